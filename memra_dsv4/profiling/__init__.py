"""Profiling: NVTX phase brackets, CUDA-event phase timing, and the phase report.

    from memra_dsv4.profiling import phase, phase_report
    with phase("stage0/block3/attn"):
        ...
    phase_report(plain_us=2610.0)

`MEMRA_DSV4_PROF=off|nvtx|events` picks what a bracket does (phases.py explains the modes and
their interaction with CUDA-graph capture). Importing this package never imports CuPy.
"""

from .events import EventPool, FakeClock, TimeSource
from .phases import (
    ENV_VAR,
    MODES,
    phase,
    phase_collect,
    phase_report,
    phase_reset,
    phase_set_capturing,
    prof_configure,
    prof_mode,
    prof_on,
)
from .report import Row, build_report, format_report

__all__ = [
    "ENV_VAR", "MODES", "EventPool", "FakeClock", "Row", "TimeSource", "build_report",
    "format_report", "phase", "phase_collect", "phase_report", "phase_reset",
    "phase_set_capturing", "prof_configure", "prof_mode", "prof_on",
]
