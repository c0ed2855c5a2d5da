"""Launch wrappers of kernels_cu/decode.cu: the device decode step's glue (see the .cu header).

All take preallocated CuPy arrays (arena views) and allocate nothing; integer arguments go as
np.int32; positions are read on the device from ``pos`` (int32 [1]).
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, i32, kernel, null_or

STEM = "decode"
KERNELS = ("gemv_bf16", "gemv_bf16_multi", "embed_gather", "step_scalars", "ring_write", "pending_write",
           "entry_commit", "pending_advance", "build_cand")
kernel_loader.register(STEM, KERNELS)

__all__ = ["gemv_bf16", "GemvTable", "gemv_bf16_multi", "embed_gather", "step_scalars", "ring_write", "pending_write",
           "entry_commit", "pending_advance", "build_cand", "KERNELS", "STEM"]


def _blocks(n: int) -> int:
    return max(1, min((int(n) + 255) // 256, 1024))


def gemv_bf16(w, x, out, *, groups: int = 1):
    """out [O] (f32 or bf16 bits) = W [O, K] . x (bf16 bits); groups > 1: row o uses
    x[(o // (O // groups)) * K : +K] (x holds groups * K values)."""
    check(w, "gemv_bf16.w", np.uint16)
    O, K = w.shape
    assert K % 8 == 0, f"gemv_bf16: K = {K} must be a multiple of 8"
    check(x, "gemv_bf16.x", np.uint16)
    assert x.size == groups * K, f"gemv_bf16.x: {x.size} values, expected {groups} * {K}"
    assert out.dtype in (np.float32, np.uint16) and out.size == O and out.flags.c_contiguous, (
        f"gemv_bf16.out: {out.shape} {out.dtype}, expected {O} f32/bf16 contiguous")
    assert O % groups == 0, f"gemv_bf16: {O} rows not divisible into {groups} groups"
    assert w.data.ptr % 16 == 0 and x.data.ptr % 16 == 0, "gemv_bf16: 16-byte alignment"
    rpg = O // groups if groups > 1 else 0
    kernel(STEM, "gemv_bf16")(((O + 7) // 8,), (256,),
                              (w, x, out, i32(O), i32(K), i32(rpg),
                               i32(1 if out.dtype == np.uint16 else 0)))
    return out


class GemvTable:
    """Device table of projections that share one input x (decode.cu GemvSeg, 24 bytes each
    + a sentinel): built once at setup from weights [O_s, K] bf16 bits and outputs (arena
    views, f32 or bf16 bits, O_s values).  The addresses are baked in, like a graph's."""

    SEG_BYTES = 24

    def __init__(self, pairs, K: int):
        import cupy as cp
        assert pairs, "GemvTable: no projections"
        rec = np.zeros(len(pairs) + 1, dtype=np.dtype([("w", "<u8"), ("y", "<u8"), ("row0", "<i4"),
                                                        ("out_bf16", "<i4")]))
        assert rec.dtype.itemsize == self.SEG_BYTES
        row = 0
        self.keep = []
        for i, (w, out) in enumerate(pairs):
            check(w, f"GemvTable.w[{i}]", np.uint16)
            assert w.shape[1] == K, f"GemvTable.w[{i}]: shape {w.shape}, expected [*, {K}]"
            assert out.dtype in (np.float32, np.uint16) and out.size == w.shape[0] and \
                out.flags.c_contiguous, f"GemvTable.out[{i}]: {out.shape} {out.dtype}"
            assert w.data.ptr % 16 == 0, f"GemvTable.w[{i}]: 16-byte alignment"
            rec[i] = (w.data.ptr, out.data.ptr, row, int(out.dtype == np.uint16))
            row += w.shape[0]
            self.keep += [w, out]
        rec[len(pairs)]["row0"] = row
        self.rows, self.K, self.nseg = row, int(K), len(pairs)
        self.table = cp.asarray(rec.view(np.uint8))


def gemv_bf16_multi(table: GemvTable, x):
    """Every projection of ``table`` applied to x (bf16 bits [K]) in one launch."""
    check(x, "gemv_bf16_multi.x", np.uint16)
    assert x.size == table.K and x.data.ptr % 16 == 0, f"gemv_bf16_multi.x: {x.size} != {table.K}"
    kernel(STEM, "gemv_bf16_multi")(((table.rows + 7) // 8,), (256,),
                                    (table.table, i32(table.nseg), x, i32(table.K)))


def embed_gather(tok, embed, streams):
    check(tok, "embed_gather.tok", np.int32)
    check(embed, "embed_gather.embed", np.uint16)
    check(streams, "embed_gather.streams", np.uint16)
    D = embed.shape[1]
    hc = streams.size // D
    kernel(STEM, "embed_gather")((_blocks(hc * D),), (256,), (tok, embed, streams, i32(D), i32(hc)))
    return streams


def step_scalars(pos, aux, ratios):
    check(pos, "step_scalars.pos", np.int32)
    check(aux, "step_scalars.aux", np.int32)
    r = list(ratios) + [1] * (4 - len(ratios))
    assert len(r) == 4 and aux.size >= 5, f"step_scalars: ratios {ratios}, aux {aux.size}"
    kernel(STEM, "step_scalars")((1,), (32,), (pos, aux, i32(r[0]), i32(r[1]), i32(r[2]), i32(r[3])))
    return aux


def ring_write(pos, src, ring):
    check(src, "ring_write.src", np.uint16)
    check(ring, "ring_write.ring", np.uint16)
    W, d = ring.shape
    assert src.size == d
    kernel(STEM, "ring_write")((_blocks(d),), (256,), (pos, src, ring, i32(W), i32(d)))


def pending_write(pos, a, z, kv, score, ratio: int, overlap: bool):
    check(kv, "pending_write.kv", np.float32)
    check(score, "pending_write.score", np.float32, kv.shape)
    C = kv.shape[1]
    check(a, "pending_write.a", np.float32)
    check(z, "pending_write.z", np.float32)
    assert a.size == C and z.size == C, f"pending_write: a {a.size}, z {z.size}, rows {C}"
    kernel(STEM, "pending_write")((_blocks(C),), (256,),
                                  (pos, a, z, kv, score, i32(ratio), i32(int(overlap)), i32(C)))


def entry_commit(pos, src, dst, ratio: int):
    check(src, "entry_commit.src", np.uint16)
    check(dst, "entry_commit.dst", np.uint16)
    n, d = dst.shape
    assert src.size == d
    kernel(STEM, "entry_commit")((_blocks(d),), (256,), (pos, src, dst, i32(ratio), i32(d), i32(n)))


def pending_advance(pos, kv, score, ratio: int, overlap: bool):
    check(kv, "pending_advance.kv", np.float32)
    check(score, "pending_advance.score", np.float32, kv.shape)
    C = kv.shape[1]
    kernel(STEM, "pending_advance")((_blocks(ratio * C),), (256,),
                                    (pos, kv, score, i32(ratio), i32(int(overlap)), i32(C)))


def build_cand(pos, cand, window: int, ratio: int, sel=None):
    """cand int32 [K] (see the .cu header); sel int32 [sel_w] ascending entry ids (CSA)."""
    check(cand, "build_cand.cand", np.int32)
    K = cand.size
    sel_w = 0
    if sel is not None:
        check(sel, "build_cand.sel", np.int32)
        sel_w = sel.size
    kernel(STEM, "build_cand")((_blocks(K),), (256,),
                               (pos, i32(window), i32(ratio), null_or(sel), i32(sel_w), cand, i32(K)))
