"""GPU prefill (memra_dsv4.gpu.model.Dsv4Gpu) against the NumPy oracle, numerics='bf16'.

Bounds (named constants below) and why:
* The GPU path rounds at the same points as the oracle (same bf16 stores, same fp32 islands),
  but its GEMMs, sparse attention and indexer scores accumulate in fp32 (the oracle: float64,
  rounded once).  A bf16 store then differs by one bf16 ulp (2^-8 relative) on a fraction of
  elements, and those differences propagate through the residual streams.  Relative L2 per
  capture: streams/activations <= REL_L2 (2e-2, ~5 bf16 ulps of RMS drift after a few
  blocks); fp32 islands computed from those inputs the same.
* Discrete choices (moe.idx, attn.index.sel) may flip on near-ties: with random weights a
  router top-k boundary within one bf16 ulp of scores is common, and one flipped expert moves
  that token's MoE output by O(1) (measured on the H200: block 2 of tiny, 1 of 20 rows,
  moe.out relL2 0.11).  So the capture comparison replays the GPU's discrete choices in the
  oracle (``force_decisions``), which isolates the arithmetic, and checks that every GPU
  choice is a top-k of the oracle's own scores up to a near-tie (TIE_ABS / TIE_REL).
* Top-1 of the last-position logits must equal the oracle's.
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.oracle.model import Oracle
from memra_dsv4.synth import synth_arrays, with_drafter

REL_L2 = 2e-2            # streams and float activations, block 0
# Drift compounds through the residual streams block by block (the oracle's own class bounds
# are B0 + B1*block, docs/semantics.md); measured on the H200 with replayed choices: small at
# 140 tokens, block 5 attn.comp 2.3e-2.  Bound for block b: REL_L2 + REL_L2_PER_BLOCK * b.
REL_L2_PER_BLOCK = 2e-3
# Full-size Flash layers (flash-layers:4) drift faster per block: the KV FP8 simulation turns the
# ~2.5e-3 drift of a block's normed input into whole e4m3 steps of some elements.  Measured on the
# H200 at a4b9426 (both FP4 formats, 8 tokens, choices replayed, every choice agreeing): block 1
# attn.kv 1.09e-2 from attn_norm 2.46e-3; block 3 attn.o 2.62e-2 (the 2e-3 slope's bound is
# 2.6e-2); top hc_head / final_norm 1.3e-2.
REL_L2_PER_BLOCK_FLASH = 5e-3
TIE_GAP = 2e-2           # relative top-2 gap of the oracle's logits below which top-1 may differ
REL_L2_SCORES = 3e-2     # indexer scores / router scores (products of drifted inputs)
# FP4-simulated indexer tensors: one e2m1 step is 1/3-1/2 relative, so a one-ulp bf16 change of
# the input moves an element to the neighbouring code now and then (seen on the H200: tiny
# attn.index.keys 5.4e-2 with every other capture of that block <= 2e-2).
REL_L2_FP4 = 1e-1
FP4_CAPTURES = ("attn.index.keys", "attn.index.q", "attn.index.scores")
DISCRETE_AGREE = 0.95    # fraction of rows whose selected set equals the oracle's
DISCRETE = ("moe.idx", "attn.index.sel", "attn.cand")
PROMPT = [3, 17, 42, 5, 99, 7, 1, 250, 31, 64, 12, 8, 77, 2, 150, 9, 60, 4, 33, 120]


def _ckpt(name, experts="mxfp4", seed=0, drafter=None):
    cfg = preset(name)
    if drafter is not None:
        cfg = with_drafter(cfg, drafter)
    return Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=seed, experts=experts))


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _row_sets_agree(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0.0
    if a.shape[-1] == 0:
        return 1.0
    return float(np.mean([set(x[x >= 0].tolist()) == set(y[y >= 0].tolist())
                          for x, y in zip(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))]))


TIE_ABS = 2e-2   # router: sqrtsoftplus(+bias) gap treated as a tie (scores are O(1); the GPU
                 # scores differ from the oracle's by relL2 ~1e-3 after the drifted inputs)
TIE_REL = 2e-2   # indexer: gap relative to the row's max |score| (bf16 scores tie often)


def near_tie_violations(ck, gpu_out, ora_out, ids=PROMPT):
    """Each discrete choice the GPU made must be a top-k of the oracle's own scores for the same
    (replayed) inputs, up to a near-tie: min(score of picked) >= max(score of not picked) - tol.
    Hash-routed layers must agree exactly (tid2eid is a table lookup of the prompt ``ids``)."""
    cfg, bad = ck.config, []
    for i, (g, o) in enumerate(zip(gpu_out.captures, ora_out.captures)):
        picks = np.asarray(g["moe.idx"])
        if cfg.is_hash_layer(i):
            tid = ck.dequant(f"layers.{i}.ffn.gate.tid2eid")[np.asarray(ids)]
            if not np.array_equal(np.sort(picks, 1), np.sort(tid, 1)):
                bad.append(f"block {i}: hash routing differs from tid2eid")
            continue
        sel_score = np.asarray(o["moe.scores"], np.float64) + ck.dequant(f"layers.{i}.ffn.gate.bias")
        for t in range(picks.shape[0]):
            mask = np.zeros(sel_score.shape[1], bool)
            mask[picks[t]] = True
            lo, hi = sel_score[t, mask].min(), sel_score[t, ~mask].max(initial=-np.inf)
            if lo < hi - TIE_ABS:
                bad.append(f"block {i} token {t}: router pick {lo:.4f} < unpicked {hi:.4f}")
        if "attn.index.sel" in g:
            sc = np.asarray(o["attn.index.scores"], np.float64)
            sel = np.asarray(g["attn.index.sel"])
            for t in range(sel.shape[0]):
                n_valid = (t + 1) // cfg.compress_ratio(i)
                chosen = sel[t][sel[t] >= 0]
                if n_valid == 0 or chosen.size == 0:
                    continue
                mask = np.zeros(n_valid, bool)
                mask[chosen] = True
                row = sc[t, :n_valid]
                tol = TIE_REL * max(np.abs(row).max(), 1e-30)
                lo, hi = row[mask].min(), row[~mask].max(initial=-np.inf)
                if lo < hi - tol:
                    bad.append(f"block {i} token {t}: indexer pick {lo:.4g} < unpicked {hi:.4g}")
    return bad


def compare(gpu_out, ora_out, per_block: float = REL_L2_PER_BLOCK):
    """Returns (failures, table) comparing every capture name by name; the bound of block b is
    the capture's block-0 bound + per_block * b."""
    fails, lines = [], []
    for i, (g, o) in enumerate(zip(gpu_out.captures, ora_out.captures)):
        missing = sorted(set(o) ^ set(g))
        if missing:
            fails.append(f"block {i}: capture names differ: {missing}")
        for name in sorted(set(o) & set(g)):
            if name in DISCRETE:
                agree = _row_sets_agree(g[name], o[name])
                lines.append(f"block {i:2d} {name:22s} agree {agree:.3f}")
                if agree < DISCRETE_AGREE:
                    fails.append(f"block {i} {name}: row agreement {agree:.3f} < {DISCRETE_AGREE}")
                continue
            if g[name].shape != o[name].shape:
                fails.append(f"block {i} {name}: shape {g[name].shape} vs oracle {o[name].shape}")
                continue
            r = _rel(g[name], o[name])
            bound = (REL_L2_FP4 if name in FP4_CAPTURES else
                     REL_L2_SCORES if "scores" in name else REL_L2) + per_block * i
            lines.append(f"block {i:2d} {name:22s} relL2 {r:.2e} (bound {bound:.1e})")
            if not r <= bound:
                fails.append(f"block {i} {name}: rel L2 {r:.3e} > {bound:.2e}")
    for name in ("embed", "hc_head", "final_norm"):
        r = _rel(gpu_out.captures_top[name], ora_out.captures_top[name])
        lines.append(f"top {name:22s} relL2 {r:.2e}")
        if not r <= REL_L2:
            fails.append(f"top {name}: rel L2 {r:.3e} > {REL_L2:.0e}")
    return fails, "\n".join(lines)


