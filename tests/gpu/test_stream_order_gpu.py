"""Setup work on the caller's current stream is ordered before the compute streams' kernels
(runtime.Devices.order_after_current).

CuPy enqueues array creation, ``fill`` and host uploads on the current stream: the legacy
default stream unless the caller set another.  The model's compute streams are non-blocking, so
without an explicit edge a kernel on them may run before a cache zeroing or a table upload that
the host enqueued first.  Under another process's load that is rare and silent (wrong logits at
a state's first step).  These tests make it certain instead: a kernel that spins for a while on
the current stream holds back everything enqueued there after it, then

* prefill (its ``state.reset()`` fills) followed by device steps must give the bits of the same
  calls made on an idle current stream;
* a state's first device step (its GemvTables uploaded by cp.asarray) likewise, eager and graph;
* a caller's own non-blocking stream made current works the same way as the legacy stream.

Without the edges the prefill case reads caches that the delayed fills then zero, and the step
case reads a table before its bytes arrive."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

_SPIN_SRC = r'''
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
'''
_SPIN_NS = 1_500_000_000   # longer than a tiny prefill + a few eager steps, host side included


def _spin(stream):
    """Hold ``stream`` busy for _SPIN_NS; returns an event recorded after the spin."""
    k = cp.RawKernel(_SPIN_SRC, "spin_ns")
    k((1,), (1,), (np.uint64(_SPIN_NS),), stream=stream)
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev


def _tiny():
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    ck, m = _model("tiny", (0,), "device")
    return ck, m, _ids(ck.config, 5 + 4, seed=23)


def _run(m, ids, state=None, graph=False):
    """prefill 5 tokens, then 4 device steps: (every step's logits, the final snapshot)."""
    from memra_dsv4.gpu.step import device_step
    _, state = m.prefill(ids[:5], state)
    logits = [device_step(m, state, t, graph=graph) for t in ids[5:]]
    cp.cuda.Device(0).synchronize()
    return logits, state.snapshot()


def _same(tag, got, want):
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{tag}: step {i} logits differ"
    diff = [k for k in want[1] if not np.array_equal(np.asarray(want[1][k]), np.asarray(got[1][k]))]
    assert not diff, f"{tag}: caches differ: {diff}"


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_prefill_reset_behind_a_busy_current_stream(graph):
    ck, m, ids = _tiny()
    want = _run(m, ids, m.new_state(), graph)
    state = m.new_state()
    _run(m, ids, state, graph)               # the state has been used: reset has work to do
    cp.cuda.Device(0).synchronize()
    done = _spin(cp.cuda.Stream.null)        # reset's fills queue behind the spin
    got = _run(m, ids, state, graph)
    assert done.done, "the spin must have ended by the synchronize"
    _same(f"prefill behind a busy legacy stream ({'graph' if graph else 'eager'})", got, want)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_first_step_tables_behind_a_busy_current_stream(graph):
    from memra_dsv4.gpu.step import device_step
    ck, m, ids = _tiny()
    want = _run(m, ids, m.new_state(), graph)
    state = m.new_state()
    _, state = m.prefill(ids[:5], state)
    cp.cuda.Device(0).synchronize()
    done = _spin(cp.cuda.Stream.null)        # this state's GemvTables upload behind the spin
    logits = [device_step(m, state, t, graph=graph) for t in ids[5:]]
    cp.cuda.Device(0).synchronize()
    assert done.done
    _same(f"first steps behind a busy legacy stream ({'graph' if graph else 'eager'})",
          (logits, state.snapshot()), want)


def test_callers_own_current_stream_is_ordered_too():
    ck, m, ids = _tiny()
    want = _run(m, ids, m.new_state())
    mine = cp.cuda.Stream(non_blocking=True)
    with mine:
        done = _spin(mine)                    # new_state's zeroing, reset and tables on `mine`
        got = _run(m, ids, m.new_state())
    assert done.done
    _same("a caller's non-blocking stream current", got, want)
