"""Which forms of the device step disagree on a Flash-shaped layer with the shared expert's w2
fused into the down + combine (MEMRA_DSV4_DECODE_SHARED_W2)?  Diagnostic for the fifteenth
session's failure of tests/gpu/test_step_shared_w2_gpu.py::..._flash_layer (fused != gemv at
step 0).  Loads flash-layers:1 (bf16 dense), prefills 5 tokens into one state per arm, runs
STEPS steps per arm interleaved, and prints for every arm and step whether its logits equal
the reference arm's (gemv, graph, PDL on, fork on) and the largest |difference|.  Arms vary
the w2 form, graph / eager, PDL and the graph fork, so the report says whether the difference
is in the kernels (eager differs too) or in the schedule (only some graph forms differ).

    python3 tools/diag_shared_w2.py [--steps 3] [--reps 1] [--arms gemv,fused,...]

--reps R repeats the whole comparison R times with fresh states (so fresh graph captures), and
prints one summary line per rep plus the count of reps with any difference: an intermittent
(schedule-dependent) difference shows as a rate.

--poison fills every stage's step arena (StepWs: one arena per stage, shared by every state) with
0xFF bytes before each rep's first step (from rep 1 on, once the step exists).  Every arena
buffer must be rewritten before it is read, so a correct step is unaffected; a read that races
ahead of its writer (a load before the PDL wait of something the step writes) then reads NaN
patterns instead of the previous arm's identical values, and the reference arm's step 0
differs loudly.  Why: the seventeenth session's suite run failed four Flash-layer step tests at
step 0 only (the arena is shared, so at step i > 0 a racing read would see the previous arm's
equal bits), with experts.cu FP4_DN_PRELOAD = 2; run with MEMRA_DSV4_KERNELS_DIR at a tree of
each level to compare their rates.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--arms", default="", help="comma-separated subset of the arms (default all)")
    ap.add_argument("--poison", action="store_true", help="0xFF over the step arenas before each rep")
    a = ap.parse_args()
    from memra_dsv4.checkpoint import Checkpoint
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.synth import synth_arrays
    cfg = preset("flash-layers:1")
    ck = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=0, experts="mxfp4"))
    m = Dsv4Gpu.load(ck, devices=(0,), decode_path="device", max_seq_len=1024, prefill_attn="simt", dense="bf16")
    prompt = 5
    ids = np.random.default_rng(31).integers(2, cfg.vocab_size, prompt + a.steps).tolist()
    # arm -> (shared_w2, graph, pdl, fork)
    arms = {"gemv": ("gemv", True, "on", m.decode_fork), "gemv+eager": ("gemv", False, "on", m.decode_fork),
            "fused": ("fused", True, "on", m.decode_fork), "fused+eager": ("fused", False, "on", m.decode_fork),
            "fused+nopdl": ("fused", True, "off", m.decode_fork), "fused+nofork": ("fused", True, "on", "off"),
            "gemv+nopdl": ("gemv", True, "off", m.decode_fork)}
    if a.arms:
        arms = {k: arms[k] for k in ["gemv"] + [x for x in a.arms.split(",") if x != "gemv"]}
    bad_reps = 0
    for rep in range(a.reps):
        states = {k: m.prefill(ids[:prompt], m.new_state())[1] for k in arms}
        if a.poison and m._step is not None:
            import cupy as cp
            for S in m._step.stages:
                with cp.cuda.Device(S.dev):
                    cp.cuda.runtime.memset(S.arena.base_ptr, 0xFF, S.arena.nbytes)
                    cp.cuda.Device(S.dev).synchronize()
        bad = []
        for i, t in enumerate(ids[prompt:]):
            got = {}
            for k, (w2, graph, pdl, fork) in arms.items():
                m.decode_shared_w2, m.pdl, m.decode_fork = w2, pdl, fork
                got[k] = np.asarray(device_step(m, states[k], int(t), graph=graph)).astype(np.float32)
            ref = got["gemv"]
            for k in arms:
                same = np.array_equal(got[k].view(np.uint32), ref.view(np.uint32))
                d = float(np.max(np.abs(got[k].astype(np.float64) - ref))) if not same else 0.0
                eq = [o for o in arms if np.array_equal(got[o].view(np.uint32), got[k].view(np.uint32))]
                if a.reps == 1 or not same:
                    print(f"rep {rep} step {i}: {k:<14} {'==' if same else '!='} gemv  max|d| {d:.3e}  "
                          f"equal to {eq}", flush=True)
                if not same:
                    bad.append((i, k))
        bad_reps += bool(bad)
        print(f"rep {rep}: {'differences ' + str(bad) if bad else 'all arms equal'}", flush=True)
    print(f"{bad_reps} of {a.reps} reps with a difference", flush=True)
    return 1 if bad_reps else 0


if __name__ == "__main__":
    raise SystemExit(main())
