"""The step's non-seam A/B switches read from the environment, on the CPU: the preferred
shared-memory carveout of the PDL launches (MEMRA_DSV4_SMEM_CARVEOUT, pdl.smem_carveout) and the
q_norm inside wq_b (MEMRA_DSV4_WQB_QNORM, step_device.wqb_qnorm_on) and the CSA indexer's q GEMV
inside wq_b's launch (MEMRA_DSV4_IDXQ_PAIR, step_device.idxq_pair_on): values and refusals."""
from __future__ import annotations

import pytest


def test_carveout_env(monkeypatch):
    from memra_dsv4.gpu.pdl import smem_carveout
    monkeypatch.delenv("MEMRA_DSV4_SMEM_CARVEOUT", raising=False)
    assert smem_carveout() is None
    for v, want in (("default", None), ("max", 100), ("maxl1", 0), ("50", 50), ("0", 0), ("100", 100)):
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", v)
        assert smem_carveout() == want, v
    for bad in ("101", "-1", "half"):
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", bad)
        with pytest.raises(ValueError, match="MEMRA_DSV4_SMEM_CARVEOUT"):
            smem_carveout()


@pytest.mark.parametrize("env,fn,bad,default", [("MEMRA_DSV4_WQB_QNORM", "wqb_qnorm_on", "yes", False),
                                                  ("MEMRA_DSV4_IDXQ_PAIR", "idxq_pair_on", "1", True)])
def test_on_off_switch_env(monkeypatch, env, fn, bad, default):
    from memra_dsv4.gpu import step_device
    on = getattr(step_device, fn)
    monkeypatch.delenv(env, raising=False)
    assert on() is default   # IDXQ_PAIR on by default since the thirty-first session
    monkeypatch.setenv(env, "")
    assert on() is default
    monkeypatch.setenv(env, "off")
    assert on() is False
    monkeypatch.setenv(env, "on")
    assert on() is True
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=env):
        on()


def test_hc_join_env(monkeypatch):
    from memra_dsv4.gpu.step_device import HC_JOIN_ENV, hc_join_early
    monkeypatch.delenv(HC_JOIN_ENV, raising=False)
    assert hc_join_early() is False
    monkeypatch.setenv(HC_JOIN_ENV, "early")
    assert hc_join_early() is True
    monkeypatch.setenv(HC_JOIN_ENV, "ride")
    assert hc_join_early() is False
    from memra_dsv4.gpu.step_device import hc_join_form
    assert hc_join_form() == "ride"
    monkeypatch.setenv(HC_JOIN_ENV, "late")
    with pytest.raises(ValueError, match="MEMRA_DSV4_HC_JOIN"):
        hc_join_early()


def test_l2_side_env(monkeypatch):
    from memra_dsv4.gpu.step_device import l2_side_params, l2_side_targets
    for k in ("MEMRA_DSV4_L2_SIDE", "MEMRA_DSV4_L2_SIDE_MB", "MEMRA_DSV4_L2_SIDE_CTAS", "MEMRA_DSV4_L2_SIDE_NS"):
        monkeypatch.delenv(k, raising=False)
    assert l2_side_targets() == set() and l2_side_params() == (24.0, 8, 200)
    for v, want in (("wq", {"wq"}), ("wo", {"wo"}), ("both", {"wq", "wo"}), ("off", set())):
        monkeypatch.setenv("MEMRA_DSV4_L2_SIDE", v)
        assert l2_side_targets() == want
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE", "all")
    with pytest.raises(ValueError, match="MEMRA_DSV4_L2_SIDE="):
        l2_side_targets()
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_MB", "16")
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_NS", "400")
    assert l2_side_params() == (16.0, 8, 400)
    monkeypatch.setenv("MEMRA_DSV4_L2_SIDE_CTAS", "0")
    with pytest.raises(ValueError, match="MEMRA_DSV4_L2_SIDE_CTAS"):
        l2_side_params()


def test_carveout_read_once_per_pdl_block(monkeypatch):
    """PdlKernel launches take the carveout pdl_launches read on entry; the block restores the
    outer value on exit (no env read per launch)."""
    from memra_dsv4.gpu import pdl
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "max")
    with pdl.pdl_launches(True):
        assert pdl._CARVE == 100
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "50")
        assert pdl._CARVE == 100            # read once, on entry
        with pdl.pdl_launches(True):
            assert pdl._CARVE == 50
        assert pdl._CARVE == 100
        with pdl.pdl_launches(False):      # PDL off: no PdlKernel launches, the value is kept
            assert pdl._CARVE == 100
    assert pdl._CARVE is None
