"""Diagnostics of the decode indexer's split form (kernels_cu/indexer.cu indexer_scores_tiles_d128 +
indexer_select_d128) on one GPU: a target for Nsight Compute, and the selection's timing variants.

    python3 tools/diag_indexer.py --once [--n 8192]
        warm up, then ONE scores_topk(form='split') at N = n_valid = n (Flash shapes: H = 64,
        k = 512): run under `ncu -k regex:indexer_s -c 2` to profile both kernels of one call.
    python3 tools/diag_indexer.py --variants
        indexer.cu built with -DIX_SEL_ALGO=0 (the binary search, the default build) and =1 (two
        radix-256 passes over per-warp private histograms): indexer_select_d128 alone, us per call
        (tests/gpu/timing_common.us_per_call: a graph of back-to-back launches), for n = 1024 ..
        32768 on bf16 rows of random scores and of few distinct values; each variant's selection
        is checked equal to the default build's (byte for byte) before it is timed.

Prints one line per measurement.  Not collected by pytest; needs CuPy and a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))


def _bits(cp, a):
    return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def once(n: int) -> None:
    import cupy as cp

    from memra_dsv4.gpu.ops import indexer as IX
    rng = np.random.default_rng(0)
    H, K = 64, 512
    q = _bits(cp, rng.standard_normal((1, H, 128)))
    hw = _bits(cp, rng.standard_normal((1, H)) / 64)
    keys = _bits(cp, rng.standard_normal((n, 128)))
    nvg = cp.asarray(np.array([n], np.int32))
    sc, sel = cp.empty((1, n), np.uint16), cp.empty((1, K), np.int32)
    for _ in range(3):                       # warm: module load, first-launch costs
        IX.scores_topk(q, hw, keys, nvg, K, sc, sel, w_scale=1.0, form="split")
    cp.cuda.Device().synchronize()
    IX.scores_topk(q, hw, keys, nvg, K, sc, sel, w_scale=1.0, form="split")   # the profiled call
    cp.cuda.Device().synchronize()
    print(f"diag_indexer --once: N = n_valid = {n}, k = {K}, split form: one call done")


def variants() -> None:
    import cupy as cp
    from timing_common import us_per_call

    from memra_dsv4.gpu import kernel_loader
    from memra_dsv4.gpu.ops import indexer as IX
    loader = kernel_loader.get_loader(cp.cuda.Device().id)
    with open(loader.source_path(IX.STEM), encoding="utf-8") as fh:
        source = fh.read()
    funcs = {}
    for algo in (0, 1):
        opts = kernel_loader.nvrtc_options(loader.kernels_dir) + (f"-DIX_SEL_ALGO={algo}",)
        mod = cp.RawModule(code=source, options=opts, name_expressions=["indexer_select_d128"])
        funcs[algo] = mod.get_function("indexer_select_d128")
    rng = np.random.default_rng(1)
    K = 512
    for kind in ("rand", "few"):
        row = []
        for n in (1024, 4096, 8192, 16384, 32768):
            x = rng.standard_normal(n) if kind == "rand" else rng.integers(-3, 4, n) * 0.5
            sc = _bits(cp, x)
            nvg = cp.asarray(np.array([n], np.int32))
            outs = {}
            for algo, f in funcs.items():
                sel = cp.full((1, K), -7, np.int32)

                def launch(f=f, sel=sel):
                    f((1,), (IX.SELECT_THREADS,), (sc, nvg, np.int32(n), np.int32(K), sel, np.int32(K), np.int32(0)))
                launch()
                cp.cuda.Device().synchronize()
                outs[algo] = sel.get()
                if not np.array_equal(outs[algo], outs[0]):
                    raise SystemExit(f"IX_SEL_ALGO={algo} selects differently from the default build "
                                     f"({kind}, n = {n}): first col {int(np.flatnonzero(outs[algo] != outs[0])[0])}")
                row.append(f"n={n} algo{algo} {us_per_call(launch):6.2f}")
        print(f"indexer_select_d128 alone ({kind} scores, k = {K}): " + "   ".join(row) + " us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--once", action="store_true", help="one split call after a warm-up (for ncu)")
    ap.add_argument("--n", type=int, default=8192, help="N = n_valid for --once (default 8192: 32K context)")
    ap.add_argument("--variants", action="store_true", help="time the IX_SEL_ALGO builds of the selection")
    a = ap.parse_args()
    if not (a.once or a.variants):
        ap.error("give --once and / or --variants")
    if a.n < 1:
        ap.error(f"--n {a.n}: must be >= 1")
    if a.once:
        once(a.n)
    if a.variants:
        variants()


if __name__ == "__main__":
    main()
