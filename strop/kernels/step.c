/* A whole forward step of a softmax-routed MoE model or a dense one (Llama, Qwen3) in one call
   (bound by `strop.engine.rows_step`).

   Compiled after the other kernel files: it chains their kernels (the attention block, the router
   projection and its softmax top-k, the experts, the final norm and the output head) over any rows
   (decode tokens, whole prompts, prompt suffixes after reused keys, all in one call), so a step
   costs one ctypes call instead of a few per layer. It is the same chain of functions
   `strop.model.deterministic` calls one by one, so its results are theirs bit for bit. */

/* Per layer, `forward_rows` reads P_LAYER pointers and V_LAYER floats in this order; after the
   layers come the shared pointers (G_*) and the final norm's eps. cfg holds the C_* sizes. */
enum { P_IN_NORM, P_QKV, P_QKV_BIAS, P_QK_NORM, P_O, P_O_BIAS, P_POST_NORM, P_K_CACHE, P_V_CACHE,
       P_ROUTER, P_GATE_UP, P_DOWN, P_LAYER };
enum { V_EPS_IN, V_EPS_QK, V_EPS_POST, V_SCALE, V_LAYER };
enum { G_EMBED, G_COS, G_SIN, G_NORM, G_HEAD, G_N };
enum { C_LAYERS, C_D, C_NQ, C_NK, C_HEAD_DIM, C_L, C_E, C_E_PACKED, C_K, C_NORM_TOPK, C_I, C_BF16, C_VOCAB, C_N };

/* N token rows (tokens, cache slots and positions) through every layer (attention block, router
   logits through the packed router [E_PACKED / 32, D, 32], softmax top-k, experts, whose output the
   next norm adds), then the final norm and the output head for the S rows `out_rows` (each
   sequence's last row). The last layer's experts run on those S rows alone (nothing else reads
   their output); its router runs on every row, for the routing record. A dense model (C_E = 0, no
   routing record) has instead a silu MLP per layer: gate and up as one packed [2I / 32, D, 32]
   (P_GATE_UP, gate rows first), down packed [D / 32, I, 32] (P_DOWN); no router; the last layer's
   MLP on the S rows alone. A NULL P_QK_NORM: no per-head q/k norm (Llama). All packed weights are
   bf16 when C_BF16, else fp32. out: logits [S, vocab]; ids [N, layers, K]: the routing record.
   Scratch: fs floats and is int64s as `forward_rows_scratch` sizes them for N and S. */
