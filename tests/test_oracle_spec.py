"""Speculative decoding on the oracle: verify == decode, commit/rollback == plain decode of the
committed tokens (hypothesis), the MTP drafter against ``Oracle.mtp_forward``, lossless greedy
speculative decoding with MTP drafts, acceptance counting, refused calls.

Convention under test (memra_dsv4/oracle/decode.py): verify(state, [t_last, d1..dk]) runs
positions pos..pos+k; commit(state, n) keeps pos..pos+n; the bonus token is fed by the next
verify / decode_step.  Everything is on the tiny preset; bf16 results are bit-equal, so the
checks are exact (np.array_equal / DecodeState.diff).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.oracle import MAX_DRAFT, DecodeState, Oracle
from memra_dsv4.oracle.sampling import greedy
from memra_dsv4.oracle.spec import greedy_generate, speculative_generate


@functools.lru_cache(maxsize=None)
def oracle(numerics: str = "bf16", name: str = "tiny") -> Oracle:
    cfg = preset(name)
    return Oracle(Checkpoint.from_arrays(cfg, synth_arrays_cached(name)), numerics)


@functools.lru_cache(maxsize=None)
def synth_arrays_cached(name: str):
    from memra_dsv4.synth import synth_arrays
    return synth_arrays(preset(name), 0)


def rand_ids(seed: int, n: int, vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


# ----------------------------------------------------------------- verify and commit
@pytest.mark.parametrize("name,p0,k", [("tiny", 1, 3), ("tiny", 6, 3), ("tiny", 14, 3),
                                        ("tiny", 5, 12), ("tiny", 30, 16), ("small", 30, 3)],
                         ids=["start", "csa_emit_and_window_wrap", "hca_emit", "k_over_window",
                              "k_max", "small_window_wrap_hca_emit"])
def test_verify_rows_equal_decode_and_every_commit_equals_decode(name, p0, k):
    """Rows of one verify == decode logits; for every n, commit(n) == decode of n+1 tokens."""
    o = oracle("bf16", name)
    ids = rand_ids(7, p0 + k + 1, o.config.vocab_size)
    base = o.prefill_state(ids[:p0]).state
    plain = base.copy()
    dec, plain_states = [], []
    for t in range(p0, p0 + k + 1):
        dec.append(o.decode_step(plain, ids[t]))
        plain_states.append(plain.copy())
    for n in range(k + 1):
        s = base.copy()
        rows = o.verify(s, ids[p0:p0 + k + 1])
        assert rows.shape == (k + 1, o.config.vocab_size)
        assert np.array_equal(rows, np.stack(dec))
        o.commit(s, n)
        assert s.pos == p0 + n + 1
        assert s.diff(plain_states[n]) == [], f"n={n}"
        # the state continues exactly like plain decode
        assert np.array_equal(o.decode_step(s, 11), o.decode_step(plain_states[n].copy(), 11))


@pytest.mark.parametrize("numerics", ["exact", "reference"])
def test_verify_commit_other_classes(numerics):
    o = oracle(numerics)
    ids = rand_ids(3, 20)
    s = o.prefill_state(ids[:6]).state
    plain = s.copy()
    rows = o.verify(s, ids[6:10])
    dec = np.stack([o.decode_step(plain, t) for t in ids[6:8]])
    o.commit(s, 1)
    if numerics == "exact":
        assert np.abs(rows[:2] - dec).max() <= 1e-12 * np.abs(dec).max()
        assert s.pos == plain.pos
    else:
        assert np.array_equal(rows[:2], dec) and s.diff(plain) == []


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prompt_len=st.integers(1, 12),
       rounds=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_random_verify_commit_rounds_equal_plain_decode(prompt_len, rounds, seed):
    """Random rounds of verify (random k, random tokens) + commit (random acceptance) give the
    logits and the final state of plain decode of the committed tokens."""
    o = oracle()
    rng = np.random.default_rng(seed)
    V = o.config.vocab_size
    prompt = rng.integers(0, V, prompt_len)
    s = o.prefill_state(prompt).state
    committed, kept_rows = [], []
    for k, n_raw in rounds:
        toks = rng.integers(0, V, k + 1)
        n = min(n_raw, k)
        rows = o.verify(s, toks)
        o.commit(s, n)
        committed.extend(int(t) for t in toks[:n + 1])
        kept_rows.extend(rows[:n + 1])
    plain = o.prefill_state(prompt).state
    for t, want in zip(committed, kept_rows):
        assert np.array_equal(o.decode_step(plain, t), want)
    assert s.diff(plain) == []


def test_refused_spec_calls_leave_state_unchanged():
    o = oracle()
    V = o.config.vocab_size
    s = o.prefill_state(rand_ids(1, 6)).state

    def refused(fn, match):
        before = s.copy()
        with pytest.raises(ValueError, match=match):
            fn()
        assert s.diff(before) == []

    refused(lambda: o.commit(s, 0), "no uncommitted verify")
    refused(lambda: o.verify(s, [5]), "k = 0")
    refused(lambda: o.verify(s, np.arange(MAX_DRAFT + 2)), f"k = {MAX_DRAFT + 1}")
    refused(lambda: o.verify(s, [1, 2, V]), "outside the vocabulary")
    short = o.prefill_state(rand_ids(1, 6), o.new_state(max_seq_len=8)).state
    before = short.copy()
    with pytest.raises(ValueError, match="exceed max_seq_len 8"):
        o.verify(short, [1, 2, 3])
    assert short.diff(before) == []
    o.verify(s, [1, 2, 3])
    refused(lambda: o.commit(s, 3), "outside 0..k = 0..2")
    refused(lambda: o.commit(s, -1), "outside 0..k")
    refused(lambda: o.commit(s, 1.0), "must be an integer")
    refused(lambda: o.decode_step(s, 1), "uncommitted verify")
    refused(lambda: o.prefill_chunk(s, [1]), "uncommitted verify")
    refused(lambda: o.verify(s, [1, 2]), "uncommitted verify")
    o.commit(s, 2)
    assert s.pos == 9 and s.journal is None


# ---------------------------------------------------------------------------- MTP drafter
@pytest.mark.parametrize("numerics", ["bf16", "exact"])
def test_mtp_propose_matches_mtp_forward(numerics):
    """Draft 1 = mtp_forward over the whole history at its last row; drafts 2, 3 = mtp_forward
    with the MTP block's own output streams appended as the next rows (vLLM recursion)."""
    o = oracle(numerics)
    ids = rand_ids(5, 13)
    out = o.prefill_state(ids[:12])
    g = greedy(out.logits)
    nxt = np.append(ids[1:12], g)
    ms = o.new_mtp_state()
    d = o.mtp_propose(ms, out.streams, nxt, 3)
    assert ms.pos == 12 and d.tokens.shape == (3,) and d.logits.shape == (3, o.config.vocab_size)
    rows, toks = out.streams, nxt
    for j in range(3):
        ref = o.mtp_forward(rows, toks)
        if numerics == "exact":
            assert np.abs(d.logits[j] - ref.logits[-1]).max() <= 1e-12 * np.abs(ref.logits[-1]).max()
        else:
            assert np.array_equal(d.logits[j], ref.logits[-1])
        assert d.tokens[j] == greedy(d.logits[j])
        rows = np.concatenate([rows, ref.streams[-1:]])
        toks = np.append(toks, d.tokens[j])


