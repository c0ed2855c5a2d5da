"""The CPU side of the GPU drafter: which drafter layers the GPU path loads and where
(gpu.weights.drafter_layers / weight_plan(drafter=True) / load_stage_weights(drafter_layers=)),
the shared checks of an MTP propose (oracle.spec.check_propose_args) and of a speculative call
(check_spec_args), and the loop's target interface (oracle.spec.spec_loop) on a scripted target.
The GPU drafter itself: tests/gpu/test_drafter_gpu.py."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.gpu.weights import drafter_layers, load_stage_weights, weight_plan
from memra_dsv4.oracle.spec import check_propose_args, check_spec_args, spec_loop
from memra_dsv4.placement import plan_split
from memra_dsv4.synth import synth_arrays


def test_drafter_layers_and_refusals():
    tiny = preset("tiny")
    assert drafter_layers(tiny, False) == range(0)
    assert drafter_layers(tiny, True) == range(4, 5)
    assert drafter_layers(preset("flash"), True) == range(43, 44)
    assert drafter_layers(preset("flash-0731"), True) == range(43, 46)   # DSpark: mtp.0..2
    assert drafter_layers(preset("flash-0731"), False) == range(0)
    none = dataclasses.replace(tiny, num_nextn_predict_layers=0, compress_ratios=(0, 4, 16, 4),
                               name="tiny-nodrafter")
    assert none.drafter_kind == "none"
    with pytest.raises(ValueError, match="has no drafter"):
        drafter_layers(none, True)


def test_weight_plan_counts_the_drafter_on_the_last_stage():
    cfg = preset("flash")
    with_d = weight_plan(cfg, 2, drafter=True)
    without = weight_plan(cfg, 2)
    assert without == weight_plan(cfg, 2, drafter=False)
    want = plan_split(cfg, 2, dense="bf16", include_drafter=True, device_bytes=1 << 50)
    assert with_d == [(i, s.layers, s.has_embed, s.has_head) for i, s in enumerate(want.stages)]
    # the drafter (~7 GB on Flash) lands on the last stage, so the cut moves earlier
    assert with_d[0][1].stop <= without[0][1].stop
    assert with_d[-1][3] and not with_d[0][3]


def test_load_stage_weights_takes_the_mtp_tensors():
    cfg = preset("tiny")
    ck = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=3))
    sw = load_stage_weights(ck, 0, range(4), True, True, upload=np.asarray,
                            drafter_layers=range(4, 5))
    trunk = load_stage_weights(ck, 0, range(4), True, True, upload=np.asarray)
    mtp = sorted(n for n in sw.t if n.startswith("mtp.0."))
    assert not any(n.startswith("mtp.") for n in trunk.t)
    assert set(sw.t) - set(trunk.t) == set(mtp)
    for leaf in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
                 "hc_head_fn", "attn.wq_a.weight", "ffn.experts.w1.packed", "ffn.gate.weight"):
        assert f"mtp.0.{leaf}" in sw.t, leaf
    assert sw.expert_fmt[4] == "mxfp4" and sw.drafter_layers == range(4, 5)
    assert sw.layers == range(4)          # the trunk loop never sees the drafter
    np.testing.assert_array_equal(sw.t["mtp.0.enorm.weight"],
                                  np.asarray(ck.raw("mtp.0.enorm.weight")).view(np.uint16))


def test_check_propose_args_messages():
    cfg = preset("tiny")
    hc, D = cfg.hc_mult, cfg.hidden_size
    ids = check_propose_args(cfg, 0, 16, (2, hc, D), "f", [1, 2], 3)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2]
    bad = [((0, 16, (2, hc, D), "i", [1, 2], 1), "floating point"),
           ((0, 16, (2, hc, D + 1), "f", [1, 2], 1), r"hc_rows must be \[m >= 1"),
           ((0, 16, (0, hc, D), "f", [], 1), r"hc_rows must be \[m >= 1"),
           ((0, 16, (2, hc, D), "f", [1], 1), "next_tokens has 1 entries"),
           ((0, 16, (2, hc, D), "f", [1, 512], 1), "outside the vocabulary"),
           ((0, 16, (2, hc, D), "f", [1, 2], 0), "k = 0"),
           ((0, 16, (2, hc, D), "f", [1, 2], True), "k = True"),
           ((14, 16, (2, hc, D), "f", [1, 2], 2), "positions up to 16 exceed max_seq_len 16")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            check_propose_args(cfg, *args)


def test_check_spec_args():
    n, sampled, probs, gen = check_spec_args(5, 2, 0.0, 1.0, None, object(), None)
    assert (n, sampled, gen) == (5, False, None)
    _, sampled, _, gen = check_spec_args(5, 2, 0.7, 0.9, None, object(), None)
    assert sampled and isinstance(gen, np.random.Generator)
    for args, msg in [((0, 2, 0.0, 1.0), "max_new_tokens"), ((5, 0, 0.0, 1.0), "k = 0"),
                      ((5, 2, -1.0, 1.0), "temperature"), ((5, 2, 1.0, 0.0), "top_p")]:
        with pytest.raises(ValueError, match=msg):
            check_spec_args(*args, None, object(), None)
    with pytest.raises(ValueError, match="cost function"):
        check_spec_args(5, 2, 0.0, 1.0, None, object(), 3)
    with pytest.raises(ValueError, match="reports no confidences"):
        check_spec_args(5, 2, 0.0, 1.0, None, object(), lambda t: 1.0)


class _ScriptedTarget:
    """TEST DOUBLE of spec_loop's target: position p's greedy next token is seq[p + 1] (one-hot
    logits); records the calls.  rows are the positions' indices (what a drafter would get)."""

    class _State:
        max_seq_len = 64

    def __init__(self, seq, V=16):
        self.seq, self.V, self.pos, self.calls = list(seq), V, 0, []
        self.model, self.state = "target", self._State()

    def _logits(self, p):
        lg = np.zeros(self.V)
        lg[self.seq[p + 1]] = 1.0
        return lg

    def prefill(self, prompt):
        self.pos = len(prompt)
        self.calls.append(("prefill", len(prompt)))
        return self._logits(self.pos - 1), np.arange(self.pos)

    def verify(self, tokens):
        p0 = self.pos
        self.calls.append(("verify", len(tokens)))
        return np.stack([self._logits(p0 + i) for i in range(len(tokens))]), \
            np.arange(p0, p0 + len(tokens))

    def commit(self, n):
        self.calls.append(("commit", n))
        self.pos += n + 1

    def decode_step(self, token):
        self.calls.append(("decode", int(token)))
        self.pos += 1
        return self._logits(self.pos - 1)


