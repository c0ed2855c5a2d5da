// Routed-expert weights: MXFP4 / NVFP4 dequantisation and the fused FP4 GEMV of decode
// (dsv4_model_and_formats §9.4, §10).
//
// Packed layout (both formats): [out, in/2] bytes, element 2j in the LOW nibble of byte j,
// 2j+1 in the HIGH nibble; e2m1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign.
//
// dequant_mxfp4_bf16: W = e2m1 * 2^(S - 127) (S e8m0 per 32 inputs) -> bf16. The product has at
//   most 2 significant bits, so it is built directly on integer bits, bf16 subnormals included
//   (exact; independent of -ftz). Twin formats.dequant_mxfp4 (then exact bf16). S = 0xFF -> NaN.
// dequant_nvfp4_bf16: W = bf16( f32( f32(e2m1 * e4m3(S16)) * weight_scale_2 ) ), the twin's
//   formats.dequant_nvfp4 order, then RNE to bf16 (exact when the NVFP4 came from MXFP4).
//   Thread per 16-byte chunk (32 elements), grid-stride.
// gemv_mxfp4_k{1,2,4} / gemv_nvfp4_k{1,2,4}: y[s, o] = bf16( sum_k W_e[o, k] x[s / x_div, k] ),
//   e = expert_ids[s] read on the device (e < 0: the row is written as zeros). Weights are
//   reached through per-expert device pointer tables (u64 [E]: packed, scales; NVFP4 also a
//   weight_scale_2 f32 [E] array), so experts can live anywhere (a stacked [E, out, in/2] tensor
//   is the special case base + e * stride). The STORED bytes are read directly with 128-bit
//   loads: one uint4 = 32 e2m1 values = exactly one MXFP4 scale (two NVFP4 scales).
//   gemv_*_gateup_k*: W1 and W3 GEMVs + clamped SwiGLU in one launch; gemv_*_down_combine_k*:
//   W2 GEMV + the MoE combine in one launch. Same row arithmetic, so the fused and plain kernels
//   produce identical bits.
//
// THE ROW ARITHMETIC (fixed by (o, K) alone; the launch geometry below never changes it): lane l
//   of one warp owns the 32-element chunks q = l + 32 i (i < KPL, K <= 1024*KPL); per chunk a
//   32-product f32 partial in element order (FMA chain), acc = fma(partial, block scale, acc) in
//   chunk order (NVFP4: two 16-element partials and scales), then the warp xor-tree warp_sum
//   (FP4_XRED: the same tree for several rows at once, warp_sum_rows);
//   NVFP4 multiplies weight_scale_2 once at the end. (FP4_ALU_ODD computes the odd elements'
//   products as (e2m1 * 2^-14) * (x * 2^14): the same real products, so the same bits, for
//   |x| < 2^114; beyond that x * 2^14 overflows.) Gate/up round a and u to bf16, then SwiGLU;
//   down rounds each pick to bf16 and sums them from 0 in ascending expert id (stable), then adds
//   the shared expert. x is expected bf16; for the reference numeric class pass the
//   FP8-simulated activation (quant_sim fp8_sim_b128).
//
// LAYOUT (why: occupancy, load/compute overlap, no bank conflicts). The old kernels kept the
//   whole x slice and all weight chunks of a warp in registers (~170 registers, 1 CTA of 8 warps
//   per SM) and loaded everything before computing, so memory and math never overlapped.
//   * 256-thread CTAs, <= 128 registers, 2 CTAs (16 warps) per SM. A slot (down: a token) gets
//     nx CTAs (grid (nx, slots), nx from the SM count in ops/experts.py); their warps take the
//     slot's row groups (R rows; gate/up: R rows of both matrices) round-robin.
//   * Per warp a stream of chunk steps (group g, chunk i) with a register ring: the weights and
//     scales of step s + FP4_DEPTH are loaded into the slot step s has just consumed, so loads
//     stay in flight across groups (and across picks in down_combine) while the warp computes.
//     The first loads are issued before the CTA stages x (or h), so staging hides behind them.
//   * x (down: the token's k rows of h) is staged once per CTA in shared memory as f32 (bf16 for
//     down with K > 2048), lane-interleaved so a warp's 32 lanes read 32 consecutive 16-byte
//     words (conflict-free), and each x chunk is read once per step for all the rows of a group.
//   * e2m1 decode, split between two pipes (FP4_ALU_ODD, default 1). Even elements: a 16-word
//     f32 table in shared memory (conflict-free: 16 words on 16 banks, equal addresses
//     broadcast); the lookup address is one byte insert (PRMT) into the table's 256-aligned base.
//     Table-only (FP4_ALU_ODD=0, the previous kernels) made the GEMVs shared-memory-pipe bound:
//     one LDS wavefront per 32 weights plus the x reads, ~160 wavefronts per 128-weight chunk step
//     of a gate/up warp against ~540 issued instructions (4 warps / SM partition). Odd elements:
//     ALU, two per f16x2 (bit placement, exact e2m1 * 2^-14, subnormal code 1 included) and a
//     cvt to f32, with their x staged times 2^14 so the products are unchanged. Per chunk step
//     the issue count stays ~535 and the LDS wavefronts drop to ~96 (nvdisasm, gateup_k4): the
//     step becomes issue bound. An f32 bit trick would meet f32 subnormals (-ftz), which f16
//     arithmetic does not flush.
//     The default decode is FP4_PRMT=1 (since 5937ee9's A/B): all eight elements by the f16
//     placement, the f16x2 words built from byte-gathered f16 high bytes, no table: 27 instead of
//     29 instructions per 8 weights, gate/up 28.27 -> 27.04 us, down 18.51 -> 17.84 us for 6
//     Flash experts (tools/bench_gemv.py, H200). The alternatives, same bits
//     (tests/gpu/test_kernels_experts.py): FP4_PRMT=0 (even elements through the table, the
//     previous default), FP4_ALU_EVEN=1 (the plain placement: slower), FP4_ALU_ODD=0 (all table).
//     See dot8 and docs/decode_perf.md "FP4 GEMV instruction budget".
//   * Finished rows are kept one per lane and stored 32 at a time, so the epilogues (bf16
//     rounding, SwiGLU in double) run lane-parallel. With FP4_XRED (the default) a row group's
//     warp sums are one transposed reduction that leaves each row's total on its own lanes, so
//     the per-row work between the sums and the store (NVFP4's weight_scale_2, the bf16
//     roundings, down's pick sums) runs once per lane too (KeptX).
//   * down_combine: each warp ranks the token's picks itself (shuffles: no barrier before the
//     first weight loads) and walks them in ascending expert id for its R rows.
//   * Full-shape fast paths (gemv_*_gateup_k4_f, gemv_*_down_combine_k2_f; ops/experts.py picks
//     them for the Flash shapes): the same row arithmetic without the bookkeeping the general
//     shapes need (load predicates, zero fills, runtime row strides); see "full-shape fast paths".
//     gemv_*_down_combine_k2_f_w2 also computes the shared expert's w2 rows (gemv_bf16_row.cuh;
//     the device step's default, MEMRA_DSV4_DECODE_SHARED_W2=fused).  gemv_*_gateup_k4_r (opt-in,
//     ops/experts.py GATEUP_RING): the full-shape gate/up with its weight ring in shared memory,
//     filled by cp.async one row group ahead (fp4_stream_gateup_ring); same bits, 24.6 -> 23.7 us
//     alone and nothing in the step (issue-bound, docs/decode_perf.md eleventh session).
//     gemv_*_gateup_k4_f_sh also computes the shared expert's SwiGLU (bf16 weights, one token),
//     before its PDL wait while the router runs (SharedSwigluPre; the device step's default,
//     MEMRA_DSV4_SHARED_GATEUP=on; gemv_bf16_swiglu's bytes, docs/decode_perf.md twentieth session).
#include "common.cuh"
#include "gemv_bf16_row.cuh"

using namespace memra;

namespace {

// e2m1 nibble n times 2^(sb - 127) as bf16 bits, exact (sb = e8m0 byte).
DEV u32 mx_to_bf16(u32 n, u32 sb) {
    const u32 sign = (n & 8u) << 12;
    const u32 c = n & 7u;
    if (sb == 255u) return 0x7fc0u;
    if (c == 0u) return sign;
    const int ec = c == 1u ? -1 : (int)(c >> 1) - 1;
    const u32 m = c == 1u ? 0u : (c & 1u);
    const int E = ec + (int)sb;  // biased bf16 exponent
    if (E >= 255) return sign | 0x7f80u;
    if (E >= 1) return sign | ((u32)E << 7) | (m << 6);
    return sign | ((2u + m) << (E + 5));  // subnormal: (1 + m/2) 2^(E-127) = (2+m) 2^(E+5) * 2^-133
}

// The dequantisation of one matrix, grid-stride over its 32-element chunks (16 B read, 64 B
// written per thread step): packed [R, C/2] u8, scale [R, C/32] e8m0 -> out [R, C] bf16.
DEV void dequant_mxfp4_rows(const u8* __restrict__ packed, const u8* __restrict__ scale, u16* __restrict__ out,
                            i64 R, int C) {
    const int cpr = C >> 5;
    const i64 total = R * cpr;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const uint4 w = ldg16(packed + q * 16);  // chunk q = row q / cpr, 32 elements
        const u32 sb = __ldg(scale + q);
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        uint4* o = reinterpret_cast<uint4*>(out + q * 32);
#pragma unroll
        for (int v = 0; v < 4; ++v) {  // 8 elements per word
            u32 h[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) h[i] = mx_to_bf16((ws[v] >> (4 * i)) & 15u, sb);
            o[v] = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
        }
    }
}

// packed [R, C/2] u8, wscale [R, C/16] e4m3, ws2 -> out [R, C] bf16 = bf16(f32(e2m1 * s) * ws2).
DEV void dequant_nvfp4_rows(const u8* __restrict__ packed, const u8* __restrict__ wscale, float ws2,
                            u16* __restrict__ out, i64 R, int C) {
    const int cpr = C >> 5;
    const i64 total = R * cpr;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (i64)gridDim.x * blockDim.x) {
        const uint4 w = ldg16(packed + q * 16);
        const float s0 = e4m3_to_f32(__ldg(wscale + 2 * q)), s1 = e4m3_to_f32(__ldg(wscale + 2 * q + 1));
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        uint4* o = reinterpret_cast<uint4*>(out + q * 32);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const float s = v < 2 ? s0 : s1;
            float f[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(__fmul_rn(e2m1_to_f32((ws[v] >> (4 * i)) & 15u), s), ws2);
            o[v] = pack8(f);
        }
    }
}

}  // namespace

// packed [R, C/2] u8; scale [R, C/32] u8; out [R, C] bf16. C % 32 == 0.
extern "C" __global__ void __launch_bounds__(256)
dequant_mxfp4_bf16(const u8* __restrict__ packed, const u8* __restrict__ scale, u16* __restrict__ out,
                   long long R, int C) { PDL_ENTRY();
    dequant_mxfp4_rows(packed, scale, out, R, C);
}

// packed [R, C/2] u8; wscale [R, C/16] u8 (e4m3); ws2 f32 scalar; out [R, C] bf16. C % 32 == 0.
extern "C" __global__ void __launch_bounds__(256)
dequant_nvfp4_bf16(const u8* __restrict__ packed, const u8* __restrict__ wscale, float ws2,
                   u16* __restrict__ out, long long R, int C) { PDL_ENTRY();
    dequant_nvfp4_rows(packed, wscale, ws2, out, R, C);
}

namespace {

// ------------------------------------------------------------------------ FP4 GEMV engine
// See the header comment for the layout. Tunables (rows per warp group, prefetch depth) are
// macros only so that tools can time alternatives; the arithmetic does not depend on them.
#ifndef FP4_GV_R
#define FP4_GV_R 4  // gemv_*: rows per warp group
#endif
#ifndef FP4_GU_R
#define FP4_GU_R 2  // gateup: rows per warp group (x 2 matrices)
#endif
#ifndef FP4_DN_R
#define FP4_DN_R 2  // down_combine: rows per warp group
#endif
#ifndef FP4_DEPTH
#define FP4_DEPTH 2  // prefetch distance in chunk steps (register ring slots)
#endif
#ifndef FP4_DN_DEPTH
// down_combine's prefetch distance: its warps have few steps (Flash: 6 picks x 2 chunk steps),
// so the loads issued before the first step cover a larger share of the run, and its ring of
// R = 2 rows leaves the registers for 4 slots (<= 124 registers, no spills)
#define FP4_DN_DEPTH 4
#endif
#ifndef FP4_DN_PRELOAD
// The full-shape down + combine kernels (_k2_f, _k2_f_w2): what a warp issues BEFORE its PDL wait
// (PDL_ENTRY_PRELOAD; common.cuh states the rule and why the expert ids may be read there).
// 0: nothing, every load after the wait.  1: the token's expert ids (ld.cg), their ranking, the
// weight-table entries and the weight ring's first FP4_DN_DEPTH chunk steps.  2: also (_k2_f_w2)
// the first trip (R rows x 1024 bf16) of the warp's first shared-w2 row group, by cp.async into
// shared memory behind the h rows and the w2 row values (DOWN_W2_PRE_BYTES; ops/experts.py
// requests that region at every level, so the levels differ in their code alone).  The same
// loads and the same arithmetic at every level: the same bits (GPU test
// test_down_preload_levels_same_bytes).  MEASURED (seventeenth session, 1x H200, flash-layers:20,
// in-process A/B against level 0): 1K 3.66 -> 3.59 and 3.49 -> 3.44 ms (both arm orders), 32K
// 3.77 -> 3.70 ms.  The default since the eighteenth session.  (The first whole-suite run with
// level 2, 3f71101, had failed four Flash-layer step identity tests at step 0; the same message
// had been seen once before this macro existed.  The eighteenth session found a race that fits
// it and is not in the kernels: new_state / prefill's reset and the first step's GemvTable
// uploads were enqueued on the caller's current stream, which the non-blocking compute streams
// never waited for; runtime.Devices.order_after_current, GPU test test_stream_order_gpu.py.)
#define FP4_DN_PRELOAD 2
#endif
#ifndef FP4_MINB
#define FP4_MINB 2  // resident CTAs per SM the register budget is set for (launch bounds)
#endif
constexpr int FP4_WARPS = 8;  // 256-thread CTAs
// gemv_*_down_combine_k2_f_w2: the shared expert's intermediate size (w2 [O, DOWN_W2_K] bf16)
constexpr int DOWN_W2_K = 2048;
// FP4_DN_PRELOAD >= 2: the CTA's preloaded w2 chunks (per warp: R rows x the first 1024 bf16);
// ops/experts.py DOWN_W2_PRE_SMEM
constexpr int DOWN_W2_PRE_BYTES = FP4_WARPS * FP4_DN_R * 1024 * 2;

#ifndef FP4_ALU_EVEN
// 1: the even elements are decoded on the ALU too (the odd elements' bit placement, see dot8),
// every x is staged times 2^14 and there is no table: no LDS for weights at all, the shared-
// memory pipe carries only the x reads (the limiter of the default kernels, Nsight L1/TEX ~75 %)
// at the price of more ALU work and 4 more f16->f32 converts (HADD2.F32) per 8 weights.
// nvdisasm, gemv_mxfp4_gateup_k4 per chunk step (4 rows x 4 words): L1 wavefronts of LDS 96 -> 32
// (64 table LDS gone, the 8 x LDS.128 stay), issued ~661 -> ~692. Not timed yet. Needs FP4_ALU_ODD.
#define FP4_ALU_EVEN 0
#endif
#if FP4_ALU_EVEN && defined(FP4_ALU_ODD) && !FP4_ALU_ODD  // FP4_ALU_ODD defaults to 1 below
#error "FP4_ALU_EVEN=1 needs FP4_ALU_ODD=1"
#endif

#ifndef FP4_DIAG_DECODE
// TIMING ONLY, never a build that computes anything: 1 builds dot8's (and, with FP4_MMA_PRMT,
// the _mma kernels') f16x2 words with the instruction count a load-time bit permutation of the
// stored words would leave (qe one mask, qo one shift + mask: 7 instead of 11 operations per 8
// weights), 2 without the gathers (5 operations).  Both give WRONG values; they exist so
// that tools/bench_gemv.py --fp4-cost can time what a cheaper decode would be worth before
// anyone builds the permuted layout.
#define FP4_DIAG_DECODE 0
#endif
#ifndef FP4_DIAG_DOWN
// TIMING ONLY, like FP4_DIAG_DECODE (wrong values): bits that remove parts of the down +
// combine kernels' prologue, to size them: 1 = the token's h rows are not staged in shared memory
// (the stream reads whatever is there; the __syncthreads stays), 2 = each pick's weight / scale
// table entry is read at the pick's lane index instead of its ranked expert id, so those loads
// do not wait for the ids and the ranking (tools/bench_gemv.py --fp4-cost)
#define FP4_DIAG_DOWN 0
#endif
#ifndef FP4_PRMT
// 1 (the default): every e2m1 element decoded on the ALU like FP4_ALU_EVEN=1 (the same f16x2
// words, so the same f32 weights, the same x staged times 2^14, no table), but the f16x2 words
// are built with fewer instructions: the four odd elements' f16 high bytes are gathered into one
// word by a single shift + mask + merge (sign bit 7 of each byte is already in place, the
// magnitude moves down 3), the four even ones' into another (shifts 1 and 4), and each f16x2 is
// then one byte permute (PRMT with a zero word: bytes 0 and 2 -> high bytes of the two halves) or
// one mask. nvdisasm, gemv_mxfp4_gateup_k4 main loop: 29 -> 27 instructions per 8 weights
// (decode + FFMA). Measured (H200, 5937ee9, tools/bench_gemv.py --fp4-variants, L2 flushed, 6
// Flash experts): gate/up 28.27 -> 27.04 us, down 18.51 -> 17.84 us; bit-identical to the table
// build (12 GPU tests). A build that names FP4_ALU_EVEN=1 or FP4_ALU_ODD=0 gets FP4_PRMT=0 unless
// it names FP4_PRMT too. Needs FP4_ALU_ODD=1.
#if FP4_ALU_EVEN || (defined(FP4_ALU_ODD) && !FP4_ALU_ODD)
#define FP4_PRMT 0
#else
#define FP4_PRMT 1
#endif
#endif
#if FP4_PRMT && FP4_ALU_EVEN
#error "FP4_PRMT=1 and FP4_ALU_EVEN=1 are alternatives: pick one"
#endif
#if FP4_PRMT && defined(FP4_ALU_ODD) && !FP4_ALU_ODD
#error "FP4_PRMT=1 needs FP4_ALU_ODD=1"
#endif
// the even elements are decoded on the ALU (and their x staged times 2^14): no table
#define FP4_EVEN_ON_ALU (FP4_ALU_EVEN || FP4_PRMT)

#ifndef FP4_XRED
// 1 (the default): the end of a row group reduces its N rows' lane partials by one transposed
// warp reduction (warp_sum_rows: at xor distance 16 lanes keep one row of each pair and send the
// other, at 8 one of the remaining pairs, ...; N - 1 + 5 - log2 N shuffles instead of 5 N), each
// row through warp_sum's own tree: the same pairs of lane values added at every level, so the
// same f32 sums bit for bit (tests/test_fp4_xred_cpu.py emulates both). The row totals then sit
// one row per lane group (lane / (32 / R) = row in the group, lane % (32 / R) = the group's slot
// among the 32 / R kept ones), so the epilogue's NVFP4 weight_scale_2, the bf16 roundings and
// down's pick sums run once per lane instead of once per row on every lane. 0: a warp_sum per
// row (the previous kernels). Schedule only: the bytes of both builds are equal
// (tests/gpu/test_kernels_experts.py -k xred).
#define FP4_XRED 1
#endif

#ifndef FP4_E8M0_FMA
// 1 (the default): the MXFP4 block scale 2^(b - 127) as the f32 of bits b << 23 passed through
// fma(s, 0, s) (2 instructions instead of e8m0_to_f32's shift, two compares and two selects):
// s for b in 1..254; +0 for b = 0, which is what the chunk fold's FFMA.FTZ makes of the 2^-127
// subnormal of e8m0_to_f32 (-ftz, every build here: a subnormal operand flushes to +0); and for
// b = 255, +inf * 0 + inf = NaN, as e8m0_to_f32's 0x7fc00000 (every f32 operation on a NaN returns
// the canonical 0x7fffffff on the GPU, so the fold's results are the same bits). 0: the selects.
#define FP4_E8M0_FMA 1
#endif

#ifndef FP4_E4M3_CVT
// 1 (the default): the two NVFP4 e4m3 block scales of a chunk by the hardware conversion (one
// cvt.rn.f16x2.e4m3x2 of the two bytes, exact: every e4m3 value is a normal f16; then the exact
// f16 -> f32 of each half) instead of two e4m3_to_f32 (bit arithmetic with branches): the same
// f32 values, -0 for 0x80 included; 0x7F / 0xFF give some NaN as e4m3_to_f32's signed 0x7fc00000
// does (the fold's FFMA returns the canonical NaN for either). 0: e4m3_to_f32.
#define FP4_E4M3_CVT 1
#endif

#if !FP4_EVEN_ON_ALU
// e2m1 decode table, one per CTA: 16 words on 16 banks, so a warp's 32 lookups are one
// conflict-free wavefront. 256-byte aligned: the low byte of its shared address is 0, so
// "table address + 4 * nibble" is a byte insert (one PRMT / LOP3 per element, no add).
__shared__ __align__(256) float fp4_lut[16];

DEV u32 lut_base() { return (u32)__cvta_generic_to_shared(fp4_lut); }
DEV float lds_f32(u32 a) {  // volatile: stays after the barrier that publishes the table
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}
#else
DEV u32 lut_base() { return 0u; }  // no table: dot8 ignores b
#endif

#ifndef FP4_ALU_ODD
#define FP4_ALU_ODD 1  // 1: odd elements decoded on the ALU (f16 bit placement), 0: all through the table
#endif
// x multiplier of the ALU-decoded (odd) elements: their weights arrive as e2m1 * 2^-14 (below)
constexpr float FP4_ODD_X_SCALE = FP4_ALU_ODD ? 16384.0f : 1.0f;

// an odd element's x as the FMA chain uses it: times 2^14 with FP4_ALU_ODD (exact for |x| < 2^114;
// a subnormal x flushes to zero here as the table path's FFMA.FTZ flushes it), else unchanged
DEV float odd_x(float x) { return FP4_ALU_ODD ? __fmul_rn(x, FP4_ODD_X_SCALE) : x; }
// an even element's x: times 2^14 only with FP4_ALU_EVEN or FP4_PRMT (then like odd_x), else unchanged
DEV float even_x(float x) { return FP4_EVEN_ON_ALU ? __fmul_rn(x, FP4_ODD_X_SCALE) : x; }

// f16x2 bit pattern -> two f32 (exact, f16 subnormals included: no .ftz on the cvt)
DEV void f16x2_to_f32(u32 h, float& lo, float& hi) {
    asm("{\n\t.reg .b16 lo16, hi16;\n\tmov.b32 {lo16, hi16}, %2;\n\t"
        "cvt.f32.f16 %0, lo16;\n\tcvt.f32.f16 %1, hi16;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(h));
}

// p continued by the eight products of the f16x2 words h04 h15 h26 h37 (the halves of word hij
// are elements i and j; each half an exact f16, converted to f32 exactly) with xf, in element
// order as every dot8 path: the common tail of the all-ALU decodes (FP4_ALU_EVEN, FP4_PRMT),
// which differ only in how they build the words.
DEV float dot8_words(u32 h04, u32 h15, u32 h26, u32 h37, const float (&xf)[8], float p) {
    float w0, w4, w1, w5, w2, w6, w3, w7;
    f16x2_to_f32(h04, w0, w4);
    f16x2_to_f32(h15, w1, w5);
    f16x2_to_f32(h26, w2, w6);
    f16x2_to_f32(h37, w3, w7);
    p = __fmaf_rn(w0, xf[0], p);
    p = __fmaf_rn(w1, xf[1], p);
    p = __fmaf_rn(w2, xf[2], p);
    p = __fmaf_rn(w3, xf[3], p);
    p = __fmaf_rn(w4, xf[4], p);
    p = __fmaf_rn(w5, xf[5], p);
    p = __fmaf_rn(w6, xf[6], p);
    p = __fmaf_rn(w7, xf[7], p);
    return p;
}

#if FP4_DIAG_DECODE
// TIMING ONLY (wrong values, see FP4_DIAG_DECODE): FP4_PRMT's four f16x2 words from cheaper
// gathers, for dot8 and the mma decode alike; 1: qe one mask, qo one shift + mask (the count a
// load-time bit permutation would need if one existed); 2: no gathers (5 operations per 8 weights)
DEV void diag_decode_words(u32 w, u32 (&h)[4]) {
    const u32 qe = FP4_DIAG_DECODE == 1 ? (w & 0x8e8e8e8eu) : w;
    const u32 qo = FP4_DIAG_DECODE == 1 ? ((w >> 4) & 0x8e8e8e8eu) : (w >> 4);
    h[0] = __byte_perm(qe, 0u, 0x2404u);
    h[1] = __byte_perm(qo, 0u, 0x2404u);
    h[2] = qe & 0xff00ff00u;
    h[3] = qo & 0xff00ff00u;
}
#endif

// p continued by sum_{e<8} e2m1(nibble e of w) * xf[e], in element order (f32 FMA chain).
// Even elements: table lookup; t = 4 * the low nibbles of the four bytes, each lookup address is
// one byte of t placed into the table base b (PRMT), then LDS. The table alone made the kernels
// shared-memory-pipe bound (one LDS wavefront per 32 weights), so with FP4_ALU_ODD the odd
// elements are decoded on the ALU instead: the f16 pattern s000 0cc c000 0000 0 (sign to bit 15,
// the 3 magnitude bits e1 e0 m to bits 11..9) is exactly e2m1 * 2^-14 (code 1 = 2^-15, an f16
// subnormal), for elements (1, 5) and (3, 7) of w in one f16x2 each (one shift distance per
// pair), converted to f32 exactly; their x were staged times 2^14 (FP4_ODD_X_SCALE), so every
// product, hence every FMA of the chain, is the same real number as with the table: same bits.
DEV float dot8(u32 w, const float (&xf)[8], u32 b, float p) {
#if FP4_DIAG_DECODE
    (void)b;
    u32 h[4];
    diag_decode_words(w, h);
    p = dot8_words(h[0], h[1], h[2], h[3], xf, p);
#else
#if FP4_ALU_EVEN
    // all eight on the ALU: the same placement for the even nibbles, bits 0-3 / 16-19 (elements
    // 0, 4) and 8-11 / 24-27 (2, 6): magnitude to bits 11..9 and sign to bit 15 of each half.
    // One shift pair per f16x2; each half's masks keep the other nibbles (and the bits shifted
    // across the half boundary) out, so the 32-bit shifts serve both halves.
    (void)b;
    const u32 h04 = ((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u);
    const u32 h15 = ((w << 5) & 0x0e000e00u) | ((w << 8) & 0x80008000u);
    const u32 h26 = ((w << 1) & 0x0e000e00u) | ((w << 4) & 0x80008000u);
    const u32 h37 = ((w >> 3) & 0x0e000e00u) | (w & 0x80008000u);
    p = dot8_words(h04, h15, h26, h37, xf, p);
#elif FP4_PRMT
    // The f16 of e2m1 * 2^-14 (the placement above) has all its bits in the half's high byte:
    // sign at bit 7, magnitude e1 e0 m at bits 3..1. Byte k of qo is that byte for element 2k + 1
    // (the high nibble of byte k of w: magnitude bits 6..4 -> 3..1, the sign already at bit 7),
    // byte k of qe for element 2k (low nibble: magnitude 2..0 -> 3..1, sign 3 -> 7). An f16x2 of
    // elements (2k, 2k + 4) has those bytes at bits 15..8 and 31..24 and zeros elsewhere: for
    // k = 1 that is q & 0xff00ff00, for k = 0 one byte permute of q with a zero word (selector
    // nibbles, byte 0 first: 4 = zero, 0 = q byte 0, 4, 2 = q byte 2). The four words equal
    // FP4_ALU_EVEN's h04 h15 h26 h37 bit for bit (tests/test_fp4_alu_decode.py), so the weights,
    // products and FMA chain are the same; only the instruction count differs.
    (void)b;
    const u32 qo = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);
    const u32 qe = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
    const u32 h04 = __byte_perm(qe, 0u, 0x2404u);
    const u32 h15 = __byte_perm(qo, 0u, 0x2404u);
    const u32 h26 = qe & 0xff00ff00u;
    const u32 h37 = qo & 0xff00ff00u;
    p = dot8_words(h04, h15, h26, h37, xf, p);
#elif FP4_ALU_ODD
    const u32 t = (w << 2) & 0x3c3c3c3cu;
    const u32 h15 = ((w << 5) & 0x0e000e00u) | ((w << 8) & 0x80008000u);
    const u32 h37 = ((w >> 3) & 0x0e000e00u) | (w & 0x80008000u);
    float w1, w5, w3, w7;
    f16x2_to_f32(h15, w1, w5);
    f16x2_to_f32(h37, w3, w7);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7650u)), xf[0], p);
    p = __fmaf_rn(w1, xf[1], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7651u)), xf[2], p);
    p = __fmaf_rn(w3, xf[3], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7652u)), xf[4], p);
    p = __fmaf_rn(w5, xf[5], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7653u)), xf[6], p);
    p = __fmaf_rn(w7, xf[7], p);
