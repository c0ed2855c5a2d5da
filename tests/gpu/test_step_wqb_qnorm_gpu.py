"""The attention's q_norm inside wq_b (MEMRA_DSV4_WQB_QNORM, step_device.wqb_qnorm_on;
ops_decode.gemv_bf16_qnorm -> gemv_bf16_pl_r*_qn where wq_b runs as pl_r* with K = 1024): the
step must give the bits of the separate rmsnorm_bf16_wbf16 launch.

* tiny (1 stage; sliding, CSA and HCA layers; q_lora_rank 128, so the norm runs as its own launch
  into attn.qrn and the CSA indexer's branch forks after wq_b: the plumbing), 14 steps after a
  5-token prefill, the arms interleaved step by step (the env set before each): off (graph; the
  reference), on (graph), on (eager); logits of every step and every cache byte equal.
* device-hostmath with the switch on == legacy byte for byte (tiny, 5 steps).
* one Flash-sized layer (flash-layers:1: q_lora_rank 1024, wq_b [32768, 1024] as pl_r2, so the
  fused kernel), 6 steps: off == on (graphs) == on (eager), logits and caches; the eager on-step
  launches gemv_bf16_pl_r2_qn once and at most one rmsnorm_bf16_wbf16 (the final norm)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import (assert_arms_agree, eager_step_launches, env_arm_runner,  # noqa: E402
                                        step_forms)
from memra_dsv4.gpu.step_device import WQB_QNORM_ENV  # noqa: E402

_ARMS = {"off": ("off", True), "on": ("on", True), "on+eager": ("on", False)}


def _interleave(tag, m, states, ids, arms, monkeypatch, fused_check=False):
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        # the fused kernel once (one layer), and no q_norm launch: at most the final
        # norm before the head stays a rmsnorm_bf16_wbf16
        assert names.count("gemv_bf16_pl_r2_qn") == 1, names
        assert names.count("rmsnorm_bf16_wbf16") <= 1, names
        return logits
    assert_arms_agree(tag, states, ids, env_arm_runner(m, states, WQB_QNORM_ENV, arms, monkeypatch,
                                                       first_eager=first if fused_check else None))


def test_wqb_qnorm_step_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 14
    ids = _ids(ck.config, prompt + steps + 1, seed=43)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    with step_forms(m, decode_fork="all", hc_split="on"):
        _interleave("tiny", m, states, ids[prompt:prompt + steps], _ARMS, monkeypatch)


def test_wqb_qnorm_device_hostmath_equals_legacy_tiny(monkeypatch):
    from test_decode_gpu import hostmath_equals_legacy_with  # prepend import mode (tests/gpu on sys.path)
    monkeypatch.setenv(WQB_QNORM_ENV, "on")
    hostmath_equals_legacy_with(None, None, seed=47, what="q_norm in wq_b")


def test_wqb_qnorm_step_bit_identical_flash_layer(monkeypatch):
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    m, states, ids, prompt = flash_prefilled(1, _ARMS, seed=53, dense=None)
    assert m.config.q_lora_rank == 1024
    _interleave("flash-layers:1", m, states, ids[prompt:], _ARMS, monkeypatch, fused_check=True)
