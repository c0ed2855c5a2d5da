// Manifold-constrained hyper-connections (mHC): hc_pre, hc_post, hc_head (dsv4_model_and_formats §4).
//
// The mixes GEMV (kernel A) is kept apart from the split/Sinkhorn/apply step (kernel B) so the
// host can substitute B's small f32 math (pre/post/comb) and only launch the apply.
//
// hc_mixes_r{6,4}: A. mixes[t, m] = f32( (fn[m] . x_t) * rsqrt(mean(x_t^2) + eps) ), x_t = the 4
//   streams of token t flattened (hc*D bf16), fn [rows, hc*D] f32. Twin: oracle.ops._hc_mixes.
//   Grid (ceil(T/4), rows/R, n_split), block 128: a CTA computes R rows for 4 tokens (fn is
//   streamed once per 4 tokens). Products (f32 x bf16) are exact in double and accumulate in
//   double in the canonical segment order of hc_mixes_body, independent of T and of n_split;
//   decode (small T) splits the 16384-long reduction over n_split CTAs for parallelism. The
//   mean of squares is recomputed identically by each row-CTA.
// hc_pre_split_apply: B for hc_pre. pre = sigmoid(m*s0 + b) + hc_eps; post = 2 sigmoid(m*s1 + b);
//   comb = Sinkhorn(m*s2 + b) in f32 with the twin's op order (host.hc.hc_split: softmax rows +
//   eps, column normalise, then iters-1 x (row, column)), 4-term sums in index order; exp is
//   evaluated in double and rounded to f32. Then y = bf16(sum_i pre_i X_i) in double (i ascending,
//   exact products) like oracle.ops._weighted_streams. Grid (T), block 128; warp 0 lanes
//   0..15 hold comb[j][k] (lane = 4j + k), lanes 16..19 pre, 20..23 post.
// hc_weighted_sum: y = bf16(sum_i pre_i X_i) with pre given [T, 4] (host-substituted math).
// hc_head_apply: hc_head's B: pre = sigmoid(m*s0 + b) + hc_eps, then the weighted sum.
// hc_post: new_j = bf16(post_j f + sum_i comb[i][j] R_i), double, i ascending (twin
//   oracle.ops.hc_post): bit-identical. Grid (T), block 128, thread = 8 channels x 4 streams.
//
// The per-token kernels (hc_pre_split_apply, hc_weighted_sum, hc_head_apply, hc_post) run on grid
// (T, n_y): the n_y CTAs of a token split its channels (8 per thread); each recomputes the tiny
// split math, CTA y = 0 alone writes pre/post/comb. Decode (T = 1) uses n_y > 1 so one token is
// not one CTA on one SM; the bits do not depend on n_y.
//
// hc_boundary: one decode token's sub-layer boundary in one launch ([hc_post] + hc_pre + rmsnorm,
//   bit-identical to those kernels run apart); see its section at the end of this file.
//
// hc (the stream count) is 4 throughout (Flash, Pro and every preset); D % 8 == 0.
#include "common.cuh"
#include "cluster.cuh"

using namespace memra;

namespace {

constexpr int HC = 4;
constexpr int MIX_THREADS = 128;  // 4 warps
constexpr int MIX_WARPS = MIX_THREADS / 32;
constexpr int MIX_TOK = 4;        // tokens per CTA
constexpr int MIX_SEG = 256;      // elements per segment (one 8-element chunk per lane)
constexpr int MIX_MAX_SEG = 128;  // hc*D <= 32768

// The canonical reduction of a mixes value (a dot of row r with token t, or token t's sum of
// squares): the hc*D elements form segments of 256; within a segment lane l takes elements
// 8l..8l+7 (sequential double FMAs), a 5-stage reduce-scatter across the warp gives the segment
// value, and the segment values are added in segment order. The in-CTA path (n_split = 1: the
// CTA's warps take segments w, w+4, ...) and the split path (CTA z takes segments
// [z*spc, (z+1)*spc), the last CTA to finish adds them up) compute exactly this, so T = 1
// decode (split) and a T = L prefill (in-CTA) give the same bits.
template <int R>
DEV void hc_mixes_body(const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mixes,
                       int T, int n, int rows_total, double eps, double* __restrict__ ws,
                       int* __restrict__ counters) {
    constexpr int V = R * MIX_TOK + MIX_TOK;  // dot products, then sums of squares
    static_assert(V <= 32, "one value per lane");
    __shared__ double segv[MIX_MAX_SEG][32];
    __shared__ double tot[32];
    __shared__ int is_last;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int t0 = blockIdx.x * MIX_TOK;
    const int r0 = blockIdx.y * R;
    const int nseg = n / MIX_SEG;
    const int n_split = gridDim.z;
    const int spc = nseg / n_split;
    const int s_begin = blockIdx.z * spc;
    const i64 group = (i64)blockIdx.x * gridDim.y + blockIdx.y;
    for (int sg = s_begin + wid; sg < s_begin + spc; sg += MIX_WARPS) {
        const int e0 = sg * MIX_SEG + 8 * lane;
        float xf[MIX_TOK][8];
        double v[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = 0.0;
#pragma unroll
        for (int t = 0; t < MIX_TOK; ++t) {
            if (t0 + t < T) {
                unpack8(ldg16(x + (i64)(t0 + t) * n + e0), xf[t]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) xf[t][i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const double d = xf[t][i];
                v[R * MIX_TOK + t] = __fma_rn(d, d, v[R * MIX_TOK + t]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float4* wp = reinterpret_cast<const float4*>(fn + (i64)(r0 + r) * n + e0);
            const float4 wa = __ldg(wp), wb = __ldg(wp + 1);
            const float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int t = 0; t < MIX_TOK; ++t)
#pragma unroll
                for (int i = 0; i < 8; ++i) v[r * MIX_TOK + t] = __fma_rn((double)w[i], (double)xf[t][i], v[r * MIX_TOK + t]);
        }
        reduce_scatter32(v, lane);
        if (lane < V) {
            if (n_split == 1) segv[sg][lane] = v[0];
            else ws[(group * nseg + sg) * 32 + lane] = v[0];
        }
    }
    if (n_split == 1) {
        __syncthreads();
        if (threadIdx.x < V) {
            double a = segv[0][threadIdx.x];
            for (int sg = 1; sg < nseg; ++sg) a = __dadd_rn(a, segv[sg][threadIdx.x]);
            tot[threadIdx.x] = a;
        }
    } else {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) is_last = atomicAdd(counters + group, 1) == n_split - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        if (threadIdx.x < V) {
            const double* src = ws + group * nseg * 32 + threadIdx.x;
            double a = __ldcg(src);
            for (int sg = 1; sg < nseg; ++sg) a = __dadd_rn(a, __ldcg(src + sg * 32));
            tot[threadIdx.x] = a;
        }
        if (threadIdx.x == 0) counters[group] = 0;  // ready for the next launch
    }
    __syncthreads();
    if (threadIdx.x < R * MIX_TOK) {
        const int r = threadIdx.x / MIX_TOK, t = threadIdx.x % MIX_TOK;
        if (t0 + t < T) {
            const double rs = 1.0 / sqrt(tot[R * MIX_TOK + t] / (double)n + eps);
            mixes[(i64)(t0 + t) * rows_total + r0 + r] = __double2float_rn(__dmul_rn(tot[threadIdx.x], rs));
        }
    }
}

// exp in double, rounded once to f32 (matches a correctly rounded f32 exp)
DEV float exp_f32(float x) { return __double2float_rn(exp((double)x)); }
DEV float sigmoid_f32(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x))); }

// sum of the 4 values held by lanes src0..src0+3*step (step 1: a row; step 4: a column), in
// index order, identical in every lane that asks. Called by lanes 0..15 only.
DEV float sum4(float v, int src0, int step) {
    const float a = __shfl_sync(0x0000ffffu, v, src0);
    const float b = __shfl_sync(0x0000ffffu, v, src0 + step);
    const float c = __shfl_sync(0x0000ffffu, v, src0 + 2 * step);
    const float d = __shfl_sync(0x0000ffffu, v, src0 + 3 * step);
    return __fadd_rn(__fadd_rn(__fadd_rn(a, b), c), d);
}

// hc_pre's pre weight of stream i from its mix logit: sigmoid(m * s0 + b) + hc_eps (f32).
DEV float pre_value(float m, float s0, float b, float hc_eps) {
    return __fadd_rn(sigmoid_f32(__fadd_rn(__fmul_rn(m, s0), b)), hc_eps);
}

// hc_split of one token's 24 mix logits m, by the 32 lanes of one warp (all must call): lanes
// 0..15 hold comb[j][k] (lane = 4j + k; Sinkhorn), 16..19 pre, 20..23 post. Every output pointer
// may be null (not written); pre_s (shared, may be null) receives pre for the weighted sum.
DEV void split_lanes(const float* m, const float* __restrict__ scale, const float* __restrict__ base,
                     int iters, float hc_eps, int lane, float* pre_s, float* pre_out,
                     float* post_out, float* comb_out) {
    if (lane < 16) {  // comb entry (j, k) = (lane / 4, lane % 4)
        const int j = lane >> 2, k = lane & 3;
        float L = __fadd_rn(__fmul_rn(m[2 * HC + lane], scale[2]), base[2 * HC + lane]);
        const float l0 = __shfl_sync(0x0000ffffu, L, 4 * j), l1 = __shfl_sync(0x0000ffffu, L, 4 * j + 1);
        const float l2 = __shfl_sync(0x0000ffffu, L, 4 * j + 2), l3 = __shfl_sync(0x0000ffffu, L, 4 * j + 3);
        const float mx = fmaxf(fmaxf(l0, l1), fmaxf(l2, l3));
        L = exp_f32(__fsub_rn(L, mx));
        L = __fadd_rn(__fdiv_rn(L, sum4(L, 4 * j, 1)), hc_eps);   // it is now C
        L = __fdiv_rn(L, __fadd_rn(sum4(L, k, 4), hc_eps));
        for (int it = 1; it < iters; ++it) {
            L = __fdiv_rn(L, __fadd_rn(sum4(L, 4 * j, 1), hc_eps));
            L = __fdiv_rn(L, __fadd_rn(sum4(L, k, 4), hc_eps));
        }
        if (comb_out != nullptr) comb_out[lane] = L;
    }
    if (lane >= 16 && lane < 16 + HC) {
        const int i = lane - 16;
        const float p = pre_value(m[i], scale[0], base[i], hc_eps);
        if (pre_s != nullptr) pre_s[i] = p;
        if (pre_out != nullptr) pre_out[i] = p;
    } else if (lane >= 16 + HC && lane < 16 + 2 * HC) {
        const int i = lane - 16 - HC;
        const float s = sigmoid_f32(__fadd_rn(__fmul_rn(m[HC + i], scale[1]), base[HC + i]));
        if (post_out != nullptr) post_out[i] = __fmul_rn(2.0f, s);
    }
}

