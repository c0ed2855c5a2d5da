"""Routed-expert weight ops (kernels_cu/experts.cu).

dequant_mxfp4(packed, scale)          twin formats.dequant_mxfp4 -> bf16 (exact)
dequant_nvfp4(packed, wscale, ws2)    twin formats.dequant_nvfp4 -> bf16 (RNE of the f32 product)
pointer_table(arrays)                 u64 device array of base pointers (per-expert tables)
gemv_fp4(fmt, x, expert_ids, wptr, sptr, O, K, ...)
    y[s, o] = bf16(sum_k W_{e_s}[o, k] x[s // x_div, k]) reading the stored FP4 bytes,
    twin oracle.ops.linear(x, dequant(W_e), "fp4") per slot (bf16 class: x as given;
    reference class: pass the FP8-simulated x, quant_sim.fp8_sim(x, 128)).
gemv_fp4_gateup(...)        fused gemv(w1), gemv(w3), moe.swiglu: the same bits, one launch
gemv_fp4_down_combine(...)  fused gemv(w2) and moe.combine: the same bits, one launch;
    shared_w2=(w2, sh) (bf16 w2 [O, 2048], sh [T, 2048]; full shape only, see down_w2_ok):
    gemv_{fmt}_down_combine_k2_f_w2 computes the shared expert's w2 rows itself (the same bits
    as ops_decode.gemv_bf16(w2, sh, shared) then shared=shared; kernels_cu/gemv_bf16_row.cuh)

impl="simt" | "mma" (default DEFAULT_IMPL = "simt") picks the kernels of the three FP4 GEMVs:
    "simt": the CUDA-core kernels (gemv_*_k{1,2,4}; the validated default);
    "mma":  the tensor-core kernels (gemv_*_mma, K % 128 == 0, K <= 4096): mma.sync m16n8k16 on
            f16 weights (exact e2m1) and f16 x (times a per-segment power of two), f32
            accumulate.  Same contracts, bf16 class, NOT the same bits as "simt" (summation order,
            tensor-core sums, x below max|x| 2^-32 rounded); the fused _mma kernels equal
            gemv_fp4(impl="mma") + swiglu / combine bit for bit.  Bound in
            tests/gpu/test_kernels_experts.py (mma_bound).  Measured on the H200 (715d477):
            not faster than "simt" (gate/up 31.0 vs 28.0 us, down 18.0 vs 18.3 us).

Full-shape fast paths (FULL_PATH, default on): where the shapes are the ones the Flash decode
step always launches, the wrappers launch gemv_{fmt}_gateup_k4_f (K = 4096, O % 2 == 0) and
gemv_{fmt}_down_combine_k2_f (K = 2048, O % 2 == 0, k even) instead of the general _k4 / _k2
kernels: the same row arithmetic without the generality's bookkeeping (no per-load predicates,
compile-time row strides; kernels_cu/experts.cu "full-shape fast paths"), so the same bytes
(tests/gpu/test_kernels_experts.py full_path).  `with full_path(False): ...` forces the general
kernels (tests, tools/bench_gemv.py's A/B); so does MEMRA_DSV4_FP4_FULL=0 (read at every launch:
bench.decode_step's fp4full=off arm captures its graphs with the general kernels; not a seam, the
bytes do not change); gateup_full / down_full say whether a shape qualifies.

Ring gate/up (GATEUP_RING, default off; MEMRA_DSV4_FP4_RING=1 / 0 overrides it at every launch):
where the full path applies, gemv_{fmt}_gateup_k4_r instead of _k4_f, the weights of a whole row
group in flight through cp.async into a per-warp ring in shared memory (64 KB per CTA), the same
bytes (tests/gpu/test_kernels_experts.py gateup_ring, test_step_fp4full_gpu.py).  Measured
(2f2e744 / 33d8500, 2x H200): 24.6 -> 23.7 us alone, nothing in the step.

Shared SwiGLU in the gate/up launch (gemv_fp4_gateup(shared_swiglu=...); the device step's
MEMRA_DSV4_SHARED_GATEUP = on): where the full path applies (not the ring) and the shared expert's
W1 / W3 are bf16 bits, gemv_{fmt}_gateup_k4_f_sh also computes the shared expert's SwiGLU for x row
0, before its PDL wait, with gemv_bf16_swiglu's row code (kernels_cu/gemv_bf16_row.cuh), so the
bytes of that launch (tests/gpu/test_kernels_experts.py gateup_shared); gateup_shared_ok says
whether the inputs qualify.

Tests and tools only: variant_kernels({"FP4_ALU_ODD": 0, ...}) compiles experts.cu with other
values of its tuning macros (the arithmetic does not depend on them), and
`with kernels_from(variant): ...` routes the wrappers above to that build.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import (check, cupy, device_id, dynamic_smem, grid_stride_blocks, i32, kernel,
                                        null_or, out_array, row_stride, sm_count)

STEM = "experts"
KERNELS = ("dequant_mxfp4_bf16", "dequant_nvfp4_bf16") + tuple(
    f"gemv_{fmt}{kind}_k{kpl}" for kind in ("", "_gateup", "_down_combine")
    for fmt in ("mxfp4", "nvfp4") for kpl in (1, 2, 4)) + tuple(
    f"gemv_{fmt}{kind}_mma" for kind in ("", "_gateup", "_down_combine") for fmt in ("mxfp4", "nvfp4")) + tuple(
    f"gemv_{fmt}{kind}_f" for kind in ("_gateup_k4", "_down_combine_k2") for fmt in ("mxfp4", "nvfp4")) + tuple(
    f"gemv_{fmt}_down_combine_k2_f_w2" for fmt in ("mxfp4", "nvfp4")) + tuple(
    f"gemv_{fmt}_gateup_k4_r" for fmt in ("mxfp4", "nvfp4")) + tuple(
    f"gemv_{fmt}_gateup_k4_f_sh" for fmt in ("mxfp4", "nvfp4"))
kernel_loader.register(STEM, KERNELS)

IMPLS = ("simt", "mma")
DEFAULT_IMPL = "simt"    # the lead switches this after the GPU validation of "mma"

# tensor-core launch geometry (kernels_cu/experts.cu, "tensor-core FP4 GEMVs"): a CTA owns 16 rows
# of one slot (token) and all of its terms (plain 1, gate/up 2, down k), each cut into MMA_KS = 2
# K segments = 2 * terms warp tasks on min(2 * terms, 12) warps
MMA_ROWS = 16
MMA_KS = 2
MMA_MAX_WARPS = 12


def _impl(impl) -> str:
    impl = DEFAULT_IMPL if impl is None else impl
    assert impl in IMPLS, f"FP4 GEMV impl {impl!r} (one of {IMPLS})"
    return impl


def _mma_check(K: int, what: str):
    assert K % 128 == 0 and 0 < K <= 4096, f"{what}: impl='mma' needs K % 128 == 0 and K <= 4096 (K = {K})"


def _mma_launch(kern, O: int, n_y: int, terms: int, K: int, args):
    """Grid (ceil(O / 16), n_y), 32 * W threads, dynamic shared memory: W staging areas of
    ceil(K / 256) * 256 bytes, the partials [2 * terms][16] f32 and the combine order [16] int32
    (MmaSmem in experts.cu)."""
    W = min(MMA_KS * terms, MMA_MAX_WARPS)
    seg_bytes = ((K // 128 + MMA_KS - 1) // MMA_KS) * 16 * 16
    smem = W * seg_bytes + MMA_KS * terms * MMA_ROWS * 4 + 16 * 4
    dynamic_smem(kern, smem)
    kern(((O + MMA_ROWS - 1) // MMA_ROWS, n_y), (32 * W,), args, shared_mem=smem)

# FP4 GEMV launch geometry (kernels_cu/experts.cu): 256-thread CTAs of 8 warps, 2 resident per SM
# (<= 128 registers); a warp group is R rows (the FP4_*_R macros of experts.cu). Each slot
# (token for down_combine) gets nx CTAs whose warps share its row groups round-robin, nx chosen
# so the whole launch is about CTAS_PER_SM CTAs per SM (the rows' arithmetic does not depend on nx).
FP4_WARPS = 8
CTAS_PER_SM = 2
GEMV_ROWS_PER_GROUP = 4
GATEUP_ROWS_PER_GROUP = 2
DOWN_ROWS_PER_GROUP = 2
_STATIC_SMEM_SLACK = 1024   # static shared memory of the down kernels (the e2m1 table) is below this

# the full-shape fast kernels (see the module docstring); a switch for tests and tools only
FULL_PATH = True
FULL_PATH_ENV = "MEMRA_DSV4_FP4_FULL"   # "0": the general kernels (A/B in one process)
GATEUP_FULL_K = 4096        # gemv_*_gateup_k4_f: nq = 128 = 32 * KPL (every lane owns 4 chunks)
DOWN_FULL_K = 2048          # gemv_*_down_combine_k2_f: nq = 64 = 32 * KPL


def gateup_full(O: int, K: int) -> bool:
    """gemv_fp4_gateup launches the full-shape kernel for (O, K): K = 4096 and whole row groups."""
    return _full_on() and K == GATEUP_FULL_K and O % GATEUP_ROWS_PER_GROUP == 0


def down_full(O: int, K: int, k: int) -> bool:
    """gemv_fp4_down_combine launches the full-shape kernel for (O, K, k): K = 2048, whole row
    groups and an even pick count (its loop takes two picks per trip)."""
    return _full_on() and K == DOWN_FULL_K and O % DOWN_ROWS_PER_GROUP == 0 and k >= 2 and k % 2 == 0


# gemv_*_gateup_k4_r ("ring"): the full-shape gate/up with its weight ring in shared memory,
# filled by cp.async one row group ahead (experts.cu fp4_stream_gateup_ring; the same bytes as _k4_f).
# Picked where the full path applies and GATEUP_RING is on; MEMRA_DSV4_FP4_RING=1 / 0 overrides it
# (read at every launch, as MEMRA_DSV4_FP4_FULL: bench.decode_step's fp4ring=on|off arms).  Not a
# seam: the bytes do not change.
GATEUP_RING = False
RING_ENV = "MEMRA_DSV4_FP4_RING"
GATEUP_RING_SMEM = 4 * 2 * GATEUP_ROWS_PER_GROUP * 32 * 16 * FP4_WARPS   # experts.cu gateup_ring_bytes<4>()


def gateup_ring_on() -> bool:
    """gemv_fp4_gateup launches the ring kernel for a full-shape gate/up (GATEUP_RING, or the env)."""
    env = os.environ.get(RING_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{RING_ENV}={env!r}: expected 0 or 1 (or unset: ops.experts.GATEUP_RING)")
    return env == "1" if env else GATEUP_RING


DOWN_W2_K = 2048            # gemv_*_down_combine_k2_f_w2: the shared expert's w2 row length (compile-time)
# experts.cu DOWN_W2_PRE_BYTES: the _w2 kernel's w2 preload region (FP4_DN_PRELOAD >= 2: per warp
# R rows x their first 1024 bf16, by cp.async before the PDL wait), requested at every level so
# that the levels (a kernel-tree A/B) differ in their code alone
DOWN_W2_PRE_SMEM = FP4_WARPS * DOWN_ROWS_PER_GROUP * 1024 * 2


def down_w2_ok(O: int, K: int, k: int, w2) -> bool:
    """gemv_fp4_down_combine(shared_w2=(w2, ...)) can launch the _k2_f_w2 kernel: the full shape
    (down_full) and w2 bf16 bits [O, DOWN_W2_K] (an FP8-stored w2 is not supported: the caller
    keeps the separate gemv_bf16)."""
    return (down_full(O, K, k) and w2 is not None and w2.dtype == np.uint16
            and tuple(w2.shape) == (O, DOWN_W2_K))


def gateup_shared_ok(O: int, K: int, x, sw1, sw3) -> bool:
    """gemv_fp4_gateup(shared_swiglu=(sw1, sw3, sh, limit)) can launch the _k4_f_sh kernel: the
    full shape (gateup_full; not the ring, which has no _sh form), one x row (the shared expert
    runs for x row 0: one token), and W1 / W3 of the shared expert as bf16 bits [O_sh,
    GATEUP_FULL_K] (FP8-stored weights are not supported: the caller keeps the separate
    ops_decode.gemv_bf16_swiglu)."""
    return (gateup_full(O, K) and not gateup_ring_on() and x is not None and x.shape[0] == 1
            and sw1 is not None and sw3 is not None and sw1.dtype == np.uint16
            and sw3.dtype == np.uint16 and sw1.ndim == 2 and tuple(sw1.shape) == tuple(sw3.shape)
            and sw1.shape[1] == GATEUP_FULL_K)


def down_w2_smem(O: int, nx: int) -> int:
    """Bytes of the _w2 kernel's w2 row values in shared memory (after the h rows): per warp R
    bf16 values per row group it owns (row groups spread over nx * FP4_WARPS warps), 16-aligned."""
    groups = (O + DOWN_ROWS_PER_GROUP - 1) // DOWN_ROWS_PER_GROUP
    per_warp = (groups + nx * FP4_WARPS - 1) // (nx * FP4_WARPS)
    return (2 * DOWN_ROWS_PER_GROUP * FP4_WARPS * per_warp + 15) // 16 * 16


def _full_on() -> bool:
    return FULL_PATH and os.environ.get(FULL_PATH_ENV, "") != "0"


@contextlib.contextmanager
def full_path(enabled: bool):
    """Inside the block the wrappers use the full-shape kernels only if ``enabled`` (tests, A/B)."""
    global FULL_PATH
    saved = FULL_PATH
    FULL_PATH = bool(enabled)
    try:
        yield
    finally:
        FULL_PATH = saved


def _fp4_grid_x(O: int, rows_per_group: int, n_rows_of_ctas: int, reserve_sms: int = 0) -> int:
    """CTAs per slot (token): enough to fill the GPU, no more than the slot has warp groups for.
    reserve_sms > 0: the grid fits the other SMs at CTAS_PER_SM each, rounded down (a kernel beside
    it holds reserve_sms whole SMs: no CTA of this grid waits for them)."""
    groups = (O + rows_per_group - 1) // rows_per_group
    if reserve_sms:
        want = CTAS_PER_SM * (sm_count() - reserve_sms) // n_rows_of_ctas
    else:
        want = (CTAS_PER_SM * sm_count() + n_rows_of_ctas - 1) // n_rows_of_ctas
    return int(max(1, min(want, (groups + FP4_WARPS - 1) // FP4_WARPS)))


def dequant_mxfp4(packed, scale, out=None):
    """packed [R, C/2] uint8; scale [R, C/32] uint8 (e8m0) -> out [R, C] bf16."""
    check(packed, "dequant_mxfp4.packed", np.uint8)
    R, C = packed.shape[0], 2 * packed.shape[1]
    assert packed.ndim == 2 and C % 32 == 0, f"dequant_mxfp4: packed shape {packed.shape}"
    check(scale, "dequant_mxfp4.scale", np.uint8, (R, C // 32))
    out = out_array(out, "dequant_mxfp4.out", (R, C), np.uint16)
    if R * C:
        kernel(STEM, "dequant_mxfp4_bf16")((grid_stride_blocks(R * C // 32),), (256,),
                                           (packed, scale, out, np.int64(R), i32(C)))
    return out


def dequant_nvfp4(packed, wscale, ws2: float, out=None):
    """packed [R, C/2] uint8; wscale [R, C/16] uint8 (e4m3); ws2 f32 scalar -> out [R, C] bf16."""
    check(packed, "dequant_nvfp4.packed", np.uint8)
    R, C = packed.shape[0], 2 * packed.shape[1]
    assert packed.ndim == 2 and C % 32 == 0, f"dequant_nvfp4: packed shape {packed.shape}"
    check(wscale, "dequant_nvfp4.wscale", np.uint8, (R, C // 16))
    out = out_array(out, "dequant_nvfp4.out", (R, C), np.uint16)
    if R * C:
        kernel(STEM, "dequant_nvfp4_bf16")((grid_stride_blocks(R * C // 32),), (256,),
                                           (packed, wscale, np.float32(ws2), out, np.int64(R), i32(C)))
    return out


def pointer_table(arrays):
    """uint64 device array of the base pointers of ``arrays`` (one per expert; build once)."""
    cp = cupy()
    return cp.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))


def stacked_pointer_table(stacked):
    """Pointer table of a stacked [E, ...] tensor: base + e * stride."""
    cp = cupy()
    check(stacked, "stacked_pointer_table", stacked.dtype)
    E = stacked.shape[0]
    stride = stacked.strides[0]
    return cp.asarray(np.array([stacked.data.ptr + e * stride for e in range(E)], dtype=np.uint64))


def gemv_fp4(fmt: str, x, expert_ids, wptr, sptr, O: int, K: int, out=None, *, x_div: int = 1, ws2=None,
             impl=None):
    """fmt 'mxfp4' | 'nvfp4'.  x [n_x, K] bf16; expert_ids [S] int32 (< 0: zero row);
    wptr/sptr uint64 [E] (packed [O, K/2] u8; scales [O, K/32] e8m0 | [O, K/16] e4m3);
    ws2 f32 [E] (nvfp4) -> out [S, O] bf16 (rows may be strided).  Slot s reads x row s // x_div.
    K % 32 == 0, K <= 4096 (impl 'mma': K % 128 == 0)."""
    impl = _impl(impl)
    assert fmt in ("mxfp4", "nvfp4"), f"gemv_fp4: format {fmt!r}"
    check(x, "gemv_fp4.x", np.uint16, (None, K))
    check(expert_ids, "gemv_fp4.expert_ids", np.int32)
    S = expert_ids.size
    assert (S + x_div - 1) // x_div <= x.shape[0], f"gemv_fp4: {S} slots / x_div {x_div} > {x.shape[0]} x rows"
    check(wptr, "gemv_fp4.wptr", np.uint64)
    check(sptr, "gemv_fp4.sptr", np.uint64, wptr.shape)
    if fmt == "nvfp4":
        check(ws2, "gemv_fp4.ws2", np.float32, wptr.shape)
    assert K % 32 == 0 and K <= 4096, f"gemv_fp4: K = {K} (need K % 32 == 0, K <= 4096)"
    kpl = 1 if K <= 1024 else (2 if K <= 2048 else 4)
    if out is None:
        out = out_array(None, "gemv_fp4.out", (S, O), np.uint16)
    check(out, "gemv_fp4.out", np.uint16, (S, O), rows_strided=True)
    if S and O and impl == "mma":
        _mma_check(K, "gemv_fp4")
        _mma_launch(kernel(STEM, f"gemv_{fmt}_mma"), O, S, 1, K,
                    (x, i32(x_div), expert_ids, wptr, sptr, null_or(ws2 if fmt == "nvfp4" else None),
                     out, i32(row_stride(out)), i32(O), i32(K)))
    elif S and O:
        kernel(STEM, f"gemv_{fmt}_k{kpl}")((_fp4_grid_x(O, GEMV_ROWS_PER_GROUP, S), S), (256,),
                                         (x, i32(x_div), expert_ids, wptr, sptr, null_or(ws2 if fmt == "nvfp4" else None),
                                          out, i32(row_stride(out)), i32(O), i32(K)))
    return out


def _kpl(K: int) -> int:
    assert K % 32 == 0 and K <= 4096, f"FP4 GEMV: K = {K} (need K % 32 == 0, K <= 4096)"
    return 1 if K <= 1024 else (2 if K <= 2048 else 4)


def _tables(fmt, wptr, sptr, ws2, what):
    check(wptr, f"{what}.wptr", np.uint64)
    check(sptr, f"{what}.sptr", np.uint64, wptr.shape)
    if fmt == "nvfp4":
        check(ws2, f"{what}.ws2", np.float32, wptr.shape)
        return ws2
    return np.uint64(0)


def gemv_fp4_gateup(fmt: str, x, expert_ids, w1ptr, s1ptr, w3ptr, s3ptr, O: int, K: int, *, weight=None,
                    limit: float = 10.0, out=None, x_div: int = 1, ws2_1=None, ws2_3=None, impl=None,
                    shared_swiglu=None, shared_spare_ctas: int = 0, reserve_sms: int = 0):
    """h[s] = swiglu(bf16(W1_e x), bf16(W3_e x)) * weight[s] (limit <= 0: no clamp), e = expert_ids[s],
    x row s // x_div -> out [S, O] bf16.  Bit-identical to gemv_fp4(w1), gemv_fp4(w3), moe.swiglu
    (with the same impl).
    shared_swiglu=(sw1, sw3, sh, sh_limit): the same launch also writes the shared expert's
    sh [O_sh] bf16 = swiglu_clamped(bf16(sw1 x[0]), bf16(sw3 x[0]), sh_limit), the bytes of
    ops_decode.gemv_bf16_swiglu(sw1, sw3, x[0], sh, sh_limit) (experts.cu _k4_f_sh; simt, full
    shape, one x row, bf16 sw1 / sw3 [O_sh, 4096]: gateup_shared_ok).  Under PDL (the device step)
    those rows are computed BEFORE the kernel's griddepcontrol.wait, reading x through L2: x must
    have been written at least two launches back (the ffn boundary, before the router), never by
    this launch's direct predecessor.  shared_spare_ctas: the grid's last CTAs (linear order, the
    ones the block scheduler dispatches last) carry no shared rows, the first nx * S - spare CTAs'
    warps all of them (at most 32 each): a CTA that must wait for SMs a concurrent kernel holds
    (the router's cluster) then starts its routed work at once.  reserve_sms (with shared_swiglu):
    the grid is sized for the SMs a concurrent kernel leaves free (_fp4_grid_x), so no CTA waits
    for those; fewer CTAs, each with more row groups.  The same bytes for any value of either."""
    impl = _impl(impl)
    assert fmt in ("mxfp4", "nvfp4"), f"gemv_fp4_gateup: format {fmt!r}"
    check(x, "gemv_fp4_gateup.x", np.uint16, (None, K))
    check(expert_ids, "gemv_fp4_gateup.expert_ids", np.int32)
    S = expert_ids.size
    assert (S + x_div - 1) // x_div <= x.shape[0], "gemv_fp4_gateup: not enough x rows"
    a2 = _tables(fmt, w1ptr, s1ptr, ws2_1, "gemv_fp4_gateup.w1")
    u2 = _tables(fmt, w3ptr, s3ptr, ws2_3, "gemv_fp4_gateup.w3")
    if weight is not None:
        check(weight, "gemv_fp4_gateup.weight", np.float32, (S,))
    if out is None:
        out = out_array(None, "gemv_fp4_gateup.out", (S, O), np.uint16)
    check(out, "gemv_fp4_gateup.out", np.uint16, (S, O), rows_strided=True)
    assert shared_swiglu is not None or not (shared_spare_ctas or reserve_sms), (
        "gemv_fp4_gateup: shared_spare_ctas / reserve_sms apply to the shared_swiglu launch only")
    if shared_swiglu is not None:
        sw1, sw3, sh, sh_limit = shared_swiglu
        assert impl == "simt", "gemv_fp4_gateup: shared_swiglu needs impl 'simt'"
        for name, a in (("sw1", sw1), ("sw3", sw3)):
            check(a, f"gemv_fp4_gateup.shared_swiglu.{name}", np.uint16, (None, GATEUP_FULL_K))
            assert a.flags.c_contiguous and a.data.ptr % 16 == 0, (
                f"gemv_fp4_gateup.shared_swiglu.{name}: contiguous and 16-byte aligned")
        assert gateup_shared_ok(O, K, x, sw1, sw3), (
            f"gemv_fp4_gateup: shared_swiglu needs the full shape (K = {GATEUP_FULL_K}, O even, not the ring "
            f"kernel), one x row and sw1 == sw3 shapes; got O {O}, K {K}, x {tuple(x.shape)}, sw1 "
            f"{tuple(sw1.shape)}, sw3 {tuple(sw3.shape)}")
        assert x.data.ptr % 16 == 0, "gemv_fp4_gateup.x: 16-byte alignment (the shared part reads 16-byte words)"
        check(sh, "gemv_fp4_gateup.shared_swiglu.sh", np.uint16)
        O_sh = int(sw1.shape[0])
        assert sh.size == O_sh and sh.flags.c_contiguous, (
            f"gemv_fp4_gateup.shared_swiglu.sh: {sh.size} elements, expected {O_sh} contiguous")
        assert S > 0 and O > 0, "gemv_fp4_gateup: shared_swiglu needs at least one slot (the launch carries it)"
        reserve = int(reserve_sms)
        assert 0 <= reserve < sm_count(), (
            f"gemv_fp4_gateup: reserve_sms {reserve} outside 0 .. {sm_count() - 1} (the GPU has {sm_count()} SMs)")
        nx = _fp4_grid_x(O, GATEUP_ROWS_PER_GROUP, S, reserve)
        nw = nx * S * FP4_WARPS
        spare = int(shared_spare_ctas)
        assert 0 <= spare < nx * S, (
            f"gemv_fp4_gateup: shared_spare_ctas {spare} outside 0 .. {nx * S - 1} (the grid has {nx * S} CTAs)")
        w_sh = nw - spare * FP4_WARPS
        assert O_sh <= 32 * w_sh, (f"gemv_fp4_gateup: shared_swiglu O_sh {O_sh} > 32 x {w_sh} warps"
                                   f"{f' ({spare} spare CTAs of {nx * S})' if spare else ''}")
        kernel(STEM, f"gemv_{fmt}_gateup_k4_f_sh")(
            (nx, S), (256,),
            (x, i32(x_div), expert_ids, w1ptr, s1ptr, a2, w3ptr, s3ptr, u2, null_or(weight), np.float64(limit),
             out, i32(row_stride(out)), i32(O), i32(K), sw1, sw3, sh, i32(O_sh), i32(w_sh), np.float64(sh_limit)))
        return out
    if S and O and impl == "mma":
        _mma_check(K, "gemv_fp4_gateup")
        _mma_launch(kernel(STEM, f"gemv_{fmt}_gateup_mma"), O, S, 2, K,
                    (x, i32(x_div), expert_ids, w1ptr, s1ptr, a2, w3ptr, s3ptr, u2, null_or(weight),
                     np.float64(limit), out, i32(row_stride(out)), i32(O), i32(K)))
    elif S and O:
        full = gateup_full(O, K)
        ring = full and gateup_ring_on()
        name = (f"gemv_{fmt}_gateup_k4_r" if ring else f"gemv_{fmt}_gateup_k4_f" if full
                else f"gemv_{fmt}_gateup_k{_kpl(K)}")
        kern = kernel(STEM, name)
        smem = dynamic_smem(kern, GATEUP_RING_SMEM) if ring else 0
        kern((_fp4_grid_x(O, GATEUP_ROWS_PER_GROUP, S), S), (256,),
             (x, i32(x_div), expert_ids, w1ptr, s1ptr, a2, w3ptr, s3ptr, u2, null_or(weight), np.float64(limit),
              out, i32(row_stride(out)), i32(O), i32(K)), shared_mem=smem)
    return out


def gemv_fp4_down_combine(fmt: str, h, expert_ids, wptr, sptr, O: int, K: int, *, shared=None, out=None,
                          ws2=None, impl=None, shared_w2=None):
    """y[t] = bf16(sum over picks in ascending expert id of bf16(W2_e h[t*k + j]) + shared[t]).
    h [T*k, K] bf16 (routing-weighted SwiGLU output); expert_ids [T, k] int32; shared [T, O] bf16
    or None -> out [T, O] bf16.  Bit-identical to gemv_fp4(w2) then moe.combine (same impl).
    shared_w2=(w2, sh) instead of shared: w2 [O, 2048] bf16 bits, sh [T, 2048] bf16; the kernel
    computes shared[t] = bf16(w2 . sh[t]) itself (the bytes of ops_decode.gemv_bf16(w2, sh[t])
    then shared=...); simt full shape only (down_w2_ok).
    Under PDL (the device step), builds with experts.cu FP4_DN_PRELOAD >= 1 (opt-in) read
    expert_ids in the full-shape kernels BEFORE their griddepcontrol.wait: the ids must have been written at least two
    launches back (the router, before the routed gate/up that writes h), never by this launch's
    direct predecessor."""
    impl = _impl(impl)
    assert fmt in ("mxfp4", "nvfp4"), f"gemv_fp4_down_combine: format {fmt!r}"
    check(expert_ids, "gemv_fp4_down_combine.expert_ids", np.int32)
    assert expert_ids.ndim == 2 and expert_ids.shape[1] <= 16, "gemv_fp4_down_combine: expert_ids [T, k <= 16]"
    T, k = expert_ids.shape
    check(h, "gemv_fp4_down_combine.h", np.uint16, (T * k, K))
    s2 = _tables(fmt, wptr, sptr, ws2, "gemv_fp4_down_combine")
    if shared is not None:
        check(shared, "gemv_fp4_down_combine.shared", np.uint16, (T, O))
    if shared_w2 is not None:
        w2, shx = shared_w2
        assert shared is None, "gemv_fp4_down_combine: shared and shared_w2 are alternatives"
        assert impl == "simt", "gemv_fp4_down_combine: shared_w2 needs impl 'simt'"
        check(w2, "gemv_fp4_down_combine.shared_w2.w2", np.uint16, (O, DOWN_W2_K))
        check(shx, "gemv_fp4_down_combine.shared_w2.sh", np.uint16)
        assert shx.size == T * DOWN_W2_K and shx.flags.c_contiguous and shx.data.ptr % 16 == 0, (
            f"gemv_fp4_down_combine.shared_w2.sh: {shx.shape}, expected {T} x {DOWN_W2_K} contiguous, 16-aligned")
        assert w2.data.ptr % 16 == 0, "gemv_fp4_down_combine.shared_w2.w2: 16-byte alignment"
        assert down_w2_ok(O, K, k, w2), (
            f"gemv_fp4_down_combine: shared_w2 needs the full shape (K = {DOWN_FULL_K}, O even, k even; "
            f"got O {O}, K {K}, k {k}; MEMRA_DSV4_FP4_FULL not 0)")
    if out is None:
        out = out_array(None, "gemv_fp4_down_combine.out", (T, O), np.uint16)
    check(out, "gemv_fp4_down_combine.out", np.uint16, (T, O), rows_strided=True)
    if T and O and shared_w2 is not None:
        kern = kernel(STEM, f"gemv_{fmt}_down_combine_k2_f_w2")
        nx = _fp4_grid_x(O, DOWN_ROWS_PER_GROUP, T)
        # the h rows (f32), the w2 row values, the w2 preload region
        smem = k * 2 * 4096 + down_w2_smem(O, nx) + DOWN_W2_PRE_SMEM
        if smem + _STATIC_SMEM_SLACK > 48 * 1024:
            dynamic_smem(kern, max(smem, 48 * 1024 + 1))
        kern((nx, T), (256,),
             (h, expert_ids, i32(k), wptr, sptr, s2, w2, shx, out, i32(row_stride(out)), i32(O), i32(K)),
             shared_mem=smem)
    elif T and O and impl == "mma":
        _mma_check(K, "gemv_fp4_down_combine")
        _mma_launch(kernel(STEM, f"gemv_{fmt}_down_combine_mma"), O, T, k, K,
                    (h, expert_ids, i32(k), wptr, sptr, s2, null_or(shared), out, i32(row_stride(out)),
                     i32(O), i32(K)))
    elif T and O:
        kpl = _kpl(K)
        kern = kernel(STEM, f"gemv_{fmt}_down_combine_k2_f" if down_full(O, K, k) else f"gemv_{fmt}_down_combine_k{kpl}")
        smem = k * kpl * (4096 if kpl <= 2 else 2048)   # the token's k rows of h (f32 | bf16) in shared memory
        if smem + _STATIC_SMEM_SLACK > 48 * 1024:
            dynamic_smem(kern, max(smem, 48 * 1024 + 1))
        kern((_fp4_grid_x(O, DOWN_ROWS_PER_GROUP, T), T), (256,),
             (h, expert_ids, i32(k), wptr, sptr, s2, null_or(shared), out, i32(row_stride(out)), i32(O), i32(K)),
             shared_mem=smem)
    return out


_VARIANTS: dict = {}   # (device, defines) -> lookup


def variant_kernels(defines: dict):
    """kernels_cu/experts.cu built with extra ``-D NAME=value`` tuning macros (FP4_ALU_ODD,
    FP4_ALU_EVEN, FP4_PRMT, FP4_DEPTH, FP4_DN_DEPTH, ...), for tests and benchmarks: returns a
    ``kernel(stem, name)`` lookup to pass to `kernels_from`.  Not for the decode path (no disk-cache bookkeeping)."""
    cp = cupy()
    key = (device_id(), tuple(sorted((k, int(v)) for k, v in defines.items())))
    hit = _VARIANTS.get(key)
    if hit is not None:
        return hit
    loader = kernel_loader.get_loader(device_id())
    with open(loader.source_path(STEM), encoding="utf-8") as fh:
        source = fh.read()
    options = kernel_loader.nvrtc_options(loader.kernels_dir) + tuple(
        f"-D{k}={int(v)}" for k, v in sorted(defines.items()))
    module = cp.RawModule(code=source, options=options, name_expressions=list(KERNELS))
    module.compile()
    funcs = {n: module.get_function(n) for n in KERNELS}

    def lookup(stem: str, name: str):
        assert stem == STEM, f"variant_kernels: {stem!r} is not {STEM!r}"
        return funcs[name]
    _VARIANTS[key] = lookup
    return lookup


@contextlib.contextmanager
def kernels_from(lookup):
    """Route this module's wrappers to ``lookup`` (a `variant_kernels` build) inside the block."""
    global kernel
    saved = kernel
    kernel = lookup
    try:
        yield
    finally:
        kernel = saved
