"""``fs`` — a shared-filesystem store: one file per *chunk* (a run of consecutive blocks of a prompt,
``chunk_tokens`` tokens on average, as LMCache's chunks) per (namespace, rank), under a directory.

The directory (local disk, NFS, Lustre, tmpfs) may be shared by any number of producer and consumer
processes on any number of machines. **Where chunks end is a property of the blocks' keys**: block
``i`` ends a chunk when ``crc32(key) % C == 0`` (``C = chunk_tokens // block_size`` blocks, so chunks
are ``C`` blocks long on average; the last chunk of a prompt ends with it). Keys are chained over the
whole prefix, so every engine cuts a prompt the same way without knowing where a list of keys starts
in its prompt — a tier of a ``chain`` asked about a prompt's tail finds the same chunks as an engine
asked about the whole prompt. Every stored block has a *locator*, a file name derived from its key
alone::

    <path>/<sha256(namespace)[:16]>/tp<T>.<rank>/v2-<C>/<name[:2]>/<name>     name = key.hex() (or a hash, see below)

``tp<T>.<rank>`` names the shard: rank ``rank`` of ``T`` tensor-parallel ranks (``tp1.0`` for every rank of
an engine whose ranks all hold the same KV, MLA's latent cache: rank 0 writes it, every rank reads it).
A consumer of another TP size finds the shards of the ``T`` its lookup saw and cuts its heads out of
them (:func:`kvbridge.layout.reslice`): each of its ranks reads the objects of every producer rank
that holds some of its heads, and only the blocks all of those hold arrive.

so a key, whatever its bytes, names a file of hex digits under the root and can never escape it. The
locator of a chunk's *last* block is the chunk's object itself; the locators of its other blocks are
symbolic links to it (``../<name[:2]>/<name>``). Every object starts where its chunk starts, so
following any locator reaches an object holding that block and every block of its chunk before it:

- **lookup** stats one locator per chunk — its last block's, which exists only if the whole chunk
  does — and, in the first chunk that is not whole, finds how far it goes by bisection (a prompt that
  shares only part of a chunk with a stored one still hits that part): about ``n/C + log2(C)`` stats
  for ``n`` blocks (5 for a 1024-token prompt in 256-token chunks) instead of one per block;
- **loads** open one locator per object they read, whatever block the load starts at.

A save that starts inside a chunk (the next step of a chunked prefill) reads the chunk's first blocks
back from their object (checked) and writes the chunk again, whole up to where it has blocks. Which
blocks those are, the scheduler side tells the worker (:class:`FsSave`, in ``BlockSave.target``):
after the request's previous save, or where its lookup's hit ended. Where they are not in the store
(a tier of a chain whose hit ended inside a chunk another tier served), the rest of that chunk is not
written. One case it cannot see: a chain's tier asked about a prompt's tail (``keys[pos:]``) that
holds none of it takes that tail for a whole prompt, so the request's next save there may start an
object inside a chunk; a later lookup of the whole prompt by another engine may then offer blocks of
that chunk this store lacks — a failed load, recomputed, never wrong bytes.

**Object format**: :data:`kvbridge.codec.FS` (version 2; :mod:`kvbridge.codec` has the byte layout)
— a header (magic, version, checksum kind, the layout fingerprint, and per block its key and
checksum; :data:`HEADER_BYTES` long unless the keys need more, always a multiple of 4096), then the
blocks, each its bytes in every layer, layer after layer. A reader checks the header (its own
checksum included), that the object has exactly the promised length, that it holds the key it was
reached by, and each block's checksum *before that block counts as loaded*: a damaged block fails
from itself on (the blocks before it load; it and those after it are reported failed, so the engine
recomputes them over whatever landed there), is counted in ``stats.corrupt`` and logged, and its
object is deleted so the next producer rewrites it. Objects of another version or layout are
left alone (another engine may own them). **Version 1 objects** (one file per block, written before)
live outside the ``v2-<C>`` folders: today's readers never look at them (a miss, never an error) and
eviction removes them, oldest first, like any object.

**Moving bytes.** A save checksums each block straight from the KV cache and writes it from there
(``pwritev`` of the per-layer pieces: no staging copy). A load reads each block straight into its
block of the KV (``preadv`` into the per-layer pieces: the kernel's copy is the only one) and checks
it there. The block is the request's own, which the engine reads only after the load reports, and
recomputes if the check failed — as a one-sided ucx read lands before its seal is checked. (Reading
into a thread's buffer, checking, then copying into the KV would copy every byte twice; bench: ``fs
load 8b 1024tok``.) With crc32c objects and kvbridge's native module built, a load's blocks and a
save's (a window of objects) go to its ``file_start`` in one call: ``preadv``/``pwritev`` of each
block's pieces and the block's crc32c beside, on the native threads, blocks cut between them, no
Python per block (a Python thread per stretch of blocks adds a hand-off per stretch, which in a small
load weighs as much as the read; bench: ``fs load 8b 64tok``); a KV on a GPU through pinned staging.
Elsewhere ``io_threads`` threads share a load's or a save's blocks: a KV on a GPU, one whose blocks
are not contiguous, or ``o_direct`` (aligned buffers) goes through a per-thread buffer, then the KV
or a staging buffer and one scatter. Which of these routes a load or a save takes is decided once,
before any file is opened (:mod:`kvbridge.connectors.fs.plan`). ``o_direct=True`` opens objects with ``O_DIRECT`` (past the page cache: NVMe, parallel
filesystems), through page-aligned buffers; a filesystem that refuses it is a
:class:`~kvbridge.errors.ConfigError` at start-up. (A layout whose block is not a multiple of 4096
bytes writes through the page cache even then; every real model's is.)

**Concurrency.** A writer writes a private temporary file in the object's directory and
``os.replace``\\ s it into place, which is atomic on POSIX filesystems (NFS and Lustre included), so a
reader sees the old object, the new one or none — never half of one; links are made the same way.
Writers of the same chunk write the same bytes, and whichever renames last wins. Readers that opened
an object keep reading it even if it is replaced or evicted meanwhile.

**Durability.** With ``fsync=False`` (the default) an object survives its writer's process dying,
not the machine losing power (the page cache may still hold it); a half-written object is never
visible either way. ``fsync=True`` flushes each object and its directory before the save returns:
slower (a flush per object and per directory), needed only where the cache must outlive a machine crash. (Links
are not flushed: one lost in a crash makes its block a miss.)

**Capacity.** With ``capacity_bytes`` set, a save that would push the directory past it first
deletes the oldest objects (by mtime: first saved, first evicted; a save that finds its chunk already
present refreshes that mtime) down to 90% of the capacity, so scans stay rare; links left pointing
nowhere are misses and are removed by the same scans. Usage is an estimate per process, refreshed by
a scan whenever it crosses the capacity: several writers may overshoot it by what they wrote between
scans. A full filesystem (``ENOSPC``) fails that save with :class:`~kvbridge.errors.StoreFull`; the
chunks it published before are kept, and nothing already stored is lost.

**Modules**: :mod:`~.naming` (file names, chunks, shards), :mod:`~.index` (the scheduler side),
:mod:`~.plan` (a load's and a save's route), :mod:`~.read`, :mod:`~.write`, :mod:`~.evict` (publishing,
links, damaged objects, capacity), :mod:`~.files` (file IO and threads), :mod:`~.native` (the one
place ``fs`` obtains the native module), :mod:`~.store` (the worker side, tying them together).
"""

