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
#include "cluster.cuh"

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

// Learned top-k of one token by one warp (every lane calls): b[i] = f32(s + bias) of expert
// lane + 32 i (-inf past E): top-k of b, descending, ties -> lower id, into sel[0..k).
template <int EPL>
DEV void select_topk_warp(const float (&b)[EPL], int* sel, int E, int k, int lane) {
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
}

// The routing weights of the k picks sel[0..k) (shared; every lane calls, after the picks are
// visible to the warp): w = (s[e] / sum_j s[sel_j]) * route_scale, the sum in pick order.
DEV void select_weights_warp(const float* s_row, const int* sel, int* __restrict__ idx_row,
                             float* __restrict__ w_row, int k, float route_scale, int lane) {
    if (lane < k) {
        float tot = s_row[sel[0]];
        for (int j = 1; j < k; ++j) tot = __fadd_rn(tot, s_row[sel[j]]);
        const int e = sel[lane];
        idx_row[lane] = e;
        w_row[lane] = __fmul_rn(__fdiv_rn(s_row[e], tot), route_scale);
    }
}

// One token's selection by one warp (every lane calls): s_row = the token's scores (shared,
// [32 * EPL], 0 past E), b[i] = f32(s + bias) of expert lane + 32 i (-inf past E; unused for
// hash), sel = k ints of shared scratch. Learned: top-k of b (select_topk_warp); hash:
// tid2eid_row[0..k). Writes idx_row / w_row [k] (select_weights_warp). router_select_*,
// router_fused_* and router_cluster_* all select through these functions: the same ids and
// weights for the same scores.
template <int EPL>
DEV void select_token_warp(const float* s_row, const float (&b)[EPL], bool learned,
                           const int* __restrict__ tid2eid_row, int* sel, int* __restrict__ idx_row,
                           float* __restrict__ w_row, int E, int k, float route_scale, int lane) {
    if (learned) {
        select_topk_warp<EPL>(b, sel, E, k, lane);
    } else if (lane < k) {
        sel[lane] = __ldg(tid2eid_row + lane);
    }
    __syncwarp();
    select_weights_warp(s_row, sel, idx_row, w_row, k, route_scale, lane);
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
// Multi-row (grid (ceil(E / RF_WARPS), T): the device verify's T tokens, each routed alone):
// x [T, D], token_ids [T], logits_out / scores_out [T, E], idx_out / w_out [T, k], counter [T];
// row t's CTAs are a one-token launch on row t's pointers (the same bytes); row 0 unchanged.
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
template <int ROWS_PER_CTA>
DEV RfFirst rf_preload(const u16* __restrict__ w, int D, int E) {
    RfFirst f;
    const int e = blockIdx.x * ROWS_PER_CTA + (threadIdx.x >> 5);
    const bool row_ok = e < E;
    rf_load_batch(w + (i64)(row_ok ? e : 0) * D, row_ok, D >> 3, 0, f.wv);
    if (D < 0) __trap();
    return f;
}

// The row dot of router_fused_* / router_cluster_*: lane l accumulates the chunks c = l + 32 i of
// its warp's row in c order in double (its first RF_LOADS chunks from ``first``, loaded before the
// wait), then warp_sum: router_logits_bf16's per-row order, so the logits are the same bits.
// xs: x staged in shared memory (D / 8 chunks).  Every lane returns the row's sum.
DEV double rf_row_dot(const RfFirst& first, const uint4* xs, const u16* __restrict__ wrow, bool row_ok, int nc) {
    const int lane = threadIdx.x & 31;
    uint4 wv[RF_LOADS];
#pragma unroll
    for (int i = 0; i < RF_LOADS; ++i) wv[i] = first.wv[i];  // loaded before the wait
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
    return warp_sum(acc);
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
    for (int c = threadIdx.x; c < nc; c += blockDim.x) xs[c] = ldg16(x + 8 * c);
    __syncthreads();
    const double tot = rf_row_dot(first, xs, wrow, row_ok, nc);
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
        PDL_ENTRY_PRELOAD(const RfFirst first = rf_preload<RF_WARPS>(w, D, E));                             \
        const int t = blockIdx.y;  /* row t of a multi-row launch: its own token, outputs, ticket */ \
        router_fused_body<EPL>(first, x + (i64)t * D, w, bias, tid2eid,                           \
                               token_ids == nullptr ? nullptr : token_ids + t, logits_out + (i64)t * E, \
                               scores_out + (i64)t * E, idx_out + t * k, w_out + t * k, counter + t, \
                               D, E, k, route_scale);                                             \
    }

ROUTER_FUSED(router_fused_e32, 1)
ROUTER_FUSED(router_fused_e64, 2)
ROUTER_FUSED(router_fused_e128, 4)
ROUTER_FUSED(router_fused_e256, 8)
ROUTER_FUSED(router_fused_e384, 12)
ROUTER_FUSED(router_fused_e512, 16)

// ---------------------------------------------------------------------------------------------
// router_cluster_e{32,64,128,256}: router_fused_*'s launch, the same bits, with the selection's
// handoff inside ONE thread-block cluster instead of through global memory.
//   Grid = one cluster of C = ceil(E / RC_WARPS) CTAs (C <= 16, so E <= 256; C > 8 is a
//   non-portable cluster size, which the launch allows on the function) of RC_WARPS = 16 warps,
//   one expert row per warp, the lane's first RF_LOADS chunks loaded before the PDL wait
//   (rf_preload, as router_fused_*) and the row dot rf_row_dot (the same per-row order, so the
//   same logits).  Lane 0 of a row writes its logit and score to global (the outputs) and the
//   score into the shared memory of the cluster's rank-0 CTA by st.async, which completes 4
//   bytes of an mbarrier there (rank 0 set it up before its PDL wait, expecting E * 4 bytes);
//   rank 0's warp 0 waits on that mbarrier (acquire, cluster scope) and selects
//   (select_topk_warp / select_weights_warp: router_select_*'s code).  The only cluster barrier
//   is split: every CTA arrives before its PDL wait, and waits (long satisfied) before its first
//   remote store, so all CTAs have started and the mbarrier is initialised.
//   What that removes from router_fused_*'s chain after the wait: the fence, the ticket atomic,
//   the second fence and the ld.cg re-read of the scores (~4 L2 round trips, which a saturated
//   HBM, the shared expert's rows streaming beside the router (MEMRA_DSV4_SHARED_GATEUP),
//   stretches to microseconds), and any GPU-scope fence: barrier.cluster.arrive.release
//   compiles to MEMBAR.ALL.GPU, which would wait for the logits / scores stores.  No counter.  Static data of rank 0's warp 0 also move
//   off the chain: the bias (learned) is loaded before the wait with the weight rows; the token
//   id and its tid2eid row (hash) right after the wait, in flight during the row dot.
//   Why 16 warps: one row per warp, and a cluster has at most 16 CTAs; 512 threads x <= 128
//   registers (ptxas: ~110) = one CTA per SM.
// Arguments as router_fused_* without the counter. grid C = ceil(E / 16) with cluster dims
// (C, 1, 1), block 32 * RC_WARPS, dynamic smem D * 2 bytes.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int RC_WARPS = 16;

template <int EPL>
struct RcFirst {
    RfFirst rows;     // the lane's first RF_LOADS chunks of its warp's row
    float bias[EPL];  // rank 0, warp 0, learned: bias[lane + 32 i] (0 elsewhere)
};

// rank 0's mbarrier that counts the E score bytes the rows send (one per CTA, static shared)
DEV u64* rc_scores_bar() {
    __shared__ __align__(8) u64 bar;
    return &bar;
}

// Before the PDL wait: the static router weight rows and (rank 0's warp 0) the static bias; rank
// 0's thread 0 sets up the scores' mbarrier (one arrival, its own, carrying E * 4 expected bytes;
// the rows' st.async complete the bytes).  Then every thread arrives (relaxed) at the cluster
// barrier whose wait (cluster_started) precedes the first remote store: the CUDA guide's rule
// that every CTA of the cluster must have started before its shared memory is accessed, and the
// mbarrier's init visible cluster-wide (fence.mbarrier_init).  None of it touches global memory,
// so it may precede the wait.
template <int EPL>
DEV RcFirst<EPL> rc_preload(const u16* __restrict__ w, const float* __restrict__ bias, int D, int E) {
    RcFirst<EPL> f;
    f.rows = rf_preload<RC_WARPS>(w, D, E);
    const int lane = threadIdx.x & 31;
    const bool selector = blockIdx.x == 0 && threadIdx.x < 32 && bias != nullptr;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        f.bias[i] = selector && e < E ? __ldg(bias + e) : 0.0f;
    }
    if (E < 0) __trap();  // ends the block: the wait stays below the loads (rf_preload's reason)
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        mbar_init_expect(rc_scores_bar(), 4 * E);
        fence_mbarrier_init_cluster();
    }
    cluster_arrive_relaxed();
    return f;
}

