"""Delay probe: which kernels set the length of a graph-replayed decode step.

A timeline (profiling.device_trace) draws when each launch ran, not which launches the step's
length depends on: under PDL the next GEMV's CTAs preload while a latency-bound launch runs,
graph branches overlap, and earlier sessions saw launches shortened on the drawn chain while the
step did not move.  This probe asks the step itself.  In the trace build (MEMRA_DSV4_DEVICE_TRACE
=on) one kernel at a time is made to wait: every launch of it is held ``delay_ns`` from the first
wait return of its CTAs (common.cuh memra_trace_delay / memra_trace_deadline,
device_trace.set_delay; every CTA resident before that deadline waits for it, after its
launch_dependents, so the successor's pre-wait loads run as usual; a later wave does not wait
again), and the step is timed against the undelayed step measured right before and after it:

    delta  = step time with the delay - the mean of the two neighbouring baseline blocks
    slope  = delta / (launches of the kernel per step x delay)

A slope near 1: every launch of that kernel is on the step's critical path, so shortening it
shortens the step (up to the slack of the next path).  Near 0: it is hidden (overlapped, or
waiting on something else), and shortening it buys nothing.  In between: some of its launches
are critical, or it has less slack than the delay.  The probe adds time only; a kernel made
faster can gain less than its slope says when another path is nearly critical.

Schedule: ``rounds`` rounds; each round is B t1 B t2 ... B tn B (B = baseline block), the target
order rotated by one per round, so slow drift (clocks, temperature) cancels in the neighbour
mean.  Every block first rewinds the decode state to the same position (``rewind``), runs one
untimed step (it absorbs the delay write's synchronisation), then ``steps_per_block`` timed steps:
every block replays the same positions, so the context does not drift either.  The rewound
state's caches are rewritten at positions they already hold: the values are not a decode anymore
(run the probe after everything that reads the state), the work per step is the step's.

CPU side (schedule, analysis, formatting) is tested without a GPU: tests/test_delay_probe_cpu.py;
the device side in tests/gpu/test_device_trace_gpu.py.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

__all__ = ["schedule", "analyze", "run", "format_rows"]


def schedule(n_targets: int, rounds: int) -> list[int | None]:
    """The block order: per round B t B t ... B (None = baseline), targets rotated by the round."""
    if n_targets < 1 or rounds < 1:
        raise ValueError(f"delay_probe.schedule: need n_targets >= 1 and rounds >= 1, "
                         f"got {n_targets}, {rounds}")
    out: list[int | None] = []
    for r in range(rounds):
        for j in range(n_targets):
            out += [None, (j + r) % n_targets]
        out.append(None)
    return out


def analyze(blocks: Sequence[tuple[int | None, Sequence[float]]], sites: Sequence[dict],
            delay_ns: int) -> dict:
    """blocks: (target index | None, per-step ms samples) in run order, as schedule() laid them
    out (every target block between two baseline blocks).  Returns {"baseline_ms", "noise_us",
    "rows"}: per site its deltas (us per step, one per round), their median, and the slope.
    noise_us: the median absolute difference of consecutive baseline blocks (what a delta of a
    hidden kernel scatters by)."""
    if delay_ns <= 0:
        raise ValueError(f"delay_probe.analyze: delay_ns = {delay_ns} must be > 0")
    med = [statistics.median(s) for _, s in blocks]
    base = [m for (t, _), m in zip(blocks, med) if t is None]
    if len(base) < 2:
        raise ValueError("delay_probe.analyze: fewer than two baseline blocks")
    deltas: dict[int, list[float]] = {}
    for i, (t, _) in enumerate(blocks):
        if t is None:
            continue
        if not (0 < i < len(blocks) - 1 and blocks[i - 1][0] is None and blocks[i + 1][0] is None):
            raise ValueError(f"delay_probe.analyze: target block {i} is not between two baselines")
        ref = 0.5 * (med[i - 1] + med[i + 1])
        deltas.setdefault(t, []).append(1e3 * (med[i] - ref))
    rows = []
    for t, site in enumerate(sites):
        ds = deltas.get(t, [])
        d = statistics.median(ds) if ds else float("nan")
        n = int(site.get("launches", 0))
        rows.append({**site, "deltas_us": ds, "delta_us": d,
                     "slope": d * 1e3 / (n * delay_ns) if n else float("nan")})
    rows.sort(key=lambda r: -r["delta_us"] if r["delta_us"] == r["delta_us"] else 0.0)
    diffs = [abs(b - a) * 1e3 for a, b in zip(base, base[1:])]
    return {"baseline_ms": statistics.median(base), "noise_us": statistics.median(diffs),
            "delay_ns": int(delay_ns), "rows": rows}


def run(step: Callable[[], None], rewind: Callable[[], None], timer: Callable, sites: Sequence[dict],
        set_delay: Callable[[object, int], None], delay_ns: int, *, rounds: int = 4,
        steps_per_block: int = 8, progress: Callable[[str], None] | None = None) -> dict:
    """Run the schedule: ``step()`` one graph-replayed decode step, ``rewind()`` the state back
    to the probe's start position, ``timer(fn)`` ms of fn on the device (bench.harness
    CudaEventTimer), ``set_delay((stem, line) | None, ns)`` (device_trace.set_delay bound to the
    devices).  Leaves no kernel delayed, on success and on error."""
    if steps_per_block < 1:
        raise ValueError(f"delay_probe.run: steps_per_block = {steps_per_block} must be >= 1")
    order = schedule(len(sites), rounds)
    blocks: list[tuple[int | None, list[float]]] = []
    try:
        for i, t in enumerate(order):
            set_delay(None if t is None else (sites[t]["stem"], sites[t]["line"]),
                      0 if t is None else delay_ns)
            rewind()
            step()
            blocks.append((t, [float(timer(step)) for _ in range(steps_per_block)]))
            if progress is not None and (i + 1) % 20 == 0:
                progress(f"delay probe: {i + 1} / {len(order)} blocks")
    finally:
        set_delay(None, 0)
    out = analyze(blocks, sites, delay_ns)
    out.update(rounds=rounds, steps_per_block=steps_per_block)
    return out


def format_rows(res: dict, top: int = 40) -> str:
    lines = [f"delay probe: each kernel waits {res['delay_ns'] / 1e3:.1f} us per launch after its "
             f"PDL wait; baseline {res['baseline_ms']:.3f} ms/step, baseline-to-baseline noise "
             f"{res['noise_us']:.1f} us ({res.get('rounds', '?')} rounds x "
             f"{res.get('steps_per_block', '?')} steps)",
             f"  {'kernel':52s} {'n/step':>6s} {'delta us':>9s} {'slope':>6s}  per round"]
    for r in res["rows"][:top]:
        per = " ".join(f"{d:.0f}" for d in r["deltas_us"])
        lines.append(f"  {r['kernel']:52s} {r['launches']:6d} {r['delta_us']:9.1f} "
                     f"{r['slope']:6.2f}  {per}")
    lines.append("slope = delta / (launches x delay): ~1 every launch on the critical path, ~0 hidden")
    return "\n".join(lines)
