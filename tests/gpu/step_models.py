"""Models and prefilled states the device-step A/B tests share (tests/gpu/test_step_*.py).

flash_prefilled(n, arms, seed)  flash-layers:n (MXFP4 experts unless experts= says otherwise,
                                bf16 dense unless dense= says otherwise, None: the seam's own
                                choice; the device path, one GPU, max_seq_len 1024, SIMT prefill
                                attention) and one state per arm, each prefilled with the same
                                prompt.
tiny_prefilled(arms, seed)      the same for the tiny preset (test_decode_gpu's cached model).
Both return (model, states: arm -> DecodeState, token ids of prompt + steps, prompt length); the
ids are drawn from seed, so a test's arms all see the same tokens.  Not a test module (no test_
prefix); the tests import it in pytest's prepend import mode (tests/gpu on sys.path)."""
from __future__ import annotations

import numpy as np


def flash_prefilled(n_layers: int, arms, seed: int, prompt: int = 5, steps: int = 6,
                    experts: str = "mxfp4", dense: str | None = "bf16"):
    from test_prefill_gpu import _ckpt

    from memra_dsv4.gpu.model import Dsv4Gpu
    ck = _ckpt(f"flash-layers:{n_layers}", experts, drafter="none")
    kw = {} if dense is None else {"dense": dense}
    m = Dsv4Gpu.load(ck, devices=(0,), decode_path="device", max_seq_len=1024, prefill_attn="simt", **kw)
    ids = np.random.default_rng(seed).integers(2, ck.config.vocab_size, prompt + steps).tolist()
    return m, {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}, ids, prompt


def tiny_prefilled(arms, seed: int, prompt: int = 5, steps: int = 12):
    from test_decode_gpu import _ids, _model
    ck, m = _model("tiny", (0,), "device")
    ids = _ids(ck.config, prompt + steps, seed=seed)
    return m, {a: m.prefill(ids[:prompt], m.new_state())[1] for a in arms}, ids, prompt
