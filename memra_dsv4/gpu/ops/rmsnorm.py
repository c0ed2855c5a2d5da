"""RMSNorm ops (kernels_cu/rmsnorm.cu).

rmsnorm(x, weight, eps)  twin oracle.ops.rmsnorm       y = bf16(w * x * rsqrt(mean(x^2) + eps))
head_rms(x, eps)         twin oracle.ops.head_rms       unweighted per-head q norm in bf16 arithmetic
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, i32, kernel, out_array

STEM = "rmsnorm"
KERNELS = ("rmsnorm_bf16_wf32", "rmsnorm_bf16_wbf16", "head_rms_bf16")
kernel_loader.register(STEM, KERNELS)


def rmsnorm(x, weight, eps: float, out=None):
    """x [..., n] bf16 (uint16) -> out (same shape, may be x); weight [n] float32 or bf16 bits.
    One CTA (128 threads) per row; double statistics; bit-identical to the twin up to double ties."""
    n = x.shape[-1]
    check(x, "rmsnorm.x", np.uint16)
    assert n % 8 == 0, f"rmsnorm: n = {n} must be a multiple of 8"
    assert weight.shape == (n,) and weight.dtype in (np.float32, np.uint16), (
        f"rmsnorm.weight: shape {weight.shape} dtype {weight.dtype}, expected ({n},) float32/uint16")
    check(weight, "rmsnorm.weight", weight.dtype)
    out = out_array(out, "rmsnorm.out", x.shape, np.uint16)
    rows = x.size // n
    if rows:
        name = "rmsnorm_bf16_wf32" if weight.dtype == np.float32 else "rmsnorm_bf16_wbf16"
        kernel(STEM, name)((rows,), (128,), (x, weight, out, i32(n), np.float64(eps)))
    return out


def head_rms(x, eps: float, out=None, *, rope=None):
    """x [..., D] bf16 (each row one head) -> out (may be x).  eps is applied as float32, as the
    twin (``mean + dtype(eps)``).  One warp per row.
    rope = (pos [T] int32, cos, sin [n_pos, R/2] f32) with x [T, H, D]: also apply the q RoPE to
    the last R dims (= rope.rope(head_rms(x), pos, cos, sin), bit for bit)."""
    n = x.shape[-1]
    check(x, "head_rms.x", np.uint16)
    assert n % 8 == 0, f"head_rms: D = {n} must be a multiple of 8"
    out = out_array(out, "head_rms.out", x.shape, np.uint16)
    rows = x.size // n
    if rope is not None:
        assert x.ndim == 3, f"head_rms with rope: x must be [T, H, D], got {x.shape}"
        pos, cos, sin = rope
        check(pos, "head_rms.pos", np.int32, (x.shape[0],))
        check(cos, "head_rms.cos", np.float32)
        check(sin, "head_rms.sin", np.float32, cos.shape)
        R = 2 * cos.shape[1]
        assert R % 8 == 0 and R <= n, f"head_rms: rope dims {R} unsupported"
        rargs = (i32(x.shape[1]), pos, cos, sin, i32(R))
    else:
        rargs = (i32(1), np.uint64(0), np.uint64(0), np.uint64(0), i32(0))
    if rows:
        kernel(STEM, "head_rms_bf16")(((rows + 3) // 4,), (128,),
                                      (x, out, i32(rows), i32(n), np.float32(eps)) + rargs)
    return out
