"""MEMRA_DSV4_HC_PRE_HANDOFF=cluster (step_device.hc_pre_handoff): every sub-layer boundary's
critical launch as hc.cu hc_boundary_pre_cluster (one thread-block cluster of D / 256 CTAs
exchanging the mixes partials and x through DSMEM) instead of hc_boundary_pre (the last-CTA
ticket).  Every value is the same expression in the same order, so the step must give the ticket
form's bits:

* flash-layers:2 (D = 4096: one cluster of 16 CTAs x 1024 threads; four boundaries per step, the
  first without hc_post), 5-token prefill, 6 steps, arms interleaved step by step: ticket (graph;
  the reference), cluster (graph), cluster eager; logits of every step and every cache byte
  equal; the first eager cluster step launches hc_boundary_pre_cluster 2 x layers times and no
  hc_boundary_pre;
* tiny (D = 256: a cluster of one CTA), 12 steps past the window wrap, the same arms;
* MEMRA_DSV4_HC_PRE_HANDOFF=coop / coopall (hc_boundary_pre_coop: the ticket form's 64 CTAs
  publishing tagged words, 8 / all of them polling and forming x / xn, no single-SM tail) on
  flash-layers:2 the same way: ticket (graph), coop (graph), coop eager, coopall (graph); the
  first eager coop step launches hc_boundary_pre_coop 2 x layers times and no hc_boundary_pre
  (tiny's D = 256 falls back to the ticket form)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, eager_step_launches, env_arm_runner  # noqa: E402
from step_models import flash_prefilled, tiny_prefilled  # noqa: E402  (tests/gpu on sys.path)

ENV = "MEMRA_DSV4_HC_PRE_HANDOFF"
_ARMS = {"ticket": ("ticket", True), "cluster": ("cluster", True), "cluster+eager": ("cluster", False)}


def _first_eager(m, states, n_layers: int, form: str = "hc_boundary_pre_cluster"):
    """The first eager step of an arm: ``form`` launched at both boundaries of every layer, the
    ticket kernel (hc_boundary_pre) never."""
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        assert names.count(form) == 2 * n_layers, sorted(set(names))
        assert "hc_boundary_pre" not in names, sorted(set(names))
        return logits
    return first


def test_hc_pre_cluster_step_bit_identical_flash_layers(monkeypatch):
    m, states, ids, prompt = flash_prefilled(2, _ARMS, seed=61)
    assert_arms_agree("flash-layers:2 hc boundary cluster handoff", states, ids[prompt:],
                      env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, 2)),
                      pos0=prompt)


def test_hc_pre_cluster_step_bit_identical_tiny(monkeypatch):
    m, states, ids, prompt = tiny_prefilled(_ARMS, seed=67)
    assert_arms_agree("tiny hc boundary cluster handoff", states, ids[prompt:],
                      env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, m.config.num_hidden_layers)),
                      pos0=prompt)


_COOP_ARMS = {"ticket": ("ticket", True), "coop": ("coop", True), "coop+eager": ("coop", False),
              "coopall": ("coopall", True)}


def test_hc_pre_coop_step_bit_identical_flash_layers(monkeypatch):
    m, states, ids, prompt = flash_prefilled(2, _COOP_ARMS, seed=71)
    assert_arms_agree("flash-layers:2 hc boundary coop handoff", states, ids[prompt:],
                      env_arm_runner(m, states, ENV, _COOP_ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, 2, "hc_boundary_pre_coop")),
                      pos0=prompt)
