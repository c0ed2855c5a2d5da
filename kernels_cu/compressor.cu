// KV compressor: gate-score position bias, softmax pooling and the entry post-processing
// (dsv4_attention.md §4, M:279-377).
//
// compress_add_ape: z[t, :] = f32(z[t, :] + ape[pos[t] % r, :]) in place (twin
//   oracle.ops.compressor_project's last step). Grid-stride, one thread per element.
// compress_pool_overlap (r = 4, coff = 2): entry k, channel c pools 8 candidates in the twin's
//   order (oracle.ops.compress_candidates): the previous block's LOWER halves (rows 4k-4..4k-1,
//   cols c) then its own block's UPPER halves (rows 4k..4k+3, cols d+c). Entry 0's predecessor is
//   `prev` (the pending rows 0..3: decode / chunked prefill) or, when prev is null, kv 0 and
//   score -inf (block 0 of a sequence). Decode emits with kv = state rows 4..7, prev = rows 0..3.
// compress_pool_plain (any other r): entry k pools rows kr..kr+r-1 (decode: the state rows).
//   Both pool with THE routine of the twin (oracle.ops.compress_pool): m = max, e = exp(z - m),
//   den = sum e, num = sum (e > 0 ? e*a : 0), candidates in index order, all in double, one f32
//   rounding of num/den. Thread per (entry, channel); grid (ceil(d/128), n_entries), block 128.
//   The same code serves prefill (many entries) and decode (one), so both give the same bits.
// norm_rope_sim_*: the entry post-processing (oracle.ops.compress_entry_postprocess) and, with a
//   bf16 input, the main KV path k_t = kv_sim(rope(rmsnorm(wkv x))) (M:502-506):
//     v = bf16(in) [f32 input only]; y = bf16(w * (v * rsqrt(mean(v^2) + eps)))   (double stats)
//     RoPE on the last R dims at position pos[row] (double, like host.rope.rotate_pairs)
//     fp8 sim of dims [0, D-R) in blocks of 64  (main compressor / KV)      SIM = 1
//     or Hadamard-128 (double FWHT) -> bf16 -> fp4 sim in blocks of 32 (indexer)   SIM = 2
//   One CTA of D/EPT threads per row (thread owns EPT consecutive dims); output row k goes to
//   out + k * ld_out (write straight into a cache).
// Decode gate (pool_* and norm_rope_sim_*: trailing gate_pos, gate_r[, row_mode, n_rows]): with
//   gate_pos != null the kernel does nothing unless (pos + 1) % r == 0, so the per-step graph can
//   hold the emission work at no cost on the r - 1 steps that emit nothing (ratio 128: the pool
//   reads 128 pending rows).  norm_rope_sim (one row; ROW_RING: n rows, row b at gate_pos[b])
//   places it by row_mode: ROW_GATE: out row 0;
//   ROW_ENTRY: row (pos + 1) / r - 1 of out = the compressed cache (skipped past n_rows);
//   ROW_RING: no gate, row pos % r of out = the window ring (r = W).
// compress_emit_{fp8_d512,hadfp4_d128}: the decode emission chain of one compressor in ONE
//   launch, byte-for-byte what compress_pool_{overlap,plain} (emit-gated) + norm_rope_sim
//   (row_mode ROW_ENTRY, rope position pos + 1 - r) + decode.cu pending_advance write, in that
//   order.  0. With kv_in / score_in (the device verify's staging rows), the row's incoming
//   pending values go into pending row pos % r (+ r overlapping) first, then __syncthreads: what
//   the step's gemv_bf16_multi epilogue writes before this launch.  Gate closed ((pos + 1) % r
//   != 0): every thread returns (after step 0) before touching memory.
//   Gate open, one CTA of d threads (d = the pooled width = D):
//     1. thread c pools channel c with the SAME routine as the pool kernels (pool_small<8> over
//        the overlap candidates / pool_plain_channel over the r rows) into shared memory (the f32
//        value the pool kernels store to the arena and norm_rope_sim reloads: same bits);
//     2. __syncthreads: every read of the pending rows is done; then all threads run
//        pending_advance's element loop (rows [0, r) <- rows [r, 2r) when overlapping, the
//        current rows <- (0, -inf));
//     3. threads < D/EPT (norm_rope_sim's CTA: same EPT dims per thread, same block reduction
//        order; its two __syncthreads become a named barrier over those threads) post-process the
//        pooled row into compressed row (pos + 1) / r - 1 (nothing past n_rows).
//   The pending rows are [rows, C] f32, contiguous (ld = C): overlap r = 4, rows = 2r, C = 2d;
//   plain rows = r, C = d.
#include "common.cuh"

