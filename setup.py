"""Build kvbridge's two native extensions; all other metadata lives in pyproject.toml.

- ``kvbridge._core`` (kvbridge/csrc/{args,pool,copy,file,crc32c,tcp_*,core}.c): the copy threads, copies in
  this process and from another (process_vm_readv), a store's file IO, crc32c and the tcp lane.  It needs only libc and the
  machine's compiler, so it is built everywhere: the cpu, fs, chain and lmcache fast paths and native
  checksums do not depend on UCX.
- ``kvbridge._ucp`` (kvbridge/csrc/{args,ucp_*}.c): the one-sided data plane over ucp, built against
  $UCX_HOME (a site build, e.g. one with verbs) or else the libucx wheel in the build environment
  ([build-system] requires it, in the range ucxx accepts, so build and runtime use the same wheel).
  Without UCX headers it is skipped with a warning, and the ucx backend falls back to its two-sided path.

kvbridge.native.describe() says which of the two loaded, and why not.  Both are optional: a failed
compile does not fail the install (the Python paths remain).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Extension, setup

CSRC = "kvbridge/csrc"
# -fvisibility=hidden: the parts' shared symbols (args.c is in both extensions) stay inside each .so
CFLAGS = [
    "-std=c11",
    "-O2",
    "-D_GNU_SOURCE",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
    "-Wno-cast-function-type",
]


def ucx_prefix() -> str | None:
    home = os.environ.get("UCX_HOME")
    if home:
        return home
    # find, never import: importing libucx would dlopen() UCX into the build process for nothing
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def core_extension() -> Extension:
    return Extension(
        "kvbridge._core",
        [f"{CSRC}/{name}.c" for name in ("args", "pool", "copy", "file", "crc32c", "tcp_io", "tcp_local", "tcp_serve",
                                        "tcp_read", "core")],
        depends=[f"{CSRC}/args.h", f"{CSRC}/core.h", f"{CSRC}/tcp.h"],
        libraries=["pthread"],
        extra_compile_args=CFLAGS,
        optional=True,
    )


def ucp_extension() -> list[Extension]:
    prefix = ucx_prefix()
    if prefix is None or not os.path.isfile(os.path.join(prefix, "include", "ucp", "api", "ucp.h")):
        print(
            f"WARNING: kvbridge._ucp not built: no UCX headers under {prefix or '(no libucx wheel, no $UCX_HOME)'}; "
            "install libucx-cu13 or set UCX_HOME to build it (kvbridge._core is built without it)",
            file=sys.stderr,
        )
        return []
    return [
        Extension(
            "kvbridge._ucp",
            [f"{CSRC}/{name}.c" for name in ("args", "ucp_shared", "ucp_context", "ucp_region", "ucp_endpoint", "ucp_module")],
            depends=[f"{CSRC}/args.h", f"{CSRC}/ucp.h"],
            library_dirs=[os.path.join(prefix, "lib")],
            libraries=["ucp", "ucs", "pthread"],
            # kvbridge.native preloads libucp.so.0 by soname (libucx.load_library()) before importing the
            # extension; this rpath is only a fallback for a wheel installed beside libucx in site-packages.
            # No rpath into the build prefix: under build isolation it is deleted after the build.
            runtime_library_dirs=["$ORIGIN/../libucx/lib"],
            # -isystem: UCX's own headers are not ours to warn about
            extra_compile_args=["-isystem", os.path.join(prefix, "include"), *CFLAGS],
            # a failed compile (no compiler, odd UCX) must not fail the install: the backend falls back
            optional=True,
        )
    ]


setup(ext_modules=[core_extension(), *ucp_extension()])
