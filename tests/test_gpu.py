"""GPU paths, run only where CUDA is (``pytest -m gpu``; CI has no GPU, so they skip there).

Prepared for a device machine (``bash .ci/gpu-check``): a CUDA KV cache through the layout's gather and
scatter and through the stores, and a one-sided UCX GET from another process's GPU memory into this
one's. Every transfer is compared byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvbridge
from kvbridge.layout import KVLayout
from kvbridge.testing import MiniEngine
from kvbridge.testing.conformance import LAYOUTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
PEER = Path(__file__).parent / "helpers" / "native_peer.py"


def test_layout_moves_cuda_blocks_bit_exact() -> None:
    cpu = torch.randint(-2**15, 2**15, (4, 64, 8, 16, 256), dtype=torch.int16).view(torch.bfloat16)
    gpu = cpu.cuda()
    a, b = KVLayout.from_tensors(list(cpu)), KVLayout.from_tensors(list(gpu))
    ids = np.random.default_rng(0).permutation(64)[:20]
    staged = b.gather(ids)
    assert staged.is_cuda and torch.equal(staged.cpu(), a.gather(ids))
    b.scatter(ids[::-1].copy(), staged)
    a.scatter(ids[::-1].copy(), a.gather(ids))
    # bit patterns, not values: random bf16 words include NaNs, which never equal themselves
    assert torch.equal(gpu.cpu().view(torch.int16), cpu.view(torch.int16))


@pytest.mark.parametrize("name", ["memory", "cpu", "fs"])
def test_stores_with_a_cuda_kv_cache(name: str, tmp_path: Path) -> None:
    options = {"memory": {"name": "gpu"}, "cpu": {"capacity_bytes": 64 << 20}, "fs": {"path": str(tmp_path)}}[name]
    backend = kvbridge.create_backend(name, options)
    producer = MiniEngine(backend, engine_id="p", device="cuda")
    consumer = MiniEngine(backend, engine_id="c", device="cuda", seed=3) if name != "cpu" else producer
    tokens = list(range(16 * 6 + 3))
    producer.prefill("r", tokens)
    got = consumer.prefill("r2", tokens)
    assert got.loaded_tokens == 96 and got.failed_blocks == []
    assert torch.equal(got.snapshot[:, :6], consumer.expected(got.keys[:6]))
    producer.close()
    if consumer is not producer:
        consumer.close()


@pytest.mark.parametrize("max_runs", [0, 64], ids=["through-the-host", "dma-per-run"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["async", "layerwise"])
def test_cpu_tier_reads_slot_runs_of_a_cuda_kv_cache(max_runs: int, layerwise: bool, monkeypatch) -> None:
    """The cpu tier's GPU copies with slots in two runs (an evicted prompt's slots reused): a DMA per run,
    or the host path a fragmented pool takes (``copies.MAX_RUNS``), loaded back bit for bit; the path chosen is
    the one that ran."""
    from kvbridge.connectors.cpu import copies

    monkeypatch.setattr(copies, "MAX_RUNS", max_runs)
    up, runs_up = [], copies.runs_up  # the runs each load's DMA copied up

    def spy(storage, slot_runs, device):  # type: ignore[no-untyped-def]
        up.append(list(slot_runs))
        return runs_up(storage, slot_runs, device)

    monkeypatch.setattr(copies, "runs_up", spy)
    slot = 4 * 2 * 16 * 2 * 16 * 2  # layers x heads x tokens x (K, V) x head_size x bf16
    backend = kvbridge.create_backend("cpu", {"capacity_bytes": 8 * slot, "layerwise": layerwise})
    engine = MiniEngine(backend, engine_id="p", device="cuda", num_blocks=32)
    a, b = list(range(16 * 6 + 1)), list(range(1000, 1000 + 16 * 6 + 1))
    engine.prefill("a", a)
    engine.prefill("b", b)  # slots 6, 7, then 0..3 (a's, evicted): two runs
    got = engine.prefill("b2", b)
    assert got.loaded_tokens == 96 and got.failed_blocks == []
    assert torch.equal(got.snapshot[:, :6], engine.expected(got.keys[:6]))
    assert up == ([[(6, 2), (0, 4)]] if max_runs else []), up
    engine.close()


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_through_fs_with_a_cuda_kv_cache(layout: dict, tmp_path: Path) -> None:
    """The conformance suite's layouts (heads-major, K/V-first, MLA, fp8 in uint8 and float8) on CUDA."""
    backend = kvbridge.create_backend("fs", {"path": str(tmp_path)})
    producer = MiniEngine(backend, engine_id="p", device="cuda", seed=1, **layout)
    consumer = MiniEngine(backend, engine_id="c", device="cuda", seed=2, **layout)
    tokens = list(range(16 * 5 + 1))
    sent = producer.prefill("r", tokens)
    got = consumer.prefill("r2", tokens)
    assert got.loaded_tokens == 80 and torch.equal(got.snapshot[:, :5], sent.snapshot[:, :5])
    producer.close()
    consumer.close()


