"""The bench across emulated hosts: kvbridge's ``ucx`` backend with its producer on host A and its consumer on
host B (:mod:`kvbridge.testing.hosts`: own network, pid, uts, IPC and mount namespaces, one veth link),
beside what else moves the same bytes over the same link, at link caps none / 25gbit / 10gbit.

    kvbridge bench hosts [--tokens 1024,64] [--caps none,25gbit,10gbit] [--rows ...] [--reps 3] [--rounds 3]
                         [--pods] [--json PATH]

Needs root and ``ip netns`` (it says so and exits 2 otherwise). Rows (:data:`ROWS`):

- ``kvbridge``: the ``ucx`` backend as deployed (:func:`kvbridge.bench.ucx_baselines.consume`: a producer
  engine holds the point's requests in vLLM's layout, scattered blocks; the consumer engine pulls them in
  one step; ``auto`` lane, which across hosts is the ``tcp`` lane: kvbridge's own streams, 4 by default);
  timed ``start_step`` to the last report; the warm-up checked by sha256.
- ``kvbridge-ucp``: the same with ``lane="ucp"``: a one-sided GET over UCX's tcp (emulated by active
  messages).
- ``tcp:1``, ``tcp:4``: plain TCP sockets in Python (``sendall`` / ``recv_into``) moving the same byte count
  as one buffer over 1 and 4 streams at once; the warm-up's bytes compared.
- ``ctcp:1``, ``ctcp:4``: the same in C at kernel speed (:mod:`kvbridge.bench.rawtcp`): the raw medium a
  C lane is held to, with the kernel's auto-tuned buffers and blocking sends.
- ``ctcp-sndbuf:4``: the same with the socket settings of kvbridge's tcp lane (each send buffer capped at
  the lane's ``tcp_sndbuf`` default, non-blocking sends): the lane is held to the best the medium does with
  them too.
- ``pipe:4``: the medium of the tcp lane's local connections (:mod:`kvbridge.bench.rawtcp` ``@NAME``): the
  bytes vmspliced into pipes handed over an abstract Unix socket, one copy. It crosses between processes of
  one network namespace only (``--pods``); across hosts its row says it could not connect.
- Any stream count is a row (``tcp:8``, ``ctcp:2``, ``ctcp-sndbuf:8``, ``pipe:2``); the ratio column divides
  by the best of every raw row (these four kinds) of the same cap and size: the fastest raw medium that
  crosses there.
- ``/scat`` after a C row (``ctcp-sndbuf:4/scat``, ``pipe:4/scat``): the same medium moving the bytes in the
  layout the ``kvbridge`` row's engines hold them in: a plane per layer's K and V, the request's blocks at
  random slots of each (32 KiB pieces for Llama-3-8B), each side its own, one iovec entry per piece. Its column, ``x scat raw``,
  divides by the best such row: the lane against the medium in the same layout, apart from what scattered
  pieces cost the memory system (the gap between a row and its ``/scat`` twin); in brackets the range of
  that ratio round by round, each round's two medians measured minutes apart at most.
- ``ucp-get``: one ucp GET of the bytes as one buffer over UCX's tcp with peer error handling
  (:mod:`kvbridge.bench.peers` ``ucp-get:tcp``): the medium of kvbridge's cross-host lane.
- ``nixl``, ``mooncake``: NIXL's READ over UCX tcp and Mooncake's TCP transfer engine of the same
  scattered descriptors (``nixl:tcp``, ``mooncake:tcp``), where installed; "-" and the reason otherwise.
- ``cma`` (not a default row): ``process_vm_readv`` of the descriptors, which cannot cross a pid
  namespace: its row says why it was not measured, the proof that kvbridge's ``auto`` cannot pick it.

``--pods``: two pods on one node instead (:class:`~kvbridge.testing.hosts.EmulatedHosts` ``pods=True``: one
network namespace, loopback only, each pod its own pid, uts, IPC and mount namespaces); no caps.

Every timed transfer starts with the CPU caches cold (:mod:`kvbridge.bench.cold`; on one node both ends
share the last-level cache). Rows rotate between rounds (the machine's load drifts); each row reports the
median of all its samples and the range of its per-round medians. A ``kvbridge`` row's round also splits its
loads in three, medians in the log and in the record (``parts_ms``): ``start`` (the engine's ``start_step``,
which starts the read), ``read`` (until the engine's wait returns) and ``report`` (the poll that reports
it): what an engine adds to the medium's own time. A child that says nothing for
``--child-timeout`` seconds (a hang) is killed and its row reported failed, with the reason and the tail of
its stderr. UCX settings come from the environment (``UCX_TCP_TX_SEG_SIZE``,
``UCX_TCP_RX_SEG_SIZE`` ...), which every child inherits; the report names the ``UCX_`` variables set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.bench import cold, peers, rawtcp, ucx_baselines
from kvbridge.bench.baselines import Unavailable
from kvbridge.bench.child import HOST_SPEECH, Hung, JsonChild
from kvbridge.bench.core import SHAPES, Point
from kvbridge.connectors.ucx import tcplane
from kvbridge.testing.hosts import EmulatedHosts, Host, unavailable

ROWS = ("kvbridge", "kvbridge-ucp", "tcp:1", "tcp:4", "ctcp:1", "ctcp:4", "ctcp-sndbuf:4", "ctcp-sndbuf:4/scat",
        "ucp-get", "nixl", "mooncake", "pipe:4", "cma")
RAW = ("tcp:", "ctcp:", "ctcp-sndbuf:", "pipe:")  # raw rows, any stream count (tcp:8, ctcp:8 ...): the bar
SCAT = "/scat"  # a C raw row in the request's scattered layout (ctcp-sndbuf:4/scat)
DEFAULT_ROWS = ROWS[:-2]  # pipe:N crosses no host: --pods
CAPS = ("none", "25gbit", "10gbit")
_PEER_ROWS = {"ucp-get": "ucp-get:tcp", "nixl": "nixl:tcp", "mooncake": "mooncake:tcp", "cma": "cma"}
_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}
# The longest a child may stay silent: its start (imports, a producer's KV), a warm-up and the reps of one
# point at the slowest cap (a 128 MiB point at 10gbit takes well under a second a rep).
CHILD_TIMEOUT_S = 300.0


class _Proc(JsonChild):
    """A child on a host (:class:`~kvbridge.bench.child.JsonChild`, spoken to as ``HOST_SPEECH``), killed and
    :class:`Hung` when it says nothing for ``timeout_s``."""

    def __init__(self, host: Host, argv: Sequence[str], timeout_s: float = CHILD_TIMEOUT_S, python: bool = True):
        super().__init__([sys.executable, *argv] if python else argv, env={**os.environ, **_ENV}, speech=HOST_SPEECH,
                         timeout_s=timeout_s, kill_silent=True, popen=host.popen)  # fmt: skip


def _kvbridge(a: Host, b: Host, point: Point, reps: int, progress_mode: str = "thread", lane: str = "auto",
              timeout_s: float = CHILD_TIMEOUT_S, parts: dict[str, list[float]] | None = None) -> list[float]:
    from kvbridge.bench.ucx_baselines import _point_json

    with tempfile.TemporaryDirectory(prefix="kvbridge-hosts-bench-") as registry:
        producer = _Proc(a, ["-m", "kvbridge.bench.ucx_baselines", "producer", registry, _point_json(point), progress_mode],
                         timeout_s)
        consumer = None
        try:
            digest = producer.line("producer")["sha256"]
            consumer = _Proc(b, ["-m", "kvbridge.bench._host_child", "kvb-consumer", _point_json(point), str(reps),
                                 progress_mode, digest, lane], timeout_s)
            while True:
                msg = consumer.line("consumer")
                if "samples" in msg:
                    if parts is not None:
                        _add_parts(parts, msg.get("parts", {}))
                    return [float(v) for v in msg["samples"]]
                producer.say({"op": "offer", "rid": msg["offer"]})
                consumer.say(producer.line("producer"))
        finally:
            if consumer is not None:
                consumer.close()
            producer.close()


def _pair(a: Host, b: Host, what: str, send: Sequence[str], recv: Callable[[int], Sequence[str]], timeout_s: float,
          python: bool) -> list[float]:
    """A raw row: ``send`` started on ``a`` says its port, ``recv(port)`` on ``b`` times the reps."""
    sender = _Proc(a, send, timeout_s, python=python)
    try:
        port = sender.line(f"{what} sender")["port"]
        receiver = _Proc(b, recv(port), timeout_s, python=python)
        try:
            return [float(v) for v in receiver.line(f"{what} receiver")["samples"]]
        finally:
            receiver.close()
    finally:
        sender.close()


def _tcp(a: Host, b: Host, nbytes: int, streams: int, reps: int, timeout_s: float = CHILD_TIMEOUT_S) -> list[float]:
    child = ["-m", "kvbridge.bench._host_child"]
    return _pair(a, b, "tcp", [*child, "tcp-send", str(nbytes), str(streams)],
                 lambda port: [*child, "tcp-recv", a.address, str(port), str(nbytes), str(streams), str(reps)],
                 timeout_s, python=True)


def _ctcp(a: Host, b: Host, nbytes: int, streams: int, reps: int, timeout_s: float = CHILD_TIMEOUT_S,
          sndbuf: int = 0, pipes: bool = False, layout: Sequence[str] = ()) -> list[float]:
    """rawtcp over TCP (``sndbuf``: each send buffer's cap, 0 the kernel's), or through pipes handed over an
    abstract Unix socket (``pipes``: rows ``pipe:N``); ``layout``: rawtcp's scattered layout (rows ``.../scat``,
    :func:`_scattered`)."""
    exe = [*(["env", *layout] if layout else []), rawtcp.binary()]
    name = f"@kvbridge-bench-{os.getpid()}-{time.monotonic_ns()}"
    evict_bytes = 0 if not cold.evicting() else 2 * cold.llc_bytes()
    return _pair(a, b, "pipe" if pipes else "ctcp", [*exe, "send", str(nbytes), str(streams), name if pipes else str(sndbuf)],
                 lambda port: [*exe, "recv", name if pipes else a.address, str(port), str(nbytes), str(streams), str(reps),
                               str(evict_bytes)],
                 timeout_s, python=False)


def _scattered(point: Point) -> list[str]:
    """rawtcp's environment for ``point``'s bytes laid out as the ``kvbridge`` row's engines hold them: a region
    per layer's K and V plane, of as many slots as the engine has blocks, a piece per block."""
    shape = point.shape
    env = rawtcp.scattered(point.block_size * shape.bytes_per_token // (2 * shape.num_layers), 2 * shape.num_layers,
                           ucx_baselines.pool_blocks(point))
    return [f"{k}={v}" for k, v in env.items()]


