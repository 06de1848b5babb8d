"""A consumer worker's pulling half (roles ``consumer``/``both``): handshakes, reads or pulls, releases.

Per producer address it handshakes once (cached with the endpoint or the one-sided source). Per load:

- *one-sided* (:mod:`.onesided`): read every block straight into the KV in one batch; the blocks count
  only if the producer's seal table still holds the hand-off's word after the read (then the release goes
  off the load's path) or, failing that, the producer answers the release that it held them throughout
  (all or nothing);
- *two-sided*: post the receives, send the :class:`~.wire.Pull`, receive each chunk into a staging
  buffer — never into the KV, so a late, partial or timed-out chunk never touches a block — scatter it
  (one op per layer); the release follows the load's report.

**Where it runs.** A load from a producer already handshaken on the ``cma`` or ``tcp`` lane starts from the
engine's step itself (:meth:`Puller.start`): a native thread reads the blocks and then the seal word, and the
poll that sees it over counts it — no Python thread between the engine and the read, whose two GIL hand-offs
cost a visible share of a small hand-off (bench case ucx `transfer`, 8 MiB). Everything that waits on the
network (a handshake, a ``ucp`` or two-sided load, the confirming release when no seal is in place, a
failure's clean-up) runs on the worker's IO threads, a few per producer (:mod:`.slots`).

Every wait has a deadline. A load's data — a one-sided read with its seal word, a re-sliced load's reads
from every producer rank, a two-sided pull's status and chunks — must be in by ``timeout_s`` after the
engine started it (a wait for an IO thread or for another load's handshake included), however many bytes
keep arriving meanwhile (a link that trickles fails the load as a dead one does); so must its handshake.
Releases never sit on a load's path: they go to the producer's own lane of the :class:`~.releaser.Releaser` (an aborted one at
once, a finished load's after its report), so a failed load is reported by its deadline however slow the
link that cut it, and a dead producer's releases (retried until the lease ends) never wait in front of
a healthy one's. A dead, unreachable, refusing or too slow producer ends the load with its missing blocks
failed (the engine recomputes them), never a hang. After a failure that may leave stale state, the peer
is dropped and handshaken anew next time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from typing import Any

import numpy as np
from kvbridge.connectors.ucx import onesided, wire
from kvbridge.connectors.ucx import runtime as rtmod
from kvbridge.connectors.ucx.options import LANE_COUNTERS, UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import UcxSource, is_id
from kvbridge.connectors.ucx.releaser import Releaser
from kvbridge.connectors.ucx.staging import StagingPool, bury, chunk, sync

from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import KVBridgeError, PeerUnreachable, ProtocolError, TransferError, TransferTimeout
from kvbridge.layout import BlockAddressing, Cut, KVLayout, LayoutFingerprint, reslice
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.types import PeerInfo
from kvbridge.transfer import Fallback, Started, Transfer

log = logging.getLogger(__name__)

LOAD_THREADS = 4  # loads a consumer worker runs at once per producer address (:mod:`.slots`)


@dataclasses.dataclass
class _Peer:
    """One producer worker, handshaken: its metadata client and either an endpoint or a one-sided source."""

    client: MetadataClient
    info: PeerInfo
    ep: Any = None  # ucxx endpoint (two-sided)
    source: onesided.Source | None = None  # one-sided reads

    def close(self, rt: rtmod.Runtime) -> None:
        if self.ep is not None:
            rt.close_endpoint(self.ep)  # never raises
        if self.source is not None:
            self.source.close()  # nor this: an endpoint with reads in flight goes with its last reference
        self.client.close()


def _wait(fut: concurrent.futures.Future[Any], until: float, what: str, producer: str) -> None:
    """Wait for one posted receive until ``until`` (``time.monotonic()``); any failure, a kvbridge error."""
    try:
        fut.result(max(0.0, until - time.monotonic()))
    except concurrent.futures.TimeoutError:
        raise TransferTimeout(f"{what} from {producer} not in by the load's deadline (timeout_s)") from None
    except rtmod.ucx.exceptions.UCXMessageTruncatedError:  # more bytes than asked: never scattered
        raise ProtocolError(f"{what} from {producer} is larger than its blocks") from None
    except rtmod.ucx.exceptions.UCXError as exc:
        raise PeerUnreachable(f"{what} from {producer}: {exc}") from None


class Puller:
    """A consumer worker's pulling half: handshakes (cached per producer address), pulls, releases."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, layout: KVLayout, rt: rtmod.Runtime, stats: UcxStats):
        self.options, self.engine, self.layout, self.rt, self.stats = options, engine, layout, rt, stats
        self.info = PeerInfo(engine.engine_id, engine.rank, layout.fingerprint, {wire.WORKER_ADDRESS: rt.worker_address})
        self.addressing = layout.addressing()  # where our blocks live, for one-sided reads into them
        self._peers: dict[str, _Peer] = {}
        self._staging = StagingPool(layout, LOAD_THREADS * options.max_inflight)
        self._peer_locks: collections.defaultdict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._refused: dict[str, tuple[float, str]] = {}  # address -> when and why its last handshake failed
        self._lock = threading.Lock()
        self._releaser = Releaser(options, engine.engine_id)  # every release: one lane per producer
        self._reported: list[tuple[str, UcxSource]] = []  # loads whose release waits for their report

    # ---- peers ----
    def _address(self, src: UcxSource) -> str:
        if len(src.metadata_addresses) > self.engine.rank:
            return src.metadata_addresses[self.engine.rank]
        if self.engine.rank == 0:
            return src.metadata_address
        raise ProtocolError(f"the producer published no metadata address for rank {self.engine.rank}")

    def producer(self, op: BlockLoad | BlockSave) -> str:
        """The producer address ``op`` loads from (every rank's for a re-sliced load; ``""``: none), whose
        IO threads run it (:mod:`.slots`)."""
        src = op.source if isinstance(op, BlockLoad) else None
        if not isinstance(src, UcxSource):
            return ""
        try:
            return ",".join(dict.fromkeys(src.addresses)) if src.resliced(self.engine.world_size) else self._address(src)
        except ProtocolError:
            return ""

    def _peer(self, address: str, src: UcxSource, until: float,
              resliced: tuple[LayoutFingerprint, Cut] | None = None) -> _Peer:
        """The handshaken peer at ``address``, handshaking (by the load's deadline ``until``) if none is."""
        with self._lock:
            lock = self._peer_locks[address]
        asked = time.monotonic()
        if not lock.acquire(timeout=max(0.0, until - asked)):  # one handshake per producer, loads wait for it
            raise TransferTimeout(f"the load's deadline passed while another load handshook with {address}")
        try:
            with self._lock:
                peer = self._peers.get(address)
            if peer is not None:
                return peer
            when, why = self._refused.get(address, (0.0, ""))
            if when > asked:  # the handshake this load waited for failed: so does the load, not one deadline later
                raise PeerUnreachable(f"the handshake with {address} failed meanwhile: {why}")
            try_s, budget = self.options.timeout_s / 2, until - time.monotonic()
            client = MetadataClient(address, token=self.options.token, timeout=try_s, retries=1)
            try:
                peer = self._handshake(client, src, resliced, until)
            except BaseException as exc:
                client.close()
                if not isinstance(exc, TransferTimeout) or budget >= try_s:  # not just this load's time running out
                    self._refused[address] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
                raise
            self._refused.pop(address, None)
            with self._lock:
                self._peers[address] = peer
            if peer.source is not None:  # its sealed reads' releases go through the releaser
                self._releaser.prepare(address)
            return peer
        finally:
            lock.release()

    def _handshake(self, client: MetadataClient, src: UcxSource, resliced: tuple[LayoutFingerprint, Cut] | None,
                   until: float) -> _Peer:
        lane = self.options.lane
        mod, why = onesided.available() if lane != "two-sided" else (False, "lane='two-sided'")
        if not mod and lane != "auto" and lane != "two-sided":
            raise PeerUnreachable(f"lane={lane!r} needs the native module: {why}")
        if resliced is not None:  # another TP size: we ask for blocks of the layout its ranks must have
            if not mod:
                raise PeerUnreachable(f"re-slicing KV across TP sizes needs a one-sided lane: {why}")
            theirs_fp, cut = resliced
            ask = onesided.encode_ask(src.remote_request_id, src.grant)
            theirs = client.handshake(PeerInfo(self.info.engine_id, self.info.rank, theirs_fp, {onesided.ASK: ask}), until)
            source = onesided.open_source(theirs, self.layout, lane, self.options.ucx_tls, cut, self.options.tcp)
            if source is None:
                raise ProtocolError(f"producer {theirs.engine_id} offers no one-sided access, which re-slicing needs")
            return _Peer(client, theirs, source=source)
        if mod:  # ask for one-sided access, naming the hand-off that entitles us to it
            ask = onesided.encode_ask(src.remote_request_id, src.grant)
            theirs = client.handshake(dataclasses.replace(self.info, transport={onesided.ASK: ask}), until)
            source = onesided.open_source(theirs, self.layout, lane, self.options.ucx_tls, tcp=self.options.tcp)
            if source is not None:
                return _Peer(client, theirs, source=source)
        theirs = client.handshake(self.info, until)
        ep = self.rt.call(self.rt.connect(theirs.transport[wire.WORKER_ADDRESS]), max(0.01, until - time.monotonic()))
        return _Peer(client, theirs, ep=ep)

    def _drop(self, address: str, peer: _Peer) -> None:
        """Forget ``peer`` (failed, or its producer restarted): the next load handshakes anew. Never waits for
        a handshake under way: a failed load is reported by its deadline (test_hosts_slots.py)."""
        with self._lock:
            mine = self._peers.get(address) is peer
            if mine:
                del self._peers[address]
        if mine:  # the first of its failed loads closes it
            peer.close(self.rt)

    # ---- a load ----
    def load(self, op: BlockLoad, until: float = 0.0) -> set[int]:
        """Pull ``op`` by ``until`` (``time.monotonic()``; default ``timeout_s`` from now: a load queued for an IO
        thread counts its deadline from when the engine started it); the local block ids that did not arrive.
        Never raises."""
        src, until = op.source, until or time.monotonic() + self.options.timeout_s
        if not isinstance(src, UcxSource):  # not a plan of a ucx scheduler: nothing to pull from
            log.error("%s: load of %s names no ucx source (%r)", self.engine.engine_id, op.request_id, type(src).__name__)
            return set(op.block_ids)
        if src.resliced(self.engine.world_size):
            return self._read_resliced(op, src, until)
        address = ""
        try:
            if time.monotonic() >= until:  # it waited for an IO thread that long: no handshake, no read
                raise TransferTimeout("the load's deadline passed while it waited for an IO thread")
            address = self._address(src)
            peer = self._peer(address, src, until)
        except Exception as exc:  # noqa: BLE001 - every failure is a failed block, recomputed by the engine
            self._log_failure(op, src, 0, exc)
            self._release(address, src, ok=False)  # no address: nobody to release to
            return set(op.block_ids)
        return (self._read if peer.source is not None else self._pull_two_sided)(address, peer, op, src, until)

    def _log_failure(self, op: BlockLoad, src: UcxSource, arrived: int, exc: Exception) -> None:
        known = isinstance(exc, KVBridgeError)
        log.log(logging.WARNING if known else logging.ERROR, "%s: pull of %s from %s failed after %d of %d blocks: %s: %s",
                self.engine.engine_id, op.request_id, src.engine_id, arrived, len(op.block_ids), type(exc).__name__, exc,
                exc_info=not known)

    def _release(self, address: str, src: UcxSource, *, ok: bool) -> None:
        """Tell the producer we are done (``aborted`` unless ``ok``), off the load's path (the module docstring):
        an aborted release now, a finished pull's once the engine has taken its report (:meth:`release_reported`)."""
        if not address or not src.remote_request_id:  # no address: nobody to release to
            return
        if ok:
            with self._lock:
                self._reported.append((address, src))
        else:
            self._releaser.release((address,), src, aborted=True)

    # ---- one-sided ----
    def start(self, op: BlockLoad) -> Transfer | None:
        """Start ``op`` at once on native threads when it can run there: a producer already handshaken
        on the ``cma`` or ``tcp`` lane, the same TP size. Returns its handle: once the read is over, the thread that
        polls counts the blocks if the seal proves them; else what is left — the confirming round trip, a
        failed read's clean-up — runs on an IO thread (a :class:`~kvbridge.transfer.Fallback`). ``None``:
        load it the usual way (:meth:`load`), which also reports whatever made this one not start."""
        src = op.source
        if not isinstance(src, UcxSource) or src.resliced(self.engine.world_size):
            return None
        try:
            address = self._address(src)
            with self._lock:
                peer = self._peers.get(address)
            if peer is None or peer.source is None or peer.source.lane not in onesided.STARTED:
                return None
            t0, until = time.perf_counter(), time.monotonic() + self.options.timeout_s
            running = onesided.start(peer.source, self._batch(peer.source, op, src), src.seal)
        except Exception:  # noqa: BLE001 - the usual path meets the same failure and reports it
            return None
        self.stats.add(started_loads=1)
        read = Started(op, running, functools.partial(self._started_sealed, address, peer.source.medium, op, src, running, t0))
        return Fallback(read, functools.partial(self._started_rest, address, peer, op, src, t0, until))

    def _started_sealed(self, address: str, lane: str, op: BlockLoad, src: UcxSource, running: Any, t0: float) -> set[int]:
        """A started read is over (on the thread that polls): its blocks count if the seal word read after it
        is the hand-off's; else none counts yet (:meth:`_started_rest` settles it). Raises if the read failed."""
        _, word = running.result()
        if word and word == src.seal[1]:
            return self._sealed_read(address, lane, op, src, t0)
        return set(op.block_ids)

    def _started_rest(self, address: str, peer: _Peer, op: BlockLoad, src: UcxSource, t0: float, until: float,
                      read: Transfer) -> set[int]:
        """On an IO thread, for a started read the seal did not prove: a failed read's clean-up, or the producer's
        confirmation that it held the blocks throughout."""
        if read.error is not None:
            lane = peer.source.lane if peer.source is not None else "one-sided"
            return self._read_failed(address, op, src, peer, PeerUnreachable(f"{lane} read: {read.error}"))
        return self._confirm(address, peer, op, src, t0, until)

    def _read(self, address: str, peer: _Peer, op: BlockLoad, src: UcxSource, until: float) -> set[int]:
        """One-sided: read every block straight into the KV by ``until`` (the data and the seal word, however
        they trickle), then count them only if the producer confirms it held them throughout (see
        :mod:`kvbridge.connectors.ucx.onesided`). All or nothing."""
        assert peer.source is not None
        t0, timeout, word = time.perf_counter(), until - time.monotonic(), -1
        try:  # onesided.read and .start refuse a deadline already past (TransferTimeout)
            if peer.source.lane == "tcp":  # the seal word comes back with the data: no second request
                batch = self._batch(peer.source, op, src)
                word = int(onesided.start(peer.source, batch, src.seal, timeout).result()[1])
            else:
                self._read_blocks(peer.source, op, src, timeout_s=timeout)
        except Exception as exc:  # noqa: BLE001 - nothing counts; the producer frees its blocks
            return self._read_failed(address, op, src, peer, exc)
        if (word == src.seal[1] != 0) or (word < 0 and onesided.sealed(peer.source, src.seal, until - time.monotonic())):
            return self._sealed_read(address, peer.source.medium, op, src, t0)
        return self._confirm(address, peer, op, src, t0, until)

    def _sealed_read(self, address: str, lane: str, op: BlockLoad, src: UcxSource, t0: float) -> set[int]:
        """The seal says the producer held the blocks throughout (read over ``lane``): they count now, and
        the release goes out once the engine has taken the report (:meth:`release_reported`)."""
        self._count(op, t0, sealed=True, lane=lane)
        self._release(address, src, ok=True)
        return set()

    def _read_failed(self, address: str, op: BlockLoad, src: UcxSource, peer: _Peer, exc: Exception) -> set[int]:
        lane = peer.source.lane if peer.source is not None else "?"
        log.warning("%s: one-sided read of %s from %s (%s) failed: %s: %s", self.engine.engine_id, op.request_id,
                    src.engine_id, lane, type(exc).__name__, exc)
        self._drop(address, peer)  # a dead or restarted producer: handshake anew next time
        self._release(address, src, ok=False)
        return set(op.block_ids)

    def _confirm(self, address: str, peer: _Peer, op: BlockLoad, src: UcxSource, t0: float, until: float) -> set[int]:
        """No seal to count on: the release, answered by the load's deadline ``until``, says whether the
        producer held the blocks throughout. Unanswered, nothing counts and an aborted release follows on
        the releaser (the producer may never have seen this one)."""
        rid, held = src.remote_request_id, False
        try:
            held = peer.client.release(self.engine.engine_id, rid, aborted=False, grant=src.grant, until=until)
        except KVBridgeError as exc:
            log.warning("%s: producer %s did not confirm %s after the read: %s", self.engine.engine_id,
                        src.engine_id, rid, exc)
            self._drop(address, peer)
            self._release(address, src, ok=False)
        if not held:
            log.warning("%s: producer %s no longer held %s when the read ended: %d blocks not counted",
                        self.engine.engine_id, src.engine_id, rid, len(op.block_ids))
            return set(op.block_ids)
        self._count(op, t0, sealed=False, lane=peer.source.medium if peer.source is not None else "")
        return set()

    def _read_resliced(self, op: BlockLoad, src: UcxSource, until: float) -> set[int]:
        """Another TP size on the producer: read this rank's heads out of every producer rank holding some
        (:func:`~kvbridge.layout.reslice`), one-sided. The bytes count only if each of those ranks still
        holds the hand-off after the read (its seal, else it confirms without releasing); no release here,
        since other ranks of ours may be reading the same producer rank: the scheduler releases every
        producer rank once all of ours report."""
        t0, sealed, lane = time.perf_counter(), True, ""  # one deadline, until, for the reads from every rank
        try:
            theirs, cuts = reslice(self.layout.fingerprint, self.engine.rank, self.engine.world_size, src.ranks)
            for q, cut in cuts.items():
                address = src.addresses[q]
                peer = self._peer(address, src, until, (theirs, cut))
                assert peer.source is not None
                lane = peer.source.medium
                try:
                    self._read_blocks(peer.source, op, src, self.addressing.narrowed(cut.dst, cut.length),
                                      until - time.monotonic())
                except BaseException:
                    self._drop(address, peer)  # a dead or restarted producer: handshake anew next time
                    raise
                if onesided.sealed(peer.source, src.seal, until - time.monotonic()):
                    continue
                sealed = False
                if not peer.client.confirm(self.engine.engine_id, src.remote_request_id, grant=src.grant, until=until):
                    raise ProtocolError(f"producer rank {q} no longer held the hand-off when the read ended")
        except Exception as exc:  # noqa: BLE001 - nothing counts; the engine recomputes every block
            log.warning("%s: re-sliced read of %s from %s (tp=%d to tp=%d) failed: %s: %s", self.engine.engine_id,
                        op.request_id, src.engine_id, src.ranks, self.engine.world_size,
                        type(exc).__name__, exc)
            return set(op.block_ids)
        self._count(op, t0, sealed=sealed, lane=lane)
        self.stats.add(resliced_loads=1)
        return set()

    def _count(self, op: BlockLoad, t0: float, *, sealed: bool, lane: str) -> None:
        sizes = op.source.group_sizes if isinstance(op.source, UcxSource) else ()
        layers = (sum(n * len(g) for n, g in zip(sizes, self.layout.groups)) if sizes
                  else len(op.block_ids) * self.layout.num_layers)  # each group's ids move its own layers
        nbytes = layers * self.layout.block_bytes
        self.stats.add(load_bytes=nbytes, load_blocks=len(op.block_ids), load_seconds=time.perf_counter() - t0,
                       sealed_loads=int(sealed), **{LANE_COUNTERS.get(lane, "lane_ucp_loads"): 1})

    def _read_blocks(self, source: onesided.Source, op: BlockLoad, src: UcxSource, mine: BlockAddressing | None = None,
                     timeout_s: float | None = None) -> None:
        """The read itself, after the checks that make it safe to start, whole within ``timeout_s`` (default:
        the option); raises on any failure."""
        onesided.read(source, self._batch(source, op, src, mine), self.options.timeout_s if timeout_s is None else timeout_s)

    def _batch(self, source: onesided.Source, op: BlockLoad, src: UcxSource, mine: BlockAddressing | None = None) -> onesided.Batch:
        """``op``'s descriptors, once the checks that make the read safe to start passed (raises if not)."""
        rid, mine = src.remote_request_id, mine or self.addressing
        remote = np.asarray(src.remote_block_ids, dtype=np.int64)
        if len(remote) != len(op.block_ids):
            raise ProtocolError(f"{len(op.block_ids)} local blocks for {len(remote)} remote ones")
        if not src.grant:  # without one the producer could confirm blocks it never handed off for this request
            raise ProtocolError(f"transfer params of {rid} carry no grant: a one-sided read needs one")
        if src.expires_at < time.time():
            raise ProtocolError(f"the lease of {rid} at {src.engine_id} is over")
        local = np.asarray(op.block_ids, dtype=np.int64)
        if not src.group_sizes:
            return onesided.batch(source, self.layout, mine, remote, local)
        if len(src.group_sizes) != len(self.layout.groups):
            raise ProtocolError(f"a load of {len(src.group_sizes)} KV-cache groups; this engine has {len(self.layout.groups)}")
        at = np.cumsum([0, *src.group_sizes])
        parts = [onesided.batch(source, self.layout, mine, remote[a:b], local[a:b], layers)  # each group's own layers
                 for layers, a, b in zip(self.layout.groups, at, at[1:]) if b > a]
        return onesided.Batch.join(parts) if parts else onesided.batch(source, self.layout, mine, remote, local)

    # ---- two-sided ----
    def _pull_two_sided(self, address: str, peer: _Peer, op: BlockLoad, src: UcxSource, until: float) -> set[int]:
        arrived = [0]  # blocks (from the first) in place so far, also when the pull fails midway
        try:
            self._pull(peer, op, src, arrived, until)
        except Exception as exc:  # noqa: BLE001 - every failure is a failed block, recomputed by the engine
            self._log_failure(op, src, arrived[0], exc)
            if isinstance(exc, TransferError):
                self._drop(address, peer)  # a timed-out endpoint may hold stale state: handshake anew next time
        finally:
            self._release(address, src, ok=arrived[0] == len(op.block_ids))
        return set(op.block_ids[arrived[0]:])

    def _remote_ids(self, op: BlockLoad, src: UcxSource) -> np.ndarray:
        """The producer's block ids of ``op``, checked against what the wire can carry."""
        remote = np.asarray(src.remote_block_ids, dtype=np.int64)
        if len(remote) != len(op.block_ids):
            raise ProtocolError(f"{len(op.block_ids)} local blocks for {len(remote)} remote ones")
        if len(remote) > wire.MAX_PULL_IDS:
            raise ProtocolError(f"{len(remote)} blocks in one pull; at most {wire.MAX_PULL_IDS}")
        if len(remote) and (int(remote.min()) < 0 or int(remote.max()) > wire.MAX_BLOCK_ID):
            raise ProtocolError("remote block ids outside [0, 2**31)")
        if not is_id(self.engine.engine_id) or not is_id(src.remote_request_id):
            raise ProtocolError(f"engine and request ids must be 1 to {wire.MAX_ID_BYTES} bytes of utf-8")
        return remote

    def _pull(self, peer: _Peer, op: BlockLoad, src: UcxSource, arrived: list[int], until: float) -> None:
        """Receive and scatter every chunk by ``until`` (status and every chunk, however they trickle in),
        counting the blocks in place in ``arrived[0]``."""
        layout, timeout = self.layout, until - time.monotonic()
        if timeout <= 0:
            raise TransferTimeout("the load's deadline passed before its pull could start")
        if src.group_sizes:
            raise ProtocolError("blocks of several KV-cache groups move one-sided only (the two-sided lane "
                                "sends whole blocks of every layer)")
        remote = self._remote_ids(op, src)
        per = max(1, self.options.chunk_bytes // (layout.num_layers * layout.block_bytes))
        per = max(per, -(-len(remote) // (rtmod.MAX_CHUNKS - 1)))
        n_chunks = -(-len(remote) // per)
        serial = self.rt.next_serial()
        ep, t0 = peer.ep, time.perf_counter()
        status = np.zeros(wire.STATUS_BYTES, dtype=np.uint8)
        bufs = [self._staging.take(min(per, len(remote))) for _ in range(min(self.options.max_inflight, n_chunks))]
        futures: dict[int, concurrent.futures.Future[Any]] = {}

        def post(i: int) -> None:  # chunk i (0-based) into its staging buffer
            view = chunk(bufs[i % len(bufs)], layout, min(per, len(remote) - i * per))
            futures[i] = self.rt.submit(ep.recv(rtmod.as_buffer(view), tag=rtmod.reply_tag(serial, i + 1), force_tag=True))

        status_fut = self.rt.submit(ep.recv(status, tag=rtmod.reply_tag(serial, 0), force_tag=True))
        try:
            for i in range(len(bufs)):
                post(i)
            pull = wire.Pull(self.engine.engine_id, self.engine.rank, src.remote_request_id, remote, per, serial,
                             src.expires_at or time.time() + timeout)
            tag = int.from_bytes(peer.info.transport[wire.CONTROL_TAG], "little")
            try:
                self.rt.call(ep.send(np.frombuffer(pull.encode(), dtype=np.uint8), tag=tag, force_tag=True), timeout)
            except rtmod.ucx.exceptions.UCXError as exc:  # e.g. the producer died since the handshake
                raise PeerUnreachable(f"pull to {src.engine_id}: {exc}") from None
            _wait(status_fut, until, "status", src.engine_id)
            wire.check_status(status, src.engine_id, n_chunks, layout.num_layers * layout.block_bytes, len(remote))
            for i in range(n_chunks):
                _wait(futures.pop(i), until, f"chunk {i + 1}/{n_chunks}", src.engine_id)
                n = min(per, len(remote) - i * per)
                view = chunk(bufs[i % len(bufs)], layout, n)
                layout.scatter(op.block_ids[arrived[0]:arrived[0] + n], view)
                sync(view)
                arrived[0] += n
                if i + len(bufs) < n_chunks:
                    post(i + len(bufs))
        finally:
            pending = [f for f in (status_fut, *futures.values()) if not f.done()]
            for f in pending:
                f.cancel()  # cancels the UCX receive, which then writes nothing more
            if pending:
                bury(bufs)
            else:
                self._staging.give(bufs)
            nbytes = arrived[0] * layout.num_layers * layout.block_bytes
            self.stats.add(load_bytes=nbytes, load_blocks=arrived[0], load_seconds=time.perf_counter() - t0,
                           lane_two_sided_loads=int(arrived[0] > 0))

    def release_reported(self) -> None:
        """Queue the releases of sealed reads and finished two-sided pulls once the engine took their loads' report
        (the worker calls this after its poll): queued from the read itself, the releaser's thread woke and took
        the GIL just as the engine thread needed it to see the load done (bench case ucx `transfer`, 8 MiB)."""
        with self._lock:
            done, self._reported = self._reported, []
        for address, src in done:
            self._releaser.release((address,), src, aborted=False)

    def close(self) -> None:
        self.release_reported()  # a load never reported still frees its producer's blocks
        self._releaser.close()  # the releases still queued
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close(self.rt)


__all__ = ["LOAD_THREADS", "Puller"]
