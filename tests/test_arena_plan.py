"""ArenaPlan (CPU): alignment, no overlap, bounds, stable offsets, logical dtypes, clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memra_dsv4.gpu.arena import LOGICAL_DTYPES, ArenaError, ArenaPlan, round_up, storage_dtype


def _random_plan(seed: int, n: int = 200) -> tuple[ArenaPlan, list[tuple]]:
    rng = random.Random(seed)
    plan = ArenaPlan(f"rand{seed}")
    adds = []
    for i in range(n):
        dtype = rng.choice(sorted(LOGICAL_DTYPES))
        shape = tuple(rng.randint(0, 37) for _ in range(rng.randint(0, 3)))
        align = rng.choice([256, 256, 512, 1024, 4096, max(16, storage_dtype(dtype).itemsize)])
        adds.append((f"t{i}", shape, dtype, align))
        plan.add(f"t{i}", shape, dtype, align=align)
    return plan, adds


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_invariants_hold_for_random_plans(seed):
    plan, adds = _random_plan(seed)
    plan.check()
    slots = list(plan)
    assert len(slots) == len(adds)
    for s, (name, shape, dtype, align) in zip(slots, adds):
        assert s.name == name and s.shape == shape and s.dtype == dtype
        assert s.offset % align == 0, (s, align)
        assert s.nbytes == int(np.prod(shape, dtype=np.int64)) * LOGICAL_DTYPES[dtype].itemsize
        assert s.end <= plan.total_bytes
    nonempty = sorted((s for s in slots if s.nbytes), key=lambda s: s.offset)
    for a, b in zip(nonempty, nonempty[1:]):
        assert a.end <= b.offset, f"{a} overlaps {b}"
    assert plan.total_bytes % plan.max_align == 0


def test_offsets_are_stable_and_depend_only_on_the_adds():
    p1, _ = _random_plan(7)
    p2, _ = _random_plan(7)
    assert [(s.name, s.offset) for s in p1] == [(s.name, s.offset) for s in p2]
    assert p1.fingerprint() == p2.fingerprint()
    assert p1.total_bytes == p2.total_bytes
    p3, _ = _random_plan(8)
    assert p3.fingerprint() != p1.fingerprint()


def test_exact_offsets_of_a_small_plan():
    p = ArenaPlan("small")
    a = p.add("x", (3,), "bf16")              # 6 bytes at 0
    b = p.add("y", (5, 7), "f32", align=512)  # 140 bytes at 512
    c = p.add("z", 1, "e4m3", align=1)        # 1 byte right after y
    d = p.add("w", (2, 2), "i64", align=8)    # 32 bytes at the next multiple of 8
    assert (a.offset, b.offset, c.offset, d.offset) == (0, 512, 652, 656)
    assert p.total_bytes == round_up(688, 512) == 1024
    assert p.slot("x").storage == np.uint16 and p.slot("z").storage == np.uint8
    assert p.offset("w") == 656 and "w" in p and "q" not in p and len(p) == 4


def test_logical_dtypes_map_to_their_storage():
    assert storage_dtype("bf16") == np.uint16
    assert storage_dtype("e4m3") == storage_dtype("e8m0") == storage_dtype("fp4x2") == np.uint8
    assert storage_dtype("f32") == np.float32 and storage_dtype("i32") == np.int32
    with pytest.raises(ArenaError, match="unknown logical dtype 'fp8'"):
        storage_dtype("fp8")


@pytest.mark.parametrize("args, match", [
    (("a", (2,), "f32", 3), "not a power of two"),
    (("a", (2,), "f32", 2), "below the itemsize"),
    (("a", (-1, 2), "f32", 256), "negative dimension"),
    (("", (2,), "f32", 256), "non-empty string"),
    (("a", (2,), "bfloat16", 256), "unknown logical dtype"),
    (("a", "xy", "f32", 256), "not a tuple of ints"),
])
def test_bad_adds_are_refused(args, match):
    p = ArenaPlan()
    with pytest.raises(ArenaError, match=match):
        p.add(*args[:3], align=args[3])


def test_duplicate_name_is_refused():
    p = ArenaPlan("dup")
    p.add("kv", (4,), "bf16")
    with pytest.raises(ArenaError, match="'kv' added twice"):
        p.add("kv", (4,), "bf16")


def test_check_detects_a_corrupted_plan():
    p = ArenaPlan("bad")
    p.add("a", (100,), "f32")
    p.add("b", (100,), "f32")
    # Simulate a planner bug: move b onto a.  check() must catch it.
    from dataclasses import replace
    p._slots["b"] = replace(p._slots["b"], offset=256)   # a is [0, 400)
    with pytest.raises(ArenaError, match="overlap"):
        p.check()
    p._slots["b"] = replace(p._slots["b"], offset=1000)
    with pytest.raises(ArenaError, match="not a multiple"):
        p.check()


def test_zero_sized_slots_are_allowed_and_aligned():
    p = ArenaPlan()
    p.add("empty", (0, 16), "bf16")
    s = p.add("after", (4,), "f32")
    p.check()
    assert p.slot("empty").nbytes == 0 and s.offset == 0


def test_summary_lists_the_largest_slot_first():
    p = ArenaPlan("sum")
    p.add("small", (10,), "u8")
    p.add("big", (1 << 20,), "f32")
    lines = p.summary().splitlines()
    assert "2 slots" in lines[0] and lines[1].split()[0] == "big"


def test_importing_the_gpu_package_does_not_import_cupy():
    import subprocess
    import sys
    code = ("import sys, memra_dsv4.gpu.arena, memra_dsv4.gpu.blaslt, memra_dsv4.gpu.graphs, "
            "memra_dsv4.gpu.kernel_loader, memra_dsv4.gpu.runtime, memra_dsv4.placement; "
            "bad = [m for m in ('cupy', 'nvmath') if m in sys.modules]; "
            "assert not bad, bad; import os; print(os.environ['CUPY_CACHE_DIR'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in __import__("os").environ.items()
                              if k != "CUPY_CACHE_DIR"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(".memra_cache/cupy"), out.stdout
