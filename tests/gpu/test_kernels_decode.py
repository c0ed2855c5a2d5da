"""kernels_cu/decode.cu (memra_dsv4/gpu/ops_decode.py) against NumPy twins on fresh random inputs.

Bounds:
* gemv_bf16, f32 output: |gpu - y| <= GEMV_F32_ULPS f32 ulps of sum_k |w x| per row, y the
  float64 dot of the same bf16 values (see GEMV_F32_ULPS for why).  On small integer data every
  partial sum is exact, so there the result must equal the integer dot bit for bit, whatever the
  summation order (pins the indexing: tail loop, groups, row offsets).
* gemv_bf16, bf16 output: exactly the RNE rounding of the same launch's f32 result, and within
  GEMV_BF16_MAX_ULP bf16 ulp of the f64 value rounded to bf16 on every row where the f32
  accumulation bound is below a quarter of a bf16 ulp of the result.
* gemv determinism: two launches give identical bytes; a row's value does not depend on O, on
  its position in the matrix, on the group layout or on the rows per warp R (every instantiated
  R, incl. the tails O % R != 0 and the lowering of R to a divisor of the rows per group).
* gemv_bf16_multi (R = 1 and 4 rows per warp): bit-identical to gemv_bf16 of each projection
  alone; its pending-row entries bit-identical to the twin of gemv_bf16 (f32) + add_ape (one f32
  add) + pending_write.
* gemv_bf16_swiglu (P = 1 and 2 outputs per warp): bit-identical to gemv_bf16 (bf16) of W1 and
  W3, then moe.swiglu.
* The glue kernels (embed_gather, step_scalars, ring_write, pending_write, entry_commit,
  pending_advance, build_cand) move or index data and do no arithmetic: bit-identical to their
  twins below (which state the oracle rule each mirrors), the bytes around the outputs included.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import encode_bf16  # noqa: E402
from memra_dsv4.gpu import ops_decode as DK  # noqa: E402
from memra_dsv4.gpu.ops.testing import (assert_bf16, assert_within, bits_of, describe,  # noqa: E402
                                        fresh_seed, rand_bf16, rng_for, ulp_bf16)
from memra_dsv4.host import indices as hidx  # noqa: E402
from memra_dsv4.host.pending import advance_pending, cur_offset  # noqa: E402

pytestmark = pytest.mark.gpu

# Each product of two bf16 values is exact in f32 (8 + 8 significant bits), so the only error of
# gemv_bf16 is the f32 rounding of its running sums (the fixed tree of warp_rows_dot: a chain of
# K/128 FMAs per lane partial, 3 partial adds, a 5-level butterfly).  Every rounding is at most
# half an ulp of a partial sum, and |partial sum| <= sum_k |w x|, so the worst case is about
# (K/128 + 8)/2 ulps of sum|w x| (for K = 8, 7 roundings: 3.5 ulps, so 4 is rigorous there).  On
# random-sign data the partial sums are O(sqrt K) and the roundings cancel like a random walk:
# measured on an H200 over 4096 rows for each K in {8, 264, 1024, 1032, 2048, 4096, 4416, 8192}
# with the tests' data (normal x 2^U(-3, 3), both operands), max 1.0 ulp, rms <= 0.17 ulp
# (unscaled normal data: max 0.75, rms <= 0.06).  4 ulps of sum|w x| is still <= 1/256 of one
# average product |w x| for K <= 8192, so a dropped, doubled or misaddressed product fails.
# (The integer-data test pins the indexing exactly.)
GEMV_F32_ULPS = 4
GEMV_BF16_MAX_ULP = 1

BOUNDARY = (0, 1, 2, 3, 4, 5, 126, 127, 128, 129, 300)
W_FLASH = 128            # sliding_window of DeepSeek-V4-Flash
GUARD = 8                # guard elements around outputs (16 / 32 bytes: alignment kept)


# ------------------------------------------------------------------------------ helpers
def _pos(p: int):
    return cp.asarray(np.array([p], np.int32))


def _ints(a: np.ndarray) -> np.ndarray:
    """Integer view of the same bytes (so -inf, -0 and NaN compare by their bits)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def assert_same_bytes(got, want, what: str, seed: int, **ctx) -> None:
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype} {describe(seed, **ctx)}")
    diff = np.argwhere(_ints(got) != _ints(want))
    if diff.size:
        rows = [f"{tuple(int(i) for i in d)}: got {got[tuple(d)]!r} want {want[tuple(d)]!r}" for d in diff[:5]]
        raise AssertionError(f"{what}: {len(diff)}/{got.size} elements differ {describe(seed, **ctx)}\n    "
                             + "\n    ".join(rows))


def _guarded(n: int, dtype, fill):
    """(buffer, view): a contiguous n-element output with GUARD sentinel elements each side."""
    buf = cp.full(n + 2 * GUARD, fill, dtype=dtype)
    return buf, buf[GUARD:GUARD + n]


def _check_guards(buf, fill, what: str, seed: int, **ctx) -> None:
    b = buf.get()
    want = np.full(GUARD, fill, dtype=b.dtype)
    assert_same_bytes(b[:GUARD], want, f"{what} (guard before the output)", seed, **ctx)
    assert_same_bytes(b[-GUARD:], want, f"{what} (guard after the output)", seed, **ctx)


def _framed(a: np.ndarray, rng, g: int = 2):
    """``a`` between g rows of random bytes on each side: (host frame, host view of a's rows,
    device frame, device view).  The twins write the host view, the kernels the device view, and
    the whole frames are compared, so a write outside the array fails too."""
    shape = (a.shape[0] + 2 * g,) + a.shape[1:]
    full = rng.integers(0, 256, int(np.prod(shape)) * a.itemsize, dtype=np.uint8).view(a.dtype).reshape(shape)
    full[g:g + a.shape[0]] = a
    dev = cp.asarray(full)
    return full, full[g:g + a.shape[0]], dev, dev[g:g + a.shape[0]]


