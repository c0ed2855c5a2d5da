"""kernels_cu/attention.cu against oracle.ops.sparse_attention_with_sinks.

Bound per output element, from the twin's own softmax (A = sum_j p_j |v_j[d]| / den):
  |got - want| <= 2 ulp_bf16(want) + (2 * E_s + 2^-16) * A            bf16 class (P in f32)
                 + 2^-8 * A                                              reference class (P -> bf16)
where E_s = scale * LOGIT_TERMS * 2^-24 * max_j sum_d |q_d kv_jd| bounds the f32 logit error
(LOGIT_TERMS = the longest f32 accumulation chain of a logit: 16 FMAs per lane + a 5-level tree;
2^-16 covers the P.V chain: 32 FMAs per tile and <= 3 roundings per tile merge, and expf),
and the reference class casts P to bf16 relative to each tile's max instead of the global one.
Bitwise properties: fused (n_split = 1) == split (any n_split; the combine's partials staged in
shared memory or merged from L2: flash_decode / flash_decode_long) == auto; a token alone == the
same token in a batch (decode == prefill).
Cases: Flash (H = 64, D = 512, window 128 as ring slots + 512 selected entries, decode offsets,
-1 padding, window wrap) and tiny (H = 4, D = 128, K = 10, not a multiple of the 32-tile).

The tensor-core prefill kernel (sparse_attention_mma) is checked with the same bound, with
LOGIT_TERMS -> MMA_LOGIT_TERMS = 320: a logit is 8 chained mma.sync k-steps per 128-dim slice,
each adding 16 exact products to the accumulator; taking the worst case of a tensor core that
aligns the 17 addends to the largest and truncates each (<= 1 ulp = 2 units of 2^-24 of a
magnitude <= sum |q kv| per addend) gives 8 * 17 * 2 = 272 units, + 3 slice adds + the scale,
rounded up to 320 (still 7x below one bf16 ulp of the output at D = 512: the O(1) errors of a
layout bug stay far outside).  PV_REL -> MMA_PV_REL = 2^-15: P = bf16(p) + bf16(p - bf16(p)) is
within 2^-16 p; 4 chained MMAs per tile (68 units of 2^-23 relative to sum p |v|, the same
worst case) ~ 2^-16.9; the merges ~2^-18 over 20 tiles.  Also: relative L2 against the twin's
stored output (bf16 class <= 1e-3: the CPU replay of the kernel's arithmetic,
tests/test_attention_mma_layout.py, measures ~7e-5 at D = 512, K = 640; reference class <= 4e-3:
~1.7e-3, the tile-max P cast, the same convention as the SIMT kernel) and against the SIMT kernel
(<= 1e-3); bitwise: heads_per_cta 16 == 32, a token alone == in a batch, the fused inverse-RoPE
epilogue == a separate rope.rope(inverse=True).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import attention as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_within, bf16, bits_of, describe, fresh_seed, rand_bf16, rng_for, ulp_bf16  # noqa: E402
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


def _bound(q, kv, idx, sink, scale, want, probs_bf16, logit_terms=LOGIT_TERMS, pv_rel=PV_REL):
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
        Es = scale * logit_terms * 2.0 ** -24 * (np.abs(q64[t]) @ np.abs(g).T).max(axis=-1)
        out[t] = (2 * Es[:, None] + pv_rel + (P_BF16_REL if probs_bf16 else 0.0)) * A
    return out + 2 * ulp_bf16(want)


CASES = {
    "flash_decode": dict(T=3, H=64, D=512, W=128, topk=512, n_comp=1200, decode=True),
    # 36 tiles: more partials than the combine stages in shared memory (ops.attention.combine_smem
    # 0: it merges from L2); flash_decode's 20 tiles are staged
    "flash_decode_long": dict(T=2, H=64, D=512, W=128, topk=1024, n_comp=2400, decode=True),
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


def _holed(idx):
    """idx with whole 32-candidate tiles of -1: tile 1 and every third tile from 3 on (where the
    list has them), plus two all -1 tiles appended: the split CTAs that write the empty partial
    without a gather (attention.cu tiles_have_candidates), between and after tiles with rows."""
    T, K = idx.shape
    out = np.concatenate([idx, np.full((T, 64), -1, np.int32)], axis=1)
    for tile in [1] + list(range(3, (K + 31) // 32, 3)):
        out[:, 32 * tile:32 * tile + 32] = -1
    # a lone candidate in the last tile of the original list keeps a mostly empty tile non-empty
    out[:, ((K - 1) // 32) * 32] = idx[:, 0]
    return out


@pytest.mark.parametrize("case", ["flash_decode", "flash_decode_long", "small", "tiny"])
@pytest.mark.parametrize("probs_bf16", [False, True])
def test_sparse_attention_head_groups_and_empty_tiles(case, probs_bf16):
    """Every head group of ops.attention.HEAD_GROUPS that divides H, split one tile per CTA, by
    auto_split for that group and in 2 CTAs, == the default group's fused path (n_split = 1) bit
    for bit, on candidate lists with whole tiles of -1 in the middle and at the end (_holed); the
    fused path is also within the twin's bound there.  (A head's dots, tile statistics and merge
    do not depend on the group; an empty tile's partial is (-inf, +0, +0) in both forms.)"""
    seed = fresh_seed()
    rng = rng_for(seed)
    c = CASES[case]
    q, kv, idx, sink = _case(rng, c["T"], c["H"], c["D"], c["W"], c["topk"], c["n_comp"], c["decode"])
    idx = _holed(idx)
    scale = c["D"] ** -0.5
    H = c["H"]
    qg, kvg, ig, sg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(idx), cp.asarray(sink)
    ref = K.sparse_attention(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, n_split=1)
    pol = POLICIES["reference" if probs_bf16 else "bf16"]
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale, pol=pol)
    reff = (ref.get().astype(np.uint32) << 16).view(np.float32)
    assert_within(reff, want, _bound(q, kv, idx, sink, scale, want, probs_bf16), "holed attention", seed,
                  case=case)
    nt = K.n_tiles(idx.shape[1])
    groups = [hg for hg in K.HEAD_GROUPS if H % hg == 0]
    assert groups and groups[0] == K.head_group(H)
    for hg in groups:
        for n_split in (nt, None, 2, 1):
            got = K.sparse_attention(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, n_split=n_split, head_group=hg)
            assert cp.array_equal(got, ref), f"head_group {hg}, n_split {n_split} != default fused {describe(seed, case=case)}"


