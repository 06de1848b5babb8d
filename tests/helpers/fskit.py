"""Helpers the ``fs`` store's tests share (tests/test_fs*.py): engines on one directory, prompts whose chunks
have a wanted shape, and reading an object's header as the format documents it (:mod:`kvbridge.codec`)."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvbridge.connectors import fs
from kvbridge.connectors.fs import HEADER_BYTES, FsStore

import kvbridge
from kvbridge.keys import block_keys
from kvbridge.testing import MiniEngine

FIXED = struct.Struct("<8sHHIHHQIII")  # the documented header: magic, version, kind, header len, count, fp len, payload, 0, crc, 0
ENTRY = struct.Struct("<IH")  # per block: checksum, key length (the key follows)


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def keys_of(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, 16, namespace="mini")  # MiniEngine's


def chunk_lengths_of(keys: list[bytes]) -> list[int]:
    """The lengths of the chunks fs cuts ``keys`` into, 16 blocks each on average."""
    return fs.chunk_lengths(keys, 16)


def prompt_with(n: int, want: Callable[[list[int]], bool], seed: int = 0) -> list[int]:
    """Tokens of ``n`` blocks (and 3 more) whose chunk lengths satisfy ``want`` (the first such seed from ``seed``)."""
    while True:
        tokens = random_tokens(n * 16 + 3, seed)
        if want(chunk_lengths_of(keys_of(tokens))):
            return tokens
        seed += 1


def fs_pair(root: Path, *, num_blocks: int = 64, **options: object) -> tuple[MiniEngine, MiniEngine]:
    opts = {"path": str(root), **options}
    producer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="p", role="producer", seed=1, num_blocks=num_blocks)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, num_blocks=num_blocks)
    return producer, consumer


def store_of(engine: MiniEngine) -> FsStore:
    store = engine.worker.io  # type: ignore[attr-defined]
    assert isinstance(store, FsStore)
    return store


def index_of(engine: MiniEngine) -> fs.FsIndex:
    index = engine.scheduler.index  # type: ignore[attr-defined]
    assert isinstance(index, fs.FsIndex)
    return index


def objects_in(root: Path) -> list[Path]:
    """The objects under ``root`` (regular files; the links to them left out)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def links_in(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_symlink())


def object_of(store: FsStore, key: bytes) -> Path:
    """The object holding ``key``'s block (its locator, followed)."""
    return Path(os.path.realpath(store.path_of(key)))


def read_header(path: Path) -> tuple[tuple[int, ...], list[tuple[int, bytes]], bytes]:
    """(fixed fields, [(checksum, key)] per block, fingerprint JSON) of an object, read as documented."""
    data = path.read_bytes()
    fixed = FIXED.unpack_from(data)
    fp_len, count = fixed[5], fixed[4]
    at = FIXED.size + fp_len
    entries = []
    for _ in range(count):
        crc, key_len = ENTRY.unpack_from(data, at)
        at += ENTRY.size
        entries.append((crc, data[at : at + key_len]))
        at += key_len
    return fixed, entries, data[FIXED.size : FIXED.size + fp_len]


def block_offset(path: Path, i: int) -> int:
    fixed = FIXED.unpack_from(path.read_bytes())
    return fixed[3] + i * fixed[6]


def block_of(store: FsStore, key: bytes) -> tuple[Path, int]:
    """(the object holding ``key``'s block, where that block starts in it)."""
    obj = object_of(store, key)
    pos = [k for _, k in read_header(obj)[1]].index(key)
    return obj, block_offset(obj, pos)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x04]))


def flip_payload(path: Path) -> None:
    """A bit of block 0's payload, past the header."""
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 777] ^= 0x10
    path.write_bytes(bytes(data))
