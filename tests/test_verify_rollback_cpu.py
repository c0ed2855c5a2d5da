"""The device verify's commit on the CPU: ops_decode.verify_rollback (decode.cu verify_rollback,
one launch per stage) and the host form (VerifyStep.commit's CuPy operations) both restore the
pending rows by a gather over the layer's journal buffers [pre-verify rows | staging rows |
fresh row] with gpu.hostmath.pending_sources.  Checked here: a transcription of the kernel and
the host form's operations both equal the oracle's rule (restore the pre-verify rows, then
host.pending.advance_pending over the kept rows' values: what the rows did one by one) on caches
reached by a real token history, for every (p0, k, n) near the window wrap and the emits; the
table's records match the kernel's struct; the launch marshals the signature; refusals."""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.gpu.hostmath import pending_sources
from memra_dsv4.host.pending import advance_pending

ROW_MAX = 8


def _compressor_twin(kv, score, jkv, jsc, rows, src, ratio, lo, hi):
    """decode.cu rb_compressor, transcribed (flat index arithmetic)."""
    P, C = kv.shape
    fk, fs, jk, js = kv.reshape(-1), score.reshape(-1), jkv.reshape(-1), jsc.reshape(-1)
    for i in range(P * C):
        frm = src[i // C] * C + i % C
        fk[i], fs[i] = jk[frm], js[frm]
    width = rows.shape[1]
    r0, r1 = lo // ratio, min(hi // ratio, rows.shape[0])
    rows.reshape(-1)[r0 * width:r0 * width + max(r1 - r0, 0) * width] = 0


def _kernel_twin(L, p0, k, n):
    """decode.cu verify_rollback, transcribed (one layer, NumPy arrays in place), its gather
    lists as RollbackTable.upload_sources writes them."""
    lo, hi = p0 + n + 1, p0 + k + 1
    W, hd = L["ring"].shape
    for i in range((hi - lo) * hd):
        o = ((lo + i // hd) % W, i % hd)
        L["ring"][o] = L["ring_copy"][o]
    if L.get("ratio"):
        src = pending_sources(p0, n + 1, L["ratio"], ROW_MAX)
        _compressor_twin(L["comp_kv"], L["comp_score"], L["comp_jkv"], L["comp_jsc"], L["comp"], src,
                         L["ratio"], lo, hi)
    if L.get("idx_keys") is not None:
        src = pending_sources(p0, n + 1, 4, ROW_MAX)
        _compressor_twin(L["idx_kv"], L["idx_score"], L["idx_jkv"], L["idx_jsc"], L["idx_keys"], src, 4, lo, hi)


def _host_commit(L, p0, k, n):
    """VerifyStep.commit's host form on one layer (its CuPy operations, on NumPy)."""
    last_kept, p_end = p0 + n, p0 + k + 1
    W = L["ring"].shape[0]
    slots = np.arange(last_kept + 1, p_end) % W
    L["ring"][slots] = L["ring_copy"][slots]
    for pre, rows_key, r in (("comp", "comp", L.get("ratio")), ("idx", "idx_keys", 4)):
        if pre == "comp" and not r or pre == "idx" and L.get("idx_keys") is None:
            continue
        src = pending_sources(p0, n + 1, r, ROW_MAX)
        np.take(L[f"{pre}_jkv"], src, axis=0, out=L[f"{pre}_kv"])
        np.take(L[f"{pre}_jsc"], src, axis=0, out=L[f"{pre}_score"])
        L[rows_key][(last_kept + 1) // r:p_end // r] = 0


def _oracle_commit(L, p0, k, n):
    """The rule: ring slots back, pending rows = the pre-verify rows with rows 0..n replayed
    (advance_pending over their staging values), rolled-back emits zeroed."""
    last_kept, p_end = p0 + n, p0 + k + 1
    W = L["ring"].shape[0]
    for q in range(last_kept + 1, p_end):
        L["ring"][q % W] = L["ring_copy"][q % W]
    for pre, rows_key, r in (("comp", "comp", L.get("ratio")), ("idx", "idx_keys", 4)):
        if pre == "comp" and not r or pre == "idx" and L.get("idx_keys") is None:
            continue
        P = L[f"{pre}_kv"].shape[0]
        kv, sc = L[f"{pre}_jkv"][:P].copy(), L[f"{pre}_jsc"][:P].copy()
        advance_pending(kv, sc, L[f"{pre}_jkv"][P:P + n + 1], L[f"{pre}_jsc"][P:P + n + 1], p0, r)
        L[f"{pre}_kv"][...], L[f"{pre}_score"][...] = kv, sc
        for e in range(last_kept + 1, p_end):
            if (e + 1) % r == 0 and (e + 1) // r - 1 < L[rows_key].shape[0]:
                L[rows_key][(e + 1) // r - 1] = 0


def _journal(rng, r, C, p0):
    """(live kv, score, jkv, jsc): a pending state reached by p0 real tokens, the journal's
    pre-verify rows = it, random staging rows, the fresh row; the live rows hold garbage (what
    the verify left)."""
    P = 2 * r if r == 4 else r
    kv, sc = np.zeros((P, C), np.float32), np.full((P, C), -np.inf, np.float32)
    advance_pending(kv, sc, rng.standard_normal((p0, C)).astype(np.float32),
                    rng.standard_normal((p0, C)).astype(np.float32), 0, r)
    jkv = np.concatenate([kv, rng.standard_normal((ROW_MAX, C)).astype(np.float32), np.zeros((1, C), np.float32)])
    jsc = np.concatenate([sc, rng.standard_normal((ROW_MAX, C)).astype(np.float32),
                          np.full((1, C), -np.inf, np.float32)])
    return rng.standard_normal((P, C)).astype(np.float32), rng.standard_normal((P, C)).astype(np.float32), jkv, jsc


def _layer(rng, kind, p0, W=8, hd=16, n_comp=5, dI=8, n_idx=6):
    u16 = lambda *s: rng.integers(1, 1 << 16, s, dtype=np.uint16)
    L = dict(ring=u16(W, hd), ring_copy=u16(W, hd))
    if kind in ("csa", "hca"):
        r = 4 if kind == "csa" else 16
        kv, sc, jkv, jsc = _journal(rng, r, 2 * hd if r == 4 else hd, p0)
        L.update(ratio=r, comp_kv=kv, comp_score=sc, comp_jkv=jkv, comp_jsc=jsc, comp=u16(n_comp, hd))
    if kind == "csa":
        kv, sc, jkv, jsc = _journal(rng, 4, 2 * dI, p0)
        L.update(idx_kv=kv, idx_score=sc, idx_jkv=jkv, idx_jsc=jsc, idx_keys=u16(n_idx, dI))
    return L


def _copy(L):
    return {key: (v.copy() if isinstance(v, np.ndarray) else v) for key, v in L.items()}


@pytest.mark.parametrize("kind", ["window", "hca", "csa"])
def test_kernel_and_host_forms_are_the_replay(kind):
    rng = np.random.default_rng(len(kind))
    for p0 in list(range(0, 26)) + [61, 62, 63, 64]:
        for k in range(1, ROW_MAX):
            for n in range(k + 1):
                a = _layer(rng, kind, p0)
                b, c = _copy(a), _copy(a)
                _kernel_twin(a, p0, k, n)
                _host_commit(b, p0, k, n)
                _oracle_commit(c, p0, k, n)
                for key, v in a.items():
                    if isinstance(v, np.ndarray):
                        ctx = f"{kind} p0 {p0} k {k} n {n}: {key}"
                        assert np.array_equal(v.view(np.uint8), c[key].view(np.uint8)), f"kernel twin: {ctx}"
                        assert np.array_equal(b[key].view(np.uint8), c[key].view(np.uint8)), f"host form: {ctx}"


def test_pending_sources_refusals_and_fresh_row():
    with pytest.raises(AssertionError, match="9 rows of 8"):
        pending_sources(0, 9, 4, 8)
    # a block closed by the last kept row: its current rows come from the fresh row
    assert list(pending_sources(2, 2, 4, 8)) == [4, 5, 8, 9, 16, 16, 16, 16]
    # nothing fed: the pre rows, the block's rows past p0 % r fresh (advance_pending's rule; a
    # real state holds (0, -inf) there already)
    assert list(pending_sources(5, 0, 4, 8)) == [0, 1, 2, 3, 4, 16, 16, 16]
    assert list(pending_sources(126, 3, 128, 8))[:2] == [128 + 2, 128 + 8]   # 126, 127 close; 128 opens


def test_table_records_and_launch(monkeypatch):
    from test_kernel_sources import fake_ops_module
    launched = []
    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode",
                               lambda name, grid, block, args, smem: launched.append((name, grid, block, args)))
    import sys
    import types
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(zeros_pinned=lambda n, dt: np.zeros(n, dt)))
    rng = np.random.default_rng(0)
    dev = lambda L: {k: (fake.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in L.items()}
    layers = [dev(_layer(rng, kind, 10)) for kind in ("window", "csa", "hca")]
    tab = DK.RollbackTable(layers, ROW_MAX)
    rec = tab.dev.view(DK.RollbackTable.SEG)
    # the struct's order: twelve u64 pointers, then twelve int32 fields
    assert [DK.RollbackTable.SEG.fields[f][1] for f in ("ring", "idx_keys", "W", "idx_src")] == [0, 88, 96, 140]
    assert rec[0]["ratio"] == 0 and rec[0]["comp"] == 0 and rec[0]["idx_keys"] == 0
    assert rec[1]["ratio"] == 4 and (rec[1]["comp_P"], rec[1]["comp_C"]) == (8, 32) and rec[1]["n_idx"] == 6
    assert (rec[1]["idx_P"], rec[1]["idx_C"], rec[1]["dI"]) == (8, 16, 8)
    assert rec[2]["ratio"] == 16 and (rec[2]["comp_P"], rec[2]["comp_C"]) == (16, 16) and rec[2]["idx_keys"] == 0
    assert rec[1]["comp_jkv"] == layers[1]["comp_jkv"].data.ptr and rec[1]["idx_jsc"] == layers[1]["idx_jsc"].data.ptr
    # one gather list per ratio (4: 8 rows, 16: 16 rows), each layer pointing at its own
    assert tab.src_off == {4: 0, 16: 8} and tab.sources.size == 24
    assert rec[1]["comp_src"] == rec[1]["idx_src"] == 0 and rec[2]["comp_src"] == 8
    DK.verify_rollback(tab, 100, 4, 1)
    (name, grid, block, args), = launched
    assert name == "verify_rollback" and tuple(grid) == (8, 3) and args[0] is tab.dev and args[1] is tab.sources
    assert [int(a) for a in args[2:]] == [100, 4, 1]
    with pytest.raises(AssertionError, match="p0 100, k 4, n 5"):
        DK.verify_rollback(tab, 100, 4, 5)
    with pytest.raises(AssertionError, match="past the window 8"):
        DK.verify_rollback(tab, 100, 8, 0)
    with pytest.raises(AssertionError, match="ring_copy"):
        DK.RollbackTable([dict(ring=layers[0]["ring"], ring_copy=layers[0]["ring"][:4])], ROW_MAX)
    bad = dict(layers[1])
    bad["comp_jkv"] = bad["comp_jkv"][:-1]
    with pytest.raises(AssertionError, match="comp_jkv"):
        DK.RollbackTable([bad], ROW_MAX)
