"""What a user sets for the ``ucx`` backend (:class:`UcxOptions`) and what it counts (:class:`UcxStats`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from pathlib import Path
from typing import Literal

from kvbridge.connectors.ucx import onesided, tcplane

from kvbridge import routable
from kvbridge.options import require
from kvbridge.stats import TransferStats


@dataclasses.dataclass(frozen=True)
class UcxOptions:
    """Options of the ``ucx`` backend (``kv_connector_extra_config``); every one has a loopback default.

    - ``advertise_host``: the host consumers dial for this engine's metadata server (and the one it
      listens on, unless ``listen_host``). Default: derived at start-up (:func:`kvbridge.routable.routable_host`:
      the default route's source address, else the host's only address; a ``ConfigError`` that names
      this option where several leave it unclear). Set it where consumers dial another name or address
      (NAT, a Kubernetes service). A loopback value is refused by consumers on other hosts, saying so.
    - ``listen_host``: bind the metadata server here instead (e.g. ``0.0.0.0`` in a container).
    - ``metadata_port``: 0 = a free port per worker, published in ``registry_dir``; N = rank r listens on N+r.
    - ``registry_dir``: where workers publish their metadata address for their scheduler
      (default: ``$TMPDIR/kvbridge-ucx-<uid>``).
    - ``timeout_s``: each step of a load must be over this long after it began: the handshake, the load's
      data (a one-sided read with its seal word, a two-sided pull's status and chunks: whole, however many
      bytes keep arriving) with a confirming release; else the load's blocks fail. Other releases never
      wait on a load (:mod:`.releaser`). The ``tcp`` lane's producer answers each request within it, a
      two-sided producer serves each pull within it. See :mod:`kvbridge.connectors.ucx.puller`.
    - ``lease_s``: a producer frees a request's blocks this long after it finished if no release came
      (default 480 s, what vLLM's NIXL connector gives a consumer before it aborts; a consumer that comes
      later recomputes, and says so once at warning level, counted in ``refused_handoffs``).
    - ``chunk_bytes`` / ``max_inflight``: the pull moves chunks of about this many bytes, this many at once.
    - ``progress_mode``: ucxx progress, process-wide: "thread" (default), "blocking", "thread-polling",
      "polling". "blocking" progresses UCX on the runtime's loop thread: more bulk throughput than
      "thread" but slower small-message round trips (compare with kvbridge.bench.ucx_baselines).
    - ``ucx_tls``: UCX_TLS for this process (wins over the environment; default ``^cma``); process-wide.
    - ``lane``: how a consumer reads: "auto" (default: one-sided ``cma`` on one host, else the ``tcp``
      lane for a host-memory KV, else one-sided ``ucp`` GET with peer error handling, else the two-sided
      path when the native module is missing), "cma", "tcp" (kvbridge's own TCP streams between hosts:
      :mod:`kvbridge.connectors.ucx.tcplane`), "ucp", "ucp-unsafe" (UCX may pick cma with error handling off: a dying producer can abort
      the consumer), "two-sided" (tag sends served by the producer's Python). See
      :mod:`kvbridge.connectors.ucx.onesided`.
    - ``tcp_streams``: connections a consumer reads one load over on the ``tcp`` lane (1 to 16).
    - ``tcp_sndbuf``: a producer's send buffer per ``tcp`` lane connection, bytes (default 512 KiB; 0: the
      kernel's auto-tuned one; else 64 KiB to 1 GiB). Small keeps the bytes in flight in the CPU's caches; raise it where
      ``tcp_streams`` x ``tcp_sndbuf`` is below the link's bandwidth x round trip (see
      :mod:`kvbridge.connectors.ucx.tcplane`).
    - ``tcp_local``: the ``tcp`` lane between processes of one network namespace (pods of a node sharing
      one network; engines in separate pid namespaces) moves the KV through pipes by reference, one copy
      instead of TCP's two (default on; off: TCP over loopback there too; see
      :mod:`kvbridge.connectors.ucx.tcplane`).
    - ``tcp_port``: the port a producer worker serves the ``tcp`` lane on (0: a free one; N: rank r
      listens on N+r), on ``listen_host`` or else ``advertise_host``.
    - ``token``: shared token of the metadata plane (both sides must agree).
    - ``huge_pages``: back a CPU KV with transparent huge pages at registration (default on; see
      :mod:`kvbridge.connectors.ucx.hugepages`): one-sided ``cma`` reads then walk 2 MiB pages.
    """

    advertise_host: str = ""
    listen_host: str = ""
    metadata_port: int = 0
    registry_dir: str = ""
    timeout_s: float = 10.0
    lease_s: float = 480.0
    chunk_bytes: int = 16 << 20
    max_inflight: int = 3
    progress_mode: Literal["thread", "thread-polling", "blocking", "polling"] = "thread"
    ucx_tls: str = ""
    token: str | None = None
    lane: Literal["auto", "cma", "tcp", "ucp", "ucp-unsafe", "two-sided"] = "auto"
    tcp_streams: int = 4
    tcp_port: int = 0
    tcp_sndbuf: int = tcplane.SNDBUF
    tcp_local: bool = True
    huge_pages: bool = True

    def __post_init__(self) -> None:
        require(not (self.advertise_host and routable.is_wildcard(self.advertise_host)),
                f"advertise_host={self.advertise_host!r} is a listener's wildcard, not an address to dial "
                "(set listen_host to it, and advertise_host to an address of this host)")
        require(0 <= self.metadata_port < 65536, f"metadata_port={self.metadata_port} outside [0, 65535]")
        require(self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0")
        require(self.lease_s > 0, f"lease_s={self.lease_s} must be > 0")
        require(self.chunk_bytes >= 4096, f"chunk_bytes={self.chunk_bytes} must be >= 4096")
        require(1 <= self.max_inflight <= 64, f"max_inflight={self.max_inflight} outside [1, 64]")
        require(self.token is None or bool(self.token), "token must be non-empty (or unset)")
        require(1 <= self.tcp_streams <= 16, f"tcp_streams={self.tcp_streams} outside [1, 16]")
        require(0 <= self.tcp_port < 65536, f"tcp_port={self.tcp_port} outside [0, 65535]")
        # below 64 KiB every send waits for an acknowledgement: a load crawls (tests/test_tcplane.py)
        require(self.tcp_sndbuf == 0 or 64 << 10 <= self.tcp_sndbuf <= 1 << 30,
                f"tcp_sndbuf={self.tcp_sndbuf}: 0 (the kernel's) or 64 KiB to 1 GiB")
        require(self.lane in onesided.LANES, f"lane={self.lane!r} is not one of {', '.join(onesided.LANES)}")

    @property
    def advertised_host(self) -> str:
        """``advertise_host``, or where unset the routable address of this host (derived once per process)."""
        return self.advertise_host or _derived_host(self.listen_host)

    @property
    def tcp(self) -> tcplane.Settings:
        """The ``tcp`` lane's settings (a producer adds its hosts: :class:`~.server.Server`)."""
        return tcplane.Settings(port=self.tcp_port, streams=self.tcp_streams, timeout_s=self.timeout_s,
                               sndbuf=self.tcp_sndbuf, local=self.tcp_local)

    @property
    def registry(self) -> Path:
        return Path(self.registry_dir or Path(tempfile.gettempdir()) / f"kvbridge-ucx-{os.getuid()}")


