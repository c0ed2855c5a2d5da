"""Devices, streams, peer access, version check, debug synchronisation, stage-boundary copy.

Contract
--------
* ``Devices(ids)`` checks the driver/runtime versions (``check_versions``), then gives each
  device one non-blocking CuPy stream for compute and one for copies (non-blocking: they never
  serialise against the legacy default stream, and capture refuses the legacy stream anyway),
  and enables peer access between every ordered pair of listed devices for which
  ``cudaDeviceCanAccessPeer`` says yes ("already enabled" is fine).  Enabled pairs are recorded
  module-wide (``peer_enabled``) so ``boundary_copy`` can pick its path.
* ``Devices.order_after_current()`` orders every compute stream after the device's *current*
  stream (an event edge).  Setup that CuPy enqueues on the current stream (a new state's zeroed
  caches, prefill's reset, the device step's arena, counters and per-state tables) calls it
  before the compute streams use those buffers; the caller may have any stream current.
* ``MEMRA_DSV4_DEBUG=1`` (the ``debug`` seam of ``memra_dsv4.seams``) is read ONCE, at import
  of this module, and announced on stderr.  With it, ``debug_sync(stream, what)``
  synchronises ``stream`` after a launch and raises ``LaunchError`` naming ``what`` when the
  device reports an error; ``checked(name)`` decorates an op so that every call is followed
  by ``debug_sync`` on its stream.  Without it ``debug_sync`` is one flag test and
  ``checked`` returns the function unchanged (no wrapper, no cost).  ``debug_sync`` is a
  no-op while the stream is capturing (synchronising would invalidate the capture).
* ``boundary_copy(dst, src, nbytes, stream)`` moves the hidden state across a pipeline stage
  boundary.  With peer access it is ONE ``cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault,
  stream)``: capturable into a CUDA graph, unlike ``cudaMemcpyPeerAsync`` (verified_on_h200.md).
  Without peer access (or ``force_bounce=True``) it bounces through a portable pinned host
  buffer: device->host on ``stream``, an event, host->device on ``dst_stream`` (default:
  ``stream``; a memcpy may be issued to a stream of another device).  A second event marks the
  bounce buffer free again, and the next bounce waits on it, so back-to-back boundary copies
  on different streams never overwrite a buffer still being read; a buffer outgrown by a
  larger copy is kept, never freed, since a captured graph may hold its address.  Both paths
  are asynchronous; the consumer orders itself after the copy with an event as usual.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

from memra_dsv4.seams import SEAM_DEBUG, env_value

__all__ = [
    "DEBUG", "LaunchError", "CudaVersionError", "check_versions", "Devices", "DeviceHandles",
    "debug_sync", "checked", "boundary_copy", "peer_enabled", "enable_peer_access",
    "advance_capture_epoch",
]


def _read_debug_flag() -> bool:
    value = env_value(SEAM_DEBUG)   # validated against the seam registry ("0" / "1")
    if value == "1":
        print("memra_dsv4: debug = 1 (every checked launch synchronises its stream)",
              file=sys.stderr)
    return value == "1"


DEBUG: bool = _read_debug_flag()

# Ordered pairs (a, b): a context on device a may access device b's memory.
_PEER: set[tuple[int, int]] = set()
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


class LaunchError(RuntimeError):
    """A device error surfaced by ``debug_sync``, naming the launch that preceded it."""


class CudaVersionError(RuntimeError):
    """The installed driver is older than the CUDA runtime CuPy was built for."""


def _fmt_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def check_versions() -> tuple[int, int]:
    """Return (driver, runtime) versions as CUDA encodes them (13020 = 13.2); raise on a mismatch.

    The runtime bundled with a cupy-cudaXYx wheel needs a driver of at least the same major
    version (minor-version compatibility covers the minor); an older driver fails later with
    cudaErrorInsufficientDriver at the first allocation, which is far less clear.
    """
    import cupy

    if not cupy.is_available():
        raise CudaVersionError("CuPy reports no usable CUDA device (cupy.is_available() is False)")
    rt = cupy.cuda.runtime
    driver, runtime_v = int(rt.driverGetVersion()), int(rt.runtimeGetVersion())
    if driver // 1000 < runtime_v // 1000:
        raise CudaVersionError(
            f"CUDA driver {_fmt_version(driver)} ({driver}) is older than the CUDA runtime "
            f"{_fmt_version(runtime_v)} ({runtime_v}) of the installed CuPy "
            f"(cupy {cupy.__version__}); install the cupy-cuda{driver // 1000}x wheel or "
            f"update the driver (CUDA 13 needs >= 580)")
    return driver, runtime_v


# ------------------------------------------------------------------------ debug sync
def debug_sync(stream, what: str) -> None:
    """Under MEMRA_DSV4_DEBUG=1: synchronise ``stream`` and raise LaunchError naming ``what``."""
    if not DEBUG:
        return
    _debug_sync(stream, what)


def _debug_sync(stream, what: str) -> None:
    import cupy

    try:
        # After a fault every runtime call (is_capturing too) returns the sticky error.
        if stream.is_capturing():
            return
        stream.synchronize()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise LaunchError(f"device error after launch {what!r} on device "
                          f"{stream.device_id}: {e}") from e


def checked(name: str) -> Callable[[Callable], Callable]:
    """Decorator: under MEMRA_DSV4_DEBUG=1 each call is followed by ``debug_sync`` on the
    stream the op launched on (its ``stream=`` keyword, else CuPy's current stream)."""

    def wrap(fn: Callable) -> Callable:
        if not DEBUG:
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):
            import cupy

            out = fn(*args, **kwargs)
            stream = kwargs.get("stream") or cupy.cuda.get_current_stream()
            _debug_sync(stream, name)
            return out

        return run

    return wrap


