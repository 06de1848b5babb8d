"""The conformance targets of the built-in backends: what pair of engines each is tested (and benched) as.

A target is a producer and a consumer backend sharing whatever medium they use
(:class:`~kvbridge.testing.engine.Target`), with the faults that medium can be put through
(``corrupt``, ``vanish``, ``break_saves``). They are declared here, not in the backends, so no
production module imports test support. A third-party backend declares its own by exposing
``conformance_target(tmp_path) -> Target`` in its module; :func:`target_for` finds either.

Faults are real wherever the medium allows it (files flipped, directories removed or replaced by a
file, a producer engine closed); where a medium is this process's own memory, the fault is a fake
that says so. The hooks reach into the backends' private state on purpose: that state *is* the medium.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge import registry
from kvbridge.errors import TransferError
from kvbridge.testing.engine import MiniEngine, Target


def _engines(*engines: MiniEngine) -> list[MiniEngine]:
    """Each engine once (a one-engine target passes the same engine as producer and consumer)."""
    return list({id(e): e for e in engines}.values())


def _io(engine: MiniEngine) -> Any:
    """A store engine's worker-side :class:`~kvbridge.store.StoreIO` (the backend's own class)."""
    return engine.worker.io  # type: ignore[attr-defined]


def _index(engine: MiniEngine) -> Any:
    """A store engine's scheduler-side :class:`~kvbridge.store.StoreIndex` (the backend's own class)."""
    return engine.scheduler.index  # type: ignore[attr-defined]


@contextlib.contextmanager
def _file_instead_of(root: Path, *, recreate: bool) -> Iterator[None]:
    """A real fault: the directory ``root`` is removed and a plain file put in its place, so nothing can be
    written under it (permission bits would not do: the tests may run as root). Leaving removes the file
    (and makes the directory again when ``recreate``)."""
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_bytes(b"not a directory\n")
    try:
        yield
    finally:
        root.unlink()
        if recreate:
            root.mkdir()


@contextlib.contextmanager
def _failing_saves(io: Any, what: str) -> Iterator[None]:
    """A fake, for a medium that is this process's memory and cannot fail for real: ``io.save`` raises
    (and no save starts on native threads: each goes to ``io.save``)."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise TransferError(f"{what}: saves fail (injected by the conformance suite)")

    io.save, io.start_save = refuse, lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        del io.save, io.start_save


# -- memory ----------------------------------------------------------------------------------------
class _RefusingShelf(Mapping[Any, Any]):
    """A fake: a shared ``memory`` dict that still answers reads but refuses every write."""

    def __init__(self, data: dict[Any, Any]):
        self._data = data

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TransferError("memory: the shelf refuses writes (injected by the conformance suite)")


def _memory_corrupt(name: str, engines: Sequence[MiniEngine], keys: Sequence[bytes]) -> int:
    """``memory`` keeps no checksum: its entries are this process's own tensors, trusted like the KV cache
    itself. What it checks before a load is the layout tag each entry carries, so the damage is to that tag
    (another writer's geometry), with the bytes inverted too: a load that skipped the check shows."""
    from kvbridge.connectors import memory

    store = memory._SHARED.get(name, {})
    damaged = 0
    for engine in engines:
        for key in keys:
            slot = (engine.info.namespace, engine.info.rank, key)
            entry = store.get(slot)
            if entry is None:
                continue
            fp, data = entry
            store[slot] = (dataclasses.replace(fp, num_layers=fp.num_layers + 1), data.bitwise_not())
            damaged += 1
    return damaged


def _memory_vanish(name: str) -> None:
    """Everything in the shared dict is gone. (``memory.clear(name)`` would only unlink the dict from the
    registry: the engines already open keep reading their reference to it.)"""
    from kvbridge.connectors import memory

    memory._SHARED.get(name, {}).clear()


@contextlib.contextmanager
def _memory_refuse(ios: Sequence[Any]) -> Iterator[None]:
    """A fake (the dict of this process cannot fail for real): the shelf under each IO refuses writes."""
    saved = [io._data for io in ios]
    for io, data in zip(ios, saved):
        io._data = _RefusingShelf(data)
    try:
        yield
    finally:
        for io, data in zip(ios, saved):
            io._data = data


def _memory(tmp: Path) -> Target:
    """Two engines sharing one store."""
    from kvbridge.connectors import memory

    name = f"conformance-{tmp}"

    @contextlib.contextmanager
    def break_saves(producer: MiniEngine, consumer: MiniEngine) -> Iterator[None]:
        with _memory_refuse([_io(e) for e in _engines(producer, consumer)]):
            yield

    return Target(
        memory.MemoryBackend(memory.MemoryOptions(name)),
        memory.MemoryBackend(memory.MemoryOptions(name)),
        lambda: memory.clear(name),
        corrupt=lambda p, c, keys: _memory_corrupt(name, _engines(p), keys),
        vanish=lambda p, c: _memory_vanish(name),
        break_saves=break_saves,
    )


