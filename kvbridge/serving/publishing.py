"""An engine's prefix cache, published to a block directory so that a router sends prompts where their
prefix already is (``kvbridge proxy --directory URL``, :class:`~kvbridge.serving.routing.DirectoryView`).

Configured in ``kv_connector_extra_config`` (the adapter's own keys, beside ``backend`` and
``namespace``; every one checked at start-up)::

    "directory": "redis://10.0.0.9:6379/0",      # or grpc://HOST:PORT of a kvbridge metadata-server
    "advertise_url": "http://10.0.0.5:8000",      # how the proxy names this engine (required with it)
    "directory_ttl_s": 30                         # the engine's lease: gone from lookups this long after it dies

What is published: the route keys (:func:`kvbridge.keys.route_keys`: 16-token chunks in the namespace of
the served model name) of every full block the engine's prefix cache holds, under the holder
``advertise_url``, renewed by heartbeats (:class:`~kvbridge.metadata.holdings.Holdings`). Two feeds:

- **vLLM's own KV-cache events**, where the engine publishes them (``--kv-events-config
  '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``): a subscriber
  in the scheduler's process adds the chunks of each ``BlockStored`` block and takes back those of each
  ``BlockRemoved`` one once no medium holds it (vLLM's GPU cache, a kvbridge tier: a block evicted from
  the GPU but still in the engine's cpu tier stays published), so the directory follows evictions exactly. A block is keyed from its
  parent's key, so a block whose parent was never seen (events dropped by ZMQ under load, a
  subscriber that joined late) is skipped: a miss for routing, never a wrong answer.
- **Otherwise, each request's end**: the chunks of its computed full blocks (prompt and output: the
  next turn of a conversation starts with both), at most the engine's number of KV blocks of them
  (oldest first out), which stands in for vLLM's LRU eviction.

Routing is a hint: a key published for a block vLLM already evicted costs that request a recompute,
nothing else. An engine that runs no kvbridge connector can be followed from beside it: ``kvbridge
publish --kv-events tcp://HOST:5557 --directory URL --advertise-url URL --model NAME`` (:func:`run`) does
the same from its KV-cache events, with no cost in the engine's own steps. Not in the keys: a request's ``cache_salt`` where the events feed them (vLLM's events
do not carry it), and multimodal inputs (a router does not hash images).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import signal
import threading
from typing import Any

from kvbridge.addresses import parse_http_url
from kvbridge.errors import ConfigError
from kvbridge.keys import ROUTE_TOKENS, route_keys
from kvbridge.metadata.holdings import Holdings, check_directory_url, open_directory
from kvbridge.routable import is_wildcard

log = logging.getLogger(__name__)

KEYS = ("directory", "advertise_url", "directory_ttl_s")


@dataclasses.dataclass(frozen=True)
class PublishOptions:
    directory: str
    advertise_url: str
    ttl_s: float = 30.0

    @classmethod
    def pop(cls, options: dict[str, Any]) -> PublishOptions | None:
        """Take this module's keys out of ``options`` (the rest are the backend's); ``None`` without a directory."""
        given = {k: options.pop(k) for k in KEYS if k in options}
        if not given.get("directory"):
            if given:
                raise ConfigError(f"kv_connector_extra_config {sorted(given)} need 'directory' (redis://HOST:PORT/DB or grpc://HOST:PORT)")
            return None
        url = given.get("advertise_url")
        if not isinstance(url, str) or not url:
            raise ConfigError("kv_connector_extra_config 'directory' needs 'advertise_url': this engine's http://HOST:PORT as the proxy names it")
        parse_http_url(url, what="kv_connector_extra_config 'advertise_url'")
        ttl = given.get("directory_ttl_s", 30.0)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ConfigError(f"kv_connector_extra_config 'directory_ttl_s' must be positive seconds, got {ttl!r}")
        return cls(check_directory_url(str(given["directory"])), url.strip().rstrip("/"), float(ttl))


def served_name(vllm_config: Any) -> str:
    """The model name clients send (``--served-model-name``'s first, else the model path)."""
    name = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    return str(name[0] if isinstance(name, (list, tuple)) else name)


def request_model(request: Any, default: str) -> str:
    lora = getattr(request, "lora_request", None)
    return str(getattr(lora, "lora_name", "") or default) if lora is not None else default


class CachePublisher:
    """The scheduler side's publisher (see the module docstring); ``finished`` is called per request."""

    def __init__(self, options: PublishOptions, vllm_config: Any, block_size: int, num_blocks: int):
        if block_size % ROUTE_TOKENS:
            raise ConfigError(f"routing keys need a block size that is a multiple of {ROUTE_TOKENS}, got {block_size}")
        self.block_size, self.model = block_size, served_name(vllm_config)
        per_block = block_size // ROUTE_TOKENS
        self.holdings = Holdings(open_directory(options.directory), options.advertise_url, address=options.advertise_url,
                                 ttl_s=options.ttl_s, capacity=num_blocks * per_block or 1 << 20)  # fmt: skip
        self.events: KVEventFeed | None = None
        endpoint = kv_events_endpoint(vllm_config)
        if endpoint is not None:
            self.events = KVEventFeed(endpoint[0], endpoint[1], self.holdings, self.model)
        log.info("kvbridge: publishing the prefix cache to %s as %s (%s)", options.directory, options.advertise_url,
                 f"vLLM KV events from {endpoint[0]}" if endpoint else "at each request's end")  # fmt: skip

    def finished(self, request: Any) -> None:
        if self.events is not None:
            return  # the events say it, evictions included
        computed = int(getattr(request, "num_computed_tokens", 0) or 0) // self.block_size * self.block_size
        tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids or ())[:computed]
        if tokens:
            salt = str(getattr(request, "cache_salt", None) or "")
            self.holdings.hold(route_keys(tokens, request_model(request, self.model), salt=salt))

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.holdings.close()


