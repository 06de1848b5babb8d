"""Releases off the engine's and the load's path: a consumer's scheduler letting go of hand-offs it will
not pull, a consumer worker's release after a read its producer's seal already confirmed (:mod:`.onesided`),
and the aborted release after a failed load.

A producer holds a finished prompt's blocks (vLLM keeps them allocated, ``delay_free``) until a consumer
releases them or the lease ends (``lease_s``, 480 s by default). A consumer that pulls releases at the end
of its pull. One that does not pull must say so too, or the producer keeps the blocks — and vLLM keeps
stepping an otherwise idle producer engine while it holds them (measured: 116% of a core, its shared-memory
queues busy-poll for a second after every step). That happens when the consumer's own prefix cache already
covers the prompt (a repeated prompt, a benchmark's warm-up request), when the request ends before its
pull starts, or when it ends before it was ever scheduled.

**One lane per producer.** Each producer address has its own queue, thread and metadata client: a dead or
cut-off producer's releases wait on that producer alone (each call up to ``timeout_s``), never on the
way to a healthy one. A lane's thread ends once its queue has been empty for ``IDLE_S``; the next
release starts it again (the client stays).

**Retries.** A release that fails (the link is cut, the producer does not answer) is tried again, with a
backoff doubling from ``timeout_s`` up to ``RETRY_MAX_S``, until the hand-off's lease is over: a link that
comes back frees the producer's blocks at the next try instead of at the lease's end, and after the lease
the producer has freed them itself (its holds expire, :meth:`~.server.Server.take_finished`), so nothing
is retried forever and no hold outlives its lease. A lane whose release failed holds back the releases
queued behind it until the next try, so a dead producer costs one call's deadline per try, not one per
queued release. :meth:`Releaser.close` sends what is queued (bounded) and drops the retries.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

from kvbridge.connectors.ucx.options import UcxOptions
from kvbridge.connectors.ucx.params import UcxSource

from kvbridge.errors import KVBridgeError
from kvbridge.metadata.client import MetadataClient

log = logging.getLogger(__name__)

BATCH_S = 0.002  # how long a release waits for others to go with it (and for its load's report to go first)
IDLE_S = 30.0  # a lane's thread ends after this long with nothing to send
RETRY_MAX_S = 30.0  # the longest wait between two tries of a failed release


@dataclasses.dataclass(frozen=True)
class _Release:
    """Release ``source``'s hand-off at one producer rank."""

    source: UcxSource
    aborted: bool


@dataclasses.dataclass(frozen=True)
class _Connect:
    """Open the channel before the first release needs it."""


_Item = _Release | _Connect
_STOP = None


