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

#ifdef SD_AVX512
/* f2bf on 16 lanes, bit for bit (integer rounding, not VCVTNEPS2BF16, which flushes denormals). */
static inline __m256i f2bf_x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* x rounded to bf16 (as f2bf_x16) and widened back to fp32. */
static inline __m512 round_bf16_x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f2bf_x16(x)), 16));
}

/* e^x for x <= 0 (scores minus their maximum) on 16 lanes: 2^n p(r), r = x - n ln 2 (ln 2 in two parts),
 * p of degree 7 with Cephes expf's coefficients (relative error about 2e-7, as libm's expf). The same
 * operations on every lane: a value depends on its x alone. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* e^-87 is still a normal float; lower would be 0 anyway */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16x16_masked(const bf16 *p, __mmask16 lanes) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

/* act(g) * u on 16 lanes, SiLU or tanh-approximated GELU, through exp512 of a value <= 0: SiLU as
 * g / (1 + e^-g) (g e^g / (1 + e^g) below 0), tanh(y) as sign(y) (1 - e^-2|y|) / (1 + e^-2|y|). */
static inline __m512 act_x16(__m512 g, __m512 u, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 a;
    if (gelu) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
        const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, cube));
        const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(y)));
        const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
        const __m512 signed_th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sign));
        a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, signed_th));
    } else {
        const __m512 t = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        a = _mm512_div_ps(_mm512_mask_mul_ps(g, negative, g, t), _mm512_add_ps(one, t));
    }
    return _mm512_mul_ps(a, u);
}

/* r[i] (row i of a 16 x 16 fp32 matrix) becomes column i, in place: 64 shuffles instead of 256 scalar moves. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], _MM_SHUFFLE(2, 0, 2, 0));
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], _MM_SHUFFLE(3, 1, 3, 1));
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], _MM_SHUFFLE(2, 0, 2, 0));
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

int sd_has_avx512(void) {
#ifdef SD_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Set by sd_amx_init (AMX builds, when Linux grants the tile state). */
int sd_amx_active = 0;
int64_t sd_q_amx_rows = 48; /* GGUF panels on AMX-INT8 tiles from this many rows (linear_qp_amx_for) */
/* SD_W_Q8 panels asked for int8 activations (SD_W_X8, below: the output layer) take them where VPDPBUSD is at
 * hand; sd_amx_init turns it off where AMX-INT8 tiles take large blocks, whose Q8 products are of 16-bit
 * activations. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
int sd_q8_int8 = 1;
#else
int sd_q8_int8 = 0;
#endif

/* Which code path the linear layers take: 4 AMX tiles, 3 AVX512-BF16, 2 AVX-512, 1 AVX2 + FMA, 0 portable C. */
int sd_simd_level(void) {
    if (sd_amx_active) return 4;
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
 * accumulator, updated over k in order and reduced by the same sequence: the tile shape changes no bits.
 * (AVX-512 builds multiply bf16 weights in panels or on AMX tiles instead; see linear_panels_for.) */
#if defined(__AVX512BF16__)
#define X_IS_BF16 1 /* linear layers read bf16 inputs as they are (AVX512-BF16 dot products, AMX) */
#else
#define X_IS_BF16 0
#endif

#ifdef SD_AVX512
static inline __m512 load_i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* int8 weights (the quant:int8 draft) against fp32 inputs, 16 lanes per accumulator. Decoding and blocks of
 * 2-4 rows read the weight rows one after another, in memory order: the same accumulator per pair over k in
 * order as the tiles below (the same bits), but one sequential stream that the hardware prefetcher follows
 * instead of nb interleaved ones (on AMD Zen 4 a core then draws twice the bandwidth). */
static inline __attribute__((always_inline)) void dot_tile_i8(const int8_t *w, const float *x, int64_t K, int nb,
                                                              int mb, int64_t pf, float *res) {
    if (nb == 1 || mb == 1) {
        for (int i = 0; i < nb; i++) {
            __m512 acc[4];
            for (int j = 0; j < mb; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += LANES) {
                const __m512 wv = load_i8x16(w + i * K + k);
                for (int j = 0; j < mb; j++) acc[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * K + k), acc[j]);
            }
            for (int j = 0; j < mb; j++) res[i * mb + j] = _mm512_reduce_add_ps(acc[j]);
        }
        return;
    }
    __m512 acc[4][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        __m512 xv[4];
        for (int j = 0; j < mb; j++) xv[j] = _mm512_loadu_ps(x + j * K + k);
        for (int i = 0; i < nb; i++) {
            const int8_t *wi = w + i * K + k;
            if ((k & 63) == 0) _mm_prefetch((const char *)(wi + pf), _MM_HINT_T0);
            const __m512 wv = load_i8x16(wi);
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

#ifndef SD_AVX512
#define dot_tile(w, x, K, nb, mb, pf, res) dot_tile_wide(w, x, K, nb, mb, pf, res, 0)
/* int8 weights (the quantized self-draft): y[m, n] = scale[n] * sum_k q[n, k] x[m, k]. */
#define dot_tile_i8(w, x, K, nb, mb, pf, res) dot_tile_wide(w, x, K, nb, mb, pf, res, 1)
#endif
#ifndef MB_MAX
#define MB_MAX 4 /* input rows per tile */
#endif
#ifndef NB_DECODE
#define NB_DECODE 4 /* weight rows per tile for a single input row */
#endif
#ifdef SD_AVX512
/* AVX-512 (int8 weights): blocks of 2-4 rows take one weight row per tile (read in memory order, see
 * dot_tile_i8), longer ones tiles of 4 weight rows x up to MB_MAX input rows. */
static inline int tile_rows(int64_t M) { return M == 1 ? NB_DECODE : M <= 4 ? 1 : 4; }
static inline int input_chunk(int64_t M, int64_t m) { return M - m < MB_MAX ? (int)(M - m) : MB_MAX; }
#elif !defined(SD_AVX2)
/* Other paths: tiles of up to 4 weight rows x MB_MAX input rows. */
static inline int tile_rows(int64_t M) { return M == 1 ? NB_DECODE : 4; }
static inline int input_chunk(int64_t M, int64_t m) { return M - m < MB_MAX ? (int)(M - m) : MB_MAX; }
#endif

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

/* A tile's fp32 results res[i * mb + j] (weight row n + i, input row m + j) to y [M, N] in bf16, times the
 * per-output scale (int8 weights) and plus the bias where given. */
static inline void store_tile(const float *res, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t N,
                              int64_t n, int64_t m, int nb, int mb) {
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float v = res[i * mb + j];
            if (scale) v *= bf2f(scale[n + i]);
            if (bias) v += bf2f(bias[n + i]);
            y[(m + j) * N + n + i] = f2bf(v);
        }
}

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
                store_tile(res, NULL, bias, y, N, n, m, nb, mb);
                m += mb;
            }
            n += nb;
        }
    }
    free(panel);
}
#endif

#if X_IS_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* AMX tiles (Intel Sapphire Rapids and later). One TDPBF16PS multiplies a 16 x 32 bf16 tile of weights by a
 * 32 x 16 tile of inputs into 16 x 16 fp32 sums, so a block of up to 32 tokens costs about what one does and
 * verification is bound by reading the weights, not by arithmetic. Each output element is accumulated by the
 * hardware over k in the same order whatever the other rows and columns hold: every input row gets the same
 * bits in a block of 32 as alone, provided every bf16 linear layer of the process takes this path (decoding
 * one token included), which `sd_amx_active` decides once, at load. */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the tile state (a process-wide permission); 1 when granted: AMX is then used. */
int sd_amx_init(void) {
    sd_amx_active = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#ifdef __AMX_INT8__
    if (sd_amx_active) sd_q8_int8 = 0;
#endif
    return sd_amx_active;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Eight 16-row x 64-byte tiles: 0-3 sums (weight tile i x input tile j at 2j + i), 4-5 weights, 6-7 inputs.
 * Loaded at every call: other libraries in the process (oneDNN) configure tiles their own way. */
static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x [M, K] in the layout TDPBF16PS reads its second operand in (pairs of k interleaved across rows), one
 * block of tile_words = 16 * K / 2 words per 16 rows: block t, word kp * 16 + j = (x[16t + j, 2kp],
 * x[16t + j, 2kp + 1]); rows past M are zero. Decoding packs one row into 16, so each thread keeps a zeroed
 * buffer per input width (a layer has two: the model width and the MLP's) and rewrites only the rows it used
 * last time: packing then costs K/2 words per row instead of 8K. */
#define AMX_PACKS 4
typedef struct {
    int64_t K, rows;
    size_t words;
    uint32_t *buf;
} amx_pack;
static __thread amx_pack amx_packs[AMX_PACKS];
static __thread int amx_next_pack;

static const uint32_t *amx_pack_inputs(const bf16 *x, int64_t M, int64_t K) {
    const int64_t pairs = K / 2, mtiles = (M + 15) / 16;
    const size_t need = (size_t)(mtiles * 16 * pairs);
    amx_pack *pk = NULL;
    for (int i = 0; i < AMX_PACKS; i++)
        if (amx_packs[i].buf && amx_packs[i].K == K) pk = &amx_packs[i];
    if (!pk || pk->words < need) {
        if (!pk) {
            pk = &amx_packs[amx_next_pack];
            amx_next_pack = (amx_next_pack + 1) % AMX_PACKS;
        }
        free(pk->buf);
        pk->buf = calloc(need, sizeof(uint32_t));
        pk->K = K;
        pk->rows = 0;
        pk->words = pk->buf ? need : 0;
        if (!pk->buf) return NULL;
    }
    const uint32_t *x32 = (const uint32_t *)x;
    for (int64_t r = 0; r < (M > pk->rows ? M : pk->rows); r++) {
        uint32_t *out = pk->buf + (r / 16) * 16 * pairs + r % 16;
        if (r < M)
            for (int64_t kp = 0; kp < pairs; kp++) out[kp * 16] = x32[r * pairs + kp];
        else
            for (int64_t kp = 0; kp < pairs; kp++) out[kp * 16] = 0;
    }
    pk->rows = M;
    return pk->buf;
}

static void amx_store(int tile, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t n0, int64_t m0) {
    float sums[16 * 16]; /* sums[i * 16 + j]: weight row n0 + i, input row m0 + j */
    switch (tile) {
        case 0: _tile_stored(0, sums, 64); break;
        case 1: _tile_stored(1, sums, 64); break;
        case 2: _tile_stored(2, sums, 64); break;
        default: _tile_stored(3, sums, 64); break;
    }
    const int64_t ni = N - n0 < 16 ? N - n0 : 16, mj = M - m0 < 16 ? M - m0 : 16;
    const __mmask16 lanes = (__mmask16)((1u << ni) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(sums + 16 * i);
    transpose16(r); /* r[j]: input row m0 + j, its 16 outputs */
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n0)), 16))
                          : _mm512_setzero_ps();
    for (int64_t j = 0; j < mj; j++)
        _mm256_mask_storeu_epi16(y + (m0 + j) * N + n0, lanes, f2bf_x16(bias ? _mm512_add_ps(r[j], b) : r[j]));
}

/* y = x @ w^T (+ bias) on tiles, work-shared over pairs of 16-feature weight tiles; K a multiple of 32. Each
 * thread packs the inputs itself (they are small), so the threads never wait for one another. */
static void linear_amx_for(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                           int64_t K) {
    const int64_t mtiles = (M + 15) / 16, tile_words = 16 * (K / 2);
    const int64_t npairs = (N + 31) / 32;
    const uint32_t *packed = amx_pack_inputs(x, M, K);
    if (!packed) abort(); /* no memory for a few KB of packed inputs */
    bf16 *padded = NULL; /* the last, partial weight tile, zero-padded to 16 rows */
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t p = 0; p < npairs; p++) {
        const int64_t n0 = 32 * p, n1 = n0 + 16;
        const int two = n1 < N;
        const bf16 *w0 = w + n0 * K, *w1 = two ? w + n1 * K : NULL;
        const int64_t last = two ? n1 : n0; /* a tile with fewer than 16 rows left is read from a padded copy */
        if (N - last < 16) {
            if (!padded) padded = calloc((size_t)(16 * K), sizeof(bf16));
            if (!padded) abort();
            memcpy(padded, w + last * K, (size_t)((N - last) * K) * sizeof(bf16));
            if (two) w1 = padded; else w0 = padded;
        }
        const char *next = (const char *)(w + (n0 + 32) * K);
        for (int64_t t = 0; t < mtiles; t += 2) {
            const int second = t + 1 < mtiles;
            const uint32_t *b0 = packed + t * tile_words, *b1 = second ? b0 + tile_words : NULL;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < K; k += 32) {
                /* The next pair's 32 weight rows are contiguous: bring 1/(K/32) of them into L2 per step, in
                 * order (tile loads jump by a row, which the hardware prefetchers follow poorly; measured on
                 * Sapphire Rapids, fetching into L1 instead is slower than no prefetch at all). */
                for (int l = 0; l < 32; l++) _mm_prefetch(next + 64 * (k + l), _MM_HINT_T1);
                _tile_loadd(4, w0 + k, K * sizeof(bf16));
                _tile_loadd(6, b0 + k * 8, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(5, w1 + k, K * sizeof(bf16));
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (second) {
                    _tile_loadd(7, b1 + k * 8, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            amx_store(0, bias, y, M, N, n0, 16 * t);
            if (two) amx_store(1, bias, y, M, N, n1, 16 * t);
            if (second) {
                amx_store(2, bias, y, M, N, n0, 16 * (t + 1));
                if (two) amx_store(3, bias, y, M, N, n1, 16 * (t + 1));
            }
        }
    }
    free(padded);
}
#else
int sd_amx_init(void) { return 0; }
#endif

/* Work-shared over blocks of 16 output features: call inside a parallel region (or alone, serially).
 * bf16 weights read xin; int8 weights (scale != NULL, one scale per output) read x32, x widened to fp32. */
static void linear_for(const xin_t *xin, const float *x32, const void *w, const bf16 *scale, const bf16 *bias,
                       bf16 *y, int64_t M, int64_t N, int64_t K) {
    const int64_t pf = (int64_t)sd_prefetch_tiles * 4 * K;
#ifdef SD_AMX
    if (!scale && sd_amx_active) {
        linear_amx_for(xin, w, bias, y, M, N, K);
        return;
    }
#endif
#ifdef HAVE_PANEL
    if (!scale && M >= 4) {
        linear_panel_for(xin, w, bias, y, M, N, K);
        return;
    }
#endif
#ifdef SD_AVX512
    (void)xin;
    if (!scale) abort(); /* bf16 rows are multiplied on AMX tiles; elsewhere they come in panels */
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
#ifndef SD_AVX512
                    const bf16 *wrow = (const bf16 *)w + n * K;
                    if (nb > 4)
                        dot_tile(wrow, xin, K, NB_DECODE, 1, pf, res);
                    else
                        TILE_SWITCH(dot_tile, wrow, xin + m * K)
#endif
                }
                store_tile(res, scale, bias, y, N, n, m, nb, mb);
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

/* int8 weights with one bf16 scale per output feature (the quant:int8 draft's LM head); xf: M * K floats. */
void sd_linear_i8(const bf16 *x, const int8_t *w, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M,
                  int64_t N, int64_t K, float *xf, int threads) {
#pragma omp parallel num_threads(threads) if (N * K > 32768)
    linear_any(x, w, scale, bias, y, M, N, K, xf);
}

/* ---- dense bf16 weights in panels (AVX-512 without AMX tiles) ------------------------------------------- */

/* Why a second layout: with weights as rows, each (weight row, input row) pair sums its products in a 16-lane
 * accumulator that must be reduced across lanes at the end (for SmolLM2's K = 576, the reductions cost about
 * half as much as the multiplies), and a tile of 4 weight rows is 4 memory streams. In panels a vector holds 16
 * *outputs*: panel p, k-pair kp is PANEL (output, pair) words, lane l of the first vector holding
 * (W[PANEL p + l][2 kp], W[PANEL p + l][2 kp + 1]), and it is multiplied by one input pair broadcast to every
 * lane. Each output accumulates its pairs in k order in a lane of its own: nothing to reduce, a panel is one
 * sequential stream, each weight vector loaded serves every input row of the tile, and the operations on an
 * output are the same whatever the number of rows (row invariance by construction). Measured on an AMD Zen 4
 * (2 cores, [3072, 576]): 8 rows 0.14 ms against 0.24 ms for 4 x 4 row tiles, one row unchanged.
 *
 * Layout: bf16 [ceil(N / PANEL)][K / 2][PANEL][2]; rows of the last panel past N are zero. The AVX512-BF16
 * path multiplies the pairs with VDPBF16PS; the AVX-512 path splits them into even and odd k and runs two
 * fp32 FMAs (the CPUs whose VDPBF16PS is slow take this one, see cpu_kernels.bf16_dot_pays). */
#ifdef SD_AVX512
#define PANEL 32
#define PANEL_MB 12 /* input rows per tile: 2 x 12 accumulators, 2 weight vectors, broadcasts */

int sd_dense_panels(void) { return !sd_amx_active; }
int64_t sd_panel_width(void) { return PANEL; }

/* Input rows of the chunk starting at row m: ceil(M / most) chunks of near-equal size. */
static inline int panel_chunk(int64_t M, int64_t m) {
    const int64_t chunks = (M + PANEL_MB - 1) / PANEL_MB, base = M / chunks, extra = M % chunks;
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

/* The PANEL outputs of panel wp for mb input rows (x [mb, K] bf16 with AVX512-BF16, xf [mb, K] fp32 otherwise),
 * unrounded: acc[2 j] holds outputs 0-15 of input row j, acc[2 j + 1] outputs 16-31. While it multiplies, it
 * brings the next panel (the same offset, one panel on) into L2: once a block has more than a few rows, a
 * thread's arithmetic and its weight stream then overlap instead of alternating (a [3072, 576] layer on Zen 4:
 * 16 rows 0.18 -> 0.15 ms, 8 rows and 1 row unchanged). Past the last panel it prefetches nothing useful, and a
 * prefetch never faults. */
static inline __attribute__((always_inline)) void panel_acc(const bf16 *wp, const bf16 *x, const float *xf,
                                                            int64_t K, int mb, __m512 *acc) {
    for (int j = 0; j < 2 * mb; j++) acc[j] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
#if X_IS_BF16
    (void)xf;
    const uint32_t *xp = (const uint32_t *)x;
    for (int64_t kp = 0; kp < pairs; kp++) {
        const bf16 *wk = wp + kp * 2 * PANEL;
        _mm_prefetch((const char *)(wk + PANEL * K), _MM_HINT_T1); /* the next panel, see below */
        _mm_prefetch((const char *)(wk + PANEL * K + 32), _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wk + 32));
        for (int j = 0; j < mb; j++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[j * pairs + kp]);
            acc[2 * j] = _mm512_dpbf16_ps(acc[2 * j], w0, xb);
            acc[2 * j + 1] = _mm512_dpbf16_ps(acc[2 * j + 1], w1, xb);
        }
    }
#else
    (void)x;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < pairs; kp++) {
        const bf16 *wk = wp + kp * 2 * PANEL;
        _mm_prefetch((const char *)(wk + PANEL * K), _MM_HINT_T1);
        _mm_prefetch((const char *)(wk + PANEL * K + 32), _MM_HINT_T1);
        const __m512i v0 = _mm512_loadu_si512((const void *)wk), v1 = _mm512_loadu_si512((const void *)(wk + 32));
        const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
        const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
        const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
        const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
        for (int j = 0; j < mb; j++) {
            const __m512 xe = _mm512_set1_ps(xf[j * K + 2 * kp]), xo = _mm512_set1_ps(xf[j * K + 2 * kp + 1]);
            acc[2 * j] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, acc[2 * j]));
            acc[2 * j + 1] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, acc[2 * j + 1]));
        }
    }
