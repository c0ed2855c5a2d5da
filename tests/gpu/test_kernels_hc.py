"""kernels_cu/hc.cu against oracle.ops.hc_pre / hc_post / hc_head and host.hc.hc_split.

Bounds:
* mixes (double accumulation, one f32 rounding): MIXES_MAX_ULP f32 ulp (expected identical);
* pre / post / comb: f32, the twin's op order; exp is a correctly rounded f32 here and NumPy's
  f32 exp elsewhere, so SPLIT_MAX_ULP for pre/post and COMB_MAX_ULP after 20 Sinkhorn rounds;
* y = bf16(sum pre_i X_i) and hc_post: double with the twin's order: bit-identical given the same
  pre (WSUM_MAX_ULP = 0); end to end (GPU pre vs twin pre) HC_Y_MAX_ULP.
Sizes: Flash (D = 4096, fn [24, 16384]) and tiny (D = 256).

hc_boundary (one launch: [hc_post] -> hc_pre -> rmsnorm, decode T = 1) is held BYTE FOR BYTE to
the unfused kernels (hc_post -> hc_mixes (split path) -> hc_pre_finish -> rmsnorm) on fresh random
inputs: new streams, mixes, x, pre, post, comb and xn; at Flash and Pro widths, tiny widths, and
widths whose 256-element mixes segments straddle two streams (D = 192, 128); twice in a row (the
last-CTA counter must be left at zero), in place (post / comb read and rewritten as the device
step does), chained over several boundaries, and replayed from a CUDA graph with new inputs.
Against the twins (oracle hc_post / hc_pre / rmsnorm) it inherits the unfused bounds above.
Every hc_boundary implementation (ops.hc.BOUNDARY_IMPLS: "lastcta", "poll") is held byte for byte
to the default one on fresh inputs (both sub-layer kinds, with and without the hc_post half, in
place and not, a graph replay), and its counters / slots are zero after every launch.
The split boundary (hc_boundary_pre + hc_boundary_sinkhorn, seam MEMRA_DSV4_HC_SPLIT) is held byte
for byte to hc_boundary the same way: one boundary (post / comb untouched by the critical kernel),
a chain of boundaries carrying post / comb in place, and that chain captured with the Sinkhorn on
a forked side stream (with and without PDL) and replayed with new inputs.
The critical launch's cluster form (hc_boundary_pre(handoff="cluster"): hc_boundary_pre_cluster,
one thread-block cluster of D / 256 CTAs, 16 at Flash width) is held byte for byte to hc_boundary
at every cluster size (16, 8, 4, 2, 1 CTAs), to the ticket form and the unfused chain at Flash
width, over a chain of PDL launches, and in the forked graph; widths one cluster does not cover
are refused before any launch.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import decode_bf16  # noqa: E402
from memra_dsv4.gpu.ops import hc as K  # noqa: E402
from memra_dsv4.gpu.ops import rmsnorm as RN  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, assert_f32, bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.host.hc import hc_split  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

MIXES_MAX_ULP = 1
SPLIT_MAX_ULP = 4
COMB_MAX_ULP = 64
WSUM_MAX_ULP = 0
HC_Y_MAX_ULP = 1
HC_Y_MAX_FRAC = 1e-3
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def _params(rng, D, rows):
    fn = (rng.standard_normal((rows, 4 * D)) * (4 * D) ** -0.5).astype(np.float32)
    scale = (rng.random(3 if rows == 24 else 1) * 2 + 0.1).astype(np.float32)
    base = (rng.standard_normal(rows) * 0.5).astype(np.float32)
    return fn, scale, base


@pytest.mark.parametrize("T,D", [(1, 4096), (5, 4096), (33, 256), (4, 4096)])
def test_hc_pre(T, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    X = rand_bf16(rng, (T, 4, D), 1.0, spread=2)
    fn, scale, base = _params(rng, D, 24)
    Xg, fng = cp.asarray(bits_of(X)), cp.asarray(fn)
    mixes = K.hc_mixes(Xg, fng, NORM_EPS)
    _, want_mixes = O._hc_mixes(X, fn, NORM_EPS, O.BF16)
    assert_f32(mixes.get(), want_mixes, "hc mixes", seed, max_ulp=MIXES_MAX_ULP, T=T, D=D)
    # the split on the GPU's own mixes
    y, pre, post, comb = K.hc_pre_finish(mixes, cp.asarray(scale), cp.asarray(base), Xg,
                                         iters=ITERS, hc_eps=HC_EPS)
    m = mixes.get()
    wpre, wpost, wcomb = hc_split(m, scale, base, 4, ITERS, HC_EPS)
    assert_f32(pre.get(), wpre, "hc pre", seed, max_ulp=SPLIT_MAX_ULP, T=T)
    assert_f32(post.get(), wpost, "hc post", seed, max_ulp=SPLIT_MAX_ULP, T=T)
    assert_f32(comb.get(), wcomb, "hc comb (Sinkhorn)", seed, max_ulp=COMB_MAX_ULP, T=T)
    # y given the GPU's pre: bit-identical
    assert_bf16(y.get(), O.BF16.store(O._weighted_streams(X, pre.get())), "hc_pre y | pre", seed,
                max_ulp=WSUM_MAX_ULP, T=T, D=D)
    # end to end
    wy, wpost2, wcomb2 = O.hc_pre(X, fn, scale, base, hc_mult=4, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    # y = sum_i pre_i x_i: where the 4 terms cancel (|y| << sum |pre_i x_i|) the f32 ulps by which
    # the GPU's pre differs from the twin's are large relative to y itself (seen: 8 bf16 ulp at
    # y = 2e-6 from terms ~1), so those elements get an absolute bound on the terms' scale; the
    # others keep the ulp rule.
    yg = decode_bf16(y.get()).astype(np.float64)
    wyv = np.asarray(wy, np.float64)
    mag = np.einsum("ti,tid->td", np.abs(pre.get()).astype(np.float64), np.abs(np.asarray(X, np.float64)))
    cancel = np.abs(wyv) < 2.0 ** -4 * mag
    err = np.abs(yg - wyv)
    abs_bound = 2.0 ** -7 * np.abs(wyv) + 2.0 ** -16 * mag
    assert not (cancel & (err > abs_bound)).any(), (
        f"hc_pre y (cancelling elements): max err / bound "
        f"{float((err / np.maximum(abs_bound, 1e-30))[cancel].max()):.3g} [seed={seed}, T={T}, D={D}]")
    keep = ~cancel
    assert_bf16(y.get()[keep], np.asarray(wy, np.float32)[keep], "hc_pre y", seed, max_ulp=HC_Y_MAX_ULP,
                max_frac=HC_Y_MAX_FRAC, T=T, D=D)
    # a token alone == the same token in the batch
    if T > 1:
        y1, _, _ = K.hc_pre(Xg[T - 1:].copy(), fng, cp.asarray(scale), cp.asarray(base), iters=ITERS,
                            hc_eps=HC_EPS, norm_eps=NORM_EPS)
        assert cp.array_equal(y1[0], y[T - 1]), f"hc_pre: token alone != in batch [seed={seed}]"


@pytest.mark.parametrize("T,D", [(1, 4096), (5, 4096), (2, 512)])
def test_hc_mixes_split_is_bitwise_in_cta(T, D):
    """The split reduction (decode) and the in-CTA one (prefill) give the same bits, for every
    split count, and a token alone equals the same token in a batch."""
    seed = fresh_seed()
    rng = rng_for(seed)
    X = rand_bf16(rng, (T, 4, D), 1.0, spread=2)
    fn, _, _ = _params(rng, D, 24)
    Xg, fng = cp.asarray(bits_of(X)), cp.asarray(fn)
    ref = K.hc_mixes(Xg, fng, NORM_EPS, n_split=1)
    nseg = 4 * D // 256
    for ns in sorted({d for d in (2, 4, nseg // 4, nseg) if d >= 1 and nseg % d == 0}):
        for _ in range(2):  # twice: the split counters must be left at zero
            got = K.hc_mixes(Xg, fng, NORM_EPS, n_split=ns)
            assert cp.array_equal(got, ref), f"hc_mixes n_split={ns} != in-CTA [seed={seed}, T={T}, D={D}]"
    one = K.hc_mixes(Xg[T - 1:].copy(), fng, NORM_EPS)
    assert cp.array_equal(one[0], ref[T - 1]), f"hc_mixes token alone != in batch [seed={seed}]"
    h = K.hc_mixes(Xg, cp.asarray(fn[:4].copy()), NORM_EPS, n_split=2)
    assert cp.array_equal(h, K.hc_mixes(Xg, cp.asarray(fn[:4].copy()), NORM_EPS, n_split=1)), (
        f"hc_mixes r4 split != in-CTA [seed={seed}]")


@pytest.mark.parametrize("T,D", [(3, 4096), (17, 256)])
def test_hc_weighted_sum(T, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    X = rand_bf16(rng, (T, 4, D), 1.0, spread=3)
    pre = (rng.random((T, 4)) + 1e-6).astype(np.float32)
    got = K.hc_weighted_sum(cp.asarray(pre), cp.asarray(bits_of(X)))
    assert_bf16(got.get(), O.BF16.store(O._weighted_streams(X, pre)), "hc_weighted_sum", seed,
                max_ulp=WSUM_MAX_ULP, T=T, D=D)


@pytest.mark.parametrize("T,D", [(1, 4096), (6, 4096), (9, 256)])
def test_hc_post(T, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    f = rand_bf16(rng, (T, D), 1.0, spread=2)
    R = rand_bf16(rng, (T, 4, D), 1.0, spread=2)
    post = (2 * rng.random((T, 4))).astype(np.float32)
    comb = rng.random((T, 4, 4)).astype(np.float32)
    comb /= comb.sum(axis=1, keepdims=True)
    got = K.hc_post(cp.asarray(bits_of(f)), cp.asarray(bits_of(R)), cp.asarray(post), cp.asarray(comb))
    want = O.hc_post(f, R, post, comb)
    assert_bf16(got.get(), want, "hc_post", seed, max_ulp=WSUM_MAX_ULP, T=T, D=D)


@pytest.mark.parametrize("T,D", [(1, 4096), (7, 4096), (5, 256)])
def test_hc_head(T, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    X = rand_bf16(rng, (T, 4, D), 1.0, spread=2)
    fn, scale, base = _params(rng, D, 4)
    got = K.hc_head(cp.asarray(bits_of(X)), cp.asarray(fn), cp.asarray(scale), cp.asarray(base),
                    hc_eps=HC_EPS, norm_eps=NORM_EPS)
    want = O.hc_head(X, fn, scale, base, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    assert_bf16(got.get(), want, "hc_head", seed, max_ulp=HC_Y_MAX_ULP, max_frac=HC_Y_MAX_FRAC, T=T, D=D)


# ------------------------------------------------------------------------- hc_boundary
RMS_MAX_ULP, RMS_MAX_FRAC = 1, 1e-5  # test_kernels_rmsnorm's twin bounds (double-rounding ties)


def _boundary_case(rng, D, wide: bool = False):
    """Host inputs of one boundary: streams, the previous sub-layer's f, post / comb as a real
    split leaves them (comb columns sum to ~1), fn / scale / base, a bf16 norm weight.
    wide: streams and fn over ~2^+-12 so the double mixes sums are inexact and their bits
    depend on the reduction order (with unit-scale data they are usually exact in any order)."""
    spread = 12 if wide else 2
    X = rand_bf16(rng, (1, 4, D), 1.0, spread=spread)
    f = rand_bf16(rng, (1, D), 1.0, spread=spread)
    post = (2 * rng.random((1, 4))).astype(np.float32)
    comb = rng.random((1, 4, 4)).astype(np.float32)
    comb /= comb.sum(axis=1, keepdims=True)
    fn, scale, base = _params(rng, D, 24)
    if wide:
        fn = (fn * np.exp2(rng.integers(-12, 13, size=fn.shape))).astype(np.float32)
    w = bf16(rng.standard_normal(D).astype(np.float32) * np.float32(0.5) + np.float32(1.0))
    return dict(X=X, f=f, post=post, comb=comb, fn=fn, scale=scale, base=base, w=w)


def _dev(c):
    g = {k: cp.asarray(c[k]) for k in ("post", "comb", "fn", "scale", "base")}
    g["X"], g["f"], g["w"] = (cp.asarray(bits_of(c[k])) for k in ("X", "f", "w"))
    return g


def _unfused(g, with_post: bool):
    """The chain hc_boundary replaces, each kernel on its own."""
    S = K.hc_post(g["f"], g["X"], g["post"], g["comb"]) if with_post else g["X"]
    mixes = K.hc_mixes(S, g["fn"], NORM_EPS)  # T = 1: the split path, as the device step ran it
    x, pre, post, comb = K.hc_pre_finish(mixes, g["scale"], g["base"], S, iters=ITERS, hc_eps=HC_EPS)
    xn = RN.rmsnorm(x, g["w"], NORM_EPS)
    return dict(streams=S, mixes=mixes, x=x, pre=pre, post=post, comb=comb, xn=xn)


def _poisoned(shape, dtype):
    """Output buffers full of NaN bits: an element the kernel fails to write cannot match."""
    return cp.full(shape, 0xFFFF if dtype == np.uint16 else np.nan, dtype=dtype)


def _fused(g, with_post: bool, in_place: bool, impl=None):
    D = g["X"].shape[2]
    o = dict(x=_poisoned((1, D), np.uint16), xn=_poisoned((1, D), np.uint16),
             pre=_poisoned((1, 4), np.float32), mixes=_poisoned((1, 24), np.float32))
    if in_place:  # the device step: post / comb are read, then replaced
        o["post"], o["comb"] = g["post"].copy(), g["comb"].copy()
        pin = cin = None
    else:
        o["post"], o["comb"] = _poisoned((1, 4), np.float32), _poisoned((1, 4, 4), np.float32)
        pin, cin = g["post"], g["comb"]
    out = _poisoned((1, 4, D), np.uint16) if with_post else None
    kw = dict(f=g["f"], out=out, post_in=pin, comb_in=cin) if with_post else {}
    S = K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], iters=ITERS, hc_eps=HC_EPS,
                      norm_eps=NORM_EPS, xn=o["xn"], x=o["x"], pre=o["pre"], post=o["post"],
                      comb=o["comb"], mixes=o["mixes"], impl=impl, **kw)
    assert S is (out if with_post else g["X"])
    o["streams"] = S
    return o


def _assert_same_bytes(got, want, seed, **ctx):
    for k in ("streams", "mixes", "x", "pre", "post", "comb", "xn"):
        a, b = cp.asnumpy(got[k]), cp.asnumpy(want[k]).reshape(got[k].shape)
        assert a.dtype == b.dtype, f"hc_boundary {k}: dtype {a.dtype} != {b.dtype}"
        bits = np.uint16 if a.itemsize == 2 else np.uint32
        bad = np.flatnonzero(a.view(bits) != b.view(bits))
        assert bad.size == 0, (
            f"hc_boundary {k} != unfused chain at {bad.size}/{a.size} elements, first (index, fused, "
            f"unfused): {[(int(i), a.ravel()[i], b.ravel()[i]) for i in bad[:4]]} [seed={seed}, {ctx}]")


@pytest.mark.parametrize("D,with_post,in_place,wide", [
    (4096, True, True, False), (4096, True, False, False), (4096, False, False, False),  # Flash
    (4096, True, True, True),                                                         # wide range
    (7168, True, True, False),                                                        # Pro (nseg 112)
    (256, True, True, False), (256, False, False, False), (512, True, False, False),  # tiny / small
    (192, True, True, False), (192, True, False, True),                               # segments
    (128, True, False, False), (128, False, False, False),                            # straddle streams
])
def test_hc_boundary_bitwise_unfused(D, with_post, in_place, wide):
    seed = fresh_seed()
    rng = rng_for(seed)
    for rep in range(2):  # twice with fresh data: the counter self-resets, nothing is stale
        g = _dev(_boundary_case(rng, D, wide))
        want = _unfused(g, with_post)
        got = _fused(g, with_post, in_place)
        _assert_same_bytes(got, want, seed, D=D, with_post=with_post, in_place=in_place, wide=wide,
                           rep=rep)


@pytest.mark.parametrize("D", [4096, 256])
def test_hc_boundary_vs_twin(D):
    """The twin of hc_boundary is oracle hc_post -> hc_pre -> rmsnorm; the bounds are those of
    the unfused kernels (the fused one equals them byte for byte)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    c = _boundary_case(rng, D)
    got = _fused(_dev(c), True, True)
    new = O.hc_post(c["f"], c["X"], c["post"], c["comb"])
    assert_bf16(got["streams"].get(), new, "hc_boundary streams", seed, max_ulp=WSUM_MAX_ULP, D=D)
    _, want_mixes = O._hc_mixes(new, c["fn"], NORM_EPS, O.BF16)
    assert_f32(got["mixes"].get(), want_mixes, "hc_boundary mixes", seed, max_ulp=MIXES_MAX_ULP, D=D)
    wpre, wpost, wcomb = hc_split(got["mixes"].get(), c["scale"], c["base"], 4, ITERS, HC_EPS)
    assert_f32(got["pre"].get(), wpre, "hc_boundary pre", seed, max_ulp=SPLIT_MAX_ULP, D=D)
    assert_f32(got["post"].get(), wpost, "hc_boundary post", seed, max_ulp=SPLIT_MAX_ULP, D=D)
    assert_f32(got["comb"].get(), wcomb, "hc_boundary comb", seed, max_ulp=COMB_MAX_ULP, D=D)
    assert_bf16(got["x"].get(), O.BF16.store(O._weighted_streams(new, got["pre"].get())),
                "hc_boundary x | pre", seed, max_ulp=WSUM_MAX_ULP, D=D)
    wy, _, _ = O.hc_pre(new, c["fn"], c["scale"], c["base"], hc_mult=4, iters=ITERS, hc_eps=HC_EPS,
                        norm_eps=NORM_EPS)
    assert_bf16(got["x"].get(), wy, "hc_boundary x", seed, max_ulp=HC_Y_MAX_ULP, max_frac=HC_Y_MAX_FRAC, D=D)
    xv = decode_bf16(got["x"].get())
    assert_bf16(got["xn"].get(), O.rmsnorm(xv, c["w"], NORM_EPS), "hc_boundary xn | x", seed,
                max_ulp=RMS_MAX_ULP, max_frac=RMS_MAX_FRAC, D=D)


