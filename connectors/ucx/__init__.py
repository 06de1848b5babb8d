"""``ucx`` — peer-to-peer KV hand-off: the consumer pulls the blocks straight out of the producer's KV cache.

The producer keeps a finished prompt's blocks (``delay_free``) and names them in the transfer params
it hands the consumer; the consumer's worker pulls them over UCX and tells the producer to free
them. Bulk bytes go over UCX (shared memory between processes of one host, TCP or — with a site UCX —
RDMA between hosts); everything else over the gRPC metadata plane (:mod:`kvbridge.metadata`).

**Producer worker** (roles ``producer``/``both``) runs an embedded :class:`MetadataServer`:

- *Handshake*: refuses a consumer whose layout fingerprint differs (:class:`LayoutMismatch`), makes
  a UCX endpoint to the consumer's worker address (``transport["ucx_worker_address"]``) and answers
  with its own.
- *Pull* (a UCX tag message on the producer's :func:`control_tag`, struct-packed, never pickled):
  the consumer names its engine, a reply serial, the producer's request and block ids. The producer
  checks the request is still held, answers a status message (with its real bytes per block and in all,
  which the consumer checks against its own layout before it takes any chunk: UCX delivers a message
  shorter than the receive buffer without an error), then gathers the blocks chunk by chunk
  (``chunk_bytes``, ``max_inflight`` chunks in flight) and sends each as one message — whole chunks,
  never a message per block.
- *Release* (gRPC): the request is reported in ``finished_saving`` and its blocks freed; so is a
  request whose lease (``lease_s``) expires first (counted in ``stats.expired_leases``) — but never while
  a pull of it is still being served (every send has a deadline, so that ends). The worker
  learns the held requests from ``StepPlan.extra["ucx_holds"]``; a release that arrives before the
  plan is remembered.

**Where the scheduler finds the worker.** The scheduler writes the producer worker's metadata address
into the transfer params, but may live in another process. With ``metadata_port`` set, rank ``r``
listens on ``advertise_host:metadata_port + r`` and the scheduler derives the addresses (use this
across hosts, or whenever ports must be fixed). With ``metadata_port=0`` (default) each worker
listens on a free port and publishes its address in a small file ``<registry_dir>/<engine>.<rank>.json``
(and in-process), which the scheduler reads: scheduler and workers of one engine share a host.

**Consumer worker** (``consumer``/``both``): loads run on a small thread pool. Per producer address it
handshakes once (cached with the endpoint), then per load: posts the receives, sends the pull,
receives each chunk into a staging buffer — never into the KV, so a late, partial or timed-out chunk
never touches a block — scatters it (one op per layer), and finally releases the producer's request.
Every wait has a deadline (``timeout_s`` without progress); a dead, unreachable or refusing producer
ends the load with its missing blocks in ``failed_blocks`` (the engine recomputes them), never a
hang. After a timeout the endpoint to that producer is dropped and made anew next time.

Runtime, transport choice and the ``cma`` safety rule: :mod:`kvbridge.connectors.ucx.runtime`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from kvbridge.connectors.ucx import onesided
from kvbridge.connectors.ucx import runtime as rtmod

from kvbridge import native
from kvbridge.contract import (
    Backend,
    BlockLoad,
    EngineInfo,
    FinishDecision,
    Lookup,
    RequestInfo,
    ScheduledRequest,
    SchedulerSide,
    StepPlan,
    WorkerReport,
    WorkerSide,
)
from kvbridge.errors import KVBridgeError, PeerUnreachable, ProtocolError, TransferError, TransferTimeout
from kvbridge.layout import KVLayout
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import PeerInfo
from kvbridge.options import require
from kvbridge.stats import TransferStats

log = logging.getLogger(__name__)

PARAMS_VERSION = 1  # transfer_params["kvbridge_version"]
WORKER_ADDRESS = "ucx_worker_address"  # PeerInfo.transport keys
CONTROL_TAG = "ucx_control_tag"  # 8 bytes, little-endian: where the producer takes pulls
HOLD_GRACE_S = 5.0  # how long a two-sided pull waits for the producer's engine to report the request held
PLAN = "ucx"  # StepPlan.extra key of the scheduler's UcxPlan

# ---- wire format of the UCX control messages (little-endian) ---------------------------------------
_MAGIC = b"KVBU"
_WIRE_VERSION = 2  # 2: the status names the producer's bytes per block and in all
_PULL = struct.Struct("<4sBBHHHIIQd")  # magic, version, kind, len(engine), len(request), rank, n_ids, blocks/chunk, serial, expires_at
# magic, version, code, len(reason), n_chunks, bytes per block (all layers), bytes in all; then the reason (utf-8)
_STATUS = struct.Struct("<4sBBHIQQ")
_KIND_PULL, _KIND_STOP = 1, 2
_OK, _REFUSED = 0, 1
STATUS_BYTES = 512
MAX_PULL_IDS = 250_000  # one pull's block ids fit a 1 MiB control message (4M tokens at block size 16)
MAX_ID_BYTES = 256  # an engine or request id in a pull, utf-8
MAX_BLOCK_ID = 2**31 - 1  # block ids travel as int32
CONTROL_BYTES = _PULL.size + 2 * MAX_ID_BYTES + 4 * MAX_PULL_IDS
_MAX_CHUNK_BYTES = 1 << 30  # what a producer gathers per chunk at most, whatever a consumer asks
_SERVES = 4  # pulls a producer worker serves at once; others queue
_LOAD_THREADS = 4  # loads a consumer worker runs at once
_GRAVEYARD_BYTES = 512 << 20  # staging buffers of abandoned receives kept alive (UCX may still write them)


@dataclasses.dataclass(frozen=True)
class Hold:
    """A finished request whose blocks the engine keeps for a consumer until ``expires_at`` (wall clock)."""

    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float


@dataclasses.dataclass(frozen=True)
class UcxPlan:
    """What a producer's scheduler tells its workers each step (``StepPlan.extra["ucx"]``): the key that
    signs its grants (sent every step, so a worker can check any grant its scheduler issued, also while
    the engine is idle afterwards) and the requests it now holds (for lease expiry)."""

    grant_key: bytes
    holds: tuple[Hold, ...] = ()


def _wants_remote_decode(role: str, request: RequestInfo) -> bool:
    """Hold a finished request's blocks for a consumer? Always on a pure producer; on an engine that
    does both, only when the client asked (vLLM's ``do_remote_decode``), so ordinary requests free at once."""
    params = request.transfer_params or {}
    return role == "producer" or bool(params.get("do_remote_decode"))


@dataclasses.dataclass(frozen=True)
class UcxOptions:
    """Options of the ``ucx`` backend (``kv_connector_extra_config``); every one has a loopback default.

    - ``advertise_host``: the host consumers dial for this engine's metadata server (and the one it
      listens on, unless ``listen_host``).
    - ``listen_host``: bind the metadata server here instead (e.g. ``0.0.0.0`` in a container).
    - ``metadata_port``: 0 = a free port per worker, published in ``registry_dir``; N = rank r listens on N+r.
    - ``registry_dir``: where workers publish their metadata address for their scheduler
      (default: ``$TMPDIR/kvbridge-ucx-<uid>``).
    - ``timeout_s``: a transfer step (handshake, status, each chunk) without progress for this long fails.
    - ``lease_s``: a producer frees a request's blocks this long after it finished if no release came.
    - ``chunk_bytes`` / ``max_inflight``: the pull moves chunks of about this many bytes, this many at once.
    - ``progress_mode``: ucxx progress, process-wide: "thread" (default), "blocking", "thread-polling",
      "polling". "blocking" progresses UCX on the runtime's loop thread: measured here ~2x the bulk
      throughput of "thread" (see kvbridge.bench.ucx_baselines) but slower small-message round trips.
    - ``ucx_tls``: UCX_TLS for this process (wins over the environment; default ``^cma``); process-wide.
    - ``lane``: how a consumer reads: "auto" (default: one-sided ``cma`` on one host, else one-sided
      ``ucp`` GET with peer error handling, else the two-sided path when the native module is missing),
      "cma", "ucp", "ucp-unsafe" (UCX may pick cma with error handling off: a dying producer can abort
      the consumer), "two-sided" (tag sends served by the producer's Python). See
      :mod:`kvbridge.connectors.ucx.onesided`.
    - ``token``: shared token of the metadata plane (both sides must agree).
    """

    advertise_host: str = "127.0.0.1"
    listen_host: str = ""
    metadata_port: int = 0
    registry_dir: str = ""
    timeout_s: float = 10.0
    lease_s: float = 60.0
    chunk_bytes: int = 16 << 20
    max_inflight: int = 3
    progress_mode: Literal["thread", "thread-polling", "blocking", "polling"] = "thread"
    ucx_tls: str = ""
    token: str | None = None
    lane: Literal["auto", "cma", "ucp", "ucp-unsafe", "two-sided"] = "auto"

    def __post_init__(self) -> None:
        require(bool(self.advertise_host), "advertise_host must not be empty")
        require(0 <= self.metadata_port < 65536, f"metadata_port={self.metadata_port} outside [0, 65535]")
        require(self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0")
        require(self.lease_s > 0, f"lease_s={self.lease_s} must be > 0")
        require(self.chunk_bytes >= 4096, f"chunk_bytes={self.chunk_bytes} must be >= 4096")
        require(1 <= self.max_inflight <= 64, f"max_inflight={self.max_inflight} outside [1, 64]")
        require(self.token is None or bool(self.token), "token must be non-empty (or unset)")
        require(self.lane in onesided.LANES, f"lane={self.lane!r} is not one of {', '.join(onesided.LANES)}")

    @property
    def registry(self) -> Path:
        return Path(self.registry_dir or Path(tempfile.gettempdir()) / f"kvbridge-ucx-{os.getuid()}")


@dataclasses.dataclass
class UcxStats(TransferStats):
    """:class:`TransferStats` plus what a producer sees: pulls served or refused, releases, expired leases."""

    served_pulls: int = 0
    served_bytes: int = 0
    refused_pulls: int = 0
    releases: int = 0
    expired_leases: int = 0


# ---- where a producer's workers listen ---------------------------------------------------------------
_PUBLISHED: dict[tuple[str, str, int], str] = {}  # (registry, engine_id, rank) -> address, this process


def _registry_file(options: UcxOptions, engine_id: str, rank: int) -> Path:
    name = hashlib.sha256(engine_id.encode()).hexdigest()[:24]  # any engine id, a safe file name
    return options.registry / f"{name}.{rank}.json"


def _publish(options: UcxOptions, engine_id: str, rank: int, address: str) -> None:
    _PUBLISHED[(str(options.registry), engine_id, rank)] = address
    path = _registry_file(options, engine_id, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"engine_id": engine_id, "rank": rank, "address": address, "pid": os.getpid()}))
        os.replace(tmp, path)  # a reader sees the old address or the new one, never half
    except OSError as exc:  # in-process schedulers still find it; others will log the miss
        log.warning("cannot publish the metadata address in %s: %s", path, exc)


