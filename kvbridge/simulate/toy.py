"""``--preset toy-go``: the published toy simulation that motivates P/D disaggregation, re-implemented from its
description (240 requests, 2 servers, 20% long prompts, 20 decode steps of 5 ms).

Every prefill and every decode step is its own job, queued first-come-first-served (by the time it becomes
ready) on its server; a prompt costs 0.1 ms a token (10,000 tokens/s: short prompts 30-90 ms, long ones
700-1800 ms); nothing is batched. Colocated, request ``i`` is pinned to server ``i % servers`` (the engine
holding its KV) and its prefill and decode steps queue there; disaggregated (``xP:yD``), its prefill queues on
prefill server ``i % x`` and its decode steps on decode server ``i % y``. The first token comes at the end of
the prefill; each decode step then emits one. The article ignores the KV hand-off; with a ``HandOff`` the first
decode step waits for the KV to cross the decode server's link (shared by the transfers in flight).
"""

from __future__ import annotations

import collections
import math

import numpy as np

from kvbridge.simulate.model import HandOff, Layout, Requests, Result, Workload, _Link

PREFILL_S_PER_TOKEN = 1e-4
DECODE_STEP_S = 5e-3
# The article's table: layout -> (p99 ITL, mean ITL, mean TTFT), ms
REFERENCE = {
    "colocated": {"itl_p99_ms": 88.0, "itl_mean_ms": 15.0, "ttft_mean_ms": 426.0},
    "disaggregated": {"itl_p99_ms": 30.0, "itl_mean_ms": 11.0, "ttft_mean_ms": 1032.0},
}
# Fixed spacing of 425 ms and exactly 20% long prompts: the article says "spread" arrivals and "20%" bursts; of the
# spacings near its ~435 ms, 426 ms puts the six medians over 100 seeds closest to its table
WORKLOAD = Workload(
    requests=240, rate=1 / 0.426, arrivals="fixed", long_frac=0.2, exact_long=True, short_tokens=(300, 900),
    long_tokens=(7000, 18000), output_tokens=(21, 21),
)  # fmt: skip


def _fcfs(
    ready: list[float], rids: list[int], first_s: list[float], steps: list[int], tokens: list[list[float]]
) -> None:
    """One server: job ``k`` (request ``rids[k]``) is ready at ``ready[k]`` (ascending) and takes ``first_s[k]``,
    then ``steps[k]`` decode steps follow it, each ready when the one before ends. Appends each job's end to
    its request's ``tokens``."""
    queue: collections.deque[tuple[int, float, int]] = collections.deque()
    now, i, n = 0.0, 0, len(ready)
    while i < n or queue:
        if not queue:
            now = max(now, ready[i])
        while i < n and ready[i] <= now:
            queue.append((rids[i], first_s[i], steps[i]))
            i += 1
        rid, dur, left = queue.popleft()
        now += dur
        tokens[rid].append(now)
        while i < n and ready[i] <= now:  # what arrived while it ran is ahead of its next step
            queue.append((rids[i], first_s[i], steps[i]))
            i += 1
        if left:
            queue.append((rid, DECODE_STEP_S, left - 1))


def _over_link(starts: list[float], nbytes: list[int], handoff: HandOff) -> list[float]:
    """When each transfer (started at ``starts``, ascending) has crossed one link shared by those in flight."""
    link = _Link(handoff)
    done = [math.inf] * len(starts)
    keys: dict[object, int] = {}
    nxt, i = math.inf, 0
    while i < len(starts) or link.active:
        t_start = starts[i] + handoff.fixed_ms / 1e3 if i < len(starts) else math.inf
        if t_start <= nxt:
            key = object()
            keys[key] = i
            nxt = link.add(t_start, key, nbytes[i])  # type: ignore[arg-type]
            i += 1
        else:
            for key in link.pop_done(nxt):
                done[keys.pop(key)] = nxt
            nxt = link.next_done(nxt)
    return done


def simulate(layout: Layout, reqs: Requests, kv_bytes_per_token: int) -> Result:
    """Serve ``reqs`` the article's way on ``layout`` (``colocated`` or ``disaggregated``)."""
    n = len(reqs.arrival)
    arrival = reqs.arrival.tolist()
    prefill = (reqs.prompt * PREFILL_S_PER_TOKEN).tolist()
    decode_steps = (reqs.output - 1).tolist()
    tokens: list[list[float]] = [[] for _ in range(n)]
    handoff_s = np.zeros(n)
    if layout.kind == "colocated":
        for srv in range(layout.servers):
            ids = list(range(srv, n, layout.servers))
            _fcfs([arrival[i] for i in ids], ids, [prefill[i] for i in ids], [decode_steps[i] for i in ids], tokens)
    elif layout.kind == "disaggregated":
        p, d = layout.pools
        for srv in range(p):
            ids = list(range(srv, n, p))
            _fcfs([arrival[i] for i in ids], ids, [prefill[i] for i in ids], [0] * len(ids), tokens)
        for srv in range(d):
            ids = sorted(range(srv, n, d), key=lambda i: tokens[i][0])
            ready = [tokens[i][0] for i in ids]
            if layout.handoff is not None:
                landed = _over_link(ready, [int(reqs.prompt[i]) * kv_bytes_per_token for i in ids], layout.handoff)
                for i, t0, t1 in zip(ids, ready, landed):
                    handoff_s[i] = t1 - t0
                order = sorted(range(len(ids)), key=lambda k: landed[k])
                ids, ready = [ids[k] for k in order], [landed[k] for k in order]
            todo = [i for i in ids if decode_steps[i] > 0]
            _fcfs([ready[k] for k, i in enumerate(ids) if decode_steps[i] > 0], todo, [DECODE_STEP_S] * len(todo),
                  [decode_steps[i] - 1 for i in todo], tokens)  # fmt: skip
    else:
        raise ValueError(f"toy-go has no {layout.kind} layout")
    return Result(reqs.arrival, [np.asarray(t) for t in tokens], handoff_s)


__all__ = ["REFERENCE", "WORKLOAD", "simulate"]
