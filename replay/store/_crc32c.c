/* CRC-32C (Castagnoli, reflected, initial value and final XOR 0xFFFFFFFF: the checksum of iSCSI, ext4, Zarr's
 * crc32c codec and google-crc32c) of many spans of memory in one call, the GIL released.
 *
 * Four implementations, chosen at run time by what the CPU reports (cpuid, and the OS's saved register state):
 *   "software"  slicing-by-8 tables, any CPU;
 *   "sse4.2"    x86-64 with SSE4.2 and PCLMULQDQ: eight 128-bit accumulators folded with carry-less multiplies,
 *               the CRC32 instruction for the reduction and the last bytes;
 *   "avx2"      x86-64 with AVX2 and VPCLMULQDQ (and the OS saving the YMM registers; AMD's Zen 3 and 4, Intel's
 *               chips from Ice Lake on): the same folding, eight 256-bit accumulators, then the "sse4.2" path's end;
 *   "avx512"    x86-64 with AVX-512F and VPCLMULQDQ (and the OS saving the ZMM registers): the same folding,
 *               four 512-bit accumulators, then the "sse4.2" path's end.
 * All four give the same values (tests/store/test_crc32c_spans.py runs each against google-crc32c).
 *
 * Folding, in the reflected bit order: a 128-bit block whose first 8 bytes are H and last 8 bytes L is worth,
 * D bits further on, clmul(H, x^(D+31) mod P) xor clmul(L, x^(D-33) mod P) (the 33 is the clmul of reflected
 * operands landing one bit below the 128-bit block, plus the CRC's 32-bit shift).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CRC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define PREFETCH 16384   /* bytes read ahead: more of the memory in flight than the hardware prefetcher keeps */
#define POLY 0x82F63B78u   /* x^32 + x^28 + ... + 1, reflected, without x^32 */

enum { SOFTWARE, SSE42, AVX2, AVX512, N_PATHS };
static const char *const PATH_NAMES[N_PATHS] = {"software", "sse4.2", "avx2", "avx512"};
static int available[N_PATHS];
static int best = SOFTWARE;

static uint32_t table[8][256];

static void make_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (POLY & (0u - (c & 1)));
        table[0][i] = c;
    }
    for (int s = 1; s < 8; s++)
        for (int i = 0; i < 256; i++)
            table[s][i] = (table[s - 1][i] >> 8) ^ table[0][table[s - 1][i] & 0xff];
}

/* The CRC register (not inverted) after `n` more bytes. */
static uint32_t crc_software(uint32_t crc, const uint8_t *p, size_t n)
{
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        crc = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^ table[4][lo >> 24]
              ^ table[3][p[4]] ^ table[2][p[5]] ^ table[1][p[6]] ^ table[0][p[7]];
    }
    for (; n; p++, n--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xff];
    return crc;
}

/* x^n mod P, as a reflected CRC register. */
static uint32_t x_pow_mod(unsigned n)
{
    uint32_t v = 0x80000000u;
    while (n--)
        v = (v >> 1) ^ (POLY & (0u - (v & 1)));
    return v;
}

#ifdef CRC_X86
static uint64_t fold128[2], fold256[2], fold512[2], fold1024[2], fold2048[2];   /* {x^(D+31), x^(D-33)} mod P */

static void make_constants(void)
{
    unsigned distances[5] = {128, 256, 512, 1024, 2048};
    uint64_t *out[5] = {fold128, fold256, fold512, fold1024, fold2048};
    for (int i = 0; i < 5; i++) {
        out[i][0] = x_pow_mod(distances[i] + 31);
        out[i][1] = x_pow_mod(distances[i] - 33);
    }
}

__attribute__((target("sse4.2,pclmul")))
static inline __m128i fold(__m128i x, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

__attribute__((target("sse4.2")))
static uint32_t crc_bytes_sse42(uint32_t crc, const uint8_t *p, size_t n)
{
    uint64_t c = crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    for (; n; p++, n--)
        c = _mm_crc32_u8((uint32_t)c, *p);
    return (uint32_t)c;
}

/* The register after p[0:n], from the 128-bit accumulator `x` of the message before it (`bare`: x holds only the
 * register, no block was loaded): the 16-byte blocks folded into x, x reduced with the CRC32 instruction, which
 * then takes the last n % 16 bytes. */
__attribute__((target("sse4.2,pclmul")))
static uint32_t finish_sse42(__m128i x, const uint8_t *p, size_t n, int bare)
{
    if (bare) {
        if (n < 16)
            return crc_bytes_sse42((uint32_t)_mm_cvtsi128_si32(x), p, n);
        x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)p));
        p += 16, n -= 16;
    }
    __m128i k = _mm_loadu_si128((const __m128i *)fold128);
    for (; n >= 16; p += 16, n -= 16)
        x = fold(x, k, _mm_loadu_si128((const __m128i *)p));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
    return crc_bytes_sse42((uint32_t)c, p, n);
}

