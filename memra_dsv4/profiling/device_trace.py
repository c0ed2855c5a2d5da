"""Device timeline of a graph-replayed step: when each launch's CTAs started, waited and ended.

The launch profile (profiling.launches) times each launch ALONE; inside the step the same
kernels overlap (graph branches, PDL), find other things in L2, and pay dependency edges that
no per-launch number shows.  This module reads the step's own timeline from the GPU:

* The trace build.  With ``MEMRA_DSV4_DEVICE_TRACE=on`` (seams.SEAM_DEVICE_TRACE, read when a
  KernelLoader is made and printed) every kernels_cu module is compiled with
  ``-DMEMRA_TRACE -DMEMRA_TRACE_MODULE=<i>`` (i = module_index(stem)).  common.cuh's PDL_ENTRY()
  then has every CTA append one record to the module's ``memra_trace_rec``:
  %gridid, (module, __LINE__ of the PDL_ENTRY, linear CTA id), and three %globaltimer stamps:
  CTA start (before griddepcontrol.wait, and before the pre-wait statement of
  PDL_ENTRY_PRELOAD / _PREFETCH kernels, so their preloads count as busy time), wait return, the
  exit of the CTA's last thread (a shared count of exited threads; a last-CTA kernel's tail warps
  are inside its time).  The build is a
  different binary (its own cache entries): read its step time next to an untraced run's.
* ``reset(devices)`` zeroes every built module's record counter; run ONE step (a graph replay);
  ``collect(devices)`` returns the CTA records; ``launches(records)`` folds them per %gridid
  into Launch rows (first start, first wait return, last exit, CTA count, kernel name from the
  source line: ``kernel_at``); ``critical_chain(launches)`` walks back from the last exit
  through, at each launch, the launch that ended last before its first wait returned (the
  dependency that released it), and splits the chain into kernel time and edge time
  (wait return - the releasing launch's end).  Times are per device: %globaltimer of two GPUs
  are not one clock, so each device's launches are analysed on their own.
* Caveats (printed with the report): the records cost one atomic and one barrier per CTA
  (before the wait) and a shared atomic per exiting warp; a few kernels spill a few bytes in
  this build (gemv_fp8_r8, compressor pool); 32 bytes of static shared memory per CTA less for
  dynamic shared memory; the %globaltimer resolution is the GPU's
  (``resolution_ns`` reports the smallest nonzero step seen).

No CuPy import at module import; the CPU half (names, folding, the chain) is tested without a GPU.
"""

from __future__ import annotations

import glob
import os
import re
import statistics
from dataclasses import dataclass, field

__all__ = ["CtaRecord", "Launch", "module_stems", "module_index", "kernel_at", "reset", "collect",
           "decode_records", "launches", "critical_chain", "summarize", "format_summary",
           "set_delay", "kernel_sites", "RECORD_WORDS", "CAPACITY"]

RECORD_WORDS = 4          # u64 words per record (common.cuh)
CAPACITY = 1 << 19        # records per module (common.cuh MEMRA_TRACE_CAP)


@dataclass(frozen=True)
class CtaRecord:
    device: int
    stem: str
    line: int
    grid: int       # %gridid
    cta: int
    start: int      # ns, before the wait
    go: int         # ns, wait returned
    end: int        # ns, the CTA's last thread left


@dataclass
class Launch:
    device: int
    kernel: str     # "stem.name"
    grid: int
    ctas: int
    start: int      # first CTA start
    go: int         # first wait return
    end: int        # last CTA exit
    go_last: int    # last wait return (the CTAs that became resident late)

    @property
    def busy(self) -> int:
        return self.end - self.go


def module_stems(kernels_dir: str) -> list[str]:
    """The .cu stems of kernels_dir in the order that numbers them (sorted)."""
    return sorted(os.path.splitext(os.path.basename(p))[0]
                  for p in glob.glob(os.path.join(kernels_dir, "*.cu")))


def module_index(stem: str, kernels_dir: str) -> int:
    stems = module_stems(kernels_dir)
    if stem not in stems:
        raise KeyError(f"device_trace: no kernels_cu module {stem!r} in {kernels_dir}")
    return stems.index(stem)


_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_INVOKE = re.compile(r"^\s*([A-Z][A-Z0-9_]*)\s*\(\s*(\w+)")
_NAMES: dict[tuple[str, str], dict[int, str]] = {}


