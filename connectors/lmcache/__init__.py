"""``lmcache`` — LMCache's storage backends as one more kvbridge tier (``pip install 'kvbridge[lmcache]'``).

kvbridge drives an LMCache ``StorageManager`` (LMCache 0.5.6) directly — no LMCache engine, no GPU
connector — so its local CPU arena, its local disk tier and its remote stores (the ``lm://`` server,
``redis://``, …: any ``remote_url`` LMCache understands) hold kvbridge blocks. It works alone or as a
tier of ``chain`` (e.g. ``cpu`` then ``lmcache``).

**What is shared with whom.** One ``StorageManager`` per process per set of options: every store of
this backend in a process with equal options (the scheduler side and the worker side of an engine,
several engines in a test) uses it, reference-counted, and the last one to close closes it. Its CPU
arena and its disk tier are private to that manager: LMCache indexes disk objects in memory, so
another process (or a restart) never sees them; the manager's *locators* (below) are private to it
too. Only a **remote** tier is shared across processes, and it is what makes this backend a hand-off
between engines; with the scheduler and the worker in different processes (vLLM), a lookup sees a
block only once it reached the remote tier. Without a ``remote_url`` the backend is an offload tier
for one process.

**Objects: one per chunk.** A save cuts its blocks into *chunks* as ``fs`` does: block ``i`` ends a
chunk when ``crc32(key) % C == 0`` (``C = chunk_tokens // block_size`` blocks, so chunks are ``C``
blocks long on average, as LMCache's own 256-token chunks), a property of the key alone, so every
engine and every tier of a chain cuts a prompt alike. Each run of a save's blocks inside one chunk is
one LMCache object — the whole chunk, or the part of it the save has: the prompt's last, unfinished
chunk is an object of its own (a later request for the same prompt hits all of it), and the next step
of a chunked prefill starts a new object where the last one ended (nothing is read back: the blocks
before it stay in the object of the step before). An object holds at most ``2 * C`` blocks (a
longer chunk is cut every ``2 * C`` blocks), so it fits the CPU arena, which must hold two of the
largest (:class:`~kvbridge.errors.ConfigError` at ``register`` otherwise).

An object is keyed by its **last block**: ``CacheEngineKey(model, world_size, rank, chunk_hash,
uint8)`` where ``model`` is ``<model_name>-<sha256(namespace)[:16]>-v2c<C>`` (safe for LMCache's
``@``/``%``-separated key string and its 150-character limit whatever the namespace; the format
version and ``C`` in it, so objects of format version 1 — one per block, written before — and of
another chunk size are never found: misses, never errors) and ``chunk_hash`` is that block's key
(hashed to 32 bytes when longer). The value is a uint8 tensor ``[1, 1, 1, n]`` in the chunk format
:data:`kvbridge.codec.LMCACHE_CHUNK` (version 2): a header (magic, version, checksum kind, the layout
fingerprint, per block its key and checksum, a checksum of the header itself), then the blocks, each
its bytes in every layer.

**Lookup: one** ``contains`` **per chunk.** The scheduler asks for the object keyed by each chunk's
last block (the last key asked about ends the last chunk); the first chunk that is not there is
searched by bisection for how far it goes, each probe asking whether a block is stored in *some*
object: the object ending at it, else its **locator** — this manager's map from a block to the object
holding it (written by its saves and loads, for its own tiers; bounded, the oldest forgotten first;
an entry counts only while its object is still there), or, with a remote, a 64-byte locator object
in the remote (written beside the chunk objects, for every block that does not end its object). So
a prompt that shares only part of a chunk with a stored one still hits that part, in about ``n/C +
log2(C)`` calls for ``n`` blocks. A hit says the object ending the chunk is there; a chunk split over
several objects (a long chunk, a chunked prefill) whose earlier object was evicted alone is offered
and then fails from that block (recomputed, never wrong bytes).

**Saves** allocate each object in LMCache's CPU arena and copy the blocks straight from the KV cache
into it (no staging buffer: with a KV in host memory one call on :mod:`kvbridge._core`'s native threads,
each block's crc32c taken beside its copy; else one ``index_select`` per layer into the object's
block-major view, then the checksums: ``crc32c`` where it can be computed (the native module or
``google-crc32c``), else ``crc32``), write the header, and put it at once, so LMCache's disk writer
stores one object while the next is filled.
The save then waits — bounded by ``timeout_s`` — until the disk and remote writes are done and the
remote answers for the last of them (``lm://`` puts are unacknowledged), so a consumer can see them
when the save returns. A full arena (nothing evictable) saves what fit and raises
:class:`~kvbridge.errors.StoreFull` for the rest, never waits; a remote tier that is down or dropped
writes fails the save (:class:`~kvbridge.errors.PeerUnreachable`); both are counted by the worker.

How this compares with LMCache's own engine on the same tier, in the same run, is the bench's
``lmcache:cpu`` against ``lmcache-native:cpu`` rows (and ``lmcache-native:disk`` for the disk tier):
``kvbridge bench --backends lmcache`` (:mod:`kvbridge.bench.lmcache_native`).

**Loads** find the object of each chunk (its locator, else the object ending the chunk, else the
remote locator), ``batched_get`` them from their tiers in batches that fit half the arena (LMCache
reads a disk or remote hit into the arena and, when it is full, waits for room forever), check each
header, and copy the blocks straight into the KV. With a KV in host memory and crc32c objects that is
one call on the native threads, each block's crc32c taken where it landed (as ``fs`` reads into the
KV: the blocks are the request's own, which the engine reads only after the report, and recomputes
if one failed); else each block's checksum is checked in the arena object *before* it is copied
(one copy per layer per object). A damaged block fails
from itself on: the blocks before it load, it and the blocks after it are reported failed (the
engine recomputes them), the object is counted in ``stats.corrupt`` and dropped from the tiers that
can delete (CPU, disk; the ``lm://`` server cannot). Objects of another layout are left alone. Every
object LMCache hands out is released (``ref_count_down``) whatever happens.

**Failures.** A dead remote is a miss for lookups and failed blocks for loads, never a hang: kvbridge
sets ``timeout_s`` on the ``lm://`` socket, drops a connection whose peer closed it, and reconnects at
most every ``reconnect_s`` (a bare LMCache ``StorageManager`` never does). Calls into one manager are
serialized (the ``lm://`` client multiplexes one socket without framing its replies).
"""

