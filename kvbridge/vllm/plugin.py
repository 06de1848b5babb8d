"""vLLM plugin entry point (``vllm.general_plugins``): registers kvbridge's connectors by dotted name."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """Called by vLLM in every process; idempotent, and never fatal to vLLM.

    Registers ``kvbridge.UCXConnector``, ``kvbridge.FSConnector``, ... with vLLM's connector
    factory. Also initialises AMX tiles where torch offers it: bf16 CPU attention on AMX machines can
    otherwise die with "Illegal instruction" (a no-op elsewhere).
    """
    try:
        import torch

        init_amx = getattr(torch.cpu, "_init_amx", None)
        if callable(init_amx):
            init_amx()
    except Exception as exc:  # noqa: BLE001 - an optional CPU feature, never a reason to fail
        log.debug("torch.cpu._init_amx() failed: %s", exc)
    try:
        from kvbridge.vllm.connector import register_connectors
    except ImportError as exc:  # e.g. a vLLM whose connector API kvbridge does not support
        log.warning("kvbridge connectors not registered: %s", exc)
        return
    register_connectors()
