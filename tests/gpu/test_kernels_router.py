"""kernels_cu/router.cu against oracle.ops.router_logits and host.routing.route.

Bounds: logits ROUTER_LOGITS_MAX_ULP f32 ulp (double accumulation: expected identical);
scores SCORES_MAX_ULP and weights WEIGHTS_MAX_ULP f32 ulp (exp/log1p are correctly rounded f32
here, NumPy's f32 functions in the twin); expert ids identical except where the twin's biased
scores of the two candidates are within TIE_ULP f32 ulp (a near tie; exact ties go to the lower
id in both).  Hash routing: ids are tid2eid (int32 here, int64 in the twin), exact.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import router as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_f32, bits_of, describe, fresh_seed, rand_bf16, rng_for, ulp_dist_f32  # noqa: E402
from memra_dsv4.host.routing import route  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

ROUTER_LOGITS_MAX_ULP = 1
SCORES_MAX_ULP = 4
WEIGHTS_MAX_ULP = 16
TIE_ULP = 8


@pytest.mark.parametrize("T,D,E", [(1, 4096, 256), (9, 4096, 256), (5, 256, 8), (3, 512, 16)])
def test_router_logits(T, D, E):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = rand_bf16(rng, (T, D), 1.0)
    w = rand_bf16(rng, (E, D), D ** -0.5)
    got = K.logits(cp.asarray(bits_of(x)), cp.asarray(bits_of(w)))
    assert_f32(got.get(), O.router_logits(x, w), "router logits", seed, max_ulp=ROUTER_LOGITS_MAX_ULP, T=T, D=D, E=E)
    one = K.logits(cp.asarray(bits_of(x[-1:])), cp.asarray(bits_of(w)))
    assert cp.array_equal(one[0], got[-1]), f"router logits: token alone != in batch [seed={seed}]"


def _check_ids(got_idx, want_idx, biased, seed, what, **ctx):
    for t in np.flatnonzero((got_idx != want_idx).any(axis=1)):
        g, w = biased[t, got_idx[t]], biased[t, want_idx[t]]
        d = ulp_dist_f32(g, w)
        assert (d <= TIE_ULP).all(), (
            f"{what}: token {t} picks {got_idx[t]} vs twin {want_idx[t]} (biased {g} vs {w}, "
            f"{d} ulp apart: not a near tie) {describe(seed, **ctx)}")


@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (64, 256, 6), (7, 8, 2), (5, 16, 4), (3, 384, 6)])
def test_router_select_learned(T, E, k):
    seed = fresh_seed()
    rng = rng_for(seed)
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    logits[0, :3] = np.float32([25.0, 19.9, -30.0])              # softplus threshold 20 and tails
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    if T > 1:                                                      # an exact tie -> lower id
        logits[1, 1] = logits[1, 3]
        bias[3] = bias[1]
    scale = 1.5
    widx, wweights, wscores = route(logits, k=k, route_scale=scale, bias=bias)
    idx, weights, scores = K.select(cp.asarray(logits), k, scale, bias=cp.asarray(bias))
    idx, weights, scores = idx.get(), weights.get(), scores.get()
    assert_f32(scores, wscores, "router scores", seed, max_ulp=SCORES_MAX_ULP, T=T, E=E)
    biased = (wscores + bias).astype(np.float32)
    _check_ids(idx, widx, biased, seed, "router ids", T=T, E=E, k=k)
    same = (idx == widx).all(axis=1)
    assert_f32(weights[same], wweights[same], "router weights", seed, max_ulp=WEIGHTS_MAX_ULP, T=T, E=E)


@pytest.mark.parametrize("T,E,k,V", [(8, 256, 6, 129280), (5, 8, 2, 512)])
def test_router_select_hash(T, E, k, V):
    seed = fresh_seed()
    rng = rng_for(seed)
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(min(V, 4096))]).astype(np.int64)
    tid2eid = np.concatenate([tid2eid] * (V // len(tid2eid) + 1))[:V]
    token_ids = rng.integers(0, V, T).astype(np.int64)
    widx, wweights, wscores = route(logits, k=k, route_scale=1.5, tid2eid=tid2eid, token_ids=token_ids)
    idx, weights, scores = K.select(cp.asarray(logits), k, 1.5, tid2eid=cp.asarray(tid2eid.astype(np.int32)),
                                    token_ids=cp.asarray(token_ids.astype(np.int32)))
    assert np.array_equal(idx.get(), widx), f"hash routing ids {describe(seed)}"
    assert_f32(weights.get(), wweights, "hash routing weights", seed, max_ulp=WEIGHTS_MAX_ULP)
    assert_f32(scores.get(), wscores, "hash routing scores", seed, max_ulp=SCORES_MAX_ULP)


# ------------------------------------------------------------------------ router_fused_* (T = 1)
def _fused_case(rng, D, E, k, hash_layer, V=4096):
    """One token with ties built in: experts 1 and 3 share a weight row (equal logits, equal
    scores) and, learned, an equal bias (an exact tie of the biased scores -> lower id), and
    expert 2's row is expert 0's row negated."""
    x = rand_bf16(rng, (1, D), 1.0)
    w = rand_bf16(rng, (E, D), D ** -0.5)
    if E >= 4:
        w[3] = w[1]
        w[2] = -w[0]
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    if E >= 4:
        bias[3] = bias[1]
        bias[1] = bias[3] = np.float32(5.0)  # the tied pair is picked (and its order tested)
    if hash_layer:
        tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(V)]).astype(np.int32)
        how = dict(tid2eid=cp.asarray(tid2eid), token_ids=cp.asarray(rng.integers(0, V, 1).astype(np.int32)))
    else:
        how = dict(bias=cp.asarray(bias))
    return cp.asarray(bits_of(x)), cp.asarray(bits_of(w)), how, (x, w, bias)


def _unfused(xg, wg, k, scale, how):
    lg = K.logits(xg, wg)
    idx, weights, scores = K.select(lg, k, scale, **how)
    return idx, weights, scores, lg


def _assert_same_bits(got, want, seed, **ctx):
    for name, g, w in zip(("idx", "weights", "scores", "logits"), got, want):
        g, w = g.get(), w.get()
        assert g.shape == w.shape and g.dtype == w.dtype, f"router fused {name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        bad = np.flatnonzero(g.view(np.uint32).ravel() != w.view(np.uint32).ravel())
        assert bad.size == 0, (f"router fused {name}: {bad.size} values differ from logits()+select(), first at "
                               f"{bad[:5]}: {g.ravel()[bad[:5]]} vs {w.ravel()[bad[:5]]} {describe(seed, **ctx)}")


@pytest.mark.parametrize("D,E,k", [(4096, 256, 6), (8448, 256, 6), (512, 37, 5), (256, 8, 2), (1024, 384, 8),
                                   (4096, 512, 16)])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_router_fused_bitwise_vs_unfused(D, E, k, hash_layer):
    """router_fused_* == router_logits_bf16 + router_select_* byte for byte (logits, scores, ids,
    weights), three launches in a row (the ticket counter resets itself), and the ids == the
    twin's up to near ties."""
    seed = fresh_seed()
    rng = rng_for(seed)
    scale = 2.5
    for rep in range(3):
        xg, wg, how, (x, w, bias) = _fused_case(rng, D, E, k, hash_layer)
        want = _unfused(xg, wg, k, scale, how)
        got = K.fused(xg, wg, k, scale, **how)
        cp.cuda.get_current_stream().synchronize()
        _assert_same_bits(got, want, seed, D=D, E=E, k=k, hash_layer=hash_layer, rep=rep)
        assert int(K.workspace().get()[0]) == 0, f"router fused: ticket counter not reset {describe(seed)}"
        if not hash_layer:
            lg = O.router_logits(x, w)
            widx, _, wscores = route(lg, k=k, route_scale=scale, bias=bias)
            _check_ids(got[0].get(), widx, (wscores + bias).astype(np.float32), seed, "router fused ids", D=D, E=E)
            if E >= 4:
                ids = got[0].get()[0].tolist()
                assert ids.index(1) < ids.index(3), f"router fused: exact tie not to the lower id {ids} {describe(seed)}"


