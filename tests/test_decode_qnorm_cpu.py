"""The q norm seam of the device step on the CPU (MEMRA_DSV4_DECODE_QNORM): the seam's resolution,
DeviceStep.qnorm_form, the bench arm, Dsv4Gpu's argument, the kernels' source contract (the _qn
kernels and head_rms_bf16 run one shared row function, head_rms.cuh), and the launches
DeviceStep._attention issues with the kernels replaced by recorders (no GPU): ``kernel`` runs
head_rms in place after wq_b and attends over q without q_norm; ``attn`` runs no head_rms and
hands the raw q + q_norm = (eps, pos, cos, sin) to the attention form in use.  The bytes are the GPU
tests' (tests/gpu/test_kernels_attention.py q-norm tests, tests/gpu/test_step_qnorm_gpu.py)."""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
from tests.test_kernel_sources import braced

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_qnorm_seam(monkeypatch):
    from memra_dsv4 import seams
    s = seams.SEAMS["decode_qnorm"]
    assert s is seams.SEAM_DECODE_QNORM
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_DECODE_QNORM", "kernel", ("kernel", "attn"))
    monkeypatch.delenv("MEMRA_DSV4_DECODE_QNORM", raising=False)
    assert seams.resolve("decode_qnorm") == "kernel"
    monkeypatch.setenv("MEMRA_DSV4_DECODE_QNORM", "attn")
    assert seams.resolve("decode_qnorm") == "attn"
    assert seams.resolve("decode_qnorm", "kernel") == "kernel"          # explicit wins
    monkeypatch.setenv("MEMRA_DSV4_DECODE_QNORM", "fused")
    with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_QNORM.*'fused'.*kernel, attn"):
        seams.resolve("decode_qnorm")


def test_decode_qnorm_announced_and_taken_everywhere(monkeypatch, capsys):
    import inspect

    from memra_dsv4.gpu import model as gm
    monkeypatch.delenv("MEMRA_DSV4_DECODE_QNORM", raising=False)
    what = "device-step q head norm (own launch or in the attention)"
    assert gm._resolve_announced("DECODE_QNORM", None, what) == "kernel"
    assert f"memra_dsv4: {what} = kernel (default)" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DECODE_QNORM", "attn")
    assert gm._resolve_announced("DECODE_QNORM", None, what) == "attn"
    assert "= attn (env MEMRA_DSV4_DECODE_QNORM)" in capsys.readouterr().err
    src = inspect.getsource(gm.Dsv4Gpu.__init__)
    assert '"DECODE_QNORM", decode_qnorm' in src
    for fn in (gm.Dsv4Gpu.__init__, gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):
        p = inspect.signature(fn).parameters
        assert "decode_qnorm" in p and p["decode_qnorm"].default is None, fn.__name__
    for fn in (gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):   # passed on to the constructor
        assert "decode_qnorm=decode_qnorm" in inspect.getsource(fn), fn.__name__


def test_device_step_qnorm_form():
    from memra_dsv4.gpu.step_device import DeviceStep
    ds = object.__new__(DeviceStep)       # no GPU: only the form's resolution
    for value, want in (("kernel", "kernel"), ("attn", "attn"), (None, "kernel")):
        ds.m = SimpleNamespace(decode_qnorm=value)
        assert ds.qnorm_form() == want
    ds.m = SimpleNamespace()
    assert ds.qnorm_form() == "kernel"
    ds.m = SimpleNamespace(decode_qnorm="both")
    with pytest.raises(ValueError, match=r"model.decode_qnorm \(env MEMRA_DSV4_DECODE_QNORM\).*kernel, attn"):
        ds.qnorm_form()


def test_decode_bench_qnorm_arm():
    from bench.decode_step import check_arms
    assert check_arms("path=device+qnorm=kernel,path=device+qnorm=attn+attn=fused") == [
        {"path": "device", "qnorm": "kernel"}, {"path": "device", "qnorm": "attn", "attn": "fused"}]
    with pytest.raises(SystemExit, match="qnorm='on'; expected one of kernel, attn"):
        check_arms("path=device+qnorm=on")


