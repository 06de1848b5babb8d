/* What a context shares with its children (regions, endpoints): error words, the children list, the
 * busy count that Context.close waits on, the event wait, the open check.  Kept apart from ucp_context.c
 * so that regions and endpoints depend on this state and not on the context's own code, which in turn
 * creates and releases them (ucp_region.c, ucp_endpoint.c): no file calls back into one that calls it. */
#include "ucp.h"

#include <poll.h>
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

int ctx_check_open(ContextObject *c) { /* GIL held; state only changes from OPEN under GIL+mutex */
    if (c->state == CTX_OPEN) return 0;
    PyErr_SetString(PyExc_ValueError, "Context is closed");
    return -1;
}

