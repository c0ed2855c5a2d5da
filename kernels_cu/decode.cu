// Device decode-step glue (memra_dsv4/gpu/ops_decode.py, used by memra_dsv4/gpu/step.py).
// Every kernel that depends on the sequence position reads it from the device (pos[0]), so the
// launch sequence of a decode step is identical at every position and can be graph-captured.
//
// The GEMVs are named for their bf16 activations; W comes in either dense form, bf16 bits or
// the stored FP8 (e4m3 bytes + e8m0 128x128 block scales), with bit-identical results (see
// warp_rows_dot).
// gemv_bf16_r{1,2,4}, gemv_fp8_r{1,2,4,8}, gemv_fp8_r4t2 (W bf16 bits / e4m3 bytes):
//                 y[o] = sum_k W[o, k] x[xo(o) + k], f32 accumulation in a fixed order that is a
//                 function of K only (warp_rows_dot: lane-strided chunks, 4 partial sums, then
//                 a butterfly), stored f32 or bf16 (RNE).  xo(o) = (o / rows_per_group) * K
//                 (grouped projection, e.g. wo_a); rows_per_group = 0: one x for every row.  One
//                 warp per R rows (the suffix; R | rows_per_group; t2: FP8 loads of two trips
//                 at once), 4 warps per CTA.  K % 8 == 0, 16-byte aligned W rows and x.  The
//                 bits depend on neither R nor T.
// gemv_bf16_multi_r{1,4}: the same per row over a table of projections sharing x (GemvSeg
//                 below), incl. the compressor's pending-row write + ape (what pending_write +
//                 add_ape do).
// gemv_bf16_swiglu_p{1,2}: shared-expert gate/up GEMVs + clamped SwiGLU in one launch (P
//                 outputs, 2P rows, per warp).  Variants _p1t2 / _p2t2, _multi_r1t2 / _r4t2: bf16
//                 rows two trips at once (same bits).
// Variants of the three (same bits, speed only; picked by ops_decode's selection, the defaults
//                 above unchanged): gemv_bf16_r{1,2}t2, gemv_fp8_r1t4 / r2t2 / r2t4 (more warps,
//                 more trips of loads at once) and the TMA bulk streaming kernels
//                 gemv_{bf16,fp8}_bulk_r*s*, gemv_bf16_multi_bulk_r*s*, gemv_bf16_swiglu_bulk_p*s*
//                 (gb_stream below), the persistent register-ring gemv_bf16_ps_r*d*
//                 (gemv_ps_rows: bf16, K % 1024 == 0) and gemv_bf16_pl_r* (gemv_pl_rows: the
//                 first trip's weights loaded before the PDL wait; bf16, K % 1024 == 0).
// embed_gather:   streams[j, :] = embed[tok[0], :] for the hc streams (bf16 bits).
// step_scalars:   aux[0] = (pos + 1) / 4 (indexer n_valid), aux[1 + i] = max(pos + 1 - r_i, 0)
//                 (the position of the block an emission at pos closes), i < 4.
// greedy_argmax_f32: tok[0] = np.argmax(logits) (first maximum; a NaN is the greatest), one CTA;
//                 then hist[pos + 1] = tok[0] and pos[0] += 1; the device step's last launch.
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
#include "gemv_bf16_row.cuh"
#include "rmsnorm_row.cuh"

using namespace memra;

// The dense GEMVs' L2 prefetch budget (see "L2 prefetch of the weights before the PDL wait"
// below); at file scope with C linkage: the host finds it by this name (cuModuleGetGlobal).
extern "C" { __constant__ u64 memra_l2_prefetch_bytes; }

