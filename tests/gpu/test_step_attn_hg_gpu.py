"""MEMRA_DSV4_DECODE_ATTN_HG (step_device.decode_attn_head_group): the device step's split
attention kernel with 8 or 4 heads per CTA instead of 16, every 32-row tile in its own CTA.  A
head's dots, tile statistics and merge do not depend on the head group, and a CTA whose tile
holds no candidate writes the partial the full path computes for it (attention.cu), so the
step must give the default's bits:

* flash-layers:4 (two window-only layers, one CSA, one HCA: K = 128, 384 and 136 at max_seq_len 1024, so the 6
  steps after a 5-token prefill run tiles with candidates beside empty ones in every kind),
  arms interleaved step by step: own (graph; the reference, 16 heads per CTA, the default until
  the thirty-first session), auto (graph; the default, 8 for Flash's 64 heads), 4 (graph), 4
  eager, 8 (graph); logits of every step and every cache byte equal; the first eager hg4
  step launches sparse_attn_d512_hg4 once per layer with grid (1, 16, tiles of the layer's
  list) and never sparse_attn_d512_hg16;
* in the same interleave, 4 heads per CTA with the seam MEMRA_DSV4_DECODE_QNORM = attn (graph):
  the _qn kernels (sparse_attn_d512_hg4_qn: each warp norms + ropes its one head's raw q row, no
  head_rms_bf16 launch), the same bits as well."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import assert_arms_agree, step_forms  # noqa: E402
from step_models import flash_prefilled  # noqa: E402  (tests/gpu on sys.path)

ENV = "MEMRA_DSV4_DECODE_ATTN_HG"
# arm -> (MEMRA_DSV4_DECODE_ATTN_HG, the model's decode_qnorm seam, graph)
_ARMS = {"own": ("own", "kernel", True), "auto": ("auto", "kernel", True), "hg4": ("4", "kernel", True),
         "hg4+eager": ("4", "kernel", False), "hg8": ("8", "kernel", True), "hg4+qn": ("4", "attn", True)}


def _runner(m, states, monkeypatch, first_eager):
    """``run`` for assert_arms_agree: the arm's head group (env) and q norm form (model attribute)
    set, then its state's device step (graph replay or eager; the first eager step by
    first_eager).  Each state's graph is captured at its first step, with its arm's settings."""
    def run(a, i, t):
        from memra_dsv4.gpu.step import device_step
        hg, qn, graph = _ARMS[a]
        monkeypatch.setenv(ENV, hg)
        m.decode_qnorm = qn
        if i == 0 and not graph:
            return first_eager(a, t)
        return device_step(m, states[a], int(t), graph=graph)
    return run


def _first_eager(m, states, n_layers: int):
    """The first eager hg4 step: one sparse_attn_d512_hg4 launch per layer, each with 16 head
    groups and one CTA per tile of its candidate list; no hg16 launch."""
    from memra_dsv4.gpu.ops import attention as AT
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.profiling.launches import record_launches

    def first(a, t):
        out = []
        recs = record_launches(lambda: out.append(device_step(m, states[a], int(t), graph=False)),
                               ("step_device.py",))
        attn = [r for r in recs if r.kernel.split(".", 1)[1].startswith("sparse_attn_d512_hg")]
        names = [r.kernel.split(".", 1)[1] for r in attn]
        assert names == ["sparse_attn_d512_hg4"] * n_layers, names
        W = m.config.sliding_window
        for r, ratio in zip(attn, m.config.compress_ratios[:n_layers]):
            # step.step_ws_plan's widths at max_seq_len 1024: the CSA selection min(topk, 1024 / 4)
            K = W if ratio == 0 else (W + min(m.config.index_topk, 256) if ratio == 4 else W + 1024 // ratio)
            assert r.grid == (1, 16, AT.n_tiles(K)), (ratio, r.grid)
        return out[0]
    return first


def test_attn_head_group_step_bit_identical_flash_layers(monkeypatch):
    m, states, ids, prompt = flash_prefilled(4, _ARMS, seed=83)
    with step_forms(m, decode_qnorm=m.decode_qnorm):
        assert_arms_agree("flash-layers:4 attention head group", states, ids[prompt:],
                          _runner(m, states, monkeypatch, _first_eager(m, states, 4)), pos0=prompt)
