"""The shared-w2 seam of the device step on the CPU (MEMRA_DSV4_DECODE_SHARED_W2): the seam's
resolution, DeviceStep.shared_w2_form, the bench arm, Dsv4Gpu's argument, the kernels' source
contract (gemv_bf16's row arithmetic lives in kernels_cu/gemv_bf16_row.cuh, included by decode.cu
and experts.cu; the _k2_f_w2 kernels compute the w2 rows only through it), the wrapper's launch
arguments and checks, and the launches DeviceStep._moe issues with the kernels replaced by
recorders (no GPU): ``gemv`` launches gemv_bf16(w2) and passes ``shared``; ``fused`` launches no
w2 GEMV and passes shared_w2 = (w2, sh_h) where it applies (bf16 w2, Flash shapes), else keeps
``gemv``'s launches.  The bytes are the GPU tests' (tests/gpu/test_kernels_experts.py
test_down_combine_shared_w2_same_bytes, tests/gpu/test_step_shared_w2_gpu.py)."""
from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_shared_w2_seam(monkeypatch):
    from memra_dsv4 import seams
    s = seams.SEAMS["decode_shared_w2"]
    assert s is seams.SEAM_DECODE_SHARED_W2
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_DECODE_SHARED_W2", "fused", ("gemv", "fused"))
    monkeypatch.delenv("MEMRA_DSV4_DECODE_SHARED_W2", raising=False)
    assert seams.resolve("decode_shared_w2") == "fused"
    monkeypatch.setenv("MEMRA_DSV4_DECODE_SHARED_W2", "gemv")
    assert seams.resolve("decode_shared_w2") == "gemv"
    assert seams.resolve("decode_shared_w2", "fused") == "fused"        # explicit wins
    monkeypatch.setenv("MEMRA_DSV4_DECODE_SHARED_W2", "on")
    with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_SHARED_W2.*'on'.*gemv, fused"):
        seams.resolve("decode_shared_w2")
    assert "`MEMRA_DSV4_DECODE_SHARED_W2`" in seams.seam_table_markdown()


def test_decode_shared_w2_announced_and_taken_everywhere(monkeypatch, capsys):
    import inspect

    from memra_dsv4.gpu import model as gm
    monkeypatch.delenv("MEMRA_DSV4_DECODE_SHARED_W2", raising=False)
    what = "device-step shared-expert w2 (own GEMV or in the down + combine)"
    assert gm._resolve_announced("DECODE_SHARED_W2", None, what) == "fused"
    assert f"memra_dsv4: {what} = fused (default)" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DECODE_SHARED_W2", "gemv")
    assert gm._resolve_announced("DECODE_SHARED_W2", None, what) == "gemv"
    assert "= gemv (env MEMRA_DSV4_DECODE_SHARED_W2)" in capsys.readouterr().err
    src = inspect.getsource(gm.Dsv4Gpu.__init__)
    assert '"DECODE_SHARED_W2", decode_shared_w2' in src
    for fn in (gm.Dsv4Gpu.__init__, gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):
        p = inspect.signature(fn).parameters
        assert "decode_shared_w2" in p and p["decode_shared_w2"].default is None, fn.__name__
    for fn in (gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):   # passed on to the constructor
        assert "decode_shared_w2=decode_shared_w2" in inspect.getsource(fn), fn.__name__


def test_device_step_shared_w2_form_and_graph_key():
    import inspect

    from memra_dsv4.gpu.step_device import DeviceStep
    ds = object.__new__(DeviceStep)       # no GPU: only the form's resolution
    for value, want in (("gemv", "gemv"), ("fused", "fused"), (None, "fused")):
        ds.m = SimpleNamespace(decode_shared_w2=value)
        assert ds.shared_w2_form() == want
    ds.m = SimpleNamespace()
    assert ds.shared_w2_form() == "fused"
    ds.m = SimpleNamespace(decode_shared_w2="both")
    with pytest.raises(ValueError, match=r"model.decode_shared_w2 \(env MEMRA_DSV4_DECODE_SHARED_W2\).*gemv, fused"):
        ds.shared_w2_form()
    step = inspect.getsource(DeviceStep._prepare)   # the graph cache key's last field, and the capture's argument
    assert "gs[1:] != (pdl_on, attn, fork, hc_split, prio, qnorm, w2)" in step and "prio, qnorm, w2)" in step
    assert "w2" in inspect.signature(DeviceStep._capture).parameters