class _Lane:
    """One producer address: its queue, its thread (while there is work) and its client."""

    def __init__(self, releaser: Releaser, address: str):
        self.releaser, self.address = releaser, address
        self.queue: queue.Queue[_Item | None] = queue.Queue()
        self.thread: threading.Thread | None = None  # guarded by the releaser's lock
        self.client: MetadataClient | None = None  # only the thread touches it
        self.retry: list[_Release] = []  # failed releases, tried again at retry_at
        self.retry_at, self.backoff = 0.0, 0.0

    def run(self) -> None:
        while (batch := self._batch()) is not None:
            self._work(batch)

    def close_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def _batch(self) -> list[_Item] | None:
        """The next items: the first queued, and whatever else comes within ``BATCH_S`` of it; the retries
        once their time has come. ``None``: stop (closed, or idle for ``IDLE_S`` with nothing to retry).
        The short wait also keeps the release's Python (gRPC, protobuf) off the GIL while the engine thread
        takes the load's report (bench case ucx `transfer`, 8 MiB)."""
        wait = max(0.0, self.retry_at - time.monotonic()) if self.retry else IDLE_S
        try:
            first = self.queue.get(timeout=wait)
        except queue.Empty:
            if self.retry:
                return []  # the retries' time has come
            with self.releaser._lock:  # idle: end, unless a release came in just now
                if self.queue.empty():
                    self.thread = None
                    return None
            return []
        if first is _STOP:
            self.close_client()
            return None
        batch, deadline = [first], time.monotonic() + BATCH_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if item is _STOP:
                self.queue.put(_STOP)  # stop after this batch
                break
            batch.append(item)
        return batch

    def _work(self, batch: list[_Item]) -> None:
        if any(isinstance(item, _Connect) for item in batch) and not self.retry:
            self._connect()
        fresh = [item for item in batch if isinstance(item, _Release)]
        if self.retry and time.monotonic() < self.retry_at:  # still waiting to retry: keep the order
            self.retry.extend(fresh)
            return
        todo, self.retry = [*self.retry, *fresh], []
        now = time.time()
        for i, item in enumerate(todo):
            if 0 < item.source.expires_at < now:
                continue  # the lease is over: the producer freed the blocks itself
            if not self._send(item):
                self.retry = [r for r in todo[i:] if not 0 < r.source.expires_at < now]
                self.backoff = min(RETRY_MAX_S, 2 * self.backoff) if self.backoff else self.releaser.options.timeout_s
                self.retry_at = time.monotonic() + self.backoff
                return
        self.backoff = 0.0

    def _client(self) -> MetadataClient:
        if self.client is None:
            opts = self.releaser.options
            self.client = MetadataClient(self.address, token=opts.token, timeout=opts.timeout_s / 2, retries=1)
        return self.client

    def _drop_client(self) -> None:  # a restarted producer, a broken channel: a fresh one next time
        self.close_client()

    def _connect(self) -> None:
        try:
            self._client().wait_ready()
        except KVBridgeError as exc:  # the release will try again (and say so if it fails too)
            log.info("%s: connecting to %s for releases failed: %s", self.releaser.engine_id, self.address, exc)
            self._drop_client()

    def _send(self, item: _Release) -> bool:
        src = item.source
        try:
            self._client().release(self.releaser.engine_id, src.remote_request_id, aborted=item.aborted, grant=src.grant)
        except KVBridgeError as exc:
            log.info("%s: release of %s at %s failed (tried again until its lease ends): %s",
                     self.releaser.engine_id, src.remote_request_id, self.address, exc)
            self._drop_client()
            return False
        return True


class Releaser:
    """``release(addresses, source, aborted=...)`` queues a release of ``source``'s hand-off at each of
    ``addresses`` (producer ranks), each on its producer's own lane (see the module docstring); nothing
    here waits on the network. :meth:`close` stops every lane."""

    def __init__(self, options: UcxOptions, engine_id: str):
        self.options, self.engine_id = options, engine_id
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def release(self, addresses: Sequence[str], source: UcxSource, *, aborted: bool) -> None:
        if not source.remote_request_id:
            return
        for address in dict.fromkeys(a for a in addresses if a):
            self._put(address, _Release(source, aborted))

    def prepare(self, address: str) -> None:
        """Connect to ``address`` now, off any load's path: a channel's first call (TCP and HTTP/2 set-up,
        a few ms of gRPC's Python) used to run beside the second load from a new producer."""
        if address:
            self._put(address, _Connect())

    def _put(self, address: str, item: _Item) -> None:
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get(address)
            if lane is None:
                lane = self._lanes[address] = _Lane(self, address)
            lane.queue.put(item)
            if lane.thread is None:
                lane.thread = threading.Thread(target=lane.run, name=f"kvbridge-ucx-release-{address}", daemon=True)
                lane.thread.start()

    def pending(self) -> int:
        """Releases queued or waiting for a retry, over every lane (an approximate count, for tests and stats)."""
        with self._lock:
            lanes = list(self._lanes.values())
        return sum(lane.queue.qsize() + len(lane.retry) for lane in lanes)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (each call bounded by ``timeout_s``; all of it by ``timeout``), drop the
        retries (the producers' leases free those blocks), then stop the threads."""
        with self._lock:
            self._closed = True  # no lane starts a thread from now on
            running = [lane for lane in self._lanes.values() if lane.thread is not None]
            idle = [lane for lane in self._lanes.values() if lane.thread is None]
            for lane in running:
                lane.queue.put(_STOP)
        for lane in idle:  # no thread touches their clients any more
            lane.close_client()
        deadline = time.monotonic() + timeout
        for lane in running:
            thread = lane.thread
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))


__all__ = ["IDLE_S", "RETRY_MAX_S", "Releaser"]
