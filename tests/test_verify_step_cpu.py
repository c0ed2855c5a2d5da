"""VerifyWs bookkeeping of the device verify (memra_dsv4.gpu.verify_step), on the CPU: the plan is
the step's StepWs with a leading rows axis, the rows' strides suit the multi-row GEMV (16-byte
aligned rows), the shared workspaces stay one row, and the row limit follows the window."""
from __future__ import annotations

import math

import pytest

from memra_dsv4.config import preset
from memra_dsv4.gpu.step import step_ws_plan
from memra_dsv4.gpu.verify_step import ROW_MAX, row_limit, verify_ws_plan


@pytest.mark.parametrize("name", ["tiny", "small", "flash"])
def test_plan_is_the_step_plan_with_rows(name):
    cfg = preset(name)
    layers = range(cfg.num_hidden_layers)
    one = step_ws_plan(cfg, layers, True, True, 1024, 0)
    p = verify_ws_plan(cfg, layers, True, True, 1024, 0, rows=5)
    names = {s.name for s in p}
    for s in one:
        if s.name in ("head.tok_hist", "boundary.in", "cmp.pooled", "dev.idx_pooled", "attn.qrn",
                      "dev.head_pre"):
            assert s.name not in names
        else:
            got = p.slot(s.name)
            assert got.shape == (5,) + tuple(s.shape) and got.dtype == s.dtype, s.name
    # the multi-row GEMVs' operands: rows 16-byte aligned (row stride = one row's bytes)
    for n in ("attn.qr", "attn.q", "attn.o", "attn.u", "attn.out", "xn", "moe.sh_h", "moe.shared",
              "head.yn", "head.logits", "ffn.out"):
        sl = p.slot(n)
        row = sl.nbytes // sl.shape[0]
        assert row % 16 == 0 and sl.offset % 16 == 0, (n, row, sl.offset)
    assert p.slot("moe.h").shape == (5, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    # one multi-row attention launch: its split workspace holds T rows' partials
    from memra_dsv4.gpu.ops.attention import workspace_size
    kmax = p.slot("attn.cand").shape[1]
    ws = p.slot("dev.attn_ws")
    assert math.prod(ws.shape) >= workspace_size(5, cfg.num_attention_heads, cfg.head_dim, kmax)


def test_rows_refused_outside_range():
    cfg = preset("tiny")
    for rows in (0, ROW_MAX + 1):
        with pytest.raises(AssertionError, match="rows"):
            verify_ws_plan(cfg, range(cfg.num_hidden_layers), True, True, 64, 0, rows=rows)


def test_row_limit_is_the_window_or_eight():
    from types import SimpleNamespace
    assert row_limit(preset("tiny")) == 8   # W = 8
    assert row_limit(preset("flash")) == 8
    assert row_limit(SimpleNamespace(sliding_window=4)) == 4
    assert row_limit(SimpleNamespace(sliding_window=128)) == ROW_MAX


def test_verify_path_seam():
    from memra_dsv4 import seams
    s = seams.SEAMS["verify_path"]
    assert s is seams.SEAM_VERIFY_PATH and s.default == "chunk" and s.allowed == ("chunk", "device")
    with pytest.raises(ValueError, match="verify_path.*allowed: chunk, device"):
        seams.resolve(s, "graph")


def test_dispatch_takes_the_chunk_routine_outside_the_device_rows():
    from types import SimpleNamespace

    from memra_dsv4.gpu.verify import device_verify_of
    cfg = preset("tiny")
    state = SimpleNamespace(max_seq_len=64)
    chunk = SimpleNamespace(verify_path="chunk", config=cfg)
    assert device_verify_of(chunk, state, 3) is None
    dev = SimpleNamespace(verify_path="device", config=cfg, _verify_step=None)
    for rows in (1, row_limit(cfg) + 1):   # never reaches the GPU
        assert device_verify_of(dev, state, rows) is None
        assert dev._verify_step is None


def test_xn_projection_entries_per_layer_kind():
    """The one builder of the device step's and the device verify's GemvTable entries: order
    (wq_a, wkv, compressor wkv / wgate, indexer-compressor wkv / wgate, weights_proj) and the
    pending rows' offsets (ratio 4 overlaps: rows r..2r-1 take the current block)."""
    from types import SimpleNamespace as NS

    from memra_dsv4.gpu.step_device import xn_projection_entries

    def layer(ratio, kind):
        return NS(ratio=ratio, kind=kind, lin=lambda pre: ("W", pre), w=lambda leaf: ("w", leaf))

    def pend(ratio):
        return NS(ratio=ratio, overlap=ratio == 4, kv=("kv", ratio), score=("score", ratio))
    cache = NS(comp_state=None, idx_state=None)
    got = xn_projection_entries(layer(0, "sliding"), cache, "qr", "kv", None)
    assert got == [(("W", "attn.wq_a"), "qr"), (("W", "attn.wkv"), "kv")]
    cache = NS(comp_state=pend(16), idx_state=None)
    got = xn_projection_entries(layer(16, "hca"), cache, "qr", "kv", None)
    assert got[2:] == [(("W", "attn.compressor.wkv"), ("kv", 16), None, 0, 16),
                       (("W", "attn.compressor.wgate"), ("score", 16),
                        ("w", "attn.compressor.ape"), 0, 16)]
    cache = NS(comp_state=pend(4), idx_state=pend(4))
    got = xn_projection_entries(layer(4, "csa"), cache, "qr", "kv", "iw")
    assert [e[0][1] for e in got] == ["attn.wq_a", "attn.wkv", "attn.compressor.wkv",
                                      "attn.compressor.wgate", "attn.indexer.compressor.wkv",
                                      "attn.indexer.compressor.wgate", "attn.indexer.weights_proj"]
    assert [e[3] for e in got[2:6]] == [4, 4, 4, 4] and got[6][1] == "iw"
    # the device verify's tables: the staging arrays replace the pending rows, ring offset -1
    # (GemvTable's staging mark), the rest equal
    stg = {"attn.compressor": ("ckv", "csc"), "attn.indexer.compressor": ("ikv", "isc")}
    rows = xn_projection_entries(layer(4, "csa"), cache, "qr", "kv", "iw", staging=stg)
    assert [e[1] for e in rows[2:6]] == ["ckv", "csc", "ikv", "isc"]
    assert [e[3] for e in rows[2:6]] == [-1, -1, -1, -1]
    assert [(e[0], e[2]) + e[4:] for e in rows[2:6]] == [(e[0], e[2]) + e[4:] for e in got[2:6]]
    assert rows[:2] + rows[6:] == got[:2] + got[6:]


def test_step_ratios():
    from memra_dsv4.gpu.step_device import step_ratios
    cfg = preset("tiny")
    assert step_ratios(cfg, range(cfg.num_hidden_layers)) == [4, 16]
    assert step_ratios(cfg, [0]) == [1, 4]       # a sliding-only stage
    assert step_ratios(cfg, [2]) == [16, 4]      # HCA only: 4 appended for the key count


def test_forms_are_checked():
    from memra_dsv4.gpu.verify_step import COMMIT_FORMS, ROW_FORMS, checked_form
    assert checked_form("rows", ROW_FORMS, "row_form") == "rows"
    assert checked_form("device", COMMIT_FORMS, "commit_form") == "device"
    with pytest.raises(ValueError, match=r"VerifyStep.commit_form = 'gpu': expected one of \('host', 'device'\)"):
        checked_form("gpu", COMMIT_FORMS, "commit_form")
    with pytest.raises(ValueError, match="VerifyStep.row_form = 'row'"):
        checked_form("row", ROW_FORMS, "row_form")
