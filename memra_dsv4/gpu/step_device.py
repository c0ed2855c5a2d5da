"""The ``device`` decode step: one token through every stage over the StepWs arena
(gpu.step.step_ws_plan, one cudaMalloc per stage, made once), kernels only, every
position-dependent decision taken on the device from ``pos`` (int32 [1] in the arena):

* tok / pos: two 4-byte H2D copies per stage before the step (the only host input); the step's
  last launch (decode.cu greedy_argmax_f32, after the head GEMV) writes the greedy next token
  over tok, its entry head.tok_hist[pos + 1] and pos + 1, so ``step(readback="token")`` reads 4
  bytes back and ``greedy`` replays one stage's graph n times with nothing from the host in
  between (Dsv4Gpu.decode_greedy);
* embed gather (decode.cu); every sub-layer boundary in ONE launch (hc.cu hc_boundary: the
  previous sub-layer's hc_post + hc_pre + the input rmsnorm, bit-identical to those kernels
  run apart); bf16 GEMVs (decode.cu: warp per row, 4 weight loads in flight per lane);
* every projection of the attention input xn in ONE launch (gemv_bf16_multi over a per-layer,
  per-state GemvTable built before capture): wq_a, wkv, the compressor and indexer-compressor
  wkv / wgate (written straight into pending row (pos % r) [+ r] with ape added), the indexer's
  weights_proj;
* q: q_norm, wq_b, head_rms + RoPE fused (seam MEMRA_DSV4_DECODE_QNORM, ``model.decode_qnorm``:
  ``kernel`` (default) one head_rms_bf16 launch after wq_b, q normed in place; ``attn`` no launch:
  the sparse attention's _qn kernels norm + rope the raw q rows at their q load with
  head_rms_bf16's code, bit-identical); kv: norm_rope_sim (rmsnorm + RoPE + KV FP8 sim)
  written straight into ring row pos % W (the LayerCache ring / compressed rows are views of
  one [W + n, hd] buffer, so attention indexes it directly);
* compressor emission, gated on the device (a no-op unless (pos + 1) % r == 0), one launch per
  compressor (compressor.emit): pool (overlap / plain) over the pending rows, norm_rope_sim at
  kpos = pos + 1 - r straight into compressed row (pos + 1) / r - 1, pending_advance;
* indexer: q GEMV (by default inside wq_b's launch, MEMRA_DSV4_IDXQ_PAIR: idxq_pair_on) +
  RoPE/Hadamard/FP4, then scores over the key rows with
  n_valid = (pos + 1) // 4 from the device and the top-k in index order: ops.indexer.scores_topk
  in its default form 'auto' (MEMRA_DSV4_INDEXER_SELECT): when the key rows can hold more than
  index_topk keys, indexer_scores_tiles_d128 (scores + the high-byte histogram in a per-device
  workspace) then indexer_select_d128 (one CTA of 1024 threads); else indexer_fused_d128 in one
  launch (its last CTA selects through a per-device ticket counter);
* sparse attention with the inverse-RoPE epilogue, in the form ``model.decode_attn`` names (seam
  MEMRA_DSV4_DECODE_ATTN; the two are bit-identical):
  ``split`` (default): build_cand (window chronological, then the compressed segment, -1 padded,
  into the arena's attn.cand), then attention.sparse_attention split over CTAs with the heads
  per CTA of decode_attn_head_group (Flash: 8, every tile its own CTA; n_split auto at H's own
  group) and its combine kernel: three launches (two where auto_split gives 1: no combine);
  ``fused``: ONE launch (attention.sparse_attention_decode: the same candidate list computed in
  the kernel, split over CTAs, the partials merged by the CTAs that finish last through a
  per-device ticket counter).  Both use the arena's dev.attn_ws as the split workspace;
* router logits + select (learned bias or hash tid2eid[tok]) on the device in one launch
  (router_cluster_*, MEMRA_DSV4_ROUTER_HANDOFF = cluster, the default: one thread-block cluster
  whose rank-0 CTA receives the scores by st.async and selects; "ticket" or E > 256:
  router_fused_*, its last CTA selecting through a per-device ticket counter), fused FP4
  gate/up/SwiGLU and down+combine GEMVs reading the STORED expert bytes by device expert ids,
  shared expert via gemv_bf16_swiglu (w1, w3 and the clamped SwiGLU in one launch) + w2 GEMV;
* with ``model.hc_split`` "on" (seam MEMRA_DSV4_HC_SPLIT) each boundary is two launches instead
  (hc.cu hc_boundary_pre: the sub-layer's input; hc_boundary_sinkhorn: post / comb, read only by
  the next boundary), the Sinkhorn captured on a side stream beside the sub-layer (_hc_pre);
* hc_post ping-pong (fused into the next boundary; alone after a stage's last layer), hc_head +
  final norm + head GEMV + greedy_argmax_f32 on the last stage;
* stage boundary: runtime.boundary_copy (memcpyAsync peer copy, captured in the source stage's
  graph) into the next stage's streams.a, ordered by an event created at setup.
Graphs: one per stage, captured on the stage's compute stream the first time a state is
stepped with graph=True; cached per state (the cache addresses belong to the state) together
with the (pdl, decode_attn, decode_fork, hc_split, decode_priority, decode_qnorm,
decode_shared_w2) they were captured with: stepping the state after any of ``model.pdl`` /
``model.decode_attn`` / ``model.decode_fork`` / ``model.hc_split`` / ``model.decode_priority`` /
``model.decode_qnorm`` / ``model.decode_shared_w2`` changed recaptures.  With ``decode_priority`` "side" / "attn" (seam MEMRA_DSV4_DECODE_PRIORITY)
the side branches are captured on the device's greatest-priority streams and the graphs keep
the node priorities (graphs.capture).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np

from memra_dsv4.host.rope import layer_cos_sin

__all__ = ["DeviceStep", "stage_views", "step_ratios", "xn_projection_entries"]


class _Layer:
    pass


class GraphEntry(NamedTuple):
    """A state's captured step: one graph per stage and the forms it was captured with (a step
    with any other form recaptures)."""
    graphs: list
    pdl: bool
    attn: str
    fork: str
    hc_split: bool
    prio: str
    qnorm: str
    w2: str


class _Stage:
    pass


class DeviceStep:
    def __init__(self, model, max_seq_len: int) -> None:
        import cupy as cp
        import cupyx
        from memra_dsv4.gpu import graphs
        from memra_dsv4.gpu.arena import Arena
        from memra_dsv4.gpu.step import step_ws_plan

        self.m = model
        self.cfg = cfg = model.config
        self.msl = int(max_seq_len)
        self.stages: list[_Stage] = []
        # Per state, as long as the state lives (weak keys: a state that is dropped takes its
        # graphs and GEMV tables with it, and none is ever rebuilt while its state lives).  Up
        # to the thirtieth session these were dicts keyed by id(state) holding the state, FIFO-
        # bounded at 8 entries: with nine or more states stepped in turn every step recaptured
        # its graphs (~80 ms per step at full depth on an H100, docs/decode_perf.md), and the
        # evicted states' caches were kept alive by the dicts until then.  Values never refer
        # to their state (a value that did would keep its key alive).
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # state -> GraphEntry
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # state -> {lid: GemvTable}
        # device-hostmath: the same launches except the four islands (gpu.hostmath), eager
        self.hostmath = getattr(model, "decode_path", "") == "device-hostmath"
        self._tok = self._pos = 0
        self._logits_host = None   # pinned [vocab] f32 of the readback (made on first use)
        self._logits_ptrs = None   # its (host, device, nbytes) for the D2H, made with it
        # greedy(): pinned, made once here so a call allocates nothing.  _picks_host receives a
        # call's picks (one D2H from head.tok_hist); _pos_host[p] = p is the static source of the
        # several-stage position uploads (a copy reads its entry whenever it runs, and no entry
        # is ever rewritten, so calls need no ring and no wait before reusing it)
        self._picks_host = cupyx.zeros_pinned(self.msl, np.int32)
        self._pos_host = (cupyx.empty_pinned(self.msl, np.int32)
                          if len(model.stages) > 1 else None)
        if self._pos_host is not None:
            self._pos_host[:] = np.arange(self.msl, dtype=np.int32)
        self._forking = ""   # the fork form ("on" / "all") while capturing (_attention, _moe)
        self._qr_normed = "attn.qr"   # the arena buffer of the normed qr (_attention: attn.qrn with WQB_QNORM)
        self._hc_split = False   # this step's boundaries in two launches (seam MEMRA_DSV4_HC_SPLIT)
        self._hc_branch = False  # ... with the Sinkhorn on S.hc_side (while capturing only)
        self._qnorm = "kernel"   # this step's q norm form (seam MEMRA_DSV4_DECODE_QNORM, _attention)
        self._w2 = "gemv"        # this step's shared w2 form (seam MEMRA_DSV4_DECODE_SHARED_W2, _moe)
        for si, st in enumerate(model.stages):
            S = _Stage()
            S.st, S.dev, S.si = st, st.device, si
            S.stream = model.devs[st.device].compute
            S.ph = f"decode/stage{si}"  # phase names as the legacy path (gpu.decode)
            with cp.cuda.Device(st.device):
                S.plan = step_ws_plan(cfg, st.layers, st.has_embed, st.has_head, self.msl, si)
                S.arena = Arena(S.plan, st.device)
                S.v = S.arena.views()
                S.ratios = step_ratios(cfg, st.layers, si)
                # token / position for the step's two 4-byte uploads: pinned, so memcpyAsync
                # enqueues without a staging copy (rewritten only after the previous step's
                # final synchronize, when its uploads have run)
                S.host = cupyx.zeros_pinned(2, np.int32)
                S.tok_host = cupyx.zeros_pinned(1, np.int32)   # step(readback="token")'s D2H
                # what a host-fed step touches, resolved once: the pinned words as memoryviews
                # (a store or load is a few C instructions, no NumPy item machinery) and the
                # host / device addresses of the 4-byte copies (no .ctypes / .data objects per
                # step).  The step's Python runs right after the previous step's host wait, when
                # every code path it takes is cold (docs/decode_perf.md, twenty-ninth session):
                # the less it touches, the less that costs.
                S.host_words, S.tok_host_words = memoryview(S.host), memoryview(S.tok_host)
                S.host_ptr, S.tok_host_ptr = S.host.ctypes.data, S.tok_host.ctypes.data
                S.tok_dev_ptr, S.pos_dev_ptr = S.v["tok"].data.ptr, S.v["pos"].data.ptr
                S.greedy_ev = cp.cuda.Event(disable_timing=True)   # greedy(): the last stage's step done
                S.event = cp.cuda.Event(disable_timing=True)
                # MEMRA_DSV4_WQB_QNORM on CSA layers: the indexer's q GEMV (side2) waits for wq_b
                # (main), which writes the normed qr (_attention)
                S.qn_ev = cp.cuda.Event(disable_timing=True)
                S.pf_ev = cp.cuda.Event(disable_timing=True)   # MEMRA_DSV4_L2_SIDE wo (_attention)
                # the attention fork (seam MEMRA_DSV4_DECODE_FORK, graphs only): a side stream
                # and its fork / join events, made before any capture
                # Two sets of side streams: the launch priority of a captured kernel node is
                # its stream's (seam MEMRA_DSV4_DECODE_PRIORITY picks the set at capture)
                _, greatest = graphs.stream_priority_range()
                S.branches = {"off": self._branch_streams(S.stream, None),
                              "side": self._branch_streams(S.stream, greatest)}
                S.side, S.fork, S.side2, S.fork3, S.hc_side, S.hc_fork = S.branches["off"]
                S.moe_side, S.moe_fork = S.side, S.fork   # the shared expert's branch (_moe)
                S.hc_pending = False   # a Sinkhorn branch forked and not yet joined (_hc_pre)
                S.hc_ride = None       # an ffn Sinkhorn deferred to _moe's side branch (HC_JOIN=ride)
                S.layers, S.head_fn, S.head_host = stage_views(model, st, self.msl)
                if self.hostmath:
                    from memra_dsv4.gpu.hostmath import HostIO
                    S.io = HostIO(S.stream)
                self._prewarm(S)
            self.stages.append(S)
        # the arena, the pinned buffers and _prewarm's zeroed counters / workspaces were made on
        # the current stream, which the non-blocking compute streams do not order against
        model.devs.order_after_current()
        for d in model.devs:
            d.compute.synchronize()

    # ------------------------------------------------------------------ setup helpers
    @staticmethod
    def _branch_streams(origin, priority):
        """(side, fork, side2, fork3, hc_side, hc_fork) on streams of ``priority`` (None: the
        default), with their fork / join events: the attention fork's side stream (kv /
        compressor; the shared expert with fork "all"), the CSA indexer + candidates' second
        side stream, and the hc Sinkhorn's own side stream (seam MEMRA_DSV4_HC_SPLIT, graphs
        only), so it never queues behind the attention fork's launches.  Made before any capture."""
        import cupy as cp
        from memra_dsv4.gpu import graphs
        def make():
            return (cp.cuda.Stream(non_blocking=True) if priority is None
                    else graphs.priority_stream(priority))
        side, side2, hc_side = make(), make(), make()
        return (side, graphs.Fork(origin, side), side2, graphs.Fork(origin, side, side2),
                hc_side, graphs.Fork(origin, hc_side))

    def _prewarm(self, S) -> None:
        """Load every kernel module, the hc split workspace and boundary slots, and the router /
        indexer / decode attention ticket counters before any capture.  Both decode attention
        forms are ready: ops.kernel_names() has attention's split, combine and
        sparse_attn_decode_* kernels, ops_decode.KERNELS has build_cand, and the counters are
        made here (the split form needs none)."""
        from memra_dsv4.gpu import kernel_loader, ops, ops_decode
        from memra_dsv4.gpu.ops import attention as AT
        from memra_dsv4.gpu.ops import hc as HC
        from memra_dsv4.gpu.ops import indexer as IX
        from memra_dsv4.gpu.ops import router as RT
        loader = kernel_loader.get_loader(S.dev)
        for stem, names in list(ops.kernel_names().items()) + [(ops_decode.STEM, ops_decode.KERNELS)]:
            for n in names:
                loader.get(stem, n)
        # 4 groups: the split hc_pre; BOUNDARY_ROWS_MAX: the device verify's multi-row boundaries
        HC.split_workspace(max(4, HC.BOUNDARY_ROWS_MAX), max(1, 4 * self.cfg.hidden_size // HC.SEG))
        HC.boundary_slots()  # hc_boundary_poll's slots (BOUNDARY_IMPL "poll"; zero, baked by graphs)
        HC.coop_slots()  # hc_boundary_pre_coop's tagged slots (MEMRA_DSV4_HC_PRE_HANDOFF=coop)
        RT.workspace()  # router_fused_* / indexer_fused_d128 / sparse_attn_decode_* ticket
        IX.workspace()  # counters (graphs bake their addresses)
        IX.rows_workspace()  # the device verify's row form: per-row counters and histograms
        IX.hist_workspace()  # the split indexer's histogram (the same rule)
        ops_decode.qnorm_counter()  # gemv_bf16_multi_*_qn's ticket counter (MEMRA_DSV4_MULTI_QNORM)
        AT.decode_counters()

    def invalidate(self) -> None:
        """Prefill rewrote the caches in place (same addresses): graphs stay valid."""

    # ------------------------------------------------------------------ the step
    def step(self, state, token: int, graph: bool = True, readback: str = "logits", out=None):
        """One step of ``token`` at state.pos; returns the logits (f32 NumPy [vocab], a copy;
        with ``out``, copied into that caller-checked array, which is returned) or, with
        ``readback="token"``, the greedy next token (int: the head's greedy_argmax_f32,
        np.argmax's rule) read back as 4 bytes instead of the vocab's logits."""
        import cupy as cp
        import cupyx
        rt = cp.cuda.runtime
        if readback not in ("logits", "token"):
            raise ValueError(f"device step: readback={readback!r}; expected 'logits' or 'token'")
        gs, forms = self._prepare(state, graph)   # validated before any device work
        pos = int(state.pos)
        self._upload(token, pos)
        if self.hostmath:
            self._tok, self._pos = int(token), pos
        self._launch(state, gs, forms)
        last = self.stages[-1]
        # the readback (the step's one host wait): D2H on the last stage's stream into a pinned
        # buffer (no driver staging of a pageable destination), then a host copy, since the
        # buffer is rewritten by the next step and the caller keeps the returned array
        if readback == "token":   # the head's greedy_argmax_f32 wrote it over the stage's tok
            with cp.cuda.Device(last.dev):
                rt.memcpyAsync(last.tok_host_ptr, last.tok_dev_ptr, 4, rt.memcpyDeviceToHost,
                               last.stream.ptr)
            last.stream.synchronize()
            state.pos = pos + 1
            return last.tok_host_words[0]
        src = last.v["head.logits"]
        if self._logits_host is None or self._logits_host.size != src.size:
            self._logits_host = cupyx.empty_pinned(src.shape, src.dtype)
            self._logits_ptrs = (self._logits_host.ctypes.data, src.data.ptr, src.nbytes)
        with cp.cuda.Device(last.dev):
            host_ptr, dev_ptr, nbytes = self._logits_ptrs
            rt.memcpyAsync(host_ptr, dev_ptr, nbytes, rt.memcpyDeviceToHost, last.stream.ptr)
        last.stream.synchronize()
        if out is not None:   # the caller's array: no allocation (and no page faults) per step
            np.copyto(out, self._logits_host)
            logits = out
        else:
            logits = self._logits_host.copy()
        state.pos = pos + 1
        return logits

    def greedy(self, state, token: int, n: int, graph: bool = True):
        """``n`` greedy steps from ``token`` at state.pos, fed on the device.  The head's
        greedy_argmax_f32 ends every step by writing the next token over the stage's tok, its
        history entry (head.tok_hist[pos + 1]) and pos + 1, so one stage's graph is replayed n
        times with nothing from the host in between (the token and position uploaded once before,
        the n picks read back with one copy after: one host wait per call).  With several stages
        each step after the first also copies the last stage's tok to the others' and uploads
        every stage's position (all enqueued ahead; a stage waits for the previous step's last
        stage).  Returns int32 NumPy [n]: the token each step picked (the last one not yet
        consumed: state.pos advances by n).  The same launches and bytes as n host-fed steps
        whose host takes np.argmax of the logits (tests/gpu/test_step_greedy_gpu.py).  On
        device-hostmath (eager host islands) or with graph=False the steps are host-fed
        (step(readback="token") in a loop).  The caller validated token, n >= 1 and the room."""
        import cupy as cp
        from memra_dsv4.gpu import runtime
        rt = cp.cuda.runtime
        n = int(n)
        if self.hostmath or not graph:
            out = np.empty(n, np.int32)
            tok = int(token)
            for i in range(n):
                tok = out[i] = self.step(state, tok, graph, readback="token")
            return out
        gs, forms = self._prepare(state, graph)
        pos0 = int(state.pos)
        assert 1 <= n and pos0 + n <= self.msl, (pos0, n, self.msl)   # the caller checked the room
        last = self.stages[-1]
        multi = len(self.stages) > 1
        picks = self._picks_host[:n]   # the previous call's picks were copied out after its wait
        self._upload(token, pos0)
        for i in range(n):
            if i > 0 and multi:
                # step i-1 has finished on every stage once the last one has (each stage waited
                # for its predecessor): its token goes from the last stage's tok to the others',
                # copied on the last stage's stream after its graph (as a stage boundary's copy)
                with cp.cuda.Device(last.dev):
                    for S in self.stages[:-1]:
                        runtime.boundary_copy(S.v["tok"], last.v["tok"], 4, last.stream,
                                              dst_stream=S.stream, force_bounce=self.m.force_bounce)
                    last.greedy_ev.record(last.stream)
                for S in self.stages[:-1]:
                    with cp.cuda.Device(S.dev):
                        S.stream.wait_event(last.greedy_ev)
                        rt.memcpyAsync(S.v["pos"].data.ptr, self._pos_host.ctypes.data
                                       + 4 * (pos0 + i), 4, rt.memcpyHostToDevice, S.stream.ptr)
            self._launch(state, gs, forms)
        hist = last.v["head.tok_hist"]
        with cp.cuda.Device(last.dev):
            rt.memcpyAsync(picks.ctypes.data, hist.data.ptr + 4 * (pos0 + 1), 4 * n,
                           rt.memcpyDeviceToHost, last.stream.ptr)
        last.stream.synchronize()
        state.pos = pos0 + n
        return np.array(picks, dtype=np.int32)

    def _upload(self, token: int, pos: int) -> None:
        """The step's host input: token and position into every stage's arena tok / pos (two
        4-byte H2D copies per stage from its pinned host pair, on its compute stream; the pair
        is rewritten only after the previous step's final synchronize, when its copies ran)."""
        import cupy as cp
        rt = cp.cuda.runtime
        for S in self.stages:
            words = S.host_words
            words[0], words[1] = token, pos
            with cp.cuda.Device(S.dev):
                rt.memcpyAsync(S.tok_dev_ptr, S.host_ptr, 4, rt.memcpyHostToDevice, S.stream.ptr)
                rt.memcpyAsync(S.pos_dev_ptr, S.host_ptr + 4, 4, rt.memcpyHostToDevice,
                               S.stream.ptr)

    def _prepare(self, state, graph: bool):
        """Validate the step's forms, build the state's tables and (graph) capture or find its
        graphs, before any of the step's device work.  Returns (graphs or None, forms)."""
        import cupy as cp
        if state.max_seq_len != self.msl:
            raise ValueError(f"device step: state max_seq_len {state.max_seq_len} != the "
                             f"StepWs built for {self.msl}")
        attn = self.attn_form()
        qnorm = self.qnorm_form()
        w2 = self.shared_w2_form()
        self._ensure_tables(state)
        from memra_dsv4.gpu.ops_decode import set_l2_prefetch
        for S in self.stages:   # the GEMVs' prefetch budget (a constant: graphs follow it)
            set_l2_prefetch(S.dev, getattr(self.m, "l2_prefetch", "off"))
        pdl_on = getattr(self.m, "pdl", "off") == "on"
        if self.hostmath:   # host round trips inside the step: eager, no PDL (gpu.hostmath)
            graph, pdl_on = False, False
        hc_split = self.hc_split_form() == "on" and not self.hostmath
        forms = (pdl_on, attn, qnorm, w2, hc_split)
        if not graph:
            return None, forms
        fork, prio = self.fork_form(), self.priority_form()
        gs = self._graphs.get(state)
        if gs is None or gs[1:] != (pdl_on, attn, fork, hc_split, prio, qnorm, w2):
            gs = GraphEntry(self._capture(state, pdl_on, attn, fork, hc_split, prio, qnorm, w2),
                            pdl_on, attn, fork, hc_split, prio, qnorm, w2)
            self._graphs[state] = gs
        return gs, forms

    def _launch(self, state, gs, forms) -> None:
        """The step's launches on every stage: the captured graphs (gs) or, gs None, eagerly."""
        import cupy as cp
        pdl_on, attn, qnorm, w2, hc_split = forms
        if gs is not None:
            for S, g in zip(self.stages, gs.graphs):
                with cp.cuda.Device(S.dev):
                    if S.si > 0:
                        S.stream.wait_event(self.stages[S.si - 1].event)
                    g.launch(S.stream)
                    if S.si + 1 < len(self.stages):
                        S.event.record(S.stream)
            return
        from memra_dsv4.gpu.pdl import pdl_launches
        self._hc_split, self._hc_branch = hc_split, False   # eager: one stream, same order
        self._qnorm = qnorm
        self._w2 = w2
        try:
            for S in self.stages:
                with cp.cuda.Device(S.dev), S.stream, pdl_launches(pdl_on):  # S.stream current: phase events
                    if S.si > 0:
                        S.stream.wait_event(self.stages[S.si - 1].event)
                    self._enqueue(S, state, attn)
                    if S.si + 1 < len(self.stages):
                        S.event.record(S.stream)
        finally:
            self._hc_split = False
            self._qnorm = "kernel"
            self._w2 = "gemv"

    def fork_form(self) -> str:
        """``model.decode_fork`` (seam MEMRA_DSV4_DECODE_FORK; its default when the model has none),
        validated: "on" captures the attention sub-layer's kv / compressor launches on a side
        stream and (CSA) the indexer + candidates on a second one, beside wq_b; "single" the
        former "on" (one side branch, candidates after the join; for A/B); "all" = "on" plus the
        shared expert beside the router and the routed gate/up; "lead" = "all" with the CSA
        indexer's q GEMV on the main stream before wq_b, the rest of the indexer forked after it
        (graphs only; the eager step stays one stream)."""
        from memra_dsv4.seams import SEAM_DECODE_FORK
        value = getattr(self.m, "decode_fork", None) or SEAM_DECODE_FORK.default
        return SEAM_DECODE_FORK.check(value, f"model.decode_fork (env {SEAM_DECODE_FORK.env})")

    def priority_form(self) -> str:
        """``model.decode_priority`` (seam MEMRA_DSV4_DECODE_PRIORITY; its default when the model
        has none), validated: "side" captures the side branches on the greatest-priority streams
        and instantiates the stage graphs with node priorities (graphs.capture node_priority);
        "attn" the same except the shared expert's branch (_moe); "off" neither."""
        from memra_dsv4.seams import SEAM_DECODE_PRIORITY
        value = getattr(self.m, "decode_priority", None) or SEAM_DECODE_PRIORITY.default
        return SEAM_DECODE_PRIORITY.check(value, f"model.decode_priority (env {SEAM_DECODE_PRIORITY.env})")

    def hc_split_form(self) -> str:
        """``model.hc_split`` (seam MEMRA_DSV4_HC_SPLIT; its default when the model has none),
        validated: "on" runs each sub-layer boundary as hc_boundary_pre + hc_boundary_sinkhorn,
        the Sinkhorn on a side graph branch (graphs; the eager step keeps one stream)."""
        from memra_dsv4.seams import SEAM_HC_SPLIT
        value = getattr(self.m, "hc_split", None) or SEAM_HC_SPLIT.default
        return SEAM_HC_SPLIT.check(value, f"model.hc_split (env {SEAM_HC_SPLIT.env})")

    def qnorm_form(self) -> str:
        """``model.decode_qnorm`` (seam MEMRA_DSV4_DECODE_QNORM; its default when the model has
        none), validated: "kernel" runs head_rms_bf16 (+ q RoPE) after wq_b, "attn" leaves q raw
        and passes q_norm to the sparse attention (its _qn kernels norm + rope at the q load)."""
        from memra_dsv4.seams import SEAM_DECODE_QNORM
        value = getattr(self.m, "decode_qnorm", None) or SEAM_DECODE_QNORM.default
        return SEAM_DECODE_QNORM.check(value, f"model.decode_qnorm (env {SEAM_DECODE_QNORM.env})")

    def shared_w2_form(self) -> str:
        """``model.decode_shared_w2`` (seam MEMRA_DSV4_DECODE_SHARED_W2; its default when the model
        has none), validated: "gemv" launches the shared expert's w2 GEMV (gemv_bf16) and passes
        its output to the down + combine, "fused" has the down + combine compute the w2 rows
        (gemv_*_down_combine_k2_f_w2; where it does not apply, _moe keeps the separate launch)."""
        from memra_dsv4.seams import SEAM_DECODE_SHARED_W2
        value = getattr(self.m, "decode_shared_w2", None) or SEAM_DECODE_SHARED_W2.default
        return SEAM_DECODE_SHARED_W2.check(value, f"model.decode_shared_w2 (env {SEAM_DECODE_SHARED_W2.env})")

    def attn_form(self) -> str:
        """The decode attention form of the next step: ``model.decode_attn`` (seam
        MEMRA_DSV4_DECODE_ATTN; "split" when the model has none), validated."""
        from memra_dsv4.seams import SEAM_DECODE_ATTN
        value = getattr(self.m, "decode_attn", None) or SEAM_DECODE_ATTN.default
        return SEAM_DECODE_ATTN.check(value, f"model.decode_attn (env {SEAM_DECODE_ATTN.env})")

    def _ensure_tables(self, state) -> None:
        """Per state (they hold its pending-row addresses), before any capture or eager
        enqueue: for every layer the GemvTable of its projections of the attention input xn
        (wq_a, wkv, compressor and indexer-compressor wkv / wgate written straight into the
        pending rows with ape, indexer weights_proj).  Built once; never inside a capture."""
        if state in self._tables:
            return
        import cupy as cp
        from memra_dsv4.gpu import ops_decode as DK
        D = self.cfg.hidden_size
        tabs = {}
        for S in self.stages:
            v = S.v
            with cp.cuda.Device(S.dev):
                for L in S.layers:
                    tabs[L.lid] = DK.GemvTable(
                        xn_projection_entries(L, state.cache(L.lid), v["attn.qr"], v["dev.kvraw"],
                                              v.get("idx.w")), D)
        self._graphs.pop(state, None)   # a graph bakes its table's address: never one without it
        self._tables[state] = tabs
        # each GemvTable was uploaded by cp.asarray on the current stream (pinned staging, then
        # an async H2D): order the compute streams, whose gemv_bf16_multi reads it, after that
        self.m.devs.order_after_current()

    def _capture(self, state, pdl_on: bool = False, attn: str = "split", fork: str = "off",
                 hc_split: bool = False, prio: str = "off", qnorm: str = "kernel", w2: str = "gemv"):
        """One graph per stage; with ``pdl_on`` every kernel launch carries the programmatic
        stream serialisation attribute (gpu/pdl.py), captured as programmatic graph edges;
        ``attn`` the decode attention form ("split" / "fused"); ``fork`` "on": each attention
        sub-layer's kv / compressor launches on the stage's side stream and the indexer +
        candidates on its second side stream (_attention), "single": all of them on the side
        stream, "all": "on" plus the shared expert of each MoE (_moe); ``hc_split``: each boundary's
        Sinkhorn launch on the stage's hc side stream (_hc_pre); ``prio`` "side": those side
        streams are the greatest-priority set and the graph keeps its nodes' priorities; "attn":
        the same except the shared expert's branch (_moe), which stays at the default priority;
        ``qnorm`` the q norm form ("kernel" / "attn": _attention); ``w2`` the shared expert's w2
        form ("gemv" / "fused": _moe)."""
        import cupy as cp
        from memra_dsv4.gpu import graphs
        from memra_dsv4.gpu.pdl import pdl_launches
        from memra_dsv4.profiling import phase_set_capturing
        from memra_dsv4.profiling import phases as _ph
        out = []
        for d in self.m.devs:
            d.compute.synchronize()
        was = _ph._capturing
        phase_set_capturing(True)  # brackets inside _enqueue record no events while capturing
        try:
            for S in self.stages:
                self._forking = fork if fork in ("on", "all", "single", "lead") else ""
                self._hc_split = self._hc_branch = bool(hc_split)
                self._qnorm = qnorm
                self._w2 = w2
                S.hc_pending = False
                S.hc_ride = None
                b = S.branches["off" if prio == "off" else "side"]
                S.side, S.fork, S.side2, S.fork3, S.hc_side, S.hc_fork = b
                # "attn": the shared expert's branch stays at the default priority
                S.moe_side, S.moe_fork = (S.branches["off"] if prio == "attn" else b)[:2]
                with cp.cuda.Device(S.dev), pdl_launches(pdl_on):
                    out.append(graphs.capture(S.stream, lambda S=S: self._enqueue(S, state, attn),
                                              node_priority=prio != "off"))
        finally:
            phase_set_capturing(was)
            self._forking = ""
            self._hc_split = self._hc_branch = False
            for S in self.stages:
                S.side, S.fork, S.side2, S.fork3, S.hc_side, S.hc_fork = S.branches["off"]
                S.moe_side, S.moe_fork = S.side, S.fork
            self._qnorm = "kernel"
            self._w2 = "gemv"
        return out

    # ------------------------------------------------------------------ launches
    def _enqueue(self, S, state, attn: str = "split") -> None:
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu import runtime
        from memra_dsv4.gpu.ops import hc as HC
        from memra_dsv4.gpu.ops import rmsnorm as RN
        from memra_dsv4.profiling import phase
        cfg, st, v, sp = self.cfg, S.st, S.v, S.ph
        D = cfg.hidden_size
        with phase(sp):  # events on the current stream = S.stream (step / graphs.capture)
            DK.step_scalars(v["pos"], v["dev.aux"], S.ratios)
            cur, oth = v["streams.a"], v["streams.b"]
            if st.has_embed:
                with phase(f"{sp}/embed"):
                    DK.embed_gather(v["tok"], st["embed.weight"], cur)
            tabs = self._tables[state]
            for L in S.layers:
                with phase(f"{sp}/block"):
                    cur, oth = self._block(S, L, cur, oth, state.cache(L.lid), tabs[L.lid], attn)
            assert not S.hc_pending, "device step: an hc Sinkhorn branch left unjoined"
            if st.has_head:
                with phase(f"{sp}/head"):
                    y, yn = v["head.y"].reshape(1, D), v["head.yn"].reshape(1, D)
                    if self.hostmath:   # the head gate on the host (gpu.hostmath)
                        from memra_dsv4.gpu import hostmath as HM
                        HM.head_island(S.io, cfg, cur, S.head_fn, S.head_host["scale"],
                                       S.head_host["base"], mixes=v["dev.head_mix"],
                                       pre=v["dev.head_pre"], y=y)
                    else:
                        HC.hc_head(cur, S.head_fn, st["hc_head_scale"], st["hc_head_base"],
                                   hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, out=y,
                                   mixes=v["dev.head_mix"])
                    RN.rmsnorm(y, st["norm.weight"], cfg.rms_norm_eps, out=yn)
                    DK.gemv_bf16(st["head.weight"], yn, v["head.logits"])
                    # the greedy next token over the stage's tok, its history entry and pos + 1
                    # (their readers, embed_gather, the hash routers and every position-dependent
                    # kernel, ran earlier in this step; every branch has joined): the 4-byte
                    # readback of step(readback="token") and greedy()'s device feed
                    DK.greedy_argmax(v["head.logits"], v["tok"], v["pos"], v["head.tok_hist"])
            if S.si + 1 < len(self.stages):
                nxt = self.stages[S.si + 1]
                with phase(f"{sp}/boundary_copy"):
                    runtime.boundary_copy(nxt.v["streams.a"], cur, cur.nbytes, S.stream,
                                          force_bounce=self.m.force_bounce)

    def _hc_pre(self, S, L, streams, sub: str, f=None, out=None) -> None:
        """The boundary into sub-layer ``sub`` ("attn" / "ffn") in one launch (hc.hc_boundary):
        with f (the previous sub-layer's output) first that sub-layer's hc_post (streams -> out,
        post / comb read and then replaced in place), then hc_pre of the result (x, pre, post,
        comb) and the sub-layer's input norm (xn).

        Split (seam MEMRA_DSV4_HC_SPLIT "on"): two launches with hc_boundary's bytes,
          C_b = hc_boundary_pre   reads  streams, f, hc.post / hc.comb (boundary b-1's), fn, ...
                                  writes out, dev.mix (all 24), hc.pre, x, xn (+ the hc split ws)
          K_b = hc_boundary_sinkhorn  reads dev.mix, scale, base;  writes hc.post, hc.comb
        In a graph K_b is captured on S.hc_side: fork (an event recorded on S.stream right after
        C_b) -> K_b -> join (an event on S.hc_side that S.stream waits on) placed right before the
        next reader of hc.post / hc.comb: C_{b+1} here, or the stage's last stand-alone hc_post
        (_block; _hc_join).  The sub-layer after C_b runs on S.stream beside K_b; it touches none
        of dev.mix / hc.post / hc.comb (and K_b none of its buffers, nor the hc split workspace).
        Why single buffers suffice (no double buffering): every access to the three is ordered,
          hc.post / hc.comb: C_b's reads (b-1's values) -> K_b's writes: the fork edge follows
            C_b, and K_b's griddepcontrol.wait (PDL_ENTRY, its first statement) returns only once
            C_b has completed, so even a programmatic fork edge cannot let K_b write them while
            C_b still reads; K_b's writes -> C_{b+1}'s (or the last hc_post's) reads: the join;
          dev.mix: C_b writes -> K_b reads (fork), K_b reads -> C_{b+1} writes (join).
        hc.pre (C_b only) has no reader in the step.  Eager: K_b right after C_b on S.stream (the
        same launches and values, one stream)."""
        from memra_dsv4.gpu.ops import hc as HC
        cfg, v = self.cfg, S.v
        D = cfg.hidden_size
        if self.hostmath:   # hc_post alone, then the split on the host (gpu.hostmath)
            from memra_dsv4.gpu import hostmath as HM
            if f is not None:
                HC.hc_post(f, streams, v["hc.post"].reshape(1, -1), v["hc.comb"].reshape(1, 4, 4),
                           out=out)
                streams = out
            HM.hc_island(S.io, cfg, streams, L.f32[f"hc_{sub}_fn"], L.host[f"hc_{sub}_scale"],
                         L.host[f"hc_{sub}_base"], L.w(f"{sub}_norm.weight"),
                         mixes=v["dev.mix"], x=v["x"].reshape(1, D), xn=v["xn"].reshape(1, D),
                         pre=v["hc.pre"].reshape(1, -1), post=v["hc.post"].reshape(1, -1),
                         comb=v["hc.comb"].reshape(1, 4, 4))
            return
        # MEMRA_DSV4_HC_PRE_HANDOFF: the last-CTA ticket kernel, one thread-block cluster
        # (D % 256 == 0, D <= 4096, else the ticket) or the cooperative grid with 8 / all tail
        # CTAs (D in 1024 .. 8192, powers of two, else the ticket); the same bytes.  Read (and so
        # validated) whether or not the split applies it.
        handoff = hc_pre_handoff()
        if not HC.pre_handoff_covers(D, handoff):
            handoff = "ticket"
        if self._hc_split:
            post, comb = v["hc.post"].reshape(1, -1), v["hc.comb"].reshape(1, 4, 4)
            self._hc_join(S)   # K_{b-1} wrote post / comb: C_b reads them
            kw = dict(f=f, out=out, post_in=post, comb_in=comb) if f is not None else {}
            HC.hc_boundary_pre(streams, L.f32[f"hc_{sub}_fn"], L.w(f"hc_{sub}_scale"),
                               L.w(f"hc_{sub}_base"), L.w(f"{sub}_norm.weight"), hc_eps=cfg.hc_eps,
                               norm_eps=cfg.rms_norm_eps, xn=v["xn"].reshape(1, D),
                               x=v["x"].reshape(1, D), pre=v["hc.pre"].reshape(1, -1),
                               mixes=v["dev.mix"], handoff=handoff, **kw)

            def sinkhorn():
                HC.hc_boundary_sinkhorn(v["dev.mix"], L.w(f"hc_{sub}_scale"), L.w(f"hc_{sub}_base"),
                                        iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, post=post,
                                        comb=comb)
            form = hc_join_form()
            ride = form in ("ride", "ride_attn") and (
                (sub == "attn" and self._forking in ("on", "all"))
                or (sub == "ffn" and form == "ride" and self._forking == "all"))
            if self._hc_branch and ride and sub == "attn":
                # MEMRA_DSV4_HC_JOIN=ride: K_b first on the attention fork's side stream (forked
                # here, after C_b; _attention forks it again before the kv launches and joins it
                # before the sparse attention), so no launch of the main stream waits on the hc
                # side stream
                S.fork.fork()
                with S.side:
                    sinkhorn()
            elif self._hc_branch and ride:
                S.hc_ride = sinkhorn   # _moe: first on the shared expert's branch (forked next)
            elif self._hc_branch:
                S.hc_fork.fork()
                with S.hc_side:
                    if sub == "attn":   # MEMRA_DSV4_L2_SIDE wq: wq_b's first bytes during the
                        self._l2_side(S, L, "wq")   # boundary / multi GEMV / q_norm window
                    sinkhorn()
                S.hc_pending = True
            else:
                sinkhorn()
            return
        HC.hc_boundary(streams, L.f32[f"hc_{sub}_fn"], L.w(f"hc_{sub}_scale"), L.w(f"hc_{sub}_base"),
                       L.w(f"{sub}_norm.weight"), iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                       norm_eps=cfg.rms_norm_eps, xn=v["xn"].reshape(1, D), x=v["x"].reshape(1, D),
                       pre=v["hc.pre"].reshape(1, -1), post=v["hc.post"].reshape(1, -1),
                       comb=v["hc.comb"].reshape(1, 4, 4), mixes=v["dev.mix"], f=f, out=out)

    @staticmethod
    def _hc_join(S) -> None:
        """Join the pending hc Sinkhorn branch (if any) into S.stream: before the next reader of
        hc.post / hc.comb (_hc_pre's docstring)."""
        if getattr(S, "hc_ride", None) is not None:   # never left over: _moe enqueues it
            raise RuntimeError("hc Sinkhorn (MEMRA_DSV4_HC_JOIN=ride) deferred to a MoE that did not run it")
        if S.hc_pending:
            S.hc_fork.join()
            S.hc_pending = False

    def _block(self, S, L, cur, oth, cache, table, attn: str = "split"):
        """One layer.  The hc_post that closes a sub-layer is fused into the next boundary's
        launch (_hc_pre with f): the attn sub-layer's into the ffn boundary, the ffn sub-layer's
        into the next layer's attn boundary.  The stage's first layer starts from the streams
        as they are (embed / boundary copy); its last layer applies the ffn hc_post alone (the
        head or the boundary copy reads the streams).  A stage of n layers swaps the streams 2n
        times (1 + 2 + ... + 2 + 3), as before: they end in the buffer they started in."""
        from memra_dsv4.gpu.ops import hc as HC
        from memra_dsv4.profiling import phase
        v, bp = S.v, f"{S.ph}/block"
        D = self.cfg.hidden_size
        post, comb = v["hc.post"].reshape(1, 4), v["hc.comb"].reshape(1, 4, 4)
        with phase(f"{bp}/attn"):
            if L is S.layers[0]:
                self._hc_pre(S, L, cur, "attn")
            else:  # the previous layer's ffn hc_post + this attn's hc_pre + attn_norm
                self._hc_pre(S, L, cur, "attn", f=v["ffn.out"].reshape(1, D), out=oth)
                cur, oth = oth, cur
            self._attention(S, L, cache, table, attn)
        with phase(f"{bp}/ffn"):  # the attn hc_post + the ffn hc_pre + ffn_norm
            self._hc_pre(S, L, cur, "ffn", f=v["attn.out"].reshape(1, D), out=oth)
            cur, oth = oth, cur
            self._moe(S, L)
            if L is S.layers[-1]:
                self._hc_join(S)   # the split's last Sinkhorn wrote post / comb
                HC.hc_post(v["ffn.out"].reshape(1, D), cur, post, comb, out=oth)
                cur, oth = oth, cur
        return cur, oth

    def _compress(self, S, L, pend, dst, indexer: bool) -> None:
        """The emission half of a compressor (its wkv / wgate GEMVs wrote this token's pending
        row in the layer's GemvTable) in ONE launch (compressor.emit: compress_emit_*): pool,
        norm + RoPE (at kpos = pos + 1 - r) + sim straight into compressed row (pos + 1) / r - 1,
        then advance the pending rows; a no-op unless (pos + 1) % r == 0 (the emit gate reads pos
        on the device).  Byte-for-byte the former pool_* + norm_rope_sim(row="entry") +
        pending_advance launches."""
        from memra_dsv4.gpu.ops import compressor as CM
        sub = "attn.indexer.compressor" if indexer else "attn.compressor"
        CM.emit(S.v["pos"], pend.kv, pend.score, pend.ratio, pend.overlap, L.f32[f"{sub}.norm.weight"],
                self.cfg.rms_norm_eps, L.cos, L.sin, "hadfp4" if indexer else "fp8", dst)

    def _l2_side(self, S, L, target: str) -> None:
        """MEMRA_DSV4_L2_SIDE: a paced L2 prefetch of the first MEMRA_DSV4_L2_SIDE_MB of
        ``target``'s weight ("wq": attn.wq_b, "wo": attn.wo_a), launched on the current (side)
        stream when l2_side_targets() names it; bf16 or FP8 bytes alike (the bytes as stored)."""
        if target not in l2_side_targets():
            return
        from memra_dsv4.gpu import ops_decode as DK
        w, _ = L.lin("attn.wq_b" if target == "wq" else "attn.wo_a")
        mb, ctas, ns = l2_side_params()
        n = min(int(mb * (1 << 20)), w.nbytes) // 16 * 16
        DK.l2_prefetch_paced([(w, n)], ctas=ctas, sleep_ns=ns)

    def _indexer_q(self, S, L):
        """The indexer's q GEMV (idx.q from the normed qr): the one bandwidth-bound launch of the
        indexer; decode_fork "lead" issues it on the main stream before wq_b (_attention)."""
        from memra_dsv4.gpu import ops_decode as DK
        cfg, v = self.cfg, S.v
        q = v["idx.q"].reshape(1, cfg.index_n_heads, cfg.index_head_dim)
        w, sc = L.lin("attn.indexer.wq_b")
        DK.gemv_bf16(w, v[self._qr_normed], q, scale=sc)

    def _indexer(self, S, L, cache, q_done: bool = False, before_q=None):
        """The CSA indexer: its compressor emission, the q GEMV (unless ``q_done``: _indexer_q
        already issued it), RoPE / Hadamard / FP4 sim of q, scores + top-k -> idx.sel."""
        from memra_dsv4.gpu.ops import indexer as IX
        from memra_dsv4.gpu.ops import quant_sim as QS
        cfg, v = self.cfg, S.v
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        self._compress(S, L, cache.idx_state, cache.idx_keys, indexer=True)
        q = v["idx.q"].reshape(1, nI, dI)
        if before_q is not None:   # _attention: wq_b (which norms qr, or computes idx.q), then
            before_q()             # the wait for it
        if not q_done:
            self._indexer_q(S, L)
        QS.rope_hadamard128_fp4(q, v["pos"], L.cos, L.sin, out=q)
        N = cache.idx_keys.shape[0]
        nv = v["dev.aux"][0:1]
        sc = v["dev.idx_scores"][:N].reshape(1, N)
        sel = v["idx.sel"]
        if self.hostmath:   # scores on the device, the fine top-k on the host (gpu.hostmath)
            from memra_dsv4.gpu import hostmath as HM
            HM.indexer_island(S.io, cfg, q, v["idx.w"].reshape(1, nI), cache.idx_keys, nv,
                              (self._pos + 1) // 4, scores=sc, sel=sel)
            return sel
        # scores + top-k (index order): indexer_scores_tiles_d128 + indexer_select_d128 when the
        # key rows hold more than index_topk (form 'auto'), else indexer_fused_d128 in one
        # launch; MEMRA_DSV4_INDEXER_SELECT=fused|split forces one; the same bytes
        IX.scores_topk(q, v["idx.w"].reshape(1, nI), cache.idx_keys, nv, cfg.index_topk, sc,
                       sel.reshape(1, -1), w_scale=dI ** -0.5 * nI ** -0.5)
        return sel

    def _attention(self, S, L, cache, table, attn: str = "split") -> None:
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu.ops import attention as AT
        from memra_dsv4.gpu.ops import compressor as CM
        from memra_dsv4.gpu.ops import rmsnorm as RN
        from memra_dsv4.profiling import phase
        cfg, v, ap = self.cfg, S.v, f"{S.ph}/block/attn"
        eps, W = cfg.rms_norm_eps, cfg.sliding_window
        H, hd = cfg.num_attention_heads, cfg.head_dim
        pos = v["pos"]
        qr = v["attn.qr"].reshape(1, -1)
        q = v["attn.q"].reshape(1, H, hd)
        # seam MEMRA_DSV4_DECODE_QNORM: "attn" leaves q as wq_b wrote it (raw) and the attention's
        # _qn kernel applies head_rms + RoPE at its q load (the same code, the same bits)
        qn_attn = getattr(self, "_qnorm", "kernel") == "attn"
        mqn = multi_qnorm_on()   # q_norm in the multi GEMV's last CTA (same bytes)
        # MEMRA_DSV4_WQB_QNORM: q_norm inside wq_b (every CTA norms the raw qr; CTA 0 stores it
        # to attn.qrn for the CSA indexer), not with mqn (qr already normed) nor fork "lead" /
        # "single" (the indexer's q GEMV would run before or beside wq_b, which norms qr)
        wqn = wqb_qnorm_on() and not mqn and self._forking not in ("lead", "single")
        self._qr_normed = "attn.qrn" if wqn else "attn.qr"
        with phase(f"{ap}/projections"):  # wq_a, wkv, compressor rows, indexer weights: one launch
            DK.gemv_bf16_multi(table, v["xn"], pos,
                               qnorm=(v["attn.qr"], L.w("attn.q_norm.weight"), eps) if mqn else None)
        if not mqn and not wqn:
            with phase(f"{ap}/q"):
                RN.rmsnorm(qr, L.w("attn.q_norm.weight"), eps, out=qr)

        def wq_b():
            with phase(f"{ap}/q"):
                w, sc = L.lin("attn.wq_b")
                if pair:   # + the CSA indexer's q GEMV (same x): one launch where it can fuse
                    wi, sci = L.lin("attn.indexer.wq_b")
                    DK.gemv_bf16_pair(w, wi, qr.reshape(-1), q.reshape(-1), v["idx.q"].reshape(-1),
                                      scale=sc, scale2=sci)
                elif wqn:   # q_norm + wq_b (one launch where gemv_bf16_qnorm can fuse; same bits)
                    DK.gemv_bf16_qnorm(w, qr.reshape(-1), q.reshape(-1), L.w("attn.q_norm.weight"),
                                       eps, v["attn.qrn"], scale=sc)
                else:
                    DK.gemv_bf16(w, qr, q, scale=sc)

        def head_norm():
            if getattr(S, "hc_pending", False) and "wo" in l2_side_targets() and not hc_join_early():
                # (with HC_JOIN=early the branch joins at the attention: it would wait for this)
                # MEMRA_DSV4_L2_SIDE wo: wo_a's first bytes during the attention window, on the
                # hc Sinkhorn branch (its join before the next boundary covers them)
                S.pf_ev.record(S.stream)
                S.hc_side.wait_event(S.pf_ev)
                with S.hc_side:
                    self._l2_side(S, L, "wo")
            if not qn_attn:
                with phase(f"{ap}/q"):
                    RN.head_rms(q, eps, out=q, rope=(pos, L.cos, L.sin))

        def q_path():
            wq_b()
            head_norm()

        csa = bool(L.ratio) and L.kind == "csa"
        # MEMRA_DSV4_IDXQ_PAIR: on CSA layers wq_b and the indexer's q GEMV in one launch (both
        # read the normed qr); not with WQB_QNORM nor fork "lead" / "single" (_indexer_q there)
        pair = csa and idxq_pair_on() and not wqn and self._forking not in ("lead", "single")
        if csa:
            K = W + v["idx.sel"].size   # _indexer's selection buffer (step.step_ws_plan's sel_w)
        else:
            K = W + (cache.comp.shape[0] if L.ratio else 0)
        cand = v["attn.cand"][:K]

        def build_cands(sel):   # the split form's candidate list: pos and sel only
            if attn != "fused":
                with phase(f"{ap}/sparse_attention"):
                    DK.build_cand(pos, cand, W, L.ratio, sel)

        def kv_path():   # reads xn's projections (multi), not q: the ring row and the compressor
            kvraw = v["dev.kvraw"].reshape(1, hd)
            with phase(f"{ap}/kv"):  # norm + RoPE + FP8 sim straight into ring row pos % W
                CM.norm_rope_sim(kvraw, L.f32["attn.kv_norm.weight"], eps, L.cos, L.sin, pos,
                                 "fp8", out=cache.ring, emit_gate=(pos, W), row="ring")
            if L.ratio:
                with phase(f"{ap}/compressor"):
                    self._compress(S, L, cache.comp_state, cache.comp, indexer=False)

        def sel_path(cands: bool = True, q_done: bool = False, before_q=None):  # the indexer (CSA;
            sel = None                     # reads the normed qr and xn's projections) and the
            if csa:                        # candidate list (split form; it needs only pos and sel)
                with phase(f"{ap}/indexer"):
                    sel = self._indexer(S, L, cache, q_done=q_done, before_q=before_q)
                assert K == W + sel.size, f"candidate width {K} != {W} + {sel.size}"
            if cands:
                build_cands(sel)
            return sel

        if self._forking == "single":   # the former layout (seam value kept for A/B)
            S.fork.fork()
            with S.side:
                kv_path()
                sel = sel_path(cands=False)
            q_path()
            S.fork.join()
            build_cands(sel)
        elif self._forking in ("on", "all", "lead"):
            # Captured as graph branches beside wq_b (a bandwidth-bound GEMV; q path on
            # S.stream): the latency-bound kv ring + compressor launches on S.side and the
            # indexer + build_cand on S.side2 (CSA layers; else the candidates follow the kv
            # launches on S.side).  Until the seventh session the kv, indexer and compressor launches were
            # one side branch, longer than the q path on CSA layers (~26 vs ~20 us of kernels);
            # build_cand ran after the join.  The branches share no buffer (kv: dev.kvraw ->
            # ring, comp_state -> comp; indexer: qr, idx.w, idx_state -> idx_keys, idx.q,
            # dev.idx_scores, idx.sel -> attn.cand; q: qr -> attn.q), so the values are those of
            # the one-stream order.  The join makes the attention wait for all of them.
            # "lead" (CSA): the device timeline (92d6f72) showed side-branch CTAs dispatched only
            # once wq_b's 4096 CTAs all were, so the indexer chain (~21 us of mostly tiny
            # launches) ran after wq_b; its one bandwidth-bound launch (the q GEMV) now goes
            # first on the main stream and the rest forks after it, beside wq_b.
            lead = csa and self._forking == "lead"
            if lead:   # the indexer's q GEMV first, on the main stream: its chain forks after it
                with phase(f"{ap}/indexer"):
                    self._indexer_q(S, L)
            if csa and (wqn or pair):
                # The indexer's q GEMV reads attn.qrn, which wq_b's CTA 0 writes (WQB_QNORM), or
                # runs inside wq_b's launch (IDXQ_PAIR): the branches fork before wq_b as below
                # (so the kv launches and the indexer's compressor emission are resident early),
                # and side2 waits for wq_b (an event recorded after it) just before its q GEMV /
                # the q's RoPE.  (Forking both after wq_b put the first side kernels ~3 us after
                # wq_b's exit on the CSA layers: slower.)
                def q_ready():
                    with S.stream:
                        wq_b()
                    S.qn_ev.record(S.stream)
                    S.side2.wait_event(S.qn_ev)
                S.fork3.fork()
                with S.side:
                    kv_path()
                with S.side2:
                    sel = sel_path(before_q=q_ready, q_done=pair)
                head_norm()
                S.fork3.join()
            elif csa:
                S.fork3.fork()
                with S.side:
                    kv_path()
                with S.side2:
                    sel = sel_path(q_done=lead)
                q_path()
                S.fork3.join()
            else:
                S.fork.fork()
                with S.side:
                    kv_path()
                    sel = sel_path()
                q_path()
                S.fork.join()
        else:
            q_path()
            kv_path()
            sel = sel_path(q_done=pair)
        o = v["attn.o"].reshape(1, H, hd)
        sink, rope = L.w("attn.attn_sink"), (pos, L.cos, L.sin)
        qn = {"q_norm": (eps, pos, L.cos, L.sin)} if qn_attn else {}
        if hc_join_early():   # the attn boundary's Sinkhorn branch joins here (hc_join_early)
            self._hc_join(S)
        with phase(f"{ap}/sparse_attention"):
            if attn == "fused":  # build_cand + split + combine in one launch
                AT.sparse_attention_decode(q, cache.kv, pos, W, L.ratio, sel, K, sink, hd ** -0.5,
                                           out=o, workspace=v["dev.attn_ws"], inverse_rope=rope, **qn)
            else:                # "split": the split kernel + combine over cand (sel_path)
                # MEMRA_DSV4_DECODE_ATTN_HG: the split kernel's heads per CTA (Flash: 8 by
                # default); a group below H's own puts every tile in its own CTA (n_split = the
                # tile count)
                hg = decode_attn_head_group(H)
                split = AT.n_tiles(K) if hg != AT.head_group(H) else None
                AT.sparse_attention(q, cache.kv, cand.reshape(1, K), sink, hd ** -0.5, out=o,
                                    n_split=split, workspace=v["dev.attn_ws"], inverse_rope=rope,
                                    head_group=hg, **qn)
        with phase(f"{ap}/output"):
            # site "out": no side branch runs beside these two (ops_decode.gemv_selected)
            w, sc = L.lin("attn.wo_a")
            DK.gemv_bf16(w, o, v["attn.u"], groups=cfg.o_groups, scale=sc, site="out")
            w, sc = L.lin("attn.wo_b")
            DK.gemv_bf16(w, v["attn.u"], v["attn.out"], scale=sc, site="out")

    def _moe(self, S, L) -> None:
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu.ops import experts as EX
        from memra_dsv4.gpu.ops import router as RT
        from memra_dsv4.profiling import phase
        cfg, v, mp = self.cfg, S.v, f"{S.ph}/block/ffn/moe"
        D, I, E, k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                      cfg.num_experts_per_tok)
        xn = v["xn"].reshape(1, D)
        logits = v["moe.logits"].reshape(1, E)
        ids, wts = v["moe.ids"].reshape(1, k), v["moe.w"].reshape(1, k)
        sh, h = v["moe.sh_h"], v["moe.h"]
        # MEMRA_DSV4_DECODE_SHARED_W2 = fused: the down + combine computes the shared w2 rows
        # (bf16 w2 and the full shape only; else the separate gemv_bf16 below)
        w2_fused = None
        if getattr(self, "_w2", "gemv") == "fused":
            w2w, w2s = L.lin("ffn.shared_experts.w2")
            if w2s is None and EX.down_w2_ok(D, I, k, w2w):
                w2_fused = (w2w, sh.reshape(1, -1))

        # MEMRA_DSV4_SHARED_GATEUP = on: the routed gate/up launch computes the shared expert's
        # SwiGLU too, before its PDL wait (experts.cu _k4_f_sh; bf16 shared w1 / w3 and the full
        # shape only, else the separate launch below).  x = xn is written by the ffn boundary,
        # two launches before the gate/up (boundary -> router -> gate/up), as the kernel requires.
        sh_in_gateup = None
        if shared_gateup_on():
            (sw1, ss1), (sw3, ss3) = L.lin("ffn.shared_experts.w1"), L.lin("ffn.shared_experts.w3")
            if ss1 is None and ss3 is None and EX.gateup_shared_ok(I, D, xn, sw1, sw3):
                sh_in_gateup = (sw1, sw3, sh, cfg.swiglu_limit)

        def shared_swiglu():
            with phase(f"{mp}/shared"):
                (w1, s1), (w3, s3) = L.lin("ffn.shared_experts.w1"), L.lin("ffn.shared_experts.w3")
                DK.gemv_bf16_swiglu(w1, w3, xn, sh, cfg.swiglu_limit, scale1=s1, scale3=s3)

        def shared_w2():
            with phase(f"{mp}/shared"):
                w, sc = L.lin("ffn.shared_experts.w2")
                DK.gemv_bf16(w, sh, v["moe.shared"], scale=sc)

        # MEMRA_DSV4_ROUTER_HANDOFF: the fused router's selection behind a ticket (router_fused_*)
        # or inside one thread-block cluster (router_cluster_*, E <= 256); the same bits
        handoff = router_handoff()
        if handoff == "cluster" and not RT.cluster_ok(E):
            handoff = "ticket"

        def router():
            with phase(f"{mp}/router"):  # logits + select in one launch (router_fused_* / _cluster_*)
                if self.hostmath:   # logits on the device, the selection on the host
                    from memra_dsv4.gpu import hostmath as HM
                    HM.router_island(S.io, cfg, xn, L.w("ffn.gate.weight"), logits=logits, ids=ids,
                                     weights=wts, bias_h=L.host.get("bias"),
                                     tid2eid_h=L.host.get("tid2eid"), token=self._tok)
                else:
                    route = (dict(tid2eid=L.tid2eid, token_ids=v["tok"]) if L.hash
                             else dict(bias=L.w("ffn.gate.bias")))
                    RT.fused(xn, L.w("ffn.gate.weight"), k, cfg.routed_scaling_factor,
                             logits=logits, scores=v["moe.scores"].reshape(1, E), idx=ids,
                             weights=wts, handoff=handoff, **route)

        # MEMRA_DSV4_SHARED_GATEUP_SPARE = router: the gate/up CTAs that land on the router
        # cluster's SMs (dispatched last, once the router leaves them) carry no shared rows
        # ("grid": the gate/up's grid sized for the SMs the router leaves free instead)
        spare_kw = {}
        if sh_in_gateup is not None and handoff == "cluster":
            form = shared_gateup_spare()
            if form == "router":
                spare_kw = dict(shared_spare_ctas=RT.cluster_ctas(E) * EX.CTAS_PER_SM)
            elif form == "grid":
                spare_kw = dict(reserve_sms=RT.cluster_ctas(E))

        def gate_up():
            with phase(f"{mp}/experts"), _gateup_pdl_scope():  # gate/up + SwiGLU; down is fused into combine
                EX.gemv_fp4_gateup(L.fmt, xn, ids.reshape(k), L.wp["w1"], L.sp["w1"], L.wp["w3"],
                                   L.sp["w3"], I, D, weight=wts.reshape(k),
                                   limit=cfg.swiglu_limit, out=h, x_div=k, ws2_1=L.ws2["w1"],
                                   ws2_3=L.ws2["w3"], shared_swiglu=sh_in_gateup, **spare_kw)

        # The four are independent until the combine (any order gives the same bits).
        ride = getattr(S, "hc_ride", None)
        if sh_in_gateup is not None:
            # the shared SwiGLU rides in the gate/up launch; no MoE branch is left to fork, but
            # the ffn boundary's Sinkhorn (MEMRA_DSV4_HC_JOIN=ride) still takes the side stream
            if ride is not None:
                S.moe_fork.fork()
                with S.moe_side:
                    ride()
                    S.hc_ride = None
            router()
            gate_up()
            if w2_fused is None:   # reads sh, which the gate/up launch writes now
                shared_w2()
            if ride is not None:
                S.moe_fork.join()
        elif self._forking in ("all", "lead"):
            # Two graph branches: the shared expert (two bandwidth-bound dense GEMVs) beside the
            # router and the routed gate/up (latency- and issue-bound); they share no buffer, and
            # the join makes the down + combine wait for both.  The default since 50ac732: with
            # the 128-register swiglu p1t2 it paid (fb5d3ac, bf16 7.87 -> 7.55 ms per token);
            # with the 168-register p2 it had bought nothing (fc6c8d3), the routed gate/up
            # holding the register file.  (The device timeline, 92d6f72: the shared expert's CTAs
            # are dispatched only once the routed gate/up's single wave has been, so it runs
            # mostly after it; on a high-priority stream it splits that wave instead, slower:
            # decode_priority "attn" keeps this branch at the default priority.)
            S.moe_fork.fork()
            with S.moe_side:
                if ride is not None:   # the ffn boundary's Sinkhorn (MEMRA_DSV4_HC_JOIN=ride), first
                    ride()
                    S.hc_ride = None
                shared_swiglu()
                if w2_fused is None:
                    shared_w2()
            router()
            gate_up()
            S.moe_fork.join()
        else:
            # One stream: each dense GEMV follows a latency-bound kernel (hc_boundary, the
            # router); with MEMRA_DSV4_L2_PREFETCH it asks the L2 for its weights meanwhile.
            shared_swiglu()
            router()
            if w2_fused is None:
                shared_w2()
            gate_up()
        if hc_join_early():   # the ffn boundary's Sinkhorn branch joins here (hc_join_early)
            self._hc_join(S)
        with phase(f"{mp}/combine"):  # routed down GEMVs + weighted sum + shared
            if w2_fused is None:
                EX.gemv_fp4_down_combine(L.fmt, h, ids, L.wp["w2"], L.sp["w2"], D, I,
                                         shared=v["moe.shared"].reshape(1, D),
                                         out=v["ffn.out"].reshape(1, D), ws2=L.ws2["w2"])
            else:   # + the shared expert's w2 rows (the bytes of gemv_bf16(w2, sh) + shared=)
                EX.gemv_fp4_down_combine(L.fmt, h, ids, L.wp["w2"], L.sp["w2"], D, I,
                                         shared_w2=w2_fused,
                                         out=v["ffn.out"].reshape(1, D), ws2=L.ws2["w2"])


GATEUP_PDL_ENV = "MEMRA_DSV4_GATEUP_PDL"   # "off": the routed gate/up launches without PDL (A/B)
MULTI_QNORM_ENV = "MEMRA_DSV4_MULTI_QNORM"  # "on": the q_norm in the multi GEMV's last CTA (A/B)
# off: measured slower on (dc5fb89, 2x H200, 1K, 200 steps per arm in one process: 7.33 -> 7.42 ms;
# bench/results/2026-11-30-nvidia-h200-dc5fb89-ab_1k.log), though bit-identical (its GPU tests passed)
MULTI_QNORM_DEFAULT = "off"


def _choice_env(name: str, choices: tuple, default: str) -> str:
    """The non-seam A/B switch ``name``, one of ``choices`` (unset or empty: ``default``), read
    now; ValueError naming the variable and its value otherwise."""
    import os
    v = os.environ.get(name, "") or default
    if v not in choices:
        raise ValueError(f"{name}={v!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    return v


def _on_off_env(name: str, default: str) -> str:
    """The on | off switch ``name`` (_choice_env)."""
    return _choice_env(name, ("on", "off"), default)


def gateup_pdl_off() -> bool:
    """MEMRA_DSV4_GATEUP_PDL = off: _moe launches the routed gate/up as a plain stream-ordered
    launch even inside the step's PDL context (read when the launch is made, i.e. at graph
    capture; "on" or unset: as every other launch).  Why: with PDL the gate/up's single wave
    (2 CTAs per SM, all the register file) becomes resident as soon as the router is, and parks
    there for the router's ~8 us, so the shared expert's branch (forked before the router) and the
    hc Sinkhorn branch get no SM until gate/up CTAs leave (device timeline, eleventh session: the
    Sinkhorn of the FFN boundary starts 22 us after its input is ready, the shared SwiGLU ends
    3.7 us after the routed gate/up).  Without PDL on this one edge they can run beside the
    latency-bound router.  Schedule only: the same bytes.  Not a seam (bench arm gupdl=on|off)."""
    return _on_off_env(GATEUP_PDL_ENV, "on") == "off"


SHARED_GATEUP_ENV = "MEMRA_DSV4_SHARED_GATEUP"   # on | off: the shared SwiGLU inside the routed gate/up
# on since the twentieth session: bit-identical (its GPU tests) and, on 20 Flash layers, off -> on
# in one process each: 1K 3.408 -> 3.391, 3.405 -> 3.392, 3.559 -> 3.535, 3.536 -> 3.514 ms; 32K
# 3.555 -> 3.537, 3.660 -> 3.631 ms (bench/results/2026-12-02-nvidia-h200-{2fdbb19,c60e7ad,64bd6ca,
# 05ffd79}*.json; docs/decode_perf.md)
SHARED_GATEUP_DEFAULT = "on"


def shared_gateup_on() -> bool:
    """MEMRA_DSV4_SHARED_GATEUP = on | off (SHARED_GATEUP_DEFAULT, on), read when _moe launches (at
    graph capture): the shared expert's SwiGLU computed by the routed gate/up's launch
    (ops.experts.gemv_fp4_gateup(shared_swiglu=): experts.cu gemv_*_gateup_k4_f_sh), before its
    PDL wait, instead of its own gemv_bf16_swiglu launch on the MoE side branch.  Why: with PDL
    the gate/up's single wave becomes resident as soon as the router is and parks at its wait for
    the router's ~8 us, and the side branch's CTAs are dispatched only once that wave has been
    (device timeline, tenth session), so the shared expert's 33.5 MB stream mostly after the
    routed gate/up; inside it they stream during the router.  Applies to bf16 shared w1 / w3 and
    the Flash shapes (ops.experts.gateup_shared_ok); otherwise the separate launch.  The same
    bytes either way (tests/gpu/test_step_shared_gateup_gpu.py); not a seam (bench arm shgu=on|off)."""
    return _on_off_env(SHARED_GATEUP_ENV, SHARED_GATEUP_DEFAULT) == "on"


SHARED_GATEUP_SPARE_ENV = "MEMRA_DSV4_SHARED_GATEUP_SPARE"   # router | grid | none
# router since the twenty-first session: bit-identical (its GPU tests) and, on 20 Flash layers at
# 1K, none -> router in one process each: 3.437 -> 3.422, 3.524 -> 3.507 (router first), trace build
# 3.573 -> 3.547 ms (bench/results/2026-12-02-nvidia-h200-e057824*.json; docs/decode_perf.md)
SHARED_GATEUP_SPARE_DEFAULT = "router"


def shared_gateup_spare() -> str:
    """MEMRA_DSV4_SHARED_GATEUP_SPARE = router | grid | none (SHARED_GATEUP_SPARE_DEFAULT), read when _moe
    launches (at graph capture), with MEMRA_DSV4_SHARED_GATEUP = on and the cluster router: "router"
    leaves the shared expert's rows off the gate/up's last ceil(E / 16) x 2 CTAs
    (ops.experts.gemv_fp4_gateup(shared_spare_ctas=)).  Why: the router's cluster holds 16 whole
    SMs, so the 32 gate/up CTAs that would run there are dispatched only when it leaves, and
    with shared rows to stream before their wait they passed it 5.8 us after the first CTA
    (twenty-first session's timeline: go_last - go, against 0.6 us with the ticket router),
    setting the kernel's end.  "grid" (prepared in the twenty-first session, not GPU-run): the
    gate/up's grid sized for the SMs the router leaves free (ops.experts.gemv_fp4_gateup(
    reserve_sms=)), so no CTA waits for them; each CTA takes more row groups.  The same bytes in
    every form; not a seam (bench arm shspare=router|grid|none)."""
    return _choice_env(SHARED_GATEUP_SPARE_ENV, ("router", "grid", "none"), SHARED_GATEUP_SPARE_DEFAULT)


ROUTER_HANDOFF_ENV = "MEMRA_DSV4_ROUTER_HANDOFF"   # ticket | cluster: the fused router's selection handoff
# cluster since the twenty-first session: bit-identical (its GPU tests) and, on 20 Flash layers,
# ticket -> cluster in one process each: 1K 3.414 -> 3.377, 3.395 -> 3.352 ms (cluster first),
# trace build 3.597 -> 3.553; the router 11.6 -> 6.0 us in a CSA layer's timeline
# (bench/results/2026-12-02-nvidia-h200-9d86660*.json; docs/decode_perf.md)
ROUTER_HANDOFF_DEFAULT = "cluster"


def router_handoff() -> str:
    """MEMRA_DSV4_ROUTER_HANDOFF = ticket | cluster (ROUTER_HANDOFF_DEFAULT), read when _moe
    launches (at graph capture): how the device router's one launch hands the E scores to the CTA
    that selects.  "ticket": router_fused_* (every CTA fences its scores and takes a ticket; the
    last one fences again and re-reads them through L2); "cluster": router_cluster_* (one
    thread-block cluster of ceil(E / 16) CTAs x 16 warps; the scores go to the rank-0 CTA's
    shared memory by st.async on its mbarrier, no fence, no global round trip; E <= 256, else
    "ticket").  Why:
    beside the shared expert's stream (MEMRA_DSV4_SHARED_GATEUP) the router took 11.8 us instead
    of 7.1 (twentieth session's timeline), its chain after the wait holding ~4 L2 round trips.
    The same bytes either way (tests/gpu/test_step_router_handoff_gpu.py); not a seam (bench arm
    rhand=ticket|cluster)."""
    return _choice_env(ROUTER_HANDOFF_ENV, ("ticket", "cluster"), ROUTER_HANDOFF_DEFAULT)


HC_PRE_HANDOFF_ENV = "MEMRA_DSV4_HC_PRE_HANDOFF"   # ticket | cluster | coop | coopall: hc_boundary_pre's form
HC_PRE_HANDOFF_DEFAULT = "ticket"


def hc_pre_handoff() -> str:
    """MEMRA_DSV4_HC_PRE_HANDOFF = ticket | cluster | coop | coopall (HC_PRE_HANDOFF_DEFAULT), read
    when _hc_pre launches (at graph capture), with the hc split: how the boundary's critical launch combines
    its 64 segment partials.  "ticket": hc.cu hc_boundary_pre (64 CTAs; the last to draw a
    ticket re-reads the partials and the 4 streams through L2 and runs the segment sums, the
    weighted sum and the norm of all D channels on one SM); "cluster": hc_boundary_pre_cluster
    (one thread-block cluster of D / 256 CTAs x 1024 threads; partials and x cross CTAs by
    st.async into shared memory, every CTA sums them itself in the same order and writes its own
    256 channels; D % 256 == 0 and D <= 4096, else "ticket"); "coop": hc_boundary_pre_coop (the
    ticket form's 64 CTAs and phase A, each publishing its partials as tagged global words; 8
    tail CTAs poll the partials they need, add the chains themselves, form x of their D / 8
    channels and, after a second polled round for the norm's 128 sum-of-squares chains, their
    xn; "coopall": every CTA a tail CTA; D in 1024 .. 8192, powers of two, else "ticket").  Why:
    the boundary takes ~7.3 us go -> exit twice per layer (twenty-first session's timeline), most
    of it the ticket and the one-SM tail (~16 f32 <-> f64 conversions per clock per SM).  The same bytes either way
    (tests/gpu/test_kernels_hc.py, tests/gpu/test_step_hc_pre_handoff_gpu.py); not a seam (bench
    arm hchand=ticket|cluster|coop|coopall)."""
    return _choice_env(HC_PRE_HANDOFF_ENV, ("ticket", "cluster", "coop", "coopall"),
                       HC_PRE_HANDOFF_DEFAULT)


DECODE_ATTN_HG_ENV = "MEMRA_DSV4_DECODE_ATTN_HG"   # auto | own | 16 | 8 | 4: the split attention's heads per CTA
DECODE_ATTN_HG_DEFAULT = "auto"
DECODE_ATTN_HG_AUTO = 8   # "auto": this group where H's own group is larger (Flash: 64 heads, own 16)


def decode_attn_head_group(H: int) -> int:
    """MEMRA_DSV4_DECODE_ATTN_HG = auto | own | 16 | 8 | 4 (DECODE_ATTN_HG_DEFAULT), read when the
    attention launches (at graph capture), with MEMRA_DSV4_DECODE_ATTN = split: the heads per CTA
    of the split attention kernel (ops.attention.sparse_attention(head_group=)).  "own" is
    ops.attention.head_group(H), the largest group dividing H (16 for Flash's 64 heads; the
    default until the thirty-first session); "auto" is DECODE_ATTN_HG_AUTO (8) where H's own
    group is larger, else H's own group (tiny: 4, small: 8).  A group below H's own also gives
    every tile its own CTA (the caller's n_split) with one tile buffer (ops.attention.tile_buffers).
    Why: one token's attention at H's own group is a grid of H / 16 x tiles CTAs of 8 warps, each
    warp computing 2 heads' dots and P.V over a tile of 32 rows (~3.6 K instructions, 2 warps per
    scheduler on the ~20-80 SMs the grid takes), while the rest of the GPU idles (8.6-8.9 us go ->
    exit in a Flash layer); with 8 heads per CTA each warp has one head and the grid covers twice
    as many SMs; in the 8- and 4-head kernels the CTAs of empty tiles (the -1 tail of the list)
    leave at once (attention.cu).  Measured (docs/decode_perf.md, twenty-sixth and thirty-first
    sessions): the traced layer (20 Flash layers, 1K, one H100) CSA 203.1 -> 199.3 us and HCA
    173.7 -> 172.4 us with 8 (4: 200.6 / 173.6): the attention 8.9 -> 7.2 us; its combine slower
    (5.7 -> 6.3 us; 7.9 with 4) while the CSA layer's wo_a / wo_b run ~1.5 us faster each.  The
    production step, full depth, 1K, one H100, in-process both orders: own 8.11 / 8.13, 8: 8.08 /
    8.09, 4: 8.09 / 8.10 ms (with the IDXQ_PAIR default on: 8.07 / 8.07 and 8.08 / 8.08); 32K:
    own 8.51 / 8.51, 8 + pair 8.48 ms.  On one H200 (twenty-sixth session) 4 measured 0.0 to -0.6 %
    at full depth and 8 neutral on 20 layers.  The head group never changes a head's arithmetic:
    the same bytes (tests/gpu/test_kernels_attention.py, tests/gpu/test_step_attn_hg_gpu.py); not a
    seam (bench arm attnhg=auto|own|16|8|4).  An explicit group that does not divide H is refused
    by the wrapper, naming it."""
    from memra_dsv4.gpu.ops import attention as AT
    v = _choice_env(DECODE_ATTN_HG_ENV, ("auto", "own", "16", "8", "4"), DECODE_ATTN_HG_DEFAULT)
    own = AT.head_group(H)
    if v == "own":
        return own
    if v == "auto":
        return DECODE_ATTN_HG_AUTO if own > DECODE_ATTN_HG_AUTO else own
    return AT.head_group(H, int(v))


def multi_qnorm_on() -> bool:
    """MEMRA_DSV4_MULTI_QNORM = on | off (MULTI_QNORM_DEFAULT): the attention's q_norm runs in the
    multi GEMV's last CTA (ops_decode.gemv_bf16_multi(qnorm=): gemv_bf16_multi_*_qn) instead of
    as its own rmsnorm_bf16_wbf16 launch between the multi GEMV and wq_b.  Read when the launch
    is made (at graph capture).  The same bytes either way (rmsnorm.cu's row code in both;
    tests/gpu/test_step_multi_qnorm_gpu.py); not a seam (bench arm mqn=on|off)."""
    return _on_off_env(MULTI_QNORM_ENV, MULTI_QNORM_DEFAULT) == "on"


L2_SIDE_ENV = "MEMRA_DSV4_L2_SIDE"   # off | wq | wo | both: paced L2 prefetch on the hc side stream


def l2_side_targets() -> set:
    """MEMRA_DSV4_L2_SIDE = off | wq | wo | both (default off), read at capture: weights the
    device step asks the L2 for, on the hc Sinkhorn's side stream (graphs with the hc split; the
    branch's join before the next boundary covers the prefetch), while the main stream runs
    latency-bound launches that leave HBM idle: "wq" the first MEMRA_DSV4_L2_SIDE_MB of wq_b
    from the attn boundary on (beside the boundary, the multi GEMV and the q_norm), "wo" those of
    wo_a from wq_b's end on (beside the head norm, the kv / indexer branches, the attention and
    its combine).  Paced (ops_decode.l2_prefetch_paced: MEMRA_DSV4_L2_SIDE_CTAS CTAs, 64 KB per
    request, MEMRA_DSV4_L2_SIDE_NS between a CTA's requests) because the fifth session's burst
    prefetch slowed the latency-bound kernels.  Why at all: the fourteenth session's timelines
    have ~50 us per layer in which no weight streams (docs/decode_perf.md).  A hint: the same
    bytes.  Not a seam (bench arms l2side=, l2mb=, l2ns=)."""
    forms = {"off": set(), "wq": {"wq"}, "wo": {"wo"}, "both": {"wq", "wo"}}
    return forms[_choice_env(L2_SIDE_ENV, tuple(forms), "off")]


def l2_side_params() -> tuple:
    """(MB per prefetch, CTAs, ns between a CTA's 64 KB requests) of MEMRA_DSV4_L2_SIDE, from
    MEMRA_DSV4_L2_SIDE_MB (default 24), _CTAS (8), _NS (200); ValueError naming a bad one."""
    import os
    out = []
    for name, default, lo, hi in (("MB", 24.0, 0.0, 4096.0), ("CTAS", 8, 1, 1024), ("NS", 200, 0, 1_000_000)):
        key = f"{L2_SIDE_ENV}_{name}"
        raw = os.environ.get(key, "")
        try:
            val = type(default)(raw) if raw else default
        except ValueError:
            val = None
        if val is None or not lo <= val <= hi:
            raise ValueError(f"{key}={raw!r}: expected a number in [{lo}, {hi}]")
        out.append(val)
    return tuple(out)


HC_JOIN_ENV = "MEMRA_DSV4_HC_JOIN"   # boundary | early: where the hc Sinkhorn branch joins (A/B)


def hc_join_form() -> str:
    """MEMRA_DSV4_HC_JOIN (boundary | early | ride), validated; hc_join_early says what the first
    two do.  "ride": the Sinkhorn is not captured on the hc side stream at all; the attn
    boundary's runs first on the attention fork's side stream (joined into the sparse attention
    with the kv branch), the ffn boundary's first on the shared expert's branch (joined into the
    down + combine), so no launch ever waits on the hc side stream (fork "on" / "all"; the ffn
    one needs "all", else it stays on the hc side stream).  Why: the timelines of the fourteenth
    session put ~1.3 us extra on whichever main-stream launch carries the hc branch's join (the
    next hc_boundary_pre, or with "early" the down + combine), wherever it lands, even though the
    Sinkhorn finished long before; the attention and the down + combine already wait on side
    streams.  "ride_attn": ride for the attn boundary only (the ffn one as "boundary": on the
    shared expert's branch the Sinkhorn delayed the SwiGLU GEMV, 66adf82's timeline)."""
    return _choice_env(HC_JOIN_ENV, ("boundary", "early", "ride", "ride_attn"), "boundary")


def hc_join_early() -> bool:
    """MEMRA_DSV4_HC_JOIN = boundary | early | ride (default boundary), read at capture: with the hc
    split's Sinkhorn on its side stream (graphs), "boundary" joins it right before the next
    boundary's hc_boundary_pre (its reader); "early" joins it into a launch that already waits
    on other branches and precedes that reader on the main stream: the sparse attention (the
    attn boundary's Sinkhorn) and the MoE's down + combine (the ffn boundary's).  Why: on the
    device timeline every hc_boundary_pre behind a join starts ~1.8 us after its main-stream
    predecessor exits, against ~0.5 us for a launch with one predecessor; early, it has one.
    The order is kept transitively: every launch between the join and the reader opens with
    griddepcontrol.wait, so none completes before the Sinkhorn has.  The same bytes; not a seam
    (bench arm hcjoin=boundary|early)."""
    return hc_join_form() == "early"


IDXQ_PAIR_ENV = "MEMRA_DSV4_IDXQ_PAIR"   # "on": the CSA indexer's q GEMV inside wq_b's launch (A/B)
IDXQ_PAIR_DEFAULT = "on"   # since the thirty-first session (idxq_pair_on)


def idxq_pair_on() -> bool:
    """MEMRA_DSV4_IDXQ_PAIR = on | off (IDXQ_PAIR_DEFAULT), read when the launches are made (at
    graph capture): on CSA layers the attention's wq_b and the indexer's q GEMV, which both read
    the normed qr, run as one launch (ops_decode.gemv_bf16_pair: gemv_bf16_pl2_r{R} where wq_b
    runs as pl_r{R}; else the two launches).  Why: the device timeline has the indexer's q GEMV
    (16 MB, ~9 us at a third of the copy bandwidth) on the CSA layers' path from wq_b to the
    attention, since its CTAs get no SM until wq_b's are dispatched; inside wq_b's launch its
    bytes stream at wq_b's rate.  The indexer's branch then waits for wq_b before the q RoPE.
    Ignored with MEMRA_DSV4_WQB_QNORM on and with decode_fork "lead" / "single"; where wq_b does
    not run as pl_r{R} with bf16 weights (FP8 dense) ops_decode.gemv_bf16_pair makes the two
    launches.  The default since the thirty-first session: on one H100 at full depth, 1K, in
    process, off 8.11 -> on 8.09 ms (twice), and with 8 heads per attention CTA (the
    DECODE_ATTN_HG default) 8.08 / 8.09 -> 8.07 / 8.07 ms; on 2x H200 (fourteenth session, 20
    layers) 3.51 -> 3.50 and 3.52 -> 3.51 ms, 32K 3.84 -> 3.83 ms.  The same bytes; not a seam
    (bench arm idxpair=on|off)."""
    return _on_off_env(IDXQ_PAIR_ENV, IDXQ_PAIR_DEFAULT) == "on"


WQB_QNORM_ENV = "MEMRA_DSV4_WQB_QNORM"   # "on": the attention's q_norm inside wq_b (A/B)
WQB_QNORM_DEFAULT = "off"


def wqb_qnorm_on() -> bool:
    """MEMRA_DSV4_WQB_QNORM = on | off (WQB_QNORM_DEFAULT), read when the launches are made (at
    graph capture): the attention's q_norm runs inside wq_b (ops_decode.gemv_bf16_qnorm: where
    wq_b runs as pl_r{R} with K = 1024, gemv_bf16_pl_r{R}_qn, each CTA norming the raw qr; else
    rmsnorm into attn.qrn, then wq_b), so no norm launch sits between the multi GEMV and wq_b.
    The normed qr goes to attn.qrn (qr stays raw), which the CSA indexer's q GEMV reads; the
    indexer's branch then forks after wq_b.  Ignored with MEMRA_DSV4_MULTI_QNORM on (qr normed in
    the multi GEMV) and with decode_fork "lead" / "single".  The same bytes; not a seam (bench arm
    wqbqn=on|off)."""
    return _on_off_env(WQB_QNORM_ENV, WQB_QNORM_DEFAULT) == "on"


def _gateup_pdl_scope():
    """pdl_launches(False) around the gate/up launch when gateup_pdl_off(), else nothing."""
    import contextlib

    from memra_dsv4.gpu.pdl import pdl_launches
    return pdl_launches(False) if gateup_pdl_off() else contextlib.nullcontext()


def step_ratios(cfg, layers, stage_index: int = 0) -> list:
    """The compress ratios step_scalars derives its per-step counts for (ops_decode.step_scalars:
    at most 4): the stage's nonzero ratios ([1] when none), plus 4 when missing and there is room
    (the indexer's key count)."""
    ratios = sorted({cfg.compress_ratio(l) for l in layers} - {0}) or [1]
    if 4 not in ratios and len(ratios) < 4:
        ratios = ratios + [4]
    assert len(ratios) <= 4, f"stage {stage_index}: ratios {ratios} (at most 4)"
    return ratios


def xn_projection_entries(L, cache, qr, kvraw, idx_w, staging=None):
    """The GemvTable entries (ops_decode.GemvTable) of one layer's projections of the attention
    input xn, for one token: wq_a -> qr, wkv -> kvraw, the compressor and indexer-compressor wkv /
    wgate straight into the cache's pending rows (row pos % r [+ r], ape on the score half), the
    indexer's weights_proj -> idx_w (CSA layers).  The device step's table (DeviceStep) and each
    row's table of the device verify (gpu.verify_step) are built by it.  ``staging`` = {sub: (kv,
    score)} replaces the pending rows of compressor ``sub`` ("attn.compressor",
    "attn.indexer.compressor") by those staging arrays, ring offset -1 (GemvTable's staging
    mark): one row [O_s] for a one-row table, [rows, O_s] for the row form, GemvTable(rows=),
    whose qr, kvraw and idx_w are then [rows, O_s] too."""
    ent = [(L.lin("attn.wq_a"), qr), (L.lin("attn.wkv"), kvraw)]
    pend = []
    if L.ratio:
        pend.append((cache.comp_state, "attn.compressor"))
    if L.kind == "csa":
        pend.append((cache.idx_state, "attn.indexer.compressor"))
    for st, sub in pend:
        r, off = st.ratio, (st.ratio if st.overlap else 0) if staging is None else -1
        kv, score = (st.kv, st.score) if staging is None else staging[sub]
        ent += [(L.lin(f"{sub}.wkv"), kv, None, off, r),
                (L.lin(f"{sub}.wgate"), score, L.w(f"{sub}.ape"), off, r)]
    if L.kind == "csa":
        ent.append((L.lin("attn.indexer.weights_proj"), idx_w))
    return ent


def stage_views(model, st, msl: int):
    """(layers, head_fn, head_host) of one stage for the decode kernels, made once per
    (model, device, max_seq_len) and shared by the device step and the legacy one-token
    dispatch (gpu.decode.ChunkBlock.forward_one): per layer the full-length RoPE tables
    (cos / sin [msl, R/2] f32, indexed by pos on the device), weight accessors (w, lin: bf16
    bits or stored FP8 + scale), f32 norm / hc_fn copies, the expert pointer tables, and the
    host copies the islands read (gpu.hostmath: hc scale / base, router bias, tid2eid)."""
    import cupy as cp
    from memra_dsv4.gpu.ops import experts as EX
    memo = model.__dict__.setdefault("_stage_views", {})
    key = (st.device, tuple(st.layers), int(msl))
    if key in memo:
        return memo[key]
    cfg = model.config
    tables = model.__dict__.setdefault("_rope_tables", {})
    layers = []
    with cp.cuda.Device(st.device):
        for lid in st.layers:
            L = _Layer()
            L.lid, L.p = lid, f"layers.{lid}"
            L.ratio, L.kind = cfg.compress_ratio(lid), cfg.attn_kind(lid)
            c, s = layer_cos_sin(cfg, lid, np.arange(msl), np.float32)
            c, s = np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32)
            tk = (st.device, c.shape, hash(c.tobytes()), hash(s.tobytes()))
            if tk not in tables:
                tables[tk] = (cp.asarray(c), cp.asarray(s))
            L.cos, L.sin = tables[tk]
            w = lambda leaf, L=L, st=st: st[f"{L.p}.{leaf}"]  # bind this stage
            L.w = w
            # (weight, scale): bf16 bits + None, or stored e4m3 + e8m0 (dense="fp8")
            L.lin = lambda pre, L=L, st=st: (st[f"{L.p}.{pre}.weight"],
                                             st.scale_of(f"{L.p}.{pre}"))
            L.f32 = {}
            for leaf in ("attn.kv_norm.weight", "attn.compressor.norm.weight",
                         "attn.indexer.compressor.norm.weight"):
                if f"{L.p}.{leaf}" in st.t:
                    L.f32[leaf] = _bf16_to_f32(w(leaf))
            for sub in ("hc_attn", "hc_ffn"):
                fn = w(f"{sub}_fn")
                L.f32[f"{sub}_fn"] = cp.ascontiguousarray(
                    fn.astype(cp.float32).reshape(fn.shape[0], -1))
            L.hash = cfg.is_hash_layer(lid)
            if L.hash:
                L.tid2eid = cp.ascontiguousarray(w("ffn.gate.tid2eid").astype(cp.int32))
            L.fmt = st.expert_fmt[lid]
            key_e = f"{L.p}.ffn.experts"
            L.wp, L.sp, L.ws2 = {}, {}, {}
            for m in ("w1", "w2", "w3"):
                L.wp[m] = EX.stacked_pointer_table(st[f"{key_e}.{m}.packed"])
                L.sp[m] = EX.stacked_pointer_table(st[f"{key_e}.{m}.scale"])
                L.ws2[m] = (cp.asarray(np.asarray(st.ws2[f"{key_e}.{m}"], np.float32))
                            if L.fmt == "nvfp4" else None)
            L.host = {}
            for sub in ("hc_attn", "hc_ffn"):
                L.host[f"{sub}_scale"] = cp.asnumpy(w(f"{sub}_scale")).astype(np.float32)
                L.host[f"{sub}_base"] = cp.asnumpy(w(f"{sub}_base")).astype(np.float32)
            if L.hash:
                L.host["tid2eid"] = cp.asnumpy(L.tid2eid).astype(np.int64)
            else:
                L.host["bias"] = cp.asnumpy(w("ffn.gate.bias")).astype(np.float32)
            layers.append(L)
        head_fn = head_host = None
        if st.has_head:
            fn = st["hc_head_fn"]
            head_fn = cp.ascontiguousarray(fn.astype(cp.float32).reshape(fn.shape[0], -1))
            head_host = {"scale": cp.asnumpy(st["hc_head_scale"]).astype(np.float32),
                         "base": cp.asnumpy(st["hc_head_base"]).astype(np.float32)}
    memo[key] = (layers, head_fn, head_host)
    return memo[key]


def _bf16_to_f32(u16):
    import cupy as cp
    return cp.ascontiguousarray((u16.astype(cp.uint32) << 16).view(cp.float32))