#else
    const u32 t = (w << 2) & 0x3c3c3c3cu;
    const u32 u = (w >> 2) & 0x3c3c3c3cu;
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7650u)), xf[0], p);
    p = __fmaf_rn(lds_f32(__byte_perm(u, b, 0x7650u)), xf[1], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7651u)), xf[2], p);
    p = __fmaf_rn(lds_f32(__byte_perm(u, b, 0x7651u)), xf[3], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7652u)), xf[4], p);
    p = __fmaf_rn(lds_f32(__byte_perm(u, b, 0x7652u)), xf[5], p);
    p = __fmaf_rn(lds_f32(__byte_perm(t, b, 0x7653u)), xf[6], p);
    p = __fmaf_rn(lds_f32(__byte_perm(u, b, 0x7653u)), xf[7], p);
#endif
#endif  // FP4_DIAG_DECODE
    return p;
}

// e8m0 byte -> the f32 block scale 2^(b-127) as the chunk fold's FFMA uses it. FP4_E8M0_FMA=0:
// the bits of common.cuh's e8m0_to_f32 (0 -> 2^-127, 255 -> NaN) as selects (that one compiled
// to two branches per scale in the chunk loop); 1: b << 23 through fma(s, 0, s), the same value
// in the fold under -ftz (see FP4_E8M0_FMA).
DEV float e8m0_scale(u32 b) {
#if FP4_E8M0_FMA
    const float s = __uint_as_float(b << 23);  // 2^(b-127); +0 for b = 0, +inf for b = 255
    return __fmaf_rn(s, 0.0f, s);              // s if finite, NaN for +inf
#else
    const u32 bits = b == 0u ? 0x00400000u : (b == 255u ? 0x7fc00000u : b << 23);
    return __uint_as_float(bits);
#endif
}

DEV u32 word_of(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// FP4_E4M3_CVT: the two e4m3 block scales of an NVFP4 chunk (bytes b0, b1) -> f32, exact: the
// values of e4m3_to_f32 (NaN codes: some NaN)
DEV void e4m3_scales(u32 b0, u32 b1, float& f0, float& f1) {
    u32 pair;
    const unsigned short two = (unsigned short)(b0 | (b1 << 8));  // low byte -> low half
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(two));
    f16x2_to_f32(pair, f0, f1);
}

// One chunk (32 elements) of NRM row dots, THE arithmetic of every FP4 GEMV here: per row a
// 32-product f32 partial in element order, then acc = fma(partial, block scale, acc) (NVFP4: two
// 16-element partials, each times its e4m3 scale, in order). xq: this lane's chunk in shared
// memory (see stage_rows): XF, as f32, 4 elements per float4, part jj at xq + 32 jj; else as
// bf16, 8 per uint4. The partials are computed on every lane (zero weights and x where the
// chunk does not exist); only lanes with a chunk (qok) fold theirs into acc.
template <int NRM, bool NV, bool XF>
DEV void chunk_dots(const uint4 (&w)[NRM], const u32 (&s)[NRM][NV ? 2 : 1], const void* xq, u32 b,
                    bool qok, float (&acc)[NRM]) {
    float p[NRM];
#if FP4_E4M3_CVT
    float sc[NRM][2];  // NVFP4's two scales as f32 (from j = 1 on)
#endif
#pragma unroll
    for (int m = 0; m < NRM; ++m) p[m] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float xf[8];
        if (XF) {
            const float4 lo = static_cast<const float4*>(xq)[64 * j], hi = static_cast<const float4*>(xq)[64 * j + 32];
            xf[0] = lo.x; xf[1] = lo.y; xf[2] = lo.z; xf[3] = lo.w;
            xf[4] = hi.x; xf[5] = hi.y; xf[6] = hi.z; xf[7] = hi.w;
        } else {
            unpack8(static_cast<const uint4*>(xq)[32 * j], xf);
            xf[0] = even_x(xf[0]);  // FP4_ALU_EVEN / FP4_PRMT: the even weights too (dot8)
            xf[2] = even_x(xf[2]);
            xf[4] = even_x(xf[4]);
            xf[6] = even_x(xf[6]);
            xf[1] = odd_x(xf[1]);  // the odd elements' weights are decoded times 2^-14 (dot8)
            xf[3] = odd_x(xf[3]);
            xf[5] = odd_x(xf[5]);
            xf[7] = odd_x(xf[7]);
        }
#pragma unroll
        for (int m = 0; m < NRM; ++m) p[m] = dot8(word_of(w[m], j), xf, b, p[m]);
        if (NV && j == 1) {
#pragma unroll
            for (int m = 0; m < NRM; ++m) {
#if FP4_E4M3_CVT
                e4m3_scales(s[m][0], s[m][NV ? 1 : 0], sc[m][0], sc[m][1]);  // both, one conversion
                if (qok) acc[m] = __fmaf_rn(p[m], sc[m][0], acc[m]);
#else
                if (qok) acc[m] = __fmaf_rn(p[m], e4m3_to_f32(s[m][0]), acc[m]);
#endif
                p[m] = 0.0f;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NRM; ++m)
#if FP4_E4M3_CVT
        if (qok) acc[m] = __fmaf_rn(p[m], NV ? sc[m][1] : e8m0_scale(s[m][0]), acc[m]);
#else
        if (qok) acc[m] = __fmaf_rn(p[m], NV ? e4m3_to_f32(s[m][NV ? 1 : 0]) : e8m0_scale(s[m][0]), acc[m]);
#endif
}

// the end of a row dot: warp xor-tree of the lane partials; NVFP4 times weight_scale_2
template <bool NV>
DEV float row_total(float acc, float ws2) {
    acc = warp_sum(acc);
    return NV ? __fmul_rn(acc, ws2) : acc;
}

// a warp-summed row total times weight_scale_2 (NVFP4), as row_total after its warp_sum
template <bool NV>
DEV float times_ws2(float t, float ws2) { return NV ? __fmul_rn(t, ws2) : t; }

// FP4_XRED: the warp sums of N rows at once (N a power of two <= 32), each row by warp_sum's
// xor tree. v[m]: this lane's partial of row m (overwritten). Level l = 0 .. log2 N - 1 (xor
// distance o = 16 >> l) pairs the n = N >> l values as (i, i + n / 2): a lane with bit o set keeps
// the upper one and sends the lower, its partner (lane ^ o) the reverse, so both add their own
// value of one row to the partner's value of the same row: what warp_sum's level l adds for that
// row on that lane (same operand order too). After log2 N levels the lane holds row
// lane >> (5 - log2 N) only, and the remaining levels (16 >> log2 N .. 1) are warp_sum's own. As
// warp_sum leaves every lane with the same bits (a + b == b + a in f32, FTZ and NaN included),
// the result is row m's warp_sum exactly, on the 32 / N lanes of row m.
template <int N>
DEV float warp_sum_rows(float (&v)[N]) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two <= 32");
    constexpr int LOG = N >= 32 ? 5 : N >= 16 ? 4 : N >= 8 ? 3 : N >= 4 ? 2 : N >= 2 ? 1 : 0;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int l = 0; l < LOG; ++l) {
        const int o = 16 >> l, h = (N >> l) / 2;
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < h; ++i) {
            const float send = sel(upper, v[i], v[i + h]);
            const float keep = sel(upper, v[i + h], v[i]);
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float r = v[0];
#pragma unroll
    for (int o = 16 >> LOG; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    return r;
}

// FP4_XRED's kept rows: the totals of row rr of a warp's row group g (R rows) live on lanes
// rr * (32 / R) + (0 .. 32 / R - 1); of those, lane rr * (32 / R) + g % (32 / R) keeps it until the
// store (32 / R groups, i.e. 32 rows, per flush, as Kept).
template <int R>
struct KeptX {
    static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R: a power of two <= 32");
    static constexpr int SLOTS = 32 / R;
    float a, u;
    int o = -1;
    DEV static int row() { return (int)(threadIdx.x & 31) / SLOTS; }  // rr of this lane's totals
    // row group g's totals (a, u: this lane's row's) are kept by the lanes of slot g % SLOTS
    DEV void put(int g, float a_, float u_, int o0) {
        if ((int)(threadIdx.x & (SLOTS - 1)) == (g & (SLOTS - 1))) {
            a = a_;
            u = u_;
            o = o0 + row();
        }
    }
    DEV static bool flush_after(int g, bool last) { return (g & (SLOTS - 1)) == SLOTS - 1 || last; }
};

// this lane's pointers into the NRM rows of a warp group: weights of chunk q = lane (row start +
// 16 lane) and its scale byte(s) (row start + lane, NVFP4 + 2 lane); chunk lane + 32 i is then an
// immediate offset away. Bit m of ok: row m exists.
template <int NRM>
struct Rows {
    const u8* w[NRM];
    const u8* s[NRM];
    u32 ok;
};

// issue the loads of chunk lane + 32 i of the group's rows into one ring slot (zeros where disabled)
template <int NRM, bool NV>
DEV void fetch(uint4 (&w)[NRM], u32 (&s)[NRM][NV ? 2 : 1], const Rows<NRM>& r, int i, bool qok) {
#pragma unroll
    for (int m = 0; m < NRM; ++m) {
        const bool ok = qok && ((r.ok >> m) & 1u);
        w[m] = ok ? ldg_weight16(r.w[m] + 512 * i) : make_uint4(0, 0, 0, 0);
        if (NV) {
            s[m][0] = ok ? ldg_weight_u8(r.s[m] + 64 * i) : 0u;
            s[m][NV ? 1 : 0] = ok ? ldg_weight_u8(r.s[m] + 64 * i + 1) : 0u;
        } else {
            s[m][0] = ok ? ldg_weight_u8(r.s[m] + 32 * i) : 0u;
        }
    }
}

// The per-warp stream: groups g = 0..P.ngroups-1 of NRM rows, each KPL chunk steps (chunk
// q = lane + 32 i at step i). The weights and scales of step s + DEPTH are loaded into the ring
// slot that step s has just used, so DEPTH steps of loads are in flight while the warp computes.
// Plan P: ngroups, nq, xs (current group's x in shared memory), active (compute this group),
// rows(g, Rows&) (prefetch side, called once per group in order), stage() (once, by every
// thread of the CTA, after the first loads are issued), begin(g), finish(g, acc).
template <int KPL, int NRM, int DEPTH, bool NV, bool XF, class P>
DEV void fp4_stream(P& pl) {
    constexpr int NSC = NV ? 2 : 1;
    constexpr int U = DEPTH > KPL ? DEPTH : KPL;  // unroll: ring slot and chunk index compile-time
    static_assert(U % DEPTH == 0 && U % KPL == 0, "DEPTH and KPL must be powers of two");
    const int lane = threadIdx.x & 31;
    const int nq = pl.nq;
    const int S = pl.ngroups * KPL;
    const u32 b = lut_base();
    uint4 rw[DEPTH][NRM];
    u32 rs[DEPTH][NRM][NSC];
    Rows<NRM> pr;
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        if (d % KPL == 0 && d < S) pl.rows(d / KPL, pr);
        fetch<NRM, NV>(rw[d], rs[d], pr, d % KPL, d < S && lane + 32 * (d % KPL) < nq);
    }
    pl.stage();  // x / h to shared memory (+ __syncthreads) while the first loads are in flight
    float acc[NRM];
    for (int s0 = 0; s0 < S; s0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u;
            if (s >= S) break;  // warp-uniform
            const int i = u % KPL, d = u % DEPTH;
            const int g = s / KPL;
            if (i == 0) {
                pl.begin(g);
#pragma unroll
                for (int m = 0; m < NRM; ++m) acc[m] = 0.0f;
            }
            if (pl.active)  // warp-uniform
                chunk_dots<NRM, NV, XF>(rw[d], rs[d], static_cast<const char*>(pl.xs) + 16 * ((XF ? 256 : 128) * i + lane), b,
                                        lane + 32 * i < nq, acc);
            if (s + DEPTH < S) {
                const int ip = (u + DEPTH) % KPL;
                if (ip == 0) pl.rows((s + DEPTH) / KPL, pr);
                fetch<NRM, NV>(rw[d], rs[d], pr, ip, lane + 32 * ip < nq);
            }
            if (i == KPL - 1) pl.finish(g, acc);
        }
    }
}

// ------------------------------------------------------------------ full-shape fast paths
// gemv_*_gateup_k4_f and gemv_*_down_combine_k2_f: the Flash shapes the decode step always
// launches (gate/up K = 4096, down K = 2048: nq = 32 KPL, every lane owns KPL chunks; O a
// multiple of R: every row of every group exists; down: k even, so a loop trip of 2 picks never
// passes the end of the stream). ops/experts.py picks them only for such shapes. THE SAME ROW
// ARITHMETIC as fp4_stream: the same chunk_dots per (chunk, rows) in the same order (qok = true:
// every lane folds), the same warp_sum / round / epilogue through the same plan's finish (gate/
// up) or the same expressions (down); only the bookkeeping differs: no per-load predicates or
// zero fills (fetch), one base pointer per matrix with the rows and chunks at immediate offsets
// (K is a compile-time constant: row stride 512 KPL bytes, scale row stride (NV ? 64 : 32) KPL),
// advanced by a per-warp constant per group instead of recomputed from (g, O, K), and a loop of
// whole groups (gate/up) or whole pick pairs (down) instead of a step loop with a runtime end
// test. Same bits by construction; tests/gpu/test_kernels_experts.py (full_path) compares them.

// the block scale(s) of chunk step i of one row whose scale bytes for this lane start at p
// (MXFP4: one e8m0 byte per 32-element chunk; NVFP4: two e4m3 bytes), unpredicated: the full-shape
// paths' loads (fetch_full, fp4_stream_gateup_ring)
template <bool NV>
DEV void chunk_scales(u32 (&s)[NV ? 2 : 1], const u8* p, int i) {
    if (NV) {
        s[0] = ldg_weight_u8(p + 64 * i);
        s[NV ? 1 : 0] = ldg_weight_u8(p + 64 * i + 1);
    } else {
        s[0] = ldg_weight_u8(p + 32 * i);
    }
}

// the loads of chunk lane + 32 i of R consecutive rows of each of M matrices: pw[m] / ps[m] point
// at this lane's chunk 0 / scale byte of the first row; no predicates (every row and chunk exists)
template <int KPL, int M, int R, bool NV>
DEV void fetch_full(uint4 (&w)[M * R], u32 (&s)[M * R][NV ? 2 : 1], const u8* const (&pw)[M],
                    const u8* const (&ps)[M], int i) {
    constexpr int HK = 512 * KPL, NS = (NV ? 64 : 32) * KPL;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            w[m * R + rr] = ldg_weight16(pw[m] + rr * HK + 512 * i);
            chunk_scales<NV>(s[m * R + rr], ps[m] + rr * NS, i);
        }
    }
}

// gate/up over whole row groups (KPL chunk steps each); ring of DEPTH steps as fp4_stream (the
// steps past a group's end prefetch the next group's first chunks, if it has one)
template <int KPL, int DEPTH, bool NV, class P>
DEV void fp4_stream_gateup_full(P& pl) {
    constexpr int R = P::RG, NRM = 2 * R, NSC = NV ? 2 : 1;
    constexpr int HK = 512 * KPL, NS = (NV ? 64 : 32) * KPL;
    static_assert(DEPTH <= KPL && KPL % DEPTH == 0, "full path: DEPTH divides KPL");
    const int lane = threadIdx.x & 31;
    const int ng = pl.ngroups;
    const u32 b = lut_base();
    const i64 o0 = pl.row0(0, R);
    const u8* pw[2] = {pl.w1 + o0 * HK + 16 * lane, pl.w3 + o0 * HK + 16 * lane};
    const u8* ps[2] = {pl.s1 + o0 * NS + NSC * lane, pl.s3 + o0 * NS + NSC * lane};
    const i64 gw = (i64)pl.NW * R * HK, gs = (i64)pl.NW * R * NS;  // bytes from one group to the next
    uint4 rw[DEPTH][NRM];
    u32 rs[DEPTH][NRM][NSC];
    if (ng > 0) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) fetch_full<KPL, 2, R, NV>(rw[d], rs[d], pw, ps, d);
    }
    pl.stage();  // x to shared memory (+ __syncthreads) while the first loads are in flight
    const char* xq = static_cast<const char*>(pl.xs) + 16 * lane;
    for (int g = 0; g < ng; ++g) {
        float acc[NRM];
#pragma unroll
        for (int m = 0; m < NRM; ++m) acc[m] = 0.0f;
        const bool next = g + 1 < ng;  // warp-uniform
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            const int d = i % DEPTH;
            chunk_dots<NRM, NV, true>(rw[d], rs[d], xq + 16 * 256 * i, b, true, acc);
            if (i + DEPTH < KPL) {
                fetch_full<KPL, 2, R, NV>(rw[d], rs[d], pw, ps, i + DEPTH);
            } else {
                if (i + DEPTH == KPL) {
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        pw[m] += gw;
                        ps[m] += gs;
                    }
                }
                if (next) fetch_full<KPL, 2, R, NV>(rw[d], rs[d], pw, ps, i + DEPTH - KPL);
            }
        }
        pl.finish(g, acc);
    }
}

