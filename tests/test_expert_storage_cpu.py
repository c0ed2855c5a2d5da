"""The synthetic models' expert storage switch (weights.EXPERT_STORAGE) at its two boundaries,
without a GPU: Dsv4Gpu.synthetic refuses an unknown value before any GPU work, and
bench.decode_step refuses --expert-storage shared for a checkpoint (which stores its own experts)
before loading anything.  The aliasing itself: tests/gpu/test_synthetic_shared_experts_gpu.py."""
from __future__ import annotations

import pytest


def test_synthetic_refuses_unknown_expert_storage():
    from memra_dsv4.gpu.model import Dsv4Gpu
    with pytest.raises(ValueError, match="expert_storage = 'layer': expected one of"):
        Dsv4Gpu.synthetic("tiny", devices=(0,), expert_storage="layer")


def test_bench_refuses_shared_storage_for_a_checkpoint(tmp_path):
    from bench import decode_step
    with pytest.raises(SystemExit, match="--expert-storage shared: synthetic models only"):
        decode_step.main(["--model", str(tmp_path), "--devices", "0", "--expert-storage", "shared"])
    with pytest.raises(SystemExit):   # argparse: not one of the choices
        decode_step.main(["--expert-storage", "aliased"])
