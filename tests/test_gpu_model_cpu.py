"""CPU-testable parts of the GPU model: weight plan, input checks, import without CuPy."""
import types

import numpy as np
import pytest

from memra_dsv4.config import preset
from memra_dsv4.gpu.model import Dsv4Gpu
from memra_dsv4.gpu.weights import weight_plan


@pytest.mark.parametrize("name,n", [("tiny", 1), ("small", 2), ("flash", 2)])
def test_weight_plan_covers_every_layer_once(name, n):
    cfg = preset(name)
    plan = weight_plan(cfg, n)
    assert len(plan) == n
    layers = [l for _, r, _, _ in plan for l in r]
    assert layers == list(range(cfg.num_hidden_layers))
    assert plan[0][2] and plan[-1][3]                 # embed first, head last
    assert sum(e for *_, e, _ in plan) == 1 and sum(h for *_, h in plan) == 1


def test_check_ids_refuses_bad_input():
    fake = types.SimpleNamespace(config=preset("tiny"), max_seq_len=8)
    V = fake.config.vocab_size
    ok = Dsv4Gpu.check_ids(fake, [1, 2, 3])
    assert ok.dtype == np.int64
    for bad, word in (([], "empty"), ([V], "outside"), ([1.5], "integers"),
                      (list(range(9)), "max_seq_len")):
        with pytest.raises(ValueError, match=word):
            Dsv4Gpu.check_ids(fake, bad)
