/* kvbridge._ucp: the one-sided data plane, in plain C over ucp's stable C API and the CPython API.
 *
 * What lives here and why it is C: a KV hand-off is thousands of (remote, local, length) descriptors per
 * request.  Python may describe them only as arrays; posting, merging and waiting happen here with the GIL
 * released, so the per-descriptor cost is a function call, not an interpreter round trip.
 *
 *   cma_read(pid, remote, local, lengths,        process_vm_readv of descriptors (the raw same-host lane);
 *            streaming=False)                    pid 0: memcpy within this process (a host tier's copies),
 *                                                streaming: with stores that bypass the cache
 *   cma_start(pid, ..., seal_address=0,          the same on native threads -> CmaRead (.wait .done .result);
 *             streaming=False, cut_bytes=8 MiB,  reads of cut_bytes or more are cut between the threads;
 *             parts=0)                           parts: pid 0, each block's crc32c beside its copy (.checked)
 *   cma_drain(timeout_s)                           the caller keeps its destination alive until then
 *   crc32c(addresses, lengths, parts)            their checksums (SSE4.2 lanes, carry-less folds)
 *   file_start(runs, addresses, lengths, parts,  blocks read (or written) and checked on the native
 *              write=False, cut_bytes,           threads -> CmaRead (.checked(): sums, blocks whole, errno);
 *              block_ids=None, block_stride=0)   block_ids: addresses, lengths are block 0's pieces
 *   Context(tls=None, progress_thread=False,     one ucp context + one worker, guarded by one mutex;
 *           config=None, optional=())            config: UCX options set before ucp_init (the user's
 *     .address .config .config_text              UCX_<name> wins), optional: keys this UCX may lack
 *     .map() .connect() .progress() .close()
 *   Region    (.rkey .address .length .memory_type .close())
 *   Endpoint  (.add_rkey() .get() .put() .failed .info() .close())
 *
 * Concurrency: the worker is UCS_THREAD_MODE_SERIALIZED and every ucp call on it is made with the
 * context's mutex held; the mutex is never held while sleeping, and the GIL is never taken while it is
 * held (so the two cannot deadlock).  Python objects hold strong references upward (Region/Endpoint ->
 * Context), so nothing ucp-side is destroyed under its users; Context.close() closes its children first.
 *
 * Failure: every wait has a deadline.  A transfer that fails or times out force-closes its endpoint and
 * waits (bounded) for UCX to retire what was posted, so no byte lands in local memory after the call
 * returns; the endpoint then stays failed.  Nothing here aborts the process on a peer's death, with the
 * one exception UCX itself imposes: error_handling=False (documented as unsafe).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

#ifndef THREAD_POLL_MS
#define THREAD_POLL_MS 50     /* progress thread sleep on the event fd: bounds how long close() waits */
#endif
#ifndef WAIT_POLL_MS
#define WAIT_POLL_MS 2        /* a transfer's sleep on the event fd: re-checks even if a wakeup is missed */
#endif
#ifndef IDLE_SPINS
#define IDLE_SPINS 64         /* empty progress rounds (sched_yield between) before sleeping on the fd */
#endif
#ifndef THREAD_BATCH
#define THREAD_BATCH 64       /* progress rounds the thread makes per mutex hold, so callers get a turn */
#endif
#define ABORT_WAIT_S 2.0      /* how long a failed transfer waits for UCX to retire its requests */
#define CLOSE_WAIT_S 2.0      /* how long a graceful endpoint close may take */
#define IDLE_WAIT_S 30.0      /* how long Context.close waits for transfers in other threads to end */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *ucs_error(PyObject *exc, const char *what, ucs_status_t st) {
    PyErr_Format(exc, "%s: %s", what, ucs_status_string(st));
    return NULL;
}

/* ------------------------------------------------------------------------------- descriptor arrays */

/* One descriptor argument: a C-contiguous array of unsigned integers, or (where allowed) one scalar
 * that applies to every descriptor.  The view is held for the whole call, GIL released or not. */
typedef struct {
    Py_buffer view;
    int has_view;
    const void *data; /* NULL: use scalar */
    uint64_t scalar;
    Py_ssize_t n;     /* -1 for a scalar */
    int itemsize;
} vec_arg;

static int format_ok(const char *fmt, int itemsize) {
    if (fmt == NULL) return 0;
    /* native or little-endian markers only: this is a same-host array of machine words */
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    if (itemsize == 8) return fmt[0] == 'Q' || fmt[0] == 'L' || fmt[0] == 'K';
    return fmt[0] == 'I' || fmt[0] == 'L';
}

static int vec_parse(PyObject *o, const char *name, int itemsize, int allow_scalar, vec_arg *v) {
    memset(v, 0, sizeof(*v));
    v->itemsize = itemsize;
    v->n = -1;
    if (allow_scalar && PyLong_Check(o)) {
        unsigned long long x = PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred() || (itemsize == 4 && x > UINT32_MAX)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: scalar out of range for uint%d", name, itemsize * 8);
            return -1;
        }
        v->scalar = x;
        return 0;
    }
    if (!PyObject_CheckBuffer(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a uint%d array%s, got %.80s", name, itemsize * 8,
                     allow_scalar ? " or an int" : "", Py_TYPE(o)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(o, &v->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* numpy says BufferError; callers want one exception type for bad input */
        PyErr_Format(PyExc_ValueError, "%s: need a C-contiguous uint%d array", name, itemsize * 8);
        return -1;
    }
    v->has_view = 1;
    if (v->view.itemsize != itemsize || !format_ok(v->view.format, itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: need uint%d items, got format '%s' itemsize %zd", name, itemsize * 8,
                     v->view.format ? v->view.format : "B", v->view.itemsize);
        PyBuffer_Release(&v->view);
        v->has_view = 0;
        return -1;
    }
    v->data = v->view.buf;
    v->n = v->view.len / itemsize;
    return 0;
}

static void vec_release(vec_arg *v) {
    if (v->has_view) PyBuffer_Release(&v->view);
    v->has_view = 0;
}

static inline uint64_t vec_u64(const vec_arg *v, Py_ssize_t i) {
    return v->data ? ((const uint64_t *)v->data)[i] : v->scalar;
}

static inline uint32_t vec_u32(const vec_arg *v, Py_ssize_t i) {
    return v->data ? ((const uint32_t *)v->data)[i] : (uint32_t)v->scalar;
}

/* The common shape of every transfer call: remote and local arrays, lengths array-or-int, and for ucp
 * transfers an rkey index array-or-int.  All arrays must agree on the count. */
typedef struct {
    vec_arg remote, local, lengths, index;
    Py_ssize_t n;
} descs;

static void descs_release(descs *d) {
    vec_release(&d->remote);
    vec_release(&d->local);
    vec_release(&d->lengths);
    vec_release(&d->index);
}

static int descs_count(descs *d, const vec_arg *v, const char *name) {
    if (v->n < 0 || v->n == d->n) return 0;
    PyErr_Format(PyExc_ValueError, "%s: %zd descriptors, but remote has %zd", name, v->n, d->n);
    return -1;
}

static int descs_parse(descs *d, PyObject *remote, PyObject *local, PyObject *lengths, PyObject *index) {
    memset(d, 0, sizeof(*d));
    if (vec_parse(remote, "remote", 8, 0, &d->remote) < 0) return -1;
    d->n = d->remote.n;
    if (vec_parse(local, "local", 8, 0, &d->local) < 0 || descs_count(d, &d->local, "local") < 0) goto fail;
    if (vec_parse(lengths, "lengths", 8, 1, &d->lengths) < 0 || descs_count(d, &d->lengths, "lengths") < 0)
        goto fail;
    if (index != NULL &&
        (vec_parse(index, "rkey_index", 4, 1, &d->index) < 0 || descs_count(d, &d->index, "rkey_index") < 0))
        goto fail;
    return 0;
fail:
    descs_release(d);
    return -1;
}

/* ---------------------------------------------------------------------------------------- cma_read */

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
 * larger than the cache: measured here, 8 MiB of 32 KiB pieces into a cold host pool at ~21 GB/s instead
 * of ~12, 128 MiB at ~15 instead of ~10.  The caller fences (_mm_sfence) before it says the copy is over:
 * streaming stores are not ordered with the stores around them. */
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

/* The same descriptors within this process (pid 0): memcpy, no syscall, no page pinning.  A host-memory
 * tier's gather and scatter (connectors/cpu.py) are such copies between its pool and a CPU KV. */
static uint64_t local_copy(const descs *d, Py_ssize_t lo, Py_ssize_t hi, int streaming) {
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

/* Descriptors [lo, hi): pid > 0: process_vm_readv from that process (`streaming` has no say: the kernel
 * copies); 0: memcpy here.  Returns 0 or an errno. */
static int move_descs(pid_t pid, const descs *d, Py_ssize_t lo, Py_ssize_t hi, int streaming, uint64_t *total) {
    if (pid == 0) {
        *total = local_copy(d, lo, hi, streaming);
        return 0;
    }
    return cma_copy(pid, d, lo, hi, total);
}

static PyObject *py_cma_read(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pid", "remote", "local", "lengths", "streaming", NULL};
    int pid, streaming = 0;
    PyObject *ro, *lo, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOO|$p", kwlist, &pid, &ro, &lo, &no, &streaming)) return NULL;
    descs d;
    if (descs_parse(&d, ro, lo, no, NULL) < 0) return NULL;
    uint64_t total = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = move_descs((pid_t)pid, &d, 0, d.n, streaming, &total);
    Py_END_ALLOW_THREADS
    descs_release(&d);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(total);
}

/* ---------------------------------------------------------------------------------------- CmaRead */

/* cma_start(): the same read on native threads, so that the caller (an engine's step) neither copies nor
 * waits on a Python thread for the GIL.  Handing a read to a Python thread costs two GIL hand-offs per
 * load (to start it, and to hear it ended), ~0.2 ms here, a quarter of an 8 MiB read; these threads never
 * touch Python.  They are made once and sleep on a queue: a thread made per read started ~0.3 ms after
 * pthread_create on this 2-core VM.  The engine sleeps in wait() with the GIL released.
 *
 * A read of `cut_bytes` or more (default CMA_CUT_BYTES) is cut into pieces of about equal bytes, one per thread, which copy
 * at once: one thread's copy is bound by its own memory latency, not the machine's bandwidth (measured here:
 * 128 MiB of scattered 64 KiB blocks at ~7 GB/s on one thread, ~10.5 GB/s on two).  After every data byte
 * of every piece landed, the thread that ended the last piece reads the optional 8-byte seal word (a
 * second process_vm_readv: see the seal in connectors/ucx/onesided.py), so the word is never older than
 * the data. */
#define CMA_THREADS 2                /* pieces copied at once (memory-bound: more buy little here) */
#define CMA_PIECE_BYTES (4u << 20)   /* a piece is at least this long: below, the split measured no gain */
#define CMA_CUT_BYTES (2 * CMA_PIECE_BYTES) /* default: reads this long or longer are cut */

struct CmaReadObject;

typedef struct cma_piece {
    struct CmaReadObject *read;
    Py_ssize_t lo, hi; /* its descriptors */
    struct cma_piece *next;
} cma_piece;

typedef struct CmaReadObject {
    PyObject_HEAD
    descs d;               /* the caller's arrays, viewed until this object dies */
    int file;              /* 1: made by file_start(): d.remote holds file offsets, moved with fds */
    int write;             /* file_start(): 1 writes the blocks to the files, 0 reads them */
    vec_arg fds;           /* file_start(): each descriptor's file */
    uint64_t *placed;      /* file_start(): what fds and d.remote view (file_runs), freed with r */
    uint64_t *expanded;    /* file_start(block_ids=): what d.local and d.lengths view (file_blocks), freed with r */
    Py_ssize_t parts;      /* > 0: checked, in blocks of this many descriptors (pieces cut between blocks) */
    uint32_t *sums;        /* checked: each block's crc32c, for the blocks moved whole */
    Py_ssize_t whole;      /* checked: blocks from the first moved whole, before any short or failed one */
    pid_t pid;
    int streaming;         /* pid 0: streaming stores (local_copy) */
    uint64_t cut_bytes;    /* cut from this many bytes (cma_cut) */
    uint64_t seal_address; /* 0: no seal to read */
    uint64_t total, word;  /* bytes copied; the seal word (0 when none or unreadable) */
    int err;               /* errno of the first piece that failed, or 0 */
    int pending;           /* pieces not over yet; under cma_queue.lock */
    int done;              /* under cma_queue.lock */
    unsigned long gen;     /* cma_queue.gen when queued: a read of the process before a fork never ends here */
    cma_piece pieces[CMA_THREADS];
} CmaReadObject;

/* The pieces waiting for a thread, first in first out, and the threads' wake-ups.  One lock guards the
 * queue and every read's `done`; `cond` wakes threads (work) and waiters (a read over) alike. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t work, over;
    cma_piece *head, *tail;
    int threads, busy;  /* threads made; pieces they are copying now */
    unsigned long gen;  /* forks so far */
} cma_queue = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0};

