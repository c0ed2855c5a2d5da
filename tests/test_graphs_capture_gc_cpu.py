"""graphs.capture keeps Python's cyclic garbage collector off while the stream captures (a
collected object's finalizer may make a synchronising CUDA call that invalidates the capture),
and restores the collector's previous state afterwards, on success and when fn raises.  CPU
only: a fake ``cupy`` module stands in for the stream and runtime calls."""
from __future__ import annotations

import contextlib
import gc
import sys
import types

import pytest

from memra_dsv4.gpu import graphs


class _FakeStream:
    ptr = 0x1234
    device_id = 0

    def __init__(self):
        self.log = []
        self.capturing = False

    def is_capturing(self):
        return self.capturing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        self.log.append(("begin", gc.isenabled()))
        self.capturing = True

    def end_capture(self):
        self.log.append(("end", gc.isenabled()))
        self.capturing = False
        return types.SimpleNamespace(upload=lambda s: self.log.append(("upload", gc.isenabled())))


@pytest.fixture
def fake_cupy(monkeypatch):
    class _Err(Exception):
        pass
    rt = types.SimpleNamespace(CUDARuntimeError=_Err, getDevice=lambda: 0,
                               streamEndCapture=lambda ptr: 0, graphDestroy=lambda g: None)
    cuda = types.SimpleNamespace(Device=lambda d: contextlib.nullcontext(), runtime=rt)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(graphs.runtime, "advance_capture_epoch", lambda: None)
    return rt


@pytest.mark.parametrize("enabled_before", [True, False])
def test_capture_runs_fn_with_gc_off_and_restores_it(fake_cupy, enabled_before):
    stream, seen = _FakeStream(), []
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        graphs.capture(stream, lambda: seen.append(gc.isenabled()))
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False], "fn ran with the cyclic collector on"
    assert stream.log[:2] == [("begin", False), ("end", False)], stream.log
    assert after is enabled_before, "capture did not restore the collector's state"


def test_capture_restores_gc_when_fn_raises(fake_cupy):
    stream = _FakeStream()
    was = gc.isenabled()
    gc.enable()
    try:
        def boom():
            assert not gc.isenabled()
            raise RuntimeError("launch failed")
        with pytest.raises(RuntimeError, match="launch failed"):
            graphs.capture(stream, boom)
        assert gc.isenabled(), "the collector stayed off after a failed capture"
    finally:
        (gc.enable if was else gc.disable)()


def test_cyclic_garbage_made_inside_fn_is_collected_after_the_capture(fake_cupy):
    """The GPU regression test's scenario on the CPU: with the collector primed to run at every
    allocation, an unreachable cycle made inside fn must not be finalized while the stream
    captures (its finalizer would synchronise the device), and must be finalized afterwards."""
    stream, finalized = _FakeStream(), []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            finalized.append(stream.is_capturing())

    def fn():
        Cycle()
        junk = [[i] for i in range(2000)]
        del junk

    was, old = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.collect()
    try:
        gc.set_threshold(1, 1, 1)
        graphs.capture(stream, fn)
    finally:
        gc.set_threshold(*old)
        (gc.enable if was else gc.disable)()
    gc.collect()
    assert finalized == [False], f"finalized while capturing: {finalized}"
