"""Routing rules: sqrtsoftplus, bias for selection only, hash routing, weight normalisation."""

import numpy as np
import pytest

from memra_dsv4.host import routing as rt


def test_sqrtsoftplus_threshold():
    x = np.array([-30.0, -1.0, 0.0, 5.0, 20.0, 20.5, 50.0])
    sp = np.where(x > 20, x, np.log1p(np.exp(x)))
    np.testing.assert_allclose(rt.softplus(x), sp)
    np.testing.assert_allclose(rt.sqrtsoftplus(x), np.sqrt(sp))
    assert rt.sqrtsoftplus(x.astype(np.float32)).dtype == np.float32


def test_learned_weights_sum_to_route_scale_and_bias_only_selects():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((10, 16))
    bias = np.zeros(16)
    bias[5] = 100.0                       # forces expert 5 into every pick
    idx, w, s = rt.route(logits, k=4, route_scale=1.5, bias=bias)
    assert (idx == 5).any(axis=1).all()
    np.testing.assert_allclose(w.sum(-1), 1.5)
    picked = np.take_along_axis(s, idx, -1)          # weights use UNBIASED scores
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True) * 1.5)
    order = np.take_along_axis(s + bias, idx, -1)
    assert (np.diff(order, axis=-1) <= 0).all()      # pick order: biased score descending


def test_learned_tie_break_lower_id():
    logits = np.zeros((1, 8))
    idx, _, _ = rt.route(logits, k=3, route_scale=1.0, bias=np.zeros(8))
    assert list(idx[0]) == [0, 1, 2]


def test_hash_routing():
    tid2eid = np.array([[3, 1], [0, 2], [2, 3]])
    logits = np.random.default_rng(1).standard_normal((3, 4))
    idx, w, s = rt.route(logits, k=2, route_scale=2.0, tid2eid=tid2eid, token_ids=np.array([2, 0, 2]))
    np.testing.assert_array_equal(idx, [[2, 3], [3, 1], [2, 3]])
    np.testing.assert_allclose(w.sum(-1), 2.0)
    with pytest.raises(ValueError):
        rt.route(logits, k=2, route_scale=1.0, tid2eid=np.array([[9, 0]] * 3), token_ids=np.array([0]))
    with pytest.raises(ValueError):
        rt.route(logits, k=2, route_scale=1.0)