/* Whether `r` is over (the lock held).  A read queued before this process was forked ran, if at all, in
 * the parent: here it ends as cancelled, so that nothing (its object's dealloc included) waits for it. */
static int cma_over(CmaReadObject *r) {
    if (!r->done && r->gen != cma_queue.gen) {
        r->err = ECANCELED;
        r->whole = 0; /* a checked read: no block is known to have moved */
        r->done = 1;
    }
    return r->done;
}

/* The seal word at r->seal_address, or 0 when it cannot be read (the caller then cannot tell). */
static uint64_t cma_seal(CmaReadObject *r) {
    uint64_t word = 0;
    struct iovec l = {&word, sizeof(word)}, rv = {(void *)(uintptr_t)r->seal_address, sizeof(word)};
    if (process_vm_readv(r->pid, &l, 1, &rv, 1, 0) != (ssize_t)sizeof(word)) word = 0;
    return word;
}

static int file_checked(CmaReadObject *r, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total);
static int copy_checked(CmaReadObject *r, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total);

static void cma_run(cma_piece *p) {
    CmaReadObject *r = p->read;
    uint64_t total = 0;
    int err = r->file    ? file_checked(r, p->lo, p->hi, &total)
              : r->parts ? copy_checked(r, p->lo, p->hi, &total)
                         : move_descs(r->pid, &r->d, p->lo, p->hi, r->streaming, &total);
    pthread_mutex_lock(&cma_queue.lock);
    r->total += total;
    if (err && !r->err) r->err = err;
    int last = --r->pending == 0;
    pthread_mutex_unlock(&cma_queue.lock);
    /* the last piece is over, so no other thread writes r->err or r->word any more */
    uint64_t word = last && !r->err && r->seal_address && r->pid ? cma_seal(r) : 0;
    pthread_mutex_lock(&cma_queue.lock);
    if (last) {
        r->word = word;
        r->done = 1;
        pthread_cond_broadcast(&cma_queue.over);
    }
    cma_queue.busy--;
    if (!cma_queue.busy && !cma_queue.head) pthread_cond_broadcast(&cma_queue.over); /* cma_drain */
    pthread_mutex_unlock(&cma_queue.lock);
}

/* The copy threads are SCHED_BATCH (Linux): a batch thread that wakes does not preempt the thread running
 * on its core.  A read's start wakes both threads; on a core that is busy, the woken one took it from
 * the engine's thread at once, which then waited out the copy before it could return from the start (an
 * 8 MiB file_start() call measured 90-320 us here instead of ~20).  An idle core still runs it at once, and
 * a piece no thread has taken yet is run by whoever waits for its read (cma_wait_done). */
static void cma_batch(void) {
#ifdef SCHED_BATCH
    struct sched_param none = {0};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &none); /* a refusal keeps the default policy */
#endif
#ifdef __linux__
    (void)pthread_setname_np(pthread_self(), "kvbridge-copy"); /* for top -H, perf, /proc/<pid>/task: and tests */
#endif
}

static void *cma_thread(void *unused) {
    cma_batch();
    for (;;) {
        pthread_mutex_lock(&cma_queue.lock);
        while (!cma_queue.head) pthread_cond_wait(&cma_queue.work, &cma_queue.lock);
        cma_piece *p = cma_queue.head;
        cma_queue.head = p->next;
        if (!cma_queue.head) cma_queue.tail = NULL;
        cma_queue.busy++;
        pthread_mutex_unlock(&cma_queue.lock);
        cma_run(p);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own on its first read, and the reads
 * the parent had queued or running end as cancelled (cma_over). */
static void cma_after_fork(void) {
    pthread_mutex_init(&cma_queue.lock, NULL);
    pthread_cond_init(&cma_queue.work, NULL);
    pthread_cond_init(&cma_queue.over, NULL);
    cma_queue.head = cma_queue.tail = NULL;
    cma_queue.threads = cma_queue.busy = 0;
    cma_queue.gen++;
}

/* Cut r's descriptors into pieces of about equal bytes (whole descriptors each, whole blocks for a
 * checked read; one piece below
 * r->cut_bytes, else at most one per thread that exists, each at least CMA_PIECE_BYTES unless cut_bytes
 * asks for less).  Returns how many. */
static int cma_cut(CmaReadObject *r, int threads) {
    const descs *d = &r->d;
    uint64_t bytes = 0;
    for (Py_ssize_t i = 0; i < d->n; i++) bytes += vec_u64(&d->lengths, i);
    uint64_t piece = r->cut_bytes / 2 < CMA_PIECE_BYTES ? r->cut_bytes / 2 : CMA_PIECE_BYTES;
    uint64_t most = bytes < r->cut_bytes ? 1 : piece ? bytes / piece : (uint64_t)threads;
    int n = most < 1 ? 1 : most < (uint64_t)threads ? (int)most : threads;
    Py_ssize_t i = 0;
    uint64_t sum = 0;
    for (int k = 0; k < n; k++) {
        r->pieces[k] = (cma_piece){r, i, d->n, NULL};
        if (k == n - 1) break;
        uint64_t goal = bytes / (uint64_t)n * (uint64_t)(k + 1);
        while (i < d->n && (sum < goal || (r->parts && i % r->parts))) sum += vec_u64(&d->lengths, i++);
        r->pieces[k].hi = i;
    }
    return n;
}

/* Queue r's pieces (the lock held), making the threads on first use.  Returns 0 or an errno. */
static int cma_enqueue(CmaReadObject *r) {
    while (cma_queue.threads < CMA_THREADS) {
        pthread_t t;
        int err = pthread_create(&t, NULL, cma_thread, NULL);
        if (err) {
            if (cma_queue.threads == 0) return err;
            break; /* fewer threads: reads wait their turn */
        }
        pthread_detach(t);
        cma_queue.threads++;
    }
    r->gen = cma_queue.gen;
    r->pending = cma_cut(r, cma_queue.threads);
    for (int k = 0; k < r->pending; k++) {
        cma_piece *p = &r->pieces[k];
        if (cma_queue.tail) cma_queue.tail->next = p;
        else cma_queue.head = p;
        cma_queue.tail = p;
    }
    pthread_cond_broadcast(&cma_queue.work);
    return 0;
}

/* A piece of `r` still queued, taken off the queue (the lock held), or NULL. */
static cma_piece *cma_take(CmaReadObject *r) {
    cma_piece *prev = NULL;
    for (cma_piece *p = cma_queue.head; p; prev = p, p = p->next) {
        if (p->read != r) continue;
        if (prev) prev->next = p->next;
        else cma_queue.head = p->next;
        if (cma_queue.tail == p) cma_queue.tail = prev;
        cma_queue.busy++;
        return p;
    }
    return NULL;
}

/* Wait (GIL released) until `r` is over or `timeout_s` passed (< 0: no limit; 0: only look).  Returns
 * done.  A waiter first runs the pieces of `r` no thread has taken yet itself: it is on a core already,
 * and a sleeping thread may not be (on this 2-core VM an 8 MiB read and check measured 0.57-0.70 of a
 * plain file read when the waiter slept, 0.83-0.88 when it took the second piece).  So a wait may pass
 * `timeout_s` by one piece's copy. */
static int cma_wait_done(CmaReadObject *r, double timeout_s) {
    struct timespec until; /* the conditions' clock is the default one, CLOCK_REALTIME */
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout_s >= 0) {
        until.tv_sec += (time_t)timeout_s;
        until.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    }
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cma_queue.lock);
    while (!cma_over(r)) {
        cma_piece *p = timeout_s != 0 && r->gen == cma_queue.gen ? cma_take(r) : NULL;
        if (p) {
            pthread_mutex_unlock(&cma_queue.lock);
            cma_run(p);
            pthread_mutex_lock(&cma_queue.lock);
            continue;
        }
        if (timeout_s < 0) pthread_cond_wait(&cma_queue.over, &cma_queue.lock);
        else if (pthread_cond_timedwait(&cma_queue.over, &cma_queue.lock, &until) == ETIMEDOUT) break;
    }
    done = r->done;
    pthread_mutex_unlock(&cma_queue.lock);
    Py_END_ALLOW_THREADS
    return done;
}

static PyTypeObject CmaReadType;

/* A new read's fields, before its arrays are parsed: done, so that dealloc waits for nothing. */
static void cma_clear(CmaReadObject *r) {
    memset((char *)r + sizeof(PyObject), 0, sizeof(*r) - sizeof(PyObject));
    r->done = 1;
}

/* Queue r (its fields set) on the threads; r itself, or NULL with OSError (r released). */
static PyObject *cma_queued(CmaReadObject *r) {
    pthread_mutex_lock(&cma_queue.lock);
    r->done = 0;
    int err = cma_enqueue(r);
    if (err) r->done = 1;
    pthread_mutex_unlock(&cma_queue.lock);
    if (err) {
        Py_DECREF(r);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)r;
}

static int crc_ready; /* 1: the CPU has SSE4.2 and the crc section below set it up (crc_init) */

/* r checked in blocks of `parts` descriptors: its sums made, every block counted whole until one fails.
 * Returns 0, or -1 with the error set. */
