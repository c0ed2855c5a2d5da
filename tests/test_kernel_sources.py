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
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)

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
    return load_tool("compile_kernels")


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


def _nvcc_one(nvcc: str, src: str, tmp: str, defines: dict | None = None) -> tuple[str, int, str]:
    tag = "".join(f".{k}={v}" for k, v in sorted((defines or {}).items()))
    out = os.path.join(tmp, os.path.basename(src) + tag + ".cubin")
    cmd = [nvcc, "-arch=sm_90a", "-std=c++17", "-cubin", "-O3", "-Xptxas", "-v", "-I", KDIR, "-o", out]
    cmd += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())] + [src]
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


# Tuning-macro builds of experts.cu that tests and tools/bench_gemv.py --fp4-variants load
# (ops.experts.variant_kernels) and that are candidates for a default: they must compile under the
# same rules (no spills, no stack, the declared entries).  ~50 s of nvcc each on a 2-core box.
EXPERTS_VARIANT_BUILDS = [{"FP4_ALU_EVEN": 1}, {"FP4_PRMT": 0},
                          {"FP4_XRED": 0, "FP4_E8M0_FMA": 0, "FP4_E4M3_CVT": 0}]


@pytest.mark.parametrize("defines", EXPERTS_VARIANT_BUILDS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_nvcc_sm90a_experts_variant_builds(tmp_path, defines):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or put it on PATH)")
    src = os.path.join(KDIR, "experts.cu")
    _, rc, log = _nvcc_one(nvcc, src, str(tmp_path), defines)
    assert rc == 0, f"experts.cu {defines}: nvcc exit {rc}\n{log}"
    problems = _compile_kernels_tool().check_ptxas_log(log)
    assert not problems, f"experts.cu {defines}: " + "; ".join(problems)
    entries = set(re.findall(r"Compiling entry function '([^']+)'", log))
    assert entries == declared_kernels(src), f"experts.cu {defines}: compiled entries {sorted(entries)}"


