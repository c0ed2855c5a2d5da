"""CPU checks of the chunk routine's host-lean attention (gpu.decode.ChunkBlock.fused):

* compressor.twin_chain_rms_rope, the NumPy transcription of chain_sq + mean + chain_rms_rope,
  equals the oracle's apply_rope(rmsnorm(.)) (bf16 class) bit for bit, with and without the
  store of the input (the compressor's rmsnorm(store(pooled))), on rows with zeros, -0, bf16
  rounding ties, tiny and huge scales;
* the aligned-chunk shortcut of compress_chunk (p0 % r == 0: A, Z = a, z's first nb*r rows, no
  copy) is what host.pending.closing_blocks returns for such a chunk, after any pending history.
The GPU halves (kernel == CuPy chain, the whole block fused == unfused) are in
tests/gpu/test_hostlean_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.gpu.ops.compressor import twin_chain_rms_rope
from memra_dsv4.host.pending import advance_pending, closing_blocks, cur_offset
from memra_dsv4.host.quant import round_bf16
from memra_dsv4.oracle import ops as O


def _rows(rng, n, D, bf16):
    x = (rng.standard_normal((n, D)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, ::3] = -0.0
    hi = rng.integers(0x3E00, 0x4200, D).astype(np.uint32) | (rng.integers(0, 2, D).astype(np.uint32) << 15)
    x[2] = ((hi << 16) | 0x8000).view(np.float32)        # bf16 ties (pre_store rounds them)
    x[3] = (rng.standard_normal(D) * 3e30).astype(np.float32)
    x[4] = 0.0
    x[4, 5] = 7.0
    return round_bf16(x).astype(np.float32) if bf16 else x


@pytest.mark.parametrize("n,D,P,pre_store", [(9, 512, 32, False), (12, 512, 32, True),
                                             (7, 128, 32, True), (6, 1536, 0, False),
                                             (8, 64, 8, False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_twin_chain_rms_rope_equals_oracle(n, D, P, pre_store, seed):
    rng = np.random.default_rng(seed)
    x = _rows(rng, n, D, bf16=not pre_store)
    w = round_bf16((1.0 + 0.02 * rng.standard_normal(D)).astype(np.float32)).astype(np.float32)
    w_bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    eps = 1e-6
    xin = round_bf16(x).astype(np.float32) if pre_store else x
    want = O.rmsnorm(xin, w, eps)
    cos = sin = None
    if P:
        ang = rng.uniform(-50, 50, (n, P))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        want = O.apply_rope(want, cos, sin)
    want_bits = (np.asarray(want, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert np.all((np.asarray(want, np.float32).view(np.uint32) & 0xFFFF) == 0)
    got = twin_chain_rms_rope(x, w_bits, eps, cos, sin, pre_store=pre_store)
    bad = np.flatnonzero(got.reshape(-1) != want_bits.reshape(-1))
    assert bad.size == 0, f"{bad.size} of {got.size} differ, first at {bad[0]}"


@pytest.mark.parametrize("r,coff", [(4, 2), (16, 1), (128, 1)])
def test_aligned_chunk_closing_rows_are_the_chunk_rows(r, coff):
    rng = np.random.default_rng(r)
    C = 8 * coff
    kv = np.zeros((coff * r, C), np.float32)
    score = np.full((coff * r, C), -np.inf, np.float32)
    p0 = 0
    for S in (3 * r + r // 2, r - r // 2, 2 * r):   # leaves pending rows, then realigns
        a = rng.standard_normal((S, C)).astype(np.float32)
        z = rng.standard_normal((S, C)).astype(np.float32)
        if p0 % r == 0:
            A, Z, nb, b0 = closing_blocks(kv, score, a, z, p0, r)
            assert (nb, b0) == (S // r, p0)
            assert np.array_equal(A, a[:nb * r]) and np.array_equal(Z, z[:nb * r])
            o = cur_offset(r)
            assert np.all(kv[o:o + r] == 0) and np.all(score[o:o + r] == -np.inf)
        advance_pending(kv, score, a, z, p0, r)
        p0 += S
    assert p0 % r == 0
