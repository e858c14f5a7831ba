/* The engine's sampler: row softmax and the top-p select and draw.

   Compiled after core.c (it uses that file's vector types, `exp8` and `vmax`); bound by
   `strop.kernels`. Each row is computed from itself alone. */

/* p [N, V] = softmax of each row of x [N, V]: exp8 (within 2 ulp of expf) of x - max, summed in
   four 8-lane accumulators, times 1 / sum. */
void softmax_rows(const float *restrict x, float *restrict p, int64_t N, int64_t V) {
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * V;
        float *pr = p + n * V;
        v8 mx[4] = {BCAST(-INFINITY), BCAST(-INFINITY), BCAST(-INFINITY), BCAST(-INFINITY)};
        int64_t i = 0;
        for (; i + 32 <= V; i += 32)
            for (int q = 0; q < 4; q++) mx[q] = vmax(mx[q], *(const v8 *)(xr + i + 8 * q));
        const v8 m8 = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
        float m = m8[0];
        for (int j = 1; j < 8; j++) m = m8[j] > m ? m8[j] : m;
        for (; i < V; i++) m = xr[i] > m ? xr[i] : m;
        v8 s[4] = {{0}};
        for (i = 0; i + 32 <= V; i += 32)
            for (int q = 0; q < 4; q++) s[q] += (*(v8 *)(pr + i + 8 * q) = exp8(*(const v8 *)(xr + i + 8 * q) - BCAST(m)));
        const v8 s8 = (s[0] + s[1]) + (s[2] + s[3]);
        float sum = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
        for (; i < V; i++) sum += (pr[i] = expf(xr[i] - m));
        const float inv = 1.0f / sum;
        for (i = 0; i + 8 <= V; i += 8) *(v8 *)(pr + i) *= BCAST(inv);
        for (; i < V; i++) pr[i] *= inv;
    }
}

/* Top-p sampling of a row of probabilities p [V]. It keeps its nucleus (when top_p < 1):
   the most probable tokens, each kept when the mass ranked strictly above it is < top_p; the
   smallest kept probability t becomes a threshold and every token with p >= t is kept (ties with
   it too). The threshold comes from a select: a histogram of mass over 1024 linear buckets of
   p / max(p), the row compacted to the bucket where the mass crosses top_p, radix levels over
   the float bits (monotone for p >= 0) while that bucket is crowded, then a sort of the few
   values left; the kept mass falls out of the same walk. Then u in (0, 1] picks a token
   by inverse CDF over the kept mass in vocabulary order. Outputs: tok and
   ratio = p[tok] / kept mass. Scratch: buf [V] floats. */
static int desc_cmp(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static inline uint32_t fbits(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}

/* Over the values whose bits >> (shift + 8) equal `prefix`, histogram mass by the next 8 bits
   (four interleaved histograms, so equal buckets do not chain their adds) and return the highest
   bucket where above + its mass reaches top_p, advancing above past the buckets over it. When
   rounding leaves no such bucket, the lowest non-empty one is returned with above before it. */
static int64_t crossing(const float *row, int64_t V, int shift, uint64_t prefix, double top_p, double *above) {
    double mass[4][256];
    memset(mass, 0, sizeof(mass));
    int64_t i = 0;
    for (; i + 4 <= V; i += 4)
        for (int j = 0; j < 4; j++) {
            const uint64_t b = fbits(row[i + j]);
            if ((b >> (shift + 8)) == prefix) mass[j][(b >> shift) & 0xFF] += row[i + j];
        }
    for (; i < V; i++) {
        const uint64_t b = fbits(row[i]);
        if ((b >> (shift + 8)) == prefix) mass[0][(b >> shift) & 0xFF] += row[i];
    }
    int64_t low = -1;
    double low_mass = 0.0;
    for (int64_t k = 255; k >= 0; k--) {
        const double m = (mass[0][k] + mass[1][k]) + (mass[2][k] + mass[3][k]);
        if (m == 0.0) continue;
        if (*above + m >= top_p) return k;
        *above += m;
        low = k;
        low_mass = m;
    }
    *above -= low_mass;
    return low;
}

/* Keep in buf[0:m] the values whose bits >> shift equal prefix; returns the new m. */
static int64_t compact(const float *src, int64_t m, int shift, uint64_t prefix, float *buf) {
    int64_t k = 0;
    for (int64_t i = 0; i < m; i++)
        if (((uint64_t)fbits(src[i]) >> shift) == prefix) buf[k++] = src[i];
    return k;
}

/* Linear first level: bucket = p * 1023 / max(p), so near-uniform and peaked rows both spread out;
   returns the crossing bucket (advancing above past the buckets over it) and compacts its values
   into buf (*m of them); -1 when rounding leaves no crossing. Buckets are computed 8 lanes at a
   time; mass goes into two histograms by the index's parity, so neighbours do not chain their adds. */
static inline v8i bucket8(v8 x, float scale) {
    const v8i b = __builtin_convertvector(x * BCAST(scale), v8i), top = b > 1023;  /* truncates, as (int64_t) */
    return (b & ~top) | (1023 & top);
}

static int64_t linear_crossing(const float *row, int64_t V, double top_p, double *above, float *buf, int64_t *m) {
    double mass[2][1024];
    memset(mass, 0, sizeof(mass));
    v8 mx = {0};
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) mx = vmax(mx, *(const v8 *)(row + i));
    float pmax = 0.0f;
    for (int j = 0; j < 8; j++) pmax = mx[j] > pmax ? mx[j] : pmax;
    for (; i < V; i++) pmax = row[i] > pmax ? row[i] : pmax;
    const float scale = 1023.0f / pmax;
    for (i = 0; i + 8 <= V; i += 8) {
        const v8 x = *(const v8 *)(row + i);
        const v8i b = bucket8(x, scale);
        for (int j = 0; j < 8; j++) mass[j & 1][b[j]] += x[j];
    }
    for (; i < V; i++) {
        const int64_t b = (int64_t)(row[i] * scale);
        mass[i & 1][b > 1023 ? 1023 : b] += row[i];
    }
    int64_t k = 1023;
    double a = *above;  /* a local: through the pointer every bucket would store and reload it */
    for (; k >= 0; k--) {
        const double s = mass[0][k] + mass[1][k];
        if (a + s >= top_p) break;
        a += s;
    }
    *above = a;
    if (k < 0) return -1;
    int64_t c = 0;
    for (i = 0; i + 8 <= V; i += 8) {  /* the crossing bucket is a small share of the row: skip 8 lanes at once */
        const v8 x = *(const v8 *)(row + i);
        const v8i hit = bucket8(x, scale) == (int32_t)k;
        const v4l any = (v4l)hit;
        if (!(any[0] | any[1] | any[2] | any[3])) continue;
        for (int j = 0; j < 8; j++)
            if (hit[j]) buf[c++] = x[j];
    }
    for (; i < V; i++) {
        const int64_t b = (int64_t)(row[i] * scale);
        if ((b > 1023 ? 1023 : b) == k) buf[c++] = row[i];
    }
    *m = c;
    return k;
}

