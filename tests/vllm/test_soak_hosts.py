"""The serving soak across emulated hosts (benches/vllm/soak_hosts.py), short: real vLLM api_servers, the
producer on host A, the consumer on host B, ``kvbridge proxy`` and vLLM's own serving benchmark client on host
C at concurrency 8. While the client sends, host A's link goes down for a few seconds, then host A crashes
(every process killed), boots and its producer restarts. No client request may fail, no checked answer may
differ from the consumer's own answer before the faults, and the consumer must load KV over kvbridge again
after the restarted producer is back, without being restarted itself. Needs root (skips, saying why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import soak_hosts

from kvbridge.testing.hosts import unavailable


def test_soak_across_hosts_survives_a_link_cut_and_a_producer_crash(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    args = soak_hosts.parser().parse_args(["--minutes", "0.5", "--concurrency", "8", "--quiet-s", "10",
                                           "--sample-s", "2", "--warmup-s", "10", "--check-prompts", "4",
                                           "--work", str(tmp_path)])  # fmt: skip
    args.plan = [{"after": 3.0, "kind": "link", "hold_s": 3.0}, {"after": 2.0, "kind": "crash", "hold_s": 0.0}]
    rep = soak_hosts.soak(args)

    assert [f["kind"] for f in rep["faults"]] == ["link", "crash"], rep["faults"]
    client, check, kv = rep["client"], rep["checker"], rep["kvbridge"]
    assert client["completed"] > 0 and client["failed"] == 0, client["rounds"]
    assert check["checks"] > 0 and check["failed_requests"] == 0, check["errors"]
    assert check["wrong_outputs"] == 0, check["mismatches"]
    assert check["loaded_checks"] > 0, check  # some compared answers were decoded from KV that crossed the link
    assert kv["proxy_decode_failures"] == 0, kv
    # the crash's hand-offs were refused or recomputed; once the new producer is up, loads come back
    assert kv["loaded_blocks_after_last_fault"] > 0, (kv, rep["faults"])
    assert rep["ok"]
