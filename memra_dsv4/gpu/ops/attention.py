"""Sparse attention with sinks (kernels_cu/attention.cu), twin oracle.ops.sparse_attention_with_sinks.

sparse_attention(q, kv, idx, sink, scale, probs_bf16=False, n_split=1, q_norm=None)
    probs_bf16=False: the ``bf16`` numeric class (P kept f32); True: the ``reference`` class
    (P cast to bf16 before P.V, relative to each 32-candidate tile's max).
    n_split > 1 spreads each (token, head group)'s tiles over n_split CTAs and merges the
    per-tile partials in tile order with a second kernel: the same bits as n_split = 1, more
    parallelism for decode.  The workspace (f32, workspace_size() elements) may be passed in.
    q_norm = (eps, pos, cos, sin): q is the RAW q and the kernel (sparse_attn_*_qn) applies the
    per-head q norm + q RoPE at its q load, with rmsnorm.head_rms's code (kernels_cu/
    head_rms.cuh): byte-for-byte rmsnorm.head_rms(q, eps, rope=(pos, cos, sin)) then
    sparse_attention of the result; q itself is not written (the device step's seam
    MEMRA_DSV4_DECODE_QNORM = attn; sparse_attention_decode takes it too).

sparse_attention_decode(q, kv, pos, window, ratio, sel, K, sink, scale, ...)
    The device step's form (ONE token, graph-safe): build_cand's candidate list computed inside
    the kernel from pos (int32 [1] on the device), the window, the ratio and the indexer's
    selection, the split over n_split CTAs and the tile-order merge of the partials (by the CTAs
    that finish last, through per-device ticket counters: decode_counters(), made before any
    capture)
    in ONE launch: byte-for-byte ops_decode.build_cand + sparse_attention(n_split) (split +
    combine kernels), which stay callable as the reference.

sparse_attention_mma(q, kv, idx, sink, scale, probs_bf16=False, heads_per_cta=16)
    The prefill form (many tokens): Q.K^T and P.V on tensor cores (mma.sync m16n8k16, bf16 ->
    f32).  Same tiles, tile statistics, merge, sink, epilogue and numeric classes as
    sparse_attention; the dots accumulate in another fixed f32 order, and in the bf16 class P
    enters P.V as bf16(p) + bf16(p - bf16(p)) (within 2^-16 of p).  So it is NOT bit-identical
    to sparse_attention (both are within the twin's bf16-class bound), but it is deterministic
    and a token's output does not depend on the other tokens of the launch.
    mma_supported(T, H, D) says whether a launch qualifies (D in {128, 512}; any H: heads past
    the last multiple of 16 are zero rows in the MMA, not stored) and is worth it
    (T >= MMA_MIN_T): the chunk routine's selector.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, cupy, dynamic_smem, i32, kernel, null_or, out_array, row_stride, sm_count, ticket_counter

STEM = "attention"
KERNELS = ("sparse_attn_d512_hg16", "sparse_attn_d512_hg8", "sparse_attn_d512_hg4",
           "sparse_attn_d128_hg16", "sparse_attn_d128_hg8", "sparse_attn_d128_hg4",
           "sparse_attn_combine_d512", "sparse_attn_combine_d128",
           "sparse_attn_decode_d512_hg16", "sparse_attn_decode_d512_hg8", "sparse_attn_decode_d512_hg4",
           "sparse_attn_decode_d128_hg16", "sparse_attn_decode_d128_hg8", "sparse_attn_decode_d128_hg4",
           "sparse_attn_d512_hg16_qn", "sparse_attn_d512_hg8_qn", "sparse_attn_d512_hg4_qn",
           "sparse_attn_d128_hg16_qn", "sparse_attn_d128_hg8_qn", "sparse_attn_d128_hg4_qn",
           "sparse_attn_decode_d512_hg16_qn", "sparse_attn_decode_d512_hg8_qn",
           "sparse_attn_decode_d512_hg4_qn", "sparse_attn_decode_d128_hg16_qn",
           "sparse_attn_decode_d128_hg8_qn", "sparse_attn_decode_d128_hg4_qn",
           "sparse_attn_mma_d512_hg16", "sparse_attn_mma_d512_hg32", "sparse_attn_mma_d128_hg16")
kernel_loader.register(STEM, KERNELS)

TILE = 32
# head group -> threads (HG = heads-per-warp * warps)
_HG_THREADS = {16: 256, 8: 256, 4: 128}


def _rope_args(inverse_rope, T: int, D: int, name: str) -> tuple:
    """The kernels' OutRope arguments (pos, cos, sin, R): the inverse RoPE of the output's last
    R dims at positions pos [T] (cos / sin [positions, R/2] f32), or null pointers and R = 0."""
    if inverse_rope is None:
        return (null_or(None), null_or(None), null_or(None), i32(0))
    rpos, rcos, rsin = inverse_rope
    check(rpos, f"{name}.rope_pos", np.int32, (T,))
    check(rcos, f"{name}.cos", np.float32)
    check(rsin, f"{name}.sin", np.float32, rcos.shape)
    R = 2 * rcos.shape[1]
    assert R % 8 == 0 and R <= D, f"{name}: rope dims {R} unsupported"
    return (rpos, rcos, rsin, i32(R))


def _qnorm_args(q_norm, T: int, D: int, name: str) -> tuple:
    """The _qn kernels' q norm arguments (eps, pos, cos, sin, R) of q_norm = (eps, pos, cos, sin):
    rmsnorm.head_rms's eps (applied as float32, as there) and its q RoPE of the last R dims at
    positions pos [T] int32 (cos / sin [n_pos, R/2] f32); pos = cos = sin = None: no rotation."""
    assert isinstance(q_norm, tuple) and len(q_norm) == 4, (
        f"{name}.q_norm: expected (eps, pos, cos, sin), got {q_norm!r}")
    eps, qpos, qcos, qsin = q_norm
    if qpos is None:
        assert qcos is None and qsin is None, f"{name}.q_norm: cos / sin without pos"
        return (np.float32(eps), null_or(None), null_or(None), null_or(None), i32(0))
    check(qpos, f"{name}.q_norm.pos", np.int32, (T,))
    check(qcos, f"{name}.q_norm.cos", np.float32, (None, None))
    check(qsin, f"{name}.q_norm.sin", np.float32, qcos.shape)
    R = 2 * qcos.shape[1]
    assert R % 8 == 0 and 8 <= R <= D, f"{name}.q_norm: rope dims {R} unsupported"
    return (np.float32(eps), qpos, qcos, qsin, i32(R))


HEAD_GROUPS = (16, 8, 4)   # the kernels' heads per CTA (sparse_attn_*_hg{HG})


def head_group(H: int, hg: int | None = None) -> int:
    """Heads per CTA: the largest of HEAD_GROUPS dividing H (the bandwidth-friendly layout: every
    gathered kv row serves HG heads), or the given hg, refused unless it is an int (a bool or a
    float is refused, naming the value), one of HEAD_GROUPS and divides H.  The group never
    changes a head's arithmetic (its dots, tile statistics and merge are per head), so every
    group gives the same bits."""
    if hg is not None:
        if isinstance(hg, bool) or not isinstance(hg, (int, np.integer)):
            raise AssertionError(f"sparse_attention: head_group must be an int or None, got {hg!r}")
        hg = int(hg)
        assert hg in HEAD_GROUPS, f"sparse_attention: head_group {hg} is not one of {HEAD_GROUPS}"
        assert H % hg == 0, f"sparse_attention: head_group {hg} does not divide H = {H}"
        return hg
    for hg in HEAD_GROUPS:
        if H % hg == 0:
            return hg
    raise AssertionError(f"sparse_attention: H = {H} must be a multiple of 4")


_head_group = head_group   # for sparse_attention, whose head_group argument shadows the function


def tile_buffers(H: int, hg: int, nt: int, n_split: int) -> int:
    """Tile buffers (TILE rows of D bf16 each) of sparse_attn_d*_hg{hg}'s dynamic shared memory
    for H heads: two (the gather of tile i + 1 beside the math of tile i), or one where every CTA
    has a single tile (ceil(nt / n_split) == 1: sparse_attn_body touches only buffer 0) and the
    group was chosen below H's own (head_group(H)), as the device step does with
    MEMRA_DSV4_DECODE_ATTN_HG (every tile its own CTA): half the shared memory, so more of them,
    the combine's CTAs and the next GEMV's fit beside each other.  Every launch at H's own group
    keeps two buffers, as measured.  The bytes: GPU-tested (tests/gpu/test_kernels_attention.py
    head-group tests, twenty-sixth session call 6); the speed not measured yet."""
    single = -(-int(nt) // max(1, int(n_split))) == 1
    return 1 if single and int(hg) < head_group(int(H)) else 2


def n_tiles(K: int) -> int:
    return (int(K) + TILE - 1) // TILE


def workspace_size(T: int, H: int, D: int, K: int) -> int:
    """float32 elements of the split-path workspace: T*H*n_tiles*(2 + D)."""
    return int(T) * int(H) * n_tiles(K) * (2 + int(D))


def auto_split(T: int, H: int, K: int, hg: int | None = None) -> int:
    """Enough CTAs for ~2 waves when the fused grid is small (decode); 1 otherwise (hg: the
    head group, head_group(H, hg))."""
    ctas = T * (H // head_group(H, hg))
    target = 2 * sm_count()
    if ctas >= target:
        return 1
    return max(1, min(n_tiles(K), (target + ctas - 1) // ctas))


def sparse_attention(q, kv, idx, sink, scale: float, out=None, *, probs_bf16: bool = False,
                     n_split: int | None = 1, workspace=None, inverse_rope=None, q_norm=None,
                     head_group: int | None = None):
    """q [T, H, D] bf16; kv [N, D] bf16 rows (K = V; last axis contiguous, e.g. a cache view);
    idx [T, K] int32 (-1 = skip); sink [H] f32 -> out [T, H, D] bf16.  D in {128, 512}.
    head_group: heads per CTA (None: the largest of HEAD_GROUPS dividing H; the same bits with
    any).  n_split None = auto_split (for the head group: every tile its own CTA when the
    groups are few, as in decode).  inverse_rope = (pos [T] int32, cos, sin [n_pos, R/2] f32): apply
    the inverse RoPE of the output's last R dims in the epilogue (= rope.rope(out, ..., inverse=True)).
    q_norm = (eps, pos [T] int32 | None, cos, sin [n_pos, R/2] f32 | None): q is the raw q, normed
    (+ roped) per head inside the kernel = rmsnorm.head_rms(q, eps, rope=(pos, cos, sin)) first,
    bit for bit, without writing q (out must not alias q)."""
    check(q, "sparse_attention.q", np.uint16)
    assert q.ndim == 3, f"sparse_attention.q: expected [T, H, D], got {q.shape}"
    T, H, D = q.shape
    assert D in (128, 512), f"sparse_attention: head dim {D} unsupported (128, 512)"
    check(kv, "sparse_attention.kv", np.uint16, rows_strided=True)
    assert kv.shape[1] == D, f"sparse_attention.kv: row width {kv.shape[1]} != {D}"
    assert row_stride(kv) % 8 == 0, "sparse_attention.kv: rows must be 16-byte aligned"
    check(idx, "sparse_attention.idx", np.int32)
    assert idx.ndim == 2 and idx.shape[0] == T, f"sparse_attention.idx: expected [{T}, K], got {idx.shape}"
    K = idx.shape[1]
    check(sink, "sparse_attention.sink", np.float32, (H,))
    out = out_array(out, "sparse_attention.out", (T, H, D), np.uint16)
    hg = _head_group(H, head_group)   # refused before any launch, T = 0 included
    if T == 0:
        return out
    if n_split is None:
        n_split = auto_split(T, H, K, hg)
    nt = n_tiles(K)
    n_split = max(1, min(int(n_split), max(1, nt)))
    rope_args = _rope_args(inverse_rope, T, D, "sparse_attention")
    if q_norm is None:
        qn_args, qn = (), ""
    else:
        assert out.data.ptr != q.data.ptr, "sparse_attention: with q_norm, out must not alias q"
        qn_args, qn = _qnorm_args(q_norm, T, D, "sparse_attention"), "_qn"
    k = kernel(STEM, f"sparse_attn_d{D}_hg{hg}{qn}")
    smem = dynamic_smem(k, tile_buffers(H, hg, nt, n_split) * TILE * D * 2)
    if n_split == 1:
        k((T, H // hg, 1), (_HG_THREADS[hg],),
          (q, kv, i32(row_stride(kv)), idx, i32(K), sink, np.float32(scale), out, i32(H),
           i32(int(probs_bf16)), null_or(None), null_or(None)) + rope_args + qn_args, shared_mem=smem)
        return out
    need = workspace_size(T, H, D, K)
    if workspace is None:
        workspace = cupy().empty((need,), dtype=np.float32)
    check(workspace, "sparse_attention.workspace", np.float32)
    assert workspace.size >= need, f"sparse_attention.workspace: {workspace.size} < {need} floats"
    ws_ml = workspace[: T * H * nt * 2]
    ws_acc = workspace[T * H * nt * 2: need]
    k((T, H // hg, n_split), (_HG_THREADS[hg],),
      (q, kv, i32(row_stride(kv)), idx, i32(K), sink, np.float32(scale), out, i32(H),
       i32(int(probs_bf16)), ws_ml, ws_acc) + rope_args + qn_args, shared_mem=smem)
    kernel(STEM, f"sparse_attn_combine_d{D}")((T, H), (D // 4,),
                                              (ws_ml, ws_acc, sink, out, i32(H), i32(nt)) + rope_args,
                                              shared_mem=combine_smem(D, nt))
    return out


# attention.cu COMB_STAGE_BYTES: the combine stages a head's partials in shared memory when they fit
COMB_STAGE_BYTES = 48 * 1024


def combine_smem(D: int, n_tiles: int) -> int:
    """Dynamic shared memory of sparse_attn_combine_d{D} for n_tiles partials: n_tiles * (D + 2)
    floats when that is at most COMB_STAGE_BYTES (the kernel stages them: comb_staged), else 0
    (the kernel reads them from L2 as it merges).  The kernel decides by the same rule."""
    b = int(n_tiles) * (int(D) + 2) * 4
    return b if b <= COMB_STAGE_BYTES else 0


# ----------------------------------------------------------------------------- decode form
_N_COUNTERS = 64  # head groups per device the ticket counters cover (H / HG)
_WS: dict[int, object] = {}  # device -> int32 [_N_COUNTERS] ticket counters (kept 0)
# Upper bound of decode_mergers().  1 = the plain last-CTA pattern: the single merger is the last
# arrival, which never waits (the merge of a whole head group then runs on one SM).
MAX_DECODE_MERGERS = 8


def decode_counters():
    """The current device's ticket counters of sparse_attn_decode_* (int32 [64], zero; every
    launch leaves them zero); ``_common.ticket_counter`` rules: made before the first capture
    (DeviceStep._prewarm does), not for concurrent launches on two streams of one device."""
    return ticket_counter(_WS, "attention.decode_counters", _N_COUNTERS)


def decode_mergers(H: int, D: int, n_split: int) -> int:
    """CTAs per head group that merge (sparse_attn_decode_*): enough to give every thread of a
    merger one 4-dim slot (HG * D/4 slots), at most n_split, and few enough that at most
    (H/HG) * (n_mergers - 1) CTAs wait at once, below the SM count (forward progress)."""
    hg = head_group(H)
    slots, threads = hg * (D // 4), _HG_THREADS[hg]
    groups = H // hg
    n = max(1, min(int(n_split), slots // threads, MAX_DECODE_MERGERS))
    return max(1, min(n, (sm_count() - 1) // groups + 1))


def sparse_attention_decode(q, kv, pos, window: int, ratio: int, sel, K: int, sink, scale: float,
                            out=None, *, probs_bf16: bool = False, n_split: int | None = None,
                            n_merge: int | None = None, workspace=None, counters=None, inverse_rope=None,
                            q_norm=None):
    """One token: q [1, H, D] bf16; kv [N, D] bf16 rows (ring of `window` rows, then the
    compressed entries at row window + e); pos int32 [1] (device); ratio (0: window only);
    sel int32 [sel_w] (CSA: the indexer's ascending entry ids, -1 padded) or None (HCA: every
    entry below (pos + 1) // ratio); K = the candidate count (window + sel_w, or window + the
    compressed rows); sink [H] f32 -> out [1, H, D] bf16.  = ops_decode.build_cand(pos, cand,
    window, ratio, sel) then sparse_attention(q, kv, cand.reshape(1, K), sink, scale, n_split=...),
    bit for bit.  n_split None = auto_split; n_merge None = decode_mergers; workspace as
    sparse_attention; counters int32 [>= H/HG] zero (default: decode_counters()).  q_norm as
    sparse_attention's (pos [1]): q raw, normed + roped in the kernel (sparse_attn_decode_*_qn)."""
    check(q, "sparse_attention_decode.q", np.uint16)
    assert q.ndim == 3 and q.shape[0] == 1, f"sparse_attention_decode.q: expected [1, H, D], got {q.shape}"
    _, H, D = q.shape
    assert D in (128, 512), f"sparse_attention_decode: head dim {D} unsupported (128, 512)"
    check(kv, "sparse_attention_decode.kv", np.uint16, rows_strided=True)
    assert kv.shape[1] == D, f"sparse_attention_decode.kv: row width {kv.shape[1]} != {D}"
    assert row_stride(kv) % 8 == 0, "sparse_attention_decode.kv: rows must be 16-byte aligned"
    check(pos, "sparse_attention_decode.pos", np.int32, (1,))
    W, ratio, K = int(window), int(ratio), int(K)
    assert W >= 1 and K >= W and ratio >= 0, f"sparse_attention_decode: window {W}, ratio {ratio}, K {K}"
    sel_w = 0
    if sel is not None:
        check(sel, "sparse_attention_decode.sel", np.int32)
        assert ratio > 0, "sparse_attention_decode: a selection needs ratio > 0"
        sel_w = sel.size
    check(sink, "sparse_attention_decode.sink", np.float32, (H,))
    out = out_array(out, "sparse_attention_decode.out", (1, H, D), np.uint16)
    hg = head_group(H)
    groups = H // hg
    nt = n_tiles(K)
    if n_split is None:
        n_split = auto_split(1, H, K)
    n_split = max(1, min(int(n_split), max(1, nt)))
    if n_merge is None:
        n_merge = decode_mergers(H, D, n_split)
    n_merge = int(n_merge)
    assert 1 <= n_merge <= n_split, f"sparse_attention_decode: n_merge {n_merge} outside 1..{n_split}"
    assert groups * (n_merge - 1) < sm_count(), (
        f"sparse_attention_decode: {groups} groups x {n_merge - 1} waiting mergers >= {sm_count()} SMs")
    if inverse_rope is not None:
        rpos, rcos, rsin = inverse_rope
        check(rpos, "sparse_attention_decode.rope_pos", np.int32, (1,))
        check(rcos, "sparse_attention_decode.cos", np.float32)
        check(rsin, "sparse_attention_decode.sin", np.float32, rcos.shape)
        R = 2 * rcos.shape[1]
        assert R % 8 == 0 and R <= D, f"sparse_attention_decode: rope dims {R} unsupported"
        rope_args = (rpos, rcos, rsin, i32(R))
    else:
        rope_args = (null_or(None), null_or(None), null_or(None), i32(0))
    if n_split > 1:
        need = workspace_size(1, H, D, K)
        if workspace is None:
            workspace = cupy().empty((need,), dtype=np.float32)
        check(workspace, "sparse_attention_decode.workspace", np.float32)
        assert workspace.size >= need, f"sparse_attention_decode.workspace: {workspace.size} < {need} floats"
        ws_ml, ws_acc = workspace[: H * nt * 2], workspace[H * nt * 2: need]
        if counters is None:
            counters = decode_counters()
        check(counters, "sparse_attention_decode.counters", np.int32)
        assert counters.size >= groups, f"sparse_attention_decode.counters: {counters.size} < {groups} groups"
        ws_args = (ws_ml, ws_acc, counters)
    else:
        ws_args = (null_or(None), null_or(None), null_or(None))
    if q_norm is None:
        qn_args, qn = (), ""
    else:
        assert out.data.ptr != q.data.ptr, "sparse_attention_decode: with q_norm, out must not alias q"
        qn_args, qn = _qnorm_args(q_norm, 1, D, "sparse_attention_decode"), "_qn"
    k = kernel(STEM, f"sparse_attn_decode_d{D}_hg{hg}{qn}")
    smem = dynamic_smem(k, 2 * TILE * D * 2)
    k((1, groups, n_split), (_HG_THREADS[hg],),
      (q, kv, i32(row_stride(kv)), pos, i32(W), i32(ratio), null_or(sel), i32(sel_w), i32(K), sink,
       np.float32(scale), out, i32(H), i32(int(probs_bf16))) + ws_args + (i32(n_merge),) + rope_args
      + qn_args, shared_mem=smem)
    return out


