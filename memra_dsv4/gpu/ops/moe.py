"""MoE elementwise ops (kernels_cu/moe.cu).

swiglu(gate, up, limit, weight)   twin oracle.ops.swiglu_clamped, stored to bf16 (the w2 input)
combine(routed, idx, shared)      twin oracle.ops.moe_combine (bit-identical)
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel, null_or, out_array, row_stride

STEM = "moe"
KERNELS = ("swiglu_clamped_bf16", "moe_combine_bf16")
kernel_loader.register(STEM, KERNELS)


def swiglu(gate, up, limit: float, weight=None, out=None):
    """gate, up [S, I] bf16 rows (row-strided views allowed, e.g. halves of a [S, 2I] buffer);
    weight [S] f32 routing weights or None; limit <= 0 disables the clamps -> out [S, I] bf16."""
    check(gate, "swiglu.gate", np.uint16, rows_strided=True)
    S, I = gate.shape
    check(up, "swiglu.up", np.uint16, (S, I), rows_strided=True)
    assert I % 8 == 0 and row_stride(gate) % 8 == 0 and row_stride(up) % 8 == 0, (
        "swiglu: widths and row strides must be multiples of 8 (16-byte rows)")
    if weight is not None:
        check(weight, "swiglu.weight", np.float32, (S,))
    if out is None:
        out = out_array(None, "swiglu.out", (S, I), np.uint16)
    check(out, "swiglu.out", np.uint16, (S, I), rows_strided=True)
    if S * I:
        kernel(STEM, "swiglu_clamped_bf16")((grid_stride_blocks(S * I // 8),), (256,),
                                            (gate, i32(row_stride(gate)), up, i32(row_stride(up)), null_or(weight),
                                             out, i32(row_stride(out)), i32(S), i32(I), np.float64(limit)))
    return out


def combine(routed, idx, shared=None, out=None):
    """routed [T, k, D] bf16 (weighted expert outputs, pick order); idx [T, k] int32 expert ids;
    shared [T, D] bf16 or None -> out [T, D] bf16: f32 sum in ascending expert id (stable),
    then + shared, one rounding."""
    check(routed, "moe.combine.routed", np.uint16)
    T, k, D = routed.shape
    assert k <= 16 and D % 8 == 0, f"moe.combine: k = {k} (<= 16), D = {D} (% 8)"
    check(idx, "moe.combine.idx", np.int32, (T, k))
    if shared is not None:
        check(shared, "moe.combine.shared", np.uint16, (T, D))
    out = out_array(out, "moe.combine.out", (T, D), np.uint16)
    if T:
        kernel(STEM, "moe_combine_bf16")((T, (D // 8 + 127) // 128), (128,),
                                         (routed, idx, null_or(shared), out, i32(D), i32(k)))
    return out
