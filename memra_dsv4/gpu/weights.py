"""Device weights of the GPU runtime: what lives where, in which format.

Contract
--------
* ``resolve_dense(explicit)``: the dense seam (``MEMRA_DSV4_DENSE`` or the ``dense=`` argument of
  ``Dsv4Gpu.load`` / ``Dsv4Gpu.synthetic``): ``"bf16"`` (default) or ``"fp8"``; read once per
  load and printed (``memra_dsv4: gpu dense weights = fp8 (argument)``); anything else raises
  ``ValueError`` naming the value and the choices.
* ``weight_plan(cfg, n_devices, experts, max_seq_len, dense, drafter=False)`` (pure,
  CPU-testable) splits the trunk with ``placement.plan_split(dense=dense,
  include_drafter=drafter)`` (the byte math of the chosen dense form; the placement's ``fp8`` arm
  counts the block scales as fp32, 4x the e8m0 bytes this loader keeps: a conservative ~1 MiB on
  Flash): embedding on the first stage, head group (and, with ``drafter``, the drafter's bytes
  and cache) on the last; returns ``[(stage_index, layers range, has_embed, has_head)]``.
* ``drafter_layers(cfg, drafter)``: the layer ids of the drafter stages the GPU path loads on the
  last stage (``range(n, n + num_drafter_stages)``: the MTP block ``mtp.0``, or DSpark's three
  stages ``mtp.0..2`` with their extras: main_proj / main_norm, the Markov and confidence heads)
  or ``range(0)`` without ``drafter``.  Refused (ValueError naming the config) for a checkpoint
  without a drafter.
* ``load_stage_weights(ckpt, device, layers, has_embed, has_head, dense=..., drafter_layers=...)``
  uploads one stage (the trunk ``layers``, and the ``mtp.*`` tensors of ``drafter_layers``: the
  MTP block's routed experts are MXFP4 in every release, NVIDIA's NVFP4 one included):
    - FP8 dense linears (``spec.kind == "fp8"``), both arms: the load refuses exactly what
      ``formats.dequant_fp8_block_bf16`` refuses (a NaN e4m3 code, an e8m0 0xFF, a product
      e4m3 * 2^(s-127) that bf16 cannot hold exactly), with the message of
      ``f32_to_bf16_exact(ckpt.dequant(name), name)`` naming the tensor.
        dense "bf16": dequantised on the host, stored under ``{stem}.weight`` as uint16 bf16
          bits [out, in]; the ``.scale`` sidecar is not uploaded.
        dense "fp8": the STORED bytes: ``{stem}.weight`` uint8 [out, in] (e4m3fn codes, never
          0x7F/0xFF) and ``{stem}.scale`` uint8 [ceil(out/128), ceil(in/128)] (e8m0 bytes, never
          0xFF), both C-contiguous; value = e4m3(w[o, i]) * 2^(scale[o // 128, i // 128] - 127),
          exact in bf16 (checked on the host with ``formats.fp8_block_exact_in_bf16``: byte
          tables, no float copy; on failure the slow check raises the message).  No bf16 copy.
    - bf16 tensors (norms, the bf16 linears, head, embedding): uint16 bit patterns; f32
      tensors: float32; tid2eid: int64.  Unchanged by the dense seam.
    - routed experts stay as stored, stacked per layer and matrix so kernels index them by
      expert id: ``{p}.ffn.experts.{w}.packed`` uint8 [E, out, in/2], ``.scale`` uint8
      (MXFP4 e8m0 [E, out, in/32] or NVFP4 e4m3 [E, out, in/16]) and, NVFP4 only,
      ``.ws2`` float32 [E] on the host (a launch argument).  ``StageWeights.expert_fmt[layer]``.
* ``StageWeights`` (what the chunk routine and the device step read):
    - ``t[name]`` the device arrays above (``sw[name]`` raises a KeyError naming the stage);
    - ``layers`` the trunk layers (the chunk routine's loop), ``drafter_layers`` the drafter
      stages' layer ids held here (gpu.drafters; never in the trunk loop);
    - ``dense_fmt``: ``"bf16"`` | ``"fp8"``, the form of the checkpoint's FP8 linears;
    - ``fp8``: the set of linear stems (name without ``.weight``, e.g. ``layers.3.attn.wq_a``)
      stored as FP8 on this device: every FP8 linear of the stage with dense "fp8", empty with
      dense "bf16".  ``scale_of(weight_name)`` returns ``t[stem + ".scale"]`` for those, else
      None; ``is_fp8(weight_name)`` tells which.
    - ``nbytes``: device bytes placed (printed at load).
  Consumers: ``ops_glue.linear(g, x, w, out, scale=sw.scale_of(name))`` dequantises an FP8
  weight into the per-device bf16 scratch of ``GemmBackend`` (kernels_cu/dense.cu) and runs the
  same GEMM, so dense "fp8" prefill logits equal dense "bf16" bit for bit; the device step
  (gpu.step_device) takes (weight, scale) by the weight's dtype (uint8: FP8 + ``.scale``).
* ``synthetic_stage_weights(cfg, device, layers, ..., seed, experts, dense=...)`` builds the same
  dictionary directly on the device with CuPy random numbers (value scales as ``synth``;
  FP4 codes are random bytes: every e2m1 nibble is a valid code; scales fixed so weights are
  ~1/sqrt(fan_in)).  Dense "fp8": e4m3 codes of N(0, 32^2) samples (clipped to [2^-6, 448] in
  magnitude, never a NaN code) with e8m0 block scales b0 + {-1, 0, +1} at random, b0 chosen so
  the RMS is ~1/sqrt(fan_in) like the bf16 arm's.  For full-size benchmarks without a
  checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.config import QUANT_BLOCK, Dsv4Config
from memra_dsv4.tensors import expected_tensors

__all__ = ["StageWeights", "DENSE_FORMS", "resolve_dense", "weight_plan", "drafter_layers",
           "host_tensors", "e4m3_codes_clipped", "load_stage_weights", "synthetic_stage_weights"]

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale|weight_scale|weight_scale_2|input_scale)$")
DENSE_FORMS = ("bf16", "fp8")


def resolve_dense(explicit: str | None = None, *, announce: bool = True) -> str:
    """The dense form: argument > MEMRA_DSV4_DENSE > "bf16"; printed once per call (per load)."""
    import os
    from memra_dsv4 import seams
    dense = seams.resolve(seams.SEAM_DENSE, explicit)
    if announce:
        src = ("argument" if explicit is not None else
               f"env {seams.SEAM_DENSE.env}" if os.environ.get(seams.SEAM_DENSE.env, "") != ""
               else "default")
        print(f"memra_dsv4: gpu dense weights = {dense} ({src})", file=sys.stderr)
    return dense


def _check_dense(dense: str) -> str:
    if dense not in DENSE_FORMS:
        raise ValueError(f"dense = {dense!r} is not valid; allowed: {', '.join(DENSE_FORMS)}")
    return dense


@dataclass
class StageWeights:
    device: int
    layers: range
    has_embed: bool
    has_head: bool
    t: dict = field(default_factory=dict)           # name -> cupy array
    expert_fmt: dict = field(default_factory=dict)  # layer -> "mxfp4" | "nvfp4"
    ws2: dict = field(default_factory=dict)         # "{p}.ffn.experts.{w}" -> np.float32 [E]
    nbytes: int = 0
    dense_fmt: str = "bf16"                         # "bf16" | "fp8": the FP8 linears' form
    fp8: set = field(default_factory=set)           # stems stored as FP8 (+ "{stem}.scale")
    drafter_layers: range = range(0)                # drafter stage layer ids held here

    def __getitem__(self, name: str):
        try:
            return self.t[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is not on device {self.device} (stage layers "
                           f"{self.layers.start}..{self.layers.stop - 1})") from None

    @staticmethod
    def _stem(name: str) -> str:
        return name[:-len(".weight")] if name.endswith(".weight") else name

    def is_fp8(self, name: str) -> bool:
        """Whether the weight ``name`` ("{stem}.weight" or the stem) is stored as FP8 here."""
        return self._stem(name) in self.fp8

    def scale_of(self, name: str):
        """The e8m0 block scale of an FP8-stored weight, None for any other tensor."""
        stem = self._stem(name)
        return self[f"{stem}.scale"] if stem in self.fp8 else None

    def _put(self, name: str, arr) -> None:
        self.t[name] = arr
        self.nbytes += int(arr.nbytes)


def weight_plan(cfg: Dsv4Config, n_devices: int, experts: str = "mxfp4", max_seq_len: int = 4096,
                dense: str = "bf16", drafter: bool = False):
    """[(stage_index, layers, has_embed, has_head)] from placement.plan_split(dense=dense,
    include_drafter=drafter): the drafter's weights and cache count on the last stage."""
    _check_dense(dense)
    if n_devices == 1:
        return [(0, range(cfg.num_hidden_layers), True, True)]
    from memra_dsv4.placement import plan_split

    pl = plan_split(cfg, n_devices, experts=experts, max_seq_len=max_seq_len, dense=dense,
                    include_drafter=bool(drafter), device_bytes=1 << 50)
    return [(i, st.layers, st.has_embed, st.has_head) for i, st in enumerate(pl.stages)]


