"""``lmcache-native``: LMCache's own engine storing and retrieving the bench's KV, beside kvbridge's ``lmcache`` tier.

**What runs.** LMCache 0.5.6's ``LMCacheEngine``, built by ``LMCacheEngineBuilder`` as its vLLM integration builds
it, its ``store`` and ``retrieve`` called as that integration's adapter calls them: per request, the request's
tokens, the paged KV as one tensor per layer and the slot mapping of the request's blocks. Two configurations,
two rows: ``lmcache-native:cpu`` (``local_cpu``: the objects stay in LMCache's CPU arena) and
``lmcache-native:disk`` (``local_disk``, ``local_cpu`` off: the arena only stages, every retrieve reads LMCache's
disk tier, as the bench's kvbridge ``lmcache`` target is set up). Chunks of 256 tokens (LMCache's default, what
its vLLM integration runs with), the last unfull chunk saved (a 64-token prompt is one chunk).

**The one piece that is not LMCache's.** LMCache has no connector for KV in host memory: ``CreateGPUConnector``
raises on a CPU build, and its vLLM connector (``VLLMPagedMemGPUConnectorV2``) makes two CUDA streams and asserts
a CUDA device when it first sees the KV. :func:`_connector_type` subclasses that connector and replaces only
those two steps: LMCache's own stub streams (``torch_dev.Stream`` of a CPU build) and, instead of device
pointers, each layer's paged tensor viewed as ``[2, slots, hidden]``. Its ``from_gpu``/``to_gpu`` run unchanged,
so every copy is LMCache's ``device_ops.multi_layer_kv_transfer``: on a GPU its CUDA kernel, here LMCache's
pure-torch fallback (one ``index_select`` / ``index_copy_`` per layer). The KV is vLLM's flash-attention layout
(NHD), per layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``: the bytes per token of the bench's
pools, the block ids scattered by the bench's own rule (:func:`kvbridge.bench.pool.request_blocks`).

**Timing**, as the bench's store rows: ``save`` is every request's ``store`` (fresh tokens each rep) until LMCache
holds it, which for the disk tier means until its disk writes are done (LMCache's puts to disk are asynchronous;
kvbridge's ``lmcache`` tier waits for the same). ``load`` is every request's ``retrieve`` into the other pool's
blocks. One warm-up rep, then ``reps``. Every rep, warm-up included, compares the loaded blocks with the saved
ones byte for byte, untimed; one differing byte fails the row (:class:`Mismatch`), as does a retrieve that
returns fewer tokens than were saved. LMCache hashes the tokens inside ``store`` and ``retrieve``: that is in
its time (kvbridge's bench computes its block keys before the timed region).

**Beside it, kvbridge's tier on the CPU arena alone.** The bench's ``lmcache`` row is kvbridge's tier as its
conformance target sets it up (the arena stages, every load reads LMCache's disk tier: against
``lmcache-native:disk``). The row ``lmcache:cpu`` is the same tier with LMCache's CPU arena as the store
(``cpu_cache``, no disk, the arena sized as ``lmcache-native:cpu``'s plus room for two of kvbridge's largest
objects; against ``lmcache-native:cpu``), measured with the bench's own store cases
(:func:`kvbridge.bench.pairs.save_case` / ``load_case``: the same timing as every store row, the first load
checked byte for byte) because the bench has one store row per registered backend.

**And kvbridge's chain with LMCache behind it**, as deployed for P/D: row ``chain:lmcache``, each engine's ``cpu``
tier, then one ``lmcache`` tier on LMCache's disk (the arena staging only, as the ``lmcache`` row). Every load
is of a prompt saved just before, which the consumer's cpu tier lacks: its blocks come from LMCache's disk
tier (then are promoted into that cpu tier), so its medium is ``lmcache-native:disk``'s, measured in the same run.

LMCache logs to stderr, which ``kvbridge bench`` sends to its ``--log`` file; like kvbridge's ``lmcache`` backend,
its level defaults to WARNING and its usage tracking to off (set before LMCache is first imported).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvbridge.bench.cold import evict
from kvbridge.bench.core import Point, Timing
from kvbridge.bench.pool import fill_random, prompts, request_blocks
from kvbridge.errors import TransferTimeout

TIERS = ("cpu", "disk")
OPS = ("save", "load")
ROWS: dict[str, tuple[str, ...]] = {  # row -> its baselines: the raw medium of that tier
    "lmcache-native:cpu": ("memcpy",),
    "lmcache-native:disk": ("file",),
    "lmcache:cpu": ("memcpy",),  # kvbridge's lmcache tier on the arena alone (see the module docstring)
    "chain:lmcache": ("file",),  # kvbridge's chain, cpu then an lmcache disk tier (see the module docstring)
}
OURS_CPU = "lmcache:cpu"
OURS_CHAIN = "chain:lmcache"
CHUNK_TOKENS = 256  # LMCache's default chunk_size
MARGIN = 64 << 20  # arena and disk room beyond the bytes of one rep (chunk rounding, allocator slack)
DRAIN_TIMEOUT_S = 60.0
_IDS = itertools.count()


class Mismatch(Exception):
    """The bytes LMCache's engine loaded are not the bytes it saved."""


