"""Shared pytest wiring: GPU tests skip cleanly where there is no usable CUDA device."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    try:
        import cupy  # noqa: F401
        if not cupy.is_available():
            return 0
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return 0


def pytest_collection_modifyitems(config, items):
    n = gpu_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (none here)")
    skip_two = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        # Everything under tests/gpu/ is a GPU test, marked or not.
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        elif "multi_gpu" in item.keywords and n < 2:
            item.add_marker(skip_two)
