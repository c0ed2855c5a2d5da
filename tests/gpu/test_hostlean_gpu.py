"""The chunk routine's host-lean attention (gpu.decode.ChunkBlock.fused, branch hostlean) is the
SAME BITS as the CuPy chains it replaced, which stay callable (ops_glue.rmsnorm / rope / kv_sim /
fp4_sim / compress_pool / compress_candidates, and ChunkBlock.fused = False for the whole block):

* ops_glue.rmsnorm_rope_bits (compressor.cu chain_sq + cupy.mean + chain_rms_rope) against
  store(rope(rmsnorm(.))) [with store(x) first], rows with zeros, f32 subnormals, bf16 rounding
  ties, large and tiny scales;
* compressor.cu's pool kernels against compress_candidates / candidates_with_prev +
  compress_pool (scores with -inf, equal scores, large spreads);
* quant_sim.cu's kv_fp8_sim / fp4_sim on the bits against ops_glue.kv_sim / fp4_sim on the
  bf16-valued f32 (zeros, -0, bf16 subnormals, blocks under the amax floor, e4m3 / e2m1 ties,
  saturation);
* compress_add_ape against (zg + ape[pos % r]).astype(f32);
* end to end: tiny and small prefills with captures, a chunk at an unaligned position (pending
  rows, closing_blocks), a verify + commit (journal) and the chunk after it: logits, captures and
  every cache byte equal between fused = False and fused = True.
Inputs are finite: the chains' own contract (ops_glue._ue8m0: "amax > 0 finite").  One
documented degenerate case is not generated: a pooled channel whose every candidate term is -0
(all kv -0) pools to +0 in the chain (0 + -0) and to -0 in the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu import ops_glue as G  # noqa: E402
from memra_dsv4.gpu.decode import ChunkBlock, candidates_with_prev  # noqa: E402
from memra_dsv4.gpu.ops import compressor as CM  # noqa: E402
from memra_dsv4.gpu.ops import quant_sim as QS  # noqa: E402
from memra_dsv4.gpu.ops.testing import fresh_seed, rng_for  # noqa: E402

pytestmark = pytest.mark.gpu


def _same(got, want, what: str, seed: int):
    got, want = cp.asnumpy(got), cp.asnumpy(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape} (seed {seed})")
    g = np.ascontiguousarray(got).view(np.uint8).reshape(got.size, -1) if got.size else got
    w = np.ascontiguousarray(want).view(np.uint8).reshape(want.size, -1) if want.size else want
    bad = np.flatnonzero(np.any(g != w, axis=-1)) if got.size else []
    assert len(bad) == 0, (f"{what}: {len(bad)} of {got.size} elements differ (seed {seed}); "
                           f"first at {np.unravel_index(bad[0], got.shape)}: "
                           f"{got.reshape(-1)[bad[0]]!r} vs {want.reshape(-1)[bad[0]]!r}")


def _bf16_valued(x):
    return cp.asnumpy(G.store(cp.asarray(x, dtype=cp.float32)))


def _edge_rows(rng, n: int, D: int, bf16: bool) -> np.ndarray:
    """n rows of width D: random scales per row, plus rows of zeros, f32 subnormals, bf16 ties
    (low 16 bits 0x8000, odd and even), huge and tiny values, and a one-hot row."""
    x = (rng.standard_normal((n, D)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(np.float32)
    x[0] = 0.0
    if n > 1:
        x[1, ::3] = -0.0
    if n > 2:
        x[2] = np.float32(1e-41) * rng.integers(-50, 50, D)      # f32 subnormals
    if n > 3:
        hi = rng.integers(0x3E00, 0x4200, D).astype(np.uint32) | (rng.integers(0, 2, D).astype(np.uint32) << 15)
        x[3] = ((hi << 16) | 0x8000).view(np.float32)              # exact bf16 ties, odd and even
    if n > 4:
        x[4] = (rng.standard_normal(D) * 3e30).astype(np.float32)
    if n > 5:
        x[5] = 0.0
        x[5, rng.integers(0, D)] = 7.0
    if n > 6:
        x[6, : D // 2] = np.float32(2.0 ** -130)
    return _bf16_valued(x) if bf16 else x


@pytest.mark.parametrize("n,D,P,pre_store", [(9, 512, 32, False), (40, 512, 32, True),
                                             (17, 128, 32, True), (33, 128, 8, False),
                                             (12, 1536, 0, False), (7, 64, 0, True)])
def test_rmsnorm_rope_bits_equals_chain(n, D, P, pre_store):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = cp.asarray(_edge_rows(rng, n, D, bf16=not pre_store))
    w = G.bf16_bits(cp.asarray((1.0 + 0.02 * rng.standard_normal(D)).astype(np.float32)))
    eps = 1e-6
    xin = G.store(x) if pre_store else x
    want = G.rmsnorm(xin, G.to_f32(w).astype(cp.float64), eps)
    cos = sin = None
    if P:
        ang = rng.uniform(-50, 50, (n, P))
        cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
        want = G.rope(want, cos, sin)
    got = G.rmsnorm_rope_bits(x, w, eps, cos, sin, pre_store=pre_store)
    _same(got, G.bf16_bits(want), f"rmsnorm_rope_bits n={n} D={D} P={P} pre_store={pre_store}",
          seed)


def _scores(rng, rows, C, step):
    """Scores with -inf here and there, never in rows 0, step, 2 step, ...: every entry keeps a
    finite candidate (an all -inf channel is NaN in both, with unspecified NaN bits)."""
    z = (rng.standard_normal((rows, C)) * rng.choice([0.5, 4.0, 30.0, 300.0], (rows, 1))).astype(np.float32)
    z[rng.random((rows, C)) < 0.05] = -np.inf
    z[::step] = rng.standard_normal((len(range(0, rows, step)), C)).astype(np.float32)
    z[:, :3] = 1.25                                   # equal scores across candidates
    return z


@pytest.mark.parametrize("nb,d,with_prev", [(1, 512, True), (5, 512, False), (33, 128, True),
                                            (3, 128, False)])
def test_pool_overlap_equals_chain(nb, d, with_prev):
    seed = fresh_seed()
    rng = rng_for(seed)
    a = cp.asarray((rng.standard_normal((4 * nb, 2 * d)) * 2).astype(np.float32))
    z = cp.asarray(_scores(rng, 4 * nb, 2 * d, 4))
    if with_prev:
        pa = cp.asarray(rng.standard_normal((4, 2 * d)).astype(np.float32))
        pz = cp.asarray(_scores(rng, 4, 2 * d, 4))
        want = G.compress_pool(*candidates_with_prev(a, z, pa, pz))
        got = CM.pool_overlap(a, z, nb, prev_kv=pa, prev_score=pz)
    else:
        want = G.compress_pool(*G.compress_candidates(a, z, 4))
        got = CM.pool_overlap(a, z, nb)
    _same(got, want, f"pool_overlap nb={nb} d={d} prev={with_prev}", seed)


@pytest.mark.parametrize("nb,d,r", [(1, 512, 128), (3, 512, 128), (7, 128, 16), (2, 64, 8)])
def test_pool_plain_equals_chain(nb, d, r):
    seed = fresh_seed()
    rng = rng_for(seed)
    a = cp.asarray((rng.standard_normal((r * nb, d)) * 2).astype(np.float32))
    z = cp.asarray(_scores(rng, r * nb, d, r))
    want = G.compress_pool(*G.compress_candidates(a, z, r))
    _same(CM.pool_plain(a, z, r, nb), want, f"pool_plain nb={nb} d={d} r={r}", seed)


def _sim_rows(rng, n, D, fp4: bool) -> np.ndarray:
    x = _edge_rows(rng, n, D, bf16=True)
    q = 6.0 if fp4 else 448.0
    # a row of values at the grid's ties once divided by the block scale (s = 1 for amax = q)
    grid = np.array([0.25, 0.75, 1.25, 2.5, 3.5, 5.0] if fp4 else
                    [0.0029296875, 1.0625, 2.125, 9.5, 19.0, 104.0, 208.0, 432.0], np.float32)
    if n > 7:
        x[7] = rng.choice(np.concatenate([grid, -grid]), D)
        x[7, ::32] = q
    if n > 8:
        x[8] = _bf16_valued(rng.standard_normal(D).astype(np.float32) * 1e-6)   # under the floor
    return x


@pytest.mark.parametrize("n,D,rope", [(11, 512, 64), (37, 128, 64), (10, 192, 0)])
def test_kv_fp8_sim_bits_equals_chain(n, D, rope):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = cp.asarray(_sim_rows(rng, n, D, fp4=False))
    want = G.kv_sim(x, rope)
    _same(QS.kv_fp8_sim(G.bf16_bits(x), rope), G.bf16_bits(want), f"kv_fp8_sim D={D}", seed)


@pytest.mark.parametrize("n,D", [(11, 128), (40, 128), (9, 64)])
def test_fp4_sim_bits_equals_chain(n, D):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = cp.asarray(_sim_rows(rng, n, D, fp4=True))
    want = G.fp4_sim(x, 32)
    _same(QS.fp4_sim(G.bf16_bits(x)), G.bf16_bits(want), f"fp4_sim D={D}", seed)


def test_add_ape_equals_chain():
    seed = fresh_seed()
    rng = rng_for(seed)
    S, C, r, p0 = 45, 1024, 4, 13
    zg = cp.asarray((rng.standard_normal((S, C)) * 10.0 ** rng.uniform(-3, 3, (S, 1))).astype(np.float32))
    ape = cp.asarray((rng.standard_normal((r, C)) * 0.02).astype(np.float32))
    pos = cp.arange(p0, p0 + S, dtype=cp.int64)
    want = (zg + ape[pos % r]).astype(cp.float32)
    got = CM.add_ape(zg.copy(), ape, cp.arange(p0, p0 + S, dtype=cp.int32))
    _same(got, want, "add_ape", seed)


# ------------------------------------------------------------------------------- end to end
def _model(name):
    from memra_dsv4.checkpoint import Checkpoint
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.synth import synth_arrays
    cfg = preset(name)
    return Dsv4Gpu.load(Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=3)), devices=(0,))


def _cache_bytes(state) -> dict:
    out = {}
    for c in state.layers:
        for attr in ("kv", "idx_keys"):
            a = getattr(c, attr, None)
            if a is not None:
                out[f"{c.layer_id}.{attr}"] = cp.asnumpy(a)
        for attr in ("comp_state", "idx_state"):
            p = getattr(c, attr, None)
            if p is not None:
                out[f"{c.layer_id}.{attr}.kv"] = cp.asnumpy(p.kv)
                out[f"{c.layer_id}.{attr}.score"] = cp.asnumpy(p.score)
    return out


def _run(m, ids, fused: bool):
    """Everything the chunk routine produces for ``ids`` with ChunkBlock.fused = ``fused``."""
    old = ChunkBlock.fused
    ChunkBlock.fused = fused
    try:
        res = {}
        out = m.forward(ids, capture=True)
        res["forward.logits"] = out.logits
        res["forward.hc_state"] = out.hc_state
        for i, c in enumerate(out.captures):
            for k, v in c.items():
                res[f"forward.block{i}.{k}"] = np.asarray(v)
        for k, v in out.captures_top.items():
            res[f"forward.top.{k}"] = np.asarray(v)
        state = m.new_state(max_seq_len=4 * len(ids))
        cut = 7   # not a multiple of 4 (CSA) nor of the HCA ratio: pending rows, closing_blocks
        res["prefill.logits"], _ = m.prefill(ids[:cut], state, all_logits=True)
        res["chunk.logits"] = m.prefill_chunk(state, ids[cut:], all_logits=True)
        res["verify.logits"] = m.verify(state, [ids[-1], ids[2], ids[5], ids[1]])
        m.commit(state, 2)
        res["after.logits"] = m.prefill_chunk(state, ids[3:9], all_logits=True)
        res.update({f"cache.{k}": v for k, v in _cache_bytes(state).items()})
        return res
    finally:
        ChunkBlock.fused = old


@pytest.mark.parametrize("name,length", [("tiny", 45), ("small", 70)])
def test_chunk_routine_fused_equals_chain(name, length):
    seed = fresh_seed()
    rng = rng_for(seed)
    m = _model(name)
    ids = [int(t) for t in rng.integers(0, m.config.vocab_size, length)]
    ref = _run(m, ids, fused=False)
    got = _run(m, ids, fused=True)
    assert sorted(got) == sorted(ref), "the two paths produced different outputs"
    assert any(k.endswith("attn.comp") for k in ref), "no compressed entries exercised"
    for k in sorted(ref):
        _same(got[k], ref[k], f"{name}: {k}", seed)
