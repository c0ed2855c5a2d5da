"""The compressor pending-row state machine, written once for NumPy (oracle) and CuPy (GPU).

Contract
--------
``advance_pending(kv, score, a, z, p0, ratio)`` feeds the projections ``a`` (kv) and ``z`` (gate
score incl. ape) [S, coff*d] of positions p0..p0+S-1 into the pending rows ``kv`` / ``score``
[coff*r, coff*d] in place.  Pure data movement (no arithmetic), so it is exact in every numeric
class and on either array library; ``kv``/``score`` may be NumPy or CuPy arrays, ``a``/``z``
the same library (cast to the state's dtype).

``closing_blocks(kv, score, a, z, p0, ratio) -> (A, Z, nb, b0)``: the rows of the ``nb`` blocks
that positions p0..p0+S-1 complete (the current block's pending rows, then the chunk's rows;
A/Z [nb * r, coff*d], copies) and the first one's start position b0 = p0 - p0 % r: what a
chunk pools (the oracle's and the GPU chunk routine's compressor).

Layout (dsv4_attention.md 7.1, made canonical): ratio 4 (CSA, overlap, coff = 2): rows [0, r)
hold the previous COMPLETE block, rows [r, r + p % r) the current block's tokens; ratio r
(HCA, coff = 1): rows [0, p % r) the current block's tokens.  Rows that hold no token are
always (0, -inf), so the state is a pure function of the tokens processed and the reference's
stale-row hazard (7.3) cannot occur.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cur_offset", "advance_pending", "closing_blocks"]


def cur_offset(ratio: int) -> int:
    """First row of the current block (after the previous-block rows of the overlap layout)."""
    return ratio if ratio == 4 else 0


def _concatenate(like):
    if isinstance(like, np.ndarray):
        return np.concatenate
    import cupy  # only reached with CuPy arrays
    return cupy.concatenate


def _chunk_rows(kv, score, a, z, p0: int, ratio: int):
    """(A, Z): the current block's pending rows followed by the chunk's rows, as new arrays."""
    o, rem0 = cur_offset(ratio), p0 % ratio
    cat = _concatenate(kv)
    return (cat([kv[o:o + rem0], a.astype(kv.dtype, copy=False)], axis=0),
            cat([score[o:o + rem0], z.astype(score.dtype, copy=False)], axis=0))


def closing_blocks(kv, score, a, z, p0: int, ratio: int):
    A, Z = _chunk_rows(kv, score, a, z, p0, ratio)
    nb = A.shape[0] // ratio
    return A[:nb * ratio], Z[:nb * ratio], nb, p0 - p0 % ratio


def advance_pending(kv, score, a, z, p0: int, ratio: int) -> None:
    r, o = ratio, cur_offset(ratio)
    # concatenate copies, so the rows below can be overwritten while A/Z are read
    A, Z = _chunk_rows(kv, score, a, z, p0, ratio)
    nb = A.shape[0] // r
    if ratio == 4 and nb > 0:
        kv[:r] = A[(nb - 1) * r:nb * r]
        score[:r] = Z[(nb - 1) * r:nb * r]
    rem = A.shape[0] - nb * r
    kv[o:o + rem] = A[nb * r:]
    score[o:o + rem] = Z[nb * r:]
    kv[o + rem:o + r] = 0
    score[o + rem:o + r] = -np.inf
