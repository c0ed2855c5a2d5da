// Lightning indexer: scores and a deterministic top-k (dsv4_attention.md §5, M:380-433).
//
// indexer_scores_d128: I[t, k] = bf16( sum_h bf16( relu(bf16(q[t,h] . K[k])) * w[t,h] ) ) for
//   k < n_valid[t] (columns n_valid[t] <= k < N are written as -inf), twin oracle.ops.indexer_scores.
//   q.K: f32 FMA over d = 0..127 in order (bf16 x bf16 products are exact in f32; only the sums
//   round), rounded once to bf16; relu * w is exact in f32, then bf16; the head sum is double in
//   head order, rounded f64 -> f32 -> bf16 (the twin's order). A score depends only on (t, k).
//   Layout: grid (ceil(N/64), T), block 256. A CTA stages q[t] ([H, 128] as f32) and 64 keys
//   (transposed, [128][64] bf16) in shared memory; thread (hg = tid/16, kg = tid%16) computes 4
//   heads x 4 consecutive keys (H % 4 == 0, H <= 64: the index_n_heads of every config); the 64 x H
//   products go back to shared memory (reusing the key tile) for the ordered head sums. H <= 64.
//   Dynamic smem: H*128*4 + 128*64*2 bytes (H = 64: 48 KiB).
// indexer_topk: per token, the top min(k, n) of row t over columns < n = min(n_valid[t], N), score
//   descending, ties -> lower index (host.indices.topk_desc), written as idx + offset with -1
//   padding to `width` columns. order = 0: score order (oracle.ops.indexer_topk); order = 1:
//   ascending index (the canonical compressed segment, host.indices.candidate_matrix).
//   Scores are bf16 bits mapped to order-preserving 16-bit keys (-0 == +0). Radix select on the
//   high then the low byte (shared histograms, warp-aggregated atomics: counts are exact, so the
//   threshold is deterministic), then every key above the threshold plus the lowest-index
//   `need` keys equal to it (ordered block compaction), then a bitonic sort of the <= 1024
//   (key, index) pairs in shared memory. Block 512, grid T. k <= 1024; NaN scores unsupported.
#include "common.cuh"

using namespace memra;

namespace {

constexpr int IS_KC = 64;      // keys per CTA
constexpr int IS_THREADS = 256;
constexpr int IS_D = 128;

}  // namespace

// q: [T, H, 128] bf16; w: [T, H] bf16 (weights_proj output; scaled here by w_scale and stored,
// w_scale = 1 for weights already scaled);
// keys: [N, ld_k] bf16; n_valid: [T] int32; out: [T, ld_out] bf16. H % 4 == 0, H <= 64.
// grid (ceil(N/64), T), block 256, dynamic smem H*512 + 16384 bytes.
extern "C" __global__ void __launch_bounds__(IS_THREADS)
indexer_scores_d128(const u16* __restrict__ q, const u16* __restrict__ w, const u16* __restrict__ keys,
                    int ld_k, const int* __restrict__ n_valid, u16* __restrict__ out, int ld_out, int H, int N,
                    float w_scale) { PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = reinterpret_cast<float*>(smem_raw);                      // [H][128]
    u16* kt = reinterpret_cast<u16*>(smem_raw + (size_t)H * IS_D * 4);   // [128][64]
    float* prod = reinterpret_cast<float*>(kt);                           // [64 keys][H] after the dots (H <= 64)
    const i64 t = blockIdx.y;
    const int k0 = blockIdx.x * IS_KC;
    const int nv = min(__ldg(n_valid + t), N);
    u16* orow = out + t * ld_out;
    if (k0 >= nv) {  // nothing causal here: -inf
        for (int j = threadIdx.x; j < IS_KC; j += IS_THREADS)
            if (k0 + j < N) orow[k0 + j] = 0xff80u;
        return;
    }
    // stage q[t] as f32 and the key tile transposed
    const u16* qt = q + t * H * IS_D;
    for (int c = threadIdx.x; c < H * IS_D / 8; c += IS_THREADS) {
        float f[8];
        unpack8(ldg16(qt + 8 * c), f);
        *reinterpret_cast<float4*>(qs + 8 * c) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4*>(qs + 8 * c + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
    for (int c = threadIdx.x; c < IS_KC * IS_D / 8; c += IS_THREADS) {
        const int kk = c % IS_KC, dc = c / IS_KC;  // a warp writes 32 consecutive keys of one dim row
        uint4 v = make_uint4(0, 0, 0, 0);
        if (k0 + kk < nv) v = ldg16(keys + (i64)(k0 + kk) * ld_k + 8 * dc);
        const u32 ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            kt[(8 * dc + 2 * i) * IS_KC + kk] = (u16)(ws[i] & 0xffffu);
            kt[(8 * dc + 2 * i + 1) * IS_KC + kk] = (u16)(ws[i] >> 16);
        }
    }
    __syncthreads();
    const int hg = threadIdx.x >> 4, kg = threadIdx.x & 15;
    const int h0 = hg * 4;  // this thread's 4 heads (idle when h0 >= H)
    float dot[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) dot[a][b] = 0.0f;
    if (h0 < H) {
        for (int d = 0; d < IS_D; d += 4) {
            float qv[4][4], kv[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float4 v = *reinterpret_cast<const float4*>(qs + (h0 + a) * IS_D + d);
                qv[a][0] = v.x; qv[a][1] = v.y; qv[a][2] = v.z; qv[a][3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint2 v = *reinterpret_cast<const uint2*>(kt + (d + i) * IS_KC + 4 * kg);
                kv[i][0] = bf16lo(v.x); kv[i][1] = bf16hi(v.x); kv[i][2] = bf16lo(v.y); kv[i][3] = bf16hi(v.y);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)  // d ascending for every (head, key)
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) dot[a][b] = __fmaf_rn(qv[a][i], kv[i][b], dot[a][b]);
        }
    }
    __syncthreads();  // the key tile becomes the product buffer [64 keys][64 heads]
    if (h0 < H) {
        const u16* wt = w + t * H;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            // the head weight, stored: bf16(w * w_scale) (oracle.ops.indexer_weights; exact for 1)
            const float wv = round_bf16(__fmul_rn(bf16_to_f32(__ldg(wt + h0 + a)), w_scale));
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const float s = fmaxf(round_bf16(dot[a][b]), 0.0f);
                prod[(4 * kg + b) * 64 + h0 + a] = round_bf16(__fmul_rn(s, wv));
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < IS_KC) {
        const int k = k0 + threadIdx.x;
        const float* pr = prod + threadIdx.x * 64;
        double acc = (double)pr[0];
        for (int h = 1; h < H; ++h) acc = __dadd_rn(acc, (double)pr[h]);
        if (k < N) orow[k] = k < nv ? (u16)f64_to_bf16(acc) : (u16)0xff80u;
    }
}

// ---------------------------------------------------------------------------------------------
// indexer_scores_mma_d128: the same scores with the q.K dots on tensor cores
// (mma.sync.m16n8k16 bf16 -> f32; the products are exact, the accumulation order is the
// hardware's, fixed per instruction sequence). Everything after the dot is the SIMT kernel's
// code. A score depends only on (t, k): decode (T = 1) and prefill rows agree bit for bit within
// this kernel, but NOT with indexer_scores_d128 (a different dot accumulation): use one of the
// two for every path.
// Layout: grid (ceil(N/256), T), block 128 (4 warps). The CTA stages q[t] (heads padded to 64
// rows, zeros beyond H) once; warp w keeps the A fragments of heads 16w..16w+15 for all of
// K = 128 in registers, and walks 4 sub-tiles of 64 keys (cp.async double-buffered, zero-filled
// past n_valid): 8 n-tiles x 8 k-steps = 64 MMAs per sub-tile. Shared rows are padded to 136
// bf16 (272 B) so the fragment loads (LDS.32, row = lane/4, column pair = lane%4) are
// conflict-free. Dynamic smem: 3 * 64 * 136 * 2 + 64 * 65 * 4 = 68864 bytes.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int IM_LD = 136;      // padded smem row (bf16)
constexpr int IM_SUB = 64;      // keys per sub-tile
constexpr int IM_NSUB = 4;      // sub-tiles per CTA
constexpr int IM_THREADS = 128;

DEV void mma_bf16_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEV void im_issue_keys(u16* buf, const u16* __restrict__ keys, int ld_k, int kbase, int nv) {
    for (int c = threadIdx.x; c < IM_SUB * 16; c += IM_THREADS) {  // 16 chunks of 16 B per key
        const int r = c >> 4, cc = c & 15;
        const int k = kbase + r;
        const bool ok = k < nv;
        cp_async16(buf + r * IM_LD + 8 * cc, ok ? keys + (i64)k * ld_k + 8 * cc : keys, ok);
    }
    cp_async_commit();
}

}  // namespace

