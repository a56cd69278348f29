/*
 * gradsync._native: fused CPU kernels for the common codec operators.
 *
 * Why this file exists: the codec operators are defined in plain torch (gradsync/codecs/ops/),
 * which runs on every device and under torch.compile. On the CPU, eager torch needs several
 * passes over memory for what is one pass here (for example |x| >= t, count and compaction is
 * abs + compare + nonzero + gather), and Inductor cannot express stream compaction or a
 * histogram-free threshold search. These kernels do each operator in one streaming pass with
 * AVX2. They are used only for contiguous float32 CPU tensors with fewer than 2^31 elements and
 * only when the CPU has AVX2, FMA and F16C (checked at import); everything else takes the torch
 * path. Every function here is checked against an independent torch reference in the tests.
 *
 * Calling convention: the Python wrapper (gradsync/codecs/ops/native.py) validates dtypes,
 * sizes and contiguity and passes raw data pointers as integers. The GIL is released around
 * every kernel so that compression can overlap with autograd on another thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GS_X86 1
#define KERNEL __attribute__((target("avx2,fma,f16c")))
#else
#define GS_X86 0
#endif

#if GS_X86

#define FLT_BIG 3.4028234663852886e38f

static inline KERNEL __m256 abs8(__m256 v) {
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
}

/* value compared against the threshold: |x|, x or -x */
static inline KERNEL __m256 keyed8(__m256 v, int mode) {
    if (mode == 0) return abs8(v);
    if (mode == 1) return v;
    return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)));
}

static inline float keyed1(float v, int mode) {
    return mode == 0 ? fabsf(v) : (mode == 1 ? v : -v);
}

static inline KERNEL float hmax8(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    float m = t[0];
    for (int i = 1; i < 8; i++) m = t[i] > m ? t[i] : m;
    return m;
}

static inline KERNEL double hsum8(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    double s = 0.0;
    for (int i = 0; i < 8; i++) s += t[i];
    return s;
}

static inline KERNEL int64_t hsum8i(__m256i v) {
    int32_t t[8];
    _mm256_storeu_si256((__m256i *)t, v);
    int64_t s = 0;
    for (int i = 0; i < 8; i++) s += t[i];
    return s;
}

/* lanes where |v| is inf or NaN, as 0/-1 integers */
static inline KERNEL __m256i nonfinite8(__m256 a_abs) {
    return _mm256_castps_si256(_mm256_cmp_ps(a_abs, _mm256_set1_ps(FLT_BIG), _CMP_NLE_UQ));
}

/* Blocks of this many elements accumulate in float, then into a double. */
#define BLOCK 4096

/*
 * stats: out[0] = sum |x|, out[1] = max |x| (NaN ignored, inf counted), out[2] = number of
 * non-finite elements, out[3] = sum x^2.
 */
static KERNEL void k_stats(const float *x, int64_t n, double *out) {
    __m256 mx = _mm256_setzero_ps();
    __m256i nf = _mm256_setzero_si256();
    double s = 0.0, q = 0.0;
    int64_t i = 0;
    while (i + 16 <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        __m256 q0 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            __m256 a0 = abs8(v0), a1 = abs8(v1);
            s0 = _mm256_add_ps(s0, a0);
            s1 = _mm256_add_ps(s1, a1);
            q0 = _mm256_fmadd_ps(v0, v0, q0);
            q1 = _mm256_fmadd_ps(v1, v1, q1);
            mx = _mm256_max_ps(a0, mx);
            mx = _mm256_max_ps(a1, mx);
            nf = _mm256_sub_epi32(nf, nonfinite8(a0));
            nf = _mm256_sub_epi32(nf, nonfinite8(a1));
        }
        s += hsum8(_mm256_add_ps(s0, s1));
        q += hsum8(_mm256_add_ps(q0, q1));
    }
    float m = hmax8(mx);
    int64_t nfc = hsum8i(nf);
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        s += a;
        q += (double)x[i] * x[i];
        if (a > m) m = a;
        nfc += !(a <= FLT_BIG);
    }
    out[0] = s;
    out[1] = m;
    out[2] = (double)nfc;
    out[3] = q;
}

/*
 * scan_select: one pass that computes sum |x| (when want_sum), max |x| and whether any element
 * is non-finite, and compacts every element whose key (|x|, x or -x by mode) is >= t into
 * (idx, val), in index order. Writes at most cap entries but returns the full count, so the
 * caller can tell the buffer was too small. st = [sum |x|, max |x|, non-finite flag]; the max
 * is taken over the bit patterns of |x| (monotone for non-negative floats), which also reveals
 * inf/NaN without a separate compare: any pattern >= 0x7f800000 is non-finite.
 */
