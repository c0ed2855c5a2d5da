"""The FP4_PRMT e2m1 decode of kernels_cu/experts.cu (dot8's `#elif FP4_PRMT` branch) without a GPU.

FP4_PRMT=1 builds the same four f16x2 words as FP4_ALU_EVEN=1 (each half the f16 of
e2m1 * 2^-14: sign at bit 15, magnitude e1 e0 m at bits 11..9; x staged times 2^14), with
fewer instructions: the f16 high bytes of the odd elements are gathered into qo, of the even ones
into qe (byte k: element 2k+1 resp. 2k), then h04 / h15 = __byte_perm(q, 0, 0x2404) and
h26 / h37 = q & 0xff00ff00.  Checked here on the expressions as they stand in the source
(evaluated as 32-bit C arithmetic, __byte_perm as CUDA defines it):
* every nibble code in every element position 0..7 of a word (the other nibbles random) gives,
  in the right half of the right word, the f16 of E2M1_VALUES[code] * 2^-14 (-0.0 for code 8);
* each word equals FP4_ALU_EVEN's word of the same name bit for bit on random words, so the
  FP4_PRMT build has the weights, the products and the FMA chain of the FP4_ALU_EVEN build, which
  tests/test_fp4_alu_decode.py and the GPU test `-k alu_even` tie to the default build's bits;
* the FMA order of the branch is element order 0..7, as in every other branch.
"""

from __future__ import annotations

import re

import numpy as np

from memra_dsv4.formats import E2M1_VALUES
from test_fp4_alu_decode import SRC, _dot8_block  # tests/ on sys.path (pytest's prepend mode)

M32 = 0xFFFFFFFF




def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA __byte_perm: result byte n = byte (s >> 4n) & 7 of the 8-byte value y:x."""
    v = ((y & M32) << 32) | (x & M32)
    return sum(((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _c_to_py(expr: str) -> str:
    """A 32-bit C expression on u32 values to Python: drop the u suffixes, rename __byte_perm."""
    return re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", expr).replace("__byte_perm", "byte_perm")


def _words(cond: str) -> dict[str, str]:
    """name -> Python expression of every `const u32 NAME = EXPR;` of dot8's `cond` branch."""
    return {n: _c_to_py(e) for n, e in re.findall(r"const u32 (\w+) = ([^;]+);", _dot8_block(cond))}


def _eval_words(exprs: dict[str, str], w: int) -> dict[str, int]:
    """Evaluate in source order (later words use earlier ones), each truncated to 32 bits: a C
    left shift of a u32 drops the bits above 31; Python keeps them, but only bits below 32 matter
    after the masks and the truncation here (every shifted term is masked within 32 bits)."""
    out = {}
    for name, e in exprs.items():
        out[name] = eval(e, {"w": w, "byte_perm": byte_perm, **out}) & M32  # noqa: S307
    return out


def _f16_bits_to_f32(h: int) -> np.float32:
    return np.array([h], dtype=np.uint16).view(np.float16).astype(np.float32)[0]


WANT = (E2M1_VALUES.astype(np.float64) * 2.0 ** -14).astype(np.float32)
# element e -> (word, half): dot8 converts hAB to (wA low half, wB high half)
PLACES = {0: ("h04", 0), 4: ("h04", 16), 1: ("h15", 0), 5: ("h15", 16),
          2: ("h26", 0), 6: ("h26", 16), 3: ("h37", 0), 7: ("h37", 16)}


def test_branch_has_the_four_words_and_no_table():
    exprs = _words("#elif FP4_PRMT")
    assert {"h04", "h15", "h26", "h37"} <= set(exprs), exprs
    block = _dot8_block("#elif FP4_PRMT")
    assert "lds_f32" not in block
    # the words go to dot8_words in the order of their first elements (0, 1, 2, 3)
    assert "p = dot8_words(h04, h15, h26, h37, xf, p);" in block
    # whose FMA chain is in element order 0..7, each weight with its own x, the weight of element
    # i the half of the word that holds it (h04 -> w0 low, w4 high, ...)
    src = open(SRC, encoding="utf-8").read()
    body = src[src.index("DEV float dot8_words("):]
    body = body[:body.index("\n}\n")]
    assert re.findall(r"f16x2_to_f32\(h(\d)(\d), w(\d), w(\d)\);", body) == [
        ("0", "4", "0", "4"), ("1", "5", "1", "5"), ("2", "6", "2", "6"), ("3", "7", "3", "7")]
    fmas = re.findall(r"p = __fmaf_rn\(w(\d), xf\[(\d)\], p\);", body)
    assert fmas == [(str(i), str(i)) for i in range(8)], fmas


def test_every_code_in_every_position():
    exprs = _words("#elif FP4_PRMT")
    rng = np.random.default_rng(11)
    for pos in range(8):
        word, half = PLACES[pos]
        for code in range(16):
            for other in rng.integers(0, 2 ** 32, 48, dtype=np.uint64):
                w = (int(other) & ~(15 << (4 * pos)) & M32) | (code << (4 * pos))
                h = _eval_words(exprs, w)[word]
                got = _f16_bits_to_f32((h >> half) & 0xFFFF)
                assert got.view(np.uint32) == WANT[code].view(np.uint32), (
                    f"element {pos} code {code} w {w:#010x}: {got} != {WANT[code]} ({word})")


def test_words_equal_the_alu_even_words():
    prmt, even = _words("#elif FP4_PRMT"), _words("#if FP4_ALU_EVEN")
    rng = np.random.default_rng(12)
    ws = [int(v) for v in rng.integers(0, 2 ** 32, 4000, dtype=np.uint64)]
    ws += [0, M32, 0x88888888, 0x77777777, 0x0F0F0F0F, 0xF0F0F0F0, 0x12345678, 0x9ABCDEF0]
    for w in ws:
        a, b = _eval_words(prmt, w), _eval_words(even, w)
        for name in ("h04", "h15", "h26", "h37"):
            assert a[name] == b[name], f"{name} w {w:#010x}: FP4_PRMT {a[name]:#010x} != FP4_ALU_EVEN {b[name]:#010x}"


def test_byte_perm_model():
    """The model of __byte_perm the checks above rely on (CUDA Math API: selector nibble n picks
    byte n of the result from the 8 bytes {y, x}, x = bytes 0..3)."""
    assert byte_perm(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert byte_perm(0x33221100, 0x77665544, 0x7654) == 0x77665544
    assert byte_perm(0x33221100, 0, 0x2404) == 0x22000000
    assert byte_perm(0xDDCCBBAA, 0, 0x2404) == 0xCC00AA00


def test_default_build_turns_prmt_on_unless_another_decode_is_named():
    """FP4_PRMT defaults to 1 (measured faster, same bits), and to 0 when a build names
    FP4_ALU_EVEN=1 or FP4_ALU_ODD=0 (the alternatives stay buildable by their one macro)."""
    src = open(SRC, encoding="utf-8").read()
    assert re.search(r"#ifndef FP4_PRMT\n(?://.*\n)*#if FP4_ALU_EVEN \|\| \(defined\(FP4_ALU_ODD\) && !FP4_ALU_ODD\)\n"
                     r"#define FP4_PRMT 0\n#else\n#define FP4_PRMT 1\n#endif\n#endif", src)
