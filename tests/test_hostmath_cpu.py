"""CPU checks of the device-hostmath / legacy one-token islands (memra_dsv4.gpu.hostmath): the
host rules against the oracle's own functions, the candidate list against a transcription of
build_cand (kernels_cu/decode.cu), the one-token dispatch decision and the step module's flags.
The device halves (HostIO, the *_island launches) need a GPU: tests/gpu/test_decode_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.gpu import hostmath as HM
from memra_dsv4.oracle import ops as O


def _bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_hc_rule_is_the_oracle_split_bytewise():
    rng = np.random.default_rng(0)
    hc, iters, eps = 4, 20, 1e-6
    for _ in range(20):
        m = rng.standard_normal(24).astype(np.float32) * 3
        sc = rng.standard_normal(3).astype(np.float32)
        b = rng.standard_normal(24).astype(np.float32)
        p, q, c = HM.hc_rule(m, sc, b, hc, iters, eps)
        rp, rq, rc = O.hc_split(m[None], sc, b, hc, iters, eps)
        for a, r in ((p, rp[0]), (q, rq[0]), (c, rc[0])):
            assert a.dtype == np.float32 and a.tobytes() == np.ascontiguousarray(r).tobytes()


def test_head_rule_is_the_oracle_gate_bytewise():
    rng = np.random.default_rng(1)
    m = rng.standard_normal(4).astype(np.float32)
    sc, b = rng.standard_normal(1).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    got = HM.head_rule(m, sc, b, 1e-6)
    ref = O.hc_head_weights(m[None], sc, b, 1e-6)[0]
    assert got.dtype == np.float32 and got.tobytes() == np.ascontiguousarray(ref).tobytes()


@pytest.mark.parametrize("hashed", [False, True])
def test_route_rule_is_the_oracle_router_bytewise(hashed):
    rng = np.random.default_rng(2)
    E, k = 16, 4
    lg = rng.standard_normal(E).astype(np.float32)
    lg[3] = lg[5]   # a tie: lower expert id first
    if hashed:
        t2e = np.stack([rng.permutation(E)[:k] for _ in range(50)])
        ids, w = HM.route_rule(lg, k, 2.5, tid2eid=t2e, token=17)
        ri, rw, _ = O.router(lg[None], k=k, route_scale=2.5, tid2eid=t2e,
                             token_ids=np.array([17]))
    else:
        bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
        ids, w = HM.route_rule(lg, k, 2.5, bias=bias)
        ri, rw, _ = O.router(lg[None], k=k, route_scale=2.5, bias=bias)
    assert ids.dtype == np.int32 and w.dtype == np.float32
    assert np.array_equal(ids, ri[0]) and w.tobytes() == np.ascontiguousarray(rw[0]).tobytes()


@pytest.mark.parametrize("n_valid,k,width", [(0, 4, 4), (3, 4, 4), (4, 4, 4), (37, 8, 8),
                                             (37, 8, 10), (200, 64, 64)])
def test_index_rule_is_the_oracle_topk_ascending(n_valid, k, width):
    rng = np.random.default_rng(n_valid)
    N = max(n_valid, 1) + 5
    s = rng.standard_normal(N).astype(np.float32)
    s[1::7] = s[0]                       # ties -> lower index
    bits = _bits(s)
    got = HM.index_rule(bits, n_valid, k, width)
    f = (bits.astype(np.uint32) << 16).view(np.float32)
    ref = O.indexer_topk(f[None], np.array([n_valid]), k)[0]
    ref = np.sort(ref[ref >= 0])
    assert got.dtype == np.int32 and got.shape == (width,)
    assert np.array_equal(got[:ref.size], ref) and (got[ref.size:] == -1).all()


def _build_cand(pos, W, ratio, K, sel=None):
    """kernels_cu/decode.cu build_cand, transcribed."""
    out = []
    for j in range(K):
        v = -1
        if j < W:
            t = max(pos - W + 1, 0) + j
            if t <= pos:
                v = t % W
        elif ratio > 0:
            k = j - W
            if sel is None:
                if k < (pos + 1) // ratio:
                    v = W + k
            elif k < len(sel) and sel[k] >= 0:
                v = W + sel[k]
        out.append(v)
    return np.array(out, np.int32)


@pytest.mark.parametrize("W", [4, 8])
def test_step_candidates_equal_build_cand(W):
    rng = np.random.default_rng(W)
    for pos in range(0, 70):
        assert np.array_equal(HM.step_candidates(pos, W, 0, W), _build_cand(pos, W, 0, W))
        for r, n in ((16, 80 // 16), (4, 80 // 4)):   # HCA: K = W + the rows of msl 80
            assert np.array_equal(HM.step_candidates(pos, W, r, W + n), _build_cand(pos, W, r, W + n))
        nv, width = (pos + 1) // 4, 6                    # CSA: the selection, -1 padded
        sel = HM.index_rule(_bits(rng.standard_normal(max(nv, 1))), nv, width, width)
        assert np.array_equal(HM.step_candidates(pos, W, 4, W + width, sel),
                              _build_cand(pos, W, 4, W + width, list(sel)))


def _build_cand_rows(pos0, T, W, ratio, K, sels=None, shadow_row=0):
    """kernels_cu/decode.cu build_cand's multi-row form (grid.y = T), transcribed."""
    out = []
    for t in range(T):
        p = pos0 + t
        row = _build_cand(p, W, ratio, K, None if sels is None else sels[t])
        for j in range(min(W, K)):
            q = max(p - W + 1, 0) + j
            if q <= p and shadow_row > 0 and q < pos0 and q + W - pos0 < T:
                row[j] = shadow_row + q % W
        out.append(row)
    return np.stack(out)