def test_native_get_from_gpu_memory_of_another_process() -> None:
    from kvbridge import native

    ucp, why = native.load_ucp()
    if ucp is None:
        pytest.skip(why)
    nbytes = 64 << 20
    peer = subprocess.Popen([sys.executable, str(PEER), "--bytes", str(nbytes), "--cuda"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        info = json.loads(peer.stdout.readline())
        local = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
        from kvbridge.connectors.ucx import cuda

        ctx = ucp.Context(progress_thread=True, config=cuda.CONFIG, optional=cuda.OPTIONAL)  # as kvbridge's
        ep = ctx.connect(bytes.fromhex(info["worker"]))
        key = ep.add_rkey(bytes.fromhex(info["rkey"]))
        path = cuda.get_path("cuda", ep.transports(), ctx.config)
        print(f"\nlanes {ep.transports()}, gate {ctx.config}: {path}")
        # the gate reached UCX (its cuda module loaded) and the peer is reached over cuda_ipc: zero-copy GETs
        assert ctx.config == cuda.CONFIG and path.emulated is False, path
        n, size = 1024, 64 << 10  # scattered 64 KiB pieces
        order = np.random.default_rng(1).permutation(nbytes // size)[:n].astype(np.uint64)
        remote = np.uint64(info["address"]) + order * np.uint64(size)
        dest = np.uint64(local.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size)
        lengths = np.full(n, size, dtype=np.uint64)
        import time

        rates = []
        for _ in range(3):  # the first GET maps the peer's memory (cuda_ipc), the others find it mapped
            local.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            moved = ep.get(remote, dest, lengths, key, 30.0)
            rates.append(moved / (time.perf_counter() - t0) / 1e9)
        print(f"\nGET of {n} x 64 KiB from another process's GPU memory, GB/s: first {rates[0]:.2f}, "
              f"then {rates[1]:.2f}, {rates[2]:.2f}\n{ep.info()}")
        words = size // 8
        want = np.concatenate([(np.arange(int(o) * words, (int(o) + 1) * words, dtype=np.uint64)
                                * np.uint64(0x9E3779B97F4A7C15)) for o in order])
        assert np.array_equal(local.cpu().numpy().view(np.uint64)[: n * words], want)
        ep.close()
        ctx.close()
    finally:
        peer.kill()
        peer.wait()


GUARD = r"""
import json, os, subprocess, sys
import numpy as np, torch
from kvbridge import native
from kvbridge.connectors.ucx import cuda, onesided
from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout
ucp = native.load_ucp()[0]
peer = subprocess.Popen([sys.executable, sys.argv[1], "--bytes", str(8 << 20), "--cuda"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
info = json.loads(peer.stdout.readline())
ctx = onesided.context("")  # kvbridge's own context, made under this process's environment
ep = ctx.connect(bytes.fromhex(info["worker"]))
key = ep.add_rkey(bytes.fromhex(info["rkey"]))
path = cuda.get_path("cuda", ep.transports(), ctx.config)
local = torch.zeros((8 << 20) // 8, dtype=torch.int64, device="cuda")
n = 128
order = np.random.default_rng(2).permutation(n).astype(np.uint64)
size = (8 << 20) // n
moved = ep.get(np.uint64(info["address"]) + order * np.uint64(size),
               np.uint64(local.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size), size, key, 60.0)
want = (np.arange((8 << 20) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).reshape(n, -1)
ok = bool(np.array_equal(local.cpu().numpy().view(np.uint64).reshape(n, -1), want[order.astype(np.int64)]))
kv = list(torch.zeros(2, 16, 8, 16, 64, dtype=torch.bfloat16, device="cuda"))  # as test_layout_moves_cuda_blocks
try:
    onesided.Exporter(KVLayout.from_tensors(kv), "")
    refused = ""
except ConfigError as exc:
    refused = str(exc)
print(json.dumps({"emulated": path.emulated, "cause": path.cause, "moved": moved, "ok": ok, "refused": refused}))
ep.close()
peer.kill()
"""


@pytest.mark.parametrize("gate", ["n", "auto"])
def test_the_guard_says_when_device_gets_would_be_emulated(gate: str) -> None:
    """The user's UCX_CUDA_IPC_ENABLE_GET_ZCOPY wins over kvbridge's y, and the guard says what follows, on the
    device: ``n`` — emulated, said by name, and a CUDA KV refused at registration with a ConfigError that says
    what to set; ``auto`` (UCX's default) — zero-copy only with NVLink, said as possible. The GET itself
    still moves every byte. Each case in a fresh process: kvbridge's context is made once per process."""
    env = {**os.environ, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": gate}
    out = subprocess.run([sys.executable, "-c", GUARD, str(PEER)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\ngate {gate}: {got}")
    assert got["ok"] and got["moved"] == 8 << 20
    if gate == "n":
        assert got["emulated"] is True and "serves PUTs only" in got["cause"]
        assert "turns cuda_ipc GETs off" in got["refused"] and "set it to y" in got["refused"]
    else:
        assert got["emulated"] is None and "NVLinks" in got["cause"] and got["refused"] == ""
