"""Interleaved RoPE (kernels_cu/rope.cu), twin oracle.ops.apply_rope (bit-identical)."""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel

STEM = "rope"
KERNELS = ("rope_bf16",)
kernel_loader.register(STEM, KERNELS)


def rope(x, pos, cos, sin, inverse: bool = False):
    """In place on the last R = 2*cos.shape[1] dims of every head.

    x: [T, D] or [T, H, D] bf16 (uint16, contiguous); pos: [T] int32 = rows of the tables
    (absolute positions, or k*r for compressed entries); cos, sin: [n_pos, R/2] float32
    (host.rope.cos_sin).  Returns x."""
    check(x, "rope.x", np.uint16)
    assert x.ndim in (2, 3), f"rope.x: expected [T, D] or [T, H, D], got {x.shape}"
    T, D = x.shape[0], x.shape[-1]
    H = x.shape[1] if x.ndim == 3 else 1
    check(pos, "rope.pos", np.int32, (T,))
    check(cos, "rope.cos", np.float32)
    check(sin, "rope.sin", np.float32, cos.shape)
    R = 2 * cos.shape[1]
    assert R % 8 == 0 and R <= D and (D - R) % 8 == 0, f"rope: rope dims {R} / head dim {D} unsupported"
    total = T * H * (R // 8)
    if total:
        kernel(STEM, "rope_bf16")((grid_stride_blocks(total),), (256,),
                                  (x, pos, cos, sin, i32(T), i32(H), i32(D), i32(R), i32(int(inverse))))
    return x
