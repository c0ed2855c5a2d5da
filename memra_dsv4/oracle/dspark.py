"""The DSpark drafter of DeepSeek-V4-Flash-0731 on the oracle (dsv4_speculative.md 2.1-2.6).

Inputs from the trunk: the OUTPUT streams [hc, dim] of trunk blocks ``dspark_target_layer_ids``
for every committed position; the feature of a position is the concatenation of their hc-means
(``store(mean over hc)``), [n_taps * dim].

``DSparkDrafter()`` follows the drafter protocol of ``memra_dsv4.oracle.spec``:
``begin(oracle, max_seq_len)``, ``trunk_taps(oracle) -> layer ids`` (so that
``speculative_generate`` hands it tap rows instead of the final streams) and
``propose(tap_rows [m, n_taps, hc, dim], next_tokens [m], k, sampler) -> (tokens, logits)``:
the m rows are positions P..P+m-1 (P = ``self.n_ctx``, every committed position not yet seen);
their context rows ``kv_norm(wkv(main_norm(main_proj(feature))))`` (RoPE at the position, FP8
round trip of the nope dims) are written into each stage's window ring (slot pos % W; at
prefill only the last <= W rows are computed).  Only committed positions ever reach the rings.
Then one round is drafted with anchor = next_tokens[-1]: ``draft(anchor)``.

``draft(anchor, sampler=None, capture=None) -> DSparkDraft`` (p = n_ctx - 1, the last context
position): block ids [anchor, noise x (B-1)] at positions p+1..p+B run through the three
stages (V4 blocks whose attention is DSparkAttention: window ring rows of positions
max(0, p-W+1)..p plus all B block rows, bidirectional inside the block, sinks); stage 2's
hc_head / norm / the shared head give U_k and h_k; the Markov loop
``logits_k = U_k + markov_w2(markov_w1[out[k]])``, ``out[k+1] = sampler(logits_k)`` (out[0] =
anchor) gives B drafts; ``conf_k = proj([h_k ; markov_w1[out[k]]])`` (raw logits, sigmoid is
the consumer's).  ``propose`` returns the first min(k, B) drafts and their biased logits and
keeps their confidence logits in ``last_confidence`` (the input of
``host.spec_schedule.verify_length``).  At temperature > 0 the Markov loop samples each draft
with the loop's sampler from its biased logits, and those logits are what the acceptance test
uses as the draft distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memra_dsv4.config import DRAFTER_DSPARK
from memra_dsv4.oracle import ops
from memra_dsv4.oracle._blas import single_threaded_blas
from memra_dsv4.oracle.sampling import greedy
from memra_dsv4.oracle.state import DEFAULT_MAX_SEQ_LEN

__all__ = ["DSparkDraft", "DSparkDrafter", "check_dspark_config", "check_tap_rows",
           "check_dspark_propose"]


def check_dspark_config(cfg, who: str = "DSparkDrafter"):
    """``cfg`` if it has a DSpark drafter, else the ValueError naming its kind (shared with
    gpu.dspark.GpuDSparkDrafter)."""
    if cfg.drafter_kind != DRAFTER_DSPARK:
        raise ValueError(f"{who}: config {cfg.name!r} has drafter kind "
                         f"{cfg.drafter_kind!r}, not a DSpark drafter (no dspark_* keys / "
                         f"main_proj; use MtpDrafter for an MTP checkpoint)")
    return cfg


def check_tap_rows(cfg, n_ctx: int, max_seq_len: int, shape: tuple, kind: str) -> int:
    """m, the number of tap rows of ``shape`` / dtype ``kind``, after the checks a context write
    makes before any work (shared with the GPU drafter: the same messages): the shape
    [m >= 1, n_taps, hc, dim], floating point, positions n_ctx..n_ctx+m-1 within max_seq_len.
    (Finiteness is the caller's check: on the host here, on the device there.)"""
    nt = len(cfg.dspark_target_layer_ids)
    if len(shape) != 4 or tuple(shape[1:]) != (nt, cfg.hc_mult, cfg.hidden_size) or shape[0] == 0:
        raise ValueError(f"tap_rows must be [m >= 1, {nt}, {cfg.hc_mult}, "
                         f"{cfg.hidden_size}], got shape {tuple(shape)}")
    if kind != "f":
        raise ValueError("tap_rows must be finite floating point")
    m = int(shape[0])
    if n_ctx + m > max_seq_len:
        raise ValueError(f"DSpark: positions up to {n_ctx + m - 1} exceed max_seq_len "
                         f"{max_seq_len}")
    return m


def check_dspark_propose(cfg, next_tokens, n_rows: int, k) -> tuple[np.ndarray, int]:
    """(ids int64 [m], drafts returned = min(k, B)) of a propose call, after its checks (shared
    with the GPU drafter: the same messages): ``next_tokens`` ids in the vocabulary, one per tap
    row; k an integer in 1..MAX_DRAFT (a block drafts B; the first min(k, B) are returned)."""
    from memra_dsv4.oracle.decode import MAX_DRAFT
    from memra_dsv4.oracle.model import check_token_ids
    ids = check_token_ids(next_tokens, cfg.vocab_size, "next_tokens")
    if ids.shape[0] != n_rows:
        raise ValueError(f"next_tokens has {ids.shape[0]} entries but the tap rows have "
                         f"{n_rows}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"k = {k!r} drafts; k must be an integer in 1..{MAX_DRAFT}")
    return ids, min(int(k), int(cfg.dspark_block_size))


@dataclass
class DSparkDraft:
    tokens: np.ndarray          # int64 [B]: out[1..B]
    logits: np.ndarray          # [B, vocab] Markov-biased logits
    confidence: np.ndarray      # [B] raw confidence logits
    base_logits: np.ndarray     # [B, vocab] U_k
    hidden: np.ndarray          # [B, dim] h_k (stage 2 hc_head output, pre-norm)
    start_pos: int              # p: the block sits at p+1..p+B


class DSparkDrafter:
    name = "dspark"
    last_confidence = None   # [k] confidence logits of the last proposal (set by propose)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check(oracle):
        return check_dspark_config(oracle.config)

    def trunk_taps(self, oracle) -> tuple[int, ...]:
        return tuple(int(t) for t in self._check(oracle).dspark_target_layer_ids)

    def begin(self, oracle, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> None:
        from memra_dsv4.oracle.model import _Layer
        cfg = self._check(oracle)
        self.oracle, self.cfg, self.pol = oracle, cfg, oracle.pol
        self.max_seq_len = int(max_seq_len)
        n = cfg.num_hidden_layers
        self.stages = [_Layer(oracle, f"mtp.{s}", n + s) for s in range(3)]
        self.B = int(cfg.dspark_block_size)
        self.W = int(cfg.sliding_window)
        self.rings = [np.zeros((self.W, cfg.head_dim), dtype=self.pol.dtype) for _ in range(3)]
        self.n_ctx = 0            # positions 0..n_ctx-1 have context rows (committed)
        self.last_confidence = None

    # --------------------------------------------------------------- context
    def features(self, tap_rows) -> np.ndarray:
        """[m, n_taps, hc, dim] tap streams -> [m, n_taps * dim] (hc-means, stored)."""
        t = np.asarray(tap_rows)
        f = self.pol.store(t.astype(np.float64).mean(axis=2))
        return f.reshape(t.shape[0], -1)

    def context_rows(self, feats, positions):
        """One context row per stage for features [m, n_taps*dim] at ``positions``."""
        pol, cfg = self.pol, self.cfg
        s0 = self.stages[0]
        mx = ops.linear(feats, s0.w("main_proj.weight"), "fp8", pol=pol)
        mx = ops.rmsnorm(mx, s0.w("main_norm.weight"), cfg.rms_norm_eps, pol=pol)
        out = []
        for st in self.stages:
            cos, sin = st.rope(positions)
            out.append(st.kv_path(mx, cos, sin))
        return out

    def write_context(self, tap_rows) -> None:
        """Commit context rows for positions n_ctx..n_ctx+m-1 into all three rings."""
        t = np.asarray(tap_rows)
        if t.dtype.kind == "f" and not np.isfinite(t).all():
            raise ValueError("tap_rows must be finite floating point")
        m = check_tap_rows(self.cfg, self.n_ctx, self.max_seq_len, t.shape, t.dtype.kind)
        keep = min(m, self.W)                 # older rows would be overwritten anyway
        pos = self.n_ctx + np.arange(m - keep, m, dtype=np.int64)
        rows = self.context_rows(self.features(t[m - keep:]), pos)
        for ring, r in zip(self.rings, rows):
            ring[pos % self.W] = r
        self.n_ctx += m

    # ----------------------------------------------------------------- draft
    def _stage(self, st, streams, ids, ring, positions, cap):
        cfg, pol = self.cfg, self.pol
        p = int(positions[0]) - 1
        x, post, comb = st.hc_pre(streams, "attn")
        xn = ops.rmsnorm(x, st.w("attn_norm.weight"), cfg.rms_norm_eps, pol=pol)
        cos, sin = st.rope(positions)
        _, q = st.q_path(xn, cos, sin)
        kv = st.kv_path(xn, cos, sin)
        hist_pos = np.arange(max(0, p - self.W + 1), p + 1, dtype=np.int64)
        rows = np.concatenate([ring[hist_pos % self.W], kv], axis=0)
        cand = np.tile(np.arange(rows.shape[0], dtype=np.int32), (ids.shape[0], 1))
        o_raw = st.attend(q, rows, cand)
        _, a = st.out_proj(o_raw, cos, sin)
        s1 = ops.hc_post(a, streams, post, comb, pol=pol)
        x, post, comb = st.hc_pre(s1, "ffn")
        xn2 = ops.rmsnorm(x, st.w("ffn_norm.weight"), cfg.rms_norm_eps, pol=pol)
        f = st.moe(xn2, ids, None)
        s2 = ops.hc_post(f, s1, post, comb, pol=pol)
        if cap is not None:
            cap.append({"attn_norm": xn, "attn.q": q, "attn.kv": kv, "attn.rows": rows,
                        "attn.o_raw": o_raw, "block.out": s2})
        return s2

    def draft(self, anchor, sampler=None, capture: list | None = None) -> DSparkDraft:
        if self.n_ctx == 0:
            raise ValueError("DSpark draft: no context rows yet (propose with the prompt first)")
        with single_threaded_blas():
            return self._draft(int(anchor), sampler or greedy, capture)

    def _draft(self, anchor, pick, cap) -> DSparkDraft:
        o, cfg, pol, B = self.oracle, self.cfg, self.pol, self.B
        p = self.n_ctx - 1
        ids = np.full(B, int(cfg.dspark_noise_token_id), dtype=np.int64)
        ids[0] = anchor
        positions = p + 1 + np.arange(B, dtype=np.int64)
        streams = np.repeat(o._embed(ids)[:, None, :], cfg.hc_mult, axis=1)
        for st, ring in zip(self.stages, self.rings):
            streams = self._stage(st, streams, ids, ring, positions, cap)
        h, _, U = o._head(streams, "mtp.2.", slice(None))
        w1 = o.weight("mtp.2.markov_head.markov_w1")
        w2 = o.weight("mtp.2.markov_head.markov_w2")
        proj = o.weight("mtp.2.confidence_head.proj")
        out = [anchor]
        logits, conf = [], []
        for k in range(B):
            e = w1[out[k]][None]
            lk = pol.f32(U[k].astype(np.float64) + ops.linear(e, w2, "bf16", pol=pol)[0])
            conf.append(ops.linear(np.concatenate([h[k][None], e], axis=1), proj, "f32",
                                   pol=pol)[0, 0])
            logits.append(lk)
            out.append(int(pick(lk)))
        return DSparkDraft(tokens=np.array(out[1:], dtype=np.int64), logits=np.stack(logits),
                           confidence=np.array(conf, dtype=pol.dtype), base_logits=U,
                           hidden=h, start_pos=p)

    # -------------------------------------------------------------- protocol
    def propose(self, hc_rows, next_tokens, k: int, sampler=None):
        rows = np.asarray(hc_rows)
        ids, kk = check_dspark_propose(self.cfg, next_tokens, rows.shape[0] if rows.ndim else 0, k)
        with single_threaded_blas():
            self.write_context(rows)
        d = self.draft(ids[-1], sampler)
        self.last_confidence = d.confidence[:kk]   # for a confidence schedule (spec.py)
        return d.tokens[:kk], d.logits[:kk]
