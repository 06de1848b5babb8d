"""Run one vLLM engine (in this process) over a list of token-id prompts; write what happened as JSON.

    python engine_run.py SPEC.json OUT.json

SPEC: ``model``, ``dtype``, ``kv`` (a KVTransferConfig dict, or null for a plain engine),
``kv_bytes``, ``llm_args`` (more ``LLM(...)`` arguments: ``max_model_len``, ``block_size``, ...),
``requests`` (``[{"name", "prompt", "max_tokens", "kv_transfer_params"?, "reset_cache"?}]``,
generated one after the other; a prompt is token ids, or text where ``text`` is set: the engine then
tokenizes), ``groups`` (lists of request names instead: each group in one ``generate`` call, with
per-request TTFT where ``llm_args`` has ``disable_log_stats: false``), ``watch`` (a directory: record
the files each request adds), ``publish`` (write ``{name: kv_transfer_params}`` there once the
requests are done), ``params_from`` (wait for such a file and send each request with its entry, or
with the entry ``params_of`` names, updated by ``params_patch``), ``done`` (touch this file at the end),
``hold`` (after the requests, stay up until this file exists — a peer producer must outlive its
consumer's pulls; the engine steps only while it has unfinished requests, so a producer is idle then),
``batch`` (generate every request in one ``LLM.generate`` call, as vLLM's offline P/D pattern does; no
per-request counters then), ``corrupt_held`` (overwrite the KV blocks a peer producer holds
for these requests, before anyone pulls them: a transfer that no check can catch).

OUT: per request its tokens, the logprob of each, ``num_cached_tokens``, ``kv_transfer_params``,
wall time, files added, and the connector counters it moved (worker and scheduler side).
Runs vLLM in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the test can read the counters,
unless ``multiprocess`` (engine core and worker in their own processes, as in a server). Tensor parallel
without ``multiprocess`` (``distributed_executor_backend="mp"`` in ``llm_args``) keeps the engine core here
and puts each rank's worker in a process of its own: the scheduler side's counters only, then.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time


def _files(root: str | None) -> set[str]:
    if not root or not os.path.isdir(root):
        return set()
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".")}


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    multiprocess = bool(spec.get("multiprocess"))  # a real deployment's 3 processes; no counters then
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict = {}
    if spec.get("kv"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    kw.update(spec.get("llm_args") or {})  # more LLM(...) arguments, or other values for those below
    kw = {"block_size": 32, "max_model_len": 512, "distributed_executor_backend": None if multiprocess else "uni", **kw}
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=not spec.get("text"),
        enforce_eager=True,
        dtype=spec.get("dtype", "float32"),
        kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20),
        seed=0,
        **kw,
    )
    t_init = time.perf_counter()

    def connectors() -> tuple:
        if not spec.get("kv") or multiprocess:
            return None, None
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if not hasattr(scheduler, "totals"):  # another project's connector (vLLM's own): no kvbridge counters
            return None, None
        # the workers run elsewhere (tensor parallel ranks, each in its own process): the scheduler side only
        return (get_kv_transfer_group() if has_kv_transfer_group() else None), scheduler

    worker_conn, sched_conn = connectors()

    def totals() -> dict:
        return {
            "worker": worker_conn.totals() if worker_conn else {},
            "scheduler": sched_conn.totals() if sched_conn else {},
        }

    published = _wait_json(spec["params_from"], spec.get("hold_s", 300)) if spec.get("params_from") else {}
    results = {}
    if spec.get("batch"):
        results = _batch(llm, spec["requests"], published)
        for name in spec.get("corrupt_held", ()):
            _corrupt_held(worker_conn, results[name]["kv_transfer_params"])
    if spec.get("groups"):
        results = _groups(llm, spec, worker_conn, totals)
    for req in [] if spec.get("batch") or spec.get("groups") else spec["requests"]:
        if req.get("reset_cache"):
            # blocks still held for the connector (a save, a chain's promotion) are freed at the engine's next
            # steps, and vLLM refuses to reset its prefix cache until then (an offline engine takes no step)
            for _ in range(100):
                if llm.reset_prefix_cache():
                    break
                llm.llm_engine.step()
                time.sleep(0.01)
        sp = _sampling(req, published)
        before_files, before = _files(spec.get("watch")), totals()
        t = time.perf_counter()
        out = llm.generate([_prompt(req)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        if worker_conn is not None:  # loads and saves finish off the forward path: let them land
            wait = getattr(worker_conn._worker.side, "wait_idle", None)
            if wait:
                wait(10.0)
        results[req["name"]] = {**_outcome(out, wall, before, totals()),
                                "files": sorted(_files(spec.get("watch")) - before_files)}
        if req["name"] in spec.get("corrupt_held", ()):
            _corrupt_held(worker_conn, out.kv_transfer_params)

    if spec.get("publish"):
        _write_json(spec["publish"], {name: r["kv_transfer_params"] for name, r in results.items()})
    if spec.get("hold"):  # a peer producer serves pulls from its worker's threads; keep the engine stepping
        deadline = time.monotonic() + spec.get("hold_s", 120)
        while not os.path.exists(spec["hold"]) and time.monotonic() < deadline:
            llm.llm_engine.step() if llm.llm_engine.has_unfinished_requests() else time.sleep(0.05)
    namespace = worker_conn.engine.namespace if worker_conn else None
    groups = [dataclasses.asdict(g) for g in worker_conn.engine.kv_groups] if worker_conn else None
    _write_json(sys.argv[2], {"results": results, "totals": totals(), "namespace": namespace, "kv_groups": groups,
                              "init_s": t_init - t0})
    if spec.get("done"):
        open(spec["done"], "w").close()


def _sampling(req: dict, published: dict):
    from vllm import SamplingParams

    params = req.get("kv_transfer_params") or published.get(req.get("params_of", req["name"]))
    if params and req.get("params_patch"):
        params = {**params, **req["params_patch"]}
    extra = {"kv_transfer_params": params} if params else None
    return SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 8), ignore_eos=True, detokenize=False,
                          logprobs=1, extra_args=extra)


def _outcome(out, wall: float, before: dict, after: dict) -> dict:
    """What a test reads of one finished request: its tokens and logprobs, what vLLM says it loaded, and the
    connector's counters over its ``generate`` call."""
    comp = out.outputs[0]
    return {
        "tokens": list(comp.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids)],
        "finish_reason": comp.finish_reason,
        "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
        "wall_s": wall,
        "worker": _diff(after["worker"], before["worker"]),
        "scheduler": _diff(after["scheduler"], before["scheduler"]),
    }


