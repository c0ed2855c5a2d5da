"""CuPy twins of the oracle primitives (memra_dsv4.oracle.ops, bf16 class), for the GPU prefill.

Contract
--------
* Activations are float32 CuPy arrays whose values lie on the bf16 grid wherever the oracle
  ``store``s them (``store`` = RNE to bf16 with the kernels' bit trick, kept in float32);
  fp32 islands stay float32.  bf16 weights are uint16 bit patterns (the arena convention).
* Each function mirrors the oracle function of the same name with the ``bf16`` policy: the
  same order of roundings, short reductions in index order, float64 where the oracle
  accumulates in float64 for the non-GEMM islands (norm statistics, hc mixes and Sinkhorn
  inputs, pooling, RoPE).  GEMMs run on bf16 inputs with fp32 accumulation (cuBLASLt via
  ``memra_dsv4.gpu.blaslt``, or ``cupy.matmul`` in fp32 with ``MEMRA_DSV4_GEMM=cupy``), and the
  sparse attention / indexer scores accumulate in fp32: those are the only places the GPU
  path differs from the oracle (which rounds a float64 accumulation once), hence bf16-class
  bounds, not bitwise equality, in the tests.
* Discrete choices (router top-k, indexer top-k) sort a 64-bit composite key (score bits,
  then the index), so ties go to the lower index exactly as ``host.indices.topk_desc`` /
  ``host.routing.select_learned``, independent of sort stability.
* The routed-expert dequantisation uses kernels_cu/experts.cu (dequant_mxfp4_bf16 /
  dequant_nvfp4_bf16) and falls back to a CuPy formula if that module fails to build.
* Dense FP8 weights (``MEMRA_DSV4_DENSE=fp8``: uint8 e4m3 + uint8 e8m0 128x128 scales, see
  gpu.weights): ``linear(g, x, w, out, scale=...)`` / ``GemmBackend.mm(x, w, scale=...)``
  dequantise ``w`` exactly into the backend's bf16 scratch (kernels_cu/dense.cu, one scratch per
  device, grown on demand) and run the same bf16 GEMM, so the result equals the bf16 arm's bit
  for bit.  The scratch is reused by the next dequant: ``GemmBackend.dense_bf16`` returns a view
  that is valid until then (stream order makes an already enqueued GEMM on it safe).
* ``to_f32`` / ``bf16_bits`` / ``store`` launch kernels_cu/convert.cu (gpu.ops.convert) for a
  C-contiguous, non-empty, at least 1-d CuPy input of their own dtype (uint16, resp. float32) and
  a CuPy ElementwiseKernel otherwise; both run the same integer RNE formula (``_RNE``), so the
  outputs are the same bits either way (the raw kernel only saves host time per call).  The
  module flag ``RAW_CONVERT = False`` sends every input to the ElementwiseKernels (an A/B switch
  for tools/profile_prefill_host.py --convert; not a seam: the bytes do not change).
* ``swiglu_clamped`` on float32 CuPy gate / up with limit > 0 and no weight is one
  ElementwiseKernel whose steps are the CuPy ufuncs' expressions (the same bytes as the CuPy
  chain, ``swiglu_clamped_chain``, which every other call takes).
These are orchestration-level building blocks; the fused kernels of kernels_cu/ replace them
one by one (same signatures, same tests).
"""

from __future__ import annotations

import sys

import numpy as np

from memra_dsv4.gpu.ops import convert as _CV   # registers kernels_cu/convert.cu; no CuPy import
from memra_dsv4.host.quant import ACT_AMAX_FLOOR, FP4_AMAX_FLOOR
from memra_dsv4.seams import SEAM_GEMM, env_value

__all__ = ["GemmBackend", "to_f32", "bf16_bits", "store", "rmsnorm", "rmsnorm_rope_bits",
           "head_rms", "rope",
           "hc_pre", "hc_post", "hc_head", "kv_sim", "fp4_sim", "hadamard", "compress_pool",
           "compress_candidates", "topk_desc_rows", "candidates", "sparse_attention",
           "route_learned", "route_weights", "sqrtsoftplus", "swiglu_clamped", "moe_combine",
           "dequant_fp4_bf16", "sort_key_desc"]

_GEMM_MODE = env_value(SEAM_GEMM)  # validated against the seam registry (blaslt / cupy)
_MODULES = sys.modules


def _cp():
    # sys.modules directly: an import statement costs ~0.4 us and this runs ~5,000 times a 1K
    # prefill forward (tests replace this function, or put a stand-in in sys.modules)
    cp = _MODULES.get("cupy")
    if cp is None:
        import cupy as cp
    return cp


