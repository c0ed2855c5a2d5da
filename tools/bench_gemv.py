"""Achieved bandwidth of the decode GEMVs at Flash shapes, one GPU.

    python tools/bench_gemv.py [--device 0] [--reps 20] [--dense-only] [--rows-sweep]
                               [--only-fp4] [--fp4-variants] [--fp4-mma]

Each kernel is timed alone as a CUDA graph of --reps copies, each copy followed by a 256 MB
memset that evicts L2 (the memset graph alone is timed and subtracted), so the weights come
from HBM as in a decode step.  Prints µs per call and the weight bytes / time as a fraction of
the device-to-device copy bandwidth measured in the same run.  --dense-only skips the LM head
and the routed-expert FP4 rows; --rows-sweep adds a row per rows-per-warp variant of the dense
GEMVs (R of gemv_bf16 / gemv_fp8, of the multi-projection table, P of the shared SwiGLU), which
return the same bits and differ in speed only.
--only-fp4 times only the routed-expert FP4 rows.

--variants times, after each dense GEMV's default row, every variant of ops_decode
(gemv_variant_names: the register kernels with more trips in flight and the TMA bulk streaming
kernels) on the same inputs, and first checks each one's output bytes against the default's
(a "MISMATCH" line and exit status 1 if any differ; "n/a" where a variant cannot take the shape).
For the lead, on a fresh box (< 60 s):
    python3 tools/bench_gemv.py --dense-only --variants --reps 10

--fp4-variants also times the two fused FP4 expert kernels built with other values of the
tuning macros of kernels_cu/experts.cu (ops.experts.variant_kernels; same arithmetic, same
bits): FP4_ALU_ODD=0 is the table-only e2m1 decode of the previous kernels and FP4_DN_DEPTH=2
down_combine's previous prefetch depth (now 4), for an old/new comparison in one run;
FP4_ALU_EVEN=1 decodes every e2m1 weight on the ALU (no table LDS: the shared-memory pipe that
limited the table kernels carries only x); the default build is FP4_PRMT=1, the same all-ALU
decode with fewer instructions per weight (byte-gathered f16 high bytes, one PRMT / mask per
f16x2), and FP4_PRMT=0 the default before that (even elements through the table), for old / new:
    python3 tools/bench_gemv.py --only-fp4 --fp4-variants --fp4-variant FP4_PRMT
The default build also has FP4_XRED=1 (transposed warp sums of a row group, the epilogue once per
lane), FP4_E8M0_FMA=1 (MXFP4 scale as fma(s, 0, s) of b << 23) and FP4_E4M3_CVT=1 (NVFP4 scales
by the hardware e4m3x2 conversion), all bit-identical; "prev3" is the build with the three off
(the previous default), and one row each turns one off:
    python3 tools/bench_gemv.py --only-fp4 --fp4-variants --fp4-variant prev3 --reps 20
    python3 tools/bench_gemv.py --only-fp4 --fp4-variants --fp4-variant FP4_XRED=0 \
        --fp4-variant FP4_E8M0_FMA=0 --fp4-variant FP4_E4M3_CVT=0 --reps 20
(a label matches if it contains one of the --fp4-variant strings: prev3's contains all three)
The default rows launch the full-shape fast kernels (gemv_*_gateup_k4_f, gemv_*_down_combine_k2_f:
the Flash shapes qualify, ops.experts.gateup_full / down_full); the row labelled "general" is the
same build with ops.experts.full_path(False) (the general _k4 / _k2 kernels), for fast / general
in one run:
    python3 tools/bench_gemv.py --only-fp4 --fp4-variants --fp4-variant general --reps 20
Each variant's output bytes are first checked
against the default build's on the same inputs (a "MISMATCH" line and exit status 1 if any
differ: do not select that build).

--fp4-mma adds the tensor-core kernels of the two fused FP4 expert GEMVs (ops.experts impl="mma",
gemv_*_mma in experts.cu) right after the CUDA-core rows, same inputs, and the same kernels built
with FP4_MMA_PLACE=1 (bit-placement e2m1 decode; only meaningful if test_mma_place_decode_variant
passes) and FP4_MMA_DEPTH=4 (ring depth; needs FP4_MMA_MINB=1, i.e. > 80 registers, fewer CTAs per
SM): an A/B of "simt" vs "mma" in one run.
    python tools/bench_gemv.py --only-fp4 --fp4-mma

--fp4-cost (with --fp4-mma) adds builds with experts.cu's FP4_DIAG_DECODE (timing only, WRONG
values, so no bytes check): the CUDA-core and the mma (PLACE + PRMT) kernels with the operation
count of a decode on load-time bit-permuted words (1) and without the gathers (2), to size what a
cheaper e2m1 decode is worth before building one; and the down + combine built with
FP4_DIAG_DOWN (its h staging skipped, its weight-table loads not behind the expert ids, both):
    python tools/bench_gemv.py --only-fp4 --fp4-mma --fp4-cost
"""
from __future__ import annotations

