/* Stochastic uniform quantizer (QSGD family) for crossover, called through ctypes (see quantize.py).
 *
 * C99, single-threaded, no heap allocation: the caller passes every output buffer. Work is done in
 * blocks of BLK elements held in small stack arrays (L1-resident), each loop simple enough for gcc
 * -O3 to vectorise. On x86-64 with gcc/clang the random numbers and levels are computed by a fused
 * AVX2 loop when the CPU has AVX2 (checked at run time), and the other loops are also compiled for
 * AVX2 and picked at load time (target_clones, glibc). Every path performs the same IEEE float32
 * operations (no FMA: -ffp-contract=off, no -ffast-math), so all of them and the torch fallback give
 * bit-identical results.
 *
 * Definitions shared with the torch fallback (quantize.py), element i of a tensor of n:
 *   z_q   = mix64(seed + (q + 1) * 0x9E3779B97F4A7C15)   splitmix64 output q (mod 2^64), q = i / 4
 *   r_i   = (z_{i/4} >> (16 * (i % 4))) & 0xFFFF          16 random bits per element
 *   u_i   = (2 r_i + 1) * 2^-17                           midpoints of a 2^-16 grid in (0, 1), exact
 *   a_i   = |x_i| * mult                         float32, mult = float32(s / scale) (from Python)
 *   t_i   = a_i + u_i                            float32
 *   l_i   = t_i < s ? (int)t_i : s               NaN and anything >= s saturate to s
 *   level = signbit(x_i) ? -l_i : l_i            in [-s, s]
 *   code  = level + s                            offset binary in [0, 2s], packed LSB first
 *   value = (float)level * sw                    sw = float32(weight * scale / s) (from Python)
 * Packed stream: element i occupies bits [i*b, (i+1)*b) of the byte stream, bit k of the stream
 * being bit (k % 8) of byte k / 8; so 8 elements fill exactly b bytes, little-endian.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLK 1024 /* elements per block: a multiple of 32 (AVX2 step) and of 8 (one packing group) */

/* AVX2 clones of the autovectorised loops, chosen by the loader (ifunc: glibc only). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif

static const uint64_t GOLDEN = UINT64_C(0x9E3779B97F4A7C15);

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* u[0..4*nquads) for elements 4*quad0 ... (quad index = element index / 4): four 16-bit fields of
 * one splitmix64 output, LSB first. On a little-endian machine the fields are the 16-bit words of
 * the z stream in order, which levels16 exploits. */
static inline void uniforms_generic(uint64_t seed, uint64_t quad0, int64_t nquads, float *restrict u)
{
    uint64_t base = seed + (quad0 + 1) * GOLDEN;
    for (int64_t j = 0; j < nquads; j++) {
        uint64_t z = mix64(base + (uint64_t)j * GOLDEN);
        for (int k = 0; k < 4; k++) {
            int32_t r = (int32_t)((z >> (16 * k)) & 0xFFFFu);
            u[4 * j + k] = (float)(2 * r + 1) * 0x1p-17f;
        }
    }
}

/* levels of x[0..m) with the uniforms u[0..m) */
static inline void levels_block(const float *x, const float *restrict u, int64_t m, float mult, int32_t s,
                                int32_t *restrict lev)
{
    const float fs = (float)s;
    for (int64_t j = 0; j < m; j++) {
        float v = x[j];
        float a = fabsf(v) * mult;
        float t = a + u[j];
        t = t < fs ? t : fs;                   /* branch-free select; NaN -> s */
        int32_t l = (int32_t)t;                /* t in [0, s]: truncation is floor */
        uint32_t bits;
        memcpy(&bits, &v, 4);
        int32_t neg = -(int32_t)(bits >> 31);  /* all ones where the sign bit is set */
        lev[j] = (l ^ neg) - neg;
    }
}

/* Optional error feedback: ef[j] = x[j] - (float)lev[j] * step (ef may be x itself). */
static inline void ef_block(const float *x, const int32_t *restrict lev, int64_t m, float step, float *ef)
{
    for (int64_t j = 0; j < m; j++) {
        float d = (float)lev[j] * step;
        ef[j] = x[j] - d;
    }
}

