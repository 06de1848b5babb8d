/* A store's blocks read from or written to its files and checked, on the copy threads (FileIO).
 *
 *   file_start(runs, addresses, lengths, parts, *,   -> FileIO: every `parts` descriptors are one block,
 *              write=False, cut_bytes,                  read into place from its run's file (or written
 *              block_ids=None, block_stride=0)          there) and its crc32c taken (.checked())
 *
 * Why native: a block of a CPU KV is tens of pieces (one per layer); moving and checking them from Python
 * cost a Python object per piece, and google-crc32c holds the GIL for small pieces, so a second IO thread
 * waited instead of reading (bench case: fs, load and save at 8 MiB, `kvbridge bench --backends fs`).
 */
#include "core.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

typedef struct {
    JobObject base;        /* base.job.d: remote = file offsets (made from the runs), local = addresses */
    int write;             /* 1 writes the blocks to the files, 0 reads them */
    vec_arg fds;           /* each descriptor's file */
    uint64_t *placed;      /* what fds and d.remote view (file_runs) */
    uint64_t *expanded;    /* block_ids=: what d.local and d.lengths view (file_blocks) */
} FileIOObject;

#define FILE_OF(j) ((FileIOObject *)((char *)(j) - offsetof(JobObject, job)))

/* Move descriptors [lo, hi): remote = file offset, local = memory address, each of its own file (fds: a
 * descriptor's fd, or one for all).  Descriptors whose file ranges continue each other in one file go to
 * the kernel as one preadv/pwritev (up to IOV_MAX pieces).  A read stops at the end of the file.  Returns
 * 0 or an errno; *total = bytes moved. */
