/* The sampler's noise and its batched draws on the CPU:
 *   pd_gumbel_noise:  out[j] = G(key, ids[j])                                  (ids NULL: G(key, j))
 *   pd_gumbel_argmax: out[r] = argmax_t (scores[r][t] / temps[r] + G(keys[r], t))
 *   pd_argmax_rows:   out[r] = argmax_t scores[r][t]                             (greedy rows)
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
#include <stdint.h>
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
