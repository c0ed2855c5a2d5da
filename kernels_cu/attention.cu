// Sparse attention with sinks over a candidate index list (dsv4_attention.md §3.4, §6; K:276-368),
// twin oracle.ops.sparse_attention_with_sinks.
//
//   o[t,h] = sum_j e^{s_j} kv_j / (sum_j e^{s_j} + e^{sink_h}),  s_j = scale * (q[t,h] . kv_{idx[t,j]})
//
// MQA: one shared K = V row per candidate, so a CTA serves a group of HG heads of one token and
// every kv row it gathers is used by all HG heads (the bandwidth-friendly layout).
//
// Numerics (fixed order, never dependent on T or on the split count):
//   * the candidate list is cut into tiles of 32 (the canonical layout puts the 128-wide window
//     first, then the compressed entries; -1 = skip; a tail beyond K is skipped);
//   * per tile and head: s_j in f32 (q.kv accumulated in f32 FMA over the lane's dims in a fixed
//     order, then a fixed 5-stage reduce-scatter across the warp), m_t = max_j s_j,
//     p_j = exp(s_j - m_t) (f32), l_t = sum_j p_j (xor tree), a_t = sum_j p'_j kv_j with p'_j = p_j
//     or bf16(p_j) (probs_bf16 = 1: the `reference` class casts P to bf16 before P.V; note the
//     cast is relative to the tile max, not the global max as in the twin);
//   * tiles are merged strictly in tile order: M' = max(M, m_t), L = L a + l_t b, A = A a + a_t b
//     with a = exp(M - M'), b = exp(m_t - M') (0 for an empty side);
//   * o = A / (L + exp(sink - M)) -> bf16; optionally the inverse RoPE of the last R dims at the
//     token's position (M:534), on the stored value, as oracle.ops.apply_rope(.., inverse=True).
// The tile partials are the atoms: the fused path (n_split = 1: one CTA walks every tile and
// merges in registers) and the split path (n_split > 1: CTAs write per-tile partials to a
// workspace, sparse_attn_combine_* merges them) execute the identical merge sequence, so decode
// (split, for parallelism) and prefill (fused) give the same bits.
//
// Layout: grid (T, H/HG, n_split), block 32*NW, HG = HPW*NW (warp w owns heads w*HPW..). Tiles of
// 32 kv rows are gathered into shared memory with cp.async (zero-filled for invalid slots) and
// double-buffered. Lane l owns the dims of 16-byte (8-dim) chunks l, l+32, ... (D = 128: 4-dim
// chunks), so a warp reading a kv row touches 512 contiguous bytes: conflict-free.
// Dynamic shared memory: 2 * 32 * D * 2 bytes (D = 512: 64 KiB; the wrapper raises the limit).
//
// The _qn kernels (sparse_attn_*_qn, sparse_attn_decode_*_qn; the device step's seam
// MEMRA_DSV4_DECODE_QNORM = attn) take q as the raw wq_b output and apply the per-head q norm +
// q RoPE at the q load: each warp runs head_rms.cuh's row functions (rmsnorm.cu head_rms_bf16's
// per-chunk code in its order, with n = D; one warp per head as there) on its HPW heads' rows and
// keeps the normed bf16 values in its q registers, so the attention sees exactly the bits
// head_rms_bf16 would have stored; q in global memory is only read.  Every CTA of a head group
// (n_split of them) recomputes its heads' norm (HG rows of D bf16, from L2).
#include "common.cuh"
#include "head_rms.cuh"

using namespace memra;

namespace {

constexpr int TJ = 32;  // candidates per tile

template <int D>
struct Lanes {
    static constexpr int U = D >= 256 ? 8 : 4;  // dims per lane chunk
    static constexpr int NCH = D / (32 * U);    // chunks per lane
    static_assert(NCH * 32 * U == D, "D must be 128, 256 or a multiple of 256");
    DEV static int dim(int lane, int ch) { return (lane + 32 * ch) * U; }
};

// load U bf16 dims at p (smem or global) as floats
template <int U>
DEV void load_dims(const u16* p, float* f) {
    if (U == 8) {
        unpack8(*reinterpret_cast<const uint4*>(p), f);
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        f[0] = bf16lo(v.x); f[1] = bf16hi(v.x); f[2] = bf16lo(v.y); f[3] = bf16hi(v.y);
    }
}

DEV float merge_scale(float m_from, float m_to) {  // exp(m_from - m_to), 0 for an empty side
    return m_from == f32_ninf() ? 0.0f : expf(__fsub_rn(m_from, m_to));
}

// Optional epilogue: the inverse RoPE of the output's last R dims at position pos[t] (M:534),
// applied to the stored (bf16) output like oracle.ops.apply_rope(out, .., inverse=True).
struct OutRope {
    const int* pos;  // null: no rotation
    const float* cos_t;
    const float* sin_t;
    int R;
};

// the inverse RoPE of N consecutive values (N / 2 pairs, pair i with cos cs(i) / sin sn(i)),
// each rounded to bf16: out_rope's rotation, and the combine's with preloaded cos / sin
template <int N, typename Cos, typename Sin>
DEV void inv_rope_pairs(float* o, const Cos& cs, const Sin& sn) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
        rope_pair(o[i], o[i + 1], cs(i >> 1), sn(i >> 1), true);
        o[i] = round_bf16(o[i]);
        o[i + 1] = round_bf16(o[i + 1]);
    }
}

// o: N consecutive bf16-valued output dims starting at d0 (N even, D - R a multiple of N)
template <int N>
DEV void out_rope(float* o, int d0, int D, i64 t, const OutRope& r) {
    if (r.pos == nullptr || d0 < D - r.R) return;
    const i64 row = (i64)__ldg(r.pos + t) * (r.R >> 1) + ((d0 - (D - r.R)) >> 1);
    inv_rope_pairs<N>(o, [&](int i) { return __ldg(r.cos_t + row + i); },
                      [&](int i) { return __ldg(r.sin_t + row + i); });
}

// The _qn kernels' q norm: eps, and the q RoPE of the last R dims (8 <= R <= D, R % 8 == 0) at
// position pos[t] (cos / sin [n_pos, R/2] f32; pos null: no rotation).
struct QNorm {
    float eps;
    const int* pos;
    const float* cos_t;
    const float* sin_t;
    int R;
};

// Candidate j of the token's list (-1 = skip; j >= K: -1).  IdxCand reads the given list;
// DecodeCand computes decode.cu build_cand's entry j from (pos, W, ratio, sel) where it is used
// (the decode kernel: no build_cand launch, no list in memory; the same ints, so the same bits).
struct IdxCand {
    const int* __restrict__ row;
    int K;
    DEV int operator()(int j) const { return j < K ? __ldg(row + j) : -1; }
};
struct DecodeCand {
    int p, W, ratio, K;
    const int* __restrict__ sel;  // CSA: ascending entry ids, -1 padded; null: HCA (all entries)
    int sel_w;
    DEV int operator()(int j) const {  // build_cand, element j
        if (j >= K) return -1;
        if (j < W) {
            const int t = max(p - W + 1, 0) + j;
            return t <= p ? t % W : -1;
        }
        if (ratio <= 0) return -1;
        const int k = j - W;
        if (sel == nullptr) return k < (p + 1) / ratio ? W + k : -1;
        if (k >= sel_w) return -1;
        const int e = __ldg(sel + k);
        return e >= 0 ? W + e : -1;
    }
};

