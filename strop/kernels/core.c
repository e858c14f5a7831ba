/* The CPU kernels' shared part (built and bound by `strop.kernels`): vector helpers, the matrix
   kernels, RMSNorm and silu. `strop.kernels` compiles core.c, attention.c, sampling.c, moe.c and
   step.c, in that order, as one translation unit.

   Plain C with GCC vector extensions (8-float vectors), compiled -O3 -march=native. Shapes are
   row-major fp32; "packed" weights are [ceil(n / 32), in, 32] so a 32-output pass streams one
   contiguous block (zero columns pad the last block). Each function's comment states its contract.

   Batch invariance, by construction: every function computes a row from that row alone, in an
   order fixed by the row's length, never by how many rows a call holds, which rows sit beside it,
   where it sits or how the rows are grouped. The matrix kernels keep one accumulator per output
   element (lane) and add the products over the input index in ascending order; the compiler fuses
   `acc += x * w` into one multiply-add the same way in every tile shape, so R rows x P column pairs
   of any shape give the same bits (tests regroup rows through every shape). Reductions along a row
   (norms, softmax sums, attention scores) use a fixed lane split and a fixed tree. */

#include <pthread.h>
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

/* silu(g) * u over 8 lanes: the experts' and dense MLPs' activation. */
static inline v8 silu_mul8(v8 g, v8 u) { return g / (BCAST(1.0f) + exp8(-g)) * u; }

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

/* Weights are fp32, or bf16 when they are exactly bf16 values (as the trainer ships them): half the
   bytes to stream, and widening bf16 to fp32 is exact, so both give the same bits. LD2 loads 16
   weights (columns c..c+15 of one row) as two vectors, ST2 stores two such accumulators as
   y[c..c+15]. bf16 loads them with one 32-byte load, the even columns by a shift and the odd ones
   by a mask (no lane shuffle per weight); the accumulators then hold even and odd columns and ST2
   interleaves them once per tile. Every output is the same sum in the same order. */
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
#define LD_F32(p) (*(const v8 *)(p))
#define LD2_F32(p, e, o) ((e) = LD_F32(p), (o) = LD_F32((p) + 8))
#define ST2_F32(y, e, o) (*(v8 *)(y) = (e), *(v8 *)((y) + 8) = (o))
#define LD2_BF16(p, e, o) ((e) = (v8)(*(const v8u *)(p) << 16), (o) = (v8)(*(const v8u *)(p) & 0xFFFF0000u))
#define ST2_BF16(y, e, o) (*(v8 *)(y) = SHUF(e, o, 0, 8, 1, 9, 2, 10, 3, 11), \
                           *(v8 *)((y) + 8) = SHUF(e, o, 4, 12, 5, 13, 6, 14, 7, 15))

