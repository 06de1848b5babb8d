/* Descriptor arrays (see args.h): parsing and release, with the checks every caller wants. */
#include "args.h"

#include <string.h>

static int format_ok(const char *fmt, int itemsize) {
    if (fmt == NULL) return 0;
    /* native or little-endian markers only: this is a same-host array of machine words */
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    if (itemsize == 8) return fmt[0] == 'Q' || fmt[0] == 'L' || fmt[0] == 'K';
    return fmt[0] == 'I' || fmt[0] == 'L';
}

int vec_parse(PyObject *o, const char *name, int itemsize, int allow_scalar, vec_arg *v) {
    memset(v, 0, sizeof(*v));
    v->itemsize = itemsize;
    v->n = -1;
    if (allow_scalar && PyLong_Check(o)) {
        unsigned long long x = PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred() || (itemsize == 4 && x > UINT32_MAX)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: scalar out of range for uint%d", name, itemsize * 8);
            return -1;
        }
        v->scalar = x;
        return 0;
    }
    if (!PyObject_CheckBuffer(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a uint%d array%s, got %.80s", name, itemsize * 8,
                     allow_scalar ? " or an int" : "", Py_TYPE(o)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(o, &v->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* numpy says BufferError; callers want one exception type for bad input */
        PyErr_Format(PyExc_ValueError, "%s: need a C-contiguous uint%d array", name, itemsize * 8);
        return -1;
    }
    v->has_view = 1;
    if (v->view.itemsize != itemsize || !format_ok(v->view.format, itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: need uint%d items, got format '%s' itemsize %zd", name, itemsize * 8,
                     v->view.format ? v->view.format : "B", v->view.itemsize);
        PyBuffer_Release(&v->view);
        v->has_view = 0;
        return -1;
    }
    v->data = v->view.buf;
    v->n = v->view.len / itemsize;
    return 0;
}

void vec_release(vec_arg *v) {
    if (v->has_view) PyBuffer_Release(&v->view);
    v->has_view = 0;
}

void descs_release(descs *d) {
    vec_release(&d->remote);
    vec_release(&d->local);
    vec_release(&d->lengths);
    vec_release(&d->index);
}

static int descs_count(descs *d, const vec_arg *v, const char *name) {
    if (v->n < 0 || v->n == d->n) return 0;
    PyErr_Format(PyExc_ValueError, "%s: %zd descriptors, but remote has %zd", name, v->n, d->n);
    return -1;
}

int descs_parse(descs *d, PyObject *remote, PyObject *local, PyObject *lengths, PyObject *index) {
    memset(d, 0, sizeof(*d));
    if (vec_parse(remote, "remote", 8, 0, &d->remote) < 0) return -1;
    d->n = d->remote.n;
    if (vec_parse(local, "local", 8, 0, &d->local) < 0 || descs_count(d, &d->local, "local") < 0) goto fail;
    if (vec_parse(lengths, "lengths", 8, 1, &d->lengths) < 0 || descs_count(d, &d->lengths, "lengths") < 0)
        goto fail;
    if (index != NULL &&
        (vec_parse(index, "rkey_index", 4, 1, &d->index) < 0 || descs_count(d, &d->index, "rkey_index") < 0))
        goto fail;
    return 0;
fail:
    descs_release(d);
    return -1;
}
