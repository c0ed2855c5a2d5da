"""The typical layer of a traced decode step (bench.decode_step --device-trace JSON).

    python tools/trace_layers.py bench/results/<file>.json [--arm NAME] [--device 0] [--png OUT]

The median step's launches (profiling.device_trace) are cut into layers at every second
hc.hc_boundary_pre (the attention boundary opens a layer; the ffn boundary is the second), the
layers grouped by kind (CSA: an indexer launch inside; else HCA / window), and every launch named
by its kernel and its occurrence in the layer ("decode.gemv_bf16_r2t2#1").  Per kind it prints
each name's median wait return (go) and exit relative to the layer's first wait return, its
median busy time (go .. last CTA exit) and how long after the previous launch's exit (in go
order) it started: a launch that starts long after its predecessor ended waited for SM room or
for another branch.  Times in us.  ``--png OUT`` also draws each arm's typical CSA and HCA layers
as bars from median wait return to median exit, one row per launch, coloured by kernel family
(title: GPU, date and commit from the results document).
"""
from __future__ import annotations

import argparse
import json
import statistics as st
import sys


def layers(launches, device: int):
    ls = sorted((L for L in launches if L["device"] == device), key=lambda L: L["go_ns"])
    cut = [i for i, L in enumerate(ls) if L["kernel"].endswith("hc_boundary_pre")][0::2]
    return [ls[a:b] for a, b in zip(cut, cut[1:])]


def typical(layer_list):
    rows: dict[str, dict[str, list[float]]] = {}
    for lay in layer_list:
        t0 = lay[0]["go_ns"]
        seen: dict[str, int] = {}
        prev_end = None
        for L in lay:
            k = L["kernel"]
            n = seen.get(k, 0)
            seen[k] = n + 1
            r = rows.setdefault(f"{k}#{n}", {"go": [], "end": [], "busy": [], "after": []})
            r["go"].append((L["go_ns"] - t0) / 1e3)
            r["end"].append((L["end_ns"] - t0) / 1e3)
            r["busy"].append((L["end_ns"] - L["go_ns"]) / 1e3)
            if prev_end is not None:
                r["after"].append((L["go_ns"] - prev_end) / 1e3)
            prev_end = max(prev_end or 0, L["end_ns"])
        r = rows.setdefault("(layer)", {"go": [], "end": [], "busy": [], "after": []})
        r["busy"].append((lay[-1]["end_ns"] - t0) / 1e3)
    return rows


FAMILIES = (("dense GEMV", ("decode.gemv",)), ("FP4 experts", ("experts.",)),
            ("hc boundary", ("hc.",)), ("attention", ("attention.",)),
            ("indexer / compressor", ("indexer.", "compressor.", "quant_sim.", "decode.build_cand")),
            ("router", ("router.",)), ("norms", ("rmsnorm.",)))


def family(name: str) -> str:
    for fam, prefixes in FAMILIES:
        if name.startswith(prefixes):
            return fam
    return "other"


def draw(panels, title: str, png: str) -> str:
    """panels: [(label, rows)] with rows as typical() returns them (the "(layer)" row removed)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fams = [f for f, _ in FAMILIES] + ["other"]
    cmap = colormaps["tab10"]
    colors = {f: cmap(i) for i, f in enumerate(fams)}
    height = max(len(r) for _, r in panels)
    fig = Figure(figsize=(11.0, 0.9 + 0.24 * height * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (label, rows) in zip(axes, panels):
        items = sorted(rows.items(), key=lambda kv: st.median(kv[1]["go"]))
        for y, (k, r) in enumerate(items):
            go, end = st.median(r["go"]), st.median(r["end"])
            ax.barh(y, end - go, left=go, color=colors[family(k)], height=0.7)
        ax.set_yticks(range(len(items)), [k for k, _ in items], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("us from the layer's first wait return (medians over the layers)")
        ax.set_title(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch
    handles = [Patch(color=colors[f], label=f) for f in fams]
    axes[0].legend(handles=handles, fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.savefig(png, dpi=110)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--arm", default=None, help="arm name (default: every arm with a trace)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--png", default=None, metavar="OUT", help="also draw the typical layers")
    a = ap.parse_args(argv)
    with open(a.json) as fh:
        data = json.load(fh)
    arms = [(n, v) for n, v in data["arms"].items() if "device_trace" in v and (a.arm in (None, n))]
    if not arms:
        print(f"{a.json}: no arm with a device_trace" + (f" named {a.arm}" if a.arm else ""),
              file=sys.stderr)
        return 2
    panels = []
    for name, arm in arms:
        lays = layers(arm["device_trace"]["median_step_launches"], a.device)
        kinds = {"CSA": [l for l in lays if any("indexer" in L["kernel"] for L in l)],
                 "HCA / window": [l for l in lays if not any("indexer" in L["kernel"] for L in l)]}
        for kind, group in kinds.items():
            if not group:
                continue
            rows = typical(group)
            span = st.median(rows.pop("(layer)")["busy"])
            keep = {k: r for k, r in rows.items() if len(r["go"]) >= len(group) // 2}
            panels.append((f"{name}, device {a.device}: {kind} layer ({len(group)} layers, "
                           f"{span:.1f} us)", keep))
            print(f"{name}, device {a.device}, {kind} layers ({len(group)}): median first go .. "
                  f"last exit {span:.1f} us")
            print(f"  {'launch':48s} {'go':>7s} {'exit':>7s} {'busy':>6s} {'after prev exit':>15s}")
            for k, r in sorted(rows.items(), key=lambda kv: st.median(kv[1]["go"])):
                if len(r["go"]) < len(group) // 2:
                    continue   # launches most layers of the kind do not have
                after = f"{st.median(r['after']):15.1f}" if r["after"] else f"{'':15s}"
                print(f"  {k:48s} {st.median(r['go']):7.1f} {st.median(r['end']):7.1f} "
                      f"{st.median(r['busy']):6.1f} {after}")
    if a.png:
        meta = data.get("meta", {})
        title = (f"typical decode layer (device trace): {meta.get('gpu', '?')}, "
                 f"{meta.get('date', '?')}, commit {meta.get('commit', '?')}")
        print(f"wrote {draw(panels, title, a.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
