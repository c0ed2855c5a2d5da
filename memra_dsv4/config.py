"""Model configuration: one frozen `Dsv4Config` for every DeepSeek-V4 variant we run.

Contract
--------
* `Dsv4Config.from_checkpoint(dir)` reads the HF root `config.json` (the names the released
  checkpoints use) and also understands the official `inference/config.json` names
  (`dim`, `n_layers`, `window_size`, ...).  Both spellings map onto the same fields.
* Drift is refused.  Every key we read is on an allow-list; a key we do not know, or a value
  outside what we implement (another scoring function, another quantization block, a second
  KV head, ...), raises `ConfigError` naming the key and the value.  Dimensions are free, as
  long as the divisibility rules the kernels rely on hold (checked in `__post_init__`).
* Per-layer facts are derived here and nowhere else: compress ratio, attention kind
  (`sliding` / `csa` / `hca`), hash vs learned routing, rope kind (plain theta, or
  compress theta + YaRN).  The drafter kind (`mtp`, `dspark`, `none`) is decided from the
  keys: a config with `dspark_*` keys is a DSpark drafter and never an MTP one.
* `preset(name)` returns the synthetic presets (`tiny`, `small`, `flash-layers:N`) and the
  full configs (`flash`, `pro`, `flash-0731`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config key or value that this runtime does not implement."""


ATTN_SLIDING, ATTN_CSA, ATTN_HCA = "sliding", "csa", "hca"
ROPE_PLAIN, ROPE_YARN = "plain", "yarn"
DRAFTER_NONE, DRAFTER_MTP, DRAFTER_DSPARK = "none", "mtp", "dspark"

# The CSA ratio is fixed by the overlap layout (two blocks of 4 pooled per entry); every other
# nonzero ratio is a non-overlapping HCA pool.  The reference hard-codes `ratio == 4` too.
CSA_RATIO = 4
# FP8 weights and activations use 128-wide blocks; the KV nope FP8 simulation uses 64.
QUANT_BLOCK = 128
DSPARK_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
               "dspark_markov_rank")


