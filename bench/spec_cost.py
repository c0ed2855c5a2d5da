"""What speculative decoding costs on the GPU, per piece, in one process (interleaved rounds):

    python -m bench.spec_cost --model synthetic:flash --devices 0 --ctx 1024 --tmax 6 \
        --mtp-k 1,2,3 --steps 30 [--path device] [--expert-storage shared]

Arms (wall-clock ms per call: every piece ends with its host readback, so the host's time is the
engine's time):
* ``decode``: one ``Dsv4Gpu.decode_step`` on ``--path`` (the plain step speculative decoding has to
  beat);
* ``verify t``, t = 2..tmax: ``verify`` of t tokens (the last token and t - 1 drafts) plus
  ``commit(0)`` (the rollback of t - 1 positions), the cost of a round that accepts nothing;
  ``cost(t)`` for ``speculative_generate(schedule=...)`` is this row over the decode row.  One
  set of rows per ``--verify-paths`` entry (seam MEMRA_DSV4_VERIFY_PATH, set on the model
  before each call): ``chunk`` rows are named ``verify t``, ``device`` rows ``dverify t``
  (gpu.verify_step; only t <= its row limit, longer verifies would take the chunk routine);
* ``mtp k`` / ``dspark k``: the checkpoint's drafter's ``propose`` of one new row and k drafts
  (``--mtp-k``), its window filled by a first propose of 128 rows: ``GpuMtpDrafter`` (rows: final
  streams), or for a DSpark preset (``synthetic:flash-0731``) ``GpuDSparkDrafter`` (rows: the
  three taps; every propose drafts a whole block of B and returns the first k).
The state is a random-filled one at ``--ctx`` (bench.decode_step.random_filled_state: the bytes
and work of a step depend on pos, not on the values); every arm advances it by one position per
call (commit(0) keeps the first verified token), so the context grows by (2 + tmax + len(mtp-k))
per round; max_seq_len is sized for it.  Prints the medians and the ratios to ``decode``, beside
each verify row the byte model's ratio (gpu.verify_bytes.verify_cost_model at --ctx: what a
verify reading every weight once for its t rows would cost), writes JSON + PNG under
bench/results/ (bench.harness.write_results).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.harness import Arm, PerfCounterTimer, run_interleaved, summarize, write_results


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"expected integers >= 1, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:flash-layers:4")
    ap.add_argument("--devices", default="0")
    ap.add_argument("--ctx", type=int, default=1024, help="a multiple of 128")
    ap.add_argument("--tmax", type=int, default=6, help="verify lengths 2..tmax")
    ap.add_argument("--mtp-k", default="1,2,3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--path", default="device", help="decode path of the decode arm")
    ap.add_argument("--verify-paths", default="chunk,device",
                    help="comma-separated verify paths to time (chunk, device)")
    ap.add_argument("--expert-storage", default="per-layer", choices=("per-layer", "shared"))
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    from memra_dsv4.oracle.decode import MAX_DRAFT
    if not 2 <= a.tmax <= MAX_DRAFT + 1:   # a verify holds the last token and >= 1 draft
        raise SystemExit(f"--tmax {a.tmax}: must be in 2..{MAX_DRAFT + 1}")
    ks = _ints(a.mtp_k)
    vpaths = [p for p in a.verify_paths.split(",") if p]
    if not vpaths or set(vpaths) - {"chunk", "device"}:
        raise SystemExit(f"--verify-paths {a.verify_paths!r}: expected a comma-separated subset of chunk,device")
    devices = tuple(int(d) for d in a.devices.split(","))
    rounds = a.steps + a.warmup
    msl = a.ctx + 128 + rounds * (2 + a.tmax + len(ks)) + max(ks) + 8

    if not a.model.startswith("synthetic:"):
        raise SystemExit("--model: synthetic:PRESET only (the cost does not depend on the values)")
    if a.ctx < 128 or a.ctx % 128:
        raise SystemExit(f"--ctx {a.ctx}: must be a positive multiple of 128")

    import cupy as cp
    from bench.decode_step import random_filled_state
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.gpu.spec import default_drafter
    m = Dsv4Gpu.synthetic(a.model.split(":", 1)[1], devices=devices, seed=0, max_seq_len=msl,
                          decode_path=a.path, expert_storage=a.expert_storage, drafter=True)
    cfg = m.config
    state = random_filled_state(m, a.ctx, msl)
    rng = np.random.default_rng(0)

    def tok() -> int:
        return int(rng.integers(0, cfg.vocab_size))

    drafter = default_drafter(m)
    drafter.begin(m, msl)
    last = m.stages[m.drafter_stage]
    taps = getattr(drafter, "trunk_taps", None)
    row = (cfg.hc_mult, cfg.hidden_size) if taps is None else (len(taps(m)), cfg.hc_mult,
                                                               cfg.hidden_size)
    with cp.cuda.Device(last.device):
        rows = (cp.random.default_rng(1).standard_normal((128,) + row, dtype=cp.float32) * 0.5)
        rows = (rows.view(cp.uint32) & cp.uint32(0xFFFF0000)).view(cp.float32)   # bf16 values
    drafter.propose(rows, rng.integers(0, cfg.vocab_size, 128), 1)

    arms = [Arm("decode", lambda: m.decode_step(state, tok()))]

    from memra_dsv4.gpu.verify_step import row_limit

    def verify_arm(t, vpath):
        def step():
            m.verify_path = vpath
            m.verify(state, [tok() for _ in range(t)])
            m.commit(state, 0)
        return Arm(f"{'d' if vpath == 'device' else ''}verify {t}", step)
    for vpath in vpaths:
        arms += [verify_arm(t, vpath) for t in range(2, a.tmax + 1)
                 if vpath == "chunk" or t <= row_limit(cfg)]

    def draft_arm(k):
        return Arm(f"{drafter.name} {k}", lambda: drafter.propose(rows[-1:], [tok()], k))
    arms += [draft_arm(k) for k in ks]

    from memra_dsv4.gpu.verify_bytes import verify_cost_model
    st0 = m.stages[0]
    byte_model = verify_cost_model(cfg, a.ctx, [(s.layers, s.has_embed, s.has_head)
                                                for s in m.stages],
                                   dense=st0.dense_fmt, experts=st0.expert_fmt.get(
                                       st0.layers.start, "mxfp4"))
    samples = run_interleaved(arms, a.steps, a.warmup, PerfCounterTimer())
    summaries = {name: summarize(s) for name, s in samples.items()}
    base = summaries["decode"]["median"]
    res = {}
    print(f"{a.model} ctx {a.ctx} path {a.path}, {a.steps} rounds (wall ms, median [p10, p90])")
    for name, sm in summaries.items():
        res[name] = {"summary": sm, "over_decode": sm["median"] / base}
        model_note = ""
        if "verify " in name:
            res[name]["byte_model_over_decode"] = bm = byte_model(int(name.split()[1]))
            model_note = f"  (byte model x{bm:.2f})"
        print(f"  {name:10s} {sm['median']:8.3f} ms [{sm['p10']:.3f}, {sm['p90']:.3f}]  "
              f"x{sm['median'] / base:.2f} of decode{model_note}")
    if not a.no_write:
        payload = {"config": {"bench": "spec_cost", "model": a.model, "devices": list(devices),
                              "ctx": a.ctx, "tmax": a.tmax, "mtp_k": ks, "steps": a.steps,
                              "warmup": a.warmup, "path": a.path,
                              "verify_paths": vpaths,
                              "expert_storage": a.expert_storage, "drafter": drafter.name,
                              "timer": "wall"},
                   "arms": res}
        j, p = write_results(payload)
        print(f"results: {j} {p or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
