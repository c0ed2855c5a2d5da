"""The device-resident decode step (paths ``device-hostmath`` and ``device``): StepWs, the
per-stage workspace arena, and the bytes one decode step must read.

``device_step(model, state, token, graph=None)`` runs the ``device`` path
(gpu.step_device.DeviceStep: StepWs arena, device-side indices, one CUDA graph per stage) or,
when ``model.decode_path == "device-hostmath"``, the same launches with the four islands (hc
split, router selection, indexer fine top-k, head gate) computed on the host by gpu.hostmath:
the byte-identity instrument against ``legacy`` (whose one-token dispatch,
gpu.decode.ChunkBlock.forward_one, runs the same kernels and the same islands).
Both run on the GPU machine (tests/gpu/test_decode_gpu.py: device-hostmath == legacy byte for
byte; device within the bf16 bounds, graph replay == eager; docs/semantics.md section 9).

``step_ws_plan(cfg, layers, has_embed, has_head, max_seq_len, stage_index=0) -> ArenaPlan``
    The per-stage arena of one decode step: every activation buffer of one token, sized once.
    Buffers are reused layer after layer (the step is layer-sequential), so the plan depends
    on the stage's layer KINDS, not on how many layers it holds.  ``tok`` / ``pos`` (int32)
    are the small device buffers written before a graph replay; ``streams.a`` / ``streams.b``
    ping-pong the residual streams; stages after the first get ``boundary.in`` (reserved: the
    step's memcpyAsync peer copy lands directly in that stage's ``streams.a``).  Logical dtypes
    per gpu.arena (bf16 = uint16 bits).
``step_bytes(cfg, pos, layers, has_embed, has_head, dense="bf16", experts="mxfp4")``
    -> dict group -> bytes the step at position ``pos`` must read: the weights one token
    touches (attention projections, compressor and indexer projections, norms and hc mixes,
    router gate, the k routed experts' STORED FP4 bytes + scales, the shared expert, embed row,
    head), the KV it attends (ring rows in the window, visible HCA rows / selected CSA rows,
    all indexer keys) and the pending compressor rows (kv + score, f32).  ``dense`` is the
    dense-projection storage (the ``MEMRA_DSV4_DENSE`` seam): "bf16" (FP8 linears dequantised
    at load) or "fp8" (as stored: 1 byte + one e8m0 scale per 128x128 block).
"""

from __future__ import annotations

from memra_dsv4.gpu.arena import ArenaPlan

__all__ = ["device_step", "device_greedy", "step_ws_plan", "step_bytes", "total_step_bytes"]


def device_step(model, state, token: int, *, graph: bool | None = None, readback: str = "logits",
                out=None):
    """One decode step of ``token`` at state.pos on the device path; logits f32 NumPy [vocab]
    (``readback="token"``: the greedy next token, int, the head's greedy_argmax_f32; ``out``: a
    float32 [vocab] array the logits are copied into and that is returned, checked by the
    caller, Dsv4Gpu.decode_step).
    graph None/True: replay the per-stage CUDA graphs (captured once per state); False: the
    same launches eagerly.  On ``device-hostmath`` the step always runs eagerly and without
    PDL, whatever ``graph`` says: its host round trips (read the island inputs, apply the host
    rule, upload the result) cannot be captured."""
    from memra_dsv4.oracle.decode import check_no_journal
    check_no_journal(state, "device_step")
    return _device_step_of(model, state).step(state, int(token), True if graph is None else bool(graph),
                                              readback=readback, out=out)


def device_greedy(model, state, token: int, n: int):
    """``n`` greedy steps from ``token`` at state.pos on the device path, the tokens fed on the
    device (gpu.step_device.DeviceStep.greedy); int32 NumPy [n], the picks."""
    from memra_dsv4.oracle.decode import check_no_journal
    check_no_journal(state, "device_greedy")
    return _device_step_of(model, state).greedy(state, int(token), int(n))


def _device_step_of(model, state):
    """The model's DeviceStep (StepWs arenas), made at its first use for the state's
    max_seq_len."""
    from memra_dsv4.gpu.step_device import DeviceStep
    if model._step is None:
        model._step = DeviceStep(model, state.max_seq_len)
    return model._step


