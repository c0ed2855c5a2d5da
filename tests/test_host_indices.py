"""Candidate-index rules: window at the wrap, ring slots, compressed visibility, top-k ties."""

import numpy as np
import pytest

from memra_dsv4.host import indices as ix


@pytest.mark.parametrize("W", [8, 128])
def test_window_positions_at_wrap(W):
    assert list(ix.window_positions(0, W)) == [0] + [-1] * (W - 1)
    assert list(ix.window_positions(W - 2, W)) == list(range(W - 1)) + [-1]
    assert list(ix.window_positions(W - 1, W)) == list(range(W))
    assert list(ix.window_positions(W, W)) == list(range(1, W + 1))
    t = 2 * W + 3
    assert list(ix.window_positions(t, W)) == list(range(t - W + 1, t + 1))


def test_window_matrix_rows_equal_window_positions():
    W, L = 8, 21
    m = ix.window_matrix(L, W)
    for t in range(L):
        np.testing.assert_array_equal(m[t], ix.window_positions(t, W))
    np.testing.assert_array_equal(ix.window_matrix(3, W, start=10), m[10:13])


@pytest.mark.parametrize("t", [0, 5, 126, 127, 128, 300])
def test_ring_slots_are_the_reference_decode_order(t):
    W = 128
    slots = ix.window_ring_slots(t, W)
    if t >= W - 1:   # M:256-258: [(t+1)%W .. W-1, 0 .. t%W]
        s = t % W
        expect = list(range(s + 1, W)) + list(range(0, s + 1))
    else:            # M:259-260: [0..t, -1 x (W-1-t)]
        expect = list(range(t + 1)) + [-1] * (W - 1 - t)
    assert list(slots) == expect


def test_compressed_visibility():
    for r in (4, 16, 128):
        for t in range(3 * r + 2):
            n = int(ix.n_complete(t, r))
            assert all((k + 1) * r <= t + 1 for k in range(n)) and (n + 1) * r > t + 1
            assert list(ix.hca_entries(t, r)) == list(range(n))
    np.testing.assert_array_equal(ix.emit_positions(3, 4), [3, 7, 11])
    m = ix.hca_matrix(40, 16)
    assert m.shape == (40, 2)
    assert (m[14] == -1).all() and list(m[15]) == [0, -1] and list(m[31]) == [0, 1]


def test_topk_tie_break_and_inf():
    s = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    assert list(ix.topk_desc(s, 3)) == [1, 2, 4]
    assert list(ix.topk_desc(s, 4)) == [1, 2, 4, 3]
    s = np.array([-np.inf, 0.0, -np.inf, 0.0])
    assert list(ix.topk_desc(s, 3)) == [1, 3, 0]
    assert list(ix.topk_desc(np.zeros(2), 5)) == [0, 1]
    with pytest.raises(ValueError, match="NaN"):
        ix.topk_desc(np.array([1.0, np.nan]), 1)


def test_candidate_layout_is_canonical():
    win = ix.window_matrix(6, 4)
    comp = np.array([[-1, -1], [-1, -1], [-1, -1], [0, -1], [0, -1], [1, 0]])
    cand = ix.candidate_matrix(win, comp, offset=6)
    assert list(cand[5]) == [2, 3, 4, 5, 6, 7]          # window chronological, then ascending
    assert list(cand[3]) == [0, 1, 2, 3, 6, -1]
    row = ix.candidate_row(ix.window_positions(5, 4), np.array([1, 0]), offset=6, comp_width=3)
    assert list(row) == [2, 3, 4, 5, 6, 7, -1]
    assert ix.candidate_matrix(win, None, 6).shape == (6, 4)


# ------------------------------------------------------------ ring rollback (host/indices)
def test_ring_rollback_sources():
    from memra_dsv4.host.indices import ring_rollback_sources
    W = 8
    # verify at 5..14 (k + 1 = 10 > W: every slot written), keep 5..7
    src = ring_rollback_sources(np.arange(W), 5, 7, W)
    # slots 5, 6, 7 hold positions 5, 6, 7 (vectors 0, 1, 2); the rest go back to old rows
    assert src.tolist() == [-1, -1, -1, -1, -1, 0, 1, 2]
    # keep everything up to 14: slot s holds the newest position = s (mod 8) <= 14
    src = ring_rollback_sources(np.arange(W), 5, 14, W)
    assert src.tolist() == [3, 4, 5, 6, 7, 8, 9, 2]        # positions 8..13, 14, 7
    # brute force against the definition
    rng = np.random.default_rng(0)
    for _ in range(200):
        W = int(rng.integers(1, 12))
        p0 = int(rng.integers(0, 40))
        k = int(rng.integers(1, 17))
        last = p0 + int(rng.integers(0, k + 1))
        slots = np.unique(np.arange(p0, p0 + k + 1) % W)
        got = ring_rollback_sources(slots, p0, last, W)
        for s, g in zip(slots, got):
            kept = [p for p in range(p0, last + 1) if p % W == s]
            assert g == (max(kept) - p0 if kept else -1)
    with pytest.raises(ValueError, match="p0 <= last_kept"):
        ring_rollback_sources([0], 5, 4, 8)
    with pytest.raises(ValueError, match="slots outside"):
        ring_rollback_sources([8], 0, 3, 8)
