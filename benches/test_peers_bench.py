"""kvbridge's ``ucx`` pull beside the raw media and the peers reading the same request, in the same run:
``pytest benches/test_peers_bench.py --benchmark-only`` (a minute or two).

The benchmark times the ``ucx`` transfer of Llama-3-8B KV (scattered block ids, 1024 tokens = 128 MiB and
64 tokens = 8 MiB) exactly as ``kvbridge bench`` does; right after, every row of
:data:`kvbridge.bench.peers.PEERS` reads the same request (its own two processes, bytes checked after every
transfer) and lands in ``extra_info["peers"]`` (``--benchmark-json``): ``gbps``, ``median_s``, ``ratio``
(ucx/peer in throughput) and ``note``, or ``note`` alone when it could not run here.
"""

from __future__ import annotations

import pytest

from kvbridge import registry
from kvbridge.bench import peers
from kvbridge.bench.cases import opened
from kvbridge.bench.core import SHAPES, Point, Timing, gbps
from kvbridge.bench.measurer import Measurer
from kvbridge.bench.pairs import Pair, load_case

POINTS = {"8b-1024tok": Point(SHAPES["8b"], 1024), "8b-64tok": Point(SHAPES["8b"], 64)}
ROUNDS = 5


@pytest.mark.parametrize("point", list(POINTS))
def test_ucx_beside_peers(benchmark, point):
    p = POINTS[point]
    problem = registry.check("ucx")
    if problem:
        pytest.skip(problem)
    with opened("ucx", p) as (target, _tmp):
        pair = Pair(target, p)
        try:
            case = load_case(pair, peer=True)
            counter = iter(range(10**9))
            benchmark.pedantic(case.run, setup=lambda: ((case.setup(next(counter)),), {}), teardown=case.teardown,
                               rounds=ROUNDS, warmup_rounds=1)  # fmt: skip
        finally:
            pair.close()
    median = float(benchmark.stats.stats.median)
    measurer = Measurer(ROUNDS)
    rows: dict[str, dict[str, object]] = {}
    for name in peers.PEERS:
        base = measurer.baseline(name, p, "transfer", {})
        if isinstance(base, Timing):
            rows[name] = {"gbps": gbps(p.nbytes, base.median), "median_s": base.median, "ratio": base.median / median,
                          "note": getattr(base, "note", "")}  # fmt: skip
        else:
            rows[name] = {"note": base}
    benchmark.extra_info.update(bytes=p.nbytes, tokens=p.tokens, gbps=gbps(p.nbytes, median), peers=rows)
