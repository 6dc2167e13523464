/*
 * xxh3.h - self-contained, portable C99 implementation of the XXH3 64-bit
 * hash (XXH3_64bits_withSeed), written for kvgate from the XXH3 algorithm
 * specification.
 *
 *     static inline uint64_t kv_xxh3_64(const void *data, size_t len,
 *                                       uint64_t seed);
 *
 * Output is bit-exact with xxhash.xxh3_64_intdigest(data, seed) from the
 * Python `xxhash` package; the project's tests check this against that package.
 *
 * Scalar code only: little-endian loads via memcpy (byte-swapped on big-endian
 * hosts), 64x64->128 multiply via unsigned __int128 on gcc/clang with a
 * portable fallback.  No global mutable state; the seeded secret used for
 * inputs longer than 240 bytes is built on the stack.
 */
#ifndef KVGATE_XXH3_H
#define KVGATE_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- constants ---------------------------------------------------------- */

#define KV_XXH3_P32_1 0x9E3779B1U
#define KV_XXH3_P32_2 0x85EBCA77U
#define KV_XXH3_P32_3 0xC2B2AE3DU
#define KV_XXH3_P64_1 0x9E3779B185EBCA87ULL
#define KV_XXH3_P64_2 0xC2B2AE3D27D4EB4FULL
#define KV_XXH3_P64_3 0x165667B19E3779F9ULL
#define KV_XXH3_P64_4 0x85EBCA77C2B2AE63ULL
#define KV_XXH3_P64_5 0x27D4EB2F165667C5ULL
#define KV_XXH3_PMX_1 0x165667919E3779F9ULL
#define KV_XXH3_PMX_2 0x9FB21C651E98DF25ULL

#define KV_XXH3_SECRET_SIZE   192 /* default secret length                 */
#define KV_XXH3_STRIPE_LEN     64 /* bytes consumed per accumulate step     */
#define KV_XXH3_SECRET_RATE     8 /* secret advance per stripe              */
#define KV_XXH3_NB_ACC          8 /* 64-bit accumulator lanes               */
#define KV_XXH3_MID_START       3 /* secret offset for rounds 8.. (129-240) */
#define KV_XXH3_MID_LAST       17 /* last-16B secret offset from 136        */
#define KV_XXH3_LASTACC_START   7 /* last-stripe secret offset from end     */
#define KV_XXH3_MERGE_START    11 /* secret offset for accumulator merge    */

static const uint8_t kv_xxh3_ksecret[KV_XXH3_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---- primitives --------------------------------------------------------- */

static inline int kv_xxh3_is_le(void)
{
    const uint32_t one = 1;
    uint8_t b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static inline uint32_t kv_xxh3_bswap32(uint32_t x)
{
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) |
           ((x >> 8) & 0x0000ff00U) | ((x >> 24) & 0x000000ffU);
}

static inline uint64_t kv_xxh3_bswap64(uint64_t x)
{
    return ((uint64_t)kv_xxh3_bswap32((uint32_t)x) << 32) |
           (uint64_t)kv_xxh3_bswap32((uint32_t)(x >> 32));
}

static inline uint32_t kv_xxh3_read32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return kv_xxh3_is_le() ? v : kv_xxh3_bswap32(v);
}

static inline uint64_t kv_xxh3_read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return kv_xxh3_is_le() ? v : kv_xxh3_bswap64(v);
}

static inline void kv_xxh3_write64(uint8_t *p, uint64_t v)
{
    if (!kv_xxh3_is_le())
        v = kv_xxh3_bswap64(v);
    memcpy(p, &v, sizeof v);
}

static inline uint64_t kv_xxh3_rotl64(uint64_t x, unsigned r)
{
    return (x << r) | (x >> (64 - r)); /* r is always in 1..63 here */
}

/* 64x64 -> 128 multiply, returns low ^ high. */
static inline uint64_t kv_xxh3_mul128_fold64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__) && (defined(__GNUC__) || defined(__clang__))
    __extension__ typedef unsigned __int128 kv_u128;
    kv_u128 p = (kv_u128)a * (kv_u128)b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t a_lo = a & 0xFFFFFFFFULL, a_hi = a >> 32;
    uint64_t b_lo = b & 0xFFFFFFFFULL, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo;
    uint64_t hi_lo = a_hi * b_lo;
    uint64_t lo_hi = a_lo * b_hi;
    uint64_t hi_hi = a_hi * b_hi;
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t kv_xxh3_xxh64_avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= KV_XXH3_P64_2;
    h ^= h >> 29;
    h *= KV_XXH3_P64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t kv_xxh3_avalanche(uint64_t h)
{
    h ^= h >> 37;
    h *= KV_XXH3_PMX_1;
    h ^= h >> 32;
    return h;
}

