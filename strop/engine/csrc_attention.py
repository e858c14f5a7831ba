"""C source of the engine's decode attention: the q/k norm, rotation and cache write, attention of
one query row per sequence over its KV cache, and the whole attention block in one call.

Part of the translation unit `strop.engine.csrc.SOURCE` (it uses that file's vector types, `dot`,
`exp8`, `add_rmsnorm` and `linear_rows`). Only the default (non-deterministic) forward calls
these, so their reduction order is free: results match torch's to fp32 rounding.
"""

ATTENTION = r"""
/* From the fused projection qkv [N, (nq + 2nk) * d]: RMS-normalise every q and k head (weights
   wqk [nq + nk, d]), rotate it by the row's position (cos, sin [P, d], sin carrying the
   rotate-half sign) into qk [N, nq + nk, d], and write k and v into the caches [S, nk, L, d]. */
void qk_rope_cache(const float *restrict qkv, const float *restrict wqk, const float *restrict cos_t,
                   const float *restrict sin_t, const int64_t *restrict slots, const int64_t *restrict pos,
                   float *restrict qk, float *restrict kc, float *restrict vc,
                   int64_t N, int64_t nq, int64_t nk, int64_t d, int64_t L, float eps) {
    const int64_t half = d / 2, width = (nq + 2 * nk) * d;
    float y[d];
    for (int64_t n = 0; n < N; n++) {
        const float *row = qkv + n * width, *c = cos_t + pos[n] * d, *s = sin_t + pos[n] * d;
        for (int64_t hh = 0; hh < nq + nk; hh++) {
            const float *x = row + hh * d, *w = wqk + hh * d;
            const float r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
            for (int64_t i = 0; i < d; i++) y[i] = x[i] * r * w[i];
            float *dst = qk + (n * (nq + nk) + hh) * d;
            for (int64_t i = 0; i < d; i++) dst[i] = y[i] * c[i] + y[i < half ? i + half : i - half] * s[i];
            if (hh >= nq) memcpy(kc + ((slots[n] * nk + hh - nq) * L + pos[n]) * d, dst, d * sizeof(float));
        }
        for (int64_t hh = 0; hh < nk; hh++)
            memcpy(vc + ((slots[n] * nk + hh) * L + pos[n]) * d, row + (nq + nk + hh) * d, d * sizeof(float));
    }
}

/* Lane k of the result: the sum of a[k]'s lanes, for 8 vectors at once (a transpose-and-add
   tree, 21 vector ops where 8 separate reductions take ~56). */
static inline v8 hsum8(const v8 *a) {
    v8 b[4], c[2];
    for (int k = 0; k < 4; k++)  /* pairs of lanes: b[k] interleaves a[2k] and a[2k + 1] */
        b[k] = SHUF(a[2 * k], a[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[2 * k], a[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; k++)  /* quads: per 128-bit half, the four vectors' partial sums */
        c[k] = SHUF(b[2 * k], b[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(b[2 * k], b[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* out[c0 : c0 + 8 nb] = sum_t p[t] V[t, c0 : c0 + 8 nb] / sum, for nb (a constant once inlined) vectors of
   columns: two accumulator sets, even and odd t, so 2 nb FMA chains overlap. */
static inline __attribute__((always_inline)) void weighted_sum(const float *restrict p, const float *restrict V,
                                                               int64_t T, int64_t d, int64_t c0, const int nb,
                                                               float sum, float *restrict out) {
    v8 even[4] = {0}, odd[4] = {0};
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
        const v8 p0 = BCAST(p[t]), p1 = BCAST(p[t + 1]);
        for (int b = 0; b < nb; b++) {
            even[b] += p0 * LD_F32(V + t * d + c0 + 8 * b);
            odd[b] += p1 * LD_F32(V + (t + 1) * d + c0 + 8 * b);
        }
    }
    if (t < T)
        for (int b = 0; b < nb; b++) even[b] += BCAST(p[t]) * LD_F32(V + t * d + c0 + 8 * b);
    for (int b = 0; b < nb; b++) *(v8 *)(out + c0 + 8 * b) = (even[b] + odd[b]) / BCAST(sum);
}

/* One query head q [d] over keys and values K, V [T, d] (d % 8 == 0): out [d]; sc holds T scores.
   Scores go 8 keys at a time, one product vector per key summed across lanes together (`hsum8`);
   exp in 8 lanes; values weighted 32 columns at a time. Inlined with d a constant for the common
   head widths, so q and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_head(const float *restrict q, const float *restrict K,
                                                              const float *restrict V, int64_t T, const int64_t d,
                                                              float scale, float *restrict sc, float *restrict out) {
    v8 mx = BCAST(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
        v8 a[8];
        for (int k = 0; k < 8; k++) {
            const float *kt = K + (t + k) * d;
            v8 s = LD_F32(q) * LD_F32(kt);
            for (int64_t c = 8; c < d; c += 8) s += LD_F32(q + c) * LD_F32(kt + c);
            a[k] = s;
        }
        const v8 s8 = hsum8(a) * BCAST(scale);
        *(v8 *)(sc + t) = s8;
        mx = vmax(mx, s8);
    }
    float m = mx[0];
    for (int k = 1; k < 8; k++) m = mx[k] > m ? mx[k] : m;
    for (; t < T; t++) {
        sc[t] = dot(q, K + t * d, d) * scale;
        if (sc[t] > m) m = sc[t];
    }
    v8 s8 = {0};
    for (t = 0; t + 8 <= T; t += 8) s8 += (*(v8 *)(sc + t) = exp8(*(const v8 *)(sc + t) - BCAST(m)));
    float sum = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
    for (; t < T; t++) sum += (sc[t] = expf(sc[t] - m));
    int64_t c0 = 0;
    for (; c0 + 32 <= d; c0 += 32) weighted_sum(sc, V, T, d, c0, 4, sum, out);
    for (; c0 < d; c0 += 8) weighted_sum(sc, V, T, d, c0, 1, sum, out);
}

/* One query row per sequence: q [N, nq, d] (row stride qs floats) attends to keys 0..pos[n] of
   cache slot slots[n]; query head h reads kv head h / (nq / nk), so a group's heads run back to
   back on keys still in cache. out [N, nq, d]; sc: L floats. */
void decode_attention(const float *restrict q, int64_t qs, const float *restrict kc, const float *restrict vc,
                      const int64_t *restrict slots, const int64_t *restrict pos, float *restrict out,
                      float *restrict sc, int64_t N, int64_t nq, int64_t nk, int64_t d, int64_t L, float scale) {
    const int64_t g = nq / nk;
    for (int64_t n = 0; n < N; n++)
        for (int64_t hh = 0; hh < nq; hh++) {
            const float *qh = q + n * qs + hh * d;
            const float *K = kc + (slots[n] * nk + hh / g) * L * d, *V = vc + (slots[n] * nk + hh / g) * L * d;
            const int64_t T = pos[n] + 1;
            float *o = out + (n * nq + hh) * d;
            if (d == 32) attend_head(qh, K, V, T, 32, scale, sc, o);
            else if (d == 64) attend_head(qh, K, V, T, 64, scale, sc, o);
            else if (d == 128) attend_head(qh, K, V, T, 128, scale, sc, o);
            else attend_head(qh, K, V, T, d, scale, sc, o);
        }
}

/* A whole attention block for N decode rows: h += pending (the previous MLP's output, may be
   NULL); input RMSNorm; fused q/k/v projection; q/k norm, rotation and cache write; attention over
   the cache; output projection; h += it; post-attention RMSNorm into x_out. Projection weights
   come blocked like the experts'. Scratch: N * (2D + 3 (nq + nk) d) + L floats. */
void attn_decode_block(float *restrict h, const float *restrict pending, const float *restrict w_in, float eps_in,
                       const float *restrict wqkv, const float *restrict bqkv, const float *restrict wqk, float eps_qk,
                       const float *restrict cos_t, const float *restrict sin_t, const int64_t *restrict slots,
                       const int64_t *restrict pos, float *restrict kc, float *restrict vc, const float *restrict wo,
                       const float *restrict bo, const float *restrict w_post, float eps_post, float *restrict x_out,
                       float *restrict scratch, int64_t N, int64_t D, int64_t nq, int64_t nk, int64_t d, int64_t L,
                       float scale) {
    const int64_t Wd = (nq + 2 * nk) * d, A = nq * d;
    float *xn = scratch, *qkv = xn + N * D, *qk = qkv + N * Wd, *att = qk + N * (nq + nk) * d, *o = att + N * A;
    float *sc = o + N * D;
    add_rmsnorm(h, pending, w_in, xn, N, D, eps_in);
    linear_rows(xn, N, wqkv, bqkv, qkv, D, Wd);
    qk_rope_cache(qkv, wqk, cos_t, sin_t, slots, pos, qk, kc, vc, N, nq, nk, d, L, eps_qk);
    decode_attention(qk, (nq + nk) * d, kc, vc, slots, pos, att, sc, N, nq, nk, d, L, scale);
    linear_rows(att, N, wo, bo, o, A, D);
    add_rmsnorm(h, o, w_post, x_out, N, D, eps_post);
}

"""
