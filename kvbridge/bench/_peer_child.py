"""The two processes of a :mod:`kvbridge.bench.peers` measurement: a producer that holds a KV cache and a
consumer that reads the request's blocks out of it with one system (raw ``process_vm_readv``, a ucp GET,
NIXL, Mooncake), checks every byte after every transfer and prints its timings.

    python -m kvbridge.bench._peer_child serve|read      (the spec as one JSON line on stdin)

Only numpy is imported (a child starts in a fraction of a second; torch would take seconds), and nothing
of the bench's own process is shared: each system loads its own UCX (NIXL ships one) with the
``UCX_TLS`` the parent put in the environment. The parent reads the lines that start with ``@@`` (UCX
and NIXL log to stdout as well): the producer's one line of what a reader needs (pid, base address,
worker address and rkey, NIXL metadata, Mooncake session), which the parent hands to the consumer on its
stdin, and the consumer's result (``samples`` in seconds and a ``note``, or ``error``).

The producer's KV is ``layers x num_blocks`` blocks of ``block_bytes`` (blocks_first: one block of one
layer is contiguous), filled from ``numpy.random.default_rng(seed).bytes``; the consumer regenerates the
same bytes to check against. Descriptors are layer-major, the order kvbridge's ``BlockAddressing`` uses.
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.bench.cold import evict

POISON = 0xA5  # the consumer's destination before every transfer: a block not moved cannot pass the check


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _read_spec() -> dict[str, Any]:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("no spec on stdin")
        if line.strip() == "quit":  # the parent gave up (the other side failed): leave now, not at its kill
            raise SystemExit(0)
        if line.startswith("@@"):
            return dict(json.loads(line[2:]))


def pattern(spec: dict[str, Any]) -> np.ndarray:
    """The producer's whole KV cache, byte for byte (the same in every process for one spec)."""
    n = spec["layers"] * spec["num_blocks"] * spec["block_bytes"]
    return np.frombuffer(bytearray(np.random.default_rng(spec["seed"]).bytes(n)), dtype=np.uint8)