static inline uint64_t kv_xxh3_rrmxmx(uint64_t h, uint64_t len)
{
    h ^= kv_xxh3_rotl64(h, 49) ^ kv_xxh3_rotl64(h, 24);
    h *= KV_XXH3_PMX_2;
    h ^= (h >> 35) + len;
    h *= KV_XXH3_PMX_2;
    h ^= h >> 28;
    return h;
}

/* ---- short inputs (0..16) ----------------------------------------------- */

static inline uint64_t kv_xxh3_len_0(const uint8_t *sec, uint64_t seed)
{
    return kv_xxh3_xxh64_avalanche(seed ^ kv_xxh3_read64(sec + 56) ^
                                   kv_xxh3_read64(sec + 64));
}

static inline uint64_t kv_xxh3_len_1to3(const uint8_t *in, size_t len,
                                        const uint8_t *sec, uint64_t seed)
{
    uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
    uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | ((uint32_t)len << 8);
    uint64_t bitflip =
        (uint64_t)(kv_xxh3_read32(sec) ^ kv_xxh3_read32(sec + 4)) + seed;
    return kv_xxh3_xxh64_avalanche((uint64_t)combined ^ bitflip);
}

static inline uint64_t kv_xxh3_len_4to8(const uint8_t *in, size_t len,
                                        const uint8_t *sec, uint64_t seed)
{
    uint64_t in1, in2, bitflip, keyed;
    seed ^= (uint64_t)kv_xxh3_bswap32((uint32_t)seed) << 32;
    in1 = kv_xxh3_read32(in);
    in2 = kv_xxh3_read32(in + len - 4);
    bitflip = (kv_xxh3_read64(sec + 8) ^ kv_xxh3_read64(sec + 16)) - seed;
    keyed = (in2 + (in1 << 32)) ^ bitflip;
    return kv_xxh3_rrmxmx(keyed, (uint64_t)len);
}

static inline uint64_t kv_xxh3_len_9to16(const uint8_t *in, size_t len,
                                         const uint8_t *sec, uint64_t seed)
{
    uint64_t bf1 = (kv_xxh3_read64(sec + 24) ^ kv_xxh3_read64(sec + 32)) + seed;
    uint64_t bf2 = (kv_xxh3_read64(sec + 40) ^ kv_xxh3_read64(sec + 48)) - seed;
    uint64_t lo = kv_xxh3_read64(in) ^ bf1;
    uint64_t hi = kv_xxh3_read64(in + len - 8) ^ bf2;
    uint64_t acc = (uint64_t)len + kv_xxh3_bswap64(lo) + hi +
                   kv_xxh3_mul128_fold64(lo, hi);
    return kv_xxh3_avalanche(acc);
}

/* ---- medium inputs (17..240) -------------------------------------------- */

static inline uint64_t kv_xxh3_mix16(const uint8_t *in, const uint8_t *sec,
                                     uint64_t seed)
{
    uint64_t lo = kv_xxh3_read64(in), hi = kv_xxh3_read64(in + 8);
    return kv_xxh3_mul128_fold64(lo ^ (kv_xxh3_read64(sec) + seed),
                                 hi ^ (kv_xxh3_read64(sec + 8) - seed));
}

static inline uint64_t kv_xxh3_len_17to128(const uint8_t *in, size_t len,
                                           const uint8_t *sec, uint64_t seed)
{
    uint64_t acc = (uint64_t)len * KV_XXH3_P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += kv_xxh3_mix16(in + 48, sec + 96, seed);
                acc += kv_xxh3_mix16(in + len - 64, sec + 112, seed);
            }
            acc += kv_xxh3_mix16(in + 32, sec + 64, seed);
            acc += kv_xxh3_mix16(in + len - 48, sec + 80, seed);
        }
        acc += kv_xxh3_mix16(in + 16, sec + 32, seed);
        acc += kv_xxh3_mix16(in + len - 32, sec + 48, seed);
    }
    acc += kv_xxh3_mix16(in, sec, seed);
    acc += kv_xxh3_mix16(in + len - 16, sec + 16, seed);
    return kv_xxh3_avalanche(acc);
}

static inline uint64_t kv_xxh3_len_129to240(const uint8_t *in, size_t len,
                                            const uint8_t *sec, uint64_t seed)
{
    uint64_t acc = (uint64_t)len * KV_XXH3_P64_1;
    size_t rounds = len / 16, i;
    for (i = 0; i < 8; i++)
        acc += kv_xxh3_mix16(in + 16 * i, sec + 16 * i, seed);
    acc = kv_xxh3_avalanche(acc);
    for (i = 8; i < rounds; i++)
        acc += kv_xxh3_mix16(in + 16 * i, sec + 16 * (i - 8) + KV_XXH3_MID_START,
                             seed);
    acc += kv_xxh3_mix16(in + len - 16, sec + 136 - KV_XXH3_MID_LAST, seed);
    return kv_xxh3_avalanche(acc);
}

/* ---- long inputs (> 240) ------------------------------------------------ */

