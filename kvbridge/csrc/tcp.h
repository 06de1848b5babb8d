/* The tcp lane's internal header: its wire format and the socket helpers that tcp_serve.c (the producer's
 * server) and tcp_read.c (the consumer's reads) share.
 *
 * Why a lane of our own: UCX over TCP has no one-sided GET; it emulates one with active messages on one
 * connection in small segments, answered by a progress thread, and moves a fraction of what plain sockets
 * move on the same link (bench case: `kvbridge bench hosts`, rows kvbridge-ucp and tcp:N).  Here the
 * producer's C threads write the registered KV straight from its memory to several sockets at once, and
 * the consumer's C threads read straight into its own KV; Python does nothing per block on either side.
 *
 * The wire (little-endian, one version):
 *
 *   consumer -> server, once per connection:  HELLO  u32 magic "KVBT", u32 version, u8 secret[32]
 *   server -> consumer:                       u32 status (TCP_OK; TCP_BAD_SECRET or TCP_BAD_VERSION and the
 *                                             socket closes)
 *   consumer -> server, per request:          u32 magic "KVBR", u32 n, u64 seal_address, n x (u64 addr, u64 len)
 *   server -> consumer:                       u32 status, u32 0, u64 total, 48 zero bytes (64 in all);
 *                                             total bytes of data; u64 seal word, then zero bytes up to the
 *                                             next multiple of 64 bytes of the reply (tcp_trailer_bytes)
 *
 * Why replies keep their data on 64-byte boundaries of the stream: the producer's kernel copies the KV into
 * socket pages at the stream's offset and the consumer's kernel copies it out of them into the KV, whose
 * pieces start on cache lines.  With the data at any other offset both copies run with source and
 * destination on different alignments, the case string copies handle worst.  It costs at most 120 bytes a
 * reply; what it buys is small beside a 2-core host's spread (benches/tcp_lane_probe.py, rows scat:4 and
 * ctcp-sndbuf:4/scat, the lane beside plain TCP in the same layout).
 *
 * A request outside the registered regions is answered TCP_OUT_OF_BOUNDS, and the connection closes: no
 * byte of it is served.  The seal word is read after the data was copied into the socket (so it is never
 * older than the data; MSG_ZEROCOPY would break that: the NIC would read the pages later), or 0 when the
 * address is not a word of the seal table.
 *
 * Every socket operation waits until an absolute deadline, never longer.  The producer's sockets are
 * non-blocking and wait in poll() (tcp_wait): a sender refills its capped send buffer as soon as it drains
 * (tcp_serve.c).  A consumer's socket blocks once connected, each call bounded by SO_RCVTIMEO / SO_SNDTIMEO
 * set to what is left of the deadline: the kernel then copies arriving bytes while the thread is inside
 * recvmsg, one wake-up per batch instead of a poll() and a recvmsg, which costs the consumer and the
 * producer less CPU a load and holds up better on busy cores (benches/tcp_lane_probe.py, reader and
 * server CPU per load).  The deadline bounds a whole exchange, not each wait: a consumer's read ends by its
 * start + timeout_s, a producer's answer to one request by its arrival + timeout_s, so a dead peer, a cut
 * link or a link that keeps trickling bytes ends in ETIMEDOUT or a reset, never a hang.
 */
#ifndef KVB_TCP_H
#define KVB_TCP_H

#include "core.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* The wire's integers are written as the host holds them: both ends are little-endian here. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the tcp lane's wire is little-endian"
#endif

#define TCP_MAGIC_HELLO 0x5442564Bu   /* "KVBT" */
#define TCP_MAGIC_REQUEST 0x5242564Bu /* "KVBR" */
#define TCP_VERSION 2u
#define TCP_SECRET_BYTES 32

enum { TCP_OK = 0, TCP_BAD_SECRET = 1, TCP_OUT_OF_BOUNDS = 2, TCP_BAD_REQUEST = 3, TCP_BUSY = 4, TCP_BAD_VERSION = 5 };

/* What a reply's data is aligned to in the stream (the wire above says why). */
#define TCP_ALIGN 64

/* Descriptors in one request at most: bounds what a server allocates for one before checking it. */
#define TCP_MAX_DESCS (1u << 20)

typedef struct {
    uint32_t magic, version;
    uint8_t secret[TCP_SECRET_BYTES];
} tcp_hello;

typedef struct {
    uint32_t magic, n;
    uint64_t seal_address;
} tcp_request;

typedef struct {
    uint32_t status, zero;
    uint64_t total;
    uint8_t pad[TCP_ALIGN - 16];
} tcp_reply;

/* A reply's end over TCP: the seal word and the zeros that end the reply on a TCP_ALIGN boundary (through a
 * pipe only the word: its data is copied from the producer's own pages, wherever the header went). */
typedef struct {
    uint64_t word;
    uint8_t pad[TCP_ALIGN - 8];
} tcp_trailer;

/* Where part k of n of a read of `total` bytes ends: on a TCP_ALIGN boundary, so that each part's data stays
 * aligned as the pieces are (the last part ends at total). */
static inline uint64_t tcp_part_end(uint64_t total, uint64_t k, uint64_t n) {
    return k + 1 == n ? total : total * (k + 1) / n / TCP_ALIGN * TCP_ALIGN;
}

