"""Device memory over ucp: the UCX option kvbridge sets for it, and the guard against UCX's software emulation.

**The option.** UCX lets its ``cuda_ipc`` transport serve one-sided GETs only when
``CUDA_IPC_ENABLE_GET_ZCOPY`` says so; its default (``auto``) enables them only where NVML reports active
NVLinks. On one GPU, or GPUs joined by PCIe only, the GET then leaves ``cuda_ipc`` (PUT does not: the lane
still shows) and UCP emulates it in software over an active-message lane, a few KiB at a time with a
synchronous device copy on each side — two orders of magnitude below the device. kvbridge's context sets the
option to ``y`` (:data:`CONFIG`), unless the user set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``: the environment wins.
A UCX without its cuda module does not know the key; then it is left out (``optional``), and a CUDA KV is
refused at registration (:func:`check_registration`).

**The guard.** A CUDA KV must never silently take the emulation. Before a consumer reads, :func:`get_path`
decides from what is known without moving a byte — the memory type, whether this UCX has its cuda module,
the GET gate's effective value, and the lanes UCX chose for the endpoint (``Endpoint.transports()``) —
whether a device-memory GET is zero-copy, emulated, or cannot be told. The consumer says an emulated (or
possibly emulated) path once per cause, naming it and what to set (:func:`warn_once`), then reads (the GET
works, only slowly). Host memory is not guarded: between hosts over TCP every GET is emulated by design.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Mapping

from kvbridge.errors import ConfigError

log = logging.getLogger(__name__)

GET_ZCOPY = "CUDA_IPC_ENABLE_GET_ZCOPY"
CONFIG: Mapping[str, str] = {GET_ZCOPY: "y"}
OPTIONAL: tuple[str, ...] = (GET_ZCOPY,)  # a UCX without the cuda module refuses the key: left out, not an error

# lanes that move device memory without a host copy: cuda_ipc between processes of one host; RDMA
# transports only where GPUDirect RDMA registers device memory (which UCX does not say here)
IPC_LANES = frozenset({"cuda_ipc"})
RDMA_LANES = frozenset({"rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "gga_mlx5"})
_ON, _OFF = frozenset({"y", "yes", "on", "1", "true"}), frozenset({"n", "no", "off", "0", "false"})


@dataclasses.dataclass(frozen=True)
class GetPath:
    """What a one-sided GET of device memory over an endpoint will be. ``emulated``: True (UCX's software
    emulation), False (zero-copy), None (cannot be told without moving bytes). ``cause``: one line naming
    why, and what to set, when it is not False."""

    emulated: bool | None
    cause: str = ""


def gate(context_config: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """The effective value of the GET gate for a context made with :data:`CONFIG`: ``"y"`` where kvbridge
    set it, the user's ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` where that is set, else ``"absent"`` (this UCX has
    no cuda module, so it refused the key)."""
    env = os.environ if environ is None else environ
    user = env.get(f"UCX_{GET_ZCOPY}")
    if user is not None:
        return user.strip().lower()
    return context_config.get(GET_ZCOPY, "absent").lower()


def check_registration(memory_type: str, context_config: Mapping[str, str], environ: Mapping[str, str] | None = None) -> None:
    """Refuse, with a :class:`ConfigError` that says what to set, a KV that can only take the emulation
    whatever the peer: device memory with a UCX that has no cuda module, or with the GET gate turned off by
    the user. Host memory passes."""
    if memory_type == "host":
        return
    value = gate(context_config, environ)
    if value == "absent":
        raise ConfigError(
            f"a {memory_type} KV cache with one-sided UCX: this UCX has no cuda transports (its cuda module did "
            f"not load: libcuda missing, or a UCX built without CUDA), so GPU memory could only move through "
            "software emulation; install a CUDA-enabled UCX (libucx-cu13 on a machine with the CUDA driver) or "
            "set the ucx backend's lane='two-sided'")
    if value in _OFF:
        raise ConfigError(
            f"a {memory_type} KV cache with one-sided UCX: UCX_{GET_ZCOPY}={value} turns cuda_ipc GETs off, so "
            f"every GET between GPUs would be emulated in software; unset UCX_{GET_ZCOPY} (kvbridge sets it to "
            "y) or set it to y, or set the ucx backend's lane='two-sided'")


def get_path(memory_type: str, lanes: Iterable[tuple[str, str]], context_config: Mapping[str, str],
             environ: Mapping[str, str] | None = None) -> GetPath:
    """How a GET into or out of ``memory_type`` over an endpoint with ``lanes`` (its
    ``Endpoint.transports()``) will run. Host memory: never guarded (``GetPath(False)``)."""
    if memory_type == "host":
        return GetPath(False)
    names = {t for t, _ in lanes}
    value = gate(context_config, environ)
    if names & IPC_LANES:
        if value in _ON:
            return GetPath(False)
        if value in _OFF or value == "absent":
            return GetPath(True, f"UCX_{GET_ZCOPY}={value}: cuda_ipc serves PUTs only, GETs between GPUs are "
                                 f"emulated in software; unset UCX_{GET_ZCOPY} or set it to y")
        return GetPath(None, f"UCX_{GET_ZCOPY}={value}: cuda_ipc serves GETs only where NVML reports active "
                             f"NVLinks, else they are emulated in software; set UCX_{GET_ZCOPY}=y (or unset it)")
    if names & RDMA_LANES:
        return GetPath(None, f"no cuda_ipc lane to the peer (lanes: {', '.join(sorted(names))}): device-memory "
                             "GETs are zero-copy only where GPUDirect RDMA registers GPU memory (nvidia-peermem)")
    return GetPath(True, f"no cuda_ipc or RDMA lane to the peer (lanes: {', '.join(sorted(names)) or 'none'}): "
                         "device-memory GETs are emulated in software over TCP (another host, a peer in "
                         "another container or PID namespace, or CUDA IPC refused: UCX_LOG_LEVEL=debug names "
                         "cuIpcOpenMemHandle failures)")


_SAID: set[str] = set()
_SAID_LOCK = threading.Lock()


def warn_once(path: GetPath, peer: str) -> bool:
    """Log ``path``'s cause once per process and cause (a warning if emulated, else info); True if said now."""
    if path.emulated is False:
        return False
    with _SAID_LOCK:
        if path.cause in _SAID:
            return False
        _SAID.add(path.cause)
    if path.emulated:
        log.warning("one-sided GETs of GPU memory from %s take UCX's software emulation: %s", peer, path.cause)
    else:
        log.info("one-sided GETs of GPU memory from %s may take UCX's software emulation: %s", peer, path.cause)
    return True
