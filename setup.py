"""Build kvbridge._ucp (kvbridge/_ucp.c) against UCX; all other metadata lives in pyproject.toml.

UCX comes from $UCX_HOME (a site build, e.g. one with verbs) or else the libucx wheel in the build
environment ([build-system] requires it, in the range ucxx accepts, so build and runtime use the same
wheel).  Without UCX headers the extension is skipped with a warning: kvbridge still installs, and the ucx
backend falls back to its two-sided path (kvbridge.native.describe() says why).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Extension, setup


def ucx_prefix() -> str | None:
    home = os.environ.get("UCX_HOME")
    if home:
        return home
    # find, never import: importing libucx would dlopen() UCX into the build process for nothing
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def native_extensions() -> list[Extension]:
    prefix = ucx_prefix()
    if prefix is None or not os.path.isfile(os.path.join(prefix, "include", "ucp", "api", "ucp.h")):
        print(
            f"WARNING: kvbridge._ucp not built: no UCX headers under {prefix or '(no libucx wheel, no $UCX_HOME)'}; "
            "install libucx-cu13 or set UCX_HOME to build it",
            file=sys.stderr,
        )
        return []
    return [
        Extension(
            "kvbridge._ucp",
            ["kvbridge/_ucp.c"],
            library_dirs=[os.path.join(prefix, "lib")],
            libraries=["ucp", "ucs", "pthread"],
            # kvbridge.native preloads libucp.so.0 by soname (libucx.load_library()) before importing the
            # extension; this rpath is only a fallback for a wheel installed beside libucx in site-packages.
            # No rpath into the build prefix: under build isolation it is deleted after the build.
            runtime_library_dirs=["$ORIGIN/../libucx/lib"],
            # -isystem: UCX's own headers are not ours to warn about
            extra_compile_args=[
                "-isystem",
                os.path.join(prefix, "include"),
                "-std=c11",
                "-O2",
                "-D_GNU_SOURCE",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
                "-Wno-cast-function-type",
            ],
            # a failed compile (no compiler, odd UCX) must not fail the install: the backend falls back
            optional=True,
        )
    ]


setup(ext_modules=native_extensions())