// gate/up over whole row groups as fp4_stream_gateup_full, with the weight ring in shared memory
// (gemv_*_gateup_k4_r: "ring"): this warp's KPL x 2R x 32 16-byte words, slot (i, m) = chunk step
// i of row m (ring + (i 2R + m) 32 + lane: each lane reads back the 16 bytes it copied, a warp's
// 32 words are consecutive: no bank conflicts), filled by cp.async one whole group ahead (KPL
// steps in flight instead of the register ring's DEPTH = 2, without its 8 x 4 registers per step:
// Nsight Compute at 53f6985 put "long scoreboard" at 1.22 of the 5.3 cycles between a warp's
// issues).  The scales stay in a register ring of the same depth (one byte per lane and row).
// THE SAME ARITHMETIC: chunk_dots on the same words and scales, the same finish; only where the
// weights wait differs.  One commit group per chunk step, empty when there is no next group, so
// that before step i the wait is always "at most KPL - 1 newer groups pending".  The cp.async and
// the wait carry "memory" clobbers: the compiler must not move the ring's LDS above the wait, nor
// a slot's LDS below the cp.async that refills it.
DEV void ring_cp16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
DEV void ring_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
DEV void ring_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <int KPL, bool NV>
__host__ __device__ constexpr int gateup_ring_bytes() { return KPL * 2 * FP4_GU_R * 32 * 16 * FP4_WARPS; }

template <int KPL, bool NV, class P>
DEV void fp4_stream_gateup_ring(P& pl, uint4* ring) {
    constexpr int R = P::RG, NRM = 2 * R, NSC = NV ? 2 : 1;
    constexpr int HK = 512 * KPL, NS = (NV ? 64 : 32) * KPL;
    const int lane = threadIdx.x & 31;
    const int ng = pl.ngroups;
    const u32 b = lut_base();
    const i64 o0 = pl.row0(0, R);
    const u8* pw[2] = {pl.w1 + o0 * HK + 16 * lane, pl.w3 + o0 * HK + 16 * lane};
    const u8* ps[2] = {pl.s1 + o0 * NS + NSC * lane, pl.s3 + o0 * NS + NSC * lane};
    const i64 gw = (i64)pl.NW * R * HK, gs = (i64)pl.NW * R * NS;  // bytes from one group to the next
    uint4* wr = ring + (threadIdx.x >> 5) * (KPL * NRM * 32) + lane;  // this lane's word of slot (0, 0)
    u32 rs[KPL][NRM][NSC];
    // chunk step i of the group at pw / ps: weights into ring slots (i, *), scales into rs[i]
    auto issue = [&](int i) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
                ring_cp16(wr + (i * NRM + m * R + rr) * 32, pw[m] + rr * HK + 512 * i);
                chunk_scales<NV>(rs[i][m * R + rr], ps[m] + rr * NS, i);
            }
        }
    };
    if (ng > 0) {
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            issue(i);
            ring_commit();
        }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        pw[m] += gw;
        ps[m] += gs;
    }
    pl.stage();  // x to shared memory (+ __syncthreads) while the first group's loads are in flight
    const char* xq = static_cast<const char*>(pl.xs) + 16 * lane;
    for (int g = 0; g < ng; ++g) {
        float acc[NRM];
#pragma unroll
        for (int m = 0; m < NRM; ++m) acc[m] = 0.0f;
        const bool next = g + 1 < ng;  // warp-uniform
#pragma unroll
        for (int i = 0; i < KPL; ++i) {
            ring_wait<KPL - 1>();  // step i's group: KPL - 1 newer ones may still be in flight
            uint4 w[NRM];
#pragma unroll
            for (int m = 0; m < NRM; ++m) w[m] = wr[(i * NRM + m) * 32];
            u32 sc[NRM][NSC];
#pragma unroll
            for (int m = 0; m < NRM; ++m)
#pragma unroll
                for (int c = 0; c < NSC; ++c) sc[m][c] = rs[i][m][c];
            if (next) issue(i);  // the next group's step i into the slots just read
            ring_commit();
            chunk_dots<NRM, NV, true>(w, sc, xq + 16 * 256 * i, b, true, acc);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            pw[m] += gw;
            ps[m] += gs;
        }
        pl.finish(g, acc);
    }
    ring_wait<0>();  // nothing of this warp's may land in shared memory after it exits
}

// down_combine over (row group, pick) in the order of fp4_stream (row group major, picks in
// ascending expert id), two picks (2 KPL steps) per loop trip (k even); the fetch side and the
// compute side each track their pick rank and row-group offset incrementally (no g / k, g % k).
// The ring and its fetch side are one object so that the first DEPTH steps can be issued (prime)
// before the kernel's PDL wait (FP4_DN_PRELOAD) and the stream continued after it (run).
template <int KPL, int DEPTH, bool NV, int R>
struct DownRing {
    static constexpr int NSC = NV ? 2 : 1;
    static constexpr int HK = 512 * KPL, NS = (NV ? 64 : 32) * KPL;
    static constexpr int U = 2 * KPL;  // steps per trip: two picks
    static_assert(DEPTH <= U && U % DEPTH == 0, "full path: DEPTH divides 2 KPL");
    uint4 rw[DEPTH][R];
    u32 rs[DEPTH][R][NSC];
    i64 fow, fos;  // fetch side: this lane's offsets into its row group
    int fr;        // fetch side: rank of the pick being loaded
    const u8* pw[1];
    const u8* ps[1];
    bool fa;
    template <class P>
    DEV void pick(const P& pl, int r) {  // the fetch side's pointers for rank r of its row group
        fa = __shfl_sync(0xffffffffu, pl.r_id, r) >= 0;
        pw[0] = reinterpret_cast<const u8*>(__shfl_sync(0xffffffffu, pl.r_w, r)) + fow;
        ps[0] = reinterpret_cast<const u8*>(__shfl_sync(0xffffffffu, pl.r_s, r)) + fos;
    }
    // the first DEPTH steps' loads (needs the plan's ranked picks: r_id, r_w, r_s)
    template <class P>
    DEV void prime(const P& pl) {
        const int lane = threadIdx.x & 31;
        const int S = pl.ngroups * KPL;  // pl.ngroups = row groups x k
        fow = pl.row0(0, R) * (i64)HK + 16 * lane;
        fos = pl.row0(0, R) * (i64)NS + NSC * lane;
        fr = 0;
        fa = false;
        if (S > 0) pick(pl, 0);
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int i = d % KPL;
            if (d > 0 && i == 0) {  // the next pick (DEPTH <= 2 KPL <= k KPL: same row group)
                ++fr;
                pick(pl, fr);
            }
            if (d < S && fa) fetch_full<KPL, 1, R, NV>(rw[d], rs[d], pw, ps, i);
        }
    }
    // every step, from the primed ring on (the x rows staged: pl.stage() before)
    template <class P>
    DEV void run(P& pl) {
        const int lane = threadIdx.x & 31;
        const int k = pl.k;
        const int S = pl.ngroups * KPL;
        const u32 b = lut_base();
        const i64 gw = (i64)pl.NW * R * HK, gs = (i64)pl.NW * R * NS;
        int cr = 0, rg = 0;  // compute side: rank, row group (of this warp)
        float acc[R];
        for (int s0 = 0; s0 < S; s0 += U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = u % KPL, d = u % DEPTH;
                if (i == 0) {
                    pl.begin_rank(cr);
#pragma unroll
                    for (int m = 0; m < R; ++m) acc[m] = 0.0f;
                }
                if (pl.active)  // warp-uniform
                    chunk_dots<R, NV, P::XF>(rw[d], rs[d], static_cast<const char*>(pl.xs) + 16 * ((P::XF ? 256 : 128) * i + lane), b,
                                             true, acc);
                if (s0 + u + DEPTH < S) {
                    const int ip = (u + DEPTH) % KPL;
                    if (ip == 0) {  // the fetch side moves to its next pick
                        if (++fr == k) {
                            fr = 0;
                            fow += gw;
                            fos += gs;
                        }
                        pick(pl, fr);
                    }
                    if (fa) fetch_full<KPL, 1, R, NV>(rw[d], rs[d], pw, ps, ip);
                }
                if (i == KPL - 1) {
                    // k even and two picks a trip from rank 0: the first pick of a trip has an even
                    // rank, so only the second can be the row group's last (FP4_XRED: the first
                    // one's last-pick block is left out; the same stores)
                    pl.finish_rank(cr, [rg] { return rg; }, acc, !FP4_XRED || u >= KPL);
                    if (++cr == k) {
                        cr = 0;
                        ++rg;
                    }
                }
            }
        }
    }
};

template <int KPL, int DEPTH, bool NV, class P>
DEV void fp4_stream_down_full(P& pl) {
    DownRing<KPL, DEPTH, NV, P::RG> ring;
    // _w2: the shared expert's w2 rows of this warp first (with the ring's first loads in flight
    // beside them, ptxas spills: 8 + 4 chunks a trip on top of the ring's 48 registers)
    if constexpr (P::W2) pl.w2_rows();
    ring.prime(pl);
    pl.stage();  // the token's h rows to shared memory (+ __syncthreads)
    ring.run(pl);
}

DEV void init_lut() {
#if !FP4_EVEN_ON_ALU
    if (threadIdx.x < 16) fp4_lut[threadIdx.x] = e2m1_to_f32(threadIdx.x);
#endif
}

// x row (K bf16) -> shared memory, lane-interleaved so that the 32 lanes of a warp read 32
// consecutive 16-byte words (no bank conflicts). XF (f32, 4 elements per float4): part jj
// (elements 4 jj .. 4 jj + 3) of chunk q = l + 32 i at float4 index (8 i + jj) * 32 + l; else
// (bf16, 8 per uint4) part j at uint4 index (4 i + j) * 32 + l. Chunks q >= nq are zero.
template <int KPL, bool XF>
__host__ __device__ constexpr int staged_words() { return KPL * (XF ? 256 : 128); }  // 16-byte words per staged row

// nrows rows of K bf16 (row r at xr + r * ld) -> shared memory, row r from 16-byte word r * HW
// (HW = staged_words), each laid out as above. Every thread first issues up to STAGE_BATCH
// 16-byte loads, then converts and stores them, so the rows' L2 latency is paid once per batch
// rather than once per word (down_combine stages k rows: one word per thread and row).
// 256-thread CTAs (FP4_WARPS warps), as every launch of this file.
constexpr int STAGE_BATCH = 8;
template <int KPL, bool XF>
DEV void stage_rows(void* xs, const u16* xr, i64 ld, int nrows, int nq) {
    constexpr int WPR = KPL * 128, HW = staged_words<KPL, XF>(), NT = FP4_WARPS * 32;
    const int total = nrows * WPR;
    for (int base = threadIdx.x; base < total; base += STAGE_BATCH * NT) {
        uint4 v[STAGE_BATCH];
#pragma unroll
        for (int n = 0; n < STAGE_BATCH; ++n) {
            const int idx = base + n * NT, w = idx & (WPR - 1), r = idx / WPR;
            const int l = w & 31, j = (w >> 5) & 3, q = l + 32 * (w >> 7);
            v[n] = idx < total && q < nq ? ldg16(xr + r * ld + 32 * q + 8 * j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int n = 0; n < STAGE_BATCH; ++n) {
            const int idx = base + n * NT, w = idx & (WPR - 1), r = idx / WPR;
            if (idx >= total) break;
            const int l = w & 31, j = (w >> 5) & 3, i = w >> 7;
            if (XF) {
                float4* x4 = static_cast<float4*>(xs) + r * HW + (8 * i + 2 * j) * 32 + l;
                x4[0] = make_float4(even_x(bf16lo(v[n].x)), odd_x(bf16hi(v[n].x)), even_x(bf16lo(v[n].y)),
                                    odd_x(bf16hi(v[n].y)));
                x4[32] = make_float4(even_x(bf16lo(v[n].z)), odd_x(bf16hi(v[n].z)), even_x(bf16lo(v[n].w)),
                                     odd_x(bf16hi(v[n].w)));
            } else {
                static_cast<uint4*>(xs)[r * HW + w] = v[n];
            }
        }
    }
}

template <int R, int NRM, bool NV>
DEV void group_rows(Rows<NRM>& r, int m0, const u8* w, const u8* sc, int o0, int O, int half_k, int nsc) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        const int o = o0 + rr;
        r.w[m0 + rr] = w + (i64)o * half_k + 16 * lane;
        r.s[m0 + rr] = sc + (i64)o * nsc + (NV ? 2 : 1) * lane;
        if (o < O) r.ok |= 1u << (m0 + rr);
    }
}

// what every plan has: this warp's share of the rows and the current group's x
struct PlanBase {
    int ngroups, nq, gw, NW, O, half_k, nsc;
    bool active;
    const void* xs;
    DEV void setup(int O_, int K, bool nv, int R) {
        nq = K >> 5;
        gw = blockIdx.x * FP4_WARPS + (threadIdx.x >> 5);
        NW = gridDim.x * FP4_WARPS;
        O = O_;
        half_k = K >> 1;
        nsc = nv ? K >> 4 : K >> 5;
        const int RG = (O + R - 1) / R;
        ngroups = gw < RG ? (RG - 1 - gw) / NW + 1 : 0;
        active = true;
    }
    DEV int row0(int g, int R) const { return (gw + NW * g) * R; }
    // the rows of an empty slot (expert < 0) are zeros
    DEV void write_zeros(u16* yr, int R) const {
        const int lane = threadIdx.x & 31;
        for (int g = 0; g < ngroups; ++g) {
            const int o = row0(g, R) + lane;
            if (lane < R && o < O) yr[o] = 0;
        }
    }
};

// Finished rows are kept one per lane (row n of the warp in lane n % 32) and stored 32 at a time,
// so an epilogue (bf16 rounding, the SwiGLU in double) runs lane-parallel instead of in lane 0.
struct Kept {
    float a, u;
    int o = -1;
    DEV void put(int n, float a_, float u_, int o_) {
        if ((int)(threadIdx.x & 31) == (n & 31)) {
            a = a_;
            u = u_;
            o = o_;
        }
    }
    DEV static bool flush_after(int n, bool last) { return (n & 31) == 31 || last; }
};

// y[slot, o] = bf16(W_e[o] . x[slot / x_div]); warp group = R rows
template <int KPL, int R, bool NV>
struct GemvPlan : PlanBase {
    const u8 *w, *sc;
    float s2;
    u16* yr;
#if FP4_XRED
    KeptX<R> kx;
#else
    Kept kept;
#endif
    const u16* xrow;
    DEV void stage() {
        stage_rows<KPL, true>(const_cast<void*>(xs), xrow, 0, 1, nq);
        __syncthreads();
    }
    DEV void rows(int g, Rows<R>& r) {
        r.ok = 0;
        group_rows<R, R, NV>(r, 0, w, sc, row0(g, R), O, half_k, nsc);
    }
    DEV void begin(int) {}
    DEV void finish(int g, float (&acc)[R]) {
        const int o0 = row0(g, R);
#if FP4_XRED
        kx.put(g, warp_sum_rows<R>(acc), 0.0f, o0);
        if (KeptX<R>::flush_after(g, g == ngroups - 1)) {
            if (kx.o >= 0 && kx.o < O) yr[kx.o] = (u16)f32_to_bf16(times_ws2<NV>(kx.a, s2));
            kx.o = -1;
        }
#else
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            const int n = g * R + rr;
            kept.put(n, row_total<NV>(acc[rr], s2), 0.0f, o0 + rr);
            if (Kept::flush_after(n, g == ngroups - 1 && rr == R - 1)) {
                if (kept.o >= 0 && kept.o < O) yr[kept.o] = (u16)f32_to_bf16(kept.a);
                kept.o = -1;
            }
        }
#endif
    }
};

template <int KPL, bool NV>
DEV void gemv_fp4_body(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,
                       const u64* __restrict__ wptr, const u64* __restrict__ sptr,
                       const float* __restrict__ ws2, u16* __restrict__ y, int ld_y, int O, int K) {
    constexpr int R = FP4_GV_R;
    __shared__ float4 xs[staged_words<KPL, true>()];
    const i64 slot = blockIdx.y;
    GemvPlan<KPL, R, NV> pl;
    pl.setup(O, K, NV, R);
    pl.yr = y + slot * ld_y;
    const int e = __ldg(expert_ids + slot);
    if (e < 0) {
        pl.write_zeros(pl.yr, R);
        return;
    }
    init_lut();
    pl.w = reinterpret_cast<const u8*>(__ldg(wptr + e));
    pl.sc = reinterpret_cast<const u8*>(__ldg(sptr + e));
    pl.s2 = NV ? __ldg(ws2 + e) : 1.0f;
    pl.xs = xs;
    pl.xrow = x + (slot / x_div) * (i64)K;
    fp4_stream<KPL, R, FP4_DEPTH, NV, true>(pl);
}

// Fused gate/up GEMVs + clamped SwiGLU: h[s, o] = swiglu(bf16(W1 x), bf16(W3 x)) with the routing
// weight of slot s; warp group = R rows of both matrices (ring rows 0..R-1: W1, R..2R-1: W3).
template <int KPL, int R, bool NV>
struct GateUpPlan : PlanBase {
    static constexpr int RG = R;  // rows per group (of each matrix)
    const u8 *w1, *w3, *s1, *s3;
    float a2, u2, ws;
    bool weighted;
    double limit;
    u16* hr;
#if FP4_XRED
    KeptX<R> kx;
#else
    Kept kept;
#endif
    const u16* xrow;
    DEV void stage() {
        stage_rows<KPL, true>(const_cast<void*>(xs), xrow, 0, 1, nq);
        __syncthreads();
    }
    DEV void rows(int g, Rows<2 * R>& r) {
        r.ok = 0;
        group_rows<R, 2 * R, NV>(r, 0, w1, s1, row0(g, R), O, half_k, nsc);
        group_rows<R, 2 * R, NV>(r, R, w3, s3, row0(g, R), O, half_k, nsc);
    }
    DEV void begin(int) {}
    DEV void finish(int g, float (&acc)[2 * R]) {
        const int o0 = row0(g, R);
#if FP4_XRED
        // rows in the order a_0, u_0, a_1, u_1, ...: row 2 rr + 1 (u_rr) is on the lanes xor
        // 16 / R from row 2 rr's (a_rr), so one more shuffle gives every lane both of its row rr
        float v[2 * R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            v[2 * rr] = acc[rr];
            v[2 * rr + 1] = acc[R + rr];
        }
        const float t = warp_sum_rows<2 * R>(v), p = __shfl_xor_sync(0xffffffffu, t, 16 / R);
        const bool is_u = (threadIdx.x & (16 / R)) != 0;
        kx.put(g, sel(is_u, p, t), sel(is_u, t, p), o0);
        if (KeptX<R>::flush_after(g, g == ngroups - 1)) {
            if (kx.o >= 0 && kx.o < O)
                hr[kx.o] = (u16)f32_to_bf16(swiglu_value(round_bf16(times_ws2<NV>(kx.a, a2)),
                                                         round_bf16(times_ws2<NV>(kx.u, u2)), ws, weighted, limit));
            kx.o = -1;
        }
#else
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            const int n = g * R + rr;
            kept.put(n, round_bf16(row_total<NV>(acc[rr], a2)), round_bf16(row_total<NV>(acc[R + rr], u2)), o0 + rr);
            if (Kept::flush_after(n, g == ngroups - 1 && rr == R - 1)) {
                if (kept.o >= 0 && kept.o < O)
                    hr[kept.o] = (u16)f32_to_bf16(swiglu_value(kept.a, kept.u, ws, weighted, limit));
                kept.o = -1;
            }
        }
#endif
    }
};

template <int KPL, bool NV, bool FULL, bool RING = false>
DEV void gemv_fp4_gateup_body(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,
                              const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr,
                              const float* __restrict__ ws2_1, const u64* __restrict__ w3ptr,
                              const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3,
                              const float* __restrict__ weight, double limit, u16* __restrict__ h,
                              int ld_h, int O, int K) {
    constexpr int R = FP4_GU_R;
    __shared__ float4 xs[staged_words<KPL, true>()];
    const i64 slot = blockIdx.y;
    GateUpPlan<KPL, R, NV> pl;
    pl.setup(O, K, NV, R);
    pl.hr = h + slot * ld_h;
    const int e = __ldg(expert_ids + slot);
    if (e < 0) {
        pl.write_zeros(pl.hr, R);
        return;
    }
    init_lut();
    pl.w1 = reinterpret_cast<const u8*>(__ldg(w1ptr + e));
    pl.w3 = reinterpret_cast<const u8*>(__ldg(w3ptr + e));
    pl.s1 = reinterpret_cast<const u8*>(__ldg(s1ptr + e));
    pl.s3 = reinterpret_cast<const u8*>(__ldg(s3ptr + e));
    pl.a2 = NV ? __ldg(ws2_1 + e) : 1.0f;
    pl.u2 = NV ? __ldg(ws2_3 + e) : 1.0f;
    pl.weighted = weight != nullptr;
    pl.ws = pl.weighted ? __ldg(weight + slot) : 1.0f;
    pl.limit = limit;
    pl.xs = xs;
    pl.xrow = x + (slot / x_div) * (i64)K;
    if constexpr (RING) {
        static_assert(FULL, "the ring path is a full-shape path");
        extern __shared__ uint4 gateup_ring[];  // [FP4_WARPS][KPL][2R][32] (gateup_ring_bytes)
        fp4_stream_gateup_ring<KPL, NV>(pl, gateup_ring);
    } else if constexpr (FULL) {
        fp4_stream_gateup_full<KPL, FP4_DEPTH, NV>(pl);
    } else {
        fp4_stream<KPL, 2 * R, FP4_DEPTH, NV, true>(pl);
    }
}

