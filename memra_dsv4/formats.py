"""Exact decoders and encoders of the number formats stored in DeepSeek-V4-Flash checkpoints.

Contract
--------
* Every decoder is exact: it maps stored bytes to the float32 value the format defines, through
  256-entry lookup tables, vectorised over the whole array. No decoder rounds.
* Every problem with stored data (a NaN code, a scale of the wrong shape, a dequantised value
  that overflows float32, a wrong storage dtype) raises ``FormatError`` (a ``ValueError``) whose
  message names the tensor (the ``name`` argument) and the problem, with the count and first
  flat index of the offending elements where that applies. Nothing is silently repaired.
* Encoders (used to build synthetic checkpoints and by the host quantisation rules) round to
  nearest, ties to even, directly from the input precision (float32 or float64; no double
  rounding through an intermediate format).

Formats (reference: dsv4_model_and_formats.md sections 9.4 and 10)
-------------------------------------------------------------------
* F8_E4M3 (e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; E=0 is subnormal
  (m * 2^-9); 0x7F / 0xFF are NaN; no infinities; max 448 (0x7E).
* F8_E8M0 (e8m0fnu): unsigned exponent, value 2^(b-127); b=0 is 2^-127 (NOT zero; float32 bits
  0x00400000, a subnormal); 0xFF is NaN.
* BF16: the top 16 bits of a float32.
* E2M1 nibble: bit 3 sign, magnitudes of codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6. Two nibbles per
  byte: the LOW nibble is the even (first) element, the HIGH nibble the odd one.
* MXFP4 weight: packed e2m1 [.., out, in/2] + e8m0 scale [.., out, in/32].
* NVFP4 weight (modelopt): packed e2m1 [.., out, in/2] + e4m3 block scale [.., out, in/16] +
  float32 scalar ``weight_scale_2``.
* FP8 block weight: e4m3 [out, in] + e8m0 scale [ceil(out/128), ceil(in/128)].
  ``dequant_fp8_block_bf16`` is its exact bf16 form (the GPU loader's check, and the twin of
  kernels_cu/dense.cu); ``fp8_block_exact_in_bf16`` is the same acceptance test on byte tables.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FormatError",
    "DTYPE_ITEMSIZE",
    "numpy_storage_dtype",
    "E4M3_MAX",
    "E2M1_MAX",
    "BF16_MAX",
    "E4M3_VALUES",
    "E8M0_VALUES",
    "E2M1_VALUES",
    "decode_e4m3",
    "decode_e8m0",
    "decode_bf16",
    "unpack_e2m1",
    "dequant_mxfp4",
    "dequant_nvfp4",
    "dequant_fp8_block",
    "dequant_fp8_block_bf16",
    "fp8_block_exact_in_bf16",
    "round_minifloat",
    "encode_e4m3",
    "encode_e2m1",
    "pack_e2m1",
    "encode_bf16",
    "encode_e8m0",
    "f32_to_bf16_exact",
]


class FormatError(ValueError):
    """Stored data (or data about to be stored) violates its format; the message names the tensor."""


# ----------------------------------------------------------------------------------------------
# safetensors dtypes
# ----------------------------------------------------------------------------------------------

DTYPE_ITEMSIZE: dict[str, int] = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}

# safetensors data is little-endian; the storage dtypes say so explicitly so that a view of raw
# bytes is correct on any host. Formats NumPy has no native type for (BF16, F8_*) are viewed as
# unsigned integers of the same width and decoded with the functions below.
_STORAGE_DTYPE: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}
assert all(_STORAGE_DTYPE[k].itemsize == v for k, v in DTYPE_ITEMSIZE.items())


def numpy_storage_dtype(st_dtype: str, name: str = "<tensor>") -> np.dtype:
    """NumPy dtype used to view the raw bytes of a safetensors tensor of dtype ``st_dtype``."""
    try:
        return _STORAGE_DTYPE[st_dtype]
    except KeyError:
        raise FormatError(
            f"{name}: unsupported safetensors dtype {st_dtype!r} "
            f"(known: {', '.join(sorted(_STORAGE_DTYPE))})"
        ) from None


# ----------------------------------------------------------------------------------------------
# Lookup tables
# ----------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
E2M1_MAX = 6.0
BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))  # 3.3895314e38


def _build_e4m3_lut() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> 3) & 15
    m = b & 7
    mag = np.where(e == 0, m * 2.0**-9, (8 + m) * np.ldexp(1.0, e - 10))
    lut = (sign * mag).astype(np.float32)
    lut[[0x7F, 0xFF]] = np.nan
    return lut


def _build_e8m0_lut() -> np.ndarray:
    # b << 23 is the float32 bit pattern of 2^(b-127) for 1 <= b <= 254; b = 0 is the subnormal
    # 2^-127 (only the mantissa's top bit set). 0xFF is NaN.
    bits = np.arange(256, dtype=np.uint32) << 23
    bits[0] = 0x00400000
    bits[255] = 0x7FC00000
    return bits.view(np.float32)


E4M3_VALUES: np.ndarray = _build_e4m3_lut()  # [256] float32, NaN at 0x7F/0xFF
E8M0_VALUES: np.ndarray = _build_e8m0_lut()  # [256] float32, NaN at 0xFF
E2M1_VALUES: np.ndarray = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
# Byte -> (even element, odd element): low nibble first (convert.py / torch float4_e2m1fn_x2).
_E2M1_PAIR_LUT: np.ndarray = np.stack(
    [E2M1_VALUES[np.arange(256) & 15], E2M1_VALUES[np.arange(256) >> 4]], axis=-1
)
# Non-negative grid values, increasing with the code (codes 0x00..0x7E / 0..7 are monotone), so
# an encoder finds a rounded magnitude's code by binary search.
_E4M3_POS = E4M3_VALUES[:0x7F].astype(np.float64)
_E2M1_POS = E2M1_VALUES[:8].astype(np.float64)
_E2M1_PAIR_LUT64: np.ndarray = _E2M1_PAIR_LUT.astype(np.float64)
# e8m0 bytes >= this can make an MXFP4 value overflow float32: 6 * 2^(252 - 127) = 1.5 * 2^127 is
# finite, 4 * 2^(253 - 127) = 2^128 is not.  Below it the finiteness pass is skipped (no value
# can be inf), which changes no result.
_MXFP4_SCALE_MAY_OVERFLOW = 253
for _t in (E4M3_VALUES, E8M0_VALUES, E2M1_VALUES, _E2M1_PAIR_LUT, _E2M1_PAIR_LUT64):
    _t.flags.writeable = False


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _first_bad(mask: np.ndarray) -> tuple[int, int]:
    flat = np.flatnonzero(mask.reshape(-1))
    return int(flat.size), int(flat[0]) if flat.size else -1


def _refuse(mask: np.ndarray, name: str, what: str, arr: np.ndarray | None = None) -> None:
    """Raise FormatError if any element of ``mask`` is set: count, first flat index and value."""
    if not mask.any():
        return
    count, first = _first_bad(mask)
    detail = ""
    if arr is not None:
        v = arr.reshape(-1)[first]
        detail = f", value 0x{int(v):02X}" if arr.dtype.kind in "ui" else f", value {float(v)!r}"
    raise FormatError(
        f"{name}: {count} {what} (of {mask.size}; first at flat index {first}{detail})"
    )


def _as_u8(a, name: str, what: str, allow_i8: bool = False) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    if allow_i8 and a.dtype == np.int8:
        return a.view(np.uint8)  # the official checkpoint stores packed FP4 as I8
    raise FormatError(f"{name}: {what} must be uint8{' or int8' if allow_i8 else ''}, got {a.dtype}")


def _check_finite(w: np.ndarray, name: str) -> np.ndarray:
    _refuse(~np.isfinite(w), name, "dequantised values overflow float32", None)
    return w


def _fp4_scale_shape(packed: np.ndarray, scale: np.ndarray, name: str, fmt: str, block: int,
                     scale_label: str) -> tuple[int, tuple[int, ...]]:
    """(input width, block-scale shape) of a packed FP4 weight; refuses a layout that disagrees."""
    if packed.ndim < 2:
        raise FormatError(f"{name}: packed {fmt} weight must be at least 2-D, got {packed.shape}")
    n_in = 2 * packed.shape[-1]
    if n_in % block:
        raise FormatError(f"{name}: {fmt} input width {n_in} is not a multiple of {block}")
    want = (*packed.shape[:-1], n_in // block)
    if scale.shape != want:
        raise FormatError(f"{name}: {fmt} {scale_label} shape {scale.shape}, expected {want}")
    return n_in, want


# ----------------------------------------------------------------------------------------------
# Decoders
# ----------------------------------------------------------------------------------------------


def decode_e4m3(u8, name: str) -> np.ndarray:
    """F8_E4M3 (e4m3fn) bytes -> float32, exact. The NaN codes 0x7F/0xFF are refused."""
    u8 = _as_u8(u8, name, "F8_E4M3 data")
    _refuse((u8 & 0x7F) == 0x7F, name, "F8_E4M3 NaN codes (0x7F/0xFF)", u8)
    return np.take(E4M3_VALUES, u8)


def decode_e8m0(u8, name: str) -> np.ndarray:
    """F8_E8M0 (e8m0fnu) bytes -> float32 2^(b-127), exact; b=0 is 2^-127, 0xFF (NaN) refused."""
    u8 = _as_u8(u8, name, "F8_E8M0 data")
    _refuse(u8 == 0xFF, name, "F8_E8M0 NaN codes (0xFF)", u8)
    return E8M0_VALUES[u8]


def decode_bf16(u16, name: str = "<bf16 tensor>") -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 (bits << 16), exact; NaN/inf pass through."""
    u16 = np.asarray(u16)
    if u16.dtype != np.uint16:
        raise FormatError(f"{name}: BF16 data must be uint16 bit patterns, got {u16.dtype}")
    return (u16.astype(np.uint32) << 16).view(np.float32)