# ------------------------------------------------------------------------ devices
def peer_enabled(a: int, b: int) -> bool:
    """True when device ``a`` may access device ``b``'s memory (enabled by this process)."""
    return (int(a), int(b)) in _PEER


def enable_peer_access(a: int, b: int) -> bool:
    """Enable access from device ``a`` to device ``b`` if the hardware allows it."""
    import cupy

    rt = cupy.cuda.runtime
    a, b = int(a), int(b)
    if a == b or (a, b) in _PEER:
        return True
    if not rt.deviceCanAccessPeer(a, b):
        return False
    with cupy.cuda.Device(a):
        try:
            rt.deviceEnablePeerAccess(b)
        except rt.CUDARuntimeError as e:  # CuPy clears the sticky status before raising
            if e.status != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                raise
    _PEER.add((a, b))
    return True


@dataclass(frozen=True)
class DeviceHandles:
    id: int
    compute: object   # cupy.cuda.Stream, non-blocking
    copy: object      # cupy.cuda.Stream, non-blocking
    name: str
    total_bytes: int
    capability: str


class Devices:
    """The devices this process drives, their streams, and the peer-access matrix."""

    def __init__(self, ids: Iterable[int]) -> None:
        import cupy

        self.ids = tuple(int(i) for i in ids)
        if not self.ids:
            raise ValueError("Devices: no device ids given")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"Devices: repeated device id in {self.ids}")
        self.driver_version, self.runtime_version = check_versions()
        count = cupy.cuda.runtime.getDeviceCount()
        bad = [i for i in self.ids if not 0 <= i < count]
        if bad:
            raise ValueError(f"Devices: ids {bad} out of range; this process sees {count} device(s)")
        self._handles: dict[int, DeviceHandles] = {}
        self._order_events: dict[int, object] = {}   # order_after_current's events, one per device
        for d in self.ids:
            with cupy.cuda.Device(d):
                props = cupy.cuda.runtime.getDeviceProperties(d)
                name = props["name"]
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._handles[d] = DeviceHandles(
                    id=d,
                    compute=cupy.cuda.Stream(non_blocking=True),
                    copy=cupy.cuda.Stream(non_blocking=True),
                    name=name,
                    total_bytes=int(props["totalGlobalMem"]),
                    capability=f"{props['major']}.{props['minor']}",
                )
        for a in self.ids:
            for b in self.ids:
                if a != b:
                    enable_peer_access(a, b)

    def __getitem__(self, device_id: int) -> DeviceHandles:
        try:
            return self._handles[int(device_id)]
        except KeyError:
            raise KeyError(f"device {device_id} is not one of {self.ids}") from None

    def __iter__(self):
        return iter(self._handles.values())

    def __len__(self) -> int:
        return len(self.ids)

    def can_peer(self, a: int, b: int) -> bool:
        return peer_enabled(a, b)

    def synchronize(self) -> None:
        for h in self._handles.values():
            h.compute.synchronize()
            h.copy.synchronize()

    def order_after_current(self) -> None:
        """Make every device's compute stream wait (an event edge, no host wait) for the work
        already enqueued on that device's *current* CuPy stream.

        Why: CuPy enqueues array creation (``cp.zeros`` / ``cp.full``), ``fill`` and host uploads
        (``cp.asarray`` of a NumPy array: a pinned staging copy, then an async H2D) on the
        current stream, which is the legacy default stream unless the caller made another one
        current, and the compute streams are non-blocking: they never order against it.  So a
        kernel on a compute stream could run before or beside a cache zeroing or a table upload
        that the host enqueued first.  Every setup that enqueues such work and hands its
        buffers to the compute streams calls this once after it (Dsv4Gpu.new_state, prefill's
        reset, DeviceStep's workspaces and per-state tables)."""
        import cupy

        for h in self._handles.values():
            with cupy.cuda.Device(h.id):
                cur = cupy.cuda.get_current_stream()
                if cur.ptr == h.compute.ptr:
                    continue
                ev = self._order_events.get(h.id)
                if ev is None:
                    ev = self._order_events[h.id] = cupy.cuda.Event(disable_timing=True)
                ev.record(cur)
                h.compute.wait_event(ev)   # captures the event's state now: reuse is safe

    def describe(self) -> str:
        lines = [f"CUDA driver {_fmt_version(self.driver_version)}, runtime "
                 f"{_fmt_version(self.runtime_version)}"]
        for h in self._handles.values():
            peers = [b for b in self.ids if b != h.id and peer_enabled(h.id, b)]
            lines.append(f"  device {h.id}: {h.name}, sm_{h.capability.replace('.', '')}, "
                         f"{h.total_bytes / 2**30:.1f} GiB, peer access to {peers or 'none'}")
        return "\n".join(lines)


