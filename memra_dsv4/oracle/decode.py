"""The oracle's decode state machine: prefill into a state, one-token decode, chunked prefill,
and the batched speculative ``verify`` with its ``commit`` / rollback.

Reference: /work/shared/reference/dsv4_attention.md 4 (compressor), 6 (index layout), 7 (state
machine, reset hazard 7.3, consistency contract 7.4); dsv4_speculative.md 4.2 (rollback).

ONE routine, ``forward_chunk``, runs positions p0..p0+S-1 of a sequence against a
``DecodeState``: ``prefill_state`` is a chunk from a reset state at p0 = 0, ``decode_step`` a
chunk of one token, ``prefill_chunk`` a chunk of any length, ``verify`` a chunk of k+1 tokens
that keeps a rollback journal, and ``Oracle.prefill`` / ``Oracle.mtp_forward`` are a chunk at
p0 = 0 on a fresh state sized to the input (with ``capture`` / ``force_decisions``, which the
chunk routine takes for any p0).  Per layer it uses the per-token methods of ``model._Layer``
with the canonical candidate layout of
``memra_dsv4.host.indices`` (window chronological, W wide; compressed entries ascending), so a
position's result does not depend on how the sequence was split (tests:
tests/test_oracle_decode.py, bit-equal in every class).

Chunk semantics (7.4): window vectors of earlier positions come from the ring; chunk tokens go
through the compressor state machine (the pending rows are prepended: the current block's
pending tokens, and for ratio 4 the previous block's rows as the overlap half); an entry
emitted inside the chunk is visible to chunk token t iff (k+1)*r <= t+1; the ring is written
after the chunk's reads (with S > W only the last W survive).

API (methods of ``Oracle`` via ``DecodeMixin``; also plain functions here)
--------------------------------------------------------------------------
``oracle.new_state(max_seq_len=4096) -> DecodeState``      fresh state (position 0)
``oracle.prefill_state(tokens, state=None, all_logits=False) -> StepOut``
    Starts a NEW sequence: the state is reset first (a fresh one is made when None), then
    ``tokens`` run as one chunk.  ``Oracle.prefill`` runs the same chunk on a private fresh
    state (and returns no state).
``oracle.decode_step(state, token) -> logits [vocab]``     one token at position state.pos
``oracle.prefill_chunk(state, tokens, all_logits=False) -> logits``   a chunk of any length
``oracle.verify(state, tokens) -> logits [k+1, vocab]``    speculative verify (below)
``oracle.commit(state, n_accepted)``                       keep / roll back (below)
``oracle.new_mtp_state()``, ``oracle.mtp_propose(...)``    the MTP drafter (oracle/spec.py)

Logits are float32 (float64 for ``exact``), like ``Oracle.prefill``.  ``StepOut.streams``
holds the pre-hc_head streams [S, hc, dim] of the chunk rows (the MTP input).

Verify / commit convention
--------------------------
``verify(state, [t_last, d1, .., dk])`` processes positions pos .. pos+k in one batched pass
(t_last is the newest token not yet fed, e.g. the previous round's bonus token; d_i are the
drafts for positions pos+i) and returns k+1 logits rows; row i predicts position pos+i+1.  It
journals, per layer, what a rollback needs: the ring slots it overwrites (old rows) and its own
window vectors, the compressor and indexer-compressor pending rows and its projections, and
the counts of compressed / indexer rows before it (those caches are append-only and
position-addressed, row k = entry k, so the rows a verify emits are exactly the rows past the
saved count; a rollback truncates them, zeroing the rows).  The rollback rebuilds the pending
rows by replaying the kept positions' projections through the state machine (pure data
movement) and gives every overwritten ring slot the newest KEPT position's vector, else its
old row (this also covers k + 1 > W, where one verify writes a slot twice).  Until ``commit`` the state refuses every
call except ``commit`` and ``prefill_state`` (which resets).
``commit(state, n)`` with 0 <= n <= k keeps positions pos .. pos+n (t_last and the first n
drafts) and rolls back pos+n+1 .. pos+k: afterwards ``state.pos`` = old pos + n + 1 and the state
is exactly (array for array) what plain ``decode_step`` of those n+1 tokens leaves.  The bonus
token (argmax / sample of row n) is NOT in the state: feed it as t_last of the next verify (or
to ``decode_step``).  k ranges over 1 .. MAX_DRAFT.

Bad input (ids out of range, a position past max_seq_len, k out of range, n > k, a state of
another config / class, calls in the wrong order) raises ValueError naming the problem before
anything is written: the state is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.host import indices as hidx
from memra_dsv4.oracle import ops
from memra_dsv4.oracle._blas import single_threaded_blas
from memra_dsv4.oracle.state import DEFAULT_MAX_SEQ_LEN, CompressorState, DecodeState, LayerCache

__all__ = [
    "StepOut", "VerifyJournal", "MAX_DRAFT", "DecodeMixin", "new_state", "prefill_state",
    "decode_step", "prefill_chunk", "verify", "commit", "forward_chunk", "run_chunk",
    "check_state",
]

MAX_DRAFT = 16


@dataclass
class StepOut:
    logits: np.ndarray                    # [vocab] (last position) or [S, vocab]
    streams: np.ndarray                   # [S, hc, dim] pre-hc_head streams of the chunk rows
    state: DecodeState
    numerics: str = "bf16"

    @property
    def hc_state(self) -> np.ndarray:
        """[hc, dim] pre-hc_head streams of the last position."""
        return self.streams[-1]


@dataclass
class _LayerJournal:
    slots: np.ndarray                     # ring slots the verify wrote (unique)
    old_rows: np.ndarray                  # their rows before the verify
    kv: np.ndarray                        # the verify's window vectors [S, hd]
    comp_state: CompressorState | None = None
    comp_az: tuple | None = None          # (a, z) [S, coff*d] of the verify positions
    n_comp: int = 0
    idx_state: CompressorState | None = None
    idx_az: tuple | None = None
    n_idx: int = 0


@dataclass
class VerifyJournal:
    p0: int
    k: int
    last_hc: np.ndarray | None
    streams: np.ndarray                   # [k+1, hc, dim]
    layers: list[_LayerJournal] = field(default_factory=list)


# ----------------------------------------------------------------------------- checks
def _ids(oracle, tokens, what: str) -> np.ndarray:
    from memra_dsv4.oracle.model import check_token_ids
    return check_token_ids(tokens, oracle.config.vocab_size, what)


def _token(oracle, token) -> np.ndarray:
    t = np.asarray(token)
    if t.ndim != 0:
        raise ValueError(f"token must be one integer id, got shape {t.shape} "
                         f"(use prefill_chunk for several tokens)")
    return _ids(oracle, t.reshape(1), "token")


def check_state(oracle, state, role: str = "trunk") -> DecodeState:
    """The state must be a DecodeState built for this oracle's config, class and role."""
    if not isinstance(state, DecodeState):
        raise ValueError(f"state must be a DecodeState (from oracle.new_state()), got "
                         f"{type(state).__name__}")
    if state.role != role:
        raise ValueError(f"state is a {state.role!r} state; this call needs a {role!r} state")
    if state.config is not oracle.config and state.config != oracle.config:
        raise ValueError(f"state was built for config {getattr(state.config, 'name', '?')!r}, "
                         f"not this oracle's {oracle.config.name!r}")
    if state.numerics != oracle.numerics:
        raise ValueError(f"state was built for numerics {state.numerics!r}, not this "
                         f"oracle's {oracle.numerics!r}")
    return state


