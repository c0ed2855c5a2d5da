"""CPU test of DeviceStep's per-state graph and GEMV-table cache (gpu/step_device.py): an entry
lives exactly as long as its state (weak keys), any number of live states keep theirs (until the
thirtieth session the cache was FIFO-bounded at 8 and nine states stepped in turn recaptured on
every step: ~80 ms per step at full depth on an H100), a changed form recaptures that state
only, a rebuilt table drops the state's graphs, and nothing in the cache keeps a state alive."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from types import SimpleNamespace

import pytest

from memra_dsv4.gpu.cache import DecodeState
from memra_dsv4.gpu.step_device import DeviceStep, GraphEntry
from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)


@pytest.fixture
def step(monkeypatch):
    """A DeviceStep without a GPU: no stages (the per-stage loops do nothing), a stand-in cupy
    module for _prepare's import, and _capture / the table build counted."""
    monkeypatch.setitem(sys.modules, "cupy", sys.modules.get("cupy") or types.ModuleType("cupy"))
    ds = object.__new__(DeviceStep)
    ds.m = SimpleNamespace(pdl="on", decode_attn="split", decode_fork="all", hc_split="on",
                           decode_priority="off", decode_qnorm="kernel", decode_shared_w2="fused",
                           l2_prefetch="off", devs=SimpleNamespace(order_after_current=lambda: None))
    ds.cfg = SimpleNamespace(hidden_size=64)
    ds.msl, ds.hostmath, ds.stages = 16, False, []
    ds._graphs, ds._tables = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
    ds.captures, ds.tables_built = [], []

    def capture(state, *forms):
        ds.captures.append(forms)
        return [object()]          # one stage's graph

    def ensure_tables(state):       # the real one (no stages: no GemvTable uploads), counted
        if state not in ds._tables:
            ds.tables_built.append(1)
        DeviceStep._ensure_tables(ds, state)
    ds._capture, ds._ensure_tables = capture, ensure_tables
    return ds


def _state():
    return DecodeState(SimpleNamespace(), {}, 16)


def test_any_number_of_live_states_keep_their_graphs(step):
    states = [_state() for _ in range(12)]
    first = [step._prepare(s, True)[0] for s in states]
    assert len(step.captures) == 12
    for _ in range(3):                      # stepped in turn: never recaptured
        again = [step._prepare(s, True)[0] for s in states]
        assert all(a is b for a, b in zip(first, again))
    assert len(step.captures) == 12 and len(step._graphs) == 12
    assert isinstance(first[0], GraphEntry) and first[0].hc_split is True
    assert first[0][1:] == (True, "split", "all", True, "off", "kernel", "fused")


def test_a_changed_form_recaptures_that_state_only(step):
    a, b = _state(), _state()
    ga, gb = step._prepare(a, True)[0], step._prepare(b, True)[0]
    step.m.decode_qnorm = "attn"
    ga2 = step._prepare(a, True)[0]
    assert ga2 is not ga and ga2.qnorm == "attn" and len(step.captures) == 3
    assert step._graphs[b] is gb


def test_the_cache_keeps_no_state_alive(step):
    s = _state()
    step._prepare(s, True)
    ref = weakref.ref(s)
    assert len(step._graphs) == len(step._tables) == 1
    del s
    gc.collect()
    assert ref() is None, "the graph / table cache kept a dropped state alive"
    assert len(step._graphs) == 0 and len(step._tables) == 0


def test_a_rebuilt_table_drops_the_states_graphs(step):
    s = _state()
    step._prepare(s, True)
    del step._tables[s]                  # e.g. a table that must be rebuilt
    step._prepare(s, True)
    assert len(step.tables_built) == 2 and len(step.captures) == 2


def test_eager_and_hostmath_capture_nothing(step):
    s = _state()
    assert step._prepare(s, False)[0] is None
    step.hostmath = True
    assert step._prepare(s, True)[0] is None
    assert step.captures == [] and len(step._graphs) == 0


def test_the_real_table_build_drops_graphs_and_keys_by_state():
    """The production _ensure_tables / _prepare source: weak-keyed by the state, no FIFO bound,
    no id() keys (a reused id could hand a new state a dead state's graphs)."""
    import inspect
    src = inspect.getsource(DeviceStep)
    assert "WeakKeyDictionary()" in src
    assert "id(state)" not in inspect.getsource(DeviceStep._prepare)
    tsrc = inspect.getsource(DeviceStep._ensure_tables)
    assert "self._graphs.pop(state, None)" in tsrc and "self._tables[state] = tabs" in tsrc
    assert ">= 8" not in src


def test_graph_switch_tool_refusals():
    """tools/graph_switch.py refuses its bad arguments, naming them, before importing CuPy."""
    gs = load_tool("graph_switch")
    for argv, msg in ((["--graphs", "4,x"], "--graphs '4,x': expected comma-separated counts"),
                      (["--graphs", "4,0"], "--graphs 4,0: every count must be >= 1"),
                      (["--nodes", "0"], "--nodes 0: expected >= 1"),
                      (["--rounds", "0"], "--rounds 0: expected >= 1 timed rounds")):
        with pytest.raises(SystemExit, match=msg):
            gs.main(argv)
