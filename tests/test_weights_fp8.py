"""The dense seam (MEMRA_DSV4_DENSE = bf16 | fp8), load side, on the CPU.

* the seam: default, environment, argument wins, refusals naming the value and the choices;
* placement: weight_plan / Dsv4Gpu._plan use the chosen arm's byte math (Flash, 2 devices);
* the host half of load_stage_weights (``upload=`` stands in for the CuPy upload) on the tiny
  synthetic checkpoint: dense "fp8" keeps the stored bytes (uint8 weight + uint8 e8m0 scale),
  dense "bf16" the exact bf16 bits, and the two agree through formats.dequant_fp8_block_bf16
  (the twin of kernels_cu/dense.cu);
* refusals: both arms refuse the same checkpoints with the same message (NaN code, e8m0 0xFF,
  overflow, bf16-inexact products), and the byte-table fast check equals the slow check on
  every (e4m3 code, e8m0 scale) pair.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4 import seams
from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.formats import (E4M3_VALUES, E8M0_VALUES, FormatError, dequant_fp8_block_bf16,
                                encode_e4m3, fp8_block_exact_in_bf16)
from memra_dsv4.gpu.model import Dsv4Gpu
from memra_dsv4.gpu.weights import (StageWeights, e4m3_codes_clipped, load_stage_weights,
                                    resolve_dense, weight_plan)
from memra_dsv4.placement import plan_split, weight_bytes_on_device
from memra_dsv4.synth import synth_arrays
from memra_dsv4.tensors import G_EXPERTS, expected_tensors


# ------------------------------------------------------------------------------------- seam
def test_dense_seam_resolution(monkeypatch, capsys):
    monkeypatch.delenv("MEMRA_DSV4_DENSE", raising=False)
    assert seams.SEAMS["dense"].env == "MEMRA_DSV4_DENSE"
    assert seams.resolve("dense") == "bf16"
    assert resolve_dense() == "bf16"
    assert "memra_dsv4: gpu dense weights = bf16 (default)" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DENSE", "fp8")
    assert resolve_dense() == "fp8"
    assert "gpu dense weights = fp8 (env MEMRA_DSV4_DENSE)" in capsys.readouterr().err
    assert resolve_dense("bf16") == "bf16"                          # the argument wins
    assert "gpu dense weights = bf16 (argument)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"'fp16'.*allowed: bf16, fp8"):
        resolve_dense("fp16")
    monkeypatch.setenv("MEMRA_DSV4_DENSE", "e4m3")
    with pytest.raises(ValueError, match=r"MEMRA_DSV4_DENSE = 'e4m3' is not valid; allowed: bf16, fp8"):
        resolve_dense()
    with pytest.raises(ValueError, match="allowed: bf16, fp8"):
        resolve_dense(8)


def test_weight_plan_refuses_unknown_dense():
    with pytest.raises(ValueError, match=r"dense = 'stored'.*bf16, fp8"):
        weight_plan(preset("tiny"), 1, dense="stored")
    ck = _tiny()
    with pytest.raises(ValueError, match="dense"):
        load_stage_weights(ck, 0, range(1), True, False, dense="fp4", upload=np.asarray)


# ---------------------------------------------------------------------------------- placement
def test_flash_plan_bytes_fp8_vs_bf16():
    cfg = preset("flash")
    kw = dict(experts="mxfp4", max_seq_len=4096, include_drafter=False, device_bytes=1 << 50)
    pb = plan_split(cfg, 2, dense="bf16", **kw)
    pf = plan_split(cfg, 2, dense="fp8", **kw)
    assert weight_plan(cfg, 2, dense="bf16") == [(i, s.layers, s.has_embed, s.has_head)
                                                  for i, s in enumerate(pb.stages)]
    assert weight_plan(cfg, 2, dense="fp8") == [(i, s.layers, s.has_embed, s.has_head)
                                                 for i, s in enumerate(pf.stages)]
    assert Dsv4Gpu._plan(cfg, (0, 1), "mxfp4", "fp8") == weight_plan(cfg, 2, dense="fp8")
    assert Dsv4Gpu._plan(cfg, (0, 1), "mxfp4") == weight_plan(cfg, 2, dense="bf16")
    trunk = [s for s in expected_tensors(cfg) if s.layer is None or s.layer < cfg.num_hidden_layers]
    fp8_w = sum(s.nbytes for s in trunk if s.kind == "fp8")
    scales = sum(s.nbytes for s in trunk if s.kind == "e8m0" and s.group != G_EXPERTS)
    tot_b = sum(s.weights_bytes for s in pb.stages)
    tot_f = sum(s.weights_bytes for s in pf.stages)
    assert tot_b - tot_f == fp8_w - 4 * scales        # bf16 doubles the e4m3 bytes, drops scales
    assert 5.5e9 < fp8_w < 6.5e9                      # ~5.9 GB of FP8 dense weights on Flash
    # Flash on 2 devices: the FP8 arm saves ~2.8 GiB per device; the cut stays after layer 21
    assert pf.cuts == pb.cuts == (21,)
    for b, f in zip(pb.stages, pf.stages):
        assert 2.5 * 2**30 < b.weights_bytes - f.weights_bytes < 3.1 * 2**30


# ----------------------------------------------------------------------------- host loading
def _tiny(arrays=None):
    cfg = preset("tiny")
    return Checkpoint.from_arrays(cfg, arrays if arrays is not None else synth_arrays(cfg, seed=3))


def _host_load(ck, dense, layers=None, embed=True, head=True):
    layers = range(ck.config.num_hidden_layers) if layers is None else layers
    return load_stage_weights(ck, 0, layers, embed, head, dense=dense,
                              upload=lambda a: np.array(a, copy=True))


def test_tiny_fp8_stage_keeps_stored_bytes_and_matches_bf16_stage():
    ck = _tiny()
    cfg = ck.config
    f = _host_load(ck, "fp8")
    b = _host_load(ck, "bf16")
    assert (f.dense_fmt, b.dense_fmt) == ("fp8", "bf16")
    fp8_specs = [s for s in ck.specs() if s.kind == "fp8" and s.layer is not None
                 and s.layer < cfg.num_hidden_layers]
    assert fp8_specs and f.fp8 == {s.name[:-7] for s in fp8_specs} and b.fp8 == set()
    for s in fp8_specs:
        stem = s.name[:-7]
        w, sc = f[s.name], f[f"{stem}.scale"]
        assert w.dtype == np.uint8 and w.shape == s.shape and w.flags.c_contiguous
        assert sc.dtype == np.uint8 and sc.shape == tuple(-(-d // 128) for d in s.shape)
        assert np.array_equal(w, ck.raw(s.name).view(np.uint8))
        assert np.array_equal(sc, ck.raw(f"{stem}.scale").view(np.uint8))
        assert f.is_fp8(s.name) and f.is_fp8(stem) and f.scale_of(s.name) is sc
        assert not b.is_fp8(s.name) and b.scale_of(s.name) is None
        assert f"{stem}.scale" not in b.t
        assert b[s.name].dtype == np.uint16
        # the kernel's twin applied to the stored bytes gives the bf16 arm's bits
        assert np.array_equal(dequant_fp8_block_bf16(w, sc, s.name), b[s.name])
    # everything that is not an FP8 linear is the same array in both arms
    assert set(f.t) - set(b.t) == {f"{s}.scale" for s in f.fp8}
    for name in b.t:
        if not f.is_fp8(name):
            assert f[name].dtype == b[name].dtype and np.array_equal(f[name], b[name]), name
    assert f.scale_of("layers.0.attn_norm.weight") is None
    assert f.expert_fmt == b.expert_fmt
    # bytes placed: the stored bytes of every FP8 linear (weight + e8m0 scale) vs 2x weight
    w8 = sum(s.nbytes for s in fp8_specs)
    s8 = sum(f[f"{st}.scale"].nbytes for st in f.fp8)
    assert b.nbytes - f.nbytes == w8 - s8
    assert f.nbytes == sum(a.nbytes for a in f.t.values())
    # ... and the placement's byte math for one stage (its fp8 arm counts scales as fp32)
    specs = [s for s in ck.specs() if s.layer is None or s.layer < cfg.num_hidden_layers]
    assert b.nbytes == sum(weight_bytes_on_device(s, "bf16") for s in specs)
    assert f.nbytes == sum(weight_bytes_on_device(s, "fp8") for s in specs) - 3 * s8


def test_stage_subset_has_only_its_layers():
    ck = _tiny()
    f = _host_load(ck, "fp8", layers=range(2, 4), embed=False, head=True)
    assert all(st.startswith(("layers.2.", "layers.3.")) for st in f.fp8)
    assert "embed.weight" not in f.t and "head.weight" in f.t
    with pytest.raises(KeyError, match="not on device 0"):
        f["layers.0.attn.wq_a.weight"]


# ------------------------------------------------------------------------------- refusals
def _refusal(arrays):
    """(message of the bf16 arm, message of the fp8 arm) for a tampered tiny checkpoint."""
    msgs = []
    for dense in ("bf16", "fp8"):
        with pytest.raises(ValueError) as e:
            _host_load(_tiny(arrays), dense, layers=range(2), embed=False, head=False)
        msgs.append(str(e.value))
    return msgs


def _tamper(name, fn):
    cfg = preset("tiny")
    arrays = dict(synth_arrays(cfg, seed=3))
    a = np.array(arrays[name], copy=True)
    fn(a)
    arrays[name] = a
    return arrays


@pytest.mark.parametrize("case,target,edit,word", [
    ("nan code", "layers.1.attn.wq_b.weight", lambda a: a.__setitem__((5, 7), 0x7F), "NaN"),
    ("neg nan code", "layers.0.ffn.shared_experts.w2.weight", lambda a: a.__setitem__((0, 0), 0xFF), "NaN"),
    ("scale nan", "layers.0.attn.wkv.scale", lambda a: a.__setitem__((0, 1), 0xFF), "NaN"),
    ("overflow", "layers.1.attn.wo_b.scale", lambda a: a.__setitem__((1, 1), 254), "overflow"),
    ("inexact", "layers.0.attn.wq_a.scale", lambda a: a.__setitem__((0, 0), 0), "not exactly representable"),
])
def test_both_arms_refuse_the_same_with_the_same_message(case, target, edit, word):
    arrays = _tamper(target, edit)
    if case == "overflow":                       # a code large enough to overflow float32
        w = np.array(arrays["layers.1.attn.wo_b.weight"], copy=True)
        w[130, 131] = 0x7E                       # 448 * 2^127
        arrays["layers.1.attn.wo_b.weight"] = w
    if case == "inexact":                        # a small code times 2^-127 loses bf16 bits
        w = np.array(arrays["layers.0.attn.wq_a.weight"], copy=True)
        w[3, 4] = 0x01                           # 2^-9 * 2^-127
        arrays["layers.0.attn.wq_a.weight"] = w
    m_bf16, m_fp8 = _refusal(arrays)
    assert m_bf16 == m_fp8, (m_bf16, m_fp8)
    stem = target.rsplit(".", 1)[0]
    assert stem in m_fp8 and word in m_fp8, m_fp8


def test_extreme_but_exact_scales_are_accepted():
    """e8m0 3 with the smallest subnormal code (2^-133, the smallest bf16 subnormal) and e8m0
    246 with the largest code (448 * 2^119) are exact: both arms load, with the same values."""
    def edit(a):
        a[0, 0], a[0, 1] = 3, 246
    arrays = _tamper("layers.0.attn.wq_a.scale", edit)
    w = np.array(arrays["layers.0.attn.wq_a.weight"], copy=True)
    w[0, 0], w[1, 1], w[2, 200], w[3, 201] = 0x01, 0x81, 0x7E, 0xFE
    arrays["layers.0.attn.wq_a.weight"] = w
    ck = _tiny(arrays)
    f = _host_load(ck, "fp8", layers=range(1), embed=False, head=False)
    b = _host_load(ck, "bf16", layers=range(1), embed=False, head=False)
    name = "layers.0.attn.wq_a.weight"
    assert np.array_equal(dequant_fp8_block_bf16(f[name], f.scale_of(name), name), b[name])
    assert b[name][0, 0] == 0x0001 and b[name][1, 1] == 0x8001          # bf16 subnormals
    assert b[name][2, 200] == 0x7F60 and b[name][3, 201] == 0xFF60      # +-1.75 * 2^127


def _slow_ok(w, s) -> bool:
    try:
        dequant_fp8_block_bf16(w, s, "w")
        return True
    except FormatError:
        return False


def test_fast_check_equals_slow_check_on_every_code_and_scale():
    fast = np.zeros((256, 256), bool)
    slow = np.zeros((256, 256), bool)
    for s in range(256):
        sc = np.array([[s]], np.uint8)
        for c in range(256):
            w = np.array([[c]], np.uint8)
            fast[s, c] = fp8_block_exact_in_bf16(w, sc)
            slow[s, c] = _slow_ok(w, sc)
    assert np.array_equal(fast, slow), np.argwhere(fast != slow)[:10]
    assert slow[3:247].sum() == 244 * 254                  # every non-NaN code, scales 3..246
    assert not slow[:, 0x7F].any() and not slow[:, 0xFF].any() and not slow[255].any()


def test_fast_check_on_tensors_with_partial_blocks():
    rng = np.random.default_rng(11)
    w = rng.integers(0, 0x7F, (200, 300), dtype=np.uint8)           # no NaN codes
    sc = rng.integers(3, 247, (2, 3), dtype=np.uint8)
    assert fp8_block_exact_in_bf16(w, sc) and _slow_ok(w, sc)
    for (r, c), (bs, code) in (((199, 299), (0, 0x05)), ((128, 0), (1, 0x02)),
                               ((5, 257), (250, 0x7E)), ((150, 150), (120, 0x7F))):
        w2, s2 = w.copy(), sc.copy()
        s2[r // 128, c // 128] = bs
        w2[r, c] = code
        assert not fp8_block_exact_in_bf16(w2, s2) and not _slow_ok(w2, s2), (r, c, bs, code)
        w2[r, c] = 0x40 if code != 0x7F else 0x10                  # a harmless code instead
        assert fp8_block_exact_in_bf16(w2, s2) == _slow_ok(w2, s2), (r, c, bs)
    assert not fp8_block_exact_in_bf16(w, sc[:, :2])                # wrong scale shape
    assert not fp8_block_exact_in_bf16(w.astype(np.int8), sc)       # wrong dtype
    assert not fp8_block_exact_in_bf16(w, sc, block=0)


# ------------------------------------------------------------------------------ synthesis
def test_e4m3_codes_clipped_is_encode_e4m3_of_the_clipped_values():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1 << 16) * 32).astype(np.float32)
    x[:8] = [0.0, -0.0, 448.0, -500.0, 1e-9, -1e-30, 2.0 ** -6, 447.9]
    got = e4m3_codes_clipped(np, x)
    clipped = np.copysign(np.clip(np.abs(x), 2.0 ** -6, 448.0), x).astype(np.float32)
    assert np.array_equal(got, encode_e4m3(clipped))
    assert not np.isin(got, [0x7F, 0xFF]).any()
    vals = E4M3_VALUES[got]
    assert abs(float(np.sqrt(np.mean(vals.astype(np.float64) ** 2))) - 32) < 1.0


def test_stage_weights_fp8_contract_helpers():
    sw = StageWeights(0, range(1), False, False, dense_fmt="fp8")
    sw._put("layers.0.attn.wq_a.weight", np.zeros((4, 8), np.uint8))
    sw._put("layers.0.attn.wq_a.scale", np.zeros((1, 1), np.uint8))
    sw.fp8.add("layers.0.attn.wq_a")
    assert sw.nbytes == 33 and sw.is_fp8("layers.0.attn.wq_a.weight")
    assert sw.scale_of("layers.0.attn.wq_a.weight").shape == (1, 1)
    assert sw.scale_of("layers.0.attn.wkv.weight") is None
    assert float(E8M0_VALUES[127]) == 1.0