#endif
}

/* A call of CALL(mb) with mb a constant: constant row counts keep the accumulators in registers. */
#define PANEL_ROWS_SWITCH(mb, CALL)    \
    switch (mb) {                      \
        case 1: CALL(1); break;        \
        case 2: CALL(2); break;        \
        case 3: CALL(3); break;        \
        case 4: CALL(4); break;        \
        case 5: CALL(5); break;        \
        case 6: CALL(6); break;        \
        case 7: CALL(7); break;        \
        case 8: CALL(8); break;        \
        case 9: CALL(9); break;        \
        case 10: CALL(10); break;      \
        case 11: CALL(11); break;      \
        default: CALL(12); break;      \
    }

/* Outputs n0 .. n0 + PANEL of mb input rows into y [mb, N] (row stride N), plus the bias, rounded to bf16 once. */
static inline __attribute__((always_inline)) void panel_tile(const bf16 *wp, const bf16 *x, const float *xf,
                                                             const bf16 *bias, bf16 *y, int64_t N, int64_t K,
                                                             int64_t n0, int mb) {
    __m512 acc[2 * PANEL_MB];
    panel_acc(wp, x, xf, K, mb, acc);
    const int64_t valid = N - n0 < PANEL ? N - n0 : PANEL;
    const __mmask16 m0 = (__mmask16)(valid >= 16 ? 0xffffu : (1u << valid) - 1);
    const __mmask16 m1 = (__mmask16)(valid >= 32 ? 0xffffu : valid <= 16 ? 0u : (1u << (valid - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = load_bf16x16_masked(bias + n0, m0);
        b1 = load_bf16x16_masked(bias + n0 + 16, m1);
    }
    for (int j = 0; j < mb; j++) {
        const __m512 s0 = bias ? _mm512_add_ps(acc[2 * j], b0) : acc[2 * j];
        const __m512 s1 = bias ? _mm512_add_ps(acc[2 * j + 1], b1) : acc[2 * j + 1];
        _mm256_mask_storeu_epi16(y + j * N + n0, m0, f2bf_x16(s0));
        if (m1) _mm256_mask_storeu_epi16(y + j * N + n0 + 16, m1, f2bf_x16(s1));
    }
}

/* How the panel loops share their panels: guided, so each thread starts on a long contiguous range (one
 * sequential stream for the prefetcher) and the ranges shrink towards the end, where a thread that got
 * ahead takes what another has not reached. With static ranges, a thread that loses its core for a moment
 * (another process, the server's event loop, a busy host) held the whole layer up at the barrier: SmolLM2
 * native beside a process taking 10% of a core, medians of 4 alternated runs, one token 4.77 -> 4.55 ms, 8
 * sequences 10.4 -> 9.5 ms; alone unchanged. Which thread computes a panel never changes its bits. */
#define PANEL_SCHEDULE schedule(guided, 2)

/* y = x @ W^T (+ bias) with W in panels, work-shared over panels (PANEL_SCHEDULE); inside a parallel region.
 * xf: x widened to fp32 (the AVX-512 path only). */
static void linear_panels_for(const bf16 *x, const float *xf, const bf16 *wp, const bf16 *bias, bf16 *y,
                              int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp for PANEL_SCHEDULE
    for (int64_t p = 0; p < panels; p++) {
        const bf16 *w = wp + p * PANEL * K;
        for (int64_t m = 0; m < M;) {
            const int mb = panel_chunk(M, m);
            const bf16 *xm = x + m * K;
            const float *xfm = xf ? xf + m * K : NULL;
            bf16 *ym = y + m * N;
#define LINEAR_TILE(R) panel_tile(w, xm, xfm, bias, ym, N, K, p * PANEL, R)
            PANEL_ROWS_SWITCH(mb, LINEAR_TILE)
#undef LINEAR_TILE
            m += mb;
        }
    }
}

static void linear_panels(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                          int64_t K, float *xf) {
    if (!X_IS_BF16) widen(x, M * K, xf);
    linear_panels_for(x, X_IS_BF16 ? NULL : xf, wp, bias, y, M, N, K);
}
#else
int sd_dense_panels(void) { return 0; }
int64_t sd_panel_width(void) { return 0; }
static void linear_panels(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                          int64_t K, float *xf) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)xf;
    abort(); /* never packed: sd_dense_panels() is 0 */
}
#endif

/* xf: scratch of M * K floats (unused, may be NULL, with AVX512-BF16). */
void sd_linear_panels(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K,
                      float *xf, int threads) {
#pragma omp parallel num_threads(threads) if (N * K > 32768)
    linear_panels(x, wp, bias, y, M, N, K, xf);
}

/* ---- GGUF-native linear layers: weights in their quantized blocks, multiplied as integers ---------------- */

/* A GGUF file's blocks are repacked once at load time (gguf_native.py) into three layouts, each a row of
 * K / E blocks per output feature, holding the file's exact values (scales as fp32, which every GGUF scale
 * and sub-scale product is exactly):
 *   SD_W_Q4  (Q4_0, Q4_1, Q4_K):  E = 32, 20 bytes: fp32 scale s, 16 bytes of nibbles (byte t holds q[t] low,
 *                                 q[t + 16] high); the row's fp32 offsets m after its blocks; w = s * q + m,
 *                                 q in 0..15.
 *   SD_W_Q8  (Q8_0, Q5_0):        E = 32, 36 bytes: fp32 scale s, 32 int8; w = s * q.
 *   SD_W_Q8H (Q6_K):              E = 16, 20 bytes: fp32 scale s, 16 int8; w = s * q.
 *
 * Activations of SD_W_Q8 and SD_W_Q8H layers enter as 16-bit integers with one power-of-two scale per block
 * of E: a = 2^e * X. With bf16 inputs (8 significant bits) X is exact for every element within a factor 2^7
 * of its block's largest, and off by at most 2^-15 of that largest otherwise: far below the bf16 rounding of
 * the layer's output. SD_W_Q4 layers (the bulk of a Q4 model) take them as int8 with a float scale per block
 * of 32, as llama.cpp does (q_quantize_input_i8): VPDPBUSD then multiplies 4 pairs per lane where VPDPWSSD
 * multiplies 2. So does an SD_W_Q8 output layer (the caller asks with SD_W_X8) on AVX512-VNNI CPUs without
 * AMX-INT8 tiles (sd_q8_int8): its signed weights become unsigned bytes q + 128 (one XOR) times the int8
 * activations, and each block's sum starts from -128 sum_i X_i, so it is sum_i q_i X_i exactly: half the
 * multiply instructions of 16-bit activations, for the error llama.cpp's Q8_0 dot products make. The output
 * layer is a fifth of a SmolLM2 row's arithmetic and over half of a Gemma 3 row's; 8-bit layers inside the
 * model keep 16 bits, where int8 errors compound through the layers (Gemma 3's top-1 agreement with fp32
 * logits: 97.0% with 16 bits everywhere, 96.7% with an int8 output layer, 95.8% with int8 inner layers;
 * scripts/gguf_accuracy.py). With d_b the block's activation scale, sum_i q_i X_i is exact in int32, and
 *     y[m, n] = sum_b s_b * (d_b * sum_i q_i X_i) + m_b * (d_b * sum_i X_i)
 * in fp32: each (weight row, input row) pair keeps one 8-lane accumulator updated block by block in k order,
 * and the offset terms are one dot product over the row's blocks in a fixed order, so a row's bits do not
 * depend on the tile or on the number of rows. */
/* Layouts of a linear layer's weights; SD_W_QPANELS | a GGUF layout: that layout's panels (below). */
enum { SD_W_DENSE = 0, SD_W_Q4 = 1, SD_W_Q8 = 2, SD_W_Q8H = 3, SD_W_PANELS = 4, SD_W_QPANELS = 8, SD_W_HALF = 16,
       SD_W_X8 = 32 /* SD_W_Q8 panels asked to take int8 activations (where sd_q8_int8) */ };
#define SD_W_GGUF 3 /* the GGUF layout bits of a panel format (SD_W_HALF: its scales as fp16) */

static inline int64_t q_block_elems(int fmt) { return (fmt & SD_W_GGUF) == SD_W_Q8H ? 16 : 32; }
/* Bytes of one block in the row's block area (SD_W_Q4 keeps its offsets apart, after the blocks). */
static inline int64_t q_block_bytes(int fmt) { return fmt == SD_W_Q4 ? 20 : fmt == SD_W_Q8 ? 36 : 20; }
static inline int64_t q_row_bytes(int fmt, int64_t K) {
    return K / q_block_elems(fmt) * (q_block_bytes(fmt) + (fmt == SD_W_Q4 ? 4 : 0));
}

int64_t sd_q_row_bytes(int fmt, int64_t K) { return q_row_bytes(fmt, K); }

#define QNB_DECODE 4 /* weight rows per tile for one input row */
int64_t sd_q_prefetch = 16; /* weight rows ahead that each block's line is prefetched from */
#define QMB_MAX 8    /* input rows per tile (one weight row) from two input rows on */

/* The activations of one call in integer form, carved from `scratch` (q_scratch_floats(M, K) floats):
 * X int16 [M, K] (SD_W_Q4, SD_W_Q8 | SD_W_X8: int8); scale [M, K / E] (d of each block); offset_in [M, K / E]
 * (int8 activations only: SD_W_Q4's d * sum X of each block, what the block's offset multiplies; SD_W_X8's
 * -128 sum X, where its integer sums start). */
typedef struct {
    int16_t *X; /* int8 [M, K] in the same memory where the activations are int8 (q_x8 below) */
    float *scale, *offset_in;
} q_input;

static inline const int8_t *q_x8(q_input in) { return (const int8_t *)in.X; }

/* Whether a layout's activations are int8 (SD_W_Q4, SD_W_Q8 | SD_W_X8), with an offset term per block. */
static inline int q_int8_input(int fmt) { return (fmt & SD_W_GGUF) == SD_W_Q4 || (fmt & SD_W_X8); }

/* The activations of rows m.. of `all` (int8 ones: a row is K bytes). */
static inline q_input q_input_from(q_input all, int fmt, int64_t m, int64_t K) {
    const int64_t nblk = K / q_block_elems(fmt & SD_W_GGUF);
    const int i8 = q_int8_input(fmt);
    const q_input in = {i8 ? (int16_t *)((int8_t *)all.X + m * K) : all.X + m * K, all.scale + m * nblk,
                        i8 ? all.offset_in + m * nblk : NULL};
    return in;
}

static inline int64_t q_scratch_floats(int64_t M, int64_t K) { return M * K / 2 + M * K / 16 + M * K / 32 + 16; }

static inline q_input q_input_at(float *scratch, int64_t M, int64_t K) {
    q_input in = {(int16_t *)scratch, scratch + M * K / 2 + 8, NULL};
    in.offset_in = in.scale + M * K / 16 + 8;
    return in;
}

/* SD_W_Q4's activations, as llama.cpp's Q8_1: per block of 32, d = amax / 127 and X = rint(x * (127 / amax))
 * as int8 (|X| <= 127), scale d, offset_in d * sum X. Nibbles (unsigned) times int8 fill VPDPBUSD's 4 products
 * per lane, twice VPDPWSSD's 2: these layers (most of a Q4 model's weights) cost half the integer
 * instructions. The error, at most d / 2 an element, is what llama.cpp's own dot products make. Blocks whose
 * largest exponent is below 2^-112 (or all zero) become zeros; inf or NaN gives a NaN scale. */
/* The largest exponent field (bf16 bits 7-14) among the E elements of a block (E a multiple of 16). */
static inline int block_max_exponent(const bf16 *xb, int64_t E) {
#ifdef SD_AVX512
    __m256i e16 = _mm256_setzero_si256(); /* the exponent field of each element, in 16-bit lanes */
    for (int64_t h = 0; h < E; h += 16)
        e16 = _mm256_max_epu16(e16, _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(xb + h)), 7),
                                                     _mm256_set1_epi16(0xFF)));
    return _mm512_reduce_max_epi32(_mm512_cvtepu16_epi32(e16));
