"""CPU check of the data flow of the tensor-core FP4 GEMVs (kernels_cu/experts.cu, gemv_*_mma).

The kernels cannot run here, so this emulates, lane by lane, what they do with the bits: the PRMT
e2m1 -> f16x2 decode (PTX prmt.b32 semantics, sign-replicate selector nibbles included), the
bit-placement variant (FP4_MMA_PLACE), the x staging permutation, the per-lane A / B fragments of
mma.m16n8k16 (PTX ISA fragment layouts for .f16 A row / B col / f32 C) and the scale folding, and
checks that the result is the plain dot product of the dequantised rows.  A wrong k-slot pairing,
fragment register order or scale byte would fail here; it does not test ptxas or the hardware.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.formats import E4M3_VALUES, dequant_mxfp4, dequant_nvfp4, encode_e4m3

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        v = src[nib & 7]
        if nib & 8:
            v = 0xFF if v & 0x80 else 0x00
        out |= v << (8 * n)
    return out


def decode_prmt(w: int) -> list[int]:
    m = w & 0x77777777
    lo = prmt(0x3E3C3800, 0x46444240, m)
    hi = prmt(0x3E3C3800, 0x46444240, (m * 0x10000) >> 32)
    sh = [12, 8, 4, 0]
    sels = [0x4808, 0x5818, 0x6828, 0x7838]
    return [prmt(lo, hi, sels[i]) | (((w << sh[i]) & 0xFFFFFFFF) & 0x80008000) for i in range(4)]


def decode_place(w: int) -> list[int]:
    M, S = 0x0E000E00, 0x80008000
    sh = lambda v, k: (v << k) & 0xFFFFFFFF  # noqa: E731
    return [(sh(w, 9) & M) | (sh(w, 12) & S), (sh(w, 5) & M) | (sh(w, 8) & S),
            (sh(w, 1) & M) | (sh(w, 4) & S), (((w * (1 << 29)) >> 32) & M) | (w & S)]


def f16x2(h: int) -> tuple[float, float]:
    v = np.array([h & 0xFFFF, h >> 16], np.uint16).view(np.float16).astype(np.float64)
    return float(v[0]), float(v[1])


def test_decode_all_nibbles():
    """h[i] = (e2m1(n_i), e2m1(n_{i+4})) for every code in every position (place: times 2^-14)."""
    rng = np.random.default_rng(1)
    words = [int(v) for v in rng.integers(0, 2 ** 32, 4000, dtype=np.uint64)]
    words += [sum(c << (4 * p) for p in range(8)) for c in range(16)]
    for w in words:
        n = [(w >> (4 * p)) & 15 for p in range(8)]
        for dec, mult in ((decode_prmt, 1.0), (decode_place, 2.0 ** -14)):
            h = dec(w)
            for i in range(4):
                lo, hi = f16x2(h[i])
                assert lo == E2M1[n[i]] * mult and np.signbit(lo) == np.signbit(E2M1[n[i]]), (hex(w), i)
                assert hi == E2M1[n[i + 4]] * mult and np.signbit(hi) == np.signbit(E2M1[n[i + 4]]), (hex(w), i)


def stage(x8: np.ndarray) -> list[int]:
    """8 x values (already f16-exact) -> the staged uint4 {(x0,x4), (x1,x5), (x2,x6), (x3,x7)}."""
    b = x8.astype(np.float16).view(np.uint16).astype(np.int64)
    return [int(b[j] | (b[j + 4] << 16)) for j in range(4)]


def mma(acc, A_regs, B_regs):
    """m16n8k16 from per-lane fragments (PTX layouts): A_regs[lane] = 4 f16x2, B_regs[lane] = 2
    f16x2, acc[lane] = 4 f32 (c0 c1: row g cols 2t, 2t+1; c2 c3: row g+8)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = f16x2(A_regs[lane][r])
        for r, k0 in enumerate([2 * t, 2 * t + 8]):
            B[k0, g], B[k0 + 1, g] = f16x2(B_regs[lane][r])
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane] = [acc[lane][0] + D[g, 2 * t], acc[lane][1] + D[g, 2 * t + 1],
                     acc[lane][2] + D[g + 8, 2 * t], acc[lane][3] + D[g + 8, 2 * t + 1]]