def test_decode_bench_shared_w2_arm():
    from bench.decode_step import check_arms
    assert check_arms("path=device,path=device+w2=fused") == [{"path": "device"}, {"path": "device", "w2": "fused"}]
    with pytest.raises(SystemExit, match="w2='on'; expected one of gemv, fused"):
        check_arms("path=device+w2=on")


def _body(src: str, head: str) -> str:
    i = src.index(head)
    j = src.index("{", i)
    depth = 0
    for k in range(j, len(src)):
        depth += {"{": 1, "}": -1}.get(src[k], 0)
        if depth == 0:
            return src[j:k + 1]
    raise AssertionError(f"unbalanced body of {head}")


def test_gemv_row_code_is_shared():
    """decode.cu's gemv kernels and experts.cu's _k2_f_w2 run gemv_bf16_row.cuh's functions (the
    bit identity by construction): decode.cu keeps no copy of them, bf16_rows_dot_k does its
    arithmetic only through bf16_trip_fma + partials_total, the _w2 kernels exist (mx, nv) and
    their w2 rows go only through bf16_rows_dot_k, stored as f32_to_bf16 (gemv_bf16's store)."""
    kd = os.path.join(ROOT, "kernels_cu")
    dec = open(os.path.join(kd, "decode.cu"), encoding="utf-8").read()
    ex = open(os.path.join(kd, "experts.cu"), encoding="utf-8").read()
    hdr = open(os.path.join(kd, "gemv_bf16_row.cuh"), encoding="utf-8").read()
    assert '#include "gemv_bf16_row.cuh"' in dec and '#include "gemv_bf16_row.cuh"' in ex
    for name in ("DEV float partials_total(", "DEV void bf16_trip_fma(", "constexpr int GEMV_UNROLL"):
        assert name in hdr and name not in dec and name not in ex, name
    body = _body(hdr, "DEV void bf16_rows_dot_k_by(")
    assert "bf16_trip_fma<R>(" in body and "partials_total(" in body
    assert "__fmaf_rn" not in body and "warp_sum" not in body
    # the global-rows form and the FP4_DN_PRELOAD form both delegate to bf16_rows_dot_k_by: one
    # copy of the trip loop (the seventeenth session's w2_rows_pre had its own)
    assert "bf16_rows_dot_k_by<R, K>(" in _body(hdr, "DEV void bf16_rows_dot_k(")
    w2_rows = _body(ex, "DEV void w2_rows(")
    assert "bf16_rows_dot_k<R, DOWN_W2_K>(" in w2_rows and "f32_to_bf16(" in w2_rows
    w2_pre = _body(ex, "DEV void w2_rows_pre(")
    assert "bf16_rows_dot_k_by<R, DOWN_W2_K, 1>(" in w2_pre and "f32_to_bf16(" in w2_pre
    for rows in (w2_rows, w2_pre):
        for own in ("__fmaf_rn", "__fadd_rn", "bf16_trip_fma", "partials_total"):
            assert own not in rows, own
    assert re.findall(r"^GEMV_FP4_DOWN_W2\((\w+),", ex, re.M) == [
        "gemv_mxfp4_down_combine_k2_f_w2", "gemv_nvfp4_down_combine_k2_f_w2"]
    from memra_dsv4.gpu.ops import experts as EX
    assert {"gemv_mxfp4_down_combine_k2_f_w2", "gemv_nvfp4_down_combine_k2_f_w2"} <= set(EX.KERNELS)


