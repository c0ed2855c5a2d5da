"""The split sub-layer boundary on the CPU (seam MEMRA_DSV4_HC_SPLIT): the seam's resolution in
DeviceStep, the bench arm, and the launch / fork / join order DeviceStep._block issues with the
hc kernels and the sub-layers replaced by recorders (no GPU): the critical kernel on the compute
stream, the Sinkhorn on the hc side stream right after a fork (graph) or right after the
critical kernel on the compute stream (eager), a join before every reader of post / comb (the
next critical kernel, the stage's last hc_post), nothing left unjoined.  The bytes are the GPU
tests' (tests/gpu/test_kernels_hc.py split tests, tests/gpu/test_step_hcsplit_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest


def test_hc_split_seam_and_step_form():
    from memra_dsv4.gpu.step_device import DeviceStep
    from memra_dsv4.seams import SEAM_HC_SPLIT, SEAMS, resolve
    assert SEAMS["hc_split"] is SEAM_HC_SPLIT and SEAM_HC_SPLIT.default == "on"
    assert resolve(SEAM_HC_SPLIT, "on") == "on"
    with pytest.raises(ValueError, match="allowed: off, on"):
        resolve(SEAM_HC_SPLIT, "yes")
    ds = object.__new__(DeviceStep)       # no GPU: only the form's resolution
    for value, want in (("on", "on"), ("off", "off"), (None, "on")):
        ds.m = SimpleNamespace(hc_split=value)
        assert ds.hc_split_form() == want
    ds.m = SimpleNamespace()
    assert ds.hc_split_form() == "on"
    ds.m = SimpleNamespace(hc_split="both")
    with pytest.raises(ValueError, match=r"model.hc_split \(env MEMRA_DSV4_HC_SPLIT\).*off, on"):
        ds.hc_split_form()


def test_decode_bench_hcsplit_arm():
    from bench.decode_step import check_arms
    assert check_arms("path=device+hcsplit=off,path=device+hcsplit=on") == [
        {"path": "device", "hcsplit": "off"}, {"path": "device", "hcsplit": "on"}]
    with pytest.raises(SystemExit, match="hcsplit='2'; expected one of off, on"):
        check_arms("path=device+hcsplit=2")


class _Side:
    def __init__(self, where):
        self.where = where

    def __enter__(self):
        self.where[0] = "side"

    def __exit__(self, *exc):
        self.where[0] = "main"


def _block_log(monkeypatch, split: bool, branch: bool, n_layers: int = 2):
    """DeviceStep._block over n_layers layers of one stage; returns the recorded sequence."""
    from memra_dsv4.gpu.ops import hc as HC
    from memra_dsv4.gpu.step_device import DeviceStep
    log, where = [], ["main"]
    D = 8
    v = {k: np.zeros(n, np.float32) for k, n in (("hc.post", 4), ("hc.comb", 16), ("hc.pre", 4))}
    v.update({"dev.mix": np.zeros((1, 24), np.float32), "x": np.zeros(D, np.uint16),
              "xn": np.zeros(D, np.uint16), "attn.out": np.zeros(D, np.uint16),
              "ffn.out": np.zeros(D, np.uint16)})
    names = {id(v["hc.post"]): "post", id(v["hc.comb"]): "comb"}

    def base_of(a):
        while a is not None and id(a) not in names and getattr(a, "base", None) is not None:
            a = a.base
        return names.get(id(a))

    def pre(streams, fn, scale, base, w, **kw):
        ins = (base_of(kw.get("post_in")), base_of(kw.get("comb_in")))
        log.append(("pre", where[0], kw.get("f") is not None, ins))

    def sinkhorn(mixes, scale, base, *, iters, hc_eps, post, comb):
        assert mixes is v["dev.mix"]
        log.append(("sinkhorn", where[0], (base_of(post), base_of(comb))))

    monkeypatch.setattr(HC, "hc_boundary_pre", pre)
    monkeypatch.setattr(HC, "hc_boundary_sinkhorn", sinkhorn)
    monkeypatch.setattr(HC, "hc_boundary", lambda *a, **kw: log.append(("boundary", where[0])))
    monkeypatch.setattr(HC, "hc_post", lambda *a, **kw: log.append(("hc_post", where[0])))
    ds = object.__new__(DeviceStep)
    ds.cfg = SimpleNamespace(hidden_size=D, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    ds.hostmath, ds._forking = False, ""
    ds._hc_split, ds._hc_branch = split, branch
    ds._attention = lambda S, L, cache, table, attn: log.append(("attention", where[0]))
    ds._moe = lambda S, L: log.append(("moe", where[0]))
    S = SimpleNamespace(v=v, ph="decode/stage0", hc_pending=False, hc_side=_Side(where),
                        hc_fork=SimpleNamespace(fork=lambda: log.append(("fork",)),
                                                join=lambda: log.append(("join",))))
    S.layers = []
    for _ in range(n_layers):
        L = SimpleNamespace(f32={"hc_attn_fn": None, "hc_ffn_fn": None}, w=lambda leaf: None)
        S.layers.append(L)
    cur, oth = np.zeros((1, 4, D), np.uint16), np.zeros((1, 4, D), np.uint16)
    for L in S.layers:
        cur, oth = ds._block(S, L, cur, oth, None, None)
    assert not S.hc_pending, "a Sinkhorn branch left unjoined"
    return log


def test_block_order_split_branch(monkeypatch):
    log = _block_log(monkeypatch, split=True, branch=True)
    first, carried = ("pre", "main", False, (None, None)), ("pre", "main", True, ("post", "comb"))
    sk = [("fork",), ("sinkhorn", "side", ("post", "comb"))]
    want = ([first] + sk + [("attention", "main"), ("join",), carried] + sk + [("moe", "main")]
            + [("join",), carried] + sk + [("attention", "main"), ("join",), carried] + sk
            + [("moe", "main"), ("join",), ("hc_post", "main")])
    assert log == want


def test_block_order_split_eager(monkeypatch):
    log = _block_log(monkeypatch, split=True, branch=False)
    first, carried = ("pre", "main", False, (None, None)), ("pre", "main", True, ("post", "comb"))
    sk = [("sinkhorn", "main", ("post", "comb"))]
    want = ([first] + sk + [("attention", "main"), carried] + sk + [("moe", "main"), carried] + sk
            + [("attention", "main"), carried] + sk + [("moe", "main"), ("hc_post", "main")])
    assert log == want


def test_block_order_one_launch(monkeypatch):
    log = _block_log(monkeypatch, split=False, branch=False, n_layers=1)
    assert log == [("boundary", "main"), ("attention", "main"), ("boundary", "main"), ("moe", "main"),
                   ("hc_post", "main")]
