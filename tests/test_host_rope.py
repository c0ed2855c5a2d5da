"""RoPE rules: YaRN range, per-layer tables, interleaved layout, inverse, relative property."""

import math

import numpy as np
import pytest

from memra_dsv4.config import preset
from memra_dsv4.host import rope


def test_yarn_range_flash_is_15_25():
    assert rope.yarn_correction_range(64, 160000.0, 32, 1, 65536) == (15, 25)
    # base 10000 would give (20, 33) (unused by the model: ratio-0 layers have no YaRN)
    assert rope.yarn_correction_range(64, 10000.0, 32, 1, 65536) == (20, 33)


def test_flash_layer_tables():
    cfg = preset("flash")
    plain = rope.layer_inv_freq(cfg, 0)            # ratio 0: theta 10000, no YaRN
    base = (1.0 / np.power(np.float32(10000.0), np.arange(0, 64, 2, dtype=np.float32) / 64)).astype(np.float32)
    np.testing.assert_array_equal(plain, base)
    yarn = rope.layer_inv_freq(cfg, 2).astype(np.float64)  # CSA: theta 160000 + YaRN
    f = 1.0 / 160000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(yarn[:16], f[:16], rtol=1e-6)          # i <= 15 unchanged
    np.testing.assert_allclose(yarn[25:], f[25:] / 16, rtol=1e-6)     # i >= 25 divided by 16
    ramp = np.clip((np.arange(32) - 15) / 10, 0, 1)
    np.testing.assert_allclose(yarn, f * (1 - ramp) + f / 16 * ramp, rtol=1e-6)
    assert rope.layer_inv_freq(cfg, 3) is rope.layer_inv_freq(cfg, 2)  # HCA: same table
    np.testing.assert_array_equal(rope.layer_inv_freq(cfg, 43), plain)  # MTP block: plain


def test_angle_table_is_fp32_product():
    f = rope.layer_inv_freq(preset("flash"), 2)
    t = np.array([0, 1, 127, 4095, 65535, 1_000_003])
    th = rope.angles(f, t)
    assert th.dtype == np.float32
    np.testing.assert_array_equal(th, np.float32(t.astype(np.float32)[:, None] * f[None, :]))


def test_interleaved_layout_and_inverse():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 128))
    cos, sin = rope.cos_sin(rope.layer_inv_freq(preset("tiny"), 1), np.arange(5), np.float64)
    y = rope.rotate_pairs(x, cos[:, None], sin[:, None])
    np.testing.assert_array_equal(y[..., :64], x[..., :64])            # nope dims untouched
    back = rope.rotate_pairs(y, cos[:, None], sin[:, None], inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-13)
    # pair i = (x[64+2i], x[64+2i+1]) rotated by theta_i: (1, 0) -> (cos, sin)
    e = np.zeros(128)
    e[64 + 2 * 3] = 1.0
    r = rope.rotate_pairs(e[None], cos[2:3], sin[2:3])[0]
    assert r[70] == pytest.approx(cos[2, 3]) and r[71] == pytest.approx(sin[2, 3])


def test_relative_position_property():
    """<R(t) q, R(s) k> depends only on t - s (the reason V = K works with the output de-rotation)."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal(64), rng.standard_normal(64)
    f = rope.layer_inv_freq(preset("tiny"), 0)

    def dot(t, s):
        ct, st = rope.cos_sin(f, [t], np.float64)
        cs, ss = rope.cos_sin(f, [s], np.float64)
        return float(rope.rotate_pairs(q[None], ct, st)[0] @ rope.rotate_pairs(k[None], cs, ss)[0])

    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-5)


def test_tiny_layer_kinds():
    cfg = preset("tiny")   # ratios (0, 4, 16, 4 | 0)
    kinds = [cfg.rope_kind(l) for l in range(5)]
    assert kinds == ["plain", "yarn", "yarn", "yarn", "plain"]
    assert math.isclose(cfg.rope_base(1), 160000.0) and math.isclose(cfg.rope_base(0), 10000.0)
