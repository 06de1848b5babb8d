"""The lmcache tier's worker side: chunk objects in and out of LMCache (the package docstring's saves and loads)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from kvbridge.connectors.fs import chunk_end, chunk_ends
from kvbridge.connectors.lmcache.manager import Manager
from kvbridge.connectors.lmcache.options import (
    DELETABLE,
    FORMAT,
    LOCATOR,
    LOCATOR_MAGIC,
    MAX_LOCATORS,
    REMOTE,
    VERSION,
    LMCacheOptions,
)
from kvbridge.connectors.lmcache.side import Side

from kvbridge import codec, native
from kvbridge.contract import BlockLoad, BlockSave, EngineInfo
from kvbridge.errors import ConfigError, Corrupted, PeerUnreachable, StoreFull
from kvbridge.layout import KVLayout, block_words, coalesce, packed_offsets
from kvbridge.staging import StagingPool
from kvbridge.store import StoreIO

log = logging.getLogger(__name__)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layer_views(layout: KVLayout) -> list[torch.Tensor] | None:
    """Per layer, a view ``[num_blocks, ...]`` of the KV that moves a block as plain integers: rows of int64
    words where a block is one stretch of memory (faster copies), else the block's own shape as integers of
    the element's width (``kv_first``: K and V apart). ``None`` for a KV that is not in host memory."""
    if layout.device_type != "cpu":
        return None
    views = []
    for v in layout.layers:
        rows = block_words(v)
        if rows is None:
            bits = _BITS[v.element_size()]
            rows = v if v.dtype == bits else v.view(bits)
        views.append(rows)
    return views