static int file_range(const vec_arg *fds, const descs *d, Py_ssize_t lo, Py_ssize_t hi, int write, uint64_t *total) {
    static __thread struct iovec iov[IOV_MAX];
    *total = 0;
    Py_ssize_t i = lo;
    while (i < hi) {
        uint64_t offset = vec_u64(&d->remote, i), end = offset;
        int fd = (int)vec_u64(fds, i);
        int k = 0;
        for (; i < hi && k < IOV_MAX && vec_u64(&d->remote, i) == end && (int)vec_u64(fds, i) == fd; i++, k++) {
            uint64_t n = vec_u64(&d->lengths, i);
            iov[k] = (struct iovec){(void *)(uintptr_t)vec_u64(&d->local, i), n};
            end += n;
        }
        int first = 0;
        for (;;) {
            while (first < k && iov[first].iov_len == 0) first++; /* empty pieces move nothing: a 0 is no EOF */
            if (first == k) break;
            ssize_t got = write ? pwritev(fd, iov + first, k - first, (off_t)offset)
                                : preadv(fd, iov + first, k - first, (off_t)offset);
            if (got < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            if (got == 0) return write ? EIO : 0; /* the end of the file: the caller sees the short total */
            *total += (uint64_t)got;
            offset += (uint64_t)got;
            size_t left = (size_t)got; /* drop what moved; a piece may be cut in the middle */
            while (first < k && left >= iov[first].iov_len) left -= iov[first++].iov_len;
            if (first < k) {
                iov[first].iov_base = (char *)iov[first].iov_base + left;
                iov[first].iov_len -= left;
            }
        }
    }
    return 0;
}

#define CRC_STRETCH (256u << 10) /* a read's block is summed a stretch at a time, after that stretch's read */

/* Block i of r (its r->parts descriptors) read from its file and summed a stretch at a time: each stretch's
 * sum reads bytes its read just wrote, still in the core's own cache; a block read whole, then summed,
 * is summed out of the shared cache instead.  Writes stay whole blocks (file_work): a pwritev per stretch
 * costs more in the filesystem than the sums gain.  Bench case for both: fs, load and save at 8 MiB.
 * Returns 0 or an errno; *got = bytes read, *sum the block's crc32c (whole only if *got is the block's
 * length). */
static int read_summed(kv_job *r, Py_ssize_t i, uint64_t *got, uint32_t *sum) {
    const descs *d = &r->d;
    uint32_t s = 0xFFFFFFFFu;
    *got = 0;
    for (Py_ssize_t j = i, k; j < i + r->parts; j = k) {
        uint64_t want = vec_u64(&d->lengths, j), moved = 0;
        for (k = j + 1; k < i + r->parts && want + vec_u64(&d->lengths, k) <= CRC_STRETCH; k++) want += vec_u64(&d->lengths, k);
        int err = file_range(&FILE_OF(r)->fds, d, j, k, 0, &moved);
        *got += moved;
        if (err || moved < want) return err;
        s = descs_crc_update(s, d, j, k);
    }
    *sum = ~s;
    return 0;
}

/* file_start()'s work on one thread: blocks [lo / parts, hi / parts) moved and checked one after
 * another, each block's crc taken next to its move, while its bytes are in the cache (a write's before,
 * a read's after).  A block that comes short or fails ends the piece and lowers r->whole to it; the
 * blocks after it are not moved. */
static int file_work(kv_job *r, Py_ssize_t lo, Py_ssize_t hi, uint64_t *total) {
    const descs *d = &r->d;
    FileIOObject *f = FILE_OF(r);
    *total = 0;
    for (Py_ssize_t i = lo; i < hi; i += r->parts) {
        uint64_t want = 0, got = 0;
        for (Py_ssize_t j = i; j < i + r->parts; j++) want += vec_u64(&d->lengths, j);
        uint32_t sum = f->write ? descs_crc(d, i, r->parts) : 0;
        int err = f->write ? file_range(&f->fds, d, i, i + r->parts, 1, &got) : read_summed(r, i, &got, &sum);
        *total += got;
        if (err || got < want) {
            kv_lower_whole(r, i / r->parts);
            return err;
        }
        memcpy(&r->sums[i / r->parts], &sum, 4); /* x86-64 (crc_ready): little-endian, as crc32c() writes */
    }
    return 0;
}

/* Each descriptor's file and offset, from file_start()'s runs: a run (fd, offset, blocks) holds its
 * blocks back to back from offset, as a store's object does, so a descriptor lies where the run's
 * descriptors before it end.  Made here in one pass: as numpy arrays it was a dozen calls on the
 * engine's thread, in the start of every load (bench case: fs, load at 8 MiB, start_step). */
static int file_runs(FileIOObject *f, PyObject *runs) {
    kv_job *r = &f->base.job;
    PyObject *seq = PySequence_Fast(runs, "file_start: runs must be a sequence of (fd, offset, blocks)");
    if (!seq) return -1;
    Py_ssize_t n = r->d.n, k = 0;
    f->placed = malloc(2 * (size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!f->placed) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *fds = f->placed, *offsets = f->placed + n;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        int fd;
        long long offset;
        Py_ssize_t blocks;
        PyObject *run = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(run)) {
            PyErr_Format(PyExc_TypeError, "file_start: a run is (fd, offset, blocks), not %.80s", Py_TYPE(run)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(run, "iLn;file_start: a run is (fd, offset, blocks)", &fd, &offset, &blocks)) goto fail;
        if (offset < 0 || blocks < 0 || blocks > (n - k) / r->parts) {
            PyErr_Format(PyExc_ValueError, "file_start: run %zd (offset %lld, %zd blocks) is negative or past the "
                         "%zd blocks described", i, offset, blocks, n / r->parts);
            goto fail;
        }
        for (Py_ssize_t end = k + blocks * r->parts; k < end; k++) {
            fds[k] = (uint64_t)fd;
            offsets[k] = (uint64_t)offset;
            offset += (long long)vec_u64(&r->d.lengths, k);
        }
    }
    Py_DECREF(seq);
    if (k != n) {
        PyErr_Format(PyExc_ValueError, "file_start: the runs hold %zd blocks, the descriptors %zd", k / r->parts,
                     n / r->parts);
        return -1;
    }
    f->fds = (vec_arg){.data = fds, .n = n, .itemsize = 8};
    r->d.remote = (vec_arg){.data = offsets, .n = n, .itemsize = 8};
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* file_start(block_ids=, block_stride=): every block's descriptors made from block 0's, `parts` addresses
 * and lengths: piece p of the i-th block is at block_ids[i] * block_stride + addresses[p].  Made here, a
 * load's start on the engine's thread builds no array per transfer (as numpy, BlockAddressing.by_block,
 * it was a visible share of a small load: bench case fs, load at 8 MiB, start_step). */
static int file_blocks(FileIOObject *f, PyObject *ids, unsigned long long stride, Py_ssize_t parts) {
    descs *d = &f->base.job.d;
    if (parts <= 0 || d->n != parts) {
        PyErr_Format(PyExc_ValueError, "file_start: with block_ids, addresses are one block's %zd pieces, not %zd",
                     parts, d->n);
        return -1;
    }
    PyObject *seq = PySequence_Fast(ids, "file_start: block_ids must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t blocks = PySequence_Fast_GET_SIZE(seq), n = blocks * parts;
    f->expanded = malloc(2 * (size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!f->expanded) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *local = f->expanded, *lengths = f->expanded + n;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, b), PyExc_OverflowError);
        if (id < 0) { /* numpy's integers too (__index__); a negative id names no block */
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "file_start: block id %zd is negative", id);
            Py_DECREF(seq);
            return -1;
        }
        for (Py_ssize_t p = 0; p < parts; p++) {
            local[b * parts + p] = (uint64_t)id * stride + vec_u64(&d->local, p);
            lengths[b * parts + p] = vec_u64(&d->lengths, p);
        }
    }
    Py_DECREF(seq);
    vec_release(&d->local);
    vec_release(&d->lengths);
    d->local = (vec_arg){.data = local, .n = n, .itemsize = 8};
    d->lengths = (vec_arg){.data = lengths, .n = n, .itemsize = 8};
    d->n = n;
    return 0;
}

