"""How much of a timed decode step is host time, not GPU time (device path, graphs).

bench.decode_step times each step as the bench's arm runs it: a CUDA event on the idle compute
stream, then the host uploads token / pos, launches the stage graphs, reads the logits back
(pinned D2H, one host wait), copies them, and the arm takes its argmax on the host; then the end
event.  Everything the host does between the two events while the GPU has nothing queued is in
the step's time.  This tool splits it (one process, one model, the device arm at its defaults,
every sample after a warm-up):

  bench      the bench's sample: CudaEventTimer around the arm's step (decode_step + argmax)
  bench_out  the same with decode_step(out=a preallocated array): no new logits array per step
  token      CudaEventTimer around decode_step(readback="token"): host-fed, the head's greedy
             argmax read back as 4 bytes (no logits D2H, copy or host argmax)
  greedy     CudaEventTimer around decode_greedy(--chunk steps) / chunk: the tokens fed on the
             device, the host's uploads and launches enqueued ahead, one wait per call
  step       CudaEventTimer around decode_step alone (the argmax after the end event)
  replay+d2h N graph replays of the same captured step, each followed by its logits D2H into
             the pinned buffer, queued back to back (one sync at the end), events around / N;
             each replay's last launch (greedy_argmax_f32) advances the position and feeds its
             token to the next, so this is the device feed without decode_greedy's uploads and
             readback
  bench_np_token  bench with the token handed over as a 0-d array (the token checks' NumPy
             route, every token's before Dsv4Gpu._step_token's scalar path): in-process A/B
  replay     the same without the D2H
  launch     host wall time of one replay call (cuGraphLaunch) while the GPU is busy
  split.*    one more run of samples, stamped (medians, ms): host_py_pre (decode_step's call
             to its graph launch), launch_idle (cuGraphLaunch on the idle GPU), host_post_launch
             (launch to the readback's wait: the D2H enqueue), sync_wait, copy_return (the
             wait's return to decode_step's: the logits copy), argmax (the arm's), gpu_pre (GPU
             time from the start event to an event recorded just before the launch: what the
             GPU idles before the graph), gpu_launch_to_end (that event to the end event),
             sample (start to end); pre.* splits host_py_pre at DeviceStep's _prepare,
             _upload and _launch (stamped inside the real sequence, right after a wait)
  host_us.*  the same host pieces alone, each in a loop of --host-loops calls with nothing
             between (warm caches): ids (token checks), prepare, upload, apply (the bench
             arm's own setup, outside every timed sample)

  wake_us.*  (--wake) two fixed host workloads, microseconds: py (tools/host_wake.py's
             pure-Python loop) and ids
             (decode_step's token checks), each timed right after a graph replay's synchronize
             (after_gpu: the host-fed step's situation without its D2H), after time.sleep of the
             same length (after_sleep), after a Python busy loop of that length (after_spin),
             and back to back (warm): whether the post-wait slowness of pre.* is the CUDA wait's,
             any idle wait's, or the code's own

Every sample starts after the arm's setup (its env and model settings), as the bench's do.
--sched sets the CUDA context's host-wait flag before any CUDA work (auto, spin, yield,
blocking); --wait query makes the split's readback wait a Python loop on cudaStreamQuery.

bench - replay is what the host adds to every sample; replay is the GPU's own step.  Prints one table and writes JSON to --json when given.

  python3 tools/host_gap.py --model synthetic:flash-layers:20 --ctx 1024 --steps 300
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


# cudaDeviceSchedule* (cuda_runtime_api.h): how a host thread waits for the device
SCHED_FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}


def _set_sched(name: str, device: int) -> None:
    """cudaSetDeviceFlags(cudaDeviceSchedule<name>) on ``device`` before CuPy touches it."""
    from cuda.bindings import runtime as cudart
    err, = cudart.cudaSetDevice(device)
    err2, = cudart.cudaSetDeviceFlags(SCHED_FLAGS[name])
    err3, flags = cudart.cudaGetDeviceFlags()
    print(f"sched {name}: cudaSetDevice {err}, cudaSetDeviceFlags {err2}, flags now {flags:#x}")


def _median_ms(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:flash-layers:20")
    ap.add_argument("--devices", default="0")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300, help="samples per measure (>= 10)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--expert-storage", default="per-layer", choices=("per-layer", "shared"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--chunk", type=int, default=20, help="greedy: steps per decode_greedy call")
    ap.add_argument("--sched", default="auto", choices=tuple(SCHED_FLAGS),
                    help="the CUDA context's host wait (cudaSetDeviceFlags before any CUDA work): "
                         "auto (the default context's), spin, yield or blocking")
    ap.add_argument("--wait", default="sync", choices=("sync", "query"),
                    help="the split's readback wait: the stream's synchronize (as decode_step) "
                         "or a Python loop on cudaStreamQuery (keeps the interpreter running)")
    ap.add_argument("--host-loops", type=int, default=2000,
                    help="calls per host piece in the host_us.* measures (>= 1)")
    ap.add_argument("--wake", action="store_true",
                    help="also the wake.* measures: two fixed host workloads timed right after a "
                         "graph replay's synchronize, after time.sleep and after a Python busy "
                         "loop of the same length, and warm (see the module doc)")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="then N steps under cProfile; prints the top 30 functions by own time")
    a = ap.parse_args(argv)
    if a.steps < 10:
        raise SystemExit(f"--steps {a.steps}: need >= 10")
    if a.host_loops < 1:
        raise SystemExit(f"--host-loops {a.host_loops}: need >= 1")
    if a.chunk < 1:
        raise SystemExit(f"--chunk {a.chunk}: need >= 1")
    if a.ctx < 1:
        raise SystemExit(f"--ctx {a.ctx}: need >= 1")
    if a.cprofile < 0 or a.warmup < 1:
        raise SystemExit(f"--cprofile {a.cprofile} / --warmup {a.warmup}: need >= 0 / >= 1 "
                         f"(the warm-up captures the graph the replays launch)")
    if "," in a.devices:
        raise SystemExit(f"--devices {a.devices}: one device (the replay measures launch one "
                         f"stage's graph)")

    if a.sched != "auto":
        _set_sched(a.sched, int(a.devices))
    import cupy as cp
    from bench.decode_step import _ArmState, _load
    from bench.harness import CudaEventTimer

    devices = tuple(int(d) for d in a.devices.split(","))
    # room for every step this tool runs at advancing positions; the replays advance the
    # position too (the head's greedy_argmax_f32 ends every step with pos + 1 on the device):
    # 2 measures x reps x 20 of them
    reps, n_rep = max(5, a.steps // 20), 20
    max_seq = (a.ctx + a.warmup + 6 * a.steps + max(10, a.steps // max(a.chunk, 1)) * a.chunk
               + 2 * reps * n_rep + (2 * a.steps if a.wake else 0) + a.cprofile + 16)
    m = _load(a.model, devices, max_seq, None, a.expert_storage)
    ids = np.random.default_rng(0).integers(2, m.config.vocab_size, a.ctx)
    st = _ArmState(m, "device", ids, max_seq)
    for _ in range(a.warmup):
        st.step()
    step_obj = m._step
    gs = step_obj._graphs.get(st.state)
    if gs is None:
        raise SystemExit("no captured graph for the arm's state (is the path 'device'?)")
    if len(step_obj.stages) != 1:
        raise SystemExit("the replay measures need one stage (--devices with one id)")
    S, g = step_obj.stages[0], gs.graphs[0]
    first = m.stages[0].device
    rt = cp.cuda.runtime
    out = {}
    with cp.cuda.Device(first):
        timer = CudaEventTimer(m.devs[first].compute)
        if m.devs[first].compute.ptr != S.stream.ptr:
            raise SystemExit("the step's stream is not the timer's stream")
        def timed(fn):   # the arm's setup untimed, as the bench does (harness.Arm.setup)
            st.apply()
            return timer(fn)
        out["bench"] = _median_ms([timed(st.run) for _ in range(a.steps)])

        out_buf = np.empty(m.config.vocab_size, np.float32)

        def out_step():   # host-fed, the logits into the caller's array (decode_step(out=))
            st.tok = int(np.argmax(m.decode_step(st.state, st.tok, out=out_buf)))
        out["bench_out"] = _median_ms([timed(out_step) for _ in range(a.steps)])

        def np_token_step():   # host-fed as bench, the token handed over as a 0-d array: the
            # checks' NumPy route (np.asarray + check_ids), which every token took before the
            # scalar path of Dsv4Gpu._step_token
            st.tok = int(np.argmax(m.decode_step(st.state, np.asarray(st.tok))))
        out["bench_np_token"] = _median_ms([timed(np_token_step) for _ in range(a.steps)])

        def token_step():   # host-fed, the head's greedy argmax read back as 4 bytes
            st.tok = int(m.decode_step(st.state, st.tok, readback="token"))
        out["token"] = _median_ms([timed(token_step) for _ in range(a.steps)])

        def greedy_chunk():   # fed on the device, one host wait per chunk
            st.tok = int(m.decode_greedy(st.state, st.tok, a.chunk)[-1])
        out["greedy"] = _median_ms([timed(greedy_chunk) / a.chunk
                                    for _ in range(max(10, a.steps // a.chunk))])

        def step_only():
            st.logits = m.decode_step(st.state, st.tok)
        samples = []
        for _ in range(a.steps):
            samples.append(timed(step_only))
            st.tok = int(np.argmax(st.logits))
        out["step"] = _median_ms(samples)

        # the split: host stamps through one sample, and a GPU event recorded just before the
        # graph launch (the captured graph wrapped; the stream's synchronize stamped)
        orig_sync = S.stream.synchronize
        stamps = {}

        def stamped_sync():
            stamps["sync_call"] = time.perf_counter()
            if a.wait == "query":   # the host spins in Python on cudaStreamQuery instead
                while not S.stream.done:
                    pass
            else:
                orig_sync()
            stamps["sync_ret"] = time.perf_counter()

        class _StampedGraph:
            def __init__(self, graph):
                self.graph, self.ev = graph, cp.cuda.Event()

            def launch(self, stream):
                self.ev.record(stream)   # the GPU passes it just before the graph's work
                stamps["launch"] = time.perf_counter()
                self.graph.launch(stream)
                stamps["launched"] = time.perf_counter()

        wrapped = _StampedGraph(g)
        step_obj._graphs[st.state] = gs._replace(graphs=[wrapped])

        def stamped(name, fn):   # an instance attribute over DeviceStep's method, removed after
            def run(*args, **kw):
                stamps[name + "_in"] = time.perf_counter()
                r = fn(*args, **kw)
                stamps[name + "_out"] = time.perf_counter()
                return r
            return run
        pieces = ("_prepare", "_upload", "_launch")
        for name in pieces:
            setattr(step_obj, name, stamped(name, getattr(step_obj, name)))
        split = {k: [] for k in ("host_py_pre", "launch_idle", "host_post_launch", "sync_wait",
                                 "copy_return", "argmax", "gpu_pre", "gpu_launch_to_end", "sample",
                                 "pre.to_prepare", "pre.prepare", "pre.to_upload", "pre.upload",
                                 "pre.to_launch", "pre.launch_to_graph")}
        e_start, e_end = cp.cuda.Event(), cp.cuda.Event()
        try:   # an instance attribute on this Stream object only (cupy's Stream is a Python class)
            S.stream.synchronize = stamped_sync
        except AttributeError:
            print("cannot stamp the stream's synchronize: the host split is skipped")
            split = None
        if split is not None:
            try:
                for _ in range(a.steps):
                    st.apply()
                    e_start.record(S.stream)
                    t0 = time.perf_counter()
                    logits = m.decode_step(st.state, st.tok)
                    t_ret = time.perf_counter()
                    st.tok = int(np.argmax(logits))
                    t_arg = time.perf_counter()
                    e_end.record(S.stream)
                    e_end.synchronize()
                    ms = lambda x, y: (y - x) * 1e3
                    split["host_py_pre"].append(ms(t0, stamps["launch"]))
                    split["launch_idle"].append(ms(stamps["launch"], stamps["launched"]))
                    split["host_post_launch"].append(ms(stamps["launched"], stamps["sync_call"]))
                    split["sync_wait"].append(ms(stamps["sync_call"], stamps["sync_ret"]))
                    split["copy_return"].append(ms(stamps["sync_ret"], t_ret))
                    split["argmax"].append(ms(t_ret, t_arg))
                    split["gpu_pre"].append(cp.cuda.get_elapsed_time(e_start, wrapped.ev))
                    split["gpu_launch_to_end"].append(cp.cuda.get_elapsed_time(wrapped.ev, e_end))
                    split["sample"].append(cp.cuda.get_elapsed_time(e_start, e_end))
                    # where the Python before the launch goes (host_py_pre, in this order)
                    split["pre.to_prepare"].append(ms(t0, stamps["_prepare_in"]))
                    split["pre.prepare"].append(ms(stamps["_prepare_in"], stamps["_prepare_out"]))
                    split["pre.to_upload"].append(ms(stamps["_prepare_out"], stamps["_upload_in"]))
                    split["pre.upload"].append(ms(stamps["_upload_in"], stamps["_upload_out"]))
                    split["pre.to_launch"].append(ms(stamps["_upload_out"], stamps["_launch_in"]))
                    split["pre.launch_to_graph"].append(ms(stamps["_launch_in"], stamps["launch"]))
            finally:
                del S.stream.synchronize
                for name in pieces:
                    delattr(step_obj, name)
                step_obj._graphs[st.state] = gs
            for k, v in split.items():
                out["split." + k] = _median_ms(v)

        # the host-fed step's Python pieces alone, each in a loop of a.host_loops calls with no
        # step between (ids: the token checks; prepare: the forms, tables, graph lookup; upload:
        # the two 4-byte H2D copies per stage, re-uploading the values the next step would;
        # apply: the bench arm's environment), microseconds per call
        from memra_dsv4.oracle.decode import check_room

        def ids_checks():   # decode_step's token and room checks
            return m._step_token(st.state, st.tok, "decode_step"), check_room(st.state, 1, "decode_step")
        parts = {"ids": ids_checks,
                 "prepare": lambda: step_obj._prepare(st.state, True),
                 "upload": lambda: step_obj._upload(st.tok, st.state.pos),
                 "apply": st.apply}
        S.stream.synchronize()
        for k, fn in parts.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(a.host_loops):
                fn()
            out[f"host_us.{k}"] = (time.perf_counter() - t0) / a.host_loops * 1e6
        S.stream.synchronize()

        src = S.v["head.logits"]
        host = step_obj._logits_host
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()

        def replay(n: int, d2h: bool) -> tuple[float, float]:
            launch_wall = []
            S.stream.synchronize()
            e0.record(S.stream)
            for _ in range(n):
                t0 = time.perf_counter()
                g.launch(S.stream)
                launch_wall.append((time.perf_counter() - t0) * 1e3)
                if d2h:
                    rt.memcpyAsync(host.ctypes.data, src.data.ptr, src.nbytes,
                                   rt.memcpyDeviceToHost, S.stream.ptr)
            e1.record(S.stream)
            e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) / n, _median_ms(launch_wall)

        n = n_rep
        rd = [replay(n, True) for _ in range(reps)]
        r = [replay(n, False) for _ in range(reps)]
        out["replay+d2h"] = _median_ms([x[0] for x in rd])
        out["replay"] = _median_ms([x[0] for x in r])
        out["launch"] = _median_ms([x[1] for x in r])

        if a.wake:   # host_wake's workloads, waits and timing loop, plus the GPU's wait
            import host_wake   # tools/ (this script's folder, first on sys.path)
            step_s = out["replay"] * 1e-3

            def after_gpu():     # one replay (the step's GPU time, no D2H), the stream's wait
                g.launch(S.stream)
                S.stream.synchronize()
            host_waits = host_wake.waits(step_s)
            wake = host_wake.measure({"py": host_wake.py_work, "ids": ids_checks},
                                     {"after_gpu": after_gpu, "after_sleep": host_waits["after_sleep"],
                                      "after_spin": host_waits["after_spin_py"]}, a.steps)
            out.update({f"wake_us.{k}": v for k, v in wake.items()})
            S.stream.synchronize()
    out["host_added"] = out["bench"] - out["replay"]
    if a.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.cprofile):
            st.step()
        prof.disable()
        print(f"cProfile of {a.cprofile} arm steps (decode_step + argmax), by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    from bench.harness import host_cpu
    cpu = host_cpu()
    print(f"model {a.model}, ctx {a.ctx}, {a.steps} samples per measure (replays: {reps} x {n}); "
          f"host {cpu}")
    for k in out:
        unit = "us" if k.startswith(("host_us.", "wake_us.")) else "ms"
        print(f"  {k:<24} {out[k]:8.3f} {unit}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "host_cpu": cpu, "ms": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
