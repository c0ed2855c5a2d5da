"""The cooperative (one host thread) pipelined prefill, CPU side (no CuPy):

* ``gpu.pipeline.coop_schedule``: each stage's chunks in order, stage s chunk j never before stage
  s - 1 has finished (enqueued) chunk j, one step per stage in turn, results, errors;
* the seam value ``coop`` (allowed values, default ``off``) and the model's routing;
* ``gpu.decode.stage_steps`` / ``run_stage`` on a NumPy stand-in for CuPy: run_stage keeps one
  ``{ph}/stage{si}`` bracket around the embed / block / head brackets, and with ``step_bracket``
  nothing (bracket, device, stream) is held open across a yield.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from memra_dsv4 import seams
from memra_dsv4.gpu import pipeline as PL


# ------------------------------------------------------------------------------ the schedule
def _recording(n_steps, log, started=None, fail_at=None, closed=None):
    """start(s, j): a generator of n_steps(s) steps logging (s, j, k) per step and (s, j, "end")
    in its last ``next`` (the code after the last yield: the hand-off), returning (s, j)."""
    def start(s, j):
        if started is not None:
            started.append((s, j))

        def gen():
            try:
                for k in range(n_steps(s)):
                    if fail_at == (s, j, k):
                        log.append((s, j, "fail"))
                        raise RuntimeError(f"boom at {(s, j, k)}")
                    log.append((s, j, k))
                    yield
                log.append((s, j, "end"))
                return (s, j)
            finally:
                if closed is not None:
                    closed.append((s, j))
        return gen()
    return start


def _check_order(log, n_stages, n_chunks):
    pos = {e: i for i, e in enumerate(log)}
    assert len(pos) == len(log)
    for s in range(n_stages):
        mine = [e for e in log if e[0] == s]
        # the stage's chunks in order, each whole before the next starts
        assert [e[1] for e in mine] == sorted(e[1] for e in mine)
        for j in range(n_chunks):
            steps = [e[2] for e in mine if e[1] == j]
            assert steps[-1] == "end" and steps[:-1] == list(range(len(steps) - 1))
            if s > 0:   # never before the producer has enqueued that chunk
                first = min(i for e, i in pos.items() if e[:2] == (s, j))
                assert first > pos[(s - 1, j, "end")]


def test_schedule_two_stages_three_chunks_round_robin():
    log: list = []
    started: list = []
    res = PL.coop_schedule(2, 3, _recording(lambda s: 3, log, started))
    assert res == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    _check_order(log, 2, 3)
    # start() is called lazily, in dependency order
    assert started == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # stage 0's chunk 0 alone (4 steps: 3 layers + its end); stage 1 starts its chunk 0 in the
    # turn right after that end; strict alternation while both have work; stage 1 drains alone
    assert [e[0] for e in log[:4]] == [0] * 4 and log[3] == (0, 0, "end")
    assert log[4:6] == [(1, 0, 0), (0, 1, 0)]
    assert [e[0] for e in log[4:20]] == [1, 0] * 8
    assert all(e[0] == 1 for e in log[20:]) and len(log) == 24
    _check_round_robin(log, 2, 3)


@pytest.mark.parametrize("n_stages,n_chunks", [(2, 1), (2, 4), (3, 3), (4, 2)])
def test_schedule_uneven_steps(n_stages, n_chunks):
    log: list = []
    steps = {0: 2, 1: 5, 2: 1, 3: 3}
    res = PL.coop_schedule(n_stages, n_chunks, _recording(lambda s: steps[s], log))
    assert res == [[(s, j) for j in range(n_chunks)] for s in range(n_stages)]
    _check_order(log, n_stages, n_chunks)
    assert len(log) == n_chunks * sum(steps[s] + 1 for s in range(n_stages))
    _check_round_robin(log, n_stages, n_chunks)


def _check_round_robin(log, n_stages, n_chunks):
    """Replaying the log: whenever a stage takes two steps in a row, every other stage had
    nothing it could run (no chunk under way, and its next chunk not yet startable)."""
    done = [0] * n_stages
    running = [False] * n_stages
    prev = None
    for s, j, k in log:
        if prev == s:
            for b in range(n_stages):
                if b != s:
                    startable = done[b] < n_chunks and (b == 0 or done[b - 1] > done[b])
                    assert not running[b] and not startable, (log, s, j, k, b)
        running[s] = k != "end"
        if k == "end":
            done[s] += 1
        prev = s


def test_schedule_error_stops_everything():
    log: list = []
    started: list = []
    closed: list = []
    with pytest.raises(RuntimeError, match=r"boom at \(1, 1, 1\)"):
        PL.coop_schedule(2, 3, _recording(lambda s: 3, log, started, fail_at=(1, 1, 1),
                                          closed=closed))
    assert log[-1] == (1, 1, "fail")     # nothing ran after the failing step
    assert (0, 2) in started             # stage 0 was running its chunk 2 ...
    assert (0, 2, "end") not in log
    assert (0, 2) in closed and (1, 1) in closed   # ... and is closed, not stepped further
    assert (1, 2) not in started


def test_schedule_error_in_start_propagates():
    def start(s, j):
        if (s, j) == (1, 0):
            raise ValueError("cannot start")
        return iter(())
    with pytest.raises(ValueError, match="cannot start"):
        PL.coop_schedule(2, 2, start)


# ------------------------------------------------------------------------------ the seam
def test_seam_allows_coop_default_coop(monkeypatch):
    s = seams.SEAMS["prefill_pipeline"]
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_PREFILL_PIPELINE", "coop",
                                             ("off", "on", "coop"))
    monkeypatch.delenv("MEMRA_DSV4_PREFILL_PIPELINE", raising=False)
    assert seams.resolve("prefill_pipeline") == "coop"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_PIPELINE", "off")
    assert seams.resolve("prefill_pipeline") == "off"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_PIPELINE", "coop")
    assert seams.resolve("prefill_pipeline") == "coop"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_PIPELINE", "threads")
    with pytest.raises(ValueError, match="'threads'.*off, on, coop"):
        seams.resolve("prefill_pipeline")
    assert "`coop`" in seams.seam_table_markdown()


def test_model_plans_and_routes_coop():
    from memra_dsv4.gpu.model import Dsv4Gpu
    two = [types.SimpleNamespace(device=0), types.SimpleNamespace(device=0)]   # no peer query
    for value, planned in (("off", False), ("on", True), ("coop", True)):
        m = types.SimpleNamespace(prefill_pipeline=value, force_bounce=False, stages=two)
        plan = Dsv4Gpu._pipeline_plan(m, 8192)
        assert (plan == PL.pipeline_chunks(8192, 2)) if planned else plan is None, value
    m = types.SimpleNamespace(prefill_pipeline="coop")
    assert Dsv4Gpu._pipeline_runner(m) is PL.run_chunk_coop
    m.prefill_pipeline = "on"
    assert Dsv4Gpu._pipeline_runner(m) is PL.run_chunk_pipelined


def test_bench_arms_take_coop():
    from bench.prefill import parse_arms
    assert parse_arms("pipeline=coop+chunks=2,pipeline=on") == [
        ("pipeline=coop+chunks=2", {"pipeline": "coop", "chunks": "2"}),
        ("pipeline=on", {"pipeline": "on"})]


# ------------------------------------------------------------------------------ stage_steps
class _Ctx:
    def __init__(self, name, held):
        self.name, self.held = name, held

    def __enter__(self):
        self.held.append(self.name)
        return self

    def __exit__(self, *a):
        assert self.held.pop() == self.name
        return False


@pytest.fixture
def fake_stage(monkeypatch):
    """A NumPy stand-in for CuPy and a 2-stage model with 3 + 2 layers; logs every layer's
    forward with the contexts held at that moment."""
    from memra_dsv4.gpu import decode as D
    from memra_dsv4.gpu import model as M
    from memra_dsv4.profiling import prof_configure
    held: list = []
    calls: list = []
    fake = types.ModuleType("cupy")
    fake.asarray = np.asarray
    fake.asnumpy = lambda a: np.array(a)
    fake.ascontiguousarray = np.ascontiguousarray
    fake.broadcast_to = np.broadcast_to
    fake.uint16 = np.uint16
    fake.cuda = types.SimpleNamespace(Device=lambda d: _Ctx(f"dev{d}", held))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(M, "_f32", lambda x: np.asarray(x, np.float32))

    def fwd(self, streams, ids_d, cache, p0, c=None, journal=None, bits_out=False):
        calls.append(("layer", self.layer, tuple(held)))
        return streams + 1.0

    class Block:
        def __init__(self, model, st, layer, ph):
            self.layer = layer
        forward = fwd

    monkeypatch.setattr(D, "ChunkBlock", Block)
    cfg = types.SimpleNamespace(hc_mult=2, hidden_size=3)

    class Stage(dict):
        pass

    s0 = Stage({"embed.weight": np.arange(30, dtype=np.float32).reshape(10, 3)})
    s0.device, s0.has_embed, s0.has_head, s0.layers = 0, True, False, [0, 1, 2]
    s1 = Stage()
    s1.device, s1.has_embed, s1.has_head, s1.layers = 1, False, True, [3, 4]

    def head(st, rows, all_rows=False):
        calls.append(("head", tuple(held)))
        return rows.sum(axis=(1, 2)), None, None

    model = types.SimpleNamespace(
        config=cfg, stages=[s0, s1],
        devs={0: types.SimpleNamespace(compute=_Ctx("s0", held)),
              1: types.SimpleNamespace(compute=_Ctx("s1", held))},
        _head=head)
    state = types.SimpleNamespace(cache=lambda layer: None, max_seq_len=16)

    class Domain:
        def __init__(self):
            self.log = []

        def get_event_attributes(self, message=None, color=None, category=None, payload=None):
            return message

        def push_range(self, attributes=None):
            self.log.append(("push", attributes))
            held.append(attributes)

        def pop_range(self):
            self.log.append(("pop", held.pop()))

    dom = Domain()
    prof_configure("nvtx", nvtx_domain=dom)
    yield types.SimpleNamespace(model=model, state=state, held=held, calls=calls, dom=dom)
    prof_configure("off")


def test_run_stage_keeps_its_brackets(fake_stage):
    from memra_dsv4.gpu.decode import run_stage
    f = fake_stage
    ids = np.array([1, 2, 3])
    streams, lg, hs = run_stage(f.model, 0, f.state, ids, 0, None, ph="prefill", head=True)
    assert lg is None and hs is None and streams.shape == (3, 2, 3)
    assert [c[1] for c in f.calls] == [0, 1, 2]
    # every layer ran inside the stage's one outer bracket and its block bracket
    assert f.calls[0][2][:3] == ("dev0", "s0", "prefill/stage0")
    assert f.calls[0][2][-1] == "prefill/stage0/block"
    pushes = [a for k, a in f.dom.log if k == "push"]
    assert pushes == ["prefill/stage0", "prefill/stage0/embed"] + ["prefill/stage0/block"] * 3
    assert f.dom.log[-1] == ("pop", "prefill/stage0") and f.held == []
    f.dom.log.clear()
    out, lg, hs = run_stage(f.model, 1, f.state, ids, 0, streams, ph="prefill", head=True)
    pushes = [a for k, a in f.dom.log if k == "push"]
    assert pushes == ["prefill/stage1"] + ["prefill/stage1/block"] * 2 + ["prefill/stage1/head"]
    assert isinstance(lg, np.ndarray) and lg.shape == (1,) and hs.shape == (2, 3)
    assert np.array_equal(out, streams + 2.0) and f.held == []


def test_stage_steps_hold_nothing_across_a_yield(fake_stage):
    from memra_dsv4.gpu.decode import run_stage, stage_steps
    f = fake_stage
    ids = np.array([4, 5])
    want = run_stage(f.model, 0, f.state, ids, 0, None, ph="p", head=True)[0]
    want1 = run_stage(f.model, 1, f.state, ids, 0, want, ph="p", head=True, all_logits=True)
    f.dom.log.clear()
    f.calls.clear()
    for si, inp, n_steps in ((0, None, 4), (1, want, 3)):
        gen = stage_steps(f.model, si, f.state, ids, 0, inp, ph="p", head=True,
                          all_logits=True, step_bracket=True, readback=False)
        n = 0
        while True:
            try:
                next(gen)
            except StopIteration as fin:
                result = fin.value
                break
            n += 1
            assert f.held == [], f.held   # no device, stream or bracket open across the yield
        assert n == n_steps
    assert np.array_equal(result[0], want1[0]) and np.array_equal(result[1], want1[1])
    # each step bracketed on its own: stage 0 = embed + 3 layers, stage 1 = ids upload + 2 layers
    # + head (the step after its last yield)
    pushes = [a for k, a in f.dom.log if k == "push"]
    assert pushes.count("p/stage0") == 4 and pushes.count("p/stage1") == 4
    for c in f.calls:
        ctx = c[-1]
        assert ctx[:3] in (("dev0", "s0", "p/stage0"), ("dev1", "s1", "p/stage1")), ctx
