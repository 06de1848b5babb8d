"""The KV hand-off between two hosts, from a ``kvbridge bench hosts --json`` file, and the answer to "does P/D
pay at this link?" that ``kvbridge simulate --from-bench`` prints for it.

The file holds, per row (kvbridge's lanes, plain TCP, one raw UCX GET, NIXL, Mooncake) and link cap (``none``,
``25gbit``, ``10gbit``), the times of moving each measured size from host A to host B. Per row and cap, the
median time of each size gives ``fixed + bytes / GB/s`` (least squares, both >= 0, as for ``kvbridge bench
--json``). The hand-off at a link is then:

- **measured**, where the file ran that link (``10gbit`` is the cap ``10gbit``, ``none`` the uncapped link):
  that fit;
- **derived**, where it did not (100 GbE cannot be emulated where the machine's veth tops out lower): the
  row's fixed cost fitted on the uncapped link, then its bytes at ``min(link rate, the row's ceiling)``, the
  ceiling being the best GB/s the row measured on the uncapped link (the median of one size). That ceiling
  is the machine's that ran the bench (its veth, its cores), not a NIC's: a derived hand-off assumes the row
  fills the link up to what it reached there, and is never faster than either.

Each disaggregated layout is then compared with the better colocated one (colocated or chunked prefill, the
same engines): P/D pays when its SLO attainment is higher and the 95% intervals do not overlap, or, with a
rate sweep, when its goodput is higher. A disaggregated layout with a free hand-off (no fixed cost, no
bytes) beside them bounds what any link could give.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError
from kvbridge.simulate.inputs import Bad, fit_line, link_bits
from kvbridge.simulate.model import HandOff, Layout

LINKS = ("10gbit", "25gbit", "100gbit")  # the question's links: 10, 25 and 100 GbE
_KEYS = ("cap", "tokens", "bytes", "row", "note")
FREE = HandOff("free", 0.0, math.inf, "bound: no fixed cost, no bytes: what P/D gives these engines on any link",
               "bound")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Fit:
    """One row at one cap: ``fixed_ms + bytes / gbps``, fitted to ``sizes`` measured sizes, the best of
    which moved ``best_gbps`` (bytes over its median time)."""

    row: str
    cap: str
    fixed_ms: float
    gbps: float
    sizes: int
    best_gbps: float


@dataclasses.dataclass(frozen=True)
class HostsBench:
    path: str
    rows: tuple[str, ...]  # every row of the file, in its order (measured or not)
    caps: tuple[str, ...]
    fits: dict[tuple[str, str], Fit]  # (row, cap) -> fit, where the row measured something at that cap
    notes: dict[tuple[str, str], str]  # (row, cap) -> why it was not measured

    def _cap(self, link: str) -> str | None:
        """The file's cap that is ``link`` (same rate), else None."""
        bits = link_bits(link)
        for cap in self.caps:
            if (cap == link) if bits is None else (link_bits(cap) == bits):
                return cap
        return None

    def why_not(self, row: str, link: str) -> str:
        """Why ``row`` has no hand-off at ``link`` ('' when it has one)."""
        cap = self._cap(link)
        if cap is not None:
            if (row, cap) in self.fits:
                return ""
            return self.notes.get((row, cap)) or f"no record at cap {cap}"
        if link_bits(link) is None:
            return f"{self.path} has no {link} run (its caps: {', '.join(self.caps)})"
        if (row, "none") not in self.fits:
            why = self.notes.get((row, "none"), f"{self.path} has no uncapped (cap none) run to derive it from")
            return f"not measured at {link}, and nothing to derive it from: {why}"
        return ""

    def handoff(self, row: str, link: str) -> HandOff:
        """``row``'s hand-off at ``link``: measured where the file ran that link, else derived (see above)."""
        why = self.why_not(row, link)
        if why:
            raise ConfigError(f"{row} at {link}: {why}")
        name = f"{row} {link}"
        cap = self._cap(link)
        if cap is not None:
            f = self.fits[(row, cap)]
            where = "the uncapped link" if cap == "none" else f"the link capped at {cap}"
            return HandOff(name, f.fixed_ms, f.gbps, f"measured: {f.fixed_ms:.2f} ms + {f.gbps:.2f} GB/s fitted to "
                           f"{row}'s {f.sizes} sizes over {where} in {self.path}", "measured")  # fmt: skip
        f = self.fits[(row, "none")]
        bits = link_bits(link)
        assert bits is not None
        gbps = min(bits / 8e9, f.best_gbps)
        limit = (f"the {link} link's {bits / 8e9:.2f} GB/s" if bits / 8e9 <= f.best_gbps else
                 f"{f.best_gbps:.2f} GB/s, the best {row} measured on the uncapped link of the machine that ran "
                 f"the bench (its ceiling, not a {link} NIC's)")  # fmt: skip
        return HandOff(name, f.fixed_ms, gbps, f"derived: {f.fixed_ms:.2f} ms ({row}'s fixed cost on the uncapped "
                       f"link) + bytes at {limit}", "derived")  # fmt: skip

    def handoffs(self, rows: Sequence[str] | None, links: Sequence[str]) -> tuple[list[HandOff], list[str]]:
        """The hand-offs of ``rows`` (default: every row with one at every link) at ``links``, link by link;
        and a line per row left out, saying why, or whose derived links rest on an uncapped run slower than a
        capped one (noise). A row asked for by name that the file lacks, or that has no hand-off at one of
        the links, is a ConfigError saying what the file has."""
        measured = [r for r in self.rows if any(row == r for row, _ in self.fits)]
        chosen: list[str] = []
        skipped: list[str] = []
        if rows:
            unknown = [r for r in rows if r not in self.rows]
            if unknown:
                raise ConfigError(f"--bench-backend {','.join(unknown)}: not in {self.path} (it has rows "
                                  f"{', '.join(self.rows)}; measured: {', '.join(measured) or 'none'})")  # fmt: skip
            for r in rows:
                for link in links:
                    why = self.why_not(r, link)
                    if why:
                        raise ConfigError(f"--bench-backend {r} at {link}: {why}")
            chosen = list(dict.fromkeys(rows))
        else:
            for r in self.rows:
                why = next((f"{link}: {w}" for link in links if (w := self.why_not(r, link))), "")
                if why:
                    skipped.append(f"{r} left out ({why})")
                else:
                    chosen.append(r)
            if not chosen:
                raise ConfigError(f"{self.path}: no row has a hand-off at every link of {','.join(links)} "
                                  f"({'; '.join(skipped)})")  # fmt: skip
        links = list(dict.fromkeys(links))
        for r in chosen:
            if (r, "none") not in self.fits or all(self._cap(link) is not None for link in links):
                continue
            top = self.fits[(r, "none")].best_gbps
            faster = [f for (row, cap), f in self.fits.items() if row == r and f.best_gbps > top]
            if faster:
                f = max(faster, key=lambda f: f.best_gbps)
                skipped.append(f"{r}: reached {f.best_gbps:.2f} GB/s capped at {f.cap} but only {top:.2f} uncapped, "
                               "the ceiling its derived links use: the runs are noisy (more --rounds, a quieter "
                               "machine)")  # fmt: skip
        return [FREE, *(self.handoff(r, link) for link in links for r in chosen)], skipped


