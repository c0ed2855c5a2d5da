"""Micro-benchmark of the batched prefill MoE (gpu.ops.prefill_moe.routed_moe) on one GPU with
full-size Flash experts (256 x MXFP4 w1/w3 [2048, 4096], w2 [4096, 2048], random bytes) and
random top-6 routing: GPU time per layer (CUDA events around one call after a warm-up call that
builds the cuBLASLt plans) and the projection to 43 layers, for each GEMM arm (--gemm: "blaslt" =
dequant into bf16 scratch + cuBLASLt batches, the default path; "fp4mma" = the FP4 tensor-core
grouped GEMM on the stored bytes (mma.sync); "wgmma" = the same on Hopper warpgroup MMA).  For
fp4mma and wgmma also the two kernels alone (gate/up + SwiGLU, down) and the stored FP4 bytes they
read per layer against the copy bandwidth.  Runs in well under a minute.

    python -m bench.prefill_moe --tokens 1,1024,8192 --gemm blaslt,fp4mma,wgmma
    python -m bench.prefill_moe --tokens 1024,8192 --gemm fp4mma,wgmma --dispatch host,device

--dispatch: routed_moe(dispatch=) arms of the fp4mma and wgmma GEMMs (the ids live on the device,
as in the model: "host" reads them back and plans in NumPy, "device" plans with kernels); blaslt
always plans on the host.  With both, the two outputs of each arm are compared bit for bit.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

COPY_BW = 4.23e12   # measured H200 device copy bandwidth (bench/results), bytes / s


def _events_ms(fn, reps=1):
    """GPU milliseconds per call of fn over reps back-to-back calls (harness.CudaEventTimer)."""
    from bench.harness import CudaEventTimer
    return CudaEventTimer()(lambda: [fn() for _ in range(reps)]) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,1024,8192")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--gemm", default="blaslt,fp4mma,wgmma", help="comma list of routed_moe(gemm=) arms")
    ap.add_argument("--dispatch", default="host",
                    help="comma list of routed_moe(dispatch=) arms (fp4mma, wgmma)")
    a = ap.parse_args(argv)
    import cupy as cp
    from memra_dsv4.config import preset
    from memra_dsv4.gpu.ops_glue import GemmBackend
    from memra_dsv4.gpu.ops import prefill_moe as PM

    cfg = preset("flash")
    E, k, D, I = 256, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    gemms = [s.strip() for s in a.gemm.split(",") if s.strip()]
    disps = [s.strip() for s in a.dispatch.split(",") if s.strip()]
    for arm in gemms:
        assert arm in PM.GEMMS, f"--gemm {arm!r} not in {PM.GEMMS}"
    for d in disps:
        assert d in PM.DISPATCHES, f"--dispatch {d!r} not in {PM.DISPATCHES}"
    arms = [(gm, d) for gm in gemms for d in (disps if gm in PM.PLAN_GEMMS else ["host"])]
    with cp.cuda.Device(a.device):
        rs = cp.random.RandomState(0)
        experts = {}
        for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            packed = rs.randint(0, 256, size=(E, o, i // 2), dtype=cp.int32).astype(cp.uint8)
            scale = rs.randint(116, 123, size=(E, o, i // 32), dtype=cp.int32).astype(cp.uint8)
            experts[w] = (packed, scale)
        per_expert_bytes = sum(int(p[0].nbytes + s[0].nbytes) for p, s in experts.values())
        g = GemmBackend(a.device, "blaslt")
        rng = np.random.default_rng(0)
        grp = PM.group_size(I, D)
        print(f"group size {grp} experts; {a.layers} layers projected; arms {arms}")
        for T in [int(t) for t in a.tokens.split(",")]:
            x = cp.asarray(rng.standard_normal((T, D)).astype(np.float32))
            idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
            idx_d = cp.asarray(idx)
            wts = cp.asarray(rng.random((T, k)).astype(np.float32))
            shared = cp.zeros((T, D), dtype=cp.float32)
            p = PM.dispatch_plan(idx, grp)
            fp4_bytes = p.eids.size * per_expert_bytes
            res = {}
            for arm, disp in arms:
                label = arm if len(disps) == 1 or arm not in PM.PLAN_GEMMS else f"{arm}/{disp}"

                def call():
                    return PM.routed_moe(g, x, idx_d, wts, experts, "mxfp4", cfg.swiglu_limit, shared,
                                         gemm=arm, dispatch=disp)
                t0 = time.perf_counter()
                out = call()                                   # plans / module load
                cp.cuda.Device(a.device).synchronize()
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                ms = _events_ms(call)
                host = time.perf_counter() - t0
                res[label] = (ms, out)
                print(f"T={T:5d} {label:13s}: {ms:8.2f} ms/layer GPU (incl. {host * 1e3:7.2f} ms wall), "
                      f"x{a.layers} = {ms * a.layers / 1e3:6.3f} s; {p.eids.size} experts in "
                      f"{len(p.groups)} groups, {p.rows} padded rows for {T * k} picks "
                      f"(first call {warm * 1e3:.0f} ms)", flush=True)
                if arm in ("fp4mma", "wgmma") and disp == disps[0]:
                    items_h = PM.mma_items(p) if arm == "fp4mma" else PM.wg_items(p)
                    gateup, down = ((PM.fp4mma_gateup, PM.fp4mma_down) if arm == "fp4mma" else
                                    (PM.wgmma_gateup, PM.wgmma_down))
                    items = cp.asarray(items_h)
                    xs = cp.zeros((p.rows, D), dtype=cp.uint16)
                    hs = cp.zeros((p.rows, I), dtype=cp.uint16)
                    ys = cp.empty((p.rows, D), dtype=cp.float32)
                    flat = cp.asarray(np.maximum(p.flat, 0))
                    wf = wts.reshape(-1)
                    gu = _events_ms(lambda: gateup("mxfp4", experts["w1"], experts["w3"], items, xs,
                                                   wf, flat, cfg.swiglu_limit, hs), reps=3)
                    dn = _events_ms(lambda: down("mxfp4", experts["w2"], items, hs, ys), reps=3)
                    flops = 2 * 3 * T * k * I * D
                    print(f"          {arm} kernels: gate/up+SwiGLU {gu:7.3f} ms, down {dn:7.3f} ms "
                          f"({len(items_h)} items); FP4 bytes {fp4_bytes / 1e9:.2f} GB -> "
                          f"{fp4_bytes / ((gu + dn) * 1e-3) / COPY_BW * 100:5.1f} % of copy bw, "
                          f"{flops / ((gu + dn) * 1e-3) / 1e12:6.1f} TFLOP/s useful", flush=True)
            for gm in PM.PLAN_GEMMS:
                if f"{gm}/host" in res and f"{gm}/device" in res:
                    (mh, oh), (md, od) = res[f"{gm}/host"], res[f"{gm}/device"]
                    same = bool((oh.view(cp.uint32) == od.view(cp.uint32)).all())
                    print(f"          A/B T={T} {gm}: device / host dispatch = {md / mh:5.3f} "
                          f"({mh - md:+.2f} ms/layer), bitwise equal: {same}", flush=True)
            fp = "fp4mma" if "fp4mma" in res else f"fp4mma/{disps[0]}"
            wg = "wgmma" if "wgmma" in res else f"wgmma/{disps[0]}"
            for a_, b_ in dict.fromkeys(((fp, "blaslt"), (wg, "blaslt"), (wg, fp), ("wgmma/device", "fp4mma/device"))):
                if a_ in res and b_ in res:
                    (mb, ob), (mm, om) = res[b_], res[a_]
                    ob, om = ob.get().astype(np.float64), om.get().astype(np.float64)
                    rel = np.linalg.norm(om - ob) / max(np.linalg.norm(ob), 1e-30)
                    print(f"          A/B T={T}: {a_} / {b_} = {mm / mb:5.3f} ({mb - mm:+.2f} ms/layer), "
                          f"relL2({a_}, {b_}) = {rel:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
