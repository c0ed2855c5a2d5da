"""Candidate-index rules of the sparse attention (reference: dsv4_attention.md 3.3, 5, 6, 7.4).

The canonical candidate layout (used by the oracle's prefill, and by decode/chunked prefill so
that every path gathers the same vectors in the same order):

    [ window segment: W slots | compressed segment: C slots ]

* window segment (width W = cfg.sliding_window): the raw tokens max(0, t-W+1) .. t in
  CHRONOLOGICAL order (oldest first), padded at the END with -1 when t < W-1.
* compressed segment: for HCA every complete entry k < n_t = (t+1)//r in ascending k; for CSA
  the indexer's selection (top min(index_topk, n_t)) re-sorted ASCENDING; padded with -1.
* -1 means "skip" (no logit, no value).  Values are row numbers of a kv buffer:
  ``window_positions`` gives absolute token positions (prefill buffer rows 0..L-1);
  ``window_ring_slots`` the same tokens as ring slots pos % W (decode cache rows);
  compressed entries are added at an ``offset`` chosen by the caller (prefill: L, decode: W).

Ring rollback of a speculative verify (``ring_rollback_sources``): a verify at positions
p0..p0+k wrote ring slots pos % W; keeping p0..last_kept, each written slot must hold the
vector of the NEWEST kept position mapping to it, q = last_kept - ((last_kept - slot) mod W), if
q >= p0 (one of the verify's own vectors), else its pre-verify row.  This also covers
k + 1 > W, where the verify wrote a slot twice.

Top-k rule: score descending, ties to the LOWER index; -inf scores are never selected when a
finite one remains; NaN scores are refused.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "window_positions", "window_ring_slots", "window_matrix", "n_complete", "hca_entries",
    "hca_matrix", "topk_desc", "candidate_row", "candidate_matrix", "emit_positions",
    "ring_rollback_sources",
]


def n_complete(t, ratio: int):
    """Number of compressed entries visible to query position t: floor((t+1)/ratio)."""
    return (np.asarray(t) + 1) // ratio


def emit_positions(n_entries: int, ratio: int) -> np.ndarray:
    """Token position at which entry k is emitted: (k+1)*r - 1."""
    return (np.arange(n_entries, dtype=np.int64) + 1) * ratio - 1


def window_positions(t: int, window: int) -> np.ndarray:
    """int32 [W]: positions max(0, t-W+1)..t, chronological, -1 padded at the end."""
    start = max(0, t - window + 1)
    out = np.full(window, -1, dtype=np.int32)
    n = t - start + 1
    out[:n] = np.arange(start, t + 1, dtype=np.int32)
    return out


def window_ring_slots(t: int, window: int) -> np.ndarray:
    """int32 [W]: the same tokens as ``window_positions`` as ring slots pos % W (-1 kept).
    For t >= W-1 this is [(t+1)%W, ..., W-1, 0, ..., t%W] (the reference's decode order)."""
    p = window_positions(t, window)
    return np.where(p >= 0, p % window, -1).astype(np.int32)


def window_matrix(length: int, window: int, start: int = 0) -> np.ndarray:
    """int32 [length, W]: row i = window_positions(start + i) (absolute positions)."""
    t = start + np.arange(length, dtype=np.int64)[:, None]
    j = np.arange(window, dtype=np.int64)[None, :]
    pos = np.maximum(t - window + 1, 0) + j
    return np.where(pos <= t, pos, -1).astype(np.int32)


def hca_entries(t: int, ratio: int) -> np.ndarray:
    """int32 [n_t]: every complete compressed entry k < (t+1)//r, ascending."""
    return np.arange(int(n_complete(t, ratio)), dtype=np.int32)


def hca_matrix(length: int, ratio: int, width: int | None = None, start: int = 0) -> np.ndarray:
    """int32 [length, width]: row i = hca_entries(start+i) padded with -1
    (width defaults to the number of entries complete at the last row)."""
    t = start + np.arange(length, dtype=np.int64)
    n = (t + 1) // ratio
    if width is None:
        width = int(n[-1]) if length else 0
    k = np.arange(width, dtype=np.int64)[None, :]
    return np.where(k < n[:, None], k, -1).astype(np.int32)


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """int32 [min(k, n)] indices of the k largest scores, descending; ties -> lower index.

    ``scores`` is 1-D.  NaN is refused (ValueError).  -inf entries sort last (and, among
    themselves, by index), so they are only returned when fewer than k finite scores exist.
    """
    s = np.asarray(scores)
    if s.ndim != 1:
        raise ValueError(f"topk_desc: scores must be 1-D, got shape {s.shape}")
    if np.isnan(s).any():
        raise ValueError(f"topk_desc: NaN score at index {int(np.flatnonzero(np.isnan(s))[0])}")
    k = min(int(k), s.shape[0])
    # lexsort: last key is primary.  Primary: -score ascending (= score descending);
    # secondary: index ascending.
    order = np.lexsort((np.arange(s.shape[0]), -s.astype(np.float64)))
    return order[:k].astype(np.int32)


def candidate_row(window_idx: np.ndarray, comp_idx: np.ndarray | None, offset: int,
                  comp_width: int | None = None) -> np.ndarray:
    """One query's canonical candidate list: window rows, then compressed entries + offset
    (sorted ascending, -1 kept as -1), padded with -1 to ``comp_width`` compressed slots."""
    w = np.asarray(window_idx, dtype=np.int32)
    if comp_idx is None:
        return w.copy()
    c = np.sort(np.asarray(comp_idx, dtype=np.int64))
    c = c[c >= 0]
    width = len(c) if comp_width is None else comp_width
    if len(c) > width:
        raise ValueError(f"candidate_row: {len(c)} compressed entries exceed width {width}")
    seg = np.full(width, -1, dtype=np.int32)
    seg[:len(c)] = (c + offset).astype(np.int32)
    return np.concatenate([w, seg])


def candidate_matrix(window_mat: np.ndarray, comp_mat: np.ndarray | None, offset: int) -> np.ndarray:
    """[S, W + C] canonical candidates from a window matrix and a compressed matrix whose rows
    hold entry ids (any order, -1 = none); each compressed row is sorted ascending with its -1
    padding moved to the end, then shifted by ``offset``."""
    w = np.asarray(window_mat, dtype=np.int32)
    if comp_mat is None or comp_mat.shape[-1] == 0:
        return w.copy()
    c = np.asarray(comp_mat, dtype=np.int64)
    big = np.iinfo(np.int64).max
    c = np.sort(np.where(c >= 0, c, big), axis=-1)
    c = np.where(c == big, -1, c + offset).astype(np.int32)
    return np.concatenate([w, c], axis=-1)


def ring_rollback_sources(slots, p0: int, last_kept: int, window: int) -> np.ndarray:
    """int64 [len(slots)]: for each ring slot a verify wrote, the index (q - p0) into the
    verify's own window vectors of the newest kept position q in that slot, or -1 when no kept
    position of the verify maps to it (restore the pre-verify row).  See the module doc."""
    s = np.asarray(slots, dtype=np.int64)
    if not 0 <= p0 <= last_kept:
        raise ValueError(f"ring_rollback_sources: need 0 <= p0 <= last_kept, got {p0}, {last_kept}")
    if s.size and (s.min() < 0 or s.max() >= window):
        raise ValueError(f"ring_rollback_sources: slots outside 0..{window - 1}")
    q = last_kept - ((last_kept - s) % window)
    return np.where(q >= p0, q - p0, -1)
