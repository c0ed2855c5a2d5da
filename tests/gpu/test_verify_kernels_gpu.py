"""The verify step's kernels (docs/verify_step_plan.md), stage 1: the multi-row bf16 GEMV
(decode.cu gemv_bf16_x{2,4,8}_r{4,2,1}, ops_decode.gemv_bf16_xrows).

* Row j of a launch over nx rows is bit-identical to gemv_bf16 of X[j] alone (f32 and bf16
  outputs), for nx = 1..8, plain and grouped weights, K with and without tail chunks, O not a
  multiple of the rows per warp, X / out as row-strided views; nothing outside out is written.
* Against the NumPy twin (test_kernels_decode.gemv_twin, the float64 dot): within the GEMV's
  f32 bound (GEMV_F32_ULPS of sum |w x|), which the equality above implies but is checked here
  directly too.
* Refusals: nx = 0 or 9, a K that is not a multiple of 8, a wrong out shape.
* The table form (gemv_bf16_multi_x*, ops_decode.gemv_bf16_multi_rows): row j == the one-row
  GemvTable's launch for X[j] at pos[j], byte for byte (staging rows of the ring entries == the
  pending row that launch writes, and == the staging row of a one-row table in the staging form,
  ring offset -1); its refusals.
* The x-rows SwiGLU (gemv_bf16_swiglu_x*): row j == gemv_bf16_swiglu for X[j], byte for byte.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernels_decode import GEMV_F32_ULPS, _ulp_f32, gemv_twin  # prepend import mode

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import encode_bf16  # noqa: E402
from memra_dsv4.gpu import ops_decode as DK  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(512, 1024, 1), (1000, 520, 1), (96, 4096, 1), (1024, 264, 8), (4097, 1032, 1)]


def _bf16(rng, shape):
    return encode_bf16(rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape)))


def _values(bits):
    """bf16 bits -> their float32 values (exact): what the twin takes."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("O,K,groups", SHAPES)
@pytest.mark.parametrize("nx", [1, 2, 3, 4, 5, 8])
def test_xrows_rows_equal_single_row_gemv(O, K, groups, nx):
    rng = np.random.default_rng(O * 31 + K + nx)
    w = _bf16(rng, (O, K))
    ld = groups * K + 64                                   # row-strided X: a view
    Xbig = _bf16(rng, (nx, ld))
    wg, Xg = cp.asarray(w), cp.asarray(Xbig)[:, :groups * K]
    for dt, fill in ((cp.float32, np.float32(-1234.5)), (cp.uint16, np.uint16(0x7FC1))):
        big = cp.full((nx, O + 16), fill, dtype=dt)        # guard columns past O
        out = big[:, :O]
        DK.gemv_bf16_xrows(wg, Xg, out, groups=groups)
        got = big.get()
        assert (got[:, O:] == fill).all(), f"gemv_bf16_xrows wrote past O ({dt})"
        for j in range(nx):
            ref = cp.empty(O, dt)
            DK.gemv_bf16(wg, cp.ascontiguousarray(Xg[j]), ref, groups=groups)
            assert np.array_equal(got[j, :O].view(np.uint8), ref.get().view(np.uint8)), (
                f"row {j} of {nx}: not gemv_bf16's bits ({dt}, O={O} K={K} groups={groups})")
            if dt == cp.float32:
                y64, s = gemv_twin(_values(w), _values(Xbig[j, :groups * K]), groups)
                err = np.abs(got[j, :O].astype(np.float64) - y64)
                assert (err <= GEMV_F32_ULPS * _ulp_f32(s)).all(), f"row {j}: off the f64 dot"


def test_refusals():
    w = cp.zeros((64, 128), cp.uint16)
    for X, out, msg in [(cp.zeros((0, 128), cp.uint16), cp.zeros((0, 64), cp.float32), "rows"),
                        (cp.zeros((9, 128), cp.uint16), cp.zeros((9, 64), cp.float32), "rows"),
                        (cp.zeros((2, 128), cp.uint16), cp.zeros((2, 63), cp.float32), "out")]:
        with pytest.raises(AssertionError, match=msg):
            DK.gemv_bf16_xrows(w, X, out)
    with pytest.raises(AssertionError, match="multiple of 8"):
        DK.gemv_bf16_xrows(cp.zeros((64, 12), cp.uint16), cp.zeros((2, 12), cp.uint16),
                           cp.zeros((2, 64), cp.float32))


# ------------------------------------------------ the table form: gemv_bf16_multi_x{NX}_r{R}
# (ops_decode.gemv_bf16_multi_rows over a row-form GemvTable: the device verify's xn projections
# of its T rows in one launch).  Row j == gemv_bf16_multi of the one-row table for X[j] at
# pos[j], byte for byte: each plain output's row j, and each ring entry's staging row j == the
# pending row pos[j] % r + ring_off the one-row launch writes (ape added on the score entry);
# rows past nx untouched.  Segments: bf16 and f32 plain outputs, an overlapping ring pair (r 4,
# offset 4) and a plain one (r 8); O not a multiple of R; K with and without tail chunks.
def _table_entries(rng, K, outs, pend_rows):
    """(one-row entries, row-form entries) over the same weights; outs: (O, dtype) plain,
    pend_rows: (O, r, ring_off) ring pairs (kv without ape, score with)."""
    one, rows = [], []
    for O, dt in outs:
        w = cp.asarray(_bf16(rng, (O, K)))
        one.append((w, cp.zeros(O, dt)))
        rows.append((w, cp.full((8, O), 0x7FC1 if dt == cp.uint16 else -1234.5, dt)))
    for O, r, off in pend_rows:
        for with_ape in (False, True):
            w = cp.asarray(_bf16(rng, (O, K)))
            ape = cp.asarray(rng.standard_normal((r, O)).astype(np.float32)) if with_ape else None
            one.append((w, cp.zeros((off + r, O), cp.float32), ape, off, r))
            rows.append((w, cp.full((8, O), -1234.5, cp.float32), ape, off, r))
    return one, rows


