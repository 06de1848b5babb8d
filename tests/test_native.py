"""kvbridge._ucp against real processes on loopback: byte-exact reads and writes, a peer that dies or stops
mid-transfer, bad input, use after close.  The peer is tests/helpers/native_peer.py; word i of its buffer is
i * PATTERN_K, so every byte read can be checked here without a second copy."""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge import native

_mod, REASON = native.load()
ucp: Any = _mod


def require_native() -> None:
    if ucp is None:
        pytest.skip(f"kvbridge._ucp: {REASON}")


@pytest.fixture(autouse=True)
def _needs_native(request: pytest.FixtureRequest) -> None:
    if not request.function.__name__.startswith("test_loader"):
        require_native()


PEER = Path(__file__).parent / "helpers" / "native_peer.py"
K = np.uint64(0x9E3779B97F4A7C15)
MiB = 1 << 20
SLACK_S = 4.0  # a failed transfer may spend ABORT_WAIT_S (2 s) retiring its requests, plus scheduling


def expected(first_word: np.ndarray, words: int) -> np.ndarray:
    """The peer's words [first_word[i], first_word[i] + words) for each i, as rows."""
    return (first_word.astype(np.uint64)[:, None] + np.arange(words, dtype=np.uint64)[None, :]) * K


class Peer:
    def __init__(self, nbytes: int, tls: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--bytes", str(nbytes), "--tls", tls],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._line(30.0)
        if "error" in self.info:
            self.kill()
            pytest.skip(f"peer: {self.info['error']}")
        self.pid: int = self.info["pid"]
        self.base: int = self.info["address"]
        self.rkey = bytes.fromhex(self.info["rkey"])
        self.worker = bytes.fromhex(self.info["worker"])

    def _line(self, timeout: float) -> dict[str, Any]:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not got or not got[0]:
            self.kill()
            raise RuntimeError("native_peer did not answer")
        return dict(json.loads(got[0])) if got[0].startswith("{") else {"line": got[0].strip()}

    def sha(self, offset: int, length: int) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"sha {offset} {length}\n")
        self.proc.stdin.flush()
        return str(self._line(10.0)["line"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
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


def test_loader_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(target: str) -> Any:
        def fake(name: str, package: str | None = None) -> Any:
            if name == target:
                raise ImportError(f"simulated: no {name}")
            return real(name, package)

        return fake

    for target in ("libucx", "kvbridge._ucp"):
        monkeypatch.setattr(native.importlib, "import_module", missing(target))
        mod, reason = native.load.__wrapped__()  # type: ignore[attr-defined]
        assert mod is None and f"simulated: no {target}" in reason and "\n" not in reason
    monkeypatch.setattr(native, "load", lambda: 1 / 0)
    assert native.describe().startswith("unavailable: ZeroDivisionError")


def test_version() -> None:
    v = ucp.version()
    assert len(v) == 3 and tuple(v[:2]) >= tuple(ucp.API_VERSION)
    assert native.describe().startswith("native kvbridge._ucp (UCX ")


def test_cma_read_scattered_bit_exact(peer: Peer) -> None:
    block, n = 4096, 512
    ids = scattered(n, block, PUT_AREA // block, seed=1)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    lengths = np.full(n, block, np.uint64)
    assert ucp.cma_read(peer.pid, remote, laddr, lengths) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    local[:] = 0  # the same with one length for all
    assert ucp.cma_read(peer.pid, remote, laddr, block) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))


def test_cma_read_more_than_iov_max_and_errors(peer: Peer) -> None:
    n, block = 3 * ucp.IOV_MAX + 5, 64  # several process_vm_readv batches, nothing adjacent
    ids = np.arange(n, dtype=np.uint64) * np.uint64(3)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    assert ucp.cma_read(peer.pid, remote, laddr, block) == n * block
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    with pytest.raises(OSError) as e:  # an unmapped range in the peer
        ucp.cma_read(peer.pid, np.array([8], np.uint64), laddr[:1], 64)
    assert e.value.errno == 14  # EFAULT
    with pytest.raises(ProcessLookupError):
        ucp.cma_read(2**22 + 12345, remote[:1], laddr[:1], 64)


def test_cma_start_reads_on_a_native_thread_then_the_seal(peer: Peer) -> None:
    """The read that the ucx consumer starts from the engine's thread: the same bytes as cma_read, then
    the 8-byte word at seal_address (read after the data), and the errors of cma_read from result()."""
    block, n = 4096, 512
    ids = scattered(n, block, PUT_AREA // block, seed=7)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    word_at = 1000  # word i of the peer is i * K: a known nonzero "seal"
    reads = [ucp.cma_start(peer.pid, remote, laddr, block, seal_address=peer.base + 8 * word_at) for _ in range(3)]
    for r in reads:  # several queued at once: each over, each with every byte and the word
        assert r.wait(10.0) and r.done()
        assert r.result() == (n * block, int(expected(np.array([word_at], np.uint64), 1)[0, 0]))
    assert np.array_equal(local.reshape(n, -1), expected(ids * (block // 8), block // 8))
    quiet = ucp.cma_start(peer.pid, remote[:1], laddr[:1], block)  # no seal asked: word 0
    assert quiet.result() == (block, 0)
    bad_seal = ucp.cma_start(peer.pid, remote[:1], laddr[:1], block, seal_address=8)  # unreadable: 0, data fine
    assert bad_seal.result() == (block, 0)
    unmapped = ucp.cma_start(peer.pid, np.array([8], np.uint64), laddr[:1], 64)
    assert unmapped.wait(10.0)
    with pytest.raises(OSError) as e:
        unmapped.result()
    assert e.value.errno == 14  # EFAULT, as cma_read
    with pytest.raises(ProcessLookupError):
        ucp.cma_start(2**22 + 12345, remote[:1], laddr[:1], 64).result()
    with pytest.raises(ValueError):  # bad arrays are refused before anything is queued
        ucp.cma_start(peer.pid, remote, laddr[:3], block)
    for _ in range(50):  # dropped unwaited: its object waits for the read before letting the arrays go
        ucp.cma_start(peer.pid, remote, laddr, block)


def test_cma_start_cuts_a_long_read_between_its_threads(peer: Peer) -> None:
    """A read of 8 MiB or more runs as two pieces at once: every byte lands, the seal word is read once
    both are over, and a piece that fails fails the read (whichever half it is)."""
    block, n = 64 * 1024, 160  # 10 MiB in uneven pieces' worth of descriptors, scattered
    ids = scattered(n, block, PUT_AREA // block, seed=11)
    local = np.zeros(n * block // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    lengths = np.full(n, block, np.uint64)
    lengths[::7] //= 2  # pieces cut by bytes, not by count
    seal = int(expected(np.array([77], np.uint64), 1)[0, 0])
    assert ucp.cma_start(peer.pid, remote, laddr, lengths, seal_address=peer.base + 8 * 77).result() == (
        int(lengths.sum()), seal)
    got = local.reshape(n, -1)
    want = expected(ids * (block // 8), block // 8)
    for i in range(n):
        half = int(lengths[i]) // 8
        assert np.array_equal(got[i, :half], want[i, :half]), i
    for bad in (3, n - 3):  # an unreadable descriptor in the first piece, then in the second
        wrong = remote.copy()
        wrong[bad] = 8
        r = ucp.cma_start(peer.pid, wrong, laddr, block, seal_address=peer.base + 8 * 77)
        with pytest.raises(OSError) as e:
            r.result()
        assert e.value.errno == 14  # EFAULT


@pytest.mark.parametrize("cut_bytes", [1 << 62, 1 << 20])
def test_local_copies_with_streaming_stores_are_bit_exact(cut_bytes: int) -> None:
    """pid 0 with ``streaming=True`` (non-temporal stores, aligned 64-byte bodies between a memcpy'd head
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
    assert ucp.cma_read(0, remote, local, lengths, streaming=True) == int(lengths.sum())
    assert np.array_equal(dst, want)
    dst[:] = 0
    assert ucp.cma_start(0, remote, local, lengths, streaming=True, cut_bytes=cut_bytes).result() == (int(lengths.sum()), 0)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "lanes"])
def test_crc32c_matches_google_crc32c_over_runs_of_pieces(fold: bool) -> None:
    """The native crc32c is crc32c: the check value, and what google-crc32c gives for runs of pieces of
    every length and alignment, seams included: the three lanes' (3 x 2 KiB), and where the CPU folds by
    carry-less multiplies (``fold``), its rounds' (16 KiB)."""
    if not ucp.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    if fold and not ucp.HAS_CRC32C_FOLD:
        pytest.skip("no VPCLMULQDQ here: the lanes alone run")
    google = pytest.importorskip("google_crc32c")
    check = np.frombuffer(b"123456789", np.uint8)
    assert np.frombuffer(ucp.crc32c(np.array([check.ctypes.data], np.uint64), 9, 1, fold=fold), "<u4")[0] == 0xE3069283
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lane, round_ = 2048, 16384
    lengths = np.array([0, 1, 7, 8, 9, 4095, 3 * lane - 1, 3 * lane, 3 * lane + 1, 7 * 4096 + 13, round_ - 1, round_,
                        round_ + 1, 2 * round_ + 3 * lane + 5, 65536, 100_003, 262_144, 5, 3 * round_ - 8, 11, 2 * round_],
                       np.uint64)  # fmt: skip
    starts = rng.integers(0, buf.size - 262_144, lengths.size).astype(np.uint64)
    starts[-3:] += np.uint64(1)  # odd addresses too
    sums = np.frombuffer(ucp.crc32c(starts + np.uint64(buf.ctypes.data), lengths, 3, fold=fold), "<u4")
    for g in range(lengths.size // 3):
        want = 0
        for s, n in zip(starts[3 * g : 3 * g + 3].tolist(), lengths[3 * g : 3 * g + 3].tolist()):
            want = google.extend(want, bytes(buf[s : s + n]))
        assert sums[g] == want, g
    with pytest.raises(ValueError, match="runs of"):
        ucp.crc32c(starts[:4] + np.uint64(buf.ctypes.data), lengths[:4], 3)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_file_start_reads_blocks_of_two_files_and_checks_them(tmp_path: Any, cut_bytes: int) -> None:
    """Blocks of three pieces each, from two files, read into scattered places on the native threads:
    every byte lands where it belongs, each block's crc32c is the native crc32c of what landed, and a
    file that ends inside a block makes that block (and none before it) the first not read whole."""
    if not ucp.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    rng = np.random.default_rng(11)
    data = [rng.integers(0, 256, 96_000, dtype=np.uint8), rng.integers(0, 256, 40_000, dtype=np.uint8)]
    fds = []
    for i, d in enumerate(data):
        fds.append(os.open(tmp_path / f"o{i}", os.O_RDWR | os.O_CREAT, 0o644))
        os.write(fds[-1], d.tobytes())
    try:
        piece = np.array([5000, 3000, 8000], np.uint64)  # a block: 16_000 bytes in three pieces
        blocks = [(0, 0), (0, 16_000), (0, 48_000), (1, 0), (1, 16_000), (1, 32_000)]  # (file, offset); the last is cut
        runs = [(fds[0], 0, 2), (fds[0], 48_000, 1), (fds[1], 0, 3)]  # those blocks, as runs of back-to-back ones
        dst = np.zeros(200_000, np.uint8)
        places = rng.permutation(np.arange(0, 190_000, 8_000))[: 3 * len(blocks)].astype(np.uint64)  # disjoint
        lengths = np.tile(piece, len(blocks))
        at = places + np.uint64(dst.ctypes.data)
        running = ucp.file_start(runs, at, lengths, 3, cut_bytes=cut_bytes)
        sums, whole, err = running.checked()
        assert (whole, err) == (5, 0)
        assert np.array_equal(np.frombuffer(sums, "<u4")[:whole],
                              np.frombuffer(ucp.crc32c(at[: 3 * whole], lengths[: 3 * whole], 3), "<u4"))  # fmt: skip
        for k, (f, o) in enumerate(blocks[:whole]):
            for j in range(3):
                n, start = int(piece[j]), o + int(piece[:j].sum())
                assert np.array_equal(dst[int(places[3 * k + j]) :][:n], data[f][start : start + n]), (k, j)
        # block 2's file is no open file: blocks 0 and 1 arrived, and why 2 did not is said
        bad = [runs[0], (1 << 20, 48_000, 1), runs[2]]
        assert ucp.file_start(bad, at, lengths, 3, cut_bytes=cut_bytes).checked()[1:] == (2, errno.EBADF)
        with pytest.raises(ValueError, match="runs of"):
            ucp.file_start(runs, at[:4], lengths[:4], 3)
        with pytest.raises(ValueError, match="the runs hold 5 blocks, the descriptors 6"):
            ucp.file_start(runs[:2] + [(fds[1], 0, 2)], at, lengths, 3)
        with pytest.raises(ValueError, match="run 2 .* past the 6 blocks"):
            ucp.file_start(runs[:2] + [(fds[1], 0, 4)], at, lengths, 3)
        with pytest.raises(ValueError, match="negative"):
            ucp.file_start([(fds[0], -1, 6)], at, lengths, 3)
        with pytest.raises(TypeError, match="a run is"):
            ucp.file_start([fds[0]], at, lengths, 3)
        with pytest.raises(TypeError, match="not a checked read"):
            ucp.cma_start(0, at[:1], at[:1], 0).checked()
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_file_start_writes_blocks_to_their_files_with_their_checksums(tmp_path: Any, cut_bytes: int) -> None:
    """``write=True``: blocks of scattered pieces written where each belongs in two files, each block's
    crc32c that of its bytes; a block whose file cannot be written is the first not whole, its errno said."""
    if not ucp.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    rng = np.random.default_rng(12)
    src = rng.integers(0, 256, 100_000, dtype=np.uint8)
    piece = np.array([3000, 7000], np.uint64)  # a block: 10_000 bytes in two pieces
    blocks = [(0, 0), (0, 10_000), (1, 500), (1, 10_500)]  # (file, offset)
    fds = [os.open(tmp_path / f"w{i}", os.O_RDWR | os.O_CREAT, 0o644) for i in range(2)]
    try:
        runs = [(fds[0], 0, 2), (fds[1], 500, 2)]  # those blocks, as runs of back-to-back ones
        places = rng.permutation(np.arange(0, 90_000, 10_000))[: 2 * len(blocks)].astype(np.uint64)
        lengths = np.tile(piece, len(blocks))
        at = places + np.uint64(src.ctypes.data)
        sums, whole, err = ucp.file_start(runs, at, lengths, 2, write=True, cut_bytes=cut_bytes).checked()
        assert (whole, err) == (4, 0)
        assert sums == ucp.crc32c(at, lengths, 2)
        files = [np.fromfile(tmp_path / f"w{i}", np.uint8) for i in range(2)]
        for k, (f, o) in enumerate(blocks):
            for j in range(2):
                n, start = int(piece[j]), o + int(piece[:j].sum())
                assert np.array_equal(files[f][start : start + n], src[int(places[2 * k + j]) :][:n]), (k, j)
        reader = os.open(tmp_path / "w0", os.O_RDONLY)
        try:
            bad = [runs[0], (reader, 500, 2)]  # blocks 2 and 3 go to a file open for reading only
            assert ucp.file_start(bad, at, lengths, 2, write=True, cut_bytes=cut_bytes).checked()[1:] == (2, errno.EBADF)
        finally:
            os.close(reader)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_file_start_makes_each_blocks_pieces_from_block_ids_and_block_zeros(tmp_path: Any, cut_bytes: int) -> None:
    """``block_ids=``, ``block_stride=``: ``addresses`` and ``lengths`` are block 0's pieces (three layers
    of a strided KV), and every block's are made from them: a write of scattered block ids then a read of
    them into other ids land bit-exact, the file and the sums the same as with every block's addresses
    given (``BlockAddressing.by_block``); numpy's ids work too; bad ids and shapes are named errors."""
    from kvbridge.layout import BlockAddressing

    if not ucp.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    rng = np.random.default_rng(14)
    kv = rng.integers(0, 256, 3 * 40 * 1024, dtype=np.uint8)  # three layers of 40 blocks of 1 KiB
    base = kv.ctypes.data
    addressing = BlockAddressing((base, base + 40 * 1024, base + 80 * 1024), 1024, ((0, 400), (400, 624)))
    starts, lengths = addressing.first_block()
    ids = [7, 3, 31, 12]
    fds = [os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o644) for name in ("ours", "theirs")]
    try:
        runs = [(fds[0], 4096, 4)]
        got = ucp.file_start(runs, starts, lengths, 6, write=True, cut_bytes=cut_bytes, block_ids=ids,
                             block_stride=1024).checked()  # fmt: skip
        at, every = addressing.by_block(ids)
        want = ucp.file_start([(fds[1], 4096, 4)], at, every, 6, write=True, cut_bytes=cut_bytes).checked()
        assert got == want and got[1:] == (4, 0)
        assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()
        before = kv.copy()
        into = np.array([0, 39, 20, 5])  # numpy's integers, read back into other blocks
        sums, whole, err = ucp.file_start(runs, starts, lengths, 6, cut_bytes=cut_bytes, block_ids=into,
                                          block_stride=1024).checked()  # fmt: skip
        assert (sums, whole, err) == (got[0], 4, 0)
        layers = kv.reshape(3, 40, 1024)
        old = before.reshape(3, 40, 1024)
        assert np.array_equal(layers[:, into], old[:, ids])
        untouched = [b for b in range(40) if b not in into.tolist()]
        assert np.array_equal(layers[:, untouched], old[:, untouched])
        with pytest.raises(ValueError, match="negative"):
            ucp.file_start(runs, starts, lengths, 6, block_ids=[1, -2, 3, 4], block_stride=1024)
        with pytest.raises(ValueError, match="one block's 6 pieces, not 5"):
            ucp.file_start(runs, starts[:5], lengths[:5], 6, block_ids=ids, block_stride=1024)
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            ucp.file_start(runs, starts, lengths, 6, block_ids=[1.5, 2, 3, 4], block_stride=1024)
        with pytest.raises(ValueError, match="past the 3 blocks described"):
            ucp.file_start(runs, starts, lengths, 6, block_ids=ids[:3], block_stride=1024)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_cma_start_with_parts_checks_each_block_where_it_landed(cut_bytes: int) -> None:
    """``parts=``: blocks of scattered pieces copied within this process, each block's crc32c taken where
    it landed; the copy bit-exact, every sum the native crc32c of the destination's block."""
    if not ucp.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    rng = np.random.default_rng(13)
    src = rng.integers(0, 256, 300_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = np.tile(np.array([4000, 1, 9000], np.uint64), 5)  # five blocks of three pieces
    remote = rng.permutation(np.arange(0, 290_000, 10_000))[:15].astype(np.uint64)
    local = rng.permutation(np.arange(0, 290_000, 10_000))[:15].astype(np.uint64)
    at = local + np.uint64(dst.ctypes.data)
    running = ucp.cma_start(0, remote + np.uint64(src.ctypes.data), at, lengths, cut_bytes=cut_bytes, parts=3)
    sums, whole, err = running.checked()
    assert (whole, err) == (5, 0) and running.result()[0] == int(lengths.sum())
    assert sums == ucp.crc32c(at, lengths, 3)
    for r, loc, n in zip(remote.tolist(), local.tolist(), lengths.tolist()):
        assert np.array_equal(dst[loc : loc + n], src[r : r + n])
    with pytest.raises(ValueError, match="pid 0"):
        ucp.cma_start(os.getpid(), remote, at, lengths, parts=3)
    with pytest.raises(ValueError, match="runs of"):
        ucp.cma_start(0, remote[:4], at[:4], lengths[:4], parts=3)


def test_file_start_moves_runs_of_pieces_and_stops_at_the_end_of_the_file(tmp_path: Any) -> None:
    """pwritev/preadv of runs of blocks (fd, file offset, blocks), each block's pieces back to back in
    its run: a run's pieces go as one call, runs apart; a piece of no bytes moves nothing and is no
    error; a read past the end moves what there was, and its block is not whole."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 200_000, dtype=np.uint8)
    offsets = np.array([0, 1000, 1700, 50_000, 50_500], np.uint64)  # where the blocks go: [0, 2000), [50_000, 51_000)
    lengths = np.array([1000, 700, 300, 500, 500], np.uint64)  # five blocks of one piece each
    at = np.array([5, 90_000, 17, 120_001, 3], np.uint64)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    runs = [(fd, 0, 3), (fd, 50_000, 2)]
    try:
        assert ucp.file_start(runs, at + np.uint64(src.ctypes.data), lengths, 1, write=True).result() == (int(lengths.sum()), 0)
        data = np.fromfile(tmp_path / "f", np.uint8)
        assert data.size == 51_000
        for o, a, n in zip(offsets.tolist(), at.tolist(), lengths.tolist()):
            assert np.array_equal(data[o : o + n], src[a : a + n])
        dst = np.zeros_like(src)
        assert ucp.file_start(runs, at + np.uint64(dst.ctypes.data), lengths, 1).result() == (int(lengths.sum()), 0)
        for a, n in zip(at.tolist(), lengths.tolist()):
            assert np.array_equal(dst[a : a + n], src[a : a + n])
        nothing = ucp.file_start([(fd, 51_000, 1)], np.uint64(src.ctypes.data) + np.zeros(1, np.uint64), 0, 1, write=True)
        assert nothing.result() == (0, 0) and nothing.checked() == (bytes(4), 1, 0)  # crc32c of no bytes: 0
        # a block of two pieces from 50_900: 100 bytes, then none (the file ends at 51_000)
        short = ucp.file_start([(fd, 50_900, 1)], np.uint64(dst.ctypes.data) + np.array([0, 200], np.uint64), 200, 2)
        assert short.result() == (100, 0) and short.checked()[1:] == (0, 0)
        with pytest.raises(OSError):
            ucp.file_start([(1 << 20, 0, 5)], at + np.uint64(dst.ctypes.data), lengths, 1).result()  # no open file
    finally:
        os.close(fd)


def test_cma_start_wait_times_out_then_completes(peer: Peer) -> None:
    """wait(t) gives up after t while the read goes on; a later wait sees it over."""
    block = 2 * MiB
    ids = np.arange(PUT_AREA // block, dtype=np.uint64)
    local = np.zeros(PUT_AREA // 8, np.uint64)
    remote, laddr = descriptors(peer.base, local, ids, block)
    r = ucp.cma_start(peer.pid, remote, laddr, block)
    assert r.wait(0.0) in (False, True)  # a zero wait only looks
    assert ucp.cma_drain(30.0)  # nothing queued or running any more (what kvbridge waits for at exit)
    assert r.done() and r.wait(0.0) and r.result() == (PUT_AREA, 0)
    assert np.array_equal(local[::4099], expected(np.arange(0, PUT_AREA // 8, 4099, dtype=np.uint64), 1)[:, 0])


def test_a_waiter_runs_the_pieces_no_thread_has_taken() -> None:
    """A read queued behind others that keep both native threads busy is run by the thread that waits for
    it, at once: it is over, bit-exact, while the two before it are still copying (they would have had to
    end first for a native thread to take it). A zero wait only looks."""
    big = 512 * MiB  # each of the two long reads is one piece (under cut_bytes), ~0.1 s of copying into new pages
    src = np.empty(big, np.uint8)
    sinks = [np.empty(big, np.uint8) for _ in range(2)]
    longs = [ucp.cma_start(0, np.uint64(src.ctypes.data) + np.zeros(1, np.uint64), np.uint64(d.ctypes.data)
                           + np.zeros(1, np.uint64), big, cut_bytes=1 << 62) for d in sinks]  # fmt: skip
    small_src = np.random.default_rng(3).integers(0, 256, 64 * 1024, dtype=np.uint8)
    small_dst = np.zeros_like(small_src)
    one = np.zeros(1, np.uint64)
    r = ucp.cma_start(0, one + np.uint64(small_src.ctypes.data), one + np.uint64(small_dst.ctypes.data), small_src.size)
    assert r.wait(0.0) is False  # a look: nothing taken, nothing run (both threads are on the long reads)
    assert r.wait(30.0) and r.result() == (small_src.size, 0)
    assert np.array_equal(small_dst, small_src)
    assert not any(x.done() for x in longs)  # run by this thread, not after one of them
    assert all(x.result() == (big, 0) for x in longs)


def test_the_copy_threads_never_preempt_the_thread_that_starts_a_read() -> None:
    """The native copy threads run as SCHED_BATCH (no wake-up preemption): a read's start wakes them, and on
    a busy core the woken one took the core from the engine's thread at once (a file_start() call measured
    90-320 us instead of ~20 here). The starting thread keeps its own policy. The copy threads are found by
    their name in /proc (other threads of this process, an idle IO thread's, may be batch too)."""
    src = np.random.default_rng(4).integers(0, 256, 16 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)
    one = np.zeros(1, np.uint64)
    r = ucp.cma_start(0, one + np.uint64(src.ctypes.data), one + np.uint64(dst.ctypes.data), src.size, cut_bytes=MiB)
    assert r.wait(30.0) and r.result() == (src.size, 0) and np.array_equal(dst, src)  # both threads made by now
    copy = [int(t) for t in os.listdir("/proc/self/task") if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "kvbridge-copy"]
    assert len(copy) == 2 and all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in copy)  # the copy threads alone
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_BATCH


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
        ucp.cma_read(
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
        ucp.cma_read(peer.pid, remote, addr[:7], 8)
    with pytest.raises(ValueError, match="lengths"):
        ucp.cma_read(peer.pid, remote, addr, np.full(3, 8, np.uint64))
    with pytest.raises(ValueError, match="remote"):
        ucp.cma_read(peer.pid, remote.astype(np.int64), addr, 8)
    with pytest.raises(ValueError, match="local"):
        ucp.cma_read(peer.pid, remote, np.repeat(addr, 2)[::2], 8)
    with pytest.raises(TypeError):
        ucp.cma_read(peer.pid, [1, 2], addr, 8)
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


BIG = 256 * MiB


@pytest.mark.parametrize("call", ["cma_read", "cma_start"])
def test_peer_killed_during_cma_read(call: str) -> None:
    p = Peer(BIG)
    block = 64 * 1024
    n = BIG // block
    ids = np.random.default_rng(4).permutation(n).astype(np.uint64)
    local = np.ones(BIG // 8, np.uint64)
    remote, laddr = descriptors(p.base, local, ids, block)
    read = {"cma_read": lambda: ucp.cma_read(p.pid, remote, laddr, block),  # here, or on a native thread
            "cma_start": lambda: ucp.cma_start(p.pid, remote, laddr, block).result()}[call]
    try:
        err, after = read_until_killed(read, p.pid, 0.03, 10.0)
        assert isinstance(err, OSError), err
        assert after < SLACK_S
    finally:
        p.kill()


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

    figures = {"cma_read": best(lambda: ucp.cma_read(peer.pid, remote, laddr, block))}
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


def test_a_forked_child_never_waits_for_the_parents_reads(tmp_path: Any) -> None:
    """A read in flight when the process forks ran in the parent: in the child its object ends (cancelled,
    or done if it was) instead of waiting forever, and the child's own reads run on threads of its own."""
    import errno

    src = np.arange(64 * MiB // 8, dtype=np.uint64)
    dst = np.zeros_like(src)
    chunk = 64 * 1024
    remote = np.uint64(src.ctypes.data) + np.arange(src.nbytes // chunk, dtype=np.uint64) * np.uint64(chunk)
    local = np.uint64(dst.ctypes.data) + np.arange(src.nbytes // chunk, dtype=np.uint64) * np.uint64(chunk)
    running = [ucp.cma_start(0, remote, local, chunk) for _ in range(4)]  # pid 0: memcpy here, ~10 ms each
    fd = os.open(tmp_path / "blocks", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, src.tobytes())
    blocks = src.nbytes // chunk
    read = ucp.file_start([(fd, 0, blocks)], local, chunk, 1) if ucp.HAS_CRC32C else None
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
            again = ucp.cma_start(0, np.array([src.ctypes.data], np.uint64), np.array([mine.ctypes.data], np.uint64), mine.nbytes)
            if not again.wait(5.0) or again.result()[0] != mine.nbytes or not np.array_equal(mine, src[:1024]):
                code = 4
        finally:
            os._exit(code)
    for r in running:
        assert r.wait(10.0) and r.result()[0] == src.nbytes
    if read is not None:
        assert read.checked()[1:] == (blocks, 0)
    os.close(fd)
    assert np.array_equal(dst, src)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
