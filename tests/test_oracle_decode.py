"""The oracle's decode state machine: decode == re-prefill, chunked prefill == prefill, the cache
layout, the reset hazard, and refused calls (state unchanged).

Consistency contract (dsv4_attention.md 7.4).  For each prompt length L, prefill_state(L) then D
decode steps; the logits of every decode step at position t must equal a re-prefill of the
whole sequence 0..t at its last position:
* ``bf16`` / ``reference``: bit-equal (every op accumulates in float64 and rounds once, and every
  path gathers the same candidates in the same canonical order), so top-1 equality holds too;
* ``exact``: rel <= 1e-12 (max |a - b| / max |b|): float64 BLAS blocking depends on the number
  of rows, so M=1 and M=L products differ in the last float64 bits (~1e-15).

Sampling of steps (the O(n^2) cost of re-prefilling at every step is avoided):
* EVERY decode step is compared with the matching row of ONE all-positions prefill of the whole
  token stream (``Oracle.prefill(all_logits=True)``): row t of a causal prefill is the re-prefill
  of 0..t at its last position; ``test_all_rows_prefill_is_reprefill`` checks that premise
  literally (bit-equal in bf16) at boundary positions.
* A LITERAL re-prefill ``Oracle.prefill(tokens[:t+1])`` is also compared at the steps whose
  position t is a boundary of dsv4_attention.md section 10 for the preset (CSA emits t%4 == 3
  and the first overlapped entry, window wrap, HCA emits, indexer drop start, Flash's
  127/128/129/255/256), plus the first and last step and every 100th.
* Decode horizons: tiny runs 300 steps after L = 1 and L = 300 and 24 steps after every other L
  (enough to cross the next CSA emit, window wrap and, from L <= 15, the first HCA emit);
  small runs 72 steps after L = 1 and 8 after the others; the long lengths (>= 127) run on
  tiny only.  The whole file runs in about two minutes on 2 cores.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.oracle import DecodeState, Oracle, ops
from memra_dsv4.synth import synth_arrays

N_TOKENS = {"tiny": 600, "small": 80}
EXACT_REL = 1e-12


@functools.lru_cache(maxsize=None)
def _ckpt(name: str):
    cfg = preset(name)
    return Checkpoint.from_arrays(cfg, synth_arrays(cfg, 0))


@functools.lru_cache(maxsize=None)
def oracle(name: str, numerics: str) -> Oracle:
    return Oracle(_ckpt(name), numerics)


@functools.lru_cache(maxsize=None)
def tokens(name: str) -> np.ndarray:
    cfg = preset(name)
    return np.random.default_rng(1234).integers(0, cfg.vocab_size, N_TOKENS[name])


@functools.lru_cache(maxsize=None)
def ref_rows(name: str, numerics: str) -> np.ndarray:
    """Logits of every position of one prefill of the whole token stream."""
    return oracle(name, numerics).prefill(tokens(name), all_logits=True).logits


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same(got, want, numerics: str, what: str) -> None:
    if numerics == "exact":
        r = rel(got, want)
        assert r <= EXACT_REL, f"{what}: rel {r:.3g} > {EXACT_REL}"
    else:
        assert got.dtype == want.dtype and got.shape == want.shape, what
        if not np.array_equal(got, want):
            bad = int((got != want).sum())
            pytest.fail(f"{what}: not bit-equal ({bad} of {got.size} differ, rel {rel(got, want):.3g}, "
                        f"top-1 {np.argmax(got, -1)} vs {np.argmax(want, -1)})")


def assert_states_same(a: DecodeState, b: DecodeState, numerics: str) -> None:
    if numerics != "exact":
        assert a.diff(b) == []
        return
    sa, sb = a.snapshot(), b.snapshot()
    assert set(sa) == set(sb)
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.shape == y.shape, k
        if x.size:
            assert np.array_equal(np.isinf(x), np.isinf(y)), k
            fin = np.isfinite(y)
            assert np.allclose(x[fin], y[fin], rtol=1e-12, atol=1e-14), k


def boundaries(cfg) -> set[int]:
    """Positions t of dsv4_attention.md section 10 for this preset."""
    W = cfg.sliding_window
    hca = sorted({r for r in cfg.compress_ratios if r > 4})
    b = {0, 1, 2, 3, 4, 7, W - 1, W, W + 1, 2 * W, 127, 128, 129, 255, 256, 300}
    for r in hca:
        b |= {r - 1, r, 2 * r - 1}
    b |= {4 * (cfg.index_topk + 1) - 1}                  # the indexer starts to drop blocks
    return b


def check_decode(name: str, numerics: str, L: int, D: int) -> None:
    o = oracle(name, numerics)
    cfg = o.config
    ids = tokens(name)
    ref = ref_rows(name, numerics)
    out = o.prefill_state(ids[:L])
    assert_same(out.logits, ref[L - 1], numerics, f"prefill_state({L})")
    st_ = out.state
    assert st_.pos == L
    literal = {L, L + D - 1} | {t for t in boundaries(cfg) if L <= t < L + D} \
        | {t for t in range(L, L + D) if (t - L) % 100 == 0}
    for t in range(L, L + D):
        lg = o.decode_step(st_, ids[t])
        assert_same(lg, ref[t], numerics, f"decode after prefill({L}) at t={t} vs all-rows prefill")
        if t in literal:
            lit = o.prefill(ids[:t + 1]).logits
            assert_same(lg, lit, numerics, f"decode after prefill({L}) at t={t} vs re-prefill")
    assert st_.pos == L + D


TINY_CASES = [
    (1, "single_token_prompt", 300), (2, "two_tokens", 24), (3, "before_first_csa_emit", 24),
    (4, "first_csa_emit", 24), (5, "after_first_csa_emit", 24),
    (7, "first_overlapped_csa_entry", 24), (8, "window_wrap", 24), (9, "after_window_wrap", 24),
    (12, "indexer_drops_blocks", 24), (15, "before_first_hca_emit", 24),
    (16, "first_hca_emit", 24), (17, "after_first_hca_emit", 24),
    (127, "flash_before_window_wrap", 24), (128, "flash_window_wrap_first_hca_emit", 24),
    (129, "flash_after_window_wrap", 24), (255, "flash_before_second_hca_emit", 24),
    (256, "flash_second_hca_emit", 24), (300, "long_prompt", 300),
]
SMALL_CASES = [
    (1, "single_token_prompt", 72), (2, "two_tokens", 8), (3, "before_first_csa_emit", 8),
    (4, "first_csa_emit", 8), (5, "after_first_csa_emit", 8),
    (7, "first_overlapped_csa_entry", 8), (8, "second_csa_emit", 8), (9, "after_csa_emit", 8),
    (15, "csa_emit_3", 8), (16, "csa_emit_3_done", 8), (17, "after_csa_emit_3", 8),
    (31, "before_window_wrap_first_hca_emit", 8), (32, "window_wrap_first_hca_emit", 8),
    (33, "after_window_wrap", 8), (36, "indexer_drops_blocks", 8),
]


def _cases(preset_name, cases):
    return [pytest.param(preset_name, L, D, id=f"{preset_name}-L{L}-{label}")
            for L, label, D in cases]


@pytest.mark.parametrize("numerics", ["bf16", "exact"])
@pytest.mark.parametrize("name,L,D", _cases("tiny", TINY_CASES) + _cases("small", SMALL_CASES))
def test_decode_after_prefill(name, L, D, numerics):
    check_decode(name, numerics, L, D)


# Named aliases of the boundary cases the issue lists (same check, tiny, bf16).
def test_decode_after_prefill_L4_first_csa_emit():
    check_decode("tiny", "bf16", 4, 5)


def test_decode_after_prefill_L8_window_wrap():
    check_decode("tiny", "bf16", 8, 3)


def test_decode_after_prefill_L16_first_hca_emit():
    check_decode("tiny", "bf16", 16, 3)


def test_decode_after_prefill_L12_indexer_drops_blocks():
    check_decode("tiny", "bf16", 12, 3)


def test_decode_after_prefill_reference_class_bit_equal():
    check_decode("tiny", "reference", 5, 20)


@pytest.mark.parametrize("numerics", ["bf16", "exact"])
def test_all_rows_prefill_is_reprefill(numerics):
    """The premise of comparing against one all-positions prefill."""
    o = oracle("tiny", numerics)
    ids = tokens("tiny")
    ref = ref_rows("tiny", numerics)
    for t in (0, 3, 7, 8, 15, 16, 128, 300):
        assert_same(o.prefill(ids[:t + 1]).logits, ref[t], numerics, f"t={t}")


# --------------------------------------------------------------------------- chunking
def check_chunks(name: str, numerics: str, sizes: list[int]) -> None:
    o = oracle(name, numerics)
    ids = tokens(name)
    ref = ref_rows(name, numerics)
    n = sum(sizes)
    st_ = o.new_state()
    p = 0
    for s in sizes:
        lg = o.prefill_chunk(st_, ids[p:p + s], all_logits=True)
        assert lg.shape == (s, o.config.vocab_size)
        assert_same(lg, ref[p:p + s], numerics, f"chunks {sizes}: chunk at {p}..{p + s - 1}")
        p += s
    whole = o.prefill_state(ids[:n]).state
    assert_states_same(st_, whole, numerics)


@pytest.mark.parametrize("numerics", ["bf16", "exact"])
@pytest.mark.parametrize("sizes", [
    [1] * 20,
    [3, 1, 4, 1, 5, 9, 2, 6],                           # chunks straddling emits / the wrap
    [4, 4, 8, 16, 1],                                   # block-aligned chunks
    [7, 13, 1, 17],                                     # chunks longer than the window (8)
    [127, 1, 1, 127, 44],                               # Flash's 127/128/129 boundary, S > W
])
def test_chunked_prefill_tiny(sizes, numerics):
    check_chunks("tiny", numerics, sizes)


@pytest.mark.parametrize("numerics", ["bf16", "exact"])
@pytest.mark.parametrize("sizes", [[31, 1, 4, 36], [5, 33, 2, 1, 30], [72]])
def test_chunked_prefill_small(sizes, numerics):
    check_chunks("small", numerics, sizes)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_chunked_prefill_any_split(sizes):
    """Any split of the same tokens gives the same logits and the same state (tiny, bf16)."""
    check_chunks("tiny", "bf16", sizes)


def test_mixed_chunks_and_decode_steps():
    o = oracle("tiny", "bf16")
    ids, ref = tokens("tiny"), ref_rows("tiny", "bf16")
    st_ = o.prefill_state(ids[:3]).state
    p = 3
    for s in (1, 5, 1, 1, 9, 1, 14):
        if s == 1:
            assert_same(o.decode_step(st_, ids[p]), ref[p], "bf16", f"step {p}")
        else:
            assert_same(o.prefill_chunk(st_, ids[p:p + s]), ref[p + s - 1], "bf16", f"chunk {p}")
        p += s
    assert st_.diff(o.prefill_state(ids[:p]).state) == []


# ----------------------------------------------------------------------- cache layout
@pytest.mark.parametrize("L", [3, 6, 16, 21])
def test_caches_hold_what_prefill_computes(L):
    """Ring = the last W window vectors at slot t % W, compressed rows / indexer keys = the
    prefill's entries, pending rows in the canonical layout (state.py doc), bit-equal."""
    o = oracle("tiny", "bf16")
    cfg = o.config
    ids = tokens("tiny")[:L]
    cap = o.prefill(ids, capture=True).captures
    st_ = o.prefill_state(ids).state
    W = cfg.sliding_window
    for lid, c in enumerate(st_.layers):
        kv = cap[lid]["attn.kv"]
        for t in range(max(0, L - W), L):
            assert np.array_equal(c.ring[t % W], kv[t]), (lid, t)
        r = c.ratio
        if not r:
            assert c.comp is None and c.idx_keys is None
            continue
        comp = c.comp.view()
        assert comp.shape[0] == L // r
        if L // r:
            assert np.array_equal(comp, cap[lid]["attn.comp"])
        # pending rows from the compressor projections of the attention input
        layer = o.layers[lid]
        x = cap[lid]["attn_norm"]
        for sub, cs, rr in (("attn.compressor", c.comp_state, r),
                            ("attn.indexer.compressor", c.idx_state, 4)):
            if cs is None:
                continue
            a, z = ops.compressor_project(x, layer.w(f"{sub}.wkv.weight"),
                                          layer.w(f"{sub}.wgate.weight"), layer.w(f"{sub}.ape"),
                                          np.arange(L), pol=o.pol)
            rem, b0 = L % rr, L - L % rr
            off = rr if cs.overlap else 0
            assert np.array_equal(cs.kv[off:off + rem], a[b0:L])
            assert np.array_equal(cs.score[off:off + rem], z[b0:L])
            assert (cs.kv[off + rem:off + rr] == 0).all()
            assert np.isneginf(cs.score[off + rem:off + rr]).all()
            if cs.overlap:
                if b0 >= rr:
                    assert np.array_equal(cs.kv[:rr], a[b0 - rr:b0])
                    assert np.array_equal(cs.score[:rr], z[b0 - rr:b0])
                else:
                    assert (cs.kv[:rr] == 0).all() and np.isneginf(cs.score[:rr]).all()
        if c.kind == "csa":
            keys = c.idx_keys.view()
            assert keys.shape[0] == L // 4
            if L // 4:
                assert np.array_equal(keys, cap[lid]["attn.index.keys"])


