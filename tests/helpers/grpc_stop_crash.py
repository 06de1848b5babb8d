"""Reproduces a segmentation fault inside grpcio itself: a synchronous gRPC server started, called once and
stopped, over and over in one process. No kvbridge code runs here, on purpose: the crash is the library's.

Why it is kept: the one full-suite run that died with SIGSEGV in
``tests/test_ucx.py::test_a_handoff_the_consumer_does_not_pull_is_released_at_once`` showed the main thread
inside ``MetadataServer.stop`` (``grpc.Server.stop(grace).wait()``) and no Python frame for the thread that
faulted. This loop ends the same way with grpcio 1.78.0: the main thread waits in ``stop(...).wait()``,
faulthandler marks no current thread, and gdb on the core puts the fault in a thread of gRPC core
(``cygrpc.cpython-*.so``, started by gRPC, no Python on its stack). It does not need a client connected at
the stop (``close`` below crashed as well), nor ucx, nor kvbridge's native modules.

It is not collected by pytest: it fails only some of the time (load makes it likelier; run it beside a busy
loop on a small machine), so as a test it would be flaky, and one run costs seconds of CPU. Run::

    python tests/helpers/grpc_stop_crash.py 2000 close   # rc 0 and "ok": no crash this time; -11: SIGSEGV

argv: iterations, then ``keep`` (the client channel stays open across the stop) or ``close`` (closed first).
"""

from __future__ import annotations

import sys
from concurrent import futures

import grpc


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def main(n: int, mode: str) -> None:
    generic = grpc.method_handlers_generic_handler("t.S", {"M": grpc.unary_unary_rpc_method_handler(_echo)})
    kept: list[grpc.Channel] = []
    for _ in range(n):
        pool = futures.ThreadPoolExecutor(8)
        server = grpc.server(pool, handlers=[generic])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        assert channel.unary_unary("/t.S/M")(b"x", timeout=5) == b"x"
        if mode == "close":
            channel.close()
        else:
            kept.append(channel)  # as a consumer's releaser keeps its channel to a producer
        server.stop(0).wait()
        pool.shutdown(wait=False)  # as MetadataServer.stop does
        if len(kept) > 20:
            kept.pop(0).close()
    print("ok", n, mode, grpc.__version__)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000, sys.argv[2] if len(sys.argv) > 2 else "close")
