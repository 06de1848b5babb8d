"""The ``ucx`` peer backend between processes: bit-exact pulls, a producer killed mid-transfer, leases,
two consumers at once, a refused layout. The conformance suite (tests/test_conformance.py -k ucx) covers
the contract with both engines in one process.

The producer runs in its own process (tests/helpers/ucx_peer.py) with a Llama-3-8B-shaped KV cache (32 layers,
8 KV heads, head size 128, bf16, block size 16: 2 MiB per block); the consumer runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.connectors.ucx import UcxBackend, UcxOptions, UcxWorker  # noqa: E402
from kvbridge.connectors.ucx import runtime as rtmod  # noqa: E402

import kvbridge  # noqa: E402
from kvbridge.contract import WorkerReport  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.testing import MiniEngine  # noqa: E402

PEER = Path(__file__).parent / "helpers" / "ucx_peer.py"
GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": torch.bfloat16}


class Producer:
    """A producer engine in another process (tests/helpers/ucx_peer.py), driven by JSON lines."""

    def __init__(self, out: Path, *args: str):
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PEER.parent), os.environ.get("PYTHONPATH")]))}
        self.out = out
        self.proc = subprocess.Popen([sys.executable, str(PEER), str(out), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        assert self._read()["ready"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"producer exited (rc {self.proc.poll()})"
        return dict(json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def prefill(self, rid: str, tokens: int, seed: int) -> dict[str, Any]:
        return dict(self.ask(op="prefill", rid=rid, tokens=tokens, seed=seed)["params"])

    def sent(self, rid: str) -> torch.Tensor:
        return torch.load(self.out / f"{rid}.pt")

    def wait_freed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ask(op="held")["held"]:
            assert time.monotonic() < deadline, "producer still holds blocks"
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (AssertionError, OSError):
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tokens(n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _consumer(tmp: Path, engine_id: str = "consumer", num_blocks: int = 72, layers: int = 32, **options: Any) -> MiniEngine:
    opts = UcxOptions(registry_dir=str(tmp / "registry-c"), **options)
    return MiniEngine(UcxBackend(opts), engine_id=engine_id, role="consumer", num_blocks=num_blocks, seed=2,
                      **{**GEOMETRY, "num_layers": layers})


def _load_only(engine: MiniEngine, rid: str, tokens: list[int], params: dict[str, Any], timeout: float) -> tuple[list[int], WorkerReport]:
    """The consumer's part of a prefill up to the load's report (no compute afterwards): its blocks, the report."""
    req = engine.request(rid, tokens, params)
    n = engine.scheduler.lookup(req, 0).num_tokens
    assert n > 0
    ids = engine.allocate(-(-len(tokens) // engine.block_size))
    engine.scheduler.on_allocated(req, ids, n)
    engine.worker.start_step(engine.scheduler.plan_step([]))
    engine.worker.finish_step()
    reports = engine.wait_for(lambda r: rid in r.finished_loading, timeout)
    return ids, WorkerReport.merge(reports)


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    p = Producer(tmp_path_factory.mktemp("ucx-producer"), "--num-blocks", "136")
    try:
        yield p
    finally:
        p.close()


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        kvbridge.create_backend("ucx", {"timeout_s": "0"})
    with pytest.raises(ConfigError, match="unknown"):
        kvbridge.create_backend("ucx", {"chunk_byte": 1})
    for bad in ("-1", "4096", str(2 << 30)):
        with pytest.raises(ConfigError, match="tcp_sndbuf"):
            kvbridge.create_backend("ucx", {"tcp_sndbuf": bad})
    backend = kvbridge.create_backend("ucx", {"chunk_bytes": "8388608", "progress_mode": "blocking"})
    assert backend.kind == "peer" and backend.options.chunk_bytes == 8 << 20
    assert backend.options.tcp.sndbuf == 512 << 10  # the tcp lane's server caps its send buffers by default
    assert kvbridge.create_backend("ucx", {"tcp_sndbuf": "0"}).options.tcp.sndbuf == 0


def test_cma_is_excluded_unless_chosen() -> None:
    rt = rtmod.runtime()
    if "UCX_TLS" not in os.environ or os.environ["UCX_TLS"] == rtmod.DEFAULT_TLS:
        assert rt.tls == rtmod.DEFAULT_TLS

        async def transports() -> set[str]:
            return set(rtmod.ucx.get_active_transports())

        assert "cma" not in rt.call(transports(), 5.0)


def test_scattered_blocks_arrive_bit_exact_across_processes(producer: Producer, tmp_path: Path) -> None:
    params = producer.prefill("exact", 1000, seed=11)
    assert len(params["block_ids"]) == 62 and params["num_tokens"] == 62 * 16
    consumer = _consumer(tmp_path)
    try:
        got = consumer.prefill("exact-c", _tokens(1000, 11), params, timeout=30)
        assert got.loaded_tokens == 62 * 16 and got.failed_blocks == [] and len(got.loaded_blocks) == 62
        assert sorted(got.block_ids[:62]) != got.block_ids[:62]  # scattered ids on the consumer too
        assert torch.equal(got.snapshot[:, :62], producer.sent("exact"))  # what left the producer
        assert torch.equal(got.snapshot[:, :62], consumer.expected(got.keys[:62]))  # what the engine computes
        stats = consumer.worker.stats  # type: ignore[attr-defined]
        assert stats.load_bytes == 62 * 2 * 2**20 and stats.failed_blocks == 0
        producer.wait_freed()  # the consumer's release reached the producer
    finally:
        consumer.close()


def test_two_consumers_pull_from_one_producer_at_once(producer: Producer, tmp_path: Path) -> None:
    params = {rid: producer.prefill(rid, 500, seed=20 + i) for i, rid in enumerate(("two-a", "two-b"))}
    consumers = {rid: _consumer(tmp_path, engine_id=f"consumer-{rid}", num_blocks=40) for rid in params}
    results: dict[str, Any] = {}

    def run(rid: str) -> None:
        results[rid] = consumers[rid].prefill(f"{rid}-c", _tokens(500, 20 + list(params).index(rid)), params[rid], timeout=30)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in params]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for rid, got in results.items():
            assert got.failed_blocks == [] and len(got.loaded_blocks) == 31
            assert torch.equal(got.snapshot[:, :31], producer.sent(rid))
        assert len(results) == 2
        producer.wait_freed()
    finally:
        for c in consumers.values():
            c.close()


def test_layout_mismatch_is_refused_at_handshake(producer: Producer, tmp_path: Path) -> None:
    params = producer.prefill("mismatch", 200, seed=30)
    opts = UcxOptions(registry_dir=str(tmp_path / "registry-c"))
    consumer = MiniEngine(UcxBackend(opts), engine_id="consumer-64", role="consumer", num_blocks=16, seed=2,
                          **{**GEOMETRY, "head_size": 64})
    try:
        t0 = time.monotonic()
        ids, report = _load_only(consumer, "mismatch-c", _tokens(200, 30), params, timeout=10)
        assert time.monotonic() - t0 < 5  # refused, not timed out
        assert report.failed_blocks == set(ids[:12])
        assert not consumer.read(ids).any()  # the KV was never written
        producer.wait_freed()  # an aborted release frees the producer's blocks at once
    finally:
        consumer.close()


def test_producer_killed_mid_transfer(tmp_path: Path) -> None:
    """SIGKILL during a pull: the blocks that arrived are exact, the rest fail within the deadline, we live on."""
    p = Producer(tmp_path / "slow", "--slow", "0.4", "--num-blocks", "24", "--layers", "8")  # 512 KiB blocks
    consumer = _consumer(tmp_path, num_blocks=24, layers=8, timeout_s=2.0, chunk_bytes=1 << 20,  # 2 blocks per chunk
                         lane="two-sided")  # chunked tag sends; the one-sided lanes: tests/test_ucx_onesided.py
    try:
        params = p.prefill("killed", 20 * 16 + 5, seed=40)
        sent = p.sent("killed")
        out: dict[str, Any] = {}
        loader = threading.Thread(target=lambda: out.update(r=_load_only(consumer, "killed-c", _tokens(325, 40), params, 30)))
        loader.start()
        deadline = time.monotonic() + 20
        while not (p.out / "gathered.4").exists():
            assert time.monotonic() < deadline, "the pull never started"
            time.sleep(0.01)
        p.proc.kill()
        killed_at = time.monotonic()
        loader.join(30)
        assert not loader.is_alive()
        assert time.monotonic() - killed_at < 2.0 + 3.0  # timeout_s, plus a failed release and slack
        ids, report = out["r"]
        failed = sorted(report.failed_blocks)
        arrived = [b for b in ids[:20] if b not in report.failed_blocks]
        assert failed and len(arrived) >= 2  # some chunks came, the rest did not
        assert arrived == ids[: len(arrived)]  # a prefix, as the engine recomputes from the first failure
        assert torch.equal(consumer.read(arrived), sent[:, : len(arrived)])
        assert not consumer.read(failed).any()  # nothing half-written into the failed blocks
        assert consumer.worker.stats.failed_blocks == len(failed)  # type: ignore[attr-defined]
    finally:
        consumer.close()
        p.close()


def test_consumer_never_comes_lease_frees(tmp_path: Path) -> None:
    backend = UcxBackend(UcxOptions(registry_dir=str(tmp_path / "reg"), lease_s=0.5))
    producer = MiniEngine(backend, engine_id="lonely", role="producer", seed=1)
    consumer = MiniEngine(UcxBackend(UcxOptions(registry_dir=str(tmp_path / "reg"))), engine_id="late", role="consumer", seed=2)
    try:
        tokens = _tokens(3 * 16 + 1, seed=50)
        sent = producer.prefill("lease", tokens)
        assert sent.finish.delay_free and producer.held
        producer.wait_for(lambda _r: not producer.held, timeout=5)
        assert "lease" in producer.freed_late and backend.stats.expired_leases == 1
        # a consumer arriving after the lease is a miss (lookup) or, racing it, a refused pull — never stale blocks
        params = dict(sent.finish.transfer_params or {}, expires_at=time.time() + 60)
        t0 = time.monotonic()
        ids, report = _load_only(consumer, "late-c", tokens, params, timeout=10)
        assert time.monotonic() - t0 < 3 and report.failed_blocks == set(ids[:3])
        assert backend.stats.refused_pulls == 1
    finally:
        producer.close()
        consumer.close()


def test_a_load_out_of_time_in_a_handshake_fails_alone(tmp_path: Path) -> None:
    """A load whose deadline comes while it handshakes with a slow but healthy producer (it waited long for
    an IO thread) fails by that deadline, alone: a load that waited for that handshake with time to spare
    handshakes again and arrives bit-exact, rather than failing with the first as with a producer that
    refused or timed out a whole try."""
    producer = Producer(tmp_path / "p", "--num-blocks", "24", "--slow-handshake", "1.0")
    consumer = _consumer(tmp_path, num_blocks=24, timeout_s=6.0)
    try:
        ops = []
        for i, rid in enumerate(("short", "long")):
            params = producer.prefill(rid, 100, seed=40 + i)
            req = consumer.request(f"{rid}-c", _tokens(100, 40 + i), params)
            consumer.scheduler.on_allocated(req, consumer.allocate(7), consumer.scheduler.lookup(req, 0).num_tokens)
            ops.append(consumer.scheduler.plan_step([]).loads[0])
        puller = consumer.worker._puller  # type: ignore[attr-defined]
        t0, failed = time.monotonic(), {}

        def load(op: Any, due_in: float) -> None:
            failed[op.request_id] = (puller.load(op, t0 + due_in), time.monotonic() - t0)

        short = threading.Thread(target=load, args=(ops[0], 0.3))  # less than one try (timeout_s / 2) left
        short.start()
        time.sleep(0.1)  # the short load handshakes; the long one waits for that handshake
        load(ops[1], 6.0)
        short.join(10)
        assert failed["short-c"][0] == set(ops[0].block_ids) and failed["short-c"][1] < 1.0, failed
        assert failed["long-c"][0] == set(), failed  # on the old code: "the handshake ... failed meanwhile"
        assert torch.equal(consumer.read(list(ops[1].block_ids)), producer.sent("long"))
    finally:
        consumer.close()
        producer.close()


def test_release_before_the_plan_is_remembered(tmp_path: Path) -> None:
    """The consumer pulls and releases before the producer's next step tells its worker the request is held."""
    options = UcxOptions(registry_dir=str(tmp_path / "reg"))
    producer = MiniEngine(UcxBackend(options), engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(UcxBackend(options), engine_id="c", role="consumer", seed=2)
    try:
        tokens = _tokens(4 * 16 + 2, seed=60)
        sent = producer.prefill("early", tokens, step_after=False)  # the worker has not heard of the hold
        got = consumer.prefill("early-c", tokens, sent.finish.transfer_params)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert consumer.scheduler.stats.sealed_loads == 0  # no seal written yet: the release confirmed it
        report = producer.pump()  # the hold reaches the worker now; the release is already there
        assert "early" in report.finished_saving and not producer.held
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("how", ["cached here", "ended unscheduled", "ended before its pull"])
def test_a_handoff_the_consumer_does_not_pull_is_released_at_once(tmp_path: Path, how: str) -> None:
    """The consumer's cache already covers the prompt, or the request ends before it is scheduled or
    before its pull starts: its producer frees the blocks now, not at the lease's end (480 s of a vLLM
    producer stepping while it holds them) — and not only if the consumer engine steps again."""
    options = UcxOptions(registry_dir=str(tmp_path / "reg"))
    backend = UcxBackend(options)
    producer = MiniEngine(backend, engine_id="p", role="producer", seed=1)
    consumer = MiniEngine(UcxBackend(options), engine_id="c", role="consumer", seed=2)
    try:
        tokens = _tokens(4 * 16 + 2, seed=61)
        sent = producer.prefill("r", tokens)
        assert producer.held
        req = consumer.request("r-c", tokens, sent.finish.transfer_params)
        ids = consumer.allocate(5)
        if how == "cached here":  # the engine's own prefix cache computed every full block
            assert consumer.scheduler.lookup(req, 4 * 16).num_tokens == 0
            consumer.scheduler.on_allocated(req, ids, 0)
        else:
            assert consumer.scheduler.lookup(req, 0).num_tokens == 4 * 16
            if how == "ended before its pull":
                consumer.scheduler.on_allocated(req, ids, 4 * 16)
        assert not consumer.scheduler.on_finished(req, ids).delay_free
        producer.wait_for(lambda _r: not producer.held, timeout=5)  # no consumer step in between
        assert "r" in producer.freed_late and backend.stats.expired_leases == 0
        assert consumer.scheduler.stats.unpulled_handoffs == 1
        assert consumer.worker.poll() == WorkerReport()  # nothing was loaded, nothing reported
    finally:
        producer.close()
        consumer.close()


def test_worker_is_a_ucx_worker(tmp_path: Path) -> None:
    engine = MiniEngine(UcxBackend(UcxOptions(registry_dir=str(tmp_path))), engine_id="w", role="both")
    try:
        assert isinstance(engine.worker, UcxWorker) and engine.worker.metadata_address
    finally:
        engine.close()


_IDLE_PROBE = """
import os, tempfile, time
from kvbridge.connectors.ucx import UcxBackend, UcxOptions
from kvbridge.testing import MiniEngine
opts = UcxOptions(registry_dir=tempfile.mkdtemp())
producer = MiniEngine(UcxBackend(opts), engine_id="p", role="producer")
consumer = MiniEngine(UcxBackend(opts), engine_id="c", role="consumer")
sent = producer.prefill("r", list(range(64)))
def switches():  # voluntary context switches of every thread of this process: how often it woke
    return sum(int(line.split()[1]) for t in os.listdir("/proc/self/task")
               for line in open(f"/proc/self/task/{t}/status") if line.startswith("voluntary_ctxt_switches"))
time.sleep(1.0)
t0, c0, w0 = time.monotonic(), time.process_time(), switches()
time.sleep(3.0)
idle = (time.process_time() - c0) / (time.monotonic() - t0)
wakes = (switches() - w0) / (time.monotonic() - t0)
t1 = time.perf_counter()
got = consumer.prefill("c", list(range(64)), sent.finish.transfer_params)
first_pull_ms = 1e3 * (time.perf_counter() - t1)
assert got.loaded_blocks and not got.failed_blocks
print(f"{idle:.4f} {wakes:.1f} {first_pull_ms:.2f}")
producer.close(); consumer.close()
"""


def test_an_idle_pair_costs_almost_no_cpu() -> None:
    """A producer and a consumer with nothing to do sleep (ucxx's polling completion spun a core of the
    engine's). An idle pair uses a few percent of a core; the bound only catches a busy loop (~100%). Nor
    do they wake often: ucxx's progress thread, left as ucxx starts it, woke the process ~1000 times a
    second (runtime.PROGRESS_WAKE_MS); the bound catches that, well above the few dozen wakes left."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCXPY_ENABLE_PYTHON_FUTURE"}
    out = subprocess.run([sys.executable, "-c", _IDLE_PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    idle, wakes, first_pull_ms = map(float, out.stdout.split()[-3:])
    print(f"idle: {100 * idle:.1f}% of a core, {wakes:.0f} wakes/s; first pull after idling: {first_pull_ms:.1f} ms")
    assert idle < 0.25, f"an idle ucx pair used {100 * idle:.0f}% of a core"
    assert wakes < 300, f"an idle ucx pair woke {wakes:.0f} times a second"


@pytest.mark.parametrize("ids", ["scattered", "contiguous"])
def test_the_bench_times_ucx_as_deployed(ids: str) -> None:
    """kvbridge bench's ucx transfer: the producer engine in a child process, two requests pulled in one
    step, the first pull checked against the producer's sha256 (a mismatch raises instead of timing)."""
    from kvbridge.bench.core import SHAPES, Point
    from kvbridge.bench.ucx_baselines import two_processes

    timing = two_processes(Point(SHAPES["tiny"], 64, ids=ids, requests=2), reps=2)
    assert len(timing.samples) == 2 and all(0 < s < 10 for s in timing.samples)


def _huge_kib(address: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping ``[address, address + nbytes)``, from /proc/self/smaps
    (madvise splits a mapping at the 2 MiB boundaries it was given)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < address + nbytes and address < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_a_cpu_kv_is_backed_by_huge_pages_and_keeps_its_bytes() -> None:
    """The worker's registration collapses a CPU KV onto 2 MiB pages (cma reads then walk 512x fewer
    pages); every byte stays what it was. Where the kernel refuses (before Linux 6.1, THP off) it is 0
    bytes and nothing changes."""
    from kvbridge.connectors.ucx.hugepages import HUGE, back_with_huge_pages

    from kvbridge.layout import KVLayout

    base = torch.empty((4, 16 << 20), dtype=torch.bfloat16)  # 4 layers x 32 MiB, on small pages
    base.view(torch.int16).random_()
    before = base.clone()
    layout = KVLayout.from_tensors({f"l{i}": base[i].view(512, 8, 16, 256) for i in range(4)}, block_size=16)
    done = back_with_huge_pages(layout)
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))
    if done == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE here (before Linux 6.1, or THP off): nothing changed")
    assert done % HUGE == 0 and done >= base.numel() * 2 - 2 * HUGE
    assert _huge_kib(base.data_ptr(), base.numel() * 2) * 1024 >= done