def test_hc_boundary_chain_like_the_device_step():
    """Five boundaries as DeviceStep._block runs them (first without hc_post, then with the
    previous sub-layer's output; streams ping-pong; post / comb updated in place) against the
    unfused kernels in the same flow, byte for byte at every boundary."""
    seed = fresh_seed()
    rng = rng_for(seed)
    D = 4096
    c = _boundary_case(rng, D)
    g = _dev(c)
    fns = [_dev(_boundary_case(rng, D)) for _ in range(5)]  # per-sub-layer fn / scale / base / w
    a, b = g["X"].copy(), cp.empty_like(g["X"])
    ra = g["X"].copy()
    post, comb = cp.empty((1, 4), np.float32), cp.empty((1, 4, 4), np.float32)
    rpost = rcomb = None
    x, xn = cp.empty((1, D), np.uint16), cp.empty((1, D), np.uint16)
    pre, mixes = cp.empty((1, 4), np.float32), cp.empty((1, 24), np.float32)
    for k, p in enumerate(fns):
        f = cp.asarray(bits_of(rand_bf16(rng, (1, D), 1.0, spread=2)))  # the sub-layer's output
        kw = dict(f=f, out=b) if k else {}
        K.hc_boundary(a, p["fn"], p["scale"], p["base"], p["w"], iters=ITERS, hc_eps=HC_EPS,
                      norm_eps=NORM_EPS, xn=xn, x=x, pre=pre, post=post, comb=comb, mixes=mixes, **kw)
        if k:
            a, b = b, a
        ref = _unfused(dict(p, X=ra, f=f, post=rpost, comb=rcomb), bool(k))
        ra, rpost, rcomb = ref["streams"], ref["post"], ref["comb"]
        _assert_same_bytes(dict(streams=a, mixes=mixes, x=x, pre=pre, post=post, comb=comb, xn=xn),
                           ref, seed, boundary=k)


