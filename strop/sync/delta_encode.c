/* The delta coder's per-change loops: shared helpers and the encoder (the
   decoder is delta_decode.c; `strop.sync.native_coder` compiles the two together, this one first).

   It writes exactly the bytes `strop.sync.tensor_codec`'s numpy path writes; numpy stays the
   reference and the fallback. Encoding is two calls. `delta_scan` makes one pass over old and new
   by 64-element blocks (AVX2 masks of the changes and of the low class, the block's ordinal steps
   in one vector pass) and lists each class's coordinates (ranks or positions) and steps, with the
   sums the Rice parameters need. `delta_emit` writes each Rice stream in one pass, then the step
   streams (sign bits by movemask, escapes from a mask). Python picks the class bound before the
   scan and the Rice parameters between the calls (`tensor_codec.choose_bound`, `bits.rice_k`),
   so both paths choose alike.

   Elements are uint16 (BF16, F16) or uint32 (F32) bit patterns; `w` is their width in bytes,
   a constant in every inlined helper so the compiler emits one loop per width. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef int64_t i64;
typedef uint64_t u64;
typedef uint32_t u32;
#define INLINE static inline __attribute__((always_inline))

/* error codes, named by native_coder */
#define E_TRUNC -1
#define E_RICE -2
#define E_CLASSES -3
#define E_BOUND -4
#define E_OUTSIDE -5
#define E_STEPS -6
#define E_TRAILING -7
#define E_NOMEM -8
#define E_CAP -9

INLINE u32 at(const void *p, i64 i, int w) { return w == 2 ? ((const uint16_t *)p)[i] : ((const uint32_t *)p)[i]; }
INLINE void put(void *p, i64 i, u32 v, int w) {
    if (w == 2) ((uint16_t *)p)[i] = (uint16_t)v; else ((uint32_t *)p)[i] = v;
}
INLINE u32 wrap(u32 v, int w) { return w == 2 ? (v & 0xffffu) : v; }
INLINE u32 sgn(u32 v, int w) { return v >> (w * 8 - 1); }
/* tensor_codec.order_key: float order as unsigned order (negatives' magnitude bits flipped) */
INLINE u32 okey(u32 u, int w) { return u ^ (sgn(u, w) * (w == 2 ? 0x7fffu : 0x7fffffffu)); }

/* ---- masks over 64 elements from i (len <= 64 of them valid): bit j of *chg is
   old[i+j] != new[i+j], of *low is |old[i+j]| < t (t = bound << mant, 0 for no low class) ---- */
#ifdef __AVX2__
INLINE u32 bits16x2(__m256i a, __m256i b) {  /* two vectors of 16 all-0/all-1 lanes -> 32 bits */
    return (u32)_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xD8));
}
INLINE u32 bits32(__m256i a) { return (u32)_mm256_movemask_ps(_mm256_castsi256_ps(a)); }
#endif

INLINE void masks(const void *o, const void *nw, i64 i, i64 len, u32 t, int w, int want_chg, int want_low,
                  u64 *chg, u64 *low) {
    u64 c = 0, l = 0;
#ifdef __AVX2__
    if (len == 64 && w == 2) {
        const __m256i *a = (const __m256i *)((const uint16_t *)o + i);
        const __m256i *b = (const __m256i *)((const uint16_t *)nw + i);
        __m256i am = _mm256_set1_epi16(0x7fff), tv = _mm256_set1_epi16((short)t);
        for (int h = 0; h < 2; h++) {
            __m256i a0 = _mm256_loadu_si256(a + 2 * h), a1 = _mm256_loadu_si256(a + 2 * h + 1);
            if (want_chg) {
                __m256i b0 = _mm256_loadu_si256(b + 2 * h), b1 = _mm256_loadu_si256(b + 2 * h + 1);
                c |= (u64)(u32)~bits16x2(_mm256_cmpeq_epi16(a0, b0), _mm256_cmpeq_epi16(a1, b1)) << (32 * h);
            }
            if (want_low)  /* |old| <= 0x7fff and t <= 0x7fff: a signed compare is exact */
                l |= (u64)bits16x2(_mm256_cmpgt_epi16(tv, _mm256_and_si256(a0, am)),
                                   _mm256_cmpgt_epi16(tv, _mm256_and_si256(a1, am))) << (32 * h);
        }
        *chg = c; *low = l;
        return;
    }
    if (len == 64 && w == 4) {
        const __m256i *a = (const __m256i *)((const uint32_t *)o + i);
        const __m256i *b = (const __m256i *)((const uint32_t *)nw + i);
        __m256i am = _mm256_set1_epi32(0x7fffffff), tv = _mm256_set1_epi32((int)t);
        for (int h = 0; h < 8; h++) {
            __m256i a0 = _mm256_loadu_si256(a + h);
            if (want_chg) c |= (u64)(~bits32(_mm256_cmpeq_epi32(a0, _mm256_loadu_si256(b + h))) & 0xffu) << (8 * h);
            if (want_low) l |= (u64)bits32(_mm256_cmpgt_epi32(tv, _mm256_and_si256(a0, am))) << (8 * h);
        }
        *chg = c; *low = l;
        return;
    }
#endif
    u32 am = w == 2 ? 0x7fffu : 0x7fffffffu;
    for (i64 j = 0; j < len; j++) {
        u32 a = at(o, i + j, w);
        if (want_chg) c |= (u64)(a != at(nw, i + j, w)) << j;
        if (want_low) l |= (u64)((a & am) < t) << j;
    }
    *chg = c; *low = l;
}

