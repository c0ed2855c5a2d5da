"""The bytes a batched speculative verify must read: what a multi-row verify step could cost at
best, relative to a decode step (gpu.step.step_bytes), and so what speculation can gain at
batch 1 on an MoE model.

Contract (pure Python, no CuPy; CPU-tested in tests/test_verify_bytes_cpu.py)
------------------------------------------------------------------------------
``distinct_experts(n_experts, k, t) -> float``
    The expected number of distinct routed experts t rows pick when each row picks k of E
    uniformly without replacement, independently: E (1 - (1 - k/E)^t).  t = 1 gives k.
``verify_bytes(cfg, pos, t, layers, has_embed, has_head, dense="bf16", experts="mxfp4")``
    -> dict group -> bytes of ONE verify of t rows at positions pos..pos+t-1 that reads every
    weight once for all its rows (the form a multi-row device step would have; the chunk routine
    the GPU verifies with today is host-paced far above it, docs/speculative_gpu.md): the groups
    of ``step_bytes`` at position pos + t - 1 (the last row's KV reach: the window, HCA and
    indexer key rows are shared by the rows; one row's top-k selection, the lower end of their
    union), with ``experts`` scaled from k to ``distinct_experts(E, k, t)`` per layer (hash
    layers too: tid2eid of t different tokens), the embedding rows t times; everything else
    once.
``verify_cost_model(cfg, pos, stages, dense="bf16", experts="mxfp4") -> cost(t)``
    cost(t) = total verify_bytes(t) / total step_bytes at the same pos, over ``stages`` =
    [(layers, has_embed, has_head), ...]: a ``cost`` for host.spec_schedule.verify_length and
    ``speculative_generate(schedule=...)`` (cost(1) = 1).  A MODEL, not a bound: real routing is
    not uniform (consecutive tokens share experts more often, which lowers the cost), and a
    verify's rows may select different CSA blocks (which raises it a little).
``expected_speedup(accept, n, cost) -> float``
    Tokens per unit time of a round of n drafts with i.i.d. per-draft acceptance ``accept``
    against plain decoding: E[tokens] / cost(n + 1), E[tokens] = (1 - a^(n+1)) / (1 - a).
"""

from __future__ import annotations

from typing import Callable

from memra_dsv4.gpu.step import step_bytes

__all__ = ["distinct_experts", "verify_bytes", "verify_cost_model", "expected_speedup"]


def _check_t(t) -> int:
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"t = {t!r}: a verify holds an integer number >= 1 of rows")
    return t


def distinct_experts(n_experts: int, k: int, t: int) -> float:
    _check_t(t)
    if not 1 <= k <= n_experts:
        raise ValueError(f"k = {k} experts per row outside 1..{n_experts}")
    return n_experts * (1.0 - (1.0 - k / n_experts) ** t)


def verify_bytes(cfg, pos: int, t: int, layers, has_embed: bool, has_head: bool, *,
                 dense: str = "bf16", experts: str = "mxfp4") -> dict[str, float]:
    _check_t(t)
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
        raise ValueError(f"pos = {pos!r}: the first verified row's position, >= 0")
    out: dict[str, float] = dict(step_bytes(cfg, pos + t - 1, layers, has_embed, has_head,
                                            dense=dense, experts=experts))
    k = cfg.num_experts_per_tok
    out["experts"] = out["experts"] * distinct_experts(cfg.n_routed_experts, k, t) / k
    out["embed"] = out["embed"] * t
    return out


def verify_cost_model(cfg, pos: int, stages, *, dense: str = "bf16",
                      experts: str = "mxfp4") -> Callable[[int], float]:
    stages = [(ls, bool(e), bool(h)) for ls, e, h in stages]
    step = sum(sum(step_bytes(cfg, pos, ls, e, h, dense=dense, experts=experts).values())
               for ls, e, h in stages)

    def cost(t: int) -> float:
        return sum(sum(verify_bytes(cfg, pos, t, ls, e, h, dense=dense,
                                    experts=experts).values()) for ls, e, h in stages) / step
    return cost


def expected_speedup(accept: float, n: int, cost: Callable[[int], float]) -> float:
    if not 0.0 <= accept < 1.0:
        raise ValueError(f"accept = {accept!r}: a per-draft acceptance probability in [0, 1)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n = {n!r} drafts: an integer >= 0")
    tokens = (1.0 - accept ** (n + 1)) / (1.0 - accept)
    return tokens / cost(n + 1)
