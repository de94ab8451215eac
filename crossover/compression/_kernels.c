/* Hot-path kernels for crossover's gradient compressors (called through ctypes, see kernels.py).
 *
 * C99, single-threaded, no allocation: the caller passes every output buffer (the only scratch
 * space is a few KiB of stack). The dense loops are written as blocks of LANES independent
 * accumulators so that gcc -O3 vectorises them with the baseline instruction set (no -march=native,
 * no -ffast-math): each lane keeps its own double sum, so no floating-point reassociation is needed.
 * All functions return 0 on success; those taking indices return -1, having written nothing, when an
 * index is outside [0, n).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8      /* independent accumulators per dense loop */
#define CHUNK 1024   /* ef_select: elements per L1-resident chunk (a multiple of 32) */

#if defined(__GNUC__) || defined(__clang__)
#define CTZ32(m) __builtin_ctz(m)
#define INLINE inline __attribute__((always_inline))
#else
#define INLINE inline
static int CTZ32(uint32_t m)
{
    int l = 0;
    while (!(m & 1u)) {
        m >>= 1;
        l++;
    }
    return l;
}
#endif

/* On x86-64 with gcc and glibc the dense kernels are also compiled for AVX2 and the loader picks the
 * best version at run time (ifunc), so the cached library stays portable (no -march=native) while
 * AVX2 machines get twice the vector width. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 6 && defined(__x86_64__) && \
    defined(__GLIBC__) && !defined(CROSSOVER_NO_MULTIVERSION)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

#define HIGH (UINT32_C(1) << 31)

static const uint32_t BIT[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

static double lanes_total(const double *s)
{
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* sum of x[i]^2, accumulated in double */
MULTIVERSION
int cx_sumsq(const float *x, int64_t n, double *out_sumsq)
{
    double s[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            double d = x[i + l];
            s[l] += d * d;
        }
    }
    double t = 0.0;
    for (; i < n; i++) {
        double d = x[i];
        t += d * d;
    }
    *out_sumsq = lanes_total(s) + t;
    return 0;
}

/* r += g in place; sum of the new r^2 in double */
MULTIVERSION
int cx_ef_accumulate(const float *g, float *r, int64_t n, double *out_sumsq)
{
    double s[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            float a = r[i + l] + g[i + l];
            r[i + l] = a;
            double d = a;
            s[l] += d * d;
        }
    }
    double t = 0.0;
    for (; i < n; i++) {
        float a = r[i] + g[i];
        r[i] = a;
        double d = a;
        t += d * d;
    }
    *out_sumsq = lanes_total(s) + t;
    return 0;
}

/* Running state of cx_ef_select. */
typedef struct {
    double s[LANES]; /* per-lane sums of acc^2 */
    double tail;     /* sum of acc^2 over elements outside whole lane groups */
    double sg[LANES]; /* per-lane sums of g^2 (with r: the raw gradient apart from the residual) */
    double gtail;    /* sum of g^2 outside whole lane groups */
    double ssel;     /* sum of picked^2 */
    int64_t cnt, q;  /* picked, qualifying */
} select_state;

/* One chunk [b, b + len) of cx_ef_select, len <= CHUNK. Called with len == CHUNK for all whole
 * chunks so that, once inlined, the loops below have constant trip counts. */
