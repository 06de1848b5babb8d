"""The two-sided path's wire: handshake keys and the UCX control messages, struct-packed (never pickled).

A *pull* (consumer -> the producer's :func:`~kvbridge.connectors.ucx.runtime.control_tag`) names the
consumer's engine and rank, a reply serial, the producer's request and block ids, blocks per chunk and
the lease's end. The producer answers a *status* (on reply index 0) with its real bytes per block and
in all, which the consumer checks against its own layout before it takes any chunk: UCX delivers a
message shorter than the receive buffer without an error. All little-endian.

The limits here also bound what transfer params may name (:mod:`kvbridge.connectors.ucx.params`): a
hand-off the wire cannot carry is a miss at lookup, not a failure later.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from kvbridge.errors import ProtocolError

WORKER_ADDRESS = "ucx_worker_address"  # PeerInfo.transport keys
CONTROL_TAG = "ucx_control_tag"  # 8 bytes, little-endian: where the producer takes pulls

_MAGIC = b"KVBU"
_WIRE_VERSION = 2  # 2: the status names the producer's bytes per block and in all
_PULL = struct.Struct("<4sBBHHHIIQd")  # magic, version, kind, len(engine), len(request), rank, n_ids, blocks/chunk, serial, expires_at
# magic, version, code, len(reason), n_chunks, bytes per block (all layers), bytes in all; then the reason (utf-8)
_STATUS = struct.Struct("<4sBBHIQQ")
_KIND_PULL, _KIND_STOP = 1, 2
OK, REFUSED = 0, 1
STATUS_BYTES = 512
MAX_PULL_IDS = 250_000  # one pull's block ids fit a 1 MiB control message (4M tokens at block size 16)
MAX_ID_BYTES = 256  # an engine or request id in a pull, utf-8
MAX_BLOCK_ID = 2**31 - 1  # block ids travel as int32
CONTROL_BYTES = _PULL.size + 2 * MAX_ID_BYTES + 4 * MAX_PULL_IDS


@dataclasses.dataclass(frozen=True)
class Pull:
    """A consumer's request for ``block_ids`` of the producer's ``request_id``."""

    engine_id: str
    rank: int
    request_id: str
    block_ids: np.ndarray
    blocks_per_chunk: int
    serial: int
    expires_at: float

    def encode(self) -> bytes:
        e, r = self.engine_id.encode(), self.request_id.encode()
        head = _PULL.pack(_MAGIC, _WIRE_VERSION, _KIND_PULL, len(e), len(r), self.rank, len(self.block_ids),
                          self.blocks_per_chunk, self.serial, self.expires_at)
        return head + e + r + np.asarray(self.block_ids, dtype="<i4").tobytes()

    @classmethod
    def decode(cls, data: memoryview) -> Pull:
        """Raises :class:`Stop` for the stop message, :class:`ProtocolError` (or a decode error) for junk."""
        if len(data) < _PULL.size:
            raise ProtocolError("pull message too short")
        magic, version, kind, ne, nr, rank, n, per, serial, expires = _PULL.unpack_from(data)
        if magic == _MAGIC and version == _WIRE_VERSION and kind == _KIND_STOP:
            raise Stop
        if magic != _MAGIC or version != _WIRE_VERSION or kind != _KIND_PULL or not 0 < n <= MAX_PULL_IDS or per < 1:
            raise ProtocolError(f"malformed pull message (magic {magic!r}, version {version}, kind {kind}, {n} ids)")
        off = _PULL.size
        engine_id, request_id = bytes(data[off:off + ne]).decode(), bytes(data[off + ne:off + ne + nr]).decode()
        ids = np.frombuffer(data, dtype="<i4", count=n, offset=off + ne + nr).astype(np.int64)
        return cls(engine_id, rank, request_id, ids, per, serial, expires)


class Stop(Exception):
    """The control message a producer sends itself to end its control loop."""


STOP_MESSAGE = np.frombuffer(_PULL.pack(_MAGIC, _WIRE_VERSION, _KIND_STOP, 0, 0, 0, 0, 0, 0, 0.0), dtype=np.uint8)


def status(code: int, n_chunks: int, reason: str = "", block_bytes: int = 0, total_bytes: int = 0) -> np.ndarray:
    """The producer's answer to a pull, padded to :data:`STATUS_BYTES` (the consumer's receive buffer)."""
    text = reason.encode()[: STATUS_BYTES - _STATUS.size]
    out = np.zeros(STATUS_BYTES, dtype=np.uint8)
    head = _STATUS.pack(_MAGIC, _WIRE_VERSION, code, len(text), n_chunks, block_bytes, total_bytes)
    out[: _STATUS.size + len(text)] = np.frombuffer(head + text, np.uint8)
    return out


def read_status(buf: np.ndarray) -> tuple[int, int, int, int, str]:
    """``(code, n_chunks, bytes per block, bytes in all, reason)`` of a status message."""
    magic, version, code, n, n_chunks, block_bytes, total = _STATUS.unpack_from(buf.tobytes())
    if magic != _MAGIC or version != _WIRE_VERSION:
        raise ProtocolError(f"malformed status message from the producer (wire version {version}, ours {_WIRE_VERSION})")
    return code, n_chunks, block_bytes, total, bytes(buf[_STATUS.size:_STATUS.size + n]).decode(errors="replace")


def check_status(buf: np.ndarray, producer: str, n_chunks: int, block_bytes: int, n_blocks: int) -> None:
    """The producer's answer to a pull must accept it and announce ``n_chunks`` chunks of ``n_blocks`` blocks
    of ``block_bytes`` each: a short chunk would arrive without an error."""
    code, chunks, theirs, total, reason = read_status(buf)
    if code != OK:
        raise ProtocolError(f"producer {producer} refused the pull: {reason}")
    if chunks != n_chunks:
        raise ProtocolError(f"producer announced {chunks} chunks, expected {n_chunks}")
    if theirs != block_bytes or total != block_bytes * n_blocks:
        raise ProtocolError(f"producer {producer} sends {theirs}-byte blocks ({total} bytes in all); "
                            f"ours are {block_bytes} bytes: its layout is not the one it announced")


__all__ = [
    "CONTROL_BYTES", "CONTROL_TAG", "MAX_BLOCK_ID", "MAX_ID_BYTES", "MAX_PULL_IDS", "OK", "REFUSED", "STATUS_BYTES",
    "STOP_MESSAGE", "WORKER_ADDRESS", "Pull", "Stop", "check_status", "read_status", "status",
]
