"""CPU checks of kernels_cu/ and the op wrappers (no GPU needed).

* Every wrapper module in memra_dsv4.gpu.ops imports without CuPy and names kernels that exist
  in its .cu file (a typo in a kernel name fails here, not on the H200).
* Every .cu compiles with nvcc for sm_90a; ptxas reports no spills and no local-memory stack
  frame for any kernel (the rule of tools/compile_kernels.py), and the compiled entry points are
  exactly the extern "C" kernels the sources declare.  Skipped when nvcc is absent.
* Optionally (when libnvrtc is found: MEMRA_DSV4_NVRTC_LIB or the nvidia-cuda-nvrtc wheel), the
  same sources compile with NVRTC and the runtime loader's options, the path the GPU takes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "kernels_cu")
SOURCES = sorted(glob.glob(os.path.join(KDIR, "*.cu")))

_EXTERN = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)[\s\\]+)?(\w+)\s*\(')
_MACRO_DEF = re.compile(r"^#define\s+(\w+)\(NAME\b", re.M)


def declared_kernels(path: str) -> set[str]:
    """extern "C" kernels of a .cu: plain definitions plus instances of NAME-first macros."""
    src = open(path, encoding="utf-8").read()
    names = {n for n in _EXTERN.findall(src) if n not in ("NAME", "__launch_bounds__")}
    for macro in _MACRO_DEF.findall(src):
        names |= set(re.findall(rf"^{macro}\((\w+)\s*,", src, re.M))
    return names


def _nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _compile_kernels_tool():
    spec = importlib.util.spec_from_file_location("compile_kernels", os.path.join(ROOT, "tools", "compile_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sources_exist():
    stems = {os.path.basename(p)[:-3] for p in SOURCES}
    from memra_dsv4.gpu.ops import FAMILIES

    assert set(FAMILIES) <= stems, f"missing kernels_cu sources: {sorted(set(FAMILIES) - stems)}"
    assert os.path.isfile(os.path.join(KDIR, "common.cuh"))


def test_wrappers_import_without_cupy_and_name_existing_kernels():
    from memra_dsv4.gpu import kernel_loader
    from memra_dsv4.gpu.ops import FAMILIES, kernel_names

    had_cupy = "cupy" in sys.modules
    names = kernel_names()
    if not had_cupy:
        assert "cupy" not in sys.modules, "importing memra_dsv4.gpu.ops imported CuPy"
    assert set(names) == set(FAMILIES)
    problems = []
    for stem, kernels in names.items():
        declared = declared_kernels(os.path.join(KDIR, f"{stem}.cu"))
        missing = sorted(set(kernels) - declared)
        if missing:
            problems.append(f"{stem}.cu lacks {missing} (declares {sorted(declared)})")
        assert len(set(kernels)) == len(kernels), f"{stem}: duplicate kernel names"
        reg = kernel_loader.registered().get(stem, ())
        assert set(kernels) <= set(reg), f"{stem}: wrapper kernels not registered with the loader"
    assert not problems, "\n".join(problems)


def test_every_declared_kernel_has_a_wrapper():
    from memra_dsv4.gpu.ops import kernel_names

    names = kernel_names()
    for stem, kernels in names.items():
        unused = declared_kernels(os.path.join(KDIR, f"{stem}.cu")) - set(kernels)
        assert not unused, f"{stem}.cu declares kernels no wrapper launches: {sorted(unused)}"


def _nvcc_one(nvcc: str, src: str, tmp: str) -> tuple[str, int, str]:
    out = os.path.join(tmp, os.path.basename(src) + ".cubin")
    cmd = [nvcc, "-arch=sm_90a", "-std=c++17", "-cubin", "-O3", "-Xptxas", "-v", "-I", KDIR, "-o", out, src]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, proc.returncode, proc.stdout + proc.stderr


def test_nvcc_sm90a_no_spills_no_stack(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or put it on PATH)")
    tool = _compile_kernels_tool()
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        results = list(ex.map(lambda s: _nvcc_one(nvcc, s, str(tmp_path)), SOURCES))
    for src, rc, log in results:
        name = os.path.basename(src)
        if rc != 0:
            failures.append(f"{name}: nvcc exit {rc}\n{log}")
            continue
        problems = tool.check_ptxas_log(log)
        if problems:
            failures.append(f"{name}: " + "; ".join(problems))
        entries = set(re.findall(r"Compiling entry function '([^']+)'", log))
        declared = declared_kernels(src)
        if entries != declared:
            failures.append(f"{name}: compiled entries {sorted(entries)} != declared {sorted(declared)}")
    assert not failures, "\n".join(failures)


def _find_nvrtc():
    cand = [os.environ.get("MEMRA_DSV4_NVRTC_LIB")]
    for p in sys.path:
        cand += glob.glob(os.path.join(p, "nvidia", "cu13", "lib", "libnvrtc.so.13"))
        cand += glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"))
    cand += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    for c in cand:
        if c and os.path.isfile(c):
            try:
                return ctypes.CDLL(c)
            except OSError:
                continue
    return None


def test_nvrtc_compiles_with_runtime_options():
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (MEMRA_DSV4_NVRTC_LIB / nvidia-cuda-nvrtc wheel)")
    from memra_dsv4.gpu.kernel_loader import nvrtc_options

    opts = [o.encode() for o in nvrtc_options(KDIR)] + [b"-ftz=true", b"--device-as-default-execution-space"]
    failures = []
    for src in SOURCES:
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(),
                                      os.path.basename(src).encode(), 0, None, None) == 0
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(max(1, n.value))
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        if rc != 0:
            text = log.value.decode(errors="replace")
            if "libnvrtc-builtins" in text:
                pytest.skip(f"libnvrtc found but its builtins library is not loadable: {text.strip()}")
            failures.append(f"{os.path.basename(src)}: NVRTC error {rc}\n{text}")
    assert not failures, "\n".join(failures)


def test_declared_kernel_parser_sees_macro_instances():
    names = declared_kernels(os.path.join(KDIR, "attention.cu"))
    assert "sparse_attn_d512_hg16" in names and "sparse_attn_combine_d512" in names
    assert importlib.import_module("memra_dsv4.gpu.ops.attention").STEM == "attention"