#else
    int e_max = 0;
    for (int64_t i = 0; i < E; i++) {
        const int e = (xb[i] >> 7) & 0xFF;
        e_max = e > e_max ? e : e_max;
    }
    return e_max;
#endif
}

/* The largest |x| of a block of E finite elements (E a multiple of 16): exact, as any order of maxima is.
 * Not fmaxf: its NaN rules keep compilers from inlining it, and a library call per element cost 6% of a
 * 32-token forward. */
static inline float block_max_magnitude(const bf16 *xb, int64_t E) {
#ifdef SD_AVX512
    __m512 m = _mm512_setzero_ps();
    for (int64_t h = 0; h < E; h += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load_bf16x16(xb + h)));
    return _mm512_reduce_max_ps(m);
#else
    float amax = 0.0f;
    for (int64_t i = 0; i < E; i++) {
        const float a = fabsf(bf2f(xb[i]));
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

/* `q8`: SD_W_Q8 | SD_W_X8's offset term instead, -128 sum X (exact in fp32: |sum X| <= 32 * 127), what the sum
 * of a block's products with the weights' unsigned bytes q + 128 starts from. */
static void q_quantize_input_i8(const bf16 *x, int64_t M, int64_t K, q_input in, int q8) {
    const int64_t E = 32, blocks = M * K / E;
    int8_t *X8 = (int8_t *)in.X;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const bf16 *xb = x + b * E;
        const int e_max = block_max_exponent(xb, E);
        int32_t total = 0;
        float scale = 0.0f;
        if (e_max >= 15 && e_max < 255) {
            const float amax = block_max_magnitude(xb, E); /* no inf or NaN here: e_max < 255 */
            const float up = 127.0f / amax;
            scale = amax / 127.0f;
#ifdef SD_AVX512
            for (int64_t h = 0; h < E; h += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(xb + h), _mm512_set1_ps(up)));
                _mm_storeu_si128((__m128i *)(X8 + b * E + h), _mm512_cvtepi32_epi8(v));
                total += _mm512_reduce_add_epi32(v);
            }
#else
            for (int64_t i = 0; i < E; i++) {
                const int32_t v = (int32_t)lrintf(bf2f(xb[i]) * up);
                X8[b * E + i] = (int8_t)v;
                total += v;
            }
#endif
        } else {
            for (int64_t i = 0; i < E; i++) X8[b * E + i] = 0;
            if (e_max == 255) scale = NAN;
        }
        in.scale[b] = scale;
        in.offset_in[b] = q8 ? -128.0f * (float)total : scale * (float)total;
    }
}

/* Block by block of E: the largest exponent e_max of |x| (bf16 bits), X = rint(x * 2^(141 - e_max)) (so the
 * largest magnitudes land in [2^14, 2^15)), scale 2^(e_max - 141). Blocks whose largest is below 2^-112 (or
 * zero) become zeros; a block holding inf or NaN gets a NaN scale. Work-shared over blocks (a block's result
 * depends on its own elements only); the arithmetic is exact except for rint (to nearest even, as lrintf in the
 * default rounding mode and VCVTPS2DQ). */
static void q_quantize_input(const bf16 *x, int64_t M, int64_t K, int fmt, q_input in) {
    if (q_int8_input(fmt)) {
        q_quantize_input_i8(x, M, K, in, fmt != SD_W_Q4);
        return;
    }
    const int64_t E = q_block_elems(fmt), blocks = M * K / E;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const bf16 *xb = x + b * E;
        const int e_max = block_max_exponent(xb, E);
        int32_t total = 0;
        float scale = 0.0f;
        if (e_max >= 15 && e_max < 255) {
            uint32_t up_bits = (uint32_t)(141 - e_max + 127) << 23, down_bits = (uint32_t)(e_max - 141 + 127) << 23;
            float up, down;
            memcpy(&up, &up_bits, 4);
            memcpy(&down, &down_bits, 4);
            scale = down;
#ifdef SD_AVX512
            for (int64_t h = 0; h < E; h += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(xb + h), _mm512_set1_ps(up)));
                _mm256_storeu_si256((__m256i *)(in.X + b * E + h), _mm512_cvtepi32_epi16(v));
                total += _mm512_reduce_add_epi32(v);
            }
#else
            for (int64_t i = 0; i < E; i++) {
                const int32_t v = (int32_t)lrintf(bf2f(xb[i]) * up);
                in.X[b * E + i] = (int16_t)v;
                total += v;
            }
#endif
        } else {
            for (int64_t i = 0; i < E; i++) in.X[b * E + i] = 0;
            if (e_max == 255) scale = NAN; /* an inf or NaN input yields NaN outputs, as a float dot would */
        }
        in.scale[b] = scale;
        if (fmt == SD_W_Q4) in.offset_in[b] = scale * (float)total;
    }
}

/* Input rows of the chunk starting at row m: ceil(M / QMB_MAX) chunks of near-equal size. */
static inline int q_chunk(int64_t M, int64_t m) {
    const int64_t chunks = (M + QMB_MAX - 1) / QMB_MAX, base = M / chunks, extra = M % chunks;
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float q_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* sum_b m[b] * o[b] in a fixed order: 8 lanes over blocks, then the tail in order. */
static inline float q_offset_dot(const float *m, const float *o, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= n; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(o + b), acc);
    float sum = q_sum8(acc);
    for (; b < n; b++) sum = fmaf(m[b], o[b], sum);
    return sum;
}

/* An SD_W_Q4 block's 32 nibbles as bytes, in element order. */
static inline __m256i q4_bytes(const uint8_t *blk) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4)), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

/* An 8-bit block's integers as 16-bit lanes: q[0] = elements 0-15, q[1] = 16-31 (SD_W_Q8H: q[0] only). */
static inline __attribute__((always_inline)) void q_decode(int fmt, const uint8_t *blk, __m256i *q) {
    q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 4)));
    if (fmt == SD_W_Q8) q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 20)));
}


/* nb weight rows (stride row_bytes) x mb input rows into res[i * mb + j]. */
static inline __attribute__((always_inline)) void q_tile(int fmt, const uint8_t *w, int64_t row_bytes, q_input in,
                                                         int64_t K, int nb, int mb, float *res) {
    const int64_t E = q_block_elems(fmt), BB = q_block_bytes(fmt), nblk = K / E;
    __m256 acc[QNB_DECODE][QMB_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
#pragma GCC unroll 4
        for (int i = 0; i < nb; i++) {
            const uint8_t *blk = w + i * row_bytes + b * BB;
            _mm_prefetch((const char *)(blk + sd_q_prefetch * row_bytes), _MM_HINT_T0);
            __m256i q[2];
            if (fmt == SD_W_Q4)
                q[0] = q4_bytes(blk);
            else
                q_decode(fmt, blk, q);
            const __m256 sv = _mm256_broadcast_ss((const float *)blk);
#pragma GCC unroll 8
            for (int j = 0; j < mb; j++) {
                __m256i dot;
                if (fmt == SD_W_Q4) { /* lane l: elements 4l..4l+3 (nibble times int8: no pair saturates) */
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(q_x8(in) + j * K + b * E));
                    dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q[0], xv), _mm256_set1_epi16(1));
                } else {
                    const int16_t *xb = in.X + j * K + b * E;
                    dot = _mm256_madd_epi16(q[0], _mm256_loadu_si256((const __m256i *)xb));
                    if (fmt != SD_W_Q8H)
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(q[1], _mm256_loadu_si256((const __m256i *)(xb + 16))));
                }
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(in.scale + j * nblk + b));
                acc[i][j] = _mm256_fmadd_ps(sv, t, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) res[i * mb + j] = q_sum8(acc[i][j]);
    if (fmt == SD_W_Q4)
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < mb; j++)
                res[i * mb + j] += q_offset_dot((const float *)(w + i * row_bytes + nblk * BB),
                                                in.offset_in + j * nblk, nblk);
}
#else
/* Portable C: the same integers, lanes and order of operations as the AVX2 path. */
static inline void q_tile(int fmt, const uint8_t *w, int64_t row_bytes, q_input in, int64_t K, int nb, int mb,
                          float *res) {
    const int64_t E = q_block_elems(fmt), BB = q_block_bytes(fmt), nblk = K / E;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float acc[8] = {0};
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *blk = w + i * row_bytes + b * BB;
                const int16_t *xb = in.X + j * K + b * E;
                const int8_t *xb8 = q_x8(in) + j * K + b * E;
                float s;
                memcpy(&s, blk, 4);
                int32_t dot[8] = {0};
                for (int64_t e = 0; e < E; e++) {
                    if (fmt == SD_W_Q4)
                        dot[e / 4] += (e < 16 ? blk[4 + e] & 0x0F : blk[4 + e - 16] >> 4) * xb8[e];
                    else
                        dot[(e % 16) / 2] += ((const int8_t *)blk)[4 + e] * xb[e];
                }
                const float xs = in.scale[j * nblk + b];
                for (int l = 0; l < 8; l++) acc[l] = fmaf(s, (float)dot[l] * xs, acc[l]);
            }
            float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            if (fmt == SD_W_Q4) {
                const float *m = (const float *)(w + i * row_bytes + nblk * BB), *o = in.offset_in + j * nblk;
                for (int64_t b = 0; b < nblk; b++) sum = fmaf(m[b], o[b], sum);
            }
            res[i * mb + j] = sum;
        }
}
#endif

#define Q_TILE_CASE(FMT)                                                                               \
    switch (nb * 16 + mb) {                                                                            \
        case 16 + 1: q_tile(FMT, wrow, row_bytes, in, K, 1, 1, res); break;                           \
        case 16 + 2: q_tile(FMT, wrow, row_bytes, in, K, 1, 2, res); break;                           \
        case 16 + 3: q_tile(FMT, wrow, row_bytes, in, K, 1, 3, res); break;                           \
        case 16 + 4: q_tile(FMT, wrow, row_bytes, in, K, 1, 4, res); break;                           \
        case 16 + 5: q_tile(FMT, wrow, row_bytes, in, K, 1, 5, res); break;                           \
        case 16 + 6: q_tile(FMT, wrow, row_bytes, in, K, 1, 6, res); break;                           \
        case 16 + 7: q_tile(FMT, wrow, row_bytes, in, K, 1, 7, res); break;                           \
        case 16 + 8: q_tile(FMT, wrow, row_bytes, in, K, 1, 8, res); break;                           \
        case 32 + 1: q_tile(FMT, wrow, row_bytes, in, K, 2, 1, res); break;                           \
        case 48 + 1: q_tile(FMT, wrow, row_bytes, in, K, 3, 1, res); break;                           \
        case 64 + 1: q_tile(FMT, wrow, row_bytes, in, K, 4, 1, res); break;                           \
        default: abort(); /* linear_q_for makes no other shape */                                      \
    }

/* Work-shared over blocks of 16 output features, inside a parallel region, on q_quantize_input's `all`. */
/* Weight rows per tile: one for blocks of input rows, QNB_DECODE interleaved rows for decoding (as measured on
 * AMD Zen 3). AVX-512 builds multiply in panels instead (linear_qp_for). */
static inline int q_tile_rows(int64_t M, int64_t left) {
    return M > 1 ? 1 : left < QNB_DECODE ? (int)left : QNB_DECODE;
}

static void linear_q_for(q_input all, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                         int64_t K) {
    const int64_t row_bytes = q_row_bytes(fmt, K), block = 16;
    const int64_t nblocks = (N + block - 1) / block;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t n_end = (blk + 1) * block < N ? (blk + 1) * block : N;
        for (int64_t n = blk * block; n < n_end;) {
            const int nb = q_tile_rows(M, n_end - n);
            const uint8_t *wrow = w + n * row_bytes;
            for (int64_t m = 0; m < M;) {
                const int mb = M == 1 ? 1 : q_chunk(M, m);
                const q_input in = q_input_from(all, fmt, m, K);
                float res[QNB_DECODE * QMB_MAX];
                if (fmt == SD_W_Q4) {
                    Q_TILE_CASE(SD_W_Q4)
                } else if (fmt == SD_W_Q8) {
                    Q_TILE_CASE(SD_W_Q8)
                } else {
                    Q_TILE_CASE(SD_W_Q8H)
                }
                store_tile(res, NULL, bias, y, N, n, m, nb, mb);
                m += mb;
            }
            n += nb;
        }
    }
}

/* A GGUF-native linear layer inside a parallel region; scratch: q_scratch_floats(M, K) floats. */
static void linear_q(const bf16 *x, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                     int64_t K, float *scratch) {
    const q_input in = q_input_at(scratch, M, K);
    q_quantize_input(x, M, K, fmt, in);
    linear_q_for(in, w, fmt, bias, y, M, N, K);
}

int64_t sd_q_scratch_floats(int64_t M, int64_t K) { return q_scratch_floats(M, K); }

/* The fp32 (or, bf16_out, bf16) weights [N, K] of a GGUF-native matrix, computed as the reference dequantization does (s * q, then
 * + m: two roundings, no FMA): prompt-sized blocks multiply them with a GEMM. */
void sd_dequant_q(const uint8_t *w, int fmt, int64_t N, int64_t K, void *out, int bf16_out, int threads) {
    const int64_t E = q_block_elems(fmt), BB = q_block_bytes(fmt), nblk = K / E, row_bytes = q_row_bytes(fmt, K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
#ifndef SD_AVX512
        float o[32];
#endif
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *blk = row + b * BB;
            float s, m = 0.0f;
            memcpy(&s, blk, 4);
            if (fmt == SD_W_Q4) memcpy(&m, row + nblk * BB + b * 4, 4);
#ifdef SD_AVX512
            /* the same two roundings (s * q, then + m) on 16 lanes */
            const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 4));
            __m512 v[2];
            if (fmt == SD_W_Q4) {
                const __m512i q = _mm512_cvtepu8_epi32(bytes);
                v[0] = _mm512_add_ps(_mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))), vm);
                v[1] = _mm512_add_ps(_mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), vm);
            } else {
                v[0] = _mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
                if (fmt == SD_W_Q8)
                    v[1] = _mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                 _mm_loadu_si128((const __m128i *)(blk + 20)))));
            }
            for (int64_t h = 0; h < E / 16; h++) {
                if (bf16_out)
                    _mm256_storeu_si256((__m256i *)((bf16 *)out + n * K + b * E + 16 * h), f2bf_x16(v[h]));
                else
                    _mm512_storeu_ps((float *)out + n * K + b * E + 16 * h, v[h]);
            }
#else
            if (fmt == SD_W_Q4) {
                for (int e = 0; e < 16; e++) {
                    const float lo = s * (float)(blk[4 + e] & 0x0F), hi = s * (float)(blk[4 + e] >> 4);
                    o[e] = lo + m;
                    o[e + 16] = hi + m;
                }
            } else {
                for (int64_t e = 0; e < E; e++) o[e] = s * (float)((const int8_t *)blk)[4 + e];
            }
            /* bf16_out: rounded as torch rounds fp32 to bf16, so no fp32 copy of the matrix is written */
            if (bf16_out)
                for (int64_t e = 0; e < E; e++) ((bf16 *)out)[n * K + b * E + e] = f2bf(o[e]);
            else
                memcpy((float *)out + n * K + b * E, o, (size_t)E * sizeof(float));
#endif
        }
    }
}

void sd_linear_q(const bf16 *x, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                 int64_t K, float *scratch, int threads) {
#pragma omp parallel num_threads(threads) if (N * K > 32768)
    linear_q(x, w, fmt, bias, y, M, N, K, scratch);
}

