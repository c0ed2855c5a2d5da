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
    assert smem_carveout() == "fit1h16"   # the default since the thirty-third session (fit1 before)
    for v, want in (("default", "fit1h16"), ("driver", None), ("max", 100), ("maxl1", 0), ("fit1", "fit1"),
                    ("fitocc", "fitocc"), ("50", 50), ("0", 0),
                    ("100", 100), ("fit1h16", "fit1h16"), ("FIT1H08", "fit1h8"), ("fit1h228", "fit1h228")):
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", v)
        assert smem_carveout() == want, v
    for bad in ("101", "-1", "half", "fit1h", "fit1h0", "fit1h229", "fit1h-4", "fit1hx"):
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
        assert pdl._CARVE == "fit1" and pdl._HEADROOM is None
    assert pdl._CARVE is None
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "fit1h16")
    with pdl.pdl_launches(True):   # the headroom parsed once, on entry
        assert pdl._CARVE == "fit1h16" and pdl._HEADROOM == 16384
        monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "fit1h32")
        with pdl.pdl_launches(True):
            assert pdl._HEADROOM == 32768
        assert pdl._HEADROOM == 16384
    assert pdl._CARVE is None and pdl._HEADROOM is None
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", "fit2")
    with pytest.raises(ValueError, match="driver, max, maxl1, fit1, fit1hK, fitocc or a percentage"):
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


def test_fit1h_adds_headroom_for_the_next_kernels_ctas():
    """fit1hK (pdl.fit1_carveout's headroom): one CTA's share plus K KB, so the next kernel's CTAs
    (each the 1 KB reservation) fit beside it under PDL; still none for a many-wave grid or a
    launch without shared memory, and capped at 100."""
    from memra_dsv4.gpu.pdl import fit1_carveout
    h = dict(sm_count=132, smem_per_sm=233472, reserved_per_block=1024)
    # the hc boundary's 57 KB CTA: fit1 26 % (59.3 KB: the 64 KB configuration, 6 KB left);
    # fit1h16 (58368 + 1024 + 16384) / 233472 -> 32.5 -> 33
    assert fit1_carveout(64, 58368, 0, **h) == 26
    assert fit1_carveout(64, 58368, 0, headroom=16384, **h) == 33
    assert fit1_carveout(64, 58368, 0, headroom=32768, **h) == 40
    assert fit1_carveout(300, 58368, 0, headroom=16384, **h) is None
    assert fit1_carveout(64, 0, 0, headroom=16384, **h) is None
    assert fit1_carveout(1, 232448, 0, headroom=16384, **h) == 100
    with pytest.raises(AssertionError):
        fit1_carveout(1, 1024, 0, headroom=-1, **h)


def test_func_value_is_computed_once_per_kernel_object(monkeypatch):
    """pdl._func_value (launch_ex's static shared memory and occupancy for fit1 / fitocc): one
    driver query per function, not per launch; a different RawKernel at a reused handle
    recomputes (the entry keeps its kernel and compares identity); an occupancy of 0 is not kept."""
    from memra_dsv4.gpu import pdl
    monkeypatch.setattr(pdl, "_FUNC_VALUES", {})
    calls = []

    def q(v):
        def f():
            calls.append(v)
            return v
        return f
    k1, k2 = object(), object()
    assert pdl._func_value(k1, (77, "static"), q(1024)) == 1024
    assert pdl._func_value(k1, (77, "static"), q(9)) == 1024          # cached for k1
    assert pdl._func_value(k2, (77, "static"), q(2048)) == 2048       # same handle, another kernel
    assert pdl._func_value(k2, (77, "static"), q(9)) == 2048
    assert pdl._func_value(k2, (77, "occ", 256, 4096), q(0)) == 0      # not kept
    assert pdl._func_value(k2, (77, "occ", 256, 4096), q(3)) == 3
    assert pdl._func_value(k2, (77, "occ", 256, 4096), q(9)) == 3
    assert pdl._func_value(k2, (77, "static"), q(0)) == 2048
    assert calls == [1024, 2048, 0, 3]
    assert pdl._func_value(k1, (78, "static"), q(0)) == 0             # a static 0 is kept
    assert pdl._func_value(k1, (78, "static"), q(5)) == 0


