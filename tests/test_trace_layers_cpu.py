"""tools/trace_layers.py on a synthetic traced step: layers cut at every second hc boundary,
grouped by kind, launches named by kernel and occurrence, median times; and its CLI's refusal of a
result file without a trace."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import trace_layers as TL  # noqa: E402


def _L(kernel, go, end, dev=0):
    return {"device": dev, "kernel": kernel, "ctas": 1, "start_ns": go, "go_ns": go,
            "go_last_ns": go, "end_ns": end}


def _layer(t, csa):
    us = 1000
    out = [_L("hc.hc_boundary_pre", t, t + 8 * us), _L("decode.gemv_bf16_r2t2", t + 9 * us, t + 29 * us)]
    if csa:
        out.append(_L("indexer.indexer_fused_d128", t + 30 * us, t + 36 * us))
    out += [_L("decode.gemv_bf16_r2t2", t + 37 * us, t + 54 * us),
            _L("hc.hc_boundary_pre", t + 55 * us, t + 62 * us),
            _L("experts.gemv_mxfp4_gateup_k4_f", t + 63 * us, t + 87 * us)]
    return out


def test_layers_and_typical_rows():
    launches = []
    t = 0
    for i in range(5):
        launches += _layer(t, csa=i % 2 == 0)
        t += 100_000
    launches.append(_L("hc.hc_boundary_pre", t, t + 8000))   # the next layer opens: closes the 5th
    lays = TL.layers(launches, 0)
    assert len(lays) == 5 and all(l[0]["kernel"] == "hc.hc_boundary_pre" for l in lays)
    rows = TL.typical([l for l in lays if any("indexer" in L["kernel"] for L in l)])
    assert rows.pop("(layer)")["busy"] == [87.0] * 3
    assert rows["decode.gemv_bf16_r2t2#1"]["go"] == [37.0] * 3
    assert rows["decode.gemv_bf16_r2t2#0"]["busy"] == [20.0] * 3
    assert rows["indexer.indexer_fused_d128#0"]["after"] == [1.0] * 3


def test_cli(tmp_path, capsys):
    launches = []
    for i in range(3):
        launches += _layer(i * 100_000, csa=False)
    launches.append(_L("hc.hc_boundary_pre", 300_000, 308_000))
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"arms": {"path=device": {"device_trace": {"median_step_launches": launches}}}}))
    png = tmp_path / "layer.png"
    assert TL.main([str(f), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "HCA / window layers (3)" in out and "experts.gemv_mxfp4_gateup_k4_f#0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    assert TL.family("experts.gemv_mxfp4_gateup_k4_f") == "FP4 experts"
    assert TL.family("decode.build_cand") == "indexer / compressor" and TL.family("x.y") == "other"
    g = tmp_path / "plain.json"
    g.write_text(json.dumps({"arms": {"path=device": {}}}))
    assert TL.main([str(g)]) == 2
    assert "no arm with a device_trace" in capsys.readouterr().err
