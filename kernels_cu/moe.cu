// MoE elementwise kernels: clamped SwiGLU and the combine (dsv4_model_and_formats §5.2-5.4).
//
// swiglu_clamped_bf16: h = bf16( w_s * (f32(silu(min(g, L))) * f32(clip(u, -L, L))) ) per slot s,
//   twin oracle.ops.swiglu_clamped followed by the store of the w2 input: silu in double
//   (g / (1 + exp(-g))) rounded to f32, then the two f32 products of the twin (no FMA).
//   limit <= 0 disables the clamps; weight null = no routing weight (shared expert).
//   gate/up rows have strides ld_g/ld_u (so a fused [S, 2I] gate|up buffer works).
//   Grid-stride, one thread per 8 elements.
// moe_combine_bf16: y[t] = bf16( (0 + sum over the k picks in ASCENDING expert id (stable) of
//   routed[t, j]) + shared[t] ), f32 accumulator, bit-identical to oracle.ops.moe_combine.
//   Grid (T, ceil(D/1024)), block 128, thread = 8 channels.
#include "common.cuh"

using namespace memra;

// gate, up: [S, I] bf16 with row strides ld_g, ld_u; weight: [S] f32 or null; h: [S, ld_h] bf16.
extern "C" __global__ void __launch_bounds__(256)
swiglu_clamped_bf16(const u16* __restrict__ gate, int ld_g, const u16* __restrict__ up, int ld_u,
                    const float* __restrict__ weight, u16* __restrict__ h, int ld_h, int S, int I,
                    double limit) { PDL_ENTRY();
    const int cpr = I >> 3;
    const i64 total = (i64)S * cpr;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 s = i / cpr;
        const int c = (int)(i % cpr);
        float g[8], u[8], o[8];
        unpack8(ldg16(gate + s * ld_g + 8 * c), g);
        unpack8(ldg16(up + s * ld_u + 8 * c), u);
        const float ws = weight != nullptr ? __ldg(weight + s) : 1.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = swiglu_value(g[e], u[e], ws, weight != nullptr, limit);
        stg16(h + s * ld_h + 8 * c, pack8(o));
    }
}