static KERNEL int64_t k_scan_select(const float *x, int64_t n, float t, int mode, int want_sum,
                                    int32_t *idx, float *val, int64_t cap, double *st) {
    const __m256 tv = _mm256_set1_ps(t);
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i mb0 = _mm256_setzero_si256(), mb1 = _mm256_setzero_si256();
    double s = 0.0;
    int64_t cnt = 0, i = 0;
    while (i + 16 <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            __m256i b0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), am);
            __m256i b1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 8)), am);
            __m256 a0 = _mm256_castsi256_ps(b0), a1 = _mm256_castsi256_ps(b1);
            if (want_sum) {
                s0 = _mm256_add_ps(s0, a0);
                s1 = _mm256_add_ps(s1, a1);
            }
            mb0 = _mm256_max_epi32(mb0, b0);
            mb1 = _mm256_max_epi32(mb1, b1);
            __m256 k0 = mode == 0 ? a0 : keyed8(_mm256_loadu_ps(x + i), mode);
            __m256 k1 = mode == 0 ? a1 : keyed8(_mm256_loadu_ps(x + i + 8), mode);
            unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(k0, tv, _CMP_GE_OQ)) |
                         ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(k1, tv, _CMP_GE_OQ)) << 8);
            while (m) {
                int b = __builtin_ctz(m);
                m &= m - 1;
                if (cnt < cap) {
                    idx[cnt] = (int32_t)(i + b);
                    val[cnt] = x[i + b];
                }
                cnt++;
            }
        }
        if (want_sum) s += hsum8(_mm256_add_ps(s0, s1));
    }
    int32_t mb[8];
    _mm256_storeu_si256((__m256i *)mb, _mm256_max_epi32(mb0, mb1));
    int32_t top = 0;
    for (int q = 0; q < 8; q++) top = mb[q] > top ? mb[q] : top;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        int32_t b;
        memcpy(&b, &a, 4);
        top = b > top ? b : top;
        if (want_sum) s += a;
        if (keyed1(x[i], mode) >= t) {
            if (cnt < cap) {
                idx[cnt] = (int32_t)i;
                val[cnt] = x[i];
            }
            cnt++;
        }
    }
    float m;
    memcpy(&m, &top, 4);
    st[0] = want_sum ? s : NAN;
    st[1] = m;
    st[2] = top >= 0x7f800000 ? 1.0 : 0.0;
    return cnt;
}

/* count_ge: out[j] = #{i : key(x[i]) >= ts[j]} for up to 16 thresholds in one pass. */
static KERNEL void k_count_ge(const float *x, int64_t n, const float *ts, int m, int mode,
                              int64_t *out) {
    __m256 tv[16];
    __m256i acc[16];
    for (int j = 0; j < m; j++) {
        tv[j] = _mm256_set1_ps(ts[j]);
        acc[j] = _mm256_setzero_si256();
        out[j] = 0;
    }
    int64_t i = 0;
    while (i + 8 <= n) {
        /* int32 lane counters: flush before they can overflow */
        int64_t end = i + ((int64_t)1 << 30) < n ? i + ((int64_t)1 << 30) : n;
        for (; i + 8 <= end; i += 8) {
            __m256 k = keyed8(_mm256_loadu_ps(x + i), mode);
            for (int j = 0; j < m; j++)
                acc[j] = _mm256_sub_epi32(acc[j], _mm256_castps_si256(_mm256_cmp_ps(k, tv[j], _CMP_GE_OQ)));
        }
        for (int j = 0; j < m; j++) {
            out[j] += hsum8i(acc[j]);
            acc[j] = _mm256_setzero_si256();
        }
    }
    for (; i < n; i++) {
        float k = keyed1(x[i], mode);
        for (int j = 0; j < m; j++) out[j] += k >= ts[j];
    }
}

