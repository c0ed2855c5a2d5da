"""Probe (GPU): how close to the copy bandwidth can a tensor-core MXFP4 GEMV at one token get?
The thirty-fourth session measured the decode step's CUDA-core FP4 expert GEMVs taking the same
time on an H100 and an H200 (gate/up 25.9 / 23.8 µs for 53.5 MB): bound by instruction issue at
~4 instructions per weight, they leave ~half the H200's bandwidth unused.  This probe times the
inner loop that counts ~2 per weight, before the production family (gate/up + SwiGLU, down +
combine, the seam, the legacy path) is built on it.  First run (thirty-sixth session, H100, report
in bench/results/2026-12-07-nvidia-h100-fa2e018-s36-*): every form checked, none faster than the
CUDA-core kernels (gate/up best 30.48 us against 26.36; deeper rings slower), so the production
form was not built; an H200 run is still to come.

    python tools/fp4_mma_probe.py                      # gate/up and down shapes, every variant
    python tools/fp4_mma_probe.py --shape gateup --kernels fp4mma_quad_d4 --ksplit 4 --ctas-per-sm 2
    python tools/fp4_mma_probe.py --from-log REPORT.txt OUT.json [OUT.png]   # a report as JSON / PNG

The kernel (SRC, one warp per task = a 16-row tile over K / --ksplit of K; a persistent grid):
* A = the weights as f16 words of e2m1 * 2^-14 (experts.cu FP4_PRMT's placement: 9 operations per
  8 weights), B = x as f16 (x * 2^c, c a power of two the host picks), mma.sync m16n8k16 with f32
  accumulation; D restarts at every 32-k block and is folded with the block's e8m0 scale
  (acc = fma(D, 2^(S-127+14-c), acc)), so the scale never enters the f16 operands.
* Every HMMA sums k slots of the four lanes of a quad, which must therefore share one scale block:
  lane t of quad g takes word t (8 nibbles) of the 16-byte block of rows g and g + 8.  Layout
  `quad`: the host transposes the 4-byte words inside every 64 bytes of a row (word t of blocks
  4j..4j+3 contiguous), so a lane's 16-byte load holds its word of four blocks (the bound of the
  design: one LDG.128 per row and step); `natural`: the stored layout, four LDG.32 per row and
  step (what the checkpoint bytes give without a relayout); `natsm`: the stored layout with one
  LDG.128 per row and step (lane t loads block t) and the quad's 4 x 4 word transpose through a
  per-warp shared-memory scratch (two STS.128 and eight conflict-free LDS.32 per step).  The lanes
  end with the same words in `natural` and `natsm` (emulate_tile(quad=False) is both).
* Layout `ring` (kernels _ring_r4 / _r8 / _r16, the thirty-fifth session): the stored bytes again,
  but streamed by cp.async into a per-warp shared-memory ring of RING steps (RING - 1 steps, 1 KB
  each, in flight per warp without holding registers: the deep weight ring the sixteenth session's
  latency-bound _mma kernels lacked); lanes get their words from two ldmatrix.x4 per step (rows
  80 B apart: conflict-free), the natural layout's words (ring_image / ring_words, CPU-tested).  Shared
  memory per CTA 2 K + 8 x RING x 1408 B: r16 fits one CTA per SM; configurations that do not fit
  an SM are skipped with a line saying so.
* x is staged once per CTA in shared memory in the order the B fragments take (within every 8
  elements: 0 4 1 5 2 6 3 7), one LDS.128 per block and lane.
* DEPTH steps (kernels _d2 / _d4 / _d8; a step is 4 blocks of both rows: 32 B of weights per
  lane, 1 KB per warp) are in flight per warp (a register ring), across task boundaries.
* Each task writes its rows' partial sums (KS partials per row, summed on the host): the probe
  times the GEMV, not a reduction.

Numerics (a different contract from the production kernels, reported, not hidden): products are
exact (e2m1 * 2^-14 times an f16 x), the tensor core's f32 accumulation order is its own, and x in
f16 is exact only for elements within the f16 range of x * 2^c (the host reports whether it was).
The check compares y with a float64 reference of the same dequantised weights and x (relative L2,
and the worst row); `emulate_tile` is the same lane / fragment mapping in NumPy (CPU-tested).

Timing: each launch as tools/bench_gemv.py times the decode kernels (profiling.launches.time_launches:
a graph of --reps copies with a 256 MB L2 flush between them, the flush's own graph subtracted,
the median of --iters replays), against the device-to-device copy bandwidth measured in the same
process (bench.harness.measure_copy_bandwidth), and beside the decode step's CUDA-core kernels at
the same shapes timed the same way in the same process (ops.experts gate/up and down + combine,
six of 256 stacked experts, and their opt-in impl="mma" forms; --no-production skips them).  Prints one line per kernel; exits
non-zero if a check fails.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

SRC = r'''
typedef unsigned int u32; typedef unsigned char u8; typedef unsigned short u16; typedef long long i64;
#define DEV __device__ __forceinline__

DEV void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// experts.cu FP4_PRMT: the f16 words of e2m1 * 2^-14 for element pairs (0,4) (1,5) (2,6) (3,7)
// of the 8 nibbles of w (element 2j = low nibble of byte j; a pair's first element in the low half)
DEV void fp4_words(u32 w, u32 (&h)[4]) {
    const u32 qo = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);
    const u32 qe = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
    h[0] = __byte_perm(qe, 0u, 0x2404u);
    h[1] = __byte_perm(qo, 0u, 0x2404u);
    h[2] = qe & 0xff00ff00u;
    h[3] = qo & 0xff00ff00u;
}
// the fold factor of block i of a row's scale word q: 2^(S - 127 + 14 - c) as f32 bits, i.e.
// (S + 14 - c) << 23 with eb23 = (14 - c) << 23: one PRMT (byte i to bits 0..7) and one LEA
DEV float fold_scale(u32 q, int i, u32 eb23) {
    return __uint_as_float((__byte_perm(q, 0u, 0x4440u + (u32)i) << 23) + eb23);
}
DEV uint4 ldg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
DEV u32 ldg4(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
DEV u32 word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// a warp's walk over its tasks (task w, w + nw, ...; each spt steps of 128 k) with the lane's
// pointers: its word of the step's 4 blocks of rows g and g + 8, and those rows' 4 scale bytes
// (the same u32 for the quad's four lanes).  The row arithmetic (one division by KS) once per
// task; a step only advances the pointers.
// LAYOUT: 0 quad (transposed words, one LDG.128 per row and step), 1 stored (four LDG.32),
// 2 stored with one LDG.128 per row and step (the lane's own block) and the quad's 4 x 4 word
// transpose through a per-warp shared-memory scratch
template <int LAYOUT>
struct Cursor {
    int task, s, row, kstep;
    const u8* wa;
    const u8* sa;
    DEV void set(int tk, const u8* W, const u8* S, int K, int KS, int spt, int g, int t) {
        task = tk;
        s = 0;
        row = (tk / KS) * 16 + g;
        kstep = (tk % KS) * spt;
        wa = W + (i64)row * (K / 2) + 64 * kstep + (LAYOUT == 1 ? 4 : 16) * t;
        sa = S + (i64)row * (K / 32) + 4 * kstep;
    }
    DEV void next(const u8* W, const u8* S, int K, int KS, int spt, int g, int t, int nw) {
        if (++s == spt) {
            set(task + nw, W, S, K, KS, spt, g, t);
        } else {
            ++kstep;
            wa += 64;
            sa += 4;
        }
    }
    // the step's loads: rows g and g + 8 are K/2 and K/32 bytes apart (8 rows)
    DEV void load(int K, uint4& a, uint4& b, u32& qa, u32& qb) const {
        const u8* wb = wa + (i64)4 * K;
        if (LAYOUT != 1) {
            a = ldg16(wa);
            b = ldg16(wb);
        } else {
            a = make_uint4(ldg4(wa), ldg4(wa + 16), ldg4(wa + 32), ldg4(wa + 48));
            b = make_uint4(ldg4(wb), ldg4(wb + 16), ldg4(wb + 32), ldg4(wb + 48));
        }
        qa = ldg4(sa);
        qb = ldg4(sa + K / 4);
    }
};

// What every probe kernel shares.  A warp's place in the persistent grid: lane (g, t), warp w of
// nw, spt steps of 128 k per task, and its `total` steps over tasks w, w + nw, ...; x staged in
// shared memory first (xs [K / 8] uint4, B-fragment order).
struct Walk {
    int lane, g, t, w, nw, spt, total;
};
DEV Walk stage_x_and_walk(uint4* xs, const u16* __restrict__ xh, int O, int K, int KS) {
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) xs[i] = reinterpret_cast<const uint4*>(xh)[i];
    __syncthreads();
    Walk v;
    v.lane = threadIdx.x & 31;
    v.g = v.lane >> 2;
    v.t = v.lane & 3;
    v.w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    v.nw = gridDim.x * (blockDim.x >> 5);
    v.spt = K / KS / 128;
    const int ntasks = (O / 16) * KS;
    v.total = v.w < ntasks ? ((ntasks - v.w + v.nw - 1) / v.nw) * v.spt : 0;
    return v;
}
// One step (4 blocks of 32 k) of the tile's rows g (wa, scale word qa) and g + 8 (wb, qb): lane
// (g, t) holds word t of each block; xk = xs + 16 kstep + t
DEV void mma_step(const uint4& wa, const uint4& wb, u32 qa, u32 qb, const uint4* xk, u32 eb23, float& acc0,
                  float& acc1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // block 4 kstep + i
        u32 ha[4], hb[4];
        fp4_words(word_of(wa, i), ha);
        fp4_words(word_of(wb, i), hb);
        const uint4 xv = xk[4 * i];   // x[128 kstep + 32 i + 8 t ..] in B order
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_f16(d, ha[0], hb[0], ha[1], hb[1], xv.x, xv.y);  // elements (0,4), (1,5)
        mma_f16(d, ha[2], hb[2], ha[3], hb[3], xv.z, xv.w);  // elements (2,6), (3,7)
        acc0 = __fmaf_rn(d[0], fold_scale(qa, i, eb23), acc0);  // D row g, column 2t (every column holds the dot)
        acc1 = __fmaf_rn(d[2], fold_scale(qb, i, eb23), acc1);  // row g + 8
    }
}
// after a task's last step: lane (g, 0) writes rows row_g and row_g + 8 of partial ks; the sums restart
DEV void end_task(float* __restrict__ part, int O, int ks, int row_g, int t, float& acc0, float& acc1) {
    if (t == 0) {
        part[(i64)ks * O + row_g] = acc0;
        part[(i64)ks * O + row_g + 8] = acc1;
    }
    acc0 = acc1 = 0.0f;
}

// W [O, K/2] e2m1 (layout 0: quad, else stored), S [O, K/32] e8m0, xh [K] f16 bits of x * 2^c in the
// B-fragment order (within every 8: 0 4 1 5 2 6 3 7), part [KS, O] f32.  O % 16 == 0,
// K % (128 KS) == 0, dynamic shared memory 2 K bytes (+ 10 KB for LAYOUT 2), block 256.
template <int DEPTH, int LAYOUT>
DEV void gemv(const u8* __restrict__ W, const u8* __restrict__ S, const u16* __restrict__ xh,
              float* __restrict__ part, int O, int K, int KS, int c) {
    extern __shared__ uint4 xs[];
    u8* scratch = reinterpret_cast<u8*>(xs + K / 8);   // LAYOUT 2: 8 warps x 16 rows x 80 B
    const Walk v = stage_x_and_walk(xs, xh, O, K, KS);
    const int g = v.g, t = v.t, w = v.w, nw = v.nw, spt = v.spt, total = v.total;
    uint4 ra[DEPTH], rb[DEPTH];
    u32 sa[DEPTH], sb[DEPTH];
    Cursor<LAYOUT> ld, cm;   // the loads run DEPTH steps ahead of the compute
    ld.set(w, W, S, K, KS, spt, g, t);
    cm = ld;
#pragma unroll
    for (int r = 0; r < DEPTH; ++r)
        if (r < total) {
            ld.load(K, ra[r], rb[r], sa[r], sb[r]);
            ld.next(W, S, K, KS, spt, g, t, nw);
        }
    float acc0 = 0.0f, acc1 = 0.0f;
    const u32 eb23 = (u32)(14 - c) << 23;
    for (int n0 = 0; n0 < total; n0 += DEPTH) {
#pragma unroll
        for (int r = 0; r < DEPTH; ++r) {
            if (n0 + r >= total) break;  // warp-uniform
            uint4 wa = ra[r], wb = rb[r];
            const u32 qa = sa[r], qb = sb[r];
            if (n0 + r + DEPTH < total) {
                ld.load(K, ra[r], rb[r], sa[r], sb[r]);
                ld.next(W, S, K, KS, spt, g, t, nw);
            }
            if (LAYOUT == 2) {  // wa / wb: block t of rows g / g + 8 -> word t of blocks 0..3
                u8* sc = scratch + (threadIdx.x >> 5) * 1280 + g * 80;   // 80 B per row: no bank conflicts below
                *reinterpret_cast<uint4*>(sc + 16 * t) = wa;
                *reinterpret_cast<uint4*>(sc + 640 + 16 * t) = wb;
                __syncwarp();
                const u32* s32 = reinterpret_cast<const u32*>(sc) + t;
                wa = make_uint4(s32[0], s32[4], s32[8], s32[12]);
                wb = make_uint4(s32[160], s32[164], s32[168], s32[172]);
                __syncwarp();   // every lane has read before the next step's stores
            }
            mma_step(wa, wb, qa, qb, xs + 16 * cm.kstep + t, eb23, acc0, acc1);
            if (cm.s == spt - 1) end_task(part, O, cm.task % KS, cm.row, t, acc0, acc1);
            cm.next(W, S, K, KS, spt, g, t, nw);
        }
    }
}

// Layout `ring`: the stored bytes streamed by cp.async into a per-warp shared-memory ring of RING
// steps (RING - 1 in flight: 1 KB of weights per step and warp, no registers held for them).  A
// step's image (RING_STEP bytes): the task tile's 16 rows x 64 B at rows 80 B apart (1280 B), then
// the 16 rows' 4 scale bytes (64 B), then a 64 B sink.  Lane L copies granules L and L + 32 of the
// 64 (16 B part L % 4 of rows L / 4 and L / 4 + 8) and row L % 16's scale word (lanes 16..31 into
// the sink: no branch).  Lane (g, t) then gets word t of blocks 0..3 of rows g and g + 8 from two
// ldmatrix.x4 (matrix j = block j of 8 rows; rows 80 B apart: conflict-free), i.e. the natural
// layout's words (emulate_tile(quad=False); ring_image / ring_words in NumPy).
#define RING_ROW 80
#define RING_STEP (16 * RING_ROW + 128)   // + 64 B of scale words + the 64 B sink
DEV u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
DEV void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
DEV void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
DEV void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEV void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// four 8 x 8 b16 matrices (lanes 8 j .. 8 j + 7 give the row addresses of matrix j); lane l gets
// word l % 4 of row l / 4 of matrix j in r[j]
DEV uint4 ldsm_x4(u32 addr) {
    uint4 r;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
    return r;
}

// a warp's walk over its tasks, as Cursor; `src` / `ssrc`: this lane's copy sources of the step
// (weights of row crow at byte cpart of the step; the scale word of row crow2), advanced by 64 / 4
// bytes a step, recomputed (one division) once per task
struct RingCursor {
    int task, s, row0, kstep;
    const u8* src;
    const u8* ssrc;
    DEV void set(int tk, const u8* W, const u8* S, int K, int KS, int spt, int crow, int cpart, int crow2) {
        task = tk;
        s = 0;
        row0 = (tk / KS) * 16;
        kstep = (tk % KS) * spt;
        src = W + (i64)(row0 + crow) * (K / 2) + 64 * kstep + cpart;
        ssrc = S + (i64)(row0 + crow2) * (K / 32) + 4 * kstep;
    }
    DEV void next(const u8* W, const u8* S, int K, int KS, int spt, int nw, int crow, int cpart, int crow2) {
        if (++s == spt) {
            set(task + nw, W, S, K, KS, spt, crow, cpart, crow2);
        } else {
            ++kstep;
            src += 64;
            ssrc += 4;
        }
    }
};

// dynamic shared memory 2 K + 8 warps x RING x RING_STEP bytes, block 256; otherwise as gemv
template <int RING>
DEV void gemv_ring(const u8* __restrict__ W, const u8* __restrict__ S, const u16* __restrict__ xh,
                   float* __restrict__ part, int O, int K, int KS, int c) {
    static_assert(RING >= 2 && (RING & (RING - 1)) == 0, "RING: a power of two >= 2");
    extern __shared__ uint4 xs[];
    u8* ring = reinterpret_cast<u8*>(xs + K / 8) + (threadIdx.x >> 5) * RING * RING_STEP;
    const Walk v = stage_x_and_walk(xs, xh, O, K, KS);
    const int lane = v.lane, g = v.g, t = v.t, nw = v.nw, spt = v.spt, total = v.total;
    const i64 hk8 = (i64)4 * K;                   // 8 rows of W
    // this lane's copies: weight rows crow and crow + 8 at byte cpart; the scale word of row
    // crow2, to the image (lanes 0..15) or to the step's 64 B sink (lanes 16..31: branch-free)
    const int crow = lane >> 2, cpart = 16 * (lane & 3), crow2 = lane & 15;
    const u32 ring_s = smem_addr(ring);
    const u32 wdst = ring_s + crow * RING_ROW + cpart, sdst = ring_s + 16 * RING_ROW + 4 * lane;
    RingCursor ld, cm;
    ld.set(v.w, W, S, K, KS, spt, crow, cpart, crow2);
    cm = ld;
    u32 o = 0;   // the image offset of the next slot to fill (slots in order, wrapping)
    auto issue = [&]() {   // step ld into slot o; then ld and o advance
        cp_async16(wdst + o, ld.src);
        cp_async16(wdst + o + 8 * RING_ROW, ld.src + hk8);
        cp_async4(sdst + o, ld.ssrc);
        ld.next(W, S, K, KS, spt, nw, crow, cpart, crow2);
        o = o == (RING - 1) * RING_STEP ? 0u : o + RING_STEP;
    };
#pragma unroll
    for (int r = 0; r < RING - 1; ++r) {
        if (r < total) issue();
        cp_commit();   // one group per step, empty past the end: the wait count below stays uniform
    }
    float acc0 = 0.0f, acc1 = 0.0f;
    const u32 eb23 = (u32)(14 - c) << 23;
    for (int n = 0; n < total; ++n) {
        cp_wait<RING - 2>();   // this lane's copies of step n (group n) have landed
        __syncwarp();          // ... and every lane's; every lane has also finished reading step n - 1
        if (n + RING - 1 < total) issue();   // slot (n + RING - 1) % RING: the one step n - 1 used
        cp_commit();
        const u8* img = ring + (n & (RING - 1)) * RING_STEP;
        // ldmatrix: matrix j = block j of 8 rows, so lane (g, t) gets word t of blocks 0..3 of row g
        // (rows 8..15 in the second); the 8 rows' 16 B are 80 B apart: conflict-free
        const u32 lsm = smem_addr(img) + (lane & 7) * RING_ROW + 16 * (lane >> 3);
        const uint4 wa = ldsm_x4(lsm), wb = ldsm_x4(lsm + 8 * RING_ROW);
        const u32 qa = reinterpret_cast<const u32*>(img + 16 * RING_ROW)[g];
        const u32 qb = reinterpret_cast<const u32*>(img + 16 * RING_ROW)[g + 8];
        mma_step(wa, wb, qa, qb, xs + 16 * cm.kstep + t, eb23, acc0, acc1);
        if (cm.s == spt - 1) end_task(part, O, cm.task % KS, cm.row0 + g, t, acc0, acc1);
        cm.next(W, S, K, KS, spt, nw, crow, cpart, crow2);
    }
    cp_wait<0>();   // no copy outstanding at exit (the empty tail groups)
}

#define PROBE_RING(NAME, RING)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                 \
    NAME(const u8* W, const u8* S, const u16* xh, float* part, int O, int K, int KS, int c) {         \
        gemv_ring<RING>(W, S, xh, part, O, K, KS, c);                                                   \
    }
PROBE_RING(fp4mma_ring_r4, 4)
PROBE_RING(fp4mma_ring_r8, 8)
PROBE_RING(fp4mma_ring_r16, 16)

#define PROBE(NAME, DEPTH, LAYOUT)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                \
    NAME(const u8* W, const u8* S, const u16* xh, float* part, int O, int K, int KS, int c) {        \
        gemv<DEPTH, LAYOUT>(W, S, xh, part, O, K, KS, c);                                              \
    }
PROBE(fp4mma_quad_d2, 2, 0)
PROBE(fp4mma_quad_d4, 4, 0)
PROBE(fp4mma_quad_d8, 8, 0)
PROBE(fp4mma_natural_d4, 4, 1)
PROBE(fp4mma_natsm_d4, 4, 2)
PROBE(fp4mma_natsm_d8, 8, 2)
'''

KERNELS = ("fp4mma_quad_d2", "fp4mma_quad_d4", "fp4mma_quad_d8", "fp4mma_natural_d4", "fp4mma_natsm_d4",
           "fp4mma_natsm_d8", "fp4mma_ring_r4", "fp4mma_ring_r8", "fp4mma_ring_r16")
RING_ROW, RING_STEP = 80, 16 * 80 + 128   # SRC's ring image: 16 rows 80 B apart, 16 scale words, a 64 B sink
# the decode step's expert GEMV shapes at one token: six routed experts stacked
SHAPES = {"gateup": (6 * 2 * 2048, 4096), "down": (6 * 4096, 2048)}
X_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])   # B-fragment order within every 8 elements of x
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# ------------------------------------------------------------------------------------ host model
def quad_layout(packed: np.ndarray) -> np.ndarray:
    """[O, K/2] stored bytes -> the `quad` layout: inside every 64 bytes of a row, 4-byte word t of
    block i moves to position 4 t + i (a 4 x 4 word transpose), so lane t's 16 bytes are its word
    of four consecutive blocks."""
    O, H = packed.shape
    assert H % 64 == 0, f"row of {H} bytes: not a multiple of 64"
    return packed.reshape(O, H // 64, 4, 4, 4).transpose(0, 1, 3, 2, 4).reshape(O, H)


def smem_bytes(name: str, K: int) -> int:
    """Dynamic shared memory of kernel `name` at K: x in f16 (2 K), plus the natsm transpose scratch
    (8 warps x 1280 B) or the ring (8 warps x RING steps x RING_STEP)."""
    assert name in KERNELS, name
    if "_natsm_" in name:
        return 2 * K + 8 * 1280
    if "_ring_r" in name:
        return 2 * K + 8 * int(name.rsplit("_r", 1)[1]) * RING_STEP
    return 2 * K


def ring_copies() -> list[tuple[int, int, int]]:
    """SRC gemv_ring's copies of one step, per lane: (lane, row of the tile, byte offset in the row,
    image offset) for the two 16-byte weight granules, and the scale word as (lane, row, -1, image
    offset): row lane % 16, lanes 16..31 into the sink after the 16 scale words."""
    out = []
    for lane in range(32):
        crow, cpart = lane >> 2, 16 * (lane & 3)
        out.append((lane, crow, cpart, crow * RING_ROW + cpart))
        out.append((lane, crow + 8, cpart, (crow + 8) * RING_ROW + cpart))
        out.append((lane, lane & 15, -1, 16 * RING_ROW + 4 * lane))
    return out


def ring_image(stored: np.ndarray, scale: np.ndarray, row0: int, kstep: int) -> np.ndarray:
    """The bytes of one ring step as ring_copies() builds it from the stored layout ([RING_STEP];
    the padding between rows stays 0xEE; the sink holds scale words again)."""
    img = np.full(RING_STEP, 0xEE, dtype=np.uint8)
    for _, row, off, dst in ring_copies():
        if off < 0:
            img[dst:dst + 4] = scale[row0 + row, 4 * kstep:4 * kstep + 4]
        else:
            img[dst:dst + 16] = stored[row0 + row, 64 * kstep + off:64 * kstep + off + 16]
    return img


def ldsm_row_addresses(half: int) -> list[int]:
    """The image offsets the 32 lanes give gemv_ring's ldmatrix.x4 for rows 8 half .. 8 half + 7:
    lane l -> row l % 8 of matrix l / 8 (= block l / 8)."""
    return [(8 * half + (lane & 7)) * RING_ROW + 16 * (lane >> 3) for lane in range(32)]


def ring_words(img: np.ndarray, g: int, t: int) -> tuple[list[int], list[int], int, int]:
    """Lane (g, t)'s reads of a ring image as gemv_ring does them: register j of each ldmatrix.x4
    (PTX: lane l receives word l % 4 of row l / 4 of matrix j, whose rows start at the addresses
    lanes 8 j .. 8 j + 7 gave) for rows g and g + 8, and the two rows' scale words."""
    lane = 4 * g + t
    w32 = img.view(np.uint32)

    def ldsm(half):
        addrs = ldsm_row_addresses(half)
        return [int(w32[addrs[8 * j + lane // 4] // 4 + lane % 4]) for j in range(4)]
    return ldsm(0), ldsm(1), int(w32[(16 * RING_ROW) // 4 + g]), int(w32[(16 * RING_ROW) // 4 + g + 8])


def dequant(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[O, K/2] stored e2m1 bytes and [O, K/32] e8m0 -> [O, K] float64 (the checkpoint's values)."""
    lo, hi = packed & 15, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    s = np.exp2(scale.astype(np.float64) - 127.0)
    return E2M1[codes] * np.repeat(s, 32, axis=1)


def x_half(x: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """x (float32 values of bf16) -> (f16 bits of x * 2^c in X_ORDER, c, exact): c puts the largest
    |x| just below 2^15."""
    m = float(np.max(np.abs(x))) if x.size else 0.0
    c = 14 - int(np.ceil(np.log2(m))) if m > 0 else 0
    xs = (x.astype(np.float64) * 2.0 ** c).astype(np.float16)
    exact = bool(np.array_equal(xs.astype(np.float64) * 2.0 ** -c, x.astype(np.float64)))
    perm = xs.reshape(-1, 8)[:, X_ORDER].reshape(-1)
    return perm.view(np.uint16), c, exact


def fp4_words(w: int) -> list[int]:
    """fp4_words of SRC on one u32 (the f16 pairs (0,4) (1,5) (2,6) (3,7))."""
    m = 0xFFFFFFFF
    qo = ((w >> 3) & 0x0E0E0E0E) | (w & 0x80808080)
    qe = (((w << 1) & m) & 0x0E0E0E0E) | (((w << 4) & m) & 0x80808080)

    def perm2404(q):  # __byte_perm(q, 0, 0x2404): bytes (0, q.b0, 0, q.b2)
        return ((q & 0xFF) << 8) | (((q >> 16) & 0xFF) << 24)
    return [perm2404(qe), perm2404(qo), qe & 0xFF00FF00, qo & 0xFF00FF00]


def _f16x2(v: int) -> tuple[float, float]:
    a = np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)
    return float(a[0]), float(a[1])


def emulate_tile(stored: np.ndarray, scale: np.ndarray, xh: np.ndarray, c: int, row0: int,
                 kstep0: int, ksteps: int, quad: bool) -> np.ndarray:
    """The kernel's lane / fragment mapping for one 16-row tile over ksteps steps from kstep0, in
    NumPy (float64, so the mapping, not the rounding): every lane's words and x fragments as the
    kernel loads them (from the `quad` layout when quad, else the stored one), each HMMA as
    m16n8k16's fragment layout defines it, the folds.  Returns the 16 rows' sums [16]."""
    W = quad_layout(stored) if quad else stored
    acc = np.zeros(16)
    for kstep in range(kstep0, kstep0 + ksteps):
        for i in range(4):
            A = [np.zeros((16, 16)) for _ in range(2)]
            B = [np.zeros((16, 8)) for _ in range(2)]
            scl = np.zeros(16)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                words = []
                for r in (row0 + g, row0 + g + 8):
                    base = 64 * kstep
                    off = base + 16 * t + 4 * i if quad else base + 16 * i + 4 * t
                    words.append(fp4_words(int.from_bytes(W[r, off:off + 4].tobytes(), "little")))
                    scl[r - row0] = 2.0 ** (int(scale[r, 4 * kstep + i]) - 127 + 14 - c)
                xv = xh[kstep * 128 + 32 * i + 8 * t: kstep * 128 + 32 * i + 8 * t + 8]
                xf = xv.view(np.float16).astype(np.float64)
                for h in range(2):   # HMMA h: a0 a2 = row g words 2h, 2h+1; a1 a3 = row g+8's
                    a0, a2 = _f16x2(words[0][2 * h]), _f16x2(words[0][2 * h + 1])
                    a1, a3 = _f16x2(words[1][2 * h]), _f16x2(words[1][2 * h + 1])
                    A[h][g, 2 * t:2 * t + 2] = a0
                    A[h][g + 8, 2 * t:2 * t + 2] = a1
                    A[h][g, 2 * t + 8:2 * t + 10] = a2
                    A[h][g + 8, 2 * t + 8:2 * t + 10] = a3
                    B[h][2 * t:2 * t + 2, g] = xf[4 * h:4 * h + 2]          # b0
                    B[h][2 * t + 8:2 * t + 10, g] = xf[4 * h + 2:4 * h + 4]  # b1
            D = A[0] @ B[0] + A[1] @ B[1]
            assert np.all(D == D[:, :1]), "B's columns differ: a lane's x fragment depends on its quad"
            acc += D[:, 0] * scl
    return acc


# -------------------------------------------------------------------------------------- the probe
def format_row(label: str, nbytes: int, us: float, bw: float, base: float | None = None) -> str:
    """One timing line of the report (parse_report reads it back)."""
    rel = f"  x{us / base:5.2f} the CUDA-core kernel's time" if base else ""
    return (f"  {label:42s} {us:8.2f} us {nbytes / us / 1e3:7.1f} GB/s "
            f"{nbytes / us * 1e6 / bw * 100:5.1f} % of copy bw{rel}")


def config_label(name: str, ksplit: int, per_sm: int) -> str:
    """A probe configuration as the report names it (rows, skips and best lines; _CONFIG reads it)."""
    return f"{name} ksplit {ksplit}, {per_sm}/SM"


_CONFIG = r"(fp4mma_\w+) ksplit (\d+), (\d+)/SM"
_HEAD = re.compile(r"^device (\d+): (.+?), (\d+) SMs; copy bandwidth ([\d.]+) TB/s")
_SHAPE = re.compile(r"^(\w+): O (\d+), K (\d+), ([\d.]+) MB per launch; x in f16 exact: (True|False)$")
_ROW = re.compile(r"^  (.+?)\s+([\d.]+) us\s+([\d.]+) GB/s\s+([\d.]+) % of copy bw"
                  r"(?:  x\s*([\d.]+) the CUDA-core kernel's time)?"
                  r"(?:; relL2 ([\d.e+-]+), worst row ([\d.e+-]+))?(  CHECK FAILED)?$")
_SKIP = re.compile(rf"^  {_CONFIG}: skipped")


def parse_report(text: str) -> dict:
    """The probe's printed report as data: {"device", "sms", "copy_bw_TBps", "shapes": {shape:
    {"O", "K", "MB", "x_f16_exact", "rows": [...], "skipped": [...], "best": row}}}.  A row:
    label, us, GBps, pct_copy_bw, and where printed ratio (to the CUDA-core kernel), rel_l2,
    worst_row, check_ok, and for the probe's kernels kernel / ksplit / ctas_per_sm.  Refuses a
    line it does not recognise, naming it (a report cut short still parses up to its last line)."""
    out: dict = {"shapes": {}}
    cur = shape = None
    for n, ln in enumerate(text.splitlines(), 1):
        if not ln.strip() or ln.startswith("production kernels not timed"):
            continue
        if m := _HEAD.match(ln):
            out.update(device=m[2], sms=int(m[3]), copy_bw_TBps=float(m[4]))
        elif m := _SHAPE.match(ln):
            shape = m[1]
            cur = out["shapes"][shape] = dict(O=int(m[2]), K=int(m[3]), MB=float(m[4]),
                                             x_f16_exact=m[5] == "True", rows=[], skipped=[], best=None)
        elif cur is not None and (m := _SKIP.match(ln)):
            cur["skipped"].append(dict(kernel=m[1], ksplit=int(m[2]), ctas_per_sm=int(m[3])))
        elif cur is not None and (m := _ROW.match(ln)):
            row = dict(label=m[1].strip(), us=float(m[2]), GBps=float(m[3]), pct_copy_bw=float(m[4]))
            if m[5]:
                row["ratio"] = float(m[5])
            if m[6]:
                row.update(rel_l2=float(m[6]), worst_row=float(m[7]), check_ok=m[8] is None)
            label = row["label"]
            best = label.startswith(f"{shape} best: ")
            if best:
                label = label[len(f"{shape} best: "):]
            if k := re.fullmatch(_CONFIG, label):
                row.update(kernel=k[1], ksplit=int(k[2]), ctas_per_sm=int(k[3]))
            if best:
                cur["best"] = row
            else:
                cur["rows"].append(row)
        else:
            raise ValueError(f"line {n} is not a line of the probe's report: {ln!r}")
    if "device" not in out:
        raise ValueError("no 'device N: ...' header line: not the probe's report")
    return out


def write_report(text: str, json_path: str, png_path: str | None, source: str = "") -> dict:
    """parse_report's data as JSON, and a bar chart of % of copy bandwidth per configuration and
    shape (the CUDA-core kernels first, in their own colour) as PNG, titled with `source` (the
    report's file name, which carries the date, the GPU and the commit)."""
    import json
    data = parse_report(text)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    if png_path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        shapes = list(data["shapes"].items())
        tall = max(len(d["rows"]) for _, d in shapes)
        fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 1.5 + 0.25 * tall), squeeze=False)
        for ax, (shape, d) in zip(axes[0], shapes):
            rows = d["rows"][::-1]
            ax.barh(range(len(rows)), [r["pct_copy_bw"] for r in rows],
                    color=["tab:gray" if "kernel" not in r else "tab:blue" for r in rows])
            ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
            ax.set_xlabel("% of copy bandwidth")
            ax.set_title(f"{shape}: O {d['O']}, K {d['K']}, {d['MB']} MB", fontsize=9)
            ax.set_xlim(0, 100)
        fig.suptitle(f"{source or 'fp4_mma_probe'}: {data['device']} (copy bw {data['copy_bw_TBps']} "
                     "TB/s); grey: the decode step's kernels", fontsize=9)
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
    return data


def _int(flag: str, text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected an integer") from None
    if v < lo:
        raise SystemExit(f"{flag} {v}: expected >= {lo}")
    return v


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gateup,down", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list of " + ", ".join(KERNELS))
    ap.add_argument("--ksplit", default="2,4", help="comma list: tasks per 16-row tile (K / ksplit per task)")
    ap.add_argument("--ctas-per-sm", default="1,2", help="comma list: the persistent grid's CTAs per SM")
    ap.add_argument("--reps", default="20", help="launches per timed graph (profiling.launches.time_launches)")
    ap.add_argument("--iters", default="5", help="timed replays per graph (the median)")
    ap.add_argument("--no-production", action="store_true",
                    help="skip the decode step's CUDA-core kernels (ops.experts) in the same process")
    ap.add_argument("--device", default="0")
    a = ap.parse_args(argv)
    shapes = [s.strip() for s in a.shape.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shape {s!r}: not one of {', '.join(SHAPES)}")
    kernels = [k.strip() for k in a.kernels.split(",") if k.strip()]
    for k in kernels:
        if k not in KERNELS:
            raise SystemExit(f"--kernels {k!r}: not one of {', '.join(KERNELS)}")
    ksplits = [_int("--ksplit", v, 1) for v in a.ksplit.split(",")]
    for ks in ksplits:
        for s in shapes:
            O, K = SHAPES[s]
            if K % (128 * ks):
                raise SystemExit(f"--ksplit {ks}: K = {K} of --shape {s} is not a multiple of 128 x {ks}")
    per_sm = [_int("--ctas-per-sm", v, 1) for v in a.ctas_per_sm.split(",")]
    return dict(shapes=shapes, kernels=kernels, ksplit=ksplits, per_sm=per_sm,
                reps=_int("--reps", a.reps, 1), iters=_int("--iters", a.iters, 3),
                production=not a.no_production, device=_int("--device", a.device, 0))


def production_launches() -> dict:
    """The decode step's CUDA-core kernels at the probe's shapes, set up and timed as
    tools/bench_gemv.py does (its fp4_experts: six of 256 stacked MXFP4 experts; down with the
    shared expert's output added), and the fifteenth session's opt-in tensor-core forms
    (impl="mma"): shape -> [(label, recorded launches)], the default kernel first; "keep": the
    namespace whose arrays the launches read."""
    import cupy as cp
    from bench_gemv import fp4_experts   # tools/ is this script's directory
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.profiling.launches import record_launches

    fx = fp4_experts(cp.random.default_rng(1), EX)
    rec = lambda fn: record_launches(fn, ("fp4_mma_probe.py",))
    return {"gateup": [("ops.experts gate/up (CUDA cores)", rec(fx.gateup)),
                       ("ops.experts gate/up impl=mma", rec(lambda: fx.gateup(impl="mma")))],
            "down": [("ops.experts down + combine (CUDA cores)", rec(fx.down)),
                     ("ops.experts down + combine impl=mma", rec(lambda: fx.down(impl="mma")))],
            "keep": fx}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--from-log"]:   # the report of an earlier run as JSON (+ PNG): no GPU needed
        if len(argv) not in (3, 4):
            raise SystemExit("usage: fp4_mma_probe.py --from-log REPORT.txt OUT.json [OUT.png]")
        with open(argv[1], encoding="utf-8") as f:
            text = f.read()
        try:
            write_report(text, argv[2], argv[3] if len(argv) == 4 else None, os.path.basename(argv[1]))
        except ValueError as e:
            raise SystemExit(f"--from-log {argv[1]}: {e}") from None
        return 0
    o = parse(argv)
    import cupy as cp
    from bench.harness import measure_copy_bandwidth
    from memra_dsv4.profiling.launches import Launch, time_launches

    dev = cp.cuda.Device(o["device"])
    dev.use()
    sms = dev.attributes["MultiProcessorCount"]
    sm_smem = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    bw = measure_copy_bandwidth(o["device"])["copy_bw_Bps"]
    print(f"device {o['device']}: {cp.cuda.runtime.getDeviceProperties(o['device'])['name'].decode()}, "
          f"{sms} SMs; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"each launch timed as bench_gemv.py does (graphs of {o['reps']} with a 256 MB L2 flush between, "
          f"the flush subtracted)", flush=True)
    flush = 256 << 20

    def line(label, nbytes, us, base=None):
        return format_row(label, nbytes, us, bw, base)

    prod = {}
    if o["production"]:
        try:   # the probe's own kernels are the point: a failure here is reported, not fatal
            prod = production_launches()
        except Exception as e:  # noqa: BLE001
            print(f"production kernels not timed: {type(e).__name__}: {e}", flush=True)
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17"))
    rng = np.random.default_rng(0)
    ok = True
    for shape in o["shapes"]:
        O, K = SHAPES[shape]
        nbytes = O * K // 2 + O * K // 32
        x = rng.standard_normal(K).astype(np.float32)
        x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)          # bf16 values
        xh, c, exact = x_half(x)
        stored = rng.integers(0, 256, size=(O, K // 2), dtype=np.uint8)
        scale = rng.integers(116, 124, size=(O, K // 32), dtype=np.uint8)
        ref = np.concatenate([dequant(stored[r:r + 2048], scale[r:r + 2048]) @ x.astype(np.float64)
                              for r in range(0, O, 2048)])   # float64, 2048 rows at a time
        S_d, xh_d = cp.asarray(scale), cp.asarray(xh)
        part = cp.zeros((max(o["ksplit"]), O), dtype=cp.float32)
        print(f"{shape}: O {O}, K {K}, {nbytes / 1e6:.1f} MB per launch; x in f16 exact: {exact}", flush=True)
        base = None
        for j, (label, recs) in enumerate(prod.get(shape, [])):   # the first: the default kernel, the base
            us = sum(time_launches(recs, reps=o["reps"], iters=o["iters"], flush_bytes=flush))
            print(line(label, nbytes, us, base), flush=True)
            base = us if j == 0 else base
        best = None   # (us, label) of the fastest configuration that passed its check
        for name in o["kernels"]:
            W_d = cp.asarray(quad_layout(stored) if "_quad_" in name else stored)
            f = mod.get_function(name)
            for ks in o["ksplit"]:
                for per_sm in o["per_sm"]:
                    grid, block, smem = (sms * per_sm,), (256,), smem_bytes(name, K)
                    if per_sm * (smem + 1024) > sm_smem:   # 1 KB per CTA the driver reserves
                        print(f"  {config_label(name, ks, per_sm)}: skipped, {per_sm} x {smem} B of shared "
                              f"memory do not fit one SM's {sm_smem} B", flush=True)
                        continue
                    if smem > 48 * 1024:
                        f.max_dynamic_shared_size_bytes = smem
                    args = (W_d, S_d, xh_d, part, np.int32(O), np.int32(K), np.int32(ks), np.int32(c))
                    part.fill(np.nan)
                    f(grid, block, args, shared_mem=smem)
                    y = cp.asnumpy(part[:ks]).astype(np.float64).sum(axis=0)
                    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    worst = float(np.max(np.abs(y - ref) / np.maximum(np.abs(ref), 1e-30)))
                    good = bool(np.isfinite(y).all()) and rel < 1e-5
                    ok &= good
                    ln = Launch(f"fp4_mma_probe.{name}", grid, block, o["device"], "probe", f, args,
                                {"shared_mem": smem})
                    us = time_launches([ln], reps=o["reps"], iters=o["iters"], flush_bytes=flush)[0]
                    print(line(config_label(name, ks, per_sm), nbytes, us, base)
                          + f"; relL2 {rel:.1e}, worst row {worst:.1e}" + ("" if good else "  CHECK FAILED"),
                          flush=True)
                    if good and (best is None or us < best[0]):
                        best = (us, config_label(name, ks, per_sm))
        if best:
            print(line(f"{shape} best: {best[1]}", nbytes, best[0], base), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
