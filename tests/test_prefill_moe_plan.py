"""CPU tests of the prefill MoE's host side (memra_dsv4.gpu.ops.prefill_moe.dispatch_plan,
moe_bucket, group_size) and of the batched GemmKey (memra_dsv4.gpu.blaslt).

The layout test runs the whole batched routed-expert computation in NumPy through the plan
(gather into the padded expert-sorted rows, per group and expert slot the three products,
SwiGLU, combine through ``pos``) and compares it BITWISE with the direct per-expert oracle
(oracle.ops.expert_ffn + moe_combine).  The data are chosen so that every float64 sum is exact
(small dyadic weights, bf16 activations of bounded exponent range), so any order of summation
gives the same bits and only a layout error (wrong row, expert, weight, padding leak, combine
order) can make the two differ.
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.gpu.blaslt import GemmKey
from memra_dsv4.gpu.ops.prefill_moe import (ROW_ALIGN, dispatch_plan, group_size, moe_bucket)
from memra_dsv4.host.quant import round_bf16
from memra_dsv4.oracle import ops as O


def _seed():
    return int(np.random.SeedSequence().entropy % (1 << 32))


def _idx(rng, T, k, E, distinct=True):
    if distinct:
        return np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    return rng.integers(0, E, (T, k)).astype(np.int64)   # hash-routing tables may repeat ids


def test_moe_bucket():
    assert [moe_bucket(m) for m in (1, 2, 3, 5, 8, 9, 16, 17, 200)] == [1, 2, 4, 8, 8, 16, 16, 32, 208]
    for m in range(1, 600):
        b = moe_bucket(m)
        assert b >= m and (b - m < 16) and (b <= 8 or b % 16 == 0)
    with pytest.raises(ValueError):
        moe_bucket(0)


def test_group_size():
    assert group_size(2048, 4096) == (1 << 30) // (3 * 2048 * 4096 * 2)   # full Flash: 21
    assert group_size(128, 256) == 32
    assert group_size(1 << 20, 1 << 20) == 1


@pytest.mark.parametrize("T,k,E,group,distinct", [(1, 6, 256, 21, True), (37, 6, 256, 21, True),
                                                  (300, 2, 8, 3, True), (64, 4, 16, 5, False),
                                                  (1024, 6, 256, 21, True)])
def test_dispatch_plan_invariants(T, k, E, group, distinct):
    seed = _seed()
    rng = np.random.default_rng(seed)
    idx = _idx(rng, T, k, E, distinct)
    p = dispatch_plan(idx, group)
    ctx = f"(seed {seed})"
    flat = idx.reshape(-1)
    # experts: each active one exactly once, counts right, groups of <= group
    assert sorted(p.eids.tolist()) == sorted(set(flat.tolist())), ctx
    assert all(p.counts[i] == (flat == e).sum() for i, e in enumerate(p.eids)), ctx
    assert sum(g.n for g in p.groups) == p.eids.size and all(1 <= g.n <= group for g in p.groups)
    # groups: aligned, non-overlapping, mb covers every member's count
    end = 0
    for g in p.groups:
        assert g.row0 % ROW_ALIGN == 0 and g.row0 >= end, ctx
        assert g.mb == moe_bucket(p.counts[g.slot0:g.slot0 + g.n].max()), ctx
        end = g.row0 + g.n * g.mb
    assert end == p.rows
    # every pick exactly once, in its expert's slot, in pick order; padding marked -1
    seen = p.flat[p.flat >= 0]
    assert np.array_equal(np.sort(seen), np.arange(T * k)), ctx
    assert np.array_equal(p.src[p.flat >= 0], seen // k) and (p.src[p.flat < 0] == -1).all()
    for g in p.groups:
        for j in range(g.n):
            e, c = p.eids[g.slot0 + j], p.counts[g.slot0 + j]
            r0 = g.row0 + j * g.mb
            rows = p.flat[r0:r0 + c]
            assert (flat[rows] == e).all() and (np.diff(rows) > 0).all(), ctx
            assert (p.flat[r0 + c:r0 + g.mb] == -1).all(), ctx
    # pos: token t's picks, ascending expert id (stable), pointing at their rows
    for t in range(T):
        picks = p.flat[p.pos[t]] - t * k
        assert ((p.flat[p.pos[t]] // k) == t).all(), ctx
        assert np.array_equal(picks, np.argsort(idx[t], kind="stable")), ctx
    tab = p.table()
    assert tab.dtype == np.int32 and tab.size == 2 * p.rows + T * k + p.eids.size


def test_dispatch_plan_refuses():
    for bad in (np.zeros((0, 2), np.int64), np.array([[1.0, 2.0]]), np.array([[-1, 2]]),
                np.array([1, 2])):
        with pytest.raises(ValueError):
            dispatch_plan(bad, 4)
    with pytest.raises(ValueError):
        dispatch_plan(np.array([[1, 2]]), 0)


def _dyadic(rng, shape, levels=(-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0)):
    return rng.choice(np.array(levels, np.float32), size=shape)


def _plan_twin(x, idx, wts, W1, W2, W3, limit, shared, group):
    """The GPU path's layout in NumPy (gpu.ops.prefill_moe.routed_moe), oracle arithmetic."""
    T, D = x.shape
    k = idx.shape[1]
    p = dispatch_plan(idx, group)
    xs = np.where(p.src[:, None] >= 0, x[np.maximum(p.src, 0)], 0).astype(np.float32)
    wflat = wts.reshape(-1)
    ys = np.zeros((p.rows, D), np.float32)
    for g in p.groups:
        for j in range(g.n):
            e = p.eids[g.slot0 + j]
            r = slice(g.row0 + j * g.mb, g.row0 + (j + 1) * g.mb)
            gate = O.linear(xs[r], W1[e], "fp4")
            up = O.linear(xs[r], W3[e], "fp4")
            f = p.flat[r]
            w = np.where(f >= 0, wflat[np.maximum(f, 0)], 0).astype(np.float32)
            h = O.BF16.store(O.swiglu_clamped(gate, up, limit, w))
            ys[r] = O.linear(h, W2[e], "fp4")
    acc = np.zeros((T, D), np.float32)
    for j in range(k):
        acc = acc + round_bf16(ys[p.pos[:, j]])
    return round_bf16(acc + shared)


