"""The CSA indexer's q GEMV inside wq_b's launch (MEMRA_DSV4_IDXQ_PAIR, step_device.idxq_pair_on;
ops_decode.gemv_bf16_pair -> gemv_bf16_pl2_r* where wq_b runs as pl_r* with K % 1024 == 0): the
step must give the bits of the two separate GEMVs.

* tiny (1 stage; sliding, CSA and HCA layers; q_lora_rank 128, so the two GEMVs stay two
  launches and only the plumbing changes: the indexer's branch waits for wq_b before its q RoPE),
  14 steps after a 5-token prefill, the arms interleaved step by step (the env set before each):
  off (graph; the reference), on (graph), on (eager); logits of every step and every cache byte.
* device-hostmath with the switch on == legacy byte for byte (tiny, 5 steps).
* three Flash-sized layers (flash-layers:3: two sliding-window layers and a CSA layer, q_lora_rank
  1024, so the fused kernel), 6 steps: off == on (graphs) == on (eager), logits and caches; the
  eager on-step launches gemv_bf16_pl2_r2 once (the CSA layer)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import (assert_arms_agree, eager_step_launches, env_arm_runner,  # noqa: E402
                                        step_forms)
from memra_dsv4.gpu.step_device import IDXQ_PAIR_ENV  # noqa: E402

_ARMS = {"off": ("off", True), "on": ("on", True), "on+eager": ("on", False)}


def _interleave(tag, m, states, ids, arms, monkeypatch, fused_check=False):
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        assert names.count("gemv_bf16_pl2_r2") == 1, names   # the one CSA layer
        return logits
    assert_arms_agree(tag, states, ids, env_arm_runner(m, states, IDXQ_PAIR_ENV, arms, monkeypatch,
                                                       first_eager=first if fused_check else None))


def test_idxq_pair_step_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 14
    ids = _ids(ck.config, prompt + steps + 1, seed=59)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    with step_forms(m, decode_fork="all", hc_split="on"):
        _interleave("tiny", m, states, ids[prompt:prompt + steps], _ARMS, monkeypatch)


def test_idxq_pair_device_hostmath_equals_legacy_tiny(monkeypatch):
    from test_decode_gpu import hostmath_equals_legacy_with  # prepend import mode (tests/gpu on sys.path)
    monkeypatch.setenv(IDXQ_PAIR_ENV, "on")
    hostmath_equals_legacy_with(None, None, seed=61, what="indexer q in wq_b")


def test_idxq_pair_step_bit_identical_flash_layer(monkeypatch):
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    m, states, ids, prompt = flash_prefilled(3, _ARMS, seed=67, dense=None)
    assert m.config.q_lora_rank == 1024
    assert [m.config.compress_ratio(i) for i in range(3)] == [0, 0, 4]
    _interleave("flash-layers:3", m, states, ids[prompt:], _ARMS, monkeypatch, fused_check=True)
