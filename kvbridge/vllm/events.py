"""vLLM KV-cache events for what kvbridge's store tiers hold: ``BlockStored`` / ``BlockRemoved`` with a
medium per tier, on vLLM's own event stream (``--kv-events-config``), through the connector's
``take_events``.

A router that reads vLLM's events (vllm-router's ``kv_aware`` policy, llm-d's KV-cache indexer,
Dynamo's KV router) keys them by **vLLM's block hashes**: so are these. At a request's end the
scheduler side notes its full blocks (kvbridge's keys beside vLLM's hashes, ``request.block_hashes``;
vLLM computes them only with its prefix cache on). Each engine step asks a thread of its own to ask each
tier's index which of them it now holds (:meth:`~kvbridge.store.StoreIndex.members`: the store's own
answer, no hook in it) and to publish what a tier newly holds as ``BlockStored`` (one event per contiguous
run, parent hash and token ids as vLLM's own events carry them); at most every ``scan_s`` it re-asks a
bounded slice of what was published and publishes what a tier no longer holds (evicted, expired) as
``BlockRemoved``.

Off the step: ``members()`` may touch a file system (fs: a ``stat`` per chunk) or a server (lmcache), and
vLLM's scheduler thread, which every decode step waits for, must not wait for it. So :meth:`TierEvents.step`
and :meth:`~TierEvents.finished` only hand work over and :meth:`~TierEvents.take` only takes the events
made so far; a thread owned by :class:`TierEvents` does the asking, one round per step at most (steps that
come while a round runs make one more round, not one each). The lock they share is never held while a tier
is asked. :meth:`~TierEvents.close` (the connector's shutdown) stops and joins the thread.

A tier is always asked about one request's keys, in order, from its first block: an index may answer
from the chain's structure (fs: a chunk's last block found proves the blocks before it in that chunk),
so keys of two requests in one question could be answered as held when only the other's are.

Bounded: at most ``max_blocks`` published (tier, block) pairs are followed (beyond that the oldest is
dropped with a ``BlockRemoved``: a router may then under-count a tier, never over-count it), at most
``max_pending`` requests wait for their saves (``pending_s`` each, asked at most every ``scan_s``: a
tier that never stores them costs no stat per round), and each round asks at most ``batch`` keys of all
tiers together. Coalesced: one event per run of blocks, not per block.

When the thread falls behind (a tier slow to answer): steps cost nothing more (they coalesce into one next
round); finished requests wait in a hand-over queue of ``max_pending`` (past that the oldest waiting is
dropped, never published: under-counted, never over-counted; :attr:`TierEvents.dropped` counts them); and
while ``max_events`` events wait untaken the thread asks nothing (vLLM takes them every step, so this
bounds only a caller that never takes), so the events waiting are at most ``max_events`` and one round's.

Media (``medium``): ``cpu`` and ``memory`` -> ``CPU`` (vLLM's name for host memory, what vllm-router's
kv_aware credits as its host tier); ``fs`` -> ``DISK`` (its disk tier); ``lmcache`` -> ``LMCACHE``; a
chain names each tier by its backend. ucx keeps no tier: it publishes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

MEDIA = {"cpu": "CPU", "memory": "CPU", "fs": "DISK", "lmcache": "LMCACHE"}


@dataclasses.dataclass
class Tier:
    """One store tier as the events see it: its medium and its index (anything with ``members(keys)``)."""

    medium: str
    members: Callable[[Sequence[bytes]], list[int]]


@dataclasses.dataclass
class _Pending:
    keys: tuple[bytes, ...]
    hashes: tuple[Any, ...]
    tokens: tuple[int, ...]
    lora: Any
    deadline: float
    seen: list[set[int]]  # per tier, positions already published


def _asking(members: Callable[[Sequence[bytes]], list[int]]) -> Callable[[Sequence[bytes]], list[int] | None]:
    """``members`` that answers ``None`` instead of raising: a tier that cannot answer now (a store gone
    away) publishes nothing this time, and never stops the engine's step."""

    def ask(keys: Sequence[bytes]) -> list[int] | None:
        try:
            return list(members(keys))
        except Exception as exc:  # noqa: BLE001 - events are advisory; the store's own calls report it
            log.debug("kvbridge events: a tier could not say what it holds: %s", exc)
            return None

    return ask


