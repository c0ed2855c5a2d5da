"""CPU check of the data flow of the wgmma FP4 grouped GEMM (kernels_cu/experts.cu, namespace wg).

The kernels cannot run here, so this re-implements, thread by thread, the index math the kernels
use and checks that it computes the plain product of the dequantised weights and the activations:
* moe_gather_bf16_perm's granule formula == prefill_moe.perm128 (the host's permutation);
* the cp.async placement of the activation rows into the two SWIZZLE_128B sub-tiles, and what a
  wgmma with the kernel's descriptor (start + 32 B per k-step, SBO 1024, 128-byte swizzle applied
  to the absolute address bits [4,7) ^= [7,10)) reads back as the B operand of each k-step;
* the raw weight placement (16-byte block q of row rho at slot q ^ ((rho >> 1) & 3)) and each
  thread's LDS.128 of it; the PRMT decode (decode8, mx_table_fast / split_table, PTX prmt
  semantics incl. sign-replicate selectors) into the A fragment registers of wgmma (per warp the
  m16n8k16 A layout: rows g, g + 8, k slots 2q, 2q+1 | 2q+8, 2q+9);
* the accumulator layout (per warp the m16n8 C layout along N: acc[4 nt + 2 hh + cc] = row
  16 warp + g + 8 hh, token 8 nt + 2 q + cc) and the epilogues' index math (gate/up storing hs
  permuted, down reading it back).
A wrong k slot, swizzle, descriptor offset, fragment order or epilogue index fails here; it does
not test ptxas, the hardware or the fences.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.formats import dequant_mxfp4
from memra_dsv4.gpu.ops import prefill_moe as PM
from tests.test_fp4_mma_layout import prmt   # the PRMT byte-permute model both layouts decode with


M32 = 0xFFFFFFFF


def split_table(v01, v23, v45, v67):
    return [prmt(v01, v23, 0x6420), prmt(v45, v67, 0x6420), prmt(v01, v23, 0x7531), prmt(v45, v67, 0x7531)]


def mx_table_fast(S):
    d = ((S - 127) * 0x00800080) & M32
    return split_table((0x3F000000 + ((S - 127) << 23)) & M32, (0x3FC03F80 + d) & M32,
                       (0x40404000 + d) & M32, (0x40C04080 + d) & M32)


def decode8(w, t):
    m = w & 0x77777777
    mh = m >> 16
    la, lb = prmt(t[0], t[1], m), prmt(t[0], t[1], mh)
    ha, hb = prmt(t[2], t[3], m), prmt(t[2], t[3], mh)
    sa, sb = prmt(0x80808080, 0x80808080, w), prmt(0x80808080, 0x80808080, w >> 16)
    ha ^= ((sa << 1) & M32) & 0x80808080
    hb ^= ((sb << 1) & M32) & 0x80808080
    return [prmt(la, ha, 0x5140), prmt(la, ha, 0x7362), prmt(lb, hb, 0x5140), prmt(lb, hb, 0x7362)]


def bf16x2(r):
    v = np.array([r & 0xFFFF, r >> 16], np.uint32) << 16
    return v.view(np.float32).astype(np.float64)


def gather_perm_kernel(x_row: np.ndarray) -> np.ndarray:
    """moe_gather_bf16_perm's index math for one row (granule c8 of 8 outputs, 4 float2 loads)."""
    D = x_row.size
    out = np.empty(D, x_row.dtype)
    for c8 in range(D // 8):
        base = 128 * (c8 >> 4) + 4 * ((c8 >> 1) & 7) + 2 * (c8 & 1)
        for qq in range(4):
            out[8 * c8 + 2 * qq:8 * c8 + 2 * qq + 2] = x_row[base + 32 * qq:base + 32 * qq + 2]
    return out


def kernel_perm(L: int) -> int:
    """experts.cu wg_perm."""
    return 16 * ((L >> 2) & 7) + 8 * ((L >> 1) & 1) + 2 * (L >> 5) + (L & 1)


def test_gather_perm_matches_perm128_and_wg_perm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 512))
    for r in range(3):
        assert np.array_equal(gather_perm_kernel(x[r]), PM.perm128(x[r]))
    assert np.array_equal(PM.unperm128(PM.perm128(x)), x)
    idx = PM.perm128_index(256)
    assert sorted(idx.tolist()) == list(range(256))
    assert all(idx[c * 128 + L] == c * 128 + kernel_perm(L) for c in range(2) for L in range(128))


