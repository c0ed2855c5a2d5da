"""The device verify: the k + 1 rows of a speculative verify through the device step's kernels,
over a multi-row arena (VerifyWs), captured as one CUDA graph per (state, rows, taps) and stage
(docs/verify_step_plan.md; seam MEMRA_DSV4_VERIFY_PATH = ``device``).

Contract
--------
``VerifyStep(model, max_seq_len).verify(state, ids, return_streams, taps, graph=True)`` runs rows
t = 0..T-1 (T = k + 1, 2 <= T <= ``row_limit(cfg)`` = min(8, sliding_window)) at positions
pos + t and returns (logits float32 NumPy [T, vocab], streams or taps as gpu.verify does).
**Row t's logits are the bytes a device step (gpu.step_device, any of its forms) returns for the
token ids[t] at position pos + t after rows 0..t-1**, and after ``commit(n)`` the state's caches
equal, array for array, those n + 1 device steps leave (tests/gpu/test_verify_step_gpu.py).
Why the bytes can be equal: every launch is the step's kernel with the step's arguments for one
row, or the same kernel over T rows (grid.y = T or a row per CTA: hc_boundary, router.fused,
head_rms, norm_rope_sim's ring rows, build_cand, sparse_attention; each row computed exactly as
alone), or a weight-streaming GEMV that reads each weight once for the T rows with
per-row bits equal to the one-row kernel's (decode.cu gemv_bf16_x*: gemv_bf16's row order; the
FP4 expert kernels' slots: the row arithmetic is fixed by (o, K)).  The step's other forms
(forks, hc split, fused attention, the q norm inside wq_b / the multi GEMV, the shared expert
inside the expert launches) are bit-identical to the plain forms used here by their own tests.

Order inside a layer (why: the caches are position-addressed, rows run in position order where
a cache is read or written):
  the T rows' attention boundaries: one multi-row hc_boundary launch (grid.y = T, each row the
     one-token launch's bytes; row_form "per_row": the step's launch per row);
  A. the pending rows and the ring copied into the journal (copy_words: four arrays a launch),
     the projections of xn for the T rows in one launch (gemv_bf16_multi_rows over the layer's row-form
     GemvTable: qr, the kv row, the indexer weights, and the compressor / indexer-compressor
     pending values into the journal's staging rows; per-row tables where a weight is stored
     FP8), then each compressor's emissions for the T rows in one launch (emit_rows: per row,
     in position order, its staging values into pending row (pos + t) % r, then the emission
     when pos + t closes a block; a later row's pending slot may be one an earlier row's
     emission still pools, hence the staging).  Emitted compressed rows / indexer keys of later
     rows are invisible to an earlier row: its counts come from its own position.
  B. q_norm of the T rows (one launch, a CTA per row), wq_b (and the CSA indexer's q GEMV) for
     the T rows: one weight read.
  C. q head norm + RoPE of the T rows (one launch, each row at its position); the T kv rows into
     ring slots (pos + t) % W (one launch); the indexer's q RoPE / Hadamard / FP4 (one launch),
     the rows' scores over the keys each row's position may see and their top-k (one launch per
     kernel, grid.y = T: scores_topk_rows; per row under "per_row"); the rows' candidates
     and sparse attention (one launch each).  Every row's kv row is in the ring before any row
     attends, so a slot a later row replaced (position pos + j - W, j > t, still in row t's
     window) is read from the cache's ring_copy (the pre-verify ring, copied first in the
     layer): build_cand's shadow rows, the same bytes in the same candidate order
     (gpu.hostmath.verify_candidates; a CPU test checks what each row reads).
  D. wo_a (grouped) and wo_b for the T rows.
  ffn: the T rows' boundaries and router (one launch each: grid.y = T); the routed gate/up over
  the T x k slots (x row s // k), the shared expert's W1 / W3 + SwiGLU for the T rows in one
  launch (gemv_bf16_swiglu_xrows: gemv_bf16_swiglu's bytes per row), its w2 for the T rows, the
  down + combine with grid.y = T.  Head: hc_head, its norm and the head GEMV, one launch each
  for the T rows.
Dense weights stored as FP8 (MEMRA_DSV4_DENSE=fp8) have no multi-row GEMV yet: those run as T
one-row launches (the same bits, T weight reads).

Journal (per state, made at its first device verify, on the stages' devices): each layer's ring
as it was before the verify (LayerCache.ring_copy, a captured copy) and, per compressor, a
buffer pair [the pending rows before the verify | the staging rows (row t: the values row t
fed in) | a fresh row (0, -inf)].  ``commit(n)``: ring slots of the rolled-back positions back
from the copy (k + 1 <= W, so no kept position shares one), the pending rows gathered from the
journal buffers by gpu.hostmath.pending_sources (the oracle's pending state machine,
host.pending.advance_pending, replaying rows 0..n on row indices: restore + replay, byte for
byte), the compressed rows / indexer keys emitted by rolled-back positions zeroed; pos = p0 +
n + 1.  commit_form "host": a few CuPy operations per layer on the stage's compute stream
(cp.take for the gathers); "device": one verify_rollback launch per stage over the state's
RollbackTable (the same bytes; its GPU test compares the caches).

Launches only after every check; the graphs bake the arena, the state's caches and journal, and
the GemvTables (per state and row), all made before the first capture.  PDL follows the model's
seam (MEMRA_DSV4_PDL, as the device step): every launch carries the attribute, graph and eager
(a graph per (rows, taps, pdl, row_form)).  Why it is safe in this launch order: every kernel waits before
it triggers, and what a kernel loads before its wait (common.cuh PDL_ENTRY_PRELOAD) is static
weights, the rows' position words (uploaded before the graph) or buffers written two or more
launches back (down + combine's expert ids: the last row's router, then the routed gate/up and
the shared expert's launches).  The journal copies are kernels (ops_decode.copy_words), not
memcpy nodes, so the chain stays programmatic.
"""

