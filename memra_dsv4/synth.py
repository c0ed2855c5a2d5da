"""Synthetic DeepSeek-V4 checkpoints in the official stored formats, random but well scaled.

Contract
--------
* `synth_arrays(cfg, seed, experts="mxfp4")` returns {name: stored ndarray} for exactly the
  tensors of `expected_tensors(cfg, experts)`, in the storage dtypes `Checkpoint.raw` returns:
  BF16 as uint16 bits, F8_E4M3/F8_E8M0/U8 as uint8, I8 as int8, F32 float32, I64 int64.
  - FP8 dense linears: e4m3 codes + one e8m0 scale per 128x128 block, the scale the smallest
    power of two >= amax/448, so the codes use the whole e4m3 range.
  - MXFP4 routed experts: I8-packed e2m1 (low nibble = even element) + e8m0 per 32 inputs,
    scale 2^ceil(log2(amax/6)); about 1 block in 512 is all zero with the official sentinel scale
    byte 0 (2^-127), so decoders meet it.
  - NVFP4 routed experts (trunk only; drafters stay MXFP4 as in NVIDIA's release) are derived
    from the very same MXFP4 bytes the way NVIDIA's `cast_mxfp4_to_nvfp4.py` does, losslessly:
    weight_scale_2 = 2^m with m = max(k_max(w1), k_max(w3)) - 8 for the w1/w3 pair and
    k_max(w2) - 8 for w2 (k = e8m0 - 127 over non-zero blocks), each 16-block's weight_scale
    = e4m3(2^(k_j - m)) (0 for all-zero blocks), nibbles copied.  Synthetic block exponents are
    kept within [k_max - 17, k_max] of their scale group, the cast's lossless window, so the
    NVFP4 checkpoint dequantises to exactly the MXFP4 one of the same seed.  input_scale is a
    positive "calibrated amax / (6 * 448)", shared by w1 and w3.
  - Every tensor has its own generator, seeded by (seed, crc32(name)): a tensor's values do not
    depend on which other tensors, shards or expert format are generated.
* Scaling, so that activations stay O(1) through every layer: embed ~ N(0, 1); linear weights
  ~ N(0, 1/fan_in) before quantisation; RMSNorm weights 1 + N(0, 0.02^2); hc_*_fn
  ~ N(0, (0.01/sqrt(hc_dim))^2) so the mixes are ~0.01; hc bases give pre = sigmoid(0) = 0.5,
  post = 2 sigmoid(0) = 1 and comb logits with +4 on the diagonal (a near-identity Sinkhorn
  mix); hc scales ~ 1; attn_sink, ape, gate bias small; tid2eid rows are distinct expert ids.
* `write_checkpoint(dir, cfg, arrays)` validates `arrays` with the census, then writes
  config.json (`cfg.to_hf_dict()`), one shard per unit in the official order (embed, each trunk
  layer, head group, each drafter stage: `model-000NN-of-000TT.safetensors`) and
  `model.safetensors.index.json` (metadata.total_size, weight_map).  The safetensors writer is
  our own (the installed package may not know F8_E8M0): tensors sorted by item size so each is
  naturally aligned, no holes, header padded to 8 bytes, as the safetensors library writes them.
* `python -m memra_dsv4 synth OUT --preset NAME [--seed S] [--experts mxfp4|nvfp4]
  [--drafter mtp|dspark|none]` streams shard by shard (memory ~ one layer).  The full presets
  (flash, pro, flash-0731) are refused: they are 160 GB and more; the GPU path builds them in
  memory.  Bad arguments print one line and exit 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from .cli import ArgParser, UsageError
from .checkpoint import INDEX_FILE, Checkpoint, CheckpointError, specs_by_unit
from .config import (DRAFTER_DSPARK, DRAFTER_MTP, DRAFTER_NONE, QUANT_BLOCK, ConfigError,
                     Dsv4Config, preset)
from .formats import (E2M1_MAX, E4M3_MAX, encode_bf16, encode_e4m3, encode_e8m0,
                      numpy_storage_dtype, pack_e2m1)
from .tensors import EXPERT_FORMATS, ITEMSIZE, TensorSpec, expected_tensors

__all__ = ["synth_arrays", "synth_unit_arrays", "write_checkpoint", "write_synth_checkpoint",
           "with_drafter", "shard_plan", "mxfp4_expert_to_nvfp4", "FULL_PRESETS", "main"]

DRAFTERS = (DRAFTER_MTP, DRAFTER_DSPARK, DRAFTER_NONE)
# Presets whose data we never write to disk (160 GB and more).
FULL_PRESETS = ("flash", "pro", "flash-0731")
MX_BLOCK, NV_BLOCK = 32, 16
ZERO_BLOCK_FRACTION = 1 / 512
# cast_mxfp4_to_nvfp4: m = k_max - 8 and 2^(k_j - m) must be an exact e4m3 value, i.e.
# k_j - m in [-9, 8]: every block exponent within [k_max - 17, k_max].
NV_WINDOW_LOW, NV_WINDOW_HIGH, NV_M_OFFSET = -9, 8, 8
COMB_DIAGONAL_LOGIT = 4.0
# DSpark defaults of Flash-0731; smaller models get a proportionally small Markov rank.
DSPARK_BLOCK_SIZE, DSPARK_FLASH_NOISE_TOKEN, DSPARK_FLASH_MARKOV_RANK = 5, 128799, 256


# ---------------------------------------------------------------------------------- config
def with_drafter(cfg: Dsv4Config, drafter: str) -> Dsv4Config:
    """`cfg` with its drafter replaced: 'mtp' (one NextN block), 'dspark' (3 stages), 'none'."""
    n = cfg.num_hidden_layers
    trunk = cfg.compress_ratios[:n]
    no_dspark = dict(dspark_block_size=None, dspark_noise_token_id=None,
                     dspark_target_layer_ids=None, dspark_markov_rank=None)
    if drafter == DRAFTER_NONE:
        return cfg.replace(compress_ratios=trunk, num_nextn_predict_layers=0, **no_dspark)
    if drafter == DRAFTER_MTP:
        return cfg.replace(compress_ratios=trunk + (0,), num_nextn_predict_layers=1, **no_dspark)
    if drafter == DRAFTER_DSPARK:
        real = cfg.vocab_size == 129280 and cfg.hidden_size >= 4096
        # Flash-0731: HF config keeps num_nextn_predict_layers = 1; taps are the last 3 blocks.
        return cfg.replace(
            compress_ratios=trunk + (0, 0, 0), num_nextn_predict_layers=1,
            dspark_block_size=DSPARK_BLOCK_SIZE,
            dspark_noise_token_id=DSPARK_FLASH_NOISE_TOKEN if real else cfg.vocab_size - 1,
            dspark_target_layer_ids=tuple(range(max(0, n - 3), n)),
            dspark_markov_rank=DSPARK_FLASH_MARKOV_RANK if real else 32)
    raise ConfigError(f"drafter {drafter!r}: expected one of {', '.join(DRAFTERS)}")


# ---------------------------------------------------------------------------------- numerics
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _normal(rng: np.random.Generator, shape, std: float, mean: float = 0.0) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)      # in place: Flash-size draws are 100s of MB
    if mean:
        x += np.float32(mean)
    return x


def _ceil_log2(t: np.ndarray) -> np.ndarray:
    """Exact ceil(log2 t) for t > 0 (0 where t == 0), from the float's exponent and mantissa."""
    m, e = np.frexp(np.asarray(t, dtype=np.float64))
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def _quant_fp8_block(w: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (e4m3 codes [out, in], e8m0 scales [out/128, in/128]), 128x128 blocks."""
    out_f, in_f = w.shape
    bo, bi = -(-out_f // QUANT_BLOCK), -(-in_f // QUANT_BLOCK)
    padded = w
    if (bo * QUANT_BLOCK, bi * QUANT_BLOCK) != w.shape:
        padded = np.zeros((bo * QUANT_BLOCK, bi * QUANT_BLOCK), np.float32)
        padded[:out_f, :in_f] = w
    amax = np.abs(padded).reshape(bo, QUANT_BLOCK, bi, QUANT_BLOCK).max(axis=(1, 3))
    k = _ceil_log2(amax / E4M3_MAX)
    scale = np.ldexp(np.float32(1), k).astype(np.float32)
    full = np.repeat(np.repeat(scale, QUANT_BLOCK, 0)[:out_f], QUANT_BLOCK, 1)[:, :in_f]
    return encode_e4m3(w / full, name), encode_e8m0(scale, f"{name} (scale)")


def _mx_exponents(w: np.ndarray) -> np.ndarray:
    return _mx_exponents_abs(np.abs(w))


def _mx_exponents_abs(a: np.ndarray) -> np.ndarray:
    """Block exponents ceil(log2(amax / 6)) from |w| [out, in]."""
    amax = a.reshape(a.shape[0], -1, MX_BLOCK).max(axis=-1)
    return _ceil_log2(amax / E2M1_MAX)


# e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbouring codes, and
# whether a value exactly on the midpoint rounds up (ties to the even code: 0.75 -> 1 (code 2),
# 1.75 -> 2 (code 4), 3.5 -> 4 (code 6); the others round down).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))


def _e2m1_codes(v: np.ndarray, a: np.ndarray | None = None, neg: np.ndarray | None = None
                ) -> np.ndarray:
    """RNE e2m1 codes of float32 values already within [-6, 6].

    Equal to `formats.encode_e2m1` on that domain (tested), ~20x faster: seven comparisons
    instead of a general minifloat rounding, which matters at Flash size (768 expert matrices
    per layer).  Signs are kept, so values that round to zero from below give -0 (code 8).
    ``a`` (= |v|) and ``neg`` (= signbit(v)) may be passed instead of ``v`` (None); ``neg`` is
    then used as scratch.
    """
    a = np.abs(v) if a is None else a
    neg = np.signbit(v) if neg is None else neg
    code = np.zeros(a.shape, np.uint8)
    t = np.empty(a.shape, bool)       # one comparison buffer, reused
    for mid, tie_up in _E2M1_MIDPOINTS:
        (np.greater_equal if tie_up else np.greater)(a, np.float32(mid), out=t)
        code += t
    u = neg.view(np.uint8)            # bool -> 0/1
    u <<= 3
    code |= u
    return code


def _quant_mxfp4(a: np.ndarray, neg: np.ndarray, k: np.ndarray, zero: np.ndarray, name: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """|w| (float32 [out, in], consumed: scaled in place) and signbit(w) (bool, consumed) with
    block exponents k [out, in/32] -> (I8 packed, e8m0 scale) of w."""
    shape = a.shape
    # |w| / 2^k is exact (= |w / 2^k|), and k = ceil(log2(amax/6)) (or larger) keeps every value
    # within +-6.
    blocks = a.reshape(*k.shape, MX_BLOCK)
    blocks /= np.ldexp(np.float32(1), k).astype(np.float32)[..., None]
    if blocks.max(initial=0) > E2M1_MAX:
        raise ValueError(f"{name}: block exponents leave values beyond the e2m1 range")
    codes = _e2m1_codes(None, a=blocks, neg=neg.reshape(blocks.shape))
    codes[zero] = 0
    scale = (k + 127).astype(np.uint8)
    scale[zero] = 0                               # the official all-zero-block sentinel, 2^-127
    packed = pack_e2m1(codes.reshape(shape), name)
    return packed.view(np.int8), scale


def _mxfp4_expert(cfg: Dsv4Config, seed: int, prefix: str) -> dict[str, np.ndarray]:
    """MXFP4 w1/w2/w3 of one routed expert `prefix` (= '<block>.ffn.experts.<e>')."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    draws = {}
    for w, (out_f, in_f) in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
        rng = _rng(seed, f"{prefix}.{w}.weight")
        x = _normal(rng, (out_f, in_f), 1 / math.sqrt(in_f))
        zero = rng.random((out_f, in_f // MX_BLOCK)) < ZERO_BLOCK_FRACTION
        neg = np.signbit(x)
        a = np.abs(x, out=x)          # only |x| and its signs are kept
        draws[w] = (a, neg, zero, _mx_exponents_abs(a))
    # Keep each scale group's non-zero blocks inside the NVFP4 cast's lossless window (raising a
    # tiny block's exponent only rounds its values more coarsely; nothing saturates).
    for group in (("w1", "w3"), ("w2",)):
        k_max = max(int(draws[w][3][~draws[w][2]].max()) for w in group)
        for w in group:
            a, neg, zero, k = draws[w]
            draws[w] = (a, neg, zero, np.maximum(k, k_max + NV_WINDOW_LOW - NV_M_OFFSET))
    out = {}
    for w, (a, neg, zero, k) in draws.items():
        packed, scale = _quant_mxfp4(a, neg, k, zero, f"{prefix}.{w}.weight")
        out[f"{prefix}.{w}.weight"], out[f"{prefix}.{w}.scale"] = packed, scale
    return out


def mxfp4_expert_to_nvfp4(mx: Mapping[str, np.ndarray], prefix: str,
                          input_scales: tuple[float, float]) -> dict[str, np.ndarray]:
    """NVIDIA's closed-form MXFP4 -> NVFP4 cast of one expert, refusing any lossy block.

    `mx` holds '<prefix>.w{1,2,3}.weight' (I8) and '.scale' (e8m0); `input_scales` are the
    (w1 = w3, w2) activation scales.  Returns the NVFP4 tensors of the three matrices.
    """
    def k_and_nonzero(w):
        packed = mx[f"{prefix}.{w}.weight"].view(np.uint8)
        scale = mx[f"{prefix}.{w}.scale"]
        # A block is non-zero when any nibble has a non-zero magnitude (sign bits 0x88 ignored).
        nonzero = ((packed.reshape(*scale.shape, MX_BLOCK // 2) & 0x77) != 0).any(axis=-1)
        return scale.astype(np.int64) - 127, nonzero

    out = {}
    for group, in_scale in ((("w1", "w3"), input_scales[0]), (("w2",), input_scales[1])):
        ks = {w: k_and_nonzero(w) for w in group}
        m = max(int(k[nz].max()) for k, nz in ks.values()) - NV_M_OFFSET
        for w, (k, nonzero) in ks.items():
            name = f"{prefix}.{w}.weight"
            d = k - m
            lossy = nonzero & ((d < NV_WINDOW_LOW) | (d > NV_WINDOW_HIGH))
            if lossy.any():
                raise ValueError(f"{name}: {int(lossy.sum())} MXFP4 blocks outside the lossless "
                                 f"NVFP4 window [{NV_WINDOW_LOW}, {NV_WINDOW_HIGH}] around m = {m}")
            ws = np.where(nonzero, np.ldexp(1.0, np.clip(d, NV_WINDOW_LOW, NV_WINDOW_HIGH)), 0.0)
            out[name] = mx[name].view(np.uint8).copy()
            out[f"{prefix}.{w}.weight_scale"] = encode_e4m3(
                np.repeat(ws, MX_BLOCK // NV_BLOCK, axis=-1), f"{prefix}.{w}.weight_scale")
            out[f"{prefix}.{w}.weight_scale_2"] = np.array(np.ldexp(1.0, m), dtype=np.float32)
            out[f"{prefix}.{w}.input_scale"] = np.array(in_scale, dtype=np.float32)
    return out


def _expert(cfg: Dsv4Config, seed: int, prefix: str, fmt: str) -> dict[str, np.ndarray]:
    mx = _mxfp4_expert(cfg, seed, prefix)
    if fmt == "mxfp4":
        return mx
    # Calibrated amax of the expert's inputs (w1 = w3) and of its intermediate (w2), / (6 * 448).
    amax = _rng(seed, f"{prefix}.input_scale").uniform(2.0, 8.0, size=2)
    return mxfp4_expert_to_nvfp4(mx, prefix, tuple(float(a) / (E2M1_MAX * E4M3_MAX) for a in amax))


def _hc_base(rows: int, hc: int, rng: np.random.Generator) -> np.ndarray:
    base = _normal(rng, (rows,), 0.01)
    if rows == (2 + hc) * hc:   # pre (hc), post (hc), comb (hc x hc, row-major)
        comb = base[2 * hc:].reshape(hc, hc)
        comb[np.diag_indices(hc)] += np.float32(COMB_DIAGONAL_LOGIT)
    return base


def _tid2eid(cfg: Dsv4Config, rng: np.random.Generator) -> np.ndarray:
    draws = rng.random((cfg.vocab_size, cfg.n_routed_experts), dtype=np.float32)
    return np.argsort(draws, axis=1)[:, :cfg.num_experts_per_tok].astype("<i8")


# Value rules for the tensors that are not quantised, first match wins.  Each returns float32
# values (bf16/f32 tensors) or int64 ids.  A table entry no rule covers is an error, not a guess.
_Rule = Callable[[Dsv4Config, TensorSpec, np.random.Generator], np.ndarray]
_RULES: list[tuple[re.Pattern, _Rule]] = [
    (re.compile(r"^embed\.weight$"), lambda c, s, r: _normal(r, s.shape, 1.0)),
    (re.compile(r"^head\.weight$"), lambda c, s, r: _normal(r, s.shape, 1 / math.sqrt(s.shape[1]))),
    (re.compile(r"norm\.weight$"), lambda c, s, r: _normal(r, s.shape, 0.02, mean=1.0)),
    (re.compile(r"hc_(attn|ffn|head)_fn$"),
     lambda c, s, r: _normal(r, s.shape, 0.01 / math.sqrt(s.shape[1]))),
    (re.compile(r"hc_(attn|ffn|head)_base$"), lambda c, s, r: _hc_base(s.shape[0], c.hc_mult, r)),
    (re.compile(r"hc_(attn|ffn|head)_scale$"), lambda c, s, r: _normal(r, s.shape, 0.01, mean=1.0)),
    (re.compile(r"\.attn\.attn_sink$"), lambda c, s, r: _normal(r, s.shape, 0.1)),
    (re.compile(r"compressor\.ape$"), lambda c, s, r: _normal(r, s.shape, 0.02)),
    (re.compile(r"\.ffn\.gate\.bias$"), lambda c, s, r: _normal(r, s.shape, 0.01)),
    (re.compile(r"\.ffn\.gate\.tid2eid$"), lambda c, s, r: _tid2eid(c, r)),
    # Markov head: logits bias = markov_w1[token] . markov_w2^T, O(1) with N(0,1) x N(0,1/rank).
    (re.compile(r"markov_head\.markov_w1$"), lambda c, s, r: _normal(r, s.shape, 1.0)),
    (re.compile(r"markov_head\.markov_w2$"), lambda c, s, r: _normal(r, s.shape, 1 / math.sqrt(s.shape[1]))),
    # Plain bf16 linears [out, in]: gate, compressor and indexer projections, confidence head.
    (re.compile(r"(\.ffn\.gate\.weight|compressor\.w(kv|gate)\.weight|weights_proj\.weight"
                r"|confidence_head\.proj)$"),
     lambda c, s, r: _normal(r, s.shape, 1 / math.sqrt(s.shape[1]))),
]


def _plain(cfg: Dsv4Config, seed: int, spec: TensorSpec) -> np.ndarray:
    for pattern, rule in _RULES:
        if pattern.search(spec.name):
            values = rule(cfg, spec, _rng(seed, spec.name))
            break
    else:
        raise ValueError(f"synth: no value rule for tensor {spec.name!r} ({spec.dtype} {spec.shape})")
    if spec.kind == "bf16":
        # Row chunks bound the encoder's 64-bit temporaries (Flash embed/head are 2 GB of f32).
        out = np.empty(spec.shape, np.uint16)
        rows = max(1, _ENCODE_CHUNK // max(1, math.prod(spec.shape[1:])))
        for r in range(0, spec.shape[0], rows):
            out[r:r + rows] = encode_bf16(values[r:r + rows], spec.name)
        return out
    if spec.kind == "f32":
        return np.asarray(values, dtype="<f4")
    if spec.kind == "i64":
        return values
    raise ValueError(f"synth: tensor {spec.name!r} of kind {spec.kind!r} is not a plain tensor")


_ENCODE_CHUNK = 1 << 24   # elements per encoder call for large plain tensors
_EXPERT_W1 = re.compile(r"^(.*\.ffn\.experts\.\d+)\.w1\.weight$")


def synth_unit_arrays(cfg: Dsv4Config, seed: int, specs: Iterable[TensorSpec]
                      ) -> dict[str, np.ndarray]:
    """Stored arrays for `specs` (whole units: a weight comes with its sidecars, an expert whole)."""
    specs = list(specs)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        if s.name in out or s.kind in ("e8m0", "e4m3", "nvfp4_aux"):
            continue  # sidecars are made with their weight
        if s.kind == "fp8":
            stem = s.name[: -len(".weight")]
            rng = _rng(seed, s.name)
            w = _normal(rng, s.shape, 1 / math.sqrt(s.shape[1]))
            out[s.name], out[f"{stem}.scale"] = _quant_fp8_block(w, s.name)
        elif s.kind in EXPERT_FORMATS:
            m = _EXPERT_W1.match(s.name)
            if m is None:
                raise ValueError(f"synth: expert matrix {s.name!r} precedes its expert's w1")
            out.update(_expert(cfg, seed, m.group(1), s.kind))
        else:
            out[s.name] = _plain(cfg, seed, s)
    # The table is the contract: same names, shapes and storage dtypes, nothing more.
    want = {s.name: s for s in specs}
    if set(out) != set(want):
        raise ValueError(f"synth: generated set differs from the table: missing "
                         f"{sorted(set(want) - set(out))[:5]}, extra {sorted(set(out) - set(want))[:5]}")
    for name, a in out.items():
        s = want[name]
        if a.shape != s.shape or a.dtype != numpy_storage_dtype(s.dtype, name):
            raise ValueError(f"synth: {name} generated as {a.dtype} {a.shape}, table says "
                             f"{s.dtype} {s.shape}")
    return out


def synth_arrays(cfg: Dsv4Config, seed: int = 0, experts: str = "mxfp4",
                 workers: int | None = None) -> dict[str, np.ndarray]:
    """Every tensor of `expected_tensors(cfg, experts)` as a stored array (see module docstring).

    ``workers`` threads build the pieces (an expert, a weight with its sidecars) concurrently;
    None = min(32, cpu count).  Each unit draws from its own generator seeded by (seed, name),
    so the arrays do not depend on the worker count or the order (tested); NumPy's generators
    and ufuncs release the GIL on large arrays, which is what makes flash-layers:N presets
    (768 expert matrices of 8M values per layer) take seconds per layer instead of minutes."""
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"experts={experts!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    if workers is None:
        workers = min(32, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"synth: workers = {workers!r}; expected a positive integer")
    specs = expected_tensors(cfg, experts)
    pieces = [p for u in specs_by_unit(cfg, specs).values() for p in _pieces(u)]
    if workers == 1 or len(pieces) < 2:
        parts = [synth_unit_arrays(cfg, seed, p) for p in pieces]
    else:
        from concurrent.futures import ThreadPoolExecutor
        # Largest pieces first (embed / head: one generator each, the longest single jobs), so
        # they never start last; the dictionary keeps table order whatever finishes first.
        order = sorted(range(len(pieces)), key=lambda i: -sum(s.nbytes for s in pieces[i]))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futs = {i: pool.submit(synth_unit_arrays, cfg, seed, pieces[i]) for i in order}
            parts = [futs[i].result() for i in range(len(pieces))]
    return {k: v for part in parts for k, v in part.items()}


_SIDECAR_KINDS = ("e8m0", "e4m3", "nvfp4_aux")


def _pieces(unit: list[TensorSpec]) -> list[list[TensorSpec]]:
    """A unit's specs cut into independent pieces, table order kept: one routed expert (all of
    its matrices and sidecars), or one tensor with the sidecars that follow it.  A Flash layer
    is one 3.4 GB unit but 256 + ~30 pieces, so synth_arrays spreads a layer over every core."""
    pieces: list[list[TensorSpec]] = []
    for s in unit:
        if s.kind in EXPERT_FORMATS:     # w1 opens an expert; its w2, w3 stay with it
            starts = _EXPERT_W1.match(s.name) is not None
        else:                            # a sidecar stays with its weight
            starts = s.kind not in _SIDECAR_KINDS
        if starts or not pieces:
            pieces.append([s])
        else:
            pieces[-1].append(s)
    return pieces


# ---------------------------------------------------------------------------------- writing
def shard_plan(cfg: Dsv4Config, specs: list[TensorSpec]) -> list[tuple[str, list[TensorSpec]]]:
    """Official layout: embed, one shard per trunk layer, head group, one per drafter stage."""
    units = list(specs_by_unit(cfg, specs).values())
    total = len(units)
    return [(f"model-{i + 1:05d}-of-{total:05d}.safetensors", unit_specs)
            for i, unit_specs in enumerate(units)]


def _write_shard(path: str, tensors: list[tuple[TensorSpec, np.ndarray]]) -> int:
    """Our safetensors writer (any dtype string).  Returns the data bytes written."""
    # Largest item size first: with an 8-aligned data start every tensor is naturally aligned
    # and the buffer has no holes, exactly what safetensors' own serializer produces.
    order = sorted(range(len(tensors)), key=lambda i: -ITEMSIZE[tensors[i][0].dtype])
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i in order:
        spec, a = tensors[i]
        if a.shape != spec.shape or a.dtype != numpy_storage_dtype(spec.dtype, spec.name):
            raise ValueError(f"{spec.name}: array {a.dtype} {a.shape} does not store "
                             f"{spec.dtype} {list(spec.shape)}")
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for i in order:
            a = np.ascontiguousarray(tensors[i][1])
            fh.write(memoryview(a.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)  # a shard appears complete or not at all
    return offset


def _write(out: str, cfg: Dsv4Config, specs: list[TensorSpec],
           arrays_of: Callable[[list[TensorSpec]], Mapping[str, np.ndarray]]) -> int:
    os.makedirs(out, exist_ok=True)
    if os.listdir(out):
        raise CheckpointError(f"{out}: directory is not empty; refusing to mix a new checkpoint "
                              f"with existing files")
    weight_map, total = {}, 0
    for file, unit_specs in shard_plan(cfg, specs):
        arrays = arrays_of(unit_specs)
        total += _write_shard(os.path.join(out, file), [(s, arrays[s.name]) for s in unit_specs])
        weight_map.update({s.name: file for s in unit_specs})
        del arrays   # one unit in memory at a time (a Flash layer is 3.4 GB)
    with open(os.path.join(out, INDEX_FILE), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg.to_hf_dict(), fh, indent=2)
    return total


def write_checkpoint(out: str | os.PathLike, cfg: Dsv4Config, arrays: Mapping[str, np.ndarray]) -> int:
    """Write `arrays` (validated by the census first) as an official-layout checkpoint.

    Returns the total tensor bytes (the index's metadata.total_size).
    """
    ckpt = Checkpoint.from_arrays(cfg, arrays)   # raises CheckpointError before any file exists
    return _write(os.fspath(out), cfg, ckpt.specs(), lambda specs: {s.name: ckpt.raw(s.name) for s in specs})


def write_synth_checkpoint(out: str | os.PathLike, cfg: Dsv4Config, seed: int = 0,
                           experts: str = "mxfp4") -> int:
    """`write_checkpoint(out, cfg, synth_arrays(cfg, seed, experts))` one shard at a time."""
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"experts={experts!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    total = _write(os.fspath(out), cfg, expected_tensors(cfg, experts),
                   lambda specs: synth_unit_arrays(cfg, seed, specs))
    Checkpoint.open(out)   # the written checkpoint must pass our own census
    return total


# ---------------------------------------------------------------------------------- CLI
def _parser() -> ArgParser:
    p = ArgParser(prog="python -m memra_dsv4 synth",
                description="Write a synthetic checkpoint in the official DeepSeek-V4 layout.")
    p.add_argument("out", help="output directory (created; must be empty)")
    p.add_argument("--preset", required=True, help="tiny, small or flash-layers:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=EXPERT_FORMATS, default="mxfp4")
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="default: the preset's own (mtp)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.seed < 0:
            raise UsageError(f"--seed {args.seed}: must be >= 0")
        cfg = preset(args.preset)
        if args.drafter is not None:
            cfg = with_drafter(cfg, args.drafter)
        if cfg.name in FULL_PRESETS:
            size = sum(s.nbytes for s in expected_tensors(cfg, args.experts))
            raise UsageError(f"refusing to write preset {cfg.name!r}: {size / 1e9:.1f} GB of "
                            f"synthetic data; use flash-layers:N for real dimensions on disk "
                            f"(the GPU path builds full presets in memory)")
        total = write_synth_checkpoint(args.out, cfg, args.seed, args.experts)
    except (UsageError, ConfigError, CheckpointError, OSError) as e:
        print(f"memra_dsv4 synth: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    n = len(expected_tensors(cfg, args.experts))
    print(f"wrote {args.out}: preset {cfg.name}, experts {args.experts}, drafter "
          f"{cfg.drafter_kind}, {n} tensors, {total:,} bytes")
    return 0
