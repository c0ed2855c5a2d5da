"""CPU checks of the prefill's host-lean plumbing (the memos and fast paths that cut the Python
time of a chunk pass without changing a launch), with stand-ins for CuPy / cuBLASLt:

* ``kernel_loader.lookup`` returns what ``KernelLoader.get`` returns: the same object on a hit
  (the loader is not asked again), the PdlKernel inside ``pdl_launches``, the rebuilt module's
  kernel after a stem is rebuilt for new names, and - while ``KernelLoader.get`` is replaced, as
  ``profiling.launches.record_launches`` does - the replacement's answer on every call, never
  memoised;
* ``BlasLt.plan_bf16_f32`` is ``plan(GemmKey(m, n, k, bf16, bf16, f32))``: one plan per
  (m, n, k), the very object ``plan`` caches, an invalid shape still raises the key's
  ValueError, ``close`` empties it;
* ``GemmPlan.run_arrays`` (its checks' table made once, ``operand_specs``) refuses every bad
  operand with the former messages and passes the pointers of good ones to ``run``;
* ``GemmBackend.mm`` / ``linear`` hand the GEMM the same arrays (a contiguous weight / input
  itself, a strided one made contiguous), ask for the (M, N, K) plan, and keep the shapes;
* ``_common.check`` accepts and refuses exactly what the long form (kept here as the
  reference) does, with the same messages; ``_common.contiguous`` and ``ops_glue._on_device``
  return the array itself only where CuPy's ascontiguousarray / asarray would.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from memra_dsv4.gpu import blaslt, kernel_loader, pdl
from memra_dsv4.gpu.blaslt import BlasLtError, GemmKey


# ----------------------------------------------------------------------------- a fake CuPy
class _Mem:
    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr, self.device_id = ptr, device_id


class _Arr(np.ndarray):
    """A NumPy array posing as a CuPy one: ``data.ptr`` / ``data.device_id`` (device 0 unless
    ``on()`` says otherwise)."""

    @property
    def data(self):
        return _Mem(self.__array_interface__["data"][0], getattr(self, "_dev", 0))


def _dev(a, dev: int = 0):
    a = np.asarray(a).view(_Arr)
    a._dev = dev
    return a


def _fake_cupy(current_device: int = 0, calls=None):
    calls = [] if calls is None else calls
    fake = types.ModuleType("cupy")
    fake.ndarray = _Arr
    fake.uint16, fake.float32, fake.int32 = np.uint16, np.float32, np.int32

    def ascontiguousarray(a, dtype=None):
        calls.append(("ascontiguousarray", a))
        return _dev(np.ascontiguousarray(a, dtype=dtype))

    def asarray(a, dtype=None):
        calls.append(("asarray", a))
        return _dev(np.array(a, dtype=dtype))

    fake.ascontiguousarray = ascontiguousarray
    fake.asarray = asarray
    fake.empty = lambda shape, dtype=float: _dev(np.zeros(shape, dtype))
    stream = types.SimpleNamespace(ptr=7)
    fake.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: current_device),
        get_current_stream=lambda: stream)
    fake.calls = calls
    return fake


# ------------------------------------------------------------------- kernel_loader.lookup
class _RawModule:
    """cupy.RawModule stand-in: get_function hands out a fresh object per call and module."""

    def __init__(self, code, options, name_expressions):
        self.names = list(name_expressions or ())

    def compile(self):
        return None

    def get_function(self, name):
        return types.SimpleNamespace(name=name, module=self)


@pytest.fixture
def fake_loader(tmp_path, monkeypatch):
    """A KernelLoader of device 0 over a private kernels dir (stem ``hl_fake``) with CuPy's
    RawModule faked; counts the builds."""
    fake = _fake_cupy()
    fake.RawModule = _RawModule

    class _Dev:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    fake.cuda.Device = _Dev
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kernel_loader, "_REGISTRY", dict(kernel_loader._REGISTRY))
    (tmp_path / "hl_fake.cu").write_text('extern "C" __global__ void k_a() {}\n')
    loader = kernel_loader.KernelLoader(0, kernels_dir=str(tmp_path))
    builds = []
    real_build = kernel_loader.KernelLoader._build

    def counting_build(self, stem):
        builds.append(stem)
        return real_build(self, stem)
    monkeypatch.setattr(loader, "_build", types.MethodType(counting_build, loader))
    monkeypatch.setitem(kernel_loader._LOADERS, 0, loader)
    kernel_loader._LOOKUP.clear()
    kernel_loader.register("hl_fake", ["k_a"])
    yield loader, builds
    kernel_loader._LOOKUP.clear()


def test_lookup_is_get_memoised(fake_loader):
    loader, builds = fake_loader
    asked = []
    real_plain = loader.get_plain

    def counting_plain(stem, name):
        asked.append(name)
        return real_plain(stem, name)
    loader.get_plain = counting_plain
    k = kernel_loader.lookup(0, "hl_fake", "k_a")
    assert k is loader.get("hl_fake", "k_a") and k.name == "k_a"
    n = len(asked)
    for _ in range(3):
        assert kernel_loader.lookup(0, "hl_fake", "k_a") is k
    assert len(asked) == n, "a hit must not ask the loader"
    assert builds == ["hl_fake"]
    with pdl.pdl_launches(True):
        w = kernel_loader.lookup(0, "hl_fake", "k_a")
        assert isinstance(w, pdl.PdlKernel) and w is loader.get("hl_fake", "k_a")
        assert kernel_loader.lookup(0, "hl_fake", "k_a") is w
    assert kernel_loader.lookup(0, "hl_fake", "k_a") is k   # outside the context again


def test_lookup_follows_a_rebuilt_stem(fake_loader):
    loader, builds = fake_loader
    k_a = kernel_loader.lookup(0, "hl_fake", "k_a")
    kernel_loader.register("hl_fake", ["k_b"])   # names grew: the next get of a new name rebuilds
    k_b = kernel_loader.lookup(0, "hl_fake", "k_b")
    assert builds == ["hl_fake", "hl_fake"]
    k_a2 = kernel_loader.lookup(0, "hl_fake", "k_a")
    assert k_a2 is loader.get("hl_fake", "k_a") is not k_a, \
        "after a rebuild lookup must hand out the new module's kernel, as get does"
    assert k_a2.module is k_b.module is not k_a.module


def test_lookup_bypassed_while_get_is_replaced(fake_loader, monkeypatch):
    loader, _ = fake_loader
    k = kernel_loader.lookup(0, "hl_fake", "k_a")
    seen = []
    orig = kernel_loader.KernelLoader.get

    def recording_get(self, stem, name):
        proxy = types.SimpleNamespace(wrapped=orig(self, stem, name))
        seen.append(proxy)
        return proxy
    monkeypatch.setattr(kernel_loader.KernelLoader, "get", recording_get)
    a = kernel_loader.lookup(0, "hl_fake", "k_a")
    b = kernel_loader.lookup(0, "hl_fake", "k_a")
    assert seen == [a, b] and a is not b and a.wrapped is k
    monkeypatch.setattr(kernel_loader.KernelLoader, "get", orig)
    assert kernel_loader.lookup(0, "hl_fake", "k_a") is k   # the proxies were never memoised


def test_common_kernel_goes_through_lookup(monkeypatch):
    from memra_dsv4.gpu.ops import _common
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(current_device=3))
    got = []
    monkeypatch.setattr(kernel_loader, "lookup", lambda d, s, n: got.append((d, s, n)) or "K")
    assert _common.kernel("hc", "hc_post") == "K" and got == [(3, "hc", "hc_post")]


# --------------------------------------------------------------------- cuBLASLt plan memo
class _FakePlan:
    built: list = []

    def __init__(self, key, ctx):
        self.key, self.ctx, self.closed = key, ctx, False
        _FakePlan.built.append(key)

    def close(self):
        self.closed = True


@pytest.fixture
def fake_lt(monkeypatch):
    monkeypatch.setattr(blaslt, "GemmPlan", _FakePlan)
    _FakePlan.built = []
    lt = object.__new__(blaslt.BlasLt)
    lt.device_id, lt.handle, lt._plans, lt._bf16_f32 = 0, 0, {}, {}
    return lt


def test_plan_bf16_f32_memo(fake_lt):
    lt = fake_lt
    p = lt.plan_bf16_f32(64, 1024, 512)
    assert p.key == GemmKey(64, 1024, 512, "bf16", "bf16", "f32")
    assert lt.plan_bf16_f32(64, 1024, 512) is p
    assert lt.plan(GemmKey(64, 1024, 512, d_dtype="f32")) is p   # the one plan of that key
    q = lt.plan_bf16_f32(128, 1024, 512)
    r = lt.plan_bf16_f32(64, 1024, 1024)
    assert len({id(p), id(q), id(r)}) == 3 and r.key.k == 1024 and q.key.m == 128
    assert _FakePlan.built == [p.key, q.key, r.key]
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        lt.plan_bf16_f32(4, 1024, 7)
    lt.close()
    assert p.closed and lt.plans == {} and lt._bf16_f32 == {}
    assert lt.plan_bf16_f32(64, 1024, 512) is not p   # rebuilt after close


def test_plan_bf16_f32_reuses_a_plan_built_by_key(fake_lt):
    lt = fake_lt
    p = lt.plan(GemmKey(8, 256, 512, d_dtype="f32"))
    assert lt.plan_bf16_f32(8, 256, 512) is p and len(_FakePlan.built) == 1


# ------------------------------------------------------------------------ run_arrays
def _plan(key, device_id=0):
    plan = object.__new__(blaslt.GemmPlan)
    plan.key, plan.device_id = key, device_id
    plan._specs = blaslt.operand_specs(key)
    plan.ran = []
    plan.run = lambda *a: plan.ran.append(a)
    return plan


def test_run_arrays_checks(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(current_device=0))
    key = GemmKey(8, 256, 512, d_dtype="f32")
    plan = _plan(key)
    w = _dev(np.zeros((256, 512), np.uint16))
    x = _dev(np.zeros((8, 512), np.uint16))
    y = _dev(np.zeros((8, 256), np.float32))
    plan.run_arrays(w, x, y, "s")
    assert plan.ran == [(w.data.ptr, x.data.ptr, y.data.ptr, "s", None, None)]
    xs, ys = _dev(np.zeros((16, 512), np.uint16)), _dev(np.zeros((16, 256), np.float32))
    plan.run_arrays(w, xs, ys, "s")   # spare rows (bucket padding) are fine for X and Y
    bad = [
        ((_dev(np.zeros((255, 512), np.uint16)), x, y), r"w has shape \(255, 512\), expected \(256, 512\)"),
        ((w, _dev(np.zeros((4, 512), np.uint16)), y), r"x has shape \(4, 512\), expected >= \(8, 512\)"),
        ((w, x, _dev(np.zeros((8, 2, 128), np.float32))), r"y has shape \(8, 2, 128\), expected >= "),
        ((w, x.astype(np.float32).view(_Arr), y), r"x stored as float32, expected uint16 \(bf16\)"),
        ((w, x, _dev(np.zeros((8, 256), np.uint16))), r"y stored as uint16, expected float32 \(f32\)"),
        ((_dev(np.zeros((512, 256), np.uint16)).T, x, y), "w is not C-contiguous"),
        ((w, _dev(np.zeros((8, 512), np.uint16), dev=1), y), "x is on device 1, plan on 0"),
    ]
    for args, msg in bad:
        with pytest.raises(BlasLtError, match=msg):
            plan.run_arrays(*args, "s")
    with pytest.raises(BlasLtError, match="scales given to an unscaled plan"):
        plan.run_arrays(w, x, y, "s", a_scale=y)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(current_device=1))
    with pytest.raises(BlasLtError, match="current device is 1, plan was built for 0"):
        plan.run_arrays(w, x, y, "s")
    assert len(plan.ran) == 2


def test_run_arrays_batched_and_scaled(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    plan = _plan(GemmKey(4, 256, 512, d_dtype="f32", batch=3))
    w = _dev(np.zeros((3, 256, 512), np.uint16))
    x = _dev(np.zeros((3, 4, 512), np.uint16))
    y = _dev(np.zeros((3, 4, 256), np.float32))
    plan.run_arrays(w, x, y, None)
    with pytest.raises(BlasLtError, match=r"x has shape \(3, 8, 512\), expected \(3, 4, 512\)"):
        plan.run_arrays(w, _dev(np.zeros((3, 8, 512), np.uint16)), y, None)
    key = GemmKey(128, 256, 512, "e4m3", "e4m3", "bf16", "blk128x128", "vec128")
    plan = _plan(key)
    w = _dev(np.zeros((256, 512), np.uint8))
    x = _dev(np.zeros((128, 512), np.uint8))
    y = _dev(np.zeros((128, 256), np.uint16))
    sa, sb = _dev(np.zeros((2, 4), np.float32)), _dev(np.zeros((4, 128), np.float32))
    plan.run_arrays(w, x, y, None, a_scale=sa, b_scale=sb)
    assert plan.ran[-1][4:] == (sa.data.ptr, sb.data.ptr)
    with pytest.raises(BlasLtError, match=r"b_scale must be contiguous float32 \(4, 128\) on device 0"):
        plan.run_arrays(w, x, y, None, a_scale=sa, b_scale=_dev(np.zeros((4, 128), np.float32), dev=2))
    with pytest.raises(BlasLtError, match="a_scale must be contiguous float32"):
        plan.run_arrays(w, x, y, None, a_scale=None, b_scale=sb)


# ------------------------------------------------------------------ GemmBackend.mm / linear
@pytest.fixture
def fake_gemm(monkeypatch):
    from memra_dsv4.gpu import ops_glue as G
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    runs, plans = [], []

    class Lt:
        def plan_bf16_f32(self, m, n, k):
            plans.append((m, n, k))
            return types.SimpleNamespace(run_arrays=lambda w, x, y, s: runs.append((w, x, y, s)))
    g = object.__new__(G.GemmBackend)
    g.mode, g.lt, g.flops, g.device_id = "blaslt", Lt(), 0, 0
    def bits(a):   # the elementwise kernel's formula (ops_glue._RNE) in NumPy
        u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return _dev(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))
    monkeypatch.setitem(G._EW, "bits", bits)
    monkeypatch.setitem(G._EW, "store", lambda a: _dev(np.array(a, np.float32)))
    # contiguous float32 inputs take the raw kernels of gpu.ops.convert: the same stand-ins
    monkeypatch.setattr(G._CV, "f32_to_bf16_bits", bits)
    monkeypatch.setattr(G._CV, "f32_store_bf16", G._EW["store"])
    return G, g, fake, runs, plans


def test_mm_hands_over_the_same_arrays(fake_gemm):
    G, g, fake, runs, plans = fake_gemm
    w = _dev(np.ones((256, 512), np.uint16))
    x = _dev(np.ones((8, 512), np.uint16))
    y = g.mm(x, w)
    assert plans == [(8, 256, 512)] and y.shape == (8, 256) and y.dtype == np.float32
    rw, rx, ry, _ = runs[0]
    assert rw is w and rx is x and ry is y
    assert not [c for c in fake.calls if c[0] == "ascontiguousarray"]
    assert g.flops == 2 * 8 * 256 * 512
    ws = _dev(np.ones((256, 1024), np.uint16))[:, :512]   # strided views: made contiguous
    xs = _dev(np.ones((8, 1024), np.uint16))[:, ::2]
    g.mm(xs, ws)
    rw, rx, _, _ = runs[1]
    assert rw.flags.c_contiguous and rx.flags.c_contiguous and rw is not ws and rx is not xs
    assert np.array_equal(rw, ws) and np.array_equal(rx, xs)
    made = [c[1] for c in fake.calls if c[0] == "ascontiguousarray"]
    assert len(made) == 2 and made[0] is xs and made[1] is ws
    with pytest.raises(ValueError, match="weight dtype"):
        g.mm(x, _dev(np.ones((256, 512), np.uint8)))


def test_linear_shapes(fake_gemm):
    G, g, fake, runs, plans = fake_gemm
    w = _dev(np.ones((256, 512), np.uint16))
    x3 = _dev(np.ones((2, 4, 512), np.float32))
    y3 = G.linear(g, x3, w, out="f32")
    assert y3.shape == (2, 4, 256) and plans[-1] == (8, 256, 512)
    x2 = _dev(np.ones((4, 512), np.float32))
    y2 = G.linear(g, x2, w, out="f32")
    assert y2 is runs[-1][2] and y2.shape == (4, 256) and plans[-1] == (4, 256, 512)
    assert G.linear(g, x2, w).shape == (4, 256)   # stored (bf16-valued) output


# ------------------------------------------------------------------------- _common.check
def _check_long_form(a, name, dtype, shape=None, *, contiguous=True, rows_strided=False):
    """_common.check as it was before the fast paths: the reference."""
    cp = sys.modules["cupy"]
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy.ndarray, got {type(a).__name__}"
    assert a.dtype == np.dtype(dtype), f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}"
    if shape is not None:
        assert a.ndim == len(shape) and all(s is None or int(s) == d for s, d in zip(shape, a.shape)), (
            f"{name}: shape {a.shape}, expected {tuple('*' if s is None else s for s in shape)}")
    if rows_strided:
        assert a.ndim == 2 and (a.shape[1] <= 1 or a.strides[1] == a.itemsize), (
            f"{name}: the last axis must be contiguous (strides {a.strides})")
        assert a.strides[0] % a.itemsize == 0, f"{name}: row stride {a.strides[0]} not a multiple of the item size"
    elif contiguous:
        assert a.flags.c_contiguous, f"{name}: must be C-contiguous (strides {a.strides})"
    return a


def _outcome(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except AssertionError as e:   # the message (pytest's rewriting of the reference's asserts
        return str(e).split("\n")[0]   # appends an explanation on the next lines)
    return "ok"


def test_check_matches_the_long_form(monkeypatch):
    from memra_dsv4.gpu.ops import _common
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    a = _dev(np.zeros((4, 6), np.float32))
    arrays = [a, a[:, :3], a.T, _dev(np.zeros((4, 6, 2), np.uint16)), _dev(np.zeros(5, np.int32)),
              np.zeros((4, 6), np.float32)]
    shapes = [None, (4, 6), (4, 7), (None, 6), (4, None), [4, 6], (np.int64(4), 6), (4.0, 6),
              (4, 6, 2), (None, 6, 2), (5,), (6, 4), (4, 3), ()]
    dtypes = [np.float32, np.uint16, np.int32, "float32", np.dtype(np.float32), np.float64]
    n_ok = n_bad = 0
    for arr in arrays:
        for shape in shapes:
            for dt in dtypes:
                for kw in ({}, {"rows_strided": True}, {"contiguous": False}):
                    want = _outcome(_check_long_form, arr, "op.x", dt, shape, **kw)
                    got = _outcome(_common.check, arr, "op.x", dt, shape, **kw)
                    assert got == want, (arr.shape, shape, dt, kw)
                    n_ok += want == "ok"
                    n_bad += want != "ok"
    assert n_ok > 30 and n_bad > 300   # both outcomes well covered


def test_out_array_and_i32(monkeypatch):
    from memra_dsv4.gpu.ops import _common
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    o = _common.out_array(None, "op.out", (np.int64(3), 4.0), np.uint16)
    assert o.shape == (3, 4) and o.dtype == np.uint16
    assert _common.out_array(o, "op.out", [3, 4], np.uint16) is o
    with pytest.raises(AssertionError, match=r"op.out: shape \(3, 4\), expected \(3, 5\)"):
        _common.out_array(o, "op.out", (3, 5), np.uint16)
    v = _common.i32(7)
    assert type(v) is np.int32 and v == 7


def test_contiguous_is_ascontiguousarray(monkeypatch):
    from memra_dsv4.gpu.ops import _common
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    a = _dev(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert _common.contiguous(a) is a and _common.contiguous(a, dtype=np.float32) is a
    assert fake.calls == []
    for arg, dt in ((a[:, ::2], None), (a, np.int32), (_dev(np.float32(3)), None),
                    (np.ones(3, np.float32), None)):
        n = len(fake.calls)
        out = _common.contiguous(arg, dtype=dt)
        assert len(fake.calls) == n + 1 and fake.calls[-1][1] is arg and out is not arg


def test_on_device_is_asarray(monkeypatch):
    from memra_dsv4.gpu import ops_glue as G
    fake = _fake_cupy(current_device=1)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    here = _dev(np.zeros(3, np.float32), dev=1)
    assert G._on_device(here) is here and fake.calls == []
    there = _dev(np.zeros(3, np.float32), dev=0)     # asarray copies it to the current device
    host = np.zeros(3, np.float32)
    for arg in (there, host):
        n = len(fake.calls)
        G._on_device(arg)
        assert len(fake.calls) == n + 1 and fake.calls[-1][0] == "asarray" and fake.calls[-1][1] is arg
