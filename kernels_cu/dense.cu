// Dense FP8 linears kept as stored (the `dense = fp8` arm, dsv4_model_and_formats §9.4, §10).
//
// Stored layout: e4m3fn weight W [R, C] (u8) + e8m0 block scale S [ceil(R/128), ceil(C/128)]
// (u8): W[r, c] = e4m3(W) * 2^(S[r / 128, c / 128] - 127).
//
// dequant_fp8_bf16: W -> bf16 bits [R, C], built on integer bits (independent of -ftz). The
//   product has at most 4 significant bits, so it is EXACT in bf16 whenever the loader accepted
//   the tensor (formats.dequant_fp8_block_bf16 = f32_to_bf16_exact(dequant_fp8_block): no NaN
//   code, no S = 0xFF, no overflow, no bf16-subnormal bits lost); the kernel then equals that twin
//   bit for bit. Outside that domain (refused at load, never reached from a model) it is still
//   defined as the twin's encode_bf16 of the float32 product: RNE on the bf16 subnormal grid,
//   +-inf on float32 overflow, 0x7FC0 for a NaN code or S = 0xFF.
//   Used by the chunk routine (prefill / legacy decode): dequantise into a reused bf16 scratch,
//   then the same cuBLASLt bf16 GEMM as the bf16 arm, so both arms give the same bits.
//   Vector path (C % 16 == 0, 16-byte aligned pointers: the wrapper decides): one item = 16
//   consecutive elements of one row (one 16-byte load, all in one scale block, two 16-byte
//   stores), grid-stride. Scalar path otherwise: one element per item.
#include "common.cuh"

using namespace memra;

namespace {

// e4m3fn byte b times 2^(s - 127) (s = e8m0 byte) as bf16 bits; see the file comment.
DEV u32 fp8_to_bf16(u32 b, u32 s) {
    const u32 sign = (b & 0x80u) << 8;
    const u32 c = b & 0x7fu;
    if (c == 0x7fu || s == 255u) return 0x7fc0u;
    const u32 e = c >> 3;
    const u32 M = e ? (8u | (c & 7u)) : (c & 7u);   // |value| = M * 2^(k + s - 127)
    if (M == 0u) return sign;
    const int k = e ? (int)e - 10 : -9;
    const int p = 31 - __clz((int)M);               // M in [2^p, 2^(p+1)), p <= 3
    const int E = p + k + (int)s;                   // biased exponent of the product
    if (E >= 255) return sign | 0x7f80u;            // float32 overflow -> inf
    if (E >= 1) return sign | ((u32)E << 7) | ((M << (7 - p)) & 0x7fu);
    const int sh = k + (int)s + 6;                  // bf16 subnormal: |value| = (M * 2^sh) * 2^-133
    if (sh >= 0) return sign | (M << sh);
    const int r = -sh;                              // 1..3 bits lost: RNE
    u32 q = M >> r;
    const u32 rem = M & ((1u << r) - 1u), half = 1u << (r - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | q;
}

}  // namespace

// w [R, C] u8 (e4m3); scale [ceil(R/128), ceil(C/128)] u8 (e8m0); out [R, C] u16 (bf16 bits).
// vec != 0 only when C % 16 == 0 and w, out are 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256)
dequant_fp8_bf16(const u8* __restrict__ w, const u8* __restrict__ scale, u16* __restrict__ out,
                 long long R, int C, int vec) { PDL_ENTRY();
    const i64 sc = (C + 127) >> 7;
    const i64 step = (i64)gridDim.x * blockDim.x;
    if (vec) {
        const i64 cpr = C >> 4;
        const i64 total = R * cpr;
        for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += step) {
            const i64 r = q / cpr;
            const i64 c0 = (q - r * cpr) << 4;
            const u32 s = __ldg(scale + (r >> 7) * sc + (c0 >> 7));
            const uint4 v = ldg16(w + q * 16);
            const u32 ws[4] = {v.x, v.y, v.z, v.w};
            u32 h[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                h[2 * j] = fp8_to_bf16(ws[j] & 0xffu, s) | (fp8_to_bf16((ws[j] >> 8) & 0xffu, s) << 16);
                h[2 * j + 1] = fp8_to_bf16((ws[j] >> 16) & 0xffu, s) | (fp8_to_bf16(ws[j] >> 24, s) << 16);
            }
            uint4* o = reinterpret_cast<uint4*>(out + q * 16);
            o[0] = make_uint4(h[0], h[1], h[2], h[3]);
            o[1] = make_uint4(h[4], h[5], h[6], h[7]);
        }
    } else {
        const i64 total = R * (i64)C;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
            const i64 r = i / C;
            const i64 c = i - r * C;
            out[i] = (u16)fp8_to_bf16(__ldg(w + i), __ldg(scale + (r >> 7) * sc + (c >> 7)));
        }
    }
}
