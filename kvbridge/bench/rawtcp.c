/* The cross-host bench's raw medium: plain TCP in C, the same bytes over N streams, no protocol beyond a
 * one-byte ask per stream (kvbridge/bench/rawtcp.py compiles and runs it; rows `ctcp:N`).
 *
 *   rawtcp send NBYTES STREAMS [SNDBUF | @NAME]           listens on every address, prints @@{"port": P}
 *   rawtcp recv HOST PORT NBYTES STREAMS REPS EVICT_BYTES  prints @@{"samples": [...]} or @@{"error": ...}
 *
 * The receiver connects STREAMS sockets once (kept for every repetition, as kvbridge keeps its streams),
 * then per repetition: evicts the CPU caches (reads and rewrites EVICT_BYTES, untimed, as every row of the
 * bench does), and times from the first ask to the last byte: each stream's thread sends 'g' and receives
 * its slice (NBYTES cut in STREAMS equal parts) straight into one buffer with recv().  The sender answers
 * each 'g' with send() of its slice of a pattern.  The first repetition is a warm-up whose bytes are
 * compared with the pattern.  Blocking sockets, the kernel's default (auto-tuned) buffers, TCP_NODELAY for
 * the asks: what a C program moves over the link at kernel speed, the bar for kvbridge's tcp lane.
 *
 * SNDBUF > 0 (rows ctcp-sndbuf:N): the sender caps each socket's send buffer at SNDBUF and sends without
 * blocking, waiting in poll() when the buffer is full, as the tcp lane's server does (tcp_serve.c says
 * why): the same socket settings in a program with nothing else in it, so that the lane is held to the
 * best the medium does with them too.
 *
 * @NAME (rows pipe:N): the sender listens on the abstract Unix socket NAME instead, hands each connection a
 * pipe's read end (SCM_RIGHTS) and answers each 'g' by vmsplicing its slice into that pipe, by reference;
 * the receiver (HOST @NAME) read()s it out: one copy, the medium of the tcp lane's local connections
 * (kvbridge/csrc/tcp_local.c), which crosses between processes of one network namespace only.
 *
 * KVBRIDGE_RAWTCP_PIECE=P, _REGIONS=G, _SLOTS=S on both sides (rows `…/scat`): the bytes lie as a scattered
 * request's lie in a paged KV cache: G regions (a layer's K or V plane) of S slots of P bytes (a block's
 * share of the plane), the request's blocks at the same random slots of every region, a permutation of
 * each side's own; moved with one iovec entry per piece and at most what the lane offers per call
 * (CALL_BYTES through a socket, PIPE_BYTES through a pipe).  The medium in the layout the lane moves, so
 * that what the layout costs the memory system is measured apart from the lane.  Defaults: G = 1 (NBYTES
 * any size, the last piece short), S = twice the pieces; with G > 1, NBYTES must be G regions of whole pieces.
 *
 * Both buffers are asked for transparent huge pages (madvise), as the ucx worker backs an engine's KV cache
 * (connectors/ucx/hugepages.py): the kernel's copies into and out of the socket then miss the TLB less, and
 * a raw row on small pages would set the bar lower than the medium allows.  KVBRIDGE_RAWTCP_SMALL_PAGES=1 in the environment keeps 4 KiB pages.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_STREAMS 64
#define MAX_IOV 1024               /* IOV_MAX */
#define CALL_BYTES (8u << 20)      /* the lane's bytes per socket call (kvbridge/csrc/tcp_io.c) */
#define PIPE_BYTES (1u << 20)      /* and per pipe call: the pipe's size */

static unsigned char *buf;
static size_t nbytes;
static int streams, sndbuf;
static const char *local; /* the abstract socket's name (pipe rows), else NULL */
static int pipes[MAX_STREAMS]; /* the sender's write ends, the receiver's read ends */

static size_t piece;  /* KVBRIDGE_RAWTCP_PIECE: bytes per scattered piece; 0: one buffer */
static size_t *where; /* piece j of the stream lies at buf + where[j] * piece */

static void fail(const char *what);

