"""Speculative decoding on the oracle: the MTP block as a drafter with its own sliding-window
cache, and the draft / verify / commit loop (greedy: lossless by construction; sampled: the
min(1, p/q) rule of ``memra_dsv4.oracle.sampling.spec_accept``).

Reference: dsv4_model_and_formats.md 7 (MTP block, DeepSeek alignment), dsv4_speculative.md 3
(recursive MTP for k > 1, vLLM convention) and 4 (acceptance, rollback).

MTP drafter
-----------
``oracle.new_mtp_state(max_seq_len=4096)``: a ``DecodeState`` (role "mtp") holding one
``LayerCache`` for the MTP block (ratio 0: the window ring only).  MTP position i combines the
trunk's pre-hc_head streams of position i with the embedding of token i+1 and predicts token
i+2; its ring row i % W is written from that input (same positions as the trunk).

``oracle.mtp_propose(mtp_state, hc_rows, next_tokens, k=1, sampler=None) -> MtpDraft``
    ``hc_rows`` [m, hc, dim]: trunk streams of positions P..P+m-1 with P = mtp_state.pos (every
    trunk position not yet given to the MTP); ``next_tokens`` [m]: the tokens of positions
    P+1..P+m (the last one is the newest known token, e.g. the bonus).  These m rows are TRUE
    history: they are run as one chunk and stay in the MTP cache (mtp_state.pos += m).  The last
    row's logits give draft 1 (a prediction for position P+m+1).  For k > 1 the single MTP layer
    is re-applied recursively on a scratch copy of the cache (vLLM convention): step j takes the
    MTP block's own output streams of step j-1 as its "trunk state" and draft j-1 as its token.
    Scratch rows never reach ``mtp_state``.  ``sampler(logits) -> id`` picks each draft
    (default: greedy argmax).  Returns tokens [k] and the logits [k, vocab] they came from.
    The first row equals ``Oracle.mtp_forward`` of the whole history at its last row, and the
    recursive rows equal ``mtp_forward`` with the MTP's own output streams appended as rows
    (tests/test_oracle_spec.py, bit-equal).

Drafters and the loop
---------------------
A drafter has ``begin(oracle, max_seq_len)`` and ``propose(hc_rows, next_tokens, k, sampler)
-> (tokens [k], logits [k, V] or None)`` with the argument convention of ``mtp_propose``.
``MtpDrafter`` wraps the MTP block.  ``speculative_generate(oracle, prompt, max_new_tokens, k,
drafter=None, temperature=0.0, top_p=1.0, generator=None)`` runs:

    out = prefill_state(prompt); g = pick(out.logits); drafts = propose(out.streams, prompt[1:] + [g])
    repeat: logits = verify(state, [g] + drafts)        # positions pos..pos+k
            greedy: n = leading drafts equal to the argmax of their row; bonus = argmax(row n)
            sampled: (n, bonus) = spec_accept(p(rows), q(draft logits), drafts)
            commit(state, n); emit drafts[:n] + [bonus]; g = bonus
            drafts = propose(streams[:n + 1], drafts[:n] + [bonus], k)

so every emitted token is the target's own choice: the greedy tokens equal ``greedy_generate``
(plain prefill + decode_step) exactly.  The last round drafts at most (tokens still wanted - 1)
so exactly ``max_new_tokens`` come out.  ``SpecResult`` has the tokens and, per round, the
number drafted and accepted (bonus excluded); ``acceptance_rate`` = accepted / drafted,
``mean_accepted_length`` = tokens emitted per verify (accepted + bonus, the DSpark/vLLM
"acceptance length").

The loop itself is ``spec_loop(target, drafter, ...)``: the one copy of the acceptance rules,
driven by a target with ``prefill / verify / commit / decode_step`` (``_OracleTarget`` here,
``memra_dsv4.gpu.spec``'s on a Dsv4Gpu).  ``check_propose_args``, ``check_spec_args`` and
``check_spec_room`` are the argument checks the GPU drafter and the GPU loop share, so both refuse with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.host.spec_schedule import verify_length
from memra_dsv4.oracle._blas import single_threaded_blas
from memra_dsv4.oracle.decode import (MAX_DRAFT, block_chunk, check_state, commit, decode_step,
                                      new_state, prefill_state, verify)
from memra_dsv4.oracle.sampling import greedy, sample_from_probs, sampling_probs, spec_accept
from memra_dsv4.oracle.state import DEFAULT_MAX_SEQ_LEN, DecodeState

__all__ = [
    "MtpDraft", "new_mtp_state", "mtp_propose", "check_propose_args", "MtpDrafter", "default_drafter",
    "SpecResult",
    "check_spec_args", "check_spec_room", "spec_loop", "speculative_generate", "greedy_generate",
]


@dataclass
class MtpDraft:
    tokens: np.ndarray        # int64 [k]
    logits: np.ndarray        # [k, vocab]


# --------------------------------------------------------------------------------- MTP
def _mtp_layer(oracle):
    if not oracle.mtp_layers:
        raise ValueError(f"config {oracle.config.name!r} has no MTP block (drafter kind "
                         f"{oracle.config.drafter_kind!r})")
    return oracle.mtp_layers[0]


def new_mtp_state(oracle, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> DecodeState:
    layer = _mtp_layer(oracle)
    return DecodeState.create(oracle.config, oracle.numerics, oracle.pol.dtype, [layer.lid],
                              max_seq_len, role="mtp")


def _mtp_chunk(oracle, mstate: DecodeState, h: np.ndarray, ids: np.ndarray):
    """MTP block over rows at positions mstate.pos.. (no checks).  The same ops as
    ``Oracle.mtp_forward``.  Returns (logits of the last row [vocab], output streams [S,hc,dim])."""
    layer = oracle.mtp_layers[0]
    _, h0 = oracle._mtp_input(layer, h, ids)
    out = block_chunk(layer, mstate.layers[0], h0, ids, mstate.pos)
    _, _, logits = oracle._head(out, f"{layer.p}.", slice(-1, None))
    mstate.pos += ids.shape[0]
    mstate.last_hc = out[-1].copy()
    return logits[0], out


def check_propose_args(cfg, pos: int, max_seq_len: int, h_shape, h_kind: str, next_tokens,
                       k) -> np.ndarray:
    """The checks of an MTP ``propose`` call, shared by the oracle's and the GPU's drafter (the
    same messages): hc_rows floating point [m >= 1, hc, dim] (``h_shape`` after a 2-D input got
    its leading axis; ``h_kind`` its dtype's kind), next_tokens m ids in range, k in
    1..MAX_DRAFT, and the positions pos .. pos + m + k - 2 inside max_seq_len.  Returns the ids
    (int64 [m]).  The finiteness of hc_rows is the caller's check (on its own array library)."""
    from memra_dsv4.oracle.model import check_token_ids
    if h_kind != "f":
        raise ValueError(f"hc_rows must be floating point, got dtype kind {h_kind!r}")
    h_shape = tuple(h_shape)
    if len(h_shape) != 3 or h_shape[1:] != (cfg.hc_mult, cfg.hidden_size) or h_shape[0] == 0:
        raise ValueError(f"hc_rows must be [m >= 1, {cfg.hc_mult}, {cfg.hidden_size}], got "
                         f"shape {h_shape}")
    ids = check_token_ids(next_tokens, cfg.vocab_size, "next_tokens")
    if ids.shape[0] != h_shape[0]:
        raise ValueError(f"next_tokens has {ids.shape[0]} entries but hc_rows has {h_shape[0]} rows")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"k = {k!r} drafts; k must be an integer in 1..{MAX_DRAFT}")
    m = h_shape[0]
    if pos + m + k - 1 > max_seq_len:
        raise ValueError(f"mtp_propose: positions up to {pos + m + k - 2} exceed "
                         f"max_seq_len {max_seq_len}")
    return ids