def test_fresh_state_layout():
    o = oracle("tiny", "bf16")
    s = o.new_state()
    assert s.pos == 0 and s.max_seq_len == 4096 and s.last_hc is None and s.journal is None
    assert [c.kind for c in s.layers] == ["sliding", "csa", "hca", "csa"]
    csa, hca = s.layers[1], s.layers[2]
    assert csa.comp_state.kv.shape == (8, 2 * 128) and np.isneginf(csa.comp_state.score).all()
    assert hca.comp_state.kv.shape == (16, 128) and np.isneginf(hca.comp_state.score).all()
    assert csa.idx_state.kv.shape == (8, 2 * 128)
    assert s.layers[0].comp is None and s.layers[0].comp_state is None


# -------------------------------------------------------------------------- reset hazard
@pytest.mark.parametrize("L2", [1, 2, 3])
def test_new_sequence_on_a_used_state_is_fresh(L2):
    """dsv4_attention.md 7.3: a prefill of L < 4 after another sequence must not see the old
    sequence's pending rows (the reference keeps them).  prefill_state resets first."""
    o = oracle("tiny", "bf16")
    ids = tokens("tiny")
    used = o.prefill_state(ids[100:123]).state            # leaves prev-block rows everywhere
    o.decode_step(used, 7)
    other = np.array(ids[:L2 + 6])
    out_used = o.prefill_state(other[:L2], used)
    out_fresh = o.prefill_state(other[:L2])
    assert out_used.state is used
    assert np.array_equal(out_used.logits, out_fresh.logits)
    assert used.diff(out_fresh.state) == []
    for t in range(L2, L2 + 6):                          # through the first CSA emit at t = 3
        assert np.array_equal(o.decode_step(used, other[t]), o.decode_step(out_fresh.state, other[t]))
    assert used.diff(out_fresh.state) == []


