/* The tcp lane's producer side: kvbridge._core.TcpServer serves byte ranges of the registered KV regions to
 * consumers that present the registration's secret (wire: tcp.h).
 *
 *   TcpServer(host, port, regions, secret, *, seals=(0, 0), timeout_s=10, idle_s=300, sndbuf=0, local="")
 *     .port, .stats() -> (connections, requests, bytes, refused), .close(timeout_s=10) -> bool
 *
 * One thread accepts; each connection gets a thread of its own that answers its requests in order, so a
 * consumer's N streams are served at once and the producer's engine never steps for them.  The data goes
 * from the KV's memory to the socket with sendmsg (one copy, into the socket's buffer; no staging).
 * With `local` (a name), it also listens on that abstract Unix socket, whose connections take their data
 * through a pipe by reference instead (tcp_local.c: consumers in the same network namespace).
 *
 * The send buffer: sndbuf > 0 caps each connection's (SO_SNDBUF; the kernel doubles it for its own
 * bookkeeping).  The kernel's auto-tuned one grows to megabytes per stream, and the bytes copied into it
 * wait there, unsent, until the CPU's caches have dropped them; the copy out of the socket (a consumer
 * on this host, another pod) or the NIC's read then goes to memory again.  A send buffer of a few hundred
 * KiB per stream keeps what is in flight inside the caches, and the non-blocking sends below refill it as
 * soon as it drains (a blocking send() gains nothing from the cap: `kvbridge bench hosts`, rows ctcp:4 and
 * ctcp-sndbuf:4).  Enough for the link as long as streams x cap covers its bytes in flight (bandwidth x
 * round trip): 4 x 1 MiB is 100 Gbit/s at 300 us.  Bench case: benches/tcp_lane_probe.py, rows
 * scat:4@... with and without the cap.
 *
 * Safety: a request is served only if every range lies inside one registered region (the rest of the
 * process is never readable), only on a connection whose hello carried the secret, and the seal word
 * is read after the data was handed to the socket.  A consumer that dies, stalls or reads at a trickle
 * costs a closed socket, never a thread for good: the hello must be over timeout_s after the accept, and
 * each request answered (its data and seal word in the socket) timeout_s after it began to arrive, however
 * many bytes moved meanwhile; an idle connection closes after idle_s.  The consumer's own deadline for a
 * read (its start + its timeout_s) comes first when both sides share timeout_s, so a consumer that gives
 * up has closed its sockets before the server would.
 */
#include "tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Connections served at once; one more is closed at accept (a consumer opens a handful per producer). */
#define SERVE_MAX_CONNS 256

typedef struct {
    uint64_t lo, hi;
} region;

typedef struct server {
    int lfd, ufd, wake[2]; /* ufd: the local medium's listener (tcp_local.c), -1 without one */
    region *regions;
    int nregions;
    uint64_t seal_lo, seal_hi;
    uint8_t secret[TCP_SECRET_BYTES];
    double timeout_s, idle_s;
    int sndbuf; /* each connection's SO_SNDBUF, 0: the kernel's */
    pthread_mutex_t lock;
    pthread_cond_t gone;
    int threads; /* alive: the accept thread and each connection's */
    int stopping, closers; /* closers: close() calls waiting on the threads; the last one out frees it all */
    int conns[SERVE_MAX_CONNS]; /* open connections' fds (-1: free), shut down by close() */
    uint64_t n_conns, n_requests, n_bytes, n_refused;
} server;

typedef struct {
    server *s;
    int fd, slot, local; /* local: accepted on ufd, its data goes through a pipe */
} conn;

/* Whether [addr, addr + len) lies inside one region; *hint: the region the last range hit (ranges of a
 * request mostly follow each other). */
static int inside(const server *s, uint64_t addr, uint64_t len, int *hint) {
    if (addr + len < addr) return 0;
    for (int k = 0; k < s->nregions; k++) {
        int i = (*hint + k) % s->nregions;
        if (addr >= s->regions[i].lo && addr + len <= s->regions[i].hi) {
            *hint = i;
            return 1;
        }
    }
    return 0;
}

static void count(server *s, uint64_t *field, uint64_t n) {
    pthread_mutex_lock(&s->lock);
    *field += n;
    pthread_mutex_unlock(&s->lock);
}

static int reply(int fd, uint32_t status, uint64_t total, double until) {
    tcp_reply r = {status, 0, total, {0}};
    return tcp_send_all(fd, &r, sizeof(r), until);
}

/* One request, its header read, answered whole by the deadline `until`.  Returns 0 to go on with the
 * connection, else an errno or -1 (close). */