def test_mtp_cache_incremental_equals_one_shot_and_scratch_is_discarded():
    o = oracle()
    ids = rand_ids(9, 30)
    out = o.prefill_state(ids[:29], all_logits=True)
    nxt = ids[1:30]
    one = o.new_mtp_state()
    d_one = o.mtp_propose(one, out.streams, nxt, 2)
    inc = o.new_mtp_state()
    p = 0
    for m in (1, 4, 9, 3, 12):                          # pieces of the same 29 rows
        d_inc = o.mtp_propose(inc, out.streams[p:p + m], nxt[p:p + m], 3)
        p += m
    assert inc.pos == one.pos == 29
    assert inc.diff(one) == []                          # recursive scratch rows never kept
    assert np.array_equal(d_inc.logits[:2], d_one.logits)


def test_mtp_propose_bad_input():
    o = oracle()
    ms = o.new_mtp_state()
    h = o.prefill_state(rand_ids(2, 4)).streams
    for args, match in [((h, [1, 2, 3], 1), "3 entries but hc_rows has 4"),
                        ((h, [1, 2, 3, 4], 0), "k = 0"),
                        ((h, [1, 2, 3, 4], MAX_DRAFT + 1), "k = "),
                        ((h[:, :2], [1, 2, 3, 4], 1), "hc_rows must be"),
                        ((h * np.nan, [1, 2, 3, 4], 1), "non-finite"),
                        ((h, [1, 2, 3, 512], 1), "outside the vocabulary")]:
        before = ms.copy()
        with pytest.raises(ValueError, match=match):
            o.mtp_propose(ms, *args)
        assert ms.diff(before) == []
    with pytest.raises(ValueError, match="'trunk' state"):
        o.mtp_propose(o.new_state(), h, [1, 2, 3, 4], 1)
    with pytest.raises(ValueError, match="'mtp' state"):
        o.decode_step(ms, 1)


