"""kvbridge bench: the CLI end to end, records complete; its JSON read by kvbridge simulate (tests/test_simulate.py has the rest)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import statistics

import pytest

from kvbridge import registry
from kvbridge.bench.cases import opened
from kvbridge.bench.core import SHAPES, Point, Record
from kvbridge.bench.pairs import Pair, time_save_stall
from kvbridge.cli import main

FIELDS = {f.name for f in dataclasses.fields(Record)}
MOVES = ("save", "load", "transfer", "recompute")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Runs without --json save into the working directory: a test's own, never the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    names = [n for n in registry.available() if n != "ucx" and registry.check(n) is None]  # ucx: its own suite
    rc = main(["bench", "--quick", "--backends", ",".join([*names, "lmcache-native"]), "--tokens", "32", "--reps", "1",
               "--json", str(path)])  # fmt: skip
    assert rc == 0
    return json.loads(path.read_text())


def test_bench_cli_writes_complete_records(bench_json, capsys):
    assert bench_json
    for rec in bench_json:
        assert FIELDS <= set(rec), rec
        assert rec["baseline"], rec
        if rec["median_s"] is None:
            assert rec["note"].startswith("not measured"), rec
            continue
        assert rec["median_s"] > 0 and rec["baseline_s"] and rec["baseline_s"] > 0, rec
        assert rec["ratio"] == pytest.approx(rec["baseline_s"] / rec["median_s"]), rec
        if rec["op"] in MOVES:
            assert rec["gbps"] > 0 and rec["baseline_gbps"] > 0 and rec["bytes"] > 0, rec


def test_bench_measures_memory_and_reports_missing_peers(bench_json):
    ops = {r["op"] for r in bench_json if r["backend"] == "memory" and r["median_s"]}
    assert {"save", "load", "sched_step"} <= ops
    assert any(r["op"] == "recompute" and r["backend"] == "memory" for r in bench_json)
    external = [r for r in bench_json if r["backend"].startswith("lmcache-native")]  # NIXL, Mooncake: beside ucx (test_peers)
    assert {r["backend"] for r in external} == {"lmcache-native:cpu", "lmcache-native:disk"}
    if importlib.util.find_spec("lmcache") is None:
        assert all(r["note"].startswith("not measured") for r in external)
    else:  # LMCache's own engine, save and load on both tiers (tests/test_bench_lmcache_native.py has the rest)
        moved = [r for r in external if r["op"] != "recompute"]  # its loads are in the transfer vs recompute table too
        assert {r["op"] for r in moved} == {"save", "load"} and all(r["median_s"] for r in moved), moved


def _positive(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@pytest.mark.parametrize("name, medium", [("cpu", "memcpy"), ("fs", "file")])
def test_bench_reports_the_stall_saves_cause(bench_json, name, medium):
    """save_stall: the stall of a step that saves (the worker's start_step .. finish_step) beside the save's
    own time and the raw medium writing the same bytes. Structure and finite figures only: speed is
    measured by the bench, not asserted here."""
    recs = [r for r in bench_json if r["backend"] == name and r["op"] == "save_stall" and r["baseline"] == medium]
    assert len(recs) == 1, recs  # one record per baseline (cpu has memcpy:nt too)
    rec = recs[0]
    assert rec["note"] == "" and rec["gbps"] is None, rec
    for field in ("median_s", "p99_s", "save_s", "stall_frac", "baseline_s", "ratio"):
        assert _positive(rec[field]), (field, rec)
    assert rec["bytes"] > 0 and rec["reps"] == 1, rec
    assert rec["stall_frac"] == pytest.approx(rec["median_s"] / rec["save_s"]), rec  # one step: its own ratio
    assert rec["ratio"] == pytest.approx(rec["baseline_s"] / rec["median_s"]), rec


def test_save_stall_times_real_saves():
    """Each step of the case saves through the real worker; stall and save have one sample per step."""
    point = Point(SHAPES["8b"], 32)
    with opened("memory", point) as (target, _tmp):
        pair = Pair(target, point)
        try:
            before = pair.prod.worker.stats.saves
            timing = time_save_stall(pair, 2)
            assert pair.prod.worker.stats.saves - before == 3  # one warm-up step, two timed
            assert pair.prod.worker.wait_idle(0)  # the case leaves nothing in flight
        finally:
            pair.close()
    assert len(timing.stall.samples) == len(timing.save.samples) == len(timing.fractions) == 2
    assert all(_positive(v) for v in (*timing.stall.samples, *timing.save.samples, *timing.fractions))
    assert timing.frac == pytest.approx(statistics.median(timing.fractions))


def test_bench_ops_picks_the_cases(tmp_path, capsys):
    path = tmp_path / "stall.json"
    args = ["bench", "--backends", "memory", "--tokens", "32", "--reps", "1", "--no-recompute"]
    assert main([*args, "--ops", "save_stall", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert records and {r["op"] for r in records} == {"save_stall"}
    assert "forward-pass stall per step caused by saves" in capsys.readouterr().out
    capsys.readouterr()
    assert main([*args, "--ops", "stall"]) == 2
    assert "unknown op" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--backends", "nosuch"], "unknown backend(s) ['nosuch']"),
        (["--plot", "/nonexistent-folder/x.png"], "does not exist"),
        (["--json", "/nonexistent-folder/x.json"], "does not exist"),
        (["--tokens", "0"], "positive"),
        (["--tokens", "many"], "integers"),
        (["--reps", "-1"], "positive"),
        (["--shapes", "9b"], "unknown shape"),
        (["--device", "tpu"], "--device takes cpu or cuda[:N], got 'tpu'"),
        (["--device", "cuda:99"], "--device cuda:99: "),  # none here, or not that many
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2_before_measuring(argv, message, capsys):
    """Checked at start-up: nothing is measured first (a typo must not cost a whole run)."""
    try:
        rc = main(["bench", "--no-recompute", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    assert rc == 2
    out = capsys.readouterr()
    assert message in out.err and "Traceback" not in out.err and "GB/s" not in out.out


def test_results_are_saved_by_default_to_a_named_file(tmp_path, capsys):
    args = ["bench", "--backends", "memory", "--tokens", "32", "--reps", "1", "--no-recompute", "--ops", "load"]
    assert main(args) == 0
    saved = list(tmp_path.glob("kvbridge-bench-*.json"))
    assert len(saved) == 1, saved
    records = json.loads(saved[0].read_text())
    assert {r["backend"] for r in records} == {"memory"} and all(r["gbps"] > 0 for r in records)
    assert f"to {saved[0].name} (kvbridge simulate --from-bench" in capsys.readouterr().out
    saved[0].unlink()
    assert main([*args, "--no-save"]) == 0
    assert not list(tmp_path.glob("kvbridge-bench-*.json"))


def test_quick_keeps_a_backends_quick_baselines_and_one_point_for_a_peer():
    from kvbridge.bench.cases import BENCH
    from kvbridge.bench.measurer import Measurer

    ucx = BENCH["ucx"]
    assert ucx.quick and set(ucx.quick) < set(ucx.baselines) and ucx.chosen(True) == ucx.quick
    assert ucx.chosen(False) == ucx.baselines and BENCH["fs"].chosen(True) == BENCH["fs"].baselines
    records = Measurer(1, ops=("load",), quick=True).measure("memory", [Point(SHAPES["tiny"], 32), Point(SHAPES["tiny"], 64)])
    assert sorted(r.tokens for r in records) == [32, 64]  # a store keeps every point


def test_simulate_reads_bench_json(bench_json, tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench_json))
    assert main(["simulate", "--from-bench", str(path), "--requests", "40"]) == 0
    assert str(path) in capsys.readouterr().out  # the hand-off figure came from the file




def test_third_party_output_goes_to_a_log_not_across_the_table(tmp_path, capfd, monkeypatch):
    """What the measured systems print (LMCache's logger to stderr, UCX's C-level messages to stdout or
    stderr) lands in --log; the run ends with one line saying how much and where."""
    import logging
    import os

    from kvbridge.bench import measurer

    real = measurer.Measurer.measure

    def noisy(self, name, points):
        os.write(2, b"[1796172570.22] UCX  ERROR req 0x7f: error during flush: Connection reset by remote peer\n")
        os.write(1, b"[1796587520.05] UCX  WARN  unused environment variables: UCX_MEMTYPE_CACHE\n")  # UCX's default stream
        logging.getLogger("lmcache.fake").warning("Failed to allocate memory block")
        return real(self, name, points)

    monkeypatch.setattr(measurer.Measurer, "measure", noisy)
    fd2 = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - stderr itself, as a process sees it (pytest swaps sys.stderr)
    handler = logging.StreamHandler(fd2)  # LMCache's own handlers write to stderr
    logging.getLogger("lmcache.fake").addHandler(handler)
    log = tmp_path / "bench.log"
    try:
        assert main(["bench", "--backends", "memory", "--tokens", "32", "--reps", "1", "--no-recompute",
                     "--ops", "load", "--log", str(log)]) == 0
    finally:
        logging.getLogger("lmcache.fake").removeHandler(handler)
    out = capfd.readouterr()
    assert "UCX  ERROR" not in out.err and "Failed to allocate" not in out.err and "UCX  WARN" not in out.out
    text = log.read_text()
    assert "UCX  ERROR" in text and "UCX  WARN" in text and "Failed to allocate memory block" in text
    assert f"lines of the measured systems' own output (warnings, UCX errors) are in {log}" in out.err
    assert "GB/s" in out.out


def test_report_names_every_baseline_marks_doubtful_ratios_and_sums_up():
    from kvbridge.bench.core import Record
    from kvbridge.bench.report import legend, summary, table

    def rec(backend, op, gbps, base_gbps, baseline):
        nbytes = 8 << 20
        return Record(backend=backend, op=op, shape="8b", tokens=64, bytes=nbytes, blocks=64, median_s=nbytes / gbps / 1e9,
                      p99_s=nbytes / gbps / 1e9, gbps=gbps, baseline=baseline, baseline_s=nbytes / base_gbps / 1e9,
                      baseline_gbps=base_gbps, ratio=gbps / base_gbps, reps=3)

    records = [rec("cpu", "load", 5.0, 2.0, "memcpy"), rec("fs", "load", 1.0, 2.0, "file")]
    text = table(records)
    assert "2.50?" in text and "0.50" in text and "ran slow in this run" in text
    assert "memcpy  one torch copy" in legend(records) and "file    one sequential write" in legend(records)
    assert "load         8 MiB: fastest cpu at 5.00 GB/s, 2.50x its strictest baseline" in summary(records)
    assert "round by round" not in legend(records), "no record was timed with its baseline"
    records[1] = dataclasses.replace(records[1], interleaved=True)
    assert "timed round by round with ours (one run of each in turn, so a slow minute slows both): file;" in legend(records)


def test_a_gpu_point_takes_the_pcie_baseline_and_says_where_it_ran():
    """``--device cuda`` (checked without a GPU): host-memory baselines become ``pcie``, the others stay, each once;
    the point's label and the table's shape column name the device; a peer's transfer is refused with a reason."""
    from kvbridge.bench.cases import BENCH
    from kvbridge.bench.core import Timing, make_record
    from kvbridge.bench.measurer import Measurer
    from kvbridge.bench.report import legend, table

    assert BENCH["cpu"].chosen(False, "cuda") == ("pcie",)
    assert BENCH["cpu"].chosen(False) == ("memcpy", "memcpy:nt")
    assert BENCH["fs"].chosen(False, "cuda:1") == ("file",)
    point = Point(SHAPES["8b"], 64, device="cuda")
    assert point.label().endswith(" on cuda") and not Point(SHAPES["8b"], 64).label().endswith("cuda")
    record = make_record("cpu", "load", point, Timing((0.001,)), "pcie", Timing((0.0002,)))
    assert record.device == "cuda" and record.ratio == pytest.approx(0.2)
    assert "8b@cuda" in table([record]) and "pcie  a KV cache on a GPU" in legend([record])
    rows = Measurer(1, ops=["transfer"])._point("ucx", BENCH["ucx"], point)
    assert rows and all(r.median_s is None and "from host memory" in r.note for r in rows)


def test_llc_bytes_reads_the_largest_cache_sysfs_reports(tmp_path):
    from kvbridge.bench import cold

    for i, size in enumerate(["32K", "1024K", "32768K", "junk"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert cold.llc_bytes(tmp_path) == 32 << 20
    assert cold.llc_bytes(tmp_path / "absent") == 32 << 20  # nothing reported: the fallback


def test_every_timed_transfer_starts_with_the_caches_evicted_and_the_scheduler_warm(monkeypatch):
    """time_reps evicts before each timed call (warm-up included), and only there: never inside the timed
    call, never when ``cold`` is false; a store's save and load cases are cold, the scheduler's cases warm."""
    from kvbridge.bench import cases, core

    events: list[str] = []
    monkeypatch.setattr(core, "evict", lambda: events.append("evict"))
    core.time_reps(lambda s: events.append(f"run{s}"), 2, setup=lambda i: events.append(f"setup{i}") or i)
    assert events == ["setup0", "evict", "run0", "setup1", "evict", "run1", "setup2", "evict", "run2"]
    events.clear()
    core.time_reps(lambda s: events.append("run"), 2, cold=False)
    assert events == ["run"] * 3
    point = Point(SHAPES["tiny"], 64)
    assert not cases.sched_floor_case(point).cold
    events.clear()
    timed = cases.Case(lambda i: events.append(f"setup{i}"), lambda s: events.append("run"), lambda s: None)
    timed.time(1)
    assert events == ["setup0", "evict", "run", "setup1", "evict", "run"], "Case.time: one eviction per run"
    events.clear()
    cases.sched_floor_case(point).time(1)
    assert "evict" not in events
    with opened("memory", point) as (target, _tmp):
        pair = Pair(target, point)
        try:
            assert cases.save_case(pair).cold and cases.load_case(pair, peer=False).cold
            assert not cases.load_case(pair, peer=False, timed="plan").cold
        finally:
            pair.close()


def test_warm_turns_eviction_off_here_and_in_children(monkeypatch):
    """``--warm`` (the env var children inherit) makes evict() do nothing; without it the scratch buffer is
    read and rewritten (its bytes change), and it is at least twice the largest cache."""
    from kvbridge.bench import cold

    monkeypatch.delenv(cold.WARM_ENV, raising=False)
    cold.evict()
    assert cold._scratch is not None and cold._scratch.nbytes >= min(2 * cold.llc_bytes(), 1 << 30)
    before = int(cold._scratch[0])
    cold.evict()
    assert int(cold._scratch[0]) == (before + 1) % 256
    monkeypatch.setenv(cold.WARM_ENV, "1")
    cold.evict()
    assert int(cold._scratch[0]) == (before + 1) % 256, "warm: nothing evicted"


def test_bench_warm_option_reaches_the_eviction(monkeypatch, capsys, tmp_path):
    """``--warm`` reaches the eviction, and each record says how it was timed: a load cold unless
    ``--warm``, the scheduler's step always warm."""
    from kvbridge.bench import cold

    monkeypatch.setenv(cold.WARM_ENV, "")  # restored after the test: --warm sets it for the whole process
    out = tmp_path / "b.json"
    argv = ["bench", "--backends", "memory", "--shapes", "8b", "--tokens", "64", "--ops", "load,sched_step",
            "--reps", "1", "--no-recompute", "--json", str(out)]  # fmt: skip

    def timed_cold() -> dict[str, bool]:
        return {r["op"]: r["cold"] for r in json.loads(out.read_text())}

    assert main(argv) == 0 and not os.environ[cold.WARM_ENV]
    assert timed_cold() == {"load": True, "sched_step": False}
    assert main([*argv, "--warm"]) == 0 and os.environ[cold.WARM_ENV] == "1"
    assert timed_cold() == {"load": False, "sched_step": False}
    assert "memory" in capsys.readouterr().out


def test_plot_gives_every_backend_its_own_colour(tmp_path, monkeypatch):
    """The plot of twelve backends: a PNG, and no two backends' load lines share a colour (the default
    10-colour cycle gave ``fs load`` and ``memory load`` one), none in the baselines' grey."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvbridge.bench.core import Timing, make_record
    from kvbridge.bench.report import plot

    records = [
        make_record(f"b{i:02d}", op, Point(SHAPES["8b"], tokens), Timing((0.001 * (i + 1),)), "memcpy", Timing((0.001,)))
        for i in range(12)
        for op in ("load", "save")
        for tokens in (64, 256)
    ]
    drawn: dict[str, object] = {}
    real_close = plt.close

    def close(fig: object) -> None:  # what was drawn, read before the figure goes
        drawn.update({line.get_label(): line.get_color() for line in fig.axes[0].lines})  # type: ignore[attr-defined]
        real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    path = tmp_path / "bench.png"
    assert plot(records, str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loads = [drawn[f"b{i:02d} load"] for i in range(12)]
    assert len({str(c) for c in loads}) == 12, loads
    assert all(str(c) != str(drawn["b00 save"]) for c in loads)  # a backend's saves: its light shade, not its load's
    assert "0.45" not in {str(c) for c in loads}


def test_interleaved_cases_take_turns_each_round_and_one_failing_does_not_stop_the_others(monkeypatch):
    """time_interleaved runs one rep of every case per round, the order rotated each round, each run after
    its own setup and eviction; the warm-up round is not kept; a case that raises is dropped from the
    rounds after and returned as its exception, while the others keep every sample."""
    from kvbridge.bench import core

    events: list[str] = []
    monkeypatch.setattr(core, "evict", lambda: events.append("evict"))

    def case(name: str, fail_at: int | None = None) -> core.Case:
        def run(i: int) -> None:
            if i == fail_at:
                raise OSError(f"{name} broke at {i}")
            events.append(f"{name}{i}")

        return core.Case(lambda i: i, run)

    a, b, c = case("a"), case("b", fail_at=2), case("c")
    out = core.time_interleaved([a, b, c], 3)
    runs = [e for e in events if e != "evict"]
    assert runs[:6] == ["a0", "b0", "c0", "b1", "c1", "a1"], "rounds 0 and 1: everyone once, rotated"
    assert runs[6:] == ["c2", "a2", "a3", "c3"], "b failed in round 2: rounds 2 and 3 go on without it"
    assert events.count("evict") == len(runs) + 1, "every run (and the failed one) started cold"
    assert isinstance(out[0], core.Timing) and len(out[0].samples) == 3
    assert isinstance(out[2], core.Timing) and len(out[2].samples) == 3
    assert isinstance(out[1], OSError) and "broke at 2" in str(out[1])


def test_store_rows_time_their_in_process_baselines_round_by_round(tmp_path):
    """A store's save and load are timed round by round with the baselines that run in this process (memcpy,
    file): their records say so, and their figures are real timings of the medium; a baseline that cannot
    start is its row's note while ours is still measured; save_stall takes the save's interleaved figure."""
    from kvbridge.bench import baselines
    from kvbridge.bench.cases import BENCH, BackendBench
    from kvbridge.bench.measurer import Measurer

    point = Point(SHAPES["8b"], 32)
    measurer = Measurer(1, ops=("save", "load", "save_stall"))
    records = measurer.measure("fs", [point])
    rows = {(r.op, r.baseline): r for r in records}
    for op in ("save", "load"):
        r = rows[op, "file"]
        assert r.interleaved and r.measured and r.baseline_s and r.baseline_s > 0, r
    assert not rows["save_stall", "file"].interleaved
    assert rows["save_stall", "file"].baseline_s == rows["save", "file"].baseline_s, "the same save baseline"
    assert measurer._base == {}, "nothing measured apart: every baseline of fs runs in this process"

    def broken(nbytes, op, env):
        raise baselines.Unavailable("no such medium here")

    try:
        baselines.STEPPED["broken"] = broken
        BENCH["memory"], saved = BackendBench(("memcpy", "broken")), BENCH["memory"]
        got = {(r.op, r.baseline): r for r in Measurer(1, ops=("load",)).measure("memory", [point])}
    finally:
        del baselines.STEPPED["broken"]
        BENCH["memory"] = saved
    assert got["load", "memcpy"].interleaved and got["load", "memcpy"].measured
    assert got["load", "broken"].measured and got["load", "broken"].baseline_s is None, "ours measured anyway"
    assert "no such medium here" in got["load", "broken"].note and not got["load", "broken"].interleaved