// y[t] = bf16(sum_i pre[i] X_i), double, i ascending. Block-wide loop over 8-channel chunks.
DEV void weighted_streams(const u16* __restrict__ X, const float* pre, u16* __restrict__ y, int D) {
    const int nc = D >> 3;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < nc; c += gridDim.y * blockDim.x) {
        double acc[8];
#pragma unroll
        for (int i = 0; i < HC; ++i) {
            float f[8];
            unpack8(ldg16(X + (i64)i * D + 8 * c), f);
            const double p = pre[i];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const double prod = __dmul_rn(p, (double)f[e]);
                acc[e] = i == 0 ? prod : __dadd_rn(acc[e], prod);
            }
        }
        u32 h[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) h[e] = f64_to_bf16(acc[e]);
        stg16(y + 8 * c, make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                                    h[6] | (h[7] << 16)));
    }
}

}  // namespace

// x: [T, hc*D] bf16 (n = hc*D, n % 256 == 0, n <= 32768); fn: [rows_total, n] f32;
// mixes: [T, rows_total] f32. grid (ceil(T/4), rows_total/R, n_split), block 128, n_split | n/256.
// n_split > 1: ws = double [ceil(T/4) * rows_total/R * n/256 * 32], counters = int
// [ceil(T/4) * rows_total/R], zero before the first launch (the kernel leaves them zero).
extern "C" __global__ void __launch_bounds__(MIX_THREADS)
hc_mixes_r6(const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mixes,
            int T, int n, int rows_total, double eps, double* __restrict__ ws, int* __restrict__ counters) { PDL_ENTRY();
    hc_mixes_body<6>(x, fn, mixes, T, n, rows_total, eps, ws, counters);
}
// hc_head: rows_total = 4.
extern "C" __global__ void __launch_bounds__(MIX_THREADS)
hc_mixes_r4(const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mixes,
            int T, int n, int rows_total, double eps, double* __restrict__ ws, int* __restrict__ counters) { PDL_ENTRY();
    hc_mixes_body<4>(x, fn, mixes, T, n, rows_total, eps, ws, counters);
}

// mixes [T, 24] f32; scale [3]; base [24]; X [T, 4, D] bf16 -> y [T, D] bf16, pre [T, 4],
// post [T, 4], comb [T, 4, 4] f32 (comb[i][j]: i = source stream). grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_pre_split_apply(const float* __restrict__ mixes, const float* __restrict__ scale,
                   const float* __restrict__ base, const u16* __restrict__ X, u16* __restrict__ y,
                   float* __restrict__ pre_out, float* __restrict__ post_out,
                   float* __restrict__ comb_out, int D, int iters, float hc_eps) { PDL_ENTRY();
    __shared__ float pre_s[HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < 32) {
        const bool w = blockIdx.y == 0;
        split_lanes(mixes + t * (2 + HC) * HC, scale, base, iters, hc_eps, threadIdx.x, pre_s,
                    w ? pre_out + t * HC : nullptr, w ? post_out + t * HC : nullptr,
                    w ? comb_out + t * HC * HC : nullptr);
    }
    __syncthreads();
    weighted_streams(X + t * HC * D, pre_s, y + t * D, D);
}

// pre [T, 4] f32 given; X [T, 4, D] -> y [T, D]. grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_weighted_sum(const float* __restrict__ pre, const u16* __restrict__ X, u16* __restrict__ y, int D) { PDL_ENTRY();
    __shared__ float pre_s[HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < HC) pre_s[threadIdx.x] = pre[t * HC + threadIdx.x];
    __syncthreads();
    weighted_streams(X + t * HC * D, pre_s, y + t * D, D);
}

// mixes [T, 4]; scale [1]; base [4]; X [T, 4, D] -> y [T, D]. grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_head_apply(const float* __restrict__ mixes, const float* __restrict__ scale,
              const float* __restrict__ base, const u16* __restrict__ X, u16* __restrict__ y,
              int D, float hc_eps) { PDL_ENTRY();
    __shared__ float pre_s[HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < HC) {
        const int i = threadIdx.x;
        pre_s[i] = pre_value(mixes[t * HC + i], scale[0], base[i], hc_eps);
    }
    __syncthreads();
    weighted_streams(X + t * HC * D, pre_s, y + t * D, D);
}

// f [T, D] bf16; R [T, 4, D] bf16; post [T, 4]; comb [T, 4, 4] -> out [T, 4, D] bf16.
// out must not alias R. grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_post(const u16* __restrict__ f, const u16* __restrict__ R, const float* __restrict__ post,
        const float* __restrict__ comb, u16* __restrict__ out, int D) { PDL_ENTRY();
    __shared__ double pc[HC + HC * HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < HC) pc[threadIdx.x] = post[t * HC + threadIdx.x];
    else if (threadIdx.x < HC + HC * HC) pc[threadIdx.x] = comb[t * HC * HC + threadIdx.x - HC];
    __syncthreads();
    const int nc = D >> 3;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < nc; c += gridDim.y * blockDim.x) {
        float ff[8], r[HC][8];
        unpack8(ldg16(f + t * D + 8 * c), ff);
#pragma unroll
        for (int i = 0; i < HC; ++i) unpack8(ldg16(R + (t * HC + i) * D + 8 * c), r[i]);
#pragma unroll
        for (int j = 0; j < HC; ++j) {
            u32 h[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                double acc = __dmul_rn(pc[j], (double)ff[e]);
#pragma unroll
                for (int i = 0; i < HC; ++i) acc = __dadd_rn(acc, __dmul_rn(pc[HC + i * HC + j], (double)r[i][e]));
                h[e] = f64_to_bf16(acc);
            }
            stg16(out + (t * HC + j) * D + 8 * c,
                  make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16)));
        }
    }
}

// Phase stamps of the boundary kernels (tools/hc_boundary_phases.py builds hc.cu with
// -DMEMRA_HC_STAMPS; the production build compiles HC_STAMP away): thread `who` of each CTA writes
// %globaltimer to hc_stamps[CTA][i] at phase point i (the points: the tool's table).
#ifdef MEMRA_HC_STAMPS
__device__ unsigned long long hc_stamps[128][16];
#define HC_STAMP(who, i)                                                                          \
    do {                                                                                          \
        if (threadIdx.x == (who)) {                                                               \
            unsigned long long t_;                                                                \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)::"memory");                    \
            hc_stamps[blockIdx.x][i] = t_;                                                        \
        }                                                                                         \
    } while (0)
#else
#define HC_STAMP(who, i) do { } while (0)
#endif

// ------------------------------------------------------------------------- hc_boundary
// One decode token's whole sub-layer boundary in one launch:
//   [hc_post of the previous sub-layer] -> hc_pre (mixes, split, weighted sum) -> rmsnorm,
// bit-identical to the unfused chain hc_post -> hc_mixes_r6 -> hc_pre_split_apply ->
// rmsnorm_bf16_wbf16 (and so to their twins oracle.ops.hc_post / hc_pre / rmsnorm wherever
// those are bit-exact).
//
// Grid (n / 256) = one CTA per canonical mixes segment (see hc_mixes_body), block 256 (8 warps).
// Phase A (every CTA, segment sg = elements [256 sg, 256 sg + 256) of the flattened [4, D]
//   streams; element e = j*D + d, any D % 64 == 0: a segment may straddle two streams): with f,
//   thread t makes new element 256 sg + t with hc_post's double expression from f, R, post_in,
//   comb_in, stores it to out and to shared memory; without f the segment is R's. Then lane l of
//   every warp takes the segment's elements 8l..8l+7 and dots them with fn rows 3w..3w+2 (warp w)
//   plus their sum of squares, each a sequential double FMA chain over the 8 elements as in
//   hc_mixes_body. The warp sum of each value uses the same fixed tree as reduce_scatter32
//   (lanes paired by bit 4, then 3, 2, 1, 0: three xor stages then two reduce-scatter stages on
//   the 4 values), so the segment values are hc_mixes_body's bits. ws[sg*32 + 4w + k] holds
//   (row 3w + k) for k < 3, ws[sg*32 + 4w + 3] the sum of squares (read from warp 0's slot).
//   Phase A also prefetches the norm weight into L2 for the last CTA.
// Phase B (the last CTA to finish; __threadfence + atomic counter, which it resets to zero for
//   the next launch / graph replay; no grid-wide wait): cp.async ws, the streams S and the norm
//   weight into shared memory (S and the weight stay in flight until the weighted sum), add the
//   segments in segment order (= hc_mixes_body's split path), mixes = f32(dot * rsqrt), then
//   warp 0 runs split_lanes (Sinkhorn; writes pre/post/comb) WHILE warps 4..7 recompute pre
//   (pre_value, the same bits), form x = bf16(sum_i pre_i X_i) (weighted_streams' expression)
//   and run rmsnorm_row's exact arithmetic with the same 128-thread partition (chunk c by
//   thread c mod 128, warp_sum, warp partials in order) on a named barrier: x -> xn.
// post_in / comb_in may alias post_out / comb_out (the device step updates them in place):
//   every CTA reads them before its fence + atomic, the last CTA writes them after it.
// out must not alias R. Dynamic shared memory 14 D bytes (ws partials 4D, S 8D, weight 2D).
namespace {
constexpr int BND_THREADS = 256;
constexpr int BND_ROWS = (2 + HC) * HC;  // 24
constexpr int BND_ROWS_PER_WARP = BND_ROWS / (BND_THREADS / 32);  // 3
static_assert(BND_ROWS_PER_WARP == 3, "slot layout 4w + k assumes 3 rows per warp");
static_assert(BND_THREADS == MIX_SEG, "phase A: one thread per element of the CTA's segment");

// barrier of warps 4..7 (threads 128..255) of the CTA; barrier 0 is __syncthreads
DEV void bar_upper_half() { asm volatile("bar.sync 1, 128;" ::: "memory"); }
// barrier of warps 0..3 (threads 0..127): hc_boundary_pre_cluster's sum of squares
DEV void bar_lower_quarter() { asm volatile("bar.sync 2, 128;" ::: "memory"); }
DEV void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A lane's 8 fn values of each of its warp's 3 rows in CTA sg's segment: the HBM stream of the
// boundary, loaded BEFORE the PDL wait (PDL_ENTRY_PRELOAD, bnd_fn_preload: fn is a static weight,
// so the loads cannot observe the predecessor; under PDL the CTAs become resident during the
// preceding GEMV's last wave and the fn latency leaves the chain).
struct BndFn {
    float4 wa[BND_ROWS_PER_WARP], wb[BND_ROWS_PER_WARP];
};

// It ends its basic block (the branch on D, never taken), so ptxas cannot schedule the wait above
// the loads.
// bnd_fn_at: the loads of segment sg for warp wid (0..7) of the segment's 8 warps.
DEV BndFn bnd_fn_at(const float* __restrict__ fn, int D, int sg, int wid) {
    BndFn r;
    const int lane = threadIdx.x & 31;
    const int n = HC * D;
    const int e0 = sg * MIX_SEG + 8 * lane;
#pragma unroll
    for (int q = 0; q < BND_ROWS_PER_WARP; ++q) {
        const float4* wp = reinterpret_cast<const float4*>(fn + (i64)(BND_ROWS_PER_WARP * wid + q) * n + e0);
        r.wa[q] = ldg_weight_f4(wp);
        r.wb[q] = ldg_weight_f4(wp + 1);
    }
    return r;
}
DEV BndFn bnd_fn_preload(const float* __restrict__ fn, int D) {
    HC_STAMP(0, 0);
    const BndFn r = bnd_fn_at(fn, D, blockIdx.x, threadIdx.x >> 5);
    if (D < 0) __trap();
    return r;
}

// A segment's 4 values of one warp from the lane's 8 elements xf: rows 3w..3w+2 of fr (sequential
// double FMA chains over the 8 elements) and the sum of squares, summed over the warp by
// reduce_scatter32's tree.  Returns lane l < 4's value for slot 4w + l (l == 3: the squares).
DEV double bnd_seg_values(const BndFn& fr, const float* xf, int lane) {
    double v[4] = {0.0, 0.0, 0.0, 0.0};  // rows 3w, 3w+1, 3w+2, then the sum of squares
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const double d = xf[i];
        v[3] = __fma_rn(d, d, v[3]);
    }
#pragma unroll
    for (int q = 0; q < BND_ROWS_PER_WARP; ++q) {
        const float4 a = fr.wa[q], b = fr.wb[q];
        const float w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[q] = __fma_rn((double)w[i], (double)xf[i], v[q]);
    }
    // reduce_scatter32's tree on 4 values: pair lanes by bit 4, 3, 2 (xor), then 1, 0 (scatter)
#pragma unroll
    for (int o = 16; o >= 4; o >>= 1)
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = __dadd_rn(v[k], __shfl_xor_sync(0xffffffffu, v[k], o));
    rs_stage<2>(v, lane);
    rs_stage<1>(v, lane);  // lane l now holds value l & 3
    return v[0];
}

