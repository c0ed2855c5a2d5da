"""The chunk routine's routed experts, batched (kernels_cu/experts.cu "prefill MoE" kernels +
strided-batched cuBLASLt GEMMs of gpu.blaslt).

Contract
--------
``routed_moe(g, x, idx, wts, experts, fmt, limit, shared)`` -> y [T, D] float32 (bf16-valued)
    = ops_glue.moe_combine(routed, idx, shared) of the per-expert path it replaces: for every
    pick (t, j) with expert e = idx[t, j]: gate = store(bf16(x_t) . W1_e^T), up likewise with
    W3_e, h = store(swiglu_clamped(gate, up, limit, wts[t, j])), routed[t, j] =
    store(h . W2_e^T); W = the exact bf16 dequantisation of the stored FP4 expert; every GEMM
    bf16 x bf16 with f32 accumulation.  The kernels around the GEMMs are bit-identical to the
    CuPy ops they replace; the GEMMs are the same products run as cuBLASLt strided batches
    (an algorithm choice may differ from a batch-1 plan: bf16-class, not bitwise, equality).
Host work per call (``dispatch="host"``): ONE device->host copy of idx (it sizes the GEMMs),
ONE host->device copy of the dispatch tables (``dispatch_plan``), and per group of at most
``group_size`` experts: 3 dequant launches into a bounded bf16 scratch, 2 batched GEMMs (gate,
up), 1 SwiGLU launch, 1 batched GEMM (down); then one gather before and one combine after.
No per-expert host round trip, no per-expert allocation.
``gemm="fp4mma"`` (selectable through the seam MEMRA_DSV4_PREFILL_MOE, whose default is "wgmma";
routed_moe's own default stays "blaslt", described above): the same contract with the GEMMs run by two
launches over ALL active experts that read the STORED FP4 bytes (kernels_cu/experts.cu "FP4
grouped GEMM": decode to the exact bf16 the dequant kernels write, in registers, then
mma.sync bf16 -> f32; SwiGLU fused into the gate/up epilogue): no bf16 scratch, no dequant
launches, no gate/up f32 buffers; the work items (``mma_items``) ride in the same one upload.
``dispatch="device"`` (gemm "fp4mma" or "wgmma"; the chunk routine's default through the seam
MEMRA_DSV4_PREFILL_DISPATCH): no read back and no upload at all.  Four small kernels
(kernels_cu/moe.cu "dispatch plan", ``dispatch_on_device``; NumPy twin ``device_plan``) build the
plan from the device ids: per-expert counts, the rank order, each expert's first row, the row of
every pick, the combine's rows and the GEMM's work items (fp4mma: ``mma_items``' tiles of
MMA_BN rows; wgmma: ``wg_items``' split into items of up to WG_BN rows); every table and both
GEMM grids are sized from T, k and E alone (``max_mma_items`` with the arm's item rows; items
past the device's count have 0 rows and their CTAs return at once).  The rows are
dispatch_plan's without the padding (``compact``): the same experts in the same order, each
one's picks in pick order, the same items (expert, rows, row count) with the rows renumbered.
An fp4mma output row depends only on its own activation row, its expert and its item's row count
(the n8 tiles a CTA multiplies and the full-tile branch; the k order is fixed per chunk), never
on where the item's rows sit in memory; a wgmma output row likewise (its token tile NB is the
item's row count rounded up to 16; r0 only offsets the row addresses, rows past the item are
zero-filled B columns that no output of another row reads; the k order is fixed per chunk), so
the two dispatches are bit-identical arm by arm (tests/gpu/test_prefill_dispatch_gpu.py).  The
wgmma arm gathers xs permuted (gather_rows_perm) over the compact rows as over the padded ones.

Layout (``dispatch_plan``, pure NumPy): the active experts, sorted by pick count (descending,
ties by id) so a group's counts are alike, are cut into groups of ``group``; a group of n
experts with counts c_j gets ``mb = moe_bucket(max c_j)`` rows per expert, and expert slot j
owns padded rows [row0 + j mb, row0 + j mb + c_j) in pick order (ascending t * k + j), the
rest are padding (gathered as zeros, SwiGLU writes zeros, the combine never reads them).
Groups start at multiples of ROW_ALIGN rows, so every GEMM operand is 256-byte aligned (the
alignment cuBLASLt's heuristic assumes by default).
``moe_bucket`` rounds up to a power of two below 16 and to a multiple of 16 above (at most 15
padded rows per expert), so the number of distinct GEMM plans stays small and the plans are
built once per (mb, n) and reused by every later layer and forward.

Kernels (each with its NumPy twin in tests/gpu/test_prefill_moe_gpu.py):
``dequant_experts``  out[j] = dequant(expert eids[j]) (twin formats.dequant_mxfp4/nvfp4 -> bf16)
``gather_rows``      xs[p] = bf16(x[src[p]]), zeros for src < 0
``swiglu_rows``      h[p] = bf16(swiglu(bf16(gate[p]), bf16(up[p])) * wts[flat[p]]), 0 for padding
``combine_sorted``   y[t] = bf16(sum_j bf16(ys[pos[t, j]]) + shared[t]) (pos in ascending id)
``fp4mma_gateup``    hs = swiglu_rows(xs . W1^T, xs . W3^T) per item, W decoded from the FP4 bytes
                     (twin: the float64 products of the exact dequantised weights, f32-class bound)
``fp4mma_down``      ys = hs . W2^T per item (f32, unrounded; same twin and bound)
``dispatch_on_device``  the plan of device ids by kernels_cu/moe.cu moe_plan_* (twin device_plan,
                     tests/gpu/test_prefill_dispatch_gpu.py: equal table by table), with the
                     fp4mma or the wgmma work items
``gather_rows_perm``  gather_rows with each 128-column chunk stored in the wgmma k order (perm128)
``wgmma_gateup``     fp4mma_gateup on Hopper warpgroup MMA (items of up to 128 rows); xs and the
                     output hs are stored permuted per 128-column chunk (perm128)
``wgmma_down``       fp4mma_down on warpgroup MMA; hs permuted (as wgmma_gateup writes it), ys natural
``gemm="wgmma"`` (opt-in through MEMRA_DSV4_PREFILL_MOE=wgmma): the fp4mma contract with the two
GEMMs on wgmma (kernels_cu/experts.cu "FP4 grouped GEMM (wgmma)"): the same exact bf16 weights and
products, f32 accumulation in another order; xs and hs live in the permuted column order the
kernels read (internal buffers: the combine reads ys, which is natural).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops import moe as MO
from memra_dsv4.gpu.ops._common import (check, contiguous, cupy, dynamic_smem, grid_stride_blocks,
                                        i32, kernel)

STEM = "experts"
KERNELS = ("dequant_mxfp4_bf16_experts", "dequant_nvfp4_bf16_experts", "moe_gather_bf16",
           "moe_swiglu_rows", "moe_combine_sorted",
           "fp4mma_gateup_mxfp4", "fp4mma_gateup_nvfp4", "fp4mma_down_mxfp4", "fp4mma_down_nvfp4",
           "moe_gather_bf16_perm", "wgmma_gateup_mxfp4", "wgmma_gateup_nvfp4", "wgmma_down_mxfp4",
           "wgmma_down_nvfp4")
kernel_loader.register(STEM, KERNELS)

SCRATCH_BUDGET_BYTES = 1 << 30   # bf16 scratch of one group's W1, W3, W2 (full Flash: 21 experts)
MAX_GROUP = 32                   # more buys nothing: the batched GEMMs already fill the GPU
ROW_ALIGN = 16                   # group starts: 16 rows x (D % 8 == 0) x >= 2 B = 256-B aligned
GEMMS = ("blaslt", "fp4mma", "wgmma")  # routed_moe(gemm=): dequant + cuBLASLt (default) | FP4 GEMMs
DISPATCHES = ("host", "device")  # routed_moe(dispatch=): plan on the host (ids read back) | on the device

# fp4mma launch geometry: the FP4MMA_* macro defaults of kernels_cu/experts.cu (keep in step)
MMA_WARPS = 8                    # warps per CTA, 32 weight rows each
MMA_STAGES = 4                   # cp.async pipeline depth
MMA_ROWS = 32 * MMA_WARPS        # weight rows per CTA (gate/up: MMA_ROWS / 2 indices of W1 and of W3)
MMA_BN = 64                      # rows (picks) of one expert per work item
MMA_KC = 128                     # k per stage; K % MMA_KC == 0

# wgmma launch geometry: kernels_cu/experts.cu namespace wg (keep in step; a CPU test pins it)
WG_THREADS = 256                 # 2 warpgroups
WG_ROWS = 256                    # weight rows per CTA (gate/up: WG_ROWS / 2 indices of W1 and of W3)
WG_BN = 128                      # rows (picks) of one expert per work item, at most
WG_KC = 128                      # k per stage; K % WG_KC == 0 (gate/up: also I % WG_KC == 0)
WG_SMEM = 204800                 # the WGMMA_SMEM stage ring; the launch asks 1 KB more (alignment)


def moe_bucket(m: int) -> int:
    """Rows per expert of a group whose largest count is m: 1, 2, 4, 8, then multiples of 16."""
    m = int(m)
    if m < 1:
        raise ValueError(f"moe_bucket: m = {m} must be >= 1")
    if m <= 8:
        return 1 << (m - 1).bit_length()
    return -(-m // 16) * 16


def group_size(inter: int, dim: int, budget: int = SCRATCH_BUDGET_BYTES) -> int:
    """Experts per group: the three bf16 matrices of each fit ``budget`` bytes, at most MAX_GROUP."""
    per_expert = 3 * int(inter) * int(dim) * 2
    return int(max(1, min(MAX_GROUP, budget // per_expert)))


@dataclass(frozen=True)
class Group:
    row0: int    # first padded row of the group
    n: int       # experts in the group (batch count)
    mb: int      # rows per expert (GEMM M)
    slot0: int   # index of the group's first expert in DispatchPlan.eids


@dataclass(frozen=True)
class DispatchPlan:
    eids: np.ndarray     # int32 [n_active]: expert ids in group order
    counts: np.ndarray   # int64 [n_active]: picks per expert, same order
    groups: tuple        # Group per group, in row order
    rows: int            # P: padded rows in all
    src: np.ndarray      # int32 [P]: token row of each padded row, -1 = padding
    flat: np.ndarray     # int32 [P]: t * k + j of each padded row, -1 = padding
    pos: np.ndarray      # int32 [T, k]: padded row of each pick, picks in ascending expert id

    def table(self) -> np.ndarray:
        """The device tables as one int32 array (one host->device copy): src | flat | pos | eids."""
        return np.concatenate([self.src, self.flat, self.pos.reshape(-1), self.eids]).astype(np.int32)


def dispatch_plan(idx_h, group: int, bucket=moe_bucket) -> DispatchPlan:
    """The expert-sorted padded layout of the picks ``idx_h`` [T, k] (see the module doc)."""
    idx = _check_idx(idx_h, "dispatch_plan")
    group = int(group)
    if group < 1:
        raise ValueError(f"dispatch_plan: group = {group} must be >= 1")
    T, k = idx.shape
    flat = idx.reshape(-1).astype(np.int64)
    # by expert, then t * k + j; 16-bit keys take NumPy's radix sort (~10x a 64-bit argsort:
    # this runs on the host between the routing readback and the first expert launch)
    n_ids = int(flat.max()) + 1
    order = np.argsort(flat.astype(np.int16) if n_ids <= 1 << 15 else flat, kind="stable")
    per_id = np.bincount(flat, minlength=n_ids)
    experts = np.flatnonzero(per_id)
    counts = per_id[experts]
    starts = np.cumsum(counts) - counts                     # first sorted pick of each expert
    by = np.argsort(-counts, kind="stable")                 # most picked first, ties by id
    base = np.empty(experts.size, dtype=np.int64)           # padded row of each expert's pick 0
    groups, row = [], 0
    for g0 in range(0, by.size, group):
        row = -(-row // ROW_ALIGN) * ROW_ALIGN              # cuBLASLt: 256-B aligned operands
        mem = by[g0:g0 + group]
        mb = int(bucket(int(counts[mem].max())))
        base[mem] = row + mb * np.arange(mem.size, dtype=np.int64)
        groups.append(Group(row0=row, n=int(mem.size), mb=mb, slot0=g0))
        row += mb * mem.size
    e_of_sorted = np.repeat(np.arange(experts.size), counts)           # expert index per sorted pick
    rank = np.arange(flat.size, dtype=np.int64) - starts[e_of_sorted]  # rank within its expert
    pos_flat = np.empty(flat.size, dtype=np.int64)
    pos_flat[order] = base[e_of_sorted] + rank
    src = np.full(row, -1, dtype=np.int32)
    fl = np.full(row, -1, dtype=np.int32)
    src[pos_flat] = np.arange(flat.size) // k
    fl[pos_flat] = np.arange(flat.size)
    # combine order: ascending expert id, equal ids in pick order (oracle.ops.moe_combine)
    ordk = np.argsort(idx.astype(np.int64) * k + np.arange(k)[None, :], axis=1)
    pos = np.take_along_axis(pos_flat.reshape(T, k), ordk, axis=1).astype(np.int32)
    return DispatchPlan(eids=experts[by].astype(np.int32), counts=counts[by].astype(np.int64),
                        groups=tuple(groups), rows=int(row), src=src, flat=fl, pos=pos)


def mma_items(plan: DispatchPlan, bn: int = MMA_BN) -> np.ndarray:
    """The fp4mma work items of ``plan``: int32 [n, 4] = (expert id, first padded row, rows, 0),
    every active expert cut into tiles of ``bn`` consecutive rows (its picks, not its padding), in
    plan.eids order (an expert's tiles adjacent: their CTAs share its weights in L2)."""
    rows = []
    for gr in plan.groups:
        for j in range(gr.n):
            s = gr.slot0 + j
            base, cnt, e = gr.row0 + j * gr.mb, int(plan.counts[s]), int(plan.eids[s])
            for t0 in range(0, cnt, bn):
                rows.append((e, base + t0, min(bn, cnt - t0), 0))
    return np.asarray(rows, dtype=np.int32).reshape(-1, 4)


# ------------------------------------------------------------------ the plan on the device
def max_mma_items(n: int, E: int, bn: int = MMA_BN) -> int:
    """Most work items of at most ``bn`` rows n picks over E experts can need: sum_e
    ceil(c_e / bn) <= (n + (bn - 1) * n_active) / bn with n_active <= min(E, n).  The device
    dispatch sizes its items table and the GEMM grids with it (no read back of the real count):
    bn = MMA_BN for fp4mma, WG_BN for wgmma (wg_items makes ceil(c / WG_BN) items per expert)."""
    n, E = int(n), int(E)
    return (n + (bn - 1) * min(E, n)) // bn


PLAN_GEMMS = ("fp4mma", "wgmma")  # the GEMM arms the device dispatch builds items for


def item_rows(gemm: str) -> int:
    """Rows of one work item of the GEMM arm ``gemm`` (at most): MMA_BN (fp4mma), WG_BN (wgmma)."""
    if gemm not in PLAN_GEMMS:
        raise ValueError(f"item_rows: gemm {gemm!r} not in {PLAN_GEMMS}")
    return MMA_BN if gemm == "fp4mma" else WG_BN


@dataclass(frozen=True)
class DevicePlan:
    """The device-built dispatch plan (kernels_cu/moe.cu "dispatch plan"), as NumPy arrays: the
    twin's result (device_plan) or the device's copied back (DeviceDispatch.numpy)."""
    eids: np.ndarray     # int32 [E]: active experts by count desc, id asc; -1 past n_active
    counts: np.ndarray   # int32 [E]: their pick counts; 0 past n_active
    ebase: np.ndarray    # int32 [E]: first row of expert e; -1 = no picks
    seg: np.ndarray      # int32 [nseg, E]: picks of e before segment s (PLAN_SEG picks each)
    src: np.ndarray      # int32 [n]: token of each row (n = T * k rows, no padding)
    flat: np.ndarray     # int32 [n]: t * k + j of each row
    rowof: np.ndarray    # int32 [n]: row of each pick t * k + j
    pos: np.ndarray      # int32 [T, k]: rows of token t's picks, ascending expert id (stable)
    items: np.ndarray    # int32 [max_mma_items(n, E, item_rows(gemm)), 4]: (e, row, rows, 0), zeros past n_items
    n_active: int
    n_items: int


def _check_idx(idx, who: str) -> np.ndarray:
    idx = np.asarray(idx)
    if idx.ndim != 2 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"{who}: idx must be a non-empty integer [T, k], got "
                         f"{idx.dtype} {idx.shape}")
    if idx.min() < 0:
        raise ValueError(f"{who}: negative expert id")
    return idx


