"""Seam registry and the numeric-class policy."""

import os
import subprocess
import sys

import numpy as np
import pytest

from memra_dsv4 import seams
from memra_dsv4.host.quant import round_bf16

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resolve_precedence_and_errors(monkeypatch):
    assert seams.resolve("numerics", "exact") == "exact"
    with pytest.raises(ValueError, match="MEMRA_DSV4_NUMERICS.*bf16, reference, exact"):
        seams.resolve("numerics", "fp64")
    monkeypatch.setenv("MEMRA_DSV4_CONTINUE", "reprefill")
    assert seams.resolve("continue") == "reprefill"
    assert seams.resolve("continue", "incremental") == "incremental"   # explicit wins
    monkeypatch.setenv("MEMRA_DSV4_CONTINUE", "bogus")
    with pytest.raises(ValueError, match="MEMRA_DSV4_CONTINUE"):
        seams.resolve("continue")
    monkeypatch.delenv("MEMRA_DSV4_DECODE_PATH", raising=False)
    assert seams.resolve("decode_path") == "legacy"
    monkeypatch.setenv("MEMRA_DSV4_DECODE_PATH", "device-hostmath")
    assert seams.resolve("decode_path") == "device-hostmath"
    assert seams.resolve("decode_path", "device") == "device"
    monkeypatch.setenv("MEMRA_DSV4_DECODE_PATH", "reprefill")
    with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_PATH.*legacy, device-hostmath, device"):
        seams.resolve("decode_path")
    with pytest.raises(ValueError, match="unknown seam"):
        seams.resolve("nope")


def _import_with_env(value):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("MEMRA_DSV4_NUMERICS", None)
    if value is not None:
        env["MEMRA_DSV4_NUMERICS"] = value
    return subprocess.run([sys.executable, "-c", "import memra_dsv4.seams as s; "
                           "print(s.resolve('numerics')); s.resolve('numerics')"], env=env,
                          capture_output=True, text=True, cwd=REPO)


def test_numerics_env_read_once_and_announced():
    r = _import_with_env("exact")
    assert r.returncode == 0, r.stderr
    assert "memra_dsv4: numerics = exact" in r.stderr and r.stdout.strip() == "exact"
    assert r.stderr.count("numerics =") == 1
    r = _import_with_env(None)
    assert r.returncode == 0 and r.stdout.strip() == "bf16"
    assert r.stderr.count("memra_dsv4: numerics = bf16") == 1
    r = _import_with_env("fp64")
    assert r.returncode != 0 and "MEMRA_DSV4_NUMERICS" in r.stderr and "bf16" in r.stderr


def test_seam_table():
    md = seams.seam_table_markdown()
    for s in seams.SEAMS.values():
        assert f"`{s.env}`" in md


def test_policy_hooks():
    x = np.array([1.0 + 2.0 ** -10, 3.14159], dtype=np.float64)
    ex, bf, ref = (seams.POLICIES[n] for n in ("exact", "bf16", "reference"))
    assert ex.dtype == np.float64 and bf.dtype == np.float32
    np.testing.assert_array_equal(ex.store(x), x)
    np.testing.assert_array_equal(bf.store(x), round_bf16(x.astype(np.float32)))
    kv = np.random.default_rng(0).standard_normal((2, 128))
    np.testing.assert_array_equal(ex.kv_sim(kv, 64), kv)          # no sims in exact
    assert not np.array_equal(bf.kv_sim(kv, 64), kv.astype(np.float32))
    np.testing.assert_array_equal(bf.kv_sim(kv, 64)[:, 64:], kv[:, 64:].astype(np.float32))
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    xx = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    y_bf, y_ref = bf.linear(xx, w, "fp8"), ref.linear(xx, w, "fp8")
    np.testing.assert_array_equal(y_bf, round_bf16(y_bf))
    assert not np.array_equal(y_bf, y_ref)                          # act quant only in reference
    np.testing.assert_array_equal(bf.linear(xx, w, "bf16"), ref.linear(xx, w, "bf16"))
    assert seams.policy(None).name == seams.resolve("numerics")
    with pytest.raises(ValueError):
        bf.linear(xx, w, "int8")


