"""What the proxy says to its upstream servers: one call with a deadline (:class:`Upstream`, errors as
:class:`UpstreamError`), the prefill and decode requests made from a client's request, and how a prompt's
tokens are found for cache-aware routing (the client's ids, the proxy's own tokenizer, or the engine's
``/tokenize``). Standard library only, but for ``--tokenizer``'s transformers."""

from __future__ import annotations

import http.client
import json
from typing import Any

from kvbridge.addresses import parse_http_url
from kvbridge.errors import ConfigError


class UpstreamError(Exception):
    """An upstream call failed: unreachable, timed out, or answered with an error status."""

    def __init__(self, url: str, message: str, status: int = 502, body: bytes = b""):
        super().__init__(f"{url}: {message}")
        self.url, self.status, self.body = url, status, body


class Upstream:
    """One OpenAI-compatible server, given by its base URL (``http://host:port[/prefix]``)."""

    def __init__(self, url: str, timeout: float):
        parsed = parse_http_url(url, what="upstream")
        if not timeout > 0:
            raise ConfigError(f"upstream timeout must be positive, got {timeout}")
        self.url = url
        self.scheme, self.host, self.port, self.prefix = parsed.scheme, parsed.host, parsed.port, parsed.prefix
        self.timeout = timeout

    def open(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """Send a request and return the response once its headers arrived (the body is unread)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, self.prefix + path, body=body, headers=headers or {})
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise UpstreamError(self.url, f"{type(exc).__name__}: {exc}") from exc

    def metrics_text(self) -> str:
        """Its ``/metrics`` page (for the router's poller; a short deadline of its own)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=min(self.timeout, 2.0))
        try:
            conn.request("GET", self.prefix + "/metrics")
            resp = conn.getresponse()
            return resp.read().decode(errors="replace") if resp.status == 200 else ""
        finally:
            conn.close()

    def post_json(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST ``payload``; the decoded JSON answer. Errors -> :class:`UpstreamError`."""
        resp = self.open("POST", path, json.dumps(payload).encode(), {**headers, "Content-Type": "application/json"})
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(self.url, f"reading the answer: {exc}") from exc
        finally:
            resp.close()
        if resp.status >= 500:
            raise UpstreamError(self.url, f"answered {resp.status}: {body[:500].decode(errors='replace')}")
        if resp.status >= 400:  # the client's request was bad: let the client see the server's answer
            raise UpstreamError(self.url, f"answered {resp.status}", status=resp.status, body=body)
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise UpstreamError(self.url, f"answered non-JSON: {body[:200]!r}") from exc
        if not isinstance(answer, dict):
            raise UpstreamError(self.url, "answered JSON that is not an object")
        return answer


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, no streaming, a hand-off requested."""
    req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    req.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    return req


def decode_request(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The original request, with the prefill server's ``kv_transfer_params`` attached."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params is not None else dict(body)


_CHAT_TOKENIZE = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "tools", "add_special_tokens")  # fmt: skip


class LocalTokenizer:
    """The engines' tokenizer in the proxy (``--tokenizer``), for completion prompts: the same ids as the
    engine's, which tokenizes them with the same Hugging Face tokenizer and ``add_special_tokens``."""

    def __init__(self, name: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError("proxy --tokenizer needs transformers: pip install transformers") from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"proxy --tokenizer {name!r}: cannot load it ({exc})") from exc

    def __call__(self, request: dict[str, Any]) -> list[int] | None:
        if "prompt" not in request:
            return None  # chat: the engine's own /tokenize applies its chat template
        return list(self._tok(request["prompt"], add_special_tokens=bool(request.get("add_special_tokens", True)))["input_ids"])


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """What gives this request's prompt tokens: the token ids themselves when the client sent ids, else
    the ``/tokenize`` request that makes the engine tokenize it as it will (same special tokens, same
    chat template options); ``None`` for what cannot be routed by prefix (a batch of prompts)."""
    if "messages" in body:
        return {k: body[k] for k in _CHAT_TOKENIZE if k in body}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        return {"model": body.get("model", ""), "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    return None


__all__ = ["LocalTokenizer", "Upstream", "UpstreamError", "decode_request", "prefill_request", "tokenize_request"]
