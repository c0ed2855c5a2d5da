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


def arm_specs(command: str) -> list[str]:
    """Every --arms value a step's command gives bench.decode_step, with the shell variable F
    (F=...; before it) and a for-loop's quoted list (for A in "..." "..."; ... --arms $A)
    expanded, as the shell would."""
    out = []
    f = re.search(r"\bF=(\S+?);", command)
    for m in re.finditer(r"--arms ([^\s;]+)", command):
        spec = m.group(1)
        if spec == "$A":
            loop = re.search(r"for A in ((?:\"[^\"]*\"\s*)+);", command)
            assert loop, f"--arms $A without a for A in list: {command[:80]!r}"
            specs = re.findall(r"\"([^\"]*)\"", loop.group(1))
        else:
            specs = [spec]
        for s in specs:
            if f is not None:
                s = s.replace("$F", f.group(1))
            assert "$" not in s, f"unexpanded shell variable in --arms {s!r}"
            out.append(s)
    return out


@pytest.mark.parametrize("path", QUEUED, ids=[os.path.basename(p) for p in QUEUED])
def test_queued_batch_arms_pass_the_bench_check(path):
    """Each queued bench.decode_step's --arms passes the bench's own check (known settings,
    allowed values, no arm given twice), which the bench makes only on the GPU machine: the
    thirty-second session lost a warm machine's setup to a repeated arm."""
    from bench.decode_step import check_arms
    for _, name, cmd in steps(path):
        if "bench.decode_step" not in cmd:
            continue
        for spec in arm_specs(cmd):
            try:
                check_arms(spec)
            except SystemExit as e:
                raise AssertionError(f"{os.path.basename(path)} step {name}: --arms {spec}: {e}") from None


def test_arm_specs_expands_f_and_for_lists():
    cmd = ('F=path=device+feed=device; for A in "$F,$F+carve=driver" "$F+carve=driver,$F"; do '
           'python3 -m bench.decode_step --arms $A; done')
    assert arm_specs(cmd) == ["path=device+feed=device,path=device+feed=device+carve=driver",
                              "path=device+feed=device+carve=driver,path=device+feed=device"]
    assert arm_specs("python3 -m bench.decode_step --arms path=device,path=legacy") == ["path=device,path=legacy"]
    from bench.decode_step import check_arms
    with pytest.raises(SystemExit, match="given more than once"):
        check_arms(arm_specs("F=path=device; x --arms $F+carve=driver,$F,$F+carve=driver")[0])