# -- cpu -------------------------------------------------------------------------------------------
def _cpu_corrupt(index: Any, pool: Any, keys: Sequence[bytes]) -> int:
    """``cpu`` keeps no checksum either (process memory); what it checks is the key tag each slot carries,
    set only once a copy into the slot completed. The damage is a write that never completed: the slot's
    bytes inverted, its tag cleared (as the tier leaves a slot while it copies)."""
    damaged = 0
    for key in keys:
        slot = index._slots.get(key)
        if slot is None or pool.pool is None or pool._tags[slot] != key:
            continue
        pool._tags[slot] = None
        pool.pool[:, slot].bitwise_not_()
        damaged += 1
    return damaged


def _cpu_vanish(pool: Any, engine: MiniEngine) -> None:
    """The pool's contents are gone while the scheduler's index still names its slots: the worker allocates
    its pool anew (as a worker restarted under the same scheduler would), every slot without a key."""
    pool.attach(engine.layout)


def _cpu(tmp: Path) -> Target:
    """One engine playing both roles: the tier is private to the engine that fills it."""
    from kvbridge.connectors.cpu import CpuBackend, CpuOptions

    def corrupt(p: MiniEngine, c: MiniEngine, keys: Sequence[bytes]) -> int:
        return sum(_cpu_corrupt(_index(e), _io(e), keys) for e in _engines(p, c))

    def vanish(p: MiniEngine, c: MiniEngine) -> None:
        for e in _engines(p, c):
            _cpu_vanish(_io(e), e)

    @contextlib.contextmanager
    def break_saves(p: MiniEngine, c: MiniEngine) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for e in _engines(p, c):
                stack.enter_context(_failing_saves(_io(e), "cpu"))
            yield

    return Target(CpuBackend(CpuOptions(capacity_bytes=16 << 20)), corrupt=corrupt, vanish=vanish, break_saves=break_saves)


def _fs(tmp: Path) -> Target:
    """A producer and a consumer backend over one directory, as two processes would see it."""
    from kvbridge.connectors.fs import FsBackend, FsOptions

    root = tmp / "fs-store"

    def corrupt(p: MiniEngine, c: MiniEngine, keys: Sequence[bytes]) -> int:
        """Invert the last byte of each block's own bytes, inside whichever chunk object holds it."""
        damaged = 0
        for key in keys:
            where = _io(p).locate(key)
            if where is None:
                continue
            path, offset, length = where
            with open(path, "r+b") as f:
                f.seek(offset + length - 1)
                byte = f.read(1)
                f.seek(offset + length - 1)
                f.write(bytes([byte[0] ^ 0xFF]))
            damaged += 1
        return damaged

    def cleanup() -> None:
        if root.is_file():
            root.unlink()
        shutil.rmtree(root, ignore_errors=True)

    return Target(
        FsBackend(FsOptions(path=str(root))),
        FsBackend(FsOptions(path=str(root))),
        cleanup,
        corrupt=corrupt,
        vanish=lambda p, c: shutil.rmtree(root),
        break_saves=lambda p, c: _file_instead_of(root, recreate=False),
    )


def _chain(tmp: Path) -> Target:
    """Two engines, each with its own ``cpu`` tier in front of one shared ``memory`` tier: the
    consumer's blocks come from the slower tier (and are promoted into its ``cpu``)."""
    from kvbridge.connectors import memory
    from kvbridge.connectors.chain import ChainBackend, ChainOptions

    name = f"chain-conformance-{tmp}"
    tiers: tuple[dict[str, Any], ...] = ({"backend": "cpu", "capacity_bytes": 16 << 20}, {"backend": "memory", "name": name})

    def corrupt(p: MiniEngine, c: MiniEngine, keys: Sequence[bytes]) -> int:
        """Every copy: the shared memory tier's entries and each engine's cpu slots holding them."""
        engines = _engines(p, c)
        damaged = _memory_corrupt(name, engines, keys)
        for e in engines:
            damaged += _cpu_corrupt(_index(e).tiers[0], _io(e).tiers[0], keys)
        return damaged

    def vanish(p: MiniEngine, c: MiniEngine) -> None:
        _memory_vanish(name)
        for e in _engines(p, c):
            _cpu_vanish(_io(e).tiers[0], e)

    @contextlib.contextmanager
    def break_saves(p: MiniEngine, c: MiniEngine) -> Iterator[None]:
        """Every tier fails (fakes, as for ``memory`` and ``cpu`` alone), so the chain's save fails."""
        engines = _engines(p, c)
        with contextlib.ExitStack() as stack:
            for e in engines:
                stack.enter_context(_failing_saves(_io(e).tiers[0], "chain cpu tier"))
            stack.enter_context(_memory_refuse([_io(e).tiers[1] for e in engines]))
            yield

    return Target(
        ChainBackend(ChainOptions(tiers)),
        ChainBackend(ChainOptions(tiers)),
        lambda: memory.clear(name),
        corrupt=corrupt,
        vanish=vanish,
        break_saves=break_saves,
    )