// One tile's TJ candidate rows into shared memory rows of LDS elements (D: the SIMT kernels;
// D + 8: the tensor-core kernels' padded rows, conflict-free for ldmatrix), by NT threads.
template <int D, int NT, int LDS = D, typename Cand>
DEV void issue_tile(u16* buf, const u16* __restrict__ kv, int ld_kv, const Cand& cand, int tile) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < TJ * CPR; c += NT) {
        const int r = c / CPR, cc = c % CPR;
        const int j = tile * TJ + r;
        const int id = cand(j);
        const u16* src = id >= 0 ? kv + (i64)id * ld_kv + 8 * cc : kv;
        cp_async16(buf + r * LDS + 8 * cc, src, id >= 0);
    }
    cp_async_commit();
}

// QN: the warp's HPW q rows of token t (qw = row h0, raw), each normed (+ roped) by
// head_rms.cuh's phases (head_rms_bf16's chunks, order and arithmetic with n = D): every row's
// loads and the token's RoPE rows, then every row's lane sums, then each row's warp sum and
// values, into the lane's q registers qf[hh][ch][u] = dim L::dim(lane, ch) + u of head h0 + hh.
// U = 8 (D >= 256): head_rms's chunk c = lane + 32 ch is exactly the lane's chunk ch, so each chunk lands in the registers of the lane that computed it.
// U = 4 (D = 128): lanes 0..15 compute chunks c = lane (8 dims); lane l takes the half (l & 1) of
// chunk l >> 1 by shuffles.
template <int D, int HPW>
DEV void q_norm_rows(const u16* __restrict__ qw, i64 t, const QNorm& qn,
                     float (&qf)[HPW][Lanes<D>::NCH][Lanes<D>::U]) {
    using L = Lanes<D>;
    constexpr int U = L::U, NCH = L::NCH;
    const int lane = threadIdx.x & 31;
    const auto tok = [&] { return t; };
    HeadRmsRow<D> rows[HPW];
    HeadRmsRope<D> rope;  // one token: the same position and RoPE rows for every head
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh)  // every row's loads in flight before any sum
        head_rms_row_load(rows[hh], qw + hh * D);
    if (qn.pos != nullptr)  // uniform
        head_rms_rope_load(rope, qn.pos, tok, qn.cos_t, qn.sin_t, qn.R);
    else
        head_rms_rope_none(rope);
    double ss[HPW];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) ss[hh] = head_rms_row_sumsq(rows[hh]);
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        if constexpr (U == 8) {
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                for (int u = 0; u < U; ++u) qf[hh][ch][u] = 0.0f;
            head_rms_row_finish(rows[hh], rope, ss[hh], qn.eps, [&](int c, const uint4& v) {  // c: lane + 32 ch
#pragma unroll
                for (int ch = 0; ch < NCH; ++ch)
                    if (c - lane == 32 * ch) unpack8(v, qf[hh][ch]);
            });
        } else {
            static_assert(D == 128, "q_norm_rows: U = 4 is D = 128 (16 chunks of 8 dims)");
            uint4 held = make_uint4(0u, 0u, 0u, 0u);
            head_rms_row_finish(rows[hh], rope, ss[hh], qn.eps,
                                [&](int c, const uint4& v) { held = v; });  // c = lane < 16
            const int src = lane >> 1;
            const u32 x = __shfl_sync(0xffffffffu, held.x, src), y = __shfl_sync(0xffffffffu, held.y, src);
            const u32 z = __shfl_sync(0xffffffffu, held.z, src), w = __shfl_sync(0xffffffffu, held.w, src);
            const u32 lo = (lane & 1) ? z : x, hi = (lane & 1) ? w : y;
            qf[hh][0][0] = bf16lo(lo);
            qf[hh][0][1] = bf16hi(lo);
            qf[hh][0][2] = bf16lo(hi);
            qf[hh][0][3] = bf16hi(hi);
        }
    }
}

// Whether any candidate of tiles [tile0, tile1) exists (cand(j) >= 0): one vote per warp, the
// same answer in every warp of the CTA.
template <typename Cand>
DEV bool tiles_have_candidates(const Cand& cand, int tile0, int tile1) {
    const int lane = threadIdx.x & 31;
    bool any = false;
    for (int tile = tile0; tile < tile1; ++tile) any |= cand(tile * TJ + lane) >= 0;
    return __any_sync(0xffffffffu, any);
}

// The split path's tile partial of the warp's HPW heads (slot0: head h0's slot of this tile;
// head h0 + hh is slot0 + hh * n_tiles): (m_t, l_t) by lane 0, the lane's dims of a_t.
template <int D, int HPW>
DEV void store_tile_partial(float* __restrict__ ws_ml, float* __restrict__ ws_acc, i64 slot0, int n_tiles,
                            const float (&mt)[HPW], const float (&lt)[HPW],
                            const float (&at)[HPW][Lanes<D>::NCH][Lanes<D>::U]) {
    using L = Lanes<D>;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const i64 slot = slot0 + (i64)hh * n_tiles;
        if (lane == 0) {
            ws_ml[2 * slot] = mt[hh];
            ws_ml[2 * slot + 1] = lt[hh];
        }
#pragma unroll
        for (int ch = 0; ch < L::NCH; ++ch) {
            float* dst = ws_acc + slot * D + L::dim(lane, ch);
#pragma unroll
            for (int u = 0; u < L::U; u += 4)
                *reinterpret_cast<float4*>(dst + u) =
                    make_float4(at[hh][ch][u], at[hh][ch][u + 1], at[hh][ch][u + 2], at[hh][ch][u + 3]);
        }
    }
}

