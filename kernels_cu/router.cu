// MoE router (dsv4_model_and_formats §5.1, M:546-584).
//
// router_logits_bf16: logits[t, e] = f32(x_t . W_e) for bf16 x [T, D] and bf16 W [E, D]
//   (twin oracle.ops.router_logits: fp32 x . fp32 W^T). Each bf16 x bf16 product is exact in
//   f32 and is accumulated in double (per lane in chunk order, then a warp xor-tree), so the
//   rounded result is the twin's correctly rounded value (up to double-rounding ties). Grid
//   (ceil(E/8), ceil(T/4)), block 256: warp = one expert row for 4 tokens (W read once per 4
//   tokens). A row's result does not depend on T. Use it for decode; a cuBLASLt f32 GEMM may be
//   used for long prefills (then the two paths agree only to f32 rounding).
// router_select_e{32,64,128,256,384,512}: per token (one warp): s = sqrt(softplus(logit)) (torch
//   softplus, threshold 20; exp/log1p evaluated in double and rounded to f32 at the twin's
//   rounding points), then
//     learned (bias != null): top-k of f32(s + bias), descending, ties -> lower expert id;
//     hash (bias == null):    idx = tid2eid[token_ids[t]] (int32 table [V, k], converted from the
//                             checkpoint's int64 at load), pick order kept;
//   weights = (s[idx] / sum_j s[idx_j]) * f32(route_scale) in f32, the sum in pick order (twin
//   host.routing.route). Outputs idx int32 [T, k] (the twin returns int64), weights f32 [T, k],
//   scores f32 [T, E] (optional). Block 128 = 4 tokens; the CTA computes the scores of its 4
//   tokens with all 128 threads, then each warp selects for its token.
#include "common.cuh"

using namespace memra;

constexpr int RL_TOK = 4;

// x: [T, D] bf16; w: [E, D] bf16; out: [T, E] f32. D % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
router_logits_bf16(const u16* __restrict__ x, const u16* __restrict__ w, float* __restrict__ out,
                   int T, int D, int E) { PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * RL_TOK;
    if (e >= E) return;
    double acc[RL_TOK];
#pragma unroll
    for (int t = 0; t < RL_TOK; ++t) acc[t] = 0.0;
    const int nc = D >> 3;
    // unrolled so the loads of 2 chunks are issued before their (in-order) accumulation: the
    // same sum, with 2 loads in flight per lane instead of 1 (decode has only E / 8 CTAs; 4
    // spills)
#pragma unroll 2
    for (int c = lane; c < nc; c += 32) {
        float wf[8];
        unpack8(ldg16(w + (i64)e * D + 8 * c), wf);
#pragma unroll
        for (int t = 0; t < RL_TOK; ++t) {
            if (t0 + t < T) {
                float xf[8];
                unpack8(ldg16(x + (i64)(t0 + t) * D + 8 * c), xf);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[t] = __dadd_rn(acc[t], (double)__fmul_rn(wf[i], xf[i]));
            }
        }
    }
#pragma unroll
    for (int t = 0; t < RL_TOK; ++t) {
        const double s = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < T) out[(i64)(t0 + t) * E + e] = __double2float_rn(s);
    }
}

