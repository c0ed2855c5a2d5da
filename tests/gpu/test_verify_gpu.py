"""GPU speculative verify / commit (memra_dsv4.gpu.verify) on the device DecodeState: the chunk
routine (pinned by an autouse fixture; the device verify is tests/gpu/test_verify_step_gpu.py's).

* The rollback restores bytes: after verify(k) + commit(n), every ring slot the verify wrote holds
  the verify's own vector of the newest kept position mapping to it, else its pre-verify row;
  the pending rows equal host.pending.advance_pending of the pre-verify rows with the verify's
  own projections of the kept positions; compressed / indexer rows past the kept count are 0.
  (tiny: W = 8, so k + 1 = 10 writes slots twice; CSA ratio 4 and HCA 16 emit inside the chunk.)
* commit(k) keeps the whole chunk: the state equals a prefill_chunk of the same k + 1 tokens, byte
  for byte (the same chunk routine with the same rows).
* Rows and committed states against k + 1 single-token decode steps: bf16 class, judged as in
  test_decode_gpu (the chunk's GEMMs have M = k + 1 rows).
* Decoding continues after a commit on both paths; bad calls are refused and leave the state as
  it was.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import _ids, _logit_check, _model, _state_check  # prepend import mode

cp = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _chunk_routine(monkeypatch):
    """This file tests the chunk routine's verify and journal: pinned to it whatever the models'
    verify_path (MEMRA_DSV4_VERIFY_PATH), so the device verify can become the default
    (tests/gpu/test_verify_step_gpu.py tests that one)."""
    from memra_dsv4.gpu import verify as V
    monkeypatch.setattr(V, "device_verify_of", lambda model, state, rows: None)


def _pending_replay(kv, score, a, z, p0, ratio):
    from memra_dsv4.host.pending import advance_pending
    kv, score = kv.copy(), score.copy()
    advance_pending(kv, score, a, z, p0, ratio)
    return kv, score


@pytest.mark.parametrize("L,k", [(5, 9), (13, 3), (30, 16)])
@pytest.mark.parametrize("n", ["zero", "mid", "all"])
def test_rollback_restores_bytes(L, k, n):
    ck, m = _model("tiny")
    ids = _ids(ck.config, L + k + 1, seed=L * 31 + k)
    _, st = m.prefill(ids[:L], m.new_state())
    before = {lid: (c.ring.get(), None if c.comp_state is None else
                    (c.comp_state.kv.get(), c.comp_state.score.get()),
                    None if c.idx_state is None else (c.idx_state.kv.get(), c.idx_state.score.get()))
              for lid, c in zip(st.layer_ids, st.layers)}
    rows = m.verify(st, ids[L:L + k + 1])
    assert rows.shape == (k + 1, ck.config.vocab_size) and st.journal is not None
    jr = st.journal
    nn = {"zero": 0, "mid": k // 2, "all": k}[n]
    m.commit(st, nn)
    assert st.pos == L + nn + 1 and st.journal is None
    last = L + nn
    W = ck.config.sliding_window
    for lid, c in zip(st.layer_ids, st.layers):
        j = jr.layers[lid]
        ring0, comp0, idx0 = before[lid]
        ring = c.ring.get()
        kvj = j.kv.get()
        for slot in range(W):
            q = last - ((last - slot) % W)
            if slot in set(j.slots.tolist()):
                want = kvj[q - L] if q >= L else ring0[slot]
            else:
                want = ring0[slot]
            assert np.array_equal(ring[slot], want), f"layer {lid} ring slot {slot}"
        if c.ratio:
            a, z = (x.get()[:nn + 1] for x in j.comp_az)
            wkv, wsc = _pending_replay(*comp0, a, z, L, c.ratio)
            assert np.array_equal(c.comp_state.kv.get(), wkv), f"layer {lid} pending kv"
            assert np.array_equal(c.comp_state.score.get(), wsc), f"layer {lid} pending score"
            lo, hi = (last + 1) // c.ratio, (L + k + 1) // c.ratio
            assert not c.comp[lo:hi].get().any(), f"layer {lid}: rolled-back entries not zeroed"
        if c.idx_state is not None:
            a, z = (x.get()[:nn + 1] for x in j.idx_az)
            wkv, wsc = _pending_replay(*idx0, a, z, L, 4)
            assert np.array_equal(c.idx_state.kv.get(), wkv), f"layer {lid} idx pending kv"
            assert np.array_equal(c.idx_state.score.get(), wsc), f"layer {lid} idx pending score"


def test_commit_all_equals_prefill_chunk_bytes():
    ck, m = _model("tiny")
    L, k = 11, 6
    ids = _ids(ck.config, L + k + 1, seed=5)
    _, sa = m.prefill(ids[:L], m.new_state())
    _, sb = m.prefill(ids[:L], m.new_state())
    rows = m.verify(sa, ids[L:L + k + 1])
    m.commit(sa, k)
    ref = m.prefill_chunk(sb, ids[L:L + k + 1], all_logits=True)
    assert np.array_equal(rows, ref)
    ga, gb = sa.snapshot(), sb.snapshot()
    diff = [key for key in ga if not np.array_equal(ga[key], gb[key])]
    assert not diff, f"verify + commit(k) vs prefill_chunk differ in {diff}"


@pytest.mark.parametrize("path", ["legacy", "device"])
def test_verify_commit_vs_sequential_decode(path):
    """Rows of verify([t, d1..dk]) vs k+1 decode steps; the state after commit(n) vs n+1 steps;
    then 5 more decode steps on the committed state (both in bf16-class bounds)."""
    ck, m = _model("tiny", (0,), path)
    L, k, nn = 20, 5, 2
    ids = _ids(ck.config, L + k + 1 + 5, seed=77)
    _, sv = m.prefill(ids[:L], m.new_state())
    _, sd = m.prefill(ids[:L], m.new_state())
    rows = m.verify(sv, ids[L:L + k + 1])
    fails, lines, flips = [], [], []        # at most MAX_FLIPS near-tie flips in the whole test
    seq = [m.decode_step(sd, t) for t in ids[L:L + nn + 1]]
    for i in range(nn + 1):
        _logit_check(f"row {i} vs decode step", rows[i], seq[i], fails, lines, flips)
    m.commit(sv, nn)
    _state_check(sv, sd, fails, lines)
    for t in ids[L + k + 1:]:
        _logit_check(f"after commit pos {sv.pos}", m.decode_step(sv, t), m.decode_step(sd, t),
                     fails, lines, flips)
    print("\n".join(lines))
    assert not fails, "\n".join(fails)


def test_bad_calls_refused_and_state_unchanged():
    ck, m = _model("tiny")
    ids = _ids(ck.config, 12, seed=9)
    _, st = m.prefill(ids[:6], m.new_state())
    snap = st.snapshot()
    V = ck.config.vocab_size
    with pytest.raises(ValueError, match="no uncommitted verify"):
        m.commit(st, 0)
    for bad, word in (([ids[6]], "k = 0"), (ids[:1] * 18, "k = 17"), ([1, V], "outside")):
        with pytest.raises(ValueError, match=word):
            m.verify(st, bad)
    after = st.snapshot()
    assert all(np.array_equal(snap[x], after[x]) for x in snap), "refused verify changed the state"
    m.verify(st, ids[6:9])
    for call, word in ((lambda: m.decode_step(st, 1), "uncommitted verify"),
                       (lambda: m.verify(st, ids[6:9]), "uncommitted verify"),
                       (lambda: m.prefill_chunk(st, [1]), "uncommitted verify"),
                       (lambda: m.commit(st, 3), "outside 0..k"),
                       (lambda: m.commit(st, 1.0), "integer"),
                       (lambda: m.commit(st, True), "integer")):
        with pytest.raises(ValueError, match=word):
            call()
    assert st.journal is not None and st.pos == 9
    m.commit(st, 1)
    assert st.pos == 8 and st.journal is None
