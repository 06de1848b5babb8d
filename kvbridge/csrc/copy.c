/* Copies by descriptor: within this process (memcpy: a host tier's gather and scatter, a store's copy of
 * its own objects) and from another process (process_vm_readv: the same-host lane of a KV hand-off).
 *
 *   copy(src, dst, lengths, *, streaming)            -> bytes, GIL released, on the calling thread
 *   copy_start(src, dst, lengths, *, streaming,      -> Copy on the pool's threads; parts: each block's
 *              cut_bytes, parts)                        crc32c taken beside its copy (.checked())
 *   cma_read(pid, remote, local, lengths)            -> bytes, GIL released
 *   cma_start(pid, remote, local, lengths,           -> CmaRead on the pool's threads, then the 8-byte seal
 *             seal_address, *, cut_bytes)               word (.result() -> (bytes, word))
 */
#include "core.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/uio.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Drop the first `got` bytes from a batch of paired iovecs (a partial read may stop mid-element) and
 * shift what is left to the front.  Returns the number of pairs left. */
static int iov_consume(struct iovec *liov, struct iovec *riov, int k, size_t got) {
    int first = 0;
    while (first < k && got >= liov[first].iov_len) got -= liov[first++].iov_len;
    if (first < k && got > 0) {
        liov[first].iov_base = (char *)liov[first].iov_base + got;
        riov[first].iov_base = (char *)riov[first].iov_base + got;
        liov[first].iov_len -= got;
        riov[first].iov_len -= got;
    }
    memmove(liov, liov + first, (size_t)(k - first) * sizeof(*liov));
    memmove(riov, riov + first, (size_t)(k - first) * sizeof(*riov));
    return k - first;
}

/* Runs with the GIL released: descriptors [lo, hi).  Pairs share lengths, so each pair is one merged run
 * of descriptors that continue each other on both sides.  Returns 0 or an errno. */
static int cma_copy(pid_t pid, const descs *d, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    static __thread struct iovec liov[IOV_MAX], riov[IOV_MAX];
    Py_ssize_t i = lo;
    int k = 0;
    *total = 0;
    for (;;) {
        for (; i < hi; i++) {
            uint64_t r = vec_u64(&d->remote, i), l = vec_u64(&d->local, i), n = vec_u64(&d->lengths, i);
            if (n == 0) continue;
            if (k > 0 && (uint64_t)(uintptr_t)riov[k - 1].iov_base + riov[k - 1].iov_len == r &&
                (uint64_t)(uintptr_t)liov[k - 1].iov_base + liov[k - 1].iov_len == l) {
                liov[k - 1].iov_len += n;
                riov[k - 1].iov_len += n;
                continue;
            }
            if (k == IOV_MAX) break;
            liov[k] = (struct iovec){(void *)(uintptr_t)l, n};
            riov[k] = (struct iovec){(void *)(uintptr_t)r, n};
            k++;
        }
        if (k == 0) return 0;
        ssize_t got = process_vm_readv(pid, liov, (unsigned long)k, riov, (unsigned long)k, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return EFAULT; /* the first remote range is unreadable: no progress possible */
        *total += (uint64_t)got;
        k = iov_consume(liov, riov, k, (size_t)got);
    }
}

/* Copy n bytes with non-temporal stores where the CPU has them (SSE2: every x86-64).  A plain store to a
 * line that is not cached first reads the line (read-for-ownership); a streaming store does not, and does
 * not evict what the cache holds.  That is the right store for a destination nobody reads soon, or one
 * larger than the cache (bench case: cpu tier, save at 8 and 128 MiB, `kvbridge bench --backends cpu`).
 * The caller fences (_mm_sfence) before it says the copy is over: streaming stores are not ordered with
 * the stores around them. */
static void copy_streaming(char *dst, const char *src, size_t n) {
#ifdef __SSE2__
    size_t head = (size_t)(-(uintptr_t)dst & 15); /* _mm_stream_si128 wants a 16-byte aligned address */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)src + 1);
        __m128i c = _mm_loadu_si128((const __m128i *)src + 2), e = _mm_loadu_si128((const __m128i *)src + 3);
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)dst + 1, b);
        _mm_stream_si128((__m128i *)dst + 2, c);
        _mm_stream_si128((__m128i *)dst + 3, e);
    }
