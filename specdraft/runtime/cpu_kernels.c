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
 * rows, 8 independent FMA chains, 8 weight streams in flight. */
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

/* Weight rows per tile for M input rows (at most 16: tiles stay inside one work-shared block of 16). */
static inline int tile_rows(int64_t M) { return M == 1 ? NB_DECODE : M == 2 ? 4 : M == 3 ? 3 : NB_VERIFY; }

/* Input rows of the chunk starting at row m: ceil(M / MB_MAX) chunks of near-equal size (7 rows go as 4 + 3,
 * never 6 + 1, whose single row would leave the FMAs waiting on 2 chains). */
static inline int input_chunk(int64_t M, int64_t m) {
    const int64_t chunks = (M + MB_MAX - 1) / MB_MAX, base = M / chunks, extra = M % chunks;
    /* the first `extra` chunks take base + 1 rows */
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

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

/* Work-shared over blocks of 16 output features: call inside a parallel region (or alone, serially).
 * bf16 weights read xin; int8 weights (scale != NULL, one scale per output) read x32, x widened to fp32. */
static void linear_for(const xin_t *xin, const float *x32, const void *w, const bf16 *scale, const bf16 *bias,
                       bf16 *y, int64_t M, int64_t N, int64_t K) {
    const int64_t pf = (int64_t)sd_prefetch_tiles * 4 * K;
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
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < rows * I; idx++) {
        const int64_t r = idx / I, i = idx % I;
        const float g = bf2f(gate_up[r * 2 * I + i]), u = bf2f(gate_up[r * 2 * I + I + i]);
        float a;
        if (gelu)
            a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        else
            a = g / (1.0f + expf(-g));
        out[idx] = f2bf(a * u);
    }
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
