// Shared device helpers for every kernels_cu/*.cu.
//
// The same text compiles under nvcc (CI: tools/compile_kernels.py, -arch=sm_90a) and NVRTC
// (runtime: -std=c++17 -arch=sm_90a -I<kernels_cu>), so it includes no CUDA headers: bf16, e4m3,
// e8m0 and e2m1 are handled with integer bit math, and the few intrinsics used are built in.
//
// Storage conventions (host side): bf16 tensors are uint16 bit patterns, FP8/FP4/e8m0 are uint8.
//
// Numerics policy of these kernels (the NumPy twins in memra_dsv4/oracle are the contract):
//  * Elementwise math that the twin evaluates in float64 and then stores (f64 -> f32 -> bf16)
//    is evaluated here in double with explicit _rn intrinsics (no FMA contraction), in the same
//    order, and rounded the same way: the result is bit-identical whenever the twin's order is.
//  * Short statistics (RMS, pooling softmax, Hadamard) accumulate in double: their rounded
//    result equals the twin's correctly rounded float64 value except in astronomically rare
//    ties.
//  * Long dot products on the hot path (attention, indexer, expert GEMV, router GEMV)
//    accumulate in f32 in a FIXED order that depends only on the row being computed, never on
//    the number of rows in the launch (decode == prefill bit-for-bit).
//  * NVRTC under CuPy adds -ftz=true: f32 denormals flush. Nothing here relies on f32
//    denormals (bf16 construction of tiny MXFP4 values is done on integer bits).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DEV __device__ __forceinline__

