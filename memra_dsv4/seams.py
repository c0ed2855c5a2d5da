"""Seams: the numeric-class policy and the environment switches of memra-dsv4.

Contract
--------
* ``NumericsPolicy`` is the ONE place where a numeric class (``exact`` / ``bf16`` /
  ``reference``) is turned into arithmetic.  The oracle and its ops never test the class name;
  they call the policy's hooks (``store``, ``act_in``, ``linear``, ``kv_sim``, ``fp4_sim``,
  ``f32``, ``head_rms``...).  ``POLICIES[name]`` holds the three frozen instances.
* ``Seam(name, env, default, allowed, doc)`` describes one switch.  ``SEAMS`` is the registry.
  ``resolve(seam, explicit)`` returns the value to use: an explicit (constructor / CLI) value
  wins over the environment, the environment over the default; anything outside ``allowed``
  raises ``ValueError`` naming the variable (or argument) and the allowed values.
* ``MEMRA_DSV4_NUMERICS`` is read once, at import of this module, validated, and announced on
  stderr as ``memra_dsv4: numerics = <value>``: at import when the variable is set, otherwise
  the first time the default is used (an ``Oracle`` or ``run`` without an explicit class).
  Announced once per process.
* ``seam_table_markdown()`` renders the registry for the README.
* Owners read their own variables (profiling: MEMRA_DSV4_PROF, gpu.runtime: MEMRA_DSV4_DEBUG,
  gpu.ops_glue: MEMRA_DSV4_GEMM, gpu.weights: MEMRA_DSV4_DENSE, gpu.kernel_loader:
  MEMRA_DSV4_KERNELS_DIR); the registry is
  the one list of what exists, with the allowed values they validate against.

Numeric classes (what each hook does)
-------------------------------------
``exact``      float64 everywhere; no bf16 rounding, no quantisation simulation (no KV FP8 sim,
               no indexer FP4 sim, no activation quant).  The Hadamard rotation is kept (it is
               math, not a rounding).  Weights are the exactly dequantised checkpoint values.
``bf16``       (default) arrays are float32.  bf16 rounding at every GEMM activation input and
               at every tensor the reference keeps in bf16 (residual streams, norm outputs,
               linear outputs, caches, attention output, indexer scores, the per-head q norm in
               bf16 arithmetic).  fp32 islands (RMS statistics, hc mixes / Sinkhorn, RoPE,
               compressor projections and pooling, router, SwiGLU, attention softmax) are
               float32 values.  The QAT simulations of the model (KV nope FP8 sim, indexer
               Hadamard + FP4 sim) are kept: they are part of the model's definition.
``reference``  ``bf16`` plus the official kernels' arithmetic: per-128 ue8m0 FP8 activation
               quantisation (``act_quant_fp8``) before every FP8 and FP4 linear (output bf16),
               and the attention probabilities cast to bf16 before the P.V product.

Reductions: every matrix product and every sum over candidates is accumulated in float64 and
rounded once to the class's precision (``f32``/``store``).  That makes the bf16/reference
results the correctly rounded fp32 value of each island, independent of BLAS blocking and of
batch shape (an M=1 decode row equals the same row of an M=L prefill), which is what the
decode/prefill bit-consistency contract needs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.host.quant import act_quant_fp8, fp4_sim, kv_fp8_sim, round_bf16

__all__ = [
    "Seam", "SEAMS", "SEAM_NUMERICS", "SEAM_DECODE_PATH", "SEAM_VERIFY_PATH", "SEAM_CONTINUE", "SEAM_DEVICE", "SEAM_PROF", "SEAM_DEBUG",
    "SEAM_GEMM", "SEAM_DENSE", "SEAM_PDL", "SEAM_DECODE_ATTN", "SEAM_PREFILL_ATTN", "SEAM_PREFILL_MOE", "SEAM_PREFILL_DISPATCH", "SEAM_PREFILL_PIPELINE", "SEAM_L2_PREFETCH", "SEAM_DECODE_FORK", "SEAM_HC_SPLIT", "SEAM_DECODE_PRIORITY", "SEAM_DECODE_QNORM", "SEAM_DECODE_SHARED_W2", "SEAM_KERNELS_DIR", "SEAM_DEVICE_TRACE",
    "SEAM_REQUIRE_PARITY", "resolve",
    "seam_table_markdown", "env_value",
    "NumericsPolicy", "POLICIES", "NUMERICS_CLASSES", "policy", "DEFAULT_NUMERICS",
    "LINEAR_KINDS",
]


# ---------------------------------------------------------------------------------- seams
@dataclass(frozen=True)
class Seam:
    name: str                 # short name used in messages and tables
    env: str                  # environment variable
    default: str
    allowed: tuple[str, ...]  # empty tuple = free-form string
    doc: str

    def check(self, value: str, source: str) -> str:
        if self.allowed and value not in self.allowed:
            raise ValueError(f"{source} = {value!r} is not valid; allowed: "
                             f"{', '.join(self.allowed)}")
        return value


SEAM_NUMERICS = Seam(
    "numerics", "MEMRA_DSV4_NUMERICS", "bf16", ("bf16", "reference", "exact"),
    "Numeric class of the oracle (and the GPU path's contract): `bf16` (bf16 storage, fp32 "
    "islands, QAT sims), `reference` (+ FP8 activation quant before FP8/FP4 linears), "
    "`exact` (float64, no rounding or simulation).")
SEAM_CONTINUE = Seam(
    "continue", "MEMRA_DSV4_CONTINUE", "incremental", ("incremental", "reprefill"),
    "How `run` continues a prompt: `incremental` (one prefill into a fresh decode state, then "
    "one decode step per token: the oracle's state machine, or the GPU decode path) or "
    "`reprefill` (a full prefill per generated token; slow, the consistency reference).")
SEAM_DECODE_PATH = Seam(
    "decode_path", "MEMRA_DSV4_DECODE_PATH", "legacy", ("legacy", "device-hostmath", "device"),
    "GPU decode step (memra_dsv4.gpu.decode, read once per model and printed): `legacy` "
    "(host-driven per-layer loop over the prefill ops, one token), `device-hostmath` (the "
    "device-resident StepWs step with Sinkhorn/router/top-k/head gate on the host; "
    "byte-identical to legacy), `device` (those as kernels too; the CUDA-graph path).")
SEAM_DEVICE = Seam(
    "device", "MEMRA_DSV4_DEVICE", "auto", ("auto", "oracle", "gpu"),
    "Where `run`/`demo` execute: `gpu` (memra_dsv4.gpu, needs CuPy + a GPU), `oracle` "
    "(NumPy), `auto` (GPU when present, else the oracle, and says so).")
SEAM_PROF = Seam(
    "prof", "MEMRA_DSV4_PROF", "off", ("off", "nvtx", "events"),
    "Phase brackets (memra_dsv4.profiling): `off`, `nvtx` (ranges for Nsight), `events` "
    "(CUDA-event timings, reported at the end).")
SEAM_GEMM = Seam(
    "gemm", "MEMRA_DSV4_GEMM", "blaslt", ("blaslt", "cupy"),
    "GPU GEMM backend: `blaslt` (cuBLASLt bf16 / FP8 block-scaled plans) or `cupy` (fp32 "
    "cupy.matmul, a debugging reference).")
SEAM_DENSE = Seam(
    "dense", "MEMRA_DSV4_DENSE", "bf16", ("bf16", "fp8"),
    "How the GPU path keeps the checkpoint's FP8 dense linears (memra_dsv4.gpu.weights, read once "
    "per load and printed): `bf16` (dequantised exactly to bf16 on the host at load) or `fp8` "
    "(the stored e4m3 bytes + e8m0 128x128 block scales; the same exactness check at load; the "
    "prefill dequantises into a bf16 scratch, bit-identical to `bf16`).")
SEAM_PDL = Seam(
    "pdl", "MEMRA_DSV4_PDL", "on", ("on", "off"),
    "Programmatic dependent launch in the `device` decode step (memra_dsv4.gpu.pdl, read once "
    "per model and printed): `on` (every kernel of the step launches with programmatic stream "
    "serialisation, captured as programmatic graph edges: a kernel's launch overlaps its "
    "predecessor's tail; every kernel opens with griddepcontrol.wait) or `off` (plain launches).")
SEAM_DECODE_ATTN = Seam(
    "decode_attn", "MEMRA_DSV4_DECODE_ATTN", "split", ("split", "fused"),
    "Sparse attention of the `device` decode step (memra_dsv4.gpu.step_device, read once per "
    "model and printed): `split` (three launches: build_cand, the split-K attention kernel, the "
    "combine kernel) or `fused` (attention.sparse_attention_decode: candidates in-kernel, the "
    "split-K partials merged by the last CTAs through ticket counters, one launch); the two are "
    "bit-identical.")
SEAM_L2_PREFETCH = Seam(
    "l2_prefetch", "MEMRA_DSV4_L2_PREFETCH", "off", ("off", "8", "16", "32", "64", "128"),
    "L2 prefetch of the dense decode GEMVs' weights before their PDL wait (memra_dsv4.gpu."
    "ops_decode.set_l2_prefetch, read once per model and printed; the device step applies it): "
    "`off`, or how many MB at the start of each weight matrix a GEMV launch asks the L2 for "
    "(cp.async.bulk.prefetch.L2) while its predecessor still runs. A hint: bit-identical outputs "
    "with every value.")
SEAM_DECODE_FORK = Seam(
    "decode_fork", "MEMRA_DSV4_DECODE_FORK", "all", ("on", "off", "all", "single", "lead"),
    "Graph branches in the `device` decode step (memra_dsv4.gpu.step_device, read once per "
    "model and printed): `on` captures each attention sub-layer's kv norm + compressor launches "
    "on a side stream and (CSA layers) the indexer + candidate list on a second one, beside the "
    "wq_b GEMV (fork / join events; the eager step stays on one stream); `all` (default) = `on` "
    "plus each MoE's shared expert (SwiGLU and w2 GEMVs) on the side stream beside the router "
    "and the routed gate/up (measured on 2x H200 at fb5d3ac, 1K context, 100 steps in one "
    "process: bf16 dense 7.87 -> 7.55 ms, fp8 7.10 -> 6.91 ms per token against `on`; with "
    "bf16 dense weights and the Flash shapes the defaults leave that branch empty: the SwiGLU "
    "runs in the routed gate/up's launch, MEMRA_DSV4_SHARED_GATEUP, and the w2 in the down + "
    "combine, MEMRA_DSV4_DECODE_SHARED_W2); "
    "`single` the former `on` (one side branch for kv, indexer and compressor, candidates after "
    "the join), kept for A/B; `lead` = `all` with the CSA indexer's q GEMV moved onto the main "
    "stream before wq_b and the rest of the indexer (compressor emit, RoPE / Hadamard, scores + "
    "top-k, candidates) forked after it, so that chain of small kernels can run while wq_b "
    "streams (with MEMRA_DSV4_DECODE_PRIORITY `attn` its CTAs are dispatched ahead of wq_b's); "
    "`off` one stream. Bit-identical.")
SEAM_HC_SPLIT = Seam(
    "hc_split", "MEMRA_DSV4_HC_SPLIT", "on", ("off", "on"),
    "Sub-layer boundaries of the `device` decode step (memra_dsv4.gpu.step_device, read once per "
    "model and printed): `off` (each boundary in one launch, hc.cu hc_boundary) or `on` (two "
    "launches: hc_boundary_pre, the sub-layer's input, then hc_boundary_sinkhorn, the post "
    "weights and Sinkhorn comb matrix only the next boundary reads; in a graph the Sinkhorn is "
    "captured on a side stream beside the sub-layer and joined before the next boundary, the "
    "eager step stays on one stream). Bit-identical.")
SEAM_DECODE_PRIORITY = Seam(
    "decode_priority", "MEMRA_DSV4_DECODE_PRIORITY", "off", ("off", "side", "attn"),
    "Scheduling priority of the `device` decode step's graph branches (memra_dsv4.gpu."
    "step_device, read once per model and printed). Without it a side kernel's CTAs are "
    "dispatched only once the big GEMV beside it has dispatched all of its own "
    "(profiling.device_trace: the CSA indexer chain waits out wq_b). `side` captures every side "
    "branch (kv / compressor, indexer, shared expert, hc Sinkhorn) on streams of the device's "
    "greatest priority and instantiates each stage graph with CUDA_GRAPH_INSTANTIATE_FLAG_USE_"
    "NODE_PRIORITY; `attn` does the same except for the shared expert's branch (at high "
    "priority it splits the routed gate/up's single wave: slower); `off` keeps every node at the "
    "launch stream's priority. Same launches and buffers: bit-identical.")
SEAM_DECODE_QNORM = Seam(
    "decode_qnorm", "MEMRA_DSV4_DECODE_QNORM", "kernel", ("kernel", "attn"),
    "Per-head q norm + q RoPE of the `device` decode step (memra_dsv4.gpu.step_device, read once "
    "per model and printed): `kernel` (its own launch after the wq_b GEMV, rmsnorm.cu "
    "head_rms_bf16, q normed in place) or `attn` (no launch: the sparse attention's _qn kernels "
    "norm + rope their heads' raw q rows at the q load with head_rms_bf16's code, "
    "kernels_cu/head_rms.cuh; every split CTA of a head group recomputes them). Bit-identical.")
SEAM_DECODE_SHARED_W2 = Seam(
    "decode_shared_w2", "MEMRA_DSV4_DECODE_SHARED_W2", "fused", ("gemv", "fused"),
    "The shared expert's w2 GEMV of the `device` decode step's MoE (memra_dsv4.gpu.step_device, "
    "read once per model and printed): `gemv` (its own gemv_bf16 launch on the shared expert's "
    "branch, the down + combine adding its output) or `fused` (no launch: the full-shape down + "
    "combine kernels gemv_*fp4_down_combine_k2_f_w2 compute the w2 rows themselves with "
    "gemv_bf16's row code, kernels_cu/gemv_bf16_row.cuh). Bit-identical. `fused` needs bf16 dense "
    "weights and the Flash shapes (w2 [hidden, 2048], K = 2048, k even); elsewhere (FP8 dense, "
    "MEMRA_DSV4_DENSE=fp8, or other shapes) the step keeps the separate launch. Default `fused` since "
    "the eleventh session (2x H200, 1K: 7.25 -> 7.16 ms per token in one process).")
SEAM_VERIFY_PATH = Seam(
    "verify_path", "MEMRA_DSV4_VERIFY_PATH", "chunk", ("chunk", "device"),
    "How the GPU path runs a speculative verify (memra_dsv4.gpu.verify, read once per model and "
    "printed): `chunk` (the k + 1 rows through the chunk routine, prefill's blocks, journaled; "
    "host-paced at a few rows) or `device` (memra_dsv4.gpu.verify_step: the device step's kernels "
    "for the rows over a multi-row arena, the weight-streaming GEMVs reading each weight once for "
    "all rows, one CUDA graph per state, row count and taps; each row's logits are a device "
    "step's bytes; 2 <= k + 1 <= min(8, sliding_window), longer verifies take `chunk`).")
SEAM_PREFILL_ATTN = Seam(
    "prefill_attn", "MEMRA_DSV4_PREFILL_ATTN", "mma", ("mma", "simt"),
    "Sparse attention and indexer scores of GPU prefill chunks of >= 64 tokens "
    "(memra_dsv4.gpu.ops.attention / indexer, read once per model and printed): `mma` "
    "(tensor-core kernels: bf16 products exact, the attention's P split into two bf16 halves, "
    "their own fixed f32 orders) or `simt` (the decode step's CUDA-core kernels). Shorter "
    "chunks always use `simt`.")
SEAM_PREFILL_MOE = Seam(
    "prefill_moe", "MEMRA_DSV4_PREFILL_MOE", "wgmma", ("wgmma", "fp4mma", "blaslt"),
    "Routed experts of GPU prefill chunks (memra_dsv4.gpu.ops.prefill_moe, read once per model "
    "and printed): `wgmma` (one grouped GEMM per projection on Hopper warpgroup MMA reading the "
    "STORED FP4 bytes: weights decoded into wgmma's register operand, activations from shared "
    "memory in a permuted k order, items of up to 128 rows, SwiGLU in the epilogue; exact "
    "products, f32 accumulation; measured on 2x H200 at fc6c8d3: 8K tokens 1.54 vs 1.62 s), "
    "`fp4mma` (the same contract on mma.sync, 64-row items; bit-identical to `wgmma`) or "
    "`blaslt` (each group of experts dequantised exactly into a bf16 scratch, then "
    "strided-batched cuBLASLt GEMMs and a SwiGLU launch; another f32 summation order).")
SEAM_PREFILL_DISPATCH = Seam(
    "prefill_dispatch", "MEMRA_DSV4_PREFILL_DISPATCH", "device", ("host", "device"),
    "Dispatch plan of the routed experts of GPU prefill chunks (memra_dsv4.gpu.ops.prefill_moe, "
    "read once per model and printed; the `fp4mma` and `wgmma` arms: `blaslt` plans on the host): "
    "`host` (the expert ids read back once per layer, the plan built in NumPy and uploaded; the "
    "host waits for the GPU) or `device` (four small kernels build the plan, with the arm's work "
    "items, from the device ids and the FP4 GEMMs launch over an upper bound of work items: "
    "nothing read back; bit-identical to `host`).")
SEAM_PREFILL_PIPELINE = Seam(
    "prefill_pipeline", "MEMRA_DSV4_PREFILL_PIPELINE", "coop", ("off", "on", "coop"),
    "Prefill over 2+ stages (memra_dsv4.gpu.pipeline, read once per model and printed): `coop` "
    "(prompts of >= 2048 tokens cut into up to gpu.pipeline.N_CHUNKS (3) chunks of >= 1024 tokens "
    "that flow through the stages from one host thread interleaving the stages layer by layer, "
    "so the stages overlap; bit-identical to running those chunks one after another, bf16-class "
    "against the whole-prompt chunk; needs peer access, else the whole prompt as one chunk; "
    "measured on 2x H200 at fcf8e57, 8K tokens, uninstrumented: 936-938 ms at 3 chunks, 903-1,117 "
    "ms at 4 (host-bound), vs 1,291 ms `off`), `on` "
    "(the same chunks and bits with one host thread per stage: GIL-bound, 1,127 ms at 2 chunks) "
    "or `off` (the whole prompt as one chunk: one boundary copy per stage boundary).")
SEAM_KERNELS_DIR = Seam(
    "kernels_dir", "MEMRA_DSV4_KERNELS_DIR", "<repo>/kernels_cu", (),
    "Directory of the CUDA sources compiled at warmup (any path).")
SEAM_DEVICE_TRACE = Seam(
    "device_trace", "MEMRA_DSV4_DEVICE_TRACE", "off", ("off", "on"),
    "`on`: kernels are built with -DMEMRA_TRACE (their own cache entries), so every CTA records "
    "%globaltimer at its start, its wait return and its last thread's exit (memra_dsv4.profiling."
    "device_trace; read when a kernel loader is made and printed). A diagnostic binary: "
    "`bench.decode_step --device-trace N` reads the step's timeline from it.")
SEAM_DEBUG = Seam(
    "debug", "MEMRA_DSV4_DEBUG", "0", ("0", "1"),
    "`1`: every checked GPU launch synchronises its stream and names itself on error "
    "(read once at import of memra_dsv4.gpu.runtime).")
SEAM_REQUIRE_PARITY = Seam(
    "require_parity", "MEMRA_DSV4_REQUIRE_PARITY", "0", ("0", "1"),
    "Tests: `1` turns a skipped transformers parity test (torch/transformers missing) into a "
    "failure.")

SEAMS: dict[str, Seam] = {s.name: s for s in (
    SEAM_NUMERICS, SEAM_DECODE_PATH, SEAM_CONTINUE, SEAM_DEVICE, SEAM_PROF, SEAM_DEBUG, SEAM_GEMM,
    SEAM_DENSE, SEAM_PDL, SEAM_DECODE_ATTN, SEAM_PREFILL_ATTN, SEAM_PREFILL_MOE, SEAM_PREFILL_DISPATCH, SEAM_PREFILL_PIPELINE,
    SEAM_L2_PREFETCH, SEAM_DECODE_FORK, SEAM_HC_SPLIT, SEAM_DECODE_PRIORITY, SEAM_DECODE_QNORM,
    SEAM_DECODE_SHARED_W2, SEAM_VERIFY_PATH, SEAM_KERNELS_DIR, SEAM_DEVICE_TRACE,
    SEAM_REQUIRE_PARITY)}


def env_value(seam: Seam) -> str:
    """The environment's value of ``seam`` (validated), or its default when unset/empty."""
    raw = os.environ.get(seam.env, "")
    if raw == "":
        return seam.default
    return seam.check(raw.strip(), f"environment variable {seam.env}")