static int cma_check_blocks(CmaReadObject *r, Py_ssize_t parts, const char *fn) {
    if (!crc_ready) {
        PyErr_Format(PyExc_RuntimeError, "%s: this CPU has no SSE4.2 (use google-crc32c)", fn);
        return -1;
    }
    if (parts <= 0 || r->d.n % parts) {
        PyErr_Format(PyExc_ValueError, "%s: %zd pieces are not runs of %zd", fn, r->d.n, parts);
        return -1;
    }
    r->sums = calloc((size_t)(r->d.n / parts) + 1, 4);
    if (!r->sums) {
        PyErr_NoMemory();
        return -1;
    }
    r->parts = parts;
    r->whole = r->d.n / parts;
    return 0;
}

static PyObject *py_cma_start(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pid", "remote", "local", "lengths", "seal_address", "streaming", "cut_bytes", "parts", NULL};
    int pid, streaming = 0;
    unsigned long long seal = 0, cut = CMA_CUT_BYTES;
    Py_ssize_t parts = 0;
    PyObject *ro, *lo, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOO|K$pKn", kwlist, &pid, &ro, &lo, &no, &seal, &streaming, &cut,
                                     &parts))
        return NULL;
    if (parts && pid != 0) return PyErr_Format(PyExc_ValueError, "cma_start: parts= checks copies in this process (pid 0)");
    CmaReadObject *r = PyObject_New(CmaReadObject, &CmaReadType);
    if (!r) return NULL;
    cma_clear(r);
    if (descs_parse(&r->d, ro, lo, no, NULL) < 0 || (parts && cma_check_blocks(r, parts, "cma_start") < 0)) {
        Py_DECREF(r);
        return NULL;
    }
    r->pid = (pid_t)pid;
    r->streaming = streaming;
    r->cut_bytes = cut;
    r->seal_address = seal;
    return cma_queued(r);
}

/* cma_drain(timeout_s) -> True once no read is queued or running.  The caller of cma_start keeps the
 * destination alive until its read is over; at interpreter exit that is not given (objects go in any
 * order), so kvbridge registers this with atexit. */
static PyObject *py_cma_drain(PyObject *mod, PyObject *arg) {
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)(t > 0 ? t : 0);
    until.tv_nsec += (long)((t > 0 ? t - (double)(time_t)t : 0) * 1e9);
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    int idle;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cma_queue.lock);
    while ((cma_queue.head || cma_queue.busy) &&
           pthread_cond_timedwait(&cma_queue.over, &cma_queue.lock, &until) != ETIMEDOUT) {}
    idle = !cma_queue.head && !cma_queue.busy;
    pthread_mutex_unlock(&cma_queue.lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

/* wait(timeout_s=None) -> True once the read is over; False if timeout_s passed first.  The caller runs the
 * read's pieces no thread has started yet itself (cma_wait_done), except with timeout_s 0: a look. */
static PyObject *cma_wait(CmaReadObject *r, PyObject *args) {
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout)) return NULL;
    double t = -1.0;
    if (timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (t < 0) t = 0;
    }
    return PyBool_FromLong(cma_wait_done(r, t));
}

static PyObject *cma_done(CmaReadObject *r, PyObject *unused) {
    pthread_mutex_lock(&cma_queue.lock); /* held only for queue updates, never while copying */
    int done = cma_over(r);
    pthread_mutex_unlock(&cma_queue.lock);
    return PyBool_FromLong(done);
}

/* result() -> (bytes copied, seal word); waits for the end; OSError if the data read failed. */
static PyObject *cma_result(CmaReadObject *r, PyObject *unused) {
    cma_wait_done(r, -1.0);
    if (r->err) {
        errno = r->err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(KK)", (unsigned long long)r->total, (unsigned long long)r->word);
}

static void cma_dealloc(CmaReadObject *r) {
    cma_wait_done(r, -1.0); /* a queued or running read still uses r: it must be over first */
    descs_release(&r->d);
    vec_release(&r->fds);
    free(r->placed);
    free(r->expanded);
    free(r->sums);
    PyObject_Free(r);
}

/* checked() -> (sums, whole, errno), for a file_start() or a cma_start(parts=): waits for the end; `sums`
 * holds the crc32c of each block as little-endian uint32s, valid for the first `whole` blocks (moved whole,
 * before any that was short or failed); errno: why a block failed (0: a read came short, or none failed). */
static PyObject *cma_checked(CmaReadObject *r, PyObject *unused) {
    if (!r->parts) return PyErr_Format(PyExc_TypeError, "checked(): not a checked read (file_start, cma_start(parts=))");
    cma_wait_done(r, -1.0);
    return Py_BuildValue("(y#ni)", (const char *)r->sums, (Py_ssize_t)(4 * (r->d.n / r->parts)), r->whole, r->err);
}

static PyMethodDef cma_methods[] = {
    {"wait", (PyCFunction)cma_wait, METH_VARARGS, "wait(timeout_s=None) -> bool: over (GIL released)"},
    {"done", (PyCFunction)cma_done, METH_NOARGS, "done() -> bool, without waiting"},
    {"result", (PyCFunction)cma_result, METH_NOARGS, "result() -> (bytes copied, seal word); OSError on failure"},
    {"checked", (PyCFunction)cma_checked, METH_NOARGS, "checked() -> (sums, whole, errno) of a checked read"},
    {NULL}};

static PyTypeObject CmaReadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.CmaRead",
    .tp_doc = "a cma_read running on a native thread (made by cma_start())",
    .tp_basicsize = sizeof(CmaReadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)cma_dealloc,
    .tp_methods = cma_methods,
};

/* ------------------------------------------------------------------------------- files and crc32c */

/* A store's file I/O and its checksums, with the GIL released and no Python object per block.  A block
 * of a CPU KV is tens of pieces (one per layer); moving and checking them from Python cost ~0.1 ms per
 * 2 MiB block here, and google-crc32c holds the GIL for pieces under 1 MiB, so a second IO thread waited
 * instead of reading (connectors/fs.py). */

/* Move descriptors [lo, hi): remote = file offset, local = memory address, each of its own file (fds: a
 * descriptor's fd, or one for all).  Descriptors whose file ranges continue each other in one file go to
 * the kernel as one preadv/pwritev (up to IOV_MAX pieces).  A read stops at the end of the file.  Returns
 * 0 or an errno; *total = bytes moved. */
