"""Where the device verify's time goes: its graph's wall per row count (PDL on / off, one
process), and its launches timed one by one (memra_dsv4.profiling.launches) per kernel and per
call site, at two row counts, so the per-row share stands out.

    python tools/verify_launch_profile.py [--model synthetic:flash] [--ctx 1024] [--t 2,4]
                                          [--rounds 10] [--reps 10] [--json PATH]

The model is synthetic with shared expert storage (bench.spec_cost's default for one GPU); the
state is random-filled at pos = ctx (bench.decode_step.random_filled_state).  Walls: medians of
``rounds`` verify(t) + commit(0) after two warm-ups (and of each half), the device step's median
beside them; then the commit's host and device forms (VerifyStep.commit_form), PDL on.  The
launch profile records one eager verify of each t (PDL off while recording: the launches, not
their overlap) and times each launch alone as a graph of ``reps`` copies (L2-warm: small
weights read faster than in the verify; see profiling/launches.py).  The profile's replays
mutate the state's caches: its state is thrown away.  Prints tables; with --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _walls(m, st, rng, t: int, rounds: int) -> tuple[float, float, float]:
    """Medians (ms) of verify(t) + commit(0), of the verify alone and of the commit alone (both
    return only once their work is done: the verify reads the logits back, the commit
    synchronises its streams)."""
    vocab = m.config.vocab_size
    both, ver, com = [], [], []
    for i in range(rounds + 2):
        ids = rng.integers(0, vocab, t).tolist()
        t0 = time.perf_counter()
        m.verify(st, ids)
        t1 = time.perf_counter()
        m.commit(st, 0)
        t2 = time.perf_counter()
        if i >= 2:
            both.append((t2 - t0) * 1e3)
            ver.append((t1 - t0) * 1e3)
            com.append((t2 - t1) * 1e3)
    return statistics.median(both), statistics.median(ver), statistics.median(com)


def plot_doc(report: dict, meta: dict, top: int = 8) -> dict:
    """bench.plot's document of a report: one bar per verify row count (PDL on) stacked by its
    launch profile's top kernels (each launch alone, so the stack is the launches' time, not the
    replay's), the rest as "other kernels", the wall (verify + commit(0)) as the median; the
    device step as a bar of its wall only.  p10 / p90 are not measured here: both = the median."""
    arms = {}
    step = report["walls_ms"]["decode_step"]
    arms["device step"] = {"summary": {"median": step, "p10": step, "p90": step, "tok_s": 1e3 / step}}
    for t, prof in sorted(report["profiles"].items(), key=lambda kv: int(kv[0])):
        wall = report["walls_ms"].get(f"verify t={t} pdl=on")
        if wall is None:
            continue
        rows = prof["by_kernel"]
        phases = {r["kernel"]: r["total_us"] for r in rows[:top]}
        phases["other kernels"] = sum(r["total_us"] for r in rows[top:])
        arms[f"verify t={t} + commit(0)"] = {
            "phases_us": phases,
            "summary": {"median": wall, "p10": wall, "p90": wall, "tok_s": int(t) * 1e3 / wall}}
    return {"meta": meta, "config": {"model": report["model"], "ctx": report["ctx"]}, "arms": arms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:flash")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--t", default="2,4", help="row counts (each 2..8)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--png-from", default="", metavar="JSON",
                    help="only draw PNG (--png) from a report this tool wrote; no GPU")
    ap.add_argument("--png", default="")
    ap.add_argument("--meta", default="", help="with --png-from: 'gpu,date,commit' for the title")
    a = ap.parse_args(argv)
    if a.png_from:
        if not a.png:
            raise SystemExit("--png-from needs --png")
        from bench.plot import plot_results
        with open(a.png_from) as f:
            report = json.load(f)
        meta = dict(zip(("gpu", "date", "commit"), a.meta.split(","))) if a.meta else {}
        plot_results(plot_doc(report, meta), a.png)
        print(f"png: {a.png}")
        return 0
    ts = [int(x) for x in a.t.split(",") if x]
    if (not ts or any(not 2 <= t <= 8 for t in ts) or a.rounds < 1 or a.reps < 1
            or not a.model.startswith("synthetic:") or a.ctx % 128 or a.ctx < 128):
        raise SystemExit("--t: row counts in 2..8; --rounds, --reps >= 1; --model synthetic:PRESET; "
                         "--ctx a positive multiple of 128")
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.decode_step import random_filled_state
    from memra_dsv4.gpu.model import Dsv4Gpu
    from memra_dsv4.gpu.verify import device_verify_of
    from memra_dsv4.profiling.launches import aggregate, format_rows, record_launches, time_launches

    msl = a.ctx + 128 + 4 * (a.rounds + 4) * max(ts)
    m = Dsv4Gpu.synthetic(a.model.split(":", 1)[1], devices=(0,), seed=0, max_seq_len=msl,
                          expert_storage="shared", verify_path="device", decode_path="device")
    st = random_filled_state(m, a.ctx, msl)
    rng = np.random.default_rng(0)
    report = {"model": a.model, "ctx": a.ctx, "walls_ms": {}, "profiles": {}}
    # walls: PDL on / off, in one process, on one state (commit(0) keeps pos moving by one)
    step = []
    for i in range(a.rounds + 2):
        tok = int(rng.integers(0, m.config.vocab_size))
        t0 = time.perf_counter()
        m.decode_step(st, tok)
        if i >= 2:
            step.append((time.perf_counter() - t0) * 1e3)
    report["walls_ms"]["decode_step"] = statistics.median(step)
    print(f"{a.model} ctx {a.ctx}: device step {report['walls_ms']['decode_step']:.3f} ms (median)")
    old = m.pdl
    try:
        for pdl in ("on", "off"):
            m.pdl = pdl
            for t in ts:
                w, wv, wc = _walls(m, st, rng, t, a.rounds)
                report["walls_ms"][f"verify t={t} pdl={pdl}"] = w
                report["walls_ms"][f"verify only t={t} pdl={pdl}"] = wv
                report["walls_ms"][f"commit(0) t={t} pdl={pdl}"] = wc
                print(f"  device verify t={t} + commit(0), pdl {pdl}: {w:.3f} ms "
                      f"({w / report['walls_ms']['decode_step']:.2f} steps; verify {wv:.3f}, "
                      f"commit(0) {wc:.3f})")
        # the commit's two forms, PDL on (VerifyStep.commit_form: host CuPy operations per
        # layer | one verify_rollback launch per stage), in this process
        m.pdl = "on"
        vs = device_verify_of(m, st, max(ts))
        try:
            for form in ("host", "device"):
                vs.commit_form = form
                for t in ts:
                    w, wv, wc = _walls(m, st, rng, t, a.rounds)
                    report["walls_ms"][f"commit(0) t={t} form={form}"] = wc
                    print(f"  commit form {form}, t={t}: verify + commit(0) {w:.3f} ms, commit(0) {wc:.3f} ms")
        finally:
            vs.commit_form = "host"
        # the launch profile (PDL off while recording)
        m.pdl = "off"
        for t in ts:
            ids = np.asarray(rng.integers(0, m.config.vocab_size, t), np.int64)
            vs = device_verify_of(m, st, t)
            assert vs is not None, "no device verify for these rows"
            recs = record_launches(lambda: vs.verify(st, ids, graph=False), ("verify_step.py",))
            m.commit(st, 0)
            times = time_launches(recs, reps=a.reps)
            by_k, by_s = aggregate(recs, times, "kernel"), aggregate(recs, times, "site")
            print(f"\nlaunch profile t={t}: {len(recs)} launches, sum {sum(times) / 1e3:.3f} ms "
                  f"(each alone, graph of {a.reps} copies, L2-warm)")
            print(format_rows(by_k, "kernel", top=30))
            print(format_rows(by_s, "site", top=30))
            report["profiles"][str(t)] = {"count": len(recs), "sum_ms": sum(times) / 1e3,
                                          "by_kernel": by_k, "by_site": by_s}
    finally:
        m.pdl = old
    if len(ts) >= 2:
        lo, hi = str(min(ts)), str(max(ts))
        P = report["profiles"]
        dn = (P[hi]["count"] - P[lo]["count"]) / (int(hi) - int(lo))
        dms = (P[hi]["sum_ms"] - P[lo]["sum_ms"]) / (int(hi) - int(lo))
        print(f"\nper added row: {dn:.0f} launches, {dms:.3f} ms of launch time")
        report["per_row"] = {"launches": dn, "ms": dms}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
