"""Lightning-indexer ops (kernels_cu/indexer.cu).

scores(q, w, keys, n_valid)   twin oracle.ops.indexer_scores (columns < n_valid[t]; the rest -inf);
                              impl 'simt' (f32 FMA dots) or 'mma' (tensor-core dots, for long
                              prefills): the two differ in the dot's rounding, so a runtime must
                              use one of them for decode and prefill alike
topk(scores, n_valid, k)      twin oracle.ops.indexer_topk (order='score'); order='index' gives the
                              ascending canonical segment of host.indices.candidate_matrix
scores_topk(q, w, keys, n_valid, k, scores_out, sel_out)
                              decode (T = 1): scores(impl='simt') + topk(order='index'), the same
                              score bits and the same selection, in one of two forms:
                              'fused': ONE launch (indexer_fused_d128); its last CTA (128
                              threads) selects, through a per-device ticket counter (workspace(),
                              made before any capture);
                              'split': indexer_scores_tiles_d128 (the fused kernel's scoring, the
                              shared body, + the high-byte histogram of the scores, the first
                              radix pass, in hist_workspace()) then indexer_select_d128 (one CTA
                              of 1024 threads: the low byte's pass and the ordered compaction,
                              keys in registers up to 16384): the 32K-context tail;
                              'auto' (default SELECT_FORM): split when the row's capacity N > k,
                              else fused.  The env MEMRA_DSV4_INDEXER_SELECT=fused|split|auto
                              overrides SELECT_FORM (read at every call; bench.decode_step's
                              idxsel arms).  Not a seam: the bytes do not change.
"""

from __future__ import annotations

import os

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import (check, dynamic_smem, i32, kernel, out_array,
                                        row_stride, sm_count, ticket_counter)

STEM = "indexer"
KERNELS = ("indexer_scores_d128", "indexer_scores_mma_d128", "indexer_topk", "indexer_fused_d128",
           "indexer_scores_tiles_d128", "indexer_select_d128", "indexer_fused_rows_d128",
           "indexer_scores_tiles_rows_d128", "indexer_select_rows_d128")
kernel_loader.register(STEM, KERNELS)

TOPK_MAX = 1024
FUSED_KEYS_PER_TILE = 16                  # kernels_cu/indexer.cu IF_KC
FUSED_SMEM = 64 * 132 * 4 + 128 * 16 * 4  # IF_SMEM
SELECT_THREADS = 1024                     # indexer_select_d128's block
SELECT_REG_CAP = 16384                    # IX_SEL_THREADS * IX_SEL_REG_STEPS: keys it holds in registers
SPLIT_KEYS_PER_TILE = 32                  # kernels_cu/indexer.cu IF_KC_SPLIT
SPLIT_SMEM = 64 * 132 * 4 + 128 * 32 * 4  # IF_SMEM_SPLIT (> 48 KiB: the kernel's limit is raised)
SPLIT_SCORE_CTAS_PER_SM = 2               # indexer_scores_tiles_d128's grid cap, CTAs per SM
SELECT_FORMS = ("fused", "split", "auto")
SELECT_FORM = "auto"                      # scores_topk's default form (the env overrides it)
SELECT_ENV = "MEMRA_DSV4_INDEXER_SELECT"
ROWS_MAX = 8                  # scores_topk_rows' rows (the device verify's: ops_decode.XROWS_MAX)
_WS: dict[int, object] = {}  # device -> int32 [1] ticket counter of indexer_fused_d128 (kept 0)
_ROWS_WS: dict[int, object] = {}    # device -> int32 [ROWS_MAX] the row form's counters (kept 0)
_ROWS_HIST: dict[int, object] = {}  # device -> int32 [ROWS_MAX * 256] its histograms (kept 0)
_HIST: dict[int, object] = {}  # device -> int32 [256] high-byte histogram of the split form (kept 0)


def workspace():
    """The current device's ticket counter of indexer_fused_d128 (_common.ticket_counter: int32 [1],
    zero between launches; made before the first capture by DeviceStep._prewarm)."""
    return ticket_counter(_WS, "indexer.workspace")


