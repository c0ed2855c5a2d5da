"""Hyper-connection ops (kernels_cu/hc.cu).

hc_mixes(streams, fn, norm_eps)                  twin oracle.ops._hc_mixes (mixes only)
hc_pre_finish(mixes, scale, base, streams, ...)  twin host.hc.hc_split + oracle.ops._weighted_streams
hc_pre(streams, fn, scale, base, ...)            twin oracle.ops.hc_pre (= hc_mixes + hc_pre_finish)
hc_weighted_sum(pre, streams)                    twin oracle.ops._weighted_streams (host-substituted pre)
hc_head(streams, fn, scale, base, ...)           twin oracle.ops.hc_head
hc_post(f, residual, post, comb)                 twin oracle.ops.hc_post (bit-identical)
hc_boundary(streams, fn, scale, base, norm_w, ...)  one decode token's sub-layer boundary in one
    launch: [hc_post of the previous sub-layer] -> hc_pre -> rmsnorm; twin oracle.ops.hc_post ->
    hc_pre -> rmsnorm, and bit-identical to the unfused kernels hc_post -> hc_pre -> rmsnorm
hc_boundary_pre(...) + hc_boundary_sinkhorn(...)  hc_boundary in two launches, the same bytes in
    every output: the critical one (hc_post with the previous boundary's post / comb, mixes, pre,
    weighted sum, rmsnorm -> x, xn) and the Sinkhorn one (post, comb from the stored mixes: read
    only by the next boundary's hc_post), which the device step may run on a side graph branch
    beside the sub-layer (seam MEMRA_DSV4_HC_SPLIT)
hc_boundary_pre(..., handoff=)  the critical launch's two forms (PRE_HANDOFFS, the same bytes):
    "ticket"   hc_boundary_pre: n / 256 CTAs, one segment each; the last CTA to draw a ticket
               (fence + atomic) re-reads the partials and the streams through L2 and runs the tail
               (segment sums, weighted sum, rmsnorm of all D channels) alone;
    "cluster"  hc_boundary_pre_cluster: one thread-block cluster of D / 256 CTAs x 1024 threads
               (pre_cluster_ok: D % 256 == 0, D <= 4096), CTA r owning channels [256 r, 256 r +
               256) of the 4 streams; partials and x cross CTAs by st.async into each other's
               shared memory, every CTA runs the segment sums and the norm's sum of squares
               itself (the same order, the same bits) and writes its own channels: no ticket, no
               L2 round trip, no single-SM tail.
    "coop"     hc_boundary_pre_coop with 8 tail CTAs: the ticket form's grid and phase A (each CTA
               publishes its partials as tagged global words), then CTAs 0..7 form S of their
               D / 8 channels themselves (hc_post's expression, the same bits) while they poll
               the partials they need (one L2 round trip, no ticket, no fence), add the chains
               themselves (the same order, the same bits), form x, publish their share of
               rmsnorm_row's 128 sum-of-squares chains, poll all 128 (a second round trip) and
               write xn of their channels: the one-SM tail spread over 8 SMs; the other CTAs
               leave after phase A.  Up to ~0.5 us shorter alone, neutral in the step
               (twenty-fifth session): opt-in.
    "coopall"  the same kernel with every CTA a tail CTA (D / 64 channels each); measured slower
               in the step than "ticket" (twenty-fifth session), kept to compare.
    Both need pre_coop_ok(D): D in {1024, 2048, 4096, 8192} (the tail CTAs wait for all n / 256
    CTAs, so those must be co-resident: at most 128 of 256 threads).

Streams are [T, hc, D] bf16 (uint16) with hc = 4.

hc_boundary implementations (the same bytes in every output; BOUNDARY_IMPLS):
    "lastcta"  kernels_cu/hc.cu hc_boundary: the last CTA to draw a ticket (fence + atomic) runs
               the tail (segment sums, Sinkhorn, weighted sum, rmsnorm).  The default.
    "poll"     hc_boundary_poll: phase A publishes its partials in self-validating slots (release
               stores, no ticket); CTA 0 polls them (one L2 round trip after the last lands) and
               runs the tail with the Sinkhorn alone on its warp (post / pre on other warps).
               Its slots: _BND_SLOTS (ticket_counter: zeroed before any capture, left zero).
               Measured on the H200 (6089d42, tools/bench_hc_boundary.py): bit-identical, 8.95
               vs 9.02 us per boundary: the handoff was not the tail, so "lastcta" stays.
The module switch BOUNDARY_IMPL picks one; the environment variable MEMRA_DSV4_HC_BOUNDARY_IMPL,
read at every call, overrides it (benches / tests); hc_boundary(impl=...) overrides both.
"""

