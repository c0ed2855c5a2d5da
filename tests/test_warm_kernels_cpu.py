"""tools/warm_kernels.py --variants builds every experts.cu variant that the GPU kernel tests
compare against: each constant ``{"FP4_...": int}`` dict literal of
tests/gpu/test_kernels_experts.py must be one of EXPERT_TEST_VARIANTS (a variant missing from
the list compiles cold inside a time-boxed test process on the GPU machine), and every listed
variant must still be used there or be one of FP4_DN_PRELOAD's loop levels."""
from __future__ import annotations

import ast
import os

from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warm_module():
    return load_tool("warm_kernels")


def _constant_fp4_dicts(path: str) -> list[dict]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Dict) and node.keys
                and all(isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.startswith("FP4_")
                        for k in node.keys)
                and all(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in node.values)):
            found.append({k.value: v.value for k, v in zip(node.keys, node.values)})
    return found


def test_every_tested_variant_is_warmed():
    listed = _warm_module().EXPERT_TEST_VARIANTS
    used = _constant_fp4_dicts(os.path.join(ROOT, "tests", "gpu", "test_kernels_experts.py"))
    assert len(used) >= 8, f"only {len(used)} variant dicts found: the parse no longer sees the tests' literals"
    missing = [d for d in used if d not in listed]
    assert not missing, f"tools/warm_kernels.py EXPERT_TEST_VARIANTS lacks {missing}"
    loop_levels = [{"FP4_DN_PRELOAD": 0}, {"FP4_DN_PRELOAD": 1}]
    stale = [d for d in listed if d not in used and d not in loop_levels]
    assert not stale, f"EXPERT_TEST_VARIANTS lists {stale}, which no GPU test builds"
    assert len({tuple(sorted(d.items())) for d in listed}) == len(listed), "duplicate variants"


def test_variants_flag_parses_without_a_gpu():
    ns = _warm_module().parser().parse_args(["--variants", "--jobs", "3"])
    assert ns.variants is True and ns.jobs == 3
    assert _warm_module().parser().parse_args([]).variants is False