def test_hc_boundary_graph_replay():
    """Captured once, replayed with new inputs written into the captured buffers (in-place post /
    comb as the device step): every replay equals the unfused chain; no allocation."""
    from memra_dsv4.gpu import graphs
    from memra_dsv4.gpu.arena import count_allocations
    seed = fresh_seed()
    rng = rng_for(seed)
    D = 4096
    g = _dev(_boundary_case(rng, D))
    bufs = dict(x=cp.empty((1, D), np.uint16), xn=cp.empty((1, D), np.uint16),
                pre=cp.empty((1, 4), np.float32), post=g["post"].copy(), comb=g["comb"].copy(),
                mixes=cp.empty((1, 24), np.float32), out=cp.empty((1, 4, D), np.uint16))
    K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], iters=ITERS, hc_eps=HC_EPS,
                  norm_eps=NORM_EPS, f=g["f"], **bufs)  # loads the kernel before the capture
    _unfused(g, True)  # sizes the shared split workspace before the capture, as DeviceStep._prewarm
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()

    def step():
        K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], iters=ITERS, hc_eps=HC_EPS,
                      norm_eps=NORM_EPS, f=g["f"], **bufs)

    graph = graphs.capture(s, step)
    for rep in range(3):
        c = _boundary_case(rng, D)
        for k, v in _dev(c).items():
            g[k][...] = v
        bufs["post"][...] = g["post"]
        bufs["comb"][...] = g["comb"]
        cp.cuda.Device().synchronize()
        want = _unfused(g, True)
        cp.cuda.Device().synchronize()
        with count_allocations() as n_alloc:
            graphs.replay(graph, s)
            s.synchronize()
        assert n_alloc.total == 0, f"{n_alloc} allocations in a replay"
        got = dict(streams=bufs["out"], **{k: bufs[k] for k in ("mixes", "x", "pre", "post", "comb", "xn")})
        _assert_same_bytes(got, want, seed, rep=rep)


