"""tools/gpu_check.sh's ``tests`` step: without arguments it runs the whole tests/gpu directory;
arguments that name tests/... paths replace the directory (the sixteenth session's call passed
seven files and got the whole suite, because pytest collected the directory and the files).
CPU only: the script runs in a skeleton repository (no wheels, no GPU) with this interpreter."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def skeleton(tmp_path):
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "gpu_check.sh", tmp_path / "tools" / "gpu_check.sh")
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    for name in ("test_alpha_gpu.py", "test_beta_gpu.py", "test_gamma_gpu.py"):
        (gpu / name).write_text(f"def test_{name[5:-7]}():\n    pass\n")
    return tmp_path


def _run(skeleton, *args):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    out = skeleton / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_TEST_TIMEOUT="120")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "tools/gpu_check.sh", "tests", *args], cwd=skeleton, env=env,
                       capture_output=True, text=True, timeout=300)
    log = (out / "gpu_tests.log").read_text()
    return r.returncode, log


def test_no_arguments_runs_the_directory(skeleton):
    rc, log = _run(skeleton)
    assert rc == 0, log
    assert "3 passed" in log, log


def test_named_files_replace_the_directory(skeleton):
    rc, log = _run(skeleton, "tests/gpu/test_alpha_gpu.py", "tests/gpu/test_gamma_gpu.py")
    assert rc == 0, log
    assert "2 passed" in log, log


def test_options_alone_keep_the_directory(skeleton):
    rc, log = _run(skeleton, "-k", "beta")
    assert rc == 0, log
    assert "1 passed, 2 deselected" in log, log
