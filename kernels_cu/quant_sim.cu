// Quantisation simulations (QAT fake-quant of the reference) and the Hadamard-128 rotation.
//
// fp8_sim_b64 / fp8_sim_b128: in place on dims [0, nq) of every row, per block of B:
//   amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax * f32(1/448))) (ue8m0 bit rule),
//   x <- bf16(e4m3_RNE(clip(x/s, +-448)) * s). Twin host.quant.fp8_sim / kv_fp8_sim (nq = n - rope).
//   Bit-exact (every step is exact or a single RNE).
// fp4_sim_b32: the same with e2m1 (clip +-6, amax floor 6*2^-126, f32(1/6)); twin host.quant.fp4_sim.
// hadamard128_bf16: y = bf16(x @ H_128 * 128^-1/2) per row, Sylvester natural order
//   (scipy.linalg.hadamard), twin oracle.ops.hadamard. Fast Walsh-Hadamard in double (exact for
//   bf16 inputs), scaled in double, stored f64 -> f32 -> bf16: bit-exact.
// hadamard128_fp4_bf16: the same followed by fp4_sim_b32 on the bf16 result (the indexer's
//   rotate + fp4_act_quant, M:414-416 and M:372 with rotate=True).
//
// Layouts: block-quant kernels give each lane one 16-byte chunk (8 elements), B/8 lanes per
// block, amax by an xor-butterfly inside the lane group. Hadamard: one warp per 128-row, lane l
// holds elements 4l..4l+3; butterflies h = 1, 2 in registers, h = 4..64 across lanes (lane ^ h/4).
#include "common.cuh"

using namespace memra;

namespace {

template <int B, bool FP4>
DEV void block_sim(u16* x, i64 rows, int n, int nq) {
    constexpr int G = B / 8;  // lanes per block
    const int bpr = nq / B;   // blocks per row
    const i64 nlanes = rows * bpr * G;
    // every lane of a warp must reach the shuffles: iterate over whole warps
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + (threadIdx.x & ~31); base < nlanes; base += stride) {
        const i64 g = base + (threadIdx.x & 31);
        const bool ok = g < nlanes;
        const i64 blk = g / G;
        const int sub = (int)(g % G);
        const i64 row = blk / (bpr > 0 ? bpr : 1);
        const int b = (int)(blk - row * bpr);
        u16* p = x + row * n + (i64)b * B + 8 * sub;
        float f[8];
        float amax = 0.0f;
        if (ok) {
            unpack8(*reinterpret_cast<const uint4*>(p), f);
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
        }
        amax = group_max<G>(amax);
        if (ok) {
            if (FP4) {
                const int e = ue8m0_exp(fmaxf(amax, fp4_amax_floor()), inv_6());
#pragma unroll
                for (int i = 0; i < 8; ++i) f[i] = fp4_sim_value(f[i], e);
            } else {
                const int e = ue8m0_exp(fmaxf(amax, act_amax_floor()), inv_448());
#pragma unroll
                for (int i = 0; i < 8; ++i) f[i] = fp8_sim_value(f[i], e);
            }
            stg16(p, pack8(f));
        }
    }
}

}  // namespace

// x: [rows, n] bf16 in place; quantises dims [0, nq), nq % B == 0, n % 8 == 0. Any grid (stride loop).
extern "C" __global__ void __launch_bounds__(256)
fp8_sim_b64(u16* x, long long rows, int n, int nq) { PDL_ENTRY(); block_sim<64, false>(x, rows, n, nq); }

extern "C" __global__ void __launch_bounds__(256)
fp8_sim_b128(u16* x, long long rows, int n, int nq) { PDL_ENTRY(); block_sim<128, false>(x, rows, n, nq); }

extern "C" __global__ void __launch_bounds__(256)
fp4_sim_b32(u16* x, long long rows, int n, int nq) { PDL_ENTRY(); block_sim<32, true>(x, rows, n, nq); }