@pytest.fixture(scope="module")
def gpu_model():
    from memra_dsv4.gpu.model import Dsv4Gpu
    cache = {}

    def get(name, experts="mxfp4", devices=(0,), force_bounce=False, drafter=None):
        key = (name, experts, tuple(devices), force_bounce, drafter)
        if key not in cache:
            ck = _ckpt(name, experts, drafter=drafter)
            cache[key] = (ck, Dsv4Gpu.load(ck, devices=devices, force_bounce=force_bounce))
        return cache[key]
    return get


@pytest.mark.parametrize("name,experts", [("tiny", "mxfp4"), ("small", "mxfp4"), ("small", "nvfp4")])
def test_prefill_matches_oracle(gpu_model, name, experts):
    ck, m = gpu_model(name, experts)
    out = m.forward(PROMPT, capture=True)
    oracle = Oracle(ck, numerics="bf16")
    forced = [{k: c[k] for k in ("moe.idx", "attn.index.sel") if k in c} for c in out.captures]
    ora = oracle.prefill(PROMPT, capture=True, force_decisions=forced)
    tie_fails = near_tie_violations(ck, out, ora)
    assert not tie_fails, "GPU choices that are not near-ties of the oracle's scores:\n" + \
        "\n".join(tie_fails)
    fails, table = compare(out, ora)
    print(table)
    assert not fails, "\n".join(fails) + "\n" + table
    assert int(np.argmax(out.logits)) == int(np.argmax(ora.logits)), (
        f"top-1 {int(np.argmax(out.logits))} vs oracle {int(np.argmax(ora.logits))}; "
        f"logits relL2 {_rel(out.logits, ora.logits):.2e}")
    assert _rel(out.logits, ora.logits) <= REL_L2
    assert _rel(out.hc_state, ora.hc_state) <= REL_L2


