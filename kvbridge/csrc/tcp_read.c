/* The tcp lane's consumer side: kvbridge._core.TcpSource reads a producer's registered KV (its TcpServer,
 * tcp_serve.c) straight into this process's memory over several TCP streams at once (wire: tcp.h).
 *
 *   TcpSource(host, port, secret, *, streams=4, timeout_s=10)     host "@NAME": a TcpServer's local socket NAME
 *     .start(remote, local, lengths, seal_address=0, timeout_s=None) -> TcpRead  (.result() -> (bytes, seal word))
 *     .close()
 *
 * A read's descriptors are merged where they continue each other on both sides, then cut into `streams`
 * parts of about equal bytes on 64-byte boundaries (a descriptor may be split); each part is one request
 * on its own connection, run by a pool thread, received with recvmsg straight into the local pieces.
 * Connections stay open between reads (a connect and hello cost round trips per load otherwise) and are
 * dropped after any failure, so a read after a cut link or a restarted producer starts on fresh ones.
 *
 * The deadline: a read is over by its start + timeout_s (start()'s, else the source's), whole — connecting, the hello, every stream's
 * request, data and seal word — however many bytes keep arriving before then (a link that trickles fails
 * as a dead one does; a per-wait bound would let it run for hours).  A stream that fails (its deadline, a
 * reset, a refusal) shuts its siblings' sockets down, so the read ends with its first failure rather than
 * its slowest stream; their connections are closed, never given back mid-message.
 *
 * Several streams, because one TCP stream is bound by one core's copy out of the socket and by its
 * congestion window; across emulated hosts plain TCP moves more with several (bench case:
 * `kvbridge bench hosts`, rows tcp:1 and tcp:4).  Threads of their own rather than the copy pool's two:
 * a stream mostly waits on the network, and a copy must not queue behind it.
 *
 * The seal: each stream's server reads the seal word after its part's data; the read's word is theirs
 * only if every stream returned the same one (a word, once cleared, never comes back), else 0.
 */
#include "tcp.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define READ_MAX_STREAMS 16
/* Below this many bytes per stream, fewer streams: a stream's request and reply cost a round trip whatever
 * it carries. */
#define READ_STREAM_MIN_BYTES (1u << 20)
#define READ_MAX_THREADS 64
#define READ_MAX_IDLE 64
/* An idle connection older than this is closed rather than reused: the server closes idle ones (idle_s,
 * 300 s by default), and a reused connection the server just closed would fail a load. */
#define READ_KEEP_S 60.0

typedef struct {
    PyObject_HEAD
    struct sockaddr_storage addr;
    socklen_t alen;
    uint8_t secret[TCP_SECRET_BYTES];
    int streams;
    double timeout_s;
    pthread_mutex_t lock;
    int idle[READ_MAX_IDLE], idle_pipe[READ_MAX_IDLE]; /* idle_pipe: its pipe's read end (local), else -1 */
    double since[READ_MAX_IDLE];
    int nidle, closed, local; /* local: addr is the producer's abstract Unix socket (tcp_local.c) */
} TcpSourceObject;

struct TcpReadObject;

typedef struct stream {
    struct TcpReadObject *r;
    uint64_t lo, hi; /* its bytes of the merged descriptors */
    tcp_trailer tail; /* the seal word its server sent after the data (and, over TCP, the padding) */
    int err;
    int fd; /* its connection while it moves bytes, else -1 (r->lock) */
    int pipe; /* a local connection's pipe (its data), else -1 */
    struct stream *next; /* the pool's queue */
} stream;

typedef struct TcpReadObject {
    JobObject base;
    TcpSourceObject *src; /* held: its connections outlive no read */
    uint64_t seal_address;
    double until;     /* the read's deadline (tcp_now() seconds): its start + the source's timeout_s */
    int failed;       /* the errno of the first stream that failed, 0 while none has: the others stop (r->lock) */
    tcp_desc *rem;    /* merged: remote address and length */
    uint64_t *loc;    /* merged: local address */
    uint64_t *starts; /* starts[i]: bytes before merged descriptor i (m + 1 entries) */
    size_t m;
    int nstreams, pending;
    pthread_mutex_t lock;
    stream st[READ_MAX_STREAMS];
} TcpReadObject;

/* ---- connections */

static void close_pair(int fd, int pipe) {
    close(fd);
    if (pipe >= 0) close(pipe);
}

static void close_idle(TcpSourceObject *s) { /* s->lock held */
    for (; s->nidle > 0; s->nidle--) close_pair(s->idle[s->nidle - 1], s->idle_pipe[s->nidle - 1]);
}

