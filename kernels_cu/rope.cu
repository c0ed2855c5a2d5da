// Interleaved RoPE on the last R dims of every head, in place (M:232-244), twin oracle.ops.apply_rope.
//
// Pair i of a head is (x[D-R+2i], x[D-R+2i+1]); forward multiplies by e^{i theta}, inverse by
// e^{-i theta}. cos/sin are f32 tables [n_pos, R/2] (host.rope.cos_sin), row pos[t] for token t.
// The twin evaluates a*c - b*s, a*s + b*c in float64 and stores (f64 -> f32 -> bf16); the products
// of a bf16 and an f32 are exact in double, so doing the same double ops here (explicit _rn, no
// FMA) is bit-identical to the twin.
//
// Layout: one thread per 4 pairs (one 16-byte chunk); grid-stride over T*H*(R/8) chunks.
#include "common.cuh"

using namespace memra;

// x: [T, H, D] bf16 (rows of D contiguous, 16-byte aligned); pos: [T] int32 (row of the tables);
// cos, sin: [n_pos, R/2] f32. R % 8 == 0, (D - R) % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
rope_bf16(u16* x, const int* __restrict__ pos, const float* __restrict__ cos_t,
          const float* __restrict__ sin_t, int T, int H, int D, int R, int inverse) { PDL_ENTRY();
    const int cpr = R >> 3;  // chunks per head
    const i64 total = (i64)T * H * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        const int ch = (int)(i % cpr);
        const i64 row = i / cpr;  // t * H + h
        const int t = (int)(row / H);
        u16* p = x + row * D + (D - R) + 8 * ch;
        const i64 trow = (i64)__ldg(pos + t) * (R >> 1) + 4 * ch;
        const float4 c4 = __ldg(reinterpret_cast<const float4*>(cos_t + trow));
        const float4 s4 = __ldg(reinterpret_cast<const float4*>(sin_t + trow));
        const float c[4] = {c4.x, c4.y, c4.z, c4.w};
        const float s[4] = {s4.x, s4.y, s4.z, s4.w};
        float f[8];
        unpack8(*reinterpret_cast<const uint4*>(p), f);
#pragma unroll
        for (int j = 0; j < 4; ++j) rope_pair(f[2 * j], f[2 * j + 1], c[j], s[j], inverse != 0);
        stg16(p, pack8(f));
    }
}
