"""The ``device`` decode path (memra_dsv4.gpu.step_device.DeviceStep) on the GPU.

* device within bf16-class bounds of legacy over 20 steps, tiny (prefill L=5: crosses window
  8/9, CSA emits every 4, HCA 15/16) and small (L=5 and L=30: window 32 / HCA 32);
  judged as a trajectory across implementations (test_decode_gpu._trajectory_check);
* graph replay == eager, byte for byte (logits and the whole cache snapshot);
* zero CuPy pool allocations over 5 graph replays;
* 2 stages == 1 stage, byte for byte, on the device path (multi_gpu);
* the #7 contract: prefill(L) for L in {1, 2, 3, 4, 5, 127, 128, 129, 300} (small: a subset)
  then 300 device steps, against the oracle's decode and the GPU re-prefill (trajectories) and
  the oracle's final state.
Every failure prints the per-step lines (rel L2, top-1, gap).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decode_gpu import _ids, _model, _oracle, _state_check, _trajectory_check  # prepend import mode

STEPS = 20
LONG_STEPS = 300                                    # the #7 contract: 300 steps after prefill(L)
LONG_L = {"tiny": (1, 2, 3, 4, 5, 127, 128, 129, 300),
          "small": (1, 4, 129, 300)}                # small: the CPU oracle costs ~30 ms a step
REPREFILL_EVERY = 50


def _run(name, path, L, steps, devices=(0,), graph=None, seed=21):
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, devices, path)
    ids = _ids(ck.config, L + steps, seed=seed)
    _, st = m.prefill(ids[:L], m.new_state())
    if path == "legacy":
        return [m.decode_step(st, t) for t in ids[L:]], st
    return [device_step(m, st, t, graph=graph) for t in ids[L:]], st


@pytest.mark.parametrize("name,L", [("tiny", 5), ("tiny", 13), ("small", 5), ("small", 30)])
def test_device_path_within_bounds_of_legacy(name, L):
    a, sa = _run(name, "legacy", L, STEPS)
    b, sb = _run(name, "device", L, STEPS, graph=True)
    fails, lines = [], []
    _trajectory_check(f"{name} L={L} device vs legacy",
                      [(f"{name} L={L} step pos {L + i}", y, x) for i, (x, y) in enumerate(zip(a, b))],
                      fails, lines)
    assert sb.pos == sa.pos == L + STEPS
    print("\n".join(lines))
    assert not fails, "\n".join(fails + lines)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_device_long_decode_tracks_oracle_and_reprefill(name):
    """prefill(L), then 300 device steps (graph replay, teacher-forced ids) for L across the
    boundaries (short prompts, CSA emits, the window wrap at 127/128/129, 300): every step
    against the oracle's decode, every REPREFILL_EVERY steps against the GPU re-prefill of the
    prefix, each judged as a cross-implementation trajectory (test_decode_gpu bounds), and the
    final caches against the oracle's state (test_decode_gpu._state_check)."""
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, (0,), "device")
    ora = _oracle(name)
    fails, lines = [], []
    for L in LONG_L[name]:
        ids = _ids(ck.config, L + LONG_STEPS, seed=100 + L)
        _, st = m.prefill(ids[:L], m.new_state())
        ost = ora.prefill_state(ids[:L]).state
        vs_oracle, vs_prefill = [], []
        for i in range(LONG_STEPS):
            p = L + i
            got = device_step(m, st, ids[p], graph=True)
            vs_oracle.append((f"{name} L={L} pos {p} vs oracle", got, ora.decode_step(ost, ids[p])))
            if i % REPREFILL_EVERY == 0 or i == LONG_STEPS - 1:
                ref = m.forward(ids[:p + 1]).logits     # the chunk routine on a fresh state
                vs_prefill.append((f"{name} L={L} pos {p} vs re-prefill", got, ref))
        _trajectory_check(f"{name} L={L} vs oracle decode", vs_oracle, fails, lines)
        _trajectory_check(f"{name} L={L} vs re-prefill", vs_prefill, fails, lines)
        assert st.pos == L + LONG_STEPS
        _state_check(st, ost, fails, lines)
    print("\n".join(line for line in lines if "median" in line or "state" in line))
    assert not fails, "\n".join(fails)