#ifdef MEMRA_TRACE
// Device-timeline records (layout read by memra_dsv4/profiling/device_trace.py), 4 u64 per CTA:
//   [0] %gridid (one value per launch, shared by its CTAs)
//   [1] MEMRA_TRACE_MODULE << 56 | (__LINE__ of the kernel's PDL_ENTRY) << 32 | linear CTA id
//   [2] %globaltimer (ns) when thread 0 started, before griddepcontrol.wait
//   [3] (wait return - start) << 32 | (the CTA's last warp's exit - wait return), ns, each clamped
//       to 32 bits
// One buffer and one counter per module (NVRTC builds each .cu as its own module); the host
// zeroes the counter before the traced step and reads both afterwards (module.get_global).
// The delay probe (memra_dsv4.profiling.delay_probe): memra_trace_delay = {line, ns} of the
// module names one kernel (the __LINE__ of its PDL_ENTRY); each LAUNCH of it is then held ns:
// the first of its CTAs to pass griddepcontrol.wait sets the launch's deadline (its wait return
// + ns, in memra_trace_deadline, tagged with the launch's %gridid), and every CTA of the launch
// waits after its own wait return until that deadline (after launch_dependents, so the
// successor's pre-wait loads run as usual), in __nanosleep steps so co-resident kernels keep
// the issue slots.  A CTA resident after the deadline (a later wave) does not wait, so a launch
// of many waves is held ns once, not ns per wave.  {0, 0} (the zeroed global): no kernel
// waits.  Thread 0 reads the knob before the wait (the host writes it between replays, never
// a kernel), into the upper half of the slot word.
#ifndef MEMRA_TRACE_MODULE
#define MEMRA_TRACE_MODULE 0
#endif
#define MEMRA_TRACE_CAP (1u << 19)
extern "C" {
__device__ unsigned long long memra_trace_rec[4 * MEMRA_TRACE_CAP];
__device__ unsigned int memra_trace_n;
__device__ unsigned int memra_trace_delay[2];   // {PDL_ENTRY line, ns}; {0, 0}: none
__device__ unsigned long long memra_trace_deadline;   // (%gridid & 0xffff) << 48 | deadline ns mod 2^48
}
namespace memra_trace {
DEV unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}
DEV bool lead() { return (threadIdx.x | threadIdx.y | threadIdx.z) == 0; }
// thread 0's stamps between the entry and the exit, and the count of warps that have left:
// static shared memory (not registers), so the trace build does not change the register
// allocation of the kernel's body much
DEV unsigned long long* state() {
    // start time, delay ns << 32 | slot, wait return, the launch's remaining delay << 32 | warps left
    __shared__ unsigned long long s[4];
    return s;
}
DEV void enter(u32 line) {
    if (lead()) {
        unsigned long long* s = state();
        s[0] = now();
        const u32 slot = atomicAdd(&memra_trace_n, 1u);
        const u32 target = __ldcg(&memra_trace_delay[0]), ns = __ldcg(&memra_trace_delay[1]);
        s[1] = (target == line ? (unsigned long long)ns << 32 : 0ull) | slot;
        s[3] = 0ull;
    }
}
DEV u32 slot_of(unsigned long long w) { return (u32)(w & 0xffffffffull); }
// The delay probe: ns this CTA still waits so that its launch is held `delay` after the first
// wait return of any of its CTAs (go: this CTA's wait return).  The first CTA installs its own
// deadline; a CTA that finds another launch's tag (a stale or concurrent launch of the same
// module) replaces it.  Times mod 2^48 ns (78 hours).
DEV u32 launch_wait(u32 delay, unsigned long long go) {
    constexpr unsigned long long M = (1ull << 48) - 1;
    unsigned long long grid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    const unsigned long long tag = (grid & 0xffffull) << 48, mine = tag | ((go + delay) & M);
    unsigned long long w = __ldcg(&memra_trace_deadline);
    if ((w & ~M) != tag) {
        const unsigned long long prev = atomicCAS(&memra_trace_deadline, w, mine);
        w = (prev == w || (prev & ~M) != tag) ? mine : prev;
    }
    const unsigned long long dl = w & M, g = go & M;
    return dl > g ? (u32)min(dl - g, 0xffffffffull) : 0u;
}
DEV u32 clamp32(unsigned long long v) { return v > 0xffffffffull ? 0xffffffffu : (u32)v; }
// The CTA's exit is its LAST thread's: a last-CTA kernel's thread 0 may leave long before the
// warps that run the tail (hc_boundary_pre's warps 4..7).  At every return path (the destructor)
// the first active lane of each exiting group of lanes adds the group's size to a shared count;
// the group that brings it to the CTA's thread count writes the record with its own exit time.
struct Scope {
    u32 line;   // a constant after inlining: the Scope costs no register
    __device__ __forceinline__ explicit Scope(u32 l) : line(l) {
        unsigned long long* s = state();
        if (lead()) s[2] = now();
        // the probe's knob: written by thread 0 before MEMRA_TRACE_WAIT's barrier, never again,
        // so the branch is uniform and the barrier inside it is reached by every thread
        const u32 delay = (u32)(s[1] >> 32);
        if (delay != 0u) {
            // no warp has left yet (all are here), so s[3]'s count is 0: the upper half carries
            // the wait; the exit compares the count's lower half only
            if (lead()) s[3] = (unsigned long long)launch_wait(delay, s[2]) << 32;
            __syncthreads();
            const u32 wait = (u32)(s[3] >> 32);
            const unsigned long long until = now() + wait;
            while (now() < until) __nanosleep(256);
        }
    }
    __device__ __forceinline__ ~Scope() {
        const u32 active = __activemask();
        const u32 lane = threadIdx.x & 31u;   // blocks here are 1-D or x-multiple-of-32
        if (lane != (u32)(__ffs(active) - 1)) return;
        unsigned long long* s = state();
        const u32 threads = blockDim.x * blockDim.y * blockDim.z;
        __threadfence_block();
        const unsigned long long left = atomicAdd(&s[3], (unsigned long long)__popc(active)) + __popc(active);
        if ((u32)left != threads) return;
        __threadfence_block();   // thread 0's stamps (written before its own count) are visible
        const unsigned long long end = now();
        if (slot_of(s[1]) >= MEMRA_TRACE_CAP) return;
        unsigned long long grid;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
        const unsigned long long cta =
            blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
        unsigned long long* r = memra_trace_rec + 4 * slot_of(s[1]);
        r[0] = grid;
        r[1] = ((unsigned long long)MEMRA_TRACE_MODULE << 56) | ((unsigned long long)(line & 0xffffffu) << 32) |
               (cta & 0xffffffffull);
        r[2] = s[0];
        r[3] = ((unsigned long long)clamp32(s[2] - s[0]) << 32) | clamp32(end - s[2]);
    }
};
}  // namespace memra_trace
#endif

