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
 * Calling convention: the Python callers (through gradsync/codecs/ops/native.py) validate
 * dtypes, devices and contiguity and pass raw data pointers as integers, each buffer a kernel
 * writes with its size in bytes. The bindings check every size before a kernel runs and raise
 * (ValueError, TypeError, IndexError) instead of writing past a buffer or computing with garbage;
 * gradsync/_native.pyi declares the typed signatures. The GIL is released around every kernel
 * so that compression can overlap with autograd on another thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
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

/* Finish a max over |x| bit patterns: reduce the lanes and fold in the scalar tail from i. */
static inline KERNEL void absmax_finish(__m256i mb, const float *x, int64_t i, int64_t n, int32_t *top) {
    int32_t t8[8];
    _mm256_storeu_si256((__m256i *)t8, mb);
    int32_t t = 0;
    for (int q = 0; q < 8; q++) t = t8[q] > t ? t8[q] : t;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        int32_t b;
        memcpy(&b, &a, 4);
        t = b > t ? b : t;
    }
    *top = t;
}


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
 * sum_scan_select does the same over x + y, storing that sum in out on the way: error feedback
 * adds its residual to the gradient, and the selection's first scan reads the sum, in one pass.
 */
static KERNEL int64_t k_sum_scan_select(const float *x, const float *y, float *out, int64_t n, float t,
                                        int mode, int want_sum, int32_t *idx, float *val, int64_t cap,
                                        double *st) {
    /* with y: the elements scanned are out[i] = x[i] + y[i] (one float add, as torch.add rounds
     * it), written to out as they are computed; without: x itself */
    const float *v = y ? out : x;
    const __m256 tv = _mm256_set1_ps(t);
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i mb0 = _mm256_setzero_si256(), mb1 = _mm256_setzero_si256();
    double s = 0.0;
    int64_t cnt = 0, i = 0;
    while (i + 16 <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
            if (y) {
                x0 = _mm256_add_ps(x0, _mm256_loadu_ps(y + i));
                x1 = _mm256_add_ps(x1, _mm256_loadu_ps(y + i + 8));
                _mm256_storeu_ps(out + i, x0);
                _mm256_storeu_ps(out + i + 8, x1);
            }
            __m256i b0 = _mm256_and_si256(_mm256_castps_si256(x0), am);
            __m256i b1 = _mm256_and_si256(_mm256_castps_si256(x1), am);
            __m256 a0 = _mm256_castsi256_ps(b0), a1 = _mm256_castsi256_ps(b1);
            if (want_sum) {
                s0 = _mm256_add_ps(s0, a0);
                s1 = _mm256_add_ps(s1, a1);
            }
            mb0 = _mm256_max_epi32(mb0, b0);
            mb1 = _mm256_max_epi32(mb1, b1);
            __m256 k0 = mode == 0 ? a0 : keyed8(x0, mode);
            __m256 k1 = mode == 0 ? a1 : keyed8(x1, mode);
            unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(k0, tv, _CMP_GE_OQ)) |
                         ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(k1, tv, _CMP_GE_OQ)) << 8);
            while (m) {
                int b = __builtin_ctz(m);
                m &= m - 1;
                if (cnt < cap) {
                    idx[cnt] = (int32_t)(i + b);
                    val[cnt] = v[i + b];
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
        if (y) out[i] = x[i] + y[i];
        float a = fabsf(v[i]);
        int32_t b;
        memcpy(&b, &a, 4);
        top = b > top ? b : top;
        if (want_sum) s += a;
        if (keyed1(v[i], mode) >= t) {
            if (cnt < cap) {
                idx[cnt] = (int32_t)i;
                val[cnt] = v[i];
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

static KERNEL int64_t k_scan_select(const float *x, int64_t n, float t, int mode, int want_sum,
                                    int32_t *idx, float *val, int64_t cap, double *st) {
    return k_sum_scan_select(x, NULL, NULL, n, t, mode, want_sum, idx, val, cap, st);
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
    /* NaN keys count as -inf (the partition loops need a total order) */
    int has_nan = 0;
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float v = keyed1(vals[i], mode);
        has_nan |= v != v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    if (n <= 8192 || has_nan || !(hi > lo) || !isfinite(hi - lo)) {
        for (int64_t i = 0; i < n; i++) {
            float v = keyed1(vals[i], mode);
            scratch[i] = v != v ? -INFINITY : v;
        }
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

/* OR of the eight 32-bit lanes */
static inline KERNEL uint32_t or_lanes(__m256i v) {
    __m128i s = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_or_si128(s, _mm_shuffle_epi32(s, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

/* TBQ codes of elements i..i+7 in int32 lanes; *nz counts the non-zero ones */
static inline KERNEL __m256i tbq_codes8(const float *x, int64_t i, __m256 tp, __m256 tn, int64_t *nz) {
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 gp = _mm256_cmp_ps(v, tp, _CMP_GT_OQ), gn = _mm256_cmp_ps(v, tn, _CMP_LT_OQ);
    *nz += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_or_ps(gp, gn)));
    return _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(gp), one), _mm256_and_si256(_mm256_castps_si256(gn), two));
}

/*
 * ternary_pack (TBQ): 2-bit codes, 1 when x > tau, 2 when x < -tau, 0 otherwise.
 * st[0] = number of non-zero codes, st[1] = 1 if any element is inf or NaN.
 */
static KERNEL void k_ternary_pack(const float *x, int64_t n, float tau, uint8_t *out, double *st) {
    const __m256 tp = _mm256_set1_ps(tau), tn = _mm256_set1_ps(-tau);
    const __m256i sh0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i mb = _mm256_setzero_si256();
    int64_t nz = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        mb = _mm256_max_epi32(mb, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), am));
        mb = _mm256_max_epi32(mb, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 8)), am));
        __m256i c0 = tbq_codes8(x, i, tp, tn, &nz), c1 = tbq_codes8(x, i + 8, tp, tn, &nz);
        uint32_t w = or_lanes(_mm256_or_si256(_mm256_sllv_epi32(c0, sh0), _mm256_sllv_epi32(c1, sh1)));
        memcpy(out + (i >> 2), &w, 4);
    }
    int32_t top;
    int64_t tail = i;
    absmax_finish(mb, x, i, n, &top);
    for (i = tail; i < n; i++) {
        float v = x[i];
        unsigned c = v > tau ? 1u : (v < -tau ? 2u : 0u);
        nz += c != 0;
        store_code1(out, i, c, 2);
    }
    st[0] = (double)nz;
    st[1] = top >= 0x7f800000 ? 1.0 : 0.0;
}

