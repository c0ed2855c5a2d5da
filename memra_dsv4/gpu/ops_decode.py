"""Launch wrappers of kernels_cu/decode.cu: the device decode step's glue (see the .cu header).

All take preallocated CuPy arrays (arena views) and allocate nothing; integer arguments go as
np.int32; positions are read on the device from ``pos`` (int32 [1]).

Dense GEMV variants.  Every dense GEMV (gemv_bf16 plain, gemv_bf16_multi, gemv_bf16_swiglu) has
several kernels that return the same bits (decode.cu THE ORDER) and differ in speed only:
register kernels ``r{R}t{T}`` (plain; R rows per warp, T trips of loads at once), ``r{R}``
(multi), ``p{P}`` (swiglu), the TMA bulk-copy streaming kernels ``bulk_r{R}s{S}`` /
``bulk_p{P}s{S}`` (a persistent grid, an S-stage shared-memory ring per warp; K % 16 == 0 and,
for FP8 rows, K <= 8192), and the persistent register-ring kernels ``ps_r{R}d{D}`` (plain bf16,
K % 1024 == 0: each warp walks row groups with D trips of loads in flight; ninth session) and
``pl_r{R}`` (plain bf16, K % 1024 == 0: the warp's first trip of weights loaded before the PDL
wait; ninth session), and ``pl_r{R}[t{T}]`` of the multi GEMV (its bf16 warps' first T trips
before the wait; twenty-fourth session).  Measured on the H200 (6089d42, ``tools/bench_gemv.py --dense-only
--variants``, L2 flushed): every variant bit-identical to the default; the bulk kernels slower
on every shape (wq_b bf16 24.3 vs 19.9 us, fp8 19.4 vs 13.4 us), the register variants 0.5-2 us
faster on the small shapes only, and no change of the whole step (8.49 vs 8.50 ms), so the
defaults stayed.  At 57a2c0d, with the bf16 two-trip multi / swiglu kernels added, the pick of
``--suggest`` took the step from 8.18 to 7.94 ms (bf16 dense) and 7.20 to 7.01 ms (fp8) in one
process; it is GEMV_SELECT below.  Which one a launch uses:

* an explicit ``variant=`` argument (asserted eligible), else
* ``MEMRA_DSV4_GEMV_VARIANT`` (bench / A-B runs only; read at every call): comma-separated
  ``KEY=VARIANT``, KEY ``op``, ``op.form``, ``op.form.cls`` or ``op.form.site`` (op plain |
  multi | swiglu, form bf16 | fp8, cls small | large, see gemv_shape_class, site a launch's role
  where its caller names one: "out" = the attention's wo_a / wo_b; the most specific key wins), e.g.
  ``plain.fp8=bulk_r4s4,plain.bf16.small=bulk_r1s4,multi=bulk_r4s3``, else
* ``GEMV_SELECT``, the same keys in a module-level dict (empty: the current defaults), else
* the current defaults (gemv_default_variant, multi r4, swiglu p2).

A variant named by the env or the table that a launch cannot take (K, rows per group, the
table's R) falls back to the default for that launch.  ``default`` names the default.
"""

from __future__ import annotations

import os

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import (check, dynamic_smem, i32, kernel, null_or, sm_count,
                                        ticket_counter)

STEM = "decode"
# The dense GEMVs (decode.cu): one kernel per weight form, rows per warp R and (FP8) trips issued
# together T; a row's bits depend on none of them (see warp_rows_dot).  128-thread CTAs of
# GEMV_WARPS warps (decode.cu GEMV_THREADS / 32).
GEMV_WARPS = 4
GEMV_ROWS = {False: (1, 2, 4), True: (1, 2, 4, 8)}    # R instantiated per form (True: e4m3 W)
GEMV_VARIANTS = {False: ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)),     # (R, T) instantiated per form
                 True: ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (1, 4), (2, 2), (2, 4))}
MULTI_ROWS = (1, 4)                                   # gemv_bf16_multi_r*
# gemv_bf16_x{NX}_r{R} (the verify step's multi-row GEMV): (max rows NX, rows per warp R)
XROWS_KERNELS = ((2, 4), (4, 2), (8, 1))
XROWS_MAX = 8
XROWS_R = tuple(r for _, r in XROWS_KERNELS)          # their rows per warp
# gemv_bf16_swiglu_x{NX}_p{P} (the verify's shared-expert W1 / W3 + SwiGLU): (max rows, outputs per warp)
SWIGLU_XROWS_KERNELS = ((2, 2), (4, 1), (8, 1))
SWIGLU_OUTS = (1, 2)                                  # gemv_bf16_swiglu_p* (2P rows per warp)
# (R | P, bf16 trips at once) instantiated: gemv_bf16_multi_r{R}[t{T}], gemv_bf16_swiglu_p{P}[t{T}]
MULTI_VARIANTS = ((1, 1), (4, 1), (1, 2), (4, 2))
# (R, T) of gemv_bf16_multi_pl_r{R}[t{T}] (decode.cu gemv_multi_rows_pl: the register kernel r{R}t{T}
# whose bf16 warps load their first T trips of weights before the PDL wait; variant pl_r{R}[t{T}])
MULTI_PL = ((1, 1), (4, 1), (1, 2))
SWIGLU_VARIANTS = ((1, 1), (2, 1), (1, 2), (2, 2))
# TMA bulk streaming kernels (decode.cu gb_stream): (R | P, stages S, launch-bounds min CTAs)
GEMV_BULK = {False: ((1, 4, 4), (2, 4, 3), (4, 3, 2)),   # gemv_bf16_bulk_r{R}s{S}
             True: ((1, 8, 4), (2, 4, 4), (4, 4, 3))}    # gemv_fp8_bulk_r{R}s{S}
MULTI_BULK = ((1, 8, 4), (4, 3, 2))                      # gemv_bf16_multi_bulk_r{R}s{S}
SWIGLU_BULK = ((1, 4, 3), (2, 3, 2))                     # gemv_bf16_swiglu_bulk_p{P}s{S}
# Persistent register-ring bf16 kernels (decode.cu gemv_ps_rows): (R, ring depth D, launch-bounds
# min CTAs); plain bf16 GEMVs with K % 1024 == 0 only (variant name ps_r{R}d{D})
GEMV_PS = ((1, 4, 4), (2, 2, 4), (2, 3, 3), (4, 2, 2))        # gemv_bf16_ps_r{R}d{D}
# bf16 kernels whose first trip of weights is loaded before the PDL wait (decode.cu gemv_pl_rows):
# R rows per warp; plain bf16 GEMVs with K % 1024 == 0 only (variant name pl_r{R})
GEMV_PL = (2, 4)                                              # gemv_bf16_pl_r{R}
# The lead's pick after a GPU measurement: {"op[.form[.cls]]": variant}; empty = the defaults.
# 57a2c0d on 2x H200 (bench/results/2026-11-30-nvidia-h200-57a2c0d-gemv.log: tools/bench_gemv.py
# --dense-only --variants --suggest, L2 flushed; every variant bit-identical), then the step A/B
# in one process (bench.decode_step --arms path=device+gemv=base,path=device+gemv=pick, 1K, 60
# steps): bf16 dense 8.18 -> 7.94 ms, fp8 dense 7.20 -> 7.01 ms per token.  plain.bf16.large
# r2t2 -> pl_r2 (the first trip of weights loaded before the PDL wait; bit-identical, byte tests
# at 5a2e011 / 3bbb826): 7.56 -> 7.51 ms at 3bbb826 and 7.23 -> 7.17 ms at a40ee2f (1K bf16,
# 160 steps per arm, one process; bench/results/2026-11-30-nvidia-h200-a40ee2f-ab_1k.log).
# Launches pl_r2 cannot take (K % 1024 != 0, or R not dividing rows_per_group) keep r2t2.
# multi.bf16: the probe's pick (r1t2) never reached the step: until the forty-first session
# GemvTable flagged every table built from (weight, None) entries (all of the step's) as FP8, so
# the multi GEMV's selection (and MEMRA_DSV4_GEMV_VARIANT's multi.bf16 keys, e.g. the s24 A/B of
# pl_r1t2, "neutral") fell through to the default r4, which every measured step ran.  With the
# flag fixed, "default" keeps that measured kernel until a step A/B on the GPU picks another.
GEMV_SELECT: dict = {"multi.bf16": "default", "plain.bf16.large": "pl_r2", "plain.bf16.small": "r1t2",
                     "plain.fp8.small": "r2t2", "swiglu.bf16": "p1t2", "swiglu.fp8": "p1t2"}
GEMV_VARIANT_ENV = "MEMRA_DSV4_GEMV_VARIANT"
_SMALL_ELEMS = 1 << 23     # weight elements at or below which a GEMV is "small" (<= 16 MB bf16)


# L2 prefetch before the PDL wait (decode.cu memra_l2_prefetch_bytes; seam MEMRA_DSV4_L2_PREFETCH)
L2_PREFETCH_SYMBOL = "memra_l2_prefetch_bytes"
# (device, id(module)) -> (the module, bytes last written to its constant); the module is kept so
# a rebuilt module never inherits a freed one's entry through a reused id
_l2_prefetch_set: dict = {}


