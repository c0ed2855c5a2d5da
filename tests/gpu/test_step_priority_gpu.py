"""Graph-branch priority (seam MEMRA_DSV4_DECODE_PRIORITY, step_device / graphs.capture
node_priority): with ``side`` (and ``attn``: all but the shared expert's) the side branches are captured on greatest-priority streams and
the stage graphs are instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.  Only the
CTA dispatch order changes, so the step must give the same bits: tiny (1 stage, CSA + HCA
layers, 14 steps after a 5-token prefill) and small over 2 stages when 2 GPUs are present, the
arms interleaved step by step, logits and every cache byte equal, with fork "all" and hc split
on (every side branch present)."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import arm_attrs_now, assert_arms_agree, attr_arm_runner, step_forms  # noqa: E402

# arm -> ({decode_priority [, decode_fork lead]}, graph); every arm with fork "all" and hc split on
_ARMS = {a: ({"decode_fork": "all", "decode_priority": a}, True) for a in ("off", "side", "attn")}
_ARMS["lead+attn"] = ({"decode_fork": "lead", "decode_priority": "attn"}, True)


def _run(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu import graphs
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    least, greatest = graphs.stream_priority_range()
    assert greatest < least, f"the device offers one stream priority only ({least}, {greatest})"
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=13)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    with step_forms(m, hc_split="on", **arm_attrs_now(m, _ARMS)):
        assert_arms_agree(f"{name} priority", states, ids[prompt:prompt + steps],
                          attr_arm_runner(m, states, _ARMS), pos0=prompt)
    gs = m._step._graphs[states["side"]]
    assert gs.prio == "side" and all(isinstance(g, graphs.PriorityGraph) for g in gs.graphs)


def test_priority_graph_bit_identical_tiny():
    _run("tiny", (0,))


@pytest.mark.multi_gpu
def test_priority_graph_bit_identical_small_two_stages():
    _run("small", (0, 1), steps=8, prompt=30)