def mtp_propose(oracle, mtp_state: DecodeState, hc_rows, next_tokens, k: int = 1, *,
                sampler=None) -> MtpDraft:
    """Draft k tokens with the MTP block (module doc)."""
    cfg = oracle.config
    _mtp_layer(oracle)
    check_state(oracle, mtp_state, role="mtp")
    h = np.asarray(hc_rows)
    if h.ndim == 2:
        h = h[None]
    ids = check_propose_args(cfg, mtp_state.pos, mtp_state.max_seq_len, h.shape, h.dtype.kind,
                             next_tokens, k)
    if not np.isfinite(h).all():
        raise ValueError("hc_rows contains non-finite values")
    with single_threaded_blas():
        return _propose(oracle, mtp_state, h, ids, k, sampler if sampler is not None else greedy)


def _propose(oracle, mtp_state, h, ids, k, pick) -> MtpDraft:
    lg, out = _mtp_chunk(oracle, mtp_state, h.astype(oracle.pol.dtype, copy=False), ids)
    toks, rows = [int(pick(lg))], [lg]
    if k > 1:
        scratch = mtp_state.copy()
        hs = out[-1:]
        for _ in range(k - 1):
            lg, o = _mtp_chunk(oracle, scratch, hs, np.array([toks[-1]], dtype=np.int64))
            toks.append(int(pick(lg)))
            rows.append(lg)
            hs = o[-1:]
    return MtpDraft(tokens=np.array(toks, dtype=np.int64), logits=np.stack(rows))


