"""Probe (GPU): does a one-wave kernel with shared memory slow the streaming kernel after it, under
PDL, and does a carveout preference on the one-wave kernel alone (MEMRA_DSV4_SMEM_CARVEOUT=fit1)
take the slowdown away?  The direct test of the thirty-second session's carveout hypothesis,
which the step's A/B and trace fit but did not observe: under PDL the SMs that ran a one-wave
kernel with shared memory never idle, so the L1 / shared configuration the driver chose for it
(the largest shared share) stays while the streaming GEMV after it runs, with little L1 left to
stage its loads in flight.

    python tools/carveout_probe.py --smem-kb 32,41,57,64 --ctas 64 --mb 64 --pairs 40

One captured graph per form: --pairs links of "hold; stream", every launch a PdlKernel (PDL edges,
memra_dsv4.gpu.pdl.launch_ex).  hold: --ctas CTAs of 256 threads, S KB of dynamic shared memory,
a few µs of work (one wave, like the hc boundary, the attention, the combine); stream: reads
--mb MB once per link (ld.global.nc.L1::no_allocate with an L2 evict_first policy, the production
GEMVs' ldg_stream16; 4 loads in flight per thread, 1024 CTAs of 128 threads), no shared memory.
Forms, each timed as the median over --rounds replays (µs per link and the stream's GB/s over
the link): the stream alone; hold with no shared memory; hold with S KB and no carveout
attribute (driver); with fit1's preference (one CTA's share; pdl.fit1_carveout); with fit1h16 /
fit1h32 (that share plus 16 / 32 KB of headroom for the stream's CTAs); with max (100).
The weights buffer is 2 x --mb (the two halves alternate per link) so L2 (50 MB) holds neither.
No memra_dsv4 kernel: the effect, if any, is the hardware's / driver's.  Prints a table; exits
non-zero only on an error.

--residency (instead of timing; thirty-third session, not GPU-run yet): observe what the timing
only implies, how many CTAs of the next kernel become resident beside a one-wave CTA that still
runs on their SM under each form (the hold marks its SM with %smid when it starts, before its
trigger, and when it ends; each stream CTA reads the marks on arrival, before its PDL wait).  The
inference it tests: fit1 on a 57 KB CTA leaves its 64 KB configuration room for only 6 of the
stream's CTAs (1 KB reserved each), fit1h16 for all of them.

    python tools/carveout_probe.py --residency --smem-kb 32,57,64 --ctas 132 --pairs 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

SRC = r'''
// the hold's work (after its PDL trigger): a dependent busy loop, then a pass through shared memory
__device__ __forceinline__ void hold_work(float* x, int n, int iters, float* sh) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 1.0f;
    sh[threadIdx.x] = v;
    __syncthreads();
    if (i < n) x[i] = sh[(threadIdx.x + 1) % blockDim.x] * 0.5f;
}
extern "C" __global__ void hold(float* x, int n, int iters) {
    extern __shared__ float sh[];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    hold_work(x, n, iters, sh);
}
extern "C" __global__ void hold_nosmem(float* x, int n, int iters) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 1.0f;
    if (i < n) x[i] = v * 0.5f;
}
__device__ __forceinline__ uint4 ldg_stream16(const void* p, unsigned long long pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    return v;
}
// the stream's work (after its PDL trigger): each thread 4 independent 16-byte loads per trip,
// grid-stride over n16 chunks
__device__ __forceinline__ void stream_loads(const uint4* __restrict__ w, long long n16, unsigned* out) {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = ldg_stream16(w + i, pol), b = ldg_stream16(w + i + stride, pol);
        uint4 c = ldg_stream16(w + i + 2 * stride, pol), d = ldg_stream16(w + i + 3 * stride, pol);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) { uint4 a = ldg_stream16(w + i, pol); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;   // keeps the loads; practically never taken
}
extern "C" __global__ void stream(const uint4* __restrict__ w, long long n16, unsigned* out) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stream_loads(w, n16, out);
}
// --residency: which stream CTAs become resident beside a hold that is still running on their SM.
// sm_state[2 sm] = the epoch of the hold that started on SM sm, [2 sm + 1] = the epoch of the one
// that finished there; the start mark is written before the CTA triggers its dependents (the
// __syncthreads orders it), so no stream CTA can arrive before it.  counts[3 sm + 0]: stream CTAs
// that arrived on SM sm, [+1]: of them, those that arrived while this epoch's hold still ran there,
// [+2]: hold CTAs that ran there.
extern "C" __global__ void hold_mark(float* x, int n, int iters, unsigned* sm_state, unsigned epoch,
                                     unsigned* counts) {
    extern __shared__ float sh[];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (threadIdx.x == 0) {
        atomicExch(&sm_state[2 * sm], epoch);
        atomicAdd(&counts[3 * sm + 2], 1u);
        __threadfence();
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    hold_work(x, n, iters, sh);
    if (threadIdx.x == 0) {
        __threadfence();
        atomicExch(&sm_state[2 * sm + 1], epoch);
    }
}
extern "C" __global__ void stream_count(const uint4* __restrict__ w, long long n16, unsigned* out,
                                        const unsigned* sm_state, unsigned epoch, unsigned* counts) {
    if (threadIdx.x == 0) {   // before the PDL wait: what this CTA finds on arrival
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        unsigned started = atomicAdd((unsigned*)&sm_state[2 * sm], 0u);
        unsigned done = atomicAdd((unsigned*)&sm_state[2 * sm + 1], 0u);
        atomicAdd(&counts[3 * sm], 1u);
        if (started == epoch && done != epoch) atomicAdd(&counts[3 * sm + 1], 1u);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stream_loads(w, n16, out);   // the timed stream's loads: its registers, so its residency
}
'''


def _ints(flag: str, text: str, lo: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < lo:
        raise SystemExit(f"{flag} {text}: every value must be >= {lo}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smem-kb", default="32,41,57,64", help="the hold kernel's dynamic shared memory, KB")
    ap.add_argument("--ctas", default="64", help="the hold kernel's CTAs (one wave: <= the SM count)")
    ap.add_argument("--mb", type=int, default=64, help="MB the stream kernel reads per link")
    ap.add_argument("--pairs", type=int, default=40, help="hold + stream links per graph")
    ap.add_argument("--rounds", type=int, default=30, help="timed replays per form")
    ap.add_argument("--iters", type=int, default=400, help="the hold kernel's busy loop")
    ap.add_argument("--residency", action="store_true",
                    help="instead of timing: count the stream CTAs that become resident beside a "
                         "hold still running on their SM, per form (eager PDL launches, --pairs links)")
    ap.add_argument("--residency-iters", type=int, default=200000,
                    help="the hold's busy loop under --residency (long, so every stream CTA that "
                         "fits beside it arrives while it runs)")
    a = ap.parse_args(argv)
    smem_kb = _ints("--smem-kb", a.smem_kb, 1)
    ctas = _ints("--ctas", a.ctas, 1)
    if max(smem_kb) > 227:
        raise SystemExit(f"--smem-kb {a.smem_kb}: at most 227 KB per CTA")
    for flag, v, lo in (("--mb", a.mb, 1), ("--pairs", a.pairs, 1), ("--rounds", a.rounds, 3), ("--iters", a.iters, 0),
                         ("--residency-iters", a.residency_iters, 1)):
        if v < lo:
            raise SystemExit(f"{flag} {v}: expected >= {lo}")

    import cupy as cp
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from memra_dsv4.gpu.pdl import PdlKernel, pdl_launches

    dev = cp.cuda.runtime.getDevice()
    sms = int(cp.cuda.runtime.deviceGetAttribute(16, dev))
    if max(ctas) > sms:
        raise SystemExit(f"--ctas {a.ctas}: the hold kernel is one wave, at most {sms} CTAs here")
    props = cp.cuda.runtime.getDeviceProperties(dev)
    print(f"device {dev}: {props['name'].decode()}, {sms} SMs")
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a",))
    hold = PdlKernel(mod.get_function("hold"), "probe.hold")
    hold_ns = PdlKernel(mod.get_function("hold_nosmem"), "probe.hold_nosmem")
    stream = PdlKernel(mod.get_function("stream"), "probe.stream")
    hold.max_dynamic_shared_size_bytes = max(smem_kb) * 1024
    n16 = a.mb * (1 << 20) // 16
    w = cp.empty(2 * n16 * 4, cp.uint32)
    w[:] = cp.arange(w.size, dtype=cp.uint32)
    out = cp.zeros(1024, cp.uint32)
    x = cp.zeros(max(ctas) * 256, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)

    def capture(carve: str, hold_ctas: int, kb: int | None):
        os.environ["MEMRA_DSV4_SMEM_CARVEOUT"] = carve
        with cp.cuda.Device(dev), s, pdl_launches(True):
            s.begin_capture()
            for j in range(a.pairs):
                if kb is None:
                    pass
                elif kb == 0:
                    hold_ns((hold_ctas,), (256,), (x, np.int32(hold_ctas * 256), np.int32(a.iters)), stream=s)
                else:
                    hold((hold_ctas,), (256,), (x, np.int32(hold_ctas * 256), np.int32(a.iters)),
                         shared_mem=kb * 1024, stream=s)
                half = w[(j % 2) * n16 * 4:(j % 2 + 1) * n16 * 4]
                stream((1024,), (128,), (half, np.int64(n16), out), stream=s)
            g = s.end_capture()
        g.upload(s)
        return g

    def timed(g) -> float:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        g.launch(s)
        s.synchronize()
        ts = []
        for _ in range(a.rounds):
            e0.record(s)
            g.launch(s)
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / a.pairs)
        return statistics.median(ts)

    prev = os.environ.get("MEMRA_DSV4_SMEM_CARVEOUT")
    try:   # every form sets the variable; the caller's value comes back, whatever happens
        if a.residency:
            residency(mod, a, dev, sms, smem_kb, ctas, w, n16, out, x, s)
            return 0
        base = timed(capture("driver", 1, None))
        print(f"stream alone: {base:7.2f} us per link ({a.mb} MB: {a.mb * 1.048576e6 / base / 1e3:7.1f} GB/s)")
        for c in ctas:
            ns = timed(capture("driver", c, 0))
            print(f"hold {c:>3} CTAs, no shared memory: {ns:7.2f} us per link")
            for kb in smem_kb:
                row = {carve: timed(capture(carve, c, kb)) for carve in FORMS}
                print(f"hold {c:>3} CTAs, {kb:>3} KB: " + "  ".join(f"{k} {v:7.2f}" for k, v in row.items())
                      + f"  us per link; driver - fit1 {row['driver'] - row['fit1']:+.2f} us")
    finally:
        if prev is None:
            os.environ.pop("MEMRA_DSV4_SMEM_CARVEOUT", None)
        else:
            os.environ["MEMRA_DSV4_SMEM_CARVEOUT"] = prev
    return 0


FORMS = ("driver", "fit1", "fit1h16", "fit1h32", "max")


def residency(mod, a, dev, sms, smem_kb, ctas, w, n16, out, x, s):
    """--residency: per hold shape and carveout form, --pairs eager PDL links "hold_mark (a long
    busy loop); stream_count" (1024 CTAs of 128 threads, as the timed stream), and per link the
    stream CTAs that arrived on an SM while that link's hold still ran there.  With a hold on every
    SM (--ctas = the SM count) the stream can only start beside the holds, so the count per hold
    SM is what the carveout leaves room for; with fewer hold CTAs the scheduler may place the
    stream on the free SMs first.  Prints one line per form."""
    import cupy as cp
    import numpy as np
    from memra_dsv4.gpu.pdl import PdlKernel, pdl_launches
    hold = PdlKernel(mod.get_function("hold_mark"), "probe.hold_mark")
    stream = PdlKernel(mod.get_function("stream_count"), "probe.stream_count")
    hold.max_dynamic_shared_size_bytes = max(smem_kb) * 1024
    sm_state = cp.zeros(2 * sms, cp.uint32)
    counts = cp.zeros(3 * sms, cp.uint32)
    half = w[:n16 * 4]
    epoch = 0
    print(f"residency: {a.pairs} links per form, hold busy loop {a.residency_iters}, stream 1024 x 128 "
          f"threads over {a.mb} MB")
    for c in ctas:
        for kb in smem_kb:
            for carve in FORMS:
                os.environ["MEMRA_DSV4_SMEM_CARVEOUT"] = carve
                counts.fill(0)
                with cp.cuda.Device(dev), s, pdl_launches(True):
                    for _ in range(a.pairs):
                        epoch += 1
                        hold((c,), (256,), (x, np.int32(c * 256), np.int32(a.residency_iters), sm_state,
                                            np.uint32(epoch), counts), shared_mem=kb * 1024, stream=s)
                        stream((1024,), (128,), (half, np.int64(n16), out, sm_state, np.uint32(epoch), counts),
                               stream=s)
                s.synchronize()
                k = counts.get().reshape(sms, 3).astype(np.int64)
                arrived, beside, holds = k[:, 0], k[:, 1], k[:, 2]
                hold_sms = holds > 0
                per_sm = beside[hold_sms] / a.pairs
                print(f"hold {c:>3} CTAs, {kb:>3} KB, {carve:>7}: stream CTAs beside a running hold "
                      f"{beside.sum() / a.pairs:7.1f} of {arrived.sum() / a.pairs:6.1f} per link; per hold SM "
                      f"median {np.median(per_sm):5.2f}, min {per_sm.min():5.2f}, max {per_sm.max():5.2f} "
                      f"({int(hold_sms.sum())} SMs held, {holds.max() / a.pairs:.0f} hold CTAs on the fullest)")


if __name__ == "__main__":
    raise SystemExit(main())
