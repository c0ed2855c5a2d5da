"""MEMRA_DSV4_HC_JOIN=early|ride (step_device.hc_join_form): the hc Sinkhorn branch joins the main
stream at the sparse attention (attn boundary) and at the MoE's down + combine (ffn boundary)
instead of right before the next hc_boundary_pre (early), or the Sinkhorn runs first on the
attention fork's / the shared expert's side stream (ride).  Only the graph's edges change, so the step
must give the same bits: tiny (1 stage; CSA, HCA and sliding layers) with fork "all" and hc split
on, 14 steps after a 5-token prefill, the arms interleaved step by step (each captures its own
graphs: the switch is read at capture): boundary (graph; the reference), early (graph), ride
(graph), ride_attn (graph), ride (eager: one stream, the switch is a no-op there); logits and every cache byte equal.  Small over
2 stages when 2 GPUs are present (the stage's last layer: its ffn Sinkhorn joins at the down +
combine, before the stage's stand-alone hc_post)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, env_arm_runner, step_forms  # noqa: E402
from memra_dsv4.gpu.step_device import HC_JOIN_ENV  # noqa: E402


def _run(name, devices, monkeypatch, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=71)
    arms = {"boundary": ("boundary", True), "early": ("early", True), "ride": ("ride", True),
            "ride_attn": ("ride_attn", True), "ride+eager": ("ride", False)}
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    with step_forms(m, decode_fork="all", hc_split="on"):
        assert_arms_agree(name, states, ids[prompt:prompt + steps],
                          env_arm_runner(m, states, HC_JOIN_ENV, arms, monkeypatch), pos0=prompt)


def test_hc_join_early_bit_identical_tiny(monkeypatch):
    _run("tiny", (0,), monkeypatch)


@pytest.mark.multi_gpu
def test_hc_join_early_bit_identical_small_two_stages(monkeypatch):
    _run("small", (0, 1), monkeypatch, steps=8, prompt=30)
