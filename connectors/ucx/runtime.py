"""The process-wide UCX runtime behind the ``ucx`` backend: one event-loop thread, one UCX worker.

Every engine of a process (producer and consumer sides alike, and the conformance suite's two
engines) shares one :class:`Runtime`: UCX tags are matched per *worker*, a UCX context is costly
(~1 s) and ucxx keeps one global context per process anyway. The runtime owns a daemon thread
running an asyncio loop, on which ucxx is imported-and-initialised (its context binds progress to
the loop it is created on); callers on any thread use the synchronous wrappers, each with a
deadline: :meth:`Runtime.call` runs a coroutine to completion, :meth:`Runtime.submit` starts one and
returns a :class:`concurrent.futures.Future` the caller waits on (and cancels on timeout, which
cancels the UCX request too).

**Binding.** ``ucxx`` (the maintained successor of ucx-py, RAPIDS) first, ucx-py's ``ucp`` as a
fallback; both expose the same asyncio calls used here (worker address, endpoint from worker
address, tag send/recv with ``force_tag``). Neither exposes one-sided RMA from Python: the two-sided
path (tag sends) runs here, the one-sided lanes in the native ``kvbridge._ucp`` (``onesided.py``).

**Endpoints** are made from worker addresses exchanged over the metadata plane, with UCX error
handling *off*: only then does UCX use shared memory between processes on one host (with error
handling on it falls back to TCP, ~3x slower than a plain socket on loopback). The price: a dead
peer is not reported, only noticed by a deadline — so every await here has one.

**Transports (safety).** With error handling off, a peer killed during a ``cma`` rendezvous
(``process_vm_readv``) makes UCX *abort the surviving process*; over posix/sysv shared memory or TCP
the survivor only waits for its deadline. So unless the user chose (``UCX_TLS`` in the environment,
or the ``ucx_tls`` option), the runtime sets ``UCX_TLS=^cma`` before UCX starts. Tags with
``force_tag=True`` are raw and worker-global: :func:`reply_tag` / :func:`control_tag` pack who and
what into the 64 bits so that concurrent transfers never match each other's messages.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

import torch

from kvbridge.errors import MissingDependency, PeerUnreachable, TransferTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")

# UCX reads this one when its library loads: it must be set before the import. ucxx itself sets
# UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows, and UCX would warn about it on every start.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx's default completes requests by a coroutine that polls with sleep(0): an idle producer or consumer
# burns a whole core, on the engine's own cores. Python futures are completed by
# ucxx's notifier thread instead, which sleeps on a condition (tests/test_ucx.py checks an idle pair sleeps). Read at import.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")

_HINT = "the ucx backend needs ucxx (or ucx-py); pip install 'kvbridge[ucx]'"
try:
    import ucxx as _ucx

    BINDING = "ucxx"
except ImportError:  # pragma: no cover - exercised only where ucx-py is installed instead
    try:
        import ucp as _ucx  # type: ignore[no-redef]

        BINDING = "ucp"
    except ImportError as exc:
        raise MissingDependency(f"{_HINT} ({exc})") from exc

ucx: ModuleType = _ucx
# ucxx's progress thread ("thread" mode) waits for the worker's events in epoll with a 1 ms timeout: a process
# that holds a UCX worker, idle or busy on another lane (tcp, cma), woke ~1000 times a second, on the very
# cores a load's copies run on. The wait wakes for every event UCX signals, and ucxx signals it for every
# request queued from another thread, so the timeout only bounds how long an event UCX did not signal
# waits: it never paces a transfer (tests/test_ucx.py checks an idle runtime sleeps).
PROGRESS_WAKE_MS = 100
DEFAULT_TLS = "^cma"  # every transport but cma: see the module docstring

# ---- tags -------------------------------------------------------------------------------------------
# 64 bits: 4 bits of kind | 60 bits of kind-specific payload.
_KIND_REPLY, _KIND_CONTROL = 0x1, 0x2
CHUNK_BITS = 20  # chunk index within one pull (index 0: the status message)
MAX_CHUNKS = (1 << CHUNK_BITS) - 1
_SERIAL_MASK = (1 << (60 - CHUNK_BITS)) - 1


def reply_tag(serial: int, index: int) -> int:
    """Tag of message ``index`` (0: status, 1..: chunks) answering pull ``serial`` of this process."""
    return (_KIND_REPLY << 60) | ((serial & _SERIAL_MASK) << CHUNK_BITS) | index


def control_tag(engine_id: str, rank: int) -> int:
    """A fresh tag on which the producer worker ``(engine_id, rank)`` takes pull requests; it travels to
    consumers in the handshake. Fresh per server instance, so a receive left posted by an earlier
    instance in this process (worker-level receives cannot be cancelled) never takes a new pull."""
    digest = hashlib.sha256(f"{engine_id}\0{rank}\0".encode() + os.urandom(16)).digest()
    return (_KIND_CONTROL << 60) | (int.from_bytes(digest[:8], "little") & ((1 << 60) - 1))


def as_buffer(t: torch.Tensor) -> Any:
    """What UCX sends from / receives into: a CUDA tensor itself (``__cuda_array_interface__``), a CPU
    tensor's zero-copy numpy view (ucxx refuses CPU tensors)."""
    return t if t.is_cuda else t.numpy()


