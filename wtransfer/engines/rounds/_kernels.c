/* wtransfer.engines.rounds._kernels: the loops numpy would take several passes, or plain stores, for.

   gather(): numpy takes three passes over a chunk to gather a delta round's changes (compare into a mask, the mask's
   nonzero indices, the values at them); this reads the new bits and the base once, 8 bytes at a time, and writes
   each changed element's value, its position within its 65536-element block, and its block's count. place(): the
   worker's side, a span copied from the base and its changes written in, block by block, without the int64
   positions numpy's fancy assignment needs. stream_copy(): a copy into memory not read again soon (a worker's model
   or staged copy) with non-temporal stores. All release the GIL. Where this module was not built, the numpy paths
   (wtransfer.engines.rounds.kernels says which) do the same. An editable install builds it once: after editing
   this file, run `pip install -e .` again. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#define GATHER(T)                                                                                              \
    static int64_t gather_##T(const T *fresh, const T *old, int64_t n, int64_t start, T *values,              \
                              uint16_t *lows, uint32_t *counts) {                                              \
        enum { LANES = 8 / sizeof(T) };                                                                        \
        int64_t k = 0, i = 0;                                                                                  \
        for (; i + LANES <= n; i += LANES) {                                                                   \
            uint64_t a, b;                                                                                     \
            memcpy(&a, fresh + i, 8); /* each new byte is read once: a value and its test agree */            \
            memcpy(&b, old + i, 8);                                                                            \
            if (a == b) continue;                                                                              \
            T now[LANES], was[LANES];                                                                          \
            memcpy(now, &a, 8);                                                                                \
            memcpy(was, &b, 8);                                                                                \
            for (int j = 0; j < LANES; j++) {                                                                  \
                if (now[j] != was[j]) {                                                                        \
                    int64_t at = start + i + j;                                                                \
                    values[k] = now[j];                                                                        \
                    lows[k++] = (uint16_t)(at & 0xFFFF);                                                       \
                    counts[at >> 16]++;                                                                        \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (; i < n; i++) {                                                                                   \
            T v = fresh[i];                                                                                    \
            if (v != old[i]) {                                                                                 \
                int64_t at = start + i;                                                                        \
                values[k] = v;                                                                                 \
                lows[k++] = (uint16_t)(at & 0xFFFF);                                                           \
                counts[at >> 16]++;                                                                            \
            }                                                                                                  \
        }                                                                                                      \
        return k;                                                                                              \
    }

GATHER(uint8_t)
GATHER(uint16_t)
GATHER(uint32_t)
GATHER(uint64_t)

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer fresh, old, values, lows, counts;
    int itemsize;
    long long start;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*iL", &fresh, &old, &values, &lows, &counts, &itemsize, &start))
        return NULL;
    PyObject *result = NULL;
    int sized = itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8;
    int64_t n = sized ? fresh.len / itemsize : 0;
    if (!sized || fresh.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "gather: element size %d (1, 2, 4 or 8 bytes) of %zd bytes", itemsize,
                     fresh.len);
    } else if (old.len != fresh.len) {
        PyErr_Format(PyExc_ValueError, "gather: %zd new bytes against %zd base bytes", fresh.len, old.len);
    } else if (start < 0 || start > INT64_MAX - n - 65536) {
        PyErr_Format(PyExc_ValueError, "gather: start %lld out of range", start);
    } else if (values.len < fresh.len || lows.len / 2 < n || counts.len / 4 < (start + n + 65535) >> 16) {
        PyErr_SetString(PyExc_ValueError, "gather: an output is too small for every element changed");
    } else {
        int64_t found = 0;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
            case 1: found = gather_uint8_t(fresh.buf, old.buf, n, start, values.buf, lows.buf, counts.buf); break;
            case 2: found = gather_uint16_t(fresh.buf, old.buf, n, start, values.buf, lows.buf, counts.buf); break;
            case 4: found = gather_uint32_t(fresh.buf, old.buf, n, start, values.buf, lows.buf, counts.buf); break;
            default: found = gather_uint64_t(fresh.buf, old.buf, n, start, values.buf, lows.buf, counts.buf); break;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromLongLong(found);
    }
    PyBuffer_Release(&fresh);
    PyBuffer_Release(&old);
    PyBuffer_Release(&values);
    PyBuffer_Release(&lows);
    PyBuffer_Release(&counts);
    return result;
}