def place_b(xp_chunk: np.ndarray, NB: int) -> np.ndarray:
    """WgCopies.issue's activation copies of one stage: smem bytes (as bf16 slots) of the B region.
    xp_chunk [NB, 128] = the permuted 128-chunk of each token row."""
    BSUB = NB * 128
    sm = np.full(2 * BSUB // 2, np.nan)
    for tid in range(256):
        j = tid & 15
        xtok0 = tid >> 4
        xd = (j >> 3) * BSUB + xtok0 * 128 + (((j & 7) ^ (xtok0 & 7)) << 4)
        for u in range(NB // 16):
            tok = xtok0 + 16 * u
            dst = xd + 2048 * u
            assert dst % 16 == 0
            sm[dst // 2:dst // 2 + 8] = xp_chunk[tok, 8 * j:8 * j + 8]
    return sm


def wgmma_read_b(sm: np.ndarray, base: int, start: int, NB: int) -> np.ndarray:
    """B [16, NB] (k slot, token) that wgmma reads for a K-major SWIZZLE_128B descriptor at byte
    address start (absolute; the region begins at base, 1024-aligned): rows at 128 B, 8-row groups
    at SBO = 1024, 16-byte chunk index XOR (address bits [7,10))."""
    assert base % 1024 == 0
    B = np.empty((16, NB))
    for n in range(NB):
        for kk in range(16):
            addr = start + (n // 8) * 1024 + (n % 8) * 128 + (kk // 8) * 16 + (kk % 8) * 2
            addr ^= ((addr >> 7) & 7) << 4
            B[kk, n] = sm[(addr - base) // 2]
    return B


def place_raw(packed_chunk: np.ndarray) -> np.ndarray:
    """WgCopies.issue's weight copies: smem raw bytes [256 * 64] of one stage (packed_chunk
    [256, 64] u8: the chunk's bytes of each tile row rho)."""
    sm = np.zeros(256 * 64, np.uint8)
    for tid in range(256):
        wd = (tid >> 2) * 64 + 16 * ((tid & 3) ^ ((tid >> 3) & 3))
        for u in range(4):
            rho = (tid >> 2) + 64 * u
            j = tid & 3
            sm[wd + 4096 * u:wd + 4096 * u + 16] = packed_chunk[rho, 16 * j:16 * j + 16]
    return sm


@pytest.mark.parametrize("NB,ntok", [(16, 1), (48, 41), (128, 128)])
def test_wgmma_tile_equals_dot(NB, ntok):
    """One CTA's down tile (256 rows = 2 warpgroups x 2 m64 tiles) over K = 256 (two stages):
    the kernel's copies, reads, decode, fragments and accumulator map give W . x exactly."""
    rng = np.random.default_rng(NB + ntok)
    K = 256
    packed = rng.integers(0, 256, (256, K // 2), dtype=np.uint8)
    scale = rng.integers(110, 130, (256, K // 32), dtype=np.uint8)
    W = dequant_mxfp4(packed, scale, "w").astype(np.float64)            # [256, K]
    x = np.zeros((NB, K))
    x[:ntok] = np.round(rng.standard_normal((ntok, K)) * 64) / 64       # bf16-exact
    xp = PM.perm128(x)                                                   # the stored activations
    acc = np.zeros((256, NB))   # [thread][acc index] per (wg, mt): acc_t[wg][mt][tid_in_wg][NB/2]
    accs = np.zeros((2, 2, 128, NB // 2))
    for c in range(K // 128):
        smB = place_b(xp[:, 128 * c:128 * c + 128], NB)
        raw = place_raw(packed[:, 64 * c:64 * c + 64])
        sc = scale[:, 4 * c:4 * c + 4]                                   # per row 4 B per stage
        for wg in range(2):
            for mt in range(2):
                # A [64, 16] per k-step from the 128 threads' registers
                A = np.zeros((8, 64, 16))
                for tw in range(128):
                    wl, lane = tw >> 5, tw & 31
                    g, q = lane >> 2, lane & 3
                    for hh in range(2):
                        rho = 128 * wg + 64 * mt + 16 * wl + 8 * hh + g
                        off = rho * 64 + 16 * (q ^ ((rho >> 1) & 3))
                        words = raw[off:off + 16].view("<u4")
                        tb = mx_table_fast(int(sc[rho, q]))
                        for w in range(4):
                            r = decode8(int(words[w]), tb)
                            for s in range(2):
                                t = 2 * w + s
                                row = 16 * wl + g + 8 * hh
                                A[t, row, 2 * q:2 * q + 2] = bf16x2(r[2 * s])          # a0 / a1
                                A[t, row, 2 * q + 8:2 * q + 10] = bf16x2(r[2 * s + 1])  # a2 / a3
                for t in range(8):
                    Bt = wgmma_read_b(smB, 0, (t >> 2) * NB * 128 + 32 * (t & 3), NB)
                    D = A[t] @ Bt                                        # [64, NB]
                    for tw in range(128):
                        wl, lane = tw >> 5, tw & 31
                        g, q = lane >> 2, lane & 3
                        for i in range(NB // 2):
                            nt, hh, cc = i >> 2, (i >> 1) & 1, i & 1
                            accs[wg, mt, tw, i] += D[16 * wl + g + 8 * hh, 8 * nt + 2 * q + cc]
    # the down epilogue's index math
    for wg in range(2):
        for mt in range(2):
            for tw in range(128):
                wl, lane = tw >> 5, tw & 31
                g, q = lane >> 2, lane & 3
                for nt in range(NB // 8):
                    for cc in range(2):
                        tok = 8 * nt + 2 * q + cc
                        for hh in range(2):
                            o = 128 * wg + 64 * mt + 16 * wl + g + 8 * hh
                            acc[o, tok] = accs[wg, mt, tw, 4 * nt + 2 * hh + cc]
    want = W @ x.T
    np.testing.assert_allclose(acc[:, :ntok], want[:, :ntok], rtol=1e-12, atol=1e-12)


def test_gateup_epilogue_writes_perm_and_rows():
    """Gate/up: tile row rho = 128 wg + 64 mt + r is index n0 + 64 wg + r of W1 (mt 0) / W3 (mt 1)
    (experts.cu wg_row), and thread (wg, warp, g, hh) stores index n0 + 64 wg + 16 warp + g + 8 hh
    at column (i & ~127) + wg_perm(i & 127): every index of the CTA's 128 exactly once, at the
    position the down kernel reads (perm128)."""
    for n0 in (0, 128, 1920):
        seen = []
        for wg in range(2):
            for wl in range(4):
                for g in range(8):
                    for hh in range(2):
                        i = n0 + 64 * wg + 16 * wl + g + 8 * hh
                        seen.append((i & ~127) + kernel_perm(i & 127))
                        for mt in range(2):   # the same row of both matrices in this thread
                            rho = 128 * wg + 64 * mt + 16 * wl + 8 * hh + g
                            assert n0 + 64 * (rho >> 7) + (rho & 63) == i and ((rho >> 6) & 1) == mt
        assert sorted(seen) == sorted(PM.perm128_index(2048)[n0:n0 + 128].tolist())


def test_stage_ring_fits_and_aligns():
    """WgSmem: stage = B (2 sub-tiles of NB x 128 B) + raw (256 x 64) + scales, rounded to 1 KB;
    at least 3 stages in WG_SMEM for every NB; the launch asks WG_SMEM + 1 KB <= 227 KB."""
    for nv in (False, True):
        for NB in range(16, 129, 16):
            stage = -(-(2 * NB * 128 + 256 * 64 + 256 * (8 if nv else 4)) // 1024) * 1024
            assert PM.WG_SMEM // stage >= 3, (nv, NB)
            assert (NB * 128) % 1024 == 0          # the second sub-tile starts 1024-aligned
    assert PM.WG_SMEM + 1024 <= 227 * 1024


def test_wg_items_split():
    """Items: every pick once, 1..WG_BN rows, an expert's items adjacent and balanced (all but
    the last a multiple of 16), empty experts absent."""
    rng = np.random.default_rng(5)
    for T, E in ((1, 256), (300, 40), (1024, 256), (4000, 64)):
        idx = np.stack([rng.choice(E, 6, replace=False) for _ in range(T)]).astype(np.int64)
        plan = PM.dispatch_plan(idx, 21)
        items = PM.wg_items(plan)
        cover = np.zeros(plan.rows, np.int64)
        by_e = {}
        for e, r0, n, _ in items:
            assert 1 <= n <= PM.WG_BN
            cover[r0:r0 + n] += 1
            assert (idx.reshape(-1)[plan.flat[r0:r0 + n]] == e).all()
            by_e.setdefault(int(e), []).append(int(n))
        assert (cover[plan.src >= 0] == 1).all() and (cover[plan.src < 0] == 0).all()
        for e, ns in by_e.items():
            c = int((idx == e).sum())
            assert len(ns) == -(-c // PM.WG_BN), (e, c, ns)
            assert all(n % 16 == 0 for n in ns[:-1]) and ns[-1] <= ns[0], (e, c, ns)
    # the 8K shape's typical expert: 192 picks -> 96 + 96; 200 -> 112 + 88
    counts = {192: [96, 96], 200: [112, 88], 129: [80, 49], 128: [128], 7: [7]}
    for c, want in counts.items():
        idx = np.zeros((c, 1), np.int64)
        assert PM.wg_items(PM.dispatch_plan(idx, 1))[:, 2].tolist() == want