def measure_row(row: str, a: Host, b: Host, point: Point, reps: int, timeout_s: float = CHILD_TIMEOUT_S,
                parts: dict[str, list[float]] | None = None) -> list[float]:
    """``reps`` timed transfers of ``point``'s bytes by ``row``, from host ``a`` to host ``b`` (seconds);
    :class:`Hung` when one of its children stays silent for ``timeout_s``. ``parts``: a ``kvbridge`` row's
    loads split in three (:func:`kvbridge.bench.ucx_baselines.consume`), seconds appended per name."""
    if row.startswith("kvbridge"):
        return _kvbridge(a, b, point, reps, lane=row.partition("-")[2] or "auto", timeout_s=timeout_s, parts=parts)
    if row.startswith("tcp:"):
        return _tcp(a, b, point.nbytes, int(row.split(":")[1]), reps, timeout_s)
    kind, _, n = row.removesuffix(SCAT).partition(":")
    if kind in ("ctcp", "ctcp-sndbuf", "pipe"):
        return _ctcp(a, b, point.nbytes, int(n), reps, timeout_s, sndbuf=tcplane.SNDBUF if kind == "ctcp-sndbuf" else 0,
                     pipes=kind == "pipe", layout=_scattered(point) if row.endswith(SCAT) else ())
    name = _PEER_ROWS[row]
    why = peers.PEERS[name].missing()
    if why:
        raise Unavailable(why)
    spec = {**peers.spec(name, point, reps), "across_hosts": True}
    return list(peers.run_spec(spec, (a.prefix(), b.prefix())).samples)