#endif
    memcpy(dst, src, n);
}

/* The descriptors within this process: memcpy, no syscall, no page pinning. */
uint64_t kv_local_copy(const descs *d, Py_ssize_t lo, Py_ssize_t hi, int streaming) {
    uint64_t total = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        uint64_t n = vec_u64(&d->lengths, i);
        char *dst = (char *)(uintptr_t)vec_u64(&d->local, i);
        const char *src = (const char *)(uintptr_t)vec_u64(&d->remote, i);
        if (streaming) copy_streaming(dst, src, n);
        else memcpy(dst, src, n);
        total += n;
    }
#ifdef __SSE2__
    if (streaming) _mm_sfence();
#endif
    return total;
}

static PyObject *errno_error(int err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* copy(src, dst, lengths, *, streaming=False) -> bytes copied, on this thread with the GIL released. */
PyObject *py_copy(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"src", "dst", "lengths", "streaming", NULL};
    int streaming = 0;
    PyObject *so, *dso, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$p", kwlist, &so, &dso, &no, &streaming)) return NULL;
    descs d;
    if (descs_parse(&d, so, dso, no, NULL) < 0) return NULL;
    uint64_t total;
    Py_BEGIN_ALLOW_THREADS
    total = kv_local_copy(&d, 0, d.n, streaming);
    Py_END_ALLOW_THREADS
    descs_release(&d);
    return PyLong_FromUnsignedLongLong(total);
}

/* ------------------------------------------------------------------------------------------- Copy */

typedef struct {
    JobObject base;
    int streaming;
} CopyObject;

static int copy_work(kv_job *j, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    *total = kv_local_copy(&j->d, lo, hi, ((CopyObject *)((char *)j - offsetof(JobObject, job)))->streaming);
    return 0;
}

/* A checked copy's work on one thread: blocks [lo / parts, hi / parts) copied one after another, each
 * block's crc32c taken where it landed right after its copy, while its bytes are in the cache (a store's
 * copy of its own objects: checked as they are copied, not in a second pass over memory). */
static int copy_checked_work(kv_job *j, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    int streaming = ((CopyObject *)((char *)j - offsetof(JobObject, job)))->streaming;
    *total = 0;
    for (Py_ssize_t i = lo; i < hi; i += j->parts) {
        *total += kv_local_copy(&j->d, i, i + j->parts, streaming);
        uint32_t sum = descs_crc(&j->d, i, j->parts);
        memcpy(&j->sums[i / j->parts], &sum, 4); /* x86-64 (crc_ready): little-endian, as crc32c() writes */
    }
    return 0;
}

PyObject *py_copy_start(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"src", "dst", "lengths", "streaming", "cut_bytes", "parts", NULL};
    int streaming = 0;
    unsigned long long cut = KV_CUT_BYTES;
    Py_ssize_t parts = 0;
    PyObject *so, *dso, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$pKn", kwlist, &so, &dso, &no, &streaming, &cut, &parts))
        return NULL;
    CopyObject *c = (CopyObject *)kv_new(&CopyType, parts ? copy_checked_work : copy_work);
    if (!c) return NULL;
    kv_job *j = &c->base.job;
    if (descs_parse(&j->d, so, dso, no, NULL) < 0 || (parts && kv_check_blocks(j, parts, "copy_start") < 0)) {
        Py_DECREF(c);
        return NULL;
    }
    c->streaming = streaming;
    j->cut_bytes = cut;
    return kv_queue(&c->base);
}

/* result() -> bytes copied, once over; OSError only for a copy of the parent's, seen in a forked child. */
static PyObject *copy_result(CopyObject *c, PyObject *unused) {
    kv_job *j = &c->base.job;
    kv_wait(j, -1.0);
    return j->err ? errno_error(j->err) : PyLong_FromUnsignedLongLong(j->total);
}

