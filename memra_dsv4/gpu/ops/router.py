"""MoE router ops (kernels_cu/router.cu).

logits(x, w_gate)              twin oracle.ops.router_logits (f32 out, double accumulation)
select(logits, k, route_scale, bias=... | tid2eid=..., token_ids=...)
                               twin host.routing.route: (idx int32 [T, k], weights f32 [T, k],
                               scores f32 [T, E]); the twin's idx is int64, the values are equal.
fused(x, w_gate, k, route_scale, bias=... | tid2eid=..., token_ids=...)
                               decode (T = 1): logits + select in ONE launch, the same bits as
                               logits() then select() (router_fused_e*: same per-row reduction
                               order, same selection code); the last CTA selects, through a
                               per-device ticket counter (workspace(), made before any capture);
                               handoff="cluster" (E <= 256, cluster_ok): router_cluster_e*, one
                               thread-block cluster whose rank-0 CTA receives the scores in its
                               shared memory (DSMEM: st.async on its mbarrier): no counter, no
                               fence, no global round trip; the same bits.
tid2eid for the hash layers is int32 [V, k] (the checkpoint's int64, converted at load).
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import (check, dynamic_smem, i32, kernel, null_or, out_array,
                                        ticket_counter)

STEM = "router"
_SELECT = {32: "router_select_e32", 64: "router_select_e64", 128: "router_select_e128",
           256: "router_select_e256", 384: "router_select_e384", 512: "router_select_e512"}
_FUSED = {c: n.replace("router_select", "router_fused") for c, n in _SELECT.items()}
_CLUSTER = {c: n.replace("router_select", "router_cluster") for c, n in _SELECT.items() if c <= 256}
KERNELS = ("router_logits_bf16",) + tuple(_SELECT.values()) + tuple(_FUSED.values()) + tuple(_CLUSTER.values())
kernel_loader.register(STEM, KERNELS, cluster=tuple(_CLUSTER.values()))
HANDOFFS = ("ticket", "cluster")

KMAX = 16
FUSED_ROWS_PER_CTA = 4  # kernels_cu/router.cu RF_WARPS
CLUSTER_ROWS_PER_CTA = 16  # kernels_cu/router.cu RC_WARPS: one row per warp, 512 threads
CLUSTER_MAX_CTAS = 16      # the largest (non-portable) cluster of an H100 / H200
_WS: dict[int, object] = {}  # device -> int32 [1] ticket counter of router_fused_* (kept 0)


FUSED_ROWS_MAX = 8   # router.fused's tokens per launch (ticket form; the device verify's ROW_MAX)


def workspace():
    """The current device's ticket counters of router_fused_* (_common.ticket_counter: int32
    [FUSED_ROWS_MAX], one per row of a multi-row launch, zero between launches; made before the
    first capture by DeviceStep._prewarm)."""
    return ticket_counter(_WS, "router.workspace", FUSED_ROWS_MAX)


def logits(x, w_gate, out=None):
    """x [T, D] bf16; w_gate [E, D] bf16 -> out [T, E] f32."""
    check(x, "router.logits.x", np.uint16)
    T, D = x.shape
    assert D % 8 == 0, f"router.logits: D = {D} must be a multiple of 8"
    E = w_gate.shape[0]
    check(w_gate, "router.logits.w_gate", np.uint16, (E, D))
    out = out_array(out, "router.logits.out", (T, E), np.float32)
    if T and E:
        kernel(STEM, "router_logits_bf16")(((E + 7) // 8, (T + 3) // 4), (256,),
                                           (x, w_gate, out, i32(T), i32(D), i32(E)))
    return out


def select(logits, k: int, route_scale: float, *, bias=None, tid2eid=None, token_ids=None,
           idx=None, weights=None, scores=None, want_scores: bool = True):
    """Learned (bias [E] f32) or hash (tid2eid [V, k] int32 + token_ids [T] int32) routing.
    Returns (idx int32 [T, k], weights f32 [T, k], scores f32 [T, E] or None)."""
    check(logits, "router.select.logits", np.float32)
    T, E = logits.shape
    assert 1 <= k <= min(KMAX, E), f"router.select: k = {k} outside 1..{min(KMAX, E)}"
    assert (bias is None) != (tid2eid is None), "router.select: give exactly one of bias / tid2eid"
    if bias is not None:
        check(bias, "router.select.bias", np.float32, (E,))
    else:
        check(tid2eid, "router.select.tid2eid", np.int32, (None, k))
        check(token_ids, "router.select.token_ids", np.int32, (T,))
    cap = next((c for c in sorted(_SELECT) if c >= E), None)
    assert cap is not None, f"router.select: E = {E} > {max(_SELECT)}"
    idx = out_array(idx, "router.select.idx", (T, k), np.int32)
    weights = out_array(weights, "router.select.weights", (T, k), np.float32)
    if want_scores or scores is not None:
        scores = out_array(scores, "router.select.scores", (T, E), np.float32)
    if T:
        kernel(STEM, _SELECT[cap])(((T + 3) // 4,), (128,),
                                   (logits, null_or(bias), null_or(tid2eid), null_or(token_ids), idx, weights,
                                    null_or(scores), i32(T), i32(E), i32(k), np.float32(route_scale)))
    return idx, weights, scores


def cluster_ok(E: int) -> bool:
    """Whether router_cluster_* covers E experts: one row per warp of at most CLUSTER_MAX_CTAS
    CTAs of CLUSTER_ROWS_PER_CTA warps (E <= 256)."""
    return 1 <= E <= CLUSTER_ROWS_PER_CTA * CLUSTER_MAX_CTAS


def cluster_ctas(E: int) -> int:
    """CTAs of router_cluster_*'s one cluster for E experts (each holds a whole SM: 512 threads
    x ~110 registers)."""
    return (E + CLUSTER_ROWS_PER_CTA - 1) // CLUSTER_ROWS_PER_CTA


def fused(x, w_gate, k: int, route_scale: float, *, bias=None, tid2eid=None, token_ids=None,
          logits=None, scores=None, idx=None, weights=None, counter=None, handoff: str = "ticket"):
    """One token (x [1, D] bf16, w_gate [E, D] bf16): logits [1, E] f32, then learned (bias [E]
    f32) or hash (tid2eid [V, k] int32 + token_ids [1] int32) routing, in one launch.  Returns
    (idx int32 [1, k], weights f32 [1, k], scores f32 [1, E], logits f32 [1, E]), bit-identical
    to logits() + select().  handoff "ticket": router_fused_* (its last CTA selects; counter:
    int32 [T] (>= T entries), zero, default workspace()); "cluster": router_cluster_* (one
    cluster of ceil(E / 16) CTAs, E <= 256: cluster_ok; no counter, so none may be given).
    With "ticket", T <= FUSED_ROWS_MAX tokens, each routed alone, in one launch (grid.y = T; the
    device verify's rows): x [T, D], token_ids [T], outputs with a leading T (C-contiguous), row
    t the bytes of a one-token launch."""
    if handoff not in HANDOFFS:
        raise ValueError(f"router.fused: handoff {handoff!r} is not one of {HANDOFFS}")
    if handoff == "cluster" and counter is not None:
        raise ValueError("router.fused: handoff 'cluster' takes no ticket counter")
    check(x, "router.fused.x", np.uint16)
    T, D = x.shape
    rows_max = FUSED_ROWS_MAX if handoff == "ticket" else 1
    assert 1 <= T <= rows_max, (f"router.fused: one token (decode) with handoff {handoff!r}, got T = {T}"
                                if rows_max == 1 else f"router.fused: {T} tokens, expected 1..{rows_max}; "
                                "use logits() + select()")
    assert D % 8 == 0 and x.data.ptr % 16 == 0, f"router.fused: D = {D} % 8, 16-byte aligned x"
    E = w_gate.shape[0]
    check(w_gate, "router.fused.w_gate", np.uint16, (E, D))
    assert w_gate.data.ptr % 16 == 0, "router.fused.w_gate: 16-byte alignment"
    assert 1 <= k <= min(KMAX, E), f"router.fused: k = {k} outside 1..{min(KMAX, E)}"
    assert (bias is None) != (tid2eid is None), "router.fused: give exactly one of bias / tid2eid"
    if bias is not None:
        check(bias, "router.fused.bias", np.float32, (E,))
    else:
        check(tid2eid, "router.fused.tid2eid", np.int32, (None, k))
        check(token_ids, "router.fused.token_ids", np.int32, (T,))
    cap = next((c for c in sorted(_FUSED) if c >= E), None)
    assert cap is not None, f"router.fused: E = {E} > {max(_FUSED)}"
    if handoff == "cluster" and not cluster_ok(E):
        raise ValueError(f"router.fused: handoff 'cluster' covers E <= {CLUSTER_ROWS_PER_CTA * CLUSTER_MAX_CTAS} "
                         f"experts (one row per warp, one cluster), got E = {E}; use handoff 'ticket'")
    logits = out_array(logits, "router.fused.logits", (T, E), np.float32)
    scores = out_array(scores, "router.fused.scores", (T, E), np.float32)
    idx = out_array(idx, "router.fused.idx", (T, k), np.int32)
    weights = out_array(weights, "router.fused.weights", (T, k), np.float32)
    # the two kernels take the same arguments, router_fused_* with the ticket counter before D
    head = (x, w_gate, null_or(bias), null_or(tid2eid), null_or(token_ids), logits, scores, idx, weights)
    tail = (i32(D), i32(E), i32(k), np.float32(route_scale))
    if handoff == "cluster":
        kern = kernel(STEM, _CLUSTER[cap])
        n_cta = cluster_ctas(E)
        kern((n_cta,), (32 * CLUSTER_ROWS_PER_CTA,), head + tail, shared_mem=dynamic_smem(kern, 2 * D),
             cluster=(n_cta, 1, 1))
    else:
        if counter is None:
            counter = workspace()
        else:
            check(counter, "router.fused.counter", np.int32)
            assert counter.ndim == 1 and counter.size >= T, (
                f"router.fused.counter: {counter.shape}, expected int32 [>= {T}] (a ticket per row)")
        kern = kernel(STEM, _FUSED[cap])
        kern(((E + FUSED_ROWS_PER_CTA - 1) // FUSED_ROWS_PER_CTA, T), (32 * FUSED_ROWS_PER_CTA,),
             head + (counter,) + tail, shared_mem=dynamic_smem(kern, 2 * D))
    return idx, weights, scores, logits
