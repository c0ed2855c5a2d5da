"""CUDA-graph capture and replay with CuPy, on one device or spanning a pipeline of devices.

Contract
--------
* ``capture(stream, fn) -> cupy.cuda.Graph``: makes ``stream`` (non-blocking; capture refuses
  the legacy stream) current on its device, begins a relaxed-mode capture, calls ``fn()``
  (which enqueues work: RawKernels on the current stream, ``GemmPlan.run``, ``memcpyAsync``),
  ends the capture and instantiates the graph.  If ``fn`` raises, the capture is ended and
  discarded so the stream is usable again, and the error propagates.  Python's cyclic garbage
  collector is off for the capture (a finalizer's synchronising CUDA call would invalidate it).
  Nothing inside ``fn`` may synchronise or allocate: every buffer comes from the arena (CuPy exposes no graph-exec
  update, so a graph is tied to the addresses it captured), every GEMM plan and every kernel
  is built before capture.
* ``capture(..., node_priority=True)`` instantiates with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_
  PRIORITY (cuda.bindings; CuPy instantiates with flags 0): every kernel node then runs at the
  priority of the stream it was captured on (copied at capture), not at the launch stream's, so
  side branches captured on a high-priority stream get their CTAs dispatched ahead of the
  pending CTAs of a big kernel beside them.  Returns a ``PriorityGraph`` (launch / upload as
  cupy.cuda.Graph).
* ``replay(graph, stream)`` launches it.  A graph may be replayed on any stream of the
  capturing device; it re-reads its input buffers on every replay.
* Two devices in one graph (verified_on_h200.md): capture starts on a stream of device 0;
  ``Fork(origin, *others)`` creates, BEFORE the capture, one event per branch each way;
  ``fork()`` records on the origin and makes each other stream wait (that stream joins the
  capture), ``join()`` records on each other stream and makes the origin wait; every forked
  stream must be joined before ``capture`` returns.  The copy between devices is a
  ``cudaMemcpyAsync(..., cudaMemcpyDefault)`` (``runtime.boundary_copy``);
  ``cudaMemcpyPeerAsync`` cannot be captured.
* ``GraphSet`` keeps one graph per integer bucket (decode batch sizes) on one stream, captured
  largest first, and replays the smallest bucket that holds ``n``.
"""

from __future__ import annotations

import gc
from typing import Callable

from memra_dsv4.gpu import runtime

__all__ = ["capture", "replay", "Fork", "GraphSet", "CaptureError", "PriorityGraph",
           "stream_priority_range", "priority_stream"]


class CaptureError(RuntimeError):
    """Stream capture could not start or finish."""


def _abort_capture(stream) -> None:
    import cupy

    rt = cupy.cuda.runtime
    try:
        g = rt.streamEndCapture(stream.ptr)  # ends even an invalidated capture
        if g:
            rt.graphDestroy(g)
    except rt.CUDARuntimeError:
        pass


