"""CPU checks of the GPU MTP drafter's wiring (gpu.drafters.GpuMtpDrafter) on the recording
stand-in for CuPy of tests/test_block_host_ops_cpu.py (every GPU kernel a stub whose output is a
hash of the bytes it read):

* the MTP block reads only the drafter's tensors (``mtp.0.*``: e_proj / h_proj / enorm / hnorm,
  the block, its own hc_head and norm) plus the trunk's embedding and head matrix, never a trunk
  layer's, and through ``Dsv4Gpu._head(prefix="mtp.0.")``;
* ``propose`` advances the drafter's state by the m rows given, and the recursive drafts (k > 1)
  run on the scratch copy: the state after a k = 3 call has the same bytes as after a k = 1 call
  of the same rows, and its first draft row is the same;
* refused calls (the shared checks, non-finite rows) leave the state as it was;
* the logits of the last row only are read back, once per draft.
The numbers themselves: tests/gpu/test_drafter_gpu.py against the oracle.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import test_block_host_ops_cpu as H   # prepend import mode: the harness module


class _Compute:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Devs:
    """runtime.Devices' surface the drafter uses: devs[d].compute, order_after_current()."""

    def __getitem__(self, d):
        return types.SimpleNamespace(compute=_Compute())

    def order_after_current(self) -> None:
        pass


def _model(monkeypatch, cfg):
    """The harness's model stand-in (test_block_host_ops_cpu._model) made a Dsv4Gpu one with the
    drafter: its stage also holds the trunk's embedding / head and the MTP block's tensors
    (hash-filled), the real _head is bound to it, and name reads are recorded."""
    from memra_dsv4.gpu import model as M
    from memra_dsv4.gpu.weights import StageWeights, _stage_specs
    m, st = H._model(cfg)
    n = cfg.num_hidden_layers
    st.has_embed = st.has_head = True
    st.drafter_layers = range(n, n + cfg.num_drafter_stages)   # MTP: 1, DSpark: 3
    for spec in _stage_specs(cfg, range(0), True, True, drafter=st.drafter_layers):
        if spec.kind in ("e8m0", "e4m3") or ".ffn.experts." in spec.name:
            continue   # no FP8 sidecars (dense bf16); the routed experts are a stub
        s = H._seed("weight", spec.name)
        st._put(spec.name, H._fill(spec.shape, np.float32 if spec.kind == "f32" else np.uint16, s))
    for lid in st.drafter_layers:
        st.expert_fmt[lid] = "mxfp4"
    reads = []
    get0 = StageWeights.__getitem__
    monkeypatch.setattr(StageWeights, "__getitem__",
                        lambda self, name: (reads.append(name), get0(self, name))[1])
    m.stages, m.drafter_stage, m.max_seq_len, m.devs = [st], 0, 64, _Devs()
    m._cp = sys.modules["cupy"]
    m._head = types.MethodType(M.Dsv4Gpu._head, m)
    return m, st, reads


def make_harness(monkeypatch, cfg):
    """(m, st, reads, asnumpy): the recording CuPy installed and the model stand-in of ``cfg``
    (its drafter's stages held); ``asnumpy`` lists the shapes read back."""
    from memra_dsv4.gpu import model as M
    fake = H._fake_cupy()
    fake.sqrt = lambda a: H._dev(np.sqrt(np.abs(a)))   # the stubs' means: any sign
    fake.isfinite = lambda a: H._dev(np.isfinite(a))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(H._Arr, "device", property(lambda self: types.SimpleNamespace(id=0)),
                        raising=False)
    H._install_stubs(monkeypatch)
    monkeypatch.setattr(M._Block, "routed_experts",
                        lambda self, x, idx, wts, shared: M.routed_moe(
                            self.g, x, idx, wts, {}, "mxfp4", self.cfg.swiglu_limit, shared))
    asnumpy = []
    fake.asnumpy = lambda a: (asnumpy.append(np.shape(a)), np.array(a))[1]
    m, st, reads = _model(monkeypatch, cfg)
    return m, st, reads, asnumpy


@pytest.fixture
def harness(monkeypatch):
    from memra_dsv4.config import preset
    cfg = preset("tiny")
    return (cfg,) + make_harness(monkeypatch, cfg)


