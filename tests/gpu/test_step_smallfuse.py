"""The device step with the one-launch decode attention (sparse_attention_decode: build_cand +
split + combine in sparse_attn_decode_*) and the one-launch compressor emission (compressor.emit:
compress_emit_*) == the same step with the launches they replace, byte for byte: logits of every
step and the whole cache state (compressed rows, pending rows).  tiny and small run through
several emissions of every ratio they have, with graphs (and PDL as the model is configured)."""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import _ids, _model  # prepend import mode

pytestmark = pytest.mark.gpu


def _unfused_attention(AT, DK, cp, kmax):
    cand = cp.empty((kmax,), cp.int32)  # allocated before any capture

    def sparse_attention_decode(q, kv, pos, window, ratio, sel, K, sink, scale, out=None, *, probs_bf16=False,
                                n_split=None, n_merge=None, workspace=None, counters=None, inverse_rope=None):
        c = cand[:K]
        DK.build_cand(pos, c, window, ratio, sel)
        return AT.sparse_attention(q, kv, c.reshape(1, K), sink, scale, out=out, probs_bf16=probs_bf16,
                                   n_split=n_split, workspace=workspace, inverse_rope=inverse_rope)
    return sparse_attention_decode


def _unfused_emit(CM, DK, cp):
    pooled = cp.empty((512,), cp.float32)
    aux = cp.zeros((8,), cp.int32)

    def emit(pos, kv, score, ratio, overlap, weight, eps, cos, sin, mode, out):
        r = int(ratio)
        d = kv.shape[1] // 2 if overlap else kv.shape[1]
        pl = pooled[:d].reshape(1, d)
        gate = (pos, r)
        if overlap:
            CM.pool_overlap(kv[r:2 * r], score[r:2 * r], 1, out=pl, prev_kv=kv[:r], prev_score=score[:r],
                            emit_gate=gate)
        else:
            CM.pool_plain(kv, score, r, 1, out=pl, emit_gate=gate)
        DK.step_scalars(pos, aux, [r])  # aux[1] = max(pos + 1 - r, 0): the former kpos
        CM.norm_rope_sim(pl, weight, eps, cos, sin, aux[1:2], mode, out=out, emit_gate=gate, row="entry")
        DK.pending_advance(pos, kv, score, r, overlap)
        return out
    return emit


@pytest.mark.parametrize("name,L,steps", [("tiny", 5, 40), ("small", 30, 140)])
def test_device_step_smallfuse_equals_unfused(name, L, steps, monkeypatch):
    import cupy as cp

    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import attention as AT
    from memra_dsv4.gpu.ops import compressor as CM
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, (0,), "device")
    cfg = ck.config
    ids = _ids(cfg, L + steps, seed=91)
    _, sf = m.prefill(ids[:L], m.new_state())
    fused = [device_step(m, sf, t, graph=True) for t in ids[L:]]
    kmax = cfg.sliding_window + max(cfg.index_topk, 1024)  # >= every layer's K at max_seq_len 1024
    monkeypatch.setattr(AT, "sparse_attention_decode", _unfused_attention(AT, DK, cp, kmax))
    monkeypatch.setattr(CM, "emit", _unfused_emit(CM, DK, cp))
    _, su = m.prefill(ids[:L], m.new_state())  # a new state: a new capture, with the unfused ops
    unfused = [device_step(m, su, t, graph=True) for t in ids[L:]]
    bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(fused, unfused))
           if not np.array_equal(x, y)]
    assert not bad, f"{name}: fused vs unfused attention/compressor logits differ at (step, max|diff|): {bad}"
    ga, gb = sf.snapshot(), su.snapshot()
    diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
    assert not diff, f"{name}: fused vs unfused state differs in {diff}"
    ratios = sorted({cfg.compress_ratio(lid) for lid in range(cfg.num_hidden_layers)} - {0})
    assert all(L + steps >= 2 * r for r in ratios), f"{name}: too few steps for two emissions of {ratios}"
