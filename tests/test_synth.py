"""Synthetic checkpoints: table conformance, formats and scales, the lossless NVFP4 cast, CLI."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from memra_dsv4.checkpoint import INDEX_FILE, Checkpoint, CheckpointError
from memra_dsv4.config import Dsv4Config, flash_0731_config, preset
from memra_dsv4.formats import E2M1_VALUES, E4M3_VALUES, encode_e2m1, numpy_storage_dtype
from memra_dsv4.synth import (FULL_PRESETS, _e2m1_codes, main, mxfp4_expert_to_nvfp4,
                              synth_arrays, with_drafter, write_checkpoint)
from memra_dsv4.tensors import expected_tensors

SEED = 3


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny")


@pytest.fixture(scope="module")
def mx(tiny):
    return synth_arrays(tiny, SEED, "mxfp4")


@pytest.fixture(scope="module")
def nv(tiny):
    return synth_arrays(tiny, SEED, "nvfp4")


@pytest.mark.parametrize("drafter", ["mtp", "dspark", "none"])
@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_arrays_follow_the_table(tiny, drafter, experts):
    cfg = with_drafter(tiny, drafter)
    arrays = synth_arrays(cfg, SEED, experts)
    table = expected_tensors(cfg, experts)
    assert set(arrays) == {s.name for s in table} and len(arrays) == len(table)
    for s in table:
        a = arrays[s.name]
        assert a.shape == s.shape and a.dtype == numpy_storage_dtype(s.dtype), s.name
    Checkpoint.from_arrays(cfg, arrays)   # and the census agrees


def test_deterministic_per_tensor(tiny, mx, nv):
    again = synth_arrays(tiny, SEED, "mxfp4")
    other = synth_arrays(tiny, SEED + 1, "mxfp4")
    for name, a in mx.items():
        np.testing.assert_array_equal(a, again[name], err_msg=name)
    assert not np.array_equal(mx["layers.0.attn.wq_a.weight"], other["layers.0.attn.wq_a.weight"])
    # A tensor's values do not depend on the expert format (or anything else generated).
    for name, a in mx.items():
        if ".ffn.experts." not in name or name.startswith("mtp."):
            np.testing.assert_array_equal(a, nv[name], err_msg=name)
    # Different tensors of the same shape are different draws.
    assert not np.array_equal(mx["layers.0.attn_norm.weight"], mx["layers.0.ffn_norm.weight"])


@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_worker_count_does_not_change_the_arrays(tiny, mx, nv, experts):
    """Units are built concurrently (threads); every unit has its own (seed, name) generator."""
    one = mx if experts == "mxfp4" else nv
    many = synth_arrays(tiny, SEED, experts, workers=5)
    assert list(many) == list(synth_arrays(tiny, SEED, experts, workers=1))   # same order too
    assert set(many) == set(one)
    for name, a in one.items():
        np.testing.assert_array_equal(a, many[name], err_msg=name)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_worker_count_refused(tiny, bad):
    with pytest.raises(ValueError, match="workers"):
        synth_arrays(tiny, SEED, "mxfp4", workers=bad)


def test_nvfp4_dequantises_exactly_to_mxfp4(tiny, mx, nv):
    """NVIDIA's cast, applied to the synthetic MXFP4 bytes, is lossless tensor by tensor."""
    ref, cast = Checkpoint.from_arrays(tiny, mx), Checkpoint.from_arrays(tiny, nv)
    weights = [n for n in ref.names() if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(weights) == 5 * 8 * 3
    for name in weights:
        np.testing.assert_array_equal(cast.dequant(name), ref.dequant(name), err_msg=name)
        if name.startswith("layers."):
            assert cast.spec(name).kind == "nvfp4" and ref.spec(name).kind == "mxfp4"
            # Nibbles are copied bit for bit.
            np.testing.assert_array_equal(nv[name], mx[name].view(np.uint8))


def test_nvfp4_scale_structure(tiny, mx, nv):
    for layer in range(tiny.num_hidden_layers):
        for e in range(tiny.n_routed_experts):
            p = f"layers.{layer}.ffn.experts.{e}"
            ws2 = {w: float(nv[f"{p}.{w}.weight_scale_2"]) for w in ("w1", "w2", "w3")}
            k_max = {w: int(mx[f"{p}.{w}.scale"][mx[f"{p}.{w}.scale"] != 0].max()) - 127
                     for w in ("w1", "w2", "w3")}
            # m = max(k_max(w1), k_max(w3)) - 8 shared by the pair; w2 on its own.
            assert ws2["w1"] == ws2["w3"] == 2.0 ** (max(k_max["w1"], k_max["w3"]) - 8)
            assert ws2["w2"] == 2.0 ** (k_max["w2"] - 8)
            ins = {w: float(nv[f"{p}.{w}.input_scale"]) for w in ("w1", "w2", "w3")}
            assert ins["w1"] == ins["w3"] > 0 and ins["w2"] > 0
            for w in ("w1", "w2", "w3"):
                block = E4M3_VALUES[nv[f"{p}.{w}.weight_scale"]]
                nonzero = block[block > 0]
                # Every block scale is 2^(k_j - m) with k_j - m in the lossless window [-9, 8].
                assert np.all(np.frexp(nonzero)[0] == 0.5)
                assert nonzero.min() >= 2.0 ** -9 and nonzero.max() <= 2.0 ** 8


def test_nvfp4_cast_refuses_blocks_outside_the_window(mx):
    p = "layers.0.ffn.experts.0"
    bad = dict(mx)
    scale = mx[f"{p}.w2.scale"].copy()
    scale[0, 0] = int(scale[scale != 0].max()) - 20   # 20 binades below the top: outside [-9, 8]
    bad[f"{p}.w2.scale"] = scale
    with pytest.raises(ValueError, match=rf"{p}.w2.weight: 1 MXFP4 blocks outside the lossless"):
        mxfp4_expert_to_nvfp4(bad, p, (0.001, 0.001))


def test_fast_e2m1_codes_equal_the_shared_encoder():
    """synth's comparison-based e2m1 rounding is formats.encode_e2m1 on [-6, 6], ties included."""
    grid = E2M1_VALUES[:8].astype(np.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    edges = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)),
                            np.nextafter(mids, np.float32(7)), [np.float32(1e-30), np.float32(6)]])
    rng = np.random.default_rng(0)
    v = np.concatenate([edges, -edges, rng.uniform(-6, 6, 100_000).astype(np.float32),
                        np.float32([0.0, -0.0])])
    np.testing.assert_array_equal(_e2m1_codes(v), encode_e2m1(v))


