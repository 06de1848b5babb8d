"""The engine model of ``kvbridge simulate``: continuous batching on engines with a KV capacity, colocated
(prefill first or chunked) or disaggregated into prefill and decode pools joined by a shared KV link.

One forward step of an engine costs ``step_ms + seq_ms * decodes + ctx_ms_per_ktok * context / 1000 +
prefill_ms_per_ktok * prefill_tokens / 1000``: a fixed cost (reading the weights), a cost per sequence in the
decode batch, a cost per token of context the batch reads (its KV: decode is memory-bound), and a cost per
prompt token computed in the step (prefill is compute-bound). A running sequence gains one token, and one token
of KV, per decode step. An engine holds at most ``kv_tokens`` tokens of KV; when it is full it either never
admits what it could not finish (``queue``: a request reserves its prompt and its whole output when admitted)
or preempts the newest sequence and recomputes it later (``preempt``, vLLM's way).

Layouts: ``colocated`` engines run both phases, a waiting prompt first (its step stalls every decode on the
engine, vLLM v0's default); ``chunked`` engines fill each step's token budget with the decodes first and then
with chunks of waiting prompts (vLLM v1's default); ``xP:yD`` runs prefills on ``x`` engines and decodes on
``y``. A prefilled request's KV stays on its prefill engine until the decode engine it is routed to has
room for it and the transfer over that decode engine's inbound link has finished: ``fixed_ms`` a transfer,
then its bytes at the link's bandwidth shared equally by the transfers in flight. The decode engine emits
the first token with its first decode step. Everything here is deterministic for a seed.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import cast

import numpy as np

# KV bytes per token of kvbridge.bench.core.SHAPES (layers x K,V x kv heads x head dim x 2 bytes), without torch
KV_BYTES_PER_TOKEN = {"8b": 32 * 2 * 8 * 128 * 2, "70b": 80 * 2 * 8 * 128 * 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    """``requests`` arrivals at ``rate``/s (``poisson``, or ``fixed`` spacing ``1/rate``); ``long_frac`` of
    the prompts are long (each with that probability, or exactly that share when ``exact_long``); prompt and
    output lengths are uniform in their ranges (tokens; the output counts the first token)."""

    requests: int = 240
    rate: float = 2.0
    arrivals: str = "poisson"
    long_frac: float = 0.2
    exact_long: bool = False
    short_tokens: tuple[int, int] = (300, 900)
    long_tokens: tuple[int, int] = (7000, 18000)
    output_tokens: tuple[int, int] = (256, 256)
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN["8b"]


@dataclasses.dataclass(frozen=True)
class Requests:
    arrival: np.ndarray  # seconds, ascending
    prompt: np.ndarray  # tokens
    output: np.ndarray  # tokens to emit, the first included
    long: np.ndarray  # bool


def make_requests(w: Workload, seed: int) -> Requests:
    """The workload's requests for ``seed``, in arrival order."""
    rng = np.random.default_rng(seed)
    n = w.requests
    if w.arrivals == "fixed":
        arrival = np.arange(n) / w.rate
    else:
        arrival = np.cumsum(rng.exponential(1 / w.rate, n))
    long: np.ndarray
    if w.exact_long:
        long = np.zeros(n, bool)
        long[rng.choice(n, round(w.long_frac * n), replace=False)] = True
    else:
        long = rng.random(n) < w.long_frac
    lo = np.where(long, w.long_tokens[0], w.short_tokens[0])
    hi = np.where(long, w.long_tokens[1], w.short_tokens[1])
    prompt = np.maximum(1, np.rint(rng.uniform(lo, hi + 1e-9))).astype(np.int64)
    output = rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, n)
    return Requests(arrival, prompt, output, long)


@dataclasses.dataclass(frozen=True)
class EngineModel:
    """Step cost and KV capacity of one engine (defaults: an 8B model on an H100-class GPU, prefill at
    10,000 tokens/s as ``kvbridge bench --prefill-tps``)."""

    step_ms: float = 6.5
    seq_ms: float = 0.045
    ctx_ms_per_ktok: float = 0.044
    prefill_ms_per_ktok: float = 100.0
    kv_tokens: int = 380_000
    max_seqs: int = 256  # vLLM's max_num_seqs: the decode batch never exceeds it
    max_prefill_tokens: int = 8192  # a prefill-first step batches waiting prompts up to this (at least one)
    kv_full: str = "preempt"  # or "queue"
    source: str = "default: 8B on an H100-class GPU"

    def step_s(self, decodes: int, context: int, prefill_tokens: int) -> float:
        return (
            self.step_ms
            + self.seq_ms * decodes
            + self.ctx_ms_per_ktok * context / 1e3
            + self.prefill_ms_per_ktok * prefill_tokens / 1e3
        ) / 1e3


