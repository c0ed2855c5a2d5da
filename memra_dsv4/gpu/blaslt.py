"""cuBLASLt GEMM plans for the linear layers, Y[M,N] = X[M,K] . W[N,K]^T (nvmath.bindings).

Contract
--------
* ``GemmKey`` (pure, CPU-testable) names one plan: rows ``m`` (a bucket, see ``m_buckets``),
  ``n`` (out features), ``k`` (in features), the logical dtypes of A = W, B = X and D = Y, the
  scale modes of A and B, and the epilogue.  Supported combinations (``SUPPORTED``):
    - bf16 x bf16 -> bf16 or f32, fp32 accumulate, no scales;
    - e4m3 x e4m3 -> bf16 or f32 with A (weights) scaled per 128x128 block
      (``blk128x128``: fp32 ``[ceil(N/128), K/128]`` row-major, the checkpoint's ``.scale``
      grid decoded from e8m0) and B (activations) per 1x128 block (``vec128``: fp32
      ``[K/128, M]`` row-major, TOKEN INDEX FASTEST, i.e. the transpose of the natural
      ``[M, K/128]``).  Both layouts verified on H200 (verified_on_h200.md); sm_90 only.
  Every buffer is row-major with a leading dimension equal to its row length.
* ``batch`` > 1 (unscaled bf16 keys only): a strided batch of ``batch`` independent GEMMs,
  Y[b] = X[b] . W[b]^T, operands packed back to back (W [batch, N, K], X [batch, M, K],
  Y [batch, M, N]; strides N*K, M*K, M*N elements), set as the layouts' BATCH_COUNT and
  STRIDED_BATCH_OFFSET.  The prefill MoE runs a group of experts this way (gpu.ops.prefill_moe).
  Each batch entry is the same f32-accumulated product as a batch-1 plan, though cuBLASLt may
  pick a different algorithm (a different summation order, bf16-class differences).
* Layouts (python_gpu_tooling.md 1.3, the "TN" trick; FP8 on Hopper requires it): cuBLASLt is
  column-major, so row-major W[N,K] is A = (K x N, ld K) with TRANSA = T; row-major X[M,K] is
  B = (K x M, ld K), TRANSB = N; row-major Y[M,N] is C = D = (N x M, ld N).
* ``BlasLt(device_id, workspace)`` owns one cuBLASLt handle and one workspace (a uint8 arena
  view, 32 MiB recommended).  ``BlasLt.plan(key)`` builds a ``GemmPlan`` once and caches it:
  the matmul descriptor (COMPUTE_32F, scale type 32F, TRANSA = T), the three layouts, the
  preference (MAX_WORKSPACE_BYTES = workspace size), ONE heuristic query, and the chosen algo
  struct.  Build every plan at warmup, before capture: heuristics are host work and the first
  one in a process costs ~100 ms.  Plans sharing a workspace must run on one stream (their
  uses of it are ordered by that stream); give each concurrently used stream its own BlasLt.
  ``BlasLt.plan_bf16_f32(m, n, k)`` is ``plan(GemmKey(m, n, k, "bf16", "bf16", "f32"))`` (the
  linears of ops_glue.GemmBackend) memoised on the three ints: a hit skips the key's
  construction, validation and dataclass hashing (~10 us of host time per linear, 855 linears
  a 1K prefill forward); a miss builds the key, so an invalid shape raises its ValueError as
  before; ``close`` empties it with the plans.
* ``GemmPlan.run(w_ptr, x_ptr, y_ptr, stream, a_scale_ptr=None, b_scale_ptr=None)`` is the
  hot path: raw device pointers, alpha = 1 and beta = 0 as host fp32 arrays kept alive by the
  plan (pointer mode host), the plan's device must be current.  FP8 plans set the two scale
  pointers on the descriptor before each call (different layers, same plan).  It is
  capturable into a CUDA graph together with RawKernels (verified).  ``run_arrays`` is the
  checked entry: it asserts shapes, dtypes, contiguity and device before calling ``run``
  (the checks' table is made once per plan, ``operand_specs``; an array's device is read as
  ``arr.data.device_id``, which is what CuPy's ``arr.device.id`` returns, without making a
  Device object).
* Enum values come from nvmath's enums at runtime (``MatmulDescAttribute``,
  ``MatmulMatrixScale``, ``cublas.ComputeType``, ``nvmath.CudaDataType``...); attribute
  buffers take the dtype ``get_*_attribute_dtype`` reports.  CuPy and nvmath are imported
  only when a ``BlasLt`` is built, so this module imports on CPU-only machines.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

__all__ = ["GemmKey", "GemmPlan", "BlasLt", "BlasLtError", "SUPPORTED", "DTYPE_ITEMSIZE",
           "m_buckets", "bucket_for", "DEFAULT_WORKSPACE_BYTES", "SCALE_BLOCK", "operand_specs"]

DTYPE_ITEMSIZE = {"bf16": 2, "f32": 4, "e4m3": 1}
STORAGE = {"bf16": np.dtype(np.uint16), "f32": np.dtype(np.float32), "e4m3": np.dtype(np.uint8)}
SCALE_MODES = ("none", "blk128x128", "vec128")
EPILOGUES = ("none",)
SCALE_BLOCK = 128
# (a_dtype, b_dtype, d_dtype, a_scale, b_scale)
SUPPORTED = frozenset({
    ("bf16", "bf16", "bf16", "none", "none"),
    ("bf16", "bf16", "f32", "none", "none"),
    ("e4m3", "e4m3", "bf16", "blk128x128", "vec128"),
    ("e4m3", "e4m3", "f32", "blk128x128", "vec128"),
})
DEFAULT_WORKSPACE_BYTES = 32 << 20   # 32 MiB, the cuBLAS recommendation for Hopper
MIN_BLOCK_SCALE_VERSION = 120900     # VEC128_32F / BLK128x128_32F arrived in cuBLAS 12.9
_SMALL_BUCKETS_MAX = 128             # powers of two up to here, then multiples of it


class BlasLtError(RuntimeError):
    """A GEMM plan could not be built or run (unsupported key, no algorithm, cuBLASLt error)."""


# ------------------------------------------------------------------------ buckets (pure)
def m_buckets(max_m: int) -> tuple[int, ...]:
    """Row buckets: 1, 2, 4, ..., 128, then 256, 384, ... up to max_m rounded up to 128.

    Decode batches are small powers of two; prefill chunks pay at most 127 padded rows."""
    max_m = int(max_m)
    if max_m < 1:
        raise ValueError(f"m_buckets: max_m={max_m} must be >= 1")
    out = []
    b = 1
    while b < min(max_m, _SMALL_BUCKETS_MAX):
        out.append(b)
        b *= 2
    out.append(min(b, _SMALL_BUCKETS_MAX))
    top = -(-max_m // _SMALL_BUCKETS_MAX) * _SMALL_BUCKETS_MAX
    out.extend(range(2 * _SMALL_BUCKETS_MAX, top + 1, _SMALL_BUCKETS_MAX))
    return tuple(out)


def bucket_for(m: int, buckets) -> int:
    """The smallest bucket >= m."""
    m = int(m)
    if m < 1:
        raise ValueError(f"bucket_for: m={m} must be >= 1")
    for b in buckets:
        if b >= m:
            return b
    raise ValueError(f"bucket_for: m={m} exceeds the largest bucket {max(buckets)}")


# ------------------------------------------------------------------------ the key (pure)
@dataclass(frozen=True)
class GemmKey:
    m: int
    n: int
    k: int
    a_dtype: str = "bf16"   # weights W[N, K]
    b_dtype: str = "bf16"   # activations X[M, K]
    d_dtype: str = "bf16"   # output Y[M, N]
    a_scale: str = "none"
    b_scale: str = "none"
    epilogue: str = "none"
    batch: int = 1          # strided batch count (see the module doc); 1 = one GEMM

    def __post_init__(self) -> None:
        for f in ("m", "n", "k", "batch"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemmKey.{f} = {v!r} must be a positive int")
            object.__setattr__(self, f, int(v))
        for f in ("a_dtype", "b_dtype", "d_dtype"):
            if getattr(self, f) not in DTYPE_ITEMSIZE:
                raise ValueError(f"GemmKey.{f} = {getattr(self, f)!r}; known: {sorted(DTYPE_ITEMSIZE)}")
        for f in ("a_scale", "b_scale"):
            if getattr(self, f) not in SCALE_MODES:
                raise ValueError(f"GemmKey.{f} = {getattr(self, f)!r}; known: {SCALE_MODES}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"GemmKey.epilogue = {self.epilogue!r}; implemented: {EPILOGUES}")
        combo = (self.a_dtype, self.b_dtype, self.d_dtype, self.a_scale, self.b_scale)
        if combo not in SUPPORTED:
            raise ValueError(f"GemmKey {self.label}: unsupported dtype/scale combination {combo}; "
                             f"supported: {sorted(SUPPORTED)}")
        # cuBLASLt wants every leading dimension a multiple of 16 bytes (FP8 requires it).
        if (self.k * DTYPE_ITEMSIZE[self.a_dtype]) % 16:
            raise ValueError(f"GemmKey {self.label}: K*itemsize(A) must be a multiple of 16 bytes")
        if (self.k * DTYPE_ITEMSIZE[self.b_dtype]) % 16:
            raise ValueError(f"GemmKey {self.label}: K*itemsize(B) must be a multiple of 16 bytes")
        if (self.n * DTYPE_ITEMSIZE[self.d_dtype]) % 16:
            raise ValueError(f"GemmKey {self.label}: N*itemsize(D) must be a multiple of 16 bytes")
        if self.block_scaled and self.k % SCALE_BLOCK:
            raise ValueError(f"GemmKey {self.label}: block-scaled FP8 needs K % {SCALE_BLOCK} == 0")
        if self.batch > 1 and self.block_scaled:
            raise ValueError(f"GemmKey {self.label}: batched plans are bf16 only (no scales)")

    @property
    def block_scaled(self) -> bool:
        return self.a_scale != "none"

    @property
    def label(self) -> str:
        s = f"gemm m{self.m} n{self.n} k{self.k} {self.a_dtype}x{self.b_dtype}->{self.d_dtype}"
        if self.block_scaled:
            s += f" scales {self.a_scale}/{self.b_scale}"
        if self.batch > 1:
            s += f" batch {self.batch}"
        return s

    # Shapes of the row-major operands the caller passes.
    @property
    def w_shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def x_shape(self) -> tuple[int, int]:
        return (self.m, self.k)

    @property
    def y_shape(self) -> tuple[int, int]:
        return (self.m, self.n)

    @property
    def a_scale_shape(self) -> tuple[int, int] | None:
        if self.a_scale != "blk128x128":
            return None
        return (math.ceil(self.n / SCALE_BLOCK), self.k // SCALE_BLOCK)

    @property
    def b_scale_shape(self) -> tuple[int, int] | None:
        if self.b_scale != "vec128":
            return None
        return (self.k // SCALE_BLOCK, self.m)  # token index fastest

    def layouts(self) -> dict[str, tuple[str, int, int, int]]:
        """cuBLASLt column-major layouts (dtype, rows, cols, ld) of A, B, C and D."""
        return {
            "A": (self.a_dtype, self.k, self.n, self.k),   # W[N,K] row-major, used transposed
            "B": (self.b_dtype, self.k, self.m, self.k),   # X[M,K] row-major
            "C": (self.d_dtype, self.n, self.m, self.n),   # Y[M,N] row-major
            "D": (self.d_dtype, self.n, self.m, self.n),
        }

    def batch_strides(self) -> dict[str, int]:
        """Elements between consecutive batch entries of A (W), B (X) and D (Y)."""
        return {"A": self.n * self.k, "B": self.m * self.k, "D": self.m * self.n}

    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def operand_specs(key: GemmKey) -> tuple:
    """run_arrays' checks of (W, X, Y): (label, shape, storage dtype, logical dtype, exact) each.
    W must be exactly [N, K]; X and Y may have spare rows beyond M (bucket padding).  Batched:
    every operand exactly [batch, rows, cols] (the strides are fixed in the plan)."""
    specs = [("w", key.w_shape, key.a_dtype, True),
             ("x", key.x_shape, key.b_dtype, False),
             ("y", key.y_shape, key.d_dtype, False)]
    if key.batch > 1:
        specs = [(label, (key.batch,) + shape, dt, True) for label, shape, dt, _ in specs]
    return tuple((label, shape, STORAGE[dt], dt, exact) for label, shape, dt, exact in specs)


# ------------------------------------------------------------------------ GPU side
def _lt():
    from nvmath.bindings import cublasLt

    return cublasLt


def _current_device() -> int:
    """cupy.cuda.runtime.getDevice(), with CuPy taken from sys.modules (an import statement per
    GEMM costs ~0.4 us of host time)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        import cupy as cp
    return cp.cuda.runtime.getDevice()


