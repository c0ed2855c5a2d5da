"""Pipelined prefill over 2 stages (memra_dsv4.gpu.pipeline) on two GPUs.

* run_chunk_pipelined (``on``: a host thread per stage) and run_chunk_coop (``coop``: one host
  thread interleaving the stages) == the same chunks run one after another through the chunk
  routine, bit for bit: logits (every row), hc state and every cache of the DecodeState (tiny
  and small, chunk lengths that cross the window, a CSA emit and an HCA emit);
* ``coop`` == ``on`` bit for bit (logits, hc state, caches);
* the seam: with prefill_pipeline="on" / "coop" forward / prefill take the pipelined route for a
  long enough prompt (one boundary copy per chunk), and decode continues from that state;
* an exception in a stage (thread) reaches the caller (no hang), and the model still works.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from test_decode_gpu import _ckpt, _ids  # noqa: E402  (prepend import mode)

from memra_dsv4.gpu.ops.testing import snapshot_diff  # noqa: E402

pytestmark = pytest.mark.gpu

_CACHE: dict = {}


def _two_stage(name):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    from memra_dsv4.gpu.model import Dsv4Gpu
    if name not in _CACHE:
        ck = _ckpt(name)
        _CACHE[name] = (ck, Dsv4Gpu.load(ck, devices=(0, 1), max_seq_len=1024))
    ck, m = _CACHE[name]
    if not all(st.device == d for st, d in zip(m.stages, (0, 1))) or len(m.stages) != 2:
        pytest.skip(f"{name}: the plan did not make 2 stages")
    return ck, m


def _sequential(m, ids, chunks):
    from memra_dsv4.gpu.decode import run_chunk
    st = m.new_state()
    st.reset()
    rows, a = [], 0
    for n in chunks:
        out = run_chunk(m, st, np.asarray(ids[a:a + n], np.int32), all_logits=True, ph="prefill")
        rows.append(out.logits)
        a += n
    return np.concatenate(rows), out.hc_state, st


def _runner(mode):
    from memra_dsv4.gpu import pipeline as PL
    return {"on": PL.run_chunk_pipelined, "coop": PL.run_chunk_coop}[mode]


def _run(m, mode, ids, chunks):
    st = m.new_state()
    st.reset()
    out = _runner(mode)(m, st, np.asarray(ids, np.int32), chunks, all_logits=True)
    assert st.pos == sum(chunks)
    return out, st


@pytest.mark.parametrize("mode", ["on", "coop"])
@pytest.mark.parametrize("name,chunks", [("tiny", [64, 100, 136]), ("tiny", [5, 3, 17, 1]),
                                         ("small", [96, 64, 140])])
def test_pipelined_equals_sequential_chunks_bitwise(name, chunks, mode):
    from memra_dsv4.gpu.pipeline import pipeline_supported
    ck, m = _two_stage(name)
    if not pipeline_supported(m):
        pytest.skip("no peer access between the two GPUs")
    ids = _ids(ck.config, sum(chunks), seed=5)
    want_logits, want_hc, want_st = _sequential(m, ids, chunks)
    out, st = _run(m, mode, ids, chunks)
    assert m.boundary_paths == ["peer"] * len(chunks), m.boundary_paths
    assert out.logits.shape == want_logits.shape
    assert np.array_equal(out.logits, want_logits), (
        f"logits differ at rows {np.nonzero((out.logits != want_logits).any(axis=1))[0][:10]}")
    assert np.array_equal(out.hc_state, want_hc)
    a, b = st.snapshot(), want_st.snapshot()
    assert a.keys() == b.keys()
    bad = snapshot_diff(a, b)
    assert not bad, f"state differs in {bad[:8]}"


@pytest.mark.parametrize("name,chunks", [("tiny", [64, 100, 136]), ("small", [96, 64, 140]),
                                         ("small", [64, 64, 64, 64, 44])])
def test_coop_equals_threaded_bitwise(name, chunks):
    from memra_dsv4.gpu.pipeline import pipeline_supported
    ck, m = _two_stage(name)
    if not pipeline_supported(m):
        pytest.skip("no peer access between the two GPUs")
    ids = _ids(ck.config, sum(chunks), seed=11)
    on, st_on = _run(m, "on", ids, chunks)
    coop, st_coop = _run(m, "coop", ids, chunks)
    assert len(m.boundary_paths) == len(chunks)
    assert coop.logits.shape == on.logits.shape == (sum(chunks), ck.config.vocab_size)
    assert np.array_equal(coop.logits, on.logits)
    assert np.array_equal(coop.hc_state, on.hc_state)
    a, b = st_coop.snapshot(), st_on.snapshot()
    assert a.keys() == b.keys()
    bad = snapshot_diff(a, b)
    assert not bad, f"state differs in {bad[:8]}"
    # without all_logits: the last row only, the same bits
    st = m.new_state()
    st.reset()
    from memra_dsv4.gpu.pipeline import run_chunk_coop
    last = run_chunk_coop(m, st, np.asarray(ids, np.int32), chunks)
    assert last.logits.shape == (ck.config.vocab_size,)
    assert np.array_equal(last.logits, on.logits[-1])


@pytest.mark.parametrize("mode", ["on", "coop"])
def test_seam_routes_forward_and_prefill(monkeypatch, mode):
    from memra_dsv4.gpu import pipeline as PL
    ck, m = _two_stage("tiny")
    if not PL.pipeline_supported(m):
        pytest.skip("no peer access between the two GPUs")
    monkeypatch.setattr(PL, "MIN_CHUNK", 32)
    # 64 (N_CHUNKS - 1) + 8 tokens: N_CHUNKS chunks, the last of 8 (200 tokens at N_CHUNKS = 4)
    ids = _ids(ck.config, 64 * (PL.N_CHUNKS - 1) + 8, seed=9)
    chunks = PL.pipeline_chunks(len(ids), 2)
    assert chunks and len(chunks) == PL.N_CHUNKS
    keep = m.prefill_pipeline
    try:
        m.prefill_pipeline = "off"
        plain = m.forward(ids)
        assert len(m.boundary_paths) == 1
        m.prefill_pipeline = mode
        called = []
        real = PL.run_chunk_coop if mode == "coop" else PL.run_chunk_pipelined

        def spy(*a, **k):
            called.append(mode)
            return real(*a, **k)

        monkeypatch.setattr(PL, "run_chunk_coop" if mode == "coop" else "run_chunk_pipelined", spy)
        piped = m.forward(ids)
        assert called == [mode]
        assert len(m.boundary_paths) == len(chunks)
        want_logits, _, _ = _sequential(m, ids, chunks)
        assert np.array_equal(piped.logits, want_logits[-1])
        # bf16 class against the whole-prompt chunk (other GEMM M): top-1 and a loose L2
        rel = np.linalg.norm(piped.logits - plain.logits) / np.linalg.norm(plain.logits)
        assert rel < 0.5, rel
        # prefill + decode continue from the pipelined state, as from the sequential one
        logits, st = m.prefill(ids)
        assert called == [mode, mode]
        assert np.array_equal(logits, want_logits[-1])
        nxt = int(np.argmax(logits))
        _, _, seq_st = _sequential(m, ids, chunks)
        assert np.array_equal(m.decode_step(st, nxt), m.decode_step(seq_st, nxt))
    finally:
        m.prefill_pipeline = keep


@pytest.mark.parametrize("mode", ["on", "coop"])
def test_stage_error_reaches_the_caller(monkeypatch, mode):
    from memra_dsv4.gpu import decode as D
    from memra_dsv4.gpu.pipeline import pipeline_supported
    ck, m = _two_stage("tiny")
    if not pipeline_supported(m):
        pytest.skip("no peer access between the two GPUs")
    ids = np.asarray(_ids(ck.config, 90, seed=3), np.int32)
    real = D.ChunkBlock.forward
    stage1_layers = set(m.stages[1].layers)

    def boom(self, streams, ids_d, cache, p0, *args, **kwargs):   # forward's signature, whatever
        if self.b.lid in stage1_layers and p0 > 0:                  # keywords it grows (bits_out)
            raise RuntimeError("injected stage-1 failure")
        return real(self, streams, ids_d, cache, p0, *args, **kwargs)

    monkeypatch.setattr(D.ChunkBlock, "forward", boom)
    st = m.new_state()
    st.reset()
    with pytest.raises(RuntimeError, match="injected stage-1 failure"):
        _runner(mode)(m, st, ids, [30, 30, 30])
    monkeypatch.setattr(D.ChunkBlock, "forward", real)
    assert int(np.argmax(m.forward(ids[:10]).logits)) >= 0   # still usable