@pytest.mark.parametrize("D,T,with_post,in_place,wide", [
    (4096, 2, True, True, False), (4096, 8, True, True, True), (4096, 5, False, False, False),
    (4096, 3, True, False, False), (7168, 4, True, True, False), (256, 8, True, True, False)])
def test_hc_boundary_rows_bitwise(D, T, with_post, in_place, wide):
    """T rows in one launch (grid.y = T: the device verify's boundaries) == T one-row launches,
    byte for byte, each row with its own streams / f / post / comb (one sub-layer's fn / scale /
    base / norm weight); twice with fresh data (the T tickets self-reset)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    for rep in range(2):
        cases = [_dev(_boundary_case(rng, D, wide)) for _ in range(T)]
        g0 = cases[0]
        one = [_fused(dict(c, fn=g0["fn"], scale=g0["scale"], base=g0["base"], w=g0["w"]),
                      with_post, in_place) for c in cases]
        X = cp.concatenate([c["X"] for c in cases])
        o = dict(x=_poisoned((T, D), np.uint16), xn=_poisoned((T, D), np.uint16),
                 pre=_poisoned((T, 4), np.float32), mixes=_poisoned((T, 24), np.float32))
        post_in = cp.concatenate([c["post"] for c in cases])
        comb_in = cp.concatenate([c["comb"] for c in cases])
        if in_place:
            o["post"], o["comb"], pin, cin = post_in, comb_in, None, None
        else:
            o["post"], o["comb"] = _poisoned((T, 4), np.float32), _poisoned((T, 4, 4), np.float32)
            pin, cin = post_in, comb_in
        out = _poisoned((T, 4, D), np.uint16) if with_post else None
        kw = dict(f=cp.concatenate([c["f"] for c in cases]), out=out, post_in=pin,
                  comb_in=cin) if with_post else {}
        S = K.hc_boundary(X, g0["fn"], g0["scale"], g0["base"], g0["w"], iters=ITERS, hc_eps=HC_EPS,
                          norm_eps=NORM_EPS, xn=o["xn"], x=o["x"], pre=o["pre"], post=o["post"],
                          comb=o["comb"], mixes=o["mixes"], impl="lastcta", **kw)
        assert S is (out if with_post else X)
        o["streams"] = S
        for t in range(T):
            _assert_same_bytes({k: v[t:t + 1] for k, v in o.items()}, one[t], seed, D=D, T=T,
                               row=t, rep=rep, with_post=with_post, in_place=in_place)
        _counters_zero("lastcta")   # every row's ticket back to zero


def test_hc_boundary_refusals():
    rng = rng_for(1)
    g = _dev(_boundary_case(rng, 256))
    D = 256
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, xn=cp.empty((1, D), np.uint16),
              x=cp.empty((1, D), np.uint16), pre=cp.empty((1, 4), np.float32),
              post=cp.empty((1, 4), np.float32), comb=cp.empty((1, 4, 4), np.float32),
              mixes=cp.empty((1, 24), np.float32))
    with pytest.raises(AssertionError, match="out must not alias"):
        K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], f=g["f"], out=g["X"], **kw)
    with pytest.raises(AssertionError, match="9 tokens, expected 1..8"):
        X9 = cp.zeros((9, 4, D), np.uint16)
        K.hc_boundary(X9, g["fn"], g["scale"], g["base"], g["w"], **kw)
    with pytest.raises(AssertionError, match="x: shape"):   # 2 rows of streams, one row of x
        K.hc_boundary(cp.zeros((2, 4, D), np.uint16), g["fn"], g["scale"], g["base"], g["w"], **kw)
    kw2 = {k: cp.concatenate([v, v]) for k, v in kw.items() if k not in ("iters", "hc_eps", "norm_eps")}
    with pytest.raises(ValueError, match="impl 'lastcta'"):
        K.hc_boundary(cp.zeros((2, 4, D), np.uint16), g["fn"], g["scale"], g["base"], g["w"],
                      iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, impl="poll", **kw2)
    kw2["xn"] = cp.empty((2, 2 * D), np.uint16)[:, :D]
    with pytest.raises(AssertionError, match="xn: must be C-contiguous"):
        K.hc_boundary(cp.zeros((2, 4, D), np.uint16), g["fn"], g["scale"], g["base"], g["w"],
                      iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, **kw2)
    with pytest.raises(AssertionError, match="norm_weight"):
        K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"].view(np.int16).astype(np.float32), **kw)
    with pytest.raises(AssertionError, match="belong to the hc_post half"):
        K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], out=cp.empty((1, 4, D), np.uint16), **kw)


# ------------------------------------------------------------------------- hc_boundary variants
def _counters_zero(impl):
    if impl == "poll":
        slots = K.boundary_slots()
        assert not bool(cp.any(slots)), f"hc_boundary_poll: slots not zero after a launch ({int(cp.count_nonzero(slots))} words)"
    else:
        _, cnt = K.split_workspace(1, 1)
        assert not bool(cp.any(cnt)), "hc_boundary: ticket counter not zero after a launch"


@pytest.mark.parametrize("impl", [i for i in K.BOUNDARY_IMPLS if i != "lastcta"])
@pytest.mark.parametrize("D,with_post,in_place,wide", [
    (4096, True, True, False), (4096, True, False, False), (4096, False, False, False),  # Flash: both kinds
    (4096, True, True, True), (4096, False, False, True),                              # wide range
    (7168, True, True, False), (256, True, True, False), (256, False, False, False),  # Pro, tiny
    (192, True, False, True), (128, True, False, False), (128, False, False, False),  # straddling segments
    (64, True, True, False), (64, False, False, False),                               # one CTA
])
def test_hc_boundary_impl_bitwise(impl, D, with_post, in_place, wide):
    """Every variant == the lastcta kernel byte for byte (and so == the unfused chain), seeds
    fresh per repetition; the variant's counters / slots are zero after each launch."""
    seed = fresh_seed()
    rng = rng_for(seed)
    for rep in range(3):
        g = _dev(_boundary_case(rng, D, wide))
        want = _fused(g, with_post, in_place, impl="lastcta")
        got = _fused(g, with_post, in_place, impl=impl)
        cp.cuda.Device().synchronize()
        _counters_zero(impl)
        _assert_same_bytes(got, want, seed, impl=impl, D=D, with_post=with_post, in_place=in_place,
                           wide=wide, rep=rep)
        if rep == 0 and D == 4096:  # and the unfused chain itself
            _assert_same_bytes(got, _unfused(g, with_post), seed, impl=impl, D=D, vs="unfused")


