"""Inputs of ``kvbridge simulate``, checked when the flags are parsed: argparse ``type=`` validators (a bad value
is one line and exit 2), the KV hand-off fitted from a ``kvbridge bench --json`` file, the engine model fitted
from measured step times (``--calibrate``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.simulate.model import EngineModel, HandOff

if TYPE_CHECKING:
    from kvbridge.simulate.hostbench import HostsBench

Bad = argparse.ArgumentTypeError


def _number(text: str, kind: type, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise Bad(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and math.isnan(value):
        raise Bad(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int, "a whole number > 0")
    if value <= 0:
        raise Bad(f"must be > 0, got {text}")
    return int(value)


def count(text: str) -> int:
    """A whole number >= 0."""
    value = _number(text, int, "a whole number >= 0")
    if value < 0:
        raise Bad(f"must be >= 0, got {text}")
    return int(value)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float, "a number > 0")
    if not 0 < value < math.inf:
        raise Bad(f"must be a finite number > 0, got {text}")
    return float(value)


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number >= 0")
    if not 0 <= value < math.inf:
        raise Bad(f"must be a finite number >= 0, got {text}")
    return float(value)


def bandwidth(text: str) -> float:
    """GB/s > 0; ``inf`` for a free hand-off."""
    value = _number(text, float, "GB/s > 0 (or inf)")
    if value <= 0:
        raise Bad(f"must be > 0 (or inf), got {text}")
    return float(value)


def fraction(text: str) -> float:
    value = _number(text, float, "a share in 0..1")
    if not 0 <= value <= 1:
        raise Bad(f"must be in 0..1, got {text}")
    return float(value)


def token_range(text: str) -> tuple[int, int]:
    """``N`` or ``A-B`` tokens, 1 <= A <= B."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise Bad(f"expected N or A-B (tokens), got {text!r}") from None
    if not 1 <= a <= b:
        raise Bad(f"expected 1 <= A <= B, got {text!r}")
    return a, b


def pools(text: str) -> list[tuple[int, int]]:
    """``xP:yD`` pool sizes, comma-separated (``1:1,3:1``; the P and D are optional)."""
    out = []
    for part in text.split(","):
        p, sep, d = part.strip().upper().replace("P", "").replace("D", "").partition(":")
        try:
            x, y = int(p), int(d)
        except ValueError:
            raise Bad(f"expected xP:yD[,xP:yD...] such as 1:1,3:1, got {text!r}") from None
        if not sep or x < 1 or y < 1:
            raise Bad(f"each pool needs >= 1 prefill and >= 1 decode server, got {part.strip()!r}")
        out.append((x, y))
    return out


def sweep(text: str) -> list[float]:
    """``A:B:STEP`` request rates (req/s), A..B inclusive; at most 60 of them."""
    parts = text.split(":")
    try:
        a, b, step = (float(v) for v in parts)
    except ValueError:
        raise Bad(f"expected A:B:STEP such as 0.5:4:0.5, got {text!r}") from None
    if not (0 < a <= b < math.inf and 0 < step < math.inf):
        raise Bad(f"expected 0 < A <= B and STEP > 0, got {text!r}")
    n = math.floor((b - a) / step + 1e-9) + 1
    if n > 60:
        raise Bad(f"{n} rates; at most 60 (a larger STEP)")
    return [round(a + i * step, 10) for i in range(n)]


