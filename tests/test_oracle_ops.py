"""ops.py primitives against their definitions (independent, straightforward formulas)."""

import numpy as np
import pytest

from memra_dsv4.host.quant import act_quant_fp8, fp4_sim, kv_fp8_sim, round_bf16
from memra_dsv4.host.rope import cos_sin, inv_freq
from memra_dsv4.oracle import ops
from memra_dsv4.seams import POLICIES

EX, BF, REF = POLICIES["exact"], POLICIES["bf16"], POLICIES["reference"]
rng = np.random.default_rng(0)


def bf(shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def test_rmsnorm():
    x, w = bf((4, 64)), bf(64)
    ref = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-6, pol=EX), ref, rtol=1e-14)
    y = ops.rmsnorm(x, w, 1e-6, pol=BF)
    np.testing.assert_array_equal(y, round_bf16(ref.astype(np.float32)))


def test_head_rms_is_torch_bf16_arithmetic():
    torch = pytest.importorskip("torch")
    q = bf((16, 4, 128), 3.0)
    t = torch.from_numpy(q).to(torch.bfloat16)
    t = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6)   # M:498 in bf16
    want = t.float().numpy()
    got = ops.head_rms(q, 1e-6, pol=BF)
    assert (got == want).mean() > 0.999                              # rsqrt ulp ties aside
    np.testing.assert_allclose(got, want, rtol=2 ** -7)
    ex = ops.head_rms(q.astype(np.float64), 1e-6, pol=EX)
    np.testing.assert_allclose(ex, q / np.sqrt((q.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))


def test_linear_kinds():
    x, w = bf((3, 256)), bf((16, 256), 0.1)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_array_equal(ops.linear(x, w, "fp8", pol=BF), round_bf16(exact.astype(np.float32)))
    np.testing.assert_array_equal(ops.linear(x, w, "f32", pol=BF), exact.astype(np.float32))
    q, s = act_quant_fp8(x, 128)
    xq = (q.reshape(3, 2, 128) * s[..., None]).reshape(3, 256).astype(np.float64)
    np.testing.assert_array_equal(ops.linear(x, w, "fp4", pol=REF), round_bf16((xq @ w.T).astype(np.float32)))


def test_hadamard():
    x = bf((5, 128))
    H = ops.hadamard_matrix(128)
    assert (H @ H.T == 128 * np.eye(128)).all() and (H[0] == 1).all() and H[1, 1] == -1
    np.testing.assert_allclose(ops.hadamard(x, pol=EX), x @ H / np.sqrt(128), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ops.hadamard(ops.hadamard(x, pol=EX), pol=EX), x, atol=1e-12)
    np.testing.assert_array_equal(ops.hadamard(x, pol=BF), round_bf16((x.astype(np.float64) @ H / np.sqrt(128)).astype(np.float32)))


def test_apply_rope_stores_and_inverts():
    x = bf((6, 2, 128))
    c, s = cos_sin(inv_freq(64, 10000.0, yarn=False), np.arange(6), np.float64)
    y = ops.apply_rope(x.astype(np.float64), c[:, None], s[:, None], pol=EX)
    np.testing.assert_allclose(ops.apply_rope(y, c[:, None], s[:, None], True, pol=EX), x, atol=1e-12)
    yb = ops.apply_rope(x, c[:, None].astype(np.float32), s[:, None].astype(np.float32), pol=BF)
    np.testing.assert_array_equal(yb, round_bf16(yb))
    np.testing.assert_array_equal(yb[..., :64], x[..., :64])


def _pool_direct(a, z, r, k, overlap):
    """Entry k straight from the definition (dsv4_attention.md 4.2)."""
    d = a.shape[1] // (2 if overlap else 1)
    if not overlap:
        T = range(k * r, k * r + r)
        za, aa = z[list(T)], a[list(T)]
    else:
        rows_z, rows_a = [], []
        if k >= 1:
            rows_z += [z[t, :d] for t in range(4 * (k - 1), 4 * k)]
            rows_a += [a[t, :d] for t in range(4 * (k - 1), 4 * k)]
        rows_z += [z[t, d:] for t in range(4 * k, 4 * k + 4)]
        rows_a += [a[t, d:] for t in range(4 * k, 4 * k + 4)]
        za, aa = np.array(rows_z), np.array(rows_a)
    p = np.exp(za - za.max(0))
    return (p / p.sum(0) * aa).sum(0)


@pytest.mark.parametrize("r", [4, 8, 16])
def test_compressor_pooling_definition(r):
    coff = 2 if r == 4 else 1
    d, nb = 32, 5
    a = rng.standard_normal((nb * r, coff * d))
    z = rng.standard_normal((nb * r, coff * d))
    ac, zc = ops.compress_candidates(a, z, r)
    assert ac.shape == (nb, 2 * r if r == 4 else r, d)
    got = ops.compress_pool(ac, zc, pol=EX)
    for k in range(nb):
        np.testing.assert_allclose(got[k], _pool_direct(a, z, r, k, r == 4), rtol=1e-12, atol=1e-14)


def test_compressor_pool_same_routine_prefill_and_decode():
    """An entry pooled alone, seeded with the previous block's pending rows (decode / chunked
    prefill), is bitwise the entry of the vectorised prefill."""
    a = rng.standard_normal((24, 64)).astype(np.float32)
    z = rng.standard_normal((24, 64)).astype(np.float32)
    full = ops.compress_pool(*ops.compress_candidates(a, z, 4), pol=BF)
    for k in range(1, 6):
        ac, zc = ops.compress_candidates(a[4 * k:4 * k + 4], z[4 * k:4 * k + 4], 4,
                                         prev_a=a[4 * k - 4:4 * k], prev_z=z[4 * k - 4:4 * k])
        np.testing.assert_array_equal(ops.compress_pool(ac, zc, pol=BF)[0], full[k])


def test_compressor_project_ape_by_position():
    x, wkv, wg = bf((10, 64)), bf((16, 64), 0.1), bf((16, 64), 0.1)
    ape = rng.standard_normal((4, 16)).astype(np.float32)
    a, z = ops.compressor_project(x, wkv, wg, ape, np.arange(3, 13), pol=BF)
    np.testing.assert_array_equal(z, ops.linear(x, wg, "f32", pol=BF) + ape[np.arange(3, 13) % 4])
    np.testing.assert_array_equal(a, ops.linear(x, wkv, "f32", pol=BF))


def test_entry_postprocess():
    p = rng.standard_normal((3, 128))
    w = bf(128)
    c, s = cos_sin(inv_freq(64, 160000.0, yarn=False), np.arange(3) * 4, np.float64)
    main = ops.compress_entry_postprocess(p.astype(np.float32), w, c.astype(np.float32), s.astype(np.float32),
                                          rope_dim=64, rotate=False, eps=1e-6, pol=BF)
    normed = ops.rmsnorm(round_bf16(p.astype(np.float32)), w, 1e-6, pol=BF)
    roped = ops.apply_rope(normed, c.astype(np.float32), s.astype(np.float32), pol=BF)
    np.testing.assert_array_equal(main, kv_fp8_sim(roped, 64))
    idx = ops.compress_entry_postprocess(p.astype(np.float32), w, c.astype(np.float32), s.astype(np.float32),
                                         rope_dim=64, rotate=True, eps=1e-6, pol=BF)
    np.testing.assert_array_equal(idx, fp4_sim(ops.hadamard(roped, pol=BF), 32))
    ex = ops.compress_entry_postprocess(p, w, c, s, rope_dim=64, rotate=True, eps=1e-6, pol=EX)
    nr = ops.apply_rope(ops.rmsnorm(p, w, 1e-6, pol=EX), c, s, pol=EX)
    np.testing.assert_allclose(ex, ops.hadamard(nr, pol=EX), rtol=1e-12, atol=1e-13)  # no FP4 sim


def test_indexer_scores_and_topk():
    q, wts, keys = rng.standard_normal((5, 4, 16)), rng.standard_normal((5, 4)), rng.standard_normal((7, 16))
    got = ops.indexer_scores(q, wts, keys, pol=EX)
    want = np.einsum("th,thn->tn", wts, np.maximum(np.einsum("thd,nd->thn", q, keys), 0))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    sel = ops.indexer_topk(got, np.array([0, 1, 3, 7, 7]), 3)
    assert sel.shape == (5, 3) and (sel[0] == -1).all() and list(sel[1]) == [0, -1, -1]
    assert list(sel[4]) == list(np.argsort(-got[4], kind="stable")[:3])
    assert (sel[2][sel[2] >= 0] < 3).all()
    wts_b = ops.indexer_weights(bf((2, 64)), bf((4, 64), 0.1), n_heads=4, head_dim=128, pol=BF)
    np.testing.assert_array_equal(wts_b, round_bf16(wts_b))


def _dense_attention(q, kv, sink, scale):
    s = np.concatenate([q @ kv.T * scale, sink[:, None]], axis=1)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return p[:, :-1] @ kv


def test_sparse_attention_with_sinks():
    H, D, N = 4, 64, 12
    q, kv, sink = rng.standard_normal((H, D)), rng.standard_normal((N, D)), rng.standard_normal(H)
    idx = np.array([3, -1, 0, 7, -1, 11], dtype=np.int32)
    got = ops.sparse_attention_with_sinks(q, kv, idx, sink, D ** -0.5, pol=EX)
    np.testing.assert_allclose(got, _dense_attention(q, kv[[3, 0, 7, 11]], sink, D ** -0.5), rtol=1e-12, atol=1e-14)
    perm = ops.sparse_attention_with_sinks(q, kv, idx[::-1].copy(), sink, D ** -0.5, pol=EX)
    np.testing.assert_allclose(perm, got, rtol=1e-12, atol=1e-14)
    none = ops.sparse_attention_with_sinks(q, kv, np.full(3, -1, np.int32), sink, D ** -0.5, pol=EX)
    np.testing.assert_array_equal(none, 0.0)            # only the sink: nothing to average
    batched = ops.sparse_attention_with_sinks(np.stack([q, q]), kv, np.stack([idx, idx]), sink, D ** -0.5, pol=BF)
    one = ops.sparse_attention_with_sinks(q, kv, idx, sink, D ** -0.5, pol=BF)
    np.testing.assert_array_equal(batched[1], one)
    ref = ops.sparse_attention_with_sinks(q, kv, idx, sink, D ** -0.5, pol=REF)
    np.testing.assert_allclose(ref, got, rtol=0, atol=2e-2)   # P in bf16 before P.V
    with pytest.raises(ValueError):
        ops.sparse_attention_with_sinks(q, kv, np.array([N], np.int32), sink, 1.0, pol=EX)


def test_wo_grouped():
    o, w = rng.standard_normal((3, 4, 8)), rng.standard_normal((2 * 5, 16))   # H=4, D=8, G=2, R=5
    got = ops.wo_grouped(o, w, groups=2, pol=EX)
    flat = o.reshape(3, 32)
    want = np.concatenate([flat[:, :16] @ w[:5].T, flat[:, 16:] @ w[5:].T], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_swiglu_clamp():
    g = np.array([[-50.0, 5.0, 30.0]])
    u = np.array([[20.0, -20.0, 3.0]])
    h = ops.swiglu_clamped(g, u, 10.0, pol=EX)
    silu = lambda v: v / (1 + np.exp(-v))
    np.testing.assert_allclose(h, [[silu(-50.0) * 10.0, silu(5.0) * -10.0, silu(10.0) * 3.0]])
    np.testing.assert_allclose(ops.swiglu_clamped(g, u, 0.0, pol=EX), silu(g) * u)      # off
    np.testing.assert_allclose(ops.swiglu_clamped(g, u, 10.0, np.array([0.5]), pol=EX), 0.5 * h)


def test_moe_combine_ascending_expert_order():
    # fp32 accumulation is order dependent: 2^24 + 1 - 2^24 = 0 or 1 depending on the order
    routed = np.array([[[1.0], [2.0 ** 24], [-(2.0 ** 24)]]], dtype=np.float32)
    idx = np.array([[0, 1, 2]])                          # ascending: ((1 + 2^24) - 2^24) = 0
    y = ops.moe_combine(routed, idx, np.zeros((1, 1), np.float32), pol=BF)
    assert y[0, 0] == 0.0
    idx2 = np.array([[2, 0, 1]])                         # ascending id: 2^24 - 2^24 + 1 = 1
    y2 = ops.moe_combine(routed, idx2, np.zeros((1, 1), np.float32), pol=BF)
    assert y2[0, 0] == 1.0


def test_router_and_lm_head_are_fp32():
    x, wg = bf((3, 64)), bf((8, 64), 0.1)
    lg = ops.router_logits(x, wg, pol=BF)
    assert lg.dtype == np.float32
    np.testing.assert_array_equal(lg, (x.astype(np.float64) @ wg.T.astype(np.float64)).astype(np.float32))
    idx, w, s = ops.router(lg, k=2, route_scale=1.5, bias=np.zeros(8, np.float32))
    np.testing.assert_allclose(w.sum(-1), 1.5, rtol=1e-6)


def test_named_wrappers():
    q = bf((3, 2, 128), 2.0)
    np.testing.assert_array_equal(ops.head_rms_bf16(q, 1e-6), ops.head_rms(q, 1e-6, pol=BF))
    a, z = rng.standard_normal((8, 64)), rng.standard_normal((8, 64))
    np.testing.assert_array_equal(ops.compress_pool_overlap(a, z, pol=EX),
                                  ops.compress_pool(*ops.compress_candidates(a, z, 4), pol=EX))
    np.testing.assert_array_equal(ops.compress_pool_ratio(a, z, 8, pol=EX),
                                  ops.compress_pool(*ops.compress_candidates(a, z, 8), pol=EX))
    with pytest.raises(ValueError):
        ops.compress_pool_ratio(a, z, 4)