// QN: q is the raw q (the _qn kernels): normed + roped by q_norm_rows at the load.
template <int D, int HPW, int NW, bool QN = false, typename Cand>
DEV void sparse_attn_body(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv,
                          const Cand& cand, int K, const float* __restrict__ sink,
                          float scale, u16* __restrict__ out, int H, int probs_bf16, float* __restrict__ ws_ml,
                          float* __restrict__ ws_acc, OutRope orope, const QNorm& qn = QNorm{}) {
    using L = Lanes<D>;
    constexpr int U = L::U, NCH = L::NCH, NT = 32 * NW, HG = HPW * NW;
    constexpr bool SKIP_EMPTY = !QN && HG < 16;   // the empty-tile exit below
    extern __shared__ __align__(16) u16 smem[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const i64 t = blockIdx.x;
    const int h0 = blockIdx.y * HG + wid * HPW;
    const int n_tiles = (K + TJ - 1) / TJ;
    const int n_split = gridDim.z;
    const int tps = (n_tiles + n_split - 1) / n_split;
    const int tile0 = blockIdx.z * tps;
    const int tile1 = min(n_tiles, tile0 + tps);

    // A split CTA whose tiles hold no candidate (the -1 tail of a decode list sized for
    // max_seq_len: a CSA list past the entries selected so far, an HCA list past the compressed
    // rows so far; and a window not yet filled) writes what the full path
    // computes for such a tile and leaves: zero-filled rows, s_j = -inf, so m_t = -inf, l_t = +0,
    // every a_t dim +0 (fma(0, 0, +0)).  The same partial bytes; no gather, no q load, no FMAs,
    // so a small head group's empty CTAs do not take issue slots from the full ones on their SM.
    // Uniform over the CTA (every warp votes on the same candidates), so no barrier is skipped.
    // Only in the 8- and 4-head kernels (HG < 16): in the 16-head ones, the default of Flash's
    // decode, it measured no faster (+0.3 %, twenty-sixth session: the vote puts the candidate
    // load's round trip before the q loads), so their code is the previous one.  Not in the _qn
    // forms (opt-in; with it ptxas spills 4 B in sparse_attn_decode_d512_hg4_qn).
    if (SKIP_EMPTY && n_split > 1 && tile0 < tile1 && !tiles_have_candidates(cand, tile0, tile1)) {
        float mt[HPW], lt[HPW], at[HPW][NCH][U];
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            mt[hh] = f32_ninf();
            lt[hh] = 0.0f;
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                for (int u = 0; u < U; ++u) at[hh][ch][u] = 0.0f;
        }
        for (int tile = tile0; tile < tile1; ++tile)
            store_tile_partial<D, HPW>(ws_ml, ws_acc, (t * H + h0) * (i64)n_tiles + tile, n_tiles, mt, lt, at);
        return;
    }

    float qf[HPW][NCH][U];
    if constexpr (!QN) {
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh)
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
                load_dims<U>(q + ((t * H + h0 + hh) * (i64)D) + L::dim(lane, ch), qf[hh][ch]);
    }

    float M[HPW], Ls[HPW], A[HPW][NCH][U];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        M[hh] = f32_ninf();
        Ls[hh] = 0.0f;
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
            for (int u = 0; u < U; ++u) A[hh][ch][u] = 0.0f;
    }

    if (tile0 < tile1) issue_tile<D, NT>(smem, kv, ld_kv, cand, tile0);
    if constexpr (QN) q_norm_rows<D, HPW>(q + (t * H + h0) * (i64)D, t, qn, qf);  // beside the first gather
    for (int tile = tile0; tile < tile1; ++tile) {
        u16* buf = smem + ((tile - tile0) & 1) * (TJ * D);
        if (tile + 1 < tile1) {
            issue_tile<D, NT>(smem + ((tile + 1 - tile0) & 1) * (TJ * D), kv, ld_kv, cand, tile + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // ---- logits: per-lane partial dots for all 32 rows, then reduce-scatter (lane j <- row j)
        float s[HPW];
        {
            float p[HPW][TJ];
#pragma unroll
            for (int j = 0; j < TJ; ++j) {
#pragma unroll
                for (int hh = 0; hh < HPW; ++hh) p[hh][j] = 0.0f;
#pragma unroll
                for (int ch = 0; ch < NCH; ++ch) {
                    float kf[U];
                    load_dims<U>(buf + j * D + L::dim(lane, ch), kf);
#pragma unroll
                    for (int hh = 0; hh < HPW; ++hh)
#pragma unroll
                        for (int u = 0; u < U; ++u) p[hh][j] = __fmaf_rn(qf[hh][ch][u], kf[u], p[hh][j]);
                }
            }
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                reduce_scatter32(p[hh], lane);
                s[hh] = p[hh][0];  // the full dot of candidate row `lane`
            }
        }
        const int j_me = tile * TJ + lane;
        const bool valid = cand(j_me) >= 0;

        // ---- per-tile softmax statistics and P.V
        float pv[HPW], mt[HPW], lt[HPW];
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            const float sj = valid ? __fmul_rn(s[hh], scale) : f32_ninf();
            mt[hh] = warp_max(sj);
            const float pj = valid ? expf(__fsub_rn(sj, mt[hh])) : 0.0f;
            lt[hh] = warp_sum(pj);
            pv[hh] = probs_bf16 ? round_bf16(pj) : pj;
        }
        float at[HPW][NCH][U];
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh)
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                for (int u = 0; u < U; ++u) at[hh][ch][u] = 0.0f;
#pragma unroll 4
        for (int j = 0; j < TJ; ++j) {
            float pj[HPW];
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) pj[hh] = __shfl_sync(0xffffffffu, pv[hh], j);
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                float kf[U];
                load_dims<U>(buf + j * D + L::dim(lane, ch), kf);
#pragma unroll
                for (int hh = 0; hh < HPW; ++hh)
#pragma unroll
                    for (int u = 0; u < U; ++u) at[hh][ch][u] = __fmaf_rn(pj[hh], kf[u], at[hh][ch][u]);
            }
        }
        __syncthreads();  // every warp is done with buf before it is refilled

        if (n_split == 1) {  // merge into the running state (same sequence as the combine kernel)
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                const float Mn = fmaxf(M[hh], mt[hh]);
                const float a = merge_scale(M[hh], Mn), b = merge_scale(mt[hh], Mn);
                Ls[hh] = __fadd_rn(__fmul_rn(Ls[hh], a), __fmul_rn(lt[hh], b));
#pragma unroll
                for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        A[hh][ch][u] = __fadd_rn(__fmul_rn(A[hh][ch][u], a), __fmul_rn(at[hh][ch][u], b));
                M[hh] = Mn;
            }
        } else {  // write the tile partial
            store_tile_partial<D, HPW>(ws_ml, ws_acc, (t * H + h0) * (i64)n_tiles + tile, n_tiles, mt, lt, at);
        }
    }

    if (n_split == 1) {
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            const float den = __fadd_rn(Ls[hh], expf(__fsub_rn(__ldg(sink + h0 + hh), M[hh])));
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                float o[U];
#pragma unroll
                for (int u = 0; u < U; ++u) o[u] = round_bf16(__fdiv_rn(A[hh][ch][u], den));
                out_rope<U>(o, L::dim(lane, ch), D, t, orope);
                u16* dst = out + (t * H + h0 + hh) * (i64)D + L::dim(lane, ch);
                if (U == 8) {
                    stg16(dst, pack8(o));
                } else {
                    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
                }
            }
        }
    }
}

}  // namespace

// q: [T, H, D] bf16; kv: [N, ld_kv] bf16; idx: [T, K] int32 (-1 = skip); sink: [H] f32;
// out: [T, H, D] bf16 (n_split = 1); ws_ml: [T, H, n_tiles, 2] f32, ws_acc: [T, H, n_tiles, D] f32
// (n_split > 1, n_tiles = ceil(K/32)); rope_pos [T] int32 + cos/sin [n_pos, R/2] f32: inverse RoPE
// of the output's last R dims (rope_pos null: none). grid (T, H/HG, n_split), block 32*NW,
// dynamic smem 2*32*D*2 bytes.
#define SPARSE_ATTN(NAME, D, HPW, NW)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                          \
    NAME(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv, const int* __restrict__ idx, \
         int K, const float* __restrict__ sink, float scale, u16* __restrict__ out, int H,         \
         int probs_bf16, float* __restrict__ ws_ml, float* __restrict__ ws_acc,                    \
         const int* __restrict__ rope_pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t, \
         int rope_R) { PDL_ENTRY();                                                                             \
        sparse_attn_body<D, HPW, NW>(q, kv, ld_kv, IdxCand{idx + (i64)blockIdx.x * K, K}, K, sink, scale, out, \
                                     H, probs_bf16, ws_ml, ws_acc,                                 \
                                     OutRope{rope_pos, cos_t, sin_t, rope_R});                     \
    }

