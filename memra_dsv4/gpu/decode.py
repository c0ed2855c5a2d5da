"""The host-driven ("legacy") GPU decode: a per-layer loop over the prefill ops for a chunk of
positions against a device ``DecodeState``: cuBLASLt GEMMs and small CuPy islands of ops_glue,
the device step's kernels (gpu.ops: hc, rmsnorm, attention, indexer, quant_sim) for everything
that scales with S x heads or S x hc x D, and the batched routed experts of gpu.ops.prefill_moe.
Activations between ops are float32 holding bf16 values, or bf16 bits where a kernel chain
consumes them; each kernel rounds where its CuPy twin stores, so the numeric class is bf16.

ONE routine, ``forward_chunk``, runs positions p0..p0+S-1 of a sequence, mirroring the oracle's
``memra_dsv4.oracle.decode._attention_chunk`` step for step (dsv4_attention.md 7.4):
* window vectors of earlier positions come from the ring (chronological), then the chunk's own;
* the chunk tokens go through the compressor state machine: the pending rows are prepended
  (current block's tokens; for ratio 4 the previous block's rows as the overlap half);
* an entry emitted inside the chunk is visible to chunk token t iff (k+1)*r <= t+1;
* candidate layout is the canonical one of ``host.indices.candidate_matrix`` (window W wide,
  chronological; compressed entries ascending at offset = rows before them);
* the ring / entries / pending rows are written after every read.
``Dsv4Gpu.forward(ids)`` = a chunk from p0 = 0 on a fresh state (captures, hc_state, phases
``prefill/...``); ``Dsv4Gpu.prefill(ids, state)`` = reset + a chunk from p0 = 0;
``Dsv4Gpu.decode_step`` = a chunk of one token (path ``legacy``).  ``run_chunk`` returns the
whole ``ForwardOut``; ``forward_chunk`` only its logits.

The one-token dispatch (``one_token=True``, passed by ``Dsv4Gpu.decode_step`` on ``legacy``
only: S == 1, no journal, no captures; prefills, prefill_chunk and verify are unchanged): every
block runs ``ChunkBlock.forward_one``, the device step's kernels with the device step's
arguments (GEMVs, fused FP4 expert GEMVs, hc_mixes / hc_weighted_sum / hc_post, norm_rope_sim,
compressor.emit, indexer scores, split sparse attention) and the four islands (hc split, router
selection, indexer fine top-k, head gate) on the host (gpu.hostmath), so that ``legacy`` and
``device-hostmath`` give the same bytes.  The positions, ring / pending rows and candidate list
are the host's (``hostmath.step_candidates``), not the device's.

Decode path seam (``MEMRA_DSV4_DECODE_PATH`` or the ``decode_path=`` argument; resolved once
per model by ``resolve_decode_path`` and printed on stderr): ``legacy`` (this module),
``device-hostmath`` / ``device`` (memra_dsv4.gpu.step / step_device).
"""

from __future__ import annotations

import sys

import numpy as np

# The kernel modules the chunk routine launches register their kernels at import: imported here
# so every name is registered before any module is built (no mid-run rebuild of a stem).
from memra_dsv4.gpu import ops_decode as DK
# ops_glue once here, not by an import statement in every per-layer method (no CuPy at import)
from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.gpu.ops._common import contiguous
from memra_dsv4.gpu.ops._common import cupy as _cupy
from memra_dsv4.gpu.ops import attention as AT
from memra_dsv4.gpu.ops import compressor as CM
from memra_dsv4.gpu.ops import experts as EX
from memra_dsv4.gpu.ops import hc as HC
from memra_dsv4.gpu.ops import indexer as IX
from memra_dsv4.gpu.ops import quant_sim as QS
from memra_dsv4.gpu.ops import rmsnorm as RN
from memra_dsv4.gpu.ops import router as RT  # noqa: F401  (registered before any build)
from memra_dsv4.host import indices as hidx
from memra_dsv4.host.pending import closing_blocks
from memra_dsv4.profiling import phase

__all__ = ["DECODE_PATHS", "resolve_decode_path", "forward_chunk", "run_chunk", "ChunkBlock",
           "one_token_dispatch"]

DECODE_PATHS = ("legacy", "device-hostmath", "device")
_GRID_Y_ROWS = 32768   # rows per launch of kernels that index rows by blockIdx.y (<= 65535)


def resolve_decode_path(explicit: str | None = None, *, announce: bool = True) -> str:
    from memra_dsv4 import seams
    path = seams.resolve(seams.SEAM_DECODE_PATH, explicit)
    if announce:
        src = "argument" if explicit is not None else (
            f"env {seams.SEAM_DECODE_PATH.env}" if seams.env_value(seams.SEAM_DECODE_PATH)
            != seams.SEAM_DECODE_PATH.default or _env_set() else "default")
        print(f"memra_dsv4: gpu decode path = {path} ({src})", file=sys.stderr)
    return path


def one_token_dispatch(S: int, journal=None, capture: bool = False,
                       one_token: bool = False) -> bool:
    """Whether run_chunk takes the one-token dispatch (ChunkBlock.forward_one): asked for
    (``one_token``, by decode_step on ``legacy``) on a chunk of one token without a journal or
    captures.  Asked for on anything else is refused (ValueError)."""
    if not one_token:
        return False
    if S != 1 or journal is not None or capture:
        raise ValueError(f"one_token dispatch: needs S == 1, no journal, no capture (got S = {S}, "
                         f"journal {journal is not None}, capture {bool(capture)})")
    return True


def _env_set() -> bool:
    import os
    from memra_dsv4 import seams
    return os.environ.get(seams.SEAM_DECODE_PATH.env, "") != ""


def _cp():
    return _cupy()   # sys.modules' cupy: no import statement per call (~0.4 us)


def _f64(u16):
    """model._f64, imported when called (only the unfused reference chains use it)."""
    from memra_dsv4.gpu.model import _f64 as f64
    return f64(u16)


