"""Metadata-plane latency and throughput over loopback, beside the raw gRPC round trip it rides on.

    python -m pytest benches/test_metadata_bench.py -p no:cacheprovider -s

A server process (embedded :class:`MetadataServer` with a handshake callback and a directory
holding three engines' blocks) answers a client in this process. Each case makes ``CALLS``
sequential calls; the table prints p50 / p99 latency and sequential calls/s, plus calls/s with
``THREADS`` client threads sharing one channel. The baseline is a bare ``grpc.health.v1`` Check
through the generated stub: what any unary gRPC call costs here, with no kvbridge code around it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbridge.keys import block_keys
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.client import MetadataClient
from kvbridge.metadata.types import PeerInfo

CALLS = 2000
THREADS = 4
FP = LayoutFingerprint("bfloat16", 32, 8, 128, 16, 65536, "blocks_first")
ME = PeerInfo("decode-0", 0, FP, {"ucx_worker_address": bytes(300), "ucx_rkeys": bytes(32 * 64)})
HASHES = block_keys(list(range(64 * 16)), 16)  # a 1024-token prompt: 64 blocks

SERVER = r"""
import sys
from kvbridge.layout import LayoutFingerprint
from kvbridge.metadata.server import MetadataServer
from kvbridge.metadata.types import PeerInfo
fp = LayoutFingerprint.from_json(sys.argv[1])
me = PeerInfo("prefill-0", 0, fp, {"ucx_worker_address": bytes(300), "ucx_rkeys": bytes(32 * 64)})
server = MetadataServer(on_handshake=lambda peer: me, on_release=lambda *a: None)
server.start()
print(server.address, flush=True)
sys.stdin.read()  # until the bench closes our stdin
server.stop(0)
"""


@pytest.fixture(scope="module")
def client() -> Iterator[MetadataClient]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, FP.to_json()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdin is not None
    address = proc.stdout.readline().strip()
    with MetadataClient(address) as c:
        c.wait_ready(60)
        c.publish("prefill-0", HASHES, ttl_s=600, address=address)
        c.publish("prefill-1", HASHES[:40], ttl_s=600)
        c.publish("cpu-tier", HASHES[:8], ttl_s=600)
        yield c
    proc.stdin.close()
    proc.wait(10)


def _cases(c: MetadataClient) -> dict[str, Callable[[], Any]]:
    stub = health_pb2_grpc.HealthStub(c._channel)
    check = health_pb2.HealthCheckRequest()
    return {
        "baseline: raw gRPC health Check": lambda: stub.Check(check, timeout=5),
        "directory lookup, 64 hashes": lambda: c.lookup(HASHES),
        "handshake": lambda: c.handshake(ME),
    }


def _threaded_rate(fn: Callable[[], Any], calls: int) -> float:
    per = calls // THREADS
    threads = [threading.Thread(target=lambda: [fn() for _ in range(per)]) for _ in range(THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * THREADS / (time.perf_counter() - t0)


@pytest.mark.parametrize("case", ["baseline: raw gRPC health Check", "directory lookup, 64 hashes", "handshake"])
def test_metadata_call(benchmark: Any, client: MetadataClient, case: str) -> None:
    fn = _cases(client)[case]
    assert fn()  # sanity: a real answer (three entries for the lookup, a PeerInfo for the handshake)
    benchmark.pedantic(fn, rounds=CALLS, iterations=1, warmup_rounds=100)
    data = sorted(benchmark.stats.stats.data)
    p50, p99 = statistics.median(data), data[int(0.99 * (len(data) - 1))]
    rate = _threaded_rate(fn, CALLS)
    benchmark.extra_info.update(p50_ms=p50 * 1e3, p99_ms=p99 * 1e3, calls_per_s=1 / statistics.fmean(data),
                                calls_per_s_threads=rate)
    print(f"\n{case:<34} p50 {p50 * 1e3:6.3f} ms  p99 {p99 * 1e3:6.3f} ms  "
          f"{1 / statistics.fmean(data):7.0f} calls/s sequential  {rate:7.0f} calls/s with {THREADS} threads")
