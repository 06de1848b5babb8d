/* Context: one ucp context and its worker, the options it is made with, its children and its close. */
#include "ucp.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

PyObject *ucs_error(PyObject *exc, const char *what, ucs_status_t st) {
    PyErr_Format(exc, "%s: %s", what, ucs_status_string(st));
    return NULL;
}


void child_link(ContextObject *c, ChildObject *ch) {
    Py_INCREF(c);
    ch->ctx = c;
    ch->prev = NULL;
    ch->next = c->children;
    if (c->children) c->children->prev = ch;
    c->children = ch;
}

void child_unlink(ChildObject *ch) {
    ContextObject *c = ch->ctx;
    if (c == NULL) return;
    if (ch->prev) ch->prev->next = ch->next;
    else c->children = ch->next;
    if (ch->next) ch->next->prev = ch->prev;
    ch->ctx = NULL;
    Py_DECREF(c);
}

void busy_enter(ContextObject *c) { c->busy++; } /* mutex held */

void busy_leave(ContextObject *c) { /* mutex held */
    if (--c->busy == 0) pthread_cond_broadcast(&c->idle);
}

/* Sleep on the worker's event fd (mutex NOT held) for at most ms; a no-op wait if arming fails. */
void wait_events(ContextObject *c, int ms) {
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

int ctx_check_open(ContextObject *c) { /* GIL held; state only changes from OPEN under GIL+mutex */
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


PyTypeObject ContextType = {
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

