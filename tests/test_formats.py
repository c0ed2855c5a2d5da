"""Tests of memra_dsv4.formats: exhaustive code tables against ml_dtypes, hand-built dequant
examples with known values, RNE ties of the encoders, and one test per refusal path asserting
that the tensor name appears in the FormatError message."""

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from memra_dsv4 import formats as F
from memra_dsv4.formats import FormatError

ALL = np.arange(256, dtype=np.uint8)
E4M3_OK = (ALL & 0x7F) != 0x7F


def bits32(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def raises_named(name):
    return pytest.raises(FormatError, match=re.escape(name))


# ---------------------------------------------------------------- code tables vs ml_dtypes


def test_e4m3_all_codes_match_ml_dtypes():
    ref = ALL.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = F.decode_e4m3(ALL[E4M3_OK], "t")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(bits32(got), bits32(ref[E4M3_OK]))  # incl. -0.0 at 0x80
    assert np.isnan(ref[~E4M3_OK]).all()
    assert F.decode_e4m3(np.array([0x7E, 0xFE, 0x01, 0x08], np.uint8), "t").tolist() == [
        448.0, -448.0, 2.0**-9, 2.0**-6]


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_e4m3_nan_codes_refused(code):
    a = np.zeros((3, 5), np.uint8)
    a[1, 2] = code
    a[2, 4] = 0x7F
    with pytest.raises(FormatError) as ei:
        F.decode_e4m3(a, "layers.3.attn.wq_a.weight")
    msg = str(ei.value)
    assert "layers.3.attn.wq_a.weight" in msg and "2 " in msg and "flat index 7" in msg


def test_e8m0_all_codes_match_ml_dtypes():
    ref = ALL.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = F.decode_e8m0(ALL[:255], "s")
    np.testing.assert_array_equal(bits32(got), bits32(ref[:255]))
    assert np.isnan(ref[255])
    assert bits32(got[0]) == 0x00400000  # 2^-127 is a subnormal, not zero
    assert got[0] == 2.0**-127 and got[127] == 1.0 and got[254] == 2.0**127


def test_e8m0_nan_refused():
    with raises_named("layers.7.ffn.experts.3.w1.scale"):
        F.decode_e8m0(np.array([127, 0xFF], np.uint8), "layers.7.ffn.experts.3.w1.scale")


def test_decoders_refuse_wrong_dtype_naming_tensor():
    with raises_named("wq.w"):
        F.decode_e4m3(np.zeros(4, np.int16), "wq.w")
    with raises_named("wq.scale"):
        F.decode_e8m0(np.zeros(4, np.float32), "wq.scale")
    with raises_named("embed.weight"):
        F.decode_bf16(np.zeros(4, np.int32), "embed.weight")
    with raises_named("exp.w2"):
        F.unpack_e2m1(np.zeros(4, np.int16), "exp.w2")


def test_e2m1_all_codes_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(bits32(F.E2M1_VALUES), bits32(ref))
    # every byte: both nibbles through the pair LUT
    got = F.unpack_e2m1(ALL)
    np.testing.assert_array_equal(bits32(got[0::2]), bits32(ref[ALL & 15]))
    np.testing.assert_array_equal(bits32(got[1::2]), bits32(ref[ALL >> 4]))


def test_e2m1_nibble_order_low_is_even():
    # 0x71 = high 7 (6.0), low 1 (0.5); 0xA3 = high 0xA (-1.0), low 3 (1.5)
    got = F.unpack_e2m1(np.array([[0x71, 0xA3]], np.uint8))
    assert got.shape == (1, 4)
    assert got.tolist() == [[0.5, 6.0, 1.5, -1.0]]
    # int8 storage (official checkpoint) is the same bytes
    np.testing.assert_array_equal(got, F.unpack_e2m1(np.array([[0x71, 0xA3]], np.uint8).view(np.int8)))


def test_bf16_decode():
    u = np.array([0x3F80, 0xBF80, 0x0001, 0x7F80, 0xFF80, 0x7F7F, 0x8000], np.uint16)
    ref = u.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(bits32(F.decode_bf16(u)), bits32(ref))
    assert F.decode_bf16(u)[0] == 1.0 and bits32(F.decode_bf16(u))[2] == 0x00010000


# ---------------------------------------------------------------- dequantisation, hand-built


def test_dequant_mxfp4_known_values():
    out, n_in = 2, 64
    want = np.zeros((out, n_in), np.float32)
    codes = np.zeros((out, n_in), np.uint8)
    # row 0, block 0: element 0 = 0.5, element 1 = -6 ; scale 2^1
    codes[0, 0], codes[0, 1] = 1, 0xF
    # row 0, block 1: element 33 = 3 ; scale 2^-3
    codes[0, 33] = 5
    # row 1, block 1: element 63 = -1.5 ; scale byte 0 (2^-127): a subnormal product
    codes[1, 63] = 0xB
    scale = np.array([[128, 124], [127, 0]], np.uint8)
    want[0, 0], want[0, 1], want[0, 33] = 1.0, -12.0, 3 / 8
    want[1, 63] = np.float32(-1.5 * 2.0**-127)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    assert packed[0, 0] == 0xF1
    got = F.dequant_mxfp4(packed.view(np.int8), scale, "mtp.0.ffn.experts.0.w1.weight")
    assert got.shape == (out, n_in) and got.dtype == np.float32
    np.testing.assert_array_equal(bits32(got), bits32(want))
    assert got[1, 63] == -1.5 * 2.0**-127  # exact even in the float32 subnormal range


def test_dequant_mxfp4_matches_unpack_times_scale_random():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 8, 48), dtype=np.uint8)  # leading batch dim allowed
    scale = rng.integers(100, 140, (3, 8, 3), dtype=np.uint8)
    got = F.dequant_mxfp4(packed, scale, "w")
    vals = F.unpack_e2m1(packed).astype(np.float64)
    ref = vals * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)
    np.testing.assert_array_equal(got, ref.astype(np.float32))