def resolve(seam: Seam | str, explicit: str | None = None) -> str:
    """Explicit value (constructor/CLI) > environment > default; invalid -> ValueError."""
    if isinstance(seam, str):
        if seam not in SEAMS:
            raise ValueError(f"unknown seam {seam!r}; known: {', '.join(SEAMS)}")
        seam = SEAMS[seam]
    if explicit is not None:
        if not isinstance(explicit, str):
            raise ValueError(f"{seam.name} = {explicit!r}: expected a string; allowed: "
                             f"{', '.join(seam.allowed)}")
        return seam.check(explicit, f"{seam.name} (argument; env {seam.env})")
    if seam is SEAM_NUMERICS:
        global _ANNOUNCED
        if not _ANNOUNCED:   # env unset: announce the default the first time it is used
            print(f"memra_dsv4: numerics = {seam.default}", file=sys.stderr)
            _ANNOUNCED = True
        return _NUMERICS_AT_LOAD if _NUMERICS_AT_LOAD is not None else seam.default
    return env_value(seam)


def seam_table_markdown() -> str:
    rows = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for s in SEAMS.values():
        allowed = ", ".join(f"`{a}`" for a in s.allowed) if s.allowed else "any"
        rows.append(f"| `{s.env}` | `{s.default}` | {allowed} | {s.doc} |")
    return "\n".join(rows) + "\n"


