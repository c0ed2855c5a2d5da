"""Compile every kernels_cu/*.cu for sm_90a with nvcc and fail on spills, stack frames or
wgmma serialisation (ptxas C7514/C7515: "wgmma.mma_async instructions are serialized").

This is the CI half of "kernels are checked without a GPU": ptxas runs on the CPU machine, so
register pressure regressions (spill stores, local-memory stack frames) fail `make test` before
anyone rents an H200.  A kernel may opt out of the stack-frame check by listing its mangled or
plain name in ALLOW_STACK (none do today).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

ALLOW_STACK: set[str] = set()
_FUNC = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# ptxas C7514 / C7515 (and kin): it could not prove a wgmma pipeline safe and serialised every
# wgmma of the function (correct, but the tensor cores idle between instructions)
_WGMMA_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized.*in the function '([^']+)'")


def check_ptxas_log(log: str) -> list[str]:
    """Return one problem line per kernel that spills or uses a stack frame."""
    problems, current = [], "?"
    for line in log.splitlines():
        m = _WGMMA_SERIAL.search(line)
        if m:
            problems.append(f"{m.group(1)}: wgmma serialised by ptxas ({line.split('Potential')[0].split(':')[-1].strip()})")
            continue
        m = _FUNC.search(line)
        if m:
            current = m.group(1) or m.group(2)
            continue
        m = _STACK.search(line)
        if m:
            stack, spill_st, spill_ld = (int(x) for x in m.groups())
            if spill_st or spill_ld:
                problems.append(f"{current}: {spill_st} B spill stores, {spill_ld} B spill loads")
            elif stack and current not in ALLOW_STACK:
                problems.append(f"{current}: {stack} B stack frame")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--dir", default="kernels_cu")
    args = ap.parse_args()
    sources = sorted(glob.glob(os.path.join(args.dir, "*.cu")))
    if not sources:
        print(f"compile_kernels: no .cu files under {args.dir}")
        return 0
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            out = os.path.join(tmp, os.path.basename(src) + ".cubin")
            cmd = [args.nvcc, "-arch=sm_90a", "-std=c++17", "-cubin", "-O3", "-Xptxas", "-v",
                   "-I", args.dir, "-o", out, src]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            log = proc.stdout + proc.stderr
            if proc.returncode != 0:
                print(f"FAIL {src}: nvcc exit {proc.returncode}\n{log}")
                failed = True
                continue
            problems = check_ptxas_log(log)
            if problems:
                failed = True
                print(f"FAIL {src}:\n  " + "\n  ".join(problems))
            else:
                n = len(re.findall(r"Compiling entry function", log))
                print(f"ok   {src}: {n} kernels, no spills, no stack")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