/* Packing, 8 elements = B bytes. B = 2, 4, 8: byte-oriented loops (vectorised). Other B: one
 * 64-bit word per group, written (read) with one unaligned 8-byte access on little-endian machines
 * while those 8 bytes lie inside the groups of this call (the spill into the following groups is
 * rewritten by them), byte by byte at the end, so nothing outside the call's bytes is touched. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define LITTLE_ENDIAN_WORDS 1
#else
#define LITTLE_ENDIAN_WORDS 0
#endif

#define DEFINE_PACK(B)                                                                             \
    static inline void pack_##B(const int32_t *restrict lev, int64_t groups, int32_t s,           \
                                uint8_t *restrict p)                                               \
    {                                                                                              \
        for (int64_t g = 0; g < groups; g++) {                                                     \
            uint64_t w = 0;                                                                        \
            for (int k = 0; k < 8; k++)                                                            \
                w |= (uint64_t)(uint32_t)(lev[8 * g + k] + s) << (B * k);                          \
            if (LITTLE_ENDIAN_WORDS && B * g + 8 <= B * groups) {                                           \
                memcpy(p + B * g, &w, 8);                                                          \
            } else {                                                                               \
                for (int k = 0; k < B; k++)                                                        \
                    p[B * g + k] = (uint8_t)(w >> (8 * k));                                        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    static inline void unpack_##B(const uint8_t *restrict p, int64_t groups, int32_t s,           \
                                  int32_t *restrict lev)                                           \
    {                                                                                              \
        const uint64_t mask = (UINT64_C(1) << B) - 1;                                              \
        for (int64_t g = 0; g < groups; g++) {                                                     \
            uint64_t w = 0;                                                                        \
            if (LITTLE_ENDIAN_WORDS && B * g + 8 <= B * groups) {                                           \
                memcpy(&w, p + B * g, 8);                                                          \
            } else {                                                                               \
                for (int k = 0; k < B; k++)                                                        \
                    w |= (uint64_t)p[B * g + k] << (8 * k);                                        \
            }                                                                                      \
            for (int k = 0; k < 8; k++)                                                            \
                lev[8 * g + k] = (int32_t)((w >> (B * k)) & mask) - s;                             \
        }                                                                                          \
    }
DEFINE_PACK(3)
DEFINE_PACK(5)
DEFINE_PACK(6)
DEFINE_PACK(7)

static inline void pack_2(const int32_t *restrict lev, int64_t groups, int32_t s, uint8_t *restrict p)
{
    for (int64_t j = 0; j < 2 * groups; j++) {
        const int32_t *c = lev + 4 * j;
        p[j] = (uint8_t)((c[0] + s) | ((c[1] + s) << 2) | ((c[2] + s) << 4) | ((c[3] + s) << 6));
    }
}

static inline void unpack_2(const uint8_t *restrict p, int64_t groups, int32_t s, int32_t *restrict lev)
{
    for (int64_t j = 0; j < 2 * groups; j++) {
        int32_t v = p[j];
        lev[4 * j] = (v & 3) - s;
        lev[4 * j + 1] = ((v >> 2) & 3) - s;
        lev[4 * j + 2] = ((v >> 4) & 3) - s;
        lev[4 * j + 3] = (v >> 6) - s;
    }
}

static inline void pack_4(const int32_t *restrict lev, int64_t groups, int32_t s, uint8_t *restrict p)
{
    for (int64_t j = 0; j < 4 * groups; j++)
        p[j] = (uint8_t)((lev[2 * j] + s) | ((lev[2 * j + 1] + s) << 4));
}

static inline void unpack_4(const uint8_t *restrict p, int64_t groups, int32_t s, int32_t *restrict lev)
{
    for (int64_t j = 0; j < 4 * groups; j++) {
        int32_t v = p[j];
        lev[2 * j] = (v & 15) - s;
        lev[2 * j + 1] = (v >> 4) - s;
    }
}

static inline void pack_8(const int32_t *restrict lev, int64_t groups, int32_t s, uint8_t *restrict p)
{
    for (int64_t j = 0; j < 8 * groups; j++)
        p[j] = (uint8_t)(lev[j] + s);
}

static inline void unpack_8(const uint8_t *restrict p, int64_t groups, int32_t s, int32_t *restrict lev)
{
    for (int64_t j = 0; j < 8 * groups; j++)
        lev[j] = (int32_t)p[j] - s;
}

/* The b-bit packers and unpackers by width (b in [2, 8]); called once per chunk of groups. */
typedef void (*pack_fn)(const int32_t *restrict, int64_t, int32_t, uint8_t *restrict);
typedef void (*unpack_fn)(const uint8_t *restrict, int64_t, int32_t, int32_t *restrict);
static const pack_fn PACK[9] = {0, 0, pack_2, pack_3, pack_4, pack_5, pack_6, pack_7, pack_8};
static const unpack_fn UNPACK[9] = {0, 0, unpack_2, unpack_3, unpack_4, unpack_5, unpack_6, unpack_7, unpack_8};