namespace {

// 8 stored e4m3 bytes -> 8 f32 (exact: every e4m3 value is a normal f16, hardware converts:
// one F2FP.F16.E4M3.UNPACK_B per pair, then HADD2.F32 per value).
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

// ---------------------------------------------------------------------------- dense GEMV core
// A chunk is 8 consecutive columns of a weight row: 16 bytes of bf16 bits or 8 stored e4m3
// bytes.  Its raw bytes stay in registers until they are used (4 or 2 registers per chunk), so
// a warp can keep R rows x GEMV_UNROLL chunks (x T trips) of loads in flight per lane (256 B
// per lane at the default configurations: bf16 R = 4; fp8 R = 8, or R = 4 x T = 2) without
// spilling.
template <bool FP8> struct RawChunk { using T = uint4; };
template <> struct RawChunk<true> { using T = uint2; };

template <bool FP8>
DEV typename RawChunk<FP8>::T load_raw(const void* wrow, int c) {
    if constexpr (FP8) return ldg_stream8(reinterpret_cast<const u8*>(wrow) + (i64)c * 8);
    else return ldg_stream16(reinterpret_cast<const u16*>(wrow) + (i64)c * 8);
}

// The 8 f32 weights of a chunk: bf16 bits widened (exact), or e4m3 * sc with sc = 2^e the
// chunk's e8m0 block scale (exact in f32: <= 4 significant bits, and a weight the loader
// accepts is in range; f32 denormal products flush like the bf16 arm's denormal inputs do).
DEV void dequant_chunk(const uint4& v, float, float* f) { unpack8(v, f); }
DEV void dequant_chunk(const uint2& v, float sc, float* f) {
    unpack8_e4m3(v, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(f[i], sc);
}

// e8m0_to_f32 (common.cuh) as selects: the same values, but no branch in the unrolled trip
// (a branch there splits ptxas's schedule and stops it from issuing the trip's loads together).
DEV float e8m0_scale(u32 b) {
    const float v = __uint_as_float(b << 23);
    const float lo = __uint_as_float(0x00400000u), nan = __uint_as_float(0x7fc00000u);
    return b == 0u ? lo : (b == 255u ? nan : v);
}

// One warp's dot products of R weight rows with the same x (K % 8 == 0, 16-byte aligned rows
// and x): out[r] = wrow[r] . x on every lane.  THE ORDER (a function of K only, the same for
// every R and for both weight forms, so a row's bits depend on neither the launch shape nor
// the form):  lane l owns the chunks c = l + 32 i (i = 0, 1, ...; n_l of them); chunk i goes to
// partial i % GEMV_UNROLL while it belongs to a complete group of GEMV_UNROLL (i < GEMV_UNROLL
// * floor(n_l / GEMV_UNROLL)), the remaining (tail) chunks to partial 0; each partial is a chain
// of __fmaf_rn over its chunks in ascending i, columns in ascending order; the partials are
// added in index order, then the butterfly warp_sum (xor 16, 8, 4, 2, 1).  Since every product
// of two bf16 values (or of e4m3 * 2^e and bf16) is exact in f32, the FP8 form returns the
// bf16 form's bits on the exactly dequantised weights.  (This is the order of the earlier
// one-row-per-warp warp_row_dot, so results are bit-identical to it.)
// Phases (each lane walks them in this order, which keeps the order above): FP8 only, while
// every lane of the warp has a complete group left (warp-uniform), T trips at once, then
// single trips, scale bytes by shuffle; then the lane's own remaining complete groups (scale
// byte loads); then its tail chunks.  Per trip a lane issues R * GEMV_UNROLL weight loads
// (streamed past L1), GEMV_UNROLL x loads (L1-cached: every warp of the CTA reads x; shared by
// the R rows) and the scale loads before any arithmetic.  (The phase/lane/partial/scale-byte
// bookkeeping was checked against the previous kernel's loops for every K = 8 .. 8992, bf16
// and FP8, T = 1 and 2, by enumerating per lane the (partial, chunk, scale block) sequence.)
// SROWS (FP8 only): rows [j R / SROWS, (j + 1) R / SROWS) use the scale row srow[j] (the
// e8m0 row of their 128-row block; the chunk c of such a row has the scale srow[j][c >> 4]).
// GEMV_UNROLL, partials_total (the end of a row) and bf16_trip_fma (one bf16 trip of R rows):
// gemv_bf16_row.cuh, shared with experts.cu's down_combine _w2 kernels (the same row arithmetic).

// T trips at once: chunks c + 32 u (u < T GEMV_UNROLL) of the R rows into partials
// u % GEMV_UNROLL (ascending u, so a partial's chain is the same as T single trips').
// SHFL_SCALE (FP8, warp-uniform trips only): the 8 T scale bytes the trips need (blocks
// 8t .. 8t + 8T - 1 from trip t: chunk c + 32 u is in block 8t + 2u + (lane >> 4)) come from
// one byte load per lane and shuffles, instead of T GEMV_UNROLL byte loads per lane (fewer
// loads, so ptxas issues all of them before the first FMA).
template <bool FP8, int R, int SROWS, bool SHFL_SCALE, int T>
DEV void rows_trip(const void* const* wrow, const u8* const* srow, const u16* __restrict__ x,
                   int c, int lane, float (&acc)[R][GEMV_UNROLL]) {
    using Raw = typename RawChunk<FP8>::T;
    constexpr int NU = T * GEMV_UNROLL;
    Raw raw[R][NU];
    uint4 xv[NU];
    u32 sb[SROWS][NU];
#pragma unroll
    for (int u = 0; u < NU; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r][u] = load_raw<FP8>(wrow[r], c + 32 * u);
#pragma unroll
    for (int u = 0; u < NU; ++u) xv[u] = ldg16(x + (i64)(c + 32 * u) * 8);
    if constexpr (FP8) {
#pragma unroll
        for (int j = 0; j < SROWS; ++j) {
            if constexpr (SHFL_SCALE) {
                sb[j][0] = __ldg(srow[j] + (((c >> 4) & ~7) + (lane & (8 * T - 1))));
            } else {
#pragma unroll
                for (int u = 0; u < NU; ++u) sb[j][u] = __ldg(srow[j] + ((c + 32 * u) >> 4));
            }
        }
    }
#pragma unroll
    for (int u = 0; u < NU; ++u) {
        float b[8];
        unpack8(xv[u], b);
        float sc[SROWS];
#pragma unroll
        for (int j = 0; j < SROWS; ++j) {
            if constexpr (!FP8) sc[j] = 1.0f;
            else if constexpr (SHFL_SCALE)
                sc[j] = e8m0_scale(__shfl_sync(0xffffffffu, sb[j][0], 2 * u + (lane >> 4)));
            else sc[j] = e8m0_scale(sb[j][u]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float a[8];
            dequant_chunk(raw[r][u], sc[r / (R / SROWS)], a);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                acc[r][u % GEMV_UNROLL] = __fmaf_rn(a[i], b[i], acc[r][u % GEMV_UNROLL]);
        }
    }
}

// T (FP8 only): warp-uniform trips are taken T at a time while T fit (T = 2: 16 weight chunks
// per row per lane in flight, for long rows with few of them: wo_b, shared_w2).
template <bool FP8, int R, int SROWS, int T = 1>
DEV void warp_rows_dot(const void* const* wrow, const u8* const* srow, const u16* __restrict__ x,
                       int K, int lane, float* out) {
    static_assert(R % SROWS == 0, "SROWS must divide R");
    static_assert(T == 1 || T == 2 || T == 4, "T: 1, 2 or 4 trips at once");
    using Raw = typename RawChunk<FP8>::T;
    const int nc = K >> 3;
    float acc[R][GEMV_UNROLL];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
    int c = lane;  // = lane + 32 GEMV_UNROLL t in trip t
    if constexpr (FP8) {  // trips where every lane has a complete group (c | 31: lane 31's c)
        if constexpr (T == 4) {
            for (; (c | 31) + 32 * (4 * GEMV_UNROLL - 1) < nc; c += 4 * 32 * GEMV_UNROLL)
                rows_trip<FP8, R, SROWS, true, 4>(wrow, srow, x, c, lane, acc);
        }
        if constexpr (T >= 2) {
            for (; (c | 31) + 32 * (2 * GEMV_UNROLL - 1) < nc; c += 2 * 32 * GEMV_UNROLL)
                rows_trip<FP8, R, SROWS, true, 2>(wrow, srow, x, c, lane, acc);
        }
        for (; (c | 31) + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL)
            rows_trip<FP8, R, SROWS, true, 1>(wrow, srow, x, c, lane, acc);
    } else if constexpr (T > 1) {  // bf16: T of the lane's complete groups at once
        for (; c + 32 * (T * GEMV_UNROLL - 1) < nc; c += T * 32 * GEMV_UNROLL)
            rows_trip<FP8, R, SROWS, false, T>(wrow, srow, x, c, lane, acc);
    }
    for (; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL)  // the lane's complete groups
        rows_trip<FP8, R, SROWS, false, 1>(wrow, srow, x, c, lane, acc);
    for (; c < nc; c += 32) {  // tail chunks (fewer than GEMV_UNROLL per lane) -> partial 0
        Raw raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r] = load_raw<FP8>(wrow[r], c);
        float b[8];
        unpack8(ldg16(x + (i64)c * 8), b);
        float sc[SROWS];
#pragma unroll
        for (int j = 0; j < SROWS; ++j) sc[j] = FP8 ? e8m0_scale(__ldg(srow[j] + (c >> 4))) : 1.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float a[8];
            dequant_chunk(raw[r], sc[r / (R / SROWS)], a);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][0] = __fmaf_rn(a[i], b[i], acc[r][0]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = partials_total(acc[r]);
}

// Row o of a dense weight in either form.
template <bool FP8>
DEV const void* w_row(const void* W, i64 o, int K) {
    return FP8 ? (const void*)(reinterpret_cast<const u8*>(W) + o * K)
               : (const void*)(reinterpret_cast<const u16*>(W) + o * K);
}

DEV void store_out(void* y, i64 o, float v, int out_bf16) {
    if (out_bf16) reinterpret_cast<u16*>(y)[o] = (u16)f32_to_bf16(v);
    else reinterpret_cast<float*>(y)[o] = v;
}

// CTAs of 4 warps: the grids are many small CTAs, so the SMs get nearly equal shares of rows
// even for the 4096-row projections (1024 warps at R = 4).
constexpr int GEMV_THREADS = 128;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;
// Launch bounds' minimum resident CTAs: 4 CTAs x 128 threads caps the kernels at 128 registers
// (16 warps per SM).  The minimum also matters for the schedule: without it ptxas sinks most
// of a trip's loads below the first FMAs (SASS: 5 of gemv_bf16_r4's 20 loads issued before the
// first FFMA, 76 registers); with it all 20 go out together (128 registers), i.e. 8 KB of
// weights in flight per warp, 128 KB per SM.  The FP8 defaults gemv_fp8_r8 (K < 2048) and
// gemv_fp8_r4t2 (two trips at once, K >= 2048) take a bound of 3 CTAs: 168 registers, and
// all 37 (32 weight + 4 x + 1 scale) resp. 41 (32 + 8 + 1) loads before the first FFMA: 8 KB
// per warp, 96 KB per SM.  (The one-row-per-warp kernel this replaces: 124 registers, 16 warps
// per SM, 2 KB (bf16) or 1 KB (fp8, K = 1024) in flight per warp.)
#ifndef GEMV_MINB
#define GEMV_MINB 4
#endif

DEV int gemv_warp_id() { return (int)blockIdx.x * GEMV_WARPS + (int)(threadIdx.x >> 5); }

// ------------------------------------------------- L2 prefetch of the weights before the PDL wait
// A dense GEMV's weights are static: nothing of the step writes them, so a warp may ask for its
// rows BEFORE griddepcontrol.wait (PDL_ENTRY_PREFETCH, common.cuh).  Under PDL this launch's CTAs
// become resident while the predecessor still runs (the predecessor triggers right after its own
// wait); in the device step the predecessor is usually a latency-bound kernel (hc_boundary,
// rmsnorm, the attention combine, the router) that leaves HBM idle, so the weight stream of this
// GEMV starts that much earlier.  cp.async.bulk.prefetch.L2 is a hint: no register, no shared
// memory, no completion to wait for, and it changes no value this kernel computes (the loads
// read the same bytes from L2 or HBM): the outputs are bit-identical with any budget.
// memra_l2_prefetch_bytes (per module, per device; memra_dsv4/gpu/ops_decode.py sets it from the
// seam MEMRA_DSV4_L2_PREFETCH; 0 = off) caps what one launch asks for: rows whose first byte lies
// within the first `budget` bytes of their matrix.  A constant, read when a kernel runs, so a
// captured graph follows a new value without a recapture.
namespace {
// lane 0: prefetch `bytes` from p into L2 (16-byte aligned spans only; others are skipped)
DEV void l2_prefetch_span(const void* p, u64 bytes) {
    if (bytes == 0 || (reinterpret_cast<u64>(p) & 15) || (bytes & 15) || bytes >= (1ull << 32)) return;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"((u32)bytes) : "memory");
}

// rows [o0, o0 + n) of a [*, K] weight of row size rowb, if they start within the budget
DEV void l2_prefetch_rows(const void* W, i64 o0, int n, u64 rowb) {
    const u64 budget = memra_l2_prefetch_bytes;
    if (n <= 0 || (u64)o0 * rowb >= budget) return;
    l2_prefetch_span(reinterpret_cast<const u8*>(W) + o0 * rowb, (u64)n * rowb);
}

// gemv_rows' warp: rows [w R, w R + R) of W
template <bool FP8, int R>
DEV void gemv_rows_prefetch(const void* W, int O, int K) {
    if ((threadIdx.x & 31) != 0) return;
    const i64 o0 = (i64)gemv_warp_id() * R;
    if (o0 < O) l2_prefetch_rows(W, o0, min(R, O - (int)o0), (u64)K * (FP8 ? 1 : 2));
}
}  // namespace

// gemv_bf16 body: warp w computes rows [w R, w R + R) (rows past O recompute row O - 1 and are
// not stored).  R divides 128 and the first row is a multiple of R, so the R rows share one
// e8m0 scale row; R divides rows_per_group (the wrapper picks R so), so they share one x.
template <bool FP8, int R, int T>
DEV void gemv_rows(const void* __restrict__ W, const u8* __restrict__ S, int ld_s,
                   const u16* __restrict__ x, void* __restrict__ y, int O, int K,
                   int rows_per_group, int out_bf16) {
    static_assert(128 % R == 0, "R must divide the 128-row scale block");
    const int lane = threadIdx.x & 31;
    const int o0 = gemv_warp_id() * R;
    if (o0 >= O) return;
    const void* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w_row<FP8>(W, min(o0 + r, O - 1), K);
    const u8* sr[1] = {FP8 ? S + (i64)(o0 >> 7) * ld_s : nullptr};
    const u16* xv = x + (rows_per_group > 0 ? (i64)(o0 / rows_per_group) * K : (i64)0);
    float acc[R];
    warp_rows_dot<FP8, R, 1, T>(wr, sr, xv, K, lane, acc);
    if (lane != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (o0 + r < O) store_out(y, o0 + r, acc[r], out_bf16);
}

}  // namespace

// W: bf16 bits [O, K] (gemv_bf16_r*) or e4m3 bytes [O, K] with e8m0 scales S [ceil(O/128),
// ld_s] (gemv_fp8_r*); R rows per warp.
#define GEMV_ROWS_KERNEL(NAME, FP8, R, T, MINB)                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W, const u8* __restrict__ S, int ld_s, const u16* __restrict__ x, \
         void* __restrict__ y, int O, int K, int rows_per_group, int out_bf16) {                    \
        PDL_ENTRY_PREFETCH(gemv_rows_prefetch<FP8, R>(W, O, K));                                   \
        gemv_rows<FP8, R, T>(W, S, ld_s, x, y, O, K, rows_per_group, out_bf16);                    \
    }
GEMV_ROWS_KERNEL(gemv_bf16_r1, false, 1, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_bf16_r2, false, 2, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_bf16_r4, false, 4, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r1, true, 1, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r2, true, 2, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r4, true, 4, 1, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r8, true, 8, 1, 3)    // 168 registers, all 37 loads of a trip together
GEMV_ROWS_KERNEL(gemv_fp8_r4t2, true, 4, 2, 3)  // 2 trips at once: the long-K FP8 default
// Variants (ops_decode.GEMV_VARIANTS; same bits, selected through ops_decode.GEMV_SELECT or
// MEMRA_DSV4_GEMV_VARIANT): more warps (fewer rows each) with more trips in flight per warp, for
// the small-O shapes whose R = 4 grids cover half the SMs or less (wq_a, wkv: 64 / 32 CTAs).
GEMV_ROWS_KERNEL(gemv_bf16_r1t2, false, 1, 2, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_bf16_r2t2, false, 2, 2, 3)
GEMV_ROWS_KERNEL(gemv_fp8_r1t4, true, 1, 4, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r2t2, true, 2, 2, GEMV_MINB)
GEMV_ROWS_KERNEL(gemv_fp8_r2t4, true, 2, 4, 3)

// ------------------------------------------------ multi-row bf16 GEMV (the verify step's)
// gemv_bf16_x{NX}_r{R}: Y[j, o] = W[o, :] . X[j, xo(o) + :] for the nx <= NX activation rows j
// of a verify (docs/verify_step_plan.md, stage 1): each weight chunk is loaded ONCE and used for
// every row, so nx rows cost about one row's bytes.  Per (j, o) the arithmetic is THE ORDER of
// warp_rows_dot (bf16, the lane's complete groups chunk c + 32 u into partial u, the tail chunks
// into partial 0, __fmaf_rn(w, x, acc) columns ascending, partials_total), so row j of the output
// is bit-identical to gemv_bf16's output for X[j] alone (tests/gpu/test_verify_kernels_gpu.py).
// X: nx rows of groups * K bf16 values, row stride ldx (elements; 16-byte aligned rows); Y: nx
// rows of O values (f32 or bf16 bits), row stride ldy.  rows_per_group as gemv_bf16 (R | it).
// Accumulators NX R GEMV_UNROLL floats per lane (32 at NX R = 8): the x chunks are read per use
// through L1 (every warp of the CTA reads the same X), the weights streamed past L1.
// The x-rows loop: acc[j][r][u] of rows wr[r] against X row j (j < nx), the order above.  Shared
// by gemv_xrows and the table form gemv_multi_xrows.
template <int NX, int R>
DEV void xrows_dot(const u16* const (&wr)[R], const u16* __restrict__ X, int ldx, i64 xo, int nx,
                   int nc, int lane, float (&acc)[NX][R][GEMV_UNROLL]) {
#pragma unroll
    for (int j = 0; j < NX; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) acc[j][r][u] = 0.0f;
    int c = lane;
    for (; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL) {  // complete groups
        uint4 raw[R][GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) raw[r][u] = ldg_stream16(wr[r] + (i64)(c + 32 * u) * 8);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            float a[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) unpack8(raw[r][u], a[r]);
#pragma unroll
            for (int j = 0; j < NX; ++j) {
                if (j < nx) {  // warp-uniform
                    float b[8];
                    unpack8(ldg16(X + (i64)j * ldx + xo + (i64)(c + 32 * u) * 8), b);
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < 8; ++i)
                            acc[j][r][u] = __fmaf_rn(a[r][i], b[i], acc[j][r][u]);
                }
            }
        }
    }
    for (; c < nc; c += 32) {  // tail chunks (fewer than GEMV_UNROLL per lane) -> partial 0
        float a[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack8(ldg_stream16(wr[r] + (i64)c * 8), a[r]);
#pragma unroll
        for (int j = 0; j < NX; ++j) {
            if (j < nx) {
                float b[8];
                unpack8(ldg16(X + (i64)j * ldx + xo + (i64)c * 8), b);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[j][r][0] = __fmaf_rn(a[r][i], b[i], acc[j][r][0]);
            }
        }
    }
}

template <int NX, int R>
DEV void gemv_xrows(const u16* __restrict__ W, const u16* __restrict__ X, int ldx, int nx,
                    void* __restrict__ Y, int ldy, int O, int K, int rows_per_group,
                    int out_bf16) {
    const int lane = threadIdx.x & 31;
    const int o0 = gemv_warp_id() * R;
    if (o0 >= O) return;
    const u16* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = W + (i64)min(o0 + r, O - 1) * K;
    const i64 xo = rows_per_group > 0 ? (i64)(o0 / rows_per_group) * K : (i64)0;
    float acc[NX][R][GEMV_UNROLL];
    xrows_dot<NX, R>(wr, X, ldx, xo, nx, K >> 3, lane, acc);
#pragma unroll
    for (int j = 0; j < NX; ++j) {
        if (j < nx) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float v = partials_total(acc[j][r]);
                if (lane == 0 && o0 + r < O)
                    store_out(reinterpret_cast<u8*>(Y) + (i64)j * ldy * (out_bf16 ? 2 : 4), o0 + r,
                              v, out_bf16);
            }
        }
    }
}

