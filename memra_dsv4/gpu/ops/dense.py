"""Dense FP8 linear ops (kernels_cu/dense.cu): the stored e4m3 + e8m0 128x128 form.

dequant_fp8_bf16(w, scale, out=None)
    w [R, C] uint8 (e4m3fn), scale [ceil(R/128), ceil(C/128)] uint8 (e8m0) -> out [R, C] uint16
    (bf16 bits), exact.  Twin: formats.dequant_fp8_block_bf16 (the loader's exactness check:
    equal bits on every tensor the loader accepts); outside that domain the kernel gives the
    encode_bf16 of the float32 product (0x7FC0 for a NaN code or scale 0xFF).
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel, out_array

STEM = "dense"
KERNELS = ("dequant_fp8_bf16",)
kernel_loader.register(STEM, KERNELS)

BLOCK = 128


def dequant_fp8_bf16(w, scale, out=None):
    """w [R, C] uint8 e4m3; scale [ceil(R/128), ceil(C/128)] uint8 e8m0 -> out [R, C] bf16 bits
    (``out`` may be a C-contiguous view of a larger scratch)."""
    check(w, "dequant_fp8_bf16.w", np.uint8)
    assert w.ndim == 2, f"dequant_fp8_bf16: w must be 2-D, got shape {w.shape}"
    R, C = (int(d) for d in w.shape)
    check(scale, "dequant_fp8_bf16.scale", np.uint8, (-(-R // BLOCK), -(-C // BLOCK)))
    out = out_array(out, "dequant_fp8_bf16.out", (R, C), np.uint16)
    assert out.data.ptr != w.data.ptr, "dequant_fp8_bf16: out aliases w"
    if R * C:
        vec = C % 16 == 0 and w.data.ptr % 16 == 0 and out.data.ptr % 16 == 0
        items = R * C // 16 if vec else R * C
        kernel(STEM, "dequant_fp8_bf16")((grid_stride_blocks(items),), (256,),
                                         (w, scale, out, np.int64(R), i32(C), i32(int(vec))))
    return out
