"""Every dense GEMV variant of kernels_cu/decode.cu (ops_decode.gemv_variant_names: the register
kernels with more trips in flight, gemv_*_r1t2 / r2t2 / r1t4 / r2t4, the TMA bulk streaming
kernels gemv_*_bulk_*, gemv_bf16_multi_bulk_*, gemv_bf16_swiglu_bulk_*, and the persistent
register-ring kernels gemv_bf16_ps_r*d*, and gemv_bf16_pl_r* (first trip loaded before the PDL
wait)) against the default kernel, byte for byte.

Bound: bit-identical (the variants move bytes differently and give rows to warps differently,
never change a row's FMA order: decode.cu THE ORDER).  Inputs: random bf16 x, FP8 weights over
every finite e4m3 code with scales 2^-8..2^8 (and their exact bf16 dequantisation, which must
give the same bits again); K with tail trips (K % 1024 != 0), lane tails (K % 256 != 0), K >
8192 (no FP8 bulk) and K % 16 != 0 (no bulk at all: the explicit variant is refused); O not a
multiple of the rows per warp; grouped x (wo_a's layout, rows per group 7: only R = 1 fits);
GemvTables of odd-sized mixed-form projections incl. a pending-row entry with ape; nothing
written past O.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.formats import dequant_fp8_block, f32_to_bf16_exact  # noqa: E402
from memra_dsv4.gpu import ops_decode as DK  # noqa: E402
from memra_dsv4.gpu.ops.testing import bf16, fresh_seed, rand_bf16, rng_for  # noqa: E402

pytestmark = pytest.mark.gpu



def _filled(n, dtype):
    """An array of n values of dtype, every byte 0xA5 (a pattern no kernel writes by chance)."""
    a = cp.empty(n, dtype)
    a.view(cp.uint8).fill(0xA5)
    return a


def _fp8(rng, O, K):
    """(e4m3 bytes, e8m0 scales, bf16 bits of the exact dequantisation), NaN codes excluded."""
    codes = rng.integers(0, 0x7F, (O, K), dtype=np.uint8)
    codes |= (rng.integers(0, 2, (O, K), dtype=np.uint8) << 7)
    scale = rng.integers(127 - 8, 127 + 9, (-(-O // 128), -(-K // 128)), dtype=np.uint8)
    w = dequant_fp8_block(codes, scale, "test.w")
    return codes, scale, f32_to_bf16_exact(w.astype(np.float32), "test.w")


def _eligible_plain(vn, fp8, K, rpg):
    if vn == "default":
        return True
    if DK.parse_ps(vn) is not None:   # persistent ring: bf16, K % 1024 == 0, R | rows per group
        return DK.ps_ok(*DK.parse_ps(vn), fp8, K, rpg)
    if DK.parse_pl(vn) is not None:   # first trip before the PDL wait: bf16, K % 1024 == 0
        return DK.pl_ok(DK.parse_pl(vn), fp8, K, rpg)
    bulk, R, _ = DK._parse_variant(vn, "r")
    if rpg % R:
        return False
    return not bulk or (K % 16 == 0 and (not fp8 or K <= 8192))


@pytest.mark.parametrize("O,K,groups", [(1000, 4096, 1), (300, 1040, 1), (37, 2064, 1), (100, 1824, 1),
                                        (8192, 4096, 8), (21, 272, 3), (130, 8192, 1), (64, 8320, 1),
                                        (45, 1032, 1), (4096, 1024, 1), (7, 16, 1),
                                        (32768, 1024, 1), (4096, 8192, 1)])
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_plain_variants_bit_identical(O, K, groups, out_dtype):
    seed = fresh_seed()
    rng = rng_for(seed)
    codes, scale, wb = _fp8(rng, O, K)
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (groups * K,), 1.0), "x"))
    c_d, s_d, wb_d = cp.asarray(codes), cp.asarray(scale), cp.asarray(wb)
    rpg = O // groups if groups > 1 else 0
    view = np.uint32 if out_dtype == np.float32 else np.uint16
    ref = cp.empty(O, out_dtype)
    DK.gemv_bf16(wb_d, x, ref, groups=groups, variant="default")
    ref = cp.asnumpy(ref).view(view)
    fill = view(0xA5A5A5A5 if view == np.uint32 else 0xA5A5)
    for fp8 in (False, True):
        for vn in DK.gemv_variant_names("plain", fp8, new_only=False):
            y = _filled(O + 8, out_dtype)
            kw = dict(scale=s_d) if fp8 else {}
            w = c_d if fp8 else wb_d
            if not _eligible_plain(vn, fp8, K, rpg):
                with pytest.raises(AssertionError, match="not available"):
                    DK.gemv_bf16(w, x, y[:O], groups=groups, variant=vn, **kw)
                continue
            DK.gemv_bf16(w, x, y[:O], groups=groups, variant=vn, **kw)
            got = cp.asnumpy(y).view(view)
            bad = np.flatnonzero(got[:O] != ref)
            tag = f"seed {seed}: {'fp8' if fp8 else 'bf16'} {vn} [{O}x{K}] groups {groups}"
            assert bad.size == 0, f"{tag}: {bad.size} rows differ, first {bad[:5]}"
            assert (got[O:] == fill).all(), f"{tag}: wrote past O"


@pytest.mark.parametrize("K", [2048, 1824, 1040, 4096])
def test_multi_variants_bit_identical(K):
    """GemvTables (R = 1 and 4) of mixed-form, odd-sized projections plus a compressor pending
    entry with ape: every multi variant == the default r4 kernel, every entry's bytes."""
    seed = fresh_seed()
    rng = rng_for(seed)
    shapes = [(512, True), (256, False), (130, True), (7, True), (203, False), (129, True)]
    ws = []
    for O, is8 in shapes:
        codes, scale, wb = _fp8(rng, O, K)
        ws.append((cp.asarray(codes), cp.asarray(scale)) if is8 else cp.asarray(wb))
    pc, ps, _ = _fp8(rng, 72, K)
    ape = cp.asarray(rng.standard_normal((4, 72)).astype(np.float32))
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0), "x"))
    pos = cp.asarray(np.array([6], np.int32))

    def run(vn):
        R = 4 if vn == "default" else DK.parse_multi_variant(vn)[1]
        outs = [_filled(O + 4, cp.float32 if i % 2 == 0 else cp.uint16) for i, (O, _) in enumerate(shapes)]
        pend = _filled(8 * 72, cp.float32).reshape(8, 72)
        ent = [(w, o[:O]) for w, o, (O, _) in zip(ws, outs, shapes)]
        ent.append(((cp.asarray(pc), cp.asarray(ps)), pend, ape, 4, 4))
        DK.gemv_bf16_multi(DK.GemvTable(ent, K, rows_per_warp=R), x, pos, variant=vn)
        return [cp.asnumpy(o).tobytes() for o in outs] + [cp.asnumpy(pend).tobytes()]

    ref = run("default")
    for vn in DK.gemv_variant_names("multi", True, new_only=False)[1:]:
        got = run(vn)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a == b, f"seed {seed}: multi {vn} K {K}: entry {i} differs (incl. bytes past O)"


