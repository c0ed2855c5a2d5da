// The per-head q norm (+ the q RoPE) of one row by one warp: the body of rmsnorm.cu's
// head_rms_bf16, shared with attention.cu's sparse_attn_*_qn kernels, which apply it to their
// heads' q rows at the q load (the device step's MEMRA_DSV4_DECODE_QNORM = attn).  Both kernels
// run these functions, so the normed values are the same bits by construction.
//
// Twin NumericsPolicy.head_rms (M:498) then oracle.ops.apply_rope (M:499): in bf16 tensor
// arithmetic sq = bf16(x*x); mean = bf16(f32(mean(sq))); var = bf16(mean + f32(eps));
// r = bf16(f32(1/sqrt(var))); y = bf16(x * r); then the last R dims rotated at the row's position
// (double math as rope.cu, each value rounded f64 -> f32 -> bf16).
//
// Fixed order: lane l owns the 8-dim chunks c = l, l + 32, ... (n / 8 chunks); its squares are
// added in double in chunk / element order (head_rms_sumsq8), then warp_sum's xor tree (every lane
// ends with the same sum); everything after that is elementwise per chunk (head_rms_r,
// head_rms_scale8, head_rms_rope8).  Every f32 operation is an explicit _rn intrinsic and every
// double one is IEEE (no contraction), so the bits depend neither on the kernel the functions
// are inlined into (both modules compile with the same options) nor on when a lane's loads are
// issued.  Two drivers walk the chunks in that order:
//   head_rms_warp_row     n at run time (head_rms_bf16): a loop over the lane's chunks, loaded
//                         once per pass, the RoPE rows read where a chunk is rotated;
//   head_rms_row_load / head_rms_rope_load / head_rms_row_finish (= head_rms_warp_row_n<N>)
//                         n = N at compile time (the attention: N = D): unrolled, every load (the
//                         row's chunks, the token position, the RoPE rows) issued first, so a
//                         caller can have the loads of all its rows in flight before it finishes
//                         any; the chunks kept in registers for the second pass (the same values:
//                         the row is not written meanwhile).
#pragma once

#include "common.cuh"