@pytest.mark.parametrize("W,T", [(8, 2), (8, 8), (4, 3), (128, 8)])
def test_verify_candidates_read_what_a_step_reads(W, T):
    """The verify's rows all write the ring before any row attends; with the shadow rows each row
    t still reads the kv rows of positions max(p - W + 1, 0)..p (p = pos0 + t) in the step's
    order: a simulated buffer [ring | comp | ring_copy] holding position ids gives, through
    verify_candidates, exactly the positions step_candidates gives on the pre-verify ring with
    rows 0..t written.  Also == the kernel's transcription."""
    n_comp = 10
    shadow = W + n_comp
    for pos0 in list(range(0, 3 * W + 2)) + [1000, 1000 + W - 1]:
        ring = np.full(W, -1)
        for q in range(max(0, pos0 - W), pos0):
            ring[q % W] = q                  # the pre-verify ring: the latest position of each slot
        buf = np.full(W + n_comp + W, -7)
        buf[shadow:] = ring                  # the journal's copy (ring_copy)
        after = ring.copy()
        for j in range(T):
            after[(pos0 + j) % W] = pos0 + j  # every row's kv written
        buf[:W] = after
        want_cands = _build_cand_rows(pos0, T, W, 0, W, shadow_row=shadow)
        for t in range(T):
            step_ring = ring.copy()
            for j in range(t + 1):
                step_ring[(pos0 + j) % W] = pos0 + j
            ref = HM.step_candidates(pos0 + t, W, 0, W)
            want = [step_ring[c] if c >= 0 else None for c in ref]
            got_c = HM.verify_candidates(pos0, t, T, W, 0, W, shadow_row=shadow)
            assert np.array_equal(got_c, want_cands[t]), f"twin != kernel transcription at pos0 {pos0} t {t}"
            got = [buf[c] if c >= 0 else None for c in got_c]
            assert got == want, f"pos0 {pos0} row {t}: reads {got}, a step reads {want}"
        assert np.array_equal(_build_cand_rows(pos0, T, W, 0, W),
                              np.stack([HM.step_candidates(pos0 + t, W, 0, W) for t in range(T)])), (
            "without shadow rows the multi-row form is the step's per row")