// Programmatic dependent launch (memra_dsv4/gpu/pdl.py): the first statement of EVERY kernel
// (tests/test_kernels_pdl.py enforces it).  griddepcontrol.wait returns once the grid this launch
// depends on has completed and its writes are visible (a no-op for a launch without the PDL
// attribute, so plain CuPy launches behave as before); nothing of this kernel reads or writes
// global memory before it.  griddepcontrol.launch_dependents then lets the stream's next kernel be
// scheduled once every CTA of this grid has passed this point (the grid is resident): its CTAs
// park at their own wait, hiding the launch / drain gap between dependent kernels of a graph.
#ifndef MEMRA_TRACE
#define PDL_ENTRY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
// The device-timeline build (-DMEMRA_TRACE, memra_dsv4/profiling/device_trace.py): thread 0 of
// every CTA stamps %globaltimer when the CTA starts (before the wait) and when the wait returns;
// the CTA's last thread to leave the kernel (the destructor of memra_trace::Scope, declared here
// in the kernel's own scope so every return path runs it) stamps the exit and appends the CTA's
// record.  The slot is taken (atomicAdd on the module's counter) before the wait, so a CTA parked
// on its predecessor pays for it while it waits; one __syncthreads() orders the exit count's
// reset before any exit.  The counter and the records belong to no kernel's
// data, so touching them before the wait cannot race with the predecessor.
#define PDL_ENTRY() memra_trace::enter(__LINE__); MEMRA_TRACE_WAIT()
// the wait and the scope after enter(): PDL_ENTRY_PREFETCH / _PRELOAD stamp the CTA's start
// BEFORE their pre-wait statement (so "go" is when the CTA became resident, and a pre-wait loop
// such as l2_prefetch_paced's shows in its busy time, not as a late start)
#define MEMRA_TRACE_WAIT()                                                                       \
    __syncthreads(); /* the exit count is zeroed before any warp can leave */                   \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");       \
    memra_trace::Scope memra_trace_scope_(__LINE__)
#endif
// The one exception to "nothing before the wait": PDL_ENTRY_PREFETCH(stmt) runs stmt first, and
// stmt may only issue L2 prefetch hints for memory no kernel of the step writes (the dense GEMVs'
// weights: decode.cu gemv_*_prefetch); it loads and stores nothing, so it cannot observe or race
// with the predecessor.  tools/pdl_entry.py accepts it as the opening statement.
// (No do / while around it: under MEMRA_TRACE, PDL_ENTRY() declares the trace scope, which must
// live as long as the kernel body.)
#ifndef MEMRA_TRACE
#define PDL_ENTRY_PREFETCH(...) __VA_ARGS__; PDL_ENTRY()
#else
#define PDL_ENTRY_PREFETCH(...) memra_trace::enter(__LINE__); __VA_ARGS__; MEMRA_TRACE_WAIT()
#endif
// The second exception: PDL_ENTRY_PRELOAD(stmt) runs stmt first in the kernel's own scope (no
// do / while: what stmt declares stays visible after the wait), and stmt may only LOAD memory no
// kernel of the step writes (the dense GEMVs' weights: decode.cu gemv_pl_rows).  Such a load
// cannot observe the predecessor, so it may be in flight while the predecessor runs; every read
// of an activation and every store stays after the wait.  stmt must end its basic block (a
// branch), or ptxas schedules the wait above its loads (legal, since it only delays them).
// tools/pdl_entry.py accepts it as the opening statement.
// One more thing stmt may read: memory written by a grid that is complete before this grid can
// launch.  Every kernel's PDL_ENTRY waits BEFORE it triggers, so this grid launches only after
// every CTA of its predecessor(s) has passed its own griddepcontrol.wait, i.e. after the
// predecessor's prerequisites completed and flushed; a buffer written two launches back (the
// MoE's expert ids, written by the router and read by the down + combine behind the routed
// gate/up: experts.cu FP4_DN_PRELOAD) is final.  Read it through L2 (ld.cg), not the non-
// coherent L1 path, which could hold a line from an earlier reader of the same buffer.  The
// predecessor's own output stays after the wait.
#ifndef MEMRA_TRACE
#define PDL_ENTRY_PRELOAD(...) __VA_ARGS__; PDL_ENTRY()
#else
#define PDL_ENTRY_PRELOAD(...) memra_trace::enter(__LINE__); __VA_ARGS__; MEMRA_TRACE_WAIT()
#endif