#define GEMV_XROWS_KERNEL(NAME, NX, R)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MINB)                          \
    NAME(const u16* __restrict__ W, const u16* __restrict__ X, int ldx, int nx,                    \
         void* __restrict__ Y, int ldy, int O, int K, int rows_per_group, int out_bf16) {          \
        PDL_ENTRY_PREFETCH(gemv_rows_prefetch<false, R>(W, O, K));                                 \
        gemv_xrows<NX, R>(W, X, ldx, nx, Y, ldy, O, K, rows_per_group, out_bf16);                  \
    }
GEMV_XROWS_KERNEL(gemv_bf16_x2_r4, 2, 4)
GEMV_XROWS_KERNEL(gemv_bf16_x4_r2, 4, 2)
GEMV_XROWS_KERNEL(gemv_bf16_x8_r1, 8, 1)

// gemv_bf16_swiglu_x{NX}_p{P}: the shared expert's first half for the nx <= NX rows of a verify
// in one launch, each weight chunk of W1 and W3 loaded once for the rows: H[j, o] =
// swiglu(bf16(W1[o] . X[j]), bf16(W3[o] . X[j])) (clamped at limit, unweighted), the bits of
// gemv_bf16_swiglu for X[j] alone (its dots are warp_rows_dot's bf16 order, which xrows_dot
// keeps; the same bf16 roundings and swiglu_value).  A warp takes P outputs: the P rows of W1
// and the P of W3 in one xrows_dot (2P rows).  X: nx rows of K, row stride ldx; H: nx rows of O
// bf16, row stride ldh.
template <int NX, int P>
DEV void gemv_swiglu_xrows(const u16* __restrict__ W1, const u16* __restrict__ W3, const u16* __restrict__ X,
                           int ldx, int nx, u16* __restrict__ H, int ldh, int O, int K, double limit) {
    const int lane = threadIdx.x & 31;
    const int o0 = gemv_warp_id() * P;
    if (o0 >= O) return;
    const u16* wr[2 * P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
        wr[j] = W1 + (i64)min(o0 + j, O - 1) * K;
        wr[P + j] = W3 + (i64)min(o0 + j, O - 1) * K;
    }
    float acc[NX][2 * P][GEMV_UNROLL];
    xrows_dot<NX, 2 * P>(wr, X, ldx, (i64)0, nx, K >> 3, lane, acc);
#pragma unroll
    for (int j = 0; j < NX; ++j) {
        if (j >= nx) break;  // warp-uniform
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const float g = round_bf16(partials_total(acc[j][p]));
            const float u = round_bf16(partials_total(acc[j][P + p]));
            if (lane == 0 && o0 + p < O)
                H[(i64)j * ldh + o0 + p] = (u16)f32_to_bf16(swiglu_value(g, u, 1.0f, false, limit));
        }
    }
}

// ---------------------------------------------- persistent register-ring bf16 GEMV (variant)
// gemv_bf16_ps_r{R}d{D}: the same rows, the same bits (THE ORDER: trip t of a row group feeds
// chunks lane + 128 t + 32 u into partial u, t ascending, then the partials in index order and
// the butterfly), a different schedule.  The r*t* kernels give each warp R rows and retire it:
// a warp's loads go out once, then it waits, computes and exits, and the SM refills from a new
// CTA, so the bytes in flight per SM dip between warps.  Here a persistent grid (the wrapper
// launches at most the warps resident at once) walks row groups g = w, w + nw, ... as one stream
// of trips; the loads of trip i + D are issued into the ring slot trip i has just used, so D
// trips (D R 2 KB per warp) stay in flight while the warp computes.  bf16 only, K % 1024 == 0
// (every lane has whole trips: no tail chunks), rows_per_group % R == 0 (a group's rows share x).
// x chunks are read at compute time through L1 (shared by every warp of the SM).
template <int R, int D>
DEV void gemv_ps_rows(const u16* __restrict__ W, const u16* __restrict__ x, void* __restrict__ y,
                      int O, int K, int rpg, int out_bf16) {
    const int lane = threadIdx.x & 31;
    const int nw = (int)gridDim.x * GEMV_WARPS, w = gemv_warp_id();
    const int ng = (O + R - 1) / R, ntr = K >> 10;
    const int n = (w < ng ? (ng - 1 - w) / nw + 1 : 0) * ntr;  // this warp's trips
    uint4 raw[D][R][GEMV_UNROLL];
    int ig = w, it = 0;  // issue side: group and trip of the next trip to load
    auto issue = [&](uint4 (&dst)[R][GEMV_UNROLL]) {
        const i64 o0 = (i64)ig * R;
        const i64 col = (i64)(lane + 128 * it) * 8;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u16* row = W + min(o0 + r, (i64)O - 1) * K + col;
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) dst[r][u] = ldg_stream16(row + 256 * u);
        }
        if (++it == ntr) { it = 0; ig += nw; }
    };
#pragma unroll
    for (int d = 0; d < D; ++d)
        if (d < n) issue(raw[d]);
    int cg = w, ct = 0;  // compute side
    float acc[R][GEMV_UNROLL];
    for (int i0 = 0; i0 < n; i0 += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (i0 + d >= n) break;  // warp-uniform
            if (ct == 0) {
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
            }
            const i64 o0 = (i64)cg * R;
            const u16* xv = x + (rpg > 0 ? (o0 / rpg) * K : (i64)0) + (i64)(lane + 128 * ct) * 8;
            uint4 xr[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) xr[u] = ldg16(xv + 256 * u);
            bf16_trip_fma<R>(raw[d], xr, acc);
            if (i0 + d + D < n) issue(raw[d]);
            if (++ct == ntr) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float v = partials_total(acc[r]);
                    if (lane == 0 && o0 + r < O) store_out(y, o0 + r, v, out_bf16);
                }
                ct = 0;
                cg += nw;
            }
        }
    }
}

// ------------------------------------------- bf16 GEMV with its first trip loaded before the wait
// gemv_bf16_pl_r{R} (variant): gemv_rows' warp (R rows, single trips, THE ORDER: trip t feeds
// chunks lane + 128 t + 32 u into partial u), but the weights of the warp's first trip are
// loaded BEFORE griddepcontrol.wait.  The weights are static (nothing in the step writes them),
// so only x has to wait for the predecessor; under PDL the CTAs that become resident while the
// predecessor still runs (its tail, or all of a latency-bound one) have their first 2R KB per
// warp in registers when it completes, instead of starting the stream then.  (The fifth
// session's L2 prefetch of whole rows before the wait measured slower; this moves only the
// loads the warp issues first anyway, into its own registers.)  bf16, K % 1024 == 0 (whole trips).
template <int R>
struct PlFirst {                 // a warp's rows and the raw weights of its first trip
    const void* wr[R];
    uint4 raw[R][GEMV_UNROLL];
    int o0;                      // >= O: the warp has no rows (nothing loaded)
};

// Before the PDL wait (PDL_ENTRY_PRELOAD): weights only.  It ends its basic block (the branch
// on K, never taken), so ptxas cannot schedule the wait above the loads.
template <int R>
DEV PlFirst<R> pl_first(const u16* __restrict__ W, int O, int K, int warp) {
    PlFirst<R> f;
    const int lane = threadIdx.x & 31;
    f.o0 = warp * R;
    if (f.o0 < O) {
#pragma unroll
        for (int r = 0; r < R; ++r) f.wr[r] = W + (i64)min(f.o0 + r, O - 1) * K;
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) f.raw[r][u] = load_raw<false>(f.wr[r], lane + 32 * u);
    }
    if (K < 0) __trap();
    return f;
}

// Trip 0 of THE ORDER into fresh partials, from the weights pl_first loaded before the wait and
// the warp's x chunks xr (chunks lane + 32 u); shared by gemv_pl_rows and gemv_pl_rows_qn.
template <int R>
DEV void pl_first_trip(const PlFirst<R>& f, const uint4 (&xr)[GEMV_UNROLL], float (&acc)[R][GEMV_UNROLL]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
    bf16_trip_fma<R>(f.raw, xr, acc);
}

// The end of a pl warp's rows: partials in index order + the butterfly, lane 0 stores rows < O.
template <int R>
DEV void pl_store_rows(const PlFirst<R>& f, const float (&acc)[R][GEMV_UNROLL], void* __restrict__ y,
                       int O, int out_bf16) {
    float out[R];
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = partials_total(acc[r]);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (f.o0 + r < O) store_out(y, f.o0 + r, out[r], out_bf16);
}

// After the wait: x, the first trip's products, the remaining trips (rows_trip), the stores.
template <int R>
DEV void gemv_pl_rows(const PlFirst<R>& f, const u16* __restrict__ x, void* __restrict__ y, int O,
                      int K, int rpg, int out_bf16) {
    const int lane = threadIdx.x & 31;
    if (f.o0 >= O) return;
    const u16* xv = x + (rpg > 0 ? (i64)(f.o0 / rpg) * K : (i64)0);
    uint4 xr[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) xr[u] = ldg16(xv + (i64)(lane + 32 * u) * 8);
    float acc[R][GEMV_UNROLL];
    pl_first_trip<R>(f, xr, acc);   // trip 0, from the registers loaded before the wait
    const int nc = K >> 3;
    for (int c = lane + 32 * GEMV_UNROLL; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL)
        rows_trip<false, R, 1, false, 1>(f.wr, nullptr, xv, c, lane, acc);
    pl_store_rows<R>(f, acc, y, O, out_bf16);
}

#define GEMV_PL_KERNEL(NAME, R, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W, const u8* __restrict__ S, int ld_s, const u16* __restrict__ x, \
         void* __restrict__ y, int O, int K, int rows_per_group, int out_bf16) {                    \
        PDL_ENTRY_PRELOAD(const PlFirst<R> first = pl_first<R>(reinterpret_cast<const u16*>(W), O, K, gemv_warp_id())); \
        gemv_pl_rows<R>(first, x, y, O, K, rows_per_group, out_bf16);                              \
    }
GEMV_PL_KERNEL(gemv_bf16_pl_r2, 2, GEMV_MINB)
GEMV_PL_KERNEL(gemv_bf16_pl_r4, 4, GEMV_MINB)

// gemv_bf16_pl2_r{R}: two plain bf16 GEMVs that share x in one launch, each row exactly as
// gemv_bf16_pl_r{R} computes it (pl_first / gemv_pl_rows; the bits of a row depend on K only):
// warps [0, ceil(O / R)) take W -> y, the next ceil(O2 / R) warps W2 -> y2.  For the CSA
// attention's wq_b and the indexer's q GEMV, which both read the normed qr: the indexer's 16 MB
// then stream inside wq_b's launch instead of as a ~9 us launch of their own on the path to the
// attention (ops_decode.gemv_bf16_pair).  K % 1024 == 0.
#define GEMV_PL2_KERNEL(NAME, R, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const u16* __restrict__ W, const u16* __restrict__ W2, const u16* __restrict__ x,         \
         void* __restrict__ y, void* __restrict__ y2, int O, int O2, int K, int out_bf16,           \
         int out2_bf16) {                                                                          \
        PDL_ENTRY_PRELOAD(const int nw1 = (O + R - 1) / R; const int w = gemv_warp_id();           \
                          const bool second = w >= nw1;                                            \
                          const PlFirst<R> first = second ? pl_first<R>(W2, O2, K, w - nw1)        \
                                                          : pl_first<R>(W, O, K, w));              \
        if (second) gemv_pl_rows<R>(first, x, y2, O2, K, 0, out2_bf16);                            \
        else gemv_pl_rows<R>(first, x, y, O, K, 0, out_bf16);                                      \
    }
