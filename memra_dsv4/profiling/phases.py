"""Phase brackets: `with phase("stage0/block3/attn"):` marks a region for NVTX and GPU timing.

Modes, from `MEMRA_DSV4_PROF=off|nvtx|events` (default off). The variable is read once, at the
first `phase()`/`prof_on()` call, unless `prof_configure(mode)` ran first; the resolved mode is
announced once per configuration on stderr as `memra_dsv4: profiling = <mode>`.

- off: `phase(name)` does one flag check and returns a shared no-op context manager.
- nvtx: each bracket pushes/pops a range in the NVTX domain "memra_dsv4". The attributes and
  the context-manager object are built once per name and cached, so after first use a bracket
  allocates nothing of ours. With no tool attached, nvtx hands out its DummyDomain and the
  push/pop are empty Python calls (~0.2 µs a pair).
- events: nvtx, plus a CUDA event pair per bracket from a pool (`events.EventPool`). Records
  (name, start, end) go into preallocated slots; nothing is synchronized or read per bracket.
  `phase_collect()` synchronizes once, converts every pending pair to µs, and rewinds the pool
  so the same events serve the next steps. Call it every step or every few steps: the pool
  grows to the number of brackets between two collections.

CUDA-graph capture: events mode must not record events while a stream is capturing. An event
recorded on a capturing stream is no timestamp: capture uses it only to express cross-stream
dependencies and the replay never records it, so its elapsed time would be an error or stale;
and pool growth (cudaEventCreate) has no business inside a capture either. Querying the stream on every bracket would cost a driver call
each, so the caller states it once per step: `phase_set_capturing(stream.is_capturing())`, or
`True` before `begin_capture()` and `False` after `end_capture()`. While the flag is set, brackets
still push/pop NVTX (CPU-side, harmless, and it shows capture time on a timeline) but take and
record no events; a bracket that was opened before the flag was set is dropped, not closed
inside the capture. Graph replays themselves are timed as a whole by the caller; per-phase GPU
times come from an eager profiling run.

The report's tree comes from the '/' in names, not from how brackets nest at run time: name
a bracket inside "step" as "step/...", or it counts as a top-level phase of its own.

Invariants: push and pop stay balanced when the body raises; a bracket must start and end on
the same current device (its two events belong to one device); one host thread drives phases.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib
from typing import TextIO

from .events import EventPool, TimeSource
from .report import build_report, format_report

ENV_VAR = "MEMRA_DSV4_PROF"
MODES = ("off", "nvtx", "events")
DOMAIN_NAME = "memra_dsv4"

# tab10 as NVTX ARGB: a phase's leaf name picks its color, so "attn" looks the same in every block.
_PALETTE = (0xFF1F77B4, 0xFFFF7F0E, 0xFF2CA02C, 0xFFD62728, 0xFF9467BD,
            0xFF8C564B, 0xFFE377C2, 0xFF7F7F7F, 0xFFBCBD22, 0xFF17BECF)
_INITIAL_SLOTS = 4096
_DROPPED = object()  # end marker of a record that must not be read (closed while capturing)


class _NoOp:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False


_NOOP = _NoOp()


class _NullDomain:
    """Stands in for an NVTX domain when the nvtx package is not installed."""

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return None

    def push_range(self, attributes=None):
        pass

    def pop_range(self):
        pass


class _Recorder:
    """Pending event records as parallel preallocated slots: names[i], starts[i], ends[i]."""

    __slots__ = ("clock", "names", "starts", "ends", "count", "lock")

    def __init__(self, clock: TimeSource) -> None:
        self.clock = clock
        # One host thread per pipeline stage may bracket at once (gpu.decode.run_chunk_pipelined):
        # a slot index is taken and its start stamped under the lock (uncontended: ~50 ns).
        self.lock = threading.Lock()
        self.names: list = [None] * _INITIAL_SLOTS
        self.starts: list = [None] * _INITIAL_SLOTS
        self.ends: list = [None] * _INITIAL_SLOTS
        self.count = 0

    def open(self, name: str) -> int:
        with self.lock:
            i = self.count
            if i == len(self.names):  # doubling keeps growth rare; it never happens while capturing
                for slots in (self.names, self.starts, self.ends):
                    slots.extend([None] * len(slots))
            self.names[i] = name
            self.starts[i] = self.clock.stamp()
            self.ends[i] = None
            self.count = i + 1
            return i

    def close(self, i: int) -> None:
        self.ends[i] = _DROPPED  # what the record stays if the stamp raises
        with self.lock:
            self.ends[i] = self.clock.stamp()

    def drop(self, i: int) -> None:
        self.ends[i] = _DROPPED

    def check_closed(self, caller: str) -> None:
        for i in range(self.count):
            if self.ends[i] is None:
                raise RuntimeError(f"{caller} called inside the open phase {self.names[i]!r}")

    def drain(self, into: dict[str, list[float]]) -> None:
        """Synchronize once, append every pending duration (µs) to `into`, free the slots."""
        self.check_closed("phase_collect()")
        clock, names, starts, ends = self.clock, self.names, self.starts, self.ends
        clock.synchronize()
        for i in range(self.count):
            if ends[i] is _DROPPED:
                continue
            us = 1000.0 * clock.elapsed_ms(starts[i], ends[i])
            times = into.get(names[i])
            if times is None:
                times = into[names[i]] = []
            times.append(us)
        self.discard()

    def discard(self) -> None:
        for slots in (self.starts, self.ends):  # let go of event handles; the pool keeps them
            slots[: self.count] = [None] * self.count
        self.count = 0
        self.clock.rewind()


class _NvtxBracket:
    __slots__ = ("_push", "_pop", "_attr")

    def __init__(self, domain, attr) -> None:
        self._push, self._pop, self._attr = domain.push_range, domain.pop_range, attr

    def __enter__(self) -> None:
        self._push(self._attr)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._pop()
        return False


class _EventBracket:
    __slots__ = ("_name", "_push", "_pop", "_attr", "_rec", "_open")

    def __init__(self, name: str, domain, attr, rec: _Recorder) -> None:
        self._name, self._attr, self._rec = name, attr, rec
        self._push, self._pop = domain.push_range, domain.pop_range
        # open slots per host thread (a name may nest inside itself, and two pipeline-stage
        # threads may hold the same name open at once): thread id -> stack of slots
        self._open: dict[int, list[int]] = {}

    def _stack(self) -> list[int]:
        tid = threading.get_ident()
        st = self._open.get(tid)
        if st is None:
            st = self._open[tid] = []
        return st

    def __enter__(self) -> None:
        self._push(self._attr)
        if _capturing:
            self._stack().append(-1)
            return
        try:
            self._stack().append(self._rec.open(self._name))
        except BaseException:
            self._pop()  # __exit__ will not run when __enter__ raises
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            i = self._stack().pop()
            if i >= 0:
                if _capturing:
                    self._rec.drop(i)
                else:
                    self._rec.close(i)
        finally:
            self._pop()
        return False


# Configuration and accumulated state. `_on` is None until the first configuration.
_on: bool | None = None
_mode: str | None = None
_domain = None
_recorder: _Recorder | None = None
_capturing = False
_brackets: dict[str, object] = {}
_timings: dict[str, list[float]] = {}


def _default_domain() -> tuple[object, str]:
    try:
        import nvtx
    except ImportError:
        return _NullDomain(), " (nvtx not installed: no ranges)"
    from nvtx._lib import DummyDomain

    domain = nvtx.get_domain(DOMAIN_NAME)
    note = " (no NVTX tool attached: ranges are no-ops)" if isinstance(domain, DummyDomain) else ""
    return domain, note


def prof_configure(mode: str | None = None, *, nvtx_domain=None, clock: TimeSource | None = None) -> str:
    """Set the profiling mode (None: read MEMRA_DSV4_PROF) and start from empty state.

    `nvtx_domain` and `clock` replace the nvtx domain and the CUDA event pool; tests pass a
    recording fake domain and an `events.FakeClock`. Returns the resolved mode.
    """
    global _on, _mode, _domain, _recorder, _capturing
    raw = os.environ.get(ENV_VAR, "") if mode is None else mode
    resolved = raw.strip().lower() or "off"
    if resolved not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}; got {raw!r}")
    if clock is not None and resolved != "events":
        raise ValueError(f"a clock only applies to {ENV_VAR}=events, not {resolved!r}")

    note = ""
    domain = recorder = None
    if resolved != "off":
        domain = nvtx_domain
        if domain is None:
            domain, note = _default_domain()
    if resolved == "events":
        if clock is None:
            try:
                clock = EventPool()
            except ImportError as e:
                raise RuntimeError(f"{ENV_VAR}=events times phases with CUDA events and needs CuPy") from e
        recorder = _Recorder(clock)

    _on, _mode, _domain, _recorder, _capturing = resolved != "off", resolved, domain, recorder, False
    _brackets.clear()
    _timings.clear()
    print(f"memra_dsv4: profiling = {resolved}{note}", file=sys.stderr)
    return resolved


def prof_on() -> bool:
    """True when brackets do anything (mode nvtx or events)."""
    if _on is None:
        prof_configure()
    return _on


def prof_mode() -> str:
    if _mode is None:
        prof_configure()
    return _mode


def phase_set_capturing(capturing: bool) -> None:
    """Tell events mode whether the current stream is capturing a CUDA graph (see module doc)."""
    global _capturing
    _capturing = bool(capturing)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or any(part == "" for part in name.split("/")):
        raise ValueError(f"phase name must be a non-empty '/'-separated path without empty parts, got {name!r}")


def _new_bracket(name: str):
    if _on is None:
        prof_configure()
    if not _on:
        return _NOOP
    _check_name(name)
    leaf = name.rsplit("/", 1)[-1]
    attr = _domain.get_event_attributes(message=name, color=_PALETTE[zlib.crc32(leaf.encode()) % len(_PALETTE)])
    if _recorder is None:
        bracket = _NvtxBracket(_domain, attr)
    else:
        bracket = _EventBracket(name, _domain, attr, _recorder)
    _brackets[name] = bracket
    return bracket


def phase(name: str):
    """Context manager bracketing one phase; cached per name. Off: the shared no-op."""
    if _on is False:
        return _NOOP
    bracket = _brackets.get(name)
    if bracket is None:
        bracket = _new_bracket(name)
    return bracket


def phase_reset() -> None:
    """Drop pending records and accumulated times; keeps the event pool and bracket cache."""
    if _recorder is not None:
        _recorder.check_closed("phase_reset()")
        _recorder.discard()
    _timings.clear()


def phase_collect() -> dict[str, list[float]]:
    """Resolve pending events (one synchronize) and return every phase's GPU µs so far.

    Names appear in first-entered order; each list is in the order its brackets were entered.
    """
    if _recorder is not None and _recorder.count:
        _recorder.drain(_timings)
    return {name: list(times) for name, times in _timings.items()}


_STDOUT = object()  # default `file`: sys.stdout as it is at call time (pytest swaps it)


def phase_report(plain_us: float = 0.0, step_count: int | None = None, file: TextIO | None = _STDOUT) -> str:
    """Collect and format the phase table (see report.py); print it to `file` unless None."""
    if _mode == "events":
        text = format_report(build_report(phase_collect(), plain_us, step_count))
    else:
        text = f"(no GPU phase times: profiling = {_mode or 'unconfigured'}; set {ENV_VAR}=events)\n"
    if file is not None:
        print(text, end="", file=sys.stdout if file is _STDOUT else file)
    return text
