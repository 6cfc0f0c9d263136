/* A decode step's decoder layers in one call: the per-layer sequence of kernels that the model runs
 * op by op from Python (engine/model.py), driven from C so that a step pays one call instead of about
 * a dozen torch ops and their Python per layer.
 *
 * For each layer, in the model's order and with the model's kernels (their addresses come from the
 * libraries the op-by-op path calls, so every result is the same to the bit):
 *   normed = rms_norm(x)                        pd_rms_norm        (layer_ops_cpu.c)
 *   qkv    = normed Wqkv^T + b                  pd_linear          (linear_cpu.c)
 *   rot    = rope(q and k heads of qkv)         pd_rope
 *   cache[slot] = k heads of rot, v of qkv      pd_store_kv (pd_store_kv_tiled for a tiled cache)
 *   attn   = attention of rot's q heads         pd_paged_decode_rows (paged_prefill_*cpu.c)
 *   x     += attn Wo^T + b                      pd_linear, then the residual add here
 *   normed = rms_norm(x)
 *   act    = silu(gate) * up of normed Wgu^T    pd_linear, pd_silu_mul
 *   x     += act Wdown^T                        pd_linear, the residual add
 * The residual add rounds float32(x) + float32(y) to the model dtype, as torch's in-place add does.
 * Steps whose every sequence has a few new tokens come here (engine/runner.py: DECODER_CHUNK_TOKENS at
 * most): each new token is a decode row of its sequence, attending up to itself, the step's KV written
 * first, so a position gets the bits a prompt chunk gives it.
 *
 * dtype: 0 float32, 1 bfloat16, for activations, weights and cache alike.
 */
#include <stdint.h>

#include "cpu_scalar.h"

typedef int (*rms_norm_fn)(const void *, int64_t, const void *, void *, int, int, float, int, int);
typedef int (*linear_fn)(const void *, int64_t, const void *, const void *, void *, int64_t, int64_t, int64_t,
                         int64_t, int, int);
typedef int (*rope_fn)(const void *, int64_t, const float *, const float *, void *, int, int, int, int, int);
typedef int (*silu_mul_fn)(const void *, int64_t, void *, int, int, int, int);
typedef int (*store_kv_fn)(const void *, int64_t, const void *, int64_t, void *, void *, const int64_t *, int64_t,
                           int, int, int, int);
typedef int (*store_kv_tiled_fn)(const void *, int64_t, const void *, int64_t, void *, void *, const int64_t *,
                                 int64_t, int, int, int, int, int);
typedef int (*decode_rows_fn)(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                              const int32_t *, const int32_t *, const int32_t *, void *, int, int, int, int, int,
                              float, int);

typedef struct {
    rms_norm_fn rms_norm;
    linear_fn linear;
    rope_fn rope;
    silu_mul_fn silu_mul;
    store_kv_fn store_kv;
    store_kv_tiled_fn store_kv_tiled; /* NULL unless the cache is tiled */
    decode_rows_fn decode_rows;       /* pd_paged_decode_rows, or its _tiled twin over a tiled cache */
} kernels_t;

typedef struct { /* the model's shape */
    int hidden, heads, kv_heads, head_dim, inter, block_size, dtype;
    int tiled; /* the cache is tiled (pd_store_kv_tiled): written by store_kv_tiled */
    int64_t num_slots; /* blocks x block size of each layer's cache */
    float eps, scale;
} shape_t;

typedef struct { /* one layer's weights (linears packed by pd_linear_pack) and cache */
    const void *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache;
    /* pd_linear's dtype for each linear's weights: the model dtype's, or a quantized form (2 to 13); a
     * layer may hold its linears in several (a GGUF file's mix of types) */
    int qkv_dtype, o_dtype, gate_up_dtype, down_dtype;
} layer_t;

typedef struct { /* one step: the residual stream, where each token's KV goes, the rows' context */
    void *x;     /* [rows, hidden], updated in place */
    int rows;
    const float *cos, *sin; /* [rows, head_dim] float32, sin's first half negated */
    const int64_t *slots;   /* [rows] */
    const int32_t *tables;  /* [sequences, tables_stride] block tables */
    int64_t tables_stride;
    const int32_t *row_token, *row_seq, *ctx_lens; /* [rows], as pd_paged_decode_rows reads them */
    /* scratch, each [rows, width] in the model dtype: normed (hidden), qkv ((heads + 2 kv) head_dim),
     * rot ((heads + kv) head_dim), attn (heads head_dim), proj (hidden), gate_up (2 inter), act (inter) */
    void *normed, *qkv, *rot, *attn, *proj, *gate_up, *act;
    int threads;
} step_t;

