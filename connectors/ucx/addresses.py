"""Where a producer's workers listen, so that its scheduler can name them in the transfer params.

The scheduler writes the producer worker's metadata address into the transfer params, but may live in
another process. With ``metadata_port`` set, rank ``r`` listens on ``advertise_host:metadata_port + r``
and the scheduler derives the addresses (use this across hosts, or whenever ports must be fixed). With
``metadata_port=0`` (default) each worker listens on a free port and publishes its address in a small
file ``<registry_dir>/<engine>.<rank>.json`` (and in-process), which the scheduler reads: scheduler and
workers of one engine share a host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

from kvbridge.connectors.ucx.options import UcxOptions

log = logging.getLogger(__name__)

_PUBLISHED: dict[tuple[str, str, int], str] = {}  # (registry, engine_id, rank) -> address, this process


def _registry_file(options: UcxOptions, engine_id: str, rank: int) -> Path:
    name = hashlib.sha256(engine_id.encode()).hexdigest()[:24]  # any engine id, a safe file name
    return options.registry / f"{name}.{rank}.json"


def publish(options: UcxOptions, engine_id: str, rank: int, address: str) -> None:
    """A worker's server is up: make ``address`` findable by its scheduler."""
    _PUBLISHED[(str(options.registry), engine_id, rank)] = address
    path = _registry_file(options, engine_id, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"engine_id": engine_id, "rank": rank, "address": address, "pid": os.getpid()}))
        os.replace(tmp, path)  # a reader sees the old address or the new one, never half
    except OSError as exc:  # in-process schedulers still find it; others will log the miss
        log.warning("cannot publish the metadata address in %s: %s", path, exc)


def unpublish(options: UcxOptions, engine_id: str, rank: int) -> None:
    """The worker's server stops; the file goes only if this process wrote it (a successor may have)."""
    _PUBLISHED.pop((str(options.registry), engine_id, rank), None)
    with contextlib.suppress(OSError):
        path = _registry_file(options, engine_id, rank)
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def lookup(options: UcxOptions, engine_id: str, rank: int) -> str | None:
    """The metadata address of worker ``rank`` of ``engine_id``, or ``None`` if none is published."""
    if options.metadata_port:
        return f"{options.advertised_host}:{options.metadata_port + rank}"
    found = _PUBLISHED.get((str(options.registry), engine_id, rank))
    if found:
        return found
    try:
        entry = json.loads(_registry_file(options, engine_id, rank).read_text())
    except (OSError, ValueError):
        return None
    return str(entry["address"]) if entry.get("engine_id") == engine_id else None


__all__ = ["lookup", "publish", "unpublish"]
