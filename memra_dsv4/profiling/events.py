"""Time sources for phase brackets: CUDA event pairs on the GPU, a fake clock on CPU.

Contract (the `TimeSource` protocol that `phases.py` drives):

- `stamp()` marks "now" and returns an opaque handle. On the GPU that is a `cupy.cuda.Event`
  taken from a pool and recorded on the *current* stream of the *current* device; nothing
  waits for it.
- `synchronize()` blocks until every handle stamped since the last `rewind()` has completed.
  It is called once per collection, never per bracket.
- `elapsed_ms(start, end)` is the time between two completed handles, in milliseconds.
- `rewind()` hands every stamped handle back for reuse. It may only be called after the
  handles have been read, because reused events are re-recorded.

`EventPool` imports CuPy when it is constructed, so importing this module never needs a GPU.
`FakeClock` is deterministic: a stamp reads the clock, and only `advance()` moves it, so a test
stands for GPU work of a known length by advancing the clock inside a bracket.
"""

from __future__ import annotations

from typing import Protocol


class TimeSource(Protocol):
    def stamp(self) -> object: ...

    def synchronize(self) -> None: ...

    def elapsed_ms(self, start: object, end: object) -> float: ...

    def rewind(self) -> None: ...


class EventPool:
    """Pooled timing events, one free list per device, grown on demand and reused after rewind.

    CUDA events belong to the device that was current when they were created, and may only be
    recorded on that device's streams, so the pool keys its events by the current device.
    Growth creates events (a driver call), which is why callers must not stamp while a stream is
    capturing: the phase layer skips events during capture (see `phases.py`).
    """

    def __init__(self) -> None:
        import cupy  # lazy: only events mode pays for CuPy

        self._cupy = cupy
        self._get_device = cupy.cuda.runtime.getDevice
        self._events: dict[int, list] = {}  # device -> every event ever created there
        self._used: dict[int, int] = {}  # device -> how many of them are stamped and unread

    def stamp(self):
        device = self._get_device()
        events = self._events.get(device)
        if events is None:
            events = self._events[device] = []
            self._used[device] = 0
        i = self._used[device]
        if i == len(events):
            events.append(self._cupy.cuda.Event())  # timing enabled, non-blocking sync
        self._used[device] = i + 1
        ev = events[i]
        ev.record()  # the current stream of the current device
        return ev

    def synchronize(self) -> None:
        # A device-wide sync covers events recorded on any stream of that device, which
        # synchronizing only "the last event" would not.
        for device, used in self._used.items():
            if used:
                with self._cupy.cuda.Device(device):
                    self._cupy.cuda.runtime.deviceSynchronize()

    def elapsed_ms(self, start, end) -> float:
        return self._cupy.cuda.get_elapsed_time(start, end)

    def rewind(self) -> None:
        for device in self._used:
            self._used[device] = 0

    def capacity(self) -> int:
        """Events created so far, all devices: the pool's high-water mark."""
        return sum(len(events) for events in self._events.values())


class FakeClock:
    """A deterministic `TimeSource` in microseconds, for CPU tests of the whole phase path."""

    def __init__(self, start_us: float = 0.0) -> None:
        self.now_us = float(start_us)
        self.stamps = 0  # how many stamps were taken: lets tests assert "no events recorded"
        self.syncs = 0
        self.rewinds = 0

    def advance(self, us: float) -> None:
        """Stand-in for GPU work: the next stamp reads `us` later."""
        if us < 0:
            raise ValueError(f"FakeClock cannot go backwards (advance({us}))")
        self.now_us += us

    def stamp(self) -> float:
        self.stamps += 1
        return self.now_us

    def synchronize(self) -> None:
        self.syncs += 1

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) / 1000.0

    def rewind(self) -> None:
        self.rewinds += 1