/* The block's ordinal steps (d) and, where |d| > 1, |d| - 2 (else 0) into dbuf and bbuf, for
   all 64 lanes whether changed or not; returns the lanes with |d| != 1. One vector pass per
   block beats per-change scalar work once a block holds a few changes. */
INLINE u64 block_steps(const void *o, const void *nw, i64 i, i64 len, int w, void *dbuf, void *bbuf) {
    u64 e = 0;
#ifdef __AVX2__
    if (len == 64 && w == 2) {
        const __m256i *a = (const __m256i *)((const uint16_t *)o + i);
        const __m256i *b = (const __m256i *)((const uint16_t *)nw + i);
        __m256i mag15 = _mm256_set1_epi16(0x7fff), one = _mm256_set1_epi16(1), two = _mm256_set1_epi16(2);
        for (int h = 0; h < 4; h += 2) {
            __m256i ones[2];
            for (int q = 0; q < 2; q++) {
                __m256i x = _mm256_loadu_si256(a + h + q), y = _mm256_loadu_si256(b + h + q);
                x = _mm256_xor_si256(x, _mm256_and_si256(_mm256_srai_epi16(x, 15), mag15));
                y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_srai_epi16(y, 15), mag15));
                __m256i d = _mm256_sub_epi16(y, x), m = _mm256_abs_epi16(d);  /* abs(-2^15) stays 2^15 */
                ones[q] = _mm256_cmpeq_epi16(m, one);
                _mm256_storeu_si256((__m256i *)dbuf + h + q, d);
                _mm256_storeu_si256((__m256i *)bbuf + h + q, _mm256_andnot_si256(ones[q], _mm256_sub_epi16(m, two)));
            }
            e |= (u64)(u32)~bits16x2(ones[0], ones[1]) << (16 * h);
        }
        return e;
    }
    if (len == 64 && w == 4) {
        const __m256i *a = (const __m256i *)((const uint32_t *)o + i);
        const __m256i *b = (const __m256i *)((const uint32_t *)nw + i);
        __m256i mag31 = _mm256_set1_epi32(0x7fffffff), one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
        for (int h = 0; h < 8; h++) {
            __m256i x = _mm256_loadu_si256(a + h), y = _mm256_loadu_si256(b + h);
            x = _mm256_xor_si256(x, _mm256_and_si256(_mm256_srai_epi32(x, 31), mag31));
            y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_srai_epi32(y, 31), mag31));
            __m256i d = _mm256_sub_epi32(y, x), m = _mm256_abs_epi32(d), isone = _mm256_cmpeq_epi32(m, one);
            _mm256_storeu_si256((__m256i *)dbuf + h, d);
            _mm256_storeu_si256((__m256i *)bbuf + h, _mm256_andnot_si256(isone, _mm256_sub_epi32(m, two)));
            e |= (u64)(~bits32(isone) & 0xffu) << (8 * h);
        }
        return e;
    }
#endif
    for (i64 j = 0; j < len; j++) {
        u32 d = wrap(okey(at(nw, i + j, w), w) - okey(at(o, i + j, w), w), w);
        u32 m = sgn(d, w) ? wrap(0u - d, w) : d;
        put(dbuf, j, d, w);
        put(bbuf, j, m != 1 ? m - 2 : 0, w);
        e |= (u64)(m != 1) << j;
    }
    return e;
}

/* ---- MSB-first bit writer (np.packbits order): `fill` bits (1..64 after a write) pending at
   the top of `acc`; it only ever stores bits of the stream, so it never writes past its end ---- */
