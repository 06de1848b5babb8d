"""Block keys: a stable, prefix-chained name for every full block of prompt tokens.

A store finds a block by the tokens that produced it *and every token before it* (the KV of a token
depends on its whole prefix). The key of block ``i`` is::

    key[-1] = sha256(b"kvbridge-keys-v1" + namespace)
    key[i]  = sha256(key[i-1] + tokens[i*B:(i+1)*B] as little-endian int64)[:KEY_BYTES]

where ``B`` is the block size and ``namespace`` separates what must not share KV (model, adapter,
cache salt). A block whose KV depends on more than its token ids — an image behind placeholder
tokens, prompt embeddings — gets that too, as ``extras[i]`` (bytes naming it, e.g. the image's hash
and where it starts in the block), folded in as ``sha256(key[i-1] + tokens + b"\x00extra" + extras[i])``;
the chain carries it into every later key. Blocks without extras keep the plain form. Only full
blocks have keys. The hash depends on nothing but its inputs: it is the same
in every process, on every machine, whatever ``PYTHONHASHSEED`` says (Python's ``hash()`` is salted
per process and is never used). Engines that compute their own stable hashes can pass them through
:func:`engine_keys` instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

KEY_BYTES = 16
_DOMAIN = b"kvbridge-keys-v1"
_EXTRA = b"\x00extra"  # never a suffix of whole int64 tokens alone: the lengths differ


def namespace_key(namespace: str | bytes = b"") -> bytes:
    """The chain's root for a namespace (the ``key[-1]`` above)."""
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return hashlib.sha256(_DOMAIN + ns).digest()[:KEY_BYTES]


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    namespace: str | bytes = b"",
    parent: bytes | None = None,
    extras: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """Keys of every full block of ``token_ids``; a trailing partial block has none.

    ``parent`` continues a chain (the key of the block just before ``token_ids[0]``); ``extras`` maps
    a block's index to what else its KV depends on (see the module docstring).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype="<i8").reshape(-1)
    raw = tokens[: (tokens.size // block_size) * block_size].tobytes()
    step = block_size * 8
    prev = namespace_key(namespace) if parent is None else parent
    keys: list[bytes] = []
    extras = extras or {}
    for i, off in enumerate(range(0, len(raw), step)):
        extra = extras.get(i)
        data = prev + raw[off : off + step] if extra is None else prev + raw[off : off + step] + _EXTRA + extra
        prev = hashlib.sha256(data).digest()[:KEY_BYTES]
        keys.append(prev)
    return keys


def group_key(key: bytes, group: int) -> bytes:
    """The key of one KV-cache group's block at the position ``key`` names (vLLM's hybrid manager keeps
    a block per group per position: a sliding-window layer's KV is not a full-attention layer's)."""
    return hashlib.sha256(key + b"\x00group" + group.to_bytes(4, "little")).digest()[:KEY_BYTES]


ROUTE_TOKENS = 16  # the granularity of routing keys: every engine block size vLLM uses is a multiple
_ROUTE_DOMAIN = "kvbridge-route-v1"


def route_keys(token_ids: Sequence[int] | np.ndarray, model: str, *, salt: str = "", parent: bytes | None = None,
               chunk: int = ROUTE_TOKENS) -> list[bytes]:  # fmt: skip
    """Keys a router can compute and an engine can publish: every full ``chunk`` of ``token_ids``,
    chained like :func:`block_keys`, in a namespace of the *served* model name (the ``model`` of an
    OpenAI request) and the request's ``cache_salt``.

    They are not the block keys a store uses: those carry dtypes, revision and block size, which a
    router does not know. A fixed chunk of 16 tokens divides every engine's block size, so an engine
    publishes the chunks of its full blocks and a router needs no block size to ask. ``parent`` (the
    key of the chunk just before ``token_ids[0]``) continues a chain, as in :func:`block_keys`."""
    namespace = f"{_ROUTE_DOMAIN}|model={model}" + (f"|salt={salt}" if salt else "")
    return block_keys(token_ids, chunk, namespace=namespace, parent=parent)


def engine_keys(hashes: Iterable[bytes | int | str]) -> list[bytes]:
    """Turn an engine's own per-block hashes into kvbridge keys (bytes), unchanged in meaning.

    Use this only where the engine's hashes are stable across processes (for vLLM: only with
    ``PYTHONHASHSEED`` set); otherwise use :func:`block_keys` on the prompt tokens.
    """
    out: list[bytes] = []
    for h in hashes:
        if isinstance(h, bytes):
            out.append(h)
        elif isinstance(h, int):
            out.append(h.to_bytes(32, "little", signed=True))
        elif isinstance(h, str):
            out.append(h.encode())
        else:
            raise TypeError(f"unsupported block hash type {type(h).__name__}")
    return out


__all__ = ["KEY_BYTES", "ROUTE_TOKENS", "block_keys", "engine_keys", "group_key", "namespace_key", "route_keys"]
