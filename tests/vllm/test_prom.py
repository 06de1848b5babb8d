"""kvbridge's Prometheus series (:mod:`kvbridge.vllm.prom`) built by vLLM's own hook (``build_prom_metrics``)
into a registry of their own, fed the stats dict vLLM hands over, and read back as Prometheus text. A real
server's ``/metrics`` is scraped in ``test_vllm_router.py``."""

from __future__ import annotations

from typing import Any

from test_adapter import KV_CACHE_CONFIG, config


def _registry_types() -> tuple[Any, dict[type, type]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bound(base: type) -> type:
        return type(base.__name__, (base,), {"__init__": lambda self, *a, **k: base.__init__(self, *a, registry=registry, **k)})

    return registry, {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))): s.value
            for family in registry.collect() for s in family.samples}  # fmt: skip


def test_ucx_stats_become_series(vl: Any) -> None:
    registry, types = _registry_types()
    prom = vl.c.UCXConnector.build_prom_metrics(config(vl, "kv_consumer", {}), types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"loads": 2, "load_blocks": 12, "load_bytes": 4096, "load_seconds": 0.004, "failed_blocks": 3,
                  "refused_handoffs": 1, "expired_leases": 2, "lane_cma_loads": 2, "sealed_loads": 2, "corrupt": 0}, 0)
    got = _samples(registry)
    load = (("backend", "ucx"), ("direction", "load"), ("tier", "ucx"))
    assert got[("kvbridge_transfers_total", load)] == 2 and got[("kvbridge_transfer_blocks_total", load)] == 12
    assert got[("kvbridge_transfer_bytes_total", load)] == 4096
    hist = (("backend", "ucx"), ("direction", "load"))
    assert got[("kvbridge_transfer_seconds_count", hist)] == 2 and abs(got[("kvbridge_transfer_seconds_sum", hist)] - 0.004) < 1e-9
    assert got[("kvbridge_transfer_seconds_bucket", (*hist, ("le", "0.001")))] == 0  # each at the mean, 2 ms
    assert got[("kvbridge_transfer_seconds_bucket", (*hist, ("le", "0.0025")))] == 2
    assert got[("kvbridge_failed_blocks_total", (("backend", "ucx"), ("tier", "ucx")))] == 3
    assert got[("kvbridge_handoffs_total", (("outcome", "refused"),))] == 1
    assert got[("kvbridge_handoffs_total", (("outcome", "expired"),))] == 2
    assert got[("kvbridge_loads_by_lane_total", (("lane", "cma"),))] == 2
    assert got[("kvbridge_lane_info", (("lane", "auto"),))] == 1
    assert got[("kvbridge_other_total", (("counter", "sealed_loads"),))] == 2
    assert ("kvbridge_other_total", (("counter", "corrupt"),)) not in got, "a zero counter makes no series"


def test_a_chains_tiers_are_series_of_their_own(vl: Any, tmp_path: Any) -> None:
    """A chain's counters per tier (the connector folds each tier's stats in as ``tier:<name>:``): hits and
    loads of the cpu tier apart from the fs tier's."""
    registry, types = _registry_types()
    extra = {"tiers": [{"backend": "cpu", "capacity_bytes": 1 << 20}, {"backend": "fs", "path": str(tmp_path)}]}
    prom = vl.c.ChainConnector.build_prom_metrics(config(vl, "kv_both", extra), types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"tier:cpu:hits": 3, "tier:fs:hits": 1, "tier:fs:loads": 1, "tier:fs:load_bytes": 100,
                  "tier:cpu:misses": 1, "promoted_blocks": 4, "tier:fs:evictions": 2}, 0)
    got = _samples(registry)
    assert got[("kvbridge_hits_total", (("backend", "chain"), ("tier", "cpu")))] == 3
    assert got[("kvbridge_hits_total", (("backend", "chain"), ("tier", "fs")))] == 1
    assert got[("kvbridge_misses_total", (("backend", "chain"), ("tier", "cpu")))] == 1
    assert got[("kvbridge_transfer_bytes_total", (("backend", "chain"), ("direction", "load"), ("tier", "fs")))] == 100
    assert got[("kvbridge_other_total", (("counter", "promoted_blocks"),))] == 4
    assert got[("kvbridge_other_total", (("counter", "fs:evictions"),))] == 2
    assert not any(name == "kvbridge_lane_info" for name, _ in got), "no lane outside ucx"


def test_a_chain_connector_reports_its_tiers_counters(vl: Any, tmp_path: Any) -> None:
    """The chain's scheduler side keeps no loads or hits of its own: its tiers do, and they reach vLLM's stats."""
    from kvbridge.stats import TransferStats

    extra = {"tiers": [{"backend": "cpu", "capacity_bytes": 1 << 20}, {"backend": "fs", "path": str(tmp_path)}]}
    conn = vl.c.ChainConnector(config(vl, "kv_both", extra), vl.Role.SCHEDULER, KV_CACHE_CONFIG)
    try:
        side = conn._scheduler.side.index  # the store scheduler's ChainIndex
        assert [isinstance(t.stats, TransferStats) for t in side.tiers] == [True, True]
        side.tiers[0].stats.add(hits=2)
        side.tiers[1].stats.add(misses=5)
        data = conn.get_kv_connector_stats().data
        assert data["tier:cpu:hits"] == 2 and data["tier:fs:misses"] == 5, data
        assert conn.get_kv_connector_stats() is None, "taken: nothing new"
        assert conn.requires_kv_delivery is False, "a store's save is best effort (a property, as vLLM reads it)"
    finally:
        conn.shutdown()