@pytest.mark.parametrize("name,length", [("tiny", 300), ("small", 140)])
def test_long_prompt_matches_oracle_forced(gpu_model, name, length):
    """Long prompts cross every emit and wrap many times (tiny: window 8, HCA 16, top-k 2;
    small: window 32, HCA 32, top-k 8): same checks as above with the GPU's choices replayed."""
    ck, m = gpu_model(name)
    ids = list(np.random.default_rng(length).integers(0, ck.config.vocab_size, size=length))
    out = m.forward(ids, capture=True)
    forced = [{k: c[k] for k in ("moe.idx", "attn.index.sel") if k in c} for c in out.captures]
    ora = Oracle(ck, numerics="bf16").prefill(ids, capture=True, force_decisions=forced)
    fails, table = compare(out, ora)
    print(table)
    assert not fails, "\n".join(fails) + "\n" + table
    assert _rel(out.logits, ora.logits) <= REL_L2


@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_prefill_flash_layers_matches_oracle(gpu_model, experts):
    """flash-layers:4 (full-size Flash layers 0-3: two sliding-window, one CSA, one HCA; hash
    routing in 0-2, learned in 3; the real expert formats) at
    8 tokens, block by block against the oracle with the GPU's routing / index choices replayed
    (as test_prefill_matches_oracle).  The checkpoint has no drafter (the prefill never reads
    the MTP block: 3.5 GB less to build).  Host cost: the checkpoint is ~16.5 GB of NumPy arrays
    (synth_arrays builds it expert by expert on every core: ~600 core-seconds) and the oracle
    dequantises on every use (cache_weights=False: bounded memory; only the routed experts, the
    looked-up embedding rows and the head slice by slice: ~35 s on one core); hence opt-in."""
    import os
    if os.environ.get("MEMRA_DSV4_SLOW_ORACLE") != "1":
        pytest.skip("set MEMRA_DSV4_SLOW_ORACLE=1: flash-layers:4 needs ~17 GB of host memory "
                    "and minutes of CPU oracle")
    ck, m = gpu_model("flash-layers:4", experts, drafter="none")
    out = m.forward(PROMPT[:8], capture=True)
    forced = [{k: c[k] for k in ("moe.idx", "attn.index.sel") if k in c} for c in out.captures]
    ora = Oracle(ck, numerics="bf16", cache_weights=False).prefill(
        PROMPT[:8], capture=True, force_decisions=forced)
    tie_fails = near_tie_violations(ck, out, ora, PROMPT[:8])
    assert not tie_fails, "GPU choices that are not near-ties of the oracle's scores:\n" + \
        "\n".join(tie_fails)
    fails, table = compare(out, ora, per_block=REL_L2_PER_BLOCK_FLASH)
    print(table)
    assert not fails, "\n".join(fails) + "\n" + table
    rel = _rel(out.logits, ora.logits)
    top_g, top_o = int(np.argmax(out.logits)), int(np.argmax(ora.logits))
    two = np.sort(np.asarray(ora.logits, np.float64))[-2:]
    gap = (two[1] - two[0]) / max(abs(two[1]), 1e-30)
    print(f"logits relL2 {rel:.2e}; top-1 {top_g} vs oracle {top_o} (oracle top-2 gap {gap:.2e})")
    assert top_g == top_o or gap < TIE_GAP, f"top-1 {top_g} vs {top_o} with a top-2 gap of {gap:.2e}"
    assert rel <= REL_L2