@pytest.mark.parametrize("impl", [i for i in K.BOUNDARY_IMPLS if i != "lastcta"])
def test_hc_boundary_impl_env_and_chain(impl, monkeypatch):
    """The variant picked through $MEMRA_DSV4_HC_BOUNDARY_IMPL (read at call time), chained as
    DeviceStep._block runs it (first boundary without hc_post, then with; in-place post / comb;
    ping-pong streams), equals the default kernel's chain at every boundary."""
    seed = fresh_seed()
    rng = rng_for(seed)
    D = 4096
    g = _dev(_boundary_case(rng, D))
    params = [_dev(_boundary_case(rng, D)) for _ in range(6)]
    fs = [cp.asarray(bits_of(rand_bf16(rng, (1, D), 1.0, spread=2))) for _ in params]
    runs = {}
    for name in ("lastcta", impl):
        monkeypatch.setenv(K.BOUNDARY_IMPL_ENV, name)
        assert K.boundary_impl() == name
        a, b = g["X"].copy(), cp.empty_like(g["X"])
        bufs = dict(x=cp.empty((1, D), np.uint16), xn=cp.empty((1, D), np.uint16),
                    pre=cp.empty((1, 4), np.float32), post=cp.empty((1, 4), np.float32),
                    comb=cp.empty((1, 4, 4), np.float32), mixes=cp.empty((1, 24), np.float32))
        seq = []
        for k, (p, f) in enumerate(zip(params, fs)):
            kw = dict(f=f, out=b) if k else {}
            K.hc_boundary(a, p["fn"], p["scale"], p["base"], p["w"], iters=ITERS, hc_eps=HC_EPS,
                          norm_eps=NORM_EPS, **bufs, **kw)
            if k:
                a, b = b, a
            seq.append(dict(streams=a.copy(), **{n: v.copy() for n, v in bufs.items()}))
        runs[name] = seq
        cp.cuda.Device().synchronize()
        _counters_zero(name)
    for k, (got, want) in enumerate(zip(runs[impl], runs["lastcta"])):
        _assert_same_bytes(got, want, seed, impl=impl, boundary=k)


@pytest.mark.parametrize("impl", [i for i in K.BOUNDARY_IMPLS if i != "lastcta"])
def test_hc_boundary_impl_graph_replay(impl):
    """The variant captured once and replayed with new inputs (in-place post / comb, both kinds
    in one graph) equals the default kernel on the same inputs; slots zero after every replay."""
    from memra_dsv4.gpu import graphs
    seed = fresh_seed()
    rng = rng_for(seed)
    D = 4096
    g = _dev(_boundary_case(rng, D))
    g2 = _dev(_boundary_case(rng, D))

    def new_bufs():
        return dict(x=cp.empty((1, D), np.uint16), xn=cp.empty((1, D), np.uint16),
                    pre=cp.empty((1, 4), np.float32), post=cp.empty((1, 4), np.float32),
                    comb=cp.empty((1, 4, 4), np.float32), mixes=cp.empty((1, 24), np.float32))

    bufs, out = new_bufs(), cp.empty((1, 4, D), np.uint16)
    ref, rout = new_bufs(), cp.empty((1, 4, D), np.uint16)

    def run(b, o, name):
        K.hc_boundary(g["X"], g["fn"], g["scale"], g["base"], g["w"], iters=ITERS, hc_eps=HC_EPS,
                      norm_eps=NORM_EPS, f=g["f"], out=o, impl=name, **b)           # attn -> ffn kind
        K.hc_boundary(o, g2["fn"], g2["scale"], g2["base"], g2["w"], iters=ITERS, hc_eps=HC_EPS,
                      norm_eps=NORM_EPS, impl=name, **b)                            # first-of-stage kind

    run(bufs, out, impl)  # loads the kernel and allocates the slots before the capture
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    graph = graphs.capture(s, lambda: run(bufs, out, impl))
    for rep in range(3):
        for src, dst in ((_dev(_boundary_case(rng, D)), g), (_dev(_boundary_case(rng, D)), g2)):
            for k, v in src.items():
                dst[k][...] = v
        post0, comb0 = g["post"].copy(), g["comb"].copy()
        for b in (bufs, ref):
            b["post"][...] = post0
            b["comb"][...] = comb0
        cp.cuda.Device().synchronize()
        run(ref, rout, "lastcta")
        cp.cuda.Device().synchronize()
        graphs.replay(graph, s)
        s.synchronize()
        _counters_zero(impl)
        got = dict(streams=out, **{k: bufs[k] for k in ("mixes", "x", "pre", "post", "comb", "xn")})
        want = dict(streams=rout, **{k: ref[k] for k in ("mixes", "x", "pre", "post", "comb", "xn")})
        _assert_same_bytes(got, want, seed, impl=impl, rep=rep)


