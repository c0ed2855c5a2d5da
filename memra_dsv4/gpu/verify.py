"""Speculative verify and rollback on the GPU, with the oracle's convention
(memra_dsv4.oracle.decode: verify / commit) on the device ``DecodeState``.

``verify(model, state, [t_last, d1..dk], return_streams=False) -> logits [k+1, vocab]`` (float32
NumPy; with ``return_streams`` also the final streams of the k + 1 rows, float32 CuPy
[k+1, hc, dim] on the last stage: the MTP drafter's input; with ``taps`` (trunk layer ids) too,
those layers' output streams [k+1, n_taps, hc, dim] instead: the DSpark drafter's)
    Positions pos .. pos+k in ONE batched pass of the chunk routine (gpu.decode.run_chunk,
    phases ``verify/stage{i}/...``); row i predicts position pos+i+1.  Before a block writes
    its caches it records, per layer (``Journal``): the ring slots the chunk overwrites and
    their old rows, the chunk's own window vectors (bf16 bits, every position: k + 1 may exceed
    W, e.g. tiny's W = 8), copies of the compressor and indexer-compressor pending rows, and
    the chunk's projections (a, z) of both.  The state then refuses every call but ``commit``
    and ``prefill`` (which starts a new sequence).
``commit(model, state, n)``, 0 <= n <= k
    Keeps pos .. pos+n, rolls pos+n+1 .. pos+k back, in place (the device step's graphs keep
    the cache addresses): every overwritten ring slot gets the newest KEPT position's vector,
    else its old row; the pending rows are restored and the kept positions' projections
    replayed through the state machine (host.pending via PendingRows.advance: data movement
    only); compressed / indexer rows emitted by rolled-back positions are zeroed (the caches
    are position-addressed, row k = entry k, so they are invisible anyway).  Then
    state.pos = old pos + n + 1.  The bonus token is not in the state: feed it next.
Exactness: the rollback restores bytes (old rows, the verify's own vectors and projections),
so after commit(n) the state equals, array for array, a state that had run the first n + 1
rows of this verify's chunk.  Against n + 1 single-token decode steps it is equal within the
bf16 class only: the chunk's GEMMs run with M = k + 1 rows (cuBLASLt may pick another
algorithm / reduction order than for M = 1).
With ``model.verify_path == "device"`` (seam MEMRA_DSV4_VERIFY_PATH) and 2 <= k + 1 <=
gpu.verify_step.row_limit, the rows run through gpu.verify_step instead (the device step's
kernels, one graph per state / rows / taps; each row's logits are a device step's bytes, and
after commit(n) the caches are those of n + 1 device steps); its journal is a
gpu.verify_step.DeviceJournal and commit dispatches on it.
Bad calls (ValueError naming the problem, state unchanged): k outside 1..MAX_DRAFT, ids out of
range, positions past max_seq_len, a second verify or a decode while one is pending, commit
without a verify, n outside 0..k or not an integer.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.host.indices import ring_rollback_sources
# the call checks are the oracle's (same messages, same states' attributes)
from memra_dsv4.oracle.decode import (check_commit, check_draft_count, check_no_journal,
                                      check_room)
from memra_dsv4.profiling import phase

__all__ = ["Journal", "verify", "commit", "device_verify_of"]


class _LayerJournal:
    __slots__ = ("slots", "old_rows", "kv", "comp", "comp_az", "idx", "idx_az")


class Journal:
    """Per-layer rollback records of one verify (filled by the chunk routine's blocks)."""

    def __init__(self, p0: int, k: int):
        self.p0, self.k = int(p0), int(k)
        self.layers: dict[int, _LayerJournal] = {}

    def layer(self, layer_id: int) -> "_Recorder":
        return _Recorder(self, layer_id)


class _Recorder:
    """The ``journal`` a ChunkBlock sees: ``record(cache, pos, kv_bits, comp_az, idx_az)`` right
    before the block writes its caches (so the copies are the pre-chunk state)."""

    __slots__ = ("j", "lid")

    def __init__(self, j: Journal, lid: int):
        self.j, self.lid = j, lid

    def record(self, cache, pos: np.ndarray, kv_bits, comp_az, idx_az) -> None:
        import cupy as cp
        W = cache.window
        L = _LayerJournal()
        L.slots = np.unique(np.asarray(pos, dtype=np.int64) % W)
        L.old_rows = cache.ring[cp.asarray(L.slots)].copy()
        L.kv = kv_bits.copy()                                   # [k+1, hd] bf16 bits
        L.comp = L.comp_az = L.idx = L.idx_az = None
        if cache.ratio:
            L.comp = (cache.comp_state.kv.copy(), cache.comp_state.score.copy())
            L.comp_az = (comp_az[0].copy(), comp_az[1].copy())
        if idx_az is not None:
            L.idx = (cache.idx_state.kv.copy(), cache.idx_state.score.copy())
            L.idx_az = (idx_az[0].copy(), idx_az[1].copy())
        self.j.layers[self.lid] = L


def verify(model, state, tokens, return_streams: bool = False, taps=()):
    from memra_dsv4.gpu.decode import run_chunk
    model._check_state(state)
    check_no_journal(state, "verify")
    ids = model.check_ids(tokens)
    k = check_draft_count(ids)
    check_room(state, k + 1, "verify")
    if model._step is not None:
        model._step.invalidate()
    vs = device_verify_of(model, state, k + 1)
    if vs is not None:   # seam MEMRA_DSV4_VERIFY_PATH = device (gpu.verify_step)
        return vs.verify(state, ids, return_streams=return_streams, taps=taps)
    jr = Journal(state.pos, k)
    with phase("verify"):
        out = run_chunk(model, state, ids, all_logits=True, ph="verify", journal=jr,
                        keep_streams=return_streams, taps=taps)
    state.journal = jr
    return (out.logits, out.streams) if return_streams else out.logits


def _rollback_layer(cache, j: _LayerJournal, p0: int, last_kept: int, p_end: int, stream) -> None:
    import cupy as cp
    W = cache.window
    n_keep = last_kept - p0 + 1
    src = ring_rollback_sources(j.slots, p0, last_kept, W)   # the oracle's rule (host/)
    with cp.cuda.Device(cache.device), stream:  # the stage's compute stream: ordered with steps
        for i, (slot, q) in enumerate(zip(j.slots.tolist(), src.tolist())):
            cache.ring[slot] = j.kv[q] if q >= 0 else j.old_rows[i]
        if cache.ratio:
            st = cache.comp_state
            st.kv[...], st.score[...] = j.comp                # in place: graph addresses stay
            st.advance(j.comp_az[0][:n_keep], j.comp_az[1][:n_keep], p0)
            cache.comp[(last_kept + 1) // cache.ratio:p_end // cache.ratio] = 0
        if j.idx is not None:
            st = cache.idx_state
            st.kv[...], st.score[...] = j.idx
            st.advance(j.idx_az[0][:n_keep], j.idx_az[1][:n_keep], p0)
            cache.idx_keys[(last_kept + 1) // 4:p_end // 4] = 0


def device_verify_of(model, state, rows: int):
    """The model's VerifyStep (made at first use) when ``model.verify_path`` is "device" and it
    takes ``rows`` rows (gpu.verify_step.row_limit), else None (the chunk routine)."""
    from memra_dsv4.gpu.verify_step import VerifyStep, row_limit
    if getattr(model, "verify_path", "chunk") != "device" or not 2 <= rows <= row_limit(model.config):
        return None
    vs = getattr(model, "_verify_step", None)
    if vs is None or vs.msl != state.max_seq_len:
        vs = model._verify_step = VerifyStep(model, state.max_seq_len)
    return vs


def commit(model, state, n_accepted) -> None:
    from memra_dsv4.gpu.verify_step import DeviceJournal
    model._check_state(state)
    jr = state.journal
    n = check_commit(jr, n_accepted)
    last_kept = jr.p0 + n
    if isinstance(jr, DeviceJournal):   # a device verify (gpu.verify_step)
        with phase("verify/rollback"):
            model._verify_step.commit(state, jr, n)
        state.pos = last_kept + 1
        state.journal = None
        return
    if n < jr.k:
        with phase("verify/rollback"):
            for lid, j in jr.layers.items():
                c = state.cache(lid)
                _rollback_layer(c, j, jr.p0, last_kept, jr.p0 + jr.k + 1,
                                model.devs[c.device].compute)
        for d in model.devs:
            d.compute.synchronize()
    state.pos = last_kept + 1
    state.journal = None