static INLINE void select_chunk(select_state *st, const float *g, float *r, int64_t b, int64_t len,
                                float thr, int32_t *oidx, float *oval, int64_t cap)
{
    uint32_t mask[CHUNK / 32];
    const int64_t full = len - len % LANES;
    const float *acc = r ? r : g; /* acc is read back from here once the chunk is accumulated */
    /* 1. acc (into r) and sum of squares */
    if (r) {
        for (int64_t i = b; i < b + full; i += LANES) {
            for (int l = 0; l < LANES; l++) {
                float a = g[i + l] + r[i + l];
                r[i + l] = a;
                double d = a;
                st->s[l] += d * d;
            }
        }
        /* ||g||^2 apart from the residual, in a loop of its own over the chunk, now in L1 (folded into
         * the loop above, the second set of accumulators made it 2.5x slower) */
        for (int64_t i = b; i < b + full; i += LANES) {
            for (int l = 0; l < LANES; l++) {
                double e = g[i + l];
                st->sg[l] += e * e;
            }
        }
        for (int64_t i = b + full; i < b + len; i++) {
            float a = g[i] + r[i];
            r[i] = a;
            st->tail += (double)a * (double)a;
            st->gtail += (double)g[i] * (double)g[i];
        }
    } else {
        for (int64_t i = b; i < b + full; i += LANES) {
            for (int l = 0; l < LANES; l++) {
                double d = g[i + l];
                st->s[l] += d * d;
            }
        }
        for (int64_t i = b + full; i < b + len; i++)
            st->tail += (double)g[i] * (double)g[i];
    }
    /* 2. one bit per element: |acc| >= thr */
    const float *a = acc + b;
    const int64_t words = len / 32, rest = len % 32;
    for (int64_t w = 0; w < words; w++) {
        uint32_t m = 0;
        for (int l = 0; l < 32; l++)
            m |= BIT[l] & (0u - (uint32_t)(fabsf(a[32 * w + l]) >= thr));
        mask[w] = m;
    }
    if (rest) {
        uint32_t m = 0;
        for (int l = 0; l < rest; l++)
            m |= BIT[l] & (0u - (uint32_t)(fabsf(a[32 * words + l]) >= thr));
        mask[words] = m;
    }
    /* 3. flatten the set bits into chunk offsets, in index order: the first two bits of every word
     * without branches (ctz of m | HIGH is a harmless dummy entry, not counted, once m is empty),
     * further ones (rare at low density) in a loop */
    int32_t cand[CHUNK + 2];
    int64_t nc = 0;
    const int64_t nwords = words + (rest ? 1 : 0);
    for (int64_t w = 0; w < nwords; w++) {
        uint32_t m = mask[w];
        const int32_t base = (int32_t)(32 * w);
        cand[nc] = base + CTZ32(m | HIGH);
        nc += (m != 0);
        m &= m - 1u;
        cand[nc] = base + CTZ32(m | HIGH);
        nc += (m != 0);
        m &= m - 1u;
        while (m) {
            cand[nc++] = base + CTZ32(m);
            m &= m - 1u;
        }
    }
    /* 4. emit them while capacity lasts */
    st->q += nc;
    const int64_t room = cap - st->cnt;
    const int64_t take = nc < room ? nc : room;
    int32_t *oi = oidx + st->cnt;
    float *ov = oval + st->cnt;
    double ssel = 0.0;
    for (int64_t t = 0; t < take; t++) {
        const int64_t i = b + cand[t];
        const float v = acc[i];
        oi[t] = (int32_t)i;
        ov[t] = v;
        ssel += (double)v * (double)v;
        if (r)
            r[i] = 0.0f;
    }
    st->ssel += ssel;
    st->cnt += take;
}

/* Error-feedback threshold selection, one pass over the data. acc = g + r (r may be NULL: acc = g).
 * Elements with |acc| >= thr are picked in index order into oidx/oval while fewer than cap have been
 * picked; if r is given it ends as 0 where picked and acc elsewhere. counts = {picked, qualifying},
 * sums = {sum acc^2, sum picked^2, sum g^2} (the last read in the same pass: with r, the raw gradient's
 * norm apart from the residual, which GraVAC's gain needs; without r it equals the first).
 * The data go through in L1-sized chunks: a vectorised loop writes r = acc and sums acc^2, a second
 * vectorised loop turns each 32 elements of the (now cached) acc into a bit mask, a mostly
 * branch-free loop turns the set bits into offsets and a last loop emits them. */
MULTIVERSION
int cx_ef_select(const float *g, float *r, int64_t n, float thr, int32_t *oidx, float *oval,
                 int64_t cap, int64_t *counts, double *sums)
{
    select_state st;
    memset(&st, 0, sizeof st);
    int64_t b = 0;
    for (; n - b >= CHUNK; b += CHUNK)
        select_chunk(&st, g, r, b, CHUNK, thr, oidx, oval, cap);
    if (b < n)
        select_chunk(&st, g, r, b, n - b, thr, oidx, oval, cap);
    counts[0] = st.cnt;
    counts[1] = st.q;
    sums[0] = lanes_total(st.s) + st.tail;
    sums[1] = st.ssel;
    sums[2] = r ? lanes_total(st.sg) + st.gtail : sums[0];
    return 0;
}

/* 0 when every idx[j] lies in [0, n), -1 otherwise */
static int check_indices(const int32_t *idx, int64_t k, int64_t n)
{
    int bad = 0;
    for (int64_t j = 0; j < k; j++)
        bad |= (idx[j] < 0) | ((int64_t)idx[j] >= n);
    return bad ? -1 : 0;
}

/* out[j] = src[idx[j]] for all j, then (if zero_src) src[idx[j]] = 0 for all j; sumsq of out */
int cx_gather_take(float *src, int64_t n, const int32_t *idx, int64_t k, float *out, int zero_src,
                   double *out_sumsq)
{
    if (check_indices(idx, k, n))
        return -1;
    double ss = 0.0;
    for (int64_t j = 0; j < k; j++) {
        float v = src[idx[j]];
        out[j] = v;
        ss += (double)v * (double)v;
    }
    if (zero_src) {
        for (int64_t j = 0; j < k; j++)
            src[idx[j]] = 0.0f;
    }
    *out_sumsq = ss;
    return 0;
}

static void scatter_unchecked(float *out, const int32_t *idx, const float *vals, int64_t k,
                              float scale)
{
    if (scale == 1.0f) {
        for (int64_t j = 0; j < k; j++)
            out[idx[j]] += vals[j];
    } else {
        for (int64_t j = 0; j < k; j++)
            out[idx[j]] += scale * vals[j];
    }
}

/* out[idx[j]] += scale * vals[j]; duplicates accumulate in index order */
int cx_scatter_add(float *out, int64_t n, const int32_t *idx, const float *vals, int64_t k,
                   float scale)
{
    if (check_indices(idx, k, n))
        return -1;
    scatter_unchecked(out, idx, vals, k, scale);
    return 0;
}

