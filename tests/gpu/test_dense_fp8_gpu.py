"""The dense seam on the GPU: Dsv4Gpu.load(..., dense="fp8") keeps the FP8 linears as stored
and the chunk routine (prefill, legacy decode) gives the same bits as dense="bf16".

* load of the tiny synthetic checkpoint: every FP8 linear is ``{stem}.weight`` uint8 [out, in]
  (the stored e4m3 bytes) + ``{stem}.scale`` uint8 [ceil(out/128), ceil(in/128)] (e8m0 bytes),
  ``StageWeights.fp8`` names them, and their kernel dequantisation equals the bf16 arm's weight;
* prefill logits (all rows), the ForwardOut captures and a few legacy decode steps are
  bit-identical between the two arms (the FP8 arm dequantises into the scratch, then the same
  cuBLASLt GEMM);
* 2 stages (when two GPUs are present): the same, and the placement uses the fp8 byte math;
* synthetic dense="fp8": no NaN codes, scales in the exact range, finite logits.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.checkpoint import Checkpoint  # noqa: E402
from memra_dsv4.config import preset  # noqa: E402
from memra_dsv4.synth import synth_arrays  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 42, 5, 99, 7, 1, 250, 31, 64, 12, 8, 77, 2, 150, 9, 60, 4, 33, 120]


def _bits(a):
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.fixture(scope="module")
def tiny_pair():
    from memra_dsv4.gpu.model import Dsv4Gpu
    cfg = preset("tiny")
    ck = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=0))
    return ck, *(Dsv4Gpu.load(ck, devices=(0,), dense=d, decode_path="legacy") for d in ("bf16", "fp8"))


def test_fp8_load_keeps_stored_bytes(tiny_pair):
    from memra_dsv4.gpu.ops.dense import dequant_fp8_bf16
    ck, mb, mf = tiny_pair
    assert (mb.dense, mf.dense) == ("bf16", "fp8")
    sb, sf = mb.stages[0], mf.stages[0]
    fp8 = {s.name[:-7] for s in ck.specs() if s.kind == "fp8"
           and s.layer is not None and s.layer < ck.config.num_hidden_layers}
    assert sf.dense_fmt == "fp8" and sf.fp8 == fp8 and sb.fp8 == set()
    for stem in sorted(fp8):
        w, sc = sf[f"{stem}.weight"], sf[f"{stem}.scale"]
        spec = ck.spec(f"{stem}.weight")
        assert isinstance(w, cp.ndarray) and w.dtype == cp.uint8 and w.shape == spec.shape
        assert sc.dtype == cp.uint8 and sc.shape == tuple(-(-d // 128) for d in spec.shape)
        assert np.array_equal(w.get(), ck.raw(f"{stem}.weight").view(np.uint8)), stem
        assert np.array_equal(sc.get(), ck.raw(f"{stem}.scale").view(np.uint8)), stem
        with cp.cuda.Device(sf.device):
            d = dequant_fp8_bf16(w, sc)
        assert sb[f"{stem}.weight"].dtype == cp.uint16
        assert cp.array_equal(d, sb[f"{stem}.weight"]), stem
    assert sf.nbytes < sb.nbytes


def test_fp8_prefill_and_decode_bit_identical(tiny_pair):
    _, mb, mf = tiny_pair
    ob, of = mb.forward(PROMPT, capture=True), mf.forward(PROMPT, capture=True)
    assert np.array_equal(_bits(ob.logits), _bits(of.logits))
    for i, (cb, cf) in enumerate(zip(ob.captures, of.captures)):
        for k in cb:
            assert np.array_equal(np.asarray(cb[k]), np.asarray(cf[k])), f"block {i} {k}"
    lb, stb = mb.prefill(PROMPT, all_logits=True)
    lf, stf = mf.prefill(PROMPT, all_logits=True)
    assert np.array_equal(_bits(lb), _bits(lf))
    tb = tf = int(np.argmax(lb[-1]))
    for step in range(4):                                   # legacy decode: the chunk routine
        yb, yf = mb.decode_step(stb, tb), mf.decode_step(stf, tf)
        assert np.array_equal(_bits(yb), _bits(yf)), f"decode step {step}"
        tb = tf = int(np.argmax(yb))


def test_fp8_device_step_bit_identical(tiny_pair):
    """The device step (graph replay) reads the stored FP8 bytes in its GEMVs
    (decode.cu gemv_fp8_* kernels, warp_rows_dot on e4m3) and must give the bf16 arm's bits: same products, same
    order.  12 steps after a 5-token prefill cross a CSA emit and the tiny window."""
    from memra_dsv4.gpu.step import device_step
    _, mb, mf = tiny_pair
    sb, sf = mb.prefill(PROMPT[:5], mb.new_state())[1], mf.prefill(PROMPT[:5], mf.new_state())[1]
    for m in (mb, mf):
        m.decode_path = "device"
    try:
        for i, t in enumerate(PROMPT[5:17]):
            yb, yf = device_step(mb, sb, t, graph=True), device_step(mf, sf, t, graph=True)
            assert np.array_equal(_bits(yb), _bits(yf)), f"device step {i} (pos {5 + i})"
        ga, gb = sb.snapshot(), sf.snapshot()
        diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
        assert not diff, f"fp8 vs bf16 device-step state differs in {diff}"
    finally:
        for m in (mb, mf):
            m.decode_path = "legacy"
            m._step = None


@pytest.mark.multi_gpu
def test_fp8_two_stages_bit_identical():
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.gpu.weights import weight_plan
    cfg = preset("small")
    ck = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=1))
    mb = Dsv4Gpu.load(ck, devices=(0, 1), dense="bf16", decode_path="legacy")
    mf = Dsv4Gpu.load(ck, devices=(0, 1), dense="fp8", decode_path="legacy")
    assert [(st.layers, st.has_embed, st.has_head) for st in mf.stages] == \
        [(l, e, h) for _, l, e, h in weight_plan(cfg, 2, dense="fp8")]
    assert np.array_equal(_bits(mb.forward(PROMPT).logits), _bits(mf.forward(PROMPT).logits))


def test_synthetic_fp8_tiny():
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = Dsv4Gpu.synthetic("tiny", devices=(0,), seed=2, dense="fp8")
    st = m.stages[0]
    assert m.dense == "fp8" and st.fp8
    for stem in st.fp8:
        w, sc = st[f"{stem}.weight"], st[f"{stem}.scale"]
        assert w.dtype == cp.uint8 and sc.dtype == cp.uint8
        assert sc.shape == tuple(-(-d // 128) for d in w.shape)
        assert not bool(((w & 0x7F) == 0x7F).any()), stem
        assert int(sc.min()) >= 3 and int(sc.max()) <= 246, stem
    logits = m.forward(PROMPT).logits
    assert np.isfinite(logits).all()
