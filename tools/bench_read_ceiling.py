"""The read-bandwidth ceiling of one kernel launch at decode-GEMV sizes, one GPU.

    python tools/bench_read_ceiling.py [--device 0] [--reps 20] [--mb 64,32,16]

Why: the dense bf16 GEMVs of the decode step (wq_b / wo_a / wo_b, 64 MB each) run at ~17.4 µs,
~91 % of the device-to-device copy bandwidth (docs/decode_perf.md).  Whether anything is left
there depends on what a kernel that does nothing but read can reach at the same size, in the
same timing harness: a graph of back-to-back copies, each followed by a 256 MB memset that evicts
L2 (profiling.launches.time_launches, as tools/bench_gemv.py), so ramp-up, tail and the graph's
inter-node gap are in the number as they are in the step.

The kernels (inline source below, NVRTC through CuPy): every thread streams 16-byte words
``p[i + u * stride]`` (grid-stride, U loads in flight per thread before any use) and XORs them
into one word; the XOR of the whole buffer is reduced per warp and folded into ``out`` with one
atomicXor per warp, and the tool checks it against NumPy's XOR of the same words before timing
(so every byte was read: the loads cannot be optimised away and the ceiling is honest).  Variants:
U in {2, 4, 8, 16}, CTAs of 256 threads at 1 / 2 / 4 / 8 per SM, plain ``ld.global.nc``
(``__ldg``) or ``ld.global.nc.L1::no_allocate`` (common.cuh's streaming load).  Prints µs, GB/s
and the fraction of the copy bandwidth measured in the same run, per size, best variant marked.
``span_u{4,8,16}``: the dense GEMV's access pattern instead (each warp one contiguous span of
2 / 4 / 8 KB at a time, spans grid-strided over the warps; sizes that are a multiple of the span).
"""
from __future__ import annotations

import argparse

import numpy as np

_SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld_plain(const uint4* p) { return __ldg(p); }
__device__ __forceinline__ uint4 ld_once(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// the warp's XOR of acc folded into *out (one atomic per warp)
__device__ __forceinline__ void fold_xor(u32 acc, u32* out) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicXor(out, acc);
}
#define READ_KERNEL(NAME, U, LD)                                                              \
extern "C" __global__ void __launch_bounds__(256) NAME(const uint4* __restrict__ p, long long n, \
                                                       u32* __restrict__ out) {               \
    const long long stride = (long long)gridDim.x * blockDim.x;                              \
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                          \
    u32 acc = 0u;                                                                            \
    for (; i + (U - 1) * stride < n; i += U * stride) {                                      \
        uint4 v[U];                                                                          \
        _Pragma("unroll") for (int u = 0; u < U; ++u) v[u] = LD(p + i + u * stride);         \
        _Pragma("unroll") for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w; \
    }                                                                                        \
    for (; i < n; i += stride) {                                                             \
        const uint4 v = LD(p + i);                                                           \
        acc ^= v.x ^ v.y ^ v.z ^ v.w;                                                        \
    }                                                                                        \
    fold_xor(acc, out);                                                                      \
}
// The GEMV's pattern: warp w reads spans of U * 512 contiguous bytes (lane l: words l + 32 u, all
// U loads in flight), spans w, w + nwarps, ... (the dense GEMV's warp reads R rows of K bf16 =
// R * 2K bytes at a time: 4 KB for wq_b at R = 2).
#define SPAN_KERNEL(NAME, U, LD)                                                              \
extern "C" __global__ void __launch_bounds__(256) NAME(const uint4* __restrict__ p, long long n, \
                                                       u32* __restrict__ out) {               \
    const int lane = threadIdx.x & 31;                                                       \
    const long long nw = (long long)gridDim.x * (blockDim.x >> 5);                           \
    const long long nspan = n / (32 * U);                                                    \
    u32 acc = 0u;                                                                            \
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < nspan; w += nw) { \
        const uint4* q = p + w * (32 * U) + lane;                                            \
        uint4 v[U];                                                                          \
        _Pragma("unroll") for (int u = 0; u < U; ++u) v[u] = LD(q + 32 * u);                 \
        _Pragma("unroll") for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w; \
    }                                                                                        \
    fold_xor(acc, out);                                                                      \
}
SPAN_KERNEL(span_u4, 4, ld_once)
SPAN_KERNEL(span_u8, 8, ld_once)
SPAN_KERNEL(span_u16, 16, ld_once)
READ_KERNEL(read_u2, 2, ld_plain)
READ_KERNEL(read_u4, 4, ld_plain)
READ_KERNEL(read_u8, 8, ld_plain)
READ_KERNEL(read_u16, 16, ld_plain)
READ_KERNEL(read_once_u2, 2, ld_once)
READ_KERNEL(read_once_u4, 4, ld_once)
READ_KERNEL(read_once_u8, 8, ld_once)
READ_KERNEL(read_once_u16, 16, ld_once)
"""
KERNELS = ("read_u2", "read_u4", "read_u8", "read_u16",
           "read_once_u2", "read_once_u4", "read_once_u8", "read_once_u16",
           "span_u4", "span_u8", "span_u16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--mb", default="64,32,16", help="buffer sizes in MiB (comma list)")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.mb.split(",")]
    if any(s <= 0 for s in sizes):
        raise SystemExit(f"--mb: sizes must be positive, got {a.mb}")

    import cupy as cp

    from bench.harness import measure_copy_bandwidth
    from memra_dsv4.profiling.launches import Launch, time_launches

    cp.cuda.Device(a.device).use()
    sms = cp.cuda.Device(a.device).attributes["MultiProcessorCount"]
    bw = measure_copy_bandwidth(a.device)["copy_bw_Bps"]
    print(f"device {a.device}: {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    mod = cp.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=KERNELS)
    fns = {k: mod.get_function(k) for k in KERNELS}
    out = cp.zeros(1, cp.uint32)
    rng = np.random.default_rng(0)
    print(f"{'MiB':>4s} {'kernel':<14s} {'CTAs/SM':>7s} {'us':>8s} {'GB/s':>7s} {'of copy bw':>10s}")
    for mb in sizes:
        nbytes = mb << 20
        host = rng.integers(0, 2**32, nbytes // 4, dtype=np.uint32)
        buf = cp.asarray(host)
        want = int(np.bitwise_xor.reduce(host))
        n16 = nbytes // 16
        rows = []
        for k in KERNELS:
            for per_sm in (1, 2, 4, 8):
                grid = (sms * per_sm,)
                args = (buf, np.int64(n16), out)
                out.fill(0)
                fns[k](grid, (256,), args)
                got = int(out.get()[0])
                if got != want:
                    print(f"!!! {k} x{per_sm}: XOR {got:#010x} != NumPy's {want:#010x} (not every word read)")
                    return 1
                ln = Launch(k, grid, (256,), a.device, "bench_read_ceiling", fns[k], args, {})
                us = time_launches([ln], reps=a.reps, flush_bytes=256 << 20)[0]
                rows.append((us, k, per_sm))
        best = min(rows)
        for us, k, per_sm in rows:
            mark = "  <- best" if (us, k, per_sm) == best else ""
            print(f"{mb:4d} {k:<14s} {per_sm:7d} {us:8.2f} {nbytes / us / 1e3:7.0f} "
                  f"{100 * nbytes / (us * 1e-6) / bw:9.1f}%{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
