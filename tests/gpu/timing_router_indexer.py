"""Timing of the fused decode router / indexer against the unfused pairs they replace (and the
indexer's split form, with a sweep of its scoring grid), at the Flash shapes (one H200, < 30 s).  Each arm is captured REPS times back to back into one CUDA
graph and replayed; printed: microseconds per call (graph time / REPS).

    PYTHONPATH=. python tests/gpu/timing_router_indexer.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np
from timing_common import bits, us_per_call  # tests/gpu on sys.path (run as a script)

from memra_dsv4.gpu.ops import indexer as IX
from memra_dsv4.gpu.ops import router as RT


def main() -> None:
    rng = np.random.default_rng(0)
    D, E, k = 4096, 256, 6
    x = bits(rng.standard_normal((1, D)))
    w = bits(rng.standard_normal((E, D)) / 64)
    bias = cp.asarray((rng.standard_normal(E) * 0.1).astype(np.float32))
    lg, sc = cp.empty((1, E), np.float32), cp.empty((1, E), np.float32)
    idx, wt = cp.empty((1, k), np.int32), cp.empty((1, k), np.float32)
    RT.workspace()
    IX.workspace()

    def unfused_router():
        RT.logits(x, w, out=lg)
        RT.select(lg, k, 2.5, bias=bias, idx=idx, weights=wt, scores=sc)

    def fused_router():
        RT.fused(x, w, k, 2.5, bias=bias, logits=lg, scores=sc, idx=idx, weights=wt)

    print(f"router E={E} D={D}: unfused (logits + select) {us_per_call(unfused_router):6.2f} us   "
          f"fused {us_per_call(fused_router):6.2f} us")
    H, K = 64, 512
    q = bits(rng.standard_normal((1, H, 128)))
    hw = bits(rng.standard_normal((1, H)) / 64)
    for N, nv in ((2048, 256), (2048, 1024), (8192, 8192), (32768, 8192), (32768, 32768), (65536, 65536)):
        keys = bits(rng.standard_normal((N, 128)))
        nvg = cp.asarray(np.array([nv], np.int32))
        s_out, sel = cp.empty((1, N), np.uint16), cp.empty((1, min(K, N)), np.int32)

        def unfused_idx():
            IX.scores(q, hw, keys, nvg, out=s_out, w_scale=1.0)
            IX.topk(s_out, nvg, K, out=sel, order="index")

        def fused_idx():
            IX.scores_topk(q, hw, keys, nvg, K, s_out, sel, w_scale=1.0, form="fused")

        def split_idx():
            IX.scores_topk(q, hw, keys, nvg, K, s_out, sel, w_scale=1.0, form="split")

        print(f"indexer N={N:5d} n_valid={nv:5d} k={K}: unfused (scores + topk) {us_per_call(unfused_idx):6.2f} us   "
              f"fused {us_per_call(fused_idx):6.2f} us   split {us_per_call(split_idx):6.2f} us")

    # the split form's scoring grid: CTAs per SM (IX.SPLIT_SCORE_CTAS_PER_SM), N = n_valid = 8192
    N = 8192
    keys = bits(rng.standard_normal((N, 128)))
    nvg = cp.asarray(np.array([N], np.int32))
    s_out, sel = cp.empty((1, N), np.uint16), cp.empty((1, K), np.int32)
    default = IX.SPLIT_SCORE_CTAS_PER_SM
    row = []
    for per_sm in (1, 2, 3, 4, 5, 8):
        IX.SPLIT_SCORE_CTAS_PER_SM = per_sm
        row.append(f"{per_sm}/SM {us_per_call(lambda: IX.scores_topk(q, hw, keys, nvg, K, s_out, sel, w_scale=1.0, form='split')):6.2f}")
    IX.SPLIT_SCORE_CTAS_PER_SM = default
    print(f"indexer split N={N} scoring grid cap: " + "   ".join(row) + " us")


if __name__ == "__main__":
    main()
