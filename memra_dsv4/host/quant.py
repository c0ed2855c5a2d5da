"""Quantisation simulations of the DeepSeek-V4 reference (kernel.py act_quant / fp4_act_quant).

Contract
--------
These are the host rules used verbatim by the NumPy oracle and as the bit-exact twins of the
GPU kernels. Every function takes a float32 or float64 array and returns arrays of the same
dtype whose values lie exactly on the target grid (bf16, e4m3fn, e2m1, or power-of-two scales).
Rounding is always round-to-nearest, ties to even.

Precision choices
-----------------
* float32 input is rounded to bf16 with the kernels' bit trick
  (u += 0x7FFF + ((u >> 16) & 1); u &= 0xFFFF0000).
* float64 input is rounded to bf16 (and to e4m3 / e2m1) DIRECTLY from float64, not through
  float32: an oracle that computes in float64 gets the correctly rounded value of its own
  result, with no double rounding. (ml_dtypes and torch round float64 -> bf16 via float32 and
  can differ by one bf16 ulp on rare inputs, e.g. 1 + 2^-8 + 2^-30.)
* Block scales follow the reference exactly: the scale is computed in float32 from
  t = float32(amax) * float32(1/qmax) and s = 2^ceil(log2 t) is read off t's float32 bits
  (exponent - 127, plus 1 if the mantissa is non-zero). float64 ``amax`` is first rounded to
  float32 (the reference's amax comes from bf16 data, so this is exact in practice).
  Note float32(1/448) and float32(1/6) are slightly ABOVE 1/448 and 1/6, so x/s may exceed
  qmax by a hair; the clip before the cast absorbs that, as in the reference.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.formats import (
    BF16_MAX,
    E2M1_MAX,
    E4M3_MAX,
    decode_bf16,
    encode_bf16,
    round_minifloat,
)

__all__ = [
    "round_bf16",
    "round_e4m3",
    "round_e2m1",
    "ue8m0_scale",
    "act_quant_fp8",
    "fp8_sim",
    "fp4_sim",
    "kv_fp8_sim",
    "ACT_AMAX_FLOOR",
    "FP4_AMAX_FLOOR",
]

# amax floors of the reference kernels: act_quant clamps amax to >= 1e-4 (a float32 constant);
# fp4_act_quant to >= 6 * 2^-126 so that the scale stays a normal float32 power of two.
ACT_AMAX_FLOOR = np.float32(1e-4)
FP4_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)


def _float_array(x, fn: str) -> np.ndarray:
    x = np.asarray(x)
    assert x.dtype in (np.float32, np.float64), f"{fn}: float32/float64 expected, got {x.dtype}"
    return x


def round_bf16(x) -> np.ndarray:
    """RNE to bf16 precision; returns x's dtype (float32: bit trick; float64: direct, see module doc)."""
    x = _float_array(x, "round_bf16")
    if x.dtype == np.float32:
        return decode_bf16(encode_bf16(x))
    return round_minifloat(x, 7, -126, BF16_MAX, "inf")


def round_e4m3(x) -> np.ndarray:
    """RNE to the e4m3fn grid (subnormal quantum 2^-9), saturating at +-448; NaN propagates."""
    return round_minifloat(_float_array(x, "round_e4m3"), 3, -6, E4M3_MAX, "saturate")


def round_e2m1(x) -> np.ndarray:
    """RNE to +-{0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at +-6 (2.5->2, 3.5->4, 5->4, .25->0, .75->1)."""
    return round_minifloat(_float_array(x, "round_e2m1"), 1, 0, E2M1_MAX, "saturate")


