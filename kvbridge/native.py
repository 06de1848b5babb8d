"""Load kvbridge's native one-sided data plane (``kvbridge._ucp``, built from ``kvbridge/_ucp.c``).

The extension links against ``libucp.so.0`` without a usable rpath (the build prefix is gone after an
isolated build), so the UCX libraries are preloaded first by ``libucx.load_library()``: the libucx wheel's
copy, or a site UCX when ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` (e.g. one built with verbs for RDMA).
Once a soname is loaded, the dynamic linker binds the extension to it, so ucxx and kvbridge share one UCX.

``load()`` never raises: a missing wheel, a build that skipped the extension, or an ABI mismatch all end in
``(None, reason)``, and the ucx backend then uses its two-sided path.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.lru_cache(maxsize=1)
def load() -> tuple[ModuleType | None, str]:
    """(kvbridge._ucp, "") when the native module is usable here, else (None, one-line reason). Cached."""
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


def describe() -> str:
    """One line for ``kvbridge backends``: which native path is active, or why there is none."""
    try:
        mod, reason = load()
        if mod is None:
            return f"unavailable: {reason}"
        return "native kvbridge._ucp (UCX {}.{}.{})".format(*mod.version())
    except Exception as e:  # noqa: BLE001 - describe() is for diagnostics and must never raise
        return f"unavailable: {type(e).__name__}: {e}"
