"""The batched prefill MoE (memra_dsv4.gpu.ops.prefill_moe, the "prefill MoE" kernels at the end of
kernels_cu/experts.cu, GemmBackend.mm_batched) against NumPy twins and the per-expert CuPy
path it replaced.  Fresh random inputs every run (the seed is printed on failure).

Bounds and why:
* dequant_experts: bit-identical to the per-expert kernels (same helpers) and to the twins
  formats.dequant_mxfp4 / dequant_nvfp4 rounded to bf16 (exact: MXFP4; NVFP4 rounds the twin's
  f32 product once, as the kernel does).
* gather_rows, combine_sorted: bit-identical (copies / RNE / the twin's f32 adds in order).
* swiglu_rows: the same device function as moe.cu's swiglu (tests/gpu/test_kernels_moe.py):
  bit-identical up to a last-bit exp() tie, SWIGLU_MAX_ULP on SWIGLU_MAX_FRAC of the elements.
* mm_batched: f32 accumulation of K products; |got - want| <= K * 2^-24 * sum_k |x w| per
  element (the classic gamma_K bound of a recursive f32 sum, any order) against float64.
* routed_moe, whole layer: against the per-expert CuPy path it replaced and against the
  float64 oracle (oracle.ops.expert_ffn + moe_combine), relative L2 <= MOE_REL_L2 = 4e-3,
  one bf16 ulp (2^-8) of RMS: both sides round at the same points and differ only by f32 vs
  other accumulation orders, which moves a bf16 rounding by one ulp on a small fraction of
  elements; a wrong row, expert, weight or padding leak moves whole rows by O(1).
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import decode_bf16, dequant_mxfp4, dequant_nvfp4  # noqa: E402
from memra_dsv4.gpu import ops_glue as G  # noqa: E402
from memra_dsv4.gpu.ops import experts as EX  # noqa: E402
from memra_dsv4.gpu.ops import prefill_moe as PM  # noqa: E402
from memra_dsv4.gpu.ops.testing import assert_bf16, bits_of, fresh_seed, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.host.quant import round_bf16  # noqa: E402
from memra_dsv4.oracle import ops as O  # noqa: E402

pytestmark = pytest.mark.gpu

SWIGLU_MAX_ULP = 1
SWIGLU_MAX_FRAC = 1e-4
MOE_REL_L2 = 4e-3


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _stacked(rng, fmt, E, R, C):
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    if fmt == "mxfp4":
        scale = rng.integers(116, 123, (E, R, C // 32), dtype=np.uint8)    # 2^-11 .. 2^-5
        ws2 = None
    else:
        scale = rng.integers(0x20, 0x40, (E, R, C // 16), dtype=np.uint8)  # positive e4m3
        ws2 = np.exp2(rng.integers(-9, -5, E)).astype(np.float32)
    return packed, scale, ws2


def _twin_dequant(fmt, packed, scale, ws2, e):
    if fmt == "mxfp4":
        return dequant_mxfp4(packed[e], scale[e], "w")
    return dequant_nvfp4(packed[e], scale[e], np.float32(ws2[e]), "w")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("E,R,C,n", [(8, 64, 256, 5), (6, 2048, 4096, 3), (4, 3, 32, 4)])
def test_dequant_experts(fmt, E, R, C, n):
    seed = fresh_seed()
    rng = rng_for(seed)
    packed, scale, ws2 = _stacked(rng, fmt, E, R, C)
    eids = rng.integers(0, E, n).astype(np.int32)                  # repeats allowed
    out = cp.full((n + 1, R, C), 0xABCD, dtype=cp.uint16)          # one spare slot stays untouched
    PM.dequant_experts(fmt, cp.asarray(packed), cp.asarray(scale), cp.asarray(eids), out,
                       None if ws2 is None else cp.asarray(ws2))
    got = out.get()
    for j, e in enumerate(eids):
        assert_bf16(got[j], _twin_dequant(fmt, packed, scale, ws2, e), "dequant_experts", seed,
                    fmt=fmt, j=j, e=int(e))
        one = (EX.dequant_mxfp4(cp.asarray(packed[e]), cp.asarray(scale[e])) if fmt == "mxfp4" else
               EX.dequant_nvfp4(cp.asarray(packed[e]), cp.asarray(scale[e]), float(ws2[e])))
        assert np.array_equal(got[j], one.get()), f"seed {seed}: slot {j} != per-expert kernel"
    assert (got[n] == 0xABCD).all(), f"seed {seed}: wrote past the {n} requested experts"


@pytest.mark.parametrize("T,D,P", [(37, 4096, 300), (1, 256, 16), (5, 8, 9)])
def test_gather_rows(T, D, P):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = (rng.standard_normal((T, D)) * 3).astype(np.float32)      # not bf16-valued: RNE matters
    src = rng.integers(-1, T, P).astype(np.int32)
    got = PM.gather_rows(cp.asarray(x), cp.asarray(src), cp.empty((P, D), cp.uint16)).get()
    want = np.where(src[:, None] >= 0, round_bf16(x)[np.maximum(src, 0)], np.float32(0))
    assert_bf16(got, want, "gather_rows", seed, T=T, D=D, P=P)


@pytest.mark.parametrize("P,I,T,k", [(48, 2048, 10, 6), (16, 128, 4, 2)])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_rows(P, I, T, k, limit):
    seed = fresh_seed()
    rng = rng_for(seed)
    gate = (rng.standard_normal((P, I)) * 6).astype(np.float32)   # f32 GEMM outputs, |g| < ~40
    up = (rng.standard_normal((P, I)) * 6).astype(np.float32)
    wts = rng.random(T * k).astype(np.float32)
    flat = rng.integers(-1, T * k, P).astype(np.int32)
    got = PM.swiglu_rows(cp.asarray(gate), cp.asarray(up), cp.asarray(wts), cp.asarray(flat),
                         limit, cp.empty((P, I), cp.uint16)).get()
    w = np.where(flat >= 0, wts[np.maximum(flat, 0)], 0).astype(np.float32)
    want = O.BF16.store(O.swiglu_clamped(round_bf16(gate), round_bf16(up), limit, w))
    want = np.where(flat[:, None] >= 0, want, np.float32(0))
    assert_bf16(got, want, "swiglu_rows", seed, max_ulp=SWIGLU_MAX_ULP, max_frac=SWIGLU_MAX_FRAC,
                P=P, I=I, limit=limit)
    assert (got[flat < 0] == 0).all(), f"seed {seed}: padding rows not zero"


@pytest.mark.parametrize("T,k,D,E", [(1, 6, 4096, 256), (37, 6, 4096, 256), (9, 2, 256, 3)])
def test_combine_sorted(T, k, D, E):
    seed = fresh_seed()
    rng = rng_for(seed)
    idx = rng.integers(0, E, (T, k)).astype(np.int64)
    p = PM.dispatch_plan(idx, 5)
    ys = (rng.standard_normal((p.rows, D)) * np.exp2(rng.integers(-6, 7, (p.rows, 1)))).astype(np.float32)
    shared = rand_bf16(rng, (T, D), 1.0)
    got = PM.combine_sorted(cp.asarray(ys), cp.asarray(p.pos), cp.asarray(shared)).get()
    pos_pick = np.empty((T, k), np.int64)                             # row of pick (t, j)
    fl = p.flat[p.pos]
    pos_pick[np.arange(T)[:, None], fl - np.arange(T)[:, None] * k] = p.pos
    routed = round_bf16(ys[pos_pick])
    want = O.moe_combine(routed, idx, shared)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
        f"seed {seed}: combine_sorted differs, max |diff| {np.abs(got - want).max()}")


@pytest.mark.parametrize("mode", ["blaslt", "cupy"])
@pytest.mark.parametrize("n,m,N,K", [(21, 16, 2048, 4096), (4, 208, 4096, 2048), (3, 1, 256, 128)])
def test_mm_batched(mode, n, m, N, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    x = rand_bf16(rng, (n * m, K), 1.0, spread=2)
    w = rand_bf16(rng, (n, N, K), 0.05, spread=2)
    with cp.cuda.Device(0):
        g = G.GemmBackend(0, mode)
        y = cp.full((n * m, N), np.nan, dtype=cp.float32)
        g.mm_batched(cp.asarray(bits_of(x)), cp.asarray(bits_of(w)), y)
        got = y.get()
    assert g.flops == 2 * n * m * N * K
    for b in range(n):
        xb = x[b * m:(b + 1) * m].astype(np.float64)
        wb = w[b].astype(np.float64)
        want = xb @ wb.T
        bound = K * 2.0 ** -24 * (np.abs(xb) @ np.abs(wb).T)
        err = np.abs(got[b * m:(b + 1) * m] - want)
        assert (err <= bound).all(), (
            f"seed {seed}: batch {b} err {err.max():.3e} > bound (mode {mode}, n {n}, m {m})")


def _per_expert_reference(g, x, idx, wts, experts, fmt, ws2_h, limit, shared):
    """The per-expert CuPy path that gpu.model._Block.moe ran before the batched one."""
    T, k = idx.shape
    D = x.shape[1]
    routed = cp.zeros((T, k, D), dtype=cp.float32)
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ex, starts = np.unique(flat[order], return_index=True)
    bounds = list(starts) + [flat.size]
    for j, e in enumerate(ex):
        sel = order[bounds[j]:bounds[j + 1]]
        rows, picks = cp.asarray(sel // k), cp.asarray(sel % k)
        W = {}
        for w in ("w1", "w2", "w3"):
            pk, sc = experts[w]
            R, C = pk.shape[1], 2 * pk.shape[2]
            W[w] = G.dequant_fp4_bf16(fmt, pk[e], sc[e], None if ws2_h is None else ws2_h[w][e],
                                      cp.empty((R, C), dtype=cp.uint16))
        xe = x[rows]
        gate = G.linear(g, xe, W["w1"])
        up = G.linear(g, xe, W["w3"])
        h = G.swiglu_clamped(gate, up, limit, wts[rows, picks])
        routed[rows, picks] = G.linear(g, G.store(h), W["w2"])
    return G.moe_combine(routed, cp.asarray(idx), shared)


def _case(seed, fmt, T, k, E, D, I, distinct):
    rng = rng_for(seed)
    x = rand_bf16(rng, (T, D), 1.0)
    if distinct:
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    else:
        idx = rng.integers(0, E, (T, k)).astype(np.int64)
    wts = (rng.random((T, k)) * 0.5).astype(np.float32)
    shared = rand_bf16(rng, (T, D), 1e-4)   # well below the routed part: the test is about it
    host = {"w1": _stacked(rng, fmt, E, I, D), "w3": _stacked(rng, fmt, E, I, D),
            "w2": _stacked(rng, fmt, E, D, I)}
    return x, idx, wts, shared, host


def _experts_on_device(host, fmt):
    """_case's host experts on the current device: ({w: (packed, scale)}, {w: ws2} or None)."""
    experts = {w: (cp.asarray(h[0]), cp.asarray(h[1])) for w, h in host.items()}
    return experts, (None if fmt == "mxfp4" else {w: cp.asarray(h[2]) for w, h in host.items()})


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,k,E,D,I,group,distinct", [
    (1, 6, 16, 4096, 2048, None, True),      # decode-sized chunk, full-size matrices
    (64, 6, 16, 4096, 2048, None, True),     # counts > 16: multiple-of-16 buckets
    (40, 2, 8, 256, 128, 3, True),           # tiny, several groups
    (33, 4, 16, 512, 256, 5, False),         # small, repeated ids (hash tables)
])
def test_routed_moe(fmt, T, k, E, D, I, group, distinct):
    seed = fresh_seed()
    x, idx, wts, shared, host = _case(seed, fmt, T, k, E, D, I, distinct)
    with cp.cuda.Device(0):
        g = G.GemmBackend(0, "blaslt")
        experts, ws2_d = _experts_on_device(host, fmt)
        ws2_h = None if fmt == "mxfp4" else {w: h[2] for w, h in host.items()}
        xd, wd, sd = cp.asarray(x), cp.asarray(wts), cp.asarray(shared)
        got = PM.routed_moe(g, xd, idx, wd, experts, fmt, 10.0, sd, ws2=ws2_d, group=group).get()
        old = _per_expert_reference(g, xd, idx, wd, experts, fmt, ws2_h, 10.0, sd).get()
    assert np.array_equal(got, round_bf16(got)), f"seed {seed}: output not bf16-valued"
    r_old = _rel(got, old)
    assert r_old <= MOE_REL_L2, f"seed {seed}: vs per-expert path relL2 {r_old:.2e}"
    want = _oracle_moe(fmt, host, x, idx, wts, shared)
    r = _rel(got, want)
    assert r <= MOE_REL_L2, f"seed {seed}: vs float64 oracle relL2 {r:.2e} (per-expert path {_rel(old, want):.2e})"


