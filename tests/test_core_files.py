"""kvbridge._core's store side, which needs no UCX: crc32c against google-crc32c, and file_start's blocks read
from and written to files on the copy threads, each block checked; every byte compared."""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np
import pytest

from kvbridge import native

core: Any = native.load_core()[0]
pytestmark = pytest.mark.skipif(core is None, reason=f"kvbridge._core: {native.load_core()[1]}")


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "lanes"])
def test_crc32c_matches_google_crc32c_over_runs_of_pieces(fold: bool) -> None:
    """The native crc32c is crc32c: the check value, and what google-crc32c gives for runs of pieces of
    every length and alignment, seams included: the three lanes' (3 x 2 KiB), and where the CPU folds by
    carry-less multiplies (``fold``), its rounds' (16 KiB)."""
    if not core.HAS_CRC32C:
        pytest.skip("no SSE4.2 here")
    if fold and not core.HAS_CRC32C_FOLD:
        pytest.skip("no VPCLMULQDQ here: the lanes alone run")
    google = pytest.importorskip("google_crc32c")
    check = np.frombuffer(b"123456789", np.uint8)
    assert np.frombuffer(core.crc32c(np.array([check.ctypes.data], np.uint64), 9, 1, fold=fold), "<u4")[0] == 0xE3069283
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lane, round_ = 2048, 16384
    lengths = np.array([0, 1, 7, 8, 9, 4095, 3 * lane - 1, 3 * lane, 3 * lane + 1, 7 * 4096 + 13, round_ - 1, round_,
                        round_ + 1, 2 * round_ + 3 * lane + 5, 65536, 100_003, 262_144, 5, 3 * round_ - 8, 11, 2 * round_],
                       np.uint64)  # fmt: skip
    starts = rng.integers(0, buf.size - 262_144, lengths.size).astype(np.uint64)
    starts[-3:] += np.uint64(1)  # odd addresses too
    sums = np.frombuffer(core.crc32c(starts + np.uint64(buf.ctypes.data), lengths, 3, fold=fold), "<u4")
    for g in range(lengths.size // 3):
        want = 0
        for s, n in zip(starts[3 * g : 3 * g + 3].tolist(), lengths[3 * g : 3 * g + 3].tolist()):
            want = google.extend(want, bytes(buf[s : s + n]))
        assert sums[g] == want, g
    with pytest.raises(ValueError, match="runs of"):
        core.crc32c(starts[:4] + np.uint64(buf.ctypes.data), lengths[:4], 3)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_file_start_reads_blocks_of_two_files_and_checks_them(tmp_path: Any, cut_bytes: int) -> None:
    """Blocks of three pieces each, from two files, read into scattered places on the native threads:
    every byte lands where it belongs, each block's crc32c is the native crc32c of what landed, and a
    file that ends inside a block makes that block (and none before it) the first not read whole."""
    if not core.HAS_CRC32C:
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
        running = core.file_start(runs, at, lengths, 3, cut_bytes=cut_bytes)
        sums, whole, err = running.checked()
        assert (whole, err) == (5, 0)
        assert np.array_equal(np.frombuffer(sums, "<u4")[:whole],
                              np.frombuffer(core.crc32c(at[: 3 * whole], lengths[: 3 * whole], 3), "<u4"))  # fmt: skip
        for k, (f, o) in enumerate(blocks[:whole]):
            for j in range(3):
                n, start = int(piece[j]), o + int(piece[:j].sum())
                assert np.array_equal(dst[int(places[3 * k + j]) :][:n], data[f][start : start + n]), (k, j)
        # block 2's file is no open file: blocks 0 and 1 arrived, and why 2 did not is said
        bad = [runs[0], (1 << 20, 48_000, 1), runs[2]]
        assert core.file_start(bad, at, lengths, 3, cut_bytes=cut_bytes).checked()[1:] == (2, errno.EBADF)
        with pytest.raises(ValueError, match="runs of"):
            core.file_start(runs, at[:4], lengths[:4], 3)
        with pytest.raises(ValueError, match="the runs hold 5 blocks, the descriptors 6"):
            core.file_start(runs[:2] + [(fds[1], 0, 2)], at, lengths, 3)
        with pytest.raises(ValueError, match="run 2 .* past the 6 blocks"):
            core.file_start(runs[:2] + [(fds[1], 0, 4)], at, lengths, 3)
        with pytest.raises(ValueError, match="negative"):
            core.file_start([(fds[0], -1, 6)], at, lengths, 3)
        with pytest.raises(TypeError, match="a run is"):
            core.file_start([fds[0]], at, lengths, 3)
        with pytest.raises(TypeError, match="not a checked transfer"):
            core.copy_start(at[:1], at[:1], 0).checked()
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("cut_bytes", [8 << 20, 1 << 10], ids=["one-thread", "cut"])
def test_file_start_writes_blocks_to_their_files_with_their_checksums(tmp_path: Any, cut_bytes: int) -> None:
    """``write=True``: blocks of scattered pieces written where each belongs in two files, each block's
    crc32c that of its bytes; a block whose file cannot be written is the first not whole, its errno said."""
    if not core.HAS_CRC32C:
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
        sums, whole, err = core.file_start(runs, at, lengths, 2, write=True, cut_bytes=cut_bytes).checked()
        assert (whole, err) == (4, 0)
        assert sums == core.crc32c(at, lengths, 2)
        files = [np.fromfile(tmp_path / f"w{i}", np.uint8) for i in range(2)]
        for k, (f, o) in enumerate(blocks):
            for j in range(2):
                n, start = int(piece[j]), o + int(piece[:j].sum())
                assert np.array_equal(files[f][start : start + n], src[int(places[2 * k + j]) :][:n]), (k, j)
        reader = os.open(tmp_path / "w0", os.O_RDONLY)
        try:
            bad = [runs[0], (reader, 500, 2)]  # blocks 2 and 3 go to a file open for reading only
            assert core.file_start(bad, at, lengths, 2, write=True, cut_bytes=cut_bytes).checked()[1:] == (2, errno.EBADF)
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

    if not core.HAS_CRC32C:
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
        got = core.file_start(runs, starts, lengths, 6, write=True, cut_bytes=cut_bytes, block_ids=ids,
                             block_stride=1024).checked()  # fmt: skip
        at, every = addressing.by_block(ids)
        want = core.file_start([(fds[1], 4096, 4)], at, every, 6, write=True, cut_bytes=cut_bytes).checked()
        assert got == want and got[1:] == (4, 0)
        assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()
        before = kv.copy()
        into = np.array([0, 39, 20, 5])  # numpy's integers, read back into other blocks
        sums, whole, err = core.file_start(runs, starts, lengths, 6, cut_bytes=cut_bytes, block_ids=into,
                                          block_stride=1024).checked()  # fmt: skip
        assert (sums, whole, err) == (got[0], 4, 0)
        layers = kv.reshape(3, 40, 1024)
        old = before.reshape(3, 40, 1024)
        assert np.array_equal(layers[:, into], old[:, ids])
        untouched = [b for b in range(40) if b not in into.tolist()]
        assert np.array_equal(layers[:, untouched], old[:, untouched])
        with pytest.raises(ValueError, match="negative"):
            core.file_start(runs, starts, lengths, 6, block_ids=[1, -2, 3, 4], block_stride=1024)
        with pytest.raises(ValueError, match="one block's 6 pieces, not 5"):
            core.file_start(runs, starts[:5], lengths[:5], 6, block_ids=ids, block_stride=1024)
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            core.file_start(runs, starts, lengths, 6, block_ids=[1.5, 2, 3, 4], block_stride=1024)
        with pytest.raises(ValueError, match="past the 3 blocks described"):
            core.file_start(runs, starts, lengths, 6, block_ids=ids[:3], block_stride=1024)
    finally:
        for fd in fds:
            os.close(fd)


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
        assert core.file_start(runs, at + np.uint64(src.ctypes.data), lengths, 1, write=True).result() == int(lengths.sum())
        data = np.fromfile(tmp_path / "f", np.uint8)
        assert data.size == 51_000
        for o, a, n in zip(offsets.tolist(), at.tolist(), lengths.tolist()):
            assert np.array_equal(data[o : o + n], src[a : a + n])
        dst = np.zeros_like(src)
        assert core.file_start(runs, at + np.uint64(dst.ctypes.data), lengths, 1).result() == int(lengths.sum())
        for a, n in zip(at.tolist(), lengths.tolist()):
            assert np.array_equal(dst[a : a + n], src[a : a + n])
        nothing = core.file_start([(fd, 51_000, 1)], np.uint64(src.ctypes.data) + np.zeros(1, np.uint64), 0, 1, write=True)
        assert nothing.result() == 0 and nothing.checked() == (bytes(4), 1, 0)  # crc32c of no bytes: 0
        # a block of two pieces from 50_900: 100 bytes, then none (the file ends at 51_000)
        short = core.file_start([(fd, 50_900, 1)], np.uint64(dst.ctypes.data) + np.array([0, 200], np.uint64), 200, 2)
        assert short.result() == 100 and short.checked()[1:] == (0, 0)
        with pytest.raises(OSError):
            core.file_start([(1 << 20, 0, 5)], at + np.uint64(dst.ctypes.data), lengths, 1).result()  # no open file
    finally:
        os.close(fd)
