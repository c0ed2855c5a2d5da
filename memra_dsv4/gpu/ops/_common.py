"""Shared plumbing of the op wrappers: kernel lookup, argument checks, launch sizes.

These run several thousand times per prefill forward (a 1K forward on the H200: ~5,300 checks,
~1,400 kernel lookups, ~4,400 int32 arguments), on the one host thread that enqueues the
pipelined prefill, so their common paths are kept short: ``cupy()`` reads ``sys.modules``
(an ``import`` statement costs ~0.4 us), ``kernel`` is one memo lookup
(``kernel_loader.lookup``), ``check`` caches its dtypes and compares an exact shape tuple in
one step; every assertion and message is the same as the long form's.
"""

from __future__ import annotations

import sys

import numpy as np

from memra_dsv4.gpu import kernel_loader

_SM_COUNT: dict[int, int] = {}
# (id(kernel), bytes) -> the kernel whose limit was raised.  The kernel is kept so its id is
# never reused by another object while the entry stands (a kernel of a rebuilt module, or a
# test's stand-in, with the id of a freed one would otherwise be taken as already raised).
_SMEM_SET: dict[tuple[int, int], object] = {}
_MODULES = sys.modules


def cupy():
    """The ``cupy`` module (whatever ``sys.modules`` holds: tests put stand-ins there)."""
    cp = _MODULES.get("cupy")
    if cp is None:   # not imported yet (or blocked with None: the import raises, as before)
        import cupy as cp
    return cp


def device_id() -> int:
    return cupy().cuda.runtime.getDevice()


def kernel(stem: str, name: str):
    """Cached RawKernel ``name`` of kernels_cu/<stem>.cu for the current device (what
    ``kernel_loader.get_loader(device).get(stem, name)`` returns, memoised)."""
    return kernel_loader.lookup(cupy().cuda.runtime.getDevice(), stem, name)


def sm_count() -> int:
    dev = device_id()
    n = _SM_COUNT.get(dev)
    if n is None:
        n = _SM_COUNT[dev] = int(cupy().cuda.Device(dev).attributes["MultiProcessorCount"])
    return n


def dynamic_smem(kern, nbytes: int) -> int:
    """Allow ``nbytes`` of dynamic shared memory for ``kern`` (once per kernel and size)."""
    key = (id(kern), int(nbytes))
    if nbytes > 48 * 1024 and _SMEM_SET.get(key) is not kern:
        kern.max_dynamic_shared_size_bytes = int(nbytes)
        _SMEM_SET[key] = kern
    return int(nbytes)


def ticket_counter(counters: dict, owner: str, size: int = 1):
    """The current device's zeroed int32 [size] ticket counters in ``counters`` (device -> array)
    of a last-CTA kernel (every launch leaves them zero).  Allocated once and never freed: a captured
    graph bakes its address, so the first call must come before any capture (DeviceStep._prewarm
    makes it); a first call inside a capture is refused, naming ``owner``.  Not for concurrent
    launches on two streams of one device."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    cnt = counters.get(dev)
    if cnt is None:
        stream = cp.cuda.get_current_stream()
        try:
            capturing = stream.is_capturing()
        except cp.cuda.runtime.CUDARuntimeError:  # the legacy stream while a blocking one captures
            capturing = True
        if capturing:
            raise RuntimeError(f"{owner}: first call on device {dev} inside a CUDA-graph "
                               f"capture; call it before capturing (DeviceStep._prewarm does)")
        cnt = counters[dev] = cp.zeros((int(size),), dtype=np.int32)
        stream.synchronize()  # zero before any launch on another (non-blocking) stream reads it
    return cnt


# np.int32 itself, not a function calling it: the same value, one Python frame less per
# argument (~4,400 a 1K forward).
i32 = np.int32


def grid_stride_blocks(total: int, threads: int = 256, per_sm: int = 8) -> int:
    """Blocks for a grid-stride loop over ``total`` items."""
    return int(max(1, min((int(total) + threads - 1) // threads, sm_count() * per_sm)))


_DTYPES: dict = {}   # check's dtype argument -> np.dtype(argument) (np.dtype() costs ~0.1 us)


def _np_dtype(dtype) -> np.dtype:
    """np.dtype(dtype), remembered for hashable arguments (type objects, dtypes, strings)."""
    d = np.dtype(dtype)
    try:
        _DTYPES[dtype] = d
    except TypeError:   # an unhashable spec (a structured dtype's list): not remembered
        pass
    return d


def check(a, name: str, dtype, shape=None, *, contiguous: bool = True, rows_strided: bool = False):
    """Assert a CuPy array's dtype, shape (None entries are wildcards) and layout.

    rows_strided: only the last axis must be contiguous (a row-strided 2-D view is allowed)."""
    assert isinstance(a, cupy().ndarray), f"{name}: expected a cupy.ndarray, got {type(a).__name__}"
    try:
        want = _DTYPES[dtype]
    except (KeyError, TypeError):   # first use of this spec, or an unhashable one
        want = _np_dtype(dtype)
    assert a.dtype == want, f"{name}: dtype {a.dtype}, expected {want}"
    # a.shape == shape (the usual exact tuple of ints) implies the wildcard test below, which
    # runs whenever it does not hold (None entries, lists, a real mismatch)
    if shape is not None and a.shape != shape:
        assert a.ndim == len(shape) and all(s is None or int(s) == d for s, d in zip(shape, a.shape)), (
            f"{name}: shape {a.shape}, expected {tuple('*' if s is None else s for s in shape)}")
    if rows_strided:
        assert a.ndim == 2 and (a.shape[1] <= 1 or a.strides[1] == a.itemsize), (
            f"{name}: the last axis must be contiguous (strides {a.strides})")
        assert a.strides[0] % a.itemsize == 0, f"{name}: row stride {a.strides[0]} not a multiple of the item size"
    elif contiguous:
        assert a.flags.c_contiguous, f"{name}: must be C-contiguous (strides {a.strides})"
    return a


def out_array(out, name: str, shape, dtype):
    """``out`` checked against (shape, dtype), or a new array when ``out`` is None."""
    if out is None:
        return cupy().empty(tuple(map(int, shape)), dtype=dtype)
    return check(out, name, dtype, tuple(shape))


def contiguous(a, dtype=None):
    """cupy.ascontiguousarray(a, dtype): ``a`` itself when it is a C-contiguous CuPy array of at
    least one dimension and of that dtype (what ascontiguousarray returns then: CuPy's
    core.ascontiguousarray), without that call's ~2 us; anything else goes through it."""
    cp = cupy()
    if isinstance(a, cp.ndarray) and a.ndim and a.flags.c_contiguous and (
            dtype is None or a.dtype == dtype):
        return a
    return cp.ascontiguousarray(a, dtype=dtype)


def row_stride(a) -> int:
    """Row stride in elements of a 2-D array whose last axis is contiguous."""
    return int(a.strides[0] // a.itemsize)


def null_or(a):
    """Pointer-sized argument for an optional array (0 = nullptr)."""
    return a if a is not None else np.uint64(0)