def drafter_layers(cfg: Dsv4Config, drafter: bool) -> range:
    """The drafter layer ids the GPU path loads (module doc); checked before any device work."""
    if not drafter:
        return range(0)
    from memra_dsv4.config import DRAFTER_NONE
    if cfg.drafter_kind == DRAFTER_NONE:
        raise ValueError(f"drafter=True: config {cfg.name!r} has no drafter (no mtp.* stages: "
                         f"neither an MTP block nor DSpark's dspark_* keys)")
    n = cfg.num_hidden_layers
    return range(n, n + cfg.num_drafter_stages)


def _on_stage(spec, layers, has_embed: bool, has_head: bool, drafter=range(0)) -> bool:
    """Whether ``spec`` belongs on a stage of these trunk ``layers`` / drafter layer ids that
    holds (or not) the embedding and the head group."""
    if spec.layer is None:
        return (spec.group == "embed" and has_embed) or (spec.group == "head" and has_head)
    return spec.layer in layers or spec.layer in drafter


def _stage_specs(cfg, layers, has_embed, has_head, experts="mxfp4", drafter=range(0)):
    return (s for s in expected_tensors(cfg, experts)
            if _on_stage(s, layers, has_embed, has_head, drafter))


def _fp8_stored(ckpt, name: str):
    """(e4m3 bytes, e8m0 bytes) of an FP8 linear after the bf16 arm's exactness check."""
    from memra_dsv4.formats import f32_to_bf16_exact, fp8_block_exact_in_bf16
    w = np.asarray(ckpt.raw(name))
    sc = np.asarray(ckpt.raw(f"{name[:-len('.weight')]}.scale"))
    if not fp8_block_exact_in_bf16(w, sc, QUANT_BLOCK):
        f32_to_bf16_exact(ckpt.dequant(name), name)       # raises the bf16 arm's refusal
        raise AssertionError(f"{name}: fp8_block_exact_in_bf16 refused what the bf16 check "
                             f"accepts")
    return w.view(np.uint8), sc.view(np.uint8)


