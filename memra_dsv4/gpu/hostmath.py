"""The host islands of the byte-identity instrument: ``device-hostmath`` (gpu.step_device with
``hostmath``) and ``legacy`` at one token (gpu.decode.ChunkBlock.forward_one) compute the
four decisions of a decode step on the HOST with the host/ rules the oracle uses, from inputs
the device computed, and upload the results into the buffers the next kernels read:

* hc split (Sinkhorn): mixes f32 [(2+hc)*hc] (ops.hc.hc_mixes) -> host.hc.hc_split in f32
  -> pre, post, comb;
* router: logits f32 [E] (ops.router.logits) -> host.routing.route in f32 (sqrtsoftplus,
  learned top-k with bias or hash tid2eid[token], weights) -> ids int32 [k] (pick order),
  weights f32 [k];
* indexer fine top-k: scores bf16 bits [n_valid] (ops.indexer.scores, 'simt') ->
  host.indices.topk_desc (ties -> lower index) -> ascending entry ids, -1 padded to the width
  the attention candidate list uses;
* head gate: mixes f32 [hc] (ops.hc.hc_mixes of hc_head_fn) -> host.hc.hc_head_weights -> pre.

The pure rules (``hc_rule``, ``head_rule``, ``route_rule``, ``index_rule``) need NumPy only
(tests/test_hostmath_cpu.py checks them against the oracle's own functions).  The device side
(``HostIO``, ``hc_island``, ``head_island``, ``router_island``, ``indexer_island``) runs the
same launches in both paths; ``HostIO`` moves the bytes through pinned host buffers made on
first use (no allocation per step after the first), on one stream, synchronising before each
host rule.  The round trips make the path uncapturable: it runs eagerly.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.host.hc import hc_head_weights, hc_split
from memra_dsv4.host.indices import topk_desc
from memra_dsv4.host.routing import route

__all__ = ["hc_rule", "head_rule", "route_rule", "index_rule", "sel_width", "step_candidates", "verify_candidates",
           "HostIO", "hc_island", "head_island", "router_island", "indexer_island"]


# ------------------------------------------------------------------------- host rules
def hc_rule(mixes, scale, base, hc: int, iters: int, eps: float):
    """(pre [hc], post [hc], comb [hc, hc]) f32 of one token's mixes f32 [(2+hc)*hc]
    (host.hc.hc_split, as oracle.ops.hc_pre applies it)."""
    m = np.asarray(mixes, np.float32).reshape(-1)
    pre, post, comb = hc_split(m, np.asarray(scale, np.float32), np.asarray(base, np.float32),
                               hc, iters, eps)
    return (np.ascontiguousarray(pre, np.float32), np.ascontiguousarray(post, np.float32),
            np.ascontiguousarray(comb, np.float32))


def head_rule(mixes, scale, base, eps: float):
    """pre f32 [hc] of the head's mixes f32 [hc] (host.hc.hc_head_weights)."""
    m = np.asarray(mixes, np.float32).reshape(-1)
    return np.ascontiguousarray(hc_head_weights(m, np.asarray(scale, np.float32),
                                                np.asarray(base, np.float32), eps), np.float32)


def route_rule(logits, k: int, route_scale: float, *, bias=None, tid2eid=None, token=None):
    """(ids int32 [k] in pick order, weights f32 [k]) of one token's router logits f32 [E]
    (host.routing.route: learned with ``bias`` f32 [E], or hash with ``tid2eid`` + ``token``)."""
    lg = np.asarray(logits, np.float32).reshape(1, -1)
    if bias is not None:
        idx, w, _ = route(lg, k=k, route_scale=route_scale, bias=np.asarray(bias, np.float32))
    else:
        idx, w, _ = route(lg, k=k, route_scale=route_scale, tid2eid=tid2eid,
                          token_ids=np.asarray([int(token)], np.int64))
    return np.ascontiguousarray(idx[0], np.int32), np.ascontiguousarray(w[0], np.float32)


def index_rule(scores_bits, n_valid: int, k: int, width: int):
    """int32 [width]: the top-min(k, n_valid) entries of scores (bf16 bits, the first n_valid
    columns read; host.indices.topk_desc, ties -> lower index), ascending, -1 padded: the
    selection the device step's build_cand consumes (indexer_fused_d128 writes it in index
    order)."""
    out = np.full(int(width), -1, np.int32)
    n = int(n_valid)
    if n <= 0:
        return out
    s = (np.asarray(scores_bits, np.uint16)[:n].astype(np.uint32) << 16).view(np.float32)
    sel = np.sort(topk_desc(s, min(int(k), n)))
    assert sel.size <= width, f"index_rule: {sel.size} picks > width {width}"
    out[:sel.size] = sel
    return out


