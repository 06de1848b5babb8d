"""Load kvbridge's two native extensions, each on its own (sources in ``kvbridge/csrc/``, built by setup.py).

- ``kvbridge._core``: the copy threads, copies within this process and from another one
  (``process_vm_readv``), a store's file IO and crc32c.  It needs no UCX: :func:`load_core` never imports
  libucx, so the cpu, fs, chain and lmcache fast paths exist wherever kvbridge was built with a compiler.
- ``kvbridge._ucp``: the one-sided data plane over ucp (Context, Region, Endpoint).  It links against
  ``libucp.so.0`` without a usable rpath (the build prefix is gone after an isolated build), so
  :func:`load_ucp` preloads the UCX libraries first with ``libucx.load_library()``: the libucx wheel's copy,
  or a site UCX when ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` (e.g. one built with verbs for RDMA).  Once a
  soname is loaded, the dynamic linker binds the extension to it, so ucxx and kvbridge share one UCX.

Neither loader raises: a missing wheel, a build that skipped the extension, or an ABI mismatch all end in
``(None, reason)``, and the backends then take their Python paths (the ucx backend its two-sided one).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.lru_cache(maxsize=1)
def load_core() -> tuple[ModuleType | None, str]:
    """(kvbridge._core, "") when it is usable here, else (None, one-line reason). Cached; never imports UCX."""
    try:
        mod = importlib.import_module("kvbridge._core")
    except ImportError as e:
        return None, f"kvbridge._core is not importable ({e}); it is built at install time with the machine's C compiler"
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        return None, f"kvbridge._core failed to import: {type(e).__name__}: {e}"
    return mod, ""


def crc32c_module() -> ModuleType | None:
    """kvbridge._core where it loaded and this CPU has its crc32c (SSE4.2), else ``None``."""
    mod = load_core()[0]
    return mod if mod is not None and getattr(mod, "HAS_CRC32C", False) else None


@functools.lru_cache(maxsize=1)
def load_ucp() -> tuple[ModuleType | None, str]:
    """(kvbridge._ucp, "") when the one-sided module is usable here, else (None, one-line reason). Cached."""
    try:
        libucx = importlib.import_module("libucx")
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        return None, f"libucx is not importable ({type(e).__name__}: {e}); pip install 'kvbridge[ucx]'"
    try:
        libucx.load_library()
    except Exception as e:  # noqa: BLE001
        return None, f"libucx.load_library() failed: {type(e).__name__}: {e}"
    try:
        mod = importlib.import_module("kvbridge._ucp")
    except ImportError as e:
        return None, f"kvbridge._ucp is not importable ({e}); it is built at install time when UCX headers are found"
    except Exception as e:  # noqa: BLE001
        return None, f"kvbridge._ucp failed to import: {type(e).__name__}: {e}"
    try:
        major, minor, release = mod.version()
    except Exception as e:  # noqa: BLE001
        return None, f"kvbridge._ucp.version() failed: {type(e).__name__}: {e}"
    if (major, minor) < tuple(mod.API_VERSION):
        # an older libucp than the headers the module was compiled against may lack symbols or fields
        built = ".".join(map(str, mod.API_VERSION))
        return None, f"loaded UCX {major}.{minor}.{release} is older than the UCX {built} kvbridge._ucp was built with"
    return mod, ""


def describe_core() -> str:
    """One line: the core module and its checksum path, or why there is none."""
    mod, reason = load_core()
    if mod is None:
        return f"unavailable: {reason}"
    crc = "vpclmulqdq folds" if mod.HAS_CRC32C_FOLD else "sse4.2" if mod.HAS_CRC32C else "none (google-crc32c)"
    return f"kvbridge._core (crc32c: {crc})"


def describe_ucp() -> str:
    """One line: the ucp module and the UCX it loaded, or why there is none."""
    mod, reason = load_ucp()
    if mod is None:
        return f"unavailable: {reason}"
    return "kvbridge._ucp (UCX {}.{}.{})".format(*mod.version())


def describe() -> str:
    """One line for ``kvbridge backends``: both native modules, or why each is missing."""
    parts = []
    for name, fn in (("core", describe_core), ("ucp", describe_ucp)):
        try:
            parts.append(f"{name}: {fn()}")
        except Exception as e:  # noqa: BLE001 - describe() is for diagnostics and must never raise
            parts.append(f"{name}: unavailable: {type(e).__name__}: {e}")
    return "; ".join(parts)
