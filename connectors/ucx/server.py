"""A producer worker's serving half (roles ``producer``/``both``): metadata server, UCX control loop, holds.

- *Handshake* (gRPC): refuses a consumer whose layout fingerprint differs (:class:`LayoutMismatch`). A
  consumer that names a hand-off with a valid grant gets one-sided access (:mod:`.onesided`: addresses,
  pid, rkeys); otherwise the producer makes a UCX endpoint to the consumer's worker address
  (``transport["ucx_worker_address"]``) and answers with its own, for two-sided pulls.
- *Pull* (two-sided, a :class:`~.wire.Pull` on the producer's control tag): the producer checks the
  request is still held, answers a status, then gathers the blocks chunk by chunk (``chunk_bytes``,
  ``max_inflight`` chunks in flight) and sends each as one message — whole chunks, never a message per block.
- *Release* (gRPC): the request is reported in ``finished_saving`` and its blocks freed; so is a request
  whose lease (``lease_s``) expires first (counted in ``stats.expired_leases``) — but never while a pull
  of it is still being served (a pull has a deadline, so that ends). The worker learns the held
  requests from ``StepPlan.extra["ucx"]`` (:class:`~.params.UcxPlan`); a release that arrives before the
  plan is remembered. A pull is served whole within ``timeout_s`` of its arrival (status and every
  chunk), or dropped: its consumer has given up by then.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from kvbridge.connectors.ucx import addresses, onesided, wire
from kvbridge.connectors.ucx import runtime as rtmod
from kvbridge.connectors.ucx.options import UcxOptions, UcxStats
from kvbridge.connectors.ucx.params import UcxPlan
from kvbridge.connectors.ucx.staging import StagingPool, bury, chunk, sync

from kvbridge.contract import EngineInfo
from kvbridge.errors import ProtocolError
from kvbridge.layout import KVLayout
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import PeerInfo

log = logging.getLogger(__name__)

HOLD_GRACE_S = 5.0  # how long a two-sided pull waits for the producer's engine to report the request held
_MAX_CHUNK_BYTES = 1 << 30  # what a producer gathers per chunk at most, whatever a consumer asks
_SERVES = 4  # pulls a producer worker serves at once; others queue


class Server:
    """A producer worker's serving half: metadata server, UCX control loop, held requests."""

    def __init__(self, options: UcxOptions, engine: EngineInfo, layout: KVLayout, rt: rtmod.Runtime, stats: UcxStats):
        self.options, self.engine, self.layout, self.rt, self.stats = options, engine, layout, rt, stats
        self.tag = rtmod.control_tag(engine.engine_id, engine.rank)
        self.info = PeerInfo(engine.engine_id, engine.rank, layout.fingerprint,
                             {wire.WORKER_ADDRESS: rt.worker_address, wire.CONTROL_TAG: self.tag.to_bytes(8, "little")})
        self._lock = threading.Lock()
        self._consumers: dict[tuple[str, int], Any] = {}  # (engine id, rank) -> UCX endpoint
        self._holds: dict[str, tuple[frozenset[int], float, onesided.Seal]] = {}  # blocks, lease end, seal
        # released or expired -> already reported in finished_saving (False: released before the engine
        # told us it held the request, and not provably handed off; reported when the plan names it)
        self._done: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._grant_key: bytes | None = None  # from the scheduler's plans
        self.exporter = self._export(layout)
        self._finished: set[str] = set()  # to report in finished_saving
        self._in_service: collections.Counter[str] = collections.Counter()  # request id -> pulls of it being served
        self._control_buf = np.empty(wire.CONTROL_BYTES, dtype=np.uint8)
        self._staging = StagingPool(layout, _SERVES * options.max_inflight)
        port = options.metadata_port + engine.rank if options.metadata_port else 0
        host = options.advertised_host  # derived, or ConfigError naming advertise_host: at start-up, not per load
        self.server = MetadataServer(f"{options.listen_host or host}:{port}", token=options.token,
                                     on_handshake=self._handshake, on_release=self._release,
                                     on_confirm=self._confirm, directory=False)
        port = self.server.start()
        self.address = f"{host}:{port}"
        self._serving = rt.submit(self._control_loop())
        addresses.publish(options, engine.engine_id, engine.rank, self.address)

    def _export(self, layout: KVLayout) -> onesided.Exporter | None:
        if self.options.lane == "two-sided":
            return None
        ok, why = onesided.available()
        if not ok:
            log.info("%s: one-sided reads unavailable (%s); serving two-sided pulls only", self.engine.engine_id, why)
            return None
        tcp = None
        if self.options.lane in ("auto", "tcp"):  # served where consumers dial this worker's metadata server
            host = self.options.advertised_host
            port = self.options.tcp_port + self.engine.rank if self.options.tcp_port else 0
            tcp = dataclasses.replace(self.options.tcp, host=self.options.listen_host or host, advertise=host, port=port)
        return onesided.Exporter(layout, self.options.ucx_tls, tcp)

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
        address = peer.transport.get(wire.WORKER_ADDRESS)
        if not address:
            raise ProtocolError(f"consumer {peer.engine_id} sent no {wire.WORKER_ADDRESS}")
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
                self._unseal(known[2])  # before the engine hears of it, so before it frees the blocks
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

    def _confirm(self, engine_id: str, request_id: str, grant: bytes) -> bool:
        """Whether the request is held now, as :meth:`_release` would answer, changing nothing. Held now
        means held since the hand-off: a hold that ended never comes back."""
        with self._lock:
            expires = onesided.verify(self._grant_key, self.engine.engine_id, request_id, grant)
            known = self._holds.get(request_id)
            if known is not None and expires is None:
                expires = known[1]
            held = expires is not None and request_id not in self._done and time.time() <= expires
        if not held:
            log.info("%s: %s asked by %s is not held", self.engine.engine_id, request_id, engine_id)
        return held

    def _mark_done(self, request_id: str, *, reported: bool) -> None:
        self._done[request_id] = reported
        while len(self._done) > 65536:
            self._done.popitem(last=False)

    # ---- engine steps ----
    def hold(self, plan: UcxPlan) -> None:
        """The scheduler's word this step: its grant key, and the requests it now holds for consumers."""
        with self._lock:
            self._grant_key = plan.grant_key
            for h in plan.holds:
                reported = self._done.get(h.request_id)
                if reported is False:  # released before the plan told us it was held: report it now
                    self._finished.add(h.request_id)
                    self._done[h.request_id] = True
                elif reported is None:
                    self._holds[h.request_id] = (frozenset(h.block_ids), float(h.expires_at), h.seal)
                    if self.exporter is not None:
                        self.exporter.seals.set(h.seal)

    def _unseal(self, seal: onesided.Seal) -> None:
        if self.exporter is not None:
            self.exporter.seals.clear(seal)

    def take_finished(self) -> set[str]:
        """Requests released or expired since the last call: the engine may free their blocks."""
        now = time.time()
        with self._lock:
            # a lease does not expire under a pull still gathering from its blocks (each send has a deadline)
            expired = [rid for rid, (_, exp, _) in self._holds.items() if exp < now and not self._in_service[rid]]
            for rid in expired:
                self._unseal(self._holds.pop(rid)[2])
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
                pull = wire.Pull.decode(memoryview(buf.tobytes()))  # a copy: the buffer takes the next message now
            except wire.Stop:
                return
            except (ProtocolError, UnicodeDecodeError, ValueError) as exc:
                log.warning("%s: dropped a malformed pull: %s", self.engine.engine_id, exc)
                continue
            until = time.monotonic() + self.options.timeout_s  # the whole pull, from its arrival
            asyncio.get_running_loop().create_task(self._serve_guarded(pull, slots, until))

    async def _serve_guarded(self, pull: wire.Pull, slots: asyncio.Semaphore, until: float) -> None:
        async with slots:
            if time.monotonic() >= until:  # queued behind other pulls past its deadline: its consumer gave up
                log.info("%s: dropped a pull of %s that waited past its deadline", self.engine.engine_id, pull.request_id)
                return
            with self._lock:
                self._in_service[pull.request_id] += 1
            try:
                await self._serve(pull, until)
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

    async def _await_hold(self, pull: wire.Pull, until: float) -> None:
        # The engine tells this worker what it holds in the step after the request finished; a quick
        # consumer can pull before that step ran. Wait a little for it rather than serve blocks that
        # nobody holds (they may already belong to another request).
        deadline = min(until, time.monotonic() + HOLD_GRACE_S)
        while time.monotonic() < deadline:
            with self._lock:
                if pull.request_id in self._holds or pull.request_id in self._done:
                    return
            await asyncio.sleep(0.005)

    def _refusal(self, pull: wire.Pull) -> str:
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

    async def _serve(self, pull: wire.Pull, until: float) -> None:
        """Answer one pull: a status (a refusal ends it there), then every chunk, all of it by ``until``
        (``time.monotonic()``: ``timeout_s`` after the pull arrived) however the link trickles — the
        consumer gives up by then, and a lease never ends under a pull being served."""
        with self._lock:
            ep = self._consumers.get((pull.engine_id, pull.rank))
        if ep is None:
            raise ProtocolError(f"pull from {pull.engine_id}/{pull.rank} without a handshake")
        layout = self.layout
        block_bytes = layout.num_layers * layout.block_bytes  # the real size, whatever the handshake said
        per = max(1, min(pull.blocks_per_chunk, _MAX_CHUNK_BYTES // block_bytes))
        n_chunks = -(-len(pull.block_ids) // per)
        await self._await_hold(pull, until)
        refusal = self._refusal(pull) or ("too many chunks" if n_chunks > rtmod.MAX_CHUNKS - 1 else "")
        status = wire.status(wire.REFUSED if refusal else wire.OK, n_chunks, refusal, block_bytes,
                             block_bytes * len(pull.block_ids))
        await asyncio.wait_for(ep.send(status, tag=rtmod.reply_tag(pull.serial, 0), force_tag=True), _left(until))
        if refusal:
            self.stats.add(refused_pulls=1)
            log.info("%s: refused a pull of %s: %s", self.engine.engine_id, pull.request_id, refusal)
            return
        await self._send_chunks(ep, pull, per, n_chunks, until)
        self.stats.add(served_pulls=1, served_bytes=len(pull.block_ids) * block_bytes)

    async def _send_chunks(self, ep: Any, pull: wire.Pull, per: int, n_chunks: int, until: float) -> None:
        """Gather chunk after chunk (off the loop) into at most ``max_inflight`` buffers, each sent as it is
        ready; every wait ends by ``until``."""
        layout, loop = self.layout, asyncio.get_running_loop()
        free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        bufs = [self._staging.take(min(per, len(pull.block_ids))) for _ in range(min(self.options.max_inflight, n_chunks))]
        for buf in bufs:
            free.put_nowait(buf)
        sends: list[asyncio.Task[None]] = []

        async def send(buf: torch.Tensor, view: torch.Tensor, index: int) -> None:
            try:
                await asyncio.wait_for(ep.send(rtmod.as_buffer(view), tag=rtmod.reply_tag(pull.serial, index), force_tag=True),
                                       _left(until))
            finally:
                free.put_nowait(buf)

        def gather(ids: np.ndarray, view: torch.Tensor) -> None:
            layout.gather(ids, out=view)
            sync(view)

        try:
            for i in range(n_chunks):
                buf = await asyncio.wait_for(free.get(), _left(until))
                for task in sends:  # a send that failed (its deadline) ends the pull
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                ids = pull.block_ids[i * per:(i + 1) * per]
                view = chunk(buf, layout, len(ids))
                await loop.run_in_executor(self.rt.copies, gather, ids, view)
                if time.monotonic() >= until:  # the gather took the rest: the consumer no longer waits
                    raise TimeoutError(f"pull of {pull.request_id} not served by its deadline (timeout_s)")
                sends.append(loop.create_task(send(buf, view, i + 1)))
            await asyncio.wait_for(asyncio.gather(*sends), _left(until))
        except BaseException:
            bury(bufs)  # a send that missed its deadline may still read its buffer: never reused, never freed
            raise
        finally:
            for task in sends:
                task.cancel()
        self._staging.give(bufs)

    def close(self) -> None:
        try:  # the posted worker-level receive ends only with a message: send ourselves one
            self.rt.call(self.rt.send_self(wire.STOP_MESSAGE, self.tag), 2.0)
            self._serving.result(2.0)
        except Exception as exc:  # noqa: BLE001 - the receive stays posted: keep its buffer alive
            log.warning("%s: control loop did not stop (%s); its receive stays posted", self.engine.engine_id, exc)
            self._serving.cancel()
            bury([torch.from_numpy(self._control_buf)])
        self.server.stop(grace=0.5)
        addresses.unpublish(self.options, self.engine.engine_id, self.engine.rank)
        with self._lock:
            eps, self._consumers = list(self._consumers.values()), {}
        for ep in eps:
            self.rt.close_endpoint(ep)
        if self.exporter is not None:
            self.exporter.close()


def _left(until: float) -> float:
    """Seconds until ``until`` (``time.monotonic()``), never negative: ``wait_for(..., 0)`` fails at once
    unless the awaited thing is already done."""
    return max(0.0, until - time.monotonic())


__all__ = ["HOLD_GRACE_S", "Server"]
