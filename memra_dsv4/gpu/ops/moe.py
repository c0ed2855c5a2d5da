"""MoE elementwise ops (kernels_cu/moe.cu).

swiglu(gate, up, limit, weight)   twin oracle.ops.swiglu_clamped, stored to bf16 (the w2 input)
combine(routed, idx, shared)      twin oracle.ops.moe_combine (bit-identical)

The prefill MoE's dispatch plan built on the device (kernels_cu/moe.cu "dispatch plan"; the
composition and its NumPy twin are gpu.ops.prefill_moe.dispatch_on_device / device_plan):
plan_count(idx, E, hist)                         per-segment pick counts of each expert
plan_scan(hist, E, ebase, eids, counts, items, meta, wg)  segment prefixes, rank order, rows,
                                                 items (fp4mma's, or wgmma's with wg=True)
plan_place(idx, k, E, hist, ebase, src, flat, rowof)  the row of every pick (stable)
plan_combine_pos(idx, rowof, pos)                the combine's rows, ascending expert id (stable)
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel, null_or, out_array, row_stride

STEM = "moe"
KERNELS = ("swiglu_clamped_bf16", "moe_combine_bf16", "moe_plan_count", "moe_plan_scan",
           "moe_plan_place", "moe_plan_combine_pos")
kernel_loader.register(STEM, KERNELS)


def swiglu(gate, up, limit: float, weight=None, out=None):
    """gate, up [S, I] bf16 rows (row-strided views allowed, e.g. halves of a [S, 2I] buffer);
    weight [S] f32 routing weights or None; limit <= 0 disables the clamps -> out [S, I] bf16."""
    check(gate, "swiglu.gate", np.uint16, rows_strided=True)
    S, I = gate.shape
    check(up, "swiglu.up", np.uint16, (S, I), rows_strided=True)
    assert I % 8 == 0 and row_stride(gate) % 8 == 0 and row_stride(up) % 8 == 0, (
        "swiglu: widths and row strides must be multiples of 8 (16-byte rows)")
    if weight is not None:
        check(weight, "swiglu.weight", np.float32, (S,))
    if out is None:
        out = out_array(None, "swiglu.out", (S, I), np.uint16)
    check(out, "swiglu.out", np.uint16, (S, I), rows_strided=True)
    if S * I:
        kernel(STEM, "swiglu_clamped_bf16")((grid_stride_blocks(S * I // 8),), (256,),
                                            (gate, i32(row_stride(gate)), up, i32(row_stride(up)), null_or(weight),
                                             out, i32(row_stride(out)), i32(S), i32(I), np.float64(limit)))
    return out


def combine(routed, idx, shared=None, out=None):
    """routed [T, k, D] bf16 (weighted expert outputs, pick order); idx [T, k] int32 expert ids;
    shared [T, D] bf16 or None -> out [T, D] bf16: f32 sum in ascending expert id (stable),
    then + shared, one rounding."""
    check(routed, "moe.combine.routed", np.uint16)
    T, k, D = routed.shape
    assert k <= 16 and D % 8 == 0, f"moe.combine: k = {k} (<= 16), D = {D} (% 8)"
    check(idx, "moe.combine.idx", np.int32, (T, k))
    if shared is not None:
        check(shared, "moe.combine.shared", np.uint16, (T, D))
    out = out_array(out, "moe.combine.out", (T, D), np.uint16)
    if T:
        kernel(STEM, "moe_combine_bf16")((T, (D // 8 + 127) // 128), (128,),
                                         (routed, idx, null_or(shared), out, i32(D), i32(k)))
    return out


# ------------------------------------------------------------------ dispatch plan (moe.cu)
PLAN_SEG = 1024     # picks per warp segment: the PLAN_* constants of kernels_cu/moe.cu
PLAN_WARPS = 8      # segments per CTA of count / place
PLAN_MAX_E = 1024   # most experts moe_plan_scan ranks (one thread each)
PLAN_BN = 64        # rows per fp4mma work item (experts.cu MMA_BN)
PLAN_WG_BN = 128    # rows per wgmma work item, at most (experts.cu wg::WG_BN)


def plan_segments(n: int) -> int:
    """Segments of PLAN_SEG picks over n picks (rows of the hist table)."""
    return -(-int(n) // PLAN_SEG)


def _plan_idx(idx, name):
    check(idx, name, np.int64)
    assert idx.ndim in (1, 2), f"{name}: idx must be [T, k] or flat, got {idx.shape}"
    n = int(idx.size)
    assert 0 < n < (1 << 31) - PLAN_SEG, f"{name}: {n} picks"
    return n


def _plan_grid(n: int) -> int:
    return max(1, -(-plan_segments(n) // PLAN_WARPS))


def plan_count(idx, E: int, hist):
    """hist[s, e] = picks of expert e among idx.flat[s * PLAN_SEG:(s + 1) * PLAN_SEG]; idx int64
    expert ids in [0, E) (others trap); hist int32 [plan_segments(n), E]."""
    n = _plan_idx(idx, "plan_count.idx")
    assert 1 <= E <= PLAN_MAX_E, f"plan_count: E = {E} (1..{PLAN_MAX_E})"
    check(hist, "plan_count.hist", np.int32, (plan_segments(n), E))
    _count(idx, n, E, hist)
    return hist


def _count(idx, n: int, E: int, hist):
    """plan_count's launch (arguments checked by the caller)."""
    kernel(STEM, "moe_plan_count")((_plan_grid(n),), (32 * PLAN_WARPS,), (idx, i32(n), i32(E), hist),
                                   shared_mem=PLAN_WARPS * E * 4)


