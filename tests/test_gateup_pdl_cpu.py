"""MEMRA_DSV4_GATEUP_PDL (step_device.gateup_pdl_off): the routed gate/up of the device step's
MoE launched without PDL while every other launch keeps it, and nothing else changes.

* the switch: unset / "on" -> PDL as every launch; "off" -> a plain launch; anything else a
  ValueError naming the variable;
* _moe (fake launches, the step's PDL context active): with "off" only the gate/up sees
  pdl_active() False, in the same launch order (fork, side, shared SwiGLU, router, gate/up, join,
  down), and the PDL context is active again after it;
* bench.decode_step's arm setting gupdl=on|off sets the variable.
The speed is the GPU's (an A/B arm of bench.decode_step); the bytes cannot change (PDL only moves
when a kernel's CTAs become resident; the kernels wait for their predecessor either way)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest


def test_gateup_pdl_switch(monkeypatch):
    from memra_dsv4.gpu.step_device import GATEUP_PDL_ENV, gateup_pdl_off
    assert GATEUP_PDL_ENV == "MEMRA_DSV4_GATEUP_PDL"
    monkeypatch.delenv(GATEUP_PDL_ENV, raising=False)
    assert not gateup_pdl_off()
    monkeypatch.setenv(GATEUP_PDL_ENV, "on")
    assert not gateup_pdl_off()
    monkeypatch.setenv(GATEUP_PDL_ENV, "off")
    assert gateup_pdl_off()
    monkeypatch.setenv(GATEUP_PDL_ENV, "0")
    with pytest.raises(ValueError, match="MEMRA_DSV4_GATEUP_PDL='0'.*on or off"):
        gateup_pdl_off()


def _moe_pdl_log(monkeypatch, env: str | None, fork: str = "all"):
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.ops import router as RT
    from memra_dsv4.gpu.pdl import pdl_active, pdl_launches
    from memra_dsv4.gpu.step_device import DeviceStep
    if env is None:
        monkeypatch.delenv("MEMRA_DSV4_GATEUP_PDL", raising=False)
    else:
        monkeypatch.setenv("MEMRA_DSV4_GATEUP_PDL", env)
    D, I, E, k = 256, 128, 8, 6
    v = {"xn": np.zeros(D, np.uint16), "moe.logits": np.zeros(E, np.float32), "moe.ids": np.zeros(k, np.int32),
         "moe.w": np.zeros(k, np.float32), "moe.sh_h": np.zeros(I, np.uint16), "moe.h": np.zeros((k, I), np.uint16),
         "moe.shared": np.zeros(D, np.uint16), "moe.scores": np.zeros(E, np.float32),
         "ffn.out": np.zeros(D, np.uint16), "tok": np.zeros(1, np.int32)}
    log = []
    rec = lambda name: (lambda *a, **kw: log.append((name, pdl_active())))   # noqa: E731
    monkeypatch.setattr(DK, "gemv_bf16_swiglu", rec("swiglu"))
    monkeypatch.setattr(DK, "gemv_bf16", rec("w2"))
    monkeypatch.setattr(RT, "fused", rec("router"))
    monkeypatch.setattr(EX, "gemv_fp4_gateup", rec("gateup"))
    monkeypatch.setattr(EX, "gemv_fp4_down_combine", rec("down"))
    fk = SimpleNamespace(fork=lambda: log.append(("fork",)), join=lambda: log.append(("join",)))

    class _Side:
        def __enter__(self):
            log.append(("side",))

        def __exit__(self, *a):
            log.append(("main",))
    ds = object.__new__(DeviceStep)
    ds.cfg = SimpleNamespace(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                             swiglu_limit=10.0, routed_scaling_factor=1.5)
    ds.hostmath, ds._forking, ds._w2 = False, fork, "gemv"
    L = SimpleNamespace(lin=lambda leaf: (leaf, None), w=lambda leaf: leaf, hash=False, fmt="mxfp4",
                        wp={"w1": 0, "w3": 0, "w2": 0}, sp={"w1": 0, "w3": 0, "w2": 0},
                        ws2={"w1": None, "w3": None, "w2": None})
    S = SimpleNamespace(v=v, ph="decode/stage0", moe_fork=fk, moe_side=_Side())
    with pdl_launches(True):
        ds._moe(S, L)
        log.append(("after", pdl_active()))
    return log


@pytest.mark.parametrize("fork", ["", "all"])
def test_moe_gateup_without_pdl_only_there(monkeypatch, fork):
    on = _moe_pdl_log(monkeypatch, None, fork)
    off = _moe_pdl_log(monkeypatch, "off", fork)
    assert _moe_pdl_log(monkeypatch, "on", fork) == on
    names = lambda log: [e[0] for e in log]   # noqa: E731
    assert names(off) == names(on)            # the same launches in the same order
    for a, b in zip(on, off):
        if a[0] == "gateup":
            assert a == ("gateup", True) and b == ("gateup", False)
        else:
            assert a == b, (a, b)             # every other launch (and the context after) keeps PDL
    assert ("router", True) in off and ("after", True) in off


def test_bench_decode_gupdl_arm_sets_the_env():
    from bench.decode_step import _kernel_env
    assert _kernel_env({"gupdl": "off"}, None) == {"MEMRA_DSV4_GATEUP_PDL": "off"}
    assert _kernel_env({"gupdl": "on"}, None) == {"MEMRA_DSV4_GATEUP_PDL": "on"}