def unpack_e2m1(u8, name: str = "<packed e2m1>", dtype=np.float32) -> np.ndarray:
    """Packed e2m1 [..., n/2] (uint8 or int8) -> float32 [..., n]; low nibble = even element.
    ``dtype=np.float64`` gives the same (exact) values as float64."""
    u8 = _as_u8(u8, name, "packed E2M1 data", allow_i8=True)
    if u8.ndim == 0:
        raise FormatError(f"{name}: packed E2M1 data must have at least one dimension")
    lut = _E2M1_PAIR_LUT64 if np.dtype(dtype) == np.float64 else _E2M1_PAIR_LUT
    # np.take of whole LUT rows: the same values as lut[u8], 2-3x faster on large arrays.
    return np.take(lut, u8, axis=0).reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def dequant_mxfp4(packed_u8, scale_u8, name: str, dtype=np.float32) -> np.ndarray:
    """MXFP4 [.., out, in/2] packed e2m1 + e8m0 scale [.., out, in/32] -> float32 [.., out, in].

    W[o, k] = e2m1(nibble(o, k)) * 2^(S[o, k // 32] - 127). Both factors are powers of two times
    at most 2 significant bits, so the float32 product is exact unless it overflows (refused).
    ``dtype=np.float64``: the same exact values (and the same refusals) held as float64, without
    the float32 intermediate (a GEMM that accumulates in float64 takes them as they are).
    """
    packed = _as_u8(packed_u8, name, "packed MXFP4 weight", allow_i8=True)
    scale = _as_u8(scale_u8, f"{name} (scale)", "MXFP4 scale")
    n_in, want = _fp4_scale_shape(packed, scale, name, "MXFP4", 32, "scale")
    wide = np.dtype(dtype) == np.float64
    if not wide and np.dtype(dtype) != np.float32:
        raise FormatError(f"{name}: dequant_mxfp4 dtype must be float32 or float64, got {dtype}")
    s = decode_e8m0(scale, f"{name} (scale)")
    w = unpack_e2m1(packed, name, dtype).reshape(*want, 32)   # a fresh array: scaled in place
    with np.errstate(over="ignore"):  # overflow is detected and refused just below
        w *= (s.astype(np.float64) if wide else s)[..., None]
    w = w.reshape(*packed.shape[:-1], n_in)
    if scale.size and int(scale.max()) >= _MXFP4_SCALE_MAY_OVERFLOW:
        # float64 products are exact; float32 rounds exactly those >= 2^128 to inf
        with np.errstate(over="ignore"):
            _check_finite(w.astype(np.float32) if wide else w, name)
    return w


