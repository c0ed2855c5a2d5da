"""Diagnostics of the decode indexer's split form (kernels_cu/indexer.cu indexer_scores_tiles_d128 +
indexer_select_d128) on one GPU: a target for Nsight Compute.

    python3 tools/diag_indexer.py --once [--n 8192] [--lineinfo]
        warm up (3 calls), then ONE split call at N = n_valid = n (Flash shapes: H = 64, k = 512):
        run under `ncu -k regex:indexer_s --launch-skip 6 --launch-count 2` to profile both
        kernels of that call.  --lineinfo builds the module here with -lineinfo (for ncu's
        source counters, --import-source yes) instead of taking the runtime's.

(Twelfth session, with them: the ncu of the binary-search selection, 38,000 issued warp
instructions for n = 8192, led to the high-byte histogram in the scoring launch; a row-major key
tile for the scoring, byte-equal, timed 17.17 against 17.21 us per split call at n = 8192 and was
not kept; the scoring kernel runs at 12 % achieved occupancy, 0.35 eligible warps per scheduler.)

The launches here mirror ops.indexer.scores_topk(form='split') (grid, block, shared memory, the
histogram workspace) on a module built by this script.  Not collected by pytest; needs CuPy and a GPU.
"""
from __future__ import annotations

import argparse

import numpy as np

H, K = 64, 512


def _bits(cp, a):
    return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def build(defines: dict, lineinfo: bool = False):
    """(tiles, select, smem): indexer.cu's split kernels built with -D defines (and -lineinfo)."""
    import cupy as cp

    from memra_dsv4.gpu import kernel_loader
    from memra_dsv4.gpu.ops import indexer as IX
    loader = kernel_loader.get_loader(cp.cuda.Device().id)
    with open(loader.source_path(IX.STEM), encoding="utf-8") as fh:
        source = fh.read()
    opts = kernel_loader.nvrtc_options(loader.kernels_dir) + tuple(f"-D{k}={int(v)}" for k, v in defines.items())
    if lineinfo:
        opts += ("-lineinfo",)
    names = ["indexer_scores_tiles_d128", "indexer_select_d128"]
    mod = cp.RawModule(code=source, options=opts, name_expressions=names)
    return mod.get_function(names[0]), mod.get_function(names[1]), IX.FUSED_SMEM


def split_call(kernels, q, hw, keys, nvg, sc, sel, hist):
    """One split call on `kernels` (build()), as ops.indexer.scores_topk(form='split', w_scale=1)."""
    from memra_dsv4.gpu.ops import indexer as IX
    from memra_dsv4.gpu.ops._common import sm_count
    tiles_k, select_k, smem = kernels
    N = keys.shape[0]
    i32 = np.int32
    grid = max(1, min(-(-N // IX.FUSED_KEYS_PER_TILE), IX.SPLIT_SCORE_CTAS_PER_SM * sm_count()))
    tiles_k((grid,), (128,), (q, hw, keys, i32(keys.shape[1]), nvg, sc, i32(H), i32(N), np.float32(1.0), i32(K),
                               sel, i32(sel.shape[1]), i32(0), hist), shared_mem=smem)
    select_k((1,), (IX.SELECT_THREADS,), (sc, nvg, i32(N), i32(K), sel, i32(sel.shape[1]), i32(0), hist))


def _inputs(cp, rng, n):
    q = _bits(cp, rng.standard_normal((1, H, 128)))
    hw = _bits(cp, rng.standard_normal((1, H)) / 64)
    keys = _bits(cp, rng.standard_normal((n, 128)))
    nvg = cp.asarray(np.array([n], np.int32))
    return q, hw, keys, nvg, cp.empty((1, n), np.uint16), cp.empty((1, K), np.int32)


def once(n: int, lineinfo: bool) -> None:
    import cupy as cp

    from memra_dsv4.gpu.ops import indexer as IX
    q, hw, keys, nvg, sc, sel = _inputs(cp, np.random.default_rng(0), n)
    hist = cp.zeros(256, np.int32)
    if lineinfo:
        kernels = build({}, lineinfo=True)
        run = lambda: split_call(kernels, q, hw, keys, nvg, sc, sel, hist)  # noqa: E731
    else:
        run = lambda: IX.scores_topk(q, hw, keys, nvg, K, sc, sel, w_scale=1.0, form="split", hist=hist)  # noqa: E731
    for _ in range(3):                       # warm: module load, first-launch costs
        run()
    cp.cuda.Device().synchronize()
    run()                                    # the profiled call
    cp.cuda.Device().synchronize()
    print(f"diag_indexer --once: N = n_valid = {n}, k = {K}, split form{' (-lineinfo build)' if lineinfo else ''}: "
          f"one call done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--once", action="store_true", help="one split call after a warm-up (for ncu)")
    ap.add_argument("--n", type=int, default=8192, help="N = n_valid for --once (default 8192: 32K context)")
    ap.add_argument("--lineinfo", action="store_true", help="--once on a -lineinfo build (ncu source counters)")
    a = ap.parse_args()
    if not a.once:
        ap.error("give --once")
    if a.n < 1:
        ap.error(f"--n {a.n}: must be >= 1")
    once(a.n, a.lineinfo)


if __name__ == "__main__":
    main()
