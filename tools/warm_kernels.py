"""Fill the CuPy kernel cache for every registered kernels_cu module, compiling modules in
parallel processes (one per module), so later processes load cubins instead of compiling
(a fresh GPU machine otherwise spends ~90 s in the first process that loads the kernels).

    python tools/warm_kernels.py [--jobs 13] [--variants]   # honours MEMRA_DSV4_DEVICE_TRACE

Every module under memra_dsv4.gpu (and .ops) is imported so its register() calls run, then each
stem compiles in a worker on device 0; the parent then loads every stem on every device (cache
hits) and prints the milliseconds per device.

``--variants`` also builds, in the same pool, the experts.cu variants (``ops.experts.
variant_kernels``: experts.cu with extra -D tuning macros) that tests/gpu/test_kernels_experts.py
compares the default build against (EXPERT_TEST_VARIANTS; tests/test_warm_kernels_cpu.py keeps
the list complete).  Each is a whole experts.cu build (~60-90 s of NVRTC); cold, they are what
pushed the suite past its time box (the nineteenth session's third call, whose warm step was cut
before it had built them).  The builds land in the CuPy kernel cache (CUPY_CACHE_DIR), so the
test processes that follow load them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# experts.cu -D builds that tests/gpu/test_kernels_experts.py compares against (its dict literals;
# FP4_DN_PRELOAD's levels are a loop variable there, so listed here by hand)
EXPERT_TEST_VARIANTS: tuple[dict, ...] = (
    {"FP4_ALU_ODD": 0},
    {"FP4_ALU_EVEN": 1},
    {"FP4_PRMT": 0},
    {"FP4_XRED": 0, "FP4_E8M0_FMA": 0, "FP4_E4M3_CVT": 0},
    {"FP4_DN_R": 4, "FP4_DN_DEPTH": 2},
    {"FP4_GU_R": 1, "FP4_DEPTH": 4},
    {"FP4_MMA_PLACE": 1},
    {"FP4_MMA_PLACE": 1, "FP4_MMA_PRMT": 1},
    {"FP4_DN_PRELOAD": 0},
    {"FP4_DN_PRELOAD": 1},
    {"FP4_DN_PRELOAD": 2},
)


def _register_all() -> list[str]:
    import memra_dsv4.gpu as G
    import memra_dsv4.gpu.ops as OPS
    for pkg in (G, OPS):
        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")
    from memra_dsv4.gpu import kernel_loader
    return sorted(kernel_loader.registered())


def _compile(stem: str) -> tuple[str, float]:
    _register_all()
    from memra_dsv4.gpu import kernel_loader
    t0 = time.perf_counter()
    kernel_loader.get_loader(0).warm_all([stem])
    return stem, time.perf_counter() - t0


def _compile_variant(defines: dict) -> tuple[str, float]:
    from memra_dsv4.gpu.ops import experts as EX
    t0 = time.perf_counter()
    EX.variant_kernels(defines)
    return "experts " + " ".join(f"{k}={v}" for k, v in sorted(defines.items())), time.perf_counter() - t0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=13)
    ap.add_argument("--variants", action="store_true",
                    help="also build the experts.cu variants the GPU tests compare against")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    stems = _register_all()
    t0 = time.perf_counter()
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=mp.get_context("spawn")) as ex:
        # the variants first: each is a whole experts.cu build, the longest jobs of the pool
        jobs = ([ex.submit(_compile_variant, d) for d in EXPERT_TEST_VARIANTS] if a.variants else [])
        jobs += [ex.submit(_compile, stem) for stem in stems]
        for job in jobs:
            what, s = job.result()
            print(f"  {what}: {s:.1f} s", flush=True)
    n_var = len(EXPERT_TEST_VARIANTS) if a.variants else 0
    print(f"compiled {len(stems)} modules and {n_var} variants in {time.perf_counter() - t0:.1f} s")
    import cupy
    from memra_dsv4.gpu import kernel_loader
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        ms = kernel_loader.get_loader(d).warm_all()
        print(f"device {d}: {len(ms)} modules loaded in {sum(ms.values()) / 1e3:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
