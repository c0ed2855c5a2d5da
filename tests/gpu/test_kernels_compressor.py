"""kernels_cu/compressor.cu against oracle.ops.compress_candidates + compress_pool,
compress_entry_postprocess and the main KV path (rmsnorm -> apply_rope -> kv_fp8_sim).

Bounds:
* add_ape: one f32 add, bit-identical;
* pooling: double softmax in the twin's candidate order, one f32 rounding: POOL_MAX_ULP f32 ulp
  (a difference needs a last-bit difference of exp() AND a rounding tie);
* decode emit == prefill entry: bitwise (the same routine on the same values);
* post-processing: expected bit-identical; a statistics tie could move one bf16 value by 1 ulp,
  which the FP8/FP4 simulation can turn into one grid step (NRS_MAX_ULP), on at most NRS_MAX_FRAC.
Boundary cases: block 0 (previous slots -inf), entries with a given predecessor (decode /
chunked prefill), Flash d = 512 / ratio 128 and tiny d = 128 / ratio 16.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.config import preset  # noqa: E402
from memra_dsv4.gpu.ops import compressor as K  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, assert_f32, bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.host.quant import kv_fp8_sim  # noqa: E402
from memra_dsv4.host.rope import layer_cos_sin  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

POOL_MAX_ULP = 1
POOL_MAX_FRAC = 1e-4
NRS_MAX_ULP = 16
NRS_MAX_FRAC = 1e-4
EPS = 1e-6


def _proj(rng, rows, C):
    a = (rng.standard_normal((rows, C)) * 2).astype(np.float32)
    z = (rng.standard_normal((rows, C)) * rng.choice([0.5, 4.0, 30.0], size=(rows, 1))).astype(np.float32)
    return a, z


def test_add_ape():
    seed = fresh_seed()
    rng = rng_for(seed)
    T, C, r = 37, 1024, 4
    z = rng.standard_normal((T, C)).astype(np.float32)
    ape = rng.standard_normal((r, C)).astype(np.float32)
    pos = (rng.integers(0, 10000, T)).astype(np.int32)
    zg = cp.asarray(z)
    K.add_ape(zg, cp.asarray(ape), cp.asarray(pos))
    assert_f32(zg.get(), z + ape[pos % r], "add_ape", seed)


@pytest.mark.parametrize("nb,d", [(1, 512), (5, 512), (33, 128), (2, 128)])
def test_pool_overlap_prefill_and_decode(nb, d):
    seed = fresh_seed()
    rng = rng_for(seed)
    a, z = _proj(rng, 4 * nb, 2 * d)
    want = O.compress_pool(*O.compress_candidates(a, z, 4))
    ag, zg = cp.asarray(a), cp.asarray(z)
    got = K.pool_overlap(ag, zg, nb)
    assert_f32(got.get(), want, "pool_overlap prefill", seed, max_ulp=POOL_MAX_ULP, max_frac=POOL_MAX_FRAC, nb=nb, d=d)
    # decode: the pending state [8, 2d] (rows 0..3 previous block, 4..7 this block) emits entry k
    for k in sorted({0, nb - 1, nb // 2}):
        st_a = np.zeros((8, 2 * d), np.float32)
        st_z = np.full((8, 2 * d), -np.inf, np.float32)
        if k > 0:
            st_a[:4], st_z[:4] = a[4 * k - 4:4 * k], z[4 * k - 4:4 * k]
        st_a[4:], st_z[4:] = a[4 * k:4 * k + 4], z[4 * k:4 * k + 4]
        sa, sz = cp.asarray(st_a), cp.asarray(st_z)
        one = K.pool_overlap(sa[4:8], sz[4:8], 1, prev_kv=sa[0:4], prev_score=sz[0:4])
        assert cp.array_equal(one[0], got[k]), f"pool_overlap: decode emit of entry {k} != prefill [seed={seed}]"


def test_pool_overlap_with_predecessor():
    seed = fresh_seed()
    rng = rng_for(seed)
    nb, d = 3, 512
    a, z = _proj(rng, 4 * nb, 2 * d)
    pa, pz = _proj(rng, 4, 2 * d)
    want = O.compress_pool(*O.compress_candidates(a, z, 4, prev_a=pa, prev_z=pz))
    got = K.pool_overlap(cp.asarray(a), cp.asarray(z), nb, prev_kv=cp.asarray(pa), prev_score=cp.asarray(pz))
    assert_f32(got.get(), want, "pool_overlap with predecessor", seed, max_ulp=POOL_MAX_ULP, max_frac=POOL_MAX_FRAC)


@pytest.mark.parametrize("nb,d,r", [(3, 512, 128), (1, 512, 128), (4, 128, 16), (2, 512, 32)])
def test_pool_plain_prefill_and_decode(nb, d, r):
    seed = fresh_seed()
    rng = rng_for(seed)
    a, z = _proj(rng, r * nb, d)
    want = O.compress_pool(*O.compress_candidates(a, z, r))
    got = K.pool_plain(cp.asarray(a), cp.asarray(z), r, nb)
    assert_f32(got.get(), want, "pool_plain", seed, max_ulp=POOL_MAX_ULP, max_frac=POOL_MAX_FRAC, nb=nb, d=d, r=r)
    k = nb - 1
    one = K.pool_plain(cp.asarray(a[k * r:(k + 1) * r].copy()), cp.asarray(z[k * r:(k + 1) * r].copy()), r, 1)
    assert cp.array_equal(one[0], got[k]), f"pool_plain: decode emit != prefill [seed={seed}]"


@pytest.fixture(scope="module")
def yarn_table():
    cos, sin = layer_cos_sin(preset("flash"), 2, np.arange(65536))
    return cos, sin, cp.asarray(cos), cp.asarray(sin)


@pytest.mark.parametrize("n,d,mode,r", [(5, 512, "fp8", 4), (3, 512, "fp8", 128), (7, 128, "hadfp4", 4),
                                        (4, 128, "fp8", 16), (1, 512, "fp8", 4)])
def test_entry_postprocess(yarn_table, n, d, mode, r):
    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin, cos_g, sin_g = yarn_table
    pooled = (rng.standard_normal((n, d)) * 1.5).astype(np.float32)
    w = bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0)
    pos = (np.arange(n) * r + r * rng.integers(0, 100)).astype(np.int32)
    want = O.compress_entry_postprocess(pooled, w, cos[pos], sin[pos], rope_dim=64, rotate=(mode == "hadfp4"), eps=EPS)
    got = K.norm_rope_sim(cp.asarray(pooled), cp.asarray(w), EPS, cos_g, sin_g, cp.asarray(pos), mode)
    assert_bf16(got.get(), want, "entry post-process", seed, max_ulp=NRS_MAX_ULP, max_frac=NRS_MAX_FRAC,
                n=n, d=d, mode=mode)
    # written straight into rows of a cache (row-strided view)
    cache = cp.zeros((n + 3, d), dtype=cp.uint16)
    K.norm_rope_sim(cp.asarray(pooled), cp.asarray(w), EPS, cos_g, sin_g, cp.asarray(pos), mode, out=cache[2:2 + n])
    assert cp.array_equal(cache[2:2 + n], got) and not cache[:2].any() and not cache[2 + n:].any(), (
        f"norm_rope_sim into a cache view [seed={seed}]")


@pytest.mark.parametrize("T,d", [(9, 512), (1, 512), (6, 128)])
def test_main_kv_path(yarn_table, T, d):
    seed = fresh_seed()
    rng = rng_for(seed)
    cos, sin, cos_g, sin_g = yarn_table
    x = rand_bf16(rng, (T, d), 1.0, spread=2)
    w = bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0)
    pos = rng.integers(0, 65536, T).astype(np.int32)
    c = O.rmsnorm(x, w, EPS)
    c = O.apply_rope(c, cos[pos], sin[pos])
    want = kv_fp8_sim(c, 64)
    got = K.norm_rope_sim(cp.asarray(bits_of(x)), cp.asarray(w), EPS, cos_g, sin_g, cp.asarray(pos), "fp8")
    assert_bf16(got.get(), want, "kv path (norm, rope, fp8 sim)", seed, max_ulp=NRS_MAX_ULP, max_frac=NRS_MAX_FRAC,
                T=T, d=d)


# ------------------------------------------------------------------- decode emit gate / row modes
@pytest.mark.parametrize("r", [4, 128])
def test_emit_gate_pool(r):
    """pool_* with emit_gate=(pos, r): nothing written unless (pos + 1) % r == 0, then exactly
    the ungated result (the device step's compressor emission)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    d = 512
    if r == 4:
        a, z = _proj(rng, 8, 2 * d)
        kv, sc = cp.asarray(a), cp.asarray(z)
        run = lambda out, g: K.pool_overlap(kv[4:8], sc[4:8], 1, out=out, prev_kv=kv[:4],  # noqa: E731
                                            prev_score=sc[:4], emit_gate=g)
    else:
        a, z = _proj(rng, r, d)
        kv, sc = cp.asarray(a), cp.asarray(z)
        run = lambda out, g: K.pool_plain(kv, sc, r, 1, out=out, emit_gate=g)  # noqa: E731
    want = run(cp.empty((1, d), cp.float32), None)
    for p in (0, r - 2, r - 1, r, 2 * r - 1, 5 * r + 1):
        out = cp.full((1, d), 7.0, cp.float32)
        run(out, (cp.asarray([p], dtype=cp.int32), r))
        if (p + 1) % r == 0:
            assert cp.array_equal(out, want), f"gate open at pos {p}, r {r}: result differs [seed={seed}]"
        else:
            assert bool((out == 7.0).all()), f"gate closed at pos {p}, r {r}: output written [seed={seed}]"


@pytest.mark.parametrize("mode", ["entry", "ring"])
def test_norm_rope_row_modes(yarn_table, mode):
    """norm_rope_sim(row='entry'): gated, the row lands in compressed row (pos + 1) / r - 1 (none
    past the cache); row='ring': every pos, row pos % W.  The row equals the ungated result."""
    seed = fresh_seed()
    rng = rng_for(seed)
    _, _, cos_g, sin_g = yarn_table
    d, r, W, N = 512, 4, 128, 6
    x = (rng.standard_normal((1, d)) * 1.5).astype(np.float32)
    w = cp.asarray(bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0))
    xg = cp.asarray(x)
    for p in (0, 2, 3, 7, 23, 27, 126, 127, 128, 300):
        rpos = cp.asarray([p], dtype=cp.int32)
        want = K.norm_rope_sim(xg, w, EPS, cos_g, sin_g, rpos, "fp8")
        rows = N if mode == "entry" else W
        cache = cp.full((rows, d), 0x1234, dtype=cp.uint16)
        gate = (cp.asarray([p], dtype=cp.int32), r if mode == "entry" else W)
        K.norm_rope_sim(xg, w, EPS, cos_g, sin_g, rpos, "fp8", out=cache, emit_gate=gate, row=mode)
        if mode == "ring":
            target = p % W
        else:
            target = (p + 1) // r - 1 if (p + 1) % r == 0 and (p + 1) // r - 1 < N else None
        for i in range(rows):
            if i == target:
                assert cp.array_equal(cache[i], want[0]), f"{mode} pos {p}: row {i} [seed={seed}]"
            else:
                assert bool((cache[i] == 0x1234).all()), f"{mode} pos {p}: row {i} touched [seed={seed}]"


