"""Run NumPy's BLAS single-threaded inside the oracle.

The oracle's matrices are small; a multi-threaded OpenBLAS on a shared 2-core machine spends
its time spinning (measured 50x slower on [37, 512] x [512, 256]).  Single-threaded BLAS is
also one fewer source of run-to-run variation.  ``single_threaded_blas()`` sets OpenBLAS to one
thread for the duration of a call and restores the previous count; where no OpenBLAS with a
thread-control symbol is loaded it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading

_LOCK = threading.RLock()   # re-entrant: a nested call keeps one thread and restores
_API = None  # (get, set) or False


def _find_api():
    global _API
    if _API is not None:
        return _API
    _API = False
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            libs = sorted(set(re.findall(r"(/\S*openblas\S*\.so[^\s]*)", fh.read())))
    except OSError:
        return _API
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, set_ in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                          ("openblas_get_num_threads", "openblas_set_num_threads")):
            if hasattr(lib, get) and hasattr(lib, set_):
                g, s = getattr(lib, get), getattr(lib, set_)
                g.restype, s.argtypes = ctypes.c_int, [ctypes.c_int]
                _API = (g, s)
                return _API
    return _API


@contextlib.contextmanager
def single_threaded_blas():
    api = _find_api()
    if not api:
        yield
        return
    get, set_ = api
    with _LOCK:
        prev = int(get())
        set_(1)
        try:
            yield
        finally:
            set_(max(prev, 1))
