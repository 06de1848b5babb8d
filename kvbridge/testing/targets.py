"""The conformance targets of the built-in backends: what pair of engines each is tested (and benched) as.

A target is a producer and a consumer backend sharing whatever medium they use
(:class:`~kvbridge.testing.engine.Target`). They are declared here, not in the backends, so no
production module imports test support. A third-party backend declares its own by exposing
``conformance_target(tmp_path) -> Target`` in its module; :func:`target_for` finds either.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbridge import registry
from kvbridge.testing.engine import Target


def _memory(tmp: Path) -> Target:
    """Two engines sharing one store."""
    from kvbridge.connectors import memory

    name = f"conformance-{tmp}"
    return Target(memory.MemoryBackend(memory.MemoryOptions(name)), memory.MemoryBackend(memory.MemoryOptions(name)),
                  lambda: memory.clear(name))  # fmt: skip


def _cpu(tmp: Path) -> Target:
    """One engine playing both roles: the tier is private to the engine that fills it."""
    from kvbridge.connectors.cpu import CpuBackend, CpuOptions

    return Target(CpuBackend(CpuOptions(capacity_bytes=16 << 20)))


def _fs(tmp: Path) -> Target:
    """A producer and a consumer backend over one directory, as two processes would see it."""
    from kvbridge.connectors.fs import FsBackend, FsOptions

    root = tmp / "fs-store"
    return Target(FsBackend(FsOptions(path=str(root))), FsBackend(FsOptions(path=str(root))),
                  lambda: shutil.rmtree(root, ignore_errors=True))  # fmt: skip


def _chain(tmp: Path) -> Target:
    """Two engines, each with its own ``cpu`` tier in front of one shared ``memory`` tier: the
    consumer's blocks come from the slower tier (and are promoted into its ``cpu``)."""
    from kvbridge.connectors import memory
    from kvbridge.connectors.chain import ChainBackend, ChainOptions

    name = f"chain-conformance-{tmp}"
    tiers: tuple[dict[str, Any], ...] = ({"backend": "cpu", "capacity_bytes": 16 << 20}, {"backend": "memory", "name": name})
    return Target(ChainBackend(ChainOptions(tiers)), ChainBackend(ChainOptions(tiers)), lambda: memory.clear(name))


def _lmcache(tmp: Path) -> Target:
    """Producer and consumer over one disk tier (one process: one shared manager). The CPU arena is a
    staging buffer only, so every load really reads LMCache's disk tier. The ``lm://`` server, shared
    across processes, is exercised by ``tests/test_lmcache.py``."""
    from kvbridge.connectors.lmcache import LMCacheBackend, LMCacheOptions

    root = tmp / "lmcache-disk"
    options = LMCacheOptions(local_cpu_bytes=32 << 20, cpu_cache=False, local_disk=str(root), local_disk_bytes=256 << 20,
                             model_name="conformance")  # fmt: skip
    return Target(LMCacheBackend(options), LMCacheBackend(options), lambda: shutil.rmtree(root, ignore_errors=True))


def _ucx(tmp: Path) -> Target:
    """A producer and a consumer in this process, sharing its UCX runtime; addresses published under ``tmp``."""
    from kvbridge.connectors.ucx import UcxBackend, UcxOptions

    options = UcxOptions(registry_dir=str(tmp / "ucx-registry"), timeout_s=10.0)
    return Target(UcxBackend(options), UcxBackend(options))


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
