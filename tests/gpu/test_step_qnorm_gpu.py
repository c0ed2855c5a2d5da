"""The per-head q norm inside the sparse attention (seam MEMRA_DSV4_DECODE_QNORM, step_device._attention):
with ``attn`` the step launches no head_rms_bf16; the attention's _qn kernels norm + rope the raw
q rows at their q load with head_rms_bf16's own row code (kernels_cu/head_rms.cuh), so the step
must give the bits of ``kernel`` (head_rms_bf16 after wq_b, the default).

* tiny (1 stage; sliding, CSA and HCA layers; H = 4, D = 128), 14 steps after a 5-token prefill
  (CSA emits, the window wraps), the arms interleaved step by step, logits of every step and every
  cache byte equal: kernel (graph; the reference), attn (graph), attn with the one-launch decode
  attention (decode_attn fused: sparse_attn_decode_*_qn; graph), attn eager.  The first eager
  attn step launches the _qn kernels and no head_rms_bf16; an eager kernel step the opposite.
  Switching the seam recaptures (the cached graph records its q norm form).
* device-hostmath with attn == legacy byte for byte (tiny, 5 steps): the device-hostmath path's
  contract holds with the seam on.
* one Flash-sized layer (flash-layers:1: H = 64, D = 512, the default hg8 kernels; a sliding-window
  layer), 5-token prefill, 6 steps: kernel == attn == attn + fused (graphs), logits and caches.
  Host cost: the checkpoint is ~5 GB of NumPy arrays (as tests/gpu/test_step_fp4full_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import (arm_attrs_now, assert_arms_agree, attr_arm_runner,  # noqa: E402
                                        eager_step_launches, step_forms)


def _arm(qnorm, attn, graph):
    return {"decode_qnorm": qnorm, "decode_attn": attn}, graph


# "kernel" (the head_rms launch, graph) is the reference
_ARMS = {"kernel": _arm("kernel", "split", True), "attn": _arm("attn", "split", True),
         "attn+fused": _arm("attn", "fused", True), "attn+eager": _arm("attn", "split", False)}


def _check_launches(m, state, t, qnorm: str):
    """One eager step of ``state`` at qnorm, recorded launch by launch; returns its logits."""
    m.decode_qnorm, m.decode_attn = qnorm, "split"
    logits, launched = eager_step_launches(m, state, t)
    names = set(launched)
    qn = {n for n in names if n.startswith("sparse_attn_") and n.endswith("_qn")}
    plain = {n for n in names if n.startswith("sparse_attn_d") and not n.endswith("_qn")}
    if qnorm == "attn":
        assert "head_rms_bf16" not in names and qn and not plain, sorted(names)
    else:
        assert "head_rms_bf16" in names and plain and not qn, sorted(names)
    return logits


def _interleave(tag, m, states, ids, arms, check_launches=False):
    """assert_arms_agree over ``arms``; with check_launches the first step of each eager arm is
    recorded launch by launch (_check_launches)."""
    first = (lambda a, t: _check_launches(m, states[a], t, arms[a][0]["decode_qnorm"])) if check_launches else None
    with step_forms(m, **arm_attrs_now(m, arms)):
        assert_arms_agree(f"{tag} qnorm", states, ids, attr_arm_runner(m, states, arms, first_eager=first))


def test_qnorm_attn_step_bit_identical_tiny():
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    prompt, steps = 5, 14
    ids = _ids(ck.config, prompt + steps + 2, seed=17)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    _interleave("tiny", m, states, ids[prompt:prompt + steps], _ARMS, check_launches=True)
    # the cached graphs record the form they were captured with (a switch recaptures)
    assert m._step._graphs[states["attn"]].qnorm == "attn"
    assert m._step._graphs[states["kernel"]].qnorm == "kernel"
    # an eager kernel step launches head_rms_bf16 and the plain kernels (and the same bits)
    extra = {a: states[a] for a in ("kernel", "attn")}
    t = ids[prompt + steps]
    old = (getattr(m, "decode_qnorm", "kernel"), getattr(m, "decode_attn", "split"))
    try:
        a = _check_launches(m, extra["kernel"], t, "kernel")
        b = _check_launches(m, extra["attn"], t, "attn")
    finally:
        m.decode_qnorm, m.decode_attn = old
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), "eager kernel != eager attn"


def test_qnorm_attn_device_hostmath_equals_legacy_tiny():
    from test_decode_gpu import hostmath_equals_legacy_with  # prepend import mode (tests/gpu on sys.path)
    hostmath_equals_legacy_with("decode_qnorm", "attn", seed=23, what="qnorm attn")


def test_qnorm_attn_step_bit_identical_flash_layer():
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)
    arms = {a: _ARMS[a] for a in ("kernel", "attn", "attn+fused")}
    m, states, ids, prompt = flash_prefilled(1, arms, seed=29, dense=None)
    cfg = m.config
    assert (cfg.num_attention_heads, cfg.head_dim) == (64, 512)
    _interleave("flash-layers:1", m, states, ids[prompt:], arms)
