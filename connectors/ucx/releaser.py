"""A consumer's scheduler letting go of hand-offs it will not pull.

A producer holds a finished prompt's blocks (vLLM keeps them allocated, ``delay_free``) until a consumer
releases them or the lease ends (``lease_s``, 480 s by default). A consumer that pulls releases at the end
of its pull. One that does not pull must say so too, or the producer keeps the blocks — and vLLM keeps
stepping an otherwise idle producer engine while it holds them (measured: 116% of a core, its shared-memory
queues busy-poll for a second after every step). That happens when the consumer's own prefix cache already
covers the prompt (a repeated prompt, a benchmark's warm-up request), when the request ends before its
pull starts, or when it ends before it was ever scheduled.

The scheduler knows these cases, so it releases from there, on one background thread: the consumer engine
may never step again (an idle server after its last request), and a slow or dead producer must not stall
scheduling. A release that fails is logged at info level; the lease frees the blocks instead.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvbridge.connectors.ucx.options import UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import UcxSource

from kvbridge.errors import KVBridgeError
from kvbridge.metadata.client import MetadataClient

log = logging.getLogger(__name__)


class Releaser:
    """``let_go(request_id, source)`` queues an ``aborted`` release of ``source``'s hand-off at every
    producer rank it names; one thread sends them, started on first use and stopped by :meth:`close`."""

    def __init__(self, options: UcxOptions, engine_id: str, stats: UcxStats):
        self.options, self.engine_id, self.stats = options, engine_id, stats
        self._queue: queue.Queue[tuple[str, UcxSource] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def let_go(self, request_id: str, source: UcxSource, why: str) -> None:
        log.debug("%s: %s will not pull %s from %s (%s): releasing it", self.engine_id, request_id,
                  source.remote_request_id, source.engine_id, why)
        self.stats.add(unpulled_handoffs=1)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbridge-ucx-release", daemon=True)
                self._thread.start()
        self._queue.put((request_id, source))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._release(*item)

    def _release(self, request_id: str, src: UcxSource) -> None:
        addresses = src.metadata_addresses or (src.metadata_address,)
        for address in dict.fromkeys(a for a in addresses if a):  # each rank holds its own blocks
            client = MetadataClient(address, token=self.options.token, timeout=self.options.timeout_s / 2, retries=1)
            try:
                client.release(self.engine_id, src.remote_request_id, aborted=True, grant=src.grant)
            except KVBridgeError as exc:  # the producer's lease frees the blocks instead
                log.info("%s: release of unpulled %s at %s failed: %s", self.engine_id, src.remote_request_id,
                         address, exc)
            finally:
                client.close()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (each call bounded by ``timeout_s``), then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


__all__ = ["Releaser"]