def l2_prefetch_bytes(value) -> int:
    """Seam value (``off`` or MB as text / int) -> bytes; ValueError naming the value otherwise."""
    if value in (None, "off", 0, "0"):
        return 0
    try:
        mb = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"l2_prefetch = {value!r}: expected 'off' or a whole number of MB") from None
    if not 0 <= mb <= 4096:
        raise ValueError(f"l2_prefetch = {value!r} MB: expected 0..4096")
    return mb << 20


def set_l2_prefetch(device_id: int, value) -> int:
    """Write the prefetch budget (bytes per weight matrix and launch) into ``device_id``'s
    decode module constant; a no-op when it already holds it.  A synchronous host-to-device copy
    outside any stream capture (the kernels read the constant when they run, so captured graphs
    follow it).  Returns the bytes."""
    nbytes = l2_prefetch_bytes(value)
    mod = kernel_loader.get_loader(device_id).module(STEM)   # a rebuilt module starts at 0
    key = (device_id, id(mod))
    hit = _l2_prefetch_set.get(key)
    if hit is not None and hit[0] is mod and hit[1] == nbytes:
        return nbytes
    import cupy as cp
    with cp.cuda.Device(device_id):
        ptr = mod.get_global(L2_PREFETCH_SYMBOL)
        host = np.array([nbytes], dtype=np.uint64)
        cp.cuda.runtime.memcpy(ptr.ptr, host.ctypes.data, 8, cp.cuda.runtime.memcpyHostToDevice)
    _l2_prefetch_set[key] = (mod, nbytes)
    return nbytes


def gemv_default_variant(fp8: bool, K: int) -> tuple:
    """(R, T) of a gemv_bf16 launch: 8 KB of weights in flight per warp in every case (decode.cu
    GEMV_MINB): bf16 4 rows x 4 chunks x 16 B x 32 lanes; FP8 8 rows x 4 x 8 B, or, for rows of
    >= 2048 (few rows, long K: wo_b, shared_w2), 4 rows x 2 trips x 4 x 8 B."""
    if not fp8:
        return 4, 1
    return (4, 2) if K >= 2048 else (8, 1)


def _gemv_kernel_name(fp8: bool, R: int, T: int) -> str:
    return f"gemv_{'fp8' if fp8 else 'bf16'}_r{R}" + (f"t{T}" if T > 1 else "")


GEMV_KERNELS = tuple(_gemv_kernel_name(f, r, t) for f in (False, True) for r, t in GEMV_VARIANTS[f]) + \
    tuple(f"gemv_bf16_multi_r{r}" + (f"t{t}" if t > 1 else "") for r, t in MULTI_VARIANTS) + \
    tuple(f"gemv_bf16_multi_r{r}" + (f"t{t}" if t > 1 else "") + "_qn" for r, t in MULTI_VARIANTS) + \
    tuple(f"gemv_bf16_multi_pl_r{r}" + (f"t{t}" if t > 1 else "") for r, t in MULTI_PL) + \
    tuple(f"gemv_bf16_swiglu_p{p}" + (f"t{t}" if t > 1 else "") for p, t in SWIGLU_VARIANTS) + \
    tuple(f"gemv_{'fp8' if f else 'bf16'}_bulk_r{r}s{st}" for f in (False, True) for r, st, _ in GEMV_BULK[f]) + \
    tuple(f"gemv_bf16_multi_bulk_r{r}s{st}" for r, st, _ in MULTI_BULK) + \
    tuple(f"gemv_bf16_swiglu_bulk_p{p}s{st}" for p, st, _ in SWIGLU_BULK) + \
    tuple(f"gemv_bf16_ps_r{r}d{d}" for r, d, _ in GEMV_PS) + \
    tuple(f"gemv_bf16_pl_r{r}" for r in GEMV_PL) + \
    tuple(f"gemv_bf16_pl_r{r}_qn" for r in GEMV_PL) + \
    tuple(f"gemv_bf16_pl2_r{r}" for r in GEMV_PL)


def gemv_variant_names(op: str, fp8: bool, new_only: bool = True) -> tuple:
    """Variant names of a dense GEMV op ('plain', 'multi', 'swiglu') for a weight form:
    'default' first, then the register kernels added next to the defaults (all of them with
    new_only False) and the bulk kernels (tools/bench_gemv.py --variants, the GPU tests)."""
    if op == "plain":
        old = {False: ((1, 1), (2, 1), (4, 1)), True: ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2))}[fp8]
        reg = [f"r{r}t{t}" for r, t in GEMV_VARIANTS[fp8] if not (new_only and (r, t) in old)]
        return ("default", *reg, *(f"bulk_r{r}s{st}" for r, st, _ in GEMV_BULK[fp8]),
                *(() if fp8 else (f"ps_r{r}d{d}" for r, d, _ in GEMV_PS)),
                *(() if fp8 else (f"pl_r{r}" for r in GEMV_PL)))
    if op == "multi":
        return ("default", *(() if new_only else ("r1", "r4")), "r1t2", "r4t2",
                *(f"bulk_r{r}s{st}" for r, st, _ in MULTI_BULK),
                *(f"pl_r{r}" + (f"t{t}" if t > 1 else "") for r, t in MULTI_PL))
    if op == "swiglu":
        return ("default", *(() if new_only else ("p1", "p2")), "p1t2", "p2t2",
                *(f"bulk_p{p}s{st}" for p, st, _ in SWIGLU_BULK))
    raise ValueError(f"gemv op {op!r}: plain, multi or swiglu")


def gemv_shape_class(O: int, K: int) -> str:
    """'small' (<= 2^23 weight elements: wq_a, wkv, shared_w1 / w2, idx_wq_b) or 'large'."""
    return "small" if int(O) * int(K) <= _SMALL_ELEMS else "large"


def _parse_select(text: str) -> dict:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, val = item.partition("=")
        assert sep and key.strip() and val.strip(), (
            f"{GEMV_VARIANT_ENV}: {item!r} is not KEY=VARIANT (KEY op[.form[.cls]])")
        out[key.strip()] = val.strip()
    return out


def gemv_selected(op: str, fp8: bool, cls: str, site: str | None = None) -> str | None:
    """The variant the env override or GEMV_SELECT names for (op, form, cls); None: default.
    ``site`` (a launch's role, e.g. "out" for the attention output projections) adds the most
    specific key ``op.form.site``, tried first in each table."""
    form = "fp8" if fp8 else "bf16"
    keys = ((f"{op}.{form}.{site}",) if site else ()) + (f"{op}.{form}.{cls}", f"{op}.{form}", op)
    env = os.environ.get(GEMV_VARIANT_ENV, "")
    for table in ((_parse_select(env),) if env else ()) + (GEMV_SELECT,):
        for k in keys:
            if k in table:
                v = table[k]
                return None if v == "default" else v
    return None