from __future__ import annotations

import weakref

import numpy as np

__all__ = ["VerifyStep", "DeviceJournal", "verify_ws_plan", "row_limit", "ROW_MAX", "ROW_FORMS",
           "COMMIT_FORMS", "checked_form"]

ROW_MAX = 8   # ops_decode.XROWS_MAX: the multi-row GEMV's rows
# one row's size, shared by the rows (they run in turn on one stream): none now (the indexer's
# scores have a rows axis: one scores_topk_rows launch for the rows)
_SHARED_SLOTS = ()
# step buffers the verify does not use (greedy history, the WQB_QNORM copy, the host islands)
_DROPPED_SLOTS = ("head.tok_hist", "boundary.in", "cmp.pooled", "dev.idx_pooled", "attn.qrn",
                  "dev.head_pre")


def row_limit(cfg) -> int:
    """The most rows a device verify takes: ROW_MAX, and at most the window (commit restores a
    rolled-back position's ring slot from the pre-verify copy, so no two rows may share one)."""
    return min(ROW_MAX, int(cfg.sliding_window))


def verify_ws_plan(cfg, layers, has_embed: bool, has_head: bool, max_seq_len: int,
                   stage_index: int = 0, rows: int = ROW_MAX):
    """VerifyWs of one stage: the step's StepWs slots (gpu.step.step_ws_plan) with a leading
    ``rows`` axis (row t of every activation at [t]; the indexer's score rows too: one
    scores_topk_rows launch), and none of the step's greedy / host-island extras.  moe.h is [rows, k, I]: the routed gate/up's T x k slots in row order."""
    from memra_dsv4.gpu.arena import ArenaPlan
    from memra_dsv4.gpu.step import step_ws_plan
    rows = int(rows)
    assert 1 <= rows <= ROW_MAX, f"verify_ws_plan: rows = {rows}, expected 1..{ROW_MAX}"
    one = step_ws_plan(cfg, layers, has_embed, has_head, max_seq_len, stage_index)
    p = ArenaPlan(f"verify_ws.stage{stage_index}")
    for s in one:
        if s.name in _DROPPED_SLOTS:
            continue
        p.add(s.name, s.shape if s.name in _SHARED_SLOTS else (rows,) + tuple(s.shape), s.dtype)
    p.check()
    return p


ROW_FORMS = ("rows", "per_row")      # VerifyStep.row_form
COMMIT_FORMS = ("host", "device")    # VerifyStep.commit_form


def checked_form(value, allowed: tuple, name: str) -> str:
    """``value`` when it is one of ``allowed``, else ValueError naming the attribute: the verify's
    forms are plain attributes an engine or a bench may set, so a typo must not fall through to
    the other branch."""
    if value not in allowed:
        raise ValueError(f"VerifyStep.{name} = {value!r}: expected one of {allowed}")
    return value


class DeviceJournal:
    """A device verify's pending record (state.journal): p0, k (the oracle's check_commit reads
    them) and the per-state journal buffers it filled."""

    __slots__ = ("p0", "k", "bufs")

    def __init__(self, p0: int, k: int, bufs):
        self.p0, self.k, self.bufs = int(p0), int(k), bufs


class _StateJournal:
    """Per state and layer: ``comp`` / ``idx``: (kv, score) journal buffers of the compressor /
    the indexer's compressor, f32 [P + ROW_MAX + 1, C] each (P, C: its pending rows' shape):
    rows [0, P) the pending rows before the verify (copied first in the layer), rows P + t the
    values row t fed in (the xn projections write them: the staging rows, which the emissions
    then place), row P + ROW_MAX a fresh row (0, -inf), set here and never written.  commit(n)
    gathers the pending rows from them (gpu.hostmath.pending_sources).  (The pre-verify ring is
    the cache's own ring_copy.)"""

    def __init__(self, model, state):
        import cupy as cp
        self.comp, self.idx = {}, {}
        for st in model.stages:
            with cp.cuda.Device(st.device):
                for lid in st.layers:
                    c = state.cache(lid)
                    for pend, into in ((c.comp_state if c.ratio else None, self.comp),
                                       (c.idx_state, self.idx)):
                        if pend is None:
                            continue
                        P, C = pend.kv.shape
                        kv = cp.zeros((P + ROW_MAX + 1, C), cp.float32)
                        sc = cp.zeros((P + ROW_MAX + 1, C), cp.float32)
                        sc[P + ROW_MAX] = -np.inf
                        into[lid] = (kv, sc)
            cp.cuda.Device(st.device).synchronize()

    @staticmethod
    def pre(buf, P: int):
        """The pre-verify rows of a journal buffer pair: (kv[:P], score[:P])."""
        return buf[0][:P], buf[1][:P]

    @staticmethod
    def staging(buf, P: int, t: int | None = None):
        """The staging rows of a journal buffer pair: [ROW_MAX, C] each, or row t's [C]."""
        if t is None:
            return buf[0][P:P + ROW_MAX], buf[1][P:P + ROW_MAX]
        return buf[0][P + t], buf[1][P + t]


class _Stage:
    pass


