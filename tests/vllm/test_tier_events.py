""":class:`kvbridge.vllm.events.TierEvents` over a real ``fs`` store (a MiniEngine saves real objects): what
it publishes when a tier's objects go away, and how often it asks the tier.

vLLM's own event classes are used (hence tests/vllm); no server runs. The request objects carry only
what the events read from vLLM's ``Request`` (id, block hashes, prompt tokens).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
from kvbridge.connectors import fs

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


def _stored(events: list[Any]) -> set[Any]:
    return {h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes}


def _removed(events: list[Any]) -> set[Any]:
    return {h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}


def test_a_request_whose_objects_went_is_removed_whole_not_credited_with_the_next_ones(tmp_path: Path) -> None:
    """B (whose last chunk is partial) is published before A; then B's objects are deleted. Asking the fs
    index about B's keys followed by A's in one question would let A's first chunk end, which is present,
    vouch for B's tail (fs reads a chunk's last block as proof of the ones before it): B's tail would stay
    published. Every one of B's blocks must be removed, and none of A's."""
    engine = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path)}), engine_id="p", role="producer",
                        num_blocks=64)
    try:
        tok_b, tok_a = _tokens(20, True, 1), _tokens(20, False, 100)
        engine.prefill("b", tok_b)
        engine.prefill("a", tok_a)
        index = engine.scheduler.index  # type: ignore[attr-defined]
        events = TierEvents([Tier("DISK", index.members)], BS, scan_s=0.0)
        req_b, req_a = _request("b", tok_b), _request("a", tok_a)
        events.finished(req_b, _keys(tok_b))
        events.finished(req_a, _keys(tok_a))
        events.step()
        first = events.take()
        assert _stored(first) == req_a.published | req_b.published, first

        store = engine.worker.io  # type: ignore[attr-defined]
        for key in _keys(tok_b):
            path = os.path.realpath(store.path_of(key))
            if os.path.exists(path):
                os.unlink(path)
        time.sleep(1.1)  # past the index's memory of what its last lookup found (fs's _FOUND_S)
        events.step()
        after = events.take()
        assert _removed(after) == req_b.published, after
    finally:
        engine.close()


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
    while time.monotonic() - start < 1.2:
        events.step()
        time.sleep(0.001)
    assert 2 <= len(asked) <= 3, asked
    assert events.take() == []


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
    assert sum(asked) == 8, asked
