/* Region: memory mapped with Context.map(), and its packed remote key. */
#include "ucp.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const struct {
    const char *name;
    ucs_memory_type_t type;
} MEMORY_TYPES[] = {
    {"host", UCS_MEMORY_TYPE_HOST},
    {"cuda", UCS_MEMORY_TYPE_CUDA},
    {"cuda-managed", UCS_MEMORY_TYPE_CUDA_MANAGED},
};

static int memory_type_parse(const char *name, ucs_memory_type_t *out) {
    for (size_t i = 0; i < sizeof(MEMORY_TYPES) / sizeof(MEMORY_TYPES[0]); i++)
        if (strcmp(name, MEMORY_TYPES[i].name) == 0) return *out = MEMORY_TYPES[i].type, 0;
    PyErr_Format(PyExc_ValueError, "memory_type: '%s' is not one of host, cuda, cuda-managed", name);
    return -1;
}

/* Map and pack under one mutex hold; on any failure nothing stays mapped. */
static ucs_status_t region_map(ContextObject *c, RegionObject *r, const char **what, void **buf, size_t *len) {
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        .address = (void *)(uintptr_t)r->address,
        .length = r->length,
        .memory_type = r->mtype,
    };
    ucs_status_t st = UCS_ERR_CANCELED;
    *what = "Context is closed";
    pthread_mutex_lock(&c->lock);
    if (c->state == CTX_OPEN) {
        *what = "ucp_mem_map";
        st = ucp_mem_map(c->ucp, &mp, &r->memh);
        if (st == UCS_OK) {
            *what = "ucp_rkey_pack";
            st = ucp_rkey_pack(c->ucp, r->memh, buf, len);
            if (st != UCS_OK) ucp_mem_unmap(c->ucp, r->memh), r->memh = NULL;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

PyObject *context_map(ContextObject *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"address", "length", "memory_type", NULL};
    unsigned long long addr, length;
    const char *mt = "host";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|s", kwlist, &addr, &length, &mt)) return NULL;
    ucs_memory_type_t type;
    if (memory_type_parse(mt, &type) < 0 || ctx_check_open(c) < 0) return NULL;
    if (length == 0 || addr == 0 || addr + length < addr)
        return PyErr_SetString(PyExc_ValueError, "map: need a non-empty range at a non-null address"), NULL;
    RegionObject *r = PyObject_New(RegionObject, &RegionType);
    if (!r) return NULL;
    r->ctx = NULL;
    r->memh = NULL;
    r->rkey = NULL;
    r->address = addr;
    r->length = length;
    r->mtype = type;
    r->inuse = 0;
    const char *what;
    ucs_status_t st;
    void *buf = NULL;
    size_t len = 0;
    Py_BEGIN_ALLOW_THREADS
    st = region_map(c, r, &what, &buf, &len);
    Py_END_ALLOW_THREADS
    if (st == UCS_OK) {
        /* packed once: the key never changes while the region is mapped */
        r->rkey = PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
        ucp_rkey_buffer_release(buf);
    }
    if (st != UCS_OK || !r->rkey) {
        PyObject *exc = st == UCS_ERR_CANCELED ? PyExc_ValueError : PyExc_RuntimeError;
        if (st == UCS_OK) { /* out of memory for the bytes: undo the mapping */
            pthread_mutex_lock(&c->lock);
            ucp_mem_unmap(c->ucp, r->memh);
            pthread_mutex_unlock(&c->lock);
            r->memh = NULL;
        } else if (st == UCS_ERR_CANCELED) {
            PyErr_SetString(exc, what);
        } else {
            ucs_error(exc, what, st);
        }
        Py_DECREF(r);
        return NULL;
    }
    child_link(c, (ChildObject *)r);
    return (PyObject *)r;
}

int region_release(ChildObject *ch) { /* GIL held */
    RegionObject *r = (RegionObject *)ch;
    ContextObject *c = r->ctx;
    int busy = 0;
    if (c == NULL) return 0;
    Py_BEGIN_ALLOW_THREADS /* deregistering a large (or GPU) region can take a while */
    pthread_mutex_lock(&c->lock);
    if (r->inuse) busy = 1;
    else if (r->memh && c->ucp) ucp_mem_unmap(c->ucp, r->memh);
    if (!busy) r->memh = NULL;
    pthread_mutex_unlock(&c->lock);
    Py_END_ALLOW_THREADS
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "Region.close: a transfer is using this region");
        return -1;
    }
    return 0;
}

static void region_dealloc(RegionObject *r) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    /* no transfer holds it now; one whose requests UCX never retired keeps it mapped until ucp_cleanup */
    if (region_release((ChildObject *)r) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    child_unlink((ChildObject *)r);
    Py_XDECREF(r->rkey);
    PyObject_Free(r);
}

static PyObject *region_close(RegionObject *r, PyObject *unused) {
    if (region_release((ChildObject *)r) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *region_rkey(RegionObject *r, void *closure) {
    if (r->memh == NULL) return PyErr_SetString(PyExc_ValueError, "Region is closed"), NULL;
    return Py_NewRef(r->rkey);
}

static PyObject *region_address(RegionObject *r, void *c) { return PyLong_FromUnsignedLongLong(r->address); }
static PyObject *region_length(RegionObject *r, void *c) { return PyLong_FromUnsignedLongLong(r->length); }
static PyObject *region_closed(RegionObject *r, void *c) { return PyBool_FromLong(r->memh == NULL); }

static PyObject *region_memory_type(RegionObject *r, void *c) {
    for (size_t i = 0; i < sizeof(MEMORY_TYPES) / sizeof(MEMORY_TYPES[0]); i++)
        if (MEMORY_TYPES[i].type == r->mtype) return PyUnicode_FromString(MEMORY_TYPES[i].name);
    Py_RETURN_NONE;
}


static PyMethodDef region_methods[] = {
    {"close", (PyCFunction)region_close, METH_NOARGS, "ucp_mem_unmap (idempotent)"}, {NULL}};

static PyGetSetDef region_getset[] = {
    {"rkey", (getter)region_rkey, NULL, "packed remote key (bytes)", NULL},
    {"address", (getter)region_address, NULL, "start address", NULL},
    {"length", (getter)region_length, NULL, "length in bytes", NULL},
    {"memory_type", (getter)region_memory_type, NULL, "host | cuda | cuda-managed", NULL},
    {"closed", (getter)region_closed, NULL, "True once unmapped", NULL},
    {NULL}};


PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._ucp.Region",
    .tp_doc = "memory mapped with Context.map()",
    .tp_basicsize = sizeof(RegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_getset = region_getset,
};