/* A pooled connection that is still good (no hang-up or stray bytes waiting, not idle too long), else a
 * new one that passed the hello by the deadline `until`; -1 with *err set.  *pipe: a local one's pipe. */
static int take_conn(TcpSourceObject *s, double until, int *pipe, int *err) {
    pthread_mutex_lock(&s->lock);
    int fd = -1;
    *pipe = -1;
    while (fd < 0 && s->nidle > 0) {
        int c = s->idle[--s->nidle], cp = s->idle_pipe[s->nidle];
        struct pollfd p[2] = {{c, POLLIN | POLLRDHUP, 0}, {cp, POLLIN, 0}}; /* a pipe with stray bytes: not reused */
        if (tcp_now() - s->since[s->nidle] < READ_KEEP_S && poll(p, cp >= 0 ? 2 : 1, 0) == 0) fd = c, *pipe = cp;
        else close_pair(c, cp);
    }
    pthread_mutex_unlock(&s->lock);
    if (fd >= 0) return fd;
    fd = tcp_connect((struct sockaddr *)&s->addr, s->alen, until, err);
    if (fd < 0) return -1;
    tcp_hello h = {TCP_MAGIC_HELLO, TCP_VERSION, {0}};
    memcpy(h.secret, s->secret, TCP_SECRET_BYTES);
    uint32_t status = TCP_BAD_SECRET;
    int e = tcp_send_all(fd, &h, sizeof(h), until);
    if (!e) e = s->local ? tcp_pipe_take(fd, &status, pipe, until) : tcp_recv_all(fd, &status, sizeof(status), until);
    if (!e && status != TCP_OK) e = status == TCP_BAD_VERSION ? EPROTONOSUPPORT : EACCES;
    if (e == ECONNRESET && status != TCP_OK) e = EACCES; /* refused: the server closed without an answer */
    if (e) {
        close(fd);
        *err = e;
        return -1;
    }
    return fd;
}

static void give_conn(TcpSourceObject *s, int fd, int pipe, int failed) {
    pthread_mutex_lock(&s->lock);
    if (failed) close_idle(s); /* a cut link or a restarted producer took the others too */
    if (failed || s->closed || s->nidle == READ_MAX_IDLE) close_pair(fd, pipe);
    else {
        s->since[s->nidle] = tcp_now();
        s->idle_pipe[s->nidle] = pipe;
        s->idle[s->nidle++] = fd;
    }
    pthread_mutex_unlock(&s->lock);
}

/* ---- one stream: its part of the read, on one connection */

static size_t first_desc(const TcpReadObject *r, uint64_t lo) { /* the merged descriptor holding byte lo */
    size_t a = 0, b = r->m;
    while (a < b) {
        size_t mid = (a + b) / 2;
        if (r->starts[mid + 1] <= lo) a = mid + 1;
        else b = mid;
    }
    return a;
}

/* Whether the stream may go on: no sibling failed; then its connection is `fd` (-1: none) for them to
 * shut down should they fail. */
static int stream_own(stream *st, int fd) {
    TcpReadObject *r = st->r;
    pthread_mutex_lock(&r->lock);
    int go = !r->failed;
    st->fd = go ? fd : -1;
    pthread_mutex_unlock(&r->lock);
    return go;
}

/* The stream failed with `err`: the read has, so its siblings stop now rather than at the deadline (a
 * shut-down socket wakes their poll and fails their next call); the first failure is the read's reason.
 * Under r->lock, so no sibling closes its socket (stream_own(st, -1) first) while it is shut down here. */