using namespace memra;

// z: [T, C] f32 in place; ape: [r, C] f32; pos: [T] int32 absolute positions.
extern "C" __global__ void __launch_bounds__(256)
compress_add_ape(float* z, const float* __restrict__ ape, const int* __restrict__ pos, int T, int C, int r) { PDL_ENTRY();
    const i64 total = (i64)T * C;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), c = (int)(i % C);
        const int pr = __ldg(pos + t) % r;
        z[i] = __fadd_rn(z[i], __ldg(ape + (i64)pr * C + c));
    }
}

namespace {

// The pooling routine over n candidates, given as (a, z) pairs fetched by `get(i, a, z)`.
// Decode emission gate: with gate_pos != null the kernel runs only when (pos + 1) % r == 0 (the
// step that closes a compressed block); otherwise it returns before touching memory.  Prefill
// passes null.  Uniform across the grid, so whole CTAs exit.
DEV bool emit_gate_open(const int* gate_pos, int gate_r) {
    return gate_pos == nullptr || (__ldg(gate_pos) + 1) % gate_r == 0;
}

enum { ROW_GATE = 0, ROW_ENTRY = 1, ROW_RING = 2 };

template <int NMAX, typename Get>
DEV float pool_small(int n, Get get) {
    double a[NMAX], z[NMAX];
    double m = f64_ninf();
#pragma unroll
    for (int i = 0; i < NMAX; ++i) {
        if (i < n) {
            get(i, a[i], z[i]);
            m = fmax(m, z[i]);
        }
    }
    double den = 0.0, num = 0.0;
#pragma unroll
    for (int i = 0; i < NMAX; ++i) {
        if (i < n) {
            const double e = exp(__dsub_rn(z[i], m));
            const double term = e > 0.0 ? __dmul_rn(e, a[i]) : 0.0;
            den = i == 0 ? e : __dadd_rn(den, e);
            num = i == 0 ? term : __dadd_rn(num, term);
        }
    }
    return __double2float_rn(__ddiv_rn(num, den));
}

// One channel of a plain (non-overlap) pool: rows kp[i * ld], zp[i * ld], i < r (compress_pool's
// routine, the pool_small order with a runtime candidate count).  Plain loads: the decode emit
// kernel rewrites these rows after reading them (no read-only cache path on data it writes).
DEV float pool_plain_channel(const float* kp, const float* zp, int ld, int r) {
    double m = f64_ninf();
    for (int i = 0; i < r; ++i) m = fmax(m, (double)zp[(i64)i * ld]);
    double den = 0.0, num = 0.0;
    for (int i = 0; i < r; ++i) {
        const double e = exp(__dsub_rn((double)zp[(i64)i * ld], m));
        const double term = e > 0.0 ? __dmul_rn(e, (double)kp[(i64)i * ld]) : 0.0;
        den = i == 0 ? e : __dadd_rn(den, e);
        num = i == 0 ? term : __dadd_rn(num, term);
    }
    return __double2float_rn(__ddiv_rn(num, den));
}

}  // namespace

// kv, score: [rows, ld] f32 (ld >= 2d; token rows 4k..4k+3 are block k); prev_kv, prev_score:
// [4, ld_prev] f32 or null; out: [n_entries, ld_out] f32. grid (ceil(d/128), n_entries), block 128.
extern "C" __global__ void __launch_bounds__(128)
compress_pool_overlap(const float* __restrict__ kv, const float* __restrict__ score, int ld,
                      const float* __restrict__ prev_kv, const float* __restrict__ prev_score, int ld_prev,
                      float* __restrict__ out, int ld_out, int d, const int* __restrict__ gate_pos,
                      int gate_r) { PDL_ENTRY();
    if (!emit_gate_open(gate_pos, gate_r)) return;
    const int c = blockIdx.x * 128 + threadIdx.x;
    const i64 k = blockIdx.y;
    if (c >= d) return;
    const float p = pool_small<8>(8, [&](int i, double& a, double& z) {
        if (i < 4) {
            if (k > 0) {
                const i64 off = (4 * k - 4 + i) * (i64)ld + c;
                a = __ldg(kv + off);
                z = __ldg(score + off);
            } else if (prev_kv != nullptr) {
                a = __ldg(prev_kv + (i64)i * ld_prev + c);
                z = __ldg(prev_score + (i64)i * ld_prev + c);
            } else {
                a = 0.0;
                z = f64_ninf();
            }
        } else {
            const i64 off = (4 * k + i - 4) * (i64)ld + d + c;
            a = __ldg(kv + off);
            z = __ldg(score + off);
        }
    });
    out[k * ld_out + c] = p;
}

