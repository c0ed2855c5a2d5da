"""L2 prefetch before the PDL wait (decode.cu gemv_*_prefetch, seam MEMRA_DSV4_L2_PREFETCH).

The prefetch is a hint: it must change no output bit.  Checked here on the GPU:
* the constant the kernels read (memra_l2_prefetch_bytes) holds what set_l2_prefetch wrote;
* every dense GEMV kernel family that prefetches (plain bf16 / FP8 rows, the multi-projection
  table, the shared-expert SwiGLU) gives the same bytes with the budget off and at 128 MB, with
  plain launches and with PDL launches (where the prefetch runs before griddepcontrol.wait);
* the device step (graph replay, PDL on) gives the same logits and the same caches with
  l2_prefetch off and at 128 MB, on tiny, 12 steps past a 5-token prefill (a CSA emit and the
  window wrap of tiny), the two arms interleaved step by step.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from memra_dsv4.gpu import ops_decode as DK  # noqa: E402
from memra_dsv4.gpu.ops.testing import bits_of, fresh_seed, rand_bf16, rng_for, snapshot_diff  # noqa: E402
from memra_dsv4.gpu.pdl import pdl_launches  # noqa: E402

BUDGETS = ("off", "128")


def _read_constant(dev: int = 0) -> int:
    from memra_dsv4.gpu import kernel_loader
    mod = kernel_loader.get_loader(dev).module(DK.STEM)
    host = np.zeros(1, np.uint64)
    ptr = mod.get_global(DK.L2_PREFETCH_SYMBOL)
    cp.cuda.runtime.memcpy(host.ctypes.data, ptr.ptr, 8, cp.cuda.runtime.memcpyDeviceToHost)
    return int(host[0])


def test_set_l2_prefetch_writes_the_constant():
    for v, want in (("64", 64 << 20), ("off", 0), (8, 8 << 20), ("off", 0)):
        assert DK.set_l2_prefetch(0, v) == want
        assert _read_constant(0) == want, f"after set_l2_prefetch({v!r})"
    with pytest.raises(ValueError, match="l2_prefetch = 'lots'"):
        DK.set_l2_prefetch(0, "lots")
    assert _read_constant(0) == 0, "a refused value must leave the constant as it was"


def _runs(fn):
    """fn() under every (budget, launch form); the outputs' bytes per run."""
    out = {}
    for budget in BUDGETS:
        DK.set_l2_prefetch(0, budget)
        for pdl in (False, True):
            with pdl_launches(pdl):
                res = fn()
            cp.cuda.Device(0).synchronize()
            out[(budget, pdl)] = [np.asarray(r.get()).view(np.uint8).copy() for r in res]
    DK.set_l2_prefetch(0, "off")
    return out


def _assert_all_equal(out, what, seed):
    ref_key = ("off", False)
    for key, got in out.items():
        for i, (g, r) in enumerate(zip(got, out[ref_key])):
            assert np.array_equal(g, r), (f"{what}: output {i} differs with budget {key[0]}, "
                                          f"pdl {key[1]} (seed {seed})")


@pytest.mark.parametrize("O,K", [(4096, 1024), (1000, 4096), (33, 512)])
def test_gemv_plain_same_bytes_with_prefetch(O, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    w = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    x = cp.asarray(bits_of(rand_bf16(rng, (K,), 1.0, spread=3)))
    y = cp.empty(O, cp.float32)

    def run():
        y.fill(np.nan)
        DK.gemv_bf16(w, x, y)
        return [y]
    _assert_all_equal(_runs(run), f"gemv_bf16 O={O} K={K}", seed)


@pytest.mark.parametrize("O,K", [(4096, 1024), (300, 4096)])
def test_gemv_fp8_same_bytes_with_prefetch(O, K):
    seed = fresh_seed()
    rng = rng_for(seed)
    b = rng.integers(0, 256, (O, K), dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0                      # no e4m3 NaN
    w8 = cp.asarray(b)
    sc = cp.asarray(rng.integers(118, 136, ((O + 127) // 128, (K + 127) // 128), dtype=np.uint8))
    x = cp.asarray(bits_of(rand_bf16(rng, (K,), 1.0, spread=3)))
    y = cp.empty(O, cp.float32)

    def run():
        y.fill(np.nan)
        DK.gemv_bf16(w8, x, y, scale=sc)
        return [y]
    _assert_all_equal(_runs(run), f"gemv fp8 O={O} K={K}", seed)


def test_gemv_multi_and_swiglu_same_bytes_with_prefetch():
    seed = fresh_seed()
    rng = rng_for(seed)
    K = 1024
    x = cp.asarray(bits_of(rand_bf16(rng, (K,), 1.0, spread=3)))
    ws = [cp.asarray(bits_of(rand_bf16(rng, (n, K), 1.0, spread=3))) for n in (1536, 512, 40)]
    outs = [cp.empty(w.shape[0], cp.float32) for w in ws]
    table = DK.GemvTable(list(zip(ws, outs)), K)
    pos = cp.asarray(np.array([7], np.int32))

    def run_multi():
        for o in outs:
            o.fill(np.nan)
        DK.gemv_bf16_multi(table, x, pos)
        return outs
    _assert_all_equal(_runs(run_multi), "gemv_bf16_multi", seed)

    O = 2048
    w1 = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    w3 = cp.asarray(bits_of(rand_bf16(rng, (O, K), 1.0, spread=3)))
    h = cp.empty(O, cp.uint16)

    def run_swiglu():
        h.fill(0xFFFF)
        DK.gemv_bf16_swiglu(w1, w3, x, h, 10.0)
        return [h]
    _assert_all_equal(_runs(run_swiglu), "gemv_bf16_swiglu", seed)


def test_device_step_same_bits_with_prefetch():
    from test_decode_gpu import _ids, _model  # prepend import mode (tests/gpu on sys.path)
    from memra_dsv4.gpu.step import device_step
    ck, m = _model("tiny", (0,), "device")
    ids = _ids(ck.config, 20, seed=3)
    states = {b: m.prefill(ids[:5], m.new_state())[1] for b in BUDGETS}
    old = m.l2_prefetch
    try:
        for i, t in enumerate(ids[5:17]):
            got = {}
            for b in BUDGETS:
                m.l2_prefetch = b
                got[b] = device_step(m, states[b], int(t), graph=True)
            assert np.array_equal(got["off"].view(np.uint32), got["128"].view(np.uint32)), \
                f"device step {i} (pos {5 + i}): logits differ with l2_prefetch 128 vs off"
        sa, sb = states["off"].snapshot(), states["128"].snapshot()
        diff = snapshot_diff(sa, sb)
        assert not diff, f"caches differ with l2_prefetch 128 vs off: {diff}"
    finally:
        m.l2_prefetch = old
        DK.set_l2_prefetch(0, "off")