def test_device_graph_equals_eager_bytes_and_allocates_nothing():
    from memra_dsv4.gpu.arena import count_allocations
    from memra_dsv4.gpu.step import device_step
    ck, m = _model("tiny", (0,), "device")
    ids = _ids(ck.config, 35, seed=23)
    _, se = m.prefill(ids[:5], m.new_state())
    _, sg = m.prefill(ids[:5], m.new_state())
    eager = [device_step(m, se, t, graph=False) for t in ids[5:25]]
    graph = [device_step(m, sg, t, graph=True) for t in ids[5:25]]
    bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(eager, graph))
           if not np.array_equal(x, y)]
    assert not bad, f"graph vs eager logits differ at steps (step, max|diff|): {bad}"
    ga, gb = se.snapshot(), sg.snapshot()
    diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
    assert not diff, f"graph vs eager state differs in {diff}"
    with count_allocations() as c:
        for t in ids[25:30]:
            device_step(m, sg, t, graph=True)
    assert c.total == 0, f"{c} allocations in 5 graph steps"


@pytest.mark.multi_gpu
def test_device_two_stages_equal_one_stage():
    a, sa = _run("small", "device", 30, 10, devices=(0,))
    b, sb = _run("small", "device", 30, 10, devices=(0, 1))
    bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(a, b))
           if not np.array_equal(x, y)]
    assert not bad, f"1 vs 2 stages differ at (step, max|diff|): {bad}"
    ga, gb = sa.snapshot(), sb.snapshot()
    diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
    assert not diff, f"1 vs 2 stage state differs in {diff}"


@pytest.mark.parametrize("name,devices", [("tiny", (0,)), ("small", (0,)), ("small", (0, 1))],
                         ids=["tiny-1stage", "small-1stage", "small-2stages"])
def test_pdl_graph_equals_plain_graph_and_eager(name, devices):
    """Programmatic dependent launch (gpu/pdl.py) changes when a kernel starts, never what it
    computes: 24 steps (crossing window wraps and compressor emits) replayed from PDL graphs,
    from plain graphs and eagerly with PDL launches give the same logits and caches, byte for
    byte, and the PDL graph allocates nothing."""
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    from memra_dsv4.gpu.arena import count_allocations
    from memra_dsv4.gpu.step import device_step
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, 40, seed=29)
    runs = {}
    keep = getattr(m, "pdl", "off")
    try:
        for label, pdl, graph in (("plain graph", "off", True), ("pdl graph", "on", True),
                                  ("pdl eager", "on", False)):
            m.pdl = pdl
            _, st = m.prefill(ids[:7], m.new_state())
            runs[label] = ([device_step(m, st, t, graph=graph) for t in ids[7:31]], st)
        m.pdl = "on"
        with count_allocations() as c:
            for t in ids[31:35]:
                device_step(m, runs["pdl graph"][1], t, graph=True)
        assert c.total == 0, f"{c} allocations in 4 PDL graph steps"
    finally:
        m.pdl = keep
    ref, sref = runs["plain graph"]
    for label in ("pdl graph", "pdl eager"):
        got, st = runs[label]
        bad = [(i, float(np.abs(x - y).max())) for i, (x, y) in enumerate(zip(ref, got))
               if not np.array_equal(x, y)]
        assert not bad, f"{label} vs plain graph logits differ at (step, max|diff|): {bad}"
    ga, gb = sref.snapshot(), runs["pdl eager"][1].snapshot()
    diff = [k for k in ga if not np.array_equal(ga[k], gb[k])]
    assert not diff, f"pdl eager vs plain graph state differs in {diff}"