SPARSE_ATTN(sparse_attn_d512_hg16, 512, 2, 8)
SPARSE_ATTN(sparse_attn_d512_hg8, 512, 1, 8)
SPARSE_ATTN(sparse_attn_d512_hg4, 512, 1, 4)
SPARSE_ATTN(sparse_attn_d128_hg16, 128, 2, 8)
SPARSE_ATTN(sparse_attn_d128_hg8, 128, 1, 8)
SPARSE_ATTN(sparse_attn_d128_hg4, 128, 1, 4)

// The _qn forms: SPARSE_ATTN's arguments with q the RAW q (rows of D bf16, 16-byte aligned), then
// the q norm: eps (f32, as head_rms_bf16's), qn_pos [T] int32 + qn_cos / qn_sin [n_pos, R/2] f32:
// the q RoPE of the last qn_R dims (8 <= qn_R <= D; qn_pos null: none).  = head_rms_bf16(q, rope) into a copy of
// q, then SPARSE_ATTN on it, bit for bit.  q is not written.  Launch bounds (32*NW, 1): with
// (32*NW) alone ptxas (CUDA 13) spills 12 bytes in sparse_attn_d512_hg4_qn (t*H, live from the q
// norm to the n_split = 1 epilogue's division calls); with min 1 CTA it spills nothing.
#define SPARSE_ATTN_QN(NAME, D, HPW, NW)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1)                                        \
    NAME(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv, const int* __restrict__ idx, \
         int K, const float* __restrict__ sink, float scale, u16* __restrict__ out, int H,         \
         int probs_bf16, float* __restrict__ ws_ml, float* __restrict__ ws_acc,                    \
         const int* __restrict__ rope_pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t, \
         int rope_R, float qn_eps, const int* __restrict__ qn_pos, const float* __restrict__ qn_cos, \
         const float* __restrict__ qn_sin, int qn_R) { PDL_ENTRY();                                \
        sparse_attn_body<D, HPW, NW, true>(q, kv, ld_kv, IdxCand{idx + (i64)blockIdx.x * K, K}, K, sink, scale, \
                                           out, H, probs_bf16, ws_ml, ws_acc,                      \
                                           OutRope{rope_pos, cos_t, sin_t, rope_R},                \
                                           QNorm{qn_eps, qn_pos, qn_cos, qn_sin, qn_R});           \
    }

SPARSE_ATTN_QN(sparse_attn_d512_hg16_qn, 512, 2, 8)
SPARSE_ATTN_QN(sparse_attn_d512_hg8_qn, 512, 1, 8)
SPARSE_ATTN_QN(sparse_attn_d512_hg4_qn, 512, 1, 4)
SPARSE_ATTN_QN(sparse_attn_d128_hg16_qn, 128, 2, 8)
SPARSE_ATTN_QN(sparse_attn_d128_hg8_qn, 128, 1, 8)
SPARSE_ATTN_QN(sparse_attn_d128_hg4_qn, 128, 1, 4)

// Merge per-tile partials in tile order (the fused path's exact sequence) and write o: the 4
// consecutive dims d0.. of head h of token t.  CG: read the partials through L2 (ld.cg; the decode
// kernel reads partials other CTAs of the same launch wrote), else the read-only path.
template <bool CG>
DEV float ld_part(const float* p) { return CG ? __ldcg(p) : __ldg(p); }
template <bool CG>
DEV float4 ld_part4(const float* p) {
    return CG ? __ldcg(reinterpret_cast<const float4*>(p)) : __ldg(reinterpret_cast<const float4*>(p));
}

// One tile's partial (mt, lt, at) merged into the running (M, Ls, A) of 4 dims, and the final
// o = bf16(A / (Ls + exp(sink - M))): the merge sequence of merge_partials4 and its staged form
// (the fused path's, so every form gives the same bits).
DEV void merge_tile4(float& M, float& Ls, float* A, float mt, float lt, const float4& at) {
    const float a4[4] = {at.x, at.y, at.z, at.w};
    const float Mn = fmaxf(M, mt);
    const float a = merge_scale(M, Mn), b = merge_scale(mt, Mn);
    Ls = __fadd_rn(__fmul_rn(Ls, a), __fmul_rn(lt, b));
#pragma unroll
    for (int u = 0; u < 4; ++u) A[u] = __fadd_rn(__fmul_rn(A[u], a), __fmul_rn(a4[u], b));
    M = Mn;
}
DEV void merge_finish4(const float* A, float Ls, float M, float sink, float* o) {
    const float den = __fadd_rn(Ls, expf(__fsub_rn(sink, M)));
#pragma unroll
    for (int u = 0; u < 4; ++u) o[u] = round_bf16(__fdiv_rn(A[u], den));
}

template <int D, bool CG>
DEV void merge_partials4(const float* ws_ml, const float* ws_acc, const float* __restrict__ sink,
                         u16* __restrict__ out, i64 t, int h, int H, int n_tiles, int d0, const OutRope& orope) {
    const i64 th = t * H + h;
    float M = f32_ninf(), Ls = 0.0f, A[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int tile = 0; tile < n_tiles; ++tile) {
        const i64 slot = th * n_tiles + tile;
        merge_tile4(M, Ls, A, ld_part<CG>(ws_ml + 2 * slot), ld_part<CG>(ws_ml + 2 * slot + 1),
                    ld_part4<CG>(ws_acc + slot * D + d0));
    }
    float o[4];
    merge_finish4(A, Ls, M, __ldg(sink + h), o);
    out_rope<4>(o, d0, D, t, orope);
    *reinterpret_cast<uint2*>(out + th * D + d0) = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
}

// The combine kernels' static inputs, loaded BEFORE the PDL wait (PDL_ENTRY_PRELOAD): the head's
// sink, and for the threads whose 4 dims fall in the inverse RoPE's last R dims, the token's
// position and the cos / sin of their two dim pairs.  sink, cos and sin are static; the position
// is written before the step's graph starts (the host's copy into the arena's pos, or a kernel
// many launches back: common.cuh's "complete before this grid can launch"), read through L2.
// merge_partials4's epilogue then uses these values: the same floats as out_rope's own loads.
struct CombPre {
    float sink;
    float c[2], s[2];  // cos / sin of dim pairs (d0, d0+1) and (d0+2, d0+3); rope = false: unused
    bool rope;
};
template <int D>
DEV CombPre comb_preload(const float* __restrict__ sink, int h, i64 t, int d0, const OutRope& r) {
    CombPre p;
    p.sink = __ldg(sink + h);
    p.c[0] = p.c[1] = p.s[0] = p.s[1] = 0.0f;
    p.rope = r.pos != nullptr && d0 >= D - r.R;
    if (p.rope) {
        const i64 row = (i64)__ldcg(r.pos + t) * (r.R >> 1) + ((d0 - (D - r.R)) >> 1);
        rope_pairs_ldg(r.cos_t, r.sin_t, row, p.c, p.s);
    }
    return p;
}

