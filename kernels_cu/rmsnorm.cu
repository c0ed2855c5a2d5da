// RMSNorm family.
//
// rmsnorm_bf16_w{f32,bf16}: y = bf16(w * (x * rsqrt(mean(x^2) + eps))) per row (M:183-196),
//   twin oracle.ops.rmsnorm. One CTA of 128 threads per row; each thread owns the 8-element
//   chunks c = tid, tid+128, ... The sum of squares accumulates in double (x^2 is exact), per
//   thread in chunk order, then a fixed warp/block tree; the scale and product are double,
//   rounded f64 -> f32 -> bf16 like the twin's store(). Row results never depend on M.
//   The thread's first chunk of w is loaded before the PDL wait (rms_preload; static weights).
//   y may alias x (every thread reads its chunks before writing them).
// head_rms_bf16: the unweighted per-head q norm in bf16 tensor arithmetic (M:498), twin
//   NumericsPolicy.head_rms: sq = bf16(x*x); mean = bf16(f32(mean(sq))); var = bf16(mean + f32(eps));
//   r = bf16(f32(1/sqrt(var))); y = bf16(x * r). One warp per row (head); in place allowed.
//   Optionally fused with the q RoPE (M:499) on the normed values (double math as rope.cu).
//   The per-row body is head_rms.cuh's head_rms_warp_row, which attention.cu's sparse_attn_*_qn
//   kernels also run on their q rows (the device step's MEMRA_DSV4_DECODE_QNORM = attn).
#include "common.cuh"
#include "head_rms.cuh"

using namespace memra;

namespace {

constexpr int RMS_THREADS = 128;

template <typename WT>
DEV float load_w(const WT* w, int i);
template <>
DEV float load_w<float>(const float* w, int i) { return __ldg(w + i); }
template <>
DEV float load_w<u16>(const u16* w, int i) { return bf16_to_f32(__ldg(w + i)); }

// The thread's first chunk of the weight (chunk c = threadIdx.x), loaded BEFORE the PDL wait
// (PDL_ENTRY_PRELOAD: the norm weight is static, so the loads cannot observe the predecessor; a
// one-row norm after a GEMV then waits only for x, not x and then w).  bf16: one uint4; f32: two.
// ok = false (w not 16-byte aligned, or no chunk for this thread): the loop loads w as before.
struct RmsFirst {
    uint4 w[2];
    bool ok;
};

template <typename WT>
DEV RmsFirst rms_preload(const WT* __restrict__ w, int n) {
    RmsFirst f;
    f.w[0] = f.w[1] = make_uint4(0, 0, 0, 0);
    f.ok = (reinterpret_cast<unsigned long long>(w) & 15) == 0 && (int)threadIdx.x < (n >> 3);
    if (f.ok) {
        const uint4* p = reinterpret_cast<const uint4*>(w + 8 * threadIdx.x);
        f.w[0] = __ldg(p);
        if (sizeof(WT) == 4) f.w[1] = __ldg(p + 1);
    }
    if (n < 0) __trap();  // ends the basic block: ptxas cannot hoist the wait above the loads
    return f;
}

// the 8 weights of chunk c as f32: the preloaded registers for the thread's first chunk, else
// load_w (the same values either way: bf16 -> f32 is exact, f32 is f32)
template <typename WT>
DEV void chunk_w(const RmsFirst& f, const WT* __restrict__ w, int c, float (&wf)[8]) {
    if (f.ok && c == (int)threadIdx.x) {
        if (sizeof(WT) == 2) {
            unpack8(f.w[0], wf);
        } else {
            const u32 b[8] = {f.w[0].x, f.w[0].y, f.w[0].z, f.w[0].w, f.w[1].x, f.w[1].y, f.w[1].z, f.w[1].w};
#pragma unroll
            for (int i = 0; i < 8; ++i) wf[i] = __uint_as_float(b[i]);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) wf[i] = load_w<WT>(w, 8 * c + i);
}

template <typename WT>
DEV void rmsnorm_row(const RmsFirst& first, const u16* x, const WT* __restrict__ w, u16* y,
                     int n, double eps) {
    __shared__ double red[RMS_THREADS / 32];
    const int nc = n >> 3;
    double ss = 0.0;
    // the thread's first chunk stays in registers for the second pass (a row of <= 1024
    // elements, e.g. the decode q_norm, then reads x once: one dependent L2 round trip fewer,
    // which under PDL runs while the next GEMV's preloads fill the memory queues); chunks past
    // it are read again, as before.  Same values either way.
    uint4 x0 = make_uint4(0, 0, 0, 0);
    for (int c = threadIdx.x; c < nc; c += RMS_THREADS) {
        const uint4 raw = ldg16(x + 8 * c);
        if (c == (int)threadIdx.x) x0 = raw;
        float f[8];
        unpack8(raw, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            double d = (double)f[i];
            ss = __fma_rn(d, d, ss);  // d*d is exact in double: the fma rounds only the sum
        }
    }
    ss = block_sum<RMS_THREADS / 32>(ss, red);
    const double r = 1.0 / sqrt(ss / (double)n + eps);
    for (int c = threadIdx.x; c < nc; c += RMS_THREADS) {
        float f[8];
        unpack8(c == (int)threadIdx.x ? x0 : ldg16(x + 8 * c), f);
        float wf[8];
        chunk_w<WT>(first, w, c, wf);
        uint4 o;
        u32 h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            h[i] = f64_to_bf16(__dmul_rn((double)wf[i], __dmul_rn((double)f[i], r)));
        o.x = h[0] | (h[1] << 16);
        o.y = h[2] | (h[3] << 16);
        o.z = h[4] | (h[5] << 16);
        o.w = h[6] | (h[7] << 16);
        stg16(y + 8 * c, o);
    }
}

}  // namespace

// x, y: [M, n] bf16 (n % 8 == 0, rows 16-byte aligned); w: [n]. grid (M), block 128.
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_bf16_wf32(const u16* x, const float* __restrict__ w, u16* y,
                  int n, double eps) {
    PDL_ENTRY_PRELOAD(const RmsFirst first = rms_preload<float>(w, n));
    const i64 row = blockIdx.x;
    rmsnorm_row<float>(first, x + row * n, w, y + row * n, n, eps);
}

extern "C" __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm_bf16_wbf16(const u16* x, const u16* __restrict__ w, u16* y,
                   int n, double eps) {
    PDL_ENTRY_PRELOAD(const RmsFirst first = rms_preload<u16>(w, n));
    const i64 row = blockIdx.x;
    rmsnorm_row<u16>(first, x + row * n, w, y + row * n, n, eps);
}

// x, y: [rows, n] bf16, n % 8 == 0. One warp per row; block 128 (4 rows). grid ceil(rows/4).
// Optional fused RoPE (pos != null): rows are [T, H] heads; the last R dims of row (t, h) are then
// rotated at position pos[t] (cos/sin [n_pos, R/2] f32), = oracle.ops.apply_rope(head_rms(q)).
extern "C" __global__ void __launch_bounds__(128)
head_rms_bf16(const u16* x, u16* y, int rows, int n, float eps, int H, const int* __restrict__ pos,
              const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R) { PDL_ENTRY();
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= rows) return;
    u16* yr = y + row * n;
    head_rms_warp_row(x + row * n, n, eps, pos, [&] { return row / H; }, cos_t, sin_t, R,
                      [&](int c, const uint4& v) { stg16(yr + 8 * c, v); });
}