@pytest.mark.parametrize("K", [1024, 520])
@pytest.mark.parametrize("nx", [1, 2, 3, 4, 5, 8])
def test_multi_rows_equal_one_row_tables(K, nx):
    rng = np.random.default_rng(K * 7 + nx)
    one_e, rows_e = _table_entries(rng, K, [(1030, cp.uint16), (61, cp.float32)],
                                   [(256, 4, 4), (129, 8, 0)])
    R = DK.xrows_R(nx)
    tab = DK.GemvTable(rows_e, K, rows_per_warp=R, rows=8)
    one = DK.GemvTable(one_e, K)
    X = cp.asarray(_bf16(rng, (nx, K + 8)))[:, :K]            # row-strided view
    p0 = int(rng.integers(0, 5000))
    pos = cp.arange(p0, p0 + nx, dtype=cp.int32)
    # the one-row table in the staging form (ring offset -1: the device verify's per-row tables)
    stg_e = [e if len(e) == 2 else (e[0], cp.full(e[1].shape[1], -1234.5, cp.float32), e[2], -1, e[4])
             for e in one_e]
    stg = DK.GemvTable(stg_e, K)
    before = [e[1].copy() for e in rows_e]
    DK.gemv_bf16_multi_rows(tab, X, pos)
    for j in range(nx):
        xj = cp.ascontiguousarray(X[j])
        DK.gemv_bf16_multi(stg, xj, pos[j:j + 1])
        for i, (es, er) in enumerate(zip(stg_e, rows_e)):
            if len(es) > 2:
                assert np.array_equal(es[1].get().view(np.uint8), er[1][j].get().view(np.uint8)), (
                    f"segment {i}, row {j}: the staging-form one-row table differs from the row form")
        DK.gemv_bf16_multi(one, xj, pos[j:j + 1])
        for i, (eo, er) in enumerate(zip(one_e, rows_e)):
            got = er[1][j].get()
            if len(eo) == 2:
                want = eo[1].get()
            else:
                r, off = eo[4], eo[3]
                want = eo[1][(p0 + j) % r + off].get()
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
                f"segment {i}, row {j} of {nx} (R {R}, K {K}, pos {p0 + j}): not the one-row table's bits")
    for i, er in enumerate(rows_e):
        assert cp.array_equal(er[1][nx:], before[i][nx:]), f"segment {i}: rows past {nx} written"


def test_multi_rows_refusals():
    rng = np.random.default_rng(3)
    K = 256
    one_e, rows_e = _table_entries(rng, K, [(64, cp.float32)], [(32, 4, 4)])
    tab = DK.GemvTable(rows_e, K, rows_per_warp=4, rows=8)
    X = cp.zeros((3, K), cp.uint16)
    with pytest.raises(AssertionError, match="serves <= 2"):     # R 4 is the 2-row kernel's
        DK.gemv_bf16_multi_rows(tab, X, cp.zeros(3, cp.int32))
    with pytest.raises(AssertionError, match="row-form"):
        DK.gemv_bf16_multi_rows(DK.GemvTable(one_e, K), X[:2], cp.zeros(2, cp.int32))
    with pytest.raises(AssertionError, match="pos"):
        DK.gemv_bf16_multi_rows(tab, X[:2], cp.zeros(3, cp.int32))
    with pytest.raises(AssertionError, match="row form wants"):
        DK.GemvTable([(rows_e[0][0], cp.zeros((4, 64), cp.float32))], K, rows_per_warp=4, rows=8)
    with pytest.raises(AssertionError, match="rows_per_warp"):
        DK.GemvTable(rows_e, K, rows_per_warp=8, rows=8)


# ------------------------------------------------ gemv_bf16_swiglu_x{NX}_p{P}: the shared expert's
# W1 / W3 + SwiGLU for the rows in one launch == gemv_bf16_swiglu per row, byte for byte (rows
# whose gate / up values cross the clamp limit: scaled x), O not a multiple of P, K with a tail.
@pytest.mark.parametrize("O,K", [(2048, 4096), (1030, 520)])
@pytest.mark.parametrize("nx", [1, 2, 3, 4, 5, 8])
def test_swiglu_xrows_equal_row_launches(O, K, nx):
    rng = np.random.default_rng(O + K + nx)
    w1, w3 = cp.asarray(_bf16(rng, (O, K))), cp.asarray(_bf16(rng, (O, K)))
    X = cp.asarray(_bf16(rng, (nx, K + 8)))[:, :K]
    limit = 10.0
    big = cp.full((nx, O + 8), 0x7FC1, cp.uint16)
    DK.gemv_bf16_swiglu_xrows(w1, w3, X, big[:, :O], limit)
    got = big.get()
    assert (got[:, O:] == 0x7FC1).all(), "gemv_bf16_swiglu_xrows wrote past O"
    clamped = 0
    for j in range(nx):
        ref = cp.empty(O, cp.uint16)
        DK.gemv_bf16_swiglu(w1, w3, cp.ascontiguousarray(X[j]), ref, limit)
        assert np.array_equal(got[j, :O], ref.get()), f"row {j} of {nx}: not gemv_bf16_swiglu's bits (O={O} K={K})"
        g = cp.empty(O, cp.float32)
        DK.gemv_bf16(w1, cp.ascontiguousarray(X[j]), g)
        clamped += int((cp.abs(g) > limit).sum())
    assert clamped > 0, "no gate value crossed the clamp: the limit path was not exercised"

