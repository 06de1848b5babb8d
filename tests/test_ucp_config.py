"""kvbridge._ucp.Context(config=): UCX options set before ucp_init, read back from what UCX was given; the
user's UCX_<name> variable wins; a key this UCX does not know is an error unless marked optional; a context
so configured still moves bytes (compared after a GET between two contexts over tcp)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvbridge import native

ucp: Any = native.load_ucp()[0]
pytestmark = pytest.mark.skipif(ucp is None, reason=f"kvbridge._ucp: {native.load_ucp()[1]}")


def printed(ctx: Any, key: str) -> str | None:
    """The value ucp_config_print showed for key (a ucp key as UCX_<key>, a transport key as <key>)."""
    for line in ctx.config_text.splitlines():
        name, _, value = line.partition("=")
        if name in (key, f"UCX_{key}"):
            return value
    return None


def test_options_reach_ucx_and_the_users_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TCP_SNDBUF", raising=False)
    monkeypatch.setenv("UCX_MAX_EAGER_RAILS", "2")
    ctx = ucp.Context(tls="tcp", config={"TCP_SNDBUF": "1m", "MAX_EAGER_RAILS": "3"})
    try:
        assert ctx.config == {"TCP_SNDBUF": "1m"}  # the user's variable kept its value
        assert printed(ctx, "TCP_SNDBUF") == "1m"
        assert printed(ctx, "MAX_EAGER_RAILS") == "2"
    finally:
        ctx.close()


def test_unknown_keys_raise_unless_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_KVBRIDGE_NO_SUCH_OPTION", raising=False)
    with pytest.raises(ValueError, match="KVBRIDGE_NO_SUCH_OPTION=1"):
        ucp.Context(config={"KVBRIDGE_NO_SUCH_OPTION": "1"})
    with pytest.raises(ValueError, match="no UCX_ prefix"):
        ucp.Context(config={"UCX_TLS": "tcp"})
    with pytest.raises(TypeError, match="mapping of str to str"):
        ucp.Context(config={"TLS": 1})
    ctx = ucp.Context(config={"KVBRIDGE_NO_SUCH_OPTION": "1", "TCP_SNDBUF": "2m"}, optional=["KVBRIDGE_NO_SUCH_OPTION"])
    assert ctx.config == {"TCP_SNDBUF": "2m"}
    ctx.close()


def test_a_configured_context_moves_bytes() -> None:
    a = ucp.Context(tls="tcp", config={"TCP_SNDBUF": "1m"}, progress_thread=True)
    b = ucp.Context(tls="tcp", config={"TCP_RCVBUF": "1m"})
    try:
        src = np.random.default_rng(5).integers(0, 2**63, 1 << 17, dtype=np.uint64)
        dst = np.zeros_like(src)
        region = a.map(src.ctypes.data, src.nbytes)
        ep = b.connect(a.address)
        k = ep.add_rkey(region.rkey)
        half = src.nbytes // 2  # the halves swapped, so a copy in order would not pass
        remote = np.array([src.ctypes.data + half, src.ctypes.data], np.uint64)
        local = np.array([dst.ctypes.data, dst.ctypes.data + half], np.uint64)
        assert ep.get(remote, local, half, k, 10.0) == src.nbytes
        n = len(src) // 2
        assert np.array_equal(dst[:n], src[n:]) and np.array_equal(dst[n:], src[:n])
        ep.close()
        region.close()
    finally:
        b.close()
        a.close()