def _journal_copy(pairs, stream) -> None:
    """The (dst, src) pairs' copies in one kernel launch (ops_decode.copy_words: a kernel node
    keeps the PDL chain) when it takes every pair (ops_decode.copy_words_ok), else one memcpy each."""
    from memra_dsv4.gpu import ops_decode as DK
    pairs = list(pairs)
    if all(DK.copy_words_ok(d, s) for d, s in pairs):
        for i in range(0, len(pairs), DK.COPY_PAIRS_MAX):
            DK.copy_words(pairs[i:i + DK.COPY_PAIRS_MAX])
        return
    for d, s in pairs:
        _copy(d, s, stream)


def _copy(dst, src, stream) -> None:
    """A device-to-device copy of src's bytes into dst (both contiguous, same size), captured as
    a memcpy node."""
    import cupy as cp
    assert dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous, (
        f"verify journal copy: {dst.shape} {dst.dtype} <- {src.shape} {src.dtype}")
    cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)


class VerifyStep:
    def __init__(self, model, max_seq_len: int) -> None:
        import cupy as cp
        import cupyx
        from memra_dsv4.gpu.arena import Arena
        from memra_dsv4.gpu.step_device import DeviceStep, stage_views, step_ratios
        self.m = model
        self.cfg = cfg = model.config
        self.msl = int(max_seq_len)
        self.stages: list[_Stage] = []
        # per state (weak keys, as DeviceStep): {(T, taps): graphs}, {lid: [GemvTable per row]},
        # the journal buffers
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # per state: {lid: {R: row-form GemvTable}} (gemv_bf16_multi_rows: the T rows' xn
        # projections in one launch, the pending values into the state's journal staging rows),
        # None for a layer with a weight stored FP8 (no FP8 x-rows kernel: the per-row tables)
        self._row_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._journals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._rollback: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # commit(n): "host" (CuPy operations per layer, a few launches each; GPU-tested) or
        # "device" (ops_decode.verify_rollback: one launch per stage over a RollbackTable; its
        # GPU test compares the caches with the host form's: tests/gpu/test_verify_step_gpu.py)
        self.commit_form = "host"
        self._tap_bufs: dict = {}   # (stage, taps) -> {layer: [ROW_MAX, hc, D] bf16}
        self._taps = ()             # the taps of the graph being captured / enqueued
        self._logits_host = None
        # "rows": the multi-row launches where a row's bits do not depend on the others (the hc
        # boundaries and the router with grid.y = T; the xn projections, the emissions and the
        # indexer's top-k over the rows; the shared expert's W1 / W3 + SwiGLU in one launch);
        # "per_row": the step's own one-token launch per row (hc_boundary, router.fused,
        # gemv_bf16_multi, emit, scores_topk, gemv_bf16_swiglu).  The same bytes
        # (tests/gpu/test_verify_step_gpu.py); FP8-as-stored shared weights always run per row
        self.row_form = "rows"
        for si, st in enumerate(model.stages):
            S = _Stage()
            S.st, S.dev, S.si = st, st.device, si
            S.stream = model.devs[st.device].compute
            S.ph = f"verify/stage{si}"
            with cp.cuda.Device(st.device):
                S.plan = verify_ws_plan(cfg, st.layers, st.has_embed, st.has_head, self.msl, si)
                S.arena = Arena(S.plan, st.device)
                S.v = S.arena.views()
                S.ratios = step_ratios(cfg, st.layers, si)
                S.host = cupyx.zeros_pinned((2, ROW_MAX), np.int32)   # tok, pos of the rows
                S.event = cp.cuda.Event(disable_timing=True)
                S.layers, S.head_fn, S.head_host = stage_views(model, st, self.msl)
            self.stages.append(S)
        # the kernels, ticket counters and workspaces the step's launches need (made before any
        # capture): the device step's own prewarm
        for S in self.stages:
            with cp.cuda.Device(S.dev):
                DeviceStep._prewarm(self, S)
        model.devs.order_after_current()
        for d in model.devs:
            d.compute.synchronize()

    # ------------------------------------------------------------------ the call
    def supports(self, T: int) -> bool:
        return 2 <= int(T) <= row_limit(self.cfg)

    def verify(self, state, ids: np.ndarray, return_streams: bool = False, taps=(),
               graph: bool = True):
        """Rows ids[0..T-1] at positions state.pos + t (the caller checked the ids, the room,
        the taps and that no verify is pending); journals into state.journal."""
        import cupy as cp
        import cupyx
        from memra_dsv4.gpu.pdl import pdl_launches
        from memra_dsv4.profiling import phase
        rt = cp.cuda.runtime
        T = int(ids.shape[0])
        assert self.supports(T), f"device verify: {T} rows, expected 2..{row_limit(self.cfg)}"
        if state.max_seq_len != self.msl:
            raise ValueError(f"device verify: state max_seq_len {state.max_seq_len} != the "
                             f"VerifyWs built for {self.msl}")
        taps = tuple(int(t) for t in taps)
        checked_form(self.row_form, ROW_FORMS, "row_form")
        self._ensure_state(state)
        pos0 = int(state.pos)
        # the model's PDL seam, as the device step reads it: every launch of the verify carries
        # the attribute (captured as programmatic edges); a graph per (rows, taps, pdl, row_form)
        pdl_on = getattr(self.m, "pdl", "off") == "on"
        gs = None
        if graph:
            key = (T, taps, pdl_on, self.row_form)   # the forms a graph bakes in
            per = self._graphs[state]
            gs = per.get(key)
            if gs is None:
                gs = per[key] = self._capture(state, T, taps, pdl_on)
        with phase("verify"):
            for S in self.stages:   # the host input: the rows' tokens and positions
                S.host[0, :T] = ids
                S.host[1, :T] = np.arange(pos0, pos0 + T, dtype=np.int32)
                with cp.cuda.Device(S.dev):
                    rt.memcpyAsync(S.v["tok"].data.ptr, S.host.ctypes.data, 4 * T,
                                   rt.memcpyHostToDevice, S.stream.ptr)
                    rt.memcpyAsync(S.v["pos"].data.ptr, S.host.ctypes.data + 4 * ROW_MAX, 4 * T,
                                   rt.memcpyHostToDevice, S.stream.ptr)
            for S, g in zip(self.stages, gs if gs is not None else [None] * len(self.stages)):
                with cp.cuda.Device(S.dev):
                    if S.si > 0:
                        S.stream.wait_event(self.stages[S.si - 1].event)
                    if g is not None:
                        g.launch(S.stream)
                    else:
                        self._taps = taps
                        with S.stream, pdl_launches(pdl_on):
                            self._enqueue(S, state, T)
                        self._taps = ()
                    if S.si + 1 < len(self.stages):
                        S.event.record(S.stream)
            last = self.stages[-1]
            src = last.v["head.logits"][:T]
            if self._logits_host is None:
                self._logits_host = cupyx.empty_pinned(last.v["head.logits"].shape, np.float32)
            with cp.cuda.Device(last.dev):
                rt.memcpyAsync(self._logits_host.ctypes.data, src.data.ptr, src.nbytes,
                               rt.memcpyDeviceToHost, last.stream.ptr)
            for S in self.stages:
                S.stream.synchronize()
        logits = np.array(self._logits_host[:T])
        state.journal = DeviceJournal(pos0, T - 1, self._journals[state])
        if not return_streams:
            return logits
        return logits, self._streams_out(T, taps)

    def _streams_out(self, T: int, taps: tuple):
        """float32 CuPy on the last stage's device: the rows' final streams [T, hc, D] or, with
        taps, those layers' output streams [T, n_taps, hc, D] (gpu.decode.gather_taps)."""
        import cupy as cp
        from memra_dsv4.gpu import ops_glue as G
        from memra_dsv4.gpu.decode import gather_taps
        last = self.stages[-1]
        if not taps:
            with cp.cuda.Device(last.dev), self.m.devs[last.dev].compute:
                return G.to_f32(self._final_streams[:T])
        out = {}
        for S in self.stages:
            bufs = self._tap_bufs.get((S.si, taps), {})
            with cp.cuda.Device(S.dev), S.stream:
                for lid, b in bufs.items():
                    out[lid] = G.to_f32(b[:T])
            S.stream.synchronize()
        return gather_taps(self.m, out, taps)

    def commit(self, state, jr: DeviceJournal, n: int) -> None:
        """Roll rows n + 1..k of ``jr`` back (module doc); the caller checked n and sets pos.
        Both forms: the ring slots of the rolled-back positions from ring_copy, the pending rows
        gathered from the journal buffers by the stage's gather lists (RollbackTable.sources,
        uploaded here for (p0, n)), the compressed rows / indexer keys the rolled-back rows
        emitted zeroed."""
        import cupy as cp
        from memra_dsv4.gpu import ops_decode as DK
        if n == jr.k:
            return   # the caches are those of every row: nothing to undo
        form = checked_form(self.commit_form, COMMIT_FORMS, "commit_form")
        rb = self._rollback[state]
        bufs = jr.bufs
        last_kept, p_end = jr.p0 + n, jr.p0 + jr.k + 1
        for S in self.stages:
            tab = rb[S.si]
            with cp.cuda.Device(S.dev), S.stream:
                tab.upload_sources(jr.p0, n, S.stream)
                if form == "device":
                    DK.verify_rollback(tab, jr.p0, jr.k, n)
                    continue
                # the rolled-back positions' ring slots: the same for every layer (one window)
                slots = cp.asarray(np.arange(last_kept + 1, p_end) % self.cfg.sliding_window)
                for lid in S.st.layers:
                    c = state.cache(lid)
                    c.ring[slots] = c.ring_copy[slots]
                    for pend, buf, rows, r in ((c.comp_state if c.ratio else None, bufs.comp.get(lid),
                                                c.comp, c.ratio), (c.idx_state, bufs.idx.get(lid), c.idx_keys, 4)):
                        if pend is None:
                            continue
                        src = tab.source_rows(pend.ratio)
                        cp.take(buf[0], src, axis=0, out=pend.kv)
                        cp.take(buf[1], src, axis=0, out=pend.score)
                        rows[(last_kept + 1) // r:p_end // r] = 0
        # sync point: the gather lists' pinned buffers are rewritten by the next commit
        for S in self.stages:
            S.stream.synchronize()

    # ------------------------------------------------------------------ setup
    def _ensure_state(self, state) -> None:
        """The state's GemvTables (one per layer and row: the row's xn, qr, kv and idx.w
        addresses, the state's pending rows) and journal buffers, made once per state, before
        any capture."""
        if state in self._tables:
            return
        import cupy as cp
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu.step_device import xn_projection_entries
        D = self.cfg.hidden_size
        jr = self._journals[state] = _StateJournal(self.m, state)
        tabs, row_tabs = {}, {}
        for S in self.stages:
            v = S.v
            idx_w = v.get("idx.w")
            with cp.cuda.Device(S.dev):
                for L in S.layers:
                    c = state.cache(L.lid)
                    # one table per row (the step's kernels: any weight form), pending values
                    # into the row's staging rows
                    tabs[L.lid] = [DK.GemvTable(xn_projection_entries(
                        L, c, v["attn.qr"][t], v["dev.kvraw"][t], None if idx_w is None else idx_w[t],
                        staging=_staging(jr, c, t)), D) for t in range(ROW_MAX)]
                    # the row form: all rows in one launch (bf16 weights only)
                    ent = xn_projection_entries(L, c, v["attn.qr"], v["dev.kvraw"], idx_w,
                                                staging=_staging(jr, c))
                    fp8 = any(isinstance(e[0], tuple) and e[0][1] is not None for e in ent)
                    row_tabs[L.lid] = None if fp8 else {
                        R: DK.GemvTable(ent, D, rows_per_warp=R, rows=ROW_MAX) for R in DK.XROWS_R}
        self._graphs[state] = {}
        self._tables[state] = tabs
        self._row_tables[state] = row_tabs
        rb = {}   # per stage: the layers' RollbackTable (commit_form "device")
        for S in self.stages:
            layers = []
            for lid in S.st.layers:
                c = state.cache(lid)
                L = dict(ring=c.ring, ring_copy=c.ring_copy)
                if c.ratio:
                    L.update(ratio=c.ratio, comp_kv=c.comp_state.kv, comp_score=c.comp_state.score,
                             comp_jkv=jr.comp[lid][0], comp_jsc=jr.comp[lid][1], comp=c.comp)
                if c.idx_state is not None:
                    L.update(idx_kv=c.idx_state.kv, idx_score=c.idx_state.score, idx_jkv=jr.idx[lid][0],
                             idx_jsc=jr.idx[lid][1], idx_keys=c.idx_keys)
                layers.append(L)
            with cp.cuda.Device(S.dev):
                rb[S.si] = DK.RollbackTable(layers, ROW_MAX)
        self._rollback[state] = rb
        self.m.devs.order_after_current()   # the tables' uploads ran on the current stream

    def _capture(self, state, T: int, taps: tuple, pdl_on: bool = False):
        import cupy as cp
        from memra_dsv4.gpu import graphs
        from memra_dsv4.gpu.pdl import pdl_launches
        from memra_dsv4.profiling import phase_set_capturing
        from memra_dsv4.profiling import phases as _ph
        for d in self.m.devs:
            d.compute.synchronize()
        out = []
        was = _ph._capturing
        phase_set_capturing(True)
        self._taps = taps
        try:
            for S in self.stages:
                with cp.cuda.Device(S.dev):
                    self._tap_buffers(S, taps)
                with cp.cuda.Device(S.dev), pdl_launches(pdl_on):
                    out.append(graphs.capture(S.stream, lambda S=S: self._enqueue(S, state, T)))
        finally:
            phase_set_capturing(was)
            self._taps = ()
        return out

    def _tap_buffers(self, S, taps: tuple) -> dict:
        """{layer: [ROW_MAX, hc, D] bf16} for this stage's tap layers (made once per taps)."""
        import cupy as cp
        key = (S.si, taps)
        if key not in self._tap_bufs:
            hc, D = self.cfg.hc_mult, self.cfg.hidden_size
            with cp.cuda.Device(S.dev):
                self._tap_bufs[key] = {l: cp.zeros((ROW_MAX, hc, D), cp.uint16)
                                       for l in taps if l in S.st.layers}
            S.stream.synchronize()
        return self._tap_bufs[key]

    # ------------------------------------------------------------------ launches
    def _enqueue(self, S, state, T: int) -> None:
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu import runtime
        from memra_dsv4.gpu.ops import hc as HC
        from memra_dsv4.gpu.ops import rmsnorm as RN
        from memra_dsv4.profiling import phase
        cfg, st, v, sp = self.cfg, S.st, S.v, S.ph
        D = cfg.hidden_size
        taps = self._tap_buffers(S, self._taps)
        jr = self._journals[state]
        tabs = self._tables[state]
        rtabs = self._row_tables[state]
        with phase(sp):
            for t in range(T):
                DK.step_scalars(v["pos"][t], v["dev.aux"][t], S.ratios)
            # the step's [1, hc, D] stream slots with the rows axis: [ROW_MAX, hc, D]
            hc = cfg.hc_mult
            cur = v["streams.a"].reshape(ROW_MAX, hc, D)
            oth = v["streams.b"].reshape(ROW_MAX, hc, D)
            if st.has_embed:
                with phase(f"{sp}/embed"):
                    for t in range(T):
                        DK.embed_gather(v["tok"][t], st["embed.weight"], cur[t])
            for i, L in enumerate(S.layers):
                # a tap of the previous layer: its output streams exist only between this
                # layer's attention boundary (which writes them) and the next write of that
                # buffer (_block copies them there)
                prev_tap = taps.get(S.layers[i - 1].lid) if i > 0 else None
                with phase(f"{sp}/block"):
                    cur, oth = self._block(S, L, i, T, cur, oth, state.cache(L.lid),
                                           (tabs[L.lid], rtabs[L.lid]), jr, prev_tap)
                if L is S.layers[-1] and L.lid in taps:   # the stage's closing hc_post wrote it
                    _journal_copy([(taps[L.lid][:T], cur[:T])], S.stream)
            if st.has_head:
                with phase(f"{sp}/head"):
                    self._final_streams = cur
                    y, yn = v["head.y"][:T].reshape(T, D), v["head.yn"][:T].reshape(T, D)
                    # the T rows in one launch each: hc_mixes' bits are the same for any T
                    # (its canonical order), hc_head_apply and the rmsnorm work per row
                    HC.hc_head(cur[:T], S.head_fn, st["hc_head_scale"], st["hc_head_base"],
                               hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, out=y,
                               mixes=v["dev.head_mix"][:T].reshape(T, -1))
                    RN.rmsnorm(y, st["norm.weight"], cfg.rms_norm_eps, out=yn)
                    _rows_gemv(st["head.weight"], None, yn[:T], v["head.logits"][:T])
            if S.si + 1 < len(self.stages):
                nxt = self.stages[S.si + 1]
                with phase(f"{sp}/boundary_copy"):
                    runtime.boundary_copy(nxt.v["streams.a"], cur, cur[:T].nbytes, S.stream,
                                          force_bounce=self.m.force_bounce)

    def _boundaries(self, S, L, T: int, streams, sub: str, f=None, out=None) -> None:
        """The T rows' boundaries into sub-layer ``sub`` (with f, the previous sub-layer's hc_post
        into ``out`` first): one multi-row hc_boundary launch (grid.y = T; each row's bytes those
        of the step's one-token launch) under row_form "rows" with the lastcta kernel, else the
        step's one-token launch per row."""
        from memra_dsv4.gpu.ops import hc as HC
        if self.row_form == "rows" and HC.boundary_impl(None) == "lastcta":
            spans = [(0, T)]
        else:
            spans = [(t, t + 1) for t in range(T)]
        cfg, v = self.cfg, S.v
        for a, b in spans:
            HC.hc_boundary(streams[a:b], L.f32[f"hc_{sub}_fn"], L.w(f"hc_{sub}_scale"),
                           L.w(f"hc_{sub}_base"), L.w(f"{sub}_norm.weight"), iters=cfg.hc_sinkhorn_iters,
                           hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, xn=v["xn"][a:b], x=v["x"][a:b],
                           pre=v["hc.pre"][a:b], post=v["hc.post"][a:b], comb=v["hc.comb"][a:b],
                           mixes=v["dev.mix"][a:b].reshape(b - a, -1), f=None if f is None else f[a:b],
                           out=None if out is None else out[a:b])

    def _block(self, S, L, i: int, T: int, cur, oth, cache, tables, jr, prev_tap=None):
        """One layer for the T rows (the module doc's order); returns the streams (cur, oth).
        ``prev_tap``: a [ROW_MAX, hc, D] buffer that receives the previous layer's output streams
        (written by this layer's attention boundary)."""
        from memra_dsv4.gpu.ops import hc as HC
        from memra_dsv4.profiling import phase
        v, bp = S.v, f"{S.ph}/block"
        D, hc = self.cfg.hidden_size, self.cfg.hc_mult
        with phase(f"{bp}/attn"):
            if i == 0:
                self._boundaries(S, L, T, cur, "attn")
            else:   # the previous layer's ffn hc_post + this attn's boundary
                self._boundaries(S, L, T, cur, "attn", f=v["ffn.out"], out=oth)
                cur, oth = oth, cur
                if prev_tap is not None:
                    _journal_copy([(prev_tap[:T], cur[:T])], S.stream)
            self._attention(S, L, T, cache, tables, jr)
        with phase(f"{bp}/ffn"):
            self._boundaries(S, L, T, cur, "ffn", f=v["attn.out"], out=oth)
            cur, oth = oth, cur
            self._moe(S, L, T)
            if L is S.layers[-1]:   # the stage's closing hc_post, the T rows in one launch
                HC.hc_post(v["ffn.out"][:T].reshape(T, D), cur[:T], v["hc.post"][:T].reshape(T, hc),
                           v["hc.comb"][:T].reshape(T, hc, hc), out=oth[:T])
                cur, oth = oth, cur
        return cur, oth

    def _attention(self, S, L, T: int, cache, tables, jr) -> None:
        """One layer's attention for the T rows; tables = (the per-row GemvTables, the row-form
        tables by R or None)."""
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu.ops import attention as AT
        from memra_dsv4.gpu.ops import compressor as CM
        from memra_dsv4.gpu.ops import indexer as IX
        from memra_dsv4.gpu.ops import quant_sim as QS
        from memra_dsv4.gpu.ops import rmsnorm as RN
        from memra_dsv4.gpu.step_device import decode_attn_head_group
        from memra_dsv4.profiling import phase
        cfg, v, ap = self.cfg, S.v, f"{S.ph}/block/attn"
        eps, W = cfg.rms_norm_eps, cfg.sliding_window
        H, hd = cfg.num_attention_heads, cfg.head_dim
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        csa = bool(L.ratio) and L.kind == "csa"
        pos_rows = v["pos"][:T].reshape(T)
        # the journal: the ring before any row (LayerCache.ring_copy, in the attention's buffer)
        # and the pending rows before any row (the journal buffers' first P rows)
        pends = [(st, jbuf, sub, mode, out) for st, jbuf, sub, mode, out in (
            (cache.comp_state if L.ratio else None, jr.comp.get(L.lid), "attn.compressor", "fp8", cache.comp),
            (cache.idx_state if csa else None, jr.idx.get(L.lid), "attn.indexer.compressor", "hadfp4",
             cache.idx_keys)) if st is not None]
        pairs = [(cache.ring_copy, cache.ring)]
        for st, jbuf, *_ in pends:
            P = st.kv.shape[0]
            pairs += list(zip(_StateJournal.pre(jbuf, P), (st.kv, st.score)))
        _journal_copy(pairs, S.stream)
        # A. the projections of xn (the pending values into the journal's staging rows), then the
        # emissions in position order, each row's staging values placed into the pending rows
        # first (a later row's pending slot may be one an earlier row's emission still pools).
        # Row form: one projection launch for the T rows (per-row tables where a weight is
        # stored FP8), one emission launch per compressor for the T rows (emit_rows); per_row:
        # per row the step's table launch and emissions.
        tables, row_tabs = tables
        with phase(f"{ap}/projections"):
            if self.row_form == "rows":
                if row_tabs is not None:
                    DK.gemv_bf16_multi_rows(row_tabs[DK.xrows_R(T)], v["xn"][:T], pos_rows)
                else:
                    for t in range(T):
                        DK.gemv_bf16_multi(tables[t], v["xn"][t], v["pos"][t])
                for st, jbuf, sub, mode, out in pends:
                    CM.emit_rows(pos_rows, st.kv, st.score, st.ratio, st.overlap,
                                 L.f32[f"{sub}.norm.weight"], eps, L.cos, L.sin, mode, out,
                                 incoming=_StateJournal.staging(jbuf, st.kv.shape[0]))
            else:
                for t in range(T):
                    DK.gemv_bf16_multi(tables[t], v["xn"][t], v["pos"][t])
                    for st, jbuf, sub, mode, out in pends:
                        CM.emit(v["pos"][t], st.kv, st.score, st.ratio, st.overlap,
                                L.f32[f"{sub}.norm.weight"], eps, L.cos, L.sin, mode, out,
                                incoming=_StateJournal.staging(jbuf, st.kv.shape[0], t))
        # B. q_norm (one CTA per row: a row's bits do not depend on the others) and the rows' q
        # GEMVs: one weight read
        qr_rows = v["attn.qr"][:T]
        RN.rmsnorm(qr_rows, L.w("attn.q_norm.weight"), eps, out=qr_rows)
        with phase(f"{ap}/q"):
            w, sc = L.lin("attn.wq_b")
            _rows_gemv(w, sc, qr_rows, v["attn.q"][:T].reshape(T, H * hd))
            if csa:
                w, sc = L.lin("attn.indexer.wq_b")
                _rows_gemv(w, sc, qr_rows, v["idx.q"][:T].reshape(T, nI * dI))
        # C. per row, in position order: q norm + RoPE, the ring row, the indexer, attention
        if csa:
            K = W + v["idx.sel"].shape[1]
        else:
            K = W + (cache.comp.shape[0] if L.ratio else 0)
        hg = decode_attn_head_group(H)
        split = AT.n_tiles(K) if hg != AT.head_group(H) else None
        sink = L.w("attn.attn_sink")
        with phase(f"{ap}/rows"):
            # q head norm + RoPE of every row in one launch (a warp per head row, RoPE at the
            # row's own position pos[t]; the one-row launch's bits)
            qs = v["attn.q"][:T]
            RN.head_rms(qs, eps, out=qs, rope=(pos_rows, L.cos, L.sin))
            # the T kv rows into the ring in one launch (row t at slot (pos + t) % W, each the
            # one-row launch's bytes), before any row attends: a window slot a later row replaced
            # is read from ring_copy (build_cand's shadow rows), so every row sees its step's rows
            CM.norm_rope_sim(v["dev.kvraw"][:T].reshape(T, hd), L.f32["attn.kv_norm.weight"], eps,
                             L.cos, L.sin, pos_rows, "fp8", out=cache.ring, emit_gate=(pos_rows, W),
                             row="ring")
            sel = None
            if csa:
                # the rows' index q: RoPE at each row's position, Hadamard, FP4 (one launch, a
                # warp per head row); then per row the scores and top-k over the keys its own
                # position may see (dev.aux[t][0]: complete blocks at pos + t)
                qis = v["idx.q"][:T].reshape(T, nI, dI)
                QS.rope_hadamard128_fp4(qis, pos_rows, L.cos, L.sin, out=qis)
                N = cache.idx_keys.shape[0]
                scores = v["dev.idx_scores"].reshape(ROW_MAX, -1)
                if self.row_form == "rows" and (T == 1 or N % 8 == 0):
                    # the T rows' scores and top-k in one launch per kernel (grid.y = T; each
                    # row the one-row launch's bytes, its own counter / histogram)
                    IX.scores_topk_rows(qis, v["idx.w"][:T].reshape(T, nI), cache.idx_keys, v["dev.aux"][:T],
                                        cfg.index_topk, _rows_view(scores, T, N), v["idx.sel"][:T].reshape(T, -1),
                                        w_scale=dI ** -0.5 * nI ** -0.5)
                else:   # per row, in turn, on the slot's first N values (16-byte aligned for
                    # any N: row t of a [rows, N] view is not when N % 8 != 0)
                    one = _rows_view(scores, 1, N)
                    for t in range(T):
                        qi = v["idx.q"][t].reshape(1, nI, dI)
                        IX.scores_topk(qi, v["idx.w"][t].reshape(1, nI), cache.idx_keys, v["dev.aux"][t][0:1],
                                       cfg.index_topk, one, v["idx.sel"][t].reshape(1, -1),
                                       w_scale=dI ** -0.5 * nI ** -0.5)
                sel = v["idx.sel"][:T]
            # the rows' candidates [T, K] (contiguous: the kernel steps a row by K) and their
            # attention, one launch each (a row's bits do not depend on the others)
            cand = v["attn.cand"].reshape(-1)[:T * K].reshape(T, K)
            DK.build_cand(v["pos"][:T], cand, W, L.ratio, sel, shadow_row=cache.shadow_row)
            AT.sparse_attention(v["attn.q"][:T].reshape(T, H, hd), cache.kv, cand, sink, hd ** -0.5,
                                out=v["attn.o"][:T].reshape(T, H, hd), n_split=split,
                                workspace=v["dev.attn_ws"].reshape(-1),
                                inverse_rope=(pos_rows, L.cos, L.sin), head_group=hg)
        # D. the output projections of the rows
        with phase(f"{ap}/output"):
            w, sc = L.lin("attn.wo_a")
            _rows_gemv(w, sc, v["attn.o"][:T].reshape(T, H * hd), v["attn.u"][:T],
                       groups=cfg.o_groups)
            w, sc = L.lin("attn.wo_b")
            _rows_gemv(w, sc, v["attn.u"][:T], v["attn.out"][:T])

    def _moe(self, S, L, T: int) -> None:
        from memra_dsv4.gpu import ops_decode as DK
        from memra_dsv4.gpu.ops import experts as EX
        from memra_dsv4.gpu.ops import router as RT
        from memra_dsv4.gpu.step_device import router_handoff
        from memra_dsv4.profiling import phase
        cfg, v, mp = self.cfg, S.v, f"{S.ph}/block/ffn/moe"
        D, I, E, k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                      cfg.num_experts_per_tok)
        if self.row_form == "rows":   # the T rows in one ticket-form launch (grid.y = T)
            spans, handoff = [(0, T)], "ticket"
        else:                         # the step's one-token launch per row, its handoff
            spans, handoff = [(t, t + 1) for t in range(T)], router_handoff()
            if handoff == "cluster" and not RT.cluster_ok(E):
                handoff = "ticket"
        with phase(f"{mp}/router"):
            for a, b in spans:
                route = (dict(tid2eid=L.tid2eid, token_ids=v["tok"][a:b].reshape(b - a)) if L.hash
                         else dict(bias=L.w("ffn.gate.bias")))
                RT.fused(v["xn"][a:b], L.w("ffn.gate.weight"), k, cfg.routed_scaling_factor,
                         logits=v["moe.logits"][a:b], scores=v["moe.scores"][a:b], idx=v["moe.ids"][a:b],
                         weights=v["moe.w"][a:b], handoff=handoff, **route)
        ids = v["moe.ids"][:T]
        h = v["moe.h"][:T].reshape(T * k, I)
        with phase(f"{mp}/experts"):   # T x k slots, slot s reads x row s // k
            EX.gemv_fp4_gateup(L.fmt, v["xn"][:T], ids.reshape(T * k), L.wp["w1"], L.sp["w1"],
                               L.wp["w3"], L.sp["w3"], I, D, weight=v["moe.w"][:T].reshape(T * k),
                               limit=cfg.swiglu_limit, out=h, x_div=k, ws2_1=L.ws2["w1"],
                               ws2_3=L.ws2["w3"])
        with phase(f"{mp}/shared"):
            (w1, s1), (w3, s3) = L.lin("ffn.shared_experts.w1"), L.lin("ffn.shared_experts.w3")
            if self.row_form == "rows" and s1 is None and s3 is None:
                # W1 and W3 read once for the rows and the clamped SwiGLU in the epilogue (one
                # launch: row t's bits gemv_bf16_swiglu's for xn[t])
                DK.gemv_bf16_swiglu_xrows(w1, w3, v["xn"][:T], v["moe.sh_h"][:T], cfg.swiglu_limit)
            else:
                for t in range(T):
                    DK.gemv_bf16_swiglu(w1, w3, v["xn"][t], v["moe.sh_h"][t], cfg.swiglu_limit,
                                        scale1=s1, scale3=s3)
            w, sc = L.lin("ffn.shared_experts.w2")
            _rows_gemv(w, sc, v["moe.sh_h"][:T], v["moe.shared"][:T])
        with phase(f"{mp}/combine"):
            EX.gemv_fp4_down_combine(L.fmt, h, ids, L.wp["w2"], L.sp["w2"], D, I,
                                     shared=v["moe.shared"][:T], out=v["ffn.out"][:T],
                                     ws2=L.ws2["w2"])


