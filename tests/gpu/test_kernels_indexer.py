"""kernels_cu/indexer.cu against oracle.ops.indexer_scores / indexer_topk.

Scores: the kernel's per-(h, k) dot is an f32 FMA chain rounded once to bf16, the twin's a
correctly rounded float64 sum; they differ when the f32 sum lands on the other side of a bf16
rounding boundary (~1e-4 of the dots).  One head's term then moves by <= 2 bf16 ulp of itself, so
|got - want| <= ulp(want) + 2^-6 * sum_h |term_h|, and at least SCORE_MIN_EXACT of the scores
are bit-identical.  Columns at or beyond n_valid[t] are -inf.
Top-k: exact (same input scores): indices, order, -1 padding, ties to the lower index.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import indexer as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_within, bf16, bits_of, describe, fresh_seed, rand_bf16, rng_for, ulp_bf16  # noqa: E402
from memra_dsv4.host.indices import candidate_matrix  # noqa: E402
from memra_dsv4.host.quant import fp4_sim  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

SCORE_MIN_EXACT = 0.97
SCORE_TERM_REL = 2.0 ** -6


def _fp4ish(rng, shape):
    """Data like the real indexer operands: Hadamard-rotated, FP4-simulated bf16."""
    return fp4_sim(O.hadamard(rand_bf16(rng, shape, 1.0)), 32)


@pytest.mark.parametrize("T,H,N", [(3, 64, 2048), (1, 64, 16384), (5, 4, 37), (4, 8, 300), (2, 64, 1000)])
@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_scores(T, H, N, impl):
    seed = fresh_seed()
    rng = rng_for(seed)
    q = _fp4ish(rng, (T, H, 128))
    keys = _fp4ish(rng, (N, 128))
    w = bf16(rng.standard_normal((T, H)).astype(np.float32) * np.float32(128 ** -0.5 * H ** -0.5))
    n_valid = rng.integers(0, N + 1, T).astype(np.int32)
    n_valid[0] = N
    got = K.scores(cp.asarray(bits_of(q)), cp.asarray(bits_of(w)), cp.asarray(bits_of(keys)),
                   cp.asarray(n_valid), impl=impl).get()
    gotf = (got.astype(np.uint32) << 16).view(np.float32)
    want = O.indexer_scores(q, w, keys)
    # bound from the twin's own per-head terms
    s = O.BF16.store(np.einsum("thd,nd->thn", q.astype(np.float64), keys.astype(np.float64)))
    terms = np.abs(O.BF16.store(np.maximum(s, 0) * w[:, :, None])).astype(np.float64).sum(axis=1)
    mask = np.arange(N)[None, :] < n_valid[:, None]
    bound = ulp_bf16(want) + SCORE_TERM_REL * terms
    assert_within(np.where(mask, gotf, 0), np.where(mask, want, 0), np.where(mask, bound, 0),
                  "indexer scores", seed, T=T, H=H, N=N, impl=impl)
    exact = (got == bits_of(want)) | ~mask
    frac = exact[mask].mean() if mask.any() else 1.0
    assert frac >= SCORE_MIN_EXACT, f"indexer scores: only {frac:.4f} bit-identical {describe(seed, T=T, H=H, N=N)}"
    assert np.all(got[~mask] == 0xFF80), f"indexer scores: non-causal columns not -inf {describe(seed)}"


def _topk_case(rng, T, N, kind):
    if kind == "ties":      # few distinct values: the tie-break decides almost everything
        vals = bf16(rng.integers(-3, 4, (T, N)).astype(np.float32) * np.float32(0.5))
    elif kind == "zeros":   # +0 / -0 ties
        vals = np.where(rng.random((T, N)) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
        vals[:, ::7] = bf16(rng.standard_normal((T, len(range(0, N, 7)))).astype(np.float32))
    else:
        vals = rand_bf16(rng, (T, N), 1.0, spread=8)
        vals[:, rng.integers(0, N, 5)] = -np.inf
    return vals


@pytest.mark.parametrize("T,N,k,kind", [(2, 16384, 512, "rand"), (3, 16384, 512, "ties"), (4, 2000, 512, "rand"),
                                        (5, 300, 8, "ties"), (6, 37, 2, "zeros"), (3, 5000, 1024, "ties"),
                                        (2, 700, 512, "zeros")])
@pytest.mark.parametrize("order", ["score", "index"])
def test_topk(T, N, k, kind, order):
    seed = fresh_seed()
    rng = rng_for(seed)
    vals = _topk_case(rng, T, N, kind)
    n_valid = rng.integers(0, N + 1, T).astype(np.int32)
    n_valid[0] = N
    if T > 2:
        n_valid[1] = min(N, k // 2)   # fewer valid than k: -1 padding
        n_valid[2] = 0
    offset = int(rng.integers(0, 1000))
    got = K.topk(cp.asarray(bits_of(vals)), cp.asarray(n_valid), k, offset=offset, order=order).get()
    sel = O.indexer_topk(vals, n_valid, k)
    if order == "score":
        want = np.where(sel >= 0, sel + offset, -1)
    else:
        want = candidate_matrix(np.zeros((T, 0), np.int32), sel, offset)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        t, j = bad[0]
        raise AssertionError(f"indexer topk ({order}): {len(bad)} entries differ, first at token {t} col {j}: "
                             f"got {got[t, max(0, j - 3):j + 4]} want {want[t, max(0, j - 3):j + 4]} "
                             f"(n_valid {n_valid[t]}) {describe(seed, T=T, N=N, k=k, kind=kind)}")


def test_topk_on_gpu_scores_matches_twin_selection():
    """The pipeline of decode: GPU scores -> GPU top-k == twin top-k of those same scores."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, N, k = 2, 64, 4096, 512
    q = _fp4ish(rng, (T, H, 128))
    keys = _fp4ish(rng, (N, 128))
    w = bf16(rng.standard_normal((T, H)).astype(np.float32) * np.float32(1 / 64))
    n_valid = np.array([N, 1500], np.int32)
    sg = K.scores(cp.asarray(bits_of(q)), cp.asarray(bits_of(w)), cp.asarray(bits_of(keys)), cp.asarray(n_valid))
    got = K.topk(sg, cp.asarray(n_valid), k).get()
    s = (sg.get().astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got, O.indexer_topk(s, n_valid, k)), f"topk of GPU scores {describe(seed)}"


