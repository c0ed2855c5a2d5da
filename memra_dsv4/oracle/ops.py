"""NumPy twins of the GPU kernels: every primitive of the DeepSeek-V4 forward.

Each function is array-in / array-out, with no model state.  The numeric class is the keyword
``pol`` (a ``memra_dsv4.seams.NumericsPolicy``; default: the ``bf16`` class).  A CUDA kernel
that implements a primitive for the bf16/reference class must match the function called with
``pol=POLICIES["bf16"]`` / ``POLICIES["reference"]`` within the bound stated in its test.

Conventions
-----------
* Shapes: T tokens, H heads, D head/hidden dim, hc = 4 streams, E experts, k picks.
* ``pol.store(x)``: a tensor the reference keeps in bf16 (bf16 RNE; identity for exact).
  ``pol.f32(x)``: an fp32 island's output.  Reductions accumulate in float64 and round once
  (see memra_dsv4.seams), short reductions (4 streams, 8/r pooling candidates, k experts) run
  strictly in index order.
* Reference line numbers: M = official inference/model.py, K = kernel.py (see
  /work/shared/reference/dsv4_attention.md and dsv4_model_and_formats.md).

Signatures are a contract with the GPU kernels; change them only with an announcement.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.host.hc import hc_head_weights, hc_split
from memra_dsv4.host.indices import topk_desc
from memra_dsv4.host.quant import kv_fp8_sim, round_bf16
from memra_dsv4.host.rope import rotate_pairs
from memra_dsv4.host.routing import route, sqrtsoftplus
from memra_dsv4.seams import POLICIES, NumericsPolicy, mm

__all__ = [
    "BF16", "rmsnorm", "head_rms", "head_rms_bf16", "linear", "hc_pre", "hc_post", "hc_head",
    "apply_rope", "kv_fp8_sim", "hadamard", "hadamard_matrix", "compressor_project",
    "compress_candidates", "compress_pool", "compress_pool_overlap", "compress_pool_ratio",
    "compress_entry_postprocess", "indexer_weights", "indexer_scores", "indexer_topk",
    "sparse_attention_with_sinks", "wo_grouped", "router_logits", "router", "swiglu_clamped",
    "expert_ffn", "moe_combine", "lm_head",
]

BF16: NumericsPolicy = POLICIES["bf16"]
_F64 = np.float64


def _sum_ordered(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum along ``axis`` strictly in index order (independent of memory layout/shape)."""
    x = np.moveaxis(x, axis, 0)
    acc = x[0].copy()
    for i in range(1, x.shape[0]):
        acc += x[i]
    return acc


