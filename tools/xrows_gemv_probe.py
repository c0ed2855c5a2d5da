"""What the verify step's multi-row GEMV buys: one launch over nx rows vs nx single-row launches.

    python tools/xrows_gemv_probe.py [--device 0] [--reps 20] [--rows 1,2,4,8]

For the dense bf16 projections of a Flash layer and the LM head (random bf16 weights and rows),
times ops_decode.gemv_bf16_xrows over nx rows (decode.cu gemv_bf16_x*) against nx launches of
gemv_bf16 (the decode step's kernel), each timed alone as a CUDA graph with a 256 MB L2-evicting
memset between copies (profiling.launches.time_launches, as tools/bench_gemv.py), and checks
first that every row of the multi-row launch has gemv_bf16's bytes ("MISMATCH" and exit status 1
otherwise).  Prints µs per launch, the weight bytes / time against the copy bandwidth measured in
the same run, and the cost of nx rows in units of one row.  docs/verify_step_plan.md, stage 1.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, O, K, groups): Flash's dense bf16 GEMVs of one layer and the head
SHAPES = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1),
          ("wo_a (8 groups)", 8192, 4096, 8), ("wo_b", 4096, 8192, 1),
          ("shared w1", 2048, 4096, 1), ("shared w2", 4096, 2048, 1), ("head", 129280, 4096, 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,8")
    a = ap.parse_args(argv)
    rows = [int(v) for v in a.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 8:
        raise SystemExit(f"--rows {a.rows!r}: integers in 1..8")
    import cupy as cp
    import numpy as np
    from bench.harness import measure_copy_bandwidth
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.profiling.launches import record_launches, time_launches

    cp.cuda.Device(a.device).use()
    bw = measure_copy_bandwidth(a.device)["copy_bw_Bps"]
    print(f"{cp.cuda.runtime.getDeviceProperties(a.device)['name'].decode()}: copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    rng = cp.random.default_rng(0)

    def bf16(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    def timed(fn) -> float:
        return sum(time_launches(record_launches(fn, ("xrows_gemv_probe.py",)), reps=a.reps,
                                 flush_bytes=256 << 20))

    bad = 0
    print(f"{'shape':<18s} {'nx':>3s} {'x-rows us':>10s} {'of bw':>7s} {'nx x 1-row us':>14s} "
          f"{'x-rows / 1 row':>15s}")
    for name, O, K, groups in SHAPES:
        w = bf16(O, K)
        nbytes = 2 * O * K
        one = None
        for nx in rows:
            X = bf16(nx, groups * K)
            out = cp.empty((nx, O), cp.float32)
            refs = [cp.empty(O, cp.float32) for _ in range(nx)]
            xr = [cp.ascontiguousarray(X[j]) for j in range(nx)]
            DK.gemv_bf16_xrows(w, X, out, groups=groups)
            for j in range(nx):
                DK.gemv_bf16(w, xr[j], refs[j], groups=groups)
                if not np.array_equal(out[j].get().view(np.uint32), refs[j].get().view(np.uint32)):
                    print(f"MISMATCH {name} nx={nx} row {j}")
                    bad += 1
            t_x = timed(lambda: DK.gemv_bf16_xrows(w, X, out, groups=groups))
            t_1 = timed(lambda: [DK.gemv_bf16(w, xr[j], refs[j], groups=groups)
                                 for j in range(nx)])
            one = t_x if nx == 1 else one
            rel = f"{t_x / one:15.2f}" if one else f"{'':15s}"
            print(f"{name:<18s} {nx:3d} {t_x:10.2f} {100 * nbytes / (t_x * 1e-6) / bw:6.1f}% "
                  f"{t_1:14.2f} {rel}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