def sel_width(index_topk: int, max_seq_len: int) -> int:
    """The CSA selection width of a decode step (gpu.step.step_ws_plan's idx.sel)."""
    return min(int(index_topk), max(1, int(max_seq_len) // 4))


def step_candidates(pos: int, window: int, ratio: int, K: int, sel=None) -> np.ndarray:
    """int32 [K]: the decode candidate list build_cand (kernels_cu/decode.cu) makes on the
    device, from the host rules: host.indices.window_ring_slots (ring rows of positions
    max(pos - W + 1, 0)..pos, chronological, -1 padded), then W + the visible compressed entries
    (HCA: host.indices.hca_entries; CSA: the selection ``sel``, -1 ignored) ascending, -1
    padded to K (host.indices.candidate_row)."""
    from memra_dsv4.host import indices as hidx
    W = int(window)
    win = hidx.window_ring_slots(int(pos), W)
    if not ratio or K <= W:
        return np.ascontiguousarray(win[:K], np.int32)
    comp = hidx.hca_entries(int(pos), int(ratio)) if sel is None else np.asarray(sel, np.int64)
    return hidx.candidate_row(win, comp, W, int(K) - W).astype(np.int32)


def verify_candidates(pos0: int, t: int, T: int, window: int, ratio: int, K: int, sel=None,
                      shadow_row: int = 0) -> np.ndarray:
    """int32 [K]: the candidates build_cand makes for row t of a T-row device verify at pos0
    (kernels_cu/decode.cu, multi-row form): step_candidates(pos0 + t, ...), except that a window
    position q < pos0 whose ring slot a later row j = q + W - pos0 (t < j < T) has replaced reads
    kv row shadow_row + q % W (the pre-verify ring copy) when shadow_row > 0."""
    W = int(window)
    c = step_candidates(int(pos0) + int(t), W, ratio, K, sel)
    if shadow_row > 0:
        p = int(pos0) + int(t)
        for j in range(min(W, int(K))):
            q = max(p - W + 1, 0) + j
            if q <= p and q < pos0 and q + W - pos0 < T:
                c[j] = int(shadow_row) + q % W
    return c


def pending_sources(p0: int, n_rows: int, ratio: int, rows_max: int) -> np.ndarray:
    """int32 [P] (P = the pending rows: 2r for ratio 4, else r): where each pending row comes
    from after a device verify's rows 0..n_rows-1 at positions p0.. fed the compressor, as rows
    of its journal buffer [the P pre-verify rows | rows_max staging rows (row j: the values row j
    fed in) | one fresh row (0, -inf)].  What the commit gathers (host and device forms):
    host.pending.advance_pending (the oracle's own state machine, the rule its rollback replays)
    run on row indices instead of values, so the gather equals restoring the pre-verify rows and
    replaying rows 0..n_rows-1, byte for byte (pure data movement)."""
    from memra_dsv4.host.pending import advance_pending
    r, n = int(ratio), int(n_rows)
    assert r >= 1 and 0 <= n <= int(rows_max), f"pending_sources: ratio {r}, {n} rows of {rows_max}"
    P = 2 * r if r == 4 else r
    # index "values": kv carries the source row, score marks the fresh rows (-inf)
    kv = np.arange(P, dtype=np.float64)[:, None]
    score = kv.copy()
    rows = np.arange(P, P + n, dtype=np.float64)[:, None]
    advance_pending(kv, score, rows, rows.copy(), int(p0), r)
    return np.where(np.isneginf(score[:, 0]), P + int(rows_max), kv[:, 0]).astype(np.int32)


# ------------------------------------------------------------------------- device side
class HostIO:
    """Device <-> host copies of the islands on ``stream`` through pinned buffers, one per key,
    made on first use.  ``read`` synchronises the stream (the host rule needs the bytes);
    ``write`` is asynchronous: its pinned buffer is only rewritten after a later ``read`` on the
    same stream has synchronised, so the copy has finished by then."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.buf: dict = {}

    def _pinned(self, key, shape, dtype):
        b = self.buf.get(key)
        if b is None or b.shape != tuple(shape) or b.dtype != np.dtype(dtype):
            import cupyx
            b = self.buf[key] = cupyx.empty_pinned(tuple(shape), dtype=dtype)
        return b

    def read(self, key, dev, n: int | None = None):
        """Host copy (a pinned view, valid until the next read of ``key``) of dev's first n
        elements (all when None); dev contiguous."""
        import cupy as cp
        rt = cp.cuda.runtime
        flat = dev.reshape(-1)
        n = flat.size if n is None else int(n)
        b = self._pinned(key, (flat.size,), flat.dtype)
        if n:
            rt.memcpyAsync(b.ctypes.data, flat.data.ptr, n * flat.itemsize,
                           rt.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()
        return b[:n]

    def write(self, key, dev, host) -> None:
        import cupy as cp
        rt = cp.cuda.runtime
        flat = dev.reshape(-1)
        h = np.asarray(host, dtype=flat.dtype).reshape(-1)
        assert h.size == flat.size, f"HostIO.write {key}: {h.size} values for {flat.size}"
        b = self._pinned(key, (flat.size,), flat.dtype)
        b[...] = h
        rt.memcpyAsync(flat.data.ptr, b.ctypes.data, flat.nbytes, rt.memcpyHostToDevice,
                       self.stream.ptr)


def hc_island(io, cfg, streams, fn, scale_h, base_h, norm_w, *, mixes, x, xn, pre, post, comb):
    """One sub-layer boundary with the split on the host: mixes = hc_mixes(streams) (device),
    (pre, post, comb) = hc_rule(mixes) (host, uploaded), x = hc_weighted_sum(pre, streams),
    xn = rmsnorm(x, norm_w).  streams [1, hc, D] bf16 bits; every output preallocated."""
    from memra_dsv4.gpu.ops import hc as HC
    from memra_dsv4.gpu.ops import rmsnorm as RN
    HC.hc_mixes(streams, fn, cfg.rms_norm_eps, out=mixes)
    m = io.read("hc.mix", mixes)
    p, q, c = hc_rule(m, scale_h, base_h, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    io.write("hc.pre", pre, p)
    io.write("hc.post", post, q)
    io.write("hc.comb", comb, c)
    HC.hc_weighted_sum(pre, streams, out=x)
    RN.rmsnorm(x, norm_w, cfg.rms_norm_eps, out=xn)


def head_island(io, cfg, streams, fn, scale_h, base_h, *, mixes, pre, y):
    """hc_head with the gate on the host: mixes = hc_mixes(streams, hc_head_fn) (device),
    pre = head_rule(mixes) (host, uploaded), y = hc_weighted_sum(pre, streams)."""
    from memra_dsv4.gpu.ops import hc as HC
    HC.hc_mixes(streams, fn, cfg.rms_norm_eps, out=mixes)
    m = io.read("head.mix", mixes)
    io.write("head.pre", pre, head_rule(m, scale_h, base_h, cfg.hc_eps))
    HC.hc_weighted_sum(pre, streams, out=y)


def router_island(io, cfg, xn, w_gate, *, logits, ids, weights, bias_h=None, tid2eid_h=None,
                  token=None):
    """Router logits on the device (ops.router.logits), selection + weights on the host
    (route_rule), ids int32 [1, k] / weights f32 [1, k] uploaded."""
    from memra_dsv4.gpu.ops import router as RT
    RT.logits(xn, w_gate, out=logits)
    lg = io.read("moe.logits", logits)
    i, w = route_rule(lg, cfg.num_experts_per_tok, cfg.routed_scaling_factor, bias=bias_h,
                      tid2eid=tid2eid_h, token=token)
    io.write("moe.ids", ids, i)
    io.write("moe.w", weights, w)


def indexer_island(io, cfg, q, w, keys, n_valid_dev, n_valid: int, *, scores, sel):
    """Indexer scores on the device (ops.indexer.scores 'simt', w_scale as the step's fused
    kernel takes it), the fine top-k on the host (index_rule), sel int32 [width] uploaded.
    ``n_valid`` = (pos + 1) // 4, the host's copy of n_valid_dev.  Returns the host selection."""
    from memra_dsv4.gpu.ops import indexer as IX
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    IX.scores(q, w, keys, n_valid_dev, out=scores, w_scale=dI ** -0.5 * nI ** -0.5, impl="simt")
    s = io.read("idx.scores", scores, min(int(n_valid), scores.size))
    h = index_rule(s, n_valid, cfg.index_topk, sel.size)
    io.write("idx.sel", sel, h)
    return h
