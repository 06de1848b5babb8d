/* kvbridge._ucp's internal API: the one-sided data plane over ucp's stable C API, in plain C, its parts
 * (ucp_context.c, ucp_region.c, ucp_endpoint.c, ucp_module.c) joined by this header.  Built against the
 * UCX that setup.py finds (the libucx wheel or $UCX_HOME); the copies, file IO and checksums that need no
 * UCX are kvbridge._core (core.h), so each extension loads without the other.
 *
 *   Context(tls=None, progress_thread=False,     one ucp context + one worker, guarded by one mutex;
 *           config=None, optional=())            config: UCX options set before ucp_init (the user's
 *     .address .config .config_text              UCX_<name> wins), optional: keys this UCX may lack
 *     .map() .connect() .progress() .close()
 *   Region    (.rkey .address .length .memory_type .close())
 *   Endpoint  (.add_rkey() .get() .put() .failed .info() .transports() .close())
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
#ifndef KVB_UCP_H
#define KVB_UCP_H

#include "args.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include <ucp/api/ucp.h>

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

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* exc("what: <UCX's words for st>"); returns NULL */
KVB_INTERNAL PyObject *ucs_error(PyObject *exc, const char *what, ucs_status_t st);


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


typedef struct {
    CHILD_HEAD
    ucp_mem_h memh;
    uint64_t address, length;
    ucs_memory_type_t mtype;
    int inuse; /* transfers using memh right now (mutex) */
    PyObject *rkey;
} RegionObject;


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


KVB_INTERNAL extern PyTypeObject ContextType, RegionType, EndpointType;

/* ucp_context.c: children, the mutex's bookkeeping, the worker's sleep */
KVB_INTERNAL void child_link(ContextObject *c, ChildObject *ch);
KVB_INTERNAL void child_unlink(ChildObject *ch);
KVB_INTERNAL void busy_enter(ContextObject *c); /* mutex held */
KVB_INTERNAL void busy_leave(ContextObject *c); /* mutex held */
KVB_INTERNAL void wait_events(ContextObject *c, int ms);
KVB_INTERNAL int ctx_check_open(ContextObject *c);
/* ucp_region.c */
KVB_INTERNAL PyObject *context_map(ContextObject *c, PyObject *args, PyObject *kw);
KVB_INTERNAL int region_release(ChildObject *ch);
/* ucp_endpoint.c */
KVB_INTERNAL PyObject *context_connect(ContextObject *c, PyObject *args, PyObject *kw);
KVB_INTERNAL int endpoint_release(ChildObject *ch, int force);

#endif
