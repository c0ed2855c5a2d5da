"""The DSpark drafter (memra_dsv4/oracle/dspark.py) on the tiny preset with a DSpark drafter
(target layers = the last three trunk layers, block 5, window 8): refusals, one draft round,
the Markov loop / confidence formulas, block positions (RoPE at p+1..p+B, bidirectional
attention with sinks over ring + block rows), rings holding only committed rows, and lossless
greedy speculative generation with exact acceptance counting."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.oracle import Oracle
from memra_dsv4.oracle.dspark import DSparkDrafter
from memra_dsv4.oracle.sampling import greedy
from memra_dsv4.oracle.spec import MtpDrafter, greedy_generate, speculative_generate
from memra_dsv4.synth import synth_arrays, with_drafter


@functools.lru_cache(maxsize=None)
def oracle(numerics: str = "bf16", drafter: str = "dspark") -> Oracle:
    cfg = with_drafter(preset("tiny"), drafter)
    return Oracle(Checkpoint.from_arrays(cfg, synth_arrays(cfg, 0)), numerics)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, n)


def prefill_taps(o, ids, d):
    """Trunk prefill with the drafter's taps; returns (state, first token, tap rows)."""
    st = o.new_state(256)
    st.tap_layers = d.trunk_taps(o)
    out = o.prefill_state(ids, st)
    return st, greedy(out.logits), np.stack(st.tap_streams, axis=1)


def started(o, ids):
    d = DSparkDrafter()
    st, g, rows = prefill_taps(o, ids, d)
    d.begin(o, 256)
    toks, lg = d.propose(rows, np.append(ids[1:], g), 5)
    return d, st, g, toks, lg


# ------------------------------------------------------------------------- refusals
def test_refusals():
    o_mtp, o_ds = oracle("bf16", "mtp"), oracle("bf16", "dspark")
    assert o_ds.config.dspark_target_layer_ids == (1, 2, 3)
    with pytest.raises(ValueError, match="not a DSpark drafter"):
        DSparkDrafter().begin(o_mtp)
    with pytest.raises(ValueError, match="not a DSpark drafter"):
        speculative_generate(o_mtp, [1, 2, 3], 4, 3, DSparkDrafter())
    with pytest.raises(ValueError, match="no MTP block"):
        MtpDrafter().begin(o_ds)
    with pytest.raises(ValueError, match="no MTP block"):
        speculative_generate(o_ds, [1, 2, 3], 4, 3, MtpDrafter())


def test_default_drafter_follows_the_checkpoint():
    """speculative_generate without a drafter takes the checkpoint's (oracle.spec.default_drafter):
    DSpark on a DSpark config (the same tokens as an explicit DSparkDrafter), MTP otherwise."""
    from memra_dsv4.oracle.spec import default_drafter
    o_mtp, o_ds = oracle("bf16", "mtp"), oracle("bf16", "dspark")
    assert type(default_drafter(o_ds)) is DSparkDrafter
    assert type(default_drafter(o_mtp)) is MtpDrafter
    ids = prompt(1, 4)
    a = speculative_generate(o_ds, ids, 5, 3)
    b = speculative_generate(o_ds, ids, 5, 3, DSparkDrafter())
    assert list(a.tokens) == list(b.tokens) and a.accepted == b.accepted


# ------------------------------------------------------------------------ one round
def test_one_round_shapes_and_determinism():
    o = oracle()
    ids = prompt(1, 11)
    d, _, g, toks, lg = started(o, ids)
    B, V = o.config.dspark_block_size, o.config.vocab_size
    assert toks.shape == (B,) and lg.shape == (B, V) and d.n_ctx == len(ids)
    dr = d.draft(g)
    assert dr.tokens.shape == (B,) and dr.logits.shape == (B, V) and dr.confidence.shape == (B,)
    assert np.array_equal(dr.tokens, toks) and np.array_equal(dr.logits, lg)
    assert np.isfinite(dr.confidence).all() and np.isfinite(dr.logits).all()
    d2, _, _, toks2, lg2 = started(o, ids)
    dr2 = d2.draft(g)
    assert np.array_equal(toks2, toks) and np.array_equal(lg2, lg)
    assert np.array_equal(dr2.confidence, dr.confidence)
    for a, b in zip(d.rings, d2.rings):
        assert np.array_equal(a, b)


def test_markov_loop_and_confidence_formulas():
    o = oracle("exact")
    ids = prompt(2, 10)
    d, _, g, _, _ = started(o, ids)
    dr = d.draft(g)
    w1 = o.weight("mtp.2.markov_head.markov_w1").astype(np.float64)
    w2 = o.weight("mtp.2.markov_head.markov_w2").astype(np.float64)
    proj = o.weight("mtp.2.confidence_head.proj").astype(np.float64)
    out = [g] + [int(t) for t in dr.tokens]
    for k in range(d.B):
        bias = w2 @ w1[out[k]]
        np.testing.assert_allclose(dr.logits[k], dr.base_logits[k] + bias, rtol=1e-12, atol=1e-12)
        assert np.abs(bias).max() > 1e-3                       # the Markov term is not zero
        assert out[k + 1] == int(np.argmax(dr.logits[k]))
        c = proj[0] @ np.concatenate([dr.hidden[k], w1[out[k]]])
        np.testing.assert_allclose(dr.confidence[k], c, rtol=1e-12, atol=1e-12)
    # base logits = shared head of norm(h_k)
    from memra_dsv4.oracle import ops
    yn = ops.rmsnorm(dr.hidden, o.weight("mtp.2.norm.weight"), o.config.rms_norm_eps, pol=o.pol)
    np.testing.assert_allclose(dr.base_logits, yn @ o.weight("head.weight").T.astype(np.float64),
                               rtol=1e-12, atol=1e-12)