namespace memra {

// ss + the 8 bf16 squares of chunk x (each rounded to bf16), added in element order in double
DEV double head_rms_sumsq8(double ss, const uint4& x) {
    float f[8];
    unpack8(x, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = __dadd_rn(ss, (double)round_bf16(__fmul_rn(f[i], f[i])));
    return ss;
}

// r = bf16(f32(1/sqrt(var))), var = bf16(mean + eps), mean = bf16(f32(ss / n)): ss the row's sum
// of bf16 squares (the double sum is exact for any realistic range)
DEV float head_rms_r(double ss, int n, float eps) {
    const float mean = round_bf16(__double2float_rn(ss / (double)n));
    const float var = round_bf16(__fadd_rn(mean, eps));
    return round_bf16(__double2float_rn(1.0 / sqrt((double)var)));
}

// f = bf16(x * r) of chunk x's 8 values
DEV void head_rms_scale8(const uint4& x, float r, float* f) {
    unpack8(x, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = round_bf16(__fmul_rn(f[i], r));
}

// the q RoPE of the chunk's 4 pairs (f[2i], f[2i+1]) with cos / sin cs(i), sn(i), each value
// rounded to bf16
template <typename Cos, typename Sin>
DEV void head_rms_rope8(float* f, const Cos& cs, const Sin& sn) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        rope_pair(f[i], f[i + 1], cs(i >> 1), sn(i >> 1), false);
        f[i] = round_bf16(f[i]);
        f[i + 1] = round_bf16(f[i + 1]);
    }
}

// The RoPE table row of chunk c (its 4 pairs) at position p: cos_t / sin_t [n_pos, R/2] f32.
DEV i64 head_rms_rope_row(int p, int c, int n, int R) {
    return (i64)p * (R >> 1) + ((8 * c - (n - R)) >> 1);
}

// head_rms_bf16's RoPE rows loaded BEFORE its PDL wait (PDL_ENTRY_PRELOAD): the lane's first
// rotated chunk c (c = lane + 32 k, the smallest k with 8 c >= n - R) and its 4 cos / 4 sin.  The
// tables are static; the position is written before the step's graph starts (the host's copy into
// the arena) or many launches back (common.cuh's "complete before this grid can launch"), read
// through L2.  c = -1: none (no RoPE, no rotated chunk on this lane, or the row is out of range);
// a lane's later rotated chunks (R > 256) load their rows in the loop as before.  The same floats
// as the loop's own loads, so the same bits.
struct HeadRope {
    int c;
    float cs[4], sn[4];
};
template <typename Tok>
DEV HeadRope head_rope_preload(int n, const int* __restrict__ pos, const Tok& tok, const float* __restrict__ cos_t,
                               const float* __restrict__ sin_t, int R, bool row_ok) {
    HeadRope h;
    h.c = -1;
#pragma unroll
    for (int i = 0; i < 4; ++i) h.cs[i] = h.sn[i] = 0.0f;
    if (pos != nullptr && row_ok && R > 0) {
        const int lane = threadIdx.x & 31, nc = n >> 3, c0 = (n - R) >> 3;
        const int c = lane >= c0 ? lane : lane + 32 * ((c0 - lane + 31) >> 5);
        if (c < nc) {
            const i64 trow = head_rms_rope_row(__ldcg(pos + tok()), c, n, R);
            rope_pairs_ldg(cos_t, sin_t, trow, h.cs, h.sn);
            h.c = c;
        }
    }
    return h;
}

// xr: the row's n bf16 values (n % 8 == 0, 16-byte aligned; read through the read-only path, so
// it must not be written during the call except by `store` of the same lane's chunk, after that
// chunk's last read: y may alias x).  pos null: no RoPE; else the last R dims (R % 8 == 0,
// R <= n) are rotated at position pos[tok()] with cos / sin [n_pos, R/2] f32 rows.  tok() is
// evaluated only where a chunk is rotated.  store(c, v): chunk c's 8 outputs as packed bf16 (each
// chunk of the row exactly once, by its owning lane).  pre: this lane's preloaded RoPE rows
// (head_rope_preload; its chunk skips the loads).
template <typename Tok, typename Store>
DEV void head_rms_warp_row(const u16* xr, int n, float eps, const int* __restrict__ pos, const Tok& tok,
                           const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R,
                           const Store& store, const HeadRope& pre) {
    const int lane = threadIdx.x & 31;
    const int nc = n >> 3;
    double ss = 0.0;
    for (int c = lane; c < nc; c += 32) ss = head_rms_sumsq8(ss, ldg16(xr + 8 * c));
    ss = warp_sum(ss);
    const float r = head_rms_r(ss, n, eps);
    for (int c = lane; c < nc; c += 32) {
        float f[8];
        head_rms_scale8(ldg16(xr + 8 * c), r, f);
        if (pos != nullptr && 8 * c >= n - R) {
            if (c == pre.c) {
                head_rms_rope8(f, [&](int i) { return pre.cs[i]; }, [&](int i) { return pre.sn[i]; });
            } else {
                const i64 trow = head_rms_rope_row(__ldg(pos + tok()), c, n, R);
                head_rms_rope8(f, [&](int i) { return __ldg(cos_t + trow + i); },
                               [&](int i) { return __ldg(sin_t + trow + i); });
            }
        }
        store(c, pack8(f));
    }
}

// head_rms_warp_row with n = N known at compile time (the same chunks, order and arithmetic), in
// phases so a caller can have the loads of several rows in flight before it finishes any:
//   head_rms_row_load   lane l's chunks c = l + 32 k (k < ceil(N/256), those with c < N/8);
//   head_rms_rope_load  the token's position (tok() evaluated once; pos given, R >= 8) and, for
//                       each k, the RoPE row of chunk c, unbranched (a chunk that is not rotated
//                       loads the row of the nearest rotated one: in bounds, not used); it
//                       depends on the token only, so the rows of one token share it
//                       (head_rms_rope_none: no RoPE);
//   head_rms_row_sumsq  the lane's part of the sum (its chunks in order);
//   head_rms_row_finish warp_sum of that, r, y and the RoPE, store(c, v) per chunk.
// head_rms_warp_row_n = the four back to back.
template <int N>
struct HeadRmsRow {
    static_assert(N % 8 == 0, "HeadRmsRow: N % 8 == 0");
    static constexpr int NC = N / 8, KC = (NC + 31) / 32;
    DEV static bool has(int lane, int k) { return NC % 32 == 0 || lane + 32 * k < NC; }
    uint4 x[KC];
};

template <int N>
struct HeadRmsRope {
    static constexpr int KC = HeadRmsRow<N>::KC;
    float cs[KC][4], sn[KC][4];
    bool on;  // pos given
    int R;
    DEV bool rot(int lane, int k) const {  // chunk lane + 32 k is rotated
        return HeadRmsRow<N>::has(lane, k) && on && 8 * (lane + 32 * k) >= N - R;
    }
};

// (ldg_stream16: read once, L1::no_allocate; the second pass uses these registers.  Its asm
// volatile keeps the front end from sinking the load to its first use; ptxas still schedules it.)
template <int N>
DEV void head_rms_row_load(HeadRmsRow<N>& a, const u16* xr) {
    using A = HeadRmsRow<N>;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < A::KC; ++k)
        a.x[k] = A::has(lane, k) ? ldg_stream16(xr + 8 * (lane + 32 * k)) : make_uint4(0u, 0u, 0u, 0u);
}