@dataclasses.dataclass(frozen=True)
class HandOff:
    """KV hand-off of one request: ``fixed_ms``, then its bytes at ``gbps`` shared by the transfers in flight.
    ``basis``: ``given`` (flags), ``measured`` (fitted to a bench's runs) or ``derived`` (extrapolated from
    them to a link the bench did not run: :mod:`kvbridge.simulate.hostbench`)."""

    name: str = "nominal"
    fixed_ms: float = 1.0
    gbps: float = 25.0
    source: str = "--transfer-gbps / --transfer-fixed-ms"
    basis: str = "given"

    def seconds(self, nbytes: int) -> float:
        """The time of one transfer alone on the link."""
        return self.fixed_ms / 1e3 + (0.0 if math.isinf(self.gbps) else nbytes / (self.gbps * 1e9))


@dataclasses.dataclass(frozen=True)
class Layout:
    """``kind``: ``colocated`` (``servers`` engines), ``chunked`` (the same with a step budget of ``chunk``
    tokens) or ``disaggregated`` (``pools`` = prefill, decode engines, hand-off ``handoff``)."""

    name: str
    kind: str
    servers: int = 2
    chunk: int = 0
    pools: tuple[int, int] = (1, 1)
    handoff: HandOff | None = None


@dataclasses.dataclass
class Result:
    """What happened to each request: its arrival, the times its tokens were emitted, its hand-off wait."""

    arrival: np.ndarray
    tokens: list[np.ndarray]
    handoff_s: np.ndarray
    preemptions: int = 0


class _Seq:
    __slots__ = ("rid", "arrival", "prompt", "remaining", "todo", "done", "ctx", "join", "version", "pieces",
                 "home", "handoff_from", "handoff_s", "reserved")  # fmt: skip

    def __init__(self, rid: int, arrival: float, prompt: int, output: int):
        self.rid, self.arrival, self.prompt, self.remaining = rid, arrival, prompt, output
        self.todo = prompt  # tokens to prefill (the prompt; prompt + generated after a preemption)
        self.done = 0  # of them, prefilled so far (chunked)
        self.ctx = 0  # KV tokens when it joined the decode batch
        self.join = 0  # index of the first decode step it took part in
        self.version = 0
        self.pieces: list[float | tuple[_Engine, int, int]] = []  # token times: one, or a run of decode steps
        self.home: _Engine | None = None  # the prefill engine holding its KV until the hand-off is done
        self.handoff_from = 0.0
        self.handoff_s = 0.0
        self.reserved = 0  # KV tokens it holds on the engine it runs on


class _Link:
    """An engine's inbound link: transfers share its bandwidth equally (processor sharing)."""

    def __init__(self, handoff: HandOff):
        self.bps = handoff.gbps * 1e9
        self.active: dict[_Seq, float] = {}
        self.t = 0.0
        self.version = 0

    def _advance(self, now: float) -> None:
        if self.active and not math.isinf(self.bps):
            share = (now - self.t) * self.bps / len(self.active)
            for s in self.active:
                self.active[s] -= share
        self.t = now

    def add(self, now: float, seq: _Seq, nbytes: float) -> float:
        self._advance(now)
        self.active[seq] = 0.0 if math.isinf(self.bps) else float(nbytes)
        return self.next_done(now)

    def next_done(self, now: float) -> float:
        self.version += 1
        if not self.active:
            return math.inf
        least = min(self.active.values())
        return now + (0.0 if math.isinf(self.bps) else max(0.0, least) * len(self.active) / self.bps)

    def pop_done(self, now: float) -> list[_Seq]:
        self._advance(now)
        done = [s for s, left in self.active.items() if left <= 1.0]  # bytes (rounding)
        for s in done:
            del self.active[s]
        return done