def _fake_driver(calls, static=0, occ=2):
    """A cuda.bindings.driver stand-in for launch_ex on the CPU: records the driver calls and the
    launch config's attributes."""
    import types
    from types import SimpleNamespace as NS
    ok = NS(name="CUDA_SUCCESS")
    cu = types.ModuleType("cuda.bindings.driver")
    cu.CUresult = NS(CUDA_SUCCESS=ok)
    cu.CUfunction = lambda p: int(p)
    cu.CUstream = lambda p: int(p)
    cu.CUfunction_attribute = NS(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES="SHARED_SIZE_BYTES",
                                 CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED="NONPORTABLE")
    cu.CUlaunchAttributeID = NS(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION="PDL",
                                CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT="CARVE",
                                CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION="CLUSTER")

    class Attr:
        def __init__(self):
            self.id = None
            self.value = NS(clusterDim=NS())
    cu.CUlaunchAttribute = Attr
    cu.CUlaunchConfig = lambda: NS()

    def get_attr(what, func):
        calls.append(("attr", what, func))
        return ok, static

    def occupancy(func, threads, smem):
        calls.append(("occ", func, threads, smem))
        return ok, occ

    def launch(cfg, func, params, extra):
        calls.append(("launch", func, [(a.id, getattr(a.value, "sharedMemCarveout", None)) for a in cfg.attrs]))
        return (ok,)
    cu.cuFuncGetAttribute = get_attr
    cu.cuOccupancyMaxActiveBlocksPerMultiprocessor = occupancy
    cu.cuLaunchKernelEx = launch
    cu.cuGetErrorString = lambda err: (ok, b"fake")
    return cu


@pytest.mark.parametrize("carve", ["default", "fit1", "fit1h16", "fitocc", "driver", "50"])
def test_launch_ex_carveout_attribute(monkeypatch, carve):
    """launch_ex under each carveout form, with a fake driver on the CPU: the PDL attribute on
    every launch; the carveout attribute with fit1's one-CTA share for a one-wave launch with
    shared memory (and none for a many-wave one under fit1, the occupancy's share under fitocc,
    none with driver, the percentage with 50); the function's static shared memory and occupancy
    asked of the driver once per kernel object, not per launch; no attribute query without PDL."""
    import sys
    import types
    from types import SimpleNamespace as NS
    from tests.test_kernel_sources import _fake_cupy
    from memra_dsv4.gpu import pdl
    calls = []
    cu = _fake_driver(calls, static=0, occ=2)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = cu
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    fake = _fake_cupy()
    fake.cuda.runtime.deviceGetAttribute = lambda attr, dev: {16: 132, 81: 233472, 111: 1024}[attr]
    for name, mod in (("cupy", fake), ("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", cu)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(pdl, "_FUNC_VALUES", {})
    monkeypatch.setattr(pdl, "_DEVICE_SMEM", {})
    monkeypatch.setenv("MEMRA_DSV4_SMEM_CARVEOUT", carve)
    raw = NS(kernel=NS(ptr=4242))
    stream = NS(ptr=7)
    with pdl.pdl_launches(True):
        for _ in range(3):   # hc_boundary_pre's shape: 64 CTAs, 57 KB
            pdl.launch_ex(raw, "hc.k", (64,), (256,), (), shared_mem=58368, stream=stream, pdl=True)
        pdl.launch_ex(raw, "hc.k", (300,), (256,), (), shared_mem=58368, stream=stream, pdl=True)
    pdl.launch_ex(raw, "hc.k", (64,), (256,), (), shared_mem=58368, stream=stream, pdl=False)
    launches = [c for c in calls if c[0] == "launch"]
    queries = [c for c in calls if c[0] != "launch"]
    one_wave = {"default": 33, "fit1": 26, "fit1h16": 33, "fitocc": 26, "driver": None, "50": 50}[carve]
    many_wave = {"default": None, "fit1": None, "fit1h16": None, "fitocc": 51, "driver": None, "50": 50}[carve]   # fitocc: 2 CTAs per SM
    for attrs, want in zip([l[2] for l in launches], [one_wave] * 3 + [many_wave] + ["no pdl"]):
        if want == "no pdl":
            assert attrs == []
        else:
            assert attrs[0] == ("PDL", None)
            assert attrs[1:] == ([] if want is None else [("CARVE", want)]), (carve, attrs)
    want_q = {"fit1": [("attr", "SHARED_SIZE_BYTES", 4242)], "fit1h16": [("attr", "SHARED_SIZE_BYTES", 4242)],
              "default": [("attr", "SHARED_SIZE_BYTES", 4242)],
              "fitocc": [("attr", "SHARED_SIZE_BYTES", 4242), ("occ", 4242, 256, 58368)],
              "driver": [], "50": []}[carve]
    assert queries == want_q