/* Quickselect (Hoare partition, median of three): k-th largest (1-based) of a[0..n). */
static float kth_largest_inplace(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1; /* position in descending order */
    while (hi > lo) {
        int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float p = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                float tmp = a[i];
                a[i] = a[j];
                a[j] = tmp;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/*
 * kth_largest of key(v) for v in vals[0..n); scratch must hold n floats. Large inputs first
 * bucket the keys into 2048 equal-width bins between their min and max, find the bin holding the
 * k-th largest, and run quickselect only on that bin's elements.
 */
#define KTH_BINS 2048
static KERNEL float k_kth_largest(const float *vals, int64_t n, int64_t k, int mode, float *scratch) {
    if (n <= 8192) {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(scratch + i, keyed8(_mm256_loadu_ps(vals + i), mode));
        for (; i < n; i++) scratch[i] = keyed1(vals[i], mode);
        return kth_largest_inplace(scratch, n, k);
    }
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float v = keyed1(vals[i], mode);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    if (!(hi > lo) || !isfinite(hi - lo)) {
        int64_t i = 0;
        for (; i < n; i++) scratch[i] = keyed1(vals[i], mode);
        return kth_largest_inplace(scratch, n, k);
    }
    float scale = (float)KTH_BINS / (hi - lo);
    int64_t counts[KTH_BINS + 1];
    memset(counts, 0, sizeof(counts));
    for (int64_t i = 0; i < n; i++) {
        int b = (int)((keyed1(vals[i], mode) - lo) * scale);
        b = b < 0 ? 0 : (b > KTH_BINS ? KTH_BINS : b);
        counts[b]++;
    }
    int64_t above = 0;
    int bin = KTH_BINS;
    for (; bin > 0; bin--) {
        if (above + counts[bin] >= k) break;
        above += counts[bin];
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = keyed1(vals[i], mode);
        int b = (int)((v - lo) * scale);
        b = b < 0 ? 0 : (b > KTH_BINS ? KTH_BINS : b);
        if (b == bin) scratch[m++] = v;
    }
    return kth_largest_inplace(scratch, m, k - above);
}

/*
 * keep_top: given candidates (idx, val) in index order and the k-th largest key kth, keep the
 * entries with key > kth and then, in index order, the first (k - #greater) entries with
 * key == kth. Compacts in place and returns the number kept (k unless fewer candidates).
 */
static int64_t k_keep_top(int32_t *idx, float *val, int64_t n, int64_t k, float kth, int mode) {
    int64_t greater = 0;
    for (int64_t i = 0; i < n; i++) greater += keyed1(val[i], mode) > kth;
    int64_t ties = k - greater, out = 0;
    for (int64_t i = 0; i < n && out < k; i++) {
        float key = keyed1(val[i], mode);
        if (key > kth || (key == kth && ties > 0)) {
            if (key == kth) ties--;
            idx[out] = idx[i];
            val[out] = val[i];
            out++;
        }
    }
    return out;
}

/* sign_pack: bit i of the output is 1 when x[i] >= 0 (little-endian bit order inside a byte).
 * st[0] = sum of the non-negative entries, st[1] = their count, st[2] = sum of the negative
 * entries, st[3] = number of non-finite entries. */
static KERNEL void k_sign_pack(const float *x, int64_t n, uint8_t *bits, double *st) {
    const __m256 zero = _mm256_setzero_ps();
    __m256i nf = _mm256_setzero_si256();
    double sp = 0.0, sn = 0.0;
    int64_t cp = 0, i = 0;
    while (i + 8 <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        __m256 p = _mm256_setzero_ps(), q = _mm256_setzero_ps();
        for (; i + 8 <= end; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256 ge = _mm256_cmp_ps(v, zero, _CMP_GE_OQ);
            unsigned m = (unsigned)_mm256_movemask_ps(ge);
            bits[i >> 3] = (uint8_t)m;
            cp += __builtin_popcount(m);
            p = _mm256_add_ps(p, _mm256_and_ps(ge, v));
            q = _mm256_add_ps(q, _mm256_andnot_ps(ge, v));
            nf = _mm256_sub_epi32(nf, nonfinite8(abs8(v)));
        }
        sp += hsum8(p);
        sn += hsum8(q);
    }
    int64_t nfc = hsum8i(nf);
    if (i < n) {
        uint8_t b = 0;
        for (int64_t j = i; j < n; j++) {
            float v = x[j];
            if (v >= 0.0f) {
                b |= (uint8_t)(1u << (j - i));
                sp += v;
                cp++;
            } else {
                sn += v;
            }
            nfc += !(fabsf(v) <= FLT_BIG);
        }
        bits[i >> 3] = b;
    }
    st[0] = sp;
    st[1] = (double)cp;
    st[2] = sn;
    st[3] = (double)nfc;
}

/* Pack eight 2-bit codes held in int32 lanes into 16 bits (lane j -> bits 2j, 2j+1). */
static inline KERNEL unsigned pack2x8(__m256i c) {
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i v = _mm256_sllv_epi32(c, sh);
    __m128i s = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0xb1));
    return (unsigned)_mm_cvtsi128_si32(s);
}

