"""The workspace arena: every device buffer lives at a fixed offset of ONE allocation per device.

Contract
--------
* ``ArenaPlan`` is pure CPU bookkeeping (no CuPy).  ``add(name, shape, dtype, align=256)``
  appends a slot at the next offset that is a multiple of ``align``; offsets depend only on the
  sequence of ``add`` calls, so the same adds give the same offsets (CUDA graphs captured
  against one arena stay valid for an identical plan).  Invariants, checked by ``check()``:
  every offset is a multiple of its alignment, slots never overlap, every slot ends inside
  ``total_bytes``, names are unique.
* Dtypes are LOGICAL strings: ``bf16`` is stored as ``uint16`` (CuPy's bf16 support is
  minimal and kernels/cuBLASLt only see pointers), ``e4m3`` / ``e8m0`` / ``fp4x2`` (two packed
  e2m1 codes per byte) as ``uint8``; ``f32``, ``f16``, ``i32``, ``i64``, ``u8``, ``i8``,
  ``u16``, ``u32`` map to the obvious NumPy dtype.  The arena remembers the logical dtype of
  every slot (``Arena.logical_dtype(name)``).
* ``Arena(plan, device)`` makes exactly one ``cudaMalloc`` on ``device`` (a
  ``cupy.cuda.Memory``, outside CuPy's memory pool, freed when the arena is collected) and
  builds one ``cupy.ndarray`` view per slot up front.  After construction nothing allocates
  device memory: ``view(name)`` returns the prebuilt view, ``ptr(name)`` its address.
  Addresses are stable for the arena's lifetime, which is what graph capture needs.
* ``count_allocations()`` counts requests to CuPy's default memory pool on this thread (via a
  ``cupy.cuda.MemoryHook``), for the zero-allocation tests of the decode loop.  It cannot see
  ``MemoryAsyncPool`` (CuPy does not run hooks there) nor raw ``runtime.malloc`` calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

__all__ = ["LOGICAL_DTYPES", "Slot", "ArenaPlan", "Arena", "ArenaError", "AllocationCounter",
           "count_allocations", "storage_dtype", "round_up"]

# logical dtype -> NumPy storage dtype.  FP8/FP4 have no NumPy/CuPy dtype: bytes.
LOGICAL_DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype(np.uint16),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "u16": np.dtype(np.uint16),
    "i32": np.dtype(np.int32),
    "u32": np.dtype(np.uint32),
    "i64": np.dtype(np.int64),
    "e4m3": np.dtype(np.uint8),
    "e8m0": np.dtype(np.uint8),
    "fp4x2": np.dtype(np.uint8),
}

DEFAULT_ALIGN = 256  # cudaMalloc's guarantee; enough for 128-bit vector loads and cuBLASLt


class ArenaError(ValueError):
    """A malformed slot (bad name, shape, dtype or alignment) or a broken arena invariant."""


def storage_dtype(logical: str) -> np.dtype:
    try:
        return LOGICAL_DTYPES[logical]
    except KeyError:
        raise ArenaError(f"unknown logical dtype {logical!r}; known: "
                         f"{', '.join(LOGICAL_DTYPES)}") from None


def round_up(x: int, align: int) -> int:
    return -(-x // align) * align


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: str          # logical dtype string
    offset: int         # bytes from the arena base
    align: int

    @property
    def storage(self) -> np.dtype:
        return LOGICAL_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.storage.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class ArenaPlan:
    """Offsets of named buffers inside one allocation (CPU only)."""

    def __init__(self, name: str = "arena") -> None:
        self.name = name
        self._slots: dict[str, Slot] = {}
        self._cursor = 0
        self._max_align = DEFAULT_ALIGN

    def add(self, name: str, shape, dtype: str, align: int = DEFAULT_ALIGN) -> Slot:
        if not isinstance(name, str) or not name:
            raise ArenaError(f"{self.name}: slot name must be a non-empty string, got {name!r}")
        if name in self._slots:
            raise ArenaError(f"{self.name}: slot {name!r} added twice")
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise ArenaError(f"{self.name}: slot {name!r}: shape {shape!r} is not a tuple of ints") from None
        if any(s < 0 for s in shape):
            raise ArenaError(f"{self.name}: slot {name!r}: negative dimension in shape {shape}")
        st = storage_dtype(dtype)
        if align <= 0 or align & (align - 1):
            raise ArenaError(f"{self.name}: slot {name!r}: align={align} is not a power of two")
        if align < st.itemsize:
            raise ArenaError(f"{self.name}: slot {name!r}: align={align} below the itemsize "
                             f"{st.itemsize} of {dtype}")
        offset = round_up(self._cursor, align)
        slot = Slot(name, shape, dtype, offset, align)
        self._slots[name] = slot
        self._cursor = slot.end
        self._max_align = max(self._max_align, align)
        return slot

    # ------------------------------------------------------------------ queries
    @property
    def total_bytes(self) -> int:
        """Bytes the allocation needs: the last slot's end, rounded to the largest alignment."""
        return round_up(self._cursor, self._max_align)

    @property
    def max_align(self) -> int:
        return self._max_align

    def slot(self, name: str) -> Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"{self.name}: no slot {name!r} ({len(self._slots)} slots)") from None

    def offset(self, name: str) -> int:
        return self.slot(name).offset

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def fingerprint(self) -> str:
        """Hash of (name, shape, dtype, offset) of every slot: equal plans, equal addresses."""
        h = hashlib.sha256()
        for s in self._slots.values():
            h.update(f"{s.name}|{s.shape}|{s.dtype}|{s.offset};".encode())
        return h.hexdigest()[:16]

    def check(self) -> None:
        """Raise ArenaError if any invariant is broken (alignment, overlap, bounds)."""
        total = self.total_bytes
        ordered = sorted(self._slots.values(), key=lambda s: (s.offset, s.end))
        prev: Slot | None = None
        for s in ordered:
            if s.offset % s.align:
                raise ArenaError(f"{self.name}: slot {s.name!r} offset {s.offset} is not a "
                                 f"multiple of its align {s.align}")
            if s.end > total:
                raise ArenaError(f"{self.name}: slot {s.name!r} ends at {s.end} beyond "
                                 f"total_bytes {total}")
            if prev is not None and s.nbytes and prev.nbytes and s.offset < prev.end:
                raise ArenaError(f"{self.name}: slots {prev.name!r} [{prev.offset}, {prev.end}) "
                                 f"and {s.name!r} [{s.offset}, {s.end}) overlap")
            if s.nbytes:
                prev = s

    def summary(self, top: int = 12) -> str:
        """The largest slots and the total, for logs."""
        rows = sorted(self._slots.values(), key=lambda s: -s.nbytes)[:top]
        lines = [f"{self.name}: {len(self._slots)} slots, {self.total_bytes / 2**20:.1f} MiB"]
        for s in rows:
            lines.append(f"  {s.name:<40} {s.dtype:<5} {str(s.shape):<24} "
                         f"@{s.offset:>14,}  {s.nbytes / 2**20:10.2f} MiB")
        return "\n".join(lines)