def test_decode_attn_seam(monkeypatch):
    """MEMRA_DSV4_DECODE_ATTN: split (default) | fused; explicit > env > default; a bad value is
    refused naming the variable and the allowed values."""
    s = seams.SEAMS["decode_attn"]
    assert s is seams.SEAM_DECODE_ATTN
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_DECODE_ATTN", "split", ("split", "fused"))
    monkeypatch.delenv("MEMRA_DSV4_DECODE_ATTN", raising=False)
    assert seams.resolve("decode_attn") == "split"
    monkeypatch.setenv("MEMRA_DSV4_DECODE_ATTN", "fused")
    assert seams.resolve("decode_attn") == "fused"
    assert seams.resolve("decode_attn", "split") == "split"            # explicit wins
    monkeypatch.setenv("MEMRA_DSV4_DECODE_ATTN", "one-launch")
    with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_ATTN.*'one-launch'.*split, fused"):
        seams.resolve("decode_attn")
    monkeypatch.delenv("MEMRA_DSV4_DECODE_ATTN")
    with pytest.raises(ValueError, match=r"decode_attn \(argument; env MEMRA_DSV4_DECODE_ATTN\).*split, fused"):
        seams.resolve("decode_attn", "unfused")


def test_decode_attn_announced_like_pdl(monkeypatch, capsys):
    """Dsv4Gpu resolves decode_attn through _resolve_announced (as pdl): the value and its source
    printed once."""
    from memra_dsv4.gpu import model as gm
    monkeypatch.delenv("MEMRA_DSV4_DECODE_ATTN", raising=False)
    assert gm._resolve_announced("DECODE_ATTN", None, "device-step sparse attention") == "split"
    assert "memra_dsv4: device-step sparse attention = split (default)" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DECODE_ATTN", "fused")
    assert gm._resolve_announced("DECODE_ATTN", None, "device-step sparse attention") == "fused"
    assert "= fused (env MEMRA_DSV4_DECODE_ATTN)" in capsys.readouterr().err
    assert gm._resolve_announced("DECODE_ATTN", "split", "device-step sparse attention") == "split"
    assert "= split (argument)" in capsys.readouterr().err
    monkeypatch.setenv("MEMRA_DSV4_DECODE_ATTN", "bogus")
    with pytest.raises(ValueError, match="MEMRA_DSV4_DECODE_ATTN.*split, fused"):
        gm._resolve_announced("DECODE_ATTN", None, "device-step sparse attention")


def test_dsv4gpu_takes_decode_attn_everywhere():
    import inspect

    from memra_dsv4.gpu.model import Dsv4Gpu
    for fn in (Dsv4Gpu.__init__, Dsv4Gpu.load, Dsv4Gpu.synthetic):
        p = inspect.signature(fn).parameters
        assert "decode_attn" in p and p["decode_attn"].default is None, fn.__name__


def test_prefill_moe_seam(monkeypatch):
    """MEMRA_DSV4_PREFILL_MOE: wgmma (default) | fp4mma | blaslt; every Dsv4Gpu constructor takes
    it; the chunk routine falls back to blaslt when a width is not a multiple of 128 (the FP4
    GEMMs' K tile)."""
    import inspect
    from types import SimpleNamespace
    from memra_dsv4.gpu import model as gm
    s = seams.SEAMS["prefill_moe"]
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_PREFILL_MOE", "wgmma", ("wgmma", "fp4mma", "blaslt"))
    monkeypatch.delenv("MEMRA_DSV4_PREFILL_MOE", raising=False)
    assert seams.resolve("prefill_moe") == "wgmma"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_MOE", "blaslt")
    assert seams.resolve("prefill_moe") == "blaslt"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_MOE", "cutlass")
    with pytest.raises(ValueError, match="MEMRA_DSV4_PREFILL_MOE.*'cutlass'.*wgmma, fp4mma, blaslt"):
        seams.resolve("prefill_moe")
    for fn in (gm.Dsv4Gpu.__init__, gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):
        assert "prefill_moe" in inspect.signature(fn).parameters, fn.__qualname__
    blk = gm._Block.__new__(gm._Block)
    blk.m = SimpleNamespace(prefill_moe="fp4mma")
    assert blk._moe_gemm(4096, 2048) == "fp4mma"
    assert blk._moe_gemm(4096, 2000) == "blaslt"
    blk.m = SimpleNamespace(prefill_moe="blaslt")
    assert blk._moe_gemm(4096, 2048) == "blaslt"
    blk.m = SimpleNamespace(prefill_moe="wgmma")
    assert blk._moe_gemm(4096, 2048) == "wgmma"
    assert blk._moe_gemm(4000, 2048) == "blaslt"