// Fused down GEMV + MoE combine: for token t with picks j = 0..k-1 (slot t*k + j, expert
// ids[t, j]), y[t, o] = bf16( (0 + sum over picks in ascending expert id (stable) of
// bf16(W2_e[o] . h[slot])) + shared[t, o] ). A warp takes R rows and walks the token's picks in
// that order (group g = row group g / k, pick rank g % k), summing the rounded pick values.
// Every warp ranks the picks itself (lane j: pick j; lane r then holds the pick of rank r), so the
// first weight loads wait for no barrier. The token's k rows of h are staged in (dynamic) shared
// memory: as f32 for KPL <= 2, as bf16 for KPL = 4 (k * 64 KB of f32 would not fit).
template <int KPL, int R, bool NV, bool W2_ = false>
struct DownPlan : PlanBase {
    static constexpr bool XF = KPL <= 2;
    static constexpr bool W2 = W2_;                      // _w2: the shared expert's w2 rows here
    static constexpr int HW = staged_words<KPL, XF>();  // 16-byte words per staged h row
    static constexpr int RG = R;                         // rows per group
    int k;
    int r_id, r_order;   // this lane's rank r = lane: expert id, pick index
    u64 r_w, r_s;        // and its weight / scale bases
    float r_ws2;
    uint4* hs;           // [k][HW] staged h rows (pick index order)
    const u16* ht;       // the token's h rows
    float s2;
#if FP4_XRED
    float combx;         // the sum of the picks so far of this lane's row (KeptX<R>::row())
    KeptX<R> kx;
#else
    float comb[R];
    Kept kept;
#endif
    const u16* sh;       // shared-expert row or null
    u16* yr;
    // _w2 (W2): the shared expert's w2 [O, DOWN_W2_K] bf16 and this token's input row sh_h
    // [DOWN_W2_K] bf16; w2s: this CTA's bf16(w2 row . sh_h) in shared memory, row rr of this
    // warp's row group rg at ((rg FP4_WARPS + warp) R + rr): what gemv_bf16 stores into `shared`
    // (f32_to_bf16 of the same row dot), added in the epilogue as _k2_f adds shared[o]
    const u16* w2;
    const u16* shx;
    u16* w2s;
    DEV int w2s_at(int rg, int rr) const { return (rg * FP4_WARPS + (int)(threadIdx.x >> 5)) * R + rr; }
    // every row group of this warp (before the stream's first loads: nothing else is live)
    DEV void w2_rows() {
        const int lane = threadIdx.x & 31, nrg = ngroups / k;
        for (int rg = 0; rg < nrg; ++rg) {
            const u16* wr[R];
#pragma unroll
            for (int rr = 0; rr < R; ++rr) wr[rr] = w2 + (i64)(row0(rg, R) + rr) * DOWN_W2_K;
            float d[R];
            bf16_rows_dot_k<R, DOWN_W2_K>(wr, shx, lane, d);
#pragma unroll
            for (int rr = 0; rr < R; ++rr)
                if (lane == rr) w2s[w2s_at(rg, rr)] = (u16)f32_to_bf16(d[rr]);
        }
        __syncwarp();
    }
    // FP4_DN_PRELOAD >= 2: this warp's first row group's trip-0 w2 chunks in shared memory
    // (chunk c = lane + 32 u of row rr at [(rr GEMV_UNROLL + u) 32 + lane], each lane's own
    // cp.async), or null
    const uint4* w2pre;
    // w2_rows with the weight ring already primed (FP4_DN_PRELOAD): bf16_rows_dot_k_by (the same
    // arithmetic, so the same bits) one trip at a time, so that a trip's 4 R + 4 chunks fit beside
    // the ring's registers; trip 0 of row group 0 from w2pre when set (each lane reads only what
    // its own cp.async wrote: no barrier)
    DEV void w2_rows_pre() {
        const int lane = threadIdx.x & 31, nrg = ngroups / k;
        for (int rg = 0; rg < nrg; ++rg) {
            const u16* wr[R];
#pragma unroll
            for (int rr = 0; rr < R; ++rr) wr[rr] = w2 + (i64)(row0(rg, R) + rr) * DOWN_W2_K;
            const bool pre = rg == 0 && w2pre != nullptr;   // warp-uniform
            const uint4* w2p = w2pre;
            auto trip_w = [&](int t, int c, uint4 (&w)[R][GEMV_UNROLL]) {
                if (t == 0 && pre) {
                    cp_async_wait<0>();
#pragma unroll
                    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
                        for (int rr = 0; rr < R; ++rr) w[rr][u] = w2p[(rr * GEMV_UNROLL + u) * 32 + lane];
                } else {
                    Bf16RowsGlobal<R>{wr}(t, c, w);
                }
            };
            float d[R];
            bf16_rows_dot_k_by<R, DOWN_W2_K, 1>(trip_w, Bf16XGlobal{shx}, lane, d);
#pragma unroll
            for (int rr = 0; rr < R; ++rr)
                if (lane == rr) w2s[w2s_at(rg, rr)] = (u16)f32_to_bf16(d[rr]);
        }
        __syncwarp();
    }
    DEV void stage() {
#if !(FP4_DIAG_DOWN & 1)  // TIMING ONLY when set: the h rows are not staged (see FP4_DIAG_DOWN)
        stage_rows<KPL, XF>(hs, ht, (i64)(half_k * 2), k, nq);
#endif
        __syncthreads();
    }
    DEV void rows(int g, Rows<R>& r) {
        const int rank = g % k;
        r.ok = 0;
        const int e = __shfl_sync(0xffffffffu, r_id, rank);
        const u64 w = __shfl_sync(0xffffffffu, r_w, rank), sc = __shfl_sync(0xffffffffu, r_s, rank);
        if (e >= 0)
            group_rows<R, R, NV>(r, 0, reinterpret_cast<const u8*>(w), reinterpret_cast<const u8*>(sc),
                                 row0(g / k, R), O, half_k, nsc);
    }
    DEV void begin(int g) { begin_rank(g % k); }
    DEV void finish(int g, float (&acc)[R]) {
        finish_rank(g % k, [&] { return g / k; }, acc);
    }
    // the pick of rank `rank` starts / ends (its row group of this warp: rg_of(), evaluated only
    // after the last pick, as the general path's g / k was)
    DEV void begin_rank(int rank) {
        active = __shfl_sync(0xffffffffu, r_id, rank) >= 0;
        xs = hs + __shfl_sync(0xffffffffu, r_order, rank) * HW;
        s2 = NV ? __shfl_sync(0xffffffffu, r_ws2, rank) : 1.0f;
        if (rank == 0) {
#if FP4_XRED
            combx = 0.0f;
#else
#pragma unroll
            for (int rr = 0; rr < R; ++rr) comb[rr] = 0.0f;
#endif
        }
    }
    // (may_be_last = false: the caller knows rank < k - 1)
    template <class RG_OF>
    DEV void finish_rank(int rank, RG_OF rg_of, float (&acc)[R], bool may_be_last = true) {
#if FP4_XRED
        // the pick's R row totals at once; this lane's row's into its sum (the same sum per row)
        const float t = warp_sum_rows<R>(acc);
        combx = __fadd_rn(combx, active ? round_bf16(times_ws2<NV>(t, s2)) : 0.0f);
        if (may_be_last && rank == k - 1) {
            const int rg = rg_of(), nrg = ngroups / k;
            kx.put(rg, combx, W2 ? bf16_to_f32(w2s[w2s_at(rg, KeptX<R>::row())]) : 0.0f, row0(rg, R));
            if (KeptX<R>::flush_after(rg, rg == nrg - 1)) {
                const int o = kx.o;
                if (o >= 0 && o < O) {
                    float v = kx.a;
                    if constexpr (W2) v = __fadd_rn(v, kx.u);  // kx.u = bf16_to_f32(shared[o])
                    else if (sh != nullptr) v = __fadd_rn(v, bf16_to_f32(__ldg(sh + o)));
                    yr[o] = (u16)f32_to_bf16(v);
                }
                kx.o = -1;
            }
        }
#else
#pragma unroll
        for (int rr = 0; rr < R; ++rr)  // an empty pick contributes the zero row of gemv()
            comb[rr] = __fadd_rn(comb[rr], active ? round_bf16(row_total<NV>(acc[rr], s2)) : 0.0f);
        if (rank == k - 1) {
            const int rg = rg_of(), o0 = row0(rg, R), nrg = ngroups / k;
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
                const int n = rg * R + rr;
                kept.put(n, comb[rr], W2 ? bf16_to_f32(w2s[w2s_at(rg, rr)]) : 0.0f, o0 + rr);
                if (Kept::flush_after(n, rg == nrg - 1 && rr == R - 1)) {
                    const int o = kept.o;
                    if (o >= 0 && o < O) {
                        float v = kept.a;
                        if constexpr (W2) v = __fadd_rn(v, kept.u);
                        else if (sh != nullptr) v = __fadd_rn(v, bf16_to_f32(__ldg(sh + o)));
                        yr[o] = (u16)f32_to_bf16(v);
                    }
                    kept.o = -1;
                }
            }
        }
#endif
    }
};

// The token's k picks ranked by expert id, stable (lane j: pick j; rank = #{i: e_i < e_j} +
// #{i < j: e_i == e_j}), then lane r <- the pick of rank r: its expert id, pick index and table
// entries (pl.r_*).  CG: the ids through L2 (ld.cg; the preload form reads them before the PDL
// wait, where a line the SM's L1 kept from an earlier reader of the buffer could be stale).
template <bool CG, bool NV, class P>
DEV void rank_picks(P& pl, const int* __restrict__ ids, int k, const u64* __restrict__ wptr,
                    const u64* __restrict__ sptr, const float* __restrict__ ws2) {
    const int lane = threadIdx.x & 31;
    const int ej = lane < k ? (CG ? __ldcg(ids + lane) : __ldg(ids + lane)) : 0x7fffffff;
    int rank = 0;
    for (int i = 0; i < k; ++i) {
        const int ei = __shfl_sync(0xffffffffu, ej, i);
        rank += (ei < ej || (ei == ej && i < lane)) ? 1 : 0;
    }
    int id = 0x7fffffff, order = 0;
    for (int j = 0; j < k; ++j) {
        const int rj = __shfl_sync(0xffffffffu, rank, j), e = __shfl_sync(0xffffffffu, ej, j);
        if (lane == rj) {
            id = e;
            order = j;
        }
    }
    pl.r_id = id;
    pl.r_order = order;
    const bool have = lane < k && id >= 0;
#if FP4_DIAG_DOWN & 2  // TIMING ONLY: the table entries of pick lane, not of the ranked id
    pl.r_w = lane < k ? __ldg(wptr + lane) : 0ull;
    pl.r_s = lane < k ? __ldg(sptr + lane) : 0ull;
#else
    pl.r_w = have ? __ldg(wptr + id) : 0ull;
    pl.r_s = have ? __ldg(sptr + id) : 0ull;
#endif
    pl.r_ws2 = NV && have ? __ldg(ws2 + id) : 1.0f;
}

template <int KPL, bool NV, bool FULL, bool W2 = false>
DEV void gemv_fp4_down_combine_body(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,
                                    const u64* __restrict__ wptr, const u64* __restrict__ sptr,
                                    const float* __restrict__ ws2, const u16* __restrict__ shared,
                                    u16* __restrict__ y, int ld_y, int O, int K,
                                    const u16* __restrict__ w2 = nullptr, const u16* __restrict__ shx = nullptr) {
    static_assert(!W2 || FULL, "_w2: the full-shape path only");
    constexpr int R = FP4_DN_R;
    extern __shared__ uint4 hs[];  // [k][DownPlan::HW]
    const i64 t = blockIdx.y;
    const int lane = threadIdx.x & 31;
    init_lut();
    DownPlan<KPL, R, NV, W2> pl;
    pl.setup(O, K, NV, R);
    pl.ngroups *= k;
    pl.k = k;
    rank_picks<false, NV>(pl, expert_ids + t * k, k, wptr, sptr, ws2);
    pl.hs = hs;
    pl.ht = h + t * k * (i64)K;
    pl.sh = shared != nullptr ? shared + t * O : nullptr;
    pl.yr = y + t * ld_y;
    if constexpr (W2) {
        pl.w2 = w2;
        pl.shx = shx + t * DOWN_W2_K;
        pl.w2s = reinterpret_cast<u16*>(hs + k * DownPlan<KPL, R, NV, W2>::HW);  // after the h rows
    }
    if constexpr (FULL)
        fp4_stream_down_full<KPL, FP4_DN_DEPTH, NV>(pl);
    else
        fp4_stream<KPL, R, FP4_DN_DEPTH, NV, DownPlan<KPL, R, NV>::XF>(pl);
}

// The full-shape down + combine in two parts around the PDL wait (FP4_DN_PRELOAD >= 1): the
// plan, the ranked picks and the primed weight ring live in registers across the wait.  The same
// loads and the same row arithmetic as gemv_fp4_down_combine_body<2, NV, true, W2>, in another
// order: the ring's first steps (and with level 2 the first w2 trip) before the wait, the shared-
// w2 rows after it.
template <int KPL, bool NV, bool W2>
struct DownFullPre {
    static constexpr int R = FP4_DN_R;
    using Plan = DownPlan<KPL, R, NV, W2>;
    Plan pl;
    DownRing<KPL, FP4_DN_DEPTH, NV, R> ring;
    // before the wait: static weights, and the expert ids (common.cuh, PDL_ENTRY_PRELOAD)
    DEV void before_wait(const int* __restrict__ expert_ids, int k, const u64* __restrict__ wptr,
                         const u64* __restrict__ sptr, const float* __restrict__ ws2, int O, int K,
                         const u16* __restrict__ w2) {
        extern __shared__ uint4 hs[];  // [k][HW] h rows, the w2 row values, the w2 preload
        init_lut();
        pl.setup(O, K, NV, R);
        pl.ngroups *= k;
        pl.k = k;
        if constexpr (W2) {
            pl.w2 = w2;
            pl.w2pre = nullptr;
#if FP4_DN_PRELOAD >= 2
            if (pl.ngroups > 0) {  // the warp's first row group: R rows x their first 1024 bf16
                // behind the h rows and the w2 row values (ops/experts.py down_w2_smem's bytes)
                const int groups = (O + R - 1) / R, nwarps = gridDim.x * FP4_WARPS;
                const int w2s_words = (2 * R * FP4_WARPS * ((groups + nwarps - 1) / nwarps) + 15) / 16;
                uint4* dst = hs + k * Plan::HW + w2s_words + (threadIdx.x >> 5) * (R * GEMV_UNROLL * 32);
                const int lane = threadIdx.x & 31;
#pragma unroll
                for (int rr = 0; rr < R; ++rr)
#pragma unroll
                    for (int u = 0; u < GEMV_UNROLL; ++u)
                        cp_async16_stream(dst + (rr * GEMV_UNROLL + u) * 32 + lane,
                                          w2 + (i64)(pl.row0(0, R) + rr) * DOWN_W2_K + (i64)(lane + 32 * u) * 8);
                cp_async_commit();
                pl.w2pre = dst;
            }
#endif
        }
        rank_picks<true, NV>(pl, expert_ids + (i64)blockIdx.y * k, k, wptr, sptr, ws2);
        ring.prime(pl);
        if (k < 0) __trap();  // never taken: ends the basic block, so ptxas keeps the wait below
    }
    // after the wait: the activations (h: the routed gate/up's output; shx / shared: the shared
    // expert's), the w2 rows, the staging, the stream
    DEV void after_wait(const u16* __restrict__ h, const u16* __restrict__ shared, u16* __restrict__ y,
                        int ld_y, int K, const u16* __restrict__ shx) {
        extern __shared__ uint4 hs[];
        const i64 t = blockIdx.y;
        pl.hs = hs;
        pl.ht = h + t * pl.k * (i64)K;
        pl.sh = shared != nullptr ? shared + t * pl.O : nullptr;
        pl.yr = y + t * ld_y;
        if constexpr (W2) {
            pl.shx = shx + t * DOWN_W2_K;
            pl.w2s = reinterpret_cast<u16*>(hs + pl.k * Plan::HW);  // after the h rows
            pl.w2_rows_pre();
        }
        pl.stage();  // the token's h rows to shared memory (+ __syncthreads)
        ring.run(pl);
    }
};

// The shared expert's SwiGLU inside the routed gate/up launch (gemv_*_gateup_k4_f_sh), computed
// BEFORE the PDL wait.  Why: the gate/up's predecessor is the router, whose ~7 us are mostly one
// CTA's selection; the routed gate/up cannot start before the ids exist, but the shared expert
// (2 x 2048 x 4096 bf16, 33.5 MB) needs only x, so its bytes can stream while the router runs
// instead of beside or after the issue-bound FP4 stream.  What it may read there (common.cuh,
// PDL_ENTRY_PRELOAD): its weights (static) and x, the ffn boundary's output, written two launches
// back (boundary -> router -> this launch), so final; x is read through L2 (__ldcg: an SM's L1
// could hold a line of the same buffer from an earlier layer's reader) into a shared-memory copy
// once per CTA.  Every store stays after the wait.  (A split, part of the rows after the warp's
// FP4 stream, measured slower at 50 and 75 % and cost the FP4_PRMT = 0 build 8 B of spills:
// removed, docs/decode_perf.md twentieth session.)
// THE ARITHMETIC of decode.cu's gemv_bf16_swiglu (warp_rows_dot, THE ORDER for K = 4096): per
// output o the W1 and W3 row dots by bf16_rows_dot_k_by (gemv_bf16_row.cuh), each rounded to bf16,
// then swiglu_value(g, u, 1, unweighted, limit) -> bf16; so the same bytes as that launch.
// Work: output o belongs to warp o mod NW of the whole grid (NW = every warp of every slot's CTAs:
// ~2112 warps on an H200 for 2048 outputs, so at most one per warp there); lane j keeps the warp's
// j-th value (ops/experts.py checks O_sh <= 32 NW).  Two trips in flight (TRIP_UNROLL 2: 64
// registers of weights); all four would not fit the 128-register budget.
constexpr int SH_SWIGLU_K = 4096;  // the full-shape gate/up's K (ops/experts.py GATEUP_FULL_K)
DEV int shared_swiglu_warp() { return (blockIdx.y * gridDim.x + blockIdx.x) * FP4_WARPS + (threadIdx.x >> 5); }
struct SharedSwigluPre {
    u32 kept;  // lane j: the bf16 bits of this warp's j-th output
    // The first W_sh warps of the grid (linear order: shared_swiglu_warp) carry the outputs, warp
    // w outputs w, w + W_sh, ...; the rest none.  Why not always every warp: the CTAs dispatched
    // last (the highest linear ids) may have to wait for SMs a concurrent kernel holds (the
    // router's cluster, MEMRA_DSV4_ROUTER_HANDOFF = cluster: 16 whole SMs), and a late CTA that
    // still has shared rows to stream before its wait starts its routed work last.  Which warp
    // computes an output does not change its bits.
    DEV void before_wait(const u16* __restrict__ x, const u16* __restrict__ w1, const u16* __restrict__ w3,
                         int O_sh, int W_sh, double limit) {
        __shared__ uint4 xsh[SH_SWIGLU_K / 8];  // x as bf16, 16-byte word c = chunk c
        for (int i = threadIdx.x; i < SH_SWIGLU_K / 8; i += FP4_WARPS * 32)
            xsh[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
        __syncthreads();
        const int lane = threadIdx.x & 31, w = shared_swiglu_warp();
        kept = 0u;
        int j = 0;
        for (int o = w; w < W_sh && o < O_sh; o += W_sh, ++j) {
            const u16* const rows[2] = {w1 + (i64)o * SH_SWIGLU_K, w3 + (i64)o * SH_SWIGLU_K};
            float d[2];
            bf16_rows_dot_k_by<2, SH_SWIGLU_K, 2>(Bf16RowsGlobal<2>{rows}, Bf16XShared{xsh}, lane, d);
            const u32 v = f32_to_bf16(swiglu_value(round_bf16(d[0]), round_bf16(d[1]), 1.0f, false, limit));
            if (lane == j) kept = v;
        }
        if (O_sh < 0) __trap();  // never taken: ends the basic block, so ptxas keeps the wait below
    }
    // after the wait: lane j stores the warp's j-th output
    DEV void after_wait(u16* __restrict__ sh, int O_sh, int W_sh) const {
        const int w = shared_swiglu_warp(), o = w + (int)(threadIdx.x & 31) * W_sh;
        if (w < W_sh && o < O_sh) sh[o] = (u16)kept;
    }
};

}  // namespace

// x: [n_x, K] bf16; x row of slot s = s / x_div; expert_ids: [n_slots] int32; wptr/sptr: u64 [E]
// device pointers to packed [O, K/2] and scales ([O, K/32] e8m0 | [O, K/16] e4m3); ws2: f32 [E]
// (NVFP4); y: [n_slots, ld_y] bf16. K % 32 == 0, K <= 1024*KPL. grid (nx, n_slots), block 256,
// any nx >= 1 (the warps of a slot's nx CTAs share its rows).
#define GEMV_FP4(NAME, KPL, NV)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         u16* __restrict__ y, int ld_y, int O, int K) { PDL_ENTRY();                                           \
        gemv_fp4_body<KPL, NV>(x, x_div, expert_ids, wptr, sptr, ws2, y, ld_y, O, K);             \
    }

GEMV_FP4(gemv_mxfp4_k1, 1, false)
GEMV_FP4(gemv_mxfp4_k2, 2, false)
GEMV_FP4(gemv_mxfp4_k4, 4, false)
GEMV_FP4(gemv_nvfp4_k1, 1, true)
GEMV_FP4(gemv_nvfp4_k2, 2, true)
GEMV_FP4(gemv_nvfp4_k4, 4, true)

// Fused MoE first half. x: [n_x, K] bf16 (slot s reads row s / x_div); expert_ids [S];
// w1ptr/s1ptr/ws2_1 and w3ptr/s3ptr/ws2_3: gate and up tables as in gemv_*; weight: [S] f32
// routing weights or null; limit <= 0: no clamp; h: [S, ld_h] bf16. grid (nx, S), block 256.
#define GEMV_FP4_GATEUP(NAME, KPL, NV, FULL)                                                       \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr, const float* __restrict__ ws2_1, \
         const u64* __restrict__ w3ptr, const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3, \
         const float* __restrict__ weight, double limit, u16* __restrict__ h, int ld_h, int O, int K) { PDL_ENTRY(); \
        gemv_fp4_gateup_body<KPL, NV, FULL>(x, x_div, expert_ids, w1ptr, s1ptr, ws2_1, w3ptr, s3ptr, ws2_3,  \
                                      weight, limit, h, ld_h, O, K);                              \
    }

GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k1, 1, false, false)
GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k2, 2, false, false)
GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k4, 4, false, false)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k1, 1, true, false)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k2, 2, true, false)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k4, 4, true, false)
// the full-shape fast paths (K = 4096, O % FP4_GU_R == 0; see fp4_stream_gateup_full): same bits
GEMV_FP4_GATEUP(gemv_mxfp4_gateup_k4_f, 4, false, true)
GEMV_FP4_GATEUP(gemv_nvfp4_gateup_k4_f, 4, true, true)
// the full shape with the weight ring in shared memory (fp4_stream_gateup_ring; same bits):
// dynamic shared memory gateup_ring_bytes<4>() = 64 KB (ops/experts.py GATEUP_RING_SMEM)
#define GEMV_FP4_GATEUP_RING(NAME, NV)                                                             \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr, const float* __restrict__ ws2_1, \
         const u64* __restrict__ w3ptr, const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3, \
         const float* __restrict__ weight, double limit, u16* __restrict__ h, int ld_h, int O, int K) { PDL_ENTRY(); \
        gemv_fp4_gateup_body<4, NV, true, true>(x, x_div, expert_ids, w1ptr, s1ptr, ws2_1, w3ptr, s3ptr, ws2_3, \
                                                weight, limit, h, ld_h, O, K);                    \
    }
GEMV_FP4_GATEUP_RING(gemv_mxfp4_gateup_k4_r, false)
GEMV_FP4_GATEUP_RING(gemv_nvfp4_gateup_k4_r, true)
// The full shape with the shared expert's SwiGLU in the same launch (the device step's
// MEMRA_DSV4_SHARED_GATEUP = on; SharedSwigluPre above): as _k4_f, plus sw1 / sw3: the shared
// expert's W1 / W3 as bf16 bits [O_sh, 4096], sh: [O_sh] bf16 out = swiglu(bf16(sw1 . x[0]),
// bf16(sw3 . x[0])) (clamped at sh_limit, no routing weight; x row 0: one token), the bytes of
// ops_decode.gemv_bf16_swiglu, computed before the PDL wait by the grid's first W_sh warps
// (SharedSwigluPre): O_sh <= 32 * W_sh, W_sh <= gridDim.x * gridDim.y * FP4_WARPS.  Grid and block as
// _k4_f; static shared memory 8 KB more (x as bf16).
#define GEMV_FP4_GATEUP_SH(NAME, NV)                                                               \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr, const float* __restrict__ ws2_1, \
         const u64* __restrict__ w3ptr, const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3, \
         const float* __restrict__ weight, double limit, u16* __restrict__ h, int ld_h, int O, int K, \
         const u16* __restrict__ sw1, const u16* __restrict__ sw3, u16* __restrict__ sh, int O_sh,  \
         int W_sh, double sh_limit) {                                                              \
        PDL_ENTRY_PRELOAD(SharedSwigluPre pre; pre.before_wait(x, sw1, sw3, O_sh, W_sh, sh_limit)); \
        pre.after_wait(sh, O_sh, W_sh);                                                            \
        gemv_fp4_gateup_body<4, NV, true>(x, x_div, expert_ids, w1ptr, s1ptr, ws2_1, w3ptr, s3ptr, ws2_3, \
                                          weight, limit, h, ld_h, O, K);                          \
    }
GEMV_FP4_GATEUP_SH(gemv_mxfp4_gateup_k4_f_sh, false)
GEMV_FP4_GATEUP_SH(gemv_nvfp4_gateup_k4_f_sh, true)

// Fused MoE second half. h: [T*k, K] bf16 (pick j of token t at row t*k + j, routing weight
// already applied); expert_ids [T, k] int32 (k <= 16); wptr/sptr/ws2: down tables; shared: [T, O]
// bf16 or null; y: [T, ld_y] bf16. grid (nx, T), block 256, dynamic shared memory for the
// token's h rows: k * KPL * 4096 bytes (KPL <= 2, staged as f32) or k * KPL * 2048 (KPL = 4, bf16).
#define GEMV_FP4_DOWN(NAME, KPL, NV, FULL)                                                         \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ shared, u16* __restrict__ y, int ld_y, int O, int K) { PDL_ENTRY();            \
        gemv_fp4_down_combine_body<KPL, NV, FULL>(h, expert_ids, k, wptr, sptr, ws2, shared, y, ld_y, O, K); \
    }

GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k1, 1, false, false)
GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k2, 2, false, false)
GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k4, 4, false, false)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k1, 1, true, false)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k2, 2, true, false)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k4, 4, true, false)
// the full-shape fast paths (K = 2048, O % FP4_DN_R == 0, k even; see fp4_stream_down_full): same bits
#if FP4_DN_PRELOAD
#define GEMV_FP4_DOWN_FULL(NAME, NV)                                                               \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ shared, u16* __restrict__ y, int ld_y, int O, int K) {           \
        PDL_ENTRY_PRELOAD(DownFullPre<2, NV, false> pre;                                           \
                          pre.before_wait(expert_ids, k, wptr, sptr, ws2, O, K, nullptr));         \
        pre.after_wait(h, shared, y, ld_y, K, nullptr);                                            \
    }
GEMV_FP4_DOWN_FULL(gemv_mxfp4_down_combine_k2_f, false)
GEMV_FP4_DOWN_FULL(gemv_nvfp4_down_combine_k2_f, true)
#else
GEMV_FP4_DOWN(gemv_mxfp4_down_combine_k2_f, 2, false, true)
GEMV_FP4_DOWN(gemv_nvfp4_down_combine_k2_f, 2, true, true)
#endif

// The full-shape down + combine with the shared expert's w2 GEMV folded in (the device step's
// MEMRA_DSV4_DECODE_SHARED_W2 = fused): instead of `shared`, w2: [O, 2048] bf16 bits (the shared
// expert's down projection) and shx: [T, 2048] bf16 (its SwiGLU output); each warp computes the
// w2 rows of its row group (gemv_bf16_row.cuh's bf16_rows_dot_k: decode.cu gemv_bf16's per-row
// arithmetic, THE ORDER for K = 2048) at the group's start and adds bf16(row dot) in the epilogue
// where _k2_f adds bf16_to_f32(shared[o]): the bytes of gemv_bf16(w2, shx) then _k2_f(shared).
// K = 2048, O % FP4_DN_R == 0, k even (as _k2_f); grid and block as _k2_f; dynamic shared memory:
// _k2_f's (k * 8192 bytes of h) plus the w2 row values, 2 * FP4_DN_R * FP4_WARPS * ceil(row groups /
// (gridDim.x FP4_WARPS)) bytes (ops/experts.py down_w2_smem).
#define GEMV_FP4_DOWN_W2(NAME, NV)                                                                 \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ w2, const u16* __restrict__ shx, u16* __restrict__ y, int ld_y, int O, \
         int K) { PDL_ENTRY();                                                                     \
        gemv_fp4_down_combine_body<2, NV, true, true>(h, expert_ids, k, wptr, sptr, ws2, nullptr, y, ld_y, O, \
                                                      K, w2, shx);                                 \
    }
#if FP4_DN_PRELOAD
// (MXFP4 only: the NVFP4 ring holds two scale words per row and slot, and with the w2 trip beside
// it ptxas spills 24-44 B at 128 registers; gemv_nvfp4_down_combine_k2_f_w2 keeps the level-0 form)
#define GEMV_FP4_DOWN_W2_PRE(NAME, NV)                                                             \
    extern "C" __global__ void __launch_bounds__(256, FP4_MINB)                                   \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ w2, const u16* __restrict__ shx, u16* __restrict__ y, int ld_y, int O, \
         int K) {                                                                                  \
        PDL_ENTRY_PRELOAD(DownFullPre<2, NV, true> pre;                                            \
                          pre.before_wait(expert_ids, k, wptr, sptr, ws2, O, K, w2));              \
        pre.after_wait(h, nullptr, y, ld_y, K, shx);                                               \
    }
GEMV_FP4_DOWN_W2_PRE(gemv_mxfp4_down_combine_k2_f_w2, false)
#else
GEMV_FP4_DOWN_W2(gemv_mxfp4_down_combine_k2_f_w2, false)
#endif
GEMV_FP4_DOWN_W2(gemv_nvfp4_down_combine_k2_f_w2, true)

// ==================================================================== tensor-core FP4 GEMVs (opt-in)
// gemv_{mx,nv}fp4_mma, gemv_{mx,nv}fp4_gateup_mma, gemv_{mx,nv}fp4_down_combine_mma: the same
// contracts and launch arguments as the _k* kernels above (selected by ops.experts impl="mma"),
// K % 128 == 0, K <= 4096, with the row dots on the tensor cores (mma.sync m16n8k16, f16 x f16
// -> f32). NOT bit-identical to the CUDA-core kernels (different f32 summation order and the
// tensor core's internal sums); bf16 class, bound in tests/gpu/test_kernels_experts.py.
// MEASURED (H200, 715d477, tools/bench_gemv.py --only-fp4 --fp4-mma): NOT faster than the _k*
// kernels (gate/up 31.0 vs 28.0 us, down 18.0 vs 18.3 us for 6 experts; PLACE=1 / DEPTH=4 no
// better), so the issue-rate argument below was not the limit: both forms stop at ~40-45 % of
// copy bandwidth. Kept opt-in as the measured alternative.
//
// WHY (the hypothesis it was written for): gemv_mxfp4_gateup_k4's loop issues 5.2 instructions per weight and lane (nvdisasm: 2659
// per 512; an FFMA per weight, the decode, LDS of the table and of x), 1.9 of them on the ALU pipe
// (LOP3 / PRMT / SHF, half rate), and runs at ~2x the HBM floor. Here a lane decodes 8 weights into
// four f16x2 with 11 ALU + 4 IMAD (shifts) and ONE mma takes them: 3.05 instructions per weight
// and lane (195 per 64-weight step, 8 HMMA), 1.9 on the ALU pipe -> ALU-bound at ~0.7x the issue
// time of the CUDA-core loop. FP4_MMA_PLACE=1 decodes with 8 ALU + 7 IMAD (1.5 ALU per weight,
// ~0.6x) if the tensor core takes f16 subnormals (test_mma_place_decode_variant decides).
//
// THE ROW ARITHMETIC (fixed by (o, K) alone: never by the slot count, k, nor the CTA shape):
//   * K is cut into steps of 128 and the steps into MMA_KS = 2 segments (segment ks: steps
//     [ks*nst/2, (ks+1)*nst/2), nst = K/128). A warp computes 16 rows x one segment.
//   * x of the segment is converted to f16 times 2^s, s = 142 - (biased exponent of max|x| over
//     the segment), clamped to [-126, 126], so max|x| 2^s lies in [2^15, 2^16): RN cvt, exact
//     for every element with |x| >= max|x| 2^-32; below that the error is <= max|x| 2^-40
//     (f16 subnormal quantum 2^-24 at scale 2^s); f32-subnormal x (bf16 subnormals) flush (-ftz).
//   * e2m1 -> f16 is exact (a PRMT table of the 8 magnitudes' high bytes; the low byte of each
//     is 0, the sign is ORed in), so every product w * x_f16 is exact inside the tensor core.
//   * A step is 8 mmas: lane (g = lane/4, t = lane%4) feeds rows g and g+8 from ITS 32-element
//     block (block t of the step, one 16-byte load per row = one MXFP4 scale block, two NVFP4
//     ones) into its 4 k-slots {2t, 2t+1, 2t+8, 2t+9} of every mma; B column n holds x of block
//     n at lane n's k-slots and zeros elsewhere (only lanes g == t hold nonzero B), so the f32
//     accumulator column n is the block-n partial of every row: D[r][n] = sum of the 32 products
//     of (row r, block n) (NVFP4: mmas 0-3 and 4-7 from zero, one per 16-element half).
//   * Lane t < 2 folds its columns 2t, 2t+1 of rows g, g+8: acc = fma(partial, block scale, acc)
//     in block order (NVFP4: half 0 of both blocks, then half 1), over the steps of the segment;
//     the segment value is (acc(t=0) + acc(t=1)) * 2^-s; the row is seg0 + seg1 (NVFP4: times
//     weight_scale_2). Epilogues (bf16 rounding, SwiGLU, the combine in ascending expert id) as
//     in the CUDA-core kernels, so gemv_*_mma, then swiglu / combine == the fused _mma kernels.
//
// LAYOUT: grid (ceil(O/16), slots | tokens); a CTA owns one 16-row tile and all its terms
// (gate/up: W1 and W3; down: the k picks; plain: one), each split into the 2 K segments: NT*2
// warp tasks on W = min(2 NT, 12) warps (blockDim = 32 W). Each warp stages its own segment of x
// (no CTA barrier before the math), with its first weight loads already in flight, and streams
// its steps with a register ring of MMA_DEPTH steps (2 x 16 B per lane and step, + the scales).
// Partials go through shared memory; one barrier; 16 threads run the epilogue.
// x staging layout (per warp, dynamic shared memory): element order, every 8 elements
// x0..x7 -> one uint4 {(x0,x4), (x1,x5), (x2,x6), (x3,x7)} as f16x2, matching the decode's
// pairs (n_i, n_{i+4}); lane (t, t) reads the 4 uint4 of its block per step.
namespace {

constexpr int MMA_KS = 2;         // K segments per row (part of the row arithmetic)
#ifndef FP4_MMA_DEPTH
#define FP4_MMA_DEPTH 2  // ring depth in steps (tuning only)
#endif
#ifndef FP4_MMA_MINB
#define FP4_MMA_MINB 2  // launch bounds (384 threads, MINB CTAs): 2 -> <= 80 registers (DEPTH 2 fits)
#endif
#ifndef FP4_MMA_PLACE
#define FP4_MMA_PLACE 0  // 1: e2m1 -> f16 by bit placement (f16 subnormals into the mma), see below
#endif
#ifndef FP4_MMA_PRMT
// 1 (needs FP4_MMA_PLACE=1): the placement's four f16x2 words built as the CUDA-core kernels'
// FP4_PRMT decode builds them (two byte-gathers + two PRMT + two masks: 9 operations per word of
// 8 nibbles instead of 15); the same words bit for bit (tests/test_fp4_alu_decode.py), so the
// same mma inputs and the same outputs as FP4_MMA_PLACE=1 alone
#define FP4_MMA_PRMT 0
#endif
#if FP4_MMA_PRMT && !FP4_MMA_PLACE
#error "FP4_MMA_PRMT=1 needs FP4_MMA_PLACE=1"
#endif

DEV u32 prmt(u32 a, u32 b, u32 sel) {  // PTX prmt (selector msb = replicate the byte's sign)
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// 8 e2m1 nibbles n0..n7 of w -> 4 f16x2 h[i] = (e2m1(n_i) low half, e2m1(n_{i+4}) high half),
// exact. The f16 of every e2m1 magnitude has a zero low byte: the high bytes 00 38 3C 3E 40 42
// 44 46 are an 8-byte PRMT table indexed by the 3 magnitude bits (lo: n0..n3, hi: n4..n7); the
// interleave PRMTs put them in bytes 1 and 3 (selector nibble 8 = sign of a byte < 0x80 = 0x00
// for bytes 0 and 2); n_i's sign (bit 4i+3) and n_{i+4}'s (4i+19) are 16 apart, so one shift
// puts both at 15 and 31.
DEV void e2m1x8_to_f16x2(u32 w, u32 (&h)[4]) {
#if FP4_DIAG_DECODE && FP4_MMA_PLACE && FP4_MMA_PRMT
    diag_decode_words(w, h);  // TIMING ONLY (wrong values)
    return;
#endif
#if FP4_MMA_PLACE
    // bit placement (sign -> 15, e1 e0 m -> 11..9): exactly e2m1 * 2^-14, code 1 an f16 SUBNORMAL
    // (2^-15): 8 ALU + 7 IMAD per word instead of 11 ALU + 4; correct only if the tensor core
    // takes f16 subnormal inputs (tests decide); the 2^-14 is undone in mma_task
#if FP4_MMA_PRMT
    const u32 qo = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);
    const u32 qe = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
    h[0] = __byte_perm(qe, 0u, 0x2404u);
    h[1] = __byte_perm(qo, 0u, 0x2404u);
    h[2] = qe & 0xff00ff00u;
    h[3] = qo & 0xff00ff00u;
    return;
#endif
    h[0] = ((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u);
    h[1] = ((w << 5) & 0x0e000e00u) | ((w << 8) & 0x80008000u);
    h[2] = ((w << 1) & 0x0e000e00u) | ((w << 4) & 0x80008000u);
    h[3] = (__umulhi(w, 1u << 29) & 0x0e000e00u) | (w & 0x80008000u);
    return;
#endif
    const u32 m = w & 0x77777777u;
    const u32 lo = prmt(0x3E3C3800u, 0x46444240u, m);
    const u32 hi = prmt(0x3E3C3800u, 0x46444240u, __umulhi(m, 0x10000u));  // m >> 16 on the FMA pipe
    h[0] = prmt(lo, hi, 0x4808u) | ((w << 12) & 0x80008000u);
    h[1] = prmt(lo, hi, 0x5818u) | ((w << 8) & 0x80008000u);
    h[2] = prmt(lo, hi, 0x6828u) | ((w << 4) & 0x80008000u);
    h[3] = prmt(lo, hi, 0x7838u) | (w & 0x80008000u);
}

// acc + partial * e8m0(b), off the ALU pipe (the decode's bottleneck). bits: b at bits 23..30,
// zeros below, anything at bit 31 (removed by |.|). sc = 2^(b-127) for b in 1..254, +inf for 255,
// +0 for 0 -- which under -ftz (every build here) is what FFMA makes of e8m0_scale's 2^-127 (a
// subnormal operand flushes); sc - sc is +0, or NaN for b = 255, so acc + (sc - sc) keeps acc
// (only a zero's sign can change, after an FTZ flush) or turns it NaN as e8m0_scale's NaN does.
DEV float mma_fold_e8m0(float partial, u32 bits, float acc) {
    const float sc = fabsf(__uint_as_float(bits));
    return __fmaf_rn(partial, sc, __fadd_rn(acc, __fsub_rn(sc, sc)));
}

DEV u32 f16x2_rn(float lo, float hi) {  // (lo, hi) -> f16x2, round to nearest even
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// D += A B, m16n8k16, f16 inputs, f32 accumulate. A: a0 (row g, k 2t..), a1 (row g+8, k 2t..),
// a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..); B: b0 (k 2t.., col g), b1 (k 2t+8.., col g).
DEV void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__host__ __device__ constexpr int mma_seg_words(int K) {  // staged uint4 per warp for K
    return ((K / 128 + MMA_KS - 1) / MMA_KS) * 16;
}

// One warp task: rows o0 .. o0+15 (rows >= O read as zeros) of the term (weights wb [O, K/2],
// scales sb [O, K/32 | K/16], input row xrow [K] bf16), K segment ks; writes the 16 segment
// values to part[0..15]. xs: this warp's staging area (mma_seg_words(K) uint4).
template <bool NV>
DEV void mma_task(const u8* __restrict__ wb, const u8* __restrict__ sb, const u16* __restrict__ xrow, int O,
                  int K, int o0, int ks, uint4* xs, float* part) {
    constexpr int D = FP4_MMA_DEPTH;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nst = K >> 7, st0 = ks * nst / MMA_KS, ns = (ks + 1) * nst / MMA_KS - st0;
    const int half_k = K >> 1, nsc = NV ? K >> 4 : K >> 5;
    const bool okg = o0 + g < O, ok8 = o0 + g + 8 < O, sl = t < 2;
    // next step's weights / scales of rows g and g+8 (advanced by fetch)
    const u8* pw = wb + (i64)(o0 + g) * half_k + 16 * t + 64 * st0;
    const u8* ps = sb + (i64)(o0 + g) * nsc + (NV ? 4 : 2) * t + (NV ? 8 : 4) * st0;
    const u8* pw8 = pw + 8 * (i64)half_k;
    const u8* ps8 = ps + 8 * (i64)nsc;
    const bool sg = sl && okg, s8 = sl && ok8;
    // scale defaults where nothing is loaded (lanes t >= 2, rows >= O): 1.0 (their partials are 0).
    // MXFP4: the 2 e8m0 bytes (blocks 2t, 2t+1) of a row in one word (decoded on the FMA pipe,
    // mma_fold_e8m0); NVFP4: the 4 e4m3 bytes (blocks 2t, 2t+1 x halves 0, 1) in one word
    const u32 sdef = NV ? 0x38383838u : 0x7f7fu;
    uint4 rw[D][2];
    u32 rs[D][2];
    auto fetch = [&](int d) {
        // plain loads (not ldg_weight16): the evict_first policy's register spills at this
        // kernel's 80-register budget (opt-in kernels, not in the default step)
        rw[d][0] = okg ? ldg16(pw) : make_uint4(0, 0, 0, 0);
        rw[d][1] = ok8 ? ldg16(pw8) : make_uint4(0, 0, 0, 0);
        if (NV) {
            rs[d][0] = sg ? __ldg(reinterpret_cast<const u32*>(ps)) : sdef;
            rs[d][1] = s8 ? __ldg(reinterpret_cast<const u32*>(ps8)) : sdef;
        } else {
            rs[d][0] = sg ? (u32)__ldg(reinterpret_cast<const unsigned short*>(ps)) : sdef;
            rs[d][1] = s8 ? (u32)__ldg(reinterpret_cast<const unsigned short*>(ps8)) : sdef;
        }
        pw += 64;
        pw8 += 64;
        ps += NV ? 8 : 4;
        ps8 += NV ? 8 : 4;
    };
#pragma unroll
    for (int d = 0; d < D; ++d)
        if (d < ns) fetch(d);
    // stage x of the segment (f16 x 2^s, pair order) while the first weights are in flight
    const int n16 = ns * 16;
    const u16* xseg = xrow + 128 * st0;
    u32 mx2 = 0;
    for (int i = lane; i < n16; i += 32) {
        const uint4 v = ldg16(xseg + 8 * i);
        mx2 = __vmaxu2(mx2, __vmaxu2(__vmaxu2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu),
                                     __vmaxu2(v.z & 0x7fff7fffu, v.w & 0x7fff7fffu)));
        xs[i] = v;
    }
    const u32 mx = __reduce_max_sync(0xffffffffu, max(mx2 & 0xffffu, mx2 >> 16));
    const int s = mx == 0u ? 0 : min(126, max(-126, 142 - (int)(mx >> 7)));
    const float up = pow2f(s), down = pow2f(-s);
    for (int i = lane; i < n16; i += 32) {
        const uint4 v = xs[i];
        uint4 o;
        o.x = f16x2_rn(__fmul_rn(bf16lo(v.x), up), __fmul_rn(bf16lo(v.z), up));
        o.y = f16x2_rn(__fmul_rn(bf16hi(v.x), up), __fmul_rn(bf16hi(v.z), up));
        o.z = f16x2_rn(__fmul_rn(bf16lo(v.y), up), __fmul_rn(bf16lo(v.w), up));
        o.w = f16x2_rn(__fmul_rn(bf16hi(v.y), up), __fmul_rn(bf16hi(v.w), up));
        xs[i] = o;
    }
    __syncwarp();
    const bool bl = g == t;  // this lane holds B (x of block t at its k-slots); others keep zeros
    uint4 xb[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) xb[c] = make_uint4(0, 0, 0, 0);
    float accg = 0.0f, acc8 = 0.0f;
    for (int b0 = 0; b0 < ns; b0 += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int st = b0 + d;
            if (st >= ns) break;  // warp-uniform
            if (bl) {
#pragma unroll
                for (int c = 0; c < 4; ++c) xb[c] = xs[16 * st + 4 * t + c];
            }
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (NV && c == 2) {  // half 0 of blocks 2t, 2t+1 done: scale bytes 0 and 2
                    accg = __fmaf_rn(acc[0], e4m3_to_f32(rs[d][0] & 0xffu), accg);
                    accg = __fmaf_rn(acc[1], e4m3_to_f32((rs[d][0] >> 16) & 0xffu), accg);
                    acc8 = __fmaf_rn(acc[2], e4m3_to_f32(rs[d][1] & 0xffu), acc8);
                    acc8 = __fmaf_rn(acc[3], e4m3_to_f32((rs[d][1] >> 16) & 0xffu), acc8);
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[q] = 0.0f;
                }
                u32 hg[4], h8[4];
                e2m1x8_to_f16x2(word_of(rw[d][0], c), hg);
                e2m1x8_to_f16x2(word_of(rw[d][1], c), h8);
                mma16816(acc, hg[0], h8[0], hg[1], h8[1], xb[c].x, xb[c].y);
                mma16816(acc, hg[2], h8[2], hg[3], h8[3], xb[c].z, xb[c].w);
            }
            if (NV) {  // half 1: scale bytes 1 and 3
                accg = __fmaf_rn(acc[0], e4m3_to_f32((rs[d][0] >> 8) & 0xffu), accg);
                accg = __fmaf_rn(acc[1], e4m3_to_f32(rs[d][0] >> 24), accg);
                acc8 = __fmaf_rn(acc[2], e4m3_to_f32((rs[d][1] >> 8) & 0xffu), acc8);
                acc8 = __fmaf_rn(acc[3], e4m3_to_f32(rs[d][1] >> 24), acc8);
            } else {
                accg = mma_fold_e8m0(acc[0], rs[d][0] << 23, accg);            // byte 0; bit 31: |.|
                accg = mma_fold_e8m0(acc[1], __umulhi(rs[d][0], 1u << 24) << 23, accg);  // byte 1
                acc8 = mma_fold_e8m0(acc[2], rs[d][1] << 23, acc8);
                acc8 = mma_fold_e8m0(acc[3], __umulhi(rs[d][1], 1u << 24) << 23, acc8);
            }
            if (st + D < ns) fetch(d);  // step st + D into the slot just used
        }
    }
    // lanes t = 0, 1 hold blocks {0,1} and {2,3} of every step: add the pair (same bits in both)
    accg = __fadd_rn(accg, __shfl_xor_sync(0xffffffffu, accg, 1));
    acc8 = __fadd_rn(acc8, __shfl_xor_sync(0xffffffffu, acc8, 1));
    if (t == 0) {
        // FP4_MMA_PLACE: the weights were e2m1 * 2^-14 (one more exact power of two)
        part[g] = FP4_MMA_PLACE ? __fmul_rn(__fmul_rn(accg, down), 16384.0f) : __fmul_rn(accg, down);
        part[g + 8] = FP4_MMA_PLACE ? __fmul_rn(__fmul_rn(acc8, down), 16384.0f) : __fmul_rn(acc8, down);
    }
    __syncwarp();  // the staging area is reused by this warp's next task
}