def run(tokens: Sequence[int], caps: Sequence[str], rows: Sequence[str], reps: int, rounds: int,
        shape: str = "8b", log: Any = None, pods: bool = False, child_timeout_s: float = CHILD_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every row at every cap and size; rows rotated between rounds. One dict per (cap, tokens, row).
    ``pods``: two pods on one node (one network, own pid and IPC namespaces) instead of two hosts. A row
    whose child hangs (silent for ``child_timeout_s``) is not tried again at that point: its note says
    ``failed:`` and why."""
    out: list[dict[str, Any]] = []
    for cap in ["pods"] if pods else caps:
        with EmulatedHosts(2, rate=None if cap in ("none", "pods") else cap, pods=pods) as (a, b):
            for t in tokens:
                point = Point(SHAPES[shape], t)
                per_round: dict[str, list[list[float]]] = {r: [] for r in rows}
                parts: dict[str, dict[str, list[float]]] = {r: {} for r in rows}
                notes: dict[str, str] = {}
                for k in range(rounds):
                    for row in [*rows[k % len(rows):], *rows[: k % len(rows)]]:
                        if row in notes:
                            continue
                        mine: dict[str, list[float]] = {}
                        try:
                            per_round[row].append(measure_row(row, a, b, point, reps, child_timeout_s, mine))
                        except Unavailable as exc:
                            notes[row] = f"{'failed' if isinstance(exc, Hung) else 'not measured'}: {exc}"
                        _add_parts(parts[row], mine)
                        if log:
                            print(f"  cap {cap} {t} tokens round {k + 1} {row}: "
                                  f"{notes.get(row) or _gbps(point.nbytes, per_round[row][-1])}{_parts_line(mine)}",
                                  file=log, flush=True)
                for row in rows:
                    out.append(_summary(cap, point, row, per_round[row], notes.get(row, ""), parts[row]))
    return out


def _gbps(nbytes: int, samples: Sequence[float]) -> str:
    return f"{nbytes / statistics.median(samples) / 1e9:.2f} GB/s"


def _add_parts(into: dict[str, list[float]], parts: dict[str, Any]) -> None:
    """Append ``parts``' seconds (a kvbridge row's loads, by part) to ``into``'s."""
    for name, seconds in parts.items():
        into.setdefault(name, []).extend(float(v) for v in seconds)


