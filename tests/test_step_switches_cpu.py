"""The step's non-seam A/B switches read from the environment, on the CPU: the preferred
shared-memory carveout of the PDL launches (MEMRA_DSV4_SMEM_CARVEOUT, pdl.smem_carveout; its
per-launch forms fit1 and fitocc, pdl.fit1_carveout / fitocc_carveout) and the
q_norm inside wq_b (MEMRA_DSV4_WQB_QNORM, step_device.wqb_qnorm_on) and the CSA indexer's q GEMV
inside wq_b's launch (MEMRA_DSV4_IDXQ_PAIR, step_device.idxq_pair_on): values and refusals."""
from __future__ import annotations

import pytest


def test_carveout_env(monkeypatch):
    from memra_dsv4.gpu.pdl import smem_carveout
    monkeypatch.delenv("MEMRA_DSV4_SMEM_CARVEOUT", raising=False)
    assert smem_carveout() == "fit1"   # the default since the thirty-second session
    for v, want in (("default", "fit1"), ("driver", None), ("max", 100), ("maxl1", 0), ("fit1", "fit1"),
                    ("fitocc", "fitocc"), ("50", 50), ("0", 0),
                    ("100", 100)):
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


def test_fit1_carveout_holds_one_cta_of_a_one_wave_launch():
    """MEMRA_DSV4_SMEM_CARVEOUT=fit1 (pdl.fit1_carveout): a launch with shared memory and no more
    CTAs than SMs prefers the smallest carveout holding one CTA (dynamic + static + the per-block
    reservation, in percent of the SM's shared memory, rounded up); a launch without shared
    memory or with more CTAs than SMs gets no preference (the driver's choice)."""
    from memra_dsv4.gpu.pdl import fit1_carveout
    h = dict(sm_count=132, smem_per_sm=233472, reserved_per_block=1024)   # an H100 / H200 SM
    # hc_boundary_pre: 64 CTAs, 57 KB dynamic -> (58368 + 1024) / 233472 = 25.4 % -> 26
    assert fit1_carveout(64, 58368, 0, **h) == 26
    # the 8-head attention's one-buffer CTAs (32 KB) and the combine's staged partials (41 KB)
    assert fit1_carveout(104, 32768, 0, **h) == 15
    assert fit1_carveout(64, 20 * 514 * 4, 0, **h) == 19   # 18.05 % rounds up
    assert fit1_carveout(132, 0, 4096, **h) == 3          # static shared memory counts too
    assert fit1_carveout(1, 1, 0, **h) == 1
    assert fit1_carveout(1, 232448, 0, **h) == 100        # the largest CTA: the whole share
    assert fit1_carveout(64, 0, 0, **h) is None           # no shared memory: no preference
    assert fit1_carveout(133, 58368, 0, **h) is None      # more CTAs than SMs: the driver's choice
    assert fit1_carveout(4096, 0, 0, **h) is None
    with pytest.raises(AssertionError):
        fit1_carveout(0, 1024, 0, **h)


def test_fit1_env_and_block(monkeypatch):
    from memra_dsv4.gpu import pdl
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "fit1")
    assert pdl.smem_carveout() == pdl.FIT1 == "fit1"
    with pdl.pdl_launches(True):
        assert pdl._CARVE == "fit1"
    assert pdl._CARVE is None
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "fit2")
    with pytest.raises(ValueError, match="driver, max, maxl1, fit1, fitocc or a percentage"):
        pdl.smem_carveout()


def test_fit1_for_reads_the_device_once(monkeypatch):
    """pdl._fit1_for: the launch's static shared memory as given (launch_ex reads it from the
    driver at each fit1 launch: no cache a rebuilt module could inherit), the device's three
    attributes once per device."""
    import sys
    from types import SimpleNamespace
    from memra_dsv4.gpu import pdl
    asked = []

    def get(attr, dev):
        asked.append((attr, dev))
        return {16: 132, 81: 233472, 111: 1024}[attr]
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 3,
                                                                        deviceGetAttribute=get)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(pdl, "_DEVICE_SMEM", {})
    assert pdl._fit1_for(0, 58368, 64) == 26
    assert pdl._fit1_for(4096, 58368, 64) == 28     # (58368 + 4096 + 1024) / 233472 -> 27.3 -> 28
    assert pdl._fit1_for(4096, 58368, 200) is None
    assert pdl._fitocc_for(0, 58368, 64, 3) == 26   # one wave: fit1's share
    assert pdl._fitocc_for(0, 58368, 200, 3) == 51  # two CTAs per SM: 2 * 59392 / 233472 -> 50.9 -> 51
    assert sorted(asked) == [(16, 3), (81, 3), (111, 3)]


def test_fitocc_carveout_holds_the_ctas_an_sm_must_hold():
    """MEMRA_DSV4_SMEM_CARVEOUT=fitocc (pdl.fitocc_carveout): every launch with shared memory
    prefers the smallest carveout holding min(occupancy, ceil(CTAs / SMs)) CTAs (at least one);
    a one-wave launch gets fit1's share, a launch without shared memory no preference, and the
    largest share is 100 %."""
    from memra_dsv4.gpu.pdl import fit1_carveout, fitocc_carveout
    h = dict(sm_count=132, smem_per_sm=233472, reserved_per_block=1024)
    for n, dyn, st in ((64, 58368, 0), (104, 32768, 0), (132, 0, 4096), (1, 1, 0), (1, 232448, 0)):
        assert fitocc_carveout(n, dyn, st, 4, **h) == fit1_carveout(n, dyn, st, **h), (n, dyn, st)
    # a persistent grid of 2 CTAs per SM of 40 KB: 2 * 41 KB -> 35.1 % -> 36
    assert fitocc_carveout(264, 40960, 0, 2, **h) == 36
    # many waves at occupancy 3: three CTAs' share, not more (ceil(4096 / 132) = 32 > 3)
    assert fitocc_carveout(4096, 16384, 1024, 3, **h) == -(-100 * 3 * 18432 // 233472) == 24
    # more waves than the occupancy allows at once are capped by the whole share
    assert fitocc_carveout(4096, 100000, 0, 8, **h) == 100
    # occupancy 0 (the driver says it cannot fit): still one CTA's share, never below the need
    assert fitocc_carveout(500, 58368, 0, 0, **h) == 26
    assert fitocc_carveout(4096, 0, 0, 8, **h) is None     # no shared memory: no preference
    with pytest.raises(AssertionError):
        fitocc_carveout(1, 1024, 0, -1, **h)