# --------------------------------------------------------------------------- StepWs plan
def step_ws_plan(cfg, layers, has_embed: bool, has_head: bool, max_seq_len: int,
                 stage_index: int = 0) -> ArenaPlan:
    layers = list(layers)
    kinds = {cfg.attn_kind(l) for l in layers}
    ratios = sorted({cfg.compress_ratio(l) for l in layers} - {0})
    D, hc = cfg.hidden_size, cfg.hc_mult
    H, hd = cfg.num_attention_heads, cfg.head_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    W = cfg.sliding_window
    I, E, k = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    p = ArenaPlan(f"step_ws.stage{stage_index}")
    p.add("tok", (1,), "i32")
    p.add("pos", (1,), "i32")
    p.add("streams.a", (1, hc, D), "bf16")     # bf16 bits: the hc kernels' stream format
    p.add("streams.b", (1, hc, D), "bf16")
    if stage_index > 0:
        p.add("boundary.in", (1, hc, D), "bf16")
    p.add("hc.pre", (hc,), "f32")
    p.add("hc.post", (hc,), "f32")
    p.add("hc.comb", (hc, hc), "f32")
    p.add("x", (D,), "bf16")
    p.add("xn", (D,), "bf16")
    p.add("attn.qr", (cfg.q_lora_rank,), "bf16")
    p.add("attn.qrn", (cfg.q_lora_rank,), "bf16")   # the normed qr where it is not normed in place (MEMRA_DSV4_WQB_QNORM)
    p.add("attn.q", (H, hd), "bf16")
    # candidates: window W, then the widest compressed segment of this stage's layers
    n_keys = max(1, max_seq_len // 4)
    sel_w = min(cfg.index_topk, n_keys)
    kmax = W
    for r in ratios:
        kmax = max(kmax, W + (sel_w if r == 4 and "csa" in kinds else max(1, max_seq_len // r)))
        if r == 4:
            kmax = max(kmax, W + max(1, max_seq_len // 4))
    p.add("attn.cand", (kmax,), "i32")      # build_cand's list (decode_attn "split")
    if ratios:
        p.add("cmp.pooled", (hd,), "f32")
    if "csa" in kinds:
        p.add("idx.q", (nI, dI), "bf16")
        p.add("idx.w", (nI,), "bf16")
        p.add("idx.sel", (sel_w,), "i32")
    p.add("attn.o", (H, hd), "bf16")
    p.add("attn.u", (cfg.o_groups * cfg.o_lora_rank,), "bf16")
    p.add("attn.out", (D,), "bf16")
    p.add("moe.logits", (E,), "f32")
    p.add("moe.scores", (E,), "f32")
    p.add("moe.ids", (k,), "i32")
    p.add("moe.w", (k,), "f32")
    p.add("moe.h", (k, I), "bf16")
    p.add("moe.sh_h", (I,), "bf16")
    p.add("moe.shared", (D,), "bf16")
    p.add("ffn.out", (D,), "bf16")
    # device-step extras (gpu.step.DeviceStep)
    p.add("dev.aux", (8,), "i32")
    # the split-K workspace of either decode attention form: attention.workspace_size(1, H, hd, K)
    p.add("dev.attn_ws", (H * (-(-kmax // 32)) * (2 + hd),), "f32")
    p.add("dev.mix", (1, cfg.hc_mix_rows), "f32")
    p.add("dev.kvraw", (hd,), "bf16")
    if "csa" in kinds:
        p.add("dev.idx_pooled", (dI,), "f32")
        p.add("dev.idx_scores", (n_keys,), "bf16")
    if has_head:
        p.add("dev.head_mix", (1, hc), "f32")
        p.add("dev.head_pre", (1, hc), "f32")   # device-hostmath: the host's head gate
        p.add("head.y", (D,), "bf16")
        p.add("head.yn", (D,), "bf16")
        p.add("head.logits", (cfg.vocab_size,), "f32")
        # the greedy token history: entry p + 1 = the token the head's greedy_argmax_f32 picked at
        # position p (DeviceStep.greedy reads a call's entries back with one copy at its end)
        p.add("head.tok_hist", (max_seq_len + 1,), "i32")
    p.check()
    return p


# ------------------------------------------------------------------------- byte counting
def _dense(n_out: int, n_in: int, dense: str) -> int:
    if dense == "fp8":
        return n_out * n_in + (-(-n_out // 128)) * (-(-n_in // 128))
    if dense == "bf16":
        return 2 * n_out * n_in
    raise ValueError(f"dense = {dense!r}: expected 'bf16' or 'fp8'")


def _fp4(n_out: int, n_in: int, experts: str) -> int:
    if experts == "mxfp4":
        return n_out * n_in // 2 + n_out * n_in // 32
    if experts == "nvfp4":
        return n_out * n_in // 2 + n_out * n_in // 16 + 4
    raise ValueError(f"experts = {experts!r}: expected 'mxfp4' or 'nvfp4'")


def step_bytes(cfg, pos: int, layers, has_embed: bool, has_head: bool, *, dense: str = "bf16",
               experts: str = "mxfp4") -> dict[str, int]:
    D, hc = cfg.hidden_size, cfg.hc_mult
    H, hd = cfg.num_attention_heads, cfg.head_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    W, q = cfg.sliding_window, cfg.q_lora_rank
    I, E, k = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    og, orank = cfg.o_groups, cfg.o_lora_rank
    out = {"attn_weights": 0, "compressor_weights": 0, "indexer_weights": 0, "norm_hc": 0,
           "router": 0, "experts": 0, "shared": 0, "kv": 0, "pending": 0, "embed": 0, "head": 0}
    hc_fn = 4 * cfg.hc_mix_rows * hc * D + 4 * (cfg.hc_mix_rows + 3)
    for l in layers:
        r, kind = cfg.compress_ratio(l), cfg.attn_kind(l)
        out["attn_weights"] += (_dense(q, D, dense) + _dense(H * hd, q, dense)
                                + _dense(hd, D, dense) + _dense(og * orank, H * hd // og, dense)
                                + _dense(D, og * orank, dense) + 4 * H)
        out["norm_hc"] += 2 * hc_fn + 2 * (2 * D + q + hd)
        n_vis = (pos + 1) // r if r else 0
        out["kv"] += 2 * hd * min(pos + 1, W)
        if r:
            coff = 2 if r == 4 else 1
            out["compressor_weights"] += 2 * (2 * coff * hd * D) + 4 * r * coff * hd + 2 * hd
            out["pending"] += 2 * 4 * (coff * r) * (coff * hd)
        if kind == "csa":
            out["indexer_weights"] += (_dense(nI * dI, q, dense) + 2 * nI * D
                                       + 2 * (2 * 2 * dI * D) + 4 * 4 * 2 * dI + 2 * dI)
            out["pending"] += 2 * 4 * 8 * (2 * dI)
            out["kv"] += 2 * dI * n_vis + 2 * hd * min(cfg.index_topk, n_vis)
        elif r:
            out["kv"] += 2 * hd * n_vis
        out["router"] += 2 * E * D + (4 * E if not cfg.is_hash_layer(l) else 8 * k)
        out["experts"] += k * (2 * _fp4(I, D, experts) + _fp4(D, I, experts))
        out["shared"] += cfg.n_shared_experts * (2 * _dense(I, D, dense) + _dense(D, I, dense))
    if has_embed:
        out["embed"] += 2 * D
    if has_head:
        out["head"] += 2 * cfg.vocab_size * D + 2 * D + 4 * hc * hc * D + 4 * (hc + 1)
    return out


def total_step_bytes(cfg, pos: int, stages, *, dense: str = "bf16",
                     experts: str = "mxfp4") -> int:
    """Sum of step_bytes over ``stages`` = [(layers, has_embed, has_head), ...]."""
    return sum(sum(step_bytes(cfg, pos, ls, e, h, dense=dense, experts=experts).values())
               for ls, e, h in stages)