// The combine's partials staged in shared memory when they fit (COMB_STAGE_BYTES; the wrapper
// gives n_tiles * (D + 2) floats of dynamic shared memory exactly when comb_staged): every
// float4 the thread merges is issued at once as a cp.async (its own dims of every tile), the
// tiles' (m, l) pairs by the first 2 n_tiles threads, one wait and one barrier, then
// merge_partials4's loop over shared memory: the partials take one L2 round trip instead of
// one per few tiles, and the merge sequence (and so every bit) is merge_partials4's.
constexpr int COMB_STAGE_BYTES = 48 * 1024;
template <int D>
DEV bool comb_staged(int n_tiles) { return (i64)n_tiles * (D + 2) * 4 <= COMB_STAGE_BYTES; }

template <int D>
DEV void merge_partials4_staged(const float* ws_ml, const float* ws_acc, const CombPre& pre,
                                u16* __restrict__ out, i64 t, int h, int H, int n_tiles, int d0) {
    extern __shared__ __align__(16) float comb_smem[];
    float* sacc = comb_smem;                   // [n_tiles][D]
    float* sml = comb_smem + (i64)n_tiles * D;  // [n_tiles][2]
    const i64 th = t * H + h;
    for (int tile = 0; tile < n_tiles; ++tile)
        cp_async16(sacc + tile * D + d0, ws_acc + (th * n_tiles + tile) * D + d0, true);
    cp_async_commit();
    for (int i = threadIdx.x; i < 2 * n_tiles; i += blockDim.x) sml[i] = __ldcg(ws_ml + 2 * th * n_tiles + i);
    cp_async_wait<0>();
    __syncthreads();
    float M = f32_ninf(), Ls = 0.0f, A[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int tile = 0; tile < n_tiles; ++tile) {
        merge_tile4(M, Ls, A, sml[2 * tile], sml[2 * tile + 1],
                    *reinterpret_cast<const float4*>(sacc + tile * D + d0));
    }
    float o[4];
    merge_finish4(A, Ls, M, pre.sink, o);
    if (pre.rope)  // out_rope<4>'s rotation with the preloaded cos / sin
        inv_rope_pairs<4>(o, [&](int i) { return pre.c[i]; }, [&](int i) { return pre.s[i]; });
    *reinterpret_cast<uint2*>(out + th * D + d0) = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
}

// grid (T, H), block D/4: thread owns 4 consecutive dims.  Dynamic shared memory n_tiles * (D + 2)
// floats when comb_staged<D>(n_tiles), else none (merge_partials4 straight from L2).
template <int D>
DEV void sparse_attn_combine_body(const float* __restrict__ ws_ml, const float* __restrict__ ws_acc,
                                  const float* __restrict__ sink, u16* __restrict__ out, int H, int n_tiles,
                                  OutRope orope, const CombPre& pre) {
    if (comb_staged<D>(n_tiles))
        merge_partials4_staged<D>(ws_ml, ws_acc, pre, out, blockIdx.x, blockIdx.y, H, n_tiles, threadIdx.x * 4);
    else
        merge_partials4<D, false>(ws_ml, ws_acc, sink, out, blockIdx.x, blockIdx.y, H, n_tiles, threadIdx.x * 4, orope);
}

extern "C" __global__ void __launch_bounds__(128)
sparse_attn_combine_d512(const float* __restrict__ ws_ml, const float* __restrict__ ws_acc,
                         const float* __restrict__ sink, u16* __restrict__ out, int H, int n_tiles,
                         const int* __restrict__ rope_pos, const float* __restrict__ cos_t,
                         const float* __restrict__ sin_t, int rope_R) {
    PDL_ENTRY_PRELOAD(const CombPre pre = comb_preload<512>(sink, blockIdx.y, blockIdx.x, threadIdx.x * 4,
                                                            OutRope{rope_pos, cos_t, sin_t, rope_R}));
    sparse_attn_combine_body<512>(ws_ml, ws_acc, sink, out, H, n_tiles, OutRope{rope_pos, cos_t, sin_t, rope_R}, pre);
}
extern "C" __global__ void __launch_bounds__(32)
sparse_attn_combine_d128(const float* __restrict__ ws_ml, const float* __restrict__ ws_acc,
                         const float* __restrict__ sink, u16* __restrict__ out, int H, int n_tiles,
                         const int* __restrict__ rope_pos, const float* __restrict__ cos_t,
                         const float* __restrict__ sin_t, int rope_R) {
    PDL_ENTRY_PRELOAD(const CombPre pre = comb_preload<128>(sink, blockIdx.y, blockIdx.x, threadIdx.x * 4,
                                                            OutRope{rope_pos, cos_t, sin_t, rope_R}));
    sparse_attn_combine_body<128>(ws_ml, ws_acc, sink, out, H, n_tiles, OutRope{rope_pos, cos_t, sin_t, rope_R}, pre);
}

