"""Pure arithmetic and layout of the phase report; no GPU, no global state.

Input: `timings`, phase name -> one GPU time in µs per bracket execution, in first-seen order.
Phase names are '/'-separated paths ("stage0/block3/attn/q"). A phase's *parent* is its
longest proper prefix path that is itself a recorded phase; a *root* has no recorded ancestor.
Unrecorded intermediate path components are allowed and simply skipped in the tree.

Per row:
- `calls`, `total_us`, `mean_us` = total / calls;
- `per_step_us` = total / steps, where `steps` is `step_count`, or when that is None the
  largest call count among the roots (exact when the step is wrapped in one root phase, or
  when every root runs once per step);
- `share` = total / (sum of the roots' totals): every row, nested or not, is a fraction of the
  whole top-level time, so a child's share reads directly as "fraction of the step";
- `plain_steps` = per_step_us / plain_us when plain_us > 0, else None. This is the unit in
  which a drafted arm's overhead is quoted: "the drafter costs 0.31 plain steps".

Rows come out in tree order (each parent followed by its subtree, siblings in first-seen
order); `depth` counts recorded ancestors and `label` is the name relative to the parent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    depth: int
    calls: int
    total_us: float
    mean_us: float
    per_step_us: float
    share: float
    plain_steps: float | None


def _parent(name: str, known: dict[str, list[float]]) -> str | None:
    parts = name.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = "/".join(parts[:cut])
        if prefix in known:
            return prefix
    return None


def build_report(
    timings: dict[str, list[float]], plain_us: float = 0.0, step_count: int | None = None
) -> list[Row]:
    if plain_us < 0:
        raise ValueError(f"plain_us must be >= 0 (0 means no plain-steps column), got {plain_us}")
    if step_count is not None and step_count <= 0:
        raise ValueError(f"step_count must be a positive number of steps, got {step_count}")
    timings = {name: times for name, times in timings.items() if times}
    if not timings:
        return []

    parent = {name: _parent(name, timings) for name in timings}
    children: dict[str | None, list[str]] = {}
    for name in timings:  # dict order = first-seen order, kept for siblings
        children.setdefault(parent[name], []).append(name)
    roots = children[None]

    total = {name: float(sum(times)) for name, times in timings.items()}
    top_total = sum(total[r] for r in roots)
    steps = step_count if step_count is not None else max(len(timings[r]) for r in roots)

    rows: list[Row] = []

    def visit(name: str, depth: int) -> None:
        up = parent[name]
        per_step = total[name] / steps
        rows.append(
            Row(
                name=name,
                label=name if up is None else name[len(up) + 1 :],
                depth=depth,
                calls=len(timings[name]),
                total_us=total[name],
                mean_us=total[name] / len(timings[name]),
                per_step_us=per_step,
                share=total[name] / top_total if top_total > 0 else 0.0,
                plain_steps=per_step / plain_us if plain_us > 0 else None,
            )
        )
        for child in children.get(name, ()):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return rows


_INDENT = "  "


def format_report(rows: list[Row]) -> str:
    """A fixed-width table, one line per row, nesting shown by indentation, plus a total line."""
    if not rows:
        return "(no phases recorded)\n"
    with_plain = any(r.plain_steps is not None for r in rows)
    headers = ["phase", "calls", "total us", "mean us", "us/step", "share"]
    if with_plain:
        headers.append("plain steps")

    def cells(r: Row) -> list[str]:
        c = [
            _INDENT * r.depth + r.label,
            f"{r.calls}",
            f"{r.total_us:.1f}",
            f"{r.mean_us:.2f}",
            f"{r.per_step_us:.2f}",
            f"{100.0 * r.share:.1f}%",
        ]
        if with_plain:
            c.append("" if r.plain_steps is None else f"{r.plain_steps:.3f}")
        return c

    roots = [r for r in rows if r.depth == 0]
    top = ["top level", "", f"{sum(r.total_us for r in roots):.1f}", "",
           f"{sum(r.per_step_us for r in roots):.2f}", f"{100.0 * sum(r.share for r in roots):.1f}%"]
    if with_plain:
        plain = [r.plain_steps for r in roots if r.plain_steps is not None]
        top.append(f"{sum(plain):.3f}")

    table = [headers] + [cells(r) for r in rows] + [top]
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]

    def fmt(line: list[str]) -> str:
        # Phase names read left-aligned; numbers right-aligned so digits line up.
        first = line[0].ljust(widths[0])
        rest = [cell.rjust(w) for cell, w in zip(line[1:], widths[1:])]
        return "  ".join([first] + rest).rstrip()

    rule = "-" * len(fmt(headers))
    return "\n".join([fmt(headers), rule, *(fmt(line) for line in table[1:-1]), rule, fmt(top)]) + "\n"