__attribute__((target("sse4.2,pclmul")))
static uint32_t crc_sse42(uint32_t crc, const uint8_t *p, size_t n)
{
    if (n < 128)
        return finish_sse42(_mm_cvtsi32_si128((int)crc), p, n, 1);
    __m128i x[8];
    for (int i = 0; i < 8; i++)
        x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)crc));
    __m128i k = _mm_loadu_si128((const __m128i *)fold1024);
    for (p += 128, n -= 128; n >= 128; p += 128, n -= 128)
        for (int i = 0; i < 8; i++)
            x[i] = fold(x[i], k, _mm_loadu_si128((const __m128i *)(p + 16 * i)));
    k = _mm_loadu_si128((const __m128i *)fold128);
    for (int i = 1; i < 8; i++)
        x[i] = fold(x[i - 1], k, x[i]);
    return finish_sse42(x[7], p, n, 0);
}

__attribute__((target("avx2,vpclmulqdq,sse4.2,pclmul")))
static inline __m256i fold256x2(__m256i x, __m256i k, __m256i next)
{
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)),
                            next);
}

__attribute__((target("avx2,vpclmulqdq,sse4.2,pclmul")))
static uint32_t crc_avx2(uint32_t crc, const uint8_t *p, size_t n)
{
    if (n < 256)
        return crc_sse42(crc, p, n);
    __m256i x[8];
    for (int i = 0; i < 8; i++)
        x[i] = _mm256_loadu_si256((const __m256i *)(p + 32 * i));
    x[0] = _mm256_xor_si256(x[0], _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_cvtsi32_si128((int)crc), 0));
    __m256i k = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold2048));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        if (n > PREFETCH + 256)
            for (int i = 0; i < 256; i += 64)
                _mm_prefetch((const char *)p + PREFETCH + i, _MM_HINT_T0);
        for (int i = 0; i < 8; i++)
            x[i] = fold256x2(x[i], k, _mm256_loadu_si256((const __m256i *)(p + 32 * i)));
    }
    k = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold256));
    for (int i = 1; i < 8; i++)
        x[i] = fold256x2(x[i - 1], k, x[i]);
    __m128i k128 = _mm_loadu_si128((const __m128i *)fold128);
    __m128i y = fold(_mm256_castsi256_si128(x[7]), k128, _mm256_extracti128_si256(x[7], 1));
    return finish_sse42(y, p, n, 0);
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2,pclmul")))
static inline __m512i fold512x4(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96);   /* a ^ b ^ c */
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2,pclmul")))
static uint32_t crc_avx512(uint32_t crc, const uint8_t *p, size_t n)
{
    if (n < 256)
        return crc_sse42(crc, p, n);
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)crc), 0));
    __m512i x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128);
    __m512i x3 = _mm512_loadu_si512(p + 192);
    __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold2048));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        if (n > PREFETCH + 256)
            for (int i = 0; i < 256; i += 64)
                _mm_prefetch((const char *)p + PREFETCH + i, _MM_HINT_T0);
        x0 = fold512x4(x0, k, _mm512_loadu_si512(p));
        x1 = fold512x4(x1, k, _mm512_loadu_si512(p + 64));
        x2 = fold512x4(x2, k, _mm512_loadu_si512(p + 128));
        x3 = fold512x4(x3, k, _mm512_loadu_si512(p + 192));
    }
    k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold512));
    x3 = fold512x4(fold512x4(fold512x4(x0, k, x1), k, x2), k, x3);
    __m128i k128 = _mm_loadu_si128((const __m128i *)fold128);
    __m128i x = _mm512_extracti32x4_epi32(x3, 0);
    x = fold(x, k128, _mm512_extracti32x4_epi32(x3, 1));
    x = fold(x, k128, _mm512_extracti32x4_epi32(x3, 2));
    x = fold(x, k128, _mm512_extracti32x4_epi32(x3, 3));
    return finish_sse42(x, p, n, 0);
}

static void detect(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return;
    int sse42 = (c >> 20) & 1, pclmul = (c >> 1) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    available[SSE42] = sse42 && pclmul;
    if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, vpclmul = (c >> 10) & 1;
    uint32_t xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    int ymm_saved = (xcr0_lo & 0x6) == 0x6;     /* XMM, YMM */
    int zmm_saved = (xcr0_lo & 0xE6) == 0xE6;   /* XMM, YMM, opmask, ZMM 0-15 upper halves, ZMM 16-31 */
    available[AVX2] = available[SSE42] && avx && avx2 && vpclmul && ymm_saved;   /* 256-bit VPCLMULQDQ needs AVX */
    available[AVX512] = available[SSE42] && avx512f && vpclmul && zmm_saved;
}
#endif /* CRC_X86 */

