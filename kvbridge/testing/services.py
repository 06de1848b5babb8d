"""Real services for tests, and waiting on what they do in the background.

- :class:`RedisServer`: a private ``redis-server`` on a free loopback port, memory only, killed (and
  restarted) at will. Debian's ``redis-server`` package provides the binary (``.ci/run`` installs it);
  :data:`REDIS` is ``None`` where it is missing, and tests that need it skip.
- :func:`eventually`: the first truthy answer of a check, polled until a deadline.
- :func:`held_depth`: how many leading keys a block directory says one holder has.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REDIS = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on ``127.0.0.1:port``; :meth:`start` again after :meth:`kill` brings it back
    on the same port, empty (nothing is saved)."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.port, self.workdir = port or free_port(), workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if REDIS is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """``check()``'s first truthy answer, or its last answer once ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def held_depth(directory: Any, holder: str, keys: Sequence[bytes]) -> int:
    """The leading run of ``keys`` that ``directory`` (any :class:`~kvbridge.metadata.holdings.DirectoryClient`)
    says ``holder`` holds; 0 when it names none."""
    return next((e.num_blocks for e in directory.lookup(keys) if e.holder == holder), 0)


__all__ = ["REDIS", "RedisServer", "eventually", "free_port", "held_depth"]
