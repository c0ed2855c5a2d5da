"""The DeepSeek-V4 NumPy oracle: prefill forward and the MTP block.

API
---
``Oracle(ckpt, numerics=None, shared_expert_clamp=True)``
    ``ckpt``: anything with ``.config`` (a ``Dsv4Config``) and ``.dequant(name)`` (exact
    float32 / int64 values of a stored tensor, native names), e.g.
    ``memra_dsv4.checkpoint.Checkpoint`` (``.open(dir)`` or ``.from_arrays(cfg, synth_arrays(...))``).
    ``numerics``: ``"bf16"`` (default), ``"reference"``,
    ``"exact"`` or None (then ``MEMRA_DSV4_NUMERICS``, then bf16); see ``memra_dsv4.seams``.
    ``shared_expert_clamp``: clamp the shared expert's SwiGLU at ``swiglu_limit`` like the routed
    experts (current official revision and transformers; True) or not (initial revision).
    ``cache_weights``: keep dequantised weights (float32; float64 for exact) between calls
    (True).  With Flash dimensions one layer's 256 experts are ~25 GB in float32; pass False
    to dequantise on every use instead: then only the looked-up embedding rows are decoded,
    the head slice by slice, and a ``Checkpoint``'s routed experts straight to float64 (the
    same values; results are bit-identical to the cached mode, tests/test_oracle_fastpaths.py).

``Oracle.prefill(token_ids, all_logits=False, capture=False) -> ForwardOut``
    One sequence from position 0: the chunk routine of ``memra_dsv4.oracle.decode``
    (``run_chunk``) on a fresh, reset DecodeState sized to the prompt (not returned).  ``logits``: [vocab] of the last position, or [S, vocab]
    with ``all_logits``; float32 (float64 for ``exact``).  ``hc_state``: [hc, dim], the
    pre-hc_head streams of the last position (the MTP drafter input); ``streams``: the same for
    every position [S, hc, dim].  ``captures`` (with ``capture=True``): one dict per trunk block,
    ``captures_top``: embed / hc_head / final_norm (names below).

``Oracle.mtp_forward(hc_state_rows, next_token_ids, capture=False) -> MtpOut``
    The MTP block (layer id n_layers: ratio 0, learned routing) over S rows taken as positions
    0..S-1: row i combines the trunk streams of position i with the embedding of token i+1 (the
    caller passes ``next_token_ids[i]`` = token i+1) and predicts token i+2.
    ``logits`` [S, vocab]; ``streams`` [S, hc, dim] (the MTP block's output, before its
    hc_head); ``captures`` as for one trunk block plus "mtp.e", "mtp.h0", "hc_head",
    "final_norm".

Invalid input (empty prompt, non-integer ids, ids outside 0..vocab-1, wrong shapes/dtypes)
raises ``ValueError`` naming the problem before any computation.

Capture names (per block dict; S tokens, H heads, n compressed entries)
-----------------------------------------------------------------------
``hc_attn.x`` [S,dim], ``hc_attn.post`` [S,hc], ``hc_attn.comb`` [S,hc,hc]   hc_pre outputs
``attn_norm`` [S,dim]            attention input x
``attn.qr`` [S,q_lora]           q latent after q_norm (the indexer's input)
``attn.q`` [S,H,hd]              q after the per-head RMS and RoPE
``attn.kv`` [S,hd]               the window vectors (kv_norm, RoPE, FP8 sim)
``attn.comp`` [n,hd]             compressed entries (ratio > 0 layers)
``attn.index.q`` [S,nI,dI]       indexer queries (RoPE, Hadamard, FP4 sim)      (CSA only)
``attn.index.weights`` [S,nI]    indexer head weights                          (CSA only)
``attn.index.keys`` [n,dI]       indexer compressed keys                       (CSA only)
``attn.index.scores`` [S,n]      index scores (entries k >= (t+1)//4 are not valid) (CSA)
``attn.index.sel`` [S,min(topk,n)] selected entries in score order, -1 padded   (CSA only)
``attn.cand`` [S,W+C]            canonical candidate rows of the kv buffer [kv ; comp]
                                 (window chronological, then entries + S ascending; -1 skip)
``attn.o`` [S,H,hd]              attention output after the inverse RoPE
``attn.out`` [S,dim]             after wo_a (grouped) and wo_b
``attn.streams`` [S,hc,dim]      streams after the attention hc_post
``hc_ffn.x``, ``hc_ffn.post``, ``hc_ffn.comb``, ``ffn_norm``   as for attention
``moe.scores`` [S,E]             sqrtsoftplus scores (unbiased)
``moe.idx`` [S,k]                expert picks (learned: biased-score order; hash: tid2eid order)
``moe.weights`` [S,k]            routing weights (normalised, x routed_scaling_factor)
``moe.shared`` [S,dim]           shared expert output
``moe.out`` [S,dim]              MoE output (routed in ascending expert id + shared)
``block.out`` [S,hc,dim]         block output streams
Top level: ``embed`` [S,dim], ``hc_head`` [S,dim], ``final_norm`` [S,dim].

One block orchestration
-----------------------
The per-token pieces are methods of ``_Layer`` working on explicit positions:
``q_path``, ``kv_path``, ``compress`` (projections + ``ops.compress_pool`` over the blocks a
chunk completes, seeded with the compressor's pending rows), ``indexer_select``,
``attend`` (``ops.sparse_attention_with_sinks`` over a canonical candidate list),
``out_proj``, ``moe`` and ``hc_pre``.  The block itself is ``decode.block_chunk`` (attention
against a ``LayerCache``, with captures and forced decisions); ``prefill`` and ``mtp_forward``
run it from position 0 on fresh caches, decode / chunked prefill / verify on the sequence's.

Decode state machine (``memra_dsv4.oracle.decode`` / ``spec``, mixed in as ``DecodeMixin``):
``new_state``, ``prefill_state``, ``decode_step``, ``prefill_chunk``, ``verify``, ``commit``,
``new_mtp_state``, ``mtp_propose``; ``Oracle.prefill`` keeps no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.host import indices as hidx
from memra_dsv4.host.pending import closing_blocks
from memra_dsv4.host.rope import layer_cos_sin
from memra_dsv4.host.routing import route_weights, sqrtsoftplus
from memra_dsv4.oracle import ops
from memra_dsv4.oracle._blas import single_threaded_blas
from memra_dsv4.oracle.decode import DecodeMixin, block_chunk, run_chunk
from memra_dsv4.oracle.state import CompressorState, LayerCache
from memra_dsv4.seams import NumericsPolicy, policy

__all__ = ["Oracle", "ForwardOut", "MtpOut", "check_token_ids", "check_token_scalar"]

# The lm head runs over vocab slices of about this many weight elements (16M: 64 MB float32,
# 128 MB float64 per slice).
HEAD_CHUNK_ELEMS = 1 << 24


@dataclass
class ForwardOut:
    logits: np.ndarray                   # [vocab] or [S, vocab]
    hc_state: np.ndarray                 # [hc, dim] pre-hc_head streams, last position
    streams: np.ndarray                  # [S, hc, dim] pre-hc_head streams, every position
    captures: list[dict[str, np.ndarray]] | None = None
    captures_top: dict[str, np.ndarray] | None = None
    numerics: str = "bf16"


@dataclass
class MtpOut:
    logits: np.ndarray                   # [S, vocab]
    streams: np.ndarray                  # [S, hc, dim] MTP block output (pre its hc_head)
    captures: dict[str, np.ndarray] | None = None
    numerics: str = "bf16"


# ------------------------------------------------------------------------------ checks
def check_token_ids(token_ids, vocab: int, what: str = "token_ids") -> np.ndarray:
    """int64 [S] from a 1-D non-empty integer sequence with values in 0..vocab-1."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of integers, got {type(token_ids).__name__}")
    try:
        a = np.asarray(token_ids)
    except Exception as e:  # ragged lists etc.
        raise ValueError(f"{what}: not an array of integers ({e})") from None
    if a.dtype == object or a.dtype.kind not in "iu":
        if a.dtype.kind == "b":
            raise ValueError(f"{what} must be integers, got booleans")
        if a.size == 0 and a.ndim == 1:
            raise ValueError(f"{what} is empty (an empty prompt has nothing to predict from)")
        raise ValueError(f"{what} must be integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D [S], got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{what} is empty (an empty prompt has nothing to predict from)")
    bad = (a < 0) | (a >= vocab)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _outside_vocab(what, i, int(a[i]), vocab, int(bad.sum()))
    return a.astype(np.int64)