/* out = / += (float)lev * sw */
static inline void dequant_block(const int32_t *restrict lev, int64_t m, float sw, float *restrict out, int acc)
{
    if (acc) {
        for (int64_t j = 0; j < m; j++) {
            float d = (float)lev[j] * sw;
            out[j] = out[j] + d;
        }
    } else {
        for (int64_t j = 0; j < m; j++)
            out[j] = (float)lev[j] * sw;
    }
}

/* ---------------------------------------------------------------------------------------------
 * AVX2 paths (x86-64, gcc/clang), used when the CPU has AVX2. Outputs of at least NT_MIN_BYTES
 * that are 32-byte aligned are written with non-temporal stores (they do not fit in cache anyway;
 * this saves the read-for-ownership of every output line).
 * ------------------------------------------------------------------------------------------- */
#define NT_MIN_BYTES (16 << 20)

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

static int avx2_state = -1; /* -1: not probed yet */
static int avx2_allowed = 1; /* cq_use_simd(0) forces the portable code (tests) */

static int have_avx2(void)
{
    if (avx2_state < 0) {
        __builtin_cpu_init();
        avx2_state = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return avx2_state && avx2_allowed;
}

static int use_nt(const void *p, int64_t bytes)
{
    return bytes >= NT_MIN_BYTES && ((uintptr_t)p & 31u) == 0;
}

/* z * c mod 2^64 in each 64-bit lane (AVX2 has no 64-bit multiply): lo*lo + ((hi*lo + lo*hi) << 32) */
static inline AVX2 __m256i mul64c(__m256i z, uint64_t c)
{
    const __m256i clo = _mm256_set1_epi64x((long long)(c & 0xFFFFFFFFu));
    const __m256i chi = _mm256_set1_epi64x((long long)(c >> 32));
    __m256i lo = _mm256_mul_epu32(z, clo);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), clo), _mm256_mul_epu32(z, chi));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

static inline AVX2 void store_i32(int32_t *p, __m256i v, int nt)
{
    if (nt)
        _mm256_stream_si256((__m256i *)p, v);
    else
        _mm256_storeu_si256((__m256i *)p, v);
}

/* 32 codes (level + s, each < 256), c[k] = elements 8k..8k+7 -> 32 * bits / 8 packed bytes. */
static inline __attribute__((always_inline)) AVX2 void pack32(const __m256i *c, int bits, uint8_t *p, int spill)
{
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    /* dwords [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31] -> elements 0..31 in order */
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    b = _mm256_permutevar8x32_epi32(b, order);
    if (bits == 8) {
        _mm256_storeu_si256((__m256i *)p, b);
        return;
    }
    if (bits == 4) { /* byte pairs -> lo | hi << 4 (16-bit lanes), then bytes */
        __m256i t = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0x00FF));
        t = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0x08);
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(t));
        return;
    }
    if (bits == 2) { /* byte pairs -> 4-bit values, bytes, pairs again -> lo | hi << 4 */
        __m256i t = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 6)), _mm256_set1_epi16(0x000F));
        t = _mm256_packus_epi16(t, t);
        t = _mm256_and_si256(_mm256_or_si256(t, _mm256_srli_epi16(t, 4)), _mm256_set1_epi16(0x00FF));
        t = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(t, t), order);
        _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(t));
        return;
    }
    /* any width: merge neighbours 8 -> 16 -> 32 -> 64-bit lanes (lo | hi << w), so each 64-bit lane
     * holds its 8 codes in its low 8 * bits bits; then gather the low bits bytes of each lane */
    const int w = bits;
    const long long m1 = (1LL << w) - 1, m2 = (1LL << 2 * w) - 1, m4 = (1LL << 4 * w) - 1;
    b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16((short)m1)),
                        _mm256_and_si256(_mm256_srli_epi16(b, 8 - w), _mm256_set1_epi16((short)(m1 << w))));
    b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)m2)),
                        _mm256_and_si256(_mm256_srli_epi32(b, 16 - 2 * w), _mm256_set1_epi32((int)(m2 << 2 * w))));
    b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi64x(m4)),
                        _mm256_and_si256(_mm256_srli_epi64(b, 32 - 4 * w), _mm256_set1_epi64x(m4 << 4 * w)));
    char idx[16];
    for (int k = 0; k < 16; k++)
        idx[k] = (char)(k < w ? k : k < 2 * w ? k - w + 8 : -1);
    /* bytes 0..w-1 and 8..8+w-1 of each 128-bit half -> its first 2w bytes */
    __m128i sh = _mm_loadu_si128((const __m128i *)idx);
    __m256i g = _mm256_shuffle_epi8(b, _mm256_broadcastsi128_si256(sh));
    if (spill) { /* 16-byte stores; the bytes past 4w are rewritten by the next group of 32 */
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(g));
        _mm_storeu_si128((__m128i *)(p + 2 * w), _mm256_extracti128_si256(g, 1));
    } else {
        uint8_t tmp[32];
        _mm256_storeu_si256((__m256i *)tmp, g);
        memcpy(p, tmp, (size_t)(2 * w));
        memcpy(p + 2 * w, tmp + 16, (size_t)(2 * w));
    }
}

