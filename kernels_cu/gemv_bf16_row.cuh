// The dense bf16 GEMV's per-row arithmetic (decode.cu's gemv_bf16_* / gemv_fp8_*: THE ORDER of
// warp_rows_dot), shared with experts.cu's gemv_*_down_combine_k2_f_w2, which computes the shared
// expert's w2 rows itself (the device step's MEMRA_DSV4_DECODE_SHARED_W2 = fused).  Both kernels
// run these functions, so the w2 row dots are the same bits by construction.
//
// THE ORDER (a function of K only): lane l owns the 8-column chunks c = l + 32 i; chunk i goes to
// partial i % GEMV_UNROLL while it belongs to a complete group of GEMV_UNROLL, the tail chunks to
// partial 0; each partial is a chain of __fmaf_rn over its chunks in ascending i, columns in
// ascending order; the partials are added in index order, then the butterfly warp_sum (xor 16, 8,
// 4, 2, 1).  (decode.cu's header comment of warp_rows_dot has the full statement.)  Every f32
// operation is an explicit _rn intrinsic or a plain add (no contraction candidates: the adds of
// partials_total / warp_sum have no multiply feeding them), and both modules compile with the same
// options, so the bits depend neither on the kernel the functions are inlined into nor on when a
// lane's loads are issued.
//   partials_total       the end of a row: partials in index order, then warp_sum
//   bf16_trip_fma        one trip (chunks c + 32 u, u < GEMV_UNROLL, into partial u) of R rows
//   bf16_rows_dot_k_by<R, K, TRIP_UNROLL>  R whole rows with K % (32 * 8 * GEMV_UNROLL) == 0
//                        (every lane has whole trips, no tail chunks; K = 1024 t): trips t = 0,
//                        1, ... of bf16_trip_fma, then partials_total: THE ORDER for such K; the
//                        caller says where each trip's weight chunks and x chunks come from
//                        (Bf16XGlobal: through L1; Bf16XShared: a shared-memory copy)
//   bf16_rows_dot_k<R, K>  the same over rows in global memory (Bf16RowsGlobal)
#pragma once

#include "common.cuh"

namespace memra {

constexpr int GEMV_UNROLL = 4;

// THE ORDER's end of a row: its partials added in index order, then the butterfly warp_sum
DEV float partials_total(const float (&p)[GEMV_UNROLL]) {
    float s = p[0];
#pragma unroll
    for (int u = 1; u < GEMV_UNROLL; ++u) s += p[u];
    return warp_sum(s);
}

// one bf16 trip of R rows (raw weight chunks w[r][u], x chunks xr[u]): chunk u into partial u,
// columns in ascending order, as rows_trip's T = 1 bf16 case (the persistent / preload variants)
template <int R>
DEV void bf16_trip_fma(const uint4 (&w)[R][GEMV_UNROLL], const uint4 (&xr)[GEMV_UNROLL],
                       float (&acc)[R][GEMV_UNROLL]) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        float b[8];
        unpack8(xr[u], b);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float a[8];
            unpack8(w[r][u], a);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][u] = __fmaf_rn(a[e], b[e], acc[r][u]);
        }
    }
}

// out[r] = row r . x on every lane (R bf16 rows of K columns, 16-byte aligned, K % 1024 == 0):
// lane l's trip t covers chunks c + 32 u (c = l + 128 t, u < GEMV_UNROLL) into partial u, t
// ascending: per partial the chain of warp_rows_dot over the lane's complete groups (there is no
// tail for such K), so THE ORDER.  `trip_w(t, c, w)` fills trip t's weight chunks w[r][u] (row r,
// chunk c + 32 u): where they come from (global memory, a shared-memory copy made earlier) is the
// caller's; the arithmetic is this function's alone.  TRIP_UNROLL trips are unrolled: all of
// them (the default) puts every trip's loads in flight at once; 1 keeps one trip's 4 R + 4 chunks
// live, for a caller holding other loads in registers (experts.cu's w2_rows_pre beside the
// primed FP4 ring).  x is read through L1.
// x chunk c (8 bf16) through L1 (the default x source of bf16_rows_dot_k_by)
struct Bf16XGlobal {
    const u16* __restrict__ x;
    DEV uint4 operator()(int c) const { return ldg16(x + (i64)c * 8); }
};

// x chunk c (8 bf16) from a copy in shared memory, 16-byte word c (experts.cu's gate/up + shared
// SwiGLU stages x there through L2 before its PDL wait: lane l reads word l + 32 u, conflict-free)
struct Bf16XShared {
    const uint4* xs;
    DEV uint4 operator()(int c) const { return xs[c]; }
};

template <int R, int K, int TRIP_UNROLL = K / (32 * 8 * GEMV_UNROLL), class TripW, class XSrc>
DEV void bf16_rows_dot_k_by(const TripW& trip_w, const XSrc& x_chunk, int lane, float (&out)[R]) {
    static_assert(K % (32 * 8 * GEMV_UNROLL) == 0, "bf16_rows_dot_k: K % 1024 == 0 (whole trips)");
    constexpr int TRIPS = K / (32 * 8 * GEMV_UNROLL);
    static_assert(TRIP_UNROLL >= 1 && TRIP_UNROLL <= TRIPS, "bf16_rows_dot_k: 1 <= TRIP_UNROLL <= trips");
    float acc[R][GEMV_UNROLL];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
#pragma unroll TRIP_UNROLL
    for (int t = 0; t < TRIPS; ++t) {
        const int c = lane + 32 * GEMV_UNROLL * t;
        uint4 w[R][GEMV_UNROLL], xr[GEMV_UNROLL];
        trip_w(t, c, w);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) xr[u] = x_chunk(c + 32 * u);
        bf16_trip_fma<R>(w, xr, acc);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = partials_total(acc[r]);
}

// a trip's chunks straight from R rows in global memory, streamed past L1 (ldg_stream16)
template <int R>
struct Bf16RowsGlobal {
    const u16* const (&wrow)[R];
    DEV void operator()(int, int c, uint4 (&w)[R][GEMV_UNROLL]) const {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) w[r][u] = ldg_stream16(wrow[r] + (i64)(c + 32 * u) * 8);
    }
};

// bf16_rows_dot_k_by over rows in global memory, every trip unrolled
template <int R, int K>
DEV void bf16_rows_dot_k(const u16* const (&wrow)[R], const u16* __restrict__ x, int lane, float (&out)[R]) {
    bf16_rows_dot_k_by<R, K>(Bf16RowsGlobal<R>{wrow}, Bf16XGlobal{x}, lane, out);
}

}  // namespace memra
