"""The GPU MTP drafter (memra_dsv4.gpu.drafters) and the GPU speculative loop (gpu.spec).

* Drafts against the oracle: both drafters are given the SAME hc rows (the GPU prefill's final
  streams, read back) and the same next tokens, in two calls (split so that the second call's
  rows cross the window wrap: tiny W = 8, small W = 32); the recursive drafts of the second call
  (k = 3) take the GPU's tokens on both sides (a scripted sampler on the oracle's), so a near-tie
  flip of one draft cannot move the rows after it.  Each draft's logits: bf16 class
  (test_decode_gpu._logit_check: rel L2 <= REL_L2, top-1 equal unless the reference's top-2 gap
  is a near tie); the MTP cache after both calls against the oracle's MTP state (_state_check).
* The loop, greedy: with the MTP drafter, and with a scripted drafter that proposes the true
  greedy continuation with some drafts replaced (rounds then accept 0..k drafts and roll back),
  the tokens equal Dsv4Gpu.generate's; where they differ, the step must be a near tie of the
  re-prefill's logits at that position (the verify's rows are M = k + 1 GEMMs).
* Refusals: a model without the drafter, propose before begin, bad hc rows / tokens / k; a
  refused propose leaves the MTP state as it was.  A drafter with trunk taps is handed them.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import (TIE_GAP, _ckpt, _ids, _logit_check, _model,  # prepend import mode
                             _state_check)

cp = pytest.importorskip("cupy")

_CACHE: dict = {}


def _drafter_model(name, path="legacy"):
    """(checkpoint, Dsv4Gpu with the MTP block, bf16 oracle) of the synthetic preset ``name``."""
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.oracle.model import Oracle
    key = (name, path)
    if key not in _CACHE:
        ck = _CACHE.get(("ck", name))
        if ck is None:
            ck = _CACHE[("ck", name)] = _ckpt(name)
            _CACHE[("oracle", name)] = Oracle(ck, numerics="bf16")
        _CACHE[key] = Dsv4Gpu.load(ck, devices=(0,), decode_path=path, max_seq_len=1024,
                                   prefill_attn="simt", drafter=True)
    return _CACHE[("ck", name)], _CACHE[key], _CACHE[("oracle", name)]


@pytest.mark.parametrize("name,L,split", [("tiny", 13, 5), ("small", 45, 20)])
def test_mtp_drafts_match_oracle(name, L, split):
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    from memra_dsv4.oracle.sampling import greedy
    ck, m, o = _drafter_model(name)
    cfg = ck.config
    ids = _ids(cfg, L, seed=L)
    logits, st, streams = m.prefill(ids, return_streams=True)
    assert streams.shape == (L, cfg.hc_mult, cfg.hidden_size) and streams.dtype == cp.float32
    rows = cp.asnumpy(streams)
    nxt = np.array(ids[1:] + [greedy(logits)], np.int64)
    gd = GpuMtpDrafter()
    gd.begin(m, 1024)
    ms = o.new_mtp_state(1024)
    fails, lines = [], []
    t1, l1 = gd.propose(streams[:split], nxt[:split], 1)
    d1 = o.mtp_propose(ms, rows[:split], nxt[:split], 1)
    assert t1.shape == (1,) and l1.shape == (1, cfg.vocab_size) and l1.dtype == np.float32
    _logit_check("call 1 draft 1", l1[0], d1.logits[0], fails, lines)
    t2, l2 = gd.propose(streams[split:], nxt[split:], 3)
    script = iter(t2.tolist())
    d2 = o.mtp_propose(ms, rows[split:], nxt[split:], 3, sampler=lambda lg: next(script))
    assert gd.state.pos == ms.pos == L
    for j in range(3):
        _logit_check(f"call 2 draft {j + 1}", l2[j], d2.logits[j], fails, lines)
    assert int(t2[0]) == greedy(l2[0])
    _state_check(gd.state, ms, fails, lines)
    print("\n".join(lines))
    assert not fails, "\n".join(fails)


def _near_tie_at(m, prompt, tokens, i):
    """The relative top-2 gap of the re-prefill's logits that pick tokens[i]."""
    lg = m.forward(list(prompt) + list(tokens[:i])).logits
    srt = np.sort(np.asarray(lg, np.float64))
    return (srt[-1] - srt[-2]) / max(abs(srt[-1]), 1e-30)


def _check_lossless(m, prompt, got, want):
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    gap = _near_tie_at(m, prompt, want, i)
    assert gap < TIE_GAP, (f"token {i}: speculative {got[i]} vs generate {want[i]} with a "
                           f"top-2 gap {gap:.2e} >= {TIE_GAP} (not a near tie)")


