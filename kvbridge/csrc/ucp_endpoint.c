/* Endpoint: a connection to a peer worker, its remote keys, and the one-sided transfers (get, put). */
#include "ucp.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    EndpointObject *e = arg; /* no Python here: runs in whichever thread progressed the worker */
    if (e->peer == UCS_OK) e->peer = status;
}

PyObject *context_connect(ContextObject *c, PyObject *args, PyObject *kw) {
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
int endpoint_release(ChildObject *ch, int force) {
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


/* transports() -> [(transport, device), ...]: the lanes UCX chose for this endpoint (ucp_ep_query).  How
 * kvbridge tells, before a transfer, whether device memory can move without UCX's software emulation:
 * between two processes of one host that takes a cuda_ipc lane (connectors/ucx/cuda.py). */
static PyObject *endpoint_transports(EndpointObject *e, PyObject *unused) {
    if (ep_check_usable(e) < 0) return NULL;
    enum { MAX_LANES = 32 }; /* UCP_MAX_LANES is 64 in UCX 1.21's sources, but an endpoint uses a few */
    ucp_transport_entry_t entries[MAX_LANES];
    ucp_ep_attr_t attr = {.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS};
    attr.transports.entries = entries;
    attr.transports.num_entries = MAX_LANES;
    attr.transports.entry_size = sizeof(entries[0]);
    ContextObject *c = e->ctx;
    ucs_status_t st = UCS_ERR_CANCELED;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->lock);
    if (e->ep) st = ucp_ep_query(e->ep, &attr);
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (st == UCS_ERR_CANCELED) return PyErr_SetString(PyExc_ValueError, "Endpoint is closed"), NULL;
    if (st != UCS_OK) return ucs_error(PyExc_RuntimeError, "ucp_ep_query", st);
    PyObject *out = PyList_New(0);
    for (unsigned i = 0; out && i < attr.transports.num_entries && i < MAX_LANES; i++) {
        PyObject *t = Py_BuildValue("(ss)", entries[i].transport_name ? entries[i].transport_name : "",
                                    entries[i].device_name ? entries[i].device_name : "");
        if (!t || PyList_Append(out, t) < 0) Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyMethodDef endpoint_methods[] = {
    {"add_rkey", (PyCFunction)endpoint_add_rkey, METH_O, "add_rkey(packed) -> index in this endpoint's table"},
    {"get", (PyCFunction)(void (*)(void))endpoint_get, METH_VARARGS | METH_KEYWORDS,
     "get(remote, local, lengths, rkey_index, timeout_s, local_region=None) -> bytes read"},
    {"put", (PyCFunction)(void (*)(void))endpoint_put, METH_VARARGS | METH_KEYWORDS,
     "put(remote, local, lengths, rkey_index, timeout_s, local_region=None) -> bytes written"},
    {"info", (PyCFunction)endpoint_info, METH_NOARGS, "ucp_ep_print_info: the lanes and transports UCX chose"},
    {"transports", (PyCFunction)endpoint_transports, METH_NOARGS,
     "transports() -> [(transport, device)]: this endpoint's lanes (ucp_ep_query)"},
    {"close", (PyCFunction)(void (*)(void))endpoint_close, METH_VARARGS | METH_KEYWORDS,
     "close(force=False): bounded wait"},
    {NULL}};

static PyGetSetDef endpoint_getset[] = {
    {"failed", (getter)endpoint_failed, NULL, "why the endpoint is unusable, or None", NULL},
    {"closed", (getter)endpoint_closed, NULL, "True once closed or failed", NULL},
    {NULL}};


PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.Endpoint",
    .tp_doc = "an endpoint made with Context.connect()",
    .tp_basicsize = sizeof(EndpointObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)endpoint_dealloc,
    .tp_methods = endpoint_methods,
    .tp_getset = endpoint_getset,
};

