"""GPU decode (memra_dsv4.gpu: cache.DecodeState, Dsv4Gpu.prefill / decode_step) against
re-prefill (Dsv4Gpu.forward of the whole prefix) and the oracle's decode state machine.

Contract (dsv4_attention.md 7.4): the logits of decode step t after prefill(L) equal the
last-position logits of a prefill of the first t+1 tokens.  On the GPU both go through the
same CuPy twins, but an M=1 GEMM / attention row may take another cuBLASLt algorithm or
reduction blocking than the M=L one, so the comparison is bf16-class, not bitwise:
* logits of every step against re-prefill and against the oracle decode, judged as
  trajectories across implementations (_trajectory_check: median rel L2 <= REL_L2_XIMPL, every
  step <= FLIP_REL, top-1 equal on >= TOP1_AGREE of the steps whose reference top-2 gap is wider
  than TIE_GAP and the step's rel L2): on random synthetic weights a bf16-ulp difference flips
  a near-tie router / indexer top-k choice now and then, and one flipped expert moves the
  logits by ~1e-1; prefill vs forward of the same prompt stays strict (_logit_check, REL_L2);
* caches (ring, compressed rows, indexer keys, pending kv/score) against the oracle's state:
  -inf pattern of every pending score identical (structural, exact); finite values rel L2 <=
  REL_L2_STATE (2.5e-1: the rows went through the KV FP8 sim, and after a flip the residual
  differs), indexer keys (FP4-simulated) <= REL_L2_FP4 (2e-1).
Bitwise where the arithmetic is the same: a reused state (reset) == a fresh state, 2 stages ==
1 stage, and device-hostmath == legacy (legacy's decode_step is the one-token dispatch of the
chunk routine: the device step's kernels with the hc split, router selection, indexer top-k and
head gate on the host, gpu.hostmath; device-hostmath is the device step with the same islands).
Legacy decode vs re-prefill is therefore across arithmetics (GEMV vs cuBLASLt GEMM, fused FP4
GEMVs vs the prefill MoE, host vs device islands): bf16 class, the bounds below.
Every model here runs its prefills with prefill_attn="simt", the decode kernels' attention
arithmetic: the contract isolates the state machine (rings, pending rows, emissions, visibility).
With the default tensor-core prefill attention (chunks >= 64) a re-prefill's attention sums in
another order, and on these random weights that flips near-tie router / indexer choices at more
steps than MAX_FLIPS (seen on the H200 at 6f6c8d2: tiny L127 3 flipped steps, small L127 top-1
3/5); that kernel is checked against the oracle block by block with the decisions replayed
(test_prefill_gpu long prompts, test_kernels_attention mma).
Case names carry the boundary they cross (tiny: window 8 -> L 8/9, HCA ratio 16 -> 15/16,
CSA ratio 4 -> 3/4; small: window 32, HCA 32).
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.gpu.ops.testing import snapshot_diff
from memra_dsv4.oracle.model import Oracle
from memra_dsv4.synth import synth_arrays

REL_L2 = 2e-2
REL_L2_STATE = 2.5e-1   # cached rows vs the oracle: FP8-simulated nope dims (drift flips whole
                        # e4m3 steps), and rows written after a near-tie flip hold the flipped
                        # token's projections (seen on the H200: small L=32, layer 5 pending
                        # rows 0.11 after flips at steps 35/36; every other row <= 1.2e-2)
REL_L2_FP4 = 2e-1       # indexer keys: FP4-simulated (one e2m1 step is up to 1/3 relative)
MAX_FLIPS = 1           # steps per case and reference allowed past REL_L2 (discrete flips)
FLIP_REL = 0.5
TIE_GAP = 2e-2          # relative top-2 gap below which a top-1 flip is tolerated
# Across implementations (GPU vs oracle decode; device path vs legacy) a near-tie flip can land
# in the caches (a compressed entry, a pending row, a ring vector written during prefill), after
# which both sides hold different but equally valid states and every later step differs by a
# few 1e-2 (seen on the H200: tiny L=300 vs the oracle, 3 consecutive steps at 0.13-0.35).  So
# those references are judged as a trajectory: median rel L2 <= REL_L2_XIMPL, every step <= FLIP_REL,
# and top-1 equal on >= TOP1_AGREE of the steps whose reference top-2 gap is >= TIE_GAP.  A real
# bug moves most steps by O(1) and fails all three.  Within one implementation (GPU decode vs
# GPU re-prefill: the same kernels) the strict per-step check with MAX_FLIPS stays.
TOP1_AGREE = 0.8
# Long trajectories (the 300-step contract of test_step_gpu): a near-tie flip of the indexer's
# top-k or of a compressed entry moves a single step well past the typical few 1e-2.  Seen on the
# H200 (2026-11-30, c9d8bc4): tiny L=128, device path vs the oracle's decode, one step of 300 at
# rel L2 0.51 with the median at 1.2e-2 and top-1 239/247.  So a trajectory may hold up to
# OUTLIER_FRAC of its steps (rounded down: none below 100 steps) above FLIP_REL, each still <= OUTLIER_REL (a
# step the same size as the reference logits); the median and top-1 checks are unchanged.
OUTLIER_FRAC = 0.01
OUTLIER_REL = 1.0
# The median bound across implementations.  Measured on the H200 (2026-11-30): 0.8-1.5e-2 for
# prompts < 32 tokens, 3.5e-2 to 1.0e-1 after prompts of 127-300 tokens (more prefill tokens,
# more near-tie flips baked into the caches), while GPU decode == GPU re-prefill per step and
# the forced-choice prefill of 300 tokens matches the oracle to bf16 class
# (test_prefill_gpu.test_long_prompt_matches_oracle_forced): the arithmetic is checked there.
REL_L2_XIMPL = 1.5e-1
STEPS = 6               # decode steps after each prefill
STRIDE = 2              # re-prefill comparison every STRIDE steps (and the last)

TINY_CASES = {          # L -> name (boundaries of tiny: window 8, CSA 4, HCA 16)
    1: "L1", 2: "L2_csa3-4", 3: "L3_csa3-4", 4: "L4_csa4", 5: "L5", 8: "L8_win8-9",
    9: "L9_win9", 15: "L15_hca15-16", 16: "L16_hca16", 127: "L127", 128: "L128",
    129: "L129", 300: "L300",
}
SMALL_CASES = {1: "L1", 4: "L4_csa4", 5: "L5", 31: "L31_win-hca32", 32: "L32", 33: "L33",
               127: "L127", 129: "L129", 300: "L300"}


def _ckpt(name, experts="mxfp4", seed=0):
    cfg = preset(name)
    return Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed=seed, experts=experts))


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ids(cfg, n, seed=1):
    return np.random.default_rng(seed).integers(2, cfg.vocab_size, n).tolist()


_MODELS: dict = {}


def _model(name, devices=(0,), path="legacy", experts="mxfp4"):
    from memra_dsv4.gpu.model import Dsv4Gpu
    key = (name, tuple(devices), path, experts)
    if key not in _MODELS:
        ck = _MODELS.get(("ckpt", name, experts))
        if ck is None:
            ck = _MODELS[("ckpt", name, experts)] = _ckpt(name, experts)
        _MODELS[key] = Dsv4Gpu.load(ck, devices=devices, decode_path=path, max_seq_len=1024,
                                    prefill_attn="simt")
    return _MODELS[("ckpt", name, experts)], _MODELS[key]


def _oracle(name, experts="mxfp4"):
    key = ("oracle", name, experts)
    if key not in _MODELS:
        ck, _ = _model(name)
        _MODELS[key] = Oracle(ck, numerics="bf16")
    return _MODELS[key]


def _logit_check(tag, got, ref, fails, lines, flips=None):
    """rel L2 <= REL_L2 (or, when ``flips`` is a list, a counted flip <= FLIP_REL) and top-1."""
    r = _rel(got, ref)
    g1, r1 = int(np.argmax(got)), int(np.argmax(ref))
    srt = np.sort(np.asarray(ref, np.float64))
    gap = (srt[-1] - srt[-2]) / max(abs(srt[-1]), 1e-30)
    if not np.isfinite(np.asarray(got)).all():
        fails.append(f"{tag}: non-finite logits")
    if r <= REL_L2:
        lines.append(f"{tag}: relL2 {r:.2e} top1 {g1}/{r1} ref top2 gap {gap:.2e}")
        if g1 != r1 and gap >= TIE_GAP:
            fails.append(f"{tag}: top-1 {g1} vs {r1} with ref top-2 gap {gap:.2e} >= {TIE_GAP}")
        return
    lines.append(f"{tag}: relL2 {r:.2e} FLIP? top1 {g1}/{r1} ref top2 gap {gap:.2e}")
    if flips is None or r > FLIP_REL:
        fails.append(f"{tag}: logits rel L2 {r:.3e} > {REL_L2 if flips is None else FLIP_REL}")
    else:
        flips.append(tag)
        if len(flips) > MAX_FLIPS:
            fails.append(f"{tag}: {len(flips)} steps past rel L2 {REL_L2} (allowed {MAX_FLIPS}): "
                         f"{flips}")


def _trajectory_check(tag, pairs, fails, lines):
    """pairs: [(step tag, got logits, reference logits)] from another implementation."""
    rels, agree, counted = [], 0, 0
    for step, got, ref in pairs:
        r = _rel(got, ref)
        rels.append(r)
        g1, r1 = int(np.argmax(got)), int(np.argmax(ref))
        srt = np.sort(np.asarray(ref, np.float64))
        gap = (srt[-1] - srt[-2]) / max(abs(srt[-1]), 1e-30)
        lines.append(f"{step}: relL2 {r:.2e}{' FLIP?' if r > REL_L2 else ''} top1 {g1}/{r1} "
                     f"ref top2 gap {gap:.2e}")
        if not np.isfinite(np.asarray(got)).all():
            fails.append(f"{step}: non-finite logits")
        if r > OUTLIER_REL:
            fails.append(f"{step}: logits rel L2 {r:.3e} > {OUTLIER_REL}")
        # a step counts for top-1 when its reference's top-2 gap is wider than both TIE_GAP
        # and the step's own rel L2: a perturbation of relative size r can close a gap < r
        # (seen on the H200 at a36ea36: small L=127, legacy vs the oracle, flips at gaps
        # 2.7e-2 / 5.1e-2 on steps at rel L2 0.115 / 0.215, median 4.5e-2)
        if gap >= max(TIE_GAP, r):
            counted += 1
            agree += g1 == r1
    outliers = [r for r in rels if r > FLIP_REL]
    allowed = int(OUTLIER_FRAC * len(rels))       # 0 for the short cases: strict there
    if len(outliers) > allowed:
        fails.append(f"{tag}: {len(outliers)} steps past rel L2 {FLIP_REL} (allowed {allowed} of "
                     f"{len(rels)}): {', '.join(f'{r:.2e}' for r in outliers[:8])}")
    med = float(np.median(rels)) if rels else 0.0
    lines.append(f"{tag}: median rel L2 {med:.2e} over {len(rels)} steps; top-1 {agree}/{counted}")
    if med > REL_L2_XIMPL:
        fails.append(f"{tag}: median rel L2 {med:.3e} > {REL_L2_XIMPL}")
    if counted and agree < TOP1_AGREE * counted:
        fails.append(f"{tag}: top-1 agrees on {agree}/{counted} < {TOP1_AGREE:.0%}")


def _state_check(gs, os_, fails, lines):
    g, o = gs.snapshot(), os_.snapshot()
    if int(g["pos"]) != int(o["pos"]):
        fails.append(f"state pos {int(g['pos'])} vs oracle {int(o['pos'])}")
    for k in sorted(set(g) - {"pos"}):
        if k not in o:
            fails.append(f"state {k}: not in the oracle state")
            continue
        a, b = np.asarray(g[k], np.float64), np.asarray(o[k], np.float64)
        if a.shape != b.shape:
            fails.append(f"state {k}: shape {a.shape} vs oracle {b.shape}")
            continue
        ma, mb = np.isneginf(a), np.isneginf(b)
        if not np.array_equal(ma, mb):
            fails.append(f"state {k}: -inf pattern differs at {np.argwhere(ma != mb)[:4].tolist()}")
            continue
        if a.size == 0:
            continue
        r = _rel(np.where(ma, 0, a), np.where(mb, 0, b))
        bound = REL_L2_FP4 if k.endswith("idx_keys") else REL_L2_STATE
        lines.append(f"state {k:28s} relL2 {r:.2e} (bound {bound:.0e})")
        if not r <= bound:
            fails.append(f"state {k}: rel L2 {r:.3e} > {bound}")


def _contract(name, L):
    ck, m = _model(name)
    ora = _oracle(name)
    ids = _ids(ck.config, L + STEPS, seed=L)
    fails, lines = [], []
    logits, st = m.prefill(ids[:L])
    _logit_check(f"prefill({L}) vs forward", logits, m.forward(ids[:L]).logits, fails, lines)
    ost = ora.prefill_state(ids[:L]).state
    vs_reprefill, vs_oracle = [], []
    for i in range(STEPS):
        p = L + i
        got = m.decode_step(st, ids[p])
        ref_o = ora.decode_step(ost, ids[p])
        vs_oracle.append((f"step pos {p} vs oracle decode", got, ref_o))
        if i % STRIDE == 0 or i == STEPS - 1:
            ref = m.forward(ids[:p + 1]).logits
            vs_reprefill.append((f"step pos {p} vs re-prefill({p + 1})", got, ref))
    # legacy decode is the device step's arithmetic (GEMVs, fused FP4 GEMVs) and re-prefill the
    # chunk routine's (GEMMs, prefill MoE): two implementations, judged as a trajectory like the
    # device path's (seen on the H200 at a36ea36: small L=127/129/300, the first step at rel L2
    # 5e-7 to 4e-3, later steps 4e-2 to 0.15 as near-tie flips land in the caches)
    _trajectory_check(f"{name} L={L} vs re-prefill", vs_reprefill, fails, lines)
    _trajectory_check(f"{name} L={L} vs oracle decode", vs_oracle, fails, lines)
    assert st.pos == L + STEPS
    _state_check(st, ost, fails, lines)
    return fails, lines


@pytest.mark.parametrize("L", list(TINY_CASES), ids=list(TINY_CASES.values()))
def test_tiny_decode_equals_reprefill_and_oracle(L):
    fails, lines = _contract("tiny", L)
    print("\n".join(lines))
    assert not fails, "\n".join(fails) + "\n--- table\n" + "\n".join(lines)


@pytest.mark.parametrize("L", list(SMALL_CASES), ids=list(SMALL_CASES.values()))
def test_small_decode_equals_reprefill_and_oracle(L):
    fails, lines = _contract("small", L)
    print("\n".join(lines))
    assert not fails, "\n".join(fails) + "\n--- table\n" + "\n".join(lines)


def test_reused_state_equals_fresh_state_bitwise():
    """Reset hazard (7.3): a state that ran a long sequence, then prefill(2) + decode, gives
    exactly the bytes of a fresh state."""
    ck, m = _model("tiny")
    ids = _ids(ck.config, 40, seed=7)
    used = m.new_state()
    m.prefill(ids[:37], used)
    for t in ids[37:40]:
        m.decode_step(used, t)
    short = [5, 9, 11, 13, 17, 19, 23]
    la, used = m.prefill(short[:2], used)
    lb, fresh = m.prefill(short[:2], m.new_state())
    assert np.array_equal(la, lb)
    for t in short[2:]:
        a, b = m.decode_step(used, t), m.decode_step(fresh, t)
        assert np.array_equal(a, b), f"token {t}: max |diff| {np.abs(a - b).max()}"
    sa, sb = used.snapshot(), fresh.snapshot()
    bad = snapshot_diff(sa, sb)
    assert not bad, f"reused vs fresh state differs in {bad}"


def test_generate_equals_reprefill_generation():
    ck, m = _model("tiny")
    ids = _ids(ck.config, 10, seed=3)
    a = m.generate(ids, 6)
    b = m.generate_reprefill(ids, 6)
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"incremental {a}\nre-prefill  {b}\ncommon prefix {same}")
    # greedy chains may part after a near-tie flip (module doc); the first 3 must agree
    assert same >= 3, f"incremental {a} vs re-prefill {b}: parted at token {same}"


def test_decode_refuses_bad_calls():
    ck, m = _model("tiny")
    st = m.new_state(max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.prefill([1, 2, 3, 4, 5], st)
    m.prefill([1, 2, 3, 4], st)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.decode_step(st, 1)
    with pytest.raises(ValueError, match="one integer"):
        m.decode_step(st, [1, 2])
    with pytest.raises(ValueError, match="outside"):
        m.decode_step(m.prefill([1])[1], ck.config.vocab_size)
    with pytest.raises(ValueError, match="DecodeState"):
        m.decode_step(object(), 1)


@pytest.mark.multi_gpu
def test_two_stage_decode_bitwise_equals_one_stage():
    ck, m1 = _model("small", (0,))
    _, m2 = _model("small", (0, 1))
    assert len(m2.stages) == 2
    ids = _ids(ck.config, 45, seed=5)
    a, s1 = m1.prefill(ids[:40])
    b, s2 = m2.prefill(ids[:40])
    assert np.array_equal(a, b)
    for t in ids[40:]:
        a, b = m1.decode_step(s1, t), m2.decode_step(s2, t)
        assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"
    assert len(m2.boundary_paths) == 1
    sa, sb = s1.snapshot(), s2.snapshot()
    bad = snapshot_diff(sa, sb)
    assert not bad, f"1-stage vs 2-stage state differs in {bad}"


# ------------------------------------------------------------------ device paths
def _run_path(name, path, L, steps, devices=(0,)):
    ck, m = _model(name, devices, path)
    ids = _ids(ck.config, L + steps, seed=11)
    _, st = m.prefill(ids[:L])
    return [m.decode_step(st, t) for t in ids[L:]], st


def _hostmath_bytewise(name, L, steps, devices=(0,)):
    """device-hostmath == legacy, logits of every step and the whole state, byte for byte."""
    a, sa = _run_path(name, "legacy", L, steps, devices)
    b, sb = _run_path(name, "device-hostmath", L, steps, devices)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"step {i}: max |diff| {np.abs(x - y).max()}"
    bad = snapshot_diff(sa.snapshot(), sb.snapshot())
    assert not bad, f"state differs in {bad}"


def hostmath_equals_legacy_with(attr: str | None, value: str | None, seed: int, what: str, L: int = 16,
                                steps: int = 5):
    """tiny: device-hostmath with ``model.<attr> = value`` (a device-step form: qnorm, shared w2,
    ...) == legacy, the logits of every step bit for bit and every cache byte (the step test
    files' "the form keeps the byte contract" check).  ``attr`` None: no attribute is set (a
    form the caller selected through its env switch before the call)."""
    ck, ml = _model("tiny", (0,), "legacy")
    _, mh = _model("tiny", (0,), "device-hostmath")
    ids = _ids(ck.config, L + steps, seed=seed)
    _, sa = ml.prefill(ids[:L])
    _, sb = mh.prefill(ids[:L])
    old = getattr(mh, attr) if attr else None   # every device-step form is set on the model at load
    try:
        if attr:
            setattr(mh, attr, value)
        for i, t in enumerate(ids[L:]):
            x, y = ml.decode_step(sa, t), mh.decode_step(sb, t)
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), \
                f"step {i}: device-hostmath ({what}) != legacy, max |diff| {np.abs(x - y).max()}"
    finally:
        if attr:
            setattr(mh, attr, old)
    bad = snapshot_diff(sa.snapshot(), sb.snapshot())
    assert not bad, f"state differs in {bad}"


@pytest.mark.parametrize("L", [3, 16, 129])
def test_device_hostmath_bytewise_equals_legacy(L):
    _hostmath_bytewise("tiny", L, 5)


@pytest.mark.parametrize("L", [31, 40])
def test_device_hostmath_bytewise_equals_legacy_small(L):
    _hostmath_bytewise("small", L, 5)


@pytest.mark.multi_gpu
def test_device_hostmath_bytewise_equals_legacy_two_stages():
    _hostmath_bytewise("small", 40, 5, devices=(0, 1))
    _, m = _model("small", (0, 1), "device-hostmath")
    assert len(m.stages) == 2


def _graph_equals_eager_then_allocations(path: str):
    """tiny on ``path``: 5 steps with graph=False and 5 with graph=True from equal states give the
    same logits; returns (model, the allocation count of 5 more graph=True steps)."""
    from memra_dsv4.gpu.arena import count_allocations
    from memra_dsv4.gpu.step import device_step
    ck, m = _model("tiny", (0,), path)
    ids = _ids(ck.config, 30, seed=13)
    _, s_eager = m.prefill(ids[:20])
    _, s_graph = m.prefill(ids[:20], m.new_state())
    eager = [device_step(m, s_eager, t, graph=False) for t in ids[20:25]]
    graph = [device_step(m, s_graph, t, graph=True) for t in ids[20:25]]
    for i, (x, y) in enumerate(zip(eager, graph)):
        assert np.array_equal(x, y), f"{path} step {i}: graph=True vs False max |diff| {np.abs(x - y).max()}"
    with count_allocations() as c:
        for t in ids[25:30]:
            device_step(m, s_graph, t, graph=True)
    return m, c


def test_device_hostmath_eager_and_allocates_nothing():
    """device-hostmath runs eagerly whatever graph= says (same bytes), and after its first
    step (pinned island buffers made on first use) allocates nothing on the device."""
    m, c = _graph_equals_eager_then_allocations("device-hostmath")
    assert not m._step._graphs, "device-hostmath captured a graph"
    assert c.total == 0, f"{c} allocations in 5 device-hostmath steps"


@pytest.mark.parametrize("L", [3, 16, 129])
def test_device_within_bounds_of_legacy(L):
    a, _ = _run_path("tiny", "legacy", L, 5)
    b, _ = _run_path("tiny", "device", L, 5)
    fails, lines = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        _logit_check(f"step {i}", y, x, fails, lines)
    assert not fails, "\n".join(fails + lines)


def test_graph_replay_equals_eager_and_allocates_nothing():
    _, c = _graph_equals_eager_then_allocations("device")
    assert c.total == 0, f"{c} allocations in 5 graph steps"
