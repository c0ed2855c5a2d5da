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

// this lane's slice of an activation row: chunks q = lane + 32 i (32 bf16 = 4 x uint4 each)
template <int KPL>
DEV void load_x_slice(const u16* xr, int lane, int nq, uint4 (&xv)[KPL][4]) {
#pragma unroll
    for (int i = 0; i < KPL; ++i) {
        const int q = lane + 32 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[i][j] = q < nq ? ldg16(xr + 32 * q + 8 * j) : make_uint4(0, 0, 0, 0);
    }
}

// the lane's 16-byte weight chunks of RPW consecutive rows (issued together: RPW*KPL loads in flight)
template <int KPL, int RPW>
DEV void load_rows(const u8* wbase, int o0, int O, int K, int lane, int nq, uint4 (&wv)[RPW][KPL]) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const u8* wrow = wbase + (i64)(o0 + r) * (K >> 1);
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            const int q = lane + 32 * i;
            wv[r][i] = (o0 + r < O && q < nq) ? ldg16(wrow + 16 * q) : make_uint4(0, 0, 0, 0);
        }
    }
}

// THE row dot of the FP4 GEMVs: per chunk a 32-product f32 partial (element order) times the block
// scale, chunks in order, then a warp xor-tree; NVFP4 multiplies weight_scale_2 at the end.
// Every lane returns the full value (0 for o >= O). Shared by every GEMV kernel, so the plain and
// the fused MoE kernels produce identical bits.
template <int KPL, bool NV>
DEV float row_dot(const uint4 (&wr)[KPL], const uint4 (&xv)[KPL][4], const u8* sbase, int o, int O, int K,
                  int lane, int nq, const float* lut, float ws2) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < KPL; ++i) {
        const int q = lane + 32 * i;
        if (o < O && q < nq) {
            const uint4 w = wr[i];
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
    return NV ? __fmul_rn(acc, ws2) : acc;
}

DEV void init_lut(float* lut) {
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1_to_f32(threadIdx.x);
    __syncthreads();
}

template <int KPL, bool NV>
DEV void gemv_fp4_body(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,
                       const u64* __restrict__ wptr, const u64* __restrict__ sptr,
                       const float* __restrict__ ws2, u16* __restrict__ y, int ld_y, int O, int K) {
    __shared__ float lut[16];
    init_lut(lut);
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
    uint4 xv[KPL][4];
    load_x_slice<KPL>(x + (slot / x_div) * (i64)K, lane, nq, xv);
    const u8* wbase = reinterpret_cast<const u8*>(__ldg(wptr + e));
    const u8* sbase = reinterpret_cast<const u8*>(__ldg(sptr + e));
    const float s2 = NV ? __ldg(ws2 + e) : 1.0f;
    uint4 wv[GV_RPW][KPL];
    load_rows<KPL, GV_RPW>(wbase, o0, O, K, lane, nq, wv);
#pragma unroll
    for (int r = 0; r < GV_RPW; ++r) {
        const float acc = row_dot<KPL, NV>(wv[r], xv, sbase, o0 + r, O, K, lane, nq, lut, s2);
        if (lane == 0 && o0 + r < O) yr[o0 + r] = (u16)f32_to_bf16(acc);
    }
}

// Fused gate/up GEMVs + clamped SwiGLU (MoE first half): h[s, o] = swiglu(bf16(W1 x), bf16(W3 x))
// with the routing weight of slot s; bit-identical to gemv(w1), gemv(w3), swiglu_clamped_bf16.
// Warp = GU_RPW rows of both matrices.
constexpr int GU_RPW = 2;
constexpr int GU_ROWS = GV_WARPS * GU_RPW;

template <int KPL, bool NV>
DEV void gemv_fp4_gateup_body(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,
                              const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr,
                              const float* __restrict__ ws2_1, const u64* __restrict__ w3ptr,
                              const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3,
                              const float* __restrict__ weight, double limit, u16* __restrict__ h,
                              int ld_h, int O, int K) {
    __shared__ float lut[16];
    init_lut(lut);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const i64 slot = blockIdx.y;
    const int e = __ldg(expert_ids + slot);
    const int o0 = blockIdx.x * GU_ROWS + wid * GU_RPW;
    u16* hr = h + slot * ld_h;
    if (e < 0) {
        if (lane < GU_RPW && o0 + lane < O) hr[o0 + lane] = 0;
        return;
    }
    const int nq = K >> 5;
    uint4 xv[KPL][4];
    load_x_slice<KPL>(x + (slot / x_div) * (i64)K, lane, nq, xv);
    const u8* w1 = reinterpret_cast<const u8*>(__ldg(w1ptr + e));
    const u8* w3 = reinterpret_cast<const u8*>(__ldg(w3ptr + e));
    const u8* sc1 = reinterpret_cast<const u8*>(__ldg(s1ptr + e));
    const u8* sc3 = reinterpret_cast<const u8*>(__ldg(s3ptr + e));
    const float a2 = NV ? __ldg(ws2_1 + e) : 1.0f, u2 = NV ? __ldg(ws2_3 + e) : 1.0f;
    const float ws = weight != nullptr ? __ldg(weight + slot) : 1.0f;
    uint4 wa[GU_RPW][KPL], wu[GU_RPW][KPL];
    load_rows<KPL, GU_RPW>(w1, o0, O, K, lane, nq, wa);
    load_rows<KPL, GU_RPW>(w3, o0, O, K, lane, nq, wu);
#pragma unroll
    for (int r = 0; r < GU_RPW; ++r) {
        const float a = round_bf16(row_dot<KPL, NV>(wa[r], xv, sc1, o0 + r, O, K, lane, nq, lut, a2));
        const float u = round_bf16(row_dot<KPL, NV>(wu[r], xv, sc3, o0 + r, O, K, lane, nq, lut, u2));
        if (lane == 0 && o0 + r < O) hr[o0 + r] = (u16)f32_to_bf16(swiglu_value(a, u, ws, weight != nullptr, limit));
    }
}

// Fused down GEMV + MoE combine (MoE second half): for token t with picks j = 0..k-1 (slot t*k + j,
// expert ids[t, j]), y[t, o] = bf16( (0 + sum over picks in ascending expert id (stable) of
// bf16(W2_e[o] . h[slot])) + shared[t, o] ); bit-identical to gemv(w2) then moe_combine_bf16.
// Grid (ceil(O/32), T): a warp walks the token's picks in that order for its 4 rows.
template <int KPL, bool NV>
DEV void gemv_fp4_down_combine_body(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,
                                    const u64* __restrict__ wptr, const u64* __restrict__ sptr,
                                    const float* __restrict__ ws2, const u16* __restrict__ shared,
                                    u16* __restrict__ y, int ld_y, int O, int K) {
    __shared__ float lut[16];
    __shared__ int order[16];
    __shared__ int ids[16];
    const i64 t = blockIdx.y;
    if (threadIdx.x == 0) {  // stable insertion sort of the picks by expert id
        for (int j = 0; j < k; ++j) {
            const int e = __ldg(expert_ids + t * k + j);
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
    init_lut(lut);  // (its barrier also publishes the order)
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int o0 = blockIdx.x * GV_ROWS + wid * GV_RPW;
    const int nq = K >> 5;
    float acc[GV_RPW];
#pragma unroll
    for (int r = 0; r < GV_RPW; ++r) acc[r] = 0.0f;
    // software pipeline over the picks (KPL <= 2; KPL = 4 would spill): the next pick's activation
    // slice and weight rows are in flight while the current one is reduced. The arithmetic is the
    // same either way.
    constexpr bool PF = KPL <= 2;
    uint4 xc[KPL][4], wc[GV_RPW][KPL], xn[KPL][4], wn[GV_RPW][KPL];
    const u8* sc = nullptr;
    const u8* sn = nullptr;
    float s2c = 1.0f, s2n = 1.0f;
    if (PF) {
        const int e = ids[0];
        if (e >= 0) {
            load_x_slice<KPL>(h + (t * k + order[0]) * (i64)K, lane, nq, xc);
            load_rows<KPL, GV_RPW>(reinterpret_cast<const u8*>(__ldg(wptr + e)), o0, O, K, lane, nq, wc);
            sc = reinterpret_cast<const u8*>(__ldg(sptr + e));
            s2c = NV ? __ldg(ws2 + e) : 1.0f;
        }
    }
    for (int j = 0; j < k; ++j) {
        const int e = ids[j];
        if (!PF && e >= 0) {
            load_x_slice<KPL>(h + (t * k + order[j]) * (i64)K, lane, nq, xc);
            load_rows<KPL, GV_RPW>(reinterpret_cast<const u8*>(__ldg(wptr + e)), o0, O, K, lane, nq, wc);
            sc = reinterpret_cast<const u8*>(__ldg(sptr + e));
            s2c = NV ? __ldg(ws2 + e) : 1.0f;
        }
        if (PF && j + 1 < k) {
            const int en = ids[j + 1];
            if (en >= 0) {
                load_x_slice<KPL>(h + (t * k + order[j + 1]) * (i64)K, lane, nq, xn);
                load_rows<KPL, GV_RPW>(reinterpret_cast<const u8*>(__ldg(wptr + en)), o0, O, K, lane, nq, wn);
                sn = reinterpret_cast<const u8*>(__ldg(sptr + en));
                s2n = NV ? __ldg(ws2 + en) : 1.0f;
            }
        }
        if (e < 0) {  // an empty pick contributes the zero row of gemv()
#pragma unroll
            for (int r = 0; r < GV_RPW; ++r) acc[r] = __fadd_rn(acc[r], 0.0f);
        } else {
#pragma unroll
            for (int r = 0; r < GV_RPW; ++r)
                acc[r] = __fadd_rn(acc[r], round_bf16(row_dot<KPL, NV>(wc[r], xc, sc, o0 + r, O, K, lane, nq, lut, s2c)));
        }
        if (PF) {
#pragma unroll
            for (int i = 0; i < KPL; ++i) {
#pragma unroll
                for (int q4 = 0; q4 < 4; ++q4) xc[i][q4] = xn[i][q4];
#pragma unroll
                for (int r = 0; r < GV_RPW; ++r) wc[r][i] = wn[r][i];
            }
            sc = sn;
            s2c = s2n;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GV_RPW; ++r) {
            const int o = o0 + r;
            if (o < O) {
                float v = acc[r];
                if (shared != nullptr) v = __fadd_rn(v, bf16_to_f32(__ldg(shared + t * O + o)));
                y[t * ld_y + o] = (u16)f32_to_bf16(v);
            }
        }
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

// Fused MoE first half. x: [n_x, K] bf16 (slot s reads row s / x_div); expert_ids [S];
// w1ptr/s1ptr/ws2_1 and w3ptr/s3ptr/ws2_3: gate and up tables as in gemv_*; weight: [S] f32
// routing weights or null; limit <= 0: no clamp; h: [S, ld_h] bf16. grid (ceil(O/16), S), block 256.
#define GEMV_FP4_GATEUP(NAME, KPL, NV)                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1)                                          \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr, const float* __restrict__ ws2_1, \
         const u64* __restrict__ w3ptr, const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3, \
         const float* __restrict__ weight, double limit, u16* __restrict__ h, int ld_h, int O, int K) { \
        gemv_fp4_gateup_body<KPL, NV>(x, x_div, expert_ids, w1ptr, s1ptr, ws2_1, w3ptr, s3ptr, ws2_3,  \
                                      weight, limit, h, ld_h, O, K);                              \
    }

GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k1, 1, false)
GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k2, 2, false)
GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k4, 4, false)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k1, 1, true)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k2, 2, true)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k4, 4, true)

// Fused MoE second half. h: [T*k, K] bf16 (pick j of token t at row t*k + j, routing weight
// already applied); expert_ids [T, k] int32 (k <= 16); wptr/sptr/ws2: down tables; shared: [T, O]
// bf16 or null; y: [T, ld_y] bf16. grid (ceil(O/32), T), block 256.
#define GEMV_FP4_DOWN(NAME, KPL, NV)                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1)                                          \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ shared, u16* __restrict__ y, int ld_y, int O, int K) {            \
        gemv_fp4_down_combine_body<KPL, NV>(h, expert_ids, k, wptr, sptr, ws2, shared, y, ld_y, O, K); \
    }

GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k1, 1, false)
GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k2, 2, false)
GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k4, 4, false)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k1, 1, true)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k2, 2, true)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k4, 4, true)