@pytest.mark.parametrize("T,p0", [(8, 120), (8, 0), (2, 127), (5, 1000)])
def test_norm_rope_ring_rows(yarn_table, T, p0):
    """row='ring' with T rows (the device verify's kv rows, one launch): row t lands in slot
    (p0 + t) % W with the bytes of its one-row launch; other slots untouched."""
    seed = fresh_seed()
    rng = rng_for(seed)
    _, _, cos_g, sin_g = yarn_table
    d, W = 512, 128
    x = cp.asarray((rng.standard_normal((T, d)) * 1.5).astype(np.float32))
    w = cp.asarray(bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0))
    pos = cp.asarray(np.arange(p0, p0 + T, dtype=np.int32))
    want = cp.full((W, d), 0x1234, dtype=cp.uint16)
    for t in range(T):
        K.norm_rope_sim(x[t:t + 1], w, EPS, cos_g, sin_g, pos[t:t + 1], "fp8", out=want,
                        emit_gate=(pos[t:t + 1], W), row="ring")
    got = cp.full((W, d), 0x1234, dtype=cp.uint16)
    K.norm_rope_sim(x, w, EPS, cos_g, sin_g, pos, "fp8", out=got, emit_gate=(pos, W), row="ring")
    assert cp.array_equal(got, want), f"ring rows T {T} p0 {p0}: differ from one-row launches [seed={seed}]"
    touched = {(p0 + t) % W for t in range(T)}
    assert all(bool((got[i] == 0x1234).all()) for i in range(W) if i not in touched)


