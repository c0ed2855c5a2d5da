"""The device step with the fused decode router (router_cluster_* under the default
MEMRA_DSV4_ROUTER_HANDOFF, else router_fused_*) and indexer
(indexer_fused_d128) == the same step with the unfused pairs they replace (router logits +
select; indexer scores + top-k in index order), byte for byte: logits of every step and the
whole cache state.  tiny (index_topk 2) and small (8) run past n_valid > index_topk, so both the
short-circuit and the radix path of the fused top-k are in the trajectory; their first layers
are hash-routed."""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import _ids, _model  # prepend import mode

pytestmark = pytest.mark.gpu


def _unfused_router(RT):
    def fused(x, w_gate, k, route_scale, *, bias=None, tid2eid=None, token_ids=None, logits=None, scores=None,
              idx=None, weights=None, counter=None, handoff=None):
        RT.logits(x, w_gate, out=logits)
        return RT.select(logits, k, route_scale, bias=bias, tid2eid=tid2eid, token_ids=token_ids, idx=idx,
                         weights=weights, scores=scores)
    return fused


def _unfused_indexer(IX):
    def scores_topk(q, w, keys, n_valid, k, scores_out, sel_out, *, offset=0, w_scale=1.0, counter=None):
        IX.scores(q, w, keys, n_valid, out=scores_out, w_scale=w_scale)
        return IX.topk(scores_out, n_valid, k, out=sel_out, offset=offset, order="index", width=sel_out.shape[1])
    return scores_topk


@pytest.mark.parametrize("name,L,steps", [("tiny", 5, 40), ("small", 30, 40)])
def test_device_step_fused_equals_unfused(name, L, steps, monkeypatch):
    from memra_dsv4.gpu.ops import indexer as IX
    from memra_dsv4.gpu.ops import router as RT
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, (0,), "device")
    ids = _ids(ck.config, L + steps, seed=77)
    _, sf = m.prefill(ids[:L], m.new_state())
    fused = [device_step(m, sf, t, graph=True) for t in ids[L:]]
    monkeypatch.setattr(RT, "fused", _unfused_router(RT))
    monkeypatch.setattr(IX, "scores_topk", _unfused_indexer(IX))
    _, su = m.prefill(ids[:L], m.new_state())  # a new state: a new capture, with the unfused ops
    unfused = [device_step(m, su, t, graph=True) for t in ids[L:]]
    bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(fused, unfused))
           if not np.array_equal(x, y)]
    assert not bad, f"{name}: fused vs unfused router/indexer logits differ at (step, max|diff|): {bad}"
    ga, gb = sf.snapshot(), su.snapshot()
    diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
    assert not diff, f"{name}: fused vs unfused state differs in {diff}"