static int file_range(const vec_arg *fds, const descs *d, Py_ssize_t lo, Py_ssize_t hi, int write, uint64_t *total) {
    static __thread struct iovec iov[IOV_MAX];
    *total = 0;
    Py_ssize_t i = lo;
    while (i < hi) {
        uint64_t offset = vec_u64(&d->remote, i), end = offset;
        int fd = (int)vec_u64(fds, i);
        int k = 0;
        for (; i < hi && k < IOV_MAX && vec_u64(&d->remote, i) == end && (int)vec_u64(fds, i) == fd; i++, k++) {
            uint64_t n = vec_u64(&d->lengths, i);
            iov[k] = (struct iovec){(void *)(uintptr_t)vec_u64(&d->local, i), n};
            end += n;
        }
        int first = 0;
        for (;;) {
            while (first < k && iov[first].iov_len == 0) first++; /* empty pieces move nothing: a 0 is no EOF */
            if (first == k) break;
            ssize_t got = write ? pwritev(fd, iov + first, k - first, (off_t)offset)
                                : preadv(fd, iov + first, k - first, (off_t)offset);
            if (got < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            if (got == 0) return write ? EIO : 0; /* the end of the file: the caller sees the short total */
            *total += (uint64_t)got;
            offset += (uint64_t)got;
            size_t left = (size_t)got; /* drop what moved; a piece may be cut in the middle */
            while (first < k && left >= iov[first].iov_len) left -= iov[first++].iov_len;
            if (first < k) {
                iov[first].iov_base = (char *)iov[first].iov_base + left;
                iov[first].iov_len -= left;
            }
        }
    }
    return 0;
}

/* crc32c (Castagnoli, as google-crc32c and iSCSI) with the SSE4.2 instruction, three lanes at once: one
 * lane waits 3 cycles per 8 bytes on the instruction's latency, three interleaved lanes keep it busy
 * (~3x).  Lanes b and c start from 0 and are joined by linearity: crc(s, A B) = shift(crc(s, A)) ^ crc(0,
 * B), where shift moves a state over CRC_LANE zero bytes, a linear map applied by four table lookups.
 *
 * Where the CPU also has VPCLMULQDQ (carry-less multiply on 256-bit registers: AMD Zen 3, Intel Ice Lake
 * and later), a round of CRC_ROUND bytes runs two engines at once (crc_round): the first half is folded
 * by carry-less multiplies, the second half goes through the crc32 instruction in four lanes.  They use
 * different execution units, so the round costs about what either half would alone: measured here
 * 33 GB/s on 8 MiB against 22 for the three lanes. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CRC_LANE 2048                  /* bytes per lane per round */
#define CRC_FOLDED (4 * CRC_LANE)      /* bytes a round folds by carry-less multiplies */
#define CRC_ROUND (CRC_FOLDED + 4 * CRC_LANE)

static uint32_t crc_shift_table[4][256];
static int crc_fold;  /* 1: it also has AVX2, PCLMULQDQ and VPCLMULQDQ (crc_round) */
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
static void crc_init(void) {
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
static void crc_init(void) {}
static int crc_fold;
static uint32_t crc_update(uint32_t s, const unsigned char *p, size_t n, int fold) { return s; }
#endif

/* crc32c(addresses, lengths, parts, *, fold=True) -> bytes: the crc32c of each run of `parts` consecutive
 * pieces (a block's pieces, in order), as little-endian uint32s; the GIL released. */
static PyObject *py_crc32c(PyObject *mod, PyObject *args, PyObject *kw) {
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
static uint32_t descs_crc_update(uint32_t s, const descs *d, Py_ssize_t j, Py_ssize_t k) {
    for (; j < k; j++) s = crc_update(s, (const unsigned char *)(uintptr_t)vec_u64(&d->local, j), vec_u64(&d->lengths, j), 1);
    return s;
}

/* The crc32c of descriptors [i, i + n), as crc32c() gives it. */
static uint32_t descs_crc(const descs *d, Py_ssize_t i, Py_ssize_t n) {
    return ~descs_crc_update(0xFFFFFFFFu, d, i, i + n);
}

/* cma_start(parts=)'s work on one thread: blocks [lo / parts, hi / parts) copied one after another, each
 * block's crc32c taken where it landed right after its copy, while its bytes are in the cache (a store's
 * copy of its own objects: checked as they are copied, not in a second pass over memory). */
static int copy_checked(CmaReadObject *r, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    *total = 0;
    for (Py_ssize_t i = lo; i < hi; i += r->parts) {
        *total += local_copy(&r->d, i, i + r->parts, r->streaming);
        uint32_t sum = descs_crc(&r->d, i, r->parts);
        memcpy(&r->sums[i / r->parts], &sum, 4); /* x86-64 (crc_ready): little-endian, as crc32c() writes */
    }
    return 0;
}

#define CRC_STRETCH (256u << 10) /* a read's block is summed a stretch at a time, after that stretch's read */

/* Block i of r (its r->parts descriptors) read from its file and summed a stretch at a time: each stretch's
 * sum reads bytes its read just wrote, still in the core's own cache (a 2 MiB block read whole, then summed,
 * was summed out of L3: a single-threaded 8 MiB read and check measured 7.7-8.9 GB/s here against 9.3-9.9 in
 * 256 KiB stretches).  Writes stay whole blocks (file_checked): a pwritev per stretch cost more in the
 * filesystem than the sums gained (32 MiB of new files: 5.9 GB/s whole, 4.4 in stretches).  Returns 0 or an
 * errno; *got = bytes read, *sum the block's crc32c (whole only if *got is the block's length). */
static int read_summed(CmaReadObject *r, Py_ssize_t i, uint64_t *got, uint32_t *sum) {
    const descs *d = &r->d;
    uint32_t s = 0xFFFFFFFFu;
    *got = 0;
    for (Py_ssize_t j = i, k; j < i + r->parts; j = k) {
        uint64_t want = vec_u64(&d->lengths, j), moved = 0;
        for (k = j + 1; k < i + r->parts && want + vec_u64(&d->lengths, k) <= CRC_STRETCH; k++) want += vec_u64(&d->lengths, k);
        int err = file_range(&r->fds, d, j, k, 0, &moved);
        *got += moved;
        if (err || moved < want) return err;
        s = descs_crc_update(s, d, j, k);
    }
    *sum = ~s;
    return 0;
}

/* file_start()'s work on one thread: blocks [lo / parts, hi / parts) moved and checked one after
 * another, each block's crc taken next to its move, while its bytes are in the cache (a write's before,
 * a read's after).  A block that comes short or fails ends the piece and lowers r->whole to it; the
 * blocks after it are not moved. */
static int file_checked(CmaReadObject *r, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    const descs *d = &r->d;
    *total = 0;
    for (Py_ssize_t i = lo; i < hi; i += r->parts) {
        uint64_t want = 0, got = 0;
        for (Py_ssize_t j = i; j < i + r->parts; j++) want += vec_u64(&d->lengths, j);
        uint32_t sum = r->write ? descs_crc(d, i, r->parts) : 0;
        int err = r->write ? file_range(&r->fds, d, i, i + r->parts, 1, &got) : read_summed(r, i, &got, &sum);
        *total += got;
        if (err || got < want) {
            pthread_mutex_lock(&cma_queue.lock);
            if (i / r->parts < r->whole) r->whole = i / r->parts;
            pthread_mutex_unlock(&cma_queue.lock);
            return err;
        }
        memcpy(&r->sums[i / r->parts], &sum, 4); /* x86-64 (crc_ready): little-endian, as crc32c() writes */
    }
    return 0;
}

/* Each descriptor's file and offset, from file_start()'s runs: a run (fd, offset, blocks) holds its
 * blocks back to back from offset, as a store's object does, so a descriptor lies where the run's
 * descriptors before it end.  Made here in one pass: as numpy arrays it was a dozen calls on the
 * engine's thread, ~50 us of a load's start here. */
static int file_runs(CmaReadObject *r, PyObject *runs) {
    PyObject *seq = PySequence_Fast(runs, "file_start: runs must be a sequence of (fd, offset, blocks)");
    if (!seq) return -1;
    Py_ssize_t n = r->d.n, k = 0;
    r->placed = malloc(2 * (size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!r->placed) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *fds = r->placed, *offsets = r->placed + n;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        int fd;
        long long offset;
        Py_ssize_t blocks;
        PyObject *run = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(run)) {
            PyErr_Format(PyExc_TypeError, "file_start: a run is (fd, offset, blocks), not %.80s", Py_TYPE(run)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(run, "iLn;file_start: a run is (fd, offset, blocks)", &fd, &offset, &blocks)) goto fail;
        if (offset < 0 || blocks < 0 || blocks > (n - k) / r->parts) {
            PyErr_Format(PyExc_ValueError, "file_start: run %zd (offset %lld, %zd blocks) is negative or past the "
                         "%zd blocks described", i, offset, blocks, n / r->parts);
            goto fail;
        }
        for (Py_ssize_t end = k + blocks * r->parts; k < end; k++) {
            fds[k] = (uint64_t)fd;
            offsets[k] = (uint64_t)offset;
            offset += (long long)vec_u64(&r->d.lengths, k);
        }
    }
    Py_DECREF(seq);
    if (k != n) {
        PyErr_Format(PyExc_ValueError, "file_start: the runs hold %zd blocks, the descriptors %zd", k / r->parts,
                     n / r->parts);
        return -1;
    }
    r->fds = (vec_arg){.data = fds, .n = n, .itemsize = 8};
    r->d.remote = (vec_arg){.data = offsets, .n = n, .itemsize = 8};
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* file_start(block_ids=, block_stride=): every block's descriptors made from block 0's, `parts` addresses
 * and lengths: piece p of the i-th block is at block_ids[i] * block_stride + addresses[p].  Made here, a
 * load's start on the engine's thread builds no array: as numpy (BlockAddressing.by_block) it took
 * 0.15-0.3 ms of a cold 8 MiB load here, a tenth of the load. */
static int file_blocks(CmaReadObject *r, PyObject *ids, unsigned long long stride, Py_ssize_t parts) {
    descs *d = &r->d;
    if (parts <= 0 || d->n != parts) {
        PyErr_Format(PyExc_ValueError, "file_start: with block_ids, addresses are one block's %zd pieces, not %zd",
                     parts, d->n);
        return -1;
    }
    PyObject *seq = PySequence_Fast(ids, "file_start: block_ids must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t blocks = PySequence_Fast_GET_SIZE(seq), n = blocks * parts;
    r->expanded = malloc(2 * (size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!r->expanded) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *local = r->expanded, *lengths = r->expanded + n;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, b), PyExc_OverflowError);
        if (id < 0) { /* numpy's integers too (__index__); a negative id names no block */
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "file_start: block id %zd is negative", id);
            Py_DECREF(seq);
            return -1;
        }
        for (Py_ssize_t p = 0; p < parts; p++) {
            local[b * parts + p] = (uint64_t)id * stride + vec_u64(&d->local, p);
            lengths[b * parts + p] = vec_u64(&d->lengths, p);
        }
    }
    Py_DECREF(seq);
    vec_release(&d->local);
    vec_release(&d->lengths);
    d->local = (vec_arg){.data = local, .n = n, .itemsize = 8};
    d->lengths = (vec_arg){.data = lengths, .n = n, .itemsize = 8};
    d->n = n;
    return 0;
}

/* file_start(runs, addresses, lengths, parts, *, write=False, cut_bytes) -> CmaRead: a store's load or
 * save on the native threads.  Every `parts` descriptors (address, length) are one block, read into
 * place from its run's file (or written there from it) and its crc32c taken; blocks are cut between the
 * threads from cut_bytes.  One call instead of a Python thread per stretch of blocks: handing those out
 * and joining them cost more than the read here (~0.35 ms of an 8 MiB load).  The caller keeps the files
 * open and the memory alive until checked() returned. */
static PyObject *py_file_start(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"runs", "addresses", "lengths", "parts", "write", "cut_bytes", "block_ids",
                             "block_stride", NULL};
    PyObject *runs, *ao, *no, *ids = Py_None;
    Py_ssize_t parts;
    int write = 0;
    unsigned long long cut = CMA_CUT_BYTES, stride = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOn|$pKOK", kwlist, &runs, &ao, &no, &parts, &write, &cut, &ids,
                                     &stride))
        return NULL;
    CmaReadObject *r = PyObject_New(CmaReadObject, &CmaReadType);
    if (!r) return NULL;
    cma_clear(r);
    descs *d = &r->d;
    if (vec_parse(ao, "addresses", 8, 0, &d->local) < 0) goto fail;
    d->n = d->local.n;
    if (vec_parse(no, "lengths", 8, 1, &d->lengths) < 0) goto fail;
    if (d->lengths.n >= 0 && d->lengths.n != d->n) {
        PyErr_Format(PyExc_ValueError, "file_start: %zd lengths for %zd addresses", d->lengths.n, d->n);
        goto fail;
    }
    if (ids != Py_None && file_blocks(r, ids, stride, parts) < 0) goto fail;
    if (cma_check_blocks(r, parts, "file_start") < 0 || file_runs(r, runs) < 0) goto fail;
    r->file = 1;
    r->write = write;
    r->cut_bytes = cut;
    return cma_queued(r);
fail:
    Py_DECREF(r);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ Context */

enum { CTX_OPEN, CTX_CLOSING, CTX_CLOSED };

struct ContextObject;

/* Regions and endpoints start with this header: the context keeps them on a list (GIL-protected) so
 * close() can release them before the worker they belong to. */
#define CHILD_HEAD                      \
    PyObject_HEAD                       \
    struct ContextObject *ctx;          \
    struct ChildObject *prev, *next;

typedef struct ChildObject {
    CHILD_HEAD
} ChildObject;

typedef struct ContextObject {
    PyObject_HEAD
    ucp_context_h ucp;
    ucp_worker_h worker;
    int efd;
    pthread_mutex_t lock;  /* every ucp call on ucp/worker, and the fields below */
    pthread_cond_t idle;   /* signalled when busy drops to 0 */
    int busy;              /* calls inside a transfer or close with the mutex dropped */
    int state;
    int have_thread;
    pthread_t thread;
    atomic_int stop;
    PyObject *address;     /* bytes, read once */
    PyObject *config;      /* dict: key -> value kvbridge set (Context(config=)), the user's and absent ones aside */
    PyObject *config_text; /* str: ucp_config_print of the configuration ucp_init was given */
    ChildObject *children;
} ContextObject;

static PyTypeObject ContextType, RegionType, EndpointType;

static void child_link(ContextObject *c, ChildObject *ch) {
    Py_INCREF(c);
    ch->ctx = c;
    ch->prev = NULL;
    ch->next = c->children;
    if (c->children) c->children->prev = ch;
    c->children = ch;
}

static void child_unlink(ChildObject *ch) {
    ContextObject *c = ch->ctx;
    if (c == NULL) return;
    if (ch->prev) ch->prev->next = ch->next;
    else c->children = ch->next;
    if (ch->next) ch->next->prev = ch->prev;
    ch->ctx = NULL;
    Py_DECREF(c);
}

static void busy_enter(ContextObject *c) { c->busy++; } /* mutex held */

static void busy_leave(ContextObject *c) { /* mutex held */
    if (--c->busy == 0) pthread_cond_broadcast(&c->idle);
}

/* Sleep on the worker's event fd (mutex NOT held) for at most ms; a no-op wait if arming fails. */
static void wait_events(ContextObject *c, int ms) {
    pthread_mutex_lock(&c->lock);
    ucs_status_t st = ucp_worker_arm(c->worker);
    pthread_mutex_unlock(&c->lock);
    if (st == UCS_OK) {
        struct pollfd p = {.fd = c->efd, .events = POLLIN};
        poll(&p, 1, ms);
    } else if (st != UCS_ERR_BUSY) {
        usleep(200); /* this worker cannot sleep on events: poll it slowly instead */
    }
}

