"""The split sub-layer boundary of the device step (seam MEMRA_DSV4_HC_SPLIT, step_device._hc_pre):
with ``on`` each boundary is hc_boundary_pre (the sub-layer's input) + hc_boundary_sinkhorn (post /
comb for the next boundary), the Sinkhorn captured on its own side stream beside the sub-layer
and joined before the next boundary (or the stage's last hc_post).  The two kernels write
hc_boundary's bytes and the branches share no buffer, so the step must give the same bits as
the one-launch boundary.  Checked as test_step_fork_gpu does: tiny (1 stage; CSA and HCA layers,
14 steps after a 5-token prefill) and small over 2 stages when 2 GPUs are present; the arms
interleaved step by step, logits and every cache byte equal: split off (graph), split on (graph,
attention fork on and fork all: three side branches at once), split on eager (one stream), split
off eager."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402

# arm -> (hc_split, decode_fork, graph)
_ARMS = {"off": ("off", "on", True), "on": ("on", "on", True), "on+all": ("on", "all", True),
         "on+eager": ("on", "off", False), "off+eager": ("off", "off", False)}


def _run_arms(name, devices, steps=14, prompt=5):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    if cp.cuda.runtime.getDeviceCount() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    ck, m = _model(name, devices, "device")
    ids = _ids(ck.config, prompt + steps + 1, seed=13)
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in _ARMS}
    old = (getattr(m, "hc_split", "off"), getattr(m, "decode_fork", "on"))
    try:
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a, (split, fork, graph) in _ARMS.items():
                m.hc_split, m.decode_fork = split, fork
                got[a] = device_step(m, states[a], int(t), graph=graph)
            for a in _ARMS:
                assert np.array_equal(got[a].view(np.uint32), got["off"].view(np.uint32)), \
                    f"{name}: step {i} (pos {prompt + i}): logits of {a} differ from the one-launch boundary"
        ref = states["off"].snapshot()
        for a in _ARMS:
            sa = states[a].snapshot()
            diff = snapshot_diff(ref, sa)
            assert not diff, f"{name}: caches of {a} differ from the one-launch boundary: {diff}"
        # switching the seam recaptured: the last graph of the "on" state was captured split
        assert m._step._graphs[id(states["on"])][5] is True
        assert m._step._graphs[id(states["off"])][5] is False
    finally:
        m.hc_split, m.decode_fork = old


def test_hc_split_step_bit_identical_tiny():
    _run_arms("tiny", (0,))


@pytest.mark.multi_gpu
def test_hc_split_step_bit_identical_small_two_stages():
    _run_arms("small", (0, 1), steps=8, prompt=30)