def test_shared_w2_wrapper_launch_and_checks(monkeypatch):
    """gemv_fp4_down_combine(shared_w2=...) on fake arrays: the _w2 kernel, its arguments (w2 and sh
    where _k2_f has `shared`), the grid of _k2_f and the shared memory of the h rows plus the w2
    values; the shape / dtype / form checks."""
    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import experts as EX
    A = fake.asarray
    rec = []
    monkeypatch.setattr(EX, "kernel", lambda stem, name: (
        lambda grid, block, a, shared_mem=0: rec.append((name, grid, block, a, shared_mem))))
    monkeypatch.setattr(EX, "dynamic_smem", lambda k, n: n)
    monkeypatch.setattr(EX, "sm_count", lambda: 132)
    monkeypatch.delenv("MEMRA_DSV4_FP4_FULL", raising=False)
    D, I, k = 4096, 2048, 6
    h, ids, tab = A(np.zeros((k, I), np.uint16)), A(np.zeros((1, k), np.int32)), A(np.zeros(4, np.uint64))
    w2, sh = A(np.zeros((D, I), np.uint16)), A(np.zeros(I, np.uint16)).reshape(1, I)
    out = A(np.zeros((1, D), np.uint16))
    EX.gemv_fp4_down_combine("mxfp4", h, ids, tab, tab, D, I, shared_w2=(w2, sh), out=out)
    name, grid, block, a, smem = rec[-1]
    assert name == "gemv_mxfp4_down_combine_k2_f_w2" and block == (256,)
    assert grid == (256, 1)                       # _k2_f's grid: 2048 row groups / 8 warps per CTA
    assert a[6] is w2 and a[7] is sh and a[8] is out and len(a) == 12
    # the h rows, the w2 row values, the w2 preload region (experts.cu DOWN_W2_PRE_BYTES)
    assert smem == k * 8192 + EX.down_w2_smem(D, 256) + EX.DOWN_W2_PRE_SMEM and EX.down_w2_smem(D, 256) == 32
    assert EX.DOWN_W2_PRE_SMEM == 8 * 2 * 1024 * 2
    assert EX.down_w2_smem(D, 1) == 2 * D         # one CTA: every row's value
    EX.gemv_fp4_down_combine("nvfp4", h, ids, tab, tab, D, I, shared_w2=(w2, sh), out=out,
                             ws2=A(np.zeros(4, np.float32)))
    assert rec[-1][0] == "gemv_nvfp4_down_combine_k2_f_w2"
    with pytest.raises(AssertionError, match="alternatives"):
        EX.gemv_fp4_down_combine("mxfp4", h, ids, tab, tab, D, I, shared=out, shared_w2=(w2, sh))
    with pytest.raises(AssertionError, match="shared_w2.w2"):    # FP8 w2: not supported
        EX.gemv_fp4_down_combine("mxfp4", h, ids, tab, tab, D, I, shared_w2=(A(np.zeros((D, I), np.uint8)), sh))
    with pytest.raises(AssertionError, match="shared_w2.sh"):
        EX.gemv_fp4_down_combine("mxfp4", h, ids, tab, tab, D, I, shared_w2=(w2, A(np.zeros(I - 8, np.uint16))))
    with pytest.raises(AssertionError, match="impl 'simt'"):
        EX.gemv_fp4_down_combine("mxfp4", h, ids, tab, tab, D, I, shared_w2=(w2, sh), impl="mma")
    h5, ids5 = A(np.zeros((5, I), np.uint16)), A(np.zeros((1, 5), np.int32))
    with pytest.raises(AssertionError, match="full shape"):        # k odd: no full-shape kernel
        EX.gemv_fp4_down_combine("mxfp4", h5, ids5, tab, tab, D, I, shared_w2=(w2, sh))
    assert not EX.down_w2_ok(D, I, k, np.zeros((D, I), np.uint8))
    assert not EX.down_w2_ok(D, 1024, k, np.zeros((D, I), np.uint16))
    assert EX.down_w2_ok(D, I, k, np.zeros((D, I), np.uint16))


# ------------------------------------------------------------------ _moe's launches
def moe_buffers(D: int, I: int, E: int = 8, k: int = 6) -> dict:
    """The step views DeviceStep._moe reads and writes (zeros, host arrays: no GPU)."""
    return {"xn": np.zeros(D, np.uint16), "moe.logits": np.zeros(E, np.float32), "moe.ids": np.zeros(k, np.int32),
            "moe.w": np.zeros(k, np.float32), "moe.sh_h": np.zeros(I, np.uint16), "moe.h": np.zeros((k, I), np.uint16),
            "moe.shared": np.zeros(D, np.uint16), "moe.scores": np.zeros(E, np.float32),
            "ffn.out": np.zeros(D, np.uint16), "tok": np.zeros(1, np.int32)}


def buffer_name(v: dict, a):
    """The key of the moe_buffers view ``a`` shares memory with (None: none of them)."""
    for key, arr in v.items():
        if isinstance(a, np.ndarray) and np.shares_memory(a, arr):
            return key
    return None


