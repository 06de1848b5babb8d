"""``kvbridge bench hosts``: every row moves real bytes between two emulated hosts and checks them (a row
whose bytes differ raises, so its record says "not measured"); a child that hangs fails its row in time.
Needs root (skips, saying why)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.bench import hosts as bench_hosts  # noqa: E402
from kvbridge.testing.hosts import EmulatedHosts, unavailable  # noqa: E402


def test_rows_across_hosts_measure_checked_bytes() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    rows = ["kvbridge", "kvbridge-ucp", "tcp:1", "tcp:2", "ctcp:1", "ctcp:2", "ctcp-sndbuf:2", "ucp-get"]
    records = bench_hosts.run([32], ["none"], rows, reps=1, rounds=1, shape="tiny")
    assert [r["row"] for r in records] == rows
    for rec in records:
        assert rec["note"] == "" and rec["gbps"] > 0 and len(rec["samples"]) == 1, rec
        if rec["row"].startswith("kvbridge"):  # its one load split in three: the parts add up to its time
            parts = rec["parts_ms"]
            assert list(parts) == ["start", "read", "report"] and min(parts.values()) > 0, parts
            assert sum(parts.values()) == pytest.approx(rec["samples"][0] * 1e3), parts
        else:
            assert "parts_ms" not in rec
    assert "kvbridge" in bench_hosts.table(records)


def test_the_pipe_row_crosses_between_pods_and_not_between_hosts() -> None:
    """Between two pods of one network the raw pipe row and kvbridge (its tcp lane takes pipes there) move
    checked bytes; across hosts the pipe row says it cannot reach the other end, never a figure."""
    why = unavailable()
    if why:
        pytest.skip(why)
    rows = ["kvbridge", "pipe:2", "ctcp-sndbuf:2", "pipe:2/scat"]
    records = bench_hosts.run([32], [], rows, reps=1, rounds=1, shape="tiny", pods=True)
    for rec in records:
        assert rec["cap"] == "pods" and rec["note"] == "" and rec["gbps"] > 0, rec
    across = bench_hosts.run([32], ["none"], ["pipe:2"], reps=1, rounds=1, shape="tiny")
    assert "gbps" not in across[0] and "network namespace" in across[0]["note"], across


def test_cli_refuses_unknown_rows(capsys: pytest.CaptureFixture[str]) -> None:
    if unavailable():
        pytest.skip(str(unavailable()))
    with pytest.raises(SystemExit):
        bench_hosts.main(["--rows", "carrier-pigeon"])
    assert "carrier-pigeon" in capsys.readouterr().err


def test_a_silent_child_is_killed_and_its_row_fails_saying_why() -> None:
    """A child that hangs (here one that sleeps instead of answering) is killed at its deadline and its row
    reported failed with the reason and its stderr: the bench never waits on a child for good."""
    why = unavailable()
    if why:
        pytest.skip(why)
    with EmulatedHosts(2) as (a, _):
        child = bench_hosts._Proc(a, ["-c", "import sys, time; print('napping', file=sys.stderr, flush=True); "
                                            "time.sleep(600)"], timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(bench_hosts.Hung, match="sleeper: no answer within 1s, killed") as err:
            child.line("sleeper")
        assert time.monotonic() - t0 < 10 and child.proc.poll() is not None  # killed, not left behind
        assert "napping" in str(err.value)
        child.close()
    # through run(): a child given less time than any child needs to start is a row that failed
    records = bench_hosts.run([32], ["none"], ["tcp:1"], reps=1, rounds=2, shape="tiny", child_timeout_s=0.01)
    assert len(records) == 1 and "gbps" not in records[0], records
    assert records[0]["note"].startswith("failed: tcp sender: no answer within 0.01s, killed"), records


def test_the_table_pairs_each_round_with_the_raw_row_of_that_round() -> None:
    """The scattered-layout ratio's range divides each round's median by the best /scat row's median of the
    same round: a slow round slows both and their ratio keeps."""
    def rec(row: str, rounds: list[float]) -> dict[str, Any]:
        return {"cap": "none", "tokens": 256, "bytes": 32 << 20, "row": row, "note": "", "gbps": sorted(rounds)[1],
                "low": min(rounds), "high": max(rounds), "round_gbps": rounds}

    records = [rec("kvbridge", [4.0, 2.0, 5.0]), rec("ctcp-sndbuf:4", [6.0, 6.0, 6.0]),
               rec("ctcp-sndbuf:4/scat", [5.0, 2.5, 5.0]), {"cap": "none", "tokens": 256, "bytes": 32 << 20,
                                                             "row": "nixl", "note": "not measured: no nixl"}]
    lines = bench_hosts.table(records).splitlines()
    kvb = lines[1].split()
    assert kvb[4:] == ["4.00", "(2.00-5.00)", "0.67", "0.80", "(0.80-1.00)"], kvb  # 4/6, 4/5; 4/5, 2/2.5, 5/5
    assert lines[3].split()[-3:] == ["0.83", "1.00", "(1.00-1.00)"]  # 5/6, and itself
    assert lines[4].split()[4] == "-" and "no nixl" in lines[4]