@functools.lru_cache(maxsize=8)
def _derived_host(listen_host: str) -> str:
    if listen_host and not routable.is_wildcard(listen_host):
        return listen_host  # a listener bound to one address: consumers dial that one
    return routable.routable_host("advertise_host")


@dataclasses.dataclass
class UcxStats(TransferStats):
    """:class:`TransferStats` plus what a producer sees: pulls served or refused, releases, expired leases."""

    served_pulls: int = 0
    served_bytes: int = 0
    refused_pulls: int = 0
    releases: int = 0
    expired_leases: int = 0
    refused_handoffs: int = 0  # consumer: transfer params it could not use (expired, malformed, altered)
    unpulled_handoffs: int = 0  # consumer: hand-offs released without a pull (all cached here, ended first)
    sealed_loads: int = 0  # consumer: one-sided reads confirmed by the producer's seal (no round trip)
    resliced_loads: int = 0  # consumer: loads cut out of a producer of another tensor-parallel size
    started_loads: int = 0  # consumer: cma reads started from the engine's step on a native thread (Puller.start)
    lane_cma_loads: int = 0  # consumer: loads counted, by the lane that read them (the ucp lanes together)
    lane_tcp_loads: int = 0
    lane_tcp_local_loads: int = 0  # the tcp lane through pipes (tcplane: the local medium)
    lane_ucp_loads: int = 0
    lane_two_sided_loads: int = 0


LANE_COUNTERS = {"cma": "lane_cma_loads", "tcp": "lane_tcp_loads", "tcp-local": "lane_tcp_local_loads",
                 "ucp": "lane_ucp_loads", "ucp-unsafe": "lane_ucp_loads",
                 "two-sided": "lane_two_sided_loads"}  # a lane -> its UcxStats counter


__all__ = ["LANE_COUNTERS", "UcxOptions", "UcxStats"]