def test_fp4_alu_even_requires_alu_odd(tmp_path):
    """FP4_ALU_EVEN=1 stages every x times 2^14, so a table-only odd half would be wrong: #error."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or put it on PATH)")
    cmd = [nvcc, "-arch=sm_90a", "-std=c++17", "-E", "-I", KDIR, "-DFP4_ALU_EVEN=1", "-DFP4_ALU_ODD=0",
           "-o", os.devnull, os.path.join(KDIR, "experts.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "FP4_ALU_EVEN=1 needs FP4_ALU_ODD=1" in proc.stdout + proc.stderr


@pytest.mark.parametrize("defines,message", [
    ({"FP4_PRMT": 1, "FP4_ALU_ODD": 0}, "FP4_PRMT=1 needs FP4_ALU_ODD=1"),
    ({"FP4_PRMT": 1, "FP4_ALU_EVEN": 1}, "FP4_PRMT=1 and FP4_ALU_EVEN=1 are alternatives"),
])
def test_fp4_prmt_conflicting_macros(defines, message):
    """FP4_PRMT=1 stages every x times 2^14 (as FP4_ALU_EVEN=1, its alternative): #error otherwise."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or put it on PATH)")
    cmd = [nvcc, "-arch=sm_90a", "-std=c++17", "-E", "-I", KDIR, *(f"-D{k}={v}" for k, v in defines.items()),
           "-o", os.devnull, os.path.join(KDIR, "experts.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr


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


# ---------------------------------------------------------------------------------------------
# Launch marshalling: every wrapper, called on host stand-ins of CuPy arrays, must pass exactly
# the kernel's parameter list with the right scalar widths (CuPy does no argument checking: an
# int where the kernel takes a double, or a missing argument, is silent garbage on the GPU).
# ---------------------------------------------------------------------------------------------

def _closing(src: str, start: int, pair: str) -> int:
    """Index of the bracket closing the one at src[start] (pair "()" or "{}")."""
    depth = 0
    for i in range(start, len(src)):
        if src[i] == pair[0]:
            depth += 1
        elif src[i] == pair[1]:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {pair} from offset {start}")


def _param_list(src: str, open_paren: int) -> str:
    return src[open_paren + 1:_closing(src, open_paren, "()")]


def braced(src: str, head: str, *, from_head: bool = False) -> str:
    """The first definition in src starting with ``head``, through its matching closing brace:
    from its opening brace, or from ``head`` itself with from_head (the source-reading tests of
    test_decode_qnorm_cpu / test_fp4_xred_cpu)."""
    i = src.index(head)
    j = src.index("{", i)
    return src[i if from_head else j:_closing(src, j, "{}") + 1]


def kernel_signatures() -> dict[str, list[str]]:
    """{kernel: [param kind]} with kind in ptr | i32 | i64 | u32 | u64 | f32 | f64, parsed from kernels_cu."""
    sigs = {}
    for path in SOURCES:
        src = open(path, encoding="utf-8").read()
        for m in _EXTERN.finditer(src):
            if m.group(1) not in ("NAME", "__launch_bounds__"):
                sigs[m.group(1)] = _param_list(src, m.end() - 1)
        for mm in _MACRO_DEF.finditer(src):
            body = src.index("NAME(", src.index("extern", mm.end()))
            plist = _param_list(src, body + 4)
            for inst in re.findall(rf"^{mm.group(1)}\((\w+)\s*,", src, re.M):
                sigs[inst] = plist
    out = {}
    for name, plist in sigs.items():
        kinds = []
        for p in (x.replace("\\", " ").strip() for x in plist.split(",")):
            if not p:
                continue
            if "*" in p:
                kinds.append("ptr")
                continue
            t = re.sub(r"\s+", " ", p).rsplit(" ", 1)[0].replace("const ", "").strip()
            kinds.append({"int": "i32", "long long": "i64", "float": "f32", "double": "f64",
                          "u32": "u32", "u64": "u64"}[t])
        out[name] = kinds
    return out


def check_kernel_args(name: str, args, sigs) -> None:
    """A fake launch's arguments against kernel ``name``'s parsed signature (kernel_signatures()):
    the count, and per argument a device array (the fake's ndarray) or a u64 pointer where the
    kernel takes a pointer, else exactly the NumPy scalar type of the parameter."""
    import numpy as np
    kinds = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "f64": np.float64, "u32": np.uint32,
             "u64": np.uint64}
    want = sigs[name]
    assert len(args) == len(want), f"{name}: {len(args)} args, kernel takes {len(want)}"
    for i, (a, k) in enumerate(zip(args, want)):
        ok = (isinstance(a, np.ndarray) or type(a) is np.uint64) if k == "ptr" else type(a) is kinds[k]
        assert ok, f"{name}: argument {i} is {type(a).__name__}, kernel expects {k}"


class FakeCupyArray(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr`` (the CPU wrapper tests' stand-in); one class for
    every _fake_cupy(), so arrays made by one fake pass another's isinstance checks."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _fake_cupy():
    ndarray = FakeCupyArray
    fake = types.ModuleType("cupy")
    fake.ndarray = ndarray
    fake.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(ndarray)
    fake.zeros = lambda shape, dtype=float: np.zeros(shape, dtype).view(ndarray)
    fake.empty = lambda shape, dtype=float: np.zeros(shape, dtype).view(ndarray)
    fake.ascontiguousarray = lambda x, dtype=None: np.ascontiguousarray(x, dtype=dtype).view(ndarray)
    fake.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=lambda i=0: types.SimpleNamespace(id=i, attributes={"MultiProcessorCount": 132}))
    return fake



class FakeKernel:
    """A RawKernel stand-in for the CPU wrapper tests: every launch's arguments are checked against
    the kernel's .cu signature (check_kernel_args), then ``check(name, grid, block, shared_mem)``
    (the caller's launch checks, if any), then dynamic shared memory past 48 KB must have been
    raised on the kernel first; ``record(name, grid, block, args, shared_mem)`` keeps the launch."""

    def __init__(self, name, sigs, record, check=None):
        self.name, self.sigs, self.record, self.check = name, sigs, record, check
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0, cluster=None):
        from memra_dsv4.gpu import kernel_loader
        # cluster= only for kernels registered as cluster kernels (get() hands those out wrapped)
        assert cluster is None or any(n == self.name for _, n in kernel_loader._CLUSTER), (
            f"{self.name}: cluster={cluster} but not registered with cluster=")
        check_kernel_args(self.name, args, self.sigs)
        if self.check is not None:
            self.check(self.name, grid, block, shared_mem)
        assert shared_mem <= 48 * 1024 or self.max_dynamic_shared_size_bytes >= shared_mem, (
            f"{self.name}: {shared_mem} B dynamic smem without raising the limit")
        self.record(self.name, grid, block, args, shared_mem)


def fake_ops_module(monkeypatch, name: str, record, check=None, sms: int = 132):
    """The CPU wrapper tests' setup for ops module ``name`` (memra_dsv4.gpu.ops.<name>, or a dotted
    module path such as memra_dsv4.gpu.ops_decode): the fake
    CuPy in sys.modules, the module's kernel() handing out FakeKernels
    (registered_fake_kernels(kernel_signatures(), record, check)), dynamic_smem's cache cleared
    (it keys on id(kernel): fresh kernels) and sm_count() = sms.  Returns (fake cupy, module)."""
    import importlib

    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from memra_dsv4.gpu.ops import _common
    # a bare family name is memra_dsv4.gpu.ops.<name>; a dotted one is imported as given
    mod = importlib.import_module(name if "." in name else f"memra_dsv4.gpu.ops.{name}")
    monkeypatch.setattr(mod, "kernel", registered_fake_kernels(kernel_signatures(), record, check))
    monkeypatch.setattr(_common, "_SMEM_SET", {})
    monkeypatch.setattr(mod, "sm_count", lambda: sms)
    return fake, mod


def registered_fake_kernels(sigs, record, check=None):
    """A ``kernel(stem, name)`` stand-in: registered kernels only (asserted), one FakeKernel per
    name (so a raised shared-memory limit sticks, as on the loader's cached kernels)."""
    cache = {}

    def fake_kernel(stem, name):
        from memra_dsv4.gpu.kernel_loader import registered

        assert name in registered()[stem], f"{stem}.{name} not registered"
        return cache.setdefault(name, FakeKernel(name, sigs, record, check))

    return fake_kernel

def test_wrappers_marshal_kernel_signatures(monkeypatch):
    import numpy as np

    from memra_dsv4.gpu.ops import FAMILIES
    from memra_dsv4.gpu.ops import _common

    sigs = kernel_signatures()
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    launched = []

    def launch_ok(name, grid, block, shared_mem):
        assert all(int(g) >= 1 for g in grid) and 1 <= int(np.prod(block)) <= 1024, f"{name}: launch {grid} {block}"

    fake_kernel = registered_fake_kernels(sigs, lambda name, *_: launched.append(name), launch_ok)
    monkeypatch.setattr(_common, "_SMEM_SET", {})   # dynamic_smem keys on id(kernel): fresh ones

    mods = {f: importlib.import_module(f"memra_dsv4.gpu.ops.{f}") for f in FAMILIES}
    monkeypatch.setattr(_common, "sm_count", lambda: 132)
    for m in mods.values():
        monkeypatch.setattr(m, "kernel", fake_kernel)
        if hasattr(m, "sm_count"):
            monkeypatch.setattr(m, "sm_count", lambda: 132)
    A = fake.asarray
    u16 = lambda *s: A(np.zeros(s, np.uint16))
    f32 = lambda *s: A(np.zeros(s, np.float32))
    i32 = lambda *s: A(np.zeros(s, np.int32))
    u8 = lambda *s: A(np.zeros(s, np.uint8))
    M = mods
    M["rmsnorm"].rmsnorm(u16(2, 64), f32(64), 1e-6)
    M["rmsnorm"].rmsnorm(u16(2, 64), u16(64), 1e-6)
    M["rmsnorm"].head_rms(u16(2, 4, 64), 1e-6)
    M["rmsnorm"].head_rms(u16(2, 4, 512), 1e-6, rope=(i32(2), f32(9, 32), f32(9, 32)))
    M["rope"].rope(u16(2, 4, 128), i32(2), f32(10, 32), f32(10, 32), inverse=True)
    M["quant_sim"].fp8_sim(u16(2, 256), 128)
    M["quant_sim"].kv_fp8_sim(u16(2, 512), 64)
    M["quant_sim"].fp4_sim(u16(2, 64))
    M["quant_sim"].hadamard128(u16(3, 128))
    M["quant_sim"].hadamard128(u16(3, 128), fp4=True)
    M["quant_sim"].rope_hadamard128_fp4(u16(2, 64, 128), i32(2), f32(9, 32), f32(9, 32))
    X = u16(2, 4, 64)
    mixes = M["hc"].hc_mixes(X, f32(24, 256), 1e-6)
    M["hc"].hc_pre_finish(mixes, f32(3), f32(24), X, iters=20, hc_eps=1e-6)
    M["hc"].hc_weighted_sum(f32(2, 4), X)
    M["hc"].hc_head(X, f32(4, 256), f32(1), f32(4), hc_eps=1e-6, norm_eps=1e-6)
    M["hc"].hc_post(u16(2, 64), X, f32(2, 4), f32(2, 4, 4))
    monkeypatch.setattr(M["hc"], "_WS", {})  # hc_boundary's split workspace: fake arrays stay here
    bx = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6, xn=u16(1, 64), x=u16(1, 64), pre=f32(1, 4),
              post=f32(1, 4), comb=f32(1, 4, 4), mixes=f32(1, 24))
    M["hc"].hc_boundary(u16(1, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), **bx)
    M["hc"].hc_boundary(u16(1, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), f=u16(1, 64),
                        out=u16(1, 4, 64), **bx)
    bpre = {k: bx[k] for k in ("hc_eps", "norm_eps", "xn", "x", "pre", "mixes")}
    M["hc"].hc_boundary_pre(u16(1, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), **bpre)
    M["hc"].hc_boundary_pre(u16(1, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), f=u16(1, 64),
                            out=u16(1, 4, 64), post_in=f32(1, 4), comb_in=f32(1, 4, 4), **bpre)
    bpre256 = dict(bpre, xn=u16(1, 256), x=u16(1, 256))   # the cluster form: D % 256 == 0
    M["hc"].hc_boundary_pre(u16(1, 4, 256), f32(24, 1024), f32(3), f32(24), u16(256), f=u16(1, 256),
                            out=u16(1, 4, 256), post_in=f32(1, 4), comb_in=f32(1, 4, 4), handoff="cluster",
                            **bpre256)
    bpre1k = dict(bpre, xn=u16(1, 1024), x=u16(1, 1024))   # the coop form: D in 1024 .. 8192
    monkeypatch.setattr(M["hc"], "_COOP_SLOTS", {0: i32(M["hc"].COOP_SLOT_INT32)})
    M["hc"].hc_boundary_pre(u16(1, 4, 1024), f32(24, 4096), f32(3), f32(24), u16(1024), f=u16(1, 1024),
                            out=u16(1, 4, 1024), post_in=f32(1, 4), comb_in=f32(1, 4, 4), handoff="coop",
                            **bpre1k)
    M["hc"].hc_boundary_pre(u16(1, 4, 1024), f32(24, 4096), f32(3), f32(24), u16(1024), handoff="coopall", **bpre1k)
    M["hc"].hc_boundary_sinkhorn(f32(1, 24), f32(3), f32(24), iters=20, hc_eps=1e-6, post=f32(1, 4),
                                 comb=f32(1, 4, 4))
    monkeypatch.setattr(M["hc"], "_BND_SLOTS", {0: i32(M["hc"]._BND_SLOT_WORDS)})  # hc_boundary_poll's slots
    for f_kw in ({}, dict(f=u16(1, 64), out=u16(1, 4, 64))):
        M["hc"].hc_boundary(u16(1, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), impl="poll", **f_kw, **bx)
    bx3 = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6, xn=u16(3, 64), x=u16(3, 64), pre=f32(3, 4),
               post=f32(3, 4), comb=f32(3, 4, 4), mixes=f32(3, 24))   # the device verify's rows
    M["hc"].hc_boundary(u16(3, 4, 64), f32(24, 256), f32(3), f32(24), u16(64), f=u16(3, 64),
                        out=u16(3, 4, 64), impl="lastcta", **bx3)
    M["compressor"].add_ape(f32(3, 8), f32(4, 8), i32(3))
    st = f32(8, 32)
    M["compressor"].pool_overlap(st[4:8], st[4:8], 1, prev_kv=st[0:4], prev_score=st[0:4])
    M["compressor"].pool_overlap(f32(8, 32), f32(8, 32), 2)
    M["compressor"].pool_plain(f32(8, 16), f32(8, 16), 4, 2)
    f64 = lambda *s: A(np.zeros(s, np.float64))
    M["compressor"].chain_squares(f32(5, 512)[1:4], pre_store=True)
    M["compressor"].chain_rms_rope(f32(3, 512), f64(3, 1), u16(512), 1e-6, f32(3, 32), f32(3, 32))
    M["compressor"].chain_rms_rope(f32(3, 1536), f64(3), u16(1536), 1e-6, out=u16(4, 1536)[1:4])
    for D, mode in ((512, "fp8"), (128, "fp8"), (128, "hadfp4")):
        M["compressor"].norm_rope_sim(f32(2, D), f32(D), 1e-6, f32(10, 32), f32(10, 32), i32(2), mode)
        M["compressor"].norm_rope_sim(u16(2, D), f32(D), 1e-6, f32(10, 32), f32(10, 32), i32(2), mode,
                                      out=u16(5, D)[1:3])
    for r, ovl, D, mode in ((4, True, 512, "fp8"), (128, False, 512, "fp8"), (4, True, 128, "hadfp4"),
                            (16, False, 128, "fp8")):
        rows, C = (2 if ovl else 1) * r, (2 if ovl else 1) * D
        M["compressor"].emit(i32(1), f32(rows, C), f32(rows, C), r, ovl, f32(D), 1e-6, f32(10, 32), f32(10, 32),
                             mode, u16(5, D)[1:3])
        M["compressor"].emit(i32(1), f32(rows, C), f32(rows, C), r, ovl, f32(D), 1e-6, f32(10, 32), f32(10, 32),
                             mode, u16(5, D)[1:3], incoming=(f32(C), f32(C)))   # the verify's rows
        M["compressor"].emit_rows(i32(3), f32(rows, C), f32(rows, C), r, ovl, f32(D), 1e-6, f32(10, 32),
                                  f32(10, 32), mode, u16(5, D)[1:3], incoming=(f32(8, C), f32(8, C)))
    sc = M["indexer"].scores(u16(2, 64, 128), u16(2, 64), u16(10, 128), i32(2), w_scale=0.011)
    M["indexer"].scores(u16(2, 64, 128), u16(2, 64), u16(300, 128), i32(2), impl="mma")
    M["indexer"].topk(sc, i32(2), 4, order="index")
    M["indexer"].scores_topk(u16(1, 64, 128), u16(1, 64), u16(300, 128), i32(1), 8, u16(1, 300), i32(1, 8),
                             w_scale=0.011, counter=i32(1), form="fused")
    M["indexer"].scores_topk(u16(1, 64, 128), u16(1, 64), u16(300, 128), i32(1), 8, u16(1, 300), i32(1, 8),
                             w_scale=0.011, form="split", hist=i32(256))
    for form in ("fused", "split"):   # the device verify's row form
        M["indexer"].scores_topk_rows(u16(3, 64, 128), u16(3, 64), u16(304, 128), i32(3, 4), 8, u16(3, 304),
                                      i32(3, 8), w_scale=0.011, form=form, workspaces=(i32(8), i32(2048)))
    for H, D in ((64, 512), (8, 512), (4, 512), (4, 128), (8, 128), (16, 128)):
        for n_split in (1, 3):
            M["attention"].sparse_attention(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1,
                                            probs_bf16=True, n_split=n_split)
            M["attention"].sparse_attention(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1, n_split=n_split,
                                            inverse_rope=(i32(2), f32(9, 32), f32(9, 32)))
    for H, D in ((64, 512), (8, 512), (4, 512), (4, 128), (8, 128), (16, 128)):
        for n_split in (1, 3):  # counters given: the fake arrays stay out of the per-device cache
            M["attention"].sparse_attention_decode(u16(1, H, D), u16(200, D), i32(1), 128, 4, i32(8), 136, f32(H),
                                                   0.1, probs_bf16=True, n_split=n_split, counters=i32(64))
            M["attention"].sparse_attention_decode(u16(1, H, D), u16(200, D), i32(1), 128, 128, None, 150, f32(H),
                                                   0.1, n_split=n_split, counters=i32(64),
                                                   inverse_rope=(i32(1), f32(9, 32), f32(9, 32)))
    for H, D in ((64, 512), (8, 512), (4, 512), (4, 128), (8, 128), (16, 128)):
        for n_split in (1, 3):  # the _qn kernels (q norm + q RoPE at the q load; without rope too)
            M["attention"].sparse_attention(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1, n_split=n_split,
                                            inverse_rope=(i32(2), f32(9, 32), f32(9, 32)),
                                            q_norm=(1e-6, i32(2), f32(9, 32), f32(9, 32)))
            M["attention"].sparse_attention(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1, n_split=n_split,
                                            q_norm=(1e-6, None, None, None))
            M["attention"].sparse_attention_decode(u16(1, H, D), u16(200, D), i32(1), 128, 4, i32(8), 136, f32(H),
                                                   0.1, n_split=n_split, counters=i32(64),
                                                   inverse_rope=(i32(1), f32(9, 32), f32(9, 32)),
                                                   q_norm=(1e-6, i32(1), f32(9, 32), f32(9, 32)))
    for H, D, hpc in ((64, 512, 16), (64, 512, 32), (16, 128, 16)):
        M["attention"].sparse_attention_mma(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1, probs_bf16=True,
                                            heads_per_cta=hpc)
        M["attention"].sparse_attention_mma(u16(2, H, D), u16(10, D), i32(2, 70), f32(H), 0.1, heads_per_cta=hpc,
                                            inverse_rope=(i32(2), f32(9, 32), f32(9, 32)))
    lg = M["router"].logits(u16(2, 64), u16(8, 64))
    M["router"].select(lg, 2, 1.5, bias=f32(8))
    M["router"].select(f32(3, 256), 6, 1.5, tid2eid=i32(100, 6), token_ids=i32(3))
    for E in (64, 128, 384, 512):
        M["router"].select(f32(3, E), 6, 2.5, bias=f32(E), want_scores=False)
    for E in (8, 64, 128, 256, 384, 512):  # counter given: the fake arrays stay out of the workspace cache
        M["router"].fused(u16(1, 64), u16(E, 64), 2, 1.5, bias=f32(E), counter=i32(1))
    M["router"].fused(u16(1, 64), u16(256, 64), 6, 1.5, tid2eid=i32(100, 6), token_ids=i32(1), counter=i32(1))
    M["router"].fused(u16(4, 64), u16(256, 64), 6, 1.5, tid2eid=i32(100, 6), token_ids=i32(4), counter=i32(8))
    for E in (8, 64, 128, 200, 256):   # the cluster handoff (router_cluster_e*)
        M["router"].fused(u16(1, 64), u16(E, 64), 2, 1.5, bias=f32(E), handoff="cluster")
    M["router"].fused(u16(1, 64), u16(256, 64), 6, 1.5, tid2eid=i32(100, 6), token_ids=i32(1), handoff="cluster")
    M["experts"].dequant_mxfp4(u8(4, 32), u8(4, 2))
    M["experts"].dequant_nvfp4(u8(4, 32), u8(4, 4), 0.5)
    tab = A(np.zeros(4, np.uint64))
    # K = 2048 / 4096: the full-shape fast kernels (_f) and, with the switch off, the general ones
    for K, full in ((256, True), (2048, True), (4096, True), (2048, False), (4096, False)):
        with M["experts"].full_path(full):
            M["experts"].gemv_fp4("mxfp4", u16(1, K), i32(6), tab, tab, 64, K, x_div=6)
            M["experts"].gemv_fp4("nvfp4", u16(6, K), i32(6), tab, tab, 64, K, ws2=f32(4))
            for fmt, w2 in (("mxfp4", {}), ("nvfp4", {"ws2_1": f32(4), "ws2_3": f32(4)})):
                M["experts"].gemv_fp4_gateup(fmt, u16(1, K), i32(6), tab, tab, tab, tab, 64, K, weight=f32(6),
                                             x_div=6, **w2)
                M["experts"].gemv_fp4_down_combine(fmt, u16(12, K), i32(2, 6), tab, tab, 64, K, shared=u16(2, 64),
                                                   **({"ws2": f32(4)} if fmt == "nvfp4" else {}))
    M["experts"].GATEUP_RING = True   # _k4_r: the gate/up with its weight ring in shared memory
    try:
        for fmt, w2 in (("mxfp4", {}), ("nvfp4", {"ws2_1": f32(4), "ws2_3": f32(4)})):
            M["experts"].gemv_fp4_gateup(fmt, u16(1, 4096), i32(6), tab, tab, tab, tab, 64, 4096, weight=f32(6),
                                         x_div=6, **w2)
    finally:
        M["experts"].GATEUP_RING = False
    for fmt, nv in (("mxfp4", {}), ("nvfp4", {"ws2": f32(4)})):   # _k2_f_w2: the shared w2 rows in the kernel
        M["experts"].gemv_fp4_down_combine(fmt, u16(12, 2048), i32(2, 6), tab, tab, 64, 2048,
                                           shared_w2=(u16(64, 2048), u16(2, 2048)), **nv)
    for fmt, w2 in (("mxfp4", {}), ("nvfp4", {"ws2_1": f32(4), "ws2_3": f32(4)})):   # _k4_f_sh: the shared SwiGLU
        M["experts"].gemv_fp4_gateup(fmt, u16(1, 4096), i32(6), tab, tab, tab, tab, 64, 4096, weight=f32(6),
                                     x_div=6, shared_swiglu=(u16(64, 4096), u16(64, 4096), u16(64), 7.0), **w2)
    for K in (256, 2048, 4096):  # the tensor-core variant (k = 16 at K = 4096: > 48 KB of shared memory)
        for fmt, nv in (("mxfp4", {}), ("nvfp4", {"ws2": f32(4)})):
            M["experts"].gemv_fp4(fmt, u16(1, K), i32(6), tab, tab, 72, K, x_div=6, impl="mma", **nv)
            M["experts"].gemv_fp4_gateup(fmt, u16(1, K), i32(6), tab, tab, tab, tab, 64, K, weight=f32(6), x_div=6,
                                         impl="mma", **({"ws2_1": f32(4), "ws2_3": f32(4)} if nv else {}))
            for k in (6, 16):
                M["experts"].gemv_fp4_down_combine(fmt, u16(2 * k, K), i32(2, k), tab, tab, 64, K, shared=u16(2, 64),
                                                   impl="mma", **nv)
    gu = u16(3, 256)
    M["moe"].swiglu(gu[:, :128], gu[:, 128:], 10.0, f32(3))
    M["moe"].swiglu(u16(3, 128), u16(3, 128), 0.0)
    M["moe"].combine(u16(2, 6, 64), i32(2, 6), u16(2, 64))
    M["moe"].combine(u16(2, 6, 64), i32(2, 6))
    i64 = lambda *s: A(np.zeros(s, np.int64))
    for T, k, E in ((1, 6, 256), (3000, 6, 256), (5, 2, 1024)):   # the plan kernels (1 or 3 CTAs)
        n, nseg = T * k, M["moe"].plan_segments(T * k)
        hist, eb = i32(nseg, E), i32(E)
        M["moe"].plan_count(i64(T, k), E, hist)
        M["moe"].plan_scan(hist, E, eb, i32(E), i32(E), i32(7, 4), i32(2))
        M["moe"].plan_scan(hist, E, eb, i32(E), i32(E), i32(7, 4), i32(2), wg=True)
        M["moe"].plan_place(i64(T, k), k, E, hist, eb, i32(n), i32(n), i32(n))
        M["moe"].plan_combine_pos(i64(T, k), i32(n), i32(T, k))
    M["dense"].dequant_fp8_bf16(u8(130, 256), u8(2, 2))
    M["dense"].dequant_fp8_bf16(u8(3, 40), u8(1, 1), out=u16(3, 40))
    for n in (1, 5, 4096):
        M["convert"].f32_to_bf16_bits(f32(n))
        M["convert"].f32_store_bf16(f32(n))
        M["convert"].bf16_to_f32(u16(n))
    PM = importlib.import_module("memra_dsv4.gpu.ops.prefill_moe")
    monkeypatch.setattr(PM, "kernel", fake_kernel)
    PM.dequant_experts("mxfp4", u8(3, 16, 32), u8(3, 16, 2), i32(2), u16(2, 16, 64))
    PM.dequant_experts("nvfp4", u8(3, 16, 32), u8(3, 16, 4), i32(2), u16(2, 16, 64), ws2=f32(3))
    PM.gather_rows(f32(4, 64), i32(5), u16(5, 64))
    PM.swiglu_rows(f32(5, 64), f32(5, 64), f32(8), i32(5), 10.0, u16(5, 64))
    PM.combine_sorted(f32(5, 64), i32(2, 4), f32(2, 64))
    d = PM.dispatch_on_device(i32(3, 6), 256)             # any integer dtype: made int64 first
    assert d.items.shape == (PM.max_mma_items(18, 256), 4) and d.pos.shape == (3, 6)
    d = PM.dispatch_on_device(i32(300, 6), 256, "wgmma")  # the wgmma items: bn = WG_BN bound
    assert d.items.shape == (PM.max_mma_items(1800, 256, PM.WG_BN), 4) and d.pos.shape == (300, 6)
    for fmt, blk in (("mxfp4", 32), ("nvfp4", 16)):
        w13 = (u8(2, 128, 128), u8(2, 128, 256 // blk))       # [E, I = 128, D / 2], D = 256
        w2 = (u8(2, 256, 64), u8(2, 256, 128 // blk))         # [E, D, I / 2]
        PM.fp4mma_gateup(fmt, w13, w13, i32(3, 4), u16(10, 256), f32(12), i32(10), 10.0, u16(10, 128),
                         None if fmt == "mxfp4" else (f32(2), f32(2)))
        PM.fp4mma_down(fmt, w2, i32(3, 4), u16(10, 128), f32(10, 256), None if fmt == "mxfp4" else f32(2))
        PM.wgmma_gateup(fmt, w13, w13, i32(3, 4), u16(10, 256), f32(12), i32(10), 10.0, u16(10, 128),
                        None if fmt == "mxfp4" else (f32(2), f32(2)))
        PM.wgmma_down(fmt, w2, i32(3, 4), u16(10, 128), f32(10, 256), None if fmt == "mxfp4" else f32(2))
    PM.gather_rows_perm(f32(4, 256), i32(5), u16(5, 256))
    from memra_dsv4.gpu.ops import kernel_names

    every = {n for names in kernel_names().values() for n in names}
    assert every <= set(launched), f"kernels never launched by this check: {sorted(every - set(launched))}"


def test_fp4_launch_geometry_matches_the_kernel_macros():
    """gpu/ops/experts.py sizes the FP4 GEMV grids from the warp-group shape that
    kernels_cu/experts.cu compiles in (FP4_*_R macros, FP4_WARPS): one fact in two languages,
    pinned here so a retune of one side cannot silently mis-size the other's grid."""
    from memra_dsv4.gpu.ops import experts as EX
    with open(os.path.join(KDIR, "experts.cu")) as f:
        src = f.read()
    macro = {m: int(v) for m, v in re.findall(r"#define (FP4_(?:GV|GU|DN)_R) (\d+)", src)}
    warps = int(re.search(r"constexpr int FP4_WARPS = (\d+);", src).group(1))
    assert macro == {"FP4_GV_R": EX.GEMV_ROWS_PER_GROUP, "FP4_GU_R": EX.GATEUP_ROWS_PER_GROUP,
                     "FP4_DN_R": EX.DOWN_ROWS_PER_GROUP}
    assert warps == EX.FP4_WARPS


def test_fp4mma_launch_geometry_matches_the_kernel_macros():
    """gpu/ops/prefill_moe.py sizes the fp4mma grids, blocks and dynamic shared memory from the
    tile that kernels_cu/experts.cu compiles in (FP4MMA_WARPS, FP4MMA_STAGES, MMA_BN, MMA_KC):
    pinned here so a retune of one side cannot silently mis-size the other."""
    from memra_dsv4.gpu.ops import prefill_moe as PM
    with open(os.path.join(KDIR, "experts.cu")) as f:
        src = f.read()
    macro = {m: int(v) for m, v in re.findall(r"#define (FP4MMA_(?:WARPS|STAGES)) (\d+)", src)}
    assert macro == {"FP4MMA_WARPS": PM.MMA_WARPS, "FP4MMA_STAGES": PM.MMA_STAGES}
    assert int(re.search(r"constexpr int MMA_BN = (\d+);", src).group(1)) == PM.MMA_BN
    assert int(re.search(r"constexpr int MMA_KC = (\d+);", src).group(1)) == PM.MMA_KC
    assert PM.MMA_ROWS == 32 * PM.MMA_WARPS
    # the kernel's MmaSmem: stages x (activations + packed weights + scales)
    assert PM.mma_smem_bytes("mxfp4") == PM.MMA_STAGES * (64 * 128 * 2 + PM.MMA_ROWS * 64 + PM.MMA_ROWS * 4)
    assert PM.mma_smem_bytes("nvfp4") == PM.MMA_STAGES * (64 * 128 * 2 + PM.MMA_ROWS * 64 + PM.MMA_ROWS * 8)
    assert PM.mma_smem_bytes("nvfp4") <= 227 * 1024


def test_dispatch_plan_constants_match_moe_cu():
    """gpu/ops/moe.py sizes the plan kernels' grids, blocks and shared memory from kernels_cu/moe.cu's
    PLAN_* constants, and the plan's work items are the fp4mma kernels' MMA_BN rows: pinned here."""
    from memra_dsv4.gpu.ops import moe as MO
    from memra_dsv4.gpu.ops import prefill_moe as PM
    with open(os.path.join(KDIR, "moe.cu")) as f:
        src = f.read()
    got = {m: int(v) for m, v in re.findall(r"constexpr int (PLAN_(?:SEG|WARPS|MAX_E|BN|WG_BN)) = (\d+);", src)}
    assert got == {"PLAN_SEG": MO.PLAN_SEG, "PLAN_WARPS": MO.PLAN_WARPS, "PLAN_MAX_E": MO.PLAN_MAX_E,
                   "PLAN_BN": MO.PLAN_BN, "PLAN_WG_BN": MO.PLAN_WG_BN}
    assert MO.PLAN_BN == PM.MMA_BN and MO.PLAN_WG_BN == PM.WG_BN
    with open(os.path.join(KDIR, "experts.cu")) as f:
        assert int(re.search(r"constexpr int WG_BN = (\d+);", f.read()).group(1)) == PM.WG_BN
    assert MO.PLAN_WARPS * MO.PLAN_MAX_E * 4 <= 48 * 1024   # count / place: no opt-in smem needed


def test_wgmma_launch_geometry_matches_the_kernel():
    """gpu/ops/prefill_moe.py sizes the wgmma grids, blocks and dynamic shared memory from the tile
    kernels_cu/experts.cu (namespace wg) compiles in: pinned here, as for fp4mma."""
    from memra_dsv4.gpu.ops import prefill_moe as PM
    with open(os.path.join(KDIR, "experts.cu")) as f:
        src = f.read()
    const = {m: int(v) for m, v in re.findall(r"constexpr int (WG_(?:THREADS|ROWS|BN|KC)) = (\d+);", src)}
    assert const == {"WG_THREADS": PM.WG_THREADS, "WG_ROWS": PM.WG_ROWS, "WG_BN": PM.WG_BN, "WG_KC": PM.WG_KC}
    assert int(re.search(r"#define WGMMA_SMEM (\d+)", src).group(1)) == PM.WG_SMEM
    # the token tile of an item is its rows rounded up to 16, one instantiation per tile
    cases = re.findall(r"case (\d+): WG_CASE\((\d+)\)", src)
    assert [(int(a), int(b)) for a, b in cases] == [(i, 16 * i) for i in range(1, PM.WG_BN // 16 + 1)]


def test_ptxas_log_flags_wgmma_serialisation():
    """tools/compile_kernels.py fails a kernel whose wgmma ptxas serialised (C7514/C7515)."""
    tool = _compile_kernels_tool()
    log = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to non wgmma instructions defining accumulator registers of a wgmma between start and end "
           "of the pipeline stage in the function 'wgmma_down_nvfp4'\n"
           "ptxas info    : Compiling entry function 'k2' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    problems = tool.check_ptxas_log(log)
    assert len(problems) == 1 and problems[0].startswith("wgmma_down_nvfp4: wgmma serialised"), problems
    assert tool.check_ptxas_log(log.split("\n", 1)[1]) == []


@pytest.mark.parametrize("gemm", ["fp4mma", "wgmma"])
def test_routed_moe_device_dispatch_launch_sequence(monkeypatch, gemm):
    """routed_moe(dispatch="device") on fake arrays: the launches (kernel, grid, moe_plan_scan's
    item mode) of each FP4 arm, every argument list checked against the kernel's signature.  The
    wgmma arm: the plan with wgmma items (wg = 1), xs gathered permuted, both wgmma GEMMs over
    max_mma_items(T k, E, WG_BN) items; fp4mma: as before (wg = 0, MMA_BN items).  Nothing is
    read back: the fake arrays have no .get(), and the only host arrays are the kernels' args."""
    import numpy as np

    from memra_dsv4.gpu.ops import _common
    from memra_dsv4.gpu.ops import moe as MO
    from memra_dsv4.gpu.ops import prefill_moe as PM

    sigs = kernel_signatures()
    fake = _fake_cupy()
    for dt in ("float32", "int32", "int64", "uint16"):
        setattr(fake, dt, getattr(np, dt))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    launched = []

    def record(name, grid, block, args, shared_mem):
        launched.append((name, tuple(int(g) for g in grid), args))

    monkeypatch.setattr(_common, "sm_count", lambda: 132)
    monkeypatch.setattr(_common, "_SMEM_SET", {})   # dynamic_smem keys on id(kernel): fresh ones
    cache = {}
    for m in (MO, PM):
        monkeypatch.setattr(m, "kernel", lambda stem, name: cache.setdefault(name, FakeKernel(name, sigs, record)))
    T, k, E, D, I = 300, 6, 256, 512, 256
    A = fake.asarray
    ex = {w: (A(np.zeros((E, o, i // 2), np.uint8)), A(np.zeros((E, o, i // 32), np.uint8)))
          for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I)))}
    y = PM.routed_moe(None, A(np.zeros((T, D), np.float32)), A(np.zeros((T, k), np.int64)),
                      A(np.zeros((T, k), np.float32)), ex, "mxfp4", 10.0, A(np.zeros((T, D), np.float32)),
                      gemm=gemm, dispatch="device")
    assert y.shape == (T, D)
    wg = gemm == "wgmma"
    n_items = PM.max_mma_items(T * k, E, PM.WG_BN if wg else PM.MMA_BN)
    names = [n for n, _, _ in launched]
    assert names == ["moe_plan_count", "moe_plan_scan", "moe_plan_place", "moe_plan_combine_pos",
                     "moe_gather_bf16_perm" if wg else "moe_gather_bf16",
                     f"{gemm}_gateup_mxfp4", f"{gemm}_down_mxfp4", "moe_combine_sorted"], names
    scan = launched[1][2]
    assert int(scan[3]) == n_items and int(scan[4]) == (1 if wg else 0)      # max_items, wg
    items = scan[8]
    assert items.shape == (n_items, 4)
    gu, dn = launched[5], launched[6]
    assert gu[1] == ((I // (PM.WG_ROWS // 2)) if wg else -(-I // (PM.MMA_ROWS // 2)), n_items), gu[1]
    assert dn[1] == ((-(-D // PM.WG_ROWS)) if wg else -(-D // PM.MMA_ROWS), n_items), dn[1]
    assert gu[2][6] is items and dn[2][4] is items                            # the plan's items
    gather = launched[4][2]
    assert gather[2] is gu[2][7] and gather[2].shape == (T * k, D)            # xs: the gathered rows
