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
    from tests.test_decode_shared_w2_cpu import moe_buffers, run_moe

    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.ops import router as RT
    from memra_dsv4.gpu.pdl import pdl_active, pdl_launches
    monkeypatch.setenv("MEMRA_DSV4_SHARED_GATEUP", "off")   # the side-branch form (fork, side, SwiGLU)
    if env is None:
        monkeypatch.delenv("MEMRA_DSV4_GATEUP_PDL", raising=False)
    else:
        monkeypatch.setenv("MEMRA_DSV4_GATEUP_PDL", env)
    D, I = 256, 128
    log = []
    rec = lambda name: (lambda *a, **kw: log.append((name, pdl_active())))   # noqa: E731
    monkeypatch.setattr(DK, "gemv_bf16_swiglu", rec("swiglu"))
    monkeypatch.setattr(DK, "gemv_bf16", rec("w2"))
    monkeypatch.setattr(RT, "fused", rec("router"))
    monkeypatch.setattr(EX, "gemv_fp4_gateup", rec("gateup"))
    monkeypatch.setattr(EX, "gemv_fp4_down_combine", rec("down"))
    with pdl_launches(True):
        run_moe(moe_buffers(D, I), log, fork, "gemv", lambda leaf: (leaf, None), D, I)
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


def test_multi_qnorm_switch(monkeypatch):
    """MEMRA_DSV4_MULTI_QNORM: on / off / unset (the default), anything else refused by name."""
    from memra_dsv4.gpu import step_device as SD
    monkeypatch.setenv(SD.MULTI_QNORM_ENV, "on")
    assert SD.multi_qnorm_on() is True
    monkeypatch.setenv(SD.MULTI_QNORM_ENV, "off")
    assert SD.multi_qnorm_on() is False
    monkeypatch.delenv(SD.MULTI_QNORM_ENV)
    assert SD.multi_qnorm_on() is (SD.MULTI_QNORM_DEFAULT == "on")
    monkeypatch.setenv(SD.MULTI_QNORM_ENV, "yes")
    with pytest.raises(ValueError, match="MEMRA_DSV4_MULTI_QNORM='yes'"):
        SD.multi_qnorm_on()