# ------------------------------------------------------------------------- split boundary
def _split(g, with_post: bool, in_place: bool, handoff: str = "ticket"):
    """hc_boundary_pre then hc_boundary_sinkhorn on _fused's buffers (poisoned outputs; in place:
    post / comb hold the previous boundary's values, read by the first kernel, rewritten by the
    second).  Also checks that the critical kernel leaves post / comb alone."""
    D = g["X"].shape[2]
    o = dict(x=_poisoned((1, D), np.uint16), xn=_poisoned((1, D), np.uint16),
             pre=_poisoned((1, 4), np.float32), mixes=_poisoned((1, 24), np.float32))
    if in_place:
        o["post"], o["comb"] = g["post"].copy(), g["comb"].copy()
    else:
        o["post"], o["comb"] = _poisoned((1, 4), np.float32), _poisoned((1, 4, 4), np.float32)
    out = _poisoned((1, 4, D), np.uint16) if with_post else None
    pin, cin = (o["post"], o["comb"]) if in_place else (g["post"], g["comb"])
    kw = dict(f=g["f"], out=out, post_in=pin, comb_in=cin) if with_post else {}
    post0, comb0 = o["post"].copy(), o["comb"].copy()
    S = K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], hc_eps=HC_EPS,
                          norm_eps=NORM_EPS, xn=o["xn"], x=o["x"], pre=o["pre"], mixes=o["mixes"],
                          handoff=handoff, **kw)
    assert S is (out if with_post else g["X"])
    for k, before in (("post", post0), ("comb", comb0)):
        assert cp.asnumpy(o[k]).tobytes() == cp.asnumpy(before).tobytes(), f"hc_boundary_pre wrote {k}"
    K.hc_boundary_sinkhorn(o["mixes"], g["scale"], g["base"], iters=ITERS, hc_eps=HC_EPS,
                           post=o["post"], comb=o["comb"])
    o["streams"] = S
    return o


@pytest.mark.parametrize("D,with_post,in_place,wide", [
    (4096, True, True, False), (4096, True, False, False), (4096, False, False, False),  # Flash: both kinds
    (4096, True, True, True), (4096, False, False, True),                              # wide range
    (7168, True, True, False), (256, True, True, False), (256, False, False, False),  # Pro, tiny
    (192, True, False, True), (128, True, False, False), (128, False, False, False),  # straddling segments
    (64, True, True, False), (64, False, False, False),                               # one CTA
])
def test_hc_boundary_split_bitwise(D, with_post, in_place, wide):
    """hc_boundary_pre + hc_boundary_sinkhorn == hc_boundary byte for byte in every output (and
    == the unfused chain); the ticket counter is zero after each launch."""
    seed = fresh_seed()
    rng = rng_for(seed)
    for rep in range(3):
        g = _dev(_boundary_case(rng, D, wide))
        want = _fused(g, with_post, in_place, impl="lastcta")
        got = _split(g, with_post, in_place)
        cp.cuda.Device().synchronize()
        _counters_zero("lastcta")
        _assert_same_bytes(got, want, seed, split=True, D=D, with_post=with_post, in_place=in_place,
                           wide=wide, rep=rep)
        if rep == 0 and D == 4096:
            _assert_same_bytes(got, _unfused(g, with_post), seed, split=True, D=D, vs="unfused")


def _chain_inputs(rng, D, n):
    g = _dev(_boundary_case(rng, D, wide=True))
    params = [_dev(_boundary_case(rng, D, wide=bool(k % 2))) for k in range(n)]
    fs = [cp.asarray(bits_of(rand_bf16(rng, (1, D), 1.0, spread=4))) for _ in params]
    return g, params, fs


def _chain_bufs(D, n):
    """The step's sharing: one mixes / pre / post / comb for every boundary (as the arena's
    dev.mix, hc.pre, hc.post, hc.comb); x / xn per boundary so each can be checked."""
    return dict(a=cp.empty((1, 4, D), np.uint16), b=cp.empty((1, 4, D), np.uint16),
                mixes=cp.empty((1, 24), np.float32), pre=cp.empty((1, 4), np.float32),
                post=cp.empty((1, 4), np.float32), comb=cp.empty((1, 4, 4), np.float32),
                x=[cp.empty((1, D), np.uint16) for _ in range(n)],
                xn=[cp.empty((1, D), np.uint16) for _ in range(n)])


def _run_chain(X0, params, fs, B, split: bool, fork=None, side=None, snap=None, handoff: str = "ticket"):
    """DeviceStep._block's flow: boundary 0 without hc_post, then with the previous sub-layer's
    output f (streams ping-pong a/b; post / comb carried in place).  split: hc_boundary_pre, then
    hc_boundary_sinkhorn, on ``side`` after ``fork.fork()`` when given, joined before the next
    boundary and at the end.  snap(k, streams): called after boundary k (eager runs only)."""
    a, b = B["a"], B["b"]
    a[...] = X0
    pending = False
    for k, (p, f) in enumerate(zip(params, fs)):
        kw = dict(f=f, out=b) if k else {}
        if not split:
            K.hc_boundary(a, p["fn"], p["scale"], p["base"], p["w"], iters=ITERS, hc_eps=HC_EPS,
                          norm_eps=NORM_EPS, xn=B["xn"][k], x=B["x"][k], pre=B["pre"], post=B["post"],
                          comb=B["comb"], mixes=B["mixes"], impl="lastcta", **kw)
        else:
            if pending:
                fork.join()
                pending = False
            if k:
                kw.update(post_in=B["post"], comb_in=B["comb"])
            K.hc_boundary_pre(a, p["fn"], p["scale"], p["base"], p["w"], hc_eps=HC_EPS,
                              norm_eps=NORM_EPS, xn=B["xn"][k], x=B["x"][k], pre=B["pre"],
                              mixes=B["mixes"], handoff=handoff, **kw)
            sk = lambda p=p: K.hc_boundary_sinkhorn(B["mixes"], p["scale"], p["base"], iters=ITERS,
                                                    hc_eps=HC_EPS, post=B["post"], comb=B["comb"])
            if fork is not None:
                fork.fork()
                with side:
                    sk()
                pending = True
            else:
                sk()
        if k:
            a, b = b, a
        if snap is not None:
            snap(k, a)
    if pending:
        fork.join()
    return a


