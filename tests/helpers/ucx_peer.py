"""A producer process of tests/test_ucx.py: ``python ucx_peer.py OUT [--slow S] [--num-blocks N] ...``.

Runs a producer :class:`MiniEngine` over the ``ucx`` backend and takes JSON commands on stdin, one a line,
pumping the engine between them (so releases and leases free blocks as in a real engine):

- ``{"op": "prefill", "rid": R, "tokens": N, "seed": S}`` — prefill N tokens; writes the snapshot of the
  full blocks (the bytes that left) to OUT/R.pt; answers ``{"params": transfer_params}``.
- ``{"op": "held"}`` — answers ``{"held": [request ids still held]}``.
- ``{"op": "pump"}`` — one engine step (with ``--idle`` the engine steps only then); answers ``{}``.
- ``{"op": "quit"}``.

``--slow S`` makes every gather of a pull sleep S seconds first and touch OUT/gathered.<n>, so a test can
kill this process mid-transfer. ``--slow-handshake S`` answers every handshake S seconds late (a busy
producer; a fake, since this machine's tc cannot delay packets: no netem).
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvbridge.connectors.ucx import UcxBackend, UcxOptions

from kvbridge.testing import MiniEngine

GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": torch.bfloat16}


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--slow-handshake", type=float, default=0.0)
    ap.add_argument("--num-blocks", type=int, default=80)
    ap.add_argument("--lease", type=float, default=60.0)
    ap.add_argument("--layers", type=int, default=GEOMETRY["num_layers"])
    ap.add_argument("--idle", action="store_true", help="no engine step after a prefill, nor between commands")
    ap.add_argument("--metadata-port", type=int, default=0)
    ap.add_argument("--lane", default="auto")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    options = UcxOptions(registry_dir=str(args.out / "registry"), lease_s=args.lease, timeout_s=5.0,
                         metadata_port=args.metadata_port, lane=args.lane)
    engine = MiniEngine(UcxBackend(options), engine_id="producer", role="producer", num_blocks=args.num_blocks, seed=1, device=args.device,
                        **{**GEOMETRY, "num_layers": args.layers})
    if args.slow:
        gather, calls = engine.layout.gather, [0]

        def slow_gather(*a: Any, **kw: Any) -> torch.Tensor:
            time.sleep(args.slow)
            calls[0] += 1
            (args.out / f"gathered.{calls[0]}").touch()
            return gather(*a, **kw)

        engine.layout.gather = slow_gather  # type: ignore[method-assign]
    if args.slow_handshake:
        meta = engine.worker.server.server  # type: ignore[attr-defined]
        answer = meta._on_handshake

        def slow_handshake(peer: Any) -> Any:
            time.sleep(args.slow_handshake)
            return answer(peer)

        meta._on_handshake = slow_handshake
    print(json.dumps({"ready": True}), flush=True)
    while True:
        if not select.select([sys.stdin], [], [], 0.01)[0]:
            if not args.idle:
                engine.pump()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            sent = engine.prefill(cmd["rid"], tokens(cmd["tokens"], cmd["seed"]), step_after=not args.idle)
            n = len(sent.keys)
            torch.save(sent.snapshot[:, :n].clone(), args.out / f"{cmd['rid']}.pt")
            print(json.dumps({"params": sent.finish.transfer_params}), flush=True)
        elif cmd["op"] == "pump":
            engine.pump()
            print(json.dumps({}), flush=True)
        elif cmd["op"] == "held":
            engine.pump()
            print(json.dumps({"held": sorted(engine.held)}), flush=True)
        elif cmd["op"] == "quit":
            break
    engine.close()


if __name__ == "__main__":
    main()
