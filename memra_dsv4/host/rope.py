"""RoPE rules of DeepSeek-V4 (reference: dsv4_attention.md sections 2.6-2.7; M:199-244).

Contract
--------
* Per layer: ratio-0 layers use ``rope_theta`` with no YaRN; ratio>0 layers (CSA, HCA) use
  ``compress_rope_theta`` with YaRN (factor, original length, beta_fast/slow).  No mscale.
  Drafter (MTP) stages are ratio 0.  The decision comes from ``cfg.rope_kind(layer)``.
* ``inv_freq`` is float32: f_i = 1 / base^(2i/dim) computed in float32 as torch does
  (``base ** (arange(0, dim, 2, f32) / dim)``), then the YaRN blend
  f' = f / factor * (1 - smooth) + f * smooth with smooth = 1 - clip((i - low)/(high - low), 0, 1)
  evaluated in float32 in that order.
* The angle table is float32 for every numeric class: theta[t, i] = fp32(fp32(t) * f'_i).
  It is a model constant (the reference's ``torch.outer`` of int positions and fp32 freqs).
  ``cos_sin`` evaluates cos/sin of those float32 angles in float64 and returns them in the
  requested dtype (float32 = the reference's complex64 table; float64 for the exact class).
* Layout: interleaved pairs (x[2i], x[2i+1]) on the LAST ``rope_dim`` dims of a vector.
  Forward multiplies by e^{i theta}; inverse by e^{-i theta}.  ``rotate_pairs`` is the rule;
  ``memra_dsv4.oracle.ops.apply_rope`` wraps it with the numeric class's rounding.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = [
    "yarn_correction_range", "inv_freq", "layer_inv_freq", "angles", "cos_sin",
    "layer_cos_sin", "rotate_pairs",
]


def _correction_dim(num_rotations: float, dim: int, base: float, orig_len: int) -> float:
    return dim * math.log(orig_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(dim: int, base: float, beta_fast: float, beta_slow: float,
                          orig_len: int) -> tuple[int, int]:
    """(low, high) = (floor(d(beta_fast)), ceil(d(beta_slow))) clamped to [0, dim-1].
    Flash (dim 64, base 160000, 32/1, 65536): (15, 25)."""
    low = math.floor(_correction_dim(beta_fast, dim, base, orig_len))
    high = math.ceil(_correction_dim(beta_slow, dim, base, orig_len))
    return max(low, 0), min(high, dim - 1)


@lru_cache(maxsize=64)
def _inv_freq_cached(dim: int, base: float, factor: float, beta_fast: float, beta_slow: float,
                     orig_len: int) -> np.ndarray:
    f32 = np.float32
    expo = (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(f32)
    freqs = (f32(1.0) / np.power(f32(base), expo, dtype=f32)).astype(f32)
    if orig_len > 0:
        low, high = yarn_correction_range(dim, base, beta_fast, beta_slow, orig_len)
        lo, hi = float(low), float(high)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(lo)) / f32(hi - lo), 0, 1).astype(f32)
        smooth = (f32(1) - ramp).astype(f32)
        freqs = (freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth).astype(f32)
    freqs.setflags(write=False)
    return freqs


def inv_freq(dim: int, base: float, *, yarn: bool, factor: float = 1.0, beta_fast: float = 32.0,
             beta_slow: float = 1.0, orig_len: int = 0) -> np.ndarray:
    """float32 [dim/2] frequencies (YaRN-blended when ``yarn`` and orig_len > 0)."""
    return _inv_freq_cached(int(dim), float(base), float(factor), float(beta_fast),
                            float(beta_slow), int(orig_len) if yarn else 0)


def layer_inv_freq(cfg, layer: int) -> np.ndarray:
    """The frequencies of trunk layer ``layer`` (or drafter stage ``n_layers + s``)."""
    yarn = cfg.rope_kind(layer) == "yarn"
    return inv_freq(cfg.qk_rope_head_dim, cfg.rope_base(layer), yarn=yarn,
                    factor=cfg.rope_factor, beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow,
                    orig_len=cfg.original_max_position_embeddings)


def angles(freqs: np.ndarray, positions) -> np.ndarray:
    """float32 [T, dim/2]: theta[t, i] = fp32(fp32(t) * f_i)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    return (pos.astype(np.float32)[:, None] * freqs[None, :]).astype(np.float32)


def cos_sin(freqs: np.ndarray, positions, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [T, dim/2] of the float32 angle table, in ``dtype``."""
    th = angles(freqs, positions).astype(np.float64)
    return np.cos(th).astype(dtype), np.sin(th).astype(dtype)


def layer_cos_sin(cfg, layer: int, positions, dtype=np.float32):
    return cos_sin(layer_inv_freq(cfg, layer), positions, dtype)


def rotate_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate the last 2*P dims of x (P = cos.shape[-1]) as interleaved complex pairs.

    ``cos``/``sin`` must broadcast against x[..., :P] (e.g. [T, P] for x [T, D], [T, 1, P]
    for x [T, H, D]).  Returns a new array of x's dtype; the rotation is evaluated in float64
    (one rounding to x's dtype); the non-rope dims are copied unchanged.
    """
    x = np.asarray(x)
    P = cos.shape[-1]
    out = x.copy()
    r = x[..., x.shape[-1] - 2 * P:].astype(np.float64)
    a, b = r[..., 0::2], r[..., 1::2]
    c = np.asarray(cos, dtype=np.float64)
    s = np.asarray(sin, dtype=np.float64)
    if inverse:
        s = -s
    rot = np.empty(np.broadcast_shapes(a.shape, c.shape)[:-1] + (2 * P,), dtype=np.float64)
    rot[..., 0::2] = a * c - b * s
    rot[..., 1::2] = a * s + b * c
    out[..., x.shape[-1] - 2 * P:] = rot.astype(x.dtype)
    return out
