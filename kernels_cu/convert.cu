// bf16 <-> f32 conversions of gpu/ops_glue.py (bf16_bits, store, to_f32) as raw kernels.
//
// Why: the three CuPy ElementwiseKernels they stand in for cost ~15 us of host time per call
// (type inference, broadcasting, cache lookup; 3542 + 3201 + 1701 calls, ~130 ms, in an 8K
// prefill forward on the H200, bench/results/2026-11-30-nvidia-h200-2624ca0-prof5.log); a RawKernel
// launch with a precomputed grid costs a few us.
//
// Contract, per element i < n (x, h, y contiguous, any n >= 0, any alignment):
//   u = the 32 bits of x[i];  b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16   (u32 arithmetic, wrapping)
//   cvt_f32_to_bf16_bits: y[i] (u16)  = b                       == ElementwiseKernel memra_f32_to_bf16
//   cvt_f32_store_bf16:   y[i] (f32)  = bits b << 16            == memra_f32_store_bf16
//   cvt_bf16_to_f32:      y[i] (f32)  = bits (u32)h[i] << 16    == memra_bf16_to_f32
// This is ops_glue._RNE verbatim, on integers only: no float instruction runs, so the output is
// the same for every input bit pattern as the ElementwiseKernels' (NaN payloads, +-Inf, +-0,
// subnormals whatever -ftz says, RNE ties, max finite; a NaN whose rounding carries out of 32 bits
// wraps exactly as there).
//
// Layout: a grid-stride loop over groups of 4 elements (any grid; 256 threads per block in the
// wrapper); 16-byte f32 / 8-byte bf16 vector accesses when both pointers are aligned for them
// (a uniform test: CuPy allocations are, offset views may not be), else 4 scalar accesses; the
// n % 4 tail elements are done by the first threads of block 0.
#include "common.cuh"

using namespace memra;

namespace {

DEV u32 rne_bf16(u32 u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
cvt_f32_to_bf16_bits(const u32* __restrict__ x, u16* __restrict__ y, long long n) {
    PDL_ENTRY();
    const i64 groups = n >> 2;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = ((reinterpret_cast<u64>(x) & 15) | (reinterpret_cast<u64>(y) & 7)) == 0;
    for (i64 g = t0; g < groups; g += stride) {
        if (vec) {
            const uint4 v = reinterpret_cast<const uint4*>(x)[g];
            uint2 o;
            o.x = rne_bf16(v.x) | (rne_bf16(v.y) << 16);
            o.y = rne_bf16(v.z) | (rne_bf16(v.w) << 16);
            reinterpret_cast<uint2*>(y)[g] = o;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) y[4 * g + j] = (u16)rne_bf16(x[4 * g + j]);
        }
    }
    if (t0 < (n & 3)) y[4 * groups + t0] = (u16)rne_bf16(x[4 * groups + t0]);
}

extern "C" __global__ void __launch_bounds__(256)
cvt_f32_store_bf16(const u32* __restrict__ x, u32* __restrict__ y, long long n) {
    PDL_ENTRY();
    const i64 groups = n >> 2;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = ((reinterpret_cast<u64>(x) | reinterpret_cast<u64>(y)) & 15) == 0;
    for (i64 g = t0; g < groups; g += stride) {
        if (vec) {
            const uint4 v = reinterpret_cast<const uint4*>(x)[g];
            uint4 o;
            o.x = rne_bf16(v.x) << 16;
            o.y = rne_bf16(v.y) << 16;
            o.z = rne_bf16(v.z) << 16;
            o.w = rne_bf16(v.w) << 16;
            reinterpret_cast<uint4*>(y)[g] = o;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) y[4 * g + j] = rne_bf16(x[4 * g + j]) << 16;
        }
    }
    if (t0 < (n & 3)) y[4 * groups + t0] = rne_bf16(x[4 * groups + t0]) << 16;
}

extern "C" __global__ void __launch_bounds__(256)
cvt_bf16_to_f32(const u16* __restrict__ h, u32* __restrict__ y, long long n) {
    PDL_ENTRY();
    const i64 groups = n >> 2;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = ((reinterpret_cast<u64>(h) & 7) | (reinterpret_cast<u64>(y) & 15)) == 0;
    for (i64 g = t0; g < groups; g += stride) {
        if (vec) {
            const uint2 v = reinterpret_cast<const uint2*>(h)[g];
            uint4 o;
            o.x = v.x << 16;
            o.y = v.x & 0xFFFF0000u;
            o.z = v.y << 16;
            o.w = v.y & 0xFFFF0000u;
            reinterpret_cast<uint4*>(y)[g] = o;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) y[4 * g + j] = (u32)h[4 * g + j] << 16;
        }
    }
    if (t0 < (n & 3)) y[4 * groups + t0] = (u32)h[4 * groups + t0] << 16;
}
