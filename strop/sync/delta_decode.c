/* The delta decoder, compiled after delta_encode.c (whose helpers it uses) by
   `strop.sync.native_coder`.

   It reads what `tensor_codec.decode_delta` reads: the Rice streams (a unary scan walking set
   bits low to high, the remainder planes spread a byte at a time), ranks turned into positions
   by scanning the old tensor's low-class mask, and the new bit patterns written either as
   (positions, values) or straight into the output tensor. Every count, length and position is
   checked before it is used: a damaged payload gets an error code, never a write out of place. */

/* ---- decode ---- */
typedef struct { const uint8_t *p, *end; } RD;

static int varint_get(RD *r, u64 *x) {
    u64 v = 0;
    for (int s = 0; s < 64; s += 7) {
        if (r->p >= r->end) return E_TRUNC;
        uint8_t b = *r->p++;
        v |= (u64)(b & 0x7f) << s;
        if (b < 0x80) { *x = v; return 0; }
    }
    return E_RICE;  /* longer than any count this format writes */
}

/* A Rice stream's header; checks its body fits in the payload. */
static int rice_head(RD *r, u64 *m, u64 *k, u64 *nbits) {
    int e;
    if ((e = varint_get(r, m)) || !*m) return e;
    if ((e = varint_get(r, k)) || (e = varint_get(r, nbits))) return e;
    u64 left = (u64)(r->end - r->p);
    /* nbits < 2^33 (over 8G changes in one tensor is no real delta) keeps q << k below 2^63 */
    if (*k > 30 || *m > *nbits || *nbits >> 33) return E_RICE;
    if (*nbits / 8 > left) return E_TRUNC;
    u64 need = (*nbits + 7) / 8, pb = (*m + 7) / 8;
    if (need > left || pb * *k > left - need) return E_TRUNC;
    return 0;
}

/* bits.rice_decode into v (room for cap values); in gap mode, the sorted positions the gaps
   describe, each checked below `limit` as it is formed (so no sum can wrap around into range).
   Returns the count or an error. */
static i64 rice_get(RD *r, i64 *v, i64 cap, int gap, i64 limit) {
    u64 m, k, nbits;
    int e = rice_head(r, &m, &k, &nbits);
    if (e || !m) return e ? e : 0;
    if (m > (u64)cap) return E_RICE;
    const uint8_t *s = r->p;
    u64 nbytes = (nbits + 7) / 8;
    i64 cnt = 0, prev = -1;
    for (u64 byte = 0; byte < nbytes; byte += 8) {  /* the unary code: each 1 ends a quotient */
        u64 word = 0;
        if (byte + 8 <= nbytes) memcpy(&word, s + byte, 8);
        else memcpy(&word, s + byte, nbytes - byte);
        /* bits reversed within each byte: stream bit p is then bit p of the little-endian word,
           walked low to high (x &= x - 1 chains one cycle a bit, clearing the top bit three) */
        word = ((word >> 1) & 0x5555555555555555ull) | ((word & 0x5555555555555555ull) << 1);
        word = ((word >> 2) & 0x3333333333333333ull) | ((word & 0x3333333333333333ull) << 2);
        word = ((word >> 4) & 0x0f0f0f0f0f0f0f0full) | ((word & 0x0f0f0f0f0f0f0f0full) << 4);
        u64 base = byte * 8;
        if (nbits - base < 64) word &= (1ull << (nbits - base)) - 1;  /* padding bits are not code */
        if ((u64)cnt + __builtin_popcountll(word) > m) return E_RICE;
        for (; word; word &= word - 1) {
            i64 pos = (i64)(base + __builtin_ctzll(word));
            v[cnt++] = pos - prev - 1;
            prev = pos;
        }
    }
    if ((u64)cnt != m) return E_RICE;
    const uint8_t *pl = s + nbytes;
    i64 pb = (i64)(m + 7) / 8;
    u64 c = ~0ull;  /* the previous position, -1 to start */
    for (i64 j = 0; j < pb; j++) {  /* all k planes, and in gap mode the running position, in one pass */
        i64 r8[8] = {0};
        if (k <= 8) {  /* each plane byte spread to one bit per byte, bytes shifted in together */
            u64 y = 0;
            for (u64 q = 0; q < k; q++) {
                u64 x = (pl[q * pb + j] * 0x0101010101010101ull) & 0x0102040810204080ull;
                y = (y << 1) | (((x + 0x7f7f7f7f7f7f7f7full) >> 7) & 0x0101010101010101ull);
            }
            for (int t = 0; t < 8; t++) r8[t] = (i64)((y >> (8 * t)) & 0xff);
        } else {
            for (u64 q = 0; q < k; q++) {
                u32 byte = pl[q * pb + j];
                for (int t = 0; t < 8; t++) r8[t] = (r8[t] << 1) | ((byte >> (7 - t)) & 1);
            }
        }
        for (int t = 0; t < 8 && 8 * j + t < (i64)m; t++) {
            u64 x = ((u64)v[8 * j + t] << k) | (u64)r8[t];  /* < 2^63 (see rice_head) */
            if (gap && (x >= (u64)limit || (c = c + x + 1) >= (u64)limit)) return E_OUTSIDE;
            v[8 * j + t] = (i64)(gap ? c : x);
        }
    }
    r->p = pl + (i64)k * pb;
    return (i64)m;
}