def _line_names(kernels_dir: str, stem: str) -> dict[int, str]:
    """line -> kernel name for every line a PDL_ENTRY's __LINE__ can take in <stem>.cu: inside
    a plain kernel, the kernel's name; a macro-generated kernel expands __LINE__ to the line of
    the macro's invocation, whose first argument is the kernel's name."""
    key = (kernels_dir, stem)
    if key in _NAMES:
        return _NAMES[key]
    with open(os.path.join(kernels_dir, f"{stem}.cu"), encoding="utf-8") as fh:
        text = fh.read()
    lines = text.split("\n")
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln) + 1)
    macros: set[str] = set()    # macros whose body defines a __global__
    names: dict[int, str] = {}
    current, defining = None, None
    for n, ln in enumerate(lines, start=1):
        if defining is not None:            # a continuation line of a #define
            if "__global__" in ln:
                macros.add(defining)
            defining = defining if ln.endswith("\\") else None
            continue
        m = re.match(r"\s*#\s*define\s+(\w+)", ln)
        if m:
            if "__global__" in ln:
                macros.add(m.group(1))
            defining = m.group(1) if ln.endswith("\\") else None
            continue
        m = _INVOKE.match(ln)
        if m and m.group(1) in macros:
            names[n] = m.group(2)
            continue
        if "__global__" in ln:
            g = _GLOBAL.search(text, starts[n - 1])
            if g:
                current = g.group(1)
        if current is not None:
            names[n] = current
    _NAMES[key] = names
    return names


def kernel_at(stem: str, line: int, kernels_dir: str) -> str:
    """"stem.kernel" for a record's (module, line); "stem:line" when the line is not in a kernel."""
    name = _line_names(kernels_dir, stem).get(int(line))
    return f"{stem}.{name}" if name else f"{stem}:{line}"


def _loader_modules(devices=None, loaders=None):
    """(device, stem, module, kernels_dir) of every built module of the process-wide loaders of
    ``devices`` (or of the given KernelLoader objects)."""
    if loaders is None:
        from memra_dsv4.gpu import kernel_loader
        loaders = [kernel_loader.get_loader(int(d)) for d in devices]
    for loader in loaders:
        if not loader.trace:
            raise RuntimeError(
                f"device_trace: device {loader.device_id}'s kernels are not the trace build; set "
                f"MEMRA_DSV4_DEVICE_TRACE=on before the first kernel loads (seams.SEAM_DEVICE_TRACE)")
        for stem, (_, module) in sorted(loader._modules.items()):
            yield loader.device_id, stem, module, loader.kernels_dir


def _global(module, name, dtype, count):
    import cupy as cp
    return cp.ndarray((count,), dtype=dtype, memptr=module.get_global(name))  # a MemoryPointer


def reset(devices=None, loaders=None) -> None:
    """Zero the record counter of every built module on ``devices`` (synchronous)."""
    mods = list(_loader_modules(devices, loaders))   # refuses an untraced build before CuPy
    import cupy as cp
    import numpy as np
    for d, stem, module, _ in mods:
        with cp.cuda.Device(d):
            _global(module, "memra_trace_n", np.uint32, 1).fill(0)
            cp.cuda.Device(d).synchronize()


def set_delay(target, ns: int, devices=None, loaders=None) -> None:
    """Hold every launch of one kernel of the trace build ``ns`` from the first wait return of
    its CTAs (common.cuh memra_trace_delay / memra_trace_deadline; profiling.delay_probe): every
    CTA resident before that deadline waits for it.  ``target`` = (stem, line), the module
    and the __LINE__ of the kernel's PDL_ENTRY as its trace records carry them; None (or ns 0):
    no kernel waits.  Written into every built module of ``devices`` (the others get {0, 0}), so
    the graphs already captured follow it at their next replay.  Synchronous."""
    ns = int(ns)
    if not 0 <= ns < 1 << 32:
        raise ValueError(f"device_trace.set_delay: ns = {ns} outside 0 .. 2^32-1")
    if target is not None:
        stem, line = target
        if not isinstance(stem, str) or int(line) <= 0:
            raise ValueError(f"device_trace.set_delay: target {target!r} is not (stem, line > 0)")
    mods = list(_loader_modules(devices, loaders))   # refuses an untraced build before CuPy
    if target is not None and ns and not any(stem == target[0] for _, stem, _, _ in mods):
        raise KeyError(f"device_trace.set_delay: no built module {target[0]!r}")
    import cupy as cp
    import numpy as np
    for d, stem, module, _ in mods:
        on = target is not None and ns and stem == target[0]
        with cp.cuda.Device(d):
            cp.cuda.Device(d).synchronize()   # no replay in flight reads the old value
            _global(module, "memra_trace_delay", np.uint32, 2).set(
                np.array([int(target[1]), ns] if on else [0, 0], dtype=np.uint32))
            cp.cuda.Device(d).synchronize()


