"""Pipeline placement: which contiguous trunk layers live on which device, from per-layer byte math.

Contract
--------
``plan_split(cfg, n_devices, ...)`` returns a ``Placement``: one ``Stage`` per device with a
contiguous, non-empty range of trunk layers, the embedding on the first device and the head
group plus the drafter (MTP / DSpark stages) on the last.  The split minimises the largest
per-device total (exact dynamic programme over cut points; ties go to the earliest cuts).

Per-device total = weights + KV caches + workspace, where

* weights are the bytes as they will live on the device, from ``expected_tensors``:
    - ``dense="stored"``: exactly the checkpoint bytes;
    - ``dense="fp8"``: FP8 linears stay e4m3, their e8m0 block scales are decoded to fp32
      for cuBLASLt (4x the scale bytes);
    - ``dense="bf16"``: FP8 linears dequantised to bf16 (2x the weight bytes, no scales);
  routed experts always stay as stored (MXFP4 / NVFP4); everything else (bf16, f32, i64
  tensors) as stored.
* KV caches per layer and sequence, for ``max_seq_len`` tokens (dsv4_attention.md 7.1, 7.5):
  the window ring ``sliding_window x head_dim`` bf16 on every layer; on compressed layers
  (ratio r) the compressed rows ``max_seq_len // r x head_dim`` bf16 and the compressor's
  pending kv + score state in f32 (``2 x (coff*r) x (coff*head_dim)``, coff = 2 for the
  overlapping ratio-4 CSA, 1 for HCA); on CSA layers also the indexer keys
  ``max_seq_len // 4 x index_head_dim`` bf16 and the indexer compressor's pending state
  (``2 x 8 x 2*index_head_dim`` f32).  Times ``max_batch`` sequences.  Drafter stages are
  ratio-0 layers: a window ring each.
* ``workspace_bytes`` per device (activations, cuBLASLt workspace, staging).

With ``device_bytes`` set, a split whose largest device needs more than ``device_bytes -
context_bytes`` raises ``PlacementError`` (the minimum over all splits is that largest device,
so nothing else fits either).  ``context_bytes`` stands for what lives outside the arena (CUDA
context, cuBLASLt, loaded modules).

``main(argv)`` is ``python -m memra_dsv4 plan``: prints the table; bad arguments print one line
and return 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field

from memra_dsv4.cli import ArgParser, UsageError
from memra_dsv4.config import CSA_RATIO, ConfigError, Dsv4Config, preset
from memra_dsv4.tensors import (EXPERT_FORMATS, G_EMBED, G_EXPERTS, G_HEAD, TensorSpec,
                                expected_tensors)

__all__ = ["plan_split", "Placement", "Stage", "PlacementError", "weight_bytes_on_device",
           "layer_kv_bytes", "DENSE_ARMS", "DEFAULT_WORKSPACE_BYTES", "DEFAULT_CONTEXT_BYTES",
           "GiB", "main"]

GiB = 1 << 30
DENSE_ARMS = ("fp8", "bf16", "stored")
DEFAULT_WORKSPACE_BYTES = 2 * GiB
DEFAULT_CONTEXT_BYTES = 1 * GiB


class PlacementError(ValueError):
    """No split fits, or the request itself is malformed."""


def weight_bytes_on_device(spec: TensorSpec, dense: str) -> int:
    """Bytes of one checkpoint tensor once loaded for the given dense arm."""
    if spec.group == G_EXPERTS or dense == "stored":
        return spec.nbytes
    if spec.kind == "fp8":                       # e4m3 weight of a dense FP8 linear
        return spec.nbytes * (2 if dense == "bf16" else 1)
    if spec.kind == "e8m0":                      # its 128x128 block-scale sidecar
        return 0 if dense == "bf16" else spec.nbytes * 4
    return spec.nbytes


@functools.lru_cache(maxsize=8)
def _specs(cfg: Dsv4Config, experts: str) -> tuple[TensorSpec, ...]:
    return tuple(expected_tensors(cfg, experts))   # ~100k specs for Flash: build once


def layer_kv_bytes(cfg: Dsv4Config, layer: int, max_seq_len: int, max_batch: int = 1) -> int:
    """Per-device cache bytes of one layer id (trunk, or num_hidden_layers + drafter stage)."""
    hd = cfg.head_dim
    b = cfg.sliding_window * hd * 2                          # window ring, bf16
    r = cfg.compress_ratio(layer)
    if r > 0:
        coff = 2 if r == CSA_RATIO else 1
        b += (max_seq_len // r) * hd * 2                     # compressed rows, bf16
        b += 2 * (coff * r) * (coff * hd) * 4                # pending kv + score, f32
    if r == CSA_RATIO:
        ihd = cfg.index_head_dim
        b += (max_seq_len // r) * ihd * 2                    # indexer key cache, bf16
        b += 2 * (2 * r) * (2 * ihd) * 4                     # indexer pending state, f32
    return b * max_batch


@dataclass(frozen=True)
class Stage:
    device: int
    layers: range                 # trunk layers on this device
    weights_bytes: int
    kv_bytes: int
    workspace_bytes: int
    has_embed: bool
    has_head: bool
    has_drafter: bool

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def extras(self) -> str:
        parts = []
        if self.has_embed:
            parts.append("embed")
        if self.has_head:
            parts.append("head")
        if self.has_drafter:
            parts.append("drafter")
        return ", ".join(parts)


@dataclass(frozen=True)
class Placement:
    stages: tuple[Stage, ...]
    model: str
    experts: str
    dense: str
    max_seq_len: int
    max_batch: int
    drafter: str                      # drafter kind placed ("none" when excluded)
    layer_bytes: tuple[int, ...] = field(repr=False)   # per trunk layer: weights + KV

    @property
    def n_devices(self) -> int:
        return len(self.stages)

    @property
    def cuts(self) -> tuple[int, ...]:
        """Last trunk layer of every stage but the last ("split after layer k")."""
        return tuple(s.layers[-1] for s in self.stages[:-1])

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.stages)

    @property
    def max_stage_bytes(self) -> int:
        return max(s.total_bytes for s in self.stages)

    def device_of_layer(self, layer: int) -> int:
        for s in self.stages:
            if layer in s.layers:
                return s.device
        raise KeyError(f"layer {layer} is not placed")

    def table(self) -> str:
        def g(x: int) -> str:
            return f"{x / GiB:9.2f}"

        head = (f"plan: {self.model}, {self.experts} experts, dense {self.dense}, "
                f"max_seq_len {self.max_seq_len}, batch {self.max_batch}, drafter {self.drafter}, "
                f"{self.n_devices} device(s)")
        lines = [head,
                 f"{'device':<7}{'layers':<16}{'weights GiB':>12}{'KV GiB':>10}"
                 f"{'work GiB':>10}{'total GiB':>11}  extras"]
        for s in self.stages:
            rng = f"{s.layers[0]}-{s.layers[-1]} ({len(s.layers)})"
            lines.append(f"{s.device:<7}{rng:<16}{g(s.weights_bytes):>12}{g(s.kv_bytes):>10}"
                         f"{g(s.workspace_bytes):>10}{g(s.total_bytes):>11}  {s.extras}")
        tot = self.stages
        lines.append(f"{'total':<7}{'':<16}{g(sum(s.weights_bytes for s in tot)):>12}"
                     f"{g(sum(s.kv_bytes for s in tot)):>10}"
                     f"{g(sum(s.workspace_bytes for s in tot)):>10}{g(self.total_bytes):>11}")
        if self.cuts:
            lines.append("cuts: " + ", ".join(f"after layer {k}" for k in self.cuts))
        return "\n".join(lines)


def plan_split(cfg: Dsv4Config, n_devices: int, experts: str = "mxfp4", max_seq_len: int = 4096,
               dense: str = "fp8", include_drafter: bool = True,
               workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, max_batch: int = 1,
               device_bytes: int | None = None,
               context_bytes: int = DEFAULT_CONTEXT_BYTES) -> Placement:
    n_layers = cfg.num_hidden_layers
    if not isinstance(n_devices, int) or n_devices < 1:
        raise PlacementError(f"n_devices = {n_devices!r} must be a positive integer")
    if n_devices > n_layers:
        raise PlacementError(f"{n_devices} devices for {n_layers} trunk layers: every device "
                             f"needs at least one layer")
    if experts not in EXPERT_FORMATS:
        raise PlacementError(f"experts = {experts!r}; expected one of {EXPERT_FORMATS}")
    if dense not in DENSE_ARMS:
        raise PlacementError(f"dense = {dense!r}; expected one of {DENSE_ARMS}")
    if max_seq_len < 1 or max_batch < 1 or workspace_bytes < 0:
        raise PlacementError(f"max_seq_len ({max_seq_len}) and max_batch ({max_batch}) must be "
                             f">= 1 and workspace_bytes ({workspace_bytes}) >= 0")

    specs = _specs(cfg, experts)
    layer_w = [0] * n_layers
    embed_w = head_w = drafter_w = 0
    for s in specs:
        b = weight_bytes_on_device(s, dense)
        if s.layer is None:
            if s.group == G_EMBED:
                embed_w += b
            elif s.group == G_HEAD:
                head_w += b
            else:
                raise AssertionError(f"top-level tensor {s.name} in unexpected group {s.group}")
        elif s.layer < n_layers:
            layer_w[s.layer] += b
        else:
            drafter_w += b
    layer_kv = [layer_kv_bytes(cfg, l, max_seq_len, max_batch) for l in range(n_layers)]
    drafter_kind = cfg.drafter_kind if include_drafter else "none"
    drafter_kv = 0
    if include_drafter:
        drafter_kv = sum(layer_kv_bytes(cfg, n_layers + s, max_seq_len, max_batch)
                         for s in range(cfg.num_drafter_stages))
    else:
        drafter_w = 0

    cost = [w + k for w, k in zip(layer_w, layer_kv)]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    first_extra = embed_w
    last_extra = head_w + drafter_w + drafter_kv

    def stage_cost(j: int, a: int, b: int) -> int:
        c = prefix[b] - prefix[a] + workspace_bytes
        if j == 0:
            c += first_extra
        if j == n_devices - 1:
            c += last_extra
        return c

    # best[j][i]: smallest possible max stage cost placing layers [0, i) on stages 0..j-1.
    INF = float("inf")
    best = [[INF] * (n_layers + 1) for _ in range(n_devices + 1)]
    arg = [[-1] * (n_layers + 1) for _ in range(n_devices + 1)]
    best[0][0] = 0
    for j in range(n_devices):
        for b in range(j + 1, n_layers - (n_devices - 1 - j) + 1):
            for a in range(j, b):
                if best[j][a] == INF:
                    continue
                v = max(best[j][a], stage_cost(j, a, b))
                if v < best[j + 1][b]:          # strict: ties keep the earliest cut
                    best[j + 1][b], arg[j + 1][b] = v, a
    bounds = [n_layers]
    for j in range(n_devices, 0, -1):
        bounds.append(arg[j][bounds[-1]])
    bounds.reverse()
    assert bounds[0] == 0 and len(bounds) == n_devices + 1

    stages = []
    for j in range(n_devices):
        a, b = bounds[j], bounds[j + 1]
        w = sum(layer_w[a:b]) + (embed_w if j == 0 else 0)
        kv = sum(layer_kv[a:b])
        if j == n_devices - 1:
            w += head_w + drafter_w
            kv += drafter_kv
        stages.append(Stage(device=j, layers=range(a, b), weights_bytes=w, kv_bytes=kv,
                            workspace_bytes=workspace_bytes, has_embed=j == 0,
                            has_head=j == n_devices - 1,
                            has_drafter=j == n_devices - 1 and drafter_kind != "none"))
        assert stages[-1].total_bytes == stage_cost(j, a, b)
    placement = Placement(stages=tuple(stages), model=cfg.name, experts=experts, dense=dense,
                          max_seq_len=max_seq_len, max_batch=max_batch, drafter=drafter_kind,
                          layer_bytes=tuple(cost))
    if device_bytes is not None:
        usable = device_bytes - context_bytes
        worst = max(placement.stages, key=lambda s: s.total_bytes)
        if worst.total_bytes > usable:
            raise PlacementError(
                f"does not fit: the most balanced split over {n_devices} device(s) still needs "
                f"{worst.total_bytes / GiB:.2f} GiB on device {worst.device} (weights "
                f"{worst.weights_bytes / GiB:.2f} + KV {worst.kv_bytes / GiB:.2f} + workspace "
                f"{worst.workspace_bytes / GiB:.2f}) but a device offers "
                f"{device_bytes / GiB:.2f} GiB minus {context_bytes / GiB:.2f} GiB context "
                f"reserve; use more devices, dense fp8, a smaller max_seq_len or max_batch")
    return placement


# ------------------------------------------------------------------------ CLI
def _detect_experts(ckpt: str) -> str:
    """nvfp4 when the checkpoint index lists NVFP4 sidecars (weight_scale_2), else mxfp4."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return "mxfp4"
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{index}: unreadable ({e})") from None
    return "nvfp4" if any(k.endswith(".weight_scale_2") for k in weight_map) else "mxfp4"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = ArgParser(prog="python -m memra_dsv4 plan",
                 description="Print the pipeline split of a DeepSeek-V4 checkpoint over N devices.")
    ap.add_argument("ckpt", nargs="?", help="checkpoint directory (config.json)")
    ap.add_argument("--preset", help="a config preset instead of a checkpoint (flash, pro, ...)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--experts", choices=EXPERT_FORMATS,
                    help="expert format (default: detected from the checkpoint, else mxfp4)")
    ap.add_argument("--dense", choices=DENSE_ARMS, default="fp8")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--workspace-gib", type=float, default=DEFAULT_WORKSPACE_BYTES / GiB)
    ap.add_argument("--device-gib", type=float, default=None,
                    help="memory per device; refuse splits that do not fit")
    ap.add_argument("--no-drafter", action="store_true", help="leave the MTP/DSpark drafter out")
    try:
        if any(a in ("-h", "--help") for a in argv):
            ap.print_help()
            return 0
        args = ap.parse_args(argv)
        if (args.ckpt is None) == (args.preset is None):
            raise UsageError("give exactly one of CKPT or --preset NAME")
        if args.ckpt is not None:
            if not os.path.isdir(args.ckpt):
                raise UsageError(f"checkpoint directory {args.ckpt} does not exist")
            cfg = Dsv4Config.from_checkpoint(args.ckpt)
            experts = args.experts or _detect_experts(args.ckpt)
        else:
            cfg = preset(args.preset)
            experts = args.experts or "mxfp4"
        if args.workspace_gib < 0:
            raise UsageError(f"--workspace-gib {args.workspace_gib} must be >= 0")
        placement = plan_split(
            cfg, args.devices, experts=experts, max_seq_len=args.max_seq_len, dense=args.dense,
            include_drafter=not args.no_drafter, workspace_bytes=int(args.workspace_gib * GiB),
            max_batch=args.max_batch,
            device_bytes=None if args.device_gib is None else int(args.device_gib * GiB))
    except (UsageError, ConfigError, PlacementError) as e:
        print(f"memra_dsv4 plan: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    print(placement.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