def _on_device(x):
    """cupy.asarray(x): x itself when it is a CuPy array on the current device (what asarray
    returns for it: CuPy's _array_from_cupy_ndarray, same dtype, copy=None), without the ~2 us
    of that call; anything else (host data, another device's array) goes through asarray."""
    cp = _cp()
    if isinstance(x, cp.ndarray) and x.data.device_id == cp.cuda.runtime.getDevice():
        return x
    return cp.asarray(x)


# ------------------------------------------------------------------------- bf16 helpers
# One elementwise kernel each (one read, one write): the activations of a long prefill are
# GiB-sized ([8192, 64, 512] f32 = 1 GiB), and the CuPy expressions these replace made five
# or six full-size temporaries per call.  Same integer formula, so the same bits.
#
# The common input (a C-contiguous, non-empty, at least 1-d CuPy array of the kernel's own dtype)
# goes to the RawKernels of kernels_cu/convert.cu (gpu.ops.convert) instead: the same formula
# (_RNE, integers only), so the same bits for every input pattern, at a fraction of the host
# cost (an ElementwiseKernel call is ~15 us of CuPy's machinery: 3542 store + 3201 bf16_bits +
# 1701 to_f32 calls = ~130 ms of the host thread in an 8K prefill forward,
# bench/results/2026-11-30-nvidia-h200-2624ca0-prof5.log).  Everything else (strided views,
# other dtypes - float64 included, cast by _as_f32 - 0-d and empty arrays) keeps the
# ElementwiseKernel path and its outputs.
# RAW_CONVERT False sends every input to the ElementwiseKernels (tools/profile_prefill_host.py
# --convert ab times the two routes in one process; the bytes are the same either way).
RAW_CONVERT = True
_EW: dict = {}
_RNE = "unsigned int u = __float_as_uint(x); unsigned int b = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;"


def _ew(name: str):
    k = _EW.get(name)
    if k is None:
        cp = _cp()
        k = _EW[name] = {
            "to_f32": lambda: cp.ElementwiseKernel(
                "uint16 h", "float32 y", "y = __uint_as_float(((unsigned int)h) << 16)",
                "memra_bf16_to_f32"),
            "bits": lambda: cp.ElementwiseKernel(
                "float32 x", "uint16 y", _RNE + " y = (unsigned short)b;", "memra_f32_to_bf16"),
            "store": lambda: cp.ElementwiseKernel(
                "float32 x", "float32 y", _RNE + " y = __uint_as_float(b << 16);",
                "memra_f32_store_bf16"),
        }[name]()
    return k


def to_f32(u16):
    """bf16 bit patterns (uint16) -> float32, exact."""
    cp = _cp()
    u16 = _on_device(u16)
    if u16.dtype != cp.uint16:   # the historical formula for other integer storage
        return (u16.astype(cp.uint32) << 16).view(cp.float32)
    if RAW_CONVERT and u16.ndim and u16.size and u16.flags.c_contiguous:   # the raw kernel (see above)
        return _CV.bf16_to_f32(u16)
    return _ew("to_f32")(u16)


def _as_f32(x):
    """float32 view/copy of x (float64 and others: one RN cast first, as astype)."""
    cp = _cp()
    x = _on_device(x)   # host inputs are uploaded, as cp.ascontiguousarray did
    return x if x.dtype == cp.float32 else x.astype(cp.float32)


def bf16_bits(x):
    """float32 -> bf16 bits, RNE (u += 0x7FFF + ((u >> 16) & 1)), as host.quant.round_bf16
    (float64 inputs are rounded to float32 first)."""
    x = _on_device(x)
    if RAW_CONVERT and x.dtype == _cp().float32 and x.ndim and x.size and x.flags.c_contiguous:
        return _CV.f32_to_bf16_bits(x)   # the raw kernel (see above)
    return _ew("bits")(_as_f32(x))


def store(x):
    """A bf16-kept tensor: RNE to bf16, held as float32 (float64 inputs go through float32)."""
    x = _on_device(x)
    if RAW_CONVERT and x.dtype == _cp().float32 and x.ndim and x.size and x.flags.c_contiguous:
        return _CV.f32_store_bf16(x)     # the raw kernel (see above)
    return _ew("store")(_as_f32(x))