// rank 0: until phase 0 of the scores' mbarrier completes (all E * 4 bytes arrived), with
// cluster-scope acquire (the bytes came from other CTAs).  (cluster_started, st_async_cluster_f32:
// cluster.cuh.)
DEV void rc_wait_scores(const u64* bar) { mbar_wait_cluster(bar, 0); }

template <int EPL>
DEV void router_cluster_body(const RcFirst<EPL>& first, const u16* __restrict__ x, const u16* __restrict__ w,
                             const float* __restrict__ bias, const int* __restrict__ tid2eid,
                             const int* __restrict__ token_ids, float* __restrict__ logits_out,
                             float* __restrict__ scores_out, int* __restrict__ idx_out, float* __restrict__ w_out,
                             int D, int E, int k, float route_scale) {
    extern __shared__ __align__(16) unsigned char rf_smem[];
    uint4* xs = reinterpret_cast<uint4*>(rf_smem);  // x as D / 8 chunks of 8 bf16
    __shared__ float s_sh[32 * EPL];                // rank 0: every row's score (the others: unused)
    __shared__ int sel[RS_KMAX];
    const u64* bar = rc_scores_bar();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const bool selector = blockIdx.x == 0 && wid == 0;  // one cluster: blockIdx.x = the CTA's rank
    const int e = blockIdx.x * RC_WARPS + wid;
    const bool row_ok = e < E;  // a warp past E still reaches the barriers
    const int nc = D >> 3;
    const u16* wrow = w + (i64)(row_ok ? e : 0) * D;
    int pick = 0;  // hash: tid2eid[token, lane], issued now, consumed after the scores arrived
    if (selector && bias == nullptr && lane < k) pick = __ldg(tid2eid + (i64)__ldg(token_ids) * k + lane);
    for (int c = threadIdx.x; c < nc; c += blockDim.x) xs[c] = ldg16(x + 8 * c);
    __syncthreads();
    const double tot = rf_row_dot(first.rows, xs, wrow, row_ok, nc);
    cluster_started();  // before the first remote store
    if (row_ok && lane == 0) {
        const float logit = __double2float_rn(tot);
        const float score = sqrtsoftplus(logit);
        st_async_cluster_f32(s_sh + e, bar, 0, score);
        logits_out[e] = logit;
        scores_out[e] = score;
    }
    if (!selector) return;  // rank 0 stays until every row's bytes arrived (its wait below)
    rc_wait_scores(bar);    // rank 0's s_sh holds all E scores
    if (bias != nullptr) {
        float b[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int ee = lane + 32 * i;
            b[i] = ee < E ? __fadd_rn(s_sh[ee], first.bias[i]) : f32_ninf();
        }
        select_topk_warp<EPL>(b, sel, E, k, lane);
    } else if (lane < k) {
        sel[lane] = pick;
    }
    __syncwarp();
    select_weights_warp(s_sh, sel, idx_out, w_out, k, route_scale, lane);
}

}  // namespace

#define ROUTER_CLUSTER(NAME, EPL)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * RC_WARPS, 1)                               \
    NAME(const u16* __restrict__ x, const u16* __restrict__ w, const float* __restrict__ bias,     \
         const int* __restrict__ tid2eid, const int* __restrict__ token_ids, float* __restrict__ logits_out, \
         float* __restrict__ scores_out, int* __restrict__ idx_out, float* __restrict__ w_out,    \
         int D, int E, int k, float route_scale) {                                                \
        PDL_ENTRY_PRELOAD(const RcFirst<EPL> first = rc_preload<EPL>(w, bias, D, E));             \
        router_cluster_body<EPL>(first, x, w, bias, tid2eid, token_ids, logits_out, scores_out, idx_out, w_out, D, \
                                 E, k, route_scale);                                              \
    }

ROUTER_CLUSTER(router_cluster_e32, 1)
ROUTER_CLUSTER(router_cluster_e64, 2)
ROUTER_CLUSTER(router_cluster_e128, 4)
ROUTER_CLUSTER(router_cluster_e256, 8)