static void stream_fail(stream *st, int err) {
    TcpReadObject *r = st->r;
    pthread_mutex_lock(&r->lock);
    if (!r->failed) {
        r->failed = err;
        for (int k = 0; k < r->nstreams; k++)
            if (&r->st[k] != st && r->st[k].fd >= 0) shutdown(r->st[k].fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&r->lock);
}

static int stream_run(stream *st) {
    TcpReadObject *r = st->r;
    TcpSourceObject *s = r->src;
    double until = r->until;
    size_t i0 = first_desc(r, st->lo), n = 0;
    while (i0 + n < r->m && r->starts[i0 + n] < st->hi) n++;
    if (st->lo == st->hi) n = 0;
    size_t qbytes = sizeof(tcp_request) + n * sizeof(tcp_desc);
    char *q = malloc(qbytes);
    struct iovec *iov = malloc((n + 1) * sizeof(struct iovec));
    if (!q || !iov) {
        free(q);
        free(iov);
        return ENOMEM;
    }
    int err = 0;
    for (size_t k = 0; !err && k < n; k++) {
        size_t i = i0 + k;
        uint64_t a = st->lo > r->starts[i] ? st->lo - r->starts[i] : 0;
        uint64_t b = (st->hi < r->starts[i + 1] ? st->hi : r->starts[i + 1]) - r->starts[i];
        tcp_desc d = {r->rem[i].addr + a, b - a};
        memcpy(q + sizeof(tcp_request) + k * sizeof(tcp_desc), &d, sizeof(d));
        iov[k] = (struct iovec){(void *)(uintptr_t)(r->loc[i] + a), (size_t)(b - a)};
    }
    int fd = -1;
    if (tcp_now() >= until) err = ETIMEDOUT; /* queued behind other reads' streams past its deadline */
    else if (!stream_own(st, -1)) err = ECANCELED;
    if (!err) {
        tcp_request head = {TCP_MAGIC_REQUEST, (uint32_t)n, r->seal_address};
        memcpy(q, &head, sizeof(head));
        fd = take_conn(s, until, &st->pipe, &err);
    }
    if (fd >= 0) {
        if (!stream_own(st, fd)) err = ECANCELED;
        tcp_reply rep = {TCP_BAD_REQUEST, 0, 0, {0}};
        iov[n] = (struct iovec){&st->tail, st->pipe < 0 ? tcp_trailer_bytes(st->hi - st->lo) : sizeof(uint64_t)};
        if (!err) err = tcp_send_all(fd, q, qbytes, until);
        if (!err) err = tcp_recv_all(fd, &rep, sizeof(rep), until);
        if (!err && rep.status != TCP_OK) err = rep.status == TCP_OUT_OF_BOUNDS ? EFAULT : EPROTO;
        if (!err && rep.total != st->hi - st->lo) err = EPROTO; /* never counted: the sizes disagree */
        if (!err) err = st->pipe < 0 ? tcp_recvv(fd, iov, (int)(n + 1), until) : tcp_pipe_readv(st->pipe, fd, iov, (int)(n + 1), until);
        if (!stream_own(st, -1)) err = err ? err : ECANCELED; /* a sibling may have shut this one down */
        give_conn(s, fd, st->pipe, err != 0);
    }
    if (err) stream_fail(st, err);
    free(q);
    free(iov);
    return err;
}

/* ---- the pool of stream threads */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work;
    stream *head, *tail;
    int threads, free, queued;
} tp = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0};

static void stream_over(stream *st) {
    TcpReadObject *r = st->r;
    pthread_mutex_lock(&r->lock);
    int last = --r->pending == 0;
    pthread_mutex_unlock(&r->lock);
    if (!last) return;
    int err = r->failed; /* the first failure, not a sibling's shut-down socket it caused */
    uint64_t word = r->st[0].tail.word;
    for (int k = 0; k < r->nstreams; k++) {
        if (!err) err = r->st[k].err;
        if (r->st[k].tail.word != word) word = 0;
    }
    r->st[0].tail.word = r->seal_address ? word : 0;
    kv_end_own(&r->base.job, err, err ? 0 : r->starts[r->m]); /* r may be gone after this */
}

static void *pool_main(void *unused) {
    tcp_name_thread("kvbridge-tcp");
    pthread_mutex_lock(&tp.lock);
    for (;;) {
        while (!tp.head) pthread_cond_wait(&tp.work, &tp.lock);
        stream *st = tp.head;
        tp.head = st->next;
        if (!tp.head) tp.tail = NULL;
        tp.queued--;
        tp.free--;
        pthread_mutex_unlock(&tp.lock);
        st->err = stream_run(st);
        stream_over(st);
        pthread_mutex_lock(&tp.lock);
        tp.free++;
    }
    return NULL;
}

/* Queue a read's streams, making threads until each has one free (up to READ_MAX_THREADS: past that,
 * streams wait their turn).  0 or an errno. */
static int submit(TcpReadObject *r) {
    pthread_mutex_lock(&tp.lock);
    for (int k = 0; k < r->nstreams; k++) {
        stream *st = &r->st[k];
        st->next = NULL;
        if (tp.tail) tp.tail->next = st;
        else tp.head = st;
        tp.tail = st;
        tp.queued++;
    }
    int err = 0;
    while (tp.free < tp.queued && tp.threads < READ_MAX_THREADS) {
        pthread_t t;
        if ((err = pthread_create(&t, NULL, pool_main, NULL))) break;
        pthread_detach(t);
        tp.threads++;
        tp.free++;
    }
    if (tp.threads > 0) err = 0; /* fewer threads than streams: they run in turn */
    pthread_cond_broadcast(&tp.work);
    pthread_mutex_unlock(&tp.lock);
    return err;
}