# ------------------------------------------------------------------------------ GEMMs
class GemmBackend:
    """Y[M, N] = X[M, K] . W[N, K]^T with bf16 X (float32 bf16-valued) and bf16-bit W.

    One per device.  cuBLASLt bf16 x bf16 -> f32 plans are built on first use of a shape and
    cached (BlasLt caches by GemmKey; ``mm`` asks ``BlasLt.plan_bf16_f32(M, N, K)``, the same
    plan without a key per call).  FP8-stored weights go through ``dense_bf16`` (the device's
    reused bf16 scratch) and then the same plan."""

    def __init__(self, device_id: int, mode: str | None = None) -> None:
        cp = _cp()
        self.device_id = int(device_id)
        self.mode = mode or _GEMM_MODE
        self.lt = None
        self.flops = 0
        self._dense_scratch = None   # uint16 flat, grown on demand (dense_bf16)
        if self.mode == "blaslt":
            from memra_dsv4.gpu.blaslt import DEFAULT_WORKSPACE_BYTES, BlasLt

            with cp.cuda.Device(self.device_id):
                self.workspace = cp.zeros(DEFAULT_WORKSPACE_BYTES, dtype=cp.uint8)
            self.lt = BlasLt(self.device_id, self.workspace)

    def dense_bf16(self, w_u8, scale_u8):
        """An FP8 weight (uint8 e4m3 [N, K] + uint8 e8m0 [ceil(N/128), ceil(K/128)]) as bf16
        bits [N, K] in this device's scratch: a view valid until the next dense_bf16 call."""
        cp = _cp()
        from memra_dsv4.gpu.ops.dense import dequant_fp8_bf16
        n = int(w_u8.size)
        buf = self._dense_scratch
        if buf is None or buf.size < n:
            with cp.cuda.Device(self.device_id):
                if buf is not None:   # GEMMs enqueued on the old buffer finish before it goes
                    cp.cuda.get_current_stream().synchronize()
                self._dense_scratch = buf = cp.empty(max(n, 1), dtype=cp.uint16)
        out = buf[:n].reshape(w_u8.shape)
        return dequant_fp8_bf16(w_u8, scale_u8, out)

    def mm(self, x, w_u16, scale=None):
        """float32 [M, N] = bf16(x) . w^T, fp32 accumulation.  x: float32 (rounded to bf16
        here; a no-op when x is already bf16-valued) or uint16 bits; w_u16: uint16 [N, K], or
        with ``scale`` an FP8 weight (uint8 e4m3 [N, K], scale uint8 e8m0 128x128 blocks),
        dequantised exactly into the scratch first (dense_bf16)."""
        cp = _cp()
        if scale is not None:
            w_u16 = self.dense_bf16(w_u16, scale)
        if w_u16.dtype != cp.uint16:
            raise ValueError(f"gemm: weight dtype {w_u16.dtype}; expected uint16 bf16 bits (an "
                             f"FP8 uint8 weight needs its scale=)")
        xb = x if x.dtype == cp.uint16 else bf16_bits(x)
        if not xb.flags.c_contiguous:   # ascontiguousarray returns a contiguous 2-D xb itself
            xb = cp.ascontiguousarray(xb)
        M, K = xb.shape
        N, K2 = w_u16.shape
        if K != K2:
            raise ValueError(f"gemm: x [{M}, {K}] vs w [{N}, {K2}]")
        self.flops += 2 * M * N * K
        if self.mode == "cupy":
            return cp.matmul(to_f32(xb), to_f32(w_u16).T)
        y = cp.empty((M, N), dtype=cp.float32)
        plan = self.lt.plan_bf16_f32(M, N, K)   # = lt.plan(GemmKey(M, N, K, bf16, bf16, f32))
        if not w_u16.flags.c_contiguous:   # stored weights are; ascontiguousarray returns them
            w_u16 = cp.ascontiguousarray(w_u16)
        plan.run_arrays(w_u16, xb, y, cp.cuda.get_current_stream())
        return y

    def mm_batched(self, x_u16, w_u16, y):
        """y[b*m:(b+1)*m] = x[b*m:(b+1)*m] . w[b]^T for b < n, fp32 accumulation, into the
        float32 [n*m, N] ``y``: x uint16 [n*m, K] bf16 bits, w uint16 [n, N, K] (a group of
        dequantised experts).  One strided-batched cuBLASLt GEMM (plan cached per (m, N, K, n));
        every operand contiguous and 256-byte aligned (the heuristic's default assumption)."""
        cp = _cp()
        n, N, K = w_u16.shape
        rows = x_u16.shape[0]
        if (x_u16.dtype != cp.uint16 or w_u16.dtype != cp.uint16 or y.dtype != cp.float32
                or x_u16.ndim != 2 or x_u16.shape[1] != K or rows % n
                or y.shape != (rows, N)):
            raise ValueError(f"mm_batched: x {x_u16.dtype} {x_u16.shape}, w {w_u16.dtype} "
                             f"{w_u16.shape}, y {y.dtype} {y.shape}")
        m = rows // n
        self.flops += 2 * rows * N * K
        if self.mode == "cupy":
            y[...] = cp.matmul(to_f32(x_u16).reshape(n, m, K),
                               to_f32(w_u16).transpose(0, 2, 1)).reshape(rows, N)
            return y
        from memra_dsv4.gpu.blaslt import GemmKey
        for a in (x_u16, w_u16, y):
            if not a.flags.c_contiguous or a.data.ptr % 256:
                raise ValueError(f"mm_batched: operand at {a.data.ptr:#x} must be contiguous "
                                 f"and 256-byte aligned")
        plan = self.lt.plan(GemmKey(m, N, K, "bf16", "bf16", "f32", batch=n))
        if n == 1:   # a batch-1 key is the plain GEMM plan, whose operands are 2-D
            plan.run_arrays(w_u16.reshape(N, K), x_u16, y, cp.cuda.get_current_stream())
        else:
            plan.run_arrays(w_u16, x_u16.reshape(n, m, K), y.reshape(n, m, N),
                            cp.cuda.get_current_stream())
        return y


