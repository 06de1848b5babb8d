"""How ``kvbridge proxy`` picks an upstream: round-robin, least-loaded, or cache-aware.

An engine that already holds a prompt's prefix in its KV (vLLM's prefix cache, or a kvbridge tier
beside it) skips computing it; one that does not recomputes it. A router that knows which engine
holds which prefix, and how busy each is, sends a request where it is cheapest.

- ``round-robin``: each in turn.
- ``least-loaded``: the fewest requests in flight, counting the proxy's own (exact, immediate) plus
  what each engine's ``/metrics`` says runs and waits there (polled off the request path, every
  ``poll_s``; vLLM's ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``), ties by KV
  cache usage (``vllm:kv_cache_usage_perc``).
- ``cache-aware``: the upstream expected to hold the longest prefix of this prompt, unless it is
  ``max_imbalance`` requests busier than the least-loaded one (then least-loaded wins: a hot prefix
  must not pile every request onto one engine). Which upstream holds what is remembered from where
  the proxy sent earlier prompts: each prompt is cut into ``chunk_chars``-character pieces whose keys
  chain over the whole prefix (as block keys do over tokens), and each key remembers the upstream
  that last served it (bounded, least recently used first out). A prefix in characters is a prefix
  in tokens up to the last chunk, so this needs no tokenizer on the request path.
- ``cache-aware`` **with a directory** (``kvbridge proxy --directory URL``): what the engines themselves
  publish instead (:class:`DirectoryView`). Each engine's kvbridge connector keeps the route keys
  (:func:`kvbridge.keys.route_keys`) of the prefixes in its prefix cache published under its own URL
  (:mod:`kvbridge.metadata.holdings`); the proxy tokenizes the prompt the way the engine will (the
  engine's own ``/tokenize``, chat template included), computes the same keys and asks the directory
  who holds the longest run. This knows what an engine holds whoever sent it there (another proxy, a
  restart of this one) and forgets what it evicted. A directory that does not answer, or a prompt
  that cannot be tokenized, makes that request least-loaded; it never fails it.

Every decision and its reason are returned (the proxy puts them in an ``x-kvbridge-route`` header and
counts them in ``/metrics``). An upstream that fails is *ejected* for ``eject_s`` seconds (skipped
while another is up), then tried again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.keys import route_keys

log = logging.getLogger(__name__)

POLICIES = ("round-robin", "least-loaded", "cache-aware")


@dataclasses.dataclass
class UpstreamState:
    """What the router knows of one upstream."""

    name: str
    in_flight: int = 0  # requests the proxy has open on it now
    running: float = 0.0  # from its /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0
    ejected_until: float = 0.0

    @property
    def load(self) -> float:
        return self.in_flight + self.running + self.waiting


@dataclasses.dataclass(frozen=True)
class Held:
    """A directory's answer for one prompt: upstream index -> leading route chunks it holds, of ``total``;
    ``error`` says why nothing is known (the directory or the tokenizer did not answer)."""

    chunks: dict[int, int]
    total: int
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
    index: int  # which upstream
    reason: str  # e.g. "cache-aware: 12 chunks held", "least-loaded: 0 in flight"
    outcome: str = "round_robin"  # what decided it, as /metrics counts it (route_<outcome>)


def prompt_text(body: dict[str, Any]) -> str:
    """The part of a completion or chat request that decides its KV: the prompt, or the messages."""
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True, separators=(",", ":"), default=str)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"), default=str)


def chunk_keys(text: str, chunk_chars: int) -> list[bytes]:
    """Chained keys of every full ``chunk_chars`` piece of ``text`` (a key names its whole prefix)."""
    raw = text.encode("utf-8", errors="surrogatepass")
    step = chunk_chars  # counted in bytes: close enough to characters for affinity
    prev, keys = b"kvbridge-route-v1", []
    for off in range(0, len(raw) - step + 1, step):
        prev = hashlib.blake2b(prev + raw[off : off + step], digest_size=12).digest()
        keys.append(prev)
    return keys


class PrefixTable:
    """key -> the upstream that last served it, bounded (least recently used out first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._where: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def holder(self, keys: Sequence[bytes]) -> tuple[int, int] | None:
        """(upstream, how many leading keys it holds), for the upstream that served the first key; the
        count stops where a later key was served elsewhere (that one lacks this prefix's beginning)."""
        who = self._where.get(keys[0]) if keys else None
        if who is None:
            return None
        depth = 1
        while depth < len(keys) and self._where.get(keys[depth]) == who:
            depth += 1
        return who, depth

    def served(self, keys: Sequence[bytes], upstream: int) -> None:
        for key in keys:
            self._where[key] = upstream
            self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, upstream: int) -> None:
        for key in [k for k, v in self._where.items() if v == upstream]:
            del self._where[key]


