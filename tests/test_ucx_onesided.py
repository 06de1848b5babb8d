"""One-sided ucx lanes between processes: the consumer reads the producer's KV straight into its own.

The producer (tests/helpers/ucx_peer.py, Llama-3-8B-shaped KV: 2 MiB per block) runs with ``--idle``: no engine step
follows its prefill, as after vLLM's offline ``LLM.generate`` returns. Every load is checked byte for byte
against what left the producer, and every fault must end in failed blocks (nothing counted as loaded)
within a deadline, with this process alive: a producer stopped or killed, a lease over, block ids altered
on the way, a producer restarted on the same address.
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")
from kvbridge.connectors.ucx import onesided  # noqa: E402

if not onesided.available()[0]:
    pytest.skip(f"native one-sided module: {onesided.available()[1]}", allow_module_level=True)


def _sibling(name: str) -> Any:
    # by file path: putting tests/ on sys.path would make tests/vllm look like an installed vLLM
    spec = importlib.util.spec_from_file_location(f"kvbridge_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_kit = _sibling("test_ucx")
Producer, _consumer, _load_only, _tokens = _kit.Producer, _kit._consumer, _kit._load_only, _kit._tokens

from kvbridge.testing import MiniEngine  # noqa: E402

TIMEOUT_S = 2.0


def _lane(engine: MiniEngine) -> set[str]:
    peers = engine.worker._puller._peers  # type: ignore[attr-defined]
    return {p.source.lane for p in peers.values() if p.source is not None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("lane", ["auto", "ucp", "tcp"])
def test_idle_producer_hands_off_bit_exact(tmp_path: Path, lane: str) -> None:
    p = Producer(tmp_path / "p", "--idle", "--num-blocks", "72")
    consumer = _consumer(tmp_path, lane=lane, timeout_s=TIMEOUT_S)
    try:
        params = p.prefill("idle", 1000, seed=11)
        got = consumer.prefill("idle-c", _tokens(1000, 11), params, timeout=30)
        assert got.failed_blocks == [] and len(got.loaded_blocks) == 62
        assert torch.equal(got.snapshot[:, :62], p.sent("idle"))
        assert _lane(consumer) == {"cma" if lane == "auto" else lane}
        assert consumer.worker.stats.load_bytes == 62 * 2 * 2**20  # type: ignore[attr-defined]
        p.wait_freed()  # the release reaches the engine at its next step
    finally:
        consumer.close()
        p.close()


@pytest.mark.parametrize("lane", ["auto", "ucp", "tcp"])
def test_a_sealed_read_counts_without_a_round_trip(tmp_path: Path, lane: str) -> None:
    """A producer whose engine stepped after the hand-off has sealed it: the consumer counts the read at
    once (no confirming release on the load's path) and the release still frees the producer's blocks;
    over cma the seal is one more process_vm_readv, over ucp a GET of the registered table, over tcp
    the word each stream's server reads after its data."""
    p = Producer(tmp_path / "p", "--num-blocks", "72")
    consumer = _consumer(tmp_path, lane=lane, timeout_s=TIMEOUT_S)
    try:
        params = p.prefill("sealed", 500, seed=21)
        assert params["seal"][0] >= 0 and int(params["seal"][1], 16) != 0
        got = consumer.prefill("sealed-c", _tokens(500, 21), params, timeout=30)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :31], p.sent("sealed"))
        assert consumer.worker.stats.sealed_loads == 1  # type: ignore[attr-defined]
        assert _lane(consumer) == {"cma" if lane == "auto" else lane}
        p.wait_freed()  # the release, sent off the load's path, arrived
        # the peer is known now: over cma and tcp the next read starts from the engine's step, on native threads
        again = consumer.prefill("sealed-c2", _tokens(500, 23), p.prefill("sealed2", 500, seed=23), timeout=30)
        assert again.failed_blocks == [] and torch.equal(again.snapshot[:, :31], p.sent("sealed2"))
        stats = consumer.worker.stats  # type: ignore[attr-defined]
        assert (stats.sealed_loads, stats.started_loads) == (2, 0 if lane == "ucp" else 1)
        p.wait_freed()
    finally:
        consumer.close()
        p.close()


