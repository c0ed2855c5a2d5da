"""What the verify step's multi-row GEMV buys: one launch over nx rows vs nx single-row launches.

    python tools/xrows_gemv_probe.py [--device 0] [--reps 20] [--rows 1,2,4,8]

For the dense bf16 projections of a Flash layer and the LM head (random bf16 weights and rows),
times ops_decode.gemv_bf16_xrows over nx rows (decode.cu gemv_bf16_x*) against nx launches of
gemv_bf16 (the decode step's kernel), each timed alone as a CUDA graph with a 256 MB L2-evicting
memset between copies (profiling.launches.time_launches, as tools/bench_gemv.py), and checks
first that every row of the multi-row launch has gemv_bf16's bytes ("MISMATCH" and exit status 1
otherwise).  Prints µs per launch, the weight bytes / time against the copy bandwidth measured in
the same run, and the cost of nx rows in units of one row; writes the table as JSON + PNG under
bench/results/ (``{date}-{gpu}-{commit}-xrows_gemv``; --no-write: not).  docs/verify_step_plan.md,
stage 1.

    python tools/xrows_gemv_probe.py --from-log LOG --gpu NAME --commit SHA --date YYYY-MM-DD

writes the JSON + PNG of a run's printed table instead (no GPU: for a log whose run predates the
writer; the JSON says so under "source").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, O, K, groups): Flash's dense bf16 GEMVs of one layer and the head
SHAPES = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1),
          ("wo_a (8 groups)", 8192, 4096, 8), ("wo_b", 4096, 8192, 1),
          ("shared w1", 2048, 4096, 1), ("shared w2", 4096, 2048, 1), ("head", 129280, 4096, 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--from-log", default=None)
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--date", default=None)
    a = ap.parse_args(argv)
    if a.from_log:
        if not (a.gpu and a.commit and a.date):
            raise SystemExit("--from-log needs --gpu, --commit and --date")
        text = open(a.from_log, encoding="utf-8").read()
        rows, bw = parse_table(text)
        if not rows:
            raise SystemExit(f"{a.from_log}: no table rows found")
        print(*write(rows, bw, a.gpu, a.commit, a.date,
                     source=f"parsed from the run's log {os.path.basename(a.from_log)}"))
        return 0
    rows = [int(v) for v in a.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 8:
        raise SystemExit(f"--rows {a.rows!r}: integers in 1..8")
    import cupy as cp
    import numpy as np
    from bench.harness import measure_copy_bandwidth
    from memra_dsv4.gpu import ops_decode as DK
    from memra_dsv4.profiling.launches import record_launches, time_launches

    cp.cuda.Device(a.device).use()
    bw = measure_copy_bandwidth(a.device)["copy_bw_Bps"]
    print(f"{cp.cuda.runtime.getDeviceProperties(a.device)['name'].decode()}: copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    rng = cp.random.default_rng(0)

    def bf16(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    def timed(fn) -> float:
        return sum(time_launches(record_launches(fn, ("xrows_gemv_probe.py",)), reps=a.reps,
                                 flush_bytes=256 << 20))

    bad = 0
    table = []
    print(f"{'shape':<18s} {'nx':>3s} {'x-rows us':>10s} {'of bw':>7s} {'nx x 1-row us':>14s} "
          f"{'x-rows / 1 row':>15s}")
    for name, O, K, groups in SHAPES:
        w = bf16(O, K)
        nbytes = 2 * O * K
        one = None
        for nx in rows:
            X = bf16(nx, groups * K)
            out = cp.empty((nx, O), cp.float32)
            refs = [cp.empty(O, cp.float32) for _ in range(nx)]
            xr = [cp.ascontiguousarray(X[j]) for j in range(nx)]
            DK.gemv_bf16_xrows(w, X, out, groups=groups)
            for j in range(nx):
                DK.gemv_bf16(w, xr[j], refs[j], groups=groups)
                if not np.array_equal(out[j].get().view(np.uint32), refs[j].get().view(np.uint32)):
                    print(f"MISMATCH {name} nx={nx} row {j}")
                    bad += 1
            t_x = timed(lambda: DK.gemv_bf16_xrows(w, X, out, groups=groups))
            t_1 = timed(lambda: [DK.gemv_bf16(w, xr[j], refs[j], groups=groups)
                                 for j in range(nx)])
            one = t_x if nx == 1 else one
            rel = f"{t_x / one:15.2f}" if one else f"{'':15s}"
            print(f"{name:<18s} {nx:3d} {t_x:10.2f} {100 * nbytes / (t_x * 1e-6) / bw:6.1f}% "
                  f"{t_1:14.2f} {rel}")
            table.append({"shape": name, "nx": nx, "xrows_us": t_x,
                          "of_copy_bw": nbytes / (t_x * 1e-6) / bw, "single_rows_us": t_1})
    if not a.no_write:
        import datetime
        from bench.harness import git_commit_short
        gpu = cp.cuda.runtime.getDeviceProperties(a.device)["name"].decode()
        commit = os.environ.get("MEMRA_DSV4_COMMIT", "").strip() or git_commit_short()
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        print("results:", *write(table, bw, gpu, commit, date, source="measured"))
    return 1 if bad else 0


def parse_table(text: str):
    """(rows, copy bandwidth B/s) of the table main prints."""
    import re
    bw = None
    m = re.search(r"copy bandwidth ([0-9.]+) TB/s", text)
    if m:
        bw = float(m.group(1)) * 1e12
    rows = []
    for line in text.splitlines():
        m = re.match(r"^(.+?)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)%\s+([0-9.]+)(?:\s+[0-9.]+)?\s*$", line)
        if m:
            rows.append({"shape": m.group(1).strip(), "nx": int(m.group(2)),
                         "xrows_us": float(m.group(3)), "of_copy_bw": float(m.group(4)) / 100,
                         "single_rows_us": float(m.group(5))})
    return rows, bw


def write(rows, bw, gpu: str, commit: str, date: str, source: str):
    """JSON + PNG of the table under bench/results/: per shape, the multi-row launch's time in
    units of its 1-row time against nx single-row launches' (the line y = nx)."""
    import json
    import re
    from pathlib import Path
    out = Path(__file__).resolve().parent.parent / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stem = out / f"{date}-{slug}-{commit[:7]}-xrows_gemv"
    doc = {"config": {"bench": "xrows_gemv_probe", "copy_bw_Bps": bw, "source": source},
           "meta": {"date": date, "gpu": gpu, "commit": commit[:7]}, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return stem.with_suffix(".json"), None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, sh in enumerate(shapes):
        rs = sorted((r for r in rows if r["shape"] == sh), key=lambda r: r["nx"])
        one = next((r["xrows_us"] for r in rs if r["nx"] == 1), None)
        if one is None:
            continue
        ax.plot([r["nx"] for r in rs], [r["xrows_us"] / one for r in rs], marker="o", label=sh)
    nxs = sorted({r["nx"] for r in rows})
    ax.plot(nxs, nxs, "k--", label="y = nx: every row at the cost of one")
    ax.set_xlabel("rows nx of one launch")
    ax.set_ylabel("time / the same kernel's 1-row time")
    ax.set_title(f"multi-row bf16 GEMV (decode.cu gemv_bf16_x*) \u00b7 {gpu} \u00b7 {date} \u00b7 "
                 f"{commit[:7]}\n{source.replace(str(out) + '/', '')}", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return stem.with_suffix(".json"), stem.with_suffix(".png")


if __name__ == "__main__":
    sys.exit(main())
