"""Config: both official spellings parse to the same Dsv4Config; drift and unknown keys refused."""

from __future__ import annotations

import copy
import json

import pytest

from memra_dsv4.config import (ConfigError, Dsv4Config, flash_0731_config, flash_config, preset,
                               pro_config)

FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)]

# deepseek-ai/DeepSeek-V4-Flash config.json (reference doc section 2.1), every field, with the
# current revision's expert_dtype.
HF_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02,
    "max_position_embeddings": 1048576, "model_type": "deepseek_v4", "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": FLASH_RATIOS + [0], "expert_dtype": "fp4",
}

# Flash-0731: the DSpark keys and 46 compress_ratios (43 trunk + three drafter stages).
HF_FLASH_0731 = {**HF_FLASH, "compress_ratios": FLASH_RATIOS + [0, 0, 0],
                 "dspark_block_size": 5, "dspark_noise_token_id": 128799,
                 "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256}

# inference/config.json names (section 2.2); unset keys take the reference defaults.
INFERENCE_FLASH = {
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3,
    "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024,
    "head_dim": 512, "rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
    "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": FLASH_RATIOS + [0],
}


def _named(cfg: Dsv4Config, name: str = "x") -> Dsv4Config:
    return cfg.replace(name=name)


@pytest.mark.parametrize("name", ["tiny", "small", "flash-layers:1", "flash-layers:7", "flash",
                                  "pro", "flash-0731"])
def test_hf_dict_round_trip(name):
    cfg = preset(name)
    d = cfg.to_hf_dict()
    back = Dsv4Config.from_dict(json.loads(json.dumps(d)), name=cfg.name)
    assert back == cfg
    assert back.to_hf_dict() == d


def test_official_hf_flash_config_parses():
    cfg = Dsv4Config.from_dict(copy.deepcopy(HF_FLASH))
    assert _named(cfg) == _named(flash_config())
    assert cfg.drafter_kind == "mtp" and cfg.num_drafter_stages == 1
    assert [cfg.attn_kind(l) for l in (0, 1, 2, 3, 42, 43)] == ["sliding", "sliding", "csa", "hca",
                                                                 "csa", "sliding"]
    assert [cfg.is_hash_layer(l) for l in (2, 3, 43)] == [True, False, False]
    assert [cfg.rope_kind(l) for l in (1, 2)] == ["plain", "yarn"]
    # The initial revision has no expert_dtype.
    initial = {k: v for k, v in HF_FLASH.items() if k != "expert_dtype"}
    assert Dsv4Config.from_dict(initial) == cfg


def test_official_0731_config_parses_as_dspark():
    cfg = Dsv4Config.from_dict(copy.deepcopy(HF_FLASH_0731))
    assert _named(cfg) == _named(flash_0731_config())
    assert cfg.drafter_kind == "dspark" and cfg.num_drafter_stages == 3
    assert len(cfg.compress_ratios) == 46
    # num_nextn_predict_layers = 1 in the HF file must not make it an MTP config.
    assert cfg.num_nextn_predict_layers == 1


def test_inference_config_names_parse_to_the_same_config():
    assert Dsv4Config.from_dict(copy.deepcopy(INFERENCE_FLASH)) == Dsv4Config.from_dict(HF_FLASH)


def test_from_checkpoint_reads_either_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(HF_FLASH))
    (tmp_path / "b" / "inference").mkdir(parents=True)
    (tmp_path / "b" / "inference" / "config.json").write_text(json.dumps(INFERENCE_FLASH))
    a, b = Dsv4Config.from_checkpoint(tmp_path / "a"), Dsv4Config.from_checkpoint(tmp_path / "b")
    assert a.name == "a" and b.name == "b"
    assert _named(a) == _named(b) == _named(flash_config())
    with pytest.raises(ConfigError, match="no config.json"):
        Dsv4Config.from_checkpoint(tmp_path)