class Arena:
    """One device allocation carved into the views an ``ArenaPlan`` describes."""

    def __init__(self, plan: ArenaPlan, device: int) -> None:
        import cupy

        plan.check()
        self.plan = plan
        self.device = int(device)
        self.nbytes = plan.total_bytes
        # cudaMalloc returns >= 256-byte aligned memory; a plan asking for more (e.g. 4 KiB
        # for TMA-friendly pages) gets the slack up front and a rounded-up base.
        slack = plan.max_align - DEFAULT_ALIGN if plan.max_align > DEFAULT_ALIGN else 0
        with cupy.cuda.Device(self.device):
            self._mem = cupy.cuda.Memory(max(self.nbytes + slack, 1))
        raw = self._mem.ptr
        self._base_offset = round_up(raw, plan.max_align) - raw
        self.base_ptr = raw + self._base_offset
        self._views: dict[str, "cupy.ndarray"] = {}
        for s in plan:
            memptr = cupy.cuda.MemoryPointer(self._mem, self._base_offset + s.offset)
            self._views[s.name] = cupy.ndarray(s.shape, dtype=s.storage, memptr=memptr)

    def view(self, name: str):
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"arena {self.plan.name!r} on device {self.device}: no slot {name!r}") from None

    def ptr(self, name: str) -> int:
        return self.base_ptr + self.plan.offset(name)

    def logical_dtype(self, name: str) -> str:
        return self.plan.slot(name).dtype

    def views(self) -> dict:
        return dict(self._views)

    def zero(self, stream=None) -> None:
        """memset the whole arena to 0 on ``stream`` (asynchronous)."""
        import cupy

        s = stream if stream is not None else cupy.cuda.get_current_stream()
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.memsetAsync(self.base_ptr, 0, self.nbytes, s.ptr)


# ------------------------------------------------------------------------ allocation counter
class AllocationCounter:
    """Result of ``count_allocations``: pool requests and real device allocations seen."""

    def __init__(self) -> None:
        self.pool_requests = 0      # malloc_preprocess: any request to CuPy's pool
        self.device_allocs = 0      # alloc_preprocess: the pool had to cudaMalloc
        self.bytes_requested = 0
        self.first: list[tuple[int, int]] = []  # (device_id, size) of the first few requests

    @property
    def total(self) -> int:
        return self.pool_requests

    def __repr__(self) -> str:
        return (f"AllocationCounter(pool_requests={self.pool_requests}, "
                f"device_allocs={self.device_allocs}, bytes={self.bytes_requested}, "
                f"first={self.first})")


@contextlib.contextmanager
def count_allocations():
    """Count CuPy memory-pool requests made on this thread inside the block.

    >>> with count_allocations() as c:
    ...     step()
    >>> assert c.total == 0, c
    """
    import cupy

    counter = AllocationCounter()

    class _Hook(cupy.cuda.MemoryHook):
        def malloc_preprocess(self, **kw):
            counter.pool_requests += 1
            counter.bytes_requested += int(kw.get("mem_size", kw.get("size", 0)))
            if len(counter.first) < 8:
                counter.first.append((int(kw.get("device_id", -1)), int(kw.get("size", 0))))

        def alloc_preprocess(self, **kw):
            counter.device_allocs += 1

    hook = _Hook()
    hook.name = f"memra_dsv4_alloc_counter_{id(hook)}"  # unique: hooks are keyed by name
    with hook:
        yield counter
