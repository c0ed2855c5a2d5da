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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        self.log.append(("begin", gc.isenabled()))

    def end_capture(self):
        self.log.append(("end", gc.isenabled()))
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