import argparse

import numpy as np


def fp4_experts(rng, EX):
    """The decode step's routed-expert MXFP4 kernels at the Flash shapes, ready to call: six of 256
    stacked experts (w1 / w3 [2048, 4096], w2 [4096, 2048], random bytes, scale 2^-7), k = 6 fixed
    ids, one token.  rng: a cupy.random Generator (its draws, in this order: the packed weights,
    x, the shared expert's output, the shared w2 and its input).  Returns a namespace of
    gateup(impl=None), down(impl=None) (shared expert's output added), down_w2() (the shared w2
    rows fused in: the step's form, MEMRA_DSV4_DECODE_SHARED_W2 = fused) and their weight bytes.
    Used by this tool and tools/fp4_mma_probe.py."""
    import types

    import cupy as cp

    def bf16(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    E, I, D, k = 256, 2048, 4096, 6
    packed = {m: rng.integers(0, 255, (E, *sh), dtype=cp.uint8) for m, sh in
              (("w1", (I, D // 2)), ("w3", (I, D // 2)), ("w2", (D, I // 2)))}
    scale = {m: cp.full((E, p.shape[1], p.shape[2] * 2 // 32), 120, cp.uint8)
             for m, p in packed.items()}
    wp = {m: EX.stacked_pointer_table(p) for m, p in packed.items()}
    sp = {m: EX.stacked_pointer_table(s) for m, s in scale.items()}
    ids = cp.asarray(np.array([3, 77, 12, 200, 150, 9], np.int32))
    wts = cp.full(k, 0.5, cp.float32)
    xe, h = bf16(1, D), cp.empty((k, I), cp.uint16)
    sh, out = bf16(1, D), cp.empty((1, D), cp.uint16)
    w2_sh, shx = bf16(D, EX.DOWN_W2_K), bf16(1, EX.DOWN_W2_K)
    fp4 = lambda o, i: o * i // 2 + o * i // 32

    def gateup(impl=None):
        return EX.gemv_fp4_gateup("mxfp4", xe, ids, wp["w1"], sp["w1"], wp["w3"], sp["w3"], I, D, weight=wts,
                                  limit=10.0, out=h, x_div=k, impl=impl)

    def down(impl=None):
        return EX.gemv_fp4_down_combine("mxfp4", h, ids.reshape(1, k), wp["w2"], sp["w2"], D, I, shared=sh,
                                        out=out, impl=impl)

    def down_w2():
        return EX.gemv_fp4_down_combine("mxfp4", h, ids.reshape(1, k), wp["w2"], sp["w2"], D, I,
                                        shared_w2=(w2_sh, shx), out=out)

    return types.SimpleNamespace(gateup=gateup, down=down, down_w2=down_w2, gateup_bytes=k * 2 * fp4(I, D),
                                 down_bytes=k * fp4(D, I), down_w2_bytes=k * fp4(D, I) + 2 * D * EX.DOWN_W2_K)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dense-only", action="store_true", help="skip the head and the FP4 experts")
    ap.add_argument("--rows-sweep", action="store_true", help="time every rows-per-warp variant")
    ap.add_argument("--only-fp4", action="store_true", help="time only the FP4 expert kernels")
    ap.add_argument("--fp4-variants", action="store_true",
                    help="also time the FP4 expert kernels under other experts.cu tuning macros")
    ap.add_argument("--fp4-variant", action="append", default=None, metavar="LABEL",
                    help="with --fp4-variants / --fp4-mma / --fp4-cost: time only the variant builds whose "
                         "label contains LABEL (repeatable), e.g. FP4_ALU_EVEN (each build is one "
                         "NVRTC compile)")
    ap.add_argument("--fp4-mma", action="store_true",
                    help="also time the tensor-core FP4 expert kernels (impl='mma') and their variants")
    ap.add_argument("--fp4-cost", action="store_true",
                    help="with --fp4-mma: also time FP4_DIAG_DECODE builds (WRONG values, timing "
                         "only) that size a cheaper e2m1 decode for the CUDA-core and mma kernels")
    ap.add_argument("--suggest", metavar="FILE", default=None,
                    help="with --variants --dense-only: write the fastest bit-identical variant per "
                         "(op, form, class) as a MEMRA_DSV4_GEMV_VARIANT value to FILE")
    ap.add_argument("--variants", action="store_true",
                    help="also time (and bit-check against the default) every dense GEMV variant")
    a = ap.parse_args(argv)
    import cupy as cp
    from bench.harness import measure_copy_bandwidth
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX

    cp.cuda.Device(a.device).use()
    bw = measure_copy_bandwidth(a.device)["copy_bw_Bps"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rng = cp.random.default_rng(0)

    def bf16(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    def fp8(O, K):
        """(e4m3 bytes, e8m0 scales): finite codes, scale 2^-7."""
        return (rng.integers(0, 0x7E, (O, K), dtype=cp.uint8),
                cp.full((-(-O // 128), -(-K // 128)), 120, cp.uint8))

    def variants(default, allowed):
        return ([None] + [r for r in allowed if r != default]) if a.rows_sweep else [None]

    def tag(r, default, letter="R"):
        return f" {letter}={default if r is None else r}"

    def rt(v, fp8, K):
        """(label, kwargs) of a gemv_bf16 variant (None: the default)."""
        R, T = DK.gemv_default_variant(fp8, K) if v is None else v
        return f" R={R} T={T}" + (" (default)" if v is None else ""), \
            {} if v is None else dict(rows_per_warp=R, trips=T)

    cases = []
    mismatches = []
    meta = {}   # case name -> (op, form, cls, shape label, variant): for --suggest

    def add_variants(op, fp8, label, nbytes, call, outs):
        """call(variant) runs the op into outs (a list of arrays); each variant's bytes must
        equal the default's."""
        if not a.variants:
            return
        form = "fp8" if fp8 else "bf16"
        cls = ("large" if nbytes // (1 if fp8 else 2) > (1 << 23) else "small") if op == "plain" else "any"
        cases.append((f"{label} [default]", nbytes, lambda: call("default")))
        meta[f"{label} [default]"] = (op, form, cls, label, "default")
        call("default")
        ref = [cp.asnumpy(o).tobytes() for o in outs]
        for vn in DK.gemv_variant_names(op, fp8)[1:]:
            for o in outs:
                o.view(cp.uint8).fill(0xA5)
            try:
                call(vn)
            except AssertionError as e:
                print(f"{label} [{vn}]: n/a ({e})")
                continue
            cp.cuda.Device().synchronize()
            got = [cp.asnumpy(o).tobytes() for o in outs]
            if got != ref:
                mismatches.append(f"{label} [{vn}]")
                print(f"!!! MISMATCH: {label} [{vn}] differs from the default's bytes !!!")
            cases.append((f"{label} [{vn}]", nbytes, lambda vn=vn: call(vn)))
            if got == ref:
                meta[f"{label} [{vn}]"] = (op, form, cls, label, vn)

    if not a.only_fp4:
        dense = [("wq_a", 1024, 4096, 1), ("wkv", 512, 4096, 1), ("wq_b", 32768, 1024, 1),
                 ("wo_a", 8192, 4096, 8), ("wo_b", 4096, 8192, 1), ("shared_w1", 2048, 4096, 1),
                 ("shared_w2", 4096, 2048, 1), ("idx_wq_b", 4096, 1024, 1)]
        if not a.dense_only:
            dense.append(("head", 129280, 4096, 1))
        for name, O, K, groups in dense:
            w, x, y = bf16(O, K), bf16(groups * K), cp.empty(O, cp.uint16)
            for v in variants(DK.gemv_default_variant(False, K), DK.GEMV_VARIANTS[False]):
                label, kw = rt(v, False, K)
                cases.append((f"gemv_bf16 {name} [{O}x{K}]{label}", 2 * O * K,
                              lambda w=w, x=x, y=y, g=groups, kw=kw: DK.gemv_bf16(w, x, y, groups=g, **kw)))
            add_variants("plain", False, f"gemv_bf16 {name} [{O}x{K}]", 2 * O * K,
                         lambda vn, w=w, x=x, y=y, g=groups: DK.gemv_bf16(w, x, y, groups=g, variant=vn), [y])
        for name, O, K, groups in [("wq_a fp8", 1024, 4096, 1), ("wq_b fp8", 32768, 1024, 1),
                                   ("wo_a fp8", 8192, 4096, 8), ("wo_b fp8", 4096, 8192, 1),
                                   ("shared_w2 fp8", 4096, 2048, 1), ("idx_wq_b fp8", 4096, 1024, 1)]:
            w, sc = fp8(O, K)
            x, y = bf16(groups * K), cp.empty(O, cp.uint16)
            for v in variants(DK.gemv_default_variant(True, K), DK.GEMV_VARIANTS[True]):
                label, kw = rt(v, True, K)
                cases.append((f"gemv_fp8 {name} [{O}x{K}]{label}", O * K,
                              lambda w=w, sc=sc, x=x, y=y, g=groups, kw=kw:
                              DK.gemv_bf16(w, x, y, groups=g, scale=sc, **kw)))
            add_variants("plain", True, f"gemv_fp8 {name} [{O}x{K}]", O * K,
                         lambda vn, w=w, sc=sc, x=x, y=y, g=groups:
                         DK.gemv_bf16(w, x, y, groups=g, scale=sc, variant=vn), [y])
        # the attention-side group of [*, 4096] projections of xn in one launch
        shapes = [(1024, 0), (512, 0), (1024, 1), (1024, 1), (256, 1), (256, 1), (64, 0)]
        xm, pos = bf16(4096), cp.zeros(1, cp.int32)
        for form in ("bf16", "fp8"):
            segs = [(bf16(o, 4096) if form == "bf16" else fp8(o, 4096),
                     cp.empty(o, cp.float32 if f else cp.uint16)) for o, f in shapes]
            for r in variants(4, DK.MULTI_ROWS):
                tab = DK.GemvTable(segs, 4096, rows_per_warp=4 if r is None else r)
                cases.append((f"gemv_bf16_multi {form} attn group [4160x4096]{tag(r, 4)}",
                              (2 if form == "bf16" else 1) * tab.rows * 4096,
                              lambda tab=tab: DK.gemv_bf16_multi(tab, xm, pos)))
            if a.variants:
                tabs = {R: DK.GemvTable(segs, 4096, rows_per_warp=R) for R in DK.MULTI_ROWS}

                def call_multi(vn, tabs=tabs):
                    R = 4 if vn == "default" else DK._parse_variant(vn, "r")[1]
                    DK.gemv_bf16_multi(tabs[R], xm, pos, variant=vn)
                add_variants("multi", form == "fp8", f"gemv_bf16_multi {form} attn group [4160x4096]",
                             (2 if form == "bf16" else 1) * tabs[4].rows * 4096, call_multi,
                             [o for _, o in segs])
        xs, hs = bf16(4096), cp.empty(2048, cp.uint16)
        for form in ("bf16", "fp8"):
            if form == "bf16":
                (w1, s1), (w3, s3) = (bf16(2048, 4096), None), (bf16(2048, 4096), None)
            else:
                (w1, s1), (w3, s3) = fp8(2048, 4096), fp8(2048, 4096)
            for p in variants(2, DK.SWIGLU_OUTS):
                cases.append((f"gemv_bf16_swiglu {form} shared [2x2048x4096]{tag(p, 2, 'P')}",
                              (2 if form == "bf16" else 1) * 2 * 2048 * 4096,
                              lambda w1=w1, w3=w3, s1=s1, s3=s3, p=p:
                              DK.gemv_bf16_swiglu(w1, w3, xs, hs, 10.0, scale1=s1, scale3=s3,
                                                  outs_per_warp=2 if p is None else p)))
            add_variants("swiglu", form == "fp8", f"gemv_bf16_swiglu {form} shared [2x2048x4096]",
                         (2 if form == "bf16" else 1) * 2 * 2048 * 4096,
                         lambda vn, w1=w1, w3=w3, s1=s1, s3=s3:
                         DK.gemv_bf16_swiglu(w1, w3, xs, hs, 10.0, scale1=s1, scale3=s3, variant=vn), [hs])
    n_dense = len(cases)
    if a.dense_only:
        times = {}
        rc = _run(cases, a, bw, n_dense, EX, times=times)
        if a.suggest:
            _suggest(meta, times, a.suggest)
        return _mismatch_report(mismatches) or rc
    fx = fp4_experts(rng, EX)
    cases.append(("gemv_fp4_gateup mxfp4 6x[2x2048x4096]", fx.gateup_bytes, fx.gateup))
    cases.append(("gemv_fp4_down_combine mxfp4 6x[4096x2048]", fx.down_bytes, fx.down))
    cases.append(("gemv_fp4_down_combine_w2 mxfp4 6x[4096x2048] + w2 bf16 [4096x2048]", fx.down_w2_bytes,
                  fx.down_w2))
    n_simt = len(cases)
    if a.fp4_mma:
        cases.append(("gemv_fp4_gateup mxfp4 mma 6x[2x2048x4096]", fx.gateup_bytes,
                      lambda: fx.gateup(impl="mma")))
        cases.append(("gemv_fp4_down_combine mxfp4 mma 6x[4096x2048]", fx.down_bytes,
                      lambda: fx.down(impl="mma")))
    rc = _run(cases, a, bw, n_dense, EX, n_simt)
    return _mismatch_report(mismatches) or rc


def _mismatch_report(mismatches) -> int:
    for m in mismatches:
        print(f"!!! MISMATCH: {m}")
    if mismatches:
        print(f"!!! {len(mismatches)} GEMV variant(s) differ from the default's bytes: do not select them")
    return 1 if mismatches else 0


def _suggest(meta, times, path) -> None:
    """Per (op, form, class): the bit-identical variant with the least summed time over the
    class's shapes, if it beats the default by > 2 %; printed and written to ``path`` as a
    MEMRA_DSV4_GEMV_VARIANT value (empty when the defaults stay)."""
    groups = {}
    for name, (op, form, cls, shape, vn) in meta.items():
        if name in times:
            groups.setdefault((op, form, cls), {}).setdefault(vn, {})[shape] = times[name]
    picks = []
    for (op, form, cls), by_v in sorted(groups.items()):
        shapes = set(by_v.get("default", {}))
        best, best_t = "default", sum(by_v.get("default", {}).values())
        for vn, t in by_v.items():
            if vn != "default" and set(t) == shapes and sum(t.values()) < 0.98 * best_t:
                best, best_t = vn, sum(t.values())
        print(f"suggest {op}.{form}.{cls}: {best} ({best_t:.2f} us over {len(shapes)} shape(s); "
              f"default {sum(by_v.get('default', {}).values()):.2f} us)")
        if best != "default":
            picks.append(f"{op}.{form}" + ("" if cls == "any" else f".{cls}") + f"={best}")
    value = ",".join(picks)
    print(f"MEMRA_DSV4_GEMV_VARIANT={value}")
    with open(path, "w") as fh:
        fh.write(value + "\n")


def _default_build(stem: str, name: str):
    """The default build's kernel (a `kernels_from` lookup for rows that change only host settings)."""
    from memra_dsv4.gpu.ops._common import kernel
    return kernel(stem, name)


def _run(cases, a, bw, n_dense, EX, n_simt=None, times=None) -> int:
    from memra_dsv4.profiling.launches import record_launches, time_launches
    mismatches = []   # FP4 variant builds whose bytes differ from the default build's

    def report(name, nbytes, recs):
        us = sum(time_launches(recs, reps=a.reps, flush_bytes=256 << 20))
        if times is not None:
            times[name] = us
        print(f"{name:<56s} {us:8.2f} {nbytes / us / 1e3:8.0f} {100 * nbytes / (us * 1e-6) / bw:9.1f}%")

    print(f"{'kernel':<56s} {'us':>8s} {'GB/s':>8s} {'of copy bw':>10s}")
    for name, nbytes, fn in cases:
        report(name, nbytes, record_launches(fn, ("bench_gemv.py",)))
    import dataclasses

    def rebuilt(rec, look):
        """The recorded launch with the kernel of the same name from the variant build."""
        stem, kname = rec.kernel.split(".", 1)
        f = look(stem, kname)
        smem = int(rec.kwargs.get("shared_mem", 0))
        if smem + 1024 > 48 * 1024:   # as ops.experts.gemv_fp4_down_combine sets it
            f.max_dynamic_shared_size_bytes = max(smem, 48 * 1024 + 1)
        return dataclasses.replace(rec, fn=f)

    if a.fp4_variants:
        # "previous": the table-only decode at the old down ring depth (x staging is the new
        # batched one); "FP4_DN_DEPTH=2" isolates the ring depth (its gate/up row repeats the
        # default build: a noise estimate)
        # the same bits are the premise of every row here: each variant's output (the wrapper's
        # return value) is compared byte for byte with the default build's, same inputs
        # defines None: the default build with the full-shape fast kernels switched off
        for label, defines in [("general: FP4 full path off (the _k4 / _k2 kernels)", None),
                               ("previous: FP4_ALU_ODD=0 FP4_DN_DEPTH=2", {"FP4_ALU_ODD": 0, "FP4_DN_DEPTH": 2}),
                               ("FP4_DN_DEPTH=2", {"FP4_DN_DEPTH": 2}),
                               ("FP4_ALU_EVEN=1", {"FP4_ALU_EVEN": 1}),
                               ("FP4_PRMT=0 (table even: the PRMT session's previous default)", {"FP4_PRMT": 0}),
                               # the fp4red changes (experts.cu FP4_XRED, FP4_E8M0_FMA, FP4_E4M3_CVT):
                               # all three off (the previous default), then each off alone
                               ("prev3: FP4_XRED=0 FP4_E8M0_FMA=0 FP4_E4M3_CVT=0 (the previous default)",
                                {"FP4_XRED": 0, "FP4_E8M0_FMA": 0, "FP4_E4M3_CVT": 0}),
                               ("FP4_XRED=0", {"FP4_XRED": 0}),
                               ("FP4_E8M0_FMA=0", {"FP4_E8M0_FMA": 0}),
                               ("FP4_E4M3_CVT=0", {"FP4_E4M3_CVT": 0}),
                               # a schedule-only candidate (no spills; bits checked as every row):
                               # gate/up over 1 row pair at depth 4 (the recorded launch's grid is
                               # the R = 2 one, which already fills the GPU).  A down over 4 rows is
                               # NOT timed here: the relaunch keeps the R = 2 grid, where half the
                               # warps would get no row group (Flash down has 1024 groups of 4 for
                               # 2112 resident warps), so its time would say nothing fair
                               ("FP4_GU_R=1 FP4_DEPTH=4", {"FP4_GU_R": 1, "FP4_DEPTH": 4}),
                               # occupancy: 80 registers (launch bounds for 3 CTAs per SM) and a
                               # grid of 3 CTAs per SM (ops.experts.CTAS_PER_SM, set while the
                               # launches are recorded; down over 1-row groups, so that its grid can
                               # grow past 256 CTAs); ptxas: gate/up 12 B (mx) / 24 B (nv) of spill
                               # in the setup, down none at FP4_DN_DEPTH=1
                               ("occ3a: FP4_MINB=3 FP4_DEPTH=1 FP4_DN_DEPTH=1 FP4_DN_R=1, 3 CTAs/SM",
                                {"FP4_MINB": 3, "FP4_DEPTH": 1, "FP4_DN_DEPTH": 1, "FP4_DN_R": 1,
                                 "EX.CTAS_PER_SM": 3, "EX.DOWN_ROWS_PER_GROUP": 1}),
                               ("occ3b: FP4_MINB=3 FP4_GU_R=1 FP4_DEPTH=2 FP4_DN_DEPTH=2 FP4_DN_R=1, 3 CTAs/SM",
                                {"FP4_MINB": 3, "FP4_GU_R": 1, "FP4_DEPTH": 2, "FP4_DN_DEPTH": 2, "FP4_DN_R": 1,
                                 "EX.CTAS_PER_SM": 3, "EX.DOWN_ROWS_PER_GROUP": 1}),
                               ("occ3c: FP4_MINB=3 (default depths, spills), 3 CTAs/SM",
                                {"FP4_MINB": 3, "EX.CTAS_PER_SM": 3}),
                               ("occ2r1: FP4_DN_R=1 FP4_GU_R=1 (2 CTAs/SM, 1-row groups)",
                                {"FP4_DN_R": 1, "FP4_GU_R": 1, "EX.DOWN_ROWS_PER_GROUP": 1}),
                               # the default build's gate/up with its weight ring in shared memory
                               # (gemv_*_gateup_k4_r, cp.async one row group ahead; ops.experts
                               # GATEUP_RING); its down row repeats the default (a noise estimate)
                               ("ring: gemv_*_gateup_k4_r (weight ring in shared memory)",
                                {"EX.GATEUP_RING": True})]:
            if a.fp4_variant and not any(f in label for f in a.fp4_variant):
                continue
            host = {k[3:]: v for k, v in (defines or {}).items() if k.startswith("EX.")}
            defines = None if defines is None else {k: v for k, v in defines.items() if not k.startswith("EX.")}
            look = (EX.variant_kernels(defines) if defines else
                    _default_build if defines is not None else None)
            saved = {k: getattr(EX, k) for k in host}
            for name, nbytes, fn in cases[n_dense:n_simt]:
                want = fn().copy()
                if look is None:   # the default build's general kernels: recorded under the switch
                    with EX.full_path(False):
                        got = fn().copy()
                        recs = record_launches(fn, ("bench_gemv.py",))
                else:              # the variant build's kernel of each recorded (default) launch's name
                    for k, v in host.items():   # host geometry of the variant (grid, smem) while recording
                        setattr(EX, k, v)
                    try:
                        with EX.kernels_from(look):
                            got = fn().copy()
                        recs = [rebuilt(r, look) for r in record_launches(fn, ("bench_gemv.py",))]
                    finally:
                        for k, v in saved.items():
                            setattr(EX, k, v)
                if not (got.view(want.dtype) == want).all():
                    bad = int((got != want).sum())
                    mismatches.append(f"{name.split(' ')[0]} [{label}]: {bad} of {want.size} outputs differ")
                    print(f"!!! MISMATCH: {mismatches[-1]}")
                report(f"{name.split(' ')[0]} [{label}]", nbytes, recs)
    # timed only, no bytes check: the tensor-core kernels' builds (not the CUDA-core bits) and
    # the FP4_DIAG_* builds (wrong values on purpose)
    timed = []
    if a.fp4_mma and n_simt is not None:
        mma = cases[n_simt:]
        timed += [("mma FP4_MMA_PLACE=1", {"FP4_MMA_PLACE": 1}, mma),
                  ("mma FP4_MMA_PLACE=1 PRMT=1", {"FP4_MMA_PLACE": 1, "FP4_MMA_PRMT": 1}, mma),
                  ("mma PLACE=1 PRMT=1 DEPTH=4 MINB=1", {"FP4_MMA_PLACE": 1, "FP4_MMA_PRMT": 1,
                                                         "FP4_MMA_DEPTH": 4, "FP4_MMA_MINB": 1}, mma),
                  ("mma FP4_MMA_DEPTH=4 MINB=1", {"FP4_MMA_DEPTH": 4, "FP4_MMA_MINB": 1}, mma)]
    if a.fp4_cost and n_simt is not None:
        # TIMING ONLY: experts.cu FP4_DIAG_DECODE builds time the FP4 kernels with a cheaper e2m1
        # decode (1: the operation count a load-time bit permutation would leave, 2: no gathers)
        # to size that lever
        simt, mma, down = cases[n_dense:n_simt], cases[n_simt:], cases[n_simt - 2:n_simt]
        timed += [("COST simt decode as permuted (7 ops / 8 weights)", {"FP4_DIAG_DECODE": 1}, simt),
                  ("COST simt no gathers (5 ops / 8 weights)", {"FP4_DIAG_DECODE": 2}, simt),
                  ("COST mma PLACE PRMT decode as permuted", {"FP4_MMA_PLACE": 1, "FP4_MMA_PRMT": 1,
                                                              "FP4_DIAG_DECODE": 1}, mma),
                  ("COST mma PLACE PRMT no gathers", {"FP4_MMA_PLACE": 1, "FP4_MMA_PRMT": 1,
                                                      "FP4_DIAG_DECODE": 2}, mma),
                  # the down + combine's prologue (experts.cu FP4_DIAG_DOWN): what staging the six
                  # h rows and the ids -> table -> weights chain of dependent loads cost it
                  ("COST down: h rows not staged", {"FP4_DIAG_DOWN": 1}, down),
                  ("COST down: table loads not behind the ids", {"FP4_DIAG_DOWN": 2}, down),
                  ("COST down: both", {"FP4_DIAG_DOWN": 3}, down)]
    for label, defines, rows in timed:
        if a.fp4_variant and not any(f in label for f in a.fp4_variant):
            continue
        look = EX.variant_kernels(defines)
        for name, nbytes, fn in rows:
            recs = [rebuilt(r, look) for r in record_launches(fn, ("bench_gemv.py",))]
            report(f"{name.split(' ')[0]} [{label}]", nbytes, recs)
    if mismatches:
        print(f"!!! {len(mismatches)} FP4 variant build(s) differ from the default's bytes: do not select them")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