typedef struct { uint8_t *p; u64 acc; u32 fill; } BW;
INLINE void bw_word(BW *b, u64 x) {
    x = __builtin_bswap64(x);
    memcpy(b->p, &x, 8);
    b->p += 8;
}
INLINE void bw_unary(BW *b, u64 zeros) {  /* `zeros` 0 bits, then a 1 */
    u64 pos = b->fill + zeros;
    if (__builtin_expect(pos >= 64, 0)) {  /* about once per 64 bits written */
        bw_word(b, b->acc);
        for (pos -= 64; pos >= 64; pos -= 64) bw_word(b, 0);
        b->acc = 0;
    }
    b->acc |= 1ull << (63 - pos);
    b->fill = (u32)pos + 1;
}
INLINE void bw_bits(BW *b, u64 x, u32 nb) {  /* the low nb (1..57) bits of x, MSB first */
    if (b->fill + nb > 64) {
        u32 room = 64 - b->fill, rest = nb - room;
        bw_word(b, b->acc | (x >> rest));
        b->acc = x << (64 - rest);
        b->fill = rest;
    } else {
        b->acc |= x << (64 - b->fill - nb);
        b->fill += nb;
    }
}
INLINE uint8_t *bw_end(BW *b) {  /* the pending bits, zero-padded to a byte */
    for (u32 s = 0; s < b->fill; s += 8) *b->p++ = (uint8_t)(b->acc >> (56 - s));
    return b->p;
}

static uint8_t *varint_put(uint8_t *p, u64 x) {
    while (x >= 0x80) { *p++ = (uint8_t)(x | 0x80); x >>= 7; }
    *p++ = (uint8_t)x;
    return p;
}

/* value i of a Rice stream: v[i] itself, or in gap mode the zeros skipped before sorted v[i] */
INLINE u64 rval(const i64 *v, i64 i, int gap) { return gap ? (u64)(v[i] - (i ? v[i - 1] : -1) - 1) : (u64)v[i]; }

/* MSB-first byte of eight 0/1 bytes (byte t of x -> bit 7 - t): the multiply moves each to
   its place without collisions or carries */
INLINE u32 pack8(u64 x) { return (u32)((x * 0x8040201008040201ull) >> 56); }

/* bits.rice_encode: varint m [, k, unary length], unary quotients, k remainder bit planes
   (plane q holds bit k-1-q of every remainder, MSB first). One pass writes both parts. */
INLINE int varint_len(u64 x) { int n = 1; while (x >= 0x80) { x >>= 7; n++; } return n; }

INLINE uint8_t *rice_put_(uint8_t *p, const i64 *v, i64 m, int k, int gap, int wide, u64 total, uint8_t *planes) {
    p = varint_put(p, (u64)m);
    if (!m) return p;
    p = varint_put(p, (u64)k);
    /* the unary length goes before the unary bits but is known only after them: they are written
       after room for its longest varint (from total, which bounds it) and moved back if shorter;
       the planes wait in scratch */
    int room = varint_len((u64)m + (total >> k));
    i64 pb = (m + 7) / 8;
    u64 low = (1ull << k) - 1, nbits = (u64)m;
    BW b = {p + room, 0, 0};
    for (i64 j = 0; j < pb; j++) {
        /* xc: bits 8c..8c+7 of the 8 remainders, one byte each: plane byte b is then a shift,
           a mask and pack8 of x(b >> 3) */
        u64 x0 = 0, x1 = 0, x2 = 0, x3 = 0;
        int cnt = m - 8 * j < 8 ? (int)(m - 8 * j) : 8;
        for (int t = 0; t < cnt; t++) {
            u64 x = rval(v, 8 * j + t, gap), r = x & low;
            bw_unary(&b, x >> k);
            nbits += x >> k;
            x0 |= (r & 0xff) << (8 * t);
            if (wide) {
                x1 |= ((r >> 8) & 0xff) << (8 * t);
                x2 |= ((r >> 16) & 0xff) << (8 * t);
                x3 |= ((r >> 24) & 0xff) << (8 * t);
            }
        }
        uint8_t *q = planes + j;
        for (int bit = k - 1; bit >= 0; bit--, q += pb) {
            u64 x = !wide || bit < 8 ? x0 : bit < 16 ? x1 : bit < 24 ? x2 : x3;
            *q = (uint8_t)pack8((x >> (bit & 7)) & 0x0101010101010101ull);
        }
    }
    bw_end(&b);
    uint8_t *u = varint_put(p, nbits);
    if (u != p + room) memmove(u, p + room, (nbits + 7) / 8);
    u += (nbits + 7) / 8;
    memcpy(u, planes, (size_t)(k * pb));
    return u + k * pb;
}
/* `planes`: scratch for k * ceil(m / 8) bytes; total: the sum of the values (gaps) */
INLINE uint8_t *rice_put(uint8_t *p, const i64 *v, i64 m, int k, int gap, u64 total, uint8_t *planes) {
    return k > 8 ? rice_put_(p, v, m, k, gap, 1, total, planes) : rice_put_(p, v, m, k, gap, 0, total, planes);
}

