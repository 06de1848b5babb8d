"""``kvbridge bench hosts``: every row moves real bytes between two emulated hosts and checks them (a row
whose bytes differ raises, so its record says "not measured"); needs root (skips, saying why)."""

from __future__ import annotations

import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")

from kvbridge.bench import hosts as bench_hosts  # noqa: E402
from kvbridge.testing.hosts import unavailable  # noqa: E402


def test_rows_across_hosts_measure_checked_bytes() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    records = bench_hosts.run([32], ["none"], ["kvbridge", "kvbridge-ucp", "tcp:1", "tcp:2", "ctcp:1", "ctcp:2", "ucp-get"], reps=1, rounds=1, shape="tiny")
    assert [r["row"] for r in records] == ["kvbridge", "kvbridge-ucp", "tcp:1", "tcp:2", "ctcp:1", "ctcp:2", "ucp-get"]
    for rec in records:
        assert rec["note"] == "" and rec["gbps"] > 0 and len(rec["samples"]) == 1, rec
    assert "kvbridge" in bench_hosts.table(records)


def test_cli_refuses_unknown_rows(capsys: pytest.CaptureFixture[str]) -> None:
    if unavailable():
        pytest.skip(str(unavailable()))
    with pytest.raises(SystemExit):
        bench_hosts.main(["--rows", "carrier-pigeon"])
    assert "carrier-pigeon" in capsys.readouterr().err
