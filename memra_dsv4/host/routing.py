"""MoE routing rules (reference: dsv4_model_and_formats.md 5.1; M:546-584).

Contract
--------
* Scores: s = sqrt(softplus(logits)) with torch's softplus (beta 1, threshold 20: identity
  above 20, log1p(exp(x)) otherwise).  logits = x_fp32 . W_gate_fp32^T (computed by the caller).
* Selection:
    - learned layers: top-k of (s + bias); bias is for selection only; ties -> lower expert id.
    - hash layers (layer < num_hash_layers): idx = tid2eid[token_id] (no bias exists).
* Weights: w = s[idx] (unbiased) / sum(s[idx]) (no epsilon, as the reference) * route_scale.
* Everything in the input dtype (float32 for the bf16 classes, float64 exact); the sums over
  the k picks run in pick order.
* Expert ids are returned as int64 [T, k] in pick order (learned: score-descending;
  hash: tid2eid's column order).  Consumers that accumulate must do so in ascending id.
"""

from __future__ import annotations

import numpy as np

__all__ = ["softplus", "sqrtsoftplus", "select_learned", "select_hash", "route_weights", "route"]

SOFTPLUS_THRESHOLD = 20.0


def softplus(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        sp = np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD)))
    return np.where(x > SOFTPLUS_THRESHOLD, x, sp).astype(x.dtype)


def sqrtsoftplus(logits: np.ndarray) -> np.ndarray:
    return np.sqrt(softplus(logits)).astype(np.asarray(logits).dtype)


def select_learned(scores: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """int64 [T, k]: top-k of scores + bias per row, descending, ties -> lower expert id."""
    s = np.asarray(scores)
    biased = (s + np.asarray(bias, dtype=s.dtype)).astype(np.float64)
    if np.isnan(biased).any():
        raise ValueError("select_learned: NaN router score")
    E = s.shape[-1]
    ids = np.broadcast_to(np.arange(E), biased.shape)
    order = np.lexsort((ids, -biased), axis=-1)
    return order[..., :k].astype(np.int64)


def select_hash(tid2eid: np.ndarray, token_ids: np.ndarray, n_experts: int) -> np.ndarray:
    """int64 [T, k]: tid2eid[token_id]; ids outside 0..n_experts-1 are refused."""
    idx = np.asarray(tid2eid)[np.asarray(token_ids, dtype=np.int64)].astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n_experts):
        raise ValueError(f"select_hash: tid2eid holds expert ids outside 0..{n_experts - 1}")
    return idx


def route_weights(scores: np.ndarray, idx: np.ndarray, route_scale: float) -> np.ndarray:
    """[T, k]: s[idx] / sum(s[idx]) * route_scale in the scores' dtype (sum in pick order)."""
    s = np.asarray(scores)
    w = np.take_along_axis(s, idx, axis=-1)
    tot = w[..., 0].copy()
    for j in range(1, w.shape[-1]):
        tot = tot + w[..., j]
    return (w / tot[..., None] * s.dtype.type(route_scale)).astype(s.dtype)


def route(logits: np.ndarray, *, k: int, route_scale: float, bias: np.ndarray | None = None,
          tid2eid: np.ndarray | None = None, token_ids: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Full router: (idx int64 [T,k], weights [T,k], scores [T,E]).  Exactly one of
    ``bias`` (learned) / ``tid2eid`` + ``token_ids`` (hash) must be given."""
    if (bias is None) == (tid2eid is None):
        raise ValueError("route: give exactly one of bias (learned) or tid2eid (hash)")
    scores = sqrtsoftplus(logits)
    if tid2eid is not None:
        if token_ids is None:
            raise ValueError("route: hash routing needs token_ids")
        idx = select_hash(tid2eid, token_ids, scores.shape[-1])
    else:
        idx = select_learned(scores, bias, k)
    return idx, route_weights(scores, idx, route_scale), scores
