"""Sampling and the speculative acceptance rule (memra_dsv4/oracle/sampling.py).

Statistical tests: Pearson chi-square goodness of fit over every cell of nonzero expected
probability (cells of expected probability 0 must stay empty), df = cells - 1, rejected at
ALPHA = 1e-3.  The generators are seeded, so each run is deterministic; the stated false-failure
rate is the probability that a CORRECT implementation fails with a different seed: 1e-3 per
chi-square test (4 such tests here, so < 0.4% for the file).  A negative control shows the test
has power: a plausible wrong rule (resampling from p instead of the residual) is rejected.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from memra_dsv4.oracle.sampling import (chi2_sf, greedy, sample, sample_from_probs,
                                        sampling_probs, spec_accept)

ALPHA = 1e-3


def chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int, float]:
    """(statistic, df, p-value); asserts that zero-probability cells were never observed."""
    stat, cells = 0.0, 0
    for cell, p in expected.items():
        o = counts.get(cell, 0)
        if p == 0:
            assert o == 0, f"cell {cell} has probability 0 but was observed {o} times"
            continue
        e = n * p
        stat += (o - e) ** 2 / e
        cells += 1
    assert set(counts) <= set(expected)
    df = cells - 1
    return stat, df, chi2_sf(stat, df)


# ----------------------------------------------------------------------------- chi2_sf
def test_chi2_sf_closed_form_and_known_values():
    for df in (2, 4, 10, 24, 62):
        for x in (0.5, 3.0, df * 0.8, df * 1.0, df * 1.7, df + 30.0):
            y = x / 2
            want = math.exp(-y) * sum(y ** i / math.factorial(i) for i in range(df // 2))
            assert chi2_sf(x, df) == pytest.approx(want, rel=1e-10, abs=1e-300)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(23.209251158954356, 10) == pytest.approx(0.01, rel=1e-9)
    assert chi2_sf(0.0, 3) == 1.0


# ------------------------------------------------------------------------ distributions
def test_temperature_zero_is_greedy_with_lowest_id_ties():
    lg = np.array([0.5, 2.0, 2.0, -1.0])
    p = sampling_probs(lg, 0.0)
    assert p.tolist() == [0, 1, 0, 0]
    assert sample(lg, 0.0) == 1 == greedy(lg)
    assert sample(np.stack([lg, -lg]), 0.0).tolist() == [1, 3]


def test_softmax_temperature():
    lg = np.array([1.0, 2.0, -0.5], dtype=np.float32)
    for t in (0.3, 1.0, 2.5):
        e = np.exp(lg.astype(np.float64) / t)
        assert np.allclose(sampling_probs(lg, t), e / e.sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("top_p,keep", [(0.45, [0]), (0.55, [0, 1]), (0.75, [0, 1]),
                                        (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_shortest_prefix_reaching_top_p(top_p, keep):
    p0 = np.array([0.5, 0.3, 0.15, 0.05])
    lg = np.log(p0)[[2, 0, 3, 1]]                   # shuffled ids: 1 -> .5, 3 -> .3, 0 -> .15, 2 -> .05
    ids = np.array([1, 3, 0, 2])[keep]
    p = sampling_probs(lg, 1.0, top_p)
    assert set(np.flatnonzero(p)) == set(ids.tolist())
    assert p.sum() == pytest.approx(1.0, abs=1e-15)
    assert np.allclose(p[ids], p0[keep] / p0[keep].sum())


def test_top_p_ties_prefer_lower_ids_and_minus_inf_is_zero():
    p = sampling_probs(np.zeros(4), 1.0, 0.3)
    assert np.flatnonzero(p).tolist() == [0, 1]
    lg = np.array([-np.inf, 0.0, -np.inf, 1.0])
    p = sampling_probs(lg, 0.7)
    assert p[0] == 0 and p[2] == 0
    g = np.random.default_rng(0)
    assert all(sample(lg, 0.7, 1.0, g) in (1, 3) for _ in range(200))


def test_sample_matches_sampling_probs_chi_square():
    rng = np.random.default_rng(2024)
    lg = rng.normal(0, 1.5, 6)
    lg[4] = -np.inf
    T, top_p, n = 0.8, 0.9, 30000
    p = sampling_probs(lg, T, top_p)
    assert (p == 0).sum() >= 2                      # the -inf id and the truncated tail
    g = np.random.default_rng(7)
    counts: dict = {}
    for _ in range(n):
        t = sample(lg, T, top_p, g)
        counts[t] = counts.get(t, 0) + 1
    stat, df, pv = chi_square(counts, {i: float(p[i]) for i in range(6)}, n)
    assert pv > ALPHA, f"chi2 = {stat:.1f}, df = {df}, p = {pv:.2g}"


# ----------------------------------------------------------------- speculative sampling
# A Markov target P[prev] -> next and a different Markov drafter Q, on a vocab of 4, with zeros
# where the other has mass (so the residual path, and "q > 0, p = 0" drafts, are exercised).
P = np.array([[0.40, 0.30, 0.20, 0.10],
              [0.10, 0.00, 0.50, 0.40],
              [0.25, 0.25, 0.25, 0.25],
              [0.00, 0.60, 0.10, 0.30]])
Q = np.array([[0.10, 0.40, 0.00, 0.50],
              [0.30, 0.30, 0.30, 0.10],
              [0.70, 0.10, 0.10, 0.10],
              [0.25, 0.25, 0.25, 0.25]])
S0 = 0


def run_speculative(k: int, m: int, g: np.random.Generator, accept=spec_accept) -> tuple:
    """First m output tokens of speculative sampling of the chain P with drafts from Q."""
    out, prev = [], S0
    while len(out) < m:
        drafts, qrows, d = [], [], prev
        for _ in range(k):
            q = Q[d]
            d = sample_from_probs(q, g)
            drafts.append(d)
            qrows.append(q)
        prows = [P[x] for x in [prev] + drafts]     # row i conditions on prev, d1..di
        n, nxt = accept(np.array(prows), np.array(qrows), np.array(drafts), g)
        out += drafts[:n] + [nxt]
        prev = out[-1]
    return tuple(out[:m])


def chain_probs(m: int) -> dict:
    probs = {(): 1.0}
    for _ in range(m):
        probs = {seq + (x,): pr * P[seq[-1] if seq else S0, x]
                 for seq, pr in probs.items() for x in range(4)}
    return probs


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_output_distribution_equals_plain_sampling(k):
    """Joint law of the first 3 tokens (64 cells) == the target chain's, chi-square."""
    n, m = 24000, 3
    g = np.random.default_rng(100 + k)
    counts: dict = {}
    for _ in range(n):
        s = run_speculative(k, m, g)
        counts[s] = counts.get(s, 0) + 1
    stat, df, pv = chi_square(counts, chain_probs(m), n)
    assert pv > ALPHA, f"k={k}: chi2 = {stat:.1f}, df = {df}, p = {pv:.2g}"