// Arguments as indexer_scores_d128. grid (ceil(N/256), T), block 128, dynamic smem 68864 bytes.
extern "C" __global__ void __launch_bounds__(IM_THREADS)
indexer_scores_mma_d128(const u16* __restrict__ q, const u16* __restrict__ w, const u16* __restrict__ keys,
                        int ld_k, const int* __restrict__ n_valid, u16* __restrict__ out, int ld_out, int H,
                        int N, float w_scale) { PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* qs = reinterpret_cast<u16*>(smem_raw);                    // [64][IM_LD]
    u16* kb = qs + 64 * IM_LD;                                      // 2 x [64][IM_LD]
    float* prod = reinterpret_cast<float*>(kb + 2 * IM_SUB * IM_LD);  // [64 keys][65]
    const i64 t = blockIdx.y;
    const int k0 = blockIdx.x * (IM_SUB * IM_NSUB);
    const int nv = min(__ldg(n_valid + t), N);
    u16* orow = out + t * ld_out;
    if (k0 >= nv) {
        for (int j = threadIdx.x; j < IM_SUB * IM_NSUB; j += IM_THREADS)
            if (k0 + j < N) orow[k0 + j] = 0xff80u;
        return;
    }
    const int nsub = min(IM_NSUB, (nv - k0 + IM_SUB - 1) / IM_SUB);  // sub-tiles holding causal keys
    im_issue_keys(kb, keys, ld_k, k0, nv);
    // q[t] -> rows 0..63 (zeros past H)
    const u16* qt = q + t * H * 128;
    for (int c = threadIdx.x; c < 64 * 16; c += IM_THREADS) {
        const int r = c >> 4, cc = c & 15;
        const uint4 v = r < H ? ldg16(qt + r * 128 + 8 * cc) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(qs + r * IM_LD + 8 * cc) = v;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int g = lane >> 2, tg = lane & 3;
    u32 af[8][4];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        const u16* r0 = qs + (16 * wid + g) * IM_LD + 16 * s + 2 * tg;
        const u16* r8 = r0 + 8 * IM_LD;
        af[s][0] = *reinterpret_cast<const u32*>(r0);
        af[s][1] = *reinterpret_cast<const u32*>(r8);
        af[s][2] = *reinterpret_cast<const u32*>(r0 + 8);
        af[s][3] = *reinterpret_cast<const u32*>(r8 + 8);
    }
    const int h_lo = 16 * wid + g, h_hi = h_lo + 8;
    const float w_lo = h_lo < H ? round_bf16(__fmul_rn(bf16_to_f32(__ldg(w + t * H + h_lo)), w_scale)) : 0.0f;
    const float w_hi = h_hi < H ? round_bf16(__fmul_rn(bf16_to_f32(__ldg(w + t * H + h_hi)), w_scale)) : 0.0f;
    for (int sub = 0; sub < nsub; ++sub) {
        const u16* buf = kb + (sub & 1) * (IM_SUB * IM_LD);
        if (sub + 1 < nsub) {
            im_issue_keys(kb + ((sub + 1) & 1) * (IM_SUB * IM_LD), keys, ld_k, k0 + (sub + 1) * IM_SUB, nv);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            const u16* kr = buf + (8 * j + g) * IM_LD + 2 * tg;
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                const u32 b0 = *reinterpret_cast<const u32*>(kr + 16 * s);
                const u32 b1 = *reinterpret_cast<const u32*>(kr + 16 * s + 8);
                mma_bf16_16816(acc[j], af[s][0], af[s][1], af[s][2], af[s][3], b0, b1);
            }
        }
        // products bf16(relu(bf16(dot)) * w) -> prod[key][head]
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int kk = 8 * j + 2 * tg;
            prod[kk * 65 + h_lo] = round_bf16(__fmul_rn(fmaxf(round_bf16(acc[j][0]), 0.0f), w_lo));
            prod[(kk + 1) * 65 + h_lo] = round_bf16(__fmul_rn(fmaxf(round_bf16(acc[j][1]), 0.0f), w_lo));
            prod[kk * 65 + h_hi] = round_bf16(__fmul_rn(fmaxf(round_bf16(acc[j][2]), 0.0f), w_hi));
            prod[(kk + 1) * 65 + h_hi] = round_bf16(__fmul_rn(fmaxf(round_bf16(acc[j][3]), 0.0f), w_hi));
        }
        __syncthreads();  // prod complete; every warp is done with buf
        if (threadIdx.x < IM_SUB) {
            const int k = k0 + sub * IM_SUB + threadIdx.x;
            const float* pr = prod + threadIdx.x * 65;
            double a = (double)pr[0];
            for (int h = 1; h < H; ++h) a = __dadd_rn(a, (double)pr[h]);
            if (k < N) orow[k] = k < nv ? (u16)f64_to_bf16(a) : (u16)0xff80u;
        }
        __syncthreads();  // prod is rewritten by the next sub-tile
    }
    for (int j = k0 + nsub * IM_SUB + threadIdx.x; j < min(N, k0 + IM_SUB * IM_NSUB); j += IM_THREADS)
        orow[j] = 0xff80u;  // whole sub-tiles past n_valid
}