/*
 * Counter-based uniform numbers from the "lowbias32" integer hash, keyed by two fresh random
 * words per call (see stoch_pack). The same function is written in torch ops in
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



/*
 * stoch_pack: stochastic symmetric quantization (TernGrad for bits = 2). For each element,
 * level = floor(|x| * mult + u) clamped to [0, L], code = (x < 0) << (bits - 1) | level.
 * Unbiased: E[level] = |x| * mult while |x| * mult <= L. st[0] = non-finite count.
 */
/* 1 + u for eight lanes from 16-bit uniforms held in the low bits of u16 (float in [1, 2)) */
static inline KERNEL __m256 one_plus_u8(__m256i u16) {
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(u16, 7), _mm256_set1_epi32(0x3f800000)));
}

/* codes of elements i..i+7 (see k_stoch_pack) given 1 + u for them */
static inline KERNEL __m256i stoch_codes8(const float *x, int64_t i, __m256 f, __m256 mv, __m256i lv, int bits) {
    const __m256i am = _mm256_set1_epi32(0x7fffffff), one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
    __m256 a = _mm256_castsi256_ps(_mm256_and_si256(b, am));
    /* floor(|x| * mult + u) = trunc(|x| * mult + (1 + u)) - 1; mul and add round separately,
       exactly like the torch formula */
    __m256i lvl = _mm256_sub_epi32(_mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(a, mv), f)), one);
    lvl = _mm256_min_epi32(_mm256_max_epi32(lvl, zero), lv); /* NaN converts to INT_MIN -> 0 */
    __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(b, 31), bits - 1);
    return _mm256_or_si256(lvl, sign);
}

/* 16-bit uniform for element i: see hashed_uniform16 in gradsync/codecs/ops/random.py */
static inline uint32_t uniform16(int64_t i, uint32_t k1, uint32_t k2) {
    uint32_t h = mix32((uint32_t)((i >> 4) * 8 + (i & 7)) + k1) ^ k2;
    return (i & 8) ? h >> 16 : h & 0xffffu;
}

/*
 * stoch_pack: stochastic symmetric quantization (TernGrad for bits = 2). For each element,
 * level = floor(|x| * mult + u) clamped to [0, L], code = sign(x) << (bits - 1) | level, where
 * sign(x) is the sign bit (so -0.0 carries it). Unbiased up to the 2^-16 resolution of u:
 * E[level] = |x| * mult while |x| * mult <= L. One 32-bit hash gives the uniforms of two
 * elements, i and i + 8 within each block of 16. Inf/NaN are not reported here: callers check
 * them with absmax first.
 */
static KERNEL void k_stoch_pack(const float *x, int64_t n, float mult, int L, int bits,
                                uint32_t k1, uint32_t k2, uint8_t *out) {
    const __m256 mv = _mm256_set1_ps(mult);
    const __m256i lv = _mm256_set1_epi32(L), lo16 = _mm256_set1_epi32(0xffff);
    const __m256i kv1 = _mm256_set1_epi32((int)k1), kv2 = _mm256_set1_epi32((int)k2);
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256i sh0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
    __m256i ctr = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_xor_si256(mix32x8(_mm256_add_epi32(ctr, kv1)), kv2);
        ctr = _mm256_add_epi32(ctr, eight);
        __m256i c0 = stoch_codes8(x, i, one_plus_u8(_mm256_and_si256(h, lo16)), mv, lv, bits);
        __m256i c1 = stoch_codes8(x, i + 8, one_plus_u8(_mm256_srli_epi32(h, 16)), mv, lv, bits);
        if (bits == 2) {
            uint32_t w = or_lanes(_mm256_or_si256(_mm256_sllv_epi32(c0, sh0), _mm256_sllv_epi32(c1, sh1)));
            memcpy(out + (i >> 2), &w, 4);
        } else {
            store_codes8(out, i, c0, bits);
            store_codes8(out, i + 8, c1, bits);
        }
    }
    for (; i < n; i++) {
        float v = x[i], a = fabsf(v);
        uint32_t fb = (uniform16(i, k1, k2) << 7) | 0x3f800000u, sb;
        float f;
        memcpy(&f, &fb, 4);
        float y = a * mult;
        y = y + f;
        int lvl = (int)y - 1; /* y >= 1 for finite input */
        if (!(y >= 1.0f)) lvl = 0;
        if (lvl > L) lvl = L;
        memcpy(&sb, &v, 4);
        store_code1(out, i, (unsigned)lvl | ((sb >> 31) << (bits - 1)), bits);
    }
}