class MtpDrafter:
    """The MTP block as a drafter (see the module doc)."""

    name = "mtp"

    def begin(self, oracle, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> None:
        self.oracle = oracle
        self.state = new_mtp_state(oracle, max_seq_len)

    def propose(self, hc_rows, next_tokens, k: int, sampler=None):
        d = mtp_propose(self.oracle, self.state, hc_rows, next_tokens, k, sampler=sampler)
        return d.tokens, d.logits


# -------------------------------------------------------------------------------- loop
@dataclass
class SpecResult:
    tokens: list[int]
    drafted: list[int] = field(default_factory=list)    # per verify round: drafts verified
    accepted: list[int] = field(default_factory=list)   # per verify round (bonus excluded)
    proposed: list[int] = field(default_factory=list)   # per verify round: drafts the drafter
    #                                                     made (> drafted when a schedule cut)

    @property
    def rounds(self) -> int:
        return len(self.drafted)

    @property
    def acceptance_rate(self) -> float:
        d = sum(self.drafted)
        return sum(self.accepted) / d if d else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        return (f"{len(self.tokens)} tokens, {self.rounds} verify rounds, accepted "
                f"{sum(self.accepted)}/{sum(self.drafted)} drafts "
                f"({self.acceptance_rate:.1%}), mean accepted length "
                f"{self.mean_accepted_length:.2f}")


def _check_n(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what} must be a positive integer, got {n!r}")
    return int(n)


def greedy_generate(oracle, prompt, max_new_tokens: int, *, state=None) -> list[int]:
    """Plain greedy decoding: prefill_state, then one decode_step per token."""
    n = _check_n(max_new_tokens, "max_new_tokens")
    out = prefill_state(oracle, prompt, state)
    st = out.state
    if len(prompt) + n - 1 > st.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({n}) - 1 exceeds "
                         f"max_seq_len {st.max_seq_len}")
    toks = [greedy(out.logits)]
    while len(toks) < n:
        toks.append(greedy(decode_step(oracle, st, toks[-1])))
    return toks