def test_bad_input_refused(gpu_model):
    ck, m = gpu_model("tiny")
    V = ck.config.vocab_size
    for bad, word in (([], "empty"), ([0, V], "outside"), (np.array([1.0, 2.0]), "integers"),
                      ([[1, 2]], "1-D"), ([-1], "outside")):
        with pytest.raises(ValueError, match=word):
            m.forward(bad)
    keep = m.max_seq_len
    m.max_seq_len = 4
    try:
        with pytest.raises(ValueError, match="max_seq_len"):
            m.forward([1, 2, 3, 4, 5])
    finally:
        m.max_seq_len = keep
    assert int(np.argmax(m.forward(PROMPT[:4]).logits)) >= 0  # still usable


def test_generate_reprefill(gpu_model):
    ck, m = gpu_model("tiny")
    new = m.generate_reprefill(PROMPT[:6], 3)
    ora = Oracle(ck, numerics="bf16")
    ids = list(PROMPT[:6])
    ref = []
    for _ in range(3):
        t = int(np.argmax(ora.prefill(ids).logits))
        ref.append(t)
        ids.append(t)
    assert new == ref, f"gpu {new} vs oracle {ref}"


@pytest.mark.multi_gpu
def test_two_device_split_bitwise_equal(gpu_model):
    _, m1 = gpu_model("small", "mxfp4", (0,))
    _, m2 = gpu_model("small", "mxfp4", (0, 1))
    assert len(m2.stages) == 2
    a = m1.forward(PROMPT, capture=True)
    b = m2.forward(PROMPT, capture=True)
    assert len(m2.boundary_paths) == 1, m2.boundary_paths
    assert np.array_equal(a.logits, b.logits), f"max diff {np.abs(a.logits - b.logits).max()}"
    assert np.array_equal(a.hc_state, b.hc_state)
    for i, (x, y) in enumerate(zip(a.captures, b.captures)):
        for k in x:
            assert np.array_equal(x[k], y[k]), f"block {i} {k} differs between 1 and 2 devices"


@pytest.mark.multi_gpu
def test_peer_vs_bounce_identical(gpu_model):
    _, mp = gpu_model("small", "mxfp4", (0, 1), False)
    _, mb = gpu_model("small", "mxfp4", (0, 1), True)
    a = mp.forward(PROMPT)
    b = mb.forward(PROMPT)
    assert mb.boundary_paths == ["bounce"], mb.boundary_paths
    print("peer path:", mp.boundary_paths)
    assert np.array_equal(a.logits, b.logits)
    assert np.array_equal(a.hc_state, b.hc_state)


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_flash_synthetic_prefill_1k():
    """Synthetic full-size flash on 2 GPUs, 1K tokens: loads, runs, finite logits."""
    from memra_dsv4.gpu.model import Dsv4Gpu
    m = Dsv4Gpu.synthetic("flash", devices=(0, 1), seed=0)
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, 1024)
    out = m.forward(ids)
    assert out.logits.shape == (m.config.vocab_size,)
    assert np.isfinite(out.logits).all()
    assert np.isfinite(out.hc_state).all()
