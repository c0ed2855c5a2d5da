"""QAT simulations and the Hadamard rotation (kernels_cu/quant_sim.cu); all bit-identical to
their twins.

fp8_sim(x, block, nq)   twin host.quant.fp8_sim on x[..., :nq] (block 64 or 128), in place
kv_fp8_sim(x, rope_dim) twin host.quant.kv_fp8_sim (block 64 on the nope dims), in place
fp4_sim(x, nq)          twin host.quant.fp4_sim (block 32), in place
hadamard128(x, fp4)     twin oracle.ops.hadamard (then host.quant.fp4_sim when fp4=True)
rope_hadamard128_fp4(q, pos, cos, sin)
                        twin fp4_sim(hadamard(apply_rope(q)), 32): the indexer q (M:411-416)
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel, out_array

STEM = "quant_sim"
KERNELS = ("fp8_sim_b64", "fp8_sim_b128", "fp4_sim_b32", "hadamard128_bf16", "hadamard128_fp4_bf16",
           "rope_hadamard128_fp4_bf16")
kernel_loader.register(STEM, KERNELS)

_BLOCK_KERNEL = {("fp8", 64): "fp8_sim_b64", ("fp8", 128): "fp8_sim_b128", ("fp4", 32): "fp4_sim_b32"}


def _block_sim(kind: str, x, block: int, nq):
    check(x, f"{kind}_sim.x", np.uint16)
    n = x.shape[-1]
    nq = n if nq is None else int(nq)
    assert (kind, block) in _BLOCK_KERNEL, f"{kind}_sim: block {block} unsupported"
    assert 0 <= nq <= n and nq % block == 0 and n % 8 == 0, (
        f"{kind}_sim: quantised width {nq} must be a multiple of {block} within the row ({n})")
    rows = x.size // n if n else 0
    lanes = rows * (nq // block) * (block // 8)
    if lanes:
        kernel(STEM, _BLOCK_KERNEL[(kind, block)])(
            (grid_stride_blocks(lanes),), (256,), (x, np.int64(rows), i32(n), i32(nq)))
    return x


def fp8_sim(x, block: int = 128, nq=None):
    """bf16(e4m3(x/s) * s) per block of dims [0, nq) of every row (default: the whole row)."""
    return _block_sim("fp8", x, block, nq)


def kv_fp8_sim(x, rope_dim: int):
    """FP8 simulation of the nope dims x[..., :-rope_dim] in blocks of 64 (M:506, M:372)."""
    return _block_sim("fp8", x, 64, x.shape[-1] - int(rope_dim))


def fp4_sim(x, nq=None):
    """bf16(e2m1(x/s) * s) per block of 32 of dims [0, nq) (default: the whole row)."""
    return _block_sim("fp4", x, 32, nq)


def hadamard128(x, out=None, fp4: bool = False):
    """x [..., 128] bf16 -> bf16(x @ H_128 / sqrt(128)) (out may be x); fp4=True adds the
    indexer's FP4 simulation (blocks of 32) on the rotated values."""
    check(x, "hadamard128.x", np.uint16)
    assert x.shape[-1] == 128, f"hadamard128: last dim {x.shape[-1]} != 128"
    out = out_array(out, "hadamard128.out", x.shape, np.uint16)
    rows = x.size // 128
    if rows:
        kernel(STEM, "hadamard128_fp4_bf16" if fp4 else "hadamard128_bf16")(
            ((rows + 7) // 8,), (256,), (x, out, np.int64(rows)))
    return out


def rope_hadamard128_fp4(x, pos, cos, sin, out=None):
    """Indexer q heads x [T, H, 128] bf16: RoPE of the last R = 2*cos.shape[1] dims at pos[t],
    Hadamard-128, FP4 simulation -> out (may be x)."""
    check(x, "rope_hadamard128_fp4.x", np.uint16)
    assert x.ndim == 3 and x.shape[2] == 128, f"rope_hadamard128_fp4.x: expected [T, H, 128], got {x.shape}"
    T, H, _ = x.shape
    check(pos, "rope_hadamard128_fp4.pos", np.int32, (T,))
    check(cos, "rope_hadamard128_fp4.cos", np.float32)
    check(sin, "rope_hadamard128_fp4.sin", np.float32, cos.shape)
    R = 2 * cos.shape[1]
    assert R % 8 == 0 and R <= 128, f"rope_hadamard128_fp4: rope dims {R} unsupported"
    out = out_array(out, "rope_hadamard128_fp4.out", x.shape, np.uint16)
    rows = T * H
    if rows:
        kernel(STEM, "rope_hadamard128_fp4_bf16")(((rows + 7) // 8,), (256,),
                                                  (x, out, np.int64(rows), i32(H), pos, cos, sin, i32(R)))
    return out
