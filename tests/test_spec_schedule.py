"""host.spec_schedule: survival products, the first-drop verify length, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.host.spec_schedule import expected_tokens, survival, verify_length


def _logit(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p / (1 - p))


def test_survival_is_the_running_product_of_sigmoids():
    c = np.array([2.0, -1.0, 0.0, 3.5])
    s = 1 / (1 + np.exp(-c))
    np.testing.assert_allclose(survival(c), np.cumprod(s), rtol=1e-15)
    a = survival(_logit([0.9, 0.5]))
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 2) == pytest.approx(1 + 0.9 + 0.45)
    with pytest.raises(ValueError, match="outside 0..2"):
        expected_tokens(a, 3)


def test_constant_cost_verifies_everything():
    assert verify_length(_logit([0.01, 0.01, 0.01])) == 3
    assert verify_length(_logit([0.9] * 5), max_drafts=2) == 2


def test_linear_cost_stops_where_the_marginal_token_is_not_worth_it():
    # cost(t) = 1 + beta (t - 1): adding draft n+1 helps iff a_{n+1} / beta > tokens(n) / cost(n+1)
    a_probs = [0.9, 0.8, 0.1, 0.9, 0.9]
    conf = _logit(a_probs)
    beta = 0.2
    cost = lambda t: 1 + beta * (t - 1)  # noqa: E731
    n = verify_length(conf, cost)
    a = survival(conf)
    rates = [expected_tokens(a, m) / cost(m + 1) for m in range(1, 6)]
    # the scan extends while the rate rises and stops at the first drop
    want = 1
    while want < 5 and rates[want] > rates[want - 1]:
        want += 1
    assert n == want
    assert n < 5


def test_first_drop_not_global_argmax():
    # the rate rises to n = 2, dips at n = 3, then reaches its global maximum at n = 4:
    # the rule stops at the dip (a later confidence must not pull drafts past a drop)
    table = {2: 1.0, 3: 1.0, 4: 3.0, 5: 1.0}      # cost(t); rate = tokens / cost
    conf = _logit([0.99, 0.5, 0.99, 0.99])
    a = survival(conf)
    rates = {m: expected_tokens(a, m) / table[m + 1] for m in range(1, 5)}
    assert rates[2] > rates[1] and rates[3] < rates[2] and rates[4] == max(rates.values())
    assert verify_length(conf, table.__getitem__) == 2


def test_ties_keep_the_shorter_length_and_min_drafts():
    conf = _logit([0.5, 0.5])
    cost = lambda t: expected_tokens(survival(conf), t - 1)  # rate == 1 for every n  # noqa: E731
    assert verify_length(conf, cost) == 1
    assert verify_length(conf, cost, min_drafts=2) == 2


@pytest.mark.parametrize("bad,match", [
    (np.zeros((2, 2)), "1-D"), (np.zeros(0), "non-empty"), (np.array([0.0, np.nan]), "draft 1"),
])
def test_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        verify_length(bad)


def test_bad_cost_and_min_drafts_refused():
    conf = _logit([0.5, 0.5])
    with pytest.raises(ValueError, match="positive and finite"):
        verify_length(conf, lambda t: 0.0)
    with pytest.raises(ValueError, match="positive and finite"):
        verify_length(conf, lambda t: float("inf"))
    with pytest.raises(ValueError, match="min_drafts = 3"):
        verify_length(conf, min_drafts=3)