/* Random numbers + levels of 16 elements x[0..16) (fields of the 4 splitmix64 outputs at *ctr,
 * which advances): the same float32 operations as uniforms_generic + levels_block. */
static inline __attribute__((always_inline)) AVX2 void levels16(const float *x, __m256i *ctr, __m256 vmult,
                                                                 __m256 vfs, __m256i *l)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i ubits = _mm256_set1_epi32(0x3F800040); /* 1 + 2^-17 */
    const __m256 onef = _mm256_set1_ps(1.0f);
    __m256i z = *ctr;
    *ctr = _mm256_add_epi64(z, _mm256_set1_epi64x((long long)(4 * GOLDEN)));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
    z = mul64c(z, UINT64_C(0xBF58476D1CE4E5B9));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
    z = mul64c(z, UINT64_C(0x94D049BB133111EB));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    /* the 16 little-endian 16-bit words of 4 outputs are the 16 elements' fields, in order */
    for (int h = 0; h < 2; h++) {
        __m128i zh = h ? _mm256_extracti128_si256(z, 1) : _mm256_castsi256_si128(z);
        /* u = (2r + 1) 2^-17, exactly: the float 1 + (2r + 1) 2^-17 built from bits, minus 1 */
        __m256i fb = _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepu16_epi32(zh), 7), ubits);
        __m256 u = _mm256_sub_ps(_mm256_castsi256_ps(fb), onef);
        __m256 v = _mm256_loadu_ps(x + 8 * h);
        __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_and_ps(v, absmask), vmult), u);
        t = _mm256_min_ps(t, vfs); /* t < s ? t : s, NaN -> s */
        /* negate where the sign bit of x is set (x = +0 gives 0, as does the scalar code) */
        l[h] = _mm256_sign_epi32(_mm256_cvttps_epi32(t), _mm256_castps_si256(v));
    }
}

/* Fused random numbers + levels of m elements (m a multiple of 32) starting at element 4 * quad0.
 * Writes the levels to lev (if not NULL), the packed codes to packed (if not NULL; bits 2, 4 or 8)
 * and x - level * step to ef (if not NULL; may be x). */
