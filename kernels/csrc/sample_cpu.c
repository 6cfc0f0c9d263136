/* The sampler's noise and its batched draws on the CPU:
 *   pd_gumbel_noise:  out[j] = G(key, ids[j])                                  (ids NULL: G(key, j))
 *   pd_gumbel_argmax: out[r] = argmax_t (scores[r][t] / temps[r] + G(keys[r], t))
 *   pd_argmax_rows:   out[r] = argmax_t scores[r][t]                             (greedy rows)
 *   pd_gumbel_top:    the same draw as pd_gumbel_argmax among row r's top-k / top-p candidates only
 * G(key, t) = -log(-log(u)) is standard Gumbel noise, u the 53 high bits of splitmix64(t * golden +
 * key) as a double in (0, 1): a function of the key and the token id alone, so a seeded draw is the
 * same in any batch and whichever candidates a row keeps. argmax of scores / temperature plus Gumbel
 * noise draws from softmax(scores / temperature) with no exponential, no sum and no second pass. Every
 * argmax here returns the first maximal index (the first NaN if a row has one), as torch.argmax does.
 *
 * The logarithm and the exponential are our own (log_poly, exp_neg), not libm's: the same operations
 * in the same order as kernels/sample_ref.py, with nothing fused (fp-contract off), and the nucleus'
 * sums are integers, so this file and the torch reference agree bit for bit and a worker without a
 * C compiler draws the same tokens.
 *
 * Plain C that the compiler vectorises; built by kernels/cpu_build.py (-O3 -march=native -fopenmp).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 512 /* tokens whose noise a row computes before scanning them */
#define LANES 16  /* partial maxima of a row */

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
static const double SQRT2 = 1.4142135623730951;
static const double LN2 = 0.6931471805599453;

/* log(x) for a positive normal double: x = 2^e * m with m in (sqrt(1/2), sqrt(2)], and
 * log(m) = 2 atanh(s), s = (m - 1) / (m + 1), as its series to s^15 (relative error below 1e-13). */
static inline double log_poly(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint64_t mant = bits & 0x000FFFFFFFFFFFFFull;
    uint64_t mbits = mant | 0x3FF0000000000000ull;
    double m;
    memcpy(&m, &mbits, sizeof m);
    const int64_t big = m > SQRT2;
    mbits = mant | ((uint64_t)(1023 - big) << 52);
    memcpy(&m, &mbits, sizeof m);
    const int64_t e = (int64_t)(bits >> 52) - 1023 + big;
    const double f = m - 1.0;
    const double s = f / (f + 2.0);
    const double z = s * s;
    double p = 1.0 / 15.0;
    p = p * z + 1.0 / 13.0;
    p = p * z + 1.0 / 11.0;
    p = p * z + 1.0 / 9.0;
    p = p * z + 1.0 / 7.0;
    p = p * z + 1.0 / 5.0;
    p = p * z + 1.0 / 3.0;
    p = p * z + 1.0;
    return (double)e * LN2 + (s * 2.0) * p;
}

/* The 53 bits u is made of: splitmix64 of the token id and the key, its high bits. */
static inline uint64_t hash_bits(uint64_t key, uint64_t id) {
    uint64_t x = id * GOLDEN + key;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (x ^ (x >> 31)) >> 11;
}

static inline float gumbel(uint64_t key, uint64_t id) {
    const double u = ((double)hash_bits(key, id) + 0.5) / 9007199254740992.0; /* 2^53 */
    return (float)-log_poly(-log_poly(u));
}

static float row_max(const float *x, int n);

static inline int is_nan_bits(uint32_t w) { return (w & 0x7FFFFFFFu) > 0x7F800000u; }

int pd_gumbel_noise(uint64_t key, const int64_t *ids, int64_t n, float *out) {
    if (n < 0) return 1;
    if (ids) {
        for (int64_t j = 0; j < n; j++) out[j] = gumbel(key, (uint64_t)ids[j]);
    } else {
        for (int64_t j = 0; j < n; j++) out[j] = gumbel(key, (uint64_t)j);
    }
    return 0;
}

