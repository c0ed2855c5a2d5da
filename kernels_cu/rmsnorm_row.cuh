// rmsnorm_row: one row of rmsnorm_bf16_w{f32,bf16} (rmsnorm.cu) by a CTA of RMS_THREADS threads,
// y = bf16(w * (x * rsqrt(mean(x^2) + eps))) with rmsnorm.cu's header arithmetic (double sum of
// squares per thread in chunk order, block_sum's fixed tree, double scale and products rounded
// f64 -> bf16).  Shared by rmsnorm.cu and decode.cu's gemv_bf16_multi_*_qn (the decode q_norm in
// the multi GEMV's last CTA), so both produce the same bits by construction.
//   rms_preload (before the PDL wait): the thread's first weight chunk into registers.
//   CG = true: x read through L2 (ld.global.cg), for rows other CTAs of the same launch wrote
//   (the read-only path may not be used for memory written during the kernel).
// The caller's block must have exactly RMS_THREADS threads.
#pragma once

#include "common.cuh"

namespace memra {

constexpr int RMS_THREADS = 128;

template <bool CG>
DEV uint4 rms_ld_x(const u16* p) {
    return CG ? __ldcg(reinterpret_cast<const uint4*>(p)) : ldg16(p);
}

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

// store(c, o): where chunk c's 8 outputs go (rmsnorm_row: y + 8c in global memory; the decode
// gemv_bf16_pl_r*_qn: the CTA's shared x, and for CTA 0 also the normed row in global memory).
template <typename WT, bool CG = false, typename Store>
DEV void rmsnorm_row_to(const RmsFirst& first, const u16* x, const WT* __restrict__ w, int n,
                        double eps, Store&& store) {
    __shared__ double red[RMS_THREADS / 32];
    const int nc = n >> 3;
    double ss = 0.0;
    // the thread's first chunk stays in registers for the second pass (a row of <= 1024
    // elements, e.g. the decode q_norm, then reads x once: one dependent L2 round trip fewer,
    // which under PDL runs while the next GEMV's preloads fill the memory queues); chunks past
    // it are read again, as before.  Same values either way.
    uint4 x0 = make_uint4(0, 0, 0, 0);
    for (int c = threadIdx.x; c < nc; c += RMS_THREADS) {
        const uint4 raw = rms_ld_x<CG>(x + 8 * c);
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
        unpack8(c == (int)threadIdx.x ? x0 : rms_ld_x<CG>(x + 8 * c), f);
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
        store(c, o);
    }
}

template <typename WT, bool CG = false>
DEV void rmsnorm_row(const RmsFirst& first, const u16* x, const WT* __restrict__ w, u16* y,
                     int n, double eps) {
    rmsnorm_row_to<WT, CG>(first, x, w, n, eps, [&](int c, const uint4& o) { stg16(y + 8 * c, o); });
}


}  // namespace memra
