"""tools/host_wake.py (no GPU): its refusals, the CPU summary, and that every workload is timed
after every wait and back to back."""

from __future__ import annotations

import pytest

from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)


def _tool():
    return load_tool("host_wake")


def test_refusals():
    hw = _tool()
    for argv, msg in ((["--wait-ms", "0"], "--wait-ms 0.0"), (["--samples", "0"], "--samples 0")):
        with pytest.raises(SystemExit, match=msg):
            hw.main(argv)


def test_summary_and_measure_grid():
    hw = _tool()
    info = hw.cpu_summary()
    assert set(info) == {"cpu", "avx512_flags", "numpy_features", "NPY_DISABLE_CPU_FEATURES"}
    work = hw.workloads(vocab=1000)
    assert set(work) == {"py", "np_small", "np_vec", "ids"}
    assert work["ids"]().tolist() == [7]
    calls = []
    waits = {"after_a": lambda: calls.append("a"), "after_b": lambda: calls.append("b")}
    out = hw.measure({"w": lambda: calls.append("w")}, waits, samples=3)
    assert set(out) == {"w.after_a", "w.after_b", "w.warm"} and all(v >= 0 for v in out.values())
    # one untimed warm call, then each wait followed by the timed workload, then 3 back to back
    assert calls == ["w"] + ["a", "w"] * 3 + ["b", "w"] * 3 + ["w"] * 3