class Router:
    """Picks one of ``names`` per request under ``policy``; thread-safe. See the module docstring."""

    def __init__(self, names: Sequence[str], policy: str = "round-robin", *, chunk_chars: int = 256,
                 capacity: int = 200_000, max_imbalance: int = 4, eject_s: float = 10.0):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {list(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.states = [UpstreamState(n) for n in names]
        self.chunk_chars = chunk_chars
        self.max_imbalance = max_imbalance
        self.eject_s = eject_s
        self.table = PrefixTable(capacity)
        self._next = 0
        self._lock = threading.Lock()

    def _live(self, now: float) -> list[int]:
        up = [i for i, s in enumerate(self.states) if s.ejected_until <= now]
        return up or list(range(len(self.states)))  # all ejected: try them anyway

    def pick(self, body: dict[str, Any] | None = None, exclude: Sequence[int] = (),
             held: Held | None = None) -> tuple[Decision, list[bytes]]:  # fmt: skip
        """The upstream for this request and the prompt's chunk keys (pass them to :meth:`done`).
        ``held``: what a directory says (:meth:`DirectoryView.held`); without it cache-aware uses the
        proxy's own record."""
        own = body is not None and self.policy == "cache-aware" and held is None
        keys = chunk_keys(prompt_text(body), self.chunk_chars) if own and body is not None else []
        with self._lock:
            live = self.live(exclude)
            decision = self._decide(live, keys, held if self.policy == "cache-aware" else None)
            self.states[decision.index].in_flight += 1
        return decision, keys

    def live(self, exclude: Sequence[int] = ()) -> list[int]:
        """Upstreams not ejected (all of them when every one is), less ``exclude`` unless that leaves none."""
        return [i for i in self._live(time.monotonic()) if i not in exclude] or list(range(len(self.states)))

    def _decide(self, live: list[int], keys: list[bytes], held: Held | None) -> Decision:
        if self.policy == "round-robin":
            i = live[self._next % len(live)]
            self._next += 1
            return Decision(i, "round-robin")
        n = len(self.states)  # ties go round-robin, so new prefixes spread over idle engines
        lightest = min(live, key=lambda i: (self.states[i].load, self.states[i].kv_usage, (i - self._next) % n))
        self._next += 1
        if held is not None:
            return self._cache_aware(live, lightest, held, "cache-aware: directory: ")
        if self.policy == "cache-aware" and keys:
            mine = self.table.holder(keys)
            chunks = {mine[0]: mine[1]} if mine is not None else {}
            return self._cache_aware(live, lightest, Held(chunks, len(keys)), "cache-aware: ")
        return Decision(lightest, f"least-loaded: {self.states[lightest].load:g} in flight", "least_loaded")

    def _cache_aware(self, live: list[int], lightest: int, held: Held, why: str) -> Decision:
        """The live upstream holding the most leading chunks (ties: the lighter), unless it is
        ``max_imbalance`` busier than ``lightest``; ``why`` says whose record ``held`` is."""
        if held.error:
            outcome = "cache_aware_unreachable" if held.error == "unreachable" else "cache_aware_least_loaded"
            return Decision(lightest, f"{why}{held.error}, least-loaded", outcome)
        holders = [i for i in live if held.chunks.get(i, 0) > 0]
        if not holders:
            return Decision(lightest, f"{why}no live holder of {held.total} chunks, least-loaded", "cache_aware_least_loaded")
        best = max(holders, key=lambda i: (held.chunks[i], -self.states[i].load))
        if self.states[best].load - self.states[lightest].load >= self.max_imbalance:
            return Decision(lightest, f"{why}holder {best} too busy, least-loaded", "cache_aware_least_loaded")
        return Decision(best, f"{why}{held.chunks[best]} of {held.total} chunks held", "cache_aware_held")

    def done(self, decision: Decision, keys: Sequence[bytes], ok: bool) -> None:
        """The request on ``decision.index`` ended; ``ok=False`` ejects that upstream for a while."""
        with self._lock:
            state = self.states[decision.index]
            state.in_flight -= 1
            if ok:
                if keys:
                    self.table.served(keys, decision.index)
            else:
                state.ejected_until = time.monotonic() + self.eject_s
                self.table.forget(decision.index)  # what it held may be gone with it

    def update_metrics(self, index: int, metrics: dict[str, float]) -> None:
        with self._lock:
            s = self.states[index]
            s.running = metrics.get("vllm:num_requests_running", 0.0)
            s.waiting = metrics.get("vllm:num_requests_waiting", 0.0)
            s.kv_usage = metrics.get("vllm:kv_cache_usage_perc", metrics.get("vllm:gpu_cache_usage_perc", 0.0))


def normal_url(url: str) -> str:
    """An upstream URL as engines and the proxy compare it: lower-case, no trailing slash."""
    return url.strip().rstrip("/").lower()


class DirectoryView:
    """Who holds how much of a prompt, from the route keys engines publish to a block directory.

    ``urls`` are the routed upstreams; an engine's entry counts for the upstream whose URL equals its
    published address (or holder name): configure each engine's ``advertise_url`` as the proxy names it.
    """

    def __init__(self, directory: Any, urls: Sequence[str]):
        self.directory = directory
        self._index = {normal_url(u): i for i, u in enumerate(urls)}
        self._down = False

    def held(self, tokens: Sequence[int] | None, model: str, salt: str = "") -> Held:
        if tokens is None:
            return Held({}, 0, "prompt not tokenized")
        keys = route_keys(tokens, model, salt=salt)
        if not keys:
            return Held({}, 0)
        try:
            entries = self.directory.lookup(keys)
        except KVBridgeError as exc:
            if not self._down:
                log.warning("routing directory unreachable (%s): least-loaded until it answers", exc)
            self._down = True
            return Held({}, len(keys), "unreachable")
        if self._down:
            log.warning("routing directory answers again")
            self._down = False
        chunks: dict[int, int] = {}
        for entry in entries:
            i = self._index.get(normal_url(entry.address or entry.holder))
            if i is not None:
                chunks[i] = max(chunks.get(i, 0), entry.num_blocks)
        return Held(chunks, len(keys))


def parse_prometheus(text: str) -> dict[str, float]:
    """``name -> value`` of a Prometheus text page, summed over label sets (engines, models)."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.rpartition(" ")
        if not name_labels:
            continue
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] += float(rest)
        except ValueError:
            continue
    return dict(out)


class MetricsPoller(threading.Thread):
    """Polls every upstream's ``/metrics`` every ``poll_s`` (a daemon thread, off the request path)."""

    def __init__(self, router: Router, fetch: Sequence[Callable[[], str]], poll_s: float = 1.0):
        super().__init__(name="kvbridge-proxy-metrics", daemon=True)
        self.router, self.fetch, self.poll_s = router, list(fetch), poll_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            for i, fetch in enumerate(self.fetch):
                try:
                    self.router.update_metrics(i, parse_prometheus(fetch()))
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    log.debug("metrics of upstream %d: %s", i, exc)


__all__ = ["POLICIES", "Decision", "DirectoryView", "Held", "MetricsPoller", "PrefixTable", "Router", "UpstreamState", "chunk_keys", "normal_url", "parse_prometheus", "prompt_text"]
