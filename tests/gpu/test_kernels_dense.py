"""kernels_cu/dense.cu (dequant_fp8_bf16) against its NumPy twin, and the FP8 arm of GemmBackend.

Bounds: none; bit-exact.
* On the domain the loader accepts (no NaN code, e8m0 != 0xFF, product exact in bf16) the twin
  is formats.dequant_fp8_block_bf16 (= the loader's check): random e4m3 codes over the whole
  non-NaN range (subnormal codes 0x01..0x07 / 0x81..0x87 included), e8m0 scales 3..246 (the
  extremes planted: 2^-133 = the smallest bf16 subnormal, 448 * 2^119 near the bf16 max).
* Outside it (refused at load, never reached from a model) the kernel is still defined as the
  encode_bf16 of the float32 product (RNE on the bf16 subnormal grid, inf on overflow, 0x7FC0
  for a NaN code or scale 0xFF): checked on uniformly random bytes.
* Shapes: 128-multiples (vector path), partial 128-blocks with C % 16 == 0 (vector path),
  C % 16 != 0 and misaligned output views (scalar path).
* GemmBackend.mm / ops_glue.linear with ``scale=`` equal the bf16-weight GEMM bit for bit, and
  the per-device scratch grows and is reused without corrupting an enqueued GEMM.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import E4M3_VALUES, E8M0_VALUES, dequant_fp8_block_bf16, encode_bf16  # noqa: E402
from memra_dsv4.gpu.ops import dense as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import describe, fresh_seed, rand_bf16, rng_for  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(256, 4096), (130, 272), (300, 200), (1, 16), (7, 5), (4096, 1024)]


def _sc_shape(R, C):
    return (-(-R // 128), -(-C // 128))


def _exact_inputs(rng, R, C):
    codes = rng.integers(0, 254, (R, C), dtype=np.uint8)           # 0x00..0xFD
    codes[codes == 0x7F] = 0x7E                                     # no NaN codes (0xFF excluded)
    scale = rng.integers(3, 247, _sc_shape(R, C), dtype=np.uint8)
    # plant the extremes: scale 3 with the smallest subnormal codes, 246 with +-448
    scale[0, 0] = 3
    codes[0, 0] = 0x01
    codes[0, min(1, C - 1)] = 0x81
    scale[-1, -1] = 246
    codes[-1, -1] = 0x7E
    codes[-1, max(0, C - 2)] = 0xFE
    return codes, scale


def _check_bits(got, want, what, seed, **ctx):
    got = np.asarray(got, np.uint16)
    want = np.asarray(want, np.uint16)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got != want)
    assert bad.size == 0, (f"{what}: {len(bad)} of {got.size} elements differ {describe(seed, **ctx)}; "
                           f"first {[(tuple(int(i) for i in b), hex(int(got[tuple(b)])), hex(int(want[tuple(b)]))) for b in bad[:5]]}")


@pytest.mark.parametrize("R,C", SHAPES)
def test_dequant_fp8_exact_domain(R, C):
    seed = fresh_seed()
    rng = rng_for(seed)
    codes, scale = _exact_inputs(rng, R, C)
    want = dequant_fp8_block_bf16(codes, scale, "w")               # refuses anything inexact
    got = K.dequant_fp8_bf16(cp.asarray(codes), cp.asarray(scale))
    assert got.dtype == cp.uint16 and got.shape == (R, C)
    _check_bits(got.get(), want, "dequant_fp8_bf16", seed, R=R, C=C)


def _twin_any(codes, scale):
    R, C = codes.shape
    s = np.repeat(np.repeat(E8M0_VALUES[scale], 128, 0)[:R], 128, 1)[:, :C]
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (E4M3_VALUES[codes] * s).astype(np.float32)
    return np.where(np.isnan(prod), np.uint16(0x7FC0), encode_bf16(prod))


@pytest.mark.parametrize("R,C", [(256, 512), (200, 40)])
def test_dequant_fp8_outside_exact_domain(R, C):
    seed = fresh_seed()
    rng = rng_for(seed)
    codes = rng.integers(0, 256, (R, C), dtype=np.uint8)
    scale = rng.integers(0, 256, _sc_shape(R, C), dtype=np.uint8)
    scale[0, 0], scale[-1, -1] = 0, 255
    if scale.size > 2:
        scale.flat[1], scale.flat[2] = 1, 254
    got = K.dequant_fp8_bf16(cp.asarray(codes), cp.asarray(scale))
    _check_bits(got.get(), _twin_any(codes, scale), "dequant_fp8_bf16 (any bytes)", seed, R=R, C=C)


@pytest.mark.parametrize("offset", [8, 1])                         # 16-byte aligned / misaligned
def test_dequant_fp8_into_scratch_view(offset):
    seed = fresh_seed()
    rng = rng_for(seed)
    R, C = 192, 384
    codes, scale = _exact_inputs(rng, R, C)
    buf = cp.full(R * C + 64, 0xABCD, dtype=cp.uint16)
    out = buf[offset:offset + R * C].reshape(R, C)
    K.dequant_fp8_bf16(cp.asarray(codes), cp.asarray(scale), out)
    _check_bits(out.get(), dequant_fp8_block_bf16(codes, scale, "w"), "dequant_fp8_bf16 view", seed,
                offset=offset)
    rest = cp.concatenate([buf[:offset], buf[offset + R * C:]]).get()
    assert (rest == 0xABCD).all(), f"dequant_fp8_bf16 wrote outside its view {describe(seed, offset=offset)}"


def test_dequant_fp8_asserts_shapes_and_dtypes():
    w = cp.zeros((130, 256), cp.uint8)
    with pytest.raises(AssertionError, match="scale"):
        K.dequant_fp8_bf16(w, cp.zeros((1, 2), cp.uint8))
    with pytest.raises(AssertionError, match="dtype"):
        K.dequant_fp8_bf16(w.astype(cp.int8), cp.zeros((2, 2), cp.uint8))
    with pytest.raises(AssertionError, match="out"):
        K.dequant_fp8_bf16(w, cp.zeros((2, 2), cp.uint8), cp.zeros((130, 255), cp.uint16))


@pytest.mark.parametrize("mode", ["blaslt", "cupy"])
def test_gemm_fp8_weight_equals_bf16_weight_bitwise(mode):
    from memra_dsv4.gpu.ops_glue import GemmBackend, linear

    seed = fresh_seed()
    rng = rng_for(seed)
    try:
        g = GemmBackend(0, mode)
    except Exception as e:  # nvmath missing on this host: the blaslt arm cannot run
        pytest.skip(f"GemmBackend({mode!r}) unavailable: {e}")
    cases = []
    for (N, Kd) in ((256, 512), (1024, 256), (384, 128)):   # grows, then reuses the scratch
        codes, scale = _exact_inputs(rng, N, Kd)
        codes = np.where(rng.random(codes.shape) < 0.5, codes, codes & 0xBF).astype(np.uint8)  # spread
        scale = np.clip(scale, 100, 130).astype(np.uint8)  # keep products O(1) for a meaningful GEMM
        w_bf16 = cp.asarray(dequant_fp8_block_bf16(codes, scale, "w"))
        x = cp.asarray(rand_bf16(rng, (5, Kd)))
        cases.append((cp.asarray(codes), cp.asarray(scale), w_bf16, x))
    outs = [linear(g, x, w8, "bf16", scale=sc) for w8, sc, _, x in cases]   # all enqueued first
    for (w8, sc, wb, x), y in zip(cases, outs):
        want = linear(g, x, wb, "bf16")
        assert cp.array_equal(y.view(cp.uint32), want.view(cp.uint32)), (
            f"linear(FP8 weight) != linear(bf16 weight) {describe(seed, mode=mode, shape=w8.shape)}")
        y32 = g.mm(x, w8, sc)
        assert cp.array_equal(y32.view(cp.uint32), g.mm(x, wb).view(cp.uint32)), (
            f"mm(FP8 weight) != mm(bf16 weight) {describe(seed, mode=mode, shape=w8.shape)}")
    assert g._dense_scratch.size >= max(int(w.size) for w, *_ in cases)
    with pytest.raises(ValueError, match="uint16"):
        g.mm(cases[0][3], cases[0][0])                      # an FP8 weight without its scale