def descriptors(spec: dict[str, Any], remote_base: int, local_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(remote addresses, local addresses, lengths) as uint64: every moved block of every layer, or the
    request's bytes as one buffer when ``one_buffer``."""
    layers, nb, bb = spec["layers"], spec["num_blocks"], spec["block_bytes"]
    src = np.asarray(spec["src"], dtype=np.uint64)
    dst = np.asarray(spec["dst"], dtype=np.uint64)
    if spec.get("one_buffer"):
        n = layers * len(src) * bb
        return (np.array([remote_base], dtype=np.uint64), np.array([local_base], dtype=np.uint64),
                np.array([n], dtype=np.uint64))  # fmt: skip
    rows = (np.arange(layers, dtype=np.uint64) * np.uint64(nb)).reshape(-1, 1)
    remote = (np.uint64(remote_base) + (rows + src.reshape(1, -1)) * np.uint64(bb)).reshape(-1)
    local = (np.uint64(local_base) + (rows + dst.reshape(1, -1)) * np.uint64(bb)).reshape(-1)
    return remote, local, np.full(remote.shape, bb, dtype=np.uint64)


def checker(spec: dict[str, Any], local: np.ndarray) -> Callable[[], None]:
    """A function that raises unless ``local`` holds exactly the producer's bytes where they belong."""
    expected = pattern(spec)
    layers, nb, bb = spec["layers"], spec["num_blocks"], spec["block_bytes"]
    if spec.get("one_buffer"):
        n = layers * len(spec["src"]) * bb
        want = expected[:n].copy()

        def check_one() -> None:
            if not np.array_equal(local[:n], want):
                bad = int(np.flatnonzero(local[:n] != want)[0])
                raise AssertionError(f"{spec['name']}: byte {bad} of {n} differs from the producer's")

        return check_one
    src, dst = np.asarray(spec["src"]), np.asarray(spec["dst"])
    want = expected.reshape(layers, nb, bb)[:, src]
    got = local.reshape(layers, nb, bb)

    def check() -> None:
        same = (got[:, dst] == want).all(axis=2)
        if not same.all():
            layer, i = (int(v[0]) for v in np.nonzero(~same))
            raise AssertionError(f"{spec['name']}: {int((~same).sum())} of {same.size} blocks differ from the "
                                 f"producer's (first: layer {layer}, producer block {int(src[i])})")

    return check


# ---- producer ----------------------------------------------------------------------------------------
def _nixl() -> Any:
    try:
        import nixl_cu13 as nixl  # the wheel on PyPI (nixl-cu13): its import name
    except ImportError:
        try:
            import nixl_cu12 as nixl  # type: ignore[no-redef]
        except ImportError:
            import nixl  # type: ignore[no-redef]  # a build from source
    return nixl


def _nixl_agent(name: str, spec: dict[str, Any]) -> Any:
    nixl = _nixl()
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=bool(spec["progress_thread"]), backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer" if spec["error_handling"] else "none"})
    return agent


def _own_host(spec: dict[str, Any]) -> str:
    """Where this child's Mooncake engine listens and is dialled: loopback on one host, else this host's
    routable address (``spec["across_hosts"]``, set by :mod:`kvbridge.bench.hosts`)."""
    if not spec.get("across_hosts"):
        return "127.0.0.1"
    from kvbridge.routable import routable_host

    return routable_host("the bench's Mooncake address")


def _mooncake_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        hint = " (apt-get install libibverbs1)" if "ibverbs" in str(exc) else ""
        raise SystemExit(f"mooncake.engine does not import: {exc}{hint}") from None
    return TransferEngine()


def huge_pages(buf: np.ndarray, spec: dict[str, Any]) -> None:
    """With ``spec["huge_pages"]``, back ``buf`` with 2 MiB pages (``MADV_HUGEPAGE`` + ``MADV_COLLAPSE``), as
    kvbridge's ucx worker backs its KV (kvbridge/connectors/ucx/hugepages.py); a refusal leaves it as it is."""
    if not spec.get("huge_pages"):
        return
    import ctypes

    libc, huge = ctypes.CDLL(None, use_errno=True), 2 << 20
    start = -(-int(buf.ctypes.data) // huge) * huge
    end = (int(buf.ctypes.data) + buf.nbytes) // huge * huge
    for advice in (14, 25):  # MADV_HUGEPAGE, MADV_COLLAPSE
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


def serve(spec: dict[str, Any]) -> None:
    # producer_seed: only tests set it, to prove a consumer that gets other bytes than it expects fails
    pool = pattern({**spec, "seed": spec.get("producer_seed", spec["seed"])})
    huge_pages(pool, spec)
    base = int(pool.ctypes.data)
    info: dict[str, Any] = {"pid": os.getpid(), "base": base}
    keep: list[Any] = []
    pump: Callable[[], object] | None = None
    system = spec["system"]
    if system == "ucp":
        from kvbridge import native

        mod, why = native.load_ucp()
        if mod is None:
            raise SystemExit(why)
        ctx = mod.Context(tls=spec["tls"] or None, progress_thread=True)
        region = ctx.map(base, pool.nbytes)
        keep += [ctx, region]
        info.update(address=ctx.address.hex(), rkey=region.rkey.hex())
    elif system == "nixl":
        agent = _nixl_agent("producer", spec)
        agent.register_memory([(base, pool.nbytes, 0, "")], "DRAM")
        keep.append(agent)
        info["md"] = agent.get_agent_metadata().hex()
        if not spec["progress_thread"]:
            pump = agent.get_new_notifs  # without its thread, NIXL's UCX worker moves only when called
    elif system == "mooncake":
        engine = _mooncake_engine()
        if engine.initialize(_own_host(spec), "P2PHANDSHAKE", spec.get("protocol", "tcp"), "") != 0:
            raise SystemExit("mooncake TransferEngine.initialize failed")
        if engine.register_memory(base, pool.nbytes) != 0:
            raise SystemExit("mooncake register_memory failed")
        keep.append(engine)
        info["session"] = f"{_own_host(spec)}:{engine.get_rpc_port()}"
    _say(info)
    while True:
        if pump is not None:
            for _ in range(256):  # a busy producer, as NIXL needs without its progress thread
                pump()
            ready = select.select([sys.stdin], [], [], 0)[0]
        else:
            ready = select.select([sys.stdin], [], [], 1.0)[0]
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "quit":
                break
    del keep


# ---- consumer ----------------------------------------------------------------------------------------
def _cma(spec: dict[str, Any], peer: dict[str, Any], local: np.ndarray) -> tuple[Callable[[], object], str]:
    remote, laddr, lengths = descriptors(spec, peer["base"], int(local.ctypes.data))
    from kvbridge import native

    mod, why = native.load_core()
    if mod is not None:
        want = int(lengths.sum())

        def read() -> None:
            got = mod.cma_read(peer["pid"], remote, laddr, lengths)
            if got != want:
                raise AssertionError(f"cma_read moved {got} of {want} bytes")

        pages = ", 2 MiB pages" if spec.get("huge_pages") else ""
        if spec.get("threads", 1) > 1:  # cma_start cuts a read of 8 MiB or more over its two threads

            def read_cut() -> None:
                got = mod.cma_start(peer["pid"], remote, laddr, lengths).result()[0]
                if got != want:
                    raise AssertionError(f"cma_start moved {got} of {want} bytes")

            return read_cut, f"kvbridge._core.cma_start (2 threads from 8 MiB), {len(remote)} descriptors{pages}"
        return read, f"kvbridge._core.cma_read, {len(remote)} descriptors{pages}"
    if not spec.get("allow_fallback"):
        raise SystemExit(f"kvbridge._core not loaded: {why}")
    return _ctypes_pvr(peer["pid"], remote, laddr, lengths), f"ctypes process_vm_readv (kvbridge._core: {why})"


def _ctypes_pvr(pid: int, remote: np.ndarray, local: np.ndarray, lengths: np.ndarray) -> Callable[[], None]:
    """``process_vm_readv`` through ctypes, adjacent descriptors merged, IOV_MAX per call (for a build
    without ``kvbridge._ucp``)."""
    import ctypes

    join = (remote[1:] == remote[:-1] + lengths[:-1]) & (local[1:] == local[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~join)))
    r, lo = remote[starts], local[starts]
    n = np.add.reduceat(lengths, starts)
    liov = np.stack([lo, n], 1).astype(np.uint64).copy()
    riov = np.stack([r, n], 1).astype(np.uint64).copy()
    libc = ctypes.CDLL(None, use_errno=True)
    pvr = libc.process_vm_readv
    pvr.restype = ctypes.c_ssize_t
    pvr.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    total = int(n.sum())

    def read() -> None:
        done = 0
        for i in range(0, len(n), 1024):
            k = min(1024, len(n) - i)
            want = int(n[i : i + k].sum())
            got = pvr(pid, liov.ctypes.data + i * 16, k, riov.ctypes.data + i * 16, k, 0)
            if got != want:  # a short read only at a fault here: the bench's memory is all resident
                raise OSError(ctypes.get_errno(), f"process_vm_readv moved {got} of {want} bytes")
            done += got
        if done != total:
            raise AssertionError(f"moved {done} of {total} bytes")

    return read


def _ucp(spec: dict[str, Any], peer: dict[str, Any], local: np.ndarray, keep: list[Any]) -> tuple[Callable[[], object], str]:
    from kvbridge import native

    mod, why = native.load_ucp()
    if mod is None:
        raise SystemExit(f"kvbridge._ucp not loaded: {why}")
    ctx = mod.Context(tls=spec["tls"] or None)
    ep = ctx.connect(bytes.fromhex(peer["address"]), error_handling=bool(spec["error_handling"]))
    rkey = ep.add_rkey(bytes.fromhex(peer["rkey"]))
    region = ctx.map(int(local.ctypes.data), local.nbytes)
    keep += [ctx, ep, region]
    remote, laddr, lengths = descriptors(spec, peer["base"], int(local.ctypes.data))
    timeout = float(spec["timeout_s"])
    want = int(lengths.sum())

    def get() -> None:
        got = ep.get(remote, laddr, lengths, rkey, timeout, region)
        if got != want:
            raise AssertionError(f"get moved {got} of {want} bytes")

    get()  # wire-up, so that info() names the lanes the transfers use
    return get, f"UCX {'.'.join(map(str, mod.version()))}, lanes: {lanes(ep.info())}"


def lanes(info: str) -> str:
    """The lanes of ``ucp_ep_print_info``, short: ``tcp/lo.0 (am keepalive wireup)``; with no ``rma_bw``
    lane, UCX emulates a GET with active messages that the producer's worker answers."""
    out = []
    for line in info.splitlines():
        m = re.search(r"lane\[\d+\]:\s+\d+:(\S+)\s.*?seg \d+\s*(.*)$", line)
        if m:
            out.append(f"{m.group(1)} ({m.group(2).strip()})" if m.group(2).strip() else m.group(1))
    return ", ".join(out) or "none printed"


def _nixl_read(spec: dict[str, Any], peer: dict[str, Any], local: np.ndarray, keep: list[Any]) -> tuple[Callable[[], object], str]:
    agent = _nixl_agent("consumer", spec)
    agent.register_memory([(int(local.ctypes.data), local.nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(peer["md"]))
    remote, laddr, lengths = descriptors(spec, peer["base"], int(local.ctypes.data))
    zero = np.zeros_like(remote)
    rdescs = agent.get_xfer_descs(np.stack([remote, lengths, zero], 1).astype(np.int64), "DRAM")
    ldescs = agent.get_xfer_descs(np.stack([laddr, lengths, zero], 1).astype(np.int64), "DRAM")
    keep += [agent, rdescs, ldescs]
    timeout = float(spec["timeout_s"])
    agent.make_connection(name)
    prepped = spec.get("nixl_mode", "init") == "prepped"
    if prepped:  # what vLLM's NixlConnector does: descriptor lists prepared once, a transfer picks by index
        lside = agent.prep_xfer_dlist("NIXL_INIT_AGENT", ldescs)
        rside = agent.prep_xfer_dlist(name, rdescs)
        index = np.arange(len(remote), dtype=np.int32)
        keep += [lside, rside]

    def read() -> None:
        if prepped:
            handle = agent.make_prepped_xfer("READ", lside, index, rside, index)
        else:
            handle = agent.initialize_xfer("READ", ldescs, rdescs, name)
        state = agent.transfer(handle)
        deadline = time.perf_counter() + timeout
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"nixl READ not done within {timeout}s")
        if state != "DONE":
            raise RuntimeError(f"nixl READ ended {state}")
        agent.release_xfer_handle(handle)

    from importlib import metadata

    version = next((f"{d} {metadata.version(d)}" for d in ("nixl-cu13", "nixl-cu12", "nixl") if _has_dist(d)), "nixl")
    return read, f"{version}, ucx_error_handling_mode={'peer' if spec['error_handling'] else 'none'}"


def _has_dist(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _mooncake(spec: dict[str, Any], peer: dict[str, Any], local: np.ndarray, keep: list[Any]) -> tuple[Callable[[], object], str]:
    from importlib import metadata

    engine = _mooncake_engine()
    if engine.initialize(_own_host(spec), "P2PHANDSHAKE", spec.get("protocol", "tcp"), "") != 0:
        raise SystemExit("mooncake TransferEngine.initialize failed")
    if engine.register_memory(int(local.ctypes.data), local.nbytes) != 0:
        raise SystemExit("mooncake register_memory failed")
    keep.append(engine)
    remote, laddr, lengths = descriptors(spec, peer["base"], int(local.ctypes.data))
    r, lo, n = remote.tolist(), laddr.tolist(), lengths.tolist()
    session = peer["session"]

    def read() -> None:
        rc = engine.batch_transfer_sync_read(session, lo, r, n)
        if rc != 0:
            raise RuntimeError(f"mooncake batch_transfer_sync_read returned {rc}")

    return read, f"mooncake-transfer-engine-non-cuda {metadata.version('mooncake-transfer-engine-non-cuda')}"


def read(spec: dict[str, Any]) -> None:
    nbytes = spec["layers"] * spec["num_blocks"] * spec["block_bytes"]
    local = np.full(nbytes, POISON, dtype=np.uint8)  # resident before anything is registered or timed
    huge_pages(local, spec)
    check = checker(spec, local)
    peer = _read_spec()  # the producer's line, relayed by the parent
    keep: list[Any] = []
    system = spec["system"]
    if system == "cma":
        move, note = _cma(spec, peer, local)
    elif system == "ucp":
        move, note = _ucp(spec, peer, local, keep)
    elif system == "nixl":
        move, note = _nixl_read(spec, peer, local, keep)
    elif system == "mooncake":
        move, note = _mooncake(spec, peer, local, keep)
    else:
        raise SystemExit(f"unknown system {system!r}")
    samples = []
    for i in range(spec["warmup"] + spec["reps"]):
        local.fill(POISON)
        evict()  # as every timed call of the bench: the caches cold (kvbridge.bench.cold)
        t0 = time.perf_counter()
        move()
        dt = time.perf_counter() - t0
        check()  # after every transfer, warm-up included
        if i >= spec["warmup"]:
            samples.append(dt)
    _say({"samples": samples, "note": note})
    del keep


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    spec = _read_spec()
    try:
        if role == "serve":
            serve(spec)
        elif role == "read":
            read(spec)
        else:
            raise SystemExit(f"usage: python -m kvbridge.bench._peer_child serve|read (got {role!r})")
    except SystemExit as exc:
        if isinstance(exc.code, str):
            _say({"error": exc.code})
            raise SystemExit(1) from None
        raise
    except BaseException as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        raise


if __name__ == "__main__":
    main()
