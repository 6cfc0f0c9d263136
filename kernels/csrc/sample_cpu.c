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
 * The logarithm is our own (log_poly), not libm's: the same double operations in the same order as
 * kernels/sample_ref.py, with nothing fused (fp-contract off), so this file and the torch reference
 * agree bit for bit and a worker without a C compiler draws the same tokens.
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

static inline float gumbel(uint64_t key, uint64_t id) {
    uint64_t x = id * GOLDEN + key;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    const double u = ((double)(x >> 11) + 0.5) / 9007199254740992.0; /* 2^53 */
    return (float)-log_poly(-log_poly(u));
}

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

/* Row r of scores (float32 [rows, vocab], row stride `stride`, contiguous within a row) draws out[r]
 * with temperature temps[r] (> 0) and key keys[r]. Rows are independent and split among `threads`. */
int pd_gumbel_argmax(const float *scores, int64_t stride, int rows, int vocab, const float *temps,
                     const uint64_t *keys, int64_t *out, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = scores + (int64_t)r * stride;
        const float t = temps[r];
        const uint64_t key = keys[r];
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
 * Taylor series to f^7 (relative error below 1e-7), 2^n on the exponent bits; 0 below -87. */
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
    const int32_t e = ((int32_t)fmaxf(n, -126.0f) + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return y < -87.0f ? 0.0f : p * scale;
}

typedef struct {
    float key; /* what the candidates are ordered by, largest first */
    int32_t id;
} Cand;

static int by_key_then_id(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
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

/* The nucleus of e (0 for tokens not candidates) into cand: the tokens by e descending (ties by id)
 * while their predecessors' mass is below `limit`. It lies among the tokens with e >= some floor whose
 * mass covers the limit: floors are tried from the top (e is at most 1), every token last, and only
 * that set is sorted. Returns how many are kept. */
static int nucleus(const float *e, int vocab, double limit, Cand *cand) {
    static const float floors[] = {0.5f, 0.25f, 0.1f, 0.03f, 0.01f, 1e-3f, 1e-4f, 1e-6f, 0.0f};
    const int nfloors = (int)(sizeof floors / sizeof floors[0]);
    for (int f = 0; f < nfloors; f++) {
        if (floors[f] > 0.0f) { /* a cheap float estimate first: is the floor low enough? */
            float mass = 0.0f;
            for (int i = 0; i < vocab; i++) mass += e[i] >= floors[f] ? e[i] : 0.0f;
            if ((double)mass < limit * 0.999) continue;
        }
        int c = 0;
        for (int i = 0; i < vocab; i++) { /* branch-free: a store every token, a step for each kept */
            cand[c].key = e[i], cand[c].id = i;
            c += e[i] >= floors[f] && e[i] > 0.0f;
        }
        qsort(cand, c, sizeof *cand, by_key_then_id);
        double before = 0.0;
        int j = 0;
        for (; j < c && (j == 0 || before < limit); j++) before += (double)cand[j].key;
        if (before >= limit || floors[f] == 0.0f) return j; /* else: the estimate was short; widen */
    }
    return 0;
}

/* Row r of scores draws among its candidates: with top_ks[r] = k > 0 the tokens whose scaled score
 * x = score / temps[r] is at least the k-th largest (ties kept); then with top_ps[r] < 1 the
 * nucleus: by e = exp_neg(x - max) in descending order (ties by id), each token with e > 0 whose
 * predecessors' mass is below top_p times the candidates' total (summed in 16 double lanes, token t in lane t % 16,
 * the lanes added in order). The draw is argmax(x + G(keys[r], t)) over what is kept, ties to the
 * lower id. Scratch per thread: two rows of floats and a row of candidates. */
int pd_gumbel_top(const float *scores, int64_t stride, int rows, int vocab, const float *temps,
                  const int32_t *top_ks, const double *top_ps, const uint64_t *keys, int64_t *out, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *x = malloc((size_t)vocab * sizeof *x), *e = malloc((size_t)vocab * sizeof *e);
        Cand *cand = malloc((size_t)vocab * sizeof *cand);
        if (!x || !e || !cand) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            if (!x || !e || !cand) continue;
            const float *row = scores + (int64_t)r * stride;
            const float t = temps[r];
            float m = -INFINITY;
            for (int i = 0; i < vocab; i++) x[i] = row[i] / t;
            for (int i = 0; i < vocab; i++) m = fmaxf(m, x[i]);
            const int k = top_ks[r] > 0 && top_ks[r] < vocab ? top_ks[r] : 0;
            const float kth = k ? kth_largest(x, vocab, k, e) : -INFINITY; /* e: the heap's room */
            int kept; /* cand[0 .. kept) are drawn among */
            if (top_ps[r] < 1.0) {
                double lanes[LANES] = {0};
                for (int i = 0; i < vocab; i++) {
                    e[i] = x[i] >= kth ? exp_neg(x[i] - m) : 0.0f;
                    lanes[i % LANES] += (double)e[i];
                }
                double total = lanes[0];
                for (int l = 1; l < LANES; l++) total += lanes[l];
                kept = nucleus(e, vocab, top_ps[r] * total, cand);
            } else {
                kept = 0;
                for (int i = 0; i < vocab; i++) {
                    cand[kept].id = i;
                    kept += x[i] >= kth;
                }
            }
            float best = -INFINITY;
            int64_t at = cand[0].id;
            for (int j = 0; j < kept; j++) {
                const int id = cand[j].id;
                const float v = x[id] + gumbel(keys[r], (uint64_t)id);
                if (v > best || (v == best && id < at)) best = v, at = id;
            }
            out[r] = at;
        }
        free(x), free(e), free(cand);
    }
    return failed ? 2 : 0;
}
