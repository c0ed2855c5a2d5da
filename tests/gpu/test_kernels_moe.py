"""kernels_cu/moe.cu against oracle.ops.swiglu_clamped (stored to bf16) and oracle.ops.moe_combine.

Bounds: SwiGLU evaluates silu in double and the two f32 products of the twin: bit-identical up to
a last-bit difference of exp() meeting a rounding tie (SWIGLU_MAX_ULP on SWIGLU_MAX_FRAC);
combine: the twin's f32 accumulator in ascending expert id, bit-identical.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.formats import decode_bf16
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import moe as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

SWIGLU_MAX_ULP = 1
SWIGLU_MAX_FRAC = 1e-4


@pytest.mark.parametrize("S,I", [(6, 2048), (48, 2048), (2, 128), (1, 256)])
@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("weighted", [True, False])
def test_swiglu(S, I, limit, weighted):
    seed = fresh_seed()
    rng = rng_for(seed)
    gu = rand_bf16(rng, (S, 2 * I), 6.0, spread=2)              # values well beyond +-10 too
    gate, up = gu[:, :I], gu[:, I:]
    wt = (rng.random(S) * 1.5).astype(np.float32) if weighted else None
    want = O.BF16.store(O.swiglu_clamped(gate, up, limit, wt))
    # CuPy's NVRTC compiles with -ftz=true: an f32 intermediate below the smallest normal
    # (2^-126; e.g. silu of a very negative gate) flushes to zero before it is multiplied by
    # |up| <= 6*4 and the routing weight (seen on the H200: 4.8e-39 -> 0 and 1.9e-38 -> 0).  The
    # twin keeps subnormals; nothing in the model depends on values this small, so the test
    # flushes the twin's results below FTZ_FLOOR = 2^-126 * 2^8.
    # Both sides are compared with values below the floor flushed (the kernel keeps some such
    # values normal where the twin's are not, and the other way round).
    FTZ_FLOOR = np.float32(2.0 ** -118)
    want = np.where(np.abs(want) < FTZ_FLOOR, np.copysign(np.float32(0), want), want)
    gug = cp.asarray(bits_of(gu))                                # fused [S, 2I] buffer, halves as views
    got = K.swiglu(gug[:, :I], gug[:, I:], limit, cp.asarray(wt) if weighted else None)
    got = got.get()
    got_vals = decode_bf16(got)
    got = np.where(np.abs(got_vals) < FTZ_FLOOR, np.signbit(got_vals).astype(np.uint16) << 15, got)
    assert_bf16(got, want, "swiglu", seed, max_ulp=SWIGLU_MAX_ULP, max_frac=SWIGLU_MAX_FRAC,
                S=S, I=I, limit=limit, weighted=weighted)


@pytest.mark.parametrize("T,k,D,E", [(1, 6, 4096, 256), (37, 6, 4096, 256), (5, 2, 256, 8), (4, 4, 512, 16)])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_combine(T, k, D, E, with_shared):
    seed = fresh_seed()
    rng = rng_for(seed)
    routed = rand_bf16(rng, (T, k, D), 1.0, spread=6)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if T > 1 and k > 1:
        idx[1, 1] = idx[1, 0]                                     # equal ids keep pick order
    shared = rand_bf16(rng, (T, D), 1.0, spread=6)
    want = O.moe_combine(routed, idx, shared if with_shared else np.zeros((T, D), np.float32))
    got = K.combine(cp.asarray(bits_of(routed)), cp.asarray(idx), cp.asarray(bits_of(shared)) if with_shared else None)
    assert_bf16(got.get(), want, "moe combine", seed, T=T, k=k, D=D, shared=with_shared)