/* ---- encode ---- */

/* One pass over old/new: each change's coordinate (rank among the low class's members, or
   position) and ordinal step, low class and top class apart; and what the Rice parameters of
   the step streams need. st: m_low, m_top, escapes (|step| != 1), sum of |step| - 2 over them,
   last escape's index in the low steps, in the top steps (-1: none). */
INLINE void scan(const void *o, const void *nw, i64 n, u32 t, i64 *lowc, void *lst, i64 *topc, void *tst,
                 i64 *st, int w) {
    i64 nl = 0, nt = 0, rank = 0, nesc = 0, sbig = 0, lle = -1, lte = -1;
    uint32_t dbuf[64], bbuf[64];  /* as uint16 when w == 2 */
    for (i64 i = 0; i < n; i += 64) {
        i64 len = n - i < 64 ? n - i : 64;
        u64 c, l;
        masks(o, nw, i, len, t, w, 1, t != 0, &c, &l);
        if (c) {
            u64 e = block_steps(o, nw, i, len, w, dbuf, bbuf), cl = c & l, ct = c & ~l;
            u64 el = e & cl, et = e & ct;
            nesc += __builtin_popcountll(el) + __builtin_popcountll(et);
            /* index of the last escape: changes up to and including the highest escaping lane */
            if (el) lle = nl + __builtin_popcountll(cl & (~0ull >> __builtin_clzll(el))) - 1;
            if (et) lte = nt + __builtin_popcountll(ct & (~0ull >> __builtin_clzll(et))) - 1;
            for (; cl; cl &= cl - 1) {
                int j = __builtin_ctzll(cl);
                lowc[nl] = rank + __builtin_popcountll(l & ((1ull << j) - 1));
                put(lst, nl++, at(dbuf, j, w), w);
                sbig += at(bbuf, j, w);
            }
            for (; ct; ct &= ct - 1) {
                int j = __builtin_ctzll(ct);
                topc[nt] = i + j;
                put(tst, nt++, at(dbuf, j, w), w);
                sbig += at(bbuf, j, w);
            }
        }
        rank += __builtin_popcountll(l);
    }
    st[0] = nl; st[1] = nt; st[2] = nesc; st[3] = sbig; st[4] = lle; st[5] = lte;
}

i64 delta_scan(const void *o, const void *nw, i64 n, int w, u32 t, i64 *lowc, void *lst, i64 *topc, void *tst,
               i64 *st) {
    if (w == 2) scan(o, nw, n, t, lowc, lst, topc, tst, st, 2);
    else scan(o, nw, n, t, lowc, lst, topc, tst, st, 4);
    return 0;
}

/* tensor_codec._encode_steps over the low steps then the top steps: sign bits, escape gaps,
   sizes. esc has room for 2 * nesc + 2 values. */
#ifdef __AVX2__
/* 32 steps from s + i as bytes keeping their sign (saturating packs), and 0xff where |step| == 1 */
INLINE void steps32(const void *s, i64 i, int w, __m256i *sg, __m256i *one) {
    if (w == 2) {
        const __m256i *a = (const __m256i *)((const uint16_t *)s + i), o1 = _mm256_set1_epi16(1);
        __m256i d0 = _mm256_loadu_si256(a), d1 = _mm256_loadu_si256(a + 1);
        *sg = _mm256_permute4x64_epi64(_mm256_packs_epi16(d0, d1), 0xD8);
        *one = _mm256_permute4x64_epi64(_mm256_packs_epi16(_mm256_cmpeq_epi16(_mm256_abs_epi16(d0), o1),
                                                           _mm256_cmpeq_epi16(_mm256_abs_epi16(d1), o1)), 0xD8);
    } else {
        const __m256i *a = (const __m256i *)((const uint32_t *)s + i), o1 = _mm256_set1_epi32(1);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i d[4], e[4];
        for (int q = 0; q < 4; q++) {
            d[q] = _mm256_loadu_si256(a + q);
            e[q] = _mm256_cmpeq_epi32(_mm256_abs_epi32(d[q]), o1);
        }
        *sg = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(d[0], d[1]), _mm256_packs_epi32(d[2], d[3])), order);
        *one = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(e[0], e[1]), _mm256_packs_epi32(e[2], e[3])), order);
    }
}
#endif