namespace {

constexpr int RS_WARPS = 4;
constexpr int RS_KMAX = 16;

DEV float sqrtsoftplus(float x) {
    float sp;
    if (x > 20.0f) {
        sp = x;
    } else {
        const float ex = __double2float_rn(exp((double)x));      // np.exp (f32)
        sp = __double2float_rn(log1p((double)ex));               // np.log1p (f32)
    }
    return __fsqrt_rn(sp);
}

// One token's selection by one warp (every lane calls): s_row = the token's scores (shared,
// [32 * EPL], 0 past E), b[i] = f32(s + bias) of expert lane + 32 i (-inf past E; unused for
// hash), sel = k ints of shared scratch. Learned: top-k of b, descending, ties -> lower id; hash:
// tid2eid_row[0..k). Writes idx_row / w_row [k]. router_select_* and router_fused_* both select
// through this one function: the same ids and weights for the same scores.
template <int EPL>
DEV void select_token_warp(const float* s_row, const float (&b)[EPL], bool learned,
                           const int* __restrict__ tid2eid_row, int* sel, int* __restrict__ idx_row,
                           float* __restrict__ w_row, int E, int k, float route_scale, int lane) {
    if (learned) {
        u32 taken = 0;
        for (int j = 0; j < k; ++j) {
            float bv = f32_ninf();
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const int e = lane + 32 * i;
                if (e < E && !((taken >> i) & 1u) && (b[i] > bv || bi == 0x7fffffff)) {
                    bv = b[i];
                    bi = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {  // (value desc, id asc): a total order
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
#pragma unroll
            for (int i = 0; i < EPL; ++i)
                if (bi == lane + 32 * i) taken |= 1u << i;
            if (lane == 0) sel[j] = bi;
        }
    } else if (lane < k) {
        sel[lane] = __ldg(tid2eid_row + lane);
    }
    __syncwarp();
    if (lane < k) {
        float tot = s_row[sel[0]];
        for (int j = 1; j < k; ++j) tot = __fadd_rn(tot, s_row[sel[j]]);
        const int e = sel[lane];
        idx_row[lane] = e;
        w_row[lane] = __fmul_rn(__fdiv_rn(s_row[e], tot), route_scale);
    }
}

template <int EPL>
DEV void router_select_body(const float* __restrict__ logits, const float* __restrict__ bias,
                            const int* __restrict__ tid2eid, const int* __restrict__ token_ids,
                            int* __restrict__ idx_out, float* __restrict__ w_out,
                            float* __restrict__ scores_out, int T, int E, int k, float route_scale) {
    __shared__ float s_sh[RS_WARPS][32 * EPL];
    __shared__ float b_sh[RS_WARPS][32 * EPL];
    __shared__ int sel[RS_WARPS][RS_KMAX];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const i64 t = (i64)blockIdx.x * RS_WARPS + wid;
    // Phase 1, the whole CTA: s = sqrtsoftplus(logit) (double exp / log1p: long dependent
    // chains) and s + bias for every (token, expert) of the CTA's tokens, spread over all 128
    // threads rather than 32 * EPL chains per warp (decode has T = 1: one busy warp otherwise).
    const i64 t0 = (i64)blockIdx.x * RS_WARPS;
    for (int i = threadIdx.x; i < RS_WARPS * 32 * EPL; i += blockDim.x) {
        const int w = i / (32 * EPL), e = i % (32 * EPL);
        float s = 0.0f, bs = f32_ninf();
        if (t0 + w < T && e < E) {
            s = sqrtsoftplus(__ldg(logits + (t0 + w) * E + e));
            if (scores_out != nullptr) scores_out[(t0 + w) * E + e] = s;
            if (bias != nullptr) bs = __fadd_rn(s, __ldg(bias + e));
        }
        s_sh[w][e] = s;
        b_sh[w][e] = bs;
    }
    __syncthreads();
    if (t >= T) return;  // whole warp
    float b[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) b[i] = b_sh[wid][lane + 32 * i];
    const int* trow = bias != nullptr ? nullptr : tid2eid + (i64)__ldg(token_ids + t) * k;
    select_token_warp<EPL>(s_sh[wid], b, bias != nullptr, trow, sel[wid], idx_out + t * k, w_out + t * k, E, k,
                           route_scale, lane);
}

}  // namespace

// logits [T, E] f32; bias [E] f32 (learned) or null (hash: tid2eid [V, k] int32, token_ids [T]
// int32); idx_out [T, k] int32; w_out [T, k] f32; scores_out [T, E] f32 or null. E <= 32*EPL,
// k <= 16. grid ceil(T/4), block 128.
#define ROUTER_SELECT(NAME, EPL)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                            \
    NAME(const float* __restrict__ logits, const float* __restrict__ bias,                       \
         const int* __restrict__ tid2eid, const int* __restrict__ token_ids, int* __restrict__ idx_out, \
         float* __restrict__ w_out, float* __restrict__ scores_out, int T, int E, int k, float route_scale) { PDL_ENTRY(); \
        router_select_body<EPL>(logits, bias, tid2eid, token_ids, idx_out, w_out, scores_out, T, E, k, \
                                route_scale);                                                    \
    }

ROUTER_SELECT(router_select_e32, 1)
ROUTER_SELECT(router_select_e64, 2)
ROUTER_SELECT(router_select_e128, 4)
ROUTER_SELECT(router_select_e256, 8)
ROUTER_SELECT(router_select_e384, 12)
ROUTER_SELECT(router_select_e512, 16)

// ---------------------------------------------------------------------------------------------
// router_fused_e{32,...,512}: the decode router (T = 1) in ONE launch, bit for bit
// router_logits_bf16 followed by router_select_e* on that token.
//   GEMV: warp = one expert row, RF_WARPS rows per CTA (E = 256: 64 CTAs rather than the 32 of
//   router_logits_bf16). Lane l owns the chunks c = l + 32 i and accumulates them in c order in
//   double, then warp_sum: router_logits_bf16's per-row order exactly, so the logits are the same
//   bits. The lane's first RF_LOADS 16-byte weight chunks (D = 4096: its whole share of the row)
//   are issued BEFORE the PDL wait (PDL_ENTRY_PRELOAD, rf_preload: the router weight is static,
//   so the loads cannot observe the predecessor; under PDL the CTAs are resident while the
//   hc boundary before them runs, and the weights' DRAM latency leaves the chain); x is staged
//   in shared memory after the wait; the row's lane 0 then computes
//   s = sqrtsoftplus(logit) itself (the double exp / log1p spread over the CTAs), writing logits
//   and scores.
//   Select: every CTA fences its writes and takes a ticket (atomicAdd on counter[0]); the CTA
//   that draws the last ticket fences again, reads all E scores back through L2 (ld.cg) and its
//   warp 0 selects through select_token_warp (router_select_*'s code), then resets the counter
//   to 0: the kernel leaves it as it found it, so graph replays and the next layer's launch start
//   from 0. counter must be 0 before the first launch and not shared by concurrent launches.
// x [1, D] bf16 (D % 8 == 0, 16-byte aligned); w [E, D] bf16; bias [E] f32 or null (hash:
// tid2eid [V, k] int32 + token_ids [1] int32); logits_out, scores_out [E] f32; idx_out [k] int32;
// w_out [k] f32. grid ceil(E / RF_WARPS), block 32 * RF_WARPS, dynamic smem D * 2 bytes.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int RF_WARPS = 4;
constexpr int RF_LOADS = 16;

struct RfFirst {  // a lane's first RF_LOADS weight chunks of its warp's row (zeros past the row / E)
    uint4 wv[RF_LOADS];
};

// the lane's RF_LOADS weight chunks c0 + lane + 32 i of its warp's row (zeros past the row / E)
DEV void rf_load_batch(const u16* __restrict__ wrow, bool row_ok, int nc, int c0, uint4 (&wv)[RF_LOADS]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < RF_LOADS; ++i) {
        const int c = c0 + lane + 32 * i;
        wv[i] = row_ok && c < nc ? ldg_stream16(wrow + 8 * c) : make_uint4(0, 0, 0, 0);
    }
}

// Before the PDL wait (PDL_ENTRY_PRELOAD): the static router weight only.  It ends its basic
// block (the branch on D, never taken), so ptxas cannot schedule the wait above the loads.
DEV RfFirst rf_preload(const u16* __restrict__ w, int D, int E) {
    RfFirst f;
    const int e = blockIdx.x * RF_WARPS + (threadIdx.x >> 5);
    const bool row_ok = e < E;
    rf_load_batch(w + (i64)(row_ok ? e : 0) * D, row_ok, D >> 3, 0, f.wv);
    if (D < 0) __trap();
    return f;
}

template <int EPL>
DEV void router_fused_body(const RfFirst& first, const u16* __restrict__ x, const u16* __restrict__ w,
                           const float* __restrict__ bias,
                           const int* __restrict__ tid2eid, const int* __restrict__ token_ids,
                           float* __restrict__ logits_out, float* __restrict__ scores_out,
                           int* __restrict__ idx_out, float* __restrict__ w_out, int* __restrict__ counter,
                           int D, int E, int k, float route_scale) {
    extern __shared__ __align__(16) unsigned char rf_smem[];
    uint4* xs = reinterpret_cast<uint4*>(rf_smem);  // x as D / 8 chunks of 8 bf16
    __shared__ float s_sh[32 * EPL];
    __shared__ int sel[RS_KMAX];
    __shared__ int is_last;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int e = blockIdx.x * RF_WARPS + wid;
    const bool row_ok = e < E;  // a warp past E still reaches the barriers
    const int nc = D >> 3;
    const u16* wrow = w + (i64)(row_ok ? e : 0) * D;
    uint4 wv[RF_LOADS];
#pragma unroll
    for (int i = 0; i < RF_LOADS; ++i) wv[i] = first.wv[i];  // loaded before the wait
    for (int c = threadIdx.x; c < nc; c += blockDim.x) xs[c] = ldg16(x + 8 * c);
    __syncthreads();
    double acc = 0.0;
    for (int c0 = 0;;) {
        if (c0 + 32 * RF_LOADS <= nc) {  // a full batch (D = 4096): no per-chunk branches, so the
                                         // x reads can run ahead of the double-add chain
#pragma unroll
            for (int i = 0; i < RF_LOADS; ++i) {  // chunks in c order: router_logits_bf16's sum
                float wf[8], xf[8];
                unpack8(wv[i], wf);
                unpack8(xs[c0 + lane + 32 * i], xf);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc = __dadd_rn(acc, (double)__fmul_rn(wf[j], xf[j]));
            }
        } else {
#pragma unroll
            for (int i = 0; i < RF_LOADS; ++i) {
                const int c = c0 + lane + 32 * i;
                if (c < nc) {
                    float wf[8], xf[8];
                    unpack8(wv[i], wf);
                    unpack8(xs[c], xf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc = __dadd_rn(acc, (double)__fmul_rn(wf[j], xf[j]));
                }
            }
        }
        c0 += 32 * RF_LOADS;
        if (c0 >= nc) break;  // D > 32 * 8 * RF_LOADS: the next batch
        rf_load_batch(wrow, row_ok, nc, c0, wv);
    }
    const double tot = warp_sum(acc);
    if (row_ok && lane == 0) {
        const float logit = __double2float_rn(tot);
        logits_out[e] = logit;
        scores_out[e] = sqrtsoftplus(logit);
    }
    // this CTA's logits / scores visible device-wide before its ticket
    if (!last_cta_ticket(counter, (int)gridDim.x, is_last) || wid != 0) return;
    __threadfence();  // every other CTA's scores, read below through L2
    float s[EPL], b[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {  // all loads first (EPL in flight), then the sums
        const int ee = lane + 32 * i;
        s[i] = ee < E ? __ldcg(scores_out + ee) : 0.0f;
        b[i] = ee < E && bias != nullptr ? __ldg(bias + ee) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int ee = lane + 32 * i;
        s_sh[ee] = s[i];
        b[i] = ee < E && bias != nullptr ? __fadd_rn(s[i], b[i]) : f32_ninf();
    }
    __syncwarp();
    const int* trow = bias != nullptr ? nullptr : tid2eid + (i64)__ldg(token_ids) * k;
    select_token_warp<EPL>(s_sh, b, bias != nullptr, trow, sel, idx_out, w_out, E, k, route_scale, lane);
    if (lane == 0) *counter = 0;  // ready for the next launch
}

}  // namespace

#define ROUTER_FUSED(NAME, EPL)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * RF_WARPS)                                  \
    NAME(const u16* __restrict__ x, const u16* __restrict__ w, const float* __restrict__ bias,     \
         const int* __restrict__ tid2eid, const int* __restrict__ token_ids, float* __restrict__ logits_out, \
         float* __restrict__ scores_out, int* __restrict__ idx_out, float* __restrict__ w_out,    \
         int* __restrict__ counter, int D, int E, int k, float route_scale) {                     \
        PDL_ENTRY_PRELOAD(const RfFirst first = rf_preload(w, D, E));                             \
        router_fused_body<EPL>(first, x, w, bias, tid2eid, token_ids, logits_out, scores_out, idx_out, w_out, counter, \
                               D, E, k, route_scale);                                             \
    }

ROUTER_FUSED(router_fused_e32, 1)
ROUTER_FUSED(router_fused_e64, 2)
ROUTER_FUSED(router_fused_e128, 4)
ROUTER_FUSED(router_fused_e256, 8)
ROUTER_FUSED(router_fused_e384, 12)
ROUTER_FUSED(router_fused_e512, 16)
