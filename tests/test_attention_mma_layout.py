"""CPU check of the fragment bookkeeping of kernels_cu/attention.cu's sparse_attn_mma_* (no GPU).

The tensor-core kernel's correctness rests on index arithmetic that no CPU test can execute:
which smem addresses each lane hands to ldmatrix, which registers feed which mma operand, and how
the m16n8 accumulators of S are re-read as the m16k16 A operand of P.V.  This test replays the
kernel body warp by warp in NumPy, transcribing its address expressions literally, on top of an
implementation of the PTX-specified semantics of the three instructions involved:

  ldmatrix.m8n8.x4.b16 (lanes 8i..8i+7 address the rows of matrix i; register i of lane l holds
      row l/4, columns 2(l%4), 2(l%4)+1; .trans: column l/4, rows 2(l%4), 2(l%4)+1),
  mma.m16n8k16.row.col bf16 (a0..a3 = A[g][2c..], A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..];
      b0, b1 = B[2c..][g], B[2c+8..][g]; c0..c3 = C[g][2c..], C[g+8][2c..]; g = l/4, c = l%4),

and compares the result with the f64 twin (oracle.ops.sparse_attention_with_sinks) within the
GPU test's bound.  A wrong lane -> row mapping, a swapped b0/b1, a mis-strided shared buffer or a
P fragment assembled from the wrong accumulator produces errors of O(1), far outside the bound.
The MMA is modelled as an exact dot rounded to f32 (the hardware's accumulation order is not
modelled: the bound covers it).  What this cannot catch: races, cp.async/barrier ordering, PTX
syntax, and any divergence between this transcription and the .cu text (keep them in step).
"""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.oracle import ops as O
from memra_dsv4.seams import POLICIES

TJ = 32
LANE = np.arange(32)
G, TG = LANE // 4, LANE % 4