def host_tensors(ckpt, spec, dense: str) -> dict:
    """Host arrays one non-expert spec contributes to the stage dictionary ({} for an FP8
    linear's ``.scale`` sidecar: the weight spec brings it along with dense "fp8")."""
    from memra_dsv4.formats import f32_to_bf16_exact
    name = spec.name
    if spec.kind == "fp8":
        if dense == "fp8":
            w, sc = _fp8_stored(ckpt, name)
            return {name: w, f"{name[:-len('.weight')]}.scale": sc}
        return {name: f32_to_bf16_exact(ckpt.dequant(name), name)}
    if spec.kind == "bf16":
        return {name: np.asarray(ckpt.raw(name)).view(np.uint16)}
    if spec.kind == "f32":
        return {name: np.asarray(ckpt.raw(name), dtype=np.float32)}
    if spec.kind == "i64":
        return {name: np.asarray(ckpt.raw(name), dtype=np.int64)}
    return {}   # the e8m0 sidecar of an FP8 linear


def load_stage_weights(ckpt, device: int, layers: range, has_embed: bool, has_head: bool,
                       progress=None, dense: str = "bf16", *, upload=None,
                       drafter_layers: range = range(0)) -> StageWeights:
    """One stage on ``device``.  ``upload`` (tests): host array -> stored array, replacing the
    CuPy upload (then no CuPy is needed and ``device`` is only recorded)."""
    _check_dense(dense)
    if upload is None:
        import cupy as cp
        ctx = cp.cuda.Device(device)

        def upload(a):
            return cp.asarray(np.ascontiguousarray(a))
    else:
        ctx = contextlib.nullcontext()

    cfg = ckpt.config
    sw = StageWeights(device, layers, has_embed, has_head, dense_fmt=dense,
                      drafter_layers=drafter_layers)
    experts: dict[str, dict] = {}
    with ctx:
        for spec in ckpt.specs if not callable(ckpt.specs) else ckpt.specs():
            if not _on_stage(spec, layers, has_embed, has_head, drafter_layers):
                continue
            name = spec.name
            m = _EXPERT.match(name)
            if m:
                experts.setdefault(f"{m.group(1)}.{m.group(3)}", {}).setdefault(
                    int(m.group(2)), {})[m.group(4)] = ckpt.raw(name)
            else:
                for n, arr in host_tensors(ckpt, spec, dense).items():
                    sw._put(n, upload(np.ascontiguousarray(arr)))
                if spec.kind == "fp8" and dense == "fp8":
                    sw.fp8.add(name[:-len(".weight")])
            if progress is not None:
                progress.update(1)
        for key, per_e in experts.items():
            E = len(per_e)
            layer = _layer_of(cfg, key)
            first = per_e[0]
            fmt = "nvfp4" if "weight_scale" in first else "mxfp4"
            sw.expert_fmt[layer] = fmt
            packed = np.stack([np.asarray(per_e[e]["weight"]).view(np.uint8) for e in range(E)])
            sc_name = "weight_scale" if fmt == "nvfp4" else "scale"
            scale = np.stack([np.asarray(per_e[e][sc_name]).view(np.uint8) for e in range(E)])
            sw._put(f"{key}.packed", upload(packed))
            sw._put(f"{key}.scale", upload(scale))
            if fmt == "nvfp4":
                sw.ws2[key] = np.array([np.float32(per_e[e]["weight_scale_2"]) for e in range(E)],
                                       dtype=np.float32)
    return sw


