"""Hyper-connection (mHC) mixing rules (reference: dsv4_model_and_formats.md section 4;
M:674-687, kernel.py hc_split_sinkhorn).

Contract
--------
* ``hc_split(mixes, scale, base, hc, iters, eps)`` splits the (2+hc)*hc mix logits of each
  token (rows 0..hc-1 pre, hc..2hc-1 post, then comb row-major: row 2hc + hc*j + k = comb[j, k])
  into pre = sigmoid(m*s0 + b) + eps, post = 2*sigmoid(m*s1 + b), comb = sinkhorn(m*s2 + b).
* ``sinkhorn(logits, iters, eps)``: C = rowsoftmax(L) + eps; C /= (colsum + eps); then
  (iters - 1) x [C /= (rowsum + eps); C /= (colsum + eps)].  The last step is a column
  normalisation, so columns sum to ~1.  Reductions over the 4 entries run in index order.
* Everything is computed in the input dtype (float32 for the bf16 classes, float64 exact).
* comb[i, j]: i = SOURCE stream, j = DESTINATION stream (hc_post uses comb transposed).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sigmoid", "sinkhorn", "hc_split", "hc_head_weights"]


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    one = x.dtype.type(1)
    with np.errstate(over="ignore"):
        return (one / (one + np.exp(-x))).astype(x.dtype)


def _sum_ordered(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum along a short axis strictly in index order (no pairwise/SIMD regrouping)."""
    x = np.moveaxis(x, axis, 0)
    acc = x[0].copy()
    for i in range(1, x.shape[0]):
        acc = acc + x[i]
    return acc


def sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """[..., hc, hc] logits -> doubly-(near-)stochastic comb (see module doc)."""
    L = np.asarray(logits)
    dt = L.dtype.type
    e = dt(eps)
    m = L.max(axis=-1, keepdims=True)
    C = np.exp(L - m)
    C = C / _sum_ordered(C, -1)[..., :, None] + e
    C = C / (_sum_ordered(C, -2)[..., None, :] + e)
    for _ in range(iters - 1):
        C = C / (_sum_ordered(C, -1)[..., :, None] + e)
        C = C / (_sum_ordered(C, -2)[..., None, :] + e)
    return C.astype(L.dtype)


def hc_split(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int,
             eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    mixes = np.asarray(mixes)
    dt = mixes.dtype
    scale = np.asarray(scale, dtype=dt)
    base = np.asarray(base, dtype=dt)
    pre = sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + dt.type(eps)
    post = dt.type(2) * sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*mixes.shape[:-1], hc, hc)
    return pre.astype(dt), post.astype(dt), sinkhorn(logits, iters, eps)


def hc_head_weights(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, eps: float) -> np.ndarray:
    """hc_head: pre = sigmoid(m * scale[0] + base) + eps (no factor 2, no Sinkhorn)."""
    mixes = np.asarray(mixes)
    dt = mixes.dtype
    return (sigmoid(mixes * np.asarray(scale, dtype=dt)[0] + np.asarray(base, dtype=dt))
            + dt.type(eps)).astype(dt)