/* W [m, n] is packed in column blocks [n / 32, m, 32] (n % 32 == 0), so a pass over 16 or 32
   columns streams contiguous rows. tile: y[r, j0 : j0 + 16 P] = sum_i a[r, i] W[i, j0 : j0 + 16 P]
   for R rows (strides as, ys) and P pairs of 16 columns from j0 (pairs may run into the next block).
   R and P are constants once inlined, so the R x 2P accumulators stay in registers and each weight
   load feeds R FMAs. Shapes used: 1 x 4 (one row: 8 FMA chains hide FMA latency), 2 x 2, 3 x 2,
   and 4, 5 or 6 rows x 1. Whatever the shape, output (r, j) is acc = 0, then acc += a[r, i] W[i, j]
   for i = 0 .. m - 1: the same bits.
   vecmat: R <= 4 rows (a decode step, an expert's group of tokens), whole width. linear: N rows,
   block by block, every row group against one block while it sits in L1, so the weights stream
   from memory once. */
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
                        int64_t ys, int64_t m, int64_t n) {                                                           \
    int64_t j = 0;                                                                                        \
    switch (R) {                                                                                          \
    case 1:                                                                                               \
        for (; j + 64 <= n; j += 64) tile##SUF(a, m, W, y, ys, m, j, 1, 4);                                \
        for (; j < n; j += 32) tile##SUF(a, m, W, y, ys, m, j, 1, 2);                                      \
        break;                                                                                            \
    case 2: for (; j < n; j += 32) tile##SUF(a, m, W, y, ys, m, j, 2, 2); break;                           \
    case 3: for (; j < n; j += 32) tile##SUF(a, m, W, y, ys, m, j, 3, 2); break;                           \
    default: for (; j < n; j += 16) tile##SUF(a, m, W, y, ys, m, j, 4, 1);                                 \
    }                                                                                                     \
}                                                                                                         \
static void linear##SUF(const float *restrict x, int64_t N, const WT *restrict W, float *restrict y,      \
                        int64_t ys, int64_t m, int64_t n) {                                                           \
    if (N <= 4) {                                                                                         \
        vecmat##SUF(x, N, W, y, ys, m, n);                                                                    \
        return;                                                                                           \
    }                                                                                                     \
    for (int64_t j = 0; j < n; j += 32) {                                                                 \
        int64_t r = 0;                                                                                    \
        for (; r + 6 <= N; r += 6)                                                                        \
            for (int64_t h = 0; h < 32; h += 16) tile##SUF(x + r * m, m, W, y + r * ys, ys, m, j + h, 6, 1); \
        const float *xr = x + r * m;                                                                      \
        float *yr = y + r * ys;                                                                            \
        switch (N - r) {                                                                                  \
        case 5: for (int64_t h = 0; h < 32; h += 16) tile##SUF(xr, m, W, yr, ys, m, j + h, 5, 1); break;   \
        case 4: for (int64_t h = 0; h < 32; h += 16) tile##SUF(xr, m, W, yr, ys, m, j + h, 4, 1); break;   \
        case 3: tile##SUF(xr, m, W, yr, ys, m, j, 3, 2); break;                                            \
        case 2: tile##SUF(xr, m, W, yr, ys, m, j, 2, 2); break;                                            \
        case 1: tile##SUF(xr, m, W, yr, ys, m, j, 1, 2); break;                                            \
        }                                                                                                 \
    }                                                                                                     \
}

