"""CPU checks of gpu.ops.prefill_moe.dispatch_on_device's host work (NumPy stand-in for CuPy,
the plan kernels recording stubs): the same four launches with the same arguments (kernel, grid,
block, shared memory, every scalar, every table's offset / shape / strides in the one int32
allocation, the same idx bytes) as the composition before branch hostlean2's memo (kept below:
the checked moe.plan_* wrappers on views cut per call), and none of those wrappers' 17 argument
checks per call (pinned: the test fails on that code)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest


class _Arr(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _fake_cupy():
    fake = types.ModuleType("cupy")
    fake.ndarray = _Arr
    fake.empty = lambda shape, dtype=float: np.zeros(shape, dtype).view(_Arr)
    fake.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(_Arr)
    fake.ascontiguousarray = lambda x, dtype=None: np.ascontiguousarray(x, dtype=dtype).view(_Arr)
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    return fake


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

    def counted(check):
        def f(*a, **k):
            n_checks[0] += 1
            return check(*a, **k)
        return f
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
