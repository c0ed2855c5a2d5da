"""Token sampling and the speculative-sampling acceptance rule (lossless).

Contract
--------
``sampling_probs(logits, temperature=1.0, top_p=1.0) -> float64 probs``
    Over the last axis.  temperature == 0: one-hot on the argmax (ties -> the lowest id).
    Otherwise softmax(logits / temperature) in float64, then nucleus (top-p) truncation: tokens
    sorted by probability descending (ties -> lower id first); keep the shortest prefix whose
    mass reaches top_p (the token that crosses top_p is kept; always >= 1 token); renormalise.
    logits may hold -inf (probability 0) but no NaN / +inf, and each row needs a finite value.
``sample(logits, temperature=1.0, top_p=1.0, generator=None) -> int`` (or int64 [..] for
    batched logits).  temperature == 0 is greedy (no randomness used).  Otherwise one
    ``generator.random()`` per row, inverse CDF over ``sampling_probs`` (a token of probability
    0 is never returned).  ``generator``: a numpy ``Generator`` (None -> a fresh unseeded one).
``spec_accept(target_probs, draft_probs, drafts, generator) -> (n_accepted, next_token)``
    Speculative sampling (Leviathan et al. 2023; Chen et al. 2023; dsv4_speculative.md 2.6/4.1).
    ``target_probs`` [k+1, V]: the target's distribution at the k+1 verified positions (row i
    conditions on the prefix plus drafts d_1..d_i); ``draft_probs`` [k, V]: the drafter's
    distribution each draft d_{i+1} was sampled from; ``drafts`` [k].  For i = 0..k-1: accept
    d_{i+1} with probability min(1, p_i(d)/q_i(d)) (u < p/q with u ~ U[0,1)); at the first
    rejection return (i, a sample of the residual norm(max(p_i - q_i, 0))); if all k are
    accepted return (k, a sample of p_k) (the bonus token).  The tokens emitted are then
    drafts[:n] + [next_token], distributed exactly as sampling from the target token by token
    (tests/test_sampling.py checks this with a chi-square test).  With one-hot p and q (greedy
    target and drafter) it reduces to "accept iff the draft is the target's argmax".
``greedy(logits)``: argmax, ties -> the lowest id.
``chi2_sf(x, df)``: chi-square survival function (regularised upper incomplete gamma), for the
    statistical tests (no scipy here).

Bad input raises ValueError naming the problem.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["sampling_probs", "sample", "greedy", "spec_accept", "sample_from_probs", "chi2_sf"]


# ----------------------------------------------------------------------------- checks
def _logits(logits) -> np.ndarray:
    a = np.asarray(logits)
    if a.dtype.kind != "f":
        raise ValueError(f"logits must be floating point, got dtype {a.dtype}")
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"logits must be [..., vocab] with vocab >= 1, got shape {a.shape}")
    if np.isnan(a).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(a).any():
        raise ValueError("logits contain +inf")
    if not np.isfinite(a).any(axis=-1).all():
        raise ValueError("a row of logits has no finite value (every token is -inf)")
    return a.astype(np.float64)


def _temperature(t) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise ValueError(f"temperature must be a number, got {t!r}")
    t = float(t)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {t}")
    return t


def _top_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise ValueError(f"top_p must be a number, got {p!r}")
    p = float(p)
    if not (0.0 < p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return p


def _generator(g) -> np.random.Generator:
    if g is None:
        return np.random.default_rng()
    if not isinstance(g, np.random.Generator):
        raise ValueError(f"generator must be a numpy.random.Generator, got {type(g).__name__}")
    return g


# ---------------------------------------------------------------------------- probs
def greedy(logits):
    """Argmax over the last axis; ties -> the lowest id (np.argmax's rule)."""
    a = _logits(logits)
    r = np.argmax(a, axis=-1)
    return int(r) if np.ndim(r) == 0 else r.astype(np.int64)


def sampling_probs(logits, temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
    """The distribution ``sample`` draws from (module doc), float64, same shape as logits."""
    a = _logits(logits)
    t = _temperature(temperature)
    tp = _top_p(top_p)
    if t == 0.0:
        out = np.zeros_like(a)
        idx = np.argmax(a, axis=-1)
        np.put_along_axis(out, idx[..., None], 1.0, axis=-1)
        return out
    z = a / t
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=-1, keepdims=True)
    if tp < 1.0:
        V = p.shape[-1]
        flat = p.reshape(-1, V)
        out = np.zeros_like(flat)
        ids = np.arange(V)
        for i, row in enumerate(flat):
            order = np.lexsort((ids, -row))         # probability descending, then lower id
            srt = row[order]
            before = np.cumsum(srt) - srt            # mass strictly before each token
            keep = order[before < tp]
            keep = keep[row[keep] > 0] if (row[keep] > 0).any() else keep[:1]
            out[i, keep] = row[keep]
            out[i] /= out[i].sum()
        p = out.reshape(p.shape)
    return p


def sample_from_probs(probs, generator: np.random.Generator) -> int:
    """One id from a 1-D distribution (inverse CDF; zero-probability ids are never chosen)."""
    p = np.asarray(probs, dtype=np.float64)
    c = np.cumsum(p)
    u = generator.random() * c[-1]
    i = int(np.searchsorted(c, u, side="right"))
    nz = np.flatnonzero(p > 0)
    if i >= p.shape[0] or p[i] <= 0:                 # u at the very top (rounding)
        i = int(nz[-1]) if i >= p.shape[0] else int(nz[np.searchsorted(nz, i)])
    return i


def sample(logits, temperature: float = 1.0, top_p: float = 1.0, generator=None):
    """Sample one id per row of ``logits`` (module doc)."""
    p = sampling_probs(logits, temperature, top_p)
    if _temperature(temperature) == 0.0:
        r = np.argmax(p, axis=-1)
        return int(r) if np.ndim(r) == 0 else r.astype(np.int64)
    g = _generator(generator)
    if p.ndim == 1:
        return sample_from_probs(p, g)
    flat = p.reshape(-1, p.shape[-1])
    return np.array([sample_from_probs(row, g) for row in flat], dtype=np.int64).reshape(p.shape[:-1])


# ------------------------------------------------------------------- speculative rule
def _probs_rows(x, name: str, rows: int, V: int | None) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64) if np.asarray(x).dtype.kind == "f" else None
    if a is None:
        raise ValueError(f"{name} must be floating point probabilities")
    if a.ndim != 2 or a.shape[0] != rows or (V is not None and a.shape[1] != V):
        want = f"[{rows}, {V if V is not None else 'V'}]"
        raise ValueError(f"{name} must have shape {want}, got {a.shape}")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ValueError(f"{name} must be finite and >= 0")
    s = a.sum(axis=1)
    if (np.abs(s - 1.0) > 1e-6).any():
        raise ValueError(f"{name}: rows must sum to 1 (row sums {s.min():.6g}..{s.max():.6g})")
    return a


