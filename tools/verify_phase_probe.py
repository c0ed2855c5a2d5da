"""Where a speculative verify's time goes: host or device, and which phases.

    python tools/verify_phase_probe.py [--model synthetic:flash] [--ctx 1024] [--t 3] [--rounds 8]

Runs ``verify`` of t tokens + ``commit(0)`` on a random-filled state (bench.decode_step's) with
``MEMRA_DSV4_PROF=events``: prints the wall ms per round (median), the GPU ms the phase brackets
measured in the same rounds, and the phase report's top rows (GPU µs per phase, per round).  Wall
far above the phases' GPU time means the round is host-bound (the chunk routine's host work per
layer), not bandwidth-bound.  Numbers of one process only; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:flash")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--t", type=int, default=3, help="tokens per verify (>= 2)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    if a.t < 2 or a.rounds < 1 or not a.model.startswith("synthetic:") or a.ctx % 128:
        raise SystemExit("--t >= 2, --rounds >= 1, --model synthetic:PRESET, --ctx % 128 == 0")
    os.environ["MEMRA_DSV4_PROF"] = "events"
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.decode_step import random_filled_state
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.profiling import phase_collect, phase_report, phase_reset
    msl = a.ctx + 128 + (a.rounds + a.warmup) * 2 + a.t
    m = Dsv4Gpu.synthetic(a.model.split(":", 1)[1], devices=(0,), seed=0, max_seq_len=msl,
                          expert_storage="shared")
    st = random_filled_state(m, a.ctx, msl)
    rng = np.random.default_rng(0)

    def one_round():
        m.verify(st, rng.integers(0, m.config.vocab_size, a.t).tolist())
        m.commit(st, 0)
    for _ in range(a.warmup):
        one_round()
    phase_collect()
    phase_reset()
    walls = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        one_round()
        walls.append((time.perf_counter() - t0) * 1e3)
    times = phase_collect()
    gpu_ms = sum(sum(v) for k, v in times.items() if k == "verify") / 1e3 / a.rounds
    print(f"{a.model} ctx {a.ctx} verify t={a.t} + commit(0): wall median "
          f"{float(np.median(walls)):.2f} ms, the 'verify' bracket's GPU span {gpu_ms:.2f} ms "
          f"per round ({a.rounds} rounds)")
    text = phase_report(step_count=a.rounds, file=None)
    print("\n".join(text.splitlines()[:40]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