/* A bound that spares most tokens their noise. A token t can reach the best value so far only if
 * G(t) >= best - x[t] =: c, and G grows with u, so only if its 53 bits k exceed the k of G = c. TAU[b]
 * is, for c = b / TAU_STEPS, that k lowered by a margin (libm's exp here, rounding); a token is drawn
 * exactly only where k > TAU[bucket of c - margin] (c rounded down to its bucket, the margin above the
 * float roundings around best: a lower bound, so the test never drops a token that could win). On average a row draws a handful of tokens exactly. */
#define TAU_STEPS 4
#define TAU_SIZE 145 /* c up to 36; G never exceeds 37.5 */

static void tau_table(uint64_t tau[TAU_SIZE]) {
    for (int b = 0; b < TAU_SIZE; b++) {
        const double k = floor(exp(-exp(-(double)b / TAU_STEPS)) * 9007199254740992.0) - 4.0;
        tau[b] = k < 0.0 ? 0 : (uint64_t)k;
    }
}

/* Whether x[0 .. n) holds a NaN (on the bits, so that the loop vectorises). */
static int has_nan(const float *x, int n) {
    const uint32_t *w = (const uint32_t *)x;
    uint32_t top = 0;
    for (int i = 0; i < n; i++) top = (w[i] & 0x7FFFFFFFu) > top ? (w[i] & 0x7FFFFFFFu) : top;
    return top > 0x7F800000u;
}

/* The row's draw, every token's noise computed: for rows the bound cannot take (a NaN, which wins; an
 * infinite score; every token masked). */
static int64_t gumbel_argmax_full(const float *row, int vocab, float t, uint64_t key) {
    float v[BLOCK];
    float best = 0.0f;
    int64_t at = -1;
    for (int base = 0; base < vocab; base += BLOCK) {
        const int n = vocab - base < BLOCK ? vocab - base : BLOCK;
        for (int j = 0; j < n; j++) v[j] = row[base + j] / t + gumbel(key, (uint64_t)(base + j));
        for (int j = 0; j < n; j++) {
            const float x = v[j];
            if (at < 0 || x > best || (x != x && best == best)) best = x, at = base + j;
        }
    }
    return at;
}

/* Row r of scores (float32 [rows, vocab], row stride `stride`, contiguous within a row) draws out[r]
 * with temperature temps[r] (> 0) and key keys[r]: from the likeliest token's value, then over blocks
 * of 64 tokens, the bound above in one vectorised pass and the exact value where it fails. Rows are
 * independent and split among `threads`. */
int pd_gumbel_argmax(const float *scores, int64_t stride, int rows, int vocab, const float *temps,
                     const uint64_t *keys, int64_t *out, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
    uint64_t tau[TAU_SIZE];
    tau_table(tau);
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = scores + (int64_t)r * stride;
        const float t = temps[r];
        const uint64_t key = keys[r];
        const float top = has_nan(row, vocab) ? NAN : row_max(row, vocab); /* t > 0 keeps the order */
        if (!(top > -INFINITY && top < INFINITY)) { /* a NaN, an infinite best, or every token masked */
            out[r] = gumbel_argmax_full(row, vocab, t, key);
            continue;
        }
        int64_t at = 0;
        while (row[at] != top) at++;
        float best = row[at] / t + gumbel(key, (uint64_t)at);
        for (int base = 0; base < vocab; base += 64) {
            const int n = vocab - base < 64 ? vocab - base : 64;
            int hit = 0;
            unsigned char maybe[64];
            /* the margin covers the rounding of best - x, of the noise and of x + noise near best */
            const float margin = 0.01f + fabsf(best) * 0x1p-20f;
            for (int j = 0; j < n; j++) {
                const float gap = best - row[base + j] / t;
                float c = gap - margin;
                c = c < 0.0f ? 0.0f : c > 40.0f ? 40.0f : c; /* -inf scores: c = +inf, clamped */
                int b = (int)(c * TAU_STEPS);
                b = b < TAU_SIZE - 1 ? b : TAU_SIZE - 1;
                const int near = gap < margin;
                maybe[j] = near || hash_bits(key, (uint64_t)(base + j)) > tau[b];
                hit |= maybe[j];
            }
            if (!hit) continue;
            for (int j = 0; j < n; j++) {
                if (!maybe[j]) continue;
                const int64_t i = base + j;
                const float v = row[i] / t + gumbel(key, (uint64_t)i);
                if (v > best || (v == best && i < at)) best = v, at = i;
            }
        }
        out[r] = at;
    }
    return 0;
}