def kernel_sites(records, kernels_dir: str | None = None) -> list[dict]:
    """The distinct kernels of ``records`` as delay-probe targets: {"stem", "line", "kernel",
    "launches"} (launches = distinct %gridid per device summed), ordered by first appearance;
    one (stem, line) can name several kernels only when they share a PDL_ENTRY line."""
    from memra_dsv4.gpu.kernel_loader import KERNELS_DIR
    seen: dict[tuple[str, int], dict] = {}
    grids: dict[tuple[str, int], set] = {}
    for r in sorted(records, key=lambda r: r.start):
        key = (r.stem, int(r.line))
        if key not in seen:
            seen[key] = {"stem": r.stem, "line": int(r.line), "kernel": None, "launches": 0}
            grids[key] = set()
        grids[key].add((r.device, r.grid))
    for key, row in seen.items():
        row["launches"] = len(grids[key])
        row["kernel"] = kernel_at(key[0], key[1], kernels_dir or KERNELS_DIR)
    return list(seen.values())


def decode_records(device: int, stems_by_index: list[str], words, kernels_dir: str,
                   expect_stem: str | None = None) -> list[CtaRecord]:
    """CtaRecords from one module's raw u64 words ([n, 4])."""
    out = []
    for w0, w1, w2, w3 in (words.tolist() if hasattr(words, "tolist") else words):
        mod, line, cta = w1 >> 56, (w1 >> 32) & 0xFFFFFF, w1 & 0xFFFFFFFF
        stem = stems_by_index[mod] if mod < len(stems_by_index) else f"module{mod}"
        if expect_stem is not None and stem != expect_stem:
            raise ValueError(f"device_trace: a record of module {expect_stem!r} names module "
                             f"{mod} ({stem!r}): the build's MEMRA_TRACE_MODULE numbering is stale")
        go = w2 + (w3 >> 32)
        out.append(CtaRecord(device, stem, line, w0, cta, w2, go, go + (w3 & 0xFFFFFFFF)))
    return out


def collect(devices=None, loaders=None) -> list[CtaRecord]:
    """Every CTA record written since reset(), on ``devices`` (synchronises them)."""
    mods = list(_loader_modules(devices, loaders))
    import cupy as cp
    import numpy as np
    recs = []
    for d, stem, module, kdir in mods:
        with cp.cuda.Device(d):
            cp.cuda.Device(d).synchronize()
            n = int(_global(module, "memra_trace_n", np.uint32, 1).get()[0])
            if n > CAPACITY:
                raise RuntimeError(f"device_trace: {stem}.cu on device {d} wrote {n} records, "
                                   f"more than its {CAPACITY}: trace fewer steps per collect")
            if n == 0:
                continue
            words = _global(module, "memra_trace_rec", np.uint64, RECORD_WORDS * CAPACITY)
            raw = words[: RECORD_WORDS * n].get().reshape(n, RECORD_WORDS)
        recs.extend(decode_records(d, module_stems(kdir), raw, kdir, expect_stem=stem))
    return recs


def launches(records, kernels_dir: str | None = None) -> list[Launch]:
    """Records folded per (device, %gridid), sorted by (device, first wait return)."""
    from memra_dsv4.gpu.kernel_loader import KERNELS_DIR
    kdir = kernels_dir or KERNELS_DIR
    by: dict[tuple[int, int], list[CtaRecord]] = {}
    for r in records:
        by.setdefault((r.device, r.grid), []).append(r)
    out = []
    for (dev, grid), rs in by.items():
        r0 = rs[0]
        out.append(Launch(dev, kernel_at(r0.stem, r0.line, kdir), grid, len(rs),
                          min(r.start for r in rs), min(r.go for r in rs), max(r.end for r in rs),
                          max(r.go for r in rs)))
    out.sort(key=lambda L: (L.device, L.go, L.end))
    return out


