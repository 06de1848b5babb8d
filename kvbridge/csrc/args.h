/* Descriptor arrays: the argument shape every native call of kvbridge takes.
 *
 * A KV hand-off is thousands of (remote, local, length) descriptors per request.  Python describes them
 * only as arrays (numpy, C-contiguous machine words); the native side reads them with the GIL released,
 * so the per-descriptor cost is a load, not an interpreter round trip.  Compiled into both extensions
 * (kvbridge._core and kvbridge._ucp): each loads alone, so neither may need the other's symbols.
 */
#ifndef KVB_ARGS_H
#define KVB_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* symbols shared between this project's C files, never exported from the extension */
#define KVB_INTERNAL __attribute__((visibility("hidden")))

/* One descriptor argument: a C-contiguous array of unsigned integers, or (where allowed) one scalar
 * that applies to every descriptor.  The view is held for the whole call, GIL released or not. */
typedef struct {
    Py_buffer view;
    int has_view;
    const void *data; /* NULL: use scalar */
    uint64_t scalar;
    Py_ssize_t n;     /* -1 for a scalar */
    int itemsize;
} vec_arg;

/* A Python object as a vec_arg of itemsize 8 or 4; allow_scalar: an int applies to every descriptor.
 * Returns 0, or -1 with ValueError/TypeError set (nothing held). */
KVB_INTERNAL int vec_parse(PyObject *o, const char *name, int itemsize, int allow_scalar, vec_arg *v);
KVB_INTERNAL void vec_release(vec_arg *v);

static inline uint64_t vec_u64(const vec_arg *v, Py_ssize_t i) {
    return v->data ? ((const uint64_t *)v->data)[i] : v->scalar;
}

static inline uint32_t vec_u32(const vec_arg *v, Py_ssize_t i) {
    return v->data ? ((const uint32_t *)v->data)[i] : (uint32_t)v->scalar;
}

/* The common shape of every transfer call: remote and local arrays, lengths array-or-int, and for ucp
 * transfers an rkey index array-or-int.  All arrays must agree on the count. */
typedef struct {
    vec_arg remote, local, lengths, index;
    Py_ssize_t n;
} descs;

KVB_INTERNAL void descs_release(descs *d);
/* remote and local arrays, lengths array-or-int, index (NULL: none) array-or-int; all the same count. */
KVB_INTERNAL int descs_parse(descs *d, PyObject *remote, PyObject *local, PyObject *lengths, PyObject *index);

#endif
