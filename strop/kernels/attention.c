/* The attention kernels: the q/k norm and rotation, attention of query rows over a KV cache,
   and a whole attention block in one call.

   Compiled after core.c (it uses that file's vector types, `dot`, `exp8`, `add_rmsnorm` and
   `linear_rows`). A query's result depends on its own row, its position and the keys 0..position of
   its sequence only, computed in an order fixed by the position: a decode step, a prompt prefilled
   in one pass, a suffix prefilled against reused keys and a trainer's full-sequence forward give the
   same bits. */

/* From rows src [N, (nq + nk) * d] (row stride ss; q heads then k heads): RMS-normalise every head
   (weights wqk [nq + nk, d]; NULL: no norm, as in Llama) and rotate it by the row's position (cos,
   sin [P, d], sin carrying the rotate-half sign) into qk [N, nq + nk, d]. */
void qk_norm_rope(const float *restrict src, int64_t ss, const float *restrict wqk, const float *restrict cos_t,
                  const float *restrict sin_t, const int64_t *restrict pos, float *restrict qk,
                  int64_t N, int64_t nq, int64_t nk, int64_t d, float eps) {
    const int64_t half = d / 2;
    float y[d];
    for (int64_t n = 0; n < N; n++) {
        const float *row = src + n * ss, *c = cos_t + pos[n] * d, *s = sin_t + pos[n] * d;
        for (int64_t hh = 0; hh < nq + nk; hh++) {
            const float *x = row + hh * d;
            if (wqk) {
                const float *w = wqk + hh * d, r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
                for (int64_t i = 0; i < d; i++) y[i] = x[i] * r * w[i];
            } else {
                memcpy(y, x, d * sizeof(float));
            }
            float *dst = qk + (n * (nq + nk) + hh) * d;
            for (int64_t i = 0; i < d; i++) dst[i] = y[i] * c[i] + y[i < half ? i + half : i - half] * s[i];
        }
    }
}

/* Copy key rows k [N, nk, dk] (row stride ks) and value rows v [N, nk, dv] (row stride vs) into the
   caches kc [S, nk, L, dk] and vc [S, nk, L, dv] at (slots[n], pos[n]). */
void kv_write(const float *restrict k, int64_t ks, const float *restrict v, int64_t vs, const int64_t *restrict slots,
              const int64_t *restrict pos, float *restrict kc, float *restrict vc, int64_t N, int64_t nk, int64_t dk,
              int64_t dv, int64_t L) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t hh = 0; hh < nk; hh++) {
            memcpy(kc + ((slots[n] * nk + hh) * L + pos[n]) * dk, k + n * ks + hh * dk, dk * sizeof(float));
            memcpy(vc + ((slots[n] * nk + hh) * L + pos[n]) * dv, v + n * vs + hh * dv, dv * sizeof(float));
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
   columns of V [T, dv]: two accumulator sets, even and odd t, so 2 nb FMA chains overlap. */
static inline __attribute__((always_inline)) void weighted_sum(const float *restrict p, const float *restrict V,
                                                               int64_t T, int64_t dv, int64_t c0, const int nb,
                                                               float sum, float *restrict out) {
    v8 even[4] = {0}, odd[4] = {0};
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
        const v8 p0 = BCAST(p[t]), p1 = BCAST(p[t + 1]);
        for (int b = 0; b < nb; b++) {
            even[b] += p0 * LD_F32(V + t * dv + c0 + 8 * b);
            odd[b] += p1 * LD_F32(V + (t + 1) * dv + c0 + 8 * b);
        }
    }
    if (t < T)
        for (int b = 0; b < nb; b++) even[b] += BCAST(p[t]) * LD_F32(V + t * dv + c0 + 8 * b);
    for (int b = 0; b < nb; b++) *(v8 *)(out + c0 + 8 * b) = (even[b] + odd[b]) / BCAST(sum);
}

/* The score of key K [dk] for q [dk] as one 8-lane vector, summed across lanes by the caller. */
static inline __attribute__((always_inline)) v8 score8(const float *restrict q, const float *restrict kt, const int64_t dk) {
    v8 s = LD_F32(q) * LD_F32(kt);
    for (int64_t c = 8; c < dk; c += 8) s += LD_F32(q + c) * LD_F32(kt + c);
    return s;
}

/* One query head q [dk] over keys K [T, dk] and values V [T, dv] (dk, dv % 8 == 0): out [dv], and
   when lse is not NULL the log of the softmax denominator (max + log sum). sc holds T scores.
   Scores go 8 keys at a time, one product vector per key summed across lanes together (`hsum8`);
   the last T % 8 keys go through the same tree with zero vectors beside them, so a key's score is
   the same wherever it falls. exp in 8 lanes (the tail zero-padded likewise); values weighted 32
   columns at a time. Inlined with the widths constant for common heads. */
