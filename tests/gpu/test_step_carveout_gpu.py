"""MEMRA_DSV4_SMEM_CARVEOUT (pdl.smem_carveout): every PDL launch of the step carries a preferred
shared-memory carveout.  Only the SMs' L1 / shared split (and so which CTAs may share an SM)
changes, so the step must give the same bits: tiny (1 stage, CSA + HCA layers) with fork "all"
and hc split on, graph replay with no carveout attribute (driver), the default (fit1h16 since the
thirty-third session, fit1 before: the one-wave launches with shared memory, one CTA's share plus
16 KB), max, 50, fitocc (every launch with shared memory, its occupancy's share) and fit1h16, and the eager step at max, the arms interleaved step by
step (each captures its own graphs: the variable is read at each launch, so at capture), logits
and every cache byte equal."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, env_arm_runner, step_forms  # noqa: E402


def test_carveout_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    assert m.pdl == "on", "the carveout rides on the PDL launches"
    prompt, steps = 5, 12
    ids = _ids(ck.config, prompt + steps + 1, seed=31)
    arms = {"driver": ("driver", True), "default": ("default", True), "max": ("max", True), "50": ("50", True),
            "fitocc": ("fitocc", True), "fit1h16": ("fit1h16", True), "max_eager": ("max", False)}
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    with step_forms(m, decode_fork="all", hc_split="on"):
        assert_arms_agree("carveout", states, ids[prompt:prompt + steps],
                          env_arm_runner(m, states, "MEMRA_DSV4_SMEM_CARVEOUT", arms, monkeypatch),
                          pos0=prompt)