/* The payload's class header: how many classes past the first (0 or 1) and the bound */
static int class_head(RD *r, u64 *nb, u64 *bound) {
    int e;
    *bound = 0;
    if ((e = varint_get(r, nb))) return e;
    if (*nb > 1) return E_CLASSES;
    return *nb ? varint_get(r, bound) : 0;
}

/* Total changes in a payload (from its coordinate streams' headers), or an error. */
i64 delta_count(const uint8_t *buf, i64 len) {
    RD r = {buf, buf + len};
    u64 nb, bound, total = 0;
    int e;
    if ((e = class_head(&r, &nb, &bound))) return e;
    for (u64 c = 0; c <= nb; c++) {
        u64 m, k, nbits;
        if ((e = rice_head(&r, &m, &k, &nbits))) return e;
        if (m) r.p += (nbits + 7) / 8 + k * ((m + 7) / 8);
        total += m;
    }
    return (i64)total;
}

INLINE int select_low(const void *o, i64 n, u32 t, i64 *r, i64 m, int w) {
    /* ranks among the low class's members (sorted) -> positions, scanning old until the last */
    i64 ri = 0, base = 0;
    for (i64 i = 0; i < n && ri < m; i += 64) {
        u64 c, l;
        masks(o, o, i, n - i < 64 ? n - i : 64, t, w, 0, 1, &c, &l);
        i64 cnt = __builtin_popcountll(l);
        for (; ri < m && r[ri] < base + cnt; ri++) {
#if defined(__BMI2__) && !defined(__znver1__) && !defined(__znver2__)  /* pdep is microcoded there */
            r[ri] = i + __builtin_ctzll(_pdep_u64(1ull << (r[ri] - base), l));
#else
            u64 x = l;
            for (i64 s = r[ri] - base; s; s--) x &= x - 1;
            r[ri] = i + __builtin_ctzll(x);
#endif
        }
        base += cnt;
    }
    return ri == m ? 0 : E_OUTSIDE;
}

/* The new bit patterns into vals, or with `out` into out[pos] (vals then only scratch; out may
   be o itself: each element is read before it is written). */
