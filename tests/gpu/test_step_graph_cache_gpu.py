"""DeviceStep's per-state graphs on a GPU (gpu/step_device.py, thirtieth session): twelve
states of the tiny model stepped in turn on the device path capture once each and then only
replay (the cache was FIFO-bounded at 8 before, so the ninth state on recaptured every step),
each state's steps give the bits of the same state stepped alone, and a dropped state takes
its graphs with it."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

N_STATES = 12


def test_twelve_states_in_turn_capture_once_each_and_match_alone():
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    ids = _ids(ck.config, 8, seed=21)
    prompts = [ids[:3 + (i % 3)] for i in range(N_STATES)]   # three prompt lengths
    states = [m.prefill(p, m.new_state())[1] for p in prompts]
    toks = [int(p[-1]) for p in prompts]
    m.decode_step(states[0], toks[0])                   # the DeviceStep exists from here on
    step = m._step
    captures = []
    real = step._capture
    step._capture = lambda *a, **k: (captures.append(1), real(*a, **k))[1]
    try:
        logits_turn = [[] for _ in states]
        for r in range(3):
            for i, st in enumerate(states):
                lg = m.decode_step(st, toks[i])
                logits_turn[i].append(lg.copy())
                toks[i] = int(np.argmax(lg))
        assert len(captures) == N_STATES - 1, f"{len(captures)} captures for {N_STATES} states"
        assert sum(st in step._graphs for st in states) == N_STATES
    finally:
        del step._capture
    # the same prompts stepped alone (one state at a time, fresh states): the same bits
    for i in (0, 8, N_STATES - 1):
        st = m.prefill(prompts[i], m.new_state())[1]
        t = int(prompts[i][-1])
        if i == 0:
            m.decode_step(st, t)   # as states[0] before the turns (its token not advanced)
        for r in range(3):
            lg = m.decode_step(st, t)
            assert np.array_equal(lg.view(np.uint32), logits_turn[i][r].view(np.uint32)), (i, r)
            t = int(np.argmax(lg))
        del st
    ref = weakref.ref(states[5])
    del states[5]
    gc.collect()
    assert ref() is None, "the step's cache kept a dropped state alive"
    assert sum(st in step._graphs for st in states) == N_STATES - 1