def _wrong_accept(p, q, drafts, g):
    """Negative control: same test, but a rejection resamples from p (not the residual)."""
    for i, d in enumerate(drafts):
        if g.random() * q[i, d] >= p[i, d]:
            return i, sample_from_probs(p[i], g)
    return len(drafts), sample_from_probs(p[-1], g)


def test_chi_square_rejects_a_wrong_rule():
    n, m = 24000, 3
    g = np.random.default_rng(5)
    counts: dict = {}
    for _ in range(n):
        s = run_speculative(2, m, g, _wrong_accept)
        counts[s] = counts.get(s, 0) + 1
    expected = chain_probs(m)
    stat = sum((counts.get(c, 0) - n * pr) ** 2 / (n * pr) for c, pr in expected.items() if pr)
    assert chi2_sf(stat, sum(1 for pr in expected.values() if pr) - 1) < ALPHA


def test_greedy_drafts_reduce_to_argmax_matching():
    """One-hot p and q: accept iff the draft is the target argmax; the replacement is the argmax."""
    V, target = 5, [3, 1, 4, 0]
    p = np.eye(V)[target]
    g = np.random.default_rng(0)
    for drafts, want in [([3, 1, 4], (3, 0)), ([3, 2, 4], (1, 1)), ([0, 1, 4], (0, 3))]:
        q = np.eye(V)[drafts]
        for _ in range(5):
            assert spec_accept(p, q, np.array(drafts), g) == want


def test_identical_distributions_accept_everything():
    g = np.random.default_rng(1)
    p = np.full((4, 5), 0.2)
    for _ in range(50):
        d = np.array([sample_from_probs(p[0], g) for _ in range(3)])
        n, nxt = spec_accept(p, p[:3], d, g)
        assert n == 3 and 0 <= nxt < 5


# --------------------------------------------------------------------------- bad input
def test_bad_input():
    lg = np.zeros(4)
    for kw, match in [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                      ({"temperature": "hot"}, "temperature")]:
        with pytest.raises(ValueError, match=match):
            sampling_probs(lg, **kw)
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, np.nan]), 1.0)
    with pytest.raises(ValueError, match=r"\+inf"):
        sample(np.array([0.0, np.inf]), 1.0)
    with pytest.raises(ValueError, match="no finite"):
        sample(np.full(3, -np.inf), 1.0)
    with pytest.raises(ValueError, match="floating"):
        sample(np.arange(3), 1.0)
    with pytest.raises(ValueError, match="Generator"):
        sample(lg, 1.0, 1.0, generator=42)
    p, q = np.full((3, 4), 0.25), np.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        spec_accept(p[:2], q, np.array([0, 1]))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        spec_accept(p, q[:, :3], np.array([0, 1]))
    with pytest.raises(ValueError, match="sum to 1"):
        spec_accept(p * 2, q, np.array([0, 1]))
    with pytest.raises(ValueError, match="outside"):
        spec_accept(p, q, np.array([0, 4]))
    q0 = np.array([[1.0, 0, 0, 0], [0.25] * 4])
    with pytest.raises(ValueError, match="draft probability 0"):
        spec_accept(p, q0, np.array([2, 1]))
