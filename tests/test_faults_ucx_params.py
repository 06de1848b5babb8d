"""Hostile transfer params at the ``ucx`` consumer's scheduler: every malformed field is a miss at lookup
(nothing raised, no load planned), an expired hand-off is said once and counted, a router's prefill flags
are no hand-off, ``num_tokens`` never exceeds the blocks named, and the load's life cycle on the core's
LoadBook. No process runs here; hostile params that reach a producer are in tests/test_faults_ucx.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.connectors.ucx import UcxBackend, UcxOptions  # noqa: E402

from kvbridge.contract import EngineInfo, WorkerReport  # noqa: E402


def _good_params(**changes: Any) -> dict[str, Any]:
    params = {"kvbridge_version": 1, "engine_id": "p", "metadata_address": "127.0.0.1:5555", "request_id": "r",
              "block_ids": [3, 1, 2], "num_tokens": 48, "expires_at": time.time() + 60}
    params.update(changes)
    return {k: v for k, v in params.items() if v is not _MISSING}


_MISSING = object()
_HOSTILE: dict[str, Any] = {
    "num_tokens=-16": _good_params(num_tokens=-16),
    "num_tokens=0": _good_params(num_tokens=0),
    "num_tokens=2.5": _good_params(num_tokens=2.5),
    "num_tokens='48'": _good_params(num_tokens="48"),
    "num_tokens=True": _good_params(num_tokens=True),
    "num_tokens=nan": _good_params(num_tokens=math.nan),
    "block_ids=str": _good_params(block_ids="3,1,2"),
    "block_ids=int": _good_params(block_ids=3),
    "block_ids=dict": _good_params(block_ids={"3": 1}),
    "block_ids=[]": _good_params(block_ids=[]),
    "block_ids=None": _good_params(block_ids=None),
    "block_ids=mixed": _good_params(block_ids=[3, "1", 2]),
    "block_ids=float": _good_params(block_ids=[3, 1.5, 2]),
    "block_ids=negative": _good_params(block_ids=[3, -1, 2]),
    "block_ids=2**31": _good_params(block_ids=[3, 2**31, 2]),
    "block_ids=2**62": _good_params(block_ids=[2**62]),
    **{f"missing={k}": _good_params(**{k: _MISSING}) for k in
       ("kvbridge_version", "engine_id", "metadata_address", "request_id", "block_ids", "num_tokens", "expires_at")},
    "version=2": _good_params(kvbridge_version=2),
    "version='1'": _good_params(kvbridge_version="1"),
    "version=True": _good_params(kvbridge_version=True),
    "address=words": _good_params(metadata_address="not an address"),
    "address=no-port": _good_params(metadata_address="127.0.0.1"),
    "address=port-0": _good_params(metadata_address="127.0.0.1:0"),
    "address=port-99999": _good_params(metadata_address="127.0.0.1:99999"),
    "address=int": _good_params(metadata_address=5555),
    "address=empty": _good_params(metadata_address=""),
    "address=scheme": _good_params(metadata_address="unix:/tmp/x"),
    "addresses=str": _good_params(metadata_addresses="127.0.0.1:5555"),
    "addresses=bad": _good_params(metadata_addresses=["127.0.0.1:5555", "nope"]),
    "expires_at=past": _good_params(expires_at=time.time() - 1),
    "expires_at=nan": _good_params(expires_at=math.nan),
    "expires_at=inf": _good_params(expires_at=math.inf),
    "expires_at=word": _good_params(expires_at="soon"),
    "request_id=int": _good_params(request_id=7),
    "request_id=empty": _good_params(request_id=""),
    "request_id=300-bytes": _good_params(request_id="r" * 300),
    "request_id=surrogate": _good_params(request_id="\udcff"),
    "engine_id=dict": _good_params(engine_id={"a": 1}),
    "params=list": ["kvbridge_version", 1],
    "params=str": "kvbridge_version=1",
    "params=int": 1,
}


def _scheduler(tmp_path: Path, role: str = "consumer") -> Any:
    backend = UcxBackend(UcxOptions(registry_dir=str(tmp_path / "reg")))
    return backend.scheduler(EngineInfo("c", 16, role=role))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(_HOSTILE))
def test_hostile_params_are_a_miss_at_lookup(tmp_path: Path, name: str) -> None:
    """Malformed transfer params are Lookup(0); the scheduler raises nothing and plans no load."""
    from kvbridge.contract import RequestInfo

    scheduler = _scheduler(tmp_path)
    req = RequestInfo("r1", tuple(range(100)), (), _HOSTILE[name])
    assert scheduler.lookup(req, 0).num_tokens == 0
    scheduler.on_allocated(req, list(range(7)), 0)
    assert scheduler.plan_step([]).loads == ()
    assert not scheduler.on_finished(req, list(range(7))).delay_free


def test_an_expired_hand_off_is_said_once_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A consumer that comes after the producer's lease recomputes, and says why (once per request)."""
    from kvbridge.contract import RequestInfo

    scheduler = _scheduler(tmp_path)
    req = RequestInfo("late-1", tuple(range(100)), (), _good_params(expires_at=time.time() - 5))
    with caplog.at_level("WARNING"):
        for _ in range(3):  # the engine asks every step the request waits
            assert scheduler.lookup(req, 0).num_tokens == 0
    said = [r.getMessage() for r in caplog.records if "late-1" in r.getMessage()]
    assert len(said) == 1 and "lease expired" in said[0], said
    assert scheduler.stats.refused_handoffs == 1
    caplog.clear()
    assert scheduler.lookup(RequestInfo("plain", tuple(range(100)), (), None), 0).num_tokens == 0
    assert not caplog.records, "a request without params is no refused hand-off"


