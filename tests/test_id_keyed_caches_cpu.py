"""CPU tests of the process-wide caches keyed by an object's id (thirtieth session: the device
step's graph cache keyed by id(state) was the cause of a recapture cliff, so every id-keyed
cache was reviewed): ops._common.dynamic_smem and ops_decode.set_l2_prefetch keep the object
they key on, so a new object can never inherit a freed one's entry through a reused id."""

from __future__ import annotations

import gc
import sys
import types


class _Kern:
    def __init__(self):
        self.sets = []

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.sets[-1] if self.sets else 48 * 1024

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):
        self.sets.append(n)


def test_dynamic_smem_raises_each_kernel_once_and_never_trusts_a_reused_id(monkeypatch):
    from memra_dsv4.gpu.ops import _common
    monkeypatch.setattr(_common, "_SMEM_SET", {})
    k = _Kern()
    assert _common.dynamic_smem(k, 64 * 1024) == 64 * 1024
    assert _common.dynamic_smem(k, 64 * 1024) == 64 * 1024
    assert k.sets == [64 * 1024]                         # once per kernel and size
    assert _common.dynamic_smem(k, 1024) == 1024 and k.sets == [64 * 1024]   # <= 48 KB: nothing
    # many short-lived kernels: CPython hands a freed object's id to the next one, and each new
    # kernel must still get its own limit raised
    for _ in range(50):
        fresh = _Kern()
        _common.dynamic_smem(fresh, 96 * 1024)
        assert fresh.sets == [96 * 1024]
        del fresh
        gc.collect()


def test_set_l2_prefetch_writes_a_new_module_even_with_a_reused_id(monkeypatch):
    from memra_dsv4.gpu import ops_decode
    writes = []

    class _Mod:
        def get_global(self, name):
            assert name == ops_decode.L2_PREFETCH_SYMBOL
            return types.SimpleNamespace(ptr=id(self))

    mods = [_Mod()]
    monkeypatch.setattr(ops_decode.kernel_loader, "get_loader",
                        lambda dev: types.SimpleNamespace(module=lambda stem: mods[-1]))
    fake_cp = types.ModuleType("cupy")

    class _Dev:
        def __init__(self, d):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def memcpy(dst, src, n, kind):
        import ctypes
        writes.append((dst, ctypes.c_uint64.from_address(src).value))
    fake_cp.cuda = types.SimpleNamespace(Device=_Dev, runtime=types.SimpleNamespace(
        memcpy=memcpy, memcpyHostToDevice=1))
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(ops_decode, "_l2_prefetch_set", {})
    assert ops_decode.set_l2_prefetch(0, "8") == 8 << 20
    assert ops_decode.set_l2_prefetch(0, "8") == 8 << 20
    assert len(writes) == 1                              # a no-op when the module holds it
    for _ in range(20):                                  # rebuilt modules, ids possibly reused
        mods[-1] = _Mod()
        gc.collect()
        before = len(writes)
        ops_decode.set_l2_prefetch(0, "8")
        assert len(writes) == before + 1 and writes[-1] == (id(mods[-1]), 8 << 20)
