"""Typed, frozen backend options, parsed from plain mappings (vLLM's ``kv_connector_extra_config``).

Each backend declares a frozen dataclass of its options. :func:`parse_options` builds it from a
mapping, converting simple string values (as they arrive from a command line or JSON), and fails at
start-up with :class:`~kvbridge.errors.ConfigError` naming the option: an unknown (misspelt) key, a
missing required one, or a value of the wrong type. Range checks live in each dataclass's
``__post_init__`` and raise ``ConfigError`` too.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.errors import ConfigError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError("; ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"option {name!r} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"option {name!r} must be a list, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(_coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"option {name!r} must be a mapping, got {type(value).__name__}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"option {name!r} must be a boolean, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"option {name!r} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"option {name!r} must be an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"option {name!r} must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"option {name!r} must be a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"option {name!r} must be a string, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"option {name!r} must be a path, got {value!r}")
        return Path(value)
    return value


def parse_options(cls: type[T], data: Mapping[str, Any] | None, *, where: str = "") -> T:
    """Build the options dataclass ``cls`` from ``data``; see the module docstring for the rules."""
    label = f"{where} " if where else ""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{label}options must be a mapping of option names to values, got {type(data).__name__} {data!r}")
    if data is not None and not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{label}option names must be strings, got {sorted(map(repr, data))}")
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {label}option(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(name, data[name], hints[name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required {label}option {name!r}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{label}options: {exc}") from exc


def require(condition: bool, message: str) -> None:
    """For ``__post_init__`` range checks: raise :class:`ConfigError` with ``message`` unless true."""
    if not condition:
        raise ConfigError(message)


def writable_directory(path: str, what: str, *, mode: int = 0o777) -> str:
    """Make sure ``path`` is a directory this process can create files in (made if missing); return its
    absolute path. A regular file, a folder without write permission or a pseudo filesystem (``/proc``,
    ``/sys``) raises :class:`ConfigError` naming ``what`` (e.g. ``"fs option 'path'"``) and the cause.
    ``mode``: of the folders it makes (less the umask).
    The check creates and removes one empty file: ``os.access`` says yes to root on a read-only mount."""
    full = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(full, mode=mode, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvbridge-probe-", dir=full)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise ConfigError(f"{what}: {full} exists and is not a directory") from None
    except OSError as exc:
        reason = "is not a directory" if exc.errno == errno.ENOTDIR else f"is not writable ({exc.strerror})"
        raise ConfigError(f"{what}: {full} {reason}; name a writable directory") from None
    return full


__all__ = ["parse_options", "require", "writable_directory"]