def dequant_nvfp4(packed_u8, weight_scale_u8, weight_scale_2, name: str,
                  dtype=np.float32) -> np.ndarray:
    """NVFP4 (modelopt) -> float32 [.., out, in].

    W[o, k] = e2m1(nibble(o, k)) * e4m3(weight_scale[o, k // 16]) * weight_scale_2.
    e2m1 * e4m3 is exact in float32 (2 x 4 significant bits); the product with the float32
    ``weight_scale_2`` is then rounded once (exact when it is a power of two, as in the released
    checkpoint). ``weight_scale_2`` must be a finite float32 scalar > 0, and block scales must be
    non-negative: both are derived from amax, so anything else means a misread tensor.
    ``dtype=np.float64``: the same float32 values held as float64 (computed directly in float64
    when ``weight_scale_2`` is a power of two 2^m, |m| <= 116, where every float32 product is
    exact: no rounding, no underflow, no overflow; otherwise the float32 result widened).
    """
    packed = _as_u8(packed_u8, name, "packed NVFP4 weight", allow_i8=True)
    wsb = _as_u8(weight_scale_u8, f"{name} (weight_scale)", "NVFP4 weight_scale")
    n_in, want = _fp4_scale_shape(packed, wsb, name, "NVFP4", 16, "weight_scale")
    ws2 = np.asarray(weight_scale_2)
    if ws2.size != 1 or ws2.ndim > 1 or ws2.dtype.kind != "f":
        raise FormatError(
            f"{name}: weight_scale_2 must be a float scalar, got dtype {ws2.dtype} shape {ws2.shape}"
        )
    ws2_32 = np.float32(ws2.reshape(()))
    if not (np.isfinite(ws2_32) and ws2_32 > 0) or float(ws2_32) != float(ws2.reshape(())):
        raise FormatError(
            f"{name}: weight_scale_2 = {float(ws2.reshape(()))!r} is not a finite float32 > 0"
        )
    _refuse(
        (wsb & 0x80).astype(bool) & (wsb != 0x80),
        f"{name} (weight_scale)",
        "negative NVFP4 block scales",
        wsb,
    )
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise FormatError(f"{name}: dequant_nvfp4 dtype must be float32 or float64, got {dtype}")
    s = decode_e4m3(wsb, f"{name} (weight_scale)")
    mant, exp2 = np.frexp(np.float64(ws2_32))
    if np.dtype(dtype) == np.float64 and mant == 0.5 and -116 <= exp2 - 1 <= 116:
        # |e2m1 * e4m3| in {0} U [2^-10, 2688] with <= 6 significant bits, times 2^m: exact in
        # float32 (normal, finite), so the float64 product is the float32 value.
        w = unpack_e2m1(packed, name, np.float64).reshape(*want, 16)
        w *= s.astype(np.float64)[..., None]
        w *= np.float64(ws2_32)
        return w.reshape(*packed.shape[:-1], n_in)
    vals = unpack_e2m1(packed, name).reshape(*want, 16)
    with np.errstate(over="ignore"):  # overflow is detected and refused just below
        w = ((vals * s[..., None]) * ws2_32).reshape(*packed.shape[:-1], n_in)
    w = _check_finite(w.astype(np.float32, copy=False), name)
    return w.astype(np.float64) if np.dtype(dtype) == np.float64 else w