/* ---- GGUF-native weights in panels (AVX-512) -------------------------------------------------------------- */

/* Why: in rows (above), each (weight row, input row) pair decodes the row's blocks and reduces 8 lanes at the
 * end, so a block of M tokens costs M times the decoding work and verification is compute-bound from 2 rows on
 * (a 4-token block of SmolLM2 cost 3.4 one-token forwards on AMD Zen 4). In panels, as the bf16 panels, a vector
 * holds 16 *outputs*: the weights of 16 output rows are interleaved by pairs of k, decoded once per block into
 * 16-bit lanes, and multiplied by an input pair broadcast to every lane (VPDPWSSD: 2 exact products per lane
 * and instruction) for every input row of the tile. Each output keeps, in a lane of its own, its block's exact
 * integer sum, then its fp32 accumulator updated block by block in k order: the same operations for any number
 * of rows.
 *
 * Layout: for each panel of QPANEL outputs (the last one zero-padded) its blocks in k order, each
 *   Q4:  fp32 scales [16], fp32 offsets [16], then 4 chunks of 64 bytes: chunk h byte 4l + i holds
 *        q[l][8h + i] (low nibble) and q[l][8h + 4 + i] (high nibble), i = 0..3 (quads 2h and 2h + 1), for
 *        VPDPBUSD on the int8 activations (4 products per lane);
 *   Q8:  fp32 scales [16], then 16 pairs of 32 bytes: pair p byte 2l + i = q[l][2p + i] (int8);
 *   Q8H: fp32 scales [16], then 8 pairs of 32 bytes, as Q8 (E = 16).
 * y[m, n] = sum_b s_b (d_b sum_i q_i X_i) [+ sum_b m_b (d_b sum_i X_i), its own accumulator, for Q4], d_b
 * the block's activation scale (2^e_b, or amax / 127 for Q4).
 *
 * SD_W_HALF | a layout: its scales and offsets as fp16 [16] (32 bytes each) where every one of the matrix is
 * an fp16 value (Q4_0, Q4_1 and Q8_0 files store them so; Q4_K's products of two scales often are not, and
 * sd_q_half_exact says so). VCVTPH2PS widens them back exactly, so the results are the same bits, and a
 * decoded token reads 5 bits a weight instead of 6 (Q4) or 8.5 instead of 9 (Q8): decoding is bandwidth-bound. */
#define QPANEL 16
#define QP_MB 8 /* input rows per tile: 8 integer sums and 8 (Q4: 16) fp32 accumulators */

static inline int64_t qp_scale_bytes(int fmt) { return fmt & SD_W_HALF ? 32 : 64; }
static inline int64_t qp_block_bytes(int fmt) {
    const int base = fmt & SD_W_GGUF;
    const int64_t sc = qp_scale_bytes(fmt);
    return base == SD_W_Q4 ? sc + sc + 256 : base == SD_W_Q8 ? sc + 512 : sc + 256;
}
static inline int64_t qp_panel_bytes(int fmt, int64_t K) { return K / q_block_elems(fmt) * qp_block_bytes(fmt); }
int64_t sd_qp_panel_bytes(int fmt, int64_t K) { return qp_panel_bytes(fmt, K); }

/* f as fp16 bits in *h when f is an fp16 value (zero, normal or subnormal; not inf or NaN); 0 otherwise. */
static int f16_exact(float f, uint16_t *h) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 16) & 0x8000u, exp = (bits >> 23) & 0xFFu, man = bits & 0x7FFFFFu;
    if (exp == 0xFF || (exp == 0 && man)) return 0; /* inf, NaN, fp32 subnormals (far below fp16's range) */
    if (exp == 0) {
        *h = (uint16_t)sign;
        return 1;
    }
    const int e = (int)exp - 127;
    if (e > 15) return 0;
    if (e >= -14) { /* normal in fp16: 10 mantissa bits */
        if (man & 0x1FFFu) return 0;
        *h = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | man >> 13);
        return 1;
    }
    const uint32_t sig = man | 0x800000u; /* subnormal in fp16: sig * 2^(e - 23) = m * 2^-24 */
    const int shift = -(e + 1);
    if (shift > 24 || (sig & ((1u << shift) - 1))) return 0;
    *h = (uint16_t)(sign | sig >> shift);
    return 1;
}

/* Whether every scale and offset of GGUF-native rows [N, q_row_bytes] of layout fmt is an fp16 value (then
 * their panels can hold them as fp16: SD_W_HALF). */
int sd_q_half_exact(const uint8_t *rows, int fmt, int64_t N, int64_t K) {
    const int64_t BB = q_block_bytes(fmt), nblk = K / q_block_elems(fmt), row_bytes = q_row_bytes(fmt, K);
    uint16_t h;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = rows + n * row_bytes;
        for (int64_t b = 0; b < nblk; b++) {
            float v;
            memcpy(&v, row + b * BB, 4);
            if (!f16_exact(v, &h)) return 0;
            if (fmt == SD_W_Q4) {
                memcpy(&v, row + nblk * BB + b * 4, 4);
                if (!f16_exact(v, &h)) return 0;
            }
        }
    }
    return 1;
}

/* Rows [N, q_row_bytes] of layout fmt & SD_W_GGUF into panels [ceil(N / QPANEL), qp_panel_bytes(fmt)] (a
 * permutation of the same integers and scales; rows past N zero). SD_W_HALF in fmt: scales and offsets as
 * fp16, which they must all be (sd_q_half_exact). */
void sd_q_to_panels(const uint8_t *rows, int fmt, int64_t N, int64_t K, uint8_t *panels, int threads) {
    const int base = fmt & SD_W_GGUF, half = (fmt & SD_W_HALF) != 0;
    const int64_t E = q_block_elems(base), BB = q_block_bytes(base), nblk = K / E, row_bytes = q_row_bytes(base, K);
    const int64_t npanels = (N + QPANEL - 1) / QPANEL, PB = qp_block_bytes(fmt), SC = qp_scale_bytes(fmt);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < npanels; p++)
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *dst = panels + p * qp_panel_bytes(fmt, K) + b * PB;
            memset(dst, 0, (size_t)PB);
            for (int64_t l = 0; l < QPANEL && p * QPANEL + l < N; l++) {
                const uint8_t *row = rows + (p * QPANEL + l) * row_bytes, *blk = row + b * BB;
                const uint8_t *scales[2] = {blk, row + nblk * BB + b * 4}; /* scale, and Q4's offset */
                for (int t = 0; t < (base == SD_W_Q4 ? 2 : 1); t++) {
                    uint8_t *to = dst + t * SC;
                    if (half) {
                        float v;
                        uint16_t h = 0;
                        memcpy(&v, scales[t], 4);
                        f16_exact(v, &h);
                        memcpy(to + 2 * l, &h, 2);
                    } else {
                        memcpy(to + 4 * l, scales[t], 4);
                    }
                }
                uint8_t q[32]; /* the block's integers (as bytes: nibbles 0..15, or int8) */
                uint8_t *quants = dst + (base == SD_W_Q4 ? 2 * SC : SC);
                if (base == SD_W_Q4) {
                    for (int e = 0; e < 16; e++) {
                        q[e] = blk[4 + e] & 0x0F;
                        q[e + 16] = blk[4 + e] >> 4;
                    }
                    for (int h = 0; h < 4; h++)
                        for (int i = 0; i < 4; i++)
                            quants[64 * h + 4 * l + i] = (uint8_t)(q[8 * h + i] | (q[8 * h + 4 + i] << 4));
                } else {
                    memcpy(q, blk + 4, (size_t)E);
                    for (int64_t pr = 0; pr < E / 2; pr++)
                        for (int i = 0; i < 2; i++) quants[32 * pr + 2 * l + i] = q[2 * pr + i];
                }
            }
        }
}

/* The value of fp16 bits h that f16_exact wrote (zero, normal or subnormal): exact in fp32. */
static float f16_value(uint16_t h) {
    const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    const float v = exp ? ldexpf((float)(man | 0x400), exp - 25) : ldexpf((float)man, -24);
    return h & 0x8000u ? -v : v;
}

/* The inverse of sd_q_to_panels: rows [n, q_row_bytes] of layout fmt & SD_W_GGUF for the rows idx[0..n) of
 * the matrix (rows 0..n-1 where idx is NULL), from its panels: the bytes those rows held. So a matrix can be
 * kept as panels alone (the layout the kernels read) and still be looked up (embedding rows) or dequantized
 * (prompt GEMMs, references) without a second copy of its weights. */
void sd_q_rows_from_panels(const uint8_t *panels, int fmt, int64_t K, const int64_t *idx, int64_t n, uint8_t *rows,
                           int threads) {
    const int base = fmt & SD_W_GGUF, half = (fmt & SD_W_HALF) != 0;
    const int64_t E = q_block_elems(base), BB = q_block_bytes(base), nblk = K / E, row_bytes = q_row_bytes(base, K);
    const int64_t PB = qp_block_bytes(fmt), SC = qp_scale_bytes(fmt), panel_bytes = qp_panel_bytes(fmt, K);
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 64)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = idx ? idx[i] : i, l = r % QPANEL;
        const uint8_t *panel = panels + r / QPANEL * panel_bytes;
        uint8_t *row = rows + i * row_bytes;
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *src = panel + b * PB;
            uint8_t *blk = row + b * BB;
            uint8_t *scales[2] = {blk, row + nblk * BB + b * 4}; /* scale, and Q4's offset */
            for (int t = 0; t < (base == SD_W_Q4 ? 2 : 1); t++) {
                if (half) {
                    uint16_t h;
                    memcpy(&h, src + t * SC + 2 * l, 2);
                    const float v = f16_value(h);
                    memcpy(scales[t], &v, 4);
                } else {
                    memcpy(scales[t], src + t * SC + 4 * l, 4);
                }
            }
            const uint8_t *quants = src + (base == SD_W_Q4 ? 2 * SC : SC);
            if (base == SD_W_Q4) {
                uint8_t q[32];
                for (int h = 0; h < 4; h++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t v = quants[64 * h + 4 * l + j];
                        q[8 * h + j] = v & 0x0F;
                        q[8 * h + 4 + j] = v >> 4;
                    }
                for (int e = 0; e < 16; e++) blk[4 + e] = (uint8_t)(q[e] | q[e + 16] << 4);
            } else {
                for (int64_t pr = 0; pr < E / 2; pr++)
                    for (int j = 0; j < 2; j++) blk[4 + 2 * pr + j] = quants[32 * pr + 2 * l + j];
            }
        }
    }
}

#ifdef SD_AVX512
int sd_q_panels(void) { return 1; }

static inline __m512i qp_dot(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); /* the same exact integer sums */
#endif
}

/* acc + per lane the sum of 4 products of unsigned bytes w (nibbles) and signed bytes x: exact. */
static inline __m512i qp_dot_u8(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}

/* A panel block's 16 scales (or offsets): fp32, or fp16 widened exactly. */
static inline __m512 qp_scales(const uint8_t *p, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* The QPANEL outputs of panel w for mb input rows into y [mb, N] (+ bias), rounded to bf16 once. `in` holds the
 * tile's rows (X with row stride K, scales and offsets with row stride nblk); fmt a GGUF layout, | SD_W_HALF. */
static inline __attribute__((always_inline)) void qp_tile(int fmt, const uint8_t *w, q_input in, int64_t K,
                                                          int64_t panel_bytes, const bf16 *bias, bf16 *y,
                                                          int64_t N, int64_t n0, int mb) {
    const int half = (fmt & SD_W_HALF) != 0, x8 = (fmt & SD_W_X8) != 0;
    fmt &= SD_W_GGUF;
    const int64_t E = q_block_elems(fmt), PB = qp_block_bytes(fmt | (half ? SD_W_HALF : 0)), nblk = K / E;
    const int64_t SC = half ? 32 : 64; /* bytes of the block's 16 scales (and of Q4's 16 offsets) */
    __m512 acc[QP_MB], off[QP_MB];
    for (int j = 0; j < mb; j++) acc[j] = off[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *blk = w + b * PB;
        for (int64_t line = 0; line < PB; line += 64) /* the next panel, as panel_acc */
            _mm_prefetch((const char *)(blk + panel_bytes + line), _MM_HINT_T1);
        /* Integer sums are exact in any order, so few rows split theirs over independent accumulators (pairs
         * in turn): one chain of VPDPWSSD per row would wait on the instruction's latency. */
        const int split = mb == 1 ? 4 : mb <= 4 ? 2 : 1;
        __m512i isum[QP_MB][4];
        for (int j = 0; j < mb; j++)
            for (int a = 0; a < split; a++) /* SD_W_X8: from -128 sum X (q_quantize_input_i8) */
                isum[j][a] = x8 && a == 0 ? _mm512_set1_epi32((int32_t)in.offset_in[j * nblk + b])
                                          : _mm512_setzero_si512();
        const uint8_t *quants = blk + (fmt == SD_W_Q4 ? 2 * SC : SC);
        if (fmt == SD_W_Q4) { /* 4 x 64 bytes, each two quads of 4 elements (low and high nibbles) */
            for (int h = 0; h < 4; h++) {
                const __m512i v = _mm512_loadu_si512((const void *)(quants + 64 * h)), low = _mm512_set1_epi8(0x0F);
                const __m512i wq[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
                for (int t = 0; t < 2; t++) {
                    const int quad = 2 * h + t; /* elements 4 quad .. 4 quad + 3 of the block */
                    for (int j = 0; j < mb; j++) {
                        int32_t xquad;
                        memcpy(&xquad, q_x8(in) + j * K + b * E + 4 * quad, 4);
                        isum[j][quad % split] = qp_dot_u8(isum[j][quad % split], wq[t], _mm512_set1_epi32(xquad));
                    }
                }
            }
        } else if (x8) { /* quad q: pairs 2q and 2q + 1 (32 bytes each), each output's two pairs made one lane.
                          * Loaded as halves: a block is 32 bytes past a cache line's start every other time,
                          * and a 64-byte load would then straddle two lines (SmolLM2's output layer, one row:
                          * 27% slower). */
            const __m512i quad_order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
            for (int q = 0; q < 8; q++) {
                const __m512i first = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(quants + 64 * q)));
                const __m512i second =
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(quants + 64 * q + 32)));
                const __m512i wq = _mm512_xor_si512(_mm512_permutex2var_epi16(first, quad_order, second),
                                                    _mm512_set1_epi8((char)0x80)); /* q + 128, unsigned */
                for (int j = 0; j < mb; j++) {
                    int32_t xquad;
                    memcpy(&xquad, q_x8(in) + j * K + b * E + 4 * q, 4);
                    isum[j][q % split] = qp_dot_u8(isum[j][q % split], wq, _mm512_set1_epi32(xquad));
                }
            }
        } else { /* pairs c0 + a in turn; a is a constant after unrolling (an index computed at run time kept
                  * the sums in memory: 3- and 4-row tiles of the 8-bit head ran 3x slower than 5-row ones) */
            for (int64_t c0 = 0; c0 < E / 2; c0 += split)
                for (int a = 0; a < split; a++) {
                    const int64_t c = c0 + a;
                    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(quants + 32 * c)));
                    for (int j = 0; j < mb; j++) {
                        int32_t xpair; /* elements 2c, 2c + 1 */
                        memcpy(&xpair, in.X + j * K + b * E + 2 * c, 4);
                        isum[j][a] = qp_dot(isum[j][a], wv, _mm512_set1_epi32(xpair));
                    }
                }
        }
        const __m512 s = qp_scales(blk, half);
        for (int j = 0; j < mb; j++) {
            for (int a = 1; a < split; a++) isum[j][0] = _mm512_add_epi32(isum[j][0], isum[j][a]);
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[j][0]), _mm512_set1_ps(in.scale[j * nblk + b]));
            acc[j] = _mm512_fmadd_ps(s, t, acc[j]);
        }
        if (fmt == SD_W_Q4) {
            const __m512 m = qp_scales(blk + SC, half);
            for (int j = 0; j < mb; j++)
                off[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(in.offset_in[j * nblk + b]), off[j]);
        }
    }
    const int64_t valid = N - n0 < QPANEL ? N - n0 : QPANEL;
    const __mmask16 lanes = (__mmask16)(valid >= 16 ? 0xffffu : (1u << valid) - 1);
    const __m512 bv = bias ? load_bf16x16_masked(bias + n0, lanes) : _mm512_setzero_ps();
    for (int j = 0; j < mb; j++) {
        __m512 v = fmt == SD_W_Q4 ? _mm512_add_ps(acc[j], off[j]) : acc[j];
        if (bias) v = _mm512_add_ps(v, bv);
        _mm256_mask_storeu_epi16(y + j * N + n0, lanes, f2bf_x16(v));
    }
}

