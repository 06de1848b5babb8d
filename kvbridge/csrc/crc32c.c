/* crc32c (Castagnoli, as google-crc32c and iSCSI): a store's per-block checksums, computed with the GIL
 * released and without a Python object per piece.
 *
 *   crc32c(addresses, lengths, parts, *, fold=True)  -> the crc32c of each run of `parts` pieces
 *
 * Where the CPU has no SSE4.2, HAS_CRC32C is 0 and the stores check through google-crc32c instead.
 */
#include "core.h"

#include <string.h>

int crc_ready; /* 1: the CPU has SSE4.2 and crc_init set the tables up */

/* crc32c (Castagnoli, as google-crc32c and iSCSI) with the SSE4.2 instruction, three lanes at once: one
 * lane waits 3 cycles per 8 bytes on the instruction's latency, three interleaved lanes keep it busy
 * (~3x).  Lanes b and c start from 0 and are joined by linearity: crc(s, A B) = shift(crc(s, A)) ^ crc(0,
 * B), where shift moves a state over CRC_LANE zero bytes, a linear map applied by four table lookups.
 *
 * Where the CPU also has VPCLMULQDQ (carry-less multiply on 256-bit registers: AMD Zen 3, Intel Ice Lake
 * and later), a round of CRC_ROUND bytes runs two engines at once (crc_round): the first half is folded
 * by carry-less multiplies, the second half goes through the crc32 instruction in four lanes.  They use
 * different execution units, so the round costs about what either half would alone (bench case: fs,
 * load at 128 MiB, where every block is checked; tests/test_core.py checks one path against the other). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CRC_LANE 2048                  /* bytes per lane per round */
#define CRC_FOLDED (4 * CRC_LANE)      /* bytes a round folds by carry-less multiplies */
#define CRC_ROUND (CRC_FOLDED + 4 * CRC_LANE)

static uint32_t crc_shift_table[4][256];
int crc_fold;  /* 1: it also has AVX2, PCLMULQDQ and VPCLMULQDQ (crc_round) */
/* Fold constants (see crc_init): x^(8d +- 32) mod P for a distance of d = 128 and 16 bytes, each as a
 * pair (the low and high 64 bits of a 128-bit lane move by different powers). */
static uint64_t crc_k128[2], crc_k16[2];

__attribute__((target("sse4.2"))) static uint32_t crc_lane(uint32_t s, const unsigned char *p, size_t n) {
    uint64_t c = s;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* unaligned load */
        c = _mm_crc32_u64(c, w);
    }
    s = (uint32_t)c;
    for (; n; n--) s = _mm_crc32_u8(s, *p++);
    return s;
}

static uint32_t crc_shift(uint32_t s) {
    return crc_shift_table[0][s & 255] ^ crc_shift_table[1][(s >> 8) & 255] ^ crc_shift_table[2][(s >> 16) & 255] ^
           crc_shift_table[3][s >> 24];
}

static const unsigned char crc_zeros[CRC_LANE];

/* x^n mod P in the bit-reflected form a carry-less multiply wants (one bit up: the product of two
 * reflected 64-bit numbers lands one bit low): the state for x^(n mod 8) run over n / 8 zero bytes. */
static uint64_t crc_xpow(int n) {
    return (uint64_t)crc_lane(1u << (31 - n % 8), crc_zeros, (size_t)(n / 8)) << 1;
}

/* The shift table: column j is the state 1 << j run over CRC_LANE zero bytes; entry [k][b] is the xor
 * of the columns of b's bits at byte k.  Then the fold constants, where the CPU can fold. */
void crc_init(void) {
    if (!__builtin_cpu_supports("sse4.2")) return;
    uint32_t column[32];
    for (int j = 0; j < 32; j++) column[j] = crc_lane(1u << j, crc_zeros, CRC_LANE);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t x = 0;
            for (int j = 0; j < 8; j++)
                if (b >> j & 1) x ^= column[8 * k + j];
            crc_shift_table[k][b] = x;
        }
    crc_k128[0] = crc_xpow(8 * 128 + 32), crc_k128[1] = crc_xpow(8 * 128 - 32);
    crc_k16[0] = crc_xpow(8 * 16 + 32), crc_k16[1] = crc_xpow(8 * 16 - 32);
    crc_fold = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("pclmul") &&
               __builtin_cpu_supports("vpclmulqdq");
    crc_ready = 1;
}

/* A 128-bit lane of message moved d bytes on (its constants for d), ready to be xored into the lane d
 * bytes later: the crc of the message is unchanged.  Two of them in each 256-bit register. */
__attribute__((target("avx2,vpclmulqdq"))) static __m256i crc_fold256(__m256i x, __m256i k) {
    return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11));
}

