"""The graph-branch priority seam (MEMRA_DSV4_DECODE_PRIORITY) on the CPU: its resolution in
DeviceStep, the bench arm, and that graphs.capture's node-priority form asks the driver for
CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.  The bytes and the schedule are the GPU's
(tests/gpu/test_step_priority_gpu.py, bench.decode_step --arms ...+prio=off,...+prio=side)."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest


def test_priority_seam_and_step_form():
    from memra_dsv4.gpu.step_device import DeviceStep
    from memra_dsv4.seams import SEAM_DECODE_PRIORITY, SEAMS, resolve
    assert SEAMS["decode_priority"] is SEAM_DECODE_PRIORITY and SEAM_DECODE_PRIORITY.default == "off"
    assert resolve(SEAM_DECODE_PRIORITY, "side") == "side"
    with pytest.raises(ValueError, match="allowed: off, side, attn"):
        resolve(SEAM_DECODE_PRIORITY, "high")
    ds = object.__new__(DeviceStep)
    for value, want in (("side", "side"), ("attn", "attn"), ("off", "off"), (None, "off")):
        ds.m = SimpleNamespace(decode_priority=value)
        assert ds.priority_form() == want
    ds.m = SimpleNamespace(decode_priority="all")
    with pytest.raises(ValueError, match=r"model.decode_priority \(env MEMRA_DSV4_DECODE_PRIORITY\)"):
        ds.priority_form()


def test_decode_bench_prio_arm():
    from bench.decode_step import check_arms
    assert check_arms("path=device+prio=off,path=device+prio=side") == [
        {"path": "device", "prio": "off"}, {"path": "device", "prio": "side"}]
    with pytest.raises(SystemExit, match="prio='on'; expected one of off, side, attn"):
        check_arms("path=device+prio=on")


def test_priority_graph_instantiates_with_the_node_priority_flag(monkeypatch):
    """PriorityGraph with a stand-in cuda.bindings driver: the flag, launch / upload on the
    given stream, an instantiate error named, both handles destroyed."""
    calls = []

    class R:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class Err(int):
        @property
        def name(self):
            return "CUDA_ERROR_INVALID_VALUE"

    class Flags:
        CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = SimpleNamespace(value=8)

    fail = {"on": False}
    drv = types.ModuleType("cuda.bindings.driver")
    drv.CUresult = R
    drv.CUgraphInstantiate_flags = Flags
    drv.CUgraph = lambda h: ("graph", h)
    drv.CUstream = lambda h: ("stream", h)
    drv.cuGraphInstantiate = lambda g, f: (calls.append(("inst", g, f)) or
                                           ((Err(1), None) if fail["on"] else (0, "exec")))
    drv.cuGraphLaunch = lambda e, s: (calls.append(("launch", e, s)) or (0,))
    drv.cuGraphUpload = lambda e, s: (calls.append(("upload", e, s)) or (0,))
    drv.cuGraphExecDestroy = lambda e: calls.append(("exec_destroy", e))
    drv.cuGraphDestroy = lambda g: calls.append(("destroy", g))
    drv.cuGetErrorString = lambda e: (0, b"invalid argument")
    pkg = types.ModuleType("cuda.bindings")
    pkg.driver = drv
    cuda = types.ModuleType("cuda")
    cuda.bindings = pkg
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    from memra_dsv4.gpu import graphs
    g = graphs.PriorityGraph(1234)
    g.upload(SimpleNamespace(ptr=7))
    g.launch(SimpleNamespace(ptr=7))
    del g
    assert calls == [("inst", ("graph", 1234), 8), ("upload", "exec", ("stream", 7)),
                     ("launch", "exec", ("stream", 7)), ("exec_destroy", "exec"),
                     ("destroy", ("graph", 1234))]
    calls.clear()
    fail["on"] = True
    with pytest.raises(graphs.CaptureError, match="USE_NODE_PRIORITY.*INVALID_VALUE.*invalid argument"):
        graphs.PriorityGraph(99)
    assert ("destroy", ("graph", 99)) in calls
