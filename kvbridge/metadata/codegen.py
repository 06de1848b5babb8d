"""Regenerate the committed gRPC stubs of ``proto/kvbridge/v1`` or check that they are current.

    python -m kvbridge.metadata.codegen            # rewrite kvbridge/v1/*_pb2*.py(i)
    python -m kvbridge.metadata.codegen --check    # exit 1 if regenerating would change them (CI)

The generator is pinned (:data:`GENERATOR`): stubs embed the protobuf version of the protoc that
made them and refuse, at import, any older runtime. grpcio-tools 1.78 bundles protoc 31.1 (gencode
6.31.1), whose stubs import under protobuf 6.31.1 through 7.x and grpcio >= 1.78 — LMCache pins
protobuf < 7, so a newer generator (1.82 bundles protoc 35, gencode 7.35) would break it. Another
grpcio-tools version is refused rather than allowed to produce a spurious diff; ``--python`` runs the
generator from another interpreter that has the pinned one.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GENERATOR = "1.78"  # grpcio-tools major.minor whose protoc made the committed stubs
ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "kvbridge" / "v1"
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def protos() -> list[Path]:
    """The ``.proto`` files of package kvbridge.v1, relative to ``proto/``."""
    return sorted(p.relative_to(PROTO_DIR) for p in (PROTO_DIR / "kvbridge" / "v1").glob("*.proto"))


def generator_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('grpcio-tools'))"],
        capture_output=True, text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else ""


def generate(dest: Path, python: str = sys.executable) -> list[Path]:
    """Run protoc on every proto into ``dest``; return the generated stub paths relative to ``dest``."""
    files = protos()
    cmd = [python, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={dest}", f"--pyi_out={dest}",
           f"--grpc_python_out={dest}", *map(str, files)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [f.parent / (f.stem + s) for f in files for s in _SUFFIXES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.metadata.codegen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs differ from fresh ones")
    parser.add_argument("--python", default=sys.executable, help="interpreter whose grpcio-tools to run")
    args = parser.parse_args(argv)
    if not PROTO_DIR.is_dir():
        print(f"codegen: no {PROTO_DIR} (run from a source checkout)", file=sys.stderr)
        return 2
    version = generator_version(args.python)
    if version.rsplit(".", 1)[0] != GENERATOR:
        print(f"codegen: needs grpcio-tools=={GENERATOR}.* (found {version or 'none'} in {args.python}); "
              f"pip install 'grpcio-tools=={GENERATOR}.*' or pass --python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), args.python)
        rel_out = OUT_DIR.relative_to(ROOT)
        stale = [f for f in fresh if not (ROOT / f).is_file() or not filecmp.cmp(Path(tmp) / f, ROOT / f, shallow=False)]
        known = {ROOT / f for f in fresh}
        orphans = [p.relative_to(ROOT) for s in _SUFFIXES for p in OUT_DIR.glob("*" + s) if p not in known]
        if args.check:
            for f in stale:
                print(f"codegen: {f} is out of date", file=sys.stderr)
            for f in orphans:
                print(f"codegen: {f} has no .proto", file=sys.stderr)
            if stale or orphans:
                print("codegen: run `python -m kvbridge.metadata.codegen` and commit the result", file=sys.stderr)
                return 1
            print(f"codegen: {len(fresh)} stubs in {rel_out} are current")
            return 0
        for f in stale:
            shutil.copyfile(Path(tmp) / f, ROOT / f)
            print(f"codegen: wrote {f}")
        for f in orphans:
            (ROOT / f).unlink()
            print(f"codegen: removed {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
