"""The expected-tensor table: every tensor a config implies, with shape, stored dtype and owner.

Contract
--------
`expected_tensors(cfg, experts="mxfp4")` returns the exact inventory of a DeepSeek-V4
checkpoint in the official native naming (no `model.` prefix), in a stable order:
embedding, trunk layers 0..n-1, head group, drafter stages.  It is the single source of truth
for the census (what a checkpoint must contain), for synthetic checkpoints (what to write),
for placement (bytes per layer), and for the oracle and GPU loaders (which names exist).

* `experts="mxfp4"`: official release.  Routed experts are I8-packed e2m1 + one F8_E8M0
  `.scale` per 32 inputs.
* `experts="nvfp4"`: NVIDIA's variant.  Trunk routed experts are U8-packed e2m1 +
  `weight_scale` (F8_E4M3, one per 16) + `weight_scale_2` and `input_scale` (F32 scalars).
  Drafter experts stay MXFP4 (NVIDIA's `ignore` list has `mtp.*`).
* FP8 dense linears are F8_E4M3 `.weight` + F8_E8M0 `.scale` over 128x128 blocks.
* Drafters: `mtp` (one NextN block `mtp.0` with e_proj/h_proj) or `dspark` (three stages
  `mtp.0..2`; stage 0 has main_proj/main_norm, stage 2 the head group, markov and confidence
  heads).  Both share the trunk's `embed.weight` and `head.weight`.

Sizes: for the `flash` preset the table sums to 159,609,485,896 bytes, the published size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from .config import ATTN_CSA, ATTN_HCA, DRAFTER_DSPARK, DRAFTER_MTP, QUANT_BLOCK, Dsv4Config
from .formats import DTYPE_ITEMSIZE

EXPERT_FORMATS = ("mxfp4", "nvfp4")

# Bytes per element of each safetensors dtype: the one table formats.py keeps (re-exported).
ITEMSIZE = DTYPE_ITEMSIZE

# Owner groups: used by placement and by the census table.
G_EMBED, G_HEAD, G_ATTN, G_NORM_HC, G_GATE, G_SHARED, G_EXPERTS, G_DRAFTER_EXTRA = (
    "embed", "head", "attn", "norm_hc", "gate", "shared", "experts", "drafter_extra")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int | None      # trunk layer, or num_hidden_layers + stage for drafters; None = top
    group: str
    # How the stored bytes decode: "bf16", "f32", "i64", "fp8" (weight whose sidecar is
    # name[:-7] + ".scale"), "e8m0" / "e4m3" (scale sidecars), "mxfp4", "nvfp4", "nvfp4_aux".
    kind: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self) -> None:
        self.specs: list[TensorSpec] = []

    def add(self, name, shape, dtype, layer, group, kind):
        self.specs.append(TensorSpec(name, tuple(int(s) for s in shape), dtype, layer, group, kind))

    def fp8_linear(self, prefix, out_f, in_f, layer, group):
        self.add(f"{prefix}.weight", (out_f, in_f), "F8_E4M3", layer, group, "fp8")
        self.add(f"{prefix}.scale", (_cdiv(out_f, QUANT_BLOCK), _cdiv(in_f, QUANT_BLOCK)),
                 "F8_E8M0", layer, group, "e8m0")

    def bf16(self, name, shape, layer, group):
        self.add(name, shape, "BF16", layer, group, "bf16")

    def f32(self, name, shape, layer, group):
        self.add(name, shape, "F32", layer, group, "f32")

    def fp4_expert(self, prefix, out_f, in_f, layer, fmt):
        if fmt == "mxfp4":
            self.add(f"{prefix}.weight", (out_f, in_f // 2), "I8", layer, G_EXPERTS, "mxfp4")
            self.add(f"{prefix}.scale", (out_f, in_f // 32), "F8_E8M0", layer, G_EXPERTS, "e8m0")
        else:
            self.add(f"{prefix}.weight", (out_f, in_f // 2), "U8", layer, G_EXPERTS, "nvfp4")
            self.add(f"{prefix}.weight_scale", (out_f, in_f // 16), "F8_E4M3", layer, G_EXPERTS, "e4m3")
            self.add(f"{prefix}.weight_scale_2", (), "F32", layer, G_EXPERTS, "nvfp4_aux")
            self.add(f"{prefix}.input_scale", (), "F32", layer, G_EXPERTS, "nvfp4_aux")


def _attention(b: _Builder, cfg: Dsv4Config, p: str, layer: int) -> None:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    b.f32(f"{p}.attn.attn_sink", (H,), layer, G_ATTN)
    b.fp8_linear(f"{p}.attn.wq_a", cfg.q_lora_rank, D, layer, G_ATTN)
    b.bf16(f"{p}.attn.q_norm.weight", (cfg.q_lora_rank,), layer, G_ATTN)
    b.fp8_linear(f"{p}.attn.wq_b", H * hd, cfg.q_lora_rank, layer, G_ATTN)
    b.fp8_linear(f"{p}.attn.wkv", hd, D, layer, G_ATTN)
    b.bf16(f"{p}.attn.kv_norm.weight", (hd,), layer, G_ATTN)
    b.fp8_linear(f"{p}.attn.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, layer, G_ATTN)
    b.fp8_linear(f"{p}.attn.wo_b", D, cfg.o_groups * cfg.o_lora_rank, layer, G_ATTN)
    kind = cfg.attn_kind(layer)
    if kind in (ATTN_CSA, ATTN_HCA):
        r = cfg.compress_ratio(layer)
        coff = 2 if kind == ATTN_CSA else 1
        b.bf16(f"{p}.attn.compressor.wkv.weight", (coff * hd, D), layer, G_ATTN)
        b.bf16(f"{p}.attn.compressor.wgate.weight", (coff * hd, D), layer, G_ATTN)
        b.f32(f"{p}.attn.compressor.ape", (r, coff * hd), layer, G_ATTN)
        b.bf16(f"{p}.attn.compressor.norm.weight", (hd,), layer, G_ATTN)
    if kind == ATTN_CSA:
        ihd, ih = cfg.index_head_dim, cfg.index_n_heads
        b.fp8_linear(f"{p}.attn.indexer.wq_b", ih * ihd, cfg.q_lora_rank, layer, G_ATTN)
        b.bf16(f"{p}.attn.indexer.weights_proj.weight", (ih, D), layer, G_ATTN)
        b.bf16(f"{p}.attn.indexer.compressor.wkv.weight", (2 * ihd, D), layer, G_ATTN)
        b.bf16(f"{p}.attn.indexer.compressor.wgate.weight", (2 * ihd, D), layer, G_ATTN)
        b.f32(f"{p}.attn.indexer.compressor.ape", (cfg.compress_ratio(layer), 2 * ihd), layer, G_ATTN)
        b.bf16(f"{p}.attn.indexer.compressor.norm.weight", (ihd,), layer, G_ATTN)


def _norms_hc(b: _Builder, cfg: Dsv4Config, p: str, layer: int) -> None:
    D = cfg.hidden_size
    b.bf16(f"{p}.attn_norm.weight", (D,), layer, G_NORM_HC)
    b.bf16(f"{p}.ffn_norm.weight", (D,), layer, G_NORM_HC)
    for sub in ("attn", "ffn"):
        b.f32(f"{p}.hc_{sub}_fn", (cfg.hc_mix_rows, cfg.hc_dim), layer, G_NORM_HC)
        b.f32(f"{p}.hc_{sub}_base", (cfg.hc_mix_rows,), layer, G_NORM_HC)
        b.f32(f"{p}.hc_{sub}_scale", (3,), layer, G_NORM_HC)


def _moe(b: _Builder, cfg: Dsv4Config, p: str, layer: int, fmt: str) -> None:
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    b.bf16(f"{p}.ffn.gate.weight", (E, D), layer, G_GATE)
    if cfg.is_hash_layer(layer):
        b.add(f"{p}.ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "I64", layer, G_GATE, "i64")
    else:
        b.f32(f"{p}.ffn.gate.bias", (E,), layer, G_GATE)
    b.fp8_linear(f"{p}.ffn.shared_experts.w1", I, D, layer, G_SHARED)
    b.fp8_linear(f"{p}.ffn.shared_experts.w2", D, I, layer, G_SHARED)
    b.fp8_linear(f"{p}.ffn.shared_experts.w3", I, D, layer, G_SHARED)
    for e in range(E):
        b.fp4_expert(f"{p}.ffn.experts.{e}.w1", I, D, layer, fmt)
        b.fp4_expert(f"{p}.ffn.experts.{e}.w2", D, I, layer, fmt)
        b.fp4_expert(f"{p}.ffn.experts.{e}.w3", I, D, layer, fmt)


def _block(b: _Builder, cfg: Dsv4Config, p: str, layer: int, fmt: str) -> None:
    _attention(b, cfg, p, layer)
    _norms_hc(b, cfg, p, layer)
    _moe(b, cfg, p, layer, fmt)


def _head_group(b: _Builder, cfg: Dsv4Config, p: str, layer: int | None, group: str) -> None:
    b.bf16(f"{p}norm.weight", (cfg.hidden_size,), layer, group)
    b.f32(f"{p}hc_head_fn", (cfg.hc_mult, cfg.hc_dim), layer, group)
    b.f32(f"{p}hc_head_base", (cfg.hc_mult,), layer, group)
    b.f32(f"{p}hc_head_scale", (1,), layer, group)


def expected_tensors(cfg: Dsv4Config, experts: str = "mxfp4") -> list[TensorSpec]:
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERT_FORMATS}")
    b = _Builder()
    b.bf16("embed.weight", (cfg.vocab_size, cfg.hidden_size), None, G_EMBED)
    for layer in range(cfg.num_hidden_layers):
        _block(b, cfg, f"layers.{layer}", layer, experts)
    b.bf16("head.weight", (cfg.vocab_size, cfg.hidden_size), None, G_HEAD)
    _head_group(b, cfg, "", None, G_HEAD)
    n, D = cfg.num_hidden_layers, cfg.hidden_size
    if cfg.drafter_kind == DRAFTER_MTP:
        for s in range(cfg.num_drafter_stages):
            p, layer = f"mtp.{s}", n + s
            _block(b, cfg, p, layer, "mxfp4")
            b.fp8_linear(f"{p}.e_proj", D, D, layer, G_DRAFTER_EXTRA)
            b.fp8_linear(f"{p}.h_proj", D, D, layer, G_DRAFTER_EXTRA)
            b.bf16(f"{p}.enorm.weight", (D,), layer, G_DRAFTER_EXTRA)
            b.bf16(f"{p}.hnorm.weight", (D,), layer, G_DRAFTER_EXTRA)
            _head_group(b, cfg, f"{p}.", layer, G_DRAFTER_EXTRA)
    elif cfg.drafter_kind == DRAFTER_DSPARK:
        taps = len(cfg.dspark_target_layer_ids or ())
        rank = cfg.dspark_markov_rank
        for s in range(3):
            p, layer = f"mtp.{s}", n + s
            _block(b, cfg, p, layer, "mxfp4")
            if s == 0:
                b.fp8_linear(f"{p}.main_proj", D, taps * D, layer, G_DRAFTER_EXTRA)
                b.bf16(f"{p}.main_norm.weight", (D,), layer, G_DRAFTER_EXTRA)
            if s == 2:
                _head_group(b, cfg, f"{p}.", layer, G_DRAFTER_EXTRA)
                b.bf16(f"{p}.markov_head.markov_w1", (cfg.vocab_size, rank), layer, G_DRAFTER_EXTRA)
                b.bf16(f"{p}.markov_head.markov_w2", (cfg.vocab_size, rank), layer, G_DRAFTER_EXTRA)
                b.bf16(f"{p}.confidence_head.proj", (1, D + rank), layer, G_DRAFTER_EXTRA)
    dups = sorted(n for n, count in Counter(s.name for s in b.specs).items() if count > 1)
    assert not dups, f"duplicate tensor names in the expected table: {dups[:5]}"
    return b.specs


def layer_bytes(specs: list[TensorSpec], layer: int | None, group: str | None = None) -> int:
    return sum(s.nbytes for s in specs if s.layer == layer and (group is None or s.group == group))
