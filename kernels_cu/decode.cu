// Device decode-step glue (memra_dsv4/gpu/ops_decode.py, used by memra_dsv4/gpu/step.py).
// Every kernel that depends on the sequence position reads it from the device (pos[0]), so the
// launch sequence of a decode step is identical at every position and can be graph-captured.
//
// The GEMVs are named for their bf16 activations; W comes in either dense form, bf16 bits or
// the stored FP8 (e4m3 bytes + e8m0 128x128 block scales), with bit-identical results (see
// warp_row_dot).
// gemv_bf16:      y[o] = sum_k W[o, k] x[xo(o) + k], f32 accumulation (fixed order, see
//                 warp_row_dot: lane-strided 128-bit loads, 4 partial sums, then a butterfly),
//                 stored f32 or bf16 (RNE).  xo(o) = (o / rows_per_group) * K (grouped
//                 projection, e.g. wo_a); rows_per_group = 0: one x for every row.  One warp per
//                 output row, 8 rows per 256-thread CTA.  K % 8 == 0, 16-byte aligned W rows, x.
// gemv_bf16_multi: the same per row over a table of projections sharing x (GemvSeg below), incl.
//                 the compressor's pending-row write + ape (what pending_write + add_ape do).
// gemv_bf16_swiglu: shared-expert gate/up GEMVs + clamped SwiGLU in one launch.
// embed_gather:   streams[j, :] = embed[tok[0], :] for the hc streams (bf16 bits).
// step_scalars:   aux[0] = (pos + 1) / 4 (indexer n_valid), aux[1 + i] = max(pos + 1 - r_i, 0)
//                 (the position of the block an emission at pos closes), i < 4.
// ring_write, pending_write, entry_commit: the standalone data moves below.  The device step no
//                 longer launches them (gemv_bf16_multi writes pending rows in its epilogue,
//                 compressor.cu's norm_rope_sim writes ring / compressed rows in place); they
//                 stay as the tested reference of that index math (test_kernels_decode.py
//                 checks the multi-GEMV's pending-row epilogue against pending_write's twin).
// ring_write:     ring[pos % W, :] = src.
// pending_write:  pending row (ovl ? r : 0) + pos % r of (kv, score) = (a, z) (f32 [C]).
// entry_commit:   if (pos + 1) % r == 0: dst[(pos + 1) / r - 1, :] = src (bf16 [d]).
// pending_advance: if (pos + 1) % r == 0: (overlap) rows [0, r) = rows [r, 2r); the current
//                 rows become (0, -inf).  (oracle CompressorState.advance for one token.)
// build_cand:     cand[j] for j < W: p = max(pos - W + 1, 0) + j, p % W if p <= pos else -1;
//                 for j >= W (k = j - W): ratio > 0 and sel == null (HCA): W + k if
//                 k < (pos + 1) / r; sel != null (CSA, sel ascending, -1 padded): W + sel[k]
//                 if k < sel_w and sel[k] >= 0; else -1.
#include "common.cuh"

using namespace memra;

namespace {

// Streaming 16-byte load of weights: read once per step, so keep them out of L1 (x, which every
// warp of the CTA re-reads, stays there).
DEV uint4 ldg_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 8 stored e4m3 bytes -> 8 f32 (exact: every e4m3 value is a normal f16, hardware converts).
DEV void unpack8_e4m3(const uint2& v, float* f) {
    const u32 w[2] = {v.x, v.y};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            u32 pair;
            const unsigned short two = (unsigned short)(w[h] >> (16 * p));
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(two));
            float lo, hi;
            asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(pair & 0xffffu)));
            asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(pair >> 16)));
            f[4 * h + 2 * p] = lo;
            f[4 * h + 2 * p + 1] = hi;
        }
    }
}

DEV uint2 ldg_stream8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// One warp's dot product of a weight row with x (K % 8 == 0, 16-byte aligned x).  Lane l owns the
// 8-element chunks c = l + 32 i; chunk c + 32 u of an unrolled group goes to partial u (GEMV_UNROLL
// partials, tail chunks to partial 0), partials are added in index order, then a butterfly.  The
// order is a function of K only, and it is the SAME for both weight forms:
//   bf16: W row of u16 bits (16-byte loads; GEMV_UNROLL loads in flight per lane);
//   fp8:  the stored e4m3 bytes (8-byte loads, two groups = 2 GEMV_UNROLL loads in flight) times
//         the e8m0 scale of their 128-column block (srow = the row's scale row), w = e4m3 * 2^e
//         exact in f32, so a product equals the bf16 arm's product bit for bit and the FP8 arm
//         returns the same bits as the bf16 arm on the exactly dequantised weights.
constexpr int GEMV_UNROLL = 4;

template <bool FP8>
DEV void load_chunk(const void* w, const u8* srow, int c, float* f) {
    if (FP8) {
        unpack8_e4m3(ldg_stream8(reinterpret_cast<const u8*>(w) + (i64)c * 8), f);
        const float sc = e8m0_to_f32(__ldg(srow + (c >> 4)));
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(f[i], sc);
    } else {
        unpack8(ldg_stream16(reinterpret_cast<const u16*>(w) + (i64)c * 8), f);
    }
}