static size_t env_size(const char *name, size_t otherwise) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : otherwise;
}

/* The scattered layout (see the header): where[] for each side, its own permutation of a region's slots. */
static size_t scatter(int sending) {
    size_t pieces = (nbytes + piece - 1) / piece, regions = env_size("KVBRIDGE_RAWTCP_REGIONS", 1);
    size_t per = pieces / (regions ? regions : 1), slots = env_size("KVBRIDGE_RAWTCP_SLOTS", 2 * per);
    if (!regions || (regions > 1 && per * piece * regions != nbytes) || slots < per)
        fail("KVBRIDGE_RAWTCP_REGIONS must split NBYTES into whole pieces, and _SLOTS hold a region's");
    size_t *perm = malloc(slots * sizeof(size_t));
    where = malloc(pieces * sizeof(size_t));
    if (!perm || !where) fail("out of memory");
    uint64_t x = sending ? 0x9E3779B97F4A7C15u : 0xD1B54A32D192ED03u; /* each side its own layout */
    for (size_t j = 0; j < slots; j++) perm[j] = j;
    for (size_t j = slots; j > 1; j--) { /* Fisher-Yates, xorshift */
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t k = (size_t)(x % j), t = perm[j - 1];
        perm[j - 1] = perm[k], perm[k] = t;
    }
    for (size_t r = 0; r < regions; r++)
        for (size_t j = 0; j < per; j++) where[r * per + j] = r * slots + perm[j];
    free(perm);
    return regions * slots * piece;
}

/* The byte i of the stream, and the iovec entries of [at, hi) for one call: one entry per piece. */
static unsigned char *addr(size_t i) { return piece ? buf + where[i / piece] * piece + i % piece : buf + i; }

static int span(size_t at, size_t hi, size_t cap, struct iovec *v) {
    if (!piece) return v[0] = (struct iovec){buf + at, hi - at}, 1;
    int n = 0;
    for (size_t end = hi - at > cap ? at + cap : hi; at < end && n < MAX_IOV; n++) {
        size_t len = piece - at % piece < end - at ? piece - at % piece : end - at;
        v[n] = (struct iovec){addr(at), len};
        at += len;
    }
    return n;
}

static unsigned char pattern(size_t i) { return (unsigned char)((i * 2654435761u) >> 13) ^ (unsigned char)(i >> 20); }

/* n bytes on huge pages where the kernel gives them (2 MiB aligned, MADV_HUGEPAGE), touched once. */
static unsigned char *alloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 2u << 20, n)) return NULL;
    const char *small = getenv("KVBRIDGE_RAWTCP_SMALL_PAGES");
    if (!(small && *small == '1')) (void)madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0xA5, n);
    return p;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void fail(const char *what) {
    printf("@@{\"error\": \"rawtcp: %s\"}\n", what);
    fflush(stdout);
    exit(1);
}

static size_t cut(int k) { return (size_t)((unsigned __int128)nbytes * (unsigned)k / (unsigned)streams); }

