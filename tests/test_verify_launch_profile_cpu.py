"""tools/verify_launch_profile.py on the CPU: its argument refusals and the plot document it
draws from a report (bench.plot's schema: a wall-only step bar, one stacked bar per row count)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("vlp", os.path.join(ROOT, "tools", "verify_launch_profile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REPORT = {"model": "synthetic:flash", "ctx": 1024,
          "walls_ms": {"decode_step": 8.0, "verify t=2 pdl=on": 21.0, "verify t=2 pdl=off": 22.0,
                       "verify t=4 pdl=on": 28.0},
          "profiles": {"2": {"count": 3, "sum_ms": 0.6, "by_kernel": [
              {"kernel": "a", "total_us": 300.0}, {"kernel": "b", "total_us": 200.0},
              {"kernel": "c", "total_us": 100.0}]},
              "4": {"count": 1, "sum_ms": 0.5, "by_kernel": [{"kernel": "a", "total_us": 500.0}]}}}


def test_plot_doc():
    doc = _tool().plot_doc(REPORT, {"gpu": "G"}, top=2)
    assert list(doc["arms"]) == ["device step", "verify t=2 + commit(0)", "verify t=4 + commit(0)"]
    a2 = doc["arms"]["verify t=2 + commit(0)"]
    assert a2["phases_us"] == {"a": 300.0, "b": 200.0, "other kernels": 100.0}
    assert a2["summary"]["median"] == 21.0 and a2["summary"]["tok_s"] == pytest.approx(2e3 / 21.0)
    assert "phases_us" not in doc["arms"]["device step"] and doc["meta"] == {"gpu": "G"}


def test_png_from(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(REPORT))
    out = tmp_path / "r.png"
    assert _tool().main(["--png-from", str(src), "--png", str(out), "--meta", "G,2026-12-07,abc"]) == 0
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("argv,msg", [(["--t", "1,4"], "row counts in 2..8"), (["--t", "2,9"], "2..8"),
                                      (["--ctx", "100"], "multiple of 128"), (["--model", "x"], "synthetic"),
                                      (["--png-from", "x.json"], "needs --png")])
def test_refusals(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        _tool().main(argv)