static inline __attribute__((always_inline)) AVX2 void quantize_avx2_body(
    const float *x, int64_t m, float mult, int32_t s, uint64_t seed, uint64_t quad0, int32_t *lev, int nt,
    uint8_t *packed, int bits, float *ef, float step, int64_t avail)
{
    uint64_t base = seed + (quad0 + 1) * GOLDEN;
    __m256i ctr = _mm256_set_epi64x((long long)(base + 3 * GOLDEN), (long long)(base + 2 * GOLDEN),
                                    (long long)(base + GOLDEN), (long long)base);
    const __m256i vs = _mm256_set1_epi32(s);
    const __m256 vmult = _mm256_set1_ps(mult);
    const __m256 vfs = _mm256_set1_ps((float)s);
    const __m256 vstep = _mm256_set1_ps(step);
    for (int64_t j = 0; j < m; j += 32) {
        __m256i l[4];
        levels16(x + j, &ctr, vmult, vfs, l);
        levels16(x + j + 16, &ctr, vmult, vfs, l + 2);
        if (ef) {
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_loadu_ps(x + j + 8 * k);
                _mm256_storeu_ps(ef + j + 8 * k, _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(l[k]), vstep)));
            }
        }
        if (lev) {
            for (int k = 0; k < 4; k++)
                store_i32(lev + j + 8 * k, l[k], nt);
        }
        if (packed) {
            for (int k = 0; k < 4; k++)
                l[k] = _mm256_add_epi32(l[k], vs);
            pack32(l, bits, packed + j / 8 * bits, j / 8 * bits + 2 * bits + 16 <= avail);
        }
    }
}

/* Specialisations with the flags known at compile time (the generic body is much slower). */
#define QSPEC(NAME, LEV, NT, PACKED, BITS, EF)                                                        \
    static AVX2 void NAME(const float *x, int64_t m, float mult, int32_t s, uint64_t seed, uint64_t quad0,   \
                          int32_t *lev, uint8_t *packed, float *ef, float step, int64_t avail)              \
    {                                                                                                       \
        (void)lev;                                                                                          \
        (void)packed;                                                                                       \
        (void)ef;                                                                                           \
        quantize_avx2_body(x, m, mult, s, seed, quad0, LEV, NT, PACKED, BITS, EF, step, avail);             \
    }
QSPEC(q_lev, lev, 0, NULL, 0, NULL)
QSPEC(q_lev_nt, lev, 1, NULL, 0, NULL)
QSPEC(q_lev_ef, lev, 0, NULL, 0, ef)
QSPEC(q_lev_nt_ef, lev, 1, NULL, 0, ef)
#define QSPEC_PACK(B)                                                                              \
    QSPEC(q_pack##B, NULL, 0, packed, B, NULL)                                                     \
    QSPEC(q_pack##B##_ef, NULL, 0, packed, B, ef)
QSPEC_PACK(2)
QSPEC_PACK(3)
QSPEC_PACK(4)
QSPEC_PACK(5)
QSPEC_PACK(6)
QSPEC_PACK(7)
QSPEC_PACK(8)

typedef void (*qfn)(const float *, int64_t, float, int32_t, uint64_t, uint64_t, int32_t *, uint8_t *, float *,
                    float, int64_t);

/* The specialisation for levels out (to_levels, nt) or packed codes of the given width, with or
 * without error feedback. */
static qfn pick_quantize_avx2(int to_levels, int nt, int bits, int ef)
{
    static const qfn pack[7][2] = {{q_pack2, q_pack2_ef}, {q_pack3, q_pack3_ef}, {q_pack4, q_pack4_ef},
                                   {q_pack5, q_pack5_ef}, {q_pack6, q_pack6_ef}, {q_pack7, q_pack7_ef},
                                   {q_pack8, q_pack8_ef}};
    if (to_levels)
        return nt ? (ef ? q_lev_nt_ef : q_lev_nt) : (ef ? q_lev_ef : q_lev);
    return pack[bits - 2][ef ? 1 : 0];
}

/* 32 codes of the given width at p (4 * bits bytes) -> levels (code - s), l[k] = elements 8k..8k+7.
 * The inverse of pack32's "any width" merge: split 64 -> 32 -> 16 -> 8-bit lanes. */
static inline __attribute__((always_inline)) AVX2 void unpack32(const uint8_t *p, int bits, __m256i vs,
                                                                 __m256i *l, int overread)
{
    __m256i b;
    if (bits == 8) {
        b = _mm256_loadu_si256((const __m256i *)p);
    } else {
        const int w = bits;
        const long long m1 = (1LL << w) - 1, m2 = (1LL << 2 * w) - 1, m4 = (1LL << 4 * w) - 1;
        if (overread) { /* 16-byte loads at p (codes 0..15) and p + 2w (codes 16..31) stay in bounds */
            b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                        _mm_loadu_si128((const __m128i *)(p + 2 * w)), 1);
        } else {
            uint8_t tmp[32] = {0};
            memcpy(tmp, p, (size_t)(2 * w));
            memcpy(tmp + 16, p + 2 * w, (size_t)(2 * w));
            b = _mm256_loadu_si256((const __m256i *)tmp);
        }
        char idx[16];
        for (int k = 0; k < 16; k++) /* w bytes per 64-bit lane */
            idx[k] = (char)(k < w ? k : (k >= 8 && k < 8 + w) ? k - 8 + w : -1);
        b = _mm256_shuffle_epi8(b, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)idx)));
        b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi64x(m4)),
                            _mm256_and_si256(_mm256_slli_epi64(b, 32 - 4 * w), _mm256_set1_epi64x(m4 << 32)));
        b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)m2)),
                            _mm256_and_si256(_mm256_slli_epi32(b, 16 - 2 * w), _mm256_set1_epi32((int)(m2 << 16))));
        b = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16((short)m1)),
                            _mm256_and_si256(_mm256_slli_epi16(b, 8 - w), _mm256_set1_epi16((short)(m1 << 8))));
    }
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    l[0] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), vs);
    l[1] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), vs);
    l[2] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), vs);
    l[3] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), vs);
}