class _Engine:
    def __init__(self, idx: int, role: str, model: EngineModel, chunk: int = 0):
        self.idx, self.role, self.m, self.chunk = idx, role, model, chunk
        self.preempts = model.kv_full == "preempt"
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: dict[_Seq, None] = {}  # insertion order = admission order (preemption takes the last)
        self.joining: list[_Seq] = []
        self.incoming = 0  # hand-offs admitted and still on the link
        self.finish: list[tuple[int, int, int, _Seq]] = []  # (its last decode step, version, rid, seq)
        self.ends: list[float] = []  # end time of every step that carried decodes
        self.ctx = 0  # context tokens of the running batch
        self.kv = 0  # KV tokens held or reserved
        self.queued = 0  # prompt tokens waiting to be prefilled here (routing)
        self.busy = False
        self.work: tuple[list[_Seq], list[tuple[_Seq, int]], int] = ([], [], 0)
        self.inbox: collections.deque[_Seq] = collections.deque()  # decode engine: prefilled, awaiting KV room
        self.link: _Link | None = None
        self.preemptions = 0

    def load(self) -> int:
        prefilling = len(self.work[0]) if self.busy else 0
        return prefilling + len(self.waiting) + len(self.running) + len(self.joining) + len(self.inbox) + self.incoming

    def need(self, s: _Seq) -> int:
        """KV tokens to admit ``s``: what it must prefill (+ its whole output when the engine queues)."""
        return s.todo + (s.remaining if not self.preempts and self.role != "prefill" else 0)

    def fits(self, s: _Seq) -> bool:
        watermark = self.m.kv_tokens // 100 if self.preempts and self.kv else 0
        if self.kv + self.need(s) + watermark > self.m.kv_tokens:
            return False
        return self.role == "prefill" or len(self.running) + len(self.joining) + self.incoming < self.m.max_seqs


