"""Parity of the oracle's `exact` class with transformers' DeepseekV4ForCausalLM (float32).

The HF model is built from our Dsv4Config (layer_types from compress_ratios, compress_rates with
the preset's HCA ratio, nested main/compress rope parameters), loaded with the same synthetic
weights exactly dequantised (native -> HF names; strict load, and every HF parameter and
persistent buffer must be written exactly once), and run without a cache on whole prompts.

Where transformers departs from the official reference (docs/semantics.md, "transformers
differences"), the exact class is either unaffected (no QAT simulations in `exact`; a Hadamard
rotation of both indexer q and k leaves q.k unchanged; routing weight before/after w2 is the
same linear map) or we configure the oracle like HF (shared-expert clamp on, which is also the
current reference).  All-position logits must agree to relative L2 <= PARITY_REL_L2.

The MTP block, which transformers does not implement, is checked by running its weights through
one HF decoder layer (test_mtp_block_matches_transformers_layer).

Skips when torch/transformers are missing, unless MEMRA_DSV4_REQUIRE_PARITY=1 (then fails).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.oracle import Oracle
from memra_dsv4.synth import synth_arrays

# float32 HF vs float64 oracle: per-op relative error ~1e-7, a few hundred sequential ops and
# random-model gains of O(1) per block give ~1e-6..1e-5 on the logits; 1e-4 leaves margin and
# is far below any semantic slip (a wrong rope position, window edge or mask changes the
# logits by > 1e-2).
PARITY_REL_L2 = 1e-4

_REQUIRE = os.environ.get("MEMRA_DSV4_REQUIRE_PARITY", "0") == "1"
try:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
except Exception as e:  # pragma: no cover - environment dependent
    if _REQUIRE:
        raise RuntimeError(f"MEMRA_DSV4_REQUIRE_PARITY=1 but torch/transformers are unusable: {e}")
    pytest.skip(f"torch/transformers not available: {e}", allow_module_level=True)


# ------------------------------------------------------------------------ config mapping
def hf_config(cfg) -> "DeepseekV4Config":
    n = cfg.num_hidden_layers
    ratios = cfg.compress_ratios[:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    assert len(hca) <= 1, f"transformers has one HCA ratio per model; preset has {hca}"
    layer_types = ["sliding_attention" if r == 0 else
                   "compressed_sparse_attention" if r == 4 else
                   "heavily_compressed_attention" for r in ratios]
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    hc = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, partial_rotary_factor=prf,
        num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=1, moe_intermediate_size=cfg.moe_intermediate_size,
        routed_scaling_factor=cfg.routed_scaling_factor, scoring_func="sqrtsoftplus",
        norm_topk_prob=True, rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(l) else "moe" for l in range(n)],
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False, use_cache=False, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                     "partial_rotary_factor": prf},
            "compress": {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta,
                         "partial_rotary_factor": prf, "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_max_position_embeddings,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                         "attention_factor": 1.0},
        },
    )
    hc._attn_implementation = "eager"
    return hc


# native leaf -> HF leaf, per layer
_LAYER_MAP = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP_MAP = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
}


def hf_state_dict(ckpt) -> dict[str, "torch.Tensor"]:
    """Every native trunk tensor (scale sidecars folded in by dequant) under its HF name.
    Each native weight is used exactly once; anything unmapped fails."""
    cfg = ckpt.config
    sd: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def put(hf: str, native: str | list[str], value: np.ndarray) -> None:
        assert hf not in sd, f"HF parameter {hf} written twice"
        sd[hf] = torch.from_numpy(np.ascontiguousarray(value))
        used.update([native] if isinstance(native, str) else native)

    for native, hf in _TOP_MAP.items():
        put(hf, native, ckpt.dequant(native))
    E = cfg.n_routed_experts
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}"
        for leaf, hf in _LAYER_MAP.items():
            name = f"{p}.{leaf}"
            if name in ckpt:
                put(f"model.layers.{l}.{hf}", name, ckpt.dequant(name))
        w13 = [np.concatenate([ckpt.dequant(f"{p}.ffn.experts.{e}.w1.weight"),
                               ckpt.dequant(f"{p}.ffn.experts.{e}.w3.weight")], axis=0) for e in range(E)]
        put(f"model.layers.{l}.mlp.experts.gate_up_proj",
            [f"{p}.ffn.experts.{e}.w{i}.weight" for e in range(E) for i in (1, 3)], np.stack(w13))
        put(f"model.layers.{l}.mlp.experts.down_proj",
            [f"{p}.ffn.experts.{e}.w2.weight" for e in range(E)],
            np.stack([ckpt.dequant(f"{p}.ffn.experts.{e}.w2.weight") for e in range(E)]))
    trunk = {n for n in ckpt.names() if not n.startswith("mtp.")
             and not n.endswith(".scale")}
    missing = sorted(trunk - used)
    assert not missing, f"native trunk tensors not mapped to HF: {missing[:10]}"
    return sd


def build_hf(ckpt):
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_config(ckpt.config)).float().eval()
    sd = hf_state_dict(ckpt)
    expected = set(model.state_dict().keys())
    assert set(sd) == expected, (f"unexpected: {sorted(set(sd) - expected)[:10]}; "
                                 f"missing: {sorted(expected - set(sd))[:10]}")
    result = model.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in model.state_dict().items():  # loaded verbatim (no dtype surprises)
        assert torch.equal(v, sd[k].to(v.dtype)), k
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.scorer.register_forward_hook(_lower_index_wins)
    return model


def _lower_index_wins(module, args, scores):
    """Difference T1 (docs/semantics.md): torch.topk breaks exact ties arbitrarily; the
    reference rule here is "score descending, then lower index".  Exact ties are common: an
    entry whose q.k is negative for every indexer head scores ReLU -> exactly 0.  HF uses the
    scores only for its top-k, so subtracting k * 2^-100 (far below one ulp of any nonzero
    score, but enough to order exact zeros) makes torch pick what the oracle picks."""
    k = torch.arange(scores.shape[-1], dtype=scores.dtype)
    return scores - k * 2.0 ** -100


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# tiny: window 8 (wrap at t=8), CSA emits at t=3, HCA (r=16) at t=15, index_topk=2 drops from
# t=11.  small: window 32, HCA r=32 (t=31), top-k 8 drops from t=35.
CASES = {
    "tiny": [(0, [1, 4, 9, 16]), (1, [12, 33]), (2, [40])],
    "small": [(0, [36])],
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    cfg = preset(request.param)
    out = []
    for seed, lengths in CASES[request.param]:
        ckpt = Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed))
        out.append((seed, lengths, ckpt, Oracle(ckpt, "exact"), build_hf(ckpt)))
    return cfg, out


def test_logits_match_transformers(pair):
    cfg, runs = pair
    for seed, lengths, ckpt, oracle, model in runs:
        for L in lengths:
            ids = np.random.default_rng(1000 * seed + L).integers(0, cfg.vocab_size, L)
            ours = oracle.prefill(ids, all_logits=True).logits
            with torch.no_grad():
                theirs = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].numpy()
            err = rel_l2(ours, theirs)
            print(f"{cfg.name} seed {seed} L={L}: rel L2 {err:.3g}")
            assert err <= PARITY_REL_L2, f"{cfg.name} seed {seed} L={L}: rel L2 {err:.3g}"


def test_parity_is_sensitive():
    """The bound is meaningful: the initial-revision shared expert (no clamp) or a one-token
    shift of the window must be visible far above PARITY_REL_L2."""
    cfg = preset("tiny")
    ckpt = Checkpoint.from_arrays(cfg, synth_arrays(cfg, 3))
    model = build_hf(ckpt)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 14)
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].numpy()
    good = Oracle(ckpt, "exact").prefill(ids, all_logits=True).logits
    assert rel_l2(good, theirs) <= PARITY_REL_L2
    narrow = Oracle(Checkpoint.from_arrays(cfg.replace(sliding_window=7), synth_arrays(cfg, 3)),
                    "exact").prefill(ids, all_logits=True).logits
    assert rel_l2(narrow, theirs) > 100 * PARITY_REL_L2


# ----------------------------------------------------------------------------- MTP block
def test_mtp_block_matches_transformers_layer():
    """transformers has no MTP module (difference T20), but the MTP block is a plain decoder
    layer (layer id n_layers: sliding window, learned routing) with its own hc_head and norm
    and the trunk's embed/head.  Build a one-layer HF model from the mtp.0 weights, compute the
    MTP input h0 = h_proj(hnorm(streams)) + e_proj(enorm(embed[next])) in torch (M:760-764),
    run the HF layer with a sliding causal mask at positions 0..S-1, and compare logits."""
    cfg = preset("tiny")
    ckpt = Checkpoint.from_arrays(cfg, synth_arrays(cfg, 4))
    oracle = Oracle(ckpt, "exact")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 13)
    trunk = oracle.prefill(ids[:-1], all_logits=True)
    ours = oracle.mtp_forward(trunk.streams, ids[1:]).logits

    one = cfg.replace(num_hidden_layers=1, compress_ratios=(0, 0), num_hash_layers=0)
    model = DeepseekV4ForCausalLM(hf_config(one)).float().eval()
    d = lambda n: torch.from_numpy(np.ascontiguousarray(ckpt.dequant(n)))
    sd = {}
    for leaf, hf in _LAYER_MAP.items():
        if f"mtp.0.{leaf}" in ckpt:
            sd[f"model.layers.0.{hf}"] = d(f"mtp.0.{leaf}")
    E = cfg.n_routed_experts
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([d(f"mtp.0.ffn.experts.{e}.w1.weight"), d(f"mtp.0.ffn.experts.{e}.w3.weight")]) for e in range(E)])
    sd["model.layers.0.mlp.experts.down_proj"] = torch.stack([d(f"mtp.0.ffn.experts.{e}.w2.weight") for e in range(E)])
    sd.update({"model.embed_tokens.weight": d("embed.weight"), "lm_head.weight": d("head.weight"),
               "model.norm.weight": d("mtp.0.norm.weight"), "model.hc_head.hc_fn": d("mtp.0.hc_head_fn"),
               "model.hc_head.hc_base": d("mtp.0.hc_head_base"),
               "model.hc_head.hc_scale": d("mtp.0.hc_head_scale")})
    assert set(sd) == set(model.state_dict())
    model.load_state_dict(sd, strict=True)

    eps = cfg.rms_norm_eps
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    X = torch.from_numpy(trunk.streams.astype(np.float32))
    nxt = torch.from_numpy(ids[1:])
    e = rms(d("embed.weight")[nxt], d("mtp.0.enorm.weight"))
    z = rms(X, d("mtp.0.hnorm.weight"))
    h0 = (z @ d("mtp.0.h_proj.weight").T + (e @ d("mtp.0.e_proj.weight").T)[:, None])[None]
    S, W = h0.shape[1], cfg.sliding_window
    i = torch.arange(S)
    ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    mask = torch.where(ok, 0.0, float("-inf"))[None, None]
    pos = i[None]
    with torch.no_grad():
        pe = {k: model.model.rotary_emb(h0[:, :, 0], position_ids=pos, layer_type=k)
              for k in ("main", "compress")}
        out = model.model.layers[0](h0, input_ids=nxt[None], position_embeddings=pe,
                                    position_ids=pos, attention_mask=mask, cache=None)
        theirs = model.lm_head(model.model.norm(model.model.hc_head(out)))[0].numpy()
    err = rel_l2(ours, theirs)
    print(f"MTP block: rel L2 {err:.3g}")
    assert err <= PARITY_REL_L2, f"MTP block rel L2 {err:.3g}"
    # sensitivity: the trunk streams of the wrong position (shifted by one) are far off
    shifted = oracle.mtp_forward(np.roll(trunk.streams, 1, axis=0), ids[1:]).logits
    assert rel_l2(shifted, theirs) > 100 * PARITY_REL_L2