# The verify / commit call checks below are shared with the GPU path (gpu/verify.py): both
# states carry ``pos``, ``max_seq_len`` and ``journal`` (with ``p0`` and ``k``).
def check_room(state, n: int, what: str) -> None:
    if state.pos + n > state.max_seq_len:
        raise ValueError(f"{what}: positions {state.pos}..{state.pos + n - 1} exceed "
                         f"max_seq_len {state.max_seq_len} (state.pos = {state.pos})")


def check_no_journal(state, what: str) -> None:
    if state.journal is not None:
        raise ValueError(f"{what}: the state has an uncommitted verify of "
                         f"{state.journal.k + 1} tokens at position {state.journal.p0}; "
                         f"call commit(state, n_accepted) first")


def check_draft_count(ids: np.ndarray) -> int:
    """k of verify tokens [t_last, d1..dk], refused outside 1..MAX_DRAFT."""
    k = ids.shape[0] - 1
    if not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"verify: k = {k} drafts (tokens = [t_last, d1..dk] has "
                         f"{ids.shape[0]} entries); k must be in 1..{MAX_DRAFT}")
    return k


def check_commit(journal, n_accepted) -> int:
    """n of commit(state, n) for the pending ``journal``, refused unless an integer in 0..k."""
    if journal is None:
        raise ValueError("commit: the state has no uncommitted verify (call verify first)")
    if isinstance(n_accepted, bool) or not isinstance(n_accepted, (int, np.integer)):
        raise ValueError(f"commit: n_accepted must be an integer, got {n_accepted!r}")
    n = int(n_accepted)
    if not 0 <= n <= journal.k:
        raise ValueError(f"commit: n_accepted = {n} is outside 0..k = 0..{journal.k} (the verify "
                         f"had {journal.k} drafts)")
    return n


