"""MEMRA_DSV4_DECODE_ATTN_HG (step_device.decode_attn_head_group) and ops.attention's head_group
argument, on the CPU (no GPU):

* the switch: unset / empty -> DECODE_ATTN_HG_DEFAULT ("auto": 8 where head_group(H) is larger,
  so 8 for Flash's 64 heads, else head_group(H): 8 heads -> 8, 4 -> 4, 12 -> 4); "own" ->
  head_group(H) for any H; "16" / "8" / "4"; anything else a ValueError naming the variable; an
  explicit group that does not divide H refused by head_group, naming it; bench.decode_step's attnhg arm sets the variable;
* the wrapper on fake arrays (tests/test_kernel_sources.py's FakeKernel checks every launch's
  arguments against attention.cu's signature): head_group g launches sparse_attn_d{D}_hg{g}
  with grid (T, H / g, n_split) and the group's block, the combine unchanged; head_group None
  is the largest group dividing H; auto_split counts the group's CTAs; refusals (a group
  outside HEAD_GROUPS, one not dividing H, a bool or a float) name the value and launch
  nothing;
* the kernel's source: the empty-tile exit of sparse_attn_body (split CTAs of the 8- and 4-head
  kernels only, not in the _qn forms, before the q loads and the gather) stores m = -inf, l = +0 and zero a_t through the same
  store_tile_partial as the full path, and the full path's store is that helper.
The bytes are the GPU tests' (tests/gpu/test_kernels_attention.py: every group and split against
the default fused path on lists with empty tiles; tests/gpu/test_step_attn_hg_gpu.py: the step)."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_attn_hg_switch(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    assert SD.DECODE_ATTN_HG_ENV == "MEMRA_DSV4_DECODE_ATTN_HG"
    assert SD.DECODE_ATTN_HG_DEFAULT == "auto" and SD.DECODE_ATTN_HG_AUTO == 8
    monkeypatch.delenv(SD.DECODE_ATTN_HG_ENV, raising=False)
    # the default: 8 below a larger own group (Flash 64 heads, 128 for Pro), else the own group
    assert SD.decode_attn_head_group(64) == 8 and SD.decode_attn_head_group(128) == 8
    assert SD.decode_attn_head_group(16) == 8
    assert SD.decode_attn_head_group(8) == 8 and SD.decode_attn_head_group(4) == 4
    assert SD.decode_attn_head_group(12) == 4 and SD.decode_attn_head_group(24) == 8
    monkeypatch.setenv(SD.DECODE_ATTN_HG_ENV, "")
    assert SD.decode_attn_head_group(64) == 8
    for v, want in (("auto", 8), ("own", 16), ("16", 16), ("8", 8), ("4", 4)):
        monkeypatch.setenv(SD.DECODE_ATTN_HG_ENV, v)
        assert SD.decode_attn_head_group(64) == want
    monkeypatch.setenv(SD.DECODE_ATTN_HG_ENV, "own")
    assert [SD.decode_attn_head_group(h) for h in (4, 8, 12, 24)] == [4, 8, 4, 8]
    monkeypatch.setenv(SD.DECODE_ATTN_HG_ENV, "16")
    with pytest.raises(AssertionError, match="head_group 16 does not divide H = 8"):
        SD.decode_attn_head_group(8)
    for bad in ("2", "32", "four"):
        monkeypatch.setenv(SD.DECODE_ATTN_HG_ENV, bad)
        with pytest.raises(ValueError, match=f"MEMRA_DSV4_DECODE_ATTN_HG='{bad}'.*auto, own, 16, 8 or 4"):
            SD.decode_attn_head_group(64)


def test_bench_decode_attnhg_arm_sets_the_env():
    from bench.decode_step import _kernel_env, check_arms
    for v in ("auto", "own", "16", "8", "4"):
        assert _kernel_env({"attnhg": v}, None) == {"MEMRA_DSV4_DECODE_ATTN_HG": v}
    with pytest.raises(SystemExit, match="attnhg='2'"):
        check_arms("path=device+attnhg=2")


@pytest.fixture
def fake_at(monkeypatch):
    from tests.test_kernel_sources import fake_ops_module
    launched = []
    fake, AT = fake_ops_module(monkeypatch, "attention", lambda name, grid, block, args, smem: launched.append(
        (name, tuple(grid), tuple(block), smem)))
    return fake, AT, launched


def _call(fake, AT, T, H, D, K, **kw):
    A, z = fake.asarray, np.zeros
    return AT.sparse_attention(A(z((T, H, D), np.uint16)), A(z((50, D), np.uint16)),
                               A(z((T, K), np.int32)), A(z(H, np.float32)), 0.1, **kw)


def test_sparse_attention_head_group_launches(fake_at):
    fake, AT, launched = fake_at
    assert AT.HEAD_GROUPS == (16, 8, 4)
    threads = {16: 256, 8: 256, 4: 128}
    for H, D, K in ((64, 512, 384), (64, 512, 136), (8, 128, 70), (4, 128, 10)):
        nt = AT.n_tiles(K)
        assert AT.head_group(H) == max(g for g in AT.HEAD_GROUPS if H % g == 0)
        for hg in [g for g in AT.HEAD_GROUPS if H % g == 0] + [None]:
            g = AT.head_group(H) if hg is None else hg
            for n_split in (nt, None):
                launched.clear()
                _call(fake, AT, 1, H, D, K, n_split=n_split, head_group=hg)
                ns = nt if n_split == nt else AT.auto_split(1, H, K, g)
                ns = max(1, min(ns, nt))
                # one tile buffer where every CTA has one tile and the group is below H's own
                bufs = 1 if g < AT.head_group(H) and -(-nt // ns) == 1 else 2
                assert AT.tile_buffers(H, g, nt, ns) == bufs
                want = [(f"sparse_attn_d{D}_hg{g}", (1, H // g, ns), (threads[g],), bufs * 32 * D * 2)]
                if ns > 1:
                    want.append((f"sparse_attn_combine_d{D}", (1, H), (D // 4,), AT.combine_smem(D, nt)))
                assert launched == want, (H, D, K, hg, n_split, launched)
    # auto_split counts the group's CTAs: 64 heads in 4-head groups at 20 tiles -> 17 per group
    assert AT.auto_split(1, 64, 640) == 20 and AT.auto_split(1, 64, 640, 4) == 17
    assert AT.auto_split(1, 64, 640, 16) == 20
    # the buffers: 64 heads in groups of 4 / 8, one tile per CTA -> 1; two tiles per CTA, the
    # fused path of a longer list, or H's own group (16 for 64, 4 for 4 heads) -> 2
    assert AT.tile_buffers(64, 4, 12, 12) == 1 and AT.tile_buffers(64, 8, 5, 5) == 1
    assert AT.tile_buffers(64, 4, 20, 17) == 2 and AT.tile_buffers(64, 4, 12, 1) == 2
    assert AT.tile_buffers(64, 16, 12, 12) == 2 and AT.tile_buffers(4, 4, 12, 12) == 2
    assert AT.tile_buffers(64, 4, 1, 1) == 1   # a one-tile list: the fused path's only tile


def test_sparse_attention_head_group_refusals(fake_at):
    fake, AT, launched = fake_at
    launched.clear()
    for H, hg, msg in ((64, 3, "head_group 3 is not one of"), (64, 32, "head_group 32 is not one of"),
                       (4, 8, "head_group 8 does not divide H = 4"), (8, 16, "head_group 16 does not divide H = 8"),
                       (64, True, "head_group must be an int or None, got True"),
                       (64, 4.0, "head_group must be an int or None, got 4.0")):
        with pytest.raises(AssertionError, match=msg):
            _call(fake, AT, 1, H, 128, 70, n_split=2, head_group=hg)
        with pytest.raises(AssertionError, match=msg):   # T = 0 too: refused, not skipped
            _call(fake, AT, 0, H, 128, 70, head_group=hg)
    assert launched == []
    _call(fake, AT, 1, 64, 128, 70, n_split=2, head_group=np.int64(8))   # a NumPy int is an int
    assert launched[0][0] == "sparse_attn_d128_hg8"


def _body_src() -> str:
    src = open(os.path.join(ROOT, "kernels_cu", "attention.cu"), encoding="utf-8").read()
    a = src.index("DEV void sparse_attn_body(")
    return src[a:src.index("\n}\n", a)]


def test_empty_tile_exit_source_contract():
    body = _body_src()
    # the 8- and 4-head kernels only (the 16-head ones keep the previous code), not the _qn forms
    assert "constexpr bool SKIP_EMPTY = !QN && HG < 16;" in body
    m = re.search(r"if \(SKIP_EMPTY && n_split > 1 && tile0 < tile1 && !tiles_have_candidates\(cand, tile0, tile1\)\) \{(.*?)\n    \}",
                  body, re.S)
    assert m, "the empty-tile exit (split CTAs) is missing or changed"
    ex = m.group(1)
    assert "mt[hh] = f32_ninf();" in ex and "lt[hh] = 0.0f;" in ex and "at[hh][ch][u] = 0.0f;" in ex
    assert "store_tile_partial<D, HPW>(ws_ml, ws_acc, (t * H + h0) * (i64)n_tiles + tile, n_tiles, mt, lt, at);" in ex
    assert ex.rstrip().endswith("return;")
    # before the q loads and the first gather
    assert body.index("tiles_have_candidates(") < body.index("load_dims<U>(q") < body.index("issue_tile<D, NT>(")
    # the full path's partial store is the same helper with the same slot
    assert body.count("store_tile_partial<D, HPW>(ws_ml, ws_acc, (t * H + h0) * (i64)n_tiles + tile, n_tiles, mt, lt, at);") == 2
    assert "ws_ml[2 * slot]" not in body   # no second copy of the store