def test_head_rms_row_code_is_shared():
    """head_rms_bf16 and the attention's q norm run head_rms.cuh's chunk helpers (the bit identity
    by construction): rmsnorm.cu keeps no copy of the arithmetic, both drivers of head_rms.cuh
    (the run-time n loop and the compile-time N phases) do theirs only through the helpers, and
    the _qn kernels of both attention forms exist (6 each)."""
    kd = os.path.join(ROOT, "kernels_cu")
    rms = open(os.path.join(kd, "rmsnorm.cu"), encoding="utf-8").read()
    att = open(os.path.join(kd, "attention.cu"), encoding="utf-8").read()
    hdr = open(os.path.join(kd, "head_rms.cuh"), encoding="utf-8").read()
    assert '#include "head_rms.cuh"' in rms and '#include "head_rms.cuh"' in att
    body = braced(rms, "head_rms_bf16(const u16* x")
    assert "head_rms_warp_row(" in body and "round_bf16" not in body and "__fmul_rn" not in body
    arith = ("round_bf16", "__fmul_rn", "__dadd_rn", "__fadd_rn", "sqrt", "rope_pair")
    drivers = {"DEV void head_rms_warp_row(": ("head_rms_sumsq8(", "head_rms_r(", "head_rms_scale8(",
                                               "head_rms_rope8("),
               "DEV double head_rms_row_sumsq(": ("head_rms_sumsq8(",),
               "DEV void head_rms_row_finish(": ("warp_sum(", "head_rms_r(", "head_rms_scale8(",
                                                 "head_rms_rope8(")}
    for head, helpers in drivers.items():
        b = braced(hdr, head)
        assert all(h in b for h in helpers), head
        assert not any(a in b for a in arith), f"{head}: arithmetic outside the shared helpers"
    q_norm = braced(att, "DEV void q_norm_rows(")
    for call in ("head_rms_row_load(", "head_rms_rope_load(", "head_rms_row_sumsq(", "head_rms_row_finish("):
        assert call in q_norm, call
    assert not any(a in q_norm for a in arith)
    for macro, kernels in (("SPARSE_ATTN_QN", 6), ("SPARSE_ATTN_DECODE_QN", 6)):
        assert len(re.findall(rf"^{macro}\((\w+_qn)\s*,", att, re.M)) == kernels, macro


# ------------------------------------------------------------------ _attention's launches
class _Rec:
    def __init__(self):
        self.log = []


def _attention_log(monkeypatch, qnorm: str, attn: str, ratio: int = 0):
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.gpu.ops import attention as AT
    from memra_dsv4.gpu.ops import compressor as CM
    from memra_dsv4.gpu.ops import rmsnorm as RN
    from memra_dsv4.gpu.step_device import DeviceStep
    H, hd, W, n_comp = 4, 16, 8, 3
    v = {"pos": np.zeros(1, np.int32), "attn.qr": np.zeros(8, np.uint16), "attn.q": np.zeros(H * hd, np.uint16),
         "attn.cand": np.zeros(W + n_comp, np.int32), "dev.kvraw": np.zeros(hd, np.uint16),
         "attn.o": np.zeros(H * hd, np.uint16), "dev.attn_ws": np.zeros(64, np.float32),
         "attn.u": np.zeros(8, np.uint16), "attn.out": np.zeros(8, np.uint16), "xn": np.zeros(8, np.uint16)}
    log = []

    def name(a):
        for k, arr in v.items():
            if isinstance(a, np.ndarray) and np.shares_memory(a, arr):
                return k
        return None

    monkeypatch.setattr(DK, "gemv_bf16_multi", lambda *a, **k: log.append(("multi",)))
    monkeypatch.setattr(DK, "gemv_bf16", lambda w, x, y, **k: log.append(("gemv", w, name(y))))
    monkeypatch.setattr(DK, "build_cand", lambda *a, **k: log.append(("build_cand",)))
    monkeypatch.setattr(RN, "rmsnorm", lambda x, w, eps, out=None: log.append(("rmsnorm", name(out))))

    def head_rms(x, eps, out=None, rope=None):
        assert out is x and rope is not None and rope[0] is v["pos"]
        log.append(("head_rms", name(x), eps))
    monkeypatch.setattr(RN, "head_rms", head_rms)
    monkeypatch.setattr(CM, "norm_rope_sim", lambda *a, **k: log.append(("kv",)))

    def attention(tag):
        def f(q, *a, **k):
            assert q.shape == (1, H, hd)
            qn = k.get("q_norm")
            if qn is not None:
                eps, pos, cos, sin = qn
                assert pos is v["pos"] and cos is L.cos and sin is L.sin
                qn = ("q_norm", eps)
            log.append((tag, name(q), name(k["out"]), qn))
        return f
    monkeypatch.setattr(AT, "sparse_attention", attention("split"))
    monkeypatch.setattr(AT, "sparse_attention_decode", attention("fused"))
    ds = object.__new__(DeviceStep)
    ds.cfg = SimpleNamespace(rms_norm_eps=1e-6, sliding_window=W, num_attention_heads=H, head_dim=hd,
                             o_groups=1)
    ds.hostmath, ds._forking, ds._qnorm = False, "", qnorm
    ds._compress = lambda *a, **k: log.append(("compress",))
    L = SimpleNamespace(ratio=ratio, kind="hca" if ratio else "swa", cos=np.zeros((4, 2), np.float32),
                        sin=np.zeros((4, 2), np.float32), w=lambda leaf: leaf, lin=lambda pre: (pre, None),
                        f32={"attn.kv_norm.weight": None})
    cache = SimpleNamespace(ring=None, kv=None, comp=np.zeros((n_comp, hd), np.uint16), comp_state=None)
    S = SimpleNamespace(v=v, ph="decode/stage0")
    ds._attention(S, L, cache, None, attn)
    return log