def _layer_of(cfg, key: str) -> int:
    m = re.match(r"^layers\.(\d+)\.", key)
    if m:
        return int(m.group(1))
    m = re.match(r"^mtp\.(\d+)\.", key)
    return cfg.num_hidden_layers + int(m.group(1))


def _std_mean(name: str, shape) -> tuple[float, float]:
    """The value scale of synth's rules for a non-expert tensor (float values)."""
    fan_in = shape[-1] if len(shape) > 1 else 1
    if name == "embed.weight":
        return 1.0, 0.0
    if name.endswith("norm.weight"):
        return 0.02, 1.0
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return 0.01 / math.sqrt(fan_in), 0.0
    if re.search(r"hc_(attn|ffn|head)_base$", name):
        return 0.01, 0.0
    if re.search(r"hc_(attn|ffn|head)_scale$", name):
        return 0.01, 1.0
    if name.endswith("attn_sink"):
        return 0.1, 0.0
    if name.endswith("compressor.ape"):
        return 0.02, 0.0
    if name.endswith("gate.bias"):
        return 0.01, 0.0
    return 1.0 / math.sqrt(fan_in), 0.0   # every linear (bf16 or dequantised FP8), head


# e4m3 codes of N(0, SYNTH_FP8_STD^2) samples: |x| <= 448 at 14 sigma, so clipping never bites
SYNTH_FP8_STD = 32.0
_SYNTH_FP8_RMS = 1.3229   # sqrt(mean(4^{-1, 0, 1})): RMS factor of the random block scales


