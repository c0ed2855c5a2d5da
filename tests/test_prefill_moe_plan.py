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


# ------------------------------------------------------------- the plan built on the device
# gpu.ops.prefill_moe.device_plan is the NumPy twin of kernels_cu/moe.cu's moe_plan_* kernels
# (tests/gpu/test_prefill_dispatch_gpu.py compares the device's tables with it).  Here: the twin
# is dispatch_plan without its padding rows (so the device dispatch feeds the fp4mma kernels the
# same items over the same rows), and a line-by-line Python emulation of the four kernels (their
# segments, warp-wide matching and rank formulas) produces the twin's tables.
from memra_dsv4.gpu.ops import moe as MO  # noqa: E402
from memra_dsv4.gpu.ops import prefill_moe as PM  # noqa: E402
from memra_dsv4.gpu.ops.prefill_moe import (compact, device_plan, max_mma_items,  # noqa: E402
                                            mma_items, wg_items)


def _routing(kind, rng, T, k, E):
    if kind == "distinct":
        return _idx(rng, T, k, E, True)
    if kind == "repeats":                     # hash-routing tables may repeat an id in a row
        return _idx(rng, T, k, E, False)
    if kind == "few":                         # most experts empty
        return rng.integers(0, min(E, 3), (T, k)).astype(np.int64)
    if kind == "one":                         # every pick on one expert
        return np.full((T, k), E - 1, np.int64)
    if kind == "skewed":                      # a hot expert, ties in the counts elsewhere
        idx = _idx(rng, T, k, E, True)
        idx[: T // 2, 0] = 7 % E
        return idx
    raise AssertionError(kind)


_CASES = [(1, 6, 256, "distinct"), (1, 1, 1, "one"), (37, 6, 256, "distinct"),
          (11, 6, 256, "few"), (700, 1, 16, "one"), (171, 3, 16, "repeats"),
          (1024, 6, 256, "distinct"), (1500, 6, 256, "skewed"), (3, 6, 1024, "distinct"),
          (353, 8, 384, "distinct"), (2, 4, 5, "repeats")]


@pytest.mark.parametrize("gemm", ["fp4mma", "wgmma"])
@pytest.mark.parametrize("T,k,E,kind", _CASES)
def test_device_plan_is_dispatch_plan_without_padding(T, k, E, kind, gemm):
    seed = _seed()
    idx = _routing(kind, np.random.default_rng(seed), T, k, E)
    d = device_plan(idx, E, gemm)
    ctx = f"(seed {seed}, T {T} k {k} E {E} {kind} {gemm})"
    n = T * k
    assert d.src.shape == d.flat.shape == d.rowof.shape == (n,) and d.pos.shape == (T, k), ctx
    for group in (1, 5, 21, 300):
        p = dispatch_plan(idx, group)
        src, flat, pos, items = compact(p, gemm)
        assert d.n_active == p.eids.size, ctx
        assert np.array_equal(d.eids[:d.n_active], p.eids) and (d.eids[d.n_active:] == -1).all(), ctx
        assert np.array_equal(d.counts[:d.n_active], p.counts) and (d.counts[d.n_active:] == 0).all(), ctx
        assert np.array_equal(d.src, src) and np.array_equal(d.flat, flat), ctx
        assert np.array_equal(d.pos, pos), ctx
        assert d.n_items == items.shape[0] and np.array_equal(d.items[:d.n_items], items), ctx
    assert d.items.shape == (max_mma_items(n, E, PM.item_rows(gemm)), 4), ctx
    assert (d.items[d.n_items:] == 0).all(), ctx
    assert np.array_equal(d.rowof[d.flat], np.arange(n)) and np.array_equal(d.src, d.flat // k), ctx
    # the combine rows: token t's picks, ascending expert id (stable), as dispatch_plan's pos
    for t in range(T):
        assert np.array_equal(d.flat[d.pos[t]] - t * k, np.argsort(idx[t], kind="stable")), ctx


@pytest.mark.parametrize("gemm,host_items", [("fp4mma", mma_items), ("wgmma", wg_items)])
def test_compact_is_the_rows_in_order(gemm, host_items):
    """compact() keeps dispatch_plan's non-padding rows in their order: every item's rows stay
    consecutive and of its expert, and the rows of a tile are the same picks."""
    rng = np.random.default_rng(3)
    idx = _idx(rng, 300, 6, 40, False)
    idx[:150, 0] = 5                                     # one expert past WG_BN picks
    p = dispatch_plan(idx, 7)
    src, flat, pos, items = compact(p, gemm)
    keep = p.flat >= 0
    assert np.array_equal(flat, p.flat[keep]) and np.array_equal(src, p.src[keep])
    hi = host_items(p)
    assert hi.shape == items.shape and hi.shape[0] > p.eids.size
    for (e, r0, nr, _), (e2, q0, nq, _) in zip(hi, items):
        assert (e, nr) == (e2, nq) and np.array_equal(p.flat[r0:r0 + nr], flat[q0:q0 + nq])


def _check_wg_items(d, idx, ctx):
    """The wgmma kernels' contract on the device plan's items: every row in exactly one item,
    1..WG_BN rows of one expert each, an expert's items adjacent, ceil(c / WG_BN) of them, all
    but its last a multiple of 16 and the last no larger than the first (the token tile NB is
    the rows rounded up to 16, at most WG_BN), the tail all zeros (0 rows: the CTA exits)."""
    n = idx.size
    it = d.items[:d.n_items]
    cover = np.zeros(n, np.int64)
    by_e: dict = {}
    last = -1
    for e, r0, nr, z in it:
        assert z == 0 and 1 <= nr <= PM.WG_BN and 0 <= r0 and r0 + nr <= n, ctx
        assert -(-nr // 16) * 16 <= PM.WG_BN, ctx
        cover[r0:r0 + nr] += 1
        assert (idx.reshape(-1)[d.flat[r0:r0 + nr]] == e).all(), ctx
        assert e == last or e not in by_e, f"{ctx}: expert {e}'s items not adjacent"
        by_e.setdefault(int(e), []).append(int(nr))
        last = e
    assert (cover == 1).all(), f"{ctx}: rows covered {np.bincount(cover)} times"
    for e, ns in by_e.items():
        c = int((idx == e).sum())
        assert sum(ns) == c and len(ns) == -(-c // PM.WG_BN), (ctx, e, c, ns)
        assert all(v % 16 == 0 for v in ns[:-1]) and ns[-1] <= ns[0], (ctx, e, c, ns)
    assert (d.items[d.n_items:] == 0).all(), ctx


@pytest.mark.parametrize("T,k,E,kind", _CASES)
def test_device_plan_wgmma_items_meet_the_kernel_contract(T, k, E, kind):
    seed = _seed()
    idx = _routing(kind, np.random.default_rng(seed), T, k, E)
    d = device_plan(idx, E, "wgmma")
    _check_wg_items(d, idx, f"(seed {seed}, T {T} k {k} E {E} {kind})")
    # the same rows, experts, segments and combine rows as the fp4mma plan: only the items differ
    f = device_plan(idx, E, "fp4mma")
    for name in ("eids", "counts", "ebase", "seg", "src", "flat", "rowof", "pos", "n_active"):
        assert np.array_equal(np.asarray(getattr(d, name)), np.asarray(getattr(f, name))), name


def test_wgmma_item_split_for_every_count():
    """One expert with c picks, c = 1..2100 (up to 17 items): the twin's split is wg_items' split
    (ceil(c / WG_BN) items; the kernel's formula m = ceil(c / 128), sz = min(128, 16 ceil(c / 16 m))
    never leaves an item of <= 0 rows), and the examples of the wgmma branch hold."""
    for c in range(1, 2101):
        idx = np.zeros((c, 1), np.int64)
        d = device_plan(idx, 1, "wgmma")
        want = wg_items(dispatch_plan(idx, 1))
        assert d.n_items == want.shape[0] == -(-c // 128), c
        assert np.array_equal(d.items[:d.n_items], want), c
        m = -(-c // 128)
        sz = min(128, -(-c // (16 * m)) * 16)
        assert -(-c // sz) == m and c - sz * (m - 1) >= 1, c
    for c, want in {192: [96, 96], 200: [112, 88], 129: [80, 49], 128: [128], 7: [7],
                    1024: [128] * 8, 1025: [128] * 8 + [1]}.items():
        assert device_plan(np.zeros((c, 1), np.int64), 1, "wgmma").items[:, 2].tolist() == want, c


def test_max_mma_items_bounds_and_is_reached():
    rng = np.random.default_rng(5)
    for T, k, E in ((1, 6, 256), (64, 1, 1), (8192, 6, 256), (5, 4, 3), (100, 2, 1000)):
        n = T * k
        idx = _idx(rng, T, k, E, k <= E)
        assert device_plan(idx, E).n_items <= max_mma_items(n, E)
    # reached: every active expert with (64 q + 1) picks (each wastes 63 rows of its last item)
    E, per = 10, 65
    idx = np.repeat(np.arange(E), per).reshape(-1, 1)
    assert device_plan(idx, E).n_items == max_mma_items(E * per, E) == 2 * E
    assert max_mma_items(6, 256) == 6 and max_mma_items(49152, 256) == 1020
    # wgmma: items of up to WG_BN rows, the bound with bn = WG_BN, reached at 128 q + 1 picks
    for T, k, E in ((1, 6, 256), (64, 1, 1), (8192, 6, 256), (5, 4, 3), (100, 2, 1000)):
        idx = _idx(rng, T, k, E, k <= E)
        assert device_plan(idx, E, "wgmma").n_items <= max_mma_items(T * k, E, PM.WG_BN)
    idx = np.repeat(np.arange(E), 129).reshape(-1, 1)
    assert device_plan(idx, E, "wgmma").n_items == max_mma_items(E * 129, E, PM.WG_BN) == 2 * E
    assert max_mma_items(49152, 256, PM.WG_BN) == 638
    assert PM.item_rows("fp4mma") == PM.MMA_BN and PM.item_rows("wgmma") == PM.WG_BN


def test_device_plan_refuses():
    with pytest.raises(ValueError, match="expert id 8 >= E = 8"):
        device_plan(np.array([[1, 8]]), 8)
    with pytest.raises(ValueError, match="gemm 'blaslt'"):
        device_plan(np.array([[1, 2]]), 8, "blaslt")
    with pytest.raises(ValueError, match="gemm 'blaslt'"):
        compact(dispatch_plan(np.array([[1, 2]]), 4), "blaslt")
    for bad in (np.zeros((0, 2), np.int64), np.array([[1.0, 2.0]]), np.array([[-1, 2]]), np.array([1, 2])):
        with pytest.raises(ValueError):
            device_plan(bad, 16)


def _emulate_kernels(idx, E, wg=0):
    """kernels_cu/moe.cu's moe_plan_count / _scan / _place / _combine_pos, statement by statement
    (a warp's 32 lanes as a loop, __match_any_sync as an equality mask); wg: moe_plan_scan's
    item mode (0 fp4mma, 1 wgmma)."""
    T, k = idx.shape
    f_all = idx.reshape(-1)
    n = f_all.size
    nseg = -(-n // MO.PLAN_SEG)
    hist = np.zeros((nseg, E), np.int64)
    for seg in range(nseg):                                        # moe_plan_count
        for f in range(seg * MO.PLAN_SEG, min(n, (seg + 1) * MO.PLAN_SEG)):
            hist[seg, f_all[f]] += 1
    cnt = np.zeros(E, np.int64)                                    # moe_plan_scan
    for tid in range(E):
        c = 0
        for s in range(nseg):
            h = hist[s, tid]
            hist[s, tid] = c
            c += h
        cnt[tid] = c
    order = np.full(MO.PLAN_MAX_E, -1, np.int64)
    for tid in range(E):
        c = cnt[tid]
        if c > 0:
            order[sum(1 for j in range(E) if cnt[j] > c or (cnt[j] == c and j < tid))] = tid
    n_act = int((cnt > 0).sum())
    mc = np.array([cnt[order[t]] if t < n_act else 0 for t in range(MO.PLAN_MAX_E)])
    bn = MO.PLAN_WG_BN if wg else MO.PLAN_BN
    mi = (mc + bn - 1) // bn
    sz = np.array([min(bn, (mc[t] + 16 * mi[t] - 1) // (16 * mi[t]) * 16) if (wg and mi[t] > 0) else bn
                   for t in range(MO.PLAN_MAX_E)])
    row0, item0 = np.cumsum(mc) - mc, np.cumsum(mi) - mi
    n_items = int(mi.sum())
    max_items = max_mma_items(n, E, bn)
    items = np.zeros((max_items, 4), np.int64)
    ebase = np.where(cnt == 0, -1, 0)
    for tid in range(n_act):
        e = order[tid]
        ebase[e] = row0[tid]
        for i in range(mi[tid]):
            if item0[tid] + i < max_items:
                items[item0[tid] + i] = (e, row0[tid] + sz[tid] * i, min(sz[tid], mc[tid] - sz[tid] * i), 0)
    src, flat, rowof = (np.full(n, -7, np.int64) for _ in range(3))
    for seg in range(nseg):                                        # moe_plan_place
        ctr = ebase + hist[seg]
        f1 = min(n, (seg + 1) * MO.PLAN_SEG)
        for f0 in range(seg * MO.PLAN_SEG, f1, 32):
            lanes = [(f0 + lane, f_all[f0 + lane] if f0 + lane < f1 else -1) for lane in range(32)]
            upd = {}
            for lane, (f, e) in enumerate(lanes):
                peers = [l2 for l2, (_, e2) in enumerate(lanes) if e2 == e]
                if f < f1:
                    p = ctr[e] + sum(1 for l2 in peers if l2 < lane)
                    src[p], flat[p], rowof[f] = f // k, f, p
                    if peers[0] == lane:
                        upd[e] = len(peers)
            for e, c in upd.items():
                ctr[e] += c
    pos = np.zeros((T, k), np.int64)                               # moe_plan_combine_pos
    for t in range(T):
        for j in range(k):
            r = sum(1 for i in range(k) if idx[t, i] < idx[t, j] or (idx[t, i] == idx[t, j] and i < j))
            pos[t, r] = rowof[t * k + j]
    eids = np.array([order[t] if t < n_act else -1 for t in range(E)])
    return dict(eids=eids, counts=mc[:E], ebase=ebase, seg=hist, src=src, flat=flat, rowof=rowof,
                pos=pos, items=items, n_active=n_act, n_items=n_items)


@pytest.mark.parametrize("gemm", ["fp4mma", "wgmma"])
@pytest.mark.parametrize("T,k,E,kind", [(1, 6, 256, "distinct"), (37, 6, 64, "repeats"),
                                        (700, 1, 16, "one"), (400, 6, 256, "skewed"),
                                        (2, 4, 5, "few"), (300, 1, 3, "few")])
def test_kernel_emulation_equals_twin(T, k, E, kind, gemm):
    seed = _seed()
    idx = _routing(kind, np.random.default_rng(seed), T, k, E)
    got = _emulate_kernels(idx, E, wg=int(gemm == "wgmma"))
    want = device_plan(idx, E, gemm)
    for name, v in got.items():
        w = getattr(want, name)
        assert np.array_equal(np.asarray(v), np.asarray(w)), (
            f"seed {seed}: {name} differs ({T}, {k}, {E}, {kind}, {gemm})")
