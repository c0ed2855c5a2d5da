"""The wgmma arm of the prefill routed experts on the device-built dispatch plan
(routed_moe(gemm="wgmma", dispatch="device"): kernels_cu/moe.cu moe_plan_scan with wg = 1 writes
prefill_moe.wg_items' split over the compact rows; gather_rows_perm over those rows).

Everything here is BITWISE, no bounds:
* the device's tables with the wgmma items equal the twin's (device_plan(idx, E, "wgmma")) and
  dispatch_plan's without the padding (compact(plan, "wgmma"): wg_items renumbered);
* at Flash shape (1K tokens, 256 experts, k = 6; MXFP4 and NVFP4; distinct and repeated ids):
  wgmma with the device plan == wgmma with the host plan (guaranteed by construction: the same
  items, each row's tile NB and data the same, only the row numbering differs), and == fp4mma with
  the device plan (the two arms are bit-identical: same exact products, each k16 step summed by
  the tensor core, the same k order per 128-chunk);
* small shapes with experts of > WG_BN picks (split items), repeats and empty experts: the same
  three-way equality, and the float64 oracle (MOE_REL_L2) so "equal" is not "equally wrong";
* the wgmma device dispatch captures into a CUDA graph (no host synchronisation) and replays equal;
* a tiny model's forward logits: prefill_moe wgmma + dispatch device == wgmma + host ==
  fp4mma + device, the device plan taken once per layer.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import prefill_moe as PM  # noqa: E402
from memra_dsv4.gpu.ops.testing import fresh_seed, rng_for  # noqa: E402
from test_prefill_dispatch_gpu import (_assert_graph_replay_equals_eager, _Counter,  # noqa: E402
                                       _device_experts, _flash_inputs, _model, _routing, _same)
from test_prefill_moe_gpu import MOE_REL_L2, _case, _experts_on_device, _oracle_moe, _rel  # noqa: E402

pytestmark = pytest.mark.gpu


def _diff(a, b):
    return int((np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32)).sum())


# ------------------------------------------------------------------------------ the tables
@pytest.mark.parametrize("T,k,E,kind", [
    (1, 6, 256, "distinct"), (700, 1, 16, "one"), (171, 3, 16, "repeats"), (11, 6, 256, "few"),
    (1500, 6, 256, "skewed"), (8192, 6, 256, "distinct"), (353, 8, 384, "distinct")])
def test_device_plan_wgmma_items_equal_twin_and_host_plan(T, k, E, kind):
    seed = fresh_seed()
    idx = _routing(kind, rng_for(seed), T, k, E)
    with cp.cuda.Device(0):
        got = PM.dispatch_on_device(cp.asarray(idx), E, "wgmma").numpy()
    want = PM.device_plan(idx, E, "wgmma")
    ctx = f"seed {seed}: T {T} k {k} E {E} {kind}"
    for name in ("eids", "counts", "ebase", "seg", "src", "flat", "rowof", "pos", "items",
                 "n_active", "n_items"):
        g, w = getattr(got, name), getattr(want, name)
        assert _same(np.asarray(g), np.asarray(w)), f"{ctx}: {name} differs from the twin"
    assert got.items.shape == (PM.max_mma_items(T * k, E, PM.WG_BN), 4), ctx
    src, flat, pos, items = PM.compact(PM.dispatch_plan(idx, PM.group_size(2048, 4096)), "wgmma")
    assert _same(got.src, src) and _same(got.flat, flat) and _same(got.pos, pos), ctx
    assert _same(got.items[:got.n_items], items) and not got.items[got.n_items:].any(), ctx


# ------------------------------------------------------------------------- routed_moe
def _three(x, idx, wts, ex, fmt, shared, ws2):
    return {arm: PM.routed_moe(None, x, idx, wts, ex, fmt, 10.0, shared, ws2=ws2, gemm=arm[0],
                               dispatch=arm[1]).get()
            for arm in (("wgmma", "device"), ("wgmma", "host"), ("fp4mma", "device"))}


def _assert_three(outs, ctx):
    wd, wh, fd = outs["wgmma", "device"], outs["wgmma", "host"], outs["fp4mma", "device"]
    assert np.isfinite(wh).all() and np.abs(wh).max() > 0, ctx
    assert _same(wd, wh), f"{ctx}: wgmma device dispatch != wgmma host dispatch in {_diff(wd, wh)} elements"
    assert _same(wd, fd), f"{ctx}: wgmma device dispatch != fp4mma device dispatch in {_diff(wd, fd)} elements"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_routed_moe_wgmma_device_dispatch_bitwise_at_flash_shape(fmt):
    """1K tokens, 256 full-size experts, top-6 (distinct, as the learned router) and a hash-style
    routing with repeats: wgmma/device == wgmma/host == fp4mma/device, every bit."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, k, E, D, I = 1024, 6, 256, 4096, 2048
    with cp.cuda.Device(0):
        ex, ws2 = _device_experts(seed, fmt, E, D, I)
        x, wts, shared = _flash_inputs(rng, T, k, D)
        for kind in ("distinct", "repeats"):
            idx = cp.asarray(_routing(kind, rng, T, k, E))
            _assert_three(_three(x, idx, wts, ex, fmt, shared, ws2), f"seed {seed} {fmt} {kind}")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,k,E,D,I,kind", [
    (300, 1, 16, 256, 128, "one"),           # one expert, 300 picks: items 112 + 112 + 76
    (200, 6, 8, 512, 256, "distinct"),       # 150 picks per expert: 80 + 70
    (33, 4, 16, 512, 256, "repeats"),        # repeated ids, empty experts, items < 16 rows
])
def test_routed_moe_wgmma_device_dispatch_bitwise_and_oracle(fmt, T, k, E, D, I, kind):
    seed = fresh_seed()
    x, _, wts, shared, host = _case(seed, fmt, T, k, E, D, I, True)
    idx = _routing(kind, rng_for(seed + 1), T, k, E)
    with cp.cuda.Device(0):
        ex, ws2 = _experts_on_device(host, fmt)
        xd, wd, sd = cp.asarray(x), cp.asarray(wts), cp.asarray(shared)
        outs = _three(xd, cp.asarray(idx), wd, ex, fmt, sd, ws2)
        numpy_ids = PM.routed_moe(None, xd, idx, wd, ex, fmt, 10.0, sd, ws2=ws2, gemm="wgmma",
                                  dispatch="device").get()       # the ids as a host array
    ctx = f"seed {seed} {fmt} T {T} k {k} E {E} {kind}"
    _assert_three(outs, ctx)
    assert _same(numpy_ids, outs["wgmma", "device"]), f"{ctx}: NumPy ids differ from device ids"
    r = _rel(outs["wgmma", "device"], _oracle_moe(fmt, host, x, idx, wts, shared))
    assert r <= MOE_REL_L2, f"{ctx}: wgmma device dispatch vs float64 oracle relL2 {r:.2e}"


