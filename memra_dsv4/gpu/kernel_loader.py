"""Kernel loading: one ``cupy.RawModule`` per ``kernels_cu/<stem>.cu``, compiled once, at warmup.

Contract
--------
* Ops declare what they launch at import time: ``register(stem, name_expressions)`` (module
  function; ``KernelLoader.register`` is the same call).  Name expressions are the C++ names
  of the template instances (``"rmsnorm<4096>"``) or plain ``extern "C"`` names; every one of
  them is compiled into the stem's module.  Registration is process-wide, so every device's
  loader builds the same modules.
* ``KernelLoader(device_id)`` compiles for that device.  ``warm_all()`` compiles every
  registered module and materialises every registered kernel, so no compile and no module
  load happens on first use (``warm_all(stems)`` limits it to some stems); it returns
  milliseconds per module (printed under ``MEMRA_DSV4_DEBUG=1``).  ``get(stem, name)``
  returns the cached ``cupy.RawKernel``: the same object on every call, never a new one
  (``RawModule.get_function`` builds a fresh RawKernel each time, which costs host time and
  loses per-kernel attributes); inside ``gpu.pdl.pdl_launches(True)`` it returns the
  kernel's cached ``PdlKernel`` wrapper instead (programmatic dependent launch); a kernel
  registered with ``cluster=`` comes as an ``ExKernel`` outside it (both take ``cluster=``).  A stem whose registered names grew after warmup is rebuilt
  on the next ``get``/``warm_all`` (announced at debug).
* ``lookup(device_id, stem, name)`` is ``get_loader(device_id).get(stem, name)`` memoised per
  (device, stem, name, PDL context on/off) in one process-wide dict: the op wrappers' path
  (``gpu.ops._common.kernel``, ~1,400 lookups a 1K prefill forward), a hit being one dict
  lookup.  It returns what ``get`` returns at that moment: the memo is emptied whenever a
  module is built or rebuilt (``get`` then hands out the new module's kernels) and whenever a
  loader is made, and it is bypassed (neither read nor filled) while ``KernelLoader.get`` is
  replaced (``profiling.launches.record_launches`` wraps every lookup).
* ``use_kernels_dir(path)`` (in-process A/B of two kernel trees, bench.decode_step's
  ``kernels=base`` arm; not a seam) routes get_loader / lookup to a loader of another tree
  until ``use_kernels_dir(None)``; the memo keys on the routed tree.
* NVRTC options: ``-std=c++17 -arch=sm_90a -I<kernels_dir> -DMEMRA_DSV4_HEADERS=<hash>``.
    - ``-arch=sm_90a`` defines ``__CUDA_ARCH_FEAT_SM90_ALL`` (wgmma, setmaxnreg).  CuPy appends
      its own ``-arch=sm_90`` after ours; measured on CuPy 14.2 / H200, ours takes effect.
    - No ``--use_fast_math``: device numerics must match the NumPy twins.  CuPy silently adds
      ``-ftz=true`` (denormals flush to zero) and ``--device-as-default-execution-space`` to
      every NVRTC compile; references must treat fp32 denormals accordingly.
    - CuPy writes the source to a temporary file before compiling, so ``#include
      "common.cuh"`` resolves through ``-I<kernels_dir>`` only.
    - CuPy's disk cache keys on the .cu text and the options, not on included headers; the
      ``-DMEMRA_DSV4_HEADERS`` hash of every header under ``kernels_dir`` makes a header edit
      invalidate the cached cubins.
* Cache: compiled cubins go to ``CUPY_CACHE_DIR``, which ``memra_dsv4.gpu`` sets to
  ``<repo>/.memra_cache/cupy`` (or ``~/.memra_cache/cupy``) unless already set.
  ``configure_cache_dir()`` also repoints CuPy's disk backend when CuPy was imported before
  the variable was set (CuPy 14 reads it once at import).
* A compile failure raises ``KernelCompileError`` naming the .cu file, the device, the options
  and carrying NVRTC's log.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time

from memra_dsv4.gpu import REPO_ROOT, default_cache_dir, pdl
from memra_dsv4.seams import SEAM_DEVICE_TRACE, SEAM_KERNELS_DIR, env_value, resolve

__all__ = ["KernelCompileError", "KernelLoader", "register", "registered", "get_loader", "lookup",
           "use_kernels_dir",
           "nvrtc_options", "header_fingerprint", "configure_cache_dir", "KERNELS_DIR",
           "BASE_OPTIONS"]

_KD = env_value(SEAM_KERNELS_DIR)  # the seam's default is the placeholder "<repo>/kernels_cu"
KERNELS_DIR = os.path.join(REPO_ROOT, "kernels_cu") if _KD == SEAM_KERNELS_DIR.default else _KD
BASE_OPTIONS = ("-std=c++17", "-arch=sm_90a")
_HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc")
_STEM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# stem -> name expressions in registration order (deduplicated)
_REGISTRY: dict[str, tuple[str, ...]] = {}
_CLUSTER: set[tuple[str, str]] = set()   # (stem, name) launched as clusters (register(cluster=))


class KernelCompileError(RuntimeError):
    """NVRTC could not compile (or load) a kernels_cu module."""


def register(stem: str, name_expressions=(), *, cluster=()) -> None:
    """Declare that ``kernels_cu/<stem>.cu`` must provide ``name_expressions``.  ``cluster``:
    those of them launched as thread-block clusters (``get`` hands them out wrapped, so a call
    takes ``cluster=``: gpu/pdl.py ExKernel / PdlKernel)."""
    if not isinstance(stem, str) or not _STEM.match(stem):
        raise ValueError(f"kernel module stem {stem!r} must be a C identifier (the .cu file name "
                         f"without extension)")
    if isinstance(name_expressions, str):
        name_expressions = (name_expressions,)
    names = list(_REGISTRY.get(stem, ()))
    for n in name_expressions:
        if not isinstance(n, str) or not n.strip():
            raise ValueError(f"{stem}.cu: name expression {n!r} is not a non-empty string")
        if n not in names:
            names.append(n)
    if _REGISTRY.get(stem) != tuple(names):
        _REGISTRY[stem] = tuple(names)
    for n in ((cluster,) if isinstance(cluster, str) else cluster):
        if n not in names:
            raise ValueError(f"{stem}.cu: cluster kernel {n!r} is not among its name expressions")
        _CLUSTER.add((stem, n))


def registered() -> dict[str, tuple[str, ...]]:
    return dict(_REGISTRY)


def header_fingerprint(kernels_dir: str) -> str:
    """sha256 (16 hex) over every header under ``kernels_dir``: path and content."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(kernels_dir):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(_HEADER_SUFFIXES):
                path = os.path.join(root, f)
                h.update(os.path.relpath(path, kernels_dir).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read())
                h.update(b"\0")
    return h.hexdigest()[:16]


