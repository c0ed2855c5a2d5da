"""The batches queued for a coming session fit one device call: the next session's first call
(the newest tools/batches/next_s<N>.txt; the older ones are records of calls that ran) and the
2x H200 measurement (next_x2*.txt), still waiting for its machine.  Every
step line is ``SECONDS NAME COMMAND`` (tools/gpu_check.sh batch), names are unique (each step's
log is NAME.log: a repeated name overwrites the first one's), and the steps' boxes add up to at
most BATCH_BOX_S, the device tool's 600 s per command less what gpu_check.sh spends before the
first step (the wheel install and env.log, ~10-20 s).  A batch whose boxes overrun the call is
cut by the device tool mid-step and its later steps never run (next_x2.txt held 690 s of boxes
until the thirty-first session split it)."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_BOX_S = 570


def _queued() -> list[str]:
    d = os.path.join(ROOT, "tools", "batches")
    by_n = {int(m.group(1)): p for p in glob.glob(os.path.join(d, "next_s*.txt"))
            if (m := re.fullmatch(r"next_s(\d+)\.txt", os.path.basename(p)))}
    newest = [by_n[max(by_n)]] if by_n else []
    return newest + sorted(glob.glob(os.path.join(d, "next_x2*.txt")))


QUEUED = _queued()


def steps(path: str) -> list[tuple[int, str, str]]:
    """(seconds, name, command) of each step line; '#' and blank lines skipped, as gpu_check.sh."""
    out = []
    for n, line in enumerate(open(path, encoding="utf-8").read().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(\d+) ([A-Za-z0-9_.-]+) (\S.*)$", line)
        assert m, f"{os.path.basename(path)}:{n}: not 'SECONDS NAME COMMAND': {line[:80]!r}"
        out.append((int(m.group(1)), m.group(2), m.group(3)))
    return out


def test_there_are_queued_batches():
    names = [os.path.basename(p) for p in QUEUED]
    assert "next_x2.txt" in names, names   # #7's own measurement stays queued until it runs
    assert re.fullmatch(r"next_s\d+\.txt", names[0]), names


@pytest.mark.parametrize("path", QUEUED, ids=[os.path.basename(p) for p in QUEUED])
def test_queued_batch_fits_one_call(path):
    st = steps(path)
    assert st, f"{os.path.basename(path)}: no step lines"
    names = [n for _, n, _ in st]
    assert len(set(names)) == len(names), f"{os.path.basename(path)}: repeated step names {names}"
    total = sum(s for s, _, _ in st)
    assert total <= BATCH_BOX_S, (f"{os.path.basename(path)}: the steps' boxes add up to {total} s, "
                                  f"more than one device call's {BATCH_BOX_S} s")


def test_steps_parser_refuses_a_malformed_line(tmp_path):
    bad = tmp_path / "next_bad.txt"
    bad.write_text("# comment\n60 warm python3 x.py\nwarm python3 y.py\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="next_bad.txt:3: not 'SECONDS NAME COMMAND'"):
        steps(str(bad))
