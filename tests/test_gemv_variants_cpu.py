"""The dense GEMV variants' wrappers (memra_dsv4/gpu/ops_decode.py) without a GPU: every variant
kernel is registered, declared in decode.cu and launched with its signature's argument kinds,
a dynamic shared-memory size it is allowed (<= 227 KB, the limit raised above 48 KB) and a grid
of whole CTAs covering nw <= groups warps; the selection (explicit > MEMRA_DSV4_GEMV_VARIANT >
GEMV_SELECT > default) and its fallback.  The bits are the GPU test's (tests/gpu/
test_gemv_variants.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.test_kernel_sources import KDIR, declared_kernels, fake_ops_module


@pytest.fixture
def fake_launch(monkeypatch):
    launched = []

    def launch_ok(name, grid, block, shared_mem):
        assert shared_mem <= 227 * 1024
        assert tuple(block) == ((32,) if name == "l2_prefetch_paced" else (128,))

    def record(name, grid, block, args, shared_mem):
        launched.append((name, tuple(grid), args, shared_mem))

    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode", record, launch_ok)
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV, raising=False)
    return fake, DK, launched


def _bulk_check(name, grid, args, groups):
    nw = int(args[-1])
    assert 1 <= nw <= groups, f"{name}: nw {nw}, groups {groups}"
    assert grid[0] == -(-nw // 4), f"{name}: grid {grid} for {nw} warps"


def test_every_variant_launches(fake_launch):
    fake, DK, launched = fake_launch
    A = fake.asarray
    declared = declared_kernels(os.path.join(KDIR, "decode.cu"))
    assert set(DK.KERNELS) <= declared
    for fp8 in (False, True):
        for O, K, g in [(1024, 4096, 1), (8192, 4096, 8), (32768, 1024, 1), (37, 2064, 1)]:
            w = A(np.zeros((O, K), np.uint8 if fp8 else np.uint16))
            kw = dict(scale=A(np.zeros((-(-O // 128), -(-K // 128)), np.uint8))) if fp8 else {}
            for vn in DK.gemv_variant_names("plain", fp8, new_only=False):
                launched.clear()
                ps, pl = DK.parse_ps(vn), DK.parse_pl(vn)
                rpg = O // g if g > 1 else 0
                if (ps is not None and not DK.ps_ok(*ps, fp8, K, rpg)) or (
                        pl is not None and not DK.pl_ok(pl, fp8, K, rpg)):
                    assert K % 1024, f"{vn} refused [{O}x{K}] groups {g}"
                    with pytest.raises(AssertionError, match="not available"):
                        DK.gemv_bf16(w, A(np.zeros(g * K, np.uint16)), A(np.zeros(O, np.float32)),
                                     groups=g, variant=vn, **kw)
                    assert not launched
                    continue
                DK.gemv_bf16(w, A(np.zeros(g * K, np.uint16)), A(np.zeros(O, np.float32)), groups=g,
                             variant=vn, **kw)
                (name, grid, args, smem), = launched
                if ps is not None:   # a persistent grid: min(groups, resident warps) warps
                    assert not fp8 and name == f"gemv_bf16_{vn}"
                    minb = next(m for r, d, m in DK.GEMV_PS if (r, d) == ps)
                    nw = min(-(-O // ps[0]), 132 * 4 * minb)
                    assert grid == (-(-nw // 4),), f"{name}: grid {grid}, expected {nw} warps"
                elif pl is not None:   # one warp per R rows, like the r*t* kernels
                    assert not fp8 and name == f"gemv_bf16_{vn}"
                    assert grid == (-(-(-(-O // pl)) // 4),), f"{name}: grid {grid}"
                elif vn == "default":
                    R, T = DK.gemv_default_variant(fp8, K)
                    assert name == DK._gemv_kernel_name(fp8, R, T)
                elif vn.startswith("bulk_"):
                    assert name == f"gemv_{'fp8' if fp8 else 'bf16'}_{vn}"
                    _bulk_check(name, grid, args, -(-O // DK._parse_variant(vn, "r")[1]))
                else:
                    assert name == f"gemv_{'fp8' if fp8 else 'bf16'}_" + (vn[:-2] if vn.endswith("t1") else vn)
    K = 4096
    segs = [(A(np.zeros((o, K), np.uint16)), A(np.zeros(o, np.float32))) for o in (1024, 512, 64)]
    segs.append(((A(np.zeros((130, K), np.uint8)), A(np.zeros((2, 32), np.uint8))), A(np.zeros(130, np.uint16))))
    x, pos = A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32))
    tabs = {R: DK.GemvTable(segs, K, rows_per_warp=R) for R in DK.MULTI_ROWS}
    assert tabs[4].fp8 and tabs[4].cls == "small"
    for vn in DK.gemv_variant_names("multi", True, new_only=False):
        R = 4 if vn == "default" else DK.parse_multi_variant(vn)[1]
        launched.clear()
        DK.gemv_bf16_multi(tabs[R], x, pos, variant=vn)
        (name, grid, args, smem), = launched
        assert name == f"gemv_bf16_multi_{'r4' if vn == 'default' else vn}"
        if vn.startswith("bulk_"):
            _bulk_check(name, grid, args, tabs[R].warps)
    with pytest.raises(AssertionError, match="not available"):
        DK.gemv_bf16_multi(tabs[4], x, pos, variant="bulk_r1s8")
    w1 = A(np.zeros((2048, K), np.uint8))
    s1 = A(np.zeros((16, 32), np.uint8))
    for vn in DK.gemv_variant_names("swiglu", True, new_only=False):
        launched.clear()
        DK.gemv_bf16_swiglu(w1, w1, x, A(np.zeros(2048, np.uint16)), 10.0, scale1=s1, scale3=s1, variant=vn)
        (name, grid, args, smem), = launched
        assert name == f"gemv_bf16_swiglu_{'p2' if vn == 'default' else vn}"
        if vn.startswith("bulk_"):
            _bulk_check(name, grid, args, -(-2048 // DK._parse_variant(vn, "p")[1]))
    gemv = {n for n in DK.KERNELS if n.startswith("gemv_") and not n.endswith("_qn")
            and not n.startswith("gemv_bf16_pl2_")     # pair kernels: test_idxq_pair_launches
            and not n.startswith("gemv_bf16_x")         # multi-row kernels: test_xrows_launches,
            and not n.startswith("gemv_bf16_multi_x")   # test_multi_rows_launches,
            and not n.startswith("gemv_bf16_swiglu_x")}  # test_swiglu_xrows_launches
    assert {n for n in DK.KERNELS if n.startswith("gemv_bf16_x")} == {
        f"gemv_bf16_x{nx}_r{r}" for nx, r in DK.XROWS_KERNELS}
    assert {n for n in DK.KERNELS if n.startswith("gemv_bf16_multi_x")} == {
        f"gemv_bf16_multi_x{nx}_r{r}" for nx, r in DK.XROWS_KERNELS}
    assert {n for n in DK.KERNELS if n.startswith("gemv_bf16_pl2_")} == {f"gemv_bf16_pl2_r{r}" for r in DK.GEMV_PL}
    qn = {n for n in DK.KERNELS if n.endswith("_qn")}
    assert qn == ({f"gemv_bf16_multi_r{r}" + (f"t{t}" if t > 1 else "") + "_qn" for r, t in DK.MULTI_VARIANTS}
                  | {f"gemv_bf16_pl_r{r}_qn" for r in DK.GEMV_PL})
    seen = set()
    for fp8 in (False, True):
        for op in ("plain", "multi", "swiglu"):
            for vn in DK.gemv_variant_names(op, fp8, new_only=False)[1:]:
                base = {"plain": f"gemv_{'fp8' if fp8 else 'bf16'}_", "multi": "gemv_bf16_multi_",
                        "swiglu": "gemv_bf16_swiglu_"}[op]
                seen.add(base + (vn[:-2] if op == "plain" and vn.endswith("t1") else vn))
    assert gemv == seen, f"variants without a name: {sorted(gemv - seen)}; names without a kernel: {sorted(seen - gemv)}"


def test_selection_order_and_fallback(fake_launch, monkeypatch):
    fake, DK, launched = fake_launch
    A = fake.asarray
    monkeypatch.setattr(DK, "GEMV_SELECT", {})   # the mechanism on an empty table (shipped pick: below)
    assert DK.gemv_selected("plain", True, "large") is None           # nothing selected: defaults
    monkeypatch.setitem(DK.GEMV_SELECT, "plain.fp8", "bulk_r4s4")
    monkeypatch.setitem(DK.GEMV_SELECT, "plain.fp8.small", "r2t4")
    assert DK.gemv_selected("plain", True, "large") == "bulk_r4s4"
    assert DK.gemv_selected("plain", True, "small") == "r2t4"
    assert DK.gemv_selected("plain", False, "small") is None
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain=default, swiglu=bulk_p1s4")
    assert DK.gemv_selected("plain", True, "large") is None            # the env wins, 'default'
    assert DK.gemv_selected("swiglu", False, "large") == "bulk_p1s4"
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.fp8=bulk_r4s4")
    O, K = 256, 1032                                                    # K % 16: no bulk kernel
    w, s = A(np.zeros((O, K), np.uint8)), A(np.zeros((2, 9), np.uint8))
    DK.gemv_bf16(w, A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)), scale=s)
    assert launched[-1][0] == "gemv_fp8_r8"                             # fell back to the default
    with pytest.raises(AssertionError, match="not available"):
        DK.gemv_bf16(w, A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)), scale=s, variant="bulk_r4s4")
    O, K = 1024, 4096
    w, s = A(np.zeros((O, K), np.uint8)), A(np.zeros((8, 32), np.uint8))
    DK.gemv_bf16(w, A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)), scale=s)
    assert launched[-1][0] == "gemv_fp8_bulk_r4s4"
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.fp8")
    with pytest.raises(AssertionError, match="KEY=VARIANT"):
        DK.gemv_selected("plain", True, "large")
    with pytest.raises(ValueError, match="gemv variant"):
        DK._parse_variant("bulk_q4", "r")


def test_site_key_and_ps_fallback(fake_launch, monkeypatch):
    """A launch's site ("out": wo_a / wo_b in the step) is the most specific key; a ps_r*d* pick
    runs the persistent kernel where it can (bf16, K % 1024 == 0) and falls back otherwise."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.out=ps_r2d2")
    assert DK.gemv_selected("plain", False, "large", "out") == "ps_r2d2"
    assert DK.gemv_selected("plain", False, "large") == DK.GEMV_SELECT.get("plain.bf16.large")
    assert "plain.fp8.large" not in DK.GEMV_SELECT
    assert DK.gemv_selected("plain", True, "large", "out") is None      # the bf16 key only
    O, K = 4096, 8192                                                   # wo_b
    DK.gemv_bf16(A(np.zeros((O, K), np.uint16)), A(np.zeros(K, np.uint16)), A(np.zeros(O, np.uint16)),
                 site="out")
    (name, grid, _, _), = launched[-1:]
    assert name == "gemv_bf16_ps_r2d2" and grid == (min(O // 2, 132 * 4 * 4) // 4,)
    DK.gemv_bf16(A(np.zeros((O, K), np.uint16)), A(np.zeros(K, np.uint16)), A(np.zeros(O, np.uint16)))
    assert launched[-1][0] != "gemv_bf16_ps_r2d2"                       # no site: the class pick
    O, K = 256, 1032                                                    # K % 1024: not eligible
    DK.gemv_bf16(A(np.zeros((O, K), np.uint16)), A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)),
                 site="out")
    assert launched[-1][0] == "gemv_bf16_r4"                            # fell back to the default
    with pytest.raises(AssertionError, match="not available"):
        DK.gemv_bf16(A(np.zeros((O, K), np.uint16)), A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)),
                     variant="ps_r2d2")
    with pytest.raises(ValueError, match="ps_rNdD"):
        DK.parse_ps("ps_rxd2")
    with pytest.raises(ValueError, match="pl_rN"):
        DK.parse_pl("pl_rx")
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.large=pl_r2")
    O, K = 32768, 1024                                                  # wq_b
    DK.gemv_bf16(A(np.zeros((O, K), np.uint16)), A(np.zeros(K, np.uint16)), A(np.zeros(O, np.uint16)))
    assert launched[-1][0] == "gemv_bf16_pl_r2" and launched[-1][1] == (O // 2 // 4,)


def test_shipped_pick_launches(fake_launch, monkeypatch):
    """GEMV_SELECT as shipped (the 57a2c0d measurement; pl_r2 for large bf16 since a40ee2f): which
    kernel each step GEMV launches when nothing overrides it; a large bf16 launch pl_r2 cannot take
    gets r2t2; the fp8 multi table and fp8 large GEMVs keep the defaults."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV, raising=False)
    cases = [((1024, 4096), np.uint16, "gemv_bf16_r1t2"),      # wq_a: small bf16
             ((32768, 1024), np.uint16, "gemv_bf16_pl_r2"),    # wq_b: large bf16
             ((16384, 1536), np.uint16, "gemv_bf16_r2t2"),     # large bf16, K % 1024 != 0: no pl_r2
             ((1024, 4096), np.uint8, "gemv_fp8_r2t2"),        # small fp8
             ((32768, 1024), np.uint8, "gemv_fp8_r8")]         # large fp8: default (K < 2048)
    for (O, K), dt, name in cases:
        w = A(np.zeros((O, K), dt))
        kw = {"scale": A(np.zeros((-(-O // 128), -(-K // 128)), np.uint8))} if dt == np.uint8 else {}
        DK.gemv_bf16(w, A(np.zeros(K, np.uint16)), A(np.zeros(O, np.float32)), **kw)
        assert launched[-1][0] == name, (O, K, dt, launched[-1][0])
    K = 4096
    # multi.bf16 "default": the r4 kernel every measured step ran (GEMV_SELECT's comment), for
    # plain bf16 arrays and for the step's (weight, None) pairs alike (not FP8: the forty-first
    # session's fix; before it a pair flagged the table FP8)
    for pair in (False, True):
        ents = [((A(np.zeros((o, K), np.uint16)), None) if pair else A(np.zeros((o, K), np.uint16)),
                 A(np.zeros(o, np.float32))) for o in (1024, 512)]
        tab = DK.GemvTable(ents, K)
        assert not tab.fp8 and tab.R == 4
        DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)))
        assert launched[-1][0] == "gemv_bf16_multi_r4"
    # the env's multi.bf16 key now reaches a table of (weight, None) pairs
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "multi.bf16=r1t2")
    tab = DK.GemvTable([((A(np.zeros((o, K), np.uint16)), None), A(np.zeros(o, np.float32))) for o in (1024, 512)], K)
    assert tab.R == 1
    DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)))
    assert launched[-1][0] == "gemv_bf16_multi_r1t2"
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV)
    tab8 = DK.GemvTable([((A(np.zeros((256, K), np.uint8)), A(np.zeros((2, 32), np.uint8))),
                          A(np.zeros(256, np.uint16)))], K)
    assert tab8.R == 4
    DK.gemv_bf16_multi(tab8, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)))
    assert launched[-1][0] == "gemv_bf16_multi_r4"
    for dt, kw in ((np.uint16, {}), (np.uint8, {"scale1": A(np.zeros((16, 32), np.uint8)),
                                               "scale3": A(np.zeros((16, 32), np.uint8))})):
        w = A(np.zeros((2048, K), dt))
        DK.gemv_bf16_swiglu(w, w, A(np.zeros(K, np.uint16)), A(np.zeros(2048, np.uint16)), 10.0, **kw)
        assert launched[-1][0] == "gemv_bf16_swiglu_p1t2"


def test_multi_qnorm_launches(fake_launch, monkeypatch):
    """gemv_bf16_multi(qnorm=(y, w, eps)): the register kernels' _qn forms with the norm's
    arguments and the ticket counter appended; a bulk variant launches rmsnorm_bf16_wbf16 on y
    after it; y must be one of the table's bf16 outputs and w bf16 [y.size] (AssertionError
    naming the argument, before any launch)."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    from memra_dsv4.gpu.ops import rmsnorm as RN
    monkeypatch.setattr(RN, "kernel", DK.kernel)            # the same recording fake
    monkeypatch.setattr(DK, "qnorm_counter", lambda: A(np.zeros(1, np.int32)))
    K = 4096
    qr, kv = A(np.zeros(1024, np.uint16)), A(np.zeros(512, np.float32))
    w = A(np.zeros(1024, np.uint16))
    for R in (1, 4):
        tab = DK.GemvTable([(A(np.zeros((1024, K), np.uint16)), qr), (A(np.zeros((512, K), np.uint16)), kv)],
                           K, rows_per_warp=R)
        for vn in [v for v in DK.gemv_variant_names("multi", False, new_only=False)
                   if v == "default" or DK.parse_multi_variant(v)[1] == R]:
            launched.clear()
            DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)), variant=vn,
                               qnorm=(qr, w, 1e-6))
            if vn.startswith("bulk_"):
                assert [l[0] for l in launched] == [f"gemv_bf16_multi_{vn}", "rmsnorm_bf16_wbf16"]
                assert launched[1][1] == (1,)
            else:
                (name, grid, args, _), = launched
                # a pl variant has no _qn form: the register kernel of its R and T
                base = f"gemv_bf16_multi_r{R}" if vn == "default" else f"gemv_bf16_multi_{vn.removeprefix('pl_')}"
                assert name == base + "_qn" and len(args) == 10 and int(args[7]) == 1024, (vn, name)
        with pytest.raises(AssertionError, match="not one of the table's bf16 outputs"):
            DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)),
                               qnorm=(A(np.zeros(1024, np.uint16)), w, 1e-6))
        with pytest.raises(AssertionError, match="qnorm.weight"):
            DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)),
                               qnorm=(qr, A(np.zeros(512, np.uint16)), 1e-6))
        with pytest.raises(AssertionError, match="expected \\(y, weight, eps\\)"):
            DK.gemv_bf16_multi(tab, A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32)), qnorm=(qr, w))


