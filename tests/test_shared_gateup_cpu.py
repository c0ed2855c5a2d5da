"""MEMRA_DSV4_SHARED_GATEUP (step_device.shared_gateup_on): the shared expert's SwiGLU computed by
the routed gate/up's launch (experts.cu gemv_*_gateup_k4_f_sh, before its PDL wait) instead of
its own gemv_bf16_swiglu launch on the MoE side branch.  On the CPU (no GPU):

* the switch: unset / "on" -> in the gate/up (the default since the twentieth session); "off" ->
  the separate launch; anything else a ValueError naming the variable;
* DeviceStep._moe with the kernels replaced by recorders: with "on" no gemv_bf16_swiglu, no MoE
  fork (unless the ffn Sinkhorn rides it), gemv_fp4_gateup gets shared_swiglu = (w1, w3, sh_h,
  swiglu_limit), and a separate shared w2 GEMV (w2 gemv form) comes after the gate/up that now
  writes its input; where the kernel does not apply (FP8-stored w1 / w3, other shapes, the general
  or the ring kernels) the launches are the "off" ones;
* the wrapper on fake arrays: the _k4_f_sh kernel, its grid (_k4_f's) and arguments, and every
  refusal (dtype, shape, impl, more than one x row, the ring, too many outputs for the grid's warps);
* the kernels' source: the _sh kernels open with PDL_ENTRY_PRELOAD, read x through __ldcg, and
  compute the rows only through gemv_bf16_row.cuh's bf16_rows_dot_k_by (gemv_bf16_swiglu's row
  code, so the same bits); bench.decode_step's shgu arm sets the variable.
The bytes are the GPU tests' (tests/gpu/test_kernels_experts.py gateup_shared,
tests/gpu/test_step_shared_gateup_gpu.py); tests/test_pdl_preload_sass.py checks the SASS order
(weight loads before the wait, no global store before it)."""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shared_gateup_switch(monkeypatch):
    from memra_dsv4.gpu import step_device as SD
    assert SD.SHARED_GATEUP_ENV == "MEMRA_DSV4_SHARED_GATEUP"
    monkeypatch.delenv(SD.SHARED_GATEUP_ENV, raising=False)
    assert SD.SHARED_GATEUP_DEFAULT == "on" and SD.shared_gateup_on()
    monkeypatch.setenv(SD.SHARED_GATEUP_ENV, "on")
    assert SD.shared_gateup_on()
    monkeypatch.setenv(SD.SHARED_GATEUP_ENV, "off")
    assert not SD.shared_gateup_on()
    monkeypatch.setenv(SD.SHARED_GATEUP_ENV, "1")
    with pytest.raises(ValueError, match="MEMRA_DSV4_SHARED_GATEUP='1'.*on or off"):
        SD.shared_gateup_on()