def test_norm_rope_row_mode_refusals(yarn_table):
    _, _, cos_g, sin_g = yarn_table
    x, w = cp.zeros((1, 512), cp.float32), cp.ones(512, cp.float32)
    pos = cp.zeros(1, cp.int32)
    with pytest.raises(AssertionError, match="needs emit_gate"):
        K.norm_rope_sim(x, w, EPS, cos_g, sin_g, pos, "fp8", out=cp.zeros((8, 512), cp.uint16),
                        row="entry")
    with pytest.raises(AssertionError, match="ring of 8 rows"):
        K.norm_rope_sim(x, w, EPS, cos_g, sin_g, pos, "fp8", out=cp.zeros((8, 512), cp.uint16),
                        emit_gate=(pos, 128), row="ring")
    with pytest.raises(AssertionError, match="one row"):   # entry rows: one at a time
        K.norm_rope_sim(cp.zeros((2, 512), cp.float32), w, EPS, cos_g, sin_g, cp.zeros(2, cp.int32), "fp8",
                        out=cp.zeros((8, 512), cp.uint16), emit_gate=(cp.zeros(2, cp.int32), 4), row="entry")
    with pytest.raises(AssertionError, match="emit_gate.pos: shape"):   # a position per ring row
        K.norm_rope_sim(cp.zeros((2, 512), cp.float32), w, EPS, cos_g, sin_g, cp.zeros(2, cp.int32), "fp8",
                        out=cp.zeros((128, 512), cp.uint16), emit_gate=(pos, 128), row="ring")
    with pytest.raises(AssertionError, match="row 'bogus'"):
        K.norm_rope_sim(x, w, EPS, cos_g, sin_g, pos, "fp8", row="bogus")