/* Pack eight 4-bit codes into 32 bits. */
static inline KERNEL uint32_t pack4x8(__m256i c) {
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_sllv_epi32(c, sh);
    __m128i s = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

/* Store eight codes of `bits` bits (2, 4 or 8) for elements i..i+7; i is a multiple of 8. */
static inline KERNEL void store_codes8(uint8_t *out, int64_t i, __m256i c, int bits) {
    if (bits == 2) {
        unsigned w = pack2x8(c);
        memcpy(out + (i >> 2), &w, 2);
    } else if (bits == 4) {
        uint32_t w = pack4x8(c);
        memcpy(out + (i >> 1), &w, 4);
    } else {
        __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
        __m128i p16 = _mm_packus_epi32(lo, hi);
        __m128i p8 = _mm_packus_epi16(p16, p16);
        _mm_storel_epi64((__m128i *)(out + i), p8);
    }
}

static inline void store_code1(uint8_t *out, int64_t i, unsigned code, int bits) {
    int per = 8 / bits;
    int64_t byte = i / per;
    int shift = (int)(i % per) * bits;
    if (shift == 0) out[byte] = 0;
    out[byte] |= (uint8_t)(code << shift);
}

/*
 * ternary_pack (TBQ): 2-bit codes, 1 when x > tau, 2 when x < -tau, 0 otherwise.
 * st[0] = number of non-zero codes, st[1] = non-finite count.
 */
static KERNEL void k_ternary_pack(const float *x, int64_t n, float tau, uint8_t *out, double *st) {
    const __m256 tp = _mm256_set1_ps(tau), tn = _mm256_set1_ps(-tau);
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
    __m256i nf = _mm256_setzero_si256();
    int64_t nz = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 gp = _mm256_cmp_ps(v, tp, _CMP_GT_OQ), gn = _mm256_cmp_ps(v, tn, _CMP_LT_OQ);
        __m256i c = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(gp), one),
                                    _mm256_and_si256(_mm256_castps_si256(gn), two));
        nz += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_or_ps(gp, gn)));
        nf = _mm256_sub_epi32(nf, nonfinite8(abs8(v)));
        store_codes8(out, i, c, 2);
    }
    int64_t nfc = hsum8i(nf);
    for (; i < n; i++) {
        float v = x[i];
        unsigned c = v > tau ? 1u : (v < -tau ? 2u : 0u);
        nz += c != 0;
        nfc += !(fabsf(v) <= FLT_BIG);
        store_code1(out, i, c, 2);
    }
    st[0] = (double)nz;
    st[1] = (double)nfc;
}

/*
 * Counter-based uniform numbers: u(i) = top 24 bits of mix(mix(i ^ k1) + k2) / 2^24, where mix
 * is the "lowbias32" integer hash. The same function is written in torch ops in
 * gradsync/codecs/ops/random.py, so the native and torch paths draw identical numbers.
 */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

static inline KERNEL __m256i mix32x8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7feb352d));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x846ca68bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    return h;
}

static inline float uniform1(uint32_t i, uint32_t k1, uint32_t k2) {
    return (float)(mix32(mix32(i ^ k1) + k2) >> 8) * (1.0f / 16777216.0f);
}

/*
 * stoch_pack: stochastic symmetric quantization (TernGrad for bits = 2). For each element,
 * level = floor(|x| * mult + u) clamped to [0, L], code = (x < 0) << (bits - 1) | level.
 * Unbiased: E[level] = |x| * mult while |x| * mult <= L. st[0] = non-finite count.
 */
static KERNEL void k_stoch_pack(const float *x, int64_t n, float mult, int L, int bits,
                                uint32_t k1, uint32_t k2, uint8_t *out, double *st) {
    const __m256 mv = _mm256_set1_ps(mult), scale24 = _mm256_set1_ps(1.0f / 16777216.0f);
    const __m256 lv = _mm256_set1_ps((float)L), zero = _mm256_setzero_ps();
    const __m256i kv1 = _mm256_set1_epi32((int)k1), kv2 = _mm256_set1_epi32((int)k2);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i signbit = _mm256_set1_epi32(1 << (bits - 1));
    __m256i nf = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 a = abs8(v);
        nf = _mm256_sub_epi32(nf, nonfinite8(a));
        __m256i ctr = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)i), lane);
        __m256i h = mix32x8(_mm256_add_epi32(mix32x8(_mm256_xor_si256(ctr, kv1)), kv2));
        __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), scale24);
        __m256 lvl = _mm256_floor_ps(_mm256_fmadd_ps(a, mv, u));
        lvl = _mm256_min_ps(_mm256_max_ps(lvl, zero), lv); /* NaN -> 0 via max(NaN, 0) = 0 */
        __m256i c = _mm256_cvttps_epi32(lvl);
        __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_LT_OQ));
        c = _mm256_or_si256(c, _mm256_and_si256(neg, signbit));
        store_codes8(out, i, c, bits);
    }
    int64_t nfc = hsum8i(nf);
    for (; i < n; i++) {
        float v = x[i], a = fabsf(v);
        nfc += !(a <= FLT_BIG);
        float lvl = floorf(a * mult + uniform1((uint32_t)i, k1, k2));
        if (!(lvl >= 0.0f)) lvl = 0.0f;
        if (lvl > (float)L) lvl = (float)L;
        unsigned c = (unsigned)lvl | (v < 0.0f ? (1u << (bits - 1)) : 0u);
        store_code1(out, i, c, bits);
    }
    st[0] = (double)nfc;
}