#define PLACE(T)                                                                                               \
    static int place_##T(T *value, const T *base, int64_t n, const T *values, const uint16_t *lows,            \
                         const uint32_t *counts, int64_t blocks, int64_t total) {                              \
        int64_t k = 0;                                                                                         \
        for (int64_t b = 0; b < blocks; b++) {                                                                 \
            int64_t begin = b << 16, end = begin + 65536 < n ? begin + 65536 : n;                              \
            int64_t stop = k + counts[b]; /* read once: the caller summed the same counts into total */        \
            if (stop > total) return -1;                                                                       \
            if (base) memcpy(value + begin, base + begin, (size_t)(end - begin) * sizeof(T));                  \
            for (; k < stop; k++) {                                                                            \
                uint16_t low;                                                                                  \
                memcpy(&low, lows + k, 2); /* a 1-byte payload's positions need not be 2-byte aligned */       \
                if (begin + low >= end) return -1;                                                             \
                value[begin + low] = values[k];                                                                \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }

PLACE(uint8_t)
PLACE(uint16_t)
PLACE(uint32_t)
PLACE(uint64_t)

static PyObject *place(PyObject *self, PyObject *args) {
    Py_buffer value, base = {0}, values, lows, counts;
    PyObject *base_object;
    int itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*Oy*y*y*i", &value, &base_object, &values, &lows, &counts, &itemsize))
        return NULL;
    int have_base = base_object != Py_None;
    if (have_base && PyObject_GetBuffer(base_object, &base, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&value);
        PyBuffer_Release(&values);
        PyBuffer_Release(&lows);
        PyBuffer_Release(&counts);
        return NULL;
    }
    PyObject *result = NULL;
    int sized = itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8;
    int64_t n = sized ? value.len / itemsize : 0, blocks = (n + 65535) >> 16, total = 0;
    if (!sized || value.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "place: element size %d (1, 2, 4 or 8 bytes) of %zd bytes", itemsize,
                     value.len);
    } else if ((have_base && base.len != value.len) || counts.len / 4 < blocks) {
        PyErr_SetString(PyExc_ValueError, "place: the counts, values and positions do not fit the span");
    } else {
        for (int64_t b = 0; b < blocks; b++) total += ((const uint32_t *)counts.buf)[b];
    }
    if (PyErr_Occurred()) {
        /* reported above */
    } else if (values.len != total * itemsize || lows.len != total * 2) {
        PyErr_SetString(PyExc_ValueError, "place: the counts, values and positions do not fit the span");
    } else {
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS
        const void *from = have_base ? base.buf : NULL;
        switch (itemsize) {
            case 1: failed = place_uint8_t(value.buf, from, n, values.buf, lows.buf, counts.buf, blocks, total); break;
            case 2: failed = place_uint16_t(value.buf, from, n, values.buf, lows.buf, counts.buf, blocks, total); break;
            case 4: failed = place_uint32_t(value.buf, from, n, values.buf, lows.buf, counts.buf, blocks, total); break;
            default: failed = place_uint64_t(value.buf, from, n, values.buf, lows.buf, counts.buf, blocks, total); break;
        }
        Py_END_ALLOW_THREADS
        if (failed) {
            PyErr_SetString(PyExc_ValueError, "place: a position past the end of its block, or more than counted");
        } else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    if (have_base) PyBuffer_Release(&base);
    PyBuffer_Release(&value);
    PyBuffer_Release(&values);
    PyBuffer_Release(&lows);
    PyBuffer_Release(&counts);
    return result;
}

/* dst = src, written past the caches where the CPU has non-temporal stores (x86-64: SSE2 is always there). A store
   to memory not in cache first reads the line it lands in; a non-temporal store does not, so a copy into memory that
   is not read again soon (a model, a staged copy) moves two thirds of the bytes a plain memcpy moves. */
static void copy_streaming(char *dst, const char *src, Py_ssize_t n) {
#if defined(__SSE2__) || defined(_M_X64)
    Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)dst & 15)) & 15), i = 0;
    if (head > n) head = n;
    memcpy(dst, src, (size_t)head);
    dst += head;
    src += head;
    n -= head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
    _mm_sfence(); /* the streamed stores are visible before anything this thread does next */
#else
    memcpy(dst, src, (size_t)n);
#endif
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: %zd bytes into %zd", src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_streaming(dst.buf, src.buf, dst.len);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(new, base, values, lows, counts, itemsize, start) -> how many elements of new differ from base.\n\n"
     "Each such element's value goes to values, its position within its 65536-element block to lows (uint16),\n"
     "and counts[(start + index) >> 16] (uint32) goes up by one; values and lows must hold every element."},
    {"place", place, METH_VARARGS,
     "place(value, base, values, lows, counts, itemsize): a positions payload's span written into value.\n\n"
     "value takes base's bytes (unless base is None: rebuilt in place), then values at their positions, block by\n"
     "65536-element block, counts[b] of them in block b; a position past its block's end raises ValueError."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): dst's bytes become src's, stored past the caches where the CPU can (same sizes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
#if defined(__SSE2__) || defined(_M_X64)
    int streams = 1;
#else
    int streams = 0;
#endif
    if (m != NULL && PyModule_AddIntConstant(m, "streams", streams) < 0) { /* whether stream_copy streams */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
