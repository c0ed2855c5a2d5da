"""gpu.ops.compressor.chain_rms_rope's host checks (NumPy stand-in for CuPy, the kernel a
recording stub): the same launch as before (every argument), two checks fewer per call than at
7ece4af (the reshaped mean's second full check is a shape assert, the out it has just made is
not re-checked; pinned: fails on that code), and the refusals kept (a wrong mean length, a
wrong given out)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.test_kernel_sources import FakeCupyArray, _fake_cupy


def _call(monkeypatch, **kw):
    from memra_dsv4.gpu.ops import _common
    from memra_dsv4.gpu.ops import compressor as CM
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    launches, n = [], [0]

    def check(*a, **k):
        n[0] += 1
        return _common.check(*a, **k)
    monkeypatch.setattr(CM, "check", check)
    monkeypatch.setattr(_common, "sm_count", lambda: 132)
    monkeypatch.setattr(CM, "kernel", lambda stem, name: lambda g, b, args, **k: launches.append(
        (name, g, b, [(str(a.dtype), a.shape, a.strides, a.tobytes()) if isinstance(a, np.ndarray)
                      and a.ndim else (type(a).__name__, a.item()) for a in args])))
    A = lambda a: np.ascontiguousarray(a).view(FakeCupyArray)
    rng = np.random.default_rng(1)
    n_, D, P = 5, 64, 16
    args = dict(x=A(rng.standard_normal((n_, D)).astype(np.float32)),
                mean=A(rng.random((n_, 1))), weight=A(rng.integers(0, 1 << 16, D).astype(np.uint16)),
                eps=1e-6, cos=A(rng.random((n_, P)).astype(np.float32)),
                sin=A(rng.random((n_, P)).astype(np.float32)), pre_store=True)
    args.update({k: (A(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()})
    out = CM.chain_rms_rope(**args)
    return launches, n[0], out


def test_chain_rms_rope_same_launch_two_checks_fewer(monkeypatch):
    launches, checks, out = _call(monkeypatch)
    assert out.shape == (5, 64) and out.dtype == np.uint16
    (name, grid, block, args), = launches
    assert name == "chain_rms_rope" and block == (256,)
    assert [a[0] for a in args] == ["float32", "int32", "int32", "float64", "uint16", "float64",
                                    "float32", "float32", "int32", "uint16", "int32", "int32",
                                    "int32"]
    assert args[3][1] == (5,)   # the mean as [n]
    assert checks == 5, checks   # x, mean, weight, cos, sin (7 at 7ece4af)
    _, checks, _ = _call(monkeypatch, out=np.zeros((5, 64), np.uint16))
    assert checks == 6           # a given out is checked


def test_chain_rms_rope_refusals_kept(monkeypatch):
    with pytest.raises(AssertionError, match=r"chain_rms_rope.mean: shape \(4,\), expected \(5,\)"):
        _call(monkeypatch, mean=np.zeros((4, 1)))
    with pytest.raises(AssertionError, match="chain_rms_rope.out"):
        _call(monkeypatch, out=np.zeros((5, 64), np.float32))