INLINE uint8_t *steps_put(uint8_t *p, const void *lst, i64 ml, const void *tst, i64 mt, i64 nesc, int ke, int kb,
                          int w, i64 *esc, const u64 *tot, uint8_t *planes) {
    i64 *big = esc + nesc + 1, ne = 0, all = 0;  /* room for one write past the last escape */
    BW b = {p, 0, 0};
    for (int seg = 0; seg < 2; seg++) {
        const void *s = seg ? tst : lst;
        i64 ms = seg ? mt : ml, off = seg ? ml : 0, i = 0;
#ifdef __AVX2__
        /* 32 at a time: sign bits by movemask (each group of 8 byte-reversed first, for MSB-first
           bytes), escapes (~20% on real deltas) by walking the set bits of a mask */
        const __m256i rev = _mm256_setr_epi8(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8,
                                             7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
        for (; i + 32 <= ms; i += 32) {
            __m256i sg, one;
            steps32(s, i, w, &sg, &one);
            bw_bits(&b, __builtin_bswap32((u32)_mm256_movemask_epi8(_mm256_shuffle_epi8(sg, rev))), 32);
            for (u32 e = ~(u32)_mm256_movemask_epi8(one); e; e &= e - 1) {
                i64 j = i + __builtin_ctz(e);
                u32 d = at(s, j, w), mag = sgn(d, w) ? wrap(0u - d, w) : d;
                if (ne == nesc) return NULL;
                esc[ne] = off + j; big[ne++] = (i64)mag - 2;
                all++;
            }
        }
#endif
        for (; i < ms; i += 8) {
            int cnt = ms - i < 8 ? (int)(ms - i) : 8;
            u64 signs = 0;
            for (int q = 0; q < cnt; q++) {
                u32 d = at(s, i + q, w), neg = sgn(d, w), mag = neg ? wrap(0u - d, w) : d;
                signs |= (u64)neg << (8 * q);
                esc[ne] = off + i + q; big[ne] = (i64)mag - 2;  /* kept only when an escape: no branch */
                ne += (mag != 1) & (ne < nesc);
                all += mag != 1;
            }
            bw_bits(&b, pack8(signs) >> (8 - cnt), (u32)cnt);
        }
    }
    p = bw_end(&b);
    if (all != nesc) return NULL;
    p = rice_put(p, esc, nesc, ke, 1, tot[2], planes);
    return rice_put(p, big, nesc, kb, 0, tot[3], planes);
}

/* The payload after its class header: the classes' coordinate streams (the low one only when
   there are two classes), then the steps. tot: each Rice stream's sum of values (low and top
   coordinate gaps, escape gaps, sizes). Returns its length, or E_CAP / E_NOMEM. */
i64 delta_emit(const i64 *lowc, i64 ml, int kl, const i64 *topc, i64 mt, int kt, int two, const void *lst,
               const void *tst, int w, i64 nesc, int ke, int kb, const u64 *tot, uint8_t *out, i64 cap) {
    i64 np = kl * ((ml + 7) / 8), npt = kt * ((mt + 7) / 8), npe = (ke > kb ? ke : kb) * ((nesc + 7) / 8);
    np = np > npt ? np : npt;
    np = np > npe ? np : npe;
    i64 *esc = malloc(sizeof(i64) * (size_t)(2 * nesc + 2) + (size_t)np);  /* then the planes' scratch */
    if (!esc) return E_NOMEM;
    uint8_t *p = out, *planes = (uint8_t *)(esc + 2 * nesc + 2);
    if (two) p = rice_put(p, lowc, ml, kl, 1, tot[0], planes);
    p = rice_put(p, topc, mt, kt, 1, tot[1], planes);
    if (ml + mt)
        p = w == 2 ? steps_put(p, lst, ml, tst, mt, nesc, ke, kb, 2, esc, tot, planes)
                   : steps_put(p, lst, ml, tst, mt, nesc, ke, kb, 4, esc, tot, planes);
    free(esc);
    if (!p) return E_CAP;
    return p - out > cap ? E_CAP : p - out;
}

i64 count_changes(const void *o, const void *nw, i64 n, int w) {
    i64 m = 0;
    for (i64 i = 0; i < n; i += 64) {
        u64 c, l;
        if (w == 2) masks(o, nw, i, n - i < 64 ? n - i : 64, 0, 2, 1, 0, &c, &l);
        else masks(o, nw, i, n - i < 64 ? n - i : 64, 0, 4, 1, 0, &c, &l);
        m += __builtin_popcountll(c);
    }
    return m;
}