GEMV_PL2_KERNEL(gemv_bf16_pl2_r2, 2, GEMV_MINB)
GEMV_PL2_KERNEL(gemv_bf16_pl2_r4, 4, GEMV_MINB)

// ------------------------------------------------- paced L2 prefetch on a side stream (l2_pace)
// l2_prefetch_paced: asks the L2 for [p0, p0 + n0) then [p1, p1 + n1) (static weights of a GEMV
// that runs later), in chunks of `chunk` bytes spread over the CTAs (CTA b takes chunks b, b +
// gridDim.x, ...; lane 0 issues them), with `sleep_ns` of __nanosleep after each chunk: the
// request rate is about gridDim.x * chunk / sleep_ns, so the prefetch fills a latency-bound
// window of the step (the attention, the router) without flooding the HBM queues the
// latency-bound kernels' own misses wait in (the fifth session's in-GEMV prefetch, issued by every
// CTA at once before its wait, measured slower).  cp.async.bulk.prefetch.L2 is a hint: nothing
// this kernel or any other computes changes.  The whole loop runs before the PDL wait (static
// weights only); block 32, any grid.
extern "C" __global__ void __launch_bounds__(32)
l2_prefetch_paced(const u8* __restrict__ p0, u64 n0, const u8* __restrict__ p1, u64 n1, u32 chunk,
                  u32 sleep_ns) {
    PDL_ENTRY_PRELOAD(
        if (threadIdx.x == 0 && chunk > 0) {
            const u64 total = n0 + n1;
            for (u64 off = (u64)blockIdx.x * chunk; off < total; off += (u64)gridDim.x * chunk) {
                const u64 len = min((u64)chunk, total - off);
                if (off < n0) {
                    l2_prefetch_span(p0 + off, min(len, n0 - off));
                    if (off + len > n0) l2_prefetch_span(p1, off + len - n0);
                } else {
                    l2_prefetch_span(p1 + (off - n0), len);
                }
                if (sleep_ns) __nanosleep(sleep_ns);
            }
        });
}

// ------------------------------------------- the decode q_norm inside wq_b (gemv_bf16_pl_r*_qn)
// gemv_bf16_pl_r{R}_qn: gemv_bf16_pl_r{R} whose x is rmsnorm(xr, nw, eps), computed by EVERY CTA
// into its shared memory with rmsnorm_row's code (rmsnorm_row.cuh: the CTA is RMS_THREADS = 128
// threads, as rmsnorm_bf16_wbf16's, so the normed values are that launch's bits); CTA 0 also
// stores the normed row to xn (the CSA indexer's q GEMV reads it).  Why: the separate q_norm
// launch sat on the decode chain between the multi GEMV and wq_b (4-6 us busy on the device
// timeline, behind wq_b's own preloads) for a 2 KB row; here each CTA re-reads the 2 KB raw row
// and the 2 KB weight (from L2) after the PDL wait, while the first trip's weights it loaded
// before the wait are already in flight.  Both the GEMV's and the norm's static loads (weights,
// the norm weight's first chunk) go before the wait.  K == 1024 exactly (one chunk of 8 per
// thread for the norm, one trip per warp for the GEMV: trip 0 is the whole row, THE ORDER as
// gemv_pl_rows); xr is the predecessor's output (complete before the wait: read-only path).
// x, xn must not alias (other CTAs read x while CTA 0 writes xn).
static_assert(GEMV_THREADS == RMS_THREADS, "the _qn GEMV's CTA runs rmsnorm_row as one row's CTA");
constexpr int QN_K = 8 * RMS_THREADS;

template <int R>
DEV void gemv_pl_rows_qn(const PlFirst<R>& f, const RmsFirst& nf, const u16* __restrict__ xr,
                         const u16* __restrict__ nw, double eps, u16* __restrict__ xn,
                         void* __restrict__ y, int O, int out_bf16) {
    __shared__ __align__(16) u16 xs[QN_K];
    const bool first_cta = blockIdx.x == 0;
    rmsnorm_row_to<u16>(nf, xr, nw, QN_K, eps, [&](int c, const uint4& o) {
        *reinterpret_cast<uint4*>(xs + 8 * c) = o;
        if (first_cta) stg16(xn + 8 * c, o);
    });
    __syncthreads();   // every thread's chunk in xs (the norm's block_sum already synced the reads)
    const int lane = threadIdx.x & 31;
    if (f.o0 >= O) return;
    uint4 xv[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) xv[u] = *reinterpret_cast<const uint4*>(xs + 8 * (lane + 32 * u));
    float acc[R][GEMV_UNROLL];
    pl_first_trip<R>(f, xv, acc);   // the whole row: K = 1024 is one trip
    pl_store_rows<R>(f, acc, y, O, out_bf16);
}

// W bf16 bits [O, 1024]; xr [1024] bf16 (raw), nw [1024] bf16 (the norm weight), xn [1024] bf16
// (out: the normed row, CTA 0), y [O] f32 / bf16, K == 1024 (a runtime argument: the preloads'
// basic-block ends test it, so ptxas keeps them above the wait; any other K traps);
// grid = ceil(O / (R GEMV_WARPS)), block 128.
#define GEMV_PL_QN_KERNEL(NAME, R, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const u16* __restrict__ W, const u16* __restrict__ xr, const u16* __restrict__ nw,        \
         double eps, u16* __restrict__ xn, void* __restrict__ y, int O, int K, int out_bf16) {      \
        PDL_ENTRY_PRELOAD(const PlFirst<R> first = pl_first<R>(W, O, K, gemv_warp_id());           \
                          const RmsFirst nfirst = rms_preload<u16>(nw, K));                        \
        if (K != QN_K) __trap();                                                                   \
        gemv_pl_rows_qn<R>(first, nfirst, xr, nw, eps, xn, y, O, out_bf16);                        \
    }
GEMV_PL_QN_KERNEL(gemv_bf16_pl_r2_qn, 2, GEMV_MINB)
GEMV_PL_QN_KERNEL(gemv_bf16_pl_r4_qn, 4, GEMV_MINB)

// W bf16 bits [O, K]; S / ld_s unused (the r*t* kernels' signature, so one wrapper serves both).
#define GEMV_PS_KERNEL(NAME, R, D, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W, const u8* __restrict__ S, int ld_s, const u16* __restrict__ x, \
         void* __restrict__ y, int O, int K, int rows_per_group, int out_bf16) {                    \
        PDL_ENTRY();                                                                               \
        gemv_ps_rows<R, D>(reinterpret_cast<const u16*>(W), x, y, O, K, rows_per_group, out_bf16);  \
    }
GEMV_PS_KERNEL(gemv_bf16_ps_r1d4, 1, 4, GEMV_MINB)
GEMV_PS_KERNEL(gemv_bf16_ps_r2d2, 2, 2, GEMV_MINB)
GEMV_PS_KERNEL(gemv_bf16_ps_r2d3, 2, 3, 3)
GEMV_PS_KERNEL(gemv_bf16_ps_r4d2, 4, 2, 2)

// Several projections of the same x in one launch (e.g. every [*, D] projection of the normed
// hidden state).  segs[s]: rows [row0, segs[s + 1].row0) of the launch are rows [0, n_s) of W_s,
// computed by the warps [warp0, segs[s + 1].warp0) (ceil(n_s / R) of them, R rows each: a warp
// never straddles two projections, so its rows share a form, an x, a scale row and an output);
// written to y_s (f32 or bf16); segs[nseg] is the sentinel (row0 = total rows, warp0 = total
// warps).  ring_r > 0 makes y_s the compressor's pending rows: row r of the output goes to
// y_s[((pos % ring_r) + ring_off) * n_s + r] (f32), plus ape_s[(pos % ring_r) * n_s + r] when
// ape_s != null (the gate-score position bias; f32(dot + ape), the same rounding as
// compress_add_ape); ring_off < 0: to y_s[r] (a staging row of the device verify, placed into
// the pending rows by the row's emission: compress_emit*'s kv_in / score_in).  The table lives in device memory, built once at setup (weights and arena
// outputs never move).
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
    int warp0;
};

namespace {
// Rows r0 .. r0 + R - 1 (< n) of segment g: f32 (+ ape of the ring slot) into the pending ring row
// pos % ring_r of a ring segment, else the plain output (bf16 or f32).  The register and the bulk
// multi kernels' one epilogue.
template <int R>
DEV void store_seg_rows(const GemvSeg& g, int n, int r0, const int* __restrict__ pos, const float* v) {
    const int slot = g.ring_r > 0 ? pos[0] % g.ring_r : 0;
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const int r = r0 + j;
        if (r >= n) break;
        if (g.ring_r > 0) {
            float a = v[j];
            if (g.ape != nullptr) a = __fadd_rn(a, __ldg(g.ape + (i64)slot * n + r));
            // ring_off < 0: a staging row (the device verify's: its emission places the values)
            reinterpret_cast<float*>(g.y)[(i64)(g.ring_off >= 0 ? slot + g.ring_off : 0) * n + r] = a;
        } else {
            store_out(g.y, r, v[j], g.out_bf16);
        }
    }
}

// The segment of a table warp w < segs[nseg].warp0 (the multi kernels' one lookup).
DEV int seg_of_warp(const GemvSeg* __restrict__ segs, int nseg, int w) {
    int s = 0;
    while (s + 1 < nseg && w >= segs[s + 1].warp0) ++s;
    return s;
}

// gemv_multi_rows' warp: its R rows of its segment (the table is static device memory)
template <int R>
DEV void gemv_multi_prefetch(const GemvSeg* __restrict__ segs, int nseg, int K) {
    if ((threadIdx.x & 31) != 0) return;
    const int w = gemv_warp_id();
    if (w >= segs[nseg].warp0) return;
    const int s = seg_of_warp(segs, nseg, w);
    const GemvSeg& g = segs[s];
    const int n = segs[s + 1].row0 - g.row0, r0 = (w - g.warp0) * R;
    if (r0 < n) l2_prefetch_rows(g.w, r0, min(R, n - r0), (u64)K * (g.scale != nullptr ? 1 : 2));
}

template <int R, int T8, int TB = 1>
DEV void gemv_multi_rows(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x,
                         int K, const int* __restrict__ pos) {
    static_assert(128 % R == 0, "R must divide the 128-row scale block");
    const int lane = threadIdx.x & 31;
    const int w = gemv_warp_id();
    if (w >= segs[nseg].warp0) return;
    const int s = seg_of_warp(segs, nseg, w);
    const GemvSeg& g = segs[s];
    const int n = segs[s + 1].row0 - g.row0;
    const int r0 = (w - g.warp0) * R;
    const bool fp8 = g.scale != nullptr;
    const void* wr[R];
    float acc[R];
    if (fp8) {
#pragma unroll
        for (int j = 0; j < R; ++j) wr[j] = w_row<true>(g.w, min(r0 + j, n - 1), K);
        const u8* sr[1] = {g.scale + (i64)(r0 >> 7) * g.ld_scale};
        warp_rows_dot<true, R, 1, T8>(wr, sr, x, K, lane, acc);
    } else {
#pragma unroll
        for (int j = 0; j < R; ++j) wr[j] = w_row<false>(g.w, min(r0 + j, n - 1), K);
        const u8* sr[1] = {nullptr};
        warp_rows_dot<false, R, 1, TB>(wr, sr, x, K, lane, acc);
    }
    if (lane != 0) return;
    store_seg_rows<R>(g, n, r0, pos, acc);
}

