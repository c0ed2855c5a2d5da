"""memra_dsv4.gpu: the CuPy side of the runtime (devices, arena, kernels, cuBLASLt, graphs).

Contract
--------
* Importing this package (or any module in it) never imports CuPy or nvmath: every module
  imports them inside the functions that need them, so ``import memra_dsv4`` and the CPU tests
  (arena planner, GEMM plan keys, placement) run on machines without CUDA.
* Importing this package sets ``CUPY_CACHE_DIR`` to a directory the project owns unless the
  variable is already set: ``<repo>/.memra_cache/cupy`` when the package lives in a writable
  checkout, else ``~/.memra_cache/cupy``.  CuPy 14 reads the variable once, when ``cupy`` is
  imported, so this must run first; ``kernel_loader.configure_cache_dir()`` repairs the case
  where something imported CuPy earlier (it swaps CuPy's disk cache backend).
* Modules:
    - ``runtime``        devices, streams, peer access, version check, debug sync, boundary copy
    - ``arena``          the CPU planner (``ArenaPlan``) and one device allocation carved into views
    - ``kernel_loader``  one ``cupy.RawModule`` per ``kernels_cu/<stem>.cu``, compiled at warmup
    - ``blaslt``         cuBLASLt GEMM plans (bf16, FP8 block-scaled) via ``nvmath.bindings``
    - ``graphs``         CUDA-graph capture/replay, one- and two-device
"""

from __future__ import annotations

import os

__all__ = ["runtime", "arena", "kernel_loader", "blaslt", "graphs", "default_cache_dir"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(_PKG_DIR))


def default_cache_dir() -> str:
    """``<repo>/.memra_cache/cupy`` for an in-place checkout we can write, else under ``~``."""
    in_checkout = os.path.isfile(os.path.join(REPO_ROOT, "pyproject.toml"))
    if in_checkout and os.access(REPO_ROOT, os.W_OK):
        return os.path.join(REPO_ROOT, ".memra_cache", "cupy")
    return os.path.join(os.path.expanduser("~"), ".memra_cache", "cupy")


os.environ.setdefault("CUPY_CACHE_DIR", default_cache_dir())
