"""kvbridge simulate --from-bench with a ``kvbridge bench hosts --json`` file: the records parsed (a real run's
file, tests/data/bench_hosts.json, and records written the way bench/hosts.py writes them), the fit per row
and cap, measured vs derived hand-offs per link, the answer "does P/D pay", and a one-line error for each bad
input. As root, a fresh bench hosts run's records read back (skips, saying why, elsewhere)."""

from __future__ import annotations

import json
import math
import statistics
import types
from pathlib import Path

import pytest

from kvbridge.cli import main
from kvbridge.errors import ConfigError
from kvbridge.simulate import hostbench
from kvbridge.simulate import inputs as sim_inputs
from kvbridge.simulate.model import HandOff, Layout

REAL = Path(__file__).parent / "data" / "bench_hosts.json"  # kvbridge bench hosts --tokens 8,32,128 --reps 2 --rounds 1
REAL_ROWS = ("kvbridge", "kvbridge-ucp", "tcp:1", "tcp:4", "ucp-get", "nixl", "mooncake")
KV_TOKEN = 128 << 10  # Llama-3-8B KV bytes per token, as the bench moves it
TOKENS = (64, 256, 1024)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _rec(cap: str, tokens: int, row: str, samples: list[float], note: str = "") -> dict:
    """A record as kvbridge.bench.hosts._summary writes it (one round of ``samples``)."""
    nbytes = tokens * KV_TOKEN
    rec: dict = {"cap": cap, "tokens": tokens, "bytes": nbytes, "row": row, "note": note}
    if samples:
        gbps = nbytes / statistics.median(samples) / 1e9
        rec.update(gbps=gbps, low=gbps, high=gbps, samples=list(samples), rounds=1, round_gbps=[gbps])
    return rec


def _line(cap: str, row: str, fixed_ms: float, gbps: float) -> list[dict]:
    """``row`` at ``cap`` taking exactly ``fixed_ms + bytes / gbps`` at every size (three samples each)."""
    return [_rec(cap, t, row, [fixed_ms / 1e3 + t * KV_TOKEN / (gbps * 1e9)] * 3) for t in TOKENS]


