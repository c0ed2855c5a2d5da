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

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def _run_arms(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=11)
    arms = ("off", "on", "single", "all", "lead", "eager")
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    old = getattr(m, "decode_fork", "off")
    try:
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a in arms:
                m.decode_fork = "off" if a == "eager" else a
                got[a] = device_step(m, states[a], int(t), graph=a != "eager")
            for a in ("on", "single", "all", "lead", "eager"):
                assert np.array_equal(got[a].view(np.uint32), got["off"].view(np.uint32)), \
                    f"{name}: step {i} (pos {prompt + i}): logits of {a} differ from the one-stream graph"
        ref = states["off"].snapshot()
        for a in ("on", "single", "all", "lead", "eager"):
            sa = states[a].snapshot()
            diff = snapshot_diff(ref, sa)
            assert not diff, f"{name}: caches of {a} differ from the one-stream graph: {diff}"
    finally:
        m.decode_fork = old


def test_fork_graph_bit_identical_tiny():
    _run_arms("tiny", (0,))


@pytest.mark.multi_gpu
def test_fork_graph_bit_identical_small_two_stages():
    _run_arms("small", (0, 1), steps=8, prompt=30)