def _bf16(x):
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def ldsm_x4(smem, addr, trans=False):
    """addr [32] element offsets (row starts) -> regs [4][32 lanes][2] (lo, hi halves)."""
    regs = np.empty((4, 32, 2), np.float32)
    for i in range(4):
        mat = np.stack([smem[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])  # [row][col]
        if not trans:
            regs[i, :, 0] = mat[G, 2 * TG]
            regs[i, :, 1] = mat[G, 2 * TG + 1]
        else:
            regs[i, :, 0] = mat[2 * TG, G]
            regs[i, :, 1] = mat[2 * TG + 1, G]
    return regs


def mma(c, a, b0, b1):
    """c [4][32] f32, a [4][32][2], b0/b1 [32][2] -> new c (exact dot + c, rounded to f32)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for e in range(2):
        A[G, 2 * TG + e] = a[0][:, e]
        A[G + 8, 2 * TG + e] = a[1][:, e]
        A[G, 2 * TG + 8 + e] = a[2][:, e]
        A[G + 8, 2 * TG + 8 + e] = a[3][:, e]
        B[2 * TG + e, G] = b0[:, e]
        B[2 * TG + 8 + e, G] = b1[:, e]
        C[G, 2 * TG + e] = c[e]
        C[G + 8, 2 * TG + e] = c[2 + e]
    Dm = A @ B + C
    out = np.empty((4, 32), np.float32)
    for e in range(2):
        out[e] = Dm[G, 2 * TG + e]
        out[2 + e] = Dm[G + 8, 2 * TG + e]
    return out


def quad(v, op):
    """xor butterfly over lanes ^2, ^1 (group_max<4> / group_sum<4>)."""
    for o in (2, 1):
        v = op(v, v[LANE ^ o])
    return v


def emulate(q, kv, idx, sink, scale, probs_bf16, nhg):
    """The kernel body of sparse_attn_mma_d{D}_hg{16 nhg}, warp by warp; inverse RoPE not applied."""
    T, H, D = q.shape
    K = idx.shape[1]
    LDS, DW = D + 8, D // 4
    KS, ND, HG = DW // 16, DW // 8, 16 * nhg
    n_tiles = (K + TJ - 1) // TJ
    qflat = q.reshape(-1)
    out = np.zeros((T, H, D), np.float32)
    for t in range(T):
        for by in range((H + HG - 1) // HG):
            warps = [(w >> 2, w & 3) for w in range(4 * nhg)]
            st = {}
            for w, (hgi, ds) in enumerate(warps):
                h0, dw0 = by * HG + 16 * hgi, ds * DW
                ok0, ok8 = (h0 + G < H)[:, None], (h0 + G + 8 < H)[:, None]
                r0 = (t * H + h0 + G) * D + dw0 + 2 * TG
                r8 = r0 + 8 * D

                def pair(base, ok):
                    base = np.where(ok[:, 0], base, 0)
                    return np.where(ok, np.stack([qflat[base], qflat[base + 1]], -1), 0.0)
                qa = [[pair(r0 + 16 * s, ok0), pair(r8 + 16 * s, ok8), pair(r0 + 16 * s + 8, ok0),
                       pair(r8 + 16 * s + 8, ok8)] for s in range(KS)]
                st[w] = dict(h0=h0, dw0=dw0, qa=qa, M=np.full((2, 32), -np.inf, np.float32),
                             L=np.zeros((2, 32), np.float32), A=np.zeros((ND, 4, 32), np.float32))
            for tile in range(n_tiles):
                buf = np.zeros(TJ * LDS, np.float32)
                for r in range(TJ):
                    j = tile * TJ + r
                    iid = idx[t, j] if j < K else -1
                    if iid >= 0:
                        buf[r * LDS: r * LDS + D] = kv[iid]
                jl = tile * TJ + LANE
                ok = np.array([jl[i] < K and idx[t, jl[i]] >= 0 for i in range(32)])
                vmask = int(sum(1 << i for i in range(32) if ok[i]))
                if vmask == 0:
                    continue
                sx = np.full(nhg * 4 * 4 * 32 * 4, np.nan, np.float32)
                for w, (hgi, ds) in enumerate(warps):
                    s_ = st[w]
                    sp = np.zeros((4, 4, 32), np.float32)
                    for j in range(4):
                        kr = (8 * j + (LANE & 7)) * LDS + s_["dw0"] + 8 * (LANE >> 3)
                        for s2 in range(KS // 2):
                            b = ldsm_x4(buf, kr + 32 * s2)
                            sp[j] = mma(sp[j], s_["qa"][2 * s2], b[0], b[1])
                            sp[j] = mma(sp[j], s_["qa"][2 * s2 + 1], b[2], b[3])
                    me = (hgi * 4 + ds) * 512 + LANE * 4
                    for j in range(4):
                        for e in range(4):
                            sx[me + j * 128 + e] = sp[j][e]
                for w, (hgi, ds) in enumerate(warps):   # after __syncthreads
                    s_ = st[w]
                    hg = hgi * 2048 + LANE * 4
                    sv = np.empty((4, 4, 32), np.float32)
                    for j in range(4):
                        a = [sx[hg + j * 128 + e].copy() for e in range(4)]
                        for d2 in range(1, 4):
                            a = [np.float32(a[e] + sx[hg + d2 * 512 + j * 128 + e]) for e in range(4)]
                        v0 = (vmask >> (8 * j + 2 * TG)) & 1
                        v1 = (vmask >> (8 * j + 2 * TG + 1)) & 1
                        sc = np.float32(scale)
                        sv[j][0] = np.where(v0, a[0] * sc, -np.inf)
                        sv[j][1] = np.where(v1, a[1] * sc, -np.inf)
                        sv[j][2] = np.where(v0, a[2] * sc, -np.inf)
                        sv[j][3] = np.where(v1, a[3] * sc, -np.inf)
                    mt = np.stack([quad(np.max(np.stack([sv[j][2 * r + e] for j in range(4) for e in range(2)]), 0),
                                        np.maximum) for r in range(2)])
                    with np.errstate(invalid="ignore"):
                        pj = np.stack([[np.where(sv[j][e] == -np.inf, 0.0,
                                                 np.exp((sv[j][e] - mt[e >> 1]).astype(np.float32)))
                                        for e in range(4)] for j in range(4)]).astype(np.float32)
                    lt = np.stack([quad(sum(pj[j][2 * r] + pj[j][2 * r + 1] for j in range(4)).astype(np.float32),
                                        np.add) for r in range(2)])
                    ph = [[None] * 4 for _ in range(2)]
                    pl = [[None] * 4 for _ in range(2)]
                    for s in range(2):
                        for hh in range(2):
                            for r in range(2):
                                x0, x1 = pj[2 * s + hh][2 * r], pj[2 * s + hh][2 * r + 1]
                                h0v, h1v = _bf16(x0), _bf16(x1)
                                ph[s][2 * hh + r] = np.stack([h0v, h1v], -1)
                                pl[s][2 * hh + r] = np.stack([_bf16(x0 - h0v), _bf16(x1 - h1v)], -1)
                    Mn = np.maximum(s_["M"], mt)
                    with np.errstate(invalid="ignore"):
                        ma = np.where(s_["M"] == -np.inf, 0.0, np.exp(s_["M"] - Mn)).astype(np.float32)
                        mb = np.where(mt == -np.inf, 0.0, np.exp(mt - Mn)).astype(np.float32)
                    s_["L"] = (s_["L"] * ma + lt * mb).astype(np.float32)
                    s_["M"] = Mn
                    vr = LANE * LDS + s_["dw0"]
                    for n in range(ND):
                        b = ldsm_x4(buf, vr + 8 * n, trans=True)
                        c = np.zeros((4, 32), np.float32)
                        if not probs_bf16:
                            c = mma(c, pl[0], b[0], b[1])
                            c = mma(c, pl[1], b[2], b[3])
                        c = mma(c, ph[0], b[0], b[1])
                        c = mma(c, ph[1], b[2], b[3])
                        for e in range(4):
                            s_["A"][n][e] = s_["A"][n][e] * ma[e >> 1] + c[e] * mb[e >> 1]
            for w, (hgi, ds) in enumerate(warps):
                s_ = st[w]
                for r in range(2):
                    h = s_["h0"] + G + 8 * r
                    st_ = h < H          # lanes whose head exists store
                    h = np.where(st_, h, 0)
                    with np.errstate(over="ignore"):
                        den = s_["L"][r] + np.exp(sink[h] - s_["M"][r]).astype(np.float32)
                    for n in range(ND):
                        d = s_["dw0"] + 8 * n + 2 * TG
                        out[t, h[st_], d[st_]] = _bf16(s_["A"][n][2 * r] / den)[st_]
                        out[t, h[st_], d[st_] + 1] = _bf16(s_["A"][n][2 * r + 1] / den)[st_]
    return out


@pytest.mark.parametrize("D,H,nhg", [(128, 16, 1), (128, 32, 2), (512, 16, 1), (128, 4, 1), (128, 24, 2)])
@pytest.mark.parametrize("probs_bf16", [False, True])
def test_mma_fragment_bookkeeping_matches_twin(D, H, nhg, probs_bf16):
    rng = np.random.default_rng()
    T, N, K = 2, 90, 70   # K: two full tiles + a 6-slot tail
    q = _bf16(rng.standard_normal((T, H, D)))
    kv = _bf16(rng.standard_normal((N, D)))
    idx = rng.integers(0, N, (T, K)).astype(np.int32)
    idx[0, 5:20] = -1          # holes inside a tile
    idx[0, 32:64] = -1         # a fully empty tile (skipped)
    idx[1, :] = -1             # a fully masked token: output 0
    idx[1, 40] = 7
    sink = (rng.standard_normal(H) * 2).astype(np.float32)
    scale = D ** -0.5
    pol = POLICIES["reference" if probs_bf16 else "bf16"]
    want = O.sparse_attention_with_sinks(q, kv, idx, sink, scale, pol=pol)
    got = emulate(q, kv, idx, sink, scale, probs_bf16, nhg)
    # 2 bf16 ulps + (2^-12 [f32 logits and P.V, loose] + 2^-8 [reference class: P cast per tile]) * A,
    # A = sum_j p_j |v_j| / den from the f64 softmax (as the GPU test's bound)
    A = np.empty((T, H, D))
    for t in range(T):
        ok = idx[t] >= 0
        gk = np.where(ok[:, None], kv.astype(np.float64)[np.where(ok, idx[t], 0)], 0.0)
        lg = np.where(ok[None, :], (q[t].astype(np.float64) @ gk.T) * scale, -np.inf)
        m = np.maximum(lg.max(-1), sink)
        p = np.exp(lg - m[:, None])
        A[t] = (p @ np.abs(gk)) / (p.sum(-1) + np.exp(sink - m))[:, None]
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)
    tol = 2 * ulp + (2.0 ** -12 + (2.0 ** -8 if probs_bf16 else 0.0)) * A
    assert np.all(np.isfinite(got))
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} elements off; worst {np.abs(got - want).max()}"
    # the fully masked token's head outputs are exactly its single candidate's weighted row
    assert np.abs(got[1]).max() > 0
