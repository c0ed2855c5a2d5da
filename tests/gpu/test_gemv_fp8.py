"""The decode GEMVs on stored FP8 dense weights (kernels_cu/decode.cu, e4m3 bytes + e8m0 128x128
block scales) against the same kernels on the exactly dequantised bf16 weights.

Bound: bit-identical.  w = e4m3 * 2^(s - 127) is exact in f32 and, for a weight the loader
accepts, exact in bf16 (formats.dequant_fp8_block + f32_to_bf16_exact, the bf16 arm's load
path); both forms then feed the same products to the same accumulation order (warp_rows_dot), so
the two arms of the device step differ in bytes read only.  Codes cover every finite e4m3 value
(subnormals included) and scales 2^-8..2^8.  Every rows-per-warp kernel (gemv_fp8_r1/2/4/8/r4t2,
gemv_bf16_multi_r1/r4, gemv_bf16_swiglu_p1/p2) is held to the bf16 bits of one row per warp,
incl. rows past O in the last warp and warps whose rows sit at odd offsets of a 128-row scale
block (odd segment sizes in a GemvTable).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import dequant_fp8_block, f32_to_bf16_exact  # noqa: E402
from memra_dsv4.gpu import ops_decode as DK  # noqa: E402
from memra_dsv4.gpu.ops.testing import fresh_seed, rand_bf16, rng_for  # noqa: E402

pytestmark = pytest.mark.gpu


def _fp8(rng, O, K):
    """(e4m3 bytes, e8m0 scales, bf16 bits of the exact dequantisation), NaN codes excluded."""
    codes = rng.integers(0, 0x7F, (O, K), dtype=np.uint8)          # 0x00..0x7E: finite
    codes |= (rng.integers(0, 2, (O, K), dtype=np.uint8) << 7)      # random sign
    scale = rng.integers(127 - 8, 127 + 9, (-(-O // 128), -(-K // 128)), dtype=np.uint8)
    w = dequant_fp8_block(codes, scale, "test.w")
    return codes, scale, f32_to_bf16_exact(w.astype(np.float32), "test.w")


def _dev(*arrs):
    return [cp.asarray(a) for a in arrs]


@pytest.mark.parametrize("O,K,groups", [(1024, 4096, 1), (300, 1032, 1), (8192, 4096, 8),
                                        (4096, 8192, 1), (64, 264, 1), (100, 1824, 1)])
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_gemv_fp8_equals_bf16_bits(O, K, groups, out_dtype):
    seed = fresh_seed()
    rng = rng_for(seed)
    codes, scale, wb = _fp8(rng, O, K)
    x = f32_to_bf16_exact(rand_bf16(rng, (groups * K,), 1.0), "x")
    c_d, s_d, wb_d, x_d = _dev(codes, scale, wb, x)
    y8, yb = cp.empty(O, out_dtype), cp.empty(O, out_dtype)
    DK.gemv_bf16(c_d, x_d, y8, groups=groups, scale=s_d)
    DK.gemv_bf16(wb_d, x_d, yb, groups=groups)
    a, b = cp.asnumpy(y8).view(np.uint32 if out_dtype == np.float32 else np.uint16), \
        cp.asnumpy(yb).view(np.uint32 if out_dtype == np.float32 else np.uint16)
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, f"seed {seed}: {bad.size} rows differ, first {bad[:5]}"


@pytest.mark.parametrize("O,K,groups", [(300, 1032, 1), (4096, 1024, 1), (8192, 4096, 8), (37, 2048, 1),
                                        (21, 264, 3), (10, 1032, 2), (100, 1824, 1), (64, 800, 1),
                                        (40, 5128, 1), (4096, 8192, 1)])
def test_gemv_fp8_rows_per_warp(O, K, groups):
    """gemv_fp8_r{1,2,4,8}, gemv_fp8_r4t2 (and the default) == gemv_bf16_r1 on the dequantised
    weights, byte for byte, f32 out, nothing written past O; rows per group 7 and 5 exercise the
    lowering of the default R.  K covers every phase of warp_rows_dot: warp-uniform trip pairs
    (T = 2; K % 2048 == 0, and K = 4096 + 1024 + 8: a pair, a single uniform trip, a tail) and
    single trips (scales by shuffle), per-lane complete groups (scale byte loads; K = 1824, 800:
    chunks mod 128 in (96, 128)) and tail chunks (K = 1032, 264, 1824)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    codes, scale, wb = _fp8(rng, O, K)
    x = f32_to_bf16_exact(rand_bf16(rng, (groups * K,), 1.0), "x")
    c_d, s_d, wb_d, x_d = _dev(codes, scale, wb, x)
    ref = cp.empty(O, cp.float32)
    DK.gemv_bf16(wb_d, x_d, ref, groups=groups, rows_per_warp=1)
    ref = cp.asnumpy(ref).view(np.uint32)
    rpg = O // groups if groups > 1 else 0
    for v in [None] + [v for v in DK.GEMV_VARIANTS[True] if rpg % v[0] == 0]:
        y = cp.full(O + 8, -1234.5, cp.float32)
        kw = {} if v is None else dict(rows_per_warp=v[0], trips=v[1])
        DK.gemv_bf16(c_d, x_d, y[:O], groups=groups, scale=s_d, **kw)
        got = cp.asnumpy(y).view(np.uint32)
        bad = np.flatnonzero(got[:O] != ref)
        assert bad.size == 0, f"seed {seed}: (R, T) {v}: {bad.size} rows differ, first {bad[:5]}"
        assert (got[O:] == np.float32(-1234.5).view(np.uint32)).all(), f"seed {seed}: {v}: wrote past O"