@pytest.mark.parametrize("attn", ["split", "fused"])
@pytest.mark.parametrize("ratio", [0, 4])
def test_attention_launches_per_qnorm(monkeypatch, attn, ratio):
    want_head = [("multi",), ("rmsnorm", "attn.qr"), ("gemv", "attn.wq_b", "attn.q")]
    tail = [("gemv", "attn.wo_a", "attn.u"), ("gemv", "attn.wo_b", "attn.out")]
    mid = [("kv",)] + ([("compress",)] if ratio else []) + ([("build_cand",)] if attn == "split" else [])
    got_k = _attention_log(monkeypatch, "kernel", attn, ratio)
    assert got_k == (want_head + [("head_rms", "attn.q", 1e-6)] + mid
                     + [(attn, "attn.q", "attn.o", None)] + tail)
    got_a = _attention_log(monkeypatch, "attn", attn, ratio)
    assert got_a == want_head + mid + [(attn, "attn.q", "attn.o", ("q_norm", 1e-6))] + tail


def test_qnorm_argument_checks(monkeypatch):
    """q_norm's boundary checks (fake CuPy arrays, no launch reaches a GPU)."""
    import sys

    from tests.test_kernel_sources import _fake_cupy
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import attention as AT
    A = fake.asarray
    args = []
    monkeypatch.setattr(AT, "kernel", lambda stem, name: (lambda grid, block, a, shared_mem=0: args.append((name, a))))
    monkeypatch.setattr(AT, "dynamic_smem", lambda k, n: n)
    q, kv = A(np.zeros((2, 4, 128), np.uint16)), A(np.zeros((10, 128), np.uint16))
    idx, sink = A(np.zeros((2, 40), np.int32)), A(np.zeros(4, np.float32))
    cs = A(np.zeros((9, 32), np.float32))
    AT.sparse_attention(q, kv, idx, sink, 0.1, q_norm=(1e-6, A(np.zeros(2, np.int32)), cs, cs))
    name, a = args[-1]
    assert name == "sparse_attn_d128_hg4_qn" and type(a[-5]) is np.float32 and a[-5] == np.float32(1e-6)
    assert int(a[-1]) == 64
    with pytest.raises(AssertionError, match="q_norm.pos"):
        AT.sparse_attention(q, kv, idx, sink, 0.1, q_norm=(1e-6, A(np.zeros(3, np.int32)), cs, cs))
    with pytest.raises(AssertionError, match="rope dims 160"):
        big = A(np.zeros((9, 80), np.float32))
        AT.sparse_attention(q, kv, idx, sink, 0.1, q_norm=(1e-6, A(np.zeros(2, np.int32)), big, big))
    with pytest.raises(AssertionError, match="rope dims 0"):   # the kernels need R >= 8 with a position
        empty = A(np.zeros((9, 0), np.float32))
        AT.sparse_attention(q, kv, idx, sink, 0.1, q_norm=(1e-6, A(np.zeros(2, np.int32)), empty, empty))
    with pytest.raises(AssertionError, match="expected \\(eps, pos, cos, sin\\)"):
        AT.sparse_attention(q, kv, idx, sink, 0.1, q_norm=(1e-6, A(np.zeros(2, np.int32))))
    with pytest.raises(AssertionError, match="out must not alias q"):
        AT.sparse_attention(q, kv, idx, sink, 0.1, out=q, q_norm=(1e-6, None, None, None))