#ifdef __AVX512F__
/* The same matrix kernels on 16-float vectors where the CPU has AVX-512: one vector pair covers a
   whole 32-column block, twice the multiply-adds per instruction. Each output is still acc = 0, then
   acc += a[r, i] W[i, j] for i = 0 .. m - 1 in one lane: the same bits as the 8-float kernels (and
   as on a machine without AVX-512). tile16: R rows x P whole blocks from block b0. Shapes: 1 x 4,
   2 x 2, 3 x 2, 4 x 2 (vecmat16), and up to 8 rows x 1 (linear16: 16 accumulators of 32). Each
   weight row loaded prefetches the same row of the block after the tile's: a decode step streams
   every weight from memory once, and the hardware prefetcher stops at each 4 KiB page. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define BCAST16(s) ((v16){(s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s)})
#ifdef __clang__
#define SHUF16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
#define LD16_F32(p, e, o) ((e) = *(const v16 *)(p), (o) = *(const v16 *)((p) + 16))
#define ST16_F32(y, e, o) (*(v16 *)(y) = (e), *(v16 *)((y) + 16) = (o))
#define LD16_BF16(p, e, o) ((e) = (v16)(*(const v16u *)(p) << 16), (o) = (v16)(*(const v16u *)(p) & 0xFFFF0000u))
#define ST16_BF16(y, e, o)                                                                              \
    (*(v16 *)(y) = SHUF16(e, o, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),                \
     *(v16 *)((y) + 16) = SHUF16(e, o, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31))
#define MATRIX_KERNELS16(SUF, WT, LD2, ST2)                                                               \
static inline __attribute__((always_inline)) void tile16##SUF(const float *restrict a, int64_t as,        \
        const WT *restrict W, float *restrict y, int64_t ys, int64_t m, int64_t b0, const int R, const int P) { \
    const WT *src[4];                                                                                     \
    for (int p = 0; p < P; p++) src[p] = W + (b0 + p) * 32 * m;                                           \
    v16 acc[8][8];                                                                                        \
    for (int r = 0; r < R; r++)                                                                           \
        for (int v = 0; v < 2 * P; v++) acc[r][v] = BCAST16(0.0f);                                        \
    for (int64_t i = 0; i < m; i++) {                                                                     \
        v16 w[8];                                                                                         \
        __builtin_prefetch(src[0] + (P * m + i) * 32); /* row i of the next block (a prefetch never faults) */ \
        if (sizeof(WT) == 4) __builtin_prefetch(src[0] + (P * m + i) * 32 + 16);                          \
        for (int p = 0; p < P; p++) LD2(src[p] + i * 32, w[2 * p], w[2 * p + 1]);                         \
        for (int r = 0; r < R; r++) {                                                                     \
            const v16 x = BCAST16(a[r * as + i]);                                                         \
            for (int v = 0; v < 2 * P; v++) acc[r][v] += x * w[v];                                        \
        }                                                                                                 \
    }                                                                                                     \
    for (int r = 0; r < R; r++)                                                                           \
        for (int p = 0; p < P; p++) ST2(y + r * ys + (b0 + p) * 32, acc[r][2 * p], acc[r][2 * p + 1]);   \
}                                                                                                         \
static void vecmat16##SUF(const float *restrict a, int64_t R, const WT *restrict W, float *restrict y,    \
                          int64_t ys, int64_t m, int64_t n) {                                                         \
    const int64_t nb = n / 32;                                                                            \
    int64_t b = 0;                                                                                        \
    switch (R) {                                                                                          \
    case 1:                                                                                               \
        for (; b + 4 <= nb; b += 4) tile16##SUF(a, m, W, y, ys, m, b, 1, 4);                               \
        for (; b < nb; b++) tile16##SUF(a, m, W, y, ys, m, b, 1, 1);                                       \
        break;                                                                                            \
    case 2:                                                                                               \
        for (; b + 2 <= nb; b += 2) tile16##SUF(a, m, W, y, ys, m, b, 2, 2);                               \
        for (; b < nb; b++) tile16##SUF(a, m, W, y, ys, m, b, 2, 1);                                       \
        break;                                                                                            \
    case 3:                                                                                               \
        for (; b + 2 <= nb; b += 2) tile16##SUF(a, m, W, y, ys, m, b, 3, 2);                               \
        for (; b < nb; b++) tile16##SUF(a, m, W, y, ys, m, b, 3, 1);                                       \
        break;                                                                                            \
    default:                                                                                              \
        for (; b + 2 <= nb; b += 2) tile16##SUF(a, m, W, y, ys, m, b, 4, 2);                               \
        for (; b < nb; b++) tile16##SUF(a, m, W, y, ys, m, b, 4, 1);                                       \
    }                                                                                                     \
}                                                                                                         \
static void linear16##SUF(const float *restrict x, int64_t N, const WT *restrict W, float *restrict y,    \
                          int64_t ys, int64_t m, int64_t n) {                                                         \
    if (N <= 4) {                                                                                         \
        vecmat16##SUF(x, N, W, y, ys, m, n);                                                                  \
        return;                                                                                           \
    }                                                                                                     \
    for (int64_t b = 0; b < n / 32; b++) {                                                                \
        int64_t r = 0;                                                                                    \
        for (; r + 8 <= N; r += 8) tile16##SUF(x + r * m, m, W, y + r * ys, ys, m, b, 8, 1);                \
        const float *xr = x + r * m;                                                                      \
        float *yr = y + r * ys;                                                                            \
        switch (N - r) {                                                                                  \
        case 7: tile16##SUF(xr, m, W, yr, ys, m, b, 7, 1); break;                                          \
        case 6: tile16##SUF(xr, m, W, yr, ys, m, b, 6, 1); break;                                          \
        case 5: tile16##SUF(xr, m, W, yr, ys, m, b, 5, 1); break;                                          \
        case 4: tile16##SUF(xr, m, W, yr, ys, m, b, 4, 1); break;                                          \
        case 3: tile16##SUF(xr, m, W, yr, ys, m, b, 3, 1); break;                                          \
        case 2: tile16##SUF(xr, m, W, yr, ys, m, b, 2, 1); break;                                          \
        case 1: tile16##SUF(xr, m, W, yr, ys, m, b, 1, 1); break;                                          \
        }                                                                                                 \
    }                                                                                                     \
}
MATRIX_KERNELS16(, float, LD16_F32, ST16_F32)
MATRIX_KERNELS16(_b16, uint16_t, LD16_BF16, ST16_BF16)
#define LINEAR_F32 linear16
#define LINEAR_B16 linear16_b16
#else
MATRIX_KERNELS(, float, LD2_F32, ST2_F32)
MATRIX_KERNELS(_b16, uint16_t, LD2_BF16, ST2_BF16)
#define LINEAR_F32 linear
#define LINEAR_B16 linear_b16
#endif

