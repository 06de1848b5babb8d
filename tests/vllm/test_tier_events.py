""":class:`kvbridge.vllm.events.TierEvents` over a real ``fs`` store (a MiniEngine saves real objects): what
it publishes when a tier's objects go away, and how often it asks the tier.

vLLM's own event classes are used (hence tests/vllm); no server runs. The request objects carry only
what the events read from vLLM's ``Request`` (id, block hashes, prompt tokens).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest
import torch
from kvbridge.connectors import fs
from test_adapter import BS as ABS
from test_adapter import HEAD, HEADS, KV_CACHE_CONFIG, LAYERS, blocks, config, run_worker, step, until_released

import kvbridge
from kvbridge.keys import block_keys
from kvbridge.testing import MiniEngine
from kvbridge.vllm.events import Tier, TierEvents

BS = 16  # MiniEngine's block size


def _keys(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, BS, namespace="mini")[: len(tokens) // BS]


def _tokens(blocks: int, want_partial_tail: bool, seed: int) -> list[int]:
    """A prompt of ``blocks`` full blocks whose last block ends an fs chunk or (``want_partial_tail``) not."""
    while True:
        tokens = np.random.default_rng(seed).integers(0, 32000, blocks * BS).tolist()
        if fs.ends_chunk(_keys(tokens)[-1], 16) != want_partial_tail:
            return tokens
        seed += 1


def _request(rid: str, tokens: list[int]) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # here: collected without vLLM, skipped

    hashes = [hashlib.sha256(f"{rid}/{i}".encode()).digest() for i in range(len(tokens) // BS)]
    return NS(request_id=rid, block_hashes=hashes, published={maybe_convert_block_hash(h) for h in hashes},
              prompt_token_ids=tokens, all_token_ids=tokens, lora_request=None)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[MiniEngine]:
    """A producer MiniEngine on a real ``fs`` store in ``tmp_path``."""
    engine = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer",
                        num_blocks=64)
    yield engine
    engine.close()


def _saved(engine: MiniEngine, rid: str, tokens: list[int]) -> Any:
    """Prefill ``rid`` on ``engine`` (its blocks saved to the store) and give its vLLM-like request."""
    engine.prefill(rid, tokens)
    return _request(rid, tokens)


def _stored(events: list[Any]) -> set[Any]:
    return {h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes}


def _removed(events: list[Any]) -> set[Any]:
    return {h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}


def test_a_request_whose_objects_went_is_removed_whole_not_credited_with_the_next_ones(engine: MiniEngine) -> None:
    """B (whose last chunk is partial) is published before A; then B's objects are deleted. Asking the fs
    index about B's keys followed by A's in one question would let A's first chunk end, which is present,
    vouch for B's tail (fs reads a chunk's last block as proof of the ones before it): B's tail would stay
    published. Every one of B's blocks must be removed, and none of A's."""
    events = TierEvents([Tier("DISK", engine.scheduler.index.members)], BS, scan_s=0.0)  # type: ignore[attr-defined]
    try:
        tok_b, tok_a = _tokens(20, True, 1), _tokens(20, False, 100)
        req_b, req_a = _saved(engine, "b", tok_b), _saved(engine, "a", tok_a)
        events.finished(req_b, _keys(tok_b))
        events.finished(req_a, _keys(tok_a))
        events.step()
        assert events.drain(30)
        first = events.take()
        assert _stored(first) == req_a.published | req_b.published, first

        store = engine.worker.io  # type: ignore[attr-defined]
        for key in _keys(tok_b):
            path = os.path.realpath(store.path_of(key))
            if os.path.exists(path):
                os.unlink(path)
        time.sleep(1.1)  # past the index's memory of what its last lookup found (fs's _FOUND_S)
        events.step()
        assert events.drain(30)
        after = events.take()
        assert _removed(after) == req_b.published, after
    finally:
        events.close()


def test_a_tier_that_never_stores_is_asked_at_most_every_scan_s() -> None:
    """A request whose blocks a tier never gets stays pending ``pending_s``; the tier is asked about it at
    most once per ``scan_s``, not on every engine step (an fs tier pays a stat per question)."""
    asked: list[int] = []

    def members(keys: Any) -> list[int]:
        asked.append(len(keys))
        return []

    events = TierEvents([Tier("DISK", members)], BS, scan_s=0.5, pending_s=30.0)
    tokens = list(range(4 * BS))
    events.finished(_request("r", tokens), _keys(tokens))
    start = time.monotonic()
    try:
        while time.monotonic() - start < 1.2:
            events.step()
            time.sleep(0.001)
        assert events.drain(30)
        assert 2 <= len(asked) <= 3, asked
        assert events.take() == []
    finally:
        events.close()


def test_each_tier_asked_counts_against_the_step_budget() -> None:
    """Two tiers, requests of 4 blocks, ``batch`` 8: one step asks at most 8 keys of both tiers together."""
    asked: list[int] = []

    def members(keys: Any) -> list[int]:
        asked.append(len(keys))
        return []

    events = TierEvents([Tier("CPU", members), Tier("DISK", members)], BS, batch=8, scan_s=0.0)
    for r in range(5):
        tokens = list(range(r * 1000, r * 1000 + 4 * BS))
        events.finished(_request(f"r{r}", tokens), _keys(tokens))
    events.step()
    assert events.drain(30)
    events.close()
    assert sum(asked) == 8, asked


def _step_returns(events: TierEvents, timeout: float = 10.0) -> bool:
    """Whether ``events.step()`` returns within ``timeout`` (run on a thread, so a step stuck for good
    fails the test instead of hanging it)."""
    stepper = threading.Thread(target=events.step, daemon=True)
    stepper.start()
    stepper.join(timeout)
    return not stepper.is_alive()


def test_a_tier_stuck_in_members_does_not_hold_the_engines_step(engine: MiniEngine) -> None:
    """A real fs store holds a request's blocks; its index's ``members()`` is made to wait on an Event (the
    only test double here: it stands for a slow file system, a stat stuck on a network mount). While it
    waits, the step hands its work over and returns, a second request's end is noted and take() gives
    nothing yet; once the tier answers, the events come — each question one request's keys, in order."""
    index = engine.scheduler.index  # type: ignore[attr-defined]
    entered, gate = threading.Event(), threading.Event()
    questions: list[tuple[bytes, ...]] = []

    def slow_members(keys: Any) -> list[int]:
        questions.append(tuple(keys))
        entered.set()
        gate.wait()
        return index.members(keys)

    events = TierEvents([Tier("DISK", slow_members)], BS, scan_s=0.0)
    try:
        tok_a, tok_b = _tokens(8, False, 7), _tokens(8, False, 70)
        req_a, req_b = _saved(engine, "a", tok_a), _saved(engine, "b", tok_b)
        events.finished(req_a, _keys(tok_a))
        assert _step_returns(events)
        assert entered.wait(30), "the thread never asked the tier"
        assert _step_returns(events), "a step waited for a tier stuck in members()"
        events.finished(req_b, _keys(tok_b))  # noted while the thread is stuck
        assert _step_returns(events)
        assert events.take() == []
        gate.set()
        events.step()
        assert events.drain(30)
        got = events.take()
        assert _stored(got) == req_a.published | req_b.published, got
        assert not _removed(got), got
        for q in questions:  # each question: one request's keys from its first block, in order
            whole = next(k for k in (tuple(_keys(tok_a)), tuple(_keys(tok_b))) if k[: len(q)] == q)
            assert q == whole[: len(q)] and q
    finally:
        gate.set()
        events.close()


