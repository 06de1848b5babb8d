"""The backend registry: short names to backend classes, loaded lazily.

Built-in backends live in ``kvbridge.connectors.<name>`` (the top-level ``connectors/`` folder) and
each module exposes ``BACKEND`` (its :class:`~kvbridge.contract.Backend` subclass). Third-party
backends register through the ``kvbridge.backends`` entry-point group::

    [project.entry-points."kvbridge.backends"]
    mystore = "mypkg.kvstore:MyStoreBackend"

Nothing is imported until a backend is asked for, so listing backends is cheap and a backend whose
optional dependency is missing fails only when used, with the ``pip install`` line that fixes it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvbridge.contract import Backend
from kvbridge.errors import MissingDependency, UnknownBackend
from kvbridge.options import parse_options

ENTRY_POINT_GROUP = "kvbridge.backends"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A registry entry: where the backend lives, and what to install when its import fails."""

    name: str
    target: str  # "module" (exposing BACKEND) or "module:Class"
    summary: str
    extra: str | None = None  # the kvbridge extra that brings its dependencies

    @property
    def install_hint(self) -> str:
        return f"pip install 'kvbridge[{self.extra}]'" if self.extra else "pip install kvbridge"


_BUILTIN = {
    spec.name: spec
    for spec in (
        BackendSpec("memory", "kvbridge.connectors.memory", "in-process reference store (tests, docs)"),
        BackendSpec("cpu", "kvbridge.connectors.cpu", "bounded host-memory offload tier with LRU eviction"),
        BackendSpec("fs", "kvbridge.connectors.fs", "shared filesystem store (local disk, NFS, tmpfs)", extra="fs"),
        BackendSpec("chain", "kvbridge.connectors.chain", "ordered tiers, e.g. cpu then fs"),
        BackendSpec("lmcache", "kvbridge.connectors.lmcache", "LMCache storage tier", extra="lmcache"),
        BackendSpec("ucx", "kvbridge.connectors.ucx", "peer-to-peer pulls over UCX (RDMA/TCP/shm)", extra="ucx"),
    )
}
BUILTIN: Mapping[str, BackendSpec] = MappingProxyType(_BUILTIN)


def _entry_points() -> dict[str, BackendSpec]:
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _BUILTIN:
            found[ep.name] = BackendSpec(ep.name, ep.value, f"third-party ({ep.value})")
    return found


def available() -> dict[str, BackendSpec]:
    """Every known backend, built-in first, then entry points; nothing is imported."""
    return {**_BUILTIN, **_entry_points()}


def get(name: str) -> type[Backend]:
    """The backend class for ``name``: :class:`UnknownBackend` lists the known names;
    :class:`MissingDependency` says what to install."""
    specs = available()
    if not isinstance(name, str):
        raise UnknownBackend(f"a backend name is a string (one of {sorted(specs)}), got {type(name).__name__} {name!r}")
    spec = specs.get(name)
    if spec is None:
        raise UnknownBackend(f"unknown kvbridge backend {name!r}; known: {sorted(specs)}")
    module_name, _, attr = spec.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, MissingDependency):
            raise
        raise MissingDependency(
            f"backend {name!r} needs a dependency that is not installed ({exc}); try: {spec.install_hint}"
        ) from exc
    cls = getattr(module, attr or "BACKEND")
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise UnknownBackend(f"{spec.target} is not a kvbridge Backend subclass")
    return cls


def check(name: str) -> str | None:
    """``None`` when ``name`` is usable here, otherwise why not (for ``kvbridge backends``)."""
    try:
        cls = get(name)
        probe = getattr(cls, "probe", None)
        return probe() if callable(probe) else None
    except (MissingDependency, UnknownBackend) as exc:
        return str(exc)


def create(name: str, options: Mapping[str, Any] | None = None) -> Backend:
    """Build backend ``name`` with its options validated (a misspelt option fails here)."""
    cls = get(name)
    return cls(parse_options(cls.options_type, options, where=f"{name!r} backend"))


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "BackendSpec", "available", "check", "create", "get"]