def test_dequant_mxfp4_refusals_name_tensor():
    name = "layers.1.ffn.experts.9.w3.weight"
    p = np.zeros((4, 16), np.uint8)
    with raises_named(name):  # scale shape
        F.dequant_mxfp4(p, np.zeros((4, 2), np.uint8), name)
    with raises_named(name):  # in not a multiple of 32
        F.dequant_mxfp4(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8), name)
    with raises_named(name):  # NaN scale
        F.dequant_mxfp4(p, np.full((4, 1), 0xFF, np.uint8), name)
    with raises_named(name):  # wrong packed dtype
        F.dequant_mxfp4(p.astype(np.int16), np.zeros((4, 1), np.uint8), name)
    with raises_named(name):  # 1-D
        F.dequant_mxfp4(np.zeros(16, np.uint8), np.zeros(1, np.uint8), name)
    with raises_named(name):  # 6 * 2^127 overflows float32
        p2 = p.copy()
        p2[0, 0] = 0x07
        F.dequant_mxfp4(p2, np.full((4, 1), 254, np.uint8), name)


def test_dequant_nvfp4_known_values():
    out, n_in = 1, 32
    codes = np.zeros((out, n_in), np.uint8)
    codes[0, 0] = 0x7  # 6
    codes[0, 17] = 0xC  # -2
    codes[0, 31] = 0x3  # 1.5
    ws = F.encode_e4m3(np.array([[0.75, 2.0**-9]], np.float32))  # block scales (2nd subnormal)
    assert ws.tolist() == [[0x34, 0x01]]  # 0.75 = 1.5 * 2^-1: E=6, m=4
    ws2 = np.float32(2.0**-4)
    want = np.zeros((out, n_in), np.float32)
    want[0, 0] = 6 * 0.75 / 16
    want[0, 17] = -2 * 2.0**-9 / 16
    want[0, 31] = 1.5 * 2.0**-9 / 16
    got = F.dequant_nvfp4(F.pack_e2m1(codes), ws, ws2, "layers.5.ffn.experts.1.w2.weight")
    np.testing.assert_array_equal(got, want)
    # a non-power-of-two weight_scale_2: one float32 rounding of the exact e2m1*e4m3 product
    ws2b = np.array(0.3, np.float32)
    got = F.dequant_nvfp4(F.pack_e2m1(codes), ws, ws2b, "w")
    np.testing.assert_array_equal(got, (want * 16).astype(np.float32) * np.float32(0.3))