/* absmax: max |x| over the bit patterns (any pattern >= 0x7f800000 means inf or NaN). */
static KERNEL void k_absmax(const float *x, int64_t n, double *st) {
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
    __m256i m2 = _mm256_setzero_si256(), m3 = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), am));
        m1 = _mm256_max_epi32(m1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 8)), am));
        m2 = _mm256_max_epi32(m2, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 16)), am));
        m3 = _mm256_max_epi32(m3, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 24)), am));
    }
    int32_t mb[8];
    _mm256_storeu_si256((__m256i *)mb, _mm256_max_epi32(_mm256_max_epi32(m0, m1), _mm256_max_epi32(m2, m3)));
    int32_t top = 0;
    for (int q = 0; q < 8; q++) top = mb[q] > top ? mb[q] : top;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        int32_t b;
        memcpy(&b, &a, 4);
        top = b > top ? b : top;
    }
    float m;
    memcpy(&m, &top, 4);
    st[0] = m;
    st[1] = top >= 0x7f800000 ? 1.0 : 0.0;
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
    } else if (bits == 2) {
        /* four entries: one permute picks every lane's value */
        float tab[8] = {lut[0], lut[1], lut[2], lut[3], 0, 0, 0, 0};
        const __m256 t0 = _mm256_loadu_ps(tab);
        const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i mask = _mm256_set1_epi32(3);
        for (; i + 8 <= n; i += 8) {
            uint16_t w;
            memcpy(&w, codes + (i >> 2), 2);
            __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), mask);
            __m256 v = _mm256_permutevar8x32_ps(t0, c);
            if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out + i));
            _mm256_storeu_ps(out + i, v);
        }
    } else if (bits == 4) {
        /* sixteen entries: two permutes and a blend */
        const __m256 t0 = _mm256_loadu_ps(lut), t1 = _mm256_loadu_ps(lut + 8);
        const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i mask = _mm256_set1_epi32(15);
        for (; i + 8 <= n; i += 8) {
            uint32_t w;
            memcpy(&w, codes + (i >> 1), 4);
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
 * to_half / to_bf16: out = fp16/bf16(x * scale), round to nearest even. st[0] = max |x| (taken
 * over the bit patterns of |x|, so inf/NaN show up as a pattern >= 0x7f800000), st[1] = 1 if any
 * element is inf or NaN, st[2] = 1 if a finite element overflows the format after scaling
 * (decided from the maximum: the largest finite |x| * scale reaches the rounding limit).
 * NaN inputs are not preserved bit-exactly: the caller flags the payload as non-finite instead.
 */
static void cast_stats(int32_t top, float scale, float limit, double *st) {
    float m;
    memcpy(&m, &top, 4);
    int nonfinite = top >= 0x7f800000;
    st[0] = m;
    st[1] = nonfinite ? 1.0 : 0.0;
    /* with inf/NaN present the max says nothing about the finite values: report no overflow,
       the payload is flagged non-finite anyway */
    st[2] = (!nonfinite && fabsf(m * scale) >= limit) ? 1.0 : 0.0;
}

static inline uint16_t bf16_round1(float y) {
    uint32_t u;
    memcpy(&u, &y, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline KERNEL __m128i bf16_round8(__m256i u) {
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    __m256i hi = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

/* eight floats (as bits) to eight fp16 or bf16 values */
static inline KERNEL __m128i to16x8(__m256i b, int bf16) {
    return bf16 ? bf16_round8(b) : _mm256_cvtps_ph(_mm256_castsi256_ps(b), _MM_FROUND_TO_NEAREST_INT);
}

static KERNEL void k_to_16bit(const float *x, int64_t n, float scale, uint16_t *out, double *st, int bf16) {
    const __m256 sv = _mm256_set1_ps(scale);
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i mb = _mm256_setzero_si256();
    int64_t i = 0;
    if (scale == 1.0f && bf16) {
        /* two vectors per iteration: the one-vector bf16 loop ran up to 1.5x slower depending
           only on where it landed in the library (identical machine code; `gradsync bench
           codecs --codecs bf16`, docs/benchmarks.md) */
        for (; i + 16 <= n; i += 16) {
            __m256i b0 = _mm256_loadu_si256((const __m256i *)(x + i));
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(x + i + 8));
            mb = _mm256_max_epi32(mb, _mm256_max_epi32(_mm256_and_si256(b0, am), _mm256_and_si256(b1, am)));
            _mm_storeu_si128((__m128i *)(out + i), bf16_round8(b0));
            _mm_storeu_si128((__m128i *)(out + i + 8), bf16_round8(b1));
        }
    }
    if (scale == 1.0f) {
        for (; i + 8 <= n; i += 8) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
            mb = _mm256_max_epi32(mb, _mm256_and_si256(b, am));
            _mm_storeu_si128((__m128i *)(out + i), to16x8(b, bf16));
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
            mb = _mm256_max_epi32(mb, _mm256_and_si256(b, am));
            __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(b), sv);
            _mm_storeu_si128((__m128i *)(out + i), to16x8(_mm256_castps_si256(y), bf16));
        }
    }
    int32_t top;
    int64_t tail = i;
    absmax_finish(mb, x, i, n, &top);
    for (i = tail; i < n; i++)
        out[i] = bf16 ? bf16_round1(x[i] * scale) : (uint16_t)_cvtss_sh(x[i] * scale, _MM_FROUND_TO_NEAREST_INT);
    /* the largest finite value plus half an ulp: the smallest magnitude that rounds to inf */
    cast_stats(top, scale, bf16 ? 3.3961775292304142e38f : 65520.0f, st);
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

/*
 * sparse_to_dense: out = 0 everywhere except out[idx[j]] = val[j], in one streaming pass when the
 * indices are strictly increasing (zeros are written only between them). Returns 0 on success,
 * 1 if an index is out of [0, n) (out untouched), 2 if the indices are not strictly increasing
 * (out partly written: the caller falls back to zero + scatter-add).
 */
static int k_sparse_to_dense(float *out, int64_t n, const int32_t *idx, const float *val, int64_t m) {
    for (int64_t j = 0; j < m; j++)
        if (idx[j] < 0 || (int64_t)idx[j] >= n) return 1;
    int64_t prev = 0;
    for (int64_t j = 0; j < m; j++) {
        int64_t t = idx[j];
        if (t < prev) return 2;
        memset(out + prev, 0, (size_t)(t - prev) * sizeof(float));
        out[t] = val[j];
        prev = t + 1;
    }
    memset(out + prev, 0, (size_t)(n - prev) * sizeof(float));
    return 0;
}

/* copy_check: out = x, returning 1 if any element is inf or NaN. */
static KERNEL int k_copy_check(const float *x, int64_t n, float *out) {
    const __m256i am = _mm256_set1_epi32(0x7fffffff);
    __m256i mb = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i b0 = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(x + i + 8));
        mb = _mm256_max_epi32(mb, _mm256_max_epi32(_mm256_and_si256(b0, am), _mm256_and_si256(b1, am)));
        _mm256_storeu_si256((__m256i *)(out + i), b0);
        _mm256_storeu_si256((__m256i *)(out + i + 8), b1);
    }
    int32_t top;
    int64_t tail = i;
    absmax_finish(mb, x, i, n, &top);
    for (i = tail; i < n; i++) out[i] = x[i];
    return top >= 0x7f800000;
}

/*
 * range_positions: positions j (ascending) with lo <= keys[j] < hi. Writes at most cap of them
 * but returns the full count, so the caller can tell that pos was too small.
 */
static KERNEL int64_t k_range_positions(const float *keys, int64_t n, float lo, float hi, int32_t *pos,
                                        int64_t cap) {
    const __m256 lv = _mm256_set1_ps(lo), hv = _mm256_set1_ps(hi);
    int64_t cnt = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 k = _mm256_loadu_ps(keys + i);
        unsigned m = (unsigned)_mm256_movemask_ps(
            _mm256_and_ps(_mm256_cmp_ps(k, lv, _CMP_GE_OQ), _mm256_cmp_ps(k, hv, _CMP_LT_OQ)));
        while (m) {
            int b = __builtin_ctz(m);
            m &= m - 1;
            if (cnt < cap) pos[cnt] = (int32_t)(i + b);
            cnt++;
        }
    }
    for (; i < n; i++)
        if (keys[i] >= lo && keys[i] < hi) {
            if (cnt < cap) pos[cnt] = (int32_t)i;
            cnt++;
        }
    return cnt;
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

/*
 * gather: val[j] = x[idx[j]] for the m indices. Stops at the first index outside [0, n) and
 * returns its position j (val[0..j) written); returns -1 when every index was in range.
 */
static int64_t k_gather(const float *x, int64_t n, const int32_t *idx, int64_t m, float *val) {
    for (int64_t j = 0; j < m; j++) {
        int32_t t = idx[j];
        if (t < 0 || (int64_t)t >= n) return j;
        val[j] = x[t];
    }
    return -1;
}

#endif /* GS_X86 */

/* ------------------------------------------------------------------------------------------ */
/* Python bindings. Pointers arrive as unsigned long long ("K"), sizes as long long ("L").     */
/*                                                                                            */
/* Every buffer a kernel writes comes with its capacity in bytes (the `*_nbytes` arguments,   */
/* tensor.nbytes on the Python side), and every binding checks the sizes before the kernel     */
/* runs: a buffer too small for what the kernel would write raises ValueError naming it and    */
/* the sizes; nothing is written past its end. Element counts must be non-negative (and fit    */
/* int32 where the kernel writes int32 indices). The typed signatures are in _native.pyi.      */

#if GS_X86
#define PTR(T, v) ((T *)(uintptr_t)(v))

/* Largest element count taken anywhere: keeps every byte count below 2^63. */
#define MAX_COUNT (1LL << 56)
/* Largest element count where the kernel writes int32 indices. */
#define MAX_INDEXED 2147483647LL

/* An element or byte count from Python: refuse a negative one or one above max. */
static int check_count(const char *fn, const char *name, long long v, long long max) {
    if (v < 0 || v > max) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be in [0, %lld], got %lld", fn, name, max, v);
        return -1;
    }
    return 0;
}

