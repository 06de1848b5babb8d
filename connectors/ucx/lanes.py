"""Which lane ``lane="auto"`` reads a producer over: a pure function of what the consumer learnt about it.

:func:`auto` decides from the KV's memory type, whether the producer is on this host (the ``cma`` probe
read back), whether the producer serves the ``tcp`` lane, and the transport names of the UCX endpoint to
the producer (``Endpoint.transports()``: the lanes UCX chose, e.g. ``rc_mlx5``, ``ud_verbs``, ``tcp``).
The caller (:func:`.onesided.open_source`) gathers those — the probe, the endpoint — and acts on the
answer; nothing here touches a socket, so every branch is testable without the hardware it is about.
"""

from __future__ import annotations

from collections.abc import Collection

from kvbridge.connectors.ucx.cuda import RDMA_LANES


def has_rdma(transports: Collection[str]) -> bool:
    """Whether UCX's endpoint has an RDMA lane (a true one-sided GET in the NIC) among ``transports``."""
    return bool(set(transports) & RDMA_LANES)


def auto(memory: str, same_host: bool, transports: Collection[str] | None, tcp_offered: bool) -> str:
    """The lane ``auto`` takes: ``cma`` for a host-memory KV on this host; ``tcp`` for a host-memory KV whose
    producer serves it, unless UCX reaches the producer over RDMA (``ucp`` then: RDMA stays UCX's, a GET
    the NIC serves beats any socket); ``ucp`` where UCX reaches it at all; ``""`` when no one-sided lane
    can (the caller says why).

    ``memory``: ``"host"`` when both KVs are host memory, else the device's type (``"cuda"``);
    ``transports``: the transport names of the UCX endpoint to the producer, ``None`` where the producer
    registered nothing with UCX (there is no endpoint to ask)."""
    host = memory == "host"
    if host and same_host:
        return "cma"
    if host and tcp_offered and not (transports is not None and has_rdma(transports)):
        return "tcp"
    return "ucp" if transports is not None else ""


__all__ = ["auto", "has_rdma"]