namespace memra {

// ------------------------------------------------------------------------------- constants
DEV float f32_inf() { return __int_as_float(0x7f800000); }
DEV float f32_ninf() { return __int_as_float(0xff800000); }
DEV double f64_ninf() { return __longlong_as_double(0xfff0000000000000ULL); }

// ------------------------------------------------------------------------------------ bf16
DEV float bf16_to_f32(u32 h) { return __uint_as_float(h << 16); }

// f32 -> bf16 bits, round to nearest even (the twin's encode_bf16: u += 0x7FFF + ((u>>16)&1);
// overflow rounds to inf as IEEE RNE does); NaN -> quiet NaN with the sign kept.
DEV u32 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

// round to bf16 precision, staying in f32
DEV float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// MEMRA_L2_EVICT_FIRST (a build macro; default 1 since the fifteenth session): 1 marks every
// streamed weight load (ldg_stream16 / 8, ldg_weight16 and ldg_weight_f4 below: the dense and
// FP4 expert GEMVs, the router, hc_boundary's fn rows) with an L2 evict_first cache policy, so
// the ~400 MB of weights a layer streams per step stop evicting what the latency-bound kernels
// re-read from L2 (KV rows, compressor / indexer state, norm weights, the hc streams).  A cache
// hint: no value changes (the step identity tests pass on both builds).  Measured with the
// kernel-tree A/B of bench.decode_step --base-kernels (a copy of kernels_cu with the other
// value), 1x H200, flash-layers:20, both arm orders: 1K 3.49 -> 3.44 ms, 32K 3.64 -> 3.60 ms
// (docs/decode_perf.md, fifteenth session).  0: the plain loads (the fourteenth session's cubins).
// 2: also the FP4 experts' block-scale bytes (ldg_weight_u8); measured no faster than 1.
#ifndef MEMRA_L2_EVICT_FIRST
#define MEMRA_L2_EVICT_FIRST 1
#endif

// Streaming weight loads (16 / 8 bytes): read once per decode step, so kept out of L1 (the
// activations, re-read by every warp of a CTA, stay there).
#if MEMRA_L2_EVICT_FIRST
// sm_90 takes an L2 eviction priority on 128-bit loads only through a cache policy operand
// (.L2::evict_first as a load qualifier is 256-bit loads, sm_100); createpolicy is a pure asm, so
// ptxas keeps one per kernel region instead of one per load
DEV unsigned long long l2_evict_first_policy() {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
DEV uint4 ldg_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(l2_evict_first_policy()));
    return v;
}

DEV uint2 ldg_stream8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(l2_evict_first_policy()));
    return v;
}
#else
DEV uint4 ldg_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

DEV uint2 ldg_stream8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
#endif

// the twins' pol.store() of a float64 value: f64 -> f32 (RN) -> bf16 (RNE)
DEV u32 f64_to_bf16(double d) { return f32_to_bf16(__double2float_rn(d)); }

DEV u32 pack_bf16x2(float lo, float hi) { return f32_to_bf16(lo) | (f32_to_bf16(hi) << 16); }
DEV float bf16lo(u32 w) { return __uint_as_float(w << 16); }
DEV float bf16hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// 8 bf16 in a uint4 -> 8 floats
DEV void unpack8(const uint4& v, float* f) {
    f[0] = bf16lo(v.x); f[1] = bf16hi(v.x);
    f[2] = bf16lo(v.y); f[3] = bf16hi(v.y);
    f[4] = bf16lo(v.z); f[5] = bf16hi(v.z);
    f[6] = bf16lo(v.w); f[7] = bf16hi(v.w);
}
DEV uint4 pack8(const float* f) {
    uint4 v;
    v.x = pack_bf16x2(f[0], f[1]);
    v.y = pack_bf16x2(f[2], f[3]);
    v.z = pack_bf16x2(f[4], f[5]);
    v.w = pack_bf16x2(f[6], f[7]);
    return v;
}