/* The first index of row r that holds `best` (any_nan: the first NaN): each block of 64 is tested with
 * vector compares first and searched one by one only where it holds a match. */
static int64_t first_index(const float *row, int vocab, float best, int any_nan) {
    const uint32_t *words = (const uint32_t *)row;
    for (int base = 0; base < vocab; base += 4 * LANES) {
        const int end = vocab - base < 4 * LANES ? vocab : base + 4 * LANES;
        int hit = 0;
        for (int i = base; i < end; i++) hit |= any_nan ? is_nan_bits(words[i]) : row[i] == best;
        if (!hit) continue;
        for (int i = base; i < end; i++)
            if (any_nan ? is_nan_bits(words[i]) : row[i] == best) return i;
    }
    return 0;
}

/* Greedy rows of scores (float32 [rows, vocab], row stride `stride`): one vectorised pass finds each
 * row's maximum and whether it holds a NaN, a second the first index holding it. The float maximum
 * vectorises only when the compiler may ignore NaN and the sign of zero (GCC): NaN is found on the
 * bits instead, and -0 and +0 compare equal in the second pass. */
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
int pd_argmax_rows(const float *scores, int64_t stride, int rows, int vocab, int64_t *out, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * vocab >= 262144) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = scores + (int64_t)r * stride;
        const uint32_t *words = (const uint32_t *)row;
        float lanes[LANES];
        uint32_t mag[LANES]; /* the largest |x| bits: above 0x7F800000 only for a NaN */
        for (int l = 0; l < LANES; l++) lanes[l] = row[0], mag[l] = 0;
        const int whole = vocab - vocab % LANES;
        for (int i = 0; i < whole; i += LANES)
            for (int l = 0; l < LANES; l++) {
                const float x = row[i + l];
                const uint32_t m = words[i + l] & 0x7FFFFFFFu;
                lanes[l] = x > lanes[l] ? x : lanes[l];
                mag[l] = m > mag[l] ? m : mag[l];
            }
        for (int i = whole; i < vocab; i++) {
            const uint32_t m = words[i] & 0x7FFFFFFFu;
            lanes[0] = row[i] > lanes[0] ? row[i] : lanes[0];
            mag[0] = m > mag[0] ? m : mag[0];
        }
        float best = lanes[0];
        uint32_t top = 0;
        for (int l = 0; l < LANES; l++) {
            best = lanes[l] > best ? lanes[l] : best;
            top = mag[l] > top ? mag[l] : top;
        }
        out[r] = first_index(row, vocab, best, top > 0x7F800000u);
    }
    return 0;
}

/* exp(y) for y <= 0 in float, our own like log_poly (kernels/sample_ref.py's exp_ref does the same
 * operations): 2^t with t = y log2(e) = n + f, n the nearest integer, 2^f for f in [-1/2, 1/2] by its
 * Taylor series to f^7, 2^n on the exponent bits; 0 below -87. Relative error below 1e-7 near 0, a
 * few 1e-6 towards -87 (t is rounded to float). */
