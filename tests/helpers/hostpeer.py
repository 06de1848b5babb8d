"""A ``ucx`` peer engine (tests/helpers/ucx_fault_peer.py) running on an emulated host, driven by JSON lines.

Shared by the cross-host tests (test_hosts_ucx.py, test_hosts_faults.py): the producer runs on one
:class:`~kvbridge.testing.hosts.Host`, the consumer on another, and the test process (outside both) only
relays transfer params and compares what the two sides report.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbridge.testing.hosts import Host

HELPER = Path(__file__).with_name("ucx_fault_peer.py")
BLOCK_TOKENS = 16


class JsonLines:
    """The JSON lines a peer process writes to stdout, pumped by a thread; :meth:`read` returns the next one
    (skipping the lines UCX writes there itself) and fails, naming ``who``, when the peer is silent or gone
    (with the tail of ``log()``, its stderr). Shared with tests/test_faults_ucx.py's local peers."""

    def __init__(self, proc: subprocess.Popen[str], who: str, log: Callable[[], str]):
        self.proc, self.who, self._log = proc, who, log
        self._lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, name=f"peer-reader-{proc.pid}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.who} did not answer within {timeout}s") from None
            assert line, f"{self.who} exited ({self.proc.poll()}): {self._log()[-3000:]}"
            if line.startswith("{"):  # UCX may write its own lines to stdout, even into ours (it writes to
                # fd 1 from its own threads: between print's text and its newline), so the first object counts
                return dict(json.JSONDecoder().raw_decode(line)[0])


class HostPeer:
    """``ucx_fault_peer.py ROLE OUT ARGS`` on ``host``; :meth:`ask` sends a command and reads its answer."""

    def __init__(self, host: Host, role: str, out: Path, *args: str, env: dict[str, str] | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.host, self.out = host, out
        self._stderr = open(out / "stderr.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = host.popen([sys.executable, str(HELPER), role, str(out), *args], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        self._lines = JsonLines(self.proc, f"peer on {host.hostname}", self.log)
        self.ready = self._read(60)

    def _read(self, timeout: float) -> dict[str, Any]:
        return self._lines.read(timeout)

    def log(self) -> str:
        self._stderr.flush()
        return (self.out / "stderr.log").read_text()

    def ask(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def prefill(self, rid: str, tokens: int, seed: int) -> tuple[dict[str, Any], str]:
        """The producer prefills one request: its transfer params and the sha256 of its full blocks."""
        got = self.ask(op="prefill", reqs=[[rid, tokens, seed]])
        return got["params"][rid], got["sha"][rid]

    def wait_released(self, timeout: float) -> float:
        """Seconds until the producer holds nothing; fails past ``timeout``."""
        t0 = time.monotonic()
        while (held := self.ask(op="state")["held"]):
            assert time.monotonic() - t0 < timeout, f"producer still holds {held} after {timeout}s"
            time.sleep(0.1)
        return time.monotonic() - t0

    def close(self) -> int | None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit", timeout=20)
                self.proc.wait(20)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._lines.thread.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self._stderr.close()
        return self.proc.returncode


def full_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS


__all__ = ["BLOCK_TOKENS", "HELPER", "HostPeer", "JsonLines", "full_blocks"]