@pytest.mark.parametrize("D,E,k,T", [(4096, 256, 6, 2), (4096, 256, 6, 8), (512, 37, 5, 5), (4096, 512, 16, 3)])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_router_fused_rows_bitwise(D, E, k, T, hash_layer):
    """T tokens in one router_fused_* launch (grid.y = T: the device verify's rows), each routed
    alone == T one-token launches byte for byte (ids, weights, scores, logits), twice (the T
    tickets reset themselves); the hash form reads row t's token id."""
    seed = fresh_seed()
    rng = rng_for(seed)
    scale = 2.5
    for rep in range(2):
        cases = [_fused_case(rng, D, E, k, hash_layer) for _ in range(T)]
        wg, how0 = cases[0][1], cases[0][2]
        xs = cp.concatenate([c[0] for c in cases])
        if hash_layer:
            how = dict(tid2eid=how0["tid2eid"], token_ids=cp.concatenate([c[2]["token_ids"] for c in cases]))
            one = [K.fused(c[0], wg, k, scale, tid2eid=how0["tid2eid"], token_ids=c[2]["token_ids"])
                   for c in cases]
        else:
            how = dict(bias=how0["bias"])
            one = [K.fused(c[0], wg, k, scale, bias=how0["bias"]) for c in cases]
        got = K.fused(xs, wg, k, scale, handoff="ticket", **how)
        cp.cuda.get_current_stream().synchronize()
        for t in range(T):
            _assert_same_bits([g[t:t + 1] for g in got], one[t], seed, D=D, E=E, k=k, T=T, row=t,
                              hash_layer=hash_layer, rep=rep)
        assert not bool(cp.any(K.workspace())), f"router fused rows: tickets not reset {describe(seed)}"


