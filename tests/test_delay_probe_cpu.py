"""profiling.delay_probe without a GPU: the schedule (every target between two baselines, the
order rotated per round), the analysis (delta against the neighbour mean, slope per launch,
cancelled linear drift), run() against a modelled step (a critical kernel, a hidden one, one
with slack), the delay cleared on error, and device_trace's kernel_sites / set_delay checks."""
from __future__ import annotations

import pytest

from memra_dsv4.profiling import delay_probe as DP
from memra_dsv4.profiling import device_trace as DT


def test_schedule_puts_every_target_between_baselines_and_rotates():
    order = DP.schedule(3, 2)
    assert order == [None, 0, None, 1, None, 2, None, None, 1, None, 2, None, 0, None]
    for i, t in enumerate(order):
        if t is not None:
            assert order[i - 1] is None and order[i + 1] is None
    with pytest.raises(ValueError, match="n_targets"):
        DP.schedule(0, 1)
    with pytest.raises(ValueError, match="rounds"):
        DP.schedule(2, 0)


def _sites(*launches):
    return [{"stem": "m", "line": 10 + i, "kernel": f"m.k{i}", "launches": n}
            for i, n in enumerate(launches)]


def test_analyze_cancels_linear_drift_and_scales_by_launches():
    sites = _sites(20, 40)
    order = DP.schedule(2, 3)
    delay_ns = 2000
    blocks = []
    for i, t in enumerate(order):
        drift = 0.01 * i                                   # ms: a steady climb
        add = {None: 0.0, 0: 20 * 2e-3, 1: 0.0}[t]         # k0 critical, k1 hidden
        blocks.append((t, [3.0 + drift + add] * 4))
    res = DP.analyze(blocks, sites, delay_ns)
    by = {r["kernel"]: r for r in res["rows"]}
    assert by["m.k0"]["delta_us"] == pytest.approx(40.0)
    assert by["m.k0"]["slope"] == pytest.approx(1.0)
    assert by["m.k1"]["delta_us"] == pytest.approx(0.0, abs=1e-9)
    assert res["rows"][0]["kernel"] == "m.k0"                # sorted by delta
    assert len(by["m.k0"]["deltas_us"]) == 3
    assert res["noise_us"] == pytest.approx(20.0)            # consecutive baselines 2 blocks apart


def test_analyze_refuses_a_target_without_baseline_neighbours():
    sites = _sites(1)
    with pytest.raises(ValueError, match="between two baselines"):
        DP.analyze([(None, [1.0]), (0, [1.0]), (0, [1.0]), (None, [1.0])], sites, 1000)
    with pytest.raises(ValueError, match="delay_ns"):
        DP.analyze([(None, [1.0]), (0, [1.0]), (None, [1.0])], sites, 0)


class _ModelStep:
    """A step of 3 ms plus max(0, delay x launches - slack) for the delayed kernel."""

    def __init__(self, sites, slack_ns):
        self.sites, self.slack_ns = sites, slack_ns
        self.target, self.ns, self.last_ms, self.pos, self.calls = None, 0, 0.0, 0, []

    def set_delay(self, target, ns):
        self.target, self.ns = target, ns
        self.calls.append((target, ns))

    def step(self):
        add = 0.0
        for s in self.sites:
            if self.target == (s["stem"], s["line"]):
                add = max(0.0, self.ns * s["launches"] - self.slack_ns[s["kernel"]]) * 1e-6
        self.last_ms = 3.0 + add
        self.pos += 1

    def timer(self, fn):
        fn()
        return self.last_ms


def test_run_measures_critical_hidden_and_slack_kernels():
    sites = _sites(20, 20, 10)
    m = _ModelStep(sites, {"m.k0": 0, "m.k1": 10**9, "m.k2": 10_000})
    rewinds = []
    res = DP.run(m.step, lambda: rewinds.append(m.pos), m.timer, sites, m.set_delay, 2000,
                 rounds=2, steps_per_block=3)
    by = {r["kernel"]: r for r in res["rows"]}
    assert by["m.k0"]["slope"] == pytest.approx(1.0)
    assert by["m.k1"]["slope"] == pytest.approx(0.0)
    assert by["m.k2"]["slope"] == pytest.approx(0.5)          # 20 us added, 10 us of slack
    assert len(rewinds) == len(DP.schedule(3, 2))            # every block rewinds
    assert m.calls[-1] == (None, 0)                          # left undelayed
    assert res["rounds"] == 2 and res["steps_per_block"] == 3
    text = DP.format_rows(res)
    assert "m.k0" in text and "slope" in text