// The shared expert's first half for outputs [w P, w P + P): rows of W1 and of W3 in one
// warp_rows_dot (2P rows; the first P use W1's scale row, the rest W3's).
// gemv_swiglu_rows' warp: its P rows of W1 and of W3
template <int P>
DEV void gemv_swiglu_prefetch(const void* W1, const void* W3, bool fp8, int O, int K) {
    if ((threadIdx.x & 31) != 0) return;
    const i64 o0 = (i64)gemv_warp_id() * P;
    if (o0 >= O) return;
    const u64 rowb = (u64)K * (fp8 ? 1 : 2);
    l2_prefetch_rows(W1, o0, min(P, O - (int)o0), rowb);
    l2_prefetch_rows(W3, o0, min(P, O - (int)o0), rowb);
}

template <int P, int T8, int TB = 1>
DEV void gemv_swiglu_rows(const void* __restrict__ W1, const u8* __restrict__ S1,
                          const void* __restrict__ W3, const u8* __restrict__ S3, int ld_s,
                          const u16* __restrict__ x, u16* __restrict__ h, int O, int K,
                          double limit) {
    static_assert(128 % P == 0, "P must divide the 128-row scale block");
    const int lane = threadIdx.x & 31;
    const int o0 = gemv_warp_id() * P;
    if (o0 >= O) return;
    const void* wr[2 * P];
    float acc[2 * P];
    if (S1 != nullptr) {
#pragma unroll
        for (int j = 0; j < P; ++j) {
            wr[j] = w_row<true>(W1, min(o0 + j, O - 1), K);
            wr[P + j] = w_row<true>(W3, min(o0 + j, O - 1), K);
        }
        const u8* sr[2] = {S1 + (i64)(o0 >> 7) * ld_s, S3 + (i64)(o0 >> 7) * ld_s};
        warp_rows_dot<true, 2 * P, 2, T8>(wr, sr, x, K, lane, acc);
    } else {
#pragma unroll
        for (int j = 0; j < P; ++j) {
            wr[j] = w_row<false>(W1, min(o0 + j, O - 1), K);
            wr[P + j] = w_row<false>(W3, min(o0 + j, O - 1), K);
        }
        const u8* sr[2] = {nullptr, nullptr};
        warp_rows_dot<false, 2 * P, 2, TB>(wr, sr, x, K, lane, acc);
    }
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (o0 + j >= O) break;
        const float g = round_bf16(acc[j]), u = round_bf16(acc[P + j]);
        h[o0 + j] = (u16)f32_to_bf16(swiglu_value(g, u, 1.0f, false, limit));
    }
}
}  // namespace

// R rows per warp, FP8 projections T8 trips at once; grid = ceil(segs[nseg].warp0 / GEMV_WARPS)
// CTAs of GEMV_THREADS.  (The device step's tables have ~1000 warps of 4 rows, all resident at
// 8 warps per SM, so the 3-CTA bound that T8 = 2 needs costs no occupancy there.)
#define GEMV_MULTI_KERNEL(NAME, R, T8, TB, MINB)                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K,             \
         const int* __restrict__ pos) {                                                             \
        PDL_ENTRY_PREFETCH(gemv_multi_prefetch<R>(segs, nseg, K));                                 \
        gemv_multi_rows<R, T8, TB>(segs, nseg, x, K, pos);                                         \
    }
GEMV_MULTI_KERNEL(gemv_bf16_multi_r1, 1, 1, 1, GEMV_MINB)
GEMV_MULTI_KERNEL(gemv_bf16_multi_r4, 4, 2, 1, 3)
// Variants (same bits; bf16 rows TB trips at once): the step's multi table has ~1040 warps of
// 4 rows, i.e. ~8 warps per SM, so its bytes in flight per SM are set by the warps' own depth.
GEMV_MULTI_KERNEL(gemv_bf16_multi_r4t2, 4, 2, 2, 2)   // 2 trips of 4 bf16 rows: 254 registers
GEMV_MULTI_KERNEL(gemv_bf16_multi_r1t2, 1, 2, 2, GEMV_MINB)

// gemv_bf16_multi_pl_r{R}[t{T}]: gemv_bf16_multi_r{R}[t{T}] (the same warps, rows, trips and
// epilogue) whose bf16 warps load the weights of their first T trips (chunks lane + 32 u, u <
// T GEMV_UNROLL, of the warp's R rows: 2 T R KB per warp) BEFORE griddepcontrol.wait, the form
// gemv_bf16_pl_r{R} gives the plain GEMVs.  Why: the step's multi GEMV (the attention input's
// 21-34 MB of projections) follows the latency-bound hc boundary, during which HBM is idle; its
// resident warps (the first wave) then hold their first trips when x is ready.  The table and
// the weights are static (the table is uploaded at setup, before any graph; common.cuh
// PDL_ENTRY_PRELOAD), only x waits.  THE ORDER is unchanged: the preloaded chunks are the group
// warp_rows_dot takes first (rows_trip<T> at c = lane, chunk u into partial u % GEMV_UNROLL in
// ascending u, which is bf16_trip_fma per trip in trip order), and warp_rows_dot's bf16 loops
// continue from c = lane + 128 T.  A warp of an FP8 segment (or K % 1024 != 0, or K < 1024 T)
// loads nothing early and runs gemv_multi_rows' body.
template <int R, int T>
struct MultiFirst {
    const void* wr[R];
    uint4 raw[T][R][GEMV_UNROLL];   // trip t's chunk lane + 32 (GEMV_UNROLL t + u) of row r
    int seg;                        // the warp's segment; -1: the warp has no rows
    bool pre;                       // raw holds the first T trips (bf16, K % 1024 == 0, K >= 1024 T)
};

// Before the PDL wait: the static table and weights only.  It ends its basic block (the branch
// on K, never taken), so ptxas cannot schedule the wait above the loads.
template <int R, int T>
DEV MultiFirst<R, T> multi_first(const GemvSeg* __restrict__ segs, int nseg, int K) {
    MultiFirst<R, T> f;
    const int lane = threadIdx.x & 31;
    const int w = gemv_warp_id();
    f.seg = -1;
    f.pre = false;
    if (w < segs[nseg].warp0) {
        const int s = seg_of_warp(segs, nseg, w);
        f.seg = s;
        const GemvSeg& g = segs[s];
        f.pre = g.scale == nullptr && K % (32 * 8 * GEMV_UNROLL) == 0 && K >= 32 * 8 * GEMV_UNROLL * T;
        if (f.pre) {
            const int n = segs[s + 1].row0 - g.row0, r0 = (w - g.warp0) * R;
#pragma unroll
            for (int r = 0; r < R; ++r) f.wr[r] = w_row<false>(g.w, min(r0 + r, n - 1), K);
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        f.raw[t][r][u] = load_raw<false>(f.wr[r], lane + 32 * (GEMV_UNROLL * t + u));
        }
    }
    if (K < 0) __trap();
    return f;
}

// After the wait: the preloaded group's products (x read now), the rest of the row, the epilogue.
template <int R, int T, int T8>
DEV void gemv_multi_rows_pl(const MultiFirst<R, T>& f, const GemvSeg* __restrict__ segs, int nseg,
                            const u16* __restrict__ x, int K, const int* __restrict__ pos) {
    if (f.seg < 0) return;
    if (!f.pre) {   // FP8 segment (or short K): the register kernel's body
        gemv_multi_rows<R, T8, T>(segs, nseg, x, K, pos);
        return;
    }
    const int lane = threadIdx.x & 31;
    const GemvSeg& g = segs[f.seg];
    const int n = segs[f.seg + 1].row0 - g.row0, r0 = (gemv_warp_id() - g.warp0) * R;
    uint4 xr[T][GEMV_UNROLL];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) xr[t][u] = ldg16(x + (i64)(lane + 32 * (GEMV_UNROLL * t + u)) * 8);
    float acc[R][GEMV_UNROLL];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
#pragma unroll
    for (int t = 0; t < T; ++t) bf16_trip_fma<R>(f.raw[t], xr[t], acc);
    // warp_rows_dot's bf16 loops from c = lane + 128 T (K % 1024 == 0: no tail chunks)
    const u8* sr[1] = {nullptr};
    const int nc = K >> 3;
    int c = lane + 32 * GEMV_UNROLL * T;
    if constexpr (T > 1) {
        for (; c + 32 * (T * GEMV_UNROLL - 1) < nc; c += T * 32 * GEMV_UNROLL)
            rows_trip<false, R, 1, false, T>(f.wr, sr, x, c, lane, acc);
    }
    for (; c + 32 * (GEMV_UNROLL - 1) < nc; c += 32 * GEMV_UNROLL)
        rows_trip<false, R, 1, false, 1>(f.wr, sr, x, c, lane, acc);
    float out[R];
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = partials_total(acc[r]);
    if (lane != 0) return;
    store_seg_rows<R>(g, n, r0, pos, out);
}

#define GEMV_MULTI_PL_KERNEL(NAME, R, T8, TB, MINB)                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K,             \
         const int* __restrict__ pos) {                                                             \
        PDL_ENTRY_PRELOAD(const MultiFirst<R, TB> first = multi_first<R, TB>(segs, nseg, K));      \
        gemv_multi_rows_pl<R, TB, T8>(first, segs, nseg, x, K, pos);                               \
    }
GEMV_MULTI_PL_KERNEL(gemv_bf16_multi_pl_r1, 1, 1, 1, GEMV_MINB)
GEMV_MULTI_PL_KERNEL(gemv_bf16_multi_pl_r4, 4, 2, 1, 3)
GEMV_MULTI_PL_KERNEL(gemv_bf16_multi_pl_r1t2, 1, 2, 2, GEMV_MINB)

// gemv_bf16_multi_r{R}[t{T}]_qn: the kernel above, then the decode q_norm in its LAST CTA:
//   qn_y <- rmsnorm_bf16_wbf16(qn_y, qn_w, qn_eps) in place (rmsnorm_row, rmsnorm.cu's own row
//   code: the same bits as that launch), where qn_y is one of the table's bf16 outputs (this
//   launch writes it; ops_decode.gemv_bf16_multi(qnorm=) checks).  It saves the step the
//   rmsnorm launch between the multi GEMV and wq_b: its edge, and its x / weight round trips,
//   which ran behind wq_b's pl_r2 preloads (13b0dd5 timeline: q_norm 2.2 -> 4.1 us busy).
//   Handoff: every CTA fences its rows and takes a ticket (atomicAdd on qn_counter[0]); the CTA
//   drawing the last one fences again, reads qn_y through L2 (ld.cg: the rows other CTAs wrote
//   in this launch) and resets the counter (zero before the first launch, left zero: graph
//   replays).  Each thread's first weight chunk is loaded before the PDL wait (rms_preload:
//   static; every CTA loads it, only the last uses it: 2 KB L2 hits).
//   Block GEMV_THREADS == RMS_THREADS.  qn_counter must not be shared by concurrent launches.
static_assert(GEMV_THREADS == RMS_THREADS, "the q_norm tail runs rmsnorm_row on the GEMV's CTA");
namespace {
DEV void multi_qn_tail(const RmsFirst& first, u16* y, const u16* __restrict__ w, int n, double eps,
                       int* counter) {
    __shared__ int is_last;
    // this CTA's rows (lane 0 of its warps) visible device-wide before its ticket
    if (!last_cta_ticket(counter, (int)gridDim.x, is_last)) return;
    __threadfence();   // every other CTA's rows, read below through L2
    rmsnorm_row<u16, true>(first, y, w, y, n, eps);
    if (threadIdx.x == 0) *counter = 0;   // ready for the next launch
}
}  // namespace

#define GEMV_MULTI_QN_KERNEL(NAME, R, T8, TB, MINB)                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K,             \
         const int* __restrict__ pos, u16* qn_y, const u16* __restrict__ qn_w, int qn_n,          \
         double qn_eps, int* qn_counter) {                                                          \
        PDL_ENTRY_PRELOAD(gemv_multi_prefetch<R>(segs, nseg, K);                                   \
                          const RmsFirst qn_first = rms_preload<u16>(qn_w, qn_n));                 \
        gemv_multi_rows<R, T8, TB>(segs, nseg, x, K, pos);                                         \
        multi_qn_tail(qn_first, qn_y, qn_w, qn_n, qn_eps, qn_counter);                             \
    }