/*
 * lut_unpack: out[i] (=|+=) lut[code_i] for codes of `bits` bits (1, 2, 4 or 8), packed
 * little-endian inside each byte.
 */
static KERNEL void k_lut_unpack(const uint8_t *codes, int64_t n, int bits, const float *lut,
                                float *out, int accumulate) {
    int64_t i = 0;
    if (bits == 1) {
        const __m256 l0 = _mm256_set1_ps(lut[0]), l1 = _mm256_set1_ps(lut[1]);
        const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (; i + 8 <= n; i += 8) {
            __m256i b = _mm256_set1_epi32(codes[i >> 3]);
            __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(b, sel), sel);
            __m256 v = _mm256_blendv_ps(l0, l1, _mm256_castsi256_ps(on));
            if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
            _mm256_storeu_ps(out + i, v);
        }
    } else if (bits == 2 || bits == 4) {
        /* lut of up to 16 entries: two permutes and a blend pick the value for each lane */
        float tab[16] = {0};
        memcpy(tab, lut, sizeof(float) * (size_t)(1 << bits));
        const __m256 t0 = _mm256_loadu_ps(tab), t1 = _mm256_loadu_ps(tab + 8);
        const __m256i sh = bits == 2 ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                                     : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
        for (; i + 8 <= n; i += 8) {
            uint32_t w = 0;
            memcpy(&w, codes + (bits == 2 ? (i >> 2) : (i >> 1)), bits == 2 ? 2 : 4);
            __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), mask);
            __m256 v0 = _mm256_permutevar8x32_ps(t0, c), v1 = _mm256_permutevar8x32_ps(t1, c);
            __m256i hi = _mm256_cmpgt_epi32(c, _mm256_set1_epi32(7));
            __m256 v = _mm256_blendv_ps(v0, v1, _mm256_castsi256_ps(hi));
            if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
            _mm256_storeu_ps(out + i, v);
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(codes + i));
            __m256i c = _mm256_cvtepu8_epi32(b);
            __m256 v = _mm256_i32gather_ps(lut, c, 4);
            if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
            _mm256_storeu_ps(out + i, v);
        }
    }
    int per = 8 / bits;
    for (; i < n; i++) {
        unsigned c = (codes[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u);
        out[i] = accumulate ? out[i] + lut[c] : lut[c];
    }
}

/*
 * to_half: out = fp16(x * scale) (round to nearest even). st[0] = max |x| (NaN ignored),
 * st[1] = non-finite count of x, st[2] = count of finite x whose scaled value overflows fp16.
 */
static KERNEL void k_to_half(const float *x, int64_t n, float scale, uint16_t *out, double *st) {
    const __m256 sv = _mm256_set1_ps(scale), lim = _mm256_set1_ps(65504.0f);
    __m256 mx = _mm256_setzero_ps();
    __m256i nf = _mm256_setzero_si256(), of = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 a = abs8(v);
        mx = _mm256_max_ps(a, mx);
        __m256i bad = nonfinite8(a);
        nf = _mm256_sub_epi32(nf, bad);
        __m256 y = _mm256_mul_ps(v, sv);
        /* overflow: finite input that rounds beyond the largest half (65504 + half an ulp) */
        __m256 big = _mm256_cmp_ps(abs8(y), _mm256_set1_ps(65520.0f), _CMP_GE_OQ);
        of = _mm256_sub_epi32(of, _mm256_andnot_si256(bad, _mm256_castps_si256(big)));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
    }
    (void)lim;
    float m = hmax8(mx);
    int64_t nfc = hsum8i(nf), ofc = hsum8i(of);
    for (; i < n; i++) {
        float v = x[i], a = fabsf(v);
        if (a > m) m = a;
        int bad = !(a <= FLT_BIG);
        nfc += bad;
        float y = v * scale;
        ofc += !bad && fabsf(y) >= 65520.0f;
        out[i] = (uint16_t)_cvtss_sh(y, _MM_FROUND_TO_NEAREST_INT);
    }
    st[0] = m;
    st[1] = (double)nfc;
    st[2] = (double)ofc;
}

