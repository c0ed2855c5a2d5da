"""MEMRA_DSV4_ROUTER_HANDOFF=cluster (step_device.router_handoff): the device router's selection
handed over inside one thread-block cluster (router.cu router_cluster_*: the scores sent into the
rank-0 CTA's shared memory by st.async on its mbarrier) instead of through the ticket and L2
(router_fused_*).  The same row dot and selection code, so the step must give the ticket form's
bits:

* flash-layers:4 (E = 256: one cluster of 16 CTAs x 16 warps; three hash-routed layers and one
  learned), 5-token prefill, 6 steps, arms interleaved step by step: ticket (graph; the
  reference), cluster (graph), cluster eager; logits of every step and every cache byte equal;
  the first eager cluster step launches router_cluster_e256 four times and no router_fused_*;
* tiny (E = 8: a cluster of one CTA; hash and learned layers), 12 steps past the window wrap."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, eager_step_launches, env_arm_runner  # noqa: E402
from step_models import flash_prefilled, tiny_prefilled  # noqa: E402  (tests/gpu on sys.path)

ENV = "MEMRA_DSV4_ROUTER_HANDOFF"
_ARMS = {"ticket": ("ticket", True), "cluster": ("cluster", True), "cluster+eager": ("cluster", False)}


def _first_eager(m, states, cluster_name: str, n_layers: int):
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        assert names.count(cluster_name) == n_layers, sorted(set(names))
        assert not [n for n in names if n.startswith("router_fused_")], sorted(set(names))
        return logits
    return first


def test_router_cluster_step_bit_identical_flash_layers(monkeypatch):
    m, states, ids, prompt = flash_prefilled(4, _ARMS, seed=47)
    assert_arms_agree("flash-layers:4 router cluster handoff", states, ids[prompt:],
                      env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, "router_cluster_e256", 4)),
                      pos0=prompt)


def test_router_cluster_step_bit_identical_tiny(monkeypatch):
    m, states, ids, prompt = tiny_prefilled(_ARMS, seed=29)
    assert_arms_agree("tiny router cluster handoff", states, ids[prompt:],
                      env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, "router_cluster_e32",
                                                              m.config.num_hidden_layers)),
                      pos0=prompt)


def test_shared_gateup_spare_step_bit_identical_flash_layer(monkeypatch):
    """MEMRA_DSV4_SHARED_GATEUP_SPARE=router (with the cluster router): the routed gate/up's last 32
    CTAs carry no shared-expert rows, the others take them over; the same bytes as "none", and as
    "grid" (the gate/up's grid sized for the 116 SMs the router leaves; not GPU-run when added).
    flash-layers:1, 5-token prefill, 6 steps: none (graph), router (graph), router eager, grid
    (graph); the first eager step's gate/up launch gets W_sh = 8 x (CTAs - 32)."""
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.profiling.launches import record_launches
    monkeypatch.setenv(ENV, "cluster")
    arms = {"none": ("none", True), "router": ("router", True), "router+eager": ("router", False),
            "grid": ("grid", True)}
    m, states, ids, prompt = flash_prefilled(1, arms, seed=53)

    def first(a, t):
        out = []
        recs = record_launches(lambda: out.append(device_step(m, states[a], int(t), graph=False)),
                               ("step_device.py",))
        gu = [r for r in recs if r.kernel.endswith("_gateup_k4_f_sh")]
        assert len(gu) == 1, [r.kernel for r in recs]
        n_ctas = gu[0].grid[0] * gu[0].grid[1]
        assert int(gu[0].args[19]) == 8 * (n_ctas - 32), (int(gu[0].args[19]), n_ctas)
        return out[0]
    assert_arms_agree("flash-layers:1 shared rows off the router cluster's CTAs", states, ids[prompt:],
                      env_arm_runner(m, states, "MEMRA_DSV4_SHARED_GATEUP_SPARE", arms, monkeypatch,
                                     first_eager=first), pos0=prompt)
