"""MEMRA_DSV4_HC_PRE_HANDOFF (step_device.hc_pre_handoff): the split boundary's critical launch
(ops.hc.hc_boundary_pre) as the last-CTA ticket kernel (hc_boundary_pre, "ticket": 4 D / 256 CTAs,
the last to draw a ticket runs the tail alone) or as one thread-block cluster of D / 256 CTAs x
1024 threads handing the mixes partials and x to each other through DSMEM
(hc_boundary_pre_cluster, "cluster", D % 256 == 0 and D <= 4096), or as the ticket form's grid
where every CTA polls tagged global words for the partials and the norm's chains and writes its
own channels (hc_boundary_pre_coop: "coop" with 8 tail CTAs, "coopall" with all; D in 1024 ..
8192, powers of two).  On the CPU (no GPU):

* the switch: unset -> HC_PRE_HANDOFF_DEFAULT; "ticket" / "cluster" / "coop" / "coopall"; anything else a ValueError
  naming the variable; bench.decode_step's hchand arm sets it;
* the wrapper on fake arrays, with and without f (the fused hc_post): hc_boundary_pre_cluster with
  grid D / 256, block 1024, dynamic smem 4 (D / 256) 256 + 2 D (the partials, x of all channels),
  cluster (D / 256, 1, 1) and the ticket form's 16 leading arguments (no ws / counter); the
  ticket form unchanged (grid 4 D / 256, block 256, its 18 arguments ending in ws, counter);
  refusals (an unknown handoff; cluster at a D that hc_boundary_pre takes but one cluster does
  not cover) name the problem and launch nothing; pre_cluster_ok / pre_cluster_ctas;
* DeviceStep._hc_pre with hc_boundary_pre / hc_boundary_sinkhorn replaced by recorders:
  handoff="cluster" when the switch says so and D = 4096, "ticket" otherwise (D = 7168 falls back);
* the kernel's source: PDL_ENTRY_PRELOAD(bnc_preload) first; bnc_preload: thread 0's init +
  expect_tx of both mbarriers and the init's cluster fence, then the fn loads and the norm
  weight's cp.async, the __trap, then every thread's relaxed cluster arrive; bnc_body computes
  each segment with hc_boundary_pre's phase-A code (bnd_post_elem, bnd_seg_values: bnd_phase_a
  calls the same two), waits for the cluster barrier before its first st.async, for the
  partials' mbarrier before the segment sums (bnd_chain, bnd_mix, pre_value) and for x's before
  the norm's warp_sum; no ticket, no fence, no atomic; the byte counts the mbarriers expect
  equal what the send loops store.
The bytes are the GPU tests' (tests/gpu/test_kernels_hc.py,
tests/gpu/test_step_hc_pre_handoff_gpu.py); tests/test_pdl_preload_sass.py checks the SASS order
around the PDL wait; the cluster.cuh PTX itself: tests/test_router_handoff_cpu.py
(_cluster_cuh_contract)."""
from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hc_pre_handoff_switch(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    assert SD.HC_PRE_HANDOFF_ENV == "MEMRA_DSV4_HC_PRE_HANDOFF"
    assert SD.HC_PRE_HANDOFF_DEFAULT in ("ticket", "cluster")
    monkeypatch.delenv(SD.HC_PRE_HANDOFF_ENV, raising=False)
    assert SD.hc_pre_handoff() == SD.HC_PRE_HANDOFF_DEFAULT
    monkeypatch.setenv(SD.HC_PRE_HANDOFF_ENV, "")
    assert SD.hc_pre_handoff() == SD.HC_PRE_HANDOFF_DEFAULT
    for v in ("ticket", "cluster", "coop", "coopall"):
        monkeypatch.setenv(SD.HC_PRE_HANDOFF_ENV, v)
        assert SD.hc_pre_handoff() == v
    monkeypatch.setenv(SD.HC_PRE_HANDOFF_ENV, "dsmem")
    with pytest.raises(ValueError, match="MEMRA_DSV4_HC_PRE_HANDOFF='dsmem'.*ticket, cluster, coop or coopall"):
        SD.hc_pre_handoff()


def test_bench_decode_hchand_arm_sets_the_env():
    from bench.decode_step import _kernel_env, check_arms
    assert _kernel_env({"hchand": "cluster"}, None) == {"MEMRA_DSV4_HC_PRE_HANDOFF": "cluster"}
    assert _kernel_env({"hchand": "ticket"}, None) == {"MEMRA_DSV4_HC_PRE_HANDOFF": "ticket"}
    assert _kernel_env({"hchand": "coop"}, None) == {"MEMRA_DSV4_HC_PRE_HANDOFF": "coop"}
    assert _kernel_env({"hchand": "coopall"}, None) == {"MEMRA_DSV4_HC_PRE_HANDOFF": "coopall"}
    with pytest.raises(SystemExit, match="hchand='dsmem'"):
        check_arms("path=device+hchand=dsmem")


def _same(a, b) -> bool:
    """One launch argument equal to another: the same array object, or a scalar of the same type
    and value (the null pointers and the scalars are made anew per call)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is b
    return type(a) is type(b) and a == b


def test_hc_pre_cluster_wrapper_launch_and_checks(monkeypatch):
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import hc as HC
    A = fake.asarray
    rec, smem_asked = [], []
    monkeypatch.setattr(HC, "kernel", lambda stem, name: (
        lambda grid, block, a, shared_mem=0, **kw: rec.append((stem, name, grid, block, a, shared_mem, kw))))

    def dyn(kern, n):
        smem_asked.append(n)
        return n
    monkeypatch.setattr(HC, "dynamic_smem", dyn)
    ws, cnt = A(np.zeros(64 * 32, np.float64)), A(np.zeros(1, np.int32))
    monkeypatch.setattr(HC, "split_workspace", lambda n_groups, nseg: (ws, cnt))
    u16 = lambda *s: A(np.zeros(s, np.uint16))
    f32 = lambda *s: A(np.zeros(s, np.float32))

    def args(D, with_f):
        a = dict(streams=u16(1, 4, D), fn=f32(24, 4 * D), scale=f32(3), base=f32(24), norm_weight=u16(D))
        kw = dict(hc_eps=1e-6, norm_eps=1e-5, xn=u16(1, D), x=u16(1, D), pre=f32(1, 4), mixes=f32(1, 24))
        if with_f:
            kw.update(f=u16(1, D), out=u16(1, 4, D), post_in=f32(1, 4), comb_in=f32(1, 4, 4))
        return a, kw

    def call(a, kw, **extra):
        return HC.hc_boundary_pre(a["streams"], a["fn"], a["scale"], a["base"], a["norm_weight"], **kw, **extra)

    assert HC.PRE_HANDOFFS == ("ticket", "cluster", "coop", "coopall")
    for D in (4096, 2048, 1024, 256):
        C = D // 256
        for with_f in (False, True):
            a, kw = args(D, with_f)
            got = call(a, kw, handoff="cluster")
            stem, name, grid, block, ca, smem, ckw = rec[-1]
            assert (stem, name, grid, block) == ("hc", "hc_boundary_pre_cluster", (C,), (1024,))
            assert smem == 4 * C * 256 + 2 * D == smem_asked[-1] and ckw == {"cluster": (C, 1, 1)}
            assert got is (kw["out"] if with_f else a["streams"])
            got_t = call(a, kw, handoff="ticket")
            stem, name, grid, block, ta, tsmem, tkw = rec[-1]
            assert (stem, name, grid, block, tkw) == ("hc", "hc_boundary_pre", (4 * D // 256,), (256,), {})
            assert tsmem == 14 * D and got_t is got
            assert len(ta) == 18 and ta[16] is ws and ta[17] is cnt
            assert len(ca) == 16 and all(_same(x, y) for x, y in zip(ca, ta[:16])), D
            assert not any(x is ws or x is cnt for x in ca)
            # the argument order of hc.cu's hc_boundary_pre_cluster
            assert ca[1] is a["streams"] and ca[5] is a["fn"] and ca[8] is a["norm_weight"]
            assert ca[9] is kw["mixes"] and ca[11] is kw["x"] and ca[12] is kw["xn"]
            assert _same(ca[13], np.int32(D)) and _same(ca[14], np.float32(1e-6)) and _same(ca[15], np.float64(1e-5))
            if with_f:
                assert ca[0] is kw["f"] and ca[2] is kw["post_in"] and ca[3] is kw["comb_in"] and ca[4] is kw["out"]
            else:
                assert all(_same(ca[i], np.uint64(0)) for i in (0, 2, 3, 4))
            call(a, kw)   # the default: the ticket form
            assert rec[-1][1] == "hc_boundary_pre"
    n = len(rec)
    a, kw = args(4096, True)
    with pytest.raises(ValueError, match="handoff 'dsmem' is not one of"):
        call(a, kw, handoff="dsmem")
    for D in (7168, 192):   # hc_boundary_pre's D (4 D % 256 == 0, 4 D <= 32768), not one cluster's
        a, kw = args(D, True)
        call(a, kw, handoff="ticket")   # the ticket form takes it
        assert rec[-1][1] == "hc_boundary_pre" and rec[-1][2] == (4 * D // 256,)
        n = len(rec)
        with pytest.raises(ValueError, match=rf"handoff 'cluster' needs D % 256 == 0 and D <= 4096 .* got D = {D}"):
            call(a, kw, handoff="cluster")
        assert len(rec) == n   # nothing launched by a refused call
    for D in (256, 512, 3840, 4096):
        assert HC.pre_cluster_ok(D) and HC.pre_cluster_ctas(D) == D // 256
    for D in (0, -256, 128, 192, 4160, 4352, 7168, 8192):
        assert not HC.pre_cluster_ok(D), D
    with pytest.raises(AssertionError, match="D = 7168 not covered"):
        HC.pre_cluster_ctas(7168)
    assert HC.PRE_CLUSTER_THREADS == 4 * HC.PRE_CLUSTER_CHANNELS == 4 * HC.SEG


def _hc_pre_calls(monkeypatch, env, D, with_f=False, split=True):
    """DeviceStep._hc_pre of the split boundary (seam hc_split on, eager: no graph branch) on the
    least it reads: cfg, S.v's boundary buffers (NumPy), L's fn / weight accessors (None), with
    ops.hc's hc_boundary_pre / hc_boundary_sinkhorn replaced by recorders.  env: the handoff
    switch's value (None: unset).  Returns (hc_boundary_pre's keyword arguments, the Sinkhorn
    calls)."""
    from memra_dsv4.gpu import step_device as SD
    from memra_dsv4.gpu.ops import hc as HC
    from memra_dsv4.gpu.step_device import DeviceStep
    if env is None:
        monkeypatch.delenv(SD.HC_PRE_HANDOFF_ENV, raising=False)
    else:
        monkeypatch.setenv(SD.HC_PRE_HANDOFF_ENV, env)
    monkeypatch.delenv(SD.HC_JOIN_ENV, raising=False)
    pres, sinks = [], []
    monkeypatch.setattr(HC, "hc_boundary_pre", lambda *a, **kw: pres.append(kw))
    monkeypatch.setattr(HC, "hc_boundary_sinkhorn", lambda *a, **kw: sinks.append(kw))
    monkeypatch.setattr(HC, "hc_boundary", (lambda *a, **kw: pytest.fail("the one-launch boundary")) if split
                        else (lambda *a, **kw: pres.append(kw)))
    ds = object.__new__(DeviceStep)   # no GPU, no model: only what _hc_pre reads
    ds.cfg = SimpleNamespace(hidden_size=D, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    ds.hostmath, ds._forking, ds._hc_split, ds._hc_branch = False, "", split, False
    v = {"hc.post": np.zeros(4, np.float32), "hc.comb": np.zeros(16, np.float32),
         "hc.pre": np.zeros(4, np.float32), "dev.mix": np.zeros((1, 24), np.float32),
         "x": np.zeros(D, np.uint16), "xn": np.zeros(D, np.uint16)}
    S = SimpleNamespace(v=v, hc_pending=False)
    L = SimpleNamespace(f32={"hc_attn_fn": None, "hc_ffn_fn": None}, w=lambda leaf: None)
    streams = np.zeros((1, 4, D), np.uint16)
    if with_f:
        ds._hc_pre(S, L, streams, "ffn", f=np.zeros((1, D), np.uint16), out=np.zeros((1, 4, D), np.uint16))
    else:
        ds._hc_pre(S, L, streams, "attn")
    assert len(pres) == 1 and len(sinks) == (1 if split else 0)
    return pres[0], sinks


def test_hc_pre_passes_the_handoff(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    for with_f in (False, True):
        kw, _ = _hc_pre_calls(monkeypatch, "cluster", 4096, with_f)
        assert kw["handoff"] == "cluster"
        assert ("f" in kw) == with_f and ("post_in" in kw) == with_f
        assert _hc_pre_calls(monkeypatch, "ticket", 4096, with_f)[0]["handoff"] == "ticket"
        assert _hc_pre_calls(monkeypatch, None, 4096, with_f)[0]["handoff"] == SD.HC_PRE_HANDOFF_DEFAULT
        # one cluster covers D % 256 == 0, D <= 4096: else the ticket kernel
        assert _hc_pre_calls(monkeypatch, "cluster", 7168, with_f)[0]["handoff"] == "ticket"
        assert _hc_pre_calls(monkeypatch, "cluster", 192, with_f)[0]["handoff"] == "ticket"
        assert _hc_pre_calls(monkeypatch, "cluster", 256, with_f)[0]["handoff"] == "cluster"
        # the cooperative grid covers D in 1024 .. 8192, powers of two: else the ticket kernel
        assert _hc_pre_calls(monkeypatch, "coop", 4096, with_f)[0]["handoff"] == "coop"
        assert _hc_pre_calls(monkeypatch, "coop", 1024, with_f)[0]["handoff"] == "coop"
        assert _hc_pre_calls(monkeypatch, "coopall", 4096, with_f)[0]["handoff"] == "coopall"
        for D in (7168, 256, 3072):
            assert _hc_pre_calls(monkeypatch, "coop", D, with_f)[0]["handoff"] == "ticket", D
            assert _hc_pre_calls(monkeypatch, "coopall", D, with_f)[0]["handoff"] == "ticket", D
    with pytest.raises(ValueError, match="MEMRA_DSV4_HC_PRE_HANDOFF='both'"):
        _hc_pre_calls(monkeypatch, "both", 4096)
    # with the split off the one-launch boundary runs (no handoff to pass), but a bad value is
    # still refused, not silently ignored
    kw, _ = _hc_pre_calls(monkeypatch, "cluster", 4096, split=False)
    assert "handoff" not in kw
    with pytest.raises(ValueError, match="MEMRA_DSV4_HC_PRE_HANDOFF='both'"):
        _hc_pre_calls(monkeypatch, "both", 4096, split=False)


def _code(path: str) -> str:
    """A kernels_cu file without its // comments (the contract is about the code)."""
    return re.sub(r"//[^\n]*", "", open(os.path.join(ROOT, "kernels_cu", path), encoding="utf-8").read())