/* The passive side of a GET over tcp/sm is served by this worker's progress, so a producer runs this
 * thread for as long as its context lives.  It never touches Python. */
static void *progress_main(void *arg) {
    ContextObject *c = arg;
    while (!atomic_load(&c->stop)) {
        unsigned n = 1;
        pthread_mutex_lock(&c->lock);
        for (int i = 0; i < THREAD_BATCH && n; i++) n = ucp_worker_progress(c->worker);
        pthread_mutex_unlock(&c->lock);
        if (n) continue; /* still busy: let a caller take the mutex, then go on */
        wait_events(c, THREAD_POLL_MS);
    }
    return NULL;
}

/* One UCX option for the context, from Context(config=...).  `key` is the name without the UCX_ prefix. */
typedef struct {
    const char *key, *value;
    int optional; /* a key this UCX may not know (its module absent): refused, it is left out, not an error */
    int state;    /* CFG_SET, CFG_USER (the user's UCX_<key> wins), CFG_ABSENT (optional, refused) */
} cfg_item;

enum { CFG_SET, CFG_USER, CFG_ABSENT };

/* Apply the options to cfg before ucp_init.  A key whose UCX_<key> variable the user set is skipped: the
 * environment is how an operator overrides kvbridge, so it must win.  ucp_config_modify answers "Invalid
 * parameter" both for an unknown key and for a bad value; an optional key is one kvbridge sets to a value
 * it knows is valid, so there the refusal can only mean that the module owning the key is not loaded
 * (e.g. CUDA_IPC_* without libcuda): it is recorded, not raised. */
static int cfg_apply(ucp_config_t *cfg, cfg_item *items, Py_ssize_t n) {
    char env[256];
    for (Py_ssize_t i = 0; i < n; i++) {
        snprintf(env, sizeof(env), "UCX_%s", items[i].key);
        if (getenv(env) != NULL) {
            items[i].state = CFG_USER;
            continue;
        }
        ucs_status_t st = ucp_config_modify(cfg, items[i].key, items[i].value);
        if (st == UCS_OK) items[i].state = CFG_SET;
        else if (items[i].optional) items[i].state = CFG_ABSENT;
        else {
            PyErr_Format(PyExc_ValueError, "UCX option %s=%s: %s", items[i].key, items[i].value, ucs_status_string(st));
            return -1;
        }
    }
    return 0;
}

/* What ucp_config_print shows of cfg (its own keys, then the transport keys it holds for ucp_init):
 * how a caller reads back that an option reached UCX. */
static PyObject *cfg_text(ucp_config_t *cfg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return PyErr_SetFromErrno(PyExc_OSError);
    ucp_config_print(cfg, f, NULL, UCS_CONFIG_PRINT_CONFIG);
    fclose(f);
    PyObject *s = PyUnicode_DecodeUTF8(buf ? buf : "", (Py_ssize_t)len, "replace");
    free(buf);
    return s;
}

static int ctx_start(ContextObject *c, const char *tls, cfg_item *items, Py_ssize_t nitems) {
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_config_read", st), -1;
    if (tls) st = ucp_config_modify(cfg, "TLS", tls);
    if (st != UCS_OK) {
        ucp_config_release(cfg);
        return ucs_error(PyExc_RuntimeError, "ucp_config_modify(TLS)", st), -1;
    }
    if (cfg_apply(cfg, items, nitems) < 0 || !(c->config_text = cfg_text(cfg))) {
        ucp_config_release(cfg);
        return -1;
    }
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
    Py_BEGIN_ALLOW_THREADS
    st = ucp_init(&p, cfg, &c->ucp);
    Py_END_ALLOW_THREADS
    ucp_config_release(cfg);
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_init", st), -1;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_create(c->ucp, &wp, &c->worker);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_worker_create", st), -1;
    st = ucp_worker_get_efd(c->worker, &c->efd);
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_worker_get_efd", st), -1;
    ucp_address_t *addr;
    size_t len;
    st = ucp_worker_get_address(c->worker, &addr, &len);
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_worker_get_address", st), -1;
    c->address = PyBytes_FromStringAndSize((const char *)addr, (Py_ssize_t)len);
    ucp_worker_release_address(c->worker, addr);
    return c->address ? 0 : -1;
}

/* Undo ctx_start (and the thread); only once no child holds ucp resources. */
static void ctx_destroy_ucp(ContextObject *c) {
    pthread_mutex_lock(&c->lock);
    if (c->worker) ucp_worker_destroy(c->worker);
    if (c->ucp) ucp_cleanup(c->ucp);
    c->worker = NULL;
    c->ucp = NULL;
    c->state = CTX_CLOSED;
    pthread_mutex_unlock(&c->lock);
}

static void ctx_stop_thread(ContextObject *c) {
    if (!c->have_thread) return;
    atomic_store(&c->stop, 1);
    ucp_worker_signal(c->worker); /* safe from any thread: wakes the poll() at once */
    pthread_join(c->thread, NULL);
    c->have_thread = 0;
}

/* Context(config=, optional=): the mapping's items as cfg_items; `keep` holds the str objects they point
 * into.  Returns the count, or -1 with the error set. */
static Py_ssize_t cfg_parse(PyObject *config, PyObject *optional, PyObject **keep, cfg_item **out) {
    *keep = NULL;
    *out = NULL;
    if (config == Py_None) return 0;
    if (!PyMapping_Check(config)) return PyErr_SetString(PyExc_TypeError, "config: expected a mapping of str to str"), -1;
    PyObject *items = PyMapping_Items(config);
    if (!items) return -1;
    Py_ssize_t n = PyList_GET_SIZE(items);
    cfg_item *v = calloc((size_t)(n ? n : 1), sizeof(*v));
    if (!v) return Py_DECREF(items), PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *kv = PyList_GET_ITEM(items, i), *k = PyTuple_GET_ITEM(kv, 0), *val = PyTuple_GET_ITEM(kv, 1);
        if (!PyUnicode_Check(k) || !PyUnicode_Check(val)) {
            PyErr_SetString(PyExc_TypeError, "config: expected a mapping of str to str");
            goto fail;
        }
        v[i].key = PyUnicode_AsUTF8(k);
        v[i].value = PyUnicode_AsUTF8(val);
        if (!v[i].key || !v[i].value) goto fail;
        if (!v[i].key[0] || strncmp(v[i].key, "UCX_", 4) == 0 || strlen(v[i].key) > 200) {
            PyErr_Format(PyExc_ValueError, "config: '%s' is not a UCX option name (no UCX_ prefix)", v[i].key);
            goto fail;
        }
        int opt = optional != Py_None ? PySequence_Contains(optional, k) : 0;
        if (opt < 0) goto fail;
        v[i].optional = opt;
    }
    *keep = items;
    *out = v;
    return n;
fail:
    Py_DECREF(items);
    free(v);
    return -1;
}

static PyObject *cfg_applied(const cfg_item *items, Py_ssize_t n) {
    PyObject *d = PyDict_New();
    for (Py_ssize_t i = 0; d && i < n; i++) {
        if (items[i].state != CFG_SET) continue;
        PyObject *v = PyUnicode_FromString(items[i].value);
        if (!v || PyDict_SetItemString(d, items[i].key, v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *context_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"tls", "progress_thread", "config", "optional", NULL};
    const char *tls = NULL;
    int thread = 0;
    PyObject *config = Py_None, *optional = Py_None, *keep = NULL;
    cfg_item *items = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zpOO", kwlist, &tls, &thread, &config, &optional)) return NULL;
    if (optional != Py_None && !PySequence_Check(optional))
        return PyErr_SetString(PyExc_TypeError, "optional: expected a sequence of option names"), NULL;
    Py_ssize_t nitems = cfg_parse(config, optional, &keep, &items);
    if (nitems < 0) return NULL;
    ContextObject *c = (ContextObject *)type->tp_alloc(type, 0);
    if (!c) goto fail;
    c->efd = -1;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->idle, NULL);
    atomic_init(&c->stop, 0);
    c->state = CTX_CLOSING; /* until started: dealloc then only destroys what exists */
    if (ctx_start(c, tls, items, nitems) < 0 || !(c->config = cfg_applied(items, nitems))) goto fail;
    if (thread) {
        int err = pthread_create(&c->thread, NULL, progress_main, c);
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        c->have_thread = 1;
    }
    c->state = CTX_OPEN;
    Py_XDECREF(keep);
    free(items);
    return (PyObject *)c;
fail:
    Py_XDECREF(c);
    Py_XDECREF(keep);
    free(items);
    return NULL;
}

static int region_release(ChildObject *ch);
static int endpoint_release(ChildObject *ch, int force);

/* Close in dependency order: thread, in-flight calls, endpoints (their rkeys), regions, worker, context. */
static int ctx_close(ContextObject *c) {
    pthread_mutex_lock(&c->lock);
    int mine = c->state == CTX_OPEN;
    if (mine) c->state = CTX_CLOSING;
    pthread_mutex_unlock(&c->lock);
    if (!mine) return 0; /* closed already, or another thread is closing it */
    int idle = 1;
    Py_BEGIN_ALLOW_THREADS
    ctx_stop_thread(c);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)IDLE_WAIT_S;
    pthread_mutex_lock(&c->lock);
    while (c->busy > 0 && idle) idle = pthread_cond_timedwait(&c->idle, &c->lock, &until) != ETIMEDOUT;
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (!idle) {
        /* a transfer is still inside ucp: destroying the worker now would crash it; stay CLOSING */
        PyErr_SetString(PyExc_RuntimeError, "Context.close: transfers still running after 30 s");
        return -1;
    }
    /* endpoints first: their close may need the regions' memory handles to be retired */
    for (int pass = 0; pass < 2; pass++) {
        PyObject *kids = PyList_New(0);
        if (!kids) return -1;
        for (ChildObject *ch = c->children; ch; ch = ch->next)
            if (PyList_Append(kids, (PyObject *)ch) < 0) return Py_DECREF(kids), -1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(kids); i++) {
            ChildObject *ch = (ChildObject *)PyList_GET_ITEM(kids, i);
            int rc = 0;
            if (pass == 0 && Py_IS_TYPE(ch, &EndpointType)) rc = endpoint_release(ch, 0);
            if (pass == 1 && Py_IS_TYPE(ch, &RegionType)) rc = region_release(ch);
            if (rc < 0) PyErr_Clear(); /* cannot be busy once idle; never leave close half done */
        }
        Py_DECREF(kids);
    }
    Py_BEGIN_ALLOW_THREADS
    ctx_destroy_ucp(c);
    Py_END_ALLOW_THREADS
    return 0;
}

