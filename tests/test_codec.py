"""The object codec (kvbridge/codec.py): the block formats (lmcache's, fs's v1) and the chunk format (fs,
v2) round-trip, keep their documented byte layouts (objects stored before stay readable), and every
kind of damage raises ``Corrupted`` with the right ``damaged``."""

from __future__ import annotations

import hashlib
import pickle
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from kvbridge import checksums, codec
from kvbridge.errors import Corrupted, KVBridgeError, MissingDependency
from kvbridge.layout import LayoutFingerprint

FP = LayoutFingerprint(dtype="bfloat16", num_layers=3, num_kv_heads=2, head_size=8, block_size=4, block_bytes=128, kv_format="blocks_first")
OTHER = LayoutFingerprint(dtype="bfloat16", num_layers=3, num_kv_heads=4, head_size=4, block_size=4, block_bytes=128, kv_format="blocks_first")
KEY = bytes(range(16))
FORMATS = {"fs_v1": codec.FS_V1, "lmcache": codec.LMCACHE}
KINDS = ["crc32", "crc32c"]


def _kind(name: str) -> int:
    if name == "crc32c" and not codec.have_crc32c():
        pytest.skip("crc32c needs kvbridge's native module or google-crc32c")
    return codec.CHECKSUMS[name]


class Obj:
    """One block object as a store holds it: header bytes, the payload as per-layer rows."""

    def __init__(self, fmt: codec.BlockFormat, kind: int = codec.CRC32, key: bytes = KEY, fp: LayoutFingerprint = FP):
        self.fmt = fmt
        rng = np.random.default_rng(0)
        self.payload = rng.integers(0, 256, (fp.num_layers, fp.block_bytes), dtype=np.uint8)
        self.header = bytearray(fmt.pack(key, fp, self.rows(), kind))
        self.size = len(self.header) + self.payload.nbytes

    def rows(self) -> list[memoryview]:
        return [memoryview(row) for row in self.payload]

    def check(self, key: bytes = KEY, fp: LayoutFingerprint = FP) -> None:
        self.fmt.check(self.header, key=key, fingerprint=fp, parts=self.rows(), size=self.size)

    def set(self, field: str, value: object) -> None:
        """Rewrite one fixed header field (by its position in the format's struct)."""
        names = _FIELDS[self.fmt.inline]
        values = list(self.fmt.fixed.unpack_from(self.header))
        values[names.index(field)] = value
        self.fmt.fixed.pack_into(self.header, 0, *values)


_FIELDS = {
    True: ("magic", "version", "kind", "key_len", "fp_len", "payload", "checksum"),
    False: ("magic", "version", "kind", "checksum", "payload", "fingerprint", "key"),
}


# ---- round trips and the documented byte layouts ----------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip(fmt, kind):
    obj = Obj(FORMATS[fmt], _kind(kind))
    assert len(obj.header) == FORMATS[fmt].header_bytes
    obj.check()
    # one contiguous buffer is the same payload as its rows (lmcache passes one, fs one per layer)
    FORMATS[fmt].check(obj.header, key=KEY, fingerprint=FP, parts=[obj.payload], size=obj.size)


@pytest.mark.parametrize("kind", KINDS)
def test_fs_v1_header_is_the_documented_layout(kind):
    k = _kind(kind)
    obj = Obj(codec.FS_V1, k)
    fp = FP.to_json().encode()
    crc = codec.checksum(k, [obj.payload])
    want = struct.pack("<8sHHHHQI", b"KVBRFS\r\n", 1, k, len(KEY), len(fp), obj.payload.nbytes, crc) + KEY + fp
    assert bytes(obj.header) == want.ljust(4096, b"\0")


@pytest.mark.parametrize("kind", KINDS)
def test_lmcache_header_is_the_documented_layout(kind):
    k = _kind(kind)
    obj = Obj(codec.LMCACHE, k)
    digest = hashlib.blake2b(KEY, digest_size=16).digest()
    crc = codec.checksum(k, [obj.payload])
    want = struct.pack("<8sHHIQ16s16s", b"KVBRLM\r\n", 1, k, crc, obj.payload.nbytes, FP.digest().encode(), digest)
    assert bytes(obj.header) == want.ljust(64, b"\0")


