"""FP4_XRED (kernels_cu/experts.cu warp_sum_rows / KeptX) and FP4_E8M0_FMA, without a GPU.

warp_sum_rows<N> reduces the lane partials of N rows at once: at xor distance o = 16 >> l
(l < log2 N) the n = N >> l values are paired (i, i + n / 2), a lane with bit o set keeps the upper
value and sends the lower one, its partner the reverse, and each adds its kept value to what it
receives; after log2 N levels one value is left (row lane >> (5 - log2 N)), which finishes with
warp_sum's remaining xor levels.  Checked here on an emulation of that code (whose key lines are
matched against the source):
* symbolically: with f32 addition taken as commutative only (a + b == b + a, which IEEE addition
  is, FTZ, zero signs and the GPU's canonical NaN included), every lane's result is the same
  expression tree as warp_sum's for its row: the same pairs added at every level;
* warp_sum itself leaves the same tree (so the same bits) on every lane, so any lane of a row may
  keep it;
* numerically, on f32 values over a wide exponent range with both zero signs: bit for bit;
* the gate/up interleave (a_0, u_0, a_1, u_1, ...) plus one xor-(16 / R) shuffle gives every lane
  a_rr and u_rr of rr = lane / (32 / R), and KeptX's slots store every row of every group once,
  with the flushes after the same groups as Kept's (n & 31 == 31 or the last row).
FP4_E8M0_FMA's scale, fma(s, 0, s) with s the f32 of b << 23: modelled with FTZ on operands and
results (what FFMA.FTZ does), it gives the value the fold sees from e8m0_to_f32 for every byte
(the subnormal 2^-127 of b = 0 flushes to +0; 255 gives NaN).
FP4_E4M3_CVT: every finite e4m3 code is an exact normal f16 (or a signed zero), so the hardware
e4m3x2 -> f16x2 conversion and the exact f16 -> f32 give common.cuh's e4m3_to_f32 values (emulated
here from its source) bit for bit, -0 included; 0x7F / 0xFF are NaN both ways.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from tests.test_kernel_sources import braced

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels_cu", "experts.cu")


def _src() -> str:
    with open(SRC, encoding="utf-8") as fh:
        return fh.read()


def _function(name: str) -> str:
    """The text of a device function / struct of experts.cu from its name to its closing brace."""
    return braced(_src(), name, from_head=True)


# ---------------------------------------------------------------- emulations of the device code
def warp_sum(vals, add):
    """common.cuh warp_sum on 32 lane values: v += shfl_xor(v, o) for o = 16 .. 1."""
    v = list(vals)
    o = 16
    while o:
        v = [add(v[l], v[l ^ o]) for l in range(32)]
        o >>= 1
    return v


def warp_sum_rows(rows, add):
    """experts.cu warp_sum_rows<N>: rows[m][lane] -> per-lane result (row lane >> (5 - log2 N))."""
    N = len(rows)
    LOG = N.bit_length() - 1
    assert 1 << LOG == N
    v = [[rows[m][l] for m in range(N)] for l in range(32)]     # v[lane][m]
    for lev in range(LOG):
        o, h = 16 >> lev, (N >> lev) // 2
        send = [[(v[l][i] if l & o else v[l][i + h]) for i in range(h)] for l in range(32)]
        keep = [[(v[l][i + h] if l & o else v[l][i]) for i in range(h)] for l in range(32)]
        v = [[add(keep[l][i], send[l ^ o][i]) for i in range(h)] for l in range(32)]
    r = [v[l][0] for l in range(32)]
    o = 16 >> LOG
    while o:
        r = [add(r[l], r[l ^ o]) for l in range(32)]
        o >>= 1
    return r


def sym_add(a, b):
    """A commutative f32 addition: the node of a sum names its two operands, unordered."""
    return ("+",) + tuple(sorted((a, b), key=repr))


def f32_add(a, b):
    return np.float32(np.float32(a) + np.float32(b))


# ---------------------------------------------------------------- the source the emulation models
def test_emulation_matches_the_source():
    """The key lines of warp_sum_rows and the gate/up interleave, as the emulation does them."""
    f = _function("DEV float warp_sum_rows(")
    for line in ("const int o = 16 >> l, h = (N >> l) / 2;",
                 "const bool upper = (lane & o) != 0;",
                 "const float send = sel(upper, v[i], v[i + h]);",
                 "const float keep = sel(upper, v[i + h], v[i]);",
                 "v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);",
                 "float r = v[0];",
                 "for (int o = 16 >> LOG; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);"):
        assert line in f, line
    # warp_sum (common.cuh) adds own + partner too, at 16 .. 1
    common = open(os.path.join(os.path.dirname(SRC), "common.cuh"), encoding="utf-8").read()
    assert re.search(r"DEV float warp_sum\(float v\) \{\n#pragma unroll\n\s+for \(int o = 16; o > 0; o >>= 1\) "
                     r"v \+= __shfl_xor_sync\(0xffffffffu, v, o\);", common)
    gu = _function("struct GateUpPlan")
    for line in ("v[2 * rr] = acc[rr];", "v[2 * rr + 1] = acc[R + rr];",
                 "const float t = warp_sum_rows<2 * R>(v), p = __shfl_xor_sync(0xffffffffu, t, 16 / R);",
                 "const bool is_u = (threadIdx.x & (16 / R)) != 0;",
                 "kx.put(g, sel(is_u, p, t), sel(is_u, t, p), o0);"):
        assert line in gu, line
    kx = _function("struct KeptX")
    for line in ("static constexpr int SLOTS = 32 / R;",
                 "DEV static int row() { return (int)(threadIdx.x & 31) / SLOTS; }",
                 "if ((int)(threadIdx.x & (SLOTS - 1)) == (g & (SLOTS - 1))) {",
                 "o = o0 + row();",
                 "DEV static bool flush_after(int g, bool last) { return (g & (SLOTS - 1)) == SLOTS - 1 || last; }"):
        assert line in kx, line


# ---------------------------------------------------------------- the reduction tree
@pytest.mark.parametrize("N", [1, 2, 4, 8, 16, 32])
def test_same_tree_as_warp_sum(N):
    """Every lane's warp_sum_rows result is warp_sum's tree of its row (lane >> (5 - log2 N)),
    and warp_sum leaves one tree on all 32 lanes."""
    rows = [[f"r{m}l{l}" for l in range(32)] for m in range(N)]
    ref = [warp_sum(rows[m], sym_add) for m in range(N)]
    for m in range(N):
        assert all(t == ref[m][0] for t in ref[m]), f"warp_sum: lanes differ for row {m}"
    got = warp_sum_rows(rows, sym_add)
    LOG = N.bit_length() - 1
    for lane in range(32):
        m = lane >> (5 - LOG)
        assert got[lane] == ref[m][lane], f"N={N} lane {lane}: not row {m}'s warp_sum tree"


@pytest.mark.parametrize("N", [2, 4, 8])
def test_same_bits_as_warp_sum(N):
    """Numerically, f32 with magnitudes 2^-60 .. 2^60, +-0 and a few infinities: bit for bit."""
    rng = np.random.default_rng(1234 + N)
    for _ in range(40):
        x = (rng.standard_normal((N, 32)) * np.exp2(rng.integers(-60, 61, (N, 32)))).astype(np.float32)
        x[rng.random((N, 32)) < 0.05] = 0.0
        x[rng.random((N, 32)) < 0.05] = -0.0
        if rng.random() < 0.3:
            x[rng.integers(N), rng.integers(32)] = np.float32(np.inf)
        rows = [[np.float32(x[m, l]) for l in range(32)] for m in range(N)]
        with np.errstate(over="ignore", invalid="ignore"):
            ref = [warp_sum(rows[m], f32_add) for m in range(N)]
            got = warp_sum_rows(rows, f32_add)
        LOG = N.bit_length() - 1
        for lane in range(32):
            a = np.array([got[lane]], np.float32).view(np.uint32)[0]
            b = np.array([ref[lane >> (5 - LOG)][lane]], np.float32).view(np.uint32)[0]
            assert a == b or (np.isnan(got[lane]) and np.isnan(ref[lane >> (5 - LOG)][lane]))


@pytest.mark.parametrize("R", [1, 2, 4])
def test_gateup_interleave_gives_each_lane_its_row_pair(R):
    """GateUpPlan (FP4_XRED): rows a_0, u_0, a_1, u_1, ... through warp_sum_rows<2R>, then
    p = shfl_xor(t, 16 / R), a = is_u ? p : t, u = is_u ? t : p: lane l holds (a_rr, u_rr) of
    rr = l / (32 / R) (KeptX<R>::row())."""
    acc = [[f"{'a' if m < R else 'u'}{m % R}l{l}" for l in range(32)] for m in range(2 * R)]  # acc[m]
    v = [None] * (2 * R)
    for rr in range(R):
        v[2 * rr], v[2 * rr + 1] = acc[rr], acc[R + rr]
    t = warp_sum_rows(v, sym_add)
    p = [t[l ^ (16 // R)] for l in range(32)]
    for lane in range(32):
        is_u = bool(lane & (16 // R))
        a, u = (p[lane], t[lane]) if is_u else (t[lane], p[lane])
        rr = lane // (32 // R)
        assert a == warp_sum(acc[rr], sym_add)[0], (R, lane)
        assert u == warp_sum(acc[R + rr], sym_add)[0], (R, lane)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("ngroups", [1, 5, 16, 17, 40])
def test_keptx_stores_what_kept_stores(R, ngroups):
    """The stores of a warp's rows (row o0(g) + rr of group g, value v(g, rr)) through KeptX (one
    lane per row, slot g % (32 / R)) and through Kept (lane n % 32 of row n = g R + rr): the same
    (row, value) pairs, flushed after the same groups."""
    slots = 32 // R

    def o0(g):
        return 1000 * g

    old_stores, old_flush = [], []
    kept = [None] * 32
    for g in range(ngroups):
        for rr in range(R):
            n = g * R + rr
            kept[n % 32] = (o0(g) + rr, ("v", g, rr))
            if n % 32 == 31 or (g == ngroups - 1 and rr == R - 1):
                old_stores += [k for k in kept if k is not None]
                old_flush.append(g)
                kept = [None] * 32
    new_stores, new_flush = [], []
    kx = [None] * 32
    for g in range(ngroups):
        for lane in range(32):
            if (lane & (slots - 1)) == (g & (slots - 1)):
                rr = lane // slots
                kx[lane] = (o0(g) + rr, ("v", g, rr))
        if (g & (slots - 1)) == slots - 1 or g == ngroups - 1:
            new_stores += [k for k in kx if k is not None]
            new_flush.append(g)
            kx = [None] * 32
    assert sorted(new_stores) == sorted(old_stores)
    assert len(new_stores) == ngroups * R
    assert new_flush == old_flush


# ---------------------------------------------------------------- FP4_E8M0_FMA
def _ftz(x: np.float32) -> np.float32:
    return np.float32(np.copysign(0.0, x)) if x != 0 and abs(x) < np.finfo(np.float32).tiny else x


def _ffma_ftz(a, b, c) -> np.float32:
    """FFMA.FTZ: subnormal operands and results flushed to a zero of the same sign (one rounding:
    exact in float64 here for the operands used, which are powers of two, zeros or inf)."""
    a, b, c = _ftz(np.float32(a)), _ftz(np.float32(b)), _ftz(np.float32(c))
    with np.errstate(invalid="ignore", over="ignore"):
        return _ftz(np.float32(np.float64(a) * np.float64(b) + np.float64(c)))


def test_e8m0_fma_scale_matches_selects_under_ftz():
    """For every e8m0 byte and partials p (including 0, -0 and huge values) the fold
    fma(p, scale, acc) with the FP4_E8M0_FMA scale equals the one with e8m0_to_f32's bits,
    modelling FFMA.FTZ (NaN == NaN: the GPU returns one canonical NaN for either)."""
    src = _function("DEV float e8m0_scale(")
    assert "const float s = __uint_as_float(b << 23);" in src and "return __fmaf_rn(s, 0.0f, s);" in src
    parts = [np.float32(v) for v in (0.0, -0.0, 1.0, -3.5, 2.0 ** 100, -(2.0 ** -100), 1.5e-38)]
    accs = [np.float32(v) for v in (0.0, -0.0, 7.25, -(2.0 ** 120))]
    for b in range(256):
        old_bits = 0x00400000 if b == 0 else (0x7FC00000 if b == 255 else b << 23)
        old = np.array([old_bits], np.uint32).view(np.float32)[0]
        s = np.array([(b << 23) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]
        new = _ffma_ftz(s, np.float32(0.0), s)
        if b == 255:
            assert np.isnan(new)
        for p in parts:
            for acc in accs:
                x, y = _ffma_ftz(p, old, acc), _ffma_ftz(p, new, acc)
                same = (np.isnan(x) and np.isnan(y)) or (
                    np.array([x], np.float32).view(np.uint32)[0] == np.array([y], np.float32).view(np.uint32)[0])
                assert same, (b, p, acc, x, y)


# ---------------------------------------------------------------- FP4_E4M3_CVT
def _e4m3_to_f32_source(b: int) -> np.float32:
    """common.cuh e4m3_to_f32, statement by statement (checked against its text below)."""
    s = (b & 0x80) << 24
    e, m = (b >> 3) & 15, b & 7
    if (b & 0x7F) == 0x7F:
        bits = s | 0x7FC00000
    elif e == 0:
        bits = s | int(np.array([np.float32(m) * np.float32(0.001953125)], np.float32).view(np.uint32)[0])
    else:
        bits = s | ((e + 120) << 23) | (m << 20)
    return np.array([bits], np.uint32).view(np.float32)[0]


def test_e4m3_codes_are_exact_f16():
    """The values FP4_E4M3_CVT's path produces (e4m3 -> f16 exactly, then f16 -> f32) are
    e4m3_to_f32's for all 254 finite codes, bit for bit; the two NaN codes are NaN both ways."""
    common = open(os.path.join(os.path.dirname(SRC), "common.cuh"), encoding="utf-8").read()
    for line in ("u32 s = (b & 0x80u) << 24;", "u32 e = (b >> 3) & 15u, m = b & 7u;",
                 "if ((b & 0x7fu) == 0x7fu) return __uint_as_float(s | 0x7fc00000u);",
                 "if (e == 0) return __uint_as_float(s | __float_as_uint((float)m * 0.001953125f));",
                 "return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));"):
        assert line in common, line
    from memra_dsv4.formats import E4M3_VALUES
    for b in range(256):
        want = _e4m3_to_f32_source(b)
        if (b & 0x7F) == 0x7F:
            assert np.isnan(want) and np.isnan(E4M3_VALUES[b])
            continue
        assert np.array([want], np.float32).view(np.uint32)[0] == np.array([E4M3_VALUES[b]], np.float32).view(np.uint32)[0]
        h = np.float16(want)                               # exact: no rounding
        assert np.float32(h) == want and np.signbit(h) == np.signbit(want), b
        assert h == 0 or abs(h) >= np.finfo(np.float16).tiny, b   # a normal f16 (or a zero)
        back = np.float32(h)                               # f16 -> f32 (exact)
        assert np.array([back], np.float32).view(np.uint32)[0] == np.array([want], np.float32).view(np.uint32)[0], b
    src = _function("DEV void e4m3_scales(")
    assert 'asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(two));' in src
    assert "const unsigned short two = (unsigned short)(b0 | (b1 << 8));" in src
    assert "f16x2_to_f32(pair, f0, f1);" in src
