"""The ALU e2m1 decode of kernels_cu/experts.cu (dot8) without a GPU.

dot8 decodes e2m1 nibbles by bit placement into f16x2 words: sign to bit 15 and the 3 magnitude
bits to bits 11..9 of each half, which is exactly e2m1 * 2^-14 as an f16 (code 1 = 2^-15, an f16
subnormal; cvt.f32.f16 is exact), and the x of those elements is staged times 2^14.  The default
build does this for the odd elements (FP4_ALU_ODD), FP4_ALU_EVEN=1 for all eight.  Checked here,
on the expressions as they stand in the source:
* every nibble code in every element position 0..7 of a 32-bit word (other nibbles random) gives
  the f16 of E2M1_VALUES[code] * 2^-14, sign of zero included (code 8 = -0.0, as the table's
  e2m1_to_f32(8) and formats.E2M1_VALUES);
* the products: table weight * x == ALU weight * (x * 2^14) as real numbers with the same sign of
  zero, for bf16 x from subnormals to 2^113, with f32 subnormal x flushed first (CuPy's NVRTC
  adds -ftz=true: FFMA.FTZ flushes x in the table path, FMUL.FTZ in the staging) or not.  An FMA
  result is a function of the exact product (its sign when zero) and the addend, so equal
  products make every FMA of the f32 chain, hence the whole chain, identical bit for bit.  The
  sign of a zero product matters only while the chain's running sum is itself zero (the chain
  starts from +0.0: -0 + +0 = +0, so a -0 product could only show as -0.0 if every addend so far
  was -0); it is the same sign in both forms, so nothing differs there either.  The premise:
  |x| < 2^114 (x * 2^14 stays finite; at 2^114 and beyond an inf * 0 could appear).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from memra_dsv4.formats import E2M1_VALUES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "kernels_cu", "experts.cu")

# "const u32 h04 = ((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u);" (elements 0 and 4)
_PAIR = re.compile(r"const u32 h(\d)(\d) = (\(\(w (?:<<|>>) \d+\) & 0x0e000e00u\) \| "
                   r"\((?:\(w << \d+\)|w) & 0x80008000u\));")


def _dot8_block(cond: str) -> str:
    src = open(SRC, encoding="utf-8").read()
    body = src[src.index("DEV float dot8("):]
    body = body[:body.index("\n}\n")]
    start = body.index(cond)
    end = min(i for i in (body.find("#elif", start + 1), body.find("#else", start + 1)) if i > 0)
    return body[start:end]


def _pairs(cond: str) -> dict[tuple[int, int], str]:
    """(lo element, hi element) -> the C expression of that f16x2 in dot8's `cond` branch."""
    return {(int(a), int(b)): e.replace("u)", ")") for a, b, e in _PAIR.findall(_dot8_block(cond))}


def _f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return h.astype(np.uint16).view(np.float16).astype(np.float32)


@pytest.mark.parametrize("cond,elements", [("#if FP4_ALU_EVEN", range(8)), ("#elif FP4_ALU_ODD", (1, 3, 5, 7))])
def test_bit_placement_is_e2m1_times_2m14(cond, elements):
    pairs = _pairs(cond)
    assert sorted(e for p in pairs for e in p) == sorted(elements), pairs
    rng = np.random.default_rng(7)
    want = (E2M1_VALUES.astype(np.float64) * 2.0 ** -14).astype(np.float32)
    for (lo, hi), expr in pairs.items():
        assert lo < 4 <= hi and hi == lo + 4, (lo, hi)  # one shift distance per pair
        for pos, half in ((lo, 0), (hi, 16)):
            for code in range(16):
                other = rng.integers(0, 2 ** 32, 64, dtype=np.uint64) & ~np.uint64(15 << (4 * pos))
                w = other | np.uint64(code << (4 * pos))
                h = np.asarray([eval(expr, {"w": int(v)}) for v in w], dtype=np.uint64)  # noqa: S307
                assert int(h.max()) < 2 ** 32
                got = _f16_bits_to_f32((h >> np.uint64(half)) & np.uint64(0xFFFF))
                assert np.array_equal(got.view(np.uint32), np.full(64, want[code]).view(np.uint32)), (
                    f"element {pos} code {code}: {got[:4]} != {want[code]} ({expr})")


def _bf16_sweep() -> np.ndarray:
    """Every bf16 with |x| < 2^114, zeros and subnormals included, as f32."""
    b = np.arange(1 << 16, dtype=np.uint32)
    x = (b << 16).view(np.float32)
    return x[np.isfinite(x) & (np.abs(x) < 2.0 ** 114)]


@pytest.mark.parametrize("ftz", [False, True])
def test_products_equal_the_table_products(ftz):
    x = _bf16_sweep()
    if ftz:  # FFMA.FTZ / FMUL.FTZ read an f32 subnormal as a zero of its sign
        sub = (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
        x = np.where(sub, np.copysign(np.float32(0.0), x), x).astype(np.float32)
    x14 = (x * np.float32(16384.0)).astype(np.float32)                 # the staging's FMUL
    assert np.array_equal(x14.astype(np.float64), x.astype(np.float64) * 16384.0)  # exact, finite
    tab = E2M1_VALUES.astype(np.float64)                               # e2m1_to_f32 (the table)
    alu = _f16_bits_to_f32(np.asarray([((c & 8) << 12) | ((c & 7) << 9) for c in range(16)])).astype(np.float64)
    for code in range(16):
        p_tab = tab[code] * x.astype(np.float64)      # exact: 2-bit x 8-bit significands
        p_alu = alu[code] * x14.astype(np.float64)
        assert np.array_equal(p_tab, p_alu), code
        assert np.array_equal(np.signbit(p_tab), np.signbit(p_alu)), code


def test_default_build_keeps_the_table_for_even_elements():
    """FP4_ALU_EVEN defaults to 0 (the measured default stays), and its branch has no LDS."""
    src = open(SRC, encoding="utf-8").read()
    assert re.search(r"#ifndef FP4_ALU_EVEN\n(?://.*\n)*#define FP4_ALU_EVEN 0\n", src)
    assert "lds_f32" not in _dot8_block("#if FP4_ALU_EVEN")
    assert "lds_f32" in _dot8_block("#elif FP4_ALU_ODD")
