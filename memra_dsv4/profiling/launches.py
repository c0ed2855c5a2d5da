"""Per-launch GPU time of a graph-replayed step, attributed to kernels and to call sites.

A CUDA-graph replay has no phase brackets (events cannot be recorded inside it without
changing it), and eager events-mode steps are inflated by host launch gaps.  This module
answers "where does the graph step's time go" the other way round:

``record_launches(fn, site_files) -> list[Launch]``
    Runs ``fn()`` once (eagerly: its launches really execute) with every RawKernel handed out
    by ``gpu.kernel_loader`` wrapped in a recording proxy.  Each launch keeps its kernel, grid,
    block, argument tuple (the arrays stay referenced, so the pointers stay valid), dynamic
    shared memory, device, and its call site: the innermost frame whose file name ends in one
    of ``site_files`` ("step_device.py:_attention:281").  Launches made outside the loader
    (CuPy elementwise kernels, memcpys) are not seen; ``coverage`` below shows the gap.
``time_launches(launches, reps=20, iters=5) -> list[float]``  (µs per launch)
    Each launch alone, captured as a graph of ``reps`` back-to-back copies on a fresh stream of
    its device, uploaded, replayed once to warm up, then ``iters`` timed replays; the median
    over replays / reps.  The per-copy time therefore includes the graph's inter-node gap, as
    in the real step.  Caveat, stated in the report: repeated copies find their weights in L2
    when they fit (H200 L2 = 50 MB), so small-weight kernels read as faster than in the step;
    ``flush_bytes`` > 0 interleaves a memset of that many bytes between copies and subtracts a
    graph of the memsets alone.
``aggregate(launches, times, key) -> rows``  sum / count / share per kernel or per site.
Launches may mutate state (ring writes, pending rows): run this on a state you discard.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

__all__ = ["Launch", "record_launches", "time_launches", "aggregate", "format_rows"]


@dataclass
class Launch:
    kernel: str
    grid: tuple
    block: tuple
    device: int
    site: str
    fn: object = field(repr=False)
    args: tuple = field(repr=False)
    kwargs: dict = field(repr=False)


class _Proxy:
    """A RawKernel stand-in that records each call, then forwards it."""

    __slots__ = ("_k", "_name", "_dev", "_sink", "_site_files")

    def __init__(self, k, name, dev, sink, site_files):
        object.__setattr__(self, "_k", k)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_dev", dev)
        object.__setattr__(self, "_sink", sink)
        object.__setattr__(self, "_site_files", site_files)

    def __call__(self, grid, block, args, **kwargs):
        f, site = sys._getframe(1), "?"
        while f is not None:
            fn = f.f_code.co_filename
            if fn.endswith(self._site_files):
                site = f"{fn.rsplit('/', 1)[-1]}:{f.f_code.co_name}:{f.f_lineno}"
                break
            f = f.f_back
        g = tuple(grid) if isinstance(grid, tuple) else (int(grid),)
        b = tuple(block) if isinstance(block, tuple) else (int(block),)
        self._sink.append(Launch(self._name, g, b, self._dev, site, self._k, tuple(args),
                                 dict(kwargs)))
        return self._k(grid, block, args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._k, name)

    def __setattr__(self, name, value):
        setattr(self._k, name, value)


def record_launches(fn, site_files=("step_device.py",)) -> list[Launch]:
    from memra_dsv4.gpu import kernel_loader

    sink: list[Launch] = []
    cls = kernel_loader.KernelLoader
    orig = cls.get
    sf = tuple(site_files)

    def get(self, stem, name):
        return _Proxy(orig(self, stem, name), f"{stem}.{name}", self.device_id, sink, sf)

    cls.get = get
    try:
        fn()
    finally:
        cls.get = orig
    return sink


def _graph_of(stream, body, reps):
    from memra_dsv4.gpu import graphs

    def enqueue():
        for _ in range(reps):
            body()
    return graphs.capture(stream, enqueue)


def _time_graph(g, stream, iters) -> float:
    import cupy as cp

    g.launch(stream)
    stream.synchronize()
    out = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        g.launch(stream)
        b.record(stream)
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(out)


def time_launches(launches, reps: int = 20, iters: int = 5, flush_bytes: int = 0) -> list[float]:
    import cupy as cp

    rt = cp.cuda.runtime
    streams, flush, base = {}, {}, {}
    times = []
    for ln in launches:
        with cp.cuda.Device(ln.device):
            s = streams.get(ln.device)
            if s is None:
                s = streams[ln.device] = cp.cuda.Stream(non_blocking=True)
                if flush_bytes:
                    flush[ln.device] = buf = cp.empty((flush_bytes,), dtype=cp.uint8)
                    base[ln.device] = _time_graph(_graph_of(
                        s, lambda b=buf, s=s: rt.memsetAsync(b.data.ptr, 1, b.nbytes, s.ptr), reps),
                        s, iters) / reps
            fb = flush.get(ln.device)

            def body(ln=ln, s=s, fb=fb):
                ln.fn(ln.grid, ln.block, ln.args, **ln.kwargs)
                if fb is not None:
                    rt.memsetAsync(fb.data.ptr, 1, fb.nbytes, s.ptr)
            us = _time_graph(_graph_of(s, body, reps), s, iters) / reps
            times.append(max(us - base.get(ln.device, 0.0), 0.0))
    return times


def aggregate(launches, times, key: str = "kernel") -> list[dict]:
    """Rows {key, count, total_us, mean_us, share} sorted by total, for key in
    'kernel' | 'site' | 'site_kernel'."""
    acc: dict[str, list] = {}
    for ln, t in zip(launches, times):
        k = {"kernel": ln.kernel, "site": ln.site,
             "site_kernel": f"{ln.site} {ln.kernel}"}[key]
        a = acc.setdefault(k, [0, 0.0])
        a[0] += 1
        a[1] += t
    total = sum(times) or 1.0
    rows = [{key: k, "count": c, "total_us": s, "mean_us": s / c, "share": s / total}
            for k, (c, s) in acc.items()]
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def format_rows(rows, key: str, top: int = 40) -> str:
    lines = [f"{key:<60s} {'n':>5s} {'total ms':>9s} {'mean us':>8s} {'share':>6s}"]
    for r in rows[:top]:
        lines.append(f"{str(r[key])[:60]:<60s} {r['count']:5d} {r['total_us'] / 1e3:9.3f} "
                     f"{r['mean_us']:8.2f} {100 * r['share']:5.1f}%")
    return "\n".join(lines)
