"""The GPU prefill of DeepSeek-V4 (bf16 numeric class), pipelined over devices.

API
---
``Dsv4Gpu.load(ckpt, devices=(0,), numerics="bf16", force_bounce=False, dense=None)``
    Uploads ``ckpt`` (a ``memra_dsv4.checkpoint.Checkpoint``) split over ``devices`` with
    ``placement.plan_split`` (embedding on the first device, head group on the last); tqdm
    progress, then prints the bytes placed on each device.  ``dense`` (seam
    ``MEMRA_DSV4_DENSE``, read once per load and printed): ``"bf16"`` (FP8 dense linears
    dequantised to bf16 at load) or ``"fp8"`` (kept as stored; see gpu.weights); ``self.dense``.
    ``decode_path`` (seam ``MEMRA_DSV4_DECODE_PATH``) and ``pdl`` (seam ``MEMRA_DSV4_PDL``:
    programmatic dependent launch in the device step, gpu.pdl) are read once and printed;
    ``self.pdl`` may be changed later (the device step recaptures its graphs when it differs).
    ``prefill_attn`` (seam ``MEMRA_DSV4_PREFILL_ATTN``): ``mma`` / ``simt`` kernel of the chunk
    routine's sparse attention for chunks >= 64 tokens (``self.prefill_attn``).
    ``decode_attn`` (seam ``MEMRA_DSV4_DECODE_ATTN``, read once and printed): the device step's
    sparse attention, ``split`` (build_cand + split kernel + combine) or ``fused`` (one launch,
    attention.sparse_attention_decode), bit-identical; ``self.decode_attn`` may be changed later
    (the device step recaptures its graphs when it differs, as for ``pdl``).
    ``prefill_moe`` (seam ``MEMRA_DSV4_PREFILL_MOE``, read once and printed): the chunk routine's
    routed experts, ``wgmma`` (default: grouped GEMM on Hopper warpgroup MMA reading the stored
    FP4 bytes), ``fp4mma`` (the same on mma.sync; bit-identical to ``wgmma``) or ``blaslt`` (dequantise into a bf16 scratch +
    cuBLASLt); ``self.prefill_moe`` is read per chunk.
    ``decode_qnorm`` (seam ``MEMRA_DSV4_DECODE_QNORM``, read once and printed): the device step's
    per-head q norm + q RoPE, ``kernel`` (head_rms_bf16 after wq_b) or ``attn`` (inside the sparse
    attention's q load, the _qn kernels), bit-identical; ``self.decode_qnorm`` may be changed later
    (the device step recaptures its graphs when it differs, as for ``decode_attn``).
    ``decode_shared_w2`` (seam ``MEMRA_DSV4_DECODE_SHARED_W2``, read once and printed): the device
    step's shared-expert w2 GEMV, ``gemv`` (its own gemv_bf16 launch) or ``fused`` (computed by the
    routed down + combine kernel, gemv_*_down_combine_k2_f_w2; bf16 dense and the Flash shapes only,
    else the separate launch), bit-identical; may be changed later (the step recaptures).
    ``prefill_dispatch`` (seam ``MEMRA_DSV4_PREFILL_DISPATCH``, read once and printed): where the
    ``fp4mma`` and ``wgmma`` arms build their dispatch plan, ``host`` (the expert ids read back
    per layer) or ``device`` (kernels; nothing read back; bit-identical); ``blaslt`` always plans
    on the host; ``self.prefill_dispatch`` is read per chunk.
``Dsv4Gpu.synthetic(config_or_preset, devices=(0,), seed=0, experts="mxfp4", dense=None)``
    Random weights built on the devices in the stored formats (full-size benchmarks).
``drafter=True`` (load / synthetic): also place the checkpoint's drafter stages (the MTP block
    ``mtp.0``, or DSpark's ``mtp.0..2``; layer ids ``num_hidden_layers + s``) on the last stage,
    counted in the split's byte math (``weights.drafter_layers``: refused before any device work
    for a checkpoint without a drafter); ``self.drafter_stage`` is that stage's index (None
    without).  They are run by ``gpu.drafters.GpuMtpDrafter`` / ``gpu.dspark.GpuDSparkDrafter``,
    never by the trunk's chunk routine or step.
``prefill(ids, state, return_streams=True)`` / ``verify(state, tokens, return_streams=True)``
    also return the final (pre-hc_head) streams of every row, float32 CuPy [S, hc, dim] on the
    last stage's device: the MTP drafter's input (a prefill then skips the pipelined schedule,
    whose stages do not keep them).
``forward(token_ids, capture=False) -> ForwardOut``  (memra_dsv4.oracle.model.ForwardOut)
    The prefill is the chunk routine (``gpu.decode.run_chunk``, the same one prefill /
    prefill_chunk / the legacy decode_step run) from position 0 on a fresh DecodeState.
    ``logits`` [vocab] float32 of the last position (NumPy), ``hc_state`` [hc, dim], ``streams``
    None (not gathered; pass ``capture=True`` for host copies), ``captures``: one dict per
    block with the oracle's capture names (NumPy), ``captures_top``: embed / hc_head /
    final_norm.  ``boundary_paths`` records "peer"/"bounce" per stage boundary.
``generate_reprefill(ids, max_new) -> list[int]``: greedy continuation by re-prefill.

Invalid token ids (out of range, empty, non-integer, longer than ``max_seq_len``) raise
``ValueError`` before any device work.  Only the ``bf16`` numeric class is implemented.

Exactly one stage-boundary copy per boundary per forward: the [S, hc, dim] float32 streams
move with ``runtime.boundary_copy`` (peer copy with peer access, else a pinned host bounce;
``force_bounce=True`` forces the bounce for tests).
"""

