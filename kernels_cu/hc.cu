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
// hc (the stream count) is 4 throughout (Flash, Pro and every preset); D % 8 == 0.
#include "common.cuh"

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
            int T, int n, int rows_total, double eps, double* __restrict__ ws, int* __restrict__ counters) {
    hc_mixes_body<6>(x, fn, mixes, T, n, rows_total, eps, ws, counters);
}
// hc_head: rows_total = 4.
extern "C" __global__ void __launch_bounds__(MIX_THREADS)
hc_mixes_r4(const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mixes,
            int T, int n, int rows_total, double eps, double* __restrict__ ws, int* __restrict__ counters) {
    hc_mixes_body<4>(x, fn, mixes, T, n, rows_total, eps, ws, counters);
}

// mixes [T, 24] f32; scale [3]; base [24]; X [T, 4, D] bf16 -> y [T, D] bf16, pre [T, 4],
// post [T, 4], comb [T, 4, 4] f32 (comb[i][j]: i = source stream). grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_pre_split_apply(const float* __restrict__ mixes, const float* __restrict__ scale,
                   const float* __restrict__ base, const u16* __restrict__ X, u16* __restrict__ y,
                   float* __restrict__ pre_out, float* __restrict__ post_out,
                   float* __restrict__ comb_out, int D, int iters, float hc_eps) {
    __shared__ float pre_s[HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const float* m = mixes + t * (2 + HC) * HC;
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
            if (blockIdx.y == 0) comb_out[t * HC * HC + lane] = L;
        }
        if (lane >= 16 && lane < 16 + HC) {
            const int i = lane - 16;
            const float p = __fadd_rn(sigmoid_f32(__fadd_rn(__fmul_rn(m[i], scale[0]), base[i])), hc_eps);
            pre_s[i] = p;
            if (blockIdx.y == 0) pre_out[t * HC + i] = p;
        } else if (lane >= 16 + HC && lane < 16 + 2 * HC) {
            const int i = lane - 16 - HC;
            const float s = sigmoid_f32(__fadd_rn(__fmul_rn(m[HC + i], scale[1]), base[HC + i]));
            if (blockIdx.y == 0) post_out[t * HC + i] = __fmul_rn(2.0f, s);
        }
    }
    __syncthreads();
    weighted_streams(X + t * HC * D, pre_s, y + t * D, D);
}

// pre [T, 4] f32 given; X [T, 4, D] -> y [T, D]. grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_weighted_sum(const float* __restrict__ pre, const u16* __restrict__ X, u16* __restrict__ y, int D) {
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
              int D, float hc_eps) {
    __shared__ float pre_s[HC];
    const i64 t = blockIdx.x;
    if (threadIdx.x < HC) {
        const int i = threadIdx.x;
        pre_s[i] = __fadd_rn(sigmoid_f32(__fadd_rn(__fmul_rn(mixes[t * HC + i], scale[0]), base[i])), hc_eps);
    }
    __syncthreads();
    weighted_streams(X + t * HC * D, pre_s, y + t * D, D);
}

// f [T, D] bf16; R [T, 4, D] bf16; post [T, 4]; comb [T, 4, 4] -> out [T, 4, D] bf16.
// out must not alias R. grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128)
hc_post(const u16* __restrict__ f, const u16* __restrict__ R, const float* __restrict__ post,
        const float* __restrict__ comb, u16* __restrict__ out, int D) {
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
