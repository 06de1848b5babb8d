"""vLLM plugin entry point (``vllm.general_plugins``): registers kvbridge's connectors by dotted name."""

from __future__ import annotations


def register() -> None:
    """Called by vLLM in every process; must be idempotent and must not fail when vLLM lacks a feature."""
    try:
        from kvbridge.vllm.connector import register_connectors
    except ImportError:
        return
    register_connectors()