def nvrtc_options(kernels_dir: str, trace_module: int | None = None) -> tuple[str, ...]:
    """The NVRTC options of a module; ``trace_module`` (the module's number,
    profiling.device_trace.module_index) adds the device-timeline build's defines."""
    kernels_dir = os.path.abspath(kernels_dir)
    opts = BASE_OPTIONS + (f"-I{kernels_dir}",
                           f"-DMEMRA_DSV4_HEADERS=0x{header_fingerprint(kernels_dir)}")
    if trace_module is not None:
        opts += ("-DMEMRA_TRACE", f"-DMEMRA_TRACE_MODULE={int(trace_module)}")
    return opts


def configure_cache_dir() -> str:
    """Make CuPy's kernel cache live in ``CUPY_CACHE_DIR`` (set by ``memra_dsv4.gpu``)."""
    path = os.environ.setdefault("CUPY_CACHE_DIR", default_cache_dir())
    compiler = sys.modules.get("cupy.cuda.compiler")
    backend = getattr(compiler, "_kernel_cache_backend", None)
    current = getattr(backend, "_cache_dir", None)
    if current is not None and os.path.abspath(current) != os.path.abspath(path):
        # CuPy was imported before CUPY_CACHE_DIR was set and froze its default directory.
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend

        compiler._set_kernel_cache_backend(DiskKernelCacheBackend(path))
    os.makedirs(path, exist_ok=True)
    return path


_TRACE_ANNOUNCED = False