// kv, score: [n_entries * r, ld] f32 (ld >= d); out [n_entries, ld_out]. grid (ceil(d/128), n_entries), block 128.
extern "C" __global__ void __launch_bounds__(128)
compress_pool_plain(const float* __restrict__ kv, const float* __restrict__ score, int ld,
                    float* __restrict__ out, int ld_out, int d, int r, const int* __restrict__ gate_pos,
                    int gate_r) { PDL_ENTRY();
    if (!emit_gate_open(gate_pos, gate_r)) return;
    const int c = blockIdx.x * 128 + threadIdx.x;
    const i64 k = blockIdx.y;
    if (c >= d) return;
    out[k * ld_out + c] = pool_plain_channel(kv + k * r * (i64)ld + c, score + k * r * (i64)ld + c, ld, r);
}

namespace {

enum { SIM_NONE = 0, SIM_FP8 = 1, SIM_HAD_FP4 = 2 };

// norm_rope_sim_core's static inputs of one thread, loaded BEFORE the kernel's PDL wait
// (PDL_ENTRY_PRELOAD): the norm weight of its dims d0 .. d0 + EPT - 1 and, for the RoPE slice's
// threads, the cos / sin of their EPT / 2 pairs at the row's rope position.  w, cos and sin are
// static; the positions (the decode step's arena pos, the legacy step's uploaded pos, the chunk
// routine's arange) are written before the kernel's chain starts (common.cuh's "complete before
// this grid can launch"), read through L2.  The same floats as the loads they replace.
template <int EPT>
struct NrsPre {
    float w[EPT];
    float c[EPT / 2], s[EPT / 2];
};
template <int D, int EPT>
DEV void nrs_load(NrsPre<EPT>& pre, int d0, const float* __restrict__ w, const float* __restrict__ cos_t,
                  const float* __restrict__ sin_t, int rope_p, int R, bool rope) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) pre.w[i] = __ldg(w + d0 + i);
#pragma unroll
    for (int i = 0; i < EPT / 2; ++i) pre.c[i] = pre.s[i] = 0.0f;
    if (rope && d0 >= D - R) {
        const i64 base = (i64)rope_p * (R >> 1) + ((d0 - (D - R)) >> 1);
        rope_pairs_ldg(cos_t, sin_t, base, pre.c, pre.s);
    }
}

// The post-processing of one row after its load: v[EPT] = this thread's dims d0 .. d0 + EPT - 1
// (bf16 values in f32), pre = this thread's norm weight and RoPE rows (nrs_load at the row's rope
// position), o_row = the output row.  bsum(x) = the sum of x over the row's D/EPT threads in
// block_sum's order (warp_sum, then warp 0 + warp 1 + ...): every caller gets the same bits.
template <int D, int EPT, int SIM, typename BlockSum>
DEV void norm_rope_sim_core(float* v, int d0, const NrsPre<EPT>& pre, double eps, int R, u16* o_row,
                            BlockSum bsum) {
    static_assert(SIM != SIM_HAD_FP4 || (D == 128 && EPT == 4), "Hadamard path is one warp of 4 dims");
    double ss = 0.0;
#pragma unroll
    for (int i = 0; i < EPT; ++i) ss = __fma_rn((double)v[i], (double)v[i], ss);
    ss = bsum(ss);
    const double r = 1.0 / sqrt(ss / (double)D + eps);
#pragma unroll
    for (int i = 0; i < EPT; ++i)
        v[i] = bf16_to_f32(f64_to_bf16(__dmul_rn((double)pre.w[i], __dmul_rn((double)v[i], r))));
    if (d0 >= D - R) {  // rope slice (D - R is a multiple of EPT)
#pragma unroll
        for (int i = 0; i < EPT; i += 2) {
            rope_pair(v[i], v[i + 1], pre.c[i >> 1], pre.s[i >> 1], false);
            v[i] = round_bf16(v[i]);
            v[i + 1] = round_bf16(v[i + 1]);
        }
    }
    if (SIM == SIM_FP8) {  // blocks of 64 on the nope dims; 64/EPT lanes per block
        constexpr int G = 64 / EPT;
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < EPT; ++i) amax = fmaxf(amax, fabsf(v[i]));
        amax = group_max<G>(amax);
        if (d0 < D - R) {
            const int e = ue8m0_exp(fmaxf(amax, act_amax_floor()), inv_448());
#pragma unroll
            for (int i = 0; i < EPT; ++i) v[i] = fp8_sim_value(v[i], e);
        }
    } else if (SIM == SIM_HAD_FP4) {
        double h[4] = {v[0], v[1], v[2], v[3]};
        fwht128_warp(h);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = round_bf16(__double2float_rn(__dmul_rn(h[i], 0.08838834764831845)));
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        amax = group_max<8>(amax);
        const int e = ue8m0_exp(fmaxf(amax, fp4_amax_floor()), inv_6());
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = fp4_sim_value(v[i], e);
    }
    u16* o = o_row + d0;