def check_spec_args(max_new_tokens, k, temperature, top_p, generator, drafter, schedule):
    """The checks and set-up of a speculative_generate call, shared by the oracle's and the GPU's
    (gpu.spec): returns (n_new, sampled, probs, generator).  ``probs(logits)`` is the sampling
    distribution (it validates temperature / top_p here, before any work)."""
    n_new = _check_n(max_new_tokens, "max_new_tokens")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"k = {k!r}; k must be an integer in 1..{MAX_DRAFT}")
    sampled = float(temperature) != 0.0
    probs = (lambda lg: sampling_probs(lg, temperature, top_p))  # validates temperature/top_p
    probs(np.zeros(2))
    if sampled and generator is None:
        generator = np.random.default_rng()
    if schedule is not None and not callable(schedule):
        raise ValueError(f"schedule = {schedule!r}: expected None or a cost function cost(t)")
    if schedule is not None and not hasattr(drafter, "last_confidence"):
        raise ValueError(f"schedule: drafter {type(drafter).__name__} reports no confidences "
                         f"(confidence-scheduled verification needs a DSpark drafter)")
    return n_new, sampled, probs, generator


def check_spec_room(prompt_len: int, n_new: int, max_seq_len: int) -> None:
    """A speculative call's room: the prompt and n_new - 1 decoded positions in max_seq_len."""
    if prompt_len + n_new - 1 > max_seq_len:
        raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({n_new}) - 1 exceeds "
                         f"max_seq_len {max_seq_len}")


def default_drafter(oracle):
    """The drafter of the oracle's checkpoint (gpu.spec.default_drafter's rule): oracle.dspark's
    DSparkDrafter for a DSpark config, else MtpDrafter (whose begin refuses a checkpoint without
    an MTP block, naming it)."""
    from memra_dsv4.config import DRAFTER_DSPARK
    if oracle.config.drafter_kind == DRAFTER_DSPARK:
        from memra_dsv4.oracle.dspark import DSparkDrafter
        return DSparkDrafter()
    return MtpDrafter()


def speculative_generate(oracle, prompt, max_new_tokens: int, k: int, drafter=None, *,
                         temperature: float = 0.0, top_p: float = 1.0, generator=None,
                         state: DecodeState | None = None, schedule=None) -> SpecResult:
    """Draft (k per round) / verify / commit until ``max_new_tokens`` tokens (module doc).

    ``schedule``: None (verify every draft) or ``cost(t)``, the time of a verify of t tokens:
    each round then verifies ``host.spec_schedule.verify_length(confidences, cost)`` drafts
    (at least 1), for drafters that report confidences (DSpark: ``last_confidence``).
    ``drafter`` None: the checkpoint's own (``default_drafter``: DSpark or the MTP block)."""
    drafter = drafter if drafter is not None else default_drafter(oracle)
    n_new, sampled, probs, generator = check_spec_args(max_new_tokens, k, temperature, top_p,
                                                       generator, drafter, schedule)
    if state is None:
        state = new_state(oracle)
    check_state(oracle, state)
    ids = np.asarray(prompt)
    if ids.ndim == 1:   # anything else is refused by the prefill, naming it
        check_spec_room(ids.shape[0], n_new, state.max_seq_len)
    # A drafter with ``trunk_taps(oracle)`` (DSpark) is given, instead of the final streams,
    # the output streams of those trunk blocks: rows [m, n_taps, hc, dim].
    taps = getattr(drafter, "trunk_taps", None)
    tap_ids = tuple(taps(oracle)) if taps is not None else None
    state.tap_layers = tap_ids
    try:
        return spec_loop(_OracleTarget(oracle, state, tap_ids), drafter, prompt, n_new, k,
                         sampled, probs, generator, schedule)
    finally:
        state.tap_layers = None
        state.tap_streams = None