from __future__ import annotations

import importlib
import sys

import numpy as np

from memra_dsv4.config import Dsv4Config, preset
# The per-layer helpers below run ~40 times a layer and chunk: their modules are imported once
# here rather than by an import statement per call (~0.3-0.6 us each).  None imports CuPy.
from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.gpu.ops import router as RT
from memra_dsv4.gpu.ops._common import contiguous
from memra_dsv4.gpu.ops._common import cupy as _cupy
from memra_dsv4.gpu.ops.prefill_moe import routed_moe
from memra_dsv4.host.rope import cos_sin, layer_inv_freq
from memra_dsv4.oracle.model import ForwardOut, check_token_ids
from memra_dsv4.profiling import phase
from memra_dsv4.seams import SEAM_PREFILL_DISPATCH, SEAM_PREFILL_MOE

__all__ = ["Dsv4Gpu", "ForwardOut"]

# Every experts.cu name (the decode GEMVs of ops.experts, the prefill MoE's) is registered before
# the module is first built, so it is compiled once per device, never again mid-run.
importlib.import_module("memra_dsv4.gpu.ops.experts")


class Dsv4Gpu:
    def __init__(self, config: Dsv4Config, stages, devices, numerics: str = "bf16",
                 force_bounce: bool = False, max_seq_len: int | None = None,
                 decode_path: str | None = None, pdl: str | None = None,
                 prefill_attn: str | None = None, decode_attn: str | None = None,
                 prefill_moe: str | None = None, prefill_pipeline: str | None = None,
                 l2_prefetch: str | None = None, decode_fork: str | None = None,
                 hc_split: str | None = None, decode_priority: str | None = None,
                 prefill_dispatch: str | None = None, decode_qnorm: str | None = None,
                 decode_shared_w2: str | None = None, verify_path: str | None = None) -> None:
        import cupy as cp
        from memra_dsv4.gpu.decode import resolve_decode_path
        from memra_dsv4.gpu import runtime
        from memra_dsv4.gpu.ops_glue import GemmBackend

        if numerics != "bf16":
            raise ValueError(f"numerics = {numerics!r}: the GPU path implements only 'bf16'")
        self.config = config
        self.stages = stages
        self.devices = tuple(devices)
        self.numerics = numerics
        self.force_bounce = bool(force_bounce)
        self.max_seq_len = int(max_seq_len or min(config.max_position_embeddings, 65536))
        self.devs = runtime.Devices(self.devices)
        self.gemm = {d: GemmBackend(d) for d in self.devices}
        self.boundary_paths: list[str] = []
        self._cp = cp
        self.decode_path = resolve_decode_path(decode_path)   # read once, printed
        self.pdl = _resolve_pdl(pdl)                           # read once, printed (gpu.pdl)
        self.prefill_attn = _resolve_announced(                # read once, printed
            "PREFILL_ATTN", prefill_attn, "prefill sparse attention (chunks >= 64 tokens)")
        self.decode_attn = _resolve_announced(                 # read once, printed (step_device)
            "DECODE_ATTN", decode_attn, "device-step sparse attention")
        self.prefill_moe = _resolve_announced(                 # read once, printed
            "PREFILL_MOE", prefill_moe, "prefill routed experts")
        self.prefill_dispatch = _resolve_announced(            # read once, printed
            "PREFILL_DISPATCH", prefill_dispatch, "prefill routed-expert dispatch plan")
        self.prefill_pipeline = _resolve_announced(            # read once, printed (gpu.pipeline)
            "PREFILL_PIPELINE", prefill_pipeline, "prefill pipelined over the stages")
        self.l2_prefetch = _resolve_announced(                 # read once, printed (step_device)
            "L2_PREFETCH", l2_prefetch, "device-step L2 prefetch of dense GEMV weights (MB)")
        self.decode_fork = _resolve_announced(                 # read once, printed (step_device)
            "DECODE_FORK", decode_fork, "device-step attention graph branches")
        self.hc_split = _resolve_announced(                    # read once, printed (step_device)
            "HC_SPLIT", hc_split, "device-step hc boundary split (Sinkhorn on a side branch)")
        self.decode_priority = _resolve_announced(             # read once, printed (step_device)
            "DECODE_PRIORITY", decode_priority, "device-step graph branch priority")
        self.decode_qnorm = _resolve_announced(                # read once, printed (step_device)
            "DECODE_QNORM", decode_qnorm, "device-step q head norm (own launch or in the attention)")
        self.decode_shared_w2 = _resolve_announced(            # read once, printed (step_device)
            "DECODE_SHARED_W2", decode_shared_w2, "device-step shared-expert w2 (own GEMV or in the down + combine)")
        self.verify_path = _resolve_announced(                 # read once, printed (gpu.verify)
            "VERIFY_PATH", verify_path, "speculative verify (chunk routine or multi-row device graph)")
        self._verify_step = None                               # gpu.verify_step, made at first use
        # the stage holding the drafter's layers (Dsv4Gpu.load / synthetic drafter=True), or None
        self.drafter_stage = next((i for i, st in enumerate(stages) if len(st.drafter_layers)),
                                  None)
        self._step = None                                      # device step (gpu.step)
        self._ws2_dev: dict = {}   # (device, expert key) -> NVFP4 weight_scale_2 f32 [E]
        self._chunk_memo: dict = {}  # chunk_memo: (device, key) -> per-chunk host-made tables
        forms = {st.dense_fmt for st in stages}
        if len(forms) != 1:
            raise ValueError(f"stages disagree on the dense form: {sorted(forms)}")
        self.dense = forms.pop()                               # gpu.weights.resolve_dense
        if self.dense == "fp8":   # the chunk routine's dequant kernel: built now, not mid-prefill
            from memra_dsv4.gpu import kernel_loader
            from memra_dsv4.gpu.ops import dense as dense_ops
            for d in self.devices:
                kernel_loader.get_loader(d).warm_all([dense_ops.STEM])

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _plan(cfg, devices, experts, dense: str = "bf16", drafter: bool = False):
        from memra_dsv4.gpu.weights import weight_plan
        return weight_plan(cfg, len(devices), experts, dense=dense, drafter=drafter)

    @classmethod
    def load(cls, ckpt, devices=(0,), numerics: str = "bf16", *, force_bounce: bool = False,
             max_seq_len: int | None = None, decode_path: str | None = None,
             dense: str | None = None, pdl: str | None = None,
             prefill_attn: str | None = None, decode_attn: str | None = None,
             prefill_moe: str | None = None, prefill_pipeline: str | None = None,
             l2_prefetch: str | None = None, decode_fork: str | None = None,
             hc_split: str | None = None, decode_priority: str | None = None,
             prefill_dispatch: str | None = None, decode_qnorm: str | None = None,
                 decode_shared_w2: str | None = None, verify_path: str | None = None,
             drafter: bool = False) -> "Dsv4Gpu":
        from memra_dsv4.gpu.weights import drafter_layers, load_stage_weights, resolve_dense

        dense = resolve_dense(dense)                           # read once, printed
        devices = tuple(int(d) for d in devices)
        cfg = ckpt.config
        dl = drafter_layers(cfg, drafter)                      # refused before any device work
        kinds = set(ckpt.expert_kinds.values()) if hasattr(ckpt, "expert_kinds") else {"mxfp4"}
        plan = cls._plan(cfg, devices, "nvfp4" if "nvfp4" in kinds else "mxfp4", dense, drafter)
        bar = _bar(len(ckpt.names()), "loading")
        stages = [load_stage_weights(ckpt, devices[i], layers, emb, head, progress=bar,
                                     dense=dense, drafter_layers=dl if head else range(0))
                  for i, layers, emb, head in plan]
        if bar is not None:
            bar.close()
        _print_bytes(stages)
        return cls(cfg, stages, devices, numerics, force_bounce, max_seq_len, decode_path, pdl,
                   prefill_attn, decode_attn, prefill_moe, prefill_pipeline,
                   l2_prefetch=l2_prefetch, decode_fork=decode_fork, hc_split=hc_split,
                   decode_priority=decode_priority,
                   prefill_dispatch=prefill_dispatch, decode_qnorm=decode_qnorm,
                   decode_shared_w2=decode_shared_w2, verify_path=verify_path)

    @classmethod
    def synthetic(cls, config_or_preset, devices=(0,), seed: int = 0, *, experts: str = "mxfp4",
                  force_bounce: bool = False, max_seq_len: int | None = None,
                  decode_path: str | None = None, dense: str | None = None,
                  pdl: str | None = None, prefill_attn: str | None = None,
                  decode_attn: str | None = None, prefill_moe: str | None = None,
                  prefill_pipeline: str | None = None,
                  l2_prefetch: str | None = None, decode_fork: str | None = None,
                  hc_split: str | None = None, decode_priority: str | None = None,
                  prefill_dispatch: str | None = None, decode_qnorm: str | None = None,
                 decode_shared_w2: str | None = None, verify_path: str | None = None,
                  expert_storage: str = "per-layer",
                  drafter: bool = False) -> "Dsv4Gpu":
        """A model of random weights for ``config_or_preset`` (a Dsv4Config or a preset name).
        ``expert_storage`` "shared": each stage's MoE layers alias its first MoE layer's routed
        experts (weights.EXPERT_STORAGE; for a full-depth model on one GPU), else "per-layer"."""
        from memra_dsv4.gpu.weights import (check_expert_storage, drafter_layers, resolve_dense,
                                            synthetic_stage_weights)

        check_expert_storage(expert_storage)   # before any GPU work
        from memra_dsv4.tensors import expected_tensors

        dense = resolve_dense(dense)                           # read once, printed
        cfg = preset(config_or_preset) if isinstance(config_or_preset, str) else config_or_preset
        dl = drafter_layers(cfg, drafter)                      # refused before any device work
        devices = tuple(int(d) for d in devices)
        plan = cls._plan(cfg, devices, experts, dense, drafter)
        bar = _bar(len(expected_tensors(cfg, experts)), "synthesising")
        stages = [synthetic_stage_weights(cfg, devices[i], layers, emb, head, seed, experts,
                                          progress=bar, dense=dense, expert_storage=expert_storage,
                                          drafter_layers=dl if head else range(0))
                  for i, layers, emb, head in plan]
        if bar is not None:
            bar.close()
        _print_bytes(stages)
        return cls(cfg, stages, devices, "bf16", force_bounce, max_seq_len, decode_path, pdl,
                   prefill_attn, decode_attn, prefill_moe, prefill_pipeline,
                   l2_prefetch=l2_prefetch, decode_fork=decode_fork, hc_split=hc_split,
                   decode_priority=decode_priority,
                   prefill_dispatch=prefill_dispatch, decode_qnorm=decode_qnorm,
                   decode_shared_w2=decode_shared_w2, verify_path=verify_path)

    # ------------------------------------------------------------------ API
    def check_ids(self, token_ids) -> np.ndarray:
        ids = check_token_ids(token_ids, self.config.vocab_size)
        if ids.shape[0] > self.max_seq_len:
            raise ValueError(f"token_ids has {ids.shape[0]} tokens, past max_seq_len "
                             f"{self.max_seq_len}")
        return ids

    def forward(self, token_ids, capture: bool = False) -> ForwardOut:
        """The prefill: the chunk routine (gpu.decode.run_chunk) from position 0 on a fresh,
        reset DecodeState sized to the prompt; phases ``prefill/...``."""
        from memra_dsv4.gpu.decode import run_chunk
        ids = self.check_ids(token_ids)
        state = self.new_state(max_seq_len=ids.shape[0])
        state.reset()
        self.devs.order_after_current()   # reset's fills ran on the current stream
        chunks = None if capture else self._pipeline_plan(ids.shape[0])
        if chunks:
            return self._pipeline_runner()(self, state, ids, chunks, ph="prefill")
        return run_chunk(self, state, ids, capture=capture, ph="prefill")

    def chunk_memo(self, key, make):
        """A host-computed table shared by a chunk's layers (RoPE cos / sin, window and HCA index
        matrices), made by ``make()`` once per (current device, key) and kept until
        ``clear_chunk_memo()`` (the chunk routines call it when they start)."""
        key = (_cupy().cuda.runtime.getDevice(),) + tuple(key)
        memo = self._chunk_memo
        v = memo.get(key)
        if v is None:
            v = memo[key] = make()
        return v

    def clear_chunk_memo(self) -> None:
        self._chunk_memo = {}

    def _pipeline_plan(self, S: int):
        """Chunk lengths of a pipelined prefill of S tokens (gpu.pipeline), or None: the seam
        MEMRA_DSV4_PREFILL_PIPELINE is off, one stage, no peer access, or too short a prompt."""
        if getattr(self, "prefill_pipeline", "off") not in ("on", "coop"):
            return None
        from memra_dsv4.gpu.pipeline import pipeline_chunks, pipeline_supported
        return pipeline_chunks(S, len(self.stages)) if pipeline_supported(self) else None

    def _pipeline_runner(self):
        """The pipelined prefill routine of the seam's value: ``run_chunk_coop`` (one host
        thread) for ``coop``, ``run_chunk_pipelined`` (a thread per stage) for ``on``."""
        from memra_dsv4.gpu import pipeline as PL
        return PL.run_chunk_coop if self.prefill_pipeline == "coop" else PL.run_chunk_pipelined

    # ------------------------------------------------------------------ decode
    def new_state(self, max_seq_len: int | None = None):
        """A fresh device DecodeState (every layer's cache on its stage's device)."""
        from memra_dsv4.gpu.cache import DecodeState
        lay = {l: st.device for st in self.stages for l in st.layers}
        state = DecodeState(self.config, lay, int(max_seq_len or self.max_seq_len))
        state.owner = self
        self.devs.order_after_current()   # the caches were zeroed on the current stream
        return state

    def _check_state(self, state):
        from memra_dsv4.gpu.cache import DecodeState
        if not isinstance(state, DecodeState):
            raise ValueError(f"state must be a gpu DecodeState (Dsv4Gpu.new_state()), got "
                             f"{type(state).__name__}")
        if state.owner is not self:
            raise ValueError("state was made by another Dsv4Gpu (its caches live on that "
                             "model's devices); use this model's new_state()")
        return state

    def prefill(self, token_ids, state=None, *, all_logits: bool = False,
                return_streams: bool = False, taps=()):
        """Start a NEW sequence in ``state`` (reset first; a fresh one when None) and run
        ``token_ids`` from position 0 through the chunk routine (gpu.decode.forward_chunk).
        Returns (logits float32 NumPy [vocab] or [S, vocab], state), and with
        ``return_streams`` also the final streams [S, hc, dim] (float32 CuPy, last stage; the
        pipelined schedule is not used then: its stages do not keep them), or with ``taps``
        (trunk layer ids) those layers' output streams [S, n_taps, hc, dim] instead (the DSpark
        drafter's input; gpu.decode.gather_taps)."""
        from memra_dsv4.gpu.decode import forward_chunk, run_chunk
        ids = self.check_ids(token_ids)
        taps = self.check_taps(taps, return_streams)
        state = self.new_state() if state is None else self._check_state(state)
        if ids.shape[0] > state.max_seq_len:
            raise ValueError(f"prompt of {ids.shape[0]} tokens exceeds max_seq_len "
                             f"{state.max_seq_len}")
        state.reset()
        # reset's fills are on the current stream (the legacy default stream unless the caller
        # set one); the chunk routine's kernels run on the non-blocking compute streams
        self.devs.order_after_current()
        if self._step is not None:
            self._step.invalidate()
        with phase("prefill_state"):
            if return_streams:
                out = run_chunk(self, state, ids, all_logits=all_logits, ph="prefill_state",
                                keep_streams=True, taps=taps)
                return out.logits, state, out.streams
            chunks = self._pipeline_plan(ids.shape[0])
            if chunks:
                logits = self._pipeline_runner()(self, state, ids, chunks, all_logits=all_logits,
                                                 ph="prefill_state").logits
            else:
                logits = forward_chunk(self, state, ids, all_logits=all_logits, ph="prefill_state")
        return logits, state

    def prefill_chunk(self, state, token_ids, *, all_logits: bool = False):
        """Continue ``state`` by any number of tokens (legacy chunk routine)."""
        from memra_dsv4.gpu.decode import forward_chunk
        from memra_dsv4.oracle.decode import check_no_journal, check_room
        self._check_state(state)
        check_no_journal(state, "prefill_chunk")
        ids = self.check_ids(token_ids)
        check_room(state, ids.shape[0], "prefill_chunk")
        if self._step is not None:
            self._step.invalidate()
        return forward_chunk(self, state, ids, all_logits=all_logits, ph="prefill_chunk")

    def decode_step(self, state, token, *, readback: str = "logits", out=None):
        """Consume one token at position state.pos; logits float32 NumPy [vocab], or with
        ``readback="token"`` the greedy next token (int, np.argmax's rule: on the device path
        the head's greedy_argmax_f32, read back as 4 bytes).  ``out``: a caller's writeable
        C-contiguous float32 NumPy [vocab] that receives the logits and is returned (no new
        array per step; the device path copies its pinned readback buffer into it); refused
        with readback="token".  The path is ``self.decode_path`` (seam MEMRA_DSV4_DECODE_PATH,
        resolved at construction).  Every check runs before any work."""
        if readback not in ("logits", "token"):
            raise ValueError(f"decode_step: readback={readback!r}; expected 'logits' or 'token'")
        if out is not None:
            self._check_logits_out(out, readback)
        from memra_dsv4.oracle.decode import check_room
        tok = self._step_token(state, token, "decode_step")
        check_room(state, 1, "decode_step")
        if self.decode_path == "legacy":   # the one-token dispatch (gpu.decode module doc)
            from memra_dsv4.gpu.decode import forward_chunk
            logits = forward_chunk(self, state, np.array([tok], np.int64), ph="decode",
                                   one_token=True)
            if readback == "token":
                from memra_dsv4.host.sampling import greedy_token
                return greedy_token(logits)
            if out is not None:
                np.copyto(out, logits.reshape(out.shape))
                return out
            return logits
        from memra_dsv4.gpu.step import device_step
        return device_step(self, state, tok, readback=readback, out=out)

    def _check_logits_out(self, out, readback: str) -> None:
        V = self.config.vocab_size
        if readback != "logits":
            raise ValueError(f"decode_step: out= receives logits; readback={readback!r} returns "
                             f"a token")
        if not isinstance(out, np.ndarray):
            raise ValueError(f"decode_step: out must be a NumPy float32 array [{V}], got "
                             f"{type(out).__name__}")
        if out.dtype != np.float32 or out.shape != (V,):
            raise ValueError(f"decode_step: out must be float32 [{V}], got {out.dtype} "
                             f"{list(out.shape)}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("decode_step: out must be C-contiguous and writeable")

    def decode_greedy(self, state, token, n: int):
        """``n`` greedy decode steps from ``token`` at state.pos: step i consumes the token step
        i-1 picked (np.argmax of its logits: host.sampling.greedy_token's rule).  Returns int32
        NumPy [n], the picked tokens (the last one not yet consumed); state.pos advances by n.
        On the ``device`` path with graphs the tokens are fed on the device (the head's
        greedy_argmax_f32 writes the next step's tok; DeviceStep.greedy enqueues all n steps and
        waits once); on ``legacy`` and ``device-hostmath`` it is n host-fed steps.  Everything is
        validated before any device work: the token, n (an int >= 1) and the room for n
        positions; a refused call leaves the state as it was."""
        from memra_dsv4.oracle.decode import check_room
        tok = self._step_token(state, token, "decode_greedy")
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"decode_greedy: n must be an integer >= 1, got {n!r}")
        n = int(n)
        check_room(state, n, "decode_greedy")
        if self.decode_path == "legacy":
            out = np.empty(n, np.int32)
            for i in range(n):
                tok = out[i] = self.decode_step(state, tok, readback="token")
            return out
        from memra_dsv4.gpu.step import device_greedy
        return device_greedy(self, state, tok, n)

    def _step_token(self, state, token, what: str) -> int:
        """The checks of a call that consumes one token, before any work: the state is this
        model's, holds no uncommitted verify, and ``token`` is one integer id in range; returns
        it as a Python int.  A Python int or a NumPy integer scalar (what a sampler hands over)
        is checked in plain Python (oracle.model.check_token_scalar): this runs right after the
        previous step's host wait, where the few NumPy operations of check_ids took ~100 us
        against ~8 us back to back (cold caches; host_gap --wake, docs/decode_perf.md
        twenty-ninth session).  Anything else (a 0-d array, a bool, a float, a list) goes
        through check_ids, which refuses it as before; the messages are check_token_ids'."""
        from memra_dsv4.oracle.decode import check_no_journal
        from memra_dsv4.oracle.model import check_token_scalar
        self._check_state(state)
        check_no_journal(state, what)
        t = check_token_scalar(token, self.config.vocab_size)
        if t is not None:
            return t
        t = np.asarray(token)
        if t.ndim != 0:
            raise ValueError(f"token must be one integer id, got shape {t.shape}")
        return int(self.check_ids(t.reshape(1))[0])

    def verify(self, state, tokens, *, return_streams: bool = False, taps=()):
        """Speculative verify of [t_last, d1..dk] at positions pos..pos+k in one batched pass;
        logits [k+1, vocab] (gpu.verify: the oracle's convention, journaled for commit); with
        ``return_streams`` (logits, final streams [k+1, hc, dim] float32 CuPy), or with
        ``taps`` too (logits, those trunk layers' streams [k+1, n_taps, hc, dim])."""
        from memra_dsv4.gpu.verify import verify
        return verify(self, state, tokens, return_streams=return_streams,
                      taps=self.check_taps(taps, return_streams))

    def check_taps(self, taps, return_streams: bool) -> tuple:
        """``taps`` as a tuple of trunk layer ids, refused (naming the value) unless each is a
        distinct integer in 0..num_hidden_layers-1 and, when there are any, ``return_streams``
        is set (they are returned in the streams' place)."""
        n = self.config.num_hidden_layers
        try:
            out = tuple(taps)
        except TypeError:
            raise ValueError(f"taps = {taps!r} must be a sequence of trunk layer ids") from None
        for t in out:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < n:
                raise ValueError(f"taps: {t!r} is not a trunk layer id in 0..{n - 1}")
        if len(set(int(t) for t in out)) != len(out):
            raise ValueError(f"taps {out} repeat a layer")
        if out and not return_streams:
            raise ValueError("taps are returned in the streams' place: pass return_streams=True")
        return tuple(int(t) for t in out)

    def commit(self, state, n_accepted) -> None:
        """Keep positions pos..pos+n of the last verify and roll the rest back (gpu.verify)."""
        from memra_dsv4.gpu.verify import commit
        commit(self, state, n_accepted)

    def generate(self, token_ids, max_new: int) -> list[int]:
        """Greedy continuation: prefill once (the first token is np.argmax of its last logits),
        then the other max_new - 1 tokens by one decode_greedy call: on the ``device`` path the
        tokens are fed on the device and read back once; on ``legacy`` / ``device-hostmath``
        they are host-fed steps with the same argmax rule.  max_new and the room for the
        prompt plus max_new - 1 positions are checked before any work."""
        if (isinstance(max_new, (bool, np.bool_)) or not isinstance(max_new, (int, np.integer))
                or max_new < 0):
            raise ValueError(f"max_new = {max_new!r} must be a non-negative integer")
        if max_new == 0:
            return []
        ids = self.check_ids(token_ids)
        if ids.shape[0] + max_new - 1 > self.max_seq_len:
            raise ValueError(f"generate: a prompt of {ids.shape[0]} tokens and {max_new} new "
                             f"tokens exceed max_seq_len {self.max_seq_len}")
        logits, state = self.prefill(ids)
        out = [int(np.argmax(logits))]
        if max_new > 1:
            out += self.decode_greedy(state, out[0], max_new - 1).tolist()
        return out

    def _boundary(self, streams, si: int, ph: str = "prefill"):
        """Move the streams to the next stage's device: exactly one boundary_copy, bracketed
        as ``{ph}/boundary_copy`` (ph: the chunk's phase prefix, prefill / decode / verify).

        No host synchronisation, stream order only: dst is allocated from the destination
        compute stream's pool arena, an event there (after any earlier work on that arena's
        memory) is waited on by the source compute stream, the copy runs on the source compute
        stream (after the producer; the bounce path's host->device half on the destination
        stream, ordered by runtime.boundary_copy's own events), and the destination compute
        stream waits on an event recorded after it.  Memory-pool safety: CuPy's pool is per
        device and per stream; the source array came from the source compute stream's arena,
        so a later allocation reusing its memory is ordered after the copy on that same stream;
        it is also kept referenced (``_boundary_keep``) until the chunk routine has synchronised
        at its end, as gpu.pipeline does.  The bracket's events are recorded on the source
        compute stream: its GPU time is the wait for the destination's earlier work plus the copy
        (peer) or its device->host half (bounce)."""
        cp = self._cp
        from memra_dsv4.gpu import runtime

        src_dev = self.devs[self.stages[si].device]
        dst_dev = self.devs[self.stages[si + 1].device]
        with cp.cuda.Device(src_dev.id), src_dev.compute, phase(f"{ph}/boundary_copy"):
            with cp.cuda.Device(dst_dev.id), dst_dev.compute:
                dst = cp.empty(streams.shape, dtype=streams.dtype)
                allocated = cp.cuda.Event(disable_timing=True)
                allocated.record(dst_dev.compute)
            src_dev.compute.wait_event(allocated)
            path = runtime.boundary_copy(dst, streams, streams.nbytes, src_dev.compute,
                                         dst_stream=dst_dev.compute if self.force_bounce else None,
                                         force_bounce=self.force_bounce)
            copied = cp.cuda.Event(disable_timing=True)
            copied.record(src_dev.compute)
            dst_dev.compute.wait_event(copied)
        self.__dict__.setdefault("_boundary_keep", []).append(streams)
        self.boundary_paths.append(path)
        return dst

    def _boundary_release(self) -> None:
        """Drop the boundary sources kept by ``_boundary`` (call after the devices synchronised)."""
        self.__dict__.get("_boundary_keep", []).clear()

    def _head(self, st, streams, all_rows: bool = False, prefix: str = ""):
        """(logits f32 [vocab] of the last position, or [S, vocab] with ``all_rows``, hc_head
        output, final norm).  ``prefix``: whose hc_head / norm ("" the trunk's, "mtp.0." the MTP
        block's own); the head matrix is the trunk's either way (the MTP block has none)."""
        cp = self._cp
        cfg = self.config
        p = prefix
        y = G.hc_head(streams, st[f"{p}hc_head_fn"].astype(cp.float64), st[f"{p}hc_head_scale"],
                      st[f"{p}hc_head_base"], hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        yn = G.rmsnorm(y, _f64(st[f"{p}norm.weight"]), cfg.rms_norm_eps)
        if all_rows:
            return G.linear(self.gemm[st.device], yn, st["head.weight"], out="f32"), y, yn
        logits = G.linear(self.gemm[st.device], yn[-1:], st["head.weight"], out="f32")[0]
        return logits, y, yn

    def generate_reprefill(self, token_ids, max_new: int) -> list[int]:
        ids = list(self.check_ids(token_ids))
        if not isinstance(max_new, (int, np.integer)) or max_new < 0:
            raise ValueError(f"max_new = {max_new!r} must be a non-negative integer")
        out = []
        for _ in range(int(max_new)):
            nxt = int(np.argmax(self.forward(ids).logits))
            out.append(nxt)
            ids.append(nxt)
        return out


# ------------------------------------------------------------------------------ helpers
def _bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)