void forward_rows(const int64_t *restrict tokens, const int64_t *restrict slots, const int64_t *restrict pos,
                  int64_t N, const int64_t *restrict out_rows, int64_t S, const int64_t *restrict cfg,
                  const void *const *restrict ptrs, const float *restrict vals, float *restrict out,
                  int64_t *restrict ids, float *restrict fs, int64_t *restrict is) {
    const int64_t layers = cfg[C_LAYERS], D = cfg[C_D], nq = cfg[C_NQ], nk = cfg[C_NK], d = cfg[C_HEAD_DIM];
    const int64_t L = cfg[C_L], E = cfg[C_E], EP = cfg[C_E_PACKED], K = cfg[C_K], I = cfg[C_I], bf16 = cfg[C_BF16];
    const void *const *g = ptrs + layers * P_LAYER;
    float *h = fs, *x = h + N * D, *pending = x + N * D, *logits = pending + N * D, *w = logits + N * EP;
    float *hbuf = w + N * K, *ybuf = hbuf + MOE_GROUP * (3 * I + 2 * D), *hs = ybuf + N * K * D, *xs = hs + S * D;
    float *ws = xs + S * D, *last = ws + S * K, *att = last + S * D;
    float *gu = att + N * (2 * D + 3 * (nq + nk) * d) + L, *act = gu + N * 2 * I;  /* dense MLPs */
    int64_t *chosen = is, *order = chosen + N * K, *start = order + N * K, *cs = start + E + 1;
    const float *embed = g[G_EMBED];
    for (int64_t n = 0; n < N; n++) memcpy(h + n * D, embed + tokens[n] * D, D * sizeof(float));
    for (int64_t l = 0; l < layers; l++) {
        const void *const *p = ptrs + l * P_LAYER;
        const float *v = vals + l * V_LAYER;
        attn_block(h, l ? pending : NULL, p[P_IN_NORM], v[V_EPS_IN], p[P_QKV], p[P_QKV_BIAS], p[P_QK_NORM],
                   v[V_EPS_QK], g[G_COS], g[G_SIN], slots, pos, (float *)p[P_K_CACHE], (float *)p[P_V_CACHE],
                   p[P_O], p[P_O_BIAS], bf16, p[P_POST_NORM], v[V_EPS_POST], x, att, N, D, nq, nk, d, L, v[V_SCALE]);
        if (E == 0) {  /* dense: the last layer's MLP on the output rows alone */
            const int64_t R = l + 1 < layers ? N : S;
            const float *xin = x;
            if (l + 1 == layers) {
                for (int64_t s = 0; s < S; s++) {
                    memcpy(hs + s * D, h + out_rows[s] * D, D * sizeof(float));
                    memcpy(xs + s * D, x + out_rows[s] * D, D * sizeof(float));
                }
                xin = xs;
            }
            linear_rows(xin, R, p[P_GATE_UP], bf16, NULL, gu, D, 2 * I);
            silu_mul(gu, 2 * I, gu + I, 2 * I, act, R, I);
            linear_rows(act, R, p[P_DOWN], bf16, NULL, pending, I, D);
            continue;
        }
        linear_rows(x, N, p[P_ROUTER], bf16, NULL, logits, D, EP);
        route_softmax(logits, EP, chosen, w, N, E, K, cfg[C_NORM_TOPK]);
        for (int64_t n = 0; n < N; n++) memcpy(ids + (n * layers + l) * K, chosen + n * K, K * sizeof(int64_t));
        if (l + 1 < layers) {
            moe_experts(x, chosen, w, p[P_GATE_UP], p[P_DOWN], bf16, pending, hbuf, ybuf, NULL, order, start, N, K,
                        E, D, I);
            continue;
        }
        for (int64_t s = 0; s < S; s++) {  /* the last layer: only the rows that get logits */
            const int64_t r = out_rows[s];
            memcpy(hs + s * D, h + r * D, D * sizeof(float));
            memcpy(xs + s * D, x + r * D, D * sizeof(float));
            memcpy(cs + s * K, chosen + r * K, K * sizeof(int64_t));
            memcpy(ws + s * K, w + r * K, K * sizeof(float));
        }
        moe_experts(xs, cs, ws, p[P_GATE_UP], p[P_DOWN], bf16, pending, hbuf, ybuf, NULL, order, start, S, K, E, D, I);
    }
    add_rmsnorm(hs, pending, g[G_NORM], last, S, D, vals[layers * V_LAYER]);
    linear_rows(last, S, g[G_HEAD], bf16, NULL, out, D, cfg[C_VOCAB]);
}

/* The scratch `forward_rows` needs for N rows and S output rows: floats in sizes[0], int64s in sizes[1]. */
void forward_rows_scratch(const int64_t *restrict cfg, int64_t N, int64_t S, int64_t *restrict sizes) {
    const int64_t D = cfg[C_D], K = cfg[C_K], qk_heads = cfg[C_NQ] + cfg[C_NK];
    sizes[0] = N * (3 * D + cfg[C_E_PACKED] + K + K * D) + MOE_GROUP * (3 * cfg[C_I] + 2 * D) + S * (3 * D + K) +
               N * (2 * D + 3 * qk_heads * cfg[C_HEAD_DIM]) + cfg[C_L] + (cfg[C_E] ? 0 : 3 * N * cfg[C_I]);
    sizes[1] = 2 * N * K + cfg[C_E] + 1 + S * K;
}
