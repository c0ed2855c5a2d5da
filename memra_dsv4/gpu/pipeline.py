"""Pipelined prefill over the stages (seam ``MEMRA_DSV4_PREFILL_PIPELINE``, default ``off``).

Contract
--------
``pipeline_chunks(S, n_stages) -> list[int] | None``
    The chunk lengths a prompt of S tokens is cut into: ``None`` (run the plain chunk routine)
    with one stage or when S < 2 * MIN_CHUNK; else N_CHUNKS = 3 chunks (whole multiples of 64
    tokens; the last takes the rest) of at least MIN_CHUNK tokens each.  3 chunks over 2 stages
    keep both GPUs busy for 3 of the 4 chunk-times: time ~ 4/3 of one stage's whole-prompt time
    instead of 2x.  More chunks cut the fill / drain further but multiply the host's per-layer
    work, and ``coop``'s one host thread is then what bounds the forward: 8K Flash on 2x H200 at
    fcf8e57, interleaved forward by forward (tools/profile_prefill_host.py --chunks 3,4,5):
    3 chunks 936-938 ms every time (GPU-bound), 4 chunks 903-1117 ms (median 929: the host's
    speed comes in streaks on that machine), 5 chunks median 1042 ms.  The
    layers enqueue without host synchronisation (device router selection, index-ordered
    indexer top-k, device MoE dispatch), so a stage thread runs ahead of its GPU; what still
    waits per chunk: the last stage's logits readback (every chunk with ``all_logits``, else
    the last) and the queue hand-off.  ``N_CHUNKS`` / ``MIN_CHUNK`` are module constants a
    bench may set (read at each call).
``run_chunk_pipelined(model, state, ids, chunks, all_logits=False, ph="prefill") -> ForwardOut``
    The same result, BIT FOR BIT, as running the chunks one after another through the chunk
    routine (``run_chunk`` of chunk 0, then of chunk 1, ... on the same state): each stage runs
    the chunk routine's own per-stage body (``decode.run_stage``) on the same inputs, positions
    and caches in the same order, on the same stream.
    Only the schedule differs: one host thread per stage, so stage s runs chunk j while stage
    s + 1 runs chunk j - 1.  It is NOT bit-equal to one whole-prompt chunk (the GEMMs have
    another M, the attention another candidate tiling): bf16 class, as decode vs re-prefill.
    Not for captures or verify journals (those keep the plain routine).

Synchronisation: stage s records an event on its compute stream after chunk j; the thread of
stage s + 1 makes its own compute stream wait on that event and copies the streams over with
one peer ``memcpyAsync`` on its stream (``runtime.boundary_copy``: bracketed
``{ph}/boundary_copy``; one copy per chunk and boundary, where the plain routine makes one per
forward).  The source arrays stay referenced until the end of the forward, so the producer's
memory pool never hands them out while a copy may still read them.  Without peer access
between two stages the caller runs the plain routine (``pipeline_supported``).  An exception in
any stage thread stops the others at their next chunk and is re-raised in the caller.

``coop_schedule(n_stages, n_chunks, start) -> list[list]``
    The cooperative schedule, pure Python: ``start(s, j)`` returns stage s's step iterator of
    chunk j (a generator: each ``next`` is one step, its return value the chunk's result).
    Stage s starts chunk j only once its chunk j - 1 is done and stage s - 1 has done (enqueued)
    chunk j; then the stages take one step each in turn (0, 1, ..., 0, 1, ...; a stage with
    nothing startable is skipped).  A step that raises stops everything at once: the other
    started iterators are closed (no further step runs) and the error reaches the caller.
    Returns results[s][j].
``run_chunk_coop(model, state, ids, chunks, all_logits=False, ph="prefill") -> ForwardOut``
    Seam value ``coop``: the result of ``run_chunk_pipelined`` (and so of the chunks one after
    another), BIT FOR BIT, from ONE host thread.  Each (stage, chunk) is a generator over
    ``decode.stage_steps`` (run_stage's body, cut after the embedding and after every layer;
    each step makes the stage's device / compute stream current itself and closes every bracket
    it opens) driven by ``coop_schedule``: while the GPU of stage s + 1 runs chunk j, the one
    host thread enqueues stage s's chunk j + 1 layer by layer in between stage s + 1's layers.
    There is no GIL contention between stage threads (the threaded ``on`` measured slower with
    more chunks: two threads switching the GIL on ~6 ms of Python per layer and chunk), and
    the host work is the plain sum of the steps.  A stage's first step of chunk j (s > 0): its
    compute stream waits on the event stage s - 1 recorded after chunk j and one peer copy
    pulls the streams (``{ph}/boundary_copy``), as the threaded version does.  Brackets: no
    ``{ph}/stage{si}`` bracket spans a chunk (it could not: another stage's steps run in
    between, and NVTX ranges / the event brackets' open stack are per host thread); every step
    is bracketed ``{ph}/stage{si}`` instead (the report keeps its tree; that phase's calls count
    steps, its total is the sum of the steps' GPU spans).  The head reads nothing back until the
    end (one synchronisation of every device, then the logits / hc state copies), so with
    ``all_logits`` the chunks' device logits live until then.  Not for captures or journals.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from memra_dsv4.profiling import phase

__all__ = ["MIN_CHUNK", "N_CHUNKS", "coop_schedule", "pipeline_chunks", "pipeline_supported",
           "run_chunk_coop", "run_chunk_pipelined"]

MIN_CHUNK = 1024   # tokens: below this a chunk's GEMMs and host round trips dominate
N_CHUNKS = 3   # see the contract above: the steadiest 8K time measured (4 is faster only on a fast host)


def pipeline_chunks(S: int, n_stages: int) -> list[int] | None:
    S, n_stages = int(S), int(n_stages)
    if n_stages < 2 or S < 2 * MIN_CHUNK:
        return None
    n = min(N_CHUNKS, S // MIN_CHUNK)
    size = -(-S // n)
    size = -(-size // 64) * 64
    chunks = []
    left = S
    while left > 0:
        chunks.append(min(size, left))
        left -= chunks[-1]
    assert sum(chunks) == S and len(chunks) >= 2
    return chunks


def pipeline_supported(model) -> bool:
    """Peer access both ways between every pair of consecutive stages, and no forced bounce."""
    from memra_dsv4.gpu import runtime
    if model.force_bounce or len(model.stages) < 2:
        return False
    devs = [st.device for st in model.stages]
    return all(a == b or (runtime.peer_enabled(a, b) and runtime.peer_enabled(b, a))
               for a, b in zip(devs, devs[1:]))


def _ready_event(dev):
    """An event recorded on ``dev``'s compute stream (its device current): what the next stage
    waits on before it copies this stage's streams."""
    import cupy as cp
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(dev.compute)
    return ev