DEV void mma_zero_task(float* part) {
    const int lane = threadIdx.x & 31;
    if (lane < 16) part[lane] = 0.0f;
}

// dynamic shared memory of an _mma launch: W staging areas, then the partials [2 NT][16] f32
// and the combine order [16] int (ops.experts computes the same size)
struct MmaSmem {
    uint4* xs;
    float* part;
    int* order;
    DEV MmaSmem(uint4* base, int K, int W, int NT) {
        xs = base;
        part = reinterpret_cast<float*>(base + W * mma_seg_words(K));
        order = reinterpret_cast<int*>(part + 2 * NT * 16);
    }
    DEV uint4* warp_xs(int K) const { return xs + (threadIdx.x >> 5) * mma_seg_words(K); }
};

// the row of term `term` after its two segments (NVFP4: times weight_scale_2)
DEV float mma_row(const float* part, int term, int r, float ws2, bool nv) {
    const float v = __fadd_rn(part[(2 * term) * 16 + r], part[(2 * term + 1) * 16 + r]);
    return nv ? __fmul_rn(v, ws2) : v;
}

}  // namespace

extern __shared__ uint4 fp4_mma_smem[];

#define GEMV_FP4_MMA(NAME, NV)                                                                     \
    extern "C" __global__ void __launch_bounds__(384, FP4_MMA_MINB)                                          \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         u16* __restrict__ y, int ld_y, int O, int K) { PDL_ENTRY();                               \
        const i64 slot = blockIdx.y;                                                              \
        const int o0 = blockIdx.x * 16, W = blockDim.x >> 5, warp = threadIdx.x >> 5;             \
        const int e = __ldg(expert_ids + slot);                                                   \
        u16* yr = y + slot * ld_y;                                                                \
        if (e < 0) {                                                                              \
            if (threadIdx.x < 16 && o0 + (int)threadIdx.x < O) yr[o0 + threadIdx.x] = 0;          \
            return;                                                                               \
        }                                                                                         \
        MmaSmem sm(fp4_mma_smem, K, W, 1);                                                        \
        const u8* wb = reinterpret_cast<const u8*>(__ldg(wptr + e));                             \
        const u8* sb = reinterpret_cast<const u8*>(__ldg(sptr + e));                             \
        for (int task = warp; task < 2; task += W)                                                \
            mma_task<NV>(wb, sb, x + (slot / x_div) * (i64)K, O, K, o0, task, sm.warp_xs(K),       \
                         sm.part + 16 * task);                                                    \
        __syncthreads();                                                                          \
        const int r = threadIdx.x;                                                                \
        if (r < 16 && o0 + r < O)                                                                 \
            yr[o0 + r] = (u16)f32_to_bf16(mma_row(sm.part, 0, r, NV ? __ldg(ws2 + e) : 1.0f, NV)); \
    }

GEMV_FP4_MMA(gemv_mxfp4_mma, false)
GEMV_FP4_MMA(gemv_nvfp4_mma, true)

#define GEMV_FP4_GATEUP_MMA(NAME, NV)                                                              \
    extern "C" __global__ void __launch_bounds__(384, FP4_MMA_MINB)                                          \
    NAME(const u16* __restrict__ x, int x_div, const int* __restrict__ expert_ids,                \
         const u64* __restrict__ w1ptr, const u64* __restrict__ s1ptr, const float* __restrict__ ws2_1, \
         const u64* __restrict__ w3ptr, const u64* __restrict__ s3ptr, const float* __restrict__ ws2_3, \
         const float* __restrict__ weight, double limit, u16* __restrict__ h, int ld_h, int O, int K) { PDL_ENTRY(); \
        const i64 slot = blockIdx.y;                                                              \
        const int o0 = blockIdx.x * 16, W = blockDim.x >> 5, warp = threadIdx.x >> 5;             \
        const int e = __ldg(expert_ids + slot);                                                   \
        u16* hr = h + slot * ld_h;                                                                \
        if (e < 0) {                                                                              \
            if (threadIdx.x < 16 && o0 + (int)threadIdx.x < O) hr[o0 + threadIdx.x] = 0;          \
            return;                                                                               \
        }                                                                                         \
        MmaSmem sm(fp4_mma_smem, K, W, 2);                                                        \
        const u16* xr = x + (slot / x_div) * (i64)K;                                              \
        for (int task = warp; task < 4; task += W) {  /* term = task / 2 (W1, W3), segment task % 2 */ \
            const bool up = task >= 2;                                                            \
            mma_task<NV>(reinterpret_cast<const u8*>(__ldg((up ? w3ptr : w1ptr) + e)),             \
                         reinterpret_cast<const u8*>(__ldg((up ? s3ptr : s1ptr) + e)), xr, O, K, o0, \
                         task & 1, sm.warp_xs(K), sm.part + 16 * task);                           \
        }                                                                                         \
        __syncthreads();                                                                          \
        const int r = threadIdx.x;                                                                \
        if (r < 16 && o0 + r < O) {                                                               \
            const float a = round_bf16(mma_row(sm.part, 0, r, NV ? __ldg(ws2_1 + e) : 1.0f, NV)); \
            const float u = round_bf16(mma_row(sm.part, 1, r, NV ? __ldg(ws2_3 + e) : 1.0f, NV)); \
            const bool weighted = weight != nullptr;                                              \
            hr[o0 + r] = (u16)f32_to_bf16(swiglu_value(a, u, weighted ? __ldg(weight + slot) : 1.0f, \
                                                       weighted, limit));                         \
        }                                                                                         \
    }

GEMV_FP4_GATEUP_MMA(gemv_mxfp4_gateup_mma, false)
GEMV_FP4_GATEUP_MMA(gemv_nvfp4_gateup_mma, true)

// down + combine: terms = the token's k picks (pick j: h row t*k + j, expert ids[t, j]); the
// rounded pick rows are summed from 0 in ascending expert id (stable), then the shared row.
#define GEMV_FP4_DOWN_MMA(NAME, NV)                                                                \
    extern "C" __global__ void __launch_bounds__(384, FP4_MMA_MINB)                                          \
    NAME(const u16* __restrict__ h, const int* __restrict__ expert_ids, int k,                    \
         const u64* __restrict__ wptr, const u64* __restrict__ sptr, const float* __restrict__ ws2, \
         const u16* __restrict__ shared, u16* __restrict__ y, int ld_y, int O, int K) { PDL_ENTRY(); \
        const i64 tok = blockIdx.y;                                                               \
        const int o0 = blockIdx.x * 16, W = blockDim.x >> 5, warp = threadIdx.x >> 5;             \
        const int* ids = expert_ids + tok * k;                                                    \
        MmaSmem sm(fp4_mma_smem, K, W, k);                                                        \
        if ((int)threadIdx.x < k) {  /* stable rank of pick j: order[rank] = j */                 \
            const int j = threadIdx.x, ej = __ldg(ids + j);                                       \
            int rank = 0;                                                                         \
            for (int i = 0; i < k; ++i) {                                                         \
                const int ei = __ldg(ids + i);                                                    \
                rank += (ei < ej || (ei == ej && i < j)) ? 1 : 0;                                 \
            }                                                                                     \
            sm.order[rank] = j;                                                                   \
        }                                                                                         \
        for (int task = warp; task < 2 * k; task += W) {                                          \
            const int j = task >> 1, e = __ldg(ids + j);                                          \
            if (e < 0) {                                                                          \
                mma_zero_task(sm.part + 16 * task);                                               \
                continue;                                                                         \
            }                                                                                     \
            mma_task<NV>(reinterpret_cast<const u8*>(__ldg(wptr + e)), reinterpret_cast<const u8*>(__ldg(sptr + e)), \
                         h + (tok * k + j) * (i64)K, O, K, o0, task & 1, sm.warp_xs(K), sm.part + 16 * task); \
        }                                                                                         \
        __syncthreads();                                                                          \
        const int r = threadIdx.x, o = o0 + r;                                                    \
        if (r < 16 && o < O) {                                                                    \
            float comb = 0.0f;                                                                    \
            for (int rank = 0; rank < k; ++rank) {                                                \
                const int j = sm.order[rank], e = __ldg(ids + j);                                 \
                comb = __fadd_rn(comb, e >= 0 ? round_bf16(mma_row(sm.part, j, r, NV ? __ldg(ws2 + e) : 1.0f, NV)) \
                                              : 0.0f);                                            \
            }                                                                                     \
            if (shared != nullptr) comb = __fadd_rn(comb, bf16_to_f32(__ldg(shared + tok * O + o))); \
            y[tok * ld_y + o] = (u16)f32_to_bf16(comb);                                           \
        }                                                                                         \
    }

GEMV_FP4_DOWN_MMA(gemv_mxfp4_down_combine_mma, false)
GEMV_FP4_DOWN_MMA(gemv_nvfp4_down_combine_mma, true)

// ==================================================================== prefill MoE (batched)
// The chunk routine's routed experts (memra_dsv4/gpu/ops/prefill_moe.py): the tokens' picks are
// laid out expert-sorted in a padded buffer (expert slot j of a group owns rows
// [row0 + j * mb, row0 + (j + 1) * mb), unused rows are padding), the group's experts are
// dequantised into a bf16 scratch [n, out, in] and run as one strided-batched cuBLASLt GEMM.
// These kernels are the glue around those GEMMs; each is bit-identical to the per-expert CuPy
// path it replaces (gpu.ops_glue: dequant_fp4_bf16, bf16_bits gather, linear -> store,
// swiglu_clamped -> store, moe_combine).

// dequant_{mx,nv}fp4_bf16_experts: out[j] = dequant(expert eids[j]) for j < gridDim.y, from the
// STACKED per-layer tensors (packed [E, R, C/2] u8, scales [E, R, C/32 | C/16] u8; p_stride /
// s_stride = bytes per expert). Each expert slot runs dequant_*_rows, the body of
// dequant_*_bf16 above, so the bits equal a per-expert call. grid (x, n), block 256, grid-stride
// over the expert's R * C / 32 chunks (memory bound: 16 B read, 64 B written per thread step).
extern "C" __global__ void __launch_bounds__(256)
dequant_mxfp4_bf16_experts(const u8* __restrict__ packed, const u8* __restrict__ scale, long long p_stride,
                           long long s_stride, const int* __restrict__ eids, u16* __restrict__ out,
                           long long R, int C) { PDL_ENTRY();
    const i64 e = __ldg(eids + blockIdx.y);
    const u8* pk = packed + e * p_stride;
    const u8* sc = scale + e * s_stride;
    dequant_mxfp4_rows(pk, sc, out + (i64)blockIdx.y * (R * (C >> 5)) * 32, R, C);  // expert slot j: R * C outputs
}

// ws2: f32 [E] on the device (the layer's weight_scale_2 per expert).
extern "C" __global__ void __launch_bounds__(256)
dequant_nvfp4_bf16_experts(const u8* __restrict__ packed, const u8* __restrict__ wscale, long long p_stride,
                           long long s_stride, const float* __restrict__ ws2, const int* __restrict__ eids,
                           u16* __restrict__ out, long long R, int C) { PDL_ENTRY();
    const i64 e = __ldg(eids + blockIdx.y);
    const u8* pk = packed + e * p_stride;
    const u8* sc = wscale + e * s_stride;
    const float s2 = __ldg(ws2 + e);
    dequant_nvfp4_rows(pk, sc, s2, out + (i64)blockIdx.y * (R * (C >> 5)) * 32, R, C);  // expert slot j: R * C outputs
}

// moe_gather_bf16: xs[p] = bf16(x[src[p]]) (RNE; exact for the bf16-valued activations), zeros
// where src[p] < 0 (padding rows). x [T, D] f32, src [P] int32, xs [P, D] bf16. D % 8 == 0.
// Grid-stride, thread = 8 channels (two 16 B loads, one 16 B store).
extern "C" __global__ void __launch_bounds__(256)
moe_gather_bf16(const float* __restrict__ x, const int* __restrict__ src, u16* __restrict__ xs,
                long long P, int D) { PDL_ENTRY();
    const int cpr = D >> 3;
    const i64 total = P * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 p = i / cpr;
        const int c = (int)(i % cpr);
        const int t = __ldg(src + p);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (t >= 0) {
            const float4* xr = reinterpret_cast<const float4*>(x + (i64)t * D + 8 * c);
            const float4 a = __ldg(xr), b = __ldg(xr + 1);
            const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            v = pack8(f);
        }
        stg16(xs + i * 8, v);
    }
}

// moe_swiglu_rows: h[p] = bf16(swiglu_value(bf16(gate[p]), bf16(up[p]), wts[flat[p]])) for the
// padded rows p < P of a group (flat[p] < 0: padding, h = 0). gate/up [P, I] f32 (the batched
// GEMM outputs; rounded to bf16 here = linear(..., out="bf16")), wts [T * k] f32 routing weights,
// flat [P] int32 (t * k + pick), h [P, I] bf16. I % 8 == 0. Grid-stride, thread = 8 channels.
extern "C" __global__ void __launch_bounds__(256)
moe_swiglu_rows(const float* __restrict__ gate, const float* __restrict__ up, const float* __restrict__ wts,
                const int* __restrict__ flat, u16* __restrict__ h, long long P, int I, double limit) { PDL_ENTRY();
    const int cpr = I >> 3;
    const i64 total = P * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 p = i / cpr;
        const int f = __ldg(flat + p);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (f >= 0) {
            const float ws = __ldg(wts + f);
            const float4* gr = reinterpret_cast<const float4*>(gate + i * 8);
            const float4* ur = reinterpret_cast<const float4*>(up + i * 8);
            const float4 g0 = __ldg(gr), g1 = __ldg(gr + 1), u0 = __ldg(ur), u1 = __ldg(ur + 1);
            const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
            const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
            float o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = swiglu_value(round_bf16(g[e]), round_bf16(u[e]), ws, true, limit);
            v = pack8(o);
        }
        stg16(h + i * 8, v);
    }
}

// moe_combine_sorted: y[t] = bf16( (0 + sum_j bf16(ys[pos[t, j]])) + shared[t] ), f32 adds in j
// order; the host orders pos[t, :] by ascending expert id (stable in the pick), so this is
// oracle.ops.moe_combine of the stored expert outputs (bit-identical to ops_glue.moe_combine).
// ys [P, D] f32 (down GEMM outputs), pos [T, k] int32 rows of ys, shared [T, D] f32 bf16-valued,
// y [T, D] f32 bf16-valued. grid (T, ceil(D / 1024)), block 128, thread = 8 channels.
extern "C" __global__ void __launch_bounds__(128)
moe_combine_sorted(const float* __restrict__ ys, const int* __restrict__ pos, const float* __restrict__ shared,
                   float* __restrict__ y, int k, int D) { PDL_ENTRY();
    const i64 t = blockIdx.x;
    const int c = blockIdx.y * 128 + threadIdx.x;
    if (8 * c >= D) return;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
        const i64 r = __ldg(pos + t * k + j);
        const float4* yr = reinterpret_cast<const float4*>(ys + r * D + 8 * c);
        const float4 a = __ldg(yr), b = __ldg(yr + 1);
        const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], round_bf16(f[e]));
    }
    const float4* sr = reinterpret_cast<const float4*>(shared + t * D + 8 * c);
    const float4 a = __ldg(sr), b = __ldg(sr + 1);
    const float s[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = round_bf16(__fadd_rn(acc[e], s[e]));
    float4* yo = reinterpret_cast<float4*>(y + t * D + 8 * c);
    yo[0] = make_float4(o[0], o[1], o[2], o[3]);
    yo[1] = make_float4(o[4], o[5], o[6], o[7]);
}

