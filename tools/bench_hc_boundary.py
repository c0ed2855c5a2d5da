"""Time one decode sub-layer boundary: the fused hc_boundary launch against the unfused chain
hc_post -> hc_mixes (split) -> hc_pre_finish -> rmsnorm, both replayed from CUDA graphs.

Each graph runs --boundaries boundaries back to back on ping-pong streams, every boundary with
its own fn (f32 [24, 4D], 1.5 MB at D = 4096) and norm weight, so fn streams from HBM as in the
decode step (48 x 1.5 MB = 72 MB > the 50 MB L2).  Prints microseconds per boundary (graph
time / boundaries, launch gaps included) and checks that both graphs leave the same bytes.

    python tools/bench_hc_boundary.py [--dim 4096] [--boundaries 48] [--reps 50]
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
    a = ap.parse_args()
    D, NB = a.dim, a.boundaries
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
    f = bf16_bits((1, D))
    X0 = bf16_bits((1, 4, D))
    iters, eps = 20, 1e-6

    def bufs():
        return dict(a=X0.copy(), b=cp.empty_like(X0), x=cp.empty((1, D), cp.uint16),
                    xn=cp.empty((1, D), cp.uint16), pre=cp.empty((1, 4), cp.float32),
                    post=cp.full((1, 4), 0.5, cp.float32), comb=cp.full((1, 4, 4), 0.25, cp.float32),
                    mixes=cp.empty((1, 24), cp.float32))

    F, U = bufs(), bufs()

    def fused():
        cur, oth = F["a"], F["b"]
        for k in range(NB):
            HC.hc_boundary(cur, fns[k], scale, base, ws[k], iters=iters, hc_eps=eps, norm_eps=eps,
                           xn=F["xn"], x=F["x"], pre=F["pre"], post=F["post"], comb=F["comb"],
                           mixes=F["mixes"], f=f, out=oth)
            cur, oth = oth, cur

    def unfused():
        cur, oth = U["a"], U["b"]
        for k in range(NB):
            HC.hc_post(f, cur, U["post"], U["comb"], out=oth)
            cur, oth = oth, cur
            HC.hc_pre(cur, fns[k], scale, base, iters=iters, hc_eps=eps, norm_eps=eps, mixes=U["mixes"],
                      y=U["x"], pre=U["pre"], post=U["post"], comb=U["comb"])
            RN.rmsnorm(U["x"], ws[k], eps, out=U["xn"])

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fused()
        unfused()  # load kernels, size the split workspace before capture
    s.synchronize()
    F.update(bufs())
    U.update(bufs())
    gf, gu = graphs.capture(s, fused), graphs.capture(s, unfused)
    # one replay each from the same start: same bytes
    graphs.replay(gf, s)
    graphs.replay(gu, s)
    s.synchronize()
    same = all(bool(cp.array_equal(F[k].view(cp.uint8), U[k].view(cp.uint8)))
               for k in ("a", "b", "x", "xn", "pre", "post", "comb", "mixes"))
    ev = [cp.cuda.Event() for _ in range(2)]
    res = {}
    for name, g in (("unfused (4 launches)", gu), ("fused hc_boundary", gf)):
        for _ in range(3):
            graphs.replay(g, s)
        ev[0].record(s)
        for _ in range(a.reps):
            graphs.replay(g, s)
        ev[1].record(s)
        ev[1].synchronize()
        res[name] = cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3 / (a.reps * NB)
    for name, us in res.items():
        print(f"{name:24s} {us:7.2f} us / boundary  (D={D}, {NB} boundaries x {a.reps} graph replays)")
    print(f"saving per boundary {res['unfused (4 launches)'] - res['fused hc_boundary']:.2f} us; "
          f"x 85 fused boundaries ~ {85 * (res['unfused (4 launches)'] - res['fused hc_boundary']) / 1e3:.2f} ms/step")
    print(f"fused == unfused bytes after one replay: {same}   ({time.time() - t0:.1f} s)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
