"""Programmatic dependent launch (PDL) for the device step's kernels.

Contract
--------
* ``pdl_launches(True)`` is a context manager: while it is active, ``KernelLoader.get`` hands
  out a ``PdlKernel`` in place of the cached ``cupy.RawKernel``.  A ``PdlKernel`` launches
  through ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
  so the kernel may be scheduled while the previous kernel of its stream is still running.
  Outside the context (prefill, legacy decode, unit tests) every launch is a plain CuPy launch.
* Correctness rests on the device side: every ``__global__`` function in kernels_cu opens with
  ``PDL_ENTRY();`` (common.cuh: ``griddepcontrol.wait`` then ``griddepcontrol.launch_dependents``).
  The wait returns only once the grid this launch depends on has completed and its writes are
  visible, and it is a no-op for a launch without the attribute, so a kernel behaves the same
  either way; only its start overlaps the predecessor's tail.  tests/test_kernels_pdl.py checks
  the source rule on the CPU (every kernel, including macro-generated ones).
* Why the trigger right after the wait: the next kernel is scheduled once every CTA of this one
  has executed the trigger (or exited), i.e. once this grid is fully resident; its CTAs then park
  at their own wait on whatever SM room is left.  That hides the ~1 us launch/drain gap between
  dependent kernels of a CUDA graph (1,309 launches per step at the time of writing).
* Arguments are marshalled as CuPy does for ``RawKernel`` (cupy/_core/raw.pyx, function.pyx
  ``_pointer``): a cupy.ndarray passes its device pointer, ``None`` a null pointer, a NumPy
  scalar (or size-1 ndarray) its bytes, a Python int an int64, a float a float64, a bool a bool.
* Graph capture: launches made while a stream captures become programmatic graph edges (CUDA >=
  12.3), the cross-stream fork / join edges included (tools/probe_graph_edges.py: 9 of 9 edges
  of a forked capture had type programmatic, port programmatic, on CUDA 13); the step's graphs
  replay them with the same overlap.
* Clusters: a kernel registered with ``kernel_loader.register(..., cluster=names)`` is handed
  out as a PdlKernel (inside the context) or an ``ExKernel`` (outside: the same launch without
  the PDL attribute); both take ``cluster=(cx, cy, cz)`` and add CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
  allowing a non-portable size (> 8, up to 16 on an H200) on the function first
  (``launch_ex``).  router_cluster_* uses it.
* Carveout: a PdlKernel launch also carries the preferred shared-memory carveout that
  ``smem_carveout()`` (MEMRA_DSV4_SMEM_CARVEOUT, read on entering the block) asks for; the
  default ``fit1h16`` sets it only on one-wave launches that use shared memory (the smallest share
  holding one CTA and 16 KB for the next kernel's CTAs), with the function's static shared memory asked of the driver once per
  function (``_func_value``).  A schedule attribute: the same bytes.
* The seam ``MEMRA_DSV4_PDL`` (``on``/``off``, ``Dsv4Gpu.load(pdl=)``) decides whether the device
  step enters the context; the bench can A/B it in one process (arm setting ``pdl=on|off``).
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

__all__ = ["pdl_active", "pdl_launches", "PdlKernel", "marshal_args", "smem_carveout", "launch_ex",
           "ExKernel", "FIT1", "FIT1H", "FITOCC", "DRIVER", "SMEM_CARVEOUT_DEFAULT", "fit1_carveout",
           "fitocc_carveout"]

_ACTIVE = False
_CARVE = None   # smem_carveout() of the active pdl_launches block (read on entering it): int, FIT1, "fit1h<K>", FITOCC or None
_HEADROOM = None   # _fit1h_headroom(_CARVE), parsed on entering the block, not at every launch


SMEM_CARVEOUT_ENV = "MEMRA_DSV4_SMEM_CARVEOUT"


FIT1 = "fit1"       # smem_carveout's per-launch form: fit1_carveout
FITOCC = "fitocc"   # smem_carveout's per-launch form for every grid: fitocc_carveout
FIT1H = "fit1h"     # smem_carveout's "fit1h<K>": fit1 with K KB of headroom (fit1_carveout's headroom)


def _fit1h_headroom(carve) -> int | None:
    """The headroom in bytes of a "fit1h<K>" value of smem_carveout(), else None."""
    if isinstance(carve, str) and carve.startswith(FIT1H):
        return int(carve[len(FIT1H):]) * 1024
    return None


def fitocc_carveout(n_ctas: int, dynamic_smem: int, static_smem: int, max_blocks_per_sm: int, *,
                    sm_count: int, smem_per_sm: int, reserved_per_block: int, headroom: int = 0) -> int | None:
    """The carveout preference (percent of ``smem_per_sm``, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_
    PER_MULTIPROCESSOR) of a launch under MEMRA_DSV4_SMEM_CARVEOUT=fitocc: None (no preference, the
    driver's choice) for a launch that uses no shared memory; else the smallest percentage whose
    share holds the CTAs one SM must hold at once, min(max_blocks_per_sm, ceil(n_ctas /
    sm_count)) of them (at least 1), each its dynamic + static shared memory + the per-block
    reservation (CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK), rounded up (the driver
    rounds the preference up to a supported configuration; never below what the kernel needs).
    ``max_blocks_per_sm``: the occupancy the driver computes for the launch with all of the
    shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor), so a many-wave grid keeps its
    occupancy and gives up only the shared memory it can never use.  ``headroom``: bytes added to
    that share (fit1hK: room for the next kernel's CTAs, see fit1_carveout)."""
    n_ctas, dyn, static, occ = int(n_ctas), int(dynamic_smem), int(static_smem), int(max_blocks_per_sm)
    assert n_ctas >= 1 and dyn >= 0 and static >= 0 and occ >= 0 and headroom >= 0, (n_ctas, dyn, static, occ, headroom)
    assert sm_count >= 1 and smem_per_sm >= 1 and reserved_per_block >= 0, (sm_count, smem_per_sm)
    if dyn + static == 0:
        return None
    blocks = max(1, min(occ, -(-n_ctas // sm_count)))
    need = blocks * (dyn + static + reserved_per_block) + int(headroom)
    return min(100, max(1, -(-100 * need // smem_per_sm)))


def fit1_carveout(n_ctas: int, dynamic_smem: int, static_smem: int, *, sm_count: int,
                  smem_per_sm: int, reserved_per_block: int, headroom: int = 0) -> int | None:
    """The carveout preference of a launch under MEMRA_DSV4_SMEM_CARVEOUT=fit1: None (no
    preference, the driver's choice) for a launch that uses no shared memory or has more CTAs
    than SMs (a many-wave grid keeps the configuration the driver sizes for it); else
    fitocc_carveout's one-CTA share: the smallest percentage holding one CTA's dynamic + static
    shared memory + the per-block reservation, rounded up.
    ``headroom`` (fit1hK: K KB): bytes added to that share for the next kernel's CTAs.  Under PDL
    they become resident beside this CTA on the configuration it chose, and each needs the
    per-block reservation (1 KB) plus its static shared memory; fit1 on the hc boundary's 57 KB
    CTA leaves 6 KB of its 64 KB configuration (sm_90's table), room for 6 of them.  tools/carveout_probe.py
    (thirty-third session, H100) timed exactly that case slower than no preference (a 57 KB hold
    then a 1024 x 128-thread 64 MB stream: +0.3 us at 64 CTAs, +1.6 to +2.8 us at 128-132 CTAs,
    per 24 us link) while 32 / 41 KB (22-31 KB left) gained 0.4 us at 64 CTAs."""
    if int(n_ctas) > sm_count:
        return None
    return fitocc_carveout(n_ctas, dynamic_smem, static_smem, 1, sm_count=sm_count, smem_per_sm=smem_per_sm,
                           reserved_per_block=reserved_per_block, headroom=headroom)


_DEVICE_SMEM: dict[int, tuple[int, int, int]] = {}   # device -> (SMs, smem per SM, reserved per block)


def _device_smem() -> tuple[int, int, int]:
    """(SMs, shared memory per SM, per-block reservation) of the current device, read once."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    info = _DEVICE_SMEM.get(dev)
    if info is None:
        get = cupy.cuda.runtime.deviceGetAttribute
        # cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
        # cudaDevAttrReservedSharedMemoryPerBlock = 111 (driver_types.h; 1 KB on sm_80 / sm_90)
        info = _DEVICE_SMEM[dev] = (int(get(16, dev)), int(get(81, dev)), int(get(111, dev)))
    return info


def _fit1_for(static_smem: int, shared_mem: int, n_ctas: int, headroom: int = 0) -> int | None:
    """fit1_carveout of one launch on the current device, given the function's static shared
    memory (launch_ex asks the driver once per function, _func_value, whose entries serve only
    their own RawKernel, so no value outlives a rebuilt module) and its dynamic shared memory and
    CTA count; the device's SM count, shared memory per SM and per-block reservation are read once
    per device."""
    sms, per_sm, reserved = _device_smem()
    return fit1_carveout(n_ctas, shared_mem, static_smem, sm_count=sms, smem_per_sm=per_sm,
                         reserved_per_block=reserved, headroom=headroom)


def _fitocc_for(static_smem: int, shared_mem: int, n_ctas: int, max_blocks_per_sm: int) -> int | None:
    """fitocc_carveout of one launch on the current device (static shared memory and occupancy
    from the driver through launch_ex's _func_value, once per function)."""
    sms, per_sm, reserved = _device_smem()
    return fitocc_carveout(n_ctas, shared_mem, static_smem, max_blocks_per_sm, sm_count=sms,
                           smem_per_sm=per_sm, reserved_per_block=reserved)


_FUNC_VALUES: dict[tuple, tuple[object, int]] = {}   # (CUfunction handle, what...) -> (its RawKernel, value)


def _func_value(raw_kernel, key: tuple, compute) -> int:
    """A per-function driver value (static shared memory, occupancy) that launch_ex needs for the
    fit1 / fitocc carveouts, computed once per function: the carveout is read at every PDL launch
    (graph capture, and every eager step's ~900 launches), so a driver query per launch would be
    host time on the eager paths.  The entry keeps the RawKernel whose function it describes and
    is used only for that same object, so a rebuilt module's function (a new RawKernel) never
    inherits a freed one's value through a reused handle (the id-keyed caches' rule,
    tests/test_id_keyed_caches_cpu.py).  An occupancy of 0 (the function's shared-memory limit not
    raised yet) is not kept."""
    ent = _FUNC_VALUES.get(key)
    if ent is not None and ent[0] is raw_kernel:
        return ent[1]
    v = int(compute())
    if v > 0 or key[1] == "static":
        _FUNC_VALUES[key] = (raw_kernel, v)
    return v


SMEM_CARVEOUT_DEFAULT = "fit1h16"   # since the thirty-third session (fit1 in the thirty-second; smem_carveout)
DRIVER = "driver"              # smem_carveout's value for no carveout attribute at all


def smem_carveout() -> int | str | None:
    """MEMRA_DSV4_SMEM_CARVEOUT, read when a pdl_launches(True) block is entered (the device step
    enters one per step, so also at graph capture) and given to its PdlKernel launches.  Values:
    unset or "default": SMEM_CARVEOUT_DEFAULT ("fit1h16" since the thirty-third session, "fit1"
    in the thirty-second: bench arms named carve=default there meant fit1);
    "driver" (DRIVER, returned as None): no carveout attribute, the driver picks each kernel's
    L1 / shared split from its own needs (the default before; bench arms named carve=default
    before that session meant this); "max": 100; "maxl1": 0; an integer 0..100: that percentage
    of the maximum shared memory on every PDL launch, passed as the launch's
    CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; "fit1" (FIT1): per launch, only a launch
    that uses shared memory and has no more CTAs than the device has SMs gets a preference, the
    smallest carveout that holds one of its CTAs (fit1_carveout); every other launch none;
    "fit1hK" (K = 1..228, returned as "fit1h<K>"): fit1 with K KB more in the share, room for the
    next kernel's CTAs to become resident beside the one-wave CTA under PDL (fit1_carveout's
    headroom); fit1h16 the default;
    "fitocc" (FITOCC): every launch that uses shared memory, any grid, the smallest carveout
    holding the CTAs one SM must hold at once at its occupancy (fitocc_carveout; a one-wave
    launch: fit1's share).
    Why fit1: an SM runs CTAs of one carveout configuration at a time, and under PDL the SMs that
    held a one-wave latency-bound kernel with shared memory (the hc boundary's 57 KB, the
    attention's 32-64 KB, the combine's staged partials) never idle, so the driver's choice for
    it (the largest shared share, for an occupancy those grids never use) stays on them while the
    next kernels run, with little L1 left for the streaming GEMVs' loads in flight.  The
    thirty-first session's trace (H100) had wo_a and wo_b each ~1.5 us slower after the 52 CTAs
    of 64 KB of the 16-head attention; with fit1 (thirty-second session, H100, 20 layers) the
    CSA layer's combine ran 6.3 -> 4.9 us and its wo_a / wo_b 22.9 / 22.7 -> 22.4 / 21.4 us, and at
    full depth the device-fed step 8.06-8.08 -> 7.97-7.98 ms at 1K in three processes and
    7.98-7.99 -> 7.89 in a fourth (both orders), and 8.49 -> 8.33 ms at 32K.  The thirty-third
    session's probe (tools/carveout_probe.py, H100: a one-wave hold with shared memory, then a
    64 MB stream, under PDL) saw the L1 effect only in part: a 64-CTA hold of 32 / 41 KB slowed
    the link 0.4-0.6 us without a preference and not with fit1, but 128-132 CTAs showed none.  It
    also found fit1's own loss: a 57 KB hold (the hc boundary's CTA) under fit1 lands on the 64 KB
    configuration with 6 KB left, room for only 6 of the stream's CTAs (1 KB reserved each)
    beside it (inferred, not observed): +0.3 us at 64 CTAs, +1.6-2.8 us at 128-132, per 24 us link.  Why
    fit1h16: 16 KB of headroom removed that loss in the probe and kept fit1's gains (no case
    slower than fit1 by more than 0.03 us); at full depth it measured level or ahead of fit1 in
    four in-process A/Bs (1K 7.98 / 7.99, 7.96 / 7.97, 7.95 / 7.97 ms; 32K 8.34 / 8.34), fit1h32
    and fit1h8 level.  One preference on every launch is
    slower (max +5 %, maxl1 +2.8 %, 50 +1.5 %: it also cuts the occupancy of the many-wave kernels
    that use shared memory); fitocc measured level with fit1 (7.97-7.98 ms; 32K 8.31).  Schedule
    only: the same bytes.  Not a seam (bench arm carve=)."""
    import os
    v = os.environ.get(SMEM_CARVEOUT_ENV, "").strip().lower()
    if v in ("", "default"):
        v = SMEM_CARVEOUT_DEFAULT
    if v == DRIVER:
        return None
    if v in (FIT1, FITOCC):
        return v
    if v.startswith(FIT1H):
        kb = v[len(FIT1H):]
        if not (kb.isdigit() and 1 <= int(kb) <= 228):
            raise ValueError(f"{SMEM_CARVEOUT_ENV}={v!r}: fit1hK takes K, the headroom in KB, 1..228")
        return f"{FIT1H}{int(kb)}"
    if v == "max":
        return 100
    if v == "maxl1":
        return 0
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 100:
        raise ValueError(f"{SMEM_CARVEOUT_ENV}={v!r}: expected default, driver, max, maxl1, fit1, fit1hK, fitocc "
                         f"or a percentage 0..100")
    return n


def pdl_active() -> bool:
    return _ACTIVE


@contextlib.contextmanager
def pdl_launches(enabled: bool = True):
    """Kernels looked up (KernelLoader.get) inside the block launch with the PDL attribute."""
    global _ACTIVE, _CARVE, _HEADROOM
    was, carve_was, headroom_was = _ACTIVE, _CARVE, _HEADROOM
    _ACTIVE = bool(enabled)
    if _ACTIVE:   # the carveout of this block's launches: read once here, not at every launch
        _CARVE = smem_carveout()
        _HEADROOM = _fit1h_headroom(_CARVE)
    try:
        yield
    finally:
        _ACTIVE, _CARVE, _HEADROOM = was, carve_was, headroom_was


def marshal_args(args) -> tuple[list, "ctypes.Array"]:
    """(keep-alive list, void*[n]) for cuLaunchKernelEx, with CuPy's RawKernel conventions."""
    try:
        from cupy import ndarray as device_array
    except ImportError:           # CPU machines: only host scalars can be marshalled (tests)
        device_array = ()
    keep, ptrs = [], []
    for i, a in enumerate(args):
        if device_array and isinstance(a, device_array):
            v = np.array(a.data.ptr, dtype=np.uint64)
        elif a is None:
            v = np.zeros((), dtype=np.uint64)
        elif isinstance(a, np.ndarray):
            if a.size != 1:
                raise TypeError(f"kernel argument {i}: a NumPy array of size {a.size} (only "
                                f"size-1 arrays pass by value; device data must be cupy arrays)")
            v = np.ascontiguousarray(a).reshape(())
        elif isinstance(a, np.generic):
            v = np.array(a)
        elif isinstance(a, bool):
            v = np.array(a, dtype=np.bool_)
        elif isinstance(a, int):
            v = np.array(a, dtype=np.int64)
        elif isinstance(a, float):
            v = np.array(a, dtype=np.float64)
        else:
            raise TypeError(f"kernel argument {i}: unsupported type {type(a).__name__}")
        keep.append(v)
        ptrs.append(v.ctypes.data)
    arr = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
    keep.append(arr)
    return keep, arr


def _dim3(d) -> tuple[int, int, int]:
    t = tuple(int(x) for x in (d if isinstance(d, tuple) else (d,)))
    assert 1 <= len(t) <= 3 and all(x >= 1 for x in t), f"launch dims {d!r}"
    return t + (1,) * (3 - len(t))


_NONPORTABLE_SET: set[int] = set()   # CUfunction handles allowed a cluster of more than 8 CTAs


def launch_ex(raw_kernel, name: str, grid, block, args, *, shared_mem: int = 0, stream=None,
              pdl: bool, cluster: tuple[int, int, int] | None = None) -> None:
    """One launch of ``raw_kernel`` (a cupy.RawKernel) through ``cuLaunchKernelEx``: with the
    programmatic-serialisation attribute when ``pdl`` (and the active block's carveout), and with
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION when ``cluster`` is given (the grid must be a multiple
    of it; a cluster of more than 8 CTAs, non-portable, is allowed on the function first, once).
    Errors name the kernel and the launch shape."""
    gx, gy, gz = _dim3(grid)
    bx, by, bz = _dim3(block)
    if cluster is not None:   # before anything reaches the driver
        cx, cy, cz = _dim3(cluster)
        if gx % cx or gy % cy or gz % cz:
            raise ValueError(f"{name}: grid {(gx, gy, gz)} is not a multiple of the cluster {(cx, cy, cz)}")
    import cupy
    from cuda.bindings import driver as cu

    keep, params = marshal_args(args)
    s = stream if stream is not None else cupy.cuda.get_current_stream()
    func = cu.CUfunction(int(raw_kernel.kernel.ptr))   # the current device's CUfunction

    def fail(what, err):
        _, msg = cu.cuGetErrorString(err)
        raise RuntimeError(f"{what}({name}, grid {(gx, gy, gz)}, block {(bx, by, bz)}, smem {int(shared_mem)}"
                           f"{', cluster ' + str(cluster) if cluster else ''}): {err.name}: "
                           f"{msg.decode() if isinstance(msg, bytes) else msg}")

    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
    cfg.sharedMemBytes = int(shared_mem)
    cfg.hStream = cu.CUstream(int(s.ptr))
    attrs = []
    if pdl:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
        carve, headroom = _CARVE, _HEADROOM
        if carve in (FIT1, FITOCC) or headroom is not None:   # this launch's own preference, or none
            def static_smem():
                err, v = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func)
                if err != cu.CUresult.CUDA_SUCCESS:
                    fail("cuFuncGetAttribute(SHARED_SIZE_BYTES)", err)
                return int(v)
            static = _func_value(raw_kernel, (int(func), "static"), static_smem)
            if carve != FITOCC:   # fit1 / fit1hK
                carve = _fit1_for(static, int(shared_mem), gx * gy * gz, headroom or 0)
            elif static + int(shared_mem) == 0:
                carve = None
            else:   # a cluster launch (the router's one cluster) is sized for one CTA per SM
                occ = 1
                if cluster is None:
                    def occupancy():
                        err, v = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, bx * by * bz, int(shared_mem))
                        if err != cu.CUresult.CUDA_SUCCESS:
                            fail("cuOccupancyMaxActiveBlocksPerMultiprocessor", err)
                        return int(v)
                    occ = _func_value(raw_kernel, (int(func), "occ", bx * by * bz, int(shared_mem)), occupancy)
                carve = _fitocc_for(static, int(shared_mem), gx * gy * gz, occ)
        if carve is not None:   # captured into the graph node with the launch
            ca = cu.CUlaunchAttribute()
            ca.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            ca.value.sharedMemCarveout = carve
            attrs.append(ca)
    if cluster is not None:
        if cx * cy * cz > 8 and int(func) not in _NONPORTABLE_SET:
            err, = cu.cuFuncSetAttribute(
                func, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            if err != cu.CUresult.CUDA_SUCCESS:
                fail("cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)", err)
            _NONPORTABLE_SET.add(int(func))
        ca = cu.CUlaunchAttribute()
        ca.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        ca.value.clusterDim.x, ca.value.clusterDim.y, ca.value.clusterDim.z = cx, cy, cz
        attrs.append(ca)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    err, = cu.cuLaunchKernelEx(cfg, func, ctypes.addressof(params), 0)
    del keep                                          # the driver copied the values
    if err != cu.CUresult.CUDA_SUCCESS:
        fail("cuLaunchKernelEx", err)


class ExKernel:
    """A RawKernel stand-in whose calls launch through ``launch_ex`` without PDL: what
    KernelLoader.get hands out, outside pdl_launches(True), for a kernel registered with
    ``cluster=`` (CuPy's own launch has no cluster attribute).  Its subclass PdlKernel launches
    with PDL.  Both take ``cluster=(cx, cy, cz)`` in the call.  Attribute reads and writes
    (``max_dynamic_shared_size_bytes``) go to the RawKernel."""

    __slots__ = ("_k", "_name")
    _PDL = False

    def __init__(self, raw_kernel, name: str) -> None:
        object.__setattr__(self, "_k", raw_kernel)
        object.__setattr__(self, "_name", name)

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None, cluster=None) -> None:
        launch_ex(self._k, self._name, grid, block, args, shared_mem=shared_mem, stream=stream, pdl=self._PDL,
                  cluster=cluster)

    def __getattr__(self, name):
        return getattr(self._k, name)

    def __setattr__(self, name, value):
        setattr(self._k, name, value)


class PdlKernel(ExKernel):
    """A RawKernel stand-in whose calls launch with programmatic stream serialisation (ExKernel's
    launch with the PDL attribute)."""

    __slots__ = ()
    _PDL = True
