"""The sync-free prefill candidates (gpu.ops_glue.candidates(ascending=True)) on the CPU, with
NumPy standing in for CuPy: for every compressed matrix the chunk routine passes (the indexer's
top-k in ascending index order, -1 padded, and host.indices.hca_matrix) the sort-free matrix
equals the sorted one and host.indices.candidate_matrix, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.host import indices as hidx


@pytest.fixture
def numpy_glue(monkeypatch):
    monkeypatch.setattr(G, "_cp", lambda: np)
    return G


def _topk_rows(scores, n_valid, k, order):
    """indexer_topk's contract (kernels_cu/indexer.cu) in NumPy: the top min(k, n) of each row by
    score (ties -> lower index), in score or ascending index order, -1 padded to min(k, N)."""
    T, N = scores.shape
    width = min(k, N)
    out = np.full((T, width), -1, np.int32)
    for t in range(T):
        n = min(int(n_valid[t]), N)
        sel = hidx.topk_desc(scores[t, :n], k) if n else np.zeros(0, np.int32)
        if order == "index":
            sel = np.sort(sel)
        out[t, :sel.size] = sel
    return out


@pytest.mark.parametrize("S,N,k,seed", [(9, 12, 4, 0), (40, 30, 8, 1), (5, 3, 8, 2), (17, 64, 64, 3)])
def test_candidates_index_order_equals_sorted(numpy_glue, S, N, k, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(-3, 4, size=(S, N)).astype(np.float32)   # many exact ties
    n_valid = rng.integers(0, N + 1, size=S)
    W = 8
    win = hidx.window_matrix(S, W, start=3)
    offset = 11
    by_score = _topk_rows(scores, n_valid, k, "score")
    by_index = _topk_rows(scores, n_valid, k, "index")
    want = hidx.candidate_matrix(win, by_score, offset)
    old = numpy_glue.candidates(win, by_score, offset)
    new = numpy_glue.candidates(win, by_index, offset, ascending=True)
    assert new.dtype == old.dtype == np.int32
    np.testing.assert_array_equal(old, want)
    np.testing.assert_array_equal(new, want)


@pytest.mark.parametrize("S,ratio,start", [(20, 4, 0), (300, 16, 0), (64, 32, 100), (1, 4, 7), (3, 4, 0)])
def test_candidates_hca_matrix_is_ascending(numpy_glue, S, ratio, start):
    win = hidx.window_matrix(S, 8, start=start)
    comp = hidx.hca_matrix(S, ratio, start=start)
    offset = 5
    want = hidx.candidate_matrix(win, comp, offset)
    np.testing.assert_array_equal(numpy_glue.candidates(win, comp, offset), want)
    np.testing.assert_array_equal(numpy_glue.candidates(win, comp, offset, ascending=True), want)


def test_candidates_empty_comp(numpy_glue):
    win = hidx.window_matrix(4, 8)
    comp = np.full((4, 0), -1, np.int32)
    np.testing.assert_array_equal(numpy_glue.candidates(win, comp, 3, ascending=True), win)