class _OracleTarget:
    """The target model of ``spec_loop`` on the oracle: ``rows`` are the final streams of the
    rows run (NumPy [m, hc, dim]) or, for a drafter with trunk taps, the taps' streams
    [m, n_taps, hc, dim]."""

    def __init__(self, oracle, state: DecodeState, tap_ids):
        self.model, self.state, self.tap_ids = oracle, state, tap_ids

    def _rows(self, streams):
        return streams if self.tap_ids is None else np.stack(self.state.tap_streams, axis=1)

    def prefill(self, prompt):
        out = prefill_state(self.model, prompt, self.state)
        return out.logits, self._rows(out.streams)

    def verify(self, tokens):
        logits, streams = verify(self.model, self.state, tokens, return_streams=True)
        return logits, self._rows(streams)

    def commit(self, n: int) -> None:
        commit(self.model, self.state, n)

    def decode_step(self, token):
        return decode_step(self.model, self.state, token)


def spec_loop(target, drafter, prompt, n_new: int, k: int, sampled: bool, probs, generator,
              schedule=None) -> SpecResult:
    """The draft / verify / commit loop of the module doc against ``target`` (the oracle's
    ``_OracleTarget`` or gpu.spec's): ``prefill(prompt) -> (logits [V], rows)``,
    ``verify(tokens) -> (logits [k+1, V], rows)``, ``commit(n)``, ``decode_step(token) ->
    logits [V]``, ``model`` and ``state`` (the drafter's ``begin(model, state.max_seq_len)``).
    ``rows`` is what the drafter's ``propose`` takes, indexed by row (NumPy or CuPy).  The
    acceptance rules (greedy: leading drafts equal to their row's argmax; sampled:
    sampling.spec_accept) are this function's only: the oracle and the GPU share them."""
    def propose(hc_rows, next_tokens, kk):
        """The drafter's proposal, cut to the scheduled verify length: (tokens, logits, made)."""
        dt, dl = drafter.propose(hc_rows, next_tokens, kk, pick)
        made = len(dt)
        if schedule is not None and made:
            n = verify_length(np.asarray(drafter.last_confidence)[:made], cost=schedule)
            dt, dl = dt[:n], (None if dl is None else np.asarray(dl)[:n])
        return dt, dl, made

    first_logits, rows = target.prefill(prompt)
    ids = np.asarray(prompt, dtype=np.int64)

    def pick(lg):
        return sample_from_probs(probs(lg), generator) if sampled else greedy(lg)

    g = pick(first_logits)
    res = SpecResult(tokens=[g])
    if n_new == 1:
        return res
    drafter.begin(target.model, target.state.max_seq_len)
    kk = min(k, n_new - 1)
    dt, dl, made = propose(rows, np.append(ids[1:], g), kk)
    while len(res.tokens) < n_new:
        remaining = n_new - len(res.tokens)
        kk = min(len(dt), remaining - 1)
        if kk == 0:                                   # one token left: plain step
            res.tokens.append(pick(target.decode_step(g)))
            break
        dt = np.asarray(dt[:kk], dtype=np.int64)
        logits, rows = target.verify(np.append(g, dt))
        if sampled:
            if dl is None:
                raise ValueError(f"drafter {type(drafter).__name__} returned no draft logits: "
                                 f"sampled speculative decoding needs its distribution")
            n, bonus = spec_accept(probs(logits), probs(np.asarray(dl)[:kk]), dt, generator)
        else:
            n = 0
            while n < kk and greedy(logits[n]) == int(dt[n]):
                n += 1
            bonus = greedy(logits[n])
        target.commit(n)
        res.drafted.append(kk)
        res.proposed.append(made)
        res.accepted.append(n)
        new = [int(t) for t in dt[:n]] + [int(bonus)]
        res.tokens.extend(new)
        g = int(bonus)
        remaining = n_new - len(res.tokens)
        if remaining <= 0:
            break
        if remaining == 1:                            # nothing left to draft for
            dt, dl = np.zeros(0, dtype=np.int64), None
            continue
        dt, dl, made = propose(rows[:n + 1], np.array(new, dtype=np.int64),
                               min(k, remaining - 1))
    return res
