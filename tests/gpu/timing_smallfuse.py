"""Timing of the smallfuse decode kernels against the launches they replace, at the Flash shapes
(one H200, < 60 s).  Each arm is captured REPS times back to back into one CUDA graph (with PDL
edges, as the device step runs) and replayed; printed: microseconds per call (graph time / REPS).

  attention: build_cand + sparse_attn_d512_hg16 (split) + sparse_attn_combine_d512   (3 launches)
             vs sparse_attn_decode_d512_hg16 with the default mergers, and with ONE merger per
             head group (the plain last-CTA pattern), at CSA K = 640 (1K and 8K context) and
             HCA K = 128 + 64;
  compressor: compress_pool_* + norm_rope_sim(row="entry") + pending_advance       (3 launches)
             vs compress_emit_*, gate closed (r - 1 of every r steps) and gate open.

    PYTHONPATH=. python tests/gpu/timing_smallfuse.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np
from timing_common import bits, us_per_call  # tests/gpu on sys.path (run as a script)

from memra_dsv4.config import preset
from memra_dsv4.gpu import ops_decode as DK
from memra_dsv4.gpu.ops import attention as AT
from memra_dsv4.gpu.ops import compressor as CM
from memra_dsv4.host.rope import layer_cos_sin


def _time(fn) -> float:  # with PDL edges, as the device step runs
    return us_per_call(fn, pdl=True)


def attention(rng, cos, sin) -> None:
    H, D, W = 64, 512, 128
    q = bits(rng.standard_normal((1, H, D)))
    sink = cp.asarray(rng.standard_normal(H).astype(np.float32))
    AT.decode_counters()
    for name, ratio, sel_w, n_comp, p in (("CSA 1K ctx", 4, 512, 2048, 1023), ("CSA 8K ctx", 4, 512, 2048, 8191),
                                          ("HCA 8K ctx", 128, None, 64, 8191)):
        kv = bits(rng.standard_normal((W + n_comp, D)))
        K = W + (sel_w if sel_w is not None else n_comp)
        pos = cp.asarray(np.array([p], np.int32))
        sel = None
        if sel_w is not None:
            n_t = min((p + 1) // ratio, n_comp)
            s = np.full(sel_w, -1, np.int32)
            s[:min(sel_w, n_t)] = np.sort(rng.choice(n_t, size=min(sel_w, n_t), replace=False))
            sel = cp.asarray(s)
        cand, out = cp.empty(K, cp.int32), cp.empty((1, H, D), cp.uint16)
        ws = cp.empty(AT.workspace_size(1, H, D, K), cp.float32)
        rope = (pos, cos, sin)

        def unfused():
            DK.build_cand(pos, cand, W, ratio, sel)
            AT.sparse_attention(q, kv, cand.reshape(1, K), sink, D ** -0.5, out=out, n_split=None, workspace=ws,
                                inverse_rope=rope)

        def fused(n_merge=None):
            AT.sparse_attention_decode(q, kv, pos, W, ratio, sel, K, sink, D ** -0.5, out=out, workspace=ws,
                                       n_merge=n_merge, inverse_rope=rope)

        ns = AT.auto_split(1, H, K)
        print(f"attention {name} K={K:4d} n_split={ns:2d}: unfused (3 launches) {_time(unfused):6.2f} us   "
              f"fused, {AT.decode_mergers(H, D, ns)} mergers {_time(fused):6.2f} us   "
              f"fused, 1 merger {_time(lambda: fused(1)):6.2f} us")


def compressor(rng, cos, sin) -> None:
    for name, d, mode, r, ovl in (("main CSA r=4 overlap", 512, "fp8", 4, True),
                                  ("main HCA r=128 plain", 512, "fp8", 128, False),
                                  ("indexer r=4 overlap", 128, "hadfp4", 4, True)):
        rows, C = (2 if ovl else 1) * r, (2 if ovl else 1) * d
        kv = cp.asarray(rng.standard_normal((rows, C)).astype(np.float32))
        sc = cp.asarray(rng.standard_normal((rows, C)).astype(np.float32))
        w = cp.asarray((rng.standard_normal(d) * 0.3 + 1.0).astype(np.float32))
        cache = cp.zeros((64, d), cp.uint16)
        pooled = cp.empty((1, d), cp.float32)
        res = []
        for p in (r * 5 - 2, r * 5 - 1):  # gate closed, gate open
            pos = cp.asarray(np.array([p], np.int32))
            kpos = cp.asarray(np.array([max(p + 1 - r, 0)], np.int32))

            def unfused():
                g = (pos, r)
                if ovl:
                    CM.pool_overlap(kv[r:], sc[r:], 1, out=pooled, prev_kv=kv[:r], prev_score=sc[:r], emit_gate=g)
                else:
                    CM.pool_plain(kv, sc, r, 1, out=pooled, emit_gate=g)
                CM.norm_rope_sim(pooled, w, 1e-6, cos, sin, kpos, mode, out=cache, emit_gate=g, row="entry")
                DK.pending_advance(pos, kv, sc, r, ovl)

            def fused():
                CM.emit(pos, kv, sc, r, ovl, w, 1e-6, cos, sin, mode, cache)

            res.append((_time(unfused), _time(fused)))
        (uc, fc), (uo, fo) = res
        print(f"compressor {name:22s}: gate closed: unfused {uc:6.2f} us  fused {fc:6.2f} us   "
              f"gate open: unfused {uo:6.2f} us  fused {fo:6.2f} us")


def main() -> None:
    rng = np.random.default_rng(0)
    c, s = layer_cos_sin(preset("flash"), 2, np.arange(16384))
    cos, sin = cp.asarray(np.ascontiguousarray(c, np.float32)), cp.asarray(np.ascontiguousarray(s, np.float32))
    attention(rng, cos, sin)
    compressor(rng, cos, sin)


if __name__ == "__main__":
    main()
