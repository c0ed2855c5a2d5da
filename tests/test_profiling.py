"""CPU tests of memra_dsv4.profiling: report math, modes, bracket balance, capture flag, reset.

GPU work is stood in for by `FakeClock.advance()`, so the whole events path (brackets ->
records -> one synchronize -> µs -> report) runs here without CuPy.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_dsv4.profiling import (
    FakeClock,
    build_report,
    format_report,
    phase,
    phase_collect,
    phase_report,
    phase_reset,
    phase_set_capturing,
    prof_configure,
    prof_mode,
    prof_on,
)
from memra_dsv4.profiling import phases


class RecordingDomain:
    """An NVTX domain double that logs every call, to check push/pop balance."""

    def __init__(self):
        self.log: list[tuple[str, object]] = []
        self.depth = 0

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return ("attr", message)

    def push_range(self, attributes=None):
        self.log.append(("push", attributes))
        self.depth += 1

    def pop_range(self):
        self.log.append(("pop", None))
        self.depth -= 1


class FailingClock(FakeClock):
    def stamp(self):
        raise RuntimeError("cudaEventRecord failed")


@pytest.fixture(autouse=True)
def _profiling_off_afterwards():
    yield
    phase_set_capturing(False)
    prof_configure("off")


# ---------------------------------------------------------------- report math


TIMINGS = {
    "step": [100.0, 120.0],
    "step/attn": [30.0, 40.0],
    "step/moe": [60.0, 70.0],
    "step/moe/experts": [50.0, 50.0],
    "head": [10.0, 10.0],
}


def test_build_report_totals_means_shares_and_tree_order():
    rows = build_report(TIMINGS, plain_us=50.0)
    assert [r.name for r in rows] == ["step", "step/attn", "step/moe", "step/moe/experts", "head"]
    assert [r.depth for r in rows] == [0, 1, 1, 2, 0]
    assert [r.label for r in rows] == ["step", "attn", "moe", "experts", "head"]
    by = {r.name: r for r in rows}
    top = 220.0 + 20.0  # the roots' totals: step and head
    assert by["step"].calls == 2 and by["step"].total_us == 220.0 and by["step"].mean_us == 110.0
    assert by["step/moe"].share == pytest.approx(130.0 / top)
    assert by["step/moe/experts"].share == pytest.approx(100.0 / top)  # share of the whole step
    assert by["head"].per_step_us == 10.0  # steps inferred as 2 from the roots' call counts
    assert by["step"].plain_steps == pytest.approx(110.0 / 50.0)
    assert sum(r.share for r in rows if r.depth == 0) == pytest.approx(1.0)


def test_build_report_without_plain_and_with_explicit_steps():
    rows = build_report(TIMINGS, step_count=4)
    assert all(r.plain_steps is None for r in rows)
    assert {r.name: r.per_step_us for r in rows}["step"] == 55.0


def test_unrecorded_path_components_are_skipped_in_the_tree():
    rows = build_report({"s": [10.0], "s/b3/attn/q": [4.0], "s/b3/attn/kv": [5.0]})
    assert [(r.label, r.depth) for r in rows] == [("s", 0), ("b3/attn/q", 1), ("b3/attn/kv", 1)]


def test_build_report_rejects_bad_arguments_and_handles_empty():
    assert build_report({}) == []
    assert build_report({"x": []}) == []
    with pytest.raises(ValueError, match="plain_us"):
        build_report(TIMINGS, plain_us=-1.0)
    with pytest.raises(ValueError, match="step_count"):
        build_report(TIMINGS, step_count=0)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(
    st.lists(st.sampled_from("abc"), min_size=1, max_size=3).map("/".join),
    st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=5),
    min_size=1, max_size=10,
))
def test_report_invariants(timings):
    rows = build_report(timings, plain_us=7.0)
    assert sorted(r.name for r in rows) == sorted(timings)
    steps = max(r.calls for r in rows if r.depth == 0)
    for r in rows:
        assert r.total_us == pytest.approx(sum(timings[r.name]))
        assert r.mean_us * r.calls == pytest.approx(r.total_us)
        assert r.per_step_us * steps == pytest.approx(r.total_us)
        assert r.plain_steps == pytest.approx(r.per_step_us / 7.0)
    top = sum(r.total_us for r in rows if r.depth == 0)
    if top > 0:
        assert sum(r.share for r in rows if r.depth == 0) == pytest.approx(1.0)
    # Tree order: every row's parent precedes it.
    seen: set[str] = set()
    for r in rows:
        if r.depth > 0:
            assert any(r.name.startswith(p + "/") for p in seen)
        seen.add(r.name)


def test_format_report_layout():
    text = format_report(build_report(TIMINGS, plain_us=50.0))
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "calls", "total", "us", "mean", "us", "us/step", "share", "plain", "steps"]
    assert lines[2].startswith("step ") and lines[3].startswith("  attn ") and lines[5].startswith("    experts ")
    experts = lines[5].split()
    assert experts[1:] == ["2", "100.0", "50.00", "50.00", "41.7%", "1.000"]
    assert lines[-1].split() == ["top", "level", "240.0", "120.00", "100.0%", "2.400"]
    assert "plain" not in format_report(build_report(TIMINGS))
    assert format_report([]) == "(no phases recorded)\n"


# ---------------------------------------------------------------- modes and configuration


def test_invalid_env_value_names_variable_and_allowed_values(monkeypatch):
    monkeypatch.setenv("MEMRA_DSV4_PROF", "verbose")
    with pytest.raises(ValueError, match=r"MEMRA_DSV4_PROF must be one of off, nvtx, events; got 'verbose'"):
        prof_configure()
    with pytest.raises(ValueError, match="MEMRA_DSV4_PROF"):
        prof_configure("nsys")


def test_env_is_read_once_at_first_use_and_announced(monkeypatch, capsys):
    monkeypatch.setattr(phases, "_on", None)  # as in a fresh process
    monkeypatch.setenv("MEMRA_DSV4_PROF", "nvtx")
    assert phase("first") is not phases._NOOP
    assert capsys.readouterr().err.startswith("memra_dsv4: profiling = nvtx")
    monkeypatch.setenv("MEMRA_DSV4_PROF", "off")  # too late: the mode is already fixed
    assert prof_on() and prof_mode() == "nvtx"
    assert capsys.readouterr().err == ""


def test_off_returns_the_shared_noop_and_records_nothing(capsys):
    prof_configure("off")
    assert capsys.readouterr().err == "memra_dsv4: profiling = off\n"
    assert not prof_on()
    first, second = phase("a"), phase("b/c")
    assert first is second is phases._NOOP
    with first:
        pass
    assert phase_collect() == {}
    assert phase_report(file=None).startswith("(no GPU phase times: profiling = off")


def test_off_rejects_a_clock():
    with pytest.raises(ValueError, match="clock"):
        prof_configure("off", clock=FakeClock())


def test_nvtx_mode_uses_inert_dummy_domain_with_cached_brackets():
    nvtx = pytest.importorskip("nvtx")
    from nvtx._lib import DummyDomain

    prof_configure("nvtx")
    assert isinstance(phases._domain, DummyDomain)  # no profiler attached in CI
    bracket = phase("stage0/attn")
    assert phase("stage0/attn") is bracket  # built once per name, reused after
    for _ in range(1000):
        with phase("stage0/attn"):
            pass
    assert phase_collect() == {}  # nvtx mode never times anything
    assert nvtx.get_domain("memra_dsv4") is phases._domain


def test_invalid_phase_names_fail_at_first_use():
    prof_configure("nvtx", nvtx_domain=RecordingDomain())
    for bad in ("", "a//b", "/a", "a/"):
        with pytest.raises(ValueError, match="phase name"):
            phase(bad)


# ---------------------------------------------------------------- balance under exceptions


@pytest.mark.parametrize("mode", ["nvtx", "events"])
def test_push_pop_balanced_when_body_raises(mode):
    domain, clock = RecordingDomain(), FakeClock()
    prof_configure(mode, nvtx_domain=domain, clock=clock if mode == "events" else None)
    with pytest.raises(KeyError):
        with phase("outer"):
            with phase("outer/inner"):
                clock.advance(3.0)
                raise KeyError("boom")
    assert domain.depth == 0
    assert [op for op, _ in domain.log] == ["push", "push", "pop", "pop"]
    assert [attr for op, attr in domain.log if op == "push"] == [("attr", "outer"), ("attr", "outer/inner")]
    if mode == "events":  # the raising phase still closed its records
        assert phase_collect() == {"outer": [3.0], "outer/inner": [3.0]}


def test_push_undone_when_event_record_fails_on_entry():
    domain = RecordingDomain()
    prof_configure("events", nvtx_domain=domain, clock=FailingClock())
    with pytest.raises(RuntimeError, match="cudaEventRecord"):
        with phase("x"):
            pass
    assert domain.depth == 0 and [op for op, _ in domain.log] == ["push", "pop"]


# ---------------------------------------------------------------- events mode end to end


def run_steps(clock: FakeClock, n: int) -> None:
    for _ in range(n):
        with phase("step"):
            with phase("step/attn"):
                clock.advance(30.0)
            with phase("step/moe"):
                clock.advance(50.0)
            clock.advance(5.0)  # inside step, outside its children


def test_events_mode_times_with_one_synchronize_per_collect():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    run_steps(clock, 3)
    assert clock.stamps == 18 and clock.syncs == 0  # recorded, never read per bracket
    assert phase_collect() == {"step": [85.0] * 3, "step/attn": [30.0] * 3, "step/moe": [50.0] * 3}
    assert clock.syncs == 1 and clock.rewinds == 1
    assert phase_collect()["step"] == [85.0] * 3  # nothing pending: no second synchronize
    assert clock.syncs == 1
    run_steps(clock, 1)  # accumulates across collections
    assert len(phase_collect()["step"]) == 4


def test_phase_report_in_events_mode():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    run_steps(clock, 4)
    text = phase_report(plain_us=85.0, file=None)
    assert text == format_report(build_report(phase_collect(), 85.0))
    step_line = text.splitlines()[2].split()
    assert step_line == ["step", "4", "340.0", "85.00", "85.00", "100.0%", "1.000"]


def test_phase_report_prints_to_stdout_by_default(capsys):
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    run_steps(clock, 1)
    text = phase_report()
    assert capsys.readouterr().out == text


def test_same_name_nested_inside_itself():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    with phase("r"):
        clock.advance(1.0)
        with phase("r"):
            clock.advance(2.0)
    assert phase_collect() == {"r": [3.0, 2.0]}  # in the order the brackets were entered


def test_record_slots_grow_past_the_initial_capacity():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    n = phases._INITIAL_SLOTS + 10
    for _ in range(n):
        with phase("k"):
            clock.advance(1.0)
    times = phase_collect()["k"]
    assert len(times) == n and set(times) == {1.0}


def test_capturing_flag_skips_events_but_keeps_nvtx():
    domain, clock = RecordingDomain(), FakeClock()
    prof_configure("events", nvtx_domain=domain, clock=clock)
    phase_set_capturing(True)
    with phase("graph/body"):
        clock.advance(10.0)
    assert clock.stamps == 0 and domain.depth == 0 and len(domain.log) == 2
    phase_set_capturing(False)
    with phase("eager"):
        clock.advance(4.0)
    assert phase_collect() == {"eager": [4.0]}


def test_bracket_open_when_capture_starts_is_dropped_not_closed_inside_capture():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    with phase("straddles"):
        phase_set_capturing(True)
    assert clock.stamps == 1  # the start only: no event recorded while capturing
    phase_set_capturing(False)
    assert phase_collect() == {}


def test_reset_clears_pending_and_accumulated():
    clock = FakeClock()
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=clock)
    run_steps(clock, 2)
    phase_collect()
    run_steps(clock, 1)  # pending, not yet collected
    phase_reset()
    assert phase_collect() == {}
    run_steps(clock, 1)
    assert phase_collect()["step"] == [85.0]


def test_collect_and_reset_refuse_inside_an_open_phase():
    prof_configure("events", nvtx_domain=RecordingDomain(), clock=FakeClock())
    with phase("open"):
        with pytest.raises(RuntimeError, match="open phase 'open'"):
            phase_collect()
        with pytest.raises(RuntimeError, match="open phase 'open'"):
            phase_reset()


# ---------------------------------------------------------------- CPU-only import


def test_package_never_imports_cupy_unless_events_mode():
    # A meta-path finder that refuses CuPy: the package must import and run off/nvtx without it,
    # and events mode must say it needs CuPy rather than fail obscurely.
    code = textwrap.dedent("""
        import sys
        class NoCupy:
            def find_spec(self, name, path=None, target=None):
                if name == "cupy" or name.startswith("cupy."):
                    raise ImportError("cupy blocked by test")
        sys.meta_path.insert(0, NoCupy())
        from memra_dsv4.profiling import phase, prof_configure
        for mode in ("off", "nvtx"):
            prof_configure(mode)
            with phase("a/b"):
                pass
        try:
            prof_configure("events")
        except RuntimeError as e:
            assert "needs CuPy" in str(e), e
        else:
            raise AssertionError("events mode started without CuPy")
        print("ok")
    """)
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_fake_clock_is_monotonic():
    clock = FakeClock(start_us=5.0)
    with pytest.raises(ValueError):
        clock.advance(-1.0)
    a = clock.stamp()
    clock.advance(2.5)
    assert math.isclose(clock.elapsed_ms(a, clock.stamp()), 0.0025)
