"""A bench child process that speaks JSON lines: the one wrapper the cross-host bench
(:mod:`kvbridge.bench.hosts`, and ``benches/tcp_lane_probe.py`` through it) and the peers bench
(:mod:`kvbridge.bench.peers`) start their children with.

The child's messages are its stdout lines that start with ``@@`` (UCX and the libraries a child loads may
print lines of their own there), read by a thread so that every wait has a deadline; its stderr goes to a
file whose tail each error quotes. A message with ``error`` is the child's own failure. Two kinds of child
differ only in how they are spoken to (:class:`Speech`): :data:`HOST_SPEECH` (``kvbridge.bench._host_child``,
``ucx_baselines``' producer, the C ``rawtcp`` children: a bare JSON line counts as a message too, messages
to the child are bare JSON, and it leaves on ``{"op": "quit"}``) and :data:`PEER_SPEECH`
(``kvbridge.bench._peer_child``: ``@@`` lines both ways, and a bare ``quit``).

Silence: :meth:`JsonChild.line` waits at most its timeout; a child made with ``kill_silent`` is then killed
at once and :class:`Hung` raised (the hosts bench's ``--child-timeout``: its row is reported failed), else
:class:`~kvbridge.bench.baselines.Unavailable` (the peers bench: :meth:`~JsonChild.close` then asks the
child to leave and kills it after 20 s).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.bench.baselines import Unavailable


class Hung(Unavailable):
    """A child said nothing within its deadline and was killed: its row failed (not "not installed")."""


@dataclasses.dataclass(frozen=True)
class Speech:
    """How one kind of child is spoken to."""

    bare: bool  # a stdout line that is JSON as it stands (starts with "{") is a message too
    to_child: str  # what precedes each message written to the child's stdin
    quit: str  # the line that asks a child still running to leave


HOST_SPEECH = Speech(bare=True, to_child="", quit=json.dumps({"op": "quit"}))
PEER_SPEECH = Speech(bare=False, to_child="@@", quit="quit")


class JsonChild:
    """``argv`` started by ``popen`` (``subprocess.Popen``, or an emulated host's ``Host.popen``) with pipes
    to its stdin and stdout; its messages on a queue, its stderr in a file."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], speech: Speech, timeout_s: float | None = None,
                 kill_silent: bool = False, popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen):  # fmt: skip
        self.speech, self.timeout_s, self.kill_silent = speech, timeout_s, kill_silent
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"bench-child-{self.proc.pid}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if line.startswith("@@"):
                    self._lines.put(line[2:])
                elif self.speech.bare and line.startswith("{"):
                    self._lines.put(line)
        except (OSError, ValueError):  # the pipe closed under us (close() after a hang)
            pass
        self._lines.put(None)

    def stderr(self) -> str:
        """The tail of the child's stderr, for an error message: its last lines, at most 400 characters."""
        self.err.seek(0)
        tail = [ln for ln in self.err.read().strip().splitlines() if ln.strip()][-3:]
        return ("; stderr: " + " | ".join(tail)[-400:]) if tail else ""

    def line(self, what: str, timeout: float | None = None) -> dict[str, Any]:
        """The child's next message (``timeout``: this wait's, else the child's ``timeout_s``). Silent that
        long: :class:`Hung` with the child killed (``kill_silent``), else ``Unavailable``; the child gone or
        its message an ``error``: ``Unavailable``."""
        timeout = self.timeout_s if timeout is None else timeout
        try:
            got = self._lines.get(timeout=timeout)
        except queue.Empty:
            if not self.kill_silent:
                raise Unavailable(f"{what}: no answer within {timeout:g}s{self.stderr()}") from None
            self.proc.kill()
            self.proc.wait(10)
            raise Hung(f"{what}: no answer within {timeout:g}s, killed{self.stderr()}") from None
        if got is None:
            raise Unavailable(f"{what} exited (rc {self.proc.wait()}){self.stderr()}")
        msg = dict(json.loads(got))
        if "error" in msg:
            raise Unavailable(f"{what}: {msg['error']}")
        return msg

    def say(self, msg: dict[str, Any]) -> None:
        self._write(self.speech.to_child + json.dumps(msg))

    def _write(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Ask the child to leave; killed if it has not in 20 s (or cannot be asked)."""
        try:
            if self.proc.poll() is None:
                self._write(self.speech.quit)
            self.proc.wait(20)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        self.err.close()


__all__ = ["HOST_SPEECH", "PEER_SPEECH", "Hung", "JsonChild", "Speech"]