def _moe_log(monkeypatch, env, fork, w2_form="fused", *, fp8=False, D=4096, I=2048, ride=False,
             fp4_full="", ring=""):
    from tests.test_decode_shared_w2_cpu import buffer_name, moe_buffers, run_moe

    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.ops import router as RT
    for var, val in (("MEMRA_DSV4_SHARED_GATEUP", env), ("MEMRA_DSV4_FP4_FULL", fp4_full),
                     ("MEMRA_DSV4_FP4_RING", ring)):
        if val is None or val == "":
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, val)
    v = moe_buffers(D, I)
    w1, w3, w2 = (np.zeros((I, D), np.uint8 if fp8 else np.uint16), np.zeros((I, D), np.uint8 if fp8 else np.uint16),
                  np.zeros((D, I), np.uint16))
    scale = np.zeros((I // 128, D // 128), np.uint8) if fp8 else None
    weights = {"ffn.shared_experts.w1": (w1, scale), "ffn.shared_experts.w3": (w3, scale),
               "ffn.shared_experts.w2": (w2, None)}
    log = []

    def gateup(*a, shared_swiglu=None, **kw):
        if shared_swiglu is None:
            log.append(("gateup",))
        else:
            sw1, sw3, sh, lim = shared_swiglu
            log.append(("gateup+shared", sw1 is w1, sw3 is w3, buffer_name(v, sh), lim))
    monkeypatch.setattr(DK, "gemv_bf16_swiglu", lambda *a, **kw: log.append(("swiglu",)))
    monkeypatch.setattr(DK, "gemv_bf16", lambda w, x, y, **kw: log.append(("w2", buffer_name(v, x))))
    monkeypatch.setattr(RT, "fused", lambda *a, **kw: log.append(("router",)))
    monkeypatch.setattr(EX, "gemv_fp4_gateup", gateup)
    monkeypatch.setattr(EX, "gemv_fp4_down_combine", lambda *a, **kw: log.append(("down",)))
    S = run_moe(v, log, fork, w2_form, lambda leaf: weights[leaf], D, I, swiglu_limit=7.0,
                ride=(lambda: log.append(("sinkhorn",))) if ride else None)
    if ride:
        assert S.hc_ride is None   # consumed
    return log


@pytest.mark.parametrize("fork", ["", "all"])
def test_moe_launches_with_shared_in_gateup(monkeypatch, fork):
    shared = ("gateup+shared", True, True, "moe.sh_h", 7.0)
    # fused w2 (the default): router, then the one gate/up launch, then the down; no fork
    assert _moe_log(monkeypatch, "on", fork) == [("router",), shared, ("down",)]
    # the w2 as its own launch reads sh_h, which the gate/up launch writes: after it
    assert _moe_log(monkeypatch, "on", fork, "gemv") == [("router",), shared, ("w2", "moe.sh_h"), ("down",)]
    # "off" keeps the side-branch launches; unset is the default, "on"
    off = _moe_log(monkeypatch, "off", fork)
    assert ("swiglu",) in off and ("gateup",) in off and shared not in off
    assert _moe_log(monkeypatch, None, fork) == _moe_log(monkeypatch, "on", fork)
    if fork:
        assert off == [("fork",), ("side",), ("swiglu",), ("main",), ("router",), ("gateup",), ("join",), ("down",)]


def test_moe_shared_in_gateup_keeps_the_ffn_sinkhorn_ride(monkeypatch):
    """MEMRA_DSV4_HC_JOIN=ride hands _moe the ffn boundary's Sinkhorn for the MoE side stream: with
    the shared SwiGLU in the gate/up the side stream carries the Sinkhorn alone, joined after the
    gate/up (as before: before the down + combine)."""
    got = _moe_log(monkeypatch, "on", "all", ride=True)
    assert got == [("fork",), ("side",), ("sinkhorn",), ("main",), ("router",),
                   ("gateup+shared", True, True, "moe.sh_h", 7.0), ("join",), ("down",)]


@pytest.mark.parametrize("case", ["fp8", "small", "general", "ring"])
def test_moe_shared_in_gateup_falls_back(monkeypatch, case):
    """Where _k4_f_sh does not apply, "on" launches what "off" does: FP8-stored shared w1 / w3,
    shapes other than Flash's, the general kernels (MEMRA_DSV4_FP4_FULL=0), the ring gate/up."""
    kw = {"fp8": dict(fp8=True), "small": dict(D=256, I=128), "general": dict(fp4_full="0"),
          "ring": dict(ring="1")}[case]
    for fork in ("", "all"):
        assert _moe_log(monkeypatch, "on", fork, **kw) == _moe_log(monkeypatch, "off", fork, **kw)


def test_shared_gateup_wrapper_launch_and_checks(monkeypatch):
    """gemv_fp4_gateup(shared_swiglu=...) on fake arrays: the _k4_f_sh kernel with _k4_f's grid and
    arguments plus (sw1, sw3, sh, O_sh, sh_limit); the refusals name what is wrong."""
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import experts as EX
    A = fake.asarray
    rec = []
    monkeypatch.setattr(EX, "kernel", lambda stem, name: (
        lambda grid, block, a, shared_mem=0: rec.append((name, grid, block, a, shared_mem))))
    monkeypatch.setattr(EX, "sm_count", lambda: 132)
    for var in ("MEMRA_DSV4_FP4_FULL", "MEMRA_DSV4_FP4_RING"):
        monkeypatch.delenv(var, raising=False)
    D, I, k = 4096, 2048, 6
    x, ids, tab = A(np.zeros((1, D), np.uint16)), A(np.zeros(k, np.int32)), A(np.zeros(4, np.uint64))
    sw1, sw3, sh = A(np.zeros((I, D), np.uint16)), A(np.zeros((I, D), np.uint16)), A(np.zeros(I, np.uint16))
    out = A(np.zeros((k, I), np.uint16))
    wts = A(np.zeros(k, np.float32))
    EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k,
                       shared_swiglu=(sw1, sw3, sh, 7.0))
    name, grid, block, a, smem = rec[-1]
    assert name == "gemv_mxfp4_gateup_k4_f_sh" and block == (256,) and smem == 0
    plain = []
    monkeypatch.setattr(EX, "kernel", lambda stem, n: (lambda g, b, args, shared_mem=0: plain.append((n, g, args))))
    EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k)
    assert plain[-1][0] == "gemv_mxfp4_gateup_k4_f" and plain[-1][1] == grid == (44, k)   # 264 CTAs
    assert len(a) == len(plain[-1][2]) + 6 and all(p is q for p, q in zip(a[:15], plain[-1][2])
                                                   if not isinstance(p, (np.generic, float, int)))
    # sw1, sw3, sh, O_sh, W_sh (every warp of the 264 CTAs: 2112), sh_limit
    assert a[15] is sw1 and a[16] is sw3 and a[17] is sh and int(a[18]) == I and int(a[19]) == 2112
    assert float(a[20]) == 7.0
    # shared_spare_ctas: the last CTAs' warps carry no shared rows (W_sh = 8 x (264 - spare))
    for spare, w_sh in ((32, 1856), (256, 64), (0, 2112)):
        EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k,
                           shared_swiglu=(sw1, sw3, sh, 7.0), shared_spare_ctas=spare)
        assert int(plain[-1][2][19]) == w_sh and plain[-1][1] == (44, k)
    # reserve_sms: the grid sized for the SMs a concurrent kernel leaves, 2 CTAs each, rounded down
    # (116 SMs: 232 // 6 = 38 CTAs per slot, 228 in all; W_sh every warp of them)
    EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k,
                       shared_swiglu=(sw1, sw3, sh, 7.0), reserve_sms=16)
    assert plain[-1][1] == (38, k) and int(plain[-1][2][19]) == 8 * 38 * k
    assert EX._fp4_grid_x(I, EX.GATEUP_ROWS_PER_GROUP, k) == 44   # reserve 0: the rounding up as before
    with pytest.raises(AssertionError, match="apply to the shared_swiglu launch only"):
        EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k,
                           reserve_sms=16)
    with pytest.raises(AssertionError, match="apply to the shared_swiglu launch only"):
        EX.gemv_fp4_gateup("mxfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, limit=10.0, out=out, x_div=k,
                           shared_spare_ctas=4)
    monkeypatch.setattr(EX, "kernel", lambda stem, n: (
        lambda g, b, args, shared_mem=0: rec.append((n, g, b, args, shared_mem))))
    monkeypatch.setattr(EX, "kernel", lambda stem, n: (
        lambda g, b, args, shared_mem=0: rec.append((n, g, b, args, shared_mem))))
    EX.gemv_fp4_gateup("nvfp4", x, ids, tab, tab, tab, tab, I, D, weight=wts, out=out, x_div=k,
                       ws2_1=A(np.zeros(4, np.float32)), ws2_3=A(np.zeros(4, np.float32)),
                       shared_swiglu=(sw1, sw3, sh, 7.0))
    assert rec[-1][0] == "gemv_nvfp4_gateup_k4_f_sh"

    def call(**kw):
        args = dict(x=x, sw1=sw1, sw3=sw3, sh=sh, impl=None, ids=ids, out=out, spare=0, reserve=0)
        args.update(kw)
        EX.gemv_fp4_gateup("mxfp4", args["x"], args["ids"], tab, tab, tab, tab, I, D, out=args["out"],
                           x_div=k, impl=args["impl"], shared_swiglu=(args["sw1"], args["sw3"], args["sh"], 7.0),
                           shared_spare_ctas=args["spare"], reserve_sms=args["reserve"])
    n = len(rec)
    with pytest.raises(AssertionError, match="shared_swiglu.sw1: dtype uint8"):   # FP8-stored: not supported
        call(sw1=A(np.zeros((I, D), np.uint8)))
    with pytest.raises(AssertionError, match="shared_swiglu.sw3: shape"):
        call(sw3=A(np.zeros((I, D // 2), np.uint16)))
    with pytest.raises(AssertionError, match="sw1 == sw3 shapes"):
        call(sw3=A(np.zeros((I - 2, D), np.uint16)))
    with pytest.raises(AssertionError, match="shared_swiglu.sh: 2040 elements"):
        call(sh=A(np.zeros(I - 8, np.uint16)))
    with pytest.raises(AssertionError, match="shared_swiglu.sh: dtype float32"):
        call(sh=A(np.zeros(I, np.float32)))
    with pytest.raises(AssertionError, match="impl 'simt'"):
        call(impl="mma")
    with pytest.raises(AssertionError, match="one x row"):   # two tokens: the shared part is one token's
        call(x=A(np.zeros((2, D), np.uint16)), ids=A(np.zeros(2 * k, np.int32)), out=A(np.zeros((2 * k, I), np.uint16)))
    monkeypatch.setenv("MEMRA_DSV4_FP4_RING", "1")
    with pytest.raises(AssertionError, match="not the ring"):
        call()
    monkeypatch.delenv("MEMRA_DSV4_FP4_RING")
    with pytest.raises(AssertionError, match=r"O_sh 2048 > 32 x 56 warps \(257 spare CTAs of 264\)"):
        call(spare=257)
    with pytest.raises(AssertionError, match=r"shared_spare_ctas 264 outside 0 .. 263"):
        call(spare=264)
    with pytest.raises(AssertionError, match=r"shared_spare_ctas -1 outside"):
        call(spare=-1)
    with pytest.raises(AssertionError, match=r"reserve_sms 132 outside 0 .. 131 \(the GPU has 132 SMs\)"):
        call(reserve=132)
    monkeypatch.setattr(EX, "sm_count", lambda: 1)    # 1 CTA x 8 warps per slot: 48 warps x 32 < 2048 outputs
    with pytest.raises(AssertionError, match="O_sh 2048 > 32 x 48 warps"):
        call()
    assert len(rec) == n   # nothing launched by a refused call
    assert EX.gateup_shared_ok(I, D, np.zeros((1, D), np.uint16), np.zeros((I, D), np.uint16),
                               np.zeros((I, D), np.uint16))
    assert not EX.gateup_shared_ok(I, 1024, np.zeros((1, 1024), np.uint16), np.zeros((I, 1024), np.uint16),
                                   np.zeros((I, 1024), np.uint16))


def _body(src: str, head: str) -> str:
    """The brace-balanced body after the first occurrence of ``head``."""
    i = src.index(head)
    j = src.index("{", i)
    depth = 0
    for n in range(j, len(src)):
        depth += {"{": 1, "}": -1}.get(src[n], 0)
        if depth == 0:
            return src[j:n + 1]
    raise AssertionError(f"unbalanced body after {head!r}")


def test_shared_gateup_kernel_source_contract():
    """The _sh kernels exist (mx, nv) and open with PDL_ENTRY_PRELOAD running SharedSwigluPre's
    before_wait, whose x reads are __ldcg and whose row dots go only through bf16_rows_dot_k_by
    (gemv_bf16_row.cuh: THE ORDER of decode.cu's gemv_bf16_swiglu) with its rounding and SwiGLU;
    the store of sh is in after_wait, behind the wait."""
    ex = open(os.path.join(ROOT, "kernels_cu", "experts.cu"), encoding="utf-8").read()
    assert re.findall(r"^GEMV_FP4_GATEUP_SH\((\w+),", ex, re.M) == [
        "gemv_mxfp4_gateup_k4_f_sh", "gemv_nvfp4_gateup_k4_f_sh"]
    macro = ex[ex.index("#define GEMV_FP4_GATEUP_SH("):]
    macro = macro[:macro.index("GEMV_FP4_GATEUP_SH(gemv_mxfp4")]
    body = macro[macro.index("{"):]
    flat = re.sub(r"[\s\\]+", " ", body)
    assert flat.startswith(
        "{ PDL_ENTRY_PRELOAD(SharedSwigluPre pre; pre.before_wait(x, sw1, sw3, O_sh, W_sh, sh_limit)); "
        "pre.after_wait(sh, O_sh, W_sh); gemv_fp4_gateup_body<4, NV, true>(")
    pre = _body(ex, "DEV void before_wait(const u16* __restrict__ x, const u16* __restrict__ w1")
    assert "__ldcg(" in pre and "__ldg(" not in pre and "ldg16(" not in pre
    assert "bf16_rows_dot_k_by<2, SH_SWIGLU_K, 2>(Bf16RowsGlobal<2>{rows}, Bf16XShared{xsh}" in pre
    assert "swiglu_value(round_bf16(d[0]), round_bf16(d[1]), 1.0f, false, limit)" in pre
    for own in ("__fmaf_rn", "__fadd_rn", "bf16_trip_fma", "partials_total"):
        assert own not in pre, own
    assert not re.search(r"\bsh\[", pre)   # no store of sh before the wait
    assert "__trap()" in pre   # ends the basic block: ptxas keeps the wait after the loads
    aw = _body(ex, "DEV void after_wait(u16* __restrict__ sh, int O_sh, int W_sh)")
    assert "if (w < W_sh && o < O_sh) sh[o] = (u16)kept" in aw and "o = w + (int)(threadIdx.x & 31) * W_sh" in aw
    assert "for (int o = w; w < W_sh && o < O_sh; o += W_sh, ++j)" in pre   # the same warp -> output map
    dec = open(os.path.join(ROOT, "kernels_cu", "decode.cu"), encoding="utf-8").read()
    # gemv_bf16_swiglu's epilogue, the one the _sh kernels repeat
    assert "swiglu_value(g, u, 1.0f, false, limit)" in _body(dec, "DEV void gemv_swiglu_rows(")
    from memra_dsv4.gpu.ops import experts as EX
    assert {"gemv_mxfp4_gateup_k4_f_sh", "gemv_nvfp4_gateup_k4_f_sh"} <= set(EX.KERNELS)


def test_bench_decode_shgu_arm_sets_the_env():
    from bench.decode_step import _kernel_env
    assert _kernel_env({"shgu": "on"}, None) == {"MEMRA_DSV4_SHARED_GATEUP": "on"}
    assert _kernel_env({"shgu": "off"}, None) == {"MEMRA_DSV4_SHARED_GATEUP": "off"}
