/* kvbridge._core's internal API: the parts (pool.c, copy.c, file.c, crc32c.c, core.c) talk through this
 * header only.  kvbridge._core needs nothing but libc and the CPython API, so it is built wherever a C
 * compiler is, UCX or not: a host tier's copies, a store's file IO and its checksums do not depend on a
 * network library.
 *
 * The model: a transfer is a job (kv_job), a list of descriptors plus a work function.  The pool (pool.c)
 * cuts a job into pieces of about equal bytes and runs them on its threads with the GIL released; the
 * caller gets a Python handle (a subtype of kvbridge._core.Job) to wait on.  Each kind of transfer (a
 * copy in this process, a read of another process, a store's file IO) is its own handle type over the
 * same job, so no handle carries a mode flag for what it is.
 */
#ifndef KVB_CORE_H
#define KVB_CORE_H

#include "args.h"

#include <sys/types.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Pieces copied at once.  A copy is bound by one thread's memory latency rather than the machine's
 * bandwidth, so a second thread helps; past that the copies share the memory bus (bench case: cpu tier,
 * load at 128 MiB, `kvbridge bench --backends cpu`). */
#define KV_THREADS 2
/* A piece is at least this long: below, splitting costs a hand-off to a thread for too little copy. */
#define KV_PIECE_BYTES (4u << 20)
/* Default: jobs this long or longer are cut between the threads. */
#define KV_CUT_BYTES (2 * KV_PIECE_BYTES)

typedef struct kv_job kv_job;

/* A job's work on descriptors [lo, hi), on any thread, GIL released, never touching Python.  Returns 0
 * or an errno; *total: bytes moved. */
typedef int (*kv_work_fn)(kv_job *job, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total);
/* Runs once after the job's last piece, when none failed, before the job is over (e.g. a seal's read). */
typedef void (*kv_last_fn)(kv_job *job);

typedef struct kv_piece {
    kv_job *job;
    Py_ssize_t lo, hi; /* its descriptors */
    struct kv_piece *next;
} kv_piece;

struct kv_job {
    descs d;               /* the caller's arrays (or arrays made for them), held until the handle dies */
    kv_work_fn work;
    kv_last_fn last;       /* or NULL */
    Py_ssize_t parts;      /* > 0: checked in blocks of this many descriptors (pieces cut between blocks) */
    uint32_t *sums;        /* checked: each block's crc32c, for the blocks moved whole */
    Py_ssize_t whole;      /* checked: blocks from the first moved whole, before any short or failed one */
    uint64_t cut_bytes;    /* cut from this many bytes */
    uint64_t total;        /* bytes moved */
    int err;               /* errno of the first piece that failed, or 0 */
    int pending;           /* pieces not over yet (pool lock) */
    int done;              /* pool lock */
    unsigned long gen;     /* the pool's fork count when queued: a job of the parent never ends in a child */
    kv_piece pieces[KV_THREADS];
};

/* ---- pool.c: the threads, and the Python handle every job returns */

/* The base handle type (kvbridge._core.Job: wait(), done()); every handle starts with JobObject. */
typedef struct {
    PyObject_HEAD
    kv_job job;
} JobObject;

KVB_INTERNAL extern PyTypeObject JobType;
/* A new handle of `type` (a subtype of Job), its job cleared and over, so that dealloc waits for
 * nothing until kv_queue(). */
KVB_INTERNAL JobObject *kv_new(PyTypeObject *type, kv_work_fn work);
/* Queue the handle's job on the threads; the handle itself, or NULL with OSError (handle released). */
KVB_INTERNAL PyObject *kv_queue(JobObject *h);
/* A job run by threads of its own instead of the queue: kv_begin_own() before they start it,
 * kv_end_own() from the last of them (err 0 or an errno; total: bytes moved). */
KVB_INTERNAL void kv_begin_own(kv_job *j);
KVB_INTERNAL void kv_end_own(kv_job *j, int err, uint64_t total);
/* Wait (releases the GIL) until the job is over or timeout_s passed (< 0: no limit; 0: only look).
 * Returns whether it is over. */
KVB_INTERNAL int kv_wait(kv_job *j, double timeout_s);
/* Checked in blocks of `parts` descriptors: its sums made.  0, or -1 with the error set. */
KVB_INTERNAL int kv_check_blocks(kv_job *j, Py_ssize_t parts, const char *fn);
/* A block of a checked job came short or failed: no block from it on counts as whole. */
KVB_INTERNAL void kv_lower_whole(kv_job *j, Py_ssize_t block);
/* Waits for the job, then frees what kv_job holds (its descs and sums); for a handle's dealloc. */
KVB_INTERNAL void kv_release(kv_job *j);
/* checked() of a checked job: (sums, whole, errno) once over. */
KVB_INTERNAL PyObject *kv_checked(JobObject *h, PyObject *unused);
/* drain(timeout_s) -> True once no job is queued or running. */
KVB_INTERNAL PyObject *kv_drain(PyObject *mod, PyObject *arg);
/* Once per process, at module init: the fork handler.  0 or -1. */
KVB_INTERNAL int kv_pool_init(void);

/* ---- copy.c: copies in this process (Copy) and reads of another process (CmaRead) */

KVB_INTERNAL extern PyTypeObject CopyType, CmaReadType;
/* Descriptors [lo, hi) of d copied in this process, remote -> local; streaming: stores that bypass the
 * cache.  Returns the bytes copied. */
KVB_INTERNAL uint64_t kv_local_copy(const descs *d, Py_ssize_t lo, Py_ssize_t hi, int streaming);
KVB_INTERNAL PyObject *py_copy(PyObject *mod, PyObject *args, PyObject *kw);
KVB_INTERNAL PyObject *py_copy_start(PyObject *mod, PyObject *args, PyObject *kw);
KVB_INTERNAL PyObject *py_cma_read(PyObject *mod, PyObject *args, PyObject *kw);
KVB_INTERNAL PyObject *py_cma_start(PyObject *mod, PyObject *args, PyObject *kw);

/* ---- file.c: a store's blocks read from or written to files, checked (FileIO) */

KVB_INTERNAL extern PyTypeObject FileIOType;
KVB_INTERNAL PyObject *py_file_start(PyObject *mod, PyObject *args, PyObject *kw);

/* ---- tcp_serve.c, tcp_read.c: the tcp lane (tcp.h) */

KVB_INTERNAL extern PyTypeObject TcpServerType, TcpSourceType, TcpReadType;
KVB_INTERNAL void kv_tcp_init(void);

/* ---- crc32c.c */

KVB_INTERNAL extern int crc_ready; /* 1: this CPU has SSE4.2 and crc_init() set the tables up */
KVB_INTERNAL extern int crc_fold;  /* 1: it also folds with VPCLMULQDQ */
KVB_INTERNAL void crc_init(void);
/* The crc32c of descriptors [i, i + n) of d (their local side), as crc32c() gives it. */
KVB_INTERNAL uint32_t descs_crc(const descs *d, Py_ssize_t i, Py_ssize_t n);
/* crc32c state s carried over descriptors [j, k) of d. */
KVB_INTERNAL uint32_t descs_crc_update(uint32_t s, const descs *d, Py_ssize_t j, Py_ssize_t k);
KVB_INTERNAL PyObject *py_crc32c(PyObject *mod, PyObject *args, PyObject *kw);

#endif