static void context_dealloc(ContextObject *c) {
    /* children hold references, so none is alive here: only the thread and ucp objects remain */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (c->state == CTX_OPEN) {
        if (ctx_close(c) < 0) PyErr_WriteUnraisable((PyObject *)c);
    } else if (c->state == CTX_CLOSING) { /* construction failed part way */
        ctx_stop_thread(c);
        ctx_destroy_ucp(c);
    }
    PyErr_Restore(et, ev, tb);
    Py_XDECREF(c->address);
    Py_XDECREF(c->config);
    Py_XDECREF(c->config_text);
    pthread_cond_destroy(&c->idle);
    pthread_mutex_destroy(&c->lock);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int ctx_check_open(ContextObject *c) { /* GIL held; state only changes from OPEN under GIL+mutex */
    if (c->state == CTX_OPEN) return 0;
    PyErr_SetString(PyExc_ValueError, "Context is closed");
    return -1;
}

static PyObject *context_close(ContextObject *c, PyObject *unused) {
    if (ctx_close(c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *context_address(ContextObject *c, void *closure) {
    if (ctx_check_open(c) < 0) return NULL;
    return Py_NewRef(c->address);
}

static PyObject *context_closed(ContextObject *c, void *closure) { return PyBool_FromLong(c->state != CTX_OPEN); }
static PyObject *context_config(ContextObject *c, void *closure) { return PyDict_Copy(c->config); }
static PyObject *context_config_text(ContextObject *c, void *closure) { return Py_NewRef(c->config_text); }

static PyObject *context_progress(ContextObject *c, PyObject *unused) {
    unsigned n = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    ok = c->state == CTX_OPEN;
    if (ok) n = ucp_worker_progress(c->worker);
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_SetString(PyExc_ValueError, "Context is closed"), NULL;
    return PyLong_FromUnsignedLong(n);
}

/* ------------------------------------------------------------------------------------------- Region */

typedef struct {
    CHILD_HEAD
    ucp_mem_h memh;
    uint64_t address, length;
    ucs_memory_type_t mtype;
    int inuse; /* transfers using memh right now (mutex) */
    PyObject *rkey;
} RegionObject;

static const struct {
    const char *name;
    ucs_memory_type_t type;
} MEMORY_TYPES[] = {
    {"host", UCS_MEMORY_TYPE_HOST},
    {"cuda", UCS_MEMORY_TYPE_CUDA},
    {"cuda-managed", UCS_MEMORY_TYPE_CUDA_MANAGED},
};

static int memory_type_parse(const char *name, ucs_memory_type_t *out) {
    for (size_t i = 0; i < sizeof(MEMORY_TYPES) / sizeof(MEMORY_TYPES[0]); i++)
        if (strcmp(name, MEMORY_TYPES[i].name) == 0) return *out = MEMORY_TYPES[i].type, 0;
    PyErr_Format(PyExc_ValueError, "memory_type: '%s' is not one of host, cuda, cuda-managed", name);
    return -1;
}

/* Map and pack under one mutex hold; on any failure nothing stays mapped. */
static ucs_status_t region_map(ContextObject *c, RegionObject *r, const char **what, void **buf, size_t *len) {
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        .address = (void *)(uintptr_t)r->address,
        .length = r->length,
        .memory_type = r->mtype,
    };
    ucs_status_t st = UCS_ERR_CANCELED;
    *what = "Context is closed";
    pthread_mutex_lock(&c->lock);
    if (c->state == CTX_OPEN) {
        *what = "ucp_mem_map";
        st = ucp_mem_map(c->ucp, &mp, &r->memh);
        if (st == UCS_OK) {
            *what = "ucp_rkey_pack";
            st = ucp_rkey_pack(c->ucp, r->memh, buf, len);
            if (st != UCS_OK) ucp_mem_unmap(c->ucp, r->memh), r->memh = NULL;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static PyObject *context_map(ContextObject *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"address", "length", "memory_type", NULL};
    unsigned long long addr, length;
    const char *mt = "host";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|s", kwlist, &addr, &length, &mt)) return NULL;
    ucs_memory_type_t type;
    if (memory_type_parse(mt, &type) < 0 || ctx_check_open(c) < 0) return NULL;
    if (length == 0 || addr == 0 || addr + length < addr)
        return PyErr_SetString(PyExc_ValueError, "map: need a non-empty range at a non-null address"), NULL;
    RegionObject *r = PyObject_New(RegionObject, &RegionType);
    if (!r) return NULL;
    r->ctx = NULL;
    r->memh = NULL;
    r->rkey = NULL;
    r->address = addr;
    r->length = length;
    r->mtype = type;
    r->inuse = 0;
    const char *what;
    ucs_status_t st;
    void *buf = NULL;
    size_t len = 0;
    Py_BEGIN_ALLOW_THREADS
    st = region_map(c, r, &what, &buf, &len);
    Py_END_ALLOW_THREADS
    if (st == UCS_OK) {
        /* packed once: the key never changes while the region is mapped */
        r->rkey = PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
        ucp_rkey_buffer_release(buf);
    }
    if (st != UCS_OK || !r->rkey) {
        PyObject *exc = st == UCS_ERR_CANCELED ? PyExc_ValueError : PyExc_RuntimeError;
        if (st == UCS_OK) { /* out of memory for the bytes: undo the mapping */
            pthread_mutex_lock(&c->lock);
            ucp_mem_unmap(c->ucp, r->memh);
            pthread_mutex_unlock(&c->lock);
            r->memh = NULL;
        } else if (st == UCS_ERR_CANCELED) {
            PyErr_SetString(exc, what);
        } else {
            ucs_error(exc, what, st);
        }
        Py_DECREF(r);
        return NULL;
    }
    child_link(c, (ChildObject *)r);
    return (PyObject *)r;
}

static int region_release(ChildObject *ch) { /* GIL held */
    RegionObject *r = (RegionObject *)ch;
    ContextObject *c = r->ctx;
    int busy = 0;
    if (c == NULL) return 0;
    Py_BEGIN_ALLOW_THREADS /* deregistering a large (or GPU) region can take a while */
    pthread_mutex_lock(&c->lock);
    if (r->inuse) busy = 1;
    else if (r->memh && c->ucp) ucp_mem_unmap(c->ucp, r->memh);
    if (!busy) r->memh = NULL;
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "Region.close: a transfer is using this region");
        return -1;
    }
    return 0;
}

static void region_dealloc(RegionObject *r) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    /* no transfer holds it now; one whose requests UCX never retired keeps it mapped until ucp_cleanup */
    if (region_release((ChildObject *)r) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    child_unlink((ChildObject *)r);
    Py_XDECREF(r->rkey);
    PyObject_Free(r);
}

static PyObject *region_close(RegionObject *r, PyObject *unused) {
    if (region_release((ChildObject *)r) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *region_rkey(RegionObject *r, void *closure) {
    if (r->memh == NULL) return PyErr_SetString(PyExc_ValueError, "Region is closed"), NULL;
    return Py_NewRef(r->rkey);
}

static PyObject *region_address(RegionObject *r, void *c) { return PyLong_FromUnsignedLongLong(r->address); }
static PyObject *region_length(RegionObject *r, void *c) { return PyLong_FromUnsignedLongLong(r->length); }
static PyObject *region_closed(RegionObject *r, void *c) { return PyBool_FromLong(r->memh == NULL); }

static PyObject *region_memory_type(RegionObject *r, void *c) {
    for (size_t i = 0; i < sizeof(MEMORY_TYPES) / sizeof(MEMORY_TYPES[0]); i++)
        if (MEMORY_TYPES[i].type == r->mtype) return PyUnicode_FromString(MEMORY_TYPES[i].name);
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------------------------- Endpoint */

typedef struct {
    CHILD_HEAD
    ucp_ep_h ep;            /* NULL once closed or failed */
    ucp_rkey_h *rkeys;
    uint32_t nrkeys, cap;
    ucs_status_t peer;      /* written by the error callback, under the mutex (it runs inside progress) */
    int inflight;           /* transfers on this endpoint right now */
    int closing;            /* close() under way: no new transfer may start */
    int error_handling;
    char failed[192];       /* why it became unusable; "" while healthy */
} EndpointObject;

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    EndpointObject *e = arg; /* no Python here: runs in whichever thread progressed the worker */
    if (e->peer == UCS_OK) e->peer = status;
}

static PyObject *context_connect(ContextObject *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"worker_address", "error_handling", NULL};
    Py_buffer addr;
    int eh = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|p", kwlist, &addr, &eh)) return NULL;
    if (ctx_check_open(c) < 0) return PyBuffer_Release(&addr), NULL;
    EndpointObject *e = PyObject_New(EndpointObject, &EndpointType);
    if (!e) return PyBuffer_Release(&addr), NULL;
    e->ctx = NULL;
    e->ep = NULL;
    e->rkeys = NULL;
    e->nrkeys = e->cap = 0;
    e->peer = UCS_OK;
    e->inflight = 0;
    e->closing = 0;
    e->error_handling = eh;
    e->failed[0] = '\0';
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *)addr.buf,
        .err_mode = eh ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (eh) {
        p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        p.err_handler.cb = ep_error_cb;
        p.err_handler.arg = e; /* e outlives its ucp ep: dealloc closes the ep before freeing e */
    }
    ucs_status_t st = UCS_ERR_CANCELED;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    if (c->state == CTX_OPEN) st = ucp_ep_create(c->worker, &p, &e->ep);
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addr);
    if (st != UCS_OK) {
        e->ep = NULL;
        Py_DECREF(e);
        if (st == UCS_ERR_CANCELED) return PyErr_SetString(PyExc_ValueError, "Context is closed"), NULL;
        return ucs_error(PyExc_RuntimeError, "ucp_ep_create", st);
    }
    child_link(c, (ChildObject *)e);
    return (PyObject *)e;
}

static int req_done(void *req) { return req == NULL || ucp_request_check_status(req) != UCS_INPROGRESS; }

/* Progress until both requests completed or `until` passes; mutex NOT held on entry. */
static int wait_reqs(ContextObject *c, void *a, void *b, double until) {
    for (int spins = 0;;) {
        pthread_mutex_lock(&c->lock);
        unsigned n = ucp_worker_progress(c->worker);
        int done = req_done(a) && req_done(b);
        pthread_mutex_unlock(&c->lock);
        if (done) return 1;
        if (now_s() >= until) return 0;
        if (n) continue;
        if (++spins < IDLE_SPINS) sched_yield();
        else wait_events(c, WAIT_POLL_MS);
    }
}

static void free_req(void *req) { /* mutex held; frees now, or on completion if still in flight */
    if (req && UCS_PTR_IS_PTR(req)) ucp_request_free(req);
}

static void destroy_rkeys(EndpointObject *e) { /* mutex held */
    for (uint32_t i = 0; i < e->nrkeys; i++) ucp_rkey_destroy(e->rkeys[i]);
    free(e->rkeys);
    e->rkeys = NULL;
    e->nrkeys = e->cap = 0;
}

/* Close the ucp endpoint (mutex NOT held, GIL released).  `pending` is a request of ours still in
 * flight (a flush), or NULL.  Rkeys go only once nothing posted can still use them; if UCX does not
 * retire everything within the bound, they are leaked rather than freed under a live request. */
static int ep_shutdown(EndpointObject *e, int force, void *pending, double bound) {
    ContextObject *c = e->ctx;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    void *req = NULL;
    pthread_mutex_lock(&c->lock);
    if (e->ep) {
        ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &p);
        req = UCS_PTR_IS_PTR(r) ? r : NULL;
        e->ep = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    int done = wait_reqs(c, req, pending, now_s() + bound);
    pthread_mutex_lock(&c->lock);
    free_req(req);
    free_req(pending);
    if (done) destroy_rkeys(e);
    pthread_mutex_unlock(&c->lock);
    return done;
}

/* Endpoint.close / context close / dealloc.  GIL held on entry. */
static int endpoint_release(ChildObject *ch, int force) {
    EndpointObject *e = (EndpointObject *)ch;
    ContextObject *c = e->ctx;
    if (c == NULL) return 0;
    int busy = 0, open = 0;
    pthread_mutex_lock(&c->lock);
    if (e->inflight) busy = 1;
    else if (e->ep && !e->closing) open = 1, e->closing = 1, busy_enter(c); /* leaked rkeys stay leaked */
    pthread_mutex_unlock(&c->lock);
    if (busy) return PyErr_SetString(PyExc_RuntimeError, "Endpoint.close: a transfer is in flight"), -1;
    if (!open) return 0;
    Py_BEGIN_ALLOW_THREADS
    /* no transfer in flight: every posted operation has been flushed, so rkeys can go first */
    pthread_mutex_lock(&c->lock);
    if (e->ep) destroy_rkeys(e);
    pthread_mutex_unlock(&c->lock);
    ep_shutdown(e, force || e->peer != UCS_OK, NULL, CLOSE_WAIT_S); /* a failed peer acks nothing */
    pthread_mutex_lock(&c->lock);
    e->closing = 0;
    busy_leave(c);
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    return 0;
}

static void endpoint_dealloc(EndpointObject *e) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    endpoint_release((ChildObject *)e, 0);
    PyErr_Restore(et, ev, tb);
    child_unlink((ChildObject *)e);
    PyObject_Free(e);
}

static PyObject *endpoint_close(EndpointObject *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"force", NULL};
    int force = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p", kwlist, &force)) return NULL;
    if (endpoint_release((ChildObject *)e, force) < 0) return NULL;
    Py_RETURN_NONE;
}

