"""memra_dsv4.gpu.ops.testing.assert_arms_agree / step_forms, the GPU step tests' A/B identity
check, on fake states and logits: token-major order, a logits difference and a cache difference
both caught (naming step, position and arm), the model attributes restored."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from memra_dsv4.gpu.ops.testing import assert_arms_agree, step_forms


class _State:
    def __init__(self, cache):
        self.cache = cache

    def snapshot(self):
        return {"0.kv": self.cache.copy()}


def test_token_major_and_equal_arms_pass():
    states = {a: _State(np.zeros(4, np.uint16)) for a in ("ref", "b", "c")}
    calls = []

    def run(a, i, t):
        calls.append((a, i, t))
        return np.full(3, t, np.float32)
    assert_arms_agree("x", states, [7, 8], run)
    assert calls == [("ref", 0, 7), ("b", 0, 7), ("c", 0, 7), ("ref", 1, 8), ("b", 1, 8), ("c", 1, 8)]


def test_logits_difference_is_caught():
    states = {a: _State(np.zeros(4, np.uint16)) for a in ("ref", "b")}

    def run(a, i, t):   # -0.0 vs 0.0: equal as floats, different bits
        return np.array([-0.0 if (a == "b" and i == 1) else 0.0], np.float32)
    with pytest.raises(AssertionError, match=r"x: step 1 \(pos 6\): logits of b differ from ref's"):
        assert_arms_agree("x", states, [1, 2], run, pos0=5)


def test_cache_difference_is_caught():
    states = {"ref": _State(np.zeros(4, np.uint16)), "b": _State(np.ones(4, np.uint16))}
    with pytest.raises(AssertionError, match=r"caches of b differ from ref's: \['0.kv'\]"):
        assert_arms_agree("x", states, [1], lambda a, i, t: np.zeros(2, np.float32))


def test_step_forms_restores():
    m = SimpleNamespace(decode_fork="on", hc_split="off")
    with step_forms(m, decode_fork="all", hc_split="on"):
        assert (m.decode_fork, m.hc_split) == ("all", "on")
    assert (m.decode_fork, m.hc_split) == ("on", "off")
    with pytest.raises(RuntimeError):
        with step_forms(m, decode_fork="all"):
            raise RuntimeError
    assert m.decode_fork == "on"


def test_attr_arm_runner_sets_attributes_and_first_eager(monkeypatch):
    """attr_arm_runner sets each arm's model attributes before its step (an attribute the arm
    does not name: its value when the runner was made), runs graph / eager as the arm says, routes
    the first step of an eager arm to first_eager; arm_attrs_now + step_forms put them back."""
    from memra_dsv4.gpu import step as step_mod
    from memra_dsv4.gpu.ops.testing import arm_attrs_now, attr_arm_runner
    m = SimpleNamespace(decode_fork="on", hc_split="off")
    seen = []

    def fake_step(model, state, token, graph):
        seen.append((state, token, graph, model.decode_fork, model.hc_split))
        return np.zeros(2, np.float32)
    monkeypatch.setattr(step_mod, "device_step", fake_step)
    arms = {"ref": ({"decode_fork": "off"}, True), "split": ({"decode_fork": "all", "hc_split": "on"}, True),
            "eager": ({"decode_fork": "off"}, False)}
    states = {a: _State(np.zeros(4, np.uint16)) for a in arms}
    firsts = []

    def first(a, t):
        firsts.append((a, t, m.decode_fork))
        return np.zeros(2, np.float32)
    with step_forms(m, **arm_attrs_now(m, arms)):
        assert_arms_agree("x", states, [3, 4], attr_arm_runner(m, states, arms, first_eager=first))
    assert firsts == [("eager", 3, "off")]
    assert [(s is states["ref"], t, g, f, h) for s, t, g, f, h in seen[:2]] == [(True, 3, True, "off", "off"),
                                                                              (False, 3, True, "all", "on")]
    # eager at step 1: a real (eager) step, with hc_split back at its value when the runner was
    # made (the "split" arm before it set "on")
    assert seen[-1][1:] == (4, False, "off", "off")
    assert (m.decode_fork, m.hc_split) == ("on", "off")


def test_env_arm_runner_sets_env_and_first_eager(monkeypatch):
    """env_arm_runner sets the arm's env value before its step (first_eager included), runs graph
    / eager as the arm says and routes only the first step of an eager arm to first_eager."""
    import os

    from memra_dsv4.gpu import step as step_mod
    from memra_dsv4.gpu.ops.testing import env_arm_runner
    seen, firsts = [], []

    def fake_step(model, state, token, graph):
        seen.append((token, graph, os.environ["MEMRA_DSV4_TEST_ARM"]))
        return np.zeros(2, np.float32)
    monkeypatch.setattr(step_mod, "device_step", fake_step)
    arms = {"off": ("off", True), "on": ("on", True), "on+eager": ("on", False)}
    states = {a: _State(np.zeros(4, np.uint16)) for a in arms}

    def first(a, t):
        firsts.append((a, t, os.environ["MEMRA_DSV4_TEST_ARM"]))
        return np.zeros(2, np.float32)
    run = env_arm_runner(object(), states, "MEMRA_DSV4_TEST_ARM", arms, monkeypatch, first_eager=first)
    assert_arms_agree("x", states, [5, 6], run)
    assert firsts == [("on+eager", 5, "on")]
    assert seen == [(5, True, "off"), (5, True, "on"), (6, True, "off"), (6, True, "on"), (6, False, "on")]
