"""C source of the engine's CPU kernels (built and bound by `strop.engine.kernels`).

Plain C with GCC vector extensions (8-float vectors), compiled -O3 -march=native. Shapes are
row-major fp32; "blocked" weights are [out / 32, in, 32] so a 32-output pass streams one
contiguous block. Each function's comment states its contract. The attention kernels live in
`strop.engine.csrc_attention`, the sampler in `strop.engine.csrc_sampling`, the one-call decode
step in `strop.engine.csrc_decode`; `SOURCE` is the whole translation unit.
"""

from strop.engine.csrc_attention import ATTENTION
from strop.engine.csrc_decode import DECODE
from strop.engine.csrc_sampling import SAMPLING

_CORE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* unaligned 8-float vectors */
#define BCAST(s) ((v8){(s), (s), (s), (s), (s), (s), (s), (s)})

typedef int32_t v8i __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

/* exp over 8 lanes (Cephes expf: round-to-nearest range reduction by ln 2 in two parts, a degree-5
   polynomial, the exponent added into the float bits): within 2 ulp of expf on [-87, 88]. */
static inline v8 exp8(v8 x) {
    const v8 hi = BCAST(88.0f), lo = BCAST(-87.0f);
    v8i m = x > hi;  /* lane masks: all ones where true (C has no vector ?:) */
    x = (v8)(((v8i)hi & m) | ((v8i)x & ~m));
    m = x < lo;
    x = (v8)(((v8i)lo & m) | ((v8i)x & ~m));
    const v8 shifter = BCAST(12582912.0f);  /* 1.5 * 2^23: adding it rounds to an integer */
    const v8 t = x * BCAST(1.44269504088896341f) + shifter;
    const v8 n = t - shifter;
    const v8 r = (x - n * BCAST(0.693359375f)) + n * BCAST(2.12194440e-4f);
    v8 p = BCAST(1.9875691500e-4f);
    p = p * r + BCAST(1.3981999507e-3f);
    p = p * r + BCAST(8.3334519073e-3f);
    p = p * r + BCAST(4.1665795894e-2f);
    p = p * r + BCAST(1.6666665459e-1f);
    p = p * r + BCAST(5.0000001201e-1f);
    const v8 y = p * r * r + r + BCAST(1.0f);
    const v8i e = ((v8i)t - (v8i)shifter + 127) << 23;  /* 2^n */
    return y * (v8)e;
}

static inline v8 vmax(v8 a, v8 b) {
    const v8i m = a > b;
    return (v8)(((v8i)a & m) | ((v8i)b & ~m));
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Lane shuffles of two 8-float vectors (indices 0-7 pick from a, 8-15 from b). */
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Weights are fp32, or bf16 when the engine's weights are exactly bf16 values (as the trainer
   ships them): half the bytes to stream, and widening bf16 to fp32 is exact, so both give the same
   bits. LD2 loads 16 weights (columns c..c+15 of one row) as two vectors, ST2 stores two such
   accumulators as y[c..c+15]. bf16 loads them with one 32-byte load, the even columns by a shift and
   the odd ones by a mask (no lane shuffle per weight); the accumulators then hold even and odd
   columns and ST2 interleaves them once per tile. Every output is the same sum in the same order. */
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
#define LD_F32(p) (*(const v8 *)(p))
#define LD2_F32(p, e, o) ((e) = LD_F32(p), (o) = LD_F32((p) + 8))
#define ST2_F32(y, e, o) (*(v8 *)(y) = (e), *(v8 *)((y) + 8) = (o))
#define LD2_BF16(p, e, o) ((e) = (v8)(*(const v8u *)(p) << 16), (o) = (v8)(*(const v8u *)(p) & 0xFFFF0000u))
#define ST2_BF16(y, e, o) (*(v8 *)(y) = SHUF(e, o, 0, 8, 1, 9, 2, 10, 3, 11), \
                           *(v8 *)((y) + 8) = SHUF(e, o, 4, 12, 5, 13, 6, 14, 7, 15))

/* W [m, n] is stored in column blocks [n / 32, m, 32] (n % 32 == 0), so a pass over 16 or 32
   columns streams contiguous rows. tile: y[r, j0 : j0 + 16 P] = sum_i a[r, i] W[i, j0 : j0 + 16 P]
   for R rows (strides as, ys) and P pairs of 16 columns from j0 (pairs may run into the next block).
   R and P are constants once inlined, so the R x 2P accumulators stay in registers and each weight
   load feeds R FMAs. Shapes used: 1 x 4 (one row: 8 FMA chains hide FMA latency), 2 x 2, 3 x 2,
   and 4, 5 or 6 rows x 1.
   vecmat: R <= 4 rows (an expert's group of tokens), whole width. linear: N rows, block by block,
   every row group against one block while it sits in L1, so the weights stream from memory once. */