def test_prefill_dispatch_seam(monkeypatch, capsys):
    """MEMRA_DSV4_PREFILL_DISPATCH: host | device; every Dsv4Gpu constructor takes it (argument >
    environment > default, printed); the fp4mma arm follows it, blaslt always plans on the host."""
    import inspect
    from types import SimpleNamespace
    from memra_dsv4.gpu import model as gm
    s = seams.SEAMS["prefill_dispatch"]
    assert (s.env, s.allowed) == ("MEMRA_DSV4_PREFILL_DISPATCH", ("host", "device"))
    assert s.default in s.allowed
    monkeypatch.delenv("MEMRA_DSV4_PREFILL_DISPATCH", raising=False)
    assert seams.resolve("prefill_dispatch") == s.default
    for v in ("host", "device"):
        monkeypatch.setenv("MEMRA_DSV4_PREFILL_DISPATCH", v)
        assert seams.resolve("prefill_dispatch") == v
        assert gm._resolve_announced("PREFILL_DISPATCH", None, "dispatch") == v
        src = "default" if v == s.default else "env MEMRA_DSV4_PREFILL_DISPATCH"
        assert f"dispatch = {v} ({src})" in capsys.readouterr().err
    assert gm._resolve_announced("PREFILL_DISPATCH", "host", "dispatch") == "host"
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_DISPATCH", "gpu")
    with pytest.raises(ValueError, match="MEMRA_DSV4_PREFILL_DISPATCH.*'gpu'.*host, device"):
        seams.resolve("prefill_dispatch")
    for fn in (gm.Dsv4Gpu.__init__, gm.Dsv4Gpu.load, gm.Dsv4Gpu.synthetic):
        p = inspect.signature(fn).parameters
        assert "prefill_dispatch" in p and p["prefill_dispatch"].default is None, fn.__qualname__
    blk = gm._Block.__new__(gm._Block)
    for v in ("host", "device"):
        blk.m = SimpleNamespace(prefill_dispatch=v)
        assert blk._moe_dispatch("fp4mma") == v
        assert blk._moe_dispatch("wgmma") == v
        assert blk._moe_dispatch("blaslt") == "host"
    blk.m = SimpleNamespace()                      # a model without the attribute: the default
    assert blk._moe_dispatch("fp4mma") == s.default
    assert blk._moe_dispatch("wgmma") == s.default


def test_routed_moe_refuses_device_dispatch_for_blaslt():
    """routed_moe(dispatch="device") is the fp4mma arm's (blaslt sizes its batches on the host);
    both refusals come before anything touches CuPy or a device."""
    from memra_dsv4.gpu.ops import prefill_moe as PM
    assert PM.DISPATCHES == ("host", "device")
    for gemm, disp, msg in (("blaslt", "device", "needs gemm 'fp4mma'"), ("fp4mma", "gpu", "not in")):
        with pytest.raises(ValueError, match=msg):
            PM.routed_moe(None, None, None, None, {}, "mxfp4", 10.0, None, gemm=gemm, dispatch=disp)


def test_prefill_pipeline_seam_and_plan(monkeypatch):
    """MEMRA_DSV4_PREFILL_PIPELINE: off | on | coop (default); the chunk plan: none for one stage or
    short prompts, else N_CHUNKS (3 by default) chunks of whole 64-token multiples (the last takes
    the rest); a bench may set N_CHUNKS (read at each call)."""
    from types import SimpleNamespace
    from memra_dsv4.gpu import pipeline as PL
    s = seams.SEAMS["prefill_pipeline"]
    assert (s.env, s.default, s.allowed) == ("MEMRA_DSV4_PREFILL_PIPELINE", "coop", ("off", "on", "coop"))
    monkeypatch.setenv("MEMRA_DSV4_PREFILL_PIPELINE", "yes")
    with pytest.raises(ValueError, match="MEMRA_DSV4_PREFILL_PIPELINE.*'yes'.*off, on, coop"):
        seams.resolve("prefill_pipeline")
    assert PL.pipeline_chunks(8192, 1) is None
    assert PL.pipeline_chunks(2047, 2) is None
    assert PL.N_CHUNKS == 3
    assert PL.pipeline_chunks(8192, 2) == [2752, 2752, 2688]
    assert PL.pipeline_chunks(2048, 2) == [1024, 1024]
    assert PL.pipeline_chunks(3000, 2) == [1536, 1464]
    assert PL.pipeline_chunks(5000, 2) == [1728, 1728, 1544]
    monkeypatch.setattr(PL, "N_CHUNKS", 4)
    assert PL.pipeline_chunks(8192, 2) == [2048] * 4
    assert PL.pipeline_chunks(5000, 2) == [1280, 1280, 1280, 1160]
    monkeypatch.setattr(PL, "N_CHUNKS", 3)
    for S in range(2048, 20000, 37):
        ch = PL.pipeline_chunks(S, 3)
        assert sum(ch) == S and 2 <= len(ch) <= PL.N_CHUNKS and all(c % 64 == 0 for c in ch[:-1])
        assert min(ch[:-1]) >= PL.MIN_CHUNK and ch[-1] > 0
    one = SimpleNamespace(force_bounce=False, stages=[SimpleNamespace(device=0)])
    assert not PL.pipeline_supported(one)
    bounce = SimpleNamespace(force_bounce=True, stages=[SimpleNamespace(device=0), SimpleNamespace(device=1)])
    assert not PL.pipeline_supported(bounce)