def _ulp_f32(s) -> np.ndarray:
    """Spacing of the f32 grid at s >= 0 (2^(e-24) for s in [2^(e-1), 2^e))."""
    _, e = np.frexp(np.asarray(s, np.float64))
    return np.ldexp(1.0, e - 24)


# ------------------------------------------------------------------------------ twins
def gemv_twin(w: np.ndarray, x: np.ndarray, groups: int = 1):
    """The exact dot of gemv_bf16 (decode.cu header: y[o] = sum_k W[o, k] x[xo(o) + k], xo(o) =
    (o // (O / groups)) * K), in float64 over the bf16 values (the oracle's ops.linear without the
    storage rounding).  Returns (y, sum_k |W[o, k] x[xo(o) + k]|), both float64 [O]."""
    O, K = w.shape
    W = w.astype(np.float64).reshape(groups, O // groups, K)
    X = np.asarray(x, np.float64).reshape(groups, K, 1)
    return (W @ X)[..., 0].reshape(O), (np.abs(W) @ np.abs(X))[..., 0].reshape(O)


def embed_gather_twin(tok: int, embed: np.ndarray, hc: int) -> np.ndarray:
    """The oracle's run_chunk start: streams = repeat(embed[tok], hc_mult) (bf16 bits)."""
    return np.repeat(embed[tok][None, :], hc, axis=0)


def step_scalars_twin(pos: int, ratios) -> np.ndarray:
    """aux[0] = host.indices.n_complete(pos, 4) (the indexer's n_valid: complete ratio-4 entries
    visible to pos); aux[1 + i] = max(pos + 1 - r_i, 0): at an emit position (pos + 1) % r == 0 the
    first token k * r of the block of the entry k = (pos + 1) / r - 1 it closes (oracle
    Layer.compress: kpos = b0 + r * arange(nb)), the rope position of the new entry."""
    aux = [int(hidx.n_complete(pos, 4))]
    aux += [max(pos + 1 - r, 0) for r in ratios]
    return np.asarray(aux, np.int32)


def ring_write_twin(ring: np.ndarray, pos: int, src: np.ndarray) -> None:
    """The oracle's ring rule (decode.py, host.indices.window_ring_slots): position p lives in
    ring slot p % W."""
    ring[pos % ring.shape[0]] = src


def pending_write_twin(kv, score, pos: int, a, z, ratio: int, overlap: bool) -> None:
    """host.pending layout: the current block's token pos % r sits at row cur + pos % r, cur = r
    with the overlap layout (rows [0, r) keep the previous complete block), else 0."""
    row = (ratio if overlap else 0) + pos % ratio
    kv[row], score[row] = a, z


def pending_advance_twin(kv, score, pos: int, ratio: int, overlap: bool) -> None:
    """host.pending.advance_pending after the token that completes a block ((pos + 1) % r == 0):
    overlap: rows [0, r) = the completed block (rows [r, 2r)); the current rows become (0, -inf)
    (rows holding no token are always (0, -inf)).  Other positions: unchanged."""
    if (pos + 1) % ratio:
        return
    o = ratio if overlap else 0
    if overlap:
        kv[:ratio], score[:ratio] = kv[o:o + ratio], score[o:o + ratio]
    kv[o:o + ratio], score[o:o + ratio] = 0.0, -np.inf


def entry_commit_twin(dst: np.ndarray, pos: int, src: np.ndarray, ratio: int) -> None:
    """host.indices.emit_positions: entry k is emitted at position (k + 1) * r - 1 and becomes
    row k of the entry buffer (the oracle's RowBuffer.append); rows past the buffer are dropped."""
    k = (pos + 1) // ratio - 1
    if (pos + 1) % ratio == 0 and k < dst.shape[0]:
        dst[k] = src


def build_cand_twin(pos: int, K: int, window: int, ratio: int, sel=None) -> np.ndarray:
    """host.indices' canonical candidate row: window_ring_slots(pos, W) (chronological ring slots,
    -1 padded at the end), then the compressed entries + offset W ascending, -1 padded to K - W:
    HCA (sel None) every complete entry k < n_complete(pos, r) (hca_entries); CSA the indexer's
    selection (ascending, -1 padded); ratio 0 (window only): all -1."""
    win = hidx.window_ring_slots(pos, window)
    if ratio == 0:
        return np.concatenate([win, np.full(K - window, -1, np.int32)])
    comp = hidx.hca_entries(pos, ratio) if sel is None else np.asarray(sel)
    return hidx.candidate_row(win, comp, window, comp_width=K - window)


# ------------------------------------------------------------------------------ gemv_bf16
GEMV_SHAPES = [(7, 1024), (13, 2048), (1027, 4096), (100, 8192), (1024, 4096), (4096, 1024),
               (33, 264), (9, 1032), (19, 4416), (64, 8), (1, 2048)]


def _run_gemv(w, x, n_groups, seed, **ctx):
    """(f32 result, bf16 bits result) of gemv_bf16 with guarded outputs."""
    O = w.shape[0]
    wg, xg = cp.asarray(bits_of(w)), cp.asarray(bits_of(x))
    b32, y32 = _guarded(O, cp.float32, np.float32(-1234.5))
    b16, y16 = _guarded(O, cp.uint16, np.uint16(0x7FC1))
    DK.gemv_bf16(wg, xg, y32, groups=n_groups)
    DK.gemv_bf16(wg, xg, y16, groups=n_groups)
    _check_guards(b32, np.float32(-1234.5), "gemv_bf16 f32", seed, **ctx)
    _check_guards(b16, np.uint16(0x7FC1), "gemv_bf16 bf16", seed, **ctx)
    return y32.get(), y16.get()


def _check_gemv(w, x, n_groups, seed, **ctx):
    y64, s = gemv_twin(w, x, n_groups)
    got32, got16 = _run_gemv(w, x, n_groups, seed, **ctx)
    bound = GEMV_F32_ULPS * _ulp_f32(s)
    assert_within(got32, y64, bound, "gemv_bf16 f32 vs f64 dot", seed, **ctx)
    # bf16 output: the same sum, stored RNE
    assert_same_bytes(got16, encode_bf16(got32), "gemv_bf16 bf16 != RNE(f32 result)", seed, **ctx)
    # and within 1 bf16 ulp of the rounded exact value where the f32 sum cannot move it further
    rows = bound <= ulp_bf16(y64) / 4
    assert rows.sum() >= y64.size // 2, (
        f"gemv_bf16: only {rows.sum()}/{y64.size} rows checkable {describe(seed, **ctx)}")
    assert_bf16(got16[rows], encode_bf16(y64[rows]), "gemv_bf16 bf16 vs rounded f64 dot", seed,
                max_ulp=GEMV_BF16_MAX_ULP, max_frac=1.0, **ctx)


