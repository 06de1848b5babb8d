"""kvbridge._ucp against real processes on loopback: byte-exact reads and writes, a peer that dies or stops
mid-transfer, bad input, use after close (kvbridge._core's copies and cma reads: tests/test_core.py).  The
peer is tests/helpers/native_peer.py; word i of its buffer is i * PATTERN_K, so every byte read can be checked
here without a second copy."""

from __future__ import annotations

import hashlib
import importlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from pattern import MiB, PatternPeer, descriptors, expected, read_until_killed, scattered

from kvbridge import native

_mod, REASON = native.load_ucp()
ucp: Any = _mod
core: Any = native.load_core()[0]  # the other lane (cma) of the same peer


def require_native() -> None:
    if ucp is None:
        pytest.skip(f"kvbridge._ucp: {REASON}")


@pytest.fixture(autouse=True)
def _needs_native(request: pytest.FixtureRequest) -> None:
    if not request.function.__name__.startswith("test_loader"):
        require_native()


SLACK_S = 4.0  # a failed transfer may spend ABORT_WAIT_S (2 s) retiring its requests, plus scheduling


class Peer(PatternPeer):
    """native_peer.py with a ucp context (all transports unless ``tls``); skips where it cannot make one."""

    def __init__(self, nbytes: int, tls: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        super().__init__(["--bytes", str(nbytes), "--tls", tls], env=env)
        if "error" in self.info:
            self.kill()
            pytest.skip(f"peer: {self.info['error']}")
        self.rkey = bytes.fromhex(self.info["rkey"])
        self.worker = bytes.fromhex(self.info["worker"])

    def sha(self, offset: int, length: int) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"sha {offset} {length}\n")
        self.proc.stdin.flush()
        return str(self._line(10.0)["line"])


PEER_BYTES = 130 * MiB  # 128 MiB to read, then 2 MiB that put() may overwrite
PUT_AREA = 128 * MiB


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    require_native()  # module fixtures run before the autouse check
    p = Peer(PEER_BYTES)  # all transports: tcp for the tests, cma for the throughput figure
    yield p
    p.close()
    assert p.proc.returncode == 0  # its progress thread stopped and its context closed cleanly


@pytest.fixture(scope="module")
def tcp() -> Iterator[Any]:
    require_native()
    ctx = ucp.Context(tls="tcp")
    yield ctx
    ctx.close()


def test_loader_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(target: str) -> Any:
        def fake(name: str, package: str | None = None) -> Any:
            if name == target:
                raise ImportError(f"simulated: no {name}")
            return real(name, package)

        return fake

    for target, load in (("libucx", native.load_ucp), ("kvbridge._ucp", native.load_ucp), ("kvbridge._core", native.load_core)):
        monkeypatch.setattr(native.importlib, "import_module", missing(target))
        mod, reason = load.__wrapped__()  # type: ignore[attr-defined]
        assert mod is None and f"simulated: no {target}" in reason and "\n" not in reason
    monkeypatch.setattr(native.importlib, "import_module", missing("libucx"))
    assert native.load_core.__wrapped__()[0] is not None  # type: ignore[attr-defined]  # the core needs no UCX
    monkeypatch.setattr(native, "load_ucp", lambda: 1 / 0)
    assert native.describe().startswith("core: kvbridge._core")
    assert "ucp: unavailable: ZeroDivisionError" in native.describe()


def test_version() -> None:
    v = ucp.version()
    assert len(v) == 3 and tuple(v[:2]) >= tuple(ucp.API_VERSION)
    assert "ucp: kvbridge._ucp (UCX " in native.describe()
    assert not hasattr(ucp, "cma_read") and not hasattr(ucp, "crc32c")  # those are kvbridge._core's


