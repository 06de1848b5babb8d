"""Where a tcp-lane load's time goes, below the engine: kvbridge._core's TcpServer / TcpSource alone between
two emulated hosts or pods, beside rawtcp (C) moving the same bytes, rows alternated per round.

    sudo .venv/bin/python benches/tcp_lane_probe.py [--pods] [--mib 32,128] [--rounds 5] [--reps 5]
        [--rows scat:4,scat:4/0,ctcp:4,ctcp-sndbuf:4]

Rows: ``scat:S`` the bench's descriptors (Llama-3-8B, 32 layers x K/V, 32 KiB pieces, scattered blocks on
both sides) over S streams; ``one:S`` the same bytes as one descriptor; either with ``/B`` appended: the
server's send buffer per connection, bytes (``scat:4/0``: the kernel's; default the lane's, ``tcplane.SNDBUF``);
``ctcp:S`` rawtcp, ``ctcp-sndbuf:S`` rawtcp with the lane's send buffer and non-blocking sends,
``ctcpwarm:S`` rawtcp without the cache eviction; ``/scat`` after a rawtcp row: its bytes in the ``scat`` rows'
layout (:mod:`kvbridge.bench.hosts`); ``lscat:S`` / ``lone:S`` the ``scat`` / ``one`` rows over the
local medium (pipes; two pods or one host), ``pipe:S`` rawtcp through pipes. ``@VAR=V+VAR=V`` after a row: environment of both ends.
Every read is timed from ``TcpSource.start`` to ``result()`` after an untimed cache eviction; the first
read of each row and round is checked byte for byte and not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

PIECE = 16 * 8 * 128 * 2  # one block of one layer's K (or V): 16 tokens x 8 heads x 128 x bf16
LAYERS = 32


def _kv(blocks: int, seed: int) -> np.ndarray:
    """A KV of random bytes on transparent huge pages, as the ucx worker backs an engine's KV
    (:mod:`connectors.ucx.hugepages`), so that the lane's rows copy on the pages an engine's copies run on."""
    import os

    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch's allocator at its first allocation
    import torch

    kv = torch.empty(LAYERS * 2 * blocks * PIECE, dtype=torch.uint8).numpy()
    kv[:] = np.random.default_rng(seed).integers(0, 256, kv.nbytes, dtype=np.uint8)
    return kv


def _descs(base: int, blocks: int, ids: np.ndarray) -> np.ndarray:
    lay = np.arange(LAYERS)[:, None, None]
    kv = np.arange(2)[None, :, None]
    return (base + ((lay * 2 + kv) * blocks + ids[None, None, :]) * PIECE).reshape(-1).astype(np.uint64)


def serve(blocks: int, sndbuf: int) -> None:
    import os

    from kvbridge import native

    mod, _ = native.load_core()
    kv = _kv(blocks, 1)
    seals = np.zeros(8, dtype=np.uint64)
    seals[0] = 77
    secret = b"s" * 32
    import resource

    local = f"kvbridge-probe-{os.getpid()}"
    srv = mod.TcpServer("0.0.0.0", 0, [(kv.ctypes.data, kv.nbytes)], secret,
                        seals=(seals.ctypes.data, seals.nbytes), sndbuf=sndbuf, local=local)
    print("@@" + json.dumps({"port": srv.port, "base": kv.ctypes.data, "seal": seals.ctypes.data, "local": local}),
          flush=True)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    sys.stdin.readline()
    srv.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print("@@" + json.dumps({"cpu": ru.ru_utime + ru.ru_stime - r0.ru_utime - r0.ru_stime}), flush=True)


def read(host: str, port: int, base: int, seal: int, blocks: int, mib: int, rows: list[str], rounds: int,
         reps: int) -> None:
    from kvbridge import native
    from kvbridge.bench.cold import evict

    mod, _ = native.load_core()
    want = _kv(blocks, 1)
    local = _kv(blocks, 3)
    n = mib * (1 << 20) // (LAYERS * 2 * PIECE)
    rng = np.random.default_rng(2)
    rid, lid = rng.permutation(blocks)[:n], rng.permutation(blocks)[:n]
    remote, dst = _descs(base, blocks, rid), _descs(local.ctypes.data, blocks, lid)
    lengths = np.full(len(remote), PIECE, dtype=np.uint64)
    import resource

    got: dict[str, list[float]] = {r: [] for r in rows}
    cpu = 0.0
    sources = {}
    for r in rows:
        kind, _, s = r.partition(":")
        if kind in ("scat", "one", "lscat", "lone"):  # l...: the local medium, through pipes
            where = ("@" + host, 0) if kind.startswith("l") else (host, port)
            sources[r] = mod.TcpSource(*where, b"s" * 32, streams=int(s.partition("/")[0]), timeout_s=10)
    for k in range(rounds):
        for r in rows[k % len(rows):] + rows[: k % len(rows)]:
            kind = r.partition(":")[0]
            if kind in ("ctcp", "pipe"):
                continue
            if kind in ("one", "lone"):
                args = (np.array([base], dtype=np.uint64), np.array([local.ctypes.data], dtype=np.uint64),
                        np.array([n * LAYERS * 2 * PIECE], dtype=np.uint64))
            else:
                args = (remote, dst, lengths)
            for i in range(reps + 1):
                local[:] = 0
                evict()
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                nbytes, word = sources[r].start(*args, seal).result()
                dt = time.perf_counter() - t0
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                if i:
                    cpu += ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
                assert word == 77 and nbytes == n * LAYERS * 2 * PIECE
                if i == 0:
                    if kind in ("scat", "lscat"):
                        for a, b in zip(_descs(0, blocks, rid)[:64], _descs(0, blocks, lid)[:64]):
                            assert np.array_equal(local[int(b):int(b) + PIECE], want[int(a):int(a) + PIECE])
                    else:
                        assert np.array_equal(local[:nbytes], want[:nbytes])
                else:
                    got[r].append(dt)
    print("@@" + json.dumps({**got, "cpu": cpu}), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        return serve(int(sys.argv[2]), int(sys.argv[3]))
    if sys.argv[1:2] == ["read"]:
        a = sys.argv[2:]
        return read(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6].split(","), int(a[7]), int(a[8]))
    import os
    import subprocess

    from kvbridge.connectors.ucx import tcplane

    from kvbridge.testing.hosts import EmulatedHosts

    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", action="store_true")
    ap.add_argument("--mib", default="32,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="scat:4,scat:4/0,ctcp:4,ctcp-sndbuf:4", help="see the docstring")
    args = ap.parse_args()
    rows = args.rows.split(",")
    print(f"load average {os.getloadavg()}", flush=True)
    with EmulatedHosts(2, pods=args.pods) as (a, b):
        for mib in [int(m) for m in args.mib.split(",")]:
            blocks = max(64, 2 * mib * (1 << 20) // (LAYERS * 2 * PIECE))
            res: dict[str, list[list[float]]] = {r: [] for r in rows}
            cpu: dict[str, list[tuple[float, float]]] = {}
            for k in range(args.rounds):  # one round at a time, so ctcp alternates with the lane's rows
                order = rows[k % len(rows):] + rows[: k % len(rows)]
                for r in order:
                    scat = blocks if r.endswith("/scat") else 0
                    if r.startswith("pipe"):
                        res[r].append(_ctcp(a, b, mib << 20, int(r.split(":")[1].split("/")[0]), args.reps,
                                            cpu.setdefault(r, []), local=f"@kvbridge-probe-pipe-{os.getpid()}", scat=scat))
                        continue
                    if r.startswith("ctcp"):
                        res[r].append(_ctcp(a, b, mib << 20, int(r.split(":")[1].split("@")[0].split("/")[0]), args.reps,
                                            cpu.setdefault(r, []), warm=r.startswith("ctcpwarm"), small="@small" in r,
                                            sndbuf=tcplane.SNDBUF if r.startswith("ctcp-sndbuf") else 0, scat=scat))
                        continue
                    sndbuf = r.partition("@")[0].partition("/")[2] or str(tcplane.SNDBUF)
                    env = dict(os.environ)
                    for kv in filter(None, r.partition("@")[2].split("+")):
                        env[kv.split("=")[0]] = kv.split("=")[1]
                    srv = a.popen([sys.executable, __file__, "serve", str(blocks), sndbuf], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
                    assert srv.stdout is not None and srv.stdin is not None
                    info = json.loads(srv.stdout.readline().removeprefix("@@"))
                    host = info["local"] if r.startswith("l") else a.address
                    cli = b.popen([sys.executable, __file__, "read", host, str(info["port"]), str(info["base"]),
                                   str(info["seal"]), str(blocks), str(mib), r.partition("@")[0], "1", str(args.reps)],
                                  stdout=subprocess.PIPE, text=True, env=env)
                    out = cli.communicate()[0]
                    line = [x for x in out.splitlines() if x.startswith("@@")]
                    if not line:
                        raise SystemExit(f"reader failed: {out[-500:]}")
                    msg = json.loads(line[-1][2:])
                    res[r].append(msg[r.partition("@")[0]])
                    srv.stdin.write("q\n")
                    srv.stdin.flush()
                    scpu = json.loads(srv.stdout.readline().removeprefix("@@"))["cpu"]
                    srv.wait(60)
                    cpu.setdefault(r, []).append((msg["cpu"] / args.reps, scpu / (args.reps + 1)))
            nbytes = mib << 20
            for r in rows:
                every = [s for x in res[r] for s in x]
                meds = [nbytes / statistics.median(x) / 1e9 for x in res[r]]
                print(f"{mib:4} MiB {r:8} {nbytes / statistics.median(every) / 1e9:6.2f} GB/s "
                      f"({min(meds):.2f}-{max(meds):.2f})  median {statistics.median(every) * 1e3:7.2f} ms"
                      + (" cpu/load reader {:.2f} ms server {:.2f} ms".format(
                          *(1e3 * statistics.median(c[j] for c in cpu[r]) for j in (0, 1))) if r in cpu else ""),
                      flush=True)


def _ctcp(a: object, b: object, nbytes: int, streams: int, reps: int, cpu: list[tuple[float, float]],
          warm: bool = False, small: bool = False, sndbuf: int = 0, local: str = "", scat: int = 0) -> list[float]:
    import os

    os.environ["KVBRIDGE_RAWTCP_SMALL_PAGES"] = "1" if small else ""
    from kvbridge.bench import cold, rawtcp

    layout = rawtcp.scattered(PIECE, 2 * LAYERS, scat)  # /scat: the scat rows' layout
    os.environ.update({k: v if scat else "" for k, v in layout.items()})
    from kvbridge.bench.hosts import _Proc

    exe = rawtcp.binary()
    sender = _Proc(a, [exe, "send", str(nbytes), str(streams), local or str(sndbuf)], python=False)  # type: ignore[arg-type]
    port = sender.line("send")["port"]
    receiver = _Proc(b, [exe, "recv", local or a.address, str(port), str(nbytes), str(streams), str(reps),  # type: ignore[attr-defined]
                         str(0 if warm else 2 * cold.llc_bytes())], python=False)  # type: ignore[arg-type]
    msg = receiver.line("recv")
    scpu = sender.line("send cpu")["cpu"]
    receiver.close()
    sender.close()
    cpu.append((msg["cpu"], scpu / (reps + 1)))
    return [float(v) for v in msg["samples"]]


if __name__ == "__main__":
    main()