#pragma unroll
    for (int i = 0; i < EPT; i += 4) {
        uint2 q;
        q.x = pack_bf16x2(v[i], v[i + 1]);
        q.y = pack_bf16x2(v[i + 2], v[i + 3]);
        *reinterpret_cast<uint2*>(o + i) = q;
    }
}

// norm_rope_sim_row's loads before the PDL wait: the gate position (gate_pos given) and nrs_load
// at the row's rope position pos[row] (the RoPE slice's threads).
template <int EPT>
struct NrsRowPre {
    int gp;
    NrsPre<EPT> pre;
};
template <int D, int EPT>
DEV NrsRowPre<EPT> nrs_row_preload(const float* __restrict__ w, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, const int* __restrict__ pos, int R,
                                   const int* __restrict__ gate_pos) {
    NrsRowPre<EPT> f;
    // ring mode with n rows (the device verify's T kv rows): row b's own position gate_pos[b];
    // every other use is one row (blockIdx.x == 0)
    f.gp = gate_pos != nullptr ? __ldcg(gate_pos + blockIdx.x) : 0;
    const int d0 = threadIdx.x * EPT;
    const bool rope = d0 >= D - R;
    nrs_load<D, EPT>(f.pre, d0, w, cos_t, sin_t, rope ? __ldcg(pos + blockIdx.x) : 0, R, rope);
    return f;
}

template <int D, int EPT, bool IN_F32, int SIM>
DEV void norm_rope_sim_row(const void* in_v, int ld_in, double eps, int R, u16* out, int ld_out,
                           const int* __restrict__ gate_pos, int gate_r, int row_mode, int n_rows,
                           const NrsRowPre<EPT>& first) {
    if (gate_pos != nullptr) {
        const int p = first.gp;
        if (row_mode == ROW_RING) {            // ring row p % r (the window cache), no gate
            out += (i64)(p % gate_r) * ld_out;
        } else {
            if ((p + 1) % gate_r != 0) return;  // emission gate
            if (row_mode == ROW_ENTRY) {       // compressed row (p + 1) / r - 1
                const int k = (p + 1) / gate_r - 1;
                if (k >= n_rows) return;
                out += (i64)k * ld_out;
            }
        }
    }
    constexpr int NT = D / EPT;
    constexpr int NW = NT / 32;
    static_assert(NT % 32 == 0, "one or more whole warps per row");
    __shared__ double red[NW > 0 ? NW : 1];
    const i64 row = blockIdx.x;
    const int d0 = threadIdx.x * EPT;
    float v[EPT];
    if (IN_F32) {
        const float* in = reinterpret_cast<const float*>(in_v) + row * ld_in + d0;
#pragma unroll
        for (int i = 0; i < EPT; i += 4) {
            const float4 q = __ldg(reinterpret_cast<const float4*>(in + i));
            v[i] = round_bf16(q.x); v[i + 1] = round_bf16(q.y);
            v[i + 2] = round_bf16(q.z); v[i + 3] = round_bf16(q.w);
        }
    } else {
        const u16* in = reinterpret_cast<const u16*>(in_v) + row * ld_in + d0;
#pragma unroll
        for (int i = 0; i < EPT; i += 4) {
            const uint2 q = __ldg(reinterpret_cast<const uint2*>(in + i));
            v[i] = bf16lo(q.x); v[i + 1] = bf16hi(q.x);
            v[i + 2] = bf16lo(q.y); v[i + 3] = bf16hi(q.y);
        }
    }
    // gate_pos given: out is already the row's placed target (ring rows: row b at gate_pos[b] % r)
    norm_rope_sim_core<D, EPT, SIM>(v, d0, first.pre, eps, R, out + (gate_pos != nullptr ? 0 : row) * ld_out,
                                    [&](double x) { return block_sum<NW>(x, red); });
}

