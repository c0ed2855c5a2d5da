"""MEMRA_DSV4_SHARED_GATEUP=on (step_device.shared_gateup_on): the shared expert's SwiGLU computed
by the routed gate/up's launch (experts.cu gemv_*_gateup_k4_f_sh), before its PDL wait, instead of
its own gemv_bf16_swiglu launch on the MoE side branch.  The shared rows use gemv_bf16_swiglu's
row code and read x = xn (written by the ffn boundary, two launches back) through L2, so the step
must give the bits of "off":

* one Flash-sized layer (flash-layers:1, MXFP4, bf16 dense: the kernel applies), 5-token prefill,
  8 steps, arms interleaved step by step: off (graph; the reference), on (graph), on eager; logits
  of every step and every cache byte equal; the first eager "on" step launches
  gemv_mxfp4_gateup_k4_f_sh and no gemv_bf16_swiglu (each arm captures its own graphs: the switch
  is read at capture);
* the same with the shared w2 as its own launch (MEMRA_DSV4_DECODE_SHARED_W2 = gemv), which then
  reads sh after the gate/up launch that writes it;
* tiny (the shapes do not qualify: the separate launch stays): on == off, 8 steps."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import (assert_arms_agree, eager_step_launches, env_arm_runner,  # noqa: E402
                                        step_forms)

ENV = "MEMRA_DSV4_SHARED_GATEUP"
_ARMS = {"off": ("off", True), "on": ("on", True), "on+eager": ("on", False)}


def _first_eager(m, states, expect_fused: bool):
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        fused = [n for n in names if n.endswith("_gateup_k4_f_sh")]
        swiglu = [n for n in names if n.startswith("gemv_bf16_swiglu")]
        if expect_fused:
            assert fused and not swiglu, sorted(set(names))
        else:
            assert swiglu and not fused, sorted(set(names))
        return logits
    return first


@pytest.mark.parametrize("w2", ["fused", "gemv"])
def test_shared_gateup_step_bit_identical_flash_layer(monkeypatch, w2):
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    m, states, ids, prompt = flash_prefilled(1, _ARMS, seed=43, steps=8)
    with step_forms(m, decode_shared_w2=w2):
        assert_arms_agree(f"flash-layers:1 shared SwiGLU in the gate/up (w2 {w2})", states, ids[prompt:],
                          env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                         first_eager=_first_eager(m, states, True)), pos0=prompt)


def test_shared_gateup_step_tiny_falls_back(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 8
    ids = _ids(ck.config, prompt + steps, seed=23)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    assert_arms_agree("tiny shared SwiGLU in the gate/up", states, ids[prompt:prompt + steps],
                      env_arm_runner(m, states, ENV, _ARMS, monkeypatch,
                                     first_eager=_first_eager(m, states, False)), pos0=prompt)
