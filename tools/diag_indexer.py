"""Diagnostics of the decode indexer's split form (kernels_cu/indexer.cu indexer_scores_tiles_d128 +
indexer_select_d128) on one GPU: a target for Nsight Compute.

    python3 tools/diag_indexer.py --once [--n 8192]
        warm up (3 calls), then ONE ops.indexer.scores_topk(form='split') at N = n_valid = n
        (Flash shapes: H = 64, k = 512): run under `ncu -k regex:indexer_s --launch-skip 6
        --launch-count 2` to profile both kernels of that call.

(Twelfth session, with them: the ncu of the binary-search selection, 38,000 issued warp
instructions for n = 8192, led to the high-byte histogram in the scoring launch; a row-major key
tile for the scoring, byte-equal, timed 17.17 against 17.21 us per split call at n = 8192 and was
not kept; the scoring kernel runs at 12 % achieved occupancy, 0.35 eligible warps per scheduler.
A -lineinfo build for ncu's source counters gave no per-line table in ncu's text output.)

Not collected by pytest; needs CuPy and a GPU.
"""
from __future__ import annotations

import argparse

import numpy as np

H, K = 64, 512


def _bits(cp, a):
    return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def _inputs(cp, rng, n):
    q = _bits(cp, rng.standard_normal((1, H, 128)))
    hw = _bits(cp, rng.standard_normal((1, H)) / 64)
    keys = _bits(cp, rng.standard_normal((n, 128)))
    nvg = cp.asarray(np.array([n], np.int32))
    return q, hw, keys, nvg, cp.empty((1, n), np.uint16), cp.empty((1, K), np.int32)


def once(n: int) -> None:
    import cupy as cp

    from memra_dsv4.gpu.ops import indexer as IX
    q, hw, keys, nvg, sc, sel = _inputs(cp, np.random.default_rng(0), n)

    def run():
        IX.scores_topk(q, hw, keys, nvg, K, sc, sel, w_scale=1.0, form="split")
    for _ in range(3):                       # warm: module load, first-launch costs
        run()
    cp.cuda.Device().synchronize()
    run()                                    # the profiled call
    cp.cuda.Device().synchronize()
    print(f"diag_indexer --once: N = n_valid = {n}, k = {K}, split form: one call done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--once", action="store_true", help="one split call after a warm-up (for ncu)")
    ap.add_argument("--n", type=int, default=8192, help="N = n_valid for --once (default 8192: 32K context)")
    a = ap.parse_args()
    if not a.once:
        ap.error("give --once")
    if a.n < 1:
        ap.error(f"--n {a.n}: must be >= 1")
    once(a.n)


if __name__ == "__main__":
    main()
