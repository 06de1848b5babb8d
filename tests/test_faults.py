"""Fault injection outside any one backend: dead or silent peers, a metadata server that dies and comes
back, hostile plans and parameters, and a bounded soak. Every fault here is real (processes, sockets,
files) unless a test says otherwise."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge import registry
from kvbridge.contract import BlockLoad, StepPlan
from kvbridge.errors import PeerUnreachable, TransferTimeout
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.types import PeerInfo
from kvbridge.testing import MiniEngine

ROOT = Path(__file__).resolve().parents[1]
FP = LayoutFingerprint("bfloat16", 4, 2, 16, 16, 1024, "blocks_first")


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _store_targets(tmp_path: Path):
    return {
        "memory": registry.create("memory", {"name": f"faults-{tmp_path}"}),
        "fs": registry.create("fs", {"path": str(tmp_path / "fs")}),
        "chain": registry.create(
            "chain", {"tiers": [{"backend": "cpu", "capacity_bytes": 64 << 20}, {"backend": "fs", "path": str(tmp_path / "c")}]}
        ),
    }


@pytest.mark.parametrize("name", ["memory", "fs", "chain"])
def test_plan_with_block_ids_out_of_range_fails_those_loads_only(tmp_path, name):
    """A plan naming blocks the engine does not have is reported as failed; other loads in it succeed."""
    backend = _store_targets(tmp_path)[name]
    producer = MiniEngine(backend, engine_id="p", role="producer")
    consumer = MiniEngine(backend, engine_id="c", role="consumer", seed=5)
    try:
        tokens = _tokens(3 * 16 + 1, seed=1)
        producer.prefill("a", tokens)
        req = consumer.request("good", tokens)
        assert consumer.scheduler.lookup(req, 0).num_tokens == 48
        ids = consumer.allocate(4)
        consumer.scheduler.on_allocated(req, ids, 48)
        plan = consumer.scheduler.plan_step([])
        bad = BlockLoad("evil", (10**6, -3, 2), plan.loads[0].keys, plan.loads[0].source)
        consumer.worker.start_step(StepPlan(loads=(*plan.loads, bad)))
        consumer.worker.finish_step()
        seen, failed = set(), set()
        deadline = time.monotonic() + 20
        while seen != {"good", "evil"} and time.monotonic() < deadline:
            report = consumer.worker.poll()
            seen |= report.finished_loading
            failed |= report.failed_blocks
            time.sleep(0.005)
        assert seen == {"good", "evil"}
        assert {10**6, -3} <= failed and not failed & set(ids)
        assert torch.equal(consumer.read(ids[:3]), consumer.expected(req.block_keys[:3]))
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("computed", [10**9, 2**62])
def test_lookup_with_absurd_token_counts_is_a_miss(tmp_path, computed):
    engine = MiniEngine(_store_targets(tmp_path)["fs"], engine_id="e")
    try:
        engine.prefill("a", _tokens(64, seed=2))
        assert engine.scheduler.lookup(engine.request("b", _tokens(64, seed=2)), computed).num_tokens == 0
    finally:
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "metadata-server", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("listening on"), line
    return proc


def test_metadata_server_killed_and_restarted_clients_reconnect_and_leases_recover():
    port = _free_port()
    server = _start_server(port)
    client = MetadataClient(f"127.0.0.1:{port}", timeout=1.0, retries=2, backoff_s=0.05, max_backoff_s=0.2)
    hashes = [bytes([i]) * 16 for i in range(8)]
    try:
        client.publish("prefill-0", hashes, ttl_s=30)
        assert client.lookup(hashes)[0].num_blocks == 8
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable):
            client.lookup(hashes)
        assert time.monotonic() - t0 < 10  # a deadline, not a hang
        server = _start_server(port)  # same address; the lease state died with the old process
        client.wait_ready(10)
        assert client.lookup(hashes) == []
        assert client.heartbeat("prefill-0", ttl_s=30) is False  # "you were forgotten": publish again
        client.publish("prefill-0", hashes, ttl_s=30)
        assert client.lookup(hashes)[0].num_blocks == 8
    finally:
        client.close()
        server.kill()
        server.wait(10)


def test_peer_that_accepts_and_never_answers_hits_the_deadline():
    """A TCP listener that accepts and then says nothing (a hung process, a black-holing proxy)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    client = MetadataClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.5, retries=1, backoff_s=0.01)
    try:
        t0 = time.monotonic()
        with pytest.raises((TransferTimeout, PeerUnreachable)):
            client.handshake(PeerInfo("c", 0, FP))
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
        stop.set()
        thread.join(5)
        for s in held:
            s.close()
        silent.close()