// ------------------------------------------------------------------------------------ e4m3
// e4m3fn byte -> f32, exact. E=0: m * 2^-9; else (8+m) * 2^(E-10). 0x7F/0xFF -> NaN.
DEV float e4m3_to_f32(u32 b) {
    u32 s = (b & 0x80u) << 24;
    u32 e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(s | 0x7fc00000u);
    if (e == 0) return __uint_as_float(s | __float_as_uint((float)m * 0.001953125f));
    return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

// Round an f32 value to the e4m3fn grid (RNE; subnormal quantum 2^-9), saturating at +-448.
// The callers clamp to +-448 first, as the reference does. Result stays an f32.
DEV float round_e4m3(float x) {
    u32 u = __float_as_uint(x);
    u32 s = u & 0x80000000u;
    u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return x;  // NaN propagates
    float r;
    if (a < 0x3c800000u) {  // |x| < 2^-6: fixed quantum 2^-9 (x * 512 is exact)
        r = rintf(__uint_as_float(a) * 512.0f) * 0.001953125f;
    } else {               // normal: keep 3 mantissa bits, RNE on the bit pattern
        a += 0x7ffffu + ((a >> 20) & 1u);
        a &= 0xfff00000u;
        r = fminf(__uint_as_float(a), 448.0f);
    }
    return __uint_as_float(__float_as_uint(r) | s);
}

// ------------------------------------------------------------------------------------ e2m1
// Round to +-{0, .5, 1, 1.5, 2, 3, 4, 6} (RNE: 2.5->2, 3.5->4, 5->4, .25->0, .75->1), saturating.
DEV float round_e2m1(float x) {
    u32 u = __float_as_uint(x);
    u32 s = u & 0x80000000u;
    float a = __uint_as_float(u & 0x7fffffffu);
    if (a != a) return x;
    float q = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);  // the grid's quantum at |x|
    float r = fminf(rintf(a / q) * q, 6.0f);               // a/q exact (q = 2^k)
    return __uint_as_float(__float_as_uint(r) | s);
}

// e2m1 nibble -> f32 (exact). Codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign.
DEV float e2m1_to_f32(u32 n) {
    u32 c = n & 7u;
    // f16 bit pattern c << 9 is e2m1(c) * 2^-14 (1 -> f16 subnormal 2^-15); build the f32
    // directly instead: exponent e = (c >> 1), mantissa (c & 1); c == 1 is 0.5.
    u32 bits = c < 2u ? (c ? 0x3f000000u : 0u) : ((((c >> 1) + 126u) << 23) | ((c & 1u) << 22));
    return __uint_as_float(bits | ((n & 8u) << 28));
}

// ------------------------------------------------------------------------------------ e8m0
// e8m0 byte -> f32 2^(b-127). b = 0 is 2^-127 (an f32 subnormal: flushed under -ftz when used in
// f32 arithmetic; MXFP4 bf16 dequant avoids f32 arithmetic for that reason). 0xFF -> NaN.
DEV float e8m0_to_f32(u32 b) {
    if (b == 0u) return __uint_as_float(0x00400000u);
    if (b == 255u) return __uint_as_float(0x7fc00000u);
    return __uint_as_float(b << 23);
}

// ------------------------------------------------------------------- ue8m0 block scale rule
// s = 2^ceil(log2(amax * f32(1/qmax))), exponent read off the f32 bits of t = amax * inv_qmax
// (exponent - 127, +1 if the mantissa is non-zero). Returns the exponent e (s = 2^e).
DEV int ue8m0_exp(float amax, float inv_qmax) {
    u32 t = __float_as_uint(__fmul_rn(amax, inv_qmax));
    return (int)((t >> 23) & 0xffu) - 127 + ((t & 0x7fffffu) != 0u ? 1 : 0);
}
DEV float pow2f(int e) { return __uint_as_float((u32)(e + 127) << 23); }  // e in [-126, 127]

// fp8 simulation of one value given its block's scale exponent e: bf16(e4m3(clip(x/s)) * s).
// x/s and q*s are exact (s = 2^e), so this is the twin's fp8_sim bit for bit.
DEV float fp8_sim_value(float x, int e) {
    float v = __fmul_rn(x, pow2f(-e));
    v = fminf(fmaxf(v, -448.0f), 448.0f);
    return __fmul_rn(round_e4m3(v), pow2f(e));  // <= 4 significant bits: exact in bf16
}
DEV float fp4_sim_value(float x, int e) {
    float v = __fmul_rn(x, pow2f(-e));
    v = fminf(fmaxf(v, -6.0f), 6.0f);
    return __fmul_rn(round_e2m1(v), pow2f(e));
}
// f32(1/448) and f32(1/6) as the reference computes them
DEV float inv_448() { return __uint_as_float(0x3b124925u); }       // f32(1/448)
DEV float inv_6() { return __uint_as_float(0x3e2aaaabu); }         // f32(1/6)
DEV float act_amax_floor() { return 1e-4f; }                       // f32(1e-4)
DEV float fp4_amax_floor() { return __uint_as_float(0x01c00000u); }  // f32(6 * 2^-126)

