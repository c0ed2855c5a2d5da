"""Lightning-indexer ops (kernels_cu/indexer.cu).

scores(q, w, keys, n_valid)   twin oracle.ops.indexer_scores (columns < n_valid[t]; the rest -inf);
                              impl 'simt' (f32 FMA dots) or 'mma' (tensor-core dots, for long
                              prefills): the two differ in the dot's rounding, so a runtime must
                              use one of them for decode and prefill alike
topk(scores, n_valid, k)      twin oracle.ops.indexer_topk (order='score'); order='index' gives the
                              ascending canonical segment of host.indices.candidate_matrix
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, dynamic_smem, i32, kernel, out_array, row_stride

STEM = "indexer"
KERNELS = ("indexer_scores_d128", "indexer_scores_mma_d128", "indexer_topk")
kernel_loader.register(STEM, KERNELS)

TOPK_MAX = 1024


IMPLS = ("simt", "mma")


def scores(q, w, keys, n_valid, out=None, *, w_scale: float = 1.0, impl: str = "simt"):
    """q [T, H, 128] bf16 (rotated, FP4-simulated); w [T, H] bf16: the stored indexer head
    weights, or the raw weights_proj output with w_scale = head_dim^-0.5 * n_heads^-0.5 (the
    kernel then stores bf16(w * w_scale) as oracle.ops.indexer_weights does);
    keys [N, 128] bf16 rows (last axis contiguous); n_valid [T] int32 (<= N) -> out [T, N] bf16
    (a row-strided view is allowed)."""
    check(q, "indexer.scores.q", np.uint16)
    assert q.ndim == 3 and q.shape[2] == 128, f"indexer.scores.q: expected [T, H, 128], got {q.shape}"
    T, H, _ = q.shape
    assert H % 4 == 0 and H <= 64, f"indexer.scores: H = {H} (need H % 4 == 0, H <= 64)"
    check(w, "indexer.scores.w", np.uint16, (T, H))
    check(keys, "indexer.scores.keys", np.uint16, rows_strided=True)
    N = keys.shape[0]
    assert keys.shape[1] == 128, f"indexer.scores.keys: expected [N, 128], got {keys.shape}"
    check(n_valid, "indexer.scores.n_valid", np.int32, (T,))
    if out is None:
        out = out_array(None, "indexer.scores.out", (T, N), np.uint16)
    check(out, "indexer.scores.out", np.uint16, (T, N), rows_strided=True)
    assert impl in IMPLS, f"indexer.scores: impl {impl!r} not in {IMPLS}"
    assert row_stride(keys) % 8 == 0, "indexer.scores.keys: rows must be 16-byte aligned"
    args = (q, w, keys, i32(row_stride(keys)), n_valid, out, i32(row_stride(out)), i32(H), i32(N),
            np.float32(w_scale))
    if T and N and impl == "simt":
        k = kernel(STEM, "indexer_scores_d128")
        smem = dynamic_smem(k, H * 128 * 4 + 128 * 64 * 2)
        k(((N + 63) // 64, T), (256,), args, shared_mem=smem)
    elif T and N:
        k = kernel(STEM, "indexer_scores_mma_d128")
        smem = dynamic_smem(k, 3 * 64 * 136 * 2 + 64 * 65 * 4)
        k(((N + 255) // 256, T), (128,), args, shared_mem=smem)
    return out


def topk(scores, n_valid, k: int, out=None, offset: int = 0, order: str = "score", width=None):
    """Top min(k, n) of scores[t, :n] (n = min(n_valid[t], N)), score descending, ties -> lower
    index, as int32 idx + offset, -1 padded to ``width`` (default min(k, N)) columns.
    scores [T, N] bf16 rows; order 'score' | 'index' (ascending index)."""
    check(scores, "indexer.topk.scores", np.uint16, rows_strided=True)
    T, N = scores.shape
    check(n_valid, "indexer.topk.n_valid", np.int32, (T,))
    assert 0 < k <= TOPK_MAX, f"indexer.topk: k = {k} outside 1..{TOPK_MAX}"
    assert order in ("score", "index"), f"indexer.topk: order {order!r}"
    width = min(k, N) if width is None else int(width)
    if out is None:
        out = out_array(None, "indexer.topk.out", (T, width), np.int32)
    check(out, "indexer.topk.out", np.int32, (T, width), rows_strided=True)
    if T and width:
        kernel(STEM, "indexer_topk")((T,), (512,), (scores, i32(row_stride(scores)), n_valid, i32(N), i32(k), out,
                                                    i32(row_stride(out)), i32(width), i32(offset),
                                                    i32(1 if order == "index" else 0)))
    return out