# --------------------------------------------------------------------------- attention
def _attention_chunk(layer, cache: LayerCache, x, p0: int, jl: list | None, cap=None,
                     force=None):
    """The attention sub-layer for positions p0..p0+S-1 against ``cache`` (M:484-543); updates
    the cache (ring after the reads, entries, pending rows) and, when ``jl`` is a list, appends
    the layer's rollback journal to it.  ``cap``: a dict that receives the attention captures
    (model.py doc; "attn.comp" / "attn.index.keys" are every entry / key of the sequence so
    far); ``force``: a forced "attn.index.sel" [S, w] (CSA layers)."""
    cfg = layer.cfg
    S = x.shape[0]
    W = cfg.sliding_window
    pos = p0 + np.arange(S, dtype=np.int64)
    cos, sin = layer.rope(pos)
    qr, q = layer.q_path(x, cos, sin)
    kv = layer.kv_path(x, cos, sin)

    # window: earlier positions from the ring (chronological), then the chunk's own vectors
    h0 = max(0, p0 - W)
    hist = cache.ring[np.arange(h0, p0, dtype=np.int64) % W]
    win = hidx.window_matrix(S, W, start=p0)
    win = np.where(win >= 0, win - h0, -1).astype(np.int32)
    rows = [hist, kv]
    offset = hist.shape[0] + S

    comp_sel = None
    new_ent = new_keys = None
    az = idx_az = None
    if cache.ratio:
        if cache.kind == "csa":
            new_keys, ia, iz = layer.compress(x, p0, cache.idx_state, indexer=True)
            idx_az = (ia, iz)
            keys = np.concatenate([cache.idx_keys.view(), new_keys], axis=0)
            comp_sel = layer.indexer_select(x, qr, keys, pos, cos, sin, cap, force)
        else:
            comp_sel = hidx.hca_matrix(S, cache.ratio, start=p0)
        new_ent, ca, cz = layer.compress(x, p0, cache.comp_state, indexer=False)
        az = (ca, cz)
        rows.append(cache.comp.view())
        rows.append(new_ent)
    cand = hidx.candidate_matrix(win, comp_sel, offset=offset)
    o = layer.attend(q, np.concatenate(rows, axis=0), cand)
    o, out = layer.out_proj(o, cos, sin)
    if cap is not None:
        cap.update({"attn.qr": qr, "attn.q": q, "attn.kv": kv, "attn.cand": cand,
                    "attn.o": o, "attn.out": out})
        if cache.ratio:
            cap["attn.comp"] = np.concatenate([cache.comp.view(), new_ent], axis=0)

    # ---- writes (after every read)
    keep = pos[-min(S, W):]
    slots = keep % W
    if jl is not None:
        j = _LayerJournal(slots=slots.copy(), old_rows=cache.ring[slots].copy(), kv=kv.copy())
        if cache.ratio:
            j.comp_state, j.comp_az, j.n_comp = cache.comp_state.copy(), az, cache.comp.n
        if cache.kind == "csa":
            j.idx_state, j.idx_az, j.n_idx = cache.idx_state.copy(), idx_az, cache.idx_keys.n
        jl.append(j)
    cache.ring[slots] = kv[-len(keep):]
    if cache.ratio:
        cache.comp.append(new_ent)
        cache.comp_state.advance(*az, p0)
    if cache.kind == "csa":
        cache.idx_keys.append(new_keys)
        cache.idx_state.advance(*idx_az, p0)
    return out