static int serve_request(server *s, int fd, int pipe_w, const tcp_request *q, tcp_desc **buf, size_t *cap,
                         struct iovec *iov, double until) {
    if (q->magic != TCP_MAGIC_REQUEST || q->n > TCP_MAX_DESCS) {
        (void)reply(fd, TCP_BAD_REQUEST, 0, until);
        return -1;
    }
    if (q->n > *cap) {
        tcp_desc *grown = realloc(*buf, (size_t)q->n * sizeof(tcp_desc));
        if (!grown) return ENOMEM;
        *buf = grown;
        *cap = q->n;
    }
    int err = tcp_recv_all(fd, *buf, (size_t)q->n * sizeof(tcp_desc), until);
    if (err) return err;
    uint64_t total = 0;
    int hint = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        if (!inside(s, (*buf)[i].addr, (*buf)[i].len, &hint)) {
            count(s, &s->n_refused, 1);
            (void)reply(fd, TCP_OUT_OF_BOUNDS, 0, until);
            return -1; /* nothing of it served; a consumer that asks outside the KV is not asked again */
        }
        total += (*buf)[i].len;
    }
    /* over TCP the reply's header leads the first batch of data: one send for both; through a pipe the
     * header goes over the socket and the data into the pipe */
    tcp_reply head = {TCP_OK, 0, total, {0}};
    int k = 0;
    if (pipe_w < 0) iov[k++] = (struct iovec){&head, sizeof(head)};
    else if ((err = tcp_send_all(fd, &head, sizeof(head), until))) return err;
    for (uint32_t i = 0; i <= q->n; i++) {
        if (i == q->n || k == IOV_MAX) {
            if (k && (err = pipe_w < 0 ? tcp_sendv(fd, iov, k, until) : tcp_pipe_splicev(pipe_w, fd, iov, k, until)))
                return err;
            k = 0;
        }
        if (i < q->n) iov[k++] = (struct iovec){(void *)(uintptr_t)(*buf)[i].addr, (size_t)(*buf)[i].len};
    }
    uint64_t word = 0, a = q->seal_address;
    int sealed = a && a % 8 == 0 && a >= s->seal_lo && a + 8 <= s->seal_hi;
    if (pipe_w >= 0) { /* the word by reference, after the data: the consumer copies it last (tcp_local.c) */
        struct iovec w = {(void *)(uintptr_t)a, sizeof(word)};
        err = sealed ? tcp_pipe_splicev(pipe_w, fd, &w, 1, until) : tcp_pipe_write(pipe_w, fd, &word, sizeof(word), until);
        if (err) return err;
    } else { /* every data byte is in the socket now, so the word read here is not older than any of them */
        tcp_trailer tail = {0, {0}};
        if (sealed) tail.word = __atomic_load_n((const uint64_t *)(uintptr_t)a, __ATOMIC_ACQUIRE);
        if ((err = tcp_send_all(fd, &tail, tcp_trailer_bytes(total), until))) return err;
    }
    pthread_mutex_lock(&s->lock);
    s->n_requests++;
    s->n_bytes += total;
    pthread_mutex_unlock(&s->lock);
    return 0;
}

static void thread_gone(server *s) {
    pthread_mutex_lock(&s->lock);
    s->threads--;
    pthread_cond_broadcast(&s->gone);
    pthread_mutex_unlock(&s->lock);
}

static void *conn_main(void *arg) {
    conn c = *(conn *)arg;
    free(arg);
    server *s = c.s;
    tcp_name_thread("kvbridge-serve");
    if (c.local) tcp_block_sigpipe();
    int pipe_w = -1;
    tcp_desc *buf = NULL;
    size_t cap = 0;
    struct iovec *iov = malloc(sizeof(struct iovec) * IOV_MAX);
    tcp_hello h;
    double until = tcp_now() + s->timeout_s; /* the hello, from the accept */
    int err = iov ? tcp_recv_all(c.fd, &h, sizeof(h), until) : ENOMEM;
    if (!err) {
        uint32_t status = h.magic != TCP_MAGIC_HELLO || !tcp_secret_equal(h.secret, s->secret) ? TCP_BAD_SECRET
                          : h.version != TCP_VERSION                                          ? TCP_BAD_VERSION
                                                                                              : TCP_OK;
        if (status != TCP_OK) count(s, &s->n_refused, 1); /* before the answer: who saw the refusal sees it counted */
        err = c.local ? tcp_pipe_offer(c.fd, status, &pipe_w, until) : tcp_send_all(c.fd, &status, sizeof(status), until);
        if (status != TCP_OK) err = -1;
    }
    while (!err) {
        tcp_request q;
        /* between requests the connection may idle (a consumer keeps its streams open), up to idle_s */
        err = tcp_wait(c.fd, POLLIN, tcp_now() + s->idle_s);
        until = tcp_now() + s->timeout_s; /* the request's first bytes are here: all of it by then */
        if (!err) err = tcp_recv_all(c.fd, &q, sizeof(q), until);
        if (!err) err = serve_request(s, c.fd, pipe_w, &q, &buf, &cap, iov, until);
    }
    if (pipe_w >= 0) close(pipe_w); /* what is still in it stays readable until the consumer drops it */
    free(buf);
    free(iov);
    pthread_mutex_lock(&s->lock);
    s->conns[c.slot] = -1;
    pthread_mutex_unlock(&s->lock);
    close(c.fd);
    thread_gone(s);
    return NULL;
}

