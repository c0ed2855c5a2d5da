"""gpu.verify_bytes: the byte model of a batched verify (what a multi-row verify step could cost
against a decode step) and the speculative ceiling it implies; no GPU needed."""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.config import preset
from memra_dsv4.gpu.step import step_bytes
from memra_dsv4.gpu.verify_bytes import (distinct_experts, expected_speedup, verify_bytes,
                                         verify_cost_model)
from memra_dsv4.host.spec_schedule import verify_length


def test_distinct_experts_against_a_simulation():
    assert distinct_experts(256, 6, 1) == pytest.approx(6.0)
    vals = [distinct_experts(256, 6, t) for t in range(1, 40)]
    assert all(a < b < 256 for a, b in zip(vals, vals[1:]))
    rng = np.random.default_rng(0)   # each row: 6 distinct of 256, rows independent
    for t in (2, 5):
        sim = np.mean([len({int(e) for _ in range(t) for e in rng.choice(256, 6, replace=False)})
                       for _ in range(4000)])
        assert sim == pytest.approx(distinct_experts(256, 6, t), rel=0.01), t


@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_verify_bytes_is_a_step_at_t1_and_scales_only_the_experts(dense):
    cfg = preset("flash")
    L = range(cfg.num_hidden_layers)
    one = verify_bytes(cfg, 1000, 1, L, True, True, dense=dense)
    assert one == pytest.approx(step_bytes(cfg, 1000, L, True, True, dense=dense))
    six = verify_bytes(cfg, 1000, 6, L, True, True, dense=dense)
    last = step_bytes(cfg, 1005, L, True, True, dense=dense)   # the last row's KV reach
    for g, v in six.items():
        if g == "experts":
            assert v == pytest.approx(last[g] * distinct_experts(256, 6, 6) / 6)
        elif g == "embed":
            assert v == 6 * last[g]
        else:
            assert v == last[g], g
    cost = verify_cost_model(cfg, 1000, [(L, True, True)], dense=dense)
    c = [cost(t) for t in range(1, 9)]
    assert c[0] == pytest.approx(1.0)
    # weights read once: dearer with every row, never as dear as t separate steps
    assert all(a < b for a, b in zip(c, c[1:])) and all(1 <= x < t for t, x in enumerate(c, 1)
                                                        if t > 1)


def test_the_cost_model_drives_the_confidence_schedule_and_the_ceiling():
    cfg = preset("flash")
    cost = verify_cost_model(cfg, 4096, [(range(cfg.num_hidden_layers), True, True)])
    assert expected_speedup(0.0, 0, cost) == pytest.approx(1.0)
    # certain acceptance: n + 1 tokens for cost(n + 1)
    assert expected_speedup(0.999999, 3, cost) == pytest.approx(4 / cost(4), rel=1e-5)
    # a good drafter gains, a poor one loses with long rounds
    assert expected_speedup(0.8, 3, cost) > 1.5 > expected_speedup(0.3, 7, cost)
    n_hi = verify_length(np.full(5, 4.0), cost=cost)    # conf ~0.98: long rounds pay
    n_lo = verify_length(np.full(5, -2.0), cost=cost)   # conf ~0.12: one draft
    assert n_lo == 1 and n_hi > n_lo


def test_refusals():
    cfg = preset("tiny")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="t = "):
            verify_bytes(cfg, 0, bad, range(4), True, True)
    with pytest.raises(ValueError, match="pos = -1"):
        verify_bytes(cfg, -1, 2, range(4), True, True)
    with pytest.raises(ValueError, match="k = 9"):
        distinct_experts(8, 9, 1)
    cost = verify_cost_model(cfg, 10, [(range(4), True, True)])
    with pytest.raises(ValueError, match="accept = 1.0"):
        expected_speedup(1.0, 2, cost)
    with pytest.raises(ValueError, match="n = -1"):
        expected_speedup(0.5, -1, cost)