def test_dequant_nvfp4_random_single_rounding():
    # e2m1 * e4m3 is exact, so W must be the ONCE-rounded float32 of the exact triple product
    # (float64 holds it exactly: 2 + 4 + 24 significant bits); (e4m3 * ws2) first would round twice.
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (2, 16, 64), dtype=np.uint8)
    ws = rng.integers(0x08, 0x7F, (2, 16, 8), dtype=np.uint8)  # positive normal scales
    ws2 = np.float32(rng.uniform(1e-3, 1e-2))
    got = F.dequant_nvfp4(packed, ws, ws2, "w")
    ref = (F.unpack_e2m1(packed).astype(np.float64)
           * np.repeat(F.E4M3_VALUES[ws].astype(np.float64), 16, axis=-1) * np.float64(ws2))
    assert got.shape == (2, 16, 128) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref.astype(np.float32))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, -np.inf])
def test_dequant_nvfp4_weight_scale_2_refused(bad):
    name = "layers.2.ffn.experts.4.w1.weight"
    with raises_named(name):
        F.dequant_nvfp4(np.zeros((2, 8), np.uint8), np.full((2, 1), 0x38, np.uint8),
                        np.float32(bad), name)


def test_dequant_nvfp4_other_refusals_name_tensor():
    name = "layers.2.ffn.experts.4.w3.weight"
    p = np.zeros((2, 8), np.uint8)
    ok_ws = np.full((2, 1), 0x38, np.uint8)
    with raises_named(name):  # weight_scale shape
        F.dequant_nvfp4(p, np.full((2, 2), 0x38, np.uint8), np.float32(1), name)
    with raises_named(name):  # NaN block scale
        F.dequant_nvfp4(p, np.full((2, 1), 0x7F, np.uint8), np.float32(1), name)
    with raises_named(name):  # negative block scale
        F.dequant_nvfp4(p, np.full((2, 1), 0xB8, np.uint8), np.float32(1), name)
    with raises_named(name):  # weight_scale_2 not a scalar
        F.dequant_nvfp4(p, ok_ws, np.ones(2, np.float32), name)
    with raises_named(name):  # weight_scale_2 not representable in float32
        F.dequant_nvfp4(p, ok_ws, np.float64(0.1), name)
    with raises_named(name):  # in width not a multiple of 16
        F.dequant_nvfp4(np.zeros((2, 4), np.uint8), np.zeros((2, 0), np.uint8), np.float32(1), name)
    # -0 block scale (0x80) is accepted and yields zeros
    assert not F.dequant_nvfp4(p | 0x77, np.full((2, 1), 0x80, np.uint8), np.float32(1), "w").any()


def test_dequant_fp8_block_known_values():
    out, n_in = 130, 260  # ragged last blocks: scale [2, 3]
    w = np.zeros((out, n_in), np.uint8)
    w[0, 0] = 0x38  # 1.0
    w[129, 259] = 0xC0  # -2.0
    w[127, 128] = 0x7E  # 448
    w[128, 5] = 0x01  # 2^-9
    scale = np.array([[127, 100, 120], [130, 127, 126]], np.uint8)
    got = F.dequant_fp8_block(w, scale, "layers.0.attn.wkv.weight")
    want = np.zeros((out, n_in), np.float32)
    want[0, 0] = 1.0
    want[129, 259] = -2.0 * 2.0**-1
    want[127, 128] = 448 * 2.0**-27
    want[128, 5] = 2.0**-9 * 2.0**3
    np.testing.assert_array_equal(got, want)