def check_token_scalar(token, vocab: int, what: str = "token_ids") -> int | None:
    """A Python int or NumPy integer scalar (not a bool) checked in plain Python, no NumPy
    operation: the id as an int, or check_token_ids' error for ``[token]`` when it is out of
    range.  None for any other input, which the caller sends through check_token_ids.  For a
    per-step caller (gpu Dsv4Gpu._step_token): right after a host wait NumPy's first operations
    cost tens of microseconds (docs/decode_perf.md, twenty-ninth session)."""
    if type(token) is not int and not isinstance(token, np.integer):
        return None
    t = int(token)
    if not 0 <= t < vocab:
        raise _outside_vocab(what, 0, t, vocab, 1)
    return t


def _outside_vocab(what: str, i: int, value: int, vocab: int, n_bad: int) -> ValueError:
    return ValueError(f"{what}[{i}] = {value} is outside the vocabulary 0..{vocab - 1} "
                      f"({n_bad} ids out of range)")


def _forced(value, shape, name: str, where: str) -> np.ndarray:
    a = np.asarray(value)
    if a.shape != tuple(shape) or a.dtype.kind not in "iu":
        raise ValueError(f"force_decisions {where} {name}: expected integer array of shape "
                         f"{tuple(shape)}, got {a.dtype} {a.shape}")
    return a