def hist_workspace():
    """The current device's high-byte histogram of the split form (_common.ticket_counter: int32
    [256], zero between calls: indexer_scores_tiles_d128 fills it, indexer_select_d128 reads and
    zeroes it; made before the first capture by DeviceStep._prewarm).  One per device: two split
    calls on one device must not overlap (the decode step runs one CSA layer's indexer at a time)."""
    return ticket_counter(_HIST, "indexer.hist_workspace", 256)


def rows_workspace():
    """The row form's per-row ticket counters (int32 [ROWS_MAX], zero between launches) and
    per-row high-byte histograms (int32 [ROWS_MAX * 256], zero between calls), the current
    device's; made before the first capture by DeviceStep._prewarm."""
    return (ticket_counter(_ROWS_WS, "indexer.rows_workspace", ROWS_MAX),
            ticket_counter(_ROWS_HIST, "indexer.rows_hist_workspace", ROWS_MAX * 256))


def select_form() -> str:
    """scores_topk's form when the caller gives none: MEMRA_DSV4_INDEXER_SELECT (fused | split |
    auto) when set and non-empty, else SELECT_FORM; read at every call (the bench arms set the env
    between steps).  ValueError on any other value."""
    env = os.environ.get(SELECT_ENV, "")
    form = env or SELECT_FORM
    if form not in SELECT_FORMS:
        src = SELECT_ENV if env else "indexer.SELECT_FORM"
        raise ValueError(f"{src} = {form!r}; allowed: {', '.join(SELECT_FORMS)}")
    return form


def resolve_form(form: str, N: int, k: int) -> str:
    """'auto' -> 'split' when the row can hold more keys than it selects (N > k: the selection is
    real work, which the fused kernel's last CTA does on 128 threads; 32K context: 46.8 us fused
    against 27 us split on the device timeline), else 'fused' (every valid key is taken: one launch
    instead of two).  N is the row's capacity, fixed for a captured graph, so the form is too."""
    if form == "auto":
        return "split" if N > k else "fused"
    return form


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


