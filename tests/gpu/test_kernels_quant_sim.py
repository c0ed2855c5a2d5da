"""kernels_cu/quant_sim.cu against host.quant (fp8_sim, kv_fp8_sim, fp4_sim) and
oracle.ops.hadamard: every kernel here is bit-identical to its twin (QSIM_MAX_ULP = 0).

Inputs mix wide-range random bf16 data with the boundary cases: all-zero blocks (amax floor),
blocks whose values sit exactly on e4m3 / e2m1 rounding midpoints (ties to even), huge and tiny
magnitudes, and negative zeros.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import E2M1_VALUES, E4M3_VALUES  # noqa: E402
from memra_dsv4.gpu.ops import quant_sim as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.host.quant import fp4_sim, fp8_sim, kv_fp8_sim  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

QSIM_MAX_ULP = 0


def _data(rng, rows, n, block):
    x = rand_bf16(rng, (rows, n), 1.0, spread=12)
    nb = n // block
    if rows >= 6 and nb >= 1:
        x[0, :block] = 0.0                                   # amax floor
        x[1, :block] = -0.0
        # exact e4m3 / e2m1 midpoints times a power of two: ties to even
        mids8 = (E4M3_VALUES[1:0x7e].astype(np.float64) + E4M3_VALUES[2:0x7f]) / 2
        x[2, :block] = bf16(rng.choice(mids8, block) * 2.0 ** -3 * rng.choice([-1, 1], block))
        x[2, 0] = 448.0 * 2.0 ** -3                          # sets amax: scale 2^-3 exactly
        mids4 = (E2M1_VALUES[0:7].astype(np.float64) + E2M1_VALUES[1:8]) / 2
        x[3, :block] = bf16(rng.choice(mids4, block) * 4.0 * rng.choice([-1, 1], block))
        x[3, 0] = 24.0                                       # amax 24 -> fp4 scale 4
        x[4, :block] = bf16(rng.standard_normal(block) * 1e30)
        x[5, :block] = bf16(rng.standard_normal(block) * 1e-30)
    return x


@pytest.mark.parametrize("rows,n,block", [(64, 512, 64), (7, 4096, 128), (9, 128, 64), (1, 1024, 128)])
def test_fp8_sim(rows, n, block):
    seed = fresh_seed()
    x = _data(rng_for(seed), rows, n, block)
    want = fp8_sim(x, block)
    xg = cp.asarray(bits_of(x))
    K.fp8_sim(xg, block)
    assert_bf16(xg.get(), want, "fp8_sim", seed, max_ulp=QSIM_MAX_ULP, rows=rows, n=n, block=block)


@pytest.mark.parametrize("rows,n,rope", [(33, 512, 64), (4, 128, 64), (1, 512, 64)])
def test_kv_fp8_sim(rows, n, rope):
    seed = fresh_seed()
    x = _data(rng_for(seed), rows, n, 64)
    want = kv_fp8_sim(x, rope)
    xg = cp.asarray(bits_of(x))
    K.kv_fp8_sim(xg, rope)
    assert_bf16(xg.get(), want, "kv_fp8_sim", seed, max_ulp=QSIM_MAX_ULP, rows=rows, n=n)


@pytest.mark.parametrize("rows,n", [(64, 128), (5, 4096), (3, 32)])
def test_fp4_sim(rows, n):
    seed = fresh_seed()
    x = _data(rng_for(seed), rows, n, 32)
    want = fp4_sim(x, 32)
    xg = cp.asarray(bits_of(x))
    K.fp4_sim(xg)
    assert_bf16(xg.get(), want, "fp4_sim", seed, max_ulp=QSIM_MAX_ULP, rows=rows, n=n)


@pytest.mark.parametrize("rows", [1, 13, 64 * 7])
@pytest.mark.parametrize("fp4", [False, True])
def test_hadamard128(rows, fp4):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = rand_bf16(rng, (rows, 128), 1.0, spread=6)
    want = O.hadamard(x)
    if fp4:
        want = fp4_sim(want, 32)
    xg = cp.asarray(bits_of(x))
    got = K.hadamard128(xg, fp4=fp4)
    assert_bf16(got.get(), want, "hadamard128" + ("+fp4" if fp4 else ""), seed, max_ulp=QSIM_MAX_ULP, rows=rows)
    K.hadamard128(xg, out=xg, fp4=fp4)
    assert cp.array_equal(xg, got), f"hadamard128 in place differs [seed={seed}]"


def test_hadamard_is_sylvester_natural_order():
    seed = fresh_seed()
    e = np.zeros((128, 128), np.float32)
    e[np.arange(128), np.arange(128)] = 1.0
    got = K.hadamard128(cp.asarray(bits_of(e))).get()
    H = O.hadamard_matrix(128) * 128 ** -0.5
    assert_bf16(got, bf16(H.astype(np.float32)), "hadamard rows of the identity", seed)


@pytest.mark.parametrize("T,H", [(3, 64), (5, 4)])
def test_rope_hadamard128_fp4(T, H):
    """The indexer q chain fp4_sim(hadamard(apply_rope(q)), 32): bit-identical."""
    from memra_dsv4.config import preset
    from memra_dsv4.host.rope import layer_cos_sin

    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(8192))
    pos = rng.integers(0, 8192, T).astype(np.int32)
    q = rand_bf16(rng, (T, H, 128), 1.0, spread=3)
    want = fp4_sim(O.hadamard(O.apply_rope(q, cos[pos][:, None, :], sin[pos][:, None, :])), 32)
    got = K.rope_hadamard128_fp4(cp.asarray(bits_of(q)), cp.asarray(pos), cp.asarray(cos), cp.asarray(sin))
    assert_bf16(got.get(), want, "rope+hadamard+fp4 (indexer q)", seed, max_ulp=QSIM_MAX_ULP, T=T, H=H)