/* file_start(runs, addresses, lengths, parts, *, write=False, cut_bytes) -> FileIO: a store's load or
 * save on the copy threads.  One call instead of a Python thread per stretch of blocks: handing those
 * out and joining them cost more than the read of a small load (bench case: fs, load at 8 MiB).  The
 * caller keeps the files open and the memory alive until checked() returned. */
PyObject *py_file_start(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"runs", "addresses", "lengths", "parts", "write", "cut_bytes", "block_ids",
                             "block_stride", NULL};
    PyObject *runs, *ao, *no, *ids = Py_None;
    Py_ssize_t parts;
    int write = 0;
    unsigned long long cut = KV_CUT_BYTES, stride = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOn|$pKOK", kwlist, &runs, &ao, &no, &parts, &write, &cut, &ids,
                                     &stride))
        return NULL;
    FileIOObject *f = (FileIOObject *)kv_new(&FileIOType, file_work);
    if (!f) return NULL;
    kv_job *j = &f->base.job;
    descs *d = &j->d;
    if (vec_parse(ao, "addresses", 8, 0, &d->local) < 0) goto fail;
    d->n = d->local.n;
    if (vec_parse(no, "lengths", 8, 1, &d->lengths) < 0) goto fail;
    if (d->lengths.n >= 0 && d->lengths.n != d->n) {
        PyErr_Format(PyExc_ValueError, "file_start: %zd lengths for %zd addresses", d->lengths.n, d->n);
        goto fail;
    }
    if (ids != Py_None && file_blocks(f, ids, stride, parts) < 0) goto fail;
    if (kv_check_blocks(j, parts, "file_start") < 0 || file_runs(f, runs) < 0) goto fail;
    f->write = write;
    j->cut_bytes = cut;
    return kv_queue(&f->base);
fail:
    Py_DECREF(f);
    return NULL;
}

static void file_dealloc(FileIOObject *f) {
    kv_release(&f->base.job); /* waits: the threads use the arrays below until the job is over */
    vec_release(&f->fds);
    free(f->placed);
    free(f->expanded);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

/* result() -> bytes moved, once over; OSError if a block failed (a short read is no error: see checked()). */
static PyObject *file_result(FileIOObject *f, PyObject *unused) {
    kv_job *j = &f->base.job;
    kv_wait(j, -1.0);
    if (j->err) {
        errno = j->err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(j->total);
}

static PyMethodDef file_methods[] = {
    {"result", (PyCFunction)file_result, METH_NOARGS, "result() -> bytes moved (waits); OSError on failure"},
    {"checked", (PyCFunction)kv_checked, METH_NOARGS, "checked() -> (sums, whole, errno), once over"},
    {NULL}};

PyTypeObject FileIOType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.FileIO",
    .tp_doc = "a store's blocks moved to or from files and checked, on the copy threads (made by file_start())",
    .tp_basicsize = sizeof(FileIOObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &JobType,
    .tp_dealloc = (destructor)file_dealloc,
    .tp_methods = file_methods,
};
