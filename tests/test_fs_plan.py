"""The ``fs`` read plan: which route a load (and a save) takes for a given layout, store option and
medium, decided once per load (:mod:`kvbridge.connectors.fs.plan`); and a bit-exact round trip through
every route this machine can reach (a KV on a GPU is reached by telling the plan the KV's memory is not
the host's, as CI has no GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from kvbridge.connectors import fs
from kvbridge.connectors.fs import FsLoad, FsStore
from kvbridge.connectors.fs.plan import Medium, ReadPlan, Route, choose_read, choose_save

import kvbridge
from kvbridge import codec
from kvbridge.contract import BlockLoad
from kvbridge.errors import ConfigError
from kvbridge.keys import block_keys
from kvbridge.layout import KVLayout
from kvbridge.testing import MiniEngine

NATIVE = fs.native.module() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="kvbridge's native module (file_start, crc32c) is not here")
C, Z = codec.CRC32C, codec.CRC32


def _cpu_layout() -> KVLayout:
    return KVLayout.from_tensors([torch.zeros((8, 2, 16, 16), dtype=torch.bfloat16) for _ in range(2)], block_size=16)


@pytest.mark.parametrize(
    "medium, views, route, fallback, save",
    [
        (Medium(native=True, direct=False, kind=C), True, Route.NATIVE, Route.IN_PLACE, Route.NATIVE),
        (Medium(native=True, direct=False, kind=C), False, Route.NATIVE, Route.BUFFERED, Route.NATIVE),  # kv_first
        (Medium(native=True, direct=False, kind=Z), True, Route.IN_PLACE, Route.IN_PLACE, Route.IN_PLACE),  # crc32
        (Medium(native=True, direct=True, kind=C), True, Route.BUFFERED, Route.BUFFERED, Route.IN_PLACE),  # O_DIRECT
        (Medium(native=False, direct=False, kind=C), True, Route.IN_PLACE, Route.IN_PLACE, Route.IN_PLACE),
        (Medium(native=False, direct=False, kind=C), False, Route.BUFFERED, Route.BUFFERED, Route.BUFFERED),
        (Medium(native=False, direct=True, kind=Z), False, Route.BUFFERED, Route.BUFFERED, Route.BUFFERED),
    ],
)
def test_a_cpu_kv_gets_the_route_its_medium_allows(medium, views, route, fallback, save):
    """``views``: the KV has a view per block (blocks_first; kv_first has none). O_DIRECT reads go
    through aligned buffers; its saves copy each block into one from the KV's views, or from staging."""
    layout = _cpu_layout()
    assert choose_read(layout, None, medium, tp=1, views=views) == ReadPlan(route, fallback, 1)
    assert choose_save(layout, medium, views=views) is save


def test_a_kv_the_host_cannot_address_is_staged(monkeypatch):
    monkeypatch.setattr(fs.plan, "host_addressable", lambda layout: False)
    layout = _cpu_layout()
    native = Medium(native=True, direct=False, kind=C)
    assert choose_read(layout, None, native, tp=1, views=False) == ReadPlan(Route.NATIVE_STAGED, Route.BUFFERED, 1)
    assert choose_save(layout, native, views=False) is Route.NATIVE_STAGED
    python = Medium(native=False, direct=False, kind=C)
    assert choose_read(layout, None, python, tp=1, views=False).route is Route.BUFFERED


@pytest.mark.parametrize("medium", [Medium(native=True, direct=False, kind=C), Medium(native=False, direct=True, kind=Z)])
def test_another_tp_sizes_shards_are_resliced_whatever_the_medium(medium):
    layout = _cpu_layout()
    assert choose_read(layout, FsLoad(2), medium, tp=1, views=True) == ReadPlan(Route.RESLICED, Route.RESLICED, 2)
    assert choose_read(layout, FsLoad(1), medium, tp=1, views=True).route is not Route.RESLICED  # its own size
    assert choose_read(layout, "something else's", medium, tp=1, views=True).route is not Route.RESLICED


def test_objects_the_native_routes_cannot_check_take_the_fallback():
    plan = ReadPlan(Route.NATIVE, Route.IN_PLACE, 1)
    assert plan.route_for([C, C]) is Route.NATIVE and plan.route_for([]) is Route.NATIVE
    assert plan.route_for([C, Z]) is Route.IN_PLACE
    staged = ReadPlan(Route.NATIVE_STAGED, Route.BUFFERED, 1)
    assert staged.route_for([Z]) is Route.BUFFERED
    assert ReadPlan(Route.IN_PLACE, Route.IN_PLACE, 1).route_for([Z, C]) is Route.IN_PLACE


# ---- a round trip through each route ----------------------------------------------------------------
def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def _one_chunk(n: int, seed: int = 7) -> list[int]:
    """Tokens of ``n`` blocks (and 3 more) that make one chunk of 16 blocks on average."""
    while True:
        tokens = _tokens(n * 16 + 3, seed)
        if fs.chunk_lengths(block_keys(tokens, 16, namespace="mini"), 16) == [n]:
            return tokens
        seed += 1


def _stores(engine: MiniEngine) -> list[FsStore]:
    workers = getattr(engine.worker, "workers", [engine.worker])
    return [w.io for w in workers]  # type: ignore[attr-defined]


