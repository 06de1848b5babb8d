"""The ``kvbridge`` command line. Each subcommand lives in its own module, imported only when used.

A command module exposes ``configure(parser: argparse.ArgumentParser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import kvbridge
from kvbridge.errors import KVBridgeError

# name -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "backends": ("kvbridge.cli", "list the backends and whether each can run here"),
    "bench": ("kvbridge.bench.cli", "measure KV transfer cost of every available backend against baselines "
              "('bench hosts': across emulated hosts)"),
    "simulate": ("kvbridge.simulate.cli", "simulate colocated vs disaggregated prefill/decode serving"),
    "metadata-server": ("kvbridge.metadata.server", "run the gRPC metadata server (handshake, release, directory)"),
    "proxy": ("kvbridge.serving.proxy", "P/D proxy: prefill on one vLLM server, decode on another"),
    "publish": ("kvbridge.serving.publishing", "publish a vLLM engine's prefix cache (its KV events) for proxy --directory"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import importlib
    import json

    from kvbridge import native, registry

    rows: list[dict[str, Any]] = []
    for name, spec in registry.available().items():
        problem = registry.check(name)
        row = {"name": name, "available": problem is None, "summary": spec.summary, "problem": problem}
        if problem is None:  # a backend may say which of its paths is active here (ucx: one- or two-sided)
            describe = getattr(importlib.import_module(spec.target.partition(":")[0]), "describe", None)
            row["detail"] = describe() if callable(describe) else None
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'native':<{width}}  {native.describe()}")
    for r in rows:
        state = "yes" if r["available"] else "no "
        line = f"{r['name']:<{width}}  {state}  {r['summary']}"
        if r.get("detail"):
            line += f"\n{'':<{width}}       {r['detail']}"
        if r["problem"]:
            line += f"\n{'':<{width}}       -> {r['problem']}"
        print(line)
    return 0


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="Move an LLM's KV cache between engines and tiers.",
        epilog="commands:\n" + "\n".join(f"  {n:<16} {s}" for n, (_, s) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {kvbridge.__version__}")
    parser.add_argument("command", nargs="?", choices=list(COMMANDS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv)  # handles --help / --version / errors
        top.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    if name == "bench" and rest[:1] == ["hosts"]:  # the bench across emulated hosts: its own options
        from kvbridge.bench import hosts

        return hosts.main(rest[1:])
    module_name, summary = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvbridge {name}", description=summary)
    module.configure(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KVBridgeError as exc:  # bad input found past parsing: one line, no traceback
        print(f"kvbridge {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
