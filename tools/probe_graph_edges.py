"""Probe (GPU): how a stream capture records PDL launches and cross-stream joins, and what a
join edge costs against a programmatic edge.

1. Census: a small capture (PDL kernels on a main stream, a fork to a side stream, a join) ->
   every edge's (type, from_port) and every kernel node's programmatic-stream-serialization
   attribute, read back through the driver.
   (Fourteenth session, 2x H200: all 9 edges of the 3-link capture were (type 1 = programmatic,
   from_port 1), the fork and join edges included, so there is nothing to rewrite.)
3. Join cost by which predecessor ends last: a PDL chain of links "fork; side kernel (side
   stream); main kernel; join; next" with the main or the side kernel the long one (2000 or 0
   busy iterations), against the same chain without the fork (side kernel on the main stream).
2. Carveout: a PDL chain alternating a kernel without shared memory and one with 57 KB of
   dynamic shared memory (hc_boundary_pre's size), with MEMRA_DSV4_SMEM_CARVEOUT driver / max,
   against a chain without the shared-memory kernel.
Prints everything; exits non-zero only on an error.
"""
from __future__ import annotations

import collections
import ctypes
import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
from memra_dsv4.gpu import graphs  # noqa: E402
from memra_dsv4.gpu.pdl import PdlKernel, pdl_launches  # noqa: E402


class _EdgeData(ctypes.Structure):   # CUgraphEdgeData (8 bytes)
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]

SRC = r'''
extern "C" __global__ void busy(float* x, int n, int iters) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; for (int k = 0; k < iters; ++k) v = v * 0.999f + 1.0f; x[i] = v; }
}
extern "C" __global__ void smemk(float* x, int n) {
    extern __shared__ float sh[];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    sh[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    if (i < n) x[i] = sh[(threadIdx.x + 1) % blockDim.x] * 0.5f + 1.0f;
}
extern "C" __global__ void side(float* y, const float* x, int j) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0 && blockIdx.x == 0) y[j] = x[0] + (float)j;
}
'''


def census(handle):
    lib = ctypes.CDLL("libcuda.so.1")
    g = ctypes.c_void_p(int(handle))
    n = ctypes.c_size_t(0)
    rc = lib.cuGraphGetEdges_v2(g, None, None, None, ctypes.byref(n))
    print(f"  cuGraphGetEdges_v2 count rc={rc} n={n.value}")
    N = n.value
    src = (ctypes.c_void_p * N)(); dst = (ctypes.c_void_p * N)(); data = (_EdgeData * N)()
    rc = lib.cuGraphGetEdges_v2(g, src, dst, data, ctypes.byref(n))
    print(f"  cuGraphGetEdges_v2 rc={rc}")
    c = collections.Counter((data[i].type, data[i].from_port, data[i].to_port) for i in range(N))
    print(f"  edges by (type, from_port, to_port): {dict(c)}")
    from cuda.bindings import driver as cu
    nodes = set(src[:N]) | set(dst[:N])
    attr = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    kinds = collections.Counter()
    for nd in nodes:
        t = ctypes.c_int(-1)
        lib.cuGraphNodeGetType(ctypes.c_void_p(nd), ctypes.byref(t))
        pss = None
        if t.value == 0:
            try:
                err, val = cu.cuGraphKernelNodeGetAttribute(cu.CUgraphNode(nd), attr)
                pss = (err.name, int(val.programmaticStreamSerializationAllowed))
            except Exception as e:  # noqa: BLE001
                pss = f"{type(e).__name__}: {e}"
        ins = [i for i in range(N) if dst[i] == nd]
        kinds[(t.value, str(pss), len(ins))] += 1
    print(f"  nodes by (type, pss attribute, in-edges): {dict(kinds)}")


def build(n_links, iters, x, y, kb, ks, streams, forks):
    s0, s1 = streams
    for j in range(n_links):
        forks.fork()
        with s1:
            ks((1,), (32,), (y, x, np.int32(j)), stream=s1)
        forks.join()
        kb((132,), (256,), (x, np.int32(x.size), np.int32(iters)), stream=s0)


