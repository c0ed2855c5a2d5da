"""CPU checks of the bf16 conversion dispatch of ops_glue (to_f32 / bf16_bits / store) and of its
raw-kernel wrappers (gpu.ops.convert, kernels_cu/convert.cu), with a stand-in CuPy:

* which path each input takes: a C-contiguous, non-empty, >= 1-d CuPy array of the expected
  dtype (float32; uint16 for to_f32), host arrays included once uploaded, goes to the RawKernel;
  strided views, float64 (cast by _as_f32), 0-d and empty arrays go to the ElementwiseKernel as
  before; to_f32 of another integer dtype keeps the historical shift formula;
* the launch: kernel name, grid (ceil(n / 1024) blocks, capped at 8 per SM past 1024 blocks),
  block (256,), arguments (x, the new output, np.int64(n)), output shape and dtype;
* the kernels' source computes the same integer expression as ops_glue._RNE (so the same bits).

The GPU half (outputs byte for byte against the ElementwiseKernels) is
tests/gpu/test_kernels_convert.py.
"""

from __future__ import annotations

import os
import re
import sys
import time
import types

import numpy as np
import pytest

from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.gpu.ops import convert as CV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Mem:
    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


class _Arr(np.ndarray):
    """A NumPy array posing as a CuPy one on device 0."""

    @property
    def data(self):
        return _Mem(self.__array_interface__["data"][0], 0)


def _dev(a):
    return np.asarray(a).view(_Arr)


def _rne(x32):
    """ops_glue._RNE in NumPy (u32 arithmetic, wrapping)."""
    u = np.array(x32, np.float32).view(np.uint32).astype(np.uint64)   # 0-d stays 0-d
    return (((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16).astype(np.uint16)


def _formula(name, x):
    x = np.asarray(x)
    if name in ("memra_f32_to_bf16", "cvt_f32_to_bf16_bits"):
        return _rne(x)
    if name in ("memra_f32_store_bf16", "cvt_f32_store_bf16"):
        return (_rne(x).astype(np.uint32) << 16).view(np.float32)
    assert name in ("memra_bf16_to_f32", "cvt_bf16_to_f32")
    return (x.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture
def fake(monkeypatch):
    """A CuPy stand-in in sys.modules; ElementwiseKernel calls and RawKernel launches recorded
    in ``fake.calls`` as ("ew", name, x) / ("raw", name, grid, block, args)."""
    calls = []
    cp = types.ModuleType("cupy")
    cp.ndarray = _Arr
    cp.uint16, cp.uint32, cp.float32, cp.int32 = np.uint16, np.uint32, np.float32, np.int32
    cp.asarray = lambda a, dtype=None: _dev(np.array(a, dtype=dtype))
    cp.empty = lambda shape, dtype=float: _dev(np.full(shape, 0xAB, dtype))   # garbage, as cupy.empty
    cp.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))

    class ElementwiseKernel:
        def __init__(self, in_params, out_params, operation, name):
            self.name = name
            assert G._RNE in operation or name == "memra_bf16_to_f32"

        def __call__(self, x):
            calls.append(("ew", self.name, x))
            return _dev(_formula(self.name, x))

    cp.ElementwiseKernel = ElementwiseKernel

    class Raw:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args):
            calls.append(("raw", self.name, grid, block, args))
            x, y, n = args
            y[...] = _formula(self.name, x)   # writes into the output the wrapper allocated

    raws = {}
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(G, "_EW", {})
    monkeypatch.setattr(CV, "kernel", lambda stem, name: raws.setdefault((stem, name), Raw(name)))
    monkeypatch.setattr(CV, "sm_count", lambda: 132)
    cp.calls = calls
    return cp


_SPECIALS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x7F800000,
                      0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x3F808000,
                      0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000], np.uint32).view(np.float32)


def _f32(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2 ** 32, size=int(np.prod(shape)), dtype=np.uint64).astype(np.uint32)
    x[:min(x.size, _SPECIALS.size)] = _SPECIALS.view(np.uint32)[:x.size]
    return x.view(np.float32).reshape(shape)