/* The kernel would touch `need` bytes (for `items` items) of a buffer the caller says holds `have`. */
static int check_room(const char *fn, const char *buf, long long have, long long need, long long items,
                      const char *what) {
    if (have < 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s_nbytes must be >= 0, got %lld", fn, buf, have);
        return -1;
    }
    if (have < need) {
        PyErr_Format(PyExc_ValueError, "%s: %s holds %lld bytes but %lld %s need %lld", fn, buf, have, items,
                     what, need);
        return -1;
    }
    return 0;
}

/*
 * m floats from a sequence (already a PySequence_Fast) into dst. Stops at the first item that
 * is not a real number and raises TypeError naming it (other conversion errors, such as
 * OverflowError, pass through unchanged).
 */
static int read_floats(const char *fn, const char *arg, PyObject *fast, float *dst, Py_ssize_t m) {
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, j);
        double v = PyFloat_AsDouble(item);
        if (v == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s: %s[%zd] must be a real number, not %.100s", fn, arg, j,
                             Py_TYPE(item)->tp_name);
            }
            return -1;
        }
        dst[j] = (float)v;
    }
    return 0;
}

static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    double st[4];
    if (!PyArg_ParseTuple(args, "KL", &x, &n)) return NULL;
    if (check_count("stats", "n", n, MAX_COUNT) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS k_stats(PTR(const float, x), n, st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(ddLd)", st[0], st[1], (long long)st[2], st[3]);
}

/* returns (count, sum |x| or NaN, max |x|, non-finite flag); idx and val hold cap entries each */
static PyObject *py_scan_select(PyObject *self, PyObject *args) {
    unsigned long long x, idx, val;
    long long n, cap, cnt;
    float t;
    int mode, want_sum;
    double st[3];
    if (!PyArg_ParseTuple(args, "KLfipKKL", &x, &n, &t, &mode, &want_sum, &idx, &val, &cap)) return NULL;
    if (check_count("scan_select", "n", n, MAX_INDEXED) < 0 || check_count("scan_select", "cap", cap, MAX_COUNT) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS cnt = k_scan_select(PTR(const float, x), n, t, mode, want_sum, PTR(int32_t, idx),
                                               PTR(float, val), cap, st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(LddL)", cnt, st[0], st[1], (long long)st[2]);
}

/* sum_scan_select(x, y, n, out, out_nbytes, t, mode, want_sum, idx, val, cap): out = x + y and
 * scan_select over out, in one pass (error feedback's residual + gradient, and the selection's
 * first scan of that sum) */
static PyObject *py_sum_scan_select(PyObject *self, PyObject *args) {
    unsigned long long x, y, out, idx, val;
    long long n, out_nbytes, cap, cnt;
    float t;
    int mode, want_sum;
    double st[3];
    if (!PyArg_ParseTuple(args, "KKLKLfipKKL", &x, &y, &n, &out, &out_nbytes, &t, &mode, &want_sum, &idx, &val,
                          &cap))
        return NULL;
    if (check_count("sum_scan_select", "n", n, MAX_INDEXED) < 0 ||
        check_count("sum_scan_select", "cap", cap, MAX_COUNT) < 0 ||
        check_room("sum_scan_select", "out", out_nbytes, 4 * n, n, "floats") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS cnt = k_sum_scan_select(PTR(const float, x), PTR(const float, y), PTR(float, out), n, t,
                                                   mode, want_sum, PTR(int32_t, idx), PTR(float, val), cap, st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(LddL)", cnt, st[0], st[1], (long long)st[2]);
}

/* count_ge(x, n, thresholds (sequence of up to 16 floats), mode) -> list of counts */
static PyObject *py_count_ge(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    PyObject *seq;
    int mode;
    float ts[16];
    int64_t out[16];
    if (!PyArg_ParseTuple(args, "KLOi", &x, &n, &seq, &mode)) return NULL;
    if (check_count("count_ge", "n", n, MAX_COUNT) < 0) return NULL;
    PyObject *fast = PySequence_Fast(seq, "count_ge: thresholds must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    if (m < 1 || m > 16) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "count_ge takes 1 to 16 thresholds, got %zd", m);
        return NULL;
    }
    int bad = read_floats("count_ge", "thresholds", fast, ts, m);
    Py_DECREF(fast);
    if (bad) return NULL;
    Py_BEGIN_ALLOW_THREADS k_count_ge(PTR(const float, x), n, ts, (int)m, mode, out);
    Py_END_ALLOW_THREADS PyObject *res = PyList_New(m);
    if (res == NULL) return NULL;
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *c = PyLong_FromLongLong(out[j]);
        if (c == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        PyList_SET_ITEM(res, j, c);
    }
    return res;
}

static PyObject *py_kth_largest(PyObject *self, PyObject *args) {
    unsigned long long v, scratch;
    long long n, k, scratch_nbytes;
    int mode;
    float r;
    if (!PyArg_ParseTuple(args, "KLLiKL", &v, &n, &k, &mode, &scratch, &scratch_nbytes)) return NULL;
    if (check_count("kth_largest", "n", n, MAX_COUNT) < 0) return NULL;
    if (k < 1 || k > n) {
        PyErr_Format(PyExc_ValueError, "kth_largest needs 1 <= k <= n, got k=%lld, n=%lld", k, n);
        return NULL;
    }
    if (check_room("kth_largest", "scratch", scratch_nbytes, 4 * n, n, "floats") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS r = k_kth_largest(PTR(const float, v), n, k, mode, PTR(float, scratch));
    Py_END_ALLOW_THREADS return PyFloat_FromDouble((double)r);
}

/* in place on the first n entries of idx and val */
static PyObject *py_keep_top(PyObject *self, PyObject *args) {
    unsigned long long idx, val;
    long long n, k, r;
    float kth;
    int mode;
    if (!PyArg_ParseTuple(args, "KKLLfi", &idx, &val, &n, &k, &kth, &mode)) return NULL;
    if (check_count("keep_top", "n", n, MAX_COUNT) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS r = k_keep_top(PTR(int32_t, idx), PTR(float, val), n, k, kth, mode);
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(r);
}

/* returns (sum of non-negatives, their count, sum of negatives, non-finite count) */
static PyObject *py_sign_pack(PyObject *self, PyObject *args) {
    unsigned long long x, bits;
    long long n, bits_nbytes;
    double st[4];
    if (!PyArg_ParseTuple(args, "KLKL", &x, &n, &bits, &bits_nbytes)) return NULL;
    if (check_count("sign_pack", "n", n, MAX_COUNT) < 0 ||
        check_room("sign_pack", "bits", bits_nbytes, (n + 7) / 8, n, "sign bits") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS k_sign_pack(PTR(const float, x), n, PTR(uint8_t, bits), st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(dLdL)", st[0], (long long)st[1], st[2], (long long)st[3]);
}

/* returns (non-zero codes, non-finite count) */
static PyObject *py_ternary_pack(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n, out_nbytes;
    float tau;
    double st[2];
    if (!PyArg_ParseTuple(args, "KLfKL", &x, &n, &tau, &out, &out_nbytes)) return NULL;
    if (check_count("ternary_pack", "n", n, MAX_COUNT) < 0 ||
        check_room("ternary_pack", "out", out_nbytes, (n + 3) / 4, n, "2-bit codes") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS k_ternary_pack(PTR(const float, x), n, tau, PTR(uint8_t, out), st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(LL)", (long long)st[0], (long long)st[1]);
}

/* returns (max |x|, non-finite flag) */
static PyObject *py_absmax(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    double st[2];
    if (!PyArg_ParseTuple(args, "KL", &x, &n)) return NULL;
    if (check_count("absmax", "n", n, MAX_COUNT) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS k_absmax(PTR(const float, x), n, st);
    Py_END_ALLOW_THREADS return Py_BuildValue("(dL)", st[0], (long long)st[1]);
}

static PyObject *py_stoch_pack(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n, out_nbytes;
    float mult;
    int L, bits;
    unsigned int k1, k2;
    if (!PyArg_ParseTuple(args, "KLfiiIIKL", &x, &n, &mult, &L, &bits, &k1, &k2, &out, &out_nbytes))
        return NULL;
    if (bits != 2 && bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "stoch_pack takes bits in {2, 4, 8}, got %d", bits);
        return NULL;
    }
    /* a larger level would spill into the sign bit and the neighbouring codes */
    if (L < 0 || L > (1 << (bits - 1)) - 1) {
        PyErr_Format(PyExc_ValueError, "stoch_pack: %d-bit codes take levels in [0, %d], got %d", bits,
                     (1 << (bits - 1)) - 1, L);
        return NULL;
    }
    if (check_count("stoch_pack", "n", n, MAX_COUNT) < 0 ||
        check_room("stoch_pack", "out", out_nbytes, (n * bits + 7) / 8, n, "codes") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS k_stoch_pack(PTR(const float, x), n, mult, L, bits, k1, k2, PTR(uint8_t, out));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* lut_unpack(codes, codes_nbytes, n, bits, lut (sequence of 2^bits floats), out, out_nbytes, accumulate) */
static PyObject *py_lut_unpack(PyObject *self, PyObject *args) {
    unsigned long long codes, out;
    long long codes_nbytes, n, out_nbytes;
    int bits, acc;
    PyObject *seq;
    float lut[256];
    if (!PyArg_ParseTuple(args, "KLLiOKLp", &codes, &codes_nbytes, &n, &bits, &seq, &out, &out_nbytes, &acc))
        return NULL;
    if (bits != 1 && bits != 2 && bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "lut_unpack takes bits in {1, 2, 4, 8}, got %d", bits);
        return NULL;
    }
    if (check_count("lut_unpack", "n", n, MAX_COUNT) < 0 ||
        check_room("lut_unpack", "codes", codes_nbytes, (n * bits + 7) / 8, n, "codes") < 0 ||
        check_room("lut_unpack", "out", out_nbytes, 4 * n, n, "floats") < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "lut_unpack: lut must be a sequence");
    if (fast == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != (1 << bits)) {
        PyErr_Format(PyExc_ValueError, "lut_unpack: a %d-bit lut must have %d entries, got %zd", bits, 1 << bits,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    int bad = read_floats("lut_unpack", "lut", fast, lut, 1 << bits);
    Py_DECREF(fast);
    if (bad) return NULL;
    Py_BEGIN_ALLOW_THREADS k_lut_unpack(PTR(const uint8_t, codes), n, bits, lut, PTR(float, out), acc);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* returns (max |x|, non-finite count, overflow count) */
static PyObject *py_to_half(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n, out_nbytes;
    float scale;
    int bf16;
    double st[3];
    if (!PyArg_ParseTuple(args, "KLfKLp", &x, &n, &scale, &out, &out_nbytes, &bf16)) return NULL;
    if (check_count("to_half", "n", n, MAX_COUNT) < 0 ||
        check_room("to_half", "out", out_nbytes, 2 * n, n, "16-bit values") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS k_to_16bit(PTR(const float, x), n, scale, PTR(uint16_t, out), st, bf16);
    Py_END_ALLOW_THREADS return Py_BuildValue("(dLL)", st[0], (long long)st[1], (long long)st[2]);
}

static PyObject *py_from_half(PyObject *self, PyObject *args) {
    unsigned long long h, out;
    long long n, out_nbytes;
    float scale;
    int bf16, acc;
    if (!PyArg_ParseTuple(args, "KLfKLpp", &h, &n, &scale, &out, &out_nbytes, &bf16, &acc)) return NULL;
    if (check_count("from_half", "n", n, MAX_COUNT) < 0 ||
        check_room("from_half", "out", out_nbytes, 4 * n, n, "floats") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) k_from_bf16(PTR(const uint16_t, h), n, scale, PTR(float, out), acc);
    else k_from_half(PTR(const uint16_t, h), n, scale, PTR(float, out), acc);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* out holds n floats (indices outside [0, n) are skipped and counted); idx and val hold m entries */
static PyObject *py_sparse_add(PyObject *self, PyObject *args) {
    unsigned long long out, idx, val;
    long long n, m, bad;
    float alpha;
    if (!PyArg_ParseTuple(args, "KLKKLf", &out, &n, &idx, &val, &m, &alpha)) return NULL;
    if (check_count("sparse_add", "n", n, MAX_COUNT) < 0 || check_count("sparse_add", "m", m, MAX_COUNT) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS bad = k_sparse_add(PTR(float, out), n, PTR(const int32_t, idx), PTR(const float, val), m, alpha);
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(bad);
}

/* out holds n floats; idx and val hold m entries */
static PyObject *py_sparse_to_dense(PyObject *self, PyObject *args) {
    unsigned long long out, idx, val;
    long long n, m;
    int r;
    if (!PyArg_ParseTuple(args, "KLKKL", &out, &n, &idx, &val, &m)) return NULL;
    if (check_count("sparse_to_dense", "n", n, MAX_COUNT) < 0 ||
        check_count("sparse_to_dense", "m", m, MAX_COUNT) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS r = k_sparse_to_dense(PTR(float, out), n, PTR(const int32_t, idx), PTR(const float, val), m);
    Py_END_ALLOW_THREADS return PyLong_FromLong(r);
}

static PyObject *py_range_positions(PyObject *self, PyObject *args) {
    unsigned long long keys, pos;
    long long n, pos_nbytes, cnt;
    float lo, hi;
    if (!PyArg_ParseTuple(args, "KLffKL", &keys, &n, &lo, &hi, &pos, &pos_nbytes)) return NULL;
    if (check_count("range_positions", "n", n, MAX_INDEXED) < 0 ||
        check_count("range_positions", "pos_nbytes", pos_nbytes, LLONG_MAX) < 0)
        return NULL;
    long long cap = pos_nbytes / 4;
    Py_BEGIN_ALLOW_THREADS cnt = k_range_positions(PTR(const float, keys), n, lo, hi, PTR(int32_t, pos), cap);
    Py_END_ALLOW_THREADS if (cnt > cap) {
        PyErr_Format(PyExc_ValueError, "range_positions: pos holds %lld bytes but %lld positions need %lld",
                     pos_nbytes, cnt, 4 * cnt);
        return NULL;
    }
    return PyLong_FromLongLong(cnt);
}

static PyObject *py_copy_check(PyObject *self, PyObject *args) {
    unsigned long long x, out;
    long long n, out_nbytes;
    int r;
    if (!PyArg_ParseTuple(args, "KLKL", &x, &n, &out, &out_nbytes)) return NULL;
    if (check_count("copy_check", "n", n, MAX_COUNT) < 0 ||
        check_room("copy_check", "out", out_nbytes, 4 * n, n, "floats") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS r = k_copy_check(PTR(const float, x), n, PTR(float, out));
    Py_END_ALLOW_THREADS return PyBool_FromLong(r);
}

static PyObject *py_random_subset(PyObject *self, PyObject *args) {
    long long n, k, idx_nbytes, bitmap_nbytes;
    unsigned long long seed, idx, bitmap;
    if (!PyArg_ParseTuple(args, "LLKKLKL", &n, &k, &seed, &idx, &idx_nbytes, &bitmap, &bitmap_nbytes)) return NULL;
    if (check_count("random_subset", "n", n, MAX_INDEXED) < 0) return NULL;
    if (k < 0 || k > n) {
        PyErr_Format(PyExc_ValueError, "random_subset needs 0 <= k <= n, got k=%lld, n=%lld", k, n);
        return NULL;
    }
    if (check_room("random_subset", "idx", idx_nbytes, 4 * k, k, "indices") < 0 ||
        check_room("random_subset", "bitmap", bitmap_nbytes, 8 * ((n + 63) / 64), n, "bits") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS k_random_subset(n, k, seed, PTR(int32_t, idx), PTR(uint64_t, bitmap));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* val = x[idx] for the m indices, each checked against the n floats of x (IndexError) */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    unsigned long long x, idx, val;
    long long n, m, val_nbytes, bad;
    if (!PyArg_ParseTuple(args, "KLKLKL", &x, &n, &idx, &m, &val, &val_nbytes)) return NULL;
    if (check_count("gather", "n", n, MAX_COUNT) < 0 || check_count("gather", "m", m, MAX_COUNT) < 0 ||
        check_room("gather", "val", val_nbytes, 4 * m, m, "floats") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS bad = k_gather(PTR(const float, x), n, PTR(const int32_t, idx), m, PTR(float, val));
    Py_END_ALLOW_THREADS if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "gather: idx[%lld] = %d is outside x of %lld elements", bad,
                     (int)PTR(const int32_t, idx)[bad], n);
        return NULL;
    }
    Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
#if GS_X86
    {"stats", py_stats, METH_VARARGS, "stats(x, n): sum|x|, max|x|, non-finite count, sum x^2"},
    {"absmax", py_absmax, METH_VARARGS, "absmax(x, n): max|x| and a non-finite flag"},
    {"scan_select", py_scan_select, METH_VARARGS,
     "scan_select(x, n, t, mode, want_sum, idx, val, cap): stats + compaction of key(x) >= t"},
    {"sum_scan_select", py_sum_scan_select, METH_VARARGS,
     "sum_scan_select(x, y, n, out, out_nbytes, t, mode, want_sum, idx, val, cap): out = x + y, then scan_select"},
    {"count_ge", py_count_ge, METH_VARARGS,
     "count_ge(x, n, thresholds, mode): counts of key(x) >= t for up to 16 thresholds"},
    {"kth_largest", py_kth_largest, METH_VARARGS,
     "kth_largest(v, n, k, mode, scratch, scratch_nbytes): k-th largest key by quickselect"},
    {"keep_top", py_keep_top, METH_VARARGS,
     "keep_top(idx, val, n, k, kth, mode): keep the k largest candidates in index order"},
    {"sign_pack", py_sign_pack, METH_VARARGS, "sign_pack(x, n, bits, bits_nbytes): sign bits, sums of both signs"},
    {"ternary_pack", py_ternary_pack, METH_VARARGS, "ternary_pack(x, n, tau, out, out_nbytes): 2-bit codes"},
    {"stoch_pack", py_stoch_pack, METH_VARARGS,
     "stoch_pack(x, n, mult, levels, bits, k1, k2, out, out_nbytes): stochastic quantization codes"},
    {"lut_unpack", py_lut_unpack, METH_VARARGS,
     "lut_unpack(codes, codes_nbytes, n, bits, lut, out, out_nbytes, accumulate): codes to values"},
    {"to_half", py_to_half, METH_VARARGS,
     "to_half(x, n, scale, out, out_nbytes, bf16): float32 to fp16/bf16 with range statistics"},
    {"from_half", py_from_half, METH_VARARGS,
     "from_half(h, n, scale, out, out_nbytes, bf16, accumulate): fp16/bf16 to float32"},
    {"sparse_add", py_sparse_add, METH_VARARGS, "sparse_add(out, n, idx, val, m, alpha): bounds-checked scatter-add"},
    {"sparse_to_dense", py_sparse_to_dense, METH_VARARGS,
     "sparse_to_dense(out, n, idx, val, m): dense tensor from sorted sparse entries"},
    {"copy_check", py_copy_check, METH_VARARGS, "copy_check(x, n, out, out_nbytes): copy with a non-finite check"},
    {"range_positions", py_range_positions, METH_VARARGS,
     "range_positions(keys, n, lo, hi, pos, pos_nbytes): positions of keys in [lo, hi)"},
    {"random_subset", py_random_subset, METH_VARARGS,
     "random_subset(n, k, seed, idx, idx_nbytes, bitmap, bitmap_nbytes): sorted uniform k-subset of range(n)"},
    {"gather", py_gather, METH_VARARGS, "gather(x, n, idx, m, val, val_nbytes): val = x[idx], indices checked"},
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
