"""The two halves of a connector: :class:`SchedulerAdapter` (vLLM's scheduler calls -> a backend's
:class:`~kvbridge.contract.SchedulerSide`) and :class:`WorkerAdapter` (vLLM's per-step worker calls -> its
:class:`~kvbridge.contract.WorkerSide`). Everything here is translation; the backend does the work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.contract import (
    EMPTY_PLAN,
    NULL_BLOCK,
    EngineInfo,
    KVGroup,
    RequestInfo,
    ScheduledRequest,
    SchedulerSide,
    WorkerReport,
    WorkerSide,
)
from kvbridge.errors import ConfigError
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.serving.publishing import CachePublisher
from kvbridge.vllm.config import IDLE_WAIT_S, block_extras
from kvbridge.vllm.events import TierEvents
from kvbridge.vllm.messages import Counters, KVBridgeMetadata

log = logging.getLogger(__name__)

# ---- the two halves ----------------------------------------------------------------------------


class SchedulerAdapter:
    """The scheduler-role half: vLLM's scheduler calls -> a :class:`SchedulerSide`.

    Tracks, per live request, its :class:`RequestInfo` (keys computed once) and its block ids as
    vLLM reports them step by step (``new_block_ids`` appended; replaced on resumption).
    """

    def __init__(self, side: SchedulerSide, engine: EngineInfo, publisher: CachePublisher | None = None,
                 events: TierEvents | None = None):
        self.side = side
        self.engine = engine
        self.publisher = publisher  # the prefix cache, published for routers (kvbridge.serving.publishing)
        self.events = events  # what the store's tiers hold, as vLLM KV-cache events (kvbridge.vllm.events)
        self.counters = Counters(side)
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
        if self.events is not None:
            self.events.step()
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
        if self.events is not None:
            self.events.finished(request, info.block_keys)
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
        if self.events is not None:
            self.events.close()  # its thread asks the side's index: stopped before the side closes
        if self.publisher is not None:
            self.publisher.close()
        self.side.close()


def shared_tensors(kv_caches: Mapping[str, Any], group_layers: Sequence[Sequence[str]],
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
        self.per_tensor = per_tensor  # a store: moves a block id across every tensor (see shared_tensors)
        self._aliases: dict[str, int] = {}  # a grouped store's layer names -> the index of the tensor they share
        self.counters = Counters(side)
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
            tensors = shared_tensors(kv_caches, self.group_layers, self.engine.kv_groups)
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


class OtherRole:
    """Stands in for the half of the other role: any use says which role the call belongs to."""

    def __init__(self, role: str, half: str):
        self._role, self._half = role, half

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"kvbridge: {name} is a {self._half}-side call, but this connector has role {self._role}")


