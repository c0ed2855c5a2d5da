"""The DSpark drafter of DeepSeek-V4-Flash-0731 on the GPU: the oracle's
``memra_dsv4.oracle.dspark.DSparkDrafter`` (dsv4_speculative.md 2.1-2.6) with the trunk's chunk
kernels, on the last stage's device.

Contract (the oracle's, same arguments, same convention, same refusals)
-----------------------------------------------------------------------
``GpuDSparkDrafter().trunk_taps(model) -> layer ids``
    ``dspark_target_layer_ids``: gpu.spec's target then hands ``propose`` the output streams of
    those trunk blocks (``Dsv4Gpu.prefill`` / ``verify`` with ``return_streams=True, taps=``),
    float32 CuPy [m, n_taps, hc, dim] on the last stage's device.
``begin(model, max_seq_len)``
    ``model``: a ``Dsv4Gpu`` of a DSpark checkpoint loaded with ``drafter=True`` (refused
    otherwise, naming the fix).  Allocates the three stages' window rings (a
    ``gpu.cache.DecodeState`` over layer ids n..n+2, all ratio 0: [W, head_dim] bf16 bits each)
    once per sequence; ``n_ctx`` = 0.
``propose(tap_rows, next_tokens, k, sampler=None) -> (tokens int64 [min(k, B)], logits float32
[min(k, B), V])``
    Writes the context rows of positions n_ctx..n_ctx+m-1 (only the last <= W are computed:
    older ones would be overwritten), then drafts one block with anchor = next_tokens[-1] and
    keeps the drafts' confidence logits in ``last_confidence`` (NumPy [min(k, B)]).  Checks
    (oracle.dspark's ``dspark_propose_ids`` / ``check_tap_rows``: the same messages; finiteness
    on the device) before any device work: a refused call leaves the rings and n_ctx as they
    were.
``draft(anchor, sampler=None, capture=None) -> oracle.dspark.DSparkDraft``
    The oracle's draft: block ids [anchor, noise x (B-1)] at positions p+1..p+B (p = n_ctx - 1)
    through the three stages, stage 2's hc_head / norm / the trunk's head matrix give U and h,
    then the Markov loop ``logits_k = U_k + markov_w2 . markov_w1[out[k]]`` (one bf16 GEMV per
    draft and one readback: the sampler picks out[k+1] from it on the host) and the confidence
    ``proj([h_k ; markov_w1[out[k]]])`` (read back once, with the last draft); U and h are read
    back into the draft too (``propose`` skips those two readbacks).  ``capture``
    (list): per stage the oracle's names ``attn_norm``, ``attn.q``, ``attn.kv``, ``attn.rows``,
    ``block.out`` (NumPy float32), for a block-by-block comparison.

The pieces, as the oracle's
---------------------------
* context row: ``kv_path(main_norm(main_proj(feature)))`` per stage, feature = store(hc-mean of
  each tap) concatenated over the taps (float64 mean of the four bf16 values, as the oracle);
  main_proj is the stage-0 FP8 linear through the same ``_Block.lin`` GEMM as the trunk's; the
  kv path is the trunk's (``ChunkBlock.kv_path``: norm + RoPE at the position + the FP8 round
  trip), written into slot pos % W of each stage's ring.  Only committed positions reach the
  rings (spec_loop hands the accepted rows only).
* ``DSparkBlock``: the trunk's chunk block (``gpu.decode.ChunkBlock``: hc kernels, norms, q / kv
  / output projections, MoE) whose attention is DSpark's: the ring rows of positions
  max(0, p-W+1)..p plus all B block rows, every query attending every row (bidirectional
  inside the block) with the sinks, through the device step's sparse attention kernel with the
  inverse RoPE in its epilogue; the block's own rows are never written to the ring.

Numeric class bf16: the oracle's ``draft`` given the same context is the reference, within the
class's bounds (tests/gpu/test_dspark_gpu.py).  Phases: ``draft/dspark/...``.  Host syncs: the
finiteness check, one readback per draft (the sampler), the confidence once; tap rows or
embedding rows on another device cross through the host.  This path allocates per call (CuPy
pool): it is the drafter's correctness form, not a device-resident step (as GpuMtpDrafter).
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.gpu.decode import ChunkBlock, _ring_views
from memra_dsv4.gpu.drafters import embed_rows, f32_on_device
from memra_dsv4.gpu.ops._common import contiguous
from memra_dsv4.gpu.ops import attention as AT
from memra_dsv4.oracle.dspark import (DSparkDraft, check_dspark_config, check_dspark_propose,
                                      check_tap_rows)
from memra_dsv4.oracle.sampling import greedy
from memra_dsv4.profiling import phase

__all__ = ["DSparkBlock", "GpuDSparkDrafter"]

N_STAGES = 3   # config.py: a DSpark drafter has three stages mtp.0..2


def _cp():
    import cupy as cp
    return cp


class DSparkBlock(ChunkBlock):
    """A DSpark stage: ChunkBlock.forward (hc_pre, norms, MoE, hc_post) with DSpark's attention
    (module doc).  ``forward(streams [B, hc, D], ids_d, cache, p0)``: the block at positions
    p0..p0+B-1 against the ring rows of the W positions before p0; the ring is only read."""

    def attention(self, x, cache, p0: int, cap, journal=None):
        cp = _cp()
        assert journal is None, "a DSpark block is never journaled (it writes no cache)"
        b, cfg = self.b, self.cfg
        S = x.shape[0]
        W, hd = cfg.sliding_window, cfg.head_dim
        cos, sin = b.rope_range(p0, S)           # row t: position p0 + t
        ridx = cp.arange(S, dtype=cp.int32)
        with phase(f"{self.ph}/attn/q"):
            qr, qb = self.q_path(x, ridx, cos, sin)
        with phase(f"{self.ph}/attn/kv"):
            kvb, kv = self.kv_path(x, cos, sin)
            if kvb is None:                     # the reference chains: f32 -> the same bits
                kvb = G.bf16_bits(kv)
        h0 = max(0, p0 - W)                      # the oracle's max(0, p - W + 1), p = p0 - 1
        parts = [r for r in _ring_views(cache.ring, h0, p0 - h0, W) + [kvb] if r.shape[0]]
        rows = parts[0] if len(parts) == 1 else cp.concatenate(parts, axis=0)
        n = rows.shape[0]
        # every query attends every row: the ring's history and the whole block
        cand = cp.ascontiguousarray(cp.broadcast_to(cp.arange(n, dtype=cp.int32), (S, n)))
        with phase(f"{self.ph}/attn/sparse_attention"):
            ob = AT.sparse_attention(qb, rows, cand,
                                     contiguous(b.w("attn.attn_sink"), dtype=cp.float32),
                                     hd ** -0.5, n_split=None, inverse_rope=(ridx, cos, sin))
        with phase(f"{self.ph}/attn/output"):
            out = self.out_proj(ob)
        if cap is not None:
            cap.update({"attn.q": G.to_f32(qb), "attn.kv": G.to_f32(kvb),
                        "attn.rows": G.to_f32(rows)})
        return out


class GpuDSparkDrafter:
    """DSpark as a drafter on the GPU (module doc)."""

    name = "dspark"
    last_confidence = None   # [k] confidence logits of the last proposal (set by propose)

    def __init__(self) -> None:
        self.model = None
        self.state = None

    # ------------------------------------------------------------------ set-up
    def trunk_taps(self, model) -> tuple[int, ...]:
        cfg = check_dspark_config(model.config, "GpuDSparkDrafter")
        return tuple(int(t) for t in cfg.dspark_target_layer_ids)

    def begin(self, model, max_seq_len: int | None = None) -> None:
        from memra_dsv4.gpu.cache import DecodeState
        cfg = check_dspark_config(model.config, "GpuDSparkDrafter")
        si = getattr(model, "drafter_stage", None)
        if si is None:
            raise ValueError("GpuDSparkDrafter: the model holds no drafter; load it with "
                             "Dsv4Gpu.load(..., drafter=True) (or synthetic(..., drafter=True))")
        st = model.stages[si]
        lids = tuple(st.drafter_layers)
        n = cfg.num_hidden_layers
        if lids != tuple(range(n, n + N_STAGES)):
            raise AssertionError(f"DSpark stages on the drafter stage: {lids}")
        for lid in lids:   # config.py refuses a drafter stage with compression
            if cfg.compress_ratio(lid) != 0:
                raise AssertionError(f"DSpark layer {lid}: compress ratio {cfg.compress_ratio(lid)}")
        msl = int(max_seq_len or model.max_seq_len)
        self.model, self.stage, self.lids, self.cfg = model, st, lids, cfg
        self.B, self.W = int(cfg.dspark_block_size), int(cfg.sliding_window)
        self.state = DecodeState(cfg, {lid: st.device for lid in lids}, msl)
        self.last_confidence = None
        model.devs.order_after_current()   # the rings were zeroed on the current stream

    @property
    def n_ctx(self) -> int:
        """Positions 0..n_ctx-1 have context rows (committed)."""
        return 0 if self.state is None else self.state.pos

    def _check_begun(self, what: str) -> None:
        if self.model is None:
            raise ValueError(f"GpuDSparkDrafter.{what} before begin(model, max_seq_len)")

    # ------------------------------------------------------------------ context
    def write_context(self, tap_rows) -> None:
        """Commit context rows for positions n_ctx..n_ctx+m-1 into the three rings."""
        cp = _cp()
        self._check_begun("write_context")
        shape = tuple(tap_rows.shape)
        m = check_tap_rows(self.cfg, self.n_ctx, self.state.max_seq_len, shape,
                           np.dtype(tap_rows.dtype).kind)
        t = f32_on_device(self.model, tap_rows, self.stage.device)
        dev = self.model.devs[self.stage.device]
        with cp.cuda.Device(self.stage.device), dev.compute:
            if not bool(cp.isfinite(t).all()):   # a host wait: refused before any write
                raise ValueError("tap_rows must be finite floating point")
            self._write(t, m)
        self.state.pos += m

    def _write(self, t, m: int) -> None:
        from memra_dsv4.gpu.model import _Block, _f64
        cp = _cp()
        cfg, W = self.cfg, self.W
        keep = min(m, W)                          # older rows would be overwritten anyway
        p0 = self.n_ctx + m - keep
        with phase("draft/dspark/context"):
            tk = t[m - keep:]
            # store(mean over hc): the mean in float64 as the oracle (exact for four bf16 values
            # unless their exponents span > ~40 binades); its float32 cast before the bf16
            # rounding is exact unless they span > ~14 (a double rounding the bound covers)
            feats = G.store(tk.astype(cp.float64).mean(axis=2).astype(cp.float32))
            feats = cp.ascontiguousarray(feats.reshape(keep, -1))
            b0 = _Block(self.model, self.stage, self.lids[0], "draft/dspark/context")
            mx = b0.lin(feats, "main_proj.weight")
            mx = G.rmsnorm(mx, _f64(b0.w("main_norm.weight")), cfg.rms_norm_eps)
            for lid in self.lids:
                blk = ChunkBlock(self.model, self.stage, lid, "draft/dspark/context")
                cos, sin = blk.b.rope_range(p0, keep)
                kvb, kv = blk.kv_path(mx, cos, sin)
                kvb = kvb if kvb is not None else G.bf16_bits(kv)
                at = 0
                for dst in _ring_views(self.state.cache(lid).ring, p0, keep, W):
                    dst[...] = kvb[at:at + dst.shape[0]]
                    at += dst.shape[0]

    # ------------------------------------------------------------------ drafting
    def draft(self, anchor, sampler=None, capture: list | None = None) -> DSparkDraft:
        from memra_dsv4.oracle.model import check_token_scalar
        self._check_begun("draft")
        if self.n_ctx == 0:
            raise ValueError("DSpark draft: no context rows yet (propose with the prompt first)")
        a = check_token_scalar(anchor, self.cfg.vocab_size, "anchor")
        if a is None:
            raise ValueError(f"anchor = {anchor!r} must be one token id")
        return self._draft(a, sampler or greedy, capture)

    def _draft(self, anchor: int, pick, cap, diagnostics: bool = True) -> DSparkDraft:
        """``diagnostics``: read U and h back into the draft (``draft``); ``propose`` does not
        need them (base_logits / hidden None: two readbacks fewer per round)."""
        cp = _cp()
        model, st, cfg, B = self.model, self.stage, self.cfg, self.B
        p = self.n_ctx - 1
        ids = np.full(B, int(cfg.dspark_noise_token_id), dtype=np.int64)
        ids[0] = anchor
        model.clear_chunk_memo()
        e = embed_rows(model, ids, st.device)
        dev = model.devs[st.device]
        with cp.cuda.Device(st.device), dev.compute, phase("draft/dspark"):
            streams = cp.ascontiguousarray(
                cp.broadcast_to(e[:, None, :], (B, cfg.hc_mult, cfg.hidden_size)))
            ids_d = cp.asarray(ids)
            for s, lid in enumerate(self.lids):
                c = {} if cap is not None else None
                blk = DSparkBlock(model, st, lid, f"draft/dspark/stage{s}")
                streams = blk.forward(streams, ids_d, self.state.cache(lid), p + 1, c)
                if c is not None:
                    cap.append({k: cp.asnumpy(c[k]) for k in
                                ("attn_norm", "attn.q", "attn.kv", "attn.rows", "block.out")})
            with phase("draft/dspark/head"):
                U, h, _ = model._head(st, streams, all_rows=True, prefix=f"mtp.{N_STAGES - 1}.")
            with phase("draft/dspark/markov"):
                tokens, logits, conf = self._markov(U, h, anchor, pick)
            U_h, h_h = (cp.asnumpy(U), cp.asnumpy(h)) if diagnostics else (None, None)
        return DSparkDraft(tokens=tokens, logits=logits, confidence=conf, base_logits=U_h,
                           hidden=h_h, start_pos=p)

    def _markov(self, U, h, anchor: int, pick):
        """The Markov loop and the confidence logits (module doc): (tokens int64 [B], biased
        logits float32 [B, V] NumPy, confidence float32 [B] NumPy)."""
        cp = _cp()
        st = self.stage
        pre = f"mtp.{N_STAGES - 1}."
        g = self.model.gemm[st.device]
        w1 = st[f"{pre}markov_head.markov_w1"]        # [V, rank] bf16 bits
        w2 = st[f"{pre}markov_head.markov_w2"]        # [V, rank] bf16 bits
        proj = st[f"{pre}confidence_head.proj"]       # [1, D + rank] bf16 bits
        assert w1.dtype == cp.uint16 and w2.shape == w1.shape and proj.shape[0] == 1, \
            (w1.dtype, w1.shape, w2.shape, proj.shape)
        out, logits = [anchor], []
        for k in range(self.B):
            e = w1[out[k]:out[k] + 1]                  # [1, rank] bits: the token's row
            bias = G.linear(g, e, w2, "bf16")          # stored, as ops.linear(.., "bf16")
            lk = (U[k].astype(cp.float64) + bias[0].astype(cp.float64)).astype(cp.float32)
            lk_h = cp.asnumpy(lk)                      # the host wait: the sampler needs it
            logits.append(lk_h)
            out.append(int(pick(lk_h)))
        # confidence: ops.linear(.., "f32") = the float64 product of the unrounded inputs,
        # rounded to f32 (a 1-wide GEMM: cuBLASLt refuses N = 1, so the float64 matvec here)
        e_rows = G.to_f32(w1[cp.asarray(np.array(out[:-1], dtype=np.int64))])   # [B, rank]
        X = cp.concatenate([h.astype(cp.float64), e_rows.astype(cp.float64)], axis=1)
        conf = (X @ G.to_f32(proj)[0].astype(cp.float64)).astype(cp.float32)
        return (np.array(out[1:], dtype=np.int64), np.stack(logits), cp.asnumpy(conf))

    # ------------------------------------------------------------------ protocol
    def propose(self, hc_rows, next_tokens, k: int, sampler=None):
        self._check_begun("propose")
        shape = tuple(hc_rows.shape)
        ids, kk = check_dspark_propose(self.cfg, next_tokens, shape[0] if shape else 0, k)
        self.write_context(hc_rows)
        d = self._draft(int(ids[-1]), sampler or greedy, None, diagnostics=False)
        self.last_confidence = d.confidence[:kk]   # for a confidence schedule (oracle.spec)
        return d.tokens[:kk], d.logits[:kk]