ROUTER_PREFILL_FLAGS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}  # vllm-router 0.1.17's


def test_a_routers_prefill_flags_are_no_refused_hand_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The kv_transfer_params a P/D router sends with a *prefill* request (vllm-router: do_remote_decode,
    do_remote_prefill false, NIXL's remote_* null) name no hand-off: a kv_both engine computes the prompt
    without a warning or a refused count; params that do name a foreign (NIXL) hand-off are refused and said."""
    from kvbridge.contract import RequestInfo

    scheduler = _scheduler(tmp_path, role="both")
    req = RequestInfo("pre-1", tuple(range(100)), (), dict(ROUTER_PREFILL_FLAGS))
    with caplog.at_level("WARNING"):
        assert scheduler.lookup(req, 0).num_tokens == 0
    assert not caplog.records and scheduler.stats.refused_handoffs == 0
    nixl = RequestInfo("nixl-1", tuple(range(100)), (), {**ROUTER_PREFILL_FLAGS, "do_remote_prefill": True,
                                                          "remote_engine_id": "e", "remote_block_ids": [1, 2]})
    with caplog.at_level("WARNING"):
        assert scheduler.lookup(nixl, 0).num_tokens == 0
    assert scheduler.stats.refused_handoffs == 1 and "no kvbridge_version" in caplog.text


@pytest.mark.parametrize(("num_tokens", "ids", "expected"), [(2**62, [3, 1, 2], 48), (10**9, [5], 16), (48, [3, 1, 2, 4, 6], 48)])
def test_num_tokens_never_exceeds_the_named_blocks(tmp_path: Path, num_tokens: int, ids: list[int], expected: int) -> None:
    """A huge (or mismatched) num_tokens is capped by the blocks named: the engine never takes unloaded tokens as loaded."""
    from kvbridge.contract import RequestInfo

    scheduler = _scheduler(tmp_path)
    req = RequestInfo("r1", tuple(range(100)), (), _good_params(num_tokens=num_tokens, block_ids=ids))
    assert scheduler.lookup(req, 0).num_tokens == expected
    scheduler.on_allocated(req, list(range(7)), expected)
    (load,) = scheduler.plan_step([]).loads
    assert len(load.block_ids) == len(load.source.remote_block_ids) == expected // 16


def test_scheduler_load_life_cycle(tmp_path: Path) -> None:
    """The consumer scheduler on the core's LoadBook: the plan's source is a typed UcxSource; a request that
    ends before its pull went out frees at once, one that ends mid-pull is held and named in the next plan;
    a failed pull is never offered again (the engine recomputes)."""
    from kvbridge.connectors.ucx import UcxSource

    from kvbridge.contract import RequestInfo  # (ruff's isort keeps kvbridge.connectors apart)

    scheduler = _scheduler(tmp_path)
    params = _good_params(grant="")

    def admitted(rid: str, blocks: list[int]) -> RequestInfo:
        req = RequestInfo(rid, tuple(range(100)), (), params)
        assert scheduler.lookup(req, 0).num_tokens == 48
        scheduler.on_allocated(req, blocks, 48)
        return req

    dropped = admitted("dropped", [7, 8, 9, 10])
    assert not scheduler.on_finished(dropped, [7, 8, 9, 10]).delay_free  # never handed to a worker
    assert scheduler.plan_step([]).loads == ()

    ended, failed = admitted("ended", [7, 8, 9, 10]), admitted("failed", [20, 21, 22, 23])
    plan = scheduler.plan_step([])
    assert {op.request_id for op in plan.loads} == {"ended", "failed"}
    source = plan.loads[0].source
    assert isinstance(source, UcxSource) and source.remote_block_ids == (3, 1, 2) and source.remote_request_id == "r"
    assert scheduler.on_finished(ended, [7, 8, 9, 10]).delay_free  # the pull still writes its blocks
    assert scheduler.plan_step([]).held == ("ended",)

    scheduler.on_report(WorkerReport(frozenset({"ended", "failed"}), frozenset(), frozenset({21})))
    assert scheduler.lookup(failed, 0).num_tokens == 0  # the failed-load guard
    assert not scheduler.on_finished(failed, [20, 21, 22, 23]).delay_free
    assert scheduler.lookup(failed, 0).num_tokens == 48  # a new life of the id: offered again