def test_dequant_fp8_block_random_matches_formula():
    rng = np.random.default_rng(1)
    w = rng.integers(0, 256, (256, 384), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    s = rng.integers(110, 140, (2, 3), dtype=np.uint8)
    got = F.dequant_fp8_block(w, s, "w")
    ref = w.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.kron(
        2.0 ** (s.astype(np.float64) - 127), np.ones((128, 128)))
    np.testing.assert_array_equal(got, ref.astype(np.float32))


def test_dequant_fp8_block_refusals_name_tensor():
    name = "layers.4.attn.wo_b.weight"
    w = np.zeros((256, 128), np.uint8)
    with raises_named(name):  # scale shape (transposed)
        F.dequant_fp8_block(w, np.zeros((1, 2), np.uint8), name)
    with raises_named(name):  # scale shape (too many blocks)
        F.dequant_fp8_block(w, np.zeros((3, 1), np.uint8), name)
    with raises_named(name):  # NaN weight byte
        w2 = w.copy()
        w2[200, 3] = 0xFF
        F.dequant_fp8_block(w2, np.zeros((2, 1), np.uint8), name)
    with raises_named(name):  # NaN scale byte
        F.dequant_fp8_block(w, np.array([[127], [255]], np.uint8), name)
    with raises_named(name):  # 448 * 2^127 overflows
        w3 = w.copy()
        w3[0, 0] = 0x7E
        F.dequant_fp8_block(w3, np.full((2, 1), 254, np.uint8), name)
    with raises_named(name):  # not 2-D
        F.dequant_fp8_block(np.zeros(128, np.uint8), np.zeros(1, np.uint8), name)


_U8 = np.zeros((2, 16), np.uint8)
_REMAINING_REFUSALS = {
    "mxfp4 scale dtype": lambda n: F.dequant_mxfp4(_U8, np.zeros((2, 1), np.int8), n),
    "nvfp4 packed dtype": lambda n: F.dequant_nvfp4(_U8.astype(np.uint16), np.zeros((2, 2), np.uint8),
                                                    np.float32(1), n),
    "nvfp4 scale dtype": lambda n: F.dequant_nvfp4(_U8, np.zeros((2, 2), np.float32), np.float32(1), n),
    "nvfp4 1-D": lambda n: F.dequant_nvfp4(_U8[0], np.zeros(2, np.uint8), np.float32(1), n),
    "nvfp4 ws2 int": lambda n: F.dequant_nvfp4(_U8, np.zeros((2, 2), np.uint8), np.int32(1), n),
    "nvfp4 overflow": lambda n: F.dequant_nvfp4(_U8 | 0x07, np.full((2, 2), 0x7E, np.uint8),
                                                np.float32(2.0**127), n),
    "fp8 weight dtype": lambda n: F.dequant_fp8_block(_U8.view(np.int8), np.zeros((1, 1), np.uint8), n),
    "fp8 scale dtype": lambda n: F.dequant_fp8_block(_U8, np.zeros((1, 1), np.float32), n),
    "fp8 block size": lambda n: F.dequant_fp8_block(_U8, np.zeros((1, 1), np.uint8), n, block=0),
    "unpack 0-d": lambda n: F.unpack_e2m1(np.uint8(3), n),
    "pack 0-d": lambda n: F.pack_e2m1(np.uint8(3), n),
}


@pytest.mark.parametrize("case", sorted(_REMAINING_REFUSALS))
def test_remaining_refusals_name_tensor(case):
    name = f"layers.42.{case.replace(' ', '_')}"
    with raises_named(name):
        _REMAINING_REFUSALS[case](name)


# ---------------------------------------------------------------- encoders


def test_encode_e4m3_round_trip_all_codes():
    vals = F.decode_e4m3(ALL[E4M3_OK], "t")
    np.testing.assert_array_equal(F.encode_e4m3(vals), ALL[E4M3_OK])
    np.testing.assert_array_equal(F.encode_e4m3(vals.astype(np.float64)), ALL[E4M3_OK])


def test_encode_e4m3_ties_and_sweep_vs_ml_dtypes():
    pos = F.E4M3_VALUES[:0x7F].astype(np.float64)
    mids = (pos[:-1] + pos[1:]) / 2  # exact halfway points (exact in float32)
    x = np.concatenate([mids, -mids]).astype(np.float32)
    ref = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(F.encode_e4m3(x), ref)
    # ties go to the even code
    assert (F.encode_e4m3(mids.astype(np.float32)) % 2 == 0).all()
    # dense sweep of float32 bit patterns in [0, 448]
    u = np.arange(0, int(bits32(448.0)) + 1, 1009, dtype=np.uint32)
    xs = u.view(np.float32)
    xs = np.concatenate([xs, -xs])
    np.testing.assert_array_equal(F.encode_e4m3(xs), xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_encode_e4m3_saturates_never_nan():
    x = np.array([448, 463.9, 464, 470, 1e6, np.inf, -470, -np.inf, 3e38], np.float32)
    assert F.encode_e4m3(x).tolist() == [0x7E] * 6 + [0xFE] * 2 + [0x7E]
    with raises_named("act.x"):
        F.encode_e4m3(np.array([1.0, np.nan], np.float32), "act.x")


def test_encode_e2m1_ties_and_grid():
    x = np.array([2.5, 3.5, 5, 0.25, 0.75, 1.25, 1.75, 7, 100, -2.5, -0.1, 0], np.float32)
    got = F.encode_e2m1(x)
    assert F.E2M1_VALUES[got].tolist() == [2, 4, 4, 0, 1, 1, 2, 6, 6, -2, -0.0, 0]
    assert got[10] == 8  # -0.1 rounds to -0, code 8
    # all 16 grid values round-trip
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(F.encode_e2m1(F.E2M1_VALUES), codes)
    # vs ml_dtypes (which also saturates for e2m1) on a dense sweep
    xs = np.linspace(-8, 8, 4097, dtype=np.float32)
    np.testing.assert_array_equal(
        F.encode_e2m1(xs), xs.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)
    with raises_named("fp4.in"):
        F.encode_e2m1(np.array([np.nan]), "fp4.in")


def test_pack_e2m1_round_trip_and_refusals():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (5, 64), dtype=np.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.shape == (5, 32) and packed.dtype == np.uint8
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    np.testing.assert_array_equal(F.unpack_e2m1(packed), F.E2M1_VALUES[codes])
    with raises_named("exp.w"):
        F.pack_e2m1(np.zeros((2, 3), np.uint8), "exp.w")
    with raises_named("exp.w"):
        F.pack_e2m1(np.array([1, 16], np.int32), "exp.w")
    with raises_named("exp.w"):
        F.pack_e2m1(np.array([0.0, 1.0]), "exp.w")


def test_encode_bf16_vs_ml_dtypes_random_and_edges():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([
        0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x0000FFFF,  # subnormals
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties: to even (down / up), near ties
        0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,  # largest finite, round to inf
        0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,  # inf, NaNs (incl. sNaN)
    ], np.uint32)
    x = np.concatenate([u, edges]).view(np.float32)
    got = F.encode_bf16(x)
    with np.errstate(invalid="ignore"):
        ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    assert np.isnan(F.decode_bf16(got[nan])).all()
    np.testing.assert_array_equal(got[nan] >> 15, bits32(x[nan]) >> 31)  # sign kept
    assert F.encode_bf16(np.array([1 + 2.0**-8 + 2.0**-30]))[0] == 0x3F81  # float64: no double rounding


def test_encode_bf16_refuses_other_dtypes():
    with raises_named("h.x"):
        F.encode_bf16(np.zeros(3, np.float16), "h.x")


def test_encode_e8m0_round_trip_and_refusals():
    vals = F.decode_e8m0(ALL[:255], "s")
    np.testing.assert_array_equal(F.encode_e8m0(vals), ALL[:255])
    np.testing.assert_array_equal(F.encode_e8m0(vals.astype(np.float64)), ALL[:255])
    for bad in [3.0, 0.0, -1.0, np.nan, np.inf, 2.0**128, 2.0**-128, 0.75]:
        with raises_named("blk.scale"):
            F.encode_e8m0(np.array([1.0, bad]), "blk.scale")


def test_f32_to_bf16_exact():
    x = F.decode_bf16(np.array([0x3F80, 0x0001, 0xC2F7, 0x8000], np.uint16))
    np.testing.assert_array_equal(F.f32_to_bf16_exact(x, "n.w"), [0x3F80, 0x0001, 0xC2F7, 0x8000])
    np.testing.assert_array_equal(F.f32_to_bf16_exact(x.astype(np.float64), "n.w"),
                                  [0x3F80, 0x0001, 0xC2F7, 0x8000])
    with pytest.raises(FormatError) as ei:
        F.f32_to_bf16_exact(np.array([1.0, 1.0, 1 + 2.0**-9, 3.0, 1 + 2.0**-20], np.float32),
                            "layers.0.attn_norm.weight")
    msg = str(ei.value)
    assert "layers.0.attn_norm.weight" in msg and "2 values" in msg and "flat index 2" in msg
    assert "1.001953125" in msg
    with raises_named("a.b"):  # float64 value not even float32
        F.f32_to_bf16_exact(np.array([1 + 2.0**-40]), "a.b")
    for bad in [np.nan, np.inf, -np.inf]:
        with raises_named("norm.weight"):
            F.f32_to_bf16_exact(np.array([1.0, bad], np.float32), "norm.weight")
    with raises_named("norm.weight"):
        F.f32_to_bf16_exact(np.zeros(2, np.int32), "norm.weight")


def test_storage_dtypes():
    assert F.DTYPE_ITEMSIZE == {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1,
                                "F8_E8M0": 1, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
                                "BOOL": 1}
    assert F.numpy_storage_dtype("BF16") == np.dtype("<u2")
    assert F.numpy_storage_dtype("F8_E4M3") == np.uint8
    assert F.numpy_storage_dtype("F8_E8M0") == np.uint8
    assert F.numpy_storage_dtype("I8") == np.int8
    assert F.numpy_storage_dtype("I64") == np.dtype("<i8")
    for k, n in F.DTYPE_ITEMSIZE.items():
        assert F.numpy_storage_dtype(k).itemsize == n
    with raises_named("mtp.0.x"):
        F.numpy_storage_dtype("F8_E5M2", "mtp.0.x")


# ---------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 64),
                  elements=st.floats(-448, 448, width=32, allow_subnormal=True)))
def test_encode_e4m3_matches_ml_dtypes_property(x):
    np.testing.assert_array_equal(F.encode_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 3).map(lambda k: 16 * k))),
       st.integers(0, 252))
def test_mxfp4_pack_dequant_round_trip_property(packed, sbyte):
    # e8m0 <= 252 keeps 6 * 2^125 finite; dequant then re-encode must give back the same bytes
    # (the scale is a positive power of two, so even the sign of zero survives).
    scale = np.full((packed.shape[0], packed.shape[1] // 16), sbyte, np.uint8)
    w = F.dequant_mxfp4(packed, scale, "w")
    s = np.float64(2.0) ** (sbyte - 127)
    np.testing.assert_array_equal(F.pack_e2m1(F.encode_e2m1(w.astype(np.float64) / s)), packed)
