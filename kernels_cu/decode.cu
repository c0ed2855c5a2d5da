// Device decode-step glue (memra_dsv4/gpu/ops_decode.py, used by memra_dsv4/gpu/step.py).
// Every kernel that depends on the sequence position reads it from the device (pos[0]), so the
// launch sequence of a decode step is identical at every position and can be graph-captured.
//
// gemv_bf16:      y[o] = sum_k W[o, k] x[xo(o) + k], f32 accumulation (fixed order, see
//                 warp_row_dot: lane-strided 128-bit loads, 4 partial sums, then a butterfly),
//                 stored f32 or bf16 (RNE).  xo(o) = (o / rows_per_group) * K (grouped
//                 projection, e.g. wo_a); rows_per_group = 0: one x for every row.  One warp per
//                 output row, 8 rows per 256-thread CTA.  K % 8 == 0, 16-byte aligned W rows, x.
// gemv_bf16_multi: the same per row over a table of projections sharing x (GemvSeg below).
// embed_gather:   streams[j, :] = embed[tok[0], :] for the hc streams (bf16 bits).
// step_scalars:   aux[0] = (pos + 1) / 4 (indexer n_valid), aux[1 + i] = max(pos + 1 - r_i, 0)
//                 (the position of the block an emission at pos closes), i < 4.
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

// One warp's dot product of a bf16 row with x (K % 8 == 0, 16-byte aligned): lane l owns the
// 8-element chunks c = l + 32 i.  GEMV_UNROLL chunks are loaded before any is reduced (that many
// 16-byte weight loads in flight per lane: a warp per row alone leaves HBM idle), into
// GEMV_UNROLL partial sums; the tail goes to partial 0; partials are added in index order, then a
// butterfly.  The order is a function of K only, so every row of every call sums the same way.
constexpr int GEMV_UNROLL = 4;

DEV float warp_row_dot(const u16* __restrict__ w, const u16* __restrict__ x, int K, int lane) {
    const int nc = K >> 3;
    float acc[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) acc[u] = 0.0f;
    int c = lane;
    for (; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL], xv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            wv[u] = ldg_stream16(w + (i64)(c + 32 * u) * 8);
            xv[u] = ldg16(x + (i64)(c + 32 * u) * 8);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            float a[8], b[8];
            unpack8(wv[u], a);
            unpack8(xv[u], b);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u] = __fmaf_rn(a[i], b[i], acc[u]);
        }
    }
    for (; c < nc; c += 32) {
        float a[8], b[8];
        unpack8(ldg_stream16(w + (i64)c * 8), a);
        unpack8(ldg16(x + (i64)c * 8), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[0] = __fmaf_rn(a[i], b[i], acc[0]);
    }
    float s = acc[0];
#pragma unroll
    for (int u = 1; u < GEMV_UNROLL; ++u) s += acc[u];
    return warp_sum(s);
}

DEV void store_out(void* y, i64 o, float v, int out_bf16) {
    if (out_bf16) reinterpret_cast<u16*>(y)[o] = (u16)f32_to_bf16(v);
    else reinterpret_cast<float*>(y)[o] = v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
gemv_bf16(const u16* __restrict__ W, const u16* __restrict__ x, void* __restrict__ y, int O, int K,
          int rows_per_group, int out_bf16) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 8 + warp;
    if (o >= O) return;
    const u16* xv = x + (rows_per_group > 0 ? (i64)(o / rows_per_group) * K : (i64)0);
    const float acc = warp_row_dot(W + (i64)o * K, xv, K, lane);
    if (lane == 0) store_out(y, o, acc, out_bf16);
}

// Several projections of the same x in one launch (e.g. every [*, D] projection of the normed
// hidden state).  segs[s] = {w, y, row0, out_bf16}: rows [row0, segs[s + 1].row0) of the launch
// are rows [0, n) of W_s, written to y_s (f32 or bf16).  segs[nseg].row0 = total rows (sentinel).
// The table lives in device memory, built once at setup (weights and arena outputs never move).
struct GemvSeg {
    const u16* w;
    void* y;
    int row0;
    int out_bf16;
};

extern "C" __global__ void __launch_bounds__(256)
gemv_bf16_multi(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int o = blockIdx.x * 8 + warp;
    if (o >= segs[nseg].row0) return;
    int s = 0;
    while (s + 1 < nseg && o >= segs[s + 1].row0) ++s;
    const int r = o - segs[s].row0;
    const float acc = warp_row_dot(segs[s].w + (i64)r * K, x, K, lane);
    if (lane == 0) store_out(segs[s].y, r, acc, segs[s].out_bf16);
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
