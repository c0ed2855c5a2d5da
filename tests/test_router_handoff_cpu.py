"""MEMRA_DSV4_ROUTER_HANDOFF (step_device.router_handoff): the device router's one launch hands the
E scores to the selecting CTA through a ticket and L2 (router_fused_*, "ticket") or inside one
thread-block cluster through DSMEM (router_cluster_*, "cluster", E <= 256).  On the CPU (no GPU):

* the switch: unset -> ROUTER_HANDOFF_DEFAULT; "ticket" / "cluster"; anything else a ValueError
  naming the variable; bench.decode_step's rhand arm sets it;
* DeviceStep._moe with the launches replaced by recorders: ops.router.fused gets handoff="cluster"
  when the switch says so and E <= 256, "ticket" otherwise (E = 384 falls back);
* the wrapper on fake arrays: router_cluster_e* with grid ceil(E / 16), block 512, dynamic smem
  2 D and cluster (ceil(E / 16), 1, 1), the ticket form unchanged; refusals (an unknown handoff, a
  counter with the cluster handoff, E > 256) name the problem and launch nothing;
* kernel_loader: a kernel registered with cluster= comes out of get() as a pdl.ExKernel outside
  pdl_launches and as a PdlKernel inside (both take cluster=); cluster= naming an unregistered
  kernel is refused;
* the kernel's source: rank 0's mbarrier set up before the PDL wait (mbar_init_expect of E * 4
  bytes, fence_mbarrier_init_cluster, the cluster barrier's relaxed arrive), the arrive's wait
  before the rows' st.async into rank 0's shared memory, rank 0's acquire wait on the mbarrier
  (mbar_wait_cluster), no ticket, no fence; those helpers' PTX in kernels_cu/cluster.cuh (shared
  with hc.cu's hc_boundary_pre_cluster) and none of the global-fencing forms there; the
  selection through select_topk_warp / select_weights_warp (router_select_*'s code) and the row
  dot through rf_row_dot (router_fused_*'s), PDL_ENTRY_PRELOAD first.
The bytes are the GPU tests' (tests/gpu/test_kernels_router.py router_cluster,
tests/gpu/test_step_router_handoff_gpu.py); tests/test_pdl_preload_sass.py checks the SASS order."""
from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_router_handoff_switch(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    assert SD.ROUTER_HANDOFF_ENV == "MEMRA_DSV4_ROUTER_HANDOFF"
    monkeypatch.delenv(SD.ROUTER_HANDOFF_ENV, raising=False)
    assert SD.router_handoff() == SD.ROUTER_HANDOFF_DEFAULT
    for v in ("ticket", "cluster"):
        monkeypatch.setenv(SD.ROUTER_HANDOFF_ENV, v)
        assert SD.router_handoff() == v
    monkeypatch.setenv(SD.ROUTER_HANDOFF_ENV, "dsmem")
    with pytest.raises(ValueError, match="MEMRA_DSV4_ROUTER_HANDOFF='dsmem'.*ticket or cluster"):
        SD.router_handoff()


def test_bench_decode_rhand_arm_sets_the_env():
    from bench.decode_step import _kernel_env
    assert _kernel_env({"rhand": "cluster"}, None) == {"MEMRA_DSV4_ROUTER_HANDOFF": "cluster"}
    assert _kernel_env({"rhand": "ticket"}, None) == {"MEMRA_DSV4_ROUTER_HANDOFF": "ticket"}


def _moe_kw(monkeypatch, E=256, **env):
    """DeviceStep._moe of one fake Flash-shaped layer (bf16 shared w1 / w3; test_decode_shared_w2_cpu's
    run_moe) with the launches replaced by recorders: the keyword arguments of its ops.router.fused
    and of its ops.experts.gemv_fp4_gateup call.  env: MEMRA_DSV4_<name> -> value (None: unset);
    the FP4 full / ring switches are unset."""
    from tests.test_decode_shared_w2_cpu import moe_buffers, run_moe

    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.ops import router as RT
    for var, val in {"FP4_FULL": None, "FP4_RING": None, **env}.items():
        if val is None:
            monkeypatch.delenv(f"MEMRA_DSV4_{var}", raising=False)
        else:
            monkeypatch.setenv(f"MEMRA_DSV4_{var}", val)
    D, I = 4096, 2048
    v = moe_buffers(D, I)
    v["moe.logits"], v["moe.scores"] = np.zeros(E, np.float32), np.zeros(E, np.float32)
    weights = {"ffn.shared_experts.w1": (np.zeros((I, D), np.uint16), None),
               "ffn.shared_experts.w3": (np.zeros((I, D), np.uint16), None),
               "ffn.shared_experts.w2": (np.zeros((D, I), np.uint16), None)}
    routers, gateups = [], []
    monkeypatch.setattr(DK, "gemv_bf16_swiglu", lambda *a, **kw: None)
    monkeypatch.setattr(DK, "gemv_bf16", lambda *a, **kw: None)
    monkeypatch.setattr(RT, "fused", lambda *a, **kw: routers.append(kw))
    monkeypatch.setattr(EX, "gemv_fp4_gateup", lambda *a, **kw: gateups.append(kw))
    monkeypatch.setattr(EX, "gemv_fp4_down_combine", lambda *a, **kw: None)
    run_moe(v, [], "all", "fused", lambda leaf: weights[leaf], D, I, E=E)
    assert len(routers) == 1 and len(gateups) == 1
    return routers[0], gateups[0]


def _router_kw(monkeypatch, env, E):
    return _moe_kw(monkeypatch, E, ROUTER_HANDOFF=env)[0]


def test_moe_passes_the_handoff(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    assert _router_kw(monkeypatch, "cluster", 256)["handoff"] == "cluster"
    assert _router_kw(monkeypatch, "ticket", 256)["handoff"] == "ticket"
    assert _router_kw(monkeypatch, None, 256)["handoff"] == SD.ROUTER_HANDOFF_DEFAULT
    assert _router_kw(monkeypatch, "cluster", 384)["handoff"] == "ticket"   # one cluster covers E <= 256
    assert _router_kw(monkeypatch, "cluster", 32)["handoff"] == "cluster"


def test_router_cluster_wrapper_launch_and_checks(monkeypatch):
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import router as RT
    A = fake.asarray
    rec = []
    monkeypatch.setattr(RT, "kernel", lambda stem, name: (
        lambda grid, block, a, shared_mem=0, **kw: rec.append((name, grid, block, a, shared_mem, kw))))
    monkeypatch.setattr(RT, "dynamic_smem", lambda kern, n: n)
    counter = A(np.zeros(1, np.int32))
    monkeypatch.setattr(RT, "workspace", lambda: counter)
    D, k = 4096, 6

    def call(E, **kw):
        w = A(np.zeros((E, D), np.uint16))
        return RT.fused(A(np.zeros((1, D), np.uint16)), w, k, 2.5, bias=A(np.zeros(E, np.float32)), **kw)
    for E, ctas in ((256, 16), (200, 13), (32, 2), (8, 1)):
        out = call(E, handoff="cluster")
        name, grid, block, a, smem, kw = rec[-1]
        assert name == f"router_cluster_e{max(32, 1 << (E - 1).bit_length())}"
        assert grid == (ctas,) and block == (512,) and smem == 2 * D and kw == {"cluster": (ctas, 1, 1)}
        assert len(a) == 13 and all(x is not counter for x in a)   # the ticket form's arguments less the counter
        assert [o.shape for o in out] == [(1, k), (1, k), (1, E), (1, E)]
    call(256)
    name, grid, block, a, smem, kw = rec[-1]
    assert name == "router_fused_e256" and grid == (64, 1) and block == (128,) and kw == {} and a[9] is counter
    n = len(rec)
    with pytest.raises(ValueError, match="handoff 'dsmem' is not one of"):
        call(256, handoff="dsmem")
    with pytest.raises(ValueError, match="handoff 'cluster' takes no ticket counter"):
        call(256, handoff="cluster", counter=counter)
    with pytest.raises(ValueError, match="handoff 'cluster' covers E <= 256 .* got E = 384"):
        call(384, handoff="cluster")
    assert len(rec) == n   # nothing launched by a refused call
    assert RT.cluster_ok(256) and RT.cluster_ok(1) and not RT.cluster_ok(257) and not RT.cluster_ok(0)


def test_cluster_kernels_come_out_wrapped(monkeypatch):
    from memra_dsv4.gpu import kernel_loader, pdl
    monkeypatch.setattr(kernel_loader, "_REGISTRY", dict(kernel_loader._REGISTRY))
    monkeypatch.setattr(kernel_loader, "_CLUSTER", set(kernel_loader._CLUSTER))
    with pytest.raises(ValueError, match="cluster kernel 'k_z' is not among its name expressions"):
        kernel_loader.register("hl_cl", ["k_a"], cluster=["k_z"])
    kernel_loader.register("hl_cl", ["k_a", "k_c"], cluster=["k_c"])
    loader = object.__new__(kernel_loader.KernelLoader)
    loader._pdl, loader._ex = {}, {}
    raw = {"k_a": SimpleNamespace(name="k_a"), "k_c": SimpleNamespace(name="k_c")}
    loader.get_plain = lambda stem, name: raw[name]
    assert loader.get("hl_cl", "k_a") is raw["k_a"]   # a plain kernel stays CuPy's
    w = loader.get("hl_cl", "k_c")
    assert isinstance(w, pdl.ExKernel) and not isinstance(w, pdl.PdlKernel)
    assert w is loader.get("hl_cl", "k_c") and w.name == "k_c"
    with pdl.pdl_launches(True):
        p = loader.get("hl_cl", "k_c")
        assert isinstance(p, pdl.PdlKernel) and p.name == "k_c"


def test_router_cluster_launch_refuses_a_grid_off_the_cluster(monkeypatch):
    """pdl.launch_ex checks the grid against the cluster before it touches the driver."""
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu import pdl
    raw = SimpleNamespace(kernel=SimpleNamespace(ptr=0))
    stream = SimpleNamespace(ptr=0)
    with pytest.raises(ValueError, match=r"router.k: grid \(12, 1, 1\) is not a multiple of the cluster \(8, 1, 1\)"):
        pdl.launch_ex(raw, "router.k", (12,), (512,), (), stream=stream, pdl=False, cluster=(8, 1, 1))
    with pytest.raises(ValueError, match=r"grid \(16, 2, 1\) is not a multiple of the cluster \(16, 3, 1\)"):
        pdl.launch_ex(raw, "router.k", (16, 2), (512,), (), stream=stream, pdl=True, cluster=(16, 3, 1))


def test_router_cluster_kernel_source_contract():
    from tests.test_shared_gateup_cpu import _body
    src = open(os.path.join(ROOT, "kernels_cu", "router.cu"), encoding="utf-8").read()
    assert re.findall(r"^ROUTER_CLUSTER\((\w+), (\d+)\)", src, re.M) == [
        ("router_cluster_e32", "1"), ("router_cluster_e64", "2"), ("router_cluster_e128", "4"),
        ("router_cluster_e256", "8")]
    macro = src[src.index("#define ROUTER_CLUSTER("):src.index("ROUTER_CLUSTER(router_cluster_e32")]
    flat = re.sub(r"[\s\\]+", " ", macro[macro.index("{"):])
    assert flat.startswith("{ PDL_ENTRY_PRELOAD(const RcFirst<EPL> first = rc_preload<EPL>(w, bias, D, E)); "
                           "router_cluster_body<EPL>(")
    body = _body(src, "DEV void router_cluster_body(")
    # the handoff: the split cluster barrier's wait, then one st.async per row into rank 0's
    # shared memory, completing bytes of rank 0's mbarrier; rank 0 waits on it, then selects
    assert body.index("rf_row_dot(first.rows, xs, wrow, row_ok, nc)") < body.index("cluster_started();") \
        < body.index("st_async_cluster_f32(s_sh + e, bar, 0, score)") < body.index("rc_wait_scores(bar);") \
        < body.index("select_topk_warp<EPL>(b, sel, E, k, lane)")
    assert "select_weights_warp(s_sh, sel, idx_out, w_out, k, route_scale, lane)" in body
    for gone in ("last_cta_ticket", "__threadfence", "atomicAdd", "__ldcg", "counter", "barrier.cluster.arrive"):
        assert gone not in body, gone
    pre = _body(src, "DEV RcFirst<EPL> rc_preload(")
    # rank 0 expects E scores of 4 bytes: its mbarrier set up (kernels_cu/cluster.cuh), the init made
    # visible to the cluster, then every thread's relaxed cluster arrive; all after the __trap
    assert pre.index("__trap()") < pre.index("mbar_init_expect(rc_scores_bar(), 4 * E);") \
        < pre.index("fence_mbarrier_init_cluster();") < pre.index("cluster_arrive_relaxed();")
    assert "mbar_wait_cluster(bar, 0);" in _body(src, "DEV void rc_wait_scores(const u64* bar)")
    assert '#include "cluster.cuh"' in src
    for moved in ("DEV void cluster_started(", "DEV void st_async_cluster_f32(", "mbarrier.", "barrier.cluster",
                  "st.async", "mapa.", "fence.mbarrier_init"):   # router.cu's cluster PTX: cluster.cuh only
        assert moved not in re.sub(r"//[^\n]*", "", src), moved
    _cluster_cuh_contract()
    # router_select_* and router_fused_* select through the same two functions
    tok = _body(src, "DEV void select_token_warp(")
    assert "select_topk_warp<EPL>(b, sel, E, k, lane)" in tok and "select_weights_warp(" in tok
    assert "rf_row_dot(first, xs, wrow, row_ok, nc)" in _body(src, "DEV void router_fused_body(")
    from memra_dsv4.gpu.ops import router as RT
    assert set(RT._CLUSTER.values()) <= set(RT.KERNELS)
    from memra_dsv4.gpu import kernel_loader
    assert {("router", n) for n in RT._CLUSTER.values()} <= kernel_loader._CLUSTER


def _cluster_cuh_contract():
    """kernels_cu/cluster.cuh (the cluster kernels' shared PTX, router.cu and hc.cu): each helper's
    PTX, and none of the forms that fence global memory (barrier.cluster.arrive.release compiles to
    MEMBAR.ALL.GPU; membar; fence.acq_rel) anywhere outside the comments."""
    from tests.test_shared_gateup_cpu import _body
    src = open(os.path.join(ROOT, "kernels_cu", "cluster.cuh"), encoding="utf-8").read()
    code = re.sub(r"//[^\n]*", "", src)
    init = _body(code, "DEV void mbar_init_expect(u64* bar, u32 bytes)")
    assert init.index("mbarrier.init.shared::cta.b64 [%0], 1;") \
        < init.index('mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes)')
    assert "fence.mbarrier_init.release.cluster;" in _body(code, "DEV void fence_mbarrier_init_cluster()")
    assert "barrier.cluster.arrive.relaxed.aligned;" in _body(code, "DEV void cluster_arrive_relaxed()")
    assert "barrier.cluster.wait.aligned;" in _body(code, "DEV void cluster_started()")
    assert "mapa.shared::cluster.u32 %0, %1, %2;" in _body(code, "DEV u32 mapa_cluster(")
    st = _body(code, "DEV void st_async_cluster_f32(")
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" in st
    assert st.count("mapa_cluster(") == 2   # the data and the mbarrier, both in CTA rank
    st16 = _body(code, "DEV void st_async_cluster_16(")
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b64 [%0], {%1, %2}, [%3];" in st16
    assert st16.count("mapa_cluster(") == 2
    wait = _body(code, "DEV void mbar_wait_cluster(const u64* bar, u32 parity)")
    assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%1], %2;" in wait
    assert "while (!done)" in wait and "bra" not in wait   # a C++ loop: no PTX label to duplicate
    for bad in ("barrier.cluster.arrive.release", "barrier.cluster.arrive;", "barrier.cluster.arrive.aligned",
                "membar", "fence.acq_rel", "fence.sc"):
        assert bad not in code, bad


def _gateup_kw(monkeypatch, spare_env, handoff_env, shgu="on", E=256):
    return _moe_kw(monkeypatch, E, SHARED_GATEUP_SPARE=spare_env, ROUTER_HANDOFF=handoff_env, SHARED_GATEUP=shgu)[1]


def test_moe_spares_the_router_cluster_ctas(monkeypatch):
    """MEMRA_DSV4_SHARED_GATEUP_SPARE = router: with the cluster router and the shared SwiGLU in the
    gate/up, the gate/up launch leaves its last ceil(E / 16) x 2 CTAs without shared rows; every
    other combination passes no shared_spare_ctas (the twentieth session's launch)."""
    from memra_dsv4.gpu import step_device as SD
    assert SD.SHARED_GATEUP_SPARE_ENV == "MEMRA_DSV4_SHARED_GATEUP_SPARE"
    kw = _gateup_kw(monkeypatch, "router", "cluster")
    assert kw["shared_swiglu"] is not None and kw["shared_spare_ctas"] == 32
    assert _gateup_kw(monkeypatch, "router", "cluster", E=64)["shared_spare_ctas"] == 8
    assert "shared_spare_ctas" not in _gateup_kw(monkeypatch, "none", "cluster")
    assert "shared_spare_ctas" not in _gateup_kw(monkeypatch, "router", "ticket")
    assert "shared_spare_ctas" not in _gateup_kw(monkeypatch, "router", "cluster", shgu="off")
    default = _gateup_kw(monkeypatch, None, "cluster").get("shared_spare_ctas", 0)
    assert default == (32 if SD.SHARED_GATEUP_SPARE_DEFAULT == "router" else 0)
    kw = _gateup_kw(monkeypatch, "grid", "cluster")   # the grid sized for the other 116 SMs
    assert kw["reserve_sms"] == 16 and "shared_spare_ctas" not in kw
    assert "reserve_sms" not in _gateup_kw(monkeypatch, "grid", "ticket")
    monkeypatch.setenv("MEMRA_DSV4_SHARED_GATEUP_SPARE", "all")
    with pytest.raises(ValueError, match="MEMRA_DSV4_SHARED_GATEUP_SPARE='all'.*router, grid or none"):
        SD.shared_gateup_spare()


def test_bench_decode_shspare_arm_sets_the_env():
    from bench.decode_step import _kernel_env
    assert _kernel_env({"shspare": "grid"}, None) == {"MEMRA_DSV4_SHARED_GATEUP_SPARE": "grid"}
    assert _kernel_env({"shspare": "router"}, None) == {"MEMRA_DSV4_SHARED_GATEUP_SPARE": "router"}
    assert _kernel_env({"shspare": "none"}, None) == {"MEMRA_DSV4_SHARED_GATEUP_SPARE": "none"}
