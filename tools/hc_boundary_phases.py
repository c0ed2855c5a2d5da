"""Where one decode boundary's critical launch spends its time: hc.cu built with
-DMEMRA_HC_STAMPS (phase stamps of %globaltimer, compiled away in the production build), then
hc_boundary_pre (the last-CTA ticket form), hc_boundary_pre_cluster (one cluster of D / 256
CTAs) and hc_boundary_pre_coop (the ticket form's grid publishing tagged words; "coop": 8 tail CTAs
poll them and form x / xn, "coopall": every CTA) launched alone, one at a time, each after a 256 MB memset that evicts the L2 (so fn, 1.5 MB
at D = 4096, comes from HBM as in the decode step), both forms ("post": with hc_post; "first":
without).  Prints, per kernel and form, the median over --reps launches of each phase point in
microseconds after the earliest CTA's entry (for the ticket form the spread of phase A's end over
the 64 CTAs, then the last CTA's tail; for the cluster and coop forms the median and the latest
CTA at each point; coop points 3..7 over the tail CTAs only), and checks that every kernel wrote the ticket form's bytes (x, xn, mixes, pre,
out).

    python tools/hc_boundary_phases.py [--dim 4096] [--reps 30]

Phase points (HC_STAMP in kernels_cu/hc.cu):
  ticket  0 entry (before the fn loads)  1 after the PDL wait  2 phase A done  3 last CTA: ticket
          won  4 partials in shared memory  5 mixes + pre formed (warp 0)  6 pre + S ready (block
          barrier)  7 x, xn stored; inside: 12 chains added  13 mixes formed  8 x of thread 0's
          chunks formed  9 x barrier  10 sum of squares (second barrier)  11 rsqrt formed
  cluster 0 entry  1 after the wait  2 hc_post / S in shared memory  3 segment values staged
          4 cluster barrier passed  5 partials sent  6 all partials received (warp 0)  7 mixes /
          pre formed  8 x of the CTA's channels formed  9 x sent  10 all of x received
          11 sum of squares formed  12 xn stored
  coop    0 entry  1 after the wait (epoch read)  2 phase A done, slots published (every CTA)
          3 round 1 polled  4 mixes / pre formed, S copied  5 x formed, chains published  6 round
          2 polled  7 xn stored (tail CTAs)
"""
from __future__ import annotations

import argparse
import os

import numpy as np

TICKET_POINTS = ("entry", "wait", "phaseA", "ticket", "part+S in", "mixes+pre", "pre ready", "x,xn out",
                 "x own", "x barrier", "sumsq", "rsqrt", "chains", "mix")
CLUSTER_POINTS = ("entry", "wait", "S smem", "seg vals", "cl barrier", "part sent", "part in",
                  "mixes/pre", "x own", "x sent", "x in", "sumsq", "xn out")
COOP_POINTS = ("entry", "wait", "phaseA+pub", "round1 in", "mixes/pre", "x+chains", "round2 in", "xn out")


