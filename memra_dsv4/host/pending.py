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
    # The state keeps the tail of A = (the current block's pending rows ++ the chunk's rows), of
    # length n = p0 % r + S: its last rem = n % r rows (the current block), preceded for ratio 4
    # by the last complete block when the chunk closes one.  Those rows are contiguous in A and
    # land on contiguous state rows [dst, o + rem), so they are written as (at most) two slice
    # copies per array, no concatenate: A's pending part (state rows [o + s, o + rem0), only when
    # s < rem0: the identity when nothing closes, else rows [4, 4 + rem0) onto [0, rem0),
    # disjoint) first, then the chunk's part; the rows after them (0, -inf).  The same bytes as
    # writing A[s:] row by row; a / z cast to the state's dtype (only the rows kept).
    r, o = ratio, cur_offset(ratio)
    rem0 = p0 % r
    n = rem0 + a.shape[0]
    nb, rem = divmod(n, r)
    if ratio == 4 and nb > 0:
        s, dst = (nb - 1) * r, 0   # the last complete block, then the current block's rows
    else:
        s, dst = nb * r, o         # the current block's rows
    if s < rem0:                   # A's rows [s, rem0): pending rows (read before any write)
        if dst != o + s:
            kv[dst:dst + rem0 - s] = kv[o + s:o + rem0]
            score[dst:dst + rem0 - s] = score[o + s:o + rem0]
        dst += rem0 - s
        s = rem0
    if dst < o + rem:              # A's rows [s, n): chunk rows s - rem0 ..
        av, zv = a[s - rem0:], z[s - rem0:]
        if av.dtype != kv.dtype:
            av = av.astype(kv.dtype)
        if zv.dtype != score.dtype:
            zv = zv.astype(score.dtype)
        kv[dst:o + rem] = av
        score[dst:o + rem] = zv
    kv[o + rem:o + r] = 0
    score[o + rem:o + r] = -np.inf
