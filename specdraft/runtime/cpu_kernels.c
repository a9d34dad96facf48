/* Fused bf16 kernels for decoding and verification on CPU (see cpu_kernels.py for why they exist).
 *
 * Every kernel computes each token row with the same sequence of floating-point operations whatever the
 * number of rows in the call: a token verified in a block of K gets the bits it would get decoded alone.
 * bf16 values are stored as uint16; arithmetic is fp32 with explicit FMAs (the file is built with
 * -ffp-contract=off so the compiler adds none of its own), and results are rounded to bf16 once.
 *
 * Layouts are row-major and contiguous: activations [rows, features], weights [out, in] as in nn.Linear,
 * the KV cache of one layer [slots, kv_heads, max_len, head_dim].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define SD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SD_AVX2 1
#endif

typedef uint16_t bf16;

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline float bf2f(bf16 v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

/* Round to nearest even, NaN stays NaN: what torch does when casting fp32 to bf16. */
static inline bf16 f2bf(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((c.u >> 16) | 0x40u);
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

int sd_has_avx512(void) {
#ifdef SD_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Which code path the linear layers were built for: 3 AVX512-BF16, 2 AVX-512, 1 AVX2 + FMA, 0 portable C. */
int sd_simd_level(void) {
#if defined(__AVX512BF16__)
    return 3;
#elif defined(SD_AVX512)
    return 2;
#elif defined(SD_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* ---- dot products in a fixed 16-lane order -------------------------------------------------------- */

#define LANES 16

#ifdef SD_AVX512
static inline __m512 load_bf16x16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* q (fp32) . k (bf16) over D, a multiple of 16. */
static inline float dot_f32_bf16(const float *q, const bf16 *k, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += LANES) acc = _mm512_fmadd_ps(load_bf16x16(k + d), _mm512_loadu_ps(q + d), acc);
    return _mm512_reduce_add_ps(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float reduce_lanes(float *acc) {
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    return acc[0];
}

/* The 16 lanes of the portable loop below as two 8-lane halves, lo (lanes 0-7) and hi (8-15): the same FMAs,
 * and the same reduction (lanes l += l + 8, then l += l + 4, l += l + 2, l += l + 1). */
static inline float dot_f32_bf16(const float *q, const bf16 *k, int64_t D) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += LANES) {
        const __m256i kw = _mm256_loadu_si256((const __m256i *)(k + d));
        const __m256i klo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(kw));
        const __m256i khi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(kw, 1));
        lo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(klo, 16)), _mm256_loadu_ps(q + d), lo);
        hi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(khi, 16)), _mm256_loadu_ps(q + d + 8), hi);
    }
    const __m256 v = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
static inline float reduce_lanes(float *acc) {
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    return acc[0];
}

