"""kvbridge.bench.child: the one JSON-lines child wrapper of the hosts and peers benches, with real child
processes: each speech reads and writes what its children speak, and silence is a deadline, killed or not
as the caller asked."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from kvbridge.bench.baselines import Unavailable
from kvbridge.bench.child import HOST_SPEECH, PEER_SPEECH, Hung, JsonChild, Speech

# echoes each stdin line back (as ``@@`` + the line) until it reads "quit" or {"op": "quit"}; says it left on stderr
ECHO = r"""
import json, sys
print("noise UCX may print", flush=True)
print('{"bare": 1}', flush=True)
print("@@" + json.dumps({"ready": 1}), flush=True)
for line in sys.stdin:
    if line.strip() in ("quit", json.dumps({"op": "quit"})):
        print("left on quit", file=sys.stderr, flush=True)
        break
    print("@@" + json.dumps({"echo": line.rstrip("\n")}), flush=True)
"""
SLEEPER = "import sys, time; print('napping', file=sys.stderr, flush=True); time.sleep(600)"


def _child(code: str, speech: Speech, **kw: Any) -> JsonChild:
    return JsonChild([sys.executable, "-c", code], env=dict(os.environ), speech=speech, **kw)


def test_host_speech_reads_bare_json_and_says_bare_json() -> None:
    child = _child(ECHO, HOST_SPEECH, timeout_s=30)
    assert child.line("echo") == {"bare": 1}  # a bare JSON line is a message; the noise line is not
    assert child.line("echo") == {"ready": 1}
    child.say({"op": "offer"})
    assert child.line("echo") == {"echo": '{"op": "offer"}'}
    child.close()
    assert child.proc.returncode == 0  # left on its quit message, not killed


def test_peer_speech_skips_bare_json_and_prefixes_what_it_says() -> None:
    child = _child(ECHO, PEER_SPEECH, timeout_s=30)
    assert child.line("echo") == {"ready": 1}
    child.say({"spec": 2})
    assert child.line("echo") == {"echo": '@@{"spec": 2}'}
    child.close()
    assert child.proc.returncode == 0


def test_a_silent_child_killed_or_reported_as_the_caller_asked() -> None:
    killed = _child(SLEEPER, HOST_SPEECH, timeout_s=1.0, kill_silent=True)
    t0 = time.monotonic()
    with pytest.raises(Hung, match="sleeper: no answer within 1s, killed; stderr: napping"):
        killed.line("sleeper")
    assert time.monotonic() - t0 < 10 and killed.proc.poll() is not None
    killed.close()

    left = _child(SLEEPER, PEER_SPEECH)  # the peers bench: its own deadline per wait; close() ends the child
    with pytest.raises(Unavailable, match="no answer within 0.5s; stderr: napping") as err:
        left.line("sleeper", 0.5)
    assert not isinstance(err.value, Hung) and left.proc.poll() is None
    left.proc.kill()  # a sleeper never reads its quit: spare the test close()'s 20 s
    left.close()


def test_a_child_that_exits_or_errs_says_so() -> None:
    gone = _child("import sys; print('boom', file=sys.stderr); sys.exit(3)", HOST_SPEECH, timeout_s=30)
    with pytest.raises(Unavailable, match=r"gone exited \(rc 3\); stderr: boom"):
        gone.line("gone")
    gone.close()
    failed = _child("print('@@{\"error\": \"no NIXL\"}', flush=True)", PEER_SPEECH, timeout_s=30)
    with pytest.raises(Unavailable, match="failed: no NIXL"):
        failed.line("failed")
    failed.close()
