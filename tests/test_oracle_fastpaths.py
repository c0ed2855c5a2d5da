"""The oracle's fast paths (flashspeed) against the computation they replaced, bit for bit.

* ``Oracle(cache_weights=False)`` decodes only the looked-up embedding rows, runs the lm head
  over vocab slices (both modes) and decodes a Checkpoint's routed FP4 experts straight to
  float64.  ``_Legacy`` below is the pre-change oracle (full embedding [ids], one lm_head over
  the whole [vocab, dim] weight, float32 expert weights widened by ``seams.mm``) over a
  checkpoint whose decoders are the pre-change ones (fancy-indexed LUTs, float32 only, a
  finiteness pass on every matrix).  Every output and capture must be bitwise equal, for the
  three numeric classes and both expert formats, with head slices of a few rows so the slicing
  is exercised at these sizes.
* The head slicing relies on BLAS computing one output element the same way whatever the
  number of weight rows in the call: checked at a wider size too.
* The decoders' float64 forms and the skipped finiteness pass: same values, same refusals.
"""

from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4 import formats as F
from memra_dsv4.checkpoint import Checkpoint, CheckpointError
from memra_dsv4.config import preset
from memra_dsv4.oracle import model as oracle_model
from memra_dsv4.oracle import ops
from memra_dsv4.oracle._blas import single_threaded_blas
from memra_dsv4.oracle.model import Oracle
from memra_dsv4.seams import mm
from memra_dsv4.synth import synth_arrays

PROMPT = [3, 17, 42, 5, 99, 7, 1, 250, 31, 64, 12, 8, 77, 2, 150, 9]


# ------------------------------------------------------------------ the pre-change decoders
def _legacy_unpack(u8):
    u8 = np.asarray(u8).view(np.uint8)
    return F._E2M1_PAIR_LUT[u8].reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def _legacy_mxfp4(packed, scale):
    scale = np.asarray(scale)
    s = F.E8M0_VALUES[scale]
    vals = _legacy_unpack(packed).reshape(*scale.shape, 32)
    with np.errstate(over="ignore"):
        w = (vals * s[..., None]).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    assert np.isfinite(w).all()
    return w


def _legacy_nvfp4(packed, wsb, ws2):
    wsb = np.asarray(wsb)
    s = F.E4M3_VALUES[wsb]
    vals = _legacy_unpack(packed).reshape(*wsb.shape, 16)
    with np.errstate(over="ignore"):
        w = ((vals * s[..., None]) * np.float32(ws2)).reshape(*packed.shape[:-1],
                                                             2 * packed.shape[-1])
    w = w.astype(np.float32, copy=False)
    assert np.isfinite(w).all()
    return w


class _LegacyCkpt:
    """config + dequant(name) only (no dequant_rows, not a Checkpoint): the oracle's plain
    paths, with the pre-change FP4 decoders."""

    def __init__(self, ck: Checkpoint):
        self.ck, self.config = ck, ck.config

    def dequant(self, name):
        spec = self.ck.spec(name)
        stem = name[: -len(".weight")]
        if spec.kind == "mxfp4":
            return _legacy_mxfp4(self.ck.raw(name), self.ck.raw(f"{stem}.scale"))
        if spec.kind == "nvfp4":
            return _legacy_nvfp4(self.ck.raw(name), self.ck.raw(f"{stem}.weight_scale"),
                                 self.ck.raw(f"{stem}.weight_scale_2"))
        if spec.kind == "fp8":
            w, sc = self.ck.raw(name), self.ck.raw(f"{stem}.scale")
            s = np.repeat(np.repeat(F.E8M0_VALUES[sc], 128, 0)[:w.shape[0]], 128, 1)
            return F.E4M3_VALUES[w][:, :] * s[:, :w.shape[1]]
        return self.ck.dequant(name)


class _Legacy(Oracle):
    """The pre-change embedding lookup and lm head."""

    def _embed(self, ids):
        return self.weight("embed.weight")[ids]

    def _lm_head(self, y):
        return ops.lm_head(y, self.weight("head.weight"), pol=self.pol)


