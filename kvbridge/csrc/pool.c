/* The copy threads: jobs (core.h) cut into pieces and run with the GIL released, and the handle type
 * (kvbridge._core.Job) every job returns.
 *
 * Why threads of our own: handing a transfer to a Python thread costs two GIL hand-offs per load (to
 * start it, and to hear it ended), and the engine's step pays both; these threads never touch Python.
 * They are made once and sleep on a queue, because a thread made per transfer starts late on a loaded
 * host.  The engine sleeps in wait() with the GIL released.  Bench case for the start's cost: fs, load
 * at 8 MiB (`kvbridge bench --backends fs`, start_step).
 *
 * A job of cut_bytes or more is cut into pieces of about equal bytes, one per thread, which copy at
 * once: one thread's copy is bound by its own memory latency, not the machine's bandwidth. */
#include "core.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>

/* The pieces waiting for a thread, first in first out, and the threads' wake-ups.  One lock guards the
 * queue and every job's done/pending; `work` wakes threads, `over` wakes waiters (a job over). */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t work, over;
    kv_piece *head, *tail;
    int threads, busy;  /* threads made; pieces they are running now */
    unsigned long gen;  /* forks so far */
    int own;            /* jobs running on threads of their own (kv_begin_own), for drain() */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0, 0};

/* Whether j is over (the lock held).  A job queued before this process was forked ran, if at all, in
 * the parent: here it ends as cancelled, so that nothing (its handle's dealloc included) waits for it. */
static int job_over(kv_job *j) {
    if (!j->done && j->gen != pool.gen) {
        j->err = ECANCELED;
        j->whole = 0; /* a checked job: no block is known to have moved */
        j->done = 1;
    }
    return j->done;
}

static void run_piece(kv_piece *p) {
    kv_job *j = p->job;
    uint64_t total = 0;
    int err = j->work(j, p->lo, p->hi, &total);
    pthread_mutex_lock(&pool.lock);
    j->total += total;
    if (err && !j->err) j->err = err;
    int last = --j->pending == 0;
    pthread_mutex_unlock(&pool.lock);
    /* the last piece is over, so no other thread writes the job any more */
    if (last && !j->err && j->last) j->last(j);
    pthread_mutex_lock(&pool.lock);
    if (last) {
        j->done = 1;
        pthread_cond_broadcast(&pool.over);
    }
    pool.busy--;
    if (!pool.busy && !pool.head) pthread_cond_broadcast(&pool.over); /* drain() */
    pthread_mutex_unlock(&pool.lock);
}

/* The threads are SCHED_BATCH (Linux): a batch thread that wakes does not preempt the thread running on
 * its core.  A job's start wakes both threads; on a busy core the woken one would take the core from
 * the engine's thread at once, and the engine would wait out the copy before returning from the start.
 * An idle core still runs it at once, and a piece no thread has taken yet is run by whoever waits for
 * its job (kv_wait). */
static void thread_policy(void) {
#ifdef SCHED_BATCH
    struct sched_param none = {0};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &none); /* a refusal keeps the default policy */
#endif
#ifdef __linux__
    (void)pthread_setname_np(pthread_self(), "kvbridge-copy"); /* for top -H, perf, /proc/<pid>/task: and tests */
#endif
}

static void *pool_thread(void *unused) {
    thread_policy();
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (!pool.head) pthread_cond_wait(&pool.work, &pool.lock);
        kv_piece *p = pool.head;
        pool.head = p->next;
        if (!pool.head) pool.tail = NULL;
        pool.busy++;
        pthread_mutex_unlock(&pool.lock);
        run_piece(p);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own on its first job, and the jobs the
 * parent had queued or running end as cancelled (job_over). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.over, NULL);
    pool.head = pool.tail = NULL;
    pool.threads = pool.busy = pool.own = 0;
    pool.gen++;
}

int kv_pool_init(void) { return pthread_atfork(NULL, NULL, pool_after_fork) == 0 ? 0 : -1; }

/* Cut j's descriptors into pieces of about equal bytes (whole descriptors each, whole blocks for a
 * checked job; one piece below j->cut_bytes, else at most one per thread that exists, each at least
 * KV_PIECE_BYTES unless cut_bytes asks for less).  Returns how many. */