/* One row's pick: greedy >= 0 is the token taken (its ratio still under the nucleus), else the
   draw by u. */
static void sample_row(const float *restrict row, float top_p, float u, int64_t greedy, float *restrict buf,
                       int64_t V, int64_t *restrict tok, float *restrict ratio) {
    float t = 0.0f;
    double total = -1.0;  /* the kept mass, when the select found it */
    if (top_p < 1.0f) {
        double above = 0.0;
        int64_t m = 0;
        int64_t b = linear_crossing(row, V, top_p, &above, buf, &m);
        uint64_t prefix = 0;
        for (int shift = 24; shift >= 8 && b >= 0 && m > 64; shift -= 8) {  /* radix levels on a crowded bucket */
            b = crossing(buf, m, shift, prefix, top_p, &above);
            prefix = (prefix << 8) | (uint64_t)b;
            if (b >= 0) m = compact(buf, m, shift, prefix, buf);
        }
        if (b >= 0) {  /* the few values left, sorted */
            qsort(buf, m, sizeof(float), desc_cmp);
            int64_t j = 0;
            t = buf[0];
            for (; j < m && above < top_p; j++) {
                t = buf[j];
                above += buf[j];
            }
            for (; j < m && buf[j] == t; j++) above += buf[j];  /* ties with the threshold are kept */
            total = above;
        }
    }
    if (total < 0.0) {
        total = 0.0;
        for (int64_t i = 0; i < V; i++) if (row[i] >= t) total += row[i];
    }
    int64_t pick = greedy, last = -1, i = 0;
    if (pick < 0) {  /* inverse CDF: kept mass in 32-token blocks (vectorised), then token by token in the block */
        const double target = u * total;
        double c = 0.0;
        const v8 tv = BCAST(t);
        for (; i + 32 <= V && pick < 0; i += 32) {
            v8 s = {0};
            for (int q = 0; q < 4; q++) {
                const v8 x = *(const v8 *)(row + i + 8 * q);
                s += (v8)((v8i)x & (v8i)(x >= tv));
            }
            const double bs = (double)(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
            if (bs <= 0.0) continue;
            if (c + bs < target) { c += bs; for (int64_t k = i + 31; k >= i; k--) if (row[k] >= t && row[k] > 0.0f) { last = k; break; } continue; }
            for (int64_t k = i; k < i + 32; k++) {
                if (row[k] < t || row[k] <= 0.0f) continue;
                last = k;
                c += row[k];
                if (c >= target) { pick = k; break; }
            }
        }
        for (; i < V && pick < 0; i++) {
            if (row[i] < t || row[i] <= 0.0f) continue;
            last = i;
            c += row[i];
            if (c >= target) pick = i;
        }
        if (pick < 0) pick = last;  /* target rounded above the running sum: the last kept token */
    }
    *tok = pick;
    *ratio = (float)(row[pick] / total);
}

/* The engine's whole sampling step for logit rows x [N, V], in one call: p [N, V] = softmax_rows(x),
   then per row the greedy token (greedy[n]: the first index of the largest logit) or the top-p
   draw by u[n], with ratio[n] = p[tok] / kept mass. Scratch: buf [V] floats. */
void sample_rows(const float *restrict x, float *restrict p, const float *restrict top_p, const float *restrict u,
                 const int64_t *restrict greedy, int64_t *restrict tok, float *restrict ratio, float *restrict buf,
                 int64_t N, int64_t V) {
    softmax_rows(x, p, N, V);
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * V;
        int64_t g = -1;
        if (greedy[n]) {
            g = 0;
            for (int64_t i = 1; i < V; i++) g = xr[i] > xr[g] ? i : g;
        }
        sample_row(p + n * V, top_p[n], u[n], g, buf, V, tok + n, ratio + n);
    }
}
