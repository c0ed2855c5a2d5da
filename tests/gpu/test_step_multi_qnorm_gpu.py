"""The attention's q_norm in the multi GEMV's last CTA (MEMRA_DSV4_MULTI_QNORM, step_device.
multi_qnorm_on; ops_decode.gemv_bf16_multi(qnorm=) -> gemv_bf16_multi_*_qn): the step must give
the bits of the separate rmsnorm_bf16_wbf16 launch (both run rmsnorm.cu's row code,
kernels_cu/rmsnorm_row.cuh).

* tiny (1 stage; sliding, CSA and HCA layers), 14 steps after a 5-token prefill, the arms
  interleaved step by step (the env set before each): off (graph; the reference), on (graph),
  on (eager); logits of every step and every cache byte equal.  The first eager on-step launches
  a gemv_bf16_multi_*_qn kernel; an eager off-step none.
* device-hostmath with the switch on == legacy byte for byte (tiny, 5 steps).
* one Flash-sized layer (flash-layers:1: q_lora_rank 1024, the step's real multi table), 6 steps:
  off == on (graphs), logits and caches."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, eager_step_launches, env_arm_runner  # noqa: E402
from memra_dsv4.gpu.step_device import MULTI_QNORM_ENV  # noqa: E402

_ARMS = {"off": ("off", True), "on": ("on", True), "on+eager": ("on", False)}


def _qn_launched(m, state, t) -> tuple:
    logits, names = eager_step_launches(m, state, t)
    return logits, {n for n in names if n.startswith("gemv_bf16_multi") and n.endswith("_qn")}


def _interleave(tag, m, states, ids, arms, monkeypatch, check_launches=False):
    def first(a, t):
        logits, qn = _qn_launched(m, states[a], t)
        assert qn, f"{tag}: an eager step with {MULTI_QNORM_ENV}=on launched no _qn kernel"
        return logits
    assert_arms_agree(tag, states, ids, env_arm_runner(m, states, MULTI_QNORM_ENV, arms, monkeypatch,
                                                       first_eager=first if check_launches else None))


def test_multi_qnorm_step_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 14
    ids = _ids(ck.config, prompt + steps + 2, seed=31)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    _interleave("tiny", m, states, ids[prompt:prompt + steps], _ARMS, monkeypatch, check_launches=True)
    monkeypatch.setenv(MULTI_QNORM_ENV, "off")
    _, qn = _qn_launched(m, states["off"], ids[prompt + steps])
    assert not qn, f"an eager step with {MULTI_QNORM_ENV}=off launched {sorted(qn)}"


def test_multi_qnorm_device_hostmath_equals_legacy_tiny(monkeypatch):
    from test_decode_gpu import hostmath_equals_legacy_with  # prepend import mode (tests/gpu on sys.path)
    monkeypatch.setenv(MULTI_QNORM_ENV, "on")
    hostmath_equals_legacy_with(None, None, seed=37, what="multi q_norm")


def test_multi_qnorm_step_bit_identical_flash_layer(monkeypatch):
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    arms = {a: _ARMS[a] for a in ("off", "on")}
    m, states, ids, prompt = flash_prefilled(1, arms, seed=41, dense=None)
    assert m.config.q_lora_rank == 1024
    _interleave("flash-layers:1", m, states, ids[prompt:], arms, monkeypatch)
