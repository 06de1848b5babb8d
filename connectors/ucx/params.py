"""What crosses between the two engines and from scheduler to worker, typed and checked.

- *Transfer params* (a producer's :attr:`FinishDecision.transfer_params`, carried by a client or a P/D
  proxy to the consumer): written by :func:`handoff_params`, and every field checked by
  :func:`usable_params` before the consumer's scheduler or the wire sees it — they come from outside.
- :class:`UcxSource` — a consumer's ``BlockLoad.source``: the hand-off a load reads from.
- :class:`UcxPlan` (``StepPlan.extra["ucx"]``) and :class:`Hold` — a producer scheduler's word to its
  workers: the grant key and the requests it holds.

All frozen dataclasses of plain values, so a plan crosses processes in any encoding.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from kvbridge.connectors.ucx import onesided
from kvbridge.connectors.ucx.wire import MAX_BLOCK_ID, MAX_ID_BYTES, MAX_PULL_IDS

from kvbridge import routable
from kvbridge.contract import NULL_BLOCK

MAX_GROUPS = 16  # KV-cache groups a hand-off may name (vLLM's hybrid models have 2 or 3)

PARAMS_VERSION = 1  # transfer_params["kvbridge_version"]
PLAN = "ucx"  # StepPlan.extra key of the scheduler's UcxPlan


@dataclasses.dataclass(frozen=True)
class Hold:
    """A finished request whose blocks the engine keeps for a consumer until ``expires_at`` (wall clock)."""

    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    seal: onesided.Seal = onesided.NO_SEAL  # written into the worker's seal table while the hold lasts


@dataclasses.dataclass(frozen=True)
class UcxPlan:
    """What a producer's scheduler tells its workers each step (``StepPlan.extra["ucx"]``): the key that
    signs its grants (sent every step, so a worker can check any grant its scheduler issued, also while
    the engine is idle afterwards) and the requests it now holds (for lease expiry)."""

    grant_key: bytes
    holds: tuple[Hold, ...] = ()


@dataclasses.dataclass(frozen=True)
class UcxSource:
    """A consumer load's ``BlockLoad.source``: which producer holds the blocks and under what hand-off.

    ``remote_block_ids`` are the producer's blocks for this load's local ones, in order;
    ``metadata_addresses`` one per producer rank (empty: rank 0's ``metadata_address`` only);
    ``grant`` the producer scheduler's signature over the hand-off (empty from an older producer);
    ``seal`` what the producer's seal table holds while the hand-off lasts (:mod:`.onesided`);
    ``group_sizes`` where the engines have several KV-cache groups: how many of the load's ids (local
    and remote alike, group-major) belong to each group (empty: one group).
    """

    engine_id: str
    metadata_address: str
    metadata_addresses: tuple[str, ...]
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    expires_at: float
    grant: bytes = b""
    seal: onesided.Seal = onesided.NO_SEAL
    group_sizes: tuple[int, ...] = ()

    @classmethod
    def of(cls, params: Mapping[str, Any], remote_block_ids: tuple[int, ...], group_sizes: tuple[int, ...] = ()) -> UcxSource:
        """From :func:`usable_params`' output (already checked), for the named slice of its blocks."""
        return cls(
            engine_id=str(params["engine_id"]),
            metadata_address=str(params["metadata_address"]),
            metadata_addresses=tuple(map(str, params.get("metadata_addresses", ()))),
            remote_request_id=str(params["request_id"]),
            remote_block_ids=remote_block_ids,
            expires_at=float(params["expires_at"]),
            grant=bytes.fromhex(str(params.get("grant", ""))),
            seal=seal_of(params),
            group_sizes=group_sizes,
        )

    @property
    def addresses(self) -> tuple[str, ...]:
        """The metadata address of each producer rank, in rank order."""
        return self.metadata_addresses or (self.metadata_address,)

    @property
    def ranks(self) -> int:
        """The producer's tensor-parallel size."""
        return len(self.addresses)

    def resliced(self, world_size: int) -> bool:
        """Whether a consumer of ``world_size`` ranks cuts its blocks out of other ranks' (:func:`~kvbridge.layout.reslice`)."""
        return self.ranks != world_size


def seal_of(params: Mapping[str, Any]) -> onesided.Seal:
    """The seal in (checked) transfer params: ``"seal": [slot, "<16 hex digits>"]``, or none."""
    seal = params.get("seal")
    return (int(seal[0]), int(seal[1], 16)) if seal else onesided.NO_SEAL


