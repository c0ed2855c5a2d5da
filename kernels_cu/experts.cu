// Routed-expert weights: MXFP4 / NVFP4 dequantisation and the fused FP4 GEMV of decode
// (dsv4_model_and_formats §9.4, §10).
//
// Packed layout (both formats): [out, in/2] bytes, element 2j in the LOW nibble of byte j,
// 2j+1 in the HIGH nibble; e2m1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign.
//
// dequant_mxfp4_bf16: W = e2m1 * 2^(S - 127) (S e8m0 per 32 inputs) -> bf16. The product has at
//   most 2 significant bits, so it is built directly on integer bits, bf16 subnormals included
//   (exact; independent of -ftz). Twin formats.dequant_mxfp4 (then exact bf16). S = 0xFF -> NaN.
// dequant_nvfp4_bf16: W = bf16( f32( f32(e2m1 * e4m3(S16)) * weight_scale_2 ) ), the twin's
//   formats.dequant_nvfp4 order, then RNE to bf16 (exact when the NVFP4 came from MXFP4).
//   Thread per 16-byte chunk (32 elements), grid-stride.
// gemv_mxfp4_k{1,2,4} / gemv_nvfp4_k{1,2,4}: y[s, o] = bf16( sum_k W_e[o, k] x[s / x_div, k] ),
//   e = expert_ids[s] read on the device (e < 0: the row is written as zeros). Weights are
//   reached through per-expert device pointer tables (u64 [E]: packed, scales; NVFP4 also a
//   weight_scale_2 f32 [E] array), so experts can live anywhere (a stacked [E, out, in/2] tensor
//   is the special case base + e * stride). The STORED bytes are read directly with 128-bit
//   loads: one uint4 = 32 e2m1 values = exactly one MXFP4 scale (two NVFP4 scales).
//   Layout: grid (ceil(O / 32), n_slots), block 256 = 8 warps x 4 rows. Lane l owns the input
//   chunks q = l + 32 i (i < KPL, K <= 1024*KPL) and keeps that slice of x in registers as packed
//   bf16 for all 4 rows. Per chunk: partial = sum of 32 products in element order (f32 FMA),
//   acc = fma(partial, block scale, acc) in chunk order, then a warp xor-tree; NVFP4 multiplies
//   weight_scale_2 once at the end. The order depends only on (o, K): decode rows are
//   reproducible and independent of the slot count. e2m1 decode: 16-entry f32 LUT in shared
//   memory (conflict-free: 16 words on 16 banks, equal addresses broadcast).
//   x is expected bf16; for the reference numeric class pass the FP8-simulated activation
//   (quant_sim fp8_sim_b128), which makes sum_k exactly the reference's fp4_gemm up to order.
#include "common.cuh"

using namespace memra;

namespace {

// e2m1 nibble n times 2^(sb - 127) as bf16 bits, exact (sb = e8m0 byte).
DEV u32 mx_to_bf16(u32 n, u32 sb) {
    const u32 sign = (n & 8u) << 12;
    const u32 c = n & 7u;
    if (sb == 255u) return 0x7fc0u;
    if (c == 0u) return sign;
    const int ec = c == 1u ? -1 : (int)(c >> 1) - 1;
    const u32 m = c == 1u ? 0u : (c & 1u);
    const int E = ec + (int)sb;  // biased bf16 exponent
    if (E >= 255) return sign | 0x7f80u;
    if (E >= 1) return sign | ((u32)E << 7) | (m << 6);
    return sign | ((2u + m) << (E + 5));  // subnormal: (1 + m/2) 2^(E-127) = (2+m) 2^(E+5) * 2^-133
}

}  // namespace