def _direct(x, idx, wts, W1, W2, W3, limit, shared):
    T, k = idx.shape
    routed = np.zeros((T, k, x.shape[1]), np.float32)
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            routed[t, j] = O.expert_ffn(x[t:t + 1], W1[e], W2[e], W3[e], limit=limit,
                                        weight=wts[t, j:j + 1])[0]
    return O.moe_combine(routed, idx, shared)


@pytest.mark.parametrize("T,k,E,group,distinct", [(1, 4, 16, 5, True), (40, 2, 8, 3, True),
                                                  (33, 4, 16, 16, False)])
def test_plan_layout_equals_per_expert_oracle(T, k, E, group, distinct):
    seed = _seed()
    rng = np.random.default_rng(seed)
    D, I = 64, 32
    x = round_bf16(_dyadic(rng, (T, D)) * np.exp2(rng.integers(-3, 1, (T, D))).astype(np.float32))
    W1, W2, W3 = (_dyadic(rng, (E, I, D)), _dyadic(rng, (E, D, I)), _dyadic(rng, (E, I, D)))
    idx = _idx(rng, T, k, E, distinct)
    wts = round_bf16(rng.random((T, k)).astype(np.float32))   # wts . h: 8 x 8 bits, exact
    shared = round_bf16(rng.standard_normal((T, D)).astype(np.float32))
    want = _direct(x, idx, wts, W1, W2, W3, 10.0, shared)
    got = _plan_twin(x, idx, wts, W1, W2, W3, 10.0, shared, group)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
        f"seed {seed}: max |diff| {np.abs(got - want).max()}")


def test_batched_gemm_key():
    k = GemmKey(16, 2048, 4096, "bf16", "bf16", "f32", batch=21)
    assert k.label.endswith("batch 21") and k.flops() == 2 * 21 * 16 * 2048 * 4096
    assert k.batch_strides() == {"A": 2048 * 4096, "B": 16 * 4096, "D": 16 * 2048}
    assert GemmKey(16, 2048, 4096, "bf16", "bf16", "f32") == GemmKey(16, 2048, 4096, d_dtype="f32",
                                                                      batch=1)
    assert k != GemmKey(16, 2048, 4096, "bf16", "bf16", "f32", batch=20)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            GemmKey(16, 2048, 4096, batch=bad)
    with pytest.raises(ValueError, match="batched"):
        GemmKey(128, 256, 512, "e4m3", "e4m3", "bf16", "blk128x128", "vec128", batch=2)