// ============================================================ prefill MoE: FP4 grouped GEMM (mma)
// fp4mma_gateup_{mxfp4,nvfp4} / fp4mma_down_{mxfp4,nvfp4}: the routed experts of a prefill chunk
// as ONE launch per projection over all active experts, multiplying the expert-sorted bf16 rows
// (prefill_moe.dispatch_plan's layout) by the experts' STORED FP4 bytes on tensor cores
// (mma.sync m16n8k16 bf16 x bf16 -> f32).  Replaces, per group of experts, 3 dequant launches into
// a bf16 scratch + 3 strided-batched cuBLASLt GEMMs + the SwiGLU launch (prefill_moe.py "fp4mma").
//
// Work: items[y] = {expert id e, first row r0 of the tile in xs / hs / ys, rows n (0..64), 0}: one
//   expert's (up to) 64 consecutive rows; blockIdx.x = a tile of output rows (gate/up: 16 * WARPS
//   indices i of both W1 and W3, down: 32 * WARPS rows of W2).  x fastest: the CTAs that share an
//   item's activation rows (and an expert's weights, its items are adjacent) run together (L2).
//   An item of n = 0 rows does nothing (its CTAs return before any load): the device-built plan
//   (moe.cu moe_plan_scan) launches a grid of an upper bound of items and zero-fills the tail.
// THE ARITHMETIC: out[r, o] = sum_k W[o, k] a[r, k] with W[o, k] the EXACT bf16 the dequant kernels
//   above write (dequant_mxfp4_bf16: e2m1 * 2^(S-127), every S incl. subnormal / inf / NaN results;
//   dequant_nvfp4_bf16: bf16(f32(f32(e2m1 * e4m3) * ws2)), same f32 products, RNE; NaN stays NaN,
//   its payload may differ), products exact in f32, f32 accumulation in the
//   tensor core's order over 16-element steps, the steps in a fixed order (128-element chunks; in a
//   chunk lane quad q's step w covers elements 32 q + 8 w .. + 7 of every row, see below).  So: the
//   same products as cuBLASLt on the dequantised scratch, another f32 summation order (bf16 class).
//   Epilogues: gate/up -> h[r, i] = bf16(swiglu_value(bf16(gate), bf16(up), wts[flat[r]], limit)),
//   moe_swiglu_rows' formula bit for bit given the same gate / up; down -> ys[r, o] f32 (the
//   combine rounds it to bf16, as it rounds the cuBLASLt output).
//
// LAYOUT.  CTA = WARPS warps; warp w owns 32 weight rows (two m16 tiles: gate/up = 16 indices of W1
//   and the same 16 of W3, so gate and up of one (row, i) land in the same thread's registers and
//   SwiGLU runs in registers) x the item's 64 tokens (8 n8 tiles; tiles past the item's rows are
//   skipped, a warp-uniform branch).  Weights are the A operand (M = output rows), activations the
//   B operand (N = tokens), so an expert with a few rows wastes n8, not m16, granules.
//   * K permutation: in a 128-element chunk, lane (g, q) (g = lane / 4, q = lane % 4) reads the
//     16 packed bytes of block q (elements 32 q .. 32 q + 31, ONE MXFP4 scale, two NVFP4 scales) of
//     each of its 4 rows with one 16-byte LDS; word w (8 elements) feeds k-steps 2w, 2w + 1: the A
//     fragment's k pairs (2q, 2q+1) / (2q+8, 2q+9) of step 2w+s are elements 8w+4s+(0,1) / (2,3).
//     The B fragment of token g takes the SAME elements from one 16-byte LDS of the activation row:
//     a bijection of the chunk's 128 k, identical on both sides, so the dot product is unchanged.
//   * Decode (no LDS, no f32 math per element): per (row, block) an 8-entry table of the 8 scaled
//     magnitudes as bf16, split into low bytes (2 registers) and high bytes (2 registers); per word
//     of 8 nibbles, 4 PRMT look-ups (the 3-bit code is the PRMT byte index), 2 PRMT in sign mode (a
//     negative nibble's selector MSB replicates a byte's bit 7: 0x80 -> 0xFF) give the signs, and
//     4 PRMT interleave low / high bytes into the four bf16x2 fragment registers: 17 integer ops
//     per 8 weights.  MXFP4 tables: the e2m1 bf16 patterns plus (S - 127) << 7 on both halves (one
//     IADD per register pair; exact whenever every product is a normal bf16, 2 <= S <= 252; other S
//     take mx_to_bf16 per code).  NVFP4 tables: the 8 f32 products of dequant_nvfp4_bf16 per code,
//     RNE to bf16 (cvt.rn.bf16x2: the integer RNE of f32_to_bf16 for every non-NaN; NaN stays NaN).
//   * Shared memory per stage (cp.async, FP4MMA_STAGES deep, one barrier per chunk): activations
//     [64 tokens][128] bf16, the 16-byte granule j of token t at slot j ^ (((j >> 3) & 1) << 1) ^
//     (t & 1) (a quarter-warp's 8 B-fragment loads then hit 8 distinct 16-byte bank groups); packed
//     weights [32 * WARPS rows][64 B] (16 consecutive rows per m16 tile: conflict-free 16-byte LDS);
//     scales [rows][4 | 8 B].  Rows >= N and tokens >= n are zero-filled (cp.async src-size 0) and
//     never stored; only the n8 tiles holding tokens < n are loaded and multiplied.
//   * Items with 57..64 rows run a branch-free chunk (all 8 n8 tiles: the 8 B loads and the 32
//     independent mma per word interleave); smaller ones the per-tile-branch form.  sm_90a, nvcc:
//     ~220 registers, ~135 KB shared memory: 1 CTA of 8 warps per SM (FP4MMA_MINB 1); per chunk
//     and warp ~500 issued instructions in the full form, 128 of them HMMA.
//   K % 128 == 0 (Flash: 4096, 2048; the wrapper checks), N any.
namespace fp4g {

#ifndef FP4MMA_WARPS
#define FP4MMA_WARPS 8  // warps per CTA (32 weight rows each)
#endif
#ifndef FP4MMA_STAGES
#define FP4MMA_STAGES 4  // cp.async pipeline depth (chunks of 128 k; 1 CTA / SM, so smem is free: ~135 KB)
#endif
#ifndef FP4MMA_MINB
#define FP4MMA_MINB 1  // resident CTAs per SM the register budget is set for
#endif
constexpr int MMA_THREADS = 32 * FP4MMA_WARPS;
constexpr int MMA_ROWS = 32 * FP4MMA_WARPS;  // weight rows per CTA (gate/up: half W1, half W3)
constexpr int MMA_BN = 64;                   // tokens per item
constexpr int MMA_KC = 128;                  // k per pipeline stage

template <bool NV>
struct MmaSmem {
    static constexpr int SB = NV ? 8 : 4;              // scale bytes per row per chunk
    static constexpr int X = MMA_BN * MMA_KC * 2;      // activations, bf16
    static constexpr int W = MMA_ROWS * (MMA_KC / 2);  // packed e2m1
    static constexpr int S = MMA_ROWS * SB;
    static constexpr int STAGE = X + W + S;
    static constexpr int TOTAL = STAGE * FP4MMA_STAGES;
};

DEV u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

DEV void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a plain C++ load (the compiler sees the shared-memory read: ordered by the barriers, free to be
// scheduled early); the pointers derive from the extern __shared__ array, so this is one LDS.128
DEV uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// bf16 pairs (v01 = code 0 | code 1 << 16, ...) -> the PRMT tables {low bytes of codes 0-3, 4-7,
// high bytes of codes 0-3, 4-7}
DEV void split_table(u32 v01, u32 v23, u32 v45, u32 v67, u32 (&t)[4]) {
    t[0] = prmt(v01, v23, 0x6420u);
    t[1] = prmt(v45, v67, 0x6420u);
    t[2] = prmt(v01, v23, 0x7531u);
    t[3] = prmt(v45, v67, 0x7531u);
}

// MXFP4 block table: code c -> mx_to_bf16(c, S) (the dequant kernels' bits).  Fast form, valid for
// 2 <= S <= 252 (0.5 * 2^(S-127) .. 6 * 2^(S-127) are normal bf16): the e2m1 bf16 patterns
// 0, .5 | 1, 1.5 | 2, 3 | 4, 6 with (S - 127) added to the exponent field of both halves (each half
// stays in [0, 0x7f80), so the 32-bit add is the two 16-bit adds).
DEV void mx_table_fast(u32 S, u32 (&t)[4]) {
    const u32 d = (S - 127u) * 0x00800080u;
    split_table(0x3f000000u + ((S - 127u) << 23), 0x3fc03f80u + d, 0x40404000u + d, 0x40c04080u + d, t);
}
// any S (subnormal, inf and NaN products included), per code
DEV void mx_table_exact(u32 S, u32 (&t)[4]) {
    split_table(mx_to_bf16(0u, S) | (mx_to_bf16(1u, S) << 16), mx_to_bf16(2u, S) | (mx_to_bf16(3u, S) << 16),
                mx_to_bf16(4u, S) | (mx_to_bf16(5u, S) << 16), mx_to_bf16(6u, S) | (mx_to_bf16(7u, S) << 16), t);
}

DEV u32 cvt_bf16x2(float lo, float hi) {  // RNE; lo -> bits 0..15
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// NVFP4 half-block table: code c -> bf16(f32(f32(e2m1(c) * e4m3(sb)) * ws2)), dequant_nvfp4_bf16's order
DEV void nv_table(u32 sb, float ws2, u32 (&t)[4]) {
    const float s = e4m3_to_f32(sb);
    float v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = __fmul_rn(__fmul_rn(e2m1_to_f32((u32)c), s), ws2);
    split_table(cvt_bf16x2(v[0], v[1]), cvt_bf16x2(v[2], v[3]), cvt_bf16x2(v[4], v[5]), cvt_bf16x2(v[6], v[7]), t);
}

// 8 nibbles (element 2j low nibble of byte j) -> 4 bf16x2: r[j] = elements (2j, 2j+1)
DEV void decode8(u32 w, const u32 (&t)[4], u32 (&r)[4]) {
    const u32 m = w & 0x77777777u;  // magnitude codes: PRMT byte indices (nibbles 0..3 used)
    const u32 mh = m >> 16;         // codes of elements 4..7
    const u32 la = prmt(t[0], t[1], m), lb = prmt(t[0], t[1], mh);
    u32 ha = prmt(t[2], t[3], m), hb = prmt(t[2], t[3], mh);
    // sign mode: selector nibble MSB set (negative element) replicates bit 7 of the selected byte
    // (every byte 0x80): 0x80 for +, 0xFF for -; bit 6 -> bit 7 is then the sign, XORed into the
    // high byte (bf16 bit 15): -V(c), exactly what the dequant kernels' e2m1(8 | c) products give
    // (a negative NVFP4 scale included)
    const u32 sa = prmt(0x80808080u, 0x80808080u, w), sb = prmt(0x80808080u, 0x80808080u, w >> 16);
    ha ^= (sa << 1) & 0x80808080u;
    hb ^= (sb << 1) & 0x80808080u;
    r[0] = prmt(la, ha, 0x5140u);
    r[1] = prmt(la, ha, 0x7362u);
    r[2] = prmt(lb, hb, 0x5140u);
    r[3] = prmt(lb, hb, 0x7362u);
}

// weight row rho of the CTA tile -> output row o and matrix (gate/up: second = W3)
template <bool GATEUP>
DEV int mma_row(int rho, int n0, bool& second) {
    if (GATEUP) {
        second = ((rho >> 4) & 1) != 0;
        return n0 + 16 * (rho >> 5) + (rho & 15);
    }
    second = false;
    return n0 + rho;
}

// 16-byte / N-byte cp.async to a shared-memory ADDRESS (u32), zero-filled when !valid
DEV void cp_async16_sa(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
template <int N>
DEV void cp_async_ca_sa(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(valid ? N : 0));
}

// The decode tables of a thread's 4 weight rows (rows[i] of the stage's scale block ss; gate/up:
// rows 2, 3 are W3's) before word w of their 16-byte granules: NVFP4 at w = 0 and 2 (a granule
// spans two e4m3 scales), MXFP4 at w = 0 (one e8m0), with the exact tables when some product is
// not a normal bf16.  Other words keep the tables.  Both grouped GEMMs' chunk loops.
template <bool GATEUP, bool NV>
DEV void row_tables(const unsigned char* ss, const int (&rows)[4], int q, int w, float s2a, float s2b,
                    u32 (&tb)[4][4]) {
    if (!(w == 0 || (NV && w == 2))) return;
    if (NV) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            nv_table(ss[rows[i] * 8 + 2 * q + (w >> 1)], GATEUP && i >= 2 ? s2b : s2a, tb[i]);
    } else {
        u32 S[4];
        bool odd = false;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            S[i] = ss[rows[i] * 4 + q];
            odd |= S[i] - 2u > 250u;
        }
        if (__builtin_expect(odd, 0)) {  // some product is not a normal bf16 (never in real weights)
#pragma unroll
            for (int i = 0; i < 4; ++i) mx_table_exact(S[i], tb[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) mx_table_fast(S[i], tb[i]);
        }
    }
}

// This thread's share of every stage's copies, resolved once per CTA (sources at chunk 0, stage
// offsets): MMA_WPT weight granules (granule tid + THREADS u: row / 4, 16 B part % 4), one scale
// row, XPT activation granules; invalid rows / tokens are zero-filled, tokens past the last
// multiplied n8 tile are skipped.
constexpr int MMA_WPT = MMA_ROWS * 4 / MMA_THREADS;  // weight granules per thread (4)
constexpr int MMA_XPT = MMA_BN * 16 / MMA_THREADS;   // activation granules per thread
static_assert(MMA_ROWS == MMA_THREADS && MMA_XPT * MMA_THREADS == MMA_BN * 16, "fp4mma copy split");

template <bool NV>
struct MmaCopies {
    const u8* w[MMA_WPT];
    u32 wd[MMA_WPT];
    const u8* s;
    u32 sd;
    const u16* x[MMA_XPT];
    u32 xd[MMA_XPT];
    u32 wok, sok, xok, xuse;  // bit masks

    template <bool GATEUP>
    DEV void init(int n0, int N, int K, int ntok, int ntok8, const u8* pA, const u8* sA, const u8* pB,
                  const u8* sB, const u16* act) {
        using L = MmaSmem<NV>;
        const int tid = threadIdx.x;
        const i64 kb = K >> 1, sbr = K / (NV ? 16 : 32);
        wok = sok = xok = xuse = 0u;
#pragma unroll
        for (int u = 0; u < MMA_WPT; ++u) {
            const int i = tid + MMA_THREADS * u, rho = i >> 2, j = i & 3;
            bool second;
            const int o = mma_row<GATEUP>(rho, n0, second);
            const u8* base = second ? pB : pA;
            w[u] = o < N ? base + (i64)o * kb + 16 * j : base;
            wok |= (o < N ? 1u : 0u) << u;
            wd[u] = L::X + rho * 64 + 16 * j;
        }
        {
            bool second;
            const int o = mma_row<GATEUP>(tid, n0, second);
            const u8* base = second ? sB : sA;
            s = o < N ? base + (i64)o * sbr : base;
            sok = o < N ? 1u : 0u;
            sd = L::X + L::W + tid * L::SB;
        }
#pragma unroll
        for (int u = 0; u < MMA_XPT; ++u) {
            const int i = tid + MMA_THREADS * u, tok = i >> 4, j = i & 15;
            const int slot = j ^ (((j >> 3) & 1) << 1) ^ (tok & 1);
            x[u] = tok < ntok ? act + (i64)tok * K + 8 * j : act;
            xok |= (tok < ntok ? 1u : 0u) << u;
            xuse |= (tok < ntok8 ? 1u : 0u) << u;
            xd[u] = 2 * (tok * MMA_KC + 8 * slot);
        }
    }

    // chunk c into the stage at shared address st
    DEV void issue(u32 st, int c) const {
        using L = MmaSmem<NV>;
#pragma unroll
        for (int u = 0; u < MMA_WPT; ++u) {
            const bool ok = (wok >> u) & 1u;
            cp_async16_sa(st + wd[u], ok ? w[u] + 64 * c : w[u], ok);
        }
        cp_async_ca_sa<L::SB>(st + sd, sok ? s + L::SB * c : s, sok != 0u);
#pragma unroll
        for (int u = 0; u < MMA_XPT; ++u) {
            if ((xuse >> u) & 1u) {
                const bool ok = (xok >> u) & 1u;
                cp_async16_sa(st + xd[u], ok ? x[u] + MMA_KC * c : x[u], ok);
            }
        }
    }
};

// One 128-k chunk of the warp's 32 rows x the item's n8 tiles (FULL: all 8, no per-tile branch, so
// the B loads and the independent tiles' mma interleave freely).
template <bool GATEUP, bool NV, bool FULL>
DEV void fp4mma_chunk(const unsigned char* st, const int (&wrow)[4], const int (&xoff)[4], int q, int ntiles,
                      float s2a, float s2b, float (&acc)[2][8][4]) {
    using L = MmaSmem<NV>;
    const u16* xs = reinterpret_cast<const u16*>(st);
    const unsigned char* ws = st + L::X;
    const unsigned char* ss = st + L::X + L::W;
    uint4 wv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wv[i] = lds128(ws + wrow[i] * 64 + 16 * q);
    u32 tb[4][4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        row_tables<GATEUP, NV>(ss, wrow, q, w, s2a, s2b, tb);
        u32 a[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) decode8(word_of(wv[i], w), tb[i], a[i]);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            if (FULL || nt < ntiles) {
                const uint4 b = lds128(xs + nt * 8 * MMA_KC + xoff[w]);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma16816(acc[mt][nt], a[2 * mt][0], a[2 * mt + 1][0], a[2 * mt][1], a[2 * mt + 1][1], b.x, b.y);
                    mma16816(acc[mt][nt], a[2 * mt][2], a[2 * mt + 1][2], a[2 * mt][3], a[2 * mt + 1][3], b.z, b.w);
                }
            }
        }
    }
}

template <bool GATEUP, bool NV>
DEV void fp4mma_body(const u8* __restrict__ pa, const u8* __restrict__ sa, const u8* __restrict__ pb,
                     const u8* __restrict__ sbp, i64 p_stride, i64 s_stride, const float* __restrict__ ws2a,
                     const float* __restrict__ ws2b, const int* __restrict__ items, const u16* __restrict__ act,
                     int N, int K, const float* __restrict__ wts, const int* __restrict__ flat, double limit,
                     u16* __restrict__ hout, float* __restrict__ yout) {
    using L = MmaSmem<NV>;
    extern __shared__ __align__(128) unsigned char mma_smem[];
    const i64 e = __ldg(items + 4 * blockIdx.y);
    const i64 r0 = __ldg(items + 4 * blockIdx.y + 1);
    const int ntok = __ldg(items + 4 * blockIdx.y + 2);
    if (ntok <= 0) return;  // an empty item (the device plan's tail past its item count): the whole CTA
    const int ntiles = (ntok + 7) >> 3;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * (GATEUP ? MMA_ROWS / 2 : MMA_ROWS);
    const u8* pA = pa + e * p_stride;
    const u8* sA = sa + e * s_stride;
    const u8* pB = GATEUP ? pb + e * p_stride : pA;
    const u8* sB = GATEUP ? sbp + e * s_stride : sA;
    float s2a = 1.0f, s2b = 1.0f;
    if (NV) {
        s2a = __ldg(ws2a + e);
        s2b = GATEUP ? __ldg(ws2b + e) : s2a;
    }
    const int nchunks = K / MMA_KC;
    MmaCopies<NV> cps;
    cps.template init<GATEUP>(n0, N, K, ntok, 8 * ntiles, pA, sA, pB, sB, act + r0 * K);
    const u32 sm0 = smem_addr(mma_smem);

#pragma unroll
    for (int s = 0; s < FP4MMA_STAGES - 1; ++s) {
        if (s < nchunks) cps.issue(sm0 + s * L::STAGE, s);
        cp_async_commit();
    }

    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    // this thread's 4 weight rows in the tile: m16 tile mt = i >> 1, rows g (i even) / g + 8 (i odd)
    int wrow[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wrow[i] = 32 * warp + 16 * (i >> 1) + 8 * (i & 1) + g;
    // B fragments: granule j = 4q + w of token 8 nt + g, at its swizzled slot (see issue)
    int xoff[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) xoff[w] = g * MMA_KC + 8 * ((4 * q + w) ^ ((q >> 1) << 1) ^ (g & 1));

    for (int c = 0; c < nchunks; ++c) {
        cp_async_wait<FP4MMA_STAGES - 2>();
        __syncthreads();  // chunk c landed for every thread; slot (c - 1) % STAGES is free
        {
            const int nc = c + FP4MMA_STAGES - 1;
            if (nc < nchunks) cps.issue(sm0 + (nc % FP4MMA_STAGES) * L::STAGE, nc);
            cp_async_commit();
        }
        const unsigned char* st = mma_smem + (c % FP4MMA_STAGES) * L::STAGE;
        if (ntiles == 8)
            fp4mma_chunk<GATEUP, NV, true>(st, wrow, xoff, q, ntiles, s2a, s2b, acc);
        else
            fp4mma_chunk<GATEUP, NV, false>(st, wrow, xoff, q, ntiles, s2a, s2b, acc);
    }
    cp_async_wait<0>();  // nothing real is pending (the tail commits are empty); leave no group behind

    // epilogue: acc[mt][nt][2 hh + cc] = (row 16 mt + g + 8 hh of the warp, token 8 nt + 2 q + cc)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (nt >= ntiles) continue;
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
            const int tok = 8 * nt + 2 * q + cc;
            if (tok >= ntok) continue;
            const i64 p = r0 + tok;
            if (GATEUP) {
                const float wt = __ldg(wts + __ldg(flat + p));
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int o = n0 + 16 * warp + g + 8 * hh;
                    if (o < N) {
                        const float gv = round_bf16(acc[0][nt][2 * hh + cc]), uv = round_bf16(acc[1][nt][2 * hh + cc]);
                        hout[p * N + o] = (u16)f32_to_bf16(swiglu_value(gv, uv, wt, true, limit));
                    }
                }
            } else {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int o = n0 + 32 * warp + 16 * mt + g + 8 * hh;
                        if (o < N) yout[p * N + o] = acc[mt][nt][2 * hh + cc];
                    }
            }
        }
    }
}

}  // namespace fp4g
using namespace fp4g;

// gate/up: hs[r0 + t, i] for the item's tokens t < n and i < N (= I); xs [P, K = D] bf16, w1 / w3
// stacked [E, I, D/2] packed + [E, I, D/32 | D/16] scales (p_stride / s_stride bytes per expert),
// wts [T * k] f32, flat [P] int32 (t * k + j of each row). grid (ceil(N / (16 WARPS)), items).
extern "C" __global__ void __launch_bounds__(MMA_THREADS, FP4MMA_MINB)
fp4mma_gateup_mxfp4(const u8* __restrict__ w1p, const u8* __restrict__ w1s, const u8* __restrict__ w3p,
                    const u8* __restrict__ w3s, long long p_stride, long long s_stride, const int* __restrict__ items,
                    const u16* __restrict__ xs, const float* __restrict__ wts, const int* __restrict__ flat,
                    u16* __restrict__ hs, int N, int K, double limit) { PDL_ENTRY();
    fp4mma_body<true, false>(w1p, w1s, w3p, w3s, p_stride, s_stride, nullptr, nullptr, items, xs, N, K, wts, flat,
                             limit, hs, nullptr);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, FP4MMA_MINB)
fp4mma_gateup_nvfp4(const u8* __restrict__ w1p, const u8* __restrict__ w1s, const u8* __restrict__ w3p,
                    const u8* __restrict__ w3s, long long p_stride, long long s_stride, const float* __restrict__ ws2_1,
                    const float* __restrict__ ws2_3, const int* __restrict__ items, const u16* __restrict__ xs,
                    const float* __restrict__ wts, const int* __restrict__ flat, u16* __restrict__ hs, int N, int K,
                    double limit) { PDL_ENTRY();
    fp4mma_body<true, true>(w1p, w1s, w3p, w3s, p_stride, s_stride, ws2_1, ws2_3, items, xs, N, K, wts, flat, limit,
                            hs, nullptr);
}

// down: ys[r0 + t, o] (f32) for t < n, o < N (= D); hs [P, K = I] bf16; w2 stacked [E, D, I/2].
// grid (ceil(N / (32 WARPS)), items).
extern "C" __global__ void __launch_bounds__(MMA_THREADS, FP4MMA_MINB)
fp4mma_down_mxfp4(const u8* __restrict__ w2p, const u8* __restrict__ w2s, long long p_stride, long long s_stride,
                  const int* __restrict__ items, const u16* __restrict__ hs, float* __restrict__ ys, int N,
                  int K) { PDL_ENTRY();
    fp4mma_body<false, false>(w2p, w2s, nullptr, nullptr, p_stride, s_stride, nullptr, nullptr, items, hs, N, K,
                              nullptr, nullptr, 0.0, nullptr, ys);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, FP4MMA_MINB)
fp4mma_down_nvfp4(const u8* __restrict__ w2p, const u8* __restrict__ w2s, long long p_stride, long long s_stride,
                  const float* __restrict__ ws2, const int* __restrict__ items, const u16* __restrict__ hs,
                  float* __restrict__ ys, int N, int K) { PDL_ENTRY();
    fp4mma_body<false, true>(w2p, w2s, nullptr, nullptr, p_stride, s_stride, ws2, nullptr, items, hs, N, K, nullptr,
                             nullptr, 0.0, nullptr, ys);
}

