"""Shared plumbing of the op wrappers: kernel lookup, argument checks, launch sizes."""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader

_SM_COUNT: dict[int, int] = {}
_SMEM_SET: set[tuple[int, int]] = set()


def cupy():
    import cupy as cp

    return cp


def device_id() -> int:
    return cupy().cuda.runtime.getDevice()


def kernel(stem: str, name: str):
    """Cached RawKernel ``name`` of kernels_cu/<stem>.cu for the current device."""
    return kernel_loader.get_loader(device_id()).get(stem, name)


def sm_count() -> int:
    dev = device_id()
    n = _SM_COUNT.get(dev)
    if n is None:
        n = _SM_COUNT[dev] = int(cupy().cuda.Device(dev).attributes["MultiProcessorCount"])
    return n


def dynamic_smem(kern, nbytes: int) -> int:
    """Allow ``nbytes`` of dynamic shared memory for ``kern`` (once per kernel and size)."""
    key = (id(kern), int(nbytes))
    if nbytes > 48 * 1024 and key not in _SMEM_SET:
        kern.max_dynamic_shared_size_bytes = int(nbytes)
        _SMEM_SET.add(key)
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


def i32(v) -> np.int32:
    return np.int32(v)


def grid_stride_blocks(total: int, threads: int = 256, per_sm: int = 8) -> int:
    """Blocks for a grid-stride loop over ``total`` items."""
    return int(max(1, min((int(total) + threads - 1) // threads, sm_count() * per_sm)))


def check(a, name: str, dtype, shape=None, *, contiguous: bool = True, rows_strided: bool = False):
    """Assert a CuPy array's dtype, shape (None entries are wildcards) and layout.

    rows_strided: only the last axis must be contiguous (a row-strided 2-D view is allowed)."""
    cp = cupy()
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy.ndarray, got {type(a).__name__}"
    assert a.dtype == np.dtype(dtype), f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}"
    if shape is not None:
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
        return cupy().empty(tuple(int(s) for s in shape), dtype=dtype)
    return check(out, name, dtype, tuple(shape))


def row_stride(a) -> int:
    """Row stride in elements of a 2-D array whose last axis is contiguous."""
    return int(a.strides[0] // a.itemsize)


def null_or(a):
    """Pointer-sized argument for an optional array (0 = nullptr)."""
    return a if a is not None else np.uint64(0)
