/* Which multiply a verification block should run on an AVX512-BF16 CPU without AMX: VDPBF16PS (32 bf16
 * products per instruction) or VFMADD (16 fp32 products, on weights widened from bf16).
 *
 * Why measure: the two differ by CPU far more than their widths suggest. On an Intel Xeon (Emerald Rapids
 * class, AMX hidden by the hypervisor) VDPBF16PS zmm retires about 1.25 G/s per core against 4.6 G/s for
 * VFMADD zmm, so fp32 does 1.8x the products per second; AMD Zen 4 has the opposite ratio. Printed: the
 * instructions per second of each, 16 independent accumulators fed from 8 registers (no memory, no shared
 * operand the compiler could merge), best of 5, on one core. Built and run once per CPU by cpu_kernels.py. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ROUNDS 2000000L

#define RATE(OP)                                                                                             \
    do {                                                                                                     \
        __m512 a[16], w[4], x[4];                                                                            \
        for (int i = 0; i < 4; i++) {                                                                        \
            w[i] = _mm512_set1_ps(1.0f + 1e-3f * i);                                                         \
            x[i] = _mm512_set1_ps(1e-7f * (i + 1));                                                          \
        }                                                                                                    \
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();                                             \
        const double t = now();                                                                              \
        for (long r = 0; r < ROUNDS; r++) {                                                                  \
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)                                              \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[4 * i + j] = OP(a[4 * i + j], w[i], x[j]); \
            for (int i = 0; i < 4; i++) __asm__ volatile("" : "+v"(w[i]), "+v"(x[i]));                       \
        }                                                                                                    \
        const double rate = 16.0 * ROUNDS / (now() - t);                                                     \
        for (int i = 0; i < 16; i++) {                                                                       \
            __asm__ volatile("" : "+v"(a[i]));                                                               \
            sink += a[i][0];                                                                                 \
        }                                                                                                    \
        if (rate > best) best = rate;                                                                        \
    } while (0)

#define DOT(a, w, x) _mm512_dpbf16_ps(a, (__m512bh)(w), (__m512bh)(x))
#define FMA(a, w, x) _mm512_fmadd_ps(w, x, a)

int main(void) {
    float sink = 0;
    double dot = 0, fma = 0;
    for (int rep = 0; rep < 5; rep++) { /* interleaved, so a busy moment slows both */
        double best = dot;
        RATE(DOT);
        dot = best;
        best = fma;
        RATE(FMA);
        fma = best;
    }
    printf("%.4g %.4g %d\n", dot, fma, sink == 1.2345f);
    return 0;
}