class _RowsDrafter:
    """TEST DOUBLE: checks the rows / next tokens the loop hands over; drafts the true tokens,
    the second one of every round wrong."""

    def __init__(self, seq):
        self.seq = seq

    def begin(self, model, max_seq_len):
        assert model == "target" and max_seq_len == 64
        self.next_row = 0

    def propose(self, rows, next_tokens, k, sampler=None):
        rows = list(rows)
        assert rows == list(range(self.next_row, self.next_row + len(rows)))
        assert list(next_tokens) == self.seq[rows[0] + 1:rows[-1] + 2]
        self.next_row = rows[-1] + 1
        d = list(self.seq[self.next_row + 1:self.next_row + 1 + k])
        if len(d) > 1:
            d[1] = (d[1] + 1) % 16
        return np.array(d, np.int64), None


def test_spec_loop_drives_a_target():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]
    prompt, n = seq[:4], 12
    t = _ScriptedTarget(seq)
    _, _, probs, _ = check_spec_args(n, 3, 0.0, 1.0, None, object(), None)
    res = spec_loop(t, _RowsDrafter(seq), prompt, n, 3, False, probs, None)
    assert res.tokens == seq[4:4 + n]
    assert res.accepted == [1] * len(res.accepted) and set(res.drafted) <= {1, 2, 3}
    assert t.calls[0] == ("prefill", 4) and t.pos in (4 + n - 1, 4 + n)


def test_spec_cost_bench_refuses_before_any_gpu_work():
    from bench import spec_cost
    assert spec_cost._ints("1,2,3") == [1, 2, 3]
    for argv, msg in [(["--tmax", "0"], "--tmax 0"), (["--tmax", "1"], r"--tmax 1: must be in 2\.\."), (["--mtp-k", "0,1"], "integers >= 1"),
                      (["--mtp-k", "a"], "comma-separated"), (["--model", "/x"], "synthetic"),
                      (["--ctx", "100"], "multiple of 128"),
                      (["--verify-paths", "chunk,graph"], "subset of chunk,device"),
                      (["--verify-paths", ","], "subset of chunk,device")]:
        with pytest.raises(SystemExit, match=msg):
            spec_cost.main(argv)