def _read_numerics_once() -> str | None:
    raw = os.environ.get(SEAM_NUMERICS.env, "")
    if raw == "":
        return None
    value = SEAM_NUMERICS.check(raw.strip(), f"environment variable {SEAM_NUMERICS.env}")
    print(f"memra_dsv4: numerics = {value}", file=sys.stderr)
    return value


# Read once at load.  An invalid value is an error at import, naming the variable.
_NUMERICS_AT_LOAD: str | None = _read_numerics_once()
_ANNOUNCED: bool = _NUMERICS_AT_LOAD is not None


# ---------------------------------------------------------------------- numerics policy
# kinds of linear layers, by how the reference computes them
#   fp8 : FP8 e4m3 weight (128x128 e8m0 scales): act_quant (reference) -> fp8_gemm -> bf16 out
#   fp4 : MXFP4 routed expert weight: act_quant (reference) -> fp4_gemm -> bf16 out
#   bf16: bf16 weight, bf16 input, fp32 accumulation, bf16 out (wo_a, indexer weights_proj)
#   f32 : fp32 weight (the bf16 checkpoint value) on an fp32 input, fp32 out (compressor
#         wkv/wgate, router gate, lm head)
LINEAR_KINDS = ("fp8", "fp4", "bf16", "f32")
NUMERICS_CLASSES = ("exact", "bf16", "reference")
DEFAULT_NUMERICS = SEAM_NUMERICS.default


