"""MEMRA_DSV4_SMEM_CARVEOUT (pdl.smem_carveout): every PDL launch of the step carries a preferred
shared-memory carveout.  Only the SMs' L1 / shared split (and so which CTAs may share an SM)
changes, so the step must give the same bits: tiny (1 stage, CSA + HCA layers) with fork "all"
and hc split on, graph replay with the carveout at max and at 50 against the default, and the
eager step at max, the arms interleaved step by step (each captures its own graphs: the
variable is read at each launch, so at capture), logits and every cache byte equal."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


def test_carveout_bit_identical_tiny(monkeypatch):
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    ck, m = _model("tiny", (0,), "device")
    assert m.pdl == "on", "the carveout rides on the PDL launches"
    prompt, steps = 5, 12
    ids = _ids(ck.config, prompt + steps + 1, seed=31)
    arms = ("default", "max", "50", "max_eager")
    states = {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}
    old = (m.decode_fork, m.hc_split)
    try:
        m.decode_fork, m.hc_split = "all", "on"
        for i, t in enumerate(ids[prompt:prompt + steps]):
            got = {}
            for a in arms:
                monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", a.split("_")[0])
                got[a] = device_step(m, states[a], int(t), graph=not a.endswith("_eager"))
            for a in arms[1:]:
                assert np.array_equal(got[a].view(np.uint32), got["default"].view(np.uint32)), \
                    f"step {i} (pos {prompt + i}): logits with carveout {a} differ"
        ref = states["default"].snapshot()
        for a in arms[1:]:
            diff = snapshot_diff(ref, states[a].snapshot())
            assert not diff, f"caches with carveout {a} differ: {diff}"
    finally:
        m.decode_fork, m.hc_split = old