# ------------------------------------------------------------------------------- norms
def rmsnorm(x, weight, eps: float, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """y = store(w * x * rsqrt(mean(x^2) + eps)) over the last dim (M:183-196).
    x: [..., n] (bf16-valued); weight: [n] (the bf16 checkpoint value held wide)."""
    x64 = pol.arr(x).astype(_F64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return pol.store(np.asarray(weight, dtype=_F64) * (x64 * r))


def head_rms(x, eps: float, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Unweighted per-head RMS norm of q [..., H, D] over D (M:498), in bf16 tensor arithmetic
    for the bf16/reference classes (see NumericsPolicy.head_rms)."""
    return pol.head_rms(x, eps)


def head_rms_bf16(x, eps: float) -> np.ndarray:
    """``head_rms`` with the bf16 tensor arithmetic of M:498 (the bf16 / reference classes)."""
    return BF16.head_rms(x, eps)


def linear(x, w, kind: str, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """y = x @ w.T; ``kind`` in fp8 | fp4 | bf16 | f32 (see seams.LINEAR_KINDS).
    w is the exactly dequantised weight [out, in]."""
    return pol.linear(x, w, kind)


# ---------------------------------------------------------------------- hyper-connections
def _hc_mixes(streams: np.ndarray, fn: np.ndarray, norm_eps: float, pol: NumericsPolicy):
    X = pol.arr(streams)
    x = X.reshape(*X.shape[:-2], -1).astype(_F64)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    return X, pol.f32(mm(x, np.asarray(fn).T) * r)


def _weighted_streams(X: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """sum_i pre_i * X_i in float64, i ascending.  X [..., hc, D], pre [..., hc]."""
    X64, p64 = X.astype(_F64), pre.astype(_F64)
    acc = p64[..., 0, None] * X64[..., 0, :]
    for i in range(1, X.shape[-2]):
        acc += p64[..., i, None] * X64[..., i, :]
    return acc


def hc_pre(streams, fn, scale, base, *, hc_mult: int, iters: int, hc_eps: float,
           norm_eps: float, pol: NumericsPolicy = BF16):
    """mHC pre-mix (M:674-682).  streams [T, hc, D] (bf16-valued); fn [(2+hc)*hc, hc*D];
    scale [3]; base [(2+hc)*hc].  Returns (y [T, D] stored, post [T, hc], comb [T, hc, hc])
    with post/comb fp32 (comb[i, j]: i = source stream, j = destination).
    RMS over all hc*D values with ``norm_eps``; Sinkhorn with ``hc_eps``."""
    X, mixes = _hc_mixes(streams, fn, norm_eps, pol)
    pre, post, comb = hc_split(mixes, scale, base, hc_mult, iters, hc_eps)
    return pol.store(_weighted_streams(X, pre)), post, comb


def hc_post(f, residual, post, comb, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """new_j = store(post_j * f + sum_i comb[i, j] * R_i) (M:684-687); f [T, D],
    residual [T, hc, D], post [T, hc], comb [T, hc, hc].  Returns [T, hc, D]."""
    f64 = pol.arr(f).astype(_F64)
    R = pol.arr(residual).astype(_F64)
    P = np.asarray(post, dtype=_F64)
    C = np.asarray(comb, dtype=_F64)
    hc = R.shape[-2]
    out = np.empty(R.shape, dtype=_F64)
    for j in range(hc):
        acc = P[..., j, None] * f64
        for i in range(hc):
            acc = acc + C[..., i, j, None] * R[..., i, :]
        out[..., j, :] = acc
    return pol.store(out)


def hc_head(streams, fn, scale, base, *, hc_eps: float, norm_eps: float,
            pol: NumericsPolicy = BF16) -> np.ndarray:
    """Final stream merge (M:729-736): pre = sigmoid(mixes * scale[0] + base) + hc_eps,
    y = store(sum_i pre_i X_i).  streams [T, hc, D]; fn [hc, hc*D]; scale [1]; base [hc]."""
    X, mixes = _hc_mixes(streams, fn, norm_eps, pol)
    return pol.store(_weighted_streams(X, hc_head_weights(mixes, scale, base, hc_eps)))


# ------------------------------------------------------------------------------- RoPE
def apply_rope(x, cos, sin, inverse: bool = False, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Interleaved RoPE on the LAST 2*P dims of x (P = cos.shape[-1]); cos/sin broadcast
    against x[..., :P] (e.g. [T, P] for x [T, D]; [T, 1, P] for x [T, H, D]).  Evaluated
    wide, stored (bf16) as the reference's in-place apply_rotary_emb.  Other dims unchanged."""
    return pol.store(rotate_pairs(pol.arr(x), cos, sin, inverse))


# ----------------------------------------------------------------------------- Hadamard
def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester (natural order) +-1 Hadamard matrix H_n, as scipy.linalg.hadamard(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: size {n} is not a power of two")
    H = np.ones((1, 1), dtype=_F64)
    while H.shape[0] < n:
        H = np.block([[H, H], [H, -H]])
    return H


def hadamard(x, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """y = store(x @ H_n * n^-1/2) over the last dim (rotate_activation, M:247-251).
    The rotation itself is kept in every class (exact included); only the rounding varies."""
    x64 = pol.arr(x).astype(_F64)
    n = x64.shape[-1]
    y = x64.reshape(-1, n).copy()
    h = 1
    while h < n:  # fast Walsh-Hadamard butterflies: exact in float64 for bf16/f32 inputs
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = a + b, a - b
        h *= 2
    return pol.store(y.reshape(x64.shape) * (n ** -0.5))


# --------------------------------------------------------------------------- compressor
def compressor_project(x, wkv, wgate, ape, positions, *, pol: NumericsPolicy = BF16):
    """Per-token compressor projections (M:320-324), fp32: a = x . wkv^T,
    z = x . wgate^T + ape[t mod r].  x [T, dim] (the attention input), wkv/wgate
    [coff*d, dim], ape [r, coff*d], positions [T] absolute.  Returns (a, z) [T, coff*d]."""
    x = pol.arr(x)
    ape = np.asarray(ape)
    r = ape.shape[0]
    pos = np.asarray(positions, dtype=np.int64)
    a = pol.f32(mm(x, np.asarray(wkv).T))
    z = pol.f32(pol.f32(mm(x, np.asarray(wgate).T)) + pol.arr(ape)[pos % r])
    return a, z


def compress_candidates(a, z, ratio: int, *, prev_a=None, prev_z=None):
    """Arrange the projections of nb consecutive COMPLETE blocks into pooling candidates.

    a, z: [nb*ratio, coff*d] (rows = tokens of the blocks, in order).
    * ratio == 4 (overlap, coff = 2): entry k pools the previous block's LOWER halves
      (cols 0..d-1) then its own block's UPPER halves (cols d..2d-1): [nb, 8, d].  The first
      block's predecessor is (prev_a, prev_z) [4, 2d] when given (decode / chunked prefill:
      the pending rows 0..3), else kv 0 and score -inf (block 0 of a sequence, M:307-314).
    * otherwise (coff = 1): [nb, ratio, d], the block's own tokens.
    Returns (a_cand, z_cand)."""
    a = np.asarray(a)
    z = np.asarray(z)
    if a.shape[0] % ratio:
        raise ValueError(f"compress_candidates: {a.shape[0]} rows is not a multiple of {ratio}")
    nb = a.shape[0] // ratio
    if ratio != 4:
        return a.reshape(nb, ratio, -1), z.reshape(nb, ratio, -1)
    d = a.shape[-1] // 2
    ab, zb = a.reshape(nb, 4, 2 * d), z.reshape(nb, 4, 2 * d)
    if prev_a is None:
        pa = np.zeros((1, 4, d), dtype=a.dtype)
        pz = np.full((1, 4, d), -np.inf, dtype=z.dtype)
    else:
        pa = np.asarray(prev_a, dtype=a.dtype)[None, :, :d]
        pz = np.asarray(prev_z, dtype=z.dtype)[None, :, :d]
    lower_a = np.concatenate([pa, ab[:-1, :, :d]], axis=0)
    lower_z = np.concatenate([pz, zb[:-1, :, :d]], axis=0)
    return (np.concatenate([lower_a, ab[:, :, d:]], axis=1),
            np.concatenate([lower_z, zb[:, :, d:]], axis=1))


def compress_pool(a_cand, z_cand, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """THE pooling routine (prefill: vectorised over blocks; decode: one emit).
    a_cand, z_cand [..., n, d] -> p [..., d] = sum_n softmax_n(z)[n, c] * a[n, c] per channel c,
    max-subtracted, float64, candidates summed in index order, rounded once (fp32 island).
    -inf scores get weight 0."""
    a64 = np.asarray(a_cand, dtype=_F64)
    z64 = np.asarray(z_cand, dtype=_F64)
    m = np.max(z64, axis=-2, keepdims=True)
    e = np.exp(z64 - m)
    den = _sum_ordered(e, -2)
    num = _sum_ordered(e * np.where(e > 0, a64, 0.0), -2)
    return pol.f32(num / den)


def compress_pool_overlap(a, z, *, prev_a=None, prev_z=None,
                          pol: NumericsPolicy = BF16) -> np.ndarray:
    """Ratio-4 overlap pooling of nb complete blocks: a, z [nb*4, 2d] -> entries [nb, d]
    (= compress_pool(*compress_candidates(a, z, 4, prev_a=..., prev_z=...)))."""
    ac, zc = compress_candidates(a, z, 4, prev_a=prev_a, prev_z=prev_z)
    return compress_pool(ac, zc, pol=pol)


def compress_pool_ratio(a, z, ratio: int, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Non-overlapping ratio-r pooling (r >= 8): a, z [nb*r, d] -> entries [nb, d]."""
    if ratio == 4:
        raise ValueError("compress_pool_ratio: ratio 4 is the overlap layout; use compress_pool_overlap")
    return compress_pool(*compress_candidates(a, z, ratio), pol=pol)


def compress_entry_postprocess(pooled, norm_w, cos, sin, *, rope_dim: int, rotate: bool,
                               eps: float, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Compressed-entry post-processing (M:362-372): c = rmsnorm(store(p)); RoPE at k*r on the
    last rope_dim dims (cos/sin [n, rope_dim/2] of positions k*r); then main compressor: FP8
    sim of the nope dims (``rotate=False``); indexer compressor: Hadamard over all dims then
    FP4 sim (``rotate=True``).  pooled [n, d] -> [n, d] stored."""
    c = rmsnorm(pol.store(pooled), norm_w, eps, pol=pol)
    c = apply_rope(c, cos, sin, pol=pol)
    if rotate:
        return pol.fp4_sim(hadamard(c, pol=pol), 32)
    return pol.kv_sim(c, rope_dim)


# ------------------------------------------------------------------------------ indexer
INDEXER_WEIGHT_SCALE_DOC = "index_head_dim^-0.5 * index_n_heads^-0.5"


def indexer_weights(x, w_proj, *, n_heads: int, head_dim: int,
                    pol: NumericsPolicy = BF16) -> np.ndarray:
    """Per-head indexer weights (M:418): store(store(x . w_proj^T) * head_dim^-0.5 *
    n_heads^-0.5); x [T, dim] is the attention input (not the q latent).  -> [T, n_heads]."""
    w = linear(x, w_proj, "bf16", pol=pol)
    c = head_dim ** -0.5 * n_heads ** -0.5
    return pol.store(w * w.dtype.type(c))


def indexer_scores(q, weights, keys, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """I[t, k] = store( sum_h store( store(relu(store(q[t,h] . K[k]))) * w[t,h] ) )
    (M:420-421).  q [T, H, d] (rotated, FP4-simulated), weights [T, H], keys [N, d] -> [T, N].
    The head sum accumulates in float64, heads ascending."""
    q64 = pol.arr(q).astype(_F64)
    s = pol.store(np.einsum("thd,nd->thn", q64, np.asarray(keys, dtype=_F64)))
    s = pol.store(np.maximum(s, 0) * pol.arr(weights)[:, :, None])
    return pol.store(_sum_ordered(s.astype(_F64), 1))


def indexer_topk(scores, n_valid, k: int) -> np.ndarray:
    """Top-k per row over the first n_valid[t] entries (score descending, ties -> lower
    index).  scores [T, N]; n_valid [T].  Returns int32 [T, min(k, N)], -1 padded, in
    score order (the candidate builder re-sorts ascending)."""
    scores = np.asarray(scores)
    T, N = scores.shape
    width = min(int(k), N)
    out = np.full((T, width), -1, dtype=np.int32)
    for t in range(T):
        n = int(n_valid[t])
        sel = topk_desc(scores[t, :n], min(k, n))
        out[t, :len(sel)] = sel
    return out


# ---------------------------------------------------------------------- sparse attention
def sparse_attention_with_sinks(q, kv_rows, idx, sink, scale: float, *,
                                pol: NumericsPolicy = BF16, chunk: int = 64) -> np.ndarray:
    """Attention over an index list with a per-head sink (sparse_attn, K:276-368).

    q [..., H, D]; kv_rows [N, D] (K = V, rope dims included); idx [..., K] int32 rows of
    kv_rows, -1 = skip; sink [H] (same units as scaled logits); scale = head_dim^-0.5.
    o[h] = sum_j e^{s_j - m} kv_j / (sum_j e^{s_j - m} + e^{sink_h - m}),
    s_j = scale * q[h].kv_j, m = max(max_j s_j, sink_h).  Logits, softmax and the P.V
    accumulation are float64; the ``reference`` class casts P to bf16 before P.V (the
    denominator keeps the unrounded P, as the kernel).  Output stored (bf16).
    Leading dims are processed ``chunk`` rows at a time (memory only, no numeric effect)."""
    q = pol.arr(q)
    idx = np.asarray(idx)
    lead = q.shape[:-2]
    H, D = q.shape[-2:]
    qf = q.reshape(-1, H, D)
    idf = idx.reshape(-1, idx.shape[-1])
    if qf.shape[0] != idf.shape[0]:
        raise ValueError(f"sparse_attention_with_sinks: q rows {qf.shape[0]} != idx rows {idf.shape[0]}")
    kv64 = np.asarray(kv_rows, dtype=_F64)
    if idf.size and (idf.max() >= kv64.shape[0] or idf.min() < -1):
        raise ValueError(f"sparse_attention_with_sinks: index outside -1..{kv64.shape[0] - 1}")
    sk = np.asarray(sink, dtype=_F64)
    out = np.empty(qf.shape, dtype=_F64)
    for s0 in range(0, qf.shape[0], chunk):
        qq = qf[s0:s0 + chunk].astype(_F64)
        ii = idf[s0:s0 + chunk]
        valid = ii >= 0
        g = kv64[np.where(valid, ii, 0)]                      # [c, K, D]
        g = np.where(valid[..., None], g, 0.0)
        logits = np.einsum("chd,ckd->chk", qq, g) * scale
        logits = np.where(valid[:, None, :], logits, -np.inf)
        m = np.maximum(logits.max(axis=-1), sk[None, :])     # [c, H]
        p = np.exp(logits - m[..., None])
        den = _sum_ordered(p, -1) + np.exp(sk[None, :] - m)
        pv = round_bf16(p.astype(np.float32)).astype(_F64) if pol.attn_probs_bf16 else p
        out[s0:s0 + chunk] = np.einsum("chk,ckd->chd", pv, g) / den[..., None]
    return pol.store(out.reshape(*lead, H, D))


def wo_grouped(o, wo_a, *, groups: int, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Grouped low-rank output projection, first half (M:537-541): o [T, H, D] -> heads
    grouped g-major into [T, G, H*D/G]; u[t, g] = o_g . wo_a[g]^T with wo_a [G*R, H*D/G]
    viewed [G, R, H*D/G]; bf16 inputs, wide accumulation, stored.  Returns [T, G*R]
    (g-major), the input of wo_b."""
    o = pol.act_in(o)
    T = o.shape[0]
    og = o.reshape(T, groups, -1).astype(_F64)
    w = np.asarray(wo_a, dtype=_F64)
    wg = w.reshape(groups, w.shape[0] // groups, w.shape[1])
    return pol.store(np.einsum("tgd,grd->tgr", og, wg).reshape(T, -1))


# -------------------------------------------------------------------------------- MoE
def router_logits(x, w_gate, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """Gate logits (M:569): fp32 x . fp32 W^T.  x [T, dim] (ffn_norm output); -> [T, E]."""
    return linear(x, w_gate, "f32", pol=pol)


def router(logits, *, k: int, route_scale: float, bias=None, tid2eid=None, token_ids=None):
    """(idx int64 [T,k], weights [T,k], scores [T,E]); see memra_dsv4.host.routing.route."""
    return route(logits, k=k, route_scale=route_scale, bias=bias, tid2eid=tid2eid,
                 token_ids=token_ids)


def swiglu_clamped(gate, up, limit: float, weight=None, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """h = silu(min(gate, L)) * clip(up, -L, L), times the routing weight (if given), fp32
    island (M:597-606).  limit <= 0 disables the clamp.  gate/up [T, I]; weight [T] or None."""
    g = np.asarray(gate, dtype=_F64)
    u = np.asarray(up, dtype=_F64)
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.minimum(g, limit)
    with np.errstate(over="ignore"):
        h = pol.f32(g / (1.0 + np.exp(-g))) * pol.f32(u)
    h = pol.f32(h)
    if weight is not None:
        h = pol.f32(pol.arr(weight)[:, None] * h)
    return h


def expert_ffn(x, w1, w2, w3, *, limit: float, weight=None, kind: str = "fp4",
               pol: NumericsPolicy = BF16) -> np.ndarray:
    """One SwiGLU expert (M:594-606): gate = x.w1^T, up = x.w3^T (``kind`` linears, bf16 out),
    h = swiglu_clamped(gate, up, limit, weight), out = linear(h, w2) (bf16 in/out).
    x [T, dim]; returns [T, dim] stored."""
    gate = linear(x, w1, kind, pol=pol)
    up = linear(x, w3, kind, pol=pol)
    return linear(swiglu_clamped(gate, up, limit, weight, pol=pol), w2, kind, pol=pol)


def moe_combine(routed, idx, shared, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """y = store( (sum over picks in ASCENDING expert id of routed) + shared ), with the sum an
    fp32 accumulator (M:630-645).  routed [T, k, dim] (already weighted, stored),
    idx [T, k] expert ids, shared [T, dim] (stored).  Equal ids keep pick order."""
    r = pol.arr(routed)
    order = np.argsort(np.asarray(idx), axis=-1, kind="stable")
    rs = np.take_along_axis(r, order[..., None], axis=1)
    acc = np.zeros((r.shape[0], r.shape[2]), dtype=pol.dtype)
    for j in range(r.shape[1]):
        acc = acc + rs[:, j]
    return pol.store(acc + pol.arr(shared))


def lm_head(y, head_w, *, pol: NumericsPolicy = BF16) -> np.ndarray:
    """fp32 logits from the final-norm output (M:716-717): y [T, dim] . head^T -> [T, vocab]."""
    return linear(y, head_w, "f32", pol=pol)