from __future__ import annotations

import os

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import (check, cupy, dynamic_smem, i32, kernel, out_array, sm_count,
                                        ticket_counter)

STEM = "hc"
KERNELS = ("hc_mixes_r6", "hc_mixes_r4", "hc_pre_split_apply", "hc_weighted_sum", "hc_head_apply",
           "hc_post", "hc_boundary", "hc_boundary_poll", "hc_boundary_pre", "hc_boundary_sinkhorn",
           "hc_boundary_pre_cluster", "hc_boundary_pre_coop")
kernel_loader.register(STEM, KERNELS, cluster=("hc_boundary_pre_cluster",))

HC = 4

BOUNDARY_IMPLS = ("lastcta", "poll")
BOUNDARY_IMPL = "lastcta"
BOUNDARY_IMPL_ENV = "MEMRA_DSV4_HC_BOUNDARY_IMPL"
_BND_SLOTS: dict = {}       # device -> int32 [2 * 128 * 32] (u64 slots of hc_boundary_poll)
_BND_SLOT_WORDS = 2 * 128 * 32


COOP_HANDOFFS = ("coop", "coopall")   # hc_boundary_pre_coop with 8 / all tail CTAs
PRE_HANDOFFS = ("ticket", "cluster") + COOP_HANDOFFS
COOP_TAIL_CTAS = 8            # hc_boundary_pre_coop's tail CTAs for handoff "coop" ("coopall": all)
PRE_CLUSTER_MAX_CTAS = 16     # the largest (non-portable) cluster of an H100 / H200
PRE_CLUSTER_CHANNELS = 256    # channels per CTA of hc_boundary_pre_cluster (one segment per stream)
PRE_CLUSTER_THREADS = 1024    # 4 units of 256: one per stream


def pre_cluster_ok(D: int) -> bool:
    """Whether hc_boundary_pre_cluster covers hidden size D: D / 256 CTAs of one cluster."""
    return D > 0 and D % PRE_CLUSTER_CHANNELS == 0 and D // PRE_CLUSTER_CHANNELS <= PRE_CLUSTER_MAX_CTAS


def pre_cluster_ctas(D: int) -> int:
    """CTAs of hc_boundary_pre_cluster's one cluster (each 1024 threads x <= 64 registers: a
    whole SM's register file)."""
    assert pre_cluster_ok(D), f"hc_boundary_pre_cluster: D = {D} not covered (pre_cluster_ok)"
    return D // PRE_CLUSTER_CHANNELS


# hc_boundary_pre_coop's slots (kernels_cu/hc.cu BCO_*): round 1 [128 segments][32][2] u64, round 2
# [128][2] u64, then the epoch word; int32 units, zero before the first launch (tags, never reset)
COOP_SLOT_INT32 = 2 * (128 * 32 * 2 + 128 * 2) + 2
_COOP_SLOTS: dict = {}      # device -> int32 [COOP_SLOT_INT32]


def pre_coop_ok(D: int) -> bool:
    """Whether hc_boundary_pre_coop covers hidden size D (both tail counts): each of NT tail CTAs
    (8 or G = D / 64) owns 128 / NT of rmsnorm_row's 128 threads (NT | 128, G <= 128) with
    D / 1024 chunks each (D % 1024 == 0), and at most 1024 channels (D / 8 <= 1024)."""
    return D in (1024, 2048, 4096, 8192)