/* Waits for connections without a deadline: nothing is in flight here, and close() wakes it (s->wake). */
static void *accept_main(void *arg) {
    server *s = arg;
    tcp_name_thread("kvbridge-accept");
    for (;;) {
        struct pollfd p[3] = {{s->wake[0], POLLIN, 0}, {s->lfd, POLLIN, 0}, {s->ufd, POLLIN, 0}};
        if (poll(p, s->ufd >= 0 ? 3 : 2, -1) < 0 && errno != EINTR) break;
        if (p[0].revents) break;
        int local = s->ufd >= 0 && (p[2].revents & POLLIN);
        if (!local && !(p[1].revents & POLLIN)) continue;
        int fd = accept4(local ? s->ufd : s->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        tcp_tune(fd, local ? 0 : s->sndbuf); /* a local connection carries only headers: the data takes the pipe */
        pthread_mutex_lock(&s->lock);
        int slot = -1;
        for (int i = 0; i < SERVE_MAX_CONNS && slot < 0 && !s->stopping; i++)
            if (s->conns[i] < 0) slot = i;
        conn *c = slot >= 0 ? malloc(sizeof(conn)) : NULL;
        pthread_t t;
        if (c) {
            *c = (conn){s, fd, slot, local};
            s->conns[slot] = fd;
            s->threads++;
            s->n_conns++;
            if (pthread_create(&t, NULL, conn_main, c) == 0) pthread_detach(t);
            else {
                s->conns[slot] = -1;
                s->threads--;
                free(c);
                c = NULL;
            }
        }
        pthread_mutex_unlock(&s->lock);
        if (!c) close(fd); /* too many at once, or no thread: the consumer sees a reset */
    }
    thread_gone(s);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    server *s;
    int port;
} TcpServerObject;

static void server_free(server *s) {
    if (s->lfd >= 0) close(s->lfd);
    if (s->ufd >= 0) close(s->ufd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    free(s->regions);
    free(s);
}

/* Stop accepting, shut every connection down (its thread sees the hang-up at its next wait), and wait up
 * to timeout_s for every thread to end: they read the KV, which the caller frees after this.  Returns
 * whether they all ended (if not, the server's memory is kept for them, and the next close() waits for them
 * again rather than answering at once that they ended).  Two threads may close at once:
 * each waits, and only the last of them frees the server, once no thread of it is left.  Who is last is
 * counted while holding the GIL, as o->s is read: a close() that saw the server is counted before any
 * other can decide to free it. */
static int server_stop(TcpServerObject *o, double timeout_s) {
    server *s = o->s;
    if (!s) return 1;
    int all;
    pthread_mutex_lock(&s->lock);
    s->closers++;
    pthread_mutex_unlock(&s->lock);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->lock);
    if (!s->stopping) {
        s->stopping = 1;
        char one = 1;
        (void)!write(s->wake[1], &one, 1);
        for (int i = 0; i < SERVE_MAX_CONNS; i++)
            if (s->conns[i] >= 0) shutdown(s->conns[i], SHUT_RDWR);
    }
    double until = tcp_now() + timeout_s;
    while (s->threads > 0 && tcp_now() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&s->gone, &s->lock, &ts);
    }
    pthread_mutex_unlock(&s->lock);
    Py_END_ALLOW_THREADS
    pthread_mutex_lock(&s->lock);
    all = s->threads == 0; /* now, not when this one stopped waiting: a sibling may have seen them end since */
    int last = --s->closers == 0;
    pthread_mutex_unlock(&s->lock);
    if (all) o->s = NULL; /* over: a later close() has nothing to wait for; one still waiting frees it */
    if (all && last) server_free(s);
    return all; /* not over: o->s stays, so the next close() (or the dealloc) waits for them again */
}