def _rows(cfg, m, seed):
    x = H._fill((m, cfg.hc_mult, cfg.hidden_size), np.float32, H._seed("rows", seed))
    return H._store(x)


def test_reads_only_the_drafters_tensors_and_the_shared_head(harness):
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    cfg, m, st, reads, asnumpy = harness
    d = GpuMtpDrafter()
    d.begin(m, 64)
    H.LOG.clear()
    toks, lg = d.propose(_rows(cfg, 5, 1), [3, 4, 5, 6, 7], 2)
    assert toks.shape == (2,) and toks.dtype == np.int64
    assert lg.shape == (2, cfg.vocab_size) and d.state.pos == 5 and d._scratch.pos == 6
    names = set(reads)
    for leaf in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "hc_head_fn",
                 "hc_head_scale", "hc_head_base", "norm.weight", "attn.wq_a.weight",
                 "attn.wkv.weight", "attn.attn_sink", "ffn.gate.weight", "ffn.gate.bias",
                 "ffn.shared_experts.w2.weight", "hc_attn_fn", "hc_ffn_fn"):
        assert f"mtp.0.{leaf}" in names, leaf
    assert {"embed.weight", "head.weight"} <= names
    assert not [r for r in names if r.startswith("layers.")]
    assert "norm.weight" not in names and "hc_head_fn" not in names   # not the trunk's head group
    # one readback per draft, each the last row's logits only
    assert asnumpy == [(cfg.vocab_size,)] * 2
    assert sum(1 for name, _ in H.LOG if name == "gemm") > 0


def test_recursion_runs_on_the_scratch_copy(harness):
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    cfg, m, *_ = harness
    rows, nxt = _rows(cfg, 6, 2), [9, 8, 7, 6, 5, 4]
    a, b = GpuMtpDrafter(), GpuMtpDrafter()
    a.begin(m, 64)
    b.begin(m, 64)
    ta, la = a.propose(rows[:4], nxt[:4], 1)
    tb, lb = b.propose(rows[:4], nxt[:4], 3)
    assert ta[0] == tb[0] and np.array_equal(la[0], lb[0])
    assert a.state.pos == b.state.pos == 4
    assert np.array_equal(np.asarray(a.state.layers[0].ring), np.asarray(b.state.layers[0].ring))
    assert not np.array_equal(np.asarray(b._scratch.layers[0].ring),
                              np.asarray(b.state.layers[0].ring))   # the drafts' rows went there
    # the next call continues from the state, not from the scratch: same as a's
    ta2, la2 = a.propose(rows[4:], nxt[4:], 1)
    tb2, lb2 = b.propose(rows[4:], nxt[4:], 1)
    assert np.array_equal(la2, lb2) and a.state.pos == 6


def test_refused_calls_leave_the_state(harness):
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    cfg, m, *_ = harness
    d = GpuMtpDrafter()
    with pytest.raises(ValueError, match="before begin"):
        d.propose(_rows(cfg, 1, 0), [1], 1)
    d.begin(m, 8)
    d.propose(_rows(cfg, 2, 3), [1, 2], 1)
    ring = np.array(d.state.layers[0].ring)
    bad_rows = _rows(cfg, 2, 4)
    bad_rows[1, 0, 0] = np.nan
    for args, msg in [((_rows(cfg, 2, 4), [1], 1), "next_tokens has 1 entries"),
                      ((_rows(cfg, 2, 4), [1, 2], 99), "k = 99"),
                      ((_rows(cfg, 2, 4), [1, 512], 1), "outside the vocabulary"),
                      ((_rows(cfg, 5, 4), [1, 2, 3, 4, 5], 3), "positions up to 8 exceed max_seq_len 8"),
                      ((bad_rows, [1, 2], 1), "non-finite")]:
        with pytest.raises(ValueError, match=msg):
            d.propose(*args)
        assert d.state.pos == 2 and np.array_equal(np.array(d.state.layers[0].ring), ring), msg
    no = types.SimpleNamespace(drafter_stage=None)
    with pytest.raises(ValueError, match="drafter=True"):
        GpuMtpDrafter().begin(no, 8)