GEMV_MULTI_QN_KERNEL(gemv_bf16_multi_r1_qn, 1, 1, 1, GEMV_MINB)
GEMV_MULTI_QN_KERNEL(gemv_bf16_multi_r4_qn, 4, 2, 1, 3)
GEMV_MULTI_QN_KERNEL(gemv_bf16_multi_r4t2_qn, 4, 2, 2, 2)
GEMV_MULTI_QN_KERNEL(gemv_bf16_multi_r1t2_qn, 1, 2, 2, GEMV_MINB)

// gemv_bf16_multi_x{NX}_r{R}: the table form of gemv_bf16_x{NX}_r{R}, for the device verify's
// projections of its T rows' xn (gpu.verify_step): gemv_bf16_multi's warps and segments (the
// table is built for this R), each weight chunk loaded ONCE for the nx rows, row j's bits those
// of gemv_bf16_multi for X[j] alone (xrows_dot is warp_rows_dot's bf16 order, as gemv_bf16_x*).
// Outputs of row j: a plain segment's at y + j n_s (the arena slot's rows axis: rows of n_s
// values, f32 or bf16); a ring segment (ring_r > 0) is written to a STAGING row, f32(dot +
// ape[(pos[j] % ring_r) n_s + r]) at y + j n_s (f32): the value gemv_bf16_multi's epilogue puts
// into pending row pos % ring_r + ring_off (ring_off is not read here).  Why staging: row j's
// pending slot may be one an earlier row's emission still pools (the rows cross an emission), so
// the row's emission launch writes it into the pending rows (compress_emit_*'s kv_in / score_in),
// in position order.  bf16 segments only (ops_decode.gemv_bf16_multi_rows refuses FP8 tables).
// X: nx rows of K bf16 values, row stride ldx; pos: nx int32 (row j's position).
namespace {
template <int NX, int R>
DEV void gemv_multi_xrows(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ X,
                          int ldx, int nx, int K, const int* __restrict__ pos) {
    const int lane = threadIdx.x & 31;
    const int w = gemv_warp_id();
    if (w >= segs[nseg].warp0) return;
    const int s = seg_of_warp(segs, nseg, w);
    const GemvSeg& g = segs[s];
    const int n = segs[s + 1].row0 - g.row0;
    const int r0 = (w - g.warp0) * R;
    const u16* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const u16*>(g.w) + (i64)min(r0 + r, n - 1) * K;
    float acc[NX][R][GEMV_UNROLL];
    xrows_dot<NX, R>(wr, X, ldx, (i64)0, nx, K >> 3, lane, acc);
#pragma unroll
    for (int j = 0; j < NX; ++j) {
        if (j >= nx) break;  // warp-uniform
        float v[R];
#pragma unroll
        for (int r = 0; r < R; ++r) v[r] = partials_total(acc[j][r]);   // every lane: the butterfly
        if (lane != 0) continue;
        const int slot = g.ring_r > 0 ? pos[j] % g.ring_r : 0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int o = r0 + r;
            if (o >= n) break;
            if (g.ring_r > 0) {
                float a = v[r];
                if (g.ape != nullptr) a = __fadd_rn(a, __ldg(g.ape + (i64)slot * n + o));
                reinterpret_cast<float*>(g.y)[(i64)j * n + o] = a;
            } else {
                store_out(reinterpret_cast<u8*>(g.y) + (i64)j * n * (g.out_bf16 ? 2 : 4), o, v[r],
                          g.out_bf16);
            }
        }
    }
}
}  // namespace

#define GEMV_MULTI_XROWS_KERNEL(NAME, NX, R)                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MINB)                          \
    NAME(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ X, int ldx, int nx,   \
         int K, const int* __restrict__ pos) {                                                      \
        PDL_ENTRY_PREFETCH(gemv_multi_prefetch<R>(segs, nseg, K));                                 \
        gemv_multi_xrows<NX, R>(segs, nseg, X, ldx, nx, K, pos);                                   \
    }
GEMV_MULTI_XROWS_KERNEL(gemv_bf16_multi_x2_r4, 2, 4)
GEMV_MULTI_XROWS_KERNEL(gemv_bf16_multi_x4_r2, 4, 2)
GEMV_MULTI_XROWS_KERNEL(gemv_bf16_multi_x8_r1, 8, 1)

// h[o] = swiglu(bf16(W1[o] . x), bf16(W3[o] . x)) (clamped, no routing weight): the bits of
// gemv_bf16 (bf16 out) x 2 then swiglu_clamped_bf16.  W1, W3 both bf16 or both fp8 (S1, S3);
// P outputs per warp, FP8 T8 trips at once (2048 outputs: 1024 warps at P = 2, all resident).
#define GEMV_SWIGLU_KERNEL(NAME, P, T8, TB, MINB)                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W1, const u8* __restrict__ S1, const void* __restrict__ W3,      \
         const u8* __restrict__ S3, int ld_s, const u16* __restrict__ x, u16* __restrict__ h,      \
         int O, int K, double limit) {                                                              \
        PDL_ENTRY_PREFETCH(gemv_swiglu_prefetch<P>(W1, W3, S1 != nullptr, O, K));                  \
        gemv_swiglu_rows<P, T8, TB>(W1, S1, W3, S3, ld_s, x, h, O, K, limit);                      \
    }
GEMV_SWIGLU_KERNEL(gemv_bf16_swiglu_p1, 1, 1, 1, GEMV_MINB)
GEMV_SWIGLU_KERNEL(gemv_bf16_swiglu_p2, 2, 2, 1, 3)
// Variants (same bits; bf16 rows TB trips at once): 2048 outputs at P = 2 are ~8 warps per SM.
GEMV_SWIGLU_KERNEL(gemv_bf16_swiglu_p1t2, 1, 2, 2, GEMV_MINB)   // 2 rows x 2 trips, 16 warps / SM
GEMV_SWIGLU_KERNEL(gemv_bf16_swiglu_p2t2, 2, 2, 2, 2)           // 4 rows x 2 trips: 254 registers

// the x-rows SwiGLU (gemv_swiglu_xrows above; the device verify's shared expert): P outputs per
// warp for nx <= NX rows
#define GEMV_SWIGLU_XROWS_KERNEL(NAME, NX, P)                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MINB)                          \
    NAME(const u16* __restrict__ W1, const u16* __restrict__ W3, const u16* __restrict__ X, int ldx, \
         int nx, u16* __restrict__ H, int ldh, int O, int K, double limit) {                       \
        PDL_ENTRY_PREFETCH(gemv_swiglu_prefetch<P>(W1, W3, false, O, K));                          \
        gemv_swiglu_xrows<NX, P>(W1, W3, X, ldx, nx, H, ldh, O, K, limit);                         \
    }
GEMV_SWIGLU_XROWS_KERNEL(gemv_bf16_swiglu_x2_p2, 2, 2)
GEMV_SWIGLU_XROWS_KERNEL(gemv_bf16_swiglu_x4_p1, 4, 1)
GEMV_SWIGLU_XROWS_KERNEL(gemv_bf16_swiglu_x8_p1, 8, 1)

// ------------------------------------------------ dense GEMV variants: TMA bulk-copy streaming
// gemv_{bf16,fp8}_bulk_r{R}s{S}, gemv_bf16_multi_bulk_r{R}s{S}, gemv_bf16_swiglu_bulk_p{P}s{S}:
// the same rows, the same per-row arithmetic (THE ORDER of warp_rows_dot, so the same bits),
// but the weights reach the SMs through cp.async.bulk (TMA) copies into a per-warp shared-memory
// ring of S stages instead of register loads.  A stage is one trip (GEMV_UNROLL x 32 chunks =
// 1024 columns) of the warp's NR rows: NR bulk copies of <= 2 KB (bf16) / 1 KB (FP8) issued by
// lane 0 on one mbarrier.  The grid is persistent: nw warps (<= groups, a few CTAs per SM), warp
// w takes the contiguous groups [w G / nw, (w + 1) G / nw) (a group: the NR rows one register
// kernel's warp computes) and streams their trips back to back, so S stages stay in flight
// across row boundaries while the lanes compute: bytes in flight per SM = CTAs x 4 warps x S x
// NR x 2 KB | 1 KB, held by no register, and loads overlap arithmetic within a warp.  x is read
// through L1 at compute time (ldg16, shared by the NR rows); the FP8 scale bytes of a group
// (<= 64: K <= 8192) are loaded one group ahead, packed 2 per lane (bytes l, l + 32), and
// shuffled per chunk.  Requirements (checked by the wrappers): K % 16 == 0 (16-byte bulk sizes
// and row starts in both forms), K <= 8192 for FP8 rows, 16-byte aligned W and x.
namespace {
constexpr int GB_TRIP = 32 * GEMV_UNROLL;  // chunks per trip

DEV void gb_mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
DEV void gb_mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
DEV void gb_mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred P1;\n"
        "GB_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
        "@!P1 bra GB_WAIT;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
DEV void gb_bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// One group's operands: NR weight rows (clamped, as the register kernels do), its SROWS scale
// rows (FP8), its x, its form.
template <int NR, int SROWS>
struct GbGroup {
    const u8* w[NR];
    const u8* s[SROWS];
    const u16* x;
    bool fp8;
};

// The group's scale bytes (<= 64), packed per lane: byte l | byte (l + 32) << 8.
template <int NR, int SROWS>
DEV void gb_scales(const GbGroup<NR, SROWS>& g, int nb, int lane, u32 (&spk)[SROWS]) {
#pragma unroll
    for (int j = 0; j < SROWS; ++j) {
        u32 v = 0;
        if (g.fp8) {
            if (lane < nb) v = __ldg(g.s[j] + lane);
            if (lane + 32 < nb) v |= (u32)__ldg(g.s[j] + lane + 32) << 8;
        }
        spk[j] = v;
    }
}

// Trip t of the NR rows from the stage at `stage` (row r at stage + r ROWB): chunks c = 128 t
// + lane + 32 u; a lane whose trip is complete (c + 96 < nc for u = 0) adds chunk u into partial
// u, else its chunks c < nc go to partial 0 in ascending u (warp_rows_dot's tail rule: a trip
// is exactly one of the lane's groups of GEMV_UNROLL).
// The x chunks and scales are fetched before waiting for the stage (bar, parity).
template <bool FP8, int NR, int SROWS, int ROWB>
DEV void gb_trip(const u8* stage, u32 bar, u32 parity, const u16* __restrict__ x,
                 const u32 (&spk)[SROWS], int t, int nc, int lane, float (&acc)[NR][GEMV_UNROLL]) {
    using Raw = typename RawChunk<FP8>::T;
    constexpr int CB = FP8 ? 8 : 16;
    const int c0 = GB_TRIP * t + lane;
    Raw raw[NR][GEMV_UNROLL];
    uint4 xv[GEMV_UNROLL];
    float sc[SROWS][GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int c = min(c0 + 32 * u, nc - 1);
        xv[u] = ldg16(x + (i64)c * 8);
        if constexpr (FP8) {
            const int b = c >> 4;
#pragma unroll
            for (int j = 0; j < SROWS; ++j) {
                const u32 v = __shfl_sync(0xffffffffu, spk[j], b & 31);
                sc[j][u] = e8m0_scale((b & 32) ? (v >> 8) & 0xffu : v & 0xffu);
            }
        } else {
#pragma unroll
            for (int j = 0; j < SROWS; ++j) sc[j][u] = 1.0f;
        }
    }
    gb_mbar_wait(bar, parity);
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < NR; ++r)
            raw[r][u] = *reinterpret_cast<const Raw*>(stage + r * ROWB + (lane + 32 * u) * CB);
    if (c0 + 32 * (GEMV_UNROLL - 1) < nc) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            float b[8];
            unpack8(xv[u], b);
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                float a[8];
                dequant_chunk(raw[r][u], sc[r / (NR / SROWS)][u], a);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][u] = __fmaf_rn(a[i], b[i], acc[r][u]);
            }
        }
    } else {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            if (c0 + 32 * u >= nc) break;
            float b[8];
            unpack8(xv[u], b);
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                float a[8];
                dequant_chunk(raw[r][u], sc[r / (NR / SROWS)][u], a);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][0] = __fmaf_rn(a[i], b[i], acc[r][0]);
            }
        }
    }
}