/* How many bytes of a tcp_trailer follow `total` bytes of data (header + data + trailer: a multiple of 64). */
static inline size_t tcp_trailer_bytes(uint64_t total) {
    return sizeof(uint64_t) + (size_t)((TCP_ALIGN - (total + sizeof(uint64_t)) % TCP_ALIGN) % TCP_ALIGN);
}

typedef struct {
    uint64_t addr, len;
} tcp_desc;

/* Seconds on CLOCK_MONOTONIC. */
KVB_INTERNAL double tcp_now(void);
/* Wait until fd is ready for `events` (POLLIN/POLLOUT) or the deadline `until` (tcp_now() seconds) passes:
 * 0 (ready, or an error the next call will report), ETIMEDOUT, or with POLLRDHUP in `events` ECONNRESET
 * once the peer closed its side (what tcp_sendv waits with). */
KVB_INTERNAL int tcp_wait(int fd, short events, double until);
/* Send or receive all of iov[0..n) (the array is consumed in place) by the deadline `until`, however many
 * bytes move before it: a link that trickles fails as a dead one does.  Returns 0 or an errno (ETIMEDOUT;
 * ECONNRESET when the peer closed mid-message). */
KVB_INTERNAL int tcp_sendv(int fd, struct iovec *iov, int n, double until);
KVB_INTERNAL int tcp_recvv(int fd, struct iovec *iov, int n, double until);
KVB_INTERNAL int tcp_send_all(int fd, const void *buf, size_t len, double until);
KVB_INTERNAL int tcp_recv_all(int fd, void *buf, size_t len, double until);
/* Past the first `moved` bytes of iov[*first..n): *first moves on over whole entries, the next one is cut
 * (no entry is copied: a load's thousands of descriptors are walked once, not once per call). */
KVB_INTERNAL void tcp_iov_skip(struct iovec *iov, int n, int *first, size_t moved);
/* How many entries of iov[0..n) one call offers: up to `most` bytes (at least one entry), at most IOV_MAX. */
KVB_INTERNAL int tcp_iov_offer(const struct iovec *iov, int n, size_t most);
/* A connected TCP socket to a numeric address (no name lookup: it could block without a deadline) by the
 * deadline `until`, TCP_NODELAY set, blocking (its calls bounded as above); or -1 with *err set. */
KVB_INTERNAL int tcp_connect(const struct sockaddr *addr, socklen_t addrlen, double until, int *err);
/* A numeric host and port as a socket address: 0, or EINVAL. */
KVB_INTERNAL int tcp_address(const char *host, int port, struct sockaddr_storage *out, socklen_t *len);
/* fd made non-blocking and TCP_NODELAY (headers are small and answered at once); sndbuf > 0: its SO_SNDBUF. */
KVB_INTERNAL void tcp_tune(int fd, int sndbuf);
/* Name the calling thread (top -H, /proc/<pid>/task, tests). */
KVB_INTERNAL void tcp_name_thread(const char *name);

/* ---- the local medium (tcp_local.c): pipes handed over an abstract Unix socket, same network namespace */

/* A pipe's capacity: what one vmsplice() can queue before the consumer copies some out (the default 1 MiB
 * limit of /proc/sys/fs/pipe-max-size; refused, the pipe keeps the kernel's 64 KiB and moves less a call). */
#define TCP_PIPE_BYTES (1 << 20)
/* Host strings starting with this name an abstract Unix socket (TcpSource's host, TcpServer's local). */
#define TCP_LOCAL_PREFIX '@'

/* `name` (no '@') as an abstract Unix socket address: 0, or EINVAL. */
KVB_INTERNAL int tcp_local_address(const char *name, struct sockaddr_storage *out, socklen_t *len);
/* A listening abstract Unix socket named `name`, or -1 with *err set (EADDRINUSE: the name is taken). */
KVB_INTERNAL int tcp_local_listen(const char *name, int *err);
/* Server: answer a hello with `status` and, when TCP_OK, a new pipe's read end (SCM_RIGHTS); its write end
 * in *pipe_w.  0, or an errno (EACCES once a refusal was sent). */
KVB_INTERNAL int tcp_pipe_offer(int sock, uint32_t status, int *pipe_w, double until);
/* Consumer: the hello's answer, and with TCP_OK the pipe's read end in *pipe_r.  0, or an errno. */
KVB_INTERNAL int tcp_pipe_take(int sock, uint32_t *status, int *pipe_r, double until);
/* All of iov into the pipe by reference (vmsplice), a copy of buf (write), or out of it (readv), by the
 * deadline `until`; any event on `sock` meanwhile ends it (ECONNRESET).  0 or an errno. */
KVB_INTERNAL int tcp_pipe_splicev(int pipe_w, int sock, struct iovec *iov, int n, double until);
KVB_INTERNAL int tcp_pipe_write(int pipe_w, int sock, const void *buf, size_t len, double until);
KVB_INTERNAL int tcp_pipe_readv(int pipe_r, int sock, struct iovec *iov, int n, double until);
/* Block SIGPIPE in the calling thread (a server thread that vmsplices: tcp_local.c says why). */
KVB_INTERNAL void tcp_block_sigpipe(void);

static inline int tcp_secret_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0; /* constant time: how much of a guess matched must not show in the answer's delay */
    for (int i = 0; i < TCP_SECRET_BYTES; i++) diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

#endif
