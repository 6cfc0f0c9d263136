/* pd_linear's bfloat16 (dtype 1) on AMX tiles (Intel Sapphire Rapids and later, where the kernel grants
 * the tile state): TDPBF16PS.
 *
 * A tile multiply does 16 x 16 x 32 multiply-adds on a unit beside the vector ones: on the 2-core
 * Sapphire Rapids VM, 460-490 G a second at K = 32 against VDPBF16PS's 68 G (register-only loops, one
 * core), and SmolLM2's projections at 512 rows ran at 560-800 GFLOP/s against 71-74 on VDPBF16PS.
 *
 * TDPBF16PS adds a tile's 32 inputs into an output in an order of its own (neither VDPBF16PS's pairs
 * odd-first nor even-first: measured), the same for every row of a tile. So on a CPU that runs it, every
 * row of every dtype 1 call goes through the tiles, whatever the batch: a row alone is padded to a tile
 * of 16 rows with zeros, a short last step of the inputs (K not a multiple of 32) padded with zero
 * inputs and weights. Each output is then the same chain of tile steps over its inputs, from the first
 * 32 to the last, whatever else is in the call; the results differ in their last bits from the
 * VDPBF16PS path's, which the same build takes only where the tiles are not granted.
 *
 * Not for W4A8 (dtypes 14 and 15): a group's integer sums by TDPBSUD are exact, but the float32 steps
 * that scale each group's sums bound that kernel, and a build that took whole tiles of 16 rows through
 * TDPBSUD ran no faster than VPDPBUSD (SmolLM2's 3072 x 576 projection at 512 rows: 7.5 ms both).
 *
 * Included by linear_cpu.c after job_t (pairs_of, COLS, ROW_BLOCK).
 */
#ifndef PDFABRIC_LINEAR_AMX_H
#define PDFABRIC_LINEAR_AMX_H

#include "cpu_amx.h"

#ifdef HAVE_AMX
#define AMX_ROWS 16 /* rows a tile */

/* Loads this thread's tile configuration: all eight tiles 16 rows of 64 bytes. Tile 0 holds a step of
 * the rows (16 rows x 32 inputs), 1 to 3 a step of the weights (16 pairs x 16 columns), 4 to 7 the sums
 * of 16 rows by 64 columns. */
static inline void amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

/* bfloat16 rows [block * ROW_BLOCK, +ROW_BLOCK) against panel p (bfloat16 pairs, 256 bytes a pair of
 * inputs) into acc (row stride COLS): tiles of 16 rows by 16 columns, steps of 16 pairs of inputs. */
static void amx_item_bf16(const job_t *j, int64_t block, int64_t p, float *acc) {
    const int64_t kp = pairs_of(j->k), whole = j->k / 32; /* steps that need no padding */
    const int64_t steps = (kp + 15) / 16;
    const int64_t start = block * ROW_BLOCK, end = start + ROW_BLOCK < j->m ? start + ROW_BLOCK : j->m;
    const uint16_t *panel = (const uint16_t *)j->packed + p * kp * COLS * 2;
    uint16_t a[AMX_ROWS * 32] __attribute__((aligned(64)));     /* a padded step of the rows */
    uint16_t b[4 * 16 * 32] __attribute__((aligned(64)));       /* the padded last step of the weights */
    amx_configure();
    for (int64_t r0 = start; r0 < end; r0 += AMX_ROWS) {
        const int rows = end - r0 < AMX_ROWS ? (int)(end - r0) : AMX_ROWS;
        const uint16_t *x = (const uint16_t *)j->x + r0 * j->x_stride;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        if (rows < AMX_ROWS) memset(a, 0, sizeof a); /* the rows past the call's stay zero */
        for (int64_t s = 0; s < steps; s++) {
            if (rows == AMX_ROWS && s < whole) {
                _tile_loadd(0, x + 32 * s, j->x_stride * 2);
            } else {
                const int64_t live = j->k - 32 * s < 32 ? j->k - 32 * s : 32;
                if (live < 32) memset(a, 0, sizeof a);
                for (int r = 0; r < rows; r++) memcpy(a + 32 * r, x + r * j->x_stride + 32 * s, (size_t)live * 2);
                _tile_loadd(0, a, 64);
            }
            const uint16_t *w = panel + 16 * s * COLS * 2;
            int64_t w_stride = COLS * 4;
            if (r0 == start) /* the first tile of rows streams the panel: ask for it ahead, as tile_bf16 does */
                for (int i = 0; i < 16; i++) prefetch_step(w + i * COLS * 2, COLS * 4);
            if (16 * (s + 1) > kp) { /* fewer than 16 pairs left: the panel ends, pad with zero weights */
                const int64_t left = kp - 16 * s;
                memset(b, 0, sizeof b);
                for (int c = 0; c < 4; c++)
                    for (int64_t i = 0; i < left; i++) memcpy(b + (c * 16 + i) * 32, w + i * COLS * 2 + 32 * c, 64);
                w = b, w_stride = 64;
            }
            const int64_t next = w == b ? 16 * 64 : 64; /* bytes from one column block's weights to the next */
            _tile_loadd(1, (const char *)w, w_stride);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, (const char *)w + next, w_stride);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(3, (const char *)w + 2 * next, w_stride);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, (const char *)w + 3 * next, w_stride);
            _tile_dpbf16ps(7, 0, 1);
        }
        float *out = acc + (r0 - start) * COLS; /* acc holds ROW_BLOCK rows, a multiple of 16 */
        _tile_stored(4, out, COLS * 4);
        _tile_stored(5, out + 16, COLS * 4);
        _tile_stored(6, out + 32, COLS * 4);
        _tile_stored(7, out + 48, COLS * 4);
    }
    _tile_release();
}

#endif

/* Whether pd_linear uses AMX tiles: want 1 or 0 asks for them or not (where granted), -1 only reads.
 * Returns 1 when they are used from now on. For comparing the two paths; the default is on. */
int pd_linear_amx(int want) { return amx_switch(want); }

#endif