/* from_half: out (=|+=) float(h) * scale */
static KERNEL void k_from_half(const uint16_t *h, int64_t n, float scale, float *out, int accumulate) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), sv);
        if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) {
        float v = _cvtsh_ss(h[i]) * scale;
        out[i] = accumulate ? out[i] + v : v;
    }
}

/* to_bf16: round to nearest even; NaN stays a quiet NaN. Same st layout as to_half. */
static inline uint16_t bf16_round1(float y) {
    uint32_t u;
    memcpy(&u, &y, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static KERNEL void k_to_bf16(const float *x, int64_t n, float scale, uint16_t *out, double *st) {
    const __m256 sv = _mm256_set1_ps(scale);
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i qnan = _mm256_set1_epi32(0x7fc00000);
    __m256 mx = _mm256_setzero_ps();
    __m256i nf = _mm256_setzero_si256(), of = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 a = abs8(v);
        mx = _mm256_max_ps(a, mx);
        __m256i bad = nonfinite8(a);
        nf = _mm256_sub_epi32(nf, bad);
        __m256 y = _mm256_mul_ps(v, sv);
        __m256i u = _mm256_castps_si256(y);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        __m256 isnan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
        r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), isnan));
        /* rounding a finite value up into the exponent of inf is an overflow */
        __m256i rinf = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fff)),
                                          _mm256_set1_epi32(0x7f80));
        of = _mm256_sub_epi32(of, _mm256_andnot_si256(bad, rinf));
        __m256i hi = _mm256_srli_epi32(r, 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)(out + i), packed);
    }
    float m = hmax8(mx);
    int64_t nfc = hsum8i(nf), ofc = hsum8i(of);
    for (; i < n; i++) {
        float v = x[i], a = fabsf(v);
        if (a > m) m = a;
        int bad = !(a <= FLT_BIG);
        nfc += bad;
        uint16_t b = bf16_round1(v * scale);
        ofc += !bad && (b & 0x7fffu) == 0x7f80u;
        out[i] = b;
    }
    st[0] = m;
    st[1] = (double)nfc;
    st[2] = (double)ofc;
}

static KERNEL void k_from_bf16(const uint16_t *h, int64_t n, float scale, float *out, int accumulate) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), sv);
        if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        float v;
        memcpy(&v, &u, 4);
        v *= scale;
        out[i] = accumulate ? out[i] + v : v;
    }
}

/* sparse_add: out[idx[j]] += alpha * val[j]; indices outside [0, n) are skipped and counted. */
static int64_t k_sparse_add(float *out, int64_t n, const int32_t *idx, const float *val, int64_t m,
                            float alpha) {
    int64_t bad = 0;
    for (int64_t j = 0; j < m; j++) {
        int32_t t = idx[j];
        if (t < 0 || (int64_t)t >= n) {
            bad++;
            continue;
        }
        out[t] += alpha * val[j];
    }
    return bad;
}

/* splitmix64 stream for Floyd's sampling */
static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/*
 * random_subset: k distinct indices drawn uniformly from [0, n) (Floyd's algorithm, O(k) draws)
 * written to idx in increasing order. bitmap must hold ceil(n / 64) words.
 */
static void k_random_subset(int64_t n, int64_t k, uint64_t seed, int32_t *idx, uint64_t *bitmap) {
    int64_t words = (n + 63) / 64;
    memset(bitmap, 0, (size_t)words * 8);
    uint64_t s = seed;
    for (int64_t j = n - k; j < n; j++) {
        /* uniform in [0, j] by multiply-high (bias below 2^-32 for j < 2^31) */
        unsigned __int128 p = (unsigned __int128)splitmix64(&s) * (unsigned __int128)(uint64_t)(j + 1);
        int64_t t = (int64_t)(p >> 64);
        if (bitmap[t >> 6] >> (t & 63) & 1) t = j;
        bitmap[t >> 6] |= 1ull << (t & 63);
    }
    int64_t out = 0;
    for (int64_t w = 0; w < words; w++) {
        uint64_t b = bitmap[w];
        while (b) {
            int bit = __builtin_ctzll(b);
            b &= b - 1;
            idx[out++] = (int32_t)(w * 64 + bit);
        }
    }
}

