"""host.pending: the pending-row state machine shared by the oracle and the GPU cache."""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.host.pending import advance_pending, cur_offset


def _fresh(ratio, d):
    coff = 2 if ratio == 4 else 1
    return (np.zeros((coff * ratio, coff * d), np.float32),
            np.full((coff * ratio, coff * d), -np.inf, np.float32))


@pytest.mark.parametrize("ratio", [4, 16])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 17, 33])
def test_any_chunking_gives_the_same_rows(ratio, n):
    rng = np.random.default_rng(ratio * 100 + n)
    coff = 2 if ratio == 4 else 1
    a = rng.standard_normal((n, coff * 8)).astype(np.float32)
    z = rng.standard_normal((n, coff * 8)).astype(np.float32)
    kv1, sc1 = _fresh(ratio, 8)
    advance_pending(kv1, sc1, a, z, 0, ratio)
    kv2, sc2 = _fresh(ratio, 8)
    p = 0
    for size in (1, 2, 3, 1, 5, 7, 11, 13):
        if p >= n:
            break
        advance_pending(kv2, sc2, a[p:p + size], z[p:p + size], p, ratio)
        p += size
    if p < n:
        advance_pending(kv2, sc2, a[p:], z[p:], p, ratio)
    assert np.array_equal(kv1, kv2) and np.array_equal(sc1, sc2)


@pytest.mark.parametrize("ratio", [4, 16])
def test_layout_current_previous_and_empty_rows(ratio):
    n = 2 * ratio + 1                     # two complete blocks and one token of the third
    coff = 2 if ratio == 4 else 1
    a = np.arange(n, dtype=np.float32)[:, None].repeat(coff * 2, 1) + 1
    z = -a
    kv, sc = _fresh(ratio, 2)
    advance_pending(kv, sc, a, z, 0, ratio)
    o = cur_offset(ratio)
    assert np.array_equal(kv[o], a[2 * ratio])            # the current block's one token
    assert np.all(kv[o + 1:o + ratio] == 0) and np.all(np.isneginf(sc[o + 1:o + ratio]))
    if ratio == 4:                                        # previous complete block = block 1
        assert np.array_equal(kv[:ratio], a[ratio:2 * ratio])
        assert np.array_equal(sc[:ratio], z[ratio:2 * ratio])


def _advance_concat(kv, score, a, z, p0, ratio):
    """advance_pending as written before branch hostlean2's slice form: A / Z = the current
    block's pending rows ++ the chunk's rows (two concatenates), then the rows written from them
    (the reference the slice form must reproduce byte for byte)."""
    r, o, rem0 = ratio, cur_offset(ratio), p0 % ratio
    A = np.concatenate([kv[o:o + rem0], a.astype(kv.dtype, copy=False)], axis=0)
    Z = np.concatenate([score[o:o + rem0], z.astype(score.dtype, copy=False)], axis=0)
    nb = A.shape[0] // r
    if ratio == 4 and nb > 0:
        kv[:r] = A[(nb - 1) * r:nb * r]
        score[:r] = Z[(nb - 1) * r:nb * r]
    rem = A.shape[0] - nb * r
    kv[o:o + rem] = A[nb * r:]
    score[o:o + rem] = Z[nb * r:]
    kv[o + rem:o + r] = 0
    score[o + rem:o + r] = -np.inf


@pytest.mark.parametrize("ratio", [4, 16, 128])
@pytest.mark.parametrize("in_dtype", [np.float32, np.float64])
def test_slice_form_equals_the_concatenate_form(ratio, in_dtype):
    """Every chunk size 0 .. 2r + 3 from every pending count, from states holding arbitrary
    bytes (not only the canonical (0, -inf) tails) and from canonical ones: the same state
    bytes as the concatenate form (f64 inputs cast to the f32 state alike)."""
    rng = np.random.default_rng(ratio)
    coff = 2 if ratio == 4 else 1
    C = coff * 4
    for canonical in (True, False):
        for rem0 in range(ratio):
            for S in list(range(0, 2 * ratio + 4)) + [5 * ratio + 1]:
                p0 = 3 * ratio + rem0
                if canonical:
                    kv, sc = _fresh(ratio, 4)
                    pre = rng.standard_normal((p0, C))
                    advance_pending(kv, sc, pre.astype(np.float32), -pre.astype(np.float32), 0, ratio)
                else:
                    kv = rng.standard_normal((coff * ratio, C)).astype(np.float32)
                    sc = rng.standard_normal((coff * ratio, C)).astype(np.float32)
                kv2, sc2 = kv.copy(), sc.copy()
                a = rng.standard_normal((S, C)).astype(in_dtype)
                z = rng.standard_normal((S, C)).astype(in_dtype)
                advance_pending(kv, sc, a, z, p0, ratio)
                _advance_concat(kv2, sc2, a, z, p0, ratio)
                assert kv.tobytes() == kv2.tobytes() and sc.tobytes() == sc2.tobytes(), (
                    ratio, rem0, S, canonical)