def hosts_bench(path: str, doc: Any) -> HostsBench:
    """Parse a ``kvbridge bench hosts --json`` document (``{"ucx_env": ..., "records": [...]}``) and fit each
    row at each cap. A malformed file is a :class:`~kvbridge.simulate.inputs.Bad` (one line, exit 2)."""
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not records:
        raise Bad(f'{path} is not a kvbridge bench hosts --json file (expected {{"records": [...]}}, not empty)')
    rows: dict[str, None] = {}
    caps: dict[str, None] = {}
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    notes: dict[tuple[str, str], str] = {}
    for i, r in enumerate(records):
        missing = [k for k in _KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise Bad(f"{path}: record {i} is not a kvbridge bench hosts record (no {', '.join(missing)})")
        row, cap = str(r["row"]), str(r["cap"]).lower()
        try:
            link_bits(cap)
        except Bad:
            raise Bad(f"{path}: record {i} has cap {r['cap']!r}, neither none, pods nor a tc rate") from None
        rows[row], caps[cap] = None, None
        samples = r.get("samples")
        if not samples:
            notes.setdefault((row, cap), str(r["note"]) or "not measured")
            continue
        nbytes = r["bytes"]
        if (not isinstance(samples, list) or not all(isinstance(s, (int, float)) and s > 0 for s in samples)
                or not isinstance(nbytes, int) or nbytes <= 0):  # fmt: skip
            raise Bad(f"{path}: record {i} needs bytes > 0 and samples of seconds > 0")
        points.setdefault((row, cap), []).append((float(nbytes), statistics.median(samples)))
    fits = {}
    for (row, cap), pts in points.items():
        a = np.asarray(sorted(set(pts)))
        fixed_ms, gbps = fit_line(a[:, 0], a[:, 1])
        best = float((a[:, 0] / a[:, 1]).max()) / 1e9
        fits[(row, cap)] = Fit(row, cap, fixed_ms, gbps, len(set(a[:, 0].tolist())), best)
    return HostsBench(path, tuple(rows), tuple(caps), fits, notes)


def _split(h: HandOff) -> tuple[str, str]:
    if h.basis == "bound":
        return "free hand-off", "any"
    row, _, link = h.name.rpartition(" ")
    return row, link


def answer(lays: Sequence[Layout], results: dict[str, dict[str, Any]],
           goodput: dict[str, float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Per disaggregated layout: its link, row, hand-off and basis, figures against the better colocated
    layout, and whether P/D pays (``yes``, ``no`` or ``unclear``: the 95% intervals of SLO attainment
    overlap; with ``goodput``, the higher goodput decides)."""
    colo = [lay.name for lay in lays if lay.kind != "disaggregated"]
    if not colo:
        return []
    best = max(colo, key=lambda n: ((goodput or {}).get(n, 0.0), results[n]["slo_attainment"]))
    c = results[best]
    out = []
    for lay in lays:
        if lay.kind != "disaggregated" or lay.handoff is None:
            continue
        d, h = results[lay.name], lay.handoff
        row, link = _split(h)
        if goodput:
            gd, gc = goodput[lay.name], goodput[best]
            pays = "yes" if gd > gc else "no" if gd < gc else "unclear"
        else:
            (dlo, dhi), (clo, chi) = d["ci95"]["slo_attainment"], c["ci95"]["slo_attainment"]
            pays = "yes" if dlo > chi else "no" if dhi < clo else "unclear"
        out.append({"layout": lay.name, "link": link, "row": row, "basis": h.basis, "fixed_ms": h.fixed_ms,
                    "gbps": h.gbps, "against": best, "slo_attainment": d["slo_attainment"],
                    "against_slo_attainment": c["slo_attainment"], "ttft_mean_ms": d["ttft_mean_ms"],
                    "against_ttft_mean_ms": c["ttft_mean_ms"], "itl_p999_ms": d["itl_p999_ms"],
                    "against_itl_p999_ms": c["itl_p999_ms"], "handoff_mean_ms": d["handoff_mean_ms"],
                    **({"goodput_rps": goodput[lay.name], "against_goodput_rps": goodput[best]} if goodput else {}),
                    "pays": pays})  # fmt: skip
    return out


def answer_table(rows: Sequence[dict[str, Any]], rate: float) -> str:
    """The answer as text: a paragraph, then one line per link and row."""
    if not rows:
        return ""
    swept = "goodput_rps" in rows[0]
    r0 = rows[0]
    head = (f"Does P/D pay? Each disaggregated layout against {r0['against']}, the better colocated layout (SLO met "
            f"{r0['against_slo_attainment']:.0%} at {rate:.3g} req/s, TTFT mean {r0['against_ttft_mean_ms']:.0f} ms, "
            f"ITL p99.9 {r0['against_itl_p999_ms']:.0f} ms" + (f", goodput {r0['against_goodput_rps']:g}/s" if swept
            else "") + "). " + ("The higher goodput decides. " if swept else "yes/no: the 95% intervals of SLO met "
            "do not overlap; unclear: they do. ") + "Hand-off basis: measured = fitted to the bench's runs at that "
            "link cap; derived = a link the bench did not run: the row's fixed cost + bytes at the lesser of the "
            "link's rate and the best the row reached uncapped on the bench's machine (that machine's ceiling, not "
            "the NIC's); bound = free.")  # fmt: skip
    cols = ["link", "row", "hand-off", "basis", "SLO met", "TTFT mean", "ITL p99.9", "hand-off mean"]
    cols += ["goodput"] if swept else []
    cols += ["P/D pays?"]
    table = [cols]
    for r in rows:
        kv = "0" if r["basis"] == "bound" else f"{r['fixed_ms']:.2f} ms + {r['gbps']:.2f} GB/s"
        line = [r["link"], r["row"], kv, r["basis"], f"{r['slo_attainment']:.0%}", f"{r['ttft_mean_ms']:.0f} ms",
                f"{r['itl_p999_ms']:.0f} ms", f"{r['handoff_mean_ms']:.0f} ms"]  # fmt: skip
        line += [f"{r['goodput_rps']:g}/s"] if swept else []
        table.append([*line, r["pays"]])
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    body = "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths)))
                     for t in table)  # fmt: skip
    return f"{textwrap.fill(head, 116)}\n\n{body}"


__all__ = ["FREE", "LINKS", "Fit", "HostsBench", "answer", "answer_table", "hosts_bench"]