def _unpublish(options: UcxOptions, engine_id: str, rank: int) -> None:
    _PUBLISHED.pop((str(options.registry), engine_id, rank), None)
    with contextlib.suppress(OSError):
        path = _registry_file(options, engine_id, rank)
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def _lookup_address(options: UcxOptions, engine_id: str, rank: int) -> str | None:
    if options.metadata_port:
        return f"{options.advertise_host}:{options.metadata_port + rank}"
    found = _PUBLISHED.get((str(options.registry), engine_id, rank))
    if found:
        return found
    try:
        entry = json.loads(_registry_file(options, engine_id, rank).read_text())
    except (OSError, ValueError):
        return None
    return str(entry["address"]) if entry.get("engine_id") == engine_id else None


# ---- scheduler side ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Incoming:
    params: Mapping[str, Any]
    num_computed: int = 0
    loading: bool = False


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id(v: Any) -> bool:
    try:
        return isinstance(v, str) and 0 < len(v.encode()) <= MAX_ID_BYTES
    except UnicodeEncodeError:
        return False


def _is_address(v: Any) -> bool:
    m = _HOST_PORT.fullmatch(v) if isinstance(v, str) else None
    return m is not None and 0 < int(m.group(2)) < 65536


def _usable_params(params: Any) -> Mapping[str, Any] | None:
    """``params`` if they are transfer params this version can act on, else ``None`` (a miss): they come
    from a client or a proxy, so every field is checked here, before the scheduler or the wire sees it."""
    if not isinstance(params, Mapping) or not _is_int(params.get("kvbridge_version")):
        return None
    if params["kvbridge_version"] != PARAMS_VERSION:
        return None
    try:
        ids, n, expires_at = params["block_ids"], params["num_tokens"], float(params["expires_at"])
        names, address = (params["engine_id"], params["request_id"]), params["metadata_address"]
        many = params.get("metadata_addresses", ())
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    if not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= MAX_PULL_IDS:
        return None
    if not all(_is_int(b) and 0 <= b <= MAX_BLOCK_ID for b in ids):
        return None
    if not _is_int(n) or n <= 0 or not math.isfinite(expires_at) or expires_at < time.time():
        return None
    if not all(_is_id(v) for v in names) or not _is_address(address):
        return None
    if not isinstance(many, (list, tuple)) or not all(_is_address(a) for a in many):
        return None
    grant = params.get("grant", "")
    if not isinstance(grant, str) or len(grant) > 256 or not re.fullmatch(r"(?:[0-9a-f]{2})*", grant):
        return None
    if grant and not onesided.grant_covers(bytes.fromhex(grant), ids):  # ids altered on the way
        return None
    return params


