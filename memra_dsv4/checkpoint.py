"""Checkpoint access: safetensors shards parsed and validated by us, memory-mapped, census-checked.

Contract
--------
* `Checkpoint.open(dir, config=None)` reads the config (`Dsv4Config.from_checkpoint`) unless one
  is given, then `model.safetensors.index.json` (`weight_map`) or, without an index, the single
  `*.safetensors` file.  Every shard header is parsed here (8-byte little-endian length + JSON),
  never by the `safetensors` package, so every dtype string (F8_E8M0, U8, ...) is understood
  whatever version is installed.  Data are memory-mapped lazily; nothing is read at open except
  the headers.
* Nothing counts as loaded until all of this holds, each failure a `CheckpointError` naming the
  file and, where there is one, the tensor: the header length fits in the file; the header is a
  JSON object without duplicate names; every entry has a known dtype, a shape of non-negative
  ints and `data_offsets` whose length is exactly dtype x shape; entries neither overlap nor leave
  holes, and the data section ends exactly at the end of the file (truncation is caught here);
  the index names only existing shards and only tensors those shards hold, and every tensor of
  a referenced shard is in the index.
* Census: the stored set is compared with `expected_tensors(cfg)`, with the routed-expert format
  decided per layer from what is stored (see `detect_expert_kinds`), never from the path or the
  config.  Missing, unexpected, wrong-shape and wrong-dtype tensors are reported together, the
  first 10 of each kind by name with counts.  A config with `dspark_*` keys is checked against
  the DSpark table only; a NextN/MTP checkpoint under a DSpark config (or the reverse) fails with
  a message saying exactly that.
* Access: `names()` / `specs()` (table order), `spec(name)` (the expected `TensorSpec`, equal
  in dtype and shape to what is stored), `raw(name)` (read-only NumPy view of the stored bytes in the storage dtype: BF16 as
  uint16, F8_* and U8 as uint8, I8 as int8, shape as stored), `dequant(name)` (exact float32;
  int64 for I64; bf16/f32 NaN or inf refused), `expert_kind(layer)` / `expert_kinds`,
  `dequant(name, np.float64)` (the same values as float64), `dequant_rows(name, rows)` (BF16/F32
  rows only: the embedding lookup without decoding the table),
  `layer_bytes(unit)`, `group_bytes(unit)`, `total_bytes()`, `location(name)` (shard path and
  absolute byte range, for direct-to-device readers).  Decoder refusals (e8m0 0xFF, e4m3 NaN
  codes, weight_scale_2 <= 0) raise `CheckpointError` naming the file and tensor.
* Placement units (`layer_bytes`, `group_bytes`, `placement_units`): an int is a layer id as in
  `TensorSpec.layer` (trunk 0..n-1, drafter stage s = n + s); the strings `"embed"`, `"head"`
  (head.weight + norm + hc_head), `"mtp.S"` (drafter stage S) and `"drafter"` (all stages).
* `Checkpoint.from_arrays(config, arrays)` is the same object over in-memory stored arrays
  (name -> ndarray in the storage dtype; ml_dtypes bfloat16/float8 arrays are accepted and viewed
  as their bits), validated by the same census.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .config import DRAFTER_DSPARK, QUANT_BLOCK, Dsv4Config
from .formats import (
    DTYPE_ITEMSIZE,
    FormatError,
    decode_bf16,
    decode_e4m3,
    decode_e8m0,
    dequant_fp8_block,
    dequant_mxfp4,
    dequant_nvfp4,
    numpy_storage_dtype,
)
from .tensors import G_EMBED, TensorSpec, expected_tensors

__all__ = [
    "CheckpointError", "Checkpoint", "StoredTensor", "INDEX_FILE", "EXPERT_MXFP4", "EXPERT_NVFP4",
    "detect_expert_kinds", "expected_for_kinds", "placement_units", "unit_of", "specs_by_unit",
    "unit_label",
]

INDEX_FILE = "model.safetensors.index.json"
EXPERT_MXFP4, EXPERT_NVFP4 = "mxfp4", "nvfp4"
# safetensors itself refuses headers above 100 MB; a larger length is a corrupt length field.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# How many offenders of each kind a census error lists by name.
MAX_LISTED = 10

# <layer prefix>.ffn.experts.<e>.w<1|2|3>.<part>
_EXPERT_RE = re.compile(
    r"^(?:layers\.(\d+)|mtp\.(\d+))\.ffn\.experts\.(\d+)\.(w[123])\."
    r"(weight|scale|weight_scale|weight_scale_2|input_scale)$")
_NVFP4_SIDECARS = ("weight_scale", "weight_scale_2", "input_scale")
_DRAFTER_RE = re.compile(r"^mtp\.\d+\.(.+)$")
# NextN (MTP) and DSpark drafters both live under mtp.*; these names tell them apart.
_MTP_MARKERS = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
_DSPARK_MARKERS = ("main_proj.weight", "main_norm.weight", "markov_head.markov_w1",
                   "markov_head.markov_w2", "confidence_head.proj")
# ml_dtypes arrays are accepted by from_arrays and viewed as their stored bits.
_ML_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0"}
# Default safetensors dtype of a NumPy storage dtype, used when the expected table does not
# disambiguate (uint8 could be U8 or either F8 format).
_DEFAULT_ST_DTYPE = {"u2": "BF16", "f2": "F16", "f4": "F32", "f8": "F64", "u1": "U8",
                     "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64", "b1": "BOOL"}


class CheckpointError(ValueError):
    """A checkpoint file, index or tensor inventory we refuse; the message names file/tensor."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored: safetensors dtype string, shape, and where its bytes are."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str | None   # shard path; None for in-memory arrays
    begin: int = 0     # absolute byte offsets in `file`
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