/* A forked child has none of the parent's threads, and the parent's queued streams are not its own: the
 * jobs they belong to end as cancelled there (pool.c, job_over). */
static void tcp_after_fork(void) {
    pthread_mutex_init(&tp.lock, NULL);
    pthread_cond_init(&tp.work, NULL);
    tp.head = tp.tail = NULL;
    tp.threads = tp.free = tp.queued = 0;
}

void kv_tcp_init(void) { (void)pthread_atfork(NULL, NULL, tcp_after_fork); }

/* ---- Python: TcpRead */

static void read_dealloc(TcpReadObject *r) {
    kv_release(&r->base.job); /* waits: its streams write into memory the caller keeps until then */
    free(r->rem);
    free(r->loc);
    free(r->starts);
    if (r->src) pthread_mutex_destroy(&r->lock);
    Py_XDECREF(r->src);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static const char *why(int err) {
    switch (err) {
    case EACCES: return "the producer refused the secret";
    case EPROTONOSUPPORT: return "the producer speaks another version of the tcp lane (run one kvbridge on both ends)";
    case EFAULT: return "the producer refused ranges outside its registered KV";
    case EPROTO: return "the producer's answer does not match the request";
    case ETIMEDOUT: return "the read's deadline passed (timeout_s from its start)";
    default: return strerror(err);
    }
}

static PyObject *read_result(TcpReadObject *r, PyObject *unused) {
    kv_job *j = &r->base.job;
    kv_wait(j, -1.0);
    if (j->err) {
        PyObject *e = Py_BuildValue("(is)", j->err, why(j->err));
        if (e) PyErr_SetObject(PyExc_OSError, e); /* OSError(errno, ...) picks its subclass: TimeoutError ... */
        Py_XDECREF(e);
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)j->total, (unsigned long long)r->st[0].tail.word);
}

static PyMethodDef read_methods[] = {
    {"result", (PyCFunction)read_result, METH_NOARGS, "result() -> (bytes read, seal word); OSError on failure"},
    {NULL}};

PyTypeObject TcpReadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.TcpRead",
    .tp_doc = "a read of a producer's KV over the tcp lane (made by TcpSource.start())",
    .tp_basicsize = sizeof(TcpReadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &JobType,
    .tp_dealloc = (destructor)read_dealloc,
    .tp_methods = read_methods,
};

/* ---- Python: TcpSource */

static int source_init(TcpSourceObject *s, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "secret", "streams", "timeout_s", NULL};
    const char *host;
    int port, streams = 4;
    Py_buffer secret;
    double timeout_s = 10.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "siy*|$id", kwlist, &host, &port, &secret, &streams, &timeout_s))
        return -1;
    int bad = secret.len != TCP_SECRET_BYTES || streams < 1 || streams > READ_MAX_STREAMS || !(timeout_s > 0);
    if (!bad) memcpy(s->secret, secret.buf, TCP_SECRET_BYTES);
    PyBuffer_Release(&secret);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "TcpSource: secret of %d bytes, streams in [1, %d], timeout_s > 0",
                     TCP_SECRET_BYTES, READ_MAX_STREAMS);
        return -1;
    }
    s->local = host[0] == TCP_LOCAL_PREFIX;
    if (s->local ? tcp_local_address(host + 1, &s->addr, &s->alen) : tcp_address(host, port, &s->addr, &s->alen)) {
        PyErr_Format(PyExc_ValueError, "TcpSource: %s:%d is not a numeric address and port", host, port);
        return -1;
    }
    s->streams = streams;
    s->timeout_s = timeout_s;
    return 0;
}

static PyObject *source_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    TcpSourceObject *s = (TcpSourceObject *)type->tp_alloc(type, 0);
    if (s) pthread_mutex_init(&s->lock, NULL);
    return (PyObject *)s;
}

static void source_shut(TcpSourceObject *s) {
    pthread_mutex_lock(&s->lock);
    s->closed = 1;
    close_idle(s);
    pthread_mutex_unlock(&s->lock);
}

static PyObject *source_close(TcpSourceObject *s, PyObject *unused) {
    source_shut(s);
    Py_RETURN_NONE;
}

