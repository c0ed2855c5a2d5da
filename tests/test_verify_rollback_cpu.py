"""ops_decode.verify_rollback (decode.cu verify_rollback: the device verify's commit as one launch
per stage) on the CPU: its table's records match the kernel's struct, the launch marshals the
kernel's signature, refusals, and a transcription of the kernel's index arithmetic equals the
host commit's slicing (VerifyStep.commit's host form) on random caches, every (p0, k, n) near
the window wrap and the compressor emits."""
from __future__ import annotations

import numpy as np
import pytest

ROW_MAX = 8


def _compressor_twin(kv, score, snap, rows, ratio, lo, hi, n):
    """decode.cu rb_compressor, transcribed."""
    P, width = kv.size, rows.shape[1]
    flat = snap.reshape(-1)[n * 2 * P:(n + 1) * 2 * P]
    kv.reshape(-1)[:] = flat[:P]
    score.reshape(-1)[:] = flat[P:]
    r0, r1 = lo // ratio, min(hi // ratio, rows.shape[0])
    rows.reshape(-1)[r0 * width:r0 * width + max(r1 - r0, 0) * width] = 0


def _kernel_twin(L, p0, k, n):
    """decode.cu verify_rollback, transcribed (one layer, NumPy arrays in place)."""
    lo, hi = p0 + n + 1, p0 + k + 1
    W, hd = L["ring"].shape
    for i in range((hi - lo) * hd):
        o = ((lo + i // hd) % W, i % hd)
        L["ring"][o] = L["ring_copy"][o]
    if L.get("ratio"):
        _compressor_twin(L["comp_kv"], L["comp_score"], L["comp_snap"], L["comp"], L["ratio"], lo, hi, n)
    if L.get("idx_keys") is not None:
        _compressor_twin(L["idx_kv"], L["idx_score"], L["idx_snap"], L["idx_keys"], 4, lo, hi, n)


def _host_commit(L, p0, k, n):
    """VerifyStep.commit's host form on one layer (its CuPy operations, on NumPy)."""
    last_kept, p_end = p0 + n, p0 + k + 1
    W = L["ring"].shape[0]
    slots = np.arange(last_kept + 1, p_end) % W
    L["ring"][slots] = L["ring_copy"][slots]
    if L.get("ratio"):
        L["comp_kv"][...] = L["comp_snap"][n][0]
        L["comp_score"][...] = L["comp_snap"][n][1]
        L["comp"][(last_kept + 1) // L["ratio"]:p_end // L["ratio"]] = 0
    if L.get("idx_keys") is not None:
        L["idx_kv"][...] = L["idx_snap"][n][0]
        L["idx_score"][...] = L["idx_snap"][n][1]
        L["idx_keys"][(last_kept + 1) // 4:p_end // 4] = 0


def _layer(rng, kind, W=8, hd=16, n_comp=5, dI=8, n_idx=6):
    u16 = lambda *s: rng.integers(1, 1 << 16, s, dtype=np.uint16)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    L = dict(ring=u16(W, hd), ring_copy=u16(W, hd))
    if kind in ("csa", "hca"):
        r = 4 if kind == "csa" else 16
        rows = 2 * r if r == 4 else r
        L.update(ratio=r, comp_kv=f32(rows, hd), comp_score=f32(rows, hd),
                 comp_snap=f32(ROW_MAX, 2, rows, hd), comp=u16(n_comp, hd))
    if kind == "csa":
        L.update(idx_kv=f32(8, dI), idx_score=f32(8, dI), idx_snap=f32(ROW_MAX, 2, 8, dI),
                 idx_keys=u16(n_idx, dI))
    return L


@pytest.mark.parametrize("kind", ["window", "hca", "csa"])
def test_kernel_index_arithmetic_is_the_host_commit(kind):
    rng = np.random.default_rng(len(kind))
    for p0 in list(range(0, 26)) + [61, 62, 63, 64]:
        for k in range(1, ROW_MAX):
            for n in range(k + 1):
                a = _layer(rng, kind)
                b = {key: (v.copy() if isinstance(v, np.ndarray) else v) for key, v in a.items()}
                _kernel_twin(a, p0, k, n)
                _host_commit(b, p0, k, n)
                for key, v in a.items():
                    if isinstance(v, np.ndarray):
                        assert np.array_equal(v, b[key]), f"{kind} p0 {p0} k {k} n {n}: {key} differs"


def test_table_records_and_launch(monkeypatch):
    from test_kernel_sources import fake_ops_module
    launched = []
    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode",
                               lambda name, grid, block, args, smem: launched.append((name, grid, block, args)))
    rng = np.random.default_rng(0)
    dev = lambda L: {k: (fake.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in L.items()}
    layers = [dev(_layer(rng, kind)) for kind in ("window", "csa", "hca")]
    tab = DK.RollbackTable(layers)
    rec = tab.dev.view(DK.RollbackTable.SEG)
    # the struct's order: ten u64 pointers, then eight int32 fields
    assert [DK.RollbackTable.SEG.fields[f][1] for f in ("ring", "idx_keys", "W", "n_idx")] == [0, 72, 80, 108]
    assert rec[0]["ratio"] == 0 and rec[0]["comp"] == 0 and rec[0]["idx_keys"] == 0
    assert rec[1]["ratio"] == 4 and rec[1]["comp_p"] == 8 * 16 and rec[1]["n_idx"] == 6 and rec[1]["dI"] == 8
    assert rec[2]["ratio"] == 16 and rec[2]["n_comp"] == 5 and rec[2]["idx_keys"] == 0
    assert rec[1]["ring"] == layers[1]["ring"].data.ptr and rec[1]["comp_snap"] == layers[1]["comp_snap"].data.ptr
    DK.verify_rollback(tab, 100, 4, 1)
    (name, grid, block, args), = launched
    assert name == "verify_rollback" and tuple(grid) == (8, 3) and args[1:] == (100, 4, 1)
    with pytest.raises(AssertionError, match="p0 100, k 4, n 5"):
        DK.verify_rollback(tab, 100, 4, 5)
    with pytest.raises(AssertionError, match="past the window 8"):
        DK.verify_rollback(tab, 100, 8, 0)
    with pytest.raises(AssertionError, match="ring_copy"):
        DK.RollbackTable([dict(ring=layers[0]["ring"], ring_copy=layers[0]["ring"][:4])])