def test_sparse_attention_head_group_refusals():
    """A head group outside HEAD_GROUPS, one that does not divide H, or not an int: refused with
    the value named, before any launch (the output keeps its bytes)."""
    rng = rng_for(fresh_seed())
    H, D = 4, 128
    q = cp.asarray(bits_of(rand_bf16(rng, (1, H, D), 1.0)))
    kv = cp.asarray(bits_of(rand_bf16(rng, (40, D), 1.0)))
    idx = cp.asarray(np.arange(40, dtype=np.int32).reshape(1, 40))
    sink = cp.zeros((H,), cp.float32)
    out = cp.full((1, H, D), 0x7fc1, cp.uint16)
    for hg, msg in ((3, "head_group 3 is not one of"), (32, "head_group 32 is not one of"),
                    (8, "head_group 8 does not divide H = 4"), (16, "head_group 16 does not divide H = 4"),
                    (True, "head_group must be an int"), (4.0, "head_group must be an int")):
        with pytest.raises(AssertionError, match=msg):
            K.sparse_attention(q, kv, idx, sink, D ** -0.5, out=out, n_split=2, head_group=hg)
        assert bool((out == 0x7fc1).all()), f"head_group {hg!r}: the refused call wrote out"
    got = K.sparse_attention(q, kv, idx, sink, D ** -0.5, out=out, n_split=2, head_group=4)
    assert got is out and not bool((out == 0x7fc1).all())


@pytest.mark.parametrize("case", ["flash_decode", "flash_decode_long", "small", "tiny"])
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


# ------------------------------------------------------------------ tensor-core prefill kernel
MMA_LOGIT_TERMS = 320
MMA_PV_REL = 2.0 ** -15

