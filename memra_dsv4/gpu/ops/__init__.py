"""Launch wrappers of the kernels_cu/ kernels: one small module per op family.

Contract
--------
* Importing this package (or any module in it) never imports CuPy: every module registers its
  kernels with ``memra_dsv4.gpu.kernel_loader.register(STEM, KERNELS)`` at import (pure Python)
  and imports CuPy inside the functions.  ``tests/test_kernel_sources.py`` checks on the CPU
  that every name in every ``KERNELS`` exists as an ``extern "C" __global__`` in
  ``kernels_cu/<STEM>.cu``.
* Kernels come from the process-wide ``kernel_loader.get_loader(device)`` (compiled once,
  cached RawKernels; ``_common.kernel`` asks through ``kernel_loader.lookup``, its memo);
  launches go to the current CuPy stream.
* Every op takes CuPy arrays in the storage convention of the arena (bf16 = uint16 bits,
  FP8/FP4/e8m0 = uint8, int32 indices) and optional ``out=`` arrays.  With ``out=`` given a
  wrapper allocates nothing; it asserts shapes, dtypes and contiguity, and passes integer
  arguments as ``np.int32`` (CuPy would pass a Python int as long long).
* The NumPy twin of each op is named in its docstring; tests/gpu/test_kernels_<family>.py
  compare them.
"""

from __future__ import annotations

FAMILIES = ("rmsnorm", "rope", "quant_sim", "hc", "compressor", "indexer", "attention",
            "router", "experts", "moe", "dense", "convert")
# Wrapper modules whose kernels live in a family's .cu file (prefill_moe: experts.cu).
EXTRA_WRAPPERS = ("prefill_moe",)

__all__ = list(FAMILIES) + list(EXTRA_WRAPPERS) + ["FAMILIES", "EXTRA_WRAPPERS", "kernel_names"]


def kernel_names() -> dict[str, tuple[str, ...]]:
    """{stem: KERNELS} of every wrapper module (imports them; no CuPy needed); a stem with two
    wrapper modules (experts: experts, prefill_moe) lists both modules' kernels."""
    import importlib

    out = {}
    for fam in FAMILIES + EXTRA_WRAPPERS:
        mod = importlib.import_module(f"memra_dsv4.gpu.ops.{fam}")
        out[mod.STEM] = out.get(mod.STEM, ()) + tuple(mod.KERNELS)   # a stem may have 2 wrappers
    return out