template <bool FP8>
DEV float warp_row_dot(const void* __restrict__ w, const u8* __restrict__ srow,
                       const u16* __restrict__ x, int K, int lane) {
    const int nc = K >> 3;
    float acc[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) acc[u] = 0.0f;
    constexpr int G = FP8 ? 2 : 1;  // unrolled groups per trip (fp8 loads are half as wide)
    int c = lane;
    for (; c + 32 * (G * GEMV_UNROLL - 1) < nc; c += 32 * G * GEMV_UNROLL) {
        float wf[G * GEMV_UNROLL][8];
        uint4 xv[G * GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < G * GEMV_UNROLL; ++u) {
            load_chunk<FP8>(w, srow, c + 32 * u, wf[u]);
            xv[u] = ldg16(x + (i64)(c + 32 * u) * 8);
        }
#pragma unroll
        for (int u = 0; u < G * GEMV_UNROLL; ++u) {
            float b[8];
            unpack8(xv[u], b);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u % GEMV_UNROLL] = __fmaf_rn(wf[u][i], b[i], acc[u % GEMV_UNROLL]);
        }
    }
    if (FP8) {  // at most one more group of GEMV_UNROLL (the bf16 loop's last trip)
        for (; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL) {
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                float a[8], b[8];
                load_chunk<FP8>(w, srow, c + 32 * u, a);
                unpack8(ldg16(x + (i64)(c + 32 * u) * 8), b);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u] = __fmaf_rn(a[i], b[i], acc[u]);
            }
        }
    }
    for (; c < nc; c += 32) {
        float a[8], b[8];
        load_chunk<FP8>(w, srow, c, a);
        unpack8(ldg16(x + (i64)c * 8), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[0] = __fmaf_rn(a[i], b[i], acc[0]);
    }
    float s = acc[0];
#pragma unroll
    for (int u = 1; u < GEMV_UNROLL; ++u) s += acc[u];
    return warp_sum(s);
}

// Row o of a dense weight in either form: (row pointer, its scale row or null).
DEV const void* w_row(const void* W, int fp8, int o, int K) {
    return fp8 ? (const void*)(reinterpret_cast<const u8*>(W) + (i64)o * K)
               : (const void*)(reinterpret_cast<const u16*>(W) + (i64)o * K);
}

DEV float row_dot_any(const void* W, const u8* S, int ld_s, int fp8, int o, const u16* x, int K,
                      int lane) {
    const void* wr = w_row(W, fp8, o, K);
    return fp8 ? warp_row_dot<true>(wr, S + (i64)(o >> 7) * ld_s, x, K, lane)
               : warp_row_dot<false>(wr, nullptr, x, K, lane);
}

DEV void store_out(void* y, i64 o, float v, int out_bf16) {
    if (out_bf16) reinterpret_cast<u16*>(y)[o] = (u16)f32_to_bf16(v);
    else reinterpret_cast<float*>(y)[o] = v;
}

}  // namespace

// W: bf16 bits [O, K] (S = null) or e4m3 bytes [O, K] with e8m0 scales S [ceil(O/128), ld_s].
extern "C" __global__ void __launch_bounds__(256)
gemv_bf16(const void* __restrict__ W, const u8* __restrict__ S, int ld_s, const u16* __restrict__ x,
          void* __restrict__ y, int O, int K, int rows_per_group, int out_bf16) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 8 + warp;
    if (o >= O) return;
    const u16* xv = x + (rows_per_group > 0 ? (i64)(o / rows_per_group) * K : (i64)0);
    const float acc = row_dot_any(W, S, ld_s, S != nullptr, o, xv, K, lane);
    if (lane == 0) store_out(y, o, acc, out_bf16);
}

// Several projections of the same x in one launch (e.g. every [*, D] projection of the normed
// hidden state).  segs[s]: rows [row0, segs[s + 1].row0) of the launch are rows [0, n_s) of W_s,
// written to y_s (f32 or bf16); segs[nseg].row0 = total rows (sentinel).  ring_r > 0 makes y_s
// the compressor's pending rows: row r of the output goes to y_s[((pos % ring_r) + ring_off) *
// n_s + r] (f32), plus ape_s[(pos % ring_r) * n_s + r] when ape_s != null (the gate-score
// position bias; f32(dot + ape), the same rounding as compress_add_ape).  The table lives in
// device memory, built once at setup (weights and arena outputs never move).
struct GemvSeg {
    const void* w;     // bf16 bits or e4m3 bytes [n_s, K]
    void* y;
    const float* ape;
    const u8* scale;   // e8m0 [ceil(n_s/128), ld_scale] (fp8) or null (bf16)
    int row0;
    int out_bf16;
    int ring_r;
    int ring_off;
    int ld_scale;
    int pad;
};