// packed [R, C/2] u8; scale [R, C/32] u8; out [R, C] bf16. C % 32 == 0.
extern "C" __global__ void __launch_bounds__(256)
dequant_mxfp4_bf16(const u8* __restrict__ packed, const u8* __restrict__ scale, u16* __restrict__ out,
                   long long R, int C) {
    const int cpr = C >> 5;
    const i64 total = R * cpr;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const uint4 w = ldg16(packed + q * 16);  // chunk q = row q / cpr, 32 elements
        const u32 sb = __ldg(scale + q);
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        uint4* o = reinterpret_cast<uint4*>(out + q * 32);
#pragma unroll
        for (int v = 0; v < 4; ++v) {  // 8 elements per word
            u32 h[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) h[i] = mx_to_bf16((ws[v] >> (4 * i)) & 15u, sb);
            o[v] = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
        }
    }
}

// packed [R, C/2] u8; wscale [R, C/16] u8 (e4m3); ws2 f32 scalar; out [R, C] bf16. C % 32 == 0.
extern "C" __global__ void __launch_bounds__(256)
dequant_nvfp4_bf16(const u8* __restrict__ packed, const u8* __restrict__ wscale, float ws2,
                   u16* __restrict__ out, long long R, int C) {
    const int cpr = C >> 5;
    const i64 total = R * cpr;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const uint4 w = ldg16(packed + q * 16);
        const float s0 = e4m3_to_f32(__ldg(wscale + 2 * q)), s1 = e4m3_to_f32(__ldg(wscale + 2 * q + 1));
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        uint4* o = reinterpret_cast<uint4*>(out + q * 32);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const float s = v < 2 ? s0 : s1;
            float f[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(__fmul_rn(e2m1_to_f32((ws[v] >> (4 * i)) & 15u), s), ws2);
            o[v] = pack8(f);
        }
    }
}

