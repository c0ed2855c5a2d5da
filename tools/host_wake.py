"""How long fixed host workloads take right after the thread waited (no GPU needed).

    python tools/host_wake.py [--wait-ms 8] [--samples 200]

host_gap's wake_us.* found decode_step's token checks (a few small NumPy operations) ~12x slower
right after any ~8 ms wait (a CUDA synchronize, time.sleep, or a pure-Python busy loop) than back
to back, while a pure-Python loop of the same length was not slower.  This tool separates the
candidates on any machine, GPU or not: the same workloads (py: a pure-Python loop; np_small: the
token checks' NumPy operations on a one-element array; np_vec: one 129280-float argmax, the
size of the head's logits; ids: memra_dsv4's check_token_ids on one id) timed after a wait of
--wait-ms spent in time.sleep, in a pure-Python busy loop, in a busy loop of small NumPy
operations (keeps NumPy's SIMD code running), and back to back (warm).  It prints the CPU model,
its AVX-512 flags and NumPy's dispatched SIMD features (NPY_DISABLE_CPU_FEATURES changes them at
import), then medians in microseconds.  JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402


def cpu_summary() -> dict:
    """The CPU (bench.harness.host_cpu: model and logical CPUs), its avx512 flags in
    /proc/cpuinfo (empty where absent), NumPy's dispatched CPU features."""
    from bench.harness import host_cpu
    flags = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = sorted(x for x in line.split(":", 1)[1].split() if x.startswith("avx512"))
                    break
    except OSError:
        pass
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as feats
    on = sorted(k for k, v in feats.items() if v and (k.startswith("AVX512") or k in ("AVX2", "FMA3")))
    return {"cpu": host_cpu(), "avx512_flags": flags, "numpy_features": on,
            "NPY_DISABLE_CPU_FEATURES": os.environ.get("NPY_DISABLE_CPU_FEATURES", "")}


def py_work() -> int:
    """A fixed pure-Python workload (integer arithmetic and a dict lookup per iteration, a small
    code footprint): the interpreter-only probe here and in host_gap's wake measures."""
    d, acc = {"k": 1}, 0
    for i in range(300):
        acc += (i * 7) % 5 + d["k"]
    return acc


def workloads(vocab: int = 129280) -> dict:
    from memra_dsv4.oracle.model import check_token_ids
    one = np.asarray([5])
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)

    def np_small():   # check_token_ids's operations, inline
        a = np.asarray(one)
        bad = (a < 0) | (a >= vocab)
        return bool(bad.any()) or a.astype(np.int64)

    return {"py": py_work, "np_small": np_small, "np_vec": lambda: int(np.argmax(logits)),
            "ids": lambda: check_token_ids(np.asarray(7).reshape(1), vocab)}


def waits(wait_s: float) -> dict:
    small = np.arange(8, dtype=np.float32)

    def spin_py():
        t_end = time.perf_counter() + wait_s
        while time.perf_counter() < t_end:
            pass

    def spin_np():
        t_end = time.perf_counter() + wait_s
        while time.perf_counter() < t_end:
            np.add(small, small)
    return {"after_sleep": lambda: time.sleep(wait_s), "after_spin_py": spin_py,
            "after_spin_np": spin_np}


def measure(work: dict, wait: dict, samples: int) -> dict:
    """"<workload>.<wait>" -> median microseconds of the workload right after that wait, and
    "<workload>.warm" back to back (no wait before it)."""
    out = {}
    for wk, fn in work.items():
        fn()
        for bk, w in {**wait, "warm": None}.items():
            xs = []
            for _ in range(samples):
                if w is not None:
                    w()
                t0 = time.perf_counter()
                fn()
                xs.append((time.perf_counter() - t0) * 1e6)
            out[f"{wk}.{bk}"] = float(np.median(xs))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wait-ms", type=float, default=8.0)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not a.wait_ms > 0 or a.samples < 1:
        raise SystemExit(f"--wait-ms {a.wait_ms} / --samples {a.samples}: need > 0 / >= 1")
    info = cpu_summary()
    for k, v in info.items():
        print(f"{k}: {v}")
    res = measure(workloads(), waits(a.wait_ms * 1e-3), a.samples)
    print(f"median us, {a.samples} samples, waits of {a.wait_ms} ms")
    for k, v in res.items():
        print(f"  {k:<24} {v:9.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "info": info, "us": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