/* Threads. `linear_rows` splits a large product's 32-column blocks between `set_kernel_threads`
   threads: the caller and workers started on first use, woken per product. Each output is still
   computed whole by one thread, as above, so the split changes no bit. One product is split at a
   time: a caller that finds the workers busy (another engine on another thread) computes alone. A
   forked child (Ray, multiprocessing) starts with no workers and computes alone until told again. */
#define MAX_THREADS 16
#define SPLIT_MIN (1 << 20)  /* multiply-adds below which waking a worker costs more than it saves */
typedef struct {
    const float *x;
    int64_t N;
    const void *W;
    int64_t bf16;
    float *y;
    int64_t m, n;
} LinearJob;
static struct {
    pthread_mutex_t mu, busy;
    pthread_cond_t go, done;
    int threads, started, pending;
    uint64_t gen;
    LinearJob job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          1, 0, 0, 0, {0}};
static uint64_t first_gen[MAX_THREADS];

/* Thread t of T: its share of the job's blocks, y's rows keeping their full stride. */
static void linear_part(const LinearJob *j, int t, int T) {
    const int64_t nb = j->n / 32, b0 = nb * t / T, b1 = t < T ? nb * (t + 1) / T : b0;
    if (b0 >= b1) return;
    const size_t offset = b0 * 32 * j->m;
    if (j->bf16) LINEAR_B16(j->x, j->N, (const uint16_t *)j->W + offset, j->y + b0 * 32, j->n, j->m, (b1 - b0) * 32);
    else LINEAR_F32(j->x, j->N, (const float *)j->W + offset, j->y + b0 * 32, j->n, j->m, (b1 - b0) * 32);
}