namespace {

constexpr int TK_THREADS = 512;
constexpr int TK_KMAX = 1024;

DEV u32 score_key(u32 b) {  // bf16 bits -> order-preserving 16-bit key; -0 == +0
    if ((b & 0x7fffu) == 0u) b = 0u;
    return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// Given hist[256] (shared) and `need` >= 1, find the bucket b with above(b) < need <= above(b) + hist[b],
// scanning from the top. Returns b; *above_out = number of keys in buckets > b. Called by warp 0.
DEV int find_bucket(const int* hist, int need, int* above_out) {
    const int lane = threadIdx.x & 31;
    // lane l owns buckets 255-8l .. 248-8l (descending)
    int c[8], sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        c[i] = hist[255 - 8 * lane - i];
        sum += c[i];
    }
    int incl = sum;  // inclusive prefix over lanes (descending buckets)
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    const int excl = incl - sum;
    const u32 hit = __ballot_sync(0xffffffffu, excl < need && need <= incl);
    const int src = __ffs(hit) - 1;
    int b = 0, above = 0;
    if (lane == src) {
        int run = excl;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (run < need && need <= run + c[i]) {
                b = 255 - 8 * lane - i;
                above = run;
                break;
            }
            run += c[i];
        }
    }
    b = __shfl_sync(0xffffffffu, b, src);
    above = __shfl_sync(0xffffffffu, above, src);
    *above_out = above;
    return b;
}

DEV void hist_add(int* hist, u32 bin, bool active) {
    const u32 peers = __match_any_sync(0xffffffffu, active ? bin : 0xffffffffu);
    const int leader = __ffs(peers) - 1;
    if (active && (int)(threadIdx.x & 31) == leader) atomicAdd(hist + bin, __popc(peers));
}

// One step of the ordered compaction (indexer_fused_d128's last CTA and indexer_select_d128's
// sel_compact): the warp's 32 keys (lane l: key of index j) against the threshold key thr; keys
// above it go to their rank among the keys above (gt_base: those of earlier steps and warps),
// shifted past the first `need` ties, ties (their first `need` only) to gt_base + their rank among
// the ties; both bases then advance by the step's counts.  lt: the lanes below this one.
DEV void sel_scatter32(int key, int thr, int j, int need, int offset, u32 lt, int& gt_base, int& eq_base,
                       int* __restrict__ sel_out) {
    const u32 bg = __ballot_sync(0xffffffffu, key > thr), be = __ballot_sync(0xffffffffu, key == thr);
    const int gb = gt_base + __popc(bg & lt), eb = eq_base + __popc(be & lt);
    if (key > thr) sel_out[gb + min(eb, need)] = j + offset;
    else if (key == thr && eb < need) sel_out[gb + eb] = j + offset;
    gt_base += __popc(bg);
    eq_base += __popc(be);
}

}  // namespace

