"""Dsv4Gpu.synthetic(expert_storage="shared") on the GPU (weights.EXPERT_STORAGE): every MoE layer
of a stage aliases its first MoE layer's routed-expert arrays (w1 / w2 / w3, packed and scale),
the stage's bytes shrink by exactly the aliased arrays, the dense weights are still per layer,
and the model decodes: device-hostmath == legacy byte for byte (the byte-identity instrument of
#7) on the shared-storage model, as on any other.  (bench.decode_step --expert-storage shared
uses it for a full-depth Flash on one H200.)"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _expert_keys(st, w):
    return sorted((k for k in st.t if k.endswith(f".ffn.experts.{w}.packed")),
                  key=lambda k: int(k.split(".")[1]))


def test_shared_expert_storage_aliases_and_decodes():
    from memra_dsv4.gpu.model import Dsv4Gpu
    per = Dsv4Gpu.synthetic("tiny", devices=(0,), seed=3, decode_path="legacy")
    sh = Dsv4Gpu.synthetic("tiny", devices=(0,), seed=3, decode_path="legacy", expert_storage="shared")
    sp, ss = per.stages[0], sh.stages[0]
    aliased = 0
    for w in ("w1", "w2", "w3"):
        kp, ks = _expert_keys(sp, w), _expert_keys(ss, w)
        assert kp == ks and len(ks) >= 2, (w, ks)
        first = ss.t[ks[0]]
        for k in ks[1:]:
            assert ss.t[k].data.ptr == first.data.ptr, f"{k}: not the first MoE layer's array"
            sc = k[:-len(".packed")] + ".scale"
            assert ss.t[sc].data.ptr == ss.t[ks[0][:-len(".packed")] + ".scale"].data.ptr, sc
            assert sp.t[k].data.ptr != sp.t[kp[0]].data.ptr, f"{k}: per-layer storage aliases"
            aliased += int(first.nbytes) + int(ss.t[sc].nbytes)
    assert sp.nbytes - ss.nbytes == aliased, (sp.nbytes, ss.nbytes, aliased)
    wq = [k for k in ss.t if k.endswith("attn.wq_a.weight")]
    assert len({ss.t[k].data.ptr for k in wq}) == len(wq) >= 2     # dense weights stay per layer

    legacy = sh
    hostmath = Dsv4Gpu.synthetic("tiny", devices=(0,), seed=3, decode_path="device-hostmath",
                                 expert_storage="shared")
    V = sh.config.vocab_size
    ids = np.random.default_rng(7).integers(2, V, 21)
    _, sa = legacy.prefill(ids[:16])
    _, sb = hostmath.prefill(ids[:16])
    for i, t in enumerate(ids[16:]):
        a, b = legacy.decode_step(sa, int(t)), hostmath.decode_step(sb, int(t))
        assert np.array_equal(a, b), f"step {i}: max |diff| {np.abs(a - b).max()}"
        assert np.isfinite(a).all()