@dataclasses.dataclass
class NativeTier:
    """One configured engine during a rep (what an ``after_save`` hook sees): its tier, the LMCache engine,
    the keys of the rep's chunks, and the disk tier's directory (``None`` for ``cpu``)."""

    tier: str
    engine: Any
    keys: list[Any]
    disk: Path | None


@dataclasses.dataclass(frozen=True)
class _LMCache:
    Builder: Any
    Config: Any
    Metadata: Any
    Connector: type


_LIB: _LMCache | None = None


def _lmcache() -> _LMCache:
    global _LIB
    if _LIB is None:
        from kvbridge.connectors.lmcache import quiet_environment

        quiet_environment()  # before LMCache is imported
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        _LIB = _LMCache(LMCacheEngineBuilder, LMCacheEngineConfig, LMCacheMetadata, _connector_type())
    return _LIB


def _connector_type() -> type:
    """LMCache's vLLM paged-KV connector with its two CUDA-only steps replaced (see the module docstring)."""
    from lmcache import torch_dev
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_head_size,
        get_num_blocks,
        normalize_kv_and_discover_format,
    )

    class HostPagedConnector(VLLMPagedMemGPUConnectorV2):  # type: ignore[misc, valid-type]
        def __init__(self, num_layers: int, hidden_dim_size: int):
            # what the parent's __init__ sets, without its torch.cuda.Stream()s and its GPU staging buffer
            self.num_layers = num_layers
            self.hidden_dim_size = hidden_dim_size
            self.kvcaches: list[torch.Tensor] | None = None
            self.gpu_buffer = None
            self.use_mla = False
            self.layout_hints = {"kv_layout": "NHD"}  # vLLM's flash-attention layout (on CPU LMCache assumes HND)
            self.store_stream = torch_dev.Stream()
            self.load_stream = torch_dev.Stream()
            self._planes: list[torch.Tensor] | None = None

        def _initialize_pointers(self, kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
            # the parent copies device pointers to the GPU; LMCache's torch fallback takes the tensors themselves
            if self._planes is None or self._planes[0].data_ptr() != kv_caches[0].data_ptr():
                self.device = kv_caches[0].device
                self.engine_kv_format, kv = normalize_kv_and_discover_format(kv_caches, EngineType.VLLM, self.layout_hints)
                self.num_blocks = get_num_blocks(kv, self.engine_kv_format)
                self.block_size = get_block_size(kv, self.engine_kv_format)
                self.head_size = get_head_size(kv, self.engine_kv_format)
                self.page_buffer_size = self.num_blocks * self.block_size
                self.block_stride_elems = 0
                self._planes = [t.view(2, self.page_buffer_size, self.hidden_dim_size) for t in kv]
            return self._planes

    return HostPagedConnector


class _Pool:
    """One engine's paged KV: per layer ``[2, num_blocks, block_size, heads, head_size]`` (views of one tensor),
    each request's blocks scattered by the bench's rule, and its slot mapping."""

    def __init__(self, point: Point, seed: int, *, fill: bool):
        s = point.shape
        self.point = point
        self.num_blocks = (point.blocks_per_request + 1) * point.requests
        self.base = torch.empty(s.num_layers, 2, self.num_blocks, point.block_size, s.num_kv_heads, s.head_size, dtype=s.dtype)
        if fill:
            fill_random(self.base, seed)
        self.layers = [self.base[i] for i in range(s.num_layers)]
        n = point.blocks_per_request
        self.ids = [torch.tensor(r[:n], dtype=torch.long) for r in request_blocks(point, self.num_blocks, seed)]
        offsets = torch.arange(point.block_size, dtype=torch.long)
        self.slots = [(ids[:, None] * point.block_size + offsets).reshape(-1) for ids in self.ids]

    def blocks(self, request: int) -> torch.Tensor:
        """The request's blocks in every layer, as bytes (random bits hold NaNs, which never compare equal)."""
        return self.base.index_select(2, self.ids[request]).view(torch.uint8)


def _same(src: _Pool, dst: _Pool) -> int | None:
    """The first request whose loaded blocks differ from the saved ones, or ``None``."""
    for r in range(src.point.requests):
        if not torch.equal(src.blocks(r), dst.blocks(r)):
            return r
    return None


@contextmanager
def _engine(point: Point, tier: str, root: Path, reps: int) -> Iterator[tuple[Any, Path | None]]:
    """An LMCache engine of ``tier`` for ``point``, destroyed on exit (its threads are not daemons). The disk
    tier holds every rep's save: LMCache 0.5.6's ``remove`` of a disk object frees the file but not its room in
    the tier's accounting (``current_cache_size``), so removed objects would still fill it."""
    lib = _lmcache()
    s = point.shape
    gib = float(1 << 30)
    disk = root / "disk" if tier == "disk" else None
    if disk is None:
        config = lib.Config.from_defaults(
            chunk_size=CHUNK_TOKENS, save_unfull_chunk=True, local_cpu=True,
            max_local_cpu_size=(2 * point.nbytes + MARGIN) / gib,
        )  # fmt: skip
    else:
        disk.mkdir(parents=True)
        config = lib.Config.from_defaults(
            chunk_size=CHUNK_TOKENS, save_unfull_chunk=True, local_cpu=False,
            max_local_cpu_size=(point.nbytes + MARGIN) / gib,  # staging: one rep's chunks before their writes end
            local_disk=os.path.join(str(disk), ""), max_local_disk_size=((1 + reps) * point.nbytes + MARGIN) / gib,
        )  # fmt: skip
    metadata = lib.Metadata(
        model_name="kvbridge-bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=s.dtype, kv_shape=(s.num_layers, 2, CHUNK_TOKENS, s.num_kv_heads, s.head_size),
        role="worker", chunk_size=CHUNK_TOKENS,
    )  # fmt: skip
    name = f"kvbridge-bench-{tier}-{os.getpid()}-{next(_IDS)}"
    start = multiprocessing.get_start_method(allow_none=True)
    try:
        try:
            engine = lib.Builder.get_or_create(
                name, config, metadata, lib.Connector(s.num_layers, s.num_kv_heads * s.head_size),
                lambda tensor, src: tensor, lambda obj, src: obj,  # one rank: broadcasts are the identity
            )  # fmt: skip
            engine.post_init()
        finally:
            multiprocessing.set_start_method(start, force=True)  # LMCache's engine forces "spawn" process-wide
        yield engine, disk
    finally:
        lib.Builder.destroy(name)


def _drain(engine: Any, keys: list[Any]) -> None:
    """Until no LMCache tier still writes ``keys`` (its disk puts finish on its own threads)."""
    deadline = time.perf_counter() + DRAIN_TIMEOUT_S
    pause = 0.0001
    for backend in engine.storage_manager.storage_backends.values():
        for key in keys:
            while backend.exists_in_put_tasks(key):
                if time.perf_counter() > deadline:
                    raise TransferTimeout(f"LMCache's {backend} still writes after {DRAIN_TIMEOUT_S}s")
                time.sleep(pause)
                pause = min(2 * pause, 0.002)


def measure(
    point: Point, reps: int, tier: str, *, after_save: Callable[[NativeTier], object] | None = None
) -> dict[str, Timing]:
    """``save`` and ``load`` of ``point`` through LMCache's engine on ``tier`` (``cpu`` or ``disk``): ``reps``
    samples each after one warm-up. ``after_save`` (tests) runs between each rep's save and load, untimed."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    n = point.blocks_per_request * point.block_size  # full blocks only: the bytes of point.nbytes
    src, dst = _Pool(point, 1, fill=True), _Pool(point, 2, fill=False)
    root = Path(tempfile.mkdtemp(prefix=f"kvbridge-bench-lmcache-native-{tier}-"))
    saves: list[float] = []
    loads: list[float] = []
    try:
        with _engine(point, tier, root, reps) as (engine, disk):
            for i in range(1 + reps):
                tokens = [torch.tensor(p[:n], dtype=torch.long) for p in prompts(point, 1000 + i)]
                keys = [key for t in tokens for _, _, key in engine.token_database.process_tokens(t)]
                dst.base.zero_()
                evict()  # as every timed call of the bench (kvbridge.bench.cold)
                t0 = time.perf_counter()
                for t, slots in zip(tokens, src.slots):
                    engine.store(t, kvcaches=src.layers, slot_mapping=slots)
                _drain(engine, keys)
                saved = time.perf_counter() - t0
                if after_save is not None:
                    after_save(NativeTier(tier, engine, keys, disk))
                evict()
                t0 = time.perf_counter()
                got = [engine.retrieve(t, kvcaches=dst.layers, slot_mapping=slots, req_id=f"r{i}-{r}")
                       for r, (t, slots) in enumerate(zip(tokens, dst.slots))]  # fmt: skip
                loaded = time.perf_counter() - t0
                short = [int(mask.sum()) for mask in got if int(mask.sum()) != n]
                if short:
                    raise RuntimeError(f"LMCache retrieved {short[0]} of the {n} tokens it was given to save (rep {i})")
                bad = _same(src, dst)
                if bad is not None:
                    raise Mismatch(f"the blocks LMCache loaded differ from the ones it saved (rep {i}, request {bad})")
                if disk is None:
                    engine.storage_manager.batched_remove(keys)  # room in the arena for the next rep
                if i > 0:
                    saves.append(saved)
                    loads.append(loaded)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"save": Timing(tuple(saves)), "load": Timing(tuple(loads))}


def measure_ours_cpu(point: Point, reps: int) -> dict[str, Timing]:
    """``save`` and ``load`` of ``point`` through kvbridge's ``lmcache`` tier on LMCache's CPU arena alone, timed
    as the bench times every store (its store cases; the first load checked byte for byte)."""
    from kvbridge.bench.pairs import Pair, load_case, save_case
    from kvbridge.connectors.lmcache import LMCacheBackend, LMCacheOptions
    from kvbridge.testing.engine import Target

    options = LMCacheOptions(local_cpu_bytes=2 * point.nbytes + MARGIN + (256 << 20), cpu_cache=True,
                             model_name=f"bench-cpu-{os.getpid()}-{next(_IDS)}", timeout_s=DRAIN_TIMEOUT_S)  # fmt: skip
    pair = Pair(Target(LMCacheBackend(options), LMCacheBackend(options)), point)
    try:
        return {"save": save_case(pair).time(reps), "load": load_case(pair, peer=False).time(reps)}
    finally:
        pair.close()


def measure_ours_chain(point: Point, reps: int) -> dict[str, Timing]:
    """``save`` and ``load`` of ``point`` through kvbridge's chain, cpu then lmcache on LMCache's disk, two
    engines, every load a prompt saved just before (the bench's store cases, the first load checked byte
    for byte)."""
    from kvbridge import registry
    from kvbridge.bench.pairs import Pair, load_case, save_case
    from kvbridge.testing.engine import Target

    root = Path(tempfile.mkdtemp(prefix="kvbridge-bench-chain-lmcache-"))
    lmcache = {"backend": "lmcache", "local_cpu_bytes": 384 << 20, "cpu_cache": False, "local_disk": str(root),
               "local_disk_bytes": 4 << 30, "model_name": f"bench-chain-{os.getpid()}-{next(_IDS)}",
               "timeout_s": DRAIN_TIMEOUT_S}  # fmt: skip
    tiers = [{"backend": "cpu", "capacity_bytes": 3 * point.nbytes + MARGIN}, lmcache]
    pair = Pair(Target(registry.create("chain", {"tiers": tiers}), registry.create("chain", {"tiers": tiers})), point)
    try:
        return {"save": save_case(pair).time(reps), "load": load_case(pair, peer=False, fresh=True).time(reps)}
    finally:
        pair.close()
        shutil.rmtree(root, ignore_errors=True)


def run(point: Point, reps: int) -> dict[tuple[str, str], Timing]:
    """Both tiers at ``point``, kvbridge's tier on the arena and its chain: ``{(row, op): Timing}`` for every row of
    :data:`ROWS` and op of :data:`OPS`."""
    out: dict[tuple[str, str], Timing] = {}
    for tier in TIERS:
        for op, timing in measure(point, reps, tier).items():
            out[(f"lmcache-native:{tier}", op)] = timing
    for op, timing in measure_ours_cpu(point, reps).items():
        out[(OURS_CPU, op)] = timing
    for op, timing in measure_ours_chain(point, reps).items():
        out[(OURS_CHAIN, op)] = timing
    return out


__all__ = ["OPS", "OURS_CHAIN", "OURS_CPU", "ROWS", "TIERS", "Mismatch", "NativeTier", "measure", "measure_ours_chain", "measure_ours_cpu", "run"]
