"""The device step with the one-launch decode attention (sparse_attention_decode: build_cand +
split + combine in sparse_attn_decode_*) and the one-launch compressor emission (compressor.emit:
compress_emit_*) == the same step with the launches they replace, byte for byte: logits of every
step and the whole cache state (compressed rows, pending rows).  tiny and small run through
several emissions of every ratio they have, with graphs (and PDL as the model is configured).
The fused attention is the model's decode_attn = "fused" (seam MEMRA_DSV4_DECODE_ATTN; the
default "split" runs build_cand + split + combine from the step itself): the first test sets it.

test_device_step_decode_attn_split_equals_fused: the seam's two forms, as the step runs them,
give the same logits and caches byte for byte, with graphs and eagerly; switching the form on a
state recaptures its graphs.  Byte identity is what the code guarantees: the fused kernel's
mergers run the combine kernel's merge_partials4 (explicitly rounded __fmul_rn / __fadd_rn, tile
0.. in order; only the partials' load path differs, ld.cg vs ld.global.nc), build_cand's list is
computed by the same rule, and both forms take n_split = auto_split(1, H, K)."""
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
    # One scratch pair per compressor kind, allocated before any capture: with decode_fork
    # "on" / "all" (the default) a CSA layer's attention compressor ("fp8", on S.side) and its
    # indexer's compressor ("hadfp4", on S.side2) are captured on CONCURRENT graph branches, so
    # one shared pooled / aux let one emission overwrite the other's pooled row between its pool
    # and its norm_rope_sim (a race of this harness only: compress_emit_* keeps its pooled row in
    # registers / shared memory).  It showed as sporadic logit differences late in small's run
    # (nineteenth session, under two other test processes).  Layers follow one another through
    # the fork joins, so two pairs are enough.
    scratch = {m: (cp.empty((512,), cp.float32), cp.zeros((8,), cp.int32)) for m in ("fp8", "hadfp4")}

    def emit(pos, kv, score, ratio, overlap, weight, eps, cos, sin, mode, out):
        pooled, aux = scratch[mode]
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
    monkeypatch.setattr(m, "decode_attn", "fused")  # the step calls AT.sparse_attention_decode
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


def _attn_kernels(m, st, tok):
    """The attention-related kernels one eager device step launches (profiling.launches)."""
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.profiling.launches import record_launches
    recs = record_launches(lambda: device_step(m, st, tok, graph=False))
    return {r.kernel.split(".", 1)[1] for r in recs
            if "sparse_attn" in r.kernel or r.kernel.endswith(".build_cand")}


@pytest.mark.parametrize("name,L,steps", [("tiny", 130, 20), ("small", 130, 20)])
def test_device_step_decode_attn_split_equals_fused(name, L, steps):
    """model.decode_attn "split" (build_cand + sparse_attn_d*_hg* + sparse_attn_combine_d*) ==
    "fused" (sparse_attn_decode_d*_hg*), byte for byte: logits of every step and the whole cache
    state, graph replay and eager, after a prefill of 130 tokens (past the window and several
    emissions of every ratio: compressed candidates exist); a form switched on a state with
    graphs is recaptured (the graph cache records it) and continues byte-identical."""
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, (0,), "device")
    cfg = ck.config
    ids = _ids(cfg, L + steps + 6, seed=97)
    assert L > cfg.sliding_window and L >= 2 * max(cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers))
    keep = m.decode_attn
    runs, kernels = {}, {}
    try:
        for attn in ("split", "fused"):
            m.decode_attn = attn
            for graph in (True, False):
                _, st = m.prefill(ids[:L], m.new_state())
                runs[(attn, graph)] = ([device_step(m, st, t, graph=graph) for t in ids[L:L + steps]], st)
            _, sk = m.prefill(ids[:L], m.new_state())
            kernels[attn] = _attn_kernels(m, sk, ids[L])
        # the forms launch what they say
        assert "build_cand" in kernels["split"] and not any("decode" in k for k in kernels["split"]), kernels
        assert any(k.startswith("sparse_attn_decode_") for k in kernels["fused"]), kernels
        assert "build_cand" not in kernels["fused"] and not any("combine" in k for k in kernels["fused"]), kernels
        ref, sref = runs[("split", True)]
        gref = sref.snapshot()
        for key in (("split", False), ("fused", True), ("fused", False)):
            got, st = runs[key]
            bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(ref, got))
                   if not np.array_equal(x, y)]
            assert not bad, f"{name}: {key} vs split graph logits differ at (step, max|diff|): {bad}"
            g = st.snapshot()
            diff = [k for k in gref if not np.array_equal(gref[k], g[k])]
            assert not diff, f"{name}: {key} vs split graph state differs in {diff}"
        # switch the form on states that have graphs: split-graph state -> fused, and back
        sa, sb = runs[("split", True)][1], runs[("fused", True)][1]
        tail = ids[L + steps:L + steps + 6]
        m.decode_attn = "fused"
        a = [device_step(m, sa, t, graph=True) for t in tail[:3]]
        assert m._step._graphs[sa].attn == "fused", "switching decode_attn did not recapture"
        m.decode_attn = "split"
        a += [device_step(m, sa, t, graph=True) for t in tail[3:]]
        assert m._step._graphs[sa].attn == "split", "switching decode_attn back did not recapture"
        m.decode_attn = "fused"
        b = [device_step(m, sb, t, graph=True) for t in tail]
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not np.array_equal(x, y)]
        assert not bad, f"{name}: switched-form steps differ from fused at {bad}"
        m.decode_attn = "bogus"
        with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_ATTN.*split, fused"):
            device_step(m, sb, tail[0], graph=True)
    finally:
        m.decode_attn = keep
