"""One-sided UCX GETs between two processes' GPU memory, the same 64 MiB by piece size, with and without the
local buffer mapped (``local_region``); every variant checked bit for bit. For a device machine:

    PYTHONPATH=<kvbridge built there> python3 -P benches/ucx_gpu_get.py

On the H200 lent on 2026-12-04 every variant moved 0.4-0.55 GB/s over UCX's cuda_ipc lane, 64 KiB pieces and
16 MiB alike (benches/results/gpu-2026-12-04.txt, run 5): a bandwidth cap, not a per-operation cost.
"""
import json
import subprocess
import sys
import time

import numpy as np
import torch

from kvbridge import native

ucp, why = native.load()
assert ucp is not None, why
nbytes = 64 << 20
peer = subprocess.Popen([sys.executable, "tests/helpers/native_peer.py", "--bytes", str(nbytes), "--cuda"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
info = json.loads(peer.stdout.readline())
local = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
ctx = ucp.Context(progress_thread=True)
ep = ctx.connect(bytes.fromhex(info["worker"]))
key = ep.add_rkey(bytes.fromhex(info["rkey"]))
mine = ctx.map(local.data_ptr(), nbytes, memory_type="cuda")
want = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
for size, region in ((64 << 10, None), (64 << 10, mine), (1 << 20, mine), (16 << 20, mine), (16 << 20, None)):
    n = nbytes // size
    order = np.random.default_rng(1).permutation(n).astype(np.uint64)
    remote = np.uint64(info["address"]) + order * np.uint64(size)
    dest = np.uint64(local.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size)
    rates = []
    for _ in range(3):
        local.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moved = ep.get(remote, dest, np.full(n, size, dtype=np.uint64), key, 60.0, local_region=region)
        rates.append(moved / (time.perf_counter() - t0) / 1e9)
    got = local.cpu().numpy().view(np.uint64).reshape(n, -1)
    ok = np.array_equal(got, want.reshape(n, -1)[order.astype(np.int64)])
    print(f"{n:5d} x {size >> 10:6d} KiB, local_region={'mapped' if region else 'none':6s}: "
          f"GB/s {', '.join(f'{r:.2f}' for r in rates)}  bit-exact={ok}", flush=True)
t = torch.empty_like(local)
t.copy_(local)  # warm: the first copy pays the allocation and the kernel's first launch
torch.cuda.synchronize()
t0 = time.perf_counter()
t.copy_(local)
torch.cuda.synchronize()
print(f"same-process device copy of 64 MiB: {nbytes / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
print(ep.info())
ep.close()
mine.close()
ctx.close()
peer.kill()
