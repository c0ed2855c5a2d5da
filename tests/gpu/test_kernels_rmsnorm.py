"""kernels_cu/rmsnorm.cu against oracle.ops.rmsnorm / oracle.ops.head_rms (bf16 class).

Bounds: the kernels accumulate the statistics in double and round the double result like the
twin's store(), so they are expected bit-identical; a difference can only come from a double
rounding tie (the twin sums pairwise, the kernel in a fixed tree): at most 1 bf16 ulp on at most
MAX_FRAC of the elements.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import rmsnorm as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

RMS_MAX_ULP = 1
RMS_MAX_FRAC = 1e-5
EPS = 1e-6


@pytest.mark.parametrize("T,n", [(1, 4096), (7, 4096), (64, 1024), (5, 512), (3, 128), (33, 256), (2, 16384)])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rmsnorm(T, n, wdtype):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = rand_bf16(rng, (T, n), 1.0, spread=3)
    w = bf16(rng.standard_normal(n).astype(np.float32) * np.float32(0.5) + np.float32(1.0))  # bf16 weight values
    want = O.rmsnorm(x, w, EPS)
    xg = cp.asarray(bits_of(x))
    wg = cp.asarray(w) if wdtype == "f32" else cp.asarray(bits_of(w))
    got = K.rmsnorm(xg, wg, EPS)
    assert_bf16(got.get(), want, "rmsnorm", seed, max_ulp=RMS_MAX_ULP, max_frac=RMS_MAX_FRAC, T=T, n=n, w=wdtype)
    # in place, and a row computed alone equals the same row of the batch (decode == prefill)
    xi = xg.copy()
    K.rmsnorm(xi, wg, EPS, out=xi)
    assert cp.array_equal(xi, got), f"rmsnorm in place differs [seed={seed}]"
    for t in (0, T - 1):
        one = K.rmsnorm(xg[t:t + 1].copy(), wg, EPS)
        assert cp.array_equal(one[0], got[t]), f"rmsnorm row {t} alone != in batch [seed={seed}]"


@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("n", [1024, 4096, 136])
def test_rmsnorm_weight_preload_and_its_fallback(n, wdtype):
    """The kernels load each thread's first weight chunk before the PDL wait (rms_preload) when
    the weight is 16-byte aligned, and per element otherwise: a weight at a 2- / 4-byte offset
    (a view one element into a buffer) gives the same bytes as the aligned copy, and both equal
    the twin (n = 136: 17 chunks, threads past them preload nothing)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    x = rand_bf16(rng, (3, n), 1.0, spread=3)
    w = bf16(rng.standard_normal(n).astype(np.float32) * np.float32(0.5) + np.float32(1.0))
    wb = np.asarray(w, np.float32) if wdtype == "f32" else bits_of(w)
    aligned = cp.asarray(wb)
    buf = cp.zeros(n + 8, wb.dtype)
    buf[1:n + 1] = aligned
    shifted = buf[1:n + 1]
    assert shifted.data.ptr % 16 != 0 and aligned.data.ptr % 16 == 0
    xg = cp.asarray(bits_of(x))
    got_a = K.rmsnorm(xg, aligned, EPS)
    got_s = K.rmsnorm(xg, shifted, EPS)
    assert cp.array_equal(got_a, got_s), f"rmsnorm: aligned vs offset weight differ [seed={seed}]"
    assert_bf16(got_a.get(), O.rmsnorm(x, w, EPS), "rmsnorm preload", seed, max_ulp=RMS_MAX_ULP,
                max_frac=RMS_MAX_FRAC, n=n, w=wdtype)


@pytest.mark.parametrize("T,H,D", [(1, 64, 512), (9, 64, 512), (5, 4, 128), (3, 8, 128)])
def test_head_rms(T, H, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    q = rand_bf16(rng, (T, H, D), 0.7, spread=2)
    want = O.head_rms(q, EPS)
    qg = cp.asarray(bits_of(q))
    got = K.head_rms(qg, EPS)
    assert_bf16(got.get(), want, "head_rms", seed, max_ulp=RMS_MAX_ULP, max_frac=RMS_MAX_FRAC, T=T, H=H, D=D)
    K.head_rms(qg, EPS, out=qg)
    assert cp.array_equal(qg, got), f"head_rms in place differs [seed={seed}]"


def test_rmsnorm_zero_and_tiny_rows():
    seed = fresh_seed()
    rng = rng_for(seed)
    n = 512
    x = np.zeros((4, n), np.float32)
    x[1] = rand_bf16(rng, (n,), 1e-20)
    x[2, 7] = np.float32(3.0)
    x[3] = rand_bf16(rng, (n,), 1e4)
    w = np.asarray(rand_bf16(rng, (n,), 1.0), np.float32)
    want = O.rmsnorm(x, w, EPS)
    got = K.rmsnorm(cp.asarray(bits_of(x)), cp.asarray(w), EPS)
    assert_bf16(got.get(), want, "rmsnorm edge rows", seed, max_ulp=RMS_MAX_ULP, max_frac=RMS_MAX_FRAC)


@pytest.mark.parametrize("T,H,D", [(3, 64, 512), (4, 4, 128)])
def test_head_rms_fused_rope(T, H, D):
    """head_rms(..., rope=) == rope(head_rms(q)) on the GPU bit for bit, and matches the twin chain."""
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.ops import rope as ROPE
    from memra_dsv4.host.rope import layer_cos_sin

    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(8192))
    pos = rng.integers(0, 8192, T).astype(np.int32)
    q = rand_bf16(rng, (T, H, D), 0.7, spread=2)
    qg, pg, cg, sg = cp.asarray(bits_of(q)), cp.asarray(pos), cp.asarray(cos), cp.asarray(sin)
    fused = K.head_rms(qg, EPS, rope=(pg, cg, sg))
    two = K.head_rms(qg, EPS)
    ROPE.rope(two, pg, cg, sg)
    assert cp.array_equal(fused, two), f"head_rms+rope fused != two kernels [seed={seed}]"
    want = O.apply_rope(O.head_rms(q, EPS), cos[pos][:, None, :], sin[pos][:, None, :])
    assert_bf16(fused.get(), want, "head_rms+rope", seed, max_ulp=RMS_MAX_ULP, max_frac=RMS_MAX_FRAC, T=T, H=H)