# ---------------------------------------------------------------------------------- headers
def read_shard_header(path: str) -> dict[str, StoredTensor]:
    """Parse and validate one safetensors file's header without touching its data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for the 8-byte header length")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} runs past the end of the file "
                                      f"({size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {n} exceeds the safetensors limit "
                                      f"of {MAX_HEADER_BYTES} bytes")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None

    def no_duplicates(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CheckpointError(f"{path}: header lists {k!r} twice")
            seen[k] = v
        return seen

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is not an object")

    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, StoredTensor] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: tensor {name!r}: header entry must be an object with "
                                  f"exactly dtype, shape, data_offsets; got {entry!r}")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r} "
                                  f"(known: {', '.join(sorted(DTYPE_ITEMSIZE))})")
        if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
            raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of "
                                  f"non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)
                and offs[0] <= offs[1]):
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offs!r} is not "
                                  f"[begin, end] with 0 <= begin <= end")
        need = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if offs[1] - offs[0] != need:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offs} hold "
                                  f"{offs[1] - offs[0]} bytes but {dtype} {shape} needs {need}")
        if offs[1] > data_len:
            raise CheckpointError(f"{path}: tensor {name!r}: data ends at byte {data_start + offs[1]} "
                                  f"but the file has {size} bytes (truncated shard)")
        out[name] = StoredTensor(name, dtype, tuple(shape), path,
                                 data_start + offs[0], data_start + offs[1])
    # The data section must be indexed exactly: no overlaps, no holes, nothing trailing
    # (the same rule the safetensors library enforces).
    cursor, prev = data_start, None
    for t in sorted(out.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < cursor:
            raise CheckpointError(f"{path}: tensor {t.name!r} (bytes {t.begin - data_start}.."
                                  f"{t.end - data_start}) overlaps {prev!r}")
        if t.begin > cursor:
            raise CheckpointError(f"{path}: {t.begin - cursor} unindexed bytes before tensor "
                                  f"{t.name!r} (a hole in the data section)")
        cursor, prev = t.end, t.name
    if cursor != size:
        raise CheckpointError(f"{path}: {size - cursor} bytes after the last tensor are not "
                              f"indexed by the header")
    return out


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_index(dirpath: str) -> dict[str, StoredTensor]:
    index_path = os.path.join(dirpath, INDEX_FILE)
    if not os.path.isfile(index_path):
        shards = sorted(f for f in os.listdir(dirpath) if f.endswith(".safetensors"))
        if len(shards) == 1:
            return read_shard_header(os.path.join(dirpath, shards[0]))
        if not shards:
            raise CheckpointError(f"{dirpath}: no {INDEX_FILE} and no *.safetensors file")
        raise CheckpointError(f"{dirpath}: {len(shards)} *.safetensors files but no {INDEX_FILE} "
                              f"saying which tensor lives where")
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index_path}: needs a 'weight_map' object of tensor name -> shard file")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    # Every referenced shard must exist before any header is read: a missing file is an index
    # problem and is reported as such, not as a side effect of another shard's contents.
    for shard, names in by_shard.items():
        # A shard name is a plain file in this directory; never follow a path out of it.
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: tensor {names[0]!r} maps to {shard!r}, which is "
                                  f"not a plain file name in the checkpoint directory")
        if not os.path.isfile(os.path.join(dirpath, shard)):
            raise CheckpointError(f"{index_path}: maps {len(names)} tensors (e.g. {names[0]!r}) "
                                  f"to shard {shard!r}, which does not exist")
    stored: dict[str, StoredTensor] = {}
    for shard, names in by_shard.items():
        path = os.path.join(dirpath, shard)
        header = read_shard_header(path)
        absent = [n for n in names if n not in header]
        if absent:
            raise CheckpointError(f"{path}: the index maps {len(absent)} tensors here that the "
                                  f"shard does not hold, e.g. {absent[0]!r}")
        unlisted = sorted(set(header) - set(names))
        if unlisted:
            raise CheckpointError(f"{path}: holds {len(unlisted)} tensors the index does not map "
                                  f"to it, e.g. {unlisted[0]!r}")
        stored.update(header)
    return stored


# ---------------------------------------------------------------------------------- census
def _layer_of_prefix(cfg: Dsv4Config, trunk: str | None, stage: str | None) -> int:
    return int(trunk) if trunk is not None else cfg.num_hidden_layers + int(stage)


def detect_expert_kinds(cfg: Dsv4Config, stored: Mapping[str, StoredTensor]) -> dict[int, str]:
    """Routed-expert format of every layer (trunk and drafter), from the stored tensors.

    An expert matrix is NVFP4 when it carries any of modelopt's sidecars (weight_scale,
    weight_scale_2, input_scale), MXFP4 when it carries `.scale`; a matrix with no sidecar at all
    is classified by its weight dtype (U8 -> NVFP4, I8 -> MXFP4).  Only names and dtypes are
    used: paths, config and quantization_config are not trusted.  A matrix or a layer whose
    signals disagree is refused.  A layer with no expert tensors defaults to MXFP4 (the census
    then reports them missing); wrong dtypes under a clear signature are left to the census.
    """
    matrices: dict[tuple[int, str], dict[str, str]] = {}   # (layer, "e.wN") -> part -> dtype
    for name, t in stored.items():
        m = _EXPERT_RE.match(name)
        if m:
            layer = _layer_of_prefix(cfg, m.group(1), m.group(2))
            matrices.setdefault((layer, f"{m.group(3)}.{m.group(4)}"), {})[m.group(5)] = t.dtype
    votes: dict[int, dict[str, str]] = {}   # layer -> kind -> an example matrix
    for (layer, matrix), parts in matrices.items():
        prefix = f"{_layer_prefix(cfg, layer)}.ffn.experts.{matrix}"
        nv = sorted(p for p in parts if p in _NVFP4_SIDECARS)
        if nv and "scale" in parts:
            raise CheckpointError(f"{prefix}: has both the MXFP4 sidecar '.scale' and NVFP4 "
                                  f"sidecars {nv}; a matrix is one format or the other")
        if nv or ("scale" not in parts and parts.get("weight") == "U8"):
            kind = EXPERT_NVFP4
        elif "scale" in parts or parts.get("weight") == "I8":
            kind = EXPERT_MXFP4
        else:
            continue  # only a weight of some other dtype: the census reports it
        votes.setdefault(layer, {}).setdefault(kind, prefix)
    kinds = {}
    for layer in range(cfg.num_hidden_layers + cfg.num_drafter_stages):
        v = votes.get(layer, {})
        if len(v) == 2:
            raise CheckpointError(
                f"layer {unit_label(cfg, layer)} mixes expert formats: {v[EXPERT_NVFP4]} is NVFP4 "
                f"(weight_scale/weight_scale_2/input_scale) but {v[EXPERT_MXFP4]} is MXFP4 (.scale)")
        kinds[layer] = next(iter(v), EXPERT_MXFP4)
        if layer >= cfg.num_hidden_layers and kinds[layer] == EXPERT_NVFP4:
            raise CheckpointError(
                f"drafter stage {unit_label(cfg, layer)} stores NVFP4 experts (e.g. "
                f"{v[EXPERT_NVFP4]}); released checkpoints keep drafter experts MXFP4 and the "
                f"expected-tensor table has no NVFP4 drafter")
    return kinds


def expected_for_kinds(cfg: Dsv4Config, kinds: Mapping[int, str]) -> list[TensorSpec]:
    """The expected table with each layer's experts in its own format (table order kept)."""
    table = expected_tensors(cfg, EXPERT_MXFP4)
    nv_layers = {l for l, k in kinds.items() if k == EXPERT_NVFP4}
    if not nv_layers:
        return table
    nv_specs: dict[int, list[TensorSpec]] = {}
    for s in expected_tensors(cfg, EXPERT_NVFP4):
        if s.layer in nv_layers:
            nv_specs.setdefault(s.layer, []).append(s)
    # Walk the MXFP4 table and swap each NVFP4 layer's block for the NVFP4 table's, whole.
    out: list[TensorSpec] = []
    for s in table:
        if s.layer in nv_layers:
            out.extend(nv_specs.pop(s.layer, ()))
        else:
            out.append(s)
    return out