def _median_ms(parts: dict[str, list[float]]) -> dict[str, float]:
    """Each part's median, in ms (parts with no sample left out)."""
    return {name: statistics.median(s) * 1e3 for name, s in parts.items() if s}


def _parts_line(parts: dict[str, list[float]]) -> str:
    """A kvbridge load's parts for the log (`` (a load: start 0.30 ms, read 6.21 ms, report 0.20 ms)``), or ""."""
    shown = ", ".join(f"{name} {ms:.2f} ms" for name, ms in _median_ms(parts).items())
    return f" (a load: {shown})" if shown else ""


def _summary(cap: str, point: Point, row: str, rounds: list[list[float]], note: str,
             parts: dict[str, list[float]] | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"cap": cap, "tokens": point.tokens, "bytes": point.nbytes, "row": row, "note": note}
    if parts:  # a kvbridge row: its loads' parts, medians over every round
        rec["parts_ms"] = _median_ms(parts)
    if rounds:
        every = [s for r in rounds for s in r]
        medians = [point.nbytes / statistics.median(r) / 1e9 for r in rounds]
        rec.update(gbps=point.nbytes / statistics.median(every) / 1e9, low=min(medians), high=max(medians),
                   samples=every, rounds=len(rounds), round_gbps=medians)
    return rec