// block_sum's arithmetic over the first NW warps of a larger CTA: a named barrier (id 1) over
// those 32 * NW threads replaces __syncthreads (the other threads never reach it).  One call per
// launch, so red needs no leading barrier.
template <int NW>
DEV double block_sum_first_warps(double v, double* red) {
    v = warp_sum(v);
    if (NW == 1) return v;
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) red[w] = v;
    asm volatile("bar.sync 1, %0;" ::"n"(32 * NW) : "memory");
    double s = red[0];
#pragma unroll
    for (int i = 1; i < NW; ++i) s += red[i];
    return s;
}

}  // namespace

// in: [n, ld_in] f32 (pooled) or bf16; w: [D] f32 norm weight; cos/sin: [n_pos, R/2] f32;
// pos: [n] int32 rope positions (k*r for entries, t for tokens); out: [n, ld_out] bf16.
// grid (n), block D/EPT. R % EPT == 0 and (SIM_FP8) (D - R) % 64 == 0.
#define NORM_ROPE_SIM(NAME, D, EPT, IN_F32, SIM)                                                  \
    extern "C" __global__ void __launch_bounds__(D / EPT)                                         \
    NAME(const void* in, int ld_in, const float* __restrict__ w, double eps,                     \
         const float* __restrict__ cos_t, const float* __restrict__ sin_t,                        \
         const int* __restrict__ pos, int R, u16* out, int ld_out, const int* __restrict__ gate_pos, \
         int gate_r, int row_mode, int n_rows) {                                                  \
        PDL_ENTRY_PRELOAD(const NrsRowPre<EPT> first = nrs_row_preload<D, EPT>(w, cos_t, sin_t, pos, R, gate_pos)); \
        norm_rope_sim_row<D, EPT, IN_F32, SIM>(in, ld_in, eps, R, out, ld_out, gate_pos, gate_r, row_mode, \
                                               n_rows, first);                                    \
    }

NORM_ROPE_SIM(norm_rope_fp8_d512_f32in, 512, 8, true, SIM_FP8)
NORM_ROPE_SIM(norm_rope_fp8_d512_bf16in, 512, 8, false, SIM_FP8)
NORM_ROPE_SIM(norm_rope_fp8_d128_f32in, 128, 4, true, SIM_FP8)
NORM_ROPE_SIM(norm_rope_fp8_d128_bf16in, 128, 4, false, SIM_FP8)
NORM_ROPE_SIM(norm_rope_hadfp4_d128_f32in, 128, 4, true, SIM_HAD_FP4)
NORM_ROPE_SIM(norm_rope_hadfp4_d128_bf16in, 128, 4, false, SIM_HAD_FP4)