class _FakeGpuModel:
    """TEST DOUBLE of the Dsv4Gpu surface gpu.spec uses (greedy next token of position p is
    seq[p + 1]); its methods take the real ones' keyword arguments (checked below)."""

    def __init__(self, seq, V=16):
        self.seq, self.V = list(seq), V
        self.config = types.SimpleNamespace(vocab_size=V)
        self.calls = []

    def _lg(self, p):
        lg = np.zeros(self.V, np.float32)
        lg[self.seq[p + 1]] = 1.0
        return lg

    def check_ids(self, token_ids):
        return np.asarray(token_ids, np.int64)

    def new_state(self, max_seq_len=None):
        return types.SimpleNamespace(pos=0, max_seq_len=max_seq_len or 64)

    def _check_state(self, state):
        return state

    def _rows(self, p0, n, taps):
        """Row i: position p0 + i; with taps [n, n_taps] (position, tap layer) pairs."""
        r = np.arange(p0, p0 + n)
        return r if not taps else np.stack([r * 100 + t for t in taps], axis=1)

    def check_taps(self, taps, return_streams):
        self.calls.append(f"check_taps {tuple(taps)}")
        return tuple(taps)

    def prefill(self, token_ids, state=None, *, all_logits=False, return_streams=False, taps=()):
        assert return_streams and not all_logits
        state.pos = len(token_ids)
        self.calls.append("prefill")
        return self._lg(state.pos - 1), state, self._rows(0, state.pos, taps)

    def verify(self, state, tokens, *, return_streams=False, taps=()):
        assert return_streams
        self.calls.append(f"verify {len(tokens)}")
        self.p0, p0 = state.pos, state.pos
        return np.stack([self._lg(p0 + i) for i in range(len(tokens))]), \
            self._rows(p0, len(tokens), taps)

    def commit(self, state, n_accepted):
        state.pos = self.p0 + n_accepted + 1

    def decode_step(self, state, token, *, readback="logits", out=None):
        state.pos += 1
        return self._lg(state.pos - 1)


def test_gpu_spec_drives_the_model_surface():
    import inspect

    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.gpu.spec import speculative_generate
    for name in ("prefill", "verify", "commit", "decode_step", "check_ids", "new_state",
                 "_check_state", "check_taps"):   # the double's keywords are the real methods' keywords
        real = inspect.signature(getattr(Dsv4Gpu, name)).parameters
        fake = inspect.signature(getattr(_FakeGpuModel, name)).parameters
        assert list(fake) == list(real), (name, list(real), list(fake))
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]
    m = _FakeGpuModel(seq)
    res = speculative_generate(m, seq[:4], 12, 3, _RowsDrafterGpu(seq))
    assert res.tokens == seq[4:16] and m.calls[0] == "prefill"
    assert res.accepted == [1] * len(res.accepted)
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        speculative_generate(m, seq[:4], 6, 1, _RowsDrafterGpu(seq),
                             state=m.new_state(max_seq_len=8))
    # a drafter with trunk taps is handed those layers' rows, checked by the model
    m = _FakeGpuModel(seq)
    dr = _TapsDrafter(seq)
    res = speculative_generate(m, seq[:4], 12, 3, dr)
    assert res.tokens == seq[4:16] and m.calls[0] == "check_taps (0, 2)"
    assert dr.seen[0].shape == (4, 2) and dr.seen[0][3].tolist() == [300, 302]
    assert all(r.ndim == 2 and r.shape[1] == 2 for r in dr.seen)


class _RowsDrafterGpu(_RowsDrafter):
    def begin(self, model, max_seq_len):
        assert isinstance(model, _FakeGpuModel)
        self.next_row = 0


class _TapsDrafter(_RowsDrafterGpu):
    """Rows are [m, n_taps] (position * 100 + tap layer): _RowsDrafter reads the position."""

    def trunk_taps(self, model):
        return (0, 2)

    def begin(self, model, max_seq_len):
        super().begin(model, max_seq_len)
        self.seen = []

    def propose(self, hc_rows, next_tokens, k, sampler=None):
        self.seen.append(np.asarray(hc_rows))
        return super().propose(np.asarray(hc_rows)[:, 0] // 100, next_tokens, k, sampler)


def test_oracle_backend_drafts_with_the_checkpoints_drafter():
    """run.py's backends pick the checkpoint's drafter: DSpark's for a DSpark checkpoint (the
    oracle's default MTP drafter would refuse it), with the greedy tokens of plain decoding."""
    from memra_dsv4.oracle.spec import greedy_generate
    from memra_dsv4.run import _OracleBackend
    from memra_dsv4.synth import with_drafter
    cfg = with_drafter(preset("tiny"), "dspark")
    be = _OracleBackend(Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=0)), "bf16")
    prompt = [5, 9, 200, 3]
    res = be.speculative(np.asarray(prompt), 6, 3)
    assert res.tokens == greedy_generate(be.model, prompt, 6)
    assert res.drafted and all(d <= 3 for d in res.drafted)