def _receive(dev, src, ready, paths: list):
    """The receiving stage's half of a boundary, on ``dev``'s compute stream (its device and
    stream current): wait for ``ready``, then copy ``src`` into a new array (peer copy or host
    bounce, runtime.boundary_copy; the path goes to ``paths``).  Returns the copy."""
    import cupy as cp
    from memra_dsv4.gpu import runtime
    dev.compute.wait_event(ready)
    streams = cp.empty(src.shape, dtype=src.dtype)
    paths.append(runtime.boundary_copy(streams, src, src.nbytes, dev.compute))
    return streams


class _Stop(Exception):
    """An upstream stage failed; this stage stops (the upstream error is the one re-raised)."""


def run_chunk_pipelined(model, state, ids: np.ndarray, chunks: list[int], *,
                        all_logits: bool = False, ph: str = "prefill"):
    import cupy as cp
    from memra_dsv4.gpu.decode import run_stage
    from memra_dsv4.oracle.model import ForwardOut

    n_st = len(model.stages)
    assert n_st >= 2 and sum(chunks) == ids.shape[0], (n_st, chunks, ids.shape)
    p0 = state.pos
    offs = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    last = len(chunks) - 1
    inbox = [queue.Queue() for _ in range(n_st)]   # inbox[s]: (streams, ready event) | None
    keep: list = []                                 # producer arrays a copy may still read
    out: dict = {"logits": []}
    errors: list[BaseException] = []
    paths: list[str] = []
    model.boundary_paths = paths
    model.clear_chunk_memo()   # keys carry the positions: the chunks' tables coexist

    def stage_thread(si: int) -> None:
        st = model.stages[si]
        dev = model.devs[st.device]
        try:
            with cp.cuda.Device(st.device), dev.compute:
                for j in range(len(chunks)):
                    if errors:
                        raise _Stop()
                    a, b = int(offs[j]), int(offs[j + 1])
                    streams = None
                    if si > 0:
                        item = inbox[si].get()
                        if item is None:
                            raise _Stop()
                        with phase(f"{ph}/boundary_copy"):
                            streams = _receive(dev, *item, paths)
                    head = all_logits or j == last
                    streams, logits, hc_state = run_stage(model, si, state, ids[a:b], p0 + a, streams,
                                                          ph=ph, head=head, all_logits=all_logits)
                    if st.has_head and head:
                        out["logits"].append(logits)
                        if j == last:
                            out["hc_state"] = hc_state
                    if si + 1 < n_st:
                        keep.append(streams)
                        inbox[si + 1].put((streams, _ready_event(dev)))
                dev.compute.synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            if not isinstance(e, _Stop):
                errors.append(e)
            if si + 1 < n_st:
                inbox[si + 1].put(None)

    threads = [threading.Thread(target=stage_thread, args=(si,), name=f"memra-prefill-stage{si}")
               for si in range(n_st)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for d in model.devs:
        d.compute.synchronize()
    keep.clear()
    state.pos = p0 + int(ids.shape[0])
    logits = np.concatenate(out["logits"], axis=0) if all_logits else out["logits"][-1]
    return ForwardOut(logits=logits, hc_state=out["hc_state"], streams=None, captures=None,
                      captures_top=None, numerics=model.numerics)


def coop_schedule(n_stages: int, n_chunks: int, start) -> list[list]:
    """Run every (stage, chunk) step iterator round-robin from this thread (module doc)."""
    n_stages, n_chunks = int(n_stages), int(n_chunks)
    done = [0] * n_stages                   # chunks each stage has finished (enqueued)
    active: list = [None] * n_stages        # the stage's running iterator, or None
    results: list[list] = [[None] * n_chunks for _ in range(n_stages)]
    try:
        while done[-1] < n_chunks:
            progressed = False
            for s in range(n_stages):
                it = active[s]
                if it is None:
                    j = done[s]
                    if j == n_chunks or (s > 0 and done[s - 1] <= j):
                        continue
                    it = active[s] = start(s, j)
                try:
                    next(it)
                except StopIteration as fin:
                    results[s][done[s]] = fin.value
                    done[s] += 1
                    active[s] = None
                progressed = True
            assert progressed, done   # stage 0 can always progress: a bug if not
    except BaseException:
        for it in active:
            if it is not None and hasattr(it, "close"):
                it.close()
        raise
    return results


def run_chunk_coop(model, state, ids: np.ndarray, chunks: list[int], *,
                   all_logits: bool = False, ph: str = "prefill"):
    import cupy as cp
    from memra_dsv4.gpu.decode import stage_steps
    from memra_dsv4.oracle.model import ForwardOut

    n_st = len(model.stages)
    assert n_st >= 2 and sum(chunks) == ids.shape[0], (n_st, chunks, ids.shape)
    p0 = state.pos
    offs = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    last = len(chunks) - 1
    handoff = [[None] * len(chunks) for _ in range(n_st)]   # [s][j]: (streams, ready event)
    keep: list = []                                          # producer arrays a copy may read
    out: dict = {"logits": []}                               # device arrays until the end
    paths: list[str] = []
    model.boundary_paths = paths
    model.clear_chunk_memo()   # keys carry the positions: the chunks' tables coexist

    def chunk_steps(si: int, j: int):
        st = model.stages[si]
        dev = model.devs[st.device]
        a, b = int(offs[j]), int(offs[j + 1])
        streams = None
        if si > 0:
            src, ready = handoff[si - 1][j]
            handoff[si - 1][j] = None
            with cp.cuda.Device(st.device), dev.compute, phase(f"{ph}/boundary_copy"):
                streams = _receive(dev, src, ready, paths)
            yield
        head = all_logits or j == last
        streams, logits, hc_state = yield from stage_steps(
            model, si, state, ids[a:b], p0 + a, streams, ph=ph, head=head,
            all_logits=all_logits, step_bracket=True, readback=False)
        if st.has_head and head:
            out["logits"].append(logits)
            if j == last:
                out["hc_state"] = hc_state
        if si + 1 < n_st:
            with cp.cuda.Device(st.device):
                ready = _ready_event(dev)
            keep.append(streams)
            handoff[si][j] = (streams, ready)

    try:
        coop_schedule(n_st, len(chunks), chunk_steps)
    except BaseException:
        # let the devices finish what was enqueued before the kept sources are let go
        for d in model.devs:
            try:
                d.compute.synchronize()
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
        raise
    for d in model.devs:
        d.compute.synchronize()
    keep.clear()
    state.pos = p0 + int(ids.shape[0])
    last_st = model.stages[-1]
    with cp.cuda.Device(last_st.device), model.devs[last_st.device].compute:
        rows = [cp.asnumpy(x) for x in out["logits"]]
        hc_state = cp.asnumpy(out["hc_state"])
    logits = np.concatenate(rows, axis=0) if all_logits else rows[-1]
    return ForwardOut(logits=logits, hc_state=hc_state, streams=None, captures=None,
                      captures_top=None, numerics=model.numerics)
