"""Census from the table alone (published Flash / NVFP4 / Pro / 0731 sizes) and the CLI."""

from __future__ import annotations

import json

import pytest

from memra_dsv4.census import census_of_checkpoint, census_of_preset, format_census, main
from memra_dsv4.checkpoint import Checkpoint
from memra_dsv4.config import preset
from memra_dsv4.synth import synth_arrays, with_drafter, write_checkpoint
from memra_dsv4.tensors import expected_tensors

FLASH_TOTAL, FLASH_NVFP4_TOTAL, FLASH_MTP = 159_609_485_896, 168_266_793_544, 3_593_787_756
EMBED, HEAD_GROUP = 1_059_061_760, 1_059_332_116


@pytest.fixture(scope="module")
def flash():
    return census_of_preset(preset("flash"), "mxfp4")


@pytest.fixture(scope="module")
def flash_nv():
    return census_of_preset(preset("flash"), "nvfp4")


def test_flash_totals_match_published(flash):
    assert flash.total_bytes == FLASH_TOTAL
    assert flash.n_tensors == 69_187
    assert flash.drafter_bytes == FLASH_MTP
    assert flash.row("mtp.0").tensors == 1575
    assert flash.row("embed").total == EMBED and flash.row("head").total == HEAD_GROUP
    assert flash.expert_format() == "mxfp4" and flash.expert_format(drafter=True) == "mxfp4"


def test_flash_per_layer_bytes_match_section_11(flash, flash_nv):
    whole = {0: (3_566_148_952, 3_767_481_688), 1: (3_566_148_952, 3_767_481_688),
             2: (3_596_055_640, 3_797_388_376), 3: (3_568_596_312, 3_769_929_048),
             41: (3_568_596_312, 3_769_929_048), 4: (3_589_851_224, 3_791_183_960),
             42: (3_589_851_224, 3_791_183_960)}
    for layer, (mx_bytes, nv_bytes) in whole.items():
        assert flash.row(layer).total == mx_bytes, layer
        assert flash_nv.row(layer).total == nv_bytes, layer
    attn = {"sliding": 106_964_608, "hca": 115_616_384, "csa": 136_871_296}
    for r in flash.rows:
        if r.attn is None:
            continue
        assert r.group_bytes["attn"] == attn[r.attn], r.unit
        assert r.group_bytes["norm_hc"] == 3_162_328
        assert r.group_bytes["gate"] == (8_302_592 if r.routing == "hash" else 2_098_176)
        assert r.group_bytes["shared"] == 25_167_360
        assert r.group_bytes["experts"] == 3_422_552_064
        assert flash_nv.row(r.unit).group_bytes["experts"] == (
            3_623_884_800 if r.unit != "mtp.0" else 3_422_552_064)
    assert [r.unit for r in flash.rows] == ["embed", *map(str, range(43)), "head", "mtp.0"]
    assert flash.row(2).attn == "csa" and flash.row(2).ratio == 4 and flash.row(2).rope == "yarn"
    assert flash.row(3).attn == "hca" and flash.row(3).ratio == 128 and flash.row(3).routing == "learned"
    assert flash.row(0).rope == "plain" and flash.row(0).routing == "hash"


def test_flash_nvfp4_totals(flash_nv):
    assert flash_nv.total_bytes == FLASH_NVFP4_TOTAL
    assert flash_nv.drafter_bytes == FLASH_MTP          # MTP experts stay MXFP4
    assert flash_nv.expert_format() == "nvfp4" and flash_nv.expert_format(drafter=True) == "mxfp4"
    assert flash_nv.total_bytes == sum(s.nbytes for s in expected_tensors(preset("flash"), "nvfp4"))


def test_pipeline_split_from_rows(flash):
    # Section 11: split after layer 21 -> 74.30 / 74.35 GiB (MXFP4, with MTP on GPU1).
    gpu0 = flash.row("embed").total + sum(flash.row(l).total for l in range(22))
    gpu1 = flash.total_bytes - gpu0
    assert (round(gpu0 / 2**30, 2), round(gpu1 / 2**30, 2)) == (74.30, 74.35)


def test_pro_totals():
    pro = census_of_preset(preset("pro"))
    assert pro.total_bytes == 864_704_792_696
    assert pro.n_tensors == 145_116
    assert pro.row(0).attn == "hca" and pro.row(0).ratio == 128