def block_chunk(layer, cache: LayerCache, streams, token_ids, p0: int, jl: list | None = None,
                cap: dict | None = None, force: dict | None = None):
    """One block (hc_pre, attention, hc_post, hc_pre, MoE, hc_post) over a chunk.  ``cap``: a
    dict that receives the block's captures (names in the model.py doc); ``force``: a dict
    with "moe.idx" [S, k] and/or "attn.index.sel" [S, w] to replay instead of recompute."""
    cfg, pol = layer.cfg, layer.pol
    force = force or {}
    x, post, comb = layer.hc_pre(streams, "attn")
    xn = ops.rmsnorm(x, layer.w("attn_norm.weight"), cfg.rms_norm_eps, pol=pol)
    a = _attention_chunk(layer, cache, xn, p0, jl, cap, force.get("attn.index.sel"))
    s1 = ops.hc_post(a, streams, post, comb, pol=pol)
    if cap is not None:
        cap.update({"hc_attn.x": x, "hc_attn.post": post, "hc_attn.comb": comb,
                    "attn_norm": xn, "attn.streams": s1})
    x, post, comb = layer.hc_pre(s1, "ffn")
    xn = ops.rmsnorm(x, layer.w("ffn_norm.weight"), cfg.rms_norm_eps, pol=pol)
    f = layer.moe(xn, token_ids, cap, force.get("moe.idx"))
    s2 = ops.hc_post(f, s1, post, comb, pol=pol)
    if cap is not None:
        cap.update({"hc_ffn.x": x, "hc_ffn.post": post, "hc_ffn.comb": comb,
                    "ffn_norm": xn, "block.out": s2})
    return s2


def forward_chunk(oracle, state: DecodeState, ids: np.ndarray, *, all_logits: bool = False,
                  journal: VerifyJournal | None = None) -> StepOut:
    """Trunk forward of validated ids at positions state.pos.. (no checks; advances pos)."""
    with single_threaded_blas():
        return _forward_chunk(oracle, state, ids, all_logits, journal)


def _forward_chunk(oracle, state, ids, all_logits, journal) -> StepOut:
    logits, streams, _ = run_chunk(oracle, state, ids, all_logits, journal)
    return StepOut(logits=logits, streams=streams, state=state, numerics=oracle.numerics)


def run_chunk(oracle, state: DecodeState, ids: np.ndarray, all_logits: bool = False,
              journal: VerifyJournal | None = None, caps: list | None = None,
              force_decisions=None):
    """The chunk routine (no checks, no BLAS thread setting; advances pos): trunk forward of
    validated ids at positions state.pos...  ``caps``: a list that receives one capture dict
    per trunk block; ``force_decisions``: one dict per trunk block (``block_chunk``).  Returns
    (logits [vocab] or [S, vocab], streams [S, hc, dim], top captures or None)."""
    cfg = oracle.config
    p0 = state.pos
    e = oracle._embed(ids)
    streams = np.repeat(e[:, None, :], cfg.hc_mult, axis=1)
    taps = getattr(state, "tap_layers", None)    # DSpark: trunk block outputs to keep
    tapped = [] if taps else None
    for i, (layer, cache) in enumerate(zip(oracle.layers, state.layers)):
        jl = journal.layers if journal is not None else None
        cap = {} if caps is not None else None
        streams = block_chunk(layer, cache, streams, ids, p0, jl, cap,
                              None if force_decisions is None else force_decisions[i])
        if caps is not None:
            caps.append(cap)
        if tapped is not None and i in taps:
            tapped.append(streams)
    if tapped is not None:
        state.tap_streams = tapped               # output streams of the tap layers, in order
    rows = slice(None) if all_logits else slice(-1, None)
    y, yn, logits = oracle._head(streams, "", rows)
    state.pos = p0 + ids.shape[0]
    state.last_hc = streams[-1].copy()
    top = {"embed": e, "hc_head": y, "final_norm": yn} if caps is not None else None
    return (logits if all_logits else logits[0]), streams, top


