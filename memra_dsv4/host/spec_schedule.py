"""Confidence-scheduled verification length for DSpark drafts (dsv4_speculative.md 2.6; the
DSpark paper's Alg. 1 reduced to one request).  A host rule: the oracle's speculative loop and
a GPU loop choose the verify length with this one function.

Contract
--------
``survival(conf_logits) -> a`` (float64 [B]): conf_k = sigmoid(confidence logit k) is the
drafter's estimate of P(draft k+1 survives | drafts <= k accepted).  conf_k is computed from
h_k and the embedding of out[k], the token BEFORE draft k+1, so it never looks at the draft it
scores.  a_j = prod_{i < j} conf_i is the estimated probability that drafts 1..j are all
accepted (a_1 = conf_0).

``expected_tokens(a, n) = 1 + sum_{j <= n} a_j``: tokens emitted by a verify of n drafts
(accepted drafts + the bonus).

``verify_length(conf_logits, cost=None, max_drafts=None, min_drafts=1) -> n``
    Scan n = min_drafts .. N (N = min(B, max_drafts)) and keep extending while the expected
    throughput expected_tokens(a, n) / cost(n + 1) rises; **stop at the first n where it
    drops** (not a global argmax: a global search would let a late confidence, which depends
    on earlier drafts' values, pull in drafts after a drop; the paper's Appendix A shows that
    this biases the output distribution; the first-drop rule keeps the causal barrier).
    ``cost(t)`` is the time of a verify of t tokens (any positive unit); None = constant,
    i.e. batch-1 verification is weight-bandwidth bound, so every drafted token is worth
    verifying and n = N.  Ties keep the shorter length.
    The length depends only on the confidences and the cost model, never on the drafts'
    values or the target, so any schedule is lossless under the min(1, p/q) acceptance rule
    (greedy: the emitted tokens equal plain greedy decoding).
Refused (ValueError naming the problem): a non-1-D or empty confidence vector, a non-finite
logit, min_drafts outside 1..N, a cost that is not positive and finite.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["survival", "expected_tokens", "verify_length"]


def _conf(conf_logits) -> np.ndarray:
    c = np.asarray(conf_logits, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"confidence logits: expected a non-empty 1-D vector, got shape {c.shape}")
    if not np.isfinite(c).all():
        raise ValueError(f"confidence logits: non-finite value at draft "
                         f"{int(np.flatnonzero(~np.isfinite(c))[0])}")
    return c


def survival(conf_logits) -> np.ndarray:
    c = _conf(conf_logits)
    conf = 1.0 / (1.0 + np.exp(-c))
    return np.cumprod(conf)


def expected_tokens(a, n: int) -> float:
    a = np.asarray(a, dtype=np.float64)
    if not 0 <= n <= a.size:
        raise ValueError(f"expected_tokens: n = {n} outside 0..{a.size}")
    return 1.0 + float(a[:n].sum())


def verify_length(conf_logits, cost: Callable[[int], float] | None = None,
                  max_drafts: int | None = None, min_drafts: int = 1) -> int:
    a = survival(conf_logits)
    N = a.size if max_drafts is None else min(a.size, int(max_drafts))
    if not 1 <= min_drafts <= max(N, 0):
        raise ValueError(f"verify_length: min_drafts = {min_drafts} outside 1..{N}")
    if cost is None:
        return N

    def rate(n: int) -> float:
        t = float(cost(n + 1))
        if not (np.isfinite(t) and t > 0.0):
            raise ValueError(f"verify_length: cost({n + 1}) = {t!r}; a verify cost must be "
                             f"positive and finite")
        return expected_tokens(a, n) / t

    n, best = min_drafts, rate(min_drafts)
    while n < N:
        nxt = rate(n + 1)
        if nxt <= best:      # the first drop (or tie) ends the scan
            break
        n, best = n + 1, nxt
    return n