@pytest.mark.parametrize("K", [2048, 1824])
@pytest.mark.parametrize("rows_per_warp,outs_per_warp", [(1, 1), (4, 2)])
def test_gemv_multi_and_swiglu_mixed_forms(rows_per_warp, outs_per_warp, K):
    """A GemvTable mixing FP8 and bf16 entries, and gemv_bf16_swiglu on FP8, equal bf16 bits."""
    seed = fresh_seed()
    rng = rng_for(seed)
    shapes = [(512, True), (256, False), (130, True), (7, True), (203, True)]
    e8, eb, outs8, outsb = [], [], [], []
    for O, is8 in shapes:
        codes, scale, wb = _fp8(rng, O, K)
        c_d, s_d, wb_d = _dev(codes, scale, wb)
        o8, ob = cp.empty(O, cp.float32), cp.empty(O, cp.float32)
        e8.append(((c_d, s_d) if is8 else wb_d, o8))
        eb.append((wb_d, ob))
        outs8.append(o8)
        outsb.append(ob)
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0), "x"))
    pos = cp.zeros(1, cp.int32)
    DK.gemv_bf16_multi(DK.GemvTable(e8, K, rows_per_warp=rows_per_warp), x, pos)
    DK.gemv_bf16_multi(DK.GemvTable(eb, K, rows_per_warp=1), x, pos)
    for i, (a, b) in enumerate(zip(outs8, outsb)):
        assert bool((a.view(cp.uint32) == b.view(cp.uint32)).all()), f"seed {seed}: entry {i}"
    c1, s1, w1 = _fp8(rng, 259, K)
    c3, s3, w3 = _fp8(rng, 259, K)
    h8, hb = cp.empty(259, cp.uint16), cp.empty(259, cp.uint16)
    d = _dev(c1, s1, w1, c3, s3, w3)
    DK.gemv_bf16_swiglu(d[0], d[3], x, h8, 10.0, scale1=d[1], scale3=d[4], outs_per_warp=outs_per_warp)
    DK.gemv_bf16_swiglu(d[2], d[5], x, hb, 10.0, outs_per_warp=1)
    assert bool((h8 == hb).all()), f"seed {seed}: swiglu FP8 != bf16"


def test_fp8_weight_refusals():
    codes = cp.zeros((128, 256), cp.uint8)
    x = cp.zeros(256, cp.uint16)
    y = cp.empty(128, cp.float32)
    with pytest.raises(AssertionError, match="without its .scale"):
        DK.gemv_bf16(codes, x, y)
    with pytest.raises(AssertionError, match="scale"):
        DK.gemv_bf16(codes, x, y, scale=cp.zeros((1, 1), cp.uint8))  # needs [1, 2]
    with pytest.raises(AssertionError, match="takes no scale"):
        DK.gemv_bf16(cp.zeros((128, 256), cp.uint16), x, y, scale=cp.zeros((1, 2), cp.uint8))
