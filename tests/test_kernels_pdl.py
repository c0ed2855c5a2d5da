"""CPU checks of programmatic dependent launch (memra_dsv4/gpu/pdl.py): the kernel-source rule
that makes PDL launches safe, the rule checker itself, and the argument marshalling that must
match CuPy's RawKernel conventions byte for byte."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from memra_dsv4.gpu import pdl
from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)

ROOT = os.path.join(os.path.dirname(__file__), "..")
KDIR = os.path.join(ROOT, "kernels_cu")
pdl_entry = load_tool("pdl_entry")


def test_every_kernel_opens_with_pdl_entry():
    bad = []
    for name in sorted(os.listdir(KDIR)):
        if name.endswith(".cu"):
            src = open(os.path.join(KDIR, name), encoding="utf-8").read()
            assert pdl_entry.kernels(src), f"{name}: no __global__ found (parser broken?)"
            bad += [f"{name}:{line} {k}" for k, line in pdl_entry.violations(src)]
    assert not bad, ("kernels that do not open with PDL_ENTRY(); (run python tools/pdl_entry.py "
                     "--fix): " + ", ".join(bad))


def test_rule_checker_finds_and_fixes_plain_templated_and_macro_kernels():
    src = (
        '#include "common.cuh"\n'
        'extern "C" __global__ void __launch_bounds__(256) plain(const int* x, int n) {\n'
        '    int i = threadIdx.x;\n}\n'
        'template <int N> __global__ void templ(float* y) {\n'
        '    // a comment first\n    y[0] = N;\n}\n'
        '#define MAKE(NAME)                                   \\\n'
        '    extern "C" __global__ void NAME(float* y) {       \\\n'
        '        y[0] = 1.0f;                                  \\\n'
        '    }\n'
        'extern "C" __global__ void ok(float* y) {\n    /* why */ PDL_ENTRY();\n    y[0] = 0;\n}\n'
        'extern "C" __global__ void pf(const float* w, float* y) {\n'
        '    PDL_ENTRY_PREFETCH(hint(w));\n    y[0] = 0;\n}\n'
        'extern "C" __global__ void late(float* y) {\n    y[0] = 0; PDL_ENTRY_PREFETCH(hint(y));\n}\n'
        'extern "C" __global__ void shdecl(float* y) {\n    __shared__ __align__(16) u16 w_s[256];\n'
        '    PDL_ENTRY_PRELOAD(const F f = load(w_s));\n    y[0] = 0;\n}\n'
        'extern "C" __global__ void shthen(float* y) {\n    __shared__ int c;\n    c = 1; PDL_ENTRY();\n}\n'
        '__global__ void declared_only(float* y);\n')
    names = [n for n, _ in pdl_entry.violations(src)]
    # pf: the prefetch form opens it; shdecl: a __shared__ declaration (no code) may precede it;
    # shthen: a statement after the declaration still breaks the rule
    assert names == ["plain", "templ", "NAME", "late", "shthen"], names
    fixed = pdl_entry.fix(src)
    assert pdl_entry.violations(fixed) == []
    assert fixed.count("PDL_ENTRY();") == 7
    assert pdl_entry.fix(fixed) == fixed                       # idempotent
    assert "{ PDL_ENTRY();       \\\n" in fixed                  # the macro line keeps its continuation


def _values(args):
    keep, arr = pdl.marshal_args(args)
    ptrs = [arr[i] for i in range(len(args))]
    return [ctypes.string_at(p, k.nbytes) for p, k in zip(ptrs, keep)]


def test_marshal_args_follows_cupy_conventions():
    got = _values((np.int32(-3), np.float32(1.5), np.uint64(7), 5, 2.5, True, None,
                   np.array([9], dtype=np.int16)))
    assert got == [np.int32(-3).tobytes(), np.float32(1.5).tobytes(), np.uint64(7).tobytes(),
                   np.int64(5).tobytes(), np.float64(2.5).tobytes(), np.bool_(True).tobytes(),
                   np.uint64(0).tobytes(), np.int16(9).tobytes()]


def test_marshal_args_refuses_what_cupy_refuses():
    with pytest.raises(TypeError, match="argument 1: a NumPy array of size 3"):
        pdl.marshal_args((np.int32(1), np.zeros(3)))
    with pytest.raises(TypeError, match="argument 0: unsupported type str"):
        pdl.marshal_args(("x",))


def test_context_nests_and_restores():
    assert not pdl.pdl_active()
    with pdl.pdl_launches(True):
        assert pdl.pdl_active()
        with pdl.pdl_launches(False):
            assert not pdl.pdl_active()
        assert pdl.pdl_active()
    assert not pdl.pdl_active()
    with pytest.raises(RuntimeError):
        with pdl.pdl_launches(True):
            raise RuntimeError("boom")
    assert not pdl.pdl_active()


def test_l2_prefetch_budget_parsing():
    from memra_dsv4.gpu import ops_decode as DK
    assert DK.l2_prefetch_bytes("off") == 0 and DK.l2_prefetch_bytes(None) == 0
    assert DK.l2_prefetch_bytes("32") == 32 << 20 and DK.l2_prefetch_bytes(8) == 8 << 20
    for bad in ("lots", "-1", "1.5", "5000"):
        with pytest.raises(ValueError, match="l2_prefetch"):
            DK.l2_prefetch_bytes(bad)
