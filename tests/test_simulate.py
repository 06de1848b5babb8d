"""kvbridge simulate: the published toy table reproduced, the engine model's promises (an undersized decode pool,
chunked prefill between colocated and disaggregated, KV capacity, the hand-off), the fits from files, the JSON,
and a one-line error for every bad flag."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from kvbridge.cli import main
from kvbridge.simulate import inputs as sim_inputs
from kvbridge.simulate import toy as sim_toy
from kvbridge.simulate.cli import run_seeds
from kvbridge.simulate.model import EngineModel, HandOff, Layout, Workload, _Link, make_requests, simulate
from kvbridge.simulate.stats import FIGURES, Slo, goodput, median_ci, metrics

W = Workload(requests=160)
MODEL = EngineModel()
COLO = Layout("colocated", "colocated")
CHUNKED = Layout("chunked", "chunked", chunk=2048)
DISAGG = Layout("disaggregated", "disaggregated", pools=(1, 1), handoff=HandOff())


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def summary(lays, w=W, model=MODEL, seeds=range(3)):
    return run_seeds("default", lays, w, model, seeds, Slo())[0]


def _strict(text: str):
    def no_constant(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=no_constant)


def test_toy_go_reproduces_the_published_table(tmp_path, capsys):
    path = tmp_path / "out.json"
    t0 = time.perf_counter()
    rc, out, _ = cli(["--preset", "toy-go", "--seeds", "100", "--json", str(path)], capsys)
    elapsed = time.perf_counter() - t0
    assert rc == 0 and elapsed < 20
    doc = _strict(path.read_text())
    table = {"colocated": (88, 15, 426), "disaggregated": (30, 11, 1032)}  # the article's, ms
    for layout, ref in table.items():
        got = doc["layouts"][layout]
        for key, want in zip(("itl_p99_ms", "itl_mean_ms", "ttft_mean_ms"), ref):
            assert abs(got[key] / want - 1) <= 0.10, (layout, key, got[key], want)
            assert abs(doc["error_pct"][layout][key]) <= 10
    assert "the article" in out and doc["seeds"] == 100


def test_toy_go_semantics():
    reqs = make_requests(sim_toy.WORKLOAD, 3)
    assert reqs.long.sum() == 48 and np.allclose(np.diff(reqs.arrival), 0.426)
    r = sim_toy.simulate(Layout("d", "disaggregated"), reqs, 0)
    for t, a, p in zip(r.tokens, reqs.arrival, reqs.prompt):
        assert len(t) == 21 and t[0] >= a + p * 1e-4 - 1e-12  # first token at the end of the prefill
        assert np.all(np.diff(t) >= 5e-3 - 1e-12)  # every decode step is a 5 ms job
    colo = sim_toy.simulate(COLO, reqs, 0)
    assert colo.tokens[0][0] == pytest.approx(reqs.prompt[0] * 1e-4)  # the first request finds its server idle


def test_runs_are_deterministic_per_seed():
    a = metrics(simulate(DISAGG, make_requests(W, 0), EngineModel(), W.kv_bytes_per_token), Slo())
    b = metrics(simulate(DISAGG, make_requests(W, 0), EngineModel(), W.kv_bytes_per_token), Slo())
    c = metrics(simulate(DISAGG, make_requests(W, 1), EngineModel(), W.kv_bytes_per_token), Slo())
    assert a == b and a != c


@pytest.mark.parametrize(
    "layout,model",
    [
        (COLO, EngineModel()),
        (CHUNKED, EngineModel()),
        (DISAGG, EngineModel()),
        (Layout("2:3", "disaggregated", pools=(2, 3)), EngineModel()),
        (COLO, EngineModel(kv_tokens=30_000)),  # preempts
        (CHUNKED, EngineModel(kv_tokens=30_000, max_seqs=8)),
        (DISAGG, EngineModel(kv_tokens=30_000, kv_full="queue")),
    ],
)
def test_every_request_gets_its_tokens_in_order(layout, model):
    w = dataclasses.replace(W, requests=80, rate=4, output_tokens=(20, 60), long_tokens=(7000, 9000))
    reqs = make_requests(w, 0)
    r = simulate(layout, reqs, model, w.kv_bytes_per_token)
    for t, a, n, out in zip(r.tokens, reqs.arrival, reqs.prompt, reqs.output):
        assert len(t) == out
        assert np.all(np.diff(t) > 0)
        assert t[0] - a >= model.prefill_ms_per_ktok * n / 1e6 - 1e-9  # never faster than its own prefill


def test_kv_capacity_bounds_the_batch():
    w = dataclasses.replace(W, rate=4)
    free = summary([COLO], w, seeds=[0])["colocated"]
    preempt = summary([COLO], w, EngineModel(kv_tokens=40_000), seeds=[0])["colocated"]
    queue = summary([COLO], w, EngineModel(kv_tokens=40_000, kv_full="queue"), seeds=[0])["colocated"]
    assert free["preemptions"] == 0 and preempt["preemptions"] > 0 and queue["preemptions"] == 0
    assert preempt["ttft_mean_ms"] > free["ttft_mean_ms"] and queue["ttft_mean_ms"] > free["ttft_mean_ms"]


def test_an_undersized_decode_pool_shows_in_itl():
    w = dataclasses.replace(W, rate=6)
    pools = [Layout(f"{p}:{d}", "disaggregated", pools=(p, d), handoff=HandOff()) for p, d in ((2, 2), (3, 1))]
    s = summary(pools, w)
    balanced, short = s["2:2"], s["3:1"]
    for key in ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p99_ms"):
        assert short[key] > 1.1 * balanced[key], key
    assert short["ttft_mean_ms"] < balanced["ttft_mean_ms"]  # what the third prefill engine buys


def test_chunked_prefill_sits_between_colocated_and_disaggregated():
    small = dataclasses.replace(CHUNKED, name="chunked-512", chunk=512)
    s = summary([COLO, CHUNKED, small, DISAGG])
    colo, chunked, small_, disagg = s["colocated"], s["chunked"], s["chunked-512"], s["disaggregated"]
    # the worst stall a decode sees: a whole prefill colocated, one budget's step chunked, none disaggregated
    for key in ("itl_max_ms", "itl_p999_ms"):
        assert disagg[key] < small_[key] < chunked[key] < colo[key], key
    assert chunked["itl_max_ms"] == pytest.approx(EngineModel().step_s(0, 0, 2048) * 1e3, rel=0.1)
    # the price: prefills stretched over steps shared with decodes (more so with a smaller budget) ...
    assert colo["ttft_mean_ms"] <= chunked["ttft_mean_ms"] < small_["ttft_mean_ms"]
    # ... and half the engines prefilling when disaggregated at the same engine count
    assert chunked["ttft_mean_ms"] < disagg["ttft_mean_ms"]


def test_handoff_cost_and_link_sharing():
    ttft = [
        summary([dataclasses.replace(DISAGG, handoff=h)], seeds=[0])["disaggregated"]["ttft_mean_ms"]
        for h in (HandOff(fixed_ms=0, gbps=math.inf), HandOff(gbps=25), HandOff(gbps=5), HandOff(gbps=1))
    ]
    assert ttft == sorted(ttft) and ttft[-1] > ttft[0] + 100
    # two transfers at once share the link: each takes twice as long as alone
    done = sim_toy._over_link([0.0, 0.0], [10**9, 10**9], HandOff(fixed_ms=0, gbps=1))
    assert done == pytest.approx([2.0, 2.0])
    link = _Link(HandOff(gbps=1))
    assert link.add(0.0, "a", 1e9) == pytest.approx(1.0)  # type: ignore[arg-type]


def test_toy_with_a_measured_handoff_delays_decode(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps([_record("slow", "transfer", 1 << 20, 0.01), _record("slow", "transfer", 1 << 30, 2.0)])
    )
    rc, out, _ = cli(["--preset", "toy-go", "--seeds", "5", "--from-bench", str(bench)], capsys)
    assert rc == 0 and "disaggregated slow" in out


def _record(backend, op, nbytes, seconds, requests=1):
    return {"backend": backend, "op": op, "bytes": nbytes, "median_s": seconds, "requests": requests}


def test_from_bench_fits_fixed_plus_per_byte(tmp_path):
    sizes = [1 << 20, 1 << 24, 1 << 27]
    records = [_record("peer", "transfer", b, 0.002 + b / 10e9) for b in sizes]
    records += [_record("store", "load", b, b / 4e9) for b in sizes] + [_record("store", "save", 1 << 20, 9.0)]
    records += [_record("store", "load", 1 << 27, 99.0, requests=4), {**_record("x", "load", 1, None)}]
    path = tmp_path / "b.json"
    path.write_text(json.dumps(records))
    fits = sim_inputs.bench_file(str(path)).handoffs
    assert set(fits) == {"peer", "store"}
    assert fits["peer"].fixed_ms == pytest.approx(2.0, rel=1e-3) and fits["peer"].gbps == pytest.approx(10, rel=1e-3)
    assert fits["store"].fixed_ms == pytest.approx(0, abs=1e-6) and fits["store"].gbps == pytest.approx(4, rel=1e-3)


def test_calibrate_recovers_the_step_costs(tmp_path, capsys):
    truth = EngineModel(step_ms=4.0, seq_ms=0.1, ctx_ms_per_ktok=0.02, prefill_ms_per_ktok=60.0)
    rng = np.random.default_rng(0)
    steps = []
    for n, ctx, pf in [(1, 500, 0), (8, 8000, 0), (32, 64000, 0), (64, 40000, 0), (0, 0, 512), (0, 0, 4096),
                       (16, 20000, 1024), (128, 300000, 0)]:  # fmt: skip
        ms = truth.step_s(n, ctx, pf) * 1e3 * (1 + rng.normal(0, 0.005))
        steps.append({"decodes": n, "context_tokens": ctx, "prefill_tokens": pf, "ms": ms})
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"source": "synthetic", "kv_tokens": 200000, "steps": steps}))
    cal = sim_inputs.calibration_file(str(path))
    model = cal.apply(EngineModel())
    for key in ("step_ms", "seq_ms", "ctx_ms_per_ktok", "prefill_ms_per_ktok"):
        assert getattr(model, key) == pytest.approx(getattr(truth, key), rel=0.1), key
    assert model.kv_tokens == 200000 and cal.rms_pct < 2
    rc, out, _ = cli(["--calibrate", str(path), "--requests", "40", "--seeds", "1", "--chunk-tokens", "0"], capsys)
    assert rc == 0 and "synthetic" in out and "step 4" in out


def test_json_shape_and_sweep(tmp_path, capsys):
    path = tmp_path / "s.json"
    argv = ["--requests", "60", "--seeds", "2", "--sweep-rate", "1:3:1", "--json", str(path), "--transfer-gbps", "inf"]
    rc, out, _ = cli(argv, capsys)
    assert rc == 0 and "goodput" in out
    doc = _strict(path.read_text())
    assert doc["preset"] == "default" and doc["seeds"] == 2 and doc["workload"]["requests"] == 60
    assert set(doc["layouts"]) == {"colocated", "chunked", "disaggregated"}
    assert doc["layouts"]["disaggregated"]["handoff"]["gbps"] == "inf"
    for lay in doc["layouts"].values():
        assert set(FIGURES) <= set(lay) and lay["seeds"] == 2
        for key in FIGURES:
            lo, hi = lay["ci95"][key]
            assert lo <= lay[key] <= hi
    sweep = doc["sweep"]
    assert sweep["rates"] == [1, 2, 3] and set(sweep["goodput_rps"]) == set(doc["layouts"])
    for name, s in sweep["layouts"].items():
        assert len(s["slo_attainment"]) == 3 and sweep["goodput_rps"][name] in (0, 1, 2, 3)
    rc, out, err = cli(["--preset", "toy-go", "--seeds", "2", "--json", "-"], capsys)
    assert rc == 0 and _strict(out)["layouts"]["colocated"]["kind"] == "colocated" and "the article" in err


def test_plot_writes_an_image(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    rc, out, _ = cli(["--requests", "40", "--seeds", "1", "--sweep-rate", "1:2:1", "--plot", str(path)], capsys)
    assert rc == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_and_median_ci():
    slo = Slo()
    assert goodput([1, 2, 3, 4], [1.0, 0.95, 0.85, 0.95], slo) == 2  # the first miss ends it
    assert goodput([1, 2], [0.5, 1.0], slo) == 0
    med, lo, hi = median_ci(list(range(100)))
    assert med == 49.5 and 35 <= lo < med < hi <= 64
    assert median_ci([3.0]) == (3.0, 3.0, 3.0)


def test_requests_of_one_token_have_no_gaps():
    w = dataclasses.replace(W, requests=20, output_tokens=(1, 1))
    m = metrics(simulate(COLO, make_requests(w, 0), EngineModel(), w.kv_bytes_per_token), Slo())
    assert math.isnan(m["itl_mean_ms"]) and m["tpot_mean_ms"] == 0 and m["ttft_mean_ms"] > 0


def _bad_files(tmp_path):
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "dict.json").write_text('{"backend": "cpu"}')
    (tmp_path / "norecord.json").write_text('[{"foo": 1}]')
    (tmp_path / "nomeasure.json").write_text(json.dumps([_record("cpu", "load", 100, None)]))
    (tmp_path / "cal.json").write_text('{"steps": [{"decodes": 1}]}')
    return tmp_path


BAD = [
    (["--rate", "0"], "--rate"),
    (["--rate", "nan"], "--rate"),
    (["--rate", "fast"], "--rate"),
    (["--requests", "0"], "--requests"),
    (["--requests", "1.5"], "--requests"),
    (["--seeds", "0"], "--seeds"),
    (["--long-frac", "2"], "--long-frac"),
    (["--short-tokens", "900-300"], "--short-tokens"),
    (["--pools", "0:1"], "--pools"),
    (["--pools", "two"], "--pools"),
    (["--sweep-rate", "3:1:1"], "--sweep-rate"),
    (["--sweep-rate", "1:2"], "--sweep-rate"),
    (["--transfer-gbps", "-1"], "--transfer-gbps"),
    (["--preset", "toy"], "--preset"),
    (["--from-bench", "{d}/missing.json"], "no such file"),
    (["--from-bench", "{d}/notjson.json"], "not JSON"),
    (["--from-bench", "{d}/dict.json"], "not a kvbridge bench"),
    (["--from-bench", "{d}/norecord.json"], "record 0"),
    (["--from-bench", "{d}/nomeasure.json"], "no measured"),
    (["--from-bench", "{d}"], "folder"),
    (["--calibrate", "{d}/cal.json"], "step 0"),
    (["--plot", "{d}/no/such/dir/p.png"], "no such folder"),
    (["--plot", "{d}/p.txt"], ".png"),
    (["--json", "{d}/no/such/dir/o.json"], "no such folder"),
    (["--bench-backend", "cpu"], "needs --from-bench"),
    (["--kv-tokens", "1000"], "--kv-tokens"),
    (["--preset", "toy-go", "--kv-tokens", "1000"], "toy-go"),
]


@pytest.mark.parametrize("argv,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_flag_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    d = _bad_files(tmp_path)
    rc, out, err = cli([a.format(d=d) for a in argv], capsys)
    assert rc == 2
    assert out == ""  # found before anything ran
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbridge simulate: error:"), err
    assert says in lines[0] and "Traceback" not in err


def test_help_still_works(capsys):
    rc, out, _ = cli(["--help"], capsys)
    assert rc == 0 and "--sweep-rate" in out and "--preset" in out