@pytest.mark.parametrize("K", [4096, 1040])
@pytest.mark.parametrize("n_q", [1024, 136])
def test_multi_qnorm_equals_multi_then_rmsnorm(K, n_q):
    """gemv_bf16_multi(qnorm=(y, w, eps)) == gemv_bf16_multi then ops.rmsnorm(y, w, eps, out=y),
    every entry's bytes (y normed in place; the others untouched by the norm), for every multi
    variant of tables with R = 1 and 4 (the register kernels' _qn forms: the norm in their last
    CTA; the bulk ones: the rmsnorm launch after them); the ticket counter is zero after each
    launch; a captured graph of the _qn launch replays to the same bytes twice (the counter
    reset).  n_q = 136: 17 chunks (threads past them preload no weight)."""
    from memra_dsv4.gpu.ops import rmsnorm as RN
    seed = fresh_seed()
    rng = rng_for(seed)
    shapes = [(n_q, "q"), (512, True), (256, False), (130, True)]
    ws = []
    for O, is8 in shapes:
        codes, scale, wb = _fp8(rng, O, K)
        ws.append((cp.asarray(codes), cp.asarray(scale)) if is8 is True else cp.asarray(wb))
    pc, ps, _ = _fp8(rng, 72, K)
    ape = cp.asarray(rng.standard_normal((4, 72)).astype(np.float32))
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0), "x"))
    pos = cp.asarray(np.array([6], np.int32))
    qw = cp.asarray(f32_to_bf16_exact(bf16(rng.standard_normal(n_q).astype(np.float32) * np.float32(0.5)
                                           + np.float32(1.0)), "w"))
    eps = 1e-6

    def run(vn, R, fused, graph=False):
        outs = [_filled(O + 4, cp.uint16 if i in (0, 2) else cp.float32) for i, (O, _) in enumerate(shapes)]
        pend = _filled(8 * 72, cp.float32).reshape(8, 72)
        ent = [(w, o[:O]) for w, o, (O, _) in zip(ws, outs, shapes)]
        ent.append(((cp.asarray(pc), cp.asarray(ps)), pend, ape, 4, 4))
        tab = DK.GemvTable(ent, K, rows_per_warp=R)
        y = outs[0][:n_q]

        def launch():
            if fused:
                DK.gemv_bf16_multi(tab, x, pos, variant=vn, qnorm=(y, qw, eps))
            else:
                DK.gemv_bf16_multi(tab, x, pos, variant=vn)
                RN.rmsnorm(y, qw, eps, out=y)
        if graph:
            from memra_dsv4.gpu import graphs
            DK.qnorm_counter()
            cp.cuda.Device().synchronize()   # the fills above ran on the default stream
            stream = cp.cuda.Stream(non_blocking=True)
            g = graphs.capture(stream, launch)
            reps = []
            for _ in range(2):
                graphs.replay(g, stream)
                stream.synchronize()
                reps.append([cp.asnumpy(o).tobytes() for o in outs] + [cp.asnumpy(pend).tobytes()])
            assert reps[0] == reps[1], f"seed {seed}: {vn}: graph replays differ"
        else:
            launch()
        if fused:
            assert int(DK.qnorm_counter().get()[0]) == 0, f"seed {seed}: {vn}: ticket counter left nonzero"
        return [cp.asnumpy(o).tobytes() for o in outs] + [cp.asnumpy(pend).tobytes()]

    for vn in DK.gemv_variant_names("multi", True, new_only=False):
        R = 4 if vn == "default" else DK.parse_multi_variant(vn)[1]
        ref = run(vn, R, False)
        got = run(vn, R, True)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a == b, f"seed {seed}: multi {vn} K {K} qnorm: entry {i} differs (incl. bytes past O)"
        if not vn.startswith("bulk_"):
            assert run(vn, R, True, graph=True) == ref, f"seed {seed}: multi {vn}: graph replay differs"


