"""kvbridge._core, which needs no UCX: copies in this process (copy, copy_start), reads of another process
(cma_read, cma_start, from tests/helpers/native_peer.py --no-ucp), the copy threads (cut, waiter, scheduling
policy, fork).  Every transfer is compared byte for byte; word i of the peer's buffer is i * PATTERN_K, so
every byte read can be checked without a second copy."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pattern import MiB, PatternPeer, descriptors, expected, read_until_killed, scattered

from kvbridge import native

core: Any = native.load_core()[0]
pytestmark = pytest.mark.skipif(core is None, reason=f"kvbridge._core: {native.load_core()[1]}")

SLACK_S = 4.0  # a read of a killed peer ends within this, scheduling included
PUT_AREA = 128 * MiB
BIG = 256 * MiB


@pytest.fixture(scope="module")
def peer() -> Iterator[PatternPeer]:
    if core is None:
        pytest.skip(native.load_core()[1])
    p = PatternPeer(["--bytes", str(PUT_AREA), "--no-ucp"])
    yield p
    p.close()


def test_the_core_loads_without_ucx() -> None:
    """In a fresh interpreter where libucx cannot be imported, kvbridge._core still loads and copies."""
    code = ("import sys; sys.modules['libucx'] = None; sys.modules['kvbridge._ucp'] = None\n"
            "import numpy as np\nfrom kvbridge import native\n"
            "core, why = native.load_core(); assert core is not None, why\n"
            "a = np.arange(4096, dtype=np.uint64); b = np.zeros_like(a)\n"
            "n = core.copy(np.array([a.ctypes.data], np.uint64), np.array([b.ctypes.data], np.uint64), a.nbytes)\n"
            "assert n == a.nbytes and (a == b).all()\n"
            "assert 'libucx' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(native.describe())")
    # PYTHONSAFEPATH: the kvbridge this test imported, not a source tree in the working directory
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("core: kvbridge._core") and "ucp: unavailable: libucx is not importable" in out.stdout


def test_handles_are_their_own_types() -> None:
    """One handle type per kind of transfer, all Jobs (wait, done); result and checked where they mean something."""
    assert {t.__name__ for t in (core.Copy, core.CmaRead, core.FileIO)} == {"Copy", "CmaRead", "FileIO"}
    assert all(issubclass(t, core.Job) for t in (core.Copy, core.CmaRead, core.FileIO))
    assert not hasattr(core.CmaRead, "checked") and not hasattr(core.FileIO, "seal")


def test_cma_read_scattered_bit_exact(peer: PatternPeer) -> None:
    block, n = 4096, 512
    ids = scattered(n, block, PUT_AREA // block, seed=1)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    lengths = np.full(n, block, np.uint64)
    assert core.cma_read(peer.pid, remote, laddr, lengths) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    local[:] = 0  # the same with one length for all
    assert core.cma_read(peer.pid, remote, laddr, block) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))


def test_cma_read_more_than_iov_max_and_errors(peer: PatternPeer) -> None:
    n, block = 3 * core.IOV_MAX + 5, 64  # several process_vm_readv batches, nothing adjacent
    ids = np.arange(n, dtype=np.uint64) * np.uint64(3)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    assert core.cma_read(peer.pid, remote, laddr, block) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    with pytest.raises(OSError) as e:  # an unmapped range in the peer
        core.cma_read(peer.pid, np.array([8], np.uint64), laddr[:1], 64)
    assert e.value.errno == 14  # EFAULT
    with pytest.raises(ProcessLookupError):
        core.cma_read(2**22 + 12345, remote[:1], laddr[:1], 64)


def test_cma_start_reads_on_a_native_thread_then_the_seal(peer: PatternPeer) -> None:
    """The read that the ucx consumer starts from the engine's thread: the same bytes as cma_read, then
    the 8-byte word at seal_address (read after the data), and the errors of cma_read from result()."""
    block, n = 4096, 512
    ids = scattered(n, block, PUT_AREA // block, seed=7)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    word_at = 1000  # word i of the peer is i * K: a known nonzero "seal"
    reads = [core.cma_start(peer.pid, remote, laddr, block, seal_address=peer.base + 8 * word_at) for _ in range(3)]
    for r in reads:  # several queued at once: each over, each with every byte and the word
        assert r.wait(10.0) and r.done()
        assert r.result() == (n * block, int(expected(np.array([word_at], np.uint64), 1)[0, 0]))
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    quiet = core.cma_start(peer.pid, remote[:1], laddr[:1], block)  # no seal asked: word 0
    assert quiet.result() == (block, 0)
    bad_seal = core.cma_start(peer.pid, remote[:1], laddr[:1], block, seal_address=8)  # unreadable: 0, data fine
    assert bad_seal.result() == (block, 0)
    unmapped = core.cma_start(peer.pid, np.array([8], np.uint64), laddr[:1], 64)
    assert unmapped.wait(10.0)
    with pytest.raises(OSError) as e:
        unmapped.result()
    assert e.value.errno == 14  # EFAULT, as cma_read
    with pytest.raises(ProcessLookupError):
        core.cma_start(2**22 + 12345, remote[:1], laddr[:1], 64).result()
    with pytest.raises(ValueError):  # bad arrays are refused before anything is queued
        core.cma_start(peer.pid, remote, laddr[:3], block)
    for _ in range(50):  # dropped unwaited: its object waits for the read before letting the arrays go
        core.cma_start(peer.pid, remote, laddr, block)


def test_cma_start_cuts_a_long_read_between_its_threads(peer: PatternPeer) -> None:
    """A read of 8 MiB or more runs as two pieces at once: every byte lands, the seal word is read once
    both are over, and a piece that fails fails the read (whichever half it is)."""
    block, n = 64 * 1024, 160  # 10 MiB in uneven pieces' worth of descriptors, scattered
    ids = scattered(n, block, PUT_AREA // block, seed=11)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    lengths = np.full(n, block, np.uint64)
    lengths[::7] //= 2  # pieces cut by bytes, not by count
    seal = int(expected(np.array([77], np.uint64), 1)[0, 0])
    assert core.cma_start(peer.pid, remote, laddr, lengths, seal_address=peer.base + 8 * 77).result() == (
        int(lengths.sum()), seal)
    got = local.reshape(n, -1)
    want = expected(ids * (block // 8), block // 8)
    for i in range(n):
        half = int(lengths[i]) // 8
        assert np.array_equal(got[i, :half], want[i, :half]), i
    for bad in (3, n - 3):  # an unreadable descriptor in the first piece, then in the second
        wrong = remote.copy()
        wrong[bad] = 8
        r = core.cma_start(peer.pid, wrong, laddr, block, seal_address=peer.base + 8 * 77)
        with pytest.raises(OSError) as e:
            r.result()
        assert e.value.errno == 14  # EFAULT


@pytest.mark.parametrize("cut_bytes", [1 << 62, 1 << 20])
def test_local_copies_with_streaming_stores_are_bit_exact(cut_bytes: int) -> None:
    """``copy`` and ``copy_start`` with ``streaming=True`` (non-temporal stores, aligned 64-byte bodies between a memcpy'd head
    and tail): every byte lands for lengths and addresses of every alignment, and nothing around the
    destinations is touched; cut between the threads or not."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = np.array([0, 1, 15, 16, 17, 63, 64, 65, 127, 4096 + 3, 65536, 300_001, 1 << 20], np.uint64)
    starts = np.cumsum(np.concatenate([[0], lengths[:-1] + 29])).astype(np.uint64)  # gaps, odd offsets
    s_off, d_off = starts + 7, starts + 3  # source and destination misaligned differently
    remote, local = src.ctypes.data + s_off, dst.ctypes.data + d_off
    want = np.zeros_like(src)
    for a, b, n in zip(s_off.tolist(), d_off.tolist(), lengths.tolist()):
        want[b : b + n] = src[a : a + n]
    assert core.copy(remote, local, lengths, streaming=True) == int(lengths.sum())
    assert np.array_equal(dst, want)
    dst[:] = 0
    assert core.copy_start(remote, local, lengths, streaming=True, cut_bytes=cut_bytes).result() == int(lengths.sum())
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_copy_start_with_parts_checks_each_block_where_it_landed(cut_bytes: int) -> None:
    """``parts=``: blocks of scattered pieces copied within this process, each block's crc32c taken where
    it landed; the copy bit-exact, every sum the native crc32c of the destination's block."""
    if not core.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    rng = np.random.default_rng(13)
    src = rng.integers(0, 256, 300_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = np.tile(np.array([4000, 1, 9000], np.uint64), 5)  # five blocks of three pieces
    remote = rng.permutation(np.arange(0, 290_000, 10_000))[:15].astype(np.uint64)
    local = rng.permutation(np.arange(0, 290_000, 10_000))[:15].astype(np.uint64)
    at = local + np.uint64(dst.ctypes.data)
    running = core.copy_start(remote + np.uint64(src.ctypes.data), at, lengths, cut_bytes=cut_bytes, parts=3)
    sums, whole, err = running.checked()
    assert (whole, err) == (5, 0) and running.result() == int(lengths.sum())
    assert sums == core.crc32c(at, lengths, 3)
    for r, loc, n in zip(remote.tolist(), local.tolist(), lengths.tolist()):
        assert np.array_equal(dst[loc : loc + n], src[r : r + n])
    with pytest.raises(ValueError, match="runs of"):
        core.copy_start(remote[:4], at[:4], lengths[:4], parts=3)
    with pytest.raises(ValueError, match="not another process"):  # pid 0 meant "copy here" once: no more
        core.cma_start(0, remote, at, lengths)
    with pytest.raises(ValueError, match="not another process"):
        core.cma_read(0, remote, at, lengths)
    with pytest.raises(TypeError):  # a read of another process is not checked
        core.cma_start(os.getpid(), remote, at, lengths, parts=3)


def test_cma_start_wait_times_out_then_completes(peer: PatternPeer) -> None:
    """wait(t) gives up after t while the read goes on; a later wait sees it over."""
    block = 2 * MiB
    ids = np.arange(PUT_AREA // block, dtype=np.uint64)
    local = np.zeros(PUT_AREA // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    r = core.cma_start(peer.pid, remote, laddr, block)
    assert r.wait(0.0) in (False, True)  # a zero wait only looks
    assert core.drain(30.0)  # nothing queued or running any more (what kvbridge waits for at exit)
    assert r.done() and r.wait(0.0) and r.result() == (PUT_AREA, 0)
    assert np.array_equal(local[::4099], expected(np.arange(0, PUT_AREA // 8, 4099, dtype=np.uint64), 1)[:, 0])


def test_a_waiter_runs_the_pieces_no_thread_has_taken() -> None:
    """A read queued behind others that keep both native threads busy is run by the thread that waits for
    it, at once: it is over, bit-exact, while the two before it are still copying (they would have had to
    end first for a native thread to take it). A zero wait only looks."""
    big = 512 * MiB  # each of the two long reads is one piece (under cut_bytes), ~0.1 s of copying into new pages
    src = np.empty(big, np.uint8)
    sinks = [np.empty(big, np.uint8) for _ in range(2)]
    longs = [core.copy_start(np.uint64(src.ctypes.data) + np.zeros(1, np.uint64), np.uint64(d.ctypes.data)
                           + np.zeros(1, np.uint64), big, cut_bytes=1 << 62) for d in sinks]  # fmt: skip
    small_src = np.random.default_rng(3).integers(0, 256, 64 * 1024, dtype=np.uint8)
    small_dst = np.zeros_like(small_src)
    one = np.zeros(1, np.uint64)
    r = core.copy_start(one + np.uint64(small_src.ctypes.data), one + np.uint64(small_dst.ctypes.data), small_src.size)
    assert r.wait(0.0) is False  # a look: nothing taken, nothing run (both threads are on the long reads)
    assert r.wait(30.0) and r.result() == small_src.size
    assert np.array_equal(small_dst, small_src)
    assert not any(x.done() for x in longs)  # run by this thread, not after one of them
    assert all(x.result() == big for x in longs)


def test_the_copy_threads_never_preempt_the_thread_that_starts_a_read() -> None:
    """The native copy threads run as SCHED_BATCH (no wake-up preemption): a read's start wakes them, and on
    a busy core the woken one took the core from the engine's thread at once (bench case: fs, load at 8 MiB,
    start_step). The starting thread keeps its own policy. The copy threads are found by
    their name in /proc (other threads of this process, an idle IO thread's, may be batch too)."""
    src = np.random.default_rng(4).integers(0, 256, 16 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    one = np.zeros(1, np.uint64)
    r = core.copy_start(one + np.uint64(src.ctypes.data), one + np.uint64(dst.ctypes.data), src.size, cut_bytes=MiB)
    assert r.wait(30.0) and r.result() == src.size and np.array_equal(dst, src)  # both threads made by now
    copy = [int(t) for t in os.listdir("/proc/self/task") if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "kvbridge-copy"]
    assert len(copy) == 2 and all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in copy)  # the copy threads alone
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_BATCH


@pytest.mark.parametrize("call", ["cma_read", "cma_start"])
def test_peer_killed_during_cma_read(call: str) -> None:
    p = PatternPeer(["--bytes", str(BIG), "--no-ucp"])
    block = 64 * 1024
    n = BIG // block
    ids = np.random.default_rng(4).permutation(n).astype(np.uint64)
    local = np.ones(BIG // 8, np.uint64)
    remote, laddr = descriptors(p.base, local, ids, block)
    read = {"cma_read": lambda: core.cma_read(p.pid, remote, laddr, block),  # here, or on a native thread
            "cma_start": lambda: core.cma_start(p.pid, remote, laddr, block).result()}[call]
    try:
        err, after = read_until_killed(read, p.pid, 0.03, 10.0)
        assert isinstance(err, OSError), err
        assert after < SLACK_S
    finally:
        p.kill()


def test_a_forked_child_never_waits_for_the_parents_reads(tmp_path: Any) -> None:
    """A read in flight when the process forks ran in the parent: in the child its object ends (cancelled,
    or done if it was) instead of waiting forever, and the child's own reads run on threads of its own."""

    src = np.arange(64 * MiB // 8, dtype=np.uint64)
    dst = np.zeros_like(src)
    chunk = 64 * 1024
    remote = np.uint64(src.ctypes.data) + np.arange(src.nbytes // chunk, dtype=np.uint64) * np.uint64(chunk)
    local = np.uint64(dst.ctypes.data) + np.arange(src.nbytes // chunk, dtype=np.uint64) * np.uint64(chunk)
    running = [core.copy_start(remote, local, chunk) for _ in range(4)]
    fd = os.open(tmp_path / "blocks", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, src.tobytes())
    blocks = src.nbytes // chunk
    read = core.file_start([(fd, 0, blocks)], local, chunk, 1) if core.HAS_CRC32C else None
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 0
        try:
            if read is not None and read.checked()[1:] not in ((0, errno.ECANCELED), (blocks, 0)):
                code = 5  # a file read of the parent's counts no block here, unless it was over before the fork
            for r in running:
                if not r.wait(5.0):
                    code = 2  # it would have waited forever
                    break
                try:
                    r.result()
                except OSError as exc:
                    code = code if exc.errno == errno.ECANCELED else 3
            mine = np.zeros(1024, np.uint64)
            again = core.copy_start(np.array([src.ctypes.data], np.uint64), np.array([mine.ctypes.data], np.uint64), mine.nbytes)
            if not again.wait(5.0) or again.result() != mine.nbytes or not np.array_equal(mine, src[:1024]):
                code = 4
        finally:
            os._exit(code)
    for r in running:
        assert r.wait(10.0) and r.result() == src.nbytes
    if read is not None:
        assert read.checked()[1:] == (blocks, 0)
    os.close(fd)
    assert np.array_equal(dst, src)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