static inline float dot_f32_bf16(const float *q, const bf16 *k, int64_t D) {
    float acc[LANES] = {0};
    for (int64_t d = 0; d < D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(bf2f(k[d + l]), q[d + l], acc[l]);
    return reduce_lanes(acc);
}
#endif

/* Weights are streamed once per call; prefetching this many 4-row tiles ahead hides DRAM latency at the start
 * of each (small) matrix, where the hardware prefetcher has not ramped up yet. */
int sd_prefetch_tiles = 2;

/* NB weight rows times MB input rows (x has row stride K). Each (weight row, input row) pair gets its own
 * accumulator, updated over k in order and reduced by the same sequence: the tile shape changes no bits. */
#if defined(__AVX512BF16__)
#define X_IS_BF16 1
/* AVX512-BF16: 32 bf16 products per instruction, pairwise summed into fp32; K a multiple of 32. */
static inline __attribute__((always_inline)) void dot_tile(const bf16 *w, const bf16 *x, int64_t K, int nb,
                                                           int mb, int64_t pf, float *res) {
    __m512 acc[4][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh xv[4];
        for (int j = 0; j < mb; j++) xv[j] = (__m512bh)_mm512_loadu_si512((const void *)(x + j * K + k));
        for (int i = 0; i < nb; i++) {
            _mm_prefetch((const char *)(w + i * K + k + pf), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + i * K + k));
            for (int j = 0; j < mb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) res[i * mb + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
#define X_IS_BF16 0
#endif

/* The same tile with fp32 FMAs, for weights widened to fp32 from bf16 or from int8 (`int8`, a constant at
 * every call site, so the compiler emits one specialized loop per case). x is fp32. */
#ifdef SD_AVX512
static inline __m512 load_i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __attribute__((always_inline)) void dot_tile_wide(const void *w, const float *x, int64_t K, int nb,
                                                                int mb, int64_t pf, float *res, int int8) {
    __m512 acc[4][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        __m512 xv[4];
        for (int j = 0; j < mb; j++) xv[j] = _mm512_loadu_ps(x + j * K + k);
        for (int i = 0; i < nb; i++) {
            __m512 wv;
            if (int8) {
                const int8_t *wi = (const int8_t *)w + i * K + k;
                if ((k & 63) == 0) _mm_prefetch((const char *)(wi + pf), _MM_HINT_T0);
                wv = load_i8x16(wi);
            } else {
                const bf16 *wi = (const bf16 *)w + i * K + k;
                if ((k & 31) == 0) _mm_prefetch((const char *)(wi + pf), _MM_HINT_T0);
                wv = load_bf16x16(wi);
            }
            for (int j = 0; j < mb; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) res[i * mb + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#elif defined(SD_AVX2)
/* AVX2 + FMA (e.g. AMD Zen 2/3): 8 fp32 lanes per accumulator, summed in a fixed order. The tile shape never
 * changes a result: each (weight row, input row) pair has its own accumulator, updated in k order.
 *
 * Tile shapes (see tile_rows and input_chunk below), chosen for the 16 ymm registers: nb * mb accumulators,
 * nb widened weight vectors and one input vector. Widening 8 bf16 weights costs two vector instructions on
 * the ports the FMAs need too, so the more input rows share each widened weight the closer a verification
 * block gets to the FMA peak: 2 weight rows x up to 6 input rows (15 registers) from 4 input rows on, each
 * weight tile being widened once per chunk of 6 rows. One input row (decoding, memory-bound) takes 8 weight
 * rows, 8 independent FMA chains, 8 weight streams in flight. With bf16 weights, blocks of 4 rows and more go
 * to the panel tiles below (3 weight rows x up to 4 input rows); the int8 draft keeps these. */
#define MB_MAX 6    /* input rows per tile, from 4 input rows on */
#define NB_VERIFY 2 /* weight rows per tile, from 4 input rows on */
#define NB_DECODE 8

static inline __m256 load_bf16x8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* Every loop over the tile is unrolled completely (nb, mb are constants at each call site): an accumulator
 * array the compiler cannot scalarize is kept on the stack, and the spills, not the FMAs, set the pace. The k
 * loop steps 16 (K is a multiple of 16) with one prefetch per weight row and step, no branch inside. */
static inline __attribute__((always_inline)) void dot_tile_wide(const void *w, const float *x, int64_t K, int nb,
                                                                int mb, int64_t pf, float *res, int int8) {
    __m256 acc[NB_DECODE][MB_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) {
            if (int8) {
                if ((k & 63) == 0) _mm_prefetch((const char *)((const int8_t *)w + i * K + k + pf), _MM_HINT_T0);
            } else {
                _mm_prefetch((const char *)((const bf16 *)w + i * K + k + pf), _MM_HINT_T0);
            }
        }
#pragma GCC unroll 2
        for (int64_t s = k; s < k + 16; s += 8) {
            __m256 wv[NB_DECODE];
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++)
                wv[i] = int8 ? load_i8x8((const int8_t *)w + i * K + s) : load_bf16x8((const bf16 *)w + i * K + s);
#pragma GCC unroll 8
            for (int j = 0; j < mb; j++) {
                const __m256 xv = _mm256_loadu_ps(x + j * K + s);
#pragma GCC unroll 8
                for (int i = 0; i < nb; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) res[i * mb + j] = sum8(acc[i][j]);
}

/* Verification blocks (from 4 input rows on): tiles of 3 weight rows x up to 4 input rows, 12 accumulators, the
 * 3 widened weight vectors and one input vector: all 16 ymm registers, 7 loads per 12 FMAs. The first chunk of
 * input rows widens the 3 weight rows from bf16 and (when more chunks follow) stores them, exactly, as fp32 into
 * a per-thread panel that stays in L1; the next chunks read the panel, with no widening at all. Each pair keeps
 * its accumulator updated in k order and reduced by sum8, as in dot_tile_wide: the same bits. */
#define NB_PANEL 3
#define MB_PANEL 4
#define PANEL_BLOCK 24 /* output features per work-shared block: a multiple of NB_PANEL */

enum { PANEL_NONE, PANEL_STORE, PANEL_READ };

static inline __attribute__((always_inline)) void dot_tile_panel(const bf16 *w, float *panel, const float *x,
                                                                 int64_t K, int nb, int mb, int mode, int64_t pf,
                                                                 float *res) {
    __m256 acc[NB_PANEL][MB_PANEL];
#pragma GCC unroll 4
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 4
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (mode != PANEL_READ) {
#pragma GCC unroll 4
            for (int i = 0; i < nb; i++) _mm_prefetch((const char *)(w + i * K + k + pf), _MM_HINT_T0);
        }
#pragma GCC unroll 2
        for (int64_t s = k; s < k + 16; s += 8) {
            __m256 wv[NB_PANEL];
#pragma GCC unroll 4
            for (int i = 0; i < nb; i++) {
                if (mode == PANEL_READ) {
                    wv[i] = _mm256_loadu_ps(panel + i * K + s);
                } else {
                    wv[i] = load_bf16x8(w + i * K + s);
                    if (mode == PANEL_STORE) _mm256_storeu_ps(panel + i * K + s, wv[i]);
                }
                __asm__("" : "+x"(wv[i])); /* held in a register for the mb FMAs */
            }
#pragma GCC unroll 4
            for (int j = 0; j < mb; j++) {
                __m256 xv = _mm256_loadu_ps(x + j * K + s);
                __asm__("" : "+x"(xv)); /* one load per input vector, not one folded into each FMA */
#pragma GCC unroll 4
                for (int i = 0; i < nb; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 4
        for (int j = 0; j < mb; j++) res[i * mb + j] = sum8(acc[i][j]);
}

/* The 3 x 4 tile reading the panel, the bulk of a verification block's FMAs, in assembly: compilers spill
 * some of the 16 registers it needs. The same operations as dot_tile_panel (vfmadd231ps acc += w * x, one per
 * pair and 8 k), in the same order. */
#define SD_FMA12(O)                                                                                        \
    "vmovups " O "(%[x0],%[k],4), %%ymm15\n\t"                                                               \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm0\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm4\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n\t"                                                              \
    "vmovups " O "(%[x1],%[k],4), %%ymm15\n\t"                                                               \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm1\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm5\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n\t"                                                              \
    "vmovups " O "(%[x2],%[k],4), %%ymm15\n\t"                                                               \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm2\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm6\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm14, %%ymm10\n\t"                                                             \
    "vmovups " O "(%[x3],%[k],4), %%ymm15\n\t"                                                               \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm3\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm7\n\t"                                                              \
    "vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n\t"
#define SD_ZERO12                                                                                          \
    "vxorps %%xmm0, %%xmm0, %%xmm0\n\tvxorps %%xmm1, %%xmm1, %%xmm1\n\tvxorps %%xmm2, %%xmm2, %%xmm2\n\t"       \
    "vxorps %%xmm3, %%xmm3, %%xmm3\n\tvxorps %%xmm4, %%xmm4, %%xmm4\n\tvxorps %%xmm5, %%xmm5, %%xmm5\n\t"       \
    "vxorps %%xmm6, %%xmm6, %%xmm6\n\tvxorps %%xmm7, %%xmm7, %%xmm7\n\tvxorps %%xmm8, %%xmm8, %%xmm8\n\t"       \
    "vxorps %%xmm9, %%xmm9, %%xmm9\n\tvxorps %%xmm10, %%xmm10, %%xmm10\n\tvxorps %%xmm11, %%xmm11, %%xmm11\n\t"
#define SD_SAVE12                                                                                          \
    "vmovups %%ymm0, (%[acc])\n\tvmovups %%ymm1, 32(%[acc])\n\tvmovups %%ymm2, 64(%[acc])\n\t"                 \
    "vmovups %%ymm3, 96(%[acc])\n\tvmovups %%ymm4, 128(%[acc])\n\tvmovups %%ymm5, 160(%[acc])\n\t"             \
    "vmovups %%ymm6, 192(%[acc])\n\tvmovups %%ymm7, 224(%[acc])\n\tvmovups %%ymm8, 256(%[acc])\n\t"            \
    "vmovups %%ymm9, 288(%[acc])\n\tvmovups %%ymm10, 320(%[acc])\n\tvmovups %%ymm11, 352(%[acc])\n\t"          \
    "vzeroupper\n\t"
#define SD_CLOBBER12                                                                                       \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
        "xmm13", "xmm14", "xmm15", "cc", "memory"

/* Reads the 3 rows of the panel. */
static void dot_panel_3x4(const float *panel, const float *x, int64_t K, float *res) {
    float acc[12 * 8]; /* pair (i, j) at acc[(i * 4 + j) * 8]; in ymm(i * 4 + j) inside the loop */
    const float *p0 = panel, *p1 = panel + K, *p2 = panel + 2 * K;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    int64_t k = 0;
#define SD_LOAD3(O)                                                                                        \
    "vmovups " O "(%[p0],%[k],4), %%ymm12\n\tvmovups " O "(%[p1],%[k],4), %%ymm13\n\t"                        \
    "vmovups " O "(%[p2],%[k],4), %%ymm14\n\t"
    __asm__ volatile(SD_ZERO12 "1:\n\t" SD_LOAD3("0") SD_FMA12("0") SD_LOAD3("32") SD_FMA12("32")
                     "addq $16, %[k]\n\t"
                     "cmpq %[K], %[k]\n\t"
                     "jl 1b\n\t" SD_SAVE12
                     : [k] "+r"(k)
                     : [acc] "r"(acc), [p0] "r"(p0), [p1] "r"(p1), [p2] "r"(p2), [x0] "r"(x0), [x1] "r"(x1),
                       [x2] "r"(x2), [x3] "r"(x3), [K] "m"(K)
                     : SD_CLOBBER12);
#undef SD_LOAD3
    for (int i = 0; i < 12; i++) res[i] = sum8(_mm256_loadu_ps(acc + 8 * i));
}

/* Widens the 3 weight rows from bf16 as it goes and stores them into the panel for the next chunks. Prefetches
 * run over the rows from pf weights ahead (4 rows' worth of lines per tile of 3: some are fetched twice). */
static void dot_panel_3x4_widen(const bf16 *w, float *panel, const float *x, int64_t K, int64_t pf, float *res) {
    float acc[12 * 8];
    const bf16 *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *wpf = w + pf;
    float *p0 = panel, *p1 = panel + K, *p2 = panel + 2 * K;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    int64_t k = 0;
#define SD_WIDEN3(O, OW)                                                                                   \
    "vpmovzxwd " OW "(%[w0],%[k],2), %%ymm12\n\tvpslld $16, %%ymm12, %%ymm12\n\t"                             \
    "vmovups %%ymm12, " O "(%[p0],%[k],4)\n\t"                                                               \
    "vpmovzxwd " OW "(%[w1],%[k],2), %%ymm13\n\tvpslld $16, %%ymm13, %%ymm13\n\t"                             \
    "vmovups %%ymm13, " O "(%[p1],%[k],4)\n\t"                                                               \
    "vpmovzxwd " OW "(%[w2],%[k],2), %%ymm14\n\tvpslld $16, %%ymm14, %%ymm14\n\t"                             \
    "vmovups %%ymm14, " O "(%[p2],%[k],4)\n\t"
    __asm__ volatile(SD_ZERO12 "1:\n\t"
                     "prefetcht0 (%[wpf],%[k],8)\n\tprefetcht0 64(%[wpf],%[k],8)\n\t"
                     SD_WIDEN3("0", "0") SD_FMA12("0") SD_WIDEN3("32", "16") SD_FMA12("32")
                     "addq $16, %[k]\n\t"
                     "cmpq %[K], %[k]\n\t"
                     "jl 1b\n\t" SD_SAVE12
                     : [k] "+r"(k)
                     : [acc] "r"(acc), [w0] "r"(w0), [w1] "r"(w1), [w2] "r"(w2), [p0] "r"(p0), [p1] "r"(p1),
                       [p2] "r"(p2), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [wpf] "r"(wpf),
                       [K] "m"(K)
                     : SD_CLOBBER12);
#undef SD_WIDEN3
    for (int i = 0; i < 12; i++) res[i] = sum8(_mm256_loadu_ps(acc + 8 * i));
}

#define PANEL_CASE(NB, MB)                                                                                 \
    case NB * 8 + MB:                                                                                      \
        if (mode == PANEL_READ)                                                                            \
            dot_tile_panel(w, panel, x, K, NB, MB, PANEL_READ, pf, res);                                   \
        else if (mode == PANEL_STORE)                                                                      \
            dot_tile_panel(w, panel, x, K, NB, MB, PANEL_STORE, pf, res);                                  \
        else                                                                                               \
            dot_tile_panel(w, panel, x, K, NB, MB, PANEL_NONE, pf, res);                                   \
        break;

static void panel_tile(const bf16 *w, float *panel, const float *x, int64_t K, int nb, int mb, int mode,
                       int64_t pf, float *res) {
    if (nb == 3 && mb == 4 && K > 0 && mode != PANEL_NONE) {
        if (mode == PANEL_READ)
            dot_panel_3x4(panel, x, K, res);
        else
            dot_panel_3x4_widen(w, panel, x, K, pf, res);
        return;
    }
    switch (nb * 8 + mb) {
        PANEL_CASE(1, 1) PANEL_CASE(1, 2) PANEL_CASE(1, 3) PANEL_CASE(1, 4)
        PANEL_CASE(2, 1) PANEL_CASE(2, 2) PANEL_CASE(2, 3) PANEL_CASE(2, 4)
        PANEL_CASE(3, 1) PANEL_CASE(3, 2) PANEL_CASE(3, 3) PANEL_CASE(3, 4)
        default: abort();
    }
}
#define HAVE_PANEL 1

/* Weight rows per tile for M input rows (at most 16: tiles stay inside one work-shared block of 16). */
static inline int tile_rows(int64_t M) { return M == 1 ? NB_DECODE : M == 2 ? 4 : M == 3 ? 3 : NB_VERIFY; }

/* Input rows of the chunk starting at row m: ceil(M / MB_MAX) chunks of near-equal size (7 rows go as 4 + 3,
 * never 6 + 1, whose single row would leave the FMAs waiting on 2 chains). */
static inline int input_chunk_of(int64_t M, int64_t m, int64_t most) {
    const int64_t chunks = (M + most - 1) / most, base = M / chunks, extra = M % chunks;
    /* the first `extra` chunks take base + 1 rows */
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

static inline int input_chunk(int64_t M, int64_t m) { return input_chunk_of(M, m, MB_MAX); }

#define TILE_SWITCH(FN, W, X)                                                                              \
    switch (nb * 8 + mb) {                                                                                 \
        case 8 + 1: FN(W, X, K, 1, 1, pf, res); break;                                                     \
        case 8 + 2: FN(W, X, K, 1, 2, pf, res); break;                                                     \
        case 8 + 3: FN(W, X, K, 1, 3, pf, res); break;                                                     \
        case 8 + 4: FN(W, X, K, 1, 4, pf, res); break;                                                     \
        case 8 + 5: FN(W, X, K, 1, 5, pf, res); break;                                                     \
        case 8 + 6: FN(W, X, K, 1, 6, pf, res); break;                                                     \
        case 16 + 1: FN(W, X, K, 2, 1, pf, res); break;                                                    \
        case 16 + 2: FN(W, X, K, 2, 2, pf, res); break;                                                    \
        case 16 + 3: FN(W, X, K, 2, 3, pf, res); break;                                                    \
        case 16 + 4: FN(W, X, K, 2, 4, pf, res); break;                                                    \
        case 16 + 5: FN(W, X, K, 2, 5, pf, res); break;                                                    \
        case 16 + 6: FN(W, X, K, 2, 6, pf, res); break;                                                    \
        case 24 + 1: FN(W, X, K, 3, 1, pf, res); break;                                                    \
        case 24 + 2: FN(W, X, K, 3, 2, pf, res); break;                                                    \
        case 24 + 3: FN(W, X, K, 3, 3, pf, res); break;                                                    \
        case 32 + 1: FN(W, X, K, 4, 1, pf, res); break;                                                    \
        case 32 + 2: FN(W, X, K, 4, 2, pf, res); break;                                                    \
        case 64 + 1: FN(W, X, K, 8, 1, pf, res); break;                                                    \
        default: abort(); /* tile_rows and input_chunk make no other shape */                              \
    }
#else
static inline void dot_tile_wide(const void *w, const float *x, int64_t K, int nb, int mb, int64_t pf, float *res,
                                 int int8) {
    (void)pf;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float acc[LANES] = {0};
            for (int64_t k = 0; k < K; k += LANES)
                for (int l = 0; l < LANES; l++) {
                    const int64_t at = i * K + k + l;
                    const float wv = int8 ? (float)((const int8_t *)w)[at] : bf2f(((const bf16 *)w)[at]);
                    acc[l] = fmaf(wv, x[j * K + k + l], acc[l]);
                }
            res[i * mb + j] = reduce_lanes(acc);
        }
}
#endif

#if !X_IS_BF16
#define dot_tile(w, x, K, nb, mb, pf, res) dot_tile_wide(w, x, K, nb, mb, pf, res, 0)
#endif
#ifndef MB_MAX
#define MB_MAX 4 /* input rows per tile */
#endif
#ifndef NB_DECODE
#define NB_DECODE 4 /* weight rows per tile for a single input row */
#endif
#ifndef SD_AVX2
/* Other paths: tiles of up to 4 weight rows x MB_MAX input rows. */
static inline int tile_rows(int64_t M) { return M == 1 ? NB_DECODE : 4; }
static inline int input_chunk(int64_t M, int64_t m) { return M - m < MB_MAX ? (int)(M - m) : MB_MAX; }
#endif
/* int8 weights (the quantized self-draft): y[m, n] = scale[n] * sum_k q[n, k] x[m, k]. */
#define dot_tile_i8(w, x, K, nb, mb, pf, res) dot_tile_wide(w, x, K, nb, mb, pf, res, 1)

/* ---- linear layer: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) ---------------------------------------------- */

#if X_IS_BF16
typedef bf16 xin_t;
#else
typedef float xin_t;
#endif

/* Constant tile shapes let the compiler keep the accumulators in registers. */
#ifndef TILE_SWITCH
#define TILE_SWITCH(FN, W, X)                       \
    switch (nb * 4 + mb) {                          \
        case 5: FN(W, X, K, 1, 1, pf, res); break;  \
        case 6: FN(W, X, K, 1, 2, pf, res); break;  \
        case 7: FN(W, X, K, 1, 3, pf, res); break;  \
        case 8: FN(W, X, K, 1, 4, pf, res); break;  \
        case 9: FN(W, X, K, 2, 1, pf, res); break;  \
        case 10: FN(W, X, K, 2, 2, pf, res); break; \
        case 11: FN(W, X, K, 2, 3, pf, res); break; \
        case 12: FN(W, X, K, 2, 4, pf, res); break; \
        case 13: FN(W, X, K, 3, 1, pf, res); break; \
        case 14: FN(W, X, K, 3, 2, pf, res); break; \
        case 15: FN(W, X, K, 3, 3, pf, res); break; \
        case 16: FN(W, X, K, 3, 4, pf, res); break; \
        case 17: FN(W, X, K, 4, 1, pf, res); break; \
        case 18: FN(W, X, K, 4, 2, pf, res); break; \
        case 19: FN(W, X, K, 4, 3, pf, res); break; \
        default: FN(W, X, K, 4, 4, pf, res); break; \
    }
#endif

#ifdef HAVE_PANEL
/* Verification blocks with bf16 weights (see dot_tile_panel), work-shared over blocks of PANEL_BLOCK outputs. */
static void linear_panel_for(const float *x, const void *w, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                             int64_t K) {
    const int64_t pf = (int64_t)sd_prefetch_tiles * 4 * K;
    const int64_t nblocks = (N + PANEL_BLOCK - 1) / PANEL_BLOCK;
    /* this thread's panel; without one (no memory) every chunk widens the weights itself: the same bits */
    float *panel = malloc((size_t)(NB_PANEL * K) * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t n_end = (blk + 1) * PANEL_BLOCK < N ? (blk + 1) * PANEL_BLOCK : N;
        for (int64_t n = blk * PANEL_BLOCK; n < n_end;) {
            const int nb = n_end - n < NB_PANEL ? (int)(n_end - n) : NB_PANEL;
            const bf16 *wrow = (const bf16 *)w + n * K;
            for (int64_t m = 0; m < M;) {
                const int mb = input_chunk_of(M, m, MB_PANEL);
                const int mode = !panel ? PANEL_NONE : m == 0 ? PANEL_STORE : PANEL_READ;
                float res[NB_PANEL * MB_PANEL];
                panel_tile(wrow, panel, x + m * K, K, nb, mb, mode, pf, res);
                for (int i = 0; i < nb; i++)
                    for (int j = 0; j < mb; j++) {
                        float v = res[i * mb + j];
                        if (bias) v += bf2f(bias[n + i]);
                        y[(m + j) * N + n + i] = f2bf(v);
                    }
                m += mb;
            }
            n += nb;
        }
    }
    free(panel);
}
#endif

/* Work-shared over blocks of 16 output features: call inside a parallel region (or alone, serially).
 * bf16 weights read xin; int8 weights (scale != NULL, one scale per output) read x32, x widened to fp32. */
static void linear_for(const xin_t *xin, const float *x32, const void *w, const bf16 *scale, const bf16 *bias,
                       bf16 *y, int64_t M, int64_t N, int64_t K) {
    const int64_t pf = (int64_t)sd_prefetch_tiles * 4 * K;
#ifdef HAVE_PANEL
    if (!scale && M >= 4) {
        linear_panel_for(xin, w, bias, y, M, N, K);
        return;
    }
#endif
    const int64_t block = 16, nblocks = (N + block - 1) / block;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t n_end = (blk + 1) * block < N ? (blk + 1) * block : N;
        for (int64_t n = blk * block; n < n_end;) {
            /* a full tile where the block has room for one, else at most 4 rows (the block's last ones) */
            int nb = tile_rows(M);
            if (n_end - n < nb) nb = n_end - n < 4 ? (int)(n_end - n) : 4;
            for (int64_t m = 0; m < M;) {
                const int mb = input_chunk(M, m);
                float res[NB_DECODE * MB_MAX];
                if (scale) {
                    const int8_t *wrow = (const int8_t *)w + n * K;
                    if (nb > 4)
                        dot_tile_i8(wrow, x32, K, NB_DECODE, 1, pf, res);
                    else
                        TILE_SWITCH(dot_tile_i8, wrow, x32 + m * K)
                } else {
                    const bf16 *wrow = (const bf16 *)w + n * K;
                    if (nb > 4)
                        dot_tile(wrow, xin, K, NB_DECODE, 1, pf, res);
                    else
                        TILE_SWITCH(dot_tile, wrow, xin + m * K)
                }
                for (int i = 0; i < nb; i++)
                    for (int j = 0; j < mb; j++) {
                        float v = res[i * mb + j];
                        if (scale) v *= bf2f(scale[n + i]);
                        if (bias) v += bf2f(bias[n + i]);
                        y[(m + j) * N + n + i] = f2bf(v);
                    }
                m += mb;
            }
            n += nb;
        }
    }
}

static void widen(const bf16 *x, int64_t count, float *xf) {
#pragma omp single
    for (int64_t i = 0; i < count; i++) xf[i] = bf2f(x[i]);
}

/* A linear layer with bf16 or int8 (scale != NULL) weights, inside a parallel region; xf: M * K floats. */
static void linear_any(const bf16 *x, const void *w, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M,
                       int64_t N, int64_t K, float *xf) {
    if (scale || !X_IS_BF16) widen(x, M * K, xf);
    linear_for((const xin_t *)(X_IS_BF16 ? (const void *)x : (const void *)xf), xf, w, scale, bias, y, M, N, K);
}

int sd_linear_k_multiple(void) { return X_IS_BF16 ? 32 : 16; }

/* xf: scratch of M * K floats (unused, may be NULL, with AVX512-BF16). */
void sd_linear(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K,
               float *xf, int threads) {
#pragma omp parallel num_threads(threads) if (N * K > 32768)
    linear_any(x, w, NULL, bias, y, M, N, K, xf);
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------ */

/* Llama style rounds the normalized row to bf16 before scaling by w; Gemma style scales by (1 + w) in fp32:
 * the same roundings as the PyTorch modules. */
static inline void rmsnorm_row(const float *v, const bf16 *w, int64_t dim, float eps, int gemma, bf16 *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss = fmaf(v[i], v[i], ss);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) {
        if (gemma)
            out[i] = f2bf(v[i] * r * (1.0f + bf2f(w[i])));
        else
            out[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(v[i] * r)));
    }
}

/* x (the residual stream, updated in place) += [post_norm](h) when h is given; out = norm(x, w).
 * scratch: 3 * dim floats. */
static void add_rmsnorm(bf16 *x, const bf16 *h, const bf16 *post_w, const bf16 *w, bf16 *out, int64_t rows,
                        int64_t dim, float eps, int gemma, float *scratch) {
    float *v = scratch, *hv = scratch + dim;
    bf16 *hn = (bf16 *)(scratch + 2 * dim);
    for (int64_t r = 0; r < rows; r++) {
        bf16 *xr = x + r * dim;
        if (h) {
            const bf16 *hr = h + r * dim;
            if (post_w) {
                for (int64_t i = 0; i < dim; i++) hv[i] = bf2f(hr[i]);
                rmsnorm_row(hv, post_w, dim, eps, gemma, hn);
                hr = hn;
            }
            for (int64_t i = 0; i < dim; i++) xr[i] = f2bf(bf2f(xr[i]) + bf2f(hr[i]));
        }
        for (int64_t i = 0; i < dim; i++) v[i] = bf2f(xr[i]);
        rmsnorm_row(v, w, dim, eps, gemma, out + r * dim);
    }
}

/* ---- q/k norm, RoPE and the KV cache write ---------------------------------------------------------- */

/* qkv [rows, H + 2 Hkv, D] from the fused projection. Queries go to q_out [rows, H, D]; keys and values are
 * written into the cache at (slot of the row's sequence, cache_pos[row]). cos/sin [rows, D/2] in fp32
 * (rotate-half convention of Hugging Face checkpoints). scratch: 2 * D floats. */
static void rope_store(const bf16 *qkv, const bf16 *q_norm_w, const bf16 *k_norm_w, float eps, int gemma,
                       const float *cos_t, const float *sin_t, const int64_t *slots, const int64_t *cache_pos,
                       int64_t T, bf16 *k_cache, bf16 *v_cache, int64_t rows, int64_t H, int64_t Hkv, int64_t D,
                       int64_t max_len, bf16 *q_out, float *scratch) {
    const int64_t half = D / 2, heads = H + 2 * Hkv;
    float *v = scratch;
    bf16 *normed = (bf16 *)(scratch + D);
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        const int64_t slot = slots[r / T];
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            const bf16 *src = qkv + (r * heads + hh) * D;
            const bf16 *norm_w = hh < H ? q_norm_w : k_norm_w;
            if (norm_w) {
                for (int64_t i = 0; i < D; i++) v[i] = bf2f(src[i]);
                rmsnorm_row(v, norm_w, D, eps, gemma, normed);
                src = normed;
            }
            bf16 *dst = hh < H ? q_out + (r * H + hh) * D
                               : k_cache + ((slot * Hkv + (hh - H)) * max_len + cache_pos[r]) * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf2f(src[i]), b = bf2f(src[i + half]);
                dst[i] = f2bf(fmaf(a, c[i], -b * s[i]));
                dst[i + half] = f2bf(fmaf(b, c[i], a * s[i]));
            }
        }
        for (int64_t kv = 0; kv < Hkv; kv++)
            memcpy(v_cache + ((slot * Hkv + kv) * max_len + cache_pos[r]) * D,
                   qkv + (r * heads + H + Hkv + kv) * D, (size_t)D * sizeof(bf16));
    }
}

/* ---- attention over the cache --------------------------------------------------------------------------- */

/* q [B*T, H, D] -> out [B*T, H, D], work-shared over (row, head). mask [B*T, key_len] is additive fp32; keys it
 * hides (-inf) are skipped, so a token's result depends only on the keys it sees, in cache order, and not on
 * the padding or the block it was verified in. softcap > 0 applies tanh capping to the scores.
 * scratch: key_len + 2 * D floats per thread. */
static void attention_for(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *slots,
                          const float *mask, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                          int64_t max_len, int64_t key_len, float scale, float softcap, bf16 *out,
                          float *scratch) {
    const int64_t group = H / Hkv, total = B * T * H;
    float *scores = scratch, *qf = scratch + key_len, *acc = qf + D;
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < total; idx++) {
        const int64_t row = idx / H, h = idx % H, kv = h / group;
        const int64_t base = (slots[row / T] * Hkv + kv) * max_len;
        const float *m = mask + row * key_len;
        for (int64_t d = 0; d < D; d++) qf[d] = bf2f(q[idx * D + d]);
        float best = -INFINITY;
        for (int64_t j = 0; j < key_len; j++) {
            if (m[j] == -INFINITY) continue;
            float s = dot_f32_bf16(qf, k_cache + (base + j) * D, D);
            s = softcap > 0.0f ? tanhf(s * scale / softcap) * softcap : s * scale;
            s += m[j];
            scores[j] = s;
            if (s > best) best = s;
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        float total_p = 0.0f;
        if (best != -INFINITY) {
            for (int64_t j = 0; j < key_len; j++) {
                if (m[j] == -INFINITY) continue;
                const float p = expf(scores[j] - best);
                total_p += p;
                const bf16 *vr = v_cache + (base + j) * D;
                for (int64_t d = 0; d < D; d++) acc[d] = fmaf(p, bf2f(vr[d]), acc[d]);
            }
        }
        const float inv = total_p > 0.0f ? 1.0f / total_p : 0.0f;
        for (int64_t d = 0; d < D; d++) out[idx * D + d] = f2bf(acc[d] * inv);
    }
}

/* ---- gated MLP activation ------------------------------------------------------------------------------ */

/* gate_up [rows, 2I] -> out [rows, I] = act(gate) * up; act is SiLU or tanh-approximated GELU. */
static void act_mul_for(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t I, int gelu) {
    /* this thread's contiguous share of rows * I, walked by (row, feature) without a division per element */
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    const int64_t lo = rows * I * t / nt, hi = rows * I * (t + 1) / nt;
    int64_t r = lo / I, i = lo % I;
    for (int64_t idx = lo; idx < hi; idx++, i = i + 1 == I ? (r++, 0) : i + 1) {
        const float g = bf2f(gate_up[r * 2 * I + i]), u = bf2f(gate_up[r * 2 * I + I + i]);
        float a;
        if (gelu)
            a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        else
            a = g / (1.0f + expf(-g));
        out[idx] = f2bf(a * u);
    }
#pragma omp barrier
}

/* ---- the decoder layers ------------------------------------------------------------------------------ */

/* Weights of one layer (NULL where the architecture has none). Mirrored by a ctypes Structure. */
typedef struct {
    const bf16 *attn_norm, *bqkv, *q_norm, *k_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm;
    const void *wqkv, *wo, *w_gate_up, *w_down;                  /* bf16, or int8 when the scale is set */
    const bf16 *wqkv_scale, *wo_scale, *w_gate_up_scale, *w_down_scale;  /* per output feature, or NULL */
    int64_t sliding;
} sd_layer;

typedef struct {
    int64_t dim, heads, kv_heads, head_dim, inter, max_len;
    float eps, scale, softcap;
    int32_t gemma, gelu;
    const bf16 *final_norm;
} sd_model;

/* Runs layers[0 .. num_layers) with their KV caches [slots, kv_heads, max_len, head_dim] on the residual
 * stream x [B*T, dim] (updated in place) and writes the
 * final-normed hidden states to `normed` [B*T, dim]. Per-forward inputs: slot of each sequence, cache position
 * of each row, additive masks [B*T, key_len] and RoPE tables [B*T, D/2] for full and sliding-window layers.
 * One parallel region for the whole pass: threads meet at a barrier between steps instead of being woken
 * for each of them. Drafters that read the target's features (EAGLE, Medusa) ask for the residual stream
 * after chosen layers: capture_at[l] >= 0 copies it after layer l into captured[capture_at[l]] [B*T, dim]
 * (capture_at may be NULL: nothing is copied, nothing costs). Returns 0, or -1 when scratch memory could not
 * be allocated. */
int sd_forward(const sd_layer *layers, int64_t num_layers, const sd_model *mdl, bf16 *const *k_caches,
               bf16 *const *v_caches, bf16 *x, bf16 *normed,
               const int64_t *slots, const int64_t *cache_pos, const float *mask_full, const float *mask_sliding,
               int64_t key_len, const float *cos_full, const float *sin_full, const float *cos_sliding,
               const float *sin_sliding, int64_t B, int64_t T, int threads, const int64_t *capture_at,
               bf16 *captured) {
    const int64_t rows = B * T, dim = mdl->dim, H = mdl->heads, Hkv = mdl->kv_heads, D = mdl->head_dim;
    const int64_t I = mdl->inter, qkv_width = (H + 2 * Hkv) * D;
    const int64_t widest = max64(max64(qkv_width, 2 * I), dim);
    const int64_t per_thread = key_len + 3 * D + 3 * dim;
    bf16 *buf = malloc((size_t)rows * (size_t)(widest + 2 * H * D + I + dim) * sizeof(bf16));
    float *fbuf = malloc((size_t)(per_thread * threads + rows * max64(widest, I)) * sizeof(float));
    if (!buf || !fbuf) {
        free(buf);
        free(fbuf);
        return -1;
    }
    bf16 *wide = buf, *q = wide + rows * widest, *att = q + rows * H * D, *act = att + rows * H * D;
    bf16 *h = act + rows * I;
    float *xf = fbuf + per_thread * threads;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        float *scratch = fbuf + per_thread * omp_get_thread_num();
#else
        float *scratch = fbuf;
#endif
#pragma omp single
        add_rmsnorm(x, NULL, NULL, layers[0].attn_norm, normed, rows, dim, mdl->eps, mdl->gemma, scratch);
        for (int64_t l = 0; l < num_layers; l++) {
            const sd_layer *L = &layers[l];
            const float *mask = L->sliding ? mask_sliding : mask_full;
            const float *cs = L->sliding ? cos_sliding : cos_full, *sn = L->sliding ? sin_sliding : sin_full;
            const bf16 *next_norm = l + 1 < num_layers ? layers[l + 1].attn_norm : mdl->final_norm;

            linear_any(normed, L->wqkv, L->wqkv_scale, L->bqkv, wide, rows, qkv_width, dim, xf);
#pragma omp single
            rope_store(wide, L->q_norm, L->k_norm, mdl->eps, mdl->gemma, cs, sn, slots, cache_pos, T, k_caches[l],
                       v_caches[l], rows, H, Hkv, D, mdl->max_len, q, scratch);
            attention_for(q, k_caches[l], v_caches[l], slots, mask, B, T, H, Hkv, D, mdl->max_len, key_len,
                          mdl->scale, mdl->softcap, att, scratch);
            linear_any(att, L->wo, L->wo_scale, NULL, h, rows, dim, H * D, xf);
#pragma omp single
            add_rmsnorm(x, h, L->post_attn_norm, L->mlp_norm, normed, rows, dim, mdl->eps, mdl->gemma, scratch);
            linear_any(normed, L->w_gate_up, L->w_gate_up_scale, NULL, wide, rows, 2 * I, dim, xf);
            act_mul_for(wide, act, rows, I, mdl->gelu);
            linear_any(act, L->w_down, L->w_down_scale, NULL, h, rows, dim, I, xf);
#pragma omp single
            {
                add_rmsnorm(x, h, L->post_mlp_norm, next_norm, normed, rows, dim, mdl->eps, mdl->gemma, scratch);
                if (capture_at && capture_at[l] >= 0)
                    memcpy(captured + capture_at[l] * rows * dim, x, (size_t)(rows * dim) * sizeof(bf16));
            }
        }
    }
    free(buf);
    free(fbuf);
    return 0;
}
