"""Peers and raw media beside kvbridge's ``ucx`` backend: the same request, read one-sided by other systems
and by the bare medium, measured in the same run.

    python -m kvbridge.bench.peers [--tokens 1024,64] [--reps 5] [--peers cma,nixl:cma,...] [--json]

The request is a bench :class:`~kvbridge.bench.core.Point` (Llama-3-8B: 32 layers x 8 KV heads x 128, bf16,
block 16, blocks_first, so one block of one layer is 64 KiB contiguous; 1024 tokens = 64 blocks x 32 layers
= 2048 descriptors = 128 MiB), with the block ids the ``ucx`` case uses: a random permutation of the
producer's and of the consumer's free blocks (seeds 1 and 2, as :class:`~kvbridge.bench.pairs.Pair`).
A producer process holds the KV; a consumer process reads the request's blocks out of it. Both are fresh
children (:mod:`kvbridge.bench._peer_child`), so each system brings its own UCX (NIXL ships one) and
``UCX_TLS``, and the bench's own UCX runtime is untouched. The consumer fills its destination with a
poison byte before every transfer and compares every byte with the producer's after it (warm-up
included): a system that moves wrong bytes fails its row, loudly.

Rows (:data:`PEERS`; each is a baseline of ``ucx``'s ``transfer`` in :data:`kvbridge.bench.cases.BENCH`,
so ``ratio`` is ucx/peer in throughput):

- ``cma``: ``process_vm_readv`` of the request's descriptors through ``kvbridge._core.cma_read`` (adjacent
  descriptors merged), the call kvbridge's own same-host lane makes: its raw medium. Without the native
  module, a ctypes ``process_vm_readv`` (the note says so).
- ``cma:2t``: the same descriptors cut in two pieces of equal bytes, read by two threads at once
  (``kvbridge._core.cma_start``, which cuts a read of 8 MiB or more so): the medium of the same-host lane
  as kvbridge reads it. On a machine with free cores one thread's copy is bound by its memory latency,
  so two copy more; ``cma`` stays the strict single-thread medium.
- ``ucp-get:tcp``, ``ucp-get:sm``: one ucp GET of the request's bytes as *one buffer* through
  ``kvbridge._ucp`` (producer ``Context(progress_thread=True)``, local memory mapped), over UCX's tcp with
  peer error handling (the ``ucp`` lane's medium), and over UCX's shared-memory transports with error
  handling off (UCX then reads with cma; the ``ucp-unsafe`` lane). The note names the lanes UCX chose. With
  peer error handling UCX 1.21 offers no shared-memory lane between two processes (``sm`` alone is
  unreachable, ``tcp,sm`` picks tcp), and its tcp has no ``rma_bw`` lane: a GET over tcp is emulated with
  active messages that the producer's progress thread answers.
- ``nixl:tcp``, ``nixl:tcp+pt``, ``nixl:sm``, ``nixl:sm+pt``: NIXL's one-sided READ of the same scattered
  descriptors (UCX backend; ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` timed, descriptor
  lists built before), the same ``UCX_TLS`` and error-handling mode as the ucp rows, with NIXL's
  progress thread off (the producer then polls ``get_new_notifs`` in a loop, as NIXL needs) and on.
  (``nixl_mode="prepped"`` in a :func:`spec` times ``make_prepped_xfer`` over lists prepared once, as
  vLLM's NixlConnector does.)
- ``mooncake:tcp``: Mooncake's transfer engine, ``batch_transfer_sync_read`` of the same descriptors over
  its TCP transport (P2P handshake, no metadata server). ``mooncake-transfer-engine-non-cuda`` needs
  Debian's ``libibverbs1`` even for TCP.

A row that cannot run says why ("not measured: ..."): package absent (``pip install 'kvbridge[peers]'``),
native module not built, an import or transfer error. The plain TCP socket of the same bytes is the
existing ``tcp`` baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.bench.baselines import Unavailable
from kvbridge.bench.child import PEER_SPEECH, JsonChild
from kvbridge.bench.core import SHAPES, Point, Timing
from kvbridge.bench.pool import request_blocks

INSTALL = "pip install 'kvbridge[peers]'"


@dataclasses.dataclass(frozen=True)
class PeerTiming(Timing):
    """A peer's samples and what it ran on (versions, lanes), for the record's note."""

    note: str = ""


@dataclasses.dataclass(frozen=True)
class Peer:
    """One row: which system reads (``system``), over what (``tls``, ``error_handling``), how."""

    system: str  # cma | ucp | nixl | mooncake (kvbridge/bench/_peer_child.py)
    tls: str = ""
    error_handling: bool = True
    progress_thread: bool = False
    one_buffer: bool = False
    huge_pages: bool = False  # both buffers on 2 MiB pages, as kvbridge's ucx worker backs its KV
    threads: int = 1  # cma: threads copying pieces of the request at once

    def missing(self) -> str | None:
        """Why this row cannot run here (a package or module absent), or None. Imports nothing heavy."""
        if self.system in ("cma", "ucp"):
            if self.system == "cma" and self.threads == 1:
                return None  # without kvbridge._core the child falls back to ctypes, and says so
            from kvbridge import native

            name = "core" if self.system == "cma" else "ucp"
            mod, why = native.load_core() if name == "core" else native.load_ucp()
            return None if mod is not None else f"kvbridge._{name} not loaded: {why}"
        if self.system == "nixl":
            if not any(importlib.util.find_spec(m) for m in ("nixl_cu13", "nixl_cu12", "nixl")):
                return f"NIXL not installed (nixl-cu13); {INSTALL}"
            return None
        if self.system == "mooncake":
            if importlib.util.find_spec("mooncake") is None:
                return f"mooncake-transfer-engine-non-cuda not installed; {INSTALL} (needs Debian's libibverbs1)"
            return None
        return f"unknown system {self.system!r}"


PEERS: dict[str, Peer] = {
    # the raw medium of kvbridge's same-host lane, on the pages kvbridge reads (huge); the other rows run
    # as their systems allocate (a user's torch-allocated KV: small pages)
    "cma": Peer("cma", huge_pages=True),
    "cma:2t": Peer("cma", huge_pages=True, threads=2),
    "ucp-get:tcp": Peer("ucp", "tcp", error_handling=True, one_buffer=True),
    "ucp-get:sm": Peer("ucp", "sm", error_handling=False, one_buffer=True),
    "nixl:tcp": Peer("nixl", "tcp", error_handling=True, progress_thread=False),
    "nixl:tcp+pt": Peer("nixl", "tcp", error_handling=True, progress_thread=True),
    "nixl:sm": Peer("nixl", "sm", error_handling=False, progress_thread=False),
    "nixl:sm+pt": Peer("nixl", "sm", error_handling=False, progress_thread=True),
    "mooncake:tcp": Peer("mooncake"),
}


def spec(name: str, point: Point, reps: int, *, warmup: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
    """What both children need for row ``name`` at ``point``: the KV geometry and the moved block ids."""
    peer = PEERS[name]
    shape = point.shape
    per_request = point.blocks_per_request + 1  # the partial last block of each prompt, as KVPool allocates
    num_blocks = per_request * point.requests

    def ids(seed: int) -> list[int]:  # full blocks only: the partial last one is not moved
        return [b for run in request_blocks(point, num_blocks, seed) for b in run[: point.blocks_per_request]]

    return {
        "name": name,
        **dataclasses.asdict(peer),
        "layers": shape.num_layers,
        "num_blocks": num_blocks,
        "block_bytes": shape.num_kv_heads * point.block_size * 2 * shape.head_size * shape.dtype.itemsize,
        "src": ids(1),
        "dst": ids(2),
        "seed": 11,
        "reps": reps,
        "warmup": warmup,
        "timeout_s": timeout_s,
        "allow_fallback": True,
    }


def _child(role: str, spec: dict[str, Any], env: dict[str, str], prefix: Sequence[str] = ()) -> JsonChild:
    """A :mod:`kvbridge.bench._peer_child` child (spoken to as ``PEER_SPEECH``), told its spec."""
    child = JsonChild([*prefix, sys.executable, "-m", "kvbridge.bench._peer_child", role], env=env, speech=PEER_SPEECH)
    child.say(spec)
    return child


def measure(name: str, point: Point, reps: int, *, warmup: int = 1, timeout_s: float = 120.0) -> PeerTiming:
    """Row ``name`` at ``point``: ``reps`` timed transfers after ``warmup``, each checked byte for byte.

    Raises :class:`~kvbridge.bench.baselines.Unavailable` (the row's "not measured: ...") when it
    cannot run here or moved wrong bytes."""
    why = PEERS[name].missing()
    if why:
        raise Unavailable(why)
    return run_spec(spec(name, point, reps, warmup=warmup, timeout_s=timeout_s))


def run_spec(s: dict[str, Any], prefixes: tuple[Sequence[str], Sequence[str]] = ((), ())) -> PeerTiming:
    """Start the producer and the consumer of spec ``s`` (from :func:`spec`), relay the producer's
    address line, and return the consumer's timings. ``prefixes`` run them elsewhere (the producer's,
    the consumer's: emulated hosts' ``Host.prefix()``, :mod:`kvbridge.bench.hosts`)."""
    name = s["name"]
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}
    env.pop("UCX_TLS", None)  # the bench's own UCX runtime may have set it; each row names its lane
    if s["tls"]:
        env["UCX_TLS"] = s["tls"]
    prod = _child("serve", s, env, prefixes[0])
    cons = _child("read", s, env, prefixes[1])
    try:
        start = 60.0
        cons.say(prod.line(f"{name} producer", start))
        out = cons.line(f"{name} consumer", start + s["timeout_s"] * (s["reps"] + s["warmup"]))
        return PeerTiming(tuple(float(v) for v in out["samples"]), f"{name}: {out.get('note', '')}")
    finally:
        cons.close()
        prod.close()


def baseline(name: str) -> Callable[[Point, int], Timing]:
    """Row ``name`` as a point-aware baseline ``fn(point, reps)`` (what :class:`~kvbridge.bench.measurer.Measurer` calls)."""
    return functools.partial(measure, name)


POINT_BASELINES: dict[str, Callable[[Point, int], Timing]] = {name: baseline(name) for name in PEERS}
UCX_PEERS: tuple[str, ...] = tuple(PEERS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbridge.bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,64", help="tokens per request, comma-separated (default 1024,64)")
    ap.add_argument("--shape", default="8b", choices=sorted(s for s in SHAPES if s != "tiny"))
    ap.add_argument("--ids", default="scattered", choices=["scattered", "contiguous"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated of {list(PEERS)}")
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    args = ap.parse_args(argv)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        point = Point(SHAPES[args.shape], tokens, ids=args.ids)
        for name in (p.strip() for p in args.peers.split(",") if p.strip()):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            try:
                t = measure(name, point, args.reps)
                rows.append({"peer": name, "tokens": tokens, "bytes": point.nbytes, "median_s": t.median,
                             "gbps": point.nbytes / t.median / 1e9, "best_gbps": point.nbytes / min(t.samples) / 1e9,
                             "samples": list(t.samples), "note": t.note.removeprefix(f"{name}: "), "load1": load})  # fmt: skip
            except Unavailable as exc:
                rows.append({"peer": name, "tokens": tokens, "bytes": point.nbytes, "median_s": None, "gbps": None,
                             "note": f"not measured: {exc}", "load1": load})  # fmt: skip
            rows[-1]["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'peer':14} {'tokens':>6} {'MiB':>5} {'GB/s':>6} {'best':>6} {'ms':>7}  note")
    for r in rows:
        if r["median_s"] is None:
            print(f"{r['peer']:14} {r['tokens']:6} {r['bytes'] >> 20:5} {'-':>6} {'-':>6} {'-':>7}  {r['note']}")
        else:
            print(f"{r['peer']:14} {r['tokens']:6} {r['bytes'] >> 20:5} {r['gbps']:6.2f} {r['best_gbps']:6.2f} "
                  f"{r['median_s'] * 1e3:7.2f}  {r['note']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["PEERS", "POINT_BASELINES", "UCX_PEERS", "Peer", "PeerTiming", "baseline", "measure", "run_spec", "spec"]
