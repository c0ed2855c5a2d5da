"""The prefill MoE's dispatch plan built on the device (kernels_cu/moe.cu moe_plan_*,
gpu.ops.prefill_moe.dispatch_on_device; seam MEMRA_DSV4_PREFILL_DISPATCH) against its NumPy twin
(prefill_moe.device_plan) and against the host plan (dispatch_plan) it replaces.

Everything here is BITWISE, no bounds:
* the device's tables (counts, rank order, first rows, segment prefixes, rows of every pick, the
  combine rows, the fp4mma items incl. the zero tail and the two counts) equal the twin's, and the
  rows / items equal dispatch_plan's with the padding removed (prefill_moe.compact);
* routed_moe(dispatch="device") == routed_moe(dispatch="host") bit for bit (same items, same
  rows, same kernels: an fp4mma output row depends on its own activation row, its expert and its
  item's row count only), at Flash shape (1K tokens, 256 experts, k = 6) for MXFP4 and NVFP4 and
  on small shapes with repeated ids / empty experts / one expert; the small ones also against the
  float64 oracle (MOE_REL_L2 of tests/gpu/test_prefill_moe_gpu.py), so "equal" is not "equally
  wrong";
* the device dispatch runs inside a CUDA-graph capture (a synchronising call there fails the
  capture; the host dispatch's id read back does, the negative control) and its replay equals the
  eager result;
* whole models (tiny MXFP4 / NVFP4, small, tiny over 2 stages): forward logits, prefill + chunked
  prefill + speculative verify logits with prefill_dispatch="device" equal "host" bit for bit, the
  device plan taken once per layer and chunk (counted), the phase bracket .../ffn/moe/dispatch
  still recorded, and the blaslt arm (always host-planned) unchanged under "device".
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops import prefill_moe as PM  # noqa: E402
from memra_dsv4.gpu.ops.testing import fresh_seed, rng_for  # noqa: E402
from test_prefill_moe_gpu import MOE_REL_L2, _case, _experts_on_device, _oracle_moe, _rel  # noqa: E402

pytestmark = pytest.mark.gpu


def _routing(kind, rng, T, k, E):
    if kind == "distinct":
        return np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    if kind == "repeats":                  # hash-routing tables may repeat an id in a row
        return rng.integers(0, E, (T, k)).astype(np.int64)
    if kind == "few":                      # most experts empty
        return rng.integers(0, min(E, 3), (T, k)).astype(np.int64)
    if kind == "one":                      # every pick on one expert
        return np.full((T, k), E - 1, np.int64)
    if kind == "skewed":                   # a hot expert, equal counts elsewhere (rank ties)
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
        idx[: T // 2, 0] = 7 % E
        return idx
    raise AssertionError(kind)


def _same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ------------------------------------------------------------------------------ the tables
@pytest.mark.parametrize("T,k,E,kind", [
    (1, 6, 256, "distinct"), (1, 1, 1, "one"), (37, 6, 256, "distinct"), (11, 6, 256, "few"),
    (700, 1, 16, "one"), (171, 3, 16, "repeats"), (1024, 6, 256, "distinct"),
    (1500, 6, 256, "skewed"), (8192, 6, 256, "distinct"), (3, 6, 1024, "distinct"),
    (353, 8, 384, "distinct"), (2, 4, 5, "repeats")])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_device_plan_equals_twin_and_host_plan(T, k, E, kind, dtype):
    seed = fresh_seed()
    idx = _routing(kind, rng_for(seed), T, k, E)
    with cp.cuda.Device(0):
        got = PM.dispatch_on_device(cp.asarray(idx.astype(dtype)), E).numpy()
    want = PM.device_plan(idx, E)
    ctx = f"seed {seed}: T {T} k {k} E {E} {kind} {np.dtype(dtype).name}"
    for name in ("eids", "counts", "ebase", "seg", "src", "flat", "rowof", "pos", "items",
                 "n_active", "n_items"):
        g, w = getattr(got, name), getattr(want, name)
        assert _same(np.asarray(g), np.asarray(w)), f"{ctx}: {name} differs from the twin"
    src, flat, pos, items = PM.compact(PM.dispatch_plan(idx, PM.group_size(2048, 4096)))
    assert _same(got.src, src) and _same(got.flat, flat) and _same(got.pos, pos), ctx
    assert _same(got.items[:got.n_items], items) and not got.items[got.n_items:].any(), ctx


# ------------------------------------------------------------------------- routed_moe
def _device_experts(seed, fmt, E, D, I):
    """Full-size random FP4 experts made on the device (host RNG would take ~minutes at E = 256)."""
    rs = cp.random.RandomState(seed)
    ex, ws2 = {}, {}
    for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        packed = rs.randint(0, 256, size=(E, o, i // 2), dtype=cp.int32).astype(cp.uint8)
        if fmt == "mxfp4":
            scale = rs.randint(116, 123, size=(E, o, i // 32), dtype=cp.int32).astype(cp.uint8)
        else:
            scale = rs.randint(0x20, 0x40, size=(E, o, i // 16), dtype=cp.int32).astype(cp.uint8)
            ws2[w] = cp.exp2(rs.randint(-9, -5, size=E).astype(cp.float32))
        ex[w] = (packed, scale)
    return ex, (ws2 or None)


def _flash_inputs(rng, T, k, D):
    """Device (x [T, D] bf16-valued, routing weights [T, k], shared-expert output [T, D]) of the
    Flash-shape dispatch tests, drawn from ``rng`` in this order."""
    x = cp.asarray(np.round(rng.standard_normal((T, D)) * 64).astype(np.float32) / 64)
    wts = cp.asarray((rng.random((T, k)) * 0.5).astype(np.float32))
    shared = cp.asarray((rng.standard_normal((T, D)) * 1e-3).astype(np.float32))
    return x, wts, shared


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_routed_moe_device_dispatch_bitwise_at_flash_shape(fmt):
    """1K tokens, 256 full-size experts, top-6 (distinct, as the learned router) and a hash-style
    routing with repeats: device dispatch == host dispatch, every bit."""
    seed = fresh_seed()
    rng = rng_for(seed)
    T, k, E, D, I = 1024, 6, 256, 4096, 2048
    with cp.cuda.Device(0):
        ex, ws2 = _device_experts(seed, fmt, E, D, I)
        x, wts, shared = _flash_inputs(rng, T, k, D)
        for kind in ("distinct", "repeats"):
            idx = cp.asarray(_routing(kind, rng, T, k, E))
            outs = {d: PM.routed_moe(None, x, idx, wts, ex, fmt, 10.0, shared, ws2=ws2, gemm="fp4mma",
                                     dispatch=d).get() for d in ("host", "device")}
            assert np.isfinite(outs["host"]).all() and np.abs(outs["host"]).max() > 0, f"seed {seed}"
            assert _same(outs["device"], outs["host"]), (
                f"seed {seed} {fmt} {kind}: device dispatch differs from host dispatch in "
                f"{int((outs['device'] != outs['host']).sum())} elements")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,k,E,D,I,kind", [
    (1, 6, 16, 4096, 2048, "distinct"),      # one row per expert
    (200, 6, 8, 512, 256, "distinct"),       # full 64-row items
    (33, 4, 16, 512, 256, "repeats"),        # repeated ids, empty experts
    (150, 1, 16, 256, 128, "one"),           # every pick on one expert: 3 items, a partial one
    (40, 2, 8, 256, 128, "few"),
])
def test_routed_moe_device_dispatch_bitwise_and_oracle(fmt, T, k, E, D, I, kind):
    seed = fresh_seed()
    x, _, wts, shared, host = _case(seed, fmt, T, k, E, D, I, True)
    idx = _routing(kind, rng_for(seed + 1), T, k, E)
    with cp.cuda.Device(0):
        ex, ws2 = _experts_on_device(host, fmt)
        xd, wd, sd = cp.asarray(x), cp.asarray(wts), cp.asarray(shared)
        got = {}
        for d in ("host", "device"):
            for form in ("numpy", "device"):     # the ids as a host array or on the device
                ids = idx if form == "numpy" else cp.asarray(idx)
                got[d, form] = PM.routed_moe(None, xd, ids, wd, ex, fmt, 10.0, sd, ws2=ws2,
                                             gemm="fp4mma", dispatch=d).get()
    for key, v in got.items():
        assert _same(v, got["host", "numpy"]), f"seed {seed}: {key} differs from host dispatch"
    r = _rel(got["device", "device"], _oracle_moe(fmt, host, x, idx, wts, shared))
    assert r <= MOE_REL_L2, f"seed {seed}: device dispatch vs float64 oracle relL2 {r:.2e}"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4mma_empty_items_write_nothing(fmt):
    """Items of 0 rows (the device plan's tail up to max_mma_items) leave every row alone, in
    gate/up and in down, wherever they point; the real items before them are unchanged."""
    seed = fresh_seed()
    rng = rng_for(seed)
    E, D, I, P = 3, 256, 128, 40
    with cp.cuda.Device(0):
        ex, ws2 = _device_experts(seed, fmt, E, D, I)
        real = np.array([[1, 5, 20, 0], [2, 25, 3, 0]], np.int32)
        tail = np.array([[0, 0, 0, 0]] * 6 + [[2, 30, 0, 0]], np.int32)
        xs = cp.asarray(rng.integers(0x3c00, 0x4000, (P, D)).astype(np.uint16))   # bf16 in [2^-7, 2)
        wf = cp.asarray(rng.random(P).astype(np.float32))
        flat = cp.arange(P, dtype=cp.int32)
        outs = {}
        for name, items in (("real", real), ("with tail", np.concatenate([real, tail]))):
            hs = cp.full((P, I), 0xFFFF, dtype=cp.uint16)
            ys = cp.full((P, D), np.nan, dtype=cp.float32)
            it = cp.asarray(items)
            PM.fp4mma_gateup(fmt, ex["w1"], ex["w3"], it, xs, wf, flat, 10.0, hs,
                             None if ws2 is None else (ws2["w1"], ws2["w3"]))
            PM.fp4mma_down(fmt, ex["w2"], it, hs, ys, None if ws2 is None else ws2["w2"])
            outs[name] = (hs.get(), ys.get())
    hs, ys = outs["with tail"]
    covered = np.zeros(P, bool)
    covered[5:25] = covered[25:28] = True
    assert (hs[~covered] == 0xFFFF).all() and np.isnan(ys[~covered]).all(), f"seed {seed}: empty items wrote"
    assert not np.isnan(ys[covered]).any(), f"seed {seed}"
    assert _same(hs, outs["real"][0]) and _same(ys, outs["real"][1]), f"seed {seed}"


# --------------------------------------------------------------------------- no host sync
def _capture_case():
    seed = fresh_seed()
    x, idx, wts, shared, host = _case(seed, "mxfp4", 300, 6, 32, 512, 256, True)
    ex, _ = _experts_on_device(host, "mxfp4")
    return seed, cp.asarray(x), cp.asarray(idx), cp.asarray(wts), cp.asarray(shared), ex


def _assert_graph_replay_equals_eager(gemm: str):
    """The device dispatch of ``gemm`` captured into a CUDA graph: the capture succeeds and its
    replay equals the eager result bit for bit (shared by the fp4mma and wgmma tests)."""
    from memra_dsv4.gpu import graphs
    with cp.cuda.Device(0):
        seed, x, idx, wts, shared, ex = _capture_case()
        stream = cp.cuda.Stream(non_blocking=True)
        held = {}

        def run():
            held["y"] = PM.routed_moe(None, x, idx, wts, ex, "mxfp4", 10.0, shared, gemm=gemm,
                                      dispatch="device")
        with stream:
            run()                                   # kernels built, pool blocks on this stream
        stream.synchronize()
        eager = held["y"].get()
        graph = graphs.capture(stream, run)
        held["y"].fill(np.nan)
        graphs.replay(graph, stream)
        stream.synchronize()
        assert _same(held["y"].get(), eager), f"seed {seed}: {gemm}: graph replay differs from eager"


def test_device_dispatch_captures_into_a_graph():
    """A synchronising call inside a stream capture fails it, so a capture that succeeds is a
    routed MoE that never waits for the GPU; its replay equals the eager result bit for bit."""
    _assert_graph_replay_equals_eager("fp4mma")


def test_host_dispatch_cannot_be_captured():
    """The negative control of the test above: the host dispatch reads the ids back, and that
    read fails a capture."""
    from memra_dsv4.gpu import graphs
    with cp.cuda.Device(0):
        seed, x, idx, wts, shared, ex = _capture_case()
        stream = cp.cuda.Stream(non_blocking=True)

        def run():
            PM.routed_moe(None, x, idx, wts, ex, "mxfp4", 10.0, shared, gemm="fp4mma", dispatch="host")
        with stream:
            run()
        stream.synchronize()
        with pytest.raises(RuntimeError):
            graphs.capture(stream, run)
        with stream:                                # the stream is usable again
            run()
        stream.synchronize()


# ------------------------------------------------------------------------------- models
_MODELS: dict = {}


def _model(name, devices, experts="mxfp4"):
    from memra_dsv4.gpu.model import Dsv4Gpu
    from test_prefill_gpu import _ckpt
    key = (name, tuple(devices), experts)
    if key not in _MODELS:
        _MODELS[key] = Dsv4Gpu.load(_ckpt(name, experts), devices=devices, max_seq_len=512,
                                    prefill_moe="fp4mma", prefill_dispatch="host")
    return _MODELS[key]


class _Counter:
    def __init__(self, monkeypatch):
        self.n = 0
        real = PM.dispatch_on_device

        def counted(*a, **kw):
            self.n += 1
            return real(*a, **kw)
        monkeypatch.setattr(PM, "dispatch_on_device", counted)


def _run_all(m, ids):
    """forward logits; prefill + prefill_chunk (all logits) + verify logits on a fresh state."""
    out = {"forward": m.forward(ids).logits}
    a, b = len(ids) // 2, len(ids) - 5
    out["prefill"], st = m.prefill(ids[:a], m.new_state())
    out["chunk"] = m.prefill_chunk(st, ids[a:b], all_logits=True)
    out["verify"] = m.verify(st, ids[b:])
    m.commit(st, 1)
    return out


@pytest.mark.parametrize("name,devices,experts,S", [
    ("tiny", (0,), "mxfp4", 90), ("tiny", (0,), "nvfp4", 90), ("small", (0,), "mxfp4", 200),
    ("tiny", (0, 1), "mxfp4", 90)], ids=["tiny-mxfp4", "tiny-nvfp4", "small", "tiny-2stages"])
def test_model_device_dispatch_bitwise(name, devices, experts, S, monkeypatch):
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    m = _model(name, devices, experts)
    cfg = m.config
    assert m.prefill_moe == "fp4mma"
    from memra_dsv4.gpu.model import _Block
    blk = _Block(m, m.stages[0], m.stages[0].layers[0], "t")
    assert blk._moe_gemm(cfg.hidden_size, cfg.moe_intermediate_size) == "fp4mma", "the test would be vacuous"
    ids = np.random.default_rng(S).integers(0, cfg.vocab_size, S)
    count = _Counter(monkeypatch)
    m.prefill_dispatch = "host"
    try:
        host = _run_all(m, ids)
        assert count.n == 0
        m.prefill_dispatch = "device"
        dev = _run_all(m, ids)
    finally:
        m.prefill_dispatch = "host"
    chunks = 4                                      # forward, prefill, prefill_chunk, verify
    assert count.n == chunks * cfg.num_hidden_layers, f"device plan taken {count.n} times"
    for key in host:
        assert _same(dev[key], host[key]), (
            f"{name} {experts} {devices}: {key} logits differ between dispatch device and host")


def test_dispatch_bracket_and_blaslt_arm_under_device(monkeypatch):
    """Under dispatch "device" the bracket prefill/stage0/block/ffn/moe/dispatch is still recorded
    (with GPU time), and the blaslt arm keeps its host plan: no device plan, same bits as "host"."""
    from memra_dsv4.profiling import phase_collect, phase_reset, prof_configure
    m = _model("tiny", (0,))
    ids = np.random.default_rng(1).integers(0, m.config.vocab_size, 40)
    m.prefill_dispatch = "device"
    try:
        m.forward(ids)
        prof_configure("events")
        try:
            phase_reset()
            m.forward(ids)
            times = phase_collect()
        finally:
            prof_configure("off")
        br = "prefill/stage0/block/ffn/moe/dispatch"
        assert br in times and all(t > 0 for t in times[br]), sorted(times)
        count = _Counter(monkeypatch)
        m.prefill_moe = "blaslt"
        lb_dev = m.forward(ids).logits
        m.prefill_dispatch = "host"
        lb_host = m.forward(ids).logits
        assert count.n == 0, "blaslt took the device plan"
        assert _same(lb_dev, lb_host)
    finally:
        m.prefill_moe, m.prefill_dispatch = "fp4mma", "host"