def test_sel_width_is_the_step_plans():
    from memra_dsv4.config import preset
    from memra_dsv4.gpu import step
    cfg = preset("tiny")
    csa = [l for l in range(cfg.num_hidden_layers) if cfg.attn_kind(l) == "csa"]
    for msl in (3, 64, 1024, 65536):
        p = step.step_ws_plan(cfg, csa, False, True, msl)
        assert tuple(p.slot("idx.sel").shape) == (HM.sel_width(cfg.index_topk, msl),)
        assert tuple(p.slot("dev.head_pre").shape) == (1, cfg.hc_mult)
        assert HM.sel_width(cfg.index_topk, msl) == min(cfg.index_topk, max(1, msl // 4))


def test_one_token_dispatch_decision():
    from memra_dsv4.gpu.decode import one_token_dispatch
    assert one_token_dispatch(1, None, False, True) is True
    for S in (1, 2, 64):                 # prefills, prefill_chunk, verify: never asked
        assert one_token_dispatch(S, None, False, False) is False
        assert one_token_dispatch(S, object(), True, False) is False
    for args in ((2, None, False), (1, object(), False), (1, None, True)):
        with pytest.raises(ValueError, match="one_token dispatch"):
            one_token_dispatch(*args, True)


def test_decode_step_plumbing(monkeypatch):
    """legacy decode_step asks forward_chunk for the one-token dispatch; device paths go to
    device_step (fakes: no GPU)."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu import decode, step
    from memra_dsv4.gpu.cache import DecodeState
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = object.__new__(Dsv4Gpu)
    m.config, m.max_seq_len = preset("tiny"), 64
    st = object.__new__(DecodeState)
    st.owner, st.journal, st.pos, st.max_seq_len = m, None, 5, 64
    seen = []
    monkeypatch.setattr(decode, "forward_chunk",
                        lambda model, state, ids, **kw: seen.append(("legacy", list(ids), kw)) or 1)
    monkeypatch.setattr(step, "device_step",
                        lambda model, state, tok, readback="logits", out=None: seen.append((model.decode_path, tok, readback)) or 2)
    m.decode_path = "legacy"
    assert m.decode_step(st, 7) == 1
    m.decode_path = "device-hostmath"
    assert m.decode_step(st, 8) == 2
    assert m.decode_step(st, 9, readback="token") == 2
    assert seen == [("legacy", [7], {"ph": "decode", "one_token": True}), ("device-hostmath", 8, "logits"),
                    ("device-hostmath", 9, "token")]
    with pytest.raises(ValueError, match="readback='all'; expected 'logits' or 'token'"):
        m.decode_step(st, 9, readback="all")


def test_decode_greedy_plumbing_and_refusals(monkeypatch):
    """decode_greedy (fakes: no GPU): legacy is n host-fed steps taking greedy_token of each
    step's logits; the device paths go to DeviceStep.greedy; every refusal names the problem
    before any step, and leaves pos."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu import decode
    from memra_dsv4.gpu.cache import DecodeState
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = object.__new__(Dsv4Gpu)
    m.config, m.max_seq_len = preset("tiny"), 64
    V = m.config.vocab_size
    st = object.__new__(DecodeState)
    st.owner, st.journal, st.pos, st.max_seq_len = m, None, 5, 64
    fed = []

    def fake_chunk(model, state, ids, **kw):   # logits whose argmax is (token + 3) % V
        fed.append(int(ids[0]))
        state.pos += 1
        lg = np.zeros(V, np.float32)
        lg[(int(ids[0]) + 3) % V] = 1.0
        return lg
    monkeypatch.setattr(decode, "forward_chunk", fake_chunk)
    m.decode_path = "legacy"
    out = m.decode_greedy(st, 7, 4)
    assert out.dtype == np.int32 and out.tolist() == [10, 13, 16, 19] and fed == [7, 10, 13, 16]
    assert st.pos == 9

    class FakeStep:
        def greedy(self, state, token, n):
            fed.append(("device", token, n))
            return np.arange(n, dtype=np.int32)
    m.decode_path, m._step = "device", FakeStep()
    assert m.decode_greedy(st, 3, np.int64(2)).tolist() == [0, 1]
    assert fed[-1] == ("device", 3, 2)
    n_fed = len(fed)
    for n, msg in ((0, "n must be an integer >= 1"), (True, "n must be an integer >= 1"),
                   (2.0, "n must be an integer >= 1"), ("3", "n must be an integer >= 1"),
                   (64 - 9 + 1, "exceed max_seq_len")):
        with pytest.raises(ValueError, match=msg):
            m.decode_greedy(st, 3, n)
    for tok in (-1, V, [1, 2]):
        with pytest.raises(ValueError):
            m.decode_greedy(st, tok, 1)
    assert len(fed) == n_fed and st.pos == 9


def test_generate_is_prefill_then_one_decode_greedy(monkeypatch):
    """generate (fakes: no GPU): the first token is np.argmax of the prefill's logits, the other
    max_new - 1 come from ONE decode_greedy call fed that token; max_new and the room are checked
    before the prefill runs."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = object.__new__(Dsv4Gpu)
    m.config, m.max_seq_len = preset("tiny"), 16
    V = m.config.vocab_size
    calls = []

    def fake_prefill(ids, state=None):
        calls.append(("prefill", [int(t) for t in ids]))
        lg = np.zeros(V, np.float32)
        lg[[4, 9]] = 2.0   # a tie: np.argmax takes the first
        return lg, "state"

    def fake_greedy(state, token, n):
        calls.append(("greedy", state, token, n))
        return np.arange(100, 100 + n, dtype=np.int32)
    m.prefill, m.decode_greedy = fake_prefill, fake_greedy
    assert m.generate([1, 2, 3], 5) == [4, 100, 101, 102, 103]
    assert calls == [("prefill", [1, 2, 3]), ("greedy", "state", 4, 4)]
    calls.clear()
    assert m.generate([1, 2, 3], 1) == [4] and calls == [("prefill", [1, 2, 3])]
    calls.clear()
    assert m.generate([1, 2, 3], 0) == [] and calls == []
    assert m.generate([1, 2, 3], 14) and calls[-1] == ("greedy", "state", 4, 13)   # 3 + 13 = 16
    calls.clear()
    for bad, msg in ((15, "exceed max_seq_len"), (-1, "non-negative integer"),
                     (True, "non-negative integer"), (2.0, "non-negative integer")):
        with pytest.raises(ValueError, match=msg):
            m.generate([1, 2, 3], bad)
    with pytest.raises(ValueError):
        m.generate([1, V], 2)
    assert calls == []


def test_decode_step_out_array(monkeypatch):
    """decode_step(out=): the logits land in the caller's float32 [vocab] array, which is
    returned (legacy: copied; device: handed to device_step); a wrong out is refused, naming
    the problem, before any step (pos unchanged)."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu import decode, step
    from memra_dsv4.gpu.cache import DecodeState
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = object.__new__(Dsv4Gpu)
    m.config, m.max_seq_len = preset("tiny"), 64
    V = m.config.vocab_size
    st = object.__new__(DecodeState)
    st.owner, st.journal, st.pos, st.max_seq_len = m, None, 5, 64
    ran = []

    def fake_chunk(model, state, ids, **kw):
        ran.append(int(ids[0]))
        state.pos += 1
        return np.arange(V, dtype=np.float32)
    monkeypatch.setattr(decode, "forward_chunk", fake_chunk)
    got = []
    monkeypatch.setattr(step, "device_step",
                        lambda model, state, tok, readback="logits", out=None: got.append(out) or out)
    buf = np.full(V, -1, np.float32)
    m.decode_path = "legacy"
    assert m.decode_step(st, 7, out=buf) is buf and np.array_equal(buf, np.arange(V))
    m.decode_path = "device"
    assert m.decode_step(st, 8, out=buf) is buf and got == [buf]
    n_ran, pos = len(ran), st.pos
    bad = [(np.zeros(V, np.float64), "float32"), (np.zeros(V + 1, np.float32), "float32"),
           (np.zeros((1, V), np.float32), "float32"), ([0.0] * V, "NumPy float32 array"),
           (np.zeros(2 * V, np.float32)[::2], "C-contiguous and writeable")]
    ro = np.zeros(V, np.float32)
    ro.flags.writeable = False
    bad.append((ro, "C-contiguous and writeable"))
    for arr, msg in bad:
        with pytest.raises(ValueError, match=msg):
            m.decode_step(st, 9, out=arr)
    with pytest.raises(ValueError, match="out= receives logits"):
        m.decode_step(st, 9, readback="token", out=buf)
    assert len(ran) == n_ran and len(got) == 1 and st.pos == pos


def test_step_token_checks_a_scalar_without_numpy(monkeypatch):
    """Dsv4Gpu._step_token: a Python int or NumPy integer scalar is checked in plain Python (no
    NumPy call: it runs right after the previous step's host wait), with check_ids' own
    out-of-range message; anything else still goes through check_ids and is refused as before."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu import model as gm
    from memra_dsv4.gpu.cache import DecodeState
    m = object.__new__(gm.Dsv4Gpu)
    m.config, m.max_seq_len = preset("tiny"), 64
    V = m.config.vocab_size
    st = object.__new__(DecodeState)
    st.owner, st.journal, st.pos, st.max_seq_len = m, None, 5, 64

    class NoArrays:   # the module's np during the fast path: integer only, any array call fails
        integer = np.integer

        def __getattr__(self, name):
            raise AssertionError(f"np.{name} called on the scalar path")
    slow = {tok: m._step_token(st, tok, "decode_step") for tok in (0, 7, V - 1)}
    from memra_dsv4.oracle import model as om   # check_token_scalar's module
    monkeypatch.setattr(gm, "np", NoArrays())
    monkeypatch.setattr(om, "np", NoArrays())
    for tok in (0, 7, V - 1, np.int64(7), np.int32(V - 1), np.uint16(3)):
        got = m._step_token(st, tok, "decode_step")
        assert type(got) is int and got == int(tok) and slow.get(got, got) == got
    for tok in (-1, V, np.int64(V), np.uint64(2 ** 63 + 1)):
        with pytest.raises(ValueError, match=rf"token_ids\[0\] = {int(tok)} is outside the "
                                             rf"vocabulary 0..{V - 1} \(1 ids out of range\)"):
            m._step_token(st, tok, "decode_step")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=rf"token_ids\[0\] = {V} is outside the vocabulary"):
        m._step_token(st, np.asarray(V), "decode_step")   # the check_ids path: the same message
    assert m._step_token(st, np.asarray(9), "decode_step") == 9
    for bad, msg in ((True, "booleans"), (np.bool_(True), "booleans"), (2.0, "integers"),
                     ([1, 2], "one integer id"), ("3", "must be integers, got dtype")):
        with pytest.raises(ValueError, match=msg):
            m._step_token(st, bad, "decode_step")
    st.journal = type("J", (), {"k": 2, "p0": 4})()
    with pytest.raises(ValueError, match="uncommitted verify"):
        m._step_token(st, 7, "decode_step")
