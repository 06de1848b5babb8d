"""A process of tests/test_fs.py: ``python fs_worker.py ROLE ROOT OUT SEED``.

- ``produce``: prefill the shared prompts as a producer; write each snapshot (the bytes that left) to OUT.
- ``consume``: prefill them as a consumer; write each snapshot (the bytes that arrived) and what loaded.
- ``churn``: prefill overlapping prompts in a random order for a while as producer *and* consumer,
  deleting some objects first so that writers keep replacing files while others read them; every
  snapshot must equal what the engine computes. Writes counters to OUT.
- ``race`` (``... SEED START``): from wall-clock time START on, in rounds, remove one prompt's chunk
  objects, save that prompt's blocks and load them back — every process the same prompt at the same
  moments, so writers of the same chunk race each other and the readers. Every load must be a miss
  or bit-exact. Writes counters to OUT.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
import torch
from kvbridge.connectors.fs import FsBackend, FsOptions

from kvbridge.contract import BlockLoad, BlockSave, Role
from kvbridge.keys import block_keys
from kvbridge.testing import MiniEngine


def prompts(n: int = 6) -> dict[str, list[int]]:
    """Prompts sharing a two-block prefix, so their keys overlap across requests and processes."""
    common = np.random.default_rng(0).integers(0, 32000, 32).tolist()
    return {f"p{i}": common + np.random.default_rng(1 + i).integers(0, 32000, 16 * (1 + i % 3) + 5).tolist() for i in range(n)}


ROLES: dict[str, Role] = {"produce": "producer", "consume": "consumer", "churn": "both", "race": "both"}


def unlink_object(store: object, key: bytes) -> None:
    """Remove the object holding ``key``'s block (its locator followed), as eviction would."""
    try:
        os.unlink(os.path.realpath(store.path_of(key)))  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass


def race(engine: MiniEngine, start: float, rounds: int = 60) -> dict[str, int]:
    store = engine.worker.io  # type: ignore[attr-defined]
    tokens = np.random.default_rng(0).integers(0, 32000, 20 * 16).tolist()  # a chunk or a few
    keys = tuple(block_keys(tokens, 16, namespace=engine.info.namespace))
    src, dst = engine.allocate(20), engine.allocate(20)
    engine.compute(src, keys)
    want = engine.expected(keys)
    loaded = bad = 0
    time.sleep(max(0.0, start - time.time()))
    for step in range(rounds):
        if step % 2 == 0:
            for key in keys:  # every chunk's object (the links to them lead nowhere until rewritten)
                unlink_object(store, key)
        store.save(BlockSave("race", tuple(src), keys), engine.layout)
        failed = set(store.load(BlockLoad("race", tuple(dst), keys), engine.layout))
        good = [i for i, b in enumerate(dst) if b not in failed]
        n = len(good)
        if good != list(range(n)) or (n and not torch.equal(engine.read(dst[:n]), want[:, :n])):
            bad += 1
        loaded += n
    return {"loaded": loaded, "bad": bad, "corrupt": store.stats.corrupt}


def main(role: str, root: str, out: str, seed: int, *extra: str) -> None:
    backend = FsBackend(FsOptions(path=root))
    engine = MiniEngine(backend, engine_id=f"{role}-{seed}", role=ROLES[role], seed=seed)
    result: dict[str, object] = {}
    try:
        if role == "race":
            result = dict(race(engine, float(extra[0])))
        elif role in ("produce", "consume"):
            for rid, tokens in prompts().items():
                got = engine.prefill(f"{rid}-{role}", tokens)
                n = len(got.keys)
                result[rid] = {"snapshot": got.snapshot[:, :n].clone(), "loaded": len(got.loaded_blocks), "failed": len(got.failed_blocks)}
                assert torch.equal(got.snapshot[:, :n], engine.expected(got.keys)), f"{rid}: bytes differ from the computed KV"
        else:
            rng = random.Random(seed)
            store = engine.worker.io  # type: ignore[attr-defined]
            loaded = 0
            items = list(prompts().items())
            for step in range(40):
                rid, tokens = rng.choice(items)
                req = engine.request(rid, tokens)
                for key in rng.sample(req.block_keys, k=rng.randint(0, 2)):  # force rewrites under readers
                    unlink_object(store, key)
                got = engine.prefill(f"{rid}-{seed}-{step}", tokens)
                n = len(got.keys)
                assert torch.equal(got.snapshot[:, :n], engine.expected(got.keys)), f"{rid} step {step}: torn or foreign bytes"
                loaded += len(got.loaded_blocks)
            result = {"loaded": loaded, "corrupt": store.stats.corrupt}
    finally:
        engine.close()
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
