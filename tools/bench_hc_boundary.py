"""Time one decode sub-layer boundary: every hc_boundary implementation (ops.hc.BOUNDARY_IMPLS:
"lastcta" = the default kernel, "poll" = hc_boundary_poll) against the unfused chain
hc_post -> hc_mixes (split) -> hc_pre_finish -> rmsnorm, all replayed from CUDA graphs; with
--split also the split boundary (seam MEMRA_DSV4_HC_SPLIT): "split" = hc_boundary_pre +
hc_boundary_sinkhorn on one stream (byte-checked), and "split pre only" = hc_boundary_pre alone
(post / comb never updated, so not byte-checked): the critical path the device step keeps when
its Sinkhorn runs on a side graph branch; where one cluster covers D (ops.hc.pre_cluster_ok) the
same two arms again with hc_boundary_pre(handoff="cluster") ("split cluster", byte-checked, and
"split pre only cluster").

Two forms, as DeviceStep._block launches them: "post" (the previous sub-layer's hc_post fused in,
streams ping-pong, post / comb in place: every boundary but a stage's first) and "first" (no
hc_post: the first attn boundary of a stage).  Each graph runs --boundaries boundaries back to
back, every boundary with its own fn (f32 [24, 4D], 1.5 MB at D = 4096) and norm weight, so fn
streams from HBM as in the decode step (48 x 1.5 MB = 72 MB > the 50 MB L2).  Prints microseconds
per boundary (graph time / boundaries, launch gaps included; no PDL) and checks that every graph
leaves the same bytes as the unfused one after one replay from the same start: any difference
prints MISMATCH and the exit status is 1.

    python tools/bench_hc_boundary.py [--dim 4096] [--boundaries 48] [--reps 50] [--impls lastcta,poll] [--split]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    import cupy as cp

    from memra_dsv4.gpu import graphs
    from memra_dsv4.gpu.ops import hc as HC
    from memra_dsv4.gpu.ops import rmsnorm as RN

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--boundaries", type=int, default=48)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--impls", default=",".join(HC.BOUNDARY_IMPLS))
    ap.add_argument("--split", action="store_true",
                    help="also time hc_boundary_pre (+ hc_boundary_sinkhorn)")
    a = ap.parse_args()
    D, NB = a.dim, a.boundaries
    impls = [i for i in a.impls.split(",") if i]
    t0 = time.time()
    rs = cp.random.RandomState(1)

    def bf16_bits(shape, scale=1.0, mean=0.0):  # RNE to bf16 bits
        v = (rs.standard_normal(shape, dtype=cp.float32) * np.float32(scale) + np.float32(mean))
        v = v.view(cp.uint32)
        return ((v + 0x7FFF + ((v >> 16) & 1)) >> 16).astype(cp.uint16)

    fns = [rs.standard_normal((24, 4 * D), dtype=cp.float32) * np.float32((4 * D) ** -0.5) for _ in range(NB)]
    ws = [bf16_bits((D,), 0.1, 1.0) for _ in range(NB)]  # norm weights ~ 1
    scale = cp.asarray(np.array([0.5, 0.7, 1.1], np.float32))
    base = cp.asarray((np.random.default_rng(2).standard_normal(24) * 0.5).astype(np.float32))
    fs = [bf16_bits((1, D)) for _ in range(NB)]  # each sub-layer's output
    X0 = bf16_bits((1, 4, D))
    iters, eps = 20, 1e-6
    KEYS = ("a", "b", "x", "xn", "pre", "post", "comb", "mixes")

    def bufs():
        # b zeroed: the "first" form never writes it (an empty buffer compared garbage)
        return dict(a=X0.copy(), b=cp.zeros_like(X0), x=cp.empty((1, D), cp.uint16),
                    xn=cp.empty((1, D), cp.uint16), pre=cp.empty((1, 4), cp.float32),
                    post=cp.full((1, 4), 0.5, cp.float32), comb=cp.full((1, 4, 4), 0.25, cp.float32),
                    mixes=cp.empty((1, 24), cp.float32))

    def fused(B, impl, form):
        def run():
            cur, oth = B["a"], B["b"]
            for k in range(NB):
                kw = dict(f=fs[k], out=oth) if form == "post" else {}
                HC.hc_boundary(cur, fns[k], scale, base, ws[k], iters=iters, hc_eps=eps, norm_eps=eps,
                               xn=B["xn"], x=B["x"], pre=B["pre"], post=B["post"], comb=B["comb"],
                               mixes=B["mixes"], impl=impl, **kw)
                if form == "post":
                    cur, oth = oth, cur
        return run

    def split(B, form, sinkhorn: bool, handoff: str = "ticket"):
        def run():
            cur, oth = B["a"], B["b"]
            for k in range(NB):
                kw = (dict(f=fs[k], out=oth, post_in=B["post"], comb_in=B["comb"]) if form == "post"
                      else {})
                HC.hc_boundary_pre(cur, fns[k], scale, base, ws[k], hc_eps=eps, norm_eps=eps,
                                   xn=B["xn"], x=B["x"], pre=B["pre"], mixes=B["mixes"],
                                   handoff=handoff, **kw)
                if sinkhorn:
                    HC.hc_boundary_sinkhorn(B["mixes"], scale, base, iters=iters, hc_eps=eps,
                                            post=B["post"], comb=B["comb"])
                if form == "post":
                    cur, oth = oth, cur
        return run

    def unfused(B, form):
        def run():
            cur, oth = B["a"], B["b"]
            for k in range(NB):
                if form == "post":
                    HC.hc_post(fs[k], cur, B["post"], B["comb"], out=oth)
                    cur, oth = oth, cur
                HC.hc_pre(cur, fns[k], scale, base, iters=iters, hc_eps=eps, norm_eps=eps, mixes=B["mixes"],
                          y=B["x"], pre=B["pre"], post=B["post"], comb=B["comb"])
                RN.rmsnorm(B["x"], ws[k], eps, out=B["xn"])
        return run

    s = cp.cuda.Stream(non_blocking=True)
    ev = [cp.cuda.Event() for _ in range(2)]
    ok = True
    for form in ("post", "first"):
        arms = [("unfused (4 launches)", None)] + [(f"hc_boundary {i}", i) for i in impls]
        if a.split:
            arms += [("split", "split"), ("split pre only", "pre")]
            if HC.pre_cluster_ok(D):
                arms += [("split cluster", "split:cluster"), ("split pre only cluster", "pre:cluster")]
        B = {name: bufs() for name, _ in arms}

        def make(name, i):
            if i is None:
                return unfused(B[name], form)
            if i.split(":")[0] in ("split", "pre"):
                kind, _, handoff = i.partition(":")
                return split(B[name], form, kind == "split", handoff or "ticket")
            return fused(B[name], i, form)
        fn_of = {name: make(name, i) for name, i in arms}
        with s:
            for name, _ in arms:  # load kernels, size workspaces / slots before any capture
                fn_of[name]()
        s.synchronize()
        for name, _ in arms:
            B[name].update(bufs())
        gs = {name: graphs.capture(s, fn_of[name]) for name, _ in arms}
        for name, _ in arms:  # one replay each from the same start: the same bytes
            graphs.replay(gs[name], s)
        s.synchronize()
        ref = arms[0][0]
        for name, _ in arms[1:]:
            if name.startswith("split pre only"):   # post / comb never updated: other bytes by design
                continue
            bad = [k for k in KEYS if not bool(cp.array_equal(B[name][k].view(cp.uint8), B[ref][k].view(cp.uint8)))]
            if bad:
                ok = False
                print(f"*** MISMATCH *** form={form} {name} != unfused in {bad}")
        res = {}
        for name, _ in arms:
            g = gs[name]
            for _ in range(3):
                graphs.replay(g, s)
            ev[0].record(s)
            for _ in range(a.reps):
                graphs.replay(g, s)
            ev[1].record(s)
            ev[1].synchronize()
            res[name] = cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3 / (a.reps * NB)
        for name, us in res.items():
            print(f"form={form:5s} {name:22s} {us:7.2f} us / boundary  (D={D}, {NB} boundaries x {a.reps} replays)")
        if "hc_boundary lastcta" in res:
            for name, us in res.items():
                if name != "hc_boundary lastcta" and not name.startswith("unfused"):
                    d = res["hc_boundary lastcta"] - us
                    print(f"form={form:5s} {name} saves {d:.2f} us / boundary vs lastcta "
                          f"(x 86 boundaries ~ {86 * d / 1e3:.3f} ms/step)")
    print(f"all graphs == unfused bytes after one replay: {ok}   ({time.time() - t0:.1f} s)")
    if not ok:
        print("*** MISMATCH: a variant's bytes differ from the unfused chain ***")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