def _chain_state(B, S, k=None):
    ks = range(len(B["x"])) if k is None else [k]
    return dict(streams=S.copy(), mixes=B["mixes"].copy(), pre=B["pre"].copy(), post=B["post"].copy(),
                comb=B["comb"].copy(), x=cp.concatenate([B["x"][i] for i in ks]),
                xn=cp.concatenate([B["xn"][i] for i in ks]))


@pytest.mark.parametrize("handoff,pdl", [("ticket", False), ("cluster", True), ("coop", True), ("coop", False),
                                         ("coopall", True)])
def test_hc_boundary_split_chain(handoff, pdl):
    """Seven boundaries as DeviceStep._block runs them: the split chain == the hc_boundary chain
    byte for byte after every boundary (post / comb carried through the Sinkhorn kernel).  The
    cluster form's chain runs with every split launch under the PDL attribute (the step's
    launches), eager."""
    from memra_dsv4.gpu.pdl import pdl_launches
    seed = fresh_seed()
    rng = rng_for(seed)
    D, n = 4096, 7
    g, params, fs = _chain_inputs(rng, D, n)
    runs = {}
    for split in (False, True):
        B = _chain_bufs(D, n)
        seq = []
        with pdl_launches(pdl and split):
            _run_chain(g["X"], params, fs, B, split, handoff=handoff,
                       snap=lambda k, S, B=B, seq=seq: seq.append(_chain_state(B, S, k)))
        cp.cuda.Device().synchronize()
        _counters_zero("lastcta")
        runs[split] = seq
    for k, (got, want) in enumerate(zip(runs[True], runs[False])):
        _assert_same_bytes(got, want, seed, split=True, handoff=handoff, pdl=pdl, boundary=k)


@pytest.mark.parametrize("handoff", K.PRE_HANDOFFS)
@pytest.mark.parametrize("pdl", [False, True])
def test_hc_boundary_split_forked_graph(pdl, handoff):
    """The split chain captured with each Sinkhorn on a side stream (graphs.Fork: fork after the
    critical kernel, join before the next one and at the end), PDL launches or plain, replayed
    with new streams / sub-layer outputs written into the captured buffers: every replay equals
    the eager hc_boundary chain on the same inputs (final streams, mixes, pre, post, comb and
    every boundary's x / xn); no allocation in a replay."""
    from memra_dsv4.gpu import graphs
    from memra_dsv4.gpu.arena import count_allocations
    from memra_dsv4.gpu.pdl import pdl_launches
    seed = fresh_seed()
    rng = rng_for(seed)
    D, n = 4096, 6
    g, params, fs = _chain_inputs(rng, D, n)
    X0 = g["X"]
    B, R = _chain_bufs(D, n), _chain_bufs(D, n)
    _run_chain(X0, params, fs, B, True, handoff=handoff)   # loads the kernels before the capture
    cp.cuda.Device().synchronize()
    s, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    fork = graphs.Fork(s, side)
    final = {}

    def body():
        with pdl_launches(pdl):
            final["S"] = _run_chain(X0, params, fs, B, True, fork=fork, side=side, handoff=handoff)
    graph = graphs.capture(s, body)
    for rep in range(3):
        X0[...] = cp.asarray(bits_of(rand_bf16(rng, (1, 4, D), 1.0, spread=4)))
        for f in fs:
            f[...] = cp.asarray(bits_of(rand_bf16(rng, (1, D), 1.0, spread=4)))
        for buf in (B["mixes"], B["pre"], B["post"], B["comb"]):
            buf.fill(np.nan)
        cp.cuda.Device().synchronize()
        RS = _run_chain(X0, params, fs, R, False)
        cp.cuda.Device().synchronize()
        with count_allocations() as n_alloc:
            graphs.replay(graph, s)
            s.synchronize()
        assert n_alloc.total == 0, f"{n_alloc} allocations in a replay"
        _counters_zero("lastcta")
        _assert_same_bytes(_chain_state(B, final["S"]), _chain_state(R, RS), seed, split=True,
                           graph=True, pdl=pdl, handoff=handoff, rep=rep)


# ------------------------------------------------------------------------- cluster boundary
@pytest.mark.parametrize("D,with_post,in_place,wide", [
    (4096, True, True, False), (4096, True, False, False), (4096, False, False, False),  # Flash: 16 CTAs
    (4096, True, True, True), (4096, False, False, True),                              # wide range
    (2048, True, True, True), (1024, True, False, False), (512, True, True, True),     # 8 / 4 / 2 CTAs
    (256, True, True, False), (256, False, False, True),                               # one CTA
])
def test_hc_boundary_pre_cluster_bitwise(D, with_post, in_place, wide):
    """hc_boundary_pre's cluster form (handoff "cluster": hc_boundary_pre_cluster, one cluster of
    D / 256 CTAs exchanging partials and x through DSMEM) + hc_boundary_sinkhorn == hc_boundary
    byte for byte in every output (streams, mixes, x, pre, post, comb, xn), three fresh inputs
    per case (each launch's mbarriers start anew); at D = 4096 also == the unfused chain and ==
    the ticket form on the same inputs."""
    _split_form_bitwise("cluster", D, with_post, in_place, wide, reps=3)


def _split_form_bitwise(handoff: str, D: int, with_post: bool, in_place: bool, wide: bool, reps: int):
    """hc_boundary_pre(handoff=...) + hc_boundary_sinkhorn == hc_boundary (lastcta) byte for byte in
    every output over ``reps`` fresh inputs; at D = 4096 also == the unfused chain and == the
    ticket form on the first input."""
    seed = fresh_seed()
    rng = rng_for(seed)
    for rep in range(reps):
        g = _dev(_boundary_case(rng, D, wide))
        want = _fused(g, with_post, in_place, impl="lastcta")
        got = _split(g, with_post, in_place, handoff=handoff)
        cp.cuda.Device().synchronize()
        _assert_same_bytes(got, want, seed, handoff=handoff, D=D, with_post=with_post,
                           in_place=in_place, wide=wide, rep=rep)
        if rep == 0 and D == 4096:
            _assert_same_bytes(got, _unfused(g, with_post), seed, handoff=handoff, vs="unfused")
            _assert_same_bytes(got, _split(g, with_post, in_place, handoff="ticket"), seed,
                               handoff=handoff, vs="ticket")


