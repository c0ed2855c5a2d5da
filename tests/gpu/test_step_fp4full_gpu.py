"""The decode step at full Flash layer shapes with the full-shape fast FP4 expert kernels
(ops.experts FULL_PATH: gemv_*_gateup_k4_f or, with the shared SwiGLU in its launch (the default
MEMRA_DSV4_SHARED_GATEUP = on), _k4_f_sh; gemv_*_down_combine_k2_f or _k2_f_w2) and with the
gate/up's shared-memory weight ring (ops.experts GATEUP_RING: gemv_*_gateup_k4_r) against the same
step with the general _k4 / _k2 kernels (ops.experts.full_path(False)): logits and every cache byte
equal.

The tiny / small configs of the other step tests have expert shapes the fast kernels do not take
(K = 256 / 512), so only a Flash-shaped layer exercises them inside the step: flash-layers:1
(one full-size layer, hash routing, k = 6 of 256 experts; no drafter), a 5-token prefill, then
6 decode steps on five states: general eager, full-path eager / graph, ring eager / graph.  The first full-
path eager step must launch the _f kernels and the general one must not.  Host cost: the
checkpoint is ~5 GB of NumPy arrays (synth_arrays, all cores: ~10-20 s per format on a 16-core
host) and as much device memory."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402


@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_step_full_path_bit_identical_flash_layer(experts):
    from step_models import flash_prefilled  # prepend import mode (tests/gpu on sys.path)

    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.step_device import shared_gateup_on
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.profiling.launches import record_launches

    arms = ("general", "full_eager", "full_graph", "ring_eager", "ring_graph")
    m, states, ids, prompt = flash_prefilled(1, arms, seed=7, experts=experts, dense=None)
    cfg = m.config
    assert EX.gateup_full(cfg.moe_intermediate_size, cfg.hidden_size)
    assert EX.down_full(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok)

    def step(a, t):
        saved = EX.GATEUP_RING
        EX.GATEUP_RING = a.startswith("ring")   # gemv_*_gateup_k4_r (weight ring in shared memory)
        try:
            with EX.full_path(a != "general"):
                return device_step(m, states[a], t, graph=a.endswith("_graph"))
        finally:
            EX.GATEUP_RING = saved

    for i, t in enumerate(ids[prompt:]):
        got = {}
        for a in arms:
            if i == 0 and not a.endswith("_graph"):
                out = []
                recs = record_launches(lambda: out.append(step(a, int(t))), ("step_device.py",))
                got[a] = out[0]
                names = {r.kernel.split(".", 1)[1] for r in recs if r.kernel.startswith("experts.")}
                # the down + combine: _k2_f, or _k2_f_w2 with the shared w2 fused (the default);
                # the full-path gate/up: _k4_f_sh with the shared SwiGLU in its launch
                # (MEMRA_DSV4_SHARED_GATEUP, default on; the ring kernel has no _sh form)
                sh = "_sh" if shared_gateup_on() else ""
                gu = f"gemv_{experts}_gateup_k4_" + ("r" if a.startswith("ring") else "f" + sh)
                downs = {f"gemv_{experts}_down_combine_k2_f", f"gemv_{experts}_down_combine_k2_f_w2"}
                fast = {f"gemv_{experts}_gateup_k4_f", f"gemv_{experts}_gateup_k4_f_sh",
                        f"gemv_{experts}_gateup_k4_r"} | downs
                if a == "general":
                    assert not names & fast and f"gemv_{experts}_gateup_k4" in names, sorted(names)
                else:
                    assert gu in names and len(names & downs) == 1 and len(names & fast) == 2, sorted(names)
            else:
                got[a] = step(a, int(t))
        for a in arms[1:]:
            assert np.array_equal(got[a].view(np.uint32), got["general"].view(np.uint32)), \
                f"{experts}: step {i}: logits of {a} differ from the general kernels'"
    ref = states["general"].snapshot()
    for a in arms[1:]:
        sa = states[a].snapshot()
        diff = snapshot_diff(ref, sa)
        assert not diff, f"{experts}: caches of {a} differ from the general kernels': {diff}"