/* x[r] += y[r] for rows x width values, rounded to the dtype. */
static void add_rows(void *x, const void *y, int64_t n, int dtype) {
    if (dtype == 1) {
        uint16_t *a = x;
        const uint16_t *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    } else {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
    }
}

static int layer(const kernels_t *k, const shape_t *s, const layer_t *w, const step_t *t) {
    const int rows = t->rows, dtype = s->dtype, esize = dtype == 1 ? 2 : 4, d = s->head_dim;
    const int64_t q_width = (int64_t)s->heads * d, kv_width = (int64_t)s->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width, rot_width = q_width + kv_width;
    int status;
    if ((status = k->rms_norm(t->x, s->hidden, w->input_norm, t->normed, rows, s->hidden, s->eps, dtype, t->threads)))
        return status;
    if ((status = k->linear(t->normed, s->hidden, w->qkv, w->qkv_bias, t->qkv, qkv_width, rows, qkv_width, s->hidden,
                            w->qkv_dtype, t->threads)))
        return status;
    if ((status = k->rope(t->qkv, qkv_width, t->cos, t->sin, t->rot, rows, s->heads + s->kv_heads, d, dtype,
                          t->threads)))
        return status;
    const char *keys = (const char *)t->rot + q_width * esize, *values = (const char *)t->qkv + rot_width * esize;
    if (s->tiled)
        status = k->store_kv_tiled(keys, rot_width, values, qkv_width, w->k_cache, w->v_cache, t->slots, s->num_slots,
                                   rows, s->kv_heads, d, s->block_size, t->threads);
    else
        status = k->store_kv(keys, rot_width, values, qkv_width, w->k_cache, w->v_cache, t->slots, s->num_slots, rows,
                             (int)kv_width, esize, t->threads);
    if (status) return status;
    if ((status = k->decode_rows(t->rot, rot_width, w->k_cache, w->v_cache, t->tables, t->tables_stride, t->row_token,
                                 t->row_seq, t->ctx_lens, t->attn, rows, s->heads, s->kv_heads, d, s->block_size,
                                 s->scale, t->threads)))
        return status;
    if ((status = k->linear(t->attn, q_width, w->o, w->o_bias, t->proj, s->hidden, rows, s->hidden, q_width, w->o_dtype,
                            t->threads)))
        return status;
    add_rows(t->x, t->proj, (int64_t)rows * s->hidden, dtype);
    if ((status = k->rms_norm(t->x, s->hidden, w->post_norm, t->normed, rows, s->hidden, s->eps, dtype, t->threads)))
        return status;
    if ((status = k->linear(t->normed, s->hidden, w->gate_up, NULL, t->gate_up, 2 * (int64_t)s->inter, rows,
                            2 * (int64_t)s->inter, s->hidden, w->gate_up_dtype, t->threads)))
        return status;
    if ((status = k->silu_mul(t->gate_up, 2 * (int64_t)s->inter, t->act, rows, s->inter, dtype, t->threads)))
        return status;
    if ((status = k->linear(t->act, s->inter, w->down, NULL, t->proj, s->hidden, rows, s->hidden, s->inter, w->down_dtype,
                            t->threads)))
        return status;
    add_rows(t->x, t->proj, (int64_t)rows * s->hidden, dtype);
    return 0;
}

/* Runs layers[0 .. count) over the step. Returns 0, or the first failing kernel's status (the layers
 * after it are not run). */
int pd_decoder_layers(const kernels_t *kernels, const shape_t *shape, const layer_t *layers, int count,
                      const step_t *step) {
    if (step->rows <= 0 || count < 0 || (shape->dtype != 0 && shape->dtype != 1) ||
        (shape->tiled && kernels->store_kv_tiled == NULL))
        return 1;
    for (int i = 0; i < count; i++) {
        const int status = layer(kernels, shape, &layers[i], step);
        if (status) return status;
    }
    return 0;
}