def _cuda_dtype(logical: str) -> int:
    from nvmath import CudaDataType

    return int({"bf16": CudaDataType.CUDA_R_16BF, "f32": CudaDataType.CUDA_R_32F,
                "e4m3": CudaDataType.CUDA_R_8F_E4M3}[logical])


def _attr_buffer(dtype_fn, attr, value) -> np.ndarray:
    return np.array([value], dtype=dtype_fn(int(attr)))


class BlasLt:
    """A cuBLASLt handle, a workspace, and the plans built on them, for one device."""

    def __init__(self, device_id: int, workspace) -> None:
        import cupy

        lt = _lt()
        self.device_id = int(device_id)
        if workspace.device.id != self.device_id:
            raise BlasLtError(f"BlasLt(device {self.device_id}): workspace lives on device "
                              f"{workspace.device.id}")
        if workspace.dtype != np.uint8 or not workspace.flags.c_contiguous or workspace.ndim != 1:
            raise BlasLtError(f"BlasLt: workspace must be a contiguous 1-D uint8 view, got "
                              f"{workspace.dtype} shape {workspace.shape}")
        if workspace.data.ptr % 256:
            raise BlasLtError("BlasLt: workspace must be 256-byte aligned")
        self.workspace = workspace
        self.workspace_ptr = int(workspace.data.ptr)
        self.workspace_bytes = int(workspace.nbytes)
        with cupy.cuda.Device(self.device_id):
            self.handle = lt.create()
        self.version = int(lt.get_version())
        self._plans: dict[GemmKey, GemmPlan] = {}
        self._bf16_f32: dict[tuple[int, int, int], GemmPlan] = {}   # plan_bf16_f32's memo

    def plan(self, key: GemmKey) -> "GemmPlan":
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = GemmPlan(key, self)
        return p

    def plan_bf16_f32(self, m: int, n: int, k: int) -> "GemmPlan":
        """``plan(GemmKey(m, n, k, "bf16", "bf16", "f32"))``, memoised on (m, n, k) (module doc):
        the same plan object ``plan`` caches for that key."""
        p = self._bf16_f32.get((m, n, k))
        if p is None:
            p = self._bf16_f32[(m, n, k)] = self.plan(GemmKey(m, n, k, "bf16", "bf16", "f32"))
        return p

    def build_all(self, keys) -> list["GemmPlan"]:
        return [self.plan(k) for k in keys]

    @property
    def plans(self) -> dict:
        return dict(self._plans)

    def close(self) -> None:
        for p in self._plans.values():
            p.close()
        self._plans.clear()
        self._bf16_f32.clear()   # its plans were closed just above
        if getattr(self, "handle", None):
            _lt().destroy(self.handle)
            self.handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class GemmPlan:
    """Descriptor, layouts and the chosen algorithm for one ``GemmKey``; ``run`` enqueues it."""

    HEURISTIC_CANDIDATES = 8

    def __init__(self, key: GemmKey, lt_ctx: BlasLt) -> None:
        import cupy
        from nvmath.bindings import cublas

        lt = _lt()
        self.key = key
        self._specs = operand_specs(key)   # run_arrays' checks, made once
        self._ctx = lt_ctx   # keeps the handle and the workspace alive as long as the plan
        self.device_id = lt_ctx.device_id
        self.handle = lt_ctx.handle
        self.workspace_ptr = lt_ctx.workspace_ptr
        self.workspace_bytes = lt_ctx.workspace_bytes
        self.desc = self.a_layout = self.b_layout = self.d_layout = 0
        if key.block_scaled and lt_ctx.version < MIN_BLOCK_SCALE_VERSION:
            raise BlasLtError(f"{key.label}: cuBLASLt {lt_ctx.version} has no VEC128/BLK128x128 "
                              f"scale modes (need >= {MIN_BLOCK_SCALE_VERSION})")
        A = lt.MatmulDescAttribute
        desc_dtype = lt.get_matmul_desc_attribute_dtype
        with cupy.cuda.Device(self.device_id):
            try:
                self.desc = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F),
                                                  _cuda_dtype("f32"))
                self._set_desc(A.TRANSA, int(cublas.Operation.T))
                self._set_desc(A.TRANSB, int(cublas.Operation.N))
                if key.block_scaled:
                    self._set_desc(A.A_SCALE_MODE, int(lt.MatmulMatrixScale.BLK128x128_32F))
                    self._set_desc(A.B_SCALE_MODE, int(lt.MatmulMatrixScale.VEC128_32F))
                layouts = key.layouts()   # C = D: beta is 0, C is never read
                for attr, which in (("a_layout", "A"), ("b_layout", "B"), ("d_layout", "D")):
                    dtype, rows, cols, ld = layouts[which]
                    setattr(self, attr, lt.matrix_layout_create(_cuda_dtype(dtype), rows, cols, ld))
                    if key.batch > 1:
                        self._set_batch(getattr(self, attr), key.batch,
                                        key.batch_strides()[which])
            except Exception as e:
                self.close()
                raise BlasLtError(f"{key.label}: building descriptors failed: {e}") from e

            # Per-call scale pointers live in these buffers (set on the descriptor in run()).
            self._a_scale_buf = _attr_buffer(desc_dtype, A.A_SCALE_POINTER, 0)
            self._b_scale_buf = _attr_buffer(desc_dtype, A.B_SCALE_POINTER, 0)
            if key.block_scaled:
                # The heuristic may refuse null scale pointers; any valid device address serves
                # (it is never dereferenced at planning); run() sets the real ones.
                self._set_scale_pointers(self.workspace_ptr, self.workspace_ptr)
            self._choose_algorithm(lt)

        # Host scalars (pointer mode host): alpha = 1, beta = 0, fp32 = the scale type.
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._alpha_ptr = int(self._alpha.ctypes.data)
        self._beta_ptr = int(self._beta.ctypes.data)
        self._a_scale_attr = int(A.A_SCALE_POINTER)
        self._b_scale_attr = int(A.B_SCALE_POINTER)
        self._a_scale_addr = int(self._a_scale_buf.ctypes.data)
        self._b_scale_addr = int(self._b_scale_buf.ctypes.data)
        self._scale_ptr_size = int(self._a_scale_buf.itemsize)
        self._matmul = lt.matmul
        self._set_attr = lt.matmul_desc_set_attribute

    # ------------------------------------------------------------------ building helpers
    def _set_desc(self, attr, value) -> None:
        lt = _lt()
        buf = _attr_buffer(lt.get_matmul_desc_attribute_dtype, attr, value)
        lt.matmul_desc_set_attribute(self.desc, int(attr), buf.ctypes.data, buf.itemsize)

    @staticmethod
    def _set_batch(layout, count: int, stride: int) -> None:
        lt = _lt()
        L = lt.MatrixLayoutAttribute
        for attr, value in ((L.BATCH_COUNT, count), (L.STRIDED_BATCH_OFFSET, stride)):
            buf = _attr_buffer(lt.get_matrix_layout_attribute_dtype, attr, value)
            lt.matrix_layout_set_attribute(layout, int(attr), buf.ctypes.data, buf.itemsize)

    def _set_scale_pointers(self, a_ptr: int, b_ptr: int) -> None:
        lt = _lt()
        A = lt.MatmulDescAttribute
        self._a_scale_buf[0] = a_ptr
        self._b_scale_buf[0] = b_ptr
        lt.matmul_desc_set_attribute(self.desc, int(A.A_SCALE_POINTER),
                                     self._a_scale_buf.ctypes.data, self._a_scale_buf.itemsize)
        lt.matmul_desc_set_attribute(self.desc, int(A.B_SCALE_POINTER),
                                     self._b_scale_buf.ctypes.data, self._b_scale_buf.itemsize)

    def _choose_algorithm(self, lt) -> None:
        P = lt.MatmulPreferenceAttribute
        pref = lt.matmul_preference_create()
        try:
            buf = _attr_buffer(lt.get_matmul_preference_attribute_dtype, P.MAX_WORKSPACE_BYTES,
                               self.workspace_bytes)
            lt.matmul_preference_set_attribute(pref, int(P.MAX_WORKSPACE_BYTES),
                                               buf.ctypes.data, buf.itemsize)
            results = lt.MatmulHeuristicResult(self.HEURISTIC_CANDIDATES)
            count = np.zeros(1, dtype=np.int32)
            try:
                lt.matmul_algo_get_heuristic(self.handle, self.desc, self.a_layout, self.b_layout,
                                             self.d_layout, self.d_layout, pref,
                                             self.HEURISTIC_CANDIDATES, results.ptr,
                                             count.ctypes.data)
            except Exception as e:
                raise BlasLtError(f"{self.key.label}: cublasLtMatmulAlgoGetHeuristic failed: {e}") from e
        finally:
            lt.matmul_preference_destroy(pref)
        n_found = int(count[0])
        states = np.atleast_1d(np.asarray(results.state))[:n_found]
        ws_sizes = np.atleast_1d(np.asarray(results.workspace_size))[:n_found]
        usable = [i for i in range(n_found)
                  if int(states[i]) == 0 and int(ws_sizes[i]) <= self.workspace_bytes]
        if not usable:
            raise BlasLtError(f"{self.key.label}: cuBLASLt heuristic returned no usable algorithm "
                              f"({n_found} candidates, states {states.tolist()}, workspace "
                              f"{ws_sizes.tolist()} vs {self.workspace_bytes} available)")
        dt = lt.matmul_heuristic_result_dtype
        # The algo struct is the first member of cublasLtMatmulHeuristicResult_t.
        assert dt.fields["algo"][1] == 0, "cublasLtMatmulHeuristicResult_t.algo is not at offset 0"
        self.algo_index = usable[0]
        self.algo_workspace_bytes = int(ws_sizes[self.algo_index])
        self.n_candidates = n_found
        self._results = results  # keeps the algo struct alive
        self.algo_ptr = int(results.ptr) + self.algo_index * dt.itemsize

    # ------------------------------------------------------------------ execution
    def run(self, w_ptr: int, x_ptr: int, y_ptr: int, stream, a_scale_ptr: int | None = None,
            b_scale_ptr: int | None = None) -> None:
        """Enqueue Y = X . W^T on ``stream`` (a CuPy stream or a raw handle)."""
        if self.key.block_scaled:
            if a_scale_ptr is None or b_scale_ptr is None:
                raise BlasLtError(f"{self.key.label}: FP8 block-scaled plan needs a_scale_ptr "
                                  f"and b_scale_ptr")
            self._a_scale_buf[0] = a_scale_ptr
            self._b_scale_buf[0] = b_scale_ptr
            self._set_attr(self.desc, self._a_scale_attr, self._a_scale_addr, self._scale_ptr_size)
            self._set_attr(self.desc, self._b_scale_attr, self._b_scale_addr, self._scale_ptr_size)
        self._matmul(self.handle, self.desc, self._alpha_ptr, w_ptr, self.a_layout, x_ptr,
                     self.b_layout, self._beta_ptr, y_ptr, self.d_layout, y_ptr, self.d_layout,
                     self.algo_ptr, self.workspace_ptr, self.workspace_bytes,
                     getattr(stream, "ptr", stream))

    def run_arrays(self, w, x, y, stream, a_scale=None, b_scale=None) -> None:
        """``run`` with every operand checked: shapes, storage dtypes, contiguity, device
        (``operand_specs``; the same checks and messages as the loop over a fresh table)."""
        key = self.key
        dev = self.device_id
        for (label, shape, storage, dt, exact), arr in zip(self._specs, (w, x, y)):
            ashape = arr.shape
            ok_shape = ashape == shape if exact else (
                len(ashape) == 2 and ashape[1] == shape[1] and ashape[0] >= shape[0])
            if not ok_shape:
                raise BlasLtError(f"{key.label}: {label} has shape {ashape}, expected "
                                  f"{'' if exact else '>= '}{shape}")
            if arr.dtype != storage:
                raise BlasLtError(f"{key.label}: {label} stored as {arr.dtype}, expected "
                                  f"{storage} ({dt})")
            if not arr.flags.c_contiguous:
                raise BlasLtError(f"{key.label}: {label} is not C-contiguous")
            if arr.data.device_id != dev:   # = arr.device.id, without a Device object
                raise BlasLtError(f"{key.label}: {label} is on device {arr.data.device_id}, plan "
                                  f"on {dev}")
        current = _current_device()
        if current != dev:
            raise BlasLtError(f"{key.label}: current device is {current}, "
                              f"plan was built for {dev}")
        a_ptr = b_ptr = None
        if key.block_scaled:
            for label, arr, shape in (("a_scale", a_scale, key.a_scale_shape),
                                      ("b_scale", b_scale, key.b_scale_shape)):
                if arr is None or arr.shape != shape or arr.dtype != np.float32 \
                        or not arr.flags.c_contiguous or arr.data.device_id != dev:
                    got = None if arr is None else (arr.shape, str(arr.dtype))
                    raise BlasLtError(f"{key.label}: {label} must be contiguous float32 {shape} on "
                                      f"device {dev}, got {got}")
            a_ptr, b_ptr = a_scale.data.ptr, b_scale.data.ptr
        elif a_scale is not None or b_scale is not None:
            raise BlasLtError(f"{key.label}: scales given to an unscaled plan")
        self.run(w.data.ptr, x.data.ptr, y.data.ptr, stream, a_ptr, b_ptr)

    def close(self) -> None:
        lt = _lt()
        for attr in ("a_layout", "b_layout", "d_layout"):
            h = getattr(self, attr, 0)
            if h:
                lt.matrix_layout_destroy(h)
                setattr(self, attr, 0)
        if getattr(self, "desc", 0):
            lt.matmul_desc_destroy(self.desc)
            self.desc = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def describe(self) -> str:
        return (f"{self.key.label}: algo #{self.algo_index} of {self.n_candidates}, "
                f"workspace {self.algo_workspace_bytes} B")