namespace {

// The decode emission chain (see the header): D = the pooled width, one CTA of D threads.
// compress_emit's loads before the PDL wait: the position (the emission gate) and, when the
// launch emits, nrs_load at the entry's rope position p + 1 - r (its norm threads).
template <int EPT>
struct EmitPre {
    int p;
    NrsPre<EPT> pre;
};
template <int D, int EPT>
DEV EmitPre<EPT> emit_preload(const int* __restrict__ pos, int r, const float* __restrict__ w,
                              const float* __restrict__ cos_t, const float* __restrict__ sin_t, int R) {
    EmitPre<EPT> f;
    f.p = __ldcg(pos);
    const bool emits = (f.p + 1) % r == 0 && threadIdx.x < D / EPT;
    const int d0 = emits ? (int)threadIdx.x * EPT : 0;
    nrs_load<D, EPT>(f.pre, d0, w, cos_t, sin_t, f.p + 1 - r, R, emits);
    return f;
}

// 0. The row's incoming pending values (the device verify's staging rows: the GEMV wrote them
//    for every row at once; the emission places row p's, in position order) into pending row
//    p % r (+ r overlapping): the row gemv_bf16_multi's epilogue writes in the step.  All D
//    threads; ends with __syncthreads (the pool reads this row).
template <int D>
DEV void emit_copy_in(int p, int r, int ovl, int C, float* kv, float* score,
                      const float* __restrict__ kv_in, const float* __restrict__ score_in) {
    const i64 o = (i64)(p % r + (ovl ? r : 0)) * C;
    for (int i = threadIdx.x; i < C; i += D) {
        kv[o + i] = kv_in[i];
        score[o + i] = score_in[i];
    }
    __syncthreads();
}

// 1-2. Pool channel c into pooled[c] (compress_pool_overlap with kv = rows r.., prev = rows
//    0..3, entry 0; compress_pool_plain with entry 0), __syncthreads (every pending read done),
//    then pending_advance's loop (the same elements, the same values).  All D threads.
template <int D>
DEV void emit_pool_advance(int r, int ovl, int C, float* kv, float* score, float* pooled) {
    const int c = threadIdx.x;
    if (ovl) {
        const float* cur_kv = kv + (i64)r * C;
        const float* cur_sc = score + (i64)r * C;
        pooled[c] = pool_small<8>(8, [&](int i, double& a, double& z) {
            if (i < 4) {
                a = kv[(i64)i * C + c];
                z = score[(i64)i * C + c];
            } else {
                a = cur_kv[(i64)(i - 4) * C + D + c];
                z = cur_sc[(i64)(i - 4) * C + D + c];
            }
        });
    } else {
        pooled[c] = pool_plain_channel(kv + c, score + c, C, r);
    }
    __syncthreads();  // all pending-row reads are done (and pooled is complete)
    const int o = ovl ? r : 0;
    for (int i = threadIdx.x; i < r * C; i += D) {
        const i64 cur = (i64)o * C + i;
        if (ovl) {
            kv[i] = kv[cur];
            score[i] = score[cur];
        }
        kv[cur] = 0.0f;
        score[cur] = f32_ninf();
    }
}

// 3. norm_rope_sim (f32 input, ROW_ENTRY) of the pooled row at rope position p + 1 - r into
//    compressed row (p + 1) / r - 1 (nothing past n_rows).  Threads < D / EPT only (the caller
//    tests it; the named barrier inside spans exactly them); pre = nrs_load at that position.
template <int D, int EPT, int SIM>
DEV void emit_entry(const float* pooled, const NrsPre<EPT>& pre, int p, int r, double eps, int R,
                    u16* out, int ld_out, int n_rows, double* red) {
    constexpr int NW = D / EPT / 32;
    const int k = (p + 1) / r - 1;
    if (k >= n_rows) return;  // uniform over the NT threads: the named barrier is never split
    const int d0 = threadIdx.x * EPT;
    float v[EPT];
#pragma unroll
    for (int i = 0; i < EPT; i += 4) {
        const float4 q = *reinterpret_cast<const float4*>(pooled + d0 + i);
        v[i] = round_bf16(q.x); v[i + 1] = round_bf16(q.y);
        v[i + 2] = round_bf16(q.z); v[i + 3] = round_bf16(q.w);
    }
    norm_rope_sim_core<D, EPT, SIM>(v, d0, pre, eps, R, out + (i64)k * ld_out,
                                    [&](double x) { return block_sum_first_warps<NW>(x, red); });
}

template <int D, int EPT, int SIM>
DEV void compress_emit_body(int r, int ovl, float* kv, float* score, const float* kv_in,
                            const float* score_in, double eps, int R, u16* out, int ld_out,
                            int n_rows, const EmitPre<EPT>& first) {
    constexpr int NT = D / EPT;  // norm_rope_sim's threads
    constexpr int NW = NT / 32;
    static_assert(NT % 32 == 0 && D % 32 == 0, "whole warps");
    const int p = first.p;
    const int C = ovl ? 2 * D : D;  // pending row width = the row stride (contiguous rows)
    if (kv_in != nullptr) emit_copy_in<D>(p, r, ovl, C, kv, score, kv_in, score_in);
    if ((p + 1) % r != 0) return;  // the emission gate (uniform: the whole CTA leaves)
    __shared__ __align__(16) float pooled[D];
    __shared__ double red[NW];
    emit_pool_advance<D>(r, ovl, C, kv, score, pooled);
    if (threadIdx.x >= NT) return;
    emit_entry<D, EPT, SIM>(pooled, first.pre, p, r, eps, R, out, ld_out, n_rows, red);
}

// compress_emit_rows: the device verify's T rows through one compressor in ONE launch, in
// position order: per row t, its staging values in (step 0), then when pos[t] closes a block
// the pool, the advance and the entry (steps 1-3): the same helpers, in the same order, as T
// compress_emit launches with kv_in / score_in (so the same bytes: the state between rows lives
// in the pending rows, global memory, and the CTA's __syncthreads orders it).  The norm weight
// and RoPE rows are loaded per emitting row after the PDL wait (nrs_load: loads only).
template <int D, int EPT, int SIM>
DEV void compress_emit_rows_body(const int* __restrict__ pos, int T, int r, int ovl, float* kv,
                                 float* score, const float* __restrict__ kv_in,
                                 const float* __restrict__ score_in, int ld_in,
                                 const float* __restrict__ w, double eps,
                                 const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                 int R, u16* out, int ld_out, int n_rows) {
    constexpr int NT = D / EPT;
    constexpr int NW = NT / 32;
    static_assert(NT % 32 == 0 && D % 32 == 0, "whole warps");
    __shared__ __align__(16) float pooled[D];
    __shared__ double red[NW];
    const int C = ovl ? 2 * D : D;
    for (int t = 0; t < T; ++t) {
        const int p = pos[t];
        emit_copy_in<D>(p, r, ovl, C, kv, score, kv_in + (i64)t * ld_in, score_in + (i64)t * ld_in);
        if ((p + 1) % r != 0) continue;  // uniform
        const bool norm_thread = threadIdx.x < NT;
        NrsPre<EPT> pre;
        nrs_load<D, EPT>(pre, norm_thread ? (int)threadIdx.x * EPT : 0, w, cos_t, sin_t, p + 1 - r, R,
                         norm_thread);
        emit_pool_advance<D>(r, ovl, C, kv, score, pooled);
        if (norm_thread) emit_entry<D, EPT, SIM>(pooled, pre, p, r, eps, R, out, ld_out, n_rows, red);
        __syncthreads();  // pooled / red read and the advance written before the next row
    }
}

}  // namespace

