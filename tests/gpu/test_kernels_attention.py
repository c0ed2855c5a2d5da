"""kernels_cu/attention.cu against oracle.ops.sparse_attention_with_sinks.

Bound per output element, from the twin's own softmax (A = sum_j p_j |v_j[d]| / den):
  |got - want| <= 2 ulp_bf16(want) + (2 * E_s + 2^-16) * A            bf16 class (P in f32)
                 + 2^-8 * A                                              reference class (P -> bf16)
where E_s = scale * LOGIT_TERMS * 2^-24 * max_j sum_d |q_d kv_jd| bounds the f32 logit error
(LOGIT_TERMS = the longest f32 accumulation chain of a logit: 16 FMAs per lane + a 5-level tree;
2^-16 covers the P.V chain: 32 FMAs per tile and <= 3 roundings per tile merge, and expf),
and the reference class casts P to bf16 relative to each tile's max instead of the global one.
Bitwise properties: fused (n_split = 1) == split (any n_split) == auto; a token alone == the
same token in a batch (decode == prefill).
Cases: Flash (H = 64, D = 512, window 128 as ring slots + 512 selected entries, decode offsets,
-1 padding, window wrap) and tiny (H = 4, D = 128, K = 10, not a multiple of the 32-tile).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import attention as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_within, bits_of, describe, fresh_seed, rand_bf16, rng_for, ulp_bf16  # noqa: E402
from memra_dsv4.host.indices import candidate_row, window_positions, window_ring_slots  # noqa: E402
from memra_dsv4.host.quant import kv_fp8_sim  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402
from memra_dsv4.seams import POLICIES  # noqa: E402

pytestmark = pytest.mark.gpu

LOGIT_TERMS = 24
P_BF16_REL = 2.0 ** -8
PV_REL = 2.0 ** -16


def _case(rng, T, H, D, W, topk, n_comp, decode: bool):
    """q, kv rows, candidate idx [T, W + topk], sink.  decode: kv = [ring W rows | entries],
    window as ring slots, entries at offset W; prefill: kv = [L token rows | entries], offset L."""
    pos = np.sort(rng.integers(0, 4 * n_comp, T))
    if T > 2:
        pos[0], pos[1] = 3, W - 1  # early tokens: -1 padded window, first emits
    L = int(pos.max()) + 1
    offset = W if decode else L
    N = offset + n_comp
    rows = []
    for t in pos:
        n_t = (int(t) + 1) // 4
        comp = np.sort(rng.choice(n_t, size=min(topk, n_t), replace=False)) if n_t else np.zeros(0, np.int64)
        win = window_ring_slots(int(t), W) if decode else window_positions(int(t), W)
        rows.append(candidate_row(win, comp, offset, topk))
    idx = np.stack(rows).astype(np.int32)
    q = rand_bf16(rng, (T, H, D), 1.0)
    kv = kv_fp8_sim(rand_bf16(rng, (N, D), 1.0, spread=1), 64)
    sink = (rng.standard_normal(H) * 2).astype(np.float32)
    return q, kv, idx, sink


def _bound(q, kv, idx, sink, scale, want, probs_bf16):
    q64, kv64 = q.astype(np.float64), kv.astype(np.float64)
    T, H, D = q.shape
    out = np.empty(want.shape, np.float64)
    for t in range(T):
        valid = idx[t] >= 0
        g = np.where(valid[:, None], kv64[np.where(valid, idx[t], 0)], 0.0)
        s = np.where(valid[None, :], (q64[t] @ g.T) * scale, -np.inf)
        m = np.maximum(s.max(axis=-1), sink)
        p = np.exp(s - m[:, None])
        den = p.sum(-1) + np.exp(sink - m)
        A = (p @ np.abs(g)) / den[:, None]
        Es = scale * LOGIT_TERMS * 2.0 ** -24 * (np.abs(q64[t]) @ np.abs(g).T).max(axis=-1)
        out[t] = (2 * Es[:, None] + PV_REL + (P_BF16_REL if probs_bf16 else 0.0)) * A
    return out + 2 * ulp_bf16(want)


CASES = {
    "flash_decode": dict(T=3, H=64, D=512, W=128, topk=512, n_comp=1200, decode=True),
    "flash_prefill": dict(T=4, H=64, D=512, W=128, topk=512, n_comp=700, decode=False),
    "tiny": dict(T=6, H=4, D=128, W=8, topk=2, n_comp=5, decode=True),
    "small": dict(T=5, H=8, D=128, W=32, topk=8, n_comp=40, decode=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("probs_bf16", [False, True])
def test_sparse_attention(case, probs_bf16):
    seed = fresh_seed()
    rng = rng_for(seed)
    c = CASES[case]
    q, kv, idx, sink = _case(rng, c["T"], c["H"], c["D"], c["W"], c["topk"], c["n_comp"], c["decode"])
    scale = c["D"] ** -0.5
    pol = POLICIES["reference" if probs_bf16 else "bf16"]
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale, pol=pol)
    qg, kvg, ig, sg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(idx), cp.asarray(sink)
    got = K.sparse_attention(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, n_split=1)
    gotf = (got.get().astype(np.uint32) << 16).view(np.float32)
    assert_within(gotf, want, _bound(q, kv, idx, sink, scale, want, probs_bf16), "sparse attention", seed,
                  case=case, probs_bf16=probs_bf16)
    # split paths give the same bits as the fused path
    for n_split in (2, 5, None):
        g2 = K.sparse_attention(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, n_split=n_split)
        assert cp.array_equal(g2, got), f"n_split={n_split} != fused {describe(seed, case=case)}"
    # a token alone (decode) == the same token in the batch (prefill)
    t = c["T"] - 1
    one = K.sparse_attention(qg[t:t + 1].copy(), kvg, ig[t:t + 1].copy(), sg, scale, probs_bf16=probs_bf16,
                             n_split=None)
    assert cp.array_equal(one[0], got[t]), f"token alone != in batch {describe(seed, case=case)}"


def test_sparse_attention_kv_cache_view_and_all_padding():
    """kv given as a row view of a larger cache; a candidate list that is all -1 but one slot."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, D, N = 2, 64, 512, 300
    q = rand_bf16(rng, (T, H, D), 1.0)
    cache = kv_fp8_sim(rand_bf16(rng, (N + 10, D), 1.0), 64)
    kv = cache[5:5 + N]
    idx = np.full((T, 160), -1, np.int32)
    idx[0, 37] = 3
    idx[1, :100] = rng.integers(0, N, 100)
    sink = (rng.standard_normal(H)).astype(np.float32)
    scale = D ** -0.5
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale)
    cg = cp.asarray(bits_of(cache))
    got = K.sparse_attention(cp.asarray(bits_of(q)), cg[5:5 + N], cp.asarray(idx), cp.asarray(sink), scale)
    gotf = (got.get().astype(np.uint32) << 16).view(np.float32)
    assert_within(gotf, want, _bound(q, kv, idx, sink, scale, want, False), "attention on a cache view", seed)