def test_reset_restores_fresh_state():
    o = oracle("tiny", "bf16")
    s = o.prefill_state(tokens("tiny")[:30]).state
    s.reset()
    assert s.diff(o.new_state()) == []


# -------------------------------------------------------------------------- bad input
def _refused(state: DecodeState, fn, match: str) -> None:
    before = state.copy()
    with pytest.raises(ValueError, match=match):
        fn()
    assert state.diff(before) == [], "a refused call changed the state"


def test_bad_input_is_refused_and_state_unchanged():
    o = oracle("tiny", "bf16")
    V = o.config.vocab_size
    s = o.new_state(max_seq_len=12)
    o.prefill_state(tokens("tiny")[:9], s)
    _refused(s, lambda: o.decode_step(s, V), "outside the vocabulary")
    _refused(s, lambda: o.decode_step(s, -1), "outside the vocabulary")
    _refused(s, lambda: o.decode_step(s, [1, 2]), "one integer id")
    _refused(s, lambda: o.decode_step(s, 1.5), "integers")
    _refused(s, lambda: o.decode_step(s, True), "booleans")
    _refused(s, lambda: o.prefill_chunk(s, [1, 2, V + 3]), r"tokens\[2\]")
    _refused(s, lambda: o.prefill_chunk(s, []), "empty")
    _refused(s, lambda: o.prefill_chunk(s, [[1, 2]]), "1-D")
    _refused(s, lambda: o.prefill_chunk(s, [1, 2, 3, 4]), "exceed max_seq_len 12")
    _refused(s, lambda: o.prefill_state(np.arange(13), s), "exceeds max_seq_len 12")
    _refused(s, lambda: o.prefill_state([V], s), "outside the vocabulary")
    o.prefill_chunk(s, [1, 2, 3])                          # exactly fills 12 positions
    assert s.pos == 12
    _refused(s, lambda: o.decode_step(s, 1), "exceed max_seq_len 12")
    other = oracle("tiny", "exact")
    _refused(s, lambda: other.decode_step(s, 1), "numerics 'bf16'")
    small = oracle("small", "bf16")
    _refused(s, lambda: small.decode_step(s, 1), "config 'tiny'")
    with pytest.raises(ValueError, match="DecodeState"):
        o.decode_step(object(), 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        o.new_state(max_seq_len=0)