@dataclass
class Chain:
    device: int
    links: list = field(default_factory=list)   # (launch, edge_ns): edge = go - releaser's end
    span: int = 0                               # first start .. last end of the device

    @property
    def busy_ns(self) -> int:
        return sum(L.busy for L, _ in self.links)

    @property
    def edge_ns(self) -> int:
        return sum(e for _, e in self.links)


def critical_chain(device_launches: list[Launch], slack_ns: int = 0) -> Chain:
    """The chain of one device's launches that ends last: from the launch with the latest end,
    repeatedly step to the launch with the latest end <= this launch's first wait return
    (+ slack_ns): the completion that released it.  Launches before the first one have edge 0."""
    ls = sorted(device_launches, key=lambda L: L.end)
    if not ls:
        return Chain(device=-1)
    chain = Chain(device=ls[0].device, span=max(L.end for L in ls) - min(L.start for L in ls))
    ends = [L.end for L in ls]
    import bisect
    cur = ls[-1]
    seen = set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        k = bisect.bisect_right(ends, cur.go + slack_ns) - 1
        prev = None
        while k >= 0:
            if ls[k] is not cur and id(ls[k]) not in seen:
                prev = ls[k]
                break
            k -= 1
        chain.links.append((cur, max(0, cur.go - prev.end) if prev is not None else 0))
        cur = prev
    chain.links.reverse()
    return chain


def summarize(all_launches: list[Launch]) -> dict:
    """Per device: span, the critical chain's kernel / edge time and its per-kernel sums, and
    per-kernel in-step busy times (all launches); JSON-ready."""
    out = {}
    devs = sorted({L.device for L in all_launches})
    for d in devs:
        ls = [L for L in all_launches if L.device == d]
        ch = critical_chain(ls)
        per_kernel: dict[str, list[int]] = {}
        for L in ls:
            per_kernel.setdefault(L.kernel, []).append(L.busy)
        chain_k: dict[str, list[int]] = {}
        for L, e in ch.links:
            row = chain_k.setdefault(L.kernel, [0, 0, 0])
            row[0] += 1
            row[1] += L.busy
            row[2] += e
        steps = sorted({L.go - L.start for L in ls if L.go > L.start})
        out[str(d)] = {
            "launches": len(ls), "span_us": ch.span / 1e3,
            "chain": {"launches": len(ch.links), "busy_us": ch.busy_ns / 1e3,
                      "edge_us": ch.edge_ns / 1e3,
                      "by_kernel": {k: {"n": v[0], "busy_us": v[1] / 1e3, "edge_us": v[2] / 1e3}
                                    for k, v in sorted(chain_k.items(), key=lambda kv: -kv[1][1])}},
            "kernels": {k: {"n": len(v), "busy_us_total": sum(v) / 1e3,
                            "busy_us_median": statistics.median(v) / 1e3}
                        for k, v in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))},
            "resolution_ns": steps[0] if steps else None,
        }
    return out


def format_summary(summ: dict, top: int = 25) -> str:
    lines = []
    for d, s in summ.items():
        c = s["chain"]
        lines.append(f"device {d}: {s['launches']} launches, span {s['span_us']:.1f} us; critical chain "
                     f"{c['launches']} launches: kernels {c['busy_us']:.1f} us + edges {c['edge_us']:.1f} us"
                     f" (globaltimer step seen: {s['resolution_ns']} ns)")
        lines.append(f"  {'on the chain':56s} {'n':>4s} {'kernel us':>10s} {'edge us':>9s}")
        for k, v in list(c["by_kernel"].items())[:top]:
            lines.append(f"  {k:56s} {v['n']:4d} {v['busy_us']:10.1f} {v['edge_us']:9.1f}")
        lines.append(f"  {'every launch (in-step busy: first wait return .. last exit)':56s} {'n':>4s} "
                     f"{'total us':>10s} {'median':>9s}")
        for k, v in list(s["kernels"].items())[:top]:
            lines.append(f"  {k:56s} {v['n']:4d} {v['busy_us_total']:10.1f} {v['busy_us_median']:9.2f}")
    lines.append("caveats: one atomic + one barrier per CTA before the wait; the trace build is its "
                 "own binary (compare its step time with an untraced run)")
    return "\n".join(lines)