__attribute__((target("pclmul"))) static __m128i crc_fold128(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* One round of CRC_ROUND bytes from state s.  The first CRC_FOLDED bytes sit in eight 128-bit lanes (four
 * registers) that each fold 128 bytes on per step; the state is xored into the first (crc(s, M) is
 * crc(0, M) with s xored into M's first four bytes).  Meanwhile four crc32 lanes run over the rest.
 * The eight lanes then fold into one, whose crc from 0 is the folded part's; the crc32 lanes join it
 * by shifts, as in crc_update. */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2"))) static uint32_t crc_round(uint32_t s, const unsigned char *p) {
    const __m256i k = _mm256_set_epi64x((long long)crc_k128[1], (long long)crc_k128[0], (long long)crc_k128[1],
                                        (long long)crc_k128[0]);
    __m256i y[4];
    for (int j = 0; j < 4; j++) y[j] = _mm256_loadu_si256((const __m256i *)p + j);
    y[0] = _mm256_xor_si256(y[0], _mm256_castsi128_si256(_mm_cvtsi32_si128((int)s)));
    const unsigned char *q = p + CRC_FOLDED;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i < CRC_LANE; i += 32) {
        if (i + 32 < CRC_LANE) { /* 128 bytes folded per 32 bytes of each crc32 lane */
            const __m256i *next = (const __m256i *)(p + 128 + 4 * i);
            for (int j = 0; j < 4; j++) y[j] = _mm256_xor_si256(crc_fold256(y[j], k), _mm256_loadu_si256(next + j));
        }
        for (size_t o = i; o < i + 32; o += 8) {
            uint64_t wa, wb, wc, wd;
            memcpy(&wa, q + o, 8);
            memcpy(&wb, q + CRC_LANE + o, 8);
            memcpy(&wc, q + 2 * CRC_LANE + o, 8);
            memcpy(&wd, q + 3 * CRC_LANE + o, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            c = _mm_crc32_u64(c, wc);
            d = _mm_crc32_u64(d, wd);
        }
    }
    const __m128i k16 = _mm_set_epi64x((long long)crc_k16[1], (long long)crc_k16[0]);
    __m128i x = _mm256_castsi256_si128(y[0]);
    x = _mm_xor_si128(crc_fold128(x, k16), _mm256_extracti128_si256(y[0], 1));
    for (int j = 1; j < 4; j++) {
        x = _mm_xor_si128(crc_fold128(x, k16), _mm256_castsi256_si128(y[j]));
        x = _mm_xor_si128(crc_fold128(x, k16), _mm256_extracti128_si256(y[j], 1));
    }
    uint64_t folded = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    folded = _mm_crc32_u64(folded, (uint64_t)_mm_extract_epi64(x, 1));
    s = crc_shift((uint32_t)folded) ^ (uint32_t)a;
    s = crc_shift(s) ^ (uint32_t)b;
    s = crc_shift(s) ^ (uint32_t)c;
    return crc_shift(s) ^ (uint32_t)d;
}

/* `fold` 0: the three crc32 lanes only, even where crc_round could run (a test checks one against the other) */
__attribute__((target("sse4.2"))) static uint32_t crc_update(uint32_t s, const unsigned char *p, size_t n, int fold) {
    if (fold && crc_fold)
        for (; n >= CRC_ROUND; n -= CRC_ROUND, p += CRC_ROUND) s = crc_round(s, p);
    for (; n >= 3 * CRC_LANE; n -= 3 * CRC_LANE, p += 3 * CRC_LANE) {
        uint64_t a = s, b = 0, c = 0;
        for (size_t i = 0; i < CRC_LANE; i += 8) {
            uint64_t wa, wb, wc;
            memcpy(&wa, p + i, 8);
            memcpy(&wb, p + CRC_LANE + i, 8);
            memcpy(&wc, p + 2 * CRC_LANE + i, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            c = _mm_crc32_u64(c, wc);
        }
        s = crc_shift(crc_shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
    }
    return crc_lane(s, p, n);
}
#else /* no SSE4.2 here: crc32c() refuses (HAS_CRC32C is 0) and fs checks through google-crc32c */
void crc_init(void) {}
int crc_fold;
static uint32_t crc_update(uint32_t s, const unsigned char *p, size_t n, int fold) { return s; }
#endif

/* crc32c(addresses, lengths, parts, *, fold=True) -> bytes: the crc32c of each run of `parts` consecutive
 * pieces (a block's pieces, in order), as little-endian uint32s; the GIL released. */
PyObject *py_crc32c(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"addresses", "lengths", "parts", "fold", NULL};
    PyObject *ao, *no;
    Py_ssize_t parts;
    int fold = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOn|$p", kwlist, &ao, &no, &parts, &fold)) return NULL;
    if (!crc_ready) return PyErr_Format(PyExc_RuntimeError, "crc32c: this CPU has no SSE4.2 (use google-crc32c)");
    descs d;
    if (descs_parse(&d, ao, ao, no, NULL) < 0) return NULL;
    if (parts <= 0 || d.n % parts) {
        descs_release(&d);
        return PyErr_Format(PyExc_ValueError, "crc32c: %zd pieces are not runs of %zd", d.n, parts);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * (d.n / parts));
    if (!out) {
        descs_release(&d);
        return NULL;
    }
    unsigned char *sums = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < d.n / parts; g++) {
        uint32_t s = 0xFFFFFFFFu; /* crc32c's initial state; the result is its complement */
        for (Py_ssize_t i = g * parts; i < (g + 1) * parts; i++)
            s = crc_update(s, (const unsigned char *)(uintptr_t)vec_u64(&d.local, i), vec_u64(&d.lengths, i), fold);
        s = ~s;
        for (int b = 0; b < 4; b++) sums[4 * g + b] = (unsigned char)(s >> (8 * b));
    }
    Py_END_ALLOW_THREADS
    descs_release(&d);
    return out;
}

/* crc32c state s carried over descriptors [j, k) of d. */
uint32_t descs_crc_update(uint32_t s, const descs *d, Py_ssize_t j, Py_ssize_t k) {
    for (; j < k; j++) s = crc_update(s, (const unsigned char *)(uintptr_t)vec_u64(&d->local, j), vec_u64(&d->lengths, j), 1);
    return s;
}

/* The crc32c of descriptors [i, i + n), as crc32c() gives it. */
uint32_t descs_crc(const descs *d, Py_ssize_t i, Py_ssize_t n) {
    return ~descs_crc_update(0xFFFFFFFFu, d, i, i + n);
}