# --------------------------------------------------------------------------- no host sync
def test_wgmma_device_dispatch_captures_into_a_graph():
    """A synchronising call inside a stream capture fails it (tests/gpu/test_prefill_dispatch_gpu.py
    test_host_dispatch_cannot_be_captured is the negative control), so a capture that succeeds is a
    routed MoE that never waits for the GPU; its replay equals the eager result bit for bit."""
    _assert_graph_replay_equals_eager("wgmma")


# ------------------------------------------------------------------------------- a model
def test_tiny_model_wgmma_device_dispatch_bitwise(monkeypatch):
    """The tiny MXFP4 model's forward logits: prefill_moe wgmma with dispatch device == wgmma with
    dispatch host == fp4mma with dispatch device; the device plan taken once per layer."""
    from memra_dsv4.gpu.model import _Block
    m = _model("tiny", (0,))
    cfg = m.config
    blk = _Block(m, m.stages[0], m.stages[0].layers[0], "t")
    ids = np.random.default_rng(90).integers(0, cfg.vocab_size, 90)
    out = {}
    try:
        for gemm, disp in (("wgmma", "host"), ("wgmma", "device"), ("fp4mma", "device")):
            m.prefill_moe, m.prefill_dispatch = gemm, disp
            assert blk._moe_gemm(cfg.hidden_size, cfg.moe_intermediate_size) == gemm, "vacuous"
            assert blk._moe_dispatch(gemm) == disp
            count = _Counter(monkeypatch)
            out[gemm, disp] = m.forward(ids).logits
            assert count.n == (cfg.num_hidden_layers if disp == "device" else 0), (gemm, disp, count.n)
    finally:
        m.prefill_moe, m.prefill_dispatch = "fp4mma", "host"
    wd, wh, fd = out["wgmma", "device"], out["wgmma", "host"], out["fp4mma", "device"]
    assert np.isfinite(wd).all()
    assert _same(wd, wh), "tiny: wgmma logits differ between dispatch device and host"
    assert _same(wd, fd), "tiny: wgmma + device logits differ from fp4mma + device"