/* Input rows of the chunk starting at row m: ceil(M / QP_MB) chunks of near-equal size. */
static inline int qp_chunk(int64_t M, int64_t m) {
    const int64_t chunks = (M + QP_MB - 1) / QP_MB, base = M / chunks, extra = M % chunks;
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

#define QP_ROWS_SWITCH(FMT)                                 \
    switch (mb) {                                           \
        case 1: QP_CALL(FMT, 1); break;                     \
        case 2: QP_CALL(FMT, 2); break;                     \
        case 3: QP_CALL(FMT, 3); break;                     \
        case 4: QP_CALL(FMT, 4); break;                     \
        case 5: QP_CALL(FMT, 5); break;                     \
        case 6: QP_CALL(FMT, 6); break;                     \
        case 7: QP_CALL(FMT, 7); break;                     \
        default: QP_CALL(FMT, 8); break;                    \
    }

/* Rows first .. M of panel p (at wp) into y [M, N], in near-equal chunks of at most QP_MB rows. */
static void qp_panel_rows(q_input all, const uint8_t *wp, int fmt, const bf16 *bias, bf16 *y, int64_t first, int64_t M,
                          int64_t N, int64_t K, int64_t p, int64_t panel_bytes) {
    for (int64_t m = first; m < M;) {
        const int mb = qp_chunk(M - first, m - first);
        const q_input in = q_input_from(all, fmt & (SD_W_GGUF | SD_W_X8), m, K);
#define QP_CALL(F, R) qp_tile(F, wp, in, K, panel_bytes, bias, y + m * N, N, p * QPANEL, R)
        switch (fmt) { /* constant formats: each its own unrolled tile */
            case SD_W_Q4: QP_ROWS_SWITCH(SD_W_Q4) break;
            case SD_W_Q4 | SD_W_HALF: QP_ROWS_SWITCH(SD_W_Q4 | SD_W_HALF) break;
            case SD_W_Q8: QP_ROWS_SWITCH(SD_W_Q8) break;
            case SD_W_Q8 | SD_W_HALF: QP_ROWS_SWITCH(SD_W_Q8 | SD_W_HALF) break;
#ifdef __AVX512VNNI__
            case SD_W_Q8 | SD_W_X8: QP_ROWS_SWITCH(SD_W_Q8 | SD_W_X8) break;
            case SD_W_Q8 | SD_W_HALF | SD_W_X8: QP_ROWS_SWITCH(SD_W_Q8 | SD_W_HALF | SD_W_X8) break;
#endif
            case SD_W_Q8H: QP_ROWS_SWITCH(SD_W_Q8H) break;
            default: QP_ROWS_SWITCH(SD_W_Q8H | SD_W_HALF) break;
        }
#undef QP_CALL
        m += mb;
    }
}

/* Work-shared over panels (PANEL_SCHEDULE), inside a parallel region. */
static void linear_qp_for(q_input all, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                          int64_t K) {
    const int64_t npanels = (N + QPANEL - 1) / QPANEL;
    const int64_t panel_bytes = qp_panel_bytes(fmt, K);
#pragma omp for PANEL_SCHEDULE
    for (int64_t p = 0; p < npanels; p++) qp_panel_rows(all, w + p * panel_bytes, fmt, bias, y, 0, M, N, K, p, panel_bytes);
}

#if defined(SD_AMX) && defined(__AMX_INT8__)
#define SD_AMX_INT8 1
/* GGUF panels on AMX-INT8 tiles, for blocks of many rows (a prompt's chunk, a wide verification): at 8 and 16
 * rows tiles lose to the VNNI panels, because every block of E has its own scales and its 16 x 16 integer sums
 * must leave the tile through memory to be scaled; inside a forward they gain from about 44 rows on 4-bit layouts
 * and from 24 on 8-bit ones, whose VNNI path multiplies half as many pairs an instruction (scripts/bench_q_amx.py
 * per layer, scripts/bench_prefill.py --q-amx-rows in a forward, Sapphire Rapids).
 * One tile product multiplies a block's activations of 16 rows (A: 16 rows x E bytes) by the block's weights of
 * a panel (B: E / 4 quads x 16 outputs x 4 bytes) into the exact int32 sums qp_tile forms with VPDPBUSD /
 * VPDPWSSD:
 *   SD_W_Q4: int8 activations times the nibbles (TDPBSUD; B rows are a panel chunk's low and high nibbles);
 *   SD_W_Q8, SD_W_Q8H: 16-bit activations X = 256 hi + lo as two products, signed hi bytes (TDPBSSD) and
 *   unsigned lo bytes (TDPBUSD) times the int8 weights, then sum = 256 sum_hi + sum_lo (|sum| < 2^27).
 * The fp32 scaling that follows is qp_tile's, operation for operation, in the same block order: a row gets the
 * bits the VNNI panels give it, so decoding's bits, at any block size. Blocks of at least sd_q_amx_rows rows
 * take it (SD_W_Q8 from half as many; 0: never). */

/* Tiles 0-1 integer sums (16 x 16 int32), 2-3 activations (16 rows x E bytes), 4-5 weights (E / 4 rows x 64
 * bytes): Q4 runs two sets (0, 2, 4) and (1, 3, 5) by turns, Q8 one set of two products (hi and lo sums, hi and
 * lo activations, the weights in 4). */
static void amx_configure_q(int64_t E) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t >= 4 ? (uint8_t)(E / 4) : 16;
        cfg.colsb[t] = t == 2 || t == 3 ? (uint16_t)E : 64;
    }
    _tile_loadconfig(&cfg);
}

/* The M rows of a panel layer (fmt: a GGUF layout | SD_W_HALF), work-shared over panels; `in` as for qp_tile.
 * Whole tiles of 16 rows; up to 4 rows left over then take qp_tile on the same panel, while its weights are in
 * the cache (a second pass over the layer would read every weight from memory again: a 40-token prompt took 6%
 * longer so), and 5-15 rows a tile padded with zero rows.
 * Each thread first copies the activations into A tiles of its own (a few hundred KB at most; its own copy
 * spares the threads a barrier, which cost more than the copy at 40 rows): tile (row tile t, block b) at (t *
 * nblk + b) * 16 * E * parts, parts = 1 (Q4) or 2 (hi, then lo), so a tile load reads whole lines (rows K bytes
 * apart, re-read for every panel from L2, held the loads up: a quarter of the layer's time). The last tile's
 * rows past M are zeros, computed and not stored. */
static void linear_qp_amx_for(q_input in, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                              int64_t K) {
    const int half = (fmt & SD_W_HALF) != 0, base = fmt & SD_W_GGUF, q4 = base == SD_W_Q4;
    const int64_t E = q_block_elems(base), SC = half ? 32 : 64, PB = qp_block_bytes(fmt), nblk = K / E;
    const int64_t parts = q4 ? 1 : 2, tile_bytes = 16 * E, unit = tile_bytes * parts;
    const int64_t npanels = (N + QPANEL - 1) / QPANEL, panel_bytes = qp_panel_bytes(fmt, K);
    /* per thread, kept between calls: a panel's blocks as B tiles, its scales (and Q4's offsets) in fp32, the
     * sums of two blocks, 16 rows' offset terms, the last tile's activation scales and offsets */
    static __thread uint8_t *kept = NULL;
    static __thread size_t kept_bytes = 0;
    const int64_t rest = M % 16, tiled = rest > 4 ? M : M - rest, row_tiles = (tiled + 15) / 16;
    const size_t need = (size_t)(nblk * tile_bytes) + (size_t)(nblk * 64) * sizeof(float) + 2048 * sizeof(int32_t)
                        + (size_t)(row_tiles * nblk * unit);
    if (kept_bytes < need) {
        free(kept);
        kept = aligned_alloc(64, (need + 63) / 64 * 64);
        kept_bytes = kept ? need : 0;
        if (!kept) abort();
    }
    uint8_t *weights = kept;
    float *scales = (float *)(kept + nblk * tile_bytes), *offsets = scales + nblk * 16;
    float *padded = offsets + nblk * 16, *row_offsets = padded + nblk * 32; /* padded: zero past the rows copied */
    int32_t *sums = (int32_t *)(row_offsets + 256);
    int8_t *tiles = (int8_t *)(sums + 1024);
    memset(padded, 0, (size_t)(nblk * 32) * sizeof(float));
    for (int64_t tb = 0; tb < row_tiles * nblk; tb++) {
        const int64_t t = tb / nblk, b = tb % nblk;
        int8_t *dst = tiles + tb * unit;
        for (int j = 0; j < 16; j++) {
            const int64_t row = 16 * t + j;
            if (row >= M) {
                memset(dst + j * E, 0, (size_t)E);
                if (!q4) memset(dst + tile_bytes + j * E, 0, (size_t)E);
                continue;
            }
            if (q4) {
                memcpy(dst + j * E, q_x8(in) + row * K + b * E, (size_t)E);
                continue;
            }
            for (int64_t e = 0; e < E; e += 16) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(in.X + row * K + b * E + e));
                _mm_storeu_si128((__m128i *)(dst + j * E + e), _mm256_cvtepi16_epi8(_mm256_srai_epi16(x, 8)));
                _mm_storeu_si128((__m128i *)(dst + tile_bytes + j * E + e), _mm256_cvtepi16_epi8(x));
            }
        }
    }
    amx_configure_q(E);
    /* word 2n of a quad row: word n of the first pair (elements 4r, 4r + 1), word 2n + 1: of the second */
    __m512i interleave = _mm512_setzero_si512();
    for (int n = 0; n < 16; n++) {
        interleave = _mm512_mask_set1_epi16(interleave, (__mmask32)(1u << (2 * n)), (short)n);
        interleave = _mm512_mask_set1_epi16(interleave, (__mmask32)(1u << (2 * n + 1)), (short)(32 + n));
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma omp for PANEL_SCHEDULE
    for (int64_t p = 0; p < npanels; p++) {
        const uint8_t *wp = w + p * panel_bytes;
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *blk = wp + b * PB, *quants = blk + (q4 ? 2 * SC : SC);
            uint8_t *bt = weights + b * tile_bytes;
            for (int64_t line = 0; line < PB; line += 64) /* the next panel, as qp_tile: weights come from memory */
                _mm_prefetch((const char *)(blk + panel_bytes + line), _MM_HINT_T1);
            _mm512_store_ps(scales + 16 * b, qp_scales(blk, half));
            if (q4) { /* chunk h: quad 2h in the low nibbles, quad 2h + 1 in the high */
                _mm512_store_ps(offsets + 16 * b, qp_scales(blk + SC, half));
                for (int h = 0; h < 4; h++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(quants + 64 * h));
                    _mm512_store_si512((void *)(bt + 128 * h), _mm512_and_si512(v, low));
                    _mm512_store_si512((void *)(bt + 128 * h + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            } else { /* quad r: pairs 2r and 2r + 1 word by word */
                for (int64_t r = 0; r < E / 4; r++) {
                    const __m512i first = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(quants + 64 * r)));
                    const __m512i second = _mm512_castsi256_si512(
                        _mm256_loadu_si256((const __m256i *)(quants + 64 * r + 32)));
                    _mm512_store_si512((void *)(bt + 64 * r), _mm512_permutex2var_epi16(first, interleave, second));
                }
            }
        }
        const int64_t n0 = p * QPANEL, valid = N - n0 < QPANEL ? N - n0 : QPANEL;
        const __mmask16 lanes = (__mmask16)(valid >= 16 ? 0xffffu : (1u << valid) - 1);
        const __m512 bv = bias ? load_bf16x16_masked(bias + n0, lanes) : _mm512_setzero_ps();
        for (int64_t m0 = 0; m0 < tiled; m0 += 16) {
            const int8_t *xt = tiles + m0 / 16 * nblk * unit;
            const int64_t valid_rows = M - m0 < 16 ? M - m0 : 16;
            const float *row_scale = in.scale + m0 * nblk, *row_offset_in = q4 ? in.offset_in + m0 * nblk : NULL;
            if (valid_rows < 16) { /* rows past M: zero scales (their sums are zero too) */
                memcpy(padded, row_scale, (size_t)(valid_rows * nblk) * sizeof(float));
                row_scale = padded;
                if (q4) {
                    memcpy(padded + 16 * nblk, row_offset_in, (size_t)(valid_rows * nblk) * sizeof(float));
                    row_offset_in = padded + 16 * nblk;
                }
            }
            __m512 acc[16];
            if (q4) { /* the offset terms first, block by block as qp_tile sums them */
                for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nblk; b++) {
                    const __m512 m = _mm512_load_ps(offsets + 16 * b);
                    for (int j = 0; j < 16; j++)
                        acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(row_offset_in[j * nblk + b]), acc[j]);
                }
                for (int j = 0; j < 16; j++) _mm512_store_ps(row_offsets + 16 * j, acc[j]);
            }
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
#define QA_SCALE(isum, blk, two_parts)                                                                      \
    do {                                                                                                    \
        const __m512 s = _mm512_load_ps(scales + 16 * (blk));                                               \
        for (int j = 0; j < 16; j++) {                                                                      \
            __m512i v = _mm512_load_si512((const void *)((isum) + 16 * j));                                 \
            if (two_parts)                                                                                  \
                v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), _mm512_load_si512((const void *)((isum) + 256 + 16 * j))); \
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(row_scale[j * nblk + (blk)])); \
            acc[j] = _mm512_fmadd_ps(s, t, acc[j]);                                                         \
        }                                                                                                   \
    } while (0)
            if (q4) {
                /* Two blocks in flight, in tile sets (0, 2, 4) and (1, 3, 5) by turns: block b + 1's product is
                 * issued and block b's sums leave their tile before block b - 1's sums (stored a step earlier,
                 * so no load waits on a tile store) are scaled. Unrolled by two: tile numbers are constants. */
#define QA_ISSUE(C, A, B, blk)                                   \
    do {                                                         \
        _tile_loadd(A, xt + (blk) * unit, E);                    \
        _tile_loadd(B, weights + (blk) * tile_bytes, 64);        \
        _tile_zero(C);                                           \
        _tile_dpbsud(C, A, B);                                   \
    } while (0)
                QA_ISSUE(0, 2, 4, 0);
                for (int64_t b = 0; b < nblk; b += 2) { /* tile 0 holds block b's product */
                    if (b + 1 < nblk) QA_ISSUE(1, 3, 5, b + 1);
                    _tile_stored(0, sums, 64);
                    if (b > 0) QA_SCALE(sums + 512, b - 1, 0);
                    if (b + 2 < nblk) QA_ISSUE(0, 2, 4, b + 2);
                    if (b + 1 < nblk) _tile_stored(1, sums + 512, 64);
                    QA_SCALE(sums, b, 0);
                }
                if (nblk % 2 == 0) QA_SCALE(sums + 512, nblk - 1, 0);
#undef QA_ISSUE
            } else {
                /* Block b's two products are issued, block b - 1's sums (stored a step earlier) scaled while
                 * they run, then block b's sums stored. */
                for (int64_t b = 0; b <= nblk; b++) {
                    if (b < nblk) {
                        _tile_loadd(4, weights + b * tile_bytes, 64);
                        _tile_loadd(2, xt + b * unit, E);
                        _tile_loadd(3, xt + b * unit + tile_bytes, E);
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_dpbssd(0, 2, 4);
                        _tile_dpbusd(1, 3, 4);
                    }
                    if (b > 0) QA_SCALE(sums + ((b - 1) & 1) * 512, b - 1, 1);
                    if (b < nblk) {
                        _tile_stored(0, sums + (b & 1) * 512, 64);
                        _tile_stored(1, sums + (b & 1) * 512 + 256, 64);
                    }
                }
            }
