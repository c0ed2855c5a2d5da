"""GPU tests of memra_dsv4.gpu.{runtime, arena, kernel_loader, graphs}.

Run on the GPU machine through tools/gpu_check.sh.  Without CuPy the module is skipped at
import; without a device the root conftest skips every test here; ``multi_gpu`` tests need two.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import memra_dsv4.gpu  # noqa: F401  (sets CUPY_CACHE_DIR before CuPy is imported)

cupy = pytest.importorskip("cupy")

from memra_dsv4.gpu import REPO_ROOT, graphs, kernel_loader, runtime  # noqa: E402
from memra_dsv4.gpu.arena import Arena, ArenaPlan, count_allocations  # noqa: E402

pytestmark = pytest.mark.gpu

# y = a * x + b over n floats.  Tests use small integer values, so the result is exact whether
# or not the compiler contracts it into an FMA (NumPy does not).
AXPB_SRC = r"""
extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""


def _axpb():
    return cupy.RawKernel(AXPB_SRC, "axpb")


def _launch_axpb(k, x, y, a, b, n, stream):
    k(((n + 255) // 256,), (256,), (x, y, np.float32(a), np.float32(b), np.int32(n)), stream=stream)


def _settle():
    """Wait for setup work CuPy enqueued on the legacy stream of every device: the runtime's
    streams are non-blocking and do not order themselves after it."""
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        cupy.cuda.Device(d).synchronize()


def _ones_zeros_stream(n: int):
    """x = ones, y = zeros (n float32) on the current device and a non-blocking stream, with
    CuPy's setup work settled (_settle)."""
    x = cupy.ones(n, dtype=cupy.float32)
    y = cupy.zeros(n, dtype=cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    _settle()
    return x, y, s


def _need_peer():
    if not cupy.cuda.runtime.deviceCanAccessPeer(0, 1):
        pytest.skip("devices 0 and 1 cannot access each other (no P2P)")


# ------------------------------------------------------------------------ runtime
def test_versions_devices_and_streams():
    devs = runtime.Devices([0])
    print(devs.describe())
    assert devs.driver_version // 1000 >= devs.runtime_version // 1000
    h = devs[0]
    assert h.compute.is_non_blocking and h.copy.is_non_blocking
    assert h.compute.device_id == 0 and h.copy.device_id == 0
    assert h.compute.ptr != h.copy.ptr
    assert h.capability == "9.0", f"expected an H200 (sm_90), got {h.capability} ({h.name})"
    assert "device 0" in devs.describe()
    with pytest.raises(ValueError, match="out of range"):
        runtime.Devices([cupy.cuda.runtime.getDeviceCount()])
    with pytest.raises(ValueError, match="repeated"):
        runtime.Devices([0, 0])


@pytest.mark.multi_gpu
def test_peer_access_enabled_both_ways_and_already_enabled_is_tolerated():
    _need_peer()
    devs = runtime.Devices([0, 1])
    assert devs.can_peer(0, 1) and devs.can_peer(1, 0)
    # Forget what we enabled: the next call hits cudaErrorPeerAccessAlreadyEnabled, tolerated.
    runtime._PEER.discard((0, 1))
    assert runtime.enable_peer_access(0, 1) is True and runtime.peer_enabled(0, 1)
    runtime.Devices([1, 0])


def test_checked_is_free_without_debug():
    if runtime.DEBUG:
        pytest.skip("MEMRA_DSV4_DEBUG=1 in this process")

    def op():
        return 3

    assert runtime.checked("op")(op) is op
    runtime.debug_sync(None, "no-op without debug")   # must not touch the stream


def test_debug_sync_names_the_failing_launch():
    """In a child process (an illegal address poisons the context): MEMRA_DSV4_DEBUG=1 makes
    debug_sync and checked() raise LaunchError naming the launch."""
    code = textwrap.dedent(r'''
        import numpy as np, cupy
        from memra_dsv4.gpu import runtime
        assert runtime.DEBUG
        k = cupy.RawKernel(r'extern "C" __global__ void poke(unsigned long long a) '
                           r'{ *(volatile int*)a = 1; }', 'poke')
        s = cupy.cuda.Stream(non_blocking=True)
        k((1,), (1,), (np.uint64(16),), stream=s)
        try:
            runtime.debug_sync(s, "poke<bad address>")
            print("NOT RAISED")
        except runtime.LaunchError as e:
            print("CAUGHT", e)

        @runtime.checked("op_after_fault")
        def op(stream=None):
            return 1
        try:
            op(stream=s)
            print("CHECKED NOT RAISED")
        except runtime.LaunchError as e:
            print("CHECKED", e)
    ''')
    env = dict(os.environ, MEMRA_DSV4_DEBUG="1",
               PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    diag = f"rc={out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "memra_dsv4: debug = 1" in out.stderr, diag
    assert "CAUGHT" in out.stdout and "poke<bad address>" in out.stdout, diag
    assert "CHECKED" in out.stdout and "op_after_fault" in out.stdout, diag
    assert "NOT RAISED" not in out.stdout, diag


@pytest.mark.multi_gpu
def test_boundary_copy_peer_path_copies_exactly_nbytes():
    _need_peer()
    devs = runtime.Devices([0, 1])
    n = 1 << 20
    with cupy.cuda.Device(0):
        src = cupy.arange(n, dtype=cupy.uint32)
    with cupy.cuda.Device(1):
        dst = cupy.zeros(n, dtype=cupy.uint32)
    _settle()
    s = devs[0].copy
    path = runtime.boundary_copy(dst, src, src.nbytes - 4096, s)
    s.synchronize()
    got = dst.get()
    assert path == "peer"
    np.testing.assert_array_equal(got[:-1024], np.arange(n - 1024, dtype=np.uint32))
    assert not got[-1024:].any(), "boundary_copy wrote past nbytes"


@pytest.mark.parametrize("two_devices", [False, pytest.param(True, marks=pytest.mark.multi_gpu)])
def test_boundary_copy_bounce_path(two_devices):
    ids = [0, 1] if two_devices else [0]
    devs = runtime.Devices(ids)
    dst_dev = ids[-1]
    n = (3 << 20) // 4 + 5
    with cupy.cuda.Device(0):
        srcs = [cupy.arange(n, dtype=cupy.uint32) * (i + 1) for i in range(3)]
    with cupy.cuda.Device(dst_dev):
        dsts = [cupy.zeros(n, dtype=cupy.uint32) for _ in range(3)]
    _settle()
    s0 = devs[0].compute
    dst_stream = devs[dst_dev].copy
    # Three back-to-back bounces through the same pinned buffer, the H2D half on another
    # stream: without the "buffer free" wait the later D2H copies would clobber earlier data.
    paths = [runtime.boundary_copy(d, s, s.nbytes, s0, dst_stream=dst_stream, force_bounce=True)
             for s, d in zip(srcs, dsts)]
    dst_stream.synchronize()
    s0.synchronize()
    assert paths == ["bounce"] * 3
    for i, d in enumerate(dsts):
        np.testing.assert_array_equal(d.get(), np.arange(n, dtype=np.uint32) * (i + 1),
                                      err_msg=f"bounce {i}")
    # Same stream for both halves.
    with cupy.cuda.Device(dst_dev):
        d2 = cupy.zeros(n, dtype=cupy.uint32)
    _settle()
    assert runtime.boundary_copy(d2, srcs[2], 4 * 1000, s0, force_bounce=True) == "bounce"
    s0.synchronize()
    got = d2.get()
    np.testing.assert_array_equal(got[:1000], np.arange(1000, dtype=np.uint32) * 3)
    assert not got[1000:].any()


def test_boundary_copy_refuses_bad_arguments():
    with cupy.cuda.Device(0):
        a = cupy.zeros((16, 16), dtype=cupy.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        with pytest.raises(ValueError, match="exceeds"):
            runtime.boundary_copy(a, a, a.nbytes + 4, s)
        with pytest.raises(ValueError, match="not C-contiguous"):
            runtime.boundary_copy(a[:, ::2], a[:, ::2], 16, s)


# ------------------------------------------------------------------------ arena
def _test_plan() -> ArenaPlan:
    plan = ArenaPlan("gpu-test")
    plan.add("x", (1000,), "f32")
    plan.add("w", (64, 128), "bf16", align=4096)
    plan.add("q", (333,), "e4m3")
    plan.add("idx", (7, 3), "i32")
    plan.add("y", (1000,), "f32")
    return plan


def test_arena_views_sit_at_their_planned_offsets_and_do_not_overlap():
    plan = _test_plan()
    with cupy.cuda.Device(0):
        ar = Arena(plan, 0)
        s = cupy.cuda.Stream(non_blocking=True)
        assert ar.base_ptr % 4096 == 0
        for i, slot in enumerate(plan):
            v = ar.view(slot.name)
            assert v.data.ptr == ar.base_ptr + slot.offset == ar.ptr(slot.name), slot
            assert v.shape == slot.shape and v.dtype == slot.storage, slot
            assert v.device.id == 0
            cupy.cuda.runtime.memsetAsync(ar.ptr(slot.name), 17 + i, slot.nbytes, s.ptr)
        s.synchronize()
        for i, slot in enumerate(plan):
            got = ar.view(slot.name).view(cupy.uint8).get()
            assert (got == 17 + i).all(), f"slot {slot.name} was overwritten by a neighbour"
        assert ar.logical_dtype("w") == "bf16" and ar.view("w").dtype == np.uint16
        assert ar.logical_dtype("q") == "e4m3" and ar.view("q").dtype == np.uint8
        ar.zero(s)
        s.synchronize()
        assert not ar.view("w").get().any()
        with pytest.raises(KeyError, match="no slot 'nope'"):
            ar.view("nope")


def test_no_allocation_after_construction_and_the_counter_sees_allocations():
    plan = _test_plan()
    k = _axpb()
    with cupy.cuda.Device(0):
        ar = Arena(plan, 0)
        s = cupy.cuda.Stream(non_blocking=True)
        ar.view("x").set(np.arange(1000, dtype=np.float32))
        _settle()
        _launch_axpb(k, ar.view("x"), ar.view("y"), 2, 1, 1000, s)   # compiles and loads
        s.synchronize()
        with count_allocations() as c:
            for _ in range(5):
                _launch_axpb(k, ar.view("x"), ar.view("y"), 2, 1, 1000, s)
                ar.ptr("q")
            s.synchronize()
        assert c.total == 0 and c.device_allocs == 0, c
        np.testing.assert_array_equal(ar.view("y").get(), 2 * np.arange(1000, dtype=np.float32) + 1)
        # The counter must be able to fail: a CuPy temporary is a pool request.
        with count_allocations() as c2:
            tmp = cupy.empty(12345, dtype=cupy.float32)
        del tmp
        assert c2.pool_requests == 1 and c2.first[0] == (0, 12345 * 4), c2


# ------------------------------------------------------------------------ kernel loader
PROBE_SRC = r"""
#include "common.cuh"

template <int kMul>
__global__ void probe_mul(const int* x, int* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = kMul * x[i] + PROBE_BIAS;
}

extern "C" __global__ void probe_arch(int* flag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    flag[0] = 1;
#else
    flag[0] = 0;
#endif
    flag[1] = __CUDA_ARCH__;
}
"""


@pytest.fixture
def private_registry(monkeypatch):
    """Test stems live in a copy of the registry, so they never leak into other tests."""
    monkeypatch.setattr(kernel_loader, "_REGISTRY", dict(kernel_loader._REGISTRY))


def _probe(loader, stem, name, x):
    y = cupy.zeros_like(x)
    loader.get(stem, name)((4,), (256,), (x, y, np.int32(x.size)))
    cupy.cuda.get_current_stream().synchronize()
    return y.get()


def test_kernel_loader_compiles_caches_and_tracks_headers(tmp_path, private_registry):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "common.cuh").write_text("#pragma once\n#define PROBE_BIAS 3\n")
    stem = f"memra_probe_{os.getpid()}"
    (kdir / f"{stem}.cu").write_text(PROBE_SRC)
    kernel_loader.register(stem, ["probe_mul<2>", "probe_mul<5>", "probe_arch"])
    with cupy.cuda.Device(0):
        loader = kernel_loader.KernelLoader(0, kernels_dir=str(kdir))
        ms = loader.warm_all([stem])
        print(f"compile ms: {ms}; cache dir {loader.cache_dir}")
        assert set(ms) == {stem} and ms[stem] > 0
        backend = cupy.cuda.compiler._kernel_cache_backend
        assert os.path.abspath(backend._cache_dir) == os.path.abspath(os.environ["CUPY_CACHE_DIR"])
        k2 = loader.get(stem, "probe_mul<2>")
        assert loader.get(stem, "probe_mul<2>") is k2, "get() must return the cached RawKernel"
        x = cupy.arange(1000, dtype=cupy.int32)
        ref = np.arange(1000, dtype=np.int32)
        np.testing.assert_array_equal(_probe(loader, stem, "probe_mul<2>", x), 2 * ref + 3)
        np.testing.assert_array_equal(_probe(loader, stem, "probe_mul<5>", x), 5 * ref + 3)
        flag = cupy.zeros(2, dtype=cupy.int32)
        loader.get(stem, "probe_arch")((1,), (1,), (flag,))
        f = flag.get()
        assert f[1] == 900 and f[0] == 1, f"sm_90a features not enabled: {f} (options " \
                                          f"{kernel_loader.nvrtc_options(str(kdir))})"
        with pytest.raises(KeyError, match="not registered"):
            loader.get(stem, "probe_mul<7>")

        # A header edit must reach the kernels: same .cu text, new -DMEMRA_DSV4_HEADERS.
        (kdir / "common.cuh").write_text("#pragma once\n#define PROBE_BIAS 7\n")
        loader2 = kernel_loader.KernelLoader(0, kernels_dir=str(kdir))
        np.testing.assert_array_equal(_probe(loader2, stem, "probe_mul<2>", x), 2 * ref + 7)
        # Names registered after warmup: rebuilt on first get; old kernels keep working.
        kernel_loader.register(stem, ["probe_mul<9>"])
        np.testing.assert_array_equal(_probe(loader, stem, "probe_mul<9>", x), 9 * ref + 7)
        # The rebuilt module sees the edited header; a RawKernel fetched before the rebuild
        # keeps its own (old) module alive and still computes with the old header.
        np.testing.assert_array_equal(_probe(loader, stem, "probe_mul<2>", x), 2 * ref + 7)
        y = cupy.empty_like(x)
        k2((4,), (256,), (x, y, np.int32(x.size)))
        np.testing.assert_array_equal(y.get(), 2 * ref + 3)


def test_kernel_loader_compile_error_names_the_file_and_carries_the_log(tmp_path, private_registry):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "common.cuh").write_text("#pragma once\n")
    stem = f"memra_broken_{os.getpid()}"
    (kdir / f"{stem}.cu").write_text('#include "common.cuh"\n'
                                     'extern "C" __global__ void broken(int* y) '
                                     '{ y[0] = undefined_symbol_xyz; }\n')
    kernel_loader.register(stem, ["broken"])
    with cupy.cuda.Device(0):
        loader = kernel_loader.KernelLoader(0, kernels_dir=str(kdir))
        with pytest.raises(kernel_loader.KernelCompileError) as ei:
            loader.get(stem, "broken")
    msg = str(ei.value)
    print(msg)
    assert f"{stem}.cu" in msg and "undefined_symbol_xyz" in msg and "-arch=sm_90a" in msg
    with pytest.raises(KeyError, match="not registered"):
        loader.get("memra_never_registered", "k")


def test_every_repository_kernel_module_compiles_with_nvrtc(private_registry):
    """Each kernels_cu/*.cu through NVRTC with the loader's options (nvcc is what CI checks;
    this is the runtime's compiler), with every name expression the ops registered so far.
    All failures are reported together."""
    import glob

    stems = sorted(os.path.splitext(os.path.basename(p))[0]
                   for p in glob.glob(os.path.join(kernel_loader.KERNELS_DIR, "*.cu")))
    if not stems:
        pytest.skip(f"no .cu files under {kernel_loader.KERNELS_DIR}")
    for stem in stems:
        kernel_loader.register(stem, ())   # keeps any instances an op already registered
    loader = kernel_loader.KernelLoader(0)
    failures = {}
    with cupy.cuda.Device(0):
        for stem in stems:
            try:
                loader.warm_all([stem])
            except kernel_loader.KernelCompileError as e:
                failures[stem] = str(e)[:4000]
    print("NVRTC ms:", {k: round(v, 1) for k, v in loader.compile_ms.items()})
    assert not failures, "\n\n".join(failures.values())


# ------------------------------------------------------------------------ graphs
def test_single_device_graph_replay_equals_eager_and_rereads_inputs():
    k = _axpb()
    n = 4096
    with cupy.cuda.Device(0):
        x = cupy.arange(n, dtype=cupy.float32)
        y = cupy.zeros(n, dtype=cupy.float32)
        z = cupy.zeros(n, dtype=cupy.float32)
        w = cupy.zeros(n, dtype=cupy.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        _settle()

        def step():
            _launch_axpb(k, x, y, 2, 1, n, s)
            cupy.cuda.runtime.memcpyAsync(z.data.ptr, y.data.ptr, y.nbytes,
                                          cupy.cuda.runtime.memcpyDefault, s.ptr)
            _launch_axpb(k, z, w, 3, -1, n, s)

        step()
        s.synchronize()
        eager = w.get()
        for a in (y, z, w):
            a.fill(0)
        _settle()
        g = graphs.capture(s, step)
        with count_allocations() as c:
            graphs.replay(g, s)
            s.synchronize()
        assert c.total == 0, c
        np.testing.assert_array_equal(w.get(), eager)
        x.set(np.full(n, 5, dtype=np.float32))
        _settle()
        graphs.replay(g, s)
        s.synchronize()
        np.testing.assert_array_equal(w.get(), np.full(n, 3 * (2 * 5 + 1) - 1, dtype=np.float32))


def test_capture_failure_leaves_the_stream_usable():
    k = _axpb()
    with cupy.cuda.Device(0):
        x, y, s = _ones_zeros_stream(256)
        _launch_axpb(k, x, y, 1, 0, 256, s)

        def bad():
            _launch_axpb(k, x, y, 1, 0, 256, s)
            raise ValueError("boom inside capture")

        with pytest.raises(ValueError, match="boom"):
            graphs.capture(s, bad)
        assert not s.is_capturing()
        _launch_axpb(k, x, y, 4, 0, 256, s)
        s.synchronize()
        assert (y.get() == 4).all()
        with pytest.raises(graphs.CaptureError):
            graphs.capture(cupy.cuda.Stream.null, lambda: None)


def test_capture_survives_cyclic_garbage_with_a_synchronising_finalizer():
    """Sixteenth session: a test file's model left in a reference cycle was collected inside a
    later test's step capture, and a finalizer's device synchronise (the driver log named
    cuCtxSynchronize) invalidated the capture.  graphs.capture keeps the cyclic collector off:
    here the collector is primed to run at every allocation (threshold 1), and fn makes such
    garbage and then allocates Python objects between two launches; the capture must succeed
    and the garbage must be collected after it, not inside."""
    k = _axpb()
    with cupy.cuda.Device(0):
        x, y, s = _ones_zeros_stream(256)
        finalized = []

        class Cycle:
            def __init__(self):
                self.me = self

            def __del__(self):
                finalized.append(s.is_capturing())      # where the collection found it
                cupy.cuda.runtime.deviceSynchronize()   # as cublasLtDestroy does

        def step():
            _launch_axpb(k, x, y, 2, 1, 256, s)
            Cycle()                                     # unreachable cycle, made while capturing
            junk = [[i] for i in range(2000)]           # allocations: a collection would run here
            _launch_axpb(k, y, y, 1, 1, 256, s)
            del junk

        old = gc.get_threshold()
        gc.collect()
        try:
            gc.set_threshold(1, 1, 1)                   # collect at every allocation when enabled
            g = graphs.capture(s, step)
        finally:
            gc.set_threshold(*old)
        gc.collect()
        assert finalized == [False], f"the cycle was collected while capturing: {finalized}"
        graphs.replay(g, s)
        s.synchronize()
        assert (y.get() == 4).all()


def test_graph_set_replays_the_smallest_bucket_that_fits():
    k = _axpb()
    with cupy.cuda.Device(0):
        x = cupy.zeros(8, dtype=cupy.float32)
        y = cupy.zeros(8, dtype=cupy.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        _settle()
        _launch_axpb(k, x, y, 0, 0, 8, s)
        gs = graphs.GraphSet(s)
        gs.capture_all([1, 2, 4, 8], lambda b: (lambda: _launch_axpb(k, x, y, 0, b, b, s)))
        assert len(gs) == 4 and 4 in gs
        y.fill(0)
        _settle()
        assert gs.replay(3) == 4
        s.synchronize()
        np.testing.assert_array_equal(y.get(), [4, 4, 4, 4, 0, 0, 0, 0])
        with pytest.raises(KeyError):
            gs.replay(9)


@pytest.mark.multi_gpu
def test_two_device_graph_kernel_copy_kernel_equals_eager():
    """kernel(dev0) -> memcpyAsync dev0->dev1 -> kernel(dev1), captured in ONE graph on a
    device-0 stream; device 1's stream joins through pre-created events."""
    _need_peer()
    devs = runtime.Devices([0, 1])
    k = _axpb()
    n = 1 << 16
    s0, s1 = devs[0].compute, devs[1].compute
    with cupy.cuda.Device(0):
        x0 = cupy.arange(n, dtype=cupy.float32)
        y0 = cupy.zeros(n, dtype=cupy.float32)
    with cupy.cuda.Device(1):
        y1 = cupy.zeros(n, dtype=cupy.float32)
        z1 = cupy.zeros(n, dtype=cupy.float32)
    _settle()
    fork = graphs.Fork(s0, s1)

    def step():
        with cupy.cuda.Device(0):
            _launch_axpb(k, x0, y0, 2, 1, n, s0)
        assert runtime.boundary_copy(y1, y0, y0.nbytes, s0) == "peer"
        fork.fork()
        with cupy.cuda.Device(1):
            _launch_axpb(k, y1, z1, 3, -1, n, s1)
        fork.join()

    step()
    devs.synchronize()
    eager = z1.get()
    np.testing.assert_array_equal(eager, 3 * (2 * np.arange(n, dtype=np.float32) + 1) - 1)
    for a in (y0, y1, z1):
        with a.device:
            a.fill(0)
    _settle()
    g = graphs.capture(s0, step)
    graphs.replay(g, s0)
    s0.synchronize()       # the join makes the graph's end wait for device 1's work
    np.testing.assert_array_equal(z1.get(), eager)
    with cupy.cuda.Device(0):
        x0.set(np.full(n, 7, dtype=np.float32))
    _settle()
    graphs.replay(g, s0)
    s0.synchronize()
    np.testing.assert_array_equal(z1.get(), np.full(n, 3 * (2 * 7 + 1) - 1, dtype=np.float32))