def test_nothing_that_crosses_a_process_boundary_is_unpickled():
    """Static check over the package: no code-executing deserialization anywhere in kvbridge."""
    banned = re.compile(r"\b(import pickle|from pickle|cPickle|cloudpickle|dill|marshal\.loads|pickle\.loads?|shelve)\b|torch\.load\((?![^)]*weights_only=True)")
    offenders = []
    for folder in ("kvbridge", "connectors"):
        for path in (ROOT / folder).rglob("*.py"):
            if "/v1/" in str(path):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if banned.search(line) and "noqa: pickle-free" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


SOAK_SECONDS = float(os.environ.get("KVBRIDGE_SOAK_SECONDS", "20"))


@pytest.mark.slow
def test_soak_chain_concurrent_requests_bit_exact_and_flat(tmp_path, capsys):
    """Many concurrent requests through cpu+fs, bounded in time; every block checked; nothing leaks."""
    threads_before = threading.active_count()
    fds_before = _fds()
    options = {"tiers": [{"backend": "cpu", "capacity_bytes": 8 << 20}, {"backend": "fs", "path": str(tmp_path / "kv")}]}
    producer = MiniEngine(registry.create("chain", options), engine_id="p", role="producer", num_blocks=256)
    consumer = MiniEngine(registry.create("chain", options), engine_id="c", role="consumer", num_blocks=256, seed=3)
    requests = blocks = errors = rounds = 0
    rss_start = None
    t0 = time.monotonic()
    rng = np.random.default_rng(0)
    try:
        while time.monotonic() - t0 < SOAK_SECONDS:
            batch = [(f"r{rounds}-{i}", _tokens(int(rng.integers(17, 160)), seed=int(rng.integers(0, 64))), None) for i in range(8)]
            sent = {r.request_id: r for r in producer.prefill_many(batch)}
            got = consumer.prefill_many([(f"{rid}-c", toks, None) for rid, toks, _ in batch])
            for r in got:
                origin = sent[r.request_id.removesuffix("-c")]
                n = len(r.loaded_blocks)
                errors += len(r.failed_blocks)
                assert n == len(origin.keys)
                assert torch.equal(r.snapshot[:, :n], origin.snapshot[:, :n])
                blocks += n
            requests += len(batch)
            rounds += 1
            if rounds == 3:
                rss_start = _rss_mib()
        rss_end = _rss_mib()
    finally:
        producer.close()
        consumer.close()
    elapsed = time.monotonic() - t0
    with capsys.disabled():
        print(
            f"\nsoak chain(cpu+fs): {requests} requests, {blocks} blocks loaded "
            f"({blocks * producer.layout.num_layers * producer.layout.block_bytes / 2**20:.0f} MiB) in {elapsed:.0f}s, "
            f"{errors} failed blocks, rss {rss_start:.0f} -> {rss_end:.0f} MiB, fds {fds_before} -> {_fds()}, "
            f"threads {threads_before} -> {threading.active_count()}, maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"
        )
    assert errors == 0
    assert rss_start is not None and rss_end - rss_start < 64
    assert _fds() <= fds_before + 2
    assert threading.active_count() <= threads_before


def test_mini_engine_counts_only_tokens_that_arrived(tmp_path):
    """A consumer whose every load failed loaded nothing (it was offered the blocks, none arrived)."""
    from kvbridge.testing import MiniEngine
    from kvbridge.testing.targets import target_for

    target = target_for("memory", tmp_path)
    assert target.consumer is not None and target.vanish is not None
    producer = MiniEngine(target.producer, engine_id="p", role="producer")
    consumer = MiniEngine(target.consumer, engine_id="c", role="consumer", seed=2)
    try:
        tokens = list(range(6 * 16 + 3))
        producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens, before_load=lambda: target.vanish(producer, consumer))
        assert got.offered_tokens == 96 and got.loaded_tokens == 0 and got.loaded_blocks == []
        assert len(got.failed_blocks) == 6
    finally:
        producer.close()
        consumer.close()
