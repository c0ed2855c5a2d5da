"""The identities branch hostlean2 leans on, checked byte for byte on the GPU (the CPU halves are
tests/test_block_host_ops_cpu.py, which fakes every kernel):

* ops_glue.swiglu_clamped's fused ElementwiseKernel == swiglu_clamped_chain (the 12 CuPy calls
  it replaces), on random rows and the specials: +-limit, beyond it both ways, exp overflow
  (large negative gate), +-0, subnormals, +-Inf and NaNs (payloads compared too);
* rmsnorm_rope_bits(y, pre_store=True) == rmsnorm_rope_bits(store(y)) (the q / kv projections
  now reach it unrounded), with and without RoPE;
* hadamard(x, bits=True) == bf16_bits(hadamard(x)); bf16_bits(store(y)) == bf16_bits(y) and
  bf16_bits(to_f32(b)) == b on every pattern class (what the dropped conversions relied on);
* the chunk routine's whole-model bytes are tests/gpu/test_hostlean_gpu.py's (fused == chains),
  tests/gpu/test_prefill_gpu.py's and tests/gpu/test_pipeline_gpu.py's business.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu import ops_glue as G  # noqa: E402

pytestmark = pytest.mark.gpu

LIMIT = 10.0


def _special_f32():
    v = np.array([0.0, -0.0, LIMIT, -LIMIT, np.nextafter(LIMIT, 20), np.nextafter(-LIMIT, -20),
                  np.nextafter(LIMIT, 0), 11.0, -11.0, 1e30, -1e30, -745.0, -800.0, -1e5, 745.0,
                  1e-40, -1e-40, 1.4e-45, np.inf, -np.inf, 1.0, -1.0, 0.5, 3.0e-8], np.float32)
    nan = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32
                   ).view(np.float32)
    return np.concatenate([v, nan])


def _bits(a):
    return cp.asnumpy(a).view(np.uint32)


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (2752, 2048)])
def test_swiglu_fused_equals_chain(shape):
    rng = np.random.default_rng(shape[0])
    n = int(np.prod(shape))
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 2, n)).astype(np.float32)
    u = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 2, n)).astype(np.float32)
    sp = _special_f32()
    m = min(n, sp.size)
    g[:m] = sp[:m]
    if n >= sp.size * sp.size:   # every (gate, up) pair of specials
        gg, uu = np.meshgrid(sp, sp)
        k = gg.size
        g[m:m + k], u[m:m + k] = gg.ravel(), uu.ravel()
    gd, ud = cp.asarray(g.reshape(shape)), cp.asarray(u.reshape(shape))
    fused = G.swiglu_clamped(gd, ud, LIMIT)
    chain = G.swiglu_clamped_chain(gd, ud, LIMIT)
    assert fused.dtype == chain.dtype == cp.float32 and fused.shape == chain.shape
    bad = np.flatnonzero(_bits(fused).ravel() != _bits(chain).ravel())
    assert bad.size == 0, (f"{bad.size} differ, first at {bad[0]}: gate {g[bad[0]]!r} up "
                           f"{u[bad[0]]!r} fused {_bits(fused).ravel()[bad[0]]:#x} chain "
                           f"{_bits(chain).ravel()[bad[0]]:#x}")


def test_swiglu_other_calls_take_the_chain():
    g = cp.asarray(np.linspace(-20, 20, 64, dtype=np.float32).reshape(8, 8))
    w = cp.asarray(np.linspace(0.1, 1, 8, dtype=np.float32))
    for args in ((g, g, 0.0), (g, g, LIMIT, w), (g.astype(cp.float64), g, LIMIT)):
        got = G.swiglu_clamped(*args)
        want = G.swiglu_clamped_chain(*args)
        assert np.array_equal(cp.asnumpy(got).view(np.uint32), cp.asnumpy(want).view(np.uint32))


@pytest.mark.parametrize("n,D,P", [(9, 512, 32), (2752, 1024, 0), (300, 512, 32)])
def test_rmsnorm_rope_bits_pre_store_is_store_first(n, D, P):
    from memra_dsv4.host.quant import round_bf16
    rng = np.random.default_rng(n)
    y = (rng.standard_normal((n, D)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(np.float32)
    y[0, ::3] = -0.0
    hi = rng.integers(0x3E00, 0x4200, D).astype(np.uint32)
    y[1] = ((hi << 16) | 0x8000).view(np.float32)        # RNE ties
    w = round_bf16((1.0 + 0.02 * rng.standard_normal(D)).astype(np.float32)).astype(np.float32)
    wb = cp.asarray((w.view(np.uint32) >> 16).astype(np.uint16))
    cos = sin = None
    if P:
        ang = rng.uniform(-50, 50, (n, P))
        cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    yd = cp.asarray(y)
    got = G.rmsnorm_rope_bits(yd, wb, 1e-6, cos, sin, pre_store=True)
    want = G.rmsnorm_rope_bits(G.store(yd), wb, 1e-6, cos, sin)
    assert np.array_equal(cp.asnumpy(got), cp.asnumpy(want))


def test_hadamard_bits_and_conversion_identities():
    rng = np.random.default_rng(5)
    h = rng.integers(0, 1 << 16, (64, 128)).astype(np.uint16)
    h[(h & 0x7F80) == 0x7F80] = 0x3F80   # finite bf16 values (the keys / queries it serves)
    x = G.to_f32(cp.asarray(h))
    assert np.array_equal(cp.asnumpy(G.hadamard(x, bits=True)),
                          cp.asnumpy(G.bf16_bits(G.hadamard(x))))
    u = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    u[:4] = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F7FFFFF, 0x00008000]
    y = cp.asarray(u.view(np.float32))
    assert np.array_equal(cp.asnumpy(G.bf16_bits(G.store(y))), cp.asnumpy(G.bf16_bits(y)))
    b = cp.arange(1 << 16, dtype=cp.uint32).astype(cp.uint16)
    assert np.array_equal(cp.asnumpy(G.bf16_bits(G.to_f32(b))), cp.asnumpy(b))
