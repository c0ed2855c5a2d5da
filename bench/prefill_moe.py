"""Micro-benchmark of the batched prefill MoE (gpu.ops.prefill_moe.routed_moe) on one GPU with
full-size Flash experts (256 x MXFP4 w1/w3 [2048, 4096], w2 [4096, 2048], random bytes) and
random top-6 routing: GPU time per layer (CUDA events around one call after a warm-up call that
builds the cuBLASLt plans) and the projection to 43 layers.  Runs in well under a minute.

    python -m bench.prefill_moe --tokens 1,1024,8192
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,1024,8192")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=43)
    a = ap.parse_args(argv)
    import cupy as cp
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.ops_glue import GemmBackend
    from memra_dsv4.gpu.ops.prefill_moe import dispatch_plan, group_size, routed_moe

    cfg = preset("flash")
    E, k, D, I = 256, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    with cp.cuda.Device(a.device):
        rs = cp.random.RandomState(0)
        experts = {}
        for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            packed = rs.randint(0, 256, size=(E, o, i // 2), dtype=cp.int32).astype(cp.uint8)
            scale = rs.randint(116, 123, size=(E, o, i // 32), dtype=cp.int32).astype(cp.uint8)
            experts[w] = (packed, scale)
        g = GemmBackend(a.device, "blaslt")
        rng = np.random.default_rng(0)
        print(f"group size {group_size(I, D)} experts; {a.layers} layers projected")
        for T in [int(t) for t in a.tokens.split(",")]:
            x = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
            idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
            wts = cp.asarray(rng.random((T, k)).astype(np.float32))
            shared = cp.zeros((T, D), dtype=cp.float32)
            t0 = time.perf_counter()
            routed_moe(g, x, idx, wts, experts, "mxfp4", cfg.swiglu_limit, shared)   # plans
            cp.cuda.Device(a.device).synchronize()
            warm = time.perf_counter() - t0
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            t0 = time.perf_counter()
            e0.record()
            routed_moe(g, x, idx, wts, experts, "mxfp4", cfg.swiglu_limit, shared)
            e1.record()
            host = time.perf_counter() - t0
            e1.synchronize()
            ms = cp.cuda.get_elapsed_time(e0, e1)
            p = dispatch_plan(idx, group_size(I, D))
            print(f"T={T:5d}: {ms:8.2f} ms/layer GPU ({host * 1e3:7.2f} ms host enqueue), "
                  f"x{a.layers} = {ms * a.layers / 1e3:6.3f} s; {p.eids.size} experts in "
                  f"{len(p.groups)} groups, {p.rows} padded rows for {T * k} picks "
                  f"(first call incl. plans {warm * 1e3:.0f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
