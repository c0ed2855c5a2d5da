"""The split form of the decode indexer (kernels_cu/indexer.cu indexer_scores_tiles_d128 +
indexer_select_d128, ops.indexer.scores_topk(form='split')) without a GPU.

* The switch: ops.indexer.select_form() is SELECT_FORM ('auto') unless MEMRA_DSV4_INDEXER_SELECT
  (fused | split | auto) is set, read at every call; any other value is a ValueError naming the
  variable and the allowed values; resolve_form turns 'auto' into 'split' when N > k, else 'fused'.
  bench.decode_step's idxsel=fused|split|auto arms set that variable.
* The launches (fake CuPy, fake kernels checked against the .cu signatures): 'fused' is the one
  indexer_fused_d128 launch; 'split' is indexer_scores_tiles_d128 on the fused grid and shared
  memory with the histogram workspace, then indexer_select_d128 on (1,) x (1024,) without dynamic
  shared memory, reading the same workspace.
* The selection algorithm: a NumPy emulation of the split form (the scoring launch's high-byte
  histogram of the valid keys, then indexer_select_d128: find_bucket on it, the low bytes of bucket
  b1, find_bucket again, the 32-warp count pass and ballot-prefix ordered compaction) equals a
  plain reference (the ksel largest keys, ties to the lower index, ascending index order, -1
  padded) on random rows with many ties, +0 / -0, -inf, NaN keys and n at and around k.  The
  emulation with 4 warps (the fused kernel's last CTA) gives the same rows.
* The source: the scores-only kernel and the fused kernel are both one call of the templated
  if_body (the same score arithmetic by construction); the select kernel has the stated launch
  bounds, opens with PDL_ENTRY(), reads the scores through ld.cg only, and reuses the helpers.
The GPU bytes: tests/gpu/test_kernels_indexer.py -k split.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tests.test_kernel_sources import KDIR, braced, fake_ops_module, kernel_signatures

SRC = open(os.path.join(KDIR, "indexer.cu"), encoding="utf-8").read()


# ------------------------------------------------------------------------------------ the switch
@pytest.fixture
def IX():
    import importlib
    return importlib.import_module("memra_dsv4.gpu.ops.indexer")


def test_select_form_default_module_and_env(IX, monkeypatch):
    monkeypatch.delenv(IX.SELECT_ENV, raising=False)
    assert IX.SELECT_ENV == "MEMRA_DSV4_INDEXER_SELECT"
    assert IX.SELECT_FORMS == ("fused", "split", "auto")
    assert IX.SELECT_FORM == "auto" and IX.select_form() == "auto"
    monkeypatch.setattr(IX, "SELECT_FORM", "split")
    assert IX.select_form() == "split"
    monkeypatch.setenv(IX.SELECT_ENV, "fused")          # the env over the module switch
    assert IX.select_form() == "fused"
    monkeypatch.setattr(IX, "SELECT_FORM", "fused")
    monkeypatch.setenv(IX.SELECT_ENV, "split")
    assert IX.select_form() == "split"
    monkeypatch.setenv(IX.SELECT_ENV, "")                # empty: the module switch
    assert IX.select_form() == "fused"
    monkeypatch.setenv(IX.SELECT_ENV, "auto")
    assert IX.select_form() == "auto"


def test_resolve_form_auto_splits_only_when_the_row_can_drop_keys(IX):
    assert IX.resolve_form("auto", 513, 512) == "split"
    assert IX.resolve_form("auto", 8192, 512) == "split"
    assert IX.resolve_form("auto", 512, 512) == "fused"
    assert IX.resolve_form("auto", 256, 512) == "fused"
    for form in ("fused", "split"):
        assert IX.resolve_form(form, 8192, 512) == form and IX.resolve_form(form, 100, 512) == form


@pytest.mark.parametrize("bad", ["1", "on", "Split", "fused "])
def test_select_form_bad_env_names_variable_and_values(IX, monkeypatch, bad):
    monkeypatch.setenv(IX.SELECT_ENV, bad)
    with pytest.raises(ValueError, match=r"MEMRA_DSV4_INDEXER_SELECT.*fused, split, auto"):
        IX.select_form()


def test_select_form_bad_module_value(IX, monkeypatch):
    monkeypatch.delenv(IX.SELECT_ENV, raising=False)
    monkeypatch.setattr(IX, "SELECT_FORM", "both")
    with pytest.raises(ValueError, match=r"SELECT_FORM.*fused, split, auto"):
        IX.select_form()


def test_bench_decode_idxsel_arm_sets_the_env():
    from bench.decode_step import _arm_settings, _kernel_env, check_arms
    assert _kernel_env({"idxsel": "split"}, None) == {"MEMRA_DSV4_INDEXER_SELECT": "split"}
    assert _kernel_env({"idxsel": "fused"}, None) == {"MEMRA_DSV4_INDEXER_SELECT": "fused"}
    assert _arm_settings()["idxsel"].env == "MEMRA_DSV4_INDEXER_SELECT"
    arms = check_arms("path=device+idxsel=fused,path=device+idxsel=split")
    assert [a["idxsel"] for a in arms] == ["fused", "split"]
    with pytest.raises(SystemExit, match="idxsel"):
        check_arms("path=device+idxsel=both")
    import bench.decode_step as BD
    assert _kernel_env({"idxsel": "auto"}, None) == {"MEMRA_DSV4_INDEXER_SELECT": "auto"}
    assert "idxsel=fused|split|auto" in BD.__doc__ and "MEMRA_DSV4_INDEXER_SELECT" in BD.__doc__


# ---------------------------------------------------------------------------------- the launches
@pytest.fixture
def fake_ix(monkeypatch):
    launched = []
    fake, IX = fake_ops_module(monkeypatch, "indexer",
                               lambda n, grid, block, args, smem: launched.append((n, grid, block, args, smem)))
    monkeypatch.setattr(IX, "_WS", {})
    hist = fake.asarray(np.zeros(256, np.int32))       # the fake CuPy has no streams: a fixed workspace
    monkeypatch.setattr(IX, "hist_workspace", lambda: hist)
    return fake, IX, launched


def _call(fake, IX, N, k=512, width=None, **kw):
    A, z = fake.asarray, np.zeros
    width = min(k, N) if width is None else width
    sc, sel = A(z((1, N), np.uint16)), A(z((1, width), np.int32))
    out = IX.scores_topk(A(z((1, 64, 128), np.uint16)), A(z((1, 64), np.uint16)), A(z((N, 128), np.uint16)),
                         A(z(1, np.int32)), k, sc, sel, offset=5, w_scale=0.5, counter=A(z(1, np.int32)), **kw)
    assert out is sel
    return sc, sel


@pytest.mark.parametrize("N", [300, 512, 513, 8192, 30000, 100000])
def test_split_launches(fake_ix, monkeypatch, N):
    fake, IX, launched = fake_ix
    monkeypatch.delenv(IX.SELECT_ENV, raising=False)
    _call(fake, IX, N)                     # the default, auto: split when N > k = 512
    assert [x[0] for x in launched] == (["indexer_scores_tiles_d128", "indexer_select_d128"] if N > 512
                                        else ["indexer_fused_d128"])
    launched.clear()
    _call(fake, IX, N, form="fused")
    assert [x[0] for x in launched] == ["indexer_fused_d128"]
    fused = launched[0]
    launched.clear()
    sc, sel = _call(fake, IX, N, form="split")
    assert [x[0] for x in launched] == ["indexer_scores_tiles_d128", "indexer_select_d128"]
    tiles, select = launched
    assert fused[1] == (min(-(-N // 16), 264),) and fused[4] == IX.FUSED_SMEM
    assert tiles[1] == (min(-(-N // 32), 264),) and tiles[2] == (128,)         # 32-key tiles
    assert tiles[4] == IX.SPLIT_SMEM == 64 * 132 * 4 + 128 * 32 * 4
    assert IX.kernel("indexer", "indexer_scores_tiles_d128").max_dynamic_shared_size_bytes == IX.SPLIT_SMEM
    hist = IX.hist_workspace()                                                      # int32 [256], zero
    assert tiles[3][-1] is hist and hist.shape == (256,) and hist.dtype == np.int32
    assert select[3][-1] is hist                                                    # the same workspace
    assert select[1] == (1,) and select[2] == (1024,)
    assert select[3][0] is sc and select[3][4] is sel
    assert [int(a) for a in select[3][2:4]] + [int(a) for a in select[3][5:7]] == [N, 512, min(512, N), 5]
    assert select[4] == 0                  # static shared memory only
    # the env picks the form when the caller gives none
    for env, want_names in (("split", ["indexer_scores_tiles_d128", "indexer_select_d128"]),
                            ("fused", ["indexer_fused_d128"])):
        monkeypatch.setenv(IX.SELECT_ENV, env)
        launched.clear()
        _call(fake, IX, N)
        assert [x[0] for x in launched] == want_names, env
    monkeypatch.setenv(IX.SELECT_ENV, "nope")
    with pytest.raises(ValueError, match="MEMRA_DSV4_INDEXER_SELECT"):
        _call(fake, IX, N)


def test_split_keeps_the_argument_checks(fake_ix):
    fake, IX, launched = fake_ix
    with pytest.raises(AssertionError, match="width"):
        _call(fake, IX, 1000, k=512, width=100, form="split")
    with pytest.raises(AssertionError, match="k = 2000"):
        _call(fake, IX, 4000, k=2000, width=2000, form="split")
    with pytest.raises(AssertionError, match="form"):
        _call(fake, IX, 1000, form="unfused")
    assert launched == []


# ------------------------------------------------------------------- the selection, in NumPy
def score_key(bits: np.ndarray) -> np.ndarray:
    """indexer.cu score_key: bf16 bits -> order-preserving 16-bit keys, -0 == +0."""
    b = bits.astype(np.int64)
    b = np.where((b & 0x7FFF) == 0, 0, b)
    return np.where(b & 0x8000, ~b & 0xFFFF, b | 0x8000)


def find_bucket(hist: np.ndarray, need: int) -> tuple[int, int]:
    """indexer.cu find_bucket, lane by lane: lane l owns buckets 255-8l .. 248-8l (descending);
    the first lane whose exclusive..inclusive range holds `need` scans its 8 buckets."""
    c = np.array([[hist[255 - 8 * lane - i] for i in range(8)] for lane in range(32)])
    incl = np.cumsum(c.sum(axis=1))
    excl = incl - c.sum(axis=1)
    hit = np.flatnonzero((excl < need) & (need <= incl))
    assert hit.size, "find_bucket: need outside the histogram"
    lane = int(hit[0])
    run = int(excl[lane])
    for i in range(8):
        if run < need <= run + c[lane, i]:
            return 255 - 8 * lane - i, run
        run += int(c[lane, i])
    raise AssertionError("find_bucket: no bucket")


def emulate_select(bits, n_valid: int, k: int, width: int, offset: int, warps: int = 32) -> np.ndarray:
    """The split form's selection (warps = 32; warps = 4 is the fused kernel's last CTA) step by
    step: the high-byte histogram of the n valid keys (the scoring launch's atomics; the fused
    kernel's first pass), warp w owns [w * seg, min(w * seg + seg, n)), 32 lanes per step for the
    low-byte pass and the compaction.  Every sel_out slot below ksel is written exactly once
    (asserted)."""
    N = bits.shape[0]
    n = max(min(n_valid, N), 0)
    ksel = min(k, n)
    out = np.full(width, -7, np.int64)
    if ksel == n:
        out[:] = np.where(np.arange(width) < n, np.arange(width) + offset, -1)
        return out
    keys = score_key(bits[:n])
    seg = -(-n // (warps * 32)) * 32

    def steps(w):
        sb, se = w * seg, min(w * seg + seg, n)
        for base in range(sb, sb + seg, 32):
            j = base + np.arange(32)
            act = j < se
            yield j, act, np.where(act, keys[np.minimum(j, n - 1)], -1)

    hist = np.bincount(keys >> 8, minlength=256)     # the scoring launch: one atomic per valid key
    assert hist.sum() == n
    b1, above1 = find_bucket(hist, ksel)
    hist = np.zeros(256, np.int64)
    for w in range(warps):
        for j, act, key in steps(w):
            m = act & ((key >> 8) == b1)
            np.add.at(hist, key[m] & 0xFF, 1)
    b2, above2 = find_bucket(hist, ksel - above1)
    thr = (b1 << 8) | b2
    need = ksel - (above1 + above2)
    assert 1 <= need
    wcnt = np.zeros((warps, 2), np.int64)
    for w in range(warps):     # count pass
        for j, act, key in steps(w):
            wcnt[w, 0] += int(np.sum(key > thr))
            wcnt[w, 1] += int(np.sum(key == thr))
    written = np.zeros(width, np.int64)
    for w in range(warps):     # ballot-prefix ordered compaction
        gt_base, eq_base = int(wcnt[:w, 0].sum()), int(wcnt[:w, 1].sum())
        for j, act, key in steps(w):
            bg, be = key > thr, key == thr
            gb = gt_base + np.cumsum(bg) - bg     # popc(ballot & lanes below)
            eb = eq_base + np.cumsum(be) - be
            for lane in range(32):
                if bg[lane]:
                    pos = gb[lane] + min(eb[lane], need)
                elif be[lane] and eb[lane] < need:
                    pos = gb[lane] + eb[lane]
                else:
                    continue
                out[pos] = j[lane] + offset
                written[pos] += 1
            gt_base += int(bg.sum())
            eq_base += int(be.sum())
    assert np.all(written[:ksel] == 1) and not written[ksel:].any(), "compaction: slots not written once"
    out[ksel:] = -1
    return out


def reference_select(bits, n_valid: int, k: int, width: int, offset: int) -> np.ndarray:
    """The ksel largest score keys of the valid prefix, ties to the lower index, as ascending
    indices + offset, -1 padded (np.lexsort, no radix)."""
    n = max(min(n_valid, bits.shape[0]), 0)
    ksel = min(k, n)
    keys = score_key(bits[:n])
    idx = np.arange(n)
    pick = np.sort(np.lexsort((idx, -keys))[:ksel])
    out = np.full(width, -1, np.int64)
    out[:ksel] = pick + offset
    return out


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _row(rng, N, kind):
    if kind == "rand":
        bits = _bf16_bits(rng.standard_normal(N).astype(np.float32) * np.float32(4.0))
        bits[rng.integers(0, N, 9)] = 0xFF80        # -inf
    elif kind == "ties":                             # few values: the threshold is a big tie
        bits = _bf16_bits(rng.integers(-3, 4, N).astype(np.float32) * np.float32(0.5))
    elif kind == "zeros":                            # +0 / -0 everywhere, a few others
        bits = np.where(rng.random(N) < 0.5, 0x0000, 0x8000).astype(np.uint16)
        sel = rng.random(N) < 0.05
        bits[sel] = _bf16_bits(rng.standard_normal(int(sel.sum())).astype(np.float32))
    elif kind == "equal":                            # one value: the lowest indices win
        bits = np.full(N, _bf16_bits(np.float32(1.25)), np.uint16)
    elif kind == "nan":                              # key 0 (bf16 0xFFFF) valid and in the top-k
        bits = np.full(N, 0xFFFF, np.uint16)
        bits[rng.integers(0, N, 40)] = _bf16_bits(np.float32(2.0))
    else:                                            # low bytes matter: one high byte, many low bytes
        bits = (0x3F00 + rng.integers(0, 256, N)).astype(np.uint16)
    return bits


@pytest.mark.parametrize("kind", ["rand", "ties", "zeros", "equal", "lowbyte", "nan"])
@pytest.mark.parametrize("N", [8192, 2055])
def test_emulated_select_matches_reference(N, kind):
    rng = np.random.default_rng(1000 * N + len(kind))
    k = 512
    bits = _row(rng, N, kind)
    offset = int(rng.integers(0, 1000))
    for nv in sorted({0, 1, k - 1, k, k + 1, 3000, N - 1, N, N + 7, int(rng.integers(0, N + 1))}):
        want = reference_select(bits, nv, k, k, offset)
        got = emulate_select(bits, nv, k, k, offset)
        assert np.array_equal(got, want), (N, kind, nv, np.flatnonzero(got != want)[:5])


def test_emulated_select_past_n_valid_and_width():
    """Keys past n_valid never count (the kernel reads only [0, n)), whatever they hold; sel_out
    wider than k is -1 padded; the 4-warp form (the fused kernel's last CTA) selects the same."""
    rng = np.random.default_rng(7)
    N, k = 8192, 512
    bits = _row(rng, N, "ties")
    big = bits.copy()
    big[3000:] = _bf16_bits(np.float32(1e30))
    for nv in (600, 3000):
        a = emulate_select(bits, nv, k, k + 40, 3)
        assert np.array_equal(a, emulate_select(big, nv, k, k + 40, 3))
        assert np.array_equal(a, reference_select(bits, nv, k, k + 40, 3))
        assert np.all(a[k:] == -1)
        assert np.array_equal(a, emulate_select(bits, nv, k, k + 40, 3, warps=4))
    for k2, nv in ((8, 300), (1024, 5000), (1, 2)):
        assert np.array_equal(emulate_select(bits, nv, k2, k2, 0), reference_select(bits, nv, k2, k2, 0))


def test_emulated_select_random_many():
    rng = np.random.default_rng(11)
    for it in range(40):
        N = int(rng.integers(2, 3000))
        k = int(rng.integers(1, 1025))
        bits = _row(rng, N, ["rand", "ties", "zeros", "equal", "lowbyte"][it % 5])
        nv = int(rng.integers(0, N + 1))
        width = min(k, N) + int(rng.integers(0, 3))
        want = reference_select(bits, nv, k, width, 9)
        assert np.array_equal(emulate_select(bits, nv, k, width, 9), want), (N, k, nv)


# ------------------------------------------------------------------------------------ the source
def _kernel_body(name: str) -> str:
    return braced(SRC, f"\n{name}(")


def test_source_kernels_and_launch_bounds(IX):
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(IF_THREADS\)\s*\nindexer_scores_tiles_d128\(', SRC)
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(IX_SEL_THREADS\)\s*\nindexer_select_d128\(', SRC)
    assert re.search(r"constexpr int IX_SEL_THREADS = 1024;", SRC) and IX.SELECT_THREADS == 1024
    assert re.search(r"constexpr int IF_THREADS = 128;", SRC)
    assert int(re.search(r"constexpr int IF_KC_SPLIT = (\d+);", SRC).group(1)) == IX.SPLIT_KEYS_PER_TILE == 32
    assert "constexpr int KC = SELECT ? IF_KC : IF_KC_SPLIT, KB = KC / 4;" in SRC
    steps = int(re.search(r"constexpr int IX_SEL_REG_STEPS = (\d+);", SRC).group(1))
    assert 1024 * steps == IX.SELECT_REG_CAP
    assert {"indexer_scores_tiles_d128", "indexer_select_d128"} <= set(IX.KERNELS)
    sigs = kernel_signatures()
    assert sigs["indexer_scores_tiles_d128"] == sigs["indexer_fused_d128"]
    assert sigs["indexer_select_d128"] == ["ptr", "ptr", "i32", "i32", "ptr", "i32", "i32", "ptr"]


def test_source_fused_and_tiles_share_the_templated_body():
    fused, tiles = _kernel_body("indexer_fused_d128"), _kernel_body("indexer_scores_tiles_d128")
    call = "(q, w, keys, ld_k, n_valid, scores_out, H, N, w_scale, k, sel_out, width, offset, counter);"
    for body, sel, last in ((fused, "true", "counter"), (tiles, "false", "hist_hi")):
        stmts = [s.strip() for s in body.strip("{}").split(";") if s.strip()]
        assert stmts == ["PDL_ENTRY()", f"if_body<{sel}>" + call[:-1].replace("counter)", last + ")")], stmts
    assert SRC.count("template <bool SELECT>\nDEV void if_body(") == 1
    body = braced(SRC, "DEV void if_body(")
    stop = body.index("if constexpr (!SELECT) return;")
    assert body.index("for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x)") < stop
    assert stop < body.index("the last CTA selects") < body.index("last_cta_ticket(counter, (int)gridDim.x,")
    common = open(os.path.join(KDIR, "common.cuh"), encoding="utf-8").read()
    assert "atomicAdd(counter, 1) == n - 1" in braced(common, "DEV bool last_cta_ticket(")
    assert "scores_out[" not in body[stop:]          # no score written after the split form's return


def test_source_row_forms_share_the_bodies(IX):
    """The device verify's row forms (grid.y = T): the one-row bodies on row y's operands, each
    row its own ticket counter / histogram, the same keys."""
    fused, tiles = _kernel_body("indexer_fused_rows_d128"), _kernel_body("indexer_scores_tiles_rows_d128")
    flat = lambda b: " ".join(b.split())
    assert ("if_body<true>(q + y * ld_q, w + y * ld_w, keys, ld_k, n_valid + y * ld_nv, scores_out + y * ld_s, "
            "H, N, w_scale, k, sel_out + y * ld_sel, width, offset, counter + y);") in flat(fused)
    assert ("if_body<false>(q + y * ld_q, w + y * ld_w, keys, ld_k, n_valid + y * ld_nv, scores_out + y * ld_s, "
            "H, N, w_scale, 0, nullptr, 0, 0, hist_hi + 256 * y);") in flat(tiles)
    for b in (fused, tiles, _kernel_body("indexer_select_rows_d128")):
        assert "const i64 y = blockIdx.y;" in b
    assert {"indexer_fused_rows_d128", "indexer_scores_tiles_rows_d128", "indexer_select_rows_d128"} <= set(IX.KERNELS)


def test_source_select_kernel(IX):
    kern = _kernel_body("indexer_select_d128")
    stmts = [s.strip() for s in kern.strip("{}").split(";") if s.strip()]
    assert stmts == ["PDL_ENTRY()", "select_body(scores, n_valid, N, k, sel_out, width, offset, hist_hi)"], stmts
    # the row form (the device verify's): the same body on row y's operands and histogram
    rows = _kernel_body("indexer_select_rows_d128")
    assert rows.lstrip("{").lstrip().startswith("PDL_ENTRY();")
    assert ("select_body(scores + y * ld_s, n_valid + y * ld_nv, N, k, sel_out + y * ld_sel, width, offset,\n"
            "                hist_hi + 256 * y);") in rows
    body = braced(SRC, "DEV void select_body(")
    assert "__ldg(n_valid)" in body and "counter" not in body
    # hist_hi read into shared memory, then zeroed on every path (before the n <= k return)
    read, zero = "sh.hist_hi[tid] = __ldcg(hist_hi + tid);", "if (tid < 256) hist_hi[tid] = 0;"
    assert body.index(read) < body.index("__syncthreads();") < body.index(zero) < body.index("if (ksel == n)")
    # the branches by S = ceil(n / 1024): registers up to IX_SEL_REG_STEPS steps, then L2
    for call in ("sel_regs<4>(", "sel_regs<8>(", "sel_regs<IX_SEL_REG_STEPS>(", "sel_l2("):
        assert call in body, call
    steps = int(re.search(r"constexpr int IX_SEL_REG_STEPS = (\d+);", SRC).group(1))
    assert 1024 * steps == IX.SELECT_REG_CAP
    regs = braced(SRC, "DEV void sel_regs(")
    l2 = braced(SRC, "DEV void sel_l2(")
    compact = braced(SRC, "DEV void sel_compact(")
    for b in (regs, l2):
        assert "__ldg(scores" not in b and "__ldcg(scores + j" in b      # L2 only, never the read-only path
        # b1 from the scoring launch's histogram, b2 from bucket b1's low bytes
        assert "sel_bucket(sh.hist_hi, ksel, sh, 0);" in b and "sel_bucket(sh.hist_lo, ksel - above1, sh, 1);" in b
        assert "thr = (b1 << 8) | sh.b[1], need = ksel - (above1 + sh.above[1]);" in b
    assert "atomicAdd(&sh.hist_lo[key & 0xffu], 1)" in regs and "sel_compact<STEPS>(key_of, STEPS," in regs
    assert "hist_add(sh.hist_lo, key & 0xffu, act);" in l2 and "sel_compact<0>(key_of, S," in l2
    # the scoring launch's histogram: one atomic per valid key, only in the split body
    tail = braced(SRC, "DEV void if_body(")
    assert "if constexpr (SELECT) {" in tail and "if (kk < nv) atomicAdd(counter + (score_key(bits) >> 8), 1);" in tail
    # the ordered compaction: gt keys at gb + min(eb, need), the first `need` ties at gb + eb
    # (sel_scatter32, the step the fused kernel's last CTA runs too)
    scatter = braced(SRC, "DEV void sel_scatter32(")
    assert "sel_out[gb + min(eb, need)] = j + offset;" in scatter
    assert "else if (key == thr && eb < need) sel_out[gb + eb] = j + offset;" in scatter
    step = "sel_scatter32(key, thr, j, need, offset, lt, gt_base, eq_base, sel_out);"
    assert step in compact and step in tail
    assert "lane < wid ? wcnt[lane][0] : 0" in compact and "lane < wid ? wcnt[lane][1] : 0" in compact