# ------------------------------------------------------------------- decode emission in one launch
# compress_emit_* == compress_pool_{overlap,plain} (emit_gate) + norm_rope_sim(row="entry",
# rope position pos + 1 - r) + ops_decode.pending_advance, byte for byte: the compressed cache
# (every row, guard rows included), the pending kv and score rows, gate closed or open, past the
# cache's last row, and over a run of consecutive tokens (the pending state machine).
EMIT_CASES = [  # d, mode, ratio, overlap: Flash main CSA / HCA, Flash indexer, a tiny plain one
    (512, "fp8", 4, True), (512, "fp8", 128, False), (128, "hadfp4", 4, True), (128, "fp8", 16, False),
]


def _emit_reference(pos, kv, sc, r, ovl, w, cos_g, sin_g, mode, cache):
    """The three launches the device step made before compress_emit (step_device._compress)."""
    from memra_dsv4.gpu import ops_decode as DK
    d = kv.shape[1] // 2 if ovl else kv.shape[1]
    pooled = cp.empty((1, d), cp.float32)
    gate = (pos, r)
    if ovl:
        K.pool_overlap(kv[r:2 * r], sc[r:2 * r], 1, out=pooled, prev_kv=kv[:r], prev_score=sc[:r], emit_gate=gate)
    else:
        K.pool_plain(kv, sc, r, 1, out=pooled, emit_gate=gate)
    kpos = cp.maximum(pos + 1 - r, 0).astype(cp.int32)  # step_scalars' aux[1 + i]
    K.norm_rope_sim(pooled, w, EPS, cos_g, sin_g, kpos, mode, out=cache, emit_gate=gate, row="entry")
    DK.pending_advance(pos, kv, sc, r, ovl)


def _rand_state(rng, r, ovl, d):
    rows, C = (2 if ovl else 1) * r, (2 if ovl else 1) * d
    a, z = _proj(rng, rows, C)
    z[rng.random(rows) < 0.2] = -np.inf  # fresh (advanced) rows: score -inf, kv 0
    return a, z


