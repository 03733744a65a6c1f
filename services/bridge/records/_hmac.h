/* HMAC-SHA-256 (RFC 2104, FIPS 180-4) for the hash transform of the compiled row builder.

Python's hmac (OpenSSL underneath) is the reference, masking.py's hash transform the
Python path; tests/unit/test_rowjson.py holds this to both byte for byte (RFC 4231 vectors
and random texts). It exists because the hash transform runs per masked column per row:
through Python, a value costs a handful of calls and an OpenSSL context copy, several
times the compression itself. Here the key's inner and outer pad blocks are compressed
once per plan, so a value shorter than 56 bytes costs two compressions.
*/
#ifndef SLOTBRIDGE_HMAC_H
#define SLOTBRIDGE_HMAC_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t h[8];
    uint64_t len; /* bytes hashed so far */
    unsigned char buf[64];
    size_t n; /* bytes waiting in buf */
} Sha256;

static const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define SHA256_ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = SHA256_ROTR(w[i - 15], 7) ^ SHA256_ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = SHA256_ROTR(w[i - 2], 17) ^ SHA256_ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (SHA256_ROTR(e, 6) ^ SHA256_ROTR(e, 11) ^ SHA256_ROTR(e, 25)) +
                      ((e & f) ^ (~e & g)) + SHA256_K[i] + w[i];
        uint32_t t2 = (SHA256_ROTR(a, 2) ^ SHA256_ROTR(a, 13) ^ SHA256_ROTR(a, 22)) +
                      ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define SHA256_HAS_NI 1

/* One block with the x86 SHA extensions (SHA-NI: Intel since Goldmont/Ice Lake, AMD since
   Zen), about ten times the portable block's speed: the state is kept as the instructions
   want it (ABEF and CDGH), each sha256rnds2 does two rounds, and the message schedule is
   sha256msg1/msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void sha256_block_ni(uint32_t h[8],
                                                                        const unsigned char *p) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1); /* CDAB */
    __m128i state1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8);  /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);       /* CDGH */
    const __m128i abef = state0, cdgh = state1;
    __m128i msg[4];
    for (int i = 0; i < 16; i++) {
        __m128i w;
        if (i < 4) {
            w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
        } else {
            /* W[t-16] + s0(W[t-15]), + W[t-7], then + s1(W[t-2]) */
            w = _mm_sha256msg1_epu32(msg[i & 3], msg[(i + 1) & 3]);
            w = _mm_add_epi32(w, _mm_alignr_epi8(msg[(i + 3) & 3], msg[(i + 2) & 3], 4));
            w = _mm_sha256msg2_epu32(w, msg[(i + 3) & 3]);
        }
        msg[i & 3] = w;
        __m128i k = _mm_add_epi32(w, _mm_loadu_si128((const __m128i *)&SHA256_K[4 * i]));
        state1 = _mm_sha256rnds2_epu32(state1, state0, k);
        state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(k, 0x0E));
    }
    state0 = _mm_add_epi32(state0, abef);
    state1 = _mm_add_epi32(state1, cdgh);
    tmp = _mm_shuffle_epi32(state0, 0x1B);          /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);       /* DCHG */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0);    /* DCBA */
    state1 = _mm_alignr_epi8(state1, tmp, 8);       /* HGFE */
    _mm_storeu_si128((__m128i *)&h[0], state0);
    _mm_storeu_si128((__m128i *)&h[4], state1);
}

/* Whether this CPU has the SHA extensions and the SSE levels their code uses. */
static int sha256_ni_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1))
        return 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA);
}
#else
#define SHA256_HAS_NI 0
#endif

/* The block function in use: the portable one until sha256_accelerate() picks another. */
static void (*sha256_compress)(uint32_t h[8], const unsigned char *p) = sha256_block;

/* Use the SHA extensions where the CPU has them (on), or the portable code (off, for the
   tests that hold both to the reference); returns whether the extensions are in use. */
static int sha256_accelerate(int on) {
#if SHA256_HAS_NI
    if (on && sha256_ni_supported()) {
        sha256_compress = sha256_block_ni;
        return 1;
    }
#endif
    sha256_compress = sha256_block;
    return 0;
}

static void sha256_init(Sha256 *s) {
    static const uint32_t IV[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, IV, sizeof(IV));
    s->len = 0;
    s->n = 0;
}

static void sha256_update(Sha256 *s, const unsigned char *p, size_t n) {
    s->len += n;
    if (s->n > 0) {
        size_t take = 64 - s->n < n ? 64 - s->n : n;
        memcpy(s->buf + s->n, p, take);
        s->n += take;
        p += take;
        n -= take;
        if (s->n < 64)
            return;
        sha256_compress(s->h, s->buf);
        s->n = 0;
    }
    for (; n >= 64; p += 64, n -= 64)
        sha256_compress(s->h, p);
    memcpy(s->buf, p, n);
    s->n = n;
}

static void sha256_final(Sha256 *s, unsigned char out[32]) {
    uint64_t bits = s->len * 8;
    size_t n = s->n;
    s->buf[n++] = 0x80;
    if (n > 56) {
        memset(s->buf + n, 0, 64 - n);
        sha256_compress(s->h, s->buf);
        n = 0;
    }
    memset(s->buf + n, 0, 56 - n);
    for (int i = 0; i < 8; i++)
        s->buf[56 + i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_compress(s->h, s->buf);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)s->h[i];
    }
}

/* A key's HMAC-SHA-256 pads, each already compressed: the state every value starts from. */
typedef struct {
    Sha256 inner, outer;
} HmacKey;

static void hmac_key(HmacKey *k, const unsigned char *key, size_t n) {
    unsigned char block[64] = {0}, pad[64];
    if (n > 64) { /* a long key is its hash (RFC 2104) */
        Sha256 s;
        sha256_init(&s);
        sha256_update(&s, key, n);
        sha256_final(&s, block);
    } else {
        memcpy(block, key, n);
    }
    for (int i = 0; i < 64; i++)
        pad[i] = block[i] ^ 0x36;
    sha256_init(&k->inner);
    sha256_update(&k->inner, pad, 64);
    for (int i = 0; i < 64; i++)
        pad[i] = block[i] ^ 0x5c;
    sha256_init(&k->outer);
    sha256_update(&k->outer, pad, 64);
}

static void hmac_sha256(const HmacKey *k, const unsigned char *msg, size_t n,
                        unsigned char out[32]) {
    Sha256 s = k->inner;
    unsigned char inner[32];
    sha256_update(&s, msg, n);
    sha256_final(&s, inner);
    s = k->outer;
    sha256_update(&s, inner, 32);
    sha256_final(&s, out);
}

#endif
