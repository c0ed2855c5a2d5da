// MoE elementwise kernels: clamped SwiGLU and the combine (dsv4_model_and_formats §5.2-5.4).
//
// swiglu_clamped_bf16: h = bf16( w_s * (f32(silu(min(g, L))) * f32(clip(u, -L, L))) ) per slot s,
//   twin oracle.ops.swiglu_clamped followed by the store of the w2 input: silu in double
//   (g / (1 + exp(-g))) rounded to f32, then the two f32 products of the twin (no FMA).
//   limit <= 0 disables the clamps; weight null = no routing weight (shared expert).
//   gate/up rows have strides ld_g/ld_u (so a fused [S, 2I] gate|up buffer works).
//   Grid-stride, one thread per 8 elements.
// moe_combine_bf16: y[t] = bf16( (0 + sum over the k picks in ASCENDING expert id (stable) of
//   routed[t, j]) + shared[t] ), f32 accumulator, bit-identical to oracle.ops.moe_combine.
//   Grid (T, ceil(D/1024)), block 128, thread = 8 channels.
#include "common.cuh"

using namespace memra;

// gate, up: [S, I] bf16 with row strides ld_g, ld_u; weight: [S] f32 or null; h: [S, ld_h] bf16.
extern "C" __global__ void __launch_bounds__(256)
swiglu_clamped_bf16(const u16* __restrict__ gate, int ld_g, const u16* __restrict__ up, int ld_u,
                    const float* __restrict__ weight, u16* __restrict__ h, int ld_h, int S, int I,
                    double limit) { PDL_ENTRY();
    const int cpr = I >> 3;
    const i64 total = (i64)S * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 s = i / cpr;
        const int c = (int)(i % cpr);
        float g[8], u[8], o[8];
        unpack8(ldg16(gate + s * ld_g + 8 * c), g);
        unpack8(ldg16(up + s * ld_u + 8 * c), u);
        const float ws = weight != nullptr ? __ldg(weight + s) : 1.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = swiglu_value(g[e], u[e], ws, weight != nullptr, limit);
        stg16(h + s * ld_h + 8 * c, pack8(o));
    }
}

// routed: [T*k, D] bf16 (pick j of token t at row t*k + j); idx: [T, k] int32 expert ids;
// shared: [T, D] bf16 or null; y: [T, D] bf16. k <= 16. grid (T, ceil(D/1024)), block 128.
extern "C" __global__ void __launch_bounds__(128)
moe_combine_bf16(const u16* __restrict__ routed, const int* __restrict__ idx,
                 const u16* __restrict__ shared, u16* __restrict__ y, int D, int k) { PDL_ENTRY();
    __shared__ int order[16];
    __shared__ int ids[16];
    const i64 t = blockIdx.x;
    if (threadIdx.x == 0) {  // stable insertion sort of the picks by expert id
        for (int j = 0; j < k; ++j) {
            const int e = idx[t * k + j];
            int p = j;
            while (p > 0 && ids[p - 1] > e) {
                ids[p] = ids[p - 1];
                order[p] = order[p - 1];
                --p;
            }
            ids[p] = e;
            order[p] = j;
        }
    }
    __syncthreads();
    const int c = blockIdx.y * 128 + threadIdx.x;
    if (8 * c >= D) return;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
        float f[8];
        unpack8(ldg16(routed + (t * k + order[j]) * D + 8 * c), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
    }
    if (shared != nullptr) {
        float f[8];
        unpack8(ldg16(shared + t * D + 8 * c), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
    }
    stg16(y + t * D + 8 * c, pack8(acc));
}