def test_router_fused_rows_refusals():
    rng = rng_for(2)
    xg, wg, how, _ = _fused_case(rng, 512, 37, 5, False)
    x9 = cp.concatenate([xg] * 9)
    with pytest.raises(AssertionError, match="9 tokens, expected 1..8"):
        K.fused(x9, wg, 5, 1.0, **how)
    with pytest.raises(AssertionError, match="one token .* 'cluster', got T = 2"):
        K.fused(x9[:2], wg, 5, 1.0, handoff="cluster", **how)
    with pytest.raises(AssertionError, match="a ticket per row"):
        K.fused(x9[:3], wg, 5, 1.0, counter=cp.zeros(2, cp.int32), **how)


def _check_graph_replay(hash_layer, launch):
    """``launch(xg, wg, k, scale, how, outs)`` (one fused-router launch into outs = idx, weights,
    scores, logits) run once eagerly, captured once, then replayed on new inputs written into the
    same buffers: each replay equals the unfused pair on those inputs."""
    from memra_dsv4.gpu import graphs
    seed = fresh_seed()
    rng = rng_for(seed)
    D, E, k, scale = 4096, 256, 6, 2.5
    xg, wg, how, _ = _fused_case(rng, D, E, k, hash_layer)
    outs = [cp.empty((1, k), np.int32), cp.empty((1, k), np.float32), cp.empty((1, E), np.float32),
            cp.empty((1, E), np.float32)]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        launch(xg, wg, k, scale, how, outs)
    s.synchronize()
    g = graphs.capture(s, lambda: launch(xg, wg, k, scale, how, outs))
    for rep in range(4):
        x2, w2, how2, _ = _fused_case(rng, D, E, k, hash_layer)
        xg[...] = x2
        wg[...] = w2
        for name, a in how.items():
            a[...] = how2[name]
        want = _unfused(xg, wg, k, scale, how)
        cp.cuda.get_current_stream().synchronize()
        for o in outs:
            o.fill(0)
        cp.cuda.get_current_stream().synchronize()
        graphs.replay(g, s)
        s.synchronize()
        _assert_same_bits(outs, want, seed, hash_layer=hash_layer, rep=rep)


