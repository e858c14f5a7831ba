/* The router and the experts of a softmax-routed MoE layer.

   Compiled after core.c (it uses that file's vector types and matrix kernels); batch-invariant in
   the sense core.c states. */

/* Softmax of one router row l [E] into pr [E]: max, expf, a sum in expert order, a division. */
static inline void router_probs(const float *restrict l, float *restrict pr, int64_t E) {
    float m = l[0], z = 0.0f;
    for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
    for (int64_t e = 0; e < E; e++) z += (pr[e] = expf(l[e] - m));
    for (int64_t e = 0; e < E; e++) pr[e] /= z;
}

/* A softmax router's choice, as `strop.model.routing.route` makes it: per row of logits [N, E]
   (row stride ls), probabilities softmax(logits), the K largest in descending order (ties: lower
   expert id first) into ids [N, K], their probabilities (renormalised to sum 1 in that order when
   norm) into w [N, K]. */
void route_softmax(const float *restrict logits, int64_t ls, int64_t *restrict ids, float *restrict w, int64_t N,
                   int64_t E, int64_t K, int64_t norm) {
    float pr[E];
    for (int64_t n = 0; n < N; n++) {
        router_probs(logits + n * ls, pr, E);
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

/* Router replay (R3): the gate weights `route_softmax` gives experts ids [N, K] (given, in the
   order recorded): the same probabilities, gathered, renormalised in that order when norm. When
   ids are the router's own choice the weights are `route_softmax`'s bit for bit. */
void route_softmax_at(const float *restrict logits, int64_t ls, const int64_t *restrict ids, float *restrict w,
                      int64_t N, int64_t E, int64_t K, int64_t norm) {
    float pr[E];
    for (int64_t n = 0; n < N; n++) {
        router_probs(logits + n * ls, pr, E);
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += (w[n * K + k] = pr[ids[n * K + k]]);
        if (norm)
            for (int64_t k = 0; k < K; k++) w[n * K + k] /= s;
    }
}

/* x [N,H]; ids, w [N,K] (expert ids, gate weights); gu [E, 2I/32, H, 32] and dn [E, H/32, I, 32]
   (packed projections; bf16 when `bf16`, else fp32); out [N,H]. ybuf [N*K, H] receives every
   assignment's expert output (row n*K + k); order [N*K] the assignments sorted by expert (stable).
   gu_save, when not NULL, [N*K, 2I] receives the gate and up projections in that sorted order
   (what a backward pass needs). Scratch: hbuf MOE_GROUP * (3I + 2H) floats, start [E+1]. H and 2I are multiples of 32. Assignments go expert by expert, up to
   MOE_GROUP at a time through the matrix kernels, so each expert's weights are read once per group
   and stay in cache for all its tokens; per token the K gate-weighted outputs are added to zero in
   k order. */
#define MOE_GROUP 16
void moe_experts(const float *restrict x, const int64_t *restrict ids, const float *restrict w,
                 const void *restrict gu, const void *restrict dn, int64_t bf16, float *restrict out,
                 float *restrict hbuf, float *restrict ybuf, float *restrict gu_save, int64_t *restrict order,
                 int64_t *restrict start, int64_t N, int64_t K, int64_t E, int64_t H, int64_t I) {
    const int64_t A = N * K, I2 = 2 * I;
    float *xin = hbuf + MOE_GROUP * I2, *act = xin + MOE_GROUP * H, *yout = act + MOE_GROUP * I;
    memset(start, 0, (E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < A; a++) start[ids[a] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t a = 0; a < A; a++) order[start[ids[a]]++] = a;  /* counting sort by expert */
    const size_t wsize = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t r = 0; r < A;) {
        const int64_t e = ids[order[r]];
        int64_t R = 1;  /* this expert's next (up to) MOE_GROUP assignments share every weight load */
        while (R < MOE_GROUP && r + R < A && ids[order[r + R]] == e) R++;
        for (int64_t q = 0; q < R; q++) memcpy(xin + q * H, x + (order[r + q] / K) * H, H * sizeof(float));
        linear_rows(xin, R, (const char *)gu + e * H * I2 * wsize, bf16, NULL, hbuf, H, I2);
        if (gu_save)
            memcpy(gu_save + r * I2, hbuf, R * I2 * sizeof(float));
        for (int64_t q = 0; q < R; q++)
            for (int64_t i = 0; i < I; i += 8)
                *(v8 *)(act + q * I + i) = silu_mul8(LD_F32(hbuf + q * I2 + i), LD_F32(hbuf + q * I2 + I + i));
        linear_rows(act, R, (const char *)dn + e * I * H * wsize, bf16, NULL, yout, I, H);
        for (int64_t q = 0; q < R; q++) memcpy(ybuf + order[r + q] * H, yout + q * H, H * sizeof(float));
        r += R;
    }
    for (int64_t n = 0; n < N; n++) {
        float *on = out + n * H;
        for (int64_t o = 0; o < H; o++) on[o] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float wk = w[n * K + k], *yr = ybuf + (n * K + k) * H;
            for (int64_t o = 0; o < H; o++) on[o] += wk * yr[o];
        }
    }
}