#undef QA_SCALE
            for (int j = 0; j < valid_rows; j++) {
                __m512 v = q4 ? _mm512_add_ps(acc[j], _mm512_load_ps(row_offsets + 16 * j)) : acc[j];
                if (bias) v = _mm512_add_ps(v, bv);
                _mm256_mask_storeu_epi16(y + (m0 + j) * N + n0, lanes, f2bf_x16(v));
            }
        }
        if (tiled < M) qp_panel_rows(in, wp, fmt, bias, y, tiled, M, N, K, p, panel_bytes);
    }
}
#endif

/* A GGUF-native linear layer in panels inside a parallel region; scratch: q_scratch_floats(M, K) floats. */
static void linear_qp(const bf16 *x, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                      int64_t K, float *scratch) {
    const q_input in = q_input_at(scratch, M, K);
    if (!((fmt & SD_W_GGUF) == SD_W_Q8 && sd_q8_int8)) fmt &= ~SD_W_X8; /* 0 without VNNI */
    q_quantize_input(x, M, K, fmt & (SD_W_GGUF | SD_W_X8), in);
#ifdef SD_AMX_INT8
    /* Q8 layers (16-bit activations: VPDPWSSD, half VPDPBUSD's products an instruction) gain from half as many */
    const int64_t from = (fmt & SD_W_GGUF) == SD_W_Q8 ? sd_q_amx_rows / 2 : sd_q_amx_rows;
    if (sd_amx_active && sd_q_amx_rows > 0 && M >= from && !(fmt & SD_W_X8)) {
        linear_qp_amx_for(in, w, fmt, bias, y, M, N, K);
        return;
    }
#endif
    linear_qp_for(in, w, fmt, bias, y, M, N, K);
}
#else
int sd_q_panels(void) { return 0; }
static void linear_qp(const bf16 *x, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                      int64_t K, float *scratch) {
    (void)x, (void)w, (void)fmt, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)scratch;
    abort(); /* never packed: sd_q_panels() is 0 */
}
#endif

void sd_linear_qp(const bf16 *x, const uint8_t *w, int fmt, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                  int64_t K, float *scratch, int threads) {
#pragma omp parallel num_threads(threads) if (N * K > 32768)
    linear_qp(x, w, fmt, bias, y, M, N, K, scratch);
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------ */

/* A row's sum of squares is one chain of fused multiply-adds in element order, and stays so: the rounding of
 * this sum decides near-ties downstream (summed in 16 lanes instead, SmolLM2's first chat-template token
 * flipped its top-1 at an fp32 gap of 0.8). Several rows are summed at once, one row per lane. */
static inline float sum_squares_row(const bf16 *x, int64_t dim) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss = fmaf(bf2f(x[i]), bf2f(x[i]), ss);
    return ss;
}

/* ss[j] = sum_squares_row(x + j * stride, dim) for j < nrows <= 16, bit for bit. */
static inline void sum_squares_rows(const bf16 *x, int64_t stride, int nrows, int64_t dim, float *ss) {
#ifdef SD_AVX512
    if (nrows > 1) { /* 16 x 16 blocks transposed: one vector FMA takes a step of every row's chain */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < dim; i0 += 16) {
            const int64_t n = dim - i0 < 16 ? dim - i0 : 16;
            const __mmask16 lanes = (__mmask16)(n == 16 ? 0xffffu : (1u << n) - 1);
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = j < nrows ? load_bf16x16_masked(x + j * stride + i0, lanes) : _mm512_setzero_ps();
            transpose16(r); /* r[c]: element i0 + c of every row */
            for (int64_t c = 0; c < n; c++) acc = _mm512_fmadd_ps(r[c], r[c], acc);
        }
        float all[16];
        _mm512_storeu_ps(all, acc);
        for (int j = 0; j < nrows; j++) ss[j] = all[j];
        return;
    }
#endif
    for (int j = 0; j < nrows; j++) ss[j] = sum_squares_row(x + j * stride, dim);
}

static inline float inv_rms(float ss, int64_t dim, float eps) { return 1.0f / sqrtf(ss / (float)dim + eps); }

/* out = x * r * w, rounded as the PyTorch modules round it: Llama style rounds x * r to bf16 before scaling by
 * w; Gemma style scales by (1 + w) in fp32. out may be x. */
static inline void norm_scale_row(const bf16 *x, float r, const bf16 *w, int64_t dim, int gemma, bf16 *out) {
#ifdef SD_AVX512
    const __m512 vr = _mm512_set1_ps(r), one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 lanes = (__mmask16)(dim - i >= 16 ? 0xffffu : (1u << (dim - i)) - 1);
        const __m512 xr = _mm512_mul_ps(load_bf16x16_masked(x + i, lanes), vr);
        const __m512 wi = load_bf16x16_masked(w + i, lanes);
        const __m512 y = gemma ? _mm512_mul_ps(xr, _mm512_add_ps(one, wi)) : _mm512_mul_ps(wi, round_bf16_x16(xr));
        _mm256_mask_storeu_epi16(out + i, lanes, f2bf_x16(y));
    }
#else
    for (int64_t i = 0; i < dim; i++)
        out[i] = gemma ? f2bf(bf2f(x[i]) * r * (1.0f + bf2f(w[i]))) : f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(x[i]) * r)));
#endif
}

/* x (the residual stream, updated in place) += [post_norm](h) when h is given (h is normed in place);
 * out = norm(x, w). Work-shared over groups of up to 16 rows (call from every thread of the region). */
static void add_rmsnorm(bf16 *x, bf16 *h, const bf16 *post_w, const bf16 *w, bf16 *out, int64_t rows,
                        int64_t dim, float eps, int gemma) {
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    int64_t per_group = (rows + threads - 1) / threads;
    if (per_group > 16) per_group = 16;
    const int64_t groups = (rows + per_group - 1) / per_group;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = g * per_group;
        const int nr = (int)(rows - r0 < per_group ? rows - r0 : per_group);
        float ss[16];
        if (h && post_w) {
            sum_squares_rows(h + r0 * dim, dim, nr, dim, ss);
            for (int j = 0; j < nr; j++)
                norm_scale_row(h + (r0 + j) * dim, inv_rms(ss[j], dim, eps), post_w, dim, gemma, h + (r0 + j) * dim);
        }
        if (h)
            for (int64_t r = r0; r < r0 + nr; r++) {
                bf16 *xr = x + r * dim;
                const bf16 *hr = h + r * dim;
#ifdef SD_AVX512
                for (int64_t i = 0; i < dim; i += 16) {
                    const __mmask16 lanes = (__mmask16)(dim - i >= 16 ? 0xffffu : (1u << (dim - i)) - 1);
                    const __m512 sum = _mm512_add_ps(load_bf16x16_masked(xr + i, lanes),
                                                     load_bf16x16_masked(hr + i, lanes));
                    _mm256_mask_storeu_epi16(xr + i, lanes, f2bf_x16(sum));
                }
#else
                for (int64_t i = 0; i < dim; i++) xr[i] = f2bf(bf2f(xr[i]) + bf2f(hr[i]));
#endif
            }
        sum_squares_rows(x + r0 * dim, dim, nr, dim, ss);
        for (int j = 0; j < nr; j++)
            norm_scale_row(x + (r0 + j) * dim, inv_rms(ss[j], dim, eps), w, dim, gemma, out + (r0 + j) * dim);
    }
}

/* ---- q/k norm, RoPE and the KV cache write ---------------------------------------------------------- */

/* qkv [rows, H + 2 Hkv, D] from the fused projection. Queries go to q_out [rows, H, D]; keys and values are
 * written into the cache at (slot of the row's sequence, cache_pos[row]). cos/sin [rows, D/2] in fp32
 * (rotate-half convention of Hugging Face checkpoints). Work-shared over rows; scratch: D / 2 floats per thread. */
/* Key panels: a copy of each layer's key cache laid out as the panel attention reads it, kept up to date as
 * keys are stored, so that attention need not transpose every key of the context at every step (which took
 * most of a decoding step's attention: SmolLM2 native, 8 sequences of 2,000 tokens, 44 -> 18 ms of layers
 * without it). Per (slot, kv head): [max_len / KEY_PANEL][D / 2][KEY_PANEL] words (pairs of bf16), key t in
 * lane t % KEY_PANEL of panel t / KEY_PANEL. */
#define KEY_PANEL 32
static inline void key_to_panels(uint32_t *k_panels, const bf16 *key, int64_t head, int64_t t, int64_t D,
                                 int64_t max_len) {
    const int64_t words = D / 2;
    uint32_t *dst = k_panels + head * max_len * words + (t / KEY_PANEL) * KEY_PANEL * words + t % KEY_PANEL;
    const uint32_t *src = (const uint32_t *)key;
    for (int64_t w = 0; w < words; w++) dst[w * KEY_PANEL] = src[w];
}

/* KEY_PANEL where the panel attention reads key panels (AVX-512, not AMX tiles), else 0: none are kept. */
int sd_key_panel_width(int64_t head_dim) {
#ifdef SD_AVX512
#ifdef SD_AMX
    if (sd_amx_active && head_dim % 32 == 0) return 0;
#endif
    (void)head_dim;
    return KEY_PANEL;
#else
    (void)head_dim;
    return 0;
#endif
}

static void rope_store(const bf16 *qkv, const bf16 *q_norm_w, const bf16 *k_norm_w, float eps, int gemma,
                       const float *cos_t, const float *sin_t, const int64_t *row_slot, const int64_t *cache_pos,
                       bf16 *k_cache, bf16 *v_cache, uint32_t *k_panels, int64_t rows, int64_t H,
                       int64_t Hkv, int64_t D, int64_t max_len, bf16 *q_out, float *scratch) {
    const int64_t half = D / 2, heads = H + 2 * Hkv;
    bf16 *normed = (bf16 *)scratch;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        const int64_t slot = row_slot[r];
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            const bf16 *src = qkv + (r * heads + hh) * D;
            const bf16 *norm_w = hh < H ? q_norm_w : k_norm_w;
            if (norm_w) {
                norm_scale_row(src, inv_rms(sum_squares_row(src, D), D, eps), norm_w, D, gemma, normed);
                src = normed;
            }
            bf16 *dst = hh < H ? q_out + (r * H + hh) * D
                               : k_cache + ((slot * Hkv + (hh - H)) * max_len + cache_pos[r]) * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf2f(src[i]), b = bf2f(src[i + half]);
                dst[i] = f2bf(fmaf(a, c[i], -b * s[i]));
                dst[i + half] = f2bf(fmaf(b, c[i], a * s[i]));
            }
            if (k_panels && hh >= H) /* the same key, word by word, into its lane of the slot's key panels */
                key_to_panels(k_panels, dst, slot * Hkv + (hh - H), cache_pos[r], D, max_len);
        }
        for (int64_t kv = 0; kv < Hkv; kv++)
            memcpy(v_cache + ((slot * Hkv + kv) * max_len + cache_pos[r]) * D,
                   qkv + (r * heads + H + Hkv + kv) * D, (size_t)D * sizeof(bf16));
    }
}

/* ---- attention over the cache --------------------------------------------------------------------------- */

#ifndef SD_AVX512
/* q [rows, H, D] -> out [rows, H, D], work-shared over (row, head). mask [rows, key_len] is additive fp32; keys it
 * hides (-inf) are skipped, so a token's result depends only on the keys it sees, in cache order, and not on
 * the padding or the block it was verified in. softcap > 0 applies tanh capping to the scores.
 * scratch: key_len + 2 * D floats per thread. */