// scores: [T, ld_s] bf16; n_valid: [T] int32; out: [T, ld_out] int32 (first `width` columns
// written); k <= 1024, width >= min(k, N). grid (T), block 512.
extern "C" __global__ void __launch_bounds__(TK_THREADS)
indexer_topk(const u16* __restrict__ scores, int ld_s, const int* __restrict__ n_valid, int N, int k,
             int* __restrict__ out, int ld_out, int width, int offset, int order) { PDL_ENTRY();
    __shared__ int hist[256];
    __shared__ u64 items[TK_KMAX];
    __shared__ int warp_cnt[TK_THREADS / 32];
    __shared__ int s_b1, s_above1, s_b2, s_above2, s_count;
    const i64 t = blockIdx.x;
    const u16* row = scores + t * ld_s;
    const int n = min(__ldg(n_valid + t), N);
    const int ksel = min(k, n);
    int thr = -1, n_gt = 0;  // keys > thr are all taken; `need` keys == thr, lowest index first
    if (ksel > 0 && ksel < n) {
        for (int i = threadIdx.x; i < 256; i += TK_THREADS) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += TK_THREADS) {
            const int j = base + threadIdx.x;
            const bool act = j < n;
            hist_add(hist, act ? score_key(row[j]) >> 8 : 0u, act);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            int above;
            const int b = find_bucket(hist, ksel, &above);
            if (threadIdx.x == 0) { s_b1 = b; s_above1 = above; }
        }
        __syncthreads();
        const int b1 = s_b1, above1 = s_above1;
        for (int i = threadIdx.x; i < 256; i += TK_THREADS) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += TK_THREADS) {
            const int j = base + threadIdx.x;
            const u32 key = j < n ? score_key(row[j]) : 0u;
            const bool act = j < n && (int)(key >> 8) == b1;
            hist_add(hist, key & 0xffu, act);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            int above;
            const int b = find_bucket(hist, ksel - above1, &above);
            if (threadIdx.x == 0) { s_b2 = b; s_above2 = above; }
        }
        __syncthreads();
        thr = (b1 << 8) | s_b2;
        n_gt = above1 + s_above2;
    }
    // collect: every key > thr (any slot order: the sort below makes it deterministic), then the
    // first `need` keys == thr in index order
    if (threadIdx.x == 0) s_count = 0;
    __syncthreads();
    const int need = ksel - n_gt;
    int eq_base = 0;
    for (int base = 0; base < n; base += TK_THREADS) {
        const int j = base + threadIdx.x;
        const u32 key = j < n ? score_key(row[j]) : 0u;
        const bool gt = j < n && (int)key > thr;
        const bool eq = j < n && thr >= 0 && (int)key == thr;
        if (gt) {
            const int slot = atomicAdd(&s_count, 1);
            items[slot] = ((u64)key << 32) | (u64)(0xffffffffu - (u32)j);
        }
        // ordered compaction of the ties
        const u32 bal = __ballot_sync(0xffffffffu, eq);
        const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
        if (lane == 0) warp_cnt[wid] = __popc(bal);
        __syncthreads();
        int before = eq_base, total = 0;
        for (int w2 = 0; w2 < TK_THREADS / 32; ++w2) {
            if (w2 < wid) before += warp_cnt[w2];
            total += warp_cnt[w2];
        }
        before += __popc(bal & ((1u << lane) - 1u));
        if (eq && before < need) items[n_gt + before] = ((u64)key << 32) | (u64)(0xffffffffu - (u32)j);
        eq_base += total;
        __syncthreads();
    }
    // sort ksel items descending by (key, -index), or by -index only for order == 1
    int P = 1;
    while (P < ksel) P <<= 1;
    for (int i = threadIdx.x; i < P; i += TK_THREADS) {
        if (i >= ksel) {
            items[i] = 0ull;
        } else if (order == 1) {
            items[i] &= 0xffffffffull;
        }
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < P; i += TK_THREADS) {
                const int pj = i ^ stride;
                if (pj > i) {
                    const u64 a = items[i], b = items[pj];
                    const bool desc = (i & size) == 0;  // final order: descending
                    if (desc ? (a < b) : (a > b)) {
                        items[i] = b;
                        items[pj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    int* orow = out + t * ld_out;
    for (int i = threadIdx.x; i < width; i += TK_THREADS)
        orow[i] = i < ksel ? (int)(0xffffffffu - (u32)(items[i] & 0xffffffffull)) + offset : -1;
}

// ---------------------------------------------------------------------------------------------
// indexer_fused_d128: the decode (T = 1) indexer in ONE launch: indexer_scores_d128's scores
// (bit for bit) and indexer_topk's order = 1 (ascending index) selection of them, by the last CTA.
// Scores: tiles of IF_KC = 16 keys (rather than 64) so that a short context still spreads over
//   many SMs (1K context: 256 keys -> 16 CTAs instead of 4); the grid is min(tiles, 2 * SMs) and a
//   CTA walks tiles blockIdx.x, + gridDim.x, ... (q staged once per CTA; tiles past n_valid only
//   write -inf). Thread (hg = tid / 4, kg = tid % 4) computes heads 2hg, 2hg + 1 x keys
//   4kg .. 4kg + 3. q is staged as f32 rows padded to IF_QLD = 132 floats (the 8 head pairs a
//   warp reads fall in distinct banks), the key tile as f32 transposed [128][16] (one LDS.128 =
//   4 keys of one dim: no unpacking in the loop). Every (head, key) dot is the same f32 FMA chain
//   over d = 0..127 in order as indexer_scores_d128, then the same bf16 roundings, relu * w and
//   ordered double head sum: the same score bits.
// Top-k: every CTA fences its score writes and takes a ticket (atomicAdd on counter[0]); the CTA
//   with the last ticket fences, then (n = min(n_valid, N), ksel = min(k, n)):
//   * n <= k: every valid key is selected, so the ascending-index answer is 0..n-1 (+ offset),
//     -1 padded: written directly, no scores read;
//   * n > k: the row's scores are read back through L2 (ld.cg, 16-byte) into shared memory as
//     16-bit order keys (when they fit, IF_KEYS_CAP; else every pass reads L2), then indexer_topk's
//     radix select (the same score_key and find_bucket over exact histograms: the high-byte pass
//     warp-aggregated by hist_add, the low-byte pass, over bucket b1's few keys only, plain shared
//     atomics; threshold key thr, n_gt keys above it, and the `need` = ksel - n_gt lowest-index
//     keys equal to it), then an ordered compaction straight into ascending index order: warp w
//     owns a contiguous quarter of the row, walked 32 consecutive keys at a time; a selected key j
//     lands at (#keys > thr before j) + min(#keys == thr before j, need) (ballot prefix counts,
//     warp bases from a count pass): no sort.
//   The selected set and its order are indexer_topk's (order = 1) for the same scores.
//   The last CTA resets counter[0] to 0 (graph replays and the next layer start from 0); counter
//   must be 0 before the first launch and not shared by concurrent launches.
// q [1, H, 128] bf16; w [1, H] bf16 (scaled here by w_scale as indexer_scores_d128); keys [N, ld_k]
// bf16; n_valid [1] int32; scores_out [N] bf16, 16-byte aligned (written like indexer_scores_d128's
// row: -inf at and past n_valid); sel_out [width] int32, width >= min(k, N); H % 4 == 0, H <= 64; k <= 1024.
// grid min(ceil(N / 16), 2 * SMs), block 128, dynamic smem IF_SMEM bytes.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int IF_THREADS = 128;
constexpr int IF_WARPS = IF_THREADS / 32;
constexpr int IF_KC = 16;                                  // keys per tile
constexpr int IF_QLD = 132;                                // padded q row (floats)
constexpr int IF_PLD = 65;                                 // padded product row (floats)
constexpr int IF_QBYTES = 64 * IF_QLD * 4;                 // 33792
constexpr int IF_SMEM = IF_QBYTES + IS_D * IF_KC * 4;      // + key tile: 41984
constexpr int IF_KC_SPLIT = 32;                            // keys per tile of indexer_scores_tiles_d128
constexpr int IF_SMEM_SPLIT = IF_QBYTES + IS_D * IF_KC_SPLIT * 4;  // 50176 (> 48 KiB: opt-in limit)
static_assert(IF_SMEM_SPLIT <= 227 * 1024, "indexer_scores_tiles_d128: q rows + key tile past an SM's shared memory");
static_assert(IF_KC_SPLIT * IF_PLD <= IS_D * IF_KC_SPLIT, "the product buffer reuses the key tile");
constexpr int IF_KEYS_CAP = IF_SMEM / 2;                   // 16-bit keys the top-k can stage

DEV u32 if_key_at(const u16* ks, const u16* __restrict__ row, bool in_smem, int j) {
    return in_smem ? (u32)ks[j] : score_key(__ldcg(row + j));
}

}  // namespace

namespace {

// The body of indexer_fused_d128 (SELECT = true: scores, ticket, the last CTA selects) and of
// indexer_scores_tiles_d128 (SELECT = false: the same scores, then return; counter is the split
// form's high-byte histogram [256], k / sel_out / width / offset unused). One body, so the split
// form's score bits are the fused form's by construction. Called right after the kernel's PDL_ENTRY().
template <bool SELECT>
DEV void if_body(const u16* __restrict__ q, const u16* __restrict__ w, const u16* __restrict__ keys, int ld_k,
                 const int* __restrict__ n_valid, u16* __restrict__ scores_out, int H, int N, float w_scale,
                 int k, int* __restrict__ sel_out, int width, int offset, int* __restrict__ counter) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = reinterpret_cast<float*>(smem_raw);                  // [64][IF_QLD]
    // KC keys per tile: IF_KC (16) in the fused kernel, IF_KC_SPLIT (32) in the scores-only kernel,
    // whose CTAs each score one tile of twice the keys at 32K context instead of two tiles in a
    // row (the per-tile chain of loads, barriers and the serial head sum is the cost there, not
    // the FMAs); thread kg takes KB = KC / 4 consecutive keys, every dot the same FMA chain over
    // d = 0..127 in order: the score bits do not depend on KC
    constexpr int KC = SELECT ? IF_KC : IF_KC_SPLIT, KB = KC / 4;
    float* kt = reinterpret_cast<float*>(smem_raw + IF_QBYTES);      // [128][KC]; then prod [KC][IF_PLD]
    float* prod = kt;
    __shared__ int hist[256];
    __shared__ int wcnt[IF_WARPS][2];
    __shared__ int s_b1, s_above1, s_b2, s_above2, is_last;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int nv = max(min(__ldg(n_valid), N), 0);
    const int ntiles = (N + KC - 1) / KC;
    const int vtiles = (nv + KC - 1) / KC;  // tiles holding causal keys
    const int hg = tid >> 2, kg = tid & 3;
    const int h0 = 2 * hg;                        // this thread's 2 heads (idle when h0 >= H)
    const bool hv = h0 < H;
    float wv[2] = {0.0f, 0.0f};
    if ((int)blockIdx.x < vtiles) {  // this CTA scores at least one tile: stage q as f32 once
        for (int c = tid; c < H * IS_D / 8; c += IF_THREADS) {
            const int h = c >> 4, dc = c & 15;
            float f[8];
            unpack8(ldg16(q + 8 * c), f);
            *reinterpret_cast<float4*>(qs + h * IF_QLD + 8 * dc) = make_float4(f[0], f[1], f[2], f[3]);
            *reinterpret_cast<float4*>(qs + h * IF_QLD + 8 * dc + 4) = make_float4(f[4], f[5], f[6], f[7]);
        }
        if (hv) {  // the stored head weights bf16(w * w_scale), as indexer_scores_d128
#pragma unroll
            for (int a = 0; a < 2; ++a) wv[a] = round_bf16(__fmul_rn(bf16_to_f32(__ldg(w + h0 + a)), w_scale));
        }
    }
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int k0 = tile * KC;
        if (tile >= vtiles) {  // nothing causal: -inf (uniform over the CTA)
            if (tid < KC && k0 + tid < N) scores_out[k0 + tid] = 0xff80u;
            continue;
        }
        for (int c = tid; c < KC * IS_D / 8; c += IF_THREADS) {  // key tile, transposed, f32
            const int kk = c % KC, dc = c / KC;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (k0 + kk < nv) v = ldg16(keys + (i64)(k0 + kk) * ld_k + 8 * dc);
            float f[8];
            unpack8(v, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) kt[(8 * dc + j) * KC + kk] = f[j];
        }
        __syncthreads();  // q (first tile) and the key tile staged
        float dot[2][KB];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < KB; ++b) dot[a][b] = 0.0f;
        if (hv) {
            const float* qa = qs + h0 * IF_QLD;
#pragma unroll 4
            for (int d = 0; d < IS_D; d += 4) {
                const float4 q0 = *reinterpret_cast<const float4*>(qa + d);
                const float4 q1 = *reinterpret_cast<const float4*>(qa + IF_QLD + d);
                const float qv[2][4] = {{q0.x, q0.y, q0.z, q0.w}, {q1.x, q1.y, q1.z, q1.w}};
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // d ascending for every (head, key)
                    float kv[KB];
#pragma unroll
                    for (int c4 = 0; c4 < KB / 4; ++c4) {
                        const float4 kv4 = *reinterpret_cast<const float4*>(kt + (d + i) * KC + KB * kg + 4 * c4);
                        kv[4 * c4] = kv4.x; kv[4 * c4 + 1] = kv4.y; kv[4 * c4 + 2] = kv4.z; kv[4 * c4 + 3] = kv4.w;
                    }
#pragma unroll
                    for (int a = 0; a < 2; ++a)
#pragma unroll
                        for (int b = 0; b < KB; ++b) dot[a][b] = __fmaf_rn(qv[a][i], kv[b], dot[a][b]);
                }
            }
        }
        __syncthreads();  // the key tile becomes the product buffer [KC keys][IF_PLD]
        if (hv) {
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int b = 0; b < KB; ++b) {
                    const float s = fmaxf(round_bf16(dot[a][b]), 0.0f);
                    prod[(KB * kg + b) * IF_PLD + h0 + a] = round_bf16(__fmul_rn(s, wv[a]));
                }
        }
        __syncthreads();
        if (tid < KC) {
            const int kk = k0 + tid;
            const float* pr = prod + tid * IF_PLD;
            double acc = (double)pr[0];
            for (int h = 1; h < H; ++h) acc = __dadd_rn(acc, (double)pr[h]);
            if constexpr (SELECT) {
                if (kk < N) scores_out[kk] = kk < nv ? (u16)f64_to_bf16(acc) : (u16)0xff80u;
            } else if (kk < N) {
                const u32 bits = kk < nv ? (u32)f64_to_bf16(acc) : 0xff80u;
                scores_out[kk] = (u16)bits;
                // split form: `counter` is the 256-bin histogram of the valid keys' high bytes
                // (score_key >> 8), indexer_select_d128's first radix pass; it zeroes it again
                if (kk < nv) atomicAdd(counter + (score_key(bits) >> 8), 1);
            }
        }
        __syncthreads();  // prod is the next tile's key tile
    }
    if constexpr (!SELECT) return;  // split form: indexer_select_d128 selects in the next launch
    // ---- the last CTA selects
    if (!last_cta_ticket(counter, (int)gridDim.x, is_last)) return;
    __threadfence();
    const int n = nv, ksel = min(k, n);
    if (ksel == n) {  // every valid key is selected: ascending index = 0 .. n-1
        for (int i = tid; i < width; i += IF_THREADS) sel_out[i] = i < n ? i + offset : -1;
        if (tid == 0) *counter = 0;
        return;
    }
    u16* ks = reinterpret_cast<u16*>(smem_raw);
    const bool in_smem = n <= IF_KEYS_CAP;
    if (in_smem) {  // 16-byte L2 loads, 8 in flight per thread (8192 keys: one round trip)
        const int nc = n >> 3;
#pragma unroll 8
        for (int c = tid; c < nc; c += IF_THREADS) {
            const uint4 v = __ldcg(reinterpret_cast<const uint4*>(scores_out) + c);
            const u32 ws[4] = {v.x, v.y, v.z, v.w};
            u32 o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) o[i] = score_key(ws[i] & 0xffffu) | (score_key(ws[i] >> 16) << 16);
            *reinterpret_cast<uint4*>(ks + 8 * c) = make_uint4(o[0], o[1], o[2], o[3]);
        }
        for (int j = 8 * nc + tid; j < n; j += IF_THREADS) ks[j] = (u16)score_key(__ldcg(scores_out + j));
    }
    for (int i = tid; i < 256; i += IF_THREADS) hist[i] = 0;
    __syncthreads();
    // warp w owns keys [sb, se), walked 32 consecutive keys per step (uniform trip count per warp)
    const int seg = ((n + IF_WARPS * 32 - 1) / (IF_WARPS * 32)) * 32;
    const int sb = wid * seg, se = min(sb + seg, n);
