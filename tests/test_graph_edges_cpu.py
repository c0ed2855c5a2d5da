"""graphs.edges_to_convert (the pure half of graphs.programmatic_edges) and the
MEMRA_DSV4_GRAPH_EDGES switch, on the CPU: which captured edges become programmatic, and the
refusal of unknown values.  The rewrite itself runs on the GPU
(tests/gpu/test_step_graph_edges_gpu.py)."""
from __future__ import annotations

import pytest

from memra_dsv4.gpu import graphs
from memra_dsv4.gpu.step_device import graph_edges_form

DEF, PROG = 0, 1
# nodes: 1..6 kernels (5 and 6 PdlKernel functions f5 / f6, 4 a foreign kernel), 9 a memcpy
KINDS = {1: (True, "f1"), 2: (True, "f2"), 3: (True, "f3"), 4: (True, "f4"), 5: (True, "f5"),
         6: (True, "f6"), 9: (False, None)}
PDL = {"f1", "f2", "f3", "f5", "f6"}
EDGES = [(1, 2, PROG),   # main stream PDL edge
         (1, 5, DEF),    # fork: 5 is a side branch's first kernel (PDL function, no prog in-edge)
         (5, 3, DEF),    # join into 3, which has a programmatic in-edge (from 2)
         (2, 3, PROG),
         (3, 4, DEF),    # into a foreign kernel: never
         (9, 6, DEF),    # from a memcpy node: never (programmatic edges are kernel -> kernel)
         (3, 6, PROG)]


def test_off_converts_nothing():
    assert graphs.edges_to_convert(EDGES, KINDS.__getitem__, PDL, "off") == []


def test_join_converts_only_edges_into_pdl_launched_kernels():
    assert graphs.edges_to_convert(EDGES, KINDS.__getitem__, PDL, "join") == [2]


def test_all_adds_fork_edges_into_pdl_functions():
    assert graphs.edges_to_convert(EDGES, KINDS.__getitem__, PDL, "all") == [1, 2]


def test_all_without_pdl_functions_is_join():
    assert graphs.edges_to_convert(EDGES, KINDS.__getitem__, set(), "all") == [2]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="edges='some'"):
        graphs.edges_to_convert(EDGES, KINDS.__getitem__, PDL, "some")


def test_env_switch(monkeypatch):
    monkeypatch.delenv("MEMRA_DSV4_GRAPH_EDGES", raising=False)
    assert graph_edges_form() == "off"
    for v in ("off", "join", "all"):
        monkeypatch.setenv("MEMRA_DSV4_GRAPH_EDGES", v)
        assert graph_edges_form() == v
    monkeypatch.setenv("MEMRA_DSV4_GRAPH_EDGES", "yes")
    with pytest.raises(ValueError, match="MEMRA_DSV4_GRAPH_EDGES='yes'"):
        graph_edges_form()


def test_edge_data_is_the_driver_struct():
    import ctypes
    assert ctypes.sizeof(graphs._EdgeData) == 8


def test_carveout_env(monkeypatch):
    from memra_dsv4.gpu.pdl import smem_carveout
    monkeypatch.delenv("MEMRA_DSV4_SMEM_CARVEOUT", raising=False)
    assert smem_carveout() is None
    for v, want in (("default", None), ("max", 100), ("maxl1", 0), ("50", 50), ("0", 0), ("100", 100)):
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", v)
        assert smem_carveout() == want, v
    for bad in ("101", "-1", "half"):
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", bad)
        with pytest.raises(ValueError, match="MEMRA_DSV4_SMEM_CARVEOUT"):
            smem_carveout()


def test_wqb_qnorm_env(monkeypatch):
    from memra_dsv4.gpu.step_device import WQB_QNORM_ENV, wqb_qnorm_on
    monkeypatch.delenv(WQB_QNORM_ENV, raising=False)
    assert wqb_qnorm_on() is False
    monkeypatch.setenv(WQB_QNORM_ENV, "on")
    assert wqb_qnorm_on() is True
    monkeypatch.setenv(WQB_QNORM_ENV, "yes")
    with pytest.raises(ValueError, match="MEMRA_DSV4_WQB_QNORM"):
        wqb_qnorm_on()
