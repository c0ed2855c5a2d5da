"""The split sub-layer boundary of the device step (seam MEMRA_DSV4_HC_SPLIT, step_device._hc_pre):
with ``on`` each boundary is hc_boundary_pre (the sub-layer's input) + hc_boundary_sinkhorn (post /
comb for the next boundary), the Sinkhorn captured on its own side stream beside the sub-layer
and joined before the next boundary (or the stage's last hc_post).  The two kernels write
hc_boundary's bytes and the branches share no buffer, so the step must give the same bits as
the one-launch boundary.  Checked as test_step_fork_gpu does: tiny (1 stage; CSA and HCA layers,
14 steps after a 5-token prefill) and small over 2 stages when 2 GPUs are present; the arms
interleaved step by step, logits and every cache byte equal: split off (graph), split on (graph,
attention fork on and fork all: three side branches at once), split on eager (one stream), split
off eager."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import arm_attrs_now, assert_arms_agree, attr_arm_runner, step_forms  # noqa: E402


def _arm(split, fork, graph):
    return {"hc_split": split, "decode_fork": fork}, graph


# "off" (the one-launch boundary, graph) is the reference
_ARMS = {"off": _arm("off", "on", True), "on": _arm("on", "on", True), "on+all": _arm("on", "all", True),
         "on+eager": _arm("on", "off", False), "off+eager": _arm("off", "off", False)}


def _run_arms(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=13)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    with step_forms(m, **arm_attrs_now(m, _ARMS)):
        assert_arms_agree(f"{name} hc split", states, ids[prompt:prompt + steps],
                          attr_arm_runner(m, states, _ARMS), pos0=prompt)
    # switching the seam recaptured: the last graph of the "on" state was captured split
    assert m._step._graphs[states["on"]].hc_split is True
    assert m._step._graphs[states["off"]].hc_split is False


def test_hc_split_step_bit_identical_tiny():
    _run_arms("tiny", (0,))


@pytest.mark.multi_gpu
def test_hc_split_step_bit_identical_small_two_stages():
    _run_arms("small", (0, 1), steps=8, prompt=30)
