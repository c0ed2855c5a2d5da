"""CPU tests of bench/harness.py and bench/plot.py: arms, interleaving, statistics, floors, results."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from bench import harness
from bench.harness import (
    Arm,
    PerfCounterTimer,
    arm_label,
    floors,
    parse_arms,
    phase_breakdown,
    run_interleaved,
    summarize,
    write_results,
)
from memra_dsv4.profiling import build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- arms


def test_parse_arms_syntax():
    assert parse_arms("path=legacy,path=device+dense=fp8") == [
        {"path": "legacy"},
        {"path": "device", "dense": "fp8"},
    ]
    assert parse_arms(" path=a , path=b + mtp.k=1 ") == [{"path": "a"}, {"path": "b", "mtp.k": "1"}]
    assert parse_arms("path=a,path=a") == [{"path": "a"}, {"path": "a"}]  # an A/A pair is allowed


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("   ", "empty"),
    ("path=a,,path=b", "arm 2 is empty"),
    ("path=a,", "arm 2 is empty"),
    ("path", "not key=value"),
    ("path=a+", "not key=value"),
    ("path=", "invalid value"),
    ("=x", "invalid key"),
    ("1st=x", "invalid key"),
    ("path=a=b", "invalid value"),
    ("path=a+path=b", "sets 'path' twice"),
])
def test_parse_arms_rejects_malformed(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arms(spec)


def test_decode_step_arms_take_attn_and_refuse_bad_values():
    """bench/decode_step.py: arm settings path / pdl / attn, checked before any GPU work."""
    from bench import decode_step
    assert decode_step.check_arms("path=device+attn=split,path=device+attn=fused") == [
        {"path": "device", "attn": "split"}, {"path": "device", "attn": "fused"}]
    assert decode_step.check_arms("path=device+pdl=off+attn=fused") == [
        {"path": "device", "pdl": "off", "attn": "fused"}]
    assert arm_label({"path": "device", "attn": "fused"}) == "path=device+attn=fused"
    for spec, message in (("path=device+attn=one", r"attn='one'; expected one of split, fused"),
                          ("path=device+pdl=maybe", r"pdl='maybe'; expected one of on, off"),
                          ("path=fast", r"path='fast'; expected one of legacy, device-hostmath, device"),
                          ("path=device+attention=fused", r"unknown setting\(s\) \['attention'\]; known: path, pdl, attn")):
        with pytest.raises(SystemExit, match=message):
            decode_step.check_arms(spec)
    # main refuses before it imports CuPy or loads a model
    with pytest.raises(SystemExit, match="attn='fused2'"):
        decode_step.main(["--arms", "path=device+attn=split,path=device+attn=fused2"])
    # two arms with the same settings (the same name): refused before any GPU work, naming it
    with pytest.raises(SystemExit, match=r"--arms: arm\(s\) path=device\+pdl=off given more than once"):
        decode_step.check_arms("path=device+pdl=off,path=device,path=device+pdl=off")
    with pytest.raises(SystemExit, match="given more than once"):
        decode_step.main(["--arms", "path=device,path=device"])
    assert len(decode_step.check_arms("path=device+carve=driver,path=device,path=device+carve=driver+attnhg=auto")) == 3


def test_arm_label_inverts_parse():
    spec = "path=legacy,path=device+dense=fp8"
    assert ",".join(arm_label(a) for a in parse_arms(spec)) == spec


# ---------------------------------------------------------------- interleaving


class FakeTimer:
    """Runs fn and returns a scripted time, logging which calls were timed."""

    def __init__(self, log: list[str]):
        self.log = log
        self.calls = 0

    def __call__(self, fn) -> float:
        self.log.append("timer")
        fn()
        self.calls += 1
        return float(self.calls)


def test_run_interleaved_is_round_robin_with_untimed_warmup():
    log: list[str] = []
    arms = [Arm("A", lambda: log.append("A")), Arm("B", lambda: log.append("B"))]
    timer = FakeTimer(log)
    samples = run_interleaved(arms, steps=3, warmup=2, timer=timer, progress=False)
    assert log == ["A", "B"] * 2 + ["timer", "A", "timer", "B"] * 3
    assert samples == {"A": [1.0, 3.0, 5.0], "B": [2.0, 4.0, 6.0]}
    assert list(samples) == ["A", "B"]


def test_run_interleaved_validates():
    arm = Arm("A", lambda: None)
    timer = FakeTimer([])
    with pytest.raises(ValueError, match="at least one arm"):
        run_interleaved([], 1, 0, timer, progress=False)
    with pytest.raises(ValueError, match="unique"):
        run_interleaved([arm, Arm("A", lambda: None)], 1, 0, timer, progress=False)
    with pytest.raises(ValueError, match="steps >= 1"):
        run_interleaved([arm], 0, 0, timer, progress=False)
    with pytest.raises(ValueError, match="warmup >= 0"):
        run_interleaved([arm], 1, -1, timer, progress=False)


def test_perf_counter_timer_measures_the_call():
    ms = PerfCounterTimer()(lambda: time.sleep(0.02))
    assert 19.0 <= ms < 500.0


# ---------------------------------------------------------------- statistics and floors


def test_summarize_known_values():
    s = summarize([float(x) for x in range(10, 0, -1)])  # 1..10, unsorted
    assert s["n"] == 10
    assert s["median"] == pytest.approx(5.5) and s["mean"] == pytest.approx(5.5)
    assert s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    assert s["iqr"] == pytest.approx(7.75 - 3.25)
    assert s["tok_s"] == pytest.approx(1000.0 / 5.5)
    assert summarize([2.0], tokens_per_step=1.6)["tok_s"] == pytest.approx(800.0)
    with pytest.raises(ValueError):
        summarize([])


def test_floors():
    # The Flash batch-1 anchor: 11.22 GB read per token at the 4.3 TB/s copy rate -> 2.61 ms.
    assert floors(11.22e9, 4.3e12) == pytest.approx(2.609, abs=1e-3)
    assert floors({"A": 4.3e9, "B": 8.6e9}, 4.3e12) == {"A": pytest.approx(1.0), "B": pytest.approx(2.0)}
    with pytest.raises(ValueError):
        floors(1.0, 0.0)


def test_phase_breakdown_takes_one_tree_level():
    rows = build_report({"step": [100.0], "step/attn": [30.0], "step/moe": [60.0], "step/moe/e": [50.0]})
    assert phase_breakdown(rows, depth=1) == {"step/attn": 30.0, "step/moe": 60.0}
    assert phase_breakdown(rows) == {"step": 100.0}


# ---------------------------------------------------------------- results


def payload() -> dict:
    return {
        "config": {"model": "synthetic:tiny", "steps": 5, "ctx": 128},
        "arms": {
            "path=legacy": {"settings": {"path": "legacy"}, "summary": summarize([3.0, 3.2, 3.1]),
                            "phases_us": {"attn": 900.0, "moe": 1500.0}, "floor_ms": 2.6},
            "path=device": {"settings": {"path": "device"}, "summary": summarize([2.8, 2.9, 3.0]),
                            "phases_us": {"attn": 700.0, "moe": 1600.0, "head": 100.0}},
        },
    }


def test_write_results_json_and_png(tmp_path):
    json_path, png_path = write_results(payload(), out_dir=tmp_path, gpu_name="NVIDIA H200", commit="abcdef0123")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-nvidia-h200-abcdef0\.json", json_path.name)
    doc = json.loads(json_path.read_text())
    assert doc["arms"]["path=device"]["phases_us"]["head"] == 100.0
    assert doc["meta"]["gpu"] == "NVIDIA H200" and doc["meta"]["commit"] == "abcdef0"
    assert doc["meta"]["host_cpu"].endswith("logical CPUs)")
    assert json_path.name.startswith(doc["meta"]["date"])
    assert png_path == json_path.with_suffix(".png")
    assert png_path.read_bytes()[:8] == PNG_MAGIC

    again, _ = write_results(payload(), out_dir=tmp_path, gpu_name="NVIDIA H200", commit="abcdef0123")
    assert again.name == json_path.stem + "-2.json"  # never overwrites an earlier run


def test_write_results_keeps_json_when_plotting_is_unavailable(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench.plot", None)  # import now raises ImportError
    json_path, png_path = write_results(payload(), out_dir=tmp_path, gpu_name="cpu", commit="1234567")
    assert png_path is None and json_path.exists()
    assert "python -m bench.plot" in capsys.readouterr().err


def test_plot_cli_redraws_from_json(tmp_path):
    from bench import plot

    src = tmp_path / "r.json"
    src.write_text(json.dumps({**payload(), "meta": {"gpu": "cpu", "date": "2026-01-01", "commit": "x"}}))
    assert plot.main([str(src)]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_gpu_name_falls_back_to_cpu_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert harness.gpu_name() == "cpu"


def test_git_commit_short(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMRA_DSV4_COMMIT", raising=False)
    commit = harness.git_commit_short()
    assert commit == "nogit" or re.fullmatch(r"[0-9a-f]{7}", commit)
    assert harness.git_commit_short(tmp_path) == "nogit"  # not a repository


def test_git_commit_short_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRA_DSV4_COMMIT", "abcdef0123456789")
    assert harness.git_commit_short(tmp_path) == "abcdef0"  # env wins, even outside a repository
    assert harness.git_commit_short() == "abcdef0"
    monkeypatch.setenv("MEMRA_DSV4_COMMIT", "  ")
    assert harness.git_commit_short(tmp_path) == "nogit"  # blank: ignored


def test_prefill_bench_arms_parse_and_refuse():
    from bench.prefill import parse_arms
    assert parse_arms("") == [("", {})]
    assert parse_arms("moe=fp4mma+pipeline=on, moe=blaslt") == [
        ("moe=fp4mma+pipeline=on", {"moe": "fp4mma", "pipeline": "on"}), ("moe=blaslt", {"moe": "blaslt"})]
    with pytest.raises(SystemExit, match="unknown setting 'gemm'"):
        parse_arms("gemm=fp4mma")
    with pytest.raises(SystemExit, match="pipeline='2'; expected one of off, on"):
        parse_arms("pipeline=2")
    assert parse_arms("dispatch=host,dispatch=device+moe=fp4mma") == [
        ("dispatch=host", {"dispatch": "host"}),
        ("dispatch=device+moe=fp4mma", {"dispatch": "device", "moe": "fp4mma"})]
    with pytest.raises(SystemExit, match="dispatch='gpu'; expected one of host, device"):
        parse_arms("dispatch=gpu")


def test_decode_bench_kernel_arms(tmp_path):
    from bench.decode_step import _kernel_env, check_arms
    arms = check_arms("path=device+gemv=pick+hc=poll,path=device+gemv=base+hc=lastcta")
    pick = tmp_path / "pick"
    pick.write_text("plain.fp8.large=bulk_r4s4\n")
    assert _kernel_env(arms[0], str(pick)) == {"MEMRA_DSV4_GEMV_VARIANT": "plain.fp8.large=bulk_r4s4",
                                               "MEMRA_DSV4_HC_BOUNDARY_IMPL": "poll"}
    assert _kernel_env(arms[1], None) == {"MEMRA_DSV4_GEMV_VARIANT": "", "MEMRA_DSV4_HC_BOUNDARY_IMPL": "lastcta"}
    assert _kernel_env({"path": "device"}, None) == {}
    with pytest.raises(SystemExit, match="gemv=pick needs --gemv-pick"):
        _kernel_env(arms[0], None)
    with pytest.raises(SystemExit, match="hc='fast'; expected one of lastcta, poll"):
        check_arms("path=device+hc=fast")


def test_decode_bench_arm_without_a_setting_gets_the_start_value_not_the_previous_arms(monkeypatch):
    """Arms share one process and the kernel env variables are read at every launch: an arm that
    does not name idxsel (say) must run the process's start value, not the value the arm before it
    set (twelfth session: 'path=device+idxsel=fused,path=device' ran fused twice)."""
    import os

    import bench.decode_step as BD
    from types import SimpleNamespace
    envs = {s.env for k, s in BD._arm_settings().items() if isinstance(s, SimpleNamespace)}
    assert envs == set(BD.KERNEL_ENVS)                   # every non-seam setting is covered
    monkeypatch.setattr(BD, "_START_ENV", {k: None for k in BD.KERNEL_ENVS} | {"MEMRA_DSV4_FP4_RING": "1"})
    for k in BD.KERNEL_ENVS:   # setenv first: monkeypatch then restores (or removes) what _apply_env sets
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    first = BD.complete_kernel_env(BD._kernel_env({"idxsel": "fused", "fp4ring": "off"}, None))
    second = BD.complete_kernel_env(BD._kernel_env({"path": "device"}, None))
    assert set(first) == set(second) == set(BD.KERNEL_ENVS)
    assert first["MEMRA_DSV4_INDEXER_SELECT"] == "fused" and first["MEMRA_DSV4_FP4_RING"] == "0"
    assert second["MEMRA_DSV4_INDEXER_SELECT"] is None and second["MEMRA_DSV4_FP4_RING"] == "1"
    st = BD._ArmState.__new__(BD._ArmState)
    st.kernel_env = first
    st._apply_env()
    assert os.environ["MEMRA_DSV4_INDEXER_SELECT"] == "fused" and os.environ["MEMRA_DSV4_FP4_RING"] == "0"
    st.kernel_env = second
    st._apply_env()
    assert "MEMRA_DSV4_INDEXER_SELECT" not in os.environ and os.environ["MEMRA_DSV4_FP4_RING"] == "1"


def test_prefill_bench_times_uninstrumented_and_reports_from_separate_forwards(capsys):
    """bench.prefill.time_forwards: warm-up and timed forwards run in the timed profiling mode
    (off unless MEMRA_DSV4_PROF says otherwise), the phase report comes from the extra forwards
    in events mode only, the GEMM flops are those of the timed forwards, and profiling is left
    in the timed mode (also when a phase forward raises)."""
    from types import SimpleNamespace

    from bench.prefill import time_forwards
    from memra_dsv4.profiling import FakeClock, phase, prof_configure, prof_mode

    class FakeModel:
        def __init__(self):
            self.modes = []
            self.gemm = {0: SimpleNamespace(flops=0)}
            self.fail = False

        def forward(self, ids):
            self.modes.append(prof_mode())
            self.gemm[0].flops += 10
            with phase("prefill/stage0"):
                pass
            if self.fail and prof_mode() == "events":
                raise RuntimeError("phase forward failed")

    m = FakeModel()
    try:
        samples, flops, rows = time_forwards(m, [1, 2], "T=2", iters=3, warmup=2, phase_iters=2,
                                             phase_clock=FakeClock())
        assert m.modes == ["off"] * 5 + ["events"] * 2
        assert len(samples) == 3 and flops == 10
        assert [r.name for r in rows] == ["prefill/stage0"] and rows[0].calls == 2
        assert prof_mode() == "off"
        m.modes.clear()
        _, _, rows = time_forwards(m, [1], "T=1", iters=1, warmup=0, phase_iters=0)
        assert m.modes == ["off"] and rows == []
        m.fail = True
        with pytest.raises(RuntimeError, match="phase forward failed"):
            time_forwards(m, [1], "T=1", iters=1, warmup=0, phase_iters=1, phase_clock=FakeClock())
        assert prof_mode() == "off"
    finally:
        prof_configure("off")
    out = capsys.readouterr().out
    assert "T=2: warm-up forward 1" in out and "T=2: forward 3" in out
    assert "(host probe " in out


def test_prefill_bench_host_probe_one_per_timed_forward(monkeypatch):
    """time_forwards(probes=[...]) takes bench.prefill.host_probe_ms right before each timed
    forward (none before warm-up or phase forwards), so a slow forward can be read against the
    host's speed just before it; host_probe_ms itself is a positive wall time."""
    from types import SimpleNamespace

    import bench.prefill as BP
    from memra_dsv4.profiling import FakeClock, prof_configure

    order = []
    monkeypatch.setattr(BP, "host_probe_ms", lambda: order.append("probe") or 1.5)
    m = SimpleNamespace(gemm={}, forward=lambda ids: order.append("forward"))
    probes: list = []
    try:
        BP.time_forwards(m, [1], "T=1", iters=3, warmup=2, phase_iters=1, phase_clock=FakeClock(),
                         probes=probes)
    finally:
        prof_configure("off")
    assert probes == [1.5] * 3
    assert order == ["forward"] * 2 + ["probe", "forward"] * 3 + ["forward"]
    monkeypatch.undo()
    assert BP.host_probe_ms(2000) > 0.0


