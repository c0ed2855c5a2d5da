"""Repeat prefill(L) + decode of one synthetic preset on the GPU and say where runs differ.

Contract: for each decode path, ``--trials`` runs of (prefill of the first L ids, then ``--steps``
decode steps) on one model; prints, per path, the state keys that differ between trials after
the prefill and after each step, the steps whose logits differ, and then the first point where
the paths differ from each other (their prefills are the same code, so their post-prefill states
must be byte-identical).  ``--load`` runs a background process of back-to-back GEMMs on the same
GPU during the trials (timing perturbation: a race shows up as run-to-run differences);
``--poison MB`` fills that much of CuPy's pool with 0xFF bytes (NaN in f32 / bf16) before the
model loads and before every trial, on the null stream and on every stage's compute stream
(CuPy keeps a free list per stream), so a buffer read before it is written shows up as NaN or
as a difference between trials.  Exit
status 1 when any path is not deterministic or the prefill states differ across paths.
Diagnostic only (writes nothing); the tests that gate behaviour are in tests/gpu.

    python3 tools/diag_determinism.py --preset small --L 31 --steps 5 --trials 4 --load
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np

LOAD_SRC = """
import cupy as cp, time
a = cp.random.random((4096, 4096), dtype=cp.float32); b = a.copy()
t = time.time()
while time.time() - t < {secs}:
    for _ in range(20):
        a = a @ b * 1e-3
    cp.cuda.Stream.null.synchronize()
"""


def _diff_keys(a: dict, b: dict) -> list[str]:
    return [k for k in a if not np.array_equal(a[k], b[k])]


def poison(mb: int, streams=()) -> None:
    """Allocate, fill with 0xFF and free ``mb`` MB on the null stream and on each of ``streams``
    (the freed blocks go back to that stream's free list, where later allocations find them)."""
    import cupy as cp
    if mb <= 0:
        return
    for s in (cp.cuda.Stream.null, *streams):
        with s:
            a = cp.empty(mb << 20, cp.uint8)
            a.fill(0xFF)
        cp.cuda.Device().synchronize()
        del a


def run_trials(preset: str, path: str, L: int, steps: int, trials: int, seed: int,
               poison_mb: int = 0):
    from memra_dsv4.checkpoint import Checkpoint
    from memra_dsv4.config import preset as get_preset
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.synth import synth_arrays
    cfg = get_preset(preset)
    ck = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=0, experts="mxfp4"))
    poison(poison_mb)
    m = Dsv4Gpu.load(ck, devices=(0,), decode_path=path, max_seq_len=1024, prefill_attn="simt")
    ids = np.random.default_rng(seed).integers(2, cfg.vocab_size, L + steps).tolist()
    runs = []
    for _ in range(trials):
        poison(poison_mb, [d.compute for d in m.devs])
        _, st = m.prefill(ids[:L])
        snaps = [st.snapshot()]
        logits = []
        for t in ids[L:]:
            logits.append(np.asarray(m.decode_step(st, t)).copy())
            snaps.append(st.snapshot())
        runs.append((snaps, logits))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--L", type=int, default=31)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--paths", default="legacy,device-hostmath")
    ap.add_argument("--poison", type=int, default=0, metavar="MB",
                    help="fill this much of the memory pool with 0xFF before the load and each trial")
    ap.add_argument("--load", type=float, default=0.0, metavar="SECONDS",
                    help="background GEMM load on GPU 0 for this many seconds")
    a = ap.parse_args()
    bg = None
    if a.load > 0:
        bg = subprocess.Popen([sys.executable, "-c", LOAD_SRC.format(secs=a.load)])
    bad = False
    results = {}
    try:
        for path in a.paths.split(","):
            runs = run_trials(a.preset, path, a.L, a.steps, a.trials, a.seed, a.poison)
            results[path] = runs
            s0, l0 = runs[0]
            for ti, (s, lg) in enumerate(runs):
                nan = [i for i, x in enumerate(lg) if not np.isfinite(x).all()]
                if nan:
                    bad = True
                    print(f"{path}: trial {ti}: non-finite logits at steps {nan}")
            for ti, (s, lg) in enumerate(runs[1:], 1):
                for si in range(len(s0)):
                    d = _diff_keys(s0[si], s[si])
                    if d:
                        bad = True
                        where = "prefill" if si == 0 else f"step {si - 1}"
                        print(f"{path}: trial {ti} vs 0 state after {where} differs in "
                              f"{len(d)} keys: {d[:8]}")
                for i, (x, y) in enumerate(zip(l0, lg)):
                    if not np.array_equal(x, y):
                        bad = True
                        print(f"{path}: trial {ti} vs 0 logits step {i} max |diff| "
                              f"{np.abs(x - y).max():.3e}")
            print(f"{path}: {a.trials} trials done", flush=True)
    finally:
        if bg is not None:
            bg.kill()
    paths = list(results)
    for p in paths[1:]:
        (sa, la), (sb, lb) = results[paths[0]][0], results[p][0]
        for si in range(len(sa)):
            d = _diff_keys(sa[si], sb[si])
            if d:
                where = "prefill" if si == 0 else f"step {si - 1}"
                print(f"{paths[0]} vs {p}: first state difference after {where}: "
                      f"{len(d)} keys {d[:8]}")
                if si == 0:
                    bad = True
                break
        for i, (x, y) in enumerate(zip(la, lb)):
            if not np.array_equal(x, y):
                print(f"{paths[0]} vs {p}: first logits difference at step {i}: "
                      f"max |diff| {np.abs(x - y).max():.3e}")
                break
        else:
            print(f"{paths[0]} vs {p}: logits byte-identical over {len(la)} steps")
    print("deterministic" if not bad else "NOT deterministic / prefill states differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