/* A copy of e->failed (written by transfers in other threads, under the mutex); "" while healthy. */
static void ep_failed_copy(EndpointObject *e, char *out, size_t size) {
    pthread_mutex_lock(&e->ctx->lock);
    snprintf(out, size, "%s", e->failed);
    pthread_mutex_unlock(&e->ctx->lock);
}

/* Why this endpoint cannot be used, as a raised exception; 0 when it can.  GIL held. */
static int ep_check_usable(EndpointObject *e) {
    if (e->ctx == NULL || ctx_check_open(e->ctx) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Context is closed");
        return -1;
    }
    char failed[sizeof(e->failed)];
    ep_failed_copy(e, failed, sizeof(failed));
    if (failed[0]) return PyErr_SetString(PyExc_ConnectionError, failed), -1;
    if (e->ep == NULL || e->closing) return PyErr_SetString(PyExc_ValueError, "Endpoint is closed"), -1;
    return 0;
}

static PyObject *endpoint_add_rkey(EndpointObject *e, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (ep_check_usable(e) < 0) return PyBuffer_Release(&b), NULL;
    ContextObject *c = e->ctx;
    ucs_status_t st = UCS_OK;
    long idx = -1;
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock); /* the table is read by transfers under the same mutex */
    if (e->ep == NULL) st = UCS_ERR_CANCELED;
    else if (e->nrkeys == e->cap) {
        uint32_t cap = e->cap ? e->cap * 2 : 8;
        ucp_rkey_h *t = realloc(e->rkeys, cap * sizeof(*t));
        if (t) e->rkeys = t, e->cap = cap;
        else nomem = 1;
    }
    if (st == UCS_OK && !nomem) {
        ucp_rkey_h rk;
        st = ucp_ep_rkey_unpack(e->ep, b.buf, &rk);
        if (st == UCS_OK) e->rkeys[e->nrkeys] = rk, idx = (long)e->nrkeys++;
    }
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (nomem) return PyErr_NoMemory();
    if (st == UCS_ERR_CANCELED) return PyErr_SetString(PyExc_ValueError, "Endpoint is closed"), NULL;
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_ep_rkey_unpack", st);
    return PyLong_FromLong(idx);
}

/* One transfer's state, filled in with the GIL released. */
typedef struct {
    const descs *d;
    int is_get;
    double timeout;
    RegionObject *region; /* or NULL */
    uint64_t bytes;
    ucs_status_t status;  /* first error, UCS_OK if none */
    const char *what;     /* which call failed */
    enum { XF_OK, XF_BADARG, XF_CLOSED, XF_FAILED, XF_TIMEOUT } outcome;
    char msg[160];
} xfer;

/* Checks every descriptor before anything is posted, so bad input never leaves a half-done transfer. */
static int xfer_validate(xfer *x, uint32_t nrkeys) {
    const descs *d = x->d;
    uint64_t lo = x->region ? x->region->address : 0, hi = x->region ? lo + x->region->length : 0;
    for (Py_ssize_t i = 0; i < d->n; i++) {
        uint32_t k = vec_u32(&d->index, i);
        uint64_t l = vec_u64(&d->local, i), n = vec_u64(&d->lengths, i);
        if (k >= nrkeys) {
            snprintf(x->msg, sizeof(x->msg), "rkey_index[%zd] = %u, but the endpoint has %u rkeys", i, k, nrkeys);
            return -1;
        }
        if (x->region && n && (l < lo || l > hi || n > hi - l)) {
            snprintf(x->msg, sizeof(x->msg), "local[%zd]: %" PRIu64 " bytes at 0x%" PRIx64 " outside local_region",
                     i, n, l);
            return -1;
        }
    }
    return 0;
}

static ucs_status_t post_one(EndpointObject *e, xfer *x, uint64_t r, uint64_t l, uint64_t n, uint32_t k,
                             const ucp_request_param_t *p) {
    void *buf = (void *)(uintptr_t)l;
    ucs_status_ptr_t req = x->is_get ? ucp_get_nbx(e->ep, buf, n, r, e->rkeys[k], p)
                                     : ucp_put_nbx(e->ep, buf, n, r, e->rkeys[k], p);
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    free_req(req); /* completes in the background; the flush below covers it */
    return UCS_OK;
}

/* Post every merged run, then one flush; mutex held.  Returns the flush request (or NULL). */
static void *xfer_post(EndpointObject *e, xfer *x) {
    const descs *d = x->d;
    ucp_request_param_t p = {0};
    if (x->region) p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, p.memh = x->region->memh;
    uint64_t r0 = 0, l0 = 0, n0 = 0;
    uint32_t k0 = 0;
    ucs_status_t st = UCS_OK;
    for (Py_ssize_t i = 0; i < d->n && st == UCS_OK; i++) {
        uint64_t r = vec_u64(&d->remote, i), l = vec_u64(&d->local, i), n = vec_u64(&d->lengths, i);
        uint32_t k = vec_u32(&d->index, i);
        if (n == 0) continue;
        x->bytes += n;
        if (n0 && k == k0 && r == r0 + n0 && l == l0 + n0) { /* continues the run on both sides */
            n0 += n;
            continue;
        }
        if (n0) st = post_one(e, x, r0, l0, n0, k0, &p);
        r0 = r, l0 = l, n0 = n, k0 = k;
    }
    if (st == UCS_OK && n0) st = post_one(e, x, r0, l0, n0, k0, &p);
    if (st != UCS_OK) x->status = st, x->what = x->is_get ? "ucp_get_nbx" : "ucp_put_nbx";
    /* flush even after a posting error: what was posted must be retired before we return */
    ucp_request_param_t fp = {0};
    ucs_status_ptr_t f = ucp_ep_flush_nbx(e->ep, &fp);
    if (UCS_PTR_IS_ERR(f)) {
        if (x->status == UCS_OK) x->status = UCS_PTR_STATUS(f), x->what = "ucp_ep_flush_nbx";
        return NULL;
    }
    return f;
}

/* Wait for the flush: until it completes, the peer fails, the context closes, or the deadline. */
static void *xfer_wait(EndpointObject *e, xfer *x, void *flush, double deadline) {
    ContextObject *c = e->ctx;
    for (int spins = 0;;) {
        pthread_mutex_lock(&c->lock);
        unsigned n = ucp_worker_progress(c->worker);
        ucs_status_t st = flush ? ucp_request_check_status(flush) : UCS_OK;
        ucs_status_t peer = e->peer;
        int closing = c->state != CTX_OPEN;
        if (st != UCS_INPROGRESS) free_req(flush), flush = NULL;
        pthread_mutex_unlock(&c->lock);
        if (st != UCS_INPROGRESS) {
            if (st != UCS_OK && x->status == UCS_OK) x->status = st, x->what = "transfer";
            if (peer != UCS_OK) x->status = peer, x->what = "peer failed";
            x->outcome = x->status == UCS_OK ? XF_OK : XF_FAILED;
            return NULL;
        }
        if (peer != UCS_OK) {
            x->status = peer, x->what = "peer failed", x->outcome = XF_FAILED;
            return flush;
        }
        if (closing) {
            x->what = "Context closed during the transfer", x->outcome = XF_FAILED;
            return flush;
        }
        if (now_s() >= deadline) {
            x->outcome = XF_TIMEOUT;
            return flush;
        }
        if (n) continue;
        if (++spins < IDLE_SPINS) sched_yield();
        else wait_events(c, WAIT_POLL_MS);
    }
}

/* The whole transfer, GIL released. */
static void xfer_run(EndpointObject *e, xfer *x) {
    ContextObject *c = e->ctx;
    double deadline = now_s() + x->timeout;
    pthread_mutex_lock(&c->lock);
    if (c->state != CTX_OPEN || e->ep == NULL || e->closing || e->failed[0]) {
        pthread_mutex_unlock(&c->lock);
        x->outcome = XF_CLOSED;
        return;
    }
    e->inflight++;
    busy_enter(c);
    if (x->region) x->region->inuse++;
    uint32_t nrkeys = e->nrkeys; /* only grows while we hold no lock */
    pthread_mutex_unlock(&c->lock);

    void *flush = NULL;
    if (x->region && x->region->memh == NULL) {
        snprintf(x->msg, sizeof(x->msg), "local_region is closed");
        x->outcome = XF_BADARG;
    } else if (xfer_validate(x, nrkeys) < 0) {
        x->outcome = XF_BADARG;
    } else {
        pthread_mutex_lock(&c->lock);
        if (e->peer != UCS_OK) x->status = e->peer, x->what = "peer failed";
        else if (e->ep == NULL) x->status = UCS_ERR_CANCELED, x->what = "another transfer failed"; /* and closed it */
        else flush = xfer_post(e, x);
        pthread_mutex_unlock(&c->lock);
        flush = xfer_wait(e, x, flush, deadline);
    }
    int retired = 1;
    if (x->outcome == XF_FAILED || x->outcome == XF_TIMEOUT) {
        if (x->outcome == XF_TIMEOUT)
            snprintf(x->msg, sizeof(x->msg), "transfer timed out after %.3f s", x->timeout);
        else if (x->status != UCS_OK)
            snprintf(x->msg, sizeof(x->msg), "%s: %s", x->what, ucs_status_string(x->status));
        else
            snprintf(x->msg, sizeof(x->msg), "%s", x->what);
        pthread_mutex_lock(&c->lock);
        if (!e->failed[0]) snprintf(e->failed, sizeof(e->failed), "%s", x->msg); /* the first reason stays */
        pthread_mutex_unlock(&c->lock);
        /* force: the peer is gone or stuck; afterwards nothing may write our memory */
        retired = ep_shutdown(e, 1, flush, ABORT_WAIT_S);
    }
    pthread_mutex_lock(&c->lock);
    e->inflight--;
    /* if UCX did not retire our requests in time, keep the region pinned: unmapping it under a live
     * request is worse than leaving it mapped until the context goes */
    if (x->region && retired) x->region->inuse--;
    busy_leave(c);
    pthread_mutex_unlock(&c->lock);
}