@dataclass(frozen=True)
class Dsv4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # trunk layers, then one entry per drafter stage
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    num_nextn_predict_layers: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576
    # DSpark (Flash-0731).  All None on MTP checkpoints.
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int | None = None
    name: str = "custom"

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        # A DSpark drafter needs all four dspark_* keys; a config with only some of them is
        # neither a DSpark nor an MTP checkpoint we understand (and must never reach the MTP
        # loader), so it is refused, naming what is missing.
        dspark = {f: getattr(self, f) for f in DSPARK_KEYS}
        present = [f for f, v in dspark.items() if v is not None]
        if present and len(present) != len(dspark):
            missing = [f for f in DSPARK_KEYS if dspark[f] is None]
            raise ConfigError(f"config has {', '.join(present)} but not {', '.join(missing)}: "
                              f"a DSpark drafter needs all of {', '.join(DSPARK_KEYS)}")
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n + self.num_drafter_stages:
            raise ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries; expected "
                f"num_hidden_layers ({n}) + drafter stages ({self.num_drafter_stages})")
        for i, r in enumerate(self.compress_ratios):
            if r < 0 or (r not in (0, CSA_RATIO) and r < 8):
                raise ConfigError(f"compress_ratios[{i}] = {r}: supported are 0, 4, or >= 8")
            if i >= n and r != 0:
                raise ConfigError(f"compress_ratios[{i}] = {r}: drafter stages must be 0")
        checks = [
            ("qk_rope_head_dim", self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim < self.head_dim),
            ("head_dim", (self.head_dim - self.qk_rope_head_dim) % 64 == 0),  # KV FP8 sim blocks of 64
            ("num_attention_heads", self.num_attention_heads % self.o_groups == 0),
            ("index_head_dim", self.index_head_dim > self.qk_rope_head_dim
             and self.index_head_dim & (self.index_head_dim - 1) == 0       # Hadamard size
             and self.index_head_dim % 32 == 0),                            # FP4 sim blocks of 32
            ("hidden_size", self.hidden_size % QUANT_BLOCK == 0),
            ("moe_intermediate_size", self.moe_intermediate_size % QUANT_BLOCK == 0),
            ("q_lora_rank", self.q_lora_rank % QUANT_BLOCK == 0),
            ("o_lora_rank", self.o_lora_rank % QUANT_BLOCK == 0),
            ("num_experts_per_tok", 0 < self.num_experts_per_tok <= self.n_routed_experts),
            ("num_hash_layers", 0 <= self.num_hash_layers <= n),
            ("hc_mult", self.hc_mult == 4),
            ("n_shared_experts", self.n_shared_experts == 1),
            ("sliding_window", self.sliding_window >= 1),
            ("index_topk", self.index_topk >= 1),
        ]
        for key, ok in checks:
            if not ok:
                raise ConfigError(f"{key} = {getattr(self, key)!r} is outside what memra-dsv4 implements")
        if self.dspark_target_layer_ids is not None:
            for t in self.dspark_target_layer_ids:
                if not 0 <= t < n:
                    raise ConfigError(f"dspark_target_layer_ids contains {t}, outside 0..{n - 1}")

    # ------------------------------------------------------------------ derived facts
    @property
    def drafter_kind(self) -> str:
        if self.dspark_block_size is not None:
            return DRAFTER_DSPARK
        return DRAFTER_MTP if self.num_nextn_predict_layers > 0 else DRAFTER_NONE

    @property
    def num_drafter_stages(self) -> int:
        if self.dspark_block_size is not None:
            return 3
        return self.num_nextn_predict_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:
        """Width of the flattened hyper-connection streams (hc_mult * hidden)."""
        return self.hc_mult * self.hidden_size

    @property
    def hc_mix_rows(self) -> int:
        """Rows of hc_*_fn: pre (hc), post (hc), comb (hc*hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    def compress_ratio(self, layer: int) -> int:
        """Ratio of trunk layer `layer`, or of drafter stage `layer - num_hidden_layers`."""
        return self.compress_ratios[layer]

    def attn_kind(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return ATTN_SLIDING if r == 0 else (ATTN_CSA if r == CSA_RATIO else ATTN_HCA)

    def is_hash_layer(self, layer: int) -> bool:
        # Drafter stages (layer ids >= num_hidden_layers) are always learned-routed.
        return layer < self.num_hash_layers

    def rope_kind(self, layer: int) -> str:
        return ROPE_PLAIN if self.compress_ratios[layer] == 0 else ROPE_YARN

    def rope_base(self, layer: int) -> float:
        return self.rope_theta if self.compress_ratios[layer] == 0 else self.compress_rope_theta

    def layer_summary(self, layer: int) -> str:
        return (f"{self.attn_kind(layer)}(r={self.compress_ratios[layer]}) "
                f"{'hash' if self.is_hash_layer(layer) else 'learned'} {self.rope_kind(layer)}")

    def replace(self, **kw: Any) -> "Dsv4Config":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ (de)serialisation
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF root `config.json` that `from_dict` reads back (used by synth)."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "num_key_value_heads": 1,
            "norm_topk_prob": True,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "initializer_range": 0.02,
            "expert_dtype": "fp4",
            "quantization_config": {
                "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "scale_fmt": "ue8m0", "weight_block_size": [QUANT_BLOCK, QUANT_BLOCK]},
            "rope_scaling": {
                "type": "yarn", "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
        }
        for f in dataclasses.fields(self):
            if f.name in ("rope_factor", "original_max_position_embeddings", "beta_fast",
                          "beta_slow", "name"):
                continue
            v = getattr(self, f.name)
            if v is None:
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "Dsv4Config":
        return cls(**_normalise(raw), name=name)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "Dsv4Config":
        path = os.fspath(path)
        candidates = [os.path.join(path, "config.json"),
                      os.path.join(path, "inference", "config.json")]
        for c in candidates:
            if os.path.isfile(c):
                try:
                    with open(c, encoding="utf-8") as fh:
                        raw = json.load(fh)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{c}: not valid JSON ({e})") from None
                if not isinstance(raw, dict):
                    raise ConfigError(f"{c}: top level is not a JSON object")
                return cls.from_dict(raw, name=os.path.basename(os.path.normpath(path)))
        raise ConfigError(f"no config.json (or inference/config.json) under {path}")


# ---------------------------------------------------------------------- the allow-list
# inference/config.json spelling -> field name
_INFERENCE_ALIASES = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim", "window_size": "sliding_window",
    "original_seq_len": "original_max_position_embeddings", "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok", "n_hash_layers": "num_hash_layers",
    "route_scale": "routed_scaling_factor", "norm_eps": "rms_norm_eps",
    "n_mtp_layers": "num_nextn_predict_layers",
}
_FIELDS = {f.name for f in dataclasses.fields(Dsv4Config)} - {"name"}
_REQUIRED = {f.name for f in dataclasses.fields(Dsv4Config) if f.default is dataclasses.MISSING}
# Keys whose value must be exactly this (what we implement).  Dicts compare key by key.
_FIXED_VALUES: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus", "score_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
    "expert_dtype": "fp4",
    "dtype": "fp8",
    "scale_fmt": "ue8m0",
    "scale_dtype": "fp8",
}
# Keys that carry no semantics for inference (training knobs, bookkeeping); accepted as is.
_IGNORED = {
    "attention_dropout", "initializer_range", "torch_dtype", "transformers_version", "use_cache",
    "auto_map", "pad_token_id", "router_aux_loss_coef", "router_jitter_noise",
    "output_router_logits", "max_batch_size", "max_seq_len",
}
_QUANT_FIXED = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "scale_fmt": "ue8m0", "weight_block_size": [QUANT_BLOCK, QUANT_BLOCK]}
# NVIDIA's NVFP4 variant adds modelopt bookkeeping to quantization_config; experts are then
# decided per tensor from the stored dtypes, so these keys are accepted but not trusted.
_QUANT_IGNORED = {"moe_quant_algo", "quant_algo", "group_size", "producer", "ignore",
                  "exclude_modules", "kv_cache_quant_algo", "quantized_layers"}
_ROPE_FIXED = {"type": "yarn"}
_ROPE_MAP = {"factor": "rope_factor", "original_max_position_embeddings":
             "original_max_position_embeddings", "beta_fast": "beta_fast", "beta_slow": "beta_slow"}


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        field_name = _INFERENCE_ALIASES.get(key, key)
        if key in _FIXED_VALUES:
            if value != _FIXED_VALUES[key]:
                raise ConfigError(f"config key {key!r} = {value!r}: memra-dsv4 implements only "
                                  f"{_FIXED_VALUES[key]!r}")
        elif key in _IGNORED:
            continue
        elif key == "quantization_config":
            _check_quant(value)
        elif key in ("rope_scaling", "rope_parameters"):
            out.update(_read_rope(key, value))
        elif key == "rope_factor":
            out["rope_factor"] = float(value)
        elif key in ("beta_fast", "beta_slow"):
            out[key] = float(value)
        elif field_name in _FIELDS:
            out[field_name] = value
        else:
            raise ConfigError(f"unknown config key {key!r} (value {value!r}): not on memra-dsv4's "
                              f"allow-list; refusing a config we may not implement")
    for k in ("compress_ratios", "dspark_target_layer_ids"):
        if out.get(k) is not None:
            out[k] = tuple(int(x) for x in out[k])
    out.setdefault("rope_factor", 1.0)
    out.setdefault("beta_fast", 32.0)
    out.setdefault("beta_slow", 1.0)
    # Absent key: the reference default (ModelArgs.n_mtp_layers = 1); the official
    # inference/config.json leaves it unset while listing 44 compress_ratios (43 + 1 MTP).
    # DSpark configs get the same 1, as the HF config of 0731 says; their three stages (and
    # three trailing compress_ratios zeros) come from `num_drafter_stages`, never from this key,
    # so a DSpark config is never routed to the MTP loader.
    out.setdefault("num_nextn_predict_layers", 1)
    for k, default in (("hc_mult", 4), ("hc_sinkhorn_iters", 20), ("hc_eps", 1e-6),
                       ("rms_norm_eps", 1e-6), ("n_shared_experts", 1)):
        out.setdefault(k, default)
    missing = sorted(_REQUIRED - out.keys())
    if missing:
        raise ConfigError(f"config is missing required keys: {', '.join(missing)}")
    return out


def _check_quant(q: Any) -> None:
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config = {q!r}: expected an object")
    for k, v in q.items():
        if k in _QUANT_IGNORED:
            continue
        if k not in _QUANT_FIXED:
            raise ConfigError(f"unknown quantization_config key {k!r} (value {v!r})")
        if v != _QUANT_FIXED[k]:
            raise ConfigError(f"quantization_config.{k} = {v!r}: memra-dsv4 implements only "
                              f"{_QUANT_FIXED[k]!r}")


def _read_rope(key: str, r: Any) -> dict[str, Any]:
    if not isinstance(r, dict):
        raise ConfigError(f"{key} = {r!r}: expected an object")
    out = {}
    for k, v in r.items():
        if k in _ROPE_FIXED or k == "rope_type":
            if v != "yarn":
                raise ConfigError(f"{key}.{k} = {v!r}: memra-dsv4 implements only 'yarn'")
        elif k in _ROPE_MAP:
            out[_ROPE_MAP[k]] = v
        elif k in ("mscale", "mscale_all_dim") and v in (0, 1, 0.0, 1.0):
            continue  # the reference applies no mscale; only neutral values are accepted
        else:
            raise ConfigError(f"unknown {key} key {k!r} (value {v!r})")
    return out


# ---------------------------------------------------------------------- presets
def _flash_ratios(n_layers: int) -> tuple[int, ...]:
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layers))


_FLASH = dict(
    vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, compress_ratios=_flash_ratios(43) + (0,), rope_theta=10000.0,
    compress_rope_theta=160000.0, rope_factor=16.0, original_max_position_embeddings=65536,
    beta_fast=32.0, beta_slow=1.0, index_n_heads=64, index_head_dim=128, index_topk=512,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3,
    routed_scaling_factor=1.5, swiglu_limit=10.0, num_nextn_predict_layers=1,
)


def flash_config() -> Dsv4Config:
    return Dsv4Config(**_FLASH, name="flash")


def flash_0731_config() -> Dsv4Config:
    return Dsv4Config(**{**_FLASH, "compress_ratios": _flash_ratios(43) + (0, 0, 0)},
                      dspark_block_size=5, dspark_noise_token_id=128799,
                      dspark_target_layer_ids=(40, 41, 42), dspark_markov_rank=256,
                      name="flash-0731")


def pro_config() -> Dsv4Config:
    ratios = tuple(128 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(61)) + (0,)
    return Dsv4Config(**{**_FLASH, "hidden_size": 7168, "num_hidden_layers": 61,
                         "num_attention_heads": 128, "q_lora_rank": 1536, "o_groups": 16,
                         "n_routed_experts": 384, "moe_intermediate_size": 3072,
                         "index_topk": 1024, "routed_scaling_factor": 2.5,
                         "compress_ratios": ratios}, name="pro")


def flash_layers_config(n: int) -> Dsv4Config:
    if not 1 <= n <= 43:
        raise ConfigError(f"flash-layers:{n}: N must be in 1..43")
    return Dsv4Config(**{**_FLASH, "num_hidden_layers": n,
                         "compress_ratios": _flash_ratios(n) + (0,),
                         "num_hash_layers": min(3, n)}, name=f"flash-layers:{n}")


def tiny_config() -> Dsv4Config:
    """Every layer kind in 4 layers, sized so short prompts exercise every boundary:
    window 8 wraps at t=8, CSA emits at t=3, HCA (ratio 16) emits at t=15, and index_topk 2
    makes the indexer really drop blocks from t=11 (3 complete CSA entries) on."""
    return Dsv4Config(
        vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128,
        sliding_window=8, compress_ratios=(0, 4, 16, 4, 0), rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_max_position_embeddings=64,
        beta_fast=32.0, beta_slow=1.0, index_n_heads=4, index_head_dim=128, index_topk=2,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, num_hash_layers=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
        num_nextn_predict_layers=1, name="tiny")


def small_config() -> Dsv4Config:
    """Wider than tiny, still seconds on the CPU: window 32, HCA ratio 32, top-k 8."""
    return Dsv4Config(
        vocab_size=2048, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=128,
        sliding_window=32, compress_ratios=(0, 4, 32, 4, 32, 4, 0), rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_max_position_embeddings=256,
        beta_fast=32.0, beta_slow=1.0, index_n_heads=8, index_head_dim=128, index_topk=8,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        moe_intermediate_size=256, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, num_hash_layers=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
        num_nextn_predict_layers=1, name="small")


PRESET_NAMES = ("tiny", "small", "flash-layers:N", "flash", "pro", "flash-0731")


def preset(name: str) -> Dsv4Config:
    if name == "tiny":
        return tiny_config()
    if name == "small":
        return small_config()
    if name == "flash":
        return flash_config()
    if name == "pro":
        return pro_config()
    if name == "flash-0731":
        return flash_0731_config()
    if name.startswith("flash-layers:"):
        tail = name.split(":", 1)[1]
        if not tail.isdigit():
            raise ConfigError(f"preset {name!r}: expected flash-layers:N with N an integer")
        return flash_layers_config(int(tail))
    raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