# ------------------------------------------------------------------------ boundary copy
# Capture epochs: graphs.capture() advances this, so a bounce inside a capture only waits on a
# "buffer free" event recorded in the SAME capture (waiting on an event recorded outside the
# capture, or in another graph, is illegal during stream capture).
_CAPTURE_EPOCH = 0


def advance_capture_epoch() -> int:
    global _CAPTURE_EPOCH
    _CAPTURE_EPOCH += 1
    return _CAPTURE_EPOCH


class _Bounce:
    """A portable pinned host buffer for one (src, dst) device pair, with its events."""

    def __init__(self) -> None:
        self.mem = None
        self.nbytes = 0
        self._retired: list = []  # outgrown buffers: a captured graph may still point at one
        self._events: dict[tuple[str, int], object] = {}
        self.free = None         # the event recorded after the last host->device half
        self.free_token = None   # ("eager",) or ("capture", epoch) of that record

    def ensure(self, nbytes: int) -> None:
        import cupy

        if self.mem is not None and nbytes <= self.nbytes:
            return
        if self.mem is not None:
            self._retired.append(self.mem)  # never freed: graphs captured on it stay valid
        # Portable: pinned for every context, so both devices' copies run at full speed.
        self.mem = cupy.cuda.PinnedMemory(nbytes, cupy.cuda.runtime.hostAllocPortable)
        self.nbytes = nbytes

    def event(self, role: str, device: int):
        """An event for ``role``, created on ``device``: CUDA records an event only on a stream
        of the device it was created on."""
        import cupy

        ev = self._events.get((role, device))
        if ev is None:
            with cupy.cuda.Device(device):
                ev = self._events[(role, device)] = cupy.cuda.Event(disable_timing=True)
        return ev


_BOUNCE: dict[tuple[int, int], _Bounce] = {}


def _stream_device(stream, fallback: int) -> int:
    dev = getattr(stream, "device_id", -1)
    return fallback if dev is None or dev < 0 else int(dev)


def boundary_copy(dst, src, nbytes: int, stream, *, dst_stream=None, force_bounce: bool = False) -> str:
    """Copy the first ``nbytes`` of ``src`` into ``dst`` (C-contiguous CuPy arrays, any devices).

    Returns the path taken, ``"peer"`` or ``"bounce"``, so tests and logs can check it.
    ``stream`` is a stream of the source side (it orders the copy after the producer); on the
    bounce path ``dst_stream`` (a stream of the destination device) may take the host->device
    half.  Run it once before capturing: the first bounce of a device pair allocates its
    pinned buffer and events.  Between eager use and graph replay of the bounce path, let the
    streams drain (warmup does): "buffer free" waits do not cross the capture boundary.
    """
    import cupy

    rt = cupy.cuda.runtime
    nbytes = int(nbytes)
    for label, a in (("dst", dst), ("src", src)):
        if not a.flags.c_contiguous:
            raise ValueError(f"boundary_copy: {label} is not C-contiguous (shape {a.shape}, "
                             f"strides {a.strides})")
        if nbytes > a.nbytes:
            raise ValueError(f"boundary_copy: nbytes={nbytes} exceeds {label}.nbytes={a.nbytes}")
    if nbytes == 0:
        return "peer"
    src_dev, dst_dev = src.device.id, dst.device.id
    direct = src_dev == dst_dev or (peer_enabled(src_dev, dst_dev) and peer_enabled(dst_dev, src_dev))
    if direct and not force_bounce:
        # One capturable copy; with UVA + peer access the driver routes it over NVLink.
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDefault, stream.ptr)
        return "peer"

    b = _BOUNCE.get((src_dev, dst_dev))
    if b is None:
        b = _BOUNCE[(src_dev, dst_dev)] = _Bounce()
    b.ensure(nbytes)
    out_stream = dst_stream if dst_stream is not None else stream
    in_dev, out_dev = _stream_device(stream, src_dev), _stream_device(out_stream, dst_dev)
    token = ("capture", _CAPTURE_EPOCH) if stream.is_capturing() else ("eager",)
    if b.free is not None and b.free_token == token:
        stream.wait_event(b.free)  # an earlier host->device half may still read the buffer
    rt.memcpyAsync(b.mem.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
    if out_stream is not stream:
        filled = b.event("filled", in_dev)
        filled.record(stream)
        out_stream.wait_event(filled)
    rt.memcpyAsync(dst.data.ptr, b.mem.ptr, nbytes, rt.memcpyHostToDevice, out_stream.ptr)
    b.free = b.event("free", out_dev)
    b.free.record(out_stream)
    b.free_token = token
    return "bounce"