#define MATRIX_KERNELS(SUF, WT, LD2, ST2)                                                                 \
static inline __attribute__((always_inline)) void tile##SUF(const float *restrict a, int64_t as,          \
        const WT *restrict W, float *restrict y, int64_t ys, int64_t m, int64_t j0, const int R, const int P) { \
    const WT *src[4];                                                                                     \
    for (int p = 0; p < P; p++) src[p] = W + ((j0 + 16 * p) / 32) * 32 * m + (j0 + 16 * p) % 32;         \
    v8 acc[6][8];                                                                                         \
    for (int r = 0; r < R; r++)                                                                           \
        for (int v = 0; v < 2 * P; v++) acc[r][v] = BCAST(0.0f);                                          \
    for (int64_t i = 0; i < m; i++) {                                                                     \
        v8 w[8];                                                                                          \
        for (int p = 0; p < P; p++) LD2(src[p] + i * 32, w[2 * p], w[2 * p + 1]);                         \
        for (int r = 0; r < R; r++) {                                                                     \
            const v8 x = BCAST(a[r * as + i]);                                                            \
            for (int v = 0; v < 2 * P; v++) acc[r][v] += x * w[v];                                        \
        }                                                                                                 \
    }                                                                                                     \
    for (int r = 0; r < R; r++)                                                                           \
        for (int p = 0; p < P; p++) ST2(y + r * ys + j0 + 16 * p, acc[r][2 * p], acc[r][2 * p + 1]);     \
}                                                                                                         \
static void vecmat##SUF(const float *restrict a, int64_t R, const WT *restrict W, float *restrict y,      \
                        int64_t m, int64_t n) {                                                           \
    int64_t j = 0;                                                                                        \
    switch (R) {                                                                                          \
    case 1:                                                                                               \
        for (; j + 64 <= n; j += 64) tile##SUF(a, m, W, y, n, m, j, 1, 4);                                \
        for (; j < n; j += 32) tile##SUF(a, m, W, y, n, m, j, 1, 2);                                      \
        break;                                                                                            \
    case 2: for (; j < n; j += 32) tile##SUF(a, m, W, y, n, m, j, 2, 2); break;                           \
    case 3: for (; j < n; j += 32) tile##SUF(a, m, W, y, n, m, j, 3, 2); break;                           \
    default: for (; j < n; j += 16) tile##SUF(a, m, W, y, n, m, j, 4, 1);                                 \
    }                                                                                                     \
}                                                                                                         \
static void linear##SUF(const float *restrict x, int64_t N, const WT *restrict W, float *restrict y,      \
                        int64_t m, int64_t n) {                                                           \
    if (N <= 4) {                                                                                         \
        vecmat##SUF(x, N, W, y, m, n);                                                                    \
        return;                                                                                           \
    }                                                                                                     \
    for (int64_t j = 0; j < n; j += 32) {                                                                 \
        int64_t r = 0;                                                                                    \
        for (; r + 6 <= N; r += 6)                                                                        \
            for (int64_t h = 0; h < 32; h += 16) tile##SUF(x + r * m, m, W, y + r * n, n, m, j + h, 6, 1); \
        const float *xr = x + r * m;                                                                      \
        float *yr = y + r * n;                                                                            \
        switch (N - r) {                                                                                  \
        case 5: for (int64_t h = 0; h < 32; h += 16) tile##SUF(xr, m, W, yr, n, m, j + h, 5, 1); break;   \
        case 4: for (int64_t h = 0; h < 32; h += 16) tile##SUF(xr, m, W, yr, n, m, j + h, 4, 1); break;   \
        case 3: tile##SUF(xr, m, W, yr, n, m, j, 3, 2); break;                                            \
        case 2: tile##SUF(xr, m, W, yr, n, m, j, 2, 2); break;                                            \
        case 1: tile##SUF(xr, m, W, yr, n, m, j, 1, 2); break;                                            \
        }                                                                                                 \
    }                                                                                                     \
}
MATRIX_KERNELS(, float, LD2_F32, ST2_F32)
MATRIX_KERNELS(_b16, uint16_t, LD2_BF16, ST2_BF16)

/* y [N, n] = x [N, m] @ W^T for W bf16 in column blocks [n / 32, m, 32] (the output head). */
void linear_bf16(const float *restrict x, int64_t N, const uint16_t *restrict W, float *restrict y,
                 int64_t m, int64_t n) {
    linear_b16(x, N, W, y, m, n);
}

/* h [N,D] += a (when a is not NULL), then out = h * rsqrt(mean(h^2) + eps) * w. */
void add_rmsnorm(float *restrict h, const float *restrict a, const float *restrict w, float *restrict out,
                 int64_t N, int64_t D, float eps) {
    for (int64_t n = 0; n < N; n++) {
        float *hr = h + n * D;
        if (a) for (int64_t i = 0; i < D; i++) hr[i] += a[n * D + i];
        const float r = 1.0f / sqrtf(dot(hr, hr, D) / (float)D + eps);
        for (int64_t i = 0; i < D; i++) out[n * D + i] = hr[i] * r * w[i];
    }
}