def _announce_trace() -> None:
    global _TRACE_ANNOUNCED
    if not _TRACE_ANNOUNCED:
        print("memra_dsv4: device trace build = on (every CTA stamps %globaltimer: "
              "profiling.device_trace; not the production binary)", file=sys.stderr)
        _TRACE_ANNOUNCED = True


def _debug() -> bool:
    from memra_dsv4.gpu import runtime

    return runtime.DEBUG


class KernelLoader:
    """Compiled kernels_cu modules and their cached RawKernels for one device."""

    def __init__(self, device_id: int, kernels_dir: str | None = None,
                 trace: bool | None = None) -> None:
        self.device_id = int(device_id)
        self.kernels_dir = os.path.abspath(kernels_dir or KERNELS_DIR)
        if not os.path.isdir(self.kernels_dir):
            raise FileNotFoundError(f"kernels directory {self.kernels_dir} does not exist")
        # the device-timeline build (profiling.device_trace): argument > MEMRA_DSV4_DEVICE_TRACE
        self.trace = (resolve(SEAM_DEVICE_TRACE, None if trace is None else
                              ("on" if trace else "off")) == "on")
        if self.trace:
            _announce_trace()
        self.cache_dir = configure_cache_dir()
        self._modules: dict[str, tuple[tuple[str, ...], object]] = {}  # stem -> (names, RawModule)
        self._kernels: dict[tuple[str, str], object] = {}
        self._pdl: dict[tuple[str, str], object] = {}    # PdlKernel wrappers (gpu/pdl.py)
        self._ex: dict[tuple[str, str], object] = {}     # ExKernel wrappers of cluster kernels
        self.compile_ms: dict[str, float] = {}

    register = staticmethod(register)

    def source_path(self, stem: str) -> str:
        return os.path.join(self.kernels_dir, f"{stem}.cu")

    # ------------------------------------------------------------------ building
    def _build(self, stem: str) -> object:
        import cupy

        names = _REGISTRY.get(stem)
        if names is None:
            raise KeyError(f"kernel module {stem!r} is not registered; the op wrapper must call "
                           f"memra_dsv4.gpu.kernel_loader.register({stem!r}, [...]) at import")
        built = self._modules.get(stem)
        if built is not None and built[0] == names:
            return built[1]
        if built is not None and _debug():
            print(f"memra_dsv4: recompiling {stem}.cu after warmup: new name expressions "
                  f"{sorted(set(names) - set(built[0]))}", file=sys.stderr)
        path = self.source_path(stem)
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError as e:
            raise KernelCompileError(f"{path}: cannot read kernel source ({e})") from None
        trace_module = None
        if self.trace:
            from memra_dsv4.profiling.device_trace import module_index
            trace_module = module_index(stem, self.kernels_dir)
        options = nvrtc_options(self.kernels_dir, trace_module)
        t0 = time.perf_counter()
        try:
            with cupy.cuda.Device(self.device_id):
                module = cupy.RawModule(code=source, options=options,
                                        name_expressions=list(names) if names else None)
                module.compile()
                kernels = {n: module.get_function(n) for n in names}
        except Exception as e:  # NVRTC CompileException, NVRTCError, CUDADriverError on load
            log = e.get_message() if hasattr(e, "get_message") else str(e)
            raise KernelCompileError(
                f"{path}: NVRTC compile/load failed on device {self.device_id} "
                f"({type(e).__name__}); options {' '.join(options)}; name expressions "
                f"{list(names)}\n--- NVRTC log (line numbers refer to {os.path.basename(path)}) ---\n"
                f"{log}") from e
        ms = (time.perf_counter() - t0) * 1e3
        self.compile_ms[stem] = ms
        self._modules[stem] = (names, module)
        for n, k in kernels.items():
            self._kernels[(stem, n)] = k
        _LOOKUP.clear()   # get() now returns this module's kernels for the stem's names
        if _debug():
            print(f"memra_dsv4: {stem}.cu ready on device {self.device_id} in {ms:.1f} ms "
                  f"({len(names)} kernels)", file=sys.stderr)
        return module

    def warm_all(self, stems=None) -> dict[str, float]:
        """Compile (or load from the disk cache) every registered module (or just ``stems``)
        not built yet or whose registered names changed; return ms of each latest build."""
        todo = sorted(_REGISTRY) if stems is None else list(stems)
        for stem in todo:
            self._build(stem)
        return {stem: self.compile_ms[stem] for stem in todo}

    def module(self, stem: str):
        return self._build(stem)

    def get(self, stem: str, name: str):
        """The RawKernel ``name`` of ``kernels_cu/<stem>.cu`` (cached, built at warmup)."""
        if pdl.pdl_active():   # the device step's launches (gpu/pdl.py): same kernel, PDL launch
            w = self._pdl.get((stem, name))
            if w is None:
                w = self._pdl[(stem, name)] = pdl.PdlKernel(self.get_plain(stem, name),
                                                            f"{stem}.{name}")
            return w
        if (stem, name) in _CLUSTER:   # a cluster launch needs cuLaunchKernelEx (gpu/pdl.py ExKernel)
            w = self._ex.get((stem, name))
            if w is None:
                w = self._ex[(stem, name)] = pdl.ExKernel(self.get_plain(stem, name), f"{stem}.{name}")
            return w
        return self.get_plain(stem, name)

    def get_plain(self, stem: str, name: str):
        """``get`` without the PDL context: always the cached ``cupy.RawKernel``."""
        k = self._kernels.get((stem, name))
        if k is not None:
            return k  # a kernel stays valid when its stem is rebuilt for new names
        names = _REGISTRY.get(stem, ())
        if name not in names:
            raise KeyError(f"kernel {name!r} of {stem}.cu is not registered (registered: "
                           f"{list(names)}); add it to the module's register({stem!r}, ...) call")
        self._build(stem)
        return self._kernels[(stem, name)]