# --------------------------------------------------------------------------- one layer
class _Layer:
    """Weights and routines of one block (trunk layer or MTP stage)."""

    def __init__(self, oracle: "Oracle", prefix: str, layer_id: int):
        self.o, self.p, self.lid = oracle, prefix, layer_id
        cfg = oracle.config
        self.cfg = cfg
        self.pol: NumericsPolicy = oracle.pol
        self.ratio = cfg.compress_ratio(layer_id)
        self.kind = cfg.attn_kind(layer_id)
        self.hash = cfg.is_hash_layer(layer_id)

    def w(self, leaf: str) -> np.ndarray:
        return self.o.weight(f"{self.p}.{leaf}")

    def gw(self, leaf: str) -> np.ndarray:
        """A weight used only as a GEMM operand (``Oracle.gemm_weight``)."""
        return self.o.gemm_weight(f"{self.p}.{leaf}")

    def rope(self, positions) -> tuple[np.ndarray, np.ndarray]:
        return layer_cos_sin(self.cfg, self.lid, positions, self.pol.dtype)

    # ---------------------------------------------------------------- attention pieces
    def q_path(self, x, cos, sin):
        """x [T, dim] -> (qr [T, q_lora], q [T, H, hd]) (M:496-499)."""
        cfg, pol = self.cfg, self.pol
        qr = ops.rmsnorm(ops.linear(x, self.w("attn.wq_a.weight"), "fp8", pol=pol),
                         self.w("attn.q_norm.weight"), cfg.rms_norm_eps, pol=pol)
        q = ops.linear(qr, self.w("attn.wq_b.weight"), "fp8", pol=pol)
        q = q.reshape(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
        q = ops.head_rms(q, cfg.rms_norm_eps, pol=pol)
        return qr, ops.apply_rope(q, cos[:, None], sin[:, None], pol=pol)

    def kv_path(self, x, cos, sin):
        """x [T, dim] -> window vectors [T, hd] (M:502-506)."""
        cfg, pol = self.cfg, self.pol
        kv = ops.rmsnorm(ops.linear(x, self.w("attn.wkv.weight"), "fp8", pol=pol),
                         self.w("attn.kv_norm.weight"), cfg.rms_norm_eps, pol=pol)
        kv = ops.apply_rope(kv, cos, sin, pol=pol)
        return pol.kv_sim(kv, cfg.qk_rope_head_dim)

    def compress(self, x, p0: int, cs: CompressorState | None = None, *, indexer: bool):
        """Compressed entries completed by positions p0..p0+S-1 (x [S, dim]) given the pending
        rows ``cs`` of the main (``indexer=False``) or indexer compressor; ``cs`` is read, not
        modified (None: a sequence start, p0 = 0).  Returns (entries [nb, d], a, z) with
        (a, z) the chunk's projections (what ``cs.advance`` takes)."""
        cfg, pol = self.cfg, self.pol
        sub = "attn.indexer.compressor" if indexer else "attn.compressor"
        r = self.ratio
        d = cfg.index_head_dim if indexer else cfg.head_dim
        if cs is None:
            cs = CompressorState.fresh(r, d, pol.dtype)
        S = x.shape[0]
        positions = p0 + np.arange(S, dtype=np.int64)
        a, z = ops.compressor_project(x, self.w(f"{sub}.wkv.weight"), self.w(f"{sub}.wgate.weight"),
                                      self.w(f"{sub}.ape"), positions, pol=pol)
        A, Z, nb, b0 = closing_blocks(cs.kv, cs.score, a, z, p0, r)
        if nb == 0:
            return np.zeros((0, d), dtype=pol.dtype), a, z
        if cs.overlap:
            pa, pz = cs.prev_rows()
            ac, zc = ops.compress_candidates(A, Z, r, prev_a=pa, prev_z=pz)
        else:
            ac, zc = ops.compress_candidates(A, Z, r)
        pooled = ops.compress_pool(ac, zc, pol=pol)
        kpos = b0 + r * np.arange(nb, dtype=np.int64)   # k*r: first token of the entry's block
        cos, sin = self.rope(kpos)
        ent = ops.compress_entry_postprocess(pooled, self.w(f"{sub}.norm.weight"), cos, sin,
                                             rope_dim=cfg.qk_rope_head_dim, rotate=indexer,
                                             eps=cfg.rms_norm_eps, pol=pol)
        return ent, a, z

    def indexer_select(self, x, qr, keys, positions, cos, sin, cap=None, force=None):
        """CSA top-k per query over the complete indexer keys (M:380-433); ``keys`` [n, dI]
        are every indexer key of the sequence so far (entries of blocks completed by
        ``positions`` included).  Returns the selection [T, min(topk, n)] in score order,
        -1 padded (or ``force``)."""
        cfg, pol = self.cfg, self.pol
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        qI = ops.linear(qr, self.w("attn.indexer.wq_b.weight"), "fp8", pol=pol)
        qI = ops.apply_rope(qI.reshape(x.shape[0], nI, dI), cos[:, None], sin[:, None], pol=pol)
        qI = pol.fp4_sim(ops.hadamard(qI, pol=pol), 32)
        wts = ops.indexer_weights(x, self.w("attn.indexer.weights_proj.weight"),
                                  n_heads=nI, head_dim=dI, pol=pol)
        scores = ops.indexer_scores(qI, wts, keys, pol=pol)
        sel = ops.indexer_topk(scores, hidx.n_complete(np.asarray(positions), self.ratio),
                               cfg.index_topk)
        if force is not None:
            sel = _forced(force, sel.shape, "attn.index.sel", self.p)
        if cap is not None:
            cap.update({"attn.index.q": qI, "attn.index.weights": wts, "attn.index.keys": keys,
                        "attn.index.scores": scores, "attn.index.sel": sel})
        return sel

    def attend(self, q, kv_rows, cand):
        """Sparse attention with sinks over canonical candidate rows (K:276-368)."""
        return ops.sparse_attention_with_sinks(q, kv_rows, cand, self.w("attn.attn_sink"),
                                               self.cfg.head_dim ** -0.5, pol=self.pol)

    def out_proj(self, o, cos, sin):
        """Inverse RoPE, grouped wo_a, wo_b (M:534-543).  o [T, H, hd] -> [T, dim]."""
        cfg, pol = self.cfg, self.pol
        o = ops.apply_rope(o, cos[:, None], sin[:, None], inverse=True, pol=pol)
        u = ops.wo_grouped(o, self.w("attn.wo_a.weight"), groups=cfg.o_groups, pol=pol)
        return o, ops.linear(u, self.w("attn.wo_b.weight"), "fp8", pol=pol)

    # ---------------------------------------------------------------------- MoE
    def moe(self, x, token_ids, cap, force=None):
        cfg, pol = self.cfg, self.pol
        logits = ops.router_logits(x, self.w("ffn.gate.weight"), pol=pol)
        if force is not None:  # replay picks of another run; weights from this run's scores
            idx = _forced(force, (x.shape[0], cfg.num_experts_per_tok), "moe.idx", self.p)
            scores = sqrtsoftplus(logits)
            wts = route_weights(scores, idx.astype(np.int64), cfg.routed_scaling_factor)
        elif self.hash:
            idx, wts, scores = ops.router(logits, k=cfg.num_experts_per_tok,
                                          route_scale=cfg.routed_scaling_factor,
                                          tid2eid=self.o.tid2eid(self.p), token_ids=token_ids)
        else:
            idx, wts, scores = ops.router(logits, k=cfg.num_experts_per_tok,
                                          route_scale=cfg.routed_scaling_factor,
                                          bias=self.w("ffn.gate.bias"))
        T, k = idx.shape
        routed = np.zeros((T, k, cfg.hidden_size), dtype=pol.dtype)
        for e in np.unique(idx):
            rows, picks = np.nonzero(idx == e)
            ep = f"ffn.experts.{int(e)}"
            routed[rows, picks] = ops.expert_ffn(
                x[rows], self.gw(f"{ep}.w1.weight"), self.gw(f"{ep}.w2.weight"),
                self.gw(f"{ep}.w3.weight"), limit=cfg.swiglu_limit, weight=wts[rows, picks],
                kind="fp4", pol=pol)
        shared = ops.expert_ffn(
            x, self.w("ffn.shared_experts.w1.weight"), self.w("ffn.shared_experts.w2.weight"),
            self.w("ffn.shared_experts.w3.weight"),
            limit=cfg.swiglu_limit if self.o.shared_expert_clamp else 0.0, kind="fp8", pol=pol)
        y = ops.moe_combine(routed, idx, shared, pol=pol)
        if cap is not None:
            cap.update({"moe.scores": scores, "moe.idx": idx, "moe.weights": wts,
                        "moe.shared": shared, "moe.out": y})
        return y

    # -------------------------------------------------------------------- block
    def hc_pre(self, streams, sub: str):
        cfg = self.cfg
        return ops.hc_pre(streams, self.w(f"hc_{sub}_fn"), self.w(f"hc_{sub}_scale"),
                          self.w(f"hc_{sub}_base"), hc_mult=cfg.hc_mult,
                          iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                          norm_eps=cfg.rms_norm_eps, pol=self.pol)


# ------------------------------------------------------------------------------ oracle
class Oracle(DecodeMixin):
    def __init__(self, ckpt, numerics: str | None = None, *, shared_expert_clamp: bool = True,
                 cache_weights: bool = True):
        if not hasattr(ckpt, "config") or not hasattr(ckpt, "dequant"):
            raise ValueError("Oracle: ckpt must have .config and .dequant(name) "
                             "(e.g. memra_dsv4.checkpoint.Checkpoint)")
        self.ckpt = ckpt
        self.config = ckpt.config
        self.pol: NumericsPolicy = policy(numerics)
        self.numerics = self.pol.name
        self.shared_expert_clamp = bool(shared_expert_clamp)
        self.cache_weights = bool(cache_weights)
        self._w: dict[str, np.ndarray] = {}
        cfg = self.config
        self.layers = [_Layer(self, f"layers.{l}", l) for l in range(cfg.num_hidden_layers)]
        self.mtp_layers = ([_Layer(self, f"mtp.{s}", cfg.num_hidden_layers + s)
                            for s in range(cfg.num_drafter_stages)]
                           if cfg.drafter_kind == "mtp" else [])

    # ---------------------------------------------------------------- weights
    def weight(self, name: str) -> np.ndarray:
        """Exactly dequantised weight in the class's dtype (cached)."""
        w = self._w.get(name)
        if w is None:
            w = self.pol.arr(self.ckpt.dequant(name))
            w.setflags(write=False)
            if self.cache_weights:
                self._w[name] = w
        return w

    def gemm_weight(self, name: str) -> np.ndarray:
        """``weight(name)`` for a tensor used only as a GEMM operand (``seams.mm`` widens it to
        float64 anyway): without the weight cache (``cache_weights=False``) a ``Checkpoint``
        decodes it straight to float64, the same values without the float32 intermediate
        (the routed experts of Flash: ~2x faster).  Otherwise ``weight(name)``."""
        if self.cache_weights or name in self._w or not isinstance(self.ckpt, Checkpoint):
            return self.weight(name)
        w = self.ckpt.dequant(name, np.float64)
        w.setflags(write=False)
        return w

    def tid2eid(self, prefix: str) -> np.ndarray:
        name = f"{prefix}.ffn.gate.tid2eid"
        w = self._w.get(name)
        if w is None:
            w = np.asarray(self.ckpt.dequant(name), dtype=np.int64)
            self._w[name] = w
        return w

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        name = "embed.weight"
        if self.cache_weights or name in self._w or not hasattr(self.ckpt, "dequant_rows"):
            return self.weight(name)[ids]
        # no weight cache: decode only the looked-up rows (the same values)
        return self.pol.arr(self.ckpt.dequant_rows(name, np.asarray(ids)))

    def _lm_head(self, y: np.ndarray) -> np.ndarray:
        """``ops.lm_head(y, weight("head.weight"))``, over vocab slices of ~HEAD_CHUNK_ELEMS
        weight elements (a multiple of 64 rows) when the head is larger than that: without the
        [vocab, dim] float64 copy of the whole head (Flash: 4 GB, 5x slower).  Each logit is
        the same float64 dot product of one weight row: a single-threaded BLAS computes an
        element of a large product in the same order whatever the number of rows in the call
        (tests/test_oracle_fastpaths.py; small products, M*N*K <= 64^3 here, take another
        kernel, which slices this large never do).  Without the weight cache the rows are
        decoded slice by slice too."""
        name = "head.weight"
        V, D = self.config.vocab_size, self.config.hidden_size
        step = max(64, HEAD_CHUNK_ELEMS // max(1, D) // 64 * 64)
        cached = self.cache_weights or name in self._w or not hasattr(self.ckpt, "dequant_rows")
        full = self.weight(name) if cached else None
        out = None
        for r0 in range(0, V, step):
            r1 = min(V, r0 + step)
            w = full[r0:r1] if cached else self.pol.arr(self.ckpt.dequant_rows(name, slice(r0, r1)))
            part = ops.lm_head(y, w, pol=self.pol)
            if out is None:
                if r1 == V:
                    return part
                out = np.empty((*part.shape[:-1], V), dtype=part.dtype)
            out[..., r0:r1] = part
        return out

    def _head(self, streams, prefix: str, rows):
        """hc_head -> final norm -> fp32 logits for ``rows`` of streams [S, hc, dim]."""
        cfg, pol = self.config, self.pol
        y = ops.hc_head(streams, self.weight(f"{prefix}hc_head_fn"),
                        self.weight(f"{prefix}hc_head_scale"), self.weight(f"{prefix}hc_head_base"),
                        hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, pol=pol)
        yn = ops.rmsnorm(y, self.weight(f"{prefix}norm.weight"), cfg.rms_norm_eps, pol=pol)
        return y, yn, self._lm_head(yn[rows])

    def _mtp_input(self, layer: _Layer, h, ids):
        """The MTP block's input streams: h0 = store(h_proj(hnorm(h)) + e_proj(enorm(embed)))
        for trunk streams h [S, hc, dim] and the next tokens ids [S].  Returns (e, h0)."""
        cfg, pol = self.config, self.pol
        eps = cfg.rms_norm_eps
        e = ops.rmsnorm(self._embed(ids), layer.w("enorm.weight"), eps, pol=pol)
        z = ops.rmsnorm(pol.store(h), layer.w("hnorm.weight"), eps, pol=pol)
        ep = ops.linear(e, layer.w("e_proj.weight"), "fp8", pol=pol)
        hp = ops.linear(z, layer.w("h_proj.weight"), "fp8", pol=pol)
        return e, pol.store(hp + ep[:, None, :])

    # ---------------------------------------------------------------- prefill
    def prefill(self, token_ids, all_logits: bool = False, capture: bool = False, *,
                force_decisions=None) -> ForwardOut:
        """See the module doc.  ``force_decisions`` (testing/diagnosis): a list with one dict
        per trunk block holding "moe.idx" [S, k] and/or "attn.index.sel" [S, w] (e.g. the
        ``captures`` of another run); those discrete choices are replayed instead of recomputed
        (routing weights still come from this run's scores), so two numeric classes can be
        compared without router / indexer near-tie flips."""
        with single_threaded_blas():
            return self._prefill(token_ids, all_logits, capture, force_decisions)

    def _prefill(self, token_ids, all_logits, capture, force_decisions) -> ForwardOut:
        cfg, pol = self.config, self.pol
        ids = check_token_ids(token_ids, cfg.vocab_size)
        if force_decisions is not None and len(force_decisions) != len(self.layers):
            raise ValueError(f"force_decisions has {len(force_decisions)} entries; expected one "
                             f"per trunk block ({len(self.layers)})")
        state = self.new_state(max_seq_len=ids.shape[0])
        state.reset()
        caps = [] if capture else None
        logits, streams, top = run_chunk(self, state, ids, all_logits, caps=caps,
                                         force_decisions=force_decisions)
        return ForwardOut(logits=logits, hc_state=streams[-1].copy(), streams=streams,
                          captures=caps, captures_top=top, numerics=pol.name)

    # ---------------------------------------------------------------- MTP
    def mtp_forward(self, hc_state_rows, next_token_ids, capture: bool = False) -> MtpOut:
        with single_threaded_blas():
            return self._mtp_forward(hc_state_rows, next_token_ids, capture)

    def _mtp_forward(self, hc_state_rows, next_token_ids, capture) -> MtpOut:
        cfg, pol = self.config, self.pol
        if not self.mtp_layers:
            raise ValueError(f"config {cfg.name!r} has no MTP block (drafter kind "
                             f"{cfg.drafter_kind!r})")
        h = np.asarray(hc_state_rows)
        if h.dtype.kind != "f":
            raise ValueError(f"hc_state_rows must be floating point, got dtype {h.dtype}")
        if h.ndim == 2:
            h = h[None]
        if h.ndim != 3 or h.shape[1:] != (cfg.hc_mult, cfg.hidden_size):
            raise ValueError(f"hc_state_rows must be [S, {cfg.hc_mult}, {cfg.hidden_size}], "
                             f"got shape {np.asarray(hc_state_rows).shape}")
        ids = check_token_ids(next_token_ids, cfg.vocab_size, "next_token_ids")
        if ids.shape[0] != h.shape[0]:
            raise ValueError(f"next_token_ids has {ids.shape[0]} entries but hc_state_rows has "
                             f"{h.shape[0]} rows")
        if not np.isfinite(h).all():
            raise ValueError("hc_state_rows contains non-finite values")
        layer = self.mtp_layers[0]
        e, h0 = self._mtp_input(layer, h, ids)
        cap = {} if capture else None
        cache = LayerCache(cfg, layer.lid, pol.dtype)    # fresh: rows at positions 0..S-1
        out = block_chunk(layer, cache, h0, ids, 0, cap=cap)
        y, yn, logits = self._head(out, f"{layer.p}.", slice(None))
        if capture:
            cap.update({"mtp.e": e, "mtp.h0": h0, "hc_head": y, "final_norm": yn})
        return MtpOut(logits=logits, streams=out, captures=cap, numerics=pol.name)
