"""A small in-memory weight source for oracle tests (until/unless memra_dsv4.synth is used).

``FakeWeights(cfg, seed)`` has the two members the oracle needs: ``.config`` and
``.dequant(name) -> float32`` (int64 for ``tid2eid``), for every name of
``expected_tensors(cfg)`` that is not a scale sidecar.  Values are random but exactly
representable in the stored format of each tensor (bf16; e4m3 x a power of two per 128x128
block for FP8 weights; e2m1 x a power of two per 32 inputs for MXFP4 experts; float32), and
scaled so that activations stay O(1) through the blocks (fan-in scaling of linears, norm
weights near 1, hc mixes of order 1).  Deterministic in (cfg, seed, name).
"""

from __future__ import annotations

import zlib

import numpy as np

from memra_dsv4.host.quant import round_bf16, round_e2m1, round_e4m3
from memra_dsv4.tensors import expected_tensors

__all__ = ["FakeWeights"]


class FakeWeights:
    def __init__(self, cfg, seed: int = 0):
        self.config = cfg
        self.seed = int(seed)
        self._specs = {s.name: s for s in expected_tensors(cfg)}
        self._cache: dict[str, np.ndarray] = {}

    def names(self) -> list[str]:
        return list(self._specs)

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def dequant(self, name: str) -> np.ndarray:
        if name not in self._cache:
            if name not in self._specs:
                raise KeyError(f"FakeWeights: no tensor {name!r} for config {self.config.name}")
            a = self._make(name)
            a.setflags(write=False)
            self._cache[name] = a
        return self._cache[name]

    # ------------------------------------------------------------------------- values
    def _make(self, name: str) -> np.ndarray:
        spec = self._specs[name]
        cfg, rng, shape = self.config, self._rng(name), spec.shape
        leaf = name.rsplit(".", 1)[-1]
        if spec.kind == "i64":  # tid2eid: k distinct experts per vocabulary entry
            E, k = cfg.n_routed_experts, shape[1]
            return np.argsort(rng.random((shape[0], E)), axis=1)[:, :k].astype(np.int64)
        if spec.kind in ("fp8", "mxfp4", "nvfp4"):
            return self._quantised(spec.kind, shape, rng, name)
        if spec.kind == "f32":
            if "hc_" in name and name.endswith("_fn"):
                return (rng.standard_normal(shape) * (0.5 / np.sqrt(shape[1]))).astype(np.float32)
            if name.endswith("_scale"):
                return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            if name.endswith("_base"):
                return (0.3 * rng.standard_normal(shape)).astype(np.float32)
            if leaf == "attn_sink":
                return (0.5 * rng.standard_normal(shape)).astype(np.float32)
            if leaf == "ape":
                return (0.3 * rng.standard_normal(shape)).astype(np.float32)
            if leaf == "bias":
                return (0.1 * rng.standard_normal(shape)).astype(np.float32)
            return rng.standard_normal(shape).astype(np.float32)
        if spec.kind == "bf16":
            if "norm" in name:
                v = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name in ("embed.weight", "head.weight"):
                v = rng.standard_normal(shape) * (1.0 if name == "embed.weight" else 1.0 / np.sqrt(shape[1]))
            else:  # compressor / indexer projections, gate: fan-in scaled
                v = rng.standard_normal(shape) / np.sqrt(shape[-1])
            return round_bf16(v.astype(np.float32))
        raise ValueError(f"FakeWeights: {name} is a sidecar ({spec.kind}); ask for the weight")

    @staticmethod
    def _quantised(kind: str, shape, rng, name) -> np.ndarray:
        out_f, in_f = shape[0], (shape[1] * 2 if kind != "fp8" else shape[1])
        target = 1.0 / np.sqrt(in_f)
        if kind == "fp8":
            g = rng.standard_normal((out_f, in_f)) * 16.0
            # one power-of-two scale per 128x128 block, varied by a factor up to 2 around target
            bo, bi = -(-out_f // 128), -(-in_f // 128)
            e = np.round(np.log2(target / 16.0)) + rng.integers(-1, 1, size=(bo, bi), endpoint=True)
            s = np.repeat(np.repeat(np.exp2(e), 128, 0), 128, 1)[:out_f, :in_f]
            return (round_e4m3(g) * s).astype(np.float32)
        g = np.clip(rng.standard_normal((out_f, in_f)) * 2.0, -6, 6)
        e = np.round(np.log2(target / 2.0)) + rng.integers(-1, 1, size=(out_f, in_f // 32), endpoint=True)
        s = np.repeat(np.exp2(e), 32, 1)
        return (round_e2m1(g) * s).astype(np.float32)
