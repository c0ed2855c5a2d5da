"""host.pending: the pending-row state machine shared by the oracle and the GPU cache."""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.host.pending import advance_pending, cur_offset


def _fresh(ratio, d):
    coff = 2 if ratio == 4 else 1
    return (np.zeros((coff * ratio, coff * d), np.float32),
            np.full((coff * ratio, coff * d), -np.inf, np.float32))


@pytest.mark.parametrize("ratio", [4, 16])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 17, 33])
def test_any_chunking_gives_the_same_rows(ratio, n):
    rng = np.random.default_rng(ratio * 100 + n)
    coff = 2 if ratio == 4 else 1
    a = rng.standard_normal((n, coff * 8)).astype(np.float32)
    z = rng.standard_normal((n, coff * 8)).astype(np.float32)
    kv1, sc1 = _fresh(ratio, 8)
    advance_pending(kv1, sc1, a, z, 0, ratio)
    kv2, sc2 = _fresh(ratio, 8)
    p = 0
    for size in (1, 2, 3, 1, 5, 7, 11, 13):
        if p >= n:
            break
        advance_pending(kv2, sc2, a[p:p + size], z[p:p + size], p, ratio)
        p += size
    if p < n:
        advance_pending(kv2, sc2, a[p:], z[p:], p, ratio)
    assert np.array_equal(kv1, kv2) and np.array_equal(sc1, sc2)


@pytest.mark.parametrize("ratio", [4, 16])
def test_layout_current_previous_and_empty_rows(ratio):
    n = 2 * ratio + 1                     # two complete blocks and one token of the third
    coff = 2 if ratio == 4 else 1
    a = np.arange(n, dtype=np.float32)[:, None].repeat(coff * 2, 1) + 1
    z = -a
    kv, sc = _fresh(ratio, 2)
    advance_pending(kv, sc, a, z, 0, ratio)
    o = cur_offset(ratio)
    assert np.array_equal(kv[o], a[2 * ratio])            # the current block's one token
    assert np.all(kv[o + 1:o + ratio] == 0) and np.all(np.isneginf(sc[o + 1:o + ratio]))
    if ratio == 4:                                        # previous complete block = block 1
        assert np.array_equal(kv[:ratio], a[ratio:2 * ratio])
        assert np.array_equal(sc[:ratio], z[ratio:2 * ratio])