// ------------------------------------------------------------------------------ reductions
// Value select in registers (a plain ?: on two array elements can become a select of addresses,
// i.e. a local-memory array).
DEV float sel(bool c, float a, float b) {
    float r;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %3, 0;\n\tselp.f32 %0, %1, %2, p;\n\t}"
        : "=f"(r) : "f"(a), "f"(b), "r"((int)c));
    return r;
}
DEV double sel(bool c, double a, double b) {
    double r;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %3, 0;\n\tselp.f64 %0, %1, %2, p;\n\t}"
        : "=d"(r) : "d"(a), "d"(b), "r"((int)c));
    return r;
}
DEV float add_rn(float a, float b) { return __fadd_rn(a, b); }
DEV double add_rn(double a, double b) { return __dadd_rn(a, b); }

// One reduce-scatter stage over the lane pairs (lane, lane ^ HALF): afterwards p[0..HALF) hold
// the pair sums of the values whose bit HALF equals the lane's bit HALF.  Stages 16, 8, 4, 2, 1
// leave lane l with the fixed-order warp sum of value l (attention's tile scores, hc's segment
// sums): the order is the same for every lane count, so the sums are reproducible.
template <int HALF, typename T>
DEV void rs_stage(T* p, int lane) {
    const bool upper = (lane & HALF) != 0;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const T send = sel(upper, p[i], p[i + HALF]);
        const T keep = sel(upper, p[i + HALF], p[i]);
        p[i] = add_rn(keep, __shfl_xor_sync(0xffffffffu, send, HALF));
    }
}

// All five stages: lane l ends with the fixed-order sum over the warp of p[l] (p has 32 values).
template <typename T>
DEV void reduce_scatter32(T* p, int lane) {
    rs_stage<16>(p, lane);
    rs_stage<8>(p, lane);
    rs_stage<4>(p, lane);
    rs_stage<2>(p, lane);
    rs_stage<1>(p, lane);
}

DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEV double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEV float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// xor-butterfly over groups of G consecutive lanes (G a power of two <= 32)
template <int G>
DEV float group_max(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <int G>
DEV float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int G>
DEV double group_sum(double v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The last-CTA handoff of the one-pass kernels (hc_boundary, router_fused, indexer_fused,
// gemv_bf16_multi_*_qn): every thread fences its global stores, the CTA takes a ticket on
// *counter, and the call returns true in every thread of the CTA that drew the last of n
// tickets.  is_last: the caller's __shared__ int.  Every thread of the CTA must call it; the
// caller fences again (__threadfence) before it reads the other CTAs' stores, and resets the
// counter for the next launch.  (hc_mixes' split path keeps the same sequence written out:
// through this call ptxas schedules that GPU-tested kernel differently.)
DEV bool last_cta_ticket(int* counter, int n, int& is_last) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == n - 1;
    __syncthreads();
    return is_last;
}

// Block sum of one double per thread, fixed order: xor-tree in each warp, then warp 0 adds the
// warp partials in warp order. `red` is NWARPS doubles of shared memory. All threads get the sum.
template <int NWARPS>
DEV double block_sum(double v, double* red) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (NWARPS == 1) return v;
    __syncthreads();  // red may still be read from a previous call
    if (l == 0) red[w] = v;
    __syncthreads();
    double s = red[0];
#pragma unroll
    for (int i = 1; i < NWARPS; ++i) s += red[i];
    return s;
}

// ------------------------------------------------------------------------ shared math
// In-warp FWHT of 128 values: lane holds v[0..3] = elements 4*lane .. 4*lane+3. Exact in double.
DEV void fwht128_warp(double* v) {
    const int lane = threadIdx.x & 31;
    // h = 1: pairs (0,1), (2,3)
    double a0 = __dadd_rn(v[0], v[1]), a1 = __dsub_rn(v[0], v[1]);
    double a2 = __dadd_rn(v[2], v[3]), a3 = __dsub_rn(v[2], v[3]);
    // h = 2: pairs (0,2), (1,3)
    v[0] = __dadd_rn(a0, a2); v[2] = __dsub_rn(a0, a2);
    v[1] = __dadd_rn(a1, a3); v[3] = __dsub_rn(a1, a3);
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {  // h = 4m: partner lane ^ m
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const double o = __shfl_xor_sync(0xffffffffu, v[i], m);
            v[i] = upper ? __dsub_rn(o, v[i]) : __dadd_rn(v[i], o);  // (a+b, a-b), a = lower
        }
    }
}

