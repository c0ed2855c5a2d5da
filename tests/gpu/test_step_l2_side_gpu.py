"""MEMRA_DSV4_L2_SIDE (step_device.l2_side_targets; ops_decode.l2_prefetch_paced on the hc
Sinkhorn's side stream): a paced L2 prefetch of wq_b's / wo_a's first bytes is a hint, so the step
must give the same bits: tiny (1 stage) with fork "all" and hc split on (the branch the prefetch
rides), graphs with off (the reference) / wq / wo / both (budget 1 MB, 2 CTAs, 50 ns) and the eager
step with both (one stream, no hc branch: the switch is a no-op there), 12 steps after a 5-token
prefill, interleaved; logits and every cache byte equal.  And the kernel alone: under PDL and
plainly, over two ranges with an odd tail, it leaves memory as it was."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, env_arm_runner, step_forms  # noqa: E402


def test_l2_prefetch_paced_changes_nothing():
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.pdl import pdl_launches
    a = cp.arange(1 << 20, dtype=cp.uint32)
    b = cp.arange(12345 * 4, dtype=cp.uint8)
    ra, rb = a.copy(), b.copy()
    for pdl in (False, True):
        with pdl_launches(pdl):
            n = DK.l2_prefetch_paced([(a, a.nbytes), (b, (b.nbytes // 16) * 16)], ctas=3, chunk=4096,
                                     sleep_ns=20)
        cp.cuda.runtime.deviceSynchronize()
        assert n == a.nbytes + (b.nbytes // 16) * 16
        assert cp.array_equal(a, ra) and cp.array_equal(b, rb)


def test_l2_side_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 12
    ids = _ids(ck.config, prompt + steps + 1, seed=73)
    arms = {"off": ("off", True), "wq": ("wq", True), "wo": ("wo", True), "both": ("both", True),
            "both+eager": ("both", False)}
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_MB", "1")
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_CTAS", "2")
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_NS", "50")
    with step_forms(m, decode_fork="all", hc_split="on"):
        assert_arms_agree("l2side", states, ids[prompt:prompt + steps],
                          env_arm_runner(m, states, "MEMRA_DSV4_L2_SIDE", arms, monkeypatch), pos0=prompt)
