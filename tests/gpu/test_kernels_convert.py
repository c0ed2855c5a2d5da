"""kernels_cu/convert.cu (gpu.ops.convert) against the CuPy ElementwiseKernels of ops_glue that it
stands in for (ops_glue._ew: memra_bf16_to_f32, memra_f32_to_bf16, memra_f32_store_bf16): the
outputs must be equal BYTE FOR BYTE (the same integer RNE formula, ops_glue._RNE), and both must
equal the NumPy formula.

* to_f32 on all 2^16 bf16 bit patterns; bf16_bits / store on random 32-bit patterns (most of the
  NaN space included) plus the specials: NaN payloads (quiet, signalling, all-ones, negative),
  +-Inf, +-0, subnormals (ties among them), RNE ties both ways, max finite (rounds to Inf);
* sizes 1, 3, 4, 5, 1023, 2^20 + 3 (the grid-stride cap and the n % 4 tail), a 2-D array;
* contiguous inputs at element offsets 1..3 (pointers not 16 / 8-byte aligned: the kernels'
  scalar branch);
* ops_glue's dispatch: a contiguous input takes the raw kernel (no ElementwiseKernel call), a
  strided view takes the ElementwiseKernel and still matches.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu import ops_glue as G  # noqa: E402
from memra_dsv4.gpu.ops import convert as CV  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = [1, 3, 4, 5, 1023, (1 << 20) + 3]

SPECIAL_BITS = np.array([
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
    0x7FFF8000, 0x7FFF7FFF, 0xFFFF8000,                                  # NaNs (payloads, carries)
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,                      # +-Inf, +-0
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000, 0x00018000, 0x00007FFF,
    0x00400000,                                                          # subnormals
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F808001, 0x3F807FFF,   # RNE ties and near
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000,          # max finite and ties there
    0x00800000, 0x80800000, 0x3F800000, 0x4B7FFFFF,
], np.uint32)


def _rne_np(u32):
    u = u32.astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16).astype(np.uint16)


def _f32_bits(n, seed):
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    k = min(n, SPECIAL_BITS.size)
    u[:k] = SPECIAL_BITS[:k]
    if n > 2 * SPECIAL_BITS.size:   # the specials again near the end (the tail threads)
        u[-SPECIAL_BITS.size:] = SPECIAL_BITS
    return u


def _same_bytes(a, b):
    a, b = cp.asnumpy(a), cp.asnumpy(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _check_f32(x):
    """x: a CuPy float32 array (any layout).  Raw kernel (when x is contiguous), ElementwiseKernel
    and NumPy all agree, byte for byte, for both conversions; ops_glue's answer too."""
    want_bits = _rne_np(cp.asnumpy(x).view(np.uint32))
    want_store = (want_bits.astype(np.uint32) << 16).view(np.float32)
    ew_bits, ew_store = G._ew("bits")(x), G._ew("store")(x)
    assert cp.asnumpy(ew_bits).tobytes() == want_bits.tobytes(), "ElementwiseKernel bits vs NumPy"
    assert cp.asnumpy(ew_store).tobytes() == want_store.tobytes(), "ElementwiseKernel store vs NumPy"
    if x.flags.c_contiguous:
        assert _same_bytes(CV.f32_to_bf16_bits(x), ew_bits), f"f32_to_bf16_bits n={x.size}"
        assert _same_bytes(CV.f32_store_bf16(x), ew_store), f"f32_store_bf16 n={x.size}"
    assert _same_bytes(G.bf16_bits(x), ew_bits) and _same_bytes(G.store(x), ew_store)


@pytest.mark.parametrize("n", SIZES)
def test_f32_conversions_match_the_elementwise_kernels(n):
    _check_f32(cp.asarray(_f32_bits(n, seed=n).view(np.float32)))


def test_to_f32_all_bf16_patterns():
    h = cp.arange(1 << 16, dtype=cp.uint32).astype(cp.uint16)
    ew = G._ew("to_f32")(h)
    want = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    assert cp.asnumpy(ew).tobytes() == want.tobytes()
    assert _same_bytes(CV.bf16_to_f32(h), ew) and _same_bytes(G.to_f32(h), ew)


@pytest.mark.parametrize("n", SIZES)
def test_to_f32_sizes(n):
    h = cp.asarray((np.arange(n, dtype=np.uint64) * 40503 % 65536).astype(np.uint16))
    assert _same_bytes(CV.bf16_to_f32(h), G._ew("to_f32")(h))


@pytest.mark.parametrize("off", [1, 2, 3])
def test_unaligned_contiguous_inputs(off):
    """Offset views are contiguous but not 16 / 8-byte aligned: the scalar branch."""
    n = 4096 + 7
    xf = cp.asarray(_f32_bits(n + off, seed=off).view(np.float32))[off:]
    assert xf.flags.c_contiguous and xf.data.ptr % 16
    _check_f32(xf)
    h = cp.asarray(np.arange(n + off, dtype=np.uint64).astype(np.uint16) * np.uint16(7))[off:]
    assert h.flags.c_contiguous and h.data.ptr % 8
    assert _same_bytes(CV.bf16_to_f32(h), G._ew("to_f32")(h)) and _same_bytes(G.to_f32(h), G._ew("to_f32")(h))


def test_2d_contiguous_and_strided_view():
    x = cp.asarray(_f32_bits(37 * 129, seed=5).view(np.float32).reshape(37, 129))
    _check_f32(x)
    _check_f32(x[:, ::2])                 # ops_glue takes the ElementwiseKernel for the view
    h = G.bf16_bits(x)
    assert _same_bytes(G.to_f32(h[:, 1::3]), G._ew("to_f32")(h[:, 1::3]))


def test_dispatch_on_the_device(monkeypatch):
    """ops_glue: contiguous -> raw kernel (the ElementwiseKernels are never asked), strided view
    -> ElementwiseKernel; the outputs the same bits either way."""
    asked = []
    real = G._ew
    monkeypatch.setattr(G, "_ew", lambda name: asked.append(name) or real(name))
    x = cp.asarray(_f32_bits(1000, seed=9).view(np.float32).reshape(10, 100))
    b, s = G.bf16_bits(x), G.store(x)
    f = G.to_f32(b)
    assert asked == []
    assert b.dtype == cp.uint16 and s.dtype == cp.float32 and f.dtype == cp.float32
    assert b.shape == s.shape == f.shape == (10, 100)
    G.bf16_bits(x[:, ::3]), G.store(x[:, ::3]), G.to_f32(b[:, ::3])
    assert asked == ["bits", "store", "to_f32"]
    G.store(x.astype(cp.float64)), G.store(cp.zeros((0, 4), cp.float32))
    assert asked[3:] == ["store", "store"]
