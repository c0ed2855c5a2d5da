"""Pipeline placement (CPU): the balanced split of Flash, N = 1..3, totals, fit errors, the CLI."""

from __future__ import annotations

import functools
import json

import pytest

from memra_dsv4.config import preset
from memra_dsv4.placement import (
    GiB,
    PlacementError,
    layer_kv_bytes,
    main,
    plan_split,
    weight_bytes_on_device,
)
from memra_dsv4.tensors import expected_tensors

FLASH = preset("flash")


@functools.lru_cache(maxsize=None)
def _table(cfg, experts="mxfp4"):
    return tuple(expected_tensors(cfg, experts))


def _whole(cfg, experts="mxfp4", dense="stored", max_seq_len=4096, workspace=0, n=1, drafter=True):
    """Everything the devices hold together, summed independently of the split."""
    specs = _table(cfg, experts)
    n_layers = cfg.num_hidden_layers
    w = sum(weight_bytes_on_device(s, dense) for s in specs
            if drafter or s.layer is None or s.layer < n_layers)
    ids = range(n_layers + (cfg.num_drafter_stages if drafter else 0))
    kv = sum(layer_kv_bytes(cfg, l, max_seq_len) for l in ids)
    return w + kv + n * workspace


def test_flash_two_devices_balanced_cut_matches_the_reference_doc():
    p = plan_split(FLASH, 2, experts="mxfp4", dense="stored", include_drafter=True)
    print("\n" + p.table())
    assert p.cuts[0] in (20, 21)
    s0, s1 = p.stages
    assert s0.layers.start == 0 and s1.layers.stop == 43 and s0.layers.stop == s1.layers.start
    assert s0.has_embed and not s0.has_head and s1.has_head and s1.has_drafter
    # dsv4_model_and_formats.md section 11: weights 74.30 / 74.35 GiB at the cut after 21.
    assert p.cuts == (21,)
    assert round(s0.weights_bytes / GiB, 2) == 74.30 and round(s1.weights_bytes / GiB, 2) == 74.35
    assert abs(s0.total_bytes - s1.total_bytes) < 0.5 * GiB


def test_flash_without_drafter_moves_the_tail_weights():
    with_mtp = plan_split(FLASH, 2, dense="stored")
    without = plan_split(FLASH, 2, dense="stored", include_drafter=False)
    assert without.cuts[0] in (20, 21)
    diff = with_mtp.stages[1].weights_bytes - without.stages[1].weights_bytes
    assert round(diff / GiB, 2) == 3.35     # the MTP block, per the reference doc
    assert without.drafter == "none" and not without.stages[1].has_drafter


def test_nvfp4_split_matches_the_reference_doc():
    p = plan_split(FLASH, 2, experts="nvfp4", dense="stored")
    assert p.cuts == (21,)
    assert [round(s.weights_bytes / GiB, 2) for s in p.stages] == [78.43, 78.28]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dense", ["stored", "fp8", "bf16"])
def test_totals_sum_to_the_whole_and_ranges_tile_the_trunk(n, dense):
    ws = 3 * GiB
    p = plan_split(FLASH, n, dense=dense, workspace_bytes=ws, max_seq_len=65536)
    assert p.n_devices == n and len(p.cuts) == n - 1
    assert p.total_bytes == _whole(FLASH, dense=dense, max_seq_len=65536, workspace=ws, n=n)
    covered = [l for s in p.stages for l in s.layers]
    assert covered == list(range(FLASH.num_hidden_layers))
    assert all(len(s.layers) > 0 and s.workspace_bytes == ws for s in p.stages)
    assert [s.device for s in p.stages] == list(range(n))


def test_three_devices_is_optimal_against_brute_force():
    p = plan_split(FLASH, 3, dense="stored")
    L = FLASH.num_hidden_layers
    # What each stage carries besides its layers (embed / head + drafter, workspace).
    extra = [s.total_bytes - sum(p.layer_bytes[s.layers.start:s.layers.stop]) for s in p.stages]
    best = min(
        max(sum(p.layer_bytes[:a]) + extra[0], sum(p.layer_bytes[a:b]) + extra[1],
            sum(p.layer_bytes[b:]) + extra[2])
        for a in range(1, L - 1) for b in range(a + 1, L))
    assert p.max_stage_bytes == best