def main():
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
    kb = PdlKernel(mod.get_function("busy"), "busy")
    ks = PdlKernel(mod.get_function("side"), "side")
    s0 = cp.cuda.Stream(non_blocking=True)
    s1 = cp.cuda.Stream(non_blocking=True)
    fk = graphs.Fork(s0, s1)
    x = cp.zeros(132 * 256, cp.float32)
    y = cp.zeros(4096, cp.float32)
    # 1. census of a 3-link capture
    with cp.cuda.Device(0), s0, pdl_launches(True):
        s0.begin_capture()
        build(3, 10, x, y, kb, ks, (s0, s1), fk)
        h = cp.cuda.runtime.streamEndCapture(s0.ptr)
    print("census (3 links: fork -> side kernel -> join -> busy kernel):")
    census(h)
    cp.cuda.runtime.graphDestroy(h)
    print("join order (a PDL chain of fork / side / main / join links):")
    join_order(mod, s0, s1, fk)
    print("carveout (a PDL chain of pairs):")
    carveout(mod, s0)


def _replay_median_s(g, s0, warm: int = 3, reps: int = 30) -> float:
    """Upload the graph, replay it ``warm`` times, then the median wall time of ``reps`` replays
    (each synchronised), in seconds."""
    g.upload(s0)
    for _ in range(warm):
        g.launch(s0)
    s0.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.launch(s0)
        s0.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def join_order(mod, s0, s1, fk):
    kb = PdlKernel(mod.get_function("busy"), "busy")
    x = cp.zeros(132 * 256, cp.float32)
    y = cp.zeros(132 * 256, cp.float32)
    for form in ("main-long", "side-long", "no-fork"):
        it_main, it_side = (2000, 0) if form != "side-long" else (0, 2000)
        with cp.cuda.Device(0), s0, pdl_launches(True):
            s0.begin_capture()
            for _ in range(100):
                if form == "no-fork":
                    kb((132,), (256,), (y, np.int32(y.size), np.int32(it_side)), stream=s0)
                else:
                    fk.fork()
                    kb((132,), (256,), (y, np.int32(y.size), np.int32(it_side)), stream=s1)
                kb((132,), (256,), (x, np.int32(x.size), np.int32(it_main)), stream=s0)
                if form != "no-fork":
                    fk.join()
            g = s0.end_capture()
        print(f"  {form:<9}: {_replay_median_s(g, s0) / 100 * 1e6:.2f} us per link")


def carveout(mod, s0):
    import os
    kb = PdlKernel(mod.get_function("busy"), "busy")
    km = PdlKernel(mod.get_function("smemk"), "smemk")
    km.max_dynamic_shared_size_bytes = 58 * 1024
    x = cp.zeros(132 * 256, cp.float32)
    for iters in (0, 200, 2000):
        for form in ("busy+busy", "busy+smem"):
            for carve in ("driver", "max", "50", "fit1"):
                if form == "busy+busy" and carve != "driver":
                    continue
                os.environ["MEMRA_DSV4_SMEM_CARVEOUT"] = carve
                x.fill(0)
                with cp.cuda.Device(0), s0, pdl_launches(True):
                    s0.begin_capture()
                    for _ in range(200):
                        kb((132,), (256,), (x, np.int32(x.size), np.int32(iters)), stream=s0)
                        if form == "busy+smem":
                            km((132,), (256,), (x, np.int32(x.size)), shared_mem=57 * 1024, stream=s0)
                        else:
                            kb((132,), (256,), (x, np.int32(x.size), np.int32(0)), stream=s0)
                    g = s0.end_capture()
                print(f"  iters {iters:>4} {form:<10} carveout {carve:<7}: "
                      f"{_replay_median_s(g, s0) / 200 * 1e6:.2f} us per pair; check {float(x[:4].sum())}")
    os.environ.pop("MEMRA_DSV4_SMEM_CARVEOUT", None)


if __name__ == "__main__":
    main()