#pragma unroll 4
    for (int base = sb; base < sb + seg; base += 32) {  // high bytes crowd few buckets: aggregated
        const int j = base + lane;
        const bool act = j < se;
        hist_add(hist, act ? if_key_at(ks, scores_out, in_smem, j) >> 8 : 0u, act);
    }
    __syncthreads();
    if (tid < 32) {
        int above;
        const int b = find_bucket(hist, ksel, &above);
        if (tid == 0) { s_b1 = b; s_above1 = above; }
    }
    __syncthreads();
    const int b1 = s_b1, above1 = s_above1;
    for (int i = tid; i < 256; i += IF_THREADS) hist[i] = 0;
    __syncthreads();
#pragma unroll 4
    for (int base = sb; base < sb + seg; base += 32) {  // only bucket b1's keys: little contention
        const int j = base + lane;
        const u32 key = j < se ? if_key_at(ks, scores_out, in_smem, j) : 0u;
        if (j < se && (int)(key >> 8) == b1) atomicAdd(hist + (key & 0xffu), 1);
    }
    __syncthreads();
    if (tid < 32) {
        int above;
        const int b = find_bucket(hist, ksel - above1, &above);
        if (tid == 0) { s_b2 = b; s_above2 = above; }
    }
    __syncthreads();
    const int thr = (b1 << 8) | s_b2;
    const int need = ksel - (above1 + s_above2);  // keys == thr taken, lowest index first
    int cgt = 0, ceq = 0;
