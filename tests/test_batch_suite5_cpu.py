"""tools/batches/suite5.txt (the whole GPU suite in five processes) runs every tests/gpu test file
exactly once: the files it names, plus the two file lists it selects with grep -E (c's kernel
files; c's step files minus a's), read from the batch text itself.  A new GPU test file that no
process picks up, or one picked twice, fails here rather than silently on the GPU machine."""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_suite5_covers_every_gpu_test_file_once():
    text = open(os.path.join(ROOT, "tools", "batches", "suite5.txt"), encoding="utf-8").read()
    line = next(l for l in text.splitlines() if re.match(r"^\d+ suite ", l))
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py")))
    named = re.findall(r"\$G/(test_\w+\.py)", line)
    # C1=$(ls $G/test_*.py | grep -E "RE1" ...); C2=$(ls $G/test_step_*.py | grep -v -E "RE2" ...)
    re1 = re.search(r'C1=\$\(ls \$G/test_\*\.py \| grep -E "([^"]+)"', line).group(1)
    re2 = re.search(r'C2=\$\(ls \$G/test_step_\*\.py \| grep -v -E "([^"]+)"', line).group(1)
    c1 = [f for f in files if re.search(re1, "/" + f)]
    c2 = [f for f in files if f.startswith("test_step_") and not re.search(re2, f)]
    picked = named + c1 + c2
    missing = sorted(set(files) - set(picked))
    twice = sorted({f for f in picked if picked.count(f) > 1})
    assert not missing, f"suite5.txt runs no process for {missing}"
    assert not twice, f"suite5.txt runs {twice} in two processes"
    assert len(files) >= 40, f"only {len(files)} GPU test files found"
