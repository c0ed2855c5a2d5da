"""The verify step's kernels (docs/verify_step_plan.md), stage 1: the multi-row bf16 GEMV
(decode.cu gemv_bf16_x{2,4,8}_r{4,2,1}, ops_decode.gemv_bf16_xrows).

* Row j of a launch over nx rows is bit-identical to gemv_bf16 of X[j] alone (f32 and bf16
  outputs), for nx = 1..8, plain and grouped weights, K with and without tail chunks, O not a
  multiple of the rows per warp, X / out as row-strided views; nothing outside out is written.
* Against the NumPy twin (test_kernels_decode.gemv_twin, the float64 dot): within the GEMV's
  f32 bound (GEMV_F32_ULPS of sum |w x|), which the equality above implies but is checked here
  directly too.
* Refusals: nx = 0 or 9, a K that is not a multiple of 8, a wrong out shape.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernels_decode import GEMV_F32_ULPS, _ulp_f32, gemv_twin  # prepend import mode

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import encode_bf16  # noqa: E402
from memra_dsv4.gpu import ops_decode as DK  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(512, 1024, 1), (1000, 520, 1), (96, 4096, 1), (1024, 264, 8), (4097, 1032, 1)]


def _bf16(rng, shape):
    return encode_bf16(rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape)))


def _values(bits):
    """bf16 bits -> their float32 values (exact): what the twin takes."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("O,K,groups", SHAPES)
@pytest.mark.parametrize("nx", [1, 2, 3, 4, 5, 8])
def test_xrows_rows_equal_single_row_gemv(O, K, groups, nx):
    rng = np.random.default_rng(O * 31 + K + nx)
    w = _bf16(rng, (O, K))
    ld = groups * K + 64                                   # row-strided X: a view
    Xbig = _bf16(rng, (nx, ld))
    wg, Xg = cp.asarray(w), cp.asarray(Xbig)[:, :groups * K]
    for dt, fill in ((cp.float32, np.float32(-1234.5)), (cp.uint16, np.uint16(0x7FC1))):
        big = cp.full((nx, O + 16), fill, dtype=dt)        # guard columns past O
        out = big[:, :O]
        DK.gemv_bf16_xrows(wg, Xg, out, groups=groups)
        got = big.get()
        assert (got[:, O:] == fill).all(), f"gemv_bf16_xrows wrote past O ({dt})"
        for j in range(nx):
            ref = cp.empty(O, dt)
            DK.gemv_bf16(wg, cp.ascontiguousarray(Xg[j]), ref, groups=groups)
            assert np.array_equal(got[j, :O].view(np.uint8), ref.get().view(np.uint8)), (
                f"row {j} of {nx}: not gemv_bf16's bits ({dt}, O={O} K={K} groups={groups})")
            if dt == cp.float32:
                y64, s = gemv_twin(_values(w), _values(Xbig[j, :groups * K]), groups)
                err = np.abs(got[j, :O].astype(np.float64) - y64)
                assert (err <= GEMV_F32_ULPS * _ulp_f32(s)).all(), f"row {j}: off the f64 dot"


def test_refusals():
    w = cp.zeros((64, 128), cp.uint16)
    for X, out, msg in [(cp.zeros((0, 128), cp.uint16), cp.zeros((0, 64), cp.float32), "rows"),
                        (cp.zeros((9, 128), cp.uint16), cp.zeros((9, 64), cp.float32), "rows"),
                        (cp.zeros((2, 128), cp.uint16), cp.zeros((2, 63), cp.float32), "out")]:
        with pytest.raises(AssertionError, match=msg):
            DK.gemv_bf16_xrows(w, X, out)
    with pytest.raises(AssertionError, match="multiple of 8"):
        DK.gemv_bf16_xrows(cp.zeros((64, 12), cp.uint16), cp.zeros((2, 12), cp.uint16),
                           cp.zeros((2, 64), cp.float32))