static double cpu_s(void) { /* this process's CPU time, every thread */
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

static void nodelay(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static socklen_t local_address(struct sockaddr_un *u) {
    memset(u, 0, sizeof(*u));
    u->sun_family = AF_UNIX;
    size_t n = strlen(local);
    if (n + 1 >= sizeof(u->sun_path)) fail("NAME too long");
    memcpy(u->sun_path + 1, local, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* A connection's pipe: its read end to the receiver (SCM_RIGHTS), its write end kept (non-blocking). */
static int hand_pipe(int fd) {
    int p[2];
    if (pipe(p) < 0) fail("pipe failed");
    (void)fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
    (void)fcntl(p[1], F_SETFL, O_NONBLOCK);
    char one = 1, room[CMSG_SPACE(sizeof(int))];
    struct iovec v = {&one, 1};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = room, .msg_controllen = sizeof(room)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &p[0], sizeof(int));
    if (sendmsg(fd, &m, 0) != 1) fail("cannot hand a pipe over");
    close(p[0]);
    return p[1];
}

static int take_pipe(int fd) {
    char one, room[CMSG_SPACE(sizeof(int))];
    struct iovec v = {&one, 1};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = room, .msg_controllen = sizeof(room)};
    int p = -1;
    if (recvmsg(fd, &m, 0) != 1 || !CMSG_FIRSTHDR(&m)) fail("no pipe handed over");
    memcpy(&p, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof(int));
    return p;
}

/* ---- sender */

static void *serve(void *arg) {
    int fd = (int)(intptr_t)arg >> 8, k = (int)(intptr_t)arg & 0xff;
    size_t lo = cut(k), hi = cut(k + 1);
    char ask;
    int wait = sndbuf ? MSG_DONTWAIT : 0;
    while (recv(fd, &ask, 1, MSG_WAITALL) == 1 && ask == 'g') {
        for (size_t at = lo; at < hi;) {
            struct iovec v[MAX_IOV];
            struct msghdr m = {.msg_iov = v};
            m.msg_iovlen = (size_t)span(at, hi, local ? PIPE_BYTES : CALL_BYTES, v);
            ssize_t r = local ? vmsplice(pipes[k], v, m.msg_iovlen, SPLICE_F_NONBLOCK) : sendmsg(fd, &m, MSG_NOSIGNAL | wait);
            if (r < 0 && local && errno == EAGAIN) {
                struct pollfd p = {pipes[k], POLLOUT, 0};
                if (poll(&p, 1, -1) < 0 && errno != EINTR) return NULL;
                continue;
            }
            if (r < 0 && wait && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                struct pollfd p = {fd, POLLOUT, 0};
                if (poll(&p, 1, -1) < 0 && errno != EINTR) return NULL;
                continue;
            }
            if (r <= 0) return NULL;
            at += (size_t)r;
        }
    }
    close(fd);
    return NULL;
}

static int do_send(void) {
    for (size_t i = 0; i < nbytes; i++) *addr(i) = pattern(i);
    int lfd = socket(local ? AF_UNIX : AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = {htonl(INADDR_ANY)}};
    struct sockaddr_un u;
    socklen_t al = local ? local_address(&u) : sizeof(a);
    struct sockaddr *sa = local ? (struct sockaddr *)&u : (struct sockaddr *)&a;
    if (lfd < 0 || setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 || bind(lfd, sa, al) < 0 ||
        listen(lfd, MAX_STREAMS) < 0 || (!local && getsockname(lfd, sa, &al) < 0))
        fail("cannot listen");
    printf("@@{\"port\": %d}\n", local ? 0 : ntohs(a.sin_port));
    fflush(stdout);
    pthread_t t[MAX_STREAMS];
    for (int k = 0; k < streams; k++) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) fail("accept failed");
        if (local) pipes[k] = hand_pipe(fd);
        nodelay(fd);
        if (sndbuf > 0) (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
        pthread_create(&t[k], NULL, serve, (void *)(intptr_t)((fd << 8) | k));
    }
    close(lfd);
    double c0 = cpu_s();
    for (int k = 0; k < streams; k++) pthread_join(t[k], NULL);
    printf("@@{\"cpu\": %.6f}\n", cpu_s() - c0); /* what serving every repetition cost, for a reader that asks */
    fflush(stdout);
    return 0;
}

/* ---- receiver */

static int fds[MAX_STREAMS];
static pthread_barrier_t go, done;
static int quit, failed;

static void *take(void *arg) {
    int k = (int)(intptr_t)arg;
    for (;;) {
        pthread_barrier_wait(&go);
        if (quit) return NULL;
        size_t lo = cut(k), hi = cut(k + 1);
        if (send(fds[k], "g", 1, MSG_NOSIGNAL) != 1) failed = 1;
        for (size_t at = lo; !failed && at < hi;) {
            struct iovec v[MAX_IOV];
            int n = span(at, hi, local ? PIPE_BYTES : CALL_BYTES, v);
            ssize_t r = readv(local ? pipes[k] : fds[k], v, n);
            if (r <= 0) failed = 1;
            else at += (size_t)r;
        }
        pthread_barrier_wait(&done);
    }
}

static void evict(unsigned char *scratch, size_t n) {
    for (size_t i = 0; i < n; i += 64) scratch[i] += 1; /* a read and a write of every line */
}

static int do_recv(const char *host, int port, int reps, size_t evict_bytes) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    struct sockaddr_un u;
    if (host[0] == '@') local = host + 1;
    else if (inet_pton(AF_INET, host, &a.sin_addr) != 1) fail("host is not a numeric IPv4 address or @NAME");
    socklen_t al = local ? local_address(&u) : sizeof(a);
    for (int k = 0; k < streams; k++) {
        fds[k] = socket(local ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
        if (fds[k] < 0 || connect(fds[k], local ? (struct sockaddr *)&u : (struct sockaddr *)&a, al) < 0)
            fail(local ? "cannot connect to @NAME (not in this network namespace?)" : "cannot connect");
        if (local) pipes[k] = take_pipe(fds[k]);
        nodelay(fds[k]);
    }
    unsigned char *scratch = evict_bytes ? malloc(evict_bytes) : NULL; /* small pages: only the caches matter */
    if (scratch) memset(scratch, 1, evict_bytes);
    pthread_barrier_init(&go, NULL, (unsigned)streams + 1);
    pthread_barrier_init(&done, NULL, (unsigned)streams + 1);
    pthread_t t[MAX_STREAMS];
    for (int k = 0; k < streams; k++) pthread_create(&t[k], NULL, take, (void *)(intptr_t)k);
    double *samples = calloc((size_t)reps + 1, sizeof(double)), cpu = 0;
    for (int i = 0; i <= reps; i++) {
        if (scratch) evict(scratch, evict_bytes);
        double c0 = cpu_s(), t0 = now();
        pthread_barrier_wait(&go);
        pthread_barrier_wait(&done);
        samples[i] = now() - t0;
        if (i) cpu += cpu_s() - c0;
        if (failed) fail("the sender went away");
        if (i == 0)
            for (size_t j = 0; j < nbytes; j++)
                if (*addr(j) != pattern(j)) fail("received bytes differ from the sender's");
    }
    quit = 1;
    pthread_barrier_wait(&go);
    for (int k = 0; k < streams; k++) {
        pthread_join(t[k], NULL);
        (void)!send(fds[k], "q", 1, MSG_NOSIGNAL);
        close(fds[k]);
    }
    printf("@@{\"samples\": [");
    for (int i = 1; i <= reps; i++) printf("%s%.9f", i > 1 ? ", " : "", samples[i]);
    printf("], \"cpu\": %.6f}\n", cpu / reps);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) fail("usage: rawtcp send NBYTES STREAMS [SNDBUF | @NAME] | recv HOST PORT NBYTES STREAMS REPS EVICT_BYTES");
    int sending = strcmp(argv[1], "send") == 0;
    if (!sending && argc != 8) fail("usage: rawtcp recv HOST PORT NBYTES STREAMS REPS EVICT_BYTES");
    if (sending && argc > 5) fail("usage: rawtcp send NBYTES STREAMS [SNDBUF | @NAME]");
    if (sending && argc == 5 && argv[4][0] == '@') local = argv[4] + 1;
    else sndbuf = sending && argc == 5 ? atoi(argv[4]) : 0;
    if (sndbuf < 0) fail("SNDBUF >= 0");
    nbytes = strtoull(argv[sending ? 2 : 4], NULL, 10);
    streams = atoi(argv[sending ? 3 : 5]);
    if (!nbytes || streams < 1 || streams > MAX_STREAMS) fail("NBYTES > 0 and STREAMS in [1, 64]");
    piece = env_size("KVBRIDGE_RAWTCP_PIECE", 0);
    buf = alloc(piece ? scatter(sending) : nbytes);
    if (!buf) fail("out of memory");
    return sending ? do_send() : do_recv(argv[2], atoi(argv[3]), atoi(argv[6]), strtoull(argv[7], NULL, 10));
}