static PyMethodDef copy_methods[] = {
    {"result", (PyCFunction)copy_result, METH_NOARGS, "result() -> bytes copied (waits); OSError if cancelled"},
    {"checked", (PyCFunction)kv_checked, METH_NOARGS, "checked() -> (sums, whole, errno) of copy_start(parts=)"},
    {NULL}};

PyTypeObject CopyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.Copy",
    .tp_doc = "a copy within this process on the copy threads (made by copy_start())",
    .tp_basicsize = sizeof(CopyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &JobType,
    .tp_methods = copy_methods,
};

/* ---------------------------------------------------------------------------------------- CmaRead */

PyObject *py_cma_read(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pid", "remote", "local", "lengths", NULL};
    int pid;
    PyObject *ro, *lo, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOO", kwlist, &pid, &ro, &lo, &no)) return NULL;
    if (pid <= 0) return PyErr_Format(PyExc_ValueError, "cma_read: pid %d is not another process (copy() copies here)", pid);
    descs d;
    if (descs_parse(&d, ro, lo, no, NULL) < 0) return NULL;
    uint64_t total = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = cma_copy((pid_t)pid, &d, 0, d.n, &total);
    Py_END_ALLOW_THREADS
    descs_release(&d);
    return err ? errno_error(err) : PyLong_FromUnsignedLongLong(total);
}

/* After every data byte of every piece landed, the thread that ended the last piece reads the optional
 * 8-byte seal word (a second process_vm_readv: see the seal in connectors/ucx/onesided.py), so the word
 * is never older than the data. */
typedef struct {
    JobObject base;
    pid_t pid;
    uint64_t seal_address; /* 0: no seal to read */
    uint64_t word;         /* the seal word (0 when none or unreadable) */
} CmaReadObject;

#define CMA_OF(j) ((CmaReadObject *)((char *)(j) - offsetof(JobObject, job)))

static int cma_work(kv_job *j, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    return cma_copy(CMA_OF(j)->pid, &j->d, lo, hi, total);
}

/* The seal word, or 0 when it cannot be read (the caller then cannot tell). */
static void cma_seal(kv_job *j) {
    CmaReadObject *r = CMA_OF(j);
    uint64_t word = 0;
    struct iovec l = {&word, sizeof(word)}, rv = {(void *)(uintptr_t)r->seal_address, sizeof(word)};
    if (r->seal_address && process_vm_readv(r->pid, &l, 1, &rv, 1, 0) != (ssize_t)sizeof(word)) word = 0;
    r->word = word;
}

PyObject *py_cma_start(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pid", "remote", "local", "lengths", "seal_address", "cut_bytes", NULL};
    int pid;
    unsigned long long seal = 0, cut = KV_CUT_BYTES;
    PyObject *ro, *lo, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOO|K$K", kwlist, &pid, &ro, &lo, &no, &seal, &cut)) return NULL;
    if (pid <= 0) return PyErr_Format(PyExc_ValueError, "cma_start: pid %d is not another process (copy_start() copies here)", pid);
    CmaReadObject *r = (CmaReadObject *)kv_new(&CmaReadType, cma_work);
    if (!r) return NULL;
    if (descs_parse(&r->base.job.d, ro, lo, no, NULL) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->pid = (pid_t)pid;
    r->seal_address = seal;
    r->base.job.cut_bytes = cut;
    r->base.job.last = cma_seal;
    return kv_queue(&r->base);
}

/* result() -> (bytes copied, seal word); waits for the end; OSError if the data read failed. */
static PyObject *cma_result(CmaReadObject *r, PyObject *unused) {
    kv_job *j = &r->base.job;
    kv_wait(j, -1.0);
    if (j->err) return errno_error(j->err);
    return Py_BuildValue("(KK)", (unsigned long long)j->total, (unsigned long long)r->word);
}

static PyMethodDef cma_methods[] = {
    {"result", (PyCFunction)cma_result, METH_NOARGS, "result() -> (bytes copied, seal word); OSError on failure"},
    {NULL}};

PyTypeObject CmaReadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.CmaRead",
    .tp_doc = "a read of another process on the copy threads (made by cma_start())",
    .tp_basicsize = sizeof(CmaReadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &JobType,
    .tp_methods = cma_methods,
};
