"""The device verify (memra_dsv4.gpu.verify_step, seam MEMRA_DSV4_VERIFY_PATH = device) against
the device step, byte for byte.

* Row t of verify([t0, d1..dk]) at pos: the logits a device step returns for the same token at
  pos + t after the previous rows (the same kernels per row; the multi-row GEMVs keep gemv_bf16's
  bits per row; the FP4 expert slots keep the row arithmetic).
* commit(n): the caches equal, array for array, those of n + 1 device steps from the same state
  (ring, compressed rows, indexer keys, both pending states), pos = p0 + n + 1; the next step's
  logits agree byte for byte.
* Boundary positions on tiny (W = 8, CSA ratio 4, HCA 16): prompts of 1..3 tokens, rows across
  the first CSA emit (positions 3 / 7), the window wrap (7 / 8), the first HCA emit (15), and
  later (28..35: the indexer's top-k of 2 drops blocks there); k up to row_limit - 1 = 7.
* Graph replay == eager (the eager call with row_form "per_row": the step's one-token hc boundary,
  router and shared-expert launches per row: the same bytes);
  the graph with PDL (the model's seam) == without it;
  a second verify of the same shape replays the same graph.
* return_streams / taps: the last trunk layer's tap is the returned final streams, byte for byte;
  against the chunk routine's verify within the bf16 class (logits as test_decode_gpu judges).
* Greedy speculative decoding with the device verify == the device path's greedy generate.
* k + 1 beyond row_limit takes the chunk routine (its journal type says so).
* commit_form "device" (one verify_rollback launch per stage) == the host form's caches.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import _ids, _logit_check, _model  # prepend import mode

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture
def device_verify():
    """The cached device-path model with verify_path "device" for the test (restored after)."""
    made = []

    def get(name="tiny", devices=(0,)):
        ck, m = _model(name, devices, "device")
        made.append((m, m.verify_path))
        m.verify_path = "device"
        return ck, m
    yield get
    for m, old in made:
        m.verify_path = old


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _caches(st):
    out = {"pos": np.array([st.pos])}
    for lid, c in zip(st.layer_ids, st.layers):
        out[f"{lid}.ring"] = c.ring.get()
        if c.ratio:
            out[f"{lid}.comp"] = c.comp.get()
            out[f"{lid}.comp_kv"] = c.comp_state.kv.get()
            out[f"{lid}.comp_score"] = c.comp_state.score.get()
        if c.idx_state is not None:
            out[f"{lid}.idx_keys"] = c.idx_keys.get()
            out[f"{lid}.idx_kv"] = c.idx_state.kv.get()
            out[f"{lid}.idx_score"] = c.idx_state.score.get()
    return out


def _same_caches(a, b, tag):
    bad = [k for k in a if not np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))]
    assert not bad, f"{tag}: caches differ in {bad[:6]}"


def _steps(m, st, toks):
    return [m.decode_step(st, t).copy() for t in toks]


@pytest.mark.parametrize("L,k", [(1, 2), (2, 7), (3, 4), (6, 5), (13, 4), (28, 7)])
def test_rows_and_commit_equal_device_steps(device_verify, L, k):
    ck, m = device_verify("tiny")
    ids = _ids(ck.config, L + k + 2, seed=L * 7 + k)
    toks = ids[L:L + k + 1]
    _, sv = m.prefill(ids[:L], m.new_state())
    _, ss = m.prefill(ids[:L], m.new_state())
    rows = m.verify(sv, toks)
    assert rows.shape == (k + 1, ck.config.vocab_size)
    from memra_dsv4.gpu.verify_step import DeviceJournal
    assert isinstance(sv.journal, DeviceJournal)
    steps = _steps(m, ss, toks)
    for t in range(k + 1):
        assert np.array_equal(_bits(rows[t]), _bits(steps[t])), (
            f"L {L} k {k}: row {t} differs from the device step (max |d| "
            f"{np.max(np.abs(rows[t] - steps[t])):.3e})")
    for n in sorted({0, k // 2, k}):
        _, sa = m.prefill(ids[:L], m.new_state())
        _, sb = m.prefill(ids[:L], m.new_state())
        m.verify(sa, toks)
        m.commit(sa, n)
        assert sa.pos == L + n + 1 and sa.journal is None
        _steps(m, sb, toks[:n + 1])
        _same_caches(_caches(sa), _caches(sb), f"L {L} k {k} commit({n})")
        nxt = ids[L + n + 1]
        a, b = m.decode_step(sa, nxt), m.decode_step(sb, nxt)
        assert np.array_equal(_bits(a), _bits(b)), f"L {L} k {k} commit({n}): the next step differs"


def test_graph_equals_eager_and_replays(device_verify):
    ck, m = device_verify("tiny")
    L, k = 9, 4
    ids = _ids(ck.config, L + k + 1, seed=3)
    toks = np.asarray(ids[L:L + k + 1], np.int64)
    _, sg = m.prefill(ids[:L], m.new_state())
    _, se = m.prefill(ids[:L], m.new_state())
    g = m.verify(sg, toks)
    vs = m._verify_step
    n_graphs = len(vs._graphs[sg])
    vs.row_form = "per_row"   # the step's own one-token launches per row, eagerly
    try:
        e = vs.verify(se, toks, graph=False)
    finally:
        vs.row_form = "rows"
    assert np.array_equal(_bits(g), _bits(e)), (
        "graph replay (multi-row boundaries / router / shared expert) != eager (per row)")
    m.commit(sg, 2)
    m.commit(se, 2)   # the eager call journaled too
    _same_caches(_caches(sg), _caches(se), "graph vs eager commit(2)")
    more = _ids(ck.config, k + 1, seed=4)
    m.verify(sg, more)   # same (state, rows): the same graph
    assert len(vs._graphs[sg]) == n_graphs
    m.commit(sg, 0)


def test_pdl_on_off_same_bytes(device_verify):
    """The verify's graph with PDL (the model's seam, on by default) and without it: the same
    logits and, after commit(k), the same caches as k + 1 device steps; one graph per form."""
    ck, m = device_verify("tiny")
    L, k = 14, 5   # rows 14..19: the first HCA emit (15) and a CSA emit (15, 19)
    ids = _ids(ck.config, L + k + 1, seed=11)
    toks = np.asarray(ids[L:L + k + 1], np.int64)
    old = m.pdl
    out = {}
    try:
        for form in ("off", "on"):
            m.pdl = form
            _, s = m.prefill(ids[:L], m.new_state())
            out[form] = (m.verify(s, toks), s)
            assert (k + 1, (), form == "on", "rows") in m._verify_step._graphs[s], f"pdl {form}: no graph"
            m.commit(s, k)
    finally:
        m.pdl = old
    assert np.array_equal(_bits(out["on"][0]), _bits(out["off"][0])), "PDL on != off (logits)"
    _same_caches(_caches(out["on"][1]), _caches(out["off"][1]), "PDL on vs off commit(k)")
    _, sd = m.prefill(ids[:L], m.new_state())
    want = _steps(m, sd, toks)
    assert np.array_equal(_bits(out["on"][0]), _bits(np.stack(want))), "PDL verify != device steps"
    _same_caches(_caches(out["on"][1]), _caches(sd), "PDL verify commit(k) vs k + 1 steps")


@pytest.mark.parametrize("L,k", [(2, 7), (13, 4), (28, 7)])
def test_device_commit_equals_host(device_verify, L, k):
    """commit_form "device" (ops_decode.verify_rollback: one launch per stage) leaves the caches
    the host form leaves, array for array, for every n; the next verify from both agrees."""
    ck, m = device_verify("tiny")
    ids = _ids(ck.config, L + 2 * (k + 1), seed=L + 5 * k)
    toks = np.asarray(ids[L:L + k + 1], np.int64)
    vs = None
    try:
        for n in range(k + 1):
            _, sh = m.prefill(ids[:L], m.new_state())
            _, sd = m.prefill(ids[:L], m.new_state())
            m.verify(sh, toks)
            vs = m._verify_step
            m.verify(sd, toks)
            m.commit(sh, n)
            vs.commit_form = "device"
            m.commit(sd, n)
            vs.commit_form = "host"
            _same_caches(_caches(sd), _caches(sh), f"L {L} k {k} device commit({n}) vs host")
            more = np.asarray(ids[L + k + 1:L + 2 * (k + 1)], np.int64)
            a, b = m.verify(sh, more), m.verify(sd, more)
            assert np.array_equal(_bits(a), _bits(b)), f"L {L} k {k} n {n}: the next verify differs"
            m.commit(sh, 0)
            m.commit(sd, 0)
    finally:
        if vs is not None:
            vs.commit_form = "host"


def test_streams_and_taps(device_verify):
    ck, m = device_verify("tiny")
    cfg = ck.config
    L, k = 10, 3
    ids = _ids(cfg, L + k + 1, seed=11)
    toks = ids[L:L + k + 1]
    _, s1 = m.prefill(ids[:L], m.new_state())
    rows, streams = m.verify(s1, toks, return_streams=True)
    assert streams.shape == (k + 1, cfg.hc_mult, cfg.hidden_size) and streams.dtype == cp.float32
    m.commit(s1, 0)
    last = cfg.num_hidden_layers - 1
    _, s2 = m.prefill(ids[:L], m.new_state())
    rows2, taps = m.verify(s2, toks, return_streams=True, taps=(1, last))
    assert taps.shape == (k + 1, 2, cfg.hc_mult, cfg.hidden_size)
    assert np.array_equal(_bits(rows), _bits(rows2))
    assert np.array_equal(taps[:, 1].get().view(np.uint32), streams.get().view(np.uint32)), (
        "the last layer's tap != the final streams")
    m.commit(s2, 0)
    # against the chunk routine's verify: bf16 class
    m.verify_path = "chunk"
    _, s3 = m.prefill(ids[:L], m.new_state())
    rows3, taps3 = m.verify(s3, toks, return_streams=True, taps=(1, last))
    m.commit(s3, 0)
    m.verify_path = "device"
    fails, lines = [], []
    for t in range(k + 1):
        _logit_check(f"row {t}", rows[t], rows3[t], fails, lines, flips=[])
    for j in range(2):   # rel L2 of each tap (unrelated streams would give ~1.4)
        a, b = taps[:, j].astype(cp.float64), taps3[:, j].astype(cp.float64)
        rel = float(cp.linalg.norm(a - b) / cp.linalg.norm(b))
        lines.append(f"tap {j}: rel L2 {rel:.3e} against the chunk verify")
        if rel > 5e-2:
            fails.append(f"tap {j}: rel L2 {rel:.3e} > 5e-2")
    assert not fails, "\n".join(lines + fails)


def test_long_verify_takes_chunk_routine(device_verify):
    from memra_dsv4.gpu.verify import Journal
    from memra_dsv4.gpu.verify_step import row_limit
    ck, m = device_verify("tiny")
    T = row_limit(ck.config) + 1
    ids = _ids(ck.config, 4 + T, seed=8)
    _, st = m.prefill(ids[:4], m.new_state())
    m.verify(st, ids[4:4 + T])
    assert isinstance(st.journal, Journal)
    m.commit(st, 1)
    assert st.pos == 6


@pytest.mark.parametrize("drafter", ["mtp", "scripted"])
def test_speculative_greedy_equals_generate(drafter):
    """Rows equal device steps, so greedy speculative decoding gives generate's tokens exactly
    (no near-tie allowance), with rounds that accept some and reject some drafts (scripted)."""
    from test_drafter_gpu import ScriptedDrafterTestDouble, _drafter_model

    from memra_dsv4.gpu.spec import speculative_generate
    ck, m, _ = _drafter_model("tiny", "device")
    old = m.verify_path
    m.verify_path = "device"
    try:
        n = 20
        for L, seed in [(3, 1), (9, 2)]:
            prompt = _ids(ck.config, L, seed=200 + seed)
            want = m.generate(prompt, n)
            dr = (ScriptedDrafterTestDouble(prompt, want, ck.config.vocab_size, seed)
                  if drafter == "scripted" else None)
            res = speculative_generate(m, prompt, n, 3, dr)
            assert list(res.tokens) == list(want), f"L {L}: {res.tokens} vs {want}"
            if drafter == "scripted":
                assert set(res.accepted) - {0} and min(res.accepted) < 3, res.accepted
            print(f"device verify L={L} k=3 {drafter}: {res.summary()}")
    finally:
        m.verify_path = old


def test_two_stages_equal_steps(device_verify):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    ck, m = device_verify("small", (0, 1))
    L, k = 37, 5
    ids = _ids(ck.config, L + k + 1, seed=2)
    toks = ids[L:L + k + 1]
    _, sv = m.prefill(ids[:L], m.new_state())
    _, ss = m.prefill(ids[:L], m.new_state())
    rows = m.verify(sv, toks)
    steps = _steps(m, ss, toks)
    for t in range(k + 1):
        assert np.array_equal(_bits(rows[t]), _bits(steps[t])), f"row {t}"
    m.commit(sv, k)
    _same_caches(_caches(sv), _caches(ss), "2 stages commit(k)")