def test_checksums_are_the_usual_ones_over_the_concatenation():
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    parts = [memoryview(data[:10]), memoryview(data[10:999]), memoryview(data[999:])]
    assert codec.checksum(codec.CRC32, parts) == zlib.crc32(data.tobytes())
    if checksums._google_crc32c() is not None:
        assert codec.checksum(codec.CRC32C, parts) == checksums._google_crc32c().value(data.tobytes())
    with pytest.raises(ValueError, match="kind"):
        codec.checksum(7, parts)


@pytest.mark.parametrize("source", ["native", "google"])
def test_crc32c_from_either_source_is_crc32c(source, monkeypatch):
    """crc32c is there with either the native module or google-crc32c alone (vLLM's environment has no
    google-crc32c): the check value of "123456789", and the same sum over strided and empty parts."""
    if source == "native" and checksums.native_crc32c() is None:
        pytest.skip("kvbridge._core is not built with crc32c here")
    if source == "google":
        pytest.importorskip("google_crc32c")
    monkeypatch.setattr(checksums, "_google_crc32c" if source == "native" else "native_crc32c", lambda: None)
    assert codec.have_crc32c() and codec.default_checksum() == "crc32c"
    assert codec.checksum(codec.CRC32C, [b"1234", memoryview(b"56789")]) == 0xE3069283
    assert codec.checksum(codec.CRC32C, []) == codec.checksum(codec.CRC32C, [b""]) == 0
    strided = np.random.default_rng(4).integers(0, 256, (6, 40), dtype=np.uint8)[:, ::3]  # summed in order
    assert codec.checksum(codec.CRC32C, [strided, b""]) == codec.checksum(codec.CRC32C, [strided.tobytes()])


def test_a_key_too_long_for_the_header_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        Obj(codec.FS_V1, key=b"k" * 4096)
    Obj(codec.LMCACHE, key=b"k" * 4096).check(key=b"k" * 4096)  # a digest: any key fits


# ---- damage ---------------------------------------------------------------------------------------
def _truncated(o: Obj) -> None:
    o.size = 20
    del o.header[20:]


def _bad_magic(o: Obj) -> None:
    o.header[0] ^= 1


def _version(o: Obj) -> None:
    o.set("version", codec.VERSION + 1)


def _payload_length(o: Obj) -> None:
    o.set("payload", o.payload.nbytes - 8)


def _longer(o: Obj) -> None:
    o.size += 1


def _shorter(o: Obj) -> None:
    o.size -= 1


def _unknown_kind(o: Obj) -> None:
    o.set("kind", 9)


def _checksum(o: Obj) -> None:
    o.set("checksum", o.fmt.fixed.unpack_from(o.header)[_FIELDS[o.fmt.inline].index("checksum")] ^ 1)


def _payload_bit(o: Obj) -> None:
    o.payload[1, 5] ^= 0x40


def _fs_lengths(o: Obj) -> None:
    o.set("key_len", 5000)


def _lmcache_key(o: Obj) -> None:
    o.set("key", b"\0" * 16)