def _wake_less(worker: Any) -> None:
    """Restart ucxx's progress thread so that it sleeps until UCX has work (see :data:`PROGRESS_WAKE_MS`)."""
    if not hasattr(worker, "stop_progress_thread"):  # another ucxx: its progress thread as it starts it
        log.info("ucxx progress thread left as ucxx starts it: no stop_progress_thread")
        return
    worker.stop_progress_thread()
    try:
        worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_WAKE_MS)
    except TypeError as exc:  # a ucxx without the timeout argument: never a worker left without progress
        log.info("ucxx progress thread restarted with ucxx's own timeout: %s", exc)
        worker.start_progress_thread(polling_mode=False)


class Runtime:
    """The UCX worker of this process and the loop thread that drives it; get it with :func:`runtime`."""

    def __init__(self, progress_mode: str, tls: str):
        self.progress_mode = progress_mode
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        # gathers and scatters of a producer's chunks: off the loop, so progress never waits for a copy
        self.copies = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvbridge-ucx-copy")
        self._thread = threading.Thread(target=self._run, name="kvbridge-ucx-loop", daemon=True)
        self._serials = itertools.count(1)
        self._serial_lock = threading.Lock()
        self._self_ep: Any = None
        self._closing: set[asyncio.Task[None]] = set()
        self._thread.start()
        self.worker_address: bytes = self.call(self._init(), 30.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> bytes:
        if BINDING == "ucxx":
            ucx.init(progress_mode=self.progress_mode)
            if self.progress_mode == "thread":
                _wake_less(ucx.core._get_ctx().worker)
        else:  # pragma: no cover - ucx-py
            ucx.init(blocking_progress_mode=self.progress_mode == "blocking")
        return bytes(ucx.get_worker_address())

    # ---- calls from other threads -----------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; the caller waits on the future (with a deadline) or cancels it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and return its result; :class:`TransferTimeout` past ``timeout``."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Runtime.call from the loop thread would deadlock; await instead")
        fut = self.submit(asyncio.wait_for(coro, timeout))
        try:
            return fut.result(timeout + 1.0)
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
            fut.cancel()
            raise TransferTimeout(f"UCX operation missed its {timeout:g}s deadline") from None

    def next_serial(self) -> int:
        with self._serial_lock:
            return next(self._serials)

    # ---- coroutines (run on the loop) --------------------------------------------------------------
    async def connect(self, worker_address: bytes) -> Any:
        """An endpoint to the UCX worker at ``worker_address`` (error handling off: see the module docstring)."""
        addr = ucx.get_ucx_address_from_buffer(worker_address)
        try:
            if BINDING == "ucxx":
                return await ucx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)
            return await ucx.create_endpoint_from_worker_address(addr)  # pragma: no cover - ucx-py
        except ucx.exceptions.UCXError as exc:
            raise PeerUnreachable(f"UCX endpoint: {exc}") from exc

    def close_endpoint(self, ep: Any) -> None:
        """Close ``ep`` soon, without waiting (pending receives on it are cancelled); never raises."""

        async def close() -> None:
            try:
                await asyncio.wait_for(ep.close(), 5.0)
            except Exception as exc:  # noqa: BLE001 - an endpoint to a dead peer may fail to close; drop it anyway
                log.debug("closing a UCX endpoint: %s", exc)

        def start() -> None:
            task = self.loop.create_task(close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        self.loop.call_soon_threadsafe(start)

    async def recv_any(self, buf: Any, tag: int) -> None:
        """Worker-level receive: matches ``tag`` whichever endpoint sent it. Cancelling the awaiting task
        does *not* cancel the UCX request (ucxx tracks no worker-level requests): end it with a message."""
        await ucx.recv(buf, tag)

    async def send_self(self, buf: Any, tag: int) -> None:
        """Send ``buf`` to this process's own worker (e.g. to complete a :meth:`recv_any` at shutdown)."""
        if self._self_ep is None:
            self._self_ep = await self.connect(self.worker_address)
        await self._self_ep.send(buf, tag=tag, force_tag=True)

    def shutdown(self) -> None:
        """Stop the loop thread (at interpreter exit). UCX itself is left to the process's end: resetting
        it while a peer's message is in flight is riskier than exiting with it."""
        if self.loop.is_running():
            async def drain() -> None:
                if self._closing:
                    await asyncio.wait(list(self._closing), timeout=2.0)

            with contextlib.suppress(Exception):
                self.call(drain(), 3.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        self.copies.shutdown(wait=False, cancel_futures=True)


_RUNTIME: Runtime | None = None
_LOCK = threading.Lock()


def runtime(progress_mode: str = "thread", tls: str = "") -> Runtime:
    """The process's runtime, started on first use with ``progress_mode`` and ``tls``.

    ``tls`` (the ``ucx_tls`` option) wins over the environment's ``UCX_TLS``, which wins over
    :data:`DEFAULT_TLS`. Later callers asking for other settings get the running runtime and a warning:
    UCX reads them once per process.
    """
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is None:
            chosen = tls or os.environ.get("UCX_TLS") or DEFAULT_TLS
            os.environ["UCX_TLS"] = chosen  # read by UCX when ucxx creates its context, i.e. now
            _RUNTIME = Runtime(progress_mode, chosen)
            atexit.register(_RUNTIME.shutdown)
            log.info("UCX runtime: %s, progress %s, UCX_TLS=%s", BINDING, progress_mode, chosen)
        elif progress_mode != _RUNTIME.progress_mode or (tls and tls != _RUNTIME.tls):
            log.warning(
                "UCX runtime already started with progress_mode=%s UCX_TLS=%s; ignoring %s/%s",
                _RUNTIME.progress_mode, _RUNTIME.tls, progress_mode, tls,
            )
        return _RUNTIME


__all__ = ["BINDING", "DEFAULT_TLS", "MAX_CHUNKS", "Runtime", "as_buffer", "control_tag", "reply_tag", "runtime", "ucx"]
