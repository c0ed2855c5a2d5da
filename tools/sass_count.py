"""Static SASS instruction counts of the fused FP4 expert GEMVs' main loops, per weight, on a CPU.

    python tools/sass_count.py [--kernel NAME ...] [-D NAME=VALUE ...] [--hist] [--cubin FILE]
                               [--full]

Compiles kernels_cu/experts.cu as the runtime does (nvcc -arch=sm_90a -std=c++17 -ftz=true, the
NVRTC options' numerics: CuPy adds -ftz=true to every NVRTC compile), with -Xptxas -v for the
registers / spills / stack frame of every kernel, disassembles it (nvdisasm -c) and prints, per
kernel:

* regs, spill bytes, stack bytes (ptxas);
* the main loop: the backward branch whose [target, branch] range holds the most FFMA (the
  decode-and-FMA loop; nested backward branches inside it are counted as part of it);
* weights per trip from that loop's FFMA count: each weight is one FFMA of the element-order
  chain, and each (row, 32-element chunk) adds its block-scale folds (MXFP4 1, NVFP4 2), so
  weights = FFMA * 32 / (32 + folds), rounded to a multiple of 32 (an epilogue adds a few FFMA,
  e.g. gate/up's SwiGLU 2; more than 4 off is flagged "?"); FFMA with a zero multiplicand
  (RZ: FP4_E8M0_FMA's scale fma(s, 0, s)) are not counted as weights (they are in the loop count);
* instructions per weight and lane of that loop (static: every instruction of the loop range once,
  including epilogue blocks that run only once per 32 rows, so it overstates a little);
* --hist: the loop's class histogram (opcode without modifiers), most frequent first.

Static counts only (no GPU): what Nsight Compute calls issued instructions also includes the
prologue (x staging, the ring fill, down_combine's pick ranking) and the taken fraction of every
branch.  --full adds the whole kernel's static instruction count.

By default it reports the Flash-shape kernels of the decode step: gemv_{mx,nv}fp4_gateup_k4 and
gemv_{mx,nv}fp4_down_combine_k2, plus their full-shape fast paths (*_f) when the build has them.
--trim compiles only the part of experts.cu before the tensor-core section (the CUDA-core FP4
kernels; ~4x faster; the SASS of those kernels is the same as in the full file).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # run as a script from a checkout: the package beside it
from memra_dsv4.cuda_tools import require_nvdisasm  # noqa: E402

SRC = os.path.join(REPO, "kernels_cu", "experts.cu")
DEFAULT_KERNELS = ("gemv_mxfp4_gateup_k4", "gemv_mxfp4_gateup_k4_f", "gemv_nvfp4_gateup_k4",
                   "gemv_nvfp4_gateup_k4_f", "gemv_mxfp4_down_combine_k2", "gemv_mxfp4_down_combine_k2_f",
                   "gemv_nvfp4_down_combine_k2", "gemv_nvfp4_down_combine_k2_f")
TRIM_MARK = "// ==================================================================== tensor-core FP4 GEMVs"

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_FUNC_PTX = re.compile(r"Compiling entry function '([^']+)'|Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_ZERO_MUL = re.compile(r"FFMA[A-Z0-9_.]*\s+[^,]+,\s*(?:RZ\s*,|[^,]+,\s*RZ\s*,)")


def compile_cubin(defines: dict, out: str, trim: bool = False, nvcc: str = "nvcc") -> str:
    """experts.cu (optionally trimmed) -> cubin at out; returns the ptxas -v log."""
    src = SRC
    if trim:
        with open(SRC, encoding="utf-8") as fh:
            text = fh.read()
        cut = text.index(TRIM_MARK)
        src = os.path.join(os.path.dirname(out), "experts_trim.cu")
        with open(src, "w", encoding="utf-8") as fh:
            fh.write(text[:cut])
    cmd = [nvcc, "-arch=sm_90a", "-std=c++17", "-ftz=true", "-cubin", "-O3", "-Xptxas", "-v",
           "-I", os.path.join(REPO, "kernels_cu"), "-o", out, src] + [f"-D{k}={v}" for k, v in defines.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"nvcc failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def ptxas_info(log: str) -> dict:
    """kernel -> dict(regs, spill, stack) from a -Xptxas -v log."""
    info, cur = {}, None
    for line in log.splitlines():
        m = _FUNC_PTX.search(line)
        if m:
            cur = m.group(1) or m.group(2)
            info.setdefault(cur, {})
            continue
        m = _STACK.search(line)
        if m and cur:
            info[cur].update(stack=int(m.group(1)), spill=int(m.group(2)) + int(m.group(3)))
        m = _REGS.search(line)
        if m and cur:
            info[cur]["regs"] = int(m.group(1))
    return info


def disassemble(cubin: str) -> dict:
    """kernel -> list of (addr, opcode, full text) and its label -> addr map."""
    text = subprocess.run([require_nvdisasm(), "-c", cubin], capture_output=True, text=True, check=True).stdout
    funcs, cur, pending = {}, None, []
    for line in text.splitlines():
        if line.startswith(".text."):
            cur = line[len(".text."):].rstrip(":")
            funcs[cur] = {"insns": [], "labels": {}}
            pending = []
            continue
        if cur is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                funcs[cur]["labels"][lab] = addr
            pending = []
            funcs[cur]["insns"].append((addr, m.group(3), line.strip()))
    return funcs


def main_loop(f: dict):
    """(start, end) addresses of the backward branch range with the most FFMA (the shortest of
    those: the divergent-shuffle fallbacks at the end of a function branch back into the loop
    from far below, and their ranges hold the same FFMA), or None."""
    insns, labels = f["insns"], f["labels"]
    best, best_n = None, -1
    for addr, op, text in insns:
        if not op.startswith("BRA"):
            continue
        m = _TARGET.search(text)
        if not m or m.group(1) not in labels:
            continue
        tgt = labels[m.group(1)]
        if tgt > addr:
            continue
        n = sum(1 for a, o, _ in insns if tgt <= a <= addr and o.split(".")[0] == "FFMA")
        if n > best_n or (n == best_n and addr - tgt < best[1] - best[0]):
            best, best_n = (tgt, addr), n
    return best


def loop_stats(name: str, f: dict) -> dict:
    rng = main_loop(f)
    if rng is None:
        return {}
    body = [(a, o, t) for a, o, t in f["insns"] if rng[0] <= a <= rng[1]]
    hist = collections.Counter(o.split(".")[0] for _, o, _ in body)
    folds = 2 if "nvfp4" in name else 1
    # an FFMA with a zero multiplicand (x * 0 + y: FP4_E8M0_FMA's scale fma(s, 0, s)) is no weight
    ffma = hist.get("FFMA", 0) - sum(1 for _, o, t in body if o.split(".")[0] == "FFMA" and _ZERO_MUL.search(t))
    exact = ffma * 32 / (32 + folds)
    weights = 32 * round(exact / 32)   # a few FFMA of an epilogue (SwiGLU) may sit in the loop
    return dict(n=len(body), ffma=ffma, weights=weights, ok=abs(exact - weights) <= 4,
                per_w=len(body) / weights if weights else float("nan"), hist=hist, total=len(f["insns"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="append", default=None, help="kernel name (repeatable)")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--hist", action="store_true", help="print the loop's class histogram")
    ap.add_argument("--full", action="store_true", help="also the whole kernel's static count")
    ap.add_argument("--trim", action="store_true", help="compile only the CUDA-core part of experts.cu")
    ap.add_argument("--cubin", default=None, help="keep (or reuse, if it exists) the cubin here")
    ap.add_argument("--nvcc", default="nvcc")
    a = ap.parse_args(argv)
    defines = dict(d.split("=", 1) for d in a.defines)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = a.cubin or os.path.join(tmp, "experts.cubin")
        info = {}
        if not (a.cubin and os.path.exists(a.cubin)):
            info = ptxas_info(compile_cubin(defines, cubin, a.trim, a.nvcc))
        funcs = disassemble(cubin)
    names = a.kernel or [k for k in DEFAULT_KERNELS if k in funcs]
    print(f"{'kernel':<34s} {'regs':>4s} {'spill':>5s} {'stack':>5s} {'loop':>6s} {'weights':>7s} {'per w':>6s}"
          + ("  total" if a.full else ""))
    for name in names:
        if name not in funcs:
            print(f"{name:<34s} (not in the build)")
            continue
        pi = info.get(name, {})
        st = loop_stats(name, funcs[name])
        w = f"{st['weights']:.0f}" + ("" if st["ok"] else "?")
        print(f"{name:<34s} {pi.get('regs', '-'):>4} {pi.get('spill', '-'):>5} {pi.get('stack', '-'):>5} "
              f"{st['n']:>6d} {w:>7s} {st['per_w']:>6.3f}" + (f"  {st['total']}" if a.full else ""))
        if a.hist:
            print("    " + " ".join(f"{k} {v}" for k, v in st["hist"].most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
