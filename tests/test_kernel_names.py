"""Every registered kernel name is resolvable by NVRTC's name-expression lookup.

CuPy's RawModule(name_expressions=...) asks NVRTC for each name's lowered symbol, and NVRTC
resolves the expression in the whole translation unit: a kernel that shares its name with a
device function of common.cuh (an overload) compiles with nvcc but fails to load
("cannot determine which instance of overloaded function"), only on the GPU machine.  So,
on the CPU: no registered name is also a function name of a header the .cu includes, and each
name is defined exactly once (one extern "C" __global__) in its own file.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "kernels_cu")
_FUNC = re.compile(r"^\s*(?:template\s*<[^>]*>\s*)?(?:DEV|__device__|__host__ __device__|__device__ __forceinline__)"
                   r"[\w\s:<>,*&]*?\b(\w+)\s*\(", re.M)


def _registry():
    import memra_dsv4.gpu.ops as ops_pkg
    for mod in pkgutil.iter_modules(ops_pkg.__path__):
        importlib.import_module(f"memra_dsv4.gpu.ops.{mod.name}")
    importlib.import_module("memra_dsv4.gpu.ops_decode")   # registers decode.cu
    from memra_dsv4.gpu import kernel_loader
    return kernel_loader.registered()


def _header_functions(src: str) -> set[str]:
    names = set()
    for inc in re.findall(r'#include\s+"([^"]+)"', src):
        path = os.path.join(KDIR, inc)
        if os.path.exists(path):
            names |= set(_FUNC.findall(open(path, encoding="utf-8").read()))
    return names


def test_registry_covers_every_cu_file():
    stems = {f[:-3] for f in os.listdir(KDIR) if f.endswith(".cu")}
    assert stems <= set(_registry()), f"kernels_cu files nobody registers: {stems - set(_registry())}"


@pytest.mark.parametrize("stem", sorted({f[:-3] for f in os.listdir(KDIR) if f.endswith(".cu")}))
def test_kernel_names_do_not_collide(stem):
    src = open(os.path.join(KDIR, stem + ".cu"), encoding="utf-8").read()
    header = _header_functions(src)
    names = [n for n in _registry().get(stem, ()) if re.fullmatch(r"\w+", n)]  # templates: skip
    clash = sorted(n for n in names if n in header)
    assert not clash, f"{stem}.cu: kernel names that are also device functions of its headers: {clash}"
    for n in names:
        # a kernel is defined by a macro or spelled out; a spelled-out one must be unique
        defs = re.findall(r'extern "C" __global__[^{;]*?\b%s\s*\(' % re.escape(n), src, re.S)
        assert len(defs) <= 1, f"{stem}.cu: {n} defined {len(defs)} times"


def _defined_kernels(src: str) -> set[str]:
    """Names of the extern "C" kernels a .cu file defines: spelled out, or by a kernel-defining
    macro (a #define whose body has extern "C") invoked at the start of a line as MACRO(name, ..."""
    ws = r'[\s\\]*'   # whitespace, line continuations of a macro body included
    spelled = set(re.findall(r'extern "C"%s__global__%svoid%s(?:__launch_bounds__%s\([^)]*\)%s)?'
                             r'(\w+)%s\(' % (ws, ws, ws, ws, ws, ws), src))
    macros = re.findall(r'#define\s+(\w+)\s*\([^)]*\)((?:[^\n]*\\\n)+[^\n]*)', src)
    out = {n for n in spelled if n != "NAME"}
    for name, body in macros:
        if 'extern "C"' in body:
            out |= set(re.findall(r'^\s*%s\((\w+)\s*[,)]' % re.escape(name), src, re.M))
    return out


@pytest.mark.parametrize("stem", sorted({f[:-3] for f in os.listdir(KDIR) if f.endswith(".cu")}))
def test_every_defined_kernel_is_registered(stem):
    """A kernel the .cu defines but its wrapper module does not register cannot be launched: the
    loader refuses the name on the GPU machine only (the thirty-eighth session's multi-row GEMV:
    "kernel 'gemv_bf16_x2_r4' of decode.cu is not registered")."""
    src = open(os.path.join(KDIR, stem + ".cu"), encoding="utf-8").read()
    defined = _defined_kernels(src)
    assert defined, f"{stem}.cu: no kernel found (the parser above no longer matches the file)"
    missing = sorted(defined - set(_registry().get(stem, ())))
    assert not missing, f"{stem}.cu defines kernels nobody registers: {missing}"