/* gather: val[j] = x[idx[j]] (indices already known to be in range) */
static void k_gather(const float *x, const int32_t *idx, int64_t m, float *val) {
    for (int64_t j = 0; j < m; j++) val[j] = x[idx[j]];
}

#endif /* GS_X86 */

/* ------------------------------------------------------------------------------------------ */
/* Python bindings. Pointers arrive as unsigned long long ("K"), sizes as long long ("L").     */

#define PTR(T, v) ((T *)(uintptr_t)(v))

#if GS_X86
static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n;
    if (!PyArg_ParseTuple(args, "KLK", &x, &n, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS k_stats(PTR(const float, x), n, PTR(double, out));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_scan_select(PyObject *self, PyObject *args) {
    unsigned long long x, idx, val, st;
    long long n, cap, cnt;
    float t;
    int mode, want_sum;
    if (!PyArg_ParseTuple(args, "KLfipKKLK", &x, &n, &t, &mode, &want_sum, &idx, &val, &cap, &st)) return NULL;
    Py_BEGIN_ALLOW_THREADS cnt = k_scan_select(PTR(const float, x), n, t, mode, want_sum, PTR(int32_t, idx),
                                               PTR(float, val), cap, PTR(double, st));
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(cnt);
}

static PyObject *py_count_ge(PyObject *self, PyObject *args) {
    unsigned long long x, ts, out;
    long long n;
    int m, mode;
    if (!PyArg_ParseTuple(args, "KLKiiK", &x, &n, &ts, &m, &mode, &out)) return NULL;
    if (m < 1 || m > 16) {
        PyErr_SetString(PyExc_ValueError, "count_ge takes 1 to 16 thresholds");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS k_count_ge(PTR(const float, x), n, PTR(const float, ts), m, mode, PTR(int64_t, out));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_kth_largest(PyObject *self, PyObject *args) {
    unsigned long long v, scratch;
    long long n, k;
    int mode;
    float r;
    if (!PyArg_ParseTuple(args, "KLLiK", &v, &n, &k, &mode, &scratch)) return NULL;
    if (k < 1 || k > n) {
        PyErr_SetString(PyExc_ValueError, "kth_largest needs 1 <= k <= n");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS r = k_kth_largest(PTR(const float, v), n, k, mode, PTR(float, scratch));
    Py_END_ALLOW_THREADS return PyFloat_FromDouble((double)r);
}

static PyObject *py_keep_top(PyObject *self, PyObject *args) {
    unsigned long long idx, val;
    long long n, k, r;
    float kth;
    int mode;
    if (!PyArg_ParseTuple(args, "KKLLfi", &idx, &val, &n, &k, &kth, &mode)) return NULL;
    Py_BEGIN_ALLOW_THREADS r = k_keep_top(PTR(int32_t, idx), PTR(float, val), n, k, kth, mode);
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(r);
}

static PyObject *py_sign_pack(PyObject *self, PyObject *args) {
    unsigned long long x, bits, st;
    long long n;
    if (!PyArg_ParseTuple(args, "KLKK", &x, &n, &bits, &st)) return NULL;
    Py_BEGIN_ALLOW_THREADS k_sign_pack(PTR(const float, x), n, PTR(uint8_t, bits), PTR(double, st));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_ternary_pack(PyObject *self, PyObject *args) {
    unsigned long long x, out, st;
    long long n;
    float tau;
    if (!PyArg_ParseTuple(args, "KLfKK", &x, &n, &tau, &out, &st)) return NULL;
    Py_BEGIN_ALLOW_THREADS k_ternary_pack(PTR(const float, x), n, tau, PTR(uint8_t, out), PTR(double, st));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_stoch_pack(PyObject *self, PyObject *args) {
    unsigned long long x, out, st;
    long long n;
    float mult;
    int L, bits;
    unsigned int k1, k2;
    if (!PyArg_ParseTuple(args, "KLfiiIIKK", &x, &n, &mult, &L, &bits, &k1, &k2, &out, &st)) return NULL;
    if (bits != 2 && bits != 4 && bits != 8) {
        PyErr_SetString(PyExc_ValueError, "stoch_pack takes bits in {2, 4, 8}");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS k_stoch_pack(PTR(const float, x), n, mult, L, bits, k1, k2, PTR(uint8_t, out),
                                        PTR(double, st));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_lut_unpack(PyObject *self, PyObject *args) {
    unsigned long long codes, lut, out;
    long long n;
    int bits, acc;
    if (!PyArg_ParseTuple(args, "KLiKKp", &codes, &n, &bits, &lut, &out, &acc)) return NULL;
    if (bits != 1 && bits != 2 && bits != 4 && bits != 8) {
        PyErr_SetString(PyExc_ValueError, "lut_unpack takes bits in {1, 2, 4, 8}");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS k_lut_unpack(PTR(const uint8_t, codes), n, bits, PTR(const float, lut), PTR(float, out), acc);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_to_half(PyObject *self, PyObject *args) {
    unsigned long long x, out, st;
    long long n;
    float scale;
    int bf16;
    if (!PyArg_ParseTuple(args, "KLfKKp", &x, &n, &scale, &out, &st, &bf16)) return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) k_to_bf16(PTR(const float, x), n, scale, PTR(uint16_t, out), PTR(double, st));
    else k_to_half(PTR(const float, x), n, scale, PTR(uint16_t, out), PTR(double, st));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_from_half(PyObject *self, PyObject *args) {
    unsigned long long h, out;
    long long n;
    float scale;
    int bf16, acc;
    if (!PyArg_ParseTuple(args, "KLfKpp", &h, &n, &scale, &out, &bf16, &acc)) return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) k_from_bf16(PTR(const uint16_t, h), n, scale, PTR(float, out), acc);
    else k_from_half(PTR(const uint16_t, h), n, scale, PTR(float, out), acc);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_sparse_add(PyObject *self, PyObject *args) {
    unsigned long long out, idx, val;
    long long n, m, bad;
    float alpha;
    if (!PyArg_ParseTuple(args, "KLKKLf", &out, &n, &idx, &val, &m, &alpha)) return NULL;
    Py_BEGIN_ALLOW_THREADS bad = k_sparse_add(PTR(float, out), n, PTR(const int32_t, idx), PTR(const float, val), m, alpha);
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(bad);
}

static PyObject *py_random_subset(PyObject *self, PyObject *args) {
    long long n, k;
    unsigned long long seed, idx, bitmap;
    if (!PyArg_ParseTuple(args, "LLKKK", &n, &k, &seed, &idx, &bitmap)) return NULL;
    if (k < 0 || k > n) {
        PyErr_SetString(PyExc_ValueError, "random_subset needs 0 <= k <= n");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS k_random_subset(n, k, seed, PTR(int32_t, idx), PTR(uint64_t, bitmap));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_gather(PyObject *self, PyObject *args) {
    unsigned long long x, idx, val;
    long long m;
    if (!PyArg_ParseTuple(args, "KKLK", &x, &idx, &m, &val)) return NULL;
    Py_BEGIN_ALLOW_THREADS k_gather(PTR(const float, x), PTR(const int32_t, idx), m, PTR(float, val));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
#if GS_X86
    {"stats", py_stats, METH_VARARGS, "sum|x|, max|x|, non-finite count, sum x^2"},
    {"scan_select", py_scan_select, METH_VARARGS, "stats + compaction of key(x) >= t"},
    {"count_ge", py_count_ge, METH_VARARGS, "counts of key(x) >= t for up to 16 thresholds"},
    {"kth_largest", py_kth_largest, METH_VARARGS, "k-th largest key by quickselect"},
    {"keep_top", py_keep_top, METH_VARARGS, "keep the k largest candidates in index order"},
    {"sign_pack", py_sign_pack, METH_VARARGS, "sign bits with sums of both signs"},
    {"ternary_pack", py_ternary_pack, METH_VARARGS, "2-bit threshold codes"},
    {"stoch_pack", py_stoch_pack, METH_VARARGS, "stochastic symmetric quantization codes"},
    {"lut_unpack", py_lut_unpack, METH_VARARGS, "codes to values through a lookup table"},
    {"to_half", py_to_half, METH_VARARGS, "float32 to fp16/bf16 with range statistics"},
    {"from_half", py_from_half, METH_VARARGS, "fp16/bf16 to float32"},
    {"sparse_add", py_sparse_add, METH_VARARGS, "bounds-checked scatter-add"},
    {"random_subset", py_random_subset, METH_VARARGS, "sorted uniform k-subset of range(n)"},
    {"gather", py_gather, METH_VARARGS, "val = x[idx]"},
#endif
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native", "gradsync fused CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    int ok = 0;
#if GS_X86
    __builtin_cpu_init();
    ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    if (PyModule_AddIntConstant(m, "SUPPORTED", ok) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
