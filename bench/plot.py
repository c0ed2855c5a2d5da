"""Draw a results document (bench/harness.py's JSON schema) as a stacked bar chart per arm.

Each arm is one bar: its `phases_us` stacked in ms (one color per phase, the same across arms),
topped by a hatched "unattributed" segment up to the median step time when the phases do not
cover it, a p10-p90 whisker on the median, and a dashed line at `floor_ms` when the arm has one.
The title names GPU, date and commit from the document's `meta`.

Uses matplotlib's object API on an Agg canvas, so it never touches pyplot's global backend.
`python -m bench.plot RESULTS.json [OUT.png]` redraws a PNG from a JSON written elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def plot_results(doc: dict, png_path: Path | str) -> Path:
    arms: dict = doc.get("arms", {})
    meta = doc.get("meta", {})
    phases: list[str] = []
    for arm in arms.values():
        phases += [p for p in arm.get("phases_us", {}) if p not in phases]

    fig = Figure(figsize=(max(6.0, 1.6 * len(arms) + 4.0), 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tab20 = colormaps["tab20"]
    # tab20 alternates dark/light shades of one hue; take the ten darks first so neighbours differ.
    colors = [tab20((2 * i) % 20 + (i // 10) % 2) for i in range(len(phases))]

    names = list(arms)
    for x, name in enumerate(names):
        arm = arms[name]
        bottom = 0.0
        for phase, color in zip(phases, colors):
            ms = arm.get("phases_us", {}).get(phase, 0.0) / 1e3
            ax.bar(x, ms, bottom=bottom, color=color, label=phase if x == 0 else None)
            bottom += ms
        summary = arm.get("summary")
        if summary:
            median = summary["median"]
            if median > bottom:
                ax.bar(x, median - bottom, bottom=bottom, color="none", edgecolor="0.5", hatch="//",
                       label="unattributed" if "unattributed" not in _labels(ax) else None)
            ax.errorbar(x, median, yerr=[[median - summary["p10"]], [summary["p90"] - median]],
                        fmt="_", color="black", capsize=4)
            ax.annotate(f"{median:.3f} ms\n{summary['tok_s']:.0f} tok/s", (x, max(summary["p90"], bottom)),
                        xytext=(0, 6), textcoords="offset points", ha="center", va="bottom", fontsize=8)
        if "floor_ms" in arm:
            ax.hlines(arm["floor_ms"], x - 0.4, x + 0.4, colors="red", linestyles="--",
                      label="bandwidth floor" if "bandwidth floor" not in _labels(ax) else None)

    crowded = len(names) > 3  # long arm labels overlap unless tilted
    ax.set_xticks(range(len(names)), names, rotation=15 if crowded else 0, ha="right" if crowded else "center")
    ax.set_ylabel("ms per step (phases: GPU time)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the annotations
    title = " · ".join(str(meta[k]) for k in ("gpu", "date", "commit") if k in meta)
    config = doc.get("config", {})
    if config:
        title += "\n" + "  ".join(f"{k}={v}" for k, v in config.items())
    ax.set_title(title or "bench", fontsize=10)
    if _labels(ax):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)

    png_path = Path(png_path)
    fig.savefig(png_path, dpi=120)
    return png_path


def _labels(ax) -> list[str]:
    return ax.get_legend_handles_labels()[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) not in (1, 2):
        print("usage: python -m bench.plot RESULTS.json [OUT.png]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    out = plot_results(json.loads(src.read_text()), argv[1] if len(argv) == 2 else src.with_suffix(".png"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
