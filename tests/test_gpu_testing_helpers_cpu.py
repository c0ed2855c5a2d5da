"""memra_dsv4.gpu.ops.testing.snapshot_diff (the GPU step tests' "every cache byte" comparison of
two arms' DecodeState snapshots) on NumPy arrays: equal snapshots give no key, a single
differing byte names its array, keys come in the reference's order, and a bit-level difference
of -0.0 and +0.0 in a float array is seen only where the arrays are compared as bits."""
from __future__ import annotations

import numpy as np

from memra_dsv4.gpu.ops.testing import snapshot_diff


def test_snapshot_diff():
    ref = {"pos": np.int64(7), "layer0.ring": np.arange(12, dtype=np.uint16).reshape(3, 4),
           "layer0.comp": np.zeros((2, 4), np.uint8), "layer1.pend": np.ones(5, np.float32)}
    same = {k: np.array(v, copy=True) for k, v in ref.items()}
    assert snapshot_diff(ref, same) == []
    other = {k: np.array(v, copy=True) for k, v in ref.items()}
    other["layer0.comp"][1, 3] = 1
    other["layer1.pend"][0] = 2.0
    assert snapshot_diff(ref, other) == ["layer0.comp", "layer1.pend"]
    other = dict(same, pos=np.int64(8))
    assert snapshot_diff(ref, other) == ["pos"]
    z = {"x": np.zeros(2, np.float32)}
    nz = {"x": -np.zeros(2, np.float32)}
    assert snapshot_diff(z, nz) == []   # value comparison, as the tests always did
    assert snapshot_diff({"x": z["x"].view(np.uint32)}, {"x": nz["x"].view(np.uint32)}) == ["x"]
