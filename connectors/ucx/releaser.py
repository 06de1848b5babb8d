"""Releases off the engine's path: a consumer's scheduler letting go of hand-offs it will not pull, and a
consumer worker's release after a read its producer's seal already confirmed (:mod:`.onesided`).

A producer holds a finished prompt's blocks (vLLM keeps them allocated, ``delay_free``) until a consumer
releases them or the lease ends (``lease_s``, 480 s by default). A consumer that pulls releases at the end
of its pull. One that does not pull must say so too, or the producer keeps the blocks — and vLLM keeps
stepping an otherwise idle producer engine while it holds them (measured: 116% of a core, its shared-memory
queues busy-poll for a second after every step). That happens when the consumer's own prefix cache already
covers the prompt (a repeated prompt, a benchmark's warm-up request), when the request ends before its
pull starts, or when it ends before it was ever scheduled.

The scheduler knows these cases, so it releases from there, on one background thread: the consumer engine
may never step again (an idle server after its last request), and a slow or dead producer must not stall
scheduling. A release that fails is logged at info level; the lease frees the blocks instead. One client
per producer address, kept until :meth:`Releaser.close`.
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


@dataclasses.dataclass(frozen=True)
class _Release:
    """Release ``source``'s hand-off at each producer rank of ``addresses``."""

    addresses: tuple[str, ...]
    source: UcxSource
    aborted: bool


@dataclasses.dataclass(frozen=True)
class _Connect:
    """Open the channel to ``address`` before the first release needs it."""

    address: str


_Item = _Release | _Connect


class Releaser:
    """``release(addresses, source, aborted=...)`` queues a release of ``source``'s hand-off at each of
    ``addresses`` (producer ranks); one thread sends them, started on first use, stopped by :meth:`close`."""

    def __init__(self, options: UcxOptions, engine_id: str):
        self.options, self.engine_id = options, engine_id
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._clients: dict[str, MetadataClient] = {}  # only the thread touches them
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, addresses: Sequence[str], source: UcxSource, *, aborted: bool) -> None:
        self._put(_Release(tuple(dict.fromkeys(a for a in addresses if a)), source, aborted))

    def prepare(self, address: str) -> None:
        """Connect to ``address`` now, off any load's path: a channel's first call (TCP and HTTP/2 set-up,
        a few ms of gRPC's Python) used to run beside the second load from a new producer."""
        if address:
            self._put(_Connect(address))

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbridge-ucx-release", daemon=True)
                self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        while (batch := self._batch()) is not None:
            for item in batch:
                if isinstance(item, _Connect):
                    self._connect(item.address)
                    continue
                for address in item.addresses:
                    self._send(address, item.source, item.aborted)
        for client in self._clients.values():
            client.close()

    def _batch(self) -> list[_Item] | None:
        """The next releases: the first queued, and whatever else comes within ``BATCH_S`` of it. The wait
        also keeps the release's Python (gRPC, protobuf) off the GIL while the engine thread takes the
        load's report (bench case ucx `transfer`, 8 MiB); a sealed read's release is queued only after
        that report anyway (:meth:`Puller.release_reported`)."""
        first = self._queue.get()
        if first is None:
            return None
        batch, deadline = [first], time.monotonic() + BATCH_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # stop after this batch
                break
            batch.append(item)
        return batch

    def _client(self, address: str) -> MetadataClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = MetadataClient(address, token=self.options.token,
                                                             timeout=self.options.timeout_s / 2, retries=1)
        return client

    def _connect(self, address: str) -> None:
        try:
            self._client(address).wait_ready()
        except KVBridgeError as exc:  # the release will try again (and say so if it fails too)
            log.info("%s: connecting to %s for releases failed: %s", self.engine_id, address, exc)
            self._clients.pop(address).close()

    def _send(self, address: str, src: UcxSource, aborted: bool) -> None:
        client = self._client(address)
        try:
            client.release(self.engine_id, src.remote_request_id, aborted=aborted, grant=src.grant)
        except KVBridgeError as exc:  # the producer's lease frees the blocks instead
            log.info("%s: release of %s at %s failed: %s", self.engine_id, src.remote_request_id, address, exc)
            self._clients.pop(address).close()  # a restarted producer: a fresh channel next time

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (each call bounded by ``timeout_s``), then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


__all__ = ["Releaser"]