static inline __attribute__((always_inline)) void attend_head(const float *restrict q, const float *restrict K,
                                                              const float *restrict V, int64_t T, const int64_t dk,
                                                              const int64_t dv, float scale, float *restrict sc,
                                                              float *restrict out, float *restrict lse) {
    v8 mx = BCAST(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
        v8 a[8];
        for (int k = 0; k < 8; k++) a[k] = score8(q, K + (t + k) * dk, dk);
        const v8 s8 = hsum8(a) * BCAST(scale);
        *(v8 *)(sc + t) = s8;
        mx = vmax(mx, s8);
    }
    if (t < T) {
        v8 a[8];
        for (int k = 0; k < 8; k++) a[k] = t + k < T ? score8(q, K + (t + k) * dk, dk) : BCAST(0.0f);
        const v8 s8 = hsum8(a) * BCAST(scale);
        for (int k = 0; t + k < T; k++) {
            sc[t + k] = s8[k];
            mx[k] = s8[k] > mx[k] ? s8[k] : mx[k];
        }
    }
    float m = mx[0];
    for (int k = 1; k < 8; k++) m = mx[k] > m ? mx[k] : m;
    v8 s8 = {0};
    for (t = 0; t + 8 <= T; t += 8) s8 += (*(v8 *)(sc + t) = exp8(*(const v8 *)(sc + t) - BCAST(m)));
    if (t < T) {
        v8 x = BCAST(-INFINITY);
        for (int k = 0; t + k < T; k++) x[k] = sc[t + k];
        const v8 e = exp8(x - BCAST(m));
        for (int k = 0; t + k < T; k++) s8[k] += (sc[t + k] = e[k]);
    }
    const float sum = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
    int64_t c0 = 0;
    for (; c0 + 32 <= dv; c0 += 32) weighted_sum(sc, V, T, dv, c0, 4, sum, out);
    for (; c0 < dv; c0 += 8) weighted_sum(sc, V, T, dv, c0, 1, sum, out);
    if (lse) *lse = m + logf(sum);
}

/* Query rows q [N, nq, dk] (row stride qs) attend to keys 0..pos[n] of cache slot slots[n]
   (kc [S, nk, L, dk], vc [S, nk, L, dv]); query head h reads kv head h / (nq / nk), so a group's
   heads run back to back on keys still in cache. out [N, nq, dv]; lse [N, nq] or NULL; sc: L floats. */
void attention_rows(const float *restrict q, int64_t qs, const float *restrict kc, const float *restrict vc,
                    const int64_t *restrict slots, const int64_t *restrict pos, float *restrict out,
                    float *restrict lse, float *restrict sc, int64_t N, int64_t nq, int64_t nk, int64_t dk,
                    int64_t dv, int64_t L, float scale) {
    const int64_t g = nq / nk;
    for (int64_t n = 0; n < N; n++)
        for (int64_t hh = 0; hh < nq; hh++) {
            const float *qh = q + n * qs + hh * dk;
            const float *K = kc + (slots[n] * nk + hh / g) * L * dk, *V = vc + (slots[n] * nk + hh / g) * L * dv;
            const int64_t T = pos[n] + 1;
            float *o = out + (n * nq + hh) * dv, *l = lse ? lse + n * nq + hh : NULL;
            if (dk == 32 && dv == 32) attend_head(qh, K, V, T, 32, 32, scale, sc, o, l);
            else if (dk == 64 && dv == 64) attend_head(qh, K, V, T, 64, 64, scale, sc, o, l);
            else if (dk == 128 && dv == 128) attend_head(qh, K, V, T, 128, 128, scale, sc, o, l);
            else attend_head(qh, K, V, T, dk, dv, scale, sc, o, l);
        }
}

/* A whole attention block for N rows (any mix of sequences and positions): h += pending (the
   previous MLP's output, may be NULL); input RMSNorm; fused q/k/v projection; q/k norm and
   rotation (wqk NULL: rotation only); k and v written into the caches; attention over the cache; output projection; h += it;
   post-attention RMSNorm into x_out. Projection weights come packed (bf16 when `bf16`). A row's
   keys are all written before any row attends, so a prompt's rows see each other. Scratch:
   N * (2D + 3 (nq + nk) d) + L floats. */
void attn_block(float *restrict h, const float *restrict pending, const float *restrict w_in, float eps_in,
                const void *restrict wqkv, const float *restrict bqkv, const float *restrict wqk, float eps_qk,
                const float *restrict cos_t, const float *restrict sin_t, const int64_t *restrict slots,
                const int64_t *restrict pos, float *restrict kc, float *restrict vc, const void *restrict wo,
                const float *restrict bo, int64_t bf16, const float *restrict w_post, float eps_post,
                float *restrict x_out, float *restrict scratch, int64_t N, int64_t D, int64_t nq, int64_t nk, int64_t d,
                int64_t L, float scale) {
    const int64_t Wd = (nq + 2 * nk) * d, A = nq * d;
    float *xn = scratch, *qkv = xn + N * D, *qk = qkv + N * Wd, *att = qk + N * (nq + nk) * d, *o = att + N * A;
    float *sc = o + N * D;
    add_rmsnorm(h, pending, w_in, xn, N, D, eps_in);
    linear_rows(xn, N, wqkv, bf16, bqkv, qkv, D, Wd);
    qk_norm_rope(qkv, Wd, wqk, cos_t, sin_t, pos, qk, N, nq, nk, d, eps_qk);
    kv_write(qk + nq * d, (nq + nk) * d, qkv + (nq + nk) * d, Wd, slots, pos, kc, vc, N, nk, d, d, L);
    attention_rows(qk, (nq + nk) * d, kc, vc, slots, pos, att, NULL, sc, N, nq, nk, d, d, L, scale);
    linear_rows(att, N, wo, bf16, bo, o, A, D);
    add_rmsnorm(h, o, w_post, x_out, N, D, eps_post);
}

