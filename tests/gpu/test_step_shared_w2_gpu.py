"""The shared expert's w2 inside the routed down + combine (seam MEMRA_DSV4_DECODE_SHARED_W2,
step_device._moe): with ``fused`` the step launches no gemv_bf16 for w2; the down + combine's
_k2_f_w2 kernel computes the w2 rows with gemv_bf16's row code (kernels_cu/gemv_bf16_row.cuh), so
the step must give the bits of ``gemv`` (the default).

* one Flash-sized layer (flash-layers:1, bf16 dense: the kernel applies), 5-token prefill, 6
  steps, arms interleaved step by step: gemv (graph; the reference), fused (graph), fused eager;
  logits of every step and every cache byte equal; the first eager fused step launches
  gemv_*_down_combine_k2_f_w2 and no gemv_bf16 reading w2's bytes; the cached graph records the
  form (a switch recaptures).
* tiny (the shapes do not qualify: the step keeps the separate launch): fused == gemv, 8 steps.
* device-hostmath with fused == legacy byte for byte (tiny, 5 steps)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import (arm_attrs_now, assert_arms_agree, attr_arm_runner,  # noqa: E402
                                        eager_step_launches, step_forms)

# arm -> ({decode_shared_w2}, graph); "gemv" (the separate w2 launch, graph) is the reference
_ARMS = {"gemv": ({"decode_shared_w2": "gemv"}, True), "fused": ({"decode_shared_w2": "fused"}, True),
         "fused+eager": ({"decode_shared_w2": "fused"}, False)}


def _interleave(tag, m, states, ids, arms, check_fused_launch=False):
    """assert_arms_agree over ``arms``; with check_fused_launch the first eager fused step is
    recorded launch by launch: it launches the _k2_f_w2 down + combine and not _k2_f."""
    def first(a, t):
        logits, names = eager_step_launches(m, states[a], t)
        assert any(n.endswith("_down_combine_k2_f_w2") for n in names), sorted(set(names))
        assert not any(n.endswith("_down_combine_k2_f") for n in names), sorted(set(names))
        return logits
    with step_forms(m, **arm_attrs_now(m, arms)):
        assert_arms_agree(f"{tag} shared w2", states, ids,
                          attr_arm_runner(m, states, arms, first_eager=first if check_fused_launch else None))


def test_shared_w2_fused_step_bit_identical_flash_layer():
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    m, states, ids, prompt = flash_prefilled(1, _ARMS, seed=31)
    _interleave("flash-layers:1", m, states, ids[prompt:], _ARMS, check_fused_launch=True)
    assert m._step._graphs[states["fused"]].w2 == "fused"
    assert m._step._graphs[states["gemv"]].w2 == "gemv"


def test_shared_w2_fused_step_tiny_falls_back():
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 8
    ids = _ids(ck.config, prompt + steps, seed=19)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    _interleave("tiny", m, states, ids[prompt:prompt + steps], _ARMS)


def test_shared_w2_fused_device_hostmath_equals_legacy_tiny():
    from test_decode_gpu import hostmath_equals_legacy_with  # prepend import mode (tests/gpu on sys.path)
    hostmath_equals_legacy_with("decode_shared_w2", "fused", seed=37, what="shared w2 fused")