def test_decode_step_arm_apply_sets_env_and_model(monkeypatch):
    """bench.decode_step's _ArmState.apply: every arm setting onto the shared model and the arm's
    kernel env values into the environment (an empty value removes the variable); step,
    eager_step and the launch profile all start from it."""
    from types import SimpleNamespace
    from bench.decode_step import _ArmState
    monkeypatch.setenv("MEMRA_DSV4_GEMV_VARIANT", "stale")   # monkeypatch restores both afterwards
    monkeypatch.setenv("MEMRA_DSV4_FP4_FULL", "1")
    st = object.__new__(_ArmState)
    st.m = SimpleNamespace()
    st.kernel_env = {"MEMRA_DSV4_FP4_FULL": "0", "MEMRA_DSV4_GEMV_VARIANT": ""}
    st.path, st.pdl, st.attn, st.l2pf = "device", "on", "split", "off"
    st.fork, st.hcsplit, st.prio, st.qnorm, st.w2 = "lead", "on", "attn", "kernel", "fused"
    st.apply()
    assert vars(st.m) == {"decode_path": "device", "pdl": "on", "decode_attn": "split",
                          "l2_prefetch": "off", "decode_fork": "lead", "hc_split": "on",
                          "decode_priority": "attn", "decode_qnorm": "kernel",
                          "decode_shared_w2": "fused"}
    import os
    assert os.environ["MEMRA_DSV4_FP4_FULL"] == "0" and "MEMRA_DSV4_GEMV_VARIANT" not in os.environ


def test_run_interleaved_runs_setup_outside_the_timed_region():
    """An arm's setup runs before each of its steps (warm-up included), never inside timer(fn)."""
    log = []

    class LoggingTimer:
        def __call__(self, fn):
            log.append("start")
            fn()
            log.append("end")
            return 1.0
    arms = [Arm("A", lambda: log.append("A"), setup=lambda: log.append("setA")),
            Arm("B", lambda: log.append("B"))]
    samples = run_interleaved(arms, steps=2, warmup=1, timer=LoggingTimer(), progress=False)
    assert samples == {"A": [1.0, 1.0], "B": [1.0, 1.0]}
    assert log == ["setA", "A", "B"] + ["setA", "start", "A", "end", "start", "B", "end"] * 2


def test_host_cpu_names_the_model(tmp_path):
    from bench.harness import host_cpu
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU 9000\nflags\t: a b\n")
    assert host_cpu(str(info)).startswith("Some CPU 9000 (") and host_cpu(str(info)).endswith(" logical CPUs)")
    assert host_cpu(str(tmp_path / "absent")).endswith(" logical CPUs)")   # platform's name or unknown