def _check_drafter_kind(cfg: Dsv4Config, stored: Mapping[str, StoredTensor], source: str) -> None:
    tails = {n: m.group(1) for n in stored if (m := _DRAFTER_RE.match(n))}
    mtp = sorted(n for n, tail in tails.items() if tail in _MTP_MARKERS)
    dspark = sorted(n for n, tail in tails.items() if tail in _DSPARK_MARKERS)
    if cfg.drafter_kind == DRAFTER_DSPARK and mtp:
        raise CheckpointError(
            f"{source}: the config declares a DSpark drafter (dspark_* keys) but the checkpoint "
            f"holds a NextN/MTP block ({mtp[0]!r}, {len(mtp)} MTP-only tensors); refusing to load "
            f"MTP weights as DSpark stages")
    if cfg.drafter_kind != DRAFTER_DSPARK and dspark:
        raise CheckpointError(
            f"{source}: the checkpoint holds DSpark drafter tensors ({dspark[0]!r}) but the config "
            f"has no dspark_* keys (drafter {cfg.drafter_kind!r}); refusing to load DSpark stages "
            f"as NextN/MTP")


def _census(cfg: Dsv4Config, stored: Mapping[str, StoredTensor], source: str
            ) -> tuple[list[TensorSpec], dict[int, str]]:
    _check_drafter_kind(cfg, stored, source)
    kinds = detect_expert_kinds(cfg, stored)
    specs = expected_for_kinds(cfg, kinds)
    expected = {s.name: s for s in specs}
    missing = [s.name for s in specs if s.name not in stored]
    unexpected = sorted(n for n in stored if n not in expected)
    bad_shape, bad_dtype = [], []
    for s in specs:
        t = stored.get(s.name)
        if t is None:
            continue
        if t.shape != s.shape:
            bad_shape.append(f"{s.name} (stored {list(t.shape)}, expected {list(s.shape)})")
        if t.dtype != s.dtype:
            bad_dtype.append(f"{s.name} (stored {t.dtype}, expected {s.dtype})")
    problems = [(what, items) for what, items in (
        ("missing", missing), ("unexpected", unexpected),
        ("wrong shape", bad_shape), ("wrong dtype", bad_dtype)) if items]
    if problems:
        lines = [f"{source}: tensor census failed against the {cfg.name!r} table "
                 f"(trunk experts {_trunk_formats(cfg, kinds) or 'n/a'}, "
                 f"drafter {cfg.drafter_kind}; "
                 f"{len(specs)} expected, {len(stored)} stored)"]
        for what, items in problems:
            shown = ", ".join(items[:MAX_LISTED])
            more = f", ... ({len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
            lines.append(f"  {len(items)} {what}: {shown}{more}")
        raise CheckpointError("\n".join(lines))
    return specs, kinds


