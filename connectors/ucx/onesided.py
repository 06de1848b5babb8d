"""One-sided pulls for the ``ucx`` backend: the consumer reads the producer's KV blocks straight into its own.

The producer registers its KV once (:class:`Exporter`); a consumer that passed the metadata plane's
checks gets, in the handshake, what it needs to address every block: the layout's
:class:`~kvbridge.layout.BlockAddressing`, the producer's pid and a probe (``cma``), its TCP port and
secret (``tcp``), its UCX worker address and packed rkeys (``ucp``). Per load the consumer derives
remote and local addresses from block ids with one numpy expression (:func:`batch`) and hands the batch
to the native modules (:mod:`kvbridge._core`, :mod:`kvbridge._ucp`), which merge adjacent descriptors
and move them with the GIL released: :func:`read` in the calling thread, or :func:`start` (``cma``,
``tcp``) on native threads that then read the seal word, so a consumer engine can start a read from its
step and count it at its next poll. No staging copy, and the producer's Python does nothing per transfer.

**Lanes** (option ``lane``; what ``auto`` takes: :func:`.lanes.auto`):

- ``cma`` — same host: ``process_vm_readv`` straight from the producer's memory (a dead producer is an
  ``OSError``, never an abort). The probe decides: the consumer reads a random nonce at an address the
  producer named, which proves same host, same pid namespace, permission, and the right process.
- ``tcp`` — kvbridge's own streams (:mod:`.tcplane`), C threads on both ends: host-memory KV between hosts
  (TCP), or through pipes by reference where both share a network namespace.
- ``ucp`` — UCX RMA GET with *peer error handling* (a dead peer is an error): RDMA, CUDA memory, TCP where asked for.
- ``ucp-unsafe`` — error handling off, so UCX may choose cma itself: a producer killed mid-read can abort the
  consumer (UCX 1.21) or end the read "OK" with wrong bytes (1.22). Documented opt-in only.

**When bytes count as loaded.** A one-sided reader cannot see the producer free or reuse a block. So a
read counts only after the producer confirms, in the release, that it *held* the request from the
hand-off until then (``ReleaseResponse.held``): not released or expired before, lease not over, and
handed off by this producer's own scheduler — the grant in the transfer params is an HMAC with a key
the scheduler sends its workers in every step plan, so a producer that restarted (new key) or never
handed the request off says no. The producer frees the blocks only after it has answered (it reports
the release in its next step), so confirmed bytes were never overwritten during the read. A dead
producer cannot confirm; a failed read or refusal fails every block of the load (the engine
recomputes them), because a one-sided batch may have landed partly.

**The seal: confirming without a round trip.** Each hand-off carries a *seal* ``(slot,
word)``, chosen by the producer's scheduler (word random and nonzero, covered by the grant). The producer
worker keeps a table of words (:class:`Seals`, exported with the KV): it writes ``word`` at ``slot`` when
its plan names the hold, and clears it when the hold ends (release, lease over) — before reporting the
request, so before the engine can free its blocks. After reading the data the consumer reads that word
(``cma``: a second ``process_vm_readv``; ``ucp``: one 8-byte GET of the table, registered beside the KV,
once the data's GETs completed): equal means the hold had not ended when the read was over, so the blocks
were held throughout (a hold never comes back once ended): the bytes count at once, the release goes off
the load's path. Anything else (the worker has not learnt the hold yet, a newer hold took the slot, no
table) falls back to the confirming release above: the seal saves a round trip, the answer is the same.

**Trust.** UCX traffic is neither authenticated nor encrypted. Whoever holds the rkeys (``ucp``) can read the
producer's whole registered KV — every request's blocks — until it exits; ``cma`` needs no key but the same
uid. The producer gives rkeys only in a handshake that passed the metadata plane's token (and TLS when
configured) and named a request its own scheduler handed off (a valid grant).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import threading
import time
from typing import Any

import numpy as np
from kvbridge.connectors.ucx import cuda, lanes, tcplane

from kvbridge import native
from kvbridge.errors import ConfigError, LayoutMismatch, PeerUnreachable, ProtocolError, TransferTimeout
from kvbridge.layout import BlockAddressing, Cut, KVLayout
from kvbridge.metadata.types import PeerInfo

log = logging.getLogger(__name__)

LANES = ("auto", "cma", "tcp", "ucp", "ucp-unsafe", "two-sided")
STARTED = ("cma", "tcp")  # lanes whose reads start on native threads and bring the seal word with the data
ASK = "ucx1s_ask"  # handshake transport keys (PeerInfo.transport); this one: the asking load's request id + grant
PID, PROBE, ADDRESSING, WORKER, RKEYS, MEMORY, BLOCKS = ("ucx1s_pid", "ucx1s_probe", "ucx1s_addressing", "ucx1s_worker",
                                                          "ucx1s_rkeys", "ucx1s_memory", "ucx1s_blocks")
SEALS = "ucx1s_seals"  # "<address>:<slots>" of the producer's seal table
SEAL_RKEY = "ucx1s_seal_rkey"  # the seal table's rkey (hex), where ucp registered it
SEAL_SLOTS = 1 << 16  # words in a producer's seal table (512 KiB); a slot is reused after that many hand-offs
_GRANT = struct.Struct("<d32s32s")  # expires_at, HMAC-SHA256, sha256 of the block ids (and seal) it covers
Seal = tuple[int, int]  # (slot, word): see the module docstring
NO_SEAL: Seal = (-1, 0)


# ---- grants: "my scheduler handed these blocks off", checkable by any of its workers --------------------
def new_key() -> bytes:
    return secrets.token_bytes(32)


def ids_digest(block_ids: Any, seal: Seal = NO_SEAL) -> bytes:
    data = np.asarray(block_ids, dtype="<i8").tobytes()
    if seal != NO_SEAL:
        data += struct.pack("<qQ", *seal)
    return hashlib.sha256(data).digest()


def new_seal(counter: int) -> Seal:
    """The seal of a producer scheduler's ``counter``-th hand-off: its slot, and a random nonzero word."""
    return counter % SEAL_SLOTS, secrets.randbits(63) | 1