@pytest.mark.parametrize("lane", ["cma", "ucp", "cma-started", "tcp", "tcp-started"])
def test_a_hold_that_ends_during_the_read_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: str) -> None:
    """The hold ends (another consumer released it) after the blocks were read but before the seal is
    checked: the seal is gone, the confirming release says no, every block fails. The timing is forced
    (the release runs inside the read; ``cma-started``: a known peer, whose read runs on a native thread,
    loses the hold just before it starts; ``tcp`` reads always start on native threads, which bring the
    seal word back with the data); the producer, seal table and release are the real ones."""
    from kvbridge.connectors.ucx import UcxBackend, UcxOptions, onesided

    options = UcxOptions(registry_dir=str(tmp_path / "reg"), timeout_s=TIMEOUT_S, lane=lane.partition("-")[0])
    producer = MiniEngine(UcxBackend(options), engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(UcxBackend(options), engine_id="c", role="consumer", seed=2)
    real_read, real_start = onesided.read, onesided.start

    def lose_the_hold() -> None:
        server = producer.worker.server  # type: ignore[attr-defined]
        assert server._release("thief", "r", True, b"")  # the forced race: a live hold ends here

    def read_then_lose_the_hold(*args: Any, **kwargs: Any) -> int:
        n = real_read(*args, **kwargs)
        lose_the_hold()
        return n

    def lose_the_hold_then_start(*args: Any, **kwargs: Any) -> Any:
        lose_the_hold()  # the native thread reads the seal right after the data: the race can only come first
        return real_start(*args, **kwargs)

    try:
        tokens = _tokens(4 * 16 + 2, seed=22)
        if lane.endswith("-started"):  # a first hand-off makes the producer a known peer
            warm = producer.prefill("w", _tokens(4 * 16 + 2, seed=24))
            assert consumer.prefill("w-c", _tokens(4 * 16 + 2, seed=24), warm.finish.transfer_params).failed_blocks == []
            monkeypatch.setattr(onesided, "start", lose_the_hold_then_start)
        if lane == "tcp":
            monkeypatch.setattr(onesided, "start", lose_the_hold_then_start)
        sent = producer.prefill("r", tokens)  # steps after: the hold is sealed
        monkeypatch.setattr(onesided, "read", read_then_lose_the_hold)
        got = consumer.prefill("r-c", tokens, sent.finish.transfer_params)
        assert got.failed_blocks == sorted(got.block_ids[:4]) and got.loaded_blocks == []
        stats = consumer.worker.stats  # type: ignore[attr-defined]
        assert stats.sealed_loads == (1 if lane.endswith("-started") else 0)  # the warm-up's only
        assert stats.started_loads == (1 if lane.endswith("-started") else 0)
        assert _lane(consumer) == {lane.partition("-")[0]}
    finally:
        producer.close()
        consumer.close()


def test_altered_block_ids_count_nothing(tmp_path: Path) -> None:
    p = Producer(tmp_path / "p", "--idle", "--num-blocks", "40")
    consumer = _consumer(tmp_path, timeout_s=TIMEOUT_S)
    try:
        params = p.prefill("alt", 300, seed=12)
        params["block_ids"] = list(reversed(params["block_ids"]))  # a proxy or client changed them
        request = consumer.request("alt-c", _tokens(300, 12), params)
        assert consumer.scheduler.lookup(request, 0).num_tokens == 0  # a miss: the grant names other ids
        del params["grant"]  # and without a grant a one-sided read is refused before any byte moves
        ids, report = _load_only(consumer, "alt-d", _tokens(300, 12), params, timeout=10)
        assert report.failed_blocks == set(ids[:18]) and not consumer.read(ids[:18]).any()
    finally:
        consumer.close()
        p.close()


def _assert_all_fail_in_time(consumer: MiniEngine, rid: str, seed: int, params: dict[str, Any]) -> None:
    t0 = time.monotonic()
    ids, report = _load_only(consumer, rid, _tokens(200, seed), params, timeout=30)
    assert report.failed_blocks == set(ids[:12])
    assert time.monotonic() - t0 < TIMEOUT_S + 3


def test_stopped_then_killed_producer_confirms_nothing(tmp_path: Path) -> None:
    p = Producer(tmp_path / "p", "--idle", "--num-blocks", "40")
    consumer = _consumer(tmp_path, timeout_s=TIMEOUT_S)
    try:
        first, second = p.prefill("one", 200, seed=13), p.prefill("two", 200, seed=14)
        assert consumer.prefill("one-c", _tokens(200, 13), first).failed_blocks == []  # handshake done
        p.proc.send_signal(signal.SIGSTOP)  # memory stays readable; nobody confirms the hold
        _assert_all_fail_in_time(consumer, "two-c", 14, second)
        p.proc.kill()
        p.proc.wait()
        _assert_all_fail_in_time(consumer, "two-d", 14, second)
        # the first on the native thread; its unconfirmed read dropped the peer, so the second handshakes (refused)
        assert consumer.worker.stats.started_loads == 1  # type: ignore[attr-defined]
    finally:
        consumer.close()
        p.close()


def test_lease_over_before_the_confirmation(tmp_path: Path) -> None:
    p = Producer(tmp_path / "p", "--lease", "0.5", "--num-blocks", "40")  # steps: its lease expires
    consumer = _consumer(tmp_path, timeout_s=TIMEOUT_S)
    try:
        params = p.prefill("late", 200, seed=15)
        p.wait_freed()
        params = dict(params, expires_at=time.time() + 60)  # the consumer's clock says there is time left
        ids, report = _load_only(consumer, "late-c", _tokens(200, 15), params, timeout=10)
        assert report.failed_blocks == set(ids[:12])
    finally:
        consumer.close()
        p.close()


def test_producer_restarted_on_the_same_address(tmp_path: Path) -> None:
    port = str(_free_port())
    old = Producer(tmp_path / "old", "--idle", "--num-blocks", "40", "--metadata-port", port)
    consumer = _consumer(tmp_path, timeout_s=TIMEOUT_S)
    new: Any = None
    try:
        params = old.prefill("r", 200, seed=16)
        stale = old.prefill("s", 200, seed=17)
        assert consumer.prefill("r-c", _tokens(200, 16), params).failed_blocks == []
        old.close()
        new = Producer(tmp_path / "new", "--idle", "--num-blocks", "40", "--metadata-port", port)
        fresh = new.prefill("s", 200, seed=18)  # the same request id, other KV, in the same blocks maybe
        for rid in ("s-c1", "s-c2"):  # a cached peer (dead pid), then a new handshake with the old grant
            ids, report = _load_only(consumer, rid, _tokens(200, 17), stale, timeout=10)
            assert report.failed_blocks == set(ids[:12])
        got = consumer.prefill("s-c3", _tokens(200, 18), fresh)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :12], new.sent("s"))
    finally:
        consumer.close()
        old.close()
        if new is not None:
            new.close()


def test_without_the_native_module_the_two_sided_path_says_so() -> None:
    # an import that fails the way a wheel built without UCX headers does (the module is absent)
    code = ("import sys; sys.modules['kvbridge._ucp'] = None\n"
            "from kvbridge.connectors import ucx\nprint(ucx.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "two-sided tag sends (one-sided unavailable: kvbridge._ucp is not importable" in out.stdout
