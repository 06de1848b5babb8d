"""Fault injection for the ``ucx`` peer backend, with real processes and sockets: a producer SIGKILLed before
the pull, after the handshake, and while the consumer releases; a consumer SIGKILLed mid-pull; a producer
whose layout fingerprint lies; hostile transfer params that reach the producer (those its scheduler refuses:
tests/test_faults_ucx_params.py); a hostile control message; a bounded soak.

Every fault ends in a named kvbridge error inside the backend, surfacing as a reported load failure (the
affected blocks only, in ``failed_blocks``) within a stated deadline, or is a miss at lookup; nothing
hangs, the consumer (this process) survives, and the producer's held blocks are always released
(release, aborted release, or lease expiry). Every fault is real unless its test says it is a fake.

The consumers here use the two-sided path (``lane="two-sided"``: chunks tag-sent by the producer), whose
faults differ from the one-sided lanes' (tests/test_ucx_onesided.py): a killed two-sided pull keeps the
bit-exact chunks that arrived, a one-sided read counts nothing the producer did not confirm.

Peers run in their own processes (tests/helpers/ucx_fault_peer.py) with a small KV cache: 4 layers, 4 KV heads,
head size 64, bf16, block size 16 — 16 KiB per block and layer, 64 KiB per block; the consumer runs here
with ``timeout_s`` = 2 s.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.connectors.ucx import CONTROL_BYTES, CONTROL_TAG, WORKER_ADDRESS, UcxBackend, UcxOptions  # noqa: E402
from kvbridge.connectors.ucx import runtime as rtmod  # noqa: E402

from kvbridge.contract import WorkerReport  # noqa: E402
from kvbridge.metadata.client import MetadataClient  # noqa: E402
from kvbridge.metadata.types import PeerInfo  # noqa: E402
from kvbridge.testing import MiniEngine  # noqa: E402

HELPER = Path(__file__).parent / "helpers" / "ucx_fault_peer.py"


def _load_hostpeer() -> Any:
    # by file path: putting tests/ on sys.path would make tests/vllm look like an installed vLLM
    spec = importlib.util.spec_from_file_location("kvbridge_tests_hostpeer", HELPER.with_name("hostpeer.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_hostpeer = _load_hostpeer()  # its JsonLines reads a peer's answers
GEOMETRY: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 4, "head_size": 64, "block_size": 16, "dtype": torch.bfloat16}
BLOCK_BYTES = 4 * 4 * 16 * 2 * 64 * 2  # 64 KiB per block, all layers
TIMEOUT_S = 2.0  # the consumer's timeout_s: a load not over this long after it began fails, whole
DEAD_PEER_S = 3.0  # a dead producer's metadata port: failed blocks within this (connection refused, no timeout)
# a dead producer behind a cached UCX endpoint: the load's deadline, plus room for a busy machine (the aborted
# release no longer counts: it runs off the load's path, connectors/ucx/releaser.py)
SILENT_PEER_S = TIMEOUT_S + 3.0
LEASE_S = 3.0  # the shared producer's lease
log_name = "kvbridge.connectors.ucx"


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


class Peer:
    """A peer engine in another process (tests/helpers/ucx_fault_peer.py), driven by JSON lines; answers within ``timeout``."""

    def __init__(self, role: str, out: Path, *args: str):
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HELPER.parent), os.environ.get("PYTHONPATH")]))}
        self.out = out
        self._stderr = open(out / "stderr.log", "w")  # noqa: SIM115 - closed in close()/kill()
        self.proc = subprocess.Popen([sys.executable, str(HELPER), role, str(out), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True)
        self._lines = _hostpeer.JsonLines(self.proc, f"peer {self.proc.pid}", (self.out / "stderr.log").read_text)
        assert self._read(60)["ready"]

    def _read(self, timeout: float) -> dict[str, Any]:
        return self._lines.read(timeout)

    def ask(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def prefill(self, *reqs: tuple[str, int, int]) -> dict[str, dict[str, Any]]:
        return dict(self.ask(op="prefill", reqs=[list(r) for r in reqs])["params"])

    def state(self) -> dict[str, Any]:
        return self.ask(op="state")

    def wait_freed(self, rid: str, timeout: float) -> float:
        """Seconds until ``rid`` is reported in the producer's ``finished_saving``; fails past ``timeout``."""
        t0 = time.monotonic()
        while rid not in self.state()["freed"]:
            assert time.monotonic() - t0 < timeout, f"producer still holds {rid} after {timeout}s"
            time.sleep(0.05)
        return time.monotonic() - t0

    def _reap(self) -> None:
        self._lines.thread.join(10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._reap()

    def close(self) -> int | None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit", timeout=20)
                self.proc.wait(20)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        if not self._stderr.closed:
            self._reap()
        return self.proc.returncode


def _consumer(tmp: Path, engine_id: str = "consumer", num_blocks: int = 128, **options: Any) -> MiniEngine:
    options.setdefault("lane", "two-sided")  # this suite covers the chunked tag path; one-sided: test_ucx_onesided.py
    opts = UcxOptions(registry_dir=str(tmp / "registry-c"), timeout_s=TIMEOUT_S, chunk_bytes=1 << 20, **options)
    return MiniEngine(UcxBackend(opts), engine_id=engine_id, role="consumer", num_blocks=num_blocks, seed=2, **GEOMETRY)


def _load_only(engine: MiniEngine, rid: str, tokens: list[int], params: Any, timeout: float = 20.0) -> tuple[list[int], WorkerReport, float]:
    """The consumer's part of a prefill up to the load's report: its blocks, the merged report, seconds taken."""
    req = engine.request(rid, tokens, params)
    n = engine.scheduler.lookup(req, 0).num_tokens
    assert n > 0, "lookup refused the params"
    ids = engine.allocate(-(-len(tokens) // engine.block_size))
    engine.scheduler.on_allocated(req, ids, n)
    t0 = time.monotonic()
    engine.worker.start_step(engine.scheduler.plan_step([]))
    engine.worker.finish_step()
    reports = engine.wait_for(lambda r: rid in r.finished_loading, timeout)
    elapsed = time.monotonic() - t0
    engine.free(ids)  # the engine recomputes or drops them; the backend wrote nothing more into them
    engine.scheduler.on_finished(req, ids)
    return ids, WorkerReport.merge(reports), elapsed


def _assert_loads_bit_exact(consumer: MiniEngine, producer: Peer, rid: str, n_tokens: int, seed: int) -> None:
    """The worker is still usable: a full load from a live producer arrives bit-exact and is released."""
    params = producer.prefill((rid, n_tokens, seed))[rid]
    got = consumer.prefill(f"{rid}-c", _tokens(n_tokens, seed), params, timeout=20)
    n = n_tokens // 16  # every full block (the engine recomputes the prompt's last token, not its block)
    assert got.failed_blocks == [] and len(got.loaded_blocks) == n
    assert torch.equal(got.snapshot[:, :n], consumer.expected(got.keys[:n]))
    producer.wait_freed(rid, 5)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    """A healthy producer shared by the tests (short lease: the consumer-killed test waits for it)."""
    p = Peer("producer", tmp_path_factory.mktemp("ucx-live"), "--engine-id", "live", "--lease", str(LEASE_S))
    try:
        yield p
    finally:
        assert p.close() == 0


# ---- 1. producer dead before the pull -----------------------------------------------------------------
@pytest.mark.parametrize("when", ["before-handshake", "after-handshake"])
def test_producer_killed_before_the_pull(tmp_path: Path, live: Peer, when: str, caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL before the consumer pulls: with no handshake yet (its metadata port refuses: failed within
    DEAD_PEER_S), or after one (the cached UCX endpoint goes to a dead worker: no status, failed within
    SILENT_PEER_S). The consumer survives and its next load from a live producer is bit-exact."""
    victim = Peer("producer", tmp_path / "victim", "--engine-id", f"victim-{when}")
    consumer = _consumer(tmp_path)
    try:
        params = victim.prefill(("first", 100, 1), ("doomed", 100, 2))
        if when == "after-handshake":
            ids, report, _ = _load_only(consumer, "first-c", _tokens(100, 1), params["first"])
            assert not report.failed_blocks
        victim.kill()
        with caplog.at_level(logging.INFO, logger=log_name):
            ids, report, elapsed = _load_only(consumer, "doomed-c", _tokens(100, 2), params["doomed"])
        failures = [r for r in caplog.records if "pull of doomed-c" in r.getMessage()]
        assert failures and all(r.levelno == logging.WARNING for r in failures)  # a named error, not a traceback
        assert any(e in failures[0].getMessage() for e in ("PeerUnreachable", "TransferTimeout"))
        assert not consumer.worker._puller._peers  # type: ignore[attr-defined]  # the dead endpoint is dropped
        assert report.failed_blocks == set(ids[:6])  # the six full blocks; the partial one was never asked for
        assert elapsed < (DEAD_PEER_S if when == "before-handshake" else SILENT_PEER_S), elapsed
        assert not consumer.read(ids).any()  # nothing written into the failed blocks
        assert consumer.worker.stats.failed_blocks == 6  # type: ignore[attr-defined]
        _assert_loads_bit_exact(consumer, live, f"after-kill-{when}", 100, 3)
    finally:
        consumer.close()
        victim.close()
    print(f"\n[{when}] producer killed: 6 blocks failed in {elapsed:.2f}s")


# ---- 2. producer dead while the consumer releases -----------------------------------------------------
def test_producer_killed_during_release(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The transfer is complete; the producer is SIGKILLed while the consumer's release call is in flight.
    The consumer keeps the bytes (bit-exact) and reports no failed block, never waiting on the release
    (it runs on the releaser's lane for that producer, after the load's report); the release's failure is
    logged within its deadline of the kill.
    (``--hang-release`` is the only fake: the producer's release handler blocks so the kill lands mid-call.)"""
    p = Peer("producer", tmp_path / "p", "--engine-id", "forgetful", "--hang-release")
    consumer = _consumer(tmp_path)
    out: dict[str, Any] = {}
    try:
        params = p.prefill(("kept", 200, 4))["kept"]
        with caplog.at_level(logging.INFO, logger=log_name):
            loader = threading.Thread(target=lambda: out.update(r=_load_only(consumer, "kept-c", _tokens(200, 4), params)))
            loader.start()
            deadline = time.monotonic() + 10
            while not (p.out / "releasing").exists():
                assert time.monotonic() < deadline, "the release never reached the producer"
                time.sleep(0.005)
            loader.join(TIMEOUT_S)  # reported while the producer still hangs in the release
            assert not loader.is_alive(), "the load waited on its release"
            p.kill()
            killed_at = time.monotonic()
            while not any("release of kept" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() - killed_at < TIMEOUT_S + 1.0, "the failed release was never logged"
                time.sleep(0.01)
            detect = time.monotonic() - killed_at
        ids, report, _ = out["r"]
        assert report.failed_blocks == frozenset() and "kept-c" in report.finished_loading
        assert torch.equal(consumer.read(ids[:12]), consumer.expected(consumer.request("x", _tokens(200, 4)).block_keys[:12]))
        assert detect < TIMEOUT_S + 1.0  # the release's deadline (timeout_s / 2, one retry) plus slack
        assert consumer.worker.stats.load_failures == 0  # type: ignore[attr-defined]
    finally:
        consumer.close()
        p.close()
    print(f"\nproducer killed during release: the failed release logged {detect:.2f}s after the kill")


# ---- 3. consumer dead mid-pull --------------------------------------------------------------------------
def test_consumer_killed_mid_pull_producer_serves_on_and_lease_frees(tmp_path: Path, live: Peer) -> None:
    """A consumer process SIGKILLed while it pulls: the producer lives, serves another consumer bit-exact
    meanwhile, and frees the dead consumer's request by lease expiry (LEASE_S; a lease never expires under
    a pull still being served, so: lease or the producer's send deadline, whichever is later)."""
    before = live.state()["stats"]
    victim = Peer("consumer", tmp_path / "c", "--engine-id", "doomed-consumer", "--chunk-bytes", str(2 * BLOCK_BYTES),
                  "--lane", "two-sided")
    consumer = _consumer(tmp_path, engine_id="survivor")
    try:
        live.ask(op="slow", seconds=0.3)  # 10 chunks of 2 blocks, 0.3 s per gather
        params = live.prefill(("orphan", 20 * 16 + 5, 5))["orphan"]
        t_prefill = time.monotonic()
        assert victim.ask(op="load", rid="orphan-c", tokens=20 * 16 + 5, seed=5, params=params)["started"] == 320
        deadline = time.monotonic() + 10
        while not (live.out / "gathered.2").exists():
            assert time.monotonic() < deadline, "the pull never started"
            time.sleep(0.005)
        victim.kill()
        live.ask(op="slow", seconds=0)
        _assert_loads_bit_exact(consumer, live, "bystander", 150, 6)  # served while the orphan's pull dies
        freed_after = live.wait_freed("orphan", LEASE_S + 2 * 2.0 + 5)  # lease, the producer's send deadline
        since_prefill = time.monotonic() - t_prefill
        state = live.state()
        assert state["stats"]["expired_leases"] == before["expired_leases"] + 1
        assert state["held"] == [] and live.proc.poll() is None
        _assert_loads_bit_exact(consumer, live, "after-orphan", 80, 7)
    finally:
        live.ask(op="slow", seconds=0)
        consumer.close()
        victim.close()
    print(f"\nconsumer killed mid-pull: orphan freed by lease {since_prefill:.1f}s after prefill ({freed_after:.1f}s waited)")


# ---- 4. a fingerprint that lies ---------------------------------------------------------------------------
@pytest.mark.parametrize("real_head_size", [32, 128], ids=["blocks-smaller", "blocks-larger"])
def test_lying_fingerprint_never_scatters_wrong_sized_data(tmp_path: Path, real_head_size: int) -> None:
    """A producer whose handshake claims our layout fingerprint but whose blocks have another size. FAKE: the
    forging (``--forge-head-size``: the producer advertises and accepts the fingerprint of head size 64).
    Smaller blocks would arrive as short messages, which UCX completes without an error; larger ones truncate.
    Either way the load fails at the status (its real bytes per block), fast, and the KV stays untouched."""
    p = Peer("producer", tmp_path / "liar", "--engine-id", f"liar-{real_head_size}", "--head-size", str(real_head_size),
             "--forge-head-size", "64")
    consumer = _consumer(tmp_path)
    try:
        params = p.prefill(("lie", 200, 8))["lie"]
        ids, report, elapsed = _load_only(consumer, "lie-c", _tokens(200, 8), params)
        assert report.failed_blocks == set(ids[:12]) and elapsed < DEAD_PEER_S
        assert not consumer.read(ids).any()  # no byte of the producer's reached the KV
        assert consumer.worker.stats.load_bytes == 0  # type: ignore[attr-defined]
        p.wait_freed("lie", 5)  # the aborted release freed the producer's blocks
        assert p.proc.poll() is None
    finally:
        consumer.close()
        assert p.close() == 0


# ---- 5. hostile params that reach the producer (those the scheduler refuses: tests/test_faults_ucx_params.py)
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on return: nothing listens there


def _miss(consumer: MiniEngine, params: dict[str, Any]) -> bool:
    return consumer.scheduler.lookup(consumer.request("probe", _tokens(100, 0), params), 0).num_tokens == 0


def test_hostile_params_reaching_the_producer_fail_those_blocks_fast(tmp_path: Path, live: Peer) -> None:
    """Well-formed but wrong params: block ids the producer does not have (it refuses the pull), too few
    block ids for num_tokens (capped: the named blocks load bit-exact), a closed metadata port
    (PeerUnreachable), a request id the producer never held (refused: its blocks may belong to anyone
    now). Each within a deadline; the worker stays usable."""
    consumer = _consumer(tmp_path)
    try:
        sent = live.prefill(("h-range", 100, 9), ("h-short", 100, 10), ("h-closed", 100, 11))
        before = live.state()["stats"]["refused_pulls"]
        bad = dict(sent["h-range"], block_ids=[10**6, *sent["h-range"]["block_ids"][1:]])
        assert _miss(consumer, bad)  # the producer's grant names other ids: refused at lookup already
        del bad["grant"]  # without it, the params reach the producer, whose own checks must hold
        ids, report, elapsed = _load_only(consumer, "h-range-c", _tokens(100, 9), bad)
        assert report.failed_blocks == set(ids[:6]) and elapsed < DEAD_PEER_S and not consumer.read(ids).any()
        assert live.state()["stats"]["refused_pulls"] == before + 1
        live.wait_freed("h-range", 5)  # the consumer's aborted release frees the real request at once

        short = dict(sent["h-short"], block_ids=sent["h-short"]["block_ids"][:2])  # num_tokens still says 96
        assert _miss(consumer, short)
        del short["grant"]
        ids, report, elapsed = _load_only(consumer, "h-short-c", _tokens(100, 10), short)
        assert report.failed_blocks == frozenset()
        keys = consumer.request("x", _tokens(100, 10)).block_keys
        assert torch.equal(consumer.read(ids[:2]), consumer.expected(keys[:2]))
        assert consumer.worker.stats.load_blocks == 2  # type: ignore[attr-defined]

        closed = dict(sent["h-closed"], metadata_address=f"127.0.0.1:{_closed_port()}")
        ids, report, elapsed = _load_only(consumer, "h-closed-c", _tokens(100, 11), closed)
        assert report.failed_blocks == set(ids[:6]) and elapsed < DEAD_PEER_S
        forged = dict(sent["h-closed"], request_id="never-held")  # real blocks, a request the producer never held
        ids, report, elapsed = _load_only(consumer, "h-forged-c", _tokens(100, 11), forged)
        assert report.failed_blocks == set(ids[:6]) and not consumer.read(ids).any()
        _assert_loads_bit_exact(consumer, live, "h-after", 60, 12)
    finally:
        consumer.close()


def test_oversized_control_message_does_not_stop_the_producer(tmp_path: Path, live: Peer) -> None:
    """A hostile consumer handshakes, then sends the producer's control tag a message larger than any pull
    (the receive truncates). The producer drops it and goes on serving pulls."""
    consumer = _consumer(tmp_path, engine_id="after-rogue")
    rt = rtmod.runtime()
    address = live.state()["address"]
    client = MetadataClient(address, timeout=2.0, retries=1)
    try:
        theirs = client.handshake(PeerInfo("rogue", 0, consumer.layout.fingerprint, {WORKER_ADDRESS: rt.worker_address}))
        ep = rt.call(rt.connect(theirs.transport[WORKER_ADDRESS]), 5.0)
        tag = int.from_bytes(theirs.transport[CONTROL_TAG], "little")
        junk = np.full(CONTROL_BYTES + 4096, 0xAB, dtype=np.uint8)
        rt.call(ep.send(junk, tag=tag, force_tag=True), 5.0)
        rt.call(ep.send(np.full(64, 0xCD, dtype=np.uint8), tag=tag, force_tag=True), 5.0)  # and a malformed one
        rt.close_endpoint(ep)
        _assert_loads_bit_exact(consumer, live, "after-rogue", 120, 13)
    finally:
        client.close()
        consumer.close()


# ---- 6. bounded soak ------------------------------------------------------------------------------------------
SOAK_SECONDS = float(os.environ.get("KVBRIDGE_SOAK_SECONDS", "20"))
RSS_BOUND_MIB = 48  # growth allowed after warm-up (3 rounds), this process and the producer's
# the process-wide UCX runtime's threads outlive every engine: its loop, and ucxx's notifier (made with the
# runtime, so new here only when this test is the first of the process to start one)
PERSISTENT_THREADS = {"kvbridge-ucx-loop", "UCX-Py Async Notifier Thread"}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _children() -> set[int]:
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out |= {int(pid) for pid in f.read().split()}
        except FileNotFoundError:  # the thread ended between the listing and the read: it has no children
            continue
    return out


@pytest.mark.slow
def test_soak_concurrent_pulls_bit_exact_and_flat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SOAK_SECONDS (env KVBRIDGE_SOAK_SECONDS, default 20: the file stays under 90 s on 2 cores) of rounds of 6 concurrent requests (17..400 tokens)
    from a producer process; every loaded block is checked against what the engine computes. Afterwards:
    no failed block, RSS (ours and the producer's) within RSS_BOUND_MIB of its value after warm-up, open fds
    flat, no thread left but PERSISTENT_THREADS, no child process, the producer's metadata port closed."""
    threads_before = {t.name for t in threading.enumerate()}
    children_before = _children()
    producer = Peer("producer", tmp_path / "soak", "--engine-id", "soak", "--num-blocks", "512")
    consumer = _consumer(tmp_path, engine_id="soak-c", num_blocks=6 * 25)  # a round may need 6 x 400 tokens
    rng = np.random.default_rng(0)
    requests = blocks = errors = rounds = 0
    rss0 = fds0 = prss0 = pfds0 = 0.0
    t0 = time.monotonic()
    try:
        address = producer.state()["address"]
        while time.monotonic() - t0 < SOAK_SECONDS:
            batch = [(f"s{rounds}-{i}", int(rng.integers(17, 401)), int(rng.integers(0, 1 << 30))) for i in range(6)]
            params = producer.prefill(*batch)
            got = consumer.prefill_many([(f"{rid}-c", _tokens(n, seed), params[rid]) for rid, n, seed in batch], timeout=30)
            for (_rid, n, _seed), r in zip(batch, got):
                full = n // 16
                errors += len(r.failed_blocks) + int(len(r.loaded_blocks) != full)
                assert torch.equal(r.snapshot[:, :full], consumer.expected(r.keys[:full]))
                blocks += len(r.loaded_blocks)
            requests += len(batch)
            rounds += 1
            if rounds == 3:
                state = producer.state()
                rss0, fds0, prss0, pfds0 = _rss_mib(), _fds(), state["rss_mib"], state["fds"]
        rss1, fds1 = _rss_mib(), _fds()
        state = producer.state()
        deadline = time.monotonic() + 5
        while state["held"] and time.monotonic() < deadline:
            time.sleep(0.05)
            state = producer.state()
        elapsed = time.monotonic() - t0
    finally:
        consumer.close()
        rc = producer.close()
    threads_after = {t.name for t in threading.enumerate()}
    with socket.socket() as s:
        host, _, port = address.rpartition(":")
        port_open = s.connect_ex((host, int(port))) == 0
    mib = blocks * BLOCK_BYTES / 2**20
    with capsys.disabled():
        print(f"\nsoak ucx: {requests} requests in {rounds} rounds, {blocks} blocks, {mib:.0f} MiB in {elapsed:.1f}s "
              f"({mib / elapsed:.0f} MiB/s), {errors} errors; rss {rss0:.0f} -> {rss1:.0f} MiB, fds {fds0:.0f} -> {fds1}, "
              f"producer rss {prss0:.0f} -> {state['rss_mib']:.0f} MiB, fds {pfds0:.0f} -> {state['fds']}; "
              f"producer served {state['stats']['served_pulls']} pulls, {state['stats']['releases']} releases, "
              f"{state['stats']['expired_leases']} expired; new threads {sorted(threads_after - threads_before)}")
    assert errors == 0 and rounds >= 3
    assert state["held"] == [] and state["stats"]["expired_leases"] == 0 and state["stats"]["served_pulls"] == requests
    assert rss1 - rss0 < RSS_BOUND_MIB and state["rss_mib"] - prss0 < RSS_BOUND_MIB
    assert fds1 <= fds0 + 2 and state["fds"] <= pfds0 + 2
    assert threads_after - threads_before <= PERSISTENT_THREADS
    assert rc == 0 and _children() <= children_before and not port_open