def device_plan(idx_h, E: int, gemm: str = "fp4mma") -> DevicePlan:
    """NumPy twin of the device-built plan of the picks ``idx_h`` [T, k] over ``E`` experts.

    It is ``compact(dispatch_plan(idx_h, group), gemm)`` for every group (the padded layout with
    its padding rows removed: the same experts in the same order, each one's picks in pick order),
    plus the tables the kernels write on the way (ebase, seg) and the work items of the arm
    ``gemm`` over the compact rows (fp4mma: mma_items' tiles; wgmma: wg_items' split),
    zero-padded to max_mma_items(T * k, E, item_rows(gemm)) entries."""
    bn = item_rows(gemm)
    idx = _check_idx(idx_h, "device_plan")
    E = int(E)
    if idx.max() >= E:
        raise ValueError(f"device_plan: expert id {int(idx.max())} >= E = {E}")
    T, k = idx.shape
    n = T * k
    f = idx.reshape(-1).astype(np.int64)
    cnt = np.bincount(f, minlength=E)
    active = np.flatnonzero(cnt)
    order = active[np.lexsort((active, -cnt[active]))]       # count descending, id ascending
    c = cnt[order]
    ebase = np.full(E, -1, np.int64)
    ebase[order] = np.cumsum(c) - c
    nseg = MO.plan_segments(n)
    seg = np.zeros((nseg, E), np.int64)
    for s in range(1, nseg):
        seg[s] = seg[s - 1] + np.bincount(f[(s - 1) * MO.PLAN_SEG:s * MO.PLAN_SEG], minlength=E)
    srt = np.argsort(f, kind="stable")                       # by id, then pick order
    rank = np.empty(n, np.int64)
    rank[srt] = np.arange(n) - (np.cumsum(cnt) - cnt)[f[srt]]
    rowof = ebase[f] + rank
    src = np.empty(n, np.int64)
    fl = np.empty(n, np.int64)
    src[rowof] = np.arange(n) // k
    fl[rowof] = np.arange(n)
    pos = np.take_along_axis(rowof.reshape(T, k), np.argsort(idx, axis=1, kind="stable"), axis=1)
    ni = -(-c // bn)                                         # items per expert (c >= 1)
    sz = np.full(c.size, bn, np.int64) if gemm == "fp4mma" else np.minimum(bn, -(-c // (16 * ni)) * 16)
    owner = np.repeat(np.arange(order.size), ni)
    tile = np.arange(owner.size) - np.repeat(np.cumsum(ni) - ni, ni)
    items = np.zeros((max_mma_items(n, E, bn), 4), np.int64)
    items[:owner.size, 0] = order[owner]
    items[:owner.size, 1] = ebase[order[owner]] + sz[owner] * tile
    items[:owner.size, 2] = np.minimum(sz[owner], c[owner] - sz[owner] * tile)
    eids = np.full(E, -1, np.int64)
    eids[:order.size] = order
    counts = np.zeros(E, np.int64)
    counts[:order.size] = c
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)
    return DevicePlan(eids=i32(eids), counts=i32(counts), ebase=i32(ebase), seg=i32(seg),
                      src=i32(src), flat=i32(fl), rowof=i32(rowof), pos=i32(pos), items=i32(items),
                      n_active=int(order.size), n_items=int(owner.size))


def compact(plan: DispatchPlan, gemm: str = "fp4mma"):
    """dispatch_plan's layout without its padding rows: (src, flat, pos, items) with every padded
    row renumbered to its rank among the non-padding rows (items: the arm's items of the host
    dispatch renumbered: mma_items(plan) for fp4mma, wg_items(plan) for wgmma)."""
    item_rows(gemm)
    keep = plan.flat >= 0
    row = np.cumsum(keep) - 1                      # compact row of each non-padding padded row
    items = (mma_items(plan) if gemm == "fp4mma" else wg_items(plan)).copy()
    items[:, 1] = row[items[:, 1]]
    return (plan.src[keep].astype(np.int32), plan.flat[keep].astype(np.int32),
            row[plan.pos].astype(np.int32), items.astype(np.int32))


@dataclass(frozen=True)
class DeviceDispatch:
    """The device-built plan (dispatch_on_device): int32 CuPy views of one allocation."""
    eids: object
    counts: object
    ebase: object
    seg: object
    src: object
    flat: object
    rowof: object
    pos: object
    items: object
    meta: object    # [2] = (n_active, n_items)

    def numpy(self) -> DevicePlan:
        """A host copy (tests): synchronises."""
        meta = self.meta.get()
        return DevicePlan(eids=self.eids.get(), counts=self.counts.get(), ebase=self.ebase.get(),
                          seg=self.seg.get(), src=self.src.get(), flat=self.flat.get(),
                          rowof=self.rowof.get(), pos=self.pos.get(), items=self.items.get(),
                          n_active=int(meta[0]), n_items=int(meta[1]))


def dispatch_on_device(idx, E: int, gemm: str = "fp4mma") -> DeviceDispatch:
    """The plan of the device expert ids ``idx`` [T, k] (any integer dtype; ids in [0, E), others
    trap) built by 4 launches (kernels_cu/moe.cu moe_plan_*) into one int32 allocation; no host
    synchronisation, nothing read back; every table is sized from T, k and E alone; the items are
    the GEMM arm ``gemm``'s (fp4mma | wgmma; max_mma_items(T * k, E, item_rows(gemm)) rows).
    Twin: device_plan(idx, E, gemm)."""
    cp = cupy()
    idx = contiguous(idx, dtype=np.int64)   # an int32 idx (the router's) is converted here
    assert idx.ndim == 2 and idx.size > 0, f"dispatch_on_device: idx {idx.shape}"
    T, k = idx.shape
    E = int(E)
    key = (T, k, E, gemm)
    lay = _PLAN_LAYOUT.get(key)
    if lay is None:
        lay = _PLAN_LAYOUT[key] = _plan_layout(T, k, E, gemm)
    total, (o_it, o_me, o_eb, o_ei, o_co, o_sg, o_sr, o_fl, o_ro, o_po, o_end), nseg, mi = lay
    buf = cp.empty(total, dtype=np.int32)
    d = DeviceDispatch(eids=buf[o_ei:o_co], counts=buf[o_co:o_sg], ebase=buf[o_eb:o_ei],
                       seg=buf[o_sg:o_sr].reshape(nseg, E), src=buf[o_sr:o_fl],
                       flat=buf[o_fl:o_ro], rowof=buf[o_ro:o_po],
                       pos=buf[o_po:o_end].reshape(T, k), items=buf[o_it:o_me].reshape(mi, 4),
                       meta=buf[o_me:o_me + 2])
    MO.plan_launches(idx, T, k, E, d, gemm == "wgmma")
    return d


# (T, k, E, gemm) -> _plan_layout(T, k, E, gemm): dispatch_on_device's table offsets, worked out
# (and the plan kernels' size limits asserted) once per shape
_PLAN_LAYOUT: dict = {}


def _plan_layout(T: int, k: int, E: int, gemm: str):
    """(total int32 elements, the 11 offsets of items, meta, ebase, eids, counts, seg, src,
    flat, rowof, pos and the end, nseg, max items) of dispatch_on_device's one allocation: the
    tables in that order, each sized from T, k and E alone (its views have exactly the shapes
    moe.plan_count / _scan / _place / _combine_pos check)."""
    bn = item_rows(gemm)
    n = T * k
    assert 0 < n < (1 << 31) - MO.PLAN_SEG, f"dispatch_on_device: {n} picks"
    assert 1 <= E <= MO.PLAN_MAX_E, f"dispatch_on_device: E = {E} (1..{MO.PLAN_MAX_E})"
    nseg, mi = MO.plan_segments(n), max_mma_items(n, E, bn)
    offs, o = [], 0
    for size in (4 * mi, 4, E, E, E, nseg * E, n, n, n, n):
        offs.append(o)
        o += size
    offs.append(o)
    return o, tuple(offs), nseg, mi


def wg_items(plan: DispatchPlan, bn: int = WG_BN) -> np.ndarray:
    """The wgmma work items of ``plan``: int32 [n, 4] = (expert id, first padded row, rows, 0).
    An expert with c picks gets m = ceil(c / bn) items of nearly equal size, all but the last a
    multiple of 16 (the kernels' token tile is the item's rows rounded up to 16: 200 picks run as
    112 + 88, not 128 + 72), in plan.eids order (an expert's items adjacent)."""
    rows = []
    for gr in plan.groups:
        for j in range(gr.n):
            s = gr.slot0 + j
            base, cnt, e = gr.row0 + j * gr.mb, int(plan.counts[s]), int(plan.eids[s])
            m = -(-cnt // bn)
            size = min(bn, -(-cnt // (16 * m)) * 16)
            for t0 in range(0, cnt, size):
                rows.append((e, base + t0, min(size, cnt - t0), 0))
    return np.asarray(rows, dtype=np.int32).reshape(-1, 4)


def perm128_index(n: int) -> np.ndarray:
    """Stored position of every logical column of a row of n (n % 128 == 0) columns in the wgmma
    kernels' k order: in each 128-chunk, logical L = 32 q + 4 t + 2 hi + j sits at 16 t + 8 hi +
    2 q + j (experts.cu wg_perm: lane quad q owns the contiguous elements of its scale block)."""
    assert n % 128 == 0, f"perm128: {n} columns, not a multiple of 128"
    L = np.arange(128)
    P = 16 * ((L >> 2) & 7) + 8 * ((L >> 1) & 1) + 2 * (L >> 5) + (L & 1)
    return (np.arange(0, n, 128)[:, None] + P[None, :]).reshape(-1)


def perm128(a: np.ndarray) -> np.ndarray:
    """a with its last axis stored in the wgmma k order: out[..., perm[L]] = a[..., L]."""
    a = np.asarray(a)
    out = np.empty_like(a)
    out[..., perm128_index(a.shape[-1])] = a
    return out


def unperm128(a: np.ndarray) -> np.ndarray:
    """The inverse of perm128: natural column order back."""
    a = np.asarray(a)
    return a[..., perm128_index(a.shape[-1])]


def mma_smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of the fp4mma kernels (experts.cu MmaSmem): per stage activations
    [MMA_BN][MMA_KC] bf16, packed weights [MMA_ROWS][MMA_KC / 2], scales [MMA_ROWS][4 | 8]."""
    sb = 8 if fmt == "nvfp4" else 4
    return MMA_STAGES * (MMA_BN * MMA_KC * 2 + MMA_ROWS * MMA_KC // 2 + MMA_ROWS * sb)


# ------------------------------------------------------------------------------- kernels
def dequant_experts(fmt: str, packed, scale, eids, out, ws2=None):
    """out[j] = bf16 dequant of expert eids[j] of the stacked packed [E, R, C/2] u8 / scale
    ([E, R, C/32] e8m0 | [E, R, C/16] e4m3) for j < eids.size; ws2: f32 [E] device (NVFP4).
    out [>= n, R, C] uint16 (only the first n written)."""
    assert fmt in ("mxfp4", "nvfp4"), f"dequant_experts: format {fmt!r}"
    check(packed, "dequant_experts.packed", np.uint8)
    E, R, half = packed.shape
    C = 2 * half
    assert C % 32 == 0, f"dequant_experts: C = {C} must be a multiple of 32"
    check(scale, "dequant_experts.scale", np.uint8, (E, R, C // (32 if fmt == "mxfp4" else 16)))
    check(eids, "dequant_experts.eids", np.int32)
    n = int(eids.size)
    check(out, "dequant_experts.out", np.uint16, (None, R, C))
    assert out.shape[0] >= n, f"dequant_experts: out holds {out.shape[0]} experts, {n} asked"
    if n == 0:
        return out
    grid = (grid_stride_blocks(R * C // 32 * n) + n - 1) // n
    args = (packed, scale, np.int64(packed.strides[0]), np.int64(scale.strides[0]))
    if fmt == "mxfp4":
        kernel(STEM, "dequant_mxfp4_bf16_experts")((grid, n), (256,),
                                                   args + (eids, out, np.int64(R), i32(C)))
    else:
        check(ws2, "dequant_experts.ws2", np.float32, (E,))
        kernel(STEM, "dequant_nvfp4_bf16_experts")((grid, n), (256,),
                                                   args + (ws2, eids, out, np.int64(R), i32(C)))
    return out


def gather_rows(x, src, out, *, checked: bool = True):
    """out[p] = bf16 bits of x[src[p]] (RNE), zeros where src[p] < 0.  x [T, D] f32, src [P]
    int32, out [P, D] uint16.  checked False: the caller vouches for the three arrays (the
    routed_moe device path, which made them); the launch is the same."""
    return _gather(x, src, out, "gather_rows", "moe_gather_bf16", 8, checked)


def gather_rows_perm(x, src, out, *, checked: bool = True):
    """gather_rows with every 128-column chunk of each row stored in the wgmma k order:
    out = perm128(gather_rows(x, src)).  D % 128 == 0."""
    return _gather(x, src, out, "gather_rows_perm", "moe_gather_bf16_perm", 128, checked)


def _gather(x, src, out, who: str, kname: str, d_mult: int, checked: bool = True):
    """The checks and launch the two gathers share (8 columns per thread; D % d_mult == 0)."""
    if checked:
        check(x, f"{who}.x", np.float32)
    T, D = x.shape
    assert D % d_mult == 0, f"{who}: D = {D} must be a multiple of {d_mult}"
    if checked:
        check(src, f"{who}.src", np.int32)
    P = int(src.size)
    if checked:
        check(out, f"{who}.out", np.uint16, (P, D))
    if P:
        kernel(STEM, kname)((grid_stride_blocks(P * D // 8),), (256,),
                            (x, src, out, np.int64(P), i32(D)))
    return out


def swiglu_rows(gate, up, wts, flat, limit: float, out):
    """out[p] = bf16(swiglu_clamped(bf16(gate[p]), bf16(up[p]), limit, wts[flat[p]])), zeros
    where flat[p] < 0.  gate/up [P, I] f32, wts [T*k] f32, flat [P] int32, out [P, I] uint16."""
    check(gate, "swiglu_rows.gate", np.float32)
    P, I = gate.shape
    assert I % 8 == 0, f"swiglu_rows: I = {I} must be a multiple of 8"
    check(up, "swiglu_rows.up", np.float32, (P, I))
    check(wts, "swiglu_rows.wts", np.float32)
    check(flat, "swiglu_rows.flat", np.int32, (P,))
    check(out, "swiglu_rows.out", np.uint16, (P, I))
    if P:
        kernel(STEM, "moe_swiglu_rows")((grid_stride_blocks(P * I // 8),), (256,),
                                        (gate, up, wts, flat, out, np.int64(P), i32(I),
                                         np.float64(limit)))
    return out


def combine_sorted(ys, pos, shared, out=None, *, checked: bool = True):
    """out[t] = bf16((0 + sum_j bf16(ys[pos[t, j]])) + shared[t]) in f32.  ys [P, D] f32,
    pos [T, k] int32 (picks in ascending expert id), shared [T, D] f32 -> out [T, D] f32.
    checked False: ys, pos and out (when given) are the caller's own (routed_moe's device
    path); shared is checked either way."""
    if checked:
        check(ys, "combine_sorted.ys", np.float32)
    D = ys.shape[1]
    assert D % 8 == 0, f"combine_sorted: D = {D} must be a multiple of 8"
    if checked:
        check(pos, "combine_sorted.pos", np.int32)
    T, k = pos.shape
    check(shared, "combine_sorted.shared", np.float32, (T, D))
    if out is None:
        out = cupy().empty((T, D), dtype=np.float32)
    elif checked:
        check(out, "combine_sorted.out", np.float32, (T, D))
    if T:
        kernel(STEM, "moe_combine_sorted")((T, (D // 8 + 127) // 128), (128,),
                                           (ys, pos, shared, out, i32(k), i32(D)))
    return out


def _mma_weights(fmt, w, name):
    """(packed [E, R, C/2] u8, scale [E, R, C/32 | C/16] u8) checked; returns (E, R, C)."""
    packed, scale = w
    check(packed, f"{name}.packed", np.uint8)
    E, R, half = packed.shape
    C = 2 * half
    assert C % MMA_KC == 0, f"{name}: K = {C} must be a multiple of {MMA_KC} (fp4mma)"
    check(scale, f"{name}.scale", np.uint8, (E, R, C // (32 if fmt == "mxfp4" else 16)))
    return E, R, C


def _mma_launch(name, fmt, grid_x, n_items, args):
    assert n_items < 65536, f"{name}: {n_items} work items (grid.y limit 65535)"
    k = kernel(STEM, name)
    smem = dynamic_smem(k, mma_smem_bytes(fmt))
    k((grid_x, n_items), (32 * MMA_WARPS,), args, shared_mem=smem)


def _gateup_args(who: str, fmt: str, w1, w3, items, xs, wts, flat, limit: float, hs, ws2,
                 checked: bool = True):
    """The checked launch arguments of a grouped gate/up kernel (fp4mma_gateup, wgmma_gateup: one
    argument contract): (args, n_items, I).  checked False: the weights (and ws2) are checked,
    items / xs / wts / flat / hs are the caller's own (routed_moe's device path made them)."""
    assert fmt in ("mxfp4", "nvfp4"), f"{who}: format {fmt!r}"
    E, I, D = _mma_weights(fmt, w1, f"{who}.w1")
    assert _mma_weights(fmt, w3, f"{who}.w3") == (E, I, D), f"{who}: w1 / w3 shapes differ"
    assert w1[0].strides == w3[0].strides and w1[1].strides == w3[1].strides
    if checked:
        check(items, f"{who}.items", np.int32, (None, 4))
        check(xs, f"{who}.xs", np.uint16, (None, D))
        P = xs.shape[0]
        check(wts, f"{who}.wts", np.float32)
        check(flat, f"{who}.flat", np.int32, (P,))
        check(hs, f"{who}.hs", np.uint16, (P, I))
    ps, ss = np.int64(w1[0].strides[0]), np.int64(w1[1].strides[0])
    tail = (items, xs, wts, flat, hs, i32(I), i32(D), np.float64(limit))
    if fmt == "mxfp4":
        args = (w1[0], w1[1], w3[0], w3[1], ps, ss) + tail
    else:
        assert ws2 is not None and len(ws2) == 2, f"{who}: NVFP4 needs ws2 = (w1, w3)"
        for j, a in enumerate(ws2):
            check(a, f"{who}.ws2[{j}]", np.float32, (E,))
        args = (w1[0], w1[1], w3[0], w3[1], ps, ss, ws2[0], ws2[1]) + tail
    return args, int(items.shape[0]), I


def _down_args(who: str, fmt: str, w2, items, hs, ys, ws2, checked: bool = True):
    """The checked launch arguments of a grouped down kernel (fp4mma_down, wgmma_down: one
    argument contract): (args, n_items, D).  checked False: items / hs / ys are the caller's
    own (the weights and ws2 checked either way)."""
    assert fmt in ("mxfp4", "nvfp4"), f"{who}: format {fmt!r}"
    E, D, I = _mma_weights(fmt, w2, f"{who}.w2")
    if checked:
        check(items, f"{who}.items", np.int32, (None, 4))
        check(hs, f"{who}.hs", np.uint16, (None, I))
        check(ys, f"{who}.ys", np.float32, (hs.shape[0], D))
    ps, ss = np.int64(w2[0].strides[0]), np.int64(w2[1].strides[0])
    tail = (items, hs, ys, i32(D), i32(I))
    if fmt == "mxfp4":
        args = (w2[0], w2[1], ps, ss) + tail
    else:
        check(ws2, f"{who}.ws2", np.float32, (E,))
        args = (w2[0], w2[1], ps, ss, ws2) + tail
    return args, int(items.shape[0]), D


def fp4mma_gateup(fmt: str, w1, w3, items, xs, wts, flat, limit: float, hs, ws2=None, *,
                  checked: bool = True):
    """hs[r0 + t, i] = bf16(swiglu_clamped(bf16(xs[r0+t] . W1_e[i]), bf16(xs[r0+t] . W3_e[i]),
    limit, wts[flat[r0+t]])) for every item (e, r0, n, 0) of ``items`` [n_items, 4] int32 and
    t < n, i < I; W = the exact bf16 dequantisation of the stored FP4 (never materialised);
    f32 accumulation (kernels_cu/experts.cu "FP4 grouped GEMM").  w1, w3: (packed [E, I, D/2],
    scale) stacked; xs [P, D] bf16 (uint16); wts [T*k] f32; flat [P] int32; hs [P, I] uint16
    (rows outside the items untouched); ws2 = (ws2_w1, ws2_w3) f32 [E] device for NVFP4."""
    args, n, I = _gateup_args("fp4mma_gateup", fmt, w1, w3, items, xs, wts, flat, limit, hs, ws2,
                              checked)
    if n:
        _mma_launch(f"fp4mma_gateup_{fmt}", fmt, -(-I // (MMA_ROWS // 2)), n, args)
    return hs


def fp4mma_down(fmt: str, w2, items, hs, ys, ws2=None, *, checked: bool = True):
    """ys[r0 + t, o] = hs[r0 + t] . W2_e[o] (f32 accumulation of the exact products, not rounded)
    for every item (e, r0, n, 0) and t < n, o < D.  w2: (packed [E, D, I/2], scale) stacked;
    hs [P, I] uint16; ys [P, D] f32 (rows outside the items untouched); ws2 f32 [E] (NVFP4)."""
    args, n, D = _down_args("fp4mma_down", fmt, w2, items, hs, ys, ws2, checked)
    if n:
        _mma_launch(f"fp4mma_down_{fmt}", fmt, -(-D // MMA_ROWS), n, args)
    return ys


def _wg_launch(name, grid_x, n_items, args):
    assert n_items < 65536, f"{name}: {n_items} work items (grid.y limit 65535)"
    k = kernel(STEM, name)
    smem = dynamic_smem(k, WG_SMEM + 1024)
    k((grid_x, n_items), (WG_THREADS,), args, shared_mem=smem)


def wgmma_gateup(fmt: str, w1, w3, items, xs, wts, flat, limit: float, hs, ws2=None, *,
                 checked: bool = True):
    """fp4mma_gateup on warpgroup MMA, columns permuted: hs[r0 + t, perm(i)] =
    bf16(swiglu_clamped(bf16(xs[r0+t] . W1_e[i]), bf16(xs[r0+t] . W3_e[i]), limit, wts[flat[r0+t]]))
    for every item (e, r0, n, 0) (n <= WG_BN) and t < n, i < I, where xs [P, D] holds each row
    PERMUTED per 128-chunk (gather_rows_perm / perm128) and perm is perm128's column map; W the exact
    bf16 dequantisation of the stored FP4; f32 accumulation.  I % 128 == 0 and D % 128 == 0.
    Rows outside the items untouched; ws2 = (ws2_w1, ws2_w3) f32 [E] device for NVFP4.  items is
    a device array (not checked here): an item with n outside 1..WG_BN is skipped by the kernels
    (wg_items never builds one)."""
    args, n, I = _gateup_args("wgmma_gateup", fmt, w1, w3, items, xs, wts, flat, limit, hs, ws2,
                              checked)
    assert I % WG_KC == 0, f"wgmma_gateup: I = {I} must be a multiple of {WG_KC} (permuted hs)"
    if n:
        _wg_launch(f"wgmma_gateup_{fmt}", I // (WG_ROWS // 2), n, args)
    return hs


def wgmma_down(fmt: str, w2, items, hs, ys, ws2=None, *, checked: bool = True):
    """fp4mma_down on warpgroup MMA: ys[r0 + t, o] = hs_nat[r0 + t] . W2_e[o] (f32, not rounded) for
    every item (e, r0, n, 0) (n <= WG_BN), t < n, o < D, where hs [P, I] holds each row PERMUTED per
    128-chunk (as wgmma_gateup writes it; hs_nat = unperm128(hs)).  I % 128 == 0, D any.  Rows
    outside the items untouched; ws2 f32 [E] (NVFP4)."""
    args, n, D = _down_args("wgmma_down", fmt, w2, items, hs, ys, ws2, checked)
    if n:
        _wg_launch(f"wgmma_down_{fmt}", -(-D // WG_ROWS), n, args)
    return ys


# ------------------------------------------------------------------------- orchestration
def routed_moe(g, x, idx, wts, experts: dict, fmt: str, limit: float, shared, *,
               ws2=None, group: int | None = None, ph: str | None = None, gemm: str = "blaslt",
               dispatch: str = "host"):
    """The MoE output y [T, D] f32 (bf16-valued) = combine(routed experts) + shared (module doc).

    g: ops_glue.GemmBackend of the current device; x [T, D] f32 bf16-valued; idx [T, k] integer
    expert ids, a NumPy array or a CuPy array on the current device; wts [T, k] f32 device;
    dispatch: "host" (dispatch_plan on a host copy of idx: a device idx is read back, one
    synchronisation) or "device" (dispatch_on_device: the plan built by kernels from the device
    idx, a NumPy idx uploaded; nothing read back; gemm "fp4mma" or "wgmma", bit-identical to
    "host" of the same gemm: the same items over the same rows, renumbered without the padding);
    experts: {"w1", "w2",
    "w3": (packed [E, out, in/2] u8, scale u8)}; ws2: {"w1", "w2", "w3": f32 [E] device} for
    NVFP4; shared [T, D] f32.  ph: the phase prefix (``.../ffn/moe``) under which the
    dispatch (host plan, the table upload, the gather), the experts (per group: dequant, GEMMs,
    SwiGLU) and the combine are bracketed; None brackets nothing.
    gemm: "blaslt" (default) dequantises each group into the bf16 scratch and runs cuBLASLt
    batches; "fp4mma" runs two launches for all experts (fp4mma_gateup, fp4mma_down) on the stored
    FP4 bytes, no scratch (g unused; needs D % 128 == I % 128 == 0); "wgmma" likewise with
    wgmma_gateup / wgmma_down (xs gathered permuted, hs permuted; same conditions).  Same products,
    same roundings around the GEMMs; the f32 summation order differs (bf16 class, not bitwise)."""
    from memra_dsv4.profiling import phase
    assert gemm in GEMMS, f"routed_moe: gemm {gemm!r} not in {GEMMS}"
    if dispatch not in DISPATCHES:
        raise ValueError(f"routed_moe: dispatch {dispatch!r} not in {DISPATCHES}")
    if dispatch == "device" and gemm not in PLAN_GEMMS:
        raise ValueError(f"routed_moe: dispatch 'device' needs gemm 'fp4mma' or 'wgmma' (gemm "
                         f"{gemm!r} sizes its cuBLASLt batches on the host: dispatch 'host')")
    cp = cupy()
    x = contiguous(x, dtype=cp.float32)
    T, D = x.shape
    I = experts["w1"][0].shape[1]
    assert experts["w1"][0].shape[2] * 2 == D and experts["w2"][0].shape[1:] == (D, I // 2), (
        f"routed_moe: expert shapes {experts['w1'][0].shape} / {experts['w2'][0].shape} vs D = {D}")
    on_device = isinstance(idx, cp.ndarray)
    if not on_device:
        idx = np.asarray(idx)
    assert idx.ndim == 2 and idx.shape[0] == T, f"routed_moe: idx {idx.shape} vs x {x.shape}"
    k = idx.shape[1]
    check(wts, "routed_moe.wts", np.float32, (T, k))
    grp = int(group or group_size(I, D))
    bracket = (lambda leaf: phase(f"{ph}/{leaf}")) if ph else (lambda leaf: _NO_PHASE)
    if dispatch == "device":
        return _routed_moe_device(g, x, idx, wts, experts, fmt, limit, shared, ws2, bracket, gemm)
    with bracket("dispatch"):
        idx_h = cp.asnumpy(idx) if on_device else idx   # the one device->host read of the ids
        plan = dispatch_plan(idx_h, grp)
        P, n_act = plan.rows, plan.eids.size
        host_tab = plan.table()
        if gemm in ("fp4mma", "wgmma"):
            items_h = mma_items(plan) if gemm == "fp4mma" else wg_items(plan)
            host_tab = np.concatenate([host_tab, items_h.reshape(-1)])
        tab = cp.asarray(host_tab)                           # the one host->device copy
        src, flat = tab[:P], tab[P:2 * P]
        pos = tab[2 * P:2 * P + T * k].reshape(T, k)
        eids = tab[2 * P + T * k:2 * P + T * k + n_act]
        gather = gather_rows_perm if gemm == "wgmma" else gather_rows
        xs = gather(x, src, cp.empty((P, D), dtype=cp.uint16))
    if gemm in ("fp4mma", "wgmma"):
        items = tab[2 * P + T * k + n_act:].reshape(-1, 4)
        hs = cp.empty((P, I), dtype=cp.uint16)
        ys = cp.empty((P, D), dtype=cp.float32)
        wflat = contiguous(wts).reshape(-1)
        gateup, down = (fp4mma_gateup, fp4mma_down) if gemm == "fp4mma" else (wgmma_gateup, wgmma_down)
        with bracket("experts"):
            gateup(fmt, experts["w1"], experts["w3"], items, xs, wflat, flat, limit, hs,
                   None if ws2 is None else (ws2["w1"], ws2["w3"]))
            down(fmt, experts["w2"], items, hs, ys, None if ws2 is None else ws2["w2"])
        if g is not None and hasattr(g, "flops"):   # the GEMM flop count benches read: the
            g.flops += 6 * T * k * I * D             # useful products (3 projections per pick)
        with bracket("combine"):
            return combine_sorted(ys, pos, contiguous(shared, dtype=cp.float32))
    hs = cp.empty((P, I), dtype=cp.uint16)
    ys = cp.empty((P, D), dtype=cp.float32)
    gmax = max(gr.n * gr.mb for gr in plan.groups)
    gate = cp.empty((gmax, I), dtype=cp.float32)
    up = cp.empty((gmax, I), dtype=cp.float32)
    nmax = max(gr.n for gr in plan.groups)
    scratch = {w: cp.empty((nmax,) + (experts[w][0].shape[1], 2 * experts[w][0].shape[2]),
                           dtype=cp.uint16) for w in ("w1", "w3", "w2")}
    wflat = contiguous(wts).reshape(-1)
    with bracket("experts"):
        _run_groups(g, plan, eids, experts, fmt, ws2, scratch, xs, gate, up, hs, ys, wflat, flat,
                    limit)
    assert n_act == sum(gr.n for gr in plan.groups)
    with bracket("combine"):
        return combine_sorted(ys, pos, contiguous(shared, dtype=cp.float32))


def _routed_moe_device(g, x, idx, wts, experts, fmt, limit, shared, ws2, bracket, gemm):
    """routed_moe(gemm="fp4mma" | "wgmma", dispatch="device"): the plan by kernels
    (dispatch_on_device, the arm's items), the gather over the T * k compact rows (wgmma: stored
    permuted, gather_rows_perm), both GEMM launches over max_mma_items(T * k, E, item_rows(gemm))
    items (the empty tail returns at once), the combine; no host synchronisation."""
    cp = cupy()
    T, D = x.shape
    E, I = experts["w1"][0].shape[:2]
    k = idx.shape[1]
    n = T * k
    wg = gemm == "wgmma"
    with bracket("dispatch"):
        d = dispatch_on_device(idx if isinstance(idx, cp.ndarray) else cp.asarray(idx), E, gemm)
        # checked=False below: every array those wrappers would check is made here (xs, hs, ys,
        # the plan's views, wflat: routed_moe checked wts) or checked by routed_moe (x: a
        # contiguous f32 [T, D], D the experts'); the weights, ws2 and shared are still checked
        xs = (gather_rows_perm if wg else gather_rows)(x, d.src, cp.empty((n, D), dtype=cp.uint16),
                                                       checked=False)
    hs = cp.empty((n, I), dtype=cp.uint16)
    ys = cp.empty((n, D), dtype=cp.float32)
    wflat = contiguous(wts).reshape(-1)
    gateup, down = (wgmma_gateup, wgmma_down) if wg else (fp4mma_gateup, fp4mma_down)
    with bracket("experts"):
        gateup(fmt, experts["w1"], experts["w3"], d.items, xs, wflat, d.flat, limit, hs,
               None if ws2 is None else (ws2["w1"], ws2["w3"]), checked=False)
        down(fmt, experts["w2"], d.items, hs, ys, None if ws2 is None else ws2["w2"],
             checked=False)
    if g is not None and hasattr(g, "flops"):
        g.flops += 6 * T * k * I * D
    with bracket("combine"):
        return combine_sorted(ys, d.pos, contiguous(shared, dtype=cp.float32), checked=False)


class _NoPhase:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_PHASE = _NoPhase()


def _run_groups(g, plan, eids, experts, fmt, ws2, scratch, xs, gate, up, hs, ys, wflat, flat,
                limit):
    """Per group of experts: dequantise the three matrices, gate / up batched GEMMs, SwiGLU,
    down batched GEMM into the expert-sorted rows ys."""
    for gr in plan.groups:
        rows = slice(gr.row0, gr.row0 + gr.n * gr.mb)
        ge = eids[gr.slot0:gr.slot0 + gr.n]
        for w in ("w1", "w3", "w2"):
            pk, sc = experts[w]
            dequant_experts(fmt, pk, sc, ge, scratch[w], None if ws2 is None else ws2[w])
        m = gr.n * gr.mb
        g.mm_batched(xs[rows], scratch["w1"][:gr.n], gate[:m])
        g.mm_batched(xs[rows], scratch["w3"][:gr.n], up[:m])
        swiglu_rows(gate[:m], up[:m], wflat, flat[rows], limit, hs[rows])
        g.mm_batched(hs[rows], scratch["w2"][:gr.n], ys[rows])
