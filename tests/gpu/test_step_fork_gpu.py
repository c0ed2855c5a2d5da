"""The graph branches of the device step (seam MEMRA_DSV4_DECODE_FORK, step_device._attention /
_moe): with ``on`` each attention sub-layer's kv norm / compressor launches are captured on a
side stream and (CSA layers) the indexer + candidate list on a second one, beside wq_b;
``single`` (the former ``on``) puts kv, indexer and compressor on one side stream and the
candidates after the join; ``all`` = ``on`` and also puts each MoE's shared expert on the side
stream beside the router and the routed gate/up; ``lead`` = ``all`` with the CSA indexer's q GEMV
on the main stream before wq_b and the rest of the indexer forked after it.  The branches share no buffer, so the step must give the same bits as
the one-stream graph.  Checked on tiny (1 stage; CSA and HCA layers, 14 steps after a 5-token
prefill: CSA emits and the window wrap) and on small over 2 stages when 2 GPUs are present: the
two arms interleaved step by step, logits and every cache byte equal; and the eager step (which
never forks) equals the forked graph."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import arm_attrs_now, assert_arms_agree, attr_arm_runner, step_forms  # noqa: E402

# arm -> ({decode_fork}, graph); "off" (the one-stream graph) is the reference
_ARMS = {a: ({"decode_fork": a}, True) for a in ("off", "on", "single", "all", "lead")}
_ARMS["eager"] = ({"decode_fork": "off"}, False)


def _run_arms(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=11)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    with step_forms(m, **arm_attrs_now(m, _ARMS)):
        assert_arms_agree(f"{name} fork", states, ids[prompt:prompt + steps], attr_arm_runner(m, states, _ARMS),
                          pos0=prompt)


def test_fork_graph_bit_identical_tiny():
    _run_arms("tiny", (0,))


@pytest.mark.multi_gpu
def test_fork_graph_bit_identical_small_two_stages():
    _run_arms("small", (0, 1), steps=8, prompt=30)