# ----------------------------------------------------------------------------- tensor-core form
# Below this many tokens the chunk routine keeps the SIMT kernel (decode-sized verify chunks: the
# MMA kernel's grid of T * H/16 CTAs is too small to matter and the SIMT path stays bit-identical
# to the device step there).
MMA_MIN_T = 64
# (D, heads per CTA) -> threads; each warp owns 16 heads x D/4 dims of the output
_MMA_VARIANTS = {(512, 16): 128, (512, 32): 256, (128, 16): 128}
# Heads per CTA when the caller does not say (D = 512; D = 128 has 16 only).  16: 4 warps, 3 CTAs
# per SM; 32: 8 warps, 1 CTA per SM, but each token's kv rows are gathered H/32 instead of H/16
# times (L2 traffic halved).  tools/bench_prefill_attention.py times both; the outputs are
# bit-identical, so this is a pure speed choice.
MMA_HEADS_PER_CTA = 16


def _heads_per_cta(D: int, heads_per_cta: int | None) -> int:
    if heads_per_cta is not None:
        return int(heads_per_cta)
    return MMA_HEADS_PER_CTA if (int(D), MMA_HEADS_PER_CTA) in _MMA_VARIANTS else 16


def mma_supported(T: int, H: int, D: int, heads_per_cta: int | None = None) -> bool:
    """True when sparse_attention_mma handles D with heads_per_cta (None: the default), H >= 1
    and T >= MMA_MIN_T."""
    return (int(T) >= MMA_MIN_T and int(H) >= 1
            and (int(D), _heads_per_cta(D, heads_per_cta)) in _MMA_VARIANTS)