def _mac(key: bytes, engine_id: str, request_id: str, expires_at: float, digest: bytes) -> bytes:
    text = f"kvbridge-ucx-grant-1\0{engine_id}\0{request_id}\0{expires_at!r}\0".encode() + digest
    return hmac.new(key, text, hashlib.sha256).digest()


def sign(key: bytes, engine_id: str, request_id: str, expires_at: float, block_ids: Any, seal: Seal = NO_SEAL) -> bytes:
    """The grant a scheduler puts in the transfer params: its expiry, a MAC over (engine, request, expiry,
    block ids, seal) and the digest of those ids and the seal; a consumer sends it back as it got it."""
    digest = ids_digest(block_ids, seal)
    return _GRANT.pack(expires_at, _mac(key, engine_id, request_id, expires_at, digest), digest)


def verify(key: bytes | None, engine_id: str, request_id: str, grant: bytes) -> float | None:
    """The grant's expiry if ``key`` signed it for this request (and its block ids), else ``None``. Block
    ids altered on the way (a proxy, a client) change the digest, so they fail here."""
    if not key or len(grant) != _GRANT.size:
        return None
    expires_at, mac, digest = _GRANT.unpack(grant)
    return expires_at if hmac.compare_digest(_mac(key, engine_id, request_id, expires_at, digest), mac) else None


def grant_covers(grant: bytes, block_ids: Any, seal: Seal = NO_SEAL) -> bool:
    """Whether ``grant`` names exactly these block ids and seal (the consumer checks its params before reading)."""
    return len(grant) == _GRANT.size and _GRANT.unpack(grant)[2] == ids_digest(block_ids, seal)