# -------------------------------------------------------------------------------- API
def new_state(oracle, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> DecodeState:
    """A fresh trunk state (position 0) for ``oracle``."""
    return DecodeState.create(oracle.config, oracle.numerics, oracle.pol.dtype,
                              range(oracle.config.num_hidden_layers), max_seq_len)


def prefill_state(oracle, tokens, state: DecodeState | None = None, *,
                  all_logits: bool = False) -> StepOut:
    """Start a new sequence: reset ``state`` (or make one), run ``tokens`` from position 0."""
    if state is None:
        state = new_state(oracle)
    check_state(oracle, state)
    ids = _ids(oracle, tokens, "tokens")
    if ids.shape[0] > state.max_seq_len:
        raise ValueError(f"prompt of {ids.shape[0]} tokens exceeds max_seq_len "
                         f"{state.max_seq_len}")
    state.reset()
    return forward_chunk(oracle, state, ids, all_logits=all_logits)


def prefill_chunk(oracle, state: DecodeState, tokens, *, all_logits: bool = False) -> np.ndarray:
    """Continue the sequence of ``state`` by ``tokens`` (any length >= 1); logits of the last
    position ([vocab]) or of every chunk position ([S, vocab])."""
    check_state(oracle, state)
    check_no_journal(state, "prefill_chunk")
    ids = _ids(oracle, tokens, "tokens")
    check_room(state, ids.shape[0], "prefill_chunk")
    return forward_chunk(oracle, state, ids, all_logits=all_logits).logits


def decode_step(oracle, state: DecodeState, token) -> np.ndarray:
    """Consume one token at position state.pos; logits [vocab] of that position."""
    check_state(oracle, state)
    check_no_journal(state, "decode_step")
    ids = _token(oracle, token)
    check_room(state, 1, "decode_step")
    return forward_chunk(oracle, state, ids).logits


def verify(oracle, state: DecodeState, tokens, *, return_streams: bool = False):
    """Speculative verify of [t_last, d1..dk] at positions pos..pos+k (see the module doc).
    Returns logits [k+1, vocab] (and the streams [k+1, hc, dim] with ``return_streams``)."""
    check_state(oracle, state)
    check_no_journal(state, "verify")
    ids = _ids(oracle, tokens, "tokens")
    k = check_draft_count(ids)
    check_room(state, k + 1, "verify")
    jr = VerifyJournal(p0=state.pos, k=k, last_hc=state.last_hc, streams=None)
    out = forward_chunk(oracle, state, ids, all_logits=True, journal=jr)
    jr.streams = out.streams
    state.journal = jr
    return (out.logits, out.streams) if return_streams else out.logits


def _rollback_layer(cache: LayerCache, j: _LayerJournal, p0: int, last_kept: int) -> None:
    W = cache.window
    n_keep = last_kept - p0 + 1
    # ring: each written slot gets the newest KEPT position mapping to it, else its old row
    src = hidx.ring_rollback_sources(j.slots, p0, last_kept, W)
    for slot, old, i in zip(j.slots, j.old_rows, src):
        cache.ring[slot] = j.kv[i] if i >= 0 else old
    if cache.ratio:
        cache.comp_state = j.comp_state.copy()
        cache.comp_state.advance(j.comp_az[0][:n_keep], j.comp_az[1][:n_keep], p0)
        cache.comp.truncate((last_kept + 1) // cache.ratio)
    if cache.kind == "csa":
        cache.idx_state = j.idx_state.copy()
        cache.idx_state.advance(j.idx_az[0][:n_keep], j.idx_az[1][:n_keep], p0)
        cache.idx_keys.truncate((last_kept + 1) // 4)


def commit(oracle, state: DecodeState, n_accepted) -> None:
    """Keep positions pos..pos+n of the last verify, roll back the rest (module doc)."""
    check_state(oracle, state)
    jr = state.journal
    n = check_commit(jr, n_accepted)
    last_kept = jr.p0 + n
    if n < jr.k:
        for cache, j in zip(state.layers, jr.layers):
            _rollback_layer(cache, j, jr.p0, last_kept)
    state.pos = last_kept + 1
    state.last_hc = jr.streams[n].copy()
    state.journal = None


# ------------------------------------------------------------------------------ mixin
class DecodeMixin:
    """The decode / speculative API as ``Oracle`` methods (implemented in this module and
    ``memra_dsv4.oracle.spec``)."""

    def new_state(self, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> DecodeState:
        return new_state(self, max_seq_len)

    def prefill_state(self, tokens, state: DecodeState | None = None, *,
                      all_logits: bool = False) -> StepOut:
        return prefill_state(self, tokens, state, all_logits=all_logits)

    def decode_step(self, state: DecodeState, token) -> np.ndarray:
        return decode_step(self, state, token)

    def prefill_chunk(self, state: DecodeState, tokens, *, all_logits: bool = False):
        return prefill_chunk(self, state, tokens, all_logits=all_logits)

    def verify(self, state: DecodeState, tokens, *, return_streams: bool = False):
        return verify(self, state, tokens, return_streams=return_streams)

    def commit(self, state: DecodeState, n_accepted) -> None:
        return commit(self, state, n_accepted)

    def new_mtp_state(self, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> DecodeState:
        from memra_dsv4.oracle.spec import new_mtp_state
        return new_mtp_state(self, max_seq_len)

    def mtp_propose(self, mtp_state: DecodeState, hc_rows, next_tokens, k: int = 1, **kw):
        from memra_dsv4.oracle.spec import mtp_propose
        return mtp_propose(self, mtp_state, hc_rows, next_tokens, k, **kw)