def mma_smem_bytes(D: int, heads_per_cta: int) -> int:
    """Dynamic shared memory of sparse_attn_mma_*: two 32-row kv tiles padded to D + 8 bf16,
    plus the f32 S partials (16 heads x 32 slots x 4 dim slices per 16-head group)."""
    return 2 * TILE * (int(D) + 8) * 2 + (int(heads_per_cta) // 16) * 4 * 16 * TILE * 4


def sparse_attention_mma(q, kv, idx, sink, scale: float, out=None, *, probs_bf16: bool = False,
                         inverse_rope=None, heads_per_cta: int | None = None):
    """As sparse_attention (n_split = 1) with the dots on tensor cores: q [T, H, D] bf16 (C-contiguous),
    kv [N, D] bf16 rows (last axis contiguous, 16-byte aligned rows), idx [T, K] int32 (-1 = skip),
    sink [H] f32 -> out [T, H, D] bf16.  D in {128, 512}; heads_per_cta 16 (D = 512 also 32;
    None: MMA_HEADS_PER_CTA where D allows it, else 16); any H
    (the last CTA's heads >= H are computed as zero rows and not stored).  inverse_rope as sparse_attention.  Any T (MMA_MIN_T is the chunk
    routine's choice, not a limit)."""
    check(q, "sparse_attention_mma.q", np.uint16)
    assert q.ndim == 3, f"sparse_attention_mma.q: expected [T, H, D], got {q.shape}"
    T, H, D = q.shape
    hpc = _heads_per_cta(D, heads_per_cta)
    assert (D, hpc) in _MMA_VARIANTS, f"sparse_attention_mma: (D, heads_per_cta) = {(D, hpc)} unsupported"
    check(kv, "sparse_attention_mma.kv", np.uint16, rows_strided=True)
    assert kv.shape[1] == D, f"sparse_attention_mma.kv: row width {kv.shape[1]} != {D}"
    assert row_stride(kv) % 8 == 0 and kv.data.ptr % 16 == 0, \
        "sparse_attention_mma.kv: rows must be 16-byte aligned"
    check(idx, "sparse_attention_mma.idx", np.int32)
    assert idx.ndim == 2 and idx.shape[0] == T, f"sparse_attention_mma.idx: expected [{T}, K], got {idx.shape}"
    K = idx.shape[1]
    check(sink, "sparse_attention_mma.sink", np.float32, (H,))
    out = out_array(out, "sparse_attention_mma.out", (T, H, D), np.uint16)
    if T == 0:
        return out
    rope_args = _rope_args(inverse_rope, T, D, "sparse_attention_mma")
    k = kernel(STEM, f"sparse_attn_mma_d{D}_hg{hpc}")
    smem = dynamic_smem(k, mma_smem_bytes(D, hpc))
    k((T, (H + hpc - 1) // hpc, 1), (_MMA_VARIANTS[(D, hpc)],),
      (q, kv, i32(row_stride(kv)), idx, i32(K), sink, np.float32(scale), out, i32(H),
       i32(int(probs_bf16))) + rope_args, shared_mem=smem)
    return out