def scores_topk(q, w, keys, n_valid, k: int, scores_out, sel_out, *, offset: int = 0,
                w_scale: float = 1.0, counter=None, form: str | None = None, hist=None):
    """One token: scores_out [1, N] bf16 = scores(q, w, keys, n_valid, w_scale=w_scale) (the
    'simt' bits) and sel_out [1, width] int32 = topk(scores_out, n_valid, k, offset=offset,
    order='index', width=width), in one launch.  q [1, H, 128] bf16; w [1, H] bf16; keys [N, 128]
    bf16 rows; n_valid [1] int32 (read on the device); width >= min(k, N).  counter: int32 [1],
    zero (default: workspace()).  form: 'fused' (indexer_fused_d128, one launch), 'split'
    (indexer_scores_tiles_d128 then indexer_select_d128: the same bytes; hist, int32 [256], zero,
    default hist_workspace(), instead of counter) or 'auto' (resolve_form: split when N > k); None:
    select_form().  Allocates nothing (scores_out / sel_out are the caller's).  Returns sel_out."""
    check(q, "indexer.scores_topk.q", np.uint16)
    assert q.ndim == 3 and q.shape[0] == 1 and q.shape[2] == 128, (
        f"indexer.scores_topk.q: expected [1, H, 128] (one token), got {q.shape}")
    H = q.shape[1]
    assert H % 4 == 0 and H <= 64, f"indexer.scores_topk: H = {H} (need H % 4 == 0, H <= 64)"
    check(w, "indexer.scores_topk.w", np.uint16, (1, H))
    check(keys, "indexer.scores_topk.keys", np.uint16, rows_strided=True)
    N = keys.shape[0]
    assert keys.shape[1] == 128 and N > 0, f"indexer.scores_topk.keys: expected [N > 0, 128], got {keys.shape}"
    assert row_stride(keys) % 8 == 0 and keys.data.ptr % 16 == 0, "indexer.scores_topk.keys: 16-byte aligned rows"
    assert q.data.ptr % 16 == 0, "indexer.scores_topk.q: 16-byte alignment"
    check(n_valid, "indexer.scores_topk.n_valid", np.int32, (1,))
    check(scores_out, "indexer.scores_topk.scores_out", np.uint16, (1, N))
    assert scores_out.data.ptr % 16 == 0, "indexer.scores_topk.scores_out: 16-byte alignment (read back as uint4)"
    assert 0 < k <= TOPK_MAX, f"indexer.scores_topk: k = {k} outside 1..{TOPK_MAX}"
    check(sel_out, "indexer.scores_topk.sel_out", np.int32, (1, None))
    width = sel_out.shape[1]
    assert width >= min(k, N), f"indexer.scores_topk: width {width} < min(k, N) = {min(k, N)}"
    form = select_form() if form is None else form
    assert form in SELECT_FORMS, f"indexer.scores_topk: form {form!r} not in {SELECT_FORMS}"
    form = resolve_form(form, N, k)
    tiles = -(-N // FUSED_KEYS_PER_TILE)
    grid = (max(1, min(tiles, 2 * sm_count())),)
    if form == "split":
        # scores: the fused kernel's body (the bits depend on neither the tile size nor the grid) on
        # tiles of SPLIT_KEYS_PER_TILE keys + the high-byte histogram (hist, zero here); up to
        # SPLIT_SCORE_CTAS_PER_SM CTAs per SM (49 KB smem each)
        hist = hist_workspace() if hist is None else check(hist, "indexer.scores_topk.hist", np.int32, (256,))
        kern = kernel(STEM, "indexer_scores_tiles_d128")
        split_tiles = -(-N // SPLIT_KEYS_PER_TILE)
        kern((max(1, min(split_tiles, SPLIT_SCORE_CTAS_PER_SM * sm_count())),), (128,),
             (q, w, keys, i32(row_stride(keys)), n_valid, scores_out, i32(H), i32(N), np.float32(w_scale), i32(k),
              sel_out, i32(width), i32(offset), hist),
             shared_mem=dynamic_smem(kern, SPLIT_SMEM))
        # selection: one CTA of 1024 threads; reads scores_out and hist after its PDL wait (the
        # whole scoring grid done), n_valid on the device; zeroes hist; static shared memory only
        sel = kernel(STEM, "indexer_select_d128")
        sel((1,), (SELECT_THREADS,), (scores_out, n_valid, i32(N), i32(k), sel_out, i32(width), i32(offset), hist))
        return sel_out
    counter = workspace() if counter is None else check(counter, "indexer.scores_topk.counter", np.int32, (1,))
    kern = kernel(STEM, "indexer_fused_d128")
    kern(grid, (128,),
         (q, w, keys, i32(row_stride(keys)), n_valid, scores_out, i32(H), i32(N), np.float32(w_scale), i32(k),
          sel_out, i32(width), i32(offset), counter),
         shared_mem=dynamic_smem(kern, FUSED_SMEM))
    return sel_out


def scores_topk_rows(q, w, keys, n_valid, k: int, scores_out, sel_out, *, offset: int = 0,
                     w_scale: float = 1.0, form: str | None = None, workspaces=None):
    """scores_topk for T <= ROWS_MAX rows over the same keys in one launch per kernel (the device
    verify's rows; grid.y = T): row t's scores_out[t] and sel_out[t] are the bytes scores_topk
    makes for (q[t:t+1], w[t:t+1], n_valid[t, 0]) alone, in the same form (``form`` resolved as
    there, from N and k: the same for every row).  q [T, H, 128] bf16, w [T, H] bf16, n_valid
    int32 [T, m] (column 0 read: the rows' step scalars), scores_out [T, N] bf16, sel_out [T,
    width] int32, all C-contiguous.  workspaces: (counters int32 [>= T], hists int32 [>= 256 T]),
    zero (default rows_workspace()).  Returns sel_out."""
    check(q, "indexer.scores_topk_rows.q", np.uint16)
    assert q.ndim == 3 and 1 <= q.shape[0] <= ROWS_MAX and q.shape[2] == 128, (
        f"indexer.scores_topk_rows.q: expected [T <= {ROWS_MAX}, H, 128], got {q.shape}")
    T, H = q.shape[0], q.shape[1]
    assert H % 4 == 0 and H <= 64, f"indexer.scores_topk_rows: H = {H} (need H % 4 == 0, H <= 64)"
    check(w, "indexer.scores_topk_rows.w", np.uint16, (T, H))
    check(keys, "indexer.scores_topk_rows.keys", np.uint16, rows_strided=True)
    N = keys.shape[0]
    assert keys.shape[1] == 128 and N > 0, f"indexer.scores_topk_rows.keys: expected [N > 0, 128], got {keys.shape}"
    assert row_stride(keys) % 8 == 0 and keys.data.ptr % 16 == 0, "indexer.scores_topk_rows.keys: 16-byte aligned rows"
    assert q.data.ptr % 16 == 0, "indexer.scores_topk_rows.q: 16-byte alignment"
    check(n_valid, "indexer.scores_topk_rows.n_valid", np.int32, (T, None))
    check(scores_out, "indexer.scores_topk_rows.scores_out", np.uint16, (T, N))
    assert scores_out.data.ptr % 16 == 0 and (T == 1 or N % 8 == 0), (
        f"indexer.scores_topk_rows.scores_out: rows must be 16-byte aligned (read back as uint4): "
        f"address {scores_out.data.ptr:#x}, N = {N}")
    assert 0 < k <= TOPK_MAX, f"indexer.scores_topk_rows: k = {k} outside 1..{TOPK_MAX}"
    check(sel_out, "indexer.scores_topk_rows.sel_out", np.int32, (T, None))
    width = sel_out.shape[1]
    assert width >= min(k, N), f"indexer.scores_topk_rows: width {width} < min(k, N) = {min(k, N)}"
    form = select_form() if form is None else form
    assert form in SELECT_FORMS, f"indexer.scores_topk_rows: form {form!r} not in {SELECT_FORMS}"
    form = resolve_form(form, N, k)
    counters, hists = rows_workspace() if workspaces is None else workspaces
    check(counters, "indexer.scores_topk_rows.counters", np.int32)
    check(hists, "indexer.scores_topk_rows.hists", np.int32)
    assert counters.size >= T and hists.size >= 256 * T, (
        f"indexer.scores_topk_rows: workspaces {counters.size} / {hists.size} for {T} rows")
    ld_q, ld_nv = H * 128, n_valid.shape[1]
    if form == "split":   # scores_topk's split form per row: the same grid x extent, grid.y = T
        kern = kernel(STEM, "indexer_scores_tiles_rows_d128")
        split_tiles = -(-N // SPLIT_KEYS_PER_TILE)
        kern((max(1, min(split_tiles, SPLIT_SCORE_CTAS_PER_SM * sm_count())), T), (128,),
             (q, i32(ld_q), w, i32(H), keys, i32(row_stride(keys)), n_valid, i32(ld_nv), scores_out, i32(N),
              i32(H), i32(N), np.float32(w_scale), hists),
             shared_mem=dynamic_smem(kern, SPLIT_SMEM))
        kernel(STEM, "indexer_select_rows_d128")(
            (1, T), (SELECT_THREADS,),
            (scores_out, i32(N), n_valid, i32(ld_nv), i32(N), i32(k), sel_out, i32(width), i32(width),
             i32(offset), hists))
        return sel_out
    kern = kernel(STEM, "indexer_fused_rows_d128")
    tiles = -(-N // FUSED_KEYS_PER_TILE)
    kern((max(1, min(tiles, 2 * sm_count())), T), (128,),
         (q, i32(ld_q), w, i32(H), keys, i32(row_stride(keys)), n_valid, i32(ld_nv), scores_out, i32(N),
          i32(H), i32(N), np.float32(w_scale), i32(k), sel_out, i32(width), i32(width), i32(offset), counters),
         shared_mem=dynamic_smem(kern, FUSED_SMEM))
    return sel_out
