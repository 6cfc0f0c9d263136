/* AMX tiles (Intel Sapphire Rapids and later) as every library of kernels here asks for them: the
 * tile state granted once per process by the kernel (a library's constructor asks), a tile
 * configuration, and a switch to turn the tiles off for comparing paths. Each library that includes
 * this has its own switch (its own statics).
 *
 * HAVE_AMX is defined where the build targets AMX-BF16 and AVX512-BF16 (HAVE_AVX512_BF16 defined
 * before this is included); elsewhere amx_on() is 0.
 */
#ifndef PDFABRIC_CPU_AMX_H
#define PDFABRIC_CPU_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_AVX512_BF16)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* glibc's; unistd.h declares it only outside strict C11 */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config_t;

static int amx_granted; /* the kernel let this process use the tile state (asked once, at load) */
static int amx_wanted = 1;

__attribute__((constructor)) static void amx_ask(void) {
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static inline int amx_on(void) { return amx_granted && amx_wanted; }

/* Loads this thread's tile configuration: tile t has rows[t] rows of colsb[t] bytes. */
static inline void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = colsb[t];
    _tile_loadconfig(&cfg);
}

#else
static inline int amx_on(void) { return 0; }
static int amx_wanted = 1;
#endif

/* want 1 or 0 asks for the tiles or not (where granted), -1 only reads; returns 1 when they are used
 * from now on. */
static inline int amx_switch(int want) {
    if (want >= 0) amx_wanted = want != 0;
    return amx_on();
}

#endif