// ---------------------------------------------------------------------------------------------
// sparse_attn_decode_d{D}_hg{HG}: the device step's sparse attention of ONE token in one launch,
// byte-for-byte build_cand (decode.cu) + sparse_attn_d{D}_hg{HG} (split) + sparse_attn_combine_d{D}.
//   * candidates: DecodeCand computes build_cand's entry j where the tile gather and the valid
//     mask use it (pos from the device, W, ratio, the indexer's selection for CSA);
//   * grid (1, H/HG, n_split): the split CTAs run sparse_attn_body exactly as the split kernel
//     (same tiles, same per-tile partials in the same workspace layout).  n_split = 1: the fused
//     path, out written by the body, nothing else happens;
//   * merge: each CTA fences its partial writes and draws a ticket on its head group's counter
//     (atomicAdd).  The CTAs that draw the last n_merge tickets are the mergers: merger m waits
//     (thread 0 spins on an ld.acquire.gpu of the counter, with nanosleep) until all n_split
//     tickets are drawn, fences, and merges slice m of the group's HG * D/4 four-dim slots (slot
//     s -> head s / (D/4), dims 4 (s % (D/4)) ..; slots m*NT + tid, step n_merge*NT) with
//     merge_partials4: the combine kernel's code, reading the partials through L2.  The last
//     merger's tile-0.. merge order is the combine's, so the bits are the combine's.
//     n_merge > 1 spreads the merge over several SMs (one CTA merging HG = 16 heads x 512 dims x
//     20 tiles would read 640 KiB through one SM: slower than the separate combine launch).
//   * forward progress of the wait: a merger waits only for CTAs of its own group that have not
//     drawn a ticket yet; at most (H/HG) * (n_merge - 1) CTAs ever wait at once and the wrapper
//     keeps that below the SM count, so a CTA still to be scheduled always finds a slot freed by a
//     CTA that does not wait (and under PDL no dependent grid starts before every CTA of this one
//     is resident).
//   * counters: int32 [H/HG] per device (ops.attention.workspace(), made before any capture),
//     zero before the launch and left zero: every merger adds 1 again after its wait, and the one
//     that brings the count to n_split + n_merge resets it (all waits are over by then).  Graph
//     replays and the next layer's launch start from 0.  Not for concurrent launches.
template <int D, int HPW, int NW, bool QN = false>
DEV void sparse_attn_decode_body(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv,
                                 const int* __restrict__ pos, int W, int ratio, const int* __restrict__ sel,
                                 int sel_w, int K, const float* __restrict__ sink, float scale,
                                 u16* __restrict__ out, int H, int probs_bf16, float* ws_ml, float* ws_acc,
                                 int* counters, int n_merge, OutRope orope, const QNorm& qn = QNorm{}) {
    constexpr int NT = 32 * NW, HG = HPW * NW, SLOTS = HG * (D / 4);
    const DecodeCand cand{__ldg(pos), W, ratio, K, sel, sel_w};
    sparse_attn_body<D, HPW, NW, QN>(q, kv, ld_kv, cand, K, sink, scale, out, H, probs_bf16, ws_ml, ws_acc, orope,
                                     qn);
    const int n_split = gridDim.z;
    if (n_split == 1) return;
    __shared__ int s_ticket;
    int* cnt = counters + blockIdx.y;
    __threadfence();  // this CTA's partials are visible device-wide before its ticket
    __syncthreads();
    if (threadIdx.x == 0) s_ticket = atomicAdd(cnt, 1);
    __syncthreads();
    const int m = s_ticket - (n_split - n_merge);
    if (m < 0) return;
    if (threadIdx.x == 0) {
        for (;;) {
            int c;
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(c) : "l"(cnt) : "memory");
            if (c >= n_split) break;
            asm volatile("nanosleep.u32 64;" ::: "memory");
        }
    }
    __syncthreads();
    __threadfence();  // every other CTA's partials, read below through L2
    const int n_tiles = (K + TJ - 1) / TJ;
    for (int s = m * NT + threadIdx.x; s < SLOTS; s += n_merge * NT)
        merge_partials4<D, true>(ws_ml, ws_acc, sink, out, 0, blockIdx.y * HG + s / (D / 4), H, n_tiles,
                                 (s % (D / 4)) * 4, orope);
    if (threadIdx.x == 0 && atomicAdd(cnt, 1) == n_split + n_merge - 1) atomicExch(cnt, 0);
}

// q: [1, H, D] bf16; kv: [N, ld_kv] bf16; pos: [1] int32; W, ratio, sel [sel_w] int32 (CSA; null:
// HCA), K: build_cand's arguments (K = the candidate list length); sink [H] f32; out [1, H, D] bf16;
// ws_ml [H, n_tiles, 2], ws_acc [H, n_tiles, D] f32 (n_split > 1); counters int32 [H/HG] (zero);
// 1 <= n_merge <= n_split; rope_* as SPARSE_ATTN.  grid (1, H/HG, n_split), block 32*NW, dynamic
// smem 2*32*D*2 bytes.
#define SPARSE_ATTN_DECODE(NAME, D, HPW, NW)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                          \
    NAME(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv, const int* __restrict__ pos, \
         int W, int ratio, const int* __restrict__ sel, int sel_w, int K, const float* __restrict__ sink, \
         float scale, u16* __restrict__ out, int H, int probs_bf16, float* ws_ml, float* ws_acc,   \
         int* counters, int n_merge, const int* __restrict__ rope_pos, const float* __restrict__ cos_t, \
         const float* __restrict__ sin_t, int rope_R) { PDL_ENTRY();                              \
        sparse_attn_decode_body<D, HPW, NW>(q, kv, ld_kv, pos, W, ratio, sel, sel_w, K, sink, scale, out, H, \
                                            probs_bf16, ws_ml, ws_acc, counters, n_merge,         \
                                            OutRope{rope_pos, cos_t, sin_t, rope_R});              \
    }

SPARSE_ATTN_DECODE(sparse_attn_decode_d512_hg16, 512, 2, 8)
SPARSE_ATTN_DECODE(sparse_attn_decode_d512_hg8, 512, 1, 8)
SPARSE_ATTN_DECODE(sparse_attn_decode_d512_hg4, 512, 1, 4)
SPARSE_ATTN_DECODE(sparse_attn_decode_d128_hg16, 128, 2, 8)
SPARSE_ATTN_DECODE(sparse_attn_decode_d128_hg8, 128, 1, 8)
SPARSE_ATTN_DECODE(sparse_attn_decode_d128_hg4, 128, 1, 4)

// The _qn forms: SPARSE_ATTN_DECODE's arguments with q the RAW q, then the q norm as
// SPARSE_ATTN_QN's (qn_pos [1] int32: the token's position; null: no q RoPE).
#define SPARSE_ATTN_DECODE_QN(NAME, D, HPW, NW)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                          \
    NAME(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv, const int* __restrict__ pos, \
         int W, int ratio, const int* __restrict__ sel, int sel_w, int K, const float* __restrict__ sink, \
         float scale, u16* __restrict__ out, int H, int probs_bf16, float* ws_ml, float* ws_acc,   \
         int* counters, int n_merge, const int* __restrict__ rope_pos, const float* __restrict__ cos_t, \
         const float* __restrict__ sin_t, int rope_R, float qn_eps, const int* __restrict__ qn_pos, \
         const float* __restrict__ qn_cos, const float* __restrict__ qn_sin, int qn_R) { PDL_ENTRY(); \
        sparse_attn_decode_body<D, HPW, NW, true>(q, kv, ld_kv, pos, W, ratio, sel, sel_w, K, sink, scale, out, \
                                                  H, probs_bf16, ws_ml, ws_acc, counters, n_merge, \
                                                  OutRope{rope_pos, cos_t, sin_t, rope_R},         \
                                                  QNorm{qn_eps, qn_pos, qn_cos, qn_sin, qn_R});    \
    }

SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d512_hg16_qn, 512, 2, 8)
SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d512_hg8_qn, 512, 1, 8)
SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d512_hg4_qn, 512, 1, 4)
SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d128_hg16_qn, 128, 2, 8)
SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d128_hg8_qn, 128, 1, 8)
SPARSE_ATTN_DECODE_QN(sparse_attn_decode_d128_hg4_qn, 128, 1, 4)