def _print_bytes(stages) -> None:
    for st in stages:
        print(f"memra_dsv4: device {st.device}: layers {st.layers.start}..{st.layers.stop - 1}"
              f"{' +embed' if st.has_embed else ''}{' +head' if st.has_head else ''}: "
              f"{st.nbytes / 2**30:.2f} GiB of weights placed (dense {st.dense_fmt})",
              file=sys.stderr)


def _f32(u16):
    return G.to_f32(u16)


def _f64(u16):
    import cupy as cp
    return _f32(u16).astype(cp.float64)


class _Block:
    """One trunk block's weights and shared helpers on one device (linear, hc_pre, rope tables,
    MoE); the block itself (attention against the layer cache) is gpu.decode.ChunkBlock."""

    def __init__(self, model: Dsv4Gpu, st, layer: int, ph: str) -> None:
        self.m, self.st, self.lid, self.ph = model, st, layer, ph
        self.cfg = model.config
        n = self.cfg.num_hidden_layers   # drafter stage s is layer id n + s, tensors mtp.{s}.*
        self.p = f"layers.{layer}" if layer < n else f"mtp.{layer - n}"
        self.g = model.gemm[st.device]
        self.ratio = self.cfg.compress_ratio(layer)
        self.kind = self.cfg.attn_kind(layer)

    def w(self, leaf: str):
        return self.st[f"{self.p}.{leaf}"]

    def lin(self, x, leaf: str, out: str = "bf16"):
        """linear with the weight ``leaf``: bf16 bits, or FP8 as stored (dequantised into the
        device's bf16 scratch first: the same GEMM and bits)."""
        name = f"{self.p}.{leaf}"
        return G.linear(self.g, x, self.st[name], out, scale=self.st.scale_of(name))

    def w_bf16(self, leaf: str):
        """The weight ``leaf`` as bf16 bits: the stored array, or for an FP8-stored one its
        dequantisation in the device's scratch (valid until the next dequant on this device)."""
        name = f"{self.p}.{leaf}"
        sc = self.st.scale_of(name)
        return self.st[name] if sc is None else self.g.dense_bf16(self.st[name], sc)

    def rope_tables(self, positions):
        """(cos, sin) f32 device tables of this layer's RoPE at ``positions``: host.rope's
        values, computed and uploaded once per chunk for every layer that shares the inverse
        frequencies (memoised on the model: ~5 ms of host time per layer at 8K tokens)."""
        cp = _cupy()
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        inv = layer_inv_freq(self.cfg, self.lid)

        def make():
            c, s = cos_sin(inv, positions, np.float32)
            return cp.asarray(c), cp.asarray(s)
        return self.m.chunk_memo(("rope", inv.tobytes(), positions.tobytes()), make)

    def rope_range(self, start: int, n: int, step: int = 1):
        """rope_tables(start + step * arange(n)): the same tables, memoised by (start, n, step)
        instead of by the positions' bytes (the chunk pass's positions are ranges: hashing
        ~22 KB of int64 per call for the key is host time for nothing)."""
        inv = layer_inv_freq(self.cfg, self.lid)
        return self.m.chunk_memo(
            ("rope_range", inv.tobytes(), int(start), int(n), int(step)),
            lambda: self.rope_tables(int(start) + int(step) * np.arange(int(n), dtype=np.int64)))

    def hc_pre(self, streams, sub: str):
        cp = _cupy()
        cfg = self.cfg
        return G.hc_pre(streams, self.w(f"hc_{sub}_fn").astype(cp.float64),
                        self.w(f"hc_{sub}_scale"), self.w(f"hc_{sub}_base"), hc=cfg.hc_mult,
                        iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    # ------------------------------------------------------------------------ MoE
    def routed_experts(self, x, idx, wts, shared):
        """combine(routed experts) + shared, batched (gpu.ops.prefill_moe.routed_moe) on the
        device ids ``idx``: the dispatch plan built on the device (``_moe_dispatch`` "device",
        nothing read back) or on the host (one device->host copy of idx, one host->device copy
        of the tables), then the fp4mma launches or, per group of experts, 3 dequants, 3 batched
        GEMMs and a SwiGLU (``_moe_gemm``)."""
        cp = _cupy()
        fmt = self.st.expert_fmt[self.lid]
        key = f"{self.p}.ffn.experts"
        experts = {w: (self.st[f"{key}.{w}.packed"], self.st[f"{key}.{w}.scale"])
                   for w in ("w1", "w2", "w3")}
        ws2 = None
        if fmt == "nvfp4":   # weight_scale_2 lives on the host: uploaded once per model
            cache = self.m._ws2_dev
            ws2 = {}
            for w in ("w1", "w2", "w3"):
                ck = (self.st.device, f"{key}.{w}")
                if ck not in cache:
                    cache[ck] = cp.asarray(self.st.ws2[f"{key}.{w}"].astype(np.float32))
                ws2[w] = cache[ck]
        gemm = self._moe_gemm(x.shape[1], experts["w1"][0].shape[1])
        return routed_moe(self.g, x, idx, wts, experts, fmt, self.cfg.swiglu_limit,
                          shared, ws2=ws2, ph=f"{self.ph}/ffn/moe", gemm=gemm,
                          dispatch=self._moe_dispatch(gemm))   # brackets dispatch / experts / combine

    def _moe_gemm(self, D: int, I: int) -> str:
        """The seam MEMRA_DSV4_PREFILL_MOE; the FP4 tensor-core GEMMs (fp4mma, wgmma) tile K by
        128, so a model whose hidden or expert width is not a multiple of 128 runs "blaslt"."""
        form = getattr(self.m, "prefill_moe", SEAM_PREFILL_MOE.default)
        return form if form == "blaslt" or (D % 128 == 0 and I % 128 == 0) else "blaslt"

    def _moe_dispatch(self, gemm: str) -> str:
        """The seam MEMRA_DSV4_PREFILL_DISPATCH for the FP4 tensor-core arms (fp4mma, wgmma: the
        device plan builds either arm's items); "blaslt" sizes its cuBLASLt batches from the host
        plan, so it always dispatches on the host."""
        form = getattr(self.m, "prefill_dispatch", SEAM_PREFILL_DISPATCH.default)
        return form if gemm in ("fp4mma", "wgmma") else "host"

    def moe(self, x, ids_d, cap, xb=None):
        """The MoE output [T, D] f32 (bf16-valued) of x [T, D] f32 (bf16-valued).  ``xb``: x's
        bf16 bits when the caller has them (gpu.decode.ChunkBlock): the router and shared
        GEMMs take them as they are instead of rounding x again (bf16_bits(x) = xb, exactly;
        three conversion launches saved); the routed experts gather the f32 rows either way."""
        cp = _cupy()
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        xg = x if xb is None else xb
        with phase(f"{self.ph}/ffn/moe/router"):
            logits = self.lin(xg, "ffn.gate.weight", "f32")
            idx, wts, scores = self.route(logits, ids_d, want_scores=cap is not None)
        with phase(f"{self.ph}/ffn/moe/shared"):
            gate = self.lin(xg, "ffn.shared_experts.w1.weight")
            up = self.lin(xg, "ffn.shared_experts.w3.weight")
            h = G.swiglu_clamped(gate, up, cfg.swiglu_limit)
            # the GEMM rounds h to bf16 bits itself: bf16_bits(store(h)) = bf16_bits(h), so the
            # oracle's store(h) before w2 is that rounding (one conversion launch saved)
            shared = self.lin(h, "ffn.shared_experts.w2.weight")
        y = self.routed_experts(x, idx, wts, shared)  # brackets dispatch / experts / combine
        if cap is not None:   # moe.idx as the oracle's int64 (the values are the device ids)
            cap.update({"moe.scores": scores, "moe.idx": idx.astype(cp.int64), "moe.weights": wts,
                        "moe.shared": shared, "moe.out": y})
        assert idx.shape[1] == k
        return y

    def route(self, logits, ids_d, want_scores: bool = False):
        """(idx [T, k] device ids in pick order, weights f32 [T, k], scores f32 [T, E] or None)
        of the router logits f32 [T, E]: host.routing.route on the device.

        ``prefill_router`` (class attribute, default "kernel"): gpu.ops.router.select, one
        launch, no host synchronisation (idx int32); "cupy": the CuPy chain of ops_glue
        (sqrtsoftplus, route_learned = a cupy.sort, which synchronises the host; idx int64).
        The two pick the same ids and weights from the same scores (the same f32 add of the
        bias, the same (score desc, id asc) order, the same f32 pick-order sum, IEEE divide and
        multiply); the scores themselves may differ by an f32 ulp or two: the kernel evaluates
        exp / log1p in double and rounds to f32 at the oracle's points, CuPy calls expf /
        log1pf.  The kernel serves E <= 512, k <= 16 (every preset); beyond, the chain."""
        cp = _cupy()
        cfg = self.cfg
        k, E = cfg.num_experts_per_tok, logits.shape[1]
        hashed = cfg.is_hash_layer(self.lid)
        if self.prefill_router == "kernel" and E <= max(RT._SELECT) and k <= RT.KMAX:
            logits = contiguous(logits, dtype=cp.float32)
            if hashed:
                route = dict(tid2eid=self._tid2eid32(),
                             token_ids=contiguous(ids_d, dtype=cp.int32))
            else:
                route = dict(bias=contiguous(self.w("ffn.gate.bias"), dtype=cp.float32))
            return RT.select(logits, k, cfg.routed_scaling_factor, want_scores=want_scores,
                             **route)
        scores = G.sqrtsoftplus(logits)
        if hashed:
            idx = self.w("ffn.gate.tid2eid")[ids_d].astype(cp.int64)
        else:
            idx = G.route_learned(scores, self.w("ffn.gate.bias"), k)
        return idx, G.route_weights(scores, idx, cfg.routed_scaling_factor), scores

    prefill_router = "kernel"

    def _tid2eid32(self):
        """The layer's tid2eid as int32 [V, k] on this device (router.select's table), converted
        once per model (the checkpoint's int64 holds expert ids < E)."""
        import cupy as cp
        cache = self.m.__dict__.setdefault("_tid2eid32", {})
        ck = (self.st.device, self.lid)
        t = cache.get(ck)
        if t is None:
            t = cache[ck] = cp.ascontiguousarray(self.w("ffn.gate.tid2eid").astype(cp.int32))
        return t


def _resolve_pdl(explicit: str | None) -> str:
    """The PDL seam (``MEMRA_DSV4_PDL`` or ``pdl=``), read once per model and printed."""
    return _resolve_announced("PDL", explicit, "device-step launches: pdl")


def _resolve_announced(which: str, explicit: str | None, what: str) -> str:
    """Seam ``SEAM_<which>``: argument > environment > default, printed with its source."""
    import sys
    from memra_dsv4 import seams
    seam = getattr(seams, f"SEAM_{which}")
    value = seams.resolve(seam, explicit)
    src = "argument" if explicit is not None else (
        f"env {seam.env}" if seams.env_value(seam) != seam.default else "default")
    print(f"memra_dsv4: {what} = {value} ({src})", file=sys.stderr)
    return value