@pytest.mark.parametrize("O,K", GEMV_SHAPES)
def test_gemv_bf16(O, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    w = rand_bf16(rng, (O, K), 1.0, spread=3)
    x = rand_bf16(rng, (K,), 1.0, spread=3)
    _check_gemv(w, x, 1, seed, O=O, K=K)


@pytest.mark.parametrize("O,K,groups", [(8192, 4096, 8), (64, 2048, 8), (24, 264, 3), (10, 1032, 2),
                                        (21, 4416, 3)])
def test_gemv_bf16_grouped(O, K, groups):
    """groups > 1 (wo_a: 8 groups of [1024, 4096]): row o reads x[(o // (O / groups)) * K:][:K]."""
    seed = fresh_seed()
    rng = rng_for(seed)
    w = rand_bf16(rng, (O, K), 1.0, spread=3)
    x = rand_bf16(rng, (groups * K,), 1.0, spread=3)
    _check_gemv(w, x, groups, seed, O=O, K=K, groups=groups)


@pytest.mark.parametrize("O,K,groups", [(7, 1024, 1), (1027, 4096, 1), (100, 8192, 1), (33, 264, 1),
                                        (9, 1032, 1), (19, 4416, 1), (64, 8, 1), (8192, 4096, 8),
                                        (10, 1032, 2), (24, 264, 3)])
def test_gemv_bf16_exact_on_integer_data(O, K, groups):
    """w, x integers in [-8, 8]: every partial sum is an integer below 2^24, exact in f32 in any
    order, so the result must be the integer dot bit for bit (f32), and its RNE (bf16)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    wi = rng.integers(-8, 9, (O, K))
    xi = rng.integers(-8, 9, (groups * K,))
    want = (wi.reshape(groups, O // groups, K) @ xi.reshape(groups, K, 1))[..., 0].reshape(O)
    assert np.abs(want).max(initial=0) < 2 ** 24
    got32, got16 = _run_gemv(wi.astype(np.float32), xi.astype(np.float32), groups, seed, O=O, K=K, groups=groups)
    assert_same_bytes(got32, want.astype(np.float32), "gemv_bf16 f32 on integer data", seed, O=O, K=K, groups=groups)
    assert_same_bytes(got16, encode_bf16(want.astype(np.float32)), "gemv_bf16 bf16 on integer data", seed,
                      O=O, K=K, groups=groups)


def test_gemv_bf16_deterministic_and_row_independent():
    """Two launches: identical bytes.  A row's bits do not depend on O or on where the row sits
    (sub-matrices starting at other CTA/warp offsets), and a grouped launch equals the plain
    launch of each group's rows with that group's x."""
    seed = fresh_seed()
    rng = rng_for(seed)
    O, K, groups = 1029, 4416, 3
    w = rand_bf16(rng, (O, K), 1.0, spread=3)
    x = rand_bf16(rng, (groups * K,), 1.0, spread=3)
    wg, xg = cp.asarray(bits_of(w)), cp.asarray(bits_of(x))
    x0 = xg[:K]
    for dtype in (cp.float32, cp.uint16):
        full1, full2 = cp.empty(O, dtype), cp.empty(O, dtype)
        DK.gemv_bf16(wg, x0, full1)
        DK.gemv_bf16(wg, x0, full2)
        f1 = full1.get()
        assert_same_bytes(full2.get(), f1, "gemv_bf16 second launch", seed, dtype=dtype.__name__)
        for a, b in ((0, 1), (5, 18), (1026, 1029), (3, 1027), (8, 16), (1000, 1029)):
            part = cp.empty(b - a, dtype)
            DK.gemv_bf16(wg[a:b], x0, part)
            assert_same_bytes(part.get(), f1[a:b], f"gemv_bf16 rows [{a}, {b}) alone vs in [{O}]", seed,
                              dtype=dtype.__name__)
        grouped = cp.empty(O, dtype)
        DK.gemv_bf16(wg, xg, grouped, groups=groups)
        gr = grouped.get()
        rpg = O // groups
        for g in range(groups):
            part = cp.empty(rpg, dtype)
            DK.gemv_bf16(wg[g * rpg:(g + 1) * rpg], xg[g * K:(g + 1) * K], part)
            assert_same_bytes(gr[g * rpg:(g + 1) * rpg], part.get(), f"gemv_bf16 group {g} vs plain", seed,
                              dtype=dtype.__name__)


@pytest.mark.parametrize("O,K,groups", [(7, 1024, 1), (13, 264, 1), (1027, 4096, 1), (9, 1032, 1),
                                        (33, 4416, 1), (4096, 1024, 1), (24, 264, 3), (10, 1032, 2),
                                        (21, 4416, 3), (8192, 4096, 8), (1, 2048, 1)])
def test_gemv_bf16_rows_per_warp(O, K, groups):
    """Every rows-per-warp kernel (gemv_bf16_r1/r2/r4) gives the bytes of R = 1 (one warp per
    row), f32 and bf16 out, guards untouched: the last warp's rows past O (O % R != 0) are
    computed on a clamped row and not stored, and a grouped launch keeps a warp's rows in one
    group (rows per group 8, 5, 7, 1024: R lowered to a divisor by the default)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    wg = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    xg = cp.asarray(bits_of(rand_bf16(rng, (groups * K,), 1.0, spread=3)))
    rpg = O // groups if groups > 1 else 0
    for dtype, fill in ((cp.float32, np.float32(-1234.5)), (cp.uint16, np.uint16(0x7FC1))):
        ref = cp.empty(O, dtype)
        DK.gemv_bf16(wg, xg, ref, groups=groups, rows_per_warp=1)
        ref = ref.get()
        for R in [None] + [r for r in DK.GEMV_ROWS[False] if rpg % r == 0]:
            buf, y = _guarded(O, dtype, fill)
            DK.gemv_bf16(wg, xg, y, groups=groups, rows_per_warp=R)
            ctx = dict(O=O, K=K, groups=groups, R=R, dtype=np.dtype(dtype).name)
            assert_same_bytes(y.get(), ref, "gemv_bf16 rows_per_warp R vs 1", seed, **ctx)
            _check_guards(buf, fill, "gemv_bf16 rows_per_warp", seed, **ctx)


def test_gemv_bf16_refusals():
    w = cp.zeros((16, 264), cp.uint16)
    x = cp.zeros(264, cp.uint16)
    with pytest.raises(AssertionError, match="multiple of 8"):
        DK.gemv_bf16(cp.zeros((16, 12), cp.uint16), cp.zeros(12, cp.uint16), cp.empty(16, cp.float32))
    with pytest.raises(AssertionError, match=r"gemv_bf16\.x: 256 values, expected 1 \* 264"):
        DK.gemv_bf16(w, cp.zeros(256, cp.uint16), cp.empty(16, cp.float32))
    with pytest.raises(AssertionError, match=r"gemv_bf16\.x: dtype float32"):
        DK.gemv_bf16(w, cp.zeros(264, cp.float32), cp.empty(16, cp.float32))
    with pytest.raises(AssertionError, match=r"gemv_bf16\.out"):
        DK.gemv_bf16(w, x, cp.empty(16, cp.float16))
    with pytest.raises(AssertionError, match=r"gemv_bf16\.out"):
        DK.gemv_bf16(w, x, cp.empty(15, cp.float32))
    with pytest.raises(AssertionError, match="not divisible into 3 groups"):
        DK.gemv_bf16(w, cp.zeros(3 * 264, cp.uint16), cp.empty(16, cp.float32), groups=3)
    with pytest.raises(AssertionError, match=r"rows_per_warp 8 not in"):     # bf16: R <= 4
        DK.gemv_bf16(w, x, cp.empty(16, cp.float32), rows_per_warp=8)
    with pytest.raises(AssertionError, match=r"\(rows_per_warp, trips\) \(4, 2\) not in"):  # T = 2: FP8 only
        DK.gemv_bf16(w, x, cp.empty(16, cp.float32), rows_per_warp=4, trips=2)
    with pytest.raises(AssertionError, match=r"rows_per_warp 4 does not divide the 2 rows per group"):
        DK.gemv_bf16(w, cp.zeros(8 * 264, cp.uint16), cp.empty(16, cp.float32), groups=8, rows_per_warp=4)


# ------------------------------------------------------------------------------ gemv_bf16_multi
# (K, entries): ("out", rows, bf16?) a plain projection; ("pend", ratio, overlap, C) the two
# pending-row entries of one compressor (kv: no ape; score: + ape), as step_device builds them.
# 3..7 projections, mixed outputs, row counts that put several segments into one CTA of 8 warps.
MULTI_TABLES = [
    (4096, [("out", 1024, True), ("out", 512, True), ("out", 1024, False), ("out", 1024, False),
            ("out", 256, False), ("out", 256, False), ("out", 64, True)]),
    (264, [("out", 1, False), ("out", 13, True), ("out", 7, False)]),
    (8192, [("out", 9, False), ("out", 4096, True), ("out", 3, True), ("out", 17, False)]),
    (1032, "random"),
    (4416, "random"),
    # the attention group of a CSA layer: wq_a, wkv, compressor (4, overlap, 2 x 512), indexer
    # compressor (4, overlap, 2 x 128), indexer weights_proj
    (4096, [("out", 1024, True), ("out", 512, True), ("pend", 4, True, 1024), ("pend", 4, True, 256),
            ("out", 64, False)]),
    # an HCA layer: wq_a, wkv, compressor (128, plain, 512)
    (4096, [("out", 1024, True), ("out", 512, True), ("pend", 128, False, 512)]),
    # odd sizes around pending entries (rows not multiples of 8)
    (264, [("out", 3, False), ("pend", 4, True, 20), ("out", 5, True), ("pend", 8, False, 12)]),
]


def _multi_positions(entries):
    ratios = {e[1] for e in entries if e[0] == "pend"}
    extra = set()
    for r in ratios:
        extra |= {r - 1, r, 2 * r - 1, 2 * r}
    return sorted(set(BOUNDARY) | extra)


@pytest.mark.parametrize("rows_per_warp", DK.MULTI_ROWS)
@pytest.mark.parametrize("K,entries", MULTI_TABLES)
def test_gemv_bf16_multi(K, entries, rows_per_warp):
    """One launch over a GemvTable, at the boundary positions: a plain projection == gemv_bf16 of
    it alone, byte for byte (the same warp_rows_dot order per row); a pending-row pair == the twin of
    gemv_bf16 (f32) + add_ape + pending_write: row (pos % r) + (overlap ? r : 0) of kv gets W_kv x,
    of score f32(W_gate x + ape[pos % r]), every other pending row and every byte around the
    outputs unchanged; a second launch gives the same bytes."""
    seed = fresh_seed()
    rng = rng_for(seed)
    if entries == "random":
        n = int(rng.integers(3, 8))
        entries = [("out", int(rng.integers(1, 40)), bool(rng.integers(0, 2))) for _ in range(n)]
    ctx = dict(K=K, entries=entries, rows_per_warp=rows_per_warp)
    x = cp.asarray(bits_of(rand_bf16(rng, (K,), 1.0, spread=3)))
    table_entries, checks = [], []
    for e in entries:
        if e[0] == "out":
            _, rows, is_bf16 = e
            w = cp.asarray(bits_of(rand_bf16(rng, (rows, K), 1.0, spread=3)))
            fill = np.uint16(0x7FC1) if is_bf16 else np.float32(-1234.5)
            buf, out = _guarded(rows, cp.uint16 if is_bf16 else cp.float32, fill)
            alone = cp.empty(out.shape, out.dtype)
            DK.gemv_bf16(w, x, alone)
            table_entries.append((w, out))
            checks.append(("out", buf, out, fill, alone.get()))
        else:
            _, r, overlap, C = e
            wkv = cp.asarray(bits_of(rand_bf16(rng, (C, K), 1.0, spread=3)))
            wg = cp.asarray(bits_of(rand_bf16(rng, (C, K), 1.0, spread=3)))
            ape = rng.standard_normal((r, C)).astype(np.float32)
            (kfull, kv, dkfull, dkv), (sfull, sc, dsfull, dsc) = _rand_pending(rng, r, overlap, C)
            a32, z32 = cp.empty(C, cp.float32), cp.empty(C, cp.float32)
            DK.gemv_bf16(wkv, x, a32)
            DK.gemv_bf16(wg, x, z32)
            off = r if overlap else 0
            table_entries += [(wkv, dkv, None, off, r), (wg, dsc, cp.asarray(ape), off, r)]
            checks.append(("pend", (kfull, kv, dkfull), (sfull, sc, dsfull), a32.get(), z32.get(), ape, r, overlap))
    table = DK.GemvTable(table_entries, K, rows_per_warp=rows_per_warp)
    assert table.nseg == len(table_entries), f"GemvTable.nseg {table.nseg} {describe(seed, **ctx)}"
    for p in _multi_positions(entries):
        DK.gemv_bf16_multi(table, x, _pos(p))
        for i, c in enumerate(checks):
            if c[0] == "out":
                _, buf, out, fill, want = c
                assert_same_bytes(out.get(), want, f"gemv_bf16_multi entry {i} vs gemv_bf16", seed, pos=p, **ctx)
                _check_guards(buf, fill, f"gemv_bf16_multi entry {i}", seed, pos=p, **ctx)
            else:
                _, (kfull, kv, dkfull), (sfull, sc, dsfull), a, z, ape, r, overlap = c
                pending_write_twin(kv, sc, p, a, z + ape[p % r], r, overlap)     # f32 + f32: RN
                assert_same_bytes(dkfull.get(), kfull, f"gemv_bf16_multi entry {i} pending kv", seed,
                                  pos=p, **ctx)
                assert_same_bytes(dsfull.get(), sfull, f"gemv_bf16_multi entry {i} pending score (+ ape)", seed,
                                  pos=p, **ctx)
    # a second launch at the last position: the same bytes everywhere
    frames = [buf for c in checks for buf in ((c[1],) if c[0] == "out" else (c[1][2], c[2][2]))]
    before = [f.get() for f in frames]
    DK.gemv_bf16_multi(table, x, _pos(p))
    for i, (f, b) in enumerate(zip(frames, before)):
        assert_same_bytes(f.get(), b, f"gemv_bf16_multi output frame {i}: second launch", seed, pos=p, **ctx)


def test_gemv_bf16_multi_refusals():
    K = 264
    w = cp.zeros((16, K), cp.uint16)
    pos = _pos(0)
    with pytest.raises(AssertionError, match="no projections"):
        DK.GemvTable([], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.w\[0\]: shape \(16, 264\), expected \[\*, 256\]"):
        DK.GemvTable([(w, cp.empty(16, cp.float32))], 256)
    with pytest.raises(AssertionError, match=r"GemvTable\.w\[1\]: shape \(8, 256\), expected \[\*, 264\]"):
        DK.GemvTable([(w, cp.empty(16, cp.float32)), (cp.zeros((8, 256), cp.uint16), cp.empty(8, cp.float32))], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.w\[0\]: dtype float32"):
        DK.GemvTable([(cp.zeros((16, K), cp.float32), cp.empty(16, cp.float32))], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.out\[0\]"):
        DK.GemvTable([(w, cp.empty(15, cp.float32))], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.out\[0\]"):
        DK.GemvTable([(w, cp.empty(16, cp.float16))], K)
    # pending-row entries: (w, pending [rows, O] f32, ape [r, O] f32 | None, ring_off, r)
    with pytest.raises(AssertionError, match=r"GemvTable\.pending\[0\]: rows 4 < offset 4 \+ r 4"):
        DK.GemvTable([(w, cp.zeros((4, 16), cp.float32), None, 4, 4)], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.pending\[0\]"):
        DK.GemvTable([(w, cp.zeros((8, 15), cp.float32), None, 4, 4)], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.pending\[0\]: dtype"):
        DK.GemvTable([(w, cp.zeros((8, 16), cp.uint16), None, 4, 4)], K)
    with pytest.raises(AssertionError, match=r"GemvTable\.ape\[0\]"):
        DK.GemvTable([(w, cp.zeros((8, 16), cp.float32), cp.zeros((3, 16), cp.float32), 4, 4)], K)
    with pytest.raises(AssertionError, match=r"GemvTable: rows_per_warp 2 not in"):
        DK.GemvTable([(w, cp.empty(16, cp.float32))], K, rows_per_warp=2)
    with pytest.raises(AssertionError, match=r"GemvTable: K = 12 must be a multiple of 8"):
        DK.GemvTable([(cp.zeros((16, 12), cp.uint16), cp.empty(16, cp.float32))], 12)
    table = DK.GemvTable([(w, cp.empty(16, cp.float32))], K)
    with pytest.raises(AssertionError, match=r"gemv_bf16_multi\.x: 256 values, the table's K is 264"):
        DK.gemv_bf16_multi(table, cp.zeros(256, cp.uint16), pos)
    with pytest.raises(AssertionError, match=r"gemv_bf16_multi\.x: dtype float32"):
        DK.gemv_bf16_multi(table, cp.zeros(K, cp.float32), pos)
    with pytest.raises(AssertionError, match=r"gemv_bf16_multi\.pos"):
        DK.gemv_bf16_multi(table, cp.zeros(K, cp.uint16), cp.zeros(2, cp.int32))


# ------------------------------------------------------------------------------ gemv_bf16_swiglu
@pytest.mark.parametrize("outs_per_warp", (1, 2))
@pytest.mark.parametrize("O,K,limit", [(2048, 4096, 10.0), (13, 264, 10.0), (64, 1032, 0.0), (7, 8192, 10.0),
                                       (40, 4416, 2.5)])
def test_gemv_bf16_swiglu(O, K, limit, outs_per_warp):
    """== gemv_bf16 (bf16 out) of W1 and of W3, then moe.swiglu (swiglu_clamped_bf16, no routing
    weight), byte for byte (the header's contract); the dots (|.| up to ~sqrt(K) * 8) go well past
    the clamp.  The SwiGLU itself is checked against the oracle in test_kernels_moe."""
    from memra_dsv4.gpu.ops import moe as MO
    seed = fresh_seed()
    rng = rng_for(seed)
    w1 = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    w3 = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    x = cp.asarray(bits_of(rand_bf16(rng, (K,), 1.0, spread=3)))
    buf, h = _guarded(O, cp.uint16, np.uint16(0x7FC1))
    P = outs_per_warp
    DK.gemv_bf16_swiglu(w1, w3, x, h, limit, outs_per_warp=P)
    _check_guards(buf, np.uint16(0x7FC1), "gemv_bf16_swiglu", seed, O=O, K=K, limit=limit, P=P)
    Op = (O + 7) // 8 * 8                                 # moe.swiglu wants rows of 8k values
    g, u = cp.zeros((1, Op), cp.uint16), cp.zeros((1, Op), cp.uint16)
    DK.gemv_bf16(w1, x, g[0, :O])
    DK.gemv_bf16(w3, x, u[0, :O])
    want = MO.swiglu(g, u, limit).get()[0, :O]
    assert_same_bytes(h.get(), want, "gemv_bf16_swiglu vs gemv_bf16 x 2 + swiglu", seed, O=O, K=K, limit=limit,
                      P=P)
    h2 = cp.empty(O, cp.uint16)
    DK.gemv_bf16_swiglu(w1, w3, x, h2, limit, outs_per_warp=P)
    assert_same_bytes(h2.get(), want, "gemv_bf16_swiglu second launch", seed, O=O, K=K, limit=limit, P=P)


def test_gemv_bf16_swiglu_refusals():
    w = cp.zeros((16, 264), cp.uint16)
    x, h = cp.zeros(264, cp.uint16), cp.empty(16, cp.uint16)
    with pytest.raises(AssertionError, match=r"gemv_bf16_swiglu: w1 != w3"):
        DK.gemv_bf16_swiglu(w, cp.zeros((16, 256), cp.uint16), x, h, 10.0)
    with pytest.raises(AssertionError, match=r"gemv_bf16_swiglu: x 256"):
        DK.gemv_bf16_swiglu(w, w, cp.zeros(256, cp.uint16), h, 10.0)
    with pytest.raises(AssertionError, match=r"gemv_bf16_swiglu: x 264, h 15"):
        DK.gemv_bf16_swiglu(w, w, x, cp.empty(15, cp.uint16), 10.0)
    with pytest.raises(AssertionError, match=r"gemv_bf16_swiglu\.h: dtype float32"):
        DK.gemv_bf16_swiglu(w, w, x, cp.empty(16, cp.float32), 10.0)
    with pytest.raises(AssertionError, match=r"gemv_bf16_swiglu: outs_per_warp 4 not in"):
        DK.gemv_bf16_swiglu(w, w, x, h, 10.0, outs_per_warp=4)


# ------------------------------------------------------------------------------ embed_gather
@pytest.mark.parametrize("V,D,hc", [(1000, 4096, 4), (37, 64, 4), (300, 1024, 1), (5, 8, 3)])
def test_embed_gather(V, D, hc):
    seed = fresh_seed()
    rng = rng_for(seed)
    embed = rng.integers(0, 1 << 16, (V, D), dtype=np.uint16)       # any bits (NaN patterns too)
    eg = cp.asarray(embed)
    for tok in sorted({0, 1, V - 1, int(rng.integers(0, V))}):
        full, view, dfull, dview = _framed(np.zeros((hc, D), np.uint16), rng)
        DK.embed_gather(cp.asarray(np.array([tok], np.int32)), eg, dview)
        view[:] = embed_gather_twin(tok, embed, hc)
        assert_same_bytes(dfull.get(), full, "embed_gather", seed, V=V, D=D, hc=hc, tok=tok)


def test_embed_gather_flash_vocab():
    """The Flash table [129280, 4096] (rows far into the buffer); the table is made on the device
    from an index hash, the twin reads the row back."""
    seed = fresh_seed()
    rng = rng_for(seed)
    V, D, hc = 129280, 4096, 4
    embed = ((cp.arange(V * D, dtype=cp.uint32) * cp.uint32(2654435761) + cp.uint32(seed & 0xFFFFFFFF))
             >> 16).astype(cp.uint16).reshape(V, D)
    for tok in sorted({0, V - 1, V // 2, int(rng.integers(0, V))}):
        full, view, dfull, dview = _framed(np.zeros((hc, D), np.uint16), rng)
        DK.embed_gather(cp.asarray(np.array([tok], np.int32)), embed, dview)
        view[:] = embed_gather_twin(0, embed[tok:tok + 1].get(), hc)
        assert_same_bytes(dfull.get(), full, "embed_gather (Flash vocab)", seed, tok=tok)
    del embed


# ------------------------------------------------------------------------------ step_scalars
@pytest.mark.parametrize("ratios", [(4, 128), (128, 4), (4,), (128,), (4, 128, 8, 16)])
def test_step_scalars(ratios):
    seed = fresh_seed()
    rng = rng_for(seed)
    positions = list(BOUNDARY) + [255, 511, 1000003, int(rng.integers(0, 1 << 20))]
    for p in positions:
        aux = cp.full(8, -7, cp.int32)
        DK.step_scalars(_pos(p), aux, ratios)
        got = aux.get()
        want = step_scalars_twin(p, ratios)
        assert_same_bytes(got[:1 + len(ratios)], want, "step_scalars", seed, pos=p, ratios=ratios)
        assert_same_bytes(got[5:], np.full(3, -7, np.int32), "step_scalars wrote past aux[4]", seed, pos=p)
        for i, r in enumerate(ratios):               # at an emit: the first token of the closed block
            if (p + 1) % r == 0:
                k = (p + 1) // r - 1
                assert hidx.emit_positions(k + 1, r)[k] == p and got[1 + i] == k * r, (
                    f"step_scalars: aux[{1 + i}] = {got[1 + i]} at emit pos {p}, entry {k}, ratio {r} "
                    f"{describe(seed)}")


# ------------------------------------------------------------------------------ ring_write
@pytest.mark.parametrize("W,d", [(W_FLASH, 512), (W_FLASH, 64), (5, 8), (7, 300)])
def test_ring_write(W, d):
    """Writes at the boundary positions in order (wrapping at W - 1 / W, 2W - 1 / 2W, ...); the
    whole ring (and the bytes around it) is compared after each write."""
    seed = fresh_seed()
    rng = rng_for(seed)
    full, ring, dfull, dring = _framed(rng.integers(0, 1 << 16, (W, d), dtype=np.uint16), rng)
    positions = sorted(set(BOUNDARY) | {W - 1, W, 2 * W - 1, 2 * W, 1000003})
    for p in positions:
        src = rng.integers(0, 1 << 16, d, dtype=np.uint16)
        DK.ring_write(_pos(p), cp.asarray(src), dring)
        ring_write_twin(ring, p, src)
        assert_same_bytes(dfull.get(), full, "ring_write", seed, W=W, d=d, pos=p)


@pytest.mark.parametrize("W,T", [(W_FLASH, 8), (W_FLASH, 2), (5, 5), (8, 3)])
@pytest.mark.parametrize("kind,ratio,width", [("window", 0, 0), ("hca", 4, 80), ("csa", 4, 16)])
def test_build_cand_rows(W, T, kind, ratio, width):
    """The device verify's form: T rows at pos0 + t in one launch (grid.y = T), with and without
    the shadow rows, == the host twin (gpu.hostmath.verify_candidates) row by row; the frame
    around the [T, K] block is untouched."""
    from memra_dsv4.gpu import hostmath as HM
    seed = fresh_seed()
    rng = rng_for(seed)
    K = W + width
    shadow = W + 40
    for p0 in sorted(set(BOUNDARY) | {W - T, W - 1, W, 2 * W - 1, 2 * W}):
        if p0 < 0:
            continue
        sels = [(_csa_sel(rng, p0 + t, width) if kind == "csa" else None) for t in range(T)]
        dsel = None if kind != "csa" else cp.asarray(np.stack(sels))
        pos = cp.asarray(np.arange(p0, p0 + T, dtype=np.int32))
        for sh in (0, shadow):
            full, cand, dfull, dcand = _framed(np.full((T, K), -7, np.int32), rng, g=2)
            DK.build_cand(pos, dcand, W, ratio, dsel, shadow_row=sh)
            for t in range(T):
                cand[t] = HM.verify_candidates(p0, t, T, W, ratio, K, sels[t], shadow_row=sh)
            assert_same_bytes(dfull.get(), full, "build_cand rows", seed, kind=kind, W=W, T=T, pos0=p0,
                              shadow=sh)


# ------------------------------------------------------------------------------ copy_words
@pytest.mark.parametrize("sizes", [[16], [16384, 16384, 4096, 4096], [131072], [48, 0, 1 << 20],
                                   [4096 * 7, 16 * 3]])
def test_copy_words(sizes):
    """One launch copies up to four ranges (the verify journal's pending snapshots / ring copy):
    every destination frame equals its source after it, and the frames around each destination
    keep their bytes (twin: the assignment)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    pairs, frames = [], []
    for n in sizes:   # rows of 16 B: _framed's guard rows are 16 B each side
        src = rng.integers(0, 1 << 32, max(n // 4, 0), dtype=np.uint32).reshape(-1, 4)
        full, host, dfull, dev = _framed(rng.integers(0, 1 << 32, src.shape, dtype=np.uint32), rng)
        host[...] = src
        pairs.append((dev, cp.asarray(src)))
        frames.append((dfull, full))
    DK.copy_words(pairs)
    for i, (dfull, full) in enumerate(frames):
        assert_same_bytes(dfull.get(), full, f"copy_words range {i}", seed, sizes=sizes)


def test_copy_words_refusals():
    a = cp.zeros(64, cp.uint32)
    with pytest.raises(AssertionError, match="pairs"):
        DK.copy_words([(a, a)] * 5)
    with pytest.raises(AssertionError, match="B\\)"):
        DK.copy_words([(a[:32], a[:16])])
    with pytest.raises(AssertionError, match="16-byte aligned"):
        DK.copy_words([(a[1:5], a[8:12])])
    with pytest.raises(AssertionError, match="multiple of 16"):
        DK.copy_words([(a[:3], a[8:11])])


# ------------------------------------------------------------------------------ pending rows
# (ratio, overlap, C): CSA main (4, 2 x 512), CSA indexer (4, 2 x 128), HCA (128, 512), and two
# combinations the model does not use (the kernels take ratio and overlap independently)
PENDING = [(4, True, 1024), (4, True, 256), (128, False, 512), (4, False, 64), (8, True, 40)]


def _rand_pending(rng, ratio, overlap, C):
    """Framed random (kv, score) [coff * r, C] (scores with -inf holes): two _framed tuples."""
    rows = (2 if overlap else 1) * ratio
    kv = rng.standard_normal((rows, C)).astype(np.float32)
    score = rng.standard_normal((rows, C)).astype(np.float32)
    score[rng.random((rows, C)) < 0.2] = -np.inf
    return _framed(kv, rng), _framed(score, rng)


@pytest.mark.parametrize("ratio,overlap,C", PENDING)
def test_pending_write(ratio, overlap, C):
    seed = fresh_seed()
    rng = rng_for(seed)
    (kfull, kv, dkfull, dkv), (sfull, score, dsfull, dsc) = _rand_pending(rng, ratio, overlap, C)
    for p in BOUNDARY:
        a = rng.standard_normal(C).astype(np.float32)
        z = rng.standard_normal(C).astype(np.float32)
        DK.pending_write(_pos(p), cp.asarray(a), cp.asarray(z), dkv, dsc, ratio, overlap)
        pending_write_twin(kv, score, p, a, z, ratio, overlap)
        ctx = dict(ratio=ratio, overlap=overlap, C=C, pos=p)
        assert_same_bytes(dkfull.get(), kfull, "pending_write kv", seed, **ctx)
        assert_same_bytes(dsfull.get(), sfull, "pending_write score", seed, **ctx)


@pytest.mark.parametrize("ratio,overlap,C", PENDING)
def test_pending_advance(ratio, overlap, C):
    """On a random state (any values): moves/resets only at emit positions, leaves it otherwise."""
    seed = fresh_seed()
    rng = rng_for(seed)
    positions = sorted(set(BOUNDARY) | {ratio - 1, ratio, 2 * ratio - 1, 3 * ratio - 1})
    for p in positions:
        (kfull, kv, dkfull, dkv), (sfull, score, dsfull, dsc) = _rand_pending(rng, ratio, overlap, C)
        DK.pending_advance(_pos(p), dkv, dsc, ratio, overlap)
        pending_advance_twin(kv, score, p, ratio, overlap)
        ctx = dict(ratio=ratio, overlap=overlap, C=C, pos=p, emit=(p + 1) % ratio == 0)
        assert_same_bytes(dkfull.get(), kfull, "pending_advance kv", seed, **ctx)
        assert_same_bytes(dsfull.get(), sfull, "pending_advance score", seed, **ctx)


@pytest.mark.parametrize("ratio,C", [(4, 1024), (4, 256), (128, 512), (16, 24)])
def test_pending_state_machine(ratio, C):
    """pending_write then pending_advance per token (the device step's order) from a fresh state
    (0, -inf) == host.pending.advance_pending fed one token at a time (overlap iff ratio 4, as
    in the model), compared after every position 0..300."""
    seed = fresh_seed()
    rng = rng_for(seed)
    overlap = cur_offset(ratio) > 0
    rows = (2 if overlap else 1) * ratio
    kfull, kv, dkfull, dkv = _framed(np.zeros((rows, C), np.float32), rng)
    sfull, score, dsfull, dsc = _framed(np.full((rows, C), -np.inf, np.float32), rng)
    for p in range(max(BOUNDARY) + 1):
        a = rng.standard_normal(C).astype(np.float32)
        z = rng.standard_normal(C).astype(np.float32)
        pg = _pos(p)
        DK.pending_write(pg, cp.asarray(a), cp.asarray(z), dkv, dsc, ratio, overlap)
        DK.pending_advance(pg, dkv, dsc, ratio, overlap)
        advance_pending(kv, score, a[None], z[None], p, ratio)
        ctx = dict(ratio=ratio, C=C, pos=p)
        assert_same_bytes(dkfull.get(), kfull, "pending rows kv vs advance_pending", seed, **ctx)
        assert_same_bytes(dsfull.get(), sfull, "pending rows score vs advance_pending", seed, **ctx)


# ------------------------------------------------------------------------------ entry_commit
@pytest.mark.parametrize("ratio,d,n_rows", [(4, 512, 100), (4, 128, 100), (128, 512, 8), (4, 512, 2),
                                            (128, 64, 1)])
def test_entry_commit(ratio, d, n_rows):
    """Writes row (pos + 1) / r - 1 only when (pos + 1) % r == 0 and that row exists; every other
    byte of dst (and around it) stays (n_rows = 2 / 1: emits past the buffer are dropped)."""
    seed = fresh_seed()
    rng = rng_for(seed)
    full, dst, dfull, ddst = _framed(rng.integers(0, 1 << 16, (n_rows, d), dtype=np.uint16), rng)
    positions = sorted(set(BOUNDARY) | {7, 11, 255, 383})
    for p in positions:
        src = rng.integers(0, 1 << 16, d, dtype=np.uint16)
        DK.entry_commit(_pos(p), cp.asarray(src), ddst, ratio)
        entry_commit_twin(dst, p, src, ratio)
        assert_same_bytes(dfull.get(), full, "entry_commit", seed, ratio=ratio, d=d, n_rows=n_rows, pos=p)


# ------------------------------------------------------------------------------ build_cand
def _csa_sel(rng, pos: int, width: int) -> np.ndarray:
    """An indexer selection as topk(order='index') gives it: min(width, n_complete(pos, 4)) entry
    ids < n_complete ascending, -1 padded to width."""
    n = int(hidx.n_complete(pos, 4))
    m = min(width, n)
    sel = np.full(width, -1, np.int32)
    sel[:m] = np.sort(rng.choice(n, m, replace=False))
    return sel


@pytest.mark.parametrize("W", [W_FLASH, 5])
@pytest.mark.parametrize("kind,ratio,width", [("window", 0, 0), ("window", 0, 16), ("hca", 128, 8),
                                              ("hca", 4, 80), ("csa", 4, 512), ("csa", 4, 16)])
def test_build_cand(W, kind, ratio, width):
    seed = fresh_seed()
    rng = rng_for(seed)
    K = W + width
    positions = sorted(set(BOUNDARY) | {W - 1, W, 2 * W - 1, 2 * W})
    if kind == "hca":
        assert hidx.n_complete(max(positions), ratio) < width, "test setup: HCA width too small"
    for p in positions:
        sel = _csa_sel(rng, p, width) if kind == "csa" else None
        full, cand, dfull, dcand = _framed(np.full(K, -7, np.int32), rng, g=4)
        DK.build_cand(_pos(p), dcand, W, ratio, None if sel is None else cp.asarray(sel))
        cand[:] = build_cand_twin(p, K, W, ratio, sel)
        assert_same_bytes(dfull.get(), full, "build_cand", seed, kind=kind, W=W, ratio=ratio, K=K, pos=p)