static int server_init(TcpServerObject *o, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "regions", "secret", "seals", "timeout_s", "idle_s", "sndbuf", "local", NULL};
    const char *host, *local = "";
    int port;
    PyObject *regions;
    Py_buffer secret;
    unsigned long long seal_lo = 0, seal_len = 0;
    double timeout_s = 10.0, idle_s = 300.0;
    int sndbuf = 0;
    if (o->s) {
        PyErr_SetString(PyExc_RuntimeError, "TcpServer: already started");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "siOy*|$(KK)ddis", kwlist, &host, &port, &regions, &secret, &seal_lo,
                                     &seal_len, &timeout_s, &idle_s, &sndbuf, &local))
        return -1;
    int ok = secret.len == TCP_SECRET_BYTES && timeout_s > 0 && idle_s > 0 && sndbuf >= 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "TcpServer: the secret must be %d bytes, timeouts > 0, sndbuf >= 0",
                     TCP_SECRET_BYTES);
    PyObject *seq = ok ? PySequence_Fast(regions, "TcpServer: regions must be a sequence of (address, length)") : NULL;
    server *s = seq ? calloc(1, sizeof(server)) : NULL;
    if (seq && !s) PyErr_NoMemory();
    if (!s) goto fail;
    s->lfd = s->ufd = s->wake[0] = s->wake[1] = -1;
    for (int i = 0; i < SERVE_MAX_CONNS; i++) s->conns[i] = -1;
    s->nregions = (int)PySequence_Fast_GET_SIZE(seq);
    s->regions = calloc((size_t)s->nregions + 1, sizeof(region));
    if (!s->regions) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int i = 0; i < s->nregions; i++) {
        unsigned long long a, n;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &a, &n)) goto fail;
        s->regions[i] = (region){a, a + n};
    }
    memcpy(s->secret, secret.buf, TCP_SECRET_BYTES);
    s->seal_lo = seal_lo;
    s->seal_hi = seal_lo + seal_len;
    s->timeout_s = timeout_s;
    s->idle_s = idle_s;
    s->sndbuf = sndbuf;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->gone, NULL);
    struct sockaddr_storage addr;
    socklen_t alen;
    if (tcp_address(host, port, &addr, &alen)) {
        PyErr_Format(PyExc_ValueError, "TcpServer: %s:%d is not a numeric address and port", host, port);
        goto fail;
    }
    int one = 1, err = 0;
    s->lfd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
        bind(s->lfd, (struct sockaddr *)&addr, alen) < 0 || listen(s->lfd, 128) < 0 || pipe2(s->wake, O_CLOEXEC) < 0 ||
        getsockname(s->lfd, (struct sockaddr *)&addr, &alen) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    if (*local && (s->ufd = tcp_local_listen(local, &err)) < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    o->port = ntohs(addr.ss_family == AF_INET ? ((struct sockaddr_in *)&addr)->sin_port
                                              : ((struct sockaddr_in6 *)&addr)->sin6_port);
    pthread_t t;
    s->threads = 1;
    err = pthread_create(&t, NULL, accept_main, s);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    pthread_detach(t);
    o->s = s;
    Py_DECREF(seq);
    PyBuffer_Release(&secret);
    return 0;
fail:
    if (s) server_free(s);
    Py_XDECREF(seq);
    PyBuffer_Release(&secret);
    return -1;
}

static PyObject *server_close(TcpServerObject *o, PyObject *args) {
    double timeout_s = 10.0;
    if (!PyArg_ParseTuple(args, "|d", &timeout_s)) return NULL;
    return PyBool_FromLong(server_stop(o, timeout_s));
}

static PyObject *server_stats(TcpServerObject *o, PyObject *unused) {
    server *s = o->s;
    if (!s) return Py_BuildValue("(KKKK)", 0ULL, 0ULL, 0ULL, 0ULL);
    pthread_mutex_lock(&s->lock);
    PyObject *r = Py_BuildValue("(KKKK)", (unsigned long long)s->n_conns, (unsigned long long)s->n_requests,
                                (unsigned long long)s->n_bytes, (unsigned long long)s->n_refused);
    pthread_mutex_unlock(&s->lock);
    return r;
}

static PyObject *server_port(TcpServerObject *o, void *unused) { return PyLong_FromLong(o->port); }

static void server_dealloc(TcpServerObject *o) {
    (void)server_stop(o, 10.0);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyMethodDef server_methods[] = {
    {"close", (PyCFunction)server_close, METH_VARARGS,
     "close(timeout_s=10) -> bool: stop serving; True once every serving thread ended (the KV may go then)"},
    {"stats", (PyCFunction)server_stats, METH_NOARGS, "stats() -> (connections, requests, bytes, refused)"},
    {NULL}};

static PyGetSetDef server_getset[] = {{"port", (getter)server_port, NULL, "the port it listens on", NULL}, {NULL}};

PyTypeObject TcpServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.TcpServer",
    .tp_doc = "TcpServer(host, port, regions, secret, *, seals=(0, 0), timeout_s=10, idle_s=300, sndbuf=0, local=''): serves the "
              "registered regions' bytes to consumers holding the secret (the tcp lane)",
    .tp_basicsize = sizeof(TcpServerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)server_init,
    .tp_dealloc = (destructor)server_dealloc,
    .tp_methods = server_methods,
    .tp_getset = server_getset,
};