class ScriptedDrafterTestDouble:
    """TEST DOUBLE (not a product drafter): the known greedy continuation, each draft replaced by
    a wrong token with probability 1/2, so rounds accept 0..k drafts (oracle test's double)."""

    def __init__(self, prompt, continuation, vocab, seed):
        self.seq = list(prompt) + list(continuation)
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def begin(self, model, max_seq_len):
        self.pos = 0

    def propose(self, hc_rows, next_tokens, k, sampler=None):
        mm = len(next_tokens)
        assert hc_rows.shape[0] == mm
        self.pos += mm
        d = np.array(self.seq[self.pos + 1:self.pos + 1 + k], dtype=np.int64)
        flip = self.rng.random(len(d)) < 0.5
        return np.where(flip, (d + 1) % self.vocab, d), None


@pytest.mark.parametrize("path", ["legacy", "device"])
def test_speculative_greedy_equals_generate(path):
    from memra_dsv4.gpu.spec import speculative_generate
    ck, m, _ = _drafter_model("tiny", path)
    cfg = ck.config
    n = 24
    for L, seed in [(3, 1), (9, 2)]:
        prompt = _ids(cfg, L, seed=100 + seed)
        want = m.generate(prompt, n)
        for k in (1, 3):
            res = speculative_generate(m, prompt, n, k)
            assert len(res.tokens) == n
            assert all(0 <= a <= d <= k for a, d in zip(res.accepted, res.drafted))
            _check_lossless(m, prompt, res.tokens, want)
            print(f"{path} L={L} k={k} mtp: {res.summary()}")
        dr = ScriptedDrafterTestDouble(prompt, want, cfg.vocab_size, seed)
        res = speculative_generate(m, prompt, n, 3, dr)
        _check_lossless(m, prompt, res.tokens, want)
        assert set(res.accepted) - {0} and min(res.accepted) < 3, res.accepted  # both paths
        assert n - (1 + sum(a + 1 for a in res.accepted)) in (0, 1)
        print(f"{path} L={L} k=3 scripted: {res.summary()}")


def test_bad_calls_refused_and_state_unchanged():
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    from memra_dsv4.gpu.spec import speculative_generate
    ck, m, _ = _drafter_model("tiny")
    cfg = ck.config
    _, plain = _model("tiny")                       # loaded without the drafter
    with pytest.raises(ValueError, match="holds no drafter"):
        GpuMtpDrafter().begin(plain, 64)
    with pytest.raises(ValueError, match="before begin"):
        GpuMtpDrafter().propose(np.zeros((1, cfg.hc_mult, cfg.hidden_size), np.float32), [1], 1)
    ids = _ids(cfg, 6, seed=3)
    _, _, streams = m.prefill(ids, return_streams=True)
    gd = GpuMtpDrafter()
    gd.begin(m, 16)
    gd.propose(streams[:2], ids[1:3], 1)
    before = gd.state.snapshot()
    bad = [
        ((streams[2:4], ids[3:4], 1), "next_tokens has 1 entries"),
        ((streams[2:4, :2], ids[3:5], 1), "hc_rows must be"),
        ((streams[2:4], ids[3:5], 0), "k = 0"),
        ((streams[2:4], [1, cfg.vocab_size], 1), "out of range|vocab"),
        ((streams[2:4] * cp.float32(np.inf), ids[3:5], 1), "non-finite"),
        ((streams[2:4].astype(cp.int32), ids[3:5], 1), "floating point"),
        ((cp.concatenate([streams] * 3)[:14], list(range(1, 15)), 2), "max_seq_len"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gd.propose(*args)
        after = gd.state.snapshot()
        assert gd.state.pos == 2 and all(np.array_equal(before[k], after[k]) for k in before), msg

    class Taps(ScriptedDrafterTestDouble):   # handed the taps' rows [m, 1, hc, dim]
        def trunk_taps(self, model):
            return (1,)

        def propose(self, hc_rows, next_tokens, k, sampler=None):
            assert hc_rows.shape[1:] == (1, cfg.hc_mult, cfg.hidden_size), hc_rows.shape
            return super().propose(hc_rows, next_tokens, k, sampler)
    want = m.generate(ids, 4)
    res = speculative_generate(m, ids, 4, 2, Taps(ids, want, cfg.vocab_size, 0))
    _check_lossless(m, ids, res.tokens, want)
    with pytest.raises(ValueError, match="k = 0"):
        speculative_generate(m, ids, 4, 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        speculative_generate(m, ids, 4, 1, state=m.new_state(max_seq_len=8))