@dataclass(frozen=True)
class NumericsPolicy:
    """Arithmetic hooks of one numeric class.  All hooks are pure array -> array functions."""
    name: str
    dtype: type = field(default=np.float32)  # storage dtype of every activation array
    bf16_storage: bool = True    # round bf16-kept tensors (and GEMM inputs) to bf16
    qat_sims: bool = True        # KV nope FP8 sim, indexer FP4 sim
    act_quant: bool = False      # FP8 activation quant before FP8/FP4 linears
    attn_probs_bf16: bool = False  # P cast to bf16 before P.V (sparse_attn kernel)

    # -- precision points ---------------------------------------------------------------
    def arr(self, x) -> np.ndarray:
        """Bring an array into this class's dtype without any other rounding."""
        return np.asarray(x, dtype=self.dtype)

    def f32(self, x) -> np.ndarray:
        """An fp32 island's output: correctly rounded to float32 (float64 kept for exact)."""
        return np.asarray(x, dtype=self.dtype)

    def store(self, x) -> np.ndarray:
        """A tensor the reference keeps in bf16 (streams, norm/linear outputs, caches)."""
        x = np.asarray(x, dtype=self.dtype)
        return round_bf16(x) if self.bf16_storage else x

    def act_in(self, x) -> np.ndarray:
        """Activation input of a bf16/FP8/FP4 GEMM (bf16 in the reference)."""
        return self.store(x)

    # -- QAT simulations ----------------------------------------------------------------
    def kv_sim(self, kv, rope_dim: int) -> np.ndarray:
        kv = self.arr(kv)
        return kv_fp8_sim(kv, rope_dim) if self.qat_sims else kv

    def fp4_sim(self, x, block: int = 32) -> np.ndarray:
        x = self.arr(x)
        return fp4_sim(x, block) if self.qat_sims else x

    # -- linears ------------------------------------------------------------------------
    def linear(self, x, w, kind: str) -> np.ndarray:
        """y = x @ w.T for one linear kind (see LINEAR_KINDS); accumulation in float64."""
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linear kind {kind!r}; expected one of {LINEAR_KINDS}")
        x = self.arr(x)
        if kind == "f32":
            return self.f32(mm(x, w.T))
        x = self.act_in(x)
        if self.act_quant and kind in ("fp8", "fp4"):
            q, s = act_quant_fp8(x, 128)
            x = (q.reshape(*x.shape[:-1], -1, 128) * s[..., None]).reshape(x.shape)
        return self.store(mm(x, w.T))

    # -- the q head norm ----------------------------------------------------------------
    def head_rms(self, x, eps: float) -> np.ndarray:
        """Unweighted RMS norm over the last dim (M:498).  bf16 classes: bf16 tensor
        arithmetic as torch does it, q <- bf16(q * bf16(rsqrt(bf16(bf16(mean(bf16(q^2))) + eps))))
        with the mean accumulated wide; exact: x * rsqrt(mean(x^2) + eps) in float64."""
        x = self.arr(x)
        if not self.bf16_storage:
            return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)
        sq = round_bf16(x * x)
        mean = round_bf16(self.f32(np.mean(sq.astype(np.float64), axis=-1, keepdims=True)))
        var = round_bf16(mean + self.dtype(eps))
        r = round_bf16(self.f32(1.0 / np.sqrt(var.astype(np.float64))))
        return round_bf16(x * r)


def mm(a, b) -> np.ndarray:
    """Matrix product accumulated in float64, returned as a's dtype (one rounding)."""
    a = np.asarray(a)
    out = np.matmul(a.astype(np.float64, copy=False), np.asarray(b).astype(np.float64, copy=False))
    return out.astype(a.dtype if a.dtype in (np.float32, np.float64) else np.float64, copy=False)


POLICIES: dict[str, NumericsPolicy] = {
    "exact": NumericsPolicy("exact", dtype=np.float64, bf16_storage=False, qat_sims=False),
    "bf16": NumericsPolicy("bf16"),
    "reference": NumericsPolicy("reference", act_quant=True, attn_probs_bf16=True),
}


def policy(numerics: str | NumericsPolicy | None = None) -> NumericsPolicy:
    """The policy for an explicit class name (or env / default when None)."""
    if isinstance(numerics, NumericsPolicy):
        return numerics
    return POLICIES[resolve(SEAM_NUMERICS, numerics)]
