"""The native paths that need no UCX: fs, cpu and a chain of both move a CPU KV cache through kvbridge._core
(file_start, copy_start/copy), byte for byte, wherever kvbridge was built with a C compiler.

CI runs this file a second time in an environment installed without the ucx extra (no libucx), with
KVBRIDGE_EXPECT_NO_UCX=1: there kvbridge._ucp must be reported unavailable while the core still loads.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvbridge
from kvbridge import checksums, native
from kvbridge.testing import MiniEngine

core, WHY = native.load_core()
pytestmark = pytest.mark.skipif(core is None, reason=f"kvbridge._core: {WHY}")


class Spy:
    """kvbridge._core as the stores see it, counting the calls each makes."""

    def __init__(self, mod: Any, calls: Counter[str]) -> None:
        self._mod, self._calls = mod, calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._mod, name)
        if not callable(value) or isinstance(value, type):
            return value

        def counted(*args: Any, **kw: Any) -> Any:
            self._calls[name] += 1
            return value(*args, **kw)

        return counted


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    seen: Counter[str] = Counter()
    monkeypatch.setattr(native, "load_core", lambda: (Spy(core, seen), ""))
    checksums.native_crc32c.cache_clear()  # probed once per process: probe the spy
    yield seen
    checksums.native_crc32c.cache_clear()


def test_the_core_is_there_and_ucp_is_said_where_it_is_not() -> None:
    line = native.describe()
    assert line.startswith("core: kvbridge._core (crc32c: ")
    if os.environ.get("KVBRIDGE_EXPECT_NO_UCX") == "1":
        assert native.load_ucp()[0] is None and "ucp: unavailable: libucx is not importable" in line, line
        with pytest.raises(ImportError):
            import libucx  # noqa: F401
    else:
        assert "ucp: " in line


CPU = {"capacity_bytes": 8 << 20}


@pytest.mark.parametrize("name", ["fs", "cpu", "chain"])
def test_stores_move_a_cpu_kv_through_the_core(name: str, tmp_path: Path, calls: Counter[str]) -> None:
    if name != "cpu" and not core.HAS_CRC32C:  # type: ignore[union-attr]
        pytest.skip("no SSE4.2 here: fs checks through google-crc32c, not kvbridge._core")
    options: dict[str, Any] = {
        "fs": {"path": str(tmp_path / "fs")},
        "cpu": CPU,
        "chain": {"tiers": [{"backend": "cpu", **CPU}, {"backend": "fs", "path": str(tmp_path / "fs")}]},
    }[name]
    backend = kvbridge.create_backend(name, options)
    producer = MiniEngine(backend, engine_id="p", seed=1)
    consumer = MiniEngine(backend, engine_id="c", seed=2) if name == "fs" else producer
    try:
        prompt = np.random.default_rng(3).integers(0, 32000, 16 * 6 + 3).tolist()
        producer.prefill("a", prompt)
        got = consumer.prefill("b", prompt)
        assert got.loaded_tokens == 96 and got.failed_blocks == []
        assert np.array_equal(got.snapshot[:, :6].numpy(), consumer.expected(got.keys[:6]).numpy())
    finally:
        producer.close()
        if consumer is not producer:
            consumer.close()
    moved_files = calls["file_start"]
    copied = calls["copy_start"] + calls["copy"]
    want = {"fs": (True, False), "cpu": (False, True), "chain": (True, True)}[name]
    assert (moved_files > 0, copied > 0) == want, dict(calls)
