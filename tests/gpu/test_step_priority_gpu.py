"""Graph-branch priority (seam MEMRA_DSV4_DECODE_PRIORITY, step_device / graphs.capture
node_priority): with ``side`` (and ``attn``: all but the shared expert's) the side branches are captured on greatest-priority streams and
the stage graphs are instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.  Only the
CTA dispatch order changes, so the step must give the same bits: tiny (1 stage, CSA + HCA
layers, 14 steps after a 5-token prefill) and small over 2 stages when 2 GPUs are present, the
arms interleaved step by step, logits and every cache byte equal, with fork "all" and hc split
on (every side branch present)."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def _run(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu import graphs
    from memra_dsv4.gpu.step import device_step
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    least, greatest = graphs.stream_priority_range()
    assert greatest < least, f"the device offers one stream priority only ({least}, {greatest})"
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=13)
    arms = ("off", "side", "attn", "lead+attn")   # decode_priority [+ decode_fork lead]
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    old = (m.decode_priority, m.decode_fork, m.hc_split)
    try:
        m.decode_fork, m.hc_split = "all", "on"
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a in arms:
                m.decode_fork, m.decode_priority = ("lead", "attn") if a == "lead+attn" else ("all", a)
                got[a] = device_step(m, states[a], int(t), graph=True)
            for a in arms[1:]:
                assert np.array_equal(got[a].view(np.uint32), got["off"].view(np.uint32)), \
                    f"{name}: step {i} (pos {prompt + i}): logits with prio={a} differ"
        ref = states["off"].snapshot()
        for a in arms[1:]:
            sa = states[a].snapshot()
            diff = snapshot_diff(ref, sa)
            assert not diff, f"{name}: caches with prio={a} differ: {diff}"
        step = m._step
        gs = step._graphs[id(states["side"])]
        assert gs[6] == "side" and all(isinstance(g, graphs.PriorityGraph) for g in gs[1])
    finally:
        m.decode_priority, m.decode_fork, m.hc_split = old


def test_priority_graph_bit_identical_tiny():
    _run("tiny", (0,))


@pytest.mark.multi_gpu
def test_priority_graph_bit_identical_small_two_stages():
    _run("small", (0, 1), steps=8, prompt=30)