MMA_CASES = {
    # K = 640 = window 128 + top-k 512 (Flash CSA); early tokens: -1 window and entry padding
    "flash_prefill": dict(T=6, H=64, D=512, W=128, topk=512, n_comp=700, decode=False),
    "flash_decode_layout": dict(T=5, H=64, D=512, W=128, topk=512, n_comp=1200, decode=True),
    # many CTAs in flight (T * H/16 = 384), HCA-like K = 128 + 64 = 192
    "flash_prefill_t96_k192": dict(T=96, H=64, D=512, W=128, topk=64, n_comp=300, decode=False),
    # D = 128, K = 40 (a 8-slot tail tile)
    "d128_h32": dict(T=70, H=32, D=128, W=32, topk=8, n_comp=40, decode=False),
}


def _mma_case(rng, c):
    q, kv, idx, sink = _case(rng, c["T"], c["H"], c["D"], c["W"], c["topk"], c["n_comp"], c["decode"])
    idx[2, :] = -1                  # a fully masked token: o = 0
    idx[3, : idx.shape[1] // 2] = -1  # whole empty tiles before valid ones (skipped tiles)
    return q, kv, idx, sink


def _rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-300))


def _f32(bits_gpu):
    return (bits_gpu.get().astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("case", sorted(MMA_CASES))
@pytest.mark.parametrize("probs_bf16", [False, True])
def test_sparse_attention_mma(case, probs_bf16):
    seed = fresh_seed()
    rng = rng_for(seed)
    c = MMA_CASES[case]
    q, kv, idx, sink = _mma_case(rng, c)
    scale = c["D"] ** -0.5
    pol = POLICIES["reference" if probs_bf16 else "bf16"]
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale, pol=pol)
    qg, kvg, ig, sg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(idx), cp.asarray(sink)
    got = K.sparse_attention_mma(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, heads_per_cta=16)
    gotf = _f32(got)
    assert np.all(gotf[2] == 0), f"fully masked token not 0 {describe(seed, case=case)}"
    bound = _bound(q, kv, idx, sink, scale, want, probs_bf16, MMA_LOGIT_TERMS, MMA_PV_REL)
    assert_within(gotf, want, bound, "sparse attention (mma)", seed, case=case, probs_bf16=probs_bf16)
    r_twin = _rel_l2(gotf, want)
    assert r_twin <= (4e-3 if probs_bf16 else 1e-3), f"rel L2 vs twin {r_twin:.3e} {describe(seed, case=case)}"
    simt = _f32(K.sparse_attention(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, n_split=1))
    r_simt = _rel_l2(gotf, simt)
    assert r_simt <= 1e-3, f"rel L2 vs the SIMT kernel {r_simt:.3e} {describe(seed, case=case)}"
    print(f"\n{case} probs_bf16={probs_bf16}: rel L2 vs twin {r_twin:.2e}, vs SIMT {r_simt:.2e}, "
          f"SIMT vs twin {_rel_l2(simt, want):.2e}")
    # deterministic, and a token's bits do not depend on the launch's other tokens or on heads per CTA
    again = K.sparse_attention_mma(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, heads_per_cta=16)
    assert cp.array_equal(again, got), f"two launches differ {describe(seed, case=case)}"
    t = c["T"] - 1
    one = K.sparse_attention_mma(qg[t:t + 1].copy(), kvg, ig[t:t + 1].copy(), sg, scale, probs_bf16=probs_bf16,
                                 heads_per_cta=16)
    assert cp.array_equal(one[0], got[t]), f"token alone != in batch {describe(seed, case=case)}"
    if K.mma_supported(K.MMA_MIN_T, c["H"], c["D"], heads_per_cta=32):
        g32 = K.sparse_attention_mma(qg, kvg, ig, sg, scale, probs_bf16=probs_bf16, heads_per_cta=32)
        assert cp.array_equal(g32, got), f"heads_per_cta 32 != 16 {describe(seed, case=case)}"