@pytest.mark.parametrize("K", [2048, 1824, 4096, 1040])
@pytest.mark.parametrize("O", [259, 2048])
def test_swiglu_variants_bit_identical(O, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    c1, s1, w1 = _fp8(rng, O, K)
    c3, s3, w3 = _fp8(rng, O, K)
    d = [cp.asarray(a) for a in (c1, s1, w1, c3, s3, w3)]
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0), "x"))
    ref = _filled(O + 4, cp.uint16)
    DK.gemv_bf16_swiglu(d[2], d[5], x, ref[:O], 10.0, variant="default")
    ref = cp.asnumpy(ref)
    for fp8 in (False, True):
        for vn in DK.gemv_variant_names("swiglu", fp8, new_only=False):
            h = _filled(O + 4, cp.uint16)
            if fp8:
                DK.gemv_bf16_swiglu(d[0], d[3], x, h[:O], 10.0, scale1=d[1], scale3=d[4], variant=vn)
            else:
                DK.gemv_bf16_swiglu(d[2], d[5], x, h[:O], 10.0, variant=vn)
            got = cp.asnumpy(h)
            bad = np.flatnonzero(got != ref)
            assert bad.size == 0, f"seed {seed}: swiglu {'fp8' if fp8 else 'bf16'} {vn} [{O}x{K}]: {bad[:5]}"


def test_selection_env_and_table(monkeypatch):
    """MEMRA_DSV4_GEMV_VARIANT and GEMV_SELECT pick a variant (most specific key first); a pick a
    launch cannot take falls back to the default; the bits never change."""
    rng = rng_for(fresh_seed())
    codes, scale, wb = _fp8(rng, 256, 1032)          # K % 16 != 0: no bulk kernel
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (1032,), 1.0), "x"))
    ref, y = cp.empty(256, cp.float32), cp.empty(256, cp.float32)
    DK.gemv_bf16(cp.asarray(wb), x, ref, variant="default")
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, "plain=bulk_r2s4,plain.fp8.small=bulk_r4s4")
    assert DK.gemv_selected("plain", True, "small") == "bulk_r4s4"
    assert DK.gemv_selected("plain", False, "large") == "bulk_r2s4"
    DK.gemv_bf16(cp.asarray(codes), x, y, scale=cp.asarray(scale))   # falls back to the default
    assert bool((y.view(cp.uint32) == ref.view(cp.uint32)).all())
    monkeypatch.delenv(DK.GEMV_VARIANT_ENV)
    # the generic "swiglu" key applies where no form-specific key does (GEMV_SELECT ships
    # "swiglu.fp8" since 57a2c0d, which this test predates: take it out for the check)
    monkeypatch.delitem(DK.GEMV_SELECT, "swiglu.fp8", raising=False)
    monkeypatch.setitem(DK.GEMV_SELECT, "swiglu", "bulk_p1s4")
    assert DK.gemv_selected("swiglu", True, "large") == "bulk_p1s4"
    monkeypatch.setitem(DK.GEMV_SELECT, "swiglu.fp8", "p1t2")
    assert DK.gemv_selected("swiglu", True, "large") == "p1t2"          # the specific key first