def handoff_params(engine_id: str, request_id: str, block_ids: tuple[int, ...], num_tokens: int, expires_at: float,
                   grant_key: bytes, addresses: Sequence[str | None], seal: onesided.Seal = onesided.NO_SEAL,
                   groups: int = 1) -> dict[str, Any]:
    """The transfer params a producer hands out for ``request_id`` (JSON-able: they travel through clients;
    the seal's word as hex, since JSON readers elsewhere may hold integers as doubles). With several
    KV-cache groups, ``block_ids`` are group-major, ``NULL_BLOCK`` (-1) where a group kept none."""
    params: dict[str, Any] = {
        "kvbridge_version": PARAMS_VERSION,
        "engine_id": engine_id,
        "metadata_address": addresses[0],
        "request_id": request_id,
        "block_ids": list(block_ids),
        "num_tokens": num_tokens,
        "expires_at": expires_at,
        "grant": onesided.sign(grant_key, engine_id, request_id, expires_at, block_ids, seal).hex(),
    }
    if seal != onesided.NO_SEAL:
        params["seal"] = [seal[0], f"{seal[1]:016x}"]
    if groups > 1:
        params["groups"] = groups
    if len(addresses) > 1 and all(addresses):
        params["metadata_addresses"] = list(addresses)
    if any(a and routable.is_loopback(a.rpartition(":")[0]) for a in addresses):
        params["net"] = routable.net_identity()  # a consumer elsewhere refuses loopback, saying why
    return params


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_id(v: Any) -> bool:
    """An engine or request id the wire can carry: 1 to ``MAX_ID_BYTES`` bytes of utf-8."""
    try:
        return isinstance(v, str) and 0 < len(v.encode()) <= MAX_ID_BYTES
    except UnicodeEncodeError:
        return False


def _is_address(v: Any) -> bool:
    m = _HOST_PORT.fullmatch(v) if isinstance(v, str) else None
    return m is not None and 0 < int(m.group(2)) < 65536


def check_params(params: Any) -> tuple[Mapping[str, Any] | None, str]:
    """``(params, "")`` if they are transfer params this version can act on, else ``(None, why)`` — ``why``
    empty when there were none at all. They come from a client or a proxy, so every field is checked
    here, before the scheduler or the wire sees it; block ids as one array, never one by one."""
    if params is None:
        return None, ""
    if not isinstance(params, Mapping) or not _is_int(params.get("kvbridge_version")):
        return None, "not kvbridge transfer params (no kvbridge_version)"
    if params["kvbridge_version"] != PARAMS_VERSION:
        return None, f"kvbridge_version {params['kvbridge_version']}, this consumer reads {PARAMS_VERSION}"
    try:
        ids, n, expires_at = params["block_ids"], params["num_tokens"], float(params["expires_at"])
        names, address = (params["engine_id"], params["request_id"]), params["metadata_address"]
        many = params.get("metadata_addresses", ())
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        return None, f"malformed ({type(exc).__name__}: {exc})"
    groups = params.get("groups", 1)
    if not _is_int(groups) or not 1 <= groups <= MAX_GROUPS:
        return None, f"groups must be an int in 1..{MAX_GROUPS}"
    if not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= MAX_PULL_IDS or len(ids) % groups:
        return None, f"block_ids must be a list of 1 to {MAX_PULL_IDS} ids, the same number per group"
    arr = np.asarray(ids)  # object or bool dtype for anything but plain ints (floats, strings, huge ints)
    lowest = NULL_BLOCK if groups > 1 else 0  # a group may keep no block at a position (a sliding window)
    if arr.dtype.kind not in "iu" or int(arr.min()) < lowest or int(arr.max()) > MAX_BLOCK_ID:
        return None, f"block_ids must be ints in {lowest}..{MAX_BLOCK_ID}"
    if not _is_int(n) or n <= 0 or not math.isfinite(expires_at):
        return None, "num_tokens or expires_at out of range"
    if expires_at < time.time():
        return None, f"the producer's lease expired {time.time() - expires_at:.1f}s ago (its lease_s is too short for this consumer)"
    if not all(is_id(v) for v in names) or not _is_address(address):
        return None, "engine_id, request_id or metadata_address malformed"
    if not isinstance(many, (list, tuple)) or not all(_is_address(a) for a in many):
        return None, "metadata_addresses malformed"
    host = address.rpartition(":")[0]
    if not routable.loopback_reaches(host, params.get("net")):
        return None, (f"the producer advertises the loopback address {address} but runs on another host (network "
                      "namespace); set advertise_host (or leave it unset) in the producer's kv_connector_extra_config")
    grant = params.get("grant", "")
    if not isinstance(grant, str) or len(grant) > 256 or not re.fullmatch(r"(?:[0-9a-f]{2})*", grant):
        return None, "grant malformed"
    seal = params.get("seal")
    if seal is not None and not (isinstance(seal, (list, tuple)) and len(seal) == 2 and _is_int(seal[0])
                                 and 0 <= seal[0] < onesided.SEAL_SLOTS and isinstance(seal[1], str)
                                 and re.fullmatch(r"[0-9a-f]{16}", seal[1])):  # fmt: skip
        return None, "seal malformed"
    if grant and not onesided.grant_covers(bytes.fromhex(grant), ids, seal_of(params)):
        return None, "the grant does not cover these block ids and seal (altered on the way)"
    return params, ""


def usable_params(params: Any) -> Mapping[str, Any] | None:
    """``params`` if :func:`check_params` accepts them, else ``None`` (a miss)."""
    return check_params(params)[0]


__all__ = ["PARAMS_VERSION", "PLAN", "Hold", "UcxPlan", "UcxSource", "check_params", "handoff_params", "is_id", "seal_of",
           "usable_params"]
