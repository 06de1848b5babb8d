"""The connector contract: a scheduler side and a worker side per backend, and what passes between them.

An inference engine runs a *scheduler* (decides which requests run, owns block allocation) and one
or more *workers* (own the KV tensors, run the model). A kvbridge backend gives each its own object:

- :class:`SchedulerSide` — answers how many prompt tokens the backend can supply for a request,
  learns which blocks the engine allocated for them, turns every engine step into a
  :class:`StepPlan` (blocks to load, blocks to save), and decides at a request's end whether its
  blocks may be freed now or must be held for a consumer.
- :class:`WorkerSide` — registers the KV tensors (as a :class:`~kvbridge.layout.KVLayout`), carries
  out a step's plan (loads asynchronously, saves per layer), and reports which requests finished
  loading or saving and which blocks failed to load.

The :class:`StepPlan` is the only thing that travels from scheduler to worker: a frozen dataclass of
plain values (ints, bytes, strings, tuples), safe to pickle or to encode in any format. Reports
travel back as :class:`WorkerReport`.

Call order for one engine step (this is what the vLLM adapter does, and what
:class:`kvbridge.testing.MiniEngine` does in tests)::

    scheduler: lookup(req, n_computed)          # once or more per new request, before allocation
    scheduler: on_allocated(req, block_ids, n)  # after allocation, if lookup returned n > 0
    scheduler: plan = plan_step(scheduled)       # every step
    worker:    start_step(plan)                  # loads begin (asynchronously)
    worker:    wait_layer(i); save_layer(i)      # for every layer, as the forward pass goes
    worker:    finish_step()                     # the forward pass is over; saves go on in the background
    worker:    report = poll()                   # every step, on every rank
    scheduler: on_report(report)                 # the reports of all ranks, merged
    scheduler: on_finished(req, block_ids)       # when a request ends (finished or aborted)
    scheduler: on_preempted(req_ids)             # when the engine takes running requests' blocks back

The bookkeeping every backend needs for this sequence (loads planned and in flight, holds, failed
loads never offered again, transfers on a background thread) is written once in
:mod:`kvbridge.lifecycle`; a backend's sides use it and only move bytes.

Every object raises :class:`~kvbridge.errors.ClosedError` when used after ``close()``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from kvbridge.errors import ClosedError
from kvbridge.layout import KVLayout
from kvbridge.stats import TransferStats

Role = Literal["producer", "consumer", "both"]
NULL_BLOCK = -1  # in a grouped engine's block ids: the group keeps no block at this position


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of an engine (vLLM's hybrid KV-cache manager gives each kind of attention layer
    its own): ``num_layers`` layers, in layout order after the groups before it, that share block ids.

    - A sliding-window group (``sliding_window`` tokens; 0: full attention) keeps only the blocks its
      window still covers: the others are :data:`NULL_BLOCK` in a request's ids.
    - A *state* group (``state=True``: Mamba/SSM layers in vLLM's ``mamba_cache_mode="align"``) holds no
      per-token KV: its block at position ``p`` is the layers' recurrent state after token
      ``(p + 1) * block_size``, where the engine kept one (most positions are null). A load into it
      needs exactly the state at the load's end, so loads that involve one end on a block boundary.
    """

    num_layers: int
    sliding_window: int = 0
    state: bool = False

    @property
    def gives_back(self) -> bool:
        """Whether the engine may take this group's blocks back while the request runs (a window that
        moved on, a state superseded by the next one): their saves must be over before the next step."""
        return bool(self.sliding_window) or self.state

    def loaded(self, computed: int, total: int, block_size: int) -> range:
        """The block positions an engine at ``total`` tokens keeps in this group from ``computed`` tokens
        on: what a load into it covers (vLLM gives back a sliding group's blocks before token
        ``total - window + 1``; a state group's load is the one state at ``total``, a block boundary)."""
        first = computed // block_size
        if self.state:
            end = total // block_size
            return range(end - 1, end) if total > computed and total % block_size == 0 else range(0)
        if self.sliding_window:
            first = max(first, max(0, total - self.sliding_window + 1) // block_size)
        return range(first, -(-total // block_size))


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a backend knows about the engine it serves, fixed at start-up.

    ``namespace`` separates KV that must never be mixed (model, dtype, adapter); it seeds the block
    keys. ``rank``/``world_size`` name this worker's shard under tensor parallelism.
    ``block_bytes`` is the size of one block across all layers of this rank (0 if unknown): the
    scheduler side has no KV tensors, and a store that sizes a pool there (``cpu``) needs it.
    ``kv_replicated``: every rank holds the same KV (MLA's latent cache is not split by heads), so
    there is one copy to share, rank 0's (:attr:`kv_rank`), whatever the tensor-parallel size.
    ``kv_groups``: the KV-cache groups where there are several (empty: one group, every layer). Then
    every list of a request's block ids is *group-major*: group 0's id for each block position, then
    group 1's, and so on (``len(groups) * positions`` ids, :func:`split_groups`). Only a backend that
    declares :attr:`Backend.supports_kv_groups` is given more than one group.
    """

    engine_id: str
    block_size: int
    role: Role = "both"
    namespace: str = ""
    rank: int = 0
    world_size: int = 1
    block_bytes: int = 0
    kv_replicated: bool = False
    kv_groups: tuple[KVGroup, ...] = ()

    @property
    def kv_rank(self) -> int:
        """Whose copy of the KV this worker shares with other engines: its own, or rank 0's where
        every rank holds the same bytes."""
        return 0 if self.kv_replicated else self.rank

    @property
    def kv_world_size(self) -> int:
        """How many different shards of the KV the engine's ranks hold (1 where all hold the same)."""
        return 1 if self.kv_replicated else self.world_size


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """A request as the backend sees it: its prompt, the keys of its full blocks, and transfer params.

    ``transfer_params`` are what the client (or a P/D proxy) attached, e.g. the producer's
    :attr:`FinishDecision.transfer_params` handed to the consumer.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]
    transfer_params: Mapping[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """``num_tokens`` beyond those already computed that the backend can supply; loaded asynchronously
    when ``is_async`` (the request waits until the worker reports it in ``finished_loading``)."""

    num_tokens: int = 0
    is_async: bool = True


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """A request that runs in this step: all its block ids so far, tokens computed before this step,
    and tokens computed in it."""

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclasses.dataclass(frozen=True)
class BlockLoad:
    """Load ``keys`` (or the backend's ``source``) into the local blocks ``block_ids``, in order.

    A ``layerwise`` load is synchronous: it runs during the step that computes the rest of the prompt,
    ``wait_layer(i)`` returning once layer ``i`` is in place; the engine waits for no ``finished_loading``
    report of it (the worker still makes one, and reports its failed blocks as any load's)."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...] = ()
    source: Any = None  # the backend's own payload: a frozen dataclass of plain values (or None)
    layerwise: bool = False  # synchronous (Lookup(is_async=False)): done inside this step, layer by layer


@dataclasses.dataclass(frozen=True)
class BlockSave:
    """Save the local blocks ``block_ids`` under ``keys`` (same order) once the step has computed them."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...] = ()
    target: Any = None  # the backend's own payload: a frozen dataclass of plain values (or None)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the worker side must do for one engine step; plain values only.

    ``held`` names requests that ended while the engine holds their blocks for the backend
    (``delay_free``: a load still writing them, a save still reading them): the worker reports each in
    ``finished_saving`` once nothing of it is in flight, so the engine frees the blocks only then.
    ``flush`` names requests whose blocks the engine took back without an end (preempted): the worker
    finishes their saves before this step's forward pass may overwrite the blocks.
    ``extra`` carries the backend's own payload: frozen dataclasses of plain values, one per key.
    """

    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    held: tuple[str, ...] = ()
    flush: tuple[str, ...] = ()
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.held or self.flush or self.extra)


EMPTY_PLAN = StepPlan()


@dataclasses.dataclass(frozen=True)
class FinishDecision:
    """At a request's end: hold its blocks (``delay_free``) until a ``finished_saving`` report, and the
    params a consumer needs to fetch its KV (for peers; ``None`` for stores)."""

    delay_free: bool = False
    transfer_params: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class WorkerReport:
    """What a worker learned since its previous report. Every rank reports every request id.

    A request whose load failed (wholly or partly) is still in ``finished_loading``; the local ids of
    the blocks that did not arrive are in ``failed_blocks`` — the engine recomputes those.
    """

    finished_loading: frozenset[str] = frozenset()
    finished_saving: frozenset[str] = frozenset()
    failed_blocks: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.finished_loading or self.finished_saving or self.failed_blocks)

    @staticmethod
    def merge(reports: Sequence[WorkerReport]) -> WorkerReport:
        """Union of several reports (e.g. of several steps of one rank)."""
        return WorkerReport(
            frozenset().union(*(r.finished_loading for r in reports)),
            frozenset().union(*(r.finished_saving for r in reports)),
            frozenset().union(*(r.failed_blocks for r in reports)),
        )


class _Closable:
    _closed = False
    stats: TransferStats | None = None  # the side's counters, for logs and metrics (None: it keeps none)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Release every resource; idempotent. Any later call raises :class:`ClosedError`."""
        self._closed = True


class SchedulerSide(_Closable, abc.ABC):
    """The backend's half in the engine's scheduler process. Must be cheap: it runs every step."""

    @abc.abstractmethod
    def lookup(self, request: RequestInfo, num_computed_tokens: int) -> Lookup:
        """How many prompt tokens past ``num_computed_tokens`` this backend can supply.

        May be called more than once for the same request (the engine retries when it cannot
        schedule it) and must give the same answer without side effects. Never more than
        ``request.num_prompt_tokens - 1 - num_computed_tokens``: the engine must compute at least one
        token itself. A miss is ``Lookup(0)``, never an error.
        """

    @abc.abstractmethod
    def on_allocated(self, request: RequestInfo, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks, in order, covering computed
        and external tokens) and accepted ``num_external_tokens`` from :meth:`lookup`."""

    @abc.abstractmethod
    def plan_step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """The work for this step: loads for newly allocated requests, saves for blocks the step computes."""

    def on_report(self, report: WorkerReport) -> None:
        """Merged worker reports of a step (all ranks)."""
        self._check_open()

    def on_preempted(self, request_ids: Sequence[str]) -> None:
        """The engine took these requests' blocks back (they resume later from scratch or from a
        lookup); a backend still reading those blocks must name them in the next plan's ``flush``."""
        self._check_open()

    @abc.abstractmethod
    def on_finished(self, request: RequestInfo, block_ids: Sequence[int]) -> FinishDecision:
        """The request ended (finished or aborted): free its blocks now, or hold them for a consumer
        or an in-flight transfer (``delay_free``; the worker reports it in ``finished_saving`` later)."""


class WorkerSide(_Closable, abc.ABC):
    """The backend's half in each worker process, beside the KV tensors."""

    layout: KVLayout | None = None

    def register(self, layout: KVLayout) -> None:
        """The engine's KV cache, once, before the first step."""
        self._check_open()
        self.layout = layout

    @abc.abstractmethod
    def start_step(self, plan: StepPlan) -> None:
        """Begin the step: start the plan's loads (asynchronously) and remember its saves."""

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of this step's synchronous loads is in place (default: none are)."""
        self._check_open()

    def save_layer(self, layer: int) -> None:
        """Layer ``layer`` has been computed for this step; a backend may start saving it now."""
        self._check_open()

    @abc.abstractmethod
    def finish_step(self) -> None:
        """The forward pass is over: hand this step's saves off and return without waiting for them.

        A save may go on reading its blocks after this returns: the scheduler side holds the blocks
        of a request that ends with a save in flight (``delay_free``, then ``held``), and names a
        preempted one in ``flush``. Only what the engine may overwrite while it is still a live,
        unpreempted request — nothing, for computed full blocks — needs copying before return."""

    @abc.abstractmethod
    def poll(self) -> WorkerReport:
        """What finished or failed since the previous call (each event is reported once)."""

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no load or save of this worker is in flight (shutdown, tests, a client that
        needs a save durable before it goes on); ``False`` on timeout."""
        self._check_open()
        return True

    def _require_layout(self) -> KVLayout:
        self._check_open()
        if self.layout is None:
            raise ClosedError(f"{type(self).__name__}: register() the KV cache first")
        return self.layout


class Backend(abc.ABC):
    """A configured backend: a factory of scheduler and worker sides.

    ``name`` is its registry name; ``options_type`` the frozen dataclass of its options;
    ``kind`` is ``"store"`` (keyed by block hash) or ``"peer"`` (reads another engine's KV directly).
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["store", "peer"]]
    options_type: ClassVar[type[Any]]
    supports_kv_groups: ClassVar[bool] = False  # moves the blocks of several KV-cache groups (EngineInfo.kv_groups)
    supports_state_groups: ClassVar[bool] = False  # ... state groups among them (KVGroup.state: Mamba layers)

    def __init__(self, options: Any):
        self.options = options

    @abc.abstractmethod
    def scheduler(self, engine: EngineInfo) -> SchedulerSide:
        """A new scheduler side for ``engine``."""

    @abc.abstractmethod
    def worker(self, engine: EngineInfo) -> WorkerSide:
        """A new worker side for ``engine`` (one per rank)."""


def split_groups(block_ids: Sequence[int], groups: int) -> list[tuple[int, ...]]:
    """Group-major block ids (:attr:`EngineInfo.kv_groups`) as one tuple per group."""
    if groups <= 1:
        return [tuple(block_ids)]
    if len(block_ids) % groups:
        raise ValueError(f"{len(block_ids)} block ids do not split into {groups} groups")
    n = len(block_ids) // groups
    return [tuple(block_ids[g * n : (g + 1) * n]) for g in range(groups)]


__all__ = [
    "EMPTY_PLAN",
    "NULL_BLOCK",
    "KVGroup",
    "split_groups",
    "Backend",
    "BlockLoad",
    "BlockSave",
    "EngineInfo",
    "FinishDecision",
    "Lookup",
    "RequestInfo",
    "Role",
    "ScheduledRequest",
    "SchedulerSide",
    "StepPlan",
    "WorkerReport",
    "WorkerSide",
]