static int cut(kv_job *j, int threads) {
    const descs *d = &j->d;
    uint64_t bytes = 0;
    for (Py_ssize_t i = 0; i < d->n; i++) bytes += vec_u64(&d->lengths, i);
    uint64_t piece = j->cut_bytes / 2 < KV_PIECE_BYTES ? j->cut_bytes / 2 : KV_PIECE_BYTES;
    uint64_t most = bytes < j->cut_bytes ? 1 : piece ? bytes / piece : (uint64_t)threads;
    int n = most < 1 ? 1 : most < (uint64_t)threads ? (int)most : threads;
    Py_ssize_t i = 0;
    uint64_t sum = 0;
    for (int k = 0; k < n; k++) {
        j->pieces[k] = (kv_piece){j, i, d->n, NULL};
        if (k == n - 1) break;
        uint64_t goal = bytes / (uint64_t)n * (uint64_t)(k + 1);
        while (i < d->n && (sum < goal || (j->parts && i % j->parts))) sum += vec_u64(&d->lengths, i++);
        j->pieces[k].hi = i;
    }
    return n;
}

/* Queue j's pieces (the lock held), making the threads on first use.  Returns 0 or an errno. */
static int enqueue(kv_job *j) {
    while (pool.threads < KV_THREADS) {
        pthread_t t;
        int err = pthread_create(&t, NULL, pool_thread, NULL);
        if (err) {
            if (pool.threads == 0) return err;
            break; /* fewer threads: jobs wait their turn */
        }
        pthread_detach(t);
        pool.threads++;
    }
    j->gen = pool.gen;
    j->pending = cut(j, pool.threads);
    for (int k = 0; k < j->pending; k++) {
        kv_piece *p = &j->pieces[k];
        if (pool.tail) pool.tail->next = p;
        else pool.head = p;
        pool.tail = p;
    }
    pthread_cond_broadcast(&pool.work);
    return 0;
}

/* A piece of j still queued, taken off the queue (the lock held), or NULL. */
static kv_piece *take(kv_job *j) {
    kv_piece *prev = NULL;
    for (kv_piece *p = pool.head; p; prev = p, p = p->next) {
        if (p->job != j) continue;
        if (prev) prev->next = p->next;
        else pool.head = p->next;
        if (pool.tail == p) pool.tail = prev;
        pool.busy++;
        return p;
    }
    return NULL;
}

static struct timespec deadline_after(double timeout_s) {
    struct timespec until; /* the conditions' clock is the default one, CLOCK_REALTIME */
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout_s > 0) {
        until.tv_sec += (time_t)timeout_s;
        until.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    }
    return until;
}

/* A waiter first runs the pieces of j no thread has taken yet itself: it is on a core already, and a
 * sleeping thread may not be (bench case: fs, load at 8 MiB, a loaded host).  So a wait may pass
 * timeout_s by one piece's copy. */
int kv_wait(kv_job *j, double timeout_s) {
    struct timespec until = deadline_after(timeout_s);
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool.lock);
    while (!job_over(j)) {
        kv_piece *p = timeout_s != 0 && j->gen == pool.gen ? take(j) : NULL;
        if (p) {
            pthread_mutex_unlock(&pool.lock);
            run_piece(p);
            pthread_mutex_lock(&pool.lock);
            continue;
        }
        if (timeout_s < 0) pthread_cond_wait(&pool.over, &pool.lock);
        else if (pthread_cond_timedwait(&pool.over, &pool.lock, &until) == ETIMEDOUT) break;
    }
    done = j->done;
    pthread_mutex_unlock(&pool.lock);
    Py_END_ALLOW_THREADS
    return done;
}

JobObject *kv_new(PyTypeObject *type, kv_work_fn work) {
    JobObject *h = (JobObject *)type->tp_alloc(type, 0); /* zeroed */
    if (!h) return NULL;
    h->job.work = work;
    h->job.cut_bytes = KV_CUT_BYTES;
    h->job.done = 1;
    return h;
}

PyObject *kv_queue(JobObject *h) {
    pthread_mutex_lock(&pool.lock);
    h->job.done = 0;
    int err = enqueue(&h->job);
    if (err) h->job.done = 1;
    pthread_mutex_unlock(&pool.lock);
    if (err) {
        Py_DECREF(h);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)h;
}

/* A job that runs on threads of its own (the tcp lane's streams, tcp_read.c) rather than the queue: it
 * is marked running here so that wait(), done(), a fork and the handle's dealloc treat it like any job. */