@pytest.mark.parametrize("case", ["flash_decode", "tiny"])
@pytest.mark.parametrize("n_split", [1, 3])
def test_sparse_attention_inverse_rope_epilogue(case, n_split):
    """The fused inverse-RoPE epilogue == attention, then rope.rope(inverse=True), bit for bit."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.ops import rope as ROPE
    from memra_dsv4.host.rope import layer_cos_sin

    seed = fresh_seed()
    rng = rng_for(seed)
    c = CASES[case]
    q, kv, idx, sink = _case(rng, c["T"], c["H"], c["D"], c["W"], c["topk"], c["n_comp"], c["decode"])
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(4096))
    cg, sg_ = cp.asarray(cos), cp.asarray(sin)
    pos = cp.asarray(rng.integers(0, 4096, c["T"]).astype(np.int32))
    qg, kvg, ig, skg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(idx), cp.asarray(sink)
    scale = c["D"] ** -0.5
    plain = K.sparse_attention(qg, kvg, ig, skg, scale, n_split=n_split)
    ROPE.rope(plain, pos, cg, sg_, inverse=True)
    fused = K.sparse_attention(qg, kvg, ig, skg, scale, n_split=n_split, inverse_rope=(pos, cg, sg_))
    assert cp.array_equal(fused, plain), f"inverse-rope epilogue != separate rope {describe(seed, case=case)}"