// hc_post's new element of stream j at channel d (double, i ascending; hc_post's expression)
// hc_post's value of one element from its bf16 inputs (f's and the 4 streams' at its channel; any
// bits above the low 16 ignored): double, i ascending (hc_post's expression)
DEV u16 bnd_post_value(double pj, const double* cj, u32 fb, const u32* rb) {
    double acc = __dmul_rn(pj, (double)bf16_to_f32(fb & 0xffffu));
#pragma unroll
    for (int i = 0; i < HC; ++i) acc = __dadd_rn(acc, __dmul_rn(cj[i], (double)bf16_to_f32(rb[i] & 0xffffu)));
    return (u16)f64_to_bf16(acc);
}
DEV u16 bnd_post_elem(const u16* __restrict__ f, const u16* __restrict__ R, const float* post_in,
                      const float* comb_in, int D, int j, int d) {
    // every load before any arithmetic
    const u32 fb = __ldg(f + d);
    u32 rb[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) rb[i] = __ldg(R + (i64)i * D + d);
    const double pj = post_in[j];
    double cj[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) cj[i] = comb_in[i * HC + j];
    return bnd_post_value(pj, cj, fb, rb);
}

// hc_post's 8 new elements of stream j at chunk c (channels 8c .. 8c + 7): bnd_post_elem's value per
// element, from one 16-byte load of f and of each stream (every load before any arithmetic)
DEV uint4 bnd_post_chunk(const u16* __restrict__ f, const u16* __restrict__ R, const float* post_in,
                         const float* comb_in, int D, int j, int c) {
    const uint4 fv = ldg16(f + 8 * c);
    uint4 rv[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) rv[i] = ldg16(R + (i64)i * D + 8 * c);
    const double pj = post_in[j];
    double cj[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) cj[i] = comb_in[i * HC + j];
    const u32 fw[4] = {fv.x, fv.y, fv.z, fv.w};
    u32 h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int sh = 16 * (e & 1);
        u32 rb[HC];
#pragma unroll
        for (int i = 0; i < HC; ++i) {
            const u32 rw[4] = {rv[i].x, rv[i].y, rv[i].z, rv[i].w};
            rb[i] = rw[e >> 1] >> sh;
        }
        h[e] = bnd_post_value(pj, cj, fw[e >> 1] >> sh, rb);
    }
    return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}

// hc_boundary's / hc_boundary_poll's phase A for CTA sg: writes out (f given), returns lane l < 4
// of warp w's value for slot 4w + l (rows 3w + l, l == 3 the squares).  fr: bnd_fn_preload's.
DEV double bnd_phase_a(const BndFn& fr, const u16* __restrict__ f, const u16* __restrict__ R,
                       const float* post_in, const float* comb_in, u16* out,
                       const u16* __restrict__ norm_w, int D, u16* seg_s) {
    const int lane = threadIdx.x & 31;
    const int sg = blockIdx.x;
    const int e0 = sg * MIX_SEG + 8 * lane;
    {
        const int nlines = (2 * D + 127) / 128;
        for (int li = blockIdx.x * BND_THREADS + threadIdx.x; li < nlines; li += gridDim.x * BND_THREADS)
            prefetch_l2(norm_w + 64 * li);
    }
    float xf[8];
    if (f != nullptr) {
        // hc_post once per element: thread t makes element e = 256 sg + t (new stream j, channel
        // d) and shares the segment through shared memory (8 warps recomputing each lane's 8
        // elements would cost 8x the f32 -> f64 conversions, 16 per clock per SM on sm_90).
        // (weak loads of post_in / comb_in: the launch's writer of them - hc_boundary's last
        // CTA - writes only after every CTA has passed its fence)
        const int e = sg * MIX_SEG + threadIdx.x;
        const int j = e / D, d = e - j * D;
        const u16 h = bnd_post_elem(f, R, post_in, comb_in, D, j, d);
        seg_s[threadIdx.x] = h;
        out[e] = h;
        __syncthreads();  // also orders every thread's store to out before the release below
        unpack8(*reinterpret_cast<const uint4*>(seg_s + 8 * lane), xf);
    } else {
        unpack8(ldg16(R + e0), xf);
    }
    return bnd_seg_values(fr, xf, lane);
}

// hc_boundary's segment chain of value t (row t < 24, t == 24 the squares) over part [nseg][32]:
// part[slot] + part[32 + slot] + ... in segment order.  The loads go out 8 at a time ahead of the
// adds (the add order is the chain's; only the load schedule differs from a plain loop, whose
// ~30-cycle shared-memory latency per step made 64 segments cost ~0.9 us: tools/hc_boundary_phases.py).
DEV double bnd_chain(const double* part, int t, int nseg) {
    const int slot = t < BND_ROWS ? 4 * (t / 3) + t % 3 : 3;
    double a = part[slot];
    int s = 1;
    for (; s + 8 <= nseg; s += 8) {
        double v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = part[(s + j) * 32 + slot];
#pragma unroll
        for (int j = 0; j < 8; ++j) a = __dadd_rn(a, v[j]);
    }
    for (; s < nseg; ++s) a = __dadd_rn(a, part[s * 32 + slot]);
    return a;
}
// mix value of row t from its chain and the squares' chain (hc_boundary's expression)
DEV float bnd_mix(double tot_row, double tot_sq, int n, double norm_eps) {
    const double rs = 1.0 / sqrt(tot_sq / (double)n + norm_eps);
    return __double2float_rn(__dmul_rn(tot_row, rs));
}

// The per-chunk expressions of the boundary's x / xn, one code for every kernel that forms them
// (bnd_wsum_norm, bnd_wsum_norm256, hc_boundary_pre_cluster), so their bytes agree by construction.
// x of chunk c (8 channels) = bf16(sum_i pre_i S_i), double, i ascending (weighted_streams'
// expression); S [4][D] in shared memory.
template <typename Pre>
DEV uint4 bnd_x_chunk(const Pre& pre, const u16* sst, int D, int c) {
    double acc[8];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
        float xi[8];
        unpack8(*reinterpret_cast<const uint4*>(sst + i * D + 8 * c), xi);
        const double p = pre[i];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const double prod = __dmul_rn(p, (double)xi[e]);
            acc[e] = i == 0 ? prod : __dadd_rn(acc[e], prod);
        }
    }
    u32 h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = f64_to_bf16(acc[e]);
    return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}
// rmsnorm_row's sum of squares over one chunk of x (8 bf16), continuing the thread's chain ss
DEV double bnd_ss_chunk(const uint4& x, double ss) {
    float xv[8];
    unpack8(x, xv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const double v = xv[e];
        ss = __fma_rn(v, v, ss);
    }
    return ss;
}
// rmsnorm_row's 1 / rms from the 4 warp partials of the sum of squares, added in warp order
DEV double bnd_norm_rsqrt(const double* red, int D, double norm_eps) {
    double s = red[0];
#pragma unroll
    for (int i = 1; i < 4; ++i) s += red[i];
    return 1.0 / sqrt(s / (double)D + norm_eps);
}
// xn of one chunk: bf16(w * (x * r)) in double (rmsnorm_row's expression)
DEV uint4 bnd_xn_chunk(const uint4& x, const uint4& w, double r) {
    float xv[8], wv[8];
    unpack8(x, xv);
    unpack8(w, wv);
    u32 h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = f64_to_bf16(__dmul_rn((double)wv[e], __dmul_rn((double)xv[e], r)));
    return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}