@pytest.mark.parametrize("case", ["flash_prefill", "d128_h32"])
def test_sparse_attention_mma_inverse_rope_epilogue(case):
    """The fused inverse-RoPE epilogue == the MMA attention, then rope.rope(inverse=True), bit for bit."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.ops import rope as ROPE
    from memra_dsv4.host.rope import layer_cos_sin

    seed = fresh_seed()
    rng = rng_for(seed)
    c = MMA_CASES[case]
    q, kv, idx, sink = _mma_case(rng, c)
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(4096))
    cg, sg_ = cp.asarray(cos), cp.asarray(sin)
    pos = cp.asarray(rng.integers(0, 4096, c["T"]).astype(np.int32))
    qg, kvg, ig, skg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(idx), cp.asarray(sink)
    scale = c["D"] ** -0.5
    plain = K.sparse_attention_mma(qg, kvg, ig, skg, scale)
    ROPE.rope(plain, pos, cg, sg_, inverse=True)
    fused = K.sparse_attention_mma(qg, kvg, ig, skg, scale, inverse_rope=(pos, cg, sg_))
    assert cp.array_equal(fused, plain), f"inverse-rope epilogue != separate rope {describe(seed, case=case)}"


def test_sparse_attention_mma_kv_cache_view_and_all_padding():
    """kv as a row view of a larger cache (ld_kv > D); lists that are all -1 but one slot, a K
    that is not a multiple of 32, and rows whose only candidates sit in the last (partial) tile."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, D, N, Kc = 4, 64, 512, 300, 150
    q = rand_bf16(rng, (T, H, D), 1.0)
    wide = kv_fp8_sim(rand_bf16(rng, (N + 10, D + 64), 1.0), 64)
    kv = np.ascontiguousarray(wide[5:5 + N, :D])
    idx = np.full((T, Kc), -1, np.int32)
    idx[0, 37] = 3
    idx[1, :100] = rng.integers(0, N, 100)
    idx[2, 140:] = rng.integers(0, N, 10)
    idx[3] = rng.integers(0, N, Kc)
    sink = rng.standard_normal(H).astype(np.float32)
    scale = D ** -0.5
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale)
    wg = cp.asarray(bits_of(wide))
    got = K.sparse_attention_mma(cp.asarray(bits_of(q)), wg[5:5 + N, :D], cp.asarray(idx), cp.asarray(sink), scale)
    assert_within(_f32(got), want, _bound(q, kv, idx, sink, scale, want, False, MMA_LOGIT_TERMS, MMA_PV_REL),
                  "mma attention on a cache view", seed)


def test_chunk_routine_uses_mma_from_min_t(monkeypatch):
    """ChunkBlock.attention takes the tensor-core kernel for chunks of >= MMA_MIN_T tokens (tiny
    model: H = 4, D = 128, one partial 16-head group) and the SIMT kernel below.  The two prefills'
    logits agree within the bf16 class up to a near-tie router / top-k flip (rel L2 <= 0.5, the
    FLIP_REL of test_decode_gpu; a wrong attention moves them by O(1)); the oracle comparison of
    the MMA path is tests/gpu/test_prefill_gpu.py's long-prompt cases (300 and 140 tokens)."""
    from memra_dsv4.checkpoint import Checkpoint
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.synth import synth_arrays

    cfg = preset("tiny")
    m = Dsv4Gpu.load(Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=0)), devices=(0,))
    calls = []
    real = K.sparse_attention_mma

    def counting(*a, **kw):
        calls.append(int(a[0].shape[0]))
        return real(*a, **kw)

    monkeypatch.setattr(K, "sparse_attention_mma", counting)
    ids = np.random.default_rng(fresh_seed()).integers(2, cfg.vocab_size, K.MMA_MIN_T).tolist()
    m.forward(ids[:K.MMA_MIN_T - 1])
    assert calls == [], f"MMA kernel used below MMA_MIN_T: {calls}"
    a = m.forward(ids).logits
    assert calls and set(calls) == {K.MMA_MIN_T}, f"MMA kernel not used at T = MMA_MIN_T: {calls}"
    monkeypatch.setattr(K, "MMA_MIN_T", 10 ** 9)
    n = len(calls)
    b = m.forward(ids).logits
    assert len(calls) == n
    assert np.isfinite(a).all() and np.isfinite(b).all()
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    print(f"\ntiny prefill({K.MMA_MIN_T}) logits, MMA vs SIMT attention: rel L2 {rel:.2e}")
    assert rel <= 0.5, f"MMA vs SIMT prefill logits rel L2 {rel:.2e}: not a near-tie flip"