def _write(tmp_path: Path, records: list[dict], name: str = "hosts.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"ucx_env": "", "records": records}))
    return str(path)


def _hosts(path: str) -> hostbench.HostsBench:
    hosts = sim_inputs.bench_file(path).hosts
    assert hosts is not None
    return hosts


def test_records_here_are_the_bench_hosts_format() -> None:
    bench_hosts = pytest.importorskip("kvbridge.bench.hosts")
    point = types.SimpleNamespace(tokens=256, nbytes=256 * KV_TOKEN)
    assert bench_hosts._summary("10gbit", point, "tcp:4", [[0.03, 0.02, 0.025]], "") == _rec(
        "10gbit", 256, "tcp:4", [0.03, 0.02, 0.025]
    )
    assert bench_hosts._summary("none", point, "nixl", [], "not measured: x") == _rec(
        "none", 256, "nixl", [], "not measured: x"
    )


def test_a_real_bench_hosts_file_is_fitted_per_row_and_cap() -> None:
    hosts = _hosts(str(REAL))
    assert hosts.rows == REAL_ROWS and hosts.caps == ("none", "25gbit", "10gbit")
    assert set(hosts.fits) == {(r, c) for r in REAL_ROWS for c in hosts.caps}
    doc = json.loads(REAL.read_text())
    for (row, cap), fit in hosts.fits.items():
        recs = [r for r in doc["records"] if r["row"] == row and r["cap"] == cap]
        assert fit.sizes == len(recs) == 3 and fit.fixed_ms >= 0 and 0 < fit.gbps < math.inf
        assert fit.best_gbps == pytest.approx(max(r["gbps"] for r in recs))  # median of all samples, per size
        # the fit is the least-squares line through the medians: its residuals are no worse than a line through
        # the two largest sizes (any other line with coefficients >= 0)
        pts = sorted((r["bytes"], statistics.median(r["samples"])) for r in recs)

        (b1, s1), (b2, s2) = pts[-2:]
        slope = (s2 - s1) / (b2 - b1)
        if slope > 0 and s1 - slope * b1 >= 0:
            assert _sse(pts, fit.fixed_ms / 1e3, 1 / (fit.gbps * 1e9)) <= _sse(pts, s1 - slope * b1, slope) * (1 + 1e-9)


def _sse(pts: list[tuple[int, float]], fixed_s: float, per_byte: float) -> float:
    return sum((fixed_s + b * per_byte - s) ** 2 for b, s in pts)


def test_the_fit_recovers_fixed_cost_and_rate(tmp_path: Path) -> None:
    hosts = _hosts(_write(tmp_path, _line("none", "kvbridge", 1.5, 4.0) + _line("10gbit", "kvbridge", 3.0, 1.1)))
    fit = hosts.fits[("kvbridge", "none")]
    assert fit.fixed_ms == pytest.approx(1.5, rel=1e-6) and fit.gbps == pytest.approx(4.0, rel=1e-6)
    largest = 1024 * KV_TOKEN
    assert fit.best_gbps == pytest.approx(largest / (1.5e-3 + largest / 4e9) / 1e9)
    assert hosts.fits[("kvbridge", "10gbit")].fixed_ms == pytest.approx(3.0, rel=1e-6)


def test_measured_links_and_derived_ones(tmp_path: Path) -> None:
    hosts = _hosts(_write(tmp_path, _line("none", "kvbridge", 1.5, 4.0) + _line("10gbit", "kvbridge", 3.0, 1.1)))
    ceiling = hosts.fits[("kvbridge", "none")].best_gbps  # what the row reached uncapped, its largest size
    h10 = hosts.handoff("kvbridge", "10gbit")
    assert (h10.basis, h10.fixed_ms, h10.name) == ("measured", pytest.approx(3.0), "kvbridge 10gbit")
    assert h10.gbps == pytest.approx(1.1) and "capped at 10gbit" in h10.source
    assert hosts.handoff("kvbridge", "10000mbit").gbps == pytest.approx(1.1)  # the same rate, another spelling
    h0 = hosts.handoff("kvbridge", "none")
    assert h0.basis == "measured" and h0.gbps == pytest.approx(4.0) and "uncapped" in h0.source
    h25 = hosts.handoff("kvbridge", "25gbit")  # 3.125 GB/s of link, below the ceiling: the link limits
    assert ceiling > 25 / 8
    assert (h25.basis, h25.fixed_ms, h25.gbps) == ("derived", pytest.approx(1.5), pytest.approx(25 / 8))
    assert "link's 3.12 GB/s" in h25.source
    h100 = hosts.handoff("kvbridge", "100gbit")  # 12.5 GB/s of link, above the ceiling: the ceiling limits
    assert (h100.basis, h100.fixed_ms, h100.gbps) == ("derived", pytest.approx(1.5), pytest.approx(ceiling))
    assert "ceiling, not a 100gbit NIC's" in h100.source and "derived" in h100.source
    got, skipped = hosts.handoffs(None, ["10gbit", "100gbit"])
    assert [h.name for h in got] == ["free", "kvbridge 10gbit", "kvbridge 100gbit"] and skipped == []
    assert got[0].basis == "bound" and got[0].fixed_ms == 0 and math.isinf(got[0].gbps)


def test_an_uncapped_run_slower_than_a_capped_one_is_flagged(tmp_path: Path) -> None:
    hosts = _hosts(_write(tmp_path, _line("none", "kvbridge", 1.0, 0.7) + _line("10gbit", "kvbridge", 1.0, 1.1)))
    got, notes = hosts.handoffs(["kvbridge"], ["10gbit", "100gbit"])
    assert got[2].basis == "derived" and got[2].gbps < got[1].gbps  # the derived link rests on the slower run
    assert len(notes) == 1 and "1.09 GB/s capped at 10gbit but only 0.70 uncapped" in notes[0] and "noisy" in notes[0]
    assert hosts.handoffs(["kvbridge"], ["10gbit", "none"])[1] == []  # nothing derived, nothing to flag


def test_rows_left_out_by_default_and_refused_by_name(tmp_path: Path) -> None:
    records = _line("none", "kvbridge", 1.0, 4.0) + _line("10gbit", "kvbridge", 1.0, 1.1)
    records += [_rec(c, t, "nixl", [], "not measured: nixl: not installed") for c in ("none", "10gbit") for t in TOKENS]
    records += _line("10gbit", "tcp:4", 1.0, 1.1)  # no uncapped run: cannot derive 100gbit
    hosts = _hosts(_write(tmp_path, records))
    got, skipped = hosts.handoffs(None, ["10gbit", "100gbit"])
    assert [h.name for h in got] == ["free", "kvbridge 10gbit", "kvbridge 100gbit"]
    assert len(skipped) == 2 and "nixl: not installed" in skipped[0] and "nothing to derive" in skipped[1]
    with pytest.raises(ConfigError, match="nixl at 10gbit: not measured: nixl: not installed"):
        hosts.handoffs(["nixl"], ["10gbit"])
    assert [h.name for h in hosts.handoffs(["tcp:4"], ["10gbit"])[0]] == ["free", "tcp:4 10gbit"]
    with pytest.raises(ConfigError, match="tcp:4 at 100gbit: .*nothing to derive"):
        hosts.handoffs(["tcp:4"], ["100gbit"])
    with pytest.raises(ConfigError, match="it has rows kvbridge, nixl, tcp:4; measured: kvbridge, tcp:4"):
        hosts.handoffs(["kvbridge", "carrier-pigeon"], ["10gbit"])


def _summary(slo: float, lo: float, hi: float) -> dict:
    return {"slo_attainment": slo, "ci95": {"slo_attainment": [lo, hi]}, "ttft_mean_ms": 500.0,
            "itl_p999_ms": 9.0, "handoff_mean_ms": 10.0}  # fmt: skip


def test_the_verdict_needs_intervals_apart_or_more_goodput() -> None:
    def lay(name: str, gbps: float) -> Layout:
        return Layout(name, "disaggregated", pools=(1, 1), handoff=HandOff(f"{name} 10gbit", 1.0, gbps, "", "measured"))

    lays = [Layout("colocated", "colocated"), Layout("chunked", "chunked", chunk=2048),
            lay("up", 9), lay("down", 0.1), lay("close", 2)]  # fmt: skip
    results = {"colocated": _summary(0.70, 0.65, 0.75), "chunked": _summary(0.80, 0.76, 0.84),
               "up": _summary(0.95, 0.90, 0.99), "down": _summary(0.30, 0.20, 0.40), "close": _summary(0.83, 0.80, 0.86)}  # fmt: skip
    got = {r["row"]: r for r in hostbench.answer(lays, results)}
    assert {k: r["pays"] for k, r in got.items()} == {"up": "yes", "down": "no", "close": "unclear"}
    assert {r["against"] for r in got.values()} == {"chunked"} and got["up"]["link"] == "10gbit"
    goodput = {"colocated": 3.0, "chunked": 2.5, "up": 3.5, "down": 1.0, "close": 3.0}
    swept = {r["row"]: r["pays"] for r in hostbench.answer(lays, results, goodput)}
    assert swept == {"up": "yes", "down": "no", "close": "unclear"}
    text = hostbench.answer_table(hostbench.answer(lays, results, goodput), 2.0)
    assert "against colocated" in text and "3.5/s" in text and text.count("measured") >= 3


def test_cli_answers_per_link_on_a_real_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "out.json"
    argv = ["--from-bench", str(REAL), "--bench-backend", "kvbridge,nixl", "--seeds", "2", "--requests", "30",
            "--json", str(out_json)]  # fmt: skip
    rc, out, _ = cli(argv, capsys)
    assert rc == 0 and "Does P/D pay?" in out
    assert "hand-off kvbridge 100gbit: derived:" in out and "ceiling, not a 100gbit NIC's" in out
    assert "hand-off nixl 10gbit: measured:" in out
    doc = json.loads(out_json.read_text())
    basis = {(r["row"], r["link"]): r["basis"] for r in doc["pd_pays"]}
    assert basis == {("free hand-off", "any"): "bound",
                     **{(row, link): "measured" for row in ("kvbridge", "nixl") for link in ("10gbit", "25gbit")},
                     ("kvbridge", "100gbit"): "derived", ("nixl", "100gbit"): "derived"}  # fmt: skip
    assert doc["layouts"]["disaggregated kvbridge 100gbit"]["handoff"]["basis"] == "derived"
    assert all(r["pays"] in ("yes", "no", "unclear") for r in doc["pd_pays"])


def test_a_fast_link_pays_and_a_slow_one_does_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _line("none", "fast", 0.5, 50.0) + _line("none", "slow", 5.0, 0.02))
    argv = ["--from-bench", path, "--links", "none", "--seeds", "6", "--requests", "60", "--slo-tpot-ms", "10",
            "--chunk-tokens", "0", "--json", "-"]  # fmt: skip
    rc, out, err = cli(argv, capsys)
    assert rc == 0 and "Does P/D pay?" in err  # the table on stderr when the JSON is stdout's
    pays = {r["row"]: r["pays"] for r in json.loads(out)["pd_pays"]}
    assert pays == {"free hand-off": "yes", "fast": "yes", "slow": "no"}


