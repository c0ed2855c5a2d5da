"""Where the host time of a GPU prefill goes (cProfile of one warm forward).

    python3 tools/profile_prefill_host.py --tokens 8192 --devices 0,1 [--top 40] [--reps 3]

The 8K prefill of synthetic Flash spends GPU-idle time between phases (bench.prefill at 6089d42:
the attention phases' brackets sum to ~60 % of the attention time): the host enqueues slower
than the GPUs run.  This loads the model, runs one warm-up forward, then one forward under
cProfile, and prints the functions by own time and by cumulative time, plus the wall time of
the profiled forward (cProfile itself adds overhead: read the shares, not the absolute times).
``--reps N`` times N plain forwards first (each printed, then their median): the number to
compare before / after a host-side change, when the host is what bounds the forward.
``--pipeline off|on|coop`` and ``--chunks N`` set the model's prefill pipeline and
gpu.pipeline.N_CHUNKS (default: the seam's value and the module's 4), e.g. to see where the one
host thread of ``coop`` waits at 5 chunks.  ``--convert ab`` times the plain forwards alternately
with ops_glue's raw-kernel bf16 conversions and with its ElementwiseKernels (RAW_CONVERT; same
bytes) and prints both medians; ``raw`` / ``ew`` pin one route for the whole run.
``--gc-ab`` adds the collector as one more interleaved dimension of the plain forwards (enabled,
and disabled around the forward) and prints, per forward, the gen-2 collections it ran, each
device's CuPy pool size and the device's free memory: whether a slow forward is a collector pause
or the memory pool growing / shrinking (a cudaFree synchronises the device).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:flash")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--reps", type=int, default=1, help="plain forwards timed before profiling")
    ap.add_argument("--pipeline", choices=("off", "on", "coop"), default=None,
                    help="the model's prefill pipeline (default: MEMRA_DSV4_PREFILL_PIPELINE)")
    ap.add_argument("--chunks", default=None,
                    help="gpu.pipeline.N_CHUNKS; a comma list (e.g. 3,4) alternates the counts "
                         "forward by forward in the plain forwards (interleaved A/B)")
    ap.add_argument("--convert", choices=("raw", "ew", "ab"), default="raw",
                    help="ops_glue bf16 conversions: raw kernels, ElementwiseKernels, or both alternately")
    ap.add_argument("--gc-ab", action="store_true",
                    help="alternate forwards with the garbage collector on / off, with pool sizes")
    a = ap.parse_args(argv)
    from memra_dsv4.gpu import ops_glue
    from memra_dsv4.gpu import pipeline as PL
    from memra_dsv4.gpu.model import Dsv4Gpu
    chunk_counts = [None]
    if a.chunks is not None:
        try:
            chunk_counts = [int(c) for c in a.chunks.split(",")]
        except ValueError:
            ap.error(f"--chunks {a.chunks!r}: expected N or N,M,...")
        if min(chunk_counts) < 2 or len(set(chunk_counts)) != len(chunk_counts):
            ap.error(f"--chunks {a.chunks}: each at least 2, no repeats")
        PL.N_CHUNKS = chunk_counts[0]
    devices = tuple(int(d) for d in a.devices.split(","))
    m = Dsv4Gpu.synthetic(a.model.split(":", 1)[1], devices=devices, seed=0)
    if a.pipeline is not None:
        m.prefill_pipeline = a.pipeline
    print(f"prefill pipeline {m.prefill_pipeline}, chunks {m._pipeline_plan(a.tokens)}")
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, a.tokens)
    t0 = time.perf_counter()
    m.forward(ids)
    print(f"warm-up forward: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    routes = {"raw": ("raw",), "ew": ("ew",), "ab": ("ew", "raw")}[a.convert]
    gcs = (True, False) if a.gc_ab else (True,)
    # every combination, interleaved forward by forward: (conversions, chunk count, collector on)
    arms = [(r, c, g) for c in chunk_counts for r in routes for g in gcs]
    plain = {arm: [] for arm in arms}

    def label(arm):
        r, c, g = arm
        return (f"{r} conversions" + (f", {c} chunks" if c is not None else "")
                + ("" if not a.gc_ab else ", gc on" if g else ", gc off"))

    for _ in range(max(1, a.reps)):
        for arm in arms:
            ops_glue.RAW_CONVERT = arm[0] == "raw"
            if arm[1] is not None:
                PL.N_CHUNKS = arm[1]
            g2 = gc.get_stats()[2]["collections"]
            if not arm[2]:
                gc.disable()
            t0 = time.perf_counter()
            try:
                m.forward(ids)
            finally:
                gc.enable()
            plain[arm].append((time.perf_counter() - t0) * 1e3)
            extra = "" if not a.gc_ab else (
                f", gen-2 collections {gc.get_stats()[2]['collections'] - g2}; {_pools(devices)}")
            print(f"plain forward ({label(arm)}): {plain[arm][-1]:.0f} ms{extra}", flush=True)
    for arm in arms:
        if len(plain[arm]) > 1:
            print(f"plain forward ({label(arm)}) median of {len(plain[arm])}: "
                  f"{float(np.median(plain[arm])):.1f} ms")
    ops_glue.RAW_CONVERT = a.convert != "ew"
    if chunk_counts[0] is not None:
        PL.N_CHUNKS = chunk_counts[0]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    m.forward(ids)
    prof.disable()
    print(f"profiled forward: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        print(f"==== by {key}")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])
    return 0


def _pools(devices) -> str:
    """Each device's CuPy pool size and free memory (a pool that grows or shrinks between
    forwards means cudaMalloc / cudaFree inside them; a cudaFree synchronises the device)."""
    import cupy as cp
    out = []
    for d in devices:
        with cp.cuda.Device(d):
            free, _ = cp.cuda.runtime.memGetInfo()
            out.append(f"dev{d} pool {cp.get_default_memory_pool().total_bytes() / 2**30:.2f} GiB "
                       f"free {free / 2**30:.2f} GiB")
    return ", ".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
