"""The GET gate and the emulation guard (connectors/ucx/cuda.py) with real UCX on host memory: the option
reaches UCX or the user's variable wins, a UCX without its cuda module leaves the key out, and the guard's
decision from a real endpoint's lanes (tcp here: a device-memory GET over it is emulated, said once; host
memory never guarded). The device half runs in tests/test_gpu.py (``bash .ci/gpu-check``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="pip install 'kvbridge[ucx]'")
from kvbridge.connectors.ucx import cuda  # noqa: E402

from kvbridge import native  # noqa: E402
from kvbridge.errors import ConfigError  # noqa: E402

ucp: Any = native.load_ucp()[0]
pytestmark = pytest.mark.skipif(ucp is None, reason=f"kvbridge._ucp: {native.load_ucp()[1]}")
ENV = f"UCX_{cuda.GET_ZCOPY}"


def context(**kw: Any) -> Any:
    return ucp.Context(tls="tcp", config=cuda.CONFIG, optional=cuda.OPTIONAL, **kw)


def test_the_gate_reaches_ucx_where_its_cuda_module_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvbridge's context asks for the gate; where UCX loaded its cuda module it is in what ucp_init got,
    else the key was refused and left out (never an error); the user's variable always wins."""
    monkeypatch.delenv(ENV, raising=False)
    ctx = context()
    try:
        printed = [line for line in ctx.config_text.splitlines() if cuda.GET_ZCOPY in line]
        if ctx.config:  # a UCX with cuda transports (a GPU machine): kvbridge's y is what UCX holds
            assert ctx.config == {cuda.GET_ZCOPY: "y"} and printed == [f"{cuda.GET_ZCOPY}=y"]
            assert cuda.gate(ctx.config) == "y"
        else:  # this UCX has no cuda module (no libcuda): nothing set, nothing printed
            assert printed == [] and cuda.gate(ctx.config) == "absent"
    finally:
        ctx.close()
    monkeypatch.setenv(ENV, "auto")
    ctx = context()
    try:
        assert ctx.config == {} and cuda.gate(ctx.config) == "auto"
    finally:
        ctx.close()


def test_a_cuda_kv_is_refused_where_it_could_only_be_emulated() -> None:
    no_cuda: dict[str, str] = {}
    cuda.check_registration("host", no_cuda, {})  # host memory: never guarded
    with pytest.raises(ConfigError, match="no cuda transports.*lane='two-sided'"):
        cuda.check_registration("cuda", no_cuda, {})
    with pytest.raises(ConfigError, match=f"{ENV}=n turns cuda_ipc GETs off.*set it to y"):
        cuda.check_registration("cuda", cuda.CONFIG, {ENV: "n"})
    cuda.check_registration("cuda", cuda.CONFIG, {})  # kvbridge's gate on: registered
    cuda.check_registration("cuda", {}, {ENV: "auto"})  # the user's auto: decided per endpoint (get_path)


def test_the_guard_decides_from_a_real_endpoints_lanes(caplog: pytest.LogCaptureFixture) -> None:
    """Two contexts over tcp, a GET of host memory compared byte for byte; the endpoint's lanes are tcp
    alone, so a device-memory GET over it would be emulated: said once, by name; host memory says nothing."""
    a, b = context(progress_thread=True), context()
    try:
        src = np.random.default_rng(8).integers(0, 2**63, 1 << 16, dtype=np.uint64)
        dst = np.zeros_like(src)
        region = a.map(src.ctypes.data, src.nbytes)
        ep = b.connect(a.address)
        k = ep.add_rkey(region.rkey)
        assert ep.get(np.array([src.ctypes.data], np.uint64), np.array([dst.ctypes.data], np.uint64), src.nbytes, k,
                      10.0) == src.nbytes  # fmt: skip
        assert np.array_equal(dst, src)
        lanes = ep.transports()
        assert lanes and {t for t, _ in lanes} == {"tcp"}, lanes
        assert cuda.get_path("host", lanes, b.config) == cuda.GetPath(False)
        path = cuda.get_path("cuda", lanes, b.config)
        assert path.emulated is True and "no cuda_ipc or RDMA lane" in path.cause and "tcp" in path.cause
        with caplog.at_level(logging.INFO, logger=cuda.__name__):
            assert not cuda.warn_once(cuda.get_path("host", lanes, b.config), "p")
            assert cuda.warn_once(path, "p") and not cuda.warn_once(path, "p")  # once per cause
        said = [r for r in caplog.records if r.name == cuda.__name__]
        assert len(said) == 1 and said[0].levelno == logging.WARNING and "software emulation" in said[0].message
        ep.close()
        with pytest.raises(ValueError, match="closed"):
            ep.transports()
        region.close()
    finally:
        b.close()
        a.close()


@pytest.mark.parametrize(("env", "emulated", "words"), [
    ({}, False, ""),
    ({ENV: "n"}, True, "serves PUTs only"),
    ({ENV: "auto"}, None, "active NVLinks"),
], ids=["kvbridge-on", "user-off", "user-auto"])  # fmt: skip
def test_a_cuda_ipc_lane_is_zero_copy_only_with_the_gate_on(env: dict[str, str], emulated: bool | None, words: str) -> None:
    """The lanes a GPU machine's endpoint shows (cuda_ipc beside tcp), with the gate set three ways."""
    lanes = [("tcp", "lo"), ("cuda_ipc", "cuda")]
    path = cuda.get_path("cuda", lanes, {} if env else cuda.CONFIG, env)
    assert path.emulated is emulated and words in path.cause
    rdma = cuda.get_path("cuda", [("rc_mlx5", "mlx5_0:1")], cuda.CONFIG, {})
    assert rdma.emulated is None and "GPUDirect" in rdma.cause