def encode_ask(request_id: str, grant: bytes) -> bytes:
    return request_id.encode() + b"\0" + grant


def decode_ask(data: bytes) -> tuple[str, bytes]:
    rid, _, grant = data.partition(b"\0")
    return rid.decode(errors="replace"), grant


# ---- the process's native context ----------------------------------------------------------------------
def available() -> tuple[bool, str]:
    """Whether the one-sided lanes can run here: ``cma`` needs :mod:`kvbridge._core`, ``ucp``
    :mod:`kvbridge._ucp`; without either the backend keeps its two-sided path (``auto`` falls back to it,
    which a lane that exists only half could not). ``(False, why)`` otherwise."""
    for mod, why in (native.load_core(), native.load_ucp()):
        if mod is None:
            return False, why
    return True, ""


_CTX: Any = None
_CTX_LOCK = threading.Lock()


# UCX's TCP transport emulates GET with active messages in segments of TCP_TX_SEG_SIZE / TCP_RX_SEG_SIZE
# (8 KiB by default); 64 KiB on both sides (which run this code) cuts sends, receives and progress rounds
# per byte eightfold (`kvbridge bench hosts`; a row with UCX_TCP_TX_SEG_SIZE=8k shows UCX's default).
TCP_CONFIG = {"TCP_TX_SEG_SIZE": "64k", "TCP_RX_SEG_SIZE": "64k"}


def context(tls: str) -> Any:
    """The process-wide native UCX context (with a progress thread: a producer's worker must progress for
    TCP GETs to be served), made on first use; raises :class:`PeerUnreachable` if the module is missing."""
    global _CTX
    mod, why = native.load_ucp()
    if mod is None:
        raise PeerUnreachable(f"one-sided UCX unavailable: {why}")
    with _CTX_LOCK:
        if _CTX is None:
            # the GET gate for device memory (cuda.CONFIG) and TCP's segments (TCP_CONFIG): each set unless
            # the user set UCX_<name> (the user wins)
            _CTX = mod.Context(tls=tls or None, progress_thread=True, config={**cuda.CONFIG, **TCP_CONFIG},
                               optional=(*cuda.OPTIONAL, *TCP_CONFIG))
            # stop its progress thread and free UCX state before the interpreter (and ucxx) goes away
            atexit.register(_close_context)
        return _CTX


def _close_context() -> None:
    global _CTX
    with _CTX_LOCK:
        ctx, _CTX = _CTX, None
    if ctx is not None:
        try:
            ctx.close()
        except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
            log.warning("closing the native UCX context at exit: %s", exc)


def _memory_type(layout: KVLayout) -> str:
    return "cuda" if layout.device_type == "cuda" else "host"


# ---- producer --------------------------------------------------------------------------------------------
class Seals:
    """A producer worker's seal table (the module docstring); aligned 8-byte stores: a reader sees a word whole."""

    def __init__(self) -> None:
        self.words = np.zeros(SEAL_SLOTS, dtype=np.uint64)

    def set(self, seal: Seal) -> None:
        if seal != NO_SEAL:
            self.words[seal[0]] = seal[1]

    def clear(self, seal: Seal) -> None:
        """The hold of ``seal`` ended: its word goes, unless a newer hold has the slot now."""
        if seal != NO_SEAL and int(self.words[seal[0]]) == seal[1]:
            self.words[seal[0]] = 0


