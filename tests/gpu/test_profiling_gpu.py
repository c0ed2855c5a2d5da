"""GPU checks of the event timing behind phase() and the bench timers, against cupyx's benchmark.

The reference workload is a one-thread kernel that spins on %globaltimer for a fixed number of
nanoseconds, so its duration does not depend on SM clocks. Agreement is required within 15 % or
5 µs, whichever is larger: both sides time with CUDA events, so a larger gap means the brackets
record around the wrong work (or read the wrong pair).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
if not cupy.is_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from cupyx.profiler import benchmark  # noqa: E402

from bench.harness import CudaEventTimer, measure_copy_bandwidth  # noqa: E402
from memra_dsv4.profiling import (  # noqa: E402
    EventPool,
    phase,
    phase_collect,
    phase_set_capturing,
    prof_configure,
)

pytestmark = pytest.mark.gpu

SPIN_SRC = r"""
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


def spinner(ns: int):
    kernel = cupy.RawKernel(SPIN_SRC, "spin_ns")  # compiled per device on first launch
    arg = (np.uint64(ns),)
    return lambda: kernel((1,), (1,), arg)


def reference_us(fn, n: int = 20) -> float:
    """Median GPU µs of fn() by cupyx.profiler.benchmark on the current stream."""
    return float(np.median(benchmark(fn, n_repeat=n, n_warmup=3).gpu_times[0])) * 1e6


def close(measured_us: float, ref_us: float) -> bool:
    return abs(measured_us - ref_us) <= max(0.15 * ref_us, 5.0)


@pytest.fixture(autouse=True)
def _profiling_off_afterwards():
    yield
    phase_set_capturing(False)
    prof_configure("off")


@pytest.fixture
def stream():
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        yield s


def test_phase_event_time_matches_benchmark(stream):
    spin = spinner(200_000)
    ref = reference_us(spin)
    assert ref >= 190.0  # the kernel itself: at least 200 µs of globaltimer

    prof_configure("events")
    for _ in range(3):
        spin()
    for _ in range(20):
        with phase("spin"):
            spin()
    times = phase_collect()["spin"]
    assert len(times) == 20
    assert close(float(np.median(times)), ref), (np.median(times), ref)


def test_nested_phases_add_up(stream):
    a, b = spinner(100_000), spinner(50_000)
    ref_a, ref_b = reference_us(a), reference_us(b)
    prof_configure("events")
    for _ in range(10):
        with phase("outer"):
            with phase("outer/a"):
                a()
            with phase("outer/b"):
                b()
    t = {name: float(np.median(v)) for name, v in phase_collect().items()}
    assert close(t["outer/a"], ref_a) and close(t["outer/b"], ref_b), (t, ref_a, ref_b)
    assert close(t["outer"], t["outer/a"] + t["outer/b"]), t


def test_event_pool_is_reused_across_collections(stream):
    spin = spinner(10_000)
    pool = EventPool()
    prof_configure("events", clock=pool)
    for _ in range(3):
        for _ in range(5):
            with phase("step"):
                with phase("step/k"):
                    spin()
        phase_collect()
        assert pool.capacity() == 20  # 10 brackets x (start, end), never more
    assert len(phase_collect()["step"]) == 15


def test_capture_records_no_events_and_replay_is_timed_whole(stream):
    spin = spinner(100_000)
    ref = reference_us(spin)
    pool = EventPool()
    prof_configure("events", clock=pool)
    spin()  # compile and load before capture

    stream.begin_capture()
    phase_set_capturing(stream.is_capturing())
    with phase("captured/spin"):
        spin()
    graph = stream.end_capture()
    phase_set_capturing(stream.is_capturing())
    assert pool.capacity() == 0  # nothing stamped during capture

    for _ in range(10):
        with phase("replay"):
            graph.launch(stream)
    times = phase_collect()
    assert "captured/spin" not in times
    assert close(float(np.median(times["replay"])), ref), (times["replay"], ref)


@pytest.mark.multi_gpu
def test_phases_on_a_second_device():
    prof_configure("events")
    with cupy.cuda.Device(1):
        spin = spinner(100_000)
        ref = reference_us(spin)
        for _ in range(10):
            with phase("dev1"):
                spin()
    with cupy.cuda.Device(0):
        spin0 = spinner(50_000)
        for _ in range(10):
            with phase("dev0"):
                spin0()
    times = phase_collect()  # one synchronize per device, pairs read on their own device
    assert close(float(np.median(times["dev1"])), ref), (times["dev1"], ref)
    assert len(times["dev0"]) == 10


# ---------------------------------------------------------------- bench harness timers


def test_cuda_event_timer_matches_benchmark(stream):
    spin = spinner(150_000)
    ref = reference_us(spin)
    timer = CudaEventTimer()
    ms = [timer(spin) for _ in range(20)]
    assert close(float(np.median(ms)) * 1e3, ref), (ms, ref)


def test_copy_bandwidth_counts_read_plus_write():
    nbytes = 256 << 20
    bw = measure_copy_bandwidth(0, nbytes=nbytes, iters=10)
    assert bw["copy_bw_Bps"] == pytest.approx(2 * bw["copied_Bps"])
    assert bw["copied_Bps"] == pytest.approx(nbytes / (bw["median_ms"] / 1e3))

    rt = cupy.cuda.runtime
    src, dst = cupy.empty(nbytes, np.uint8), cupy.empty(nbytes, np.uint8)
    ref_us = reference_us(
        lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice,
                               cupy.cuda.get_current_stream().ptr))
    assert close(bw["median_ms"] * 1e3, ref_us), (bw, ref_us)
    # HBM traffic of a device copy on any current datacenter GPU: 0.5 to 10 TB/s.
    assert 0.5e12 < bw["copy_bw_Bps"] < 10e12, bw