def test_get_tcp_scattered_bit_exact(peer: Peer, tcp: Any) -> None:
    block, n = 4096, 512
    ids = scattered(n, block, PUT_AREA // block, seed=2)
    local = np.zeros(n * block // 8, np.uint64)
    region = tcp.map(local.ctypes.data, local.nbytes)
    ep = tcp.connect(peer.worker, error_handling=True)
    k = ep.add_rkey(peer.rkey)
    remote, laddr = descriptors(peer.base, local, ids, block)
    assert ep.get(remote, laddr, np.full(n, block, np.uint64), np.zeros(n, np.uint32), 10.0, region) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    local[:] = 0  # scalars for lengths and rkey index, no local region
    assert ep.get(remote, laddr, block, k, 10.0) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    assert "tcp" in ep.info() and ep.failed is None
    ep.close()
    region.close()


def test_put_tcp_lands_in_peer(peer: Peer, tcp: Any) -> None:
    block, n = 4096, 256  # reversed order into the put area, so nothing merges on the remote side
    src = np.random.default_rng(3).integers(0, 2**63, n * block // 8, dtype=np.uint64)
    ep = tcp.connect(peer.worker)
    k = ep.add_rkey(peer.rkey)
    ids = np.arange(n - 1, -1, -1, dtype=np.uint64)
    remote, laddr = descriptors(peer.base + PUT_AREA, src, ids, block)
    assert ep.put(remote, laddr, block, k, 10.0) == n * block
    want = np.empty_like(src).reshape(n, -1)
    want[ids.astype(np.int64)] = src.reshape(n, -1)
    assert peer.sha(PUT_AREA, n * block) == hashlib.sha256(want.tobytes()).hexdigest()
    back = np.zeros_like(src)  # and read back through the other lane
    assert (
        core.cma_read(
            peer.pid, np.array([peer.base + PUT_AREA], np.uint64), np.array([back.ctypes.data], np.uint64), back.nbytes
        )
        == back.nbytes
    )
    assert np.array_equal(back, want.reshape(-1))
    ep.close()


def test_bad_input(peer: Peer, tcp: Any) -> None:
    a = np.zeros(8, np.uint64)
    addr = np.uint64(a.ctypes.data) + np.arange(8, dtype=np.uint64) * np.uint64(8)
    remote = np.uint64(peer.base) + np.arange(8, dtype=np.uint64) * np.uint64(8)
    with pytest.raises(ValueError, match="local"):
        core.cma_read(peer.pid, remote, addr[:7], 8)
    with pytest.raises(ValueError, match="lengths"):
        core.cma_read(peer.pid, remote, addr, np.full(3, 8, np.uint64))
    with pytest.raises(ValueError, match="remote"):
        core.cma_read(peer.pid, remote.astype(np.int64), addr, 8)
    with pytest.raises(ValueError, match="local"):
        core.cma_read(peer.pid, remote, np.repeat(addr, 2)[::2], 8)
    with pytest.raises(TypeError):
        core.cma_read(peer.pid, [1, 2], addr, 8)
    ep = tcp.connect(peer.worker)
    k = ep.add_rkey(peer.rkey)
    with pytest.raises(ValueError, match="rkey_index"):
        ep.get(remote, addr, 8, np.zeros(8, np.uint64), 5.0)  # uint64, not uint32
    with pytest.raises(ValueError, match="rkey_index"):
        ep.get(remote, addr, 8, k + 1, 5.0)
    with pytest.raises(ValueError, match="rkey_index"):
        ep.get(remote, addr, 8, np.zeros(7, np.uint32), 5.0)
    with pytest.raises(ValueError, match="timeout"):
        ep.get(remote, addr, 8, k, 0.0)
    other = np.zeros(8, np.uint64)
    region = tcp.map(other.ctypes.data, other.nbytes)
    with pytest.raises(ValueError, match="outside local_region"):
        ep.get(remote, addr, 8, k, 5.0, region)
    with pytest.raises(ValueError, match="memory_type"):
        tcp.map(other.ctypes.data, other.nbytes, "tpu")
    assert ep.failed is None  # bad input is refused before anything is posted
    assert ep.get(remote, addr, 8, k, 5.0) == 64
    ep.close()
    ep.close()
    with pytest.raises(ValueError, match="closed"):
        ep.get(remote, addr, 8, k, 5.0)
    region.close()
    region.close()
    with pytest.raises(ValueError, match="closed"):
        region.rkey  # noqa: B018


def test_use_after_context_close(peer: Peer) -> None:
    ctx = ucp.Context(tls="tcp")
    buf = np.zeros(1024, np.uint64)
    region = ctx.map(buf.ctypes.data, buf.nbytes)
    ep = ctx.connect(peer.worker)
    k = ep.add_rkey(peer.rkey)
    assert ep.get(np.array([peer.base], np.uint64), np.array([buf.ctypes.data], np.uint64), buf.nbytes, k, 5.0, region)
    ctx.close()
    ctx.close()
    assert ctx.closed and ep.closed and region.closed
    for call in (
        lambda: ep.get(np.array([peer.base], np.uint64), np.array([buf.ctypes.data], np.uint64), 8, k, 5.0),
        lambda: ep.add_rkey(peer.rkey),
        lambda: ep.info(),
        lambda: region.rkey,
        lambda: ctx.map(buf.ctypes.data, buf.nbytes),
        lambda: ctx.connect(peer.worker),
        lambda: ctx.address,
        lambda: ctx.progress(),
    ):
        with pytest.raises(ValueError, match="closed"):
            call()
    ep.close()  # and when these go, deallocation after close must not touch freed ucp objects
    region.close()


BIG = 256 * MiB


def test_peer_killed_during_get_tcp(tcp: Any) -> None:
    p = Peer(BIG, tls="tcp")
    block = 64 * 1024
    n = BIG // block
    ids = np.random.default_rng(5).permutation(n).astype(np.uint64)
    local = np.ones(BIG // 8, np.uint64)
    region = tcp.map(local.ctypes.data, local.nbytes)
    ep = tcp.connect(p.worker, error_handling=True)
    k = ep.add_rkey(p.rkey)
    remote, laddr = descriptors(p.base, local, ids, block)
    timeout = 10.0
    try:
        err, after = read_until_killed(lambda: ep.get(remote, laddr, block, k, timeout, region), p.pid, 0.1, 30.0)
        assert isinstance(err, (ConnectionError, TimeoutError)), err
        assert after < timeout + SLACK_S
        assert ep.failed
        with pytest.raises(ConnectionError):
            ep.get(remote, laddr, block, k, timeout, region)
        ep.close()
        region.close()  # nothing in flight still uses it
    finally:
        p.kill()


def test_stopped_peer_times_out(tcp: Any) -> None:
    p = Peer(32 * MiB, tls="tcp")
    local = np.zeros(32 * MiB // 8, np.uint64)
    ep = tcp.connect(p.worker)
    k = ep.add_rkey(p.rkey)
    remote = np.array([p.base], np.uint64)
    laddr = np.array([local.ctypes.data], np.uint64)
    try:
        assert ep.get(remote, laddr, 4096, k, 10.0) == 4096  # wired up
        os.kill(p.pid, signal.SIGSTOP)
        ticks = [0]
        done = threading.Event()

        def count() -> None:  # runs only if the wait below released the GIL
            while not done.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        counter = threading.Thread(target=count)
        counter.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                ep.get(remote, laddr, local.nbytes, k, 1.0)
        finally:
            done.set()
            counter.join()
        assert time.monotonic() - t0 < 1.0 + SLACK_S
        assert ticks[0] > 100, ticks
        assert ep.failed and "timed out" in ep.failed
        with pytest.raises(ConnectionError, match="timed out"):
            ep.get(remote, laddr, 4096, k, 1.0)
    finally:
        p.kill()


def test_concurrent_gets_share_an_endpoint(peer: Peer, tcp: Any) -> None:
    block, n, threads = 4096, 1024, 4
    ep = tcp.connect(peer.worker)
    k = ep.add_rkey(peer.rkey)
    results: list[bool] = []

    def reader(seed: int) -> None:
        ids = scattered(n, block, PUT_AREA // block, seed=seed)
        local = np.zeros(n * block // 8, np.uint64)
        remote, laddr = descriptors(peer.base, local, ids, block)
        for _ in range(3):
            ep.get(remote, laddr, block, k, 20.0)
            results.append(np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8)))

    ts = [threading.Thread(target=reader, args=(10 + i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert results == [True] * (3 * threads)
    ep.close()


def test_context_close_aborts_a_waiting_get() -> None:
    p = Peer(32 * MiB, tls="tcp")
    ctx = ucp.Context(tls="tcp")
    local = np.zeros(32 * MiB // 8, np.uint64)
    ep = ctx.connect(p.worker)
    k = ep.add_rkey(p.rkey)
    remote = np.array([p.base], np.uint64)
    laddr = np.array([local.ctypes.data], np.uint64)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            ep.get(remote, laddr, local.nbytes, k, 60.0)
        except BaseException as e:  # noqa: BLE001 - the test asserts the type
            errors.append(e)

    try:
        assert ep.get(remote, laddr, 4096, k, 10.0) == 4096
        os.kill(p.pid, signal.SIGSTOP)
        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        ctx.close()  # must end the other thread's wait, not wait out its 60 s deadline
        t.join(10)
        assert time.monotonic() - t0 < SLACK_S and not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ConnectionError), errors
        assert ep.closed and ctx.closed
    finally:
        p.kill()


def test_throughput_figures(peer: Peer, tcp: Any) -> None:
    """Printed, not asserted (run with -s): 128 MiB in 2048 scattered 64 KiB blocks, per lane."""
    block = 64 * 1024
    n = PUT_AREA // block // 2
    ids = scattered(n, block, PUT_AREA // block, seed=6)
    local = np.ones(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)

    def best(fn: Any, reps: int = 3) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return n * block / min(ts) / 1e9

    figures = {"cma_read": best(lambda: core.cma_read(peer.pid, remote, laddr, block))}
    ctx_any = ucp.Context(tls="all")  # not the environment's UCX_TLS: another test may have set it
    for name, ctx, eh in (("get tcp", tcp, True), ("get default lanes, no error handling", ctx_any, False)):
        region = ctx.map(local.ctypes.data, local.nbytes)
        ep = ctx.connect(peer.worker, error_handling=eh)
        k = ep.add_rkey(peer.rkey)
        ep.get(remote, laddr, block, k, 30.0, region)
        figures[name] = best(lambda ep=ep, k=k, region=region: ep.get(remote, laddr, block, k, 30.0, region))
        lanes = [ln.split()[2] for ln in ep.info().splitlines() if "lane[" in ln]
        figures[name + " lanes"] = lanes  # type: ignore[assignment]
        assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
        ep.close()
        region.close()
    ctx_any.close()
    print(
        "\nkvbridge._ucp, 128 MiB as 2048 x 64 KiB scattered:",
        ", ".join(f"{k} {v:.2f} GB/s" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()),
    )