class Exporter:
    """A producer worker's KV, registered once for one-sided readers (``cma`` needs no registration)."""

    def __init__(self, layout: KVLayout, tls: str, tcp: tcplane.Settings | None = None):
        self.layout = layout
        self.addressing = layout.addressing()
        self._probe = np.frombuffer(secrets.token_bytes(16), dtype=np.uint8).copy()  # kept alive with self
        self.seals = Seals()
        self._regions: list[Any] = []
        self._seal_region: Any = None
        self._ucp_error = ""
        try:
            ctx = context(tls)
            cuda.check_registration(_memory_type(layout), ctx.config)  # a CUDA KV that could only be emulated
            self._regions = [ctx.map(addr, n, memory_type=_memory_type(layout)) for addr, n in layout.regions()]
            self._seal_region = ctx.map(self.seals.words.ctypes.data, self.seals.words.nbytes, memory_type="host")
            self._worker = bytes(ctx.address)
        except ConfigError:
            raise  # nothing else can serve this KV: the engine's registration fails, saying what to set
        except Exception as exc:  # noqa: BLE001 - cma may still serve; say why ucp cannot
            self._ucp_error = f"{type(exc).__name__}: {exc}"
            log.info("one-sided ucp unavailable on this producer: %s", self._ucp_error)
        self.tcp: tcplane.Server | None = None
        why = tcplane.why_not() if tcp is not None else "not asked for"
        if not why and _memory_type(layout) == "host":  # device memory cannot go to a socket without a copy
            self.tcp = tcplane.Server(list(layout.regions()), (self.seals.words.ctypes.data, self.seals.words.nbytes), tcp)
        elif tcp is not None:
            log.info("tcp lane not served by this producer: %s", why or "its KV is device memory")

    def transport(self) -> dict[str, bytes]:
        """What a granted consumer gets in the handshake answer."""
        out = {
            PID: str(os.getpid()).encode(),
            PROBE: f"{self._probe.ctypes.data}:{self._probe.tobytes().hex()}".encode(),
            ADDRESSING: self.addressing.to_json().encode(),
            MEMORY: _memory_type(self.layout).encode(),
            BLOCKS: str(self.layout.num_blocks).encode(),
            SEALS: f"{self.seals.words.ctypes.data}:{SEAL_SLOTS}".encode(),
        }
        if self._regions:
            out[WORKER] = self._worker
            out[RKEYS] = json.dumps([[r.address, r.length, bytes(r.rkey).hex()] for r in self._regions]).encode()
        if self._seal_region is not None:
            out[SEAL_RKEY] = bytes(self._seal_region.rkey).hex().encode()
        if self.tcp is not None:
            out.update(self.tcp.transport())
        return out

    def close(self) -> None:
        self.seals.words[:] = 0  # a read whose pages a pipe still holds (tcplane) copies its seal word last: 0
        if self.tcp is not None:  # its threads read the KV: they end before the KV can go
            self.tcp.close()
            self.tcp = None
        for region in [*self._regions, *([self._seal_region] if self._seal_region is not None else [])]:
            with contextlib.suppress(ValueError):  # its context closed first (at exit): already unmapped
                region.close()
        self._regions, self._seal_region = [], None


# ---- consumer --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Source:
    """One producer worker as a one-sided reader sees it (from its handshake answer)."""

    lane: str
    addressing: BlockAddressing
    num_blocks: int
    pid: int = 0
    ep: Any = None
    layer_rkey: np.ndarray | None = None  # rkey index per layer (ucp)
    seals: tuple[int, int] = (0, 0)  # (address, slots) of the producer's seal table; (0, 0): none
    seal_rkey: int = -1  # its rkey index (ucp); -1: not registered, the release confirms
    tcp: Any = None  # kvbridge._core.TcpSource (tcp)

    @property
    def medium(self) -> str:  # the lane, and ``tcp-local`` for a tcp lane through pipes (:mod:`.tcplane`)
        return "tcp-local" if self.lane == "tcp" and tcplane.is_local(self.tcp) else self.lane

    def close(self) -> None:
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        if self.ep is not None:
            # its context closed first (at exit), or reads still in flight: it goes with its last reference
            with contextlib.suppress(ValueError, RuntimeError):
                self.ep.close(force=True)
            self.ep = None