# -------------------------------------------------------------------- block positions
def test_block_roped_at_p_plus_one_and_attends_ring_plus_block():
    o = oracle("exact")
    ids = prompt(3, 11)                                      # p = 10 > W: the ring has wrapped
    d, _, g, _, _ = started(o, ids)
    cap = []
    d.draft(g, capture=cap)
    st0, c = d.stages[0], cap[0]
    p, B, W = d.n_ctx - 1, d.B, d.W
    pos = p + 1 + np.arange(B)
    cos, sin = st0.rope(pos)
    _, q_ref = st0.q_path(c["attn_norm"], cos, sin)
    kv_ref = st0.kv_path(c["attn_norm"], cos, sin)
    assert np.array_equal(c["attn.q"], q_ref) and np.array_equal(c["attn.kv"], kv_ref)
    cos0, sin0 = st0.rope(pos - 1)                           # the EAGLE-style off-by-one
    assert not np.allclose(st0.q_path(c["attn_norm"], cos0, sin0)[1], c["attn.q"])
    # keys: ring rows of positions p-W+1..p (chronological), then the B block rows
    hist = np.arange(p - W + 1, p + 1)
    rows = np.concatenate([d.rings[0][hist % W], kv_ref])
    assert np.array_equal(c["attn.rows"], rows)
    # hand-built attention: every query sees every row (bidirectional), sink in the denominator
    sink = o.weight("mtp.0.attn.attn_sink").astype(np.float64)
    s = np.einsum("thd,nd->thn", q_ref, rows) * o.config.head_dim ** -0.5
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True) + np.exp(sink[None, :, None] - m)
    o_ref = np.einsum("thn,nd->thd", e / den, rows)
    np.testing.assert_allclose(c["attn.o_raw"], o_ref, rtol=1e-10, atol=1e-12)
    # causal masking inside the block would give a different anchor row: bidirectional
    sc = s[0, :, :W + 1]
    ec = np.exp(sc - sc.max(-1, keepdims=True))
    pc = ec / (ec.sum(-1, keepdims=True) + np.exp(sink[:, None] - sc.max(-1, keepdims=True)))
    assert not np.allclose(pc @ rows[:W + 1], c["attn.o_raw"][0])


# ------------------------------------------------------------------ committed rings
def test_rings_hold_only_committed_rows():
    o = oracle()
    ids = prompt(4, 9)
    truth = greedy_generate(o, ids, 6)
    d, st, g, _, _ = started(o, ids)
    assert g == truth[0]
    V = o.config.vocab_size
    drafts = [truth[1], (truth[2] + 1) % V, truth[3], truth[4]]    # 1 right, then wrong
    logits = o.verify(st, [g] + drafts)
    rows_all = np.stack(st.tap_streams, axis=1)
    n = 0
    while n < 4 and greedy(logits[n]) == drafts[n]:
        n += 1
    assert n == 1
    bonus = greedy(logits[n])
    assert bonus == truth[2]
    o.commit(st, n)
    rows = np.stack(st.tap_streams, axis=1)[:n + 1]
    d.propose(rows, [drafts[0], bonus], 5)
    assert d.n_ctx == st.pos == len(ids) + 2
    # reference: a fresh drafter seeded from a plain prefill of the committed tokens
    full = np.concatenate([ids, truth[:2]])
    ref = DSparkDrafter()
    _, g2, rows2 = prefill_taps(o, full, ref)
    assert g2 == bonus
    ref.begin(o, 256)
    ref.propose(rows2, np.append(full[1:], g2), 5)
    for a, b in zip(d.rings, ref.rings):
        assert np.array_equal(a, b)
    # the rejected verify position's context row is in no ring
    q = len(ids) + 2
    rej = d.context_rows(d.features(rows_all[2:3]), np.array([q]))
    for ring, r in zip(d.rings, rej):
        assert not np.array_equal(ring[q % d.W], r[0])


# ----------------------------------------------------------------------- lossless
class TruthDSpark(DSparkDrafter):
    """DSpark machinery (rings, drafts) with the first ``a`` drafts replaced by the true greedy
    tokens and the rest made wrong: acceptance is exactly min(a, drafted)."""

    def __init__(self, full, a):
        self.full, self.a = full, a

    def propose(self, hc_rows, next_tokens, k, sampler=None):
        toks, lg = super().propose(hc_rows, next_tokens, k, sampler)
        toks = toks.copy()
        V = self.cfg.vocab_size
        for j in range(len(toks)):
            t = self.full[self.n_ctx + 1 + j]
            toks[j] = t if j < self.a else (t + 1) % V
        return toks, lg