def test_unknown_key_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'first_k_dense_replace' \(value 3\)"):
        Dsv4Config.from_dict({**HF_FLASH, "first_k_dense_replace": 3})
    with pytest.raises(ConfigError, match=r"unknown quantization_config key 'bits' \(value 4\)"):
        Dsv4Config.from_dict({**HF_FLASH, "quantization_config": {
            **HF_FLASH["quantization_config"], "bits": 4}})
    with pytest.raises(ConfigError, match=r"unknown rope_scaling key 'low_freq_factor'"):
        Dsv4Config.from_dict({**HF_FLASH, "rope_scaling": {**HF_FLASH["rope_scaling"],
                                                           "low_freq_factor": 1}})


@pytest.mark.parametrize("key, value, message", [
    ("scoring_func", "softmax", r"config key 'scoring_func' = 'softmax'"),
    ("num_key_value_heads", 2, r"config key 'num_key_value_heads' = 2"),
    ("topk_method", "greedy", r"config key 'topk_method' = 'greedy'"),
    ("hidden_act", "gelu", r"config key 'hidden_act' = 'gelu'"),
    ("tie_word_embeddings", True, r"config key 'tie_word_embeddings' = True"),
])
def test_drift_refused_naming_key_and_value(key, value, message):
    with pytest.raises(ConfigError, match=message):
        Dsv4Config.from_dict({**HF_FLASH, key: value})


def test_nested_drift_refused():
    q = {**HF_FLASH["quantization_config"], "weight_block_size": [64, 64]}
    with pytest.raises(ConfigError, match=r"quantization_config.weight_block_size = \[64, 64\]"):
        Dsv4Config.from_dict({**HF_FLASH, "quantization_config": q})
    q = {**HF_FLASH["quantization_config"], "fmt": "e5m2"}
    with pytest.raises(ConfigError, match=r"quantization_config.fmt = 'e5m2'"):
        Dsv4Config.from_dict({**HF_FLASH, "quantization_config": q})
    r = {**HF_FLASH["rope_scaling"], "type": "linear"}
    with pytest.raises(ConfigError, match=r"rope_scaling.type = 'linear'"):
        Dsv4Config.from_dict({**HF_FLASH, "rope_scaling": r})


def test_inference_spelling_drift_refused():
    with pytest.raises(ConfigError, match=r"config key 'score_func' = 'sigmoid'"):
        Dsv4Config.from_dict({**INFERENCE_FLASH, "score_func": "sigmoid"})
    with pytest.raises(ConfigError, match=r"config key 'dtype' = 'bf16'"):
        Dsv4Config.from_dict({**INFERENCE_FLASH, "dtype": "bf16"})


def test_structural_refusals():
    with pytest.raises(ConfigError, match=r"compress_ratios has 43 entries; expected num_hidden_layers "
                                          r"\(43\) \+ drafter stages \(1\)"):
        Dsv4Config.from_dict({**HF_FLASH, "compress_ratios": FLASH_RATIOS})
    # A DSpark config needs three drafter entries, not the MTP one.
    with pytest.raises(ConfigError, match=r"compress_ratios has 44 entries; expected .* drafter stages \(3\)"):
        Dsv4Config.from_dict({**HF_FLASH_0731, "compress_ratios": FLASH_RATIOS + [0]})
    with pytest.raises(ConfigError, match=r"dspark_target_layer_ids contains 43"):
        Dsv4Config.from_dict({**HF_FLASH_0731, "dspark_target_layer_ids": [41, 42, 43]})
    with pytest.raises(ConfigError, match=r"missing required keys: hidden_size"):
        Dsv4Config.from_dict({k: v for k, v in HF_FLASH.items() if k != "hidden_size"})


def test_not_json_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 4096}")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        Dsv4Config.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: top level is not a JSON object"):
        Dsv4Config.from_checkpoint(tmp_path)


def test_presets():
    assert preset("pro") == pro_config()
    assert preset("flash-layers:3").num_hash_layers == 3
    assert preset("flash-layers:2").num_hash_layers == 2
    for bad in ("flash-layers:0", "flash-layers:x", "nope"):
        with pytest.raises(ConfigError, match=bad):
            preset(bad)


def test_partial_dspark_keys_are_refused_naming_the_missing_ones():
    from memra_dsv4.config import ConfigError, flash_0731_config
    d = flash_0731_config().to_hf_dict()
    del d["dspark_block_size"]
    with pytest.raises(ConfigError, match="dspark_block_size"):
        Dsv4Config.from_dict(d)