def _lmcache(tmp: Path) -> Target:
    """Producer and consumer over one disk tier (one process: one shared manager). The CPU arena is a
    staging buffer only, so every load really reads LMCache's disk tier. The ``lm://`` server, shared
    across processes, is exercised by ``tests/test_lmcache.py``. Sized for the bench as well (it builds
    this target): the arena holds a 128 MiB request's objects at once (as ``lmcache-native:disk``'s does),
    and the disk tier every rep of a bench point without evicting (LMCache's eviction scans every object)."""
    from kvbridge.connectors.lmcache import LMCacheBackend, LMCacheOptions

    root = tmp / "lmcache-disk"
    # timeout_s bounds a save whose disk write failed (break_saves): LMCache never clears such a write's
    # "in progress" mark, so the save waits for it until this deadline (a 128 MiB bench save takes < 1 s)
    options = LMCacheOptions(local_cpu_bytes=384 << 20, cpu_cache=False, local_disk=str(root), local_disk_bytes=4 << 30,
                             model_name="conformance", timeout_s=5.0)  # fmt: skip

    def corrupt(p: MiniEngine, c: MiniEngine, keys: Sequence[bytes]) -> int:
        """LMCache's disk objects (the only copy: ``cpu_cache=False``): the last byte of each block's own bytes
        inverted, inside whichever chunk object holds it."""
        store = _io(p)
        disk = store.storage_manager.storage_backends["LocalDiskBackend"]
        damaged = 0
        for key in keys:
            where = store.locate(key)
            if where is None:
                continue
            obj_key, offset, length = where
            try:
                with open(disk._key_to_path(obj_key), "r+b") as f:
                    f.seek(offset + length - 1)
                    byte = f.read(1)
                    f.seek(offset + length - 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
            except OSError:
                continue
            damaged += 1
        return damaged

    def cleanup() -> None:
        if root.is_file():
            root.unlink()
        shutil.rmtree(root, ignore_errors=True)

    return Target(
        LMCacheBackend(options),
        LMCacheBackend(options),
        cleanup,
        corrupt=corrupt,
        vanish=lambda p, c: shutil.rmtree(root),
        break_saves=lambda p, c: _file_instead_of(root, recreate=True),
    )


def _ucx(tmp: Path) -> Target:
    """A producer and a consumer in this process, sharing its UCX runtime; addresses published under ``tmp``."""
    from kvbridge.connectors.ucx import UcxBackend, UcxOptions

    options = UcxOptions(registry_dir=str(tmp / "ucx-registry"), timeout_s=10.0)
    return Target(
        UcxBackend(options),
        UcxBackend(options),
        vanish=lambda p, c: p.close(),  # the producer engine stops: its metadata server and UCX endpoints go
        absent={
            "corrupt": "ucx keeps no stored copy: the consumer reads the producer's live KV, and KV changed "
            "after the hand-off is not detectable by design",
            "break_saves": "ucx saves nothing: the producer holds its blocks (delay_free) for the consumer's pull",
        },
    )


BUILTIN: dict[str, Callable[[Path], Target]] = {
    "memory": _memory, "cpu": _cpu, "fs": _fs, "chain": _chain, "lmcache": _lmcache, "ucx": _ucx,
}  # fmt: skip


def target_for(name: str, tmp_path: Path) -> Target:
    """The conformance target of backend ``name``; ``ImportError`` when it cannot run here (a missing
    extra), ``LookupError`` when it declares none."""
    factory = BUILTIN.get(name)
    if factory is not None:
        return factory(Path(tmp_path))
    module_name = registry.available()[name].target.partition(":")[0]
    hook = getattr(importlib.import_module(module_name), "conformance_target", None)
    if hook is None:
        raise LookupError(f"backend {name!r} has no conformance target: expose conformance_target(tmp_path) in {module_name}")
    target: Target = hook(tmp_path)
    return target


__all__ = ["BUILTIN", "target_for"]