/* m codes (a multiple of 32) at packed -> mode 0: levels to lev; 1: out = level * sw; 2: the same
 * with non-temporal stores; 3: out += level * sw. */
static inline __attribute__((always_inline)) AVX2 void unpack_avx2_body(const uint8_t *packed, int64_t m,
                                                                         int32_t s, int bits, float sw,
                                                                         float *out, int32_t *lev, int mode,
                                                                         int64_t avail)
{
    const __m256i vs = _mm256_set1_epi32(s);
    const __m256 vw = _mm256_set1_ps(sw);
    for (int64_t j = 0; j < m; j += 32) {
        __m256i l[4];
        unpack32(packed + j / 8 * bits, bits, vs, l, j / 8 * bits + 2 * bits + 16 <= avail);
        for (int k = 0; k < 4; k++) {
            if (mode == 0) {
                _mm256_storeu_si256((__m256i *)(lev + j + 8 * k), l[k]);
                continue;
            }
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(l[k]), vw);
            float *o = out + j + 8 * k;
            if (mode == 1)
                _mm256_storeu_ps(o, v);
            else if (mode == 2)
                _mm256_stream_ps(o, v);
            else
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
        }
    }
}

typedef void (*ufn)(const uint8_t *, int64_t, int32_t, float, float *, int32_t *, int64_t);

#define UFN(B, NAME, OUT, LEV, MODE)                                                                 \
    static AVX2 void u##B##_##NAME(const uint8_t *p, int64_t m, int32_t s, float sw, float *o, int32_t *l, \
                                   int64_t a)                                                       \
    {                                                                                              \
        (void)o;                                                                                   \
        (void)l;                                                                                   \
        unpack_avx2_body(p, m, s, B, sw, OUT, LEV, MODE, a);                                       \
    }
#define USPEC(B) UFN(B, lev, NULL, l, 0) UFN(B, st, o, NULL, 1) UFN(B, nt, o, NULL, 2) UFN(B, acc, o, NULL, 3)
USPEC(2)
USPEC(3)
USPEC(4)
USPEC(5)
USPEC(6)
USPEC(7)
USPEC(8)

static ufn pick_unpack_avx2(int bits, int mode)
{
    static const ufn fns[7][4] = {{u2_lev, u2_st, u2_nt, u2_acc}, {u3_lev, u3_st, u3_nt, u3_acc},
                                  {u4_lev, u4_st, u4_nt, u4_acc}, {u5_lev, u5_st, u5_nt, u5_acc},
                                  {u6_lev, u6_st, u6_nt, u6_acc}, {u7_lev, u7_st, u7_nt, u7_acc},
                                  {u8_lev, u8_st, u8_nt, u8_acc}};
    return fns[bits - 2][mode];
}

/* out[0..m) = (float)lev * sw, m a multiple of 8 */
static AVX2 void dequant_avx2(const int32_t *lev, int64_t m, float sw, float *out, int nt)
{
    const __m256 w = _mm256_set1_ps(sw);
    for (int64_t j = 0; j < m; j += 8) {
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(lev + j))), w);
        if (nt)
            _mm256_stream_ps(out + j, v);
        else
            _mm256_storeu_ps(out + j, v);
    }
}