static void attention_for(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *row_slot,
                          const float *mask, int64_t rows, int64_t H, int64_t Hkv, int64_t D,
                          int64_t max_len, int64_t key_len, float scale, float softcap, bf16 *out,
                          float *scratch) {
    const int64_t group = H / Hkv, total = rows * H;
    float *scores = scratch, *qf = scratch + key_len, *acc = qf + D;
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < total; idx++) {
        const int64_t row = idx / H, h = idx % H, kv = h / group;
        const int64_t base = (row_slot[row] * Hkv + kv) * max_len;
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
#endif

#ifdef SD_AVX512
#define PV_QUERIES 6 /* queries per pass over the values: 6 x 4 accumulators */

/* a[j][l] = sum over keys k in [lo, hi), in order, of p[j][k] * v[k][16 l .. 16 l + 16) (v with row stride D):
 * one FMA per lane and key, `vectors` (a constant at each call) vectors of 16 dimensions. */
static inline __attribute__((always_inline)) void pv_block(const float *const *p, const bf16 *v, int64_t D,
                                                           int64_t lo, int64_t hi, int vectors,
                                                           __m512 a[PV_QUERIES][4]) {
    for (int j = 0; j < PV_QUERIES; j++)
        for (int l = 0; l < vectors; l++) a[j][l] = _mm512_setzero_ps();
    for (int64_t k = lo; k < hi; k++) {
        __m512 vk[4];
        for (int l = 0; l < vectors; l++) vk[l] = load_bf16x16(v + k * D + 16 * l);
        for (int j = 0; j < PV_QUERIES; j++) {
            const __m512 pk = _mm512_set1_ps(p[j][k]);
            for (int l = 0; l < vectors; l++) a[j][l] = _mm512_fmadd_ps(pk, vk[l], a[j][l]);
        }
    }
}

/* A forward's rows are B sequences packed one after another: sequence b holds rows seq_start[b] ..
 * seq_start[b + 1] (a uniform block of T rows each: seq_start[b] = b * T; a ragged batch of drafts packs only
 * each sequence's real rows). Attention works in units of queries (a row times one of the `group` heads that
 * share a kv head) of one sequence and kv head: chunks[b] units per kv head of sequence b, numbered b first,
 * then kv head, then chunk. Unit u's sequence, kv head and chunk: */
static inline void attention_unit(const int64_t *chunks, int64_t Hkv, int64_t u, int64_t *b, int64_t *kv,
                                  int64_t *c) {
    int64_t s = 0;
    while (u >= Hkv * chunks[s]) u -= Hkv * chunks[s++];
    *b = s;
    *kv = u / chunks[s];
    *c = u % chunks[s];
}

/* The softmax and the weighted sum of values of nq <= 16 queries of one sequence (its first row row0) and kv
 * head kv, given their raw dot products with keys 0 .. key_len (scores[j * stride + k], query j of the unit
 * being query q0 + j of the sequence: row row0 + (q0 + j) / group, head kv * group + (q0 + j) % group).
 * scores is overwritten; live_p holds stride floats. Shared by the AMX and the AVX-512 attention, which differ
 * in how they get the dot products. */
static void attention_finish(float *scores, int64_t stride, float *live_p, const float *mask, const bf16 *values,
                             int64_t row0, int64_t H, int64_t kv, int64_t group, int64_t q0, int64_t nq,
                             int64_t D, int64_t key_len, float scale, float softcap, bf16 *out) {
    float inv[16];
    int64_t first[16], last[16]; /* each query's first and one past its last visible key */
    /* Softmax per query, in place, 16 keys per vector (lane k % 16 holds key k whatever key_len, and keys
     * past a row's own are masked, so extra blocks add exact zeros): masked keys get probability 0 and
     * are skipped below. */
    const __m512 vscale = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < nq; j++) {
        const int64_t i = q0 + j, row = row0 + i / group;
        const float *m = mask + row * key_len;
        float *s = scores + j * stride;
        if (softcap > 0.0f)
            for (int64_t k = 0; k < key_len; k++)
                s[k] = m[k] == -INFINITY ? -INFINITY : tanhf(s[k] * scale / softcap) * softcap + m[k];
        __m512 vbest = minus_inf;
        for (int64_t k = 0; k < key_len; k += 16) {
            const __mmask16 lanes = key_len - k >= 16 ? 0xffff : (__mmask16)((1u << (key_len - k)) - 1);
            const __m512 mk = _mm512_mask_loadu_ps(minus_inf, lanes, m + k);
            __m512 v = _mm512_maskz_loadu_ps(lanes, s + k);
            if (softcap <= 0.0f) v = _mm512_add_ps(_mm512_mul_ps(v, vscale), mk); /* rounded as attention_for */
            v = _mm512_mask_mov_ps(minus_inf, _mm512_cmp_ps_mask(mk, minus_inf, _CMP_NEQ_OQ), v);
            _mm512_mask_storeu_ps(s + k, lanes, v);
            vbest = _mm512_max_ps(vbest, v);
        }
        const float best = _mm512_reduce_max_ps(vbest);
        int64_t n_live = 0; /* the probabilities of the keys this query sees, in key order, into live_p */
        first[j] = key_len;
        last[j] = 0;
        if (best != -INFINITY) {
            const __m512 vb = _mm512_set1_ps(best);
            for (int64_t k = 0; k < key_len; k += 16) {
                const __mmask16 lanes = key_len - k >= 16 ? 0xffff : (__mmask16)((1u << (key_len - k)) - 1);
                const __m512 v = _mm512_maskz_loadu_ps(lanes, s + k);
                const __mmask16 live = lanes & _mm512_cmp_ps_mask(v, minus_inf, _CMP_NEQ_OQ);
                const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, vb)));
                /* compressed in a register and stored whole: the lanes past n_live are overwritten by the next
                 * store or never read, and k + 16 <= stride. (A compressing store to memory is microcoded on
                 * AMD Zen 4: a 32-token block's attention took 40% longer with it.) */
                _mm512_storeu_ps(live_p + n_live, _mm512_maskz_compress_ps(live, p));
                n_live += __builtin_popcount(live);
                if (live) {
                    if (first[j] == key_len) first[j] = k + __builtin_ctz(live);
                    last[j] = k + 32 - __builtin_clz((unsigned)live);
                }
                _mm512_mask_storeu_ps(s + k, lanes, p);
            }
        } else {
            for (int64_t k = 0; k < key_len; k++) s[k] = 0.0f;
        }
        /* The denominator in 16 lanes by rank among the visible keys, not by key position: a tree node's
         * ancestors sit apart in the block, on its path decoded alone they are adjacent, and the sum
         * must be the same. */
        __m512 vtotal = _mm512_setzero_ps();
        for (int64_t k = 0; k < n_live; k += 16) {
            const __mmask16 lanes = n_live - k >= 16 ? 0xffff : (__mmask16)((1u << (n_live - k)) - 1);
            vtotal = _mm512_add_ps(vtotal, _mm512_maskz_loadu_ps(lanes, live_p + k));
        }
        const float total_p = _mm512_reduce_add_ps(vtotal);
        inv[j] = total_p > 0.0f ? 1.0f / total_p : 0.0f;
    }
    /* Weighted values: PV_QUERIES queries at a time share each value row's conversion to fp32; each query still
     * adds its keys in order with one FMA per lane. A key it does not see has probability 0 and adds 0 * v,
     * which changes no bit (values are finite: the cache starts zeroed), so keys need no test; the loop covers
     * the keys any of the queries sees. Rows past nq read zeros (live_p, cleared). */
    for (int64_t k = 0; k < stride; k++) live_p[k] = 0.0f;
    for (int64_t j0 = 0; j0 < nq; j0 += PV_QUERIES) {
        const float *p[PV_QUERIES];
        int64_t lo = key_len, hi = 0;
        for (int j = 0; j < PV_QUERIES; j++) {
            p[j] = j0 + j < nq ? scores + (j0 + j) * stride : live_p;
            if (j0 + j < nq && first[j0 + j] < lo) lo = first[j0 + j];
            if (j0 + j < nq && last[j0 + j] > hi) hi = last[j0 + j];
        }
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            __m512 a[PV_QUERIES][4];
            const int vectors = D - d0 < 64 ? (int)((D - d0) / 16) : 4;
#define PV_CALL(V) pv_block(p, values + d0, D, lo, hi, V, a)
            switch (vectors) {
                case 1: PV_CALL(1); break;
                case 2: PV_CALL(2); break;
                case 3: PV_CALL(3); break;
                default: PV_CALL(4); break;
            }
#undef PV_CALL
            for (int j = 0; j < PV_QUERIES && j0 + j < nq; j++) {
                const int64_t i = q0 + j0 + j, row = row0 + i / group, h = kv * group + i % group;
                const __m512 scale_j = _mm512_set1_ps(inv[j0 + j]);
                for (int l = 0; l < vectors; l++)
                    _mm256_storeu_si256((__m256i *)(out + (row * H + h) * D + d0 + 16 * l),
                                        f2bf_x16(_mm512_mul_ps(a[j][l], scale_j)));
            }
        }
    }
}

#endif

#ifdef SD_AMX
/* Key block kb (16 rows of D) of one sequence and kv head; the last, partial one zero-padded into kpad. */
static inline const bf16 *amx_key_tile(const bf16 *keys, int64_t kb, int64_t key_len, int64_t D, bf16 *kpad) {
    if (kb * 16 + 16 <= key_len) return keys + kb * 16 * D;
    memset(kpad, 0, (size_t)(16 * D) * sizeof(bf16));
    memcpy(kpad, keys + kb * 16 * D, (size_t)((key_len - kb * 16) * D) * sizeof(bf16));
    return kpad;
}

/* Sums tile (0 or 6: key k of block kb x query j at k * 16 + j) into scores[j * stride + kb * 16 + k]. */
static inline void amx_scatter_scores(int tile, float *scores, int64_t stride, int64_t kb, int64_t nq) {
    float sums[16 * 16];
    if (tile == 0)
        _tile_stored(0, sums, 64);
    else
        _tile_stored(6, sums, 64);
    __m512 r[16];
    for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(sums + 16 * k);
    transpose16(r); /* r[j]: query j's scores for the block's 16 keys */
    for (int64_t j = 0; j < nq; j++) _mm512_storeu_ps(scores + j * stride + kb * 16, r[j]);
}
#endif

#ifdef SD_AMX
/* Attention with the query-key products on AMX tiles (AMX builds; the softmax and the weighted sum of values
 * as in attention_for). A tile multiplies 16 cached keys (read in place: a key row is a tile row) by 16
 * queries of one sequence and kv head (the rows of the block times the heads sharing that kv head), so a
 * block of 32 tokens reads each key once per 16 queries instead of once per query, and no horizontal sums
 * are left. Each score is the hardware's sum for its own (query, key) pair, independent of the other queries
 * in the tile: a row gets the same bits in any block. Work-shared over (sequence, kv head, 16 queries). */
static void attention_amx_for(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *slots,
                              const float *mask, int64_t B, const int64_t *seq_start, int64_t H, int64_t Hkv,
                              int64_t D, int64_t max_len, int64_t key_len, float scale, float softcap, bf16 *out) {
    const int64_t group = H / Hkv, kblocks = (key_len + 15) / 16, stride = kblocks * 16;
    const int64_t words = D / 2; /* uint32 pairs per query or key row */
    float *scores = malloc((size_t)(17 * stride) * sizeof(float)), *live_p = scores + 16 * stride;
    uint32_t *packed = malloc((size_t)(16 * words) * sizeof(uint32_t));
    bf16 *kpad = malloc((size_t)(16 * D) * sizeof(bf16));
    int64_t *qtiles = malloc((size_t)B * sizeof(int64_t)), units = 0; /* tiles of 16 queries per sequence */
    if (!scores || !packed || !kpad || !qtiles) abort();
    for (int64_t s = 0; s < B; s++) {
        qtiles[s] = ((seq_start[s + 1] - seq_start[s]) * group + 15) / 16;
        units += Hkv * qtiles[s];
    }
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        int64_t b, kv, qt;
        attention_unit(qtiles, Hkv, u, &b, &kv, &qt);
        const int64_t row0 = seq_start[b], queries = (seq_start[b + 1] - row0) * group;
        const int64_t q0 = 16 * qt, nq = queries - q0 < 16 ? queries - q0 : 16;
        const int64_t cache_base = (slots[b] * Hkv + kv) * max_len * D;
        /* queries as TDPBF16PS's second operand, 32 dims per block: word (c * 16 + p) * 16 + j is the pair
         * c * 16 + p of query q0 + j (query i of the unit: row i / group of the block, head kv * group + i % group) */
        for (int64_t j = 0; j < 16; j++) {
            const int64_t i = q0 + j;
            const uint32_t *qrow = (const uint32_t *)(q + ((row0 + i / group) * H + kv * group + i % group) * D);
            for (int64_t w = 0; w < words; w++) packed[w * 16 + j] = j < nq ? qrow[w] : 0;
        }
        const bf16 *keys = k_cache + cache_base;
        if (D == 64) {
            /* The queries stay in tiles 2-3; two key blocks at a time (tiles 1, 4 and 5, 7 into sums 0 and 6)
             * so that one block's products overlap the other's loads. The same sums as below, in the same order. */
            _tile_loadd(2, packed, 64);
            _tile_loadd(3, packed + 256, 64);
            for (int64_t kb = 0; kb < kblocks; kb += 2) {
                const int two = kb + 1 < kblocks;
                const bf16 *k0 = amx_key_tile(keys, kb, key_len, D, kpad);
                _tile_zero(0);
                _tile_loadd(1, k0, 128);
                _tile_loadd(4, k0 + 32, 128);
                _tile_dpbf16ps(0, 1, 2);
                if (two) {
                    const bf16 *k1 = amx_key_tile(keys, kb + 1, key_len, D, kpad);
                    _tile_zero(6);
                    _tile_loadd(5, k1, 128);
                    _tile_loadd(7, k1 + 32, 128);
                    _tile_dpbf16ps(6, 5, 2);
                }
                _tile_dpbf16ps(0, 4, 3);
                if (two) _tile_dpbf16ps(6, 7, 3);
                amx_scatter_scores(0, scores, stride, kb, nq);
                if (two) amx_scatter_scores(6, scores, stride, kb + 1, nq);
            }
        } else {
            for (int64_t kb = 0; kb < kblocks; kb++) {
                const bf16 *k0 = amx_key_tile(keys, kb, key_len, D, kpad);
                _tile_zero(0);
                for (int64_t c = 0; c < D / 32; c++) {
                    _tile_loadd(1, k0 + 32 * c, D * sizeof(bf16));
                    _tile_loadd(2, packed + c * 256, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                amx_scatter_scores(0, scores, stride, kb, nq);
            }
        }
        attention_finish(scores, stride, live_p, mask, v_cache + cache_base, row0, H, kv, group, q0, nq, D, key_len,
                         scale, softcap, out);
    }
    free(qtiles);
    free(kpad);
    free(packed);
    free(scores);
}
#endif

#ifdef SD_AVX512
/* Attention on AVX-512 without tiles, work-shared over units of up to 16 queries of one sequence and kv head.
 * A unit's keys are transposed once into panels of PANEL keys ([D / 2][PANEL] pairs of dimensions, the linear
 * layers' weight layout with the keys as outputs), so one broadcast query pair meets 16 keys per instruction and
 * each score is summed over the dimensions in order in a lane of its own: the same operations whatever the
 * block, with no reduction across lanes (the vector attention_for reduces 16 lanes per query and key, which
 * made a 32-token block's attention cost as much as its MLPs). Then attention_finish, as on AMX. */
#if PANEL != KEY_PANEL
#error "the attention's key panels are KEY_PANEL keys wide"
#endif
static void attention_panels_for(const bf16 *q, const bf16 *k_cache, const uint32_t *k_panels, const bf16 *v_cache,
                                 const int64_t *slots, const float *mask, int64_t B, const int64_t *seq_start,
                                 int64_t H, int64_t Hkv, int64_t D, int64_t max_len, int64_t key_len, float scale,
                                 float softcap, bf16 *out) {
    const int64_t group = H / Hkv, words = D / 2;
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t kpanels = (key_len + PANEL - 1) / PANEL, stride = kpanels * PANEL;
    float *scores = malloc((size_t)(17 * stride) * sizeof(float)), *live_p = scores + 16 * stride;
    uint32_t *kpanel = malloc((size_t)(stride * words) * sizeof(uint32_t));
    bf16 *qb = malloc((size_t)(16 * D) * sizeof(bf16));
    float *qf = malloc((size_t)(16 * D) * sizeof(float));
    int64_t *chunks = malloc((size_t)B * sizeof(int64_t)), units = 0;
    if (!scores || !kpanel || !qb || !qf || !chunks) abort();
    /* units of up to 16 queries; at least one unit per thread where there are queries enough (one token of a
     * model with one kv head): then each sequence's queries in as many even chunks */
    int64_t sixteens = 0;
    for (int64_t s = 0; s < B; s++) sixteens += Hkv * (((seq_start[s + 1] - seq_start[s]) * group + 15) / 16);
    const int64_t split = sixteens < threads ? (threads + B * Hkv - 1) / (B * Hkv) : 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t queries = (seq_start[s + 1] - seq_start[s]) * group;
        chunks[s] = split == 0 ? (queries + 15) / 16 : split < queries ? split : queries;
        units += Hkv * chunks[s];
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        int64_t b, kv, c;
        attention_unit(chunks, Hkv, u, &b, &kv, &c);
        const int64_t row0 = seq_start[b], queries = (seq_start[b + 1] - row0) * group;
        const int64_t base = queries / chunks[b], extra = queries % chunks[b];
        const int64_t q0 = c * base + (c < extra ? c : extra), nq = base + (c < extra);
        const int64_t cache_base = (slots[b] * Hkv + kv) * max_len * D;
        for (int64_t j = 0; j < nq; j++) {
            const int64_t i = q0 + j;
            const bf16 *src = q + ((row0 + i / group) * H + kv * group + i % group) * D;
            memcpy(qb + j * D, src, (size_t)D * sizeof(bf16));
            if (!X_IS_BF16)
                for (int64_t d = 0; d < D; d++) qf[j * D + d] = bf2f(src[d]);
        }
        /* keys [key_len, D] as words [key_len, D / 2], 16 x 16 blocks transposed into the panels, unless the
         * cache keeps them in panels already (key_to_panels: the same words in the same places) */
        const uint32_t *keys = (const uint32_t *)(k_cache + cache_base);
        const uint32_t *panels = k_panels ? k_panels + cache_base / 2 : kpanel;
        if (!k_panels)
        for (int64_t k0 = 0; k0 < stride; k0 += 16) {
            const int64_t nkeys = key_len - k0 < 16 ? (key_len - k0 > 0 ? key_len - k0 : 0) : 16;
            uint32_t *dst = kpanel + (k0 / PANEL) * PANEL * words + k0 % PANEL;
            for (int64_t w0 = 0; w0 < words; w0 += 16) {
                const int64_t nw = words - w0 < 16 ? words - w0 : 16;
                const __mmask16 lanes = (__mmask16)(nw == 16 ? 0xffffu : (1u << nw) - 1);
                __m512 r[16];
                for (int64_t i = 0; i < 16; i++)
                    r[i] = i < nkeys ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(lanes, keys + (k0 + i) * words + w0))
                                     : _mm512_setzero_ps();
                transpose16(r); /* r[w]: word w0 + w of the 16 keys */
                for (int64_t w = 0; w < nw; w++) _mm512_storeu_ps((float *)(dst + (w0 + w) * PANEL), r[w]);
            }
        }
        for (int64_t p = 0; p < kpanels; p++) {
            const bf16 *wp = (const bf16 *)(panels + p * PANEL * words);
            for (int64_t m = 0; m < nq;) {
                const int mb = panel_chunk(nq, m);
                __m512 acc[2 * PANEL_MB];
#define SCORE_ACC(R) panel_acc(wp, qb + m * D, qf + m * D, D, R, acc)
                PANEL_ROWS_SWITCH(mb, SCORE_ACC)
#undef SCORE_ACC
                for (int j = 0; j < mb; j++) {
                    _mm512_storeu_ps(scores + (m + j) * stride + p * PANEL, acc[2 * j]);
                    _mm512_storeu_ps(scores + (m + j) * stride + p * PANEL + 16, acc[2 * j + 1]);
                }
                m += mb;
            }
        }
        attention_finish(scores, stride, live_p, mask, v_cache + cache_base, row0, H, kv, group, q0, nq, D, key_len,
                         scale, softcap, out);
    }
    free(chunks);
    free(qf);
    free(qb);
    free(kpanel);
    free(scores);
}
#endif

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
#ifdef SD_AVX512
    /* 16 features at a time (masked at the ends of a row and of the share): every value comes from the same
     * vector operations wherever it falls. */
    for (int64_t idx = lo; idx < hi;) {
        const int64_t r = idx / I, i = idx % I;
        int64_t n = I - i < hi - idx ? I - i : hi - idx;
        if (n > 16) n = 16;
        const __mmask16 lanes = (__mmask16)((1u << n) - 1);
        const bf16 *g = gate_up + r * 2 * I + i;
        _mm256_mask_storeu_epi16(out + idx, lanes, f2bf_x16(act_x16(load_bf16x16_masked(g, lanes),
                                                                     load_bf16x16_masked(g + I, lanes), gelu)));
        idx += n;
    }
