"""kvbridge: move an LLM's KV cache from where it was computed to where it is needed.

The public API, imported lazily so that ``import kvbridge`` stays cheap (it imports neither torch
nor vLLM until something is used)::

    from kvbridge import KVLayout, block_keys, registry
    backend = kvbridge.create_backend("fs", {"path": "/mnt/kv"})
    sched, worker = backend.scheduler(engine), backend.worker(engine)

vLLM connector classes (``kvbridge.UCXConnector``, ``FSConnector``, ``CPUConnector``,
``ChainConnector``, ``KVBridgeConnector``) resolve from here too, for
``kv_connector_module_path: kvbridge``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # core
    "KVLayout": "kvbridge.layout",
    "LayoutFingerprint": "kvbridge.layout",
    "coalesce": "kvbridge.layout",
    "block_keys": "kvbridge.keys",
    "engine_keys": "kvbridge.keys",
    "EngineInfo": "kvbridge.contract",
    "RequestInfo": "kvbridge.contract",
    "Lookup": "kvbridge.contract",
    "ScheduledRequest": "kvbridge.contract",
    "StepPlan": "kvbridge.contract",
    "BlockLoad": "kvbridge.contract",
    "BlockSave": "kvbridge.contract",
    "FinishDecision": "kvbridge.contract",
    "WorkerReport": "kvbridge.contract",
    "SchedulerSide": "kvbridge.contract",
    "WorkerSide": "kvbridge.contract",
    "Backend": "kvbridge.contract",
    "StoreBackend": "kvbridge.store",
    "TransferStats": "kvbridge.stats",
    "create_backend": "kvbridge.registry",
    # errors
    "KVBridgeError": "kvbridge.errors",
    "ConfigError": "kvbridge.errors",
    "UnknownBackend": "kvbridge.errors",
    "MissingDependency": "kvbridge.errors",
    "LayoutError": "kvbridge.errors",
    "LayoutMismatch": "kvbridge.errors",
    "Corrupted": "kvbridge.errors",
    "TransferError": "kvbridge.errors",
    "TransferTimeout": "kvbridge.errors",
    "PeerUnreachable": "kvbridge.errors",
    "ProtocolError": "kvbridge.errors",
    "Unauthorized": "kvbridge.errors",
    "StoreFull": "kvbridge.errors",
    "ClosedError": "kvbridge.errors",
    # vLLM connectors (import vLLM when touched)
    "KVBridgeConnector": "kvbridge.vllm.connector",
    "UCXConnector": "kvbridge.vllm.connector",
    "FSConnector": "kvbridge.vllm.connector",
    "CPUConnector": "kvbridge.vllm.connector",
    "ChainConnector": "kvbridge.vllm.connector",
}
_RENAMES = {"create_backend": "create"}


def __getattr__(name: str) -> Any:
    if name == "registry":
        return importlib.import_module("kvbridge.registry")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*_EXPORTS, "registry", "__version__"])


__all__ = sorted([*_EXPORTS, "__version__"])