from __future__ import annotations

import importlib.util

from kvbridge.connectors.lmcache.options import HINT

from kvbridge.errors import MissingDependency

# find_spec costs nothing (importing LMCache takes seconds): `kvbridge backends` stays fast, and tells the truth
if importlib.util.find_spec("lmcache") is None:
    raise MissingDependency(f"the lmcache backend needs LMCache: {HINT}")

from kvbridge.connectors.lmcache.index import LMCacheIndex  # noqa: E402
from kvbridge.connectors.lmcache.manager import quiet_environment  # noqa: E402
from kvbridge.connectors.lmcache.options import FORMAT, HEADER_BYTES, MAGIC, VERSION, LMCacheOptions  # noqa: E402
from kvbridge.connectors.lmcache.store import LMCacheStore  # noqa: E402

from kvbridge import codec  # noqa: E402
from kvbridge.contract import EngineInfo  # noqa: E402
from kvbridge.options import writable_directory  # noqa: E402
from kvbridge.store import StoreBackend  # noqa: E402


class LMCacheBackend(StoreBackend):
    """The ``lmcache`` store backend: an :class:`LMCacheIndex` and :class:`LMCacheStore` s on the process's manager."""

    name = "lmcache"
    options_type = LMCacheOptions

    def __init__(self, options: LMCacheOptions):
        codec.require_checksum(options.checksum, "lmcache")
        if options.local_disk:
            writable_directory(options.local_disk, "lmcache option 'local_disk'")
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> LMCacheIndex:
        return LMCacheIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> LMCacheStore:
        return LMCacheStore(engine, self.options)


BACKEND = LMCacheBackend

__all__ = ["BACKEND", "FORMAT", "HEADER_BYTES", "MAGIC", "VERSION", "LMCacheBackend", "LMCacheIndex", "LMCacheOptions",
           "LMCacheStore", "quiet_environment"]