def _trunk_formats(cfg: Dsv4Config, kinds: Mapping[int, str]) -> str:
    """The trunk layers' expert formats, e.g. 'mxfp4' or 'mxfp4/nvfp4'."""
    return "/".join(sorted({k for l, k in kinds.items() if l < cfg.num_hidden_layers}))


# ---------------------------------------------------------------------------------- units
def unit_of(cfg: Dsv4Config, spec: TensorSpec) -> int | str:
    """Placement unit of a tensor: 'embed', 'head', or its layer id (drafter stages n + s)."""
    if spec.layer is None:
        return "embed" if spec.group == G_EMBED else "head"
    return spec.layer


def placement_units(cfg: Dsv4Config) -> list[int | str]:
    """Units in pipeline order: embed, trunk layers, head, drafter stage layer ids."""
    n = cfg.num_hidden_layers
    return ["embed", *range(n), "head", *range(n, n + cfg.num_drafter_stages)]


def specs_by_unit(cfg: Dsv4Config, specs: Iterable[TensorSpec]
                  ) -> dict[int | str, list[TensorSpec]]:
    """`specs` grouped by placement unit, units in pipeline order, table order within a unit."""
    by_unit: dict[int | str, list[TensorSpec]] = {}
    for s in specs:
        by_unit.setdefault(unit_of(cfg, s), []).append(s)
    return {u: by_unit[u] for u in placement_units(cfg) if u in by_unit}


