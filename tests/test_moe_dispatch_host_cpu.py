"""CPU checks of gpu.ops.prefill_moe.dispatch_on_device's host work (NumPy stand-in for CuPy,
the plan kernels recording stubs): the same four launches with the same arguments (kernel, grid,
block, shared memory, every scalar, every table's offset / shape / strides in the one int32
allocation, the same idx bytes) as the composition before branch hostlean2's memo (kept below:
the checked moe.plan_* wrappers on views cut per call), and none of those wrappers' 17 argument
checks per call (pinned: the test fails on that code)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.test_kernel_sources import _fake_cupy


def _old_dispatch(idx, E, gemm="fp4mma"):
    """dispatch_on_device as written at 7ece4af (the reference)."""
    from memra_dsv4.gpu.ops import moe as MO
    from memra_dsv4.gpu.ops import prefill_moe as PM
    bn = PM.item_rows(gemm)
    cp = sys.modules["cupy"]
    idx = cp.ascontiguousarray(idx, dtype=np.int64)
    T, k = idx.shape
    n, E = T * k, int(E)
    nseg, mi = MO.plan_segments(n), PM.max_mma_items(n, E, bn)
    sizes = {"items": 4 * mi, "meta": 4, "ebase": E, "eids": E, "counts": E, "seg": nseg * E,
             "src": n, "flat": n, "rowof": n, "pos": n}
    buf = cp.empty(sum(sizes.values()), dtype=np.int32)
    v, o = {}, 0
    for name, size in sizes.items():
        v[name] = buf[o:o + size]
        o += size
    d = PM.DeviceDispatch(eids=v["eids"], counts=v["counts"], ebase=v["ebase"],
                          seg=v["seg"].reshape(nseg, E), src=v["src"], flat=v["flat"],
                          rowof=v["rowof"], pos=v["pos"].reshape(T, k),
                          items=v["items"].reshape(mi, 4), meta=v["meta"][:2])
    MO.plan_count(idx, E, d.seg)
    MO.plan_scan(d.seg, E, d.ebase, d.eids, d.counts, d.items, d.meta, wg=gemm == "wgmma")
    MO.plan_place(idx, k, E, d.seg, d.ebase, d.src, d.flat, d.rowof)
    MO.plan_combine_pos(idx, d.rowof, d.pos)
    return d


def _counter(n_checks):
    """check -> the same check counting its calls in n_checks[0] (the wrappers' argument checks)."""
    def counted(check):
        def f(*a, **k):
            n_checks[0] += 1
            return check(*a, **k)
        return f
    return counted


def _arr_key(a, base, idx_arg):
    """An argument as what the kernel gets: a table by (offset in the allocation, dtype, shape,
    strides); the ids by their bytes; a scalar by (type, value)."""
    if isinstance(a, np.ndarray) and a.ndim and a is idx_arg:
        return ("idx", str(a.dtype), a.shape, a.strides, a.tobytes())
    if isinstance(a, np.ndarray) and a.ndim:
        return ("table", a.__array_interface__["data"][0] - base, str(a.dtype), a.shape, a.strides)
    return (type(a).__name__, a.item() if hasattr(a, "item") else a)


def _record(monkeypatch, fn, idx, E, gemm):
    from memra_dsv4.gpu.ops import moe as MO
    from memra_dsv4.gpu.ops import prefill_moe as PM
    launches, n_checks = [], [0]

    def kernel(stem, name):
        return lambda grid, block, args, shared_mem=0: launches.append(
            (name, tuple(grid), tuple(block), shared_mem, args))

    counted = _counter(n_checks)
    with monkeypatch.context() as m:
        m.setattr(MO, "kernel", kernel)
        m.setattr(MO, "check", counted(MO.check))
        m.setattr(PM, "check", counted(PM.check))
        d = fn(idx, E, gemm)
    base = d.items.__array_interface__["data"][0]   # the allocation's first table
    idx_arg = launches[0][4][0]
    out = [(nm, g, b, sm, [_arr_key(a, base, idx_arg) for a in args])
           for nm, g, b, sm, args in launches]
    views = {f: _arr_key(getattr(d, f), base, None)
             for f in ("eids", "counts", "ebase", "seg", "src", "flat", "rowof", "pos", "items",
                       "meta")}
    return out, views, n_checks[0]


@pytest.mark.parametrize("gemm", ["fp4mma", "wgmma"])
@pytest.mark.parametrize("T,k,E,dt", [(1, 6, 256, np.int32), (300, 6, 256, np.int32),
                                      (2048, 6, 256, np.int32), (5, 2, 1024, np.int64),
                                      (3000, 8, 64, np.int64)])
def test_dispatch_on_device_same_launches_without_the_checks(monkeypatch, gemm, T, k, E, dt):
    from memra_dsv4.gpu.ops import prefill_moe as PM
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    idx = _fake_cupy().asarray(np.random.default_rng(T).integers(0, E, (T, k)).astype(dt))
    want, want_views, old_checks = _record(monkeypatch, _old_dispatch, idx, E, gemm)
    for _ in range(2):   # the layout's first use and its memo
        got, got_views, checks = _record(monkeypatch, PM.dispatch_on_device, idx, E, gemm)
        assert [g[:4] for g in got] == [w[:4] for w in want]
        assert got == want
        assert got_views == want_views
        assert old_checks == 17 and checks == 0, (old_checks, checks)


def test_dispatch_on_device_refuses_what_the_checks_refused(monkeypatch):
    from memra_dsv4.gpu.ops import prefill_moe as PM
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(AssertionError):
        PM.dispatch_on_device(fake.asarray(np.zeros((3, 6), np.int32)), 2048)   # E > PLAN_MAX_E
    with pytest.raises(AssertionError):
        PM.dispatch_on_device(fake.asarray(np.zeros((0, 6), np.int32)), 256)    # no picks
    with pytest.raises(ValueError):
        PM.dispatch_on_device(fake.asarray(np.zeros((3, 6), np.int32)), 256, "blaslt")


# ------------------------------------------------------- routed_moe(dispatch="device") as a whole
def _old_routed_moe_device(g, x, idx, wts, experts, fmt, limit, shared, ws2, bracket, gemm):
    """prefill_moe._routed_moe_device as written at 7ece4af (every wrapper checked)."""
    from memra_dsv4.gpu.ops import prefill_moe as PM
    from memra_dsv4.gpu.ops._common import contiguous
    cp = sys.modules["cupy"]
    T, D = x.shape
    E, I = experts["w1"][0].shape[:2]
    k = idx.shape[1]
    n = T * k
    wg = gemm == "wgmma"
    d = _old_dispatch(idx, E, gemm)
    xs = (PM.gather_rows_perm if wg else PM.gather_rows)(x, d.src, cp.empty((n, D), dtype=cp.uint16))
    hs = cp.empty((n, I), dtype=cp.uint16)
    ys = cp.empty((n, D), dtype=cp.float32)
    wflat = contiguous(wts).reshape(-1)
    gateup, down = (PM.wgmma_gateup, PM.wgmma_down) if wg else (PM.fp4mma_gateup, PM.fp4mma_down)
    gateup(fmt, experts["w1"], experts["w3"], d.items, xs, wflat, d.flat, limit, hs,
           None if ws2 is None else (ws2["w1"], ws2["w3"]))
    down(fmt, experts["w2"], d.items, hs, ys, None if ws2 is None else ws2["w2"])
    return PM.combine_sorted(ys, d.pos, contiguous(shared, dtype=cp.float32))


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _record_moe(monkeypatch, run):
    """(launches, checks): every launch as (kernel, grid, block, smem, args), an array argument
    as (ordinal of its allocation by first use, byte offset in it, dtype, shape, strides), and
    the number of argument checks of the gpu.ops.moe / prefill_moe wrappers."""
    from memra_dsv4.gpu.ops import _common
    from memra_dsv4.gpu.ops import moe as MO
    from memra_dsv4.gpu.ops import prefill_moe as PM
    launches, n_checks, roots = [], [0], []

    class K:
        def __init__(self, name):
            self.name, self.max_dynamic_shared_size_bytes = name, 0

        def __call__(self, grid, block, args, shared_mem=0):
            key = []
            for a in args:
                if isinstance(a, np.ndarray) and a.ndim:
                    r = _root(a)
                    if not any(r is q for q in roots):
                        roots.append(r)
                    i = next(j for j, q in enumerate(roots) if q is r)
                    off = a.__array_interface__["data"][0] - r.__array_interface__["data"][0]
                    key.append(("array", i, off, str(a.dtype), a.shape, a.strides))
                else:
                    key.append((type(a).__name__, a.item() if hasattr(a, "item") else a))
            launches.append((self.name, tuple(grid), tuple(block), shared_mem, key))

    kernels = {}

    counted = _counter(n_checks)
    with monkeypatch.context() as m:
        for mod in (MO, PM):
            m.setattr(mod, "kernel", lambda stem, name: kernels.setdefault(name, K(name)))
            m.setattr(mod, "check", counted(mod.check))
        m.setattr(_common, "sm_count", lambda: 132)
        m.setattr(_common, "_SMEM_SET", {})
        y = run()
    return launches, n_checks[0], y


@pytest.mark.parametrize("gemm", ["fp4mma", "wgmma"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_routed_moe_device_same_launches_fewer_checks(monkeypatch, gemm, fmt):
    """routed_moe(dispatch="device"): the launches of 7ece4af's composition (every wrapper
    checked), argument by argument; the wrappers' checks per call 39 -> 8 (mxfp4; nvfp4 + 3
    ws2 checks either way): the plan's 17, the gather's 3, gate/up's 5 and down's 3 array
    checks and combine's 3 gone (those arrays made by the call), the weights' / ws2 / shared /
    wts checks kept."""
    from memra_dsv4.gpu.ops import prefill_moe as PM
    fake = _fake_cupy()
    for dt in ("float32", "int32", "int64", "uint16"):
        setattr(fake, dt, getattr(np, dt))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    T, k, E, D, I = 300, 6, 64, 256, 128
    A = fake.asarray
    rng = np.random.default_rng(0)
    blk = 32 if fmt == "mxfp4" else 16
    ex = {w: (A(np.zeros((E, o, i // 2), np.uint8)), A(np.zeros((E, o, i // blk), np.uint8)))
          for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I)))}
    ws2 = None if fmt == "mxfp4" else {w: A(np.ones(E, np.float32)) for w in ("w1", "w2", "w3")}
    x = A(rng.standard_normal((T, D)).astype(np.float32))
    idx = A(rng.integers(0, E, (T, k)).astype(np.int32))
    wts = A(rng.random((T, k)).astype(np.float32))
    shared = A(rng.standard_normal((T, D)).astype(np.float32))
    want, old_checks, _ = _record_moe(monkeypatch, lambda: _old_routed_moe_device(
        None, x, idx, wts, ex, fmt, 10.0, shared, ws2, None, gemm))
    got, checks, y = _record_moe(monkeypatch, lambda: PM.routed_moe(
        None, x, idx, wts, ex, fmt, 10.0, shared, ws2=ws2, gemm=gemm, dispatch="device"))
    assert y.shape == (T, D)
    assert [w[0] for w in got] == [w[0] for w in want]
    for g_, w_ in zip(got, want):
        assert g_ == w_, (g_[0], g_, w_)
    extra = 0 if ws2 is None else 3
    # the composition above runs today's checked wrappers: 38 at 7ece4af less combine_sorted's
    # check of the out it has just made (gone); routed_moe's own check of wts (1) not in it
    assert old_checks == 37 + extra and checks == 8 + extra, (old_checks, checks)