def test_requests_ended_while_the_thread_is_behind_keep_the_newest() -> None:
    """The hand-over queue holds ``max_pending`` requests: past that, while the thread is stuck, the oldest
    waiting is dropped unasked (counted in ``dropped``; a router under-counts, never over-counts). The
    tier here is a plain function that holds everything once let through (stuck: a test double of a slow
    index)."""
    entered, gate = threading.Event(), threading.Event()

    def members(keys: Any) -> list[int]:
        entered.set()
        gate.wait()
        return list(range(len(keys)))

    events = TierEvents([Tier("CPU", members)], BS, max_pending=2, scan_s=0.0)
    reqs = []
    try:
        for r in range(5):
            tokens = list(range(r * 1000, r * 1000 + 2 * BS))
            reqs.append(_request(f"r{r}", tokens))
            events.finished(reqs[-1], _keys(tokens))
            if r == 0:
                assert _step_returns(events)
                assert entered.wait(30)
        assert events.dropped == 2  # r1 and r2; r3 and r4 wait
        gate.set()
        events.step()
        assert events.drain(30)
        got = _stored(events.take())
        assert got == reqs[0].published | reqs[3].published | reqs[4].published, got
    finally:
        gate.set()
        events.close()


def test_close_joins_the_thread_even_from_a_tier_still_answering() -> None:
    """close() stops the thread: no thread is left behind, and one stuck in a tier at close asks nothing
    more once it gets its answer."""
    entered, gate = threading.Event(), threading.Event()
    asked: list[int] = []

    def members(keys: Any) -> list[int]:
        asked.append(len(keys))
        entered.set()
        gate.wait()
        return []

    events = TierEvents([Tier("CPU", members), Tier("DISK", members)], BS, scan_s=0.0, close_s=0.2)
    tokens = list(range(2 * BS))
    events.finished(_request("r", tokens), _keys(tokens))
    assert _step_returns(events)
    assert entered.wait(30)
    events.close()  # the tier is still stuck: close waits close_s, then leaves the daemon thread to end
    gate.set()
    deadline = time.monotonic() + 30
    while any(t.name == "kvbridge-tier-events" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the events thread outlived its close"
        time.sleep(0.01)
    assert asked == [2], "asked the second tier after close"
    events.step()  # after close: nothing, and no new thread
    events.finished(_request("s", tokens), _keys(tokens))
    assert not any(t.name == "kvbridge-tier-events" for t in threading.enumerate())


def test_the_connector_publishes_its_tier_and_its_shutdown_ends_the_thread(vl: Any) -> None:
    """A real scheduler- and worker-role connector pair (``memory`` store, ``--kv-events-config`` on): a
    request's saved blocks come out of ``take_events`` as ``BlockStored`` with medium CPU while the engine
    steps, and the scheduler connector's shutdown leaves no events thread behind."""
    cfg = config(vl, "kv_both", {"backend": "memory", "name": "tier-events"}, engine_id="tier-events")
    cfg.kv_events_config = NS(enable_kv_cache_events=True, publisher="zmq")
    sched, worker = vl.c.KVBridgeConnector(cfg, vl.Role.SCHEDULER, KV_CACHE_CONFIG), vl.c.KVBridgeConnector(cfg, vl.Role.WORKER, KV_CACHE_CONFIG)
    base = torch.zeros(LAYERS, 64, HEADS, ABS, 2 * HEAD)  # vLLM CPU's layout, as test_adapter's engines
    eng = NS(sched=sched, worker=worker, kv={f"l{i}": base[i] for i in range(LAYERS)})
    worker.register_kv_caches(eng.kv)
    try:
        tokens, ids = list(range(500, 500 + 3 * ABS)), [4, 2, 9]
        hashes = [hashlib.sha256(f"c/{i}".encode()).digest() for i in range(3)]
        req = NS(request_id="c", prompt_token_ids=tokens, all_token_ids=tokens, block_hashes=hashes,
                 kv_transfer_params=None, cache_salt=None, lora_request=None)  # fmt: skip
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, blocks(ids), 0)
        run_worker(vl, eng, sched.build_connector_meta(step(new=[("c", ids, 0, len(tokens))])), compute=ids)
        if sched.request_finished(req, ids)[0]:
            until_released(vl, eng, "c")
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        want, got = {maybe_convert_block_hash(h) for h in hashes}, []
        deadline = time.monotonic() + 30
        while not want <= {h for e in got if type(e).__name__ == "BlockStored" and e.medium == "CPU" for h in e.block_hashes}:
            assert time.monotonic() < deadline, got
            run_worker(vl, eng, sched.build_connector_meta(step()))
            got += sched.take_events()
            time.sleep(0.01)
        assert any(t.name == "kvbridge-tier-events" for t in threading.enumerate())
    finally:
        sched.shutdown()
        worker.shutdown()
    assert not any(t.name == "kvbridge-tier-events" for t in threading.enumerate()), "the connector's shutdown leaked it"



def test_events_nobody_takes_stop_the_asking_until_taken() -> None:
    """``max_events`` untaken events: the thread asks nothing more (its memory stays bounded by that and one
    round's events) until take() empties them; then the waiting request is asked and published."""
    asked: list[int] = []

    def members(keys: Any) -> list[int]:
        asked.append(len(keys))
        return list(range(len(keys)))

    events = TierEvents([Tier("CPU", members)], BS, max_events=1, scan_s=0.0)
    try:
        first, second = list(range(2 * BS)), list(range(5000, 5000 + 2 * BS))
        events.finished(_request("r0", first), _keys(first))
        events.step()
        assert events.drain(30) and asked
        before = len(asked)
        events.finished(_request("r1", second), _keys(second))
        events.step()
        assert events.drain(30) and len(asked) == before, "asked while an event waited untaken"
        assert len(events.take()) == 1
        events.step()
        assert events.drain(30) and len(asked) > before
        assert _stored(events.take()) == _request("r1", second).published
    finally:
        events.close()