namespace memra {

// bf16 values (4 per lane) -> Hadamard -> bf16 for one warp-row; optional fp4 sim (blocks of
// 32 = 8 lanes)
template <bool FP4>
DEV void hadamard128_vals(const float* in, u16* yr) {
    const int lane = threadIdx.x & 31;
    double v[4] = {(double)in[0], (double)in[1], (double)in[2], (double)in[3]};
    fwht128_warp(v);
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        f[i] = round_bf16(__double2float_rn(__dmul_rn(v[i], 0.08838834764831845)));  // 128^-0.5 (f64)
    if (FP4) {
        float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
        amax = group_max<8>(amax);
        const int e = ue8m0_exp(fmaxf(amax, fp4_amax_floor()), inv_6());
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = fp4_sim_value(f[i], e);
    }
    uint2 o;
    o.x = pack_bf16x2(f[0], f[1]);
    o.y = pack_bf16x2(f[2], f[3]);
    *reinterpret_cast<uint2*>(yr + 4 * lane) = o;
}

template <bool FP4>
DEV void hadamard128_row(const u16* xr, u16* yr) {
    const int lane = threadIdx.x & 31;
    const uint2 w = *reinterpret_cast<const uint2*>(xr + 4 * lane);
    const float f[4] = {bf16lo(w.x), bf16hi(w.x), bf16lo(w.y), bf16hi(w.y)};
    hadamard128_vals<FP4>(f, yr);
}

}  // namespace memra

// Indexer q: RoPE of the last R dims of each 128-dim head at pos[row / H] (double math, stored
// bf16), then Hadamard-128, then fp4 sim: = fp4_sim(hadamard(apply_rope(q)), 32) (M:411-416).
// x, y: [T*H, 128] bf16 (y may alias x); pos [T] int32; cos/sin [n_pos, R/2] f32. One warp per row.
// The RoPE lanes' position and cos / sin are loaded BEFORE the PDL wait (PDL_ENTRY_PRELOAD: static
// tables; the position written before the chain starts, read through L2, as head_rope_preload).
struct QsRope {
    float c[2], s[2];
};
DEV QsRope rope_h128_preload(const int* __restrict__ pos, const float* __restrict__ cos_t,
                             const float* __restrict__ sin_t, int R, i64 row, long long rows, int H) {
    QsRope q;
    q.c[0] = q.c[1] = q.s[0] = q.s[1] = 0.0f;
    const int lane = threadIdx.x & 31;
    if (row < rows && 4 * lane >= 128 - R) {
        const i64 trow = (i64)__ldcg(pos + row / H) * (R >> 1) + ((4 * lane - (128 - R)) >> 1);
        rope_pairs_ldg(cos_t, sin_t, trow, q.c, q.s);
    }
    return q;
}
extern "C" __global__ void __launch_bounds__(256)
rope_hadamard128_fp4_bf16(const u16* x, u16* y, long long rows, int H, const int* __restrict__ pos,
                          const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R) {
    PDL_ENTRY_PRELOAD(const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
                      const QsRope rp = rope_h128_preload(pos, cos_t, sin_t, R, row, rows, H));
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const uint2 w = *reinterpret_cast<const uint2*>(x + row * 128 + 4 * lane);
    float f[4] = {bf16lo(w.x), bf16hi(w.x), bf16lo(w.y), bf16hi(w.y)};
    if (4 * lane >= 128 - R) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            rope_pair(f[i], f[i + 1], rp.c[i >> 1], rp.s[i >> 1], false);
            f[i] = round_bf16(f[i]);
            f[i + 1] = round_bf16(f[i + 1]);
        }
    }
    hadamard128_vals<true>(f, y + row * 128);
}

// x, y: [rows, 128] bf16 (y may alias x). One warp per row, block 256 (8 rows), grid ceil(rows/8).
extern "C" __global__ void __launch_bounds__(256)
hadamard128_bf16(const u16* x, u16* y, long long rows) { PDL_ENTRY();
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps exit together
    hadamard128_row<false>(x + row * 128, y + row * 128);
}

extern "C" __global__ void __launch_bounds__(256)
hadamard128_fp4_bf16(const u16* x, u16* y, long long rows) { PDL_ENTRY();
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    hadamard128_row<true>(x + row * 128, y + row * 128);
}