def test_dense_bf16_arm_doubles_fp8_linears_only():
    """Reference doc: non-expert weights of the 43 trunk layers are 6.27 GiB stored, 11.7 in bf16."""
    specs = _table(FLASH)
    trunk = [s for s in specs if s.layer is not None and s.layer < 43 and s.group != "experts"]
    assert round(sum(weight_bytes_on_device(s, "stored") for s in trunk) / GiB, 2) == 6.27
    assert round(sum(weight_bytes_on_device(s, "bf16") for s in trunk) / GiB, 1) == 11.7
    experts = [s for s in specs if s.group == "experts"]
    for arm in ("fp8", "bf16"):
        assert sum(weight_bytes_on_device(s, arm) for s in experts) == sum(s.nbytes for s in experts)
    scale = next(s for s in specs if s.name == "layers.0.attn.wq_a.scale")
    assert weight_bytes_on_device(scale, "fp8") == 4 * scale.nbytes       # decoded to fp32
    assert weight_bytes_on_device(scale, "bf16") == 0


def test_kv_bytes_per_layer_kind_match_dsv4_attention_7_5():
    T = 4096
    window = 128 * 512 * 2
    assert layer_kv_bytes(FLASH, 0, T) == window                                   # ratio 0
    csa = window + (T // 4) * 512 * 2 + 64 * 1024 + (T // 4) * 128 * 2 + 16 * 1024
    assert layer_kv_bytes(FLASH, 2, T) == csa                                      # ratio 4
    hca = window + (T // 128) * 512 * 2 + 512 * 1024
    assert layer_kv_bytes(FLASH, 3, T) == hca                                      # ratio 128
    assert layer_kv_bytes(FLASH, 43, T) == window                                  # MTP stage
    assert layer_kv_bytes(FLASH, 2, T, max_batch=4) == 4 * csa


def test_impossible_fit_raises_a_clear_error():
    with pytest.raises(PlacementError, match=r"does not fit.*device 0.*weights"):
        plan_split(FLASH, 1, device_bytes=141 * GiB)
    with pytest.raises(PlacementError, match="does not fit"):
        plan_split(FLASH, 2, device_bytes=60 * GiB)
    ok = plan_split(FLASH, 2, device_bytes=141 * GiB)        # an H200 holds half of Flash
    assert ok.max_stage_bytes < 140 * GiB


@pytest.mark.parametrize("kw, match", [
    (dict(n_devices=0), "positive integer"),
    (dict(n_devices=44), "at least one layer"),
    (dict(n_devices=2, experts="fp4"), "experts"),
    (dict(n_devices=2, dense="fp16"), "dense"),
    (dict(n_devices=2, max_seq_len=0), "max_seq_len"),
])
def test_bad_requests_are_refused(kw, match):
    with pytest.raises(PlacementError, match=match):
        plan_split(FLASH, **kw)


def test_tiny_preset_splits_and_places_every_layer():
    cfg = preset("tiny")
    for n in (1, 2, 4):
        p = plan_split(cfg, n, workspace_bytes=0)
        assert sorted(l for s in p.stages for l in s.layers) == list(range(4))


# ------------------------------------------------------------------------ CLI
def test_cli_prints_the_table(capsys):
    assert main(["--preset", "flash", "--devices", "2", "--dense", "stored"]) == 0
    out = capsys.readouterr().out
    assert "cuts: after layer 21" in out
    assert "0-21 (22)" in out and "22-42 (21)" in out and "head, drafter" in out
    assert "74.30" in out and "74.35" in out


def test_cli_reads_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(FLASH.to_hf_dict()))
    index = {"weight_map": {"layers.0.ffn.experts.0.w1.weight_scale_2": "x.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main([str(tmp_path), "--devices", "2", "--dense", "stored"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4 experts" in out and "78.43" in out      # detected from the index


@pytest.mark.parametrize("argv, match", [
    (["--devices", "2"], "exactly one of CKPT or --preset"),
    (["--preset", "flash", "--devices", "0"], "positive integer"),
    (["--preset", "nope"], "unknown preset"),
    (["--preset", "flash", "--dense", "fp16"], "invalid choice"),
    (["--preset", "flash", "--devices", "two"], "invalid int value"),
    (["/nonexistent/ckpt"], "does not exist"),
    (["--preset", "flash", "--devices", "1", "--device-gib", "141"], "does not fit"),
])
def test_cli_bad_arguments_give_one_line_and_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("memra_dsv4 plan: ") and match in err, err
