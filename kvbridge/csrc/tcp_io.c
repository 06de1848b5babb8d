/* The tcp lane's socket helpers (tcp.h): every wait is a poll() bounded by an absolute deadline. */
#include "tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double tcp_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int tcp_wait(int fd, short events, double until) {
    for (;;) {
        double left = until - tcp_now();
        if (left <= 0) return ETIMEDOUT;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (r < 0 && errno != EINTR) return errno;
        if (r <= 0) continue;
        if (p.revents & POLLNVAL) return EBADF;
        /* asked for (a sender's wait): the peer closed its side, so nothing it is sent will be read (neither
         * end of the lane half-closes).  Without this a sender facing a zero window waits out its deadline. */
        return (events & POLLRDHUP) && (p.revents & POLLRDHUP) ? ECONNRESET : 0;
    }
}

void tcp_iov_skip(struct iovec *iov, int n, int *first, size_t moved) {
    while (*first < n && moved >= iov[*first].iov_len) moved -= iov[(*first)++].iov_len;
    if (*first < n && moved) {
        iov[*first].iov_base = (char *)iov[*first].iov_base + moved;
        iov[*first].iov_len -= moved;
    }
    while (*first < n && iov[*first].iov_len == 0) (*first)++; /* a recvmsg of nothing reads as the peer's close */
}

int tcp_iov_offer(const struct iovec *iov, int n, size_t most) {
    size_t offered = 0;
    int k = 0;
    while (k < n && k < IOV_MAX && offered < most) offered += iov[k++].iov_len;
    return k;
}

/* Bytes one call is offered, at most: more than a socket buffer holds (the kernel's auto-tuned ones reach a
 * few MiB), so a call is never short for lack of entries, while the kernel imports and checks only the
 * entries offered each call, not every one left of a load's thousands (bench case: benches/tcp_lane_probe.py,
 * rows scat:4 against one:4, the same bytes as one entry). */
#define CALL_BYTES (8u << 20)

/* A blocking socket's next call waits at most `left` seconds (> 0): SO_SNDTIMEO or SO_RCVTIMEO. */
static int bound_call(int fd, int sending, double left) {
    struct timeval tv = {(time_t)left, (suseconds_t)((left - (double)(time_t)left) * 1e6)};
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1; /* zero would mean "wait for ever" */
    return setsockopt(fd, SOL_SOCKET, sending ? SO_SNDTIMEO : SO_RCVTIMEO, &tv, sizeof(tv)) ? errno : 0;
}

/* A non-blocking socket's call is tried first and polled only when the socket is not ready: a stream that
 * keeps up never pays a poll() per message.  A blocking socket's call waits itself, bounded by what is left
 * of the deadline (set before each call: the deadline is the exchange's, not the call's).  The deadline is
 * checked before every call too, so a stream that always has a few bytes ready (it never waits) still ends
 * at it. */
static int move_all(int fd, struct iovec *iov, int n, double until, int sending) {
    int blocking = !(fcntl(fd, F_GETFL) & O_NONBLOCK), first = 0;
    tcp_iov_skip(iov, n, &first, 0);
    while (first < n) {
        double left = until - tcp_now();
        if (left <= 0) return ETIMEDOUT;
        if (blocking) {
            int err = bound_call(fd, sending, left);
            if (err) return err;
        }
        int k = tcp_iov_offer(iov + first, n - first, CALL_BYTES);
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov + first;
        m.msg_iovlen = (size_t)k;
        int flags = blocking ? 0 : MSG_DONTWAIT;
        ssize_t r = sending ? sendmsg(fd, &m, flags | MSG_NOSIGNAL) : recvmsg(fd, &m, flags);
        if (r > 0) {
            tcp_iov_skip(iov, n, &first, (size_t)r);
            continue;
        }
        if (r == 0) return ECONNRESET; /* the peer closed (or a sibling shut this socket down) mid-message */
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
        if (blocking) continue; /* its bound ran out: the deadline, checked above, says whether to go on */
        int err = tcp_wait(fd, sending ? POLLOUT | POLLRDHUP : POLLIN, until);
        if (err) return err;
    }
    return 0;
}

int tcp_sendv(int fd, struct iovec *iov, int n, double until) { return move_all(fd, iov, n, until, 1); }
int tcp_recvv(int fd, struct iovec *iov, int n, double until) { return move_all(fd, iov, n, until, 0); }

int tcp_send_all(int fd, const void *buf, size_t len, double until) {
    struct iovec v = {(void *)buf, len};
    return len ? tcp_sendv(fd, &v, 1, until) : 0;
}

int tcp_recv_all(int fd, void *buf, size_t len, double until) {
    struct iovec v = {buf, len};
    return len ? tcp_recvv(fd, &v, 1, until) : 0;
}

void tcp_tune(int fd, int sndbuf) {
    int one = 1;
    (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (sndbuf > 0) (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)); /* tcp_serve.c says why */
}

int tcp_address(const char *host, int port, struct sockaddr_storage *out, socklen_t *len) {
    memset(out, 0, sizeof(*out));
    if (port < 0 || port > 65535) return EINVAL;
    struct sockaddr_in *v4 = (struct sockaddr_in *)out;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)port);
        *len = sizeof(*v4);
        return 0;
    }
    if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)port);
        *len = sizeof(*v6);
        return 0;
    }
    return EINVAL;
}

int tcp_connect(const struct sockaddr *addr, socklen_t addrlen, double until, int *err) {
    int fd = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    tcp_tune(fd, 0); /* a consumer sends only requests; its receive buffer stays the kernel's auto-tuned one */
    if (connect(fd, addr, addrlen) < 0 && errno != EINPROGRESS) {
        *err = errno;
        close(fd);
        return -1;
    }
    int e = tcp_wait(fd, POLLOUT, until);
    socklen_t sl = sizeof(int);
    if (!e && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) < 0) e = errno;
    if (!e && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0) e = errno; /* tcp.h: why it blocks */
    if (e) {
        *err = e;
        close(fd);
        return -1;
    }
    return fd;
}

void tcp_name_thread(const char *name) {
#ifdef __linux__
    (void)pthread_setname_np(pthread_self(), name);
#else
    (void)name;
#endif
}