# ----------------------------------------------------------------- speculative loop
class PerfectDrafterTestDouble:
    """TEST DOUBLE (not a product drafter): proposes the known greedy continuation, so every
    draft must be accepted.  Convention of Drafter.propose: hc_rows are trunk positions
    P..P+m-1, next_tokens the tokens of P+1..P+m; the drafts are for P+m+1.. ."""

    def __init__(self, prompt, continuation):
        self.seq = list(prompt) + list(continuation)
        self.calls = []

    def begin(self, oracle, max_seq_len):
        self.pos = 0                                     # trunk rows given so far

    def propose(self, hc_rows, next_tokens, k, sampler=None):
        m = len(next_tokens)
        assert list(next_tokens) == self.seq[self.pos + 1:self.pos + m + 1]
        self.pos += m
        self.calls.append(k)
        return np.array(self.seq[self.pos + 1:self.pos + 1 + k], dtype=np.int64), None


class NoisyDrafterTestDouble(PerfectDrafterTestDouble):
    """TEST DOUBLE: the true continuation with each draft replaced by a wrong token with
    probability 1/2, so rounds accept 0..k drafts."""

    def __init__(self, prompt, continuation, seed):
        super().__init__(prompt, continuation)
        self.rng = np.random.default_rng(seed)

    def propose(self, hc_rows, next_tokens, k, sampler=None):
        d, _ = super().propose(hc_rows, next_tokens, k, sampler)
        flip = self.rng.random(len(d)) < 0.5
        return np.where(flip, (d + 1) % 512, d), None


PROMPTS = [(1, 0), (3, 1), (4, 2), (7, 3), (8, 4), (12, 5), (16, 6), (17, 7)]


@functools.lru_cache(maxsize=None)
def plain_greedy(L: int, seed: int, n: int):
    prompt = rand_ids(100 + seed, L)
    return prompt, greedy_generate(oracle(), prompt, n)


@pytest.mark.parametrize("L,seed", PROMPTS)
def test_greedy_speculative_with_mtp_is_lossless(L, seed):
    """MTP drafts, k = 1..3: exactly the tokens of plain greedy decoding (8 prompts)."""
    n = 20
    prompt, want = plain_greedy(L, seed, n)
    for k in (1, 2, 3):
        res = speculative_generate(oracle(), prompt, n, k)
        assert res.tokens == want, f"k={k}"
        assert len(res.tokens) == n
        assert all(0 <= a <= d <= k for a, d in zip(res.accepted, res.drafted))
        print(f"L={L} k={k}: {res.summary()}")


@pytest.mark.parametrize("numerics,name", [("exact", "tiny"), ("bf16", "small")])
def test_greedy_speculative_other_class_and_preset(numerics, name):
    o = oracle(numerics, name)
    prompt = rand_ids(21, 9, o.config.vocab_size)
    want = greedy_generate(o, prompt, 12)
    res = speculative_generate(o, prompt, 12, 2)
    assert res.tokens == want
    print(f"{name} {numerics} k=2: {res.summary()}")


def test_perfect_drafter_accepts_k_every_round():
    L, k, R = 5, 3, 6
    n = 1 + R * (k + 1)
    prompt, want = plain_greedy(L, 11, n)
    dr = PerfectDrafterTestDouble(prompt, want)
    res = speculative_generate(oracle(), prompt, n, k, dr)
    assert res.tokens == want
    assert res.drafted == [k] * R and res.accepted == [k] * R
    assert res.acceptance_rate == 1.0 and res.mean_accepted_length == k + 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partially_accepting_drafter_is_lossless_and_counted(k):
    L, n = 6, 25
    prompt, want = plain_greedy(L, 12, n)
    dr = NoisyDrafterTestDouble(prompt, want, seed=k)
    res = speculative_generate(oracle(), prompt, n, k, dr)
    assert res.tokens == want
    # tokens = the prefill's + (accepted + bonus) per verify round + at most one final plain step
    assert n - (1 + sum(a + 1 for a in res.accepted)) in (0, 1)
    assert set(res.accepted) - {0} and min(res.accepted) < k   # both paths were exercised


def test_sampled_speculative_loop_runs_and_is_seeded():
    o = oracle()
    prompt = rand_ids(3, 5)
    a = speculative_generate(o, prompt, 12, 2, temperature=0.8, top_p=0.9,
                             generator=np.random.default_rng(5))
    b = speculative_generate(o, prompt, 12, 2, temperature=0.8, top_p=0.9,
                             generator=np.random.default_rng(5))
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert all(0 <= t < o.config.vocab_size for t in a.tokens)


def test_speculative_generate_bad_input():
    o = oracle()
    with pytest.raises(ValueError, match="k = 0"):
        speculative_generate(o, [1, 2], 5, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(o, [1, 2], 0, 1)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(o, [1, 2], 5, 1, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        speculative_generate(o, [1, 2], 8, 1, state=o.new_state(max_seq_len=8))
    assert isinstance(o.new_state(), DecodeState)