def kv_events_endpoint(vllm_config: Any) -> tuple[str, str] | None:
    """(endpoint to connect to, topic) of the engine's own ZMQ KV-event publisher, if it has one."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False) or getattr(cfg, "publisher", "") != "zmq":
        return None
    endpoint = str(cfg.endpoint)
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    if dp_rank:  # each data-parallel engine publishes on the port after the last one's
        from vllm.distributed.kv_events import ZmqEventPublisher

        endpoint = str(ZmqEventPublisher.offset_endpoint_port(endpoint, dp_rank))
    host, port = _tcp_parts(endpoint)
    if host is not None and _every_interface(host):  # the publisher binds every interface; we are on its host
        if port == "0":
            raise ConfigError(f"--kv-events-config endpoint {endpoint}: port 0 (the OS picks one) cannot be followed; "
                              "set a fixed port, e.g. tcp://*:5557")  # fmt: skip
        endpoint = f"tcp://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"  # loopback of the family it bound
    return endpoint, str(getattr(cfg, "topic", "") or "")


def _tcp_parts(endpoint: str) -> tuple[str | None, str]:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint (``HOST`` as written, IPv6 in brackets); no host for others."""
    if not endpoint.startswith("tcp://"):
        return None, ""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, port


def _every_interface(host: str) -> bool:
    """A bind address, not one to dial: :func:`kvbridge.routable.is_wildcard`'s spellings and ZMQ's ``*``."""
    return host == "*" or is_wildcard(host)


