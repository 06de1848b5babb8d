/* The tcp lane's local medium: between processes that share a network namespace (two pods of one node with
 * one network, or two engines on one host whose pid namespaces differ, where cma cannot reach), the
 * producer's KV pages go by reference into a pipe and the consumer copies them out: one copy, where TCP
 * over loopback makes two (into the socket, out of it).
 *
 * How: the producer's TcpServer also listens on an abstract Unix socket (a name of 128 random bits, which
 * exists only inside its network namespace).  A consumer that can connect to it says hello with the secret
 * as over TCP; the server answers with the status and, as SCM_RIGHTS, the read end of a pipe of its own
 * for that connection.  Requests, and the reply's header, go over the socket as over TCP; the data goes
 * into the pipe with vmsplice(), which hands the kernel references to the KV's pages, not copies, and the
 * consumer's readv() copies them into its KV (bench case: `kvbridge bench hosts --pods`, rows kvbridge,
 * pipe:4 and ctcp-sndbuf:4).
 *
 * The seal: over TCP the server reads the seal word after the data was copied into the socket.  Here the
 * data is copied when the consumer reads it, so the seal word goes into the pipe by reference too, after
 * the data: the consumer's copy of it is read after its copy of every data byte, as the cma lane reads it
 * (the pages of a producer that exits stay readable, unchanged, until the pipe is drained).  Should a
 * kernel make vmsplice copy instead, the word is copied after the data all the same.
 *
 * Waits: both ends' pipe fds are non-blocking, and every wait on a pipe also watches the connection's
 * socket, so a connection shut down (the server's close(), a sibling stream's failure) or a peer gone ends
 * the wait at once rather than at the deadline.  A consumer that goes away closes the pipe's read end: the
 * server's next vmsplice fails with EPIPE (the SIGPIPE it raises is blocked in the server's threads and
 * taken back at once).
 */
#include "tcp.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

int tcp_local_address(const char *name, struct sockaddr_storage *out, socklen_t *len) {
    size_t n = strlen(name);
    struct sockaddr_un *u = (struct sockaddr_un *)out;
    if (n < 1 || n >= sizeof(u->sun_path)) return EINVAL;
    memset(out, 0, sizeof(*out));
    u->sun_family = AF_UNIX;
    memcpy(u->sun_path + 1, name, n); /* sun_path[0] == 0: the abstract namespace, no file anywhere */
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
    return 0;
}