def test_wqb_qnorm_launches(fake_launch, monkeypatch):
    """gemv_bf16_qnorm (the attention's q_norm inside wq_b, MEMRA_DSV4_WQB_QNORM): one
    gemv_bf16_pl_r{R}_qn launch where wq_b runs as pl_r{R} with K = 1024 and bf16 weights (its
    arguments: W, raw x, norm weight, eps, xn_out, out, O, K, out_bf16); otherwise
    rmsnorm_bf16_wbf16 into xn_out, then the plain GEMV reading xn_out.  Overlapping x / xn_out
    and wrong sizes are refused before any launch."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    from memra_dsv4.gpu.ops import rmsnorm as RN
    monkeypatch.setattr(RN, "kernel", DK.kernel)            # the same recording fake
    nw = A(np.zeros(1024, np.uint16))
    for O, R in ((32768, 2), (32868, 2)):   # the second: a partial last CTA
        launched.clear()
        x, xn, out = A(np.zeros(1024, np.uint16)), A(np.zeros(1024, np.uint16)), A(np.zeros(O, np.uint16))
        got = DK.gemv_bf16_qnorm(A(np.zeros((O, 1024), np.uint16)), x, out, nw, 1e-6, xn)
        assert len(launched) == 1, [l[0] for l in launched]
        (name, grid, args, _), = launched
        assert got == "fused" and name == f"gemv_bf16_pl_r{R}_qn", (O, name)
        assert grid == (-(-(-(-O // R)) // 4),) and len(args) == 9
        assert int(args[6]) == O and int(args[7]) == 1024 and int(args[8]) == 1
        assert args[1] is x and args[4] is xn and args[5] is out
    # pl_r4 selected through the env override
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.large=pl_r4")
    launched.clear()
    DK.gemv_bf16_qnorm(A(np.zeros((32768, 1024), np.uint16)), A(np.zeros(1024, np.uint16)),
                       A(np.zeros(32768, np.float32)), nw, 1e-6, A(np.zeros(1024, np.uint16)))
    assert [l[0] for l in launched] == ["gemv_bf16_pl_r4_qn"]
    # a variant that is not pl: the two launches
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.large=r2t2")
    launched.clear()
    xn = A(np.zeros(1024, np.uint16))
    got = DK.gemv_bf16_qnorm(A(np.zeros((32768, 1024), np.uint16)), A(np.zeros(1024, np.uint16)),
                             A(np.zeros(32768, np.float32)), nw, 1e-6, xn)
    assert got == "split" and [l[0] for l in launched] == ["rmsnorm_bf16_wbf16", "gemv_bf16_r2t2"]
    assert launched[1][2][3] is not None
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV)
    # K = 2048 (pl takes it, the _qn form does not) and FP8 weights: split
    launched.clear()
    got = DK.gemv_bf16_qnorm(A(np.zeros((32768, 2048), np.uint16)), A(np.zeros(2048, np.uint16)),
                             A(np.zeros(32768, np.float32)), A(np.zeros(2048, np.uint16)), 1e-6,
                             A(np.zeros(2048, np.uint16)))
    assert got == "split" and [l[0] for l in launched] == ["rmsnorm_bf16_wbf16", "gemv_bf16_pl_r2"]
    launched.clear()
    got = DK.gemv_bf16_qnorm(A(np.zeros((32768, 1024), np.uint8)), A(np.zeros(1024, np.uint16)),
                             A(np.zeros(32768, np.float32)), nw, 1e-6, A(np.zeros(1024, np.uint16)),
                             scale=A(np.zeros((256, 8), np.uint8)))
    assert got == "split" and launched[0][0] == "rmsnorm_bf16_wbf16" and launched[1][0].startswith("gemv_fp8_")
    # refusals, before any launch
    launched.clear()
    buf = A(np.zeros(2048, np.uint16))
    with pytest.raises(AssertionError, match="overlap"):
        DK.gemv_bf16_qnorm(A(np.zeros((64, 1024), np.uint16)), buf[:1024], A(np.zeros(64, np.float32)),
                           nw, 1e-6, buf[512:1536])
    with pytest.raises(AssertionError, match="expected K = 1024"):
        DK.gemv_bf16_qnorm(A(np.zeros((64, 1024), np.uint16)), A(np.zeros(512, np.uint16)),
                           A(np.zeros(64, np.float32)), nw, 1e-6, A(np.zeros(1024, np.uint16)))
    with pytest.raises(AssertionError, match="norm_weight"):
        DK.gemv_bf16_qnorm(A(np.zeros((64, 1024), np.uint16)), A(np.zeros(1024, np.uint16)),
                           A(np.zeros(64, np.float32)), A(np.zeros(512, np.uint16)), 1e-6,
                           A(np.zeros(1024, np.uint16)))
    assert not launched


def test_idxq_pair_launches(fake_launch, monkeypatch):
    """gemv_bf16_pair (wq_b + the CSA indexer's q GEMV, MEMRA_DSV4_IDXQ_PAIR): one
    gemv_bf16_pl2_r{R} launch over both row sets when the first GEMV runs as pl_r{R} (grid: the
    warps of both, R rows each; arguments W, W2, x, out, out2, O, O2, K, out_bf16, out2_bf16);
    otherwise the two plain launches (FP8 weights with their scales, a non-pl variant, K % 1024
    != 0); mismatched K / sizes refused before any launch."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    K = 1024
    w, w2 = A(np.zeros((32768, K), np.uint16)), A(np.zeros((8192, K), np.uint16))
    x, y, y2 = A(np.zeros(K, np.uint16)), A(np.zeros(32768, np.uint16)), A(np.zeros(8192, np.float32))
    assert DK.gemv_bf16_pair(w, w2, x, y, y2) == "fused"
    (name, grid, args, _), = launched
    assert name == "gemv_bf16_pl2_r2" and grid == (-(-(16384 + 4096) // 4),)
    assert args[0] is w and args[1] is w2 and args[2] is x and args[3] is y and args[4] is y2
    assert [int(a) for a in args[5:]] == [32768, 8192, K, 1, 0]
    # an odd second row count: the warps round up per matrix
    launched.clear()
    w3 = A(np.zeros((8193, K), np.uint16))
    DK.gemv_bf16_pair(w, w3, x, y, A(np.zeros(8193, np.uint16)))
    assert launched[0][1] == (-(-(16384 + 4097) // 4),)
    # pl_r4 through the env override
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.large=pl_r4")
    launched.clear()
    DK.gemv_bf16_pair(w, w2, x, y, y2)
    assert [l[0] for l in launched] == ["gemv_bf16_pl2_r4"] and launched[0][1] == (-(-(8192 + 2048) // 4),)
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain.bf16.large=r2t2")
    launched.clear()
    assert DK.gemv_bf16_pair(w, w2, x, y, y2) == "split"
    assert [l[0] for l in launched] == ["gemv_bf16_r2t2", "gemv_bf16_r1t2"]
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV)
    # FP8 weights: the two launches with their scales
    launched.clear()
    f1, f2 = A(np.zeros((32768, K), np.uint8)), A(np.zeros((8192, K), np.uint8))
    s1, s2 = A(np.zeros((256, 8), np.uint8)), A(np.zeros((64, 8), np.uint8))
    assert DK.gemv_bf16_pair(f1, f2, x, y, y2, scale=s1, scale2=s2) == "split"
    assert [l[0][:9] for l in launched] == ["gemv_fp8_", "gemv_fp8_"]
    # K % 1024 != 0: split
    launched.clear()
    assert DK.gemv_bf16_pair(A(np.zeros((32768, 512), np.uint16)), A(np.zeros((8192, 512), np.uint16)),
                             A(np.zeros(512, np.uint16)), y, y2) == "split"
    # refusals
    launched.clear()
    with pytest.raises(AssertionError, match="gemv_bf16_pair"):
        DK.gemv_bf16_pair(w, A(np.zeros((8192, 512), np.uint16)), x, y, y2)
    with pytest.raises(AssertionError, match="gemv_bf16_pair.out2"):
        DK.gemv_bf16_pair(w, w2, x, y, A(np.zeros(8191, np.float32)))
    assert not launched


def test_l2_prefetch_paced_launches(fake_launch):
    """l2_prefetch_paced (MEMRA_DSV4_L2_SIDE): one l2_prefetch_paced launch of `ctas` one-warp
    CTAs with the two ranges (the second a null pointer and 0 bytes when absent), the chunk and
    the sleep; nothing launched for 0 bytes; unaligned / oversized ranges refused."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    w, w2 = A(np.zeros((64, 1024), np.uint16)), A(np.zeros(4096, np.uint8))
    assert DK.l2_prefetch_paced([(w, 65536)], ctas=4, sleep_ns=100) == 65536
    (name, grid, args, _), = launched
    assert name == "l2_prefetch_paced" and grid == (4,)
    assert args[0] is w and int(args[1]) == 65536 and int(args[2]) == 0 and int(args[3]) == 0
    assert int(args[4]) == 65536 and int(args[5]) == 100
    launched.clear()
    assert DK.l2_prefetch_paced([(w, 1024), (w2, 4096)]) == 5120
    assert launched[0][2][2] is w2 and launched[0][1] == (8,)
    launched.clear()
    assert DK.l2_prefetch_paced([(w, 0)]) == 0 and not launched
    with pytest.raises(AssertionError, match="bytes of a"):
        DK.l2_prefetch_paced([(w, 8)])
    with pytest.raises(AssertionError, match="bytes of a"):
        DK.l2_prefetch_paced([(w, w.nbytes + 16)])
    with pytest.raises(AssertionError, match="chunk"):
        DK.l2_prefetch_paced([(w, 1024)], chunk=24)
    assert not launched


def test_multi_pl_variant_launches(fake_launch, monkeypatch):
    """The multi GEMV's preload variants (decode.cu gemv_bf16_multi_pl_r{R}[t{T}]): selected by
    the env key multi.bf16 (the table's R from the name), launched with the register kernel's grid
    and arguments; an explicit pl variant of another R, or of an (R, T) without a kernel, is
    refused; the name parser refuses a bulk-shaped pl name."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    assert DK.parse_multi_variant("pl_r1t2") == ("pl", 1, 2)
    assert DK.parse_multi_variant("pl_r4") == ("pl", 4, 1)
    assert DK.parse_multi_variant("bulk_r4s3") == ("bulk", 4, 3)
    assert DK.parse_multi_variant("r1t2") == ("reg", 1, 2)
    with pytest.raises(ValueError, match="pl_rN"):
        DK.parse_multi_variant("pl_bulk_r1s2")
    with pytest.raises(ValueError, match="gemv variant"):
        DK.parse_multi_variant("pl_q1")
    K = 4096
    ents = [(A(np.zeros((o, K), np.uint16)), A(np.zeros(o, np.float32))) for o in (1024, 512, 64)]
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "multi.bf16=pl_r1t2")
    tab = DK.GemvTable(ents, K)
    assert tab.R == 1 and tab.warps == 1600
    x, pos = A(np.zeros(K, np.uint16)), A(np.zeros(1, np.int32))
    DK.gemv_bf16_multi(tab, x, pos)
    (name, grid, args, _), = launched[-1:]
    assert name == "gemv_bf16_multi_pl_r1t2" and grid == (400,) and len(args) == 5
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "multi.bf16=pl_r4")
    tab4 = DK.GemvTable(ents, K)
    assert tab4.R == 4
    DK.gemv_bf16_multi(tab4, x, pos)
    assert launched[-1][0] == "gemv_bf16_multi_pl_r4" and launched[-1][1] == (100,)
    with pytest.raises(AssertionError, match="not available"):
        DK.gemv_bf16_multi(tab4, x, pos, variant="pl_r1t2")     # the table's R is 4
    with pytest.raises(AssertionError, match="not available"):
        DK.gemv_bf16_multi(tab4, x, pos, variant="pl_r4t2")     # no such kernel
    assert {n for n in DK.KERNELS if "_multi_pl_" in n} == {
        "gemv_bf16_multi_pl_r1", "gemv_bf16_multi_pl_r4", "gemv_bf16_multi_pl_r1t2"}


def test_xrows_launches(fake_launch):
    """gemv_bf16_xrows (the verify step's multi-row GEMV): the kernel with the fewest rows per warp
    for nx (x2_r4 / x4_r2 / x8_r1; with groups, an R dividing the rows per group), one warp per R
    rows, arguments W, X, ldx (elements), nx, Y, ldy (elements), O, K, rows per group, out_bf16;
    bad calls refused before any launch."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    O, K = 4097, 1024
    w = A(np.zeros((O, K), np.uint16))
    for nx, want in [(1, "gemv_bf16_x2_r4"), (2, "gemv_bf16_x2_r4"), (3, "gemv_bf16_x4_r2"),
                     (4, "gemv_bf16_x4_r2"), (5, "gemv_bf16_x8_r1"), (8, "gemv_bf16_x8_r1")]:
        launched.clear()
        X, Y = A(np.zeros((nx, K), np.uint16)), A(np.zeros((nx, O), np.float32))
        DK.gemv_bf16_xrows(w, X, Y)
        (name, grid, args, _), = launched
        R = int(name[-1])
        assert name == want and grid == (-(-(-(-O // R)) // 4),), (nx, name, grid)
        assert args[0] is w and args[1] is X and args[4] is Y
        assert [int(a) for a in (args[2], args[3], args[5], args[6], args[7], args[8], args[9])] == \
            [K, nx, O, O, K, 0, 0]
    # grouped (wo_a: 8 groups of 1024 rows), bf16 output
    launched.clear()
    wg = A(np.zeros((8192, 512), np.uint16))
    DK.gemv_bf16_xrows(wg, A(np.zeros((2, 8 * 512), np.uint16)), A(np.zeros((2, 8192), np.uint16)),
                       groups=8)
    (name, _, args, _), = launched
    assert name == "gemv_bf16_x2_r4" and int(args[8]) == 1024 and int(args[9]) == 1
    launched.clear()
    for X, Y, msg in [(A(np.zeros((9, K), np.uint16)), A(np.zeros((9, O), np.float32)), "rows"),
                      (A(np.zeros((2, K), np.float32)), A(np.zeros((2, O), np.float32)), "X"),
                      (A(np.zeros((2, K), np.uint16)), A(np.zeros((2, O - 1), np.float32)), "out")]:
        with pytest.raises(AssertionError, match=msg):
            DK.gemv_bf16_xrows(w, X, Y)
    assert not launched



def test_multi_rows_launches(fake_launch):
    """gemv_bf16_multi_rows (the device verify's xn projections of its T rows, decode.cu
    gemv_bf16_multi_x{NX}_r{R}): the row-form GemvTable records each staging row's ring ratio,
    no ring offset and the ape; the launch is the kernel of the table's R (nx <= its NX) over
    the table's warps, arguments table, nseg, X, ldx, nx, K, pos; bad tables and calls refused
    before any launch."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    K = 1024
    w = lambda o: A(np.zeros((o, K), np.uint16))
    ape = A(np.zeros((4, 256), np.float32))
    ents = [(w(1024), A(np.zeros((8, 1024), np.uint16))), (w(512), A(np.zeros((8, 512), np.float32))),
            (w(256), A(np.zeros((8, 256), np.float32)), None, 4, 4),
            (w(256), A(np.zeros((8, 256), np.float32)), ape, 4, 4)]
    assert DK.XROWS_R == (4, 2, 1)
    for R, NX in ((4, 2), (2, 4), (1, 8)):
        tab = DK.GemvTable(ents, K, rows_per_warp=R, rows=8)
        rec = np.asarray(tab.table).view(np.ndarray).view(DK.GemvTable.SEG)
        assert list(rec["ring_r"][:4]) == [0, 0, 4, 4] and list(rec["ring_off"][:4]) == [0, 0, -1, -1]
        assert rec["ape"][3] == ape.data.ptr and rec["ape"][2] == 0 and list(rec["out_bf16"][:4]) == [1, 0, 0, 0]
        assert tab.warps == sum(-(-o // R) for o in (1024, 512, 256, 256))
        for nx in range(1, NX + 1):
            assert DK.xrows_R(nx) >= R   # a table of fewer rows per warp serves fewer-row calls too
            launched.clear()
            X = A(np.zeros((nx, K + 8), np.uint16))[:, :K]
            pos = A(np.zeros(nx, np.int32))
            DK.gemv_bf16_multi_rows(tab, X, pos)
            (name, grid, args, _), = launched
            assert name == f"gemv_bf16_multi_x{NX}_r{R}" and grid == (-(-tab.warps // 4),), (name, grid)
            assert args[0] is tab.table and args[2] is X and args[6] is pos
            assert [int(args[i]) for i in (1, 3, 4, 5)] == [4, K + 8, nx, K]
        with pytest.raises(AssertionError, match=f"serves <= {NX}"):
            if NX < 8:
                DK.gemv_bf16_multi_rows(tab, A(np.zeros((NX + 1, K), np.uint16)),
                                        A(np.zeros(NX + 1, np.int32)))
            else:
                raise AssertionError(f"serves <= {NX}")
    assert [DK.xrows_R(n) for n in range(1, 9)] == [4, 4, 2, 2, 1, 1, 1, 1]
    launched.clear()
    tab = DK.GemvTable(ents, K, rows_per_warp=1, rows=8)
    for args, msg in [((DK.GemvTable([(w(64), A(np.zeros(64, np.float32)))], K), A(np.zeros((2, K), np.uint16)),
                        A(np.zeros(2, np.int32))), "row-form"),
                      ((tab, A(np.zeros((2, K), np.uint16)), A(np.zeros(3, np.int32))), "pos"),
                      ((tab, A(np.zeros((2, K), np.float32)), A(np.zeros(2, np.int32))), "X"),
                      ((tab, A(np.zeros((2, K - 8), np.uint16)), A(np.zeros(2, np.int32))), "K is")]:
        with pytest.raises(AssertionError, match=msg):
            DK.gemv_bf16_multi_rows(*args)
    assert not launched
    sc = A(np.zeros((8, 8), np.uint8))
    for bad, kw, msg in [([((A(np.zeros((1024, K), np.uint8)), sc), A(np.zeros((8, 1024), np.uint16)))],
                          dict(rows_per_warp=4, rows=8), "bf16 weights only"),
                         (ents, dict(rows_per_warp=8, rows=8), "rows_per_warp"),
                         (ents, dict(rows_per_warp=None, rows=8), "rows_per_warp"),
                         (ents, dict(rows_per_warp=4, rows=9), "rows = 9"),
                         ([(w(512), A(np.zeros(512, np.float32)))], dict(rows_per_warp=4, rows=8), "row form wants"),
                         ([(w(256), A(np.zeros((8, 256), np.uint16)), None, 4, 4)], dict(rows_per_warp=4, rows=8),
                          "row form wants")]:
        with pytest.raises(AssertionError, match=msg):
            DK.GemvTable(bad, K, **kw)


def test_swiglu_xrows_launches(fake_launch):
    """gemv_bf16_swiglu_xrows (the verify's shared expert W1 / W3 + SwiGLU over its rows): the
    kernel of the fewest rows per warp for nx (x2_p2 / x4_p1 / x8_p1), one warp per P outputs,
    arguments W1, W3, X, ldx, nx, H, ldh, O, K, limit; bad calls refused before any launch."""
    fake, DK, launched = fake_launch
    A = fake.asarray
    O, K = 2051, 1024
    w1, w3 = A(np.zeros((O, K), np.uint16)), A(np.zeros((O, K), np.uint16))
    assert {n for n in DK.KERNELS if n.startswith("gemv_bf16_swiglu_x")} == {
        f"gemv_bf16_swiglu_x{a}_p{p}" for a, p in DK.SWIGLU_XROWS_KERNELS}
    for nx, want in [(1, "x2_p2"), (2, "x2_p2"), (3, "x4_p1"), (4, "x4_p1"), (5, "x8_p1"), (8, "x8_p1")]:
        launched.clear()
        X = A(np.zeros((nx, K + 16), np.uint16))[:, :K]
        H = A(np.zeros((nx, O + 5), np.uint16))[:, :O]
        DK.gemv_bf16_swiglu_xrows(w1, w3, X, H, 10.0)
        (name, grid, args, _), = launched
        P = int(name[-1])
        assert name == f"gemv_bf16_swiglu_{want}" and grid == (-(-(-(-O // P)) // 4),), (nx, name, grid)
        assert args[0] is w1 and args[1] is w3 and args[2] is X and args[5] is H
        assert [int(a) for a in (args[3], args[4], args[6], args[7], args[8])] == [K + 16, nx, O + 5, O, K]
        assert float(args[9]) == 10.0
    launched.clear()
    for a, msg in [((w1, A(np.zeros((O, K - 8), np.uint16)), A(np.zeros((2, K), np.uint16)),
                     A(np.zeros((2, O), np.uint16))), "w3"),
                   ((w1, w3, A(np.zeros((9, K), np.uint16)), A(np.zeros((9, O), np.uint16))), "rows"),
                   ((w1, w3, A(np.zeros((2, K), np.float32)), A(np.zeros((2, O), np.uint16))), "X"),
                   ((w1, w3, A(np.zeros((2, K), np.uint16)), A(np.zeros((2, O), np.float32))), "h")]:
        with pytest.raises(AssertionError, match=msg):
            DK.gemv_bf16_swiglu_xrows(*a, 10.0)
    assert not launched