extern "C" __global__ void __launch_bounds__(256)
gemv_bf16_multi(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K,
                const int* __restrict__ pos) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 8 + warp;
    if (o >= segs[nseg].row0) return;
    int s = 0;
    while (s + 1 < nseg && o >= segs[s + 1].row0) ++s;
    const GemvSeg& g = segs[s];
    const int r = o - g.row0;
    float acc = row_dot_any(g.w, g.scale, g.ld_scale, g.scale != nullptr, r, x, K, lane);
    if (lane != 0) return;
    if (g.ring_r > 0) {
        const int n = segs[s + 1].row0 - g.row0;
        const int slot = pos[0] % g.ring_r;
        if (g.ape != nullptr) acc = __fadd_rn(acc, __ldg(g.ape + (i64)slot * n + r));
        reinterpret_cast<float*>(g.y)[(i64)(slot + g.ring_off) * n + r] = acc;
    } else {
        store_out(g.y, r, acc, g.out_bf16);
    }
}

// The shared expert's first half: h[o] = swiglu(bf16(W1[o] . x), bf16(W3[o] . x)) (clamped, no
// routing weight), the bits of gemv_bf16 (bf16 out) x 2 then swiglu_clamped_bf16.
extern "C" __global__ void __launch_bounds__(256)
gemv_bf16_swiglu(const void* __restrict__ W1, const u8* __restrict__ S1, const void* __restrict__ W3,
                 const u8* __restrict__ S3, int ld_s, const u16* __restrict__ x, u16* __restrict__ h,
                 int O, int K, double limit) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 8 + warp;
    if (o >= O) return;
    const float g = round_bf16(row_dot_any(W1, S1, ld_s, S1 != nullptr, o, x, K, lane));
    const float u = round_bf16(row_dot_any(W3, S3, ld_s, S3 != nullptr, o, x, K, lane));
    if (lane == 0) h[o] = (u16)f32_to_bf16(swiglu_value(g, u, 1.0f, false, limit));
}

extern "C" __global__ void __launch_bounds__(256)
embed_gather(const int* __restrict__ tok, const u16* __restrict__ embed, u16* __restrict__ streams,
             int D, int hc) {
    const i64 row = (i64)tok[0] * D;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hc * D; i += gridDim.x * blockDim.x)
        streams[i] = embed[row + (i % D)];
}

extern "C" __global__ void step_scalars(const int* __restrict__ pos, int* __restrict__ aux, int r0,
                                        int r1, int r2, int r3) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int p = pos[0];
    aux[0] = (p + 1) / 4;
    const int r[4] = {r0, r1, r2, r3};
#pragma unroll
    for (int i = 0; i < 4; ++i) aux[1 + i] = max(p + 1 - r[i], 0);
}

extern "C" __global__ void __launch_bounds__(256)
ring_write(const int* __restrict__ pos, const u16* __restrict__ src, u16* __restrict__ ring, int W,
           int d) {
    const i64 row = (i64)(pos[0] % W) * d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        ring[row + i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
pending_write(const int* __restrict__ pos, const float* __restrict__ a, const float* __restrict__ z,
              float* __restrict__ kv, float* __restrict__ score, int r, int ovl, int C) {
    const i64 row = (i64)((ovl ? r : 0) + pos[0] % r) * C;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < C; i += gridDim.x * blockDim.x) {
        kv[row + i] = a[i];
        score[row + i] = z[i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
entry_commit(const int* __restrict__ pos, const u16* __restrict__ src, u16* __restrict__ dst, int r,
             int d, int n_rows) {
    const int p1 = pos[0] + 1;
    if (p1 % r != 0) return;
    const int k = p1 / r - 1;
    if (k >= n_rows) return;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        dst[(i64)k * d + i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
pending_advance(const int* __restrict__ pos, float* __restrict__ kv, float* __restrict__ score, int r,
                int ovl, int C) {
    if ((pos[0] + 1) % r != 0) return;
    const int o = ovl ? r : 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < r * C; i += gridDim.x * blockDim.x) {
        const i64 cur = (i64)o * C + i;
        if (ovl) {
            kv[i] = kv[cur];
            score[i] = score[cur];
        }
        kv[cur] = 0.0f;
        score[cur] = f32_ninf();
    }
}

extern "C" __global__ void __launch_bounds__(256)
build_cand(const int* __restrict__ pos, int W, int ratio, const int* __restrict__ sel, int sel_w,
           int* __restrict__ cand, int K) {
    const int p = pos[0];
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < K; j += gridDim.x * blockDim.x) {
        int v = -1;
        if (j < W) {
            const int t = max(p - W + 1, 0) + j;
            if (t <= p) v = t % W;
        } else if (ratio > 0) {
            const int k = j - W;
            if (sel == nullptr) {
                if (k < (p + 1) / ratio) v = W + k;
            } else if (k < sel_w) {
                const int e = sel[k];
                if (e >= 0) v = W + e;
            }
        }
        cand[j] = v;
    }
}