int tcp_local_listen(const char *name, int *err) {
    struct sockaddr_storage a;
    socklen_t alen;
    if ((*err = tcp_local_address(name, &a, &alen))) return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, alen) < 0 || listen(fd, 128) < 0) {
        *err = errno;
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

/* ---- the pipe, handed over once per connection */

int tcp_pipe_offer(int sock, uint32_t status, int *pipe_w, double until) {
    int p[2] = {-1, -1};
    if (status == TCP_OK && pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0) status = TCP_BUSY;
    if (p[1] >= 0) (void)fcntl(p[1], F_SETPIPE_SZ, TCP_PIPE_BYTES); /* refused: the default size, slower */
    if (tcp_wait(sock, POLLOUT, until)) {
        if (p[0] >= 0) close(p[0]), close(p[1]);
        return ETIMEDOUT;
    }
    struct iovec v = {&status, sizeof(status)};
    union {
        struct cmsghdr h;
        char room[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    memset(&ctl, 0, sizeof(ctl));
    m.msg_iov = &v;
    m.msg_iovlen = 1;
    if (p[0] >= 0) {
        m.msg_control = ctl.room;
        m.msg_controllen = sizeof(ctl.room);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &p[0], sizeof(int));
    }
    int err = sendmsg(sock, &m, MSG_NOSIGNAL) == (ssize_t)sizeof(status) ? 0 : errno ? errno : EPROTO;
    if (p[0] >= 0) close(p[0]); /* the consumer holds the read end now */
    if (err || status != TCP_OK) {
        if (p[1] >= 0) close(p[1]);
        return err ? err : EACCES;
    }
    *pipe_w = p[1];
    return 0;
}

int tcp_pipe_take(int sock, uint32_t *status, int *pipe_r, double until) {
    *pipe_r = -1;
    union {
        struct cmsghdr h;
        char room[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec v = {status, sizeof(*status)};
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    m.msg_iov = &v;
    m.msg_iovlen = 1;
    m.msg_control = ctl.room;
    m.msg_controllen = sizeof(ctl.room);
    int err = tcp_wait(sock, POLLIN, until);
    if (err) return err;
    ssize_t r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r < 0) return errno == EAGAIN ? ETIMEDOUT : errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(pipe_r, CMSG_DATA(c), sizeof(int));
    if (r != (ssize_t)sizeof(*status)) err = r == 0 ? ECONNRESET : EPROTO; /* the status is 4 bytes, sent at once */
    else if (*status == TCP_OK && *pipe_r < 0) err = EPROTO;
    if (err && *pipe_r >= 0) close(*pipe_r), *pipe_r = -1;
    return err;
}

/* ---- data through the pipe */

/* Wait for the pipe (POLLIN or POLLOUT) by `until`; any event on the socket (hang-up, shut down, stray
 * bytes: nothing is sent on it while data moves) ends the exchange. */
static int pipe_wait(int pipe, short events, int sock, double until) {
    for (;;) {
        double left = until - tcp_now();
        if (left <= 0) return ETIMEDOUT;
        struct pollfd p[2] = {{pipe, events, 0}, {sock, POLLIN | POLLRDHUP, 0}};
        int r = poll(p, 2, (int)(left * 1000.0) + 1);
        if (r < 0 && errno != EINTR) return errno;
        if (r <= 0) continue;
        if (p[1].revents) return ECONNRESET;
        if (p[0].revents & POLLNVAL) return EBADF;
        return 0; /* ready, or an error (POLLERR, POLLHUP) the next call reports */
    }
}

/* SIGPIPE of a vmsplice into a pipe nobody reads: blocked in the server's threads, and taken back here, so
 * that it never reaches the process (whose handler may not ignore it) or piles up pending. */
static void drop_sigpipe(void) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    struct timespec zero = {0, 0};
    while (sigtimedwait(&s, NULL, &zero) == SIGPIPE) {
    }
}

enum { PIPE_READ, PIPE_SPLICE, PIPE_WRITE }; /* readv out of it; vmsplice (references) or writev (copies) in */

static int pipe_move(int pipe, int sock, struct iovec *iov, int n, double until, int how) {
    int first = 0;
    tcp_iov_skip(iov, n, &first, 0);
    while (first < n) {
        if (tcp_now() >= until) return ETIMEDOUT;
        /* at most a pipe's worth of entries a call: the kernel imports and checks every entry offered, and a
         * call moves no more than the pipe holds (bench case: benches/tcp_lane_probe.py, rows lscat:4 and
         * lone:4, scattered pieces against the same bytes as one entry) */
        int k = tcp_iov_offer(iov + first, n - first, TCP_PIPE_BYTES);
        ssize_t r = how == PIPE_SPLICE  ? vmsplice(pipe, iov + first, (unsigned long)k, SPLICE_F_NONBLOCK)
                    : how == PIPE_WRITE ? writev(pipe, iov + first, k)
                                        : readv(pipe, iov + first, k);
        if (r > 0) {
            tcp_iov_skip(iov, n, &first, (size_t)r);
            continue;
        }
        if (r == 0) return ECONNRESET; /* the server closed its end mid-message */
        int e = errno;
        if (e == EINTR) continue;
        if (e == EPIPE) drop_sigpipe(); /* (changes errno) */
        if (e != EAGAIN) return e;
        int err = pipe_wait(pipe, how == PIPE_READ ? POLLIN : POLLOUT, sock, until);
        if (err) return err;
    }
    return 0;
}

int tcp_pipe_splicev(int pipe_w, int sock, struct iovec *iov, int n, double until) {
    return pipe_move(pipe_w, sock, iov, n, until, PIPE_SPLICE);
}

int tcp_pipe_write(int pipe_w, int sock, const void *buf, size_t len, double until) {
    struct iovec v = {(void *)buf, len};
    return pipe_move(pipe_w, sock, &v, 1, until, PIPE_WRITE);
}

int tcp_pipe_readv(int pipe_r, int sock, struct iovec *iov, int n, double until) {
    return pipe_move(pipe_r, sock, iov, n, until, PIPE_READ);
}

void tcp_block_sigpipe(void) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    (void)pthread_sigmask(SIG_BLOCK, &s, NULL);
}