// pos, cos_t, sin_t non-null (no RoPE: head_rms_rope_none)
template <int N, typename Tok>
DEV void head_rms_rope_load(HeadRmsRope<N>& q, const int* __restrict__ pos, const Tok& tok,
                            const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R) {
    const int lane = threadIdx.x & 31;
    q.on = true;
    q.R = R;
    const int p = __ldg(pos + tok());
#pragma unroll
    for (int k = 0; k < HeadRmsRope<N>::KC; ++k) {
        const int c = min(max(lane + 32 * k, (N - R) >> 3), N / 8 - 1);
        const i64 trow = head_rms_rope_row(p, c, N, R);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q.cs[k][i] = __ldg(cos_t + trow + i);
            q.sn[k][i] = __ldg(sin_t + trow + i);
        }
    }
}

template <int N>
DEV void head_rms_rope_none(HeadRmsRope<N>& q) {
    q.on = false;
    q.R = 0;
}

// the lane's part of the row's sum of squares (its chunks in order)
template <int N>
DEV double head_rms_row_sumsq(const HeadRmsRow<N>& a) {
    using A = HeadRmsRow<N>;
    const int lane = threadIdx.x & 31;
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < A::KC; ++k)
        if (A::has(lane, k)) ss = head_rms_sumsq8(ss, a.x[k]);
    return ss;
}

// ss: head_rms_row_sumsq(a)
template <int N, typename Store>
DEV void head_rms_row_finish(const HeadRmsRow<N>& a, const HeadRmsRope<N>& q, double ss, float eps,
                             const Store& store) {
    using A = HeadRmsRow<N>;
    const int lane = threadIdx.x & 31;
    ss = warp_sum(ss);
    const float r = head_rms_r(ss, N, eps);
#pragma unroll
    for (int k = 0; k < A::KC; ++k) {
        if (A::has(lane, k)) {
            float f[8];
            head_rms_scale8(a.x[k], r, f);
            if (q.rot(lane, k))
                head_rms_rope8(f, [&](int i) { return q.cs[k][i]; }, [&](int i) { return q.sn[k][i]; });
            store(lane + 32 * k, pack8(f));
        }
    }
}

template <int N, typename Tok, typename Store>
DEV void head_rms_warp_row_n(const u16* xr, float eps, const int* __restrict__ pos, const Tok& tok,
                             const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R,
                             const Store& store) {
    HeadRmsRow<N> a;
    HeadRmsRope<N> q;
    head_rms_row_load(a, xr);
    if (pos != nullptr)
        head_rms_rope_load(q, pos, tok, cos_t, sin_t, R);
    else
        head_rms_rope_none(q);
    head_rms_row_finish(a, q, head_rms_row_sumsq(a), eps, store);
}

}  // namespace memra
