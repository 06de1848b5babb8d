"""Prefill/decode across emulated hosts (kvbridge.testing.hosts): the producer engine on host A, the consumer
engine on host B, each with its own network, pid, uts, IPC and mount namespaces, one link between them;
the transfer params travel through this process (outside both hosts), as through a proxy.

- ``ucx``: nothing configured for the addresses — the producer advertises its own routable address (the
  params name host A's), the consumer reads one-sided over TCP (``auto``; cma cannot cross hosts). Between
  two pods of one network the same configuration reads through pipes (the tcp lane's local medium).
- ``fs`` and ``chain`` (cpu, then fs): over a directory both hosts mount (the shared file system).

Each time the consumer's greedy tokens and logprobs equal a single plain engine's and vLLM counted the
prompt's full blocks as loaded. Engines are pinned to one core each (``OMP_NUM_THREADS=1``). Needs root
and vLLM (skips, saying why).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pdkit import BLOCK, PROMPT_LEN, Engine, assert_same_output, gated, kv_config, open_gate

from kvbridge.testing.hosts import Host

FULL_BLOCKS = PROMPT_LEN // BLOCK


def _pinned(core: int) -> dict[str, str]:
    cpus = os.cpu_count() or 1
    return {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core % cpus)}


@pytest.fixture
def on_host(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    """``on_host(host, name, core, **spec)`` starts an engine subprocess on an emulated host."""
    started: list[Engine] = []

    def start(host: Host, name: str, core: int, **spec: Any) -> Engine:
        spec.setdefault("model", str(tiny_model))
        eng = Engine(tmp_path / "engines", name, spec, prefix=host.prefix(), env=_pinned(core))
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.kill()


def _check_loaded(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert_same_output(result, baseline)
    assert result["num_cached_tokens"] == FULL_BLOCKS * BLOCK, f"vLLM did not count the prompt as loaded: {result}"
    assert result["worker"].get("load_blocks") == FULL_BLOCKS and not result["worker"].get("failed_blocks"), result


@pytest.mark.parametrize("where", ["hosts", "pods"])
def test_ucx_pd_across_hosts(request: pytest.FixtureRequest, where: str, on_host: Callable[..., Engine],
                             baseline: dict, prompts: dict, tmp_path: Path) -> None:
    a, b = request.getfixturevalue(where)
    params, done = tmp_path / "params.json", tmp_path / "consumer.done"
    producer = on_host(a, "producer", 0, kv=kv_config("kvbridge.UCXConnector", "kv_producer", {}),
                       requests=[{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in "AB"],
                       batch=True, publish=str(params), hold=str(done))
    consumer = on_host(b, "consumer", 1,
                       kv=kv_config("kvbridge.UCXConnector", "kv_consumer", {}, kv_load_failure_policy="recompute"),
                       params_from=str(params), done=str(done),
                       requests=[{"name": n, "prompt": prompts[n], "max_tokens": 8} for n in "AB"])
    got = consumer.result()["results"]
    served = producer.result()["results"]
    for n in "AB":
        address = served[n]["kv_transfer_params"]["metadata_address"]
        assert address.rpartition(":")[0] == a.address, f"the producer advertised {address}, not host A's address"
        _check_loaded(got[n], baseline[n])
    medium = "lane_tcp_local_loads" if where == "pods" else "lane_tcp_loads"  # pods of one network: pipes
    for n in "AB":
        lanes = {k: v for k, v in got[n]["worker"].items() if k.startswith("lane_") and v}
        assert set(lanes) == {medium}, lanes


@pytest.mark.parametrize("backend", ["fs", "chain"])
def test_store_pd_across_hosts_over_a_shared_directory(hosts: list[Host], on_host: Callable[..., Engine], baseline: dict,
                                                       prompts: dict, tmp_path: Path, backend: str) -> None:
    a, b = hosts
    store = str(tmp_path / "shared-store")
    if backend == "fs":
        connector, extra = "kvbridge.FSConnector", {"path": store}
    else:
        connector, extra = "kvbridge.ChainConnector", {"tiers": [{"backend": "cpu", "capacity_bytes": 16 << 20},
                                                                 {"backend": "fs", "path": store}]}
    gate = tmp_path / "gate.json"  # the consumer starts beside the producer, and sends once the KV is stored
    consumer = on_host(b, "consumer", 1, kv=kv_config(connector, "kv_consumer", extra, kv_load_failure_policy="recompute"),
                       requests=[{"name": n, "prompt": prompts[n], "max_tokens": 8} for n in "AB"], **gated(gate))
    produced = on_host(a, "producer", 0, kv=kv_config(connector, "kv_producer", extra),
                       requests=[{"name": n, "prompt": prompts[n], "max_tokens": 1} for n in "AB"]).result()["results"]
    for n in "AB":
        assert produced[n]["worker"]["save_blocks"] == FULL_BLOCKS, produced[n]["worker"]
    open_gate(gate)
    got = consumer.result()["results"]
    for n in "AB":
        _check_loaded(got[n], baseline[n])
