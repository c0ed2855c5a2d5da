"""GPU tests of memra_dsv4.gpu.blaslt: bf16 and FP8 block-scaled GEMMs against NumPy float64,
and plans captured into CUDA graphs next to RawKernels.

Needs nvmath-python (tools/gpu_check.sh installs the carried wheel) and ml_dtypes.  Every
accuracy failure prints the plan (algorithm index, candidates), the relative error and the
worst element.
"""

from __future__ import annotations

import numpy as np
import pytest

import memra_dsv4.gpu  # noqa: F401  (sets CUPY_CACHE_DIR before CuPy is imported)

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from memra_dsv4.gpu import graphs  # noqa: E402
from memra_dsv4.gpu.arena import Arena, ArenaPlan, count_allocations  # noqa: E402
from memra_dsv4.gpu.blaslt import DEFAULT_WORKSPACE_BYTES, BlasLt, BlasLtError, GemmKey  # noqa: E402

pytestmark = pytest.mark.gpu

E4M3 = ml_dtypes.float8_e4m3fn
FP8_KEY = dict(a_dtype="e4m3", b_dtype="e4m3", d_dtype="bf16", a_scale="blk128x128",
               b_scale="vec128")
BF16_TOL = 2.5e-3     # Frobenius relative error of a bf16-rounded output (unit roundoff 2^-9)
FP8_TOL = 4e-3

FLIP_SRC = r"""
extern "C" __global__ void flip_sign_bf16(const unsigned short* src, unsigned short* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] ^ 0x8000u;
}
"""


@pytest.fixture(scope="module")
def nvmath_ok():
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:
        pytest.fail(f"nvmath-python is not importable ({e}); tools/gpu_check.sh installs it "
                    f"from .whl/")
    try:
        version = cublasLt.get_version()
    except Exception as e:  # libcublasLt not found by cuda.pathfinder
        pytest.fail(f"cuBLASLt could not be loaded through nvmath: {e}")
    print(f"cuBLASLt {version}")
    return version


