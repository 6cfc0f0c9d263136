/* What the prompt kernels' pd_paged_decode_rows share (paged_prefill_cpu.c, paged_prefill_f32_cpu.c):
 * the check of a call's rows, how its work is split between threads, and per-thread scratch that
 * lives from call to call. cpu_build.py hashes this header with each kernel's source. */
#ifndef PDFABRIC_CPU_DECODE_ROWS_H
#define PDFABRIC_CPU_DECODE_ROWS_H

#include <stdint.h>
#include <stdlib.h>

/* A buffer of at least `bytes` that this thread keeps from call to call (decode rows come once a
 * layer, and a fresh allocation of this size is a fresh mapping whose pages fault in on every call);
 * NULL when it cannot grow. */
static inline void *thread_scratch(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t capacity = 0;
    if (bytes > capacity) {
        free(buffer);
        capacity = bytes + bytes / 4;
        buffer = malloc(capacity);
        if (buffer == NULL) capacity = 0;
    }
    return buffer;
}

typedef struct {
    int longest; /* the longest row's context */
    int parts;   /* work items per row: 1 (all its kv heads), or kv_heads (one each) */
    int items, threads;
} rows_plan_t;

/* Checks a call's shapes and plans it; returns 0, or 1 for bad arguments. A row's kv heads go to one
 * thread, one after the other, so its tokens' cache lines (all heads of a token lie together) come
 * from memory once; with fewer rows than threads, each head is an item. */
static inline int plan_rows(const int32_t *ctx_lens, int rows, int q_heads, int kv_heads, int head_dim,
                            int block_size, int64_t q_stride, int max_group, int threads, rows_plan_t *plan) {
    if (rows < 0 || kv_heads <= 0 || q_heads % kv_heads != 0 || q_heads / kv_heads > max_group ||
        block_size <= 0 || q_stride < (int64_t)q_heads * head_dim)
        return 1;
    plan->longest = 0;
    for (int r = 0; r < rows; r++) {
        if (ctx_lens[r] <= 0) return 1;
        if (ctx_lens[r] > plan->longest) plan->longest = ctx_lens[r];
    }
    if (threads < 1) threads = 1;
    plan->parts = rows >= threads ? 1 : kv_heads;
    plan->items = rows * plan->parts;
    plan->threads = plan->items < threads ? (plan->items > 0 ? plan->items : 1) : threads;
    return 0;
}

#endif /* PDFABRIC_CPU_DECODE_ROWS_H */