def test_hc_boundary_pre_cluster_refusals_and_occupancy():
    """D not covered by one cluster (7168: 28 CTAs; 192: not a multiple of 256) is refused
    before any launch (the outputs stay poisoned); the 16-CTA cluster of 1024 threads can be
    resident (cuOccupancyMaxActiveClusters >= 1, printed)."""
    from memra_dsv4.gpu.ops._common import kernel
    from memra_dsv4.gpu.ops.testing import max_active_clusters
    rng = rng_for(3)
    for D in (7168, 192):
        g = _dev(_boundary_case(rng, D))
        xn = _poisoned((1, D), np.uint16)
        with pytest.raises(ValueError, match=f"handoff 'cluster' needs .* got D = {D}"):
            K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], hc_eps=HC_EPS,
                              norm_eps=NORM_EPS, xn=xn, x=_poisoned((1, D), np.uint16),
                              pre=_poisoned((1, 4), np.float32), mixes=_poisoned((1, 24), np.float32),
                              handoff="cluster")
        cp.cuda.Device().synchronize()
        assert bool(cp.all(xn == 0xFFFF)), f"a refused call wrote xn (D = {D})"
    n = max_active_clusters(kernel(K.STEM, "hc_boundary_pre_cluster"), 16, 1024, 64 * 256 + 2 * 4096)
    print(f"hc_boundary_pre_cluster: {n} clusters of 16 x 1024 threads resident at once")
    assert n >= 1


# ------------------------------------------------------------------------- cooperative boundary
@pytest.mark.parametrize("handoff", ["coop", "coopall"])
@pytest.mark.parametrize("D,with_post,in_place,wide", [
    (4096, True, True, False), (4096, True, False, False), (4096, False, False, False),  # Flash: 64 CTAs
    (4096, True, True, True), (4096, False, False, True),                              # wide range
    (8192, True, True, True), (2048, True, False, False), (1024, True, True, True),    # 128 / 32 / 16 CTAs
    (1024, False, False, False),
])
def test_hc_boundary_pre_coop_bitwise(D, with_post, in_place, wide, handoff):
    """hc_boundary_pre's cooperative form (hc_boundary_pre_coop: "coop" 8 tail CTAs, "coopall"
    every CTA, polling tagged words for the partials and the norm's chains) + hc_boundary_sinkhorn
    == hc_boundary byte for byte in every output, five fresh inputs per case (each launch a new
    tag: a stale word of the previous launch must not be taken); at D = 4096 also == the unfused
    chain and == the ticket form on the same inputs."""
    _split_form_bitwise(handoff, D, with_post, in_place, wide, reps=5)


def test_hc_boundary_pre_coop_many_launches_and_widths():
    """200 launches in a row cycling D = 4096 / 1024 and 8 / all tail CTAs (different segment and
    tail counts over one slot buffer) under the PDL attribute, each == the ticket form; then the
    epoch word advanced by exactly one per launch."""
    from memra_dsv4.gpu.pdl import pdl_launches
    seed = fresh_seed()
    rng = rng_for(seed)
    cases = {D: _dev(_boundary_case(rng, D, wide=True)) for D in (4096, 1024)}
    want = {D: _split(g, True, False, handoff="ticket") for D, g in cases.items()}
    cp.cuda.Device().synchronize()
    slots = K.coop_slots()
    e0 = int(cp.asnumpy(slots[-2:]).view(np.uint32)[0])
    for i in range(200):
        D = 4096 if i % 2 == 0 else 1024
        handoff = "coop" if i % 4 < 2 else "coopall"
        with pdl_launches(True):
            got = _split(cases[D], True, False, handoff=handoff)
        if i % 25 in (0, 1, 2, 3) or i >= 196:
            cp.cuda.Device().synchronize()
            _assert_same_bytes(got, want[D], seed, handoff=handoff, D=D, launch=i)
    cp.cuda.Device().synchronize()
    e1 = int(cp.asnumpy(slots[-2:]).view(np.uint32)[0])
    assert e1 == e0 + 200, (e0, e1)


def test_hc_boundary_pre_coop_refusals():
    """D the cooperative grid does not cover (7168: 112 CTAs; 256; 3072) is refused before any
    launch (the outputs stay poisoned)."""
    rng = rng_for(5)
    for D in (7168, 256, 3072):
        g = _dev(_boundary_case(rng, D))
        for handoff in ("coop", "coopall"):
            xn = _poisoned((1, D), np.uint16)
            with pytest.raises(ValueError, match=f"handoff '{handoff}' needs D in .* got D = {D}"):
                K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], hc_eps=HC_EPS,
                                  norm_eps=NORM_EPS, xn=xn, x=_poisoned((1, D), np.uint16),
                                  pre=_poisoned((1, 4), np.float32), mixes=_poisoned((1, 24), np.float32),
                                  handoff=handoff)
            cp.cuda.Device().synchronize()
            assert bool(cp.all(xn == 0xFFFF)), f"a refused call wrote xn (D = {D}, {handoff})"


def test_hc_boundary_split_refusals():
    rng = rng_for(2)
    D = 256
    g = _dev(_boundary_case(rng, D))
    kw = dict(hc_eps=HC_EPS, norm_eps=NORM_EPS, xn=cp.empty((1, D), np.uint16),
              x=cp.empty((1, D), np.uint16), pre=cp.empty((1, 4), np.float32),
              mixes=cp.empty((1, 24), np.float32))
    with pytest.raises(AssertionError, match="needs post_in / comb_in"):
        K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], f=g["f"], **kw)
    with pytest.raises(AssertionError, match="out must not alias"):
        K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], f=g["f"], out=g["X"],
                          post_in=g["post"], comb_in=g["comb"], **kw)
    with pytest.raises(AssertionError, match="belong to the hc_post half"):
        K.hc_boundary_pre(g["X"], g["fn"], g["scale"], g["base"], g["w"], post_in=g["post"], **kw)
    with pytest.raises(AssertionError, match="hc_boundary_sinkhorn.comb"):
        K.hc_boundary_sinkhorn(kw["mixes"], g["scale"], g["base"], iters=ITERS, hc_eps=HC_EPS,
                               post=g["post"], comb=g["comb"].reshape(1, 16))