static inline float exp_neg(float y) {
    const float t = y * 1.44269504f;
    const float n = rintf(t);
    const float f = t - n;
    float p = 1.52527338e-5f;
    p = p * f + 1.54035304e-4f;
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    const int32_t e = ((int32_t)(n < -126.0f ? -126.0f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return y < -87.0f ? 0.0f : p * scale;
}

typedef struct {
    float e; /* exp(x - max): the unnormalised probability */
    int32_t id;
} Cand;

/* A token's mass in the nucleus' sums: e (at most 1) in units of 2^-36, truncated, so that sums are
 * exact 64-bit integers and any order of adding them gives the same. */
static inline int64_t mass(float e) { return (int64_t)(e * 68719476736.0f); }

/* Moves the nucleus of cand[0 .. n) (candidates in id order, every token whose e is at least some
 * value) to its front and returns its size: in the order e descending, ties by id, each token whose
 * predecessors' mass is below `limit` (> 0). A quickselect on e: each round splits the active range
 * into e above, equal to and below a pivot, keeping each part in id order. */
static int nucleus_select(Cand *cand, int n, int64_t limit, Cand *tmp) {
    int lo = 0, hi = n; /* cand[0 .. lo) are kept; cand[lo .. hi) is undecided */
    while (lo < hi) {
        const float a = cand[lo].e, b = cand[lo + (hi - lo) / 2].e, c = cand[hi - 1].e;
        const float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int g = 0, q = 0;
        int64_t above = 0;
        for (int i = lo; i < hi; i++) g += cand[i].e > pivot, q += cand[i].e == pivot;
        for (int i = lo, ig = 0, iq = g, il = g + q; i < hi; i++) {
            const Cand t = cand[i];
            if (t.e > pivot) tmp[ig++] = t, above += mass(t.e);
            else if (t.e == pivot) tmp[iq++] = t;
            else tmp[il++] = t;
        }
        memcpy(cand + lo, tmp, (size_t)(hi - lo) * sizeof *cand);
        if (above >= limit) { /* the nucleus ends among the tokens above the pivot */
            hi = lo + g;
            continue;
        }
        limit -= above, lo += g; /* all of them kept; then the pivot's ties by id while mass is short */
        for (int j = 0; j < q; j++, lo++) {
            if (limit <= 0) return lo;
            limit -= mass(cand[lo].e);
        }
        if (limit <= 0) return lo;
    } /* and on among the tokens below the pivot */
    return lo;
}

/* The nucleus of the row (e: 0 for tokens not candidates) into cand, with `p` the top-p: the tokens
 * with e at least a floor whose exact mass covers the limit (floors tried from the top; e is at most
 * 1), then nucleus_select among them. Returns how many are kept. */
static int nucleus(const float *e, int vocab, double p, Cand *cand, Cand *tmp) {
    int64_t total = 0;
    for (int i = 0; i < vocab; i++) total += mass(e[i]);
    int64_t limit = (int64_t)(p * (double)total);
    limit = limit < 1 ? 1 : limit > total ? total : limit;
    static const float floors[] = {0.5f, 0.25f, 0.1f, 0.03f, 0.01f, 1e-3f, 1e-4f, 1e-6f, 0.0f};
    float at = 0.0f;
    for (int f = 0; f < (int)(sizeof floors / sizeof floors[0]) - 1; f++) {
        int64_t covered = 0;
        for (int i = 0; i < vocab; i++) covered += e[i] >= floors[f] ? mass(e[i]) : 0;
        if (covered >= limit) {
            at = floors[f];
            break;
        }
    }
    const float least = at > 0x1p-36f ? at : 0x1p-36f; /* mass(e) > 0 exactly when e >= 2^-36 */
    int c = 0;
    for (int base = 0; base < vocab; base += 64) {
        const int end = vocab - base < 64 ? vocab : base + 64;
        int any = 0; /* a vectorised test of the block first */
        for (int i = base; i < end; i++) any |= e[i] >= least;
        if (!any) continue;
        for (int i = base; i < end; i++) { /* branch-free: a store every token, a step for each taken */
            cand[c].e = e[i], cand[c].id = i;
            c += e[i] >= least;
        }
    }
    return nucleus_select(cand, c, limit, tmp);
}

/* The largest of x[0 .. n) (-inf counts; no NaN): 16 lanes, which vectorise only when the compiler may
 * ignore NaN and the sign of zero (GCC), as in pd_argmax_rows. */
__attribute__((optimize("finite-math-only", "no-signed-zeros"))) static float row_max(const float *x, int n) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = x[0];
    const int whole = n - n % LANES;
    for (int i = 0; i < whole; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
    for (int i = whole; i < n; i++) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
    float m = lanes[0];
    for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    return m;
}

/* The k-th largest value of x (0 < k < vocab): a min-heap of the k largest seen, one pass. */
static float kth_largest(const float *x, int vocab, int k, float *heap) {
    for (int i = 0; i < k; i++) { /* heapify the first k, sifting each up */
        int c = i;
        heap[c] = x[i];
        while (c > 0 && heap[(c - 1) / 2] > heap[c]) {
            const float tmp = heap[c];
            heap[c] = heap[(c - 1) / 2], heap[(c - 1) / 2] = tmp, c = (c - 1) / 2;
        }
    }
    for (int i = k; i < vocab; i++) {
        if (i % 64 == 0 && i + 64 <= vocab) { /* a vectorised test of the next 64 first */
            int any = 0;
            for (int j = i; j < i + 64; j++) any |= x[j] > heap[0];
            if (!any) {
                i += 63;
                continue;
            }
        }
        if (!(x[i] > heap[0])) continue;
        int c = 0; /* replace the smallest and sift it down */
        const float v = x[i];
        for (;;) {
            int child = 2 * c + 1;
            if (child >= k) break;
            if (child + 1 < k && heap[child + 1] < heap[child]) child++;
            if (!(heap[child] < v)) break;
            heap[c] = heap[child], c = child;
        }
        heap[c] = v;
    }
    return heap[0];
}

/* Row r of scores draws among its candidates: with top_ks[r] = k > 0 the tokens whose scaled score
 * x = score / temps[r] is at least the k-th largest (ties kept); then with top_ps[r] < 1 the
 * nucleus: by e = exp_neg(x - max) in descending order (ties by id), each token whose predecessors'
 * mass is below top_p times the candidates' total (masses: `mass`, exact integers; a token of mass 0
 * is never kept). The draw is argmax(x + G(keys[r], t)) over what is kept, ties to the
 * lower id. A row whose largest score is not finite (a NaN, +inf, every token masked) draws as
 * pd_gumbel_argmax does. Scratch per thread: two rows of floats and two of candidates. */
int pd_gumbel_top(const float *scores, int64_t stride, int rows, int vocab, const float *temps,
                  const int32_t *top_ks, const double *top_ps, const uint64_t *keys, int64_t *out, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *x = malloc((size_t)vocab * sizeof *x), *e = malloc((size_t)vocab * sizeof *e);
        Cand *cand = malloc((size_t)vocab * sizeof *cand), *tmp = malloc((size_t)vocab * sizeof *tmp);
        if (!x || !e || !cand || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            if (!x || !e || !cand || !tmp) continue;
            const float *row = scores + (int64_t)r * stride;
            const float t = temps[r];
            for (int i = 0; i < vocab; i++) x[i] = row[i] / t;
            const float m = has_nan(x, vocab) ? NAN : row_max(x, vocab);
            if (!(m > -INFINITY && m < INFINITY)) { /* a NaN, an infinite score, every token masked */
                out[r] = gumbel_argmax_full(row, vocab, t, keys[r]);
                continue;
            }
            const int k = top_ks[r] > 0 && top_ks[r] < vocab ? top_ks[r] : 0;
            const float kth = k ? kth_largest(x, vocab, k, e) : -INFINITY; /* e: the heap's room */
            int kept; /* cand[0 .. kept) are drawn among */
            if (top_ps[r] < 1.0) {
                for (int i = 0; i < vocab; i++) e[i] = x[i] >= kth ? exp_neg(x[i] - m) : 0.0f;
                kept = nucleus(e, vocab, top_ps[r], cand, tmp);
            } else {
                kept = 0;
                for (int base = 0; base < vocab; base += 64) {
                    const int end = vocab - base < 64 ? vocab : base + 64;
                    int any = 0; /* a vectorised test of the block first */
                    for (int i = base; i < end; i++) any |= x[i] >= kth;
                    if (!any) continue;
                    for (int i = base; i < end; i++) {
                        cand[kept].id = i;
                        kept += x[i] >= kth;
                    }
                }
            }
            /* the noise of every kept token first (a loop the compiler vectorises), then the scan */
            const uint64_t key = keys[r];
            for (int j = 0; j < kept; j++) e[j] = gumbel(key, (uint64_t)(uint32_t)cand[j].id);
            float best = -INFINITY;
            int64_t at = cand[0].id;
            for (int j = 0; j < kept; j++) {
                const int id = cand[j].id;
                const float v = x[id] + e[j];
                if (v > best || (v == best && id < at)) best = v, at = id;
            }
            out[r] = at;
        }
        free(x), free(e), free(cand), free(tmp);
    }
    return failed ? 2 : 0;
}