#pragma unroll 4
    for (int base = sb; base < sb + seg; base += 32) {
        const int j = base + lane;
        const int key = j < se ? (int)if_key_at(ks, scores_out, in_smem, j) : -1;
        cgt += __popc(__ballot_sync(0xffffffffu, key > thr));
        ceq += __popc(__ballot_sync(0xffffffffu, key == thr));
    }
    if (lane == 0) { wcnt[wid][0] = cgt; wcnt[wid][1] = ceq; }
    __syncthreads();
    int gt_base = 0, eq_base = 0;
    for (int w2 = 0; w2 < wid; ++w2) { gt_base += wcnt[w2][0]; eq_base += wcnt[w2][1]; }
    const u32 lt = (1u << lane) - 1u;
#pragma unroll 4
    for (int base = sb; base < sb + seg; base += 32) {
        const int j = base + lane;
        const int key = j < se ? (int)if_key_at(ks, scores_out, in_smem, j) : -1;
        sel_scatter32(key, thr, j, need, offset, lt, gt_base, eq_base, sel_out);
    }
    for (int i = ksel + tid; i < width; i += IF_THREADS) sel_out[i] = -1;
    if (tid == 0) *counter = 0;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(IF_THREADS)
indexer_fused_d128(const u16* __restrict__ q, const u16* __restrict__ w, const u16* __restrict__ keys, int ld_k,
                   const int* __restrict__ n_valid, u16* __restrict__ scores_out, int H, int N, float w_scale,
                   int k, int* __restrict__ sel_out, int width, int offset, int* __restrict__ counter) { PDL_ENTRY();
    if_body<true>(q, w, keys, ld_k, n_valid, scores_out, H, N, w_scale, k, sel_out, width, offset, counter);
}

// ---------------------------------------------------------------------------------------------
// The split form of indexer_fused_d128 (two launches; the decode step's default when the key row
// can hold more than k keys, ops.indexer.scores_topk form 'split' / 'auto'):
// indexer_scores_tiles_d128: indexer_fused_d128's scoring (the shared if_body<false>) on tiles of
//   IF_KC_SPLIT = 32 keys (thread kg: keys 8kg .. 8kg + 7), block 128, IF_SMEM_SPLIT dynamic smem:
//   the same score bits, -inf at and past n_valid; any grid; plus one global atomicAdd per valid key into hist_hi[score_key >> 8]:
//   the selection's first radix pass, done where the scores are made. No ticket, no selection;
//   k / sel_out / width / offset unused. hist_hi [256] int32 must be zero at launch.
// indexer_select_d128: the selection on one CTA of 1024 threads (32 warps), reading the row the
//   scoring launch wrote, after PDL_ENTRY's griddepcontrol.wait (the whole previous grid complete
//   and visible), through L2 (ld.cg), never the read-only path. It reads hist_hi into shared
//   memory and zeroes it (every path, so the next scoring launch on this device finds it zero:
//   that launch runs after this grid in stream order). n = min(n_valid, N), ksel = min(k, n):
//   * n <= k: 0..n-1 (+ offset), then -1 to width (no scores read);
//   * n > k: the high-byte bucket b1 from hist_hi (find_bucket: above1 keys in higher buckets),
//     then the low byte's histogram over bucket b1's keys (shared atomics: within one high byte
//     the low bytes spread; hist_add's match-aggregation for n > 16384), bucket b2: thr =
//     b1 << 8 | b2, need = ksel - #(keys > thr) keys == thr taken, lowest index first. The same
//     threshold and count as indexer_fused_d128's radix passes;
//   then the ordered compaction of indexer_fused_d128 over 32 warps: warp w owns the contiguous
//   keys [w * seg, (w + 1) * seg), seg = 32 * S, S = ceil(n / 1024) steps of 32 consecutive keys
//   (lane = key % 32); a count pass gives each warp its bases (# > thr and # == thr in lower
//   warps), then a selected key j lands at (#keys > thr before j) + min(#keys == thr before j,
//   need) from ballot prefix counts; -1 padding to width. Up to S = 16 (n <= 16384, a 64K
//   context) each thread holds its keys in registers (sel_regs<STEPS>; at 32 steps ptxas spills
//   under the 64-register cap of 1024 threads); past that every pass reads L2 (sel_l2). The
//   selected set and its (ascending index) order are indexer_topk's (order = 1) = the fused
//   kernel's for the same scores.
// scores [N] bf16; n_valid [1] int32; sel_out [width] int32, width >= min(k, N); k <= 1024;
// hist_hi [256] int32 as the scoring launch of this row left it. grid 1, block 1024, no dynamic
// shared memory.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int IX_SEL_THREADS = 1024;
constexpr int IX_SEL_WARPS = IX_SEL_THREADS / 32;
constexpr int IX_SEL_REG_STEPS = 16;  // keys in registers up to 16 steps of 32 per warp: n <= 16384