def test_0731_dspark_table_is_self_consistent():
    cfg = preset("flash-0731")
    c = census_of_preset(cfg)
    assert cfg.drafter_kind == "dspark"
    assert [r.tensors for r in c.drafter_rows] == [1568, 1565, 1572]
    assert sum(r.tensors for r in c.drafter_rows) == 4705
    # ~10.863 GB on disk for the drafter (published audit), trunk identical to Flash.
    assert round(c.drafter_bytes / 1e9, 3) == 10.863
    assert c.total_bytes - c.drafter_bytes == FLASH_TOTAL - FLASH_MTP
    assert c.total_bytes == sum(r.total for r in c.rows) == sum(s.nbytes for s in expected_tensors(cfg))
    assert c.n_tensors == len(expected_tensors(cfg))
    assert c.row("mtp.0").group_bytes["drafter_extra"] > 0       # main_proj + main_norm
    assert "drafter_extra" not in c.row("mtp.1").group_bytes
    assert all(r.attn == "sliding" and r.routing == "learned" for r in c.drafter_rows)
    # Flash + --drafter dspark is the same table.
    assert census_of_preset(with_drafter(preset("flash"), "dspark")).total_bytes == c.total_bytes


def test_census_of_checkpoint_matches_preset(tmp_path):
    cfg = preset("tiny")
    write_checkpoint(tmp_path / "c", cfg, synth_arrays(cfg, 1, "nvfp4"))
    from_ckpt = census_of_checkpoint(Checkpoint.open(tmp_path / "c"))
    from_table = census_of_preset(cfg, "nvfp4")
    assert [(r.unit, r.tensors, r.group_bytes, r.experts) for r in from_ckpt.rows] == \
           [(r.unit, r.tensors, r.group_bytes, r.experts) for r in from_table.rows]
    text = format_census(from_ckpt)
    assert "expert format: trunk nvfp4, drafter mxfp4" in text


def test_cli_preset_prints_totals(capsys):
    assert main(["--preset", "flash"]) == 0
    out = capsys.readouterr().out
    assert "grand total: 159,609,485,896 bytes (148.65 GiB) in 69,187 tensors" in out
    assert "drafter: mtp, 1 stage, 1,575 tensors, 3,593,787,756 bytes" in out
    assert "expert format: trunk mxfp4, drafter mxfp4" in out
    lines = out.splitlines()
    row2 = next(l for l in lines if l.startswith("2 "))
    assert row2.split()[:6] == ["2", "csa", "4", "hash", "yarn", "mxfp4"]
    assert row2.split()[-1] == "3,596,055,640"
    assert main(["--preset", "flash", "--experts", "nvfp4"]) == 0
    assert "168,266,793,544" in capsys.readouterr().out
    assert main(["--preset", "flash", "--drafter", "dspark"]) == 0
    assert "drafter: dspark, 3 stages, 4,705 tensors" in capsys.readouterr().out


def test_cli_directory(tmp_path, capsys):
    cfg = preset("tiny")
    write_checkpoint(tmp_path / "c", cfg, synth_arrays(cfg, 1))
    assert main([str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    total = sum(s.nbytes for s in expected_tensors(cfg))
    assert f"grand total: {total:,} bytes" in out and f"census of {tmp_path / 'c'}" in out


@pytest.mark.parametrize("argv, message", [
    ([], "give exactly one of DIR or --preset NAME"),
    (["somewhere", "--preset", "tiny"], "give exactly one of DIR or --preset NAME"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "tiny", "--experts", "int4"], "invalid choice: 'int4'"),
    (["DIR", "--experts", "nvfp4"], "--experts/--drafter apply to --preset only"),
    (["DIR"], "not a directory"),
])
def test_cli_errors_exit_2(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / "missing") if a == "DIR" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_directory_census_failure_prints_the_report(tmp_path, capsys):
    cfg = preset("tiny")
    arrays = synth_arrays(cfg, 1)
    write_checkpoint(tmp_path / "c", cfg, arrays)
    # Same weights under a config that claims one more layer: layer 4's tensors are missing.
    bigger = cfg.replace(num_hidden_layers=5, compress_ratios=(0, 4, 16, 4, 4, 0))
    (tmp_path / "c" / "config.json").write_text(json.dumps(bigger.to_hf_dict()))
    assert main([str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "tensor census failed" in err and "missing: layers.4." in err
