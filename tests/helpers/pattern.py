"""What the native tests share about tests/helpers/native_peer.py: the process, its pattern (word i of its
buffer is i * K, so every byte read is checked without a second copy), and the descriptors and faults the
tests build against it. Imported by tests/test_core.py (no UCX) and tests/test_native.py (ucp)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

PEER = Path(__file__).with_name("native_peer.py")
K = np.uint64(0x9E3779B97F4A7C15)
MiB = 1 << 20


def expected(first_word: np.ndarray, words: int) -> np.ndarray:
    """The peer's words [first_word[i], first_word[i] + words) for each i, as rows."""
    return (first_word.astype(np.uint64)[:, None] + np.arange(words, dtype=np.uint64)[None, :]) * K


class PatternPeer:
    """native_peer.py in its own process, started with ``args``; its first line (JSON) is ``info``."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.info = self._line(30.0)
        if "error" not in self.info and "pid" not in self.info:
            self.kill()
            raise RuntimeError("native_peer did not answer")
        self.pid: int = self.info.get("pid", 0)
        self.base: int = self.info.get("address", 0)

    def _line(self, timeout: float) -> dict[str, Any]:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not got or not got[0]:
            self.kill()
            raise RuntimeError("native_peer did not answer")
        return dict(json.loads(got[0])) if got[0].startswith("{") else {"line": got[0].strip()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped peer (SIGSTOP tests) dies too
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def scattered(n: int, block: int, blocks: int, seed: int) -> np.ndarray:
    """n block ids in random order, every eighth followed by its next two blocks (runs to merge)."""
    ids = np.random.default_rng(seed).permutation(blocks)[:n].astype(np.uint64)
    for i in range(0, n - 2, 8):
        ids[i + 1] = min(ids[i] + 1, blocks - 1)
        ids[i + 2] = min(ids[i] + 2, blocks - 1)
    return ids


def descriptors(base: int, local: np.ndarray, ids: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    remote = np.uint64(base) + ids * np.uint64(block)
    laddr = np.uint64(local.ctypes.data) + np.arange(len(ids), dtype=np.uint64) * np.uint64(block)
    return remote, laddr


def read_until_killed(fn: Any, pid: int, delay: float, limit: float) -> tuple[BaseException, float]:
    """Repeat fn() while the peer is SIGKILLed `delay` s in; the first exception and its time after the kill."""
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Timer(delay, kill).start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test asserts the type
            while not killed:
                time.sleep(0.01)
            return e, time.monotonic() - killed[0]
    raise AssertionError(f"no error within {limit} s of reading from a killed peer")
