"""One-sided UCX GETs between two processes' GPU memory beside the same-process gather of the same blocks (issue
41's medium), by piece size, with kvbridge's context (the cuda_ipc GET gate on unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY
is set); every variant checked bit for bit. For a device machine (``bash .ci/gpu-check`` runs it twice: as is,
and with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto``, UCX's own default, for the A/B):

    PYTHONPATH=<kvbridge built there> python3 -P benches/ucx_gpu_get.py

Prints, per piece size, the GET's GB/s (best of 3, after a first GET that maps the peer's memory), the gather's,
their ratio, and what the emulation guard (connectors/ucx/cuda.py) decided from the endpoint's lanes.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from kvbridge.connectors.ucx import cuda

from kvbridge import native

ucp, why = native.load_ucp()
assert ucp is not None, why
nbytes = 64 << 20
peer = subprocess.Popen([sys.executable, "tests/helpers/native_peer.py", "--bytes", str(nbytes), "--cuda"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
info = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
local = torch.zeros(nbytes // 8, dtype=torch.int64, device="cuda")
ctx = ucp.Context(progress_thread=True, config=cuda.CONFIG, optional=cuda.OPTIONAL)
ep = ctx.connect(bytes.fromhex(info["worker"]))
key = ep.add_rkey(bytes.fromhex(info["rkey"]))
mine = ctx.map(local.data_ptr(), nbytes, memory_type="cuda")
gate = os.environ.get(f"UCX_{cuda.GET_ZCOPY}", f"{ctx.config.get(cuda.GET_ZCOPY, 'absent')} (kvbridge)")
lanes = ep.transports()
path = cuda.get_path("cuda", lanes, ctx.config)
print(f"gate {cuda.GET_ZCOPY}={gate}; lanes {lanes}; guard: emulated={path.emulated} {path.cause}", flush=True)
want = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
source = torch.from_numpy(want.view(np.int64)).cuda()  # the same bytes in this process, for the gather


def best(fn, reps=3):  # type: ignore[no-untyped-def]
    fn()  # the first call maps (cuda_ipc) or warms (the gather's kernel)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9


for size in (64 << 10, 1 << 20, 16 << 20):
    n = nbytes // size
    order = np.random.default_rng(1).permutation(n).astype(np.uint64)
    remote = np.uint64(info["address"]) + order * np.uint64(size)
    dest = np.uint64(local.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size)
    lengths = np.full(n, size, dtype=np.uint64)
    local.zero_()
    get = best(lambda r=remote, d=dest, n_=lengths: ep.get(r, d, n_, key, 60.0, local_region=mine))
    got = local.cpu().numpy().view(np.uint64).reshape(n, -1)
    ok = np.array_equal(got, want.reshape(n, -1)[order.astype(np.int64)])
    index = torch.from_numpy(order.astype(np.int64)).cuda()
    rows = source.view(n, -1)
    out = torch.empty_like(rows)
    gather = best(lambda r=rows, i=index, o=out: torch.index_select(r, 0, i, out=o))
    print(f"{n:5d} x {size >> 10:6d} KiB: GET {get:7.2f} GB/s, same-process gather {gather:7.2f} GB/s, "
          f"GET/gather {get / gather:.2f}, bit-exact={ok}", flush=True)
print(ep.info())
ep.close()
mine.close()
ctx.close()
peer.kill()
