// The per-head q norm (+ the q RoPE) of one row by one warp: the body of rmsnorm.cu's
// head_rms_bf16, shared with attention.cu's sparse_attn_*_qn kernels, which apply it to their
// heads' q rows at the q load (the device step's MEMRA_DSV4_DECODE_QNORM = attn).  Both kernels
// run this one function, so the normed values are the same bits by construction.
//
// Twin NumericsPolicy.head_rms (M:498) then oracle.ops.apply_rope (M:499): in bf16 tensor
// arithmetic sq = bf16(x*x); mean = bf16(f32(mean(sq))); var = bf16(mean + f32(eps));
// r = bf16(f32(1/sqrt(var))); y = bf16(x * r); then the last R dims rotated at the row's position
// (double math as rope.cu, each value rounded f64 -> f32 -> bf16).
//
// Fixed order: lane l owns the 8-dim chunks c = l, l + 32, ... (n / 8 chunks); its squares are
// added in double in chunk / element order, then warp_sum's xor tree (every lane ends with the
// same sum); everything after that is elementwise.  Every f32 operation is an explicit _rn
// intrinsic and every double one is IEEE (no contraction), so the bits do not depend on the
// kernel the function is inlined into (both modules compile with the same options).
#pragma once

#include "common.cuh"

namespace memra {

// xr: the row's n bf16 values (n % 8 == 0, 16-byte aligned; read twice through the read-only path,
// so it must not be written during the call except by `store` of the same lane's chunk, after
// that chunk's last read: y may alias x).  pos null: no RoPE; else the last R dims (R % 8 == 0,
// R <= n) are rotated at position pos[tok()] with cos / sin [n_pos, R/2] f32 rows.  tok() is
// evaluated only where a chunk is rotated.  store(c, v): chunk c's 8 outputs as packed bf16 (each
// chunk of the row exactly once, by its owning lane).
template <typename Tok, typename Store>
DEV void head_rms_warp_row(const u16* xr, int n, float eps, const int* __restrict__ pos, const Tok& tok,
                           const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R,
                           const Store& store) {
    const int lane = threadIdx.x & 31;
    const int nc = n >> 3;
    double ss = 0.0;
    for (int c = lane; c < nc; c += 32) {
        float f[8];
        unpack8(ldg16(xr + 8 * c), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = __dadd_rn(ss, (double)round_bf16(__fmul_rn(f[i], f[i])));
    }
    ss = warp_sum(ss);  // bf16 squares: the double sum is exact for any realistic range
    const float mean = round_bf16(__double2float_rn(ss / (double)n));
    const float var = round_bf16(__fadd_rn(mean, eps));
    const float r = round_bf16(__double2float_rn(1.0 / sqrt((double)var)));
    for (int c = lane; c < nc; c += 32) {
        float f[8];
        unpack8(ldg16(xr + 8 * c), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = round_bf16(__fmul_rn(f[i], r));
        if (pos != nullptr && 8 * c >= n - R) {
            const i64 trow = (i64)__ldg(pos + tok()) * (R >> 1) + ((8 * c - (n - R)) >> 1);
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                rope_pair(f[i], f[i + 1], __ldg(cos_t + trow + (i >> 1)), __ldg(sin_t + trow + (i >> 1)), false);
                f[i] = round_bf16(f[i]);
                f[i + 1] = round_bf16(f[i + 1]);
            }
        }
        store(c, pack8(f));
    }
}

}  // namespace memra