/* y [N, n] = x [N, m] @ W (+ bias, may be NULL) for W in 32-column blocks [n / 32, m, 32]. */
static void linear_rows(const float *restrict x, int64_t N, const float *restrict W, const float *restrict bias,
                        float *restrict y, int64_t m, int64_t n) {
    linear(x, N, W, y, m, n);
    if (bias)
        for (int64_t r = 0; r < N; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

"""

_MOE = r"""
/* A softmax router's choice, as `strop.model.routing.route` makes it: per row of logits [N, E],
   probabilities softmax(logits), the K largest in descending order (ties: lower expert id
   first) into ids [N, K], their probabilities (renormalised to sum 1 when norm) into w [N, K]. */
void route_softmax(const float *restrict logits, int64_t *restrict ids, float *restrict w, int64_t N, int64_t E,
                   int64_t K, int64_t norm) {
    float pr[E];
    for (int64_t n = 0; n < N; n++) {
        const float *l = logits + n * E;
        float m = l[0], z = 0.0f;
        for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        for (int64_t e = 0; e < E; e++) z += (pr[e] = expf(l[e] - m));
        for (int64_t e = 0; e < E; e++) pr[e] /= z;
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (pr[e] >= 0.0f && (best < 0 || pr[e] > pr[best])) best = e;
            if (best < 0) best = k % E;  /* NaN logits: stay in bounds (the output is NaN anyway) */
            ids[n * K + k] = best;
            s += (w[n * K + k] = pr[best]);
            pr[best] = -1.0f;  /* taken */
        }
        if (norm)
            for (int64_t k = 0; k < K; k++) w[n * K + k] /= s;
    }
}

/* x [N,H]; ids, w [N,K] (expert ids, gate weights); gu [E,H,2I] and dn [E,I,H] (transposed
   projections; bf16 when `bf16`, else fp32); out [N,H]. Scratch: hbuf MOE_GROUP * (3I + 2H) floats,
   ybuf [N*K,H], order [N*K], start [E+1]. H and 2I are multiples of 32. Assignments go expert by
   expert, up to MOE_GROUP at a time through the matrix kernels, so each expert's weights are read
   once per group and stay in cache for all its tokens. */
#define MOE_GROUP 16
void moe_experts(const float *restrict x, const int64_t *restrict ids, const float *restrict w,
                 const void *restrict gu, const void *restrict dn, int64_t bf16, float *restrict out,
                 float *restrict hbuf, float *restrict ybuf, int64_t *restrict order, int64_t *restrict start,
                 int64_t N, int64_t K, int64_t E, int64_t H, int64_t I) {
    const int64_t A = N * K, I2 = 2 * I;
    float *xin = hbuf + MOE_GROUP * I2, *act = xin + MOE_GROUP * H, *yout = act + MOE_GROUP * I;
    memset(start, 0, (E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < A; a++) start[ids[a] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t a = 0; a < A; a++) order[start[ids[a]]++] = a;  /* counting sort by expert */
    for (int64_t r = 0; r < A;) {
        const int64_t e = ids[order[r]];
        int64_t R = 1;  /* this expert's next (up to) MOE_GROUP assignments share every weight load */
        while (R < MOE_GROUP && r + R < A && ids[order[r + R]] == e) R++;
        for (int64_t q = 0; q < R; q++) memcpy(xin + q * H, x + (order[r + q] / K) * H, H * sizeof(float));
        const int64_t g_at = e * H * I2, d_at = e * I * H;
        if (bf16) linear_b16(xin, R, (const uint16_t *)gu + g_at, hbuf, H, I2);
        else linear(xin, R, (const float *)gu + g_at, hbuf, H, I2);
        for (int64_t q = 0; q < R; q++)  /* silu(gate) * up, 8 lanes at a time */
            for (int64_t i = 0; i < I; i += 8) {
                const v8 g = *(const v8 *)(hbuf + q * I2 + i), up = *(const v8 *)(hbuf + q * I2 + I + i);
                *(v8 *)(act + q * I + i) = g / (BCAST(1.0f) + exp8(-g)) * up;
            }
        if (bf16) linear_b16(act, R, (const uint16_t *)dn + d_at, yout, I, H);
        else linear(act, R, (const float *)dn + d_at, yout, I, H);
        for (int64_t q = 0; q < R; q++) memcpy(ybuf + order[r + q] * H, yout + q * H, H * sizeof(float));
        r += R;
    }
    for (int64_t n = 0; n < N; n++) {  /* gate-weighted sum over k, in k order */
        float *on = out + n * H;
        for (int64_t o = 0; o < H; o++) on[o] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float wk = w[n * K + k], *yr = ybuf + (n * K + k) * H;
            for (int64_t o = 0; o < H; o++) on[o] += wk * yr[o];
        }
    }
}
"""

SOURCE = _CORE + ATTENTION + SAMPLING + _MOE + DECODE