# name -> (spoil, damaged, the reason's words); every check of the module docstring's table
DAMAGE: dict[str, tuple[Callable[[Obj], None], bool, str]] = {
    "truncated": (_truncated, True, "truncated"),
    "bad_magic": (_bad_magic, True, "magic"),
    "foreign_version": (_version, False, "version"),
    "payload_length": (_payload_length, True, "payload length"),
    "longer": (_longer, True, "promises"),
    "shorter": (_shorter, True, "promises"),
    "unknown_checksum_kind": (_unknown_kind, False, "cannot be verified"),
    "checksum_field": (_checksum, True, "checksum mismatch"),
    "payload_bit": (_payload_bit, True, "checksum mismatch"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_corruption_raises_corrupted_with_the_right_damaged(fmt, damage):
    spoil, damaged, reason = DAMAGE[damage]
    obj = Obj(FORMATS[fmt])
    spoil(obj)
    with pytest.raises(Corrupted, match=reason) as err:
        obj.check()
    assert err.value.damaged is damaged
    assert isinstance(err.value, KVBridgeError)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_another_key_is_damaged_another_layout_foreign(fmt):
    obj = Obj(FORMATS[fmt])
    with pytest.raises(Corrupted, match="another key") as err:
        obj.check(key=b"another key")
    assert err.value.damaged
    with pytest.raises(Corrupted, match="layout") as err:
        obj.check(fp=OTHER)  # same bytes per block, another geometry: someone else's object
    assert not err.value.damaged


def test_format_specific_fields():
    fs = Obj(codec.FS_V1)
    _fs_lengths(fs)
    with pytest.raises(Corrupted, match="out of range") as err:
        fs.check()
    assert err.value.damaged
    lm = Obj(codec.LMCACHE)
    _lmcache_key(lm)
    with pytest.raises(Corrupted, match="another key") as err:
        lm.check()
    assert err.value.damaged


def test_one_formats_object_is_not_the_others():
    fs = Obj(codec.FS_V1)
    with pytest.raises(Corrupted, match="magic") as err:
        codec.LMCACHE.check(fs.header, key=KEY, fingerprint=FP, parts=fs.rows(), size=fs.size)
    assert err.value.damaged


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_crc32c_object_where_crc32c_is_missing_is_foreign(fmt, monkeypatch):
    obj = Obj(FORMATS[fmt], _kind("crc32c"))
    monkeypatch.setattr(checksums, "_google_crc32c", lambda: None)
    monkeypatch.setattr(checksums, "native_crc32c", lambda: None)
    assert not codec.have_crc32c() and codec.default_checksum() == "crc32"
    with pytest.raises(Corrupted, match="cannot be verified") as err:
        obj.check()
    assert not err.value.damaged
    with pytest.raises(MissingDependency, match="native module or google-crc32c: pip install google-crc32c"):
        codec.require_checksum("crc32c", "fs")
    codec.require_checksum("crc32", "fs")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bit_flips_anywhere_in_the_payload_are_detected(fmt, kind):
    obj = Obj(FORMATS[fmt], _kind(kind))
    flat = obj.payload.reshape(-1)
    for pos in range(0, flat.size, 7):  # every layer, every word, all eight bit positions
        bit = 1 << (pos % 8)
        flat[pos] ^= bit
        with pytest.raises(Corrupted, match="checksum") as err:
            obj.check()
        assert err.value.damaged
        flat[pos] ^= bit
    obj.check()  # and the intact object still passes


def test_corrupted_keeps_damaged_through_pickling():
    for damaged in (True, False):
        again = pickle.loads(pickle.dumps(Corrupted("why", damaged=damaged)))
        assert isinstance(again, Corrupted) and again.damaged is damaged and str(again) == "why"
    assert Corrupted("default").damaged


# ---- the chunk format (fs, version 2) ---------------------------------------------------------------
KEYS = [bytes([i]) * 16 for i in range(5)]
PAYLOAD = FP.num_layers * FP.block_bytes


class Chunk:
    """One chunk object as fs stores it: header bytes, then each block's payload."""

    def __init__(self, kind: int = codec.CRC32, keys: list[bytes] = KEYS):
        rng = np.random.default_rng(3)
        self.blocks = [rng.integers(0, 256, PAYLOAD, dtype=np.uint8) for _ in keys]
        self.sums = [codec.checksum(kind, [b]) for b in self.blocks]
        self.header = bytearray(codec.FS.pack(keys, FP, self.sums, kind))
        self.size = len(self.header) + len(keys) * PAYLOAD

    def parse(self, fp: LayoutFingerprint = FP) -> codec.Chunk:
        return codec.FS.parse(self.header, fingerprint=fp, size=self.size)

    def set(self, index: int, value: object, *, fix_crc: bool = True) -> None:
        """Rewrite one fixed header field (its position in the documented struct), keeping the header checksum."""
        values = list(codec.FS.fixed.unpack_from(self.header))
        values[index] = value
        values[8] = 0
        codec.FS.fixed.pack_into(self.header, 0, *values)
        if fix_crc:
            struct.pack_into("<I", self.header, 32, codec._header_crc(self.header))


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_round_trip_and_documented_layout(kind):
    k = _kind(kind)
    obj = Chunk(k)
    chunk = obj.parse()
    assert chunk.keys == tuple(KEYS) and chunk.checksums == tuple(obj.sums)
    assert chunk.header_bytes == 4096 == len(obj.header) and chunk.size == obj.size and chunk.offset(2) == 4096 + 2 * PAYLOAD
    for i, block in enumerate(obj.blocks):
        chunk.verify(i, [block])
        chunk.verify(i, [block[:100], block[100:]])  # pieces (one per layer) are the same payload
    fp = FP.to_json().encode()
    table = b"".join(struct.pack("<IH", c, len(key)) + key for key, c in zip(KEYS, obj.sums))
    fixed = struct.pack("<8sHHIHHQIII", b"KVBRFS\r\n", 2, k, 4096, len(KEYS), len(fp), PAYLOAD, 0, 0, 0)
    want = bytearray((fixed + fp + table).ljust(4096, b"\0"))
    struct.pack_into("<I", want, 32, zlib.crc32(bytes(want)))  # the header checksum, over the header with it zero
    assert bytes(obj.header) == bytes(want)
    assert chunk.find(KEYS[3]) == 3
    with pytest.raises(Corrupted, match="another key") as err:
        chunk.find(b"not here")
    assert err.value.damaged


def test_chunk_header_grows_in_pages_when_keys_need_it():
    keys = [bytes([i]) * 200 for i in range(40)]  # 40 * 206 bytes of entries: more than one page
    obj = Chunk(keys=keys)
    assert len(obj.header) == 3 * 4096 and obj.parse().keys == tuple(keys)
    with pytest.raises(ValueError, match="one of each"):
        codec.FS.pack(KEYS, FP, [1], codec.CRC32)


def _chunk_version(o: Chunk) -> None:
    o.set(1, 1)  # a v1 reader's object, or a v3 one's: not ours


def _chunk_header_len(o: Chunk) -> None:
    o.set(3, 4097)


def _chunk_header_past_end(o: Chunk) -> None:
    o.size = 4000


def _chunk_header_bit(o: Chunk) -> None:
    o.header[codec.FS.fixed.size + len(FP.to_json()) + 9] ^= 0x01  # a key's byte


def _chunk_kind(o: Chunk) -> None:
    o.set(2, 9)


def _chunk_payload_len(o: Chunk) -> None:
    o.set(6, PAYLOAD - 8)


def _chunk_count_zero(o: Chunk) -> None:
    o.set(4, 0)


def _chunk_count_huge(o: Chunk) -> None:
    o.set(4, 4000)


def _chunk_fp_len(o: Chunk) -> None:
    o.set(5, 5000)


def _chunk_longer(o: Chunk) -> None:
    o.size += 1


def _chunk_shorter(o: Chunk) -> None:
    o.size -= PAYLOAD


CHUNK_DAMAGE: dict[str, tuple[Callable[[Chunk], None], bool, str]] = {
    "truncated": (lambda o: (setattr(o, "size", 20), o.header.__delitem__(slice(20, None))), True, "truncated"),
    "empty": (lambda o: (setattr(o, "size", 0), o.header.clear()), True, "truncated"),
    "bad_magic": (lambda o: o.header.__setitem__(0, o.header[0] ^ 1), True, "magic"),
    "foreign_version": (_chunk_version, False, "version"),
    "header_length": (_chunk_header_len, True, "out of range"),
    "header_past_end": (_chunk_header_past_end, True, "truncated"),
    "header_bit": (_chunk_header_bit, True, "header checksum"),
    "unknown_checksum_kind": (_chunk_kind, False, "cannot be verified"),
    "payload_length": (_chunk_payload_len, True, "payload length"),
    "no_blocks": (_chunk_count_zero, True, "no blocks"),
    "entries_past_header": (_chunk_count_huge, True, "out of range"),
    "fingerprint_length": (_chunk_fp_len, True, "out of range"),
    "longer": (_chunk_longer, True, "promises"),
    "shorter": (_chunk_shorter, True, "promises"),
}


@pytest.mark.parametrize("damage", sorted(CHUNK_DAMAGE))
def test_every_chunk_corruption_raises_corrupted_with_the_right_damaged(damage):
    spoil, damaged, reason = CHUNK_DAMAGE[damage]
    obj = Chunk()
    spoil(obj)
    with pytest.raises(Corrupted, match=reason) as err:
        obj.parse()
    assert err.value.damaged is damaged


def test_chunk_of_another_layout_is_foreign_and_a_flipped_field_is_caught():
    obj = Chunk()
    with pytest.raises(Corrupted, match="layout") as err:
        obj.parse(OTHER)
    assert not err.value.damaged
    obj.set(7, 48, fix_crc=False)  # a reserved field changed without the header checksum: caught
    with pytest.raises(Corrupted, match="header checksum"):
        obj.parse()


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_block_fails_only_itself(kind):
    obj = Chunk(_kind(kind))
    chunk = obj.parse()
    obj.blocks[2][77] ^= 0x08
    for i, block in enumerate(obj.blocks):
        if i == 2:
            with pytest.raises(Corrupted, match="checksum mismatch in block 2") as err:
                chunk.verify(i, [block])
            assert err.value.damaged
        else:
            chunk.verify(i, [block])


def test_v1_object_is_foreign_to_the_chunk_reader():
    v1 = Obj(codec.FS_V1)
    with pytest.raises(Corrupted, match="version 1") as err:
        codec.FS.parse(v1.header, fingerprint=FP, size=v1.size)
    assert not err.value.damaged
    with pytest.raises(Corrupted, match="magic") as err:
        codec.FS.parse(Obj(codec.LMCACHE).header + bytes(4096), fingerprint=FP, size=4096 + 64)
    assert err.value.damaged


def test_crc32c_chunk_where_crc32c_is_missing_is_foreign(monkeypatch):
    obj = Chunk(_kind("crc32c"))
    monkeypatch.setattr(checksums, "_google_crc32c", lambda: None)
    monkeypatch.setattr(checksums, "native_crc32c", lambda: None)
    with pytest.raises(Corrupted, match="cannot be verified") as err:
        obj.parse()
    assert not err.value.damaged


@pytest.mark.parametrize("kind", [codec.CRC32, codec.CRC32C])
def test_block_checksums_are_each_blocks_checksum(kind):
    """One call for every block of an object (native crc32c where built) gives what one checksum per block
    gives; a flipped byte makes that block the first bad one."""
    if kind == codec.CRC32C and not codec.have_crc32c():
        pytest.skip("crc32c cannot be computed here")
    blocks = np.random.default_rng(3).integers(0, 256, (5, 3000), dtype=np.uint8)
    sums = codec.block_checksums(kind, blocks)
    assert sums.tolist() == [codec.checksum(kind, [row]) for row in blocks]
    blocks[3, 1234] ^= 0x10
    assert codec.block_checksums(kind, blocks)[3] != sums[3]


def test_leading_matches_counts_the_checksums_that_agree_from_the_first():
    from kvbridge.codec import leading_matches

    assert leading_matches([1, 2, 3], [1, 2, 3]) == 3
    assert leading_matches([1, 9, 3], [1, 2, 3]) == 1  # a later match after a mismatch does not count
    assert leading_matches([7], [1]) == 0
    assert leading_matches([], []) == 0
    # the same answers from packed little-endian uint32s (a native read's sums beside Chunk.packed_sums)
    for got, want in (([1, 2, 3], [1, 2, 3]), ([1, 9, 3], [1, 2, 3]), ([7], [1]), ([], []), ([2**32 - 1, 5], [2**32 - 1, 6])):
        packed = [struct.pack(f"<{len(x)}I", *x) for x in (got, want)]
        assert leading_matches(*packed) == leading_matches(got, want)
