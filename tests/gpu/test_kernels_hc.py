"""kernels_cu/hc.cu against oracle.ops.hc_pre / hc_post / hc_head and host.hc.hc_split.

Bounds:
* mixes (double accumulation, one f32 rounding): MIXES_MAX_ULP f32 ulp (expected identical);
* pre / post / comb: f32, the twin's op order; exp is a correctly rounded f32 here and NumPy's
  f32 exp elsewhere, so SPLIT_MAX_ULP for pre/post and COMB_MAX_ULP after 20 Sinkhorn rounds;
* y = bf16(sum pre_i X_i) and hc_post: double with the twin's order: bit-identical given the same
  pre (WSUM_MAX_ULP = 0); end to end (GPU pre vs twin pre) HC_Y_MAX_ULP.
Sizes: Flash (D = 4096, fn [24, 16384]) and tiny (D = 256).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import hc as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, assert_f32, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
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
    assert_bf16(y.get(), wy, "hc_pre y", seed, max_ulp=HC_Y_MAX_ULP, max_frac=HC_Y_MAX_FRAC, T=T, D=D)
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