static PyObject *endpoint_xfer(EndpointObject *e, PyObject *args, PyObject *kw, int is_get) {
    static char *kwlist[] = {"remote", "local", "lengths", "rkey_index", "timeout_s", "local_region", NULL};
    PyObject *ro, *lo, *no, *io, *region = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOd|O", kwlist, &ro, &lo, &no, &io, &timeout, &region))
        return NULL;
    if (!(timeout > 0) || timeout > 1e7)
        return PyErr_SetString(PyExc_ValueError, "timeout_s must be a positive number of seconds"), NULL;
    if (region != Py_None && !Py_IS_TYPE(region, &RegionType))
        return PyErr_SetString(PyExc_TypeError, "local_region: expected a Region or None"), NULL;
    if (region != Py_None && ((RegionObject *)region)->ctx != e->ctx)
        return PyErr_SetString(PyExc_ValueError, "local_region belongs to another Context"), NULL;
    if (ep_check_usable(e) < 0) return NULL;
    descs d;
    if (descs_parse(&d, ro, lo, no, io) < 0) return NULL;
    xfer x = {.d = &d, .is_get = is_get, .timeout = timeout, .status = UCS_OK, .outcome = XF_OK,
              .region = region == Py_None ? NULL : (RegionObject *)region};
    Py_BEGIN_ALLOW_THREADS
    xfer_run(e, &x);
    Py_END_ALLOW_THREADS
    descs_release(&d);
    switch (x.outcome) {
    case XF_OK: return PyLong_FromUnsignedLongLong(x.bytes);
    case XF_BADARG: return PyErr_SetString(PyExc_ValueError, x.msg), NULL;
    case XF_CLOSED:
        if (ep_check_usable(e) == 0) PyErr_SetString(PyExc_ValueError, "Endpoint is closed");
        return NULL;
    case XF_TIMEOUT: return PyErr_SetString(PyExc_TimeoutError, x.msg), NULL;
    default: return PyErr_SetString(PyExc_ConnectionError, x.msg), NULL;
    }
}

static PyObject *endpoint_get(EndpointObject *e, PyObject *a, PyObject *k) { return endpoint_xfer(e, a, k, 1); }
static PyObject *endpoint_put(EndpointObject *e, PyObject *a, PyObject *k) { return endpoint_xfer(e, a, k, 0); }

static PyObject *endpoint_failed(EndpointObject *e, void *closure) {
    char failed[sizeof(e->failed)];
    if (e->ctx == NULL) Py_RETURN_NONE;
    ep_failed_copy(e, failed, sizeof(failed));
    if (failed[0]) return PyUnicode_FromString(failed);
    if (e->peer != UCS_OK) return PyUnicode_FromFormat("peer failed: %s", ucs_status_string(e->peer));
    Py_RETURN_NONE;
}

static PyObject *endpoint_closed(EndpointObject *e, void *closure) { return PyBool_FromLong(e->ep == NULL); }

static PyObject *endpoint_info(EndpointObject *e, PyObject *unused) {
    if (ep_check_usable(e) < 0) return NULL;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return PyErr_SetFromErrno(PyExc_OSError);
    ContextObject *c = e->ctx;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    if (e->ep) ucp_ep_print_info(e->ep, f);
    pthread_mutex_unlock(&c->lock);
    fclose(f);
    Py_END_ALLOW_THREADS
    PyObject *s = PyUnicode_DecodeUTF8(buf ? buf : "", (Py_ssize_t)len, "replace");
    free(buf);
    return s;
}

/* ------------------------------------------------------------------------------------------- module */

static PyMethodDef context_methods[] = {
    {"map", (PyCFunction)(void (*)(void))context_map, METH_VARARGS | METH_KEYWORDS,
     "map(address, length, memory_type='host') -> Region: ucp_mem_map of existing memory"},
    {"connect", (PyCFunction)(void (*)(void))context_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(worker_address, error_handling=True) -> Endpoint.  error_handling=False lets UCX pick lanes such as "
     "cma that have no peer-failure handling: a peer dying mid-transfer can then abort this process (unsafe)"},
    {"progress", (PyCFunction)context_progress, METH_NOARGS, "one ucp_worker_progress, GIL released"},
    {"close", (PyCFunction)context_close, METH_NOARGS, "close endpoints, regions, worker, context (idempotent)"},
    {NULL}};

static PyGetSetDef context_getset[] = {
    {"address", (getter)context_address, NULL, "this worker's address (bytes), for the peer's connect()", NULL},
    {"closed", (getter)context_closed, NULL, "True once close() has begun", NULL},
    {"config", (getter)context_config, NULL, "the config= options set (the user's UCX_* and absent ones aside)", NULL},
    {"config_text", (getter)context_config_text, NULL, "ucp_config_print of what ucp_init was given", NULL},
    {NULL}};

static PyMethodDef region_methods[] = {
    {"close", (PyCFunction)region_close, METH_NOARGS, "ucp_mem_unmap (idempotent)"}, {NULL}};

static PyGetSetDef region_getset[] = {
    {"rkey", (getter)region_rkey, NULL, "packed remote key (bytes)", NULL},
    {"address", (getter)region_address, NULL, "start address", NULL},
    {"length", (getter)region_length, NULL, "length in bytes", NULL},
    {"memory_type", (getter)region_memory_type, NULL, "host | cuda | cuda-managed", NULL},
    {"closed", (getter)region_closed, NULL, "True once unmapped", NULL},
    {NULL}};

static PyMethodDef endpoint_methods[] = {
    {"add_rkey", (PyCFunction)endpoint_add_rkey, METH_O, "add_rkey(packed) -> index in this endpoint's table"},
    {"get", (PyCFunction)(void (*)(void))endpoint_get, METH_VARARGS | METH_KEYWORDS,
     "get(remote, local, lengths, rkey_index, timeout_s, local_region=None) -> bytes read"},
    {"put", (PyCFunction)(void (*)(void))endpoint_put, METH_VARARGS | METH_KEYWORDS,
     "put(remote, local, lengths, rkey_index, timeout_s, local_region=None) -> bytes written"},
    {"info", (PyCFunction)endpoint_info, METH_NOARGS, "ucp_ep_print_info: the lanes and transports UCX chose"},
    {"close", (PyCFunction)(void (*)(void))endpoint_close, METH_VARARGS | METH_KEYWORDS,
     "close(force=False): bounded wait"},
    {NULL}};

static PyGetSetDef endpoint_getset[] = {
    {"failed", (getter)endpoint_failed, NULL, "why the endpoint is unusable, or None", NULL},
    {"closed", (getter)endpoint_closed, NULL, "True once closed or failed", NULL},
    {NULL}};

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.Context",
    .tp_doc = "Context(tls=None, progress_thread=False, config=None, optional=()): a ucp context with one serialized "
              "worker; config: UCX options (names without UCX_) set before ucp_init unless the user set UCX_<name>; "
              "optional: those of them this UCX may not know (a refused one is left out)",
    .tp_basicsize = sizeof(ContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = context_new,
    .tp_dealloc = (destructor)context_dealloc,
    .tp_methods = context_methods,
    .tp_getset = context_getset,
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.Region",
    .tp_doc = "memory mapped with Context.map()",
    .tp_basicsize = sizeof(RegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_getset = region_getset,
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.Endpoint",
    .tp_doc = "an endpoint made with Context.connect()",
    .tp_basicsize = sizeof(EndpointObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)endpoint_dealloc,
    .tp_methods = endpoint_methods,
    .tp_getset = endpoint_getset,
};

static PyObject *py_version(PyObject *m, PyObject *unused) {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return Py_BuildValue("(III)", major, minor, release);
}

static PyMethodDef module_methods[] = {
    {"cma_read", (PyCFunction)(void (*)(void))py_cma_read, METH_VARARGS | METH_KEYWORDS,
     "cma_read(pid, remote, local, lengths, *, streaming=False) -> bytes copied with process_vm_readv (GIL "
     "released); pid 0: memcpy within this process (streaming: with stores that bypass the cache)"},
    {"cma_start", (PyCFunction)(void (*)(void))py_cma_start, METH_VARARGS | METH_KEYWORDS,
     "cma_start(pid, remote, local, lengths, seal_address=0, *, streaming=False, cut_bytes=8 MiB) -> CmaRead: "
     "cma_read on native threads (cut between them from cut_bytes), then the 8-byte word at seal_address"},
    {"cma_drain", py_cma_drain, METH_O, "cma_drain(timeout_s) -> bool: no cma_start read queued or running"},
    {"file_start", (PyCFunction)(void (*)(void))py_file_start, METH_VARARGS | METH_KEYWORDS,
     "file_start(runs, addresses, lengths, parts, *, write=False, cut_bytes, block_ids=None, block_stride=0) -> "
     "CmaRead: blocks moved, checked"},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(addresses, lengths, parts, *, fold=True) -> bytes: crc32c of each run of `parts` pieces, little-endian "
     "uint32s (fold=False: without the carry-less multiplies, where HAS_CRC32C_FOLD)"},
    {"version", py_version, METH_NOARGS, "the loaded libucp's version, (major, minor, release)"},
    {NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbridge._ucp", "kvbridge's one-sided data plane over ucp (see kvbridge/_ucp.c)", -1,
    module_methods};

PyMODINIT_FUNC PyInit__ucp(void) {
    PyTypeObject *types[] = {&ContextType, &RegionType, &EndpointType, &CmaReadType};
    const char *names[] = {"Context", "Region", "Endpoint", "CmaRead"};
    for (int i = 0; i < 4; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    if (pthread_atfork(NULL, NULL, cma_after_fork) != 0) return PyErr_NoMemory();
    crc_init();
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "HAS_CRC32C", crc_ready) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "HAS_CRC32C_FOLD", crc_ready && crc_fold) < 0) goto fail;
    for (int i = 0; i < 4; i++)
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) goto fail;
    PyObject *api = Py_BuildValue("(ii)", UCP_API_MAJOR, UCP_API_MINOR);
    if (PyModule_AddObject(m, "API_VERSION", api) < 0) {
        Py_XDECREF(api);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