def spec_accept(target_probs, draft_probs, drafts, generator=None) -> tuple[int, int]:
    """(n_accepted, next_token) for one speculative round (module doc)."""
    d = np.asarray(drafts)
    if d.ndim != 1 or d.dtype.kind not in "iu":
        raise ValueError(f"drafts must be a 1-D integer array, got {d.dtype} {d.shape}")
    k = d.shape[0]
    p = _probs_rows(target_probs, "target_probs", k + 1, None)
    V = p.shape[1]
    q = _probs_rows(draft_probs, "draft_probs", k, V)
    if ((d < 0) | (d >= V)).any():
        raise ValueError(f"drafts outside 0..{V - 1}")
    g = _generator(generator)
    for i in range(k):
        t = int(d[i])
        if q[i, t] <= 0:
            raise ValueError(f"draft {i} (token {t}) has draft probability 0: it cannot have "
                             f"been sampled from draft_probs[{i}]")
        u = g.random()
        if u * q[i, t] < p[i, t]:                     # u < min(1, p/q)
            continue
        res = np.maximum(p[i] - q[i], 0.0)
        if res.sum() <= 0:                            # p == q up to rounding: cannot reject
            res = p[i]
        return i, sample_from_probs(res / res.sum(), g)
    return k, sample_from_probs(p[k], g)


# ------------------------------------------------------------------------ statistics
def _gammainc_lower_reg(a: float, x: float) -> float:
    """P(a, x) by its series (x < a + 1)."""
    term = 1.0 / a
    s = term
    n = a
    for _ in range(10000):
        n += 1.0
        term *= x / n
        s += term
        if abs(term) < abs(s) * 1e-16:
            break
    return s * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gammainc_upper_reg(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction (x >= a + 1; modified Lentz)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    dd = 1.0 / b
    h = dd
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        dd = an * dd + b
        dd = tiny if abs(dd) < tiny else dd
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        dd = 1.0 / dd
        delta = dd * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    if df < 1:
        raise ValueError(f"chi2_sf: df must be >= 1, got {df}")
    if x <= 0:
        return 1.0
    a, y = df / 2.0, x / 2.0
    if y < a + 1.0:
        return 1.0 - _gammainc_lower_reg(a, y)
    return _gammainc_upper_reg(a, y)
