"""Network addresses as users type them, parsed strictly once: ``HOST:PORT`` and ``http(s)://`` URLs.

Every listener and every upstream kvbridge takes from a user (``--listen``, ``--prefill``, a
``metadata_address`` option) goes through here, so a typo fails at start-up with one line that says
what was wrong and what to write — never a port that silently wraps (``99999``), a default port
nobody asked for, or a traceback.

- ``HOST:PORT``: HOST is a name (letters, digits, ``.``, ``-``, ``_``), an IPv4 address, or an IPv6
  address in brackets (``[::1]:5000``); PORT is 0-65535 (0 only where a listener may pick one).
- URL: ``http://HOST[:PORT][/prefix]`` or ``https://...``; a bare ``HOST:PORT`` means ``http://``.
  A bare word (``foo``) is refused: it is almost always a forgotten port, not a host on port 80.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

from kvbridge.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?")
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.%a-zA-Z0-9]+\]|[^\[\]:/\s]+):(?P<port>[0-9]+)")


@dataclasses.dataclass(frozen=True)
class HostPort:
    host: str  # as written; IPv6 without its brackets
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _check_host(host: str, text: str, what: str) -> str:
    if host.startswith("["):
        inner = host[1:-1]
        if ":" not in inner:
            raise ConfigError(f"{what}: {text!r} has brackets around {inner!r}, which is not an IPv6 address")
        return inner
    if not _NAME.fullmatch(host):
        raise ConfigError(f"{what}: {text!r} has no usable host name {host!r}")
    return host


def _check_port(port: str, text: str, what: str, allow_zero: bool) -> int:
    value = int(port)
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise ConfigError(f"{what}: port {value} in {text!r} is out of range ({low}-65535)")
    return value


def parse_host_port(text: str, *, what: str = "address", allow_zero: bool = False) -> HostPort:
    """``HOST:PORT`` -> :class:`HostPort`; :class:`~kvbridge.errors.ConfigError` naming ``what`` otherwise."""
    if not isinstance(text, str):
        raise ConfigError(f"{what}: expected HOST:PORT, got {type(text).__name__}")
    m = _HOST_PORT.fullmatch(text.strip())
    if m is None:
        hint = "0-65535" if allow_zero else "1-65535"
        raise ConfigError(f"{what}: expected HOST:PORT (e.g. 127.0.0.1:8000, [::1]:8000; port {hint}), got {text!r}")
    host = _check_host(m["host"], text, what)
    return HostPort(host, _check_port(m["port"], text, what, allow_zero))


@dataclasses.dataclass(frozen=True)
class HttpUrl:
    scheme: str  # "http" or "https"
    host: str
    port: int
    prefix: str  # path without its trailing slash ("" for none)

    def __str__(self) -> str:
        return f"{self.scheme}://{HostPort(self.host, self.port)}{self.prefix}"


def parse_http_url(text: str, *, what: str = "URL") -> HttpUrl:
    """``http(s)://HOST[:PORT][/prefix]`` or ``HOST:PORT`` -> :class:`HttpUrl`; ``ConfigError`` otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what}: expected http://HOST:PORT, got {text!r}")
    text = text.strip()
    if "://" not in text:
        if not _HOST_PORT.fullmatch(text):
            raise ConfigError(f"{what}: {text!r} is not a URL; write http://HOST:PORT (or HOST:PORT)")
        text = f"http://{text}"
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{what}: {text!r} is not an http:// or https:// URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{what}: {text!r} may not carry a query, fragment or credentials")
    netloc = parts.netloc
    if re.fullmatch(r"(\[[^\]]+\]|[^\[\]:]+)", netloc):  # no port written: the scheme's own
        netloc += ":443" if parts.scheme == "https" else ":80"
    try:
        hp = parse_host_port(netloc, what=what)
    except ConfigError:
        raise ConfigError(f"{what}: {text!r} has no usable HOST[:PORT] ({parts.netloc!r})") from None
    return HttpUrl(parts.scheme, hp.host, hp.port, parts.path.rstrip("/"))


__all__ = ["HostPort", "HttpUrl", "parse_host_port", "parse_http_url"]
