"""CPU checks of the GPU DSpark drafter's wiring (gpu.dspark.GpuDSparkDrafter) on the recording
stand-in for CuPy of tests/test_block_host_ops_cpu.py (every GPU kernel a stub whose output is a
hash of the bytes it read), with tiny's DSpark variant (W = 8, B = 5, taps = layers 1..3):

* a round reads only the drafter's tensors (``mtp.0..2.*``: main_proj / main_norm of stage 0, the
  three blocks, stage 2's hc_head / norm / Markov and confidence heads) plus the trunk's
  embedding and head matrix, never a trunk layer's;
* ``write_context`` writes the ring rows of the positions given (only the last W of a longer
  write), and a draft leaves the rings as they were (its block rows never reach them);
* ``propose`` returns min(k, B) drafts and their confidence logits, reading back one [V] row per
  draft of the block and the B confidence logits once;
* refused calls (the shared checks, non-finite rows) leave the rings and n_ctx as they were.
The numbers themselves: tests/gpu/test_dspark_gpu.py against the oracle.
"""
from __future__ import annotations

import numpy as np
import pytest

import test_block_host_ops_cpu as H   # prepend import mode: the harness modules
import test_drafter_harness_cpu as DH


@pytest.fixture
def harness(monkeypatch):
    from memra_dsv4.config import preset
    from memra_dsv4.synth import with_drafter
    cfg = with_drafter(preset("tiny"), "dspark")
    return (cfg,) + DH.make_harness(monkeypatch, cfg)


def _taps(cfg, m, seed):
    x = H._fill((m, 3, cfg.hc_mult, cfg.hidden_size), np.float32, H._seed("taps", seed))
    return H._store(x)


def _rings(d):
    return [np.array(d.state.cache(lid).ring) for lid in d.lids]


def test_reads_only_the_drafters_tensors(harness):
    from memra_dsv4.gpu.dspark import GpuDSparkDrafter
    cfg, m, st, reads, asnumpy = harness
    d = GpuDSparkDrafter()
    assert d.trunk_taps(m) == (1, 2, 3)
    d.begin(m, 64)
    assert d.lids == (4, 5, 6) and d.n_ctx == 0
    toks, lg = d.propose(_taps(cfg, 6, 1), [3, 4, 5, 6, 7, 8], 9)   # k > B: B drafts
    B = cfg.dspark_block_size
    assert toks.shape == (B,) and toks.dtype == np.int64 and lg.shape == (B, cfg.vocab_size)
    assert d.last_confidence.shape == (B,) and d.n_ctx == 6
    names = set(reads)
    for leaf in ("main_proj.weight", "main_norm.weight"):
        assert f"mtp.0.{leaf}" in names and f"mtp.1.{leaf}" not in names, leaf
    for s in range(3):
        for leaf in ("attn.wq_a.weight", "attn.wkv.weight", "attn.attn_sink", "attn.wo_b.weight",
                     "ffn.gate.weight", "ffn.shared_experts.w2.weight", "hc_attn_fn",
                     "hc_ffn_fn"):
            assert f"mtp.{s}.{leaf}" in names, (s, leaf)
    for leaf in ("hc_head_fn", "norm.weight", "markov_head.markov_w1",
                 "markov_head.markov_w2", "confidence_head.proj"):
        assert f"mtp.2.{leaf}" in names, leaf
    assert {"embed.weight", "head.weight"} <= names
    assert not [r for r in names if r.startswith("layers.")]
    assert "norm.weight" not in names and "hc_head_fn" not in names   # not the trunk's head group
    # one [V] readback per draft of the block, the confidences once, nothing else
    assert asnumpy == [(cfg.vocab_size,)] * B + [(B,)]
    assert np.isfinite(d.last_confidence).all() and np.isfinite(lg).all()
    assert [int(t) for t in toks] == [int(np.argmax(r)) for r in lg]   # the greedy default
    k2, _ = d.propose(_taps(cfg, 2, 2), [9, 10], 2)
    assert k2.shape == (2,) and d.last_confidence.shape == (2,) and d.n_ctx == 8


def test_context_rows_and_drafts_leave_the_rings(harness):
    from memra_dsv4.gpu.dspark import GpuDSparkDrafter
    cfg, m, *_ = harness
    W = cfg.sliding_window
    d = GpuDSparkDrafter()
    d.begin(m, 64)
    zero = _rings(d)
    d.write_context(_taps(cfg, 3, 5))
    r3 = _rings(d)
    for a, b in zip(zero, r3):   # slots 0..2 written, the others untouched
        assert np.array_equal(a[3:], b[3:]) and not any(np.array_equal(a[i], b[i])
                                                         for i in range(3))
    draft = d.draft(7)
    assert draft.start_pos == 2 and draft.base_logits.shape == (cfg.dspark_block_size,
                                                                cfg.vocab_size)
    assert all(np.array_equal(a, b) for a, b in zip(r3, _rings(d)))   # drafts never write
    # a write longer than W: positions 3..3+W+2, only the last W rows computed (every slot)
    d.write_context(_taps(cfg, W + 3, 6))
    assert d.n_ctx == W + 6
    assert all(not np.array_equal(a[i], b[i]) for a, b in zip(r3, _rings(d)) for i in range(W))


def test_refused_calls_leave_the_state(harness):
    from memra_dsv4.gpu.dspark import GpuDSparkDrafter
    cfg, m, *_ = harness
    d = GpuDSparkDrafter()
    with pytest.raises(ValueError, match="before begin"):
        d.propose(_taps(cfg, 1, 0), [1], 1)
    with pytest.raises(ValueError, match="before begin"):
        d.draft(1)
    d.begin(m, 8)
    with pytest.raises(ValueError, match="no context rows"):
        d.draft(1)
    d.propose(_taps(cfg, 2, 3), [1, 2], 1)
    rings = _rings(d)
    bad = _taps(cfg, 2, 4)
    bad[1, 0, 0, 0] = np.nan
    for args, msg in [((_taps(cfg, 2, 4), [1], 1), "next_tokens has 1 entries"),
                      ((_taps(cfg, 2, 4), [1, 2], 99), "k = 99"),
                      ((_taps(cfg, 2, 4), [1, 2], 0), "k = 0"),
                      ((_taps(cfg, 2, 4), [1, 512], 1), "outside the vocabulary"),
                      ((_taps(cfg, 2, 4)[:, :2], [1, 2], 1), "tap_rows must be"),
                      ((_taps(cfg, 7, 4), list(range(1, 8)), 3), "positions up to 8 exceed "
                                                                  "max_seq_len 8"),
                      ((bad, [1, 2], 1), "finite")]:
        with pytest.raises(ValueError, match=msg):
            d.propose(*args)
        assert d.n_ctx == 2 and all(np.array_equal(a, b) for a, b in zip(rings, _rings(d))), msg
    with pytest.raises(ValueError, match="anchor|outside the vocabulary"):
        d.draft(cfg.vocab_size)
    import types
    with pytest.raises(ValueError, match="holds no drafter"):
        GpuDSparkDrafter().begin(types.SimpleNamespace(drafter_stage=None, config=cfg), 8)
