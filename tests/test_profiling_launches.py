"""profiling.launches on the CPU: launch recording through the loader (with a stand-in kernel),
call-site attribution, proxy attribute forwarding, and the aggregation / table math."""

from __future__ import annotations

import pytest

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.profiling.launches import Launch, aggregate, format_rows, record_launches


class _FakeKernel:
    def __init__(self):
        self.calls = []
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, **kw):
        self.calls.append((grid, block, args, kw))


class _FakeLoader:
    device_id = 3


@pytest.fixture
def fake_get(monkeypatch):
    kerns = {}

    def get(self, stem, name):
        return kerns.setdefault((stem, name), _FakeKernel())
    monkeypatch.setattr(kernel_loader.KernelLoader, "get", get)
    return kerns


def _site_a(loader):
    kernel_loader.KernelLoader.get(loader, "decode", "gemv_bf16")((4,), (256,), (1, 2), shared_mem=64)


def _site_b(loader):
    k = kernel_loader.KernelLoader.get(loader, "hc", "hc_post")
    k.max_dynamic_shared_size_bytes = 4096      # forwarded to the real kernel
    k(3, 128, ("x",))


def test_record_launches_forwards_and_attributes(fake_get):
    loader = _FakeLoader()

    def step():
        _site_a(loader)
        _site_b(loader)
        _site_a(loader)

    recs = record_launches(step, ("test_profiling_launches.py",))
    assert [r.kernel for r in recs] == ["decode.gemv_bf16", "hc.hc_post", "decode.gemv_bf16"]
    assert [r.site.split(":")[1] for r in recs] == ["_site_a", "_site_b", "_site_a"]
    assert recs[0].grid == (4,) and recs[0].block == (256,) and recs[0].kwargs == {"shared_mem": 64}
    assert recs[1].grid == (3,) and recs[1].block == (128,) and recs[1].device == 3
    gemv = fake_get[("decode", "gemv_bf16")]
    assert len(gemv.calls) == 2 and gemv.calls[0][3] == {"shared_mem": 64}   # really launched
    assert fake_get[("hc", "hc_post")].max_dynamic_shared_size_bytes == 4096
    # the loader is restored: a launch outside record_launches is not recorded
    _site_a(loader)
    assert len(recs) == 3


def test_record_restores_loader_on_error(fake_get):
    patched = kernel_loader.KernelLoader.get

    def boom():
        raise RuntimeError("step failed")
    with pytest.raises(RuntimeError, match="step failed"):
        record_launches(boom)
    assert kernel_loader.KernelLoader.get is patched


def _launch(kernel, site):
    return Launch(kernel, (1,), (1,), 0, site, None, (), {})


def test_aggregate_and_format():
    recs = [_launch("a.k1", "s1"), _launch("a.k2", "s1"), _launch("a.k1", "s2")]
    times = [3.0, 1.0, 6.0]
    by_k = aggregate(recs, times, "kernel")
    assert [(r["kernel"], r["count"], r["total_us"]) for r in by_k] == [("a.k1", 2, 9.0), ("a.k2", 1, 1.0)]
    assert by_k[0]["mean_us"] == 4.5 and abs(by_k[0]["share"] - 0.9) < 1e-12
    by_s = aggregate(recs, times, "site")
    assert [(r["site"], r["total_us"]) for r in by_s] == [("s2", 6.0), ("s1", 4.0)]
    assert sum(r["share"] for r in by_s) == pytest.approx(1.0)
    both = aggregate(recs, times, "site_kernel")
    assert len(both) == 3
    table = format_rows(by_k, "kernel", top=1).splitlines()
    assert len(table) == 2 and table[1].startswith("a.k1") and "90.0%" in table[1]
    with pytest.raises(KeyError):
        aggregate(recs, times, "nope")


def test_prof_modes_match_the_seam():
    """profiling keeps its own mode tuple (it must import without memra_dsv4.seams, whose
    import validates MEMRA_DSV4_NUMERICS); this pins it to the seam registry."""
    from memra_dsv4.profiling import phases
    from memra_dsv4.seams import SEAM_PROF
    assert tuple(phases.MODES) == tuple(SEAM_PROF.allowed)
    assert phases.ENV_VAR == SEAM_PROF.env
