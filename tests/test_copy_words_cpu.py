"""ops_decode.copy_words (decode.cu copy_vec4_x4, the device verify's journal copies) on the CPU:
the launch marshals the kernel's signature (null pairs padded to four), the grid covers the
16-byte words at <= 4 per thread, and every refusal names the pair and the problem."""
from __future__ import annotations

import numpy as np
import pytest


def _aligned(fake, n_bytes):
    """A fake device array of n_bytes whose address is 16-byte aligned (a view into a larger one)."""
    base = fake.zeros((n_bytes // 4 + 8,), np.uint32)
    off = (-base.data.ptr % 16) // 4
    return base[off:off + n_bytes // 4]


def test_copy_words_launch(monkeypatch):
    from test_kernel_sources import fake_ops_module
    launched = []
    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode",
                               lambda name, grid, block, args, smem: launched.append((name, grid, block, args)))
    a, b = _aligned(fake, 16384), _aligned(fake, 16384)
    c, d = _aligned(fake, 1 << 20), _aligned(fake, 1 << 20)
    DK.copy_words([(a, b), (c, d)])
    (name, grid, block, args), = launched
    assert name == "copy_vec4_x4" and tuple(block) == (256,)
    assert args[0] is b and args[1] is a and args[2] == 1024 and isinstance(args[2], np.int64)
    assert args[3] is d and args[4] is c and args[5] == 65536
    assert all(args[i] == 0 for i in range(6, 12)), "the unused pairs: null pointers, no words"
    assert grid[0] == -(-(1024 + 65536) // 1024)   # 4 words per thread of 256
    launched.clear()
    e, f = _aligned(fake, 64 << 20), _aligned(fake, 64 << 20)
    DK.copy_words([(e, f)])
    assert launched[0][1][0] == 1024, "the grid is capped (grid-stride beyond it)"
    launched.clear()
    DK.copy_words([(a[:0], b[:0])])
    assert not launched, "nothing to copy: no launch"


def test_copy_words_refusals(monkeypatch):
    from test_kernel_sources import fake_ops_module
    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode", lambda *a: None)
    a = _aligned(fake, 1024)
    with pytest.raises(AssertionError, match="5 pairs"):
        DK.copy_words([(a, a)] * 5)
    with pytest.raises(AssertionError, match="0 pairs"):
        DK.copy_words([])
    with pytest.raises(AssertionError, match=r"pair 1: dst .*128 B\) <- src .*64 B\)"):
        DK.copy_words([(a[:4], a[4:8]), (a[:32], a[:16])])
    with pytest.raises(AssertionError, match="pair 0: src address .* not 16-byte aligned"):
        DK.copy_words([(a[8:12], a[1:5])])
    with pytest.raises(AssertionError, match="multiple of 16"):
        DK.copy_words([(a[:3], a[8:11])])
    with pytest.raises(AssertionError, match="not C-contiguous"):
        DK.copy_words([(a[:8], a[:16:2])])
