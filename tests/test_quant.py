"""Tests of memra_dsv4.host.quant: roundings against ml_dtypes and an independent nearest-grid
search, the ue8m0 scale rule against a float64 formula, and properties of the act_quant / fake
quant simulations (grid membership, idempotence, reconstruction error, untouched rope dims)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from memra_dsv4 import formats as F
from memra_dsv4.host import quant as Q

E4M3_GRID = np.unique(np.abs(F.E4M3_VALUES[(np.arange(256) & 0x7F) != 0x7F]).astype(np.float64))
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def nearest_even(x, grid):
    """Independent oracle: nearest grid magnitude, ties to the even index (== even code), saturating."""
    ax = np.minimum(np.abs(x), grid[-1])
    i = np.clip(np.searchsorted(grid, ax), 1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    dlo, dhi = ax - lo, hi - ax
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (i % 2 == 0))
    return np.copysign(np.where(pick_hi, hi, lo), x)


def on_bf16_grid(v):
    return (np.asarray(v, np.float32).view(np.uint32) & 0xFFFF == 0).all()


def on_e4m3_scaled_grid(v, s, block):
    q = v.reshape(*v.shape[:-1], -1, block) / s[..., None]
    return np.isin(np.abs(q), E4M3_GRID).all()


# ---------------------------------------------------------------- round_bf16


def test_round_bf16_vs_ml_dtypes_random_and_edges():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 1, 0x8000, 0x18000, 0x7FFF, 0x3F808000, 0x3F818000,
                      0x3F807FFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF, 0x7F800000], np.uint32)
    x = np.concatenate([u, edges]).view(np.float32)
    x = x[~np.isnan(x)]
    got = Q.round_bf16(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(x.astype(ml_dtypes.bfloat16).astype(np.float32)))
    assert np.isnan(Q.round_bf16(np.array([np.nan], np.float32))).all()


def test_round_bf16_float64_is_direct_not_double_rounded():
    x32 = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    x32 = np.concatenate([x32, x32 * np.float32(1e-39), x32 * np.float32(1e-33),
                          np.float32([3.3895e38, 3.4e38, -3.4e38, 2.0**-133, 2.0**-149])])
    # on float32-representable inputs both paths agree (and the result stays float64)
    got64 = Q.round_bf16(x32.astype(np.float64))
    assert got64.dtype == np.float64
    np.testing.assert_array_equal(got64, Q.round_bf16(x32).astype(np.float64))
    # 1 + 2^-8 + 2^-30: halfway-plus-a-bit rounds UP; via float32 it would tie and round down
    x = np.array([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-8, -(1 + 3 * 2.0**-8 - 2.0**-40)])
    # and just below the tie between 1+2^-7 (odd) and 1+2^-6 (even) rounds DOWN (float32: ties, up)
    assert Q.round_bf16(x).tolist() == [1 + 2.0**-7, 1.0, -(1 + 2.0**-7)]
    via32 = Q.round_bf16(x.astype(np.float32))
    assert via32.tolist() == [1.0, 1.0, -(1 + 2.0**-6)]
    # overflow to inf exactly where IEEE RNE puts it
    big = np.array([(2 - 2.0**-8) * 2.0**127, (2 - 2.0**-8) * 2.0**127 * (1 - 2.0**-30)])
    assert Q.round_bf16(big).tolist() == [np.inf, F.BF16_MAX]


# ---------------------------------------------------------------- round_e4m3 / round_e2m1


def test_round_e4m3_dense_sweep_vs_ml_dtypes():
    u = np.arange(0, int(np.float32(448).view(np.uint32)) + 1, 251, dtype=np.uint32)
    mids = ((E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2).astype(np.float32)
    x = np.concatenate([u.view(np.float32), mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9)])
    x = np.concatenate([x, -x])
    got = Q.round_e4m3(x)
    np.testing.assert_array_equal(bits(got), bits(x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)))


def test_round_e4m3_saturation_and_float64():
    x = np.array([448, 460, 464, 470, 1e30, np.inf, -500, -np.inf], np.float32)
    assert Q.round_e4m3(x).tolist() == [448] * 6 + [-448] * 2
    assert np.isnan(Q.round_e4m3(np.array([np.nan]))).all()
    rng = np.random.default_rng(2)
    x64 = rng.standard_normal(50_000) * np.exp2(rng.integers(-14, 10, 50_000))
    got = Q.round_e4m3(x64)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, nearest_even(x64, E4M3_GRID))


def test_round_e2m1_vs_ml_dtypes_and_ties():
    x = np.linspace(-7, 7, 28001, dtype=np.float32)
    np.testing.assert_array_equal(bits(Q.round_e2m1(x)),
                                  bits(x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)))
    t = np.array([2.5, 3.5, 5, 0.25, 0.75, 1.25, 1.75, -5, 6.5, 1e9], np.float64)
    assert Q.round_e2m1(t).tolist() == [2, 4, 4, 0, 1, 1, 2, -4, 6, 6]
    np.testing.assert_array_equal(Q.round_e2m1(t), nearest_even(t, E2M1_GRID))


# ---------------------------------------------------------------- ue8m0_scale


@pytest.mark.parametrize("qmax", [448.0, 6.0])
def test_ue8m0_scale_vs_float64_formula(qmax):
    rng = np.random.default_rng(3)
    a = (rng.random(100_000) * np.exp2(rng.integers(-30, 30, 100_000))).astype(np.float32)
    pow2 = np.exp2(np.arange(-40, 40)).astype(np.float32)
    a = np.concatenate([a, pow2, pow2 * 448, pow2 * 6, np.nextafter(pow2 * 448, 0),
                        np.nextafter(pow2 * 448, np.inf), np.nextafter(pow2 * 6, 0),
                        np.nextafter(pow2 * 6, np.inf)]).astype(np.float32)
    a = a[a > 0]
    s = Q.ue8m0_scale(a, qmax)
    assert s.dtype == np.float32
    t = (a * np.float32(1 / qmax)).astype(np.float64)  # the reference's float32 t
    np.testing.assert_array_equal(s.astype(np.float64), np.exp2(np.ceil(np.log2(t))))
    # For qmax 448 and 6 the error of float32(1/qmax) (+4.5e-8 / +3.0e-8 relative) is too small to
    # push t across a power of two for any float32 amax (the nearest candidates are the float32
    # neighbours of qmax * 2^k, included above), so the rule equals the exact formula too.
    exact = np.exp2(np.ceil(np.log2(a.astype(np.float64) / qmax)))
    np.testing.assert_array_equal(s.astype(np.float64), exact)
    # mantissa-zero case: t an exact power of two gives s == t, not 2t
    t_pow = np.exp2(np.arange(-20, 20)).astype(np.float32)
    np.testing.assert_array_equal(Q.ue8m0_scale(t_pow * np.float32(qmax), qmax), t_pow)


def test_ue8m0_scale_float64_dtype_and_refusals():
    s = Q.ue8m0_scale(np.array([1.0, 448.0, 449.0]), 448.0)
    assert s.dtype == np.float64 and s.tolist() == [2.0**-8, 1.0, 2.0]
    for bad in [0.0, -1.0, np.nan, np.inf]:
        with pytest.raises(ValueError, match="amax"):
            Q.ue8m0_scale(np.array([1.0, bad], np.float32), 448.0)
    with pytest.raises(ValueError, match="exponent"):
        Q.ue8m0_scale(np.array([1e-44], np.float32), 448.0)  # t underflows to 0


# ---------------------------------------------------------------- act_quant_fp8 / sims


def test_act_quant_fp8_reconstruction_and_scales():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 5, 512)) * np.exp2(rng.integers(-8, 8, (3, 5, 1)))).astype(np.float32)
    x[0, 0, :128] = 0.0  # all-zero block: amax floor 1e-4
    q, s = Q.act_quant_fp8(x)
    assert q.shape == x.shape and s.shape == (3, 5, 4) and q.dtype == s.dtype == np.float32
    m, _ = np.frexp(s)
    assert (m == 0.5).all()  # powers of two
    assert np.isin(np.abs(q), E4M3_GRID).all()
    assert s[0, 0, 0] == 2.0**-22  # ceil(log2(1e-4/448)) = -22
    recon = (q.reshape(3, 5, 4, 128) * s[..., None]).reshape(x.shape)
    # e4m3 has 3 mantissa bits: normal values within 2^-4 relative, subnormals within s * 2^-10
    err = np.abs(recon - x)
    assert (err <= np.maximum(np.abs(x) * 2.0**-4, np.repeat(s, 128, -1) * 2.0**-10)).all()
    amax = np.abs(x.reshape(3, 5, 4, 128)).max(-1)
    assert (amax / s <= 448 * (1 + 2.0**-20)).all() and (
        np.abs(q).reshape(3, 5, 4, 128).max(-1)[amax > 1e-4] >= 224).all()


def test_act_quant_fp8_matches_ml_dtypes_cast():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 256)).astype(np.float32) * 3
    q, s = Q.act_quant_fp8(x)
    xs = x.reshape(7, 2, 128) / s[..., None]
    ref = np.clip(xs, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(7, 256)
    np.testing.assert_array_equal(q, ref)


def test_block_divisibility_asserted():
    with pytest.raises(AssertionError, match="block"):
        Q.act_quant_fp8(np.zeros((2, 100), np.float32))
    with pytest.raises(AssertionError, match="block"):
        Q.fp4_sim(np.zeros((2, 48), np.float32))
    with pytest.raises(AssertionError, match="nope width"):
        Q.kv_fp8_sim(np.zeros((2, 100), np.float32), 4)


def test_fp8_sim_idempotent_and_on_grid():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((9, 448)) * np.exp2(rng.integers(-20, 20, (9, 1)))).astype(np.float32)
    x[3, 64:128] = 0
    x[4, :64] = 224.5 * 2.0**-3  # amax/s just above 224: exercises the halved-scale path
    v = Q.fp8_sim(x, 64)
    assert v.dtype == np.float32 and on_bf16_grid(v)
    _, s = Q.act_quant_fp8(x, 64)
    assert on_e4m3_scaled_grid(v, s, 64)
    np.testing.assert_array_equal(bits(Q.fp8_sim(v, 64)), bits(v))
    assert not np.array_equal(v, x)


def test_fp4_sim_known_block_and_idempotent():
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [12.0, 5.0, -7.0, 1.0, 0.4, -0.9]  # amax 12 -> s = 2
    v = Q.fp4_sim(x)
    # x/s = 6, 2.5->2, -3.5->-4, 0.5 (on grid), 0.2->0, -0.45->-0.5; then * s
    assert v[0, :6].tolist() == [12.0, 4.0, -8.0, 1.0, 0.0, -1.0]
    rng = np.random.default_rng(7)
    y = (rng.standard_normal((6, 128)) * np.exp2(rng.integers(-30, 30, (6, 1)))).astype(np.float32)
    w = Q.fp4_sim(y)
    assert on_bf16_grid(w)
    np.testing.assert_array_equal(bits(Q.fp4_sim(w)), bits(w))
    s = Q.ue8m0_scale(np.maximum(np.abs(y.reshape(6, 4, 32)).max(-1), Q.FP4_AMAX_FLOOR), 6.0)
    assert np.isin(np.abs(w.reshape(6, 4, 32) / s[..., None]), E2M1_GRID).all()
    z = Q.fp4_sim(np.zeros((2, 32), np.float32))  # amax floor keeps the scale normal
    assert not z.any() and not np.isnan(z).any()


def test_kv_fp8_sim_rope_dims_untouched():
    rng = np.random.default_rng(8)
    kv = rng.standard_normal((2, 5, 512)).astype(np.float32) * 7
    kv = Q.round_bf16(kv) + np.float32(1e-3)  # rope dims deliberately off any fp8 grid
    out = Q.kv_fp8_sim(kv, 64)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    np.testing.assert_array_equal(bits(out[..., 448:]), bits(kv[..., 448:]))
    np.testing.assert_array_equal(out[..., :448], Q.fp8_sim(kv[..., :448], 64))
    assert not np.array_equal(out[..., :448], kv[..., :448])
    kv_before = kv.copy()
    Q.kv_fp8_sim(kv, 64)
    np.testing.assert_array_equal(bits(kv), bits(kv_before))  # input not modified
    np.testing.assert_array_equal(Q.kv_fp8_sim(kv[..., :448], 0), Q.fp8_sim(kv[..., :448], 64))
    out64 = Q.kv_fp8_sim(kv.astype(np.float64), 64)
    assert out64.dtype == np.float64
    np.testing.assert_array_equal(out64, out.astype(np.float64))


# ---------------------------------------------------------------- properties

finite32 = st.floats(-3e4, 3e4, width=32, allow_nan=False, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([64, 128])), elements=finite32))
def test_fp8_sim_property_idempotent_on_grid(x):
    v = Q.fp8_sim(x, 64)
    assert on_bf16_grid(v)
    np.testing.assert_array_equal(bits(Q.fp8_sim(v, 64)), bits(v))
    np.testing.assert_array_equal(Q.round_e4m3(v), Q.round_e4m3(Q.round_e4m3(v)))


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 96])), elements=finite32))
def test_fp4_sim_property_idempotent_on_grid(x):
    w = Q.fp4_sim(x)
    assert on_bf16_grid(w)
    np.testing.assert_array_equal(bits(Q.fp4_sim(w)), bits(w))
    # |error| per element at most half the top grid spacing (s) of its block
    s = Q.ue8m0_scale(np.maximum(np.abs(x.reshape(x.shape[0], -1, 32)).max(-1), Q.FP4_AMAX_FLOOR), 6.0)
    assert (np.abs(w - x).reshape(x.shape[0], -1, 32) <= s[..., None]).all()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 50),
                  elements=st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False)))
def test_round_e4m3_e2m1_float64_property(x):
    np.testing.assert_array_equal(Q.round_e4m3(x), nearest_even(x, E4M3_GRID))
    np.testing.assert_array_equal(Q.round_e2m1(x), nearest_even(x, E2M1_GRID))