def _prompt(req: dict) -> dict:
    return {"prompt": req["prompt"]} if isinstance(req["prompt"], str) else {"prompt_token_ids": req["prompt"]}


def _groups(llm, spec: dict, worker_conn, totals) -> dict:
    """``groups`` (lists of request names): each group in one ``generate`` call, one group after the
    other; every request of a group gets the group's wall time and counters."""
    by_name = {r["name"]: r for r in spec["requests"]}
    results = {}
    for names in spec["groups"]:
        reqs = [by_name[n] for n in names]
        before = totals()
        t = time.perf_counter()
        outs = llm.generate([_prompt(r) for r in reqs], [_sampling(r, {}) for r in reqs], use_tqdm=False)
        wall = time.perf_counter() - t
        if worker_conn is not None:  # loads and saves finish off the forward path: let them land
            worker_conn._worker.side.wait_idle(10.0)
        after = totals()
        for req, out in zip(reqs, outs):
            results[req["name"]] = {**_outcome(out, wall, before, after),
                                    "ttft_s": getattr(out.metrics, "first_token_latency", None)}  # with disable_log_stats=False
    return results


def _batch(llm, requests: list, published: dict) -> dict:
    """Every request in one generate call; the engine goes idle when it returns."""
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], [_sampling(r, published) for r in requests],
                        use_tqdm=False)
    results = {}
    for req, out in zip(requests, outs):
        comp = out.outputs[0]
        results[req["name"]] = {
            "tokens": list(comp.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids)],
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
            "worker": {}, "scheduler": {},
        }
    return results


def _write_json(path: str, data: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _wait_json(path: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)
    return json.load(open(path))


def _corrupt_held(worker_conn, params) -> None:
    """Overwrite a held request's blocks in the producer's KV cache with other (finite) values."""
    import torch

    ids = [int(b) for b in (params or {}).get("block_ids", [])]
    assert ids, f"no block ids in the producer's transfer params {params}"
    layout = worker_conn._worker.layout
    for view in layout.layers:
        view[torch.tensor(ids)] = view[torch.tensor(ids)].flip(-1) * 0.5 + 0.25


if __name__ == "__main__":
    main()