def emulate_tile(packed: np.ndarray, scale: np.ndarray, x: np.ndarray, nv: bool, decode=decode_prmt):
    """16 rows (packed [16, K/2] u8, scales [16, K/32 | K/16] u8) . x [K] (f16-exact values), one
    K segment covering all of K, the kernel's lane program; returns the 16 row values."""
    K = x.size
    words = packed.view("<u4")                     # [16, K/8] little-endian words
    xs = [stage(x[8 * i: 8 * i + 8]) for i in range(K // 8)]   # staged uint4 per 8 elements
    e4m3 = lambda b: float(E4M3_VALUES[b])  # noqa: E731
    accg = np.zeros(32)
    acc8 = np.zeros(32)
    for st in range(K // 128):
        acc = [[0.0] * 4 for _ in range(32)]

        def fold(half):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if t >= 2:
                    continue
                for r, (row, A) in enumerate(((g, accg), (g + 8, acc8))):
                    for cc in range(2):
                        blk = 4 * st + 2 * t + cc
                        if nv:
                            s = e4m3(int(scale[row, 2 * blk + half]))
                        else:
                            s = 2.0 ** (int(scale[row, blk]) - 127)
                        A[lane] += acc[lane][2 * r + cc] * s
        for c in range(4):
            if nv and c == 2:
                fold(0)
                acc = [[0.0] * 4 for _ in range(32)]
            A_lo, A_hi, Bs_lo, Bs_hi = [], [], [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                wcol = (st * 128 + 32 * t) // 8 + c  # word c of lane t's block
                hg, h8 = decode(int(words[g, wcol])), decode(int(words[g + 8, wcol]))
                A_lo.append([hg[0], h8[0], hg[1], h8[1]])
                A_hi.append([hg[2], h8[2], hg[3], h8[3]])
                xb = xs[(st * 128 + 32 * t) // 8 + c] if g == t else [0, 0, 0, 0]
                Bs_lo.append([xb[0], xb[1]])
                Bs_hi.append([xb[2], xb[3]])
            mma(acc, A_lo, Bs_lo)
            mma(acc, A_hi, Bs_hi)
        fold(1 if nv else 0)
    out = np.zeros(16)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if t == 0:
            out[g] = accg[lane] + accg[lane + 1]
            out[g + 8] = acc8[lane] + acc8[lane + 1]
    return out


def _tile(rng, K, nv):
    packed = rng.integers(0, 256, (16, K // 2), dtype=np.uint8)
    sc = rng.integers(118, 135, (16, K // 32), dtype=np.uint8)
    x = (rng.standard_normal(K) * 64).astype(np.float16).astype(np.float64)   # f16-exact x
    if nv:
        k = sc.astype(np.int64) - 127
        sc16 = encode_e4m3(np.exp2(np.repeat(k, 2, axis=-1) - int(k.max()) + 8).astype(np.float64))
        W = dequant_nvfp4(packed, sc16, np.float32(1.0), "w").astype(np.float64)
        return packed, sc16, x, W
    return packed, sc, x, dequant_mxfp4(packed, sc, "w").astype(np.float64)


def test_tile_mx_and_nv_equal_dot():
    rng = np.random.default_rng(2)
    for nv in (False, True):
        for decode, mult in ((decode_prmt, 1.0), (decode_place, 2.0 ** 14)):
            packed, sc, x, W = _tile(rng, 256, nv)
            got = emulate_tile(packed, sc, x, nv, decode) * mult
            want = W @ x
            assert np.allclose(got, want, rtol=1e-12, atol=1e-9 * np.abs(W) @ np.abs(x)), (nv, decode.__name__)


def test_e8m0_word_decode():
    """MXFP4 scales are loaded as one u16 per row (blocks 2t, 2t+1): byte 0 -> |f32(rs << 23)|,
    byte 1 -> f32((rs >> 8) << 23) (umulhi by 2^24), i.e. 2^(b-127) for b in 1..254, +inf for 255
    (made NaN by mma_fold_e8m0's sc - sc), +0 for 0 (e8m0_scale's 2^-127 under -ftz)."""
    rs = np.arange(1 << 16, dtype=np.uint64)
    lo = np.abs(((rs << np.uint64(23)) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)).astype(np.float64)
    hi = (((rs * (1 << 24)) >> np.uint64(32)) << np.uint64(23)).astype(np.uint32).view(np.float32).astype(np.float64)
    for got, b in ((lo, rs & np.uint64(0xFF)), (hi, rs >> np.uint64(8))):
        b = b.astype(np.int64)
        mid = (b > 0) & (b < 255)
        assert np.array_equal(got[mid], np.exp2(b[mid] - 127.0))
        assert np.all(got[b == 0] == 0.0) and np.all(np.isinf(got[b == 255]))
