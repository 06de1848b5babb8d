"""A TCP relay on loopback whose producer-to-consumer direction can be made to trickle: a slow link between
two real peers, for the tests of deadlines that need no root (the emulated hosts' ``tc`` cap needs it).

    relay = Throttle(("127.0.0.1", producer_port))   # consumers dial relay.port instead
    relay.trickle = True                             # from now on each connection moves CHUNK per PAUSE_S

Each accepted connection gets its own connection to the target and two pump threads; when either side
closes or fails, both sockets are closed (a consumer that gives up is seen by the producer at once, as
over a real link: what it still sends meets a reset). Reading the producer's side slowly is what makes the producer see a slow consumer.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 16 << 10
PAUSE_S = 0.01  # trickling: CHUNK per PAUSE_S per connection, bytes every wait, far below the link's speed


class Throttle:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.trickle = False
        self.accepted = 0  # connections made through the relay so far
        self.open = 0  # of them, still relayed
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return  # closed
            up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # a small receive buffer: the producer's sends wait on the trickle, not on a big buffer filling
            up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            try:
                up.connect(self.target)
            except OSError:
                up.close()
                down.close()
                continue
            with self._lock:
                self.accepted += 1
                self.open += 1
                self._socks += [down, up]
            pumps = [2]  # pumps of this connection still running
            threading.Thread(target=self._pump, args=(down, up, False, pumps), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True, pumps), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_producer: bool, pumps: list[int]) -> None:
        try:
            while True:
                slow = from_producer and self.trickle
                data = src.recv(CHUNK if slow else 1 << 20)
                if not data:
                    break
                dst.sendall(data)
                if slow:
                    time.sleep(PAUSE_S)
        except OSError:
            pass
        for s in (src, dst):  # either side gone: the other pump stops too
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            pumps[0] -= 1
            last = pumps[0] == 0
            if last:
                self.open -= 1
                self._socks = [s for s in self._socks if s not in (src, dst)]
        if last:  # closed, not only shut down: what the far side still sends is answered with a reset
            src.close()
            dst.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