from __future__ import annotations

from kvbridge.connectors.fs.files import probe_o_direct
from kvbridge.connectors.fs.index import FsIndex
from kvbridge.connectors.fs.naming import (
    _FIXED,
    FORMAT,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    chunk_blocks,
    chunk_end,
    chunk_ends,
    chunk_lengths,
    ends_chunk,
    object_name,
)
from kvbridge.connectors.fs.options import FsLoad, FsOptions, FsSave
from kvbridge.connectors.fs.store import FsStore

from kvbridge import codec
from kvbridge.contract import EngineInfo
from kvbridge.options import writable_directory
from kvbridge.store import StoreBackend


class FsBackend(StoreBackend):
    """The ``fs`` store backend: an :class:`FsIndex` for the scheduler, an :class:`FsStore` per worker."""

    name = "fs"
    options_type = FsOptions

    def __init__(self, options: FsOptions):
        codec.require_checksum(options.checksum, "fs")
        writable_directory(options.path, "fs option 'path'")
        if options.o_direct:
            probe_o_direct(options.path)
        super().__init__(options)

    def open_index(self, engine: EngineInfo) -> FsIndex:
        return FsIndex(engine, self.options)

    def open_io(self, engine: EngineInfo) -> FsStore:
        return FsStore(engine, self.options)


BACKEND = FsBackend

__all__ = [
    "BACKEND",
    "FORMAT",
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "_FIXED",
    "FsBackend",
    "FsIndex",
    "FsLoad",
    "FsOptions",
    "FsSave",
    "FsStore",
    "chunk_blocks",
    "chunk_end",
    "chunk_ends",
    "chunk_lengths",
    "ends_chunk",
    "object_name",
    "probe_o_direct",
]