@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_scores_token_alone_equals_batch(impl):
    """A token's scores do not depend on the other tokens of the launch (decode == prefill)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, N = 4, 64, 3000
    q = cp.asarray(bits_of(_fp4ish(rng, (T, H, 128))))
    keys = cp.asarray(bits_of(_fp4ish(rng, (N, 128))))
    w = cp.asarray(bits_of(bf16(rng.standard_normal((T, H)).astype(np.float32) / 64)))
    nv = cp.asarray(np.array([N, 17, 2999, 1024], np.int32))
    allrows = K.scores(q, w, keys, nv, impl=impl)
    for t in range(T):
        one = K.scores(q[t:t + 1].copy(), w[t:t + 1].copy(), keys, nv[t:t + 1].copy(), impl=impl)
        assert cp.array_equal(one[0], allrows[t]), f"indexer scores ({impl}) token {t} alone != batch {describe(seed)}"


def test_scores_scale_raw_weights_in_kernel():
    """w_scale: the kernel stores bf16(w * c) itself (oracle.ops.indexer_weights' last step)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, H, N = 3, 64, 500
    c = 128 ** -0.5 * 64 ** -0.5
    q = _fp4ish(rng, (T, H, 128))
    keys = _fp4ish(rng, (N, 128))
    raw = bf16(rng.standard_normal((T, H)).astype(np.float32))
    scaled = O.BF16.store(raw * raw.dtype.type(c))
    nv = cp.asarray(np.full(T, N, np.int32))
    qg, kg = cp.asarray(bits_of(q)), cp.asarray(bits_of(keys))
    a = K.scores(qg, cp.asarray(bits_of(raw)), kg, nv, w_scale=c)
    b = K.scores(qg, cp.asarray(bits_of(scaled)), kg, nv)
    assert cp.array_equal(a, b), f"indexer scores with w_scale != pre-scaled weights {describe(seed)}"


# ------------------------------------------------------------- indexer_fused_d128 (T = 1, decode)
def _fused_inputs(rng, H, N, kind):
    """q, w, keys of one token.  'rand': real-like operands; 'dup': keys drawn from 37 distinct
    rows (exact score ties everywhere, the threshold is a tie); 'zero': half the head weights
    zero and the rest negative, so most scores are +0 or -0 (ties of +0 / -0)."""
    q = _fp4ish(rng, (1, H, 128))
    if kind == "dup":
        pool = _fp4ish(rng, (37, 128))
        keys = pool[rng.integers(0, 37, N)]
    else:
        keys = _fp4ish(rng, (N, 128))
    w = bf16(rng.standard_normal((1, H)).astype(np.float32) * np.float32(128 ** -0.5 * H ** -0.5))
    if kind == "zero":
        w = np.where(rng.random((1, H)) < 0.5, np.float32(0.0), -np.abs(w)).astype(np.float32)
        w[0, :4] = bf16(np.abs(w[0, :4]) + np.float32(2.0 ** -8))  # a few positive terms: some scores > 0
    return cp.asarray(bits_of(q)), cp.asarray(bits_of(w)), cp.asarray(bits_of(keys))


def _unfused_index_topk(qg, wg, kg, nv, k, width, offset, w_scale):
    sc = K.scores(qg, wg, kg, nv, w_scale=w_scale)
    sel = K.topk(sc, nv, k, offset=offset, order="index", width=width)
    return sc, sel


def _check_fused(qg, wg, kg, nvg, k, width, offset, w_scale, seed, form="fused", **ctx):
    N = kg.shape[0]
    sc = cp.full((1, N), 0x1234, np.uint16)
    sel = cp.full((1, width), -7, np.int32)
    K.scores_topk(qg, wg, kg, nvg, k, sc, sel, offset=offset, w_scale=w_scale, form=form)
    ctx["form"] = form
    want_sc, want_sel = _unfused_index_topk(qg, wg, kg, nvg, k, width, offset, w_scale)
    got_sc, got_sel = sc.get(), sel.get()
    want_sc, want_sel = want_sc.get(), want_sel.get()
    bad = np.flatnonzero(got_sc != want_sc)
    assert bad.size == 0, (f"indexer fused scores: {bad.size} columns differ from indexer_scores_d128, first "
                           f"{bad[:5]} {describe(seed, **ctx)}")
    if not np.array_equal(got_sel, want_sel):
        j = int(np.flatnonzero(got_sel != want_sel)[0])
        raise AssertionError(f"indexer fused top-k != indexer_topk(order='index'): first at col {j}: got "
                             f"{got_sel[0, max(0, j - 3):j + 4]} want {want_sel[0, max(0, j - 3):j + 4]} "
                             f"{describe(seed, **ctx)}")
    # and the twin's selection of those same scores, canonical (ascending) order
    nv = int(nvg.get()[0])
    if width == min(k, N):
        s = (got_sc.astype(np.uint32) << 16).view(np.float32)
        twin = candidate_matrix(np.zeros((1, 0), np.int32), O.indexer_topk(s, np.array([nv]), k), offset)
        assert np.array_equal(got_sel, twin), f"indexer fused top-k != twin {describe(seed, **ctx)}"
    assert int(K.workspace().get()[0]) == 0, f"indexer fused: ticket counter not reset {describe(seed, **ctx)}"


@pytest.mark.parametrize("N,k", [(1024, 512), (8192, 512), (2055, 512), (300, 8), (5000, 1024), (24000, 512)])
@pytest.mark.parametrize("kind", ["rand", "dup", "zero"])
@pytest.mark.parametrize("form", ["fused", "split"])
def test_scores_topk_fused_bitwise(N, k, kind, form):
    """indexer_fused_d128 == indexer_scores_d128 + indexer_topk(order='index') byte for byte (score
    row incl. the -inf tail, selection incl. -1 padding and offset) for n_valid across the
    short-circuit boundary (0, 1, k - 1, k, k + 1, N, random), N not a multiple of 16, and
    24000 > IF_KEYS_CAP (the L2 fallback of the top-k); and == the twin's selection."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H = 64
    qg, wg, kg = _fused_inputs(rng, H, N, kind)
    width = min(k, N)
    offset = int(rng.integers(0, 1000))
    for nv in sorted({0, 1, k - 1, k, k + 1, N, int(rng.integers(0, N + 1))}):
        nv = min(max(nv, 0), N)
        _check_fused(qg, wg, kg, cp.asarray(np.array([nv], np.int32)), k, width, offset, 128 ** -0.5 * H ** -0.5,
                     seed, form=form, N=N, topk=k, kind=kind, nv=nv)


@pytest.mark.parametrize("H", [4, 8, 32])
def test_scores_topk_fused_small_heads(H):
    seed = fresh_seed()
    rng = rng_for(seed)
    N, k = 700, 64
    qg, wg, kg = _fused_inputs(rng, H, N, "rand")
    for nv in (50, 64, 65, 700):
        _check_fused(qg, wg, kg, cp.asarray(np.array([nv], np.int32)), k, k, 3, 1.0, seed, H=H, nv=nv)


def _graph_replays_match(qg, wg, kg, k, nvs, want, what, seed, form=None):
    """scores_topk(form) captured once into a graph on a side stream; n_valid changes on the device
    between replays (as pos does in decode), through nvs (the first also the capture's): every
    replay's score row and selection == want(nvg), a (scores, selection) pair of device arrays."""
    from memra_dsv4.gpu import graphs
    N = kg.shape[0]
    nvg = cp.asarray(np.array([nvs[0]], np.int32))
    sc = cp.empty((1, N), np.uint16)
    sel = cp.empty((1, k), np.int32)
    s = cp.cuda.Stream(non_blocking=True)

    def launch():
        K.scores_topk(qg, wg, kg, nvg, k, sc, sel, offset=128, w_scale=1 / 64, form=form)

    with s:
        launch()
    s.synchronize()
    g = graphs.capture(s, launch)
    for nv in nvs:
        nvg.fill(nv)
        want_sc, want_sel = want(nvg)
        cp.cuda.get_current_stream().synchronize()
        sc.fill(0)
        sel.fill(-7)
        cp.cuda.get_current_stream().synchronize()
        graphs.replay(g, s)
        s.synchronize()
        assert cp.array_equal(sc, want_sc), f"indexer {what} (graph) scores, n_valid {nv} {describe(seed)}"
        assert cp.array_equal(sel, want_sel), f"indexer {what} (graph) top-k, n_valid {nv} {describe(seed)}"


def test_scores_topk_fused_graph_replay_device_n_valid():
    """Captured once; n_valid changes on the device between replays (as pos does in decode), across
    the n <= k short-circuit and the radix path: every replay == the unfused pair, the counter
    ends at 0."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H, N, k = 64, 4096, 512
    qg, wg, kg = _fused_inputs(rng, H, N, "rand")
    K.workspace()
    _graph_replays_match(qg, wg, kg, k, (100, 512, 513, 4096, 3000, 7, 0, 2222),
                         lambda nvg: _unfused_index_topk(qg, wg, kg, nvg, k, k, 128, 1 / 64), "fused", seed,
                         form="fused")
    assert int(K.workspace().get()[0]) == 0


# ------------------------------------- the split form (indexer_scores_tiles_d128 + indexer_select_d128)
@pytest.mark.parametrize("N", [256, 1024, 4100, 8192, 16384, 16385, 32768, 40000])
@pytest.mark.parametrize("kind", ["rand", "dup", "zero"])
def test_scores_topk_split_equals_fused(N, kind):
    """scores_topk(form='split') == scores_topk(form='fused') byte for byte: the score row (incl.
    the -inf tail) and the selection (incl. -1 padding and offset), for n_valid across the n <= k
    short-circuit (1, k - 1, k) and the selection (k + 1, 3000, N, one random); 'dup' makes the
    threshold a big tie; N covers every sel_regs<STEPS> (S = ceil(n / 1024) in 1, 4, 5 .. 8, 16)
    and sel_l2 (n > 16384: 16385, 32768, 40000, every pass from L2).  Also == the unfused pair
    (indexer_scores_d128 + indexer_topk(order='index')), and the split form leaves its histogram
    workspace zero after every call (the n <= k copy path included)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H, k = 64, 512
    qg, wg, kg = _fused_inputs(rng, H, N, kind)
    width = min(k, N) + 3
    offset = int(rng.integers(0, 1000))
    w_scale = 128 ** -0.5 * H ** -0.5
    for nv in sorted({1, k - 1, k, k + 1, 3000, N, int(rng.integers(k + 1, N + 1)) if N > k else N}):
        nv = min(max(nv, 0), N)
        nvg = cp.asarray(np.array([nv], np.int32))
        got = {}
        for form in ("fused", "split"):
            sc = cp.full((1, N), 0x1234, np.uint16)
            sel = cp.full((1, width), -7, np.int32)
            K.scores_topk(qg, wg, kg, nvg, k, sc, sel, offset=offset, w_scale=w_scale, form=form)
            got[form] = (sc.get(), sel.get())
            assert int(cp.count_nonzero(K.hist_workspace())) == 0, (
                f"indexer split: histogram workspace not zero after the call {describe(seed, N=N, kind=kind, nv=nv)}")
        ctx = dict(N=N, kind=kind, nv=nv)
        assert np.array_equal(got["split"][0], got["fused"][0]), f"indexer split scores != fused {describe(seed, **ctx)}"
        if not np.array_equal(got["split"][1], got["fused"][1]):
            j = int(np.flatnonzero(got["split"][1] != got["fused"][1])[0])
            raise AssertionError(f"indexer split top-k != fused: first at col {j}: split "
                                 f"{got['split'][1][0, max(0, j - 3):j + 4]} fused "
                                 f"{got['fused'][1][0, max(0, j - 3):j + 4]} {describe(seed, **ctx)}")
        want_sc, want_sel = _unfused_index_topk(qg, wg, kg, nvg, k, width, offset, w_scale)
        assert np.array_equal(got["split"][0], want_sc.get()), f"indexer split scores != unfused {describe(seed, **ctx)}"
        assert np.array_equal(got["split"][1], want_sel.get()), f"indexer split top-k != unfused {describe(seed, **ctx)}"
    assert int(K.workspace().get()[0]) == 0


def test_scores_topk_split_many_equal_scores():
    """Every key the same row (all scores equal): the top-k is the k lowest indices, in both forms."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H, N, k = 64, 8192, 512
    qg, wg, _ = _fused_inputs(rng, H, 1, "rand")
    kg = cp.asarray(np.repeat(bits_of(_fp4ish(rng, (1, 128))), N, axis=0))
    for nv in (k + 1, 3000, N):
        nvg = cp.asarray(np.array([nv], np.int32))
        out = {}
        for form in ("fused", "split"):
            sc = cp.full((1, N), 0x1234, np.uint16)
            sel = cp.full((1, k), -7, np.int32)
            K.scores_topk(qg, wg, kg, nvg, k, sc, sel, offset=0, w_scale=1 / 64, form=form)
            out[form] = (sc.get(), sel.get())
        assert np.array_equal(out["split"][0], out["fused"][0]), f"split scores, nv {nv} {describe(seed)}"
        assert np.array_equal(out["split"][1], out["fused"][1]), f"split top-k, nv {nv} {describe(seed)}"
        assert np.array_equal(out["split"][1][0], np.arange(k)), f"equal scores: not the k lowest, nv {nv} {describe(seed)}"


def test_scores_topk_split_graph_replay_env(monkeypatch):
    """The env form (MEMRA_DSV4_INDEXER_SELECT=split, as bench.decode_step's idxsel=split arm) in a
    captured graph, n_valid changed on the device between replays: every replay == the fused form."""
    monkeypatch.setenv(K.SELECT_ENV, "split")
    seed = fresh_seed()
    rng = rng_for(seed)
    H, N, k = 64, 8192, 512
    qg, wg, kg = _fused_inputs(rng, H, N, "rand")

    def fused(nvg):
        want_sc = cp.empty((1, N), np.uint16)
        want_sel = cp.empty((1, k), np.int32)
        K.scores_topk(qg, wg, kg, nvg, k, want_sc, want_sel, offset=128, w_scale=1 / 64, form="fused")
        return want_sc, want_sel

    _graph_replays_match(qg, wg, kg, k, (100, 512, 513, 8192, 3000, 7, 0, 2222), fused, "split", seed)

# ------------------------------------- the row form (the device verify's T rows in one launch each)
@pytest.mark.parametrize("N", [256, 1024, 4104])
@pytest.mark.parametrize("form", ["fused", "split"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_scores_topk_rows_equal_row_launches(N, form, T):
    """scores_topk_rows (grid.y = T) == scores_topk per row, byte for byte: each row's score row
    and selection, rows with their own q, w and n_valid (across the n <= k short-circuit and the
    selection), read from a [T, m] step-scalar array's column 0; the per-row workspaces are zero
    after the call."""
    seed = fresh_seed()
    rng = rng_for(seed)
    H, k = 64, 512
    _, _, kg = _fused_inputs(rng, H, N, "rand")
    qs, ws = zip(*[_fused_inputs(rng, H, 8, "dup")[:2] for _ in range(T)])
    q, w = cp.concatenate(qs), cp.concatenate(ws)
    width = min(k, N) + 3
    offset = int(rng.integers(0, 1000))
    w_scale = 128 ** -0.5 * H ** -0.5
    nvs = np.array([min(N, v) for v in rng.choice([1, k - 1, k, k + 1, 3000, N], T)], np.int32)
    aux = cp.asarray(np.stack([nvs, np.full(T, 77, np.int32), np.zeros(T, np.int32)], axis=1))
    sc = cp.full((T, N), 0x1234, np.uint16)
    sel = cp.full((T, width), -7, np.int32)
    K.scores_topk_rows(q, w, kg, aux, k, sc, sel, offset=offset, w_scale=w_scale, form=form)
    for t in range(T):
        sc1 = cp.full((1, N), 0x1234, np.uint16)
        sel1 = cp.full((1, width), -7, np.int32)
        K.scores_topk(q[t:t + 1], w[t:t + 1], kg, aux[t, 0:1], k, sc1, sel1, offset=offset, w_scale=w_scale,
                      form=form)
        ctx = describe(seed, N=N, form=form, T=T, t=t, nv=int(nvs[t]))
        assert np.array_equal(sc[t].get(), sc1[0].get()), f"indexer rows: scores of row {t} differ {ctx}"
        assert np.array_equal(sel[t].get(), sel1[0].get()), f"indexer rows: selection of row {t} differs {ctx}"
    counters, hists = K.rows_workspace()
    assert int(cp.count_nonzero(counters)) == 0 and int(cp.count_nonzero(hists)) == 0, (
        f"indexer rows: workspaces not zero after the call {describe(seed, N=N, form=form, T=T)}")


def test_scores_topk_rows_refusals():
    q, w = cp.zeros((2, 64, 128), cp.uint16), cp.zeros((2, 64), cp.uint16)
    keys, aux = cp.zeros((256, 128), cp.uint16), cp.zeros((2, 3), cp.int32)
    sc, sel = cp.zeros((2, 256), cp.uint16), cp.zeros((2, 256), cp.int32)
    with pytest.raises(AssertionError, match="T <= 8"):
        K.scores_topk_rows(cp.zeros((9, 64, 128), cp.uint16), w, keys, aux, 8, sc, sel)
    with pytest.raises(AssertionError, match="n_valid"):
        K.scores_topk_rows(q, w, keys, cp.zeros(2, cp.int32), 8, sc, sel)
    with pytest.raises(AssertionError, match="scores_out"):
        K.scores_topk_rows(q, w, keys, aux, 8, cp.zeros((2, 255), cp.uint16), sel)
    with pytest.raises(AssertionError, match="rows must be 16-byte aligned"):
        K.scores_topk_rows(q, w, keys[:250], aux, 8, cp.zeros((2, 250), cp.uint16), sel)