class UcxScheduler(SchedulerSide):
    """Scheduler side. As a consumer: admits what the transfer params name and plans the pulls. As a
    producer: holds finished prompts' full blocks for a consumer and says where to pull them from."""

    def __init__(self, options: UcxOptions, engine: EngineInfo):
        self.options = options
        self.engine = engine
        self._incoming: dict[str, _Incoming] = {}
        self._pending: list[BlockLoad] = []
        self._hold_after_load: list[str] = []
        self._holds: list[Hold] = []
        self._grant_key = onesided.new_key()  # a new engine, a new key: grants of a previous one fail

    def lookup(self, request: RequestInfo, num_computed_tokens: int) -> Lookup:
        self._check_open()
        params = _usable_params(request.transfer_params) if self.engine.role != "producer" else None
        if params is None or params["engine_id"] == self.engine.engine_id:
            return Lookup(0)
        self._incoming[request.request_id] = _Incoming(params, num_computed_tokens)
        # never more than the named blocks hold: the engine would take the rest as loaded
        loadable = min(params["num_tokens"], len(params["block_ids"]) * self.engine.block_size, request.num_prompt_tokens - 1)
        return Lookup(max(0, loadable - num_computed_tokens), is_async=True)

    def on_allocated(self, request: RequestInfo, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self._check_open()
        incoming = self._incoming.get(request.request_id)
        if incoming is None or num_external_tokens <= 0:
            return
        bs = self.engine.block_size
        first = incoming.num_computed // bs
        remote = tuple(int(b) for b in incoming.params["block_ids"])
        last = min(-(-(incoming.num_computed + num_external_tokens) // bs), len(remote), len(block_ids))
        if last <= first:
            return
        p = incoming.params
        source = {
            "engine_id": str(p["engine_id"]),
            "metadata_address": str(p["metadata_address"]),
            "metadata_addresses": tuple(str(a) for a in p.get("metadata_addresses", ())),
            "remote_request_id": str(p["request_id"]),
            "remote_block_ids": remote[first:last],
            "expires_at": float(p["expires_at"]),
            "grant": str(p.get("grant", "")),
        }
        self._pending.append(BlockLoad(request.request_id, tuple(int(b) for b in block_ids[first:last]), source=source))
        incoming.loading = True

    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        self._check_open()
        extra = {PLAN: UcxPlan(self._grant_key, tuple(self._holds))} if self.engine.role != "consumer" else {}
        plan = StepPlan(loads=tuple(self._pending), held=tuple(self._hold_after_load), extra=extra)
        self._pending.clear()
        self._hold_after_load.clear()
        self._holds.clear()
        return plan

    def on_report(self, report: WorkerReport) -> None:
        self._check_open()
        for rid in report.finished_loading:
            incoming = self._incoming.get(rid)
            if incoming is not None:
                incoming.loading = False

    def on_finished(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        self._check_open()
        incoming = self._incoming.pop(request.request_id, None)
        if incoming is not None and incoming.loading:
            if any(op.request_id == request.request_id for op in self._pending):  # never started: drop it
                self._pending = [op for op in self._pending if op.request_id != request.request_id]
                return FinishDecision()
            self._hold_after_load.append(request.request_id)  # a pull still writes into its blocks
            return FinishDecision(delay_free=True)
        if self.engine.role == "consumer" or not _wants_remote_decode(self.engine.role, request):
            return FinishDecision()
        return self._offer(request, block_ids)

    def _offer(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        full = min(request.num_prompt_tokens // self.engine.block_size, len(block_ids))
        addresses = [_lookup_address(self.options, self.engine.engine_id, r) for r in range(self.engine.world_size)]
        if not full or addresses[0] is None:
            if full:
                log.warning("%s: no published metadata address (worker not started?); %s not offered",
                            self.engine.engine_id, request.request_id)
            return FinishDecision()
        ids = tuple(int(b) for b in block_ids[:full])
        expires_at = time.time() + self.options.lease_s
        self._holds.append(Hold(request.request_id, ids, expires_at))
        params = {
            "kvbridge_version": PARAMS_VERSION,
            "engine_id": self.engine.engine_id,
            "metadata_address": addresses[0],
            "request_id": request.request_id,
            "block_ids": list(ids),
            "num_tokens": full * self.engine.block_size,
            "expires_at": expires_at,
            "grant": onesided.sign(self._grant_key, self.engine.engine_id, request.request_id, expires_at, ids).hex(),
        }
        if self.engine.world_size > 1 and all(addresses):
            params["metadata_addresses"] = addresses
        return FinishDecision(delay_free=True, transfer_params=params)


# ---- producer worker: serving pulls --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Pull:
    engine_id: str
    rank: int
    request_id: str
    block_ids: np.ndarray
    blocks_per_chunk: int
    serial: int
    expires_at: float

    def encode(self) -> bytes:
        e, r = self.engine_id.encode(), self.request_id.encode()
        head = _PULL.pack(_MAGIC, _WIRE_VERSION, _KIND_PULL, len(e), len(r), self.rank, len(self.block_ids),
                          self.blocks_per_chunk, self.serial, self.expires_at)
        return head + e + r + np.asarray(self.block_ids, dtype="<i4").tobytes()

    @classmethod
    def decode(cls, data: memoryview) -> _Pull:
        if len(data) < _PULL.size:
            raise ProtocolError("pull message too short")
        magic, version, kind, ne, nr, rank, n, per, serial, expires = _PULL.unpack_from(data)
        if magic == _MAGIC and version == _WIRE_VERSION and kind == _KIND_STOP:
            raise _Stop
        if magic != _MAGIC or version != _WIRE_VERSION or kind != _KIND_PULL or not 0 < n <= MAX_PULL_IDS or per < 1:
            raise ProtocolError(f"malformed pull message (magic {magic!r}, version {version}, kind {kind}, {n} ids)")
        off = _PULL.size
        engine_id, request_id = bytes(data[off:off + ne]).decode(), bytes(data[off + ne:off + ne + nr]).decode()
        ids = np.frombuffer(data, dtype="<i4", count=n, offset=off + ne + nr).astype(np.int64)
        return cls(engine_id, rank, request_id, ids, per, serial, expires)


class _Stop(Exception):
    """The control message a producer sends itself to end its control loop."""


_STOP_MESSAGE = np.frombuffer(_PULL.pack(_MAGIC, _WIRE_VERSION, _KIND_STOP, 0, 0, 0, 0, 0, 0, 0.0), dtype=np.uint8)


def _status(code: int, n_chunks: int, reason: str = "", block_bytes: int = 0, total_bytes: int = 0) -> np.ndarray:
    text = reason.encode()[: STATUS_BYTES - _STATUS.size]
    out = np.zeros(STATUS_BYTES, dtype=np.uint8)
    head = _STATUS.pack(_MAGIC, _WIRE_VERSION, code, len(text), n_chunks, block_bytes, total_bytes)
    out[: _STATUS.size + len(text)] = np.frombuffer(head + text, np.uint8)
    return out


def _read_status(buf: np.ndarray) -> tuple[int, int, int, int, str]:
    """``(code, n_chunks, bytes per block, bytes in all, reason)`` of a status message."""
    magic, version, code, n, n_chunks, block_bytes, total = _STATUS.unpack_from(buf.tobytes())
    if magic != _MAGIC or version != _WIRE_VERSION:
        raise ProtocolError(f"malformed status message from the producer (wire version {version}, ours {_WIRE_VERSION})")
    return code, n_chunks, block_bytes, total, bytes(buf[_STATUS.size:_STATUS.size + n]).decode(errors="replace")


def _chunk(buf: torch.Tensor, layout: KVLayout, n: int) -> torch.Tensor:
    """The first ``n`` blocks' worth of a staging buffer, as a contiguous ``[layers, n, block_bytes]``."""
    return buf.view(-1)[: layout.num_layers * n * layout.block_bytes].view(layout.num_layers, n, layout.block_bytes)


class _StagingPool:
    """Staging buffers kept for reuse. Fresh memory costs UCX a registration (and the kernel page faults) on
    every transfer: measured here, 16 MiB chunks into new buffers ran 5-8x slower than into reused ones."""

    def __init__(self, layout: KVLayout, keep: int):
        self.layout, self.keep = layout, keep
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def take(self, blocks: int) -> torch.Tensor:
        with self._lock:
            free = self._free[blocks]
            if free:
                return free.pop()
        return self.layout.staging(blocks)

    def give(self, bufs: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for buf in bufs:
                free = self._free[int(buf.shape[1])]
                if len(free) < self.keep:
                    free.append(buf)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:  # a gather/scatter on the GPU is queued on a stream; UCX must see finished bytes
        torch.cuda.current_stream(t.device).synchronize()


class _Server:
    """A producer worker's serving half: metadata server, UCX control loop, held requests."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, layout: KVLayout, rt: rtmod.Runtime, stats: UcxStats):
        self.options, self.engine, self.layout, self.rt, self.stats = options, engine, layout, rt, stats
        self.tag = rtmod.control_tag(engine.engine_id, engine.rank)
        self.info = PeerInfo(engine.engine_id, engine.rank, layout.fingerprint,
                             {WORKER_ADDRESS: rt.worker_address, CONTROL_TAG: self.tag.to_bytes(8, "little")})
        self._lock = threading.Lock()
        self._consumers: dict[tuple[str, int], Any] = {}  # (engine id, rank) -> UCX endpoint
        self._holds: dict[str, tuple[frozenset[int], float]] = {}
        # released or expired -> already reported in finished_saving (False: released before the engine
        # told us it held the request, and not provably handed off; reported when the plan names it)
        self._done: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._grant_key: bytes | None = None  # from the scheduler's plans
        self.exporter = self._export(layout)
        self._finished: set[str] = set()  # to report in finished_saving
        self._in_service: collections.Counter[str] = collections.Counter()  # request id -> pulls of it being served
        self._control_buf = np.empty(CONTROL_BYTES, dtype=np.uint8)
        self._staging = _StagingPool(layout, _SERVES * options.max_inflight)
        port = options.metadata_port + engine.rank if options.metadata_port else 0
        self.server = MetadataServer(f"{options.listen_host or options.advertise_host}:{port}", token=options.token,
                                     on_handshake=self._handshake, on_release=self._release, directory=False)
        port = self.server.start()
        self.address = f"{options.advertise_host}:{port}"
        self._serving = rt.submit(self._control_loop())
        _publish(options, engine.engine_id, engine.rank, self.address)

    def _export(self, layout: KVLayout) -> onesided.Exporter | None:
        if self.options.lane == "two-sided":
            return None
        mod, why = native.load()
        if mod is None:
            log.info("%s: one-sided reads unavailable (%s); serving two-sided pulls only", self.engine.engine_id, why)
            return None
        return onesided.Exporter(layout, self.options.ucx_tls)

    # ---- metadata callbacks (gRPC threads) ----
    def _handshake(self, peer: PeerInfo) -> PeerInfo:
        self.layout.fingerprint.check(peer.fingerprint, what=f"consumer {peer.engine_id}")
        ask = peer.transport.get(onesided.ASK)
        if ask is not None and self.exporter is not None:
            rid, grant = onesided.decode_ask(ask)
            with self._lock:
                key = self._grant_key
            if onesided.verify(key, self.engine.engine_id, rid, grant) is None:  # rkeys only for a hand-off
                raise ProtocolError(f"consumer {peer.engine_id} named request {rid!r} without a valid grant of this producer")
            return dataclasses.replace(self.info, transport={**self.info.transport, **self.exporter.transport()})
        address = peer.transport.get(WORKER_ADDRESS)
        if not address:
            raise ProtocolError(f"consumer {peer.engine_id} sent no {WORKER_ADDRESS}")
        ep = self.rt.call(self.rt.connect(address), self.options.timeout_s)
        with self._lock:
            old = self._consumers.pop((peer.engine_id, peer.rank), None)
            self._consumers[(peer.engine_id, peer.rank)] = ep
        if old is not None:  # the consumer dropped its side (a timeout) and starts over
            self.rt.close_endpoint(old)
        return self.info

    def _release(self, engine_id: str, request_id: str, aborted: bool, grant: bytes) -> bool:
        """Free the request's blocks (reported at the engine's next step); answer whether they stayed held
        from the hand-off until now. A valid grant proves the hand-off even before the engine told this
        worker (an idle engine never does); without one only a request the plans named counts."""
        self.stats.add(releases=1)
        now = time.time()
        with self._lock:
            expires = onesided.verify(self._grant_key, self.engine.engine_id, request_id, grant)
            if expires is None and grant and self._grant_key is not None and request_id not in self._holds:
                # another engine's grant (this address restarted): not ours to free, nor to remember
                log.info("%s: ignored a release of %s with a foreign grant", self.engine.engine_id, request_id)
                return False
            known = self._holds.pop(request_id, None)
            if known is not None:
                expires = known[1] if expires is None else expires
            done_before = request_id in self._done
            handed_off = expires is not None and not done_before
            if handed_off:
                self._finished.add(request_id)
            if not done_before:
                self._mark_done(request_id, reported=handed_off)
        held = expires is not None and not done_before and now <= expires
        if not held and not aborted:
            self.stats.add(refused_pulls=1)
            log.info("%s: %s released by %s was not held throughout (%s)", self.engine.engine_id, request_id, engine_id,
                     "already released or expired" if done_before else "no valid grant" if expires is None else "lease over")
        return held

    def _mark_done(self, request_id: str, *, reported: bool) -> None:
        self._done[request_id] = reported
        while len(self._done) > 65536:
            self._done.popitem(last=False)

    # ---- engine steps ----
    def hold(self, plan: UcxPlan) -> None:
        with self._lock:
            self._grant_key = plan.grant_key
            for h in plan.holds:
                reported = self._done.get(h.request_id)
                if reported is False:  # released before the plan told us it was held: report it now
                    self._finished.add(h.request_id)
                    self._done[h.request_id] = True
                elif reported is None:
                    self._holds[h.request_id] = (frozenset(h.block_ids), float(h.expires_at))

    def take_finished(self) -> set[str]:
        now = time.time()
        with self._lock:
            # a lease does not expire under a pull still gathering from its blocks (each send has a deadline)
            expired = [rid for rid, (_, exp) in self._holds.items() if exp < now and not self._in_service[rid]]
            for rid in expired:
                del self._holds[rid]
                self._mark_done(rid, reported=True)
                self._finished.add(rid)
            out, self._finished = self._finished, set()
        if expired:
            log.info("%s: lease expired for %d request(s) no consumer released", self.engine.engine_id, len(expired))
            self.stats.add(expired_leases=len(expired))
        return out

    # ---- UCX (on the loop) ----
    async def _control_loop(self) -> None:
        buf = self._control_buf
        slots = asyncio.Semaphore(_SERVES)
        while True:
            try:
                await self.rt.recv_any(buf, self.tag)
            except Exception as exc:  # noqa: BLE001 - e.g. a message larger than any pull: the loop must go on
                log.warning("%s: dropped a control message: %s: %s", self.engine.engine_id, type(exc).__name__, exc)
                await asyncio.sleep(0.01)  # never a busy loop, whatever keeps failing
                continue
            try:
                pull = _Pull.decode(memoryview(buf.tobytes()))  # a copy: the buffer takes the next message now
            except _Stop:
                return
            except (ProtocolError, UnicodeDecodeError, ValueError) as exc:
                log.warning("%s: dropped a malformed pull: %s", self.engine.engine_id, exc)
                continue
            asyncio.get_running_loop().create_task(self._serve_guarded(pull, slots))

    async def _serve_guarded(self, pull: _Pull, slots: asyncio.Semaphore) -> None:
        async with slots:
            with self._lock:
                self._in_service[pull.request_id] += 1
            try:
                await self._serve(pull)
            except Exception as exc:  # noqa: BLE001 - one pull failing must not stop the others
                log.warning("%s: serving %s to %s failed: %s", self.engine.engine_id, pull.request_id, pull.engine_id, exc)
                with self._lock:
                    ep = self._consumers.pop((pull.engine_id, pull.rank), None)
                if ep is not None:  # a stuck consumer: it handshakes again next time
                    self.rt.close_endpoint(ep)
            finally:
                with self._lock:
                    self._in_service[pull.request_id] -= 1
                    if not self._in_service[pull.request_id]:
                        del self._in_service[pull.request_id]

    async def _await_hold(self, pull: _Pull) -> None:
        # The engine tells this worker what it holds in the step after the request finished; a quick
        # consumer can pull before that step ran. Wait a little for it rather than serve blocks that
        # nobody holds (they may already belong to another request).
        deadline = time.monotonic() + min(self.options.timeout_s, HOLD_GRACE_S)
        while time.monotonic() < deadline:
            with self._lock:
                if pull.request_id in self._holds or pull.request_id in self._done:
                    return
            await asyncio.sleep(0.005)

    def _refusal(self, pull: _Pull) -> str:
        ids = pull.block_ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks:
            return "block ids outside the KV cache"
        with self._lock:
            if pull.request_id in self._done:
                return f"request {pull.request_id} was already released or its lease expired"
            held = self._holds.get(pull.request_id)
        if time.time() > pull.expires_at:
            return f"the lease of request {pull.request_id} expired"
        if held is None:
            return f"request {pull.request_id} is not held by this producer"
        if not held[0].issuperset(ids.tolist()):
            return f"blocks not held for request {pull.request_id}"
        return ""

    async def _serve(self, pull: _Pull) -> None:
        with self._lock:
            ep = self._consumers.get((pull.engine_id, pull.rank))
        if ep is None:
            raise ProtocolError(f"pull from {pull.engine_id}/{pull.rank} without a handshake")
        timeout, layout, loop = self.options.timeout_s, self.layout, asyncio.get_running_loop()
        per = max(1, min(pull.blocks_per_chunk, _MAX_CHUNK_BYTES // (layout.num_layers * layout.block_bytes)))
        n_chunks = -(-len(pull.block_ids) // per)
        await self._await_hold(pull)
        refusal = self._refusal(pull) or ("too many chunks" if n_chunks > rtmod.MAX_CHUNKS - 1 else "")
        block_bytes = layout.num_layers * layout.block_bytes  # the real size, whatever the handshake said
        status = _status(_REFUSED if refusal else _OK, n_chunks, refusal, block_bytes, block_bytes * len(pull.block_ids))
        await asyncio.wait_for(ep.send(status, tag=rtmod.reply_tag(pull.serial, 0), force_tag=True), timeout)
        if refusal:
            self.stats.add(refused_pulls=1)
            log.info("%s: refused a pull of %s: %s", self.engine.engine_id, pull.request_id, refusal)
            return
        free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        bufs = [self._staging.take(min(per, len(pull.block_ids))) for _ in range(min(self.options.max_inflight, n_chunks))]
        for buf in bufs:
            free.put_nowait(buf)
        sends: list[asyncio.Task[None]] = []

        async def send(buf: torch.Tensor, view: torch.Tensor, index: int) -> None:
            try:
                await asyncio.wait_for(ep.send(rtmod.as_buffer(view), tag=rtmod.reply_tag(pull.serial, index), force_tag=True), timeout)
            finally:
                free.put_nowait(buf)

        def gather(ids: np.ndarray, view: torch.Tensor) -> None:
            layout.gather(ids, out=view)
            _sync(view)

        try:
            for i in range(n_chunks):
                buf = await asyncio.wait_for(free.get(), timeout)
                for task in sends:  # a send that failed (its deadline) ends the pull
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                ids = pull.block_ids[i * per:(i + 1) * per]
                view = _chunk(buf, layout, len(ids))
                await loop.run_in_executor(self.rt.copies, gather, ids, view)
                sends.append(loop.create_task(send(buf, view, i + 1)))
            await asyncio.gather(*sends)
        finally:
            for task in sends:
                task.cancel()
        self._staging.give(bufs)  # not on failure: a send that missed its deadline may still read its buffer
        self.stats.add(served_pulls=1, served_bytes=len(pull.block_ids) * layout.num_layers * layout.block_bytes)

    def close(self) -> None:
        try:  # the posted worker-level receive ends only with a message: send ourselves one
            self.rt.call(self.rt.send_self(_STOP_MESSAGE, self.tag), 2.0)
            self._serving.result(2.0)
        except Exception as exc:  # noqa: BLE001 - the receive stays posted: keep its buffer alive
            log.warning("%s: control loop did not stop (%s); its receive stays posted", self.engine.engine_id, exc)
            self._serving.cancel()
            _bury([torch.from_numpy(self._control_buf)])
        self.server.stop(grace=0.5)
        _unpublish(self.options, self.engine.engine_id, self.engine.rank)
        with self._lock:
            eps, self._consumers = list(self._consumers.values()), {}
        for ep in eps:
            self.rt.close_endpoint(ep)
        if self.exporter is not None:
            self.exporter.close()


# ---- consumer worker: pulling ---------------------------------------------------------------------------
@dataclasses.dataclass
class _Peer:
    client: MetadataClient
    info: PeerInfo
    ep: Any = None  # ucxx endpoint (two-sided)
    source: onesided.Source | None = None  # one-sided reads

    def close(self, rt: rtmod.Runtime) -> None:
        if self.ep is not None:
            rt.close_endpoint(self.ep)
        if self.source is not None:
            self.source.close()
        self.client.close()


_GRAVEYARD: collections.deque[torch.Tensor] = collections.deque()
_GRAVEYARD_LOCK = threading.Lock()


def _bury(buffers: Sequence[torch.Tensor]) -> None:
    """Keep the staging buffers of abandoned receives alive: a cancelled UCX receive should write
    nothing more, but freed memory that it did write would corrupt whatever is allocated there next."""
    with _GRAVEYARD_LOCK:
        _GRAVEYARD.extend(buffers)
        total = sum(b.numel() for b in _GRAVEYARD)
        while total > _GRAVEYARD_BYTES and len(_GRAVEYARD) > len(buffers):
            total -= _GRAVEYARD.popleft().numel()


class _Puller:
    """A consumer worker's pulling half: handshakes (cached per producer address), pulls, releases."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, layout: KVLayout, rt: rtmod.Runtime, stats: UcxStats):
        self.options, self.engine, self.layout, self.rt, self.stats = options, engine, layout, rt, stats
        self.info = PeerInfo(engine.engine_id, engine.rank, layout.fingerprint, {WORKER_ADDRESS: rt.worker_address})
        self.addressing = layout.addressing()  # where our blocks live, for one-sided reads into them
        self._peers: dict[str, _Peer] = {}
        self._staging = _StagingPool(layout, _LOAD_THREADS * options.max_inflight)
        self._peer_locks: collections.defaultdict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._lock = threading.Lock()

    def _address(self, source: Mapping[str, Any]) -> str:
        many = source.get("metadata_addresses") or ()
        if len(many) > self.engine.rank:
            return str(many[self.engine.rank])
        if self.engine.rank == 0:
            return str(source["metadata_address"])
        raise ProtocolError(f"the producer published no metadata address for rank {self.engine.rank}")

    def _peer(self, address: str, src: Mapping[str, Any]) -> _Peer:
        with self._lock:
            lock = self._peer_locks[address]
        with lock:  # one handshake per producer, even with many loads starting at once
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            client = MetadataClient(address, token=self.options.token, timeout=self.options.timeout_s / 2, retries=1)
            try:
                peer = self._handshake(client, src)
            except BaseException:
                client.close()
                raise
            self._peers[address] = peer
            return peer

    def _handshake(self, client: MetadataClient, src: Mapping[str, Any]) -> _Peer:
        lane = self.options.lane
        mod, why = native.load() if lane != "two-sided" else (None, "lane='two-sided'")
        if mod is None and lane != "auto" and lane != "two-sided":
            raise PeerUnreachable(f"lane={lane!r} needs the native module: {why}")
        if mod is not None:  # ask for one-sided access, naming the hand-off that entitles us to it
            ask = onesided.encode_ask(str(src["remote_request_id"]), bytes.fromhex(str(src.get("grant", ""))))
            theirs = client.handshake(dataclasses.replace(self.info, transport={onesided.ASK: ask}))
            source = onesided.open_source(theirs, self.layout, lane, self.options.ucx_tls)
            if source is not None:
                return _Peer(client, theirs, source=source)
        theirs = client.handshake(self.info)
        ep = self.rt.call(self.rt.connect(theirs.transport[WORKER_ADDRESS]), self.options.timeout_s)
        return _Peer(client, theirs, ep=ep)

    def _drop(self, address: str) -> None:
        with self._lock:
            lock = self._peer_locks[address]
        with lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.close(self.rt)

    def load(self, op: BlockLoad) -> set[int]:
        """Pull ``op``; return the local block ids that did not arrive. Never raises."""
        src = op.source or {}
        address = ""
        try:
            address = self._address(src)
            peer = self._peer(address, src)
        except Exception as exc:  # noqa: BLE001 - every failure is a failed block, recomputed by the engine
            self._log_failure(op, src, 0, exc)
            self._release(address, src, ok=False)  # no address: nobody to release to
            return set(op.block_ids)
        if peer.source is not None:
            return self._read(address, peer, op, src)
        return self._pull_two_sided(address, peer, op, src)

    def _log_failure(self, op: BlockLoad, src: Mapping[str, Any], arrived: int, exc: Exception) -> None:
        log.log(logging.WARNING if isinstance(exc, KVBridgeError) else logging.ERROR,
                "%s: pull of %s from %s failed after %d of %d blocks: %s: %s", self.engine.engine_id,
                op.request_id, src.get("engine_id"), arrived, len(op.block_ids), type(exc).__name__, exc,
                exc_info=not isinstance(exc, KVBridgeError))

    def _pull_two_sided(self, address: str, peer: _Peer, op: BlockLoad, src: Mapping[str, Any]) -> set[int]:
        arrived = [0]  # blocks (from the first) in place so far, also when the pull fails midway
        try:
            self._pull(peer, op, src, arrived)
        except Exception as exc:  # noqa: BLE001 - every failure is a failed block, recomputed by the engine
            self._log_failure(op, src, arrived[0], exc)
            if isinstance(exc, TransferError):
                self._drop(address)  # a timed-out endpoint may hold stale state: handshake anew next time
        finally:
            self._release(address, src, ok=arrived[0] == len(op.block_ids))
        return set(op.block_ids[arrived[0]:])

    def _read(self, address: str, peer: _Peer, op: BlockLoad, src: Mapping[str, Any]) -> set[int]:
        """One-sided: read every block straight into the KV, then count them only if the producer confirms
        it held them throughout (see :mod:`kvbridge.connectors.ucx.onesided`). All or nothing."""
        assert peer.source is not None
        rid, t0 = str(src["remote_request_id"]), time.perf_counter()
        grant = bytes.fromhex(str(src.get("grant", "")))
        remote = np.asarray(src["remote_block_ids"], dtype=np.int64)
        held = False
        try:
            if len(remote) != len(op.block_ids):
                raise ProtocolError(f"{len(op.block_ids)} local blocks for {len(remote)} remote ones")
            if not grant:  # without one the producer could confirm blocks it never handed off for this request
                raise ProtocolError(f"transfer params of {rid} carry no grant: a one-sided read needs one")
            if float(src.get("expires_at", 0.0)) < time.time():
                raise ProtocolError(f"the lease of {rid} at {src['engine_id']} is over")
            onesided.read(peer.source, self.layout, self.addressing, remote, np.asarray(op.block_ids, dtype=np.int64),
                          self.options.timeout_s)
        except Exception as exc:  # noqa: BLE001 - nothing counts; the producer frees its blocks
            log.warning("%s: one-sided read of %s from %s (%s) failed: %s: %s", self.engine.engine_id, op.request_id,
                        src.get("engine_id"), peer.source.lane, type(exc).__name__, exc)
            self._drop(address)  # a dead or restarted producer: handshake anew next time
            self._release(address, src, ok=False)
            return set(op.block_ids)
        try:
            held = peer.client.release(self.engine.engine_id, rid, aborted=False, grant=grant)
        except KVBridgeError as exc:
            log.warning("%s: producer %s did not confirm %s after the read: %s", self.engine.engine_id,
                        src.get("engine_id"), rid, exc)
            self._drop(address)
        if not held:
            log.warning("%s: producer %s no longer held %s when the read ended: %d blocks not counted",
                        self.engine.engine_id, src.get("engine_id"), rid, len(op.block_ids))
            return set(op.block_ids)
        nbytes = len(op.block_ids) * self.layout.num_layers * self.layout.block_bytes
        self.stats.add(load_bytes=nbytes, load_blocks=len(op.block_ids), load_seconds=time.perf_counter() - t0)
        return set()

    def _release(self, address: str, src: Mapping[str, Any], *, ok: bool) -> None:
        rid = src.get("remote_request_id")
        if not address or not rid:
            return
        with self._lock:
            peer = self._peers.get(address)
        client = peer.client if peer is not None else MetadataClient(address, token=self.options.token,
                                                                     timeout=self.options.timeout_s / 2, retries=1)
        try:
            client.release(self.engine.engine_id, str(rid), aborted=not ok, grant=bytes.fromhex(str(src.get("grant", ""))))
        except KVBridgeError as exc:  # the producer's lease frees the blocks instead
            log.info("%s: release of %s at %s failed: %s", self.engine.engine_id, rid, address, exc)
        finally:
            if peer is None:
                client.close()

    def _pull(self, peer: _Peer, op: BlockLoad, src: Mapping[str, Any], arrived: list[int]) -> None:
        """Receive and scatter every chunk, counting the blocks in place in ``arrived[0]``."""
        layout, timeout = self.layout, self.options.timeout_s
        remote = np.asarray(src["remote_block_ids"], dtype=np.int64)
        if len(remote) != len(op.block_ids):
            raise ProtocolError(f"{len(op.block_ids)} local blocks for {len(remote)} remote ones")
        if len(remote) > MAX_PULL_IDS:
            raise ProtocolError(f"{len(remote)} blocks in one pull; at most {MAX_PULL_IDS}")
        if len(remote) and (int(remote.min()) < 0 or int(remote.max()) > MAX_BLOCK_ID):
            raise ProtocolError("remote block ids outside [0, 2**31)")
        if not _is_id(self.engine.engine_id) or not _is_id(src.get("remote_request_id")):
            raise ProtocolError(f"engine and request ids must be 1 to {MAX_ID_BYTES} bytes of utf-8")
        per = max(1, self.options.chunk_bytes // (layout.num_layers * layout.block_bytes))
        per = max(per, -(-len(remote) // (rtmod.MAX_CHUNKS - 1)))
        n_chunks = -(-len(remote) // per)
        serial = self.rt.next_serial()
        ep, t0 = peer.ep, time.perf_counter()
        status = np.zeros(STATUS_BYTES, dtype=np.uint8)
        bufs = [self._staging.take(min(per, len(remote))) for _ in range(min(self.options.max_inflight, n_chunks))]
        futures: dict[int, concurrent.futures.Future[Any]] = {}

        def post(i: int) -> None:  # chunk i (0-based) into its staging buffer
            n = min(per, len(remote) - i * per)
            view = _chunk(bufs[i % len(bufs)], layout, n)
            futures[i] = self.rt.submit(ep.recv(rtmod.as_buffer(view), tag=rtmod.reply_tag(serial, i + 1), force_tag=True))

        def wait(fut: concurrent.futures.Future[Any], what: str) -> None:
            try:
                fut.result(timeout)
            except concurrent.futures.TimeoutError:
                raise TransferTimeout(f"{what}: nothing from {src['engine_id']} for {timeout:g}s") from None
            except rtmod.ucx.exceptions.UCXMessageTruncatedError:  # more bytes than asked: never scattered
                raise ProtocolError(f"{what} from {src['engine_id']} is larger than its blocks") from None
            except rtmod.ucx.exceptions.UCXError as exc:
                raise PeerUnreachable(f"{what} from {src['engine_id']}: {exc}") from None

        status_fut = self.rt.submit(ep.recv(status, tag=rtmod.reply_tag(serial, 0), force_tag=True))
        try:
            for i in range(len(bufs)):
                post(i)
            pull = _Pull(self.engine.engine_id, self.engine.rank, str(src["remote_request_id"]), remote, per, serial,
                         float(src.get("expires_at", 0.0)) or time.time() + timeout)
            tag = int.from_bytes(peer.info.transport[CONTROL_TAG], "little")
            try:
                self.rt.call(ep.send(np.frombuffer(pull.encode(), dtype=np.uint8), tag=tag, force_tag=True), timeout)
            except rtmod.ucx.exceptions.UCXError as exc:  # e.g. the producer died since the handshake
                raise PeerUnreachable(f"pull to {src['engine_id']}: {exc}") from None
            wait(status_fut, "status")
            code, chunks, block_bytes, total, reason = _read_status(status)
            if code != _OK:
                raise ProtocolError(f"producer {src['engine_id']} refused the pull: {reason}")
            if chunks != n_chunks:
                raise ProtocolError(f"producer announced {chunks} chunks, expected {n_chunks}")
            ours = layout.num_layers * layout.block_bytes
            if block_bytes != ours or total != ours * len(remote):  # a short chunk would arrive without an error
                raise ProtocolError(f"producer {src['engine_id']} sends {block_bytes}-byte blocks ({total} bytes in all); "
                                    f"ours are {ours} bytes: its layout is not the one it announced")
            for i in range(n_chunks):
                wait(futures.pop(i), f"chunk {i + 1}/{n_chunks}")
                n = min(per, len(remote) - i * per)
                view = _chunk(bufs[i % len(bufs)], layout, n)
                layout.scatter(op.block_ids[arrived[0]:arrived[0] + n], view)
                _sync(view)
                arrived[0] += n
                if i + len(bufs) < n_chunks:
                    post(i + len(bufs))
        finally:
            pending = [f for f in (status_fut, *futures.values()) if not f.done()]
            for f in pending:
                f.cancel()  # cancels the UCX receive, which then writes nothing more
            if pending:
                _bury(bufs)
            else:
                self._staging.give(bufs)
            nbytes = arrived[0] * layout.num_layers * layout.block_bytes
            self.stats.add(load_bytes=nbytes, load_blocks=arrived[0], load_seconds=time.perf_counter() - t0)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close(self.rt)


class UcxWorker(WorkerSide):
    """Worker side: serves pulls of the KV it holds (producer) and/or pulls KV from producers (consumer)."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, stats: UcxStats):
        self.options = options
        self.engine = engine
        self.stats: UcxStats = stats
        self.rt = rtmod.runtime(options.progress_mode, options.ucx_tls)
        self.server: _Server | None = None
        self._puller: _Puller | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: set[int] = set()
        self._saved: set[str] = set()
        self._holds: set[str] = set()

    @property
    def metadata_address(self) -> str | None:
        """Where consumers reach this (producer) worker's metadata server; ``None`` for a consumer."""
        return self.server.address if self.server is not None else None

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        if self.engine.role in ("producer", "both"):
            self.server = _Server(self.options, self.engine, layout, self.rt, self.stats)
        if self.engine.role in ("consumer", "both"):
            self._puller = _Puller(self.options, self.engine, layout, self.rt, self.stats)
            self._pool = concurrent.futures.ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix=f"kvbridge-ucx-{self.engine.engine_id}")

    def start_step(self, plan: StepPlan) -> None:
        self._require_layout()
        ucx_plan = plan.extra.get(PLAN)
        if self.server is not None and isinstance(ucx_plan, UcxPlan):
            self.server.hold(ucx_plan)
        with self._lock:
            for rid in plan.held:
                (self._holds if rid in self._inflight else self._saved).add(rid)
            if plan.loads and (self._pool is None or self._puller is None):
                raise ProtocolError(f"{self.engine.engine_id} is a {self.engine.role}: it cannot load")
            for op in plan.loads:
                self._inflight.add(op.request_id)
                assert self._pool is not None
                self._pool.submit(self._load, op)

    def _load(self, op: BlockLoad) -> None:
        assert self._puller is not None
        failed = self._puller.load(op)
        self.stats.add(loads=1, load_failures=int(bool(failed)), failed_blocks=len(failed))
        with self._lock:
            self._inflight.discard(op.request_id)
            self._loaded.add(op.request_id)
            self._failed |= failed
            if op.request_id in self._holds:
                self._holds.discard(op.request_id)
                self._saved.add(op.request_id)

    def finish_step(self) -> None:
        self._require_layout()

    def poll(self) -> WorkerReport:
        self._check_open()
        released = self.server.take_finished() if self.server is not None else set()
        with self._lock:
            report = WorkerReport(frozenset(self._loaded), frozenset(self._saved | released), frozenset(self._failed))
            self._loaded.clear()
            self._saved.clear()
            self._failed.clear()
        return report

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no load is in flight (tests, shutdown); ``False`` on timeout."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        if not self._closed:
            if self._pool is not None:
                self._pool.shutdown(wait=True)  # loads end by their deadlines
            if self._puller is not None:
                self._puller.close()
            if self.server is not None:
                self.server.close()
        super().close()


class UcxBackend(Backend):
    """The ``ucx`` backend; ``stats`` (:class:`UcxStats`) counts for every side it made."""

    name: ClassVar[str] = "ucx"
    kind: ClassVar[Literal["store", "peer"]] = "peer"
    options_type: ClassVar[type[Any]] = UcxOptions

    def __init__(self, options: UcxOptions):
        super().__init__(options)
        self.stats = UcxStats()

    def scheduler(self, engine: EngineInfo) -> UcxScheduler:
        return UcxScheduler(self.options, engine)

    def worker(self, engine: EngineInfo) -> UcxWorker:
        return UcxWorker(self.options, engine, self.stats)


BACKEND = UcxBackend


def describe() -> str:
    """Which data path a consumer takes here (for ``kvbridge backends``)."""
    mod, why = native.load()
    if mod is None:
        return f"data path: two-sided tag sends (one-sided unavailable: {why})"
    return (f"data path: one-sided reads, {native.describe()}: cma on one host, else ucp GET with peer error "
            "handling (lane option)")


__all__ = ["BACKEND", "UcxBackend", "UcxOptions", "UcxScheduler", "UcxStats", "UcxWorker", "describe"]