def unit_label(cfg: Dsv4Config, layer: int) -> str:
    """How a layer id is named to people: trunk layer "7", drafter stage "mtp.0"."""
    n = cfg.num_hidden_layers
    return str(layer) if layer < n else f"mtp.{layer - n}"


def _layer_prefix(cfg: Dsv4Config, layer: int) -> str:
    return f"layers.{layer}" if layer < cfg.num_hidden_layers else unit_label(cfg, layer)


# ---------------------------------------------------------------------------------- the object
class Checkpoint:
    """A validated DeepSeek-V4 checkpoint (files or in-memory arrays); see the module docstring."""

    def __init__(self, config: Dsv4Config, stored: dict[str, StoredTensor], source: str,
                 arrays: Mapping[str, np.ndarray] | None = None) -> None:
        # Private: use Checkpoint.open / Checkpoint.from_arrays, which validate first.
        self.config = config
        self.source = source
        self._stored = stored
        self._arrays = arrays
        self._specs, self._kinds = _census(config, stored, source)
        self._by_name = {s.name: s for s in self._specs}
        self._by_unit = specs_by_unit(config, self._specs)
        self._maps: dict[str, np.ndarray] = {}

    # -------------------------------------------------------------- constructors
    @classmethod
    def open(cls, path: str | os.PathLike, config: Dsv4Config | None = None) -> "Checkpoint":
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        cfg = config if config is not None else Dsv4Config.from_checkpoint(path)
        return cls(cfg, _read_index(path), path)

    @classmethod
    def from_arrays(cls, config: Dsv4Config, arrays: Mapping[str, np.ndarray]) -> "Checkpoint":
        candidates: dict[str, set[str]] = {}
        for kind in (EXPERT_MXFP4, EXPERT_NVFP4):
            for s in expected_tensors(config, kind):
                candidates.setdefault(s.name, set()).add(s.dtype)
        stored, views = {}, {}
        for name, a in arrays.items():
            if not isinstance(name, str):
                raise CheckpointError(f"from_arrays: tensor name {name!r} is not a string")
            a = np.asarray(a)
            st = _ML_DTYPES.get(a.dtype.name)
            if st is not None:
                a = a.view(numpy_storage_dtype(st))
            else:
                st = _st_dtype_of(name, a, candidates.get(name, ()))
            # (np.ascontiguousarray would turn the 0-d NVFP4 scalars into shape [1].)
            v = (a if a.flags.c_contiguous else a.copy(order="C")).view()
            v.flags.writeable = False
            stored[name] = StoredTensor(name, st, tuple(int(x) for x in v.shape), None)
            views[name] = v
        return cls(config, stored, "<in-memory>", views)

    # -------------------------------------------------------------- inventory
    @property
    def expert_kinds(self) -> dict[int, str]:
        return dict(self._kinds)

    def names(self) -> list[str]:
        """All tensor names in table order (embed, layers, head group, drafter)."""
        return [s.name for s in self._specs]

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise CheckpointError(f"{self.source}: no tensor {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._specs)

    def expert_kind(self, layer: int | str) -> str:
        """'mxfp4' or 'nvfp4' for a layer id (or 'mtp.S'), as detected from the stored tensors."""
        unit = self._unit(layer)
        if not isinstance(unit, int):
            raise CheckpointError(f"expert_kind: {layer!r} has no routed experts")
        return self._kinds[unit]

    def location(self, name: str) -> tuple[str, int, int] | None:
        """(shard path, begin, end) absolute byte range of a file-backed tensor; None in memory."""
        self.spec(name)
        t = self._stored[name]
        return None if t.file is None else (t.file, t.begin, t.end)

    # -------------------------------------------------------------- bytes
    def _unit(self, unit: int | str) -> int | str:
        n, stages = self.config.num_hidden_layers, self.config.num_drafter_stages
        if isinstance(unit, str) and unit.startswith("mtp."):
            tail = unit[4:]
            if tail.isdigit() and int(tail) < stages:
                return n + int(tail)
        elif unit in ("embed", "head", "drafter"):
            return unit
        elif isinstance(unit, (int, np.integer)) and not isinstance(unit, bool) \
                and 0 <= unit < n + stages:
            return int(unit)
        stage_ids = f" or 'mtp.0'..'mtp.{stages - 1}'" if stages else ""
        raise CheckpointError(f"unknown unit {unit!r}: expected a layer id 0..{n + stages - 1}, "
                              f"'embed', 'head', 'drafter'{stage_ids}")

    def _specs_of(self, unit: int | str) -> list[TensorSpec]:
        u = self._unit(unit)
        if u == "drafter":
            n = self.config.num_hidden_layers
            return [s for l, specs in self._by_unit.items()
                    if isinstance(l, int) and l >= n for s in specs]
        return self._by_unit.get(u, [])

    def layer_bytes(self, unit: int | str) -> int:
        return sum(s.nbytes for s in self._specs_of(unit))

    def group_bytes(self, unit: int | str) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self._specs_of(unit):
            out[s.group] = out.get(s.group, 0) + s.nbytes
        return out

    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._specs)

    # -------------------------------------------------------------- data
    def raw(self, name: str) -> np.ndarray:
        """Read-only view of the stored bytes, storage dtype, stored shape (memory-mapped)."""
        spec = self.spec(name)
        dtype = numpy_storage_dtype(spec.dtype, name)
        if self._arrays is not None:
            return self._arrays[name]
        t = self._stored[name]
        m = self._maps.get(t.file)
        if m is None:
            with open(t.file, "rb") as fh:
                # mmap + frombuffer gives a read-only view and keeps the file mapping alive.
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            m = self._maps[t.file] = np.frombuffer(mm, dtype=np.uint8)
        if t.end > m.size:
            raise CheckpointError(f"{t.file}: tensor {name!r} ends at byte {t.end} but the file "
                                  f"now has {m.size} bytes (changed since open)")
        return m[t.begin:t.end].view(dtype).reshape(spec.shape)

    def dequant(self, name: str, dtype=np.float32) -> np.ndarray:
        """Exact float32 values of a tensor (int64 for I64); decoder refusals name the tensor.
        ``dtype=np.float64``: the same values as float64 (FP4 experts are then decoded straight
        to float64, without the float32 intermediate; every other kind is widened)."""
        spec = self.spec(name)
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise CheckpointError(f"dequant {name}: dtype must be float32 or float64, got {dtype}")
        wide = np.dtype(dtype) == np.float64
        try:
            if wide and spec.kind in ("mxfp4", "nvfp4"):
                return self._dequant(spec, wide=True)
            w = self._dequant(spec)
            return w.astype(np.float64) if wide and w.dtype == np.float32 else w
        except FormatError as e:
            where = self._stored[name].file or self.source
            raise CheckpointError(f"{where}: {e}") from e

    def dequant_rows(self, name: str, rows) -> np.ndarray:
        """``dequant(name)[rows]`` for a BF16 / F32 tensor (embedding, head), decoding only the
        selected rows (``rows``: a slice or an integer index array along axis 0).  The values are
        the same; the non-finite refusal covers only those rows."""
        spec = self.spec(name)
        if spec.kind not in ("bf16", "f32"):
            raise CheckpointError(f"dequant_rows {name}: only BF16 / F32 tensors, not {spec.kind}")
        part = self.raw(name)[rows]
        try:
            if spec.kind == "bf16":
                return _finite(decode_bf16(np.ascontiguousarray(part), name), name)
            return _finite(np.array(part, dtype=np.float32), name)
        except FormatError as e:
            where = self._stored[name].file or self.source
            raise CheckpointError(f"{where}: {e}") from e

    def _dequant(self, spec: TensorSpec, wide: bool = False) -> np.ndarray:
        name, kind, raw = spec.name, spec.kind, self.raw(spec.name)
        out = np.float64 if wide else np.float32
        if kind == "bf16":
            return _finite(decode_bf16(raw, name), name)
        if kind == "f32":
            return _finite(np.array(raw, dtype=np.float32), name)
        if kind == "i64":
            return np.array(raw, dtype=np.int64)
        if kind == "e8m0":
            return decode_e8m0(raw, name)
        if kind == "e4m3":
            return decode_e4m3(raw, name)
        if kind == "nvfp4_aux":
            value = np.array(raw, dtype=np.float32)
            if not (np.isfinite(value) and value > 0):
                raise CheckpointError(f"{self._stored[name].file or self.source}: {name} = "
                                      f"{float(value)!r}; NVFP4 scales must be finite and > 0")
            return value
        stem = name[: -len(".weight")]
        if kind == "fp8":
            return dequant_fp8_block(raw, self.raw(f"{stem}.scale"), name, QUANT_BLOCK)
        if kind == "mxfp4":
            return dequant_mxfp4(raw, self.raw(f"{stem}.scale"), name, out)
        if kind == "nvfp4":
            return dequant_nvfp4(raw, self.raw(f"{stem}.weight_scale"),
                                 np.float32(self.raw(f"{stem}.weight_scale_2")), name, out)
        raise CheckpointError(f"{name}: no decoder for tensor kind {kind!r}")

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Drop the memory maps (views handed out keep their own mapping alive)."""
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({self.source!r}, config={self.config.name!r}, tensors={len(self)}, "
                f"bytes={self.total_bytes():,}, "
                f"experts={_trunk_formats(self.config, self._kinds)}, "
                f"drafter={self.config.drafter_kind})")


def _st_dtype_of(name: str, a: np.ndarray, expected: Iterable[str]) -> str:
    """safetensors dtype of an in-memory stored array: the expected one its NumPy dtype can hold."""
    if a.dtype.byteorder == ">":
        raise CheckpointError(f"from_arrays: tensor {name!r} is big-endian; stored data is "
                              f"little-endian")
    fitting = sorted(d for d in expected if numpy_storage_dtype(d) == a.dtype.newbyteorder("<"))
    if len(fitting) == 1:
        return fitting[0]
    code = f"{a.dtype.kind}{a.dtype.itemsize}"
    if code not in _DEFAULT_ST_DTYPE:
        raise CheckpointError(f"from_arrays: tensor {name!r} has NumPy dtype {a.dtype}, which is "
                              f"no safetensors storage dtype")
    return _DEFAULT_ST_DTYPE[code]


def _finite(values: np.ndarray, name: str) -> np.ndarray:
    bad = ~np.isfinite(values)
    if bad.any():
        first = int(np.flatnonzero(bad.reshape(-1))[0])
        raise FormatError(f"{name}: {int(bad.sum())} non-finite values (first at flat index "
                          f"{first}); no DeepSeek-V4 weight is NaN or infinite")
    return values