static inline void kv_xxh3_accumulate_512(uint64_t *acc, const uint8_t *in,
                                          const uint8_t *sec)
{
    int i;
    for (i = 0; i < KV_XXH3_NB_ACC; i++) {
        uint64_t v = kv_xxh3_read64(in + 8 * i);
        uint64_t k = v ^ kv_xxh3_read64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static inline void kv_xxh3_scramble(uint64_t *acc, const uint8_t *sec)
{
    int i;
    for (i = 0; i < KV_XXH3_NB_ACC; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= kv_xxh3_read64(sec + 8 * i);
        a *= KV_XXH3_P32_1;
        acc[i] = a;
    }
}

static inline uint64_t kv_xxh3_hash_long(const uint8_t *in, size_t len,
                                         const uint8_t *sec)
{
    enum {
        STRIPES_PER_BLOCK =
            (KV_XXH3_SECRET_SIZE - KV_XXH3_STRIPE_LEN) / KV_XXH3_SECRET_RATE,
        BLOCK_LEN = KV_XXH3_STRIPE_LEN * STRIPES_PER_BLOCK
    };
    uint64_t acc[KV_XXH3_NB_ACC] = {
        KV_XXH3_P32_3, KV_XXH3_P64_1, KV_XXH3_P64_2, KV_XXH3_P64_3,
        KV_XXH3_P64_4, KV_XXH3_P32_2, KV_XXH3_P64_5, KV_XXH3_P32_1};
    size_t nb_blocks = (len - 1) / BLOCK_LEN;
    size_t n, s, nb_stripes;
    uint64_t result;
    int i;

    for (n = 0; n < nb_blocks; n++) {
        const uint8_t *blk = in + n * BLOCK_LEN;
        for (s = 0; s < STRIPES_PER_BLOCK; s++)
            kv_xxh3_accumulate_512(acc, blk + s * KV_XXH3_STRIPE_LEN,
                                   sec + s * KV_XXH3_SECRET_RATE);
        kv_xxh3_scramble(acc, sec + KV_XXH3_SECRET_SIZE - KV_XXH3_STRIPE_LEN);
    }

    /* last partial block, then the final (possibly overlapping) stripe */
    nb_stripes = ((len - 1) - BLOCK_LEN * nb_blocks) / KV_XXH3_STRIPE_LEN;
    for (s = 0; s < nb_stripes; s++)
        kv_xxh3_accumulate_512(acc,
                               in + nb_blocks * BLOCK_LEN + s * KV_XXH3_STRIPE_LEN,
                               sec + s * KV_XXH3_SECRET_RATE);
    kv_xxh3_accumulate_512(acc, in + len - KV_XXH3_STRIPE_LEN,
                           sec + KV_XXH3_SECRET_SIZE - KV_XXH3_STRIPE_LEN -
                               KV_XXH3_LASTACC_START);

    /* merge accumulators */
    result = (uint64_t)len * KV_XXH3_P64_1;
    for (i = 0; i < 4; i++) {
        const uint8_t *k = sec + KV_XXH3_MERGE_START + 16 * i;
        result += kv_xxh3_mul128_fold64(acc[2 * i] ^ kv_xxh3_read64(k),
                                        acc[2 * i + 1] ^ kv_xxh3_read64(k + 8));
    }
    return kv_xxh3_avalanche(result);
}

/* ---- public entry point ------------------------------------------------- */

static inline uint64_t kv_xxh3_64(const void *data, size_t len, uint64_t seed)
{
    const uint8_t *in = (const uint8_t *)data;
    const uint8_t *ks = kv_xxh3_ksecret;

    if (len <= 16) {
        if (len > 8)
            return kv_xxh3_len_9to16(in, len, ks, seed);
        if (len >= 4)
            return kv_xxh3_len_4to8(in, len, ks, seed);
        if (len > 0)
            return kv_xxh3_len_1to3(in, len, ks, seed);
        return kv_xxh3_len_0(ks, seed);
    }
    if (len <= 128)
        return kv_xxh3_len_17to128(in, len, ks, seed);
    if (len <= 240)
        return kv_xxh3_len_129to240(in, len, ks, seed);

    if (seed == 0)
        return kv_xxh3_hash_long(in, len, ks);
    {
        /* seeded long input: derive a custom secret on the stack */
        uint8_t custom[KV_XXH3_SECRET_SIZE];
        int i;
        for (i = 0; i < KV_XXH3_SECRET_SIZE / 16; i++) {
            kv_xxh3_write64(custom + 16 * i,
                            kv_xxh3_read64(ks + 16 * i) + seed);
            kv_xxh3_write64(custom + 16 * i + 8,
                            kv_xxh3_read64(ks + 16 * i + 8) - seed);
        }
        return kv_xxh3_hash_long(in, len, custom);
    }
}

#endif /* KVGATE_XXH3_H */