def stream_priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority of the current device (greatest is numerically lowest;
    cudaDeviceGetStreamPriorityRange through cuda.bindings: CuPy 14 does not wrap it)."""
    from cuda.bindings import runtime as cudart
    err, least, greatest = cudart.cudaDeviceGetStreamPriorityRange()
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceGetStreamPriorityRange: {err.name}")
    return int(least), int(greatest)


_OWNED_STREAMS: list = []   # driver-created priority streams wrapped by ExternalStream (kept)


def priority_stream(priority: int):
    """A non-blocking CuPy stream of ``priority`` on the current device (cupy.cuda.Stream's
    ``priority``; where this CuPy lacks it, cuStreamCreateWithPriority wrapped as an
    ExternalStream that lives as long as the process)."""
    import cupy
    try:
        return cupy.cuda.Stream(non_blocking=True, priority=int(priority))
    except TypeError:
        from cuda.bindings import driver as cu
        err, h = cu.cuStreamCreateWithPriority(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), int(priority))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamCreateWithPriority({priority}): {err.name}") from None
        _OWNED_STREAMS.append(h)
        return cupy.cuda.ExternalStream(int(h), cupy.cuda.runtime.getDevice())


def _check(err, what: str):
    from cuda.bindings import driver as cu
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise CaptureError(f"{what}: {err.name}: {msg.decode() if isinstance(msg, bytes) else msg}")


class PriorityGraph:
    """A captured cudaGraph_t instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
    (driver API through cuda.bindings); owns both handles."""

    def __init__(self, graph_handle: int) -> None:
        from cuda.bindings import driver as cu
        self._cu = cu
        self._graph = cu.CUgraph(int(graph_handle))
        flag = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        err, self._exec = cu.cuGraphInstantiate(self._graph, int(getattr(flag, "value", flag)))
        if err != cu.CUresult.CUDA_SUCCESS:
            cu.cuGraphDestroy(self._graph)
            self._exec = None
            _check(err, "cuGraphInstantiate(USE_NODE_PRIORITY)")

    def launch(self, stream) -> None:
        err, = self._cu.cuGraphLaunch(self._exec, self._cu.CUstream(int(stream.ptr)))
        _check(err, "cuGraphLaunch")

    def upload(self, stream) -> None:
        err, = self._cu.cuGraphUpload(self._exec, self._cu.CUstream(int(stream.ptr)))
        _check(err, "cuGraphUpload")

    def __del__(self) -> None:
        cu = getattr(self, "_cu", None)
        if cu is None:
            return
        try:
            if getattr(self, "_exec", None) is not None:
                cu.cuGraphExecDestroy(self._exec)
            cu.cuGraphDestroy(self._graph)
        except Exception:   # interpreter shutdown: the driver may be gone
            pass


def capture(stream, fn: Callable[[], None], *, upload: bool = True, node_priority: bool = False):
    """Capture the work ``fn`` enqueues on ``stream`` into an instantiated ``cupy.cuda.Graph``
    (a ``PriorityGraph`` with ``node_priority``: module doc)."""
    import cupy

    if stream.ptr in (0, 1, 2):  # null, legacy and per-thread default streams
        raise CaptureError("capture: pass a cupy.cuda.Stream(non_blocking=True), not a default stream")
    device = stream.device_id if stream.device_id >= 0 else cupy.cuda.runtime.getDevice()
    runtime.advance_capture_epoch()
    # No cyclic garbage collection while the stream captures: a collected object's finalizer
    # may make a synchronising CUDA call that invalidates the capture (the sixteenth session's
    # driver log named cuCtxSynchronize, as a cuBLASLt handle's destroy makes), and which garbage
    # is collected there depends on what ran before in the process (a test file's model left in
    # a reference cycle), not on fn.  Collection resumes after the capture and its upload.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with cupy.cuda.Device(device), stream:
            stream.begin_capture()
            try:
                fn()
            except BaseException:
                _abort_capture(stream)
                raise
            try:
                if node_priority:   # the raw cudaGraph_t, instantiated by PriorityGraph
                    graph = PriorityGraph(cupy.cuda.runtime.streamEndCapture(stream.ptr))
                else:
                    graph = stream.end_capture()
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise CaptureError(f"capture on device {device}: ending the capture failed ({e}); "
                                   f"a forked stream not joined back, a synchronising call or an "
                                   f"uncapturable API (e.g. cudaMemcpyPeerAsync) inside fn") from e
            if upload:
                graph.upload(stream)  # move the first-launch setup cost out of the timed path
    finally:
        if gc_was_enabled:
            gc.enable()
    return graph


def replay(graph, stream) -> None:
    graph.launch(stream)


class Fork:
    """Events (created now, before any capture) to bring streams into and out of a capture
    that runs on ``origin``; the other streams may belong to other devices."""

    def __init__(self, origin, *others) -> None:
        import cupy

        if not others:
            raise ValueError("Fork: no streams to fork to")
        self.origin = origin
        self.others = others
        # An event is recorded only on a stream of the device it was created on.
        with cupy.cuda.Device(_device_of(origin)):
            self._out = [cupy.cuda.Event(disable_timing=True) for _ in others]
        self._back = []
        for s in others:
            with cupy.cuda.Device(_device_of(s)):
                self._back.append(cupy.cuda.Event(disable_timing=True))

    def fork(self) -> None:
        for ev, s in zip(self._out, self.others):
            ev.record(self.origin)
            s.wait_event(ev)

    def join(self) -> None:
        for ev, s in zip(self._back, self.others):
            ev.record(s)
            self.origin.wait_event(ev)


def _device_of(stream) -> int:
    import cupy

    return stream.device_id if stream.device_id >= 0 else cupy.cuda.runtime.getDevice()


class GraphSet:
    """One captured graph per bucket (e.g. decode batch size) on one stream."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.graphs: dict[int, object] = {}

    def capture_all(self, buckets, make_fn: Callable[[int], Callable[[], None]]) -> None:
        # Largest first, as nano-vllm does: the biggest shapes decide any lazily sized state.
        for b in sorted(set(int(x) for x in buckets), reverse=True):
            self.graphs[b] = capture(self.stream, make_fn(b))

    def bucket_for(self, n: int) -> int:
        fits = [b for b in self.graphs if b >= n]
        if not fits:
            raise KeyError(f"GraphSet: no captured bucket holds n={n} (buckets {sorted(self.graphs)})")
        return min(fits)

    def replay(self, n: int) -> int:
        """Replay the smallest bucket >= n; return that bucket."""
        b = self.bucket_for(n)
        self.graphs[b].launch(self.stream)
        return b

    def __contains__(self, bucket: int) -> bool:
        return bucket in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)