static void nt_fence(int nt)
{
    if (nt)
        _mm_sfence();
}
#else
static int avx2_allowed = 1;
static int have_avx2(void) { return 0; }
static int use_nt(const void *p, int64_t bytes) { (void)p; (void)bytes; return 0; }
static void nt_fence(int nt) { (void)nt; }
#endif

/* ---------------------------------------------------------------------------------------------
 * Exported functions (return 0)
 * ------------------------------------------------------------------------------------------- */

/* Allow (1) or forbid (0) the AVX2 paths; returns 1 when they are in use afterwards. */
int cq_use_simd(int32_t enabled)
{
    avx2_allowed = enabled != 0;
    return have_avx2();
}

/* Levels of elements [i0 + from, i0 + m) of x (block-relative x, lev; i0 + from a multiple of 4). */
static void levels_generic(const float *x, int64_t i0, int64_t from, int64_t m, float mult, int32_t s,
                           uint64_t seed, int32_t *lev)
{
    float u[BLK];
    uniforms_generic(seed, (uint64_t)((i0 + from) >> 2), (m - from + 3) >> 2, u);
    levels_block(x + from, u, m - from, mult, s, lev + from);
}

/* Quantize x[0..n) into int32 levels in [-s, s]. ef != NULL: also ef[i] = x[i] - level_i * step. */
MULTIVERSION
int cq_quantize_levels(const float *x, int64_t n, float mult, int32_t s, uint64_t seed, int32_t *out,
                       float *ef, float step)
{
    const int avx2 = have_avx2();
    const int nt = avx2 && use_nt(out, n * 4);
#ifdef HAVE_AVX2_PATH
    qfn q = avx2 ? pick_quantize_avx2(1, nt, 0, ef != NULL) : NULL;
#endif
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
        int64_t m = n - i0 < BLK ? n - i0 : BLK;
        int64_t done = 0;
#ifdef HAVE_AVX2_PATH
        if (avx2) {
            done = m & ~(int64_t)31;
            q(x + i0, done, mult, s, seed, (uint64_t)(i0 >> 2), out + i0, NULL, ef ? ef + i0 : NULL, step, 0);
        }
#endif
        if (done < m) {
            levels_generic(x + i0, i0, done, m, mult, s, seed, out + i0);
            if (ef)
                ef_block(x + i0 + done, out + i0 + done, m - done, step, ef + i0 + done);
        }
    }
    nt_fence(nt);
    return 0;
}

/* Quantize x[0..n) and pack b-bit offset-binary codes into out[0..ceil(n*b/8)). 2 <= b <= 8 and
 * 1 <= s <= 2^(b-1) - 1 (checked by the caller). ef as in cq_quantize_levels. */
MULTIVERSION
int cq_quantize_pack(const float *x, int64_t n, float mult, int32_t s, int32_t bits, uint64_t seed,
                     uint8_t *out, float *ef, float step)
{
    if (bits < 2 || bits > 8)
        return -1; /* the caller checks widths (levels_for_bits); never index past the packers */
    int32_t lev[BLK];
    uint8_t tail[8];
    const int avx2 = have_avx2();
    const int fused = avx2; /* every width has a fused AVX2 packer */
    const int64_t nbytes = (n * bits + 7) / 8;
    (void)nbytes;
#ifdef HAVE_AVX2_PATH
    qfn q = avx2 ? pick_quantize_avx2(!fused, 0, bits, ef != NULL) : NULL;
#endif
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
        int64_t m = n - i0 < BLK ? n - i0 : BLK;
        uint8_t *p = out + (i0 / 8) * bits;
        int64_t done = 0;
#ifdef HAVE_AVX2_PATH
        if (avx2) {
            done = m & ~(int64_t)31;
            q(x + i0, done, mult, s, seed, (uint64_t)(i0 >> 2), lev, p, ef ? ef + i0 : NULL, step,
              nbytes - (i0 / 8) * bits);
        }
#endif
        if (done < m) {
            levels_generic(x + i0, i0, done, m, mult, s, seed, lev);
            if (ef)
                ef_block(x + i0 + done, lev + done, m - done, step, ef + i0 + done);
        }
        int64_t from = fused ? done : 0; /* lev[from..m) still to pack; from is a multiple of 8 */
        int64_t full = (m - from) / 8;
        PACK[bits](lev + from, full, s, p + from / 8 * bits);
        int64_t rest = m - from - 8 * full;
        if (rest) { /* last block only: pad the group with code 0 (zero bits), write ceil(rest*b/8) */
            int32_t *g = lev + from + 8 * full;
            for (int64_t j = rest; j < 8; j++)
                g[j] = -s;
            PACK[bits](g, 1, s, tail);
            memcpy(p + (from / 8 + full) * bits, tail, (size_t)((rest * bits + 7) / 8));
        }
    }
    return 0;
}