# ------------------------------------------------------------------ decode form (one launch)
# sparse_attention_decode == ops_decode.build_cand + sparse_attention(n_split) (split kernel +
# combine kernel), byte for byte, for every n_split / n_merge; the candidate list it computes
# in-kernel == host.indices' canonical row (through the twin bound); its ticket counters are zero
# after every launch, inside a CUDA graph replayed at changing positions, with PDL edges.
DECODE_CASES = {
    # name: H, D, W, ratio, sel width (CSA; None: HCA / window only), compressed rows
    "flash_csa": (64, 512, 128, 4, 512, 1200),
    "flash_hca": (64, 512, 128, 128, None, 96),
    "flash_window_only": (64, 512, 128, 0, None, 0),
    "tiny_csa": (4, 128, 8, 4, 2, 5),
    "small_hca": (8, 128, 32, 16, None, 40),
}


def _decode_inputs(rng, H, D, W, n_comp):
    q = rand_bf16(rng, (1, H, D), 1.0)
    kv = kv_fp8_sim(rand_bf16(rng, (W + n_comp, D), 1.0, spread=1), 64)
    sink = (rng.standard_normal(H) * 2).astype(np.float32)
    return q, kv, sink


def _decode_sel(rng, p, ratio, sel_w, n_comp):
    """The indexer's output for position p: ascending entries < min((p+1)//ratio, n_comp), -1 padded."""
    n_t = min((p + 1) // ratio, n_comp)
    comp = np.sort(rng.choice(n_t, size=min(sel_w, n_t), replace=False)) if n_t else np.zeros(0, np.int64)
    sel = np.full(sel_w, -1, np.int32)
    sel[:comp.size] = comp
    return sel


def _decode_positions(rng, W, ratio):
    r = max(ratio, 1)
    return sorted({0, 3, W - 1, W, 4 * r - 1, int(rng.integers(W, 4096)), int(rng.integers(0, 4096))})


def _host_cand(p, K, W, ratio, sel):
    win = window_ring_slots(p, W)
    if ratio == 0:
        return np.concatenate([win, np.full(K - W, -1, np.int32)])
    comp = np.arange((p + 1) // ratio, dtype=np.int32)[:K - W] if sel is None else sel
    return candidate_row(win, comp, W, comp_width=K - W)


@pytest.fixture(scope="module")
def rope_tables():
    from memra_dsv4.config import preset
    from memra_dsv4.host.rope import layer_cos_sin
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(4096))
    return cp.asarray(cos), cp.asarray(sin)


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("probs_bf16", [False, True])
def test_sparse_attention_decode_equals_build_cand_split_combine(case, probs_bf16, rope_tables):
    from memra_dsv4.gpu import ops_decode as DK
    seed = fresh_seed()
    rng = rng_for(seed)
    H, D, W, ratio, sel_w, n_comp = DECODE_CASES[case]
    K_ = W + (sel_w if sel_w is not None else n_comp)
    q, kv, sink = _decode_inputs(rng, H, D, W, n_comp)
    scale = D ** -0.5
    qg, kvg, sg = cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(sink)
    cg, sng = rope_tables
    counters = K.decode_counters()
    nt = K.n_tiles(K_)
    for p in _decode_positions(rng, W, ratio):
        sel = _decode_sel(rng, p, ratio, sel_w, n_comp) if sel_w is not None else None
        selg = cp.asarray(sel) if sel is not None else None
        pos = cp.asarray(np.array([p], np.int32))
        cand = cp.full(K_, 12345, cp.int32)
        DK.build_cand(pos, cand, W, ratio, selg)
        host = _host_cand(p, K_, W, ratio, sel)
        assert np.array_equal(cand.get(), host), f"build_cand != host row at pos {p} {describe(seed, case=case)}"
        for rope in (None, (pos, cg, sng)):
            for n_split in sorted({1, 2, 5, nt, K.auto_split(1, H, K_)}):
                want = K.sparse_attention(qg, kvg, cand.reshape(1, K_), sg, scale, probs_bf16=probs_bf16,
                                          n_split=n_split, inverse_rope=rope)
                ns = max(1, min(n_split, nt))
                for n_merge in sorted({1, 2, K.decode_mergers(H, D, ns), ns} - {0}):
                    if n_merge > ns:
                        continue
                    out = cp.full((1, H, D), 0x7fc1, cp.uint16)
                    ws = cp.full(K.workspace_size(1, H, D, K_), np.nan, cp.float32)
                    K.sparse_attention_decode(qg, kvg, pos, W, ratio, selg, K_, sg, scale, out=out,
                                              probs_bf16=probs_bf16, n_split=n_split, n_merge=n_merge,
                                              workspace=ws, inverse_rope=rope)
                    ctx = dict(case=case, pos=p, n_split=n_split, n_merge=n_merge, rope=rope is not None)
                    assert cp.array_equal(out, want), f"decode != build_cand + split + combine {describe(seed, **ctx)}"
                    assert not counters.any(), f"ticket counters not reset {describe(seed, **ctx)}"
        # the twin on the canonical candidate row (auto split / mergers, no rope)
        got = K.sparse_attention_decode(qg, kvg, pos, W, ratio, selg, K_, sg, scale, probs_bf16=probs_bf16)
        pol = POLICIES["reference" if probs_bf16 else "bf16"]
        idx = host.reshape(1, K_)
        want_t = O.sparse_attention_with_sinks(q, kv, idx, sink, scale, pol=pol)
        gotf = (got.get().astype(np.uint32) << 16).view(np.float32)
        assert_within(gotf, want_t, _bound(q, kv, idx, sink, scale, want_t, probs_bf16), "decode attention",
                      seed, case=case, pos=p)


def test_sparse_attention_decode_graph_replay_pdl(rope_tables):
    """Two decode launches (two 'layers' sharing the counters) captured once with PDL edges,
    replayed at changing device positions: every replay == the unfused reference, counters 0."""
    from memra_dsv4.gpu import graphs
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.pdl import pdl_launches
    seed = fresh_seed()
    rng = rng_for(seed)
    H, D, W, ratio, sel_w, n_comp = DECODE_CASES["flash_csa"]
    K_ = W + sel_w
    scale = D ** -0.5
    cg, sng = rope_tables
    layers = []
    for _ in range(2):
        q, kv, sink = _decode_inputs(rng, H, D, W, n_comp)
        layers.append((cp.asarray(bits_of(q)), cp.asarray(bits_of(kv)), cp.asarray(sink)))
    counters = K.decode_counters()
    stream = cp.cuda.Stream(non_blocking=True)
    pos = cp.zeros(1, cp.int32)
    sel = cp.full(sel_w, -1, cp.int32)
    outs = [cp.zeros((1, H, D), cp.uint16) for _ in layers]
    ws = cp.zeros(K.workspace_size(1, H, D, K_), cp.float32)

    def enqueue():
        for (qg, kvg, sg), o in zip(layers, outs):
            K.sparse_attention_decode(qg, kvg, pos, W, ratio, sel, K_, sg, scale, out=o, workspace=ws,
                                      inverse_rope=(pos, cg, sng))

    with stream:
        enqueue()  # load the module (and run once) before any capture
    stream.synchronize()
    for pdl in (False, True):
        with pdl_launches(pdl):
            g = graphs.capture(stream, enqueue)
        for p in (int(rng.integers(0, 600)), W - 1, 2047, int(rng.integers(600, 4096))):
            s = _decode_sel(rng, p, ratio, sel_w, n_comp)
            with stream:
                pos.set(np.array([p], np.int32), stream=stream)
                sel.set(s, stream=stream)
                g.launch(stream)
            stream.synchronize()
            cand = cp.empty(K_, cp.int32)
            DK.build_cand(pos, cand, W, ratio, sel)
            for (qg, kvg, sg), o in zip(layers, outs):
                want = K.sparse_attention(qg, kvg, cand.reshape(1, K_), sg, scale, n_split=None,
                                          inverse_rope=(pos, cg, sng))
                assert cp.array_equal(o, want), f"graph replay != reference {describe(seed, pos=p, pdl=pdl)}"
            assert not counters.any(), f"ticket counters not reset after replay {describe(seed, pos=p, pdl=pdl)}"


def test_sparse_attention_decode_refusals():
    q = cp.zeros((1, 64, 512), cp.uint16)
    kv = cp.zeros((200, 512), cp.uint16)
    pos, sink = cp.zeros(1, cp.int32), cp.zeros(64, cp.float32)
    with pytest.raises(AssertionError, match="expected \\[1, H, D\\]"):
        K.sparse_attention_decode(cp.zeros((2, 64, 512), cp.uint16), kv, pos, 128, 4, None, 160, sink, 1.0)
    with pytest.raises(AssertionError, match="n_merge"):
        K.sparse_attention_decode(q, kv, pos, 128, 128, None, 160, sink, 1.0, n_split=2, n_merge=3)
    with pytest.raises(AssertionError, match="needs ratio > 0"):
        K.sparse_attention_decode(q, kv, pos, 128, 0, cp.zeros(4, cp.int32), 132, sink, 1.0)


# ------------------------------------------------------------------ q norm at the q load (_qn)
# sparse_attention(q_raw, ..., q_norm=(eps, pos, cos, sin)) must be byte-for-byte
# rmsnorm.head_rms(q_raw, eps, rope=(pos, cos, sin)) followed by sparse_attention: the _qn kernels
# run head_rms_bf16's row code (kernels_cu/head_rms.cuh) on their heads' q rows (the device step's
# MEMRA_DSV4_DECODE_QNORM = attn), for every split count, and never write q.
QN_EPS = 1e-6


def _qn_raw_q(rng, T, H, D):
    """Raw q with mixed magnitudes: per-head scales 2^-20 .. 2^12, per-element spread 2^+-6, a zero
    head, a head of tiny values where eps dominates, and a head with a few large outliers."""
    q = rand_bf16(rng, (T, H, D), 1.0, spread=6).astype(np.float64)
    q *= np.exp2(rng.integers(-20, 13, size=(T, H, 1)))
    q[:, 0] = 0.0
    q[:, 1 % H] *= 2.0 ** -30
    q[:, 2 % H, rng.integers(0, D, 3)] = 3.0e4
    return bits_of(bf16(q.astype(np.float32)))


def _qn_positions(rng, W):
    """Early (-1 padded window), the first wrap, and two later positions (< 4000: the T = 3
    case adds 37 per token within the 4096-row tables)."""
    return [0, 3, W - 1, W + 5, int(rng.integers(W + 6, 4000))]


def _qn_reference(qg, pos, cg, sng):
    from memra_dsv4.gpu.ops import rmsnorm as RN
    qn = qg.copy()
    RN.head_rms(qn, QN_EPS, out=qn, rope=None if pos is None else (pos, cg, sng))
    return qn


QN_SPLIT_CASES = {
    # name: T, H, D, W, top-k, compressed rows (0: window only; the ring slots of each position,
    # -1 padded early), positions per token drawn from _decode_positions
    "flash_t1_csa": (1, 64, 512, 128, 512, 1200),
    "flash_t1_window_only": (1, 64, 512, 128, 0, 0),
    "flash_t3_csa": (3, 64, 512, 128, 512, 1200),
    "d128_h4": (1, 4, 128, 8, 2, 5),
    "d128_h8": (2, 8, 128, 32, 8, 40),
    "d128_h16": (1, 16, 128, 32, 8, 40),
}


@pytest.mark.parametrize("case", sorted(QN_SPLIT_CASES))
def test_sparse_attention_q_norm_equals_head_rms_then_attention(case, rope_tables):
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, D, W, topk, n_comp = QN_SPLIT_CASES[case]
    cg, sng = rope_tables
    qg = cp.asarray(_qn_raw_q(rng, T, H, D))
    q_keep = qg.copy()
    kvg = cp.asarray(bits_of(kv_fp8_sim(rand_bf16(rng, (W + n_comp, D), 1.0, spread=1), 64)))
    sg = cp.asarray((rng.standard_normal(H) * 2).astype(np.float32))
    scale = D ** -0.5
    for p in _qn_positions(rng, W):
        ps = np.minimum(p + np.arange(T) * 37, 4095).astype(np.int32)   # one position per token
        rows = []
        for pt in ps:
            n_t = min((int(pt) + 1) // 4, n_comp)
            comp = (np.sort(rng.choice(n_t, size=min(topk, n_t), replace=False)) if n_t and topk
                    else np.zeros(0, np.int64))
            rows.append(candidate_row(window_ring_slots(int(pt), W), comp if topk else None, W, topk))
        idx = cp.asarray(np.stack(rows).astype(np.int32))
        K_ = idx.shape[1]
        pos = cp.asarray(ps)
        rope = (pos, cg, sng)
        for qpos in (pos, None):
            qn_ref = _qn_reference(qg, qpos, cg, sng)
            qn = (QN_EPS, qpos, cg if qpos is not None else None, sng if qpos is not None else None)
            for n_split in sorted({1, 2, 3, K.n_tiles(K_), K.auto_split(T, H, K_)}):
                for probs_bf16 in ((False, True) if n_split == 1 else (False,)):
                    want = K.sparse_attention(qn_ref, kvg, idx, sg, scale, probs_bf16=probs_bf16, n_split=n_split,
                                              inverse_rope=rope)
                    got = K.sparse_attention(qg, kvg, idx, sg, scale, probs_bf16=probs_bf16, n_split=n_split,
                                             inverse_rope=rope, q_norm=qn)
                    ctx = dict(case=case, pos=p, n_split=n_split, probs_bf16=probs_bf16, qrope=qpos is not None)
                    assert cp.array_equal(got, want), f"q_norm kernel != head_rms + attention {describe(seed, **ctx)}"
                    assert cp.array_equal(qg, q_keep), f"q_norm kernel wrote q {describe(seed, **ctx)}"


@pytest.mark.parametrize("case", ["flash_csa", "flash_hca", "flash_window_only", "tiny_csa", "small_hca"])
def test_sparse_attention_decode_q_norm_equals_head_rms_then_decode(case, rope_tables):
    """The one-launch decode form (seam MEMRA_DSV4_DECODE_ATTN = fused) with q_norm: the same bits as
    head_rms + sparse_attention_decode, for several split / merger counts."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H, D, W, ratio, sel_w, n_comp = DECODE_CASES[case]
    K_ = W + (sel_w if sel_w is not None else n_comp)
    cg, sng = rope_tables
    _, kv, sink = _decode_inputs(rng, H, D, W, n_comp)
    qg = cp.asarray(_qn_raw_q(rng, 1, H, D))
    q_keep = qg.copy()
    kvg, sg = cp.asarray(bits_of(kv)), cp.asarray(sink)
    scale = D ** -0.5
    nt = K.n_tiles(K_)
    for p in _qn_positions(rng, W):
        sel = _decode_sel(rng, p, ratio, sel_w, n_comp) if sel_w is not None else None
        selg = cp.asarray(sel) if sel is not None else None
        pos = cp.asarray(np.array([p], np.int32))
        qn_ref = _qn_reference(qg, pos, cg, sng)
        for n_split in sorted({1, 3, nt, K.auto_split(1, H, K_)}):
            ns = max(1, min(n_split, nt))
            for n_merge in sorted({1, K.decode_mergers(H, D, ns)}):
                kw = dict(n_split=n_split, n_merge=n_merge, inverse_rope=(pos, cg, sng))
                want = K.sparse_attention_decode(qn_ref, kvg, pos, W, ratio, selg, K_, sg, scale, **kw)
                got = K.sparse_attention_decode(qg, kvg, pos, W, ratio, selg, K_, sg, scale,
                                                q_norm=(QN_EPS, pos, cg, sng), **kw)
                ctx = dict(case=case, pos=p, n_split=n_split, n_merge=n_merge)
                assert cp.array_equal(got, want), f"decode q_norm != head_rms + decode {describe(seed, **ctx)}"
                assert cp.array_equal(qg, q_keep), f"decode q_norm wrote q {describe(seed, **ctx)}"