namespace {

constexpr int GV_WARPS = 8;
constexpr int GV_RPW = 4;  // rows per warp
constexpr int GV_ROWS = GV_WARPS * GV_RPW;

// sum_{e<8} lut[nibble e of w] * x_e, in element order, continuing `acc`
DEV float dot8(u32 w, u32 xa, u32 xb, u32 xc, u32 xd, const float* lut, float acc) {
    acc = __fmaf_rn(lut[w & 15u], bf16lo(xa), acc);
    acc = __fmaf_rn(lut[(w >> 4) & 15u], bf16hi(xa), acc);
    acc = __fmaf_rn(lut[(w >> 8) & 15u], bf16lo(xb), acc);
    acc = __fmaf_rn(lut[(w >> 12) & 15u], bf16hi(xb), acc);
    acc = __fmaf_rn(lut[(w >> 16) & 15u], bf16lo(xc), acc);
    acc = __fmaf_rn(lut[(w >> 20) & 15u], bf16hi(xc), acc);
    acc = __fmaf_rn(lut[(w >> 24) & 15u], bf16lo(xd), acc);
    acc = __fmaf_rn(lut[w >> 28], bf16hi(xd), acc);
    return acc;
}

template <int KPL, bool NV>
DEV void gemv_fp4_body(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,
                       const u64* __restrict__ wptr, const u64* __restrict__ sptr,
                       const float* __restrict__ ws2, u16* __restrict__ y, int ld_y, int O, int K) {
    __shared__ float lut[16];
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1_to_f32(threadIdx.x);
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const i64 slot = blockIdx.y;
    const int e = __ldg(expert_ids + slot);
    const int o0 = blockIdx.x * GV_ROWS + wid * GV_RPW;
    u16* yr = y + slot * ld_y;
    if (e < 0) {
        if (lane < GV_RPW && o0 + lane < O) yr[o0 + lane] = 0;
        return;
    }
    const int nq = K >> 5;  // 32-element chunks per row
    // this lane's slice of x: chunk q = lane + 32 i -> 32 bf16 = 16 packed words
    const u16* xr = x + (slot / x_div) * (i64)K;
    uint4 xv[KPL][4];
#pragma unroll
    for (int i = 0; i < KPL; ++i) {
        const int q = lane + 32 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[i][j] = q < nq ? ldg16(xr + 32 * q + 8 * j) : make_uint4(0, 0, 0, 0);
    }
    const u8* wbase = reinterpret_cast<const u8*>(__ldg(wptr + e));
    const u8* sbase = reinterpret_cast<const u8*>(__ldg(sptr + e));
    // issue every weight load of the warp's rows up front (GV_RPW * KPL 16-byte loads per lane
    // in flight), then reduce row by row
    uint4 wv[GV_RPW][KPL];
#pragma unroll
    for (int r = 0; r < GV_RPW; ++r) {
        const u8* wrow = wbase + (i64)(o0 + r) * (K >> 1);
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            const int q = lane + 32 * i;
            wv[r][i] = (o0 + r < O && q < nq) ? ldg16(wrow + 16 * q) : make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int r = 0; r < GV_RPW; ++r) {
        const int o = o0 + r;
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            const int q = lane + 32 * i;
            if (o < O && q < nq) {
                const uint4 w = wv[r][i];
                if (!NV) {
                    float p = 0.0f;
                    p = dot8(w.x, xv[i][0].x, xv[i][0].y, xv[i][0].z, xv[i][0].w, lut, p);
                    p = dot8(w.y, xv[i][1].x, xv[i][1].y, xv[i][1].z, xv[i][1].w, lut, p);
                    p = dot8(w.z, xv[i][2].x, xv[i][2].y, xv[i][2].z, xv[i][2].w, lut, p);
                    p = dot8(w.w, xv[i][3].x, xv[i][3].y, xv[i][3].z, xv[i][3].w, lut, p);
                    const u32 sb = __ldg(sbase + (i64)o * nq + q);
                    acc = __fmaf_rn(p, e8m0_to_f32(sb), acc);
                } else {
                    float p0 = 0.0f, p1 = 0.0f;
                    p0 = dot8(w.x, xv[i][0].x, xv[i][0].y, xv[i][0].z, xv[i][0].w, lut, p0);
                    p0 = dot8(w.y, xv[i][1].x, xv[i][1].y, xv[i][1].z, xv[i][1].w, lut, p0);
                    p1 = dot8(w.z, xv[i][2].x, xv[i][2].y, xv[i][2].z, xv[i][2].w, lut, p1);
                    p1 = dot8(w.w, xv[i][3].x, xv[i][3].y, xv[i][3].z, xv[i][3].w, lut, p1);
                    const u8* sp = sbase + (i64)o * (K >> 4) + 2 * q;
                    acc = __fmaf_rn(p0, e4m3_to_f32(__ldg(sp)), acc);
                    acc = __fmaf_rn(p1, e4m3_to_f32(__ldg(sp + 1)), acc);
                }
            }
        }
        acc = warp_sum(acc);
        if (NV) acc = __fmul_rn(acc, __ldg(ws2 + e));
        if (lane == 0 && o < O) yr[o] = (u16)f32_to_bf16(acc);
    }
}

}  // namespace

// x: [n_x, K] bf16; x row of slot s = s / x_div; expert_ids: [n_slots] int32; wptr/sptr: u64 [E]
// device pointers to packed [O, K/2] and scales ([O, K/32] e8m0 | [O, K/16] e4m3); ws2: f32 [E]
// (NVFP4); y: [n_slots, ld_y] bf16. K % 32 == 0, K <= 1024*KPL. grid (ceil(O/32), n_slots), block 256.
#define GEMV_FP4(NAME, KPL, NV)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 1)                                          \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         u16* __restrict__ y, int ld_y, int O, int K) {                                           \
        gemv_fp4_body<KPL, NV>(x, x_div, expert_ids, wptr, sptr, ws2, y, ld_y, O, K);             \
    }

GEMV_FP4(gemv_mxfp4_k1, 1, false)
GEMV_FP4(gemv_mxfp4_k2, 2, false)
GEMV_FP4(gemv_mxfp4_k4, 4, false)
GEMV_FP4(gemv_nvfp4_k1, 1, true)
GEMV_FP4(gemv_nvfp4_k2, 2, true)
GEMV_FP4(gemv_nvfp4_k4, 4, true)
