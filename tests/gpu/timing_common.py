"""Shared helpers of the tests/gpu/timing_*.py scripts (run as scripts on a GPU, not collected).

``bits(a)``: float data -> bf16 bits (truncation: any bits will do for timing) on the device.
``us_per_call(fn, pdl=False)``: fn run once (loads its kernels), then captured REPS times back to
back into one CUDA graph (with programmatic-dependent-launch edges when ``pdl``), the graph replayed
once, then ITERS more times between two events; microseconds per call (graph time / REPS).
"""
from __future__ import annotations

import contextlib

import cupy as cp
import numpy as np

from memra_dsv4.gpu import graphs
from memra_dsv4.gpu.pdl import pdl_launches

REPS, ITERS = 50, 20


def bits(a):
    return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def us_per_call(fn, pdl: bool = False) -> float:
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
    s.synchronize()
    with pdl_launches(True) if pdl else contextlib.nullcontext():
        g = graphs.capture(s, lambda: [fn() for _ in range(REPS)])
    graphs.replay(g, s)
    s.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(s)
    for _ in range(ITERS):
        graphs.replay(g, s)
    b.record(s)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3 / (ITERS * REPS)