def test_hc_pre_cluster_kernel_source_contract():
    from tests.test_shared_gateup_cpu import _body
    src = _code("hc.cu")
    assert '#include "cluster.cuh"' in src
    kern = _body(src, 'extern "C" __global__ void __launch_bounds__(BNC_THREADS, 1)\nhc_boundary_pre_cluster(')
    flat = re.sub(r"\s+", " ", kern)
    assert flat == ("{ __shared__ __align__(16) u16 w_s[MIX_SEG]; "
                    "PDL_ENTRY_PRELOAD(const BndFn fr = bnc_preload(fn, norm_w, w_s, D)); "
                    "bnc_body(fr, f, R, post_in, comb_in, out, scale, base, w_s, mixes, pre_out, x_out, xn_out, D, "
                    "hc_eps, norm_eps); }"), flat
    assert "constexpr int BNC_THREADS = HC * BND_THREADS;" in src
    # before the wait: thread 0's mbarriers and their cluster fence first (a fence behind the
    # weight's cp.async waits for the copy), then the static loads, the __trap (ends the block),
    # then every thread's arrive
    pre = _body(src, "DEV BndFn bnc_preload(")
    order = ["if (threadIdx.x == 0)", "mbar_init_expect(&b->part, (u32)(nseg * 32 * sizeof(double)));",
             "mbar_init_expect(&b->x, (u32)(2 * D));", "fence_mbarrier_init_cluster();",
             "bnd_fn_at(fn, D, q * C + r, wid8)",
             "cp_async16(w_s + 8 * threadIdx.x, norm_w + MIX_SEG * r + 8 * threadIdx.x, true)",
             "cp_async_commit()", "if (D < 0) __trap();", "cluster_arrive_relaxed();", "return fr;"]
    at = [pre.index(s) for s in order]
    assert at == sorted(at), list(zip(order, at))
    t0 = _body(pre, "if (threadIdx.x == 0)")
    assert "fence_mbarrier_init_cluster();" in t0 and "cluster_arrive_relaxed" not in t0   # every thread arrives
    for bad in ("R[", "f[", "__ldg(", "__ldcg(", "ldg16(", "stg16(", "out[", "cluster_started", "st_async",
                "mbar_wait_cluster", "asm"):   # nothing of the predecessor's, nothing remote, no PTX here
        assert bad not in pre, bad
    body = _body(src, "DEV void bnc_body(")
    # phase A: hc_boundary_pre's code (bnd_phase_a calls the same two), slot layout 4 w + lane
    assert "bnd_post_elem(f, R, post_in, comb_in, D, q, d)" in body
    assert "bnd_seg_values(fr, xf, lane)" in body and "stage[q * 32 + 4 * wid8 + lane] = v" in body
    pa = _body(src, "DEV double bnd_phase_a(")
    assert "bnd_post_elem(f, R, post_in, comb_in, D, j, d)" in pa and "return bnd_seg_values(fr, xf, lane);" in pa
    assert "__fma_rn" not in pa and "__dadd_rn" not in pa   # the arithmetic lives in the shared helpers only
    assert "bnd_phase_a(fr, f, R, post_in, comb_in, out, norm_w, D, seg_s)" in _body(src, "DEV void bnd_lastcta(")
    assert "ws[sg * 32 + 4 * wid + lane] = val" in _body(src, "DEV void bnd_lastcta(")
    # the handoff order
    i_seg = body.index("bnd_seg_values(")
    i_started = body.index("cluster_started();")
    i_st1 = body.index("st_async_cluster_16(part + (qq * C + r) * 32 + slot, &bars->part, (u32)c,")
    i_wpart = body.index("mbar_wait_cluster(&bars->part, 0);")
    i_chain, i_mix = body.index("bnd_chain(part, lane, nseg)"), body.index("bnd_mix(tot, tot_sq, n, norm_eps)")
    i_pre = body.index("pre_value(m, scale[0], base[lane], hc_eps)")
    i_st2 = body.index("st_async_cluster_16(xall + MIX_SEG * r + 8 * k, &bars->x, (u32)c,")
    i_wx = body.index("mbar_wait_cluster(&bars->x, 0);")
    i_sum = body.index("ss = warp_sum(ss);")
    i_bar = body.index("bar_lower_quarter();")
    assert i_seg < i_started < i_st1 < i_wpart < i_chain < i_mix < i_pre < i_st2 < i_wx < i_sum < i_bar
    assert body.count("cluster_started();") == 1 and body.count("st_async_cluster_16(") == 2
    assert body.count("mbar_wait_cluster(") == 2
    # the bytes each mbarrier expects = what the send loops store into every CTA: C senders x
    # 64 chunks of 16 B (the 4 segments' 32 doubles) = nseg * 32 * 8; C x 32 chunks of 8 channels = 2 D
    assert "for (int i = threadIdx.x; i < C * 64; i += BNC_THREADS)" in body
    assert "const int c = i >> 6, k = i & 63, qq = k >> 4, slot = 2 * (k & 15);" in body
    assert "for (int i = threadIdx.x; i < C * 32; i += BNC_THREADS)" in body
    assert "const int c = i >> 5, k = i & 31;" in body
    assert "const int C = gridDim.x, r = blockIdx.x, nseg = HC * C, n = HC * D;" in body
    # only rank 0 stores the 24 mixes and pre; every CTA its own 256 channels of x / xn
    assert "if (r == 0 && lane < BND_ROWS) mixes[lane] = m;" in body and "if (r == 0) pre_out[lane] = p;" in body
    for o in ("x_out", "xn_out"):
        assert f"stg16({o} + MIX_SEG * r + 8 * threadIdx.x," in body, o
    assert body.index("cp_async_wait<0>();") > i_bar   # the norm weight's cp.async (bnc_preload) waited for last
    for gone in ("last_cta_ticket", "__threadfence", "atomicAdd", "atomicExch", "counter", "ws[",
                 "barrier.cluster.arrive", "fence", "asm"):
        assert gone not in body, gone
    from memra_dsv4.gpu import kernel_loader
    from memra_dsv4.gpu.ops import hc as HC
    assert "hc_boundary_pre_cluster" in HC.KERNELS and ("hc", "hc_boundary_pre_cluster") in kernel_loader._CLUSTER
    assert ("hc", "hc_boundary_pre") not in kernel_loader._CLUSTER   # the ticket form launches plain