// One RoPE pair in double (twin host.rope.rotate_pairs: a*c - b*s, a*s + b*c; inverse: s -> -s),
// rounded f64 -> f32. a, b are bf16 values, c, s f32: every product is exact in double.
DEV void rope_pair(float& a_io, float& b_io, float c, float s, bool inverse) {
    const double a = a_io, b = b_io, cc = c, ss = s;
    double re, im;
    if (!inverse) {
        re = __dsub_rn(__dmul_rn(a, cc), __dmul_rn(b, ss));
        im = __dadd_rn(__dmul_rn(a, ss), __dmul_rn(b, cc));
    } else {
        re = __dadd_rn(__dmul_rn(a, cc), __dmul_rn(b, ss));
        im = __dsub_rn(__dmul_rn(b, cc), __dmul_rn(a, ss));
    }
    a_io = __double2float_rn(re);
    b_io = __double2float_rn(im);
}

// cos / sin of NP consecutive RoPE pairs from table index row (cos_t / sin_t [n_pos, R/2] f32,
// row = pos * (R/2) + the first pair), c[i] and s[i] interleaved, through the read-only path.
// For the PDL preloads (PDL_ENTRY_PRELOAD), which call it before griddepcontrol.wait: the tables
// are static, and these are the same floats as the rotation loops' own loads.  The position in
// row is the caller's, read through L2 (__ldcg).
template <int NP>
DEV void rope_pairs_ldg(const float* __restrict__ cos_t, const float* __restrict__ sin_t, i64 row, float (&c)[NP],
                        float (&s)[NP]) {
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        c[i] = __ldg(cos_t + row + i);
        s[i] = __ldg(sin_t + row + i);
    }
}

// Clamped SwiGLU of one element (twin oracle.ops.swiglu_clamped, then stored): silu in double,
// rounded to f32, then the twin's f32 products. g, u are the bf16 linear outputs; limit <= 0: no clamp.
DEV float swiglu_value(float g, float u, float ws, bool weighted, double limit) {
    double gd = g, ud = u;
    if (limit > 0.0) {
        ud = fmin(fmax(ud, -limit), limit);
        gd = fmin(gd, limit);
    }
    const float silu = __double2float_rn(__ddiv_rn(gd, __dadd_rn(1.0, exp(-gd))));
    float hv = __fmul_rn(silu, __double2float_rn(ud));
    if (weighted) hv = __fmul_rn(ws, hv);
    return hv;
}

// ------------------------------------------------------------------------- memory helpers
DEV uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
// a weight load of the FP4 expert GEMVs: ldg16 (the build's default), or with MEMRA_L2_EVICT_FIRST
// ldg_stream16's evict_first form
#if MEMRA_L2_EVICT_FIRST
DEV uint4 ldg_weight16(const void* p) { return ldg_stream16(p); }
#else
DEV uint4 ldg_weight16(const void* p) { return ldg16(p); }
#endif
// a one-byte weight load (the FP4 expert GEMVs' block scales): __ldg, or with
// MEMRA_L2_EVICT_FIRST >= 2 the evict_first policy too (level 2 is the scales on top of level 1's
// 16-byte streams: ~1/32 of the expert bytes, 32 contiguous bytes per warp load)
DEV u32 ldg_weight_u8(const u8* p) {
#if MEMRA_L2_EVICT_FIRST >= 2
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u8 %0, [%1], %2;"
                 : "=h"(v) : "l"(p), "l"(l2_evict_first_policy()));
    return (u32)v;
#else
    return (u32)__ldg(p);
#endif
}
// the f32 form (hc_boundary's fn rows)
DEV float4 ldg_weight_f4(const float4* p) {
#if MEMRA_L2_EVICT_FIRST
    const uint4 v = ldg_stream16(p);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
#else
    return __ldg(p);
#endif
}
DEV void stg16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

DEV u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16-byte cp.async, zero-filled when !valid (src-size 0)
DEV void cp_async16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0));
}
// a 16-byte cp.async of a streamed weight (L2 only, as ldg_stream16; with MEMRA_L2_EVICT_FIRST the
// same evict_first cache policy)
DEV void cp_async16_stream(void* smem, const void* gmem) {
#if MEMRA_L2_EVICT_FIRST
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "l"(l2_evict_first_policy()) : "memory");
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
#endif
}
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace memra