@pytest.mark.parametrize("hash_layer", [False, True])
def test_router_fused_graph_replay(hash_layer):
    """Captured once, replayed on new inputs written into the same buffers: each replay equals the
    unfused pair on those inputs (the counter is left at 0 by every launch, so replays chain)."""
    def launch(xg, wg, k, scale, how, outs):
        K.fused(xg, wg, k, scale, idx=outs[0], weights=outs[1], scores=outs[2], logits=outs[3], **how)
    K.workspace()
    _check_graph_replay(hash_layer, launch)
    assert int(K.workspace().get()[0]) == 0


# ------------------------------------------------------------------------ router_cluster_* (T = 1)
@pytest.mark.parametrize("D,E,k", [(4096, 256, 6), (8448, 256, 6), (512, 37, 5), (256, 8, 2), (1024, 200, 16),
                                   (4096, 128, 8), (4096, 241, 6)])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_router_cluster_bitwise_vs_unfused(D, E, k, hash_layer):
    """router_cluster_* (one cluster of ceil(E / 16) CTAs, the scores handed over in DSMEM) ==
    router_logits_bf16 + router_select_* byte for byte, and == router_fused_* (the ticket form),
    three launches plain and one inside pdl_launches (the PdlKernel launch with both attributes)."""
    from memra_dsv4.gpu import pdl
    seed = fresh_seed()
    rng = rng_for(seed)
    scale = 2.5
    for rep in range(4):
        xg, wg, how, (x, w, bias) = _fused_case(rng, D, E, k, hash_layer)
        want = _unfused(xg, wg, k, scale, how)
        ticket = K.fused(xg, wg, k, scale, **how)
        if rep == 3:
            with pdl.pdl_launches(True):
                got = K.fused(xg, wg, k, scale, handoff="cluster", **how)
        else:
            got = K.fused(xg, wg, k, scale, handoff="cluster", **how)
        cp.cuda.get_current_stream().synchronize()
        _assert_same_bits(got, want, seed, D=D, E=E, k=k, hash_layer=hash_layer, rep=rep, handoff="cluster")
        _assert_same_bits(got, ticket, seed, D=D, E=E, k=k, hash_layer=hash_layer, rep=rep, vs="ticket")
        if not hash_layer and E >= 4:
            ids = got[0].get()[0].tolist()
            assert ids.index(1) < ids.index(3), f"router cluster: exact tie not to the lower id {ids} {describe(seed)}"


@pytest.mark.parametrize("hash_layer", [False, True])
def test_router_cluster_graph_replay(hash_layer):
    """The cluster launch captured (inside pdl_launches, as the device step captures it) and
    replayed on new inputs written into the same buffers: each replay equals the unfused pair."""
    from memra_dsv4.gpu import pdl

    def launch(xg, wg, k, scale, how, outs):
        with pdl.pdl_launches(True):
            K.fused(xg, wg, k, scale, idx=outs[0], weights=outs[1], scores=outs[2], logits=outs[3],
                    handoff="cluster", **how)
    _check_graph_replay(hash_layer, launch)


def test_router_cluster_fits_one_gpc():
    """The 16-CTA cluster of 512 threads (E = 256) can be resident: cuOccupancyMaxActiveClusters
    >= 1 (printed: how many such clusters the GPU holds at once)."""
    from memra_dsv4.gpu.ops._common import kernel
    from memra_dsv4.gpu.ops.testing import max_active_clusters
    kern = kernel(K.STEM, "router_cluster_e256")
    n = max_active_clusters(kern, 16, 512, 2 * 4096)
    regs = kern.attributes["num_regs"] if hasattr(kern, "attributes") else "?"
    print(f"router_cluster_e256: {n} clusters of 16 x 512 threads resident at once (regs {regs})")
    assert n >= 1
