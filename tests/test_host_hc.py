"""mHC rules: split, Sinkhorn, transposed comb consumption."""

import numpy as np

from memra_dsv4.host.hc import hc_head_weights, hc_split, sigmoid, sinkhorn
from memra_dsv4.oracle import ops
from memra_dsv4.seams import POLICIES


def _naive_sinkhorn(L, iters, eps):
    C = np.exp(L - L.max(-1, keepdims=True))
    C = C / C.sum(-1, keepdims=True) + eps
    C = C / (C.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdims=True) + eps)
        C = C / (C.sum(-2, keepdims=True) + eps)
    return C


def test_sinkhorn_matches_definition_and_columns_sum_to_one():
    rng = np.random.default_rng(0)
    L = rng.standard_normal((50, 4, 4)) * 3
    C = sinkhorn(L, 20, 1e-6)
    np.testing.assert_allclose(C, _naive_sinkhorn(L, 20, 1e-6), rtol=1e-12)
    assert (C > 0).all()
    np.testing.assert_allclose(C.sum(-2), 1.0, atol=1e-5)   # last step normalises columns
    np.testing.assert_allclose(C.sum(-1), 1.0, atol=5e-2)   # rows: approximately (20 iterations)
    C32 = sinkhorn(L.astype(np.float32), 20, 1e-6)
    assert C32.dtype == np.float32
    np.testing.assert_allclose(C32, C, rtol=1e-5, atol=1e-6)


def test_hc_split_layout():
    rng = np.random.default_rng(1)
    m = rng.standard_normal((3, 24))
    scale = np.array([0.5, 2.0, 1.5])
    base = rng.standard_normal(24)
    pre, post, comb = hc_split(m, scale, base, 4, 20, 1e-6)
    np.testing.assert_allclose(pre, sigmoid(m[:, :4] * 0.5 + base[:4]) + 1e-6)
    np.testing.assert_allclose(post, 2 * sigmoid(m[:, 4:8] * 2.0 + base[4:8]))
    # row 8 + 4j + k is comb[j, k]
    np.testing.assert_allclose(comb, sinkhorn((m[:, 8:] * 1.5 + base[8:]).reshape(3, 4, 4), 20, 1e-6))
    np.testing.assert_allclose(hc_head_weights(m[:, :4], [0.5], base[:4], 1e-6), pre)


def test_hc_post_consumes_comb_transposed():
    """comb[i, j]: i = source stream, j = destination: a permutation comb moves stream i to j."""
    pol = POLICIES["exact"]
    rng = np.random.default_rng(2)
    R = rng.standard_normal((2, 4, 8))
    f = rng.standard_normal((2, 8))
    perm = [2, 0, 3, 1]                     # source i goes to destination perm[i]
    comb = np.zeros((2, 4, 4))
    for i, j in enumerate(perm):
        comb[:, i, j] = 1.0
    post = np.array([[0.5, 1.0, 1.5, 2.0]] * 2)
    out = ops.hc_post(f, R, post, comb, pol=pol)
    for i, j in enumerate(perm):
        np.testing.assert_allclose(out[:, j], post[:, j, None] * f + R[:, i])


def test_hc_pre_mix_matches_formula():
    pol = POLICIES["exact"]
    rng = np.random.default_rng(3)
    X = rng.standard_normal((5, 4, 16))
    fn = rng.standard_normal((24, 64)) * 0.1
    scale, base = np.array([1.0, 1.0, 1.0]), rng.standard_normal(24) * 0.1
    y, post, comb = ops.hc_pre(X, fn, scale, base, hc_mult=4, iters=20, hc_eps=1e-6,
                               norm_eps=1e-6, pol=pol)
    x = X.reshape(5, 64)
    mixes = (x @ fn.T) / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    pre, post2, comb2 = hc_split(mixes, scale, base, 4, 20, 1e-6)
    np.testing.assert_allclose(y, (pre[..., None] * X).sum(1), rtol=1e-12)
    np.testing.assert_allclose(post, post2)
    np.testing.assert_allclose(comb, comb2)
