"""The device-timeline build (profiling.device_trace) on the GPU.

* A trace-build loader's kernels give the same bytes as the production build's (the records
  live beside the kernel's data, never in it).
* Two launches of rmsnorm_bf16_wbf16 on one stream: one record per CTA, folded into two
  launches named by their source line, each with start <= wait return <= exit, the second
  starting after the first ended (same stream, plain launches), and a reset empties the
  records.
* The same under a PDL launch (gpu.pdl), the form the device step uses.
* The delay probe's knob (set_delay) holds exactly the kernel it names, once per launch.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu import kernel_loader as KL  # noqa: E402
from memra_dsv4.gpu.ops import rmsnorm as _rmsnorm  # noqa: E402,F401  (registers the kernels)
from memra_dsv4.gpu.ops.testing import bits_of, rand_bf16, rng_for  # noqa: E402
from memra_dsv4.profiling import device_trace as DT  # noqa: E402

ROWS, N = 96, 4096


def _args(rng):
    x = cp.asarray(bits_of(rand_bf16(rng, (ROWS, N))))
    w = cp.asarray(bits_of(rand_bf16(rng, (N,))))
    return x, w


def _launch(k, x, w, y):
    k((ROWS,), (128,), (x, w, y, np.int32(N), np.float64(1e-6)))


@pytest.mark.parametrize("pdl", [False, True])
def test_trace_build_records_every_cta(pdl):
    from memra_dsv4.gpu.pdl import pdl_launches
    rng = rng_for(20261130)
    x, w = _args(rng)
    plain = KL.KernelLoader(0, trace=False).get_plain("rmsnorm", "rmsnorm_bf16_wbf16")
    loader = KL.KernelLoader(0, trace=True)
    y0, y1, y2 = (cp.zeros_like(x) for _ in range(3))
    _launch(plain, x, w, y0)
    loader.get_plain("rmsnorm", "rmsnorm_bf16_wbf16")      # builds the module
    DT.reset(loaders=[loader])
    assert DT.collect(loaders=[loader]) == []
    with pdl_launches(pdl):
        k = loader.get("rmsnorm", "rmsnorm_bf16_wbf16")
        _launch(k, x, w, y1)
        _launch(k, x, w, y2)
    recs = DT.collect(loaders=[loader])
    assert cp.array_equal(y0, y1) and cp.array_equal(y0, y2), "the trace build changed the output"
    assert len(recs) == 2 * ROWS
    ls = DT.launches(recs)
    assert len(ls) == 2, [L.kernel for L in ls]
    for L in ls:
        assert L.kernel == "rmsnorm.rmsnorm_bf16_wbf16" and L.ctas == ROWS
        assert L.start <= L.go <= L.go_last <= L.end
        assert L.end - L.start < 10_000_000, "a launch of 96 small CTAs took > 10 ms?"
    assert sorted(r.cta for r in recs if r.grid == ls[0].grid) == list(range(ROWS))
    assert ls[1].go >= ls[0].end, "the second launch's CTAs passed the wait before the first ended"
    DT.reset(loaders=[loader])
    assert DT.collect(loaders=[loader]) == []


def test_set_delay_holds_the_named_kernel_only():
    """The delay probe's knob (device_trace.set_delay): the named kernel's CTAs each wait the
    delay after their wait return (busy >= delay), its output unchanged; with the delay on a
    line that names no kernel, and after set_delay(None), it runs undelayed."""
    rng = rng_for(20261202)
    x, w = _args(rng)
    loader = KL.KernelLoader(0, trace=True)
    k = loader.get_plain("rmsnorm", "rmsnorm_bf16_wbf16")
    y0, y1, y2 = (cp.zeros_like(x) for _ in range(3))
    DT.reset(loaders=[loader])
    _launch(k, x, w, y0)
    (site,) = DT.kernel_sites(DT.collect(loaders=[loader]))
    assert site["kernel"] == "rmsnorm.rmsnorm_bf16_wbf16" and site["launches"] == 1
    delay_ns = 200_000
    DT.set_delay((site["stem"], site["line"]), delay_ns, loaders=[loader])
    DT.reset(loaders=[loader])
    _launch(k, x, w, y1)
    (slow,) = DT.launches(DT.collect(loaders=[loader]))
    DT.set_delay(("rmsnorm", site["line"] + 1), delay_ns, loaders=[loader])   # no kernel's line
    DT.reset(loaders=[loader])
    _launch(k, x, w, y2)
    (other,) = DT.launches(DT.collect(loaders=[loader]))
    DT.set_delay(None, 0, loaders=[loader])
    DT.reset(loaders=[loader])
    _launch(k, x, w, y2)
    (fast,) = DT.launches(DT.collect(loaders=[loader]))
    assert cp.array_equal(y0, y1) and cp.array_equal(y0, y2), "the delay changed the output"
    assert slow.busy >= delay_ns, f"delayed launch busy {slow.busy} ns < {delay_ns}"
    assert other.busy < delay_ns // 2 and fast.busy < delay_ns // 2, (other.busy, fast.busy)


def test_set_delay_holds_a_many_wave_launch_once():
    """A launch of more CTAs than fit at once is held the delay once (its first CTA's wait
    return + delay is the deadline of every CTA), not once per wave; a second launch of the
    same kernel gets its own deadline."""
    rows = 16384                      # 16384 CTAs of 128 threads: several waves on an H200
    rng = rng_for(20261203)
    x = cp.asarray(bits_of(rand_bf16(rng, (rows, N))))
    w = cp.asarray(bits_of(rand_bf16(rng, (N,))))
    loader = KL.KernelLoader(0, trace=True)
    k = loader.get_plain("rmsnorm", "rmsnorm_bf16_wbf16")
    y = cp.zeros_like(x)

    def launch():
        k((rows,), (128,), (x, w, y, np.int32(N), np.float64(1e-6)))

    DT.reset(loaders=[loader])
    launch()
    (site,) = DT.kernel_sites(DT.collect(loaders=[loader]))
    DT.reset(loaders=[loader])
    launch()
    (plain,) = DT.launches(DT.collect(loaders=[loader]))
    delay_ns = 200_000
    DT.set_delay((site["stem"], site["line"]), delay_ns, loaders=[loader])
    DT.reset(loaders=[loader])
    launch()
    launch()
    held = DT.launches(DT.collect(loaders=[loader]))
    DT.set_delay(None, 0, loaders=[loader])
    assert len(held) == 2
    late = [r for r in held if r.go_last - r.go > delay_ns]
    assert late, "every CTA passed its wait within the delay: not several waves"
    for L in held:
        assert L.busy >= delay_ns, f"a held launch took {L.busy} ns < {delay_ns}"
        assert L.busy < plain.busy + delay_ns + delay_ns // 2, (
            f"held {L.busy} ns against {plain.busy} undelayed: more than one delay per launch")