# ------------------------------------------------------------------------ host helpers
def bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def e4m3_codes(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(E4M3).view(np.uint8)


def e4m3_values(codes) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(E4M3).astype(np.float64)


def _arena(slots) -> Arena:
    plan = ArenaPlan("blaslt-test")
    plan.add("ws", (DEFAULT_WORKSPACE_BYTES,), "u8")
    for name, shape, dtype in slots:
        plan.add(name, shape, dtype)
    return Arena(plan, 0)


def _settle():
    cupy.cuda.Device(0).synchronize()


def _compare(got, ref, what: str) -> tuple[float, str]:
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    err = np.abs(got - ref)
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    return rel, (f"{what}: rel err {rel:.3e}; worst |err| {err[i]:.4g} at {tuple(int(v) for v in i)} "
                 f"(got {got[i]:.6g}, ref {ref[i]:.6g}); max|ref| {np.abs(ref).max():.4g}")


# ------------------------------------------------------------------------ bf16
@pytest.mark.parametrize("d_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_bf16_gemm_matches_float64_reference(m, d_dtype, nvmath_ok):
    N, K, pad = 1536, 1024, 2
    rng = np.random.default_rng(1000 + m)
    w = bf16_bits(rng.standard_normal((N, K), dtype=np.float32))
    x = bf16_bits(rng.standard_normal((m, K), dtype=np.float32))
    key = GemmKey(m, N, K, d_dtype=d_dtype)
    with cupy.cuda.Device(0):
        ar = _arena([("w", (N, K), "bf16"), ("x", (m, K), "bf16"), ("y", (m + pad, N), d_dtype)])
        ar.view("w").set(w)
        ar.view("x").set(x)
        ar.view("y").fill(0x7FC1 if d_dtype == "bf16" else np.nan)   # NaN sentinels
        _settle()
        lt = BlasLt(0, ar.view("ws"))
        plan = lt.plan(key)
        assert lt.plan(key) is plan, "plans must be cached per key"
        s = cupy.cuda.Stream(non_blocking=True)
        plan.run_arrays(ar.view("w"), ar.view("x"), ar.view("y"), s)
        s.synchronize()
        y = ar.view("y").get()
    ref = bf16_values(x) @ bf16_values(w).T
    got = bf16_values(y[:m]) if d_dtype == "bf16" else y[:m].astype(np.float64)
    rel, diag = _compare(got, ref, plan.describe())
    print(diag)
    tail = y[m:]
    assert (tail == 0x7FC1).all() if d_dtype == "bf16" else np.isnan(tail).all(), \
        f"rows >= M were written: the D layout (ld N) is wrong. {diag}"
    err = np.abs(got - ref)
    if d_dtype == "bf16":
        assert rel <= BF16_TOL, diag
        assert (err <= 2.0**-8 * np.abs(ref) + 1e-4 * np.abs(ref).max()).all(), diag
    else:
        assert rel <= 2e-5, diag
        assert (err <= 1e-5 * np.abs(ref).max()).all(), diag


def test_run_arrays_refuses_mismatched_operands(nvmath_ok):
    N, K, m = 256, 256, 4
    with cupy.cuda.Device(0):
        ar = _arena([("w", (N, K), "bf16"), ("x", (m, K), "bf16"), ("y", (m, N), "bf16"),
                     ("wt", (K, N + 16), "bf16"), ("yf", (m, N), "f32")])
        lt = BlasLt(0, ar.view("ws"))
        plan = lt.plan(GemmKey(m, N, K))
        s = cupy.cuda.Stream(non_blocking=True)
        from memra_dsv4.gpu.blaslt import BlasLtError
        with pytest.raises(BlasLtError, match="w has shape"):
            plan.run_arrays(ar.view("wt"), ar.view("x"), ar.view("y"), s)
        with pytest.raises(BlasLtError, match="y stored as float32"):
            plan.run_arrays(ar.view("w"), ar.view("x"), ar.view("yf"), s)
        with pytest.raises(BlasLtError, match="scales given to an unscaled plan"):
            plan.run_arrays(ar.view("w"), ar.view("x"), ar.view("y"), s, a_scale=ar.view("yf"))


# ------------------------------------------------------------------------ FP8 block-scaled
def _fp8_problem(rng, m, N, K):
    """Random e4m3 operands with NON-uniform power-of-two block scales, and the float64
    dequantize-then-matmul reference."""
    w_codes = e4m3_codes(rng.standard_normal((N, K), dtype=np.float32) * 2)
    x_codes = e4m3_codes(rng.standard_normal((m, K), dtype=np.float32) * 2)
    a_scale = (2.0 ** rng.integers(-6, 4, size=(N // 128, K // 128))).astype(np.float32)
    x_scale = (2.0 ** rng.integers(-6, 4, size=(m, K // 128))).astype(np.float32)  # [M, K/128]
    wv = e4m3_values(w_codes) * np.kron(a_scale.astype(np.float64), np.ones((128, 128)))
    xv = e4m3_values(x_codes) * np.repeat(x_scale.astype(np.float64), 128, axis=1)
    return w_codes, x_codes, a_scale, x_scale, xv @ wv.T


@pytest.mark.parametrize("m", [64, 256])
def test_fp8_block_scaled_gemm_matches_dequantized_reference(m, nvmath_ok):
    N, K = 1024, 2048
    rng = np.random.default_rng(2000 + m)
    w_codes, x_codes, a_scale, x_scale, ref = _fp8_problem(rng, m, N, K)
    key = GemmKey(m, N, K, **FP8_KEY)
    assert key.a_scale_shape == a_scale.shape and key.b_scale_shape == x_scale.T.shape
    with cupy.cuda.Device(0):
        ar = _arena([("w", (N, K), "e4m3"), ("x", (m, K), "e4m3"), ("y", (m, N), "bf16"),
                     ("a_scale", key.a_scale_shape, "f32"), ("b_scale", key.b_scale_shape, "f32"),
                     ("a_scale_t", a_scale.T.shape, "f32"), ("x_scale_nat", x_scale.shape, "f32")])
        ar.view("w").set(w_codes)
        ar.view("x").set(x_codes)
        ar.view("a_scale").set(a_scale)                                # checkpoint grid as is
        ar.view("b_scale").set(np.ascontiguousarray(x_scale.T))        # token index fastest
        ar.view("a_scale_t").set(np.ascontiguousarray(a_scale.T))
        ar.view("x_scale_nat").set(x_scale)
        _settle()
        lt = BlasLt(0, ar.view("ws"))
        plan = lt.plan(key)
        s = cupy.cuda.Stream(non_blocking=True)
        plan.run_arrays(ar.view("w"), ar.view("x"), ar.view("y"), s,
                        a_scale=ar.view("a_scale"), b_scale=ar.view("b_scale"))
        s.synchronize()
        got = bf16_values(ar.view("y").get())
        rel, diag = _compare(got, ref, plan.describe())
        print(diag)
        assert rel <= FP8_TOL, diag

        # The test must be able to tell the layouts apart: the same scales in the wrong
        # arrangement must give an error of order one.
        w_p, x_p, y_p = ar.ptr("w"), ar.ptr("x"), ar.ptr("y")
        plan.run(w_p, x_p, y_p, s, ar.ptr("a_scale_t"), ar.ptr("b_scale"))
        s.synchronize()
        rel_a, diag_a = _compare(bf16_values(ar.view("y").get()), ref, "A scales transposed")
        print(diag_a)
        assert rel_a > 0.05, f"a transposed A-scale grid went unnoticed: {diag_a}"
        if m > 1:   # for M = 1 both B layouts are the same bytes
            plan.run(w_p, x_p, y_p, s, ar.ptr("a_scale"), ar.ptr("x_scale_nat"))
            s.synchronize()
            rel_b, diag_b = _compare(bf16_values(ar.view("y").get()), ref, "B scales [M, K/128]")
            print(diag_b)
            assert rel_b > 0.05, f"natural [M, K/128] B scales went unnoticed: {diag_b}"


# ------------------------------------------------------------------------ graphs
def test_bf16_plan_in_a_graph_with_a_rawkernel_is_bit_identical_to_eager(nvmath_ok):
    m, N, K = 8, 2048, 1024
    rng = np.random.default_rng(7)
    w = bf16_bits(rng.standard_normal((N, K), dtype=np.float32))
    src_a = bf16_bits(rng.standard_normal((m, K), dtype=np.float32))
    src_b = bf16_bits(rng.standard_normal((m, K), dtype=np.float32))
    flip = cupy.RawKernel(FLIP_SRC, "flip_sign_bf16")
    with cupy.cuda.Device(0):
        ar = _arena([("w", (N, K), "bf16"), ("src", (m, K), "bf16"), ("x", (m, K), "bf16"),
                     ("y", (m, N), "bf16")])
        ar.view("w").set(w)
        ar.view("src").set(src_a)
        _settle()
        lt = BlasLt(0, ar.view("ws"))
        plan = lt.plan(GemmKey(m, N, K))
        s = cupy.cuda.Stream(non_blocking=True)
        n = m * K
        args = (ar.view("src"), ar.view("x"), np.int32(n))
        w_p, x_p, y_p = ar.ptr("w"), ar.ptr("x"), ar.ptr("y")

        def step():
            flip(((n + 255) // 256,), (256,), args, stream=s)   # x = -src
            plan.run(w_p, x_p, y_p, s)

        step()
        s.synchronize()
        eager_a = ar.view("y").get()
        rel, diag = _compare(bf16_values(eager_a), -(bf16_values(src_a) @ bf16_values(w).T),
                             plan.describe())
        assert rel <= BF16_TOL, f"eager result is wrong before any graph: {diag}"

        ar.view("y").fill(0)
        _settle()
        g = graphs.capture(s, step)
        with count_allocations() as c:
            graphs.replay(g, s)
            s.synchronize()
        assert c.total == 0, c
        np.testing.assert_array_equal(ar.view("y").get(), eager_a,
                                      err_msg="graph replay differs from eager (bits)")

        # New input through the same addresses: the graph must re-read it.
        ar.view("src").set(src_b)
        _settle()
        step()
        s.synchronize()
        eager_b = ar.view("y").get()
        assert not np.array_equal(eager_b, eager_a)
        ar.view("y").fill(0)
        _settle()
        graphs.replay(g, s)
        s.synchronize()
        np.testing.assert_array_equal(ar.view("y").get(), eager_b,
                                      err_msg="graph replay with new input differs from eager")


def test_fp8_plan_serves_two_layers_in_one_graph(nvmath_ok):
    """One FP8 plan, two weight/scale sets (two layers) in one graph: the scale pointers set
    per call must be baked into each captured launch, not the last one set."""
    m, N, K = 16, 1024, 1024
    rng = np.random.default_rng(11)
    w1, x_codes, a1, x_scale, ref1 = _fp8_problem(rng, m, N, K)
    w2 = e4m3_codes(rng.standard_normal((N, K), dtype=np.float32) * 2)
    a2 = (2.0 ** rng.integers(-6, 4, size=a1.shape)).astype(np.float32)
    xv = e4m3_values(x_codes) * np.repeat(x_scale.astype(np.float64), 128, axis=1)
    ref2 = xv @ (e4m3_values(w2) * np.kron(a2.astype(np.float64), np.ones((128, 128)))).T
    key = GemmKey(m, N, K, **FP8_KEY)
    with cupy.cuda.Device(0):
        ar = _arena([("w1", (N, K), "e4m3"), ("w2", (N, K), "e4m3"), ("x", (m, K), "e4m3"),
                     ("a1", a1.shape, "f32"), ("a2", a2.shape, "f32"),
                     ("b", key.b_scale_shape, "f32"), ("y1", (m, N), "bf16"), ("y2", (m, N), "bf16")])
        for name, host in (("w1", w1), ("w2", w2), ("x", x_codes), ("a1", a1), ("a2", a2),
                           ("b", np.ascontiguousarray(x_scale.T))):
            ar.view(name).set(host)
        _settle()
        lt = BlasLt(0, ar.view("ws"))
        plan = lt.plan(key)
        s = cupy.cuda.Stream(non_blocking=True)
        p = ar.ptr

        def step():
            plan.run(p("w1"), p("x"), p("y1"), s, p("a1"), p("b"))
            plan.run(p("w2"), p("x"), p("y2"), s, p("a2"), p("b"))

        step()
        s.synchronize()
        e1, e2 = ar.view("y1").get(), ar.view("y2").get()
        for got, ref, what in ((e1, ref1, "layer 1"), (e2, ref2, "layer 2")):
            rel, diag = _compare(bf16_values(got), ref, f"{plan.describe()} {what}")
            print(diag)
            assert rel <= FP8_TOL, diag
        ar.view("y1").fill(0)
        ar.view("y2").fill(0)
        _settle()
        g = graphs.capture(s, step)
        graphs.replay(g, s)
        s.synchronize()
        np.testing.assert_array_equal(ar.view("y1").get(), e1, err_msg="layer 1 in the graph")
        np.testing.assert_array_equal(ar.view("y2").get(), e2, err_msg="layer 2 in the graph")


@pytest.mark.parametrize("m", [1, 8, 16, 32])
def test_fp8_block_scaled_small_m_is_supported_or_refused_clearly(m, nvmath_ok):
    """Measured on H200 / cuBLASLt 13.x (2026-11-30): the BLK128x128 x VEC128 FP8 mode returned
    CUBLAS_STATUS_NOT_SUPPORTED from the heuristic at M=1.  A decode-shaped FP8 dense arm
    therefore needs its own GEMV (or padding M).  This test records which small M work and
    requires that an unsupported one fails at plan time with an error naming the GEMM key,
    never later inside a launch or a graph."""
    N, K = 1024, 2048
    rng = np.random.default_rng(3000 + m)
    w_codes, x_codes, a_scale, x_scale, ref = _fp8_problem(rng, m, N, K)
    key = GemmKey(m, N, K, **FP8_KEY)
    with cupy.cuda.Device(0):
        ar = _arena([("w", (N, K), "e4m3"), ("x", (m, K), "e4m3"), ("y", (m, N), "bf16"),
                     ("a_scale", key.a_scale_shape, "f32"), ("b_scale", key.b_scale_shape, "f32")])
        ar.view("w").set(w_codes)
        ar.view("x").set(x_codes)
        ar.view("a_scale").set(a_scale)
        ar.view("b_scale").set(np.ascontiguousarray(x_scale.T))
        _settle()
        lt = BlasLt(0, ar.view("ws"))
        try:
            plan = lt.plan(key)
        except BlasLtError as e:
            print(f"FP8 block-scaled M={m}: unsupported: {e}")
            assert key.label in str(e)
            return
        s = cupy.cuda.Stream(non_blocking=True)
        plan.run_arrays(ar.view("w"), ar.view("x"), ar.view("y"), s,
                        a_scale=ar.view("a_scale"), b_scale=ar.view("b_scale"))
        s.synchronize()
        rel, diag = _compare(bf16_values(ar.view("y").get()), ref, plan.describe())
        print(f"FP8 block-scaled M={m}: supported; {diag}")
        assert rel <= FP8_TOL, diag