def test_hc_pre_coop_wrapper_launch_and_checks(monkeypatch):
    """handoff="coop" / "coopall": hc_boundary_pre_coop on the ticket form's grid (4 D / 256) and
    block (256), no dynamic shared memory, the ticket form's 16 leading arguments then n_tail (8;
    all D / 64) and the per-device slots (in place of ws / counter); D outside pre_coop_ok refused
    before any launch, naming D."""
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import hc as HC
    A = fake.asarray
    rec = []
    monkeypatch.setattr(HC, "kernel", lambda stem, name: (
        lambda grid, block, a, shared_mem=0, **kw: rec.append((stem, name, grid, block, a, shared_mem, kw))))
    monkeypatch.setattr(HC, "dynamic_smem", lambda kern, n: n)
    ws, cnt = A(np.zeros(128 * 32, np.float64)), A(np.zeros(1, np.int32))
    slots = A(np.zeros(HC.COOP_SLOT_INT32, np.int32))
    monkeypatch.setattr(HC, "split_workspace", lambda n_groups, nseg: (ws, cnt))
    monkeypatch.setattr(HC, "coop_slots", lambda: slots)
    u16 = lambda *s: A(np.zeros(s, np.uint16))
    f32 = lambda *s: A(np.zeros(s, np.float32))
    assert HC.COOP_TAIL_CTAS == 8
    for D in (1024, 2048, 4096, 8192):
        for with_f in (False, True):
            a = dict(streams=u16(1, 4, D), fn=f32(24, 4 * D), scale=f32(3), base=f32(24), norm_weight=u16(D))
            kw = dict(hc_eps=1e-6, norm_eps=1e-5, xn=u16(1, D), x=u16(1, D), pre=f32(1, 4), mixes=f32(1, 24))
            if with_f:
                kw.update(f=u16(1, D), out=u16(1, 4, D), post_in=f32(1, 4), comb_in=f32(1, 4, 4))
            call = lambda h: HC.hc_boundary_pre(a["streams"], a["fn"], a["scale"], a["base"], a["norm_weight"],
                                                handoff=h, **kw)
            call("ticket")
            ta = rec[-1][4]
            for h, n_tail in (("coop", 8), ("coopall", D // 64)):
                got = call(h)
                stem, name, grid, block, ca, smem, ckw = rec[-1]
                assert (stem, name, grid, block, smem, ckw) == ("hc", "hc_boundary_pre_coop", (D // 64,), (256,), 0, {})
                assert got is (kw["out"] if with_f else a["streams"])
                assert len(ca) == 18 and _same(ca[16], np.int32(n_tail)) and ca[17] is slots, (h, D)
                assert all(_same(x, y) for x, y in zip(ca[:16], ta[:16])), D
                assert HC.coop_tail_ctas(D, h) == n_tail
    assert HC.pre_launch_shape(4096, "coop") == dict(grid=(64,), block=(256,), shared_mem=0, smem_optin=0,
                                                      cluster=None)
    for D in (1024, 2048, 4096, 8192):
        assert HC.pre_coop_ok(D)
    for D in (0, 64, 256, 512, 3072, 6144, 7168, 16384):
        assert not HC.pre_coop_ok(D), D
    # the step's fallback asks pre_handoff_covers: every D for the ticket form, else the form's own
    for D in (64, 192, 256, 1024, 3072, 4096, 7168, 8192):
        assert HC.pre_handoff_covers(D, "ticket")
        assert HC.pre_handoff_covers(D, "cluster") == HC.pre_cluster_ok(D)
        for h in HC.COOP_HANDOFFS:
            assert HC.pre_handoff_covers(D, h) == HC.pre_coop_ok(D), (h, D)
    with pytest.raises(AssertionError, match="handoff 'dsmem' is not one of"):
        HC.pre_handoff_covers(4096, "dsmem")
    for D in (7168, 256, 3072):   # the ticket form takes them, the cooperative grid refuses them
        a = dict(streams=u16(1, 4, D), fn=f32(24, 4 * D), scale=f32(3), base=f32(24), norm_weight=u16(D))
        kw = dict(hc_eps=1e-6, norm_eps=1e-5, xn=u16(1, D), x=u16(1, D), pre=f32(1, 4), mixes=f32(1, 24))
        for h in ("coop", "coopall"):
            n = len(rec)
            with pytest.raises(ValueError, match=rf"handoff '{h}' needs D in \(1024, 2048, 4096, 8192\) .* got D = {D}"):
                HC.hc_boundary_pre(a["streams"], a["fn"], a["scale"], a["base"], a["norm_weight"], handoff=h, **kw)
            assert len(rec) == n   # nothing launched by a refused call
    # the slot buffer's size is the kernel's: round 1 [128][32][2] u64, round 2 [128][2] u64, epoch
    src = _code("hc.cu")
    assert "constexpr int BCO_R1_WORDS = MIX_MAX_SEG * 32 * 2;" in src and "constexpr int MIX_MAX_SEG = 128;" in src
    assert "constexpr int BCO_R2_WORDS = 128 * 2;" in src
    assert HC.COOP_SLOT_INT32 == 2 * (128 * 32 * 2 + 128 * 2) + 2
    # the kernel's static bounds hold for every covered D and tail count: own channels D / NT <=
    # BCO_MAX_CH, polled values 5 + ceil((20 - k) / NT) <= BCO_MAXV, NT | 128
    assert "constexpr int BCO_MAX_CH = 1024;" in src and "constexpr int BCO_MAXV = 8;" in src
    for D in (1024, 2048, 4096, 8192):
        for h in ("coop", "coopall"):
            nt = HC.coop_tail_ctas(D, h)
            assert 128 % nt == 0 and D // nt <= 1024 and nt <= D // 64
            assert max(5 + ((20 - k + nt - 1) // nt if k < 20 else 0) for k in range(nt)) <= 8


def test_hc_pre_coop_kernel_source_contract():
    """hc_boundary_pre_coop: before the PDL wait only the static loads (fn rows, the norm weight of
    a tail CTA's own chunks); the tag read after the wait; phase A is the ticket form's
    (bnd_phase_a); each slot value goes out tagged, and CTAs past the tail leave; a tail CTA forms
    S of its own channels with bnd_post_chunk (no CTA reads another's out: no fence), polls, and
    uses the ticket form's expressions (bnd_mix, pre_value, bnd_ss_chunk, warp_sum, bnd_norm_rsqrt,
    bnd_xn_chunk); CTA 0 stores the epoch only after the round-2 poll and its barriers; no
    ticket, no atomic."""
    from tests.test_shared_gateup_cpu import _body
    src = _code("hc.cu")
    kern = _body(src, 'extern "C" __global__ void __launch_bounds__(BND_THREADS, 1)\nhc_boundary_pre_coop(')
    flat = re.sub(r"\s+", " ", kern)
    assert flat == ("{ PDL_ENTRY_PRELOAD(const BcoPre pl = bco_preload(fn, norm_w, D, n_tail)); "
                    "bco_body(pl, f, R, post_in, comb_in, out, scale, base, norm_w, mixes, pre_out, x_out, xn_out, D, "
                    "hc_eps, norm_eps, n_tail, slots); }"), flat
    pre = _body(src, "DEV BcoPre bco_preload(")
    order = ["bnd_fn_at(fn, D, blockIdx.x, threadIdx.x >> 5)",
             "ldg16(norm_w + 8 * bco_chunk(blockIdx.x, threadIdx.x, D, NT))", "if (D < 0) __trap();", "return p;"]
    at = [pre.index(s) for s in order]
    assert at == sorted(at), list(zip(order, at))
    for bad in ("R[", "f[", "post_in", "comb_in", "slots", "epoch", "stg16(", "ld_relaxed", "st_relaxed", "fence"):
        assert bad not in pre, bad
    body = _body(src, "DEV void bco_body(")
    seq = ["const u32 e = ld_relaxed_gpu_u32(epoch_p);",
           "bnd_phase_a(pl.fr, f, R, post_in, comb_in, out, norm_w, D, seg_s)",
           "bco_publish(r1 + 2 * (k * 32 + 4 * wid + lane), val, tag)",
           "if (k >= NT) return;",
           "bnd_post_chunk(f, R, post_in, comb_in, D, st, c) : ldg16(R + (i64)st * D + 8 * c)",
           "ld_relaxed_gpu(r1 + 2 * ((rem >> 1) * 32 + bco_slot(bco_row(v, k, NT))) + (rem & 1))",
           "tot = __dadd_rn(tot, v8[j])", "bnd_mix(tot, tot_sq, n, norm_eps)",
           "pre_value(m, scale[0], base[lane], hc_eps)",
           "__dmul_rn((double)pre_s[i], (double)bf16_to_f32(own_s[i * own_ch + q]))",
           "bnd_ss_chunk(", "bco_publish(r2 + 2 * (k * P + threadIdx.x), ss, tag)",
           "word = ld_relaxed_gpu(r2 + threadIdx.x);", "ss = warp_sum(ss);",
           "if (k == 0 && threadIdx.x == 0) st_relaxed_gpu_u32(epoch_p, tag);",
           "bnd_norm_rsqrt(red, D, norm_eps)", "bnd_xn_chunk("]
    pos, at = 0, []
    for t in seq:   # in this order, each after the previous one
        i = body.index(t, pos)
        at.append(i)
        pos = i + 1
    # the epoch store follows the barriers after the round-2 poll (every CTA has read the epoch)
    i_poll2, i_epoch = body.index("word = ld_relaxed_gpu(r2 + threadIdx.x);"), body.index("st_relaxed_gpu_u32(epoch_p")
    assert body[i_poll2:i_epoch].count("__syncthreads();") == 2
    assert "const u32 tag = e + 1u == 0u ? 1u : e + 1u;" in body   # tag 0 (zeroed slots) never used
    # only the tagged words cross CTAs: no CTA reads another's out, so no fence and no copy of out
    for gone in ("last_cta_ticket", "__threadfence", "atomicAdd", "atomicExch", "counter", "ws[", "fence",
                 "cp_async", " out[", "(out", " out +"):
        assert gone not in body, gone
    assert "if (k == 0) {" in body and "mixes[lane] = m;" in body and "pre_out[lane] = p;" in body
    assert "mixes[bco_row(lane, k, NT)] = m;" in body
    # S of the own chunks is hc_post's arithmetic of phase A: bnd_post_elem and bnd_post_chunk
    # both end in bnd_post_value, the one place of the expression
    pe, pc = _body(src, "DEV u16 bnd_post_elem("), _body(src, "DEV uint4 bnd_post_chunk(")
    assert "return bnd_post_value(pj, cj, fb, rb);" in pe and "bnd_post_value(pj, cj, fw[e >> 1] >> sh, rb)" in pc
    for b in (pe, pc):
        assert "__dmul_rn" not in b and "__dadd_rn" not in b
    from memra_dsv4.gpu.ops import hc as HC
    assert "hc_boundary_pre_coop" in HC.KERNELS