// The last CTA's x = bf16(sum_i pre_i S_i) and rmsnorm_row<u16> (xn) by warps 4..7 over thread
// vt's chunks (a thread reads only the chunks its own cp.async brought: the caller waited for
// them). S [4][D] in shared memory, row 0 overwritten by x; wst [D] the norm weight; red [4]
// shared doubles; pre: the 4 pre weights (shared memory or registers). One code for both kernels'
// x / xn bytes.
template <typename Pre>
DEV void bnd_wsum_norm(const Pre& pre, u16* sst, const u16* wst, u16* x_out, u16* xn_out, double* red,
                       int D, double norm_eps) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int vt = threadIdx.x - 128, nc = D >> 3;
    double ss = 0.0;
    for (int c = vt; c < nc; c += 128) {
        const uint4 o = bnd_x_chunk(pre, sst, D, c);
        ss = bnd_ss_chunk(o, ss);
        stg16(x_out + 8 * c, o);
        *reinterpret_cast<uint4*>(sst + 8 * c) = o;  // x over S_0's chunk c (read above, same thread)
    }
    ss = warp_sum(ss);  // block_sum<4>'s order: xor tree, then the 4 warp partials in order
    if (lane == 0) red[wid - 4] = ss;
    bar_upper_half();
    const double r = bnd_norm_rsqrt(red, D, norm_eps);
    for (int c = vt; c < nc; c += 128)
        stg16(xn_out + 8 * c, bnd_xn_chunk(*reinterpret_cast<const uint4*>(sst + 8 * c),
                                           *reinterpret_cast<const uint4*>(wst + 8 * c), r));
}
// hc_boundary_pre's x / xn from S [4][D] and the weight [D] in shared memory (every thread's
// cp.async landed and a block barrier passed): bnd_wsum_norm's bytes with all 256 threads where
// the order allows it.  x: chunk c by thread c mod 256 (a per-element expression: any thread);
// the sum of squares: rmsnorm_row's partition (chunk c by thread c mod 128 of warps 0..3, reading
// x back from shared memory, warp_sum, the 4 warp partials in order); xn: chunk c by thread
// c mod 256.  hc_boundary (warp 0 on the Sinkhorn) keeps bnd_wsum_norm on warps 4..7.
DEV void bnd_wsum_norm256(const float* pre, u16* sst, const u16* wst, u16* x_out, u16* xn_out, double* red,
                          int D, double norm_eps) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int nc = D >> 3;
    for (int c = threadIdx.x; c < nc; c += BND_THREADS) {
        const uint4 o = bnd_x_chunk(pre, sst, D, c);
        stg16(x_out + 8 * c, o);
        *reinterpret_cast<uint4*>(sst + 8 * c) = o;  // x over S_0's chunk c (read above, same thread)
    }
    HC_STAMP(0, 8);
    __syncthreads();
    HC_STAMP(0, 9);
    if (wid < 4) {
        double ss = 0.0;
        for (int c = threadIdx.x; c < nc; c += 128) ss = bnd_ss_chunk(*reinterpret_cast<const uint4*>(sst + 8 * c), ss);
        ss = warp_sum(ss);  // block_sum<4>'s order: xor tree, then the 4 warp partials in order
        if (lane == 0) red[wid] = ss;
    }
    __syncthreads();
    HC_STAMP(0, 10);
    const double r = bnd_norm_rsqrt(red, D, norm_eps);
    HC_STAMP(0, 11);
    for (int c = threadIdx.x; c < nc; c += BND_THREADS)
        stg16(xn_out + 8 * c, bnd_xn_chunk(*reinterpret_cast<const uint4*>(sst + 8 * c),
                                           *reinterpret_cast<const uint4*>(wst + 8 * c), r));
}

