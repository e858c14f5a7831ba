"""C source of a whole decode step in one call (bound by `strop.engine.decode_step`).

Part of the translation unit `strop.engine.csrc.SOURCE`: it chains that file's kernels (the
attention block, the router's softmax top-k, the experts, the final norm and the output head),
so a decode step costs one ctypes call instead of a few per layer.
"""

DECODE = r"""
/* Per layer, `decode_step` reads P_LAYER pointers and V_LAYER floats in this order; after the
   layers come the shared pointers (G_*) and the final norm's eps. cfg holds the C_* sizes. */
enum { P_IN_NORM, P_QKV, P_QKV_BIAS, P_QK_NORM, P_O, P_O_BIAS, P_POST_NORM, P_K_CACHE, P_V_CACHE,
       P_ROUTER, P_GATE_UP, P_DOWN, P_LAYER };
enum { V_EPS_IN, V_EPS_QK, V_EPS_POST, V_SCALE, V_LAYER };
enum { G_EMBED, G_COS, G_SIN, G_NORM, G_HEAD, G_N };
enum { C_LAYERS, C_D, C_NQ, C_NK, C_HEAD_DIM, C_L, C_E, C_K, C_NORM_TOPK, C_I, C_BF16, C_VOCAB, C_N };

/* One decode token for each of N sequences through every layer (all MoE: attention block, router
   logits x W_r^T, softmax top-k, experts, the experts' output added by the next norm), then the
   final norm and, when G_HEAD is not NULL, the bf16 output head. out: logits [N, vocab], or the
   final norm's output [N, D] without a head. ids [N, layers, K]: the routing record. Scratch:
   fs floats and is int64s as `decode_step_scratch` sizes them. */
void decode_step(const int64_t *restrict tokens, const int64_t *restrict slots, const int64_t *restrict pos,
                 int64_t N, const int64_t *restrict cfg, const void *const *restrict ptrs,
                 const float *restrict vals, float *restrict out, int64_t *restrict ids, float *restrict fs,
                 int64_t *restrict is) {
    const int64_t layers = cfg[C_LAYERS], D = cfg[C_D], nq = cfg[C_NQ], nk = cfg[C_NK], d = cfg[C_HEAD_DIM];
    const int64_t L = cfg[C_L], E = cfg[C_E], K = cfg[C_K], I = cfg[C_I];
    const void *const *g = ptrs + layers * P_LAYER;
    float *h = fs, *x = h + N * D, *pending = x + N * D, *logits = pending + N * D, *w = logits + N * E;
    float *hbuf = w + N * K, *ybuf = hbuf + MOE_GROUP * (3 * I + 2 * D), *last = ybuf + N * K * D, *att = last + N * D;
    int64_t *chosen = is, *order = chosen + N * K, *start = order + N * K;
    const float *embed = g[G_EMBED];
    for (int64_t n = 0; n < N; n++) memcpy(h + n * D, embed + tokens[n] * D, D * sizeof(float));
    for (int64_t l = 0; l < layers; l++) {
        const void *const *p = ptrs + l * P_LAYER;
        const float *v = vals + l * V_LAYER, *router = p[P_ROUTER];
        attn_decode_block(h, l ? pending : NULL, p[P_IN_NORM], v[V_EPS_IN], p[P_QKV], p[P_QKV_BIAS], p[P_QK_NORM],
                          v[V_EPS_QK], g[G_COS], g[G_SIN], slots, pos, (float *)p[P_K_CACHE], (float *)p[P_V_CACHE],
                          p[P_O], p[P_O_BIAS], p[P_POST_NORM], v[V_EPS_POST], x, att, N, D, nq, nk, d, L, v[V_SCALE]);
        for (int64_t n = 0; n < N; n++)
            for (int64_t e = 0; e < E; e++) logits[n * E + e] = dot(x + n * D, router + e * D, D);
        route_softmax(logits, chosen, w, N, E, K, cfg[C_NORM_TOPK]);
        for (int64_t n = 0; n < N; n++) memcpy(ids + (n * layers + l) * K, chosen + n * K, K * sizeof(int64_t));
        moe_experts(x, chosen, w, p[P_GATE_UP], p[P_DOWN], cfg[C_BF16], pending, hbuf, ybuf, order, start, N, K, E, D, I);
    }
    add_rmsnorm(h, pending, g[G_NORM], g[G_HEAD] ? last : out, N, D, vals[layers * V_LAYER]);
    if (g[G_HEAD]) linear_bf16(last, N, g[G_HEAD], out, D, cfg[C_VOCAB]);
}

/* The scratch `decode_step` needs for N rows: floats in sizes[0], int64s in sizes[1]. */
void decode_step_scratch(const int64_t *restrict cfg, int64_t N, int64_t *restrict sizes) {
    const int64_t D = cfg[C_D], E = cfg[C_E], K = cfg[C_K], qk_heads = cfg[C_NQ] + cfg[C_NK];
    sizes[0] = N * (4 * D + E + K + K * D) + MOE_GROUP * (3 * cfg[C_I] + 2 * D) +
               N * (2 * D + 3 * qk_heads * cfg[C_HEAD_DIM]) + cfg[C_L];
    sizes[1] = 2 * N * K + E + 1;
}
"""