def table(records: Sequence[dict[str, Any]]) -> str:
    """The records as a table: each row's GB/s over the best raw row, and over the best raw row in the KV's
    scattered layout, with the range of that ratio round by round (the two measured minutes apart at most,
    so a drift of the machine's load moves both: the range says how far one run's ratio can be trusted)."""
    lines = [f"{'cap':7} {'tokens':>6} {'MiB':>5} {'row':18} {'GB/s':>6} {'(round medians)':>16} {'x raw best':>10} "
             f"{'x scat raw (per round)':>22}  note"]
    def best(rec: dict[str, Any], scat: bool) -> dict[str, Any] | None:  # the bar: the best raw row (scattered)
        return max((r for r in records if r["cap"] == rec["cap"] and r["tokens"] == rec["tokens"] and "gbps" in r
                    and r["row"].startswith(RAW) and (not scat or r["row"].endswith(SCAT))),
                   key=lambda r: r["gbps"], default=None)

    for rec in records:
        head = f"{rec['cap']:7} {rec['tokens']:6} {rec['bytes'] >> 20:5} {rec['row']:18}"
        if "gbps" not in rec:
            lines.append(f"{head} {'-':>6} {'':16} {'':10} {'':22}  {rec['note'][:160]}")
            continue
        spread = "({:.2f}-{:.2f})".format(rec["low"], rec["high"])
        raw, scat = best(rec, False), best(rec, True)
        over_raw = f"{rec['gbps'] / raw['gbps']:10.2f}" if raw else f"{'-':>10}"
        over_scat = f"{'-':>22}"
        if scat:
            paired = [a / b for a, b in zip(rec.get("round_gbps", ()), scat.get("round_gbps", ()))]
            rounds = f"({min(paired):.2f}-{max(paired):.2f})" if paired else ""
            over_scat = f"{rec['gbps'] / scat['gbps']:.2f} {rounds:>12}".rjust(22)
        lines.append(f"{head} {rec['gbps']:6.2f} {spread:>16} {over_raw} {over_scat}")
    return "\n".join(lines)


def _raw(row: str) -> bool:
    """``tcp:N``, ``ctcp:N``, ``ctcp-sndbuf:N`` or ``pipe:N`` with 1 <= N <= 64, the C ones with ``/scat`` or not."""
    kind, _, n = row.removesuffix(SCAT).partition(":")
    scat_ok = not row.endswith(SCAT) or kind != "tcp"
    return f"{kind}:" in RAW and n.isdigit() and 1 <= int(n) <= 64 and scat_ok


def _list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench hosts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,64", help="tokens per request (Llama-3-8B KV: 128 KiB a token)")
    ap.add_argument("--caps", default=",".join(CAPS), help="link caps, comma-separated: none or a tc rate (10gbit)")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated of {list(ROWS)}")
    ap.add_argument("--pods", action="store_true",
                    help="two pods on one node (one network, own pid and IPC namespaces) instead of two hosts; no caps")
    ap.add_argument("--reps", type=int, default=3, help="timed transfers per row and round (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, rows rotated between them")
    ap.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    ap.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_S,
                    help="seconds a child may stay silent before its row is reported failed (default %(default)g)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"kvbridge bench hosts: {why}", file=sys.stderr)
        return 2
    rows = _list(args.rows)
    bad = [r for r in rows if r not in ROWS and not _raw(r)]
    if bad or args.reps < 1 or args.rounds < 1 or not args.child_timeout > 0:
        ap.error(f"unknown rows {bad} (known: {list(ROWS)})" if bad
                 else "--reps and --rounds must be >= 1, --child-timeout > 0")
    tokens = [int(t) for t in _list(args.tokens)]
    ucx_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_"))
    print(f"kvbridge bench hosts ({'two pods on one node' if args.pods else 'two hosts'}): Llama-3-8B KV, scattered "
          f"blocks; {args.rounds} rounds x {args.reps} reps; "
          f"{ucx_env or 'no UCX_ variables set'}", flush=True)
    t0 = time.perf_counter()
    records = run(tokens, _list(args.caps), rows, args.reps, args.rounds, log=sys.stdout, pods=args.pods,
                  child_timeout_s=args.child_timeout)
    print(table(records))
    print(f"({time.perf_counter() - t0:.0f} s; ratios: GB/s over the best raw row of the same cap and size, and over "
          f"the best raw row in the request's scattered layout, {SCAT})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ucx_env": ucx_env, "records": records}, f, indent=1)
        print(f"wrote {args.json} (kvbridge simulate --from-bench {args.json}: does P/D pay at 10/25/100 GbE)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CAPS", "CHILD_TIMEOUT_S", "ROWS", "Hung", "main", "measure_row", "run", "table"]