def open_source(theirs: PeerInfo, layout: KVLayout, lane: str, tls: str, cut: Cut | None = None,
                tcp: tcplane.Settings | None = None) -> Source | None:
    """The way to read ``theirs`` one-sided under ``lane``, or ``None`` when it did not export its KV
    (an older or two-sided producer: the caller falls back). Raises when ``lane`` names one that fails.
    With ``cut`` (another TP size), the source addresses only those bytes of each block; ``tcp``: its settings."""
    t = theirs.transport
    if ADDRESSING not in t:
        if lane in ("cma", "tcp", "ucp", "ucp-unsafe"):
            raise ProtocolError(f"producer {theirs.engine_id} offers no one-sided access (lane={lane!r})")
        return None
    addressing = BlockAddressing.from_json(t[ADDRESSING])
    if cut is not None:
        addressing = addressing.narrowed(cut.src, cut.length)
        layout.addressing().narrowed(cut.dst, cut.length).check_compatible(addressing)
    else:
        layout.addressing().check_compatible(addressing)
    num_blocks = int(t.get(BLOCKS, b"0"))
    host_kv = t.get(MEMORY, b"host") == b"host" and layout.device_type == "cpu"
    address, _, slots = t.get(SEALS, b"0:0").decode().partition(":")
    seals = (int(address), int(slots or 0))
    pid = int(t.get(PID, b"0"))
    same_host = lane in ("auto", "cma") and host_kv and _probe(pid, t[PROBE])
    if lane == "cma" and host_kv and not same_host:
        raise PeerUnreachable(f"cma cannot read producer {theirs.engine_id} (pid {pid}): other host, "
                              "pid namespace or permission (ptrace scope)")
    tcp_ok = host_kv and tcplane.offered(t)
    if lane == "tcp" and not tcp_ok:
        raise PeerUnreachable(f"producer {theirs.engine_id} offers no tcp lane" if host_kv else "lane 'tcp' moves host-memory KV only")
    ctx = context(tls) if WORKER in t and not same_host and lane != "tcp" else None
    ep = ctx.connect(t[WORKER], error_handling=lane != "ucp-unsafe") if ctx is not None else None
    try:  # auto: the lanes UCX took to the producer decide between ucp and tcp (RDMA stays UCX's)
        chosen = lane if lane != "auto" else lanes.auto(
            "host" if host_kv else "cuda", same_host, None if ep is None else [n for n, _ in ep.transports()], tcp_ok)
        if chosen in ("cma", "tcp") and ep is not None:
            ep.close(force=True)
            ep = None
        if chosen == "cma" and same_host:
            return Source("cma", addressing, num_blocks, pid=pid, seals=seals)
        if chosen == "tcp":
            return Source("tcp", addressing, num_blocks, seals=seals, tcp=tcplane.connect(t, tcp or tcplane.Settings()))
        if ep is None or ctx is None:
            raise PeerUnreachable(f"producer {theirs.engine_id} registered no KV with UCX; no one-sided lane left")
        memory = "cuda" if layout.device_type == "cuda" or t.get(MEMORY, b"host") != b"host" else "host"
        cuda.warn_once(cuda.get_path(memory, ep.transports(), ctx.config), theirs.engine_id)  # never silent
        regions = json.loads(t[RKEYS])
        index = [ep.add_rkey(bytes.fromhex(key)) for _, _, key in regions]
        layer_rkey = np.empty(len(addressing.bases), dtype=np.uint32)
        for i, base in enumerate(addressing.bases):
            hits = [k for k, (addr, n, _) in enumerate(regions) if addr <= base < addr + n]
            if not hits:
                raise LayoutMismatch(f"producer layer {i} lies in no registered region")
            layer_rkey[i] = index[hits[0]]
        seal_rkey = ep.add_rkey(bytes.fromhex(t[SEAL_RKEY].decode())) if SEAL_RKEY in t else -1
    except BaseException:
        if ep is not None:
            ep.close(force=True)
        raise
    return Source("ucp" if lane != "ucp-unsafe" else lane, addressing, num_blocks, ep=ep, layer_rkey=layer_rkey,
                  seals=seals, seal_rkey=int(seal_rkey))  # fmt: skip


