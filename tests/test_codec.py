"""The block-object codec (kvbridge/codec.py): both formats round-trip, keep their documented byte
layouts (objects stored before stay readable), and every kind of damage raises ``Corrupted`` with
the right ``damaged``."""

from __future__ import annotations

import hashlib
import pickle
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from kvbridge import codec
from kvbridge.errors import Corrupted, KVBridgeError, MissingDependency
from kvbridge.layout import LayoutFingerprint

FP = LayoutFingerprint(dtype="bfloat16", num_layers=3, num_kv_heads=2, head_size=8, block_size=4, block_bytes=128, kv_format="blocks_first")
OTHER = LayoutFingerprint(dtype="bfloat16", num_layers=3, num_kv_heads=4, head_size=4, block_size=4, block_bytes=128, kv_format="blocks_first")
KEY = bytes(range(16))
FORMATS = {"fs": codec.FS, "lmcache": codec.LMCACHE}
KINDS = ["crc32", "crc32c"]


def _kind(name: str) -> int:
    if name == "crc32c" and not codec.have_crc32c():
        pytest.skip("crc32c needs google-crc32c")
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
def test_fs_header_is_the_documented_layout(kind):
    k = _kind(kind)
    obj = Obj(codec.FS, k)
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
    if codec.have_crc32c():
        import google_crc32c

        assert codec.checksum(codec.CRC32C, parts) == google_crc32c.value(data.tobytes())
    with pytest.raises(ValueError, match="kind"):
        codec.checksum(7, parts)


def test_a_key_too_long_for_the_header_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        Obj(codec.FS, key=b"k" * 4096)
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
    fs = Obj(codec.FS)
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
    fs = Obj(codec.FS)
    with pytest.raises(Corrupted, match="magic") as err:
        codec.LMCACHE.check(fs.header, key=KEY, fingerprint=FP, parts=fs.rows(), size=fs.size)
    assert err.value.damaged


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_crc32c_object_where_crc32c_is_missing_is_foreign(fmt, monkeypatch):
    obj = Obj(FORMATS[fmt], _kind("crc32c"))
    monkeypatch.setattr(codec, "_google_crc32c", lambda: None)
    assert not codec.have_crc32c() and codec.default_checksum() == "crc32"
    with pytest.raises(Corrupted, match="cannot be verified") as err:
        obj.check()
    assert not err.value.damaged
    with pytest.raises(MissingDependency, match="pip install google-crc32c"):
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
