"""The bf16 class rounds where the official PyTorch code rounds.

Each check runs a few lines of the reference model.py (M), written in torch with the same
dtypes (bf16 tensors, fp32 islands), against the oracle op in the bf16 class.  Accumulation
order differs (torch fp32 vs oracle float64), so the check is: >= 99% of elements bitwise
equal and the rest within one bf16 ulp.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from memra_dsv4.host.quant import round_bf16  # noqa: E402
from memra_dsv4.oracle import ops  # noqa: E402
from memra_dsv4.seams import POLICIES  # noqa: E402

BF = POLICIES["bf16"]
rng = np.random.default_rng(0)
bf16 = torch.bfloat16


def _bf(shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _t(a, dtype=bf16):
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _agree(got, want, min_equal=0.99):
    want = want.float().numpy() if hasattr(want, "numpy") else want
    eq = got == want
    assert eq.mean() >= min_equal, f"only {eq.mean():.4f} bitwise equal"
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-30)


def test_rmsnorm_as_M183():
    x, w = _bf((16, 256), 2.0), _bf(256)
    xt = _t(x).float()
    want = (_t(w, torch.float32) * (xt * torch.rsqrt(xt.square().mean(-1, keepdim=True) + 1e-6))).to(bf16)
    _agree(ops.rmsnorm(x, w, 1e-6, pol=BF), want)


def test_hc_pre_post_as_M674():
    X = _bf((8, 4, 64))
    fn = (rng.standard_normal((24, 256)) * 0.05).astype(np.float32)
    scale = np.array([1.0, 0.7, 1.3], np.float32)
    base = (rng.standard_normal(24) * 0.3).astype(np.float32)
    y, post, comb = ops.hc_pre(X, fn, scale, base, hc_mult=4, iters=20, hc_eps=1e-6,
                               norm_eps=1e-6, pol=BF)
    x = _t(X).flatten(1).float()
    mixes = torch.nn.functional.linear(x, _t(fn, torch.float32)) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes[:, :4] * scale[0] + _t(base[:4], torch.float32)) + 1e-6
    post_t = 2 * torch.sigmoid(mixes[:, 4:8] * scale[1] + _t(base[4:8], torch.float32))
    np.testing.assert_allclose(post, post_t.numpy(), rtol=1e-5)
    want = torch.sum(pre.unsqueeze(-1) * _t(X).float(), dim=1).to(bf16)
    _agree(y, want)
    f = _bf((8, 64))
    out = ops.hc_post(f, X, post, comb, pol=BF)
    pt, ct = _t(post, torch.float32), _t(comb, torch.float32)
    want = (pt.unsqueeze(-1) * _t(f).unsqueeze(-2) + torch.sum(ct.unsqueeze(-1) * _t(X).unsqueeze(-2), dim=1)).to(bf16)
    _agree(out, want)


def test_indexer_chain_as_M418():
    T, H, d, N = 6, 8, 128, 9
    x, wp = _bf((T, 256)), _bf((H, 256), 0.06)
    q, K = _bf((T, H, d)), _bf((N, d))
    w = ops.indexer_weights(x, wp, n_heads=H, head_dim=d, pol=BF)
    wt = torch.nn.functional.linear(_t(x), _t(wp)) * (d ** -0.5 * H ** -0.5)
    _agree(w, wt)
    s = ops.indexer_scores(q, w, K, pol=BF)
    st = torch.einsum("shd,td->sht", _t(q), _t(K))
    st = (st.relu_() * _t(w).unsqueeze(-1)).sum(dim=1)
    _agree(s, st, min_equal=0.95)


def test_compressor_pool_as_M331():
    nb, d = 5, 32
    a = (rng.standard_normal((nb * 4, 2 * d))).astype(np.float32)
    z = (rng.standard_normal((nb * 4, 2 * d))).astype(np.float32)
    got = ops.compress_pool(*ops.compress_candidates(a, z, 4), pol=BF)
    kv, sc = _t(a, torch.float32).view(1, nb, 4, 2 * d), _t(z, torch.float32).view(1, nb, 4, 2 * d)

    def overlap(t, value):   # M:307-314
        new = t.new_full((1, nb, 8, d), value)
        new[:, :, 4:] = t[:, :, :, d:]
        new[:, 1:, :4] = t[:, :-1, :, :d]
        return new

    want = (overlap(kv, 0) * overlap(sc, float("-inf")).softmax(dim=2)).sum(dim=2)[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