def _peek(pid: int, address: int, out: np.ndarray) -> bool:
    """Fill ``out`` from ``address`` in process ``pid`` with one ``process_vm_readv``; ``False`` if it failed."""
    mod, _ = native.load_core()
    assert mod is not None
    try:
        mod.cma_read(pid, np.array([address], dtype=np.uint64), np.array([out.ctypes.data], dtype=np.uint64),
                     np.array([out.nbytes], dtype=np.uint64))
    except OSError as exc:
        log.info("cma read of %d bytes at pid %d failed: %s", out.nbytes, pid, exc)
        return False
    return True


def _probe(pid: int, probe: bytes) -> bool:
    addr, _, nonce = probe.decode().partition(":")
    want = bytes.fromhex(nonce)
    got = np.zeros(len(want), dtype=np.uint8)
    return _peek(pid, int(addr), got) and got.tobytes() == want


def seal_address(src: Source, seal: Seal) -> int:
    """Where ``seal``'s word lies in the producer, or 0 (no table, a slot out of range, no seal: the release confirms)."""
    (address, slots), (slot, word) = src.seals, seal
    return address + 8 * slot if address and 0 <= slot < slots and word else 0


def sealed(src: Source, seal: Seal, timeout_s: float = 1.0) -> bool:
    """Whether the producer's seal table still holds ``seal``'s word (read now, after the data: over cma
    one ``process_vm_readv``, over ucp one 8-byte GET, issued after the data's GETs completed); ``False``
    whenever it cannot tell (no table, a failed read, no time left): then the release must confirm."""
    address = seal_address(src, seal)
    if not address:
        return False
    got = np.zeros(1, dtype=np.uint64)
    if src.lane == "cma":
        return _peek(src.pid, address, got) and int(got[0]) == seal[1]
    if src.lane == "tcp":
        return timeout_s > 0 and tcplane.seal_word(src.tcp, address, timeout_s) == seal[1]
    if src.seal_rkey < 0 or src.ep is None or timeout_s <= 0:
        return False
    one = np.ones(1, dtype=np.uint64)
    try:
        src.ep.get(np.array([address], dtype=np.uint64), np.array([got.ctypes.data], dtype=np.uint64),
                   one * 8, np.array([src.seal_rkey], dtype=np.uint32), timeout_s)  # fmt: skip
    except (TimeoutError, ConnectionError, ValueError) as exc:
        log.info("reading the seal over ucp failed (%s): the release confirms", exc)
        return False
    return int(got[0]) == seal[1]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One load's descriptors, one entry per piece: its address in the producer, its address here, its
    length, and (``ucp``) the index of the rkey that covers it."""

    remote: np.ndarray
    local: np.ndarray
    lengths: np.ndarray
    rkeys: np.ndarray | None = None

    @staticmethod
    def join(parts: list[Batch]) -> Batch:
        """One batch of several (a load's KV-cache groups, each read into its own layers)."""
        if len(parts) == 1:
            return parts[0]
        rkeys = [p.rkeys for p in parts]
        return Batch(np.concatenate([p.remote for p in parts]), np.concatenate([p.local for p in parts]),
                     np.concatenate([p.lengths for p in parts]),
                     None if any(r is None for r in rkeys) else np.concatenate(rkeys))  # type: ignore[arg-type]


def batch(src: Source, layout: KVLayout, mine: BlockAddressing, remote_ids: np.ndarray, local_ids: np.ndarray,
          layers: range | None = None) -> Batch:
    """The descriptors that read blocks ``remote_ids`` of ``src`` into the local blocks ``local_ids``
    (``mine``: ``layout``'s addressing), every layer (or ``layers``: one KV-cache group's). Raises
    before any byte moves on ids outside either KV."""
    layout.check_range(local_ids)
    # only addresses inside the producer's KV: over tcp its UCX serves whatever address it is asked for
    # (a NULL_BLOCK the producer no longer kept fails here too: a group's block it cannot give)
    if len(remote_ids) and (int(remote_ids.min()) < 0 or int(remote_ids.max()) >= src.num_blocks):
        raise ProtocolError(f"remote block ids outside the producer's [0, {src.num_blocks})")
    theirs = src.addressing if layers is None else src.addressing.select(layers)
    mine = mine if layers is None else mine.select(layers)
    remote = theirs.addresses(remote_ids)
    local = mine.addresses(local_ids)
    lengths = mine.lengths(len(local_ids))
    if src.lane in STARTED:
        return Batch(remote, local, lengths)
    assert src.layer_rkey is not None
    layer_rkey = src.layer_rkey if layers is None else src.layer_rkey[layers.start : layers.stop]
    return Batch(remote, local, lengths, np.repeat(layer_rkey, len(remote) // len(theirs.bases)))


def read(src: Source, todo: Batch, timeout_s: float) -> int:
    """Move ``todo`` (see :func:`batch`) in one call, whole by ``timeout_s`` from now however the bytes trickle
    (``cma`` copies memory: nothing waits there); raises on any failure (then nothing counts as loaded)."""
    if timeout_s <= 0:
        raise TransferTimeout("the load's deadline passed before its read could start")
    if src.lane in STARTED:
        try:  # started and waited for: cma runs a read of 8 MiB or more in two pieces at once, tcp in streams
            return int(start(src, todo, NO_SEAL, timeout_s).result()[0])
        except OSError as exc:
            where = f"{src.lane} read" + (f" from pid {src.pid}" if src.lane == "cma" else "")
            raise (TransferTimeout if isinstance(exc, TimeoutError) else PeerUnreachable)(f"{where}: {exc}") from None
    t0 = time.monotonic()
    try:
        return int(src.ep.get(todo.remote, todo.local, todo.lengths, todo.rkeys, timeout_s))
    except TimeoutError:
        raise TransferTimeout(f"one-sided read not done after {time.monotonic() - t0:.1f}s") from None
    except ConnectionError as exc:
        raise PeerUnreachable(f"one-sided read: {exc}") from None


def start(src: Source, todo: Batch, seal: Seal, timeout_s: float | None = None) -> Any:
    """Start ``todo`` on native threads (``cma``, ``tcp``), reading ``seal``'s word after the data: a
    :class:`kvbridge._core.CmaRead` or ``TcpRead`` whose ``result()`` is ``(bytes, word)`` (word 0: no
    seal to read, or streams that disagree) or raises ``OSError`` (``TimeoutError``: a ``tcp`` read not
    over ``timeout_s`` after this call, default its source's). Nothing waits here; see :meth:`Puller.start`."""
    mod, _ = native.load_core()
    assert mod is not None and src.lane in STARTED
    if timeout_s is not None and timeout_s <= 0:  # as read() says it: not the native call's ValueError
        raise TransferTimeout("the load's deadline passed before its read could start")
    _drain_at_exit(mod)
    if src.lane == "tcp":
        return src.tcp.start(todo.remote, todo.local, todo.lengths, seal_address(src, seal), timeout_s)
    return mod.cma_start(src.pid, todo.remote, todo.local, todo.lengths, seal_address=seal_address(src, seal))


@functools.cache
def _drain_at_exit(mod: Any) -> None:
    """Once: at interpreter exit, wait for started reads before the KV they write into can go."""
    atexit.register(mod.drain, 10.0)


__all__ = ["LANES", "NO_SEAL", "STARTED", "SEAL_SLOTS", "Batch", "Exporter", "Seal", "Seals", "Source", "batch", "context",
           "grant_covers", "new_key", "new_seal", "open_source", "read", "seal_address", "sealed", "sign", "start",
           "verify"]
