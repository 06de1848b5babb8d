"""Parts of the serving soak across emulated hosts (soak_hosts.py): HTTP into a host's network namespace,
vLLM servers and the proxy started on hosts, process-tree memory, Prometheus text, the output checker.

The soak's driver runs in the root namespaces, where the hosts' addresses do not route. It still speaks
HTTP to them, without a helper process per call: :func:`in_netns` moves the calling *thread* into a host's
network namespace (``setns(2)`` acts on one thread) just long enough to create and connect a socket, which
stays in that namespace afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pd_serve_bench import Layout, server_env, tree

from kvbridge.testing.hosts import Host

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """The calling thread in network namespace ``netns`` (an ``ip netns`` name) inside the block."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # a thread left in the wrong namespace would poison later calls
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)


class NsConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket lives in network namespace ``netns``."""

    def __init__(self, netns: str, host: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.netns = netns

    def connect(self) -> None:
        with in_netns(self.netns):
            super().connect()


def http_call(via: Host, url_host: str, port: int, method: str, path: str, payload: Any = None,
              timeout: float = 10.0) -> tuple[int, bytes]:  # fmt: skip
    """One request from host ``via``'s network to ``url_host:port``: (status, body); OSError when unreachable."""
    conn = NsConnection(via.netns, url_host, port, timeout)
    try:
        body = None if payload is None else json.dumps(payload).encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except http.client.HTTPException as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()


# --- servers on hosts -----------------------------------------------------------------------------------------


def pinned_env(core: int) -> dict[str, str]:
    cpus = os.cpu_count() or 1
    return {**server_env(), "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core % cpus)}


class HostLayout(Layout):
    """pd_serve_bench's :class:`Layout` with each server on its own emulated host, listening on the host's
    address (every host has its own ports, so each role keeps a fixed one)."""

    def __init__(self, name: str, work: Path, model: Path):
        super().__init__(name, work, model)
        self.hosts: dict[str, Host] = {}
        self.cores: dict[str, int] = {}
        self.cmds: dict[str, list[str]] = {}
        self.lives: dict[str, int] = {}

    def place(self, role: str, host: Host, port: int, core: int | None = None) -> None:
        self.hosts[role], self.ports[role] = host, port
        if core is not None:
            self.cores[role] = core

    def _start(self, role: str, port: int, cmd: list[str]) -> None:
        host = self.hosts[role]
        if "--host" in cmd:
            cmd[cmd.index("--host") + 1] = host.address
        self.cmds[role] = cmd
        self.lives[role] = self.lives.get(role, 0) + 1
        env = pinned_env(self.cores[role]) if role in self.cores else server_env()
        with open(self.work / f"{self.name}-{role}-{self.lives[role]}.log", "w") as log:
            self.procs[role] = host.popen(cmd, stdout=log, stderr=log, env=env)
        self.ports[role] = port

    def restart(self, role: str) -> None:
        """The same command again (after its host crashed and booted)."""
        self._start(role, self.ports[role], list(self.cmds[role]))

    def proxy_on(self, host: Host, port: int, timeout: float, prefill_timeout: float) -> None:
        import sys

        self.place("proxy", host, port)
        prefill, decode = self.hosts["prefill"], self.hosts["decode"]
        cmd = [sys.executable, "-m", "kvbridge.cli", "proxy", "--policy", "round-robin",
               "--prefill", f"http://{prefill.address}:{self.ports['prefill']}",
               "--decode", f"http://{decode.address}:{self.ports['decode']}",
               "--listen", f"{host.address}:{port}", "--timeout", str(timeout),
               "--prefill-timeout", str(prefill_timeout)]  # fmt: skip
        self._start("proxy", port, cmd)

    def healthy(self, role: str) -> bool:
        host = self.hosts[role]
        try:
            return http_call(host, host.address, self.ports[role], "GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def wait_up(self, roles: list[str], limit_s: float = 600) -> float:
        t0 = time.monotonic()
        for role in roles:
            while not self.healthy(role):
                proc = self.procs[role]
                if proc.poll() is not None or time.monotonic() - t0 > limit_s:
                    log = (self.work / f"{self.name}-{role}-{self.lives[role]}.log").read_text()[-6000:]
                    raise RuntimeError(f"{role} did not come up (rc {proc.poll()}):\n{log}")
                time.sleep(1)
        return time.monotonic() - t0


# --- memory and metrics ---------------------------------------------------------------------------------------


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB (0 when it is gone)."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def prom_sum(text: str, name: str, **labels: str) -> float:
    """The sum of series ``name`` whose labels include ``labels``, from Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            with contextlib.suppress(ValueError):
                total += float(value)
    return total


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / var if var else 0.0


# --- the checker ----------------------------------------------------------------------------------------------


def fixed_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(length)] for _ in range(n)]


def complete(via: Host, host: str, port: int, prompt: list[int], salt: str, max_tokens: int,
             timeout: float) -> dict[str, Any]:  # fmt: skip
    """A greedy completion of ``prompt`` (token ids); ``salt`` keeps it out of every prefix cache, so each
    check is a fresh prefill and hand-off. Raises OSError for a failed request."""
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
               "ignore_eos": True, "cache_salt": salt}  # fmt: skip
    status, body = http_call(via, host, port, "POST", "/v1/completions", payload, timeout=timeout)
    if status != 200:
        raise OSError(f"HTTP {status}: {body[:300]!r}")
    answer = json.loads(body)
    choice, usage = answer["choices"][0], answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0  # KV the decoder did not compute
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"], "cached_tokens": cached}


class Checker(threading.Thread):
    """Sends the fixed prompts through the proxy, round after round, until stopped; each answer is compared
    with the reference (the same prompt's greedy answer computed before the soak)."""

    def __init__(self, via: Host, port: int, prompts: list[list[int]], reference: list[dict[str, Any]],
                 max_tokens: int, t0: float, timeout: float = 120.0):  # fmt: skip
        super().__init__(daemon=True, name="soak-checker")
        self.via, self.port, self.prompts, self.reference = via, port, prompts, reference
        self.max_tokens, self.t0, self.timeout = max_tokens, t0, timeout
        self.stop = threading.Event()
        self.checks = self.failed = self.loaded = 0  # loaded: checks whose prompt KV came over kvbridge
        self.mismatches: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.max_logprob_diff = 0.0

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            k = i % len(self.prompts)
            t = round(time.monotonic() - self.t0, 1)
            try:
                got = complete(self.via, self.via.address, self.port, self.prompts[k], f"check-{i}", self.max_tokens,
                               self.timeout)  # fmt: skip
            except (OSError, ValueError, KeyError) as exc:
                self.failed += 1
                self.errors.append({"t": t, "prompt": k, "error": str(exc)[:300]})
            else:
                want = self.reference[k]
                self.checks += 1
                self.loaded += got["cached_tokens"] > 0
                if got["text"] != want["text"] or len(got["logprobs"]) != len(want["logprobs"]):
                    self.mismatches.append({"t": t, "prompt": k, "got": got, "want": want})
                else:
                    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
                    self.max_logprob_diff = max(self.max_logprob_diff, diff)
            i += 1
            self.stop.wait(0.5)

    def report(self) -> dict[str, Any]:
        return {"checks": self.checks, "loaded_checks": self.loaded, "failed_requests": self.failed,
                "wrong_outputs": len(self.mismatches), "max_logprob_diff": self.max_logprob_diff, "mismatches": self.mismatches[:10],
                "errors": self.errors[:10]}  # fmt: skip