def simulate(layout: Layout, reqs: Requests, model: EngineModel, kv_bytes_per_token: int) -> Result:
    """Serve ``reqs`` on ``layout``; every engine is ``model``."""
    handoff = layout.handoff or HandOff()
    if layout.kind == "disaggregated":
        n_prefill, n_decode = layout.pools
        front = [_Engine(i, "prefill", model) for i in range(n_prefill)]
        decoders = [_Engine(n_prefill + i, "decode", model) for i in range(n_decode)]
        for e in decoders:
            e.link = _Link(handoff)
        engines = front + decoders
    else:
        chunk = layout.chunk if layout.kind == "chunked" else 0
        engines = [_Engine(i, "both", model, chunk) for i in range(layout.servers)]
        front = decoders = engines
    seqs = [
        _Seq(i, float(a), int(n), int(o)) for i, (a, n, o) in enumerate(zip(reqs.arrival, reqs.prompt, reqs.output))
    ]
    events: list[tuple[float, int, int, object]] = []
    counter = 0
    ARRIVE, STEP, LATENCY, LINK = 0, 1, 2, 3

    def push(t: float, kind: int, obj: object) -> None:
        nonlocal counter
        heapq.heappush(events, (t, counter, kind, obj))
        counter += 1

    def admit(e: _Engine, s: _Seq) -> None:
        s.reserved = e.need(s)
        e.kv += s.reserved

    def release(e: _Engine, s: _Seq, steps: int = 0) -> None:
        e.kv -= s.reserved + (steps if e.preempts else 0)  # preempting engines grow a sequence's KV each step
        s.reserved = 0

    def join(e: _Engine, s: _Seq) -> None:
        s.join, s.ctx = len(e.ends), s.todo
        s.version += 1
        e.running[s] = None
        e.ctx += s.ctx
        heapq.heappush(e.finish, (s.join + s.remaining - 1, s.version, s.rid, s))

    def leave(e: _Engine, s: _Seq, steps: int) -> None:
        """``s`` leaves the batch after ``steps`` decode steps in it."""
        del e.running[s]
        e.ctx -= s.ctx + steps
        if steps:
            s.pieces.append((e, s.join, s.join + steps))
        s.remaining -= steps
        s.version += 1
        release(e, s, steps)

    def preempt(e: _Engine) -> None:
        """Room for one more token per running sequence: preempt the newest, to be recomputed."""
        while e.preempts and e.running and e.kv + len(e.running) > e.m.kv_tokens:
            s = next(reversed(e.running))
            steps = len(e.ends) - s.join
            leave(e, s, steps)
            s.todo, s.done = s.ctx + steps, 0
            e.waiting.appendleft(s)
            e.queued += s.todo
            e.preemptions += 1

    def prefilled(e: _Engine, s: _Seq, now: float) -> None:
        """``s``'s prompt is in ``e``'s KV: emit a token (colocated, recompute) or hand it off."""
        e.queued -= s.todo
        if e.role == "prefill":
            s.home, s.handoff_from = e, now
            d = min(decoders, key=lambda d: (d.kv + sum(q.todo for q in d.inbox), d.load(), d.idx))
            d.inbox.append(s)
            admit_inbox(d, now)
            return
        s.pieces.append(now)
        s.remaining -= 1
        if s.remaining <= 0:
            release(e, s)
        else:
            e.joining.append(s)

    def admit_inbox(d: _Engine, now: float) -> None:
        """Start the hand-offs the decode engine has room for (its preempted work first)."""
        while d.inbox and not d.waiting and d.fits(d.inbox[0]):
            s = d.inbox.popleft()
            admit(d, s)
            d.incoming += 1
            push(now + handoff.fixed_ms / 1e3, LATENCY, (d, s))

    def kick(e: _Engine, now: float) -> None:
        if e.busy:
            return
        for s in e.joining:
            join(e, s)
        e.joining.clear()
        prefill: list[_Seq] = []
        chunks: list[tuple[_Seq, int]] = []
        tokens = decodes = 0
        if e.chunk:  # decodes first, then chunks of the waiting prompts in the budget left
            preempt(e)
            decodes = len(e.running)
            budget = e.chunk - decodes
            for s in e.waiting:
                if budget <= 0:
                    break
                if not s.reserved:
                    if not e.fits(s):
                        break
                    admit(e, s)
                take = min(budget, s.todo - s.done)
                chunks.append((s, take))
                budget -= take
                tokens += take
        else:  # a waiting prompt first (whole; several up to max_prefill_tokens), else a decode step
            while e.waiting and e.fits(e.waiting[0]):
                s = e.waiting[0]
                if prefill and tokens + s.todo > e.m.max_prefill_tokens:
                    break
                e.waiting.popleft()
                admit(e, s)
                prefill.append(s)
                tokens += s.todo
            if not prefill:
                preempt(e)
                decodes = len(e.running)
        if not (decodes or tokens):
            return
        e.busy = True
        e.work = (prefill, chunks, decodes)
        push(now + e.m.step_s(decodes, e.ctx if decodes else 0, tokens), STEP, e)

    def step_done(e: _Engine, now: float) -> None:
        prefill, chunks, decodes = e.work
        e.busy = False
        if decodes:
            e.ends.append(now)
            k = len(e.ends) - 1
            e.ctx += decodes
            if e.preempts:
                e.kv += decodes
            while e.finish and e.finish[0][0] <= k:
                _, version, _, s = heapq.heappop(e.finish)
                if version == s.version:
                    leave(e, s, k - s.join + 1)
        for s, take in chunks:
            s.done += take
            if s.done >= s.todo:
                e.waiting.remove(s)
                prefilled(e, s, now)
        for s in prefill:
            prefilled(e, s, now)
        if e.role == "decode":
            admit_inbox(e, now)
        kick(e, now)

    for s in seqs:
        push(s.arrival, ARRIVE, s)
    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == ARRIVE:
            s = cast(_Seq, obj)
            e = min(front, key=lambda e: (e.queued, e.load(), e.idx) if e.role == "prefill" else (e.load(), e.idx))
            e.waiting.append(s)
            e.queued += s.todo
            kick(e, now)
        elif kind == STEP:
            step_done(cast(_Engine, obj), now)
        elif kind == LATENCY:
            dst, s = cast("tuple[_Engine, _Seq]", obj)
            link = dst.link
            assert link is not None
            push(link.add(now, s, s.todo * kv_bytes_per_token), LINK, (dst, link.version))
        else:
            dst, version = cast("tuple[_Engine, int]", obj)
            link = dst.link
            assert link is not None
            if version != link.version:
                continue
            for s in link.pop_done(now):
                s.handoff_s = now - s.handoff_from
                home = s.home
                assert home is not None
                home.kv -= s.prompt  # the prefill engine frees the prompt's KV
                dst.incoming -= 1
                dst.joining.append(s)
                kick(home, now)
            kick(dst, now)
            t = link.next_done(now)
            if not math.isinf(t):
                push(t, LINK, (dst, link.version))
    return _result(seqs, engines)


def _result(seqs: Sequence[_Seq], engines: Sequence[_Engine]) -> Result:
    ends = {e: np.asarray(e.ends) for e in engines}
    tokens = []
    for s in seqs:
        if s.remaining > 0:
            raise RuntimeError(f"request {s.rid} did not finish ({s.remaining} tokens left)")
        parts = [np.asarray([p]) if isinstance(p, float) else ends[p[0]][p[1] : p[2]] for p in s.pieces]
        tokens.append(np.concatenate(parts))
    return Result(
        np.asarray([s.arrival for s in seqs]),
        tokens,
        np.asarray([s.handoff_s for s in seqs]),
        sum(e.preemptions for e in engines),
    )


__all__ = [
    "KV_BYTES_PER_TOKEN",
    "EngineModel",
    "HandOff",
    "Layout",
    "Requests",
    "Result",
    "Workload",
    "make_requests",
    "simulate",
]
