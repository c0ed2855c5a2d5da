"""The device step's greedy token: decode.cu greedy_argmax_f32 against its NumPy twin
(host.sampling.greedy_token = np.argmax's rule), and the two feeds that use it:

* the kernel on random logits of several lengths (1, below / above / at multiples of its 1024
  threads, Flash's vocab) and on the cases where the rule matters: ties (the first index), NaN (the
  first NaN beats +inf), all -inf, -0.0 against +0.0; with pos / hist: hist[pos + 1] = the pick
  (not written past its end or below 0), pos + 1; a wrong dtype or shape is refused;
* ``decode_step(readback="token")`` and ``decode_greedy`` (tokens fed on the device: the head's
  argmax writes the next step's tok, one host wait per call) against host-fed steps that take
  greedy_token of the returned logits, on tiny and flash-layers:2, from one prefill: the same
  tokens, every cache byte equal after the steps, and the next step's logits bit for bit; the
  greedy steps in two calls (chunks 5 + 7) so a call boundary is crossed;
* refusals before any device work (state.pos unchanged): n = 0, n = True, n past max_seq_len,
  a token id out of range, readback not 'logits' / 'token';
* decode_greedy allocates nothing once the step exists (no CuPy device-pool request, no pinned
  host allocation: its picks buffer and position table are the DeviceStep's);
* ``generate`` (prefill, then one decode_greedy call) equals prefill + host-fed decode_step with
  np.argmax, for max_new 1 and 7, and refuses a prompt + max_new past max_seq_len up front."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.host.sampling import greedy_token  # noqa: E402
from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def _argmax_dev(x: np.ndarray) -> int:
    from memra_dsv4.gpu import ops_decode as DK
    tok = cp.full((1,), -7, cp.int32)
    DK.greedy_argmax(cp.asarray(x, dtype=cp.float32), tok)
    return int(tok.get()[0])


@pytest.mark.parametrize("n", [1, 2, 1000, 1024, 1025, 4097, 129280])
def test_greedy_argmax_random(n):
    rng = np.random.default_rng(n)
    for scale in (1.0, 1e-30, 1e30):
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        assert _argmax_dev(x) == greedy_token(x), f"n {n} scale {scale}"


def test_greedy_argmax_rule_cases():
    n = 5000
    cases = {}
    x = np.zeros(n, np.float32)
    cases["all equal"] = x.copy()
    x = np.full(n, -1.0, np.float32); x[3000] = 2.0; x[7] = 2.0
    cases["tie: first index"] = x
    x = np.full(n, -1.0, np.float32); x[1030] = 2.0; x[6] = 2.0; x[4099] = 2.0
    cases["tie across threads and warps"] = x
    x = np.full(n, -np.inf, np.float32)
    cases["all -inf"] = x
    x = np.full(n, -1.0, np.float32); x[99] = np.inf; x[200] = np.nan; x[4000] = np.nan
    cases["NaN beats +inf, first NaN"] = x
    x = np.full(n, -1.0, np.float32); x[5] = -0.0; x[3] = 0.0
    cases["+0.0 first, -0.0 tie"] = x
    x = np.full(n, -1.0, np.float32); x[3] = -0.0; x[5] = 0.0
    cases["-0.0 first, +0.0 tie"] = x
    x = np.full(n, -np.inf, np.float32); x[n - 1] = -3.0e38
    cases["last element"] = x
    for name, x in cases.items():
        assert _argmax_dev(x) == greedy_token(x), name


def test_greedy_argmax_history_and_advance():
    from memra_dsv4.gpu import ops_decode as DK
    x = np.random.default_rng(5).standard_normal(3000).astype(np.float32)
    want = greedy_token(x)
    for p0, L in ((5, 16), (14, 16), (15, 16), (-1, 16)):
        tok = cp.full((1,), -7, cp.int32)
        pos = cp.full((1,), p0, cp.int32)
        hist = cp.full((L,), -3, cp.int32)
        DK.greedy_argmax(cp.asarray(x), tok, pos, hist)
        h = hist.get()
        exp = np.full(L, -3, np.int32)
        if 0 <= p0 + 1 < L:
            exp[p0 + 1] = want
        assert int(tok.get()[0]) == want and int(pos.get()[0]) == p0 + 1, p0
        assert np.array_equal(h, exp), (p0, h)
    tok, pos = cp.zeros((1,), cp.int32), cp.full((1,), 9, cp.int32)
    DK.greedy_argmax(cp.asarray(x), tok, pos)   # no history: the advance alone
    assert int(pos.get()[0]) == 10 and int(tok.get()[0]) == want


def test_greedy_argmax_refusals():
    from memra_dsv4.gpu import ops_decode as DK
    tok = cp.zeros((1,), cp.int32)
    with pytest.raises(AssertionError, match="logits: dtype"):
        DK.greedy_argmax(cp.zeros(8, cp.float16), tok)
    with pytest.raises(AssertionError, match="tok: shape"):
        DK.greedy_argmax(cp.zeros(8, cp.float32), cp.zeros((2,), cp.int32))
    with pytest.raises(AssertionError, match="1 .. 2"):
        DK.greedy_argmax(cp.zeros(0, cp.float32), tok)


def _models(kind: str):
    arms = ("host", "token", "greedy")
    if kind == "tiny":
        from step_models import tiny_prefilled  # noqa: E402  (tests/gpu on sys.path)
        return tiny_prefilled(arms, seed=31)
    from step_models import flash_prefilled
    return flash_prefilled(2, arms, seed=32)


@pytest.mark.parametrize("kind", ["tiny", "flash-layers:2"])
def test_greedy_feeds_agree(kind):
    m, states, ids, prompt = _models(kind)
    assert m.decode_path == "device"
    t0 = int(ids[prompt])
    pos0 = states["host"].pos
    n1, n2 = 5, 7
    host, tok = [], t0
    for _ in range(n1 + n2):   # host-fed, logits read back, the host's argmax
        tok = greedy_token(m.decode_step(states["host"], tok))
        host.append(tok)
    token, tok = [], t0
    for _ in range(n1 + n2):   # host-fed, the head's argmax read back as 4 bytes
        tok = m.decode_step(states["token"], tok, readback="token")
        assert isinstance(tok, int)
        token.append(tok)
    g1 = m.decode_greedy(states["greedy"], t0, n1)
    g2 = m.decode_greedy(states["greedy"], int(g1[-1]), n2)
    assert g1.dtype == np.int32 and g1.shape == (n1,) and g2.shape == (n2,)
    greedy = g1.tolist() + g2.tolist()
    assert token == host, f"{kind}: readback=token picked {token}, the host's argmax {host}"
    assert greedy == host, f"{kind}: decode_greedy picked {greedy}, the host's argmax {host}"
    # the arena's pos after decode_greedy: advanced on the device by each step's argmax
    assert int(m._step.stages[-1].v["pos"].get()[0]) == pos0 + n1 + n2
    for a in ("token", "greedy"):
        assert states[a].pos == pos0 + n1 + n2, (a, states[a].pos)
        diff = snapshot_diff(states["host"].snapshot(), states[a].snapshot())
        assert not diff, f"{kind}: caches of {a} differ from host's: {diff}"
    nxt = {a: m.decode_step(states[a], host[-1]) for a in ("host", "greedy")}
    assert np.array_equal(nxt["greedy"].view(np.uint32), nxt["host"].view(np.uint32)), \
        f"{kind}: the step after decode_greedy differs from the host-fed one's"


def test_greedy_refusals_leave_the_state():
    m, states, ids, prompt = _models("tiny")
    st = states["greedy"]
    pos0 = st.pos
    snap = st.snapshot()
    V = m.config.vocab_size
    for bad_n, msg in ((0, "n must be an integer >= 1"), (True, "n must be an integer >= 1"),
                       (2.0, "n must be an integer >= 1"),
                       (st.max_seq_len - pos0 + 1, "exceed max_seq_len")):
        with pytest.raises(ValueError, match=msg):
            m.decode_greedy(st, int(ids[prompt]), bad_n)
    for bad_tok in (-1, V, 2 ** 40):
        with pytest.raises(ValueError):
            m.decode_greedy(st, bad_tok, 2)
    with pytest.raises(ValueError, match="readback"):
        m.decode_step(st, int(ids[prompt]), readback="argmax")
    assert st.pos == pos0
    assert not snapshot_diff(snap, st.snapshot())


def test_greedy_two_stages_agree():
    """Two stages (tiny over GPUs 0 and 1): decode_greedy's per-step token copy from the last
    stage and position uploads against host-fed steps on the same model."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    from test_decode_gpu import _ids, _model
    ck, m = _model("tiny", (0, 1), "device")
    ids = _ids(ck.config, 6, seed=33)
    st = {a: m.prefill(ids[:5], m.new_state())[1] for a in ("host", "greedy")}
    host, tok = [], int(ids[5])
    for _ in range(9):
        tok = greedy_token(m.decode_step(st["host"], tok))
        host.append(tok)
    greedy = m.decode_greedy(st["greedy"], int(ids[5]), 9).tolist()
    assert greedy == host
    diff = snapshot_diff(st["host"].snapshot(), st["greedy"].snapshot())
    assert not diff, f"two stages: caches of greedy differ from host's: {diff}"