// ---------------------------------------------------------------------------------------------
// sparse_attn_mma_d{D}_hg{16*NHG}: the prefill form of the same attention, with the two products
// on tensor cores (mma.sync.m16n8k16 bf16 x bf16 -> f32, fragments from shared memory with
// ldmatrix).  Same candidate tiles (32), same per-tile statistics and the same tile-order merge
// as the SIMT kernel above; what differs is only the f32 accumulation order of the dots, and P's
// representation in P.V:
//   * S = Q.K^T: q and kv are bf16 values, so every product is exact in f32; the 128-dim slice of
//     warp w accumulates in the MMA's order (8 chained k-steps of 16), and the four slices'
//     partials are added in the fixed order ((w0 + w1) + w2) + w3.  bf16 class: not the SIMT
//     kernel's bits (its order is per-lane FMA chains + a butterfly), but a fixed order that
//     depends only on the token's own row: prefill rows of one launch == the same token alone.
//   * m_t, p_j = exp(s_j - m_t), l_t exactly as the SIMT kernel writes them (f32, masked slots
//     -inf / 0); l_t = per-thread sum of its 8 columns, then a quad butterfly (fixed order).
//   * P.V in the bf16 class (P kept f32): P = P_hi + P_lo with P_hi = bf16(p), P_lo = bf16(p - P_hi)
//     (p - P_hi is exact), two MMAs on the same V fragment.  |p - P_hi - P_lo| <= 2^-16 p, the
//     products are exact, so a_t is f32 P.V up to 2^-16 relative (plus the f32 accumulation).
//     Reference class (probs_bf16 = 1): P_hi only = bf16(p) relative to the tile max, as the
//     SIMT kernel's cast.
//   * a_t of each tile is accumulated from zero and merged into A with the SIMT kernel's
//     M' = max(M, m_t), L = L a + l_t b, A = A a + a_t b; o = A / (L + exp(sink - M)) -> bf16;
//     inverse RoPE epilogue (OutRope) on the stored value.  A tile whose 32 slots are all -1 is
//     skipped: its merge is the identity (a = 1, b = 0), so skipping changes no bit.
// Layout: grid (T, ceil(H/HG)), block 128*NHG = 4*NHG warps; warp w = 4*hgi + ds owns heads
// h0 + 16*hgi .. +15 and dims ds*D/4 .. +D/4-1 of O (f32 accumulators in registers: D/32 n-tiles x 4).
// The token's kv rows are gathered tile by tile (cp.async, zero-filled holes, double-buffered)
// into rows padded to D + 8 bf16 (a row stride of 16 mod 128 bytes: the 8 row addresses of every
// ldmatrix phase hit distinct banks).  Q fragments (16 heads x D/4 dims) stay in registers for
// the whole launch.  The S partials go through shared memory laid out [hgi][ds][n-tile][lane][4]
// (16-byte lane-contiguous stores / loads: conflict-free); thanks to the m16n8 accumulator layout
// == the m16k16 A-operand layout, every thread re-reads exactly the S entries it needs for its P
// fragments.  Dynamic smem: 2*32*(D+8)*2 + NHG*4*16*32*4 bytes (D = 512, NHG = 1: 74752).
// ---------------------------------------------------------------------------------------------
namespace {

DEV void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i
DEV void ldsm_x4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
DEV void ldsm_x4_trans(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <int D, int NHG>
DEV void sparse_attn_mma_body(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv,
                              const int* __restrict__ idx, int K, const float* __restrict__ sink, float scale,
                              u16* __restrict__ out, int H, int probs_bf16, OutRope orope) {
    constexpr int NT = 128 * NHG, HG = 16 * NHG, LDS = D + 8;
    constexpr int DW = D / 4;      // O dims per warp
    constexpr int KS = DW / 16;    // k-steps of the warp's S partial
    constexpr int ND = DW / 8;     // n-tiles of the warp's O slice
    static_assert(KS % 2 == 0 && ND >= 1, "D must be a multiple of 128");
    extern __shared__ __align__(16) u16 smem[];
    float* sx = reinterpret_cast<float*>(smem + 2 * TJ * LDS);  // [NHG][4 ds][4 n-tiles][32 lanes][4]
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int g = lane >> 2, tg = lane & 3;
    const int hgi = wid >> 2, ds = wid & 3;
    const i64 t = blockIdx.x;
    const int h0 = blockIdx.y * HG + 16 * hgi;  // this warp's 16 heads
    const int dw0 = ds * DW;                     // this warp's dims
    const int n_tiles = (K + TJ - 1) / TJ;
    const IdxCand cand{idx + t * K, K};

    if (n_tiles > 0) issue_tile<D, NT, LDS>(smem, kv, ld_kv, cand, 0);

    // A fragments of Q (rows = heads h0 + g, h0 + g + 8; k = the warp's dims), straight from global;
    // heads >= H (H not a multiple of 16: small test models) are zero rows, computed, never stored
    u32 qa[KS][4];
    {
        const u32 m0 = h0 + g < H ? 0xffffffffu : 0u, m8 = h0 + g + 8 < H ? 0xffffffffu : 0u;
        const u16* r0 = q + (t * H + min(h0 + g, H - 1)) * (i64)D + dw0 + 2 * tg;  // clamped: in bounds
        const u16* r8 = q + (t * H + min(h0 + g + 8, H - 1)) * (i64)D + dw0 + 2 * tg;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            qa[s][0] = __ldg(reinterpret_cast<const u32*>(r0 + 16 * s)) & m0;
            qa[s][1] = __ldg(reinterpret_cast<const u32*>(r8 + 16 * s)) & m8;
            qa[s][2] = __ldg(reinterpret_cast<const u32*>(r0 + 16 * s + 8)) & m0;
            qa[s][3] = __ldg(reinterpret_cast<const u32*>(r8 + 16 * s + 8)) & m8;
        }
    }

    // running state of rows g (index 0) and g + 8 (index 1); A[n][0..1] row g, A[n][2..3] row g + 8
    float M[2] = {f32_ninf(), f32_ninf()}, Ls[2] = {0.0f, 0.0f};
    float A[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) A[n][0] = A[n][1] = A[n][2] = A[n][3] = 0.0f;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const u16* buf = smem + (tile & 1) * (TJ * LDS);
        if (tile + 1 < n_tiles) {
            issue_tile<D, NT, LDS>(smem + ((tile + 1) & 1) * (TJ * LDS), kv, ld_kv, cand, tile + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        // bit j: slot tile*32 + j holds a candidate (the same word in every warp: CTA-uniform)
        const int jl = tile * TJ + lane;
        const u32 vmask = __ballot_sync(0xffffffffu, cand(jl) >= 0);
        if (vmask != 0u) {
            // ---- S partial over the warp's dims: 4 n-tiles (8 candidates) x KS k-steps
            float sp[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                sp[j][0] = sp[j][1] = sp[j][2] = sp[j][3] = 0.0f;
                // matrix i of an x4: candidates 8j..8j+7, dims dw0 + 32*s2 + 8i (k-steps 2*s2, 2*s2+1)
                const u16* kr = buf + (8 * j + (lane & 7)) * LDS + dw0 + 8 * (lane >> 3);
#pragma unroll
                for (int s2 = 0; s2 < KS / 2; ++s2) {
                    u32 b[4];
                    ldsm_x4(b, kr + 32 * s2);
                    mma_bf16_16816(sp[j], qa[2 * s2], b[0], b[1]);
                    mma_bf16_16816(sp[j], qa[2 * s2 + 1], b[2], b[3]);
                }
            }
            float* sx_me = sx + (hgi * 4 + ds) * (4 * 32 * 4) + lane * 4;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                *reinterpret_cast<float4*>(sx_me + j * 128) = make_float4(sp[j][0], sp[j][1], sp[j][2], sp[j][3]);
            __syncthreads();
            // ---- full logits in the fixed slice order, scale, mask
            const float* sx_hg = sx + hgi * (4 * 4 * 32 * 4) + lane * 4;
            float sv[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 v = *reinterpret_cast<const float4*>(sx_hg + j * 128);
                float a0 = v.x, a1 = v.y, a2 = v.z, a3 = v.w;
#pragma unroll
                for (int d2 = 1; d2 < 4; ++d2) {
                    v = *reinterpret_cast<const float4*>(sx_hg + d2 * 512 + j * 128);
                    a0 = __fadd_rn(a0, v.x); a1 = __fadd_rn(a1, v.y);
                    a2 = __fadd_rn(a2, v.z); a3 = __fadd_rn(a3, v.w);
                }
                const bool v0 = (vmask >> (8 * j + 2 * tg)) & 1u, v1 = (vmask >> (8 * j + 2 * tg + 1)) & 1u;
                sv[j][0] = v0 ? __fmul_rn(a0, scale) : f32_ninf();
                sv[j][1] = v1 ? __fmul_rn(a1, scale) : f32_ninf();
                sv[j][2] = v0 ? __fmul_rn(a2, scale) : f32_ninf();
                sv[j][3] = v1 ? __fmul_rn(a3, scale) : f32_ninf();
            }
            // ---- tile statistics of rows g / g + 8: the quad (tg = 0..3) holds the row's 32 slots
            float mt[2], lt[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m = sv[0][2 * r];
#pragma unroll
                for (int j = 0; j < 4; ++j) m = fmaxf(m, fmaxf(sv[j][2 * r], sv[j][2 * r + 1]));
                mt[r] = group_max<4>(m);
            }
            float pj[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)  // a -inf slot is masked (mt is then finite)
                    pj[j][e] = sv[j][e] == f32_ninf() ? 0.0f : expf(__fsub_rn(sv[j][e], mt[e >> 1]));
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float l = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) l = __fadd_rn(__fadd_rn(l, pj[j][2 * r]), pj[j][2 * r + 1]);
                lt[r] = group_sum<4>(l);
            }
            // ---- P fragments (A operand, k = candidates): k-step s = n-tiles 2s, 2s+1 of S
            u32 ph[2][4], pl[2][4];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {      // a0/a1: n-tile 2s; a2/a3: n-tile 2s+1
#pragma unroll
                    for (int r = 0; r < 2; ++r) {     // rows g / g + 8
                        const float x0 = pj[2 * s + hh][2 * r], x1 = pj[2 * s + hh][2 * r + 1];
                        const float h0v = round_bf16(x0), h1v = round_bf16(x1);
                        ph[s][2 * hh + r] = pack_bf16x2(h0v, h1v);
                        pl[s][2 * hh + r] = pack_bf16x2(__fsub_rn(x0, h0v), __fsub_rn(x1, h1v));
                    }
                }
            }
            // ---- merge weights (the SIMT kernel's sequence)
            float ma[2], mb[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float Mn = fmaxf(M[r], mt[r]);
                ma[r] = merge_scale(M[r], Mn);
                mb[r] = merge_scale(mt[r], Mn);
                Ls[r] = __fadd_rn(__fmul_rn(Ls[r], ma[r]), __fmul_rn(lt[r], mb[r]));
                M[r] = Mn;
            }
            // ---- a_t = P.V per 8-dim n-tile (from zero), then A = A a + a_t b
            // x4.trans, lane = candidate row: matrices = candidates 0-7, 8-15, 16-23, 24-31 at
            // dims dw0 + 8n..: (b0, b1) of k-step 0, then of k-step 1
            const u16* vr = buf + lane * LDS + dw0;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                u32 b[4];
                ldsm_x4_trans(b, vr + 8 * n);
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (!probs_bf16) {
                    mma_bf16_16816(c, pl[0], b[0], b[1]);
                    mma_bf16_16816(c, pl[1], b[2], b[3]);
                }
                mma_bf16_16816(c, ph[0], b[0], b[1]);
                mma_bf16_16816(c, ph[1], b[2], b[3]);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    A[n][e] = __fadd_rn(__fmul_rn(A[n][e], ma[e >> 1]), __fmul_rn(c[e], mb[e >> 1]));
            }
        }
        __syncthreads();  // every warp is done with buf and sx before they are refilled
    }

    // ---- o = A / (L + exp(sink - M)) -> bf16, inverse RoPE, store (u32 = 2 dims per row)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = h0 + g + 8 * r;
        const bool h_ok = h < H;  // rows past H: computed on zeros, not stored
        const float den = __fadd_rn(Ls[r], expf(__fsub_rn(__ldg(sink + (h_ok ? h : 0)), M[r])));
        u16* orow = out + (t * H + h) * (i64)D;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const int d = dw0 + 8 * n + 2 * tg;
            float o[2] = {round_bf16(__fdiv_rn(A[n][2 * r], den)), round_bf16(__fdiv_rn(A[n][2 * r + 1], den))};
            out_rope<2>(o, d, D, t, orope);
            if (h_ok) *reinterpret_cast<u32*>(orow + d) = pack_bf16x2(o[0], o[1]);
        }
    }
}

}  // namespace