def _outputs(o: Oracle):
    out = o.prefill(PROMPT, capture=True, all_logits=True)
    res = {"logits": out.logits, "hc": out.hc_state, "streams": out.streams}
    for i, cap in enumerate(out.captures):
        res.update({f"{i}.{k}": v for k, v in cap.items()})
    res.update({f"top.{k}": v for k, v in out.captures_top.items()})
    res["last"] = o.prefill(PROMPT[:5]).logits                # one row through the head
    if o.mtp_layers:
        m = o.mtp_forward(out.streams[:-1], PROMPT[1:], capture=True)
        res["mtp.logits"] = m.logits
        res.update({f"mtp.{k}": v for k, v in m.captures.items()})
    return res


def _assert_bitwise(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {k}: {x.dtype}{x.shape} " \
                                                          f"vs {y.dtype}{y.shape}"
        assert x.tobytes() == y.tobytes(), f"{what} {k}: not bitwise equal"


@pytest.fixture(scope="module")
def ckpts():
    return {(n, e): Checkpoint.from_arrays(preset(n), synth_arrays(preset(n), 0, e))
            for n in ("tiny", "small") for e in ("mxfp4", "nvfp4")}


@pytest.mark.parametrize("numerics", ["bf16", "exact", "reference"])
@pytest.mark.parametrize("name,experts", [("tiny", "mxfp4"), ("tiny", "nvfp4"),
                                          ("small", "mxfp4"), ("small", "nvfp4")])
def test_fast_paths_bit_identical_to_legacy(ckpts, monkeypatch, name, experts, numerics):
    ck = ckpts[(name, experts)]
    ref = _outputs(_Legacy(_LegacyCkpt(ck), numerics=numerics, cache_weights=True))
    D, V = ck.config.hidden_size, ck.config.vocab_size
    # slices of 128 / 192 rows (a ragged last one), then one slice.  (Much thinner slices
    # than the oracle ever takes, M*N*K <= 64^3, go through another OpenBLAS kernel whose float64
    # results differ in the last bit: visible in the exact class.)
    for rows in (128, 192, V):
        monkeypatch.setattr(oracle_model, "HEAD_CHUNK_ELEMS", rows * D)
        for cache in (False, True):
            o = Oracle(ck, numerics=numerics, cache_weights=cache)
            _assert_bitwise(ref, _outputs(o), f"{name}/{experts}/{numerics} cache={cache} "
                                              f"head rows {rows}")
            if not cache:
                assert "embed.weight" not in o._w and "head.weight" not in o._w


@pytest.mark.parametrize("M", [1, 3, 8, 20])
def test_head_slices_bitwise_at_width(M):
    """A wider head ([3000, 2048], float64 dot products of bf16 values) in slices of 512..2048
    rows equals one call over all rows, element for element (float64, before any rounding)."""
    rng = np.random.default_rng(M)
    W = F.decode_bf16(F.encode_bf16(rng.standard_normal((3000, 2048), dtype=np.float32) / 45))
    x = F.decode_bf16(F.encode_bf16(rng.standard_normal((M, 2048), dtype=np.float32)))
    x, W = x.astype(np.float64), W.astype(np.float64)
    with single_threaded_blas():
        full = mm(x, W.T)
        for step in (512, 1000, 2048):
            part = np.concatenate([mm(x, W[r:r + step].T) for r in range(0, 3000, step)], axis=1)
            assert full.tobytes() == part.tobytes(), f"M={M} slices of {step}"


# ------------------------------------------------------------------ decoders
def test_unpack_and_dequant_float64_equal_float32_values():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (2, 128, 64), dtype=np.uint8)
    assert F.unpack_e2m1(packed).tobytes() == _legacy_unpack(packed).tobytes()
    np.testing.assert_array_equal(F.unpack_e2m1(packed, dtype=np.float64),
                                  _legacy_unpack(packed).astype(np.float64))
    # every scale byte but NaN, overflow-capable ones excluded (checked below)
    scale = rng.integers(0, 253, (2, 128, 4), dtype=np.uint8)
    scale.reshape(-1)[:253] = np.arange(253)
    w32 = F.dequant_mxfp4(packed.view(np.int8), scale, "w")
    assert w32.tobytes() == _legacy_mxfp4(packed, scale).tobytes()
    w64 = F.dequant_mxfp4(packed.view(np.int8), scale, "w", np.float64)
    assert w64.dtype == np.float64
    assert w64.astype(np.float32).tobytes() == w32.tobytes()
    np.testing.assert_array_equal(w64, w32.astype(np.float64))
    # -0.0 kept
    assert np.array_equal(np.signbit(w64), np.signbit(w32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dequant_mxfp4_overflow_still_refused(dtype):
    p = np.zeros((2, 16), np.uint8)
    sc = np.full((2, 1), 253, np.uint8)
    p[0, 0] = 0x06       # 4 * 2^126 = 2^128: not a float32
    with pytest.raises(F.FormatError, match="overflow"):
        F.dequant_mxfp4(p, sc, "w", dtype)
    p[0, 0] = 0x05       # 3 * 2^126: finite
    w = F.dequant_mxfp4(p, sc, "w", dtype)
    assert w[0, 0] == 3 * 2.0 ** 126 and w.dtype == dtype
    sc[:] = 252
    p[0, 0] = 0x07       # 6 * 2^125 = 1.5 * 2^127: finite (the skipped check is safe)
    assert F.dequant_mxfp4(p, sc, "w", dtype)[0, 0] == 6 * 2.0 ** 125


@pytest.mark.parametrize("ws2", [2.0 ** -20, 1.0, 2.0 ** 116, 2.0 ** -116, 2.0 ** -130,
                                 0.3, 1e-40, 2.0 ** 120])
def test_dequant_nvfp4_float64_equals_float32(ws2):
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (8, 32), dtype=np.uint8)
    wsb = rng.integers(0, 0x7F, (8, 4), dtype=np.uint8)        # every non-negative code range
    wsb.reshape(-1)[:8] = [0, 1, 2, 7, 8, 0x78, 0x7E, 0x40]
    ws2 = np.float32(ws2)
    try:
        ref = _legacy_nvfp4(packed, wsb, ws2)
    except AssertionError:                                      # overflow: both refuse
        for dt in (np.float32, np.float64):
            with pytest.raises(F.FormatError, match="overflow"):
                F.dequant_nvfp4(packed, wsb, ws2, "w", dt)
        return
    w32 = F.dequant_nvfp4(packed, wsb, ws2, "w")
    w64 = F.dequant_nvfp4(packed, wsb, ws2, "w", np.float64)
    assert w32.dtype == np.float32 and w64.dtype == np.float64
    assert w32.tobytes() == ref.tobytes()
    assert w64.astype(np.float32).tobytes() == ref.tobytes()
    np.testing.assert_array_equal(w64, ref.astype(np.float64))


def test_checkpoint_dequant_float64_and_rows(ckpts):
    for (name, experts), ck in ckpts.items():
        for n in ck.names():
            spec = ck.spec(n)
            if spec.kind in ("mxfp4", "nvfp4") and ".experts.1." not in n:
                continue
            a, b = ck.dequant(n), ck.dequant(n, np.float64)
            if a.dtype == np.int64:
                assert b.dtype == np.int64 and np.array_equal(a, b)
            else:
                assert b.dtype == np.float64 and np.array_equal(b, a.astype(np.float64)), n
        full = ck.dequant("embed.weight")
        ids = np.array([5, 0, 5, ck.config.vocab_size - 1])
        assert ck.dequant_rows("embed.weight", ids).tobytes() == full[ids].tobytes()
        assert ck.dequant_rows("head.weight", slice(3, 11)).tobytes() == \
            ck.dequant("head.weight")[3:11].tobytes()
    with pytest.raises(CheckpointError, match="only BF16"):
        ck.dequant_rows("layers.0.attn.wq_a.weight", slice(0, 2))


def test_dequant_rows_refuses_non_finite_rows():
    cfg = preset("tiny")
    arrays = synth_arrays(cfg, 0)
    emb = arrays["embed.weight"].copy()
    emb[4, 3] = 0x7FC0                                          # bf16 NaN
    arrays["embed.weight"] = emb
    ck = Checkpoint.from_arrays(cfg, arrays)
    assert np.isfinite(ck.dequant_rows("embed.weight", np.array([1, 2]))).all()
    with pytest.raises(CheckpointError, match="non-finite"):
        ck.dequant_rows("embed.weight", np.array([1, 4]))
