"""GEMM plan keys and M buckets (CPU): validation, layouts, scale shapes, bucketing."""

from __future__ import annotations

import pytest

from memra_dsv4.gpu.blaslt import SUPPORTED, GemmKey, bucket_for, m_buckets


def test_buckets_powers_of_two_then_multiples_of_128():
    b = m_buckets(4096)
    assert b[:8] == (1, 2, 4, 8, 16, 32, 64, 128)
    assert b[8:11] == (256, 384, 512) and b[-1] == 4096
    assert len(b) == 8 + 31
    assert all(x < y for x, y in zip(b, b[1:]))
    assert m_buckets(1) == (1,)
    assert m_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert m_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert m_buckets(129) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError):
        m_buckets(0)


@pytest.mark.parametrize("m, want", [(1, 1), (2, 2), (3, 4), (7, 8), (64, 64), (65, 128),
                                     (129, 256), (300, 384), (4096, 4096)])
def test_bucket_for_picks_the_smallest_bucket_that_holds_m(m, want):
    assert bucket_for(m, m_buckets(4096)) == want


def test_bucket_for_refuses_too_many_rows():
    with pytest.raises(ValueError, match="exceeds the largest bucket 4096"):
        bucket_for(4097, m_buckets(4096))
    with pytest.raises(ValueError):
        bucket_for(0, m_buckets(16))


def test_bf16_key_layouts_follow_the_tn_mapping():
    k = GemmKey(m=7, n=512, k=1024)
    assert k.layouts() == {"A": ("bf16", 1024, 512, 1024), "B": ("bf16", 1024, 7, 1024),
                           "C": ("bf16", 512, 7, 512), "D": ("bf16", 512, 7, 512)}
    assert (k.w_shape, k.x_shape, k.y_shape) == ((512, 1024), (7, 1024), (7, 512))
    assert k.a_scale_shape is None and k.b_scale_shape is None and not k.block_scaled
    assert k.flops() == 2 * 7 * 512 * 1024


def test_fp8_key_scale_shapes():
    k = GemmKey(256, 1000 + 24, 2048, "e4m3", "e4m3", "bf16", "blk128x128", "vec128")
    assert k.block_scaled
    assert k.a_scale_shape == (8, 16)         # [ceil(N/128), K/128], the checkpoint grid
    assert k.b_scale_shape == (16, 256)       # [K/128, M]: token index fastest
    assert k.layouts()["A"] == ("e4m3", 2048, 1024, 2048)
    assert "scales blk128x128/vec128" in k.label


def test_keys_are_hashable_values():
    a = GemmKey(8, 256, 512)
    b = GemmKey(8, 256, 512, "bf16", "bf16", "bf16")
    c = GemmKey(8, 256, 512, d_dtype="f32")
    assert a == b and hash(a) == hash(b) and a != c
    assert len({a, b, c}) == 2


@pytest.mark.parametrize("kw, match", [
    (dict(m=0, n=256, k=256), "positive int"),
    (dict(m=1, n=256, k=256, a_dtype="fp8"), "a_dtype"),
    (dict(m=1, n=256, k=256, a_dtype="e4m3", b_dtype="e4m3"), "unsupported"),   # FP8 without scales
    (dict(m=1, n=256, k=256, a_dtype="e4m3", b_dtype="bf16", a_scale="blk128x128",
          b_scale="vec128"), "unsupported"),
    (dict(m=1, n=256, k=256, a_scale="vec128"), "unsupported"),                 # scales on bf16
    (dict(m=1, n=256, k=196), "K\\*itemsize\\(A\\)"),                           # 392 B rows
    (dict(m=1, n=100, k=256), "N\\*itemsize\\(D\\)"),
    (dict(m=1, n=256, k=272, a_dtype="e4m3", b_dtype="e4m3", a_scale="blk128x128",
          b_scale="vec128"), "K % 128"),
    (dict(m=1, n=256, k=256, epilogue="bias"), "epilogue"),
    (dict(m=True, n=256, k=256), "positive int"),
])
def test_bad_keys_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        GemmKey(**kw)


def test_supported_set_is_what_the_runtime_needs():
    assert ("bf16", "bf16", "bf16", "none", "none") in SUPPORTED
    assert ("bf16", "bf16", "f32", "none", "none") in SUPPORTED
    assert ("e4m3", "e4m3", "bf16", "blk128x128", "vec128") in SUPPORTED


def test_dsv4_flash_linears_all_make_valid_keys():
    """Every dense linear of Flash must have a valid bf16 and FP8 key at decode and prefill sizes."""
    from memra_dsv4.config import preset
    from memra_dsv4.tensors import expected_tensors

    cfg = preset("flash")
    shapes = {s.shape for s in expected_tensors(cfg) if s.kind == "fp8" and s.layer == 2}
    assert len(shapes) >= 6
    for n, k in shapes:
        for m in (1, 8, 4096):
            GemmKey(m, n, k)
            GemmKey(m, n, k, "e4m3", "e4m3", "bf16", "blk128x128", "vec128")