def test_greedy_allocates_nothing():
    """After a first call (graphs captured), decode_greedy requests no device memory from CuPy's
    pools and no pinned host memory."""
    from memra_dsv4.gpu.arena import count_allocations
    m, states, ids, prompt = _models("tiny")
    st = states["greedy"]
    tok = int(m.decode_greedy(st, int(ids[prompt]), 2)[-1])
    pool = cp.get_default_pinned_memory_pool()
    pinned = []

    def counting_pinned(size):
        pinned.append(int(size))
        return pool.malloc(size)
    cp.cuda.set_pinned_memory_allocator(counting_pinned)
    try:
        with count_allocations() as c:
            for n in (3, 4):
                tok = int(m.decode_greedy(st, tok, n)[-1])
    finally:
        cp.cuda.set_pinned_memory_allocator(pool.malloc)
    assert c.total == 0, f"{c} device allocations in two decode_greedy calls"
    assert not pinned, f"pinned host allocations in two decode_greedy calls: {pinned}"
    assert st.pos == prompt + 2 + 3 + 4


def test_generate_is_prefill_then_device_greedy():
    m, states, ids, prompt = _models("tiny")
    assert m.decode_path == "device"
    p = [int(t) for t in ids[:prompt]]
    logits, st = m.prefill(p)
    ref = [greedy_token(logits)]
    for _ in range(6):
        ref.append(greedy_token(m.decode_step(st, ref[-1])))
    assert m.generate(p, 7) == ref
    assert m.generate(p, 1) == ref[:1]
    assert m.generate(p, 0) == []
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        m.generate(p, m.max_seq_len - prompt + 2)
    with pytest.raises(ValueError, match="non-negative integer"):
        m.generate(p, True)


def test_decode_step_out_array_same_bits():
    """decode_step(out=buf) on the device path: the logits land in buf (returned as buf), bit for
    bit those of decode_step without it, over several steps from one prefill."""
    m, states, ids, prompt = _models("tiny")
    V = m.config.vocab_size
    buf = np.full(V, np.nan, np.float32)
    tok_a = tok_b = int(ids[prompt])
    for i in range(4):
        a = m.decode_step(states["host"], tok_a)
        b = m.decode_step(states["token"], tok_b, out=buf)
        assert b is buf
        assert np.array_equal(a.view(np.uint32), buf.view(np.uint32)), f"step {i}"
        tok_a = tok_b = greedy_token(a)
    with pytest.raises(ValueError, match="float32"):
        m.decode_step(states["token"], tok_b, out=np.zeros(V, np.float64))