// hc_boundary_pre's last CTA after its ticket (and __threadfence): hc_boundary's phase B without
// the Sinkhorn warp, with a shorter chain (tools/hc_boundary_phases.py measured the old one at
// ~5 us: the chains 0.9, pre 0.6, the weighted sum and norm on 4 warps 2.6):
//   * every thread issues its cp.async: the partials (group 1), then its chunks of S and of the
//     weight (chunk c by thread c mod 256; group 2, in flight during the sums);
//   * warp 0 alone: lane t <= 24 adds chain t (bnd_chain), the mixes (bnd_mix, the squares'
//     chain by shuffle), lanes 0..3 pre (pre_value) -> mixes, pre_out, pre_s: no block barrier
//     between the chains and pre;
//   * one block barrier (every thread waited for its own cp.async), then bnd_wsum_norm256.
// The same expressions in the same order as hc_boundary's last CTA: the same bytes.
DEV void bnd_pre_tail(const u16* __restrict__ f, const u16* __restrict__ R, const u16* out,
                      const float* __restrict__ scale, const float* __restrict__ base,
                      const u16* __restrict__ norm_w, float* mixes, float* pre_out, u16* x_out, u16* xn_out,
                      int D, float hc_eps, double norm_eps, double* ws, int* counter) {
    extern __shared__ double bnd_smem[];  // partials [nseg][32], S [4][D], weight [D]
    __shared__ float pre_s[HC];
    __shared__ double red[4];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int n = HC * D, nseg = n / MIX_SEG, nc = D >> 3;
    double* part = bnd_smem;
    u16* sst = reinterpret_cast<u16*>(bnd_smem + nseg * 32);
    u16* wst = sst + HC * D;
    for (int i = threadIdx.x; i < nseg * 16; i += BND_THREADS) cp_async16(part + 2 * i, ws + 2 * i, true);
    cp_async_commit();
    const u16* S = f != nullptr ? out : R;  // out was written by this launch's CTAs
    for (int c = threadIdx.x; c < nc; c += BND_THREADS) {
#pragma unroll
        for (int i = 0; i < HC; ++i) cp_async16(sst + i * D + 8 * c, S + (i64)i * D + 8 * c, true);
        cp_async16(wst + 8 * c, norm_w + 8 * c, true);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's partials landed; S and the weight may still be in flight
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
    __syncthreads();
    HC_STAMP(0, 4);
    if (wid == 0) {
        const double tot = lane <= BND_ROWS ? bnd_chain(part, lane, nseg) : 0.0;
        const double tot_sq = __shfl_sync(0xffffffffu, tot, BND_ROWS);
        HC_STAMP(0, 12);
        const float m = bnd_mix(tot, tot_sq, n, norm_eps);
        HC_STAMP(0, 13);
        if (lane < BND_ROWS) mixes[lane] = m;
        if (lane < HC) {
            const float p = pre_value(m, scale[0], base[lane], hc_eps);
            pre_s[lane] = p;
            pre_out[lane] = p;
        }
        HC_STAMP(0, 5);
    }
    cp_async_wait<0>();
    __syncthreads();
    HC_STAMP(0, 6);
    bnd_wsum_norm256(pre_s, sst, wst, x_out, xn_out, red, D, norm_eps);
    HC_STAMP(0, 7);
}

// The last-CTA boundary of hc_boundary (SINKHORN) and hc_boundary_pre (!SINKHORN: no Sinkhorn
// warp; warps 4..7 write pre_out, the same pre_value bits split_lanes writes; post_out / comb_out
// / iters unused).  One body, so the split kernel stays hc_boundary minus warp 0 by construction.
template <bool SINKHORN>
DEV void bnd_lastcta(const BndFn& fr, const u16* __restrict__ f, const u16* __restrict__ R, const float* post_in,
                     const float* comb_in, u16* out,
                     const float* __restrict__ scale, const float* __restrict__ base,
                     const u16* __restrict__ norm_w, float* mixes, float* pre_out, float* post_out,
                     float* comb_out, u16* x_out, u16* xn_out, int D, int iters, float hc_eps,
                     double norm_eps, double* ws, int* counter) {
    extern __shared__ double bnd_smem[];  // last CTA: partials [nseg][32], S [4][D], weight [D]
    __shared__ double tot[BND_ROWS + 1];
    __shared__ float mix_s[BND_ROWS];
    __shared__ float pre_s[HC];
    __shared__ double red[4];
    __shared__ int is_last;
    __shared__ __align__(16) u16 seg_s[MIX_SEG];  // this CTA's segment of the new streams
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int n = HC * D, nseg = n / MIX_SEG;
    const int sg = blockIdx.x;
    // ---- phase A (the fn rows, the HBM stream, are requested first; hc_post once per element
    // when f is given: thread t makes element 256 sg + t and shares the segment in seg_s)
    HC_STAMP(0, 1);
    const double val = bnd_phase_a(fr, f, R, post_in, comb_in, out, norm_w, D, seg_s);
    HC_STAMP(0, 2);
    if (lane < 4) ws[sg * 32 + 4 * wid + lane] = val;  // slot 4w + 3: the same squares in every warp
    if (!last_cta_ticket(counter, (int)gridDim.x, is_last)) return;
    HC_STAMP(0, 3);
    // ---- phase B: the last CTA
    __threadfence();
    if constexpr (!SINKHORN) {
        bnd_pre_tail(f, R, out, scale, base, norm_w, mixes, pre_out, x_out, xn_out, D, hc_eps, norm_eps, ws,
                     counter);
        return;
    }
    const int nc = D >> 3;
    const int vt = threadIdx.x - 128;                                 // warps 4..7: 0..127
    double* part = bnd_smem;                                          // [nseg][32] ws partials
    u16* sst = reinterpret_cast<u16*>(bnd_smem + nseg * 32);          // [4][D] S; row 0 then x
    u16* wst = sst + HC * D;                                          // [D] the norm weight
    // every load of phase B is issued here (cp.async, L2): first the partials (group 1), then
    // warps 4..7's own chunks of S and of the norm weight (group 2), which stay in flight
    // through the segment sums and the mixes
    for (int i = threadIdx.x; i < nseg * 16; i += BND_THREADS) cp_async16(part + 2 * i, ws + 2 * i, true);
    cp_async_commit();
    if (wid >= 4) {
        const u16* S = f != nullptr ? out : R;  // out was written by this launch's CTAs
        for (int c = vt; c < nc; c += 128) {
#pragma unroll
            for (int i = 0; i < HC; ++i) cp_async16(sst + i * D + 8 * c, S + (i64)i * D + 8 * c, true);
            cp_async16(wst + 8 * c, norm_w + 8 * c, true);
        }
        cp_async_commit();
        cp_async_wait<1>();  // the partials landed; S and the weight may still be in flight
    } else {
        cp_async_wait<0>();
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
    __syncthreads();
    HC_STAMP(0, 4);
    if (threadIdx.x <= BND_ROWS) {  // value t: row t (slot 4(t/3) + t%3), t == 24 the squares
        tot[threadIdx.x] = bnd_chain(part, threadIdx.x, nseg);
    }
    __syncthreads();
    if (threadIdx.x < BND_ROWS) {
        const double rs = 1.0 / sqrt(tot[BND_ROWS] / (double)n + norm_eps);
        const float m = __double2float_rn(__dmul_rn(tot[threadIdx.x], rs));
        mix_s[threadIdx.x] = m;
        mixes[threadIdx.x] = m;
    }
    __syncthreads();
    HC_STAMP(0, 5);
    if (SINKHORN && wid == 0) {  // Sinkhorn on its own warp: comb / post are for the next hc_post only
        split_lanes(mix_s, scale, base, iters, hc_eps, lane, nullptr, pre_out, post_out, comb_out);
        return;
    }
    if (wid < 4) return;
    // warps 4..7: pre, x = bf16(sum_i pre_i S_i), then rmsnorm_row<u16> with thread vt's chunks
    // (each thread reads only the chunks its own cp.async brought: its wait suffices for them)
    if (vt < HC) {
        const float p = pre_value(mix_s[vt], scale[0], base[vt], hc_eps);
        pre_s[vt] = p;
        if (!SINKHORN) pre_out[vt] = p;  // with the Sinkhorn warp, its split_lanes wrote pre_out
    }
    cp_async_wait<0>();
    bar_upper_half();
    HC_STAMP(128, 6);
    bnd_wsum_norm(pre_s, sst, wst, x_out, xn_out, red, D, norm_eps);
    HC_STAMP(128, 7);
}
}  // namespace

// f [D] bf16 or null; R [4, D] bf16; post_in [4], comb_in [4, 4] f32 (read only when f != null);
// out [4, D] bf16 (f != null); fn [24, 4D] f32; scale [3]; base [24]; norm_w [D] bf16;
// mixes [24], pre_out [4], post_out [4], comb_out [16] f32; x_out, xn_out [D] bf16;
// ws double [n/256 * 32]; counter int [1], zero before the first launch (left zero).
// n = 4D, n % 256 == 0, n <= 32768. grid (n / 256), block 256, dynamic shared 14 D bytes.
// Multi-row (grid (n / 256, T)): every per-token array above with T contiguous rows ([T, D],
// [T, 4, D], [T, 24], [T, 4], [T, 4, 4]), ws [T][n/256 * 32], counter [T]; row t independent.
// (min 1 CTA/SM: lets ptxas keep all of phase A's loads in flight at once; the grid is n/256 CTAs)
extern "C" __global__ void __launch_bounds__(BND_THREADS, 1)
hc_boundary(const u16* __restrict__ f, const u16* __restrict__ R, const float* post_in,
            const float* comb_in, u16* out, const float* __restrict__ fn,
            const float* __restrict__ scale, const float* __restrict__ base,
            const u16* __restrict__ norm_w, float* mixes, float* pre_out, float* post_out,
            float* comb_out, u16* x_out, u16* xn_out, int D, int iters, float hc_eps,
            double norm_eps, double* ws, int* counter) {
    PDL_ENTRY_PRELOAD(const BndFn fr = bnd_fn_preload(fn, D));
    // blockIdx.y = row t of a multi-row launch (the device verify's T tokens, each its own
    // boundary): every per-token pointer moves by row t's stride, the split workspace by row t's
    // nseg x 32 partials and ticket t.  Row 0 (the step's grid.y = 1) is the one-token launch
    // unchanged; a row's CTAs compute exactly what a one-token launch computes: the same bytes.
    const int t = blockIdx.y;
    const i64 hd = (i64)HC * D;
    if (t != 0) {
        if (f != nullptr) {
            f += t * (i64)D;
            post_in += t * HC;
            comb_in += t * HC * HC;
            out += t * hd;
        }
        R += t * hd;
        mixes += t * BND_ROWS;
        pre_out += t * HC;
        post_out += t * HC;
        comb_out += t * HC * HC;
        x_out += t * (i64)D;
        xn_out += t * (i64)D;
        ws += (i64)t * (hd / MIX_SEG) * 32;
        counter += t;
    }
    bnd_lastcta<true>(fr, f, R, post_in, comb_in, out, scale, base, norm_w, mixes, pre_out, post_out,
                      comb_out, x_out, xn_out, D, iters, hc_eps, norm_eps, ws, counter);
}

// ------------------------------------------------------------------------- hc_boundary_poll
// hc_boundary with a shorter serial tail (ops.hc BOUNDARY_IMPL "poll"); the same bytes in every
// output (mixes, pre, post, comb, out, x, xn), each value by the same f32 / f64 expression in the
// same order as hc_boundary (and so as the unfused chain).
//
// Phase A: hc_boundary's own (bnd_phase_a). The handoff is a
//   self-validating slot per value instead of fence + ticket + a second L2 read: lane k < 4 of warp
//   w of CTA sg publishes its value in slot sg*32 + 4w + k (the layout of hc_boundary's ws) as
//   bits ^ BND_KEY (never 0: BND_KEY is a NaN payload the double sums cannot produce; a value with
//   those bits would be stored as 1, a NaN as well) with a release (fence.acq_rel.gpu +
//   st.relaxed.gpu, after the __syncthreads that follows the CTA's stores to out). An empty slot
//   is 0. Every CTA but CTA 0 is then done.
// CTA 0 (the designated tail; no ticket): warps 4..7 start the norm weight's cp.async, then all
//   256 threads poll the nseg*32 slots (ld.relaxed.gpu, every missing slot of a thread re-read
//   per round: one L2 round trip after the last slot lands), decode them into shared memory in
//   hc_boundary's [nseg][32] partial layout, fence.acq_rel.gpu (acquire: out of the other CTAs),
//   __syncthreads. Then, with no further block-wide barrier:
//     warp 0: the 16 comb rows (lane & 15) and the squares, each lane its own segment chain, then
//             the Sinkhorn over all 32 lanes (lanes 16..31 a copy of 0..15: full-mask shuffles),
//             lanes 0..15 write mixes[8..23] and comb;
//     warp 1: rows 4..7 -> mixes[4..7], post (hc_boundary ran these on the Sinkhorn warp, after
//             the Sinkhorn in issue order: here they are off the Sinkhorn's path);
//     warps 2..3: zero the slots for the next launch (every slot was read before the barrier);
//     warps 4..7: rows 0..3 -> pre (each warp its own copy; warp 4 writes mixes[0..3], pre), the
//             streams' cp.async, then hc_boundary's weighted sum + rmsnorm code unchanged.
//   Each chain is hc_boundary's: part[slot] + part[32 + slot] + ... in segment order (double),
//   rs = 1 / sqrt(squares / n + norm_eps), mix = f32(chain * rs).
// Forward progress: only CTA 0 waits, and only for CTAs that never wait, so no co-residency is
//   needed (a CTA still to be scheduled gets any SM the others leave; under PDL no dependent grid
//   starts before every CTA of this one has run PDL_ENTRY).
// Slots: u64 [128 * 32] (ops.hc via ticket_counter: zeroed once, before any capture), left zero
//   by every launch (graph replay). Not for concurrent launches on two streams of one device.
// post_in / comb_in may alias post_out / comb_out: every CTA reads them before its release, CTA 0
//   writes them after its acquire.
namespace {
constexpr u64 BND_KEY = 0x7FF4C0DE5EED0001ULL;
constexpr int BND_MAX_SLOTS = MIX_MAX_SEG * 32;                 // n <= 32768: nseg <= 128
constexpr int BND_POLL = BND_MAX_SLOTS / BND_THREADS;           // slots per polling thread (16)

DEV void st_release_gpu(u64* p, u64 v) {
    asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DEV u64 ld_relaxed_gpu(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
DEV void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
DEV u64 bnd_encode(double v) {
    const u64 s = (u64)__double_as_longlong(v) ^ BND_KEY;
    return s != 0 ? s : 1ULL;
}
DEV double bnd_decode(u64 s) { return __longlong_as_double((long long)(s ^ BND_KEY)); }


// split_lanes' Sinkhorn with every lane of the warp: lane l holds comb entry (j, k) of
// e = l & 15 = 4j + k; lanes 16..31 compute the same values as 0..15 (full-mask shuffles within
// each half). Returns comb[j][k] (the same f32 operations in the same order as split_lanes).
DEV float sum4_full(float v, int src0, int step) {
    const float a = __shfl_sync(0xffffffffu, v, src0);
    const float b = __shfl_sync(0xffffffffu, v, src0 + step);
    const float c = __shfl_sync(0xffffffffu, v, src0 + 2 * step);
    const float d = __shfl_sync(0xffffffffu, v, src0 + 3 * step);
    return __fadd_rn(__fadd_rn(__fadd_rn(a, b), c), d);
}
DEV float sinkhorn_full_warp(float m, float s2, float b, int iters, float hc_eps, int lane) {
    const int h = lane & 16, e = lane & 15, j = e >> 2, k = e & 3;
    const int row0 = h + 4 * j, col0 = h + k;
    float L = __fadd_rn(__fmul_rn(m, s2), b);
    const float l0 = __shfl_sync(0xffffffffu, L, row0), l1 = __shfl_sync(0xffffffffu, L, row0 + 1);
    const float l2 = __shfl_sync(0xffffffffu, L, row0 + 2), l3 = __shfl_sync(0xffffffffu, L, row0 + 3);
    const float mx = fmaxf(fmaxf(l0, l1), fmaxf(l2, l3));
    L = exp_f32(__fsub_rn(L, mx));
    L = __fadd_rn(__fdiv_rn(L, sum4_full(L, row0, 1)), hc_eps);   // it is now C
    L = __fdiv_rn(L, __fadd_rn(sum4_full(L, col0, 4), hc_eps));
    for (int it = 1; it < iters; ++it) {
        L = __fdiv_rn(L, __fadd_rn(sum4_full(L, row0, 1), hc_eps));
        L = __fdiv_rn(L, __fadd_rn(sum4_full(L, col0, 4), hc_eps));
    }
    return L;
}

}  // namespace

// hc_boundary's arguments with slots (u64 [128 * 32], zero, left zero) in place of ws / counter.
// grid (n / 256), block 256, dynamic shared 14 D bytes.
extern "C" __global__ void __launch_bounds__(BND_THREADS, 1)
hc_boundary_poll(const u16* __restrict__ f, const u16* __restrict__ R, const float* post_in,
                 const float* comb_in, u16* out, const float* __restrict__ fn,
                 const float* __restrict__ scale, const float* __restrict__ base,
                 const u16* __restrict__ norm_w, float* mixes, float* pre_out, float* post_out,
                 float* comb_out, u16* x_out, u16* xn_out, int D, int iters, float hc_eps,
                 double norm_eps, int* slots_i32) {
    PDL_ENTRY_PRELOAD(const BndFn fr = bnd_fn_preload(fn, D));
    extern __shared__ double bnd_smem[];  // CTA 0: partials [nseg][32], S [4][D], weight [D]
    __shared__ double red[4];
    __shared__ __align__(16) u16 seg_s[MIX_SEG];
    u64* slots = reinterpret_cast<u64*>(slots_i32);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int n = HC * D, nseg = n / MIX_SEG;
    const double val = bnd_phase_a(fr, f, R, post_in, comb_in, out, norm_w, D, seg_s);
    if (lane < 4) st_release_gpu(slots + blockIdx.x * 32 + 4 * wid + lane, bnd_encode(val));
    if (blockIdx.x != 0) return;
    // ---- CTA 0
    const int nc = D >> 3;
    const int vt = threadIdx.x - 128;                                 // warps 4..7: 0..127
    double* part = bnd_smem;                                          // [nseg][32]
    u16* sst = reinterpret_cast<u16*>(bnd_smem + nseg * 32);          // [4][D] S; row 0 then x
    u16* wst = sst + HC * D;                                          // [D] the norm weight
    if (wid >= 4) {  // the weight is an input: in flight during the wait
        for (int c = vt; c < nc; c += 128) cp_async16(wst + 8 * c, norm_w + 8 * c, true);
        cp_async_commit();
    }
    {
        const int nslot = nseg * 32;
        u64 s[BND_POLL];
#pragma unroll
        for (int i = 0; i < BND_POLL; ++i) s[i] = 0;
        for (;;) {
#pragma unroll
            for (int i = 0; i < BND_POLL; ++i) {
                const int q = threadIdx.x + i * BND_THREADS;
                if (q < nslot && s[i] == 0) s[i] = ld_relaxed_gpu(slots + q);
            }
            bool done = true;
#pragma unroll
            for (int i = 0; i < BND_POLL; ++i) {
                const int q = threadIdx.x + i * BND_THREADS;
                done = done && (q >= nslot || s[i] != 0);
            }
            if (done) break;
        }
#pragma unroll
        for (int i = 0; i < BND_POLL; ++i) {
            const int q = threadIdx.x + i * BND_THREADS;
            if (q < nslot) part[q] = bnd_decode(s[i]);
        }
        fence_acq_rel_gpu();  // acquire: the other CTAs' out, released with their slots
    }
    __syncthreads();
    if (wid == 0) {  // comb rows 8 + (lane & 15): the Sinkhorn
        const int e = lane & 15;
        const float m = bnd_mix(bnd_chain(part, 2 * HC + e, nseg), bnd_chain(part, BND_ROWS, nseg), n, norm_eps);
        if (lane < 16) mixes[2 * HC + lane] = m;
        const float c = sinkhorn_full_warp(m, scale[2], base[2 * HC + e], iters, hc_eps, lane);
        if (lane < 16) comb_out[lane] = c;
        return;
    }
    if (wid == 1) {  // rows 4..7: post
        if (lane < HC) {
            const float m = bnd_mix(bnd_chain(part, HC + lane, nseg), bnd_chain(part, BND_ROWS, nseg), n, norm_eps);
            mixes[HC + lane] = m;
            const float s = sigmoid_f32(__fadd_rn(__fmul_rn(m, scale[1]), base[HC + lane]));
            post_out[lane] = __fmul_rn(2.0f, s);
        }
        return;
    }
    if (wid < 4) {  // the slots back to zero for the next launch (all were read before the barrier)
        uint4* z = reinterpret_cast<uint4*>(slots);
        for (int q = threadIdx.x - 64; q < nseg * 16; q += 64) z[q] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    // warps 4..7: the streams' cp.async, pre (rows 0..3, each warp its own copy), then
    // hc_boundary's weighted sum + rmsnorm_row<u16> with thread vt's chunks
    {
        const u16* S = f != nullptr ? out : R;  // out was written by this launch's CTAs (acquired above)
        for (int c = vt; c < nc; c += 128) {
#pragma unroll
            for (int i = 0; i < HC; ++i) cp_async16(sst + i * D + 8 * c, S + (i64)i * D + 8 * c, true);
        }
        cp_async_commit();
    }
    float pl = 0.0f;
    if (lane < HC) {
        const float m = bnd_mix(bnd_chain(part, lane, nseg), bnd_chain(part, BND_ROWS, nseg), n, norm_eps);
        pl = pre_value(m, scale[0], base[lane], hc_eps);
        if (wid == 4) {
            mixes[lane] = m;
            pre_out[lane] = pl;
        }
    }
    float pre_r[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) pre_r[i] = __shfl_sync(0xffffffffu, pl, i);
    cp_async_wait<0>();  // thread vt reads only the chunks its own cp.async brought
    bnd_wsum_norm(pre_r, sst, wst, x_out, xn_out, red, D, norm_eps);
}

// ------------------------------------------------------------------------- the split boundary
// hc_boundary in two launches (ops.hc.hc_boundary_pre + hc_boundary_sinkhorn; the device step's
// seam MEMRA_DSV4_HC_SPLIT), so the f32 Sinkhorn can leave the critical path: the comb matrix and
// the post weights of boundary b are read only by the hc_post of boundary b + 1 (fused into its
// phase A, or the stage's last stand-alone hc_post), never by the sub-layer that follows
// boundary b.  Together the two write the same bytes as hc_boundary in every output:
//
// hc_boundary_pre (critical: the sub-layer's input): hc_boundary's body (bnd_lastcta<false>)
//   without warp 0's split_lanes: phase A (bnd_phase_a: hc_post with post_in / comb_in -> out, the mixes partials),
//   the last CTA's segment sums -> mixes[0..23] (all 24: the Sinkhorn kernel reads them), then
//   warps 4..7: pre (pre_value, thread vt < 4 also writes pre_out: hc_boundary's warp 0 wrote
//   the same pre_value bits from split_lanes), the weighted sum and the rmsnorm (bnd_wsum_norm)
//   -> x, xn.  It writes no post / comb: post_in / comb_in are pure inputs here.
// hc_boundary_sinkhorn (off the critical path): one warp runs hc_boundary's split_lanes on the 24
//   mixes the critical kernel stored (the same f32 values hc_boundary kept in shared memory, the
//   same f32 operations in the same order) -> post_out, comb_out (pre is not rewritten).
//   Grid 1, block 32.  Reads nothing the critical kernel of the NEXT boundary writes before the
//   caller's ordering (the device step joins the branch before that kernel; see
//   step_device._hc_pre).
extern "C" __global__ void __launch_bounds__(BND_THREADS, 1)
hc_boundary_pre(const u16* __restrict__ f, const u16* __restrict__ R, const float* __restrict__ post_in,
                const float* __restrict__ comb_in, u16* out, const float* __restrict__ fn,
                const float* __restrict__ scale, const float* __restrict__ base,
                const u16* __restrict__ norm_w, float* mixes, float* pre_out, u16* x_out,
                u16* xn_out, int D, float hc_eps, double norm_eps, double* ws, int* counter) {
    PDL_ENTRY_PRELOAD(const BndFn fr = bnd_fn_preload(fn, D));
    bnd_lastcta<false>(fr, f, R, post_in, comb_in, out, scale, base, norm_w, mixes, pre_out, nullptr,
                       nullptr, x_out, xn_out, D, 0, hc_eps, norm_eps, ws, counter);
}

// mixes [24] (hc_boundary_pre's), scale [3], base [24] -> post_out [4], comb_out [16].
// grid 1, block 32.
extern "C" __global__ void __launch_bounds__(32)
hc_boundary_sinkhorn(const float* __restrict__ mixes, const float* __restrict__ scale,
                     const float* __restrict__ base, float* __restrict__ post_out,
                     float* __restrict__ comb_out, int iters, float hc_eps) { PDL_ENTRY();
    split_lanes(mixes, scale, base, iters, hc_eps, threadIdx.x, nullptr, nullptr, post_out, comb_out);
}

// ------------------------------------------------------------------------- the cluster boundary
// hc_boundary_pre_cluster: hc_boundary_pre's outputs, byte for byte, from ONE thread-block cluster
// of C = D / 256 CTAs (C <= 16; D = 4096: 16, a non-portable size the launch allows on the
// function) whose CTAs hand their partials to each other through distributed shared memory
// (cluster.cuh), so no CTA is "last": the serial tail of hc_boundary_pre (fence, ticket, the last
// CTA's L2 re-read of 64 partial blocks and of the 4 streams, then the weighted sum and the norm
// of all D channels on one SM, ~16 f32 <-> f64 conversions per clock) is spread over the cluster.
//
// CTA r (= blockIdx.x: one cluster) owns channels [256 r, 256 r + 256) of all 4 streams, i.e. the
// canonical mixes segments sg = q C + r, q = 0..3 (segment sg = elements [256 sg, 256 sg + 256)
// of the flattened [4, D] streams; C * 256 = D, so segment q C + r is stream q's channels of CTA
// r).  1024 threads = 4 units of 256: unit q computes segment q C + r exactly as one CTA of
// hc_boundary_pre does (its 8 warps, 3 fn rows each, loaded before the PDL wait; bnd_post_elem,
// bnd_seg_values: the same code).
//   1. Every CTA sends its 4 x 32 partial slots (1 KB) to every CTA of the cluster (st.async into
//      part [nseg][32], completing the receiver's mbarrier 0, which expects nseg * 256 bytes).
//   2. Each CTA, once its mbarrier 0 completes, adds the 25 segment chains in segment order
//      (hc_boundary's bnd_chain: the same sequence of double adds, so every CTA holds the same
//      bits), forms mixes and pre (bnd_mix, pre_value), and CTA 0 stores mixes and pre_out.
//   3. Each CTA forms x = bf16(sum_i pre_i S_i) for its 256 channels (bnd_wsum_norm's expression,
//      S from its own units' segments), stores them to x_out and sends them to every CTA (st.async
//      into xall [D], mbarrier 1, D * 2 bytes).
//   4. Each CTA, once its mbarrier 1 completes, runs rmsnorm_row's sum of squares over ALL of x
//      with bnd_wsum_norm's 128-thread partition (thread vt: chunks vt, vt + 128, ... in order,
//      warp_sum, the 4 warp partials in order): the same s, r in every CTA; then xn for its own
//      channels (the same expression) -> xn_out.
// Every value is the same f32 / f64 expression in the same order as hc_boundary_pre computes it,
// so the bytes equal (tests/gpu/test_kernels_hc.py).  Requires D % 256 == 0, D <= 4096 (else the
// host uses hc_boundary_pre).  post_in / comb_in: pure inputs.
// Arguments: hc_boundary_pre's without ws / counter.  grid C with cluster dims (C, 1, 1), block
// 1024, dynamic shared memory nseg * 256 + 2 D bytes (the partials, then x of all channels).
namespace {
constexpr int BNC_THREADS = HC * BND_THREADS;  // 4 units of 256

struct BncBars {
    u64 part, x;
};
DEV BncBars* bnc_bars() {
    __shared__ __align__(8) BncBars b;
    return &b;
}

// Before the PDL wait: the unit's fn rows (static), the norm weight of the CTA's channels
// (static; cp.async by warp 0, waited for by the same threads in step 4), the two mbarriers, and
// the cluster arrive.  Nothing here reads what the predecessor writes.
DEV BndFn bnc_preload(const float* __restrict__ fn, const u16* __restrict__ norm_w, u16* w_s, int D) {
    const int q = threadIdx.x / BND_THREADS, wid8 = (threadIdx.x >> 5) & 7;
    const int C = gridDim.x, r = blockIdx.x, nseg = HC * C;
    HC_STAMP(0, 0);
    // the mbarriers first: fence.mbarrier_init (FENCE.VIEW.ASYNC.S) after the weight's cp.async
    // held thread 0's warp until the copy landed, ~1 us of HBM latency before its post-wait loads
    // (tools/hc_boundary_phases.py: entry -> wait 1.0-1.3 us against 0.5 for the ticket form)
    if (threadIdx.x == 0) {
        BncBars* b = bnc_bars();
        mbar_init_expect(&b->part, (u32)(nseg * 32 * sizeof(double)));
        mbar_init_expect(&b->x, (u32)(2 * D));
        fence_mbarrier_init_cluster();
    }
    const BndFn fr = bnd_fn_at(fn, D, q * C + r, wid8);
    if (threadIdx.x < MIX_SEG / 8) {
        cp_async16(w_s + 8 * threadIdx.x, norm_w + MIX_SEG * r + 8 * threadIdx.x, true);
        cp_async_commit();
    }
    if (D < 0) __trap();  // ends the block: the wait stays below the loads (bnd_fn_preload's reason)
    cluster_arrive_relaxed();
    return fr;
}

DEV void bnc_body(const BndFn& fr, const u16* __restrict__ f, const u16* __restrict__ R,
                  const float* __restrict__ post_in, const float* __restrict__ comb_in, u16* out,
                  const float* __restrict__ scale, const float* __restrict__ base, const u16* w_s,
                  float* mixes, float* pre_out, u16* x_out, u16* xn_out, int D, float hc_eps,
                  double norm_eps) {
    extern __shared__ __align__(16) double bnc_smem[];
    __shared__ __align__(16) u16 seg_s[HC][MIX_SEG];     // S of this CTA's channels, stream q
    __shared__ __align__(16) double stage[HC * 32];      // this CTA's 4 segments' slots
    __shared__ __align__(16) u16 xo_s[MIX_SEG];          // x of this CTA's channels
    __shared__ float pre_s[HC];
    __shared__ double red[4];
    BncBars* bars = bnc_bars();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int q = threadIdx.x / BND_THREADS, t = threadIdx.x % BND_THREADS, wid8 = wid & 7;
    const int C = gridDim.x, r = blockIdx.x, nseg = HC * C, n = HC * D;
    double* part = bnc_smem;                                      // [nseg][32]
    u16* xall = reinterpret_cast<u16*>(bnc_smem + nseg * 32);     // [D]
    // ---- phase A: unit q = segment q C + r = stream q, channel d = 256 r + t
    const int d = MIX_SEG * r + t;
    HC_STAMP(0, 1);
    {
        const u16 h = f != nullptr ? bnd_post_elem(f, R, post_in, comb_in, D, q, d) : R[(i64)q * D + d];
        if (f != nullptr) out[(i64)q * D + d] = h;
        seg_s[q][t] = h;
    }
    __syncthreads();
    HC_STAMP(0, 2);
    {
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(&seg_s[q][8 * lane]), xf);
        const double v = bnd_seg_values(fr, xf, lane);
        if (lane < 4) stage[q * 32 + 4 * wid8 + lane] = v;  // slot 4 w + 3: the squares, every warp
    }
    __syncthreads();
    HC_STAMP(0, 3);
    cluster_started();  // every CTA started, its mbarriers initialised: remote stores may begin
    HC_STAMP(0, 4);
    // ---- 1. the 4 segments' slots to every CTA: chunk k (2 doubles) of 64, destination c
    for (int i = threadIdx.x; i < C * 64; i += BNC_THREADS) {
        const int c = i >> 6, k = i & 63, qq = k >> 4, slot = 2 * (k & 15);
        const double* src = stage + qq * 32 + slot;
        st_async_cluster_16(part + (qq * C + r) * 32 + slot, &bars->part, (u32)c,
                            (u64)__double_as_longlong(src[0]), (u64)__double_as_longlong(src[1]));
    }
    // ---- 2. the mixes and pre (warp 0; every CTA the same bits)
    HC_STAMP(0, 5);
    if (wid == 0) {
        mbar_wait_cluster(&bars->part, 0);
        HC_STAMP(0, 6);
        const double tot = lane <= BND_ROWS ? bnd_chain(part, lane, nseg) : 0.0;
        const double tot_sq = __shfl_sync(0xffffffffu, tot, BND_ROWS);
        const float m = bnd_mix(tot, tot_sq, n, norm_eps);
        if (r == 0 && lane < BND_ROWS) mixes[lane] = m;
        if (lane < HC) {
            const float p = pre_value(m, scale[0], base[lane], hc_eps);
            pre_s[lane] = p;
            if (r == 0) pre_out[lane] = p;
        }
    }
    __syncthreads();
    HC_STAMP(0, 7);
    // ---- 3. x of this CTA's channels (threads 0..255, channel t), to x_out and to every CTA
    if (threadIdx.x < MIX_SEG) {
        double acc = 0.0;
#pragma unroll
        for (int i = 0; i < HC; ++i) {
            const double prod = __dmul_rn((double)pre_s[i], (double)bf16_to_f32(seg_s[i][t]));
            acc = i == 0 ? prod : __dadd_rn(acc, prod);
        }
        xo_s[t] = (u16)f64_to_bf16(acc);
    }
    __syncthreads();
    HC_STAMP(0, 8);
    for (int i = threadIdx.x; i < C * 32; i += BNC_THREADS) {  // chunk k (8 channels) to CTA c
        const int c = i >> 5, k = i & 31;
        const uint4 v = *reinterpret_cast<const uint4*>(xo_s + 8 * k);
        st_async_cluster_16(xall + MIX_SEG * r + 8 * k, &bars->x, (u32)c, ((u64)v.y << 32) | v.x,
                            ((u64)v.w << 32) | v.z);
    }
    if (threadIdx.x < MIX_SEG / 8)
        stg16(x_out + MIX_SEG * r + 8 * threadIdx.x, *reinterpret_cast<const uint4*>(xo_s + 8 * threadIdx.x));
    HC_STAMP(0, 9);
    if (threadIdx.x >= 128) return;
    // ---- 4. warps 0..3: the sum of squares of all of x (bnd_wsum_norm's partition and order)
    mbar_wait_cluster(&bars->x, 0);
    HC_STAMP(0, 10);
    const int nc = D >> 3;
    double ss = 0.0;
    for (int c = threadIdx.x; c < nc; c += 128) ss = bnd_ss_chunk(*reinterpret_cast<const uint4*>(xall + 8 * c), ss);
    ss = warp_sum(ss);
    if (lane == 0) red[wid] = ss;
    bar_lower_quarter();
    HC_STAMP(0, 11);
    if (threadIdx.x >= MIX_SEG / 8) return;
    const double rr = bnd_norm_rsqrt(red, D, norm_eps);
    cp_async_wait<0>();  // this thread's chunk of the norm weight (bnc_preload)
    stg16(xn_out + MIX_SEG * r + 8 * threadIdx.x, bnd_xn_chunk(*reinterpret_cast<const uint4*>(xo_s + 8 * threadIdx.x),
                                                              *reinterpret_cast<const uint4*>(w_s + 8 * threadIdx.x), rr));
    HC_STAMP(0, 12);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(BNC_THREADS, 1)
hc_boundary_pre_cluster(const u16* __restrict__ f, const u16* __restrict__ R, const float* __restrict__ post_in,
                        const float* __restrict__ comb_in, u16* out, const float* __restrict__ fn,
                        const float* __restrict__ scale, const float* __restrict__ base,
                        const u16* __restrict__ norm_w, float* mixes, float* pre_out, u16* x_out,
                        u16* xn_out, int D, float hc_eps, double norm_eps) {
    __shared__ __align__(16) u16 w_s[MIX_SEG];  // the norm weight of this CTA's channels
    PDL_ENTRY_PRELOAD(const BndFn fr = bnc_preload(fn, norm_w, w_s, D));
    bnc_body(fr, f, R, post_in, comb_in, out, scale, base, w_s, mixes, pre_out, x_out, xn_out, D, hc_eps,
             norm_eps);
}

// ------------------------------------------------------------------------- the cooperative boundary
// hc_boundary_pre_coop: hc_boundary_pre's outputs, byte for byte, from the ticket form's own grid
// (G = n / 256 CTAs x 256 threads, one canonical segment each, fn loaded before the PDL wait: the
// same phase A) with the single-SM tail spread over NT "tail" CTAs (n_tail: 8, or all G).  The
// ticket form's last CTA spends ~4.9 us after its ticket (tools/hc_boundary_phases.py,
// twenty-second session): the L2 re-read of 64 partial blocks, the chains, then x, the sum of
// squares and xn of all D channels on one SM (~16 f32 <-> f64 conversions per clock).
// Measured (docs/decode_perf.md, twenty-fifth session): up to ~0.5 us shorter alone, neutral in
// the step with 8 tail CTAs, 0.9-1.7 % slower with all 64 (held resident for ~7 us): opt-in.
//
// Ownership: tail CTA k < NT owns threads [k P, k P + P) of rmsnorm_row's 128-thread partition
//   (P = 128 / NT; thread u's chunks are u, u + 128, u + 256, ... of the D / 8 chunks of 8
//   channels): P M chunks, D / NT channels of every stream; local chunk j = u' M + m is global
//   chunk k P + u' + 128 m (bco_chunk; M = D / 1024 chunks per thread).
// 1. Phase A (every CTA): the ticket form's (bnd_phase_a: hc_post -> out for segment k, the
//    segment's 32 slot values), which go out as tagged words (below); CTAs k >= NT are then done.
// 2. Round 1 (tail CTAs): S of the own 4 x D / NT stream elements (bnd_post_chunk: the bits the
//    elements' segment owners store to out; R's without f) into shared memory, its loads in
//    flight during the poll; poll, over every segment, the slots the CTA needs: rows 0..3 and
//    the squares (for pre) and the mixes rows 4 + k + NT i < 24 it stores; warp 0 adds each chain
//    in segment order (bnd_chain's sequence of double adds), forms the mixes (bnd_mix) and pre
//    (pre_value); CTA 0 stores mixes[0..3] and pre_out.  Every tail CTA holds the same pre bits.
// 3. x of the own channels (bnd_x_chunk's expression, per element) -> x_out; the CTA's P
//    threads' sum-of-squares chains over their chunks in order (bnd_ss_chunk) -> round 2.
// 4. Round 2: each tail CTA polls the 128 chains, sums them as bnd_wsum_norm256 does (warp_sum
//    over each warp's 32 chains, the 4 warp partials in order: bnd_norm_rsqrt), and writes xn of
//    its channels (bnd_xn_chunk; the weight chunks were loaded before the PDL wait).
// Tagged words: a double crosses as two u64 words (tag << 32) | half, st.relaxed.gpu, polled with
//   ld.relaxed.gpu until the word carries this launch's tag.  Only these words cross CTAs (no
//   CTA reads another's out), so no fence, no ticket and no reset: the tag is the launch's epoch (the epoch word + 1, 0 skipped), read by every CTA after the PDL wait;
//   CTA 0 stores it back after its round-1 poll saw every segment's words (so every CTA had read
//   it) and its round-2 poll; the next launch reads it only after this grid completed (stream
//   order / the PDL wait).  Every launch rewrites every word it polls, so a stale word's tag is
//   the previous launch's.
// Forward progress: the tail CTAs wait for every CTA's words while holding their SMs, so the
//   other CTAs must find SMs beside them (with NT = G: all G co-resident): G <= 128 CTAs of 256
//   threads, ~20 KB of static shared memory (one per SM suffices; an H200 has 132).  A dependent grid under PDL launches only after every CTA of this one ran
//   launch_dependents (PDL_ENTRY: every CTA already resident); the kernels beside it on the
//   step's other graph branches do not wait on it, so they leave their SMs.  One slot buffer per
//   device: not for concurrent launches on two streams of one device.
// Covers D in {1024, 2048, 4096, 8192} (D % 1024 == 0, G | 128) and NT in {8, G} (8 <= NT <= G,
// NT | 128: ops.hc.pre_coop_ok); the host uses the ticket form elsewhere.  post_in / comb_in:
// pure inputs.  Arguments: hc_boundary_pre's, then n_tail and slots (int32 [COOP_SLOT_INT32],
// zero before the first launch) in place of ws / counter.  grid (n / 256), block 256, no dynamic
// shared memory.
namespace {
constexpr int BCO_MAX_CH = 1024;                          // own channels per tail CTA (D / NT)
constexpr int BCO_MAXV = 8;                               // polled values: rows 0..3, squares, <= 3 mixes rows
constexpr int BCO_R1_WORDS = MIX_MAX_SEG * 32 * 2;        // round 1: [nseg][32 slots][2 halves] u64
constexpr int BCO_R2_WORDS = 128 * 2;                     // round 2: [128 chains][2 halves] u64
constexpr int BCO_POLL = (BCO_MAXV * MIX_MAX_SEG * 2 + BND_THREADS - 1) / BND_THREADS;  // words per thread

DEV void st_relaxed_gpu_u64(u64* p, u64 v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DEV void st_relaxed_gpu_u32(u32* p, u32 v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DEV u32 ld_relaxed_gpu_u32(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// a double as two tagged words (low half first)
DEV void bco_publish(u64* w, double v, u32 tag) {
    const u64 b = (u64)__double_as_longlong(v), t = (u64)tag << 32;
    st_relaxed_gpu_u64(w, t | (b & 0xffffffffull));
    st_relaxed_gpu_u64(w + 1, t | (b >> 32));
}
// global chunk of tail CTA k's local chunk j (NT tail CTAs)
DEV int bco_chunk(int k, int j, int D, int NT) {
    const int P = 128 / NT, M = D >> 10;
    return k * P + j / M + 128 * (j % M);
}
// the row of polled value v of tail CTA k: rows 0..3, then 24 (the squares), then the mixes rows
// 4 + k + NT i
DEV int bco_row(int v, int k, int NT) { return v < HC ? v : v == HC ? BND_ROWS : HC + k + NT * (v - HC - 1); }
// the slot of row t (< 24), or of the squares (t == 24), in a segment's 32 (hc_boundary's layout)
DEV int bco_slot(int t) { return t < BND_ROWS ? 4 * (t / 3) + t % 3 : 3; }

struct BcoPre {
    BndFn fr;
    uint4 w;  // tail CTAs, threads < own chunks: the norm weight of own chunk threadIdx.x
};
// before the PDL wait: static weights only (fn rows, the norm weight)
DEV BcoPre bco_preload(const float* __restrict__ fn, const u16* __restrict__ norm_w, int D, int NT) {
    HC_STAMP(0, 0);
    BcoPre p;
    p.fr = bnd_fn_at(fn, D, blockIdx.x, threadIdx.x >> 5);
    p.w = make_uint4(0u, 0u, 0u, 0u);
    if ((int)blockIdx.x < NT && (int)threadIdx.x < D / (8 * NT))
        p.w = ldg16(norm_w + 8 * bco_chunk(blockIdx.x, threadIdx.x, D, NT));
    if (D < 0) __trap();  // ends the block: the wait stays below the loads (bnd_fn_preload's reason)
    return p;
}

DEV void bco_body(const BcoPre& pl, const u16* __restrict__ f, const u16* __restrict__ R,
                  const float* __restrict__ post_in, const float* __restrict__ comb_in, u16* out,
                  const float* __restrict__ scale, const float* __restrict__ base,
                  const u16* __restrict__ norm_w, float* mixes, float* pre_out, u16* x_out, u16* xn_out,
                  int D, float hc_eps, double norm_eps, int NT, int* slots_i32) {
    __shared__ __align__(16) u16 own_s[HC * BCO_MAX_CH];          // S of the own channels [4][D / NT]
    __shared__ __align__(16) u16 xo_s[BCO_MAX_CH];                // x of the own channels
    __shared__ __align__(16) u16 seg_s[MIX_SEG];                  // phase A's segment
    __shared__ __align__(16) u32 part32[BCO_MAXV][MIX_MAX_SEG][2];  // polled values [v][segment]
    __shared__ __align__(16) u32 ss32[128][2];                    // the 128 chains
    __shared__ float pre_s[HC];
    __shared__ double red[4];
    u64* r1 = reinterpret_cast<u64*>(slots_i32);
    u64* r2 = r1 + BCO_R1_WORDS;
    u32* epoch_p = reinterpret_cast<u32*>(r2 + BCO_R2_WORDS);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int k = blockIdx.x, n = HC * D, nseg = n / MIX_SEG;  // nseg == G
    const int own_ch = D / NT, own_chunks = own_ch >> 3;
    const u32 e = ld_relaxed_gpu_u32(epoch_p);
    const u32 tag = e + 1u == 0u ? 1u : e + 1u;
    HC_STAMP(0, 1);
    const double val = bnd_phase_a(pl.fr, f, R, post_in, comb_in, out, norm_w, D, seg_s);
    if (lane < 4) bco_publish(r1 + 2 * (k * 32 + 4 * wid + lane), val, tag);
    HC_STAMP(0, 2);
    if (k >= NT) return;
    // S of the own channels, in flight during the round-1 poll: (stream st, own chunk j) by thread
    // i = st * own_chunks + j (one per thread at 8 tail CTAs): bnd_post_chunk (bnd_post_elem's
    // bits, those its segment owner stored to out), or R's chunk without f.  Only the tagged words
    // cross CTAs: no fence.
    for (int i = threadIdx.x; i < HC * own_chunks; i += BND_THREADS) {
        const int st = i / own_chunks, j = i - st * own_chunks, c = bco_chunk(k, j, D, NT);
        *reinterpret_cast<uint4*>(own_s + st * own_ch + 8 * j) =
            f != nullptr ? bnd_post_chunk(f, R, post_in, comb_in, D, st, c) : ldg16(R + (i64)st * D + 8 * c);
    }
    // ---- round 1: values v < nvals over every segment; word w = (v, segment, half)
    const int nvals = HC + 1 + (k < BND_ROWS - HC ? (BND_ROWS - HC - 1 - k) / NT + 1 : 0);
    {
        const int nw = nvals * nseg * 2;
        u32 missing = 0;
#pragma unroll
        for (int i = 0; i < BCO_POLL; ++i)
            if (threadIdx.x + BND_THREADS * i < nw) missing |= 1u << i;
        while (missing) {
            u64 word[BCO_POLL];
#pragma unroll
            for (int i = 0; i < BCO_POLL; ++i) {  // every missing word's load in flight at once
                const int w = threadIdx.x + BND_THREADS * i, v = w / (2 * nseg), rem = w - v * 2 * nseg;
                word[i] = (missing >> i & 1u)
                              ? ld_relaxed_gpu(r1 + 2 * ((rem >> 1) * 32 + bco_slot(bco_row(v, k, NT))) + (rem & 1))
                              : 0ull;
            }
#pragma unroll
            for (int i = 0; i < BCO_POLL; ++i) {
                const int w = threadIdx.x + BND_THREADS * i, v = w / (2 * nseg), rem = w - v * 2 * nseg;
                if ((missing >> i & 1u) && (u32)(word[i] >> 32) == tag) {
                    part32[v][rem >> 1][rem & 1] = (u32)word[i];
                    missing &= ~(1u << i);
                }
            }
        }
    }
    __syncthreads();
    HC_STAMP(0, 3);
    if (wid == 0) {  // lane v < nvals: chain v in segment order (bnd_chain's sequence)
        double tot = 0.0;
        if (lane < nvals) {
            const double* pv = reinterpret_cast<const double*>(&part32[lane][0][0]);
            tot = pv[0];
            int s = 1;
            for (; s + 8 <= nseg; s += 8) {
                double v8[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) v8[j] = pv[s + j];
#pragma unroll
                for (int j = 0; j < 8; ++j) tot = __dadd_rn(tot, v8[j]);
            }
            for (; s < nseg; ++s) tot = __dadd_rn(tot, pv[s]);
        }
        const double tot_sq = __shfl_sync(0xffffffffu, tot, HC);
        const float m = bnd_mix(tot, tot_sq, n, norm_eps);
        if (lane < HC) {
            const float p = pre_value(m, scale[0], base[lane], hc_eps);
            pre_s[lane] = p;
            if (k == 0) {
                mixes[lane] = m;
                pre_out[lane] = p;
            }
        } else if (lane > HC && lane < nvals) {
            mixes[bco_row(lane, k, NT)] = m;
        }
    }
    __syncthreads();
    HC_STAMP(0, 4);
    // ---- x of the own channels: channel q by thread q mod 256 (bnd_x_chunk's expression)
    for (int q = threadIdx.x; q < own_ch; q += BND_THREADS) {
        double acc = 0.0;
#pragma unroll
        for (int i = 0; i < HC; ++i) {
            const double prod = __dmul_rn((double)pre_s[i], (double)bf16_to_f32(own_s[i * own_ch + q]));
            acc = i == 0 ? prod : __dadd_rn(acc, prod);
        }
        xo_s[q] = (u16)f64_to_bf16(acc);
    }
    __syncthreads();
    const int P = 128 / NT, M = D >> 10;
    if ((int)threadIdx.x < P) {  // thread u's chain over its chunks u M .. u M + M - 1 (global u + 128 m)
        double ss = 0.0;
        for (int m = 0; m < M; ++m)
            ss = bnd_ss_chunk(*reinterpret_cast<const uint4*>(xo_s + 8 * (threadIdx.x * M + m)), ss);
        bco_publish(r2 + 2 * (k * P + threadIdx.x), ss, tag);
    }
    if ((int)threadIdx.x < own_chunks)  // own_chunks = D / (8 NT) <= 128
        stg16(x_out + 8 * bco_chunk(k, threadIdx.x, D, NT), *reinterpret_cast<const uint4*>(xo_s + 8 * threadIdx.x));
    HC_STAMP(0, 5);
    // ---- round 2: thread i polls word i of the 256
    {
        u64 word;
        do {
            word = ld_relaxed_gpu(r2 + threadIdx.x);
        } while ((u32)(word >> 32) != tag);
        ss32[threadIdx.x >> 1][threadIdx.x & 1] = (u32)word;
    }
    __syncthreads();
    HC_STAMP(0, 6);
    if (wid < 4) {  // bnd_wsum_norm256's sum: warp_sum of each warp's 32 chains, then the 4 in order
        double ss = reinterpret_cast<const double*>(&ss32[0][0])[threadIdx.x];
        ss = warp_sum(ss);
        if (lane == 0) red[wid] = ss;
    }
    __syncthreads();
    if (k == 0 && threadIdx.x == 0) st_relaxed_gpu_u32(epoch_p, tag);  // every CTA has read the epoch
    if ((int)threadIdx.x < own_chunks) {
        const double r = bnd_norm_rsqrt(red, D, norm_eps);
        stg16(xn_out + 8 * bco_chunk(k, threadIdx.x, D, NT),
              bnd_xn_chunk(*reinterpret_cast<const uint4*>(xo_s + 8 * threadIdx.x), pl.w, r));
    }
    HC_STAMP(0, 7);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(BND_THREADS, 1)
hc_boundary_pre_coop(const u16* __restrict__ f, const u16* __restrict__ R, const float* __restrict__ post_in,
                     const float* __restrict__ comb_in, u16* out, const float* __restrict__ fn,
                     const float* __restrict__ scale, const float* __restrict__ base,
                     const u16* __restrict__ norm_w, float* mixes, float* pre_out, u16* x_out,
                     u16* xn_out, int D, float hc_eps, double norm_eps, int n_tail, int* slots) {
    PDL_ENTRY_PRELOAD(const BcoPre pl = bco_preload(fn, norm_w, D, n_tail));
    bco_body(pl, f, R, post_in, comb_in, out, scale, base, norm_w, mixes, pre_out, x_out, xn_out, D, hc_eps,
             norm_eps, n_tail, slots);
}
