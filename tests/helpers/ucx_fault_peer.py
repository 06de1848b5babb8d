"""A peer process of tests/test_faults_ucx.py: ``python ucx_fault_peer.py ROLE OUT [options]``, driven by JSON lines.

``ROLE`` is ``producer`` or ``consumer``; one :class:`MiniEngine` over the ``ucx`` backend, pumped between
commands (so releases and leases free blocks as in a real engine). Every answer is one JSON line.

Producer commands:

- ``{"op": "prefill", "reqs": [[rid, n_tokens, seed], ...]}`` — prefill them together; answers
  ``{"params": {rid: transfer_params}}``.
- ``{"op": "state"}`` — ``held`` (request ids still held), ``freed`` (ids reported in ``finished_saving``
  for held requests), ``stats`` (the backend's :class:`UcxStats`), ``rss_mib``, ``fds``, ``threads``,
  ``address`` (the worker's metadata address), ``serving`` (two-sided pulls being served now).
- ``{"op": "slow", "seconds": S}`` — from now on every gather of a pull sleeps S seconds first and touches
  ``OUT/gathered.<n>`` (S=0: back to full speed).
- ``{"op": "quit"}``.

Producer faults (each one a fake of something that cannot be made real on demand; the test says which):

- ``--forge-head-size H``: the handshake advertises (and accepts) the layout fingerprint of the same cache
  with head size H, while the real blocks keep their size — a producer whose fingerprint lies.
- ``--hang-release``: a release touches ``OUT/releasing`` and then blocks (until the test kills the process).
- ``--hang-handshake``: a handshake blocks until ``quit`` and is then answered (a wedged producer whose gRPC
  server still accepts: a host that drops packets fails a new handshake at gRPC's connect timeout).

Consumer commands:

- ``{"op": "load", "rid": R, "tokens": N, "seed": S, "params": P}`` — the consumer's part of a prefill up to
  the start of the load (lookup, allocation, the plan with the load); answers ``{"started": n_tokens}``.
- ``{"op": "begin", "rid": R, "tokens": N, "seed": S, "params": P}`` — like ``load``, keeping the request for ``end``.
- ``{"op": "end", "rid": R, "wait": T}`` — pump until ``R``'s load is reported (or ``T`` s pass; several
  loads may be begun and ended in any order); answers
  ``loaded`` / ``failed`` (block counts), ``exact`` (the loaded blocks equal what the producer computed for
  their keys), ``sha`` (sha256 of the loaded full blocks, to compare with the producer's ``sha``),
  ``seconds`` (from ``begin``), and frees the blocks.
- ``{"op": "pull", "rid": R, "tokens": N, "seed": S, "params": P}`` — ``begin`` then ``end``.
- ``{"op": "quit"}``.

A producer's ``prefill`` answer carries ``sha`` too: ``{rid: sha256 of its full blocks}`` (the bytes that left).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvbridge.connectors.ucx import UcxBackend, UcxOptions

from kvbridge.layout import KVLayout
from kvbridge.testing import MiniEngine


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _LyingLayout:
    """The real layout for everything (gathers, sizes) but its fingerprint."""

    def __init__(self, real: KVLayout, fingerprint: Any):
        self._real, self.fingerprint = real, fingerprint

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _sha(blocks: torch.Tensor) -> str:
    return hashlib.sha256(blocks.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _end(engine: MiniEngine, req: Any, ids: list[int], t0: float, timeout: float,
         pending: dict[str, tuple[Any, list[int], float]],
         reported: dict[str, tuple[set[int], float]]) -> dict[str, Any]:
    """Wait for ``req``'s load report; what arrived, checked against what the producer computed. Reports of
    other ``pending`` loads seen meanwhile are kept in ``reported`` (their failed blocks, when) for their end."""
    rid = req.request_id

    def seen(report: Any) -> bool:
        for other in report.finished_loading:
            blocks = ids if other == rid else pending[other][1] if other in pending else None
            if blocks is not None:  # the blocks of loads in flight are disjoint: each gets its own failures
                reported[other] = (set(report.failed_blocks) & set(blocks), time.monotonic())
        return rid in reported

    if rid not in reported:
        try:
            engine.wait_for(seen, timeout)
        except Exception as exc:  # noqa: BLE001 - the test reads the reason
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    failed, at = reported.pop(rid)
    seconds = at - t0
    keys = list(req.block_keys)
    got = engine.read(ids[: len(keys)])
    exact = not failed and bool(torch.equal(got, engine.expected(keys)))
    out = {"loaded": 0 if failed else len(keys), "failed": len(failed), "exact": exact, "sha": _sha(got),
           "seconds": seconds}
    engine.free(ids)
    engine.scheduler.on_finished(req, ids)
    return out


def _say(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    # when each failure was seen, and on which thread: what a test's timing bound needs to be explained
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d ms %(threadName)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--engine-id", default="")
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--lease", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--forge-head-size", type=int, default=0)
    ap.add_argument("--hang-release", action="store_true")
    ap.add_argument("--hang-handshake", action="store_true")
    ap.add_argument("--lane", default="auto")
    ap.add_argument("--advertise-host", default="")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = UcxOptions(registry_dir=str(args.out / "registry"), lease_s=args.lease, timeout_s=args.timeout,
                         chunk_bytes=args.chunk_bytes, lane=args.lane, advertise_host=args.advertise_host)
    backend = UcxBackend(options)
    geometry = {"num_layers": args.layers, "num_kv_heads": args.heads, "head_size": args.head_size, "block_size": 16,
                "dtype": torch.bfloat16}
    engine = MiniEngine(backend, engine_id=args.engine_id or args.role, role=args.role, num_blocks=args.num_blocks,
                        seed=1, **geometry)  # type: ignore[arg-type]
    server = getattr(engine.worker, "server", None)
    slow = [0.0]
    unwedge = threading.Event()  # set at quit: a wedged handshake lets the server close
    if server is not None:
        gather, calls = engine.layout.gather, [0]

        def slow_gather(*a: Any, **kw: Any) -> torch.Tensor:
            if slow[0] and "out" in kw:  # the server's gathers only, not the engine's own reads
                time.sleep(slow[0])
                calls[0] += 1
                (args.out / f"gathered.{calls[0]}").touch()
            return gather(*a, **kw)

        engine.layout.gather = slow_gather  # type: ignore[method-assign]
        if args.forge_head_size:
            shape = (args.layers, 1, args.heads, 16, 2 * args.forge_head_size)
            base = torch.zeros(shape, dtype=torch.bfloat16)
            forged = KVLayout.from_tensors({f"l{i}": base[i] for i in range(args.layers)}, block_size=16).fingerprint
            server.layout = _LyingLayout(server.layout, forged)
            server.info = dataclasses.replace(server.info, fingerprint=forged)
        if args.hang_release:
            def hang(engine_id: str, request_id: str, aborted: bool, grant: bytes) -> None:
                (args.out / "releasing").touch()
                threading.Event().wait(120)

            server.server._on_release = hang
        if args.hang_handshake:
            answer = server.server._on_handshake

            def wedged(peer: Any) -> Any:
                unwedge.wait(120)
                return answer(peer)

            server.server._on_handshake = wedged
    pending: dict[str, tuple[Any, list[int], float]] = {}  # rid -> request, its blocks, when its load began
    reported: dict[str, tuple[set[int], float]] = {}  # rid -> failed blocks and when, reported before its end
    _say({"ready": True, "pid": os.getpid()})
    while True:
        if not select.select([sys.stdin], [], [], 0.01)[0]:
            if not pending:  # a pending load's report is for its "end" to read
                engine.pump()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "prefill":
            engine.pump()
            sent = engine.prefill_many([(rid, tokens(n, seed), None) for rid, n, seed in cmd["reqs"]])
            _say({"params": {r.request_id: r.finish.transfer_params for r in sent},
                  "sha": {r.request_id: _sha(r.snapshot[:, : len(r.keys)]) for r in sent}})
        elif op == "state":
            engine.pump()
            _say({"held": sorted(engine.held), "freed": sorted(engine.freed_late), "rss_mib": _rss_mib(),
                  "stats": dataclasses.asdict(backend.stats), "fds": len(os.listdir("/proc/self/fd")),
                  "threads": threading.active_count(), "address": getattr(server, "address", None),
                  "serving": len(getattr(server, "_in_service", ()))})
        elif op == "slow":
            slow[0] = float(cmd["seconds"])
            _say({"slow": slow[0]})
        elif op == "load":
            req = engine.request(cmd["rid"], tokens(cmd["tokens"], cmd["seed"]), cmd["params"])
            n = engine.scheduler.lookup(req, 0).num_tokens
            ids = engine.allocate(-(-len(req.prompt_token_ids) // engine.block_size))
            engine.scheduler.on_allocated(req, ids, n)
            engine.worker.start_step(engine.scheduler.plan_step([]))
            engine.worker.finish_step()
            _say({"started": n})
        elif op in ("begin", "pull"):
            req = engine.request(cmd["rid"], tokens(cmd["tokens"], cmd["seed"]), cmd["params"])
            n = engine.scheduler.lookup(req, 0).num_tokens
            ids = engine.allocate(-(-len(req.prompt_token_ids) // engine.block_size))
            engine.scheduler.on_allocated(req, ids, n)
            pending[cmd["rid"]] = (req, ids, time.monotonic())
            engine.worker.start_step(engine.scheduler.plan_step([]))
            engine.worker.finish_step()
            if op == "begin":
                _say({"started": n})
        if op == "end" or op == "pull":
            _say(_end(engine, *pending.pop(cmd["rid"]), float(cmd.get("wait", 30)), pending, reported))
        elif op == "quit":
            break
    unwedge.set()
    engine.close()
    _say({"bye": True})


if __name__ == "__main__":
    main()
