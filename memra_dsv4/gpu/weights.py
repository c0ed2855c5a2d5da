"""Device weights of the GPU runtime: what lives where, in which format.

Contract
--------
* ``weight_plan(cfg, n_devices)`` (pure, CPU-testable) splits the trunk with
  ``placement.plan_split(dense="bf16")``: embedding on the first stage, head group on the
  last; returns ``[(stage_index, layers range, has_embed, has_head)]``.
* ``load_stage_weights(ckpt, device, layers, has_embed, has_head)`` uploads one stage:
    - FP8 dense linears: dequantised exactly on the host and converted to bf16 bits through
      ``formats.f32_to_bf16_exact`` (a value bf16 cannot hold raises, naming the tensor);
      stored under the ``.weight`` name as uint16 [out, in].  Their ``.scale`` sidecars are
      not uploaded.
    - bf16 tensors: uint16 bit patterns; f32 tensors: float32; tid2eid: int64.
    - routed experts stay as stored, stacked per layer and matrix so kernels index them by
      expert id: ``{p}.ffn.experts.{w}.packed`` uint8 [E, out, in/2], ``.scale`` uint8
      (MXFP4 e8m0 [E, out, in/32] or NVFP4 e4m3 [E, out, in/16]) and, NVFP4 only,
      ``.ws2`` float32 [E] on the host (a launch argument).  ``StageWeights.expert_fmt[layer]``.
* ``synthetic_stage_weights(cfg, device, layers, ..., seed, experts)`` builds the same
  dictionary directly on the device with CuPy random numbers (value scales as ``synth``;
  FP4 codes are random bytes: every e2m1 nibble is a valid code; scales fixed so weights are
  ~1/sqrt(fan_in)).  For full-size benchmarks without a checkpoint.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.config import Dsv4Config
from memra_dsv4.tensors import expected_tensors

__all__ = ["StageWeights", "weight_plan", "load_stage_weights", "synthetic_stage_weights"]

_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale|weight_scale|weight_scale_2|input_scale)$")


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

    def __getitem__(self, name: str):
        try:
            return self.t[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is not on device {self.device} (stage layers "
                           f"{self.layers.start}..{self.layers.stop - 1})") from None


def weight_plan(cfg: Dsv4Config, n_devices: int, experts: str = "mxfp4", max_seq_len: int = 4096):
    """[(stage_index, layers, has_embed, has_head)] from placement.plan_split."""
    if n_devices == 1:
        return [(0, range(cfg.num_hidden_layers), True, True)]
    from memra_dsv4.placement import plan_split

    pl = plan_split(cfg, n_devices, experts=experts, max_seq_len=max_seq_len, dense="bf16",
                    include_drafter=False, device_bytes=1 << 50)
    return [(i, st.layers, st.has_embed, st.has_head) for i, st in enumerate(pl.stages)]


def _stage_specs(cfg, layers, has_embed, has_head, experts="mxfp4"):
    for s in expected_tensors(cfg, experts):
        if s.layer is None:
            if (s.group == "embed" and has_embed) or (s.group == "head" and has_head):
                yield s
        elif s.layer in layers:
            yield s


def load_stage_weights(ckpt, device: int, layers: range, has_embed: bool, has_head: bool,
                       progress=None) -> StageWeights:
    import cupy as cp
    from memra_dsv4.formats import f32_to_bf16_exact

    cfg = ckpt.config
    sw = StageWeights(device, layers, has_embed, has_head)
    experts: dict[str, dict] = {}
    with cp.cuda.Device(device):
        for spec in ckpt.specs if not callable(ckpt.specs) else ckpt.specs():
            if spec.layer is None:
                if not ((spec.group == "embed" and has_embed) or (spec.group == "head" and has_head)):
                    continue
            elif spec.layer not in layers:
                continue
            name = spec.name
            m = _EXPERT.match(name)
            if m:
                experts.setdefault(f"{m.group(1)}.{m.group(3)}", {}).setdefault(
                    int(m.group(2)), {})[m.group(4)] = ckpt.raw(name)
                if progress is not None:
                    progress.update(1)
                continue
            if spec.kind == "fp8":
                arr = f32_to_bf16_exact(ckpt.dequant(name), name)
            elif spec.kind == "bf16":
                arr = np.asarray(ckpt.raw(name)).view(np.uint16)
            elif spec.kind == "f32":
                arr = np.asarray(ckpt.raw(name), dtype=np.float32)
            elif spec.kind == "i64":
                arr = np.asarray(ckpt.raw(name), dtype=np.int64)
            else:  # fp8 .scale sidecars: folded into the bf16 weight above
                if progress is not None:
                    progress.update(1)
                continue
            sw.t[name] = cp.asarray(np.ascontiguousarray(arr))
            sw.nbytes += sw.t[name].nbytes
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
            sw.t[f"{key}.packed"] = cp.asarray(packed)
            sw.t[f"{key}.scale"] = cp.asarray(scale)
            sw.nbytes += packed.nbytes + scale.nbytes
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


def synthetic_stage_weights(cfg: Dsv4Config, device: int, layers: range, has_embed: bool,
                            has_head: bool, seed: int = 0, experts: str = "mxfp4",
                            progress=None) -> StageWeights:
    import cupy as cp
    from memra_dsv4.gpu.ops_glue import bf16_bits
    from memra_dsv4.synth import COMB_DIAGONAL_LOGIT

    sw = StageWeights(device, layers, has_embed, has_head)
    hc = cfg.hc_mult
    E = cfg.n_routed_experts
    with cp.cuda.Device(device):
        rs = cp.random.RandomState(seed * 1000 + device + 1)
        done_experts: set[str] = set()
        for spec in _stage_specs(cfg, layers, has_embed, has_head, experts):
            name = spec.name
            m = _EXPERT.match(name)
            if m:
                key = f"{m.group(1)}.{m.group(3)}"
                if key not in done_experts:
                    done_experts.add(key)
                    out_f, in_half = spec.shape if m.group(4) == "weight" else (None, None)
                    if out_f is None:  # expert names arrive weight-first; be safe
                        raise AssertionError(f"unexpected expert spec order at {name}")
                    in_f = 2 * in_half
                    sw.expert_fmt[spec.layer] = experts
                    packed = rs.randint(0, 256, size=(E, out_f, in_half), dtype=cp.int32).astype(cp.uint8)
                    target = 1.0 / math.sqrt(in_f) / 2.3   # mean |e2m1| of random codes ~2.3
                    if experts == "mxfp4":
                        b = 127 + int(round(math.log2(target)))
                        scale = cp.full((E, out_f, in_f // 32), b, dtype=cp.uint8)
                    else:
                        scale = cp.full((E, out_f, in_f // 16), 0x38, dtype=cp.uint8)  # e4m3 1.0
                        sw.ws2[key] = np.full(E, 2.0 ** int(round(math.log2(target))), np.float32)
                    sw.t[f"{key}.packed"], sw.t[f"{key}.scale"] = packed, scale
                    sw.nbytes += packed.nbytes + scale.nbytes
                if progress is not None:
                    progress.update(1)
                continue
            if spec.kind in ("e8m0",):  # fp8 sidecar
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
            sw.t[name] = arr
            sw.nbytes += arr.nbytes
            if progress is not None:
                progress.update(1)
        cp.cuda.Device(device).synchronize()
    return sw
