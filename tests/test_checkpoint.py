"""Checkpoint: header parsing, every refusal, census, expert-kind detection, raw/dequant values.

Files are tiny synthetic checkpoints written by memra_dsv4.synth; each corruption test edits a
private copy and asserts the error names the file or tensor at fault.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from memra_dsv4.checkpoint import (INDEX_FILE, Checkpoint, CheckpointError, read_shard_header)
from memra_dsv4.config import preset
from memra_dsv4.synth import synth_arrays, with_drafter, write_checkpoint
from memra_dsv4.tensors import ITEMSIZE, expected_tensors

SEED = 7


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def tiny_arrays(tiny_cfg):
    return synth_arrays(tiny_cfg, SEED, "mxfp4")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_cfg, tiny_arrays):
    d = tmp_path_factory.mktemp("tiny") / "ckpt"
    write_checkpoint(d, tiny_cfg, tiny_arrays)
    return d


@pytest.fixture(scope="module")
def nvfp4_arrays(tiny_cfg):
    return synth_arrays(tiny_cfg, SEED, "nvfp4")


@pytest.fixture
def copy(tiny_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    return d


def _index(d):
    with open(d / INDEX_FILE) as fh:
        return json.load(fh)


def _write_index(d, index):
    with open(d / INDEX_FILE, "w") as fh:
        json.dump(index, fh)


def _shard_of(d, name):
    return d / _index(d)["weight_map"][name]


def _read_raw_header(path):
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        data = fh.read()
    return header, data


def _write_raw(path, header_bytes: bytes, data: bytes, length: int | None = None):
    with open(path, "wb") as fh:
        fh.write((len(header_bytes) if length is None else length).to_bytes(8, "little"))
        fh.write(header_bytes)
        fh.write(data)


def _rewrite_shard(d, shard, mutate):
    """Re-serialise `shard` after `mutate(tensors)`, tensors = {name: [dtype, shape, bytes]};
    offsets are recomputed (no holes) and the index follows the new name set."""
    header, data = _read_raw_header(shard)
    header.pop("__metadata__", None)
    tensors = {k: [v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]]
               for k, v in header.items()}
    mutate(tensors)
    new, blob, off = {}, b"", 0
    for name, (dtype, shape, payload) in tensors.items():
        new[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(payload)]}
        blob += payload
        off += len(payload)
    _write_raw(shard, json.dumps(new).encode(), blob)
    index = _index(d)
    wm = {k: v for k, v in index["weight_map"].items() if v != shard.name}
    wm.update({k: shard.name for k in tensors})
    index["weight_map"] = wm
    _write_index(d, index)


def _patch_bytes(d, name, new: bytes, at: int = 0):
    """Overwrite bytes of tensor `name` in place (offset `at` within the tensor)."""
    ckpt_loc = Checkpoint.open(d).location(name)
    path, begin, end = ckpt_loc
    assert begin + at + len(new) <= end
    with open(path, "r+b") as fh:
        fh.seek(begin + at)
        fh.write(new)


# ------------------------------------------------------------------------------ happy path
def test_synth_tiny_opens_and_passes_census(tiny_dir, tiny_cfg):
    ckpt = Checkpoint.open(tiny_dir)
    assert ckpt.config.replace(name="tiny") == tiny_cfg
    table = expected_tensors(tiny_cfg, "mxfp4")
    assert ckpt.names() == [s.name for s in table]
    assert ckpt.total_bytes() == sum(s.nbytes for s in table) == _index(tiny_dir)["metadata"]["total_size"]
    assert {ckpt.expert_kind(l) for l in range(5)} == {"mxfp4"}
    # One shard per unit in the official order: embed, 4 layers, head group, mtp.0.
    wm = _index(tiny_dir)["weight_map"]
    assert wm["embed.weight"] == "model-00001-of-00007.safetensors"
    assert wm["layers.3.ffn.gate.bias"] == "model-00005-of-00007.safetensors"
    assert wm["hc_head_fn"] == wm["head.weight"] == "model-00006-of-00007.safetensors"
    assert wm["mtp.0.e_proj.scale"] == "model-00007-of-00007.safetensors"


def test_raw_is_stored_bytes_memory_mapped(tiny_dir, tiny_arrays):
    ckpt = Checkpoint.open(tiny_dir)
    want_np = {"BF16": np.uint16, "F32": np.float32, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
               "I8": np.int8, "U8": np.uint8, "I64": np.int64}
    for name in ckpt.names():
        spec, raw = ckpt.spec(name), ckpt.raw(name)
        assert raw.dtype == want_np[spec.dtype], name
        assert raw.shape == spec.shape, name
        assert not raw.flags.writeable, name
        np.testing.assert_array_equal(raw, tiny_arrays[name], err_msg=name)
    # The view is backed by the file mapping, not a copy read at open.
    base = ckpt.raw("layers.2.ffn.experts.5.w2.weight")
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, mmap.mmap)


def test_safetensors_library_reads_our_shards(tiny_dir):
    safetensors = pytest.importorskip("safetensors")
    from safetensors import safe_open
    ckpt = Checkpoint.open(tiny_dir)
    wm = _index(tiny_dir)["weight_map"]
    for shard in sorted(set(wm.values())):
        try:
            with safe_open(str(tiny_dir / shard), "np") as fh:
                keys = set(fh.keys())
                f32 = [k for k in keys if ckpt.spec(k).dtype == "F32"]
                for k in f32:
                    np.testing.assert_array_equal(fh.get_tensor(k), ckpt.raw(k))
        except Exception as e:  # an old safetensors that cannot parse F8_E8M0 headers
            pytest.skip(f"safetensors {safetensors.__version__} cannot read F8 headers: {e}")
        assert keys == {k for k, v in wm.items() if v == shard}


def test_dequant_values_match_independent_decoders(tiny_dir):
    ckpt = Checkpoint.open(tiny_dir)
    # BF16: bits << 16.
    emb = ckpt.raw("embed.weight")
    np.testing.assert_array_equal(ckpt.dequant("embed.weight"),
                                  emb.view(ml_dtypes.bfloat16).astype(np.float32))
    assert abs(float(ckpt.dequant("embed.weight").std()) - 1.0) < 0.05
    # FP8 128x128 blocks, decoded with ml_dtypes.
    name = "layers.1.attn.wq_b.weight"
    q, s = ckpt.raw(name), ckpt.raw("layers.1.attn.wq_b.scale")
    scale = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    want = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.kron(scale, np.ones((128, 128), np.float32))
    got = ckpt.dequant(name)
    np.testing.assert_array_equal(got, want)
    fan_in = got.shape[1]
    assert abs(float(got.std()) * math.sqrt(fan_in) - 1.0) < 0.05
    np.testing.assert_array_equal(ckpt.dequant("layers.1.attn.wq_b.scale"), scale)
    # MXFP4: low nibble = even element, e8m0 per 32 (ml_dtypes float4 decodes the nibbles).
    name = "layers.0.ffn.experts.3.w3.weight"
    p = ckpt.raw(name).view(np.uint8)
    nib = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], -1)
    vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    sc = ckpt.raw("layers.0.ffn.experts.3.w3.scale").view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(ckpt.dequant(name), vals * np.repeat(sc, 32, axis=1))
    # F32 and I64 come back as they are stored.
    np.testing.assert_array_equal(ckpt.dequant("layers.2.hc_ffn_base"), ckpt.raw("layers.2.hc_ffn_base"))
    t = ckpt.dequant("layers.0.ffn.gate.tid2eid")
    assert t.dtype == np.int64 and t.shape == (512, 2)


def test_from_arrays_same_api(tiny_cfg, tiny_arrays, tiny_dir):
    mem, disk = Checkpoint.from_arrays(tiny_cfg, tiny_arrays), Checkpoint.open(tiny_dir)
    assert mem.names() == disk.names()
    for name in ("layers.3.attn.wo_b.weight", "mtp.0.ffn.experts.7.w2.weight", "head.weight"):
        np.testing.assert_array_equal(mem.dequant(name), disk.dequant(name))
    assert mem.location("head.weight") is None
    assert disk.location("head.weight")[0].endswith("model-00006-of-00007.safetensors")
    # ml_dtypes arrays are taken as their bits.
    arrays = dict(tiny_arrays)
    arrays["embed.weight"] = tiny_arrays["embed.weight"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(Checkpoint.from_arrays(tiny_cfg, arrays).raw("embed.weight"),
                                  tiny_arrays["embed.weight"])


def test_layer_bytes_units(tiny_dir, tiny_cfg):
    ckpt = Checkpoint.open(tiny_dir)
    table = expected_tensors(tiny_cfg)
    assert ckpt.layer_bytes("embed") == 512 * 256 * 2
    assert ckpt.layer_bytes("head") == sum(s.nbytes for s in table if s.layer is None) - 512 * 256 * 2
    assert ckpt.layer_bytes("mtp.0") == ckpt.layer_bytes(4) == ckpt.layer_bytes("drafter")
    units = ["embed", 0, 1, 2, 3, "head", "mtp.0"]
    assert sum(ckpt.layer_bytes(u) for u in units) == ckpt.total_bytes()
    assert sum(ckpt.group_bytes(2).values()) == ckpt.layer_bytes(2)
    assert set(ckpt.group_bytes(0)) == {"attn", "norm_hc", "gate", "shared", "experts"}
    for bad in (5, -1, "mtp.1", "layers.0", True):
        with pytest.raises(CheckpointError, match="unknown unit"):
            ckpt.layer_bytes(bad)


# ------------------------------------------------------------------------------ file refusals
def test_truncated_shard(copy):
    shard = _shard_of(copy, "layers.1.attn.wq_a.weight")
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*truncated"):
        Checkpoint.open(copy)


def test_header_length_past_end_of_file(copy):
    shard = _shard_of(copy, "head.weight")
    header, data = _read_raw_header(shard)
    _write_raw(shard, json.dumps(header).encode(), data, length=10**12)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: header length 1000000000000 runs past"):
        Checkpoint.open(copy)


def test_file_shorter_than_header_length_field(copy):
    shard = _shard_of(copy, "embed.weight")
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=rf"{shard.name}: 2 bytes, too short"):
        Checkpoint.open(copy)


def test_header_not_json(copy):
    shard = _shard_of(copy, "embed.weight")
    header, data = _read_raw_header(shard)
    garbage = b"{not json" + b" " * (len(json.dumps(header)) - 9)
    _write_raw(shard, garbage, data)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: header is not valid JSON"):
        Checkpoint.open(copy)


def test_header_not_an_object(copy):
    shard = _shard_of(copy, "embed.weight")
    _, data = _read_raw_header(shard)
    _write_raw(shard, b"[1, 2, 3]", data)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: header is a JSON list, not an object"):
        Checkpoint.open(copy)


def test_header_duplicate_name(copy):
    shard = _shard_of(copy, "embed.weight")
    header, data = _read_raw_header(shard)
    entry = json.dumps(header["embed.weight"])
    text = '{"embed.weight": %s, "embed.weight": %s}' % (entry, entry)
    _write_raw(shard, text.encode(), data)
    with pytest.raises(CheckpointError, match=r"header lists 'embed.weight' twice"):
        Checkpoint.open(copy)


def test_overlapping_offsets(copy):
    shard = _shard_of(copy, "layers.0.attn_norm.weight")
    header, data = _read_raw_header(shard)
    # Two BF16 [256] tensors: point the second at the first one's bytes.
    header["layers.0.ffn_norm.weight"]["data_offsets"] = header["layers.0.attn_norm.weight"]["data_offsets"]
    _write_raw(shard, json.dumps(header).encode(), data)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor 'layers.0.(attn|ffn)_norm.weight'"
                                              r".*overlaps 'layers.0.(attn|ffn)_norm.weight'"):
        Checkpoint.open(copy)


def test_offsets_not_matching_dtype_times_shape(copy):
    shard = _shard_of(copy, "layers.2.attn.attn_sink")
    header, data = _read_raw_header(shard)
    header["layers.2.attn.attn_sink"]["shape"] = [5]   # 4 heads stored, 5 claimed
    _write_raw(shard, json.dumps(header).encode(), data)
    with pytest.raises(CheckpointError, match=r"tensor 'layers.2.attn.attn_sink': data_offsets "
                                              r"\[\d+, \d+\] hold 16 bytes but F32 \[5\] needs 20"):
        Checkpoint.open(copy)


def test_unknown_dtype(copy):
    shard = _shard_of(copy, "layers.2.attn.attn_sink")
    header, data = _read_raw_header(shard)
    header["layers.2.attn.attn_sink"]["dtype"] = "Q4_K"
    _write_raw(shard, json.dumps(header).encode(), data)
    with pytest.raises(CheckpointError, match=r"tensor 'layers.2.attn.attn_sink': unknown dtype 'Q4_K'"):
        Checkpoint.open(copy)


def test_hole_and_trailing_bytes(copy):
    shard = _shard_of(copy, "head.weight")
    header, data = _read_raw_header(shard)
    _write_raw(shard, json.dumps(header).encode(), data + b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: 8 bytes after the last tensor"):
        Checkpoint.open(copy)
    # Shift every tensor by 4 bytes: the first 4 data bytes are indexed by no tensor.
    for v in header.values():
        if isinstance(v, dict) and "data_offsets" in v:
            v["data_offsets"] = [o + 4 for o in v["data_offsets"]]
    _write_raw(shard, json.dumps(header).encode(), b"\0" * 4 + data)
    with pytest.raises(CheckpointError, match=r"4 unindexed bytes before tensor"):
        Checkpoint.open(copy)


def test_index_points_at_missing_shard(copy):
    index = _index(copy)
    index["weight_map"]["layers.3.ffn.gate.bias"] = "model-00099-of-00007.safetensors"
    _write_index(copy, index)
    with pytest.raises(CheckpointError, match=r"to shard 'model-00099-of-00007.safetensors', which "
                                              r"does not exist"):
        Checkpoint.open(copy)


def test_index_tensor_missing_from_named_shard(copy):
    index = _index(copy)
    index["weight_map"]["layers.3.ffn.gate.bias"] = index["weight_map"]["embed.weight"]
    _write_index(copy, index)
    # Two refusals are possible; whichever shard is read first, the offending tensor is named.
    with pytest.raises(CheckpointError, match=r"'layers.3.ffn.gate.bias'"):
        Checkpoint.open(copy)


def test_shard_tensor_the_index_does_not_list(copy):
    index = _index(copy)
    del index["weight_map"]["mtp.0.enorm.weight"]
    _write_index(copy, index)
    with pytest.raises(CheckpointError, match=r"holds 1 tensors the index does not map to it, e.g. "
                                              r"'mtp.0.enorm.weight'"):
        Checkpoint.open(copy)


def test_index_shard_name_outside_directory(copy):
    index = _index(copy)
    index["weight_map"]["embed.weight"] = "../elsewhere.safetensors"
    _write_index(copy, index)
    with pytest.raises(CheckpointError, match=r"'embed.weight' maps to '../elsewhere.safetensors', "
                                              r"which is not a plain file name"):
        Checkpoint.open(copy)


def test_index_not_json_and_no_index(copy):
    (copy / INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: not valid JSON"):
        Checkpoint.open(copy)
    os.remove(copy / INDEX_FILE)
    with pytest.raises(CheckpointError, match=r"7 \*.safetensors files but no model.safetensors.index.json"):
        Checkpoint.open(copy)


def test_single_file_checkpoint_without_index(tmp_path, tiny_cfg, tiny_arrays, tiny_dir):
    """A single *.safetensors is read without an index (one merged shard)."""
    d = tmp_path / "single"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    ckpt = Checkpoint.open(tiny_dir)
    tensors, blob, off = {}, [], 0
    for name in ckpt.names():
        payload = np.ascontiguousarray(ckpt.raw(name)).tobytes()
        spec = ckpt.spec(name)
        tensors[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [off, off + len(payload)]}
        blob.append(payload)
        off += len(payload)
    _write_raw(d / "model.safetensors", json.dumps(tensors).encode(), b"".join(blob))
    single = Checkpoint.open(d)
    assert single.names() == ckpt.names()
    np.testing.assert_array_equal(single.dequant("mtp.0.h_proj.weight"), ckpt.dequant("mtp.0.h_proj.weight"))


# ------------------------------------------------------------------------------ census refusals
def test_wrong_shape(copy):
    name = "layers.1.attn.attn_sink"
    _rewrite_shard(copy, _shard_of(copy, name), lambda t: t[name].__setitem__(1, [2, 2]))
    with pytest.raises(CheckpointError, match=r"1 wrong shape: layers.1.attn.attn_sink \(stored "
                                              r"\[2, 2\], expected \[4\]\)"):
        Checkpoint.open(copy)


def test_wrong_dtype(copy):
    name = "layers.1.hc_attn_scale"
    _rewrite_shard(copy, _shard_of(copy, name), lambda t: t[name].__setitem__(0, "I32"))
    with pytest.raises(CheckpointError, match=r"1 wrong dtype: layers.1.hc_attn_scale \(stored I32, "
                                              r"expected F32\)"):
        Checkpoint.open(copy)


def test_missing_tensor(copy):
    name = "layers.2.ffn.shared_experts.w2.scale"
    _rewrite_shard(copy, _shard_of(copy, name), lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"1 missing: layers.2.ffn.shared_experts.w2.scale"):
        Checkpoint.open(copy)


def test_unexpected_tensor(copy):
    shard = _shard_of(copy, "layers.0.attn_norm.weight")
    _rewrite_shard(copy, shard, lambda t: t.__setitem__("layers.0.attn.bonus", ["F32", [2], b"\0" * 8]))
    with pytest.raises(CheckpointError, match=r"1 unexpected: layers.0.attn.bonus"):
        Checkpoint.open(copy)


def test_census_lists_first_ten_with_counts(tiny_cfg, tiny_arrays):
    arrays = {k: v for k, v in tiny_arrays.items() if ".ffn.experts.1." not in k}   # 5 blocks x 6
    arrays["embed.weight"] = tiny_arrays["embed.weight"].astype(np.float32)          # F32, not BF16
    arrays["head.weight"] = tiny_arrays["head.weight"][:10]
    with pytest.raises(CheckpointError) as err:
        Checkpoint.from_arrays(tiny_cfg, arrays)
    msg = str(err.value)
    assert "30 missing: layers.0.ffn.experts.1.w1.weight, layers.0.ffn.experts.1.w1.scale" in msg
    assert "(20 more)" in msg
    assert msg.count("ffn.experts.1.") == 10
    assert "1 wrong dtype: embed.weight (stored F32, expected BF16)" in msg
    assert "1 wrong shape: head.weight (stored [10, 256], expected [512, 256])" in msg
    assert "unexpected" not in msg


def test_from_arrays_refuses_non_storage_dtypes(tiny_cfg, tiny_arrays):
    arrays = dict(tiny_arrays)
    arrays["layers.0.hc_attn_base"] = arrays["layers.0.hc_attn_base"].astype(np.complex64)
    with pytest.raises(CheckpointError, match=r"'layers.0.hc_attn_base' has NumPy dtype complex64"):
        Checkpoint.from_arrays(tiny_cfg, arrays)


# ------------------------------------------------------------------------------ value refusals
def test_e8m0_nan_scale_refused_at_dequant(copy):
    _patch_bytes(copy, "layers.1.attn.wq_a.scale", b"\xff", at=1)
    ckpt = Checkpoint.open(copy)   # values are not read at open
    with pytest.raises(CheckpointError, match=r"layers.1.attn.wq_a.weight \(scale\): 1 F8_E8M0 NaN "
                                              r"codes \(0xFF\).*first at flat index 1"):
        ckpt.dequant("layers.1.attn.wq_a.weight")
    with pytest.raises(CheckpointError, match=r"layers.1.attn.wq_a.scale: 1 F8_E8M0 NaN"):
        ckpt.dequant("layers.1.attn.wq_a.scale")
    ckpt.dequant("layers.0.attn.wq_a.weight")   # other tensors unaffected


def test_e8m0_nan_in_expert_scale(copy):
    _patch_bytes(copy, "mtp.0.ffn.experts.2.w2.scale", b"\xff")
    with pytest.raises(CheckpointError, match=r"model-00007-of-00007.safetensors: "
                                              r"mtp.0.ffn.experts.2.w2.weight \(scale\)"):
        Checkpoint.open(copy).dequant("mtp.0.ffn.experts.2.w2.weight")


def test_e4m3_nan_code_in_fp8_weight(copy):
    _patch_bytes(copy, "layers.3.ffn.shared_experts.w1.weight", b"\x7f")
    with pytest.raises(CheckpointError, match=r"layers.3.ffn.shared_experts.w1.weight: 1 F8_E4M3 NaN"):
        Checkpoint.open(copy).dequant("layers.3.ffn.shared_experts.w1.weight")


def test_nonfinite_bf16_and_f32_refused(tiny_cfg, tiny_arrays):
    arrays = dict(tiny_arrays)
    arrays["layers.1.ffn_norm.weight"] = tiny_arrays["layers.1.ffn_norm.weight"].copy()
    arrays["layers.1.ffn_norm.weight"][3] = 0x7FC0   # bf16 NaN
    arrays["layers.2.ffn.gate.bias"] = tiny_arrays["layers.2.ffn.gate.bias"].copy()
    arrays["layers.2.ffn.gate.bias"][0] = np.inf
    ckpt = Checkpoint.from_arrays(tiny_cfg, arrays)
    with pytest.raises(CheckpointError, match=r"layers.1.ffn_norm.weight: 1 non-finite values "
                                              r"\(first at flat index 3\)"):
        ckpt.dequant("layers.1.ffn_norm.weight")
    with pytest.raises(CheckpointError, match=r"layers.2.ffn.gate.bias: 1 non-finite"):
        ckpt.dequant("layers.2.ffn.gate.bias")


@pytest.fixture
def nvfp4_dir(tmp_path, tiny_cfg, nvfp4_arrays):
    d = tmp_path / "nv"
    write_checkpoint(d, tiny_cfg, nvfp4_arrays)
    return d


def test_nvfp4_weight_scale_2_zero_refused(nvfp4_dir):
    name = "layers.2.ffn.experts.4.w3"
    _patch_bytes(nvfp4_dir, f"{name}.weight_scale_2", np.float32(0).tobytes())
    ckpt = Checkpoint.open(nvfp4_dir)
    with pytest.raises(CheckpointError, match=rf"{name}.weight: weight_scale_2 = 0.0 is not a finite "
                                              r"float32 > 0"):
        ckpt.dequant(f"{name}.weight")
    with pytest.raises(CheckpointError, match=rf"{name}.weight_scale_2 = 0.0; NVFP4 scales must be"):
        ckpt.dequant(f"{name}.weight_scale_2")
    ckpt.dequant(f"{name.replace('w3', 'w1')}.weight")


# ------------------------------------------------------------------------------ expert kinds
def test_expert_kind_per_layer_on_nvfp4(nvfp4_dir, tiny_cfg):
    ckpt = Checkpoint.open(nvfp4_dir)
    assert [ckpt.expert_kind(l) for l in range(4)] == ["nvfp4"] * 4
    assert ckpt.expert_kind(4) == ckpt.expert_kind("mtp.0") == "mxfp4"
    assert ckpt.spec("layers.0.ffn.experts.0.w1.weight").dtype == "U8"
    assert ckpt.spec("mtp.0.ffn.experts.0.w1.weight").dtype == "I8"
    assert ckpt.names() == [s.name for s in expected_tensors(tiny_cfg, "nvfp4")]
    assert ckpt.total_bytes() == sum(s.nbytes for s in expected_tensors(tiny_cfg, "nvfp4"))
    with pytest.raises(CheckpointError, match="has no routed experts"):
        ckpt.expert_kind("embed")


def test_expert_kind_mixed_across_layers(tiny_cfg, tiny_arrays, nvfp4_arrays):
    """Layer 1 MXFP4, other trunk layers NVFP4: decided per layer, census passes."""
    arrays = {k: v for k, v in nvfp4_arrays.items() if not k.startswith("layers.1.ffn.experts.")}
    arrays.update({k: v for k, v in tiny_arrays.items() if k.startswith("layers.1.ffn.experts.")})
    ckpt = Checkpoint.from_arrays(tiny_cfg, arrays)
    assert ckpt.expert_kinds == {0: "nvfp4", 1: "mxfp4", 2: "nvfp4", 3: "nvfp4", 4: "mxfp4"}
    assert ckpt.spec("layers.1.ffn.experts.0.w2.scale").dtype == "F8_E8M0"
    # Same seed: the MXFP4 layer and the NVFP4 layers decode to the same values as pure MXFP4.
    ref = Checkpoint.from_arrays(tiny_cfg, tiny_arrays)
    for name in ("layers.1.ffn.experts.6.w1.weight", "layers.2.ffn.experts.6.w1.weight"):
        np.testing.assert_array_equal(ckpt.dequant(name), ref.dequant(name))


def test_expert_kind_mixed_within_layer_refused(tiny_cfg, tiny_arrays, nvfp4_arrays):
    arrays = {k: v for k, v in nvfp4_arrays.items() if not k.startswith("layers.2.ffn.experts.3.")}
    arrays.update({k: v for k, v in tiny_arrays.items() if k.startswith("layers.2.ffn.experts.3.")})
    with pytest.raises(CheckpointError, match=r"layer 2 mixes expert formats: layers.2.ffn.experts.\d.w\d "
                                              r"is NVFP4 .* but layers.2.ffn.experts.3.w\d is MXFP4"):
        Checkpoint.from_arrays(tiny_cfg, arrays)
    # One matrix with both sidecar families.
    arrays = dict(tiny_arrays)
    arrays["layers.0.ffn.experts.0.w1.weight_scale_2"] = np.array(1.0, np.float32)
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.experts.0.w1: has both the MXFP4 sidecar"):
        Checkpoint.from_arrays(tiny_cfg, arrays)


def test_nvfp4_drafter_experts_refused(tiny_cfg, tiny_arrays, nvfp4_arrays):
    arrays = {k: v for k, v in tiny_arrays.items() if not k.startswith("mtp.0.ffn.experts.")}
    arrays.update({k.replace("layers.0.", "mtp.0."): v for k, v in nvfp4_arrays.items()
                   if k.startswith("layers.0.ffn.experts.")})
    with pytest.raises(CheckpointError, match=r"drafter stage mtp.0 stores NVFP4 experts"):
        Checkpoint.from_arrays(tiny_cfg, arrays)


def test_wrong_dtype_under_nvfp4_signature_is_a_census_error(tiny_cfg, nvfp4_arrays):
    arrays = dict(nvfp4_arrays)
    arrays["layers.3.ffn.experts.0.w2.weight"] = nvfp4_arrays["layers.3.ffn.experts.0.w2.weight"].view(np.int8)
    with pytest.raises(CheckpointError, match=r"1 wrong dtype: layers.3.ffn.experts.0.w2.weight "
                                              r"\(stored I8, expected U8\)"):
        Checkpoint.from_arrays(tiny_cfg, arrays)


# ------------------------------------------------------------------------------ drafters
def test_dspark_checkpoint_routes_to_dspark_table(tmp_path, tiny_cfg):
    cfg = with_drafter(tiny_cfg, "dspark")
    d = tmp_path / "dspark"
    write_checkpoint(d, cfg, synth_arrays(cfg, SEED))
    ckpt = Checkpoint.open(d)
    assert ckpt.config.drafter_kind == "dspark"
    assert ckpt.config.dspark_target_layer_ids == (1, 2, 3)
    names = set(ckpt.names())
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.markov_head.markov_w1",
            "mtp.2.confidence_head.proj", "mtp.2.hc_head_fn"} <= names
    assert not any(n.startswith("mtp.0.e_proj") or n.startswith("mtp.0.enorm") for n in names)
    assert ckpt.spec("mtp.0.main_proj.weight").shape == (256, 3 * 256)
    assert [ckpt.expert_kind(f"mtp.{s}") for s in range(3)] == ["mxfp4"] * 3
    assert ckpt.layer_bytes("drafter") == sum(ckpt.layer_bytes(f"mtp.{s}") for s in range(3))


def test_mtp_checkpoint_under_dspark_config_refused(tiny_dir, tiny_cfg):
    with pytest.raises(CheckpointError, match=r"config declares a DSpark drafter \(dspark_\* keys\) "
                                              r"but the checkpoint holds a NextN/MTP block \('mtp.0.e"):
        Checkpoint.open(tiny_dir, config=with_drafter(tiny_cfg, "dspark"))
    # The same through config.json: a DSpark config next to MTP weights.
    cfg = with_drafter(tiny_cfg, "dspark")
    arrays = synth_arrays(tiny_cfg, SEED)
    with pytest.raises(CheckpointError, match="NextN/MTP"):
        Checkpoint.from_arrays(cfg, arrays)


def test_dspark_checkpoint_under_mtp_config_refused(tiny_cfg):
    cfg = with_drafter(tiny_cfg, "dspark")
    with pytest.raises(CheckpointError, match=r"holds DSpark drafter tensors \('mtp.0.main_"
                                              r".*config has no dspark_\* keys"):
        Checkpoint.from_arrays(tiny_cfg, synth_arrays(cfg, SEED))


def test_no_drafter_checkpoint(tiny_cfg, tiny_arrays):
    cfg = with_drafter(tiny_cfg, "none")
    trunk = {k: v for k, v in tiny_arrays.items() if not k.startswith("mtp.")}
    ckpt = Checkpoint.from_arrays(cfg, trunk)
    assert len(ckpt) == len(trunk)
    with pytest.raises(CheckpointError, match=r"\d+ unexpected: mtp.0."):
        Checkpoint.from_arrays(cfg, tiny_arrays)


# ------------------------------------------------------------------------------ headers alone
def test_read_shard_header_does_not_read_data(tmp_path):
    """A 4 GiB sparse shard: the header is parsed without touching the data."""
    path = tmp_path / "big.safetensors"
    header = json.dumps({"w": {"dtype": "U8", "shape": [2**16, 2**16], "data_offsets": [0, 2**32]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)
    with open(path, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.truncate(8 + len(header) + 2**32)
    t = read_shard_header(str(path))["w"]
    assert (t.dtype, t.shape, t.end - t.begin) == ("U8", (65536, 65536), 2**32)
    assert t.nbytes == math.prod(t.shape) * ITEMSIZE["U8"]


def test_open_errors_for_non_directory_and_bad_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint.open(tmp_path / "nope")
    from memra_dsv4.config import ConfigError
    (tmp_path / "config.json").write_text("{]")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Checkpoint.open(tmp_path)