void kv_begin_own(kv_job *j) {
    pthread_mutex_lock(&pool.lock);
    j->gen = pool.gen;
    j->done = 0;
    pool.own++;
    pthread_mutex_unlock(&pool.lock);
}

void kv_end_own(kv_job *j, int err, uint64_t total) {
    pthread_mutex_lock(&pool.lock);
    j->total = total;
    if (err && !j->err) j->err = err;
    j->done = 1;
    if (j->gen == pool.gen) pool.own--; /* a job of the parent's, ended in a forked child, was never counted */
    pthread_cond_broadcast(&pool.over);
    pthread_mutex_unlock(&pool.lock);
}

int kv_check_blocks(kv_job *j, Py_ssize_t parts, const char *fn) {
    if (!crc_ready) {
        PyErr_Format(PyExc_RuntimeError, "%s: this CPU has no SSE4.2 (use google-crc32c)", fn);
        return -1;
    }
    if (parts <= 0 || j->d.n % parts) {
        PyErr_Format(PyExc_ValueError, "%s: %zd pieces are not runs of %zd", fn, j->d.n, parts);
        return -1;
    }
    j->sums = calloc((size_t)(j->d.n / parts) + 1, 4);
    if (!j->sums) {
        PyErr_NoMemory();
        return -1;
    }
    j->parts = parts;
    j->whole = j->d.n / parts;
    return 0;
}

void kv_lower_whole(kv_job *j, Py_ssize_t block) {
    pthread_mutex_lock(&pool.lock);
    if (block < j->whole) j->whole = block;
    pthread_mutex_unlock(&pool.lock);
}

void kv_release(kv_job *j) {
    kv_wait(j, -1.0); /* a queued or running job still uses its arrays: it must be over first */
    descs_release(&j->d);
    free(j->sums);
    j->sums = NULL;
}

/* drain(timeout_s): the caller of a start keeps the destination alive until its job is over; at
 * interpreter exit that is not given (objects go in any order), so kvbridge registers this with atexit. */
PyObject *kv_drain(PyObject *mod, PyObject *arg) {
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    struct timespec until = deadline_after(t);
    int idle;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool.lock);
    while ((pool.head || pool.busy || pool.own) &&
           pthread_cond_timedwait(&pool.over, &pool.lock, &until) != ETIMEDOUT) {}
    idle = !pool.head && !pool.busy && !pool.own;
    pthread_mutex_unlock(&pool.lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

/* wait(timeout_s=None) -> True once the job is over; False if timeout_s passed first.  The caller runs
 * the job's pieces no thread has started yet itself (kv_wait), except with timeout_s 0: a look. */
static PyObject *job_wait(JobObject *h, PyObject *args) {
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout)) return NULL;
    double t = -1.0;
    if (timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (t < 0) t = 0;
    }
    return PyBool_FromLong(kv_wait(&h->job, t));
}

static PyObject *job_done(JobObject *h, PyObject *unused) {
    pthread_mutex_lock(&pool.lock); /* held only for queue updates, never while copying */
    int done = job_over(&h->job);
    pthread_mutex_unlock(&pool.lock);
    return PyBool_FromLong(done);
}

/* (sums, whole, errno) once over: `sums` holds the crc32c of each block as little-endian uint32s, valid for
 * the first `whole` blocks (moved whole, before any that was short or failed); errno: why a block failed
 * (0: a read came short, or none failed). */
PyObject *kv_checked(JobObject *h, PyObject *unused) {
    kv_job *j = &h->job;
    if (!j->parts) return PyErr_Format(PyExc_TypeError, "checked(): not a checked transfer (made without parts=)");
    kv_wait(j, -1.0);
    return Py_BuildValue("(y#ni)", (const char *)j->sums, (Py_ssize_t)(4 * (j->d.n / j->parts)), j->whole, j->err);
}

static void job_dealloc(JobObject *h) {
    kv_release(&h->job);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef job_methods[] = {
    {"wait", (PyCFunction)job_wait, METH_VARARGS, "wait(timeout_s=None) -> bool: over (GIL released)"},
    {"done", (PyCFunction)job_done, METH_NOARGS, "done() -> bool, without waiting"},
    {NULL}};

PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbridge._core.Job",
    .tp_doc = "a transfer running on kvbridge's copy threads (the base of Copy, CmaRead, FileIO)",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
};