static void source_dealloc(TcpSourceObject *s) {
    source_shut(s); /* no read holds it any more: each holds a reference until it is over */
    pthread_mutex_destroy(&s->lock);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Merge the descriptors into r (runs that continue each other on both sides become one) and cut them
 * into streams of equal bytes.  0, or -1 with the error set. */
static int plan(TcpReadObject *r, int streams) {
    const descs *d = &r->base.job.d;
    r->rem = malloc(((size_t)d->n + 1) * sizeof(tcp_desc));
    r->loc = malloc(((size_t)d->n + 1) * sizeof(uint64_t));
    r->starts = malloc(((size_t)d->n + 2) * sizeof(uint64_t));
    if (!r->rem || !r->loc || !r->starts) {
        PyErr_NoMemory();
        return -1;
    }
    size_t m = 0;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < d->n; i++) {
        uint64_t a = vec_u64(&d->remote, i), b = vec_u64(&d->local, i), n = vec_u64(&d->lengths, i);
        if (!n) continue;
        if (m && r->rem[m - 1].addr + r->rem[m - 1].len == a && r->loc[m - 1] + r->rem[m - 1].len == b) {
            r->rem[m - 1].len += n;
        } else {
            r->starts[m] = total;
            r->rem[m] = (tcp_desc){a, n};
            r->loc[m++] = b;
        }
        total += n;
    }
    r->starts[m] = total;
    r->m = m;
    uint64_t most = total / READ_STREAM_MIN_BYTES;
    r->nstreams = most < 1 ? 1 : most < (uint64_t)streams ? (int)most : streams;
    for (uint64_t k = 0, parts = (uint64_t)r->nstreams; k < parts; k++)
        r->st[k] = (stream){.r = r, .lo = k ? r->st[k - 1].hi : 0, .hi = tcp_part_end(total, k, parts), .fd = -1, .pipe = -1};
    return 0;
}

static PyObject *source_start(TcpSourceObject *s, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"remote", "local", "lengths", "seal_address", "timeout_s", NULL};
    PyObject *ro, *lo, *no, *to = Py_None;
    unsigned long long seal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|KO", kwlist, &ro, &lo, &no, &seal, &to)) return NULL;
    double timeout_s = s->timeout_s;
    if (to != Py_None && (timeout_s = PyFloat_AsDouble(to)) == -1.0 && PyErr_Occurred()) return NULL;
    if (!(timeout_s > 0) || timeout_s > 1e7)
        return PyErr_Format(PyExc_ValueError, "TcpSource.start: timeout_s must be a positive number of seconds");
    if (s->closed) return PyErr_Format(PyExc_ValueError, "TcpSource.start: the source is closed");
    TcpReadObject *r = (TcpReadObject *)kv_new(&TcpReadType, NULL);
    if (!r) return NULL;
    pthread_mutex_init(&r->lock, NULL);
    Py_INCREF(s);
    r->src = s;
    r->seal_address = seal;
    r->until = tcp_now() + timeout_s; /* the whole read, from now */
    if (descs_parse(&r->base.job.d, ro, lo, no, NULL) < 0 || plan(r, s->streams) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->pending = r->nstreams;
    kv_begin_own(&r->base.job);
    int err = submit(r);
    if (err) { /* no thread at all: the job ends failed, so that dealloc waits for nothing */
        kv_end_own(&r->base.job, err, 0);
        Py_DECREF(r);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)r;
}

static PyMethodDef source_methods[] = {
    {"start", (PyCFunction)(void (*)(void))source_start, METH_VARARGS | METH_KEYWORDS,
     "start(remote, local, lengths, seal_address=0, timeout_s=None) -> TcpRead: the descriptors read over `streams` "
     "connections at once into this process's memory, then the seal word; the whole read fails once timeout_s "
     "(default: the source's) passed since this call"},
    {"close", (PyCFunction)source_close, METH_NOARGS, "close(): drop the idle connections; no read starts after"},
    {NULL}};

static PyObject *source_local(TcpSourceObject *s, void *unused) { return PyBool_FromLong(s->local); }

static PyGetSetDef source_getset[] = {
    {"local", (getter)source_local, NULL, "whether it reads over a local socket, its data through pipes", NULL}, {NULL}};

PyTypeObject TcpSourceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.TcpSource",
    .tp_doc = "TcpSource(host, port, secret, *, streams=4, timeout_s=10): a producer's TcpServer, read from here (host '@NAME': over its local socket NAME, data through pipes)",
    .tp_basicsize = sizeof(TcpSourceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = source_new,
    .tp_init = (initproc)source_init,
    .tp_dealloc = (destructor)source_dealloc,
    .tp_methods = source_methods,
    .tp_getset = source_getset,
};