def _staging(jr, cache, t: int | None = None) -> dict:
    """{compressor: (kv, score)} staging arrays of a layer's compressors in the state's journal
    (xn_projection_entries' ``staging``): the [ROW_MAX, C] rows, or row t's [C]."""
    out = {}
    for st, sub, into in ((cache.comp_state if cache.ratio else None, "attn.compressor", jr.comp),
                          (cache.idx_state, "attn.indexer.compressor", jr.idx)):
        if st is not None:
            out[sub] = _StateJournal.staging(into[cache.layer_id], st.kv.shape[0], t)
    return out


def _rows_view(buf, T: int, N: int):
    """A contiguous [T, N] view of the first T * N values of a [rows, Nmax] slot (the rows of a
    layer whose key count N is below the slot's width, packed at stride N)."""
    return buf.reshape(-1)[:T * N].reshape(T, N)


def _rows_gemv(w, scale, X, out, groups: int = 1) -> None:
    """out[t] = gemv_bf16(w, X[t]) for the rows of X: one multi-row launch (each weight chunk read
    once, gemv_bf16's bits per row) for bf16 weights, else (stored FP8) one launch per row."""
    from memra_dsv4.gpu import ops_decode as DK
    if scale is None and w.dtype == np.uint16:
        DK.gemv_bf16_xrows(w, X, out, groups=groups)
        return
    for t in range(X.shape[0]):
        DK.gemv_bf16(w, X[t:t + 1], out[t:t + 1], groups=groups, scale=scale)