def plan_scan(hist, E: int, ebase, eids, counts, items, meta, wg: bool = False):
    """One CTA: hist -> its exclusive prefix over segments; counts / eids of the active experts
    in rank order (count descending, id ascending; tails 0 / -1); ebase[e] = first row of expert e
    (-1: no picks); items [max_items, 4] = (e, row, rows, 0) per tile of each expert in rank order,
    zeros after: wg False the fp4mma tiles of PLAN_BN rows (the last one ragged), wg True the wgmma
    items (prefill_moe.wg_items' split: ceil(c / PLAN_WG_BN) items of up to PLAN_WG_BN rows, all
    but the last a multiple of 16); meta [2] = (n_active, n_items)."""
    check(hist, "plan_scan.hist", np.int32, (None, E))
    assert 1 <= E <= PLAN_MAX_E, f"plan_scan: E = {E} (1..{PLAN_MAX_E})"
    for a, nm in ((ebase, "ebase"), (eids, "eids"), (counts, "counts")):
        check(a, f"plan_scan.{nm}", np.int32, (E,))
    check(items, "plan_scan.items", np.int32, (None, 4))
    check(meta, "plan_scan.meta", np.int32, (2,))
    _scan(hist, E, ebase, eids, counts, items, meta, wg)
    return items


def _scan(hist, E: int, ebase, eids, counts, items, meta, wg: bool):
    """plan_scan's launch (arguments checked by the caller)."""
    kernel(STEM, "moe_plan_scan")((1,), (PLAN_MAX_E,), (hist, i32(hist.shape[0]), i32(E), i32(items.shape[0]),
                                                          i32(1 if wg else 0), ebase, eids, counts, items, meta))


def plan_place(idx, k: int, E: int, hist, ebase, src, flat, rowof):
    """Row p of every pick f (expert e, segment s) = ebase[e] + hist[s, e] (the prefix) + its rank
    among e's picks of segment s: src[p] = f // k, flat[p] = f, rowof[f] = p."""
    n = _plan_idx(idx, "plan_place.idx")
    assert n % int(k) == 0, f"plan_place: {n} picks, k = {k}"
    check(hist, "plan_place.hist", np.int32, (plan_segments(n), E))
    check(ebase, "plan_place.ebase", np.int32, (E,))
    for a, nm in ((src, "src"), (flat, "flat"), (rowof, "rowof")):
        check(a, f"plan_place.{nm}", np.int32, (n,))
    _place(idx, n, k, E, hist, ebase, src, flat, rowof)
    return src


def _place(idx, n: int, k: int, E: int, hist, ebase, src, flat, rowof):
    """plan_place's launch (arguments checked by the caller)."""
    kernel(STEM, "moe_plan_place")((_plan_grid(n),), (32 * PLAN_WARPS,),
                                   (idx, i32(n), i32(k), i32(E), hist, ebase, src, flat, rowof),
                                   shared_mem=PLAN_WARPS * E * 4)


def plan_combine_pos(idx, rowof, pos):
    """pos[t, r] = rowof[t * k + j] for token t's pick j of rank r in (expert id, j) order."""
    check(idx, "plan_combine_pos.idx", np.int64)
    T, k = idx.shape
    check(rowof, "plan_combine_pos.rowof", np.int32, (T * k,))
    check(pos, "plan_combine_pos.pos", np.int32, (T, k))
    if T:
        _combine_pos(idx, rowof, T, k, pos)
    return pos


def _combine_pos(idx, rowof, T: int, k: int, pos):
    """plan_combine_pos's launch (T > 0; arguments checked by the caller)."""
    kernel(STEM, "moe_plan_combine_pos")((-(-T // 256),), (256,), (idx, rowof, i32(T), i32(k), pos))


def plan_launches(idx, T: int, k: int, E: int, d, wg: bool) -> None:
    """plan_count, plan_scan, plan_place, plan_combine_pos of ``idx`` (int64 [T, k], C-contiguous,
    T * k > 0 picks) into the tables of ``d`` (prefill_moe.DeviceDispatch: the int32 views that
    prefill_moe.dispatch_on_device cut to exactly the shapes those four check), without the
    four wrappers' 15 argument checks: the same launches with the same arguments."""
    n = T * k
    _count(idx, n, E, d.seg)
    _scan(d.seg, E, d.ebase, d.eids, d.counts, d.items, d.meta, wg)
    _place(idx, n, k, E, d.seg, d.ebase, d.src, d.flat, d.rowof)
    _combine_pos(idx, d.rowof, T, k, d.pos)