// The selection's shared state (one copy for every branch: static shared memory in an inlined
// function would be one allocation per template instantiation).
struct SelShared {
    int hist_hi[256];   // the scoring launch's high-byte histogram
    int hist_lo[256];   // bucket b1's low bytes
    int wcnt[IX_SEL_WARPS][2];
    int b[2], above[2];
};

// Warp 0: bucket b of `hist` for need = ksel - above_before, into sh.b[i] / sh.above[i] (caller syncs).
DEV void sel_bucket(const int* hist, int need, SelShared& sh, int i) {
    if (threadIdx.x < 32) {
        int above;
        const int b = find_bucket(hist, need, &above);
        if (threadIdx.x == 0) { sh.b[i] = b; sh.above[i] = above; }
    }
}

// The ordered compaction, shared by both branches of indexer_select_d128: key_of(s) is step s's
// key of this lane (-1 past se). Writes sel_out[0, ksel) and the -1 padding. STEPS > 0: exactly STEPS steps, fully unrolled
// (sel_regs: key_of indexes registers with s, which must be static); STEPS = 0: `steps` steps.
template <int STEPS, typename KeyOf>
DEV void sel_compact(KeyOf key_of, int steps, int thr, int need, int ksel, int sb, int* __restrict__ sel_out,
                     int width, int offset, int (*wcnt)[2]) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (STEPS > 0) steps = STEPS;
    int cgt = 0, ceq = 0;
#pragma unroll (STEPS > 0 ? STEPS : 4)
    for (int s = 0; s < steps; ++s) {  // count pass: this warp's # > thr, # == thr
        const int key = key_of(s);
        cgt += __popc(__ballot_sync(0xffffffffu, key > thr));
        ceq += __popc(__ballot_sync(0xffffffffu, key == thr));
    }
    if (lane == 0) { wcnt[wid][0] = cgt; wcnt[wid][1] = ceq; }
    __syncthreads();
    // the counts of the lower warps (lower indices): lane l contributes warp l's when l < wid
    int gt_base = __reduce_add_sync(0xffffffffu, lane < wid ? wcnt[lane][0] : 0);
    int eq_base = __reduce_add_sync(0xffffffffu, lane < wid ? wcnt[lane][1] : 0);
    const u32 lt = (1u << lane) - 1u;
#pragma unroll (STEPS > 0 ? STEPS : 4)
    for (int s = 0; s < steps; ++s) {
        const int j = sb + 32 * s + lane;
        const int key = key_of(s);
        sel_scatter32(key, thr, j, need, offset, lt, gt_base, eq_base, sel_out);
    }
    for (int i = ksel + tid; i < width; i += IX_SEL_THREADS) sel_out[i] = -1;
}

// n <= IX_SEL_THREADS * STEPS: the keys in registers (kp[s / 2], step s in the low half when s is
// even; keys past se held as 0 and masked by the step's bound).
template <int STEPS>
DEV void sel_regs(const u16* __restrict__ scores, int n, int ksel, int S, int* __restrict__ sel_out, int width,
                  int offset, SelShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int sb = wid * 32 * S, se = min(sb + 32 * S, n);
    u32 kp[STEPS / 2];
#pragma unroll
    for (int s = 0; s < STEPS; s += 2) {  // all loads in flight at once (L2: the row was just written)
        const int j0 = sb + 32 * s + lane, j1 = j0 + 32;
        const u32 k0 = j0 < se ? score_key(__ldcg(scores + j0)) : 0u;
        const u32 k1 = j1 < se ? score_key(__ldcg(scores + j1)) : 0u;
        kp[s / 2] = k0 | (k1 << 16);
    }
    if (tid < 256) sh.hist_lo[tid] = 0;
    sel_bucket(sh.hist_hi, ksel, sh, 0);
    __syncthreads();
    const int b1 = sh.b[0], above1 = sh.above[0];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {  // bucket b1's low bytes
        const u32 key = (kp[s >> 1] >> (16 * (s & 1))) & 0xffffu;
        if (sb + 32 * s + lane < se && (int)(key >> 8) == b1) atomicAdd(&sh.hist_lo[key & 0xffu], 1);
    }
    __syncthreads();
    sel_bucket(sh.hist_lo, ksel - above1, sh, 1);
    __syncthreads();
    const int thr = (b1 << 8) | sh.b[1], need = ksel - (above1 + sh.above[1]);
    auto key_of = [&](int s) -> int {
        const u32 key = (kp[s >> 1] >> (16 * (s & 1))) & 0xffffu;  // s is unrolled: static indexing
        return sb + 32 * s + lane < se ? (int)key : -1;
    };
    // STEPS, not S: the unrolled loop keeps kp in registers; steps past S are -1 in every lane
    sel_compact<STEPS>(key_of, STEPS, thr, need, ksel, sb, sel_out, width, offset, sh.wcnt);
}