def _bulk_smem(nr: int, S: int, rowb: int) -> int:
    """decode.cu gb_stream's dynamic shared memory: 4 warps' mbarriers (128 B aligned) + rings."""
    return -(-GEMV_WARPS * S * 8 // 128) * 128 + GEMV_WARPS * S * nr * rowb


def _bulk_launch(name: str, groups: int, nr: int, S: int, rowb: int, minb: int, args: tuple):
    """A persistent gb_stream launch: nw = min(groups, warps resident on every SM) warps."""
    k = kernel(STEM, name)
    smem = _bulk_smem(nr, S, rowb)
    ctas = max(1, min(int(minb), (228 * 1024) // (smem + 1024)))
    nw = max(1, min(int(groups), sm_count() * GEMV_WARPS * ctas))
    dynamic_smem(k, smem)
    k(_gemv_grid(nw), (32 * GEMV_WARPS,), args + (i32(nw),), shared_mem=smem)


def _parse_variant(v: str, letter: str):
    """'bulk_r4s3' -> (True, 4, 3); 'r4t2' -> (False, 4, 2); 'r4' / 'p2' -> (False, n, 1)."""
    bulk = v.startswith("bulk_")
    body = v[5:] if bulk else v
    try:
        assert body[0] == letter
        if bulk:
            a, b = body[1:].split("s")
            return True, int(a), int(b)
        a, _, b = body[1:].partition("t")
        return False, int(a), int(b) if b else 1
    except (AssertionError, ValueError, IndexError):
        raise ValueError(f"gemv variant {v!r}: expected {letter}N[tT] or bulk_{letter}NsS") from None


def parse_multi_variant(v: str):
    """A multi variant name -> (kind, R, S): 'r4t2' -> ('reg', 4, 2), 'bulk_r4s3' -> ('bulk', 4,
    3), 'pl_r1t2' -> ('pl', 1, 2) (S: bf16 trips at once, or the bulk ring's stages)."""
    if v.startswith("pl_"):
        bulk, R, T = _parse_variant(v[3:], "r")
        if bulk:
            raise ValueError(f"gemv variant {v!r}: expected pl_rN[tT]")
        return "pl", R, T
    bulk, R, S = _parse_variant(v, "r")
    return ("bulk" if bulk else "reg"), R, S


def parse_ps(v: str):
    """'ps_r2d3' -> (2, 3); None if v is not a persistent-ring variant name."""
    if not v.startswith("ps_r"):
        return None
    a, sep, b = v[4:].partition("d")
    if not (sep and a.isdigit() and b.isdigit()):
        raise ValueError(f"gemv variant {v!r}: expected ps_rNdD")
    return int(a), int(b)


def parse_pl(v: str):
    """'pl_r2' -> 2; None if v is not a preload variant name."""
    if not v.startswith("pl_r"):
        return None
    if not v[4:].isdigit():
        raise ValueError(f"gemv variant {v!r}: expected pl_rN")
    return int(v[4:])


def pl_ok(R: int, fp8: bool, K: int, rpg: int) -> bool:
    """Whether gemv_bf16_pl_r{R} exists and can take the launch (bf16, K % 1024, R | rpg)."""
    return not fp8 and R in GEMV_PL and K % 1024 == 0 and rpg % R == 0


def ps_ok(R: int, D: int, fp8: bool, K: int, rpg: int) -> bool:
    """Whether gemv_bf16_ps_r{R}d{D} exists and can take the launch (bf16, K % 1024, R | rpg)."""
    return (not fp8 and any(r == R and d == D for r, d, _ in GEMV_PS) and K % 1024 == 0
            and rpg % R == 0)


def _stream_variant(variant: str, fp8: bool, O: int, K: int, rpg: int):
    """(kernel name, warps) of a ps_r*d* / pl_r* variant that can take this plain launch; False if
    the name is one of them but the launch is not eligible; None if it names neither.  ps: a
    persistent grid of at most the warps resident at once (its launch bounds' minimum CTAs per
    SM); pl: one warp per R rows, as the r*t* kernels."""
    ps = parse_ps(variant)
    if ps is not None:
        R, D = ps
        if not ps_ok(R, D, fp8, K, rpg):
            return False
        minb = next(m for r, d, m in GEMV_PS if r == R and d == D)
        return f"gemv_bf16_ps_r{R}d{D}", max(1, min(-(-O // R), sm_count() * GEMV_WARPS * minb))
    pl = parse_pl(variant)
    if pl is not None:
        return (f"gemv_bf16_pl_r{pl}", -(-O // pl)) if pl_ok(pl, fp8, K, rpg) else False
    return None


def _bulk_ok(K: int, fp8: bool) -> bool:
    return K % 16 == 0 and (not fp8 or K <= 8192)
KERNELS = GEMV_KERNELS + ("embed_gather", "step_scalars", "ring_write", "pending_write", "entry_commit",
                          "pending_advance", "build_cand", "l2_prefetch_paced", "greedy_argmax_f32",
                          "copy_vec4_x4", "verify_rollback") \
    + tuple(f"gemv_bf16_x{nx}_r{r}" for nx, r in XROWS_KERNELS) \
    + tuple(f"gemv_bf16_multi_x{nx}_r{r}" for nx, r in XROWS_KERNELS) \
    + tuple(f"gemv_bf16_swiglu_x{nx}_p{p}" for nx, p in SWIGLU_XROWS_KERNELS)
kernel_loader.register(STEM, KERNELS)

__all__ = ["GEMV_WARPS", "GEMV_ROWS", "GEMV_VARIANTS", "MULTI_ROWS", "SWIGLU_OUTS", "MULTI_VARIANTS",
           "SWIGLU_VARIANTS", "gemv_default_variant",
           "GEMV_BULK", "MULTI_BULK", "SWIGLU_BULK", "GEMV_SELECT", "GEMV_VARIANT_ENV", "gemv_variant_names",
           "gemv_shape_class", "gemv_selected",
           "dense_weight", "gemv_bf16", "gemv_bf16_qnorm", "gemv_bf16_pair", "l2_prefetch_paced", "QNORM_K", "GemvTable", "gemv_bf16_multi", "xrows_R", "gemv_bf16_multi_rows", "gemv_bf16_swiglu_xrows", "gemv_bf16_swiglu", "embed_gather", "step_scalars", "ring_write", "pending_write",
           "entry_commit", "pending_advance", "build_cand", "greedy_argmax", "copy_words", "copy_words_ok", "COPY_PAIRS_MAX",
           "RollbackTable", "verify_rollback",
           "KERNELS", "STEM"]


def _blocks(n: int) -> int:
    return max(1, min((int(n) + 255) // 256, 1024))


def dense_weight(w, scale=None, name: str = "w"):
    """(weight, scale, ld_scale) kernel arguments of a dense [O, K] weight in either form:
    bf16 bits (uint16, scale None) or the stored FP8 (uint8 e4m3 bytes + uint8 e8m0 scales
    [ceil(O/128), ceil(K/128)])."""
    O, K = w.shape
    if w.dtype == np.uint8:
        assert scale is not None, f"{name}: FP8 weight without its .scale"
        check(scale, f"{name}.scale", np.uint8, (-(-O // 128), -(-K // 128)))
        assert w.flags.c_contiguous and w.data.ptr % 16 == 0, f"{name}: contiguous, 16-byte aligned"
        return w, scale, i32(scale.shape[1])
    check(w, name, np.uint16)
    assert scale is None, f"{name}: a bf16 weight takes no scale"
    assert w.data.ptr % 16 == 0, f"{name}: 16-byte alignment"
    return w, np.uint64(0), i32(0)


def _gemv_grid(warps: int) -> tuple:
    return ((int(warps) + GEMV_WARPS - 1) // GEMV_WARPS,)


def _check_gemv_out(out, O: int, name: str) -> None:
    """A plain GEMV's output: O f32 or bf16-bits values, contiguous."""
    assert out.dtype in (np.float32, np.uint16) and out.size == O and out.flags.c_contiguous, (
        f"{name}: {out.shape} {out.dtype}, expected {O} f32/bf16 contiguous")


def _selected_pl(fp8: bool, O: int, K: int, site: str | None):
    """R when the plain GEMV of this shape (and ``site``) is selected to run as pl_r{R} and
    pl_r{R} can take it with one x for every row (the fused forms: gemv_bf16_qnorm /
    gemv_bf16_pair), else None."""
    variant = gemv_selected("plain", fp8, gemv_shape_class(O, K), site)
    R = parse_pl(variant) if variant else None
    return R if R and pl_ok(R, fp8, K, 0) else None


def gemv_bf16(w, x, out, *, groups: int = 1, scale=None, rows_per_warp: int | None = None,
              trips: int | None = None, variant: str | None = None, site: str | None = None):
    """out [O] (f32 or bf16 bits) = W [O, K] . x (bf16 bits); W bf16 bits or stored FP8 with
    ``scale`` (same bits either way); groups > 1: row o uses x[(o // (O // groups)) * K : +K]
    (x holds groups * K values).  rows_per_warp R and trips T (a GEMV_VARIANTS pair; default
    gemv_default_variant, R lowered to a divisor of the rows per group) change the speed only,
    never the bits; so does ``variant`` (module docstring: 'r{R}t{T}', 'bulk_r{R}s{S}',
    'default'; None: the env override / GEMV_SELECT / the default, looked up with ``site``)."""
    O, K = w.shape
    wa, sa, ld = dense_weight(w, scale, "gemv_bf16.w")
    assert K % 8 == 0, f"gemv_bf16: K = {K} must be a multiple of 8"
    check(x, "gemv_bf16.x", np.uint16)
    assert x.size == groups * K, f"gemv_bf16.x: {x.size} values, expected {groups} * {K}"
    _check_gemv_out(out, O, "gemv_bf16.out")
    assert O % groups == 0, f"gemv_bf16: {O} rows not divisible into {groups} groups"
    assert x.data.ptr % 16 == 0, "gemv_bf16.x: 16-byte alignment"
    rpg = O // groups if groups > 1 else 0
    fp8 = bool(w.dtype == np.uint8)
    explicit = variant is not None
    if variant is None and rows_per_warp is None and trips is None:
        variant = gemv_selected("plain", fp8, gemv_shape_class(O, K), site)
    sv = _stream_variant(variant, fp8, O, K, rpg) if variant is not None else None
    if sv is not None:   # ps_r*d* / pl_r*
        assert sv or not explicit, f"gemv_bf16: variant {variant!r} not available for {'fp8' if fp8 else 'bf16'} [{O}x{K}], {rpg} rows per group"
        if sv:
            name, nw = sv
            kernel(STEM, name)(
                _gemv_grid(nw), (32 * GEMV_WARPS,),
                (wa, sa, ld, x, out, i32(O), i32(K), i32(rpg), i32(1 if out.dtype == np.uint16 else 0)))
            return out
        # a selected (not explicit) variant this launch cannot take: pl_r{R} -> r{R}t2 (the same
        # rows per warp; pl_r2 replaced the r2t2 pick), ps_r*d* -> the default
        R_pl = None if fp8 else parse_pl(variant)
        variant = f"r{R_pl}t2" if R_pl and (R_pl, 2) in GEMV_VARIANTS[fp8] else None
    if variant is not None and variant != "default":
        bulk, R, T = _parse_variant(variant, "r")
        if bulk:
            ok = any(r == R and st == T for r, st, _ in GEMV_BULK[fp8]) and _bulk_ok(K, fp8) and rpg % R == 0
        else:
            ok = (R, T) in GEMV_VARIANTS[fp8] and rpg % R == 0
        assert ok or not explicit, f"gemv_bf16: variant {variant!r} not available for {'fp8' if fp8 else 'bf16'} [{O}x{K}], {rpg} rows per group"
        if ok and bulk:
            minb = next(m for r, st, m in GEMV_BULK[fp8] if r == R and st == T)
            _bulk_launch(f"gemv_{'fp8' if fp8 else 'bf16'}_bulk_r{R}s{T}", -(-O // R), R, T,
                         1024 if fp8 else 2048, minb,
                         (wa, sa, ld, x, out, i32(O), i32(K), i32(rpg),
                          i32(1 if out.dtype == np.uint16 else 0)))
            return out
        if ok:
            rows_per_warp, trips = R, T
    R, T = gemv_default_variant(fp8, K)
    if rows_per_warp is None and trips is None:
        while rpg % R:            # a warp's rows must share one x (R = 1 always does)
            R, T = R // 2, 1
    else:
        R = R if rows_per_warp is None else int(rows_per_warp)
        T = 1 if trips is None else int(trips)
    assert R in GEMV_ROWS[fp8], f"gemv_bf16: rows_per_warp {R} not in {GEMV_ROWS[fp8]}"
    assert (R, T) in GEMV_VARIANTS[fp8], f"gemv_bf16: (rows_per_warp, trips) {(R, T)} not in {GEMV_VARIANTS[fp8]}"
    assert rpg % R == 0, f"gemv_bf16: rows_per_warp {R} does not divide the {rpg} rows per group"
    kernel(STEM, _gemv_kernel_name(fp8, R, T))(
        _gemv_grid(-(-O // R)), (32 * GEMV_WARPS,),
        (wa, sa, ld, x, out, i32(O), i32(K), i32(rpg), i32(1 if out.dtype == np.uint16 else 0)))
    return out


def gemv_bf16_xrows(w, X, out, *, groups: int = 1):
    """out [nx, O] (f32 or bf16 bits) = X [nx, groups * K] (bf16 bits) . W [O, K]^T for the nx <= 8
    rows of a verify, each weight chunk loaded once for all of them (decode.cu gemv_bf16_x*:
    docs/verify_step_plan.md stage 1); row j's bits are gemv_bf16(w, X[j])'s.  W bf16 bits (the
    FP8-as-stored form is not built yet); groups as gemv_bf16 (row o uses X[j, (o // (O //
    groups)) * K : + K]).  X and out may be row-strided views (last axis contiguous, rows 16-byte
    aligned); the kernel with the fewest rows per warp for nx (nx <= 2: r4, <= 4: r2, else r1)."""
    O, K = w.shape
    check(w, "gemv_bf16_xrows.w", np.uint16)
    assert w.flags.c_contiguous and w.data.ptr % 16 == 0, "gemv_bf16_xrows.w: contiguous, aligned"
    assert K % 8 == 0, f"gemv_bf16_xrows: K = {K} must be a multiple of 8"
    assert X.dtype == np.uint16 and X.ndim == 2, f"gemv_bf16_xrows.X: {X.shape} {X.dtype}"
    nx = X.shape[0]
    assert 1 <= nx <= XROWS_MAX, f"gemv_bf16_xrows: {nx} rows, expected 1..{XROWS_MAX}"
    assert X.shape[1] == groups * K, f"gemv_bf16_xrows.X: {X.shape[1]} values a row, expected {groups} * {K}"
    assert O % groups == 0, f"gemv_bf16_xrows: {O} rows not divisible into {groups} groups"
    assert X.strides[1] == 2 and X.strides[0] % 16 == 0 and X.data.ptr % 16 == 0, (
        f"gemv_bf16_xrows.X: rows 16-byte aligned, last axis contiguous (strides {X.strides})")
    assert out.dtype in (np.float32, np.uint16) and out.shape == (nx, O), (
        f"gemv_bf16_xrows.out: {out.shape} {out.dtype}, expected ({nx}, {O}) f32/bf16")
    assert out.strides[1] == out.itemsize, "gemv_bf16_xrows.out: last axis contiguous"
    rpg = O // groups if groups > 1 else 0
    # R = 1 (x8_r1) takes any rows per group
    NX, R = next((a, r) for a, r in XROWS_KERNELS if nx <= a and rpg % r == 0)
    kernel(STEM, f"gemv_bf16_x{NX}_r{R}")(
        _gemv_grid(-(-O // R)), (32 * GEMV_WARPS,),
        (w, X, i32(X.strides[0] // 2), i32(nx), out, i32(out.strides[0] // out.itemsize),
         i32(O), i32(K), i32(rpg), i32(1 if out.dtype == np.uint16 else 0)))
    return out


def gemv_bf16_swiglu_xrows(w1, w3, X, h, limit: float):
    """h [nx, O] bf16 = swiglu_clamped(bf16(W1 X[j]), bf16(W3 X[j]), limit) for the nx <= 8 rows
    of a verify in one launch (decode.cu gemv_bf16_swiglu_x{NX}_p{P}: W1 and W3 read once for the
    rows); row j's bits are gemv_bf16_swiglu(w1, w3, X[j], h[j], limit)'s.  W1, W3 bf16 bits [O,
    K] (the FP8-as-stored form has no x-rows kernel); X [nx, K] bf16 rows, h [nx, O] (row-strided
    views: last axis contiguous, 16-byte aligned rows for X)."""
    O, K = w1.shape
    for name, w in (("w1", w1), ("w3", w3)):
        check(w, f"gemv_bf16_swiglu_xrows.{name}", np.uint16, (O, K))
        assert w.data.ptr % 16 == 0, f"gemv_bf16_swiglu_xrows.{name}: 16-byte alignment"
    assert K % 8 == 0, f"gemv_bf16_swiglu_xrows: K = {K} must be a multiple of 8"
    assert X.dtype == np.uint16 and X.ndim == 2 and X.shape[1] == K, (
        f"gemv_bf16_swiglu_xrows.X: {X.shape} {X.dtype}, expected [nx, {K}] bf16")
    nx = X.shape[0]
    assert 1 <= nx <= XROWS_MAX, f"gemv_bf16_swiglu_xrows: {nx} rows, expected 1..{XROWS_MAX}"
    assert X.strides[1] == 2 and X.strides[0] % 16 == 0 and X.data.ptr % 16 == 0, (
        f"gemv_bf16_swiglu_xrows.X: rows 16-byte aligned, last axis contiguous (strides {X.strides})")
    assert h.dtype == np.uint16 and h.shape == (nx, O) and h.strides[1] == 2, (
        f"gemv_bf16_swiglu_xrows.h: {h.shape} {h.dtype}, expected ({nx}, {O}) bf16, last axis contiguous")
    NX, P = next((a, p) for a, p in SWIGLU_XROWS_KERNELS if nx <= a)
    kernel(STEM, f"gemv_bf16_swiglu_x{NX}_p{P}")(
        _gemv_grid(-(-O // P)), (32 * GEMV_WARPS,),
        (w1, w3, X, i32(X.strides[0] // 2), i32(nx), h, i32(h.strides[0] // 2), i32(O), i32(K),
         np.float64(limit)))
    return h


QNORM_K = 1024   # decode.cu QN_K: the one row length gemv_bf16_pl_r*_qn takes


def gemv_bf16_qnorm(w, x_raw, out, norm_weight, eps: float, xn_out, *, scale=None,
                    site: str | None = None) -> str:
    """out = W . rmsnorm(x_raw, norm_weight, eps), and xn_out = rmsnorm(x_raw, ...) (bf16 bits);
    the bits of ``rmsnorm(x_raw, norm_weight, eps, out=xn_out)`` then ``gemv_bf16(w, xn_out, out)``
    in every form.  Fused (one launch, decode.cu gemv_bf16_pl_r{R}_qn: every CTA norms the row
    into its shared memory with rmsnorm_bf16_wbf16's row code, CTA 0 also writes xn_out) when the
    GEMV would run as pl_r{R} (the selected variant for ``site``), W is bf16 bits, K == 1024 and
    the norm weight is bf16 bits; else those two launches.  Returns "fused" or "split".
    x_raw and xn_out must not overlap (other CTAs read x_raw while CTA 0 writes xn_out)."""
    from memra_dsv4.gpu.ops import rmsnorm as RN
    O, K = w.shape
    check(x_raw, "gemv_bf16_qnorm.x", np.uint16)
    check(xn_out, "gemv_bf16_qnorm.xn_out", np.uint16)
    assert x_raw.size == K and xn_out.size == K, (
        f"gemv_bf16_qnorm: x {x_raw.size} / xn_out {xn_out.size} values, expected K = {K}")
    assert norm_weight.shape == (K,), f"gemv_bf16_qnorm.norm_weight: {norm_weight.shape}, expected ({K},)"
    a0, a1 = x_raw.data.ptr, xn_out.data.ptr
    assert a0 + 2 * K <= a1 or a1 + 2 * K <= a0, "gemv_bf16_qnorm: x and xn_out overlap"
    R = _selected_pl(bool(w.dtype == np.uint8), O, K, site)
    if R and K == QNORM_K and norm_weight.dtype == np.uint16 and scale is None:
        wa, _, _ = dense_weight(w, scale, "gemv_bf16_qnorm.w")
        check(norm_weight, "gemv_bf16_qnorm.norm_weight", np.uint16)
        _check_gemv_out(out, O, "gemv_bf16_qnorm.out")
        assert a0 % 16 == 0 and a1 % 16 == 0 and norm_weight.data.ptr % 16 == 0, \
            "gemv_bf16_qnorm: x, xn_out and norm_weight need 16-byte alignment"
        kernel(STEM, f"gemv_bf16_pl_r{R}_qn")(
            _gemv_grid(-(-O // R)), (32 * GEMV_WARPS,),
            (wa, x_raw, norm_weight, np.float64(eps), xn_out, out, i32(O), i32(K),
             i32(1 if out.dtype == np.uint16 else 0)))
        return "fused"
    RN.rmsnorm(x_raw.reshape(1, K), norm_weight, eps, out=xn_out.reshape(1, K))
    gemv_bf16(w, xn_out.reshape(-1), out, scale=scale, site=site)
    return "split"


def l2_prefetch_paced(ranges, *, ctas: int = 8, chunk: int = 65536, sleep_ns: int = 200) -> int:
    """Ask the L2 for the first ``nbytes`` of up to two weights (``ranges``: [(array, nbytes)],
    nbytes <= array.nbytes, multiples of 16, 16-byte aligned arrays) from ``ctas`` CTAs of one
    warp, ``chunk`` bytes per request and ``sleep_ns`` between a CTA's requests (decode.cu
    l2_prefetch_paced: about ctas * chunk / sleep_ns bytes per ns).  A hint: no value changes.
    Returns the bytes asked for."""
    assert 1 <= len(ranges) <= 2, f"l2_prefetch_paced: {len(ranges)} ranges, expected 1 or 2"
    assert ctas >= 1 and chunk >= 16 and chunk % 16 == 0 and 0 <= sleep_ns < 2 ** 32, (
        f"l2_prefetch_paced: ctas {ctas}, chunk {chunk}, sleep_ns {sleep_ns}")
    args = []
    for a, n in list(ranges) + [(None, 0)] * (2 - len(ranges)):
        if a is not None:
            assert 0 <= n <= a.nbytes and n % 16 == 0 and a.data.ptr % 16 == 0, (
                f"l2_prefetch_paced: {n} bytes of a {a.nbytes}-byte array at {a.data.ptr:#x}")
        args += [null_or(a), np.uint64(n)]
    total = int(args[1]) + int(args[3])
    if total:
        kernel(STEM, "l2_prefetch_paced")((int(ctas),), (32,),
                                          tuple(args) + (np.uint32(chunk), np.uint32(sleep_ns)))
    return total


def gemv_bf16_pair(w, w2, x, out, out2, *, scale=None, scale2=None, site: str | None = None) -> str:
    """out = W . x and out2 = W2 . x (bf16 bits x [K]; out / out2 f32 or bf16 bits), the bits of
    ``gemv_bf16(w, x, out, scale=scale)`` then ``gemv_bf16(w2, x, out2, scale=scale2)`` in every
    form (either weight may be the stored FP8 with its scale).  One launch
    (decode.cu gemv_bf16_pl2_r{R}) when the first GEMV would run as pl_r{R} (the variant selected
    for its shape and ``site``) and both weights are bf16 bits with the same K (K % 1024 == 0);
    else the two launches.  Returns "fused" or "split"."""
    O, K = w.shape
    O2, K2 = w2.shape
    check(x, "gemv_bf16_pair.x", np.uint16)
    assert K2 == K and x.size == K, f"gemv_bf16_pair: W [{O}x{K}], W2 [{O2}x{K2}], x {x.size} values"
    _check_gemv_out(out, O, "gemv_bf16_pair.out")
    _check_gemv_out(out2, O2, "gemv_bf16_pair.out2")
    R = _selected_pl(bool(w.dtype == np.uint8) or bool(w2.dtype == np.uint8), O, K, site)
    if R and scale is None and scale2 is None:
        wa, _, _ = dense_weight(w, None, "gemv_bf16_pair.w")
        wb, _, _ = dense_weight(w2, None, "gemv_bf16_pair.w2")
        assert x.data.ptr % 16 == 0, "gemv_bf16_pair.x: 16-byte alignment"
        kernel(STEM, f"gemv_bf16_pl2_r{R}")(
            _gemv_grid(-(-O // R) + -(-O2 // R)), (32 * GEMV_WARPS,),
            (wa, wb, x, out, out2, i32(O), i32(O2), i32(K), i32(1 if out.dtype == np.uint16 else 0),
             i32(1 if out2.dtype == np.uint16 else 0)))
        return "fused"
    gemv_bf16(w, x, out, scale=scale, site=site)
    gemv_bf16(w2, x, out2, scale=scale2)
    return "split"


class GemvTable:
    """Device table of projections that share one input x (decode.cu GemvSeg, 56 bytes each
    + a sentinel), built once at setup; the addresses are baked in, like a graph's.

    Entries: (w, out) with out f32 or bf16 bits of O_s values; or (w, pending, ape, ring_off,
    r): the compressor pending rows ``pending`` f32 [rows, O_s] get row (pos % r) + ring_off,
    plus ape [r, O_s] f32 when given (the score half), i.e. what pending_write + add_ape do, in
    the GEMV epilogue; ring_off < 0: ``pending`` is one staging row f32 [O_s] that gets those
    values (the device verify's: the row's emission places them, compressor.emit(incoming=)).  w is a bf16-bits array [O_s, K] or a (e4m3 bytes, e8m0 scale) pair.
    Each projection gets ceil(O_s / R) warps of R rows (field warp0: its first warp), so no warp
    straddles two projections; R (rows_per_warp) changes the speed only, never the bits.

    The row form (``rows`` = n, for gemv_bf16_multi_rows, the device verify's T rows): bf16
    weights only, R one of the x-rows kernels' (xrows_R), every output [n, O_s] C-contiguous
    (row j of the launch's rows at [j]); a pending entry's array is a STAGING buffer [n, O_s] f32
    that gets f32(dot + ape[pos[j] % r]) in row j (its ring_off is recorded as -1, the staging
    mark): the rows' emission launch places them (compressor.emit_rows / emit(incoming=)), in
    position order."""

    SEG = np.dtype([("w", "<u8"), ("y", "<u8"), ("ape", "<u8"), ("scale", "<u8"), ("row0", "<i4"),
                    ("out_bf16", "<i4"), ("ring_r", "<i4"), ("ring_off", "<i4"),
                    ("ld_scale", "<i4"), ("warp0", "<i4")])

    def __init__(self, entries, K: int, rows_per_warp: int | None = None, rows: int | None = None):
        import cupy as cp
        assert entries, "GemvTable: no projections"
        assert self.SEG.itemsize == 56
        # FP8 = some projection is stored e4m3 with its scale: a (weight, None) pair is bf16 (the
        # step's L.lin returns pairs for both forms)
        self.fp8 = any(isinstance(e[0], tuple) and e[0][1] is not None for e in entries)
        self.row_axis = None if rows is None else int(rows)
        if rows is not None:
            assert 1 <= int(rows) <= XROWS_MAX, f"GemvTable: rows = {rows}, expected 1..{XROWS_MAX}"
            assert not self.fp8, "GemvTable: the row form takes bf16 weights only (no FP8 x-rows kernel)"
            assert rows_per_warp in XROWS_R, (
                f"GemvTable: the row form's rows_per_warp {rows_per_warp} not in {XROWS_R}")
        self.cls = gemv_shape_class(sum(int((e[0][0] if isinstance(e[0], tuple) else e[0]).shape[0])
                                        for e in entries), K)
        if rows_per_warp is None and rows is None:   # the selected variant's R (a table serves one R)
            v = gemv_selected("multi", self.fp8, self.cls)
            rows_per_warp = 4 if v is None else parse_multi_variant(v)[1]
            if rows_per_warp not in MULTI_ROWS:
                rows_per_warp = 4
        assert rows is not None or rows_per_warp in MULTI_ROWS, (
            f"GemvTable: rows_per_warp {rows_per_warp} not in {MULTI_ROWS}")
        assert K % 8 == 0, f"GemvTable: K = {K} must be a multiple of 8"
        R = int(rows_per_warp)
        rec = np.zeros(len(entries) + 1, dtype=self.SEG)
        row = warp = 0
        self.keep = []
        self.bf16_outs: dict[int, int] = {}   # plain bf16 output address -> its row count
        for i, e in enumerate(entries):
            w, out = e[0], e[1]
            w, sc = w if isinstance(w, tuple) else (w, None)
            wa, sa, ld = dense_weight(w, sc, f"GemvTable.w[{i}]")
            sp = 0 if sc is None else sc.data.ptr
            O = w.shape[0]
            assert w.shape[1] == K, f"GemvTable.w[{i}]: shape {w.shape}, expected [*, {K}]"
            if rows is not None:   # the row form: [rows, O] outputs / staging rows
                want = np.float32 if len(e) > 2 else None
                assert out.dtype in ((want,) if want else (np.float32, np.uint16)) and \
                    tuple(out.shape) == (int(rows), O) and out.flags.c_contiguous, (
                        f"GemvTable.out[{i}]: {out.shape} {out.dtype}, the row form wants [{rows}, {O}] "
                        + ("f32" if want else "f32 / bf16") + " contiguous")
                ape, r = (e[2], int(e[4])) if len(e) > 2 else (None, 0)
                if ape is not None:
                    check(ape, f"GemvTable.ape[{i}]", np.float32, (r, O))
                    self.keep.append(ape)
                rec[i] = (w.data.ptr, out.data.ptr, 0 if ape is None else ape.data.ptr, sp, row,
                          int(out.dtype == np.uint16), r, -1 if r else 0, int(ld), warp)
            elif len(e) == 2:
                assert out.dtype in (np.float32, np.uint16) and out.size == O and \
                    out.flags.c_contiguous, f"GemvTable.out[{i}]: {out.shape} {out.dtype}, want {O}"
                rec[i] = (w.data.ptr, out.data.ptr, 0, sp, row, int(out.dtype == np.uint16), 0, 0,
                          int(ld), warp)
                if out.dtype == np.uint16:
                    self.bf16_outs[int(out.data.ptr)] = int(O)   # gemv_bf16_multi(qnorm=) targets
            else:
                ape, ring_off, r = e[2], int(e[3]), int(e[4])
                if ring_off < 0:   # a staging row (the device verify's): O values, f32
                    assert out.dtype == np.float32 and out.size == O and out.flags.c_contiguous, (
                        f"GemvTable.staging[{i}]: {out.shape} {out.dtype}, want {O} f32 contiguous")
                    ring_off = -1
                else:
                    check(out, f"GemvTable.pending[{i}]", np.float32, (None, O))
                    assert ring_off + r <= out.shape[0], (
                        f"GemvTable.pending[{i}]: rows {out.shape[0]} < offset {ring_off} + r {r}")
                if ape is not None:
                    check(ape, f"GemvTable.ape[{i}]", np.float32, (r, O))
                    self.keep.append(ape)
                rec[i] = (w.data.ptr, out.data.ptr, 0 if ape is None else ape.data.ptr, sp, row, 0,
                          r, ring_off, int(ld), warp)
            row += O
            warp += -(-O // R)
            self.keep += [w, out] + ([] if sc is None else [sc])
        rec[len(entries)]["row0"] = row
        rec[len(entries)]["warp0"] = warp
        self.rows, self.K, self.nseg, self.R, self.warps = row, int(K), len(entries), R, warp
        self.table = cp.asarray(rec.view(np.uint8))


def xrows_R(nx: int) -> int:
    """Rows per warp of the x-rows kernels (gemv_bf16_x*, gemv_bf16_multi_x*) for nx rows: the
    fewest rows per warp whose kernel takes nx (nx <= 2: 4, <= 4: 2, else 1)."""
    assert 1 <= int(nx) <= XROWS_MAX, f"xrows_R: {nx} rows, expected 1..{XROWS_MAX}"
    return next(r for a, r in XROWS_KERNELS if nx <= a)


def gemv_bf16_multi_rows(table: GemvTable, X, pos):
    """Every projection of a row-form ``table`` (GemvTable(rows=n)) for the nx <= n rows of X
    (bf16 bits [nx, K], rows 16-byte aligned, last axis contiguous) in one launch, each weight
    chunk read once (decode.cu gemv_bf16_multi_x{NX}_r{R}, R the table's: nx <= NX); pos int32
    [nx] (row j's position: the ring entries' ape slot).  Row j of each output (or staging row
    of a pending entry) is what gemv_bf16_multi(the one-row table, X[j], pos[j]) writes to that
    output (or to the pending row pos[j] % r + ring_off), bit for bit."""
    assert isinstance(table, GemvTable) and table.row_axis is not None, (
        "gemv_bf16_multi_rows: expected a row-form GemvTable (rows=)")
    assert X.dtype == np.uint16 and X.ndim == 2, f"gemv_bf16_multi_rows.X: {X.shape} {X.dtype}"
    nx = int(X.shape[0])
    assert 1 <= nx <= table.row_axis, f"gemv_bf16_multi_rows: {nx} rows, the table has {table.row_axis}"
    NX = next(a for a, r in XROWS_KERNELS if r == table.R)
    assert nx <= NX, f"gemv_bf16_multi_rows: {nx} rows, the table's R {table.R} serves <= {NX}"
    assert X.shape[1] == table.K, f"gemv_bf16_multi_rows.X: {X.shape[1]} values a row, the table's K is {table.K}"
    assert X.strides[1] == 2 and X.strides[0] % 16 == 0 and X.data.ptr % 16 == 0, (
        f"gemv_bf16_multi_rows.X: rows 16-byte aligned, last axis contiguous (strides {X.strides})")
    check(pos, "gemv_bf16_multi_rows.pos", np.int32, (nx,))
    kernel(STEM, f"gemv_bf16_multi_x{NX}_r{table.R}")(
        _gemv_grid(table.warps), (32 * GEMV_WARPS,),
        (table.table, i32(table.nseg), X, i32(X.strides[0] // 2), i32(nx), i32(table.K), pos))


_QN_COUNTERS: dict = {}   # device -> int32 [1] ticket counter of gemv_bf16_multi_*_qn (kept 0)


def qnorm_counter():
    """The current device's ticket counter of the gemv_bf16_multi_*_qn kernels (int32 [1], zero
    between launches; made before the first capture by DeviceStep._prewarm)."""
    return ticket_counter(_QN_COUNTERS, "ops_decode.qnorm_counter")


def _check_qnorm(table: GemvTable, qnorm) -> tuple:
    """qnorm = (y, weight, eps): y one of the table's plain bf16 outputs (uint16, contiguous),
    weight bf16 bits [y.size]; returns (y, weight, n, eps).  AssertionError naming the problem."""
    assert isinstance(qnorm, tuple) and len(qnorm) == 3, "gemv_bf16_multi.qnorm: expected (y, weight, eps)"
    y, w, eps = qnorm
    check(y, "gemv_bf16_multi.qnorm.y", np.uint16)
    n = int(y.size)
    assert table.bf16_outs.get(int(y.data.ptr)) == n, (
        f"gemv_bf16_multi.qnorm.y: not one of the table's bf16 outputs (address {y.data.ptr:#x}, "
        f"{n} values); the norm runs in the launch that writes it")
    assert n % 8 == 0, f"gemv_bf16_multi.qnorm: n = {n} must be a multiple of 8"
    assert y.data.ptr % 16 == 0, "gemv_bf16_multi.qnorm.y: 16-byte alignment (read as uint4)"
    check(w, "gemv_bf16_multi.qnorm.weight", np.uint16, (n,))
    return y, w, n, float(eps)


def gemv_bf16_multi(table: GemvTable, x, pos, *, variant: str | None = None, qnorm=None):
    """Every projection of ``table`` applied to x (bf16 bits [K]) in one launch; pos int32 [1]
    (read only by pending-row entries).  ``variant`` ('r{R}[t{T}]', 'bulk_r{R}s{S}',
    'pl_r{R}[t{T}]', 'default'; R must be the table's): the speed only, never the bits.
    ``qnorm`` = (y, weight, eps): then also y <- rmsnorm(y, weight, eps) in place (y one of the
    table's bf16 outputs, weight bf16 bits): the register kernels' _qn forms do it in their last
    CTA (rmsnorm_bf16_wbf16's row code, so the bits of gemv_bf16_multi then ops.rmsnorm.rmsnorm);
    a bulk variant launches the rmsnorm after it; a pl variant (no _qn form) runs as the register
    kernel of its R and T with the norm in its last CTA."""
    check(x, "gemv_bf16_multi.x", np.uint16)
    check(pos, "gemv_bf16_multi.pos", np.int32, (1,))
    assert x.size == table.K, f"gemv_bf16_multi.x: {x.size} values, the table's K is {table.K}"
    assert x.data.ptr % 16 == 0, "gemv_bf16_multi.x: 16-byte alignment"
    qn = _check_qnorm(table, qnorm) if qnorm is not None else None
    explicit = variant is not None
    if variant is None:
        variant = gemv_selected("multi", table.fp8, table.cls)
    T = 1
    pl = False
    if variant is not None and variant != "default":
        kind, R, S = parse_multi_variant(variant)
        bulk = kind == "bulk"
        ok = R == table.R and (any(r == R and st == S for r, st, _ in MULTI_BULK)
                               and _bulk_ok(table.K, table.fp8) if bulk
                               else (R, S) in (MULTI_PL if kind == "pl" else MULTI_VARIANTS))
        assert ok or not explicit, f"gemv_bf16_multi: variant {variant!r} not available (table R {table.R}, K {table.K})"
        if ok and bulk:
            minb = next(m for r, st, m in MULTI_BULK if r == R and st == S)
            _bulk_launch(f"gemv_bf16_multi_bulk_r{R}s{S}", table.warps, R, S, 2048, minb,
                         (table.table, i32(table.nseg), x, i32(table.K), pos))
            if qn is not None:   # no _qn form of the bulk kernels: the norm as its own launch
                from memra_dsv4.gpu.ops import rmsnorm as RN
                RN.rmsnorm(qn[0], qn[1], qn[3], out=qn[0])
            return
        if ok:
            T = S   # the register kernel's bf16 trips (FP8 rows keep the kernel's own depth)
            pl = kind == "pl" and qn is None
    name = f"gemv_bf16_multi_{'pl_' if pl else ''}r{table.R}" + (f"t{T}" if T > 1 else "")
    args = (table.table, i32(table.nseg), x, i32(table.K), pos)
    if qn is not None:
        y, w, n, eps = qn
        name += "_qn"
        args += (y, w, i32(n), np.float64(eps), qnorm_counter())
    kernel(STEM, name)(_gemv_grid(table.warps), (32 * GEMV_WARPS,), args)


def gemv_bf16_swiglu(w1, w3, x, h, limit: float, *, scale1=None, scale3=None,
                     outs_per_warp: int | None = None, variant: str | None = None):
    """h [O] bf16 = swiglu_clamped(bf16(W1 x), bf16(W3 x), limit) (no routing weight); W1, W3
    both bf16 bits or both stored FP8 with their scales.  outs_per_warp P (2P rows per warp,
    default 2) and ``variant`` ('p{P}', 'bulk_p{P}s{S}', 'default') change the speed only, never
    the bits."""
    O, K = w1.shape
    a1, s1, ld = dense_weight(w1, scale1, "gemv_bf16_swiglu.w1")
    a3, s3, ld3 = dense_weight(w3, scale3, "gemv_bf16_swiglu.w3")
    assert w3.shape == (O, K) and w3.dtype == w1.dtype and ld == ld3, "gemv_bf16_swiglu: w1 != w3"
    check(x, "gemv_bf16_swiglu.x", np.uint16)
    check(h, "gemv_bf16_swiglu.h", np.uint16)
    assert x.size == K and h.size == O and K % 8 == 0, f"gemv_bf16_swiglu: x {x.size}, h {h.size}"
    fp8 = bool(w1.dtype == np.uint8)
    explicit = variant is not None
    T = 1
    if variant is None and outs_per_warp is None:
        variant = gemv_selected("swiglu", fp8, gemv_shape_class(2 * O, K))
    if variant is not None and variant != "default":
        bulk, P, S = _parse_variant(variant, "p")
        ok = (any(p == P and st == S for p, st, _ in SWIGLU_BULK) and _bulk_ok(K, fp8)) if bulk \
            else (P, S) in SWIGLU_VARIANTS
        assert ok or not explicit, f"gemv_bf16_swiglu: variant {variant!r} not available (K {K})"
        if ok and bulk:
            minb = next(m for p, st, m in SWIGLU_BULK if p == P and st == S)
            _bulk_launch(f"gemv_bf16_swiglu_bulk_p{P}s{S}", -(-O // P), 2 * P, S, 2048, minb,
                         (a1, s1, a3, s3, ld, x, h, i32(O), i32(K), np.float64(limit)))
            return
        if ok:
            outs_per_warp, T = P, S
    if outs_per_warp is None:
        outs_per_warp = 2
    assert outs_per_warp in SWIGLU_OUTS, f"gemv_bf16_swiglu: outs_per_warp {outs_per_warp} not in {SWIGLU_OUTS}"
    P = int(outs_per_warp)
    kernel(STEM, f"gemv_bf16_swiglu_p{P}" + (f"t{T}" if T > 1 else ""))(
        _gemv_grid(-(-O // P)), (32 * GEMV_WARPS,),
        (a1, s1, a3, s3, ld, x, h, i32(O), i32(K), np.float64(limit)))


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


def greedy_argmax(logits, tok, pos=None, hist=None):
    """tok[0] = np.argmax(logits) on the device (decode.cu greedy_argmax_f32; NumPy twin
    memra_dsv4.host.sampling.greedy_token): the first index of the maximum, a NaN counting as
    the greatest value.  logits f32 [n] (n >= 1, contiguous), tok int32 [1].  With ``pos`` (int32
    [1]): then hist[pos + 1] = tok[0] (``hist`` int32 [L], entries past L - 1 not written; None:
    no history) and pos[0] += 1 (the device-fed greedy step's advance).  One CTA."""
    check(logits, "greedy_argmax.logits", np.float32)
    check(tok, "greedy_argmax.tok", np.int32, (1,))
    n = logits.size
    assert 1 <= n < 2 ** 31 - 1, f"greedy_argmax: {n} logits (need 1 .. 2^31 - 2)"
    assert hist is None or pos is not None, "greedy_argmax: hist needs pos"
    if pos is not None:
        check(pos, "greedy_argmax.pos", np.int32, (1,))
    if hist is not None:
        check(hist, "greedy_argmax.hist", np.int32)
        assert hist.ndim == 1 and 1 <= hist.size < 2 ** 31, f"greedy_argmax: hist shape {hist.shape}"
    kernel(STEM, "greedy_argmax_f32")((1,), (1024,), (logits, i32(n), tok, null_or(pos),
                                                      null_or(hist), i32(0 if hist is None else hist.size)))
    return tok


COPY_PAIRS_MAX = 4   # decode.cu copy_vec4_x4's ranges per launch


def copy_words_ok(dst, src) -> bool:
    """Whether copy_words takes the pair (dst, src): same byte size, both C-contiguous, 16-byte
    aligned, a multiple of 16 bytes (copy_vec4_x4 moves uint4 words)."""
    return (dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous
            and dst.data.ptr % 16 == 0 and src.data.ptr % 16 == 0 and src.nbytes % 16 == 0)


def copy_words(pairs) -> None:
    """dst[...] = src for up to COPY_PAIRS_MAX (dst, src) pairs of device arrays, one launch
    (decode.cu copy_vec4_x4: bit-identical to a device-to-device memcpy; NumPy twin: the
    assignment).  Each pair: same byte size, both C-contiguous, on the current device, 16-byte
    aligned with a size that is a multiple of 16 bytes (the kernel moves uint4 words).  Why a
    kernel, not memcpy: inside a PDL graph a memcpy node ends the programmatic chain and costs a
    node of its own (the device verify's journal takes up to four copies per row and layer)."""
    pairs = list(pairs)
    assert 1 <= len(pairs) <= COPY_PAIRS_MAX, f"copy_words: {len(pairs)} pairs, expected 1..{COPY_PAIRS_MAX}"
    args, total = [], 0
    for i, (dst, src) in enumerate(pairs):
        assert dst.nbytes == src.nbytes, f"copy_words pair {i}: dst {dst.shape} {dst.dtype} ({dst.nbytes} B) <- src {src.shape} {src.dtype} ({src.nbytes} B)"
        assert dst.flags.c_contiguous and src.flags.c_contiguous, f"copy_words pair {i}: not C-contiguous"
        for name, a in (("dst", dst), ("src", src)):
            assert a.data.ptr % 16 == 0, f"copy_words pair {i}: {name} address {a.data.ptr:#x} is not 16-byte aligned"
        assert src.nbytes % 16 == 0, f"copy_words pair {i}: {src.nbytes} B is not a multiple of 16"
        n = src.nbytes // 16
        args += [src, dst, np.int64(n)]
        total += n
    for _ in range(len(pairs), COPY_PAIRS_MAX):
        args += [null_or(None), null_or(None), np.int64(0)]
    if total == 0:
        return
    # at most 4 words per thread at this grid (an H200 runs 132 x 8 CTAs of 256 at once)
    blocks = max(1, min(-(-total // (256 * 4)), 1024))
    kernel(STEM, "copy_vec4_x4")((blocks,), (256,), tuple(args))


class RollbackTable:
    """Device table of a stage's layers for verify_rollback (decode.cu RbLayer, 144 bytes each),
    built once per state: per layer its ring and ring_copy [W, hd] bf16 bits, and where the layer
    has them its compressor's pending rows (kv, score f32 [P, C]), their journal buffers (jkv,
    jsc f32 [P + rows_max + 1, C]: the pre-verify rows, the staging rows, a fresh row) and the
    compressed rows [n_comp, hd], and the same for the indexer's (keys [n_idx, dI]).  The
    addresses are baked in (graphs are not involved: one eager launch per commit).  ``sources``
    (int32, device) holds one gather list per distinct ratio (gpu.hostmath.pending_sources),
    rewritten by ``upload_sources`` before each commit (host and device forms read it)."""

    SEG = np.dtype([("ring", "<u8"), ("ring_copy", "<u8"), ("comp_kv", "<u8"), ("comp_score", "<u8"),
                    ("comp_jkv", "<u8"), ("comp_jsc", "<u8"), ("comp", "<u8"), ("idx_kv", "<u8"),
                    ("idx_score", "<u8"), ("idx_jkv", "<u8"), ("idx_jsc", "<u8"), ("idx_keys", "<u8"),
                    ("W", "<i4"), ("hd", "<i4"), ("ratio", "<i4"), ("comp_P", "<i4"), ("comp_C", "<i4"),
                    ("n_comp", "<i4"), ("comp_src", "<i4"), ("dI", "<i4"), ("idx_P", "<i4"),
                    ("idx_C", "<i4"), ("n_idx", "<i4"), ("idx_src", "<i4")])

    def __init__(self, layers, rows_max: int):
        """layers: dicts with ring, ring_copy and optionally (comp_kv, comp_score, comp_jkv,
        comp_jsc, comp, ratio) and (idx_kv, idx_score, idx_jkv, idx_jsc, idx_keys) device arrays;
        rows_max: the journal buffers' staging rows (the verify's most rows)."""
        import cupy as cp
        import cupyx
        assert self.SEG.itemsize == 144
        assert layers, "RollbackTable: no layers"
        self.rows_max = int(rows_max)
        rec = np.zeros(len(layers), dtype=self.SEG)
        self.keep = []
        ratios = sorted({int(L["ratio"]) for L in layers if L.get("ratio")}
                        | ({4} if any(L.get("idx_keys") is not None for L in layers) else set()))
        self.src_off, off = {}, 0   # ratio -> its gather list's offset in sources
        for r in ratios:
            self.src_off[r] = off
            off += 2 * r if r == 4 else r
        for i, L in enumerate(layers):
            ring, rc = L["ring"], L["ring_copy"]
            check(ring, f"RollbackTable[{i}].ring", np.uint16)
            check(rc, f"RollbackTable[{i}].ring_copy", np.uint16, ring.shape)
            W, hd = ring.shape
            rec[i]["ring"], rec[i]["ring_copy"], rec[i]["W"], rec[i]["hd"] = ring.data.ptr, rc.data.ptr, W, hd
            self.keep += [ring, rc]
            if L.get("ratio"):
                self._compressor(rec[i], i, "comp", L, "comp", "n_comp", int(L["ratio"]), hd)
                rec[i]["ratio"] = int(L["ratio"])
            if L.get("idx_keys") is not None:
                self._compressor(rec[i], i, "idx", L, "idx_keys", "n_idx", 4, None)
                rec[i]["dI"] = L["idx_keys"].shape[1]
        self.n = len(layers)
        self.window = int(layers[0]["ring"].shape[0])
        self.dev = cp.asarray(rec.view(np.uint8))
        self.sources = cp.asarray(np.zeros(max(off, 1), np.int32))
        self._sources_host = cupyx.zeros_pinned(max(off, 1), np.int32)

    def _compressor(self, r, i: int, pre: str, L, rows_key: str, n_field: str, ratio: int, width) -> None:
        """One compressor's fields of record r (prefix ``pre``: "comp" / "idx"): its pending rows
        {pre}_kv / {pre}_score f32 [P, C], their journal buffers {pre}_jkv / {pre}_jsc f32
        [P + rows_max + 1, C], the rows it emits (L[rows_key]: bf16 bits [n, width], width None:
        any), their count (n_field) and its gather list's offset."""
        kv, sc, jkv, jsc, rows = L[f"{pre}_kv"], L[f"{pre}_score"], L[f"{pre}_jkv"], L[f"{pre}_jsc"], L[rows_key]
        check(kv, f"RollbackTable[{i}].{pre}_kv", np.float32)
        P = 2 * ratio if ratio == 4 else ratio
        assert kv.ndim == 2 and kv.shape[0] == P, f"RollbackTable[{i}].{pre}_kv: {kv.shape}, expected [{P}, C] (ratio {ratio})"
        C = kv.shape[1]
        check(sc, f"RollbackTable[{i}].{pre}_score", np.float32, kv.shape)
        check(jkv, f"RollbackTable[{i}].{pre}_jkv", np.float32, (P + self.rows_max + 1, C))
        check(jsc, f"RollbackTable[{i}].{pre}_jsc", np.float32, jkv.shape)
        check(rows, f"RollbackTable[{i}].{rows_key}", np.uint16, (None, width))
        for f, a in (("kv", kv), ("score", sc), ("jkv", jkv), ("jsc", jsc)):
            r[f"{pre}_{f}"] = a.data.ptr
        r[rows_key], r[f"{pre}_P"], r[f"{pre}_C"], r[n_field] = rows.data.ptr, P, C, rows.shape[0]
        r[f"{pre}_src"] = self.src_off[ratio]
        self.keep += [kv, sc, jkv, jsc, rows]

    def upload_sources(self, p0: int, n: int, stream) -> None:
        """Write the gather lists of commit(n) after a verify at p0 (rows 0..n kept: for each
        ratio gpu.hostmath.pending_sources(p0, n + 1, ratio, rows_max)) into ``sources``, an
        asynchronous copy on ``stream`` from a pinned buffer.  Sync point: the caller
        synchronises ``stream`` before the next upload (VerifyStep.commit does), so the pinned
        buffer is not rewritten while its copy is in flight."""
        import cupy as cp
        from memra_dsv4.gpu.hostmath import pending_sources
        for r, off in self.src_off.items():
            src = pending_sources(p0, n + 1, r, self.rows_max)
            self._sources_host[off:off + src.size] = src
        cp.cuda.runtime.memcpyAsync(self.sources.data.ptr, self._sources_host.ctypes.data,
                                    self.sources.nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def source_rows(self, ratio: int):
        """The device gather list of ``ratio`` (a view of ``sources``)."""
        off = self.src_off[int(ratio)]
        return self.sources[off:off + (2 * ratio if ratio == 4 else ratio)]


def verify_rollback(table: RollbackTable, p0: int, k: int, n: int) -> None:
    """The device verify's commit(n) on every layer of ``table`` in one launch (decode.cu
    verify_rollback: ring slots of positions p0 + n + 1 .. p0 + k from ring_copy, the pending
    rows gathered from the journal buffers by ``table.sources``, which the caller has uploaded
    for (p0, n) (RollbackTable.upload_sources), rolled-back compressed rows / indexer keys
    zeroed).  0 <= n <= k, k + 1 <= the window and the journal's staging rows."""
    p0, k, n = int(p0), int(k), int(n)
    assert 0 <= n <= k and p0 >= 0, f"verify_rollback: p0 {p0}, k {k}, n {n}"
    assert k + 1 <= table.window and k + 1 <= table.rows_max, (
        f"verify_rollback: k {k} + 1 rows past the window {table.window} or the journal's "
        f"{table.rows_max} staging rows")
    kernel(STEM, "verify_rollback")((8, table.n), (256,), (table.dev, table.sources, i32(p0), i32(k), i32(n)))


def ring_write(pos, src, ring):
    check(src, "ring_write.src", np.uint16)
    check(ring, "ring_write.ring", np.uint16)
    W, d = ring.shape
    assert src.size == d, f"ring_write: src has {src.size} values, ring rows {d}"
    kernel(STEM, "ring_write")((_blocks(d),), (256,), (pos, src, ring, i32(W), i32(d)))


def pending_write(pos, a, z, kv, score, ratio: int, overlap: bool):
    check(kv, "pending_write.kv", np.float32)
    check(score, "pending_write.score", np.float32, kv.shape)
    C = kv.shape[1]
    assert kv.shape[0] == (2 if overlap else 1) * ratio, (
        f"pending_write: {kv.shape[0]} pending rows, expected {(2 if overlap else 1) * ratio} "
        f"(ratio {ratio}, overlap {overlap}): the kernel would write outside them")
    check(a, "pending_write.a", np.float32)
    check(z, "pending_write.z", np.float32)
    assert a.size == C and z.size == C, f"pending_write: a {a.size}, z {z.size}, rows {C}"
    kernel(STEM, "pending_write")((_blocks(C),), (256,),
                                  (pos, a, z, kv, score, i32(ratio), i32(int(overlap)), i32(C)))


def entry_commit(pos, src, dst, ratio: int):
    check(src, "entry_commit.src", np.uint16)
    check(dst, "entry_commit.dst", np.uint16)
    n, d = dst.shape
    assert src.size == d, f"entry_commit: src has {src.size} values, rows of dst {d}"
    kernel(STEM, "entry_commit")((_blocks(d),), (256,), (pos, src, dst, i32(ratio), i32(d), i32(n)))


def pending_advance(pos, kv, score, ratio: int, overlap: bool):
    check(kv, "pending_advance.kv", np.float32)
    check(score, "pending_advance.score", np.float32, kv.shape)
    C = kv.shape[1]
    assert kv.shape[0] == (2 if overlap else 1) * ratio, (
        f"pending_advance: {kv.shape[0]} pending rows, expected {(2 if overlap else 1) * ratio} "
        f"(ratio {ratio}, overlap {overlap}): the kernel would write outside them")
    kernel(STEM, "pending_advance")((_blocks(ratio * C),), (256,),
                                    (pos, kv, score, i32(ratio), i32(int(overlap)), i32(C)))


def build_cand(pos, cand, window: int, ratio: int, sel=None, shadow_row: int = 0):
    """cand int32 [K] (see the .cu header); sel int32 [sel_w] ascending entry ids (CSA).
    Multi-row (the device verify): cand [T, K], sel [T, sel_w], pos int32 [>= T] (row t at
    pos[t] = pos[0] + t), one launch (grid.y = T); shadow_row > 0: window slots a later row
    replaced are read from kv rows shadow_row + slot (LayerCache.ring_copy; see the .cu
    header).  T = 1 with shadow_row 0 is the step's launch."""
    check(cand, "build_cand.cand", np.int32)
    T = 1 if cand.ndim == 1 else cand.shape[0]
    assert cand.ndim in (1, 2) and 1 <= T <= 65535, f"build_cand.cand: {cand.shape}, expected [K] or [T, K]"
    K = cand.size // T
    check(pos, "build_cand.pos", np.int32)
    assert pos.size >= T, f"build_cand.pos: {pos.size} positions for {T} rows"
    assert int(shadow_row) >= 0, f"build_cand: shadow_row {shadow_row}"
    sel_w = 0
    if sel is not None:
        check(sel, "build_cand.sel", np.int32)
        assert sel.size % T == 0 and (T == 1 or (sel.ndim == 2 and sel.shape[0] == T)), (
            f"build_cand.sel: {sel.shape} for {T} rows")
        sel_w = sel.size // T
    kernel(STEM, "build_cand")((_blocks(K), T), (256,),
                               (pos, i32(window), i32(ratio), null_or(sel), i32(sel_w), cand, i32(K),
                                i32(shadow_row)))