/* out = 0 everywhere, then out[idx[j]] += scale * vals[j] (decompress into a reused dense buffer) */
int cx_zero_scatter(float *out, int64_t n, const int32_t *idx, const float *vals, int64_t k,
                    float scale)
{
    if (check_indices(idx, k, n))
        return -1;
    memset(out, 0, (size_t)n * sizeof(float));
    scatter_unchecked(out, idx, vals, k, scale);
    return 0;
}

/* out[j] = |g[p] + r[p]| (r may be NULL), j < m: one p per stratum [floor(j*numel/m),
 * floor((j+1)*numel/m)), at offset (h * width) >> 31 with h = (j * 0x4F1BBCDD) mod 2^31 (a Weyl sequence).
 * A plain stride aliases with a matrix's rows: every 98th element of a 256 x 1568 gradient is in 16 of its
 * 1568 columns, and the threshold from them kept a median 1.19x the elements wanted. */
int cx_sample_abs(const float *g, const float *r, int64_t numel, int64_t m, float *out)
{
    for (int64_t j = 0; j < m; j++) {
        uint64_t lo = ((uint64_t)j * (uint64_t)numel) / (uint64_t)m;
        uint64_t width = ((uint64_t)(j + 1) * (uint64_t)numel) / (uint64_t)m - lo;
        uint64_t h = ((uint64_t)j * UINT64_C(0x4F1BBCDD)) & UINT64_C(0x7FFFFFFF);
        int64_t p = (int64_t)(lo + ((h * width) >> 31));
        float a = r ? g[p] + r[p] : g[p];
        out[j] = fabsf(a);
    }
    return 0;
}

/* splitmix64 finaliser */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* Stratified random indices: stratum j = [floor(j*numel/k), floor((j+1)*numel/k)), one index per
 * stratum at offset ((z >> 32) * width) >> 32 with z = mix64(seed + (j+1) * golden). Distinct and
 * sorted when k <= numel (checked by the caller). */
int cx_random_indices(int64_t numel, int64_t k, uint64_t seed, int32_t *out)
{
    const uint64_t golden = UINT64_C(0x9E3779B97F4A7C15);
    for (int64_t j = 0; j < k; j++) {
        uint64_t lo = ((uint64_t)j * (uint64_t)numel) / (uint64_t)k;
        uint64_t hi = ((uint64_t)(j + 1) * (uint64_t)numel) / (uint64_t)k;
        uint64_t z = mix64(seed + (uint64_t)(j + 1) * golden);
        out[j] = (int32_t)(lo + (((z >> 32) * (hi - lo)) >> 32));
    }
    return 0;
}

/* A selection as a bitmap and its values in index order (the allgather's bitmap format):
 * bits[0..nbytes) = the set of idx (bit j of byte i = element 8 i + j), vals[0..c) = the values of the set
 * bits in index order, a repeated index's values added up; scratch holds n floats (any content). Returns c,
 * -1 when an index is outside [0, n) or n > 8 nbytes (nothing meaningful written), -2 when c > cap. */
int cx_bitmap_pack(const int32_t *idx, const float *val, int64_t k, int64_t n, uint8_t *bits,
                       int64_t nbytes, float *scratch, float *vals, int64_t cap)
{
    if (n > 8 * nbytes || check_indices(idx, k, n))
        return -1;
    memset(bits, 0, (size_t)nbytes);
    for (int64_t j = 0; j < k; j++) {
        int32_t i = idx[j];
        uint8_t m = (uint8_t)(1u << (i & 7));
        if (bits[i >> 3] & m) {
            scratch[i] += val[j];
        } else {
            bits[i >> 3] |= m;
            scratch[i] = val[j];
        }
    }
    int64_t c = 0;
    for (int64_t b = 0; b < nbytes; b++) {
        unsigned byte = bits[b];
        while (byte) {
            if (c >= cap)
                return -2;
            vals[c++] = scratch[b * 8 + CTZ32(byte)];
            byte &= byte - 1;
        }
    }
    return (int)c; /* c <= k <= n < 2^31 */
}

/* out[i] += scale * vals[c] for the c-th set bit i of bits (index order); n < 2^31. Returns the number of set bits,
 * -1 when a bit marks an element at or beyond n, -2 when the bits outnumber the nvals values; on an error
 * out may be partly updated (the caller raises). */
int cx_bitmap_add(float *out, int64_t n, const uint8_t *bits, int64_t nbytes, const float *vals,
                      int64_t nvals, float scale)
{
    int64_t c = 0;
    for (int64_t b = 0; b < nbytes; b++) {
        unsigned byte = bits[b];
        while (byte) {
            int64_t i = b * 8 + CTZ32(byte);
            if (i >= n)
                return -1;
            if (c >= nvals)
                return -2;
            out[i] += scale * vals[c++];
            byte &= byte - 1;
        }
    }
    return (int)c; /* c <= n < 2^31 */
}