/* The first PREFETCH bytes of the next span on their way to the cache while this one is read. */
static void prefetch_head(const uint8_t *p, size_t n)
{
#ifdef CRC_X86
    if (n > PREFETCH)
        n = PREFETCH;
    for (size_t i = 0; i < n; i += 64)
        _mm_prefetch((const char *)p + i, _MM_HINT_T0);
#else
    (void)p, (void)n;
#endif
}

/* The CRC-32C of p[0:n] by implementation `path`. */
static uint32_t crc32c(int path, const uint8_t *p, size_t n)
{
    uint32_t crc = 0xFFFFFFFFu;
#ifdef CRC_X86
    if (path == AVX512)
        return ~crc_avx512(crc, p, n);
    if (path == AVX2)
        return ~crc_avx2(crc, p, n);
    if (path == SSE42)
        return ~crc_sse42(crc, p, n);
#endif
    return ~crc_software(crc, p, n);
}

/* The implementation a call names (None: the best this CPU has), or -1 with an exception set. */
static int path_of(PyObject *name)
{
    if (name == NULL || name == Py_None)
        return best;
    for (int i = 0; i < N_PATHS; i++) {
        if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, PATH_NAMES[i]) == 0) {
            if (available[i])
                return i;
            PyErr_Format(PyExc_ValueError, "CRC-32C implementation %s is not available on this CPU", PATH_NAMES[i]);
            return -1;
        }
    }
    PyErr_Format(PyExc_ValueError, "no CRC-32C implementation named %R", name);
    return -1;
}

static PyObject *py_value(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "path", NULL};
    Py_buffer data;
    PyObject *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|O", keywords, &data, &name))
        return NULL;
    int path = path_of(name);
    if (path < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c(path, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_spans(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"spans", "out", "path", NULL};
    Py_buffer spans, out;
    PyObject *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*|O", keywords, &spans, &out, &name))
        return NULL;
    PyObject *result = NULL;
    int path = path_of(name);
    if (path < 0)
        goto done;
    Py_ssize_t n = spans.len / 16;
    if (spans.len % 16 != 0 || out.len != n * 4) {
        PyErr_SetString(PyExc_ValueError, "spans: (address, length) pairs of 64-bit integers; out: one 32-bit "
                                          "integer per span");
        goto done;
    }
    const uint64_t *pairs = spans.buf;
    uint32_t *crcs = out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + 1 < n)
            prefetch_head((const uint8_t *)(uintptr_t)pairs[2 * i + 2], (size_t)pairs[2 * i + 3]);
        crcs[i] = crc32c(path, (const uint8_t *)(uintptr_t)pairs[2 * i], (size_t)pairs[2 * i + 1]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&spans);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"value", (PyCFunction)(void (*)(void))py_value, METH_VARARGS | METH_KEYWORDS,
     "value(data, path=None) -> int: the CRC-32C of a bytes-like object, by implementation `path` (default: the "
     "fastest this CPU has)."},
    {"spans", (PyCFunction)(void (*)(void))py_spans, METH_VARARGS | METH_KEYWORDS,
     "spans(spans, out, path=None): the CRC-32C of each span of memory into `out` (uint32, one per span); `spans` "
     "holds native 64-bit (address, length) pairs. The memory must stay valid for the call; the GIL is released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c",
                                    "CRC-32C of many spans of memory in one call (see _crc32c.c).", -1, methods};

PyMODINIT_FUNC PyInit__crc32c(void)
{
    make_table();
    available[SOFTWARE] = 1;
#ifdef CRC_X86
    make_constants();
    detect();
#endif
    for (int i = 0; i < N_PATHS; i++)
        if (available[i])
            best = i;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    int count = 0;
    for (int i = 0; i < N_PATHS; i++)
        count += available[i];
    PyObject *paths = PyTuple_New(count);
    for (int i = 0, j = 0; paths != NULL && i < N_PATHS; i++) {
        if (!available[i])
            continue;
        PyObject *name = PyUnicode_FromString(PATH_NAMES[i]);
        if (name == NULL) {
            Py_CLEAR(paths);
            break;
        }
        PyTuple_SET_ITEM(paths, j++, name);
    }
    int failed = paths == NULL || PyModule_AddObjectRef(m, "paths", paths) < 0
                 || PyModule_AddStringConstant(m, "best", PATH_NAMES[best]) < 0;
    Py_XDECREF(paths);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