// ============================================================ prefill MoE: FP4 grouped GEMM (wgmma)
// wgmma_gateup_{mxfp4,nvfp4} / wgmma_down_{mxfp4,nvfp4}: the fp4mma contract above (same work items
// up to their size, same exact bf16 weights, same products, f32 accumulation in the tensor core's
// order, the same epilogues bit for bit given gate / up) on Hopper warpgroup MMA.  Why another
// kernel: fp4mma issues ~500 instructions per 128 HMMA per warp (decode + B loads + mma.sync
// m16n8k16) and reaches ~190 TFLOP/s; here one wgmma.m64nNk16 does the work of N/8 m16n8k16 of
// each of the 4 warps, the activations are read by the tensor core straight from shared memory
// (no per-warp B fragment loads), and the decode of a weight is amortised over up to 128 tokens.
//
// Operands: wgmma's A (M = 64 weight rows per instruction) from REGISTERS, decoded in place by the
//   consumer warps (the fp4mma decode: per-block PRMT tables, decode8), B (N = the item's tokens,
//   up to 128) from shared memory through a matrix descriptor.  A from registers because the
//   alternative (producer warps writing decoded bf16 A tiles to shared memory, both operands read
//   by the tensor core) costs ~160 B/clk of shared-memory traffic per SM at the MMA rate (A written
//   + read, B read, the raw bytes) against a 128 B/clk port; with A in registers it is ~94 B/clk.
// K permutation (the fp4mma one, now applied to the activations IN GLOBAL MEMORY): in every
//   128-element chunk of K, lane quad q (lane % 4) owns the contiguous elements 32 q .. 32 q + 31
//   (ONE MXFP4 scale block, two NVFP4 blocks: one table per row instead of four), word w of its
//   16 packed bytes feeds k-steps 2w, 2w + 1.  The A fragment of wgmma (per warp: the m16n8k16 A
//   layout, rows 16 (warp % 4) + g (+8), k pairs 2q, 2q+1 | 2q+8, 2q+9) then holds at step
//   t = 2w + s, k slot p (0..15) the logical element L = 32 ((p & 7) >> 1) + 4 t + 2 (p >> 3) + (p & 1)
//   of the chunk.  B must hold the same element at the same k slot, and wgmma reads B's k slots
//   contiguously, so the activations are STORED permuted: phys 16 t + p <- logical L, per chunk
//   (wg_perm below; moe_gather_bf16_perm writes xs so, the gate/up epilogue writes hs so).  The
//   dot products are unchanged (the same bijection on both sides), only the summation order.
// Tile: CTA = 2 warpgroups (256 threads), 256 weight rows: warpgroup wg owns two m64 tiles mt
//   (gate/up: mt 0 = W1, mt 1 = W3 of the SAME 64 indices i, so gate and up of one (token, i) land
//   in one thread's accumulators and SwiGLU runs in registers; down: 128 consecutive rows of W2)
//   x the item's tokens (NB = 16 .. 128 in steps of 16: one instantiation per NB, chosen per CTA
//   from the item's row count; rows past the item are zero-filled and never stored).
// Pipeline (one barrier per 128-k stage, all warps load and compute): cp.async ring of STAGES
//   stages (as many as fit WGMMA_SMEM bytes: 4 at NB = 128, 8 at NB <= 48), loads issued
//   STAGES - 2 stages ahead.  Per stage and thread: 4 LDS.128 (its 4 weight rows' 16 bytes),
//   then per word w: decode 4 rows -> 16 registers, wgmma.fence, 4 wgmma (2 k-steps x 2 tiles),
//   commit; wgmma.wait_group 1 before each decode keeps one group in flight while the next one is
//   decoded (its A registers are those of the group two back, complete).  Slot reuse: the stage
//   c + STAGES - 2 overwrites the slot of stage c - 2, whose wgmma groups every thread has waited
//   for (wait_group 1 at word 2 of stage c - 1) before the barrier of stage c.
// Shared memory per stage (the stage base 1024-aligned):
//   B: two K-major SWIZZLE_128B sub-tiles (phys k 0..63, 64..127) of NB rows x 128 B: 16-byte
//     chunk j of token row r at r * 128 + ((j ^ (r & 7)) << 4) (the TMA / wgmma 128-byte swizzle:
//     address bits [4,7) ^= bits [7,10), atoms of 8 rows = 1024 B).  Descriptor: start address of
//     the sub-tile + 32 B per k-step inside the 128-byte row, leading byte offset 0 (unused for
//     swizzled K-major), stride byte offset 1024 (next 8-row group), layout type 1 (128B swizzle),
//     base offset 0 (atoms 1024-aligned).
//   raw: 256 rows x 64 B packed e2m1; 16-byte block q of row rho at slot q ^ ((rho >> 1) & 3) (the
//     8 rows g of one LDS.128 hit 8 distinct 16-byte bank groups).  scales: rows x 4 B (MXFP4) /
//     8 B (NVFP4).
//   cp.async writes are generic-proxy writes that wgmma reads through the async proxy: every
//   thread runs fence.proxy.async.shared::cta after its cp.async.wait_group, before the barrier.
// Accumulator (wgmma D, f32, per warp the m16n8 C layout repeated along N): acc[mt][4 nt + 2 hh + cc]
//   = (row 16 (warp % 4) + g + 8 hh of tile mt, token 8 nt + 2 q + cc).
// K % 128 == 0; gate/up also N % 128 == 0 (hs is stored permuted per 128-chunk); N any for down.
namespace wg {

#ifndef WGMMA_SMEM
#define WGMMA_SMEM 204800  // bytes of stage ring (200 KB; + 1 KB alignment slack requested)
#endif
constexpr int WG_THREADS = 256;  // 2 warpgroups
constexpr int WG_ROWS = 256;     // weight rows per CTA (gate/up: 128 indices of W1 and of W3)
constexpr int WG_BN = 128;       // tokens per item (at most)
constexpr int WG_KC = 128;       // k per stage

template <bool NV, int NB>
struct WgSmem {
    static constexpr int SB = NV ? 8 : 4;        // scale bytes per row per stage
    static constexpr int BSUB = NB * 128;        // one SW128 sub-tile (64 k of NB rows)
    static constexpr int B = 2 * BSUB;           // activations, bf16 (permuted k)
    static constexpr int W = WG_ROWS * 64;       // packed e2m1
    static constexpr int S = WG_ROWS * SB;
    static constexpr int STAGE = (B + W + S + 1023) / 1024 * 1024;
    static constexpr int STAGES = WGMMA_SMEM / STAGE < 8 ? WGMMA_SMEM / STAGE : 8;
    static constexpr int LOOK = STAGES - 2;      // stages loaded ahead
    static_assert(STAGES >= 3, "wgmma ring too shallow");
};

// wgmma.mma_async m64nNk16 f32 += bf16 (A: 4 registers, the m16n8k16 A fragment of each warp's 16
// rows) x bf16 (B: descriptor, K-major: imm-trans-b 0); scale-d = 1 (accumulate; the accumulators
// start at zero).  One specialisation per N (written out: the operand list is literal).
template <int N>
struct Wgmma;
template <>
struct Wgmma<16> {
    static DEV void mma(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<32> {
    static DEV void mma(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<48> {
    static DEV void mma(float (&d)[24], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<64> {
    static DEV void mma(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<80> {
    static DEV void mma(float (&d)[40], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, {%40, %41, %42, %43}, %44, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<96> {
    static DEV void mma(float (&d)[48], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<112> {
    static DEV void mma(float (&d)[56], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, {%56, %57, %58, %59}, %60, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};
template <>
struct Wgmma<128> {
    static DEV void mma(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n\t}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    }
};

DEV void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEV void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
DEV void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pin registers at a point of the instruction stream (CUTLASS's warpgroup_fence_operand): an empty
// volatile asm that "modifies" them, so the compiler cannot move plain reads / writes of the
// accumulators across the wgmma fence / wait instructions (the epilogue above wait_group 0, the
// zero-fill below the first wgmma), which ptxas would answer by serialising every wgmma (C7514/5).
template <int N>
DEV void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
DEV void pin(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// K-major SWIZZLE_128B descriptor of the B sub-tile k-step at shared address a (see the layout)
DEV u64 b_desc(u32 a) {
    return (1ull << 62) | ((u64)(1024 >> 4) << 32) | (u64)((a & 0x3ffffu) >> 4);
}

// logical column L of a 128-chunk -> its stored (permuted) position (the section comment)
DEV int wg_perm(int L) {
    return 16 * ((L >> 2) & 7) + 8 * ((L >> 1) & 1) + 2 * (L >> 5) + (L & 1);
}

// weight row rho of the CTA tile (128 wg + 64 mt + r) -> output row o and matrix (gate/up: mt = 1 is W3)
template <bool GATEUP>
DEV int wg_row(int rho, int n0, bool& second) {
    if (GATEUP) {
        second = ((rho >> 6) & 1) != 0;
        return n0 + 64 * (rho >> 7) + (rho & 63);
    }
    second = false;
    return n0 + rho;
}

// This thread's share of every stage's copies (sources at stage 0): 4 raw granules (rows
// tid / 4 + 64 u, 16-byte block tid % 4), one scale row (rho = tid), NB / 16 activation granules
// (tokens tid / 16 + 16 u, 16-byte chunk tid % 16 of the permuted 128-chunk).
template <bool NV, int NB>
struct WgCopies {
    const u8* w[4];
    const u8* s;
    const u16* x;
    u32 wd, sd, xd;
    u32 wok, sok;
    int xtok0;

    template <bool GATEUP>
    DEV void init(int n0, int N, int K, const u8* pA, const u8* sA, const u8* pB, const u8* sB, const u16* act) {
        using L = WgSmem<NV, NB>;
        const int tid = threadIdx.x;
        const i64 kb = K >> 1, sbr = K / (NV ? 16 : 32);
        wok = 0u;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int rho = (tid >> 2) + 64 * u;
            bool second;
            const int o = wg_row<GATEUP>(rho, n0, second);
            const u8* base = second ? pB : pA;
            w[u] = o < N ? base + (i64)o * kb + 16 * (tid & 3) : base;
            wok |= (o < N ? 1u : 0u) << u;
        }
        // row (tid >> 2) + 64 u: ((rho >> 1) & 3) == ((tid >> 3) & 3) for every u
        wd = L::B + (tid >> 2) * 64 + 16 * ((tid & 3) ^ ((tid >> 3) & 3));
        {
            bool second;
            const int o = wg_row<GATEUP>(tid, n0, second);
            const u8* base = second ? sB : sA;
            s = o < N ? base + (i64)o * sbr : base;
            sok = o < N ? 1u : 0u;
            sd = L::B + L::W + tid * L::SB;
        }
        const int j = tid & 15;
        xtok0 = tid >> 4;  // token of u = 0; (token & 7) is the same for every u
        x = act + (i64)xtok0 * K + 8 * j;
        xd = (j >> 3) * L::BSUB + xtok0 * 128 + (((j & 7) ^ (xtok0 & 7)) << 4);
    }

    // stage c into the ring slot at shared address st
    DEV void issue(u32 st, int c, int ntok, int K) const {
        using L = WgSmem<NV, NB>;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const bool ok = (wok >> u) & 1u;
            cp_async16_sa(st + wd + 4096 * u, ok ? w[u] + 64 * c : w[u], ok);
        }
        cp_async_ca_sa<L::SB>(st + sd, sok ? s + L::SB * c : s, sok != 0u);
#pragma unroll
        for (int u = 0; u < NB / 16; ++u) {
            const bool ok = xtok0 + 16 * u < ntok;
            cp_async16_sa(st + xd + 2048 * u, ok ? x + (i64)16 * u * K + WG_KC * c : x, ok);
        }
    }
};

template <bool GATEUP, bool NV, int NB>
DEV void wgmma_body(unsigned char* smem, const u8* __restrict__ pa, const u8* __restrict__ sa,
                    const u8* __restrict__ pb, const u8* __restrict__ sbp, i64 p_stride, i64 s_stride,
                    const float* __restrict__ ws2a, const float* __restrict__ ws2b, i64 e, i64 r0, int ntok,
                    const u16* __restrict__ act, int N, int K, const float* __restrict__ wts,
                    const int* __restrict__ flat, double limit, u16* __restrict__ hout, float* __restrict__ yout) {
    using L = WgSmem<NV, NB>;
    constexpr int NA = NB / 2;  // accumulator registers per m64 tile
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int wg = warp >> 2, wl = warp & 3;
    const int n0 = blockIdx.x * (GATEUP ? WG_ROWS / 2 : WG_ROWS);
    const u8* pA = pa + e * p_stride;
    const u8* sA = sa + e * s_stride;
    const u8* pB = GATEUP ? pb + e * p_stride : pA;
    const u8* sB = GATEUP ? sbp + e * s_stride : sA;
    float s2a = 1.0f, s2b = 1.0f;
    if (NV) {
        s2a = __ldg(ws2a + e);
        s2b = GATEUP ? __ldg(ws2b + e) : s2a;
    }
    const int nchunks = K / WG_KC;
    WgCopies<NV, NB> cps;
    cps.template init<GATEUP>(n0, N, K, pA, sA, pB, sB, act + r0 * K);
    const u32 sm0 = smem_addr(smem);

#pragma unroll
    for (int s = 0; s < L::LOOK; ++s) {
        if (s < nchunks) cps.issue(sm0 + s * L::STAGE, s, ntok, K);
        cp_async_commit();
    }

    float acc[2][NA];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < NA; ++i) acc[mt][i] = 0.0f;
    pin(acc[0]);
    pin(acc[1]);

    // this thread's 4 weight rows: [2 mt + hh] -> rho = 128 wg + 64 mt + 16 wl + 8 hh + g
    int wrow[4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) wrow[2 * mt + hh] = 128 * wg + 64 * mt + 16 * wl + 8 * hh + g;

    for (int c = 0; c < nchunks; ++c) {
        cp_async_wait<L::LOOK - 1>();  // stage c landed (this thread's copies)
        fence_proxy_async();           // ... and is visible to the async proxy (wgmma's B reads)
        __syncthreads();               // every thread's copies of stage c; every wgmma of stage c - 2 done
        {
            const int nc = c + L::LOOK;
            if (nc < nchunks) cps.issue(sm0 + (nc % L::STAGES) * L::STAGE, nc, ntok, K);
            cp_async_commit();
        }
        const int slot = c % L::STAGES;
        const unsigned char* st = smem + slot * L::STAGE;
        const unsigned char* ws = st + L::B;
        const unsigned char* ss = st + L::B + L::W;
        const u32 bst = sm0 + slot * L::STAGE;
        uint4 wv[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int rho = wrow[2 * mt + hh];
                wv[mt][hh] = lds128(ws + rho * 64 + 16 * (q ^ ((rho >> 1) & 3)));
            }
        u32 tb[4][4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            row_tables<GATEUP, NV>(ss, wrow, q, w, s2a, s2b, tb);
            wg_wait<1>();  // the group two back (whose A registers these replace) is complete
            u32 a[2][2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    u32 word = word_of(wv[mt][hh], w);
                    pin(word);  // the decode stays below the wait: at most two A register sets live
                    decode8(word, tb[2 * mt + hh], a[mt][hh]);
                }
            wg_fence();
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int t = 2 * w + s;  // k-step of the stage: sub-tile t / 4, 32 B per step inside
                const u64 desc = b_desc(bst + (t >> 2) * L::BSUB + 32 * (t & 3));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    Wgmma<NB>::mma(acc[mt], a[mt][0][2 * s], a[mt][1][2 * s], a[mt][0][2 * s + 1], a[mt][1][2 * s + 1],
                                   desc);
            }
            wg_commit();
            pin(acc[0]);
            pin(acc[1]);
        }
    }
    wg_wait<0>();
    pin(acc[0]);
    pin(acc[1]);
    cp_async_wait<0>();  // nothing real is pending (the tail commits are empty); leave no group behind

    // epilogue: acc[mt][4 nt + 2 hh + cc] = (row 16 wl + g + 8 hh of tile mt, token 8 nt + 2 q + cc)
#pragma unroll
    for (int nt = 0; nt < NB / 8; ++nt) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
            const int tok = 8 * nt + 2 * q + cc;
            if (tok >= ntok) continue;
            const i64 p = r0 + tok;
            if (GATEUP) {
                const float wt = __ldg(wts + __ldg(flat + p));
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int o = n0 + 64 * wg + 16 * wl + g + 8 * hh;
                    if (o < N) {
                        const float gv = round_bf16(acc[0][4 * nt + 2 * hh + cc]);
                        const float uv = round_bf16(acc[1][4 * nt + 2 * hh + cc]);
                        hout[p * N + (o & ~127) + wg_perm(o & 127)] =
                            (u16)f32_to_bf16(swiglu_value(gv, uv, wt, true, limit));
                    }
                }
            } else {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int o = n0 + 128 * wg + 64 * mt + 16 * wl + g + 8 * hh;
                        if (o < N) yout[p * N + o] = acc[mt][4 * nt + 2 * hh + cc];
                    }
            }
        }
    }
}

// the item of this CTA, its token tile NB (16 .. 128, from its row count), the 1024-aligned ring
template <bool GATEUP, bool NV>
DEV void wgmma_dispatch(const u8* pa, const u8* sa, const u8* pb, const u8* sbp, i64 p_stride, i64 s_stride,
                        const float* ws2a, const float* ws2b, const int* __restrict__ items, const u16* act, int N,
                        int K, const float* wts, const int* flat, double limit, u16* hout, float* yout) {
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    unsigned char* smem = wg_smem_raw + ((1024u - (smem_addr(wg_smem_raw) & 1023u)) & 1023u);
    const i64 e = __ldg(items + 4 * blockIdx.y);
    const i64 r0 = __ldg(items + 4 * blockIdx.y + 1);
    const int ntok = __ldg(items + 4 * blockIdx.y + 2);
#define WG_CASE(NB_)                                                                                             \
    wgmma_body<GATEUP, NV, NB_>(smem, pa, sa, pb, sbp, p_stride, s_stride, ws2a, ws2b, e, r0, ntok, act, N, K, wts, \
                                flat, limit, hout, yout);                                                         \
    break;
    switch ((ntok + 15) >> 4) {
        case 1: WG_CASE(16)
        case 2: WG_CASE(32)
        case 3: WG_CASE(48)
        case 4: WG_CASE(64)
        case 5: WG_CASE(80)
        case 6: WG_CASE(96)
        case 7: WG_CASE(112)
        case 8: WG_CASE(128)
        default: break;  // n outside 1..128: the wrapper never builds such items
    }
#undef WG_CASE
}

}  // namespace wg

// gate/up: hs[r0 + t, perm(i)] for the item's tokens t < n (1..128) and i < N (= I, N % 128 == 0);
// xs [P, K = D] bf16 PERMUTED per 128-chunk (moe_gather_bf16_perm), w1 / w3 stacked [E, I, D/2]
// packed + [E, I, D/32 | D/16] scales, wts [T * k] f32, flat [P] int32. grid (N / 128, items).
extern "C" __global__ void __launch_bounds__(wg::WG_THREADS, 1)
wgmma_gateup_mxfp4(const u8* __restrict__ w1p, const u8* __restrict__ w1s, const u8* __restrict__ w3p,
                   const u8* __restrict__ w3s, long long p_stride, long long s_stride, const int* __restrict__ items,
                   const u16* __restrict__ xs, const float* __restrict__ wts, const int* __restrict__ flat,
                   u16* __restrict__ hs, int N, int K, double limit) { PDL_ENTRY();
    wg::wgmma_dispatch<true, false>(w1p, w1s, w3p, w3s, p_stride, s_stride, nullptr, nullptr, items, xs, N, K, wts,
                                    flat, limit, hs, nullptr);
}

extern "C" __global__ void __launch_bounds__(wg::WG_THREADS, 1)
wgmma_gateup_nvfp4(const u8* __restrict__ w1p, const u8* __restrict__ w1s, const u8* __restrict__ w3p,
                   const u8* __restrict__ w3s, long long p_stride, long long s_stride, const float* __restrict__ ws2_1,
                   const float* __restrict__ ws2_3, const int* __restrict__ items, const u16* __restrict__ xs,
                   const float* __restrict__ wts, const int* __restrict__ flat, u16* __restrict__ hs, int N, int K,
                   double limit) { PDL_ENTRY();
    wg::wgmma_dispatch<true, true>(w1p, w1s, w3p, w3s, p_stride, s_stride, ws2_1, ws2_3, items, xs, N, K, wts, flat,
                                   limit, hs, nullptr);
}

// down: ys[r0 + t, o] (f32) for t < n, o < N (= D); hs [P, K = I] bf16 PERMUTED per 128-chunk (the
// gate/up kernels' output); w2 stacked [E, D, I/2]. grid (ceil(N / 256), items).
extern "C" __global__ void __launch_bounds__(wg::WG_THREADS, 1)
wgmma_down_mxfp4(const u8* __restrict__ w2p, const u8* __restrict__ w2s, long long p_stride, long long s_stride,
                 const int* __restrict__ items, const u16* __restrict__ hs, float* __restrict__ ys, int N,
                 int K) { PDL_ENTRY();
    wg::wgmma_dispatch<false, false>(w2p, w2s, nullptr, nullptr, p_stride, s_stride, nullptr, nullptr, items, hs, N,
                                     K, nullptr, nullptr, 0.0, nullptr, ys);
}

extern "C" __global__ void __launch_bounds__(wg::WG_THREADS, 1)
wgmma_down_nvfp4(const u8* __restrict__ w2p, const u8* __restrict__ w2s, long long p_stride, long long s_stride,
                 const float* __restrict__ ws2, const int* __restrict__ items, const u16* __restrict__ hs,
                 float* __restrict__ ys, int N, int K) { PDL_ENTRY();
    wg::wgmma_dispatch<false, true>(w2p, w2s, nullptr, nullptr, p_stride, s_stride, ws2, nullptr, items, hs, N, K,
                                    nullptr, nullptr, 0.0, nullptr, ys);
}

// moe_gather_bf16_perm: moe_gather_bf16 with every 128-element chunk of a row stored in the wgmma
// kernels' k order: xs[p, 128 c + 16 t + 8 hi + 2 q + j] = bf16(x[src[p], 128 c + 32 q + 4 t + 2 hi + j]),
// zeros where src[p] < 0.  D % 128 == 0.  Thread = one 16-byte output granule (t, hi): 4 float2 loads.
extern "C" __global__ void __launch_bounds__(256)
moe_gather_bf16_perm(const float* __restrict__ x, const int* __restrict__ src, u16* __restrict__ xs, long long P,
                     int D) { PDL_ENTRY();
    const int cpr = D >> 3;
    const i64 total = P * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 p = i / cpr;
        const int c8 = (int)(i % cpr);  // output granule: chunk c8 >> 4, t = (c8 >> 1) & 7, hi = c8 & 1
        const int t = __ldg(src + p);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (t >= 0) {
            const float* xr = x + (i64)t * D + 128 * (c8 >> 4) + 4 * ((c8 >> 1) & 7) + 2 * (c8 & 1);
            float f[8];
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) {
                const float2 a = __ldg(reinterpret_cast<const float2*>(xr + 32 * qq));
                f[2 * qq] = a.x;
                f[2 * qq + 1] = a.y;
            }
            v = pack8(f);
        }
        stg16(xs + i * 8, v);
    }
}