def run_moe(v: dict, log: list, fork: str, w2_form: str, lin, D: int, I: int, E: int = 8, k: int = 6, *,
            swiglu_limit: float = 10.0, ride=None):
    """DeviceStep._moe of one fake layer (L.lin = lin) on the buffers v, the shared expert's
    graph fork / join and side-stream entry / exit appended to log as ("fork",), ("join",),
    ("side",), ("main",); the launches are whatever the caller patched (tests/test_gateup_pdl_cpu
    and tests/test_shared_gateup_cpu use this too).  ride: the ffn boundary's Sinkhorn handed to
    _moe (S.hc_ride, MEMRA_DSV4_HC_JOIN=ride).  Returns the step context S."""
    from memra_dsv4.gpu.step_device import DeviceStep

    class _Fork:
        def fork(self):
            log.append(("fork",))

        def join(self):
            log.append(("join",))

    class _Side:
        def __enter__(self):
            log.append(("side",))

        def __exit__(self, *a):
            log.append(("main",))
    ds = object.__new__(DeviceStep)
    ds.cfg = SimpleNamespace(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                             swiglu_limit=swiglu_limit, routed_scaling_factor=1.5)
    ds.hostmath, ds._forking, ds._w2 = False, fork, w2_form
    L = SimpleNamespace(lin=lin, w=lambda leaf: leaf, hash=False, fmt="mxfp4", wp={"w1": 0, "w3": 0, "w2": 0},
                        sp={"w1": 0, "w3": 0, "w2": 0}, ws2={"w1": None, "w3": None, "w2": None})
    S = SimpleNamespace(v=v, ph="decode/stage0", moe_fork=_Fork(), moe_side=_Side())
    if ride is not None:
        S.hc_ride = ride
    ds._moe(S, L)
    return S


def _moe_log(monkeypatch, w2_form: str, fork: str, w2_dtype=np.uint16, D=4096, I=2048):
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import experts as EX
    from memra_dsv4.gpu.ops import router as RT
    monkeypatch.delenv("MEMRA_DSV4_FP4_FULL", raising=False)
    # the shared SwiGLU as its own side-branch launch (the default puts it in the gate/up launch:
    # tests/test_shared_gateup_cpu.py)
    monkeypatch.setenv("MEMRA_DSV4_SHARED_GATEUP", "off")
    v = moe_buffers(D, I)
    w2 = np.zeros((D, I), w2_dtype)
    log = []

    def name(a):
        return buffer_name(v, a)

    monkeypatch.setattr(DK, "gemv_bf16_swiglu", lambda *a, **kw: log.append(("swiglu",)))
    monkeypatch.setattr(DK, "gemv_bf16", lambda w, x, y, **kw: log.append(("gemv", "w2" if w is w2 else w, name(x), name(y))))
    monkeypatch.setattr(RT, "fused", lambda *a, **kw: log.append(("router",)))
    monkeypatch.setattr(EX, "gemv_fp4_gateup", lambda *a, **kw: log.append(("gateup",)))

    def down(fmt, h, ids, wp, sp, O, K, *, shared=None, out=None, ws2=None, shared_w2=None):
        sw = None if shared_w2 is None else ("w2" if shared_w2[0] is w2 else "?", name(shared_w2[1]))
        log.append(("down", name(shared), sw, name(out)))
    monkeypatch.setattr(EX, "gemv_fp4_down_combine", down)
    scale = None if w2_dtype == np.uint16 else np.zeros((D // 128, I // 128), np.uint8)
    run_moe(v, log, fork, w2_form, lambda leaf: (w2, scale) if leaf.endswith("w2") else (leaf, None), D, I)
    return log


@pytest.mark.parametrize("fork", ["", "all"])
def test_moe_launches_per_shared_w2(monkeypatch, fork):
    gemv = ("gemv", "w2", "moe.sh_h", "moe.shared")
    down_g = ("down", "moe.shared", None, "ffn.out")
    down_f = ("down", None, ("w2", "moe.sh_h"), "ffn.out")
    got_g = _moe_log(monkeypatch, "gemv", fork)
    got_f = _moe_log(monkeypatch, "fused", fork)
    if fork:
        assert got_g == [("fork",), ("side",), ("swiglu",), gemv, ("main",), ("router",), ("gateup",), ("join",), down_g]
        assert got_f == [("fork",), ("side",), ("swiglu",), ("main",), ("router",), ("gateup",), ("join",), down_f]
    else:
        assert got_g == [("swiglu",), ("router",), gemv, ("gateup",), down_g]
        assert got_f == [("swiglu",), ("router",), ("gateup",), down_f]
    # where the kernel does not apply (FP8-stored w2; other shapes), fused keeps gemv's launches
    assert _moe_log(monkeypatch, "fused", fork, w2_dtype=np.uint8) == _moe_log(monkeypatch, "gemv", fork, w2_dtype=np.uint8)
    small = dict(D=256, I=128)
    assert _moe_log(monkeypatch, "fused", fork, **small) == _moe_log(monkeypatch, "gemv", fork, **small)
