"""MEMRA_DSV4_GRAPH_EDGES (step_device.graph_edges_form, graphs.programmatic_edges): the stage
graphs' fork / join edges rewritten as programmatic edges before instantiation.  Only when the
destination kernels may start changes (each still waits in griddepcontrol.wait for every
prerequisite grid), so the step must give the same bits as the graph with plain edges and as the
eager step: tiny (1 stage, CSA + HCA layers) and small over 2 stages when 2 GPUs are present,
fork "all" and hc split on (every side branch present), the arms interleaved step by step
(each captures its own graphs: the switch is read at capture), logits and every cache byte
equal.  It also checks that the rewrite happened: each stage graph of ``join`` / ``all`` reports
converted edges, ``all`` at least as many as ``join``."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def _run(name, devices, monkeypatch, steps=14, prompt=5, prio="off"):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    assert m.pdl == "on", "programmatic edges need the step's PDL context"
    ids = _ids(ck.config, prompt + steps + 1, seed=29)
    arms = ("off", "join", "all", "eager")
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    old = (m.decode_fork, m.hc_split, m.decode_priority)
    try:
        m.decode_fork, m.hc_split, m.decode_priority = "all", "on", prio
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a in arms:
                monkeypatch.setenv("MEMRA_DSV4_GRAPH_EDGES", "off" if a == "eager" else a)
                got[a] = device_step(m, states[a], int(t), graph=a != "eager")
            for a in arms[1:]:
                assert np.array_equal(got[a].view(np.uint32), got["off"].view(np.uint32)), \
                    f"{name}: step {i} (pos {prompt + i}): logits with edges={a} differ"
        ref = states["off"].snapshot()
        for a in arms[1:]:
            diff = snapshot_diff(ref, states[a].snapshot())
            assert not diff, f"{name}: caches with edges={a} differ: {diff}"
        step = m._step
        added = {a: [g.programmatic_edges_added for g in step._graphs[id(states[a])][1]]
                 for a in ("join", "all")}
        print(f"{name}: programmatic edges added per stage: {added}")
        assert all(n > 0 for n in added["join"]), added
        assert all(x >= y for x, y in zip(added["all"], added["join"])), added
    finally:
        m.decode_fork, m.hc_split, m.decode_priority = old


def test_graph_edges_bit_identical_tiny(monkeypatch):
    _run("tiny", (0,), monkeypatch)


def test_graph_edges_bit_identical_tiny_priority(monkeypatch):
    _run("tiny", (0,), monkeypatch, steps=6, prio="side")


@pytest.mark.multi_gpu
def test_graph_edges_bit_identical_small_two_stages(monkeypatch):
    _run("small", (0, 1), monkeypatch, steps=8, prompt=30)