def ue8m0_scale(amax, qmax: float) -> np.ndarray:
    """s = 2^ceil(log2(amax/qmax)), bit-exactly as the reference's fast_round_scale.

    t = float32(amax) * float32(1/qmax) (one float32 rounding), then the exponent is read from
    t's bits: e = exponent_field - 127 + (mantissa != 0). amax must be finite and > 0 (callers
    apply the reference's floors), and the scale must be a normal float32 (e in [-126, 127]).
    Returns amax's dtype.
    """
    amax = _float_array(amax, "ue8m0_scale")
    a32 = amax.astype(np.float32)
    if not (np.isfinite(a32).all() and (a32 > 0).all()):
        bad = np.flatnonzero(~(np.isfinite(a32) & (a32 > 0)).reshape(-1))
        raise ValueError(
            f"ue8m0_scale: amax must be finite and > 0; {bad.size} bad values, first at flat "
            f"index {bad[0]} = {float(a32.reshape(-1)[bad[0]])!r}"
        )
    with np.errstate(over="ignore"):
        t = a32 * np.float32(1.0 / qmax)
    bits = np.atleast_1d(t).view(np.uint32).reshape(t.shape)
    e = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0)
    if ((e < -126) | (e > 127)).any():
        raise ValueError(
            f"ue8m0_scale: scale exponent out of the normal float32 range "
            f"(min {int(e.min())}, max {int(e.max())}) for qmax={qmax}"
        )
    s = ((e + 127).astype(np.uint32) << 23).view(np.float32)
    return s.astype(amax.dtype)


def _blocked(x: np.ndarray, block: int, fn: str) -> np.ndarray:
    assert x.ndim >= 1, f"{fn}: need at least one dimension"
    assert block > 0 and x.shape[-1] % block == 0, (
        f"{fn}: last dim {x.shape[-1]} is not a multiple of the block size {block}"
    )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def act_quant_fp8(x, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Per-row, per-``block`` FP8 activation quantisation (kernel.py act_quant, ue8m0 scales).

    amax = max(max|x_blk|, 1e-4); s = ue8m0_scale(amax, 448); q = e4m3_RNE(clip(x/s, +-448)).
    Returns (q [..., n] on the e4m3 grid, s [..., n/block] powers of two), both x's dtype.
    x/s is exact (s is a power of two), so the e4m3 rounding is the only rounding.
    """
    x = _float_array(x, "act_quant_fp8")
    xb = _blocked(x, block, "act_quant_fp8")
    amax = np.maximum(np.abs(xb).max(axis=-1), x.dtype.type(ACT_AMAX_FLOOR))
    s = ue8m0_scale(amax, E4M3_MAX)
    q = round_e4m3(np.clip(xb / s[..., None], -E4M3_MAX, E4M3_MAX))
    return q.reshape(x.shape), s


def fp8_sim(x, block: int) -> np.ndarray:
    """In-place fake quant of the reference: bf16(e4m3(x/s) * s) per block (64 for the KV nope dims)."""
    x = _float_array(x, "fp8_sim")
    q, s = act_quant_fp8(x, block)
    qb = q.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return round_bf16((qb * s[..., None]).reshape(x.shape))


def fp4_sim(x, block: int = 32) -> np.ndarray:
    """fp4_act_quant(inplace=True): bf16(e2m1_RNE(clip(x/s, +-6)) * s) per ``block``.

    amax = max(max|x_blk|, 6 * 2^-126); s = ue8m0_scale(amax, 6).
    """
    x = _float_array(x, "fp4_sim")
    xb = _blocked(x, block, "fp4_sim")
    amax = np.maximum(np.abs(xb).max(axis=-1), x.dtype.type(FP4_AMAX_FLOOR))
    s = ue8m0_scale(amax, E2M1_MAX)[..., None]
    v = round_e2m1(np.clip(xb / s, -E2M1_MAX, E2M1_MAX)) * s
    return round_bf16(v.reshape(x.shape))


def kv_fp8_sim(kv, rope_dim: int) -> np.ndarray:
    """fp8_sim(block=64) on kv[..., :-rope_dim] (the nope dims); the rope dims are copied untouched."""
    kv = _float_array(kv, "kv_fp8_sim")
    assert kv.ndim >= 1 and 0 <= rope_dim <= kv.shape[-1], (
        f"kv_fp8_sim: rope_dim {rope_dim} invalid for kv shape {kv.shape}"
    )
    nope = kv.shape[-1] - rope_dim
    assert nope % 64 == 0, f"kv_fp8_sim: nope width {nope} is not a multiple of 64"
    out = kv.copy()
    out[..., :nope] = fp8_sim(kv[..., :nope], 64)
    return out