// n > IX_SEL_THREADS * IX_SEL_REG_STEPS: the same passes, every key read from L2 in each; the low
// bytes' histogram match-aggregated (hist_add: at this length one bucket can hold many ties).
DEV void sel_l2(const u16* __restrict__ scores, int n, int ksel, int S, int* __restrict__ sel_out, int width,
                int offset, SelShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int seg = 32 * S, sb = wid * seg, se = min(sb + seg, n);
    if (tid < 256) sh.hist_lo[tid] = 0;
    sel_bucket(sh.hist_hi, ksel, sh, 0);
    __syncthreads();
    const int b1 = sh.b[0], above1 = sh.above[0];
#pragma unroll 4
    for (int base = sb; base < sb + seg; base += 32) {  // bucket b1's keys (aggregated: ties crowd one bin)
        const int j = base + lane;
        const u32 key = j < se ? score_key(__ldcg(scores + j)) : 0u;
        const bool act = j < se && (int)(key >> 8) == b1;
        hist_add(sh.hist_lo, key & 0xffu, act);
    }
    __syncthreads();
    sel_bucket(sh.hist_lo, ksel - above1, sh, 1);
    __syncthreads();
    const int thr = (b1 << 8) | sh.b[1], need = ksel - (above1 + sh.above[1]);
    auto key_of = [&](int s) -> int {
        const int j = sb + 32 * s + lane;
        return j < se ? (int)score_key(__ldcg(scores + j)) : -1;
    };
    sel_compact<0>(key_of, S, thr, need, ksel, sb, sel_out, width, offset, sh.wcnt);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(IF_THREADS)
indexer_scores_tiles_d128(const u16* __restrict__ q, const u16* __restrict__ w, const u16* __restrict__ keys,
                          int ld_k, const int* __restrict__ n_valid, u16* __restrict__ scores_out, int H, int N,
                          float w_scale, int k, int* __restrict__ sel_out, int width, int offset,
                          int* __restrict__ hist_hi) { PDL_ENTRY();
    if_body<false>(q, w, keys, ld_k, n_valid, scores_out, H, N, w_scale, k, sel_out, width, offset, hist_hi);
}

namespace {
DEV void select_body(const u16* __restrict__ scores, const int* __restrict__ n_valid, int N, int k,
                     int* __restrict__ sel_out, int width, int offset, int* __restrict__ hist_hi) {
    __shared__ SelShared sh;
    const int tid = threadIdx.x;
    const int n = max(min(__ldg(n_valid), N), 0), ksel = min(k, n);
    if (tid < 256) sh.hist_hi[tid] = __ldcg(hist_hi + tid);
    __syncthreads();                   // every read of hist_hi done
    if (tid < 256) hist_hi[tid] = 0;   // zero again for the next scoring launch (on every path)
    if (ksel == n) {  // every valid key is selected: ascending index = 0 .. n-1
        for (int i = tid; i < width; i += IX_SEL_THREADS) sel_out[i] = i < n ? i + offset : -1;
        return;
    }
    const int S = (n + IX_SEL_THREADS - 1) / IX_SEL_THREADS;  // steps of 32 keys per warp (block-uniform)
    if (S <= 4) sel_regs<4>(scores, n, ksel, S, sel_out, width, offset, sh);
    else if (S <= 8) sel_regs<8>(scores, n, ksel, S, sel_out, width, offset, sh);
    else if (S <= IX_SEL_REG_STEPS) sel_regs<IX_SEL_REG_STEPS>(scores, n, ksel, S, sel_out, width, offset, sh);
    else sel_l2(scores, n, ksel, S, sel_out, width, offset, sh);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(IX_SEL_THREADS)
indexer_select_d128(const u16* __restrict__ scores, const int* __restrict__ n_valid, int N, int k,
                    int* __restrict__ sel_out, int width, int offset, int* __restrict__ hist_hi) { PDL_ENTRY();
    select_body(scores, n_valid, N, k, sel_out, width, offset, hist_hi);
}

// ---------------------------------------------------------------------------------------------
// The row forms (the device verify's T rows in one launch each, grid.y = T): row y = blockIdx.y
// runs the one-row kernel's body on its own operands, q + y ld_q, w + y ld_w, n_valid + y ld_nv,
// scores_out + y ld_s, sel_out + y ld_sel, and its own workspace (fused: counter + y; split:
// hist_hi + 256 y), over the same keys.  A row's CTAs never touch another row's operands or
// workspace, and a row's arithmetic is the one-row launch's (the grid's x extent and the tile
// walk per CTA as there), so each row's scores and selection are that launch's bytes.
extern "C" __global__ void __launch_bounds__(IF_THREADS)
indexer_fused_rows_d128(const u16* __restrict__ q, int ld_q, const u16* __restrict__ w, int ld_w,
                        const u16* __restrict__ keys, int ld_k, const int* __restrict__ n_valid, int ld_nv,
                        u16* __restrict__ scores_out, int ld_s, int H, int N, float w_scale, int k,
                        int* __restrict__ sel_out, int ld_sel, int width, int offset,
                        int* __restrict__ counter) { PDL_ENTRY();
    const i64 y = blockIdx.y;
    if_body<true>(q + y * ld_q, w + y * ld_w, keys, ld_k, n_valid + y * ld_nv, scores_out + y * ld_s, H, N,
                  w_scale, k, sel_out + y * ld_sel, width, offset, counter + y);
}

extern "C" __global__ void __launch_bounds__(IF_THREADS)
indexer_scores_tiles_rows_d128(const u16* __restrict__ q, int ld_q, const u16* __restrict__ w, int ld_w,
                               const u16* __restrict__ keys, int ld_k, const int* __restrict__ n_valid,
                               int ld_nv, u16* __restrict__ scores_out, int ld_s, int H, int N,
                               float w_scale, int* __restrict__ hist_hi) { PDL_ENTRY();
    const i64 y = blockIdx.y;
    if_body<false>(q + y * ld_q, w + y * ld_w, keys, ld_k, n_valid + y * ld_nv, scores_out + y * ld_s, H, N,
                   w_scale, 0, nullptr, 0, 0, hist_hi + 256 * y);
}

extern "C" __global__ void __launch_bounds__(IX_SEL_THREADS)
indexer_select_rows_d128(const u16* __restrict__ scores, int ld_s, const int* __restrict__ n_valid, int ld_nv,
                         int N, int k, int* __restrict__ sel_out, int ld_sel, int width, int offset,
                         int* __restrict__ hist_hi) { PDL_ENTRY();
    const i64 y = blockIdx.y;
    select_body(scores + y * ld_s, n_valid + y * ld_nv, N, k, sel_out + y * ld_sel, width, offset,
                hist_hi + 256 * y);
}