// The streaming loop.  D: ngroups(), group(g, hint) -> GbGroup (hint: a lookup state that only
// moves forward), store(g, out[NR]) on lane 0.  FORM: 0 bf16, 1 FP8, 2 per group (g.fp8).
// ROWB: bytes per row of a stage (2048 when a bf16 row may come, else 1024).
template <int FORM, int NR, int SROWS, int S, int ROWB, class D>
DEV void gb_stream(const D& d, int K, int nw) {
    extern __shared__ __align__(128) u8 gb_smem[];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int w = gemv_warp_id();
    if (w >= nw) return;
    const int G = d.ngroups();
    const int g0 = (int)((i64)w * G / nw), g1 = (int)((i64)(w + 1) * G / nw);
    if (g0 >= g1) return;
    const u32 bar0 = smem_addr(gb_smem) + (u32)(wib * S * 8);
    const u32 ring = smem_addr(gb_smem) + (u32)(GEMV_WARPS * S * 8 + 127) / 128 * 128 +
                     (u32)(wib * S * NR * ROWB);
    const u8* ring_p = gb_smem + (GEMV_WARPS * S * 8 + 127) / 128 * 128 + wib * S * NR * ROWB;
    const int nc = K >> 3, ntrips = (nc + GB_TRIP - 1) / GB_TRIP, nb = (K + 127) >> 7;
    const int n = (g1 - g0) * ntrips;
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < S; ++s) gb_mbar_init(bar0 + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncwarp();
    int phint = 0;  // the producer's (lane 0) lookup state
    auto issue = [&](int item) {
        const int g = g0 + item / ntrips, t = item - (item / ntrips) * ntrips;
        const GbGroup<NR, SROWS> gg = d.group(g, phint);
        const bool f8 = FORM == 1 || (FORM == 2 && gg.fp8);
        const int cb = f8 ? 8 : 16;
        const u32 bytes = (u32)(min(GB_TRIP, nc - GB_TRIP * t) * cb);
        const int s = item % S;
        const u32 bar = bar0 + 8 * s;
        gb_mbar_expect(bar, bytes * NR);
#pragma unroll
        for (int r = 0; r < NR; ++r)
            gb_bulk_g2s(ring + (u32)((s * NR + r) * ROWB), gg.w[r] + (i64)GB_TRIP * t * cb, bytes, bar);
    };
    if (lane == 0)
        for (int i = 0; i < S && i < n; ++i) issue(i);
    int chint = 0;  // the consumer's lookup state
    GbGroup<NR, SROWS> cur = d.group(g0, chint);
    u32 spk[SROWS];
    gb_scales(cur, nb, lane, spk);
    int it = 0;
    for (int g = g0; g < g1; ++g) {
        GbGroup<NR, SROWS> nxt = cur;
        u32 spn[SROWS];
#pragma unroll
        for (int j = 0; j < SROWS; ++j) spn[j] = 0;
        if (g + 1 < g1) {  // the next group's scale bytes, in flight during this group
            nxt = d.group(g + 1, chint);
            gb_scales(nxt, nb, lane, spn);
        }
        float acc[NR][GEMV_UNROLL];
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) acc[r][u] = 0.0f;
        for (int t = 0; t < ntrips; ++t, ++it) {
            const int s = it % S;
            const u32 bar = bar0 + 8 * s, par = (u32)((it / S) & 1);
            const u8* stage = ring_p + s * NR * ROWB;
            if (FORM == 1 || (FORM == 2 && cur.fp8))
                gb_trip<true, NR, SROWS, ROWB>(stage, bar, par, cur.x, spk, t, nc, lane, acc);
            else
                gb_trip<false, NR, SROWS, ROWB>(stage, bar, par, cur.x, spk, t, nc, lane, acc);
            __syncwarp();  // every lane has read the stage before it is refilled
            if (lane == 0 && it + S < n) issue(it + S);
        }
        float out[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) out[r] = partials_total(acc[r]);
        if (lane == 0) d.store(g, out);
        cur = nxt;
#pragma unroll
        for (int j = 0; j < SROWS; ++j) spk[j] = spn[j];
    }
}

// gemv_bf16's rows (R per group, the register kernels' layout).
template <bool FP8, int R>
struct GbPlain {
    const void* W;
    const u8* S;
    int ld_s;
    const u16* x;
    void* y;
    int O, K, rpg, out_bf16;
    DEV int ngroups() const { return (O + R - 1) / R; }
    DEV GbGroup<R, 1> group(int g, int&) const {
        GbGroup<R, 1> r;
        const int o0 = g * R;
#pragma unroll
        for (int j = 0; j < R; ++j)
            r.w[j] = reinterpret_cast<const u8*>(w_row<FP8>(W, min(o0 + j, O - 1), K));
        r.s[0] = FP8 ? S + (i64)(o0 >> 7) * ld_s : nullptr;
        r.x = x + (rpg > 0 ? (i64)(o0 / rpg) * K : (i64)0);
        r.fp8 = FP8;
        return r;
    }
    DEV void store(int g, const float* v) const {
#pragma unroll
        for (int j = 0; j < R; ++j)
            if (g * R + j < O) store_out(y, g * R + j, v[j], out_bf16);
    }
};

// gemv_bf16_multi's rows: group g = the table's warp g (R rows of one projection).
template <int R>
struct GbMulti {
    const GemvSeg* segs;
    int nseg, K;
    const int* pos;
    DEV int ngroups() const { return segs[nseg].warp0; }
    DEV int seg_of(int g, int& hint) const {
        while (hint + 1 < nseg && g >= segs[hint + 1].warp0) ++hint;
        return hint;
    }
    DEV GbGroup<R, 1> group(int g, int& hint) const {
        const GemvSeg& sg = segs[seg_of(g, hint)];
        const int n = (&sg)[1].row0 - sg.row0, r0 = (g - sg.warp0) * R;
        GbGroup<R, 1> r;
        r.fp8 = sg.scale != nullptr;
#pragma unroll
        for (int j = 0; j < R; ++j)
            r.w[j] = reinterpret_cast<const u8*>(sg.w) + (i64)min(r0 + j, n - 1) * K * (r.fp8 ? 1 : 2);
        r.s[0] = r.fp8 ? sg.scale + (i64)(r0 >> 7) * sg.ld_scale : nullptr;
        r.x = nullptr;  // set by the kernel (one x)
        return r;
    }
    DEV void store(int g, const float* v) const {
        int hint = 0;
        const GemvSeg& sg = segs[seg_of(g, hint)];
        store_seg_rows<R>(sg, (&sg)[1].row0 - sg.row0, (g - sg.warp0) * R, pos, v);
    }
};
template <int R>
struct GbMultiX : GbMulti<R> {
    const u16* x;
    DEV GbGroup<R, 1> group(int g, int& hint) const {
        GbGroup<R, 1> r = GbMulti<R>::group(g, hint);
        r.x = x;
        return r;
    }
};

// gemv_bf16_swiglu's outputs: group g = outputs [g P, g P + P), rows of W1 then of W3.
template <int P>
struct GbSwiglu {
    const void *W1, *W3;
    const u8 *S1, *S3;
    int ld_s;
    const u16* x;
    u16* h;
    int O, K;
    double limit;
    DEV int ngroups() const { return (O + P - 1) / P; }
    DEV GbGroup<2 * P, 2> group(int g, int&) const {
        GbGroup<2 * P, 2> r;
        const int o0 = g * P;
        r.fp8 = S1 != nullptr;
        const i64 eb = r.fp8 ? 1 : 2;
#pragma unroll
        for (int j = 0; j < P; ++j) {
            r.w[j] = reinterpret_cast<const u8*>(W1) + (i64)min(o0 + j, O - 1) * K * eb;
            r.w[P + j] = reinterpret_cast<const u8*>(W3) + (i64)min(o0 + j, O - 1) * K * eb;
        }
        r.s[0] = r.fp8 ? S1 + (i64)(o0 >> 7) * ld_s : nullptr;
        r.s[1] = r.fp8 ? S3 + (i64)(o0 >> 7) * ld_s : nullptr;
        r.x = x;
        return r;
    }
    DEV void store(int g, const float* v) const {
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if (g * P + j >= O) break;
            const float gg = round_bf16(v[j]), u = round_bf16(v[P + j]);
            h[g * P + j] = (u16)f32_to_bf16(swiglu_value(gg, u, 1.0f, false, limit));
        }
    }
};
}  // namespace

// Launch: grid = ceil(nw / GEMV_WARPS) CTAs of GEMV_THREADS, dynamic shared memory
// ceil(GEMV_WARPS S 8 / 128) 128 + GEMV_WARPS S NR ROWB (ops_decode._bulk_smem).
#define GEMV_BULK_KERNEL(NAME, FP8, R, S, MINB)                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W, const u8* __restrict__ S_, int ld_s, const u16* __restrict__ x, \
         void* __restrict__ y, int O, int K, int rows_per_group, int out_bf16, int nw) {           \
        PDL_ENTRY();                                                                               \
        const GbPlain<FP8, R> d{W, S_, ld_s, x, y, O, K, rows_per_group, out_bf16};                \
        gb_stream<FP8 ? 1 : 0, R, 1, S, FP8 ? 1024 : 2048>(d, K, nw);                             \
    }
GEMV_BULK_KERNEL(gemv_bf16_bulk_r1s4, false, 1, 4, 4)
GEMV_BULK_KERNEL(gemv_bf16_bulk_r2s4, false, 2, 4, 3)
GEMV_BULK_KERNEL(gemv_bf16_bulk_r4s3, false, 4, 3, 2)
GEMV_BULK_KERNEL(gemv_fp8_bulk_r1s8, true, 1, 8, 4)
GEMV_BULK_KERNEL(gemv_fp8_bulk_r2s4, true, 2, 4, 4)
GEMV_BULK_KERNEL(gemv_fp8_bulk_r4s4, true, 4, 4, 3)

#define GEMV_MULTI_BULK_KERNEL(NAME, R, S, MINB)                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const GemvSeg* __restrict__ segs, int nseg, const u16* __restrict__ x, int K,             \
         const int* __restrict__ pos, int nw) {                                                    \
        PDL_ENTRY();                                                                               \
        GbMultiX<R> d;                                                                             \
        d.segs = segs; d.nseg = nseg; d.K = K; d.pos = pos; d.x = x;                               \
        gb_stream<2, R, 1, S, 2048>(d, K, nw);                                                     \
    }
GEMV_MULTI_BULK_KERNEL(gemv_bf16_multi_bulk_r1s8, 1, 8, 4)
GEMV_MULTI_BULK_KERNEL(gemv_bf16_multi_bulk_r4s3, 4, 3, 2)

#define GEMV_SWIGLU_BULK_KERNEL(NAME, P, S, MINB)                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, MINB)                               \
    NAME(const void* __restrict__ W1, const u8* __restrict__ S1, const void* __restrict__ W3,      \
         const u8* __restrict__ S3, int ld_s, const u16* __restrict__ x, u16* __restrict__ h,      \
         int O, int K, double limit, int nw) {                                                     \
        PDL_ENTRY();                                                                               \
        const GbSwiglu<P> d{W1, W3, S1, S3, ld_s, x, h, O, K, limit};                              \
        gb_stream<2, 2 * P, 2, S, 2048>(d, K, nw);                                                 \
    }
GEMV_SWIGLU_BULK_KERNEL(gemv_bf16_swiglu_bulk_p1s4, 1, 4, 3)
GEMV_SWIGLU_BULK_KERNEL(gemv_bf16_swiglu_bulk_p2s3, 2, 3, 2)


extern "C" __global__ void __launch_bounds__(256)
embed_gather(const int* __restrict__ tok, const u16* __restrict__ embed, u16* __restrict__ streams,
             int D, int hc) { PDL_ENTRY();
    const i64 row = (i64)tok[0] * D;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hc * D; i += gridDim.x * blockDim.x)
        streams[i] = embed[row + (i % D)];
}