def e4m3_codes_clipped(xp, x):
    """float32 array -> e4m3fn codes (uint8), RNE, magnitudes clipped to [2^-6, 448] first (no
    subnormal code, never a NaN code).  ``xp`` is numpy or cupy; equals formats.encode_e4m3 of
    the clipped values."""
    xb = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    sign = (xb >> xp.uint32(24)) & xp.uint32(0x80)
    a = xp.clip(xp.abs(xb.view(xp.float32)), xp.float32(2.0 ** -6), xp.float32(448.0))
    u = a.view(xp.uint32)
    u = (u + xp.uint32(0x7FFFF) + ((u >> xp.uint32(20)) & xp.uint32(1))) & xp.uint32(0xFFF00000)
    code = (((u >> xp.uint32(23)) - xp.uint32(120)) << xp.uint32(3)) | ((u >> xp.uint32(20)) & xp.uint32(7))
    return (code | sign).astype(xp.uint8)


def _synthetic_fp8(rs, shape, target_rms: float):
    """(e4m3 codes uint8 [out, in], e8m0 scales uint8 [ceil(out/128), ceil(in/128)]) on the
    current device: e4m3_codes_clipped of N(0, 32^2) samples, block scales b0 + {-1, 0, +1}
    with the RMS ~target_rms."""
    import cupy as cp
    out_f, in_f = shape
    codes = e4m3_codes_clipped(cp, rs.standard_normal(shape, dtype=cp.float32)
                               * cp.float32(SYNTH_FP8_STD))
    b0 = 127 + int(round(math.log2(target_rms / (SYNTH_FP8_STD * _SYNTH_FP8_RMS))))
    sshape = (-(-out_f // QUANT_BLOCK), -(-in_f // QUANT_BLOCK))
    scale = (rs.randint(-1, 2, size=sshape, dtype=cp.int32) + b0).astype(cp.uint8)
    return codes, scale


# Expert storage of a synthetic stage: "per-layer" (every MoE layer its own routed-expert tensors,
# as a checkpoint) or "shared" (the stage's first MoE layer's tensors, w1 / w2 / w3, aliased by
# every later layer of the stage: a full-depth Flash fits one H200 for a one-GPU measurement of
# the whole step; each layer's routed experts are still read from HBM, since the L2 holds a few
# percent of what a layer streams between two reads of one expert's bytes).
EXPERT_STORAGE = ("per-layer", "shared")


def check_expert_storage(value: str) -> str:
    """``value`` if it is one of EXPERT_STORAGE, else ValueError naming it."""
    if value not in EXPERT_STORAGE:
        raise ValueError(f"expert_storage = {value!r}: expected one of {EXPERT_STORAGE}")
    return value


def synthetic_stage_weights(cfg: Dsv4Config, device: int, layers: range, has_embed: bool,
                            has_head: bool, seed: int = 0, experts: str = "mxfp4",
                            progress=None, dense: str = "bf16",
                            expert_storage: str = "per-layer",
                            drafter_layers: range = range(0)) -> StageWeights:
    import cupy as cp
    from memra_dsv4.gpu.ops_glue import bf16_bits
    from memra_dsv4.synth import COMB_DIAGONAL_LOGIT

    _check_dense(dense)
    check_expert_storage(expert_storage)
    sw = StageWeights(device, layers, has_embed, has_head, dense_fmt=dense,
                      drafter_layers=drafter_layers)
    hc = cfg.hc_mult
    E = cfg.n_routed_experts
    with cp.cuda.Device(device):
        rs = cp.random.RandomState(seed * 1000 + device + 1)
        done_experts: set[str] = set()
        first_experts: dict = {}   # (fmt, "w1" | "w2" | "w3") -> (packed, scale, ws2) ("shared")
        for spec in _stage_specs(cfg, layers, has_embed, has_head, experts, drafter_layers):
            name = spec.name
            m = _EXPERT.match(name)
            # the drafter's routed experts are MXFP4 in every release (tensors.py)
            fmt = "mxfp4" if spec.layer in drafter_layers else experts
            if m:
                key = f"{m.group(1)}.{m.group(3)}"
                if key not in done_experts:
                    done_experts.add(key)
                    out_f, in_half = spec.shape if m.group(4) == "weight" else (None, None)
                    if out_f is None:  # expert names arrive weight-first; be safe
                        raise AssertionError(f"unexpected expert spec order at {name}")
                    in_f = 2 * in_half
                    sw.expert_fmt[spec.layer] = fmt
                    alias = first_experts.get((fmt, m.group(3))) if expert_storage == "shared" else None
                    if alias is not None:   # the stage's first MoE layer's arrays (no new bytes)
                        packed, scale, ws2 = alias
                        assert packed.shape == (E, out_f, in_half), f"{name}: shape {packed.shape}"
                        sw.t[f"{key}.packed"], sw.t[f"{key}.scale"] = packed, scale
                        if ws2 is not None:
                            sw.ws2[key] = ws2
                    else:
                        packed = rs.randint(0, 256, size=(E, out_f, in_half), dtype=cp.int32).astype(cp.uint8)
                        target = 1.0 / math.sqrt(in_f) / 2.3   # mean |e2m1| of random codes ~2.3
                        if fmt == "mxfp4":
                            b = 127 + int(round(math.log2(target)))
                            scale = cp.full((E, out_f, in_f // 32), b, dtype=cp.uint8)
                        else:
                            scale = cp.full((E, out_f, in_f // 16), 0x38, dtype=cp.uint8)  # e4m3 1.0
                            sw.ws2[key] = np.full(E, 2.0 ** int(round(math.log2(target))), np.float32)
                        sw._put(f"{key}.packed", packed)
                        sw._put(f"{key}.scale", scale)
                        if expert_storage == "shared":
                            first_experts[(fmt, m.group(3))] = (packed, scale, sw.ws2.get(key))
                if progress is not None:
                    progress.update(1)
                continue
            if spec.kind in ("e8m0",):  # fp8 sidecar: made with its weight (dense fp8)
                if progress is not None:
                    progress.update(1)
                continue
            if spec.kind == "fp8" and dense == "fp8":
                stem = name[:-len(".weight")]
                codes, scale = _synthetic_fp8(rs, spec.shape, _std_mean(name, spec.shape)[0])
                sw._put(name, codes)
                sw._put(f"{stem}.scale", scale)
                sw.fp8.add(stem)
                if progress is not None:
                    progress.update(1)
                continue
            if spec.kind == "i64":
                r = rs.random_sample((cfg.vocab_size, E), dtype=cp.float32)
                arr = cp.argsort(r, axis=1)[:, :cfg.num_experts_per_tok].astype(cp.int64)
            else:
                std, mean = _std_mean(name, spec.shape)
                x = rs.standard_normal(spec.shape, dtype=cp.float32) * cp.float32(std)
                if mean:
                    x += cp.float32(mean)
                if re.search(r"hc_(attn|ffn)_base$", name):
                    comb = x[2 * hc:].reshape(hc, hc)
                    comb[cp.arange(hc), cp.arange(hc)] += cp.float32(COMB_DIAGONAL_LOGIT)
                arr = x if spec.kind == "f32" else bf16_bits(x)
            sw._put(name, arr)
            if progress is not None:
                progress.update(1)
        cp.cuda.Device(device).synchronize()
    return sw
