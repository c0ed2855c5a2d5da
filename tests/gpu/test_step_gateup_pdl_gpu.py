"""MEMRA_DSV4_GATEUP_PDL=off (step_device.gateup_pdl_off): the routed gate/up launched without
PDL inside the step's PDL context.  Only when its CTAs become resident changes, so the step must
give the same bits: tiny (1 stage) with fork "all" and hc split on (the shared expert's and the
Sinkhorn's branches present), graph replay and eager, 12 steps after a 5-token prefill, the arms
interleaved step by step (each captures its own graphs: the switch is read at capture), logits
and every cache byte equal to the PDL gate/up's."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def test_gateup_without_pdl_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    ck, m = _model("tiny", (0,), "device")
    assert m.pdl == "on", "the switch only matters inside the step's PDL context"
    prompt, steps = 5, 12
    ids = _ids(ck.config, prompt + steps + 1, seed=17)
    arms = ("on", "off_graph", "off_eager")
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    old = (m.decode_fork, m.hc_split)
    try:
        m.decode_fork, m.hc_split = "all", "on"
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a in arms:
                monkeypatch.setenv("MEMRA_DSV4_GATEUP_PDL", "on" if a == "on" else "off")
                got[a] = device_step(m, states[a], int(t), graph=a != "off_eager")
            for a in arms[1:]:
                assert np.array_equal(got[a].view(np.uint32), got["on"].view(np.uint32)), \
                    f"step {i} (pos {prompt + i}): logits with the gate/up without PDL ({a}) differ"
        ref = states["on"].snapshot()
        for a in arms[1:]:
            diff = snapshot_diff(ref, states[a].snapshot())
            assert not diff, f"caches with the gate/up without PDL ({a}) differ: {diff}"
    finally:
        m.decode_fork, m.hc_split = old