def main() -> int:
    import cupy as cp

    from memra_dsv4.gpu import kernel_loader, pdl
    from memra_dsv4.gpu.ops import hc as HC

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    D = a.dim
    assert HC.pre_cluster_ok(D), f"D = {D}: no cluster form"
    kdir = kernel_loader.KERNELS_DIR
    src = open(os.path.join(kdir, "hc.cu"), encoding="utf-8").read()
    mod = cp.RawModule(code=src, options=kernel_loader.nvrtc_options(kdir) + ("-DMEMRA_HC_STAMPS",))
    k_ticket = mod.get_function("hc_boundary_pre")
    k_cluster = mod.get_function("hc_boundary_pre_cluster")
    k_coop = mod.get_function("hc_boundary_pre_coop") if HC.pre_coop_ok(D) else None
    coop_slots = cp.zeros((HC.COOP_SLOT_INT32,), cp.int32)   # this module's own (tags start anew)
    shape = {h: HC.pre_launch_shape(D, h) for h in HC.PRE_HANDOFFS}   # ops.hc's launches
    k_ticket.max_dynamic_shared_size_bytes = shape["ticket"]["smem_optin"]   # > 48 KB: opt in
    stamps = cp.ndarray((128, 16), cp.uint64, mod.get_global("hc_stamps"))

    rs = cp.random.RandomState(5)

    def bf16_bits(shape, scale=1.0, mean=0.0):
        v = (rs.standard_normal(shape, dtype=cp.float32) * np.float32(scale) + np.float32(mean)).view(cp.uint32)
        return ((v + 0x7FFF + ((v >> 16) & 1)) >> 16).astype(cp.uint16)

    n = 4 * D
    nseg, C = n // 256, HC.pre_cluster_ctas(D)
    fn = rs.standard_normal((24, n), dtype=cp.float32) * np.float32(n ** -0.5)
    scale = cp.asarray(np.array([0.5, 0.7, 1.1], np.float32))
    base = cp.asarray((np.random.default_rng(2).standard_normal(24) * 0.5).astype(np.float32))
    w = bf16_bits((D,), 0.1, 1.0)
    X, f = bf16_bits((1, 4, D)), bf16_bits((1, D))
    post = cp.asarray(np.array([[0.9, 1.1, 0.7, 1.3]], np.float32))
    comb = cp.full((1, 4, 4), 0.25, cp.float32)
    flush = cp.empty(256 << 20, cp.uint8)
    ws, cnt = HC.split_workspace(1, nseg)
    null = np.uint64(0)
    s = cp.cuda.Stream(non_blocking=True)
    ok = True

    def outs():
        return dict(out=cp.zeros((1, 4, D), cp.uint16), mixes=cp.zeros((1, 24), cp.float32),
                    pre=cp.zeros((1, 4), cp.float32), x=cp.zeros((1, D), cp.uint16), xn=cp.zeros((1, D), cp.uint16))

    def launch(kind, form, o):
        withf = form == "post"
        head = (f if withf else null, X, post if withf else null, comb if withf else null,
                o["out"] if withf else null, fn, scale, base, w, o["mixes"], o["pre"], o["x"], o["xn"],
                np.int32(D), np.float32(1e-6), np.float64(1e-6))
        sh = shape[kind]
        if kind == "ticket":
            pdl.launch_ex(k_ticket, "hc_boundary_pre", sh["grid"], sh["block"], head + (ws, cnt),
                          shared_mem=sh["shared_mem"], stream=s, pdl=False)
        elif kind in HC.COOP_HANDOFFS:
            pdl.launch_ex(k_coop, "hc_boundary_pre_coop", sh["grid"], sh["block"],
                          head + (np.int32(HC.coop_tail_ctas(D, kind)), coop_slots), shared_mem=0, stream=s,
                          pdl=False)
        else:
            pdl.launch_ex(k_cluster, "hc_boundary_pre_cluster", sh["grid"], sh["block"], head,
                          shared_mem=sh["shared_mem"], stream=s, pdl=False, cluster=sh["cluster"])

    for form in ("post", "first"):
        res, bytes_of = {}, {}
        kinds = ("ticket", "cluster") + (HC.COOP_HANDOFFS if k_coop is not None else ())
        for kind in kinds:
            rows = []
            o = outs()
            for rep in range(a.reps + 2):
                with s:
                    flush.fill(rep & 0xFF)
                    stamps.fill(0)
                    launch(kind, form, o)
                s.synchronize()
                if rep >= 2:
                    rows.append(cp.asnumpy(stamps).astype(np.int64))
            res[kind] = rows
            bytes_of[kind] = {k: cp.asnumpy(v).tobytes() for k, v in o.items()}
        for kind in kinds[1:]:
            bad = [k for k in bytes_of["ticket"] if bytes_of["ticket"][k] != bytes_of[kind][k]
                   and not (k == "out" and form == "first")]
            if bad:
                ok = False
                print(f"*** MISMATCH *** form={form}: {kind} != ticket in {bad}")
        # ticket: points relative to the earliest entry
        per = []
        for st in res["ticket"]:
            live = st[:nseg]
            t0 = live[:, 0].min()
            last = int(np.flatnonzero(live[:, 3])[0])
            per.append([live[:, 1].max() - t0, np.median(live[:, 2]) - t0, live[:, 2].max() - t0]
                       + [live[last, i] - t0 for i in range(3, 14)])
        med = np.median(np.array(per, np.float64), axis=0) / 1e3
        names = ["wait (latest CTA)", "phaseA (median CTA)", "phaseA (latest CTA)"] + list(TICKET_POINTS[3:])
        print(f"form={form:5s} ticket  (64 CTAs; us after the first entry, median of {a.reps}):")
        print("    " + "  ".join(f"{nm} {v:5.2f}" for nm, v in zip(names, med)))
        per_med, per_max = [], []
        for st in res["cluster"]:
            live = st[:C]
            t0 = live[:, 0].min()
            per_med.append([np.median(live[:, i]) - t0 for i in range(13)])
            per_max.append([live[:, i].max() - t0 for i in range(13)])
        mm = np.median(np.array(per_med, np.float64), axis=0) / 1e3
        mx = np.median(np.array(per_max, np.float64), axis=0) / 1e3
        print(f"form={form:5s} cluster ({C} CTAs; us after the first entry, median CTA / latest CTA):")
        print("    " + "  ".join(f"{nm} {v:5.2f}/{x:5.2f}" for nm, v, x in zip(CLUSTER_POINTS, mm, mx)))
        for kind in kinds[2:]:
            nt = HC.coop_tail_ctas(D, kind)
            per_med, per_max = [], []
            for st in res[kind]:
                live = st[:nseg]
                t0 = live[:, 0].min()
                rows = [live[:, i] if i < 3 else live[:nt, i] for i in range(8)]
                per_med.append([np.median(r) - t0 for r in rows])
                per_max.append([r.max() - t0 for r in rows])
            mm = np.median(np.array(per_med, np.float64), axis=0) / 1e3
            mx = np.median(np.array(per_max, np.float64), axis=0) / 1e3
            print(f"form={form:5s} {kind:7s} ({nseg} CTAs, {nt} tail; us after the first entry, median CTA / latest CTA):")
            print("    " + "  ".join(f"{nm} {v:5.2f}/{x:5.2f}" for nm, v, x in zip(COOP_POINTS, mm, mx)))
    print(f"cluster / coop == ticket bytes: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