class ChunkBlock:
    """One trunk block over a chunk at positions p0.. against the layer's cache.  Reuses the
    prefill block's helpers (linear, hc_pre, rope tables, MoE) of memra_dsv4.gpu.model._Block.

    ``fused`` (class attribute, default True): the attention sub-layer's host-lean form, the
    same bits as the CuPy chains it replaces (False runs those chains; tests compare the two in
    one process): the norms (+ RoPE) as ops_glue.rmsnorm_rope_bits, the KV / compressed-entry
    FP8 and FP4 simulations as quant_sim.cu's in-place kernels on the bf16 bits, the pooling as
    compressor.cu's pool kernels (the chain's double routine in its candidate order), ape as
    compress_add_ape, attention's input as the bf16 bits (every GEMM rounds f32 inputs to those
    same bits), and the chunk's index arrays made once per chunk (Dsv4Gpu.chunk_memo).  Wherever
    the next op rounds to bf16 bits anyway, the fused form hands it the bits (or the unrounded
    f32 to a kernel that rounds on load) instead of an f32 copy (attention's doc lists them);
    the streams pass between layers as bits (``forward``'s ``bits_out``)."""

    fused = True

    def __init__(self, model, st, layer: int, ph: str) -> None:
        from memra_dsv4.gpu.model import _Block
        self.b = _Block(model, st, layer, ph)
        self.cfg = model.config
        self.ph = ph
        self.attn_kernel = getattr(model, "prefill_attn", "mma")   # seam MEMRA_DSV4_PREFILL_ATTN
        self.ratio = self.b.ratio
        self.kind = self.b.kind

    # ------------------------------------------------------------------------ block
    def forward(self, streams, ids_d, cache, p0: int, cap=None, journal=None, *,
                bits_out: bool = False):
        """streams [S, hc, D] float32 (bf16-valued), or their bf16 bits (uint16) -> the block's
        output streams: float32 (bf16-valued), or with ``bits_out`` their bf16 bits (uint16;
        stage_steps hands them on to the next layer as they are: to_f32 there and bf16_bits
        here would give back the same bits, two conversion launches per layer for nothing).
        Inside, the streams travel as bf16 bits through the hc kernels (kernels_cu/hc.cu, the
        device step's: hc_pre = mixes + Sinkhorn split + weighted sum, hc_post) and the norms
        through rmsnorm.cu: one pass each instead of the float64 CuPy islands of ops_glue."""
        b, cfg = self.b, self.cfg
        eps = cfg.rms_norm_eps
        # exact: the streams are bf16-valued (bits already when the previous layer handed bits)
        sb = streams if streams.dtype == _cp().uint16 else G.bf16_bits(streams)
        with phase(f"{self.ph}/attn"):
            x, post, comb = self._hc_pre(sb, "attn")
            xn = RN.rmsnorm(x, b.w("attn_norm.weight"), eps)
            # fused: the GEMMs take the bits as they are (f32 -> bf16 of a bf16 value is exact),
            # and attention returns its output's bits (the fused path's own bf16_bits)
            a = self.attention(xn if self.fused else G.to_f32(xn), cache, p0, cap, journal)
            s1 = HC.hc_post(a if self.fused else G.bf16_bits(a), sb, post, comb)
        if cap is not None:
            cap.update({"hc_attn.x": G.to_f32(x), "hc_attn.post": post, "hc_attn.comb": comb,
                        "attn_norm": G.to_f32(xn), "attn.streams": G.to_f32(s1)})
        with phase(f"{self.ph}/ffn"):
            x, post, comb = self._hc_pre(s1, "ffn")
            xn = RN.rmsnorm(x, b.w("ffn_norm.weight"), eps)
            # fused: the shared / router GEMMs take xn's bits (= bf16_bits(to_f32(xn)), exact);
            # the routed experts gather the f32 rows
            f = b.moe(G.to_f32(xn), ids_d, cap, xb=xn if self.fused else None)
            s2b = HC.hc_post(G.bf16_bits(f), s1, post, comb)
        s2 = None if bits_out and cap is None else G.to_f32(s2b)
        if cap is not None:
            cap.update({"hc_ffn.x": G.to_f32(x), "hc_ffn.post": post, "hc_ffn.comb": comb,
                        "ffn_norm": G.to_f32(xn), "block.out": s2})
        return s2b if bits_out else s2

    def _hc_pre(self, sb, sub: str):
        """(x [S, D] bf16 bits, post [S, hc] f32, comb [S, hc, hc] f32) of the bf16 streams
        ``sb`` (ops.hc.hc_pre; n_split=1: no shared split workspace, T is large or this is the
        legacy decode, where a few CTAs are enough)."""
        cp = _cp()
        b, cfg = self.b, self.cfg
        fn = b.w(f"hc_{sub}_fn")
        if self.fused:   # the weight's 2-D f32 view, made once per model (3 CuPy calls a pass)
            views = b.m.__dict__.setdefault("_hc_fn_2d", {})
            hit = views.get(id(fn))
            if hit is None or hit[0] is not fn:   # keyed by the very array (kept alive here)
                hit = views[id(fn)] = (fn, contiguous(fn.astype(cp.float32, copy=False)
                                                      .reshape(fn.shape[0], -1)))
            fn = hit[1]
        else:
            fn = contiguous(fn.astype(cp.float32).reshape(fn.shape[0], -1))
        return HC.hc_pre(sb, fn, b.w(f"hc_{sub}_scale"), b.w(f"hc_{sub}_base"),
                         iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                         norm_eps=cfg.rms_norm_eps, n_split=1)

    # ------------------------------------------------------------- one-token dispatch
    def forward_one(self, streams, cache, p0: int, L, io, token: int):
        """The block for one token at p0 with the device step's kernels and host islands
        (module doc); streams [1, hc, D] f32 (bf16-valued) -> same form.  ``L``: the layer's
        step_device.stage_views entry; ``io``: hostmath.HostIO on the current stream.  The op
        order is DeviceStep._block's; hc_post runs alone (the step's hostmath branch does the
        same instead of its fused boundary)."""
        cp = _cp()
        cfg = self.cfg
        D, hc = cfg.hidden_size, cfg.hc_mult
        sb = cp.ascontiguousarray(G.bf16_bits(streams)).reshape(1, hc, D)
        pos_d = cp.asarray(np.array([p0], dtype=np.int32))
        t = {"mixes": cp.empty((1, cfg.hc_mix_rows), cp.float32),
             "pre": cp.empty((1, hc), cp.float32), "post": cp.empty((1, hc), cp.float32),
             "comb": cp.empty((1, hc, hc), cp.float32), "x": cp.empty((1, D), cp.uint16),
             "xn": cp.empty((1, D), cp.uint16)}
        with phase(f"{self.ph}/attn"):
            self._hc_one(io, L, sb, "attn", t)
            a = self._attention_one(t["xn"], cache, p0, pos_d, L, io)
            s1 = HC.hc_post(a.reshape(1, D), sb, t["post"], t["comb"])
        with phase(f"{self.ph}/ffn"):
            self._hc_one(io, L, s1, "ffn", t)
            f = self._moe_one(t["xn"], L, io, token)
            s2 = HC.hc_post(f.reshape(1, D), s1, t["post"], t["comb"])
        return G.to_f32(s2)

    def _hc_one(self, io, L, sb, sub: str, t) -> None:
        from memra_dsv4.gpu import hostmath as HM
        HM.hc_island(io, self.cfg, sb, L.f32[f"hc_{sub}_fn"], L.host[f"hc_{sub}_scale"],
                     L.host[f"hc_{sub}_base"], L.w(f"{sub}_norm.weight"), mixes=t["mixes"],
                     x=t["x"], xn=t["xn"], pre=t["pre"], post=t["post"], comb=t["comb"])

    @staticmethod
    def _gemv(L, pre: str, x, out, **kw):
        w, sc = L.lin(pre)
        return DK.gemv_bf16(w, x, out, scale=sc, **kw)

    def _pending_one(self, xn, pend, sub: str, p0: int, L) -> None:
        """This token's pending row of a compressor, host-indexed: row (p0 % r) [+ r for the
        ratio-4 overlap layout] = (wkv . xn, f32(wgate . xn + ape[p0 % r])): the GemvTable
        epilogue's values, per projection (a row's GEMV order depends on K only, §9.1)."""
        cp = _cp()
        r = pend.ratio
        C = pend.kv.shape[1]
        a, z = cp.empty(C, cp.float32), cp.empty(C, cp.float32)
        self._gemv(L, f"{sub}.wkv", xn, a)
        self._gemv(L, f"{sub}.wgate", xn, z)
        z += L.w(f"{sub}.ape")[p0 % r]
        row = pend.cur_offset + p0 % r
        pend.kv[row] = a
        pend.score[row] = z

    def _emit_one(self, pend, dst, pos_d, L, indexer: bool) -> None:
        sub = "attn.indexer.compressor" if indexer else "attn.compressor"
        CM.emit(pos_d, pend.kv, pend.score, pend.ratio, pend.overlap, L.f32[f"{sub}.norm.weight"],
                self.cfg.rms_norm_eps, L.cos, L.sin, "hadfp4" if indexer else "fp8", dst)

    def _attention_one(self, xn, cache, p0: int, pos_d, L, io):
        cp = _cp()
        from memra_dsv4.gpu import hostmath as HM
        cfg = self.cfg
        eps, W = cfg.rms_norm_eps, cfg.sliding_window
        H, hd = cfg.num_attention_heads, cfg.head_dim
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        u16 = cp.uint16
        ap = f"{self.ph}/attn"
        with phase(f"{ap}/projections"):   # the rows of the step's gemv_bf16_multi table
            qr = cp.empty((1, cfg.q_lora_rank), u16)
            kvraw = cp.empty((1, hd), u16)
            self._gemv(L, "attn.wq_a", xn, qr)
            self._gemv(L, "attn.wkv", xn, kvraw)
            if self.ratio:
                self._pending_one(xn, cache.comp_state, "attn.compressor", p0, L)
            if self.kind == "csa":
                self._pending_one(xn, cache.idx_state, "attn.indexer.compressor", p0, L)
                wI = cp.empty((1, nI), u16)
                self._gemv(L, "attn.indexer.weights_proj", xn, wI)
        with phase(f"{ap}/q"):
            RN.rmsnorm(qr, L.w("attn.q_norm.weight"), eps, out=qr)
            q = cp.empty((1, H, hd), u16)
            self._gemv(L, "attn.wq_b", qr, q)
            RN.head_rms(q, eps, out=q, rope=(pos_d, L.cos, L.sin))
        with phase(f"{ap}/kv"):            # the ring row by the host's index
            kv = CM.norm_rope_sim(kvraw, L.f32["attn.kv_norm.weight"], eps, L.cos, L.sin, pos_d,
                                  "fp8")
            cache.ring[p0 % W] = kv[0]
        sel_h, K = None, W
        if self.ratio:
            if self.kind == "csa":
                with phase(f"{ap}/indexer"):
                    self._emit_one(cache.idx_state, cache.idx_keys, pos_d, L, indexer=True)
                    qI = cp.empty((1, nI, dI), u16)
                    self._gemv(L, "attn.indexer.wq_b", qr, qI)
                    QS.rope_hadamard128_fp4(qI, pos_d, L.cos, L.sin, out=qI)
                    N = cache.idx_keys.shape[0]
                    nv = (p0 + 1) // 4
                    sel = cp.empty(min(cfg.index_topk, N), cp.int32)
                    sel_h = HM.indexer_island(io, cfg, qI, wI, cache.idx_keys,
                                              cp.asarray(np.array([nv], np.int32)), nv,
                                              scores=cp.empty((1, N), u16), sel=sel)
                K = W + sel_h.size
            else:
                K = W + cache.comp.shape[0]
            with phase(f"{ap}/compressor"):
                self._emit_one(cache.comp_state, cache.comp, pos_d, L, indexer=False)
        with phase(f"{ap}/sparse_attention"):  # the step's "split" form, host candidates
            cand = cp.asarray(HM.step_candidates(p0, W, self.ratio, K, sel_h)).reshape(1, K)
            o = AT.sparse_attention(q, cache.kv, cand, L.w("attn.attn_sink"), hd ** -0.5,
                                    n_split=None, inverse_rope=(pos_d, L.cos, L.sin))
        with phase(f"{ap}/output"):
            u = cp.empty(cfg.o_groups * cfg.o_lora_rank, u16)
            self._gemv(L, "attn.wo_a", o, u, groups=cfg.o_groups)
            out = cp.empty(cfg.hidden_size, u16)
            self._gemv(L, "attn.wo_b", u, out)
        return out

    def _moe_one(self, xn, L, io, token: int):
        cp = _cp()
        from memra_dsv4.gpu import hostmath as HM
        cfg = self.cfg
        D, I, E, k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                      cfg.num_experts_per_tok)
        mp = f"{self.ph}/ffn/moe"
        ids, wts = cp.empty((1, k), cp.int32), cp.empty((1, k), cp.float32)
        with phase(f"{mp}/router"):
            HM.router_island(io, cfg, xn, L.w("ffn.gate.weight"),
                             logits=cp.empty((1, E), cp.float32), ids=ids, weights=wts,
                             bias_h=L.host.get("bias"), tid2eid_h=L.host.get("tid2eid"),
                             token=token)
        h = cp.empty((k, I), cp.uint16)
        with phase(f"{mp}/experts"):
            EX.gemv_fp4_gateup(L.fmt, xn, ids.reshape(k), L.wp["w1"], L.sp["w1"], L.wp["w3"],
                               L.sp["w3"], I, D, weight=wts.reshape(k), limit=cfg.swiglu_limit,
                               out=h, x_div=k, ws2_1=L.ws2["w1"], ws2_3=L.ws2["w3"])
        sh, shared = cp.empty(I, cp.uint16), cp.empty((1, D), cp.uint16)
        with phase(f"{mp}/shared"):
            (w1, s1), (w3, s3) = L.lin("ffn.shared_experts.w1"), L.lin("ffn.shared_experts.w3")
            DK.gemv_bf16_swiglu(w1, w3, xn, sh, cfg.swiglu_limit, scale1=s1, scale3=s3)
            self._gemv(L, "ffn.shared_experts.w2", sh, shared)
        out = cp.empty((1, D), cp.uint16)
        with phase(f"{mp}/combine"):
            EX.gemv_fp4_down_combine(L.fmt, h, ids, L.wp["w2"], L.sp["w2"], D, I, shared=shared,
                                     out=out, ws2=L.ws2["w2"])
        return out

    # --------------------------------------------------------------------- compressor
    def compress_chunk(self, x, cs, p0: int, indexer: bool):
        """(entries [nb, d] as bf16 bits (uint16), a, z) for positions p0..p0+S-1 given the
        pending rows ``cs`` (not modified); the twin of oracle.model._Layer.compress.  The
        entries are bits because every consumer wants bits (the caches, the attention rows, the
        indexer keys): the fused path's kernels make them, and to_f32 + bf16_bits would give
        the same bits back."""
        cp = _cp()
        b, cfg = self.b, self.cfg
        sub = "attn.indexer.compressor" if indexer else "attn.compressor"
        r = cs.ratio
        S = x.shape[0]
        a = b.lin(x, f"{sub}.wkv.weight", "f32")
        zg = b.lin(x, f"{sub}.wgate.weight", "f32")
        if self.fused:   # z = f32(zg + ape[pos % r]) in place: compress_add_ape's one f32 add
            pos_d = b.m.chunk_memo(("pos32", p0, S),
                                   lambda: cp.arange(p0, p0 + S, dtype=cp.int32))
            z = CM.add_ape(zg, b.w(f"{sub}.ape"), pos_d)
        else:
            pos = cp.arange(p0, p0 + S, dtype=cp.int64)
            z = (zg + b.w(f"{sub}.ape")[pos % r]).astype(cp.float32)
        if self.fused and p0 % r == 0:   # no pending token: closing_blocks' rows are a / z's own
            nb, b0 = S // r, p0
            A, Z = a[:nb * r], z[:nb * r]   # read only below (the pool kernels), like its copies
        else:
            A, Z, nb, b0 = closing_blocks(cs.kv, cs.score, a, z, p0, r)
        d = cfg.index_head_dim if indexer else cfg.head_dim
        if nb == 0:
            return cp.zeros((0, d), dtype=cp.uint16), a, z
        cos, sin = b.rope_range(b0, nb, r)   # the entries' positions b0 + r * k
        if self.fused:
            return self._entries_fused(A, Z, nb, cs, sub, cos, sin, indexer), a, z
        if cs.overlap:
            pa, pz = cs.prev_rows()
            ac, zc = candidates_with_prev(A, Z, pa, pz)
        else:
            ac, zc = G.compress_candidates(A, Z, r)
        pooled = G.compress_pool(ac, zc)
        c = G.rmsnorm(G.store(pooled), _f64(b.w(f"{sub}.norm.weight")), cfg.rms_norm_eps)
        c = G.rope(c, cos, sin)
        if indexer:   # the reference chain: f32, then its (exact) bits
            return G.bf16_bits(G.fp4_sim(G.hadamard(c), 32)), a, z
        return G.bf16_bits(G.kv_sim(c, cfg.qk_rope_head_dim)), a, z

    def _entries_fused(self, A, Z, nb: int, cs, sub: str, cos, sin, indexer: bool):
        """compress_chunk's entries (bf16 bits [nb, d]) from the closing rows A / Z, the
        same bits as the chain (candidates + ops_glue.compress_pool, store, rmsnorm, rope, then
        kv_sim or hadamard + fp4_sim): the pool kernels run the chain's double routine over the
        same candidates in the same order (block 0's predecessor = the pending rows 0..r-1, as
        candidates_with_prev); rmsnorm_rope_bits; quant_sim.cu's block simulations on the bits
        (every step exact or one RNE: the chain's values on bf16-valued inputs).  The Hadamard
        stays ops_glue.hadamard (a float64 cupy.matmul: its order is cuBLAS's)."""
        b, cfg = self.b, self.cfg
        if cs.overlap:
            pa, pz = cs.prev_rows()
            pooled = CM.pool_overlap(A, Z, nb, prev_kv=pa, prev_score=pz)
        else:
            pooled = CM.pool_plain(A, Z, cs.ratio, nb)
        cb = G.rmsnorm_rope_bits(pooled, b.w(f"{sub}.norm.weight"), cfg.rms_norm_eps, cos, sin,
                                 pre_store=True)
        if indexer:   # hadamard's bits straight (bf16_bits(store(y)) = bf16_bits(y))
            return QS.fp4_sim(G.hadamard(G.to_f32(cb), bits=True))
        return QS.kv_fp8_sim(cb, cfg.qk_rope_head_dim)

    # ---------------------------------------------------------------------- attention
    def attention(self, x, cache, p0: int, cap, journal=None):
        """The per-head tensors ([S, H, hd]: 1 GiB of f32 at S = 8192 on full Flash) stay bf16
        bits and go through the device step's fused kernels: q = head_rms + RoPE
        (rmsnorm.cu), the sparse attention with the inverse RoPE in its epilogue
        (attention.cu), the indexer's RoPE + Hadamard + FP4 simulation, scores and top-k
        (quant_sim.cu, indexer.cu).  Same roundings as the CuPy twins of ops_glue; the
        attention and index-score dots accumulate in f32 in the kernels' order (bf16 class).

        Returns the sub-layer's output [S, D]: its bf16 bits on the fused path (what hc_post
        takes), float32 (bf16-valued) on the reference chains (``fused`` False).  The fused
        path hands every kernel the bytes the chains' form did, with fewer host operations:
        the q / kv projections reach rmsnorm_rope_bits unrounded with ``pre_store`` (its
        kernels round on load with the RNE the stored linear's launch would apply); q_a's
        normed output stays bits for the q and indexer GEMMs (which take bits as they are);
        the attended rows are concatenated in the bits they are kept in (ring slices, the
        chunk's simulated kv, the cached and the new compressed entries) instead of f32 copies
        rounded back; the wo_a groups are read from one transposed copy and their unrounded
        outputs rounded to bits once (bf16_bits(store(y)) = bf16_bits(y)); the ring is read and
        written as slices (at most two each) instead of index arrays; a layer without an
        indexer takes the chunk's candidate matrix made once per chunk."""
        cp = _cp()
        b, cfg = self.b, self.cfg
        S = x.shape[0]
        W = cfg.sliding_window
        H, hd = cfg.num_attention_heads, cfg.head_dim
        fused = self.fused
        memo = b.m.chunk_memo
        pos = p0 + np.arange(S, dtype=np.int64)
        cos, sin = b.rope_range(p0, S)
        # kernels: row t of cos / sin is position p0 + t
        ridx = memo(("ridx", S), lambda: cp.arange(S, dtype=cp.int32)) if fused else \
            cp.arange(S, dtype=cp.int32)
        with phase(f"{self.ph}/attn/q"):
            qr, qb = self.q_path(x, ridx, cos, sin)
        with phase(f"{self.ph}/attn/kv"):
            kvb, kv = self.kv_path(x, cos, sin)
        h0 = max(0, p0 - W)
        if fused:   # bits rows: the ring's history rows as slices (chronological), the chunk's
            rows = _ring_views(cache.ring, h0, p0 - h0, W) + [kvb]
        else:
            hist = G.to_f32(cache.ring[cp.asarray(np.arange(h0, p0, dtype=np.int64) % W)])
            rows = [hist, kv]

        def window_rows():   # window positions as rows of hist ++ kv (the chunk's layers share it)
            w = hidx.window_matrix(S, W, start=p0)
            return cp.asarray(np.where(w >= 0, w - h0, -1).astype(np.int32))
        win = b.m.chunk_memo(("window", S, W, p0), window_rows)
        offset = (p0 - h0) + S
        comp_sel = new_ent = new_keys = az = idx_az = None
        if self.ratio:
            if self.kind == "csa":
                with phase(f"{self.ph}/attn/indexer"):
                    comp_sel, new_keys, idx_az = self.indexer(x, qr, cos, sin, ridx, cache, p0,
                                                              pos, cap)
            else:
                comp_sel = b.m.chunk_memo(("hca", S, self.ratio, p0),
                                          lambda: cp.asarray(hidx.hca_matrix(S, self.ratio, start=p0)))
            with phase(f"{self.ph}/attn/compressor"):
                new_ent, ca, cz = self.compress_chunk(x, cache.comp_state, p0, indexer=False)
            az = (ca, cz)
            cached = cache.comp[:p0 // self.ratio]
            rows += [cached, new_ent] if fused else [G.to_f32(cached), G.to_f32(new_ent)]
            if cap is not None:   # every entry visible to the chunk (cached ++ new)
                cap["attn.comp"] = G.to_f32(cp.concatenate([cached, new_ent], axis=0))

        # comp_sel rows ascending, -1 padded at the end (the indexer's order="index" top-k, or
        # hidx.hca_matrix): the candidates without the sort, the same values
        def cand_matrix():
            return contiguous(G.candidates(win, comp_sel, offset, ascending=True), dtype=cp.int32)
        if fused and self.kind != "csa":   # no indexer: every such layer of the chunk has it
            cand = memo(("cand", S, W, p0, self.ratio), cand_matrix)
        else:
            cand = cand_matrix()
        with phase(f"{self.ph}/attn/sparse_attention"):
            if fused:   # the stored bits themselves (empty pieces dropped: nothing to copy)
                rows = [r for r in rows if r.shape[0]]
                kv_rows = rows[0] if len(rows) == 1 else cp.concatenate(rows, axis=0)
            else:
                kv_rows = G.bf16_bits(cp.concatenate(rows, axis=0))
            # long chunks: the tensor-core kernel (another fixed f32 dot order, same bf16-class
            # bound); short ones (verify drafts) keep the SIMT kernel of the device step
            sa_args = (qb, kv_rows, cand,
                       contiguous(b.w("attn.attn_sink"), dtype=cp.float32), hd ** -0.5)
            if self.attn_kernel == "mma" and AT.mma_supported(S, H, hd):
                ob = AT.sparse_attention_mma(*sa_args, inverse_rope=(ridx, cos, sin))
            else:
                ob = AT.sparse_attention(*sa_args, n_split=None, inverse_rope=(ridx, cos, sin))
        with phase(f"{self.ph}/attn/output"):
            out = self.out_proj(ob)
        if cap is not None:
            cap.update({"attn.qr": G.to_f32(qr) if fused else qr, "attn.q": G.to_f32(qb),
                        "attn.kv": G.to_f32(kvb) if fused else kv, "attn.cand": cand,
                        "attn.o": G.to_f32(ob), "attn.out": G.to_f32(out) if fused else out})
        # ---- writes, after every read
        if kvb is None:
            kvb = G.bf16_bits(kv)   # the fused path has them: kv = to_f32(kvb), exactly
        if journal is not None:   # a verify: what commit needs to roll the writes back
            journal.record(cache, pos, kvb, az, idx_az if self.kind == "csa" else None)
        m = min(S, W)   # the last m positions' rows: ring rows (p0 + S - m + i) % W
        if fused:       # as slices of the ring (the same rows as the index array below)
            at = S - m
            for dst in _ring_views(cache.ring, p0 + S - m, m, W):
                dst[...] = kvb[at:at + dst.shape[0]]
                at += dst.shape[0]
        else:
            cache.ring[cp.asarray(pos[-m:] % W)] = kvb[-m:]
        if self.ratio:
            n0 = p0 // self.ratio
            if new_ent.shape[0]:
                cache.comp[n0:n0 + new_ent.shape[0]] = new_ent
            cache.comp_state.advance(*az, p0)
        if self.kind == "csa":
            n0 = p0 // 4
            if new_keys.shape[0]:
                cache.idx_keys[n0:n0 + new_keys.shape[0]] = new_keys
            cache.idx_state.advance(*idx_az, p0)
        return out

    # ------------------------------------------------------- attention's projections
    # attention's q / kv / output pieces, shared with the DSpark drafter's block
    # (gpu.dspark.DSparkBlock: the same projections around another candidate set)
    def q_path(self, x, ridx, cos, sin):
        """(qr, q bits [S, H, hd]) of the normed input x: qr = q_norm(wq_a x) (bf16 bits fused,
        f32 on the reference chains), q = RoPE(head_rms(wq_b qr)) (oracle _Layer.q_path)."""
        b, cfg = self.b, self.cfg
        eps = cfg.rms_norm_eps
        S = x.shape[0]
        if self.fused:   # qr: bf16 bits (every GEMM below rounds an f32 input to these bits)
            qr = G.rmsnorm_rope_bits(b.lin(x, "attn.wq_a.weight", "f32"),
                                     b.w("attn.q_norm.weight"), eps, pre_store=True)
        else:
            qr = G.rmsnorm(b.lin(x, "attn.wq_a.weight"), _f64(b.w("attn.q_norm.weight")), eps)
        qb = G.bf16_bits(b.lin(qr, "attn.wq_b.weight", "f32")).reshape(
            S, cfg.num_attention_heads, cfg.head_dim)
        RN.head_rms(qb, eps, out=qb, rope=(ridx, cos, sin))
        return qr, qb

    def kv_path(self, x, cos, sin):
        """(kv bits [S, hd] or None, kv f32 or None): the window vectors FP8sim(RoPE(
        kv_norm(wkv x))) (oracle _Layer.kv_path); fused: the bits (norm + RoPE in one chain, the
        FP8 simulation in place), the reference chains: the f32 form."""
        b, cfg = self.b, self.cfg
        eps = cfg.rms_norm_eps
        if self.fused:
            kvb = G.rmsnorm_rope_bits(b.lin(x, "attn.wkv.weight", "f32"),
                                      b.w("attn.kv_norm.weight"), eps, cos, sin, pre_store=True)
            return QS.kv_fp8_sim(kvb, cfg.qk_rope_head_dim), None
        kv = G.rmsnorm(b.lin(x, "attn.wkv.weight"), _f64(b.w("attn.kv_norm.weight")), eps)
        return None, G.kv_sim(G.rope(kv, cos, sin), cfg.qk_rope_head_dim)

    def out_proj(self, ob):
        """The sub-layer's output of the attended rows' bits ob [S, H, hd] (inverse RoPE already
        applied by the attention kernel): grouped wo_a, then wo_b (oracle _Layer.out_proj);
        bf16 bits fused, f32 (bf16-valued) on the reference chains."""
        cp = _cp()
        b, cfg = self.b, self.cfg
        S = ob.shape[0]
        Gn = cfg.o_groups
        wa = b.w_bf16("attn.wo_a.weight")   # FP8-stored: the scratch, used right here
        R = wa.shape[0] // Gn
        if self.fused:
            # one transposed copy [Gn, S, H*hd/Gn]: og[g] holds the bytes of
            # ascontiguousarray(ob[:, g]) (bf16 bits, which the GEMMs take as they are);
            # the group outputs unrounded, rounded to bits once: bf16_bits(concat(y_g)) =
            # concat(bf16_bits(store(y_g))), the bits wo_b's GEMM took of the stored u
            og = cp.ascontiguousarray(ob.reshape(S, Gn, -1).transpose(1, 0, 2))
            u = G.bf16_bits(cp.concatenate([G.linear(b.g, og[g], wa[g * R:(g + 1) * R], "f32")
                                            for g in range(Gn)], axis=1))
            return G.bf16_bits(b.lin(u, "attn.wo_b.weight", "f32"))   # = bits(stored out)
        og = ob.reshape(S, Gn, -1)   # bf16 bits: the GEMMs take them as they are
        u = cp.concatenate([G.linear(b.g, cp.ascontiguousarray(og[:, g]),
                                     wa[g * R:(g + 1) * R]) for g in range(Gn)], axis=1)
        return b.lin(u, "attn.wo_b.weight")

    def indexer(self, x, qr, cos, sin, ridx, cache, p0: int, pos, cap):
        """(selection [S, w] int32 entry ids, the chunk's new keys (bf16 bits), (a, z) of the
        indexer compressor); ``qr``: q_a's normed output, bf16 bits (fused) or f32; scores over (cached keys ++ new keys) with the device step's kernels:
        q = fp4_sim(hadamard(rope(.))) (quant_sim.cu), scores (indexer.cu: 'simt', the decode's
        dot order, or 'mma' for chunks >= 64 tokens under prefill_attn = "mma") and top-k (the
        top by score, ties -> lower index, written in ascending index order, -1 padded: the
        candidates' order; the capture ``attn.index.sel`` keeps the score order)."""
        cp = _cp()
        b, cfg = self.b, self.cfg
        S = x.shape[0]
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        assert dI == 128, f"indexer: head dim {dI}; the kernels are written for 128"
        new_keys, ia, iz = self.compress_chunk(x, cache.idx_state, p0, indexer=True)   # bits
        n_cached = p0 // 4   # no cached key (the first chunk): the new keys are all of them
        keys = new_keys if n_cached == 0 else \
            cp.concatenate([cache.idx_keys[:n_cached], new_keys], axis=0)
        qI = G.bf16_bits(b.lin(qr, "attn.indexer.wq_b.weight", "f32")).reshape(S, nI, dI)
        QS.rope_hadamard128_fp4(qI, ridx, cos, sin, out=qI)
        wts = b.lin(x, "attn.indexer.weights_proj.weight")
        # the stored product's bits (w_scale 1 below): bf16_bits(store(v)) = bf16_bits(v)
        wb = G.bf16_bits(wts * cp.float32(dI ** -0.5 * nI ** -0.5))
        n = keys.shape[0]
        if cap is not None:
            cap.update({"attn.index.q": G.to_f32(qI), "attn.index.weights": G.to_f32(wb),
                        "attn.index.keys": G.to_f32(keys)})
        if n == 0:  # no complete block yet: nothing to select
            sel = cp.full((S, 0), -1, dtype=cp.int32)
            if cap is not None:
                cap.update({"attn.index.scores": cp.zeros((S, 0), cp.float32),
                            "attn.index.sel": sel})
            return sel, new_keys, (ia, iz)
        def valid_rows():
            return cp.asarray(((pos + 1) // 4).astype(np.int32))
        n_valid = b.m.chunk_memo(("nvalid4", p0, S), valid_rows) if self.fused else valid_rows()
        # The selection reads columns < n_valid[t] only; a capture holds every column, as the
        # oracle's scores do (the valid columns are the same bits either way).
        n_cols = n_valid if cap is None else cp.full((S,), n, dtype=cp.int32)
        # the seam MEMRA_DSV4_PREFILL_ATTN: "mma" puts the q.K dots of chunks >= MMA_MIN_T on
        # tensor cores too (products exact, another f32 order: a near-tie choice may differ
        # from the decode's "simt" scores, as the attention's sums do)
        impl = "mma" if self.attn_kernel == "mma" and S >= AT.MMA_MIN_T else "simt"
        scores = cp.empty((S, n), dtype=cp.uint16)
        for s0 in range(0, S, _GRID_Y_ROWS):   # the scores kernel puts the rows on grid.y
            r = slice(s0, min(S, s0 + _GRID_Y_ROWS))
            IX.scores(qI[r], wb[r], keys, n_cols[r], out=scores[r], impl=impl)
        # ascending index order, -1 padded: the canonical compressed segment of the candidate
        # matrix as it is (G.candidates(ascending=True): no sort, no host synchronisation); the
        # same set as the score-order selection (one selection code, indexer_topk)
        sel = IX.topk(scores, n_valid, cfg.index_topk, order="index")
        if cap is not None:   # the capture keeps the oracle's score order
            cap.update({"attn.index.scores": G.to_f32(scores),
                        "attn.index.sel": IX.topk(scores, n_valid, cfg.index_topk)})
        return sel, new_keys, (ia, iz)


def _ring_views(ring, t0: int, n: int, W: int) -> list:
    """The ring rows of positions t0..t0+n-1 (0 <= n <= W), chronological, as at most two slices
    of ``ring`` (row t % W): the rows ring[(t0 + arange(n)) % W] selects, without an index array
    (a gather / scatter launch each, and their host cost)."""
    if n <= 0:
        return []
    s = t0 % W
    first = min(n, W - s)
    views = [ring[s:s + first]]
    if n > first:
        views.append(ring[:n - first])
    return views


def candidates_with_prev(A, Z, prev_a, prev_z):
    """ops.compress_candidates for ratio 4 with the previous block's pending rows [4, 2d]
    as block 0's predecessor (oracle ops.compress_candidates(prev_a=, prev_z=))."""
    cp = _cp()
    nb = A.shape[0] // 4
    d = A.shape[-1] // 2
    ab, zb = A.reshape(nb, 4, 2 * d), Z.reshape(nb, 4, 2 * d)
    pa = prev_a[None, :, :d]
    pz = prev_z[None, :, :d]
    lower_a = cp.concatenate([pa, ab[:-1, :, :d]], axis=0)
    lower_z = cp.concatenate([pz, zb[:-1, :, :d]], axis=0)
    return (cp.concatenate([lower_a, ab[:, :, d:]], axis=1),
            cp.concatenate([lower_z, zb[:, :, d:]], axis=1))


def forward_chunk(model, state, ids: np.ndarray, *, all_logits: bool = False,
                  ph: str = "decode", one_token: bool = False):
    """Trunk forward of validated ids at positions state.pos.. against ``state`` (advances
    pos).  Returns logits float32 NumPy ([vocab], or [S, vocab] with ``all_logits``)."""
    return run_chunk(model, state, ids, all_logits=all_logits, ph=ph, one_token=one_token).logits


def _legacy_io(model, device: int, stream):
    """The legacy one-token dispatch's hostmath.HostIO of ``device`` (pinned buffers kept)."""
    from memra_dsv4.gpu.hostmath import HostIO
    ios = model.__dict__.setdefault("_legacy_io", {})
    io = ios.get(device)
    if io is None or io.stream is not stream:
        io = ios[device] = HostIO(stream)
    return io


def _head_one(model, st, streams, io, msl: int):
    """The head of the one-token dispatch: the device step's head with the gate on the host
    (hostmath.head_island), rmsnorm, head GEMV.  streams [1, hc, D] f32 -> logits f32 [vocab]."""
    cp = _cp()
    from memra_dsv4.gpu import hostmath as HM
    from memra_dsv4.gpu.step_device import stage_views
    cfg = model.config
    D, hc = cfg.hidden_size, cfg.hc_mult
    _, head_fn, head_host = stage_views(model, st, msl)
    sb = cp.ascontiguousarray(G.bf16_bits(streams)).reshape(1, hc, D)
    y = cp.empty((1, D), cp.uint16)
    HM.head_island(io, cfg, sb, head_fn, head_host["scale"], head_host["base"],
                   mixes=cp.empty((1, hc), cp.float32), pre=cp.empty((1, hc), cp.float32), y=y)
    yn = RN.rmsnorm(y, st["norm.weight"], cfg.rms_norm_eps)
    logits = cp.empty(cfg.vocab_size, cp.float32)
    DK.gemv_bf16(st["head.weight"], yn, logits)
    return logits


class _Step:
    """One step of ``stage_steps``: the stage's device and compute stream current, and - when
    ``bracket`` is a name - that phase around the step (entered in this order, left in reverse)."""

    __slots__ = ("_dev", "_stream", "_bracket", "_ctx")

    def __init__(self, device: int, stream, bracket: str | None) -> None:
        self._dev, self._stream, self._bracket = device, stream, bracket

    def __enter__(self) -> None:
        cp = _cp()
        ctx = [cp.cuda.Device(self._dev), self._stream]
        if self._bracket is not None:
            ctx.append(phase(self._bracket))
        done = []
        try:
            for c in ctx:
                c.__enter__()
                done.append(c)
        except BaseException:
            for c in reversed(done):
                c.__exit__(None, None, None)
            raise
        self._ctx = done

    def __exit__(self, exc_type, exc, tb) -> bool:
        err = None
        for c in reversed(self._ctx):
            try:
                c.__exit__(exc_type, exc, tb)
            except BaseException as e:  # noqa: BLE001 - leave every context, then raise
                err = err or e
        self._ctx = None
        if err is not None:
            raise err
        return False


def stage_steps(model, si: int, state, ids: np.ndarray, p0: int, streams, *, ph: str,
                head: bool, all_logits: bool = False, caps=None, top=None, journal=None,
                one: bool = False, step_bracket: bool = False, readback: bool = True,
                taps: dict | None = None):
    """``run_stage``'s body as a generator of steps: it yields after the embedding (the ids'
    upload on a stage without it) and after every layer; the head (when asked) is the last step,
    and the generator returns (streams, logits, hc state of the last row) as run_stage does.
    Each step makes the stage's device and compute stream current itself and every phase bracket
    opens and closes inside one step, so nothing is held open across a yield: another stage's
    steps may run in between (gpu.pipeline.run_chunk_coop).  ``step_bracket``: bracket every
    step as ``{ph}/stage{si}`` (the coop schedule's stand-in for run_stage's one outer bracket,
    which cannot span another stage's steps).  ``readback=False``: return the logits and the
    hc state as device arrays (no host wait; the caller reads them back) instead of NumPy.
    Between its layers the streams pass as bf16 bits (ChunkBlock.forward's ``bits_out``: the
    same bits the next layer would round the float32 form to); after the last layer they are
    float32 (bf16-valued) again, the stage's output form.  ``taps``: {layer id: None}; each of
    this stage's layers that is a key gets its output streams there (float32 [S, hc, dim] on
    the stage's device; the DSpark drafter's trunk taps)."""
    cp = _cp()
    from memra_dsv4.gpu.model import _f32
    cfg = model.config
    st = model.stages[si]
    dev = model.devs[st.device]
    sp = f"{ph}/stage{si}"
    step = _Step(st.device, dev.compute, sp if step_bracket else None)
    capture = caps is not None
    logits_h = out_state = None
    S = ids.shape[0]
    with step:
        ids_d = cp.asarray(ids)
        if st.has_embed:
            with phase(f"{sp}/embed"):
                e = _f32(st["embed.weight"][ids_d])
                streams = cp.ascontiguousarray(
                    cp.broadcast_to(e[:, None, :], (S, cfg.hc_mult, cfg.hidden_size)))
                if capture:
                    top["embed"] = cp.asnumpy(e)
        if one:
            from memra_dsv4.gpu.step_device import stage_views
            views = stage_views(model, st, state.max_seq_len)[0]
            io = _legacy_io(model, st.device, dev.compute)
    yield
    for li, layer in enumerate(st.layers):
        with step:
            c = {} if capture else None
            with phase(f"{sp}/block"):
                blk = ChunkBlock(model, st, layer, f"{sp}/block")
                if one:
                    streams = blk.forward_one(streams, state.cache(layer), p0, views[li],
                                              io, int(ids[0]))
                else:   # bits between the layers (ChunkBlock.forward: bits_out)
                    streams = blk.forward(
                        streams, ids_d, state.cache(layer), p0, c,
                        None if journal is None else journal.layer(layer), bits_out=True)
                    if li + 1 == len(st.layers) and streams.dtype == cp.uint16:
                        streams = G.to_f32(streams)   # the stage's output: float32, as before
                if taps is not None and layer in taps:   # a new array: the bits stay as they are
                    taps[layer] = G.to_f32(streams) if streams.dtype == cp.uint16 else streams
            if capture and not one:
                caps.append({k: cp.asnumpy(v) for k, v in c.items()})
        yield
    if st.has_head and head:
        with step:
            with phase(f"{sp}/head"):
                # hc_head and the norm are per row: without all_logits or captures
                # only the last row is needed (same bits for it)
                rows = streams if (all_logits or capture) else streams[-1:]
                if one:
                    logits = _head_one(model, st, rows, io, state.max_seq_len)
                else:
                    logits, y, yn = model._head(st, rows, all_rows=all_logits)
            if readback:
                logits_h = cp.asnumpy(logits)
                out_state = cp.asnumpy(streams[-1])
            else:
                logits_h, out_state = logits, streams[-1]
            if capture:
                top.update({"hc_head": cp.asnumpy(y), "final_norm": cp.asnumpy(yn)})
    return streams, logits_h, out_state


def run_stage(model, si: int, state, ids: np.ndarray, p0: int, streams, *, ph: str, head: bool,
              all_logits: bool = False, caps=None, top=None, journal=None, one: bool = False,
              taps: dict | None = None):
    """Stage ``si``'s part of a chunk at positions p0..: the embedding (first stage), its layers,
    and - when ``head`` and the stage has it - the head, on the stage's device and compute stream,
    bracketed ``{ph}/stage{si}/...``.  ``streams``: the stage's input (already on its device;
    None for the first stage).  Returns (streams, logits NumPy or None, hc state of the last row
    or None).  ``caps`` (list) / ``top`` (dict) collect captures; ``journal`` as run_chunk;
    ``one``: the legacy one-token dispatch (``one_token_dispatch``).  The one per-stage body of
    run_chunk and of gpu.pipeline's run_chunk_pipelined (threads) and run_chunk_coop (one thread
    interleaving the stages' ``stage_steps``): this drives ``stage_steps`` to its end inside one
    ``{ph}/stage{si}`` bracket; ``taps`` as stage_steps."""
    cp = _cp()
    st = model.stages[si]
    dev = model.devs[st.device]
    steps = stage_steps(model, si, state, ids, p0, streams, ph=ph, head=head,
                        all_logits=all_logits, caps=caps, top=top, journal=journal, one=one,
                        taps=taps)
    with cp.cuda.Device(st.device), dev.compute:
        with phase(f"{ph}/stage{si}"):
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value


def run_chunk(model, state, ids: np.ndarray, *, all_logits: bool = False,
              capture: bool = False, ph: str = "decode", journal=None,
              one_token: bool = False, keep_streams: bool = False, taps=()):
    """The chunk routine: ids (validated) at positions state.pos.. against ``state`` (advances
    pos); phases ``{ph}/stage{i}/...``; exactly one ``model._boundary`` per stage boundary.
    Returns a ForwardOut: logits ([vocab], or [S, vocab] with ``all_logits``), hc_state
    [hc, dim] of the last position, and with ``capture`` the oracle's capture names per block
    (NumPy) plus captures_top embed / hc_head / final_norm.  ``journal`` (gpu.verify.Journal):
    each block records what a rollback of this chunk needs before it writes its caches.
    ``one_token`` (decode_step on ``legacy``): the one-token dispatch (module doc,
    ``one_token_dispatch``).  ``keep_streams``: ForwardOut.streams is the last stage's output,
    the final (pre-hc_head) streams of every row as float32 CuPy [S, hc, dim] on that stage's
    device (the MTP drafter's input; not copied to the host), else None.  ``taps`` (trunk layer
    ids, with ``keep_streams``): ForwardOut.streams is instead those layers' output streams,
    float32 CuPy [S, len(taps), hc, dim] on the last stage's device (the DSpark drafter's
    input, gather_taps)."""
    from memra_dsv4.oracle.model import ForwardOut
    p0 = state.pos
    S = ids.shape[0]
    one = one_token_dispatch(S, journal, capture, one_token)
    caps = [] if capture else None
    top = {} if capture else None
    streams = logits_h = out_state = None
    model.boundary_paths = []
    model.clear_chunk_memo()
    tap_out = {int(t): None for t in taps} if (keep_streams and len(taps)) else None
    for si, st in enumerate(model.stages):
        streams, lg, hs = run_stage(model, si, state, ids, p0, streams, ph=ph, head=True,
                                    all_logits=all_logits, caps=caps, top=top, journal=journal,
                                    one=one, taps=tap_out)
        if st.has_head:
            logits_h, out_state = lg, hs
        if si + 1 < len(model.stages):
            streams = model._boundary(streams, si, ph)
    for d in model.devs:   # the chunk routine's one wait for the GPUs (the head's readback
        d.compute.synchronize()   # aside): the layers and the boundary copies only enqueue
    model._boundary_release()
    state.pos = p0 + S
    if tap_out is not None:
        streams = gather_taps(model, tap_out, tuple(int(t) for t in taps))
    return ForwardOut(logits=logits_h, hc_state=out_state,
                      streams=streams if keep_streams else None, captures=caps,
                      captures_top=top, numerics=model.numerics)


def gather_taps(model, tap_out: dict, order: tuple):
    """The tap streams ``tap_out[layer]`` ([S, hc, dim] float32 on their stages' devices) stacked
    in ``order`` as float32 CuPy [S, n_taps, hc, dim] on the last stage's device.  A tap on
    another device crosses through the host (S x hc x dim float32 each, once per chunk: the
    drafter's correctness form, as GpuMtpDrafter's embedding rows); the copies are made on the
    last stage's compute stream, which reads them next."""
    cp = _cp()
    missing = [t for t in order if tap_out.get(t) is None]
    if missing:   # config.py bounds the ids to the trunk: every one is some stage's layer
        raise AssertionError(f"trunk taps {missing} were not produced by any stage")
    last = model.stages[-1].device
    host = {t: cp.asnumpy(v) for t, v in tap_out.items() if v.device.id != last}
    with cp.cuda.Device(last), model.devs[last].compute:
        parts = [cp.asarray(host[t]) if t in host else tap_out[t] for t in order]
        return cp.stack(parts, axis=1)