def pre_handoff_covers(D: int, handoff: str) -> bool:
    """Whether the PRE_HANDOFFS form ``handoff`` covers hidden size D (the ticket form: every D
    hc_boundary_pre takes)."""
    if handoff == "cluster":
        return pre_cluster_ok(D)
    if handoff in COOP_HANDOFFS:
        return pre_coop_ok(D)
    assert handoff == "ticket", f"hc_boundary_pre: handoff {handoff!r} is not one of {PRE_HANDOFFS}"
    return True


def coop_tail_ctas(D: int, handoff: str) -> int:
    """hc_boundary_pre_coop's n_tail for a coop handoff: COOP_TAIL_CTAS ("coop") or D / 64 ("coopall")."""
    assert handoff in COOP_HANDOFFS and pre_coop_ok(D), (handoff, D)
    return COOP_TAIL_CTAS if handoff == "coop" else HC * D // SEG


def coop_slots():
    """hc_boundary_pre_coop's tagged slots + epoch on the current device (allocated zeroed once,
    before any capture: DeviceStep._prewarm; the kernel never needs them reset)."""
    return ticket_counter(_COOP_SLOTS, "hc_boundary_pre(coop)", size=COOP_SLOT_INT32)


def pre_launch_shape(D: int, handoff: str) -> dict:
    """hc_boundary_pre's launch for hidden size D and a PRE_HANDOFFS form: grid, block, the
    dynamic shared memory it uses (shared_mem), the opt-in it needs (smem_optin) and, for
    "cluster", the cluster dims.  One place for the shapes (hc_boundary_pre, and
    tools/hc_boundary_phases.py, which launches a stamped build of the same kernels)."""
    if handoff == "cluster":
        n_cta = pre_cluster_ctas(D)
        smem = HC * n_cta * 32 * 8 + 2 * D  # the partials [nseg][32] doubles, x of all D channels
        return dict(grid=(n_cta,), block=(PRE_CLUSTER_THREADS,), shared_mem=smem, smem_optin=smem,
                    cluster=(n_cta, 1, 1))
    if handoff in COOP_HANDOFFS:  # static shared memory only (~20 KB)
        return dict(grid=(HC * D // SEG,), block=(256,), shared_mem=0, smem_optin=0, cluster=None)
    # as hc_boundary: partials (4D), the streams (8D), the norm weight (2D); 1 KB of headroom in
    # the opt-in for the static shared memory
    return dict(grid=(HC * D // SEG,), block=(256,), shared_mem=14 * D, smem_optin=14 * D + 1024, cluster=None)


def boundary_impl(impl: str | None = None) -> str:
    """The hc_boundary implementation a call uses: ``impl``, else $MEMRA_DSV4_HC_BOUNDARY_IMPL
    (read now), else BOUNDARY_IMPL."""
    name = impl or os.environ.get(BOUNDARY_IMPL_ENV) or BOUNDARY_IMPL
    assert name in BOUNDARY_IMPLS, f"hc_boundary: impl {name!r} not in {BOUNDARY_IMPLS}"
    return name


def boundary_slots():
    """hc_boundary_poll's slots on the current device (zero between launches)."""
    return ticket_counter(_BND_SLOTS, "hc_boundary(poll)", size=_BND_SLOT_WORDS)


def _streams(X, name):
    check(X, name, np.uint16)
    assert X.ndim == 3 and X.shape[1] == HC and X.shape[2] % 8 == 0, (
        f"{name}: expected [T, {HC}, D] with D % 8 == 0, got {X.shape}")
    return X.shape[0], X.shape[2]


SEG = 256          # elements per reduction segment (kernels_cu/hc.cu MIX_SEG)
TOK_PER_CTA = 4
_WS: dict[int, tuple] = {}  # device -> (ws double[], counters int[]) for the split path
_RETIRED: list = []         # outgrown workspaces: a captured graph may still point at one


def _ny(T: int, D: int) -> int:
    """CTAs per token of the per-token kernels (128 threads x 8 channels each): enough to spread
    a short T over the SMs, never more than the channel chunks."""
    return max(1, min(-(-D // 1024), -(-sm_count() // max(T, 1))))


def split_workspace(n_groups: int, nseg: int):
    """Per-device scratch of the split mixes path (grown on demand; counters stay zero between
    launches).  Not safe for concurrent launches on two streams of one device.  Graphs bake
    the address (the device step captures hc_pre): an outgrown workspace is retired, never
    freed, so a graph captured on it stays valid after a bigger call grows the scratch."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    ws, cnt = _WS.get(dev, (None, None))
    if ws is None or ws.size < n_groups * nseg * 32 or cnt.size < n_groups:
        if ws is not None:
            _RETIRED.append((ws, cnt))
        ws = cp.empty((max(n_groups * nseg * 32, 1),), dtype=np.float64)
        cnt = cp.zeros((max(n_groups, 1),), dtype=np.int32)
        _WS[dev] = (ws, cnt)
    return ws, cnt


def auto_split(T: int, rows: int, n: int) -> int:
    """Split the reduction over CTAs (one segment per warp) when the grid would be small."""
    nseg = n // SEG
    r = 6 if rows % 6 == 0 else 4
    ctas = ((T + TOK_PER_CTA - 1) // TOK_PER_CTA) * (rows // r)
    if ctas >= sm_count() // 2 or nseg % 4:
        return 1
    return nseg // 4


def hc_mixes(streams, fn, norm_eps: float, out=None, *, n_split: int | None = None):
    """mixes [T, rows] f32 = (fn . vec(X_t)) * rsqrt(mean(vec(X_t)^2) + norm_eps), double
    accumulation in a canonical order (same bits for any T and n_split).  fn [rows, hc*D]
    float32 with rows % 6 == 0 (hc_pre: 24) or rows % 4 == 0 (hc_head: 4); hc*D % 256 == 0.
    n_split None = auto (split the reduction for small T, e.g. decode)."""
    T, D = _streams(streams, "hc_mixes.streams")
    n = HC * D
    rows = fn.shape[0]
    check(fn, "hc_mixes.fn", np.float32, (rows, n))
    assert n % SEG == 0 and n // SEG <= 128, f"hc_mixes: hc*D = {n} (need a multiple of 256, <= 32768)"
    out = out_array(out, "hc_mixes.out", (T, rows), np.float32)
    if T:
        if rows % 6 == 0:
            name, r = "hc_mixes_r6", 6
        else:
            assert rows % 4 == 0, f"hc_mixes: {rows} rows (need a multiple of 6 or 4)"
            name, r = "hc_mixes_r4", 4
        nseg = n // SEG
        if n_split is None:
            n_split = auto_split(T, rows, n)
        assert nseg % n_split == 0, f"hc_mixes: n_split {n_split} must divide {nseg} segments"
        groups = ((T + TOK_PER_CTA - 1) // TOK_PER_CTA) * (rows // r)
        if n_split > 1:
            ws, cnt = split_workspace(groups, nseg)
        else:
            ws, cnt = np.uint64(0), np.uint64(0)
        kernel(STEM, name)(((T + TOK_PER_CTA - 1) // TOK_PER_CTA, rows // r, n_split), (128,),
                           (streams, fn, out, i32(T), i32(n), i32(rows), np.float64(norm_eps), ws, cnt))
    return out


def hc_pre_finish(mixes, scale, base, streams, *, iters: int, hc_eps: float, y=None, pre=None,
                  post=None, comb=None):
    """Split (pre/post/comb with Sinkhorn, f32) + y = bf16(sum_i pre_i X_i).
    Returns (y [T, D] bf16, pre [T, 4], post [T, 4], comb [T, 4, 4]) (comb[i, j]: i = source)."""
    T, D = _streams(streams, "hc_pre.streams")
    check(mixes, "hc_pre.mixes", np.float32, (T, (2 + HC) * HC))
    check(scale, "hc_pre.scale", np.float32, (3,))
    check(base, "hc_pre.base", np.float32, ((2 + HC) * HC,))
    y = out_array(y, "hc_pre.y", (T, D), np.uint16)
    pre = out_array(pre, "hc_pre.pre", (T, HC), np.float32)
    post = out_array(post, "hc_pre.post", (T, HC), np.float32)
    comb = out_array(comb, "hc_pre.comb", (T, HC, HC), np.float32)
    if T:
        kernel(STEM, "hc_pre_split_apply")((T, _ny(T, D)), (128,), (mixes, scale, base, streams, y, pre, post, comb,
                                                          i32(D), i32(iters), np.float32(hc_eps)))
    return y, pre, post, comb


def hc_pre(streams, fn, scale, base, *, iters: int, hc_eps: float, norm_eps: float, mixes=None,
           y=None, pre=None, post=None, comb=None, n_split: int | None = None):
    """oracle.ops.hc_pre: returns (y, post, comb) (pre stays in ``pre`` when given).
    ``mixes`` [T, 24] f32 scratch (allocated when None)."""
    T, D = _streams(streams, "hc_pre.streams")
    mixes = hc_mixes(streams, fn, norm_eps, out=mixes, n_split=n_split)
    y, pre, post, comb = hc_pre_finish(mixes, scale, base, streams, iters=iters, hc_eps=hc_eps,
                                       y=y, pre=pre, post=post, comb=comb)
    return y, post, comb


def hc_weighted_sum(pre, streams, out=None):
    """y = bf16(sum_i pre_i X_i) in double (bit-identical to the twin given pre [T, 4] f32)."""
    T, D = _streams(streams, "hc_weighted_sum.streams")
    check(pre, "hc_weighted_sum.pre", np.float32, (T, HC))
    out = out_array(out, "hc_weighted_sum.out", (T, D), np.uint16)
    if T:
        kernel(STEM, "hc_weighted_sum")((T, _ny(T, D)), (128,), (pre, streams, out, i32(D)))
    return out


def hc_head(streams, fn, scale, base, *, hc_eps: float, norm_eps: float, out=None, mixes=None,
            n_split: int | None = None):
    """oracle.ops.hc_head: pre = sigmoid(mixes * scale[0] + base) + hc_eps; y = bf16(sum pre_i X_i)."""
    T, D = _streams(streams, "hc_head.streams")
    check(scale, "hc_head.scale", np.float32, (1,))
    check(base, "hc_head.base", np.float32, (HC,))
    mixes = hc_mixes(streams, fn, norm_eps, out=mixes, n_split=n_split)
    out = out_array(out, "hc_head.out", (T, D), np.uint16)
    if T:
        kernel(STEM, "hc_head_apply")((T, _ny(T, D)), (128,), (mixes, scale, base, streams, out, i32(D),
                                                     np.float32(hc_eps)))
    return out


def hc_post(f, residual, post, comb, out=None):
    """new_j = bf16(post_j f + sum_i comb[i, j] R_i) -> [T, 4, D] (out must not alias residual)."""
    T, D = _streams(residual, "hc_post.residual")
    check(f, "hc_post.f", np.uint16, (T, D))
    check(post, "hc_post.post", np.float32, (T, HC))
    check(comb, "hc_post.comb", np.float32, (T, HC, HC))
    out = out_array(out, "hc_post.out", (T, HC, D), np.uint16)
    assert out.data.ptr != residual.data.ptr or T == 0, "hc_post: out must not alias residual"
    if T:
        kernel(STEM, "hc_post")((T, _ny(T, D)), (128,), (f, residual, post, comb, out, i32(D)))
    return out


BOUNDARY_ROWS_MAX = 8   # hc_boundary's rows per launch (the device verify's ROW_MAX)


def _boundary_check(streams, fn, scale, base, norm_weight, x, xn, pre, mixes, who: str,
                    rows_max: int = 1):
    """The shape / dtype / alignment checks hc_boundary and hc_boundary_pre share (T tokens, 1 <=
    T <= rows_max: each its own boundary); returns D."""
    T, D = _streams(streams, f"{who}.streams")
    assert 1 <= T <= rows_max, (f"{who}: one token (decode), got T = {T}" if rows_max == 1 else
                                f"{who}: {T} tokens, expected 1..{rows_max}")
    n = HC * D
    rows = (2 + HC) * HC
    assert n % SEG == 0 and n // SEG <= 128, f"{who}: hc*D = {n} (need a multiple of 256, <= 32768)"
    check(fn, f"{who}.fn", np.float32, (rows, n))
    check(scale, f"{who}.scale", np.float32, (3,))
    check(base, f"{who}.base", np.float32, (rows,))
    check(norm_weight, f"{who}.norm_weight", np.uint16, (D,))
    check(x, f"{who}.x", np.uint16, (T, D))
    check(xn, f"{who}.xn", np.uint16, (T, D))
    check(pre, f"{who}.pre", np.float32, (T, HC))
    check(mixes, f"{who}.mixes", np.float32, (T, rows))
    for a, name in ((streams, "streams"), (norm_weight, "norm_weight"), (x, "x"), (xn, "xn")):
        assert a.data.ptr % 16 == 0, f"{who}.{name}: 16-byte loads need a 16-byte aligned base"
    return D


def _boundary_post_half(streams, D: int, f, out, post_in, comb_in, who: str):
    """The hc_post half's checks hc_boundary and hc_boundary_pre share (T = streams' tokens): with
    f, f [T, D], out [T, 4, D] (made when None; not aliasing streams), post_in [T, 4], comb_in
    [T, 4, 4], f / out 16-byte aligned; without f, none of out / post_in / comb_in.  Returns (out,
    the streams the pre half reads: out or streams)."""
    if f is None:
        assert out is None and post_in is None and comb_in is None, (
            f"{who}: out / post_in / comb_in belong to the hc_post half (f given)")
        return out, streams
    T = streams.shape[0]
    check(f, f"{who}.f", np.uint16, (T, D))
    out = out_array(out, f"{who}.out", (T, HC, D), np.uint16)
    check(post_in, f"{who}.post_in", np.float32, (T, HC))
    check(comb_in, f"{who}.comb_in", np.float32, (T, HC, HC))
    assert out.data.ptr != streams.data.ptr, f"{who}: out must not alias streams"
    assert f.data.ptr % 16 == 0 and out.data.ptr % 16 == 0, f"{who}: f / out not 16-byte aligned"
    return out, out


def hc_boundary(streams, fn, scale, base, norm_weight, *, iters: int, hc_eps: float,
                norm_eps: float, xn, x, pre, post, comb, mixes, f=None, out=None, post_in=None,
                comb_in=None, impl: str | None = None):
    """One decode token (T = 1), or T <= BOUNDARY_ROWS_MAX tokens each with its own boundary
    (the device verify's rows: grid.y = T, every row's bytes those of a one-token launch), across
    a sub-layer boundary in one launch (kernels_cu/hc.cu hc_boundary), bit for bit the unfused
    chain:

        f given:   out = hc_post(f, streams, post_in, comb_in); S = out
        f None:    S = streams (the first sub-layer of a stage: embed or the boundary copy)
        x, pre, post, comb = hc_pre(S, fn, scale, base)   (mixes: the 24 mix values)
        xn = rmsnorm(x, norm_weight, norm_eps)

    post_in / comb_in default to post / comb: the device step updates them in place (the
    kernel reads them before any CTA writes them).  streams [1, 4, D] bf16 bits, fn [24, 4D]
    f32, scale [3], base [24] f32, norm_weight [D] bf16 bits; x, xn [1, D]; pre, post [1, 4];
    comb [1, 4, 4]; mixes [1, 24]; with T rows every per-token array has a leading T (C-contiguous,
    as check() requires of each: the kernel steps row t by its size).  Uses the per-device split workspace (not concurrently on
    two streams of one device).  Returns the streams the norm was taken from (out or streams).
    impl: "lastcta" / "poll" (None: boundary_impl(), see the module docstring); same bytes; T > 1
    takes "lastcta" only."""
    D = _boundary_check(streams, fn, scale, base, norm_weight, x, xn, pre, mixes, "hc_boundary",
                        rows_max=BOUNDARY_ROWS_MAX)
    T = streams.shape[0]
    n = HC * D
    check(post, "hc_boundary.post", np.float32, (T, HC))
    check(comb, "hc_boundary.comb", np.float32, (T, HC, HC))
    if f is not None:
        post_in = post if post_in is None else post_in
        comb_in = comb if comb_in is None else comb_in
    out, src = _boundary_post_half(streams, D, f, out, post_in, comb_in, "hc_boundary")
    nseg = n // SEG
    name = boundary_impl(impl)
    if T > 1 and name == "poll":
        raise ValueError(f"hc_boundary: {T} rows need impl 'lastcta' (the poll form is one token)")
    if name == "poll":
        k = kernel(STEM, "hc_boundary_poll")
        tail = (boundary_slots(),)
    else:
        k = kernel(STEM, "hc_boundary")
        tail = split_workspace(T, nseg)   # row t: partials [t][nseg][32], ticket t
    smem = 14 * D  # the tail CTA: partials (4D), the streams (8D), the norm weight (2D); the opt-in below also covers ~0.9 KB static
    dynamic_smem(k, smem + 1024)
    null = np.uint64(0)
    k((nseg, T), (256,), (null if f is None else f, streams, null if f is None else post_in,
                        null if f is None else comb_in, null if f is None else out, fn, scale, base,
                        norm_weight, mixes, pre, post, comb, x, xn, i32(D), i32(iters),
                        np.float32(hc_eps), np.float64(norm_eps)) + tuple(tail), shared_mem=smem)
    return src


def hc_boundary_pre(streams, fn, scale, base, norm_weight, *, hc_eps: float, norm_eps: float, xn,
                    x, pre, mixes, f=None, out=None, post_in=None, comb_in=None, handoff: str = "ticket"):
    """hc_boundary's critical half, one launch (kernels_cu/hc.cu hc_boundary_pre):

        f given:   out = hc_post(f, streams, post_in, comb_in); S = out
        f None:    S = streams
        mixes (all 24), pre, x = bf16(sum_i pre_i S_i), xn = rmsnorm(x, norm_weight, norm_eps)

    byte for byte hc_boundary's outputs of the same names; post / comb are left to
    hc_boundary_sinkhorn(mixes, ...).  post_in [1, 4] / comb_in [1, 4, 4] are required with f
    (pure inputs: this kernel writes neither).  handoff (PRE_HANDOFFS, the module docstring):
    "ticket" uses the per-device split workspace (not concurrently on two streams of one device);
    "cluster" (hc_boundary_pre_cluster; pre_cluster_ok(D), else ValueError) uses none; "coop" /
    "coopall" (hc_boundary_pre_coop with 8 / all tail CTAs; pre_coop_ok(D), else ValueError) the
    per-device coop_slots (not concurrently on two streams of one device).  Returns S (out or streams)."""
    if handoff not in PRE_HANDOFFS:
        raise ValueError(f"hc_boundary_pre: handoff {handoff!r} is not one of {PRE_HANDOFFS}")
    D = _boundary_check(streams, fn, scale, base, norm_weight, x, xn, pre, mixes, "hc_boundary_pre")
    if handoff == "cluster" and not pre_cluster_ok(D):
        raise ValueError(f"hc_boundary_pre: handoff 'cluster' needs D % {PRE_CLUSTER_CHANNELS} == 0 and "
                         f"D <= {PRE_CLUSTER_CHANNELS * PRE_CLUSTER_MAX_CTAS} (one cluster of D / "
                         f"{PRE_CLUSTER_CHANNELS} CTAs), got D = {D}; use handoff 'ticket'")
    if handoff in COOP_HANDOFFS and not pre_coop_ok(D):
        raise ValueError(f"hc_boundary_pre: handoff {handoff!r} needs D in (1024, 2048, 4096, 8192) (D / 64 "
                         f"CTAs owning 128 / (D / 64) norm threads each), got D = {D}; use handoff 'ticket'")
    assert f is None or (post_in is not None and comb_in is not None), (
        "hc_boundary_pre: f given needs post_in / comb_in (the previous boundary's post / comb)")
    out, src = _boundary_post_half(streams, D, f, out, post_in, comb_in, "hc_boundary_pre")
    null = np.uint64(0)
    head = (null if f is None else f, streams, null if f is None else post_in,
            null if f is None else comb_in, null if f is None else out, fn, scale, base,
            norm_weight, mixes, pre, x, xn, i32(D), np.float32(hc_eps), np.float64(norm_eps))
    shape = pre_launch_shape(D, handoff)
    if handoff == "cluster":
        k = kernel(STEM, "hc_boundary_pre_cluster")
        dynamic_smem(k, shape["smem_optin"])
        k(shape["grid"], shape["block"], head, shared_mem=shape["shared_mem"], cluster=shape["cluster"])
        return src
    if handoff in COOP_HANDOFFS:
        slots = coop_slots()
        kernel(STEM, "hc_boundary_pre_coop")(shape["grid"], shape["block"],
                                             head + (i32(coop_tail_ctas(D, handoff)), slots))
        return src
    k = kernel(STEM, "hc_boundary_pre")
    ws, cnt = split_workspace(1, shape["grid"][0])
    dynamic_smem(k, shape["smem_optin"])
    k(shape["grid"], shape["block"], head + (ws, cnt), shared_mem=shape["shared_mem"])
    return src


def hc_boundary_sinkhorn(mixes, scale, base, *, iters: int, hc_eps: float, post, comb):
    """hc_boundary's split of post / comb (Sinkhorn) from the 24 mixes hc_boundary_pre stored,
    one warp (kernels_cu/hc.cu hc_boundary_sinkhorn): byte for byte hc_boundary's post / comb.
    mixes [1, 24], scale [3], base [24] f32 -> post [1, 4], comb [1, 4, 4] f32."""
    rows = (2 + HC) * HC
    check(mixes, "hc_boundary_sinkhorn.mixes", np.float32, (1, rows))
    check(scale, "hc_boundary_sinkhorn.scale", np.float32, (3,))
    check(base, "hc_boundary_sinkhorn.base", np.float32, (rows,))
    check(post, "hc_boundary_sinkhorn.post", np.float32, (1, HC))
    check(comb, "hc_boundary_sinkhorn.comb", np.float32, (1, HC, HC))
    assert mixes.data.ptr not in (post.data.ptr, comb.data.ptr), (
        "hc_boundary_sinkhorn: post / comb must not alias mixes")
    kernel(STEM, "hc_boundary_sinkhorn")((1,), (32,), (mixes, scale, base, post, comb, i32(iters),
                                                       np.float32(hc_eps)))
    return post, comb


__all__ = ["hc_mixes", "hc_pre_finish", "hc_pre", "hc_weighted_sum", "hc_head", "hc_post",
           "hc_boundary", "hc_boundary_pre", "hc_boundary_sinkhorn", "boundary_impl", "boundary_slots", "BOUNDARY_IMPLS",
           "BOUNDARY_ROWS_MAX",
           "PRE_HANDOFFS", "COOP_HANDOFFS", "pre_handoff_covers", "pre_cluster_ok", "pre_cluster_ctas",
           "pre_coop_ok", "coop_tail_ctas", "coop_slots",
           "pre_launch_shape"]
