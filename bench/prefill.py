"""Prefill throughput of the GPU runtime.

    python -m bench.prefill --model synthetic:flash --devices 0,1 --tokens 1024,8192
    python -m bench.prefill ... --arms moe=fp4mma+pipeline=off,moe=fp4mma+pipeline=on,moe=blaslt
    python -m bench.prefill ... --arms dispatch=host,dispatch=device
    python -m bench.prefill ... --arms pipeline=off,pipeline=coop+chunks=2,pipeline=on+chunks=2

--arms: every token count runs every arm in one process (A/B): settings moe (seam
MEMRA_DSV4_PREFILL_MOE), pipeline (MEMRA_DSV4_PREFILL_PIPELINE), attn (MEMRA_DSV4_PREFILL_ATTN),
dispatch (MEMRA_DSV4_PREFILL_DISPATCH; the fp4mma arm's plan on the host or the device), chunks
(gpu.pipeline.N_CHUNKS: how many chunks pipeline=on / coop cuts the prompt into; 2, 3, 4, 5, 6 or 8).

Per token count: median wall time of --iters forwards (after --warmup), tokens/s, achieved
TFLOP/s (GEMM flops counted by the GEMM backend per forward) against the bf16 GEMM peak
measured in the same run (an 8192^3 cuBLASLt bf16 GEMM), and the phase breakdown of
--phase-iters further forwards in events mode.  The timed forwards run with the profiling mode
of MEMRA_DSV4_PROF when it is set (e.g. nvtx under nsys) and with profiling off otherwise: every
bracket of events mode records two CUDA events from the host, and a host-bound forward (the
pipelined prefill from one host thread) shows that as time.  (Until the seventh session the
timed forwards ran in events mode: at fb5d3ac the coop pipeline at 5 chunks measured 1.29 s here
and 1.02 s uninstrumented in tools/profile_prefill_host.py.)  JSON + PNG via
bench.harness.write_results.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def bf16_peak_tflops(device: int, n: int = 8192, iters: int = 20) -> float:
    import cupy as cp
    from memra_dsv4.gpu.ops_glue import GemmBackend

    with cp.cuda.Device(device):
        g = GemmBackend(device, "blaslt")
        x = cp.zeros((n, n), dtype=cp.uint16)
        w = cp.zeros((n, n), dtype=cp.uint16)
        for _ in range(3):
            g.mm(x, w)
        cp.cuda.Device(device).synchronize()
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        for _ in range(iters):
            g.mm(x, w)
        t1.record()
        t1.synchronize()
        ms = cp.cuda.get_elapsed_time(t0, t1) / iters
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


# pipeline=on / coop chunk counts an arm may set (gpu.pipeline.N_CHUNKS; the pipeline still keeps each
# chunk >= gpu.pipeline.MIN_CHUNK tokens, so 8 chunks need >= 8K tokens)
CHUNK_COUNTS = ("2", "3", "4", "5", "6", "8")


def parse_arms(spec: str) -> list[tuple[str, dict]]:
    """'moe=fp4mma+pipeline=on,moe=blaslt' -> [(label, settings)] (bench.harness.parse_arms and
    arm_label); empty -> [("", {})].  Unknown keys or values are refused before anything loads:
    each key takes the values of its seam."""
    from bench.harness import arm_label, parse_arms as parse
    from memra_dsv4 import seams
    known = {"moe": seams.SEAM_PREFILL_MOE.allowed, "pipeline": seams.SEAM_PREFILL_PIPELINE.allowed,
             "attn": seams.SEAM_PREFILL_ATTN.allowed, "dispatch": seams.SEAM_PREFILL_DISPATCH.allowed,
             "chunks": CHUNK_COUNTS}
    if not spec.strip():
        return [("", {})]
    try:
        arms = parse(spec)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for s in arms:
        for k, v in s.items():
            if k not in known:
                raise SystemExit(f"prefill arm {arm_label(s)!r}: unknown setting {k!r}; known: {', '.join(known)}")
            if v not in known[k]:
                raise SystemExit(f"prefill arm {arm_label(s)!r}: {k}={v!r}; expected one of {', '.join(known[k])}")
    return [(arm_label(s), s) for s in arms]


def host_probe_ms(n: int = 20000) -> float:
    """Wall ms of a fixed pure-Python workload (dict updates): a gauge of the host thread's speed
    at that moment.  The coop prefill is host-bound, and on a shared machine the CPU's speed
    comes in streaks (docs/prefill_perf.md, eighth session): a forward's time read beside the
    probe taken just before it says whether a slow forward was a slow host."""
    t0 = time.perf_counter()
    d: dict = {}
    for i in range(n):
        k = i & 255
        d[k] = d.get(k, 0) + i
    return (time.perf_counter() - t0) * 1e3


def time_forwards(m, ids, label: str, iters: int, warmup: int, phase_iters: int,
                  timed_mode: str = "off", phase_clock=None, probes: list | None = None):
    """``warmup`` then ``iters`` timed forwards of ``ids`` with profiling in ``timed_mode`` (wall
    time each, printed as they finish: a time-boxed run still says how far it got), then
    ``phase_iters`` forwards in events mode for the phase report.  Returns (timed ms samples,
    GEMM flops per timed forward, the report's rows; [] without phase forwards); profiling is
    left in ``timed_mode``.  ``phase_clock``: the events mode's time source (tests pass
    profiling.FakeClock; None: CUDA events).  ``probes``: a list that receives host_probe_ms()
    taken right before each timed forward (outside its timing; printed beside it)."""
    from memra_dsv4.profiling import build_report, phase_collect, phase_reset, prof_configure
    prof_configure(timed_mode)
    for i in range(warmup):
        t0 = time.perf_counter()
        m.forward(ids)
        print(f"{label}: warm-up forward {i}: {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
    for g in m.gemm.values():
        g.flops = 0
    samples = []
    for _ in range(iters):
        probe = host_probe_ms()
        if probes is not None:
            probes.append(probe)
        t0 = time.perf_counter()
        m.forward(ids)
        samples.append((time.perf_counter() - t0) * 1e3)
        print(f"{label}: forward {len(samples)}: {samples[-1]:.0f} ms (host probe {probe:.2f} ms)", flush=True)
    flops = sum(g.flops for g in m.gemm.values()) / iters
    rows = []
    if phase_iters:
        prof_configure("events", clock=phase_clock)
        try:
            phase_reset()
            for _ in range(phase_iters):
                m.forward(ids)
            rows = build_report(phase_collect(), 0.0, phase_iters)
        finally:
            prof_configure(timed_mode)
    return samples, flops, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:flash")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--phase-iters", type=int, default=1,
                    help="forwards in events mode after the timed ones, for the phase report "
                         "(0: none)")
    ap.add_argument("--arms", default="",
                    help="comma list of arms, each '+'-joined settings moe=fp4mma|blaslt, "
                         "pipeline=off|on|coop, attn=mma|simt, dispatch=host|device (the seams "
                         "MEMRA_DSV4_PREFILL_MOE / _PIPELINE / _ATTN / _DISPATCH), chunks=2|3|4|5|6|8 "
                         "(gpu.pipeline.N_CHUNKS of pipeline=on|coop); every token "
                         "count runs every arm; empty: the model's settings")
    a = ap.parse_args(argv)
    parse_arms(a.arms)  # refuse a bad arm before loading anything
    if a.iters < 1 or a.warmup < 0 or a.phase_iters < 0:
        raise SystemExit(f"--iters {a.iters} (>= 1), --warmup {a.warmup}, --phase-iters "
                         f"{a.phase_iters} (>= 0)")
    from bench.harness import phase_breakdown, summarize, write_results
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.profiling import prof_configure

    timed_mode = os.environ.get("MEMRA_DSV4_PROF", "").strip().lower() or "off"
    prof_configure(timed_mode)   # validated here, before anything loads

    devices = tuple(int(d) for d in a.devices.split(","))
    if not a.model.startswith("synthetic:"):
        from memra_dsv4.checkpoint import Checkpoint
        m = Dsv4Gpu.load(Checkpoint.open(a.model), devices=devices)
    else:
        m = Dsv4Gpu.synthetic(a.model.split(":", 1)[1], devices=devices, seed=0)
    peak = bf16_peak_tflops(devices[0])
    print(f"bf16 GEMM peak (cuBLASLt 8192^3): {peak:.0f} TFLOP/s")
    rng = np.random.default_rng(0)
    arm_list = parse_arms(a.arms)
    from memra_dsv4.gpu import pipeline as PL
    base = {"moe": m.prefill_moe, "pipeline": m.prefill_pipeline, "attn": m.prefill_attn,
            "dispatch": m.prefill_dispatch, "chunks": str(PL.N_CHUNKS)}
    arms = {}
    for T, (label, arm) in [(int(t), la) for t in a.tokens.split(",") for la in arm_list]:
        ids = rng.integers(0, m.config.vocab_size, T)
        s = dict(base, **arm)
        m.prefill_moe, m.prefill_pipeline, m.prefill_attn = s["moe"], s["pipeline"], s["attn"]
        m.prefill_dispatch = s["dispatch"]
        PL.N_CHUNKS = int(s["chunks"])   # read by gpu.pipeline.pipeline_chunks at each forward
        T_label = f"T={T}" + (f" {label}" if label else "")
        print(f"== {T_label}: moe={s['moe']} pipeline={s['pipeline']} attn={s['attn']} "
              f"dispatch={s['dispatch']} chunks={s['chunks']}", flush=True)
        probes: list = []
        samples, flops, rows = time_forwards(m, ids, T_label, a.iters, a.warmup, a.phase_iters,
                                             timed_mode, probes=probes)
        med = float(np.median(samples))
        tflops = flops / (med * 1e-3) / 1e12
        print(f"{T_label}: median {med:.1f} ms, {T / med * 1e3:.0f} tok/s, GEMM {tflops:.1f} TFLOP/s "
              f"({100 * tflops / peak:.1f}% of peak)")
        arms[T_label] = {"settings": {"tokens": str(T), **s, "timed_profiling": timed_mode},
                          "summary": summarize(samples, tokens_per_step=T),
                          "phases_us": phase_breakdown(rows, depth=0),
                          "tokens_per_s": T / med * 1e3, "gemm_tflops": tflops,
                          "gemm_flops": flops, "peak_bf16_tflops": peak,
                          "host_probe_ms": probes}
        for r in rows:
            if r.depth <= 3:
                print(f"  {'  ' * r.depth}{r.label:28s} {r.per_step_us / 1e3:9.2f} ms/step "
                      f"{100 * r.share:5.1f}%")
    js, png = write_results({"config": {"model": a.model, "devices": list(devices),
                                        "iters": a.iters, "warmup": a.warmup,
                                        "phase_iters": a.phase_iters,
                                        "timed_profiling": timed_mode},
                             "arms": arms})
    print(f"results: {js} {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
