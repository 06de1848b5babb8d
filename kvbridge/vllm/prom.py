"""kvbridge's counters as Prometheus series on vLLM's own ``/metrics`` (vLLM's ``KVConnectorPromMetrics``).

vLLM sums each step's :class:`~kvbridge.vllm.connector.KVBridgeStats` over the workers and the scheduler
and hands the dict to :meth:`KVBridgePromMetrics.observe` in the API server's process, once per stats
interval. Every series carries vLLM's own labels (``model_name``, ``engine``) and, where it says so:
``direction`` (``load`` / ``save``), ``backend`` (the connector's backend: ucx, fs, cpu, chain, ...) and
``tier`` (a store's tier: the backend itself, or for ``chain`` each tier by its backend name).

- ``kvbridge_transfers_total``, ``kvbridge_transfer_bytes_total``, ``kvbridge_transfer_blocks_total``,
  ``kvbridge_transfer_failures_total`` {direction, backend, tier};
- ``kvbridge_transfer_seconds`` {direction, backend}: a histogram of transfer time. The stats carry a
  sum per interval, so each transfer of an interval is observed at that interval's mean (vLLM takes the
  stats every engine step: one step's transfers share a mean);
- ``kvbridge_failed_blocks_total`` {backend, tier}: blocks whose load failed; vLLM recomputes them
  (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``);
- ``kvbridge_hits_total`` / ``kvbridge_misses_total`` {backend, tier}: lookups a tier served / could not;
- ``kvbridge_handoffs_total`` {outcome}: ucx hand-offs ``refused`` by a consumer (expired, malformed,
  altered params), ``unpulled`` (released unread), ``expired`` (a producer's lease ran out), ``served``
  (pulls a producer served), ``refused_pull`` (pulls it refused);
- ``kvbridge_loads_by_lane_total`` {lane}: ucx loads by the lane that read them (cma, tcp, ucp, two-sided),
  and ``kvbridge_lane_info`` {lane}: the configured lane (``auto`` picks per producer);
- ``kvbridge_other_total`` {counter}: every other counter a backend keeps (evictions, corrupt objects,
  promoted blocks, sealed loads, ...), under its own name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

TIER_SEP = ":"  # a per-tier counter's key in the stats dict: "tier:<tier>:<counter>"
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_DIRECTIONS = ("load", "save")
_TRANSFER = {  # stats counter -> (series, direction)
    "loads": ("transfers", "load"), "saves": ("transfers", "save"),
    "load_bytes": ("bytes", "load"), "save_bytes": ("bytes", "save"),
    "load_blocks": ("blocks", "load"), "save_blocks": ("blocks", "save"),
    "load_failures": ("failures", "load"), "save_failures": ("failures", "save"),
}  # fmt: skip
_HANDOFFS = {"refused_handoffs": "refused", "unpulled_handoffs": "unpulled", "expired_leases": "expired",
             "served_pulls": "served", "refused_pulls": "refused_pull"}  # fmt: skip
_LANES = {"lane_cma_loads": "cma", "lane_tcp_loads": "tcp", "lane_tcp_local_loads": "tcp-local",
          "lane_ucp_loads": "ucp", "lane_two_sided_loads": "two-sided"}
_SECONDS = {"load_seconds", "save_seconds"}


def split_tier(key: str, default: str) -> tuple[str, str]:
    """``"tier:cpu:hits"`` -> ``("cpu", "hits")``; a plain counter is the ``default`` tier's."""
    if key.startswith("tier" + TIER_SEP):
        _, tier, counter = key.split(TIER_SEP, 2)
        return tier, counter
    return default, key


class KVBridgePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The series above, registered once per API-server process; :meth:`observe` adds one interval."""

    def __init__(self, vllm_config: Any, metric_types: Mapping[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *, backend: str, lane: str | None = None):
        super().__init__(vllm_config, dict(metric_types), labelnames, per_engine_labelvalues)
        self.backend = backend
        base = list(labelnames)

        def counter(name: str, doc: str, *labels: str) -> Any:
            return self._counter_cls(name=f"kvbridge_{name}", documentation=doc, labelnames=base + list(labels))

        self._transfer = {
            "transfers": counter("transfers", "KV transfers (loads into this engine, saves out of it)", "direction", "backend", "tier"),
            "bytes": counter("transfer_bytes", "Bytes of KV moved", "direction", "backend", "tier"),
            "blocks": counter("transfer_blocks", "KV blocks moved", "direction", "backend", "tier"),
            "failures": counter("transfer_failures", "Transfers that failed (their blocks are recomputed)", "direction", "backend", "tier"),
        }  # fmt: skip
        self._failed_blocks = counter("failed_blocks", "Blocks whose load failed; vLLM recomputes them or fails the request "
                                      "(kv_load_failure_policy)", "backend", "tier")
        self._hits = counter("hits", "Lookups a tier could serve", "backend", "tier")
        self._misses = counter("misses", "Lookups a tier could not serve", "backend", "tier")
        self._handoffs = counter("handoffs", "ucx hand-offs by outcome", "outcome")
        self._lanes = counter("loads_by_lane", "ucx loads by the lane that read them", "lane")
        self._other = counter("other", "Every other counter a kvbridge backend keeps, by name", "counter")
        self._seconds = self._histogram_cls(name="kvbridge_transfer_seconds", documentation="Time of one KV transfer "
                                            "(each transfer of a stats interval at the interval's mean)",
                                            labelnames=base + ["direction", "backend"], buckets=list(BUCKETS))
        if lane is not None:
            info = self._gauge_cls(name="kvbridge_lane_info", documentation="The ucx lane configured (auto: chosen "
                                   "per producer)", labelnames=base + ["lane"], multiprocess_mode="mostrecent")
            for values in per_engine_labelvalues.values():
                info.labels(*values, lane).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = list(self.per_engine_labelvalues.get(engine_idx, [engine_idx]))
        data = transfer_stats_data or {}
        counts: dict[str, float] = {"load": 0.0, "save": 0.0}
        seconds: dict[str, float] = {"load": 0.0, "save": 0.0}
        for key, value in data.items():
            if not value or not isinstance(value, (int, float)):
                continue
            tier, name = split_tier(key, self.backend)
            if name in _TRANSFER:
                series, direction = _TRANSFER[name]
                self._transfer[series].labels(*engine, direction, self.backend, tier).inc(value)
                if series == "transfers":
                    counts[direction] += value
            elif name in _SECONDS:
                seconds[name.removesuffix("_seconds")] += value
            elif name == "failed_blocks":
                self._failed_blocks.labels(*engine, self.backend, tier).inc(value)
            elif name in ("hits", "misses"):
                (self._hits if name == "hits" else self._misses).labels(*engine, self.backend, tier).inc(value)
            elif name in _HANDOFFS:
                self._handoffs.labels(*engine, _HANDOFFS[name]).inc(value)
            elif name in _LANES:
                self._lanes.labels(*engine, _LANES[name]).inc(value)
            else:
                self._other.labels(*engine, name if tier == self.backend else f"{tier}{TIER_SEP}{name}").inc(value)
        for direction in _DIRECTIONS:
            n = int(counts[direction])
            if n and seconds[direction] > 0:
                child = self._seconds.labels(*engine, direction, self.backend)
                for _ in range(n):
                    child.observe(seconds[direction] / n)


__all__ = ["BUCKETS", "KVBridgePromMetrics", "TIER_SEP", "split_tier"]