// routed: [T*k, D] bf16 (pick j of token t at row t*k + j); idx: [T, k] int32 expert ids;
// shared: [T, D] bf16 or null; y: [T, D] bf16. k <= 16. grid (T, ceil(D/1024)), block 128.
extern "C" __global__ void __launch_bounds__(128)
moe_combine_bf16(const u16* __restrict__ routed, const int* __restrict__ idx,
                 const u16* __restrict__ shared, u16* __restrict__ y, int D, int k) { PDL_ENTRY();
    __shared__ int order[16];
    __shared__ int ids[16];
    const i64 t = blockIdx.x;
    if (threadIdx.x == 0) {  // stable insertion sort of the picks by expert id
        for (int j = 0; j < k; ++j) {
            const int e = idx[t * k + j];
            int p = j;
            while (p > 0 && ids[p - 1] > e) {
                ids[p] = ids[p - 1];
                order[p] = order[p - 1];
                --p;
            }
            ids[p] = e;
            order[p] = j;
        }
    }
    __syncthreads();
    const int c = blockIdx.y * 128 + threadIdx.x;
    if (8 * c >= D) return;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
        float f[8];
        unpack8(ldg16(routed + (t * k + order[j]) * D + 8 * c), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
    }
    if (shared != nullptr) {
        float f[8];
        unpack8(ldg16(shared + t * D + 8 * c), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
    }
    stg16(y + t * D + 8 * c, pack8(acc));
}

// ============================================================ prefill MoE: the dispatch plan on the device
// The routed experts' dispatch plan of a prefill chunk built from the DEVICE expert ids, so the host
// never reads them back (gpu/ops/prefill_moe.py "device dispatch"; NumPy twin prefill_moe.device_plan).
// The plan is prefill_moe.dispatch_plan's with its padding rows removed: the active experts ranked by
// pick count (descending, ties by ascending id), expert r's picks on rows [row0_r, row0_r + c_r) in
// pick order (ascending f = t * k + j), row0_r = the exclusive scan of the counts in rank order; so
// the n = T * k rows are exactly the non-padding rows of dispatch_plan, in the same order.
//   moe_plan_count   hist[s][e] = picks of expert e in segment s (PLAN_SEG picks per warp).
//   moe_plan_scan    ONE CTA of 1024 threads (one per expert, E <= 1024): hist[s][e] -> its exclusive
//                    prefix over s; counts, the rank order (eids), row0 of each expert (ebase), the work
//                    items {e, row0 + sz i, min(sz, c - sz i), 0}, i < m, in rank order: wg = 0 the fp4mma
//                    items (sz = PLAN_BN = experts.cu MMA_BN, m = ceil(c / 64)), wg = 1 the wgmma items
//                    (prefill_moe.wg_items' split: m = ceil(c / 128), sz = min(128, 16 ceil(c / (16 m))):
//                    all but the last a multiple of 16, the last 1..sz rows; ceil(c / sz) == m since
//                    sz (m - 1) <= 128 (m - 1) < c), items[n_items .. max_items) = 0 (an item of 0 rows:
//                    both GEMMs exit at once), meta = {n_active, n_items}.
//   moe_plan_place   row p of pick f = ebase[e] + hist[s][e] + (picks of e before f in segment s, found by
//                    __match_any_sync over 32 picks at a time): src[p] = f / k, flat[p] = f, rowof[f] = p.
//   moe_plan_combine_pos  pos[t][r] = rowof[t * k + j] for the pick j of rank r in (expert id, j) order:
//                    the combine's "ascending expert id, stable" order (oracle.ops.moe_combine).
// Invalid ids (outside [0, E)) trap: the expert weights would be read out of bounds otherwise.
constexpr int PLAN_SEG = 1024;    // picks per warp segment (count / place)
constexpr int PLAN_WARPS = 8;     // segments per CTA of count / place (8 * E ints of shared memory)
constexpr int PLAN_MAX_E = 1024;  // experts: one thread each in moe_plan_scan
constexpr int PLAN_BN = 64;       // rows per fp4mma work item (experts.cu MMA_BN)
constexpr int PLAN_WG_BN = 128;   // rows per wgmma work item, at most (experts.cu wg::WG_BN)

// idx [n] int64 expert ids (n = T * k); hist [nseg, E] int32; grid ceil(nseg / WARPS), block 32 * WARPS,
// dynamic shared memory WARPS * E * 4 bytes.
extern "C" __global__ void __launch_bounds__(32 * PLAN_WARPS)
moe_plan_count(const long long* __restrict__ idx, int n, int E, int* __restrict__ hist) { PDL_ENTRY();
    extern __shared__ int plan_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = blockIdx.x * PLAN_WARPS + warp;
    if (seg * PLAN_SEG >= n) return;  // whole warps only; no CTA barrier below
    int* h = plan_smem + warp * E;
    for (int e = lane; e < E; e += 32) h[e] = 0;
    __syncwarp();
    const int f1 = min(n, (seg + 1) * PLAN_SEG);
    for (int f = seg * PLAN_SEG + lane; f < f1; f += 32) {
        const long long e = __ldg(idx + f);
        if ((unsigned long long)e >= (unsigned long long)E) __trap();
        atomicAdd(h + e, 1);
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) hist[(i64)seg * E + e] = h[e];
}

// hist [nseg, E] (in: counts, out: exclusive prefix over segments); ebase [E] (row0, -1 = no picks);
// eids [E] (rank order, -1 past n_active); counts [E] (rank order, 0 past n_active); items [max_items, 4];
// meta [2] = {n_active, n_items}; wg: 0 = fp4mma items, 1 = wgmma items.  grid 1, block PLAN_MAX_E.
extern "C" __global__ void __launch_bounds__(PLAN_MAX_E)
moe_plan_scan(int* __restrict__ hist, int nseg, int E, int max_items, int wg, int* __restrict__ ebase,
              int* __restrict__ eids, int* __restrict__ counts, int* __restrict__ items, int* __restrict__ meta) {
    PDL_ENTRY();
    __shared__ int cnt[PLAN_MAX_E];
    __shared__ int order[PLAN_MAX_E];
    __shared__ int srow[PLAN_MAX_E];
    __shared__ int sitem[PLAN_MAX_E];
    const int tid = threadIdx.x;
    int c = 0;
    if (tid < E) {
        for (int s = 0; s < nseg; ++s) {
            const i64 i = (i64)s * E + tid;
            const int h = hist[i];
            hist[i] = c;
            c += h;
        }
        cnt[tid] = c;
    }
    __syncthreads();
    if (c > 0) {  // rank among the active experts: count descending, id ascending
        int r = 0;
        for (int j = 0; j < E; ++j) {
            const int cj = cnt[j];
            r += (cj > c || (cj == c && j < tid)) ? 1 : 0;
        }
        order[r] = tid;
    }
    const int n_act = __syncthreads_count(c > 0);
    const int mc = tid < n_act ? cnt[order[tid]] : 0;  // count of the expert of rank tid
    const int bn = wg ? PLAN_WG_BN : PLAN_BN;
    const int mi = (mc + bn - 1) / bn;                 // its work items
    const int sz = (wg && mi > 0) ? min(bn, (mc + 16 * mi - 1) / (16 * mi) * 16) : bn;  // rows per item
    srow[tid] = mc;
    sitem[tid] = mi;
    __syncthreads();
    for (int off = 1; off < PLAN_MAX_E; off <<= 1) {  // inclusive scans (Hillis-Steele)
        const int a = tid >= off ? srow[tid - off] : 0, b = tid >= off ? sitem[tid - off] : 0;
        __syncthreads();
        srow[tid] += a;
        sitem[tid] += b;
        __syncthreads();
    }
    const int row0 = srow[tid] - mc, item0 = sitem[tid] - mi, n_items = sitem[PLAN_MAX_E - 1];
    if (tid < E) {
        eids[tid] = tid < n_act ? order[tid] : -1;
        counts[tid] = mc;
        if (c == 0) ebase[tid] = -1;
    }
    if (tid < n_act) {
        const int e = order[tid];
        ebase[e] = row0;
        for (int i = 0; i < mi && item0 + i < max_items; ++i) {
            int* it = items + 4 * (i64)(item0 + i);
            it[0] = e;
            it[1] = row0 + sz * i;
            it[2] = min(sz, mc - sz * i);
            it[3] = 0;
        }
    }
    for (int i = n_items + tid; i < max_items; i += PLAN_MAX_E) {
        int* it = items + 4 * (i64)i;
        it[0] = it[1] = it[2] = it[3] = 0;
    }
    if (tid == 0) {
        meta[0] = n_act;
        meta[1] = n_items;
    }
}

// idx [n] int64; hist [nseg, E] exclusive prefixes; ebase [E]; src / flat [n] (row -> token / pick);
// rowof [n] (pick -> row).  grid ceil(nseg / WARPS), block 32 * WARPS, dynamic smem WARPS * E * 4 bytes.
extern "C" __global__ void __launch_bounds__(32 * PLAN_WARPS)
moe_plan_place(const long long* __restrict__ idx, int n, int k, int E, const int* __restrict__ hist,
               const int* __restrict__ ebase, int* __restrict__ src, int* __restrict__ flat,
               int* __restrict__ rowof) { PDL_ENTRY();
    extern __shared__ int plan_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = blockIdx.x * PLAN_WARPS + warp;
    if (seg * PLAN_SEG >= n) return;
    int* ctr = plan_smem + warp * E;  // next row of each expert in this segment
    for (int e = lane; e < E; e += 32) ctr[e] = __ldg(ebase + e) + __ldg(hist + (i64)seg * E + e);
    __syncwarp();
    const u32 before = (1u << lane) - 1u;
    const int f1 = min(n, (seg + 1) * PLAN_SEG);
    for (int f0 = seg * PLAN_SEG; f0 < f1; f0 += 32) {  // warp-uniform trip count
        const int f = f0 + lane;
        const bool ok = f < f1;
        const int e = ok ? (int)__ldg(idx + f) : -1;
        const u32 peers = __match_any_sync(0xffffffffu, e);
        if (ok) {
            const int p = ctr[e] + __popc(peers & before);
            src[p] = f / k;
            flat[p] = f;
            rowof[f] = p;
        }
        __syncwarp();
        if (ok && __ffs(peers) - 1 == lane) ctr[e] += __popc(peers);
        __syncwarp();
    }
}

// idx [T, k] int64; rowof [T * k]; pos [T, k] int32.  grid ceil(T / 256), block 256.
extern "C" __global__ void __launch_bounds__(256)
moe_plan_combine_pos(const long long* __restrict__ idx, const int* __restrict__ rowof, int T, int k,
                     int* __restrict__ pos) { PDL_ENTRY();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const long long* id = idx + (i64)t * k;
    for (int j = 0; j < k; ++j) {
        const long long e = __ldg(id + j);
        int r = 0;
        for (int i = 0; i < k; ++i) {
            const long long ei = __ldg(id + i);
            r += (ei < e || (ei == e && i < j)) ? 1 : 0;
        }
        pos[(i64)t * k + r] = __ldg(rowof + (i64)t * k + j);
    }
}