def test_run_clears_the_delay_on_error():
    sites = _sites(5)
    m = _ModelStep(sites, {"m.k0": 0})

    def bad_step():
        if m.target is not None:
            raise RuntimeError("boom")
        m.step()

    with pytest.raises(RuntimeError, match="boom"):
        DP.run(bad_step, lambda: None, m.timer, sites, m.set_delay, 1000)
    assert m.calls[-1] == (None, 0)
    with pytest.raises(ValueError, match="steps_per_block"):
        DP.run(m.step, lambda: None, m.timer, sites, m.set_delay, 1000, steps_per_block=0)


def test_kernel_sites_count_launches_per_site():
    recs = [DT.CtaRecord(0, "rmsnorm", 33, grid=g, cta=c, start=10 * g + c, go=0, end=0)
            for g in (1, 2) for c in range(3)]
    recs += [DT.CtaRecord(0, "hc", 5, grid=7, cta=0, start=0, go=0, end=0)]
    sites = DT.kernel_sites(recs)
    assert [(s["stem"], s["line"], s["launches"]) for s in sites] == [("hc", 5, 1), ("rmsnorm", 33, 2)]
    assert sites[1]["kernel"].startswith("rmsnorm.")


def test_set_delay_validates_before_any_device_work():
    from memra_dsv4.gpu import kernel_loader as KL
    with pytest.raises(ValueError, match="outside"):
        DT.set_delay(("hc", 5), -1, loaders=[KL.KernelLoader(0, trace=True)])
    with pytest.raises(ValueError, match="stem, line"):
        DT.set_delay(("hc", 0), 100, loaders=[KL.KernelLoader(0, trace=True)])
    with pytest.raises(RuntimeError, match="not the trace build"):
        DT.set_delay(None, 0, loaders=[KL.KernelLoader(0, trace=False)])


def test_the_delay_lives_in_the_trace_build_only():
    """common.cuh: memra_trace_delay and the wait are inside #ifdef MEMRA_TRACE (the production
    cubins do not change), and every trace-build entry passes its __LINE__ to enter()."""
    import os
    src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "kernels_cu", "common.cuh")).read()
    a = src.index("#ifdef MEMRA_TRACE")
    b = src.index("#endif", src.index("}  // namespace memra_trace"))
    assert "memra_trace_delay" in src[a:b] and "__nanosleep" in src[a:b]
    assert "memra_trace_deadline" in src[a:b] and "%%gridid" in src[a:b]   # once per launch
    assert "memra_trace_delay" not in src[:a] + src[b:]
    assert "memra_trace::enter();" not in src
    assert src.count("memra_trace::enter(__LINE__)") == 3


def test_bench_refuses_a_probe_without_the_trace_build_or_with_bad_numbers(monkeypatch):
    """bench.decode_step --delay-probe: refused before any GPU work without the trace build, for a
    delay outside (0, 1000] us, and for rounds / steps below 1."""
    from bench import decode_step
    monkeypatch.delenv("MEMRA_DSV4_DEVICE_TRACE", raising=False)
    with pytest.raises(SystemExit, match="trace build"):
        decode_step.main(["--arms", "path=device", "--delay-probe", "4"])
    monkeypatch.setenv("MEMRA_DSV4_DEVICE_TRACE", "on")
    with pytest.raises(SystemExit, match="microseconds"):
        decode_step.main(["--arms", "path=device", "--delay-probe", "-2"])
    with pytest.raises(SystemExit, match="microseconds"):
        decode_step.main(["--arms", "path=device", "--delay-probe", "5000"])
    with pytest.raises(SystemExit, match="probe-rounds"):
        decode_step.main(["--arms", "path=device", "--delay-probe", "4", "--probe-rounds", "0"])