def _oracle_moe(fmt, host, x, idx, wts, shared):
    """The float64 oracle: expert_ffn of each expert's picks with the twin-dequantised weights
    (rows are independent), then moe_combine."""
    T, k = idx.shape
    routed = np.zeros((T, k, x.shape[1]), np.float32)
    for e in np.unique(idx):
        t, j = np.nonzero(idx == e)
        W = {w: round_bf16(_twin_dequant(fmt, pk, sc, w2, int(e))) for w, (pk, sc, w2) in host.items()}
        routed[t, j] = O.expert_ffn(x[t], W["w1"], W["w2"], W["w3"], limit=10.0, weight=wts[t, j])
    return O.moe_combine(routed, idx, shared)


@pytest.mark.parametrize("shape", [(7, 33), (3, 4, 512), (0, 8)])
def test_store_helpers_one_pass(shape):
    """ops_glue.bf16_bits / store / to_f32 (one ElementwiseKernel each): the integer RNE formula
    u += 0x7FFF + ((u >> 16) & 1) bit for bit (the CuPy expressions they replaced), on normal,
    subnormal, tie, huge, inf and NaN inputs, from float32 and float64 (rounded to f32 first)
    and from a strided view."""
    seed = fresh_seed()
    rng = rng_for(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-140, 120, shape))).astype(np.float32)
    flat = x.reshape(-1)
    specials = np.array([np.inf, -np.inf, np.nan, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                         3.4e38, -0.0, 1e-40], np.float32)
    flat[:min(flat.size, specials.size)] = specials[:flat.size]
    u = x.view(np.uint32).astype(np.uint64)
    want_bits = (((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16).astype(np.uint16)
    got = G.bf16_bits(cp.asarray(x)).get()
    assert np.array_equal(got, want_bits), f"seed {seed}: bf16_bits"
    got_store = G.store(cp.asarray(x)).get()
    assert np.array_equal(got_store.view(np.uint32), want_bits.astype(np.uint32) << 16), f"seed {seed}: store"
    back = G.to_f32(cp.asarray(want_bits)).get()
    assert np.array_equal(back.view(np.uint32), want_bits.astype(np.uint32) << 16), f"seed {seed}: to_f32"
    # float64 input: the GPU's f64 -> f32 cast (CuPy's astype, compiled with -ftz=true like every
    # CuPy / NVRTC kernel here) flushes f32-subnormal results to a signed zero (seen on the H200:
    # 1e-40 -> +0, -tiny -> -0), so the reference is the FTZ'd float32
    x64 = x.astype(np.float64)
    x_ftz = np.where(np.abs(x) < np.float32(2.0 ** -126), np.copysign(np.float32(0), x), x)
    u_ftz = x_ftz.astype(np.float32).view(np.uint32).astype(np.uint64)
    want_ftz = (((u_ftz + 0x7FFF + ((u_ftz >> 16) & 1)) & 0xFFFFFFFF) >> 16).astype(np.uint16)
    assert np.array_equal(G.bf16_bits(cp.asarray(x64)).get(), want_ftz), f"seed {seed}: float64 input"
    if x.ndim == 2 and x.shape[1] > 2:
        view = cp.asarray(x)[:, ::2]
        assert np.array_equal(G.bf16_bits(view).get(), want_bits[:, ::2]), f"seed {seed}: strided"


# ------------------------------------------------------------------ fp4mma (FP4 grouped GEMM)
# Bounds and why (see also the module doc):
# * one-hot rows (x = e_k): every output is ONE product W[o, k] * 1 plus exact zeros, so the
#   kernels' decoded weights are compared EXACTLY with the dequant kernel's bf16 scratch (itself
#   bit-identical to the twins), over the full scale range: MXFP4 S in [0, 252] (S < 2: the
#   per-code fallback table, subnormal bf16 weights), NVFP4 every finite e4m3 byte and a ws2 that
#   is not a power of two (the twin's two roundings), negative scales too.  Exception allowed:
#   a subnormal bf16 weight read back as 0 (a tensor-core flush, not a decode difference: the
#   cuBLASLt path multiplies the same subnormal bf16 on the same tensor cores).  Gate/up: h equals
#   swiglu_rows (the same device function) applied to the exact gate / up, bit for bit.
# * random rows: the down GEMM against float64 of the twin-dequantised weights within
#   K * 2^-24 * sum_k |x w| (any f32 summation order), as test_mm_batched.
# * rows outside the work items are never written (sentinels survive).
_ITEM_SPLITS = {128: [1, 7, 64, 56], 256: [1, 8, 9, 64, 46, 64, 64]}   # 1 row, partial and full n8 tiles


def _onehot_items(E, K, pad, splits=None):
    """Work items covering, per expert e, rows e * K + t (t < K) in the sizes ``splits[K]``
    (default _ITEM_SPLITS, the fp4mma tiles); ``pad`` spare rows at the end belong to no item."""
    items = []
    for e in range(E):
        t0 = 0
        for n in (_ITEM_SPLITS if splits is None else splits)[K]:
            items.append((e, e * K + t0, n, 0))
            t0 += n
        assert t0 == K
    return np.asarray(items, np.int32), E * K + pad


def _edge_stacked(rng, fmt, E, R, C):
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    if fmt == "mxfp4":
        scale = rng.integers(0, 253, (E, R, C // 32), dtype=np.uint8)       # 2^-127 .. 2^125
        ws2 = None
    else:
        scale = rng.integers(0, 0xFF, (E, R, C // 16), dtype=np.uint8)      # every e4m3, both signs
        scale[(scale & 0x7F) == 0x7F] = 0x3F                                  # ... but NaN
        ws2 = (np.exp2(rng.integers(-12, -6, E)) * rng.uniform(1, 2, E)).astype(np.float32)
    return packed, scale, ws2


def _scratch(fmt, w, ws2, E):
    """The dequant kernel's bf16 of all E experts as float32 [E, R, C] (host)."""
    pk, sc = w
    out = cp.empty((E, pk.shape[1], 2 * pk.shape[2]), dtype=cp.uint16)
    PM.dequant_experts(fmt, pk, sc, cp.arange(E, dtype=cp.int32), out, ws2)
    return (out.get().astype(np.uint32) << 16).view(np.float32)


def _assert_decoded(got, want, what, seed, **ctx):
    sub = (np.abs(want) < np.float32(2.0 ** -126)) & (want != 0)
    ok = (got == want) | (np.isnan(got) & np.isnan(want)) | (sub & (got == 0))
    assert ok.all(), (f"seed {seed}: {what}: {int((~ok).sum())} of {ok.size} decoded weights differ "
                      f"(first at {np.argwhere(~ok)[0]}: got {got[~ok][0]!r}, want {want[~ok][0]!r}) {ctx}")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4mma_down_decodes_exactly(fmt):
    seed = fresh_seed()
    rng = rng_for(seed)
    E, N, K, pad = 3, 300, 128, 16                         # N: a full and a partial CTA of rows
    pk, sc, ws2 = _edge_stacked(rng, fmt, E, N, K)
    w = (cp.asarray(pk), cp.asarray(sc))
    ws2_d = None if ws2 is None else cp.asarray(ws2)
    items, P = _onehot_items(E, K, pad)
    x = np.zeros((P, K), np.uint16)
    x[np.arange(E * K), np.arange(E * K) % K] = 0x3F80    # row e * K + t = e_t
    ys = cp.full((P, N), np.nan, dtype=cp.float32)
    PM.fp4mma_down(fmt, w, cp.asarray(items), cp.asarray(x), ys, ws2_d)
    got = ys.get()
    want = _scratch(fmt, w, ws2_d, E)                      # [E, N, K]
    _assert_decoded(got[:E * K].reshape(E, K, N), want.transpose(0, 2, 1), "fp4mma_down one-hot", seed,
                    fmt=fmt)
    assert np.isnan(got[E * K:]).all(), f"seed {seed}: rows outside the items were written"


def _onehot_gateup_want(fmt, w, ws2, E, D, wts, flat, limit):
    """The h rows of a one-hot gate/up (row e * D + t = e_t): swiglu_rows of the exact gate / up
    W[e][:, t] (the dequant kernels' bf16), zeros past E * D; [P, I] uint16."""
    P, I = flat.shape[0], w["w1"][0].shape[1]
    gate = np.zeros((P, I), np.float32)
    up = np.zeros((P, I), np.float32)
    W1 = _scratch(fmt, w["w1"], None if ws2 is None else ws2["w1"], E)
    W3 = _scratch(fmt, w["w3"], None if ws2 is None else ws2["w3"], E)
    gate[:E * D] = W1.transpose(0, 2, 1).reshape(E * D, I)
    up[:E * D] = W3.transpose(0, 2, 1).reshape(E * D, I)
    return PM.swiglu_rows(cp.asarray(gate), cp.asarray(up), cp.asarray(wts), cp.asarray(flat), limit,
                          cp.empty((P, I), cp.uint16)).get()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_fp4mma_gateup_decodes_exactly(fmt, limit):
    seed = fresh_seed()
    rng = rng_for(seed)
    E, I, D, pad = 2, 80, 256, 16                          # I: a partial CTA of indices
    host = {m: _stacked(rng, fmt, E, I, D) for m in ("w1", "w3")}
    w = {m: (cp.asarray(h[0]), cp.asarray(h[1])) for m, h in host.items()}
    ws2 = None if fmt == "mxfp4" else {m: cp.asarray(h[2]) for m, h in host.items()}
    items, P = _onehot_items(E, D, pad)
    x = np.zeros((P, D), np.uint16)
    x[np.arange(E * D), np.arange(E * D) % D] = 0x3F80
    wts = (rng.random(P) * 0.5).astype(np.float32)
    flat = np.arange(P, dtype=np.int32)
    flat[E * D:] = -1
    hs = cp.full((P, I), 0xABCD, dtype=cp.uint16)
    PM.fp4mma_gateup(fmt, w["w1"], w["w3"], cp.asarray(items), cp.asarray(x), cp.asarray(wts),
                     cp.asarray(flat), limit, hs, None if ws2 is None else (ws2["w1"], ws2["w3"]))
    got = hs.get()
    # the exact gate / up of row e * D + t: W[e][:, t]; then swiglu_rows, the same device function
    want = _onehot_gateup_want(fmt, w, ws2, E, D, wts, flat, limit)
    # Compared as values: the MMA sums the one product w * 1 with the other columns' zeros from a
    # +0 accumulator, so a stored -0 weight comes out as +0 (IEEE -0 + +0 = +0), while the twin
    # feeds the weight itself to swiglu_rows (seen on the H200: only 0x0000 vs 0x8000 differed).
    gv, wv = decode_bf16(got[:E * D]), decode_bf16(want[:E * D])
    assert np.array_equal(gv, wv), (
        f"seed {seed}: fp4mma_gateup one-hot: {int((gv != wv).sum())} h values differ "
        f"from swiglu_rows of the exact gate / up ({fmt}, limit {limit})")
    assert (got[E * D:] == 0xABCD).all(), f"seed {seed}: rows outside the items were written"


def _assert_down_within_f32_bound(got, x, items, fmt, pk, sc, ws2, seed):
    """A grouped down GEMM's ys (got [P, N], NaN-initialised) against float64 x @ W_e^T per item:
    |err| <= K 2^-24 (|x| @ |W|^T) (f32 accumulation of exact products); rows of no item untouched."""
    P, K = x.shape
    N = got.shape[1]
    covered = np.zeros(P, bool)
    for e, r0, n, _ in items:
        covered[r0:r0 + n] = True
        W = _twin_dequant(fmt, pk, sc, ws2, int(e)).astype(np.float64)
        xb = x[r0:r0 + n].astype(np.float64)
        want = xb @ W.T
        bound = K * 2.0 ** -24 * (np.abs(xb) @ np.abs(W).T)
        err = np.abs(got[r0:r0 + n] - want)
        assert (err <= bound).all(), (f"seed {seed}: item {(e, r0, n)} err {np.nanmax(err):.3e} beyond the "
                                      f"f32 bound ({fmt}, N {N}, K {K})")
    assert np.isnan(got[~covered]).all(), f"seed {seed}: rows outside the items were written"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("N,K", [(512, 2048), (256, 128), (4096, 256)])
def test_fp4mma_down_bound(fmt, N, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    E = 5
    pk, sc, ws2 = _stacked(rng, fmt, E, N, K)
    # items: repeated experts, gaps (rows of no item), 1-row and > 64-row experts cut in tiles
    counts = {0: 1, 3: 130, 1: 9, 4: 64, 2: 33}
    items, rows = [], 0
    for e, c in counts.items():
        rows += 3                                          # a gap before every expert
        for t0 in range(0, c, 64):
            items.append((e, rows + t0, min(64, c - t0), 0))
        rows += c
    items = np.asarray(items, np.int32)
    P = rows + 5
    x = rand_bf16(rng, (P, K), 1.0, spread=2)
    ys = cp.full((P, N), np.nan, dtype=cp.float32)
    PM.fp4mma_down(fmt, (cp.asarray(pk), cp.asarray(sc)), cp.asarray(items), cp.asarray(bits_of(x)), ys,
                   None if ws2 is None else cp.asarray(ws2))
    _assert_down_within_f32_bound(ys.get(), x, items, fmt, pk, sc, ws2, seed)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,k,E,D,I,group,distinct", [
    (1, 6, 16, 4096, 2048, None, True),      # decode-sized chunk, full-size matrices: 1 row / expert
    (64, 6, 16, 4096, 2048, None, True),     # ~24 rows per expert (partial n8 tiles)
    (200, 6, 8, 512, 256, None, True),       # 150 rows per expert: 3 items each, full tiles
    (40, 2, 8, 256, 128, 3, True),           # tiny, several groups
    (33, 4, 16, 512, 256, 5, False),         # small, repeated ids (hash tables), empty experts
])
def test_routed_moe_fp4mma(fmt, T, k, E, D, I, group, distinct):
    """routed_moe(gemm="fp4mma") against the default path (dequant + cuBLASLt) and the float64
    oracle, MOE_REL_L2 each (the GEMM sums run in another f32 order; everything around them is
    the same)."""
    seed = fresh_seed()
    x, idx, wts, shared, host = _case(seed, fmt, T, k, E, D, I, distinct)
    with cp.cuda.Device(0):
        g = G.GemmBackend(0, "blaslt")
        experts, ws2_d = _experts_on_device(host, fmt)
        xd, wd, sd = cp.asarray(x), cp.asarray(wts), cp.asarray(shared)
        got = PM.routed_moe(g, xd, idx, wd, experts, fmt, 10.0, sd, ws2=ws2_d, group=group,
                            gemm="fp4mma").get()
        base = PM.routed_moe(g, xd, idx, wd, experts, fmt, 10.0, sd, ws2=ws2_d, group=group).get()
    assert np.array_equal(got, round_bf16(got)), f"seed {seed}: output not bf16-valued"
    r_base = _rel(got, base)
    assert r_base <= MOE_REL_L2, f"seed {seed}: fp4mma vs blaslt path relL2 {r_base:.2e}"
    want = _oracle_moe(fmt, host, x, idx, wts, shared)
    r = _rel(got, want)
    assert r <= MOE_REL_L2, f"seed {seed}: fp4mma vs float64 oracle relL2 {r:.2e} (blaslt {_rel(base, want):.2e})"


def test_mma_items_cover_every_pick_once():
    """CPU-side, but here with its kernels: the work items tile each expert's picks exactly."""
    seed = fresh_seed()
    rng = rng_for(seed)
    idx = rng.integers(0, 40, (300, 6)).astype(np.int64)
    plan = PM.dispatch_plan(idx, 7)
    items = PM.mma_items(plan)
    cover = np.zeros(plan.rows, np.int64)
    for e, r0, n, _ in items:
        assert 1 <= n <= PM.MMA_BN
        cover[r0:r0 + n] += 1
        assert (idx.reshape(-1)[plan.flat[r0:r0 + n]] == e).all(), f"seed {seed}: item rows of another expert"
    assert (cover[plan.src >= 0] == 1).all() and (cover[plan.src < 0] == 0).all(), f"seed {seed}"


# ------------------------------------------------------------------ wgmma (FP4 grouped GEMM, Hopper)
# The fp4mma contract on warpgroup MMA (kernels_cu/experts.cu namespace wg); the activations xs and
# the gate/up output hs are stored with every 128-column chunk permuted (PM.perm128), so the inputs
# are permuted with the host twin and the outputs un-permuted before the same comparisons as above:
# * one-hot rows: decoded weights EXACTLY equal to the dequant kernel's bf16 (every MXFP4 scale
#   0..252, every finite e4m3 byte, both signs), gate/up: h equal to swiglu_rows of the exact gate/up;
# * random rows: down within K * 2^-24 * sum_k |x w| of float64 (any f32 order); gate/up against the
#   float64 twin through bf16(gate), bf16(up) and the clamped SwiGLU: MOE_REL_L2 over the tile and
#   per row (a bf16 rounding of gate / up may flip by one ulp; a wrong row / index moves O(1));
# * rows outside the items are never written; item row counts 1, 7, 64, 65, 128, 200 (two items:
#   PM.wg_items' split), an expert with no rows, clamp on / off, Flash K / N and small shapes.
_WG_SPLITS = {128: [1, 7, 56, 64], 256: [1, 7, 65, 128, 55]}   # each <= WG_BN; 65 and 128: odd tiles



def test_gather_rows_perm():
    seed = fresh_seed()
    rng = rng_for(seed)
    T, D, P = 37, 4096, 300
    x = (rng.standard_normal((T, D)) * 3).astype(np.float32)      # not bf16-valued: RNE matters
    src = rng.integers(-1, T, P).astype(np.int32)
    got = PM.gather_rows_perm(cp.asarray(x), cp.asarray(src), cp.empty((P, D), cp.uint16)).get()
    nat = PM.gather_rows(cp.asarray(x), cp.asarray(src), cp.empty((P, D), cp.uint16)).get()
    assert np.array_equal(got, PM.perm128(nat)), f"seed {seed}: gather_rows_perm != perm128(gather_rows)"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("K", [128, 256])
def test_wgmma_down_decodes_exactly(fmt, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    E, N, pad = 3, 300, 16                                  # N: a full and a partial CTA of rows
    pk, sc, ws2 = _edge_stacked(rng, fmt, E, N, K)
    w = (cp.asarray(pk), cp.asarray(sc))
    ws2_d = None if ws2 is None else cp.asarray(ws2)
    items, P = _onehot_items(E, K, pad, _WG_SPLITS)
    x = np.zeros((P, K), np.uint16)
    x[np.arange(E * K), np.arange(E * K) % K] = 0x3F80    # row e * K + t = e_t (logical)
    ys = cp.full((P, N), np.nan, dtype=cp.float32)
    PM.wgmma_down(fmt, w, cp.asarray(items), cp.asarray(PM.perm128(x)), ys, ws2_d)
    got = ys.get()
    want = _scratch(fmt, w, ws2_d, E)                      # [E, N, K]
    _assert_decoded(got[:E * K].reshape(E, K, N), want.transpose(0, 2, 1), "wgmma_down one-hot", seed,
                    fmt=fmt, K=K)
    assert np.isnan(got[E * K:]).all(), f"seed {seed}: rows outside the items were written"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_wgmma_gateup_decodes_exactly(fmt, limit):
    seed = fresh_seed()
    rng = rng_for(seed)
    E, I, D, pad = 2, 256, 256, 16                         # I: two CTAs of indices
    host = {m: _stacked(rng, fmt, E, I, D) for m in ("w1", "w3")}
    w = {m: (cp.asarray(h[0]), cp.asarray(h[1])) for m, h in host.items()}
    ws2 = None if fmt == "mxfp4" else {m: cp.asarray(h[2]) for m, h in host.items()}
    items, P = _onehot_items(E, D, pad, _WG_SPLITS)
    x = np.zeros((P, D), np.uint16)
    x[np.arange(E * D), np.arange(E * D) % D] = 0x3F80
    wts = (rng.random(P) * 0.5).astype(np.float32)
    flat = np.arange(P, dtype=np.int32)
    flat[E * D:] = -1
    hs = cp.full((P, I), 0xABCD, dtype=cp.uint16)
    PM.wgmma_gateup(fmt, w["w1"], w["w3"], cp.asarray(items), cp.asarray(PM.perm128(x)), cp.asarray(wts),
                    cp.asarray(flat), limit, hs, None if ws2 is None else (ws2["w1"], ws2["w3"]))
    got = hs.get()
    want = _onehot_gateup_want(fmt, w, ws2, E, D, wts, flat, limit)
    # values, not bits: -0 weights come out +0 (see test_fp4mma_gateup_decodes_exactly)
    gv, wv = decode_bf16(PM.unperm128(got[:E * D])), decode_bf16(want[:E * D])
    assert np.array_equal(gv, wv), (
        f"seed {seed}: wgmma_gateup one-hot: {int((gv != wv).sum())} h values differ "
        f"from swiglu_rows of the exact gate / up ({fmt}, limit {limit})")
    assert (got[E * D:] == 0xABCD).all(), f"seed {seed}: rows outside the items were written"


def _wg_random_items(counts, pad=3):
    """Items of {expert: rows} (0 = an expert with no rows, no item) split as PM.wg_items splits
    (via a one-expert plan), a gap of ``pad`` rows before every expert; returns (items, P)."""
    items, rows = [], 0
    for e, c in counts.items():
        rows += pad
        if c:
            sizes = PM.wg_items(PM.dispatch_plan(np.zeros((c, 1), np.int64), 1))[:, 2]
            t0 = 0
            for n in sizes:
                items.append((e, rows + t0, int(n), 0))
                t0 += int(n)
            rows += c
    return np.asarray(items, np.int32), rows + 5


_WG_COUNTS = {0: 1, 3: 200, 1: 7, 5: 0, 4: 64, 2: 65, 6: 128}   # expert 5: no rows


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("N,K", [(4096, 2048), (256, 128), (300, 256)])
def test_wgmma_down_bound(fmt, N, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    E = 7
    pk, sc, ws2 = _stacked(rng, fmt, E, N, K)
    items, P = _wg_random_items(_WG_COUNTS)
    x = rand_bf16(rng, (P, K), 1.0, spread=2)
    ys = cp.full((P, N), np.nan, dtype=cp.float32)
    PM.wgmma_down(fmt, (cp.asarray(pk), cp.asarray(sc)), cp.asarray(items), cp.asarray(PM.perm128(bits_of(x))),
                  ys, None if ws2 is None else cp.asarray(ws2))
    _assert_down_within_f32_bound(ys.get(), x, items, fmt, pk, sc, ws2, seed)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("I,D", [(2048, 4096), (128, 256)])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_wgmma_gateup_bound(fmt, I, D, limit):
    seed = fresh_seed()
    rng = rng_for(seed)
    E = 7
    host = {m: _stacked(rng, fmt, E, I, D) for m in ("w1", "w3")}
    items, P = _wg_random_items(_WG_COUNTS)
    # activations sized so that |gate|, |up| reach past the clamp limit 10 on a fraction of elements
    x = rand_bf16(rng, (P, D), 100.0 / np.sqrt(D), spread=2)
    wts = (rng.random(P) * 0.5 + 0.25).astype(np.float32)
    flat = np.arange(P, dtype=np.int32)
    hs = cp.full((P, I), 0xABCD, dtype=cp.uint16)
    ws2 = None if fmt == "mxfp4" else (cp.asarray(host["w1"][2]), cp.asarray(host["w3"][2]))
    PM.wgmma_gateup(fmt, (cp.asarray(host["w1"][0]), cp.asarray(host["w1"][1])),
                    (cp.asarray(host["w3"][0]), cp.asarray(host["w3"][1])), cp.asarray(items),
                    cp.asarray(PM.perm128(bits_of(x))), cp.asarray(wts), cp.asarray(flat), limit, hs, ws2)
    got_bits = hs.get()
    covered = np.zeros(P, bool)
    clamped = 0
    for e, r0, n, _ in items:
        covered[r0:r0 + n] = True
        W1 = _twin_dequant(fmt, *host["w1"], int(e)).astype(np.float64)
        W3 = _twin_dequant(fmt, *host["w3"], int(e)).astype(np.float64)
        xb = x[r0:r0 + n].astype(np.float64)
        g64, u64 = xb @ W1.T, xb @ W3.T
        clamped += int((np.abs(u64) > 10).sum())
        want = O.BF16.store(O.swiglu_clamped(round_bf16(g64.astype(np.float32)), round_bf16(u64.astype(np.float32)),
                                             limit, wts[r0:r0 + n]))
        got = decode_bf16(PM.unperm128(got_bits[r0:r0 + n]))
        r = _rel(got, want)
        assert r <= MOE_REL_L2, f"seed {seed}: item {(e, r0, n)} relL2 {r:.2e} ({fmt}, I {I}, limit {limit})"
        for t in range(n):
            rt = _rel(got[t], want[t])
            assert rt <= 8 * MOE_REL_L2, f"seed {seed}: item {(e, r0, n)} row {t} relL2 {rt:.2e}"
    assert clamped > 0, f"seed {seed}: no |up| beyond the clamp: the test does not exercise it"
    assert (got_bits[~covered] == 0xABCD).all(), f"seed {seed}: rows outside the items were written"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,k,E,D,I,group,distinct", [
    (1, 6, 16, 4096, 2048, None, True),      # decode-sized chunk, full-size matrices: 1 row / expert
    (64, 6, 16, 4096, 2048, None, True),     # ~24 rows per expert
    (400, 6, 12, 512, 256, None, True),      # ~200 rows per expert: two items each
    (40, 2, 8, 256, 128, 3, True),           # tiny, several groups
    (33, 4, 16, 512, 256, 5, False),         # small, repeated ids (hash tables), empty experts
])
def test_routed_moe_wgmma(fmt, T, k, E, D, I, group, distinct):
    """routed_moe(gemm="wgmma") against gemm="fp4mma" and the float64 oracle, MOE_REL_L2 each (the
    GEMM sums run in another f32 order; everything around them is the same)."""
    seed = fresh_seed()
    x, idx, wts, shared, host = _case(seed, fmt, T, k, E, D, I, distinct)
    with cp.cuda.Device(0):
        g = G.GemmBackend(0, "blaslt")
        experts, ws2_d = _experts_on_device(host, fmt)
        xd, wd, sd = cp.asarray(x), cp.asarray(wts), cp.asarray(shared)
        got = PM.routed_moe(g, xd, idx, wd, experts, fmt, 10.0, sd, ws2=ws2_d, group=group,
                            gemm="wgmma").get()
        ref = PM.routed_moe(g, xd, idx, wd, experts, fmt, 10.0, sd, ws2=ws2_d, group=group,
                            gemm="fp4mma").get()
    assert np.array_equal(got, round_bf16(got)), f"seed {seed}: output not bf16-valued"
    r_ref = _rel(got, ref)
    assert r_ref <= MOE_REL_L2, f"seed {seed}: wgmma vs fp4mma relL2 {r_ref:.2e}"
    want = _oracle_moe(fmt, host, x, idx, wts, shared)
    r = _rel(got, want)
    assert r <= MOE_REL_L2, f"seed {seed}: wgmma vs float64 oracle relL2 {r:.2e} (fp4mma {_rel(ref, want):.2e})"