# route -> (store options, engine arguments, what a store of either engine is made to lack)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "native": ({"checksum": "crc32c"}, {}, ""),
    "native-staged": ({"checksum": "crc32c"}, {}, "host"),
    "native-kv-first": ({"checksum": "crc32c"}, {"kv_format": "kv_first"}, ""),
    "in-place": ({}, {}, "native"),
    "buffered-scatter": ({}, {"kv_format": "kv_first"}, "native"),
    "buffered-o-direct": ({"o_direct": True}, {}, ""),
    "resliced": ({"chunk_tokens": 64}, {"tp": 2, "num_kv_heads": 4}, ""),
}
ROUTES = {
    "native": (Route.NATIVE, Route.NATIVE),
    "native-staged": (Route.NATIVE_STAGED, Route.NATIVE_STAGED),
    "native-kv-first": (Route.NATIVE, Route.NATIVE),
    "in-place": (Route.IN_PLACE, Route.IN_PLACE),
    "buffered-scatter": (Route.BUFFERED, Route.BUFFERED),
    "buffered-o-direct": (Route.BUFFERED, Route.IN_PLACE),  # (load, save)
    "resliced": (Route.RESLICED, None),  # the producer (tp=2) saves by its own route
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_round_trip_through_each_route_is_bit_exact(tmp_path, monkeypatch, case):
    """Producer and consumer share a directory; the consumer's loads (and both engines' saves) take the
    route the case names, every plan the consumer's store chose says so, and the bytes that arrive are
    the bytes that left. A block damaged on disk then fails from itself on."""
    options, engine_args, lacks = CASES[case]
    load_route, save_route = ROUTES[case]
    if (load_route in (Route.NATIVE, Route.NATIVE_STAGED) or lacks == "host") and not NATIVE:
        pytest.skip("kvbridge's native module (file_start, crc32c) is not here")
    opts = {"path": str(tmp_path), **options}
    try:
        producer_backend = kvbridge.create_backend("fs", opts)
    except ConfigError as exc:  # O_DIRECT refused by this filesystem
        pytest.skip(str(exc))
    consumer_args = {k: v for k, v in engine_args.items() if k != "tp"}  # a tp=1 consumer of tp=2 shards
    producer = MiniEngine(producer_backend, engine_id="p", role="producer", seed=1, **engine_args)
    consumer = MiniEngine(kvbridge.create_backend("fs", opts), engine_id="c", role="consumer", seed=2, **consumer_args)
    if lacks == "host":  # as a GPU's KV: through pinned staging
        monkeypatch.setattr(fs.plan, "host_addressable", lambda layout: False)
    for store in _stores(producer) + _stores(consumer):
        if lacks == "native":
            store._native = None
    plans: list[tuple[FsStore, ReadPlan]] = []
    saves: list[tuple[FsStore, Route]] = []
    plan_read, plan_save = FsStore.plan_read, FsStore.plan_save
    monkeypatch.setattr(FsStore, "plan_read", lambda self, *a: plans.append((self, p := plan_read(self, *a))) or p)
    monkeypatch.setattr(FsStore, "plan_save", lambda self, *a: saves.append((self, r := plan_save(self, *a))) or r)
    try:
        tokens = _one_chunk(4) if case != "resliced" else _tokens(9 * 16 + 3, seed=21)
        n = (len(tokens) - 3) // 16
        sent = producer.prefill("a", tokens)
        got = consumer.prefill("b", tokens)
        assert got.failed_blocks == [] and got.loaded_tokens == n * 16
        assert torch.equal(got.snapshot[:, :n], sent.snapshot[:, :n]), "every byte of every block"
        assert torch.equal(got.snapshot[:, :n], consumer.expected(got.keys[:n]))
        theirs = _stores(consumer)
        assert {p.route for s, p in plans if s in theirs} == {load_route}
        if save_route is not None:
            assert {r for s, r in saves if s in _stores(producer)} == {save_route}
        if case != "resliced":
            (victim,) = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and "/v2-" in str(p)]
            with open(victim, "r+b") as f:  # block 2 of 4
                at = fs.HEADER_BYTES + 2 * (victim.stat().st_size - fs.HEADER_BYTES) // 4 + 77
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 1]))
            bad = consumer.prefill("c", tokens)
            assert bad.loaded_blocks == bad.block_ids[:2] and bad.failed_blocks == sorted(bad.block_ids[2:4])
            assert torch.equal(bad.snapshot[:, :4], consumer.expected(bad.keys[:4])), "damaged bytes counted"
    finally:
        producer.close()
        consumer.close()


@needs_native
def test_crc32_objects_read_by_a_native_store_take_its_fallback(tmp_path, monkeypatch):
    """A producer configured ``checksum="crc32"`` shares the directory with a native crc32c consumer: the
    consumer's plan is NATIVE, the objects it finds are read by the plan's fallback (IN_PLACE, no native
    move), bit-exact."""
    producer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path), "checksum": "crc32"}),
                          engine_id="p", role="producer", seed=1)  # fmt: skip
    consumer = MiniEngine(kvbridge.create_backend("fs", {"path": str(tmp_path), "checksum": "crc32c"}),
                          engine_id="c", role="consumer", seed=2)  # fmt: skip
    moves: list[bool] = []
    start_move = fs.native.start_move
    monkeypatch.setattr(fs.native, "start_move", lambda *a, **k: moves.append(k["write"]) or start_move(*a, **k))
    try:
        tokens = _one_chunk(4)
        sent = producer.prefill("a", tokens)
        keys = tuple(block_keys(tokens, 16, namespace="mini"))[:4]
        probe = BlockLoad("probe", tuple(range(4)), keys)
        assert _stores(consumer)[0].plan_read(probe, consumer.layout) == ReadPlan(Route.NATIVE, Route.IN_PLACE, 1)
        got = consumer.prefill("b", tokens)
        assert got.failed_blocks == [] and torch.equal(got.snapshot[:, :4], sent.snapshot[:, :4])
        assert False not in moves, "a crc32 object was read by the native route"
    finally:
        producer.close()
        consumer.close()