def dequant_fp8_block(w_u8, scale_u8, name: str, block: int = 128) -> np.ndarray:
    """FP8 e4m3 weight [out, in] + e8m0 scale [ceil(out/b), ceil(in/b)] -> float32 [out, in].

    W[o, i] = e4m3(Wq[o, i]) * 2^(S[o // b, i // b] - 127); the scale is a multiplier. Exact in
    float32 (the scale is a power of two) unless the product overflows (refused).
    """
    w = _as_u8(w_u8, name, "F8_E4M3 weight")
    scale = _as_u8(scale_u8, f"{name} (scale)", "F8_E8M0 block scale")
    if w.ndim != 2:
        raise FormatError(f"{name}: FP8 block weight must be 2-D, got shape {w.shape}")
    if block <= 0:
        raise FormatError(f"{name}: block size must be positive, got {block}")
    out, n_in = w.shape
    want = (-(-out // block), -(-n_in // block))
    if scale.shape != want:
        raise FormatError(
            f"{name}: FP8 block scale shape {scale.shape}, expected {want} for weight "
            f"{w.shape} with {block}x{block} blocks"
        )
    s = decode_e8m0(scale, f"{name} (scale)")
    wv = decode_e4m3(w, name)
    s_full = np.repeat(np.repeat(s, block, axis=0)[:out], block, axis=1)[:, :n_in]
    with np.errstate(over="ignore"):  # overflow is detected and refused just below
        w = wv * s_full
    return _check_finite(w, name)


def dequant_fp8_block_bf16(w_u8, scale_u8, name: str, block: int = 128) -> np.ndarray:
    """FP8 block weight -> BF16 bits (uint16) [out, in], exact: ``dequant_fp8_block`` then
    ``f32_to_bf16_exact``. Refused (naming ``name``): a NaN e4m3 code, an e8m0 0xFF, a wrong
    scale shape, a product that overflows, or one bf16 cannot hold exactly (products below the
    bf16 normal range that lose bits, e.g. a subnormal e4m3 code times 2^-127).
    The twin of kernels_cu/dense.cu dequant_fp8_bf16 on the accepted domain.
    """
    return f32_to_bf16_exact(dequant_fp8_block(w_u8, scale_u8, name, block), name)


def _build_fp8_bf16_ok() -> np.ndarray:
    # [e8m0 byte, e4m3 code & 0x7F] -> the product is a finite float32 with zero low 16 bits,
    # computed exactly as dequant_fp8_block_bf16 computes it (float32 LUT values, one multiply).
    with np.errstate(over="ignore", invalid="ignore"):
        prod = E8M0_VALUES[:, None] * E4M3_VALUES[None, :0x80]
    ok = np.isfinite(prod) & ((prod.view(np.uint32) & 0xFFFF) == 0)
    ok[:, 0x7F] = False
    ok[0xFF, :] = False
    return ok


_FP8_BF16_OK: np.ndarray = _build_fp8_bf16_ok()      # [256, 128] bool
_FP8_BF16_ALL_OK: np.ndarray = _FP8_BF16_OK[:, :0x7F].all(axis=1)   # [256]: every non-NaN code ok
_FP8_BF16_OK.flags.writeable = False
_FP8_BF16_ALL_OK.flags.writeable = False


def fp8_block_exact_in_bf16(w_u8, scale_u8, block: int = 128) -> bool:
    """True iff ``dequant_fp8_block_bf16(w_u8, scale_u8, ...)`` would accept the tensor, decided
    on the bytes (no float array): dtypes and scale shape, no NaN code, no e8m0 0xFF, and for the
    blocks whose scale can make some code inexact in bf16 (e8m0 < 3 or > 246), a per-element
    table lookup. For the loader's fast path; on False, call dequant_fp8_block_bf16 for the
    error message. tests/test_weights_fp8.py checks the equivalence on every (code, scale) pair.
    """
    w = np.asarray(w_u8)
    scale = np.asarray(scale_u8)
    if w.dtype != np.uint8 or scale.dtype != np.uint8 or w.ndim != 2 or block <= 0:
        return False
    out, n_in = w.shape
    if scale.shape != (-(-out // block), -(-n_in // block)):
        return False
    if (scale == 0xFF).any() or (np.bitwise_and(w, 0x7F) == 0x7F).any():
        return False
    for i in np.flatnonzero(~_FP8_BF16_ALL_OK[scale].all(axis=1)):   # block rows to look at
        rows = np.bitwise_and(w[i * block:(i + 1) * block], 0x7F)
        s_row = np.repeat(scale[i], block)[:n_in]
        if not _FP8_BF16_OK[s_row[None, :], rows].all():
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Rounding and encoders
# ----------------------------------------------------------------------------------------------


def round_minifloat(x, mbits: int, emin: int, maxval: float, overflow: str) -> np.ndarray:
    """Round float32/float64 ``x`` to nearest-even on a binary float grid; returns x's dtype.

    The grid has ``mbits`` explicit mantissa bits, minimum normal exponent ``emin`` (subnormals
    below it with quantum 2^(emin - mbits)) and largest finite value ``maxval``. The rounding is
    done directly in the input precision: the quantum q = 2^(max(floor(log2|x|), emin) - mbits)
    is a power of two, so x / q is exact, np.rint rounds it half-to-even and * q is exact again.
    Results beyond ``maxval`` become +-``maxval`` (``overflow="saturate"``) or +-inf
    (``overflow="inf"``, IEEE behaviour, e.g. bf16). NaN propagates; +-0 keeps its sign.
    """
    x = np.asarray(x)
    assert x.dtype in (np.float32, np.float64), f"round_minifloat: float32/64 expected, got {x.dtype}"
    assert overflow in ("saturate", "inf"), overflow
    with np.errstate(over="ignore", invalid="ignore"):
        _, e = np.frexp(x)  # |x| = m * 2^e with m in [0.5, 1): floor(log2|x|) = e - 1
        e = np.maximum(e.astype(np.int32) - 1, emin)
        q = np.ldexp(np.ones(e.shape, dtype=x.dtype), e - mbits)
        r = np.rint(x / q) * q  # may overflow to inf for float32 near 2^128: that is RNE
        r = np.asarray(r, dtype=x.dtype)
        big = np.abs(r) > maxval
        if big.any():
            fill = maxval if overflow == "saturate" else np.inf
            r = np.where(big, np.copysign(np.asarray(fill, dtype=x.dtype), r), r)
    return r


def _encode_on_grid(x, name: str, fmt: str, mbits: int, emin: int, maxval: float,
                    pos: np.ndarray, sign_bit: int) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    _refuse(np.isnan(x), name, f"NaN values cannot be encoded as {fmt}", x)
    r = round_minifloat(x, mbits, emin, maxval, "saturate")
    code = np.searchsorted(pos, np.abs(r).astype(np.float64))
    assert np.array_equal(pos[code], np.abs(r)), f"{fmt} encoder: rounded value not on grid"
    return (code | np.where(np.signbit(r), sign_bit, 0)).astype(np.uint8)


def encode_e4m3(x, name: str = "<e4m3 values>") -> np.ndarray:
    """float -> F8_E4M3 (e4m3fn) bytes, round-to-nearest-even, SATURATING at +-448.

    Saturation (not NaN) is chosen because it is what the reference quantiser does: it clamps to
    +-448 before the cast, so an encoder that saturated differently could never agree with it.
    +-inf encode as +-448 (0x7E/0xFE). NaN input is refused; a NaN code is never produced.
    -0.0 encodes as 0x80.
    """
    return _encode_on_grid(x, name, "F8_E4M3", 3, -6, E4M3_MAX, _E4M3_POS, 0x80)


def encode_e2m1(x, name: str = "<e2m1 values>") -> np.ndarray:
    """float -> e2m1 codes 0..15 (uint8, unpacked), RNE on the grid, clamped to +-6; NaN refused."""
    return _encode_on_grid(x, name, "E2M1", 1, 0, E2M1_MAX, _E2M1_POS, 0x8)


def pack_e2m1(codes, name: str = "<e2m1 codes>") -> np.ndarray:
    """e2m1 codes [..., n] (0..15) -> packed uint8 [..., n/2]; element 2j low nibble, 2j+1 high."""
    codes = np.asarray(codes)
    if codes.dtype.kind not in "ui":
        raise FormatError(f"{name}: e2m1 codes must be integers, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise FormatError(f"{name}: e2m1 code count along the last axis must be even, got {codes.shape}")
    _refuse((codes < 0) | (codes > 15), name, "e2m1 codes outside 0..15", codes)
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def encode_bf16(x, name: str = "<bf16 values>") -> np.ndarray:
    """float32/float64 -> BF16 bit patterns (uint16), round-to-nearest-even.

    float32: the kernel bit trick u += 0x7FFF + ((u >> 16) & 1); u >>= 16 (overflow rounds to inf,
    as IEEE RNE does). float64: rounded directly to bf16 precision (round_minifloat), not through
    float32, so there is no double rounding; the result is then exact in float32. NaN -> quiet NaN
    with the sign kept.
    """
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = round_minifloat(x, 7, -126, BF16_MAX, "inf").astype(np.float32)
    elif x.dtype != np.float32:
        raise FormatError(f"{name}: encode_bf16 takes float32 or float64, got {x.dtype}")
    u = x.view(np.uint32).astype(np.uint64)  # 64-bit so the add cannot wrap
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x)
    if nan.any():
        r = np.where(nan, (u >> 16) | 0x0040, r)
    return r.astype(np.uint16)


def encode_e8m0(scale, name: str = "<e8m0 scale>") -> np.ndarray:
    """Exact powers of two in [2^-127, 2^127] -> F8_E8M0 bytes; anything else is refused."""
    s = np.asarray(scale)
    if s.dtype not in (np.float32, np.float64):
        s = s.astype(np.float64)
    m, e = np.frexp(s)
    ok = np.isfinite(s) & (m == 0.5)  # m == 0.5 exactly <=> positive power of two (and not 0)
    k = e.astype(np.int64) - 1
    ok &= (k >= -127) & (k <= 127)
    _refuse(~ok, name, "values are not powers of two in [2^-127, 2^127]", s)
    return (k + 127).astype(np.uint8)


def f32_to_bf16_exact(x, name: str) -> np.ndarray:
    """float32 (or float64) -> BF16 bits, refusing any value that bf16 rounding would change.

    Used where the checkpoint contract says a tensor is bf16 data held at higher precision: a value
    with non-zero low mantissa bits means the tensor is not what it claims to be. NaN/inf refused.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise FormatError(f"{name}: f32_to_bf16_exact takes float32/float64, got {x.dtype}")
    _refuse(~np.isfinite(x), name, "non-finite values (NaN/inf) cannot be stored as exact bf16", x)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    u = x32.view(np.uint32)
    inexact = (u & 0xFFFF) != 0
    if x.dtype == np.float64:
        inexact |= x32.astype(np.float64) != x
    _refuse(inexact, name, "values are not exactly representable in bf16", x)
    return (u >> 16).astype(np.uint16)