INLINE void new_values(const void *o, const i64 *pos, i64 m, const uint8_t *sg, const i64 *esc, const i64 *big,
                       i64 ne, void *vals, void *out, int w, int to_out) {
    /* |step| into vals first (1, then the escapes scattered: independent stores, where walking
       the escapes alongside would chain every change on a load), then sign and new value */
    for (i64 i = 0; i < m; i++) put(vals, i, 1, w);
    for (i64 e = 0; e < ne; e++) put(vals, esc[e], wrap((u32)(big[e] + 2), w), w);  /* sizes wrap, as encoded */
    for (i64 i = 0; i < m; i++) {
        u32 mag = at(vals, i, w), d = (sg[i >> 3] >> (7 - (i & 7))) & 1 ? wrap(0u - mag, w) : mag;
        u32 v = okey(wrap(okey(at(o, pos[i], w), w) + d, w), w);
        if (to_out) put(out, pos[i], v, w);  /* a constant: one loop each */
        else put(vals, i, v, w);
    }
}

/* one loop per width and destination, each compiled on its own (inlined into one function
   together they ran ~40% slower) */
#define NEW_VALUES(name, w, to_out) \
    static __attribute__((noinline)) void name(const void *o, const i64 *pos, i64 m, const uint8_t *sg, \
                                               const i64 *esc, const i64 *big, i64 ne, void *vals, void *out) { \
        new_values(o, pos, m, sg, esc, big, ne, vals, out, w, to_out); \
    }
NEW_VALUES(new_values_2, 2, 0)
NEW_VALUES(new_values_2o, 2, 1)
NEW_VALUES(new_values_4, 4, 0)
NEW_VALUES(new_values_4o, 4, 1)

/* tensor_codec.decode_delta: positions (each class's sorted) and new bit patterns of the m
   changes `delta_count` found, or with `out`, the changes written there. Returns 0 or an error. */
i64 delta_decode(const void *o, i64 n, int w, int mant, int expb, const uint8_t *buf, i64 len, i64 *pos,
                 void *vals, i64 m, void *out) {
    RD r = {buf, buf + len};
    u64 nb, bound;
    int e;
    if ((e = class_head(&r, &nb, &bound))) return e;
    if (bound >= (1ull << expb)) return E_BOUND;
    u32 t = (u32)(bound << mant);
    i64 m1 = 0;
    if (nb) {
        if ((m1 = rice_get(&r, pos, m, 1, n)) < 0) return m1;
        if ((e = w == 2 ? select_low(o, n, t, pos, m1, 2) : select_low(o, n, t, pos, m1, 4))) return e;
    }
    i64 m2 = rice_get(&r, pos + m1, m - m1, 1, n);
    if (m2 < 0) return m2;
    if (m1 + m2 != m) return E_RICE;
    if (!m) return r.p == r.end ? 0 : E_TRAILING;
    const uint8_t *sg = r.p;
    if ((m + 7) / 8 > r.end - r.p) return E_TRUNC;
    r.p += (m + 7) / 8;
    RD peek = r;
    u64 ne;
    if ((e = varint_get(&peek, &ne))) return e;
    if (ne > (u64)m) return E_STEPS;
    i64 *esc = malloc(sizeof(i64) * (size_t)(2 * ne + 1)), *big = esc + ne;
    if (!esc) return E_NOMEM;
    i64 got = rice_get(&r, esc, (i64)ne, 1, m), gotb = got < 0 ? got : rice_get(&r, big, (i64)ne, 0, 0);
    if (got == E_OUTSIDE) got = E_STEPS;  /* an escape past the last change */
    if (got < 0 || gotb < 0) e = got < 0 ? (int)got : (int)gotb;
    else if (got != gotb) e = E_STEPS;
    else if (r.p != r.end) e = E_TRAILING;
    else if (w == 2 && out) new_values_2o(o, pos, m, sg, esc, big, got, vals, out);
    else if (w == 2) new_values_2(o, pos, m, sg, esc, big, got, vals, out);
    else if (out) new_values_4o(o, pos, m, sg, esc, big, got, vals, out);
    else new_values_4(o, pos, m, sg, esc, big, got, vals, out);
    free(esc);
    return e;
}