def test_formats_use_their_range(tiny, mx):
    ckpt = Checkpoint.from_arrays(tiny, mx)
    # FP8: per 128x128 block the largest code magnitude is in (224, 448] (scale = 2^ceil(log2(amax/448))).
    for name in ("layers.0.attn.wq_a.weight", "layers.1.attn.wo_a.weight", "mtp.0.e_proj.weight"):
        q = np.abs(E4M3_VALUES[mx[name]])
        o, i = q.shape
        amax = q.reshape(o // 128, 128, i // 128, 128).max(axis=(1, 3))
        assert np.all((amax > 224) & (amax <= 448)), name
        w = ckpt.dequant(name)
        assert abs(float(w.std()) * math.sqrt(i) - 1) < 0.1, name
    # MXFP4: non-zero blocks reach magnitude >= 3 (scale = 2^ceil(log2(amax/6))); a few blocks are
    # all zero with the official sentinel scale byte 0 (2^-127).
    zero_blocks = 0
    for e in range(tiny.n_routed_experts):
        for w in ("w1", "w2", "w3"):
            name = f"layers.2.ffn.experts.{e}.{w}"
            p, s = mx[f"{name}.weight"].view(np.uint8), mx[f"{name}.scale"]
            codes = np.stack([p & 15, p >> 4], -1).reshape(*s.shape, 32)
            mag = np.abs(E2M1_VALUES[codes]).max(axis=-1)
            assert np.all(mag[s != 0] >= 3), name
            assert np.all(mag[s == 0] == 0), name
            zero_blocks += int((s == 0).sum())
            fan_in = 2 * p.shape[1]
            assert abs(float(ckpt.dequant(f"{name}.weight").std()) * math.sqrt(fan_in) - 1) < 0.15
    assert 0 < zero_blocks < 100


def test_plain_tensors_are_well_scaled(tiny, mx):
    ckpt = Checkpoint.from_arrays(tiny, mx)
    emb = ckpt.dequant("embed.weight")
    assert abs(float(emb.std()) - 1) < 0.05
    for name in ("layers.0.attn_norm.weight", "layers.1.attn.q_norm.weight", "norm.weight",
                 "mtp.0.enorm.weight", "layers.1.attn.indexer.compressor.norm.weight"):
        assert abs(float(ckpt.dequant(name).mean()) - 1) < 0.01, name
    # Hyper-connections: pre = sigmoid(~0), post = 2 sigmoid(~0) ~ 1, comb near identity.
    base = ckpt.dequant("layers.3.hc_attn_base")
    hc = tiny.hc_mult
    assert np.all(np.abs(base[: 2 * hc]) < 0.1)
    comb = base[2 * hc:].reshape(hc, hc)
    assert np.all(np.abs(np.diag(comb) - 4) < 0.1)
    assert np.all(np.abs(comb[~np.eye(hc, dtype=bool)]) < 0.1)
    fn = ckpt.dequant("layers.3.hc_ffn_fn")
    assert float(np.abs(fn).max()) * math.sqrt(tiny.hc_dim) < 0.1
    assert np.all(np.abs(ckpt.dequant("layers.3.hc_ffn_scale") - 1) < 0.1)
    # Hash routing table: distinct expert ids per token, in range.
    t = ckpt.dequant("layers.0.ffn.gate.tid2eid")
    assert t.shape == (tiny.vocab_size, tiny.num_experts_per_tok)
    assert t.min() >= 0 and t.max() < tiny.n_routed_experts
    assert np.all(np.sort(t, axis=1)[:, 1:] != np.sort(t, axis=1)[:, :-1])
    assert len(np.unique(t)) == tiny.n_routed_experts


def test_activations_stay_O1(tiny, mx):
    # Skip only while the oracle package does not exist; an oracle that fails to import fails.
    if importlib.util.find_spec("memra_dsv4.oracle") is None:
        pytest.skip("memra_dsv4.oracle not written yet")
    from memra_dsv4.oracle import Oracle
    oracle = Oracle(Checkpoint.from_arrays(tiny, mx))
    tokens = (np.arange(24) * 37 + 5) % tiny.vocab_size   # past the window, CSA and HCA boundaries
    out = oracle.prefill(tokens, capture=True)
    assert len(out.captures) == tiny.num_hidden_layers
    for block, cap in enumerate(out.captures):
        for key in ("attn.streams", "block.out"):     # the hc residual streams
            rms = float(np.sqrt(np.mean(np.square(cap[key], dtype=np.float64))))
            assert 0.05 <= rms <= 20, (block, key, rms)
        for key, v in cap.items():
            if np.asarray(v).dtype.kind != "f":
                continue
            assert np.isfinite(v).all(), (block, key)
            rms = float(np.sqrt(np.mean(np.square(v, dtype=np.float64))))
            assert 1e-3 <= rms <= 1e3, (block, key, rms)
    logits = np.asarray(out.logits, dtype=np.float64)
    assert np.isfinite(logits).all() and 0.1 <= logits.std() <= 100


# ------------------------------------------------------------------------------ drafters
def test_chunked_bf16_encoding_is_invisible(tiny, mx, monkeypatch):
    """Large bf16 tensors are encoded in row chunks (memory); the bytes do not depend on it."""
    import memra_dsv4.synth as synth
    monkeypatch.setattr(synth, "_ENCODE_CHUNK", 1000)
    chunked = synth_arrays(tiny, SEED, "mxfp4")
    for name in ("embed.weight", "head.weight", "layers.1.attn.compressor.wkv.weight"):
        np.testing.assert_array_equal(chunked[name], mx[name], err_msg=name)


def test_with_drafter(tiny):
    dspark = with_drafter(tiny, "dspark")
    assert dspark.drafter_kind == "dspark" and dspark.num_drafter_stages == 3
    assert dspark.dspark_target_layer_ids == (1, 2, 3)
    assert dspark.dspark_markov_rank == 32
    assert 0 <= dspark.dspark_noise_token_id < tiny.vocab_size
    assert dspark.compress_ratios == tiny.compress_ratios[:4] + (0, 0, 0)
    none = with_drafter(dspark, "none")
    assert none.drafter_kind == "none" and none.compress_ratios == tiny.compress_ratios[:4]
    assert with_drafter(none, "mtp") == tiny
    # On Flash dimensions DSpark is exactly Flash-0731's drafter.
    assert with_drafter(preset("flash"), "dspark").replace(name="x") == flash_0731_config().replace(name="x")
    one = with_drafter(preset("flash-layers:1"), "dspark")
    assert one.dspark_target_layer_ids == (0,)
    assert Dsv4Config.from_dict(dspark.to_hf_dict()).replace(name="tiny") == dspark


# ------------------------------------------------------------------------------ writing + CLI
def test_write_checkpoint_validates_first(tmp_path, tiny, mx):
    bad = {k: v for k, v in mx.items() if k != "layers.1.attn.wkv.scale"}
    out = tmp_path / "bad"
    with pytest.raises(CheckpointError, match=r"1 missing: layers.1.attn.wkv.scale"):
        write_checkpoint(out, tiny, bad)
    assert not out.exists()
    good = tmp_path / "good"
    total = write_checkpoint(good, tiny, mx)
    with open(good / INDEX_FILE) as fh:
        assert json.load(fh)["metadata"]["total_size"] == total
    with pytest.raises(CheckpointError, match="not empty"):
        write_checkpoint(good, tiny, mx)


def test_cli_writes_a_checkpoint_that_opens(tmp_path, capsys, nv):
    out = tmp_path / "cli"
    assert main([str(out), "--preset", "tiny", "--seed", str(SEED), "--experts", "nvfp4"]) == 0
    n = len(expected_tensors(preset("tiny"), "nvfp4"))
    assert f"experts nvfp4, drafter mtp, {n} tensors" in capsys.readouterr().out
    ckpt = Checkpoint.open(out)
    assert ckpt.expert_kind(0) == "nvfp4" and ckpt.expert_kind("mtp.0") == "mxfp4"
    for name in ("layers.3.ffn.experts.7.w2.weight_scale", "embed.weight", "mtp.0.h_proj.scale"):
        np.testing.assert_array_equal(ckpt.raw(name), nv[name])
    out2 = tmp_path / "cli2"
    assert main([str(out2), "--preset", "tiny", "--drafter", "dspark"]) == 0
    assert Checkpoint.open(out2).config.drafter_kind == "dspark"


@pytest.mark.parametrize("argv, message", [
    (["OUT"], "the following arguments are required: --preset"),
    (["OUT", "--preset", "huge"], "unknown preset 'huge'"),
    (["OUT", "--preset", "tiny", "--experts", "fp8"], "invalid choice: 'fp8'"),
    (["OUT", "--preset", "tiny", "--drafter", "eagle"], "invalid choice: 'eagle'"),
    (["OUT", "--preset", "tiny", "--seed", "x"], "invalid int value: 'x'"),
    (["OUT", "--preset", "tiny", "--seed", "-1"], "--seed -1: must be >= 0"),
    (["OUT", "--preset", "flash-layers:44"], "flash-layers:44: N must be in 1..43"),
    (["OUT", "--preset", "flash"], "refusing to write preset 'flash': 159.6 GB"),
    (["OUT", "--preset", "pro"], "refusing to write preset 'pro': 864.7 GB"),
    (["OUT", "--preset", "flash-0731", "--experts", "nvfp4"], "refusing to write preset 'flash-0731'"),
])
def test_cli_bad_arguments_one_line_exit_2(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / a) if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("memra_dsv4 synth: error: ")
    assert not (tmp_path / "OUT").exists()


def test_cli_refuses_non_empty_directory(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main([str(tmp_path), "--preset", "tiny"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_full_presets_are_the_refused_ones():
    assert set(FULL_PRESETS) == {"flash", "pro", "flash-0731"}
    # flash-layers:N has real dimensions and is allowed (tested through the table only: ~9 GB).
    cfg = preset("flash-layers:1")
    assert sum(s.nbytes for s in expected_tensors(cfg)) == 1_059_061_760 + 3_566_148_952 \
        + 1_059_332_116 + 3_593_787_756


@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_pieces_build_the_same_arrays_as_whole_units(tiny, experts):
    """synth_arrays cuts units into pieces (an expert; a tensor with its sidecars): the arrays
    and their order are those of building each unit whole."""
    from memra_dsv4.checkpoint import specs_by_unit
    from memra_dsv4.synth import _pieces, synth_unit_arrays
    specs = expected_tensors(tiny, experts)
    whole = {k: v for u in specs_by_unit(tiny, specs).values()
             for k, v in synth_unit_arrays(tiny, SEED, u).items()}
    cut = synth_arrays(tiny, SEED, experts, workers=3)
    assert list(cut) == list(whole)
    for name, a in whole.items():
        assert a.dtype == cut[name].dtype and a.tobytes() == cut[name].tobytes(), name
    for unit in specs_by_unit(tiny, specs).values():
        pieces = _pieces(unit)
        assert [s for p in pieces for s in p] == unit
        for p in pieces:
            head = p[0]
            assert head.kind not in ("e8m0", "e4m3", "nvfp4_aux")
            if ".ffn.experts." in head.name:
                assert head.name.endswith(".w1.weight")
                stem = head.name[:-len("w1.weight")]
                assert all(s.name.startswith(stem) for s in p) and len(p) in (6, 12)
            else:
                assert all(s.kind in ("e8m0",) for s in p[1:])


# SHA-256 over (name, dtype, shape, bytes) in dictionary order of synth_arrays(tiny, 0, fmt), as
# built before the flashspeed rework of synth (per-piece threads, |x| / sign quantisation path):
# the synthetic values are a contract of the GPU tests.  Pinned with NumPy 2.x generators; a
# NumPy that changes its random streams changes these too (then re-pin after checking why).
_TINY_DIGESTS = {
    "mxfp4": "8a71b32614f4bb7c92da4dc301a0fe377b76be131eee7294c522d2d976863b3c",
    "nvfp4": "0748eca4a9bcf44a1bf0fd5c24345fb41676572fd44a6158cd9d443285fac1f2",
}


@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_tiny_synth_values_pinned(tiny, experts):
    import hashlib
    h = hashlib.sha256()
    for k, v in synth_arrays(tiny, 0, experts).items():
        h.update(k.encode())
        h.update(str(v.dtype).encode())
        h.update(str(v.shape).encode())
        h.update(v.tobytes())
    assert h.hexdigest() == _TINY_DIGESTS[experts]


def test_e2m1_codes_from_magnitudes_and_signs():
    rng = np.random.default_rng(3)
    v = np.concatenate([rng.uniform(-6, 6, 10_000).astype(np.float32), np.float32([0.0, -0.0])])
    np.testing.assert_array_equal(_e2m1_codes(None, a=np.abs(v), neg=np.signbit(v)),
                                  _e2m1_codes(v))