def names(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out:
        raise Bad("expected one or more comma-separated names")
    return out


LINK_UNITS = {"tbit": 10**12, "gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}


def link_bits(name: str) -> int | None:
    """A link of ``kvbridge bench hosts``: a tc rate (``10gbit``, ``2500mbit``) -> bits/s; ``none`` (the
    uncapped link) and ``pods`` (two pods on one node) -> None. Anything else is a :class:`Bad`."""
    text = name.strip().lower()
    if text in ("none", "pods"):
        return None
    for unit, scale in LINK_UNITS.items():
        number = text.removesuffix(unit)
        if number != text:
            try:
                bits = float(number) * scale
            except ValueError:
                break
            if 0 < bits < math.inf:
                return int(bits)
            break
    raise Bad(f"link {name!r}: expected a tc rate such as 10gbit, 25gbit, 100gbit (or none: uncapped)")


def links(text: str) -> list[str]:
    """Comma-separated links (:func:`link_bits`), lower-cased."""
    out = [v.lower() for v in names(text)]
    for v in out:
        link_bits(v)
    return out


def out_file(text: str) -> str:
    """A file to write: its folder must exist (``-`` for stdout)."""
    if text == "-":
        return text
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise Bad(f"no such folder: {os.path.dirname(text) or '.'}")
    if os.path.isdir(text):
        raise Bad(f"{text} is a folder")
    return text


def plot_file(text: str) -> str:
    """A PNG/SVG/PDF to write: its folder must exist, and matplotlib must be importable."""
    if text == "-":
        raise Bad("a plot needs a file name")
    out_file(text)
    if os.path.splitext(text)[1].lower() not in (".png", ".svg", ".pdf"):
        raise Bad(f"expected a .png, .svg or .pdf file, got {text!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise Bad("needs matplotlib: pip install 'kvbridge[bench]'") from None
    return text


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise Bad(f"no such file: {path}") from None
    except IsADirectoryError:
        raise Bad(f"{path} is a folder") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Bad(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise Bad(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (an active set, dropping the most negative until none is)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


def fit_line(nbytes: np.ndarray, secs: np.ndarray) -> tuple[float, float]:
    """``seconds = fixed + bytes / rate`` fitted (least squares, both >= 0) to measured transfers: ``(fixed_ms,
    GB/s)``. One size, or no growth with size: its throughput, nothing fixed."""
    if len(set(nbytes.tolist())) >= 2:
        fixed, per_byte = _nnls(np.column_stack([np.ones_like(nbytes), nbytes]), secs)
    else:
        fixed, per_byte = 0.0, 0.0
    if per_byte <= 0:
        fixed, per_byte = 0.0, float((secs / nbytes).mean())
    return float(fixed) * 1e3, 1 / float(per_byte) / 1e9


@dataclasses.dataclass(frozen=True)
class BenchFile:
    path: str
    handoffs: dict[str, HandOff]  # backend -> its fitted hand-off (a kvbridge bench --json file)
    hosts: HostsBench | None = None  # a kvbridge bench hosts --json file: hand-offs per row and link


def bench_file(path: str) -> BenchFile:
    """``kvbridge bench --json`` records -> per backend, ``fixed + bytes / GB/s`` fitted to its measured
    single-request ``transfer`` (peers) or ``load`` (stores: what the decode side waits for) medians. A
    ``kvbridge bench hosts --json`` file (``{"records": [...]}``) -> :class:`~kvbridge.simulate.hostbench.HostsBench`."""
    records = _read_json(path)
    if isinstance(records, dict) and "records" in records:
        from kvbridge.simulate.hostbench import hosts_bench  # it uses this module's helpers

        return BenchFile(path, {}, hosts_bench(path, records))
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise Bad(
            f"{path} is not a kvbridge bench --json file (expected a list of records, or bench hosts' "
            '{"records": [...]})'
        )
    points: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for i, r in enumerate(records):
        missing = [k for k in ("backend", "op", "bytes", "median_s") if k not in r]
        if missing:
            raise Bad(f"{path}: record {i} is not a kvbridge bench record (no {', '.join(missing)})")
        if r["op"] not in ("transfer", "load") or r["median_s"] is None or r.get("requests", 1) != 1:
            continue
        if not isinstance(r["bytes"], (int, float)) or not isinstance(r["median_s"], (int, float)):
            raise Bad(f"{path}: record {i} has a non-numeric bytes or median_s")
        if r["bytes"] > 0 and r["median_s"] > 0:
            points.setdefault(str(r["backend"]), {}).setdefault(r["op"], []).append((r["bytes"], r["median_s"]))
    if not points:
        raise Bad(f"{path} has no measured single-request load or transfer")
    out = {}
    for backend, ops in sorted(points.items()):
        op = "transfer" if "transfer" in ops else "load"
        pts = np.asarray(sorted(set(ops[op])))
        fixed_ms, gbps = fit_line(pts[:, 0], pts[:, 1])
        out[backend] = HandOff(
            backend, fixed_ms, gbps,
            f"{backend} {op}: {fixed_ms:.2f} ms + {gbps:.2f} GB/s fitted to {len(pts)} sizes in {path}", "measured",
        )  # fmt: skip
    return BenchFile(path, out)


# --calibrate: a step's columns and their coefficient in EngineModel
_COLUMNS = (
    ("step", None, "step_ms"),
    ("decodes", 1.0, "seq_ms"),
    ("context_tokens", 1e-3, "ctx_ms_per_ktok"),
    ("prefill_tokens", 1e-3, "prefill_ms_per_ktok"),
)


@dataclasses.dataclass(frozen=True)
class Calibration:
    path: str
    fields: dict[str, Any]  # EngineModel fields fitted (or given) by the file
    steps: int
    rms_pct: float

    def apply(self, model: EngineModel) -> EngineModel:
        return dataclasses.replace(model, **self.fields)


def calibration_file(path: str) -> Calibration:
    """Measured step times -> the engine model. The file is ``{"steps": [{"decodes": N, "context_tokens": C,
    "prefill_tokens": P, "ms": T}, ...], "kv_tokens": K, "source": "..."}`` (or just the list of steps): each
    step ran ``decodes`` sequences holding ``context_tokens`` of KV in all, plus ``prefill_tokens`` prompt
    tokens, in ``ms``. A coefficient whose column never varies keeps its default."""
    data = _read_json(path)
    doc = {"steps": data} if isinstance(data, list) else data
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list) or not doc["steps"]:
        raise Bad(
            f'{path}: expected {{"steps": [{{"decodes": N, "context_tokens": C, "prefill_tokens": P, "ms": T}}, ...]}}'
        )
    rows, ys = [], []
    for i, s in enumerate(doc["steps"]):
        if not isinstance(s, dict) or "ms" not in s:
            raise Bad(f'{path}: step {i} needs at least "ms" (and decodes, context_tokens, prefill_tokens)')
        try:
            vals = [float(s.get(k, 0)) for k, _, _ in _COLUMNS[1:]]
            ms = float(s["ms"])
        except (TypeError, ValueError):
            raise Bad(f"{path}: step {i} has a non-numeric value") from None
        if ms <= 0 or min(vals) < 0 or not all(math.isfinite(v) for v in [*vals, ms]):
            raise Bad(f"{path}: step {i} needs ms > 0 and counts >= 0")
        rows.append([1.0] + [v * scale for v, (_, scale, _) in zip(vals, _COLUMNS[1:])])  # type: ignore[operator]
        ys.append(ms)
    a, y = np.asarray(rows), np.asarray(ys)
    used = [0] + [j for j in range(1, a.shape[1]) if np.ptp(a[:, j]) > 0]
    if len(rows) < len(used):
        raise Bad(
            f"{path}: {len(rows)} steps cannot fit {len(used)} coefficients; measure more batch/context/prompt sizes"
        )
    coef = _nnls(a[:, used], y)
    fields: dict[str, Any] = {_COLUMNS[j][2]: float(c) for j, c in zip(used, coef)}
    rms = float(np.sqrt(np.mean(((a[:, used] @ coef - y) / y) ** 2)) * 100)
    if "kv_tokens" in doc:
        kv = doc["kv_tokens"]
        if not isinstance(kv, int) or kv <= 0:
            raise Bad(f"{path}: kv_tokens must be a whole number > 0")
        fields["kv_tokens"] = kv
    fitted = ", ".join(k for k in fields if k != "kv_tokens")
    fields["source"] = (
        f"{doc.get('source') or 'calibrated'} ({path}: {fitted} fitted to {len(rows)} steps, rms {rms:.1f}%)"
    )
    return Calibration(path, fields, len(rows), rms)


__all__ = [
    "BenchFile",
    "Calibration",
    "bandwidth",
    "bench_file",
    "calibration_file",
    "count",
    "fit_line",
    "fraction",
    "link_bits",
    "links",
    "names",
    "non_negative_float",
    "out_file",
    "plot_file",
    "pools",
    "positive_float",
    "positive_int",
    "sweep",
    "token_range",
]