@pytest.mark.parametrize("shape", [(1,), (3,), (4,), (5,), (1023,), (7, 33), (2, 3, 512), ((1 << 20) + 3,)])
@pytest.mark.parametrize("fn,kname", [("bf16_bits", "cvt_f32_to_bf16_bits"), ("store", "cvt_f32_store_bf16")])
def test_contiguous_f32_takes_the_raw_kernel(fake, shape, fn, kname):
    x = _dev(_f32(shape))
    y = getattr(G, fn)(x)
    assert [c[:2] for c in fake.calls] == [("raw", kname)], fake.calls
    _, _, grid, block, args = fake.calls[0]
    n = x.size
    assert block == (256,) and grid == (min(-(-n // 1024), 1056) if n > 1024 * 1024 else -(-n // 1024),)
    assert args[0] is x and args[1] is y and type(args[2]) is np.int64 and int(args[2]) == n
    assert y.shape == x.shape and y.dtype == (np.uint16 if fn == "bf16_bits" else np.float32)
    assert isinstance(y, _Arr) and y.flags.c_contiguous
    assert np.array_equal(np.asarray(y).view(np.uint8), _formula(kname, x).view(np.uint8))


@pytest.mark.parametrize("shape", [(1,), (5,), (1023,), (7, 33), ((1 << 20) + 3,)])
def test_contiguous_u16_takes_the_raw_kernel(fake, shape):
    h = _dev(np.arange(int(np.prod(shape)), dtype=np.uint64).astype(np.uint16).reshape(shape))
    y = G.to_f32(h)
    assert [c[:2] for c in fake.calls] == [("raw", "cvt_bf16_to_f32")]
    _, _, grid, block, (a, b, n) = fake.calls[0]
    assert a is h and b is y and type(n) is np.int64 and int(n) == h.size and block == (256,)
    assert y.shape == h.shape and y.dtype == np.float32
    assert np.array_equal(np.asarray(y).view(np.uint32), np.asarray(h).astype(np.uint32) << 16)


def test_host_input_is_uploaded_then_raw(fake):
    y = G.store(_f32((4, 8)))   # a NumPy array: cupy.asarray, then the contiguous path
    assert [c[:2] for c in fake.calls] == [("raw", "cvt_f32_store_bf16")] and y.shape == (4, 8)


@pytest.mark.parametrize("case", ["strided", "float64", "empty", "zero_d", "transposed"])
@pytest.mark.parametrize("fn,ew", [("bf16_bits", "memra_f32_to_bf16"), ("store", "memra_f32_store_bf16")])
def test_other_inputs_keep_the_elementwise_path(fake, case, fn, ew):
    base = _dev(_f32((6, 10)))
    with np.errstate(invalid="ignore"):   # NaN payloads in the float64 copy
        x64 = _dev(np.asarray(base, np.float64))
    x = {"strided": base[:, ::2], "float64": x64,
         "empty": _dev(np.zeros((0, 8), np.float32)), "zero_d": _dev(np.float32(1.5)),
         "transposed": base.T}[case]
    y = getattr(G, fn)(x)
    assert [c[:2] for c in fake.calls] == [("ew", ew)], fake.calls
    assert fake.calls[0][2].dtype == np.float32   # float64: cast by _as_f32 first
    assert y.shape == x.shape


@pytest.mark.parametrize("case", ["strided", "empty", "zero_d"])
def test_to_f32_other_inputs_keep_the_elementwise_path(fake, case):
    base = _dev(np.arange(60, dtype=np.uint16).reshape(6, 10))
    x = {"strided": base[:, ::2], "empty": _dev(np.zeros((0, 8), np.uint16)),
         "zero_d": _dev(np.uint16(0x3F80))}[case]
    y = G.to_f32(x)
    assert [c[:2] for c in fake.calls] == [("ew", "memra_bf16_to_f32")] and y.shape == x.shape


def test_to_f32_other_integer_dtype_keeps_the_shift_formula(fake):
    y = G.to_f32(_dev(np.array([0x3F80, 0x4000], np.int32)))
    assert fake.calls == [] and np.array_equal(np.asarray(y), [1.0, 2.0])


def test_blocks_for():
    assert [CV.blocks_for(n) for n in (1, 3, 4, 1024, 1025, 1024 * 1024)] == [1, 1, 1, 1, 2, 1024]
    CV_sm = CV.sm_count
    try:
        CV.sm_count = lambda: 132
        assert CV.blocks_for(1024 * 1024 + 1) == 1025 and CV.blocks_for(1 << 30) == 1056
        CV.sm_count = lambda: 200   # the cap follows the device's SM count
        assert CV.blocks_for(1 << 30) == 1600 and CV.blocks_for(1024 * 1024 + 1) == 1025
        CV.sm_count = lambda: 100   # but never below the uncapped 1024 blocks
        assert CV.blocks_for(1 << 30) == 1024 and CV.blocks_for(1024 * 1024 + 1) == 1024
    finally:
        CV.sm_count = CV_sm


def _kernel_bodies(src):
    return {m.group(1): src[m.end():src.find("\n}\n", m.end())]
            for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\(256\)\s+(\w+)\(', src)}


def test_source_uses_the_elementwise_formula():
    """convert.cu rounds with ops_glue._RNE's expression (the same integer arithmetic, so the
    same bits), every kernel uses it or the plain shift, and THREADS matches the launch bounds."""
    src = open(os.path.join(ROOT, "kernels_cu", "convert.cu"), encoding="utf-8").read()
    expr = re.search(r"b = (\(u \+ 0x7FFFu \+ \(\(u >> 16\) & 1u\)\) >> 16);", G._RNE).group(1)
    assert f"return {expr};" in src
    bodies = _kernel_bodies(src)
    assert set(bodies) == set(CV.KERNELS)
    assert "rne_bf16(" in bodies["cvt_f32_to_bf16_bits"] and "rne_bf16(" in bodies["cvt_f32_store_bf16"]
    assert "rne_bf16(" not in bodies["cvt_bf16_to_f32"] and "<< 16" in bodies["cvt_bf16_to_f32"]
    assert CV.THREADS == 256 and CV.PER_THREAD == 4
    # no float arithmetic on the values: the kernels see u32 / u16 pointers only
    assert "float" not in src.split("#include")[1]


def test_wrapper_host_cost_smoke(fake, capsys):
    """Prints the Python-side cost of the fast path per call (fake CuPy: no allocation, no
    launch), for the record; asserts only that the fast path does no elementwise call."""
    x = _dev(np.zeros((4, 8), np.float32))
    fake.empty = lambda shape, dtype=float: x   # no allocation: the wrapper's own cost
    CV_kernel = CV.kernel
    CV.kernel = lambda stem, name: (lambda grid, block, args: None)
    try:
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            G.store(x)
        dt = (time.perf_counter() - t0) / n * 1e6
    finally:
        CV.kernel = CV_kernel
    assert not [c for c in fake.calls if c[0] == "ew"]
    with capsys.disabled():
        print(f"\n[convert] ops_glue.store fast path, Python side with fakes: {dt:.2f} us/call")


@pytest.mark.parametrize("fn,ew", [("bf16_bits", "memra_f32_to_bf16"), ("store", "memra_f32_store_bf16"),
                                   ("to_f32", "memra_bf16_to_f32")])
def test_raw_convert_off_routes_to_the_elementwise_kernels(fake, monkeypatch, fn, ew):
    """ops_glue.RAW_CONVERT = False (the A/B switch of tools/profile_prefill_host.py --convert):
    the same contiguous input goes to the ElementwiseKernel, with the same bytes out."""
    x = _dev(_f32((7, 33)) if fn != "to_f32" else np.arange(231, dtype=np.uint16).reshape(7, 33))
    monkeypatch.setattr(G, "RAW_CONVERT", False)
    y = getattr(G, fn)(x)
    assert [c[:2] for c in fake.calls] == [("ew", ew)], fake.calls
    assert np.array_equal(np.asarray(y).view(np.uint8), _formula(ew, x).view(np.uint8))