// Arguments as the SIMT kernels' fused path (no workspace): q [T, H, D] bf16, kv [N, ld_kv] bf16,
// idx [T, K] int32, sink [H] f32 -> out [T, H, D] bf16; rope_pos null: no inverse RoPE.
// grid (T, ceil(H/HG)), block 128*NHG, dynamic smem 2*32*(D+8)*2 + NHG*8192 bytes.
// LB: the launch bounds, parenthesised (d512 hg16: 3 CTAs per SM, as 3 x 73 KiB of smem fit, so
// <= 168 registers; hg32 asks for nothing more: a minimum of 1 or 2 CTAs makes ptxas spill).
#define SPARSE_ATTN_MMA(NAME, D, NHG, LB)                                                          \
    extern "C" __global__ void __launch_bounds__ LB                                                \
    NAME(const u16* __restrict__ q, const u16* __restrict__ kv, int ld_kv, const int* __restrict__ idx, \
         int K, const float* __restrict__ sink, float scale, u16* __restrict__ out, int H,         \
         int probs_bf16, const int* __restrict__ rope_pos, const float* __restrict__ cos_t,        \
         const float* __restrict__ sin_t, int rope_R) {                                            \
        PDL_ENTRY();                                                                               \
        sparse_attn_mma_body<D, NHG>(q, kv, ld_kv, idx, K, sink, scale, out, H, probs_bf16,        \
                                     OutRope{rope_pos, cos_t, sin_t, rope_R});                     \
    }

SPARSE_ATTN_MMA(sparse_attn_mma_d512_hg16, 512, 1, (128, 3))
SPARSE_ATTN_MMA(sparse_attn_mma_d512_hg32, 512, 2, (256))
SPARSE_ATTN_MMA(sparse_attn_mma_d128_hg16, 128, 1, (128))