# device -> its loader of KERNELS_DIR; (device, dir) -> a loader of another tree (use_kernels_dir)
_LOADERS: dict = {}
_GET = KernelLoader.get   # lookup() memoises only while KernelLoader.get is this function
# (device, stem, name, PDL context, other tree) -> what get_loader(device).get(stem, name) returned
_LOOKUP: dict[tuple, object] = {}
_OTHER_DIR: str | None = None   # use_kernels_dir's tree; None: KERNELS_DIR (the seam's)


def use_kernels_dir(path: str | None) -> None:
    """Route get_loader / lookup (and so every op's launches) to a loader of the kernels tree at
    ``path`` from now on, in this process; None routes them back to KERNELS_DIR.  For in-process
    A/B measurement of two kernel trees only (bench.decode_step's ``kernels=base`` arm with
    ``--base-kernels DIR``; each arm captures its own graphs, which keep the kernels of the tree
    that was routed at capture).  Not a seam: the kernel tree of a run is MEMRA_DSV4_KERNELS_DIR,
    read once at import.  FileNotFoundError when ``path`` is not a directory."""
    global _OTHER_DIR
    if path is not None:
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"use_kernels_dir: {path} is not a directory")
        if path == os.path.abspath(KERNELS_DIR):
            path = None
    _OTHER_DIR = path


def get_loader(device_id: int) -> KernelLoader:
    """The process-wide loader of ``device_id`` (ops share it so modules compile once), of
    KERNELS_DIR or of the tree use_kernels_dir routed to."""
    key = int(device_id) if _OTHER_DIR is None else (int(device_id), _OTHER_DIR)
    loader = _LOADERS.get(key)
    if loader is None:
        loader = _LOADERS[key] = KernelLoader(device_id, kernels_dir=_OTHER_DIR)
        _LOOKUP.clear()
    return loader


def lookup(device_id: int, stem: str, name: str):
    """``get_loader(device_id).get(stem, name)``, memoised (module doc): the same object, a hit
    costing one dict lookup instead of the loader's ~6 calls and an import statement."""
    key = (device_id, stem, name, pdl.pdl_active(), _OTHER_DIR)
    k = _LOOKUP.get(key)
    if k is None or KernelLoader.get is not _GET:
        k = get_loader(device_id).get(stem, name)
        if KernelLoader.get is _GET:   # a replaced get (launch recording) is asked every time
            _LOOKUP[key] = k
    return k
