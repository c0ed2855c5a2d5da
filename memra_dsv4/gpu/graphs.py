"""CUDA-graph capture and replay with CuPy, on one device or spanning a pipeline of devices.

Contract
--------
* ``capture(stream, fn) -> cupy.cuda.Graph``: makes ``stream`` (non-blocking; capture refuses
  the legacy stream) current on its device, begins a relaxed-mode capture, calls ``fn()``
  (which enqueues work: RawKernels on the current stream, ``GemmPlan.run``, ``memcpyAsync``),
  ends the capture and instantiates the graph.  If ``fn`` raises, the capture is ended and
  discarded so the stream is usable again, and the error propagates.  Nothing inside ``fn``
  may synchronise or allocate: every buffer comes from the arena (CuPy exposes no graph-exec
  update, so a graph is tied to the addresses it captured), every GEMM plan and every kernel
  is built before capture.
* ``capture(..., node_priority=True)`` instantiates with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_
  PRIORITY (cuda.bindings; CuPy instantiates with flags 0): every kernel node then runs at the
  priority of the stream it was captured on (copied at capture), not at the launch stream's, so
  side branches captured on a high-priority stream get their CTAs dispatched ahead of the
  pending CTAs of a big kernel beside them.  Returns a ``PriorityGraph`` (launch / upload as
  cupy.cuda.Graph).
* ``capture(..., edges="join" | "all")`` (``MEMRA_DSV4_GRAPH_EDGES``, read by the device step at
  capture; default "off") rewrites the captured graph before instantiating it (as a
  ``PriorityGraph``): a cross-stream edge (fork / join events) is captured as a full dependency,
  so its destination starts only after the source grid has drained (~1.8-2 us on the device
  timeline against ~0.5 us for a PDL edge), even when the source finished long before.
  ``programmatic_edges`` turns such kernel -> kernel edges into programmatic ones, with the edge
  data the capture gave the graph's own PDL edges: "join" only those into a kernel that already
  has a programmatic in-edge (its launch carried the PDL attribute), "all" also those into any
  kernel launched through ``pdl.PdlKernel`` (the first kernel of a side branch).  Why this is the
  same computation: every kernel opens with ``griddepcontrol.wait`` (pdl.py), which returns only
  once EVERY programmatic prerequisite grid has completed and flushed; before it a kernel reads
  nothing but static weights.  Schedule only: the same bytes.
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

import ctypes
from typing import Callable

from memra_dsv4.gpu import runtime

__all__ = ["capture", "replay", "Fork", "GraphSet", "CaptureError", "PriorityGraph",
           "stream_priority_range", "priority_stream", "programmatic_edges", "edges_to_convert",
           "EDGE_MODES"]

EDGE_MODES = ("off", "join", "all")


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
    """A captured cudaGraph_t instantiated through the driver API (cuda.bindings), with
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY unless ``node_priority`` is False; owns both
    handles."""

    def __init__(self, graph_handle: int, node_priority: bool = True) -> None:
        from cuda.bindings import driver as cu
        self._cu = cu
        self.programmatic_edges_added = 0   # set by capture(edges=...)
        self._graph = cu.CUgraph(int(graph_handle))
        flag = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        flags = int(getattr(flag, "value", flag)) if node_priority else 0
        err, self._exec = cu.cuGraphInstantiate(self._graph, flags)
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


def capture(stream, fn: Callable[[], None], *, upload: bool = True, node_priority: bool = False,
            edges: str = "off"):
    """Capture the work ``fn`` enqueues on ``stream`` into an instantiated ``cupy.cuda.Graph``
    (a ``PriorityGraph`` with ``node_priority`` or ``edges`` other than "off": module doc)."""
    import cupy

    if edges not in EDGE_MODES:
        raise ValueError(f"capture: edges={edges!r}, expected one of {EDGE_MODES}")
    if stream.ptr in (0, 1, 2):  # null, legacy and per-thread default streams
        raise CaptureError("capture: pass a cupy.cuda.Stream(non_blocking=True), not a default stream")
    device = stream.device_id if stream.device_id >= 0 else cupy.cuda.runtime.getDevice()
    runtime.advance_capture_epoch()
    with cupy.cuda.Device(device), stream:
        stream.begin_capture()
        try:
            fn()
        except BaseException:
            _abort_capture(stream)
            raise
        try:
            if node_priority or edges != "off":   # the raw cudaGraph_t, instantiated by PriorityGraph
                handle = cupy.cuda.runtime.streamEndCapture(stream.ptr)
                added = 0
                if edges != "off":
                    try:
                        added = programmatic_edges(handle, edges)
                    except BaseException:
                        cupy.cuda.runtime.graphDestroy(handle)
                        raise
                graph = PriorityGraph(handle, node_priority=node_priority)
                graph.programmatic_edges_added = added
            else:
                graph = stream.end_capture()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise CaptureError(f"capture on device {device}: ending the capture failed ({e}); "
                               f"a forked stream not joined back, a synchronising call or an "
                               f"uncapturable API (e.g. cudaMemcpyPeerAsync) inside fn") from e
        if upload:
            graph.upload(stream)  # move the first-launch setup cost out of the timed path
    return graph


# ---------------------------------------------------------------- programmatic join / fork edges
# Driver entry points through ctypes (cuda.bindings' wrappers of the edge-data calls changed
# names and shapes between 12.x and 13.x; the C ABI of the _v2 symbols did not).
_CU_NODE_KERNEL = 0          # CU_GRAPH_NODE_TYPE_KERNEL
_CU_DEP_DEFAULT = 0          # CU_GRAPH_DEPENDENCY_TYPE_DEFAULT
_CU_DEP_PROGRAMMATIC = 1     # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


def edges_to_convert(edges, node_kind, pdl_funcs, mode: str) -> list[int]:
    """Indices into ``edges`` ((src, dst, dep_type) node triples) of the default edges
    ``programmatic_edges`` turns programmatic.  ``node_kind(node)`` -> (is_kernel, func handle);
    ``pdl_funcs``: the CUfunction handles launched through PdlKernel.  "join": kernel -> kernel
    default edges whose destination already has a programmatic in-edge; "all": also those whose
    destination kernel is a PdlKernel function.  Pure (CPU-tested)."""
    if mode not in EDGE_MODES:
        raise ValueError(f"edges={mode!r}, expected one of {EDGE_MODES}")
    if mode == "off":
        return []
    has_prog_in = {dst for _, dst, ty in edges if ty == _CU_DEP_PROGRAMMATIC}
    out = []
    for i, (src, dst, ty) in enumerate(edges):
        if ty != _CU_DEP_DEFAULT:
            continue
        src_kernel, _ = node_kind(src)
        dst_kernel, dst_func = node_kind(dst)
        if not (src_kernel and dst_kernel):
            continue
        if dst in has_prog_in or (mode == "all" and dst_func in pdl_funcs):
            out.append(i)
    return out


class _EdgeData(ctypes.Structure):   # CUgraphEdgeData (8 bytes)
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def programmatic_edges(graph_handle: int, mode: str) -> int:
    """Rewrite the default kernel -> kernel edges ``edges_to_convert`` picks as programmatic
    edges (edge data copied from one of the graph's own programmatic edges) in the captured,
    not yet instantiated graph ``graph_handle``; returns how many.  No programmatic edge in the
    graph (PDL off): nothing to copy, nothing changed."""
    from memra_dsv4.gpu.pdl import pdl_function_handles
    lib = _libcuda()
    g = ctypes.c_void_p(int(graph_handle))

    def ok(rc, what):
        if rc != 0:
            raise CaptureError(f"programmatic_edges: {what}: CUresult {rc}")

    n = ctypes.c_size_t(0)
    ok(lib.cuGraphGetEdges_v2(g, None, None, None, ctypes.byref(n)), "cuGraphGetEdges_v2 (count)")
    N = n.value
    if N == 0:
        return 0
    src = (ctypes.c_void_p * N)()
    dst = (ctypes.c_void_p * N)()
    data = (_EdgeData * N)()
    ok(lib.cuGraphGetEdges_v2(g, src, dst, data, ctypes.byref(n)), "cuGraphGetEdges_v2")
    prog = [i for i in range(N) if data[i].type == _CU_DEP_PROGRAMMATIC]
    if not prog:
        return 0
    template = data[prog[0]]
    kinds: dict = {}

    def node_kind(node):
        if node not in kinds:
            t = ctypes.c_int(-1)
            ok(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
            func = None
            if t.value == _CU_NODE_KERNEL:
                params = (ctypes.c_byte * 256)()   # CUDA_KERNEL_NODE_PARAMS_v2: CUfunction first
                ok(lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), params),
                   "cuGraphKernelNodeGetParams_v2")
                func = ctypes.c_void_p.from_buffer(params).value
            kinds[node] = (t.value == _CU_NODE_KERNEL, func)
        return kinds[node]

    triples = [(src[i], dst[i], data[i].type) for i in range(N)]
    pick = edges_to_convert(triples, node_kind, pdl_function_handles(), mode)
    for i in pick:
        one_src, one_dst = (ctypes.c_void_p * 1)(src[i]), (ctypes.c_void_p * 1)(dst[i])
        old = (_EdgeData * 1)(data[i])
        ok(lib.cuGraphRemoveDependencies_v2(g, one_src, one_dst, old, ctypes.c_size_t(1)),
           "cuGraphRemoveDependencies_v2")
        new = (_EdgeData * 1)()
        new[0].from_port, new[0].to_port, new[0].type = template.from_port, template.to_port, template.type
        ok(lib.cuGraphAddDependencies_v2(g, one_src, one_dst, new, ctypes.c_size_t(1)),
           "cuGraphAddDependencies_v2")
    return len(pick)


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