@pytest.mark.parametrize("O,variant", [(32768, "pl_r2"), (32868, "pl_r2"), (32768, "pl_r4"), (32770, "pl_r4")])
def test_wqb_qnorm_fused_bytes(O, variant, monkeypatch):
    """gemv_bf16_qnorm fused (gemv_bf16_pl_r{R}_qn: every CTA norms the raw row into shared
    memory, CTA 0 stores it) == rmsnorm_bf16_wbf16 into xn, then gemv_bf16_pl_r{R} on xn: out
    and xn byte for byte, out in f32 and in bf16; x spread over 2^+-20 so the norm's double
    statistics matter; nothing written past O; launched under PDL and plainly."""
    from memra_dsv4.gpu.ops import rmsnorm as RN
    from memra_dsv4.gpu.pdl import pdl_launches
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, f"plain.bf16.large={variant}")
    seed = fresh_seed()
    rng = rng_for(seed)
    K = DK.QNORM_K
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0, spread=20), "x"))
    nw = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0), "nw"))
    w = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (O, K), 0.05), "w"))
    for dt in (np.float32, np.uint16):
        xn_ref = _filled(K, np.uint16)
        RN.rmsnorm(x.reshape(1, K), nw, 1e-6, out=xn_ref.reshape(1, K))
        ref = _filled(O + 64, dt)
        DK.gemv_bf16(w, xn_ref, ref[:O], variant=variant)
        for pdl in (False, True):
            xn, out = _filled(K, np.uint16), _filled(O + 64, dt)
            with pdl_launches(pdl):
                got = DK.gemv_bf16_qnorm(w, x, out[:O], nw, 1e-6, xn)
            cp.cuda.runtime.deviceSynchronize()
            assert got == "fused"
            assert cp.array_equal(xn, xn_ref), f"{variant} O={O} seed {seed}: the normed row differs (pdl {pdl})"
            assert cp.array_equal(out.view(cp.uint8), ref.view(cp.uint8)), (
                f"{variant} O={O} seed {seed} {np.dtype(dt).name}: {int((out[:O] != ref[:O]).sum())} outputs differ, or bytes past O written (pdl {pdl})")


@pytest.mark.parametrize("O,O2,variant", [(32768, 8192, "pl_r2"), (32768, 8193, "pl_r2"), (4098, 130, "pl_r4")])
def test_idxq_pair_fused_bytes(O, O2, variant, monkeypatch):
    """gemv_bf16_pair fused (gemv_bf16_pl2_r{R}: both row sets in one launch) == gemv_bf16_pl_r{R}
    on each weight, byte for byte, both outputs, bf16 and f32; nothing written past O / O2; under
    PDL and plainly."""
    from memra_dsv4.gpu.pdl import pdl_launches
    monkeypatch.setenv(DK.GEMV_VARIANT_ENV, f"plain.bf16.large={variant},plain.bf16.small={variant}")
    seed = fresh_seed()
    rng = rng_for(seed)
    K = 1024
    x = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (K,), 1.0, spread=8), "x"))
    w = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (O, K), 0.05), "w"))
    w2 = cp.asarray(f32_to_bf16_exact(rand_bf16(rng, (O2, K), 0.05), "w2"))
    for dt, dt2 in ((np.uint16, np.uint16), (np.float32, np.uint16), (np.uint16, np.float32)):
        ref, ref2 = _filled(O + 64, dt), _filled(O2 + 64, dt2)
        DK.gemv_bf16(w, x, ref[:O], variant=variant)
        DK.gemv_bf16(w2, x, ref2[:O2], variant=variant)
        for pdl in (False, True):
            out, out2 = _filled(O + 64, dt), _filled(O2 + 64, dt2)
            with pdl_launches(pdl):
                got = DK.gemv_bf16_pair(w, w2, x, out[:O], out2[:O2])
            cp.cuda.runtime.deviceSynchronize()
            assert got == "fused"
            assert cp.array_equal(out.view(cp.uint8), ref.view(cp.uint8)), f"{variant} O={O} seed {seed}: W's rows differ (pdl {pdl})"
            assert cp.array_equal(out2.view(cp.uint8), ref2.view(cp.uint8)), f"{variant} O2={O2} seed {seed}: W2's rows differ (pdl {pdl})"