#else
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
#endif
#pragma omp barrier
}

/* ---- the decoder layers ------------------------------------------------------------------------------ */

/* Weights of one layer (NULL where the architecture has none). Mirrored by a ctypes Structure. */
typedef struct {
    const bf16 *attn_norm, *bqkv, *q_norm, *k_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm;
    const void *wqkv, *wo, *w_gate_up, *w_down;                  /* bf16, or int8 when the scale is set */
    const bf16 *wqkv_scale, *wo_scale, *w_gate_up_scale, *w_down_scale;  /* per output feature, or NULL */
    int64_t sliding;
    int64_t wqkv_fmt, wo_fmt, w_gate_up_fmt, w_down_fmt; /* SD_W_DENSE, or the GGUF-native layout */
} sd_layer;

/* One linear layer of the forward: dense (bf16 / int8) or GGUF-native weights. */
static void layer_linear(const bf16 *x, const void *w, const bf16 *scale, int64_t fmt, const bf16 *bias, bf16 *y,
                         int64_t M, int64_t N, int64_t K, float *xf, float *qbuf) {
    if (fmt == SD_W_DENSE) {
        linear_any(x, w, scale, bias, y, M, N, K, xf);
        return;
    }
    if (fmt == SD_W_PANELS) {
        linear_panels(x, (const bf16 *)w, bias, y, M, N, K, xf);
        return;
    }
    if (fmt & SD_W_QPANELS) {
        linear_qp(x, (const uint8_t *)w, (int)(fmt & ~SD_W_QPANELS), bias, y, M, N, K, qbuf);
        return;
    }
    linear_q(x, (const uint8_t *)w, (int)fmt, bias, y, M, N, K, qbuf);
}

typedef struct {
    int64_t dim, heads, kv_heads, head_dim, inter, max_len;
    float eps, scale, softcap;
    int32_t gemma, gelu;
    const bf16 *final_norm;
} sd_model;

/* Runs layers[0 .. num_layers) with their KV caches [slots, kv_heads, max_len, head_dim] on the residual
 * stream x [rows, dim] (updated in place) and writes the final-normed hidden states to `normed` [rows, dim].
 * The rows are B sequences packed one after another (sequence b: rows seq_start[b] .. seq_start[b + 1], in its
 * cache slot slots[b]; a block of T tokens each is seq_start[b] = b * T). Per-forward inputs: cache position
 * of each row, additive masks [rows, key_len] and RoPE tables [rows, D/2] for full and sliding-window layers.
 * One parallel region for the whole pass: threads meet at a barrier between steps instead of being woken
 * for each of them. Drafters that read the target's features (EAGLE, Medusa) ask for the residual stream
 * after chosen layers: capture_at[l] >= 0 copies it after layer l into captured[capture_at[l]] [rows, dim]
 * (capture_at may be NULL: nothing is copied, nothing costs). Returns 0, or -1 when scratch memory could not
 * be allocated. */
int sd_forward(const sd_layer *layers, int64_t num_layers, const sd_model *mdl, bf16 *const *k_caches,
               bf16 *const *v_caches, uint32_t *const *k_panels, bf16 *x, bf16 *normed,
               const int64_t *slots, const int64_t *cache_pos, const float *mask_full, const float *mask_sliding,
               int64_t key_len, const float *cos_full, const float *sin_full, const float *cos_sliding,
               const float *sin_sliding, int64_t B, const int64_t *seq_start, int threads,
               const int64_t *capture_at, bf16 *captured) {
    const int64_t rows = seq_start[B], dim = mdl->dim, H = mdl->heads, Hkv = mdl->kv_heads, D = mdl->head_dim;
    const int64_t I = mdl->inter, qkv_width = (H + 2 * Hkv) * D;
    const int64_t widest = max64(max64(qkv_width, 2 * I), dim);
    const int64_t per_thread = key_len + 3 * D; /* attention_for's, or rope_store's D / 2 */
    bf16 *buf = malloc((size_t)rows * (size_t)(widest + 2 * H * D + I + dim) * sizeof(bf16));
    /* xf: a dense linear layer's input widened to fp32; qbuf: a GGUF-native layer's input as integers */
    const int64_t qfloats = q_scratch_floats(rows, max64(widest, I));
    float *fbuf = malloc((size_t)(per_thread * threads + rows * max64(widest, I) + qfloats) * sizeof(float));
    int64_t *row_slot = malloc((size_t)rows * sizeof(int64_t)); /* the cache slot each row writes */
    if (!buf || !fbuf || !row_slot) {
        free(buf);
        free(fbuf);
        free(row_slot);
        return -1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = seq_start[b]; r < seq_start[b + 1]; r++) row_slot[r] = slots[b];
    bf16 *wide = buf, *q = wide + rows * widest, *att = q + rows * H * D, *act = att + rows * H * D;
    bf16 *h = act + rows * I;
    float *xf = fbuf + per_thread * threads, *qbuf = xf + rows * max64(widest, I);
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        float *scratch = fbuf + per_thread * omp_get_thread_num();
#else
        float *scratch = fbuf;
#endif
        add_rmsnorm(x, NULL, NULL, layers[0].attn_norm, normed, rows, dim, mdl->eps, mdl->gemma);
        for (int64_t l = 0; l < num_layers; l++) {
            const sd_layer *L = &layers[l];
            const float *mask = L->sliding ? mask_sliding : mask_full;
            const float *cs = L->sliding ? cos_sliding : cos_full, *sn = L->sliding ? sin_sliding : sin_full;
            const bf16 *next_norm = l + 1 < num_layers ? layers[l + 1].attn_norm : mdl->final_norm;

            layer_linear(normed, L->wqkv, L->wqkv_scale, L->wqkv_fmt, L->bqkv, wide, rows, qkv_width, dim, xf,
                         qbuf);
            uint32_t *kp = k_panels ? k_panels[l] : NULL;
            rope_store(wide, L->q_norm, L->k_norm, mdl->eps, mdl->gemma, cs, sn, row_slot, cache_pos, k_caches[l],
                       v_caches[l], kp, rows, H, Hkv, D, mdl->max_len, q, scratch);
#ifdef SD_AMX
            if (sd_amx_active && D % 32 == 0)
                attention_amx_for(q, k_caches[l], v_caches[l], slots, mask, B, seq_start, H, Hkv, D, mdl->max_len,
                                  key_len, mdl->scale, mdl->softcap, att);
            else
#endif
#ifdef SD_AVX512
            attention_panels_for(q, k_caches[l], kp, v_caches[l], slots, mask, B, seq_start, H, Hkv, D,
                                 mdl->max_len, key_len, mdl->scale, mdl->softcap, att);
#else
            attention_for(q, k_caches[l], v_caches[l], row_slot, mask, rows, H, Hkv, D, mdl->max_len, key_len,
                          mdl->scale, mdl->softcap, att, scratch);
#endif
            layer_linear(att, L->wo, L->wo_scale, L->wo_fmt, NULL, h, rows, dim, H * D, xf, qbuf);
            add_rmsnorm(x, h, L->post_attn_norm, L->mlp_norm, normed, rows, dim, mdl->eps, mdl->gemma);
            layer_linear(normed, L->w_gate_up, L->w_gate_up_scale, L->w_gate_up_fmt, NULL, wide, rows, 2 * I, dim, xf,
                         qbuf);
            act_mul_for(wide, act, rows, I, mdl->gelu);
            layer_linear(act, L->w_down, L->w_down_scale, L->w_down_fmt, NULL, h, rows, dim, I, xf, qbuf);
            add_rmsnorm(x, h, L->post_mlp_norm, next_norm, normed, rows, dim, mdl->eps, mdl->gemma);
            if (capture_at && capture_at[l] >= 0) {
#pragma omp single
                memcpy(captured + capture_at[l] * rows * dim, x, (size_t)(rows * dim) * sizeof(bf16));
            }
        }
    }
    free(buf);
    free(fbuf);
    free(row_slot);
    return 0;
}

/* ---- greedy decoding's argmax ------------------------------------------------------------------------------- */

#define ARGMAX_CHUNK 128

static inline float argmax_value(const void *row, int is_bf16, int64_t i) {
    return is_bf16 ? bf2f(((const bf16 *)row)[i]) : ((const float *)row)[i];
}

/* The maximum of row[c .. end) (ignoring NaNs) and whether a NaN is among them. */
static float chunk_max(const void *row, int is_bf16, int64_t c, int64_t end, int *has_nan) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = c;
#ifdef SD_AVX512
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= end; i += 16) {
        const __m512 v = is_bf16 ? load_bf16x16_masked((const bf16 *)row + i, 0xffff)
                                 : _mm512_loadu_ps((const float *)row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(v, vm); /* a NaN in v leaves vm as it was */
    }
    m = _mm512_reduce_max_ps(vm);
    nan = unordered != 0;
#endif
    for (; i < end; i++) {
        const float f = argmax_value(row, is_bf16, i);
        nan |= f != f;
        m = f > m ? f : m;
    }
    *has_nan = nan;
    return m;
}

/* out[r] = the index of the first maximum of row r of x [R, V] (bf16 when is_bf16, else fp32), a NaN counting
 * as the maximum (its first occurrence): torch.argmax's answer. Each chunk of ARGMAX_CHUNK values is reduced
 * to its maximum and a NaN flag (16 lanes at a time on AVX-512); only the first chunk holding the row's
 * maximum (or its first NaN) is then searched element by element. One call for what torch does in five ops,
 * each of them slow right after a forward pass has evicted its code and data from the caches. */
void sd_argmax_rows(const void *x, int is_bf16, int64_t R, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < R; r++) {
        const void *row = is_bf16 ? (const void *)((const bf16 *)x + r * V) : (const void *)((const float *)x + r * V);
        float best = -INFINITY;
        int64_t best_chunk = 0, nan_chunk = -1;
        for (int64_t c = 0; c < V; c += ARGMAX_CHUNK) {
            int nan;
            const float m = chunk_max(row, is_bf16, c, c + ARGMAX_CHUNK < V ? c + ARGMAX_CHUNK : V, &nan);
            if (nan) {
                nan_chunk = c;
                break;
            }
            if (m > best) {
                best = m;
                best_chunk = c;
            }
        }
        const int64_t c = nan_chunk >= 0 ? nan_chunk : best_chunk;
        const int64_t end = c + ARGMAX_CHUNK < V ? c + ARGMAX_CHUNK : V;
        int64_t index = c;
        for (int64_t i = c; i < end; i++) {
            const float f = argmax_value(row, is_bf16, i);
            if (nan_chunk >= 0 ? f != f : f == best) {
                index = i;
                break;
            }
        }
        out[r] = index;
    }
}

/* a ranks above b in torch.topk's order: larger first, a NaN above everything; equal values by lower index. */
static inline int topk_before(float a, int64_t ia, float b, int64_t ib) {
    const int na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    return a > b || (a == b && ia < ib);
}

/* Insert (value, index) into the best-first list of n <= k entries; returns the new length. */
static int topk_insert(float *vals, int64_t *idx, int n, int k, float v, int64_t i) {
    if (n == k && !topk_before(v, i, vals[k - 1], idx[k - 1])) return n;
    int p = n < k ? n : k - 1;
    while (p > 0 && topk_before(v, i, vals[p - 1], idx[p - 1])) {
        vals[p] = vals[p - 1];
        idx[p] = idx[p - 1];
        p--;
    }
    vals[p] = v;
    idx[p] = i;
    return n < k ? n + 1 : n;
}

/* out [R, k] = the indices of the k largest values of each row of x [R, V] (bf16 when is_bf16, else fp32),
 * best first, a NaN ranking above every number, equal values by lower index: the values torch.topk gives.
 * The k best entries of a row lie in the k chunks of ARGMAX_CHUNK with the largest maxima (a chunk outside
 * them has k entries at least as large elsewhere), so only those are searched. k <= 64. */
void sd_topk_rows(const void *x, int is_bf16, int64_t R, int64_t V, int64_t k, int64_t *out) {
    float vals[64], chunk_vals[64];
    int64_t idx[64], chunks[64];
    for (int64_t r = 0; r < R; r++) {
        const void *row = is_bf16 ? (const void *)((const bf16 *)x + r * V) : (const void *)((const float *)x + r * V);
        int nc = 0, n = 0;
        for (int64_t c = 0; c < V; c += ARGMAX_CHUNK) {
            int nan;
            float m = chunk_max(row, is_bf16, c, c + ARGMAX_CHUNK < V ? c + ARGMAX_CHUNK : V, &nan);
            if (nan) m = NAN;
            nc = topk_insert(chunk_vals, chunks, nc, (int)k, m, c);
        }
        for (int j = 0; j < nc; j++) {
            const int64_t c = chunks[j], end = c + ARGMAX_CHUNK < V ? c + ARGMAX_CHUNK : V;
            for (int64_t i = c; i < end; i++) n = topk_insert(vals, idx, n, (int)k, argmax_value(row, is_bf16, i), i);
        }
        for (int64_t j = 0; j < k; j++) out[r * k + j] = j < n ? idx[j] : 0;
    }
}

/* Whether SD_W_Q8 panels asked for int8 activations (SD_W_X8) take them (on: 1 or 0 sets it where VPDPBUSD is
 * at hand, -1 only asks); the value before. */
int sd_q8_int8_set(int on) {
    const int previous = sd_q8_int8;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (on >= 0) sd_q8_int8 = on != 0;
#else
    (void)on;
#endif
    return previous;
}

/* Whether GGUF panels can take AMX-INT8 tiles in this build and process (sd_q_amx_rows sets from when). */
int sd_q_amx(void) {
#ifdef SD_AMX_INT8
    return sd_amx_active;
#else
    return 0;
#endif
}