@pytest.mark.parametrize("seed,plen,k", [(5, 6, 5), (6, 13, 3), (7, 3, 7)])
def test_greedy_speculative_is_lossless_and_counts(seed, plen, k):
    o = oracle()
    ids = prompt(seed, plen)
    n_new = 15
    truth = greedy_generate(o, ids, n_new)
    r = speculative_generate(o, ids, n_new, k, DSparkDrafter())
    assert r.tokens == truth
    assert all(0 <= a <= dd <= min(k, 5) for a, dd in zip(r.accepted, r.drafted))
    full = np.concatenate([ids, truth, [0] * 8])
    for a in (1, 2):
        r = speculative_generate(o, ids, n_new, k, TruthDSpark(full, a))
        assert r.tokens == truth
        assert r.accepted == [min(a, dd) for dd in r.drafted]
        assert max(r.drafted) == min(k, 5, n_new - 1)
        extra = len(r.tokens) - 1 - sum(r.accepted) - r.rounds      # final plain step or not
        assert extra in (0, 1)
        assert r.acceptance_rate == sum(r.accepted) / sum(r.drafted)


# ------------------------------------------------- confidence schedule and sampled drafting
def test_confidence_schedule_keeps_greedy_lossless_and_cuts_rounds():
    """speculative_generate(schedule=cost): every round verifies verify_length(confidences of
    that round's drafts, cost) drafts; the tokens stay plain greedy's."""
    from memra_dsv4.host.spec_schedule import verify_length
    o = oracle()
    ids = prompt(11, 9)
    n_new = 16
    truth = greedy_generate(o, ids, n_new)

    class Recording(DSparkDrafter):
        def propose(self, hc_rows, next_tokens, k, sampler=None):
            out = super().propose(hc_rows, next_tokens, k, sampler)
            self.log.append(np.array(self.last_confidence))
            return out

    steep = lambda t: 1.0 + 0.9 * (t - 1)  # noqa: E731  (verifying is costly: cuts rounds)
    d = Recording()
    d.log = []
    r = speculative_generate(o, ids, n_new, 5, d, schedule=steep)
    assert r.tokens == truth
    assert len(d.log) >= r.rounds
    for conf, made, verified in zip(d.log, r.proposed, r.drafted):
        assert made == len(conf)
        assert verified <= verify_length(conf, steep)        # <=: the last round may be cut
    assert any(v < m for v, m in zip(r.drafted, r.proposed)), "the steep cost never cut a round"
    flat = speculative_generate(o, ids, n_new, 5, DSparkDrafter(), schedule=lambda t: 1.0)
    assert flat.tokens == truth and flat.drafted[0] == flat.proposed[0]


def test_schedule_refusals():
    o = oracle()
    with pytest.raises(ValueError, match="reports no confidences"):
        speculative_generate(oracle("bf16", "mtp"), prompt(1, 4), 4, 2, MtpDrafter(),
                             schedule=lambda t: 1.0)
    with pytest.raises(ValueError, match="cost function"):
        speculative_generate(o, prompt(1, 4), 4, 2, DSparkDrafter(), schedule=3.0)


def test_sampled_drafts_come_from_the_logits_given_to_the_acceptance_test():
    """At temperature > 0 the Markov loop draws draft k+1 with the loop's sampler from its
    biased logits row k, and those rows are what propose returns (the q of min(1, p/q)): the
    sampler sees exactly the returned rows, in order, and its picks are the drafts."""
    o = oracle()
    ids = prompt(12, 7)
    d = DSparkDrafter()
    st, g, rows = prefill_taps(o, ids, d)
    d.begin(o, 256)
    seen, rng = [], np.random.default_rng(3)

    def sampler(lg):
        seen.append(np.array(lg))
        p = np.exp(lg - lg.max())
        return int(rng.choice(lg.shape[0], p=p / p.sum()))
    toks, lg = d.propose(rows, np.append(ids[1:], g), 5, sampler)
    assert len(seen) == d.B and lg.shape[0] == len(toks) == 5
    for k in range(5):
        assert np.array_equal(seen[k], lg[k])
    # and the picks feed the next Markov step: rerun the draft with the same picks, greedy-free
    replay = iter(toks.tolist() + [0] * 8)
    d2 = d.draft(int(g), lambda lg: next(replay))
    assert np.array_equal(d2.tokens[:5], toks) and np.array_equal(d2.logits[:5], lg)


def test_sampled_dspark_loop_runs_and_is_seeded():
    o = oracle()
    ids = prompt(13, 6)
    a = speculative_generate(o, ids, 10, 4, DSparkDrafter(), temperature=0.9,
                             generator=np.random.default_rng(5))
    b = speculative_generate(o, ids, 10, 4, DSparkDrafter(), temperature=0.9,
                             generator=np.random.default_rng(5))
    assert a.tokens == b.tokens and len(a.tokens) == 10
    assert all(0 <= x <= y for x, y in zip(a.accepted, a.drafted))