// pos: [1] int32 (the decoded token's position); kv, score: the pending rows [(ovl ? 2r : r), C]
// f32, contiguous (ovl: r = 4, C = 2D; else C = D); kv_in, score_in: null, or C f32 each (the
// row's incoming pending values, written first: step 0); w [D] f32; cos/sin [n_pos, R/2] f32;
// out: the compressed cache [n_rows, ld_out] bf16.  grid 1, block D.
#define COMPRESS_EMIT(NAME, D, EPT, SIM)                                                            \
    extern "C" __global__ void __launch_bounds__(D)                                                 \
    NAME(const int* __restrict__ pos, int r, int ovl, float* kv, float* score,                      \
         const float* __restrict__ kv_in, const float* __restrict__ score_in,                       \
         const float* __restrict__ w, double eps, const float* __restrict__ cos_t,                  \
         const float* __restrict__ sin_t, int R, u16* out, int ld_out, int n_rows) {                \
        PDL_ENTRY_PRELOAD(const EmitPre<EPT> first = emit_preload<D, EPT>(pos, r, w, cos_t, sin_t, R)); \
        compress_emit_body<D, EPT, SIM>(r, ovl, kv, score, kv_in, score_in, eps, R, out, ld_out,    \
                                        n_rows, first);                                             \
    }

COMPRESS_EMIT(compress_emit_fp8_d512, 512, 8, SIM_FP8)
COMPRESS_EMIT(compress_emit_fp8_d128, 128, 4, SIM_FP8)
COMPRESS_EMIT(compress_emit_hadfp4_d128, 128, 4, SIM_HAD_FP4)

// pos: [T] int32 (row t's position, ascending); kv_in / score_in: [T, ld_in] f32 (row t's
// incoming pending values, C used); the rest as compress_emit.  grid 1, block D.
#define COMPRESS_EMIT_ROWS(NAME, D, EPT, SIM)                                                       \
    extern "C" __global__ void __launch_bounds__(D)                                                 \
    NAME(const int* __restrict__ pos, int T, int r, int ovl, float* kv, float* score,               \
         const float* __restrict__ kv_in, const float* __restrict__ score_in, int ld_in,            \
         const float* __restrict__ w, double eps, const float* __restrict__ cos_t,                  \
         const float* __restrict__ sin_t, int R, u16* out, int ld_out, int n_rows) {                \
        PDL_ENTRY();                                                                               \
        compress_emit_rows_body<D, EPT, SIM>(pos, T, r, ovl, kv, score, kv_in, score_in, ld_in, w, \
                                             eps, cos_t, sin_t, R, out, ld_out, n_rows);           \
    }

COMPRESS_EMIT_ROWS(compress_emit_rows_fp8_d512, 512, 8, SIM_FP8)
COMPRESS_EMIT_ROWS(compress_emit_rows_fp8_d128, 128, 4, SIM_FP8)
COMPRESS_EMIT_ROWS(compress_emit_rows_hadfp4_d128, 128, 4, SIM_HAD_FP4)