def tiers_of(index: Any, backend: str) -> list[Tier]:
    """The tiers of a store's scheduler-side index: a chain's each (by its backend's name), else the index."""
    if hasattr(index, "tiers") and hasattr(index, "names"):
        return [Tier(MEDIA.get(name, name.upper()), tier.members) for name, tier in zip(index.names, index.tiers)]
    return [Tier(MEDIA.get(backend, backend.upper()), index.members)]


class TierEvents:
    """Follows what each tier holds of finished requests' blocks, on a thread of its own; :meth:`take` gives
    the events so far. :meth:`finished`, :meth:`step` and :meth:`take` never wait for a tier."""

    def __init__(self, tiers: Sequence[Tier], block_size: int, *, max_blocks: int = 65536, max_pending: int = 1024,
                 pending_s: float = 30.0, batch: int = 256, scan_s: float = 0.2, max_events: int = 65536,
                 close_s: float = 5.0):  # fmt: skip
        self.tiers = list(tiers)
        self.block_size = block_size
        self.max_blocks, self.max_pending, self.pending_s, self.batch, self.scan_s = max_blocks, max_pending, pending_s, batch, scan_s
        self.max_events, self.close_s = max_events, close_s
        self.dropped = 0  # finished requests dropped unasked from a full hand-over queue
        # shared with the thread, under _lock (held for no I/O: never while a tier is asked)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the thread waits here for a step
        self._idle = threading.Condition(self._lock)  # drain() waits here for the thread's round
        self._inbox: collections.deque[tuple[str, _Pending]] = collections.deque()
        self._events: list[Any] = []
        self._asked = self._done = 0  # rounds asked for by steps; the last of them the thread has done
        self._closed = False
        self._thread: threading.Thread | None = None
        # the thread's own
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        # (tier, hash) -> (its request's keys, its position there): a scan asks about its request's keys
        self._published: collections.OrderedDict[tuple[int, Any], tuple[tuple[bytes, ...], int]] = collections.OrderedDict()
        self._next_scan = self._next_poll = 0.0

    def finished(self, request: Any, keys: Sequence[bytes]) -> None:
        """Note a finished request's full blocks; published once a tier holds them."""
        hashes = list(getattr(request, "block_hashes", None) or ())[: len(keys)]
        if not hashes or not self.tiers:
            return  # vLLM's prefix cache off: no hashes a router could match
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        n = len(hashes)
        tokens = tuple(int(t) for t in (getattr(request, "all_token_ids", None) or request.prompt_token_ids)[: n * self.block_size])
        lora = getattr(request, "lora_request", None)
        pending = _Pending(tuple(keys[:n]), tuple(maybe_convert_block_hash(h) for h in hashes), tokens, lora,
                           time.monotonic() + self.pending_s, [set() for _ in self.tiers])  # fmt: skip
        with self._lock:
            if self._closed:
                return
            self._inbox.append((request.request_id, pending))
            while len(self._inbox) > self.max_pending:  # the thread is behind: the oldest waiting goes unasked
                self._inbox.popleft()
                self.dropped += 1
            if self._thread is None:  # started by the first request to follow: an engine without any costs none
                self._thread = threading.Thread(target=self._run, name="kvbridge-tier-events", daemon=True)
                self._thread.start()

    def step(self) -> None:
        """Ask the thread for a round: publish what tiers newly hold and what they dropped, each at most every
        ``scan_s`` and asking a bounded number of keys (``batch``, all tiers together). Returns at once."""
        with self._lock:
            if self._thread is not None and not self._closed:
                self._asked += 1
                self._work.notify()

    def take(self) -> list[Any]:
        """The events made since the last take (never waits for a round under way)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the thread has done the rounds asked for so far (False if ``timeout`` passed first):
        for a caller that needs the answers now, such as a test. The engine's step never calls it."""
        with self._lock:
            target = self._asked
            return self._idle.wait_for(lambda: self._done >= target or self._closed or self._thread is None, timeout)

    def close(self) -> None:
        """Stop the thread and join it. A tier still answering at close is not waited for past ``close_s``
        (the thread, a daemon, ends when the answer comes and asks nothing more)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._work.notify_all()
            self._idle.notify_all()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(self.close_s)
        if thread.is_alive():
            log.warning("kvbridge events: a store tier has not answered in %.1f s; its events thread ends when it does",
                        self.close_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._done == self._asked and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                target, arrived = self._asked, list(self._inbox)
                self._inbox.clear()
                full = len(self._events) >= self.max_events
            for rid, pending in arrived:
                self._pending[rid] = pending
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
            if not full:  # events untaken: ask nothing until they are
                try:
                    self._round(time.monotonic())
                except Exception:  # noqa: BLE001 - advisory: a bug here must not end the events for good
                    log.exception("kvbridge events: a round failed")
            with self._lock:
                self._done = target
                self._idle.notify_all()

    def _round(self, now: float) -> None:
        if self._pending and now >= self._next_poll:
            self._next_poll = now + self.scan_s
            self._poll(now)
        if now >= self._next_scan and self._published:
            self._next_scan = now + self.scan_s
            self._scan()

    def _poll(self, now: float) -> None:
        budget = self.batch
        for rid in list(self._pending):
            if budget <= 0 or self._closed:
                break
            p = self._pending[rid]
            done = True
            for t, tier in enumerate(self.tiers):
                if self._closed:
                    return  # closing: ask no more
                if len(p.seen[t]) == len(p.keys):
                    continue  # this tier holds them all already: asking again (a stat each, for fs) finds nothing new
                budget -= len(p.keys)
                answer = _asking(tier.members)(p.keys)
                held = set(answer or ()) - p.seen[t]
                if held:
                    p.seen[t] |= held
                    self._stored(t, p, sorted(held))
                done = done and len(p.seen[t]) == len(p.keys)
            if done or now > p.deadline:
                del self._pending[rid]

    def _stored(self, tier: int, p: _Pending, positions: list[int]) -> None:
        from vllm.distributed.kv_events import BlockStored

        bs = self.block_size
        positions = [i for i in positions if (tier, p.hashes[i]) not in self._published]  # said already
        runs: list[list[int]] = []
        for i in positions:  # contiguous runs: each event's blocks follow its parent hash
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self._emit(BlockStored(
                block_hashes=[p.hashes[i] for i in run], parent_block_hash=p.hashes[run[0] - 1] if run[0] else None,
                token_ids=list(p.tokens[run[0] * bs : (run[-1] + 1) * bs]), block_size=bs,
                lora_id=getattr(p.lora, "adapter_id", None) if p.lora else None, medium=self.tiers[tier].medium,
                lora_name=getattr(p.lora, "name", None) if p.lora else None,
            ))  # fmt: skip
            for i in run:
                self._published[(tier, p.hashes[i])] = (p.keys, i)
                self._published.move_to_end((tier, p.hashes[i]))
        while len(self._published) > self.max_blocks:
            (t, h), _ = self._published.popitem(last=False)
            self._removed(t, [h])

    def _scan(self) -> None:
        """Re-ask a bounded slice of the published blocks (oldest first, then rotated to the end), each
        request's keys from its first block to the last one asked about (see the module docstring)."""
        chunk = [self._published.popitem(last=False) for _ in range(min(self.batch, len(self._published)))]
        asks: dict[tuple[int, int], list[tuple[Any, tuple[bytes, ...], int]]] = {}
        for (t, h), (keys, i) in chunk:
            asks.setdefault((t, id(keys)), []).append((h, keys, i))
        for (t, _), entries in asks.items():
            if self._closed:
                return  # closing: what is left unasked is forgotten with the rest
            keys = entries[0][1]
            answer = _asking(self.tiers[t].members)(keys[: max(i for _, _, i in entries) + 1])
            held = None if answer is None else set(answer)  # no answer: nothing removed
            gone = [h for h, _, i in entries if held is not None and i not in held]
            for h, _, i in entries:
                if held is None or i in held:
                    self._published[(t, h)] = (keys, i)
            if gone:
                self._removed(t, gone)

    def _removed(self, tier: int, hashes: list[Any]) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        self._emit(BlockRemoved(block_hashes=hashes, medium=self.tiers[tier].medium))

    def _emit(self, event: Any) -> None:
        with self._lock:
            self._events.append(event)


__all__ = ["MEDIA", "Tier", "TierEvents", "tiers_of"]
