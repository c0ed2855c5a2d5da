"""kernels_cu/rope.cu against oracle.ops.apply_rope: bit-identical (ROPE_MAX_ULP = 0).

The kernel evaluates the rotation in double with the twin's operations and roundings, so every
element must match.  Tables come from host.rope (Flash YaRN layer and plain layer).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.config import preset  # noqa: E402
from memra_dsv4.gpu.ops import rope as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.host.rope import layer_cos_sin  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

ROPE_MAX_ULP = 0
N_POS = 65536


@pytest.fixture(scope="module")
def tables():
    cfg = preset("flash")
    out = {}
    for layer in (0, 2):  # plain (ratio 0) and YaRN (ratio 4)
        cos, sin = layer_cos_sin(cfg, layer, np.arange(N_POS))
        out[layer] = (cos, sin, cp.asarray(cos), cp.asarray(sin))
    return out


@pytest.mark.parametrize("shape", [(5, 64, 512), (1, 64, 512), (7, 512), (3, 64, 128), (4, 4, 128)])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(tables, shape, layer, inverse):
    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin, cos_g, sin_g = tables[layer]
    T = shape[0]
    pos = rng.integers(0, N_POS, size=T).astype(np.int32)
    pos[0] = 0
    if T > 2:
        pos[1], pos[2] = 127, N_POS - 1
    x = rand_bf16(rng, shape, 1.0, spread=4)
    c, s = cos[pos], sin[pos]
    if len(shape) == 3:
        c, s = c[:, None, :], s[:, None, :]
    want = O.apply_rope(x, c, s, inverse)
    xg = cp.asarray(bits_of(x))
    K.rope(xg, cp.asarray(pos), cos_g, sin_g, inverse=inverse)
    assert_bf16(xg.get(), want, "rope", seed, max_ulp=ROPE_MAX_ULP, shape=shape, layer=layer, inverse=inverse)


def test_rope_roundtrip_is_close(tables):
    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin, cos_g, sin_g = tables[2]
    x = rand_bf16(rng, (6, 64, 512), 1.0)
    pos = cp.asarray(rng.integers(0, N_POS, size=6).astype(np.int32))
    xg = cp.asarray(bits_of(x))
    K.rope(xg, pos, cos_g, sin_g)
    K.rope(xg, pos, cos_g, sin_g, inverse=True)
    back = (xg.get().astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(back[..., :448], x[..., :448]), f"rope touched the nope dims [seed={seed}]"
    assert np.allclose(back, x, rtol=2 ** -6, atol=2 ** -6), f"rope inverse does not undo forward [seed={seed}]"