extern "C" __global__ void step_scalars(const int* __restrict__ pos, int* __restrict__ aux, int r0,
                                        int r1, int r2, int r3) { PDL_ENTRY();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int p = pos[0];
    aux[0] = (p + 1) / 4;
    const int r[4] = {r0, r1, r2, r3};
#pragma unroll
    for (int i = 0; i < 4; ++i) aux[1 + i] = max(p + 1 - r[i], 0);
}

extern "C" __global__ void __launch_bounds__(256)
ring_write(const int* __restrict__ pos, const u16* __restrict__ src, u16* __restrict__ ring, int W,
           int d) { PDL_ENTRY();
    const i64 row = (i64)(pos[0] % W) * d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        ring[row + i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
pending_write(const int* __restrict__ pos, const float* __restrict__ a, const float* __restrict__ z,
              float* __restrict__ kv, float* __restrict__ score, int r, int ovl, int C) { PDL_ENTRY();
    const i64 row = (i64)((ovl ? r : 0) + pos[0] % r) * C;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < C; i += gridDim.x * blockDim.x) {
        kv[row + i] = a[i];
        score[row + i] = z[i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
entry_commit(const int* __restrict__ pos, const u16* __restrict__ src, u16* __restrict__ dst, int r,
             int d, int n_rows) { PDL_ENTRY();
    const int p1 = pos[0] + 1;
    if (p1 % r != 0) return;
    const int k = p1 / r - 1;
    if (k >= n_rows) return;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        dst[(i64)k * d + i] = src[i];
}

extern "C" __global__ void __launch_bounds__(256)
pending_advance(const int* __restrict__ pos, float* __restrict__ kv, float* __restrict__ score, int r,
                int ovl, int C) { PDL_ENTRY();
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

// verify_rollback: the device verify's commit(n) for every layer of a stage in one launch
// (gpu.verify_step VerifyStep.commit, commit_form "device"; the host form is that method's CuPy
// operations, which this kernel must equal byte for byte).  Rows 0..k were verified at p0..p0+k
// and rows n+1..k are rolled back, i.e. positions [lo, hi) = [p0 + n + 1, p0 + k + 1):
//   ring slots q % W of those positions <- ring_copy (the pre-verify ring; k + 1 <= W, so no
//     kept position shares a slot);
//   ratio > 0: the pending rows (kv, score; P rows of C floats) <- a gather of the layer's
//     journal buffers jkv / jsc [P pre-verify rows | staging rows | a fresh row (0, -inf)]:
//     row s <- journal row srcs[src + s] (gpu.hostmath.pending_sources: the oracle's pending
//     state machine replaying rows 0..n, run on row indices; uploaded by the wrapper, one list
//     per ratio), and compressed rows [lo / r, hi / r) (those below n_comp) <- 0 (emitted by
//     rolled-back rows);
//   idx_keys != 0: the same for the indexer's pending rows (ratio 4) and keys [lo / 4, hi / 4).
// Pure data movement.  grid (blocks, layers): blockIdx.y picks the layer's table entry, the
// x-blocks stride over its work.  Why a kernel: the host form is ~7 CuPy launches per layer.
struct RbLayer {  // ops_decode.RollbackTable.SEG (144 bytes)
    u64 ring, ring_copy, comp_kv, comp_score, comp_jkv, comp_jsc, comp, idx_kv, idx_score, idx_jkv,
        idx_jsc, idx_keys;
    int W, hd, ratio, comp_P, comp_C, n_comp, comp_src, dI, idx_P, idx_C, n_idx, idx_src;
};
static_assert(sizeof(RbLayer) == 144, "RbLayer: the host table's 144-byte records");

namespace {
// One compressor of a layer (the main one: ratio r, compressed rows of width hd; the indexer's:
// ratio 4, keys of width dI): pending rows (kv, score: P rows of C) <- journal rows src[s],
// rows [lo / r, hi / r) below n_rows <- 0.
DEV void rb_compressor(u64 kv_a, u64 score_a, u64 jkv_a, u64 jsc_a, u64 rows_a, const int* src,
                       int P, int C, int ratio, int width, int n_rows, int lo, int hi, int tid,
                       int nthr) {
    float* kv = reinterpret_cast<float*>(kv_a);
    float* sc = reinterpret_cast<float*>(score_a);
    const float* jkv = reinterpret_cast<const float*>(jkv_a);
    const float* jsc = reinterpret_cast<const float*>(jsc_a);
    for (int i = tid; i < P * C; i += nthr) {
        const i64 from = (i64)src[i / C] * C + i % C;
        kv[i] = jkv[from];
        sc[i] = jsc[from];
    }
    u16* rows = reinterpret_cast<u16*>(rows_a);
    const int r0 = lo / ratio, r1 = min(hi / ratio, n_rows);
    for (int i = tid; i < max(r1 - r0, 0) * width; i += nthr) rows[(i64)r0 * width + i] = 0;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
verify_rollback(const RbLayer* __restrict__ tab, const int* __restrict__ srcs, int p0, int k, int n) {
    PDL_ENTRY();
    const RbLayer L = tab[blockIdx.y];
    const int lo = p0 + n + 1, hi = p0 + k + 1;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, nthr = gridDim.x * blockDim.x;
    u16* ring = reinterpret_cast<u16*>(L.ring);
    const u16* rcopy = reinterpret_cast<const u16*>(L.ring_copy);
    for (int i = tid; i < (hi - lo) * L.hd; i += nthr) {
        const i64 o = (i64)((lo + i / L.hd) % L.W) * L.hd + i % L.hd;
        ring[o] = rcopy[o];
    }
    if (L.ratio > 0)
        rb_compressor(L.comp_kv, L.comp_score, L.comp_jkv, L.comp_jsc, L.comp, srcs + L.comp_src,
                      L.comp_P, L.comp_C, L.ratio, L.hd, L.n_comp, lo, hi, tid, nthr);
    if (L.idx_keys != 0)
        rb_compressor(L.idx_kv, L.idx_score, L.idx_jkv, L.idx_jsc, L.idx_keys, srcs + L.idx_src,
                      L.idx_P, L.idx_C, 4, L.dI, L.n_idx, lo, hi, tid, nthr);
}

// copy_vec4_x4: up to four device-to-device copies in one launch, dst_i[0, n_i) = src_i[0, n_i)
// in 16-byte words (a null pair with n_i = 0 is skipped).  The device verify's journal (the
// pending rows after each row, the ring before the rows): one kernel node where memcpy nodes
// would cost a node each and end the PDL chain (a kernel after a memcpy node waits for the
// memcpy's full completion).  Pure data movement: bit-identical to cudaMemcpy.  Grid-stride
// over the concatenation of the four ranges; the wrapper (ops_decode.copy_words) asserts the
// 16-byte alignment and sizes.
extern "C" __global__ void __launch_bounds__(256)
copy_vec4_x4(const uint4* __restrict__ s0, uint4* __restrict__ d0, long long n0,
             const uint4* __restrict__ s1, uint4* __restrict__ d1, long long n1,
             const uint4* __restrict__ s2, uint4* __restrict__ d2, long long n2,
             const uint4* __restrict__ s3, uint4* __restrict__ d3, long long n3) { PDL_ENTRY();
    const i64 total = n0 + n1 + n2 + n3;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 j = i;
        if (j < n0) { d0[j] = __ldcg(s0 + j); continue; }
        j -= n0;
        if (j < n1) { d1[j] = __ldcg(s1 + j); continue; }
        j -= n1;
        if (j < n2) { d2[j] = __ldcg(s2 + j); continue; }
        j -= n2;
        d3[j] = __ldcg(s3 + j);
    }
}

// The position is loaded BEFORE the PDL wait (PDL_ENTRY_PRELOAD): the step's arena pos is written
// before its graph starts (read through L2); the selection (sel) stays after the wait.
// Multi-row (grid.y = T: the device verify's rows at pos[0] + t): row t reads pos[t], sel row t
// (stride sel_w) and writes cand row t (stride K).  shadow_row > 0 (the verify, whose T kv rows
// are all in the ring before any row attends): a window position q < pos[0] whose slot a later
// row j = q + W - pos[0] < T replaced is read from kv row shadow_row + q % W instead (the
// pre-verify ring copy, the same bytes that slot held), so row t sees what a device step at
// pos[t] sees, in the same candidate order.  shadow_row 0 and T = 1: the step's candidates.
extern "C" __global__ void __launch_bounds__(256)
build_cand(const int* __restrict__ pos, int W, int ratio, const int* __restrict__ sel, int sel_w,
           int* __restrict__ cand, int K, int shadow_row) {
    PDL_ENTRY_PRELOAD(const int p = __ldcg(pos + blockIdx.y); const int p0 = __ldcg(pos));
    const int nrow = gridDim.y;
    if (sel != nullptr) sel += (i64)blockIdx.y * sel_w;
    cand += (i64)blockIdx.y * K;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < K; j += gridDim.x * blockDim.x) {
        int v = -1;
        if (j < W) {
            const int t = max(p - W + 1, 0) + j;
            if (t <= p) v = (shadow_row > 0 && t < p0 && t + W - p0 < nrow) ? shadow_row + t % W : t % W;
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

// greedy_argmax_f32: tok[0] = the index of the greatest of logits[0, n), np.argmax's rule: the
// first occurrence of the maximum, and a NaN counts as greater than every number (the first NaN
// wins).  With pos (may be null): hist[pos[0] + 1] = tok[0] when that entry is < hist_len, then
// pos[0] += 1.  The device step's head ends with it: the step's token readback is tok's 4 bytes,
// and DeviceStep.greedy replays the stage graph n times with nothing from the host in between
// (the next step's embed_gather reads tok, every position-dependent kernel reads the advanced
// pos) and reads the n picks back from hist at the end.  Writing tok and pos is safe here: it
// is the step's last launch and every reader of them ran earlier in the step (every branch has
// joined before the head); a host-fed step uploads both before its next launch anyway.  The next
// replay's pre-wait loads of pos (PDL_ENTRY_PRELOAD) see the advanced value: a graph launch starts
// after the previous work on its stream has completed (programmatic edges are captured inside one
// graph only).  Not timed alone; one SM's strided scan of L2-resident logits.
// One CTA of 1024 threads: the logits were just written by the head GEMV (Flash: 517 KB, in L2),
// so the launch is one SM's latency, not bandwidth.  Thread t keeps the best of t, t + 1024, ...
// (ascending, so a tie keeps the lower index), then a warp butterfly and one warp over the 32
// warp winners, both under argmax_ahead, a strict total order on (value, index) pairs (indices
// are distinct), so every lane of the butterfly ends with the same winner.
namespace {
DEV bool argmax_ahead(float va, int ia, float vb, int ib) {   // (va, ia) before (vb, ib)?
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ia < ib);
    return va > vb || (va == vb && ia < ib);
}

DEV void argmax_warp(float& v, int& i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (argmax_ahead(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(1024)
greedy_argmax_f32(const float* __restrict__ logits, int n, int* __restrict__ tok, int* __restrict__ pos,
                  int* __restrict__ hist, int hist_len) { PDL_ENTRY();
    __shared__ float wv[32];
    __shared__ int wi[32];
    float v = f32_ninf();
    int i = 0x7fffffff;   // loses to every element (n >= 1): a tie on -inf keeps the element
#pragma unroll 8
    for (int j = threadIdx.x; j < n; j += 1024) {
        const float x = logits[j];
        if (argmax_ahead(x, j, v, i)) { v = x; i = j; }
    }
    argmax_warp(v, i);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { wv[w] = v; wi[w] = i; }
    __syncthreads();
    if (w == 0) {
        v = wv[lane];
        i = wi[lane];
        argmax_warp(v, i);
        if (lane == 0) {
            tok[0] = i;
            if (pos != nullptr) {
                const int p1 = pos[0] + 1;
                if (hist != nullptr && p1 >= 0 && p1 < hist_len) hist[p1] = i;
                pos[0] = p1;
            }
        }
    }
}
