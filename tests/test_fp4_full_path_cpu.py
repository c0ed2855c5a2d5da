"""The full-shape fast FP4 kernels (kernels_cu/experts.cu "full-shape fast paths") without a GPU.

* Selection: ops.experts launches gemv_{fmt}_gateup_k4_f exactly for K = 4096 with whole row
  groups, gemv_{fmt}_down_combine_k2_f exactly for K = 2048, whole row groups and an even k >= 2,
  and the general _k* kernels otherwise or inside `full_path(False)` (fake CuPy, fake kernels:
  the launches are checked against the .cu signatures).
* Same arithmetic by construction (the source): the fast streams call the same chunk_dots (every
  lane folds: qok = true, which the general path also has on these shapes: lane + 32 i < nq for
  every lane) and end each group through the same plan epilogue as fp4_stream (gate/up: finish;
  down: finish_rank / begin_rank, which DownPlan's finish / begin delegate to); the four _f
  kernels are the GEMV_FP4_GATEUP / GEMV_FP4_DOWN macros with FULL = true, and no other is.
The bytes are the GPU test's: tests/gpu/test_kernels_experts.py -k full_path.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tests.test_kernel_sources import KDIR, fake_ops_module

SRC = open(os.path.join(KDIR, "experts.cu"), encoding="utf-8").read()
FULL = {"gemv_mxfp4_gateup_k4_f", "gemv_nvfp4_gateup_k4_f", "gemv_mxfp4_down_combine_k2_f",
        "gemv_nvfp4_down_combine_k2_f"}


@pytest.fixture
def fake_ex(monkeypatch):
    launched = []
    fake, EX = fake_ops_module(monkeypatch, "experts", lambda n, *a: launched.append(n))
    return fake, EX, launched


def _gateup(fake, EX, fmt, O, K, S=6, x_div=6):
    A, z = fake.asarray, np.zeros
    tab = A(z(8, np.uint64))
    ws2 = A(z(8, np.float32)) if fmt == "nvfp4" else None
    EX.gemv_fp4_gateup(fmt, A(z((1, K), np.uint16)), A(z(S, np.int32)), tab, tab, tab, tab, O, K,
                       weight=A(z(S, np.float32)), x_div=x_div, ws2_1=ws2, ws2_3=ws2)


def _down(fake, EX, fmt, O, K, k, T=1):
    A, z = fake.asarray, np.zeros
    tab = A(z(8, np.uint64))
    ws2 = A(z(8, np.float32)) if fmt == "nvfp4" else None
    EX.gemv_fp4_down_combine(fmt, A(z((T * k, K), np.uint16)), A(z((T, k), np.int32)), tab, tab, O, K,
                             shared=A(z((T, O), np.uint16)), ws2=ws2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gateup_selection(fake_ex, fmt):
    fake, EX, launched = fake_ex
    for O, K, want in [(2048, 4096, "_k4_f"), (2050, 4096, "_k4_f"), (2047, 4096, "_k4"), (2048, 4064, "_k4"),
                       (2048, 2048, "_k2"), (256, 256, "_k1")]:
        launched.clear()
        _gateup(fake, EX, fmt, O, K)
        assert launched == [f"gemv_{fmt}_gateup{want}"], (O, K, launched)
        assert EX.gateup_full(O, K) == want.endswith("_f")
    with EX.full_path(False):
        launched.clear()
        _gateup(fake, EX, fmt, 2048, 4096)
        assert launched == [f"gemv_{fmt}_gateup_k4"]
        assert not EX.gateup_full(2048, 4096)
    assert EX.FULL_PATH and EX.gateup_full(2048, 4096)   # restored


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_down_selection(fake_ex, fmt):
    fake, EX, launched = fake_ex
    for O, K, k, want in [(4096, 2048, 6, "_k2_f"), (4096, 2048, 2, "_k2_f"), (4096, 2048, 8, "_k2_f"),
                          (4096, 2048, 5, "_k2"), (4096, 2048, 1, "_k2"), (4095, 2048, 6, "_k2"),
                          (4096, 4096, 6, "_k4"), (4096, 1024, 6, "_k1"), (512, 2016, 6, "_k2")]:
        for T in (1, 3):
            launched.clear()
            _down(fake, EX, fmt, O, K, k, T)
            assert launched == [f"gemv_{fmt}_down_combine{want}"], (O, K, k, T, launched)
        assert EX.down_full(O, K, k) == want.endswith("_f")
    with EX.full_path(False):
        launched.clear()
        _down(fake, EX, fmt, 4096, 2048, 6)
        assert launched == [f"gemv_{fmt}_down_combine_k2"]


def test_flash_step_shapes_take_the_full_path(fake_ex):
    """The decode step's calls (step_device / decode: gate/up (O, K) = (I, D), down (D, I), k
    picks) at the Flash config qualify."""
    from memra_dsv4.config import preset

    c = preset("flash")
    _, EX, _ = fake_ex
    assert EX.gateup_full(c.moe_intermediate_size, c.hidden_size)
    assert EX.down_full(c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok)


def test_full_kernels_registered_and_declared_by_the_macros():
    import importlib

    from memra_dsv4.gpu.kernel_loader import registered

    importlib.import_module("memra_dsv4.gpu.ops.experts")   # registers the stem

    assert FULL <= set(registered()["experts"])
    got = set()
    for macro in ("GEMV_FP4_GATEUP", "GEMV_FP4_DOWN"):
        for name, kpl, nv, full in re.findall(rf"^{macro}\((\w+), (\d), (true|false), (true|false)\)", SRC, re.M):
            assert (full == "true") == name.endswith("_f"), name
            assert nv == ("true" if name.startswith("gemv_nvfp4") else "false"), name
            if full == "true":
                got.add(name)
                assert kpl == ("4" if "gateup" in name else "2"), name
    assert got == FULL


def _body(name: str) -> str:
    i = SRC.index(f"DEV void {name}(")
    j = SRC.index("\n}\n", i)
    return SRC[i:j]


def test_fast_streams_keep_the_row_arithmetic():
    gu, dn, gen = _body("fp4_stream_gateup_full"), _body("fp4_stream_down_full") + SRC[SRC.index("struct DownRing {"):SRC.index("\n};\n", SRC.index("struct DownRing {"))], _body("fp4_stream")
    # the one chunk routine, every lane folding (the general path's qok on these shapes)
    assert re.search(r"chunk_dots<NRM, NV, XF>\(rw\[d\], rs\[d\], .*lane \+ 32 \* i < nq, acc\)", gen, re.S)
    assert re.search(r"chunk_dots<NRM, NV, true>\(rw\[d\], rs\[d\], xq \+ 16 \* 256 \* i, b, true, acc\)", gu)
    assert re.search(r"chunk_dots<R, NV, P::XF>\(rw\[d\], rs\[d\], .*\(\(P::XF \? 256 : 128\) \* i \+ lane\), b,\s*true, acc\)",
                     dn, re.S)
    # acc from zero per group / pick, chunks in order, the plan's epilogue at the group's end
    assert "acc[m] = 0.0f" in gu and "acc[m] = 0.0f" in dn
    assert "pl.finish(g, acc);" in gu and "pl.begin_rank(cr);" in dn
    # down: FP4_XRED tells finish_rank that the first pick of a trip (u < KPL: an even rank, as
    # k is even and every trip starts at an even rank) is not the row group's last
    assert "pl.finish_rank(cr, [rg] { return rg; }, acc, !FP4_XRED || u >= KPL);" in dn
    assert "constexpr int U = 2 * KPL;  // steps per trip: two picks" in dn and "if (++cr == k) {" in dn
    assert "if (may_be_last && rank == k - 1) {" in SRC
    assert "DEV void begin(int g) { begin_rank(g % k); }" in SRC
    assert re.search(r"DEV void finish\(int g, float \(&acc\)\[R\]\) \{\s*finish_rank\(g % k, \[&\] \{ return g / k; \}, acc\);", SRC)
    # the loads: the rows' bytes at the general path's offsets (row o at o * K/2, chunk q at 16 q;
    # scale bytes at o * K/32 (NVFP4 K/16) + q (2 q)), here with K = 1024 KPL
    fetch = _body("fetch_full")
    assert "constexpr int HK = 512 * KPL, NS = (NV ? 64 : 32) * KPL;" in fetch
    assert "ldg_weight16(pw[m] + rr * HK + 512 * i)" in fetch
    # the scale bytes at ps[m] + rr * NS + (64 i, 64 i + 1 | 32 i): chunk_scales at p = ps[m] + rr * NS
    assert "chunk_scales<NV>(s[m * R + rr], ps[m] + rr * NS, i);" in fetch
    scales = _body("chunk_scales")
    assert "ldg_weight_u8(p + 64 * i)" in scales and "ldg_weight_u8(p + 64 * i + 1)" in scales
    assert "ldg_weight_u8(p + 32 * i)" in scales


# ------------------------------------------------- the gate/up with its weight ring in shared memory
RING = {"gemv_mxfp4_gateup_k4_r", "gemv_nvfp4_gateup_k4_r"}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gateup_ring_selection(fake_ex, monkeypatch, fmt):
    """gemv_*_gateup_k4_r replaces _k4_f exactly where the full path applies and the ring is on
    (ops.experts.GATEUP_RING, or MEMRA_DSV4_FP4_RING = 1 / 0 over it), with its 64 KB of dynamic
    shared memory raised on the kernel; never on the general shapes or with the full path off."""
    fake, EX, launched = fake_ex
    monkeypatch.delenv(EX.RING_ENV, raising=False)
    assert EX.GATEUP_RING is False and not EX.gateup_ring_on()
    monkeypatch.setattr(EX, "GATEUP_RING", True)
    assert EX.gateup_ring_on()
    for O, K, want in [(2048, 4096, "_k4_r"), (2047, 4096, "_k4"), (2048, 2048, "_k2")]:
        launched.clear()
        _gateup(fake, EX, fmt, O, K)
        assert launched == [f"gemv_{fmt}_gateup{want}"], (O, K, launched)
    assert EX.kernel("experts", f"gemv_{fmt}_gateup_k4_r").max_dynamic_shared_size_bytes == EX.GATEUP_RING_SMEM
    with EX.full_path(False):
        launched.clear()
        _gateup(fake, EX, fmt, 2048, 4096)
        assert launched == [f"gemv_{fmt}_gateup_k4"]
    for env, want in (("0", "_k4_f"), ("1", "_k4_r")):
        monkeypatch.setenv(EX.RING_ENV, env)
        launched.clear()
        _gateup(fake, EX, fmt, 2048, 4096)
        assert launched == [f"gemv_{fmt}_gateup{want}"], (env, launched)
    monkeypatch.setattr(EX, "GATEUP_RING", False)
    monkeypatch.setenv(EX.RING_ENV, "1")
    assert EX.gateup_ring_on()
    monkeypatch.setenv(EX.RING_ENV, "on")
    with pytest.raises(ValueError, match="MEMRA_DSV4_FP4_RING='on'.*0 or 1"):
        EX.gateup_ring_on()


def test_gateup_ring_kernels_and_smem():
    """The ring kernels are registered and declared by their macro (KPL 4, the full shape); the
    host's shared-memory size is the .cu's gateup_ring_bytes<4>() (4 steps x 2 R rows x 32 lanes x
    16 bytes x 8 warps at FP4_GU_R = 2 = GATEUP_ROWS_PER_GROUP)."""
    import importlib

    from memra_dsv4.gpu.kernel_loader import registered

    EX = importlib.import_module("memra_dsv4.gpu.ops.experts")
    assert RING <= set(registered()["experts"])
    got = dict(re.findall(r"^GEMV_FP4_GATEUP_RING\((\w+), (true|false)\)", SRC, re.M))
    assert got == {"gemv_mxfp4_gateup_k4_r": "false", "gemv_nvfp4_gateup_k4_r": "true"}
    assert "gemv_fp4_gateup_body<4, NV, true, true>" in SRC
    assert re.search(r"return KPL \* 2 \* FP4_GU_R \* 32 \* 16 \* FP4_WARPS;", SRC)
    assert re.search(r"#define FP4_GU_R 2\b", SRC) and EX.GATEUP_ROWS_PER_GROUP == 2
    assert EX.GATEUP_RING_SMEM == 4 * 2 * 2 * 32 * 16 * 8 == 65536


def test_gateup_ring_keeps_the_row_arithmetic():
    """The ring stream: the same chunk_dots per (step, rows), acc from zero per group, the plan's
    finish at the group's end (as fp4_stream_gateup_full); the wait before every slot's LDS is
    "at most KPL - 1 newer groups", one commit per step (empty without a next group), and the
    cp.async / wait asm carry "memory" clobbers (the ring's LDS may not move across them)."""
    ring = _body("fp4_stream_gateup_ring")
    assert re.search(r"chunk_dots<NRM, NV, true>\(w, sc, xq \+ 16 \* 256 \* i, b, true, acc\)", ring)
    assert "acc[m] = 0.0f" in ring and "pl.finish(g, acc);" in ring
    loop = ring[ring.index("for (int i = 0; i < KPL; ++i) {\n            ring_wait"):]
    assert loop.index("ring_wait<KPL - 1>();") < loop.index("w[m] = wr[") < loop.index("if (next) issue(i);")
    assert loop.index("if (next) issue(i);") < loop.index("ring_commit();") < loop.index("chunk_dots<")
    assert "ring_wait<0>();" in ring[ring.rindex("pl.finish(g, acc);"):]
    for fn in ("ring_cp16", "ring_commit", "ring_wait"):
        i = SRC.index(f"DEV void {fn}(")
        assert '"memory"' in SRC[i:SRC.index("\n", SRC.index("asm volatile", i))], fn


def test_bench_decode_fp4ring_arm_sets_the_env():
    from bench.decode_step import _kernel_env
    assert _kernel_env({"fp4ring": "on"}, None) == {"MEMRA_DSV4_FP4_RING": "1"}
    assert _kernel_env({"fp4ring": "off"}, None) == {"MEMRA_DSV4_FP4_RING": "0"}