def linear(g: GemmBackend, x, w_u16, out: str = "bf16", scale=None):
    """oracle ops.linear for kinds fp8/fp4/bf16 (out='bf16': stored) and f32 (out='f32').
    ``scale``: the e8m0 block scale of an FP8-stored weight (uint8 w), else None."""
    if x.ndim == 2:   # the reshapes below would be same-shape views (~2 us each): skipped
        y = g.mm(x, w_u16, scale)
    else:
        lead = x.shape[:-1]
        y = g.mm(x.reshape(-1, x.shape[-1]), w_u16, scale)
        y = y.reshape(*lead, w_u16.shape[0])
    return store(y) if out == "bf16" else y


# ------------------------------------------------------------------------------ norms
def rmsnorm(x, w_f64, eps: float):
    cp = _cp()
    x64 = x.astype(cp.float64)
    r = 1.0 / cp.sqrt(cp.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return store((w_f64 * (x64 * r)).astype(cp.float32))


def rmsnorm_rope_bits(x, w_u16, eps: float, cos=None, sin=None, pre_store: bool = False):
    """bf16 bits of ``rope(rmsnorm(v, f64(w), eps), cos, sin)`` (no RoPE when cos is None),
    v = x or store(x) with ``pre_store``: the same bits as those two CuPy chains (which stay the
    reference) in three launches (ops.compressor.chain_squares, cupy.mean, chain_rms_rope)
    instead of ~25.  The row statistic is cupy.mean over the same [n, D] float64 squares as
    rmsnorm's ``mean(x64 * x64)``, so it is the same reduction; x must be 2-D for that reason
    (the chain's callers pass [rows, D]).  w_u16: the bf16-bit norm weight."""
    cp = _cp()
    from memra_dsv4.gpu.ops import compressor as CM
    x = _as_f32(x)
    if x.ndim != 2:
        raise ValueError(f"rmsnorm_rope_bits: x {x.shape}; expected [rows, D]")
    mean = cp.mean(CM.chain_squares(x, pre_store), axis=-1, keepdims=True)
    return CM.chain_rms_rope(x, mean, w_u16, eps, cos, sin, pre_store=pre_store)


def head_rms(x, eps: float):
    """NumericsPolicy.head_rms of the bf16 class (bf16 tensor arithmetic)."""
    cp = _cp()
    sq = store(x * x)
    mean = store(cp.mean(sq.astype(cp.float64), axis=-1, keepdims=True).astype(cp.float32))
    var = store(mean + cp.float32(eps))
    r = store((1.0 / cp.sqrt(var.astype(cp.float64))).astype(cp.float32))
    return store(x * r)


def rope(x, cos, sin, inverse: bool = False):
    """ops.apply_rope: interleaved pairs on the last 2P dims, float64, stored.  cos/sin
    float32 CuPy arrays broadcastable to x[..., :P]."""
    cp = _cp()
    P = cos.shape[-1]
    D = x.shape[-1]
    out = x.copy()
    r = x[..., D - 2 * P:].astype(cp.float64)
    a, b = r[..., 0::2], r[..., 1::2]
    c = cos.astype(cp.float64)
    s = sin.astype(cp.float64)
    if inverse:
        s = -s
    rot = cp.empty(r.shape, dtype=cp.float64)
    rot[..., 0::2] = a * c - b * s
    rot[..., 1::2] = a * s + b * c
    out[..., D - 2 * P:] = rot.astype(cp.float32)
    return store(out)


# -------------------------------------------------------------------- hyper-connections
def _sigmoid32(x):
    cp = _cp()
    one = cp.float32(1)
    return (one / (one + cp.exp(-x))).astype(cp.float32)


def _hc_mixes(X, fn_f64, norm_eps: float):
    cp = _cp()
    x = X.reshape(X.shape[0], -1).astype(cp.float64)
    r = 1.0 / cp.sqrt(cp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    return (cp.matmul(x, fn_f64.T) * r).astype(cp.float32)


def _weighted(X, pre):
    cp = _cp()
    X64, p64 = X.astype(cp.float64), pre.astype(cp.float64)
    acc = p64[:, 0, None] * X64[:, 0, :]
    for i in range(1, X.shape[1]):
        acc = acc + p64[:, i, None] * X64[:, i, :]
    return acc


def _sinkhorn(L, iters: int, eps: float):
    cp = _cp()
    e = cp.float32(eps)
    m = L.max(axis=-1, keepdims=True)
    C = cp.exp(L - m)
    rs = C[..., 0] + C[..., 1] + C[..., 2] + C[..., 3]  # hc = 4 (config enforces), in order

    def rowsum(C):
        return C[..., 0] + C[..., 1] + C[..., 2] + C[..., 3]

    def colsum(C):
        return C[..., 0, :] + C[..., 1, :] + C[..., 2, :] + C[..., 3, :]

    C = C / rs[..., :, None] + e
    C = C / (colsum(C)[..., None, :] + e)
    for _ in range(iters - 1):
        C = C / (rowsum(C)[..., :, None] + e)
        C = C / (colsum(C)[..., None, :] + e)
    return C.astype(cp.float32)


def hc_pre(streams, fn_f64, scale, base, *, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """ops.hc_pre: (y [T, D] stored, post [T, hc] f32, comb [T, hc, hc] f32).
    scale/base: float32 CuPy arrays."""
    cp = _cp()
    mixes = _hc_mixes(streams, fn_f64, norm_eps)
    T = mixes.shape[0]
    pre = _sigmoid32(mixes[:, :hc] * scale[0] + base[:hc]) + cp.float32(hc_eps)
    post = cp.float32(2) * _sigmoid32(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(T, hc, hc)
    comb = _sinkhorn(logits.astype(cp.float32), iters, hc_eps)
    y = store(_weighted(streams, pre.astype(cp.float32)).astype(cp.float32))
    return y, post.astype(cp.float32), comb


def hc_post(f, residual, post, comb):
    """ops.hc_post: new_j = store(post_j f + sum_i comb[i, j] R_i), float64, i ascending."""
    cp = _cp()
    f64 = f.astype(cp.float64)
    R = residual.astype(cp.float64)
    P = post.astype(cp.float64)
    C = comb.astype(cp.float64)
    acc = P[:, :, None] * f64[:, None, :]
    for i in range(R.shape[1]):
        acc = acc + C[:, i, :, None] * R[:, i, None, :]
    return store(acc.astype(cp.float32))


def hc_head(streams, fn_f64, scale, base, *, hc_eps: float, norm_eps: float):
    cp = _cp()
    mixes = _hc_mixes(streams, fn_f64, norm_eps)
    pre = _sigmoid32(mixes * scale[0] + base) + cp.float32(hc_eps)
    return store(_weighted(streams, pre.astype(cp.float32)).astype(cp.float32))


# ------------------------------------------------------------------- quant simulations
def _round_minifloat(x, mbits: int, emin: int, maxval: float):
    """formats.round_minifloat for float32, overflow 'saturate'."""
    cp = _cp()
    _, e = cp.frexp(x)
    e = cp.maximum(e.astype(cp.int32) - 1, emin)
    q = cp.ldexp(cp.ones(e.shape, dtype=x.dtype), e - mbits)
    r = (cp.rint(x / q) * q).astype(x.dtype)
    return cp.where(cp.abs(r) > maxval, cp.copysign(cp.asarray(maxval, dtype=x.dtype), r), r)


def _ue8m0(amax, qmax: float):
    """quant.ue8m0_scale (float32; amax > 0 finite by construction of the floors)."""
    cp = _cp()
    t = (amax.astype(cp.float32) * cp.float32(1.0 / qmax)).astype(cp.float32)
    bits = t.view(cp.uint32)
    e = ((bits >> 23) & 0xFF).astype(cp.int32) - 127 + ((bits & 0x7FFFFF) != 0).astype(cp.int32)
    return ((e + 127).astype(cp.uint32) << 23).view(cp.float32)


def _block_sim(x, block: int, fp4: bool):
    cp = _cp()
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    if fp4:
        qmax, floor, mb, emin = 6.0, FP4_AMAX_FLOOR, 1, 0
    else:
        qmax, floor, mb, emin = 448.0, ACT_AMAX_FLOOR, 3, -6
    amax = cp.maximum(cp.abs(xb).max(axis=-1), cp.float32(floor))
    s = _ue8m0(amax, qmax)[..., None]
    q = _round_minifloat(cp.clip(xb / s, -qmax, qmax).astype(cp.float32), mb, emin, qmax)
    return store((q * s).reshape(x.shape))


def kv_sim(kv, rope_dim: int):
    """quant.kv_fp8_sim: fp8 sim (block 64) of the nope dims, rope dims untouched."""
    nope = kv.shape[-1] - rope_dim
    out = kv.copy()
    out[..., :nope] = _block_sim(_cp().ascontiguousarray(kv[..., :nope]), 64, False)
    return out


def fp4_sim(x, block: int = 32):
    return _block_sim(_cp().ascontiguousarray(x), block, True)


_HAD: dict = {}


def hadamard(x, bits: bool = False):
    """ops.hadamard: store(x @ H_n * n^-1/2), float64 (exact for bf16 inputs in practice).
    ``bits``: the bf16 bits of that (uint16) instead, bf16_bits(y) = bf16_bits(store(y)): one
    conversion launch where the caller wants bits."""
    cp = _cp()
    n = x.shape[-1]
    dev = cp.cuda.runtime.getDevice()
    H = _HAD.get((n, dev))
    if H is None:
        from memra_dsv4.oracle.ops import hadamard_matrix
        H = _HAD[(n, dev)] = cp.asarray(hadamard_matrix(n) * (n ** -0.5))
    y = cp.matmul(x.reshape(-1, n).astype(cp.float64), H)
    y = y.reshape(x.shape).astype(cp.float32)
    return bf16_bits(y) if bits else store(y)


# ------------------------------------------------------------------------- compressor
def compress_candidates(a, z, ratio: int):
    """ops.compress_candidates at a sequence start (no pending rows)."""
    cp = _cp()
    nb = a.shape[0] // ratio
    if ratio != 4:
        return a.reshape(nb, ratio, -1), z.reshape(nb, ratio, -1)
    d = a.shape[-1] // 2
    ab, zb = a.reshape(nb, 4, 2 * d), z.reshape(nb, 4, 2 * d)
    pa = cp.zeros((1, 4, d), dtype=a.dtype)
    pz = cp.full((1, 4, d), -cp.inf, dtype=z.dtype)
    lower_a = cp.concatenate([pa, ab[:-1, :, :d]], axis=0)
    lower_z = cp.concatenate([pz, zb[:-1, :, :d]], axis=0)
    return (cp.concatenate([lower_a, ab[:, :, d:]], axis=1),
            cp.concatenate([lower_z, zb[:, :, d:]], axis=1))


def compress_pool(a_cand, z_cand):
    """ops.compress_pool: softmax over candidates per channel, float64, in index order."""
    cp = _cp()
    a64 = a_cand.astype(cp.float64)
    z64 = z_cand.astype(cp.float64)
    m = cp.max(z64, axis=-2, keepdims=True)
    e = cp.exp(z64 - m)
    num = cp.zeros(e.shape[:-2] + e.shape[-1:], dtype=cp.float64)
    den = cp.zeros_like(num)
    ea = e * cp.where(e > 0, a64, 0.0)
    for i in range(e.shape[-2]):
        den = den + e[..., i, :]
        num = num + ea[..., i, :]
    return (num / den).astype(cp.float32)


# ---------------------------------------------------------------------- top-k / indices
def sort_key_desc(scores_f32, idx_bits: int = 32):
    """uint64 keys whose ASCENDING order is score descending, ties -> lower index."""
    cp = _cp()
    s = cp.ascontiguousarray(scores_f32, dtype=cp.float32)
    u = s.view(cp.uint32).astype(cp.uint64)
    neg = (u >> 31) == 1
    key = cp.where(neg, u ^ cp.uint64(0xFFFFFFFF), u | cp.uint64(0x80000000))  # ascending float
    inv = cp.uint64(0xFFFFFFFF) - key                                           # descending
    idx = cp.arange(s.shape[-1], dtype=cp.uint64)
    return (inv << cp.uint64(32)) | idx


def topk_desc_rows(scores, n_valid, k: int):
    """ops.indexer_topk: int32 [T, min(k, N)] per row over the first n_valid[t] entries,
    score order, -1 padded."""
    cp = _cp()
    T, N = scores.shape
    width = min(int(k), N)
    keys = sort_key_desc(scores)
    col = cp.arange(N, dtype=cp.int64)[None, :]
    keys = cp.where(col < n_valid[:, None], keys, cp.uint64(0xFFFFFFFFFFFFFFFF))
    keys = cp.sort(keys, axis=-1)[:, :width]
    sel = (keys & cp.uint64(0xFFFFFFFF)).astype(cp.int32)
    j = cp.arange(width, dtype=cp.int64)[None, :]
    return cp.where(j < cp.minimum(n_valid, k)[:, None], sel, -1).astype(cp.int32)


def candidates(window_mat, comp_mat, offset: int, ascending: bool = False):
    """indices.candidate_matrix on the device (comp_mat rows: entry ids, -1 = none).
    ``ascending``: the caller guarantees every comp_mat row is its entry ids ascending, then its
    -1 padding (the indexer's top-k with order="index", hidx.hca_matrix); the sort is then the
    identity and is skipped (cupy.sort synchronises the host), the same matrix.  The window
    matrix (int32 from the chunk memo) is not copied before the concatenate copies it."""
    cp = _cp()
    if comp_mat is None or comp_mat.shape[-1] == 0:
        return window_mat.copy()
    if ascending:
        c = cp.where(comp_mat >= 0, comp_mat.astype(cp.int64) + offset, -1).astype(cp.int32)
        return cp.concatenate([window_mat.astype(cp.int32, copy=False), c], axis=-1)
    c = comp_mat.astype(cp.int64)
    big = cp.iinfo(cp.int64).max
    c = cp.sort(cp.where(c >= 0, c, big), axis=-1)
    c = cp.where(c == big, -1, c + offset).astype(cp.int32)
    return cp.concatenate([window_mat.astype(cp.int32, copy=False), c], axis=-1)


# ------------------------------------------------------------------- sparse attention
def sparse_attention(q, kv_rows, idx, sink, scale: float, chunk: int = 256):
    """ops.sparse_attention_with_sinks, float32 logits/softmax/P.V, output stored.
    q [T, H, D]; kv_rows [N, D]; idx [T, K] (-1 skip); sink [H] float32."""
    cp = _cp()
    T, H, D = q.shape
    out = cp.empty((T, H, D), dtype=cp.float32)
    sk = sink.astype(cp.float32)
    for s0 in range(0, T, chunk):
        qq = q[s0:s0 + chunk]
        ii = idx[s0:s0 + chunk]
        valid = ii >= 0
        g = kv_rows[cp.where(valid, ii, 0)]                                  # [c, K, D]
        g = cp.where(valid[..., None], g, cp.float32(0))
        logits = cp.matmul(qq, g.transpose(0, 2, 1)) * cp.float32(scale)     # [c, H, K]
        logits = cp.where(valid[:, None, :], logits, cp.float32(-cp.inf))
        m = cp.maximum(logits.max(axis=-1), sk[None, :])                     # [c, H]
        p = cp.exp(logits - m[..., None])
        den = p.sum(axis=-1) + cp.exp(sk[None, :] - m)
        out[s0:s0 + chunk] = cp.matmul(p, g) / den[..., None]
    return store(out)


# ------------------------------------------------------------------------------- MoE
def sqrtsoftplus(logits):
    cp = _cp()
    x = logits.astype(cp.float32)
    sp = cp.log1p(cp.exp(cp.minimum(x, cp.float32(20.0)))).astype(cp.float32)
    return cp.sqrt(cp.where(x > 20.0, x, sp)).astype(cp.float32)


def route_weights(scores, idx, route_scale: float):
    cp = _cp()
    w = cp.take_along_axis(scores, idx, axis=-1)
    tot = w[:, 0].copy()
    for j in range(1, w.shape[-1]):
        tot = tot + w[:, j]
    return (w / tot[:, None] * cp.float32(route_scale)).astype(cp.float32)


def route_learned(scores, bias, k: int):
    """host.routing.select_learned: top-k of scores + bias, ties -> lower expert id."""
    cp = _cp()
    biased = (scores + bias.astype(cp.float32)).astype(cp.float32)
    keys = cp.sort(sort_key_desc(biased), axis=-1)[:, :k]
    return (keys & cp.uint64(0xFFFFFFFF)).astype(cp.int64)


# swiglu_clamped's common call (the shared expert of the prefill MoE: float32 CuPy gate / up,
# limit > 0, no routing weight) as ONE ElementwiseKernel instead of the chain's 12 CuPy calls
# (astype x4, clip, minimum, negative, exp, add, true_divide, multiply, astype: ~0.3 ms of host
# time per layer pass, bench/results/2026-11-30-nvidia-h200-43f08ca-prof.log).  Each step is the
# CuPy 14 ufunc's expression on the same operand types: clip = cupy_clip's 'ddd->d' line,
# minimum = cupy_minimum's NaN-propagating float line (with its preamble's NAN), exp / divide in
# double, the two casts to float and the float product.  The compiler cannot fuse across the
# former kernel boundaries: the add after exp is __dadd_rn (never contracted into an FMA with
# exp's last multiply), the division is IEEE (div.rn.f64, as true_divide's), the product has no
# add to contract with.  Both kernels are compiled by CuPy with the same options (the casts and
# the float product see the same -ftz setting).  tests/gpu/test_hostlean2_gpu.py compares the
# two byte for byte; SWIGLU_FUSED False runs the chain (swiglu_clamped_chain) everywhere.
SWIGLU_FUSED = True
_SWIGLU_PREAMBLE = "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n"
_SWIGLU_CODE = """
double g = (double)gate;
double u = (double)up;
u = lo > hi ? hi : (u < lo ? lo : (u > hi ? hi : u));
g = (isnan(g) | isnan(hi)) ? (double)(NAN) : (double)(min(g, hi));
double e = exp(-g);
double q = g / __dadd_rn(1.0, e);
float qf = (float)q;
float uf = (float)u;
h = qf * uf;
"""


def _swiglu_kernel():
    k = _EW.get("swiglu")
    if k is None:
        k = _EW["swiglu"] = _cp().ElementwiseKernel(
            "float32 gate, float32 up, float64 lo, float64 hi", "float32 h", _SWIGLU_CODE,
            "memra_swiglu_clamped", preamble=_SWIGLU_PREAMBLE)
    return k


def swiglu_clamped(gate, up, limit: float, weight=None):
    """ops.swiglu_clamped: float64 math, float32 island output (times the routing weight).
    float32 CuPy gate / up with limit > 0 and no weight: one fused kernel, the chain's bytes
    (see above); anything else: swiglu_clamped_chain."""
    cp = _cp()
    if (SWIGLU_FUSED and weight is None and limit > 0 and isinstance(gate, cp.ndarray)
            and gate.dtype == cp.float32 and isinstance(up, cp.ndarray)
            and up.dtype == cp.float32 and gate.shape == up.shape):
        return _swiglu_kernel()(gate, up, np.float64(-limit), np.float64(limit))
    return swiglu_clamped_chain(gate, up, limit, weight)


def swiglu_clamped_chain(gate, up, limit: float, weight=None):
    """swiglu_clamped as CuPy calls (the reference of the fused kernel)."""
    cp = _cp()
    g = gate.astype(cp.float64)
    u = up.astype(cp.float64)
    if limit > 0:
        u = cp.clip(u, -limit, limit)
        g = cp.minimum(g, limit)
    h = (g / (1.0 + cp.exp(-g))).astype(cp.float32) * u.astype(cp.float32)
    h = h.astype(cp.float32)
    if weight is not None:
        h = (weight.astype(cp.float32)[:, None] * h).astype(cp.float32)
    return h


def moe_combine(routed, idx, shared):
    """ops.moe_combine: fp32 sum of the picks in ascending expert id (stable), + shared, stored."""
    cp = _cp()
    T, k, _ = routed.shape
    # stable ascending order by id: key = id * k + pick
    order = cp.argsort(idx.astype(cp.int64) * k + cp.arange(k, dtype=cp.int64)[None, :], axis=-1)
    rs = cp.take_along_axis(routed, order[..., None], axis=1)
    acc = cp.zeros((T, routed.shape[2]), dtype=cp.float32)
    for j in range(k):
        acc = acc + rs[:, j]
    return store(acc + shared)


# ------------------------------------------------------------------ expert dequant
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_KERNEL_OK: dict[int, bool] = {}


def _kernels(device: int):
    from memra_dsv4.gpu import kernel_loader as kl

    kl.register("experts", ["dequant_mxfp4_bf16", "dequant_nvfp4_bf16"])
    return kl.get_loader(device)


def dequant_fp4_bf16(fmt: str, packed, scale, ws2, out):
    """Dequantise one routed expert matrix into the bf16 scratch ``out`` [R, C] (uint16).
    packed [R, C/2] u8; scale: MXFP4 e8m0 [R, C/32] / NVFP4 e4m3 [R, C/16]; ws2: float (NVFP4)."""
    cp = _cp()
    R, C = out.shape
    dev = out.device.id
    if _KERNEL_OK.get(dev, True):
        try:
            L = _kernels(dev)
            blocks = int(min(max(1, (R * C // 32 + 255) // 256), 132 * 16))
            if fmt == "mxfp4":
                L.get("experts", "dequant_mxfp4_bf16")(
                    (blocks,), (256,), (packed, scale, out, np.int64(R), np.int32(C)))
            else:
                L.get("experts", "dequant_nvfp4_bf16")(
                    (blocks,), (256,), (packed, scale, np.float32(ws2), out, np.int64(R),
                                        np.int32(C)))
            return out
        except Exception as e:  # build failure: say so once, use the CuPy formula
            from memra_dsv4.gpu.kernel_loader import KernelCompileError
            if not isinstance(e, (KernelCompileError, KeyError)):
                raise
            print(f"memra_dsv4: experts.cu unavailable on device {dev} ({str(e)[:200]}); "
                  f"using the CuPy dequant", file=sys.stderr)
            _KERNEL_OK[dev] = False
    lut = cp.asarray(_E2M1)
    p = packed.reshape(R, C // 2)
    vals = cp.stack([lut[p & 15], lut[p >> 4]], axis=-1).reshape(R, C)
    if fmt == "mxfp4":
        s = (scale.astype(cp.uint32) << 23).view(cp.float32)  # 2^(b-127); b=0 would be 2^-127
        s = cp.where(scale == 0, cp.float32(2.0 ** -127), s)
        w = (vals.reshape(R, C // 32, 32) * s[..., None]).reshape(R, C)
    else:
        from memra_dsv4.formats import E4M3_VALUES
        s = cp.asarray(E4M3_VALUES.astype(np.float32))[scale]
        w = ((vals.reshape(R, C // 16, 16) * s[..., None]) * cp.float32(ws2)).reshape(R, C)
    out[...] = bf16_bits(w.astype(cp.float32))
    return out
