"""A producer for tests/test_native.py and tests/test_core.py (--no-ucp): maps a buffer with a known pattern and serves one-sided reads.

Prints one JSON line (pid, buffer address and length, packed rkey and worker address in hex), then answers
commands on stdin until EOF: ``sha OFFSET LENGTH`` prints the sha256 of that slice of its buffer.
Word i of the buffer is ``i * PATTERN_K`` (mod 2**64), so the test can compute any slice itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

PATTERN_K = 0x9E3779B97F4A7C15


def pattern(first_word: int, words: int) -> np.ndarray:
    a = np.arange(first_word, first_word + words, dtype=np.uint64)
    a *= np.uint64(PATTERN_K)  # wraps mod 2**64, like the C side would
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--tls", default="")
    ap.add_argument("--cuda", action="store_true", help="serve the pattern from GPU memory (tests/test_gpu.py)")
    ap.add_argument("--no-ucp", action="store_true", help="no UCX: only the pid and address, for cma reads")
    args = ap.parse_args()
    if args.no_ucp:
        buf = pattern(0, args.bytes // 8)
        print(json.dumps({"pid": os.getpid(), "address": buf.ctypes.data, "length": buf.nbytes}), flush=True)
        for _ in sys.stdin:
            pass
        return
    from kvbridge import native

    ucp, reason = native.load_ucp()
    if ucp is None:
        print(json.dumps({"error": reason}), flush=True)
        sys.exit(1)
    buf = pattern(0, args.bytes // 8)
    # as kvbridge's own context (connectors/ucx/cuda.py, not imported: it brings ucxx and torch): the GET
    # gate for device memory set unless the environment sets it
    gate = "CUDA_IPC_ENABLE_GET_ZCOPY"
    ctx = ucp.Context(tls=args.tls or None, progress_thread=True, config={gate: "y"}, optional=[gate])
    address = buf.ctypes.data
    if args.cuda:
        import torch

        gpu = torch.from_numpy(buf.view(np.int64)).cuda()  # kept alive for the process
        torch.cuda.synchronize()
        address = gpu.data_ptr()
    region = ctx.map(address, buf.nbytes, memory_type="cuda" if args.cuda else "host")
    info = {
        "pid": os.getpid(),
        "address": address,
        "length": buf.nbytes,
        "rkey": region.rkey.hex(),
        "worker": ctx.address.hex(),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "sha":
            off, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(buf.view(np.uint8)[off : off + n].tobytes()).hexdigest(), flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