/* out[0..m) = / += (float)lev * sw with the best path */
static void dequant_any(const int32_t *lev, int64_t m, float sw, float *out, int accumulate, int avx2, int nt)
{
    int64_t done = 0;
#ifdef HAVE_AVX2_PATH
    if (avx2 && !accumulate) {
        done = m & ~(int64_t)7;
        dequant_avx2(lev, done, sw, out, nt);
    }
#else
    (void)avx2;
    (void)nt;
#endif
    dequant_block(lev + done, m - done, sw, out + done, accumulate);
}

MULTIVERSION
int cq_dequantize_levels(const int32_t *lev, int64_t n, float sw, float *out, int32_t accumulate)
{
    const int avx2 = have_avx2();
    const int nt = avx2 && !accumulate && use_nt(out, n * 4);
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
        int64_t m = n - i0 < BLK ? n - i0 : BLK;
        dequant_any(lev + i0, m, sw, out + i0, accumulate, avx2, nt);
    }
    nt_fence(nt);
    return 0;
}

/* Unpack n codes; out = / += (float)level * sw when out != NULL, else levels into lev_out. */
MULTIVERSION
int cq_unpack(const uint8_t *packed, int64_t n, int32_t s, int32_t bits, float sw, float *out,
              int32_t accumulate, int32_t *lev_out)
{
    if (bits < 2 || bits > 8)
        return -1;
    int32_t lev[BLK];
    uint8_t tail[8];
    const int avx2 = have_avx2();
    const int nt = out && avx2 && !accumulate && use_nt(out, n * 4);
    const int64_t nbytes = (n * bits + 7) / 8;
    (void)nbytes;
#ifdef HAVE_AVX2_PATH
    ufn u = avx2 ? pick_unpack_avx2(bits, out ? (accumulate ? 3 : nt ? 2 : 1) : 0) : NULL;
#endif
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
        int64_t m = n - i0 < BLK ? n - i0 : BLK;
        const uint8_t *p = packed + (i0 / 8) * bits;
        int64_t done = 0;
#ifdef HAVE_AVX2_PATH
        if (avx2) {
            done = m & ~(int64_t)31;
            u(p, done, s, sw, out ? out + i0 : NULL, out ? NULL : lev_out + i0, nbytes - (i0 / 8) * bits);
            if (done == m)
                continue;
        }
#endif
        int64_t full = (m - done) / 8; /* done is a multiple of 8: byte aligned */
        const uint8_t *q = p + done / 8 * bits;
        UNPACK[bits](q, full, s, lev);
        int64_t rest = m - done - 8 * full;
        if (rest) { /* read only the ceil(rest*b/8) bytes that exist */
            memset(tail, 0, sizeof tail);
            memcpy(tail, q + full * bits, (size_t)((rest * bits + 7) / 8));
            UNPACK[bits](tail, 1, s, lev + 8 * full);
        }
        if (out)
            dequant_block(lev, m - done, sw, out + i0 + done, accumulate);
        else
            memcpy(lev_out + i0 + done, lev, (size_t)(m - done) * sizeof(int32_t));
    }
    nt_fence(nt);
    return 0;
}

/* max |x| over x[0..n) as the float with the largest magnitude bits: NaN if any element is NaN
 * (NaN bit patterns sort above infinity), 0 for n == 0. */
MULTIVERSION
int cq_absmax(const float *x, int64_t n, float *out)
{
    uint32_t m[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; l++) {
            uint32_t b;
            memcpy(&b, x + i + l, 4);
            b &= 0x7FFFFFFFu;
            m[l] = b > m[l] ? b : m[l];
        }
    }
    uint32_t r = 0;
    for (int l = 0; l < 8; l++)
        r = m[l] > r ? m[l] : r;
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7FFFFFFFu;
        r = b > r ? b : r;
    }
    memcpy(out, &r, 4);
    return 0;
}
