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
#include "rmsnorm_row.cuh"

using namespace memra;


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
              const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R) {
    // the RoPE rows (static tables at the step's position) before the wait: head_rope_preload
    PDL_ENTRY_PRELOAD(const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
                      const HeadRope hr = head_rope_preload(n, pos, [&] { return row / H; }, cos_t, sin_t, R,
                                                            row < rows));
    if (row >= rows) return;
    u16* yr = y + row * n;
    head_rms_warp_row(x + row * n, n, eps, pos, [&] { return row / H; }, cos_t, sin_t, R,
                      [&](int c, const uint4& v) { stg16(yr + 8 * c, v); }, hr);
}
