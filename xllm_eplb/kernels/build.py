"""Builds the fused CPU MoE kernel (``csrc/``) with torch's C++ extension machinery.

``python -m xllm_eplb.kernels`` (run by ``make install``) compiles the sources into
``_build/<tag>/xllm_eplb_kernels_<tag>.so``; ``tag`` hashes the sources, the flags, the torch
version and the compiler, so a changed source or a new torch builds a new library and a stale
one is never loaded. :func:`library_path` says where the library of the current sources lives
(:mod:`xllm_eplb.kernels` loads it from there, or falls back to the torch path).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("ops.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_generic.cpp")
HEADERS = ("isa.h", "tiles.h", "scalar.h")
#: -ffp-contract=off: no multiply-add fused by the compiler's choice (the kernels write their
#: FMAs explicitly), so every instantiation of a tile computes a row in the same way
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-strict-aliasing")
LDFLAGS = ("-fopenmp",)


def tag() -> str:
    """Hash of what the library is built from: sources, flags, torch version, compiler."""
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((HERE / "csrc" / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(str(shutil.which("c++") or shutil.which("g++")).encode())
    return h.hexdigest()[:16]


def library_path(t: str | None = None) -> Path:
    """Where the library of the current sources is (or would be) built."""
    t = t or tag()
    return HERE / "_build" / t / f"xllm_eplb_kernels_{t}.so"


def build(verbose: bool = False) -> Path:
    """Compile (if not already built) and return the library's path; raises on a failed build."""
    from torch.utils import cpp_extension

    t = tag()
    path = library_path(t)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=f"xllm_eplb_kernels_{t}",
        sources=[str(HERE / "csrc" / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(path.parent),
        is_python_module=False,
        verbose=verbose,
    )
    if not path.exists():
        raise RuntimeError(f"the build finished but {path} is missing")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xllm_eplb.kernels",
                                 description="Build the fused CPU MoE kernel (C++ extension).")
    ap.add_argument("--verbose", action="store_true", help="print the compiler commands")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when the build fails (default: report it and exit 0, the "
                         "engine then runs the torch path)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = build(verbose=a.verbose)
    except Exception as e:  # noqa: BLE001 - any compiler or toolchain failure is reported
        print(f"xllm-eplb kernels: build failed ({type(e).__name__}: {e}); the engine will use "
              f"--moe_kernel=torch", file=sys.stderr)
        return 1 if a.strict else 0
    import torch

    torch.ops.load_library(str(path))
    isas = list(torch.ops.xllm_eplb.isas())
    print(f"xllm-eplb kernels: {path.relative_to(HERE.parent.parent)} "
          f"({time.perf_counter() - t0:.1f} s; isa {', '.join(isas)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