def _object_side(kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (uint8 ``[k, block_bytes]``, one layer's bytes of ``k`` blocks in an object, rows may be
    apart) viewed to match ``kv`` (a :func:`_layer_views` entry): the same dtype and block shape."""
    return blocks.view(kv.dtype).view(blocks.shape[0], *kv.shape[1:])


@dataclasses.dataclass
class _Want:
    """An object a load reads: its key and tier, the load's block ``at`` it should hold, how many blocks of
    the load it should hold from there, its size at most, and whether it was found by the chunk's end alone."""

    key: Any
    tier: str
    at: int
    count: int
    nbytes: int
    by_end: bool


class LMCacheStore(Side, StoreIO):
    """Worker side: chunk objects in and out of LMCache. See the module docstring."""

    def __init__(self, engine: EngineInfo, options: LMCacheOptions):
        StoreIO.__init__(self, engine)
        Side.__init__(self, engine, options)
        self._kind = codec.CHECKSUMS[options.checksum]
        self._staging = StagingPool()  # a KV that is not in host memory: gathered and scattered through host buffers
        self._views: tuple[KVLayout, list[torch.Tensor] | None] | None = None
        self._native = native.load_core()[0]  # kvbridge._core where built: a KV in host memory copied by address

    # -- geometry ------------------------------------------------------------------------------------
    def attach(self, layout: KVLayout) -> None:
        biggest = self._object_bytes(layout, self.max_blocks)
        if 2 * biggest > self.options.local_cpu_bytes or biggest >= 1 << 31:
            raise ConfigError(
                f"lmcache: an object holds up to {self.max_blocks} blocks ({biggest} bytes: chunk_tokens="
                f"{self.options.chunk_tokens}, block_size={layout.fingerprint.block_size}); local_cpu_bytes="
                f"{self.options.local_cpu_bytes} must hold two (raise it, or lower chunk_tokens), and LMCache's wire "
                "format stays under 2 GiB"
            )
        payload = layout.num_layers * layout.block_bytes
        local = (self.options.local_cpu_bytes if self.options.cpu_cache else 0) + self.options.local_disk_bytes
        m = self._open()
        with m.lock:  # room for a locator per block the local tiers can hold, twice over
            m.where_cap = max(m.where_cap, min(MAX_LOCATORS, 2 * local // max(1, payload)))
        self._layer_views(layout)

    def _layer_views(self, layout: KVLayout) -> list[torch.Tensor] | None:
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, _layer_views(layout))
        return self._views[1]

    @staticmethod
    def _object_bytes(layout: KVLayout, blocks: int) -> int:
        """The most bytes an object of ``blocks`` blocks takes (keys of up to 64 bytes)."""
        return FORMAT.header_length([bytes(64)] * blocks, layout.fingerprint) + blocks * layout.num_layers * layout.block_bytes

    def _pieces(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """The objects a save of ``keys`` writes, as ``[a, b)`` ranges: cut where a block ends a chunk, every
        :attr:`max_blocks` blocks, and at the end."""
        out = []
        a = 0
        for end in chunk_ends(keys, self.chunk):
            while a <= end:  # a chunk longer than max_blocks is cut into several objects
                b = min(end + 1, a + self.max_blocks)
                out.append((a, b))
                a = b
        return out

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, op: BlockSave, layout: KVLayout) -> None:
        if not op.keys:
            return
        ids = layout.check_range(op.block_ids)
        if self._layer_views(layout) is None:  # not in host memory: gathered over once, copied from there
            with self._staging.gathered(layout, op.block_ids) as host:
                self._store(op, layout, ids, host)
        else:
            self._store(op, layout, ids, None)

    def _store(self, op: BlockSave, layout: KVLayout, ids: np.ndarray, host: torch.Tensor | None) -> None:
        lkeys = [self.lmcache_key(k) for k in op.keys]
        pieces = self._pieces(op.keys)
        with self._session() as m:
            up = m.remote is None or m.remote.connection is not None
            failed_before = m.remote.put_failed_count if m.remote is not None else 0
            put: list[int] = []  # pieces handed to LMCache (it owns those objects now)
            try:
                for p, (a, b) in enumerate(pieces):
                    obj = self._allocate(m, FORMAT.header_length(op.keys[a:b], layout.fingerprint) + (b - a) * layout.num_layers
                                         * layout.block_bytes)
                    if obj is None and put:  # the arena is full of this save's writes: let them land, then retry
                        m.drain([lkeys[pieces[q][1] - 1] for q in put])
                        obj = self._allocate(m, FORMAT.header_length(op.keys[a:b], layout.fingerprint)
                                             + (b - a) * layout.num_layers * layout.block_bytes)
                    if obj is None:
                        raise StoreFull(
                            f"lmcache: CPU arena ({self.options.local_cpu_bytes} B) has no room for an object of {b - a} "
                            f"blocks; saved {a} of {len(op.keys)} blocks of {op.request_id}"
                        )
                    try:
                        self._fill(obj, op.keys[a:b], ids[a:b], layout, None if host is None else host[:, a:b])
                    except BaseException:
                        obj.ref_count_down()
                        raise
                    m.sm.batched_put([lkeys[b - 1]], [obj])  # at once: LMCache writes it while the next is filled
                    put.append(p)
            finally:
                ends = [lkeys[pieces[q][1] - 1] for q in put]
                if ends:
                    m.drain(ends)
                    # A finished put was only *sent*: the lm:// protocol has no acknowledgement, and a reader on
                    # another connection could ask before the server took it. The server answers one connection in
                    # order, so a lookup of the last key on ours returns once every put before it landed.
                    self._locate_saved(m, [pieces[q] for q in put], op.keys, lkeys)
            if m.remote is not None and (not up or m.remote.connection is None or m.remote.put_failed_count > failed_before):
                raise PeerUnreachable(f"lmcache remote {self.options.remote_url} did not take the blocks of {op.request_id}")

    def _allocate(self, m: Manager, nbytes: int) -> Any:
        return m.sm.allocate(torch.Size([1, 1, 1, nbytes]), torch.uint8, fmt=self._lib.KV_2LTD, eviction=True, busy_loop=False)

    def _fill(self, obj: Any, keys: Sequence[bytes], ids: np.ndarray, layout: KVLayout, host: torch.Tensor | None) -> None:
        """Write blocks ``ids`` (keys ``keys``) into ``obj``: straight from the KV (or ``host``), then their
        checksums and the header."""
        k, payload = len(keys), layout.num_layers * layout.block_bytes
        flat = obj.tensor.view(-1)
        start = FORMAT.header_length(keys, layout.fingerprint)
        body = flat[start : start + k * payload].view(k, layout.num_layers, layout.block_bytes)
        views = self._layer_views(layout)
        checked = None  # each block's crc32c, where the native copy took it
        if host is not None or views is None:
            assert host is not None
            body.copy_(host.transpose(0, 1))
        elif (checked := self._native_copy(layout, ids, body.data_ptr(), into_object=True,
                                           checked=self._kind == codec.CRC32C)) is None:  # fmt: skip
            runs = coalesce(ids)
            idx = None if len(runs) == 1 else torch.from_numpy(ids)
            for layer, kv in enumerate(views):
                dst = _object_side(kv, body[:, layer])
                if idx is None:
                    dst.copy_(kv.narrow(0, runs[0][0], k))
                else:
                    torch.index_select(kv, 0, idx, out=dst)
        arr = flat.numpy()
        if checked is None or not len(checked):
            checked = codec.block_checksums(self._kind, arr[start : start + k * payload].reshape(k, payload))
        sums = checked.tolist()
        arr[:start] = np.frombuffer(FORMAT.pack(keys, layout.fingerprint, sums, self._kind), dtype=np.uint8)

    def _locate_saved(self, m: Manager, pieces: Sequence[tuple[int, int]], keys: Sequence[bytes], lkeys: Sequence[Any]) -> None:
        """After a save's puts: this manager's locators for its blocks, and the remote's (then the remote's
        answer for the last of them, which comes once every put before it landed)."""
        local = [name for name in m.sm.storage_backends if name != REMOTE]
        for a, b in pieces:
            obj_key = lkeys[b - 1]
            if m.where.keys().isdisjoint(lkeys[a:b]):  # the common case, blocks no object held: one update in C
                m.where.update(zip(lkeys[a:b], zip(itertools.repeat(obj_key), itertools.repeat(b - a), range(b - a))))
                continue
            for pos in range(b - a):
                held = m.where.get(lkeys[a + pos])
                if held is not None and held[0] != obj_key and local and m.sm.contains(held[0], search_range=local) is not None:
                    continue  # it is in an object that is still here (LMCache keeps the first object put under a key)
                m.where[lkeys[a + pos]] = (obj_key, b - a, pos)
                m.where.move_to_end(lkeys[a + pos])
        while len(m.where) > m.where_cap:
            m.where.popitem(last=False)
        last = lkeys[pieces[-1][1] - 1]
        if not self._remote_up(m):
            return
        locators, objs = [], []
        try:
            for a, b in pieces:
                chunk = self._hash(keys[b - 1])
                for pos in range(b - a - 1):  # the block ending an object is found by the object itself
                    obj = self._allocate(m, LOCATOR.size)
                    if obj is None:
                        break
                    objs.append(obj)
                    raw = LOCATOR.pack(LOCATOR_MAGIC, VERSION, b - a, pos, len(chunk), codec.key_digest(keys[a + pos]), chunk)
                    obj.tensor.view(-1).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
                    locators.append(self.locator_key(keys[a + pos]))
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        if locators:
            m.sm.batched_put(locators, objs, location=REMOTE)
            m.drain(locators)
            last = locators[-1]
        if self._remote_up(m) and m.sm.contains(last, search_range=[REMOTE]) is None:
            raise PeerUnreachable(f"lmcache remote {m.options.remote_url} does not hold what was just put")

    # -- loads ---------------------------------------------------------------------------------------
    def load(self, op: BlockLoad, layout: KVLayout) -> Sequence[int]:
        if not op.keys:
            return op.block_ids
        ids = layout.check_range(op.block_ids)
        if self._layer_views(layout) is None:  # not in host memory: through a host buffer, one scatter at the end
            with self._staging.lend(layout, len(ids)) as host:
                good = self._fetch(op, layout, ids, host)
                if good:
                    layout.scatter(op.block_ids[:good], host[:, :good].to(layout.device))
        else:
            good = self._fetch(op, layout, ids, None)
        return op.block_ids[good:]

    def _find(self, m: Manager, keys: Sequence[bytes], i: int, tried: set[int], layout: KVLayout) -> _Want | None:
        """The object to read block ``keys[i]`` of a load from: its locator's, else the one ending its chunk."""
        held = m.where.get(self.lmcache_key(keys[i]))
        if held is None or m.sm.contains(held[0]) is None:
            held = None
            if i not in tried:
                end = chunk_end(keys, i, self.chunk)
                key = self.lmcache_key(keys[end])
                tier = m.sm.contains(key)
                if tier is not None:
                    return _Want(key, tier, i, end - i + 1, self._object_bytes(layout, self.max_blocks), True)
            held = self._holder(m, keys[i])
            if held is None:
                return None
        key, count, pos = held
        tier = m.sm.contains(key)
        if tier is None:
            return None
        return _Want(key, tier, i, max(1, min(count - pos, len(keys) - i)), self._object_bytes(layout, count), False)

    def _fetch(self, op: BlockLoad, layout: KVLayout, ids: np.ndarray, host: torch.Tensor | None) -> int:
        """Copy the blocks of ``op`` that pass their checks into the KV (or ``host``), from the first; how many."""
        # LMCache reads a disk or remote hit into its CPU arena and, when the arena is full, waits for room
        # forever: fetch in batches that fit in half of it, and give each batch back before the next.
        budget = self.options.local_cpu_bytes // 2
        n, good = len(op.keys), 0
        tried: set[int] = set()  # blocks the object ending their chunk turned out not to hold
        with self._session() as m:
            for _ in range(2 * n + 2):  # each round loads a block, or rules a way to one out, or ends
                if good >= n:
                    break
                plan: list[_Want] = []
                used, i = 0, good
                while i < n:
                    want = self._find(m, op.keys, i, tried, layout)
                    if want is None or (plan and used + want.nbytes > budget):
                        break
                    plan.append(want)
                    used += want.nbytes
                    i += want.count
                if not plan:
                    break
                got: list[Any] = []
                try:
                    for tier, group in _runs(plan):  # one batched_get per run of objects in the same tier
                        objs = m.sm.batched_get([w.key for w in group], location=tier) or []
                        got.extend([*objs, *[None] * (len(group) - len(objs))][: len(group)])
                    go_on = True
                    for want, obj in zip(plan, got):
                        if want.at != good:  # an object held fewer of the load's blocks than its locator said
                            break
                        if obj is None:  # gone since it was found (evicted, a dead remote)
                            go_on = False
                            break
                        taken, go_on = self._take(m, want, obj, op, layout, ids, host, tried)
                        good += taken
                        if not go_on or taken < want.count:
                            break
                finally:
                    for obj in got:
                        if obj is not None:
                            obj.ref_count_down()
                if not go_on:
                    break
        return good

    def _take(self, m: Manager, want: _Want, obj: Any, op: BlockLoad, layout: KVLayout, ids: np.ndarray,
              host: torch.Tensor | None, tried: set[int]) -> tuple[int, bool]:
        """Check object ``obj`` and copy the load's blocks it holds from ``want.at`` on; ``(blocks copied,
        whether the load may go on)``."""
        i = want.at
        try:
            t = obj.tensor
            if t is None or t.dtype != torch.uint8 or not t.is_contiguous():
                raise Corrupted(f"not a kvbridge object ({None if t is None else (t.dtype, tuple(t.shape))})", damaged=True)
            flat = t.view(-1)
            arr = flat.numpy()
            size = int(flat.numel())
            length = FORMAT.header_bytes(arr[: min(size, codec.MAX_HEADER)], size)
            chunk = FORMAT.parse(arr[:length], fingerprint=layout.fingerprint, size=size)
            if self.lmcache_key(chunk.keys[-1]) != want.key:
                raise Corrupted("object holds another key", damaged=True)
        except Corrupted as bad:
            self._reject(m, want.key, want.tier, bad)
            return 0, False
        m.remember(want.key, [self.lmcache_key(k) for k in chunk.keys])
        key = op.keys[i]
        if key not in chunk.keys:  # an object of a later part of the chunk: the block is elsewhere, or nowhere
            if want.by_end:
                tried.add(i)
                return 0, True
            return 0, False
        pos = chunk.keys.index(key)
        count = 1
        while pos + count < len(chunk.keys) and i + count < len(op.keys) and chunk.keys[pos + count] == op.keys[i + count]:
            count += 1
        body = flat[chunk.header_bytes :].view(len(chunk.keys), layout.num_layers, layout.block_bytes)[pos : pos + count]
        landed = None
        if host is None and chunk.kind == codec.CRC32C:  # copied into the KV, each block checked where it landed
            landed = self._native_copy(layout, ids[i : i + count], body.data_ptr(), into_object=False, checked=True)
        if landed is not None:  # (a block that failed is in the request's own KV, which recomputes it)
            good = chunk.matching(pos, landed)
        else:  # each block checked before it is copied, all in one call
            good = chunk.first_bad(pos, arr[chunk.offset(pos) : chunk.offset(pos + count)].reshape(count, chunk.payload))
            if good:
                self._scatter(layout, ids[i : i + good], body[:good], None if host is None else host[:, i : i + good])
        if good < count:
            self._reject(m, want.key, want.tier, chunk.mismatch(pos + good))
        return good, good == count

    def _scatter(self, layout: KVLayout, ids: np.ndarray, body: torch.Tensor, host: torch.Tensor | None) -> None:
        """Copy ``body`` (uint8 ``[k, num_layers, block_bytes]``, in an object) into blocks ``ids`` (or ``host``)."""
        if host is not None:
            host.copy_(body.transpose(0, 1))
            return
        if self._native_copy(layout, ids, body.data_ptr(), into_object=False) is not None:
            return
        views = self._layer_views(layout)
        assert views is not None
        runs = coalesce(ids)
        for layer, kv in enumerate(views):  # numpy's fancy assignment beats torch's index_copy_ on the CPU
            dst, src = kv.numpy(), _object_side(kv, body[:, layer]).numpy()
            if len(runs) == 1:
                dst[runs[0][0] : runs[0][0] + len(ids)] = src
            else:
                dst[ids] = src

    def _native_copy(
        self, layout: KVLayout, ids: np.ndarray, at: int, *, into_object: bool, checked: bool = False
    ) -> np.ndarray | None:
        """Blocks ``ids`` of a KV in host memory copied into (or out of) an object's body at address ``at``,
        block after block as the object holds them, in one call on kvbridge's native threads (memcpy, cut
        between them from 8 MiB), not a Python copy per layer (``kvbridge bench --backends lmcache --ops load``).
        ``checked``:
        each block's crc32c taken where it landed, beside its copy (``uint32``; else empty). ``None``
        where that module is not built (the caller copies)."""
        if self._native is None or not len(ids) or (checked and not self._native.HAS_CRC32C):
            return None
        kv, lengths = layout.addressing().by_block(ids)
        body = np.uint64(at) + packed_offsets(lengths)
        src, dst = (kv, body) if into_object else (body, kv)
        if not checked:
            self._native.copy_start(src, dst, lengths).result()
            return np.zeros(0, np.uint32)
        sums, _, _ = self._native.copy_start(src, dst, lengths, parts=len(lengths) // len(ids)).checked()
        return np.frombuffer(sums, "<u4")[: len(ids)]

    def _reject(self, m: Manager, key: Any, tier: str, bad: Corrupted) -> None:
        self.stats.add(corrupt=1)
        log.warning("lmcache store: object %s in %s is not loadable (%s)", key.to_string(), tier, bad)
        if bad.damaged:  # the remote cannot delete; CPU (a write-back copy) and disk can
            m.sm.remove(key, locations=list(DELETABLE))

    def locate(self, key: bytes) -> tuple[Any, int, int] | None:
        """Where block ``key`` is stored: ``(LMCache key of its object, offset, length)`` of its bytes in the
        object, or ``None`` (not stored, not readable, no KV attached yet). For tools and fault injection."""
        if self._views is None:
            return None
        layout = self._views[0]
        with self._session() as m:
            want = self._find(m, [key], 0, set(), layout)
            if want is None:
                return None
            got = m.sm.batched_get([want.key], location=want.tier) or [None]
            obj = got[0]
            if obj is None:
                return None
            try:
                arr = obj.tensor.view(-1).numpy()
                length = FORMAT.header_bytes(arr[: min(arr.size, codec.MAX_HEADER)], arr.size)
                chunk = FORMAT.parse(arr[:length], fingerprint=layout.fingerprint, size=arr.size)
            except Corrupted:
                return None
            finally:
                obj.ref_count_down()
        if key not in chunk.keys:
            return None
        pos = chunk.keys.index(key)
        return want.key, chunk.offset(pos), chunk.payload

    def close(self) -> None:
        self._staging.clear()
        self._views = None
        super().close()


def _runs(plan: Sequence[_Want]) -> Iterator[tuple[str, list[_Want]]]:
    """``plan`` cut into runs of consecutive objects in the same tier."""
    for tier, run in itertools.groupby(plan, key=lambda want: want.tier):
        yield tier, list(run)