// ----------------------------------------------------------------------------------------------
// The chunk routine's rmsnorm (+ RoPE) in two launches instead of ~25 CuPy ops, bit-identical to
// the CuPy chain it replaces (ops_glue.rope(ops_glue.rmsnorm(x, w, eps), cos, sin), optionally on
// ops_glue.store(x)), which stays callable as the reference (ops_glue.rmsnorm / rope).  Why not
// norm_rope_sim_* above: their row statistic is a block reduction in its own order, the chain's is
// cupy.mean's; the two agree except in rare last-bit ties, and the chunk routine's contract is
// "the same bits as before".  So the statistic stays cupy.mean over the SAME [n, D] float64 array
// of squares (chain_sq writes it: same shape, same values, so CuPy picks the same reduction), and
// chain_rms_rope does every elementwise step after it with the chain's operations:
//   r = 1.0 / sqrt(mean + eps)                         (double: add, sqrt, div, as cupy's ufuncs)
//   c = store((float)(w * (x * r)))                    (double muls in the chain's grouping)
//   rope pairs (a, b) of the last 2P dims, position = the row:
//     re = a*c - b*s, im = a*s + b*c in double (explicit _rn: no FMA contraction, which the
//     chain's separate kernels never get), (float), store
// "store" is ops_glue's RNE formula u += 0x7FFF + ((u >> 16) & 1) verbatim (no NaN special case,
// unlike f32_to_bf16: the chain's bits for every input); "(float)" is a plain conversion, the
// instruction cupy's astype emits (both compiled by NVRTC with CuPy's -ftz=true).
// Layout: x [n, ld_x] f32 rows; sq [n, D] f64 contiguous; mean [n] f64; w [D] bf16 bits;
// cos/sin [n, P] f32 (row t = row t's angles); out [n, ld_out] bf16 bits.  One thread per element
// pair (D even; D - 2P even), grid-stride, block 256.
namespace {

DEV u32 chain_rne(float f) {  // ops_glue._RNE
    const u32 u = __float_as_uint(f);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
DEV float chain_store(float f) { return __uint_as_float(chain_rne(f) << 16); }

DEV double chain_load(const float* x, i64 off, int pre_store) {
    const float v = x[off];
    return (double)(pre_store ? chain_store(v) : v);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
chain_sq(const float* __restrict__ x, int ld_x, int pre_store, double* __restrict__ sq, int n, int D) { PDL_ENTRY();
    const i64 total = (i64)n * D;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / D;
        const int c = (int)(i - row * D);
        const double v = chain_load(x, row * ld_x + c, pre_store);
        sq[i] = __dmul_rn(v, v);
    }
}

extern "C" __global__ void __launch_bounds__(256)
chain_rms_rope(const float* __restrict__ x, int ld_x, int pre_store, const double* __restrict__ mean,
               const u16* __restrict__ w, double eps, const float* __restrict__ cos_t,
               const float* __restrict__ sin_t, int P, u16* __restrict__ out, int ld_out, int n, int D) { PDL_ENTRY();
    const int half = D >> 1;
    const i64 total = (i64)n * half;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / half;
        const int c0 = 2 * (int)(i - row * half);
        const double r = __ddiv_rn(1.0, sqrt(__dadd_rn(mean[row], eps)));
        float y[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const double v = chain_load(x, row * ld_x + c0 + j, pre_store);
            const double wd = (double)bf16_to_f32(w[c0 + j]);
            y[j] = chain_store((float)__dmul_rn(wd, __dmul_rn(v, r)));
        }
        if (c0 >= D - 2 * P) {  // a rope pair (ops_glue.rope: interleaved pairs on the last 2P dims)
            const int p = (c0 - (D - 2 * P)) >> 1;
            const double a = y[0], b = y[1];
            const double cc = cos_t[row * P + p], ss = sin_t[row * P + p];
            y[0] = (float)__dsub_rn(__dmul_rn(a, cc), __dmul_rn(b, ss));
            y[1] = (float)__dadd_rn(__dmul_rn(a, ss), __dmul_rn(b, cc));
        }
        // rope's final store(out) (also over the nope dims: store(store(v)) == store(v))
        out[row * ld_out + c0] = (u16)chain_rne(y[0]);
        out[row * ld_out + c0 + 1] = (u16)chain_rne(y[1]);
    }
}
