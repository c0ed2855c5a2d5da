"""Fill the CuPy kernel cache for every registered kernels_cu module, compiling modules in
parallel processes (one per module), so later processes load cubins instead of compiling
(a fresh GPU machine otherwise spends ~90 s in the first process that loads the kernels).

    python tools/warm_kernels.py [--jobs 13]        # honours MEMRA_DSV4_DEVICE_TRACE (trace build)

Every module under memra_dsv4.gpu (and .ops) is imported so its register() calls run, then each
stem compiles in a worker on device 0; the parent then loads every stem on every device (cache
hits) and prints the milliseconds per device.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=13)
    a = ap.parse_args(argv)
    stems = _register_all()
    t0 = time.perf_counter()
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=mp.get_context("spawn")) as ex:
        for stem, s in ex.map(_compile, stems):
            print(f"  {stem}: {s:.1f} s", flush=True)
    print(f"compiled {len(stems)} modules in {time.perf_counter() - t0:.1f} s")
    import cupy
    from memra_dsv4.gpu import kernel_loader
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        ms = kernel_loader.get_loader(d).warm_all()
        print(f"device {d}: {len(ms)} modules loaded in {sum(ms.values()) / 1e3:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
