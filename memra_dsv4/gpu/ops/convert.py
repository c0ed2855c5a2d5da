"""bf16 <-> f32 conversions (kernels_cu/convert.cu): the raw-kernel form of ops_glue's helpers.

f32_to_bf16_bits(x)  float32 -> uint16 bf16 bits, RNE        twin ops_glue.bf16_bits
f32_store_bf16(x)    float32 -> float32 on the bf16 grid (RNE) twin ops_glue.store
bf16_to_f32(h)       uint16 bf16 bits -> float32, exact        twin ops_glue.to_f32

Contract: the input is a C-contiguous CuPy array of at least one element (float32, resp. uint16)
on the current device; the result is a new contiguous array of the same shape (cupy.empty on the
current stream), every element bit-identical to the ElementwiseKernel of ops_glue (the same
integer formula, ops_glue._RNE: see convert.cu).  ops_glue routes exactly these inputs here and
keeps its ElementwiseKernels for everything else (views, other dtypes, 0-d, empty).

Why: each ElementwiseKernel call costs ~15 us of host time (CuPy's type inference, broadcasting
and cache lookup), ~130 ms of an 8K prefill forward's host thread over ~8,400 calls
(bench/results/2026-11-30-nvidia-h200-2624ca0-prof5.log).  Here the launch is a cached RawKernel
(``_common.kernel``), a grid from plain ints and one np.int64: the wrappers do no checks (their
one caller, ops_glue, has made them).
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import cupy, kernel, sm_count

STEM = "convert"
# kernel names carry a cvt_ prefix: NVRTC resolves name expressions in the whole translation
# unit, and common.cuh already has DEV bf16_to_f32 (an overload makes the lookup ambiguous)
KERNELS = ("cvt_f32_to_bf16_bits", "cvt_f32_store_bf16", "cvt_bf16_to_f32")
kernel_loader.register(STEM, KERNELS)

THREADS = 256        # the kernels' __launch_bounds__
PER_THREAD = 4       # elements per grid-stride step (one 16-byte f32 vector)
_ELEMS_PER_BLOCK = THREADS * PER_THREAD
# Grids up to this many blocks are launched whole (one step per thread); larger ones are capped
# at max(1024, 8 blocks per SM) and grid-stride.  The cap needs the SM count (a device query,
# memoised per device): only arrays of > 1M elements ask for it, so the small calls that
# dominate the host cost pay nothing for it.
_UNCAPPED_BLOCKS = 1024


def blocks_for(n: int) -> int:
    """Blocks for n elements: ceil(n / 1024), at most max(1024, 8 * SMs)."""
    blocks = (n + _ELEMS_PER_BLOCK - 1) // _ELEMS_PER_BLOCK
    if blocks > _UNCAPPED_BLOCKS:
        cap = sm_count() * 8
        if blocks > cap:
            blocks = cap if cap > _UNCAPPED_BLOCKS else _UNCAPPED_BLOCKS
    return blocks


def _launch(name: str, x, dtype):
    n = x.size
    y = cupy().empty(x.shape, dtype=dtype)
    kernel(STEM, name)((blocks_for(n),), (THREADS,), (x, y, np.int64(n)))
    return y


def f32_to_bf16_bits(x):
    """float32 (contiguous, non-empty) -> uint16 bf16 bits, RNE; same shape."""
    return _launch("cvt_f32_to_bf16_bits", x, np.uint16)


def f32_store_bf16(x):
    """float32 (contiguous, non-empty) -> float32 rounded to bf16 (RNE); same shape."""
    return _launch("cvt_f32_store_bf16", x, np.float32)


def bf16_to_f32(h):
    """uint16 bf16 bits (contiguous, non-empty) -> float32, exact; same shape."""
    return _launch("cvt_bf16_to_f32", h, np.float32)