@pytest.mark.parametrize("d,mode,r,ovl", EMIT_CASES)
def test_compress_emit_equals_three_launches(yarn_table, d, mode, r, ovl):
    seed = fresh_seed()
    rng = rng_for(seed)
    _, _, cos_g, sin_g = yarn_table
    w = cp.asarray(bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0))
    N = 6
    for p in sorted({0, r - 2, r - 1, 2 * r - 1, N * r - 1, (N + 1) * r - 1, 3 * r, int(rng.integers(0, 60000))}):
        if p < 0:
            continue
        a, z = _rand_state(rng, r, ovl, d)
        cache0 = rng.integers(0, 65536, (N + 2, d)).astype(np.uint16)  # rows 1..N: the cache view
        pos = cp.asarray(np.array([p], np.int32))
        kv_w, sc_w, cache_w = cp.asarray(a), cp.asarray(z), cp.asarray(cache0)
        _emit_reference(pos, kv_w, sc_w, r, ovl, w, cos_g, sin_g, mode, cache_w[1:N + 1])
        kv_g, sc_g, cache_g = cp.asarray(a), cp.asarray(z), cp.asarray(cache0)
        K.emit(pos, kv_g, sc_g, r, ovl, w, EPS, cos_g, sin_g, mode, cache_g[1:N + 1])
        ctx = f"[seed={seed}] d={d} mode={mode} r={r} ovl={ovl} pos={p}"
        assert cp.array_equal(cache_g, cache_w), f"emit: compressed cache differs {ctx}"
        assert np.array_equal(kv_g.get().view(np.uint32), kv_w.get().view(np.uint32)), f"emit: pending kv {ctx}"
        assert np.array_equal(sc_g.get().view(np.uint32), sc_w.get().view(np.uint32)), f"emit: pending score {ctx}"
        opened = (p + 1) % r == 0
        if not opened:  # non-vacuity: the closed gate really left everything alone
            assert cp.array_equal(cache_g, cp.asarray(cache0)) and cp.array_equal(kv_g, cp.asarray(a)), ctx
        elif (p + 1) // r - 1 < N:  # ... and the open one wrote the row
            assert not cp.array_equal(cache_g[(p + 1) // r], cp.asarray(cache0[(p + 1) // r])), ctx


@pytest.mark.parametrize("d,mode,r,ovl", EMIT_CASES)
def test_compress_emit_state_machine(yarn_table, d, mode, r, ovl):
    """Consecutive tokens from a fresh state: write this token's pending row, then emit; the
    one-launch path and the three-launch path keep identical pending states and caches.  A third
    path hands the row to the emission (emit(incoming=): the device verify's staging rows)
    instead of writing it first: the same bytes."""
    from memra_dsv4.gpu import ops_decode as DK
    seed = fresh_seed()
    rng = rng_for(seed)
    _, _, cos_g, sin_g = yarn_table
    w = cp.asarray(bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0))
    rows, C = (2 if ovl else 1) * r, (2 if ovl else 1) * d
    N = 5
    fresh_kv, fresh_sc = np.zeros((rows, C), np.float32), np.full((rows, C), -np.inf, np.float32)
    paths = [[cp.asarray(fresh_kv), cp.asarray(fresh_sc), cp.zeros((N, d), cp.uint16)] for _ in range(3)]
    for p in range(min(N * r + r // 2 + 1, 3 * r + 3) if r > 16 else N * r + 3):
        a, z = _proj(rng, 1, C)
        pos = cp.asarray(np.array([p], np.int32))
        for kv, sc, _ in paths[:2]:
            DK.pending_write(pos, cp.asarray(a[0]), cp.asarray(z[0]), kv, sc, r, ovl)
        _emit_reference(pos, paths[0][0], paths[0][1], r, ovl, w, cos_g, sin_g, mode, paths[0][2])
        K.emit(pos, paths[1][0], paths[1][1], r, ovl, w, EPS, cos_g, sin_g, mode, paths[1][2])
        K.emit(pos, paths[2][0], paths[2][1], r, ovl, w, EPS, cos_g, sin_g, mode, paths[2][2],
               incoming=(cp.asarray(a[0]), cp.asarray(z[0])))
        for j in (1, 2):
            for i, what in enumerate(("kv", "score", "cache")):
                x, y = paths[j][i].get(), paths[0][i].get()
                assert np.array_equal(x.view(np.uint32 if x.itemsize == 4 else np.uint16),
                                      y.view(np.uint32 if y.itemsize == 4 else np.uint16)), (
                    f"emit state machine (path {j}): {what} differs after pos {p} [seed={seed}] "
                    f"d={d} r={r} ovl={ovl}")
    assert paths[1][2].any(), f"no entry emitted [seed={seed}]"


@pytest.mark.parametrize("d,mode,r,ovl", EMIT_CASES)
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_compress_emit_rows_equals_row_launches(yarn_table, d, mode, r, ovl, T):
    """emit_rows (the device verify's T rows through a compressor in one launch) == T emit
    launches with incoming rows, byte for byte: pending rows and the compressed cache, from
    states reached by real tokens, at start positions whose T rows cross zero, one or two
    emits (and past the cache's last row)."""
    from memra_dsv4.gpu import ops_decode as DK
    seed = fresh_seed()
    rng = rng_for(seed)
    _, _, cos_g, sin_g = yarn_table
    w = cp.asarray(bf16(rng.standard_normal(d).astype(np.float32) * 0.3 + 1.0))
    rows, C = (2 if ovl else 1) * r, (2 if ovl else 1) * d
    N = 6
    starts = sorted({0, r - T if r >= T else 0, r - 1, 2 * r - 2, N * r - 1, int(rng.integers(0, 3 * r + 1))})
    for p0 in starts:
        kv0, sc0 = cp.zeros((rows, C), cp.float32), cp.full((rows, C), -np.inf, cp.float32)
        for p in range(p0):   # the state p0 real tokens leave (the pending state machine)
            a, z = _proj(rng, 1, C)
            DK.pending_write(cp.asarray(np.array([p], np.int32)), cp.asarray(a[0]), cp.asarray(z[0]), kv0, sc0, r, ovl)
            if (p + 1) % r == 0:
                DK.pending_advance(cp.asarray(np.array([p], np.int32)), kv0, sc0, r, ovl)
        cache0 = rng.integers(0, 65536, (N + 2, d)).astype(np.uint16)
        a, z = _proj(rng, 8, C)
        kin, zin = cp.asarray(a), cp.asarray(z)
        pos = cp.arange(p0, p0 + T, dtype=cp.int32)
        ref = [kv0.copy(), sc0.copy(), cp.asarray(cache0)]
        for t in range(T):
            K.emit(pos[t:t + 1], ref[0], ref[1], r, ovl, w, EPS, cos_g, sin_g, mode, ref[2][1:N + 1],
                   incoming=(kin[t], zin[t]))
        got = [kv0.copy(), sc0.copy(), cp.asarray(cache0)]
        K.emit_rows(pos, got[0], got[1], r, ovl, w, EPS, cos_g, sin_g, mode, got[2][1:N + 1], incoming=(kin, zin))
        ctx = f"[seed={seed}] d={d} mode={mode} r={r} ovl={ovl} p0={p0} T={T}"
        for i, what in enumerate(("kv", "score", "cache")):
            x, y = got[i].get(), ref[i].get()
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"emit_rows: {what} differs {ctx}"
        emits = [p for p in range(p0, p0 + T) if (p + 1) % r == 0 and (p + 1) // r - 1 < N]
        if emits:   # non-vacuity: the rows emitted
            assert not cp.array_equal(got[2], cp.asarray(cache0)), ctx


def test_compress_emit_refusals(yarn_table):
    _, _, cos_g, sin_g = yarn_table
    pos, w = cp.zeros(1, cp.int32), cp.ones(512, cp.float32)
    cache = cp.zeros((4, 512), cp.uint16)
    with pytest.raises(AssertionError, match="pending rows"):
        K.emit(pos, cp.zeros((4, 1024), cp.float32), cp.zeros((4, 1024), cp.float32), 4, True, w, EPS,
               cos_g, sin_g, "fp8", cache)
    with pytest.raises(AssertionError, match="overlap pooling is ratio 4"):
        K.emit(pos, cp.zeros((16, 1024), cp.float32), cp.zeros((16, 1024), cp.float32), 8, True, w, EPS,
               cos_g, sin_g, "fp8", cache)
    with pytest.raises(AssertionError, match="unsupported"):
        K.emit(pos, cp.zeros((4, 256), cp.float32), cp.zeros((4, 256), cp.float32), 4, False,
               cp.ones(256, cp.float32), EPS, cos_g, sin_g, "fp8", cp.zeros((4, 256), cp.uint16))
    kv8 = cp.zeros((8, 1024), cp.float32)
    with pytest.raises(AssertionError, match="incoming.kv"):   # the row is C = 2d wide
        K.emit(pos, kv8, kv8.copy(), 4, True, w, EPS, cos_g, sin_g, "fp8", cache,
               incoming=(cp.zeros(512, cp.float32), cp.zeros(1024, cp.float32)))
    with pytest.raises(AssertionError, match="incoming.score"):
        K.emit(pos, kv8, kv8.copy(), 4, True, w, EPS, cos_g, sin_g, "fp8", cache,
               incoming=(cp.zeros(1024, cp.float32), cp.zeros(1024, cp.uint16)))
