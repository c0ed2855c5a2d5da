"""MEMRA_DSV4_GATEUP_PDL=off (step_device.gateup_pdl_off): the routed gate/up launched without
PDL inside the step's PDL context.  Only when its CTAs become resident changes, so the step must
give the same bits: tiny (1 stage) with fork "all" and hc split on (the shared expert's and the
Sinkhorn's branches present), graph replay and eager, 12 steps after a 5-token prefill, the arms
interleaved step by step (each captures its own graphs: the switch is read at capture), logits
and every cache byte equal to the PDL gate/up's."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, env_arm_runner, step_forms  # noqa: E402


def test_gateup_without_pdl_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    assert m.pdl == "on", "the switch only matters inside the step's PDL context"
    prompt, steps = 5, 12
    ids = _ids(ck.config, prompt + steps + 1, seed=17)
    arms = {"on": ("on", True), "off_graph": ("off", True), "off_eager": ("off", False)}
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    with step_forms(m, decode_fork="all", hc_split="on"):
        assert_arms_agree("gate/up without PDL", states, ids[prompt:prompt + steps],
                          env_arm_runner(m, states, "MEMRA_DSV4_GATEUP_PDL", arms, monkeypatch),
                          pos0=prompt)