def _bad_files(d: Path) -> Path:
    good = _line("none", "kvbridge", 1.0, 4.0) + _line("10gbit", "kvbridge", 1.0, 1.1)
    _write(d, good)
    _write(d, _line("10gbit", "kvbridge", 1.0, 1.1), "capped.json")
    _write(d, [_rec("none", t, "nixl", [], "not measured: nixl: not installed") for t in TOKENS], "nothing.json")
    _write(d, [], "empty.json")
    _write(d, [{"cap": "none", "row": "kvbridge"}], "partial.json")
    _write(d, [{**good[0], "cap": "fast"}], "badcap.json")
    _write(d, [{**good[0], "samples": [-1.0]}], "badsamples.json")
    (d / "single.json").write_text(json.dumps([{"backend": "cpu", "op": "load", "bytes": 100, "median_s": 0.1}]))
    return d


BAD = [
    (["--from-bench", "{d}/hosts.json", "--bench-backend", "carrier-pigeon"], "it has rows kvbridge"),
    (["--from-bench", "{d}/hosts.json", "--links", "10gbe"], "--links"),
    (["--from-bench", "{d}/hosts.json", "--links", "pods"], "has no pods run"),
    (["--from-bench", "{d}/capped.json"], "nothing to derive"),
    (["--from-bench", "{d}/nothing.json"], "nixl: not installed"),
    (["--from-bench", "{d}/empty.json"], "not a kvbridge bench hosts"),
    (["--from-bench", "{d}/partial.json"], "record 0"),
    (["--from-bench", "{d}/badcap.json"], "cap 'fast'"),
    (["--from-bench", "{d}/badsamples.json"], "samples"),
    (["--links", "10gbit"], "needs --from-bench with a kvbridge bench hosts"),
    (["--from-bench", "{d}/single.json", "--links", "10gbit"], "needs --from-bench with a kvbridge bench hosts"),
]


@pytest.mark.parametrize("argv,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys) -> None:
    d = _bad_files(tmp_path)
    rc, out, err = cli([a.format(d=d) for a in argv], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbridge simulate: error:"), err
    assert says in lines[0] and "Traceback" not in err


def test_what_bench_hosts_writes_is_what_simulate_reads(tmp_path: Path) -> None:
    pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")
    from kvbridge.bench import hosts as bench_hosts
    from kvbridge.testing.hosts import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    records = bench_hosts.run([32, 8], ["none"], ["kvbridge", "tcp:1"], reps=1, rounds=1, shape="tiny")
    hosts = _hosts(_write(tmp_path, records))  # as kvbridge bench hosts --json writes them
    assert hosts.rows == ("kvbridge", "tcp:1") and hosts.caps == ("none",)
    for row in hosts.rows:
        fit = hosts.fits[(row, "none")]
        assert fit.sizes == 2 and fit.best_gbps == pytest.approx(max(r["gbps"] for r in records if r["row"] == row))
    assert hosts.handoff("kvbridge", "none").basis == "measured"
    assert hosts.handoff("kvbridge", "100gbit").basis == "derived"
