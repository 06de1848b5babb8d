"""The cross-host bench's raw medium in C (rows ``ctcp:N``): ``rawtcp.c`` built once per source version.

Why a program of our own rather than ``iperf3 -P N -n BYTES``: the bar must move the same bytes the way
kvbridge does — streams connected once and kept, one timed repetition per load, caches evicted before each
(every row of the bench starts cold) and the warm-up's bytes compared — while iperf3 times fresh
connections per test (slow start included), has its own control channel and is not installed everywhere.
The Python ``tcp:N`` rows stay beside it: they show what a socket loop in Python moves.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvbridge.bench.baselines import Unavailable

SOURCE = Path(__file__).with_name("rawtcp.c")


def scattered(piece: int, regions: int, slots: int) -> dict[str, str]:
    """rawtcp's environment for bytes laid out as a paged KV holds a request: ``regions`` planes (a layer's K or
    V) of ``slots`` blocks, ``piece`` bytes a block and plane (rawtcp.c's header: rows ``.../scat``)."""
    return {"KVBRIDGE_RAWTCP_PIECE": str(piece), "KVBRIDGE_RAWTCP_REGIONS": str(regions),
            "KVBRIDGE_RAWTCP_SLOTS": str(slots)}


def binary() -> str:
    """The path of the built ``rawtcp`` (built on first use, cached by the source's hash); raises
    :class:`Unavailable` without a C compiler."""
    text = SOURCE.read_bytes()
    out = Path(tempfile.gettempdir()) / f"kvbridge-rawtcp-{hashlib.sha256(text).hexdigest()[:16]}"
    if out.is_file() and os.access(out, os.X_OK):
        return str(out)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Unavailable("no C compiler (cc) to build the raw TCP bench program")
    tmp = out.with_name(out.name + f".{os.getpid()}")
    built = subprocess.run([cc, "-O2", "-pthread", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if built.returncode:
        raise Unavailable(f"building rawtcp failed: {built.stderr.strip()[-300:]}")
    tmp.replace(out)  # atomic: a concurrent bench sees the old binary or the whole new one
    return str(out)


__all__ = ["SOURCE", "binary", "scattered"]