static void *worker(void *arg) {
    const int t = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mu);
    uint64_t seen = first_gen[t];
    for (;;) {
        while (pool.gen == seen) pthread_cond_wait(&pool.go, &pool.mu);
        seen = pool.gen;
        const LinearJob job = pool.job;
        const int T = pool.threads;
        pthread_mutex_unlock(&pool.mu);
        linear_part(&job, t, T);
        pthread_mutex_lock(&pool.mu);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void forked_child(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.threads = 1, pool.started = 0, pool.pending = 0;
}

/* Compute products on n threads (1..MAX_THREADS), starting the workers that are missing. */
void set_kernel_threads(int64_t n) {
    static int registered = 0;
    n = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    pthread_mutex_lock(&pool.busy);
    pthread_mutex_lock(&pool.mu);
    if (!registered) registered = !pthread_atfork(NULL, NULL, forked_child);
    while (pool.started < n - 1) {
        pthread_t th;
        const int t = pool.started + 1;
        first_gen[t] = pool.gen;
        if (pthread_create(&th, NULL, worker, (void *)(intptr_t)t)) break;  /* no thread: fewer threads */
        pthread_detach(th);
        pool.started++;
    }
    __atomic_store_n(&pool.threads, n < pool.started + 1 ? (int)n : pool.started + 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

static void linear_split(const LinearJob *j) {
    pthread_mutex_lock(&pool.mu);
    pool.job = *j;
    pool.pending = pool.started;
    pool.gen++;
    const int T = pool.threads;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    linear_part(j, 0, T);
    pthread_mutex_lock(&pool.mu);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
}

/* y [N, n] = x [N, m] @ W (+ bias [n], may be NULL) for W packed [n / 32, m, 32] (n % 32 == 0),
   bf16 when `bf16`, else fp32. The bias is added after the sum. */
static void linear_rows(const float *restrict x, int64_t N, const void *restrict W, int64_t bf16,
                        const float *restrict bias, float *restrict y, int64_t m, int64_t n) {
    if (__atomic_load_n(&pool.threads, __ATOMIC_RELAXED) > 1 && n >= 64 && N * m * n >= SPLIT_MIN &&
        pthread_mutex_trylock(&pool.busy) == 0) {
        const LinearJob job = {x, N, W, bf16, y, m, n};
        linear_split(&job);
        pthread_mutex_unlock(&pool.busy);
    } else if (bf16) {
        LINEAR_B16(x, N, (const uint16_t *)W, y, n, m, n);
    } else {
        LINEAR_F32(x, N, (const float *)W, y, n, m, n);
    }
    if (bias)
        for (int64_t r = 0; r < N; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

/* `linear_rows` for callers outside this file: y [N, n] with n the packed width (a multiple of 32). */
void linear_packed(const float *restrict x, int64_t N, const void *restrict W, int64_t bf16,
                   const float *restrict bias, float *restrict y, int64_t m, int64_t n) {
    linear_rows(x, N, W, bf16, bias, y, m, n);
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

/* out [N, I] = silu(g) * u for rows of g and u (row strides gs, us): 8 lanes at a time, a row's
   last I % 8 through the same lanes (zero-padded), so every element is computed alike. */
void silu_mul(const float *restrict g, int64_t gs, const float *restrict u, int64_t us, float *restrict out,
              int64_t N, int64_t I) {
    for (int64_t n = 0; n < N; n++) {
        const float *gr = g + n * gs, *ur = u + n * us;
        float *o = out + n * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) *(v8 *)(o + i) = silu_mul8(LD_F32(gr + i), LD_F32(ur + i));
        if (i < I) {
            v8 gt = {0}, ut = {0};
            for (int64_t j = i; j < I; j++) gt[j - i] = gr[j], ut[j - i] = ur[j];
            const v8 r = silu_mul8(gt, ut);
            for (int64_t j = i; j < I; j++) o[j] = r[j - i];
        }
    }
}


/* The gradients of act = silu(g) * u given d act, for rows of g and u (row strides gs, us):
   d g = d act * u * s (1 + g (1 - s)) and d u = d act * silu(g) with s = sigmoid(g), into dg and du
   (row strides dgs, dus); act itself into act [N, I] when not NULL. Training only: these feed
   gradients, whose rounding is free. */
void silu_mul_backward(const float *restrict g, int64_t gs, const float *restrict u, int64_t us,
                       const float *restrict da, float *restrict dg, int64_t dgs, float *restrict du, int64_t dus,
                       float *restrict act, int64_t N, int64_t I) {
    for (int64_t n = 0; n < N; n++) {
        const float *gr = g + n * gs, *ur = u + n * us, *dr = da + n * I;
        float *dgr = dg + n * dgs, *dur = du + n * dus;
        for (int64_t i = 0; i < I; i += 8) {
            v8 gv = {0}, uv = {0}, dv = {0};
            const int64_t m = I - i < 8 ? I - i : 8;
            if (m == 8) gv = LD_F32(gr + i), uv = LD_F32(ur + i), dv = LD_F32(dr + i);
            else for (int64_t j = 0; j < m; j++) gv[j] = gr[i + j], uv[j] = ur[i + j], dv[j] = dr[i + j];
            const v8 sg = BCAST(1.0f) / (BCAST(1.0f) + exp8(-gv)), silu = gv * sg;
            const v8 dgv = dv * uv * sg * (BCAST(1.0f) + gv * (BCAST(1.0f) - sg)), duv = dv * silu;
            for (int64_t j = 0; j < m; j++) {
                dgr[i + j] = dgv[j];
                dur[i + j] = duv[j];
                if (act) act[n * I + i + j] = silu[j] * uv[j];
            }
        }
    }
}