def subscriber_endpoint(endpoint: str) -> str:
    """``endpoint`` checked as one a subscriber connects to: ``tcp://HOST:PORT`` (IPv4, a name, or IPv6 in
    brackets) or ``ipc://`` / ``inproc://``; a wildcard is a :class:`ConfigError` naming what to give."""
    host, port = _tcp_parts(endpoint)
    if host is None:
        if endpoint.startswith(("ipc://", "inproc://")):
            return endpoint
        raise ConfigError(f"KV-event endpoint {endpoint!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"KV-event endpoint {endpoint!r}: expected tcp://HOST:PORT with a port in 1..65535")
    if _every_interface(host):
        loop = "[::1]" if ":" in host else "127.0.0.1"
        raise ConfigError(f"KV-event endpoint {endpoint!r} names every interface, which the engine binds, not an "
                          f"address to connect to: give the engine's host (tcp://{loop}:{port} on its machine)")
    if ":" in host and not host.startswith("["):
        raise ConfigError(f"KV-event endpoint {endpoint!r}: an IPv6 address goes in brackets, tcp://[{host}]:{port}")
    return endpoint


class KVEventFeed:
    """Subscribes to vLLM's KV-cache events and turns them into route keys held or dropped.

    Each vLLM block hash maps to its chunks' keys (a chunk may be named by several blocks: the
    same tokens in two KV-cache groups, so it is dropped when the last of them is removed) and to
    the media that hold it (``medium``: vLLM's GPU prefix cache, a kvbridge tier's ``CPU`` or
    ``DISK``, ...). A block stays published while any medium holds it: the GPU cache evicting a
    block that the engine's cpu tier still holds takes nothing back. ``AllBlocksCleared`` names no
    medium, so it takes back everything (a router may then under-count, never over-count).
    """

    def __init__(self, endpoint: str, topic: str, holdings: Holdings, model: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.holdings, self.model = holdings, model
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        endpoint = subscriber_endpoint(endpoint)
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.IPV6, 1)  # an IPv6 endpoint connects too; IPv4 ones still do
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)  # so the thread sees close()
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._again = zmq.Again
        self._keys: dict[tuple[Any, Any], list[bytes]] = {}  # (group, vLLM block hash) -> its chunks' keys
        self._media: dict[tuple[Any, Any], set[Any]] = {}  # (group, vLLM block hash) -> the media holding it
        self._refs: collections.Counter[bytes] = collections.Counter()
        self._stop = threading.Event()
        self.seen = 0  # events applied (for tests)
        self._thread = threading.Thread(target=self._run, name="kvbridge-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except self._again:
                continue
            except Exception as exc:  # a closed context at shutdown
                if not self._stop.is_set():
                    log.warning("kvbridge: KV-event subscriber stopped: %s", exc)
                return
            try:
                batch = self._decoder.decode(parts[-1])
            except Exception as exc:  # not vLLM's format: say so once per batch, keep listening
                log.warning("kvbridge: undecodable KV-event batch (%s)", exc)
                continue
            for event in batch.events:
                self.apply(event)

    def apply(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            self._removed(event)
        elif kind == "AllBlocksCleared":
            self._keys.clear()
            self._media.clear()
            self._refs.clear()
            self.holdings.clear()
        self.seen += 1

    def _stored(self, event: Any) -> None:
        group = getattr(event, "group_idx", None)  # each KV-cache group stores its own block of a position
        prev: bytes | None = None
        if event.parent_block_hash is not None:
            chain = self._keys.get((group, event.parent_block_hash))
            if not chain:
                return  # a parent never seen: these blocks cannot be keyed
            prev = chain[-1]
        lora = getattr(event, "lora_name", None)
        model, size = str(lora or self.model), int(event.block_size)
        extras = getattr(event, "extra_keys", None) or [None] * len(event.block_hashes)
        added: list[bytes] = []
        for i, block_hash in enumerate(event.block_hashes):
            if any(e != lora for e in extras[i] or ()):
                break  # a salt, an image, embeddings: a router cannot key it (nor anything after it)
            keys = route_keys(event.token_ids[i * size : (i + 1) * size], model, parent=prev)
            if len(keys) != size // ROUTE_TOKENS:
                break  # not a full block
            if (group, block_hash) not in self._keys:
                self._keys[(group, block_hash)] = keys
                self._refs.update(keys)
                added += keys
            self._media.setdefault((group, block_hash), set()).add(event.medium)
            prev = keys[-1]
        self.holdings.hold(added)

    def _removed(self, event: Any) -> None:
        group = getattr(event, "group_idx", None)
        gone: list[bytes] = []
        for block_hash in event.block_hashes:
            media = self._media.get((group, block_hash))
            if media is None:
                continue
            media.discard(event.medium)
            if media:
                continue  # another medium (a kvbridge tier, the GPU cache) still holds it
            del self._media[(group, block_hash)]
            for key in self._keys.pop((group, block_hash), ()):
                self._refs[key] -= 1
                if self._refs[key] <= 0:
                    del self._refs[key]
                    gone.append(key)
        self.holdings.drop(gone)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


# ---- kvbridge publish: the same from beside an engine that runs no kvbridge connector ------------------


def configure(parser: argparse.ArgumentParser) -> None:
    from kvbridge.serving.proxy import checked, positive_seconds

    parser.description = ("Follow a vLLM engine's KV-cache events (--kv-events-config with the zmq publisher) and keep "
                          "its prefix cache published in a block directory for kvbridge proxy --directory.")  # fmt: skip
    parser.add_argument("--kv-events", required=True, metavar="tcp://HOST:PORT", type=checked(subscriber_endpoint),
                        help="the engine's KV-event endpoint (IPv6: tcp://[ADDR]:PORT)")  # fmt: skip
    parser.add_argument("--topic", default="", help="the engine's KV-event topic (default none)")
    parser.add_argument("--directory", required=True, metavar="URL", type=checked(check_directory_url),
                        help="redis://HOST:PORT/DB or grpc://HOST:PORT")  # fmt: skip
    parser.add_argument("--advertise-url", required=True, metavar="URL", type=checked(lambda t: parse_http_url(t, what="--advertise-url")),
                        help="the engine's http://HOST:PORT as the proxy names it")  # fmt: skip
    parser.add_argument("--model", required=True, help="the engine's served model name (what clients send as model)")
    parser.add_argument("--ttl", type=positive_seconds, default=30.0, help="the lease, seconds (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    url = args.advertise_url.strip().rstrip("/")
    holdings = Holdings(open_directory(args.directory), url, address=url, ttl_s=args.ttl)
    feed = KVEventFeed(args.kv_events, args.topic, holdings, args.model)
    print(f"kvbridge publish: {args.kv_events} -> {args.directory} as {url} (model {args.model})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    feed.close()
    holdings.close()
    return 0


__all__ = ["KEYS", "CachePublisher", "KVEventFeed", "PublishOptions", "configure", "kv_events_endpoint", "run", "served_name",
           "subscriber_endpoint"]
