"""The MTP drafter on the GPU: the checkpoint's MTP block (``mtp.0``) run by the chunk routine's
block (gpu.decode.ChunkBlock) against its own window cache on the last stage's device.

Contract (the oracle's ``memra_dsv4.oracle.spec.MtpDrafter``, same arguments, same convention)
------------------------------------------------------------------------------------------------
``GpuMtpDrafter().begin(model, max_seq_len)``
    ``model``: a ``Dsv4Gpu`` loaded with ``drafter=True`` (refused otherwise, naming the fix).
    Allocates the MTP cache (a ``gpu.cache.DecodeState`` holding the one ratio-0 layer: the
    window ring, [W, head_dim] bf16 bits) and a scratch copy for the recursive drafts, both on
    the drafter stage's device, once per sequence; ``pos`` = 0.
``propose(hc_rows, next_tokens, k, sampler=None) -> (tokens int64 [k], logits float32 [k, V])``
    ``hc_rows`` [m, hc, dim]: the trunk's final (pre-hc_head) streams of positions P..P+m-1,
    P = ``self.state.pos`` (float32 CuPy, as ``Dsv4Gpu.prefill`` / ``verify`` return them with
    ``return_streams=True``, or NumPy); ``next_tokens`` [m]: the tokens of positions P+1..P+m.
    The m rows are history: one chunk through the MTP block, kept in the cache (pos += m); the
    last row's logits give draft 1.  For k > 1 the block is re-applied on the scratch copy of the
    cache (the vLLM convention the oracle follows): step j takes the block's own output streams
    of step j-1 and draft j-1.  ``sampler(logits NumPy [V]) -> id`` picks (default: the greedy
    argmax, oracle.sampling.greedy).  Checks (oracle.spec.check_propose_args, the same messages,
    plus finiteness) run before any device work; a refused call leaves the state as it was.

The block's input, as ``Oracle._mtp_input``: h0 = store(h_proj(hnorm(h)) + e_proj(enorm(embed)))
(rmsnorm per hc copy; both projections are the checkpoint's FP8 linears, bf16 or FP8-as-stored by
the dense seam, through the same ``_Block.lin`` GEMM as the trunk's); then ChunkBlock.forward (the
MTP block is a ratio-0 layer: window attention, MoE with learned routing); then the block's own
hc_head and norm and the trunk's head matrix (``Dsv4Gpu._head(prefix="mtp.0.")``).  Numeric class
bf16: the oracle's ``mtp_propose`` given the same hc rows is the reference, within the class's
bounds (tests/gpu/test_drafter_gpu.py).  Phases: ``draft/mtp/...``.

Host syncs: one per draft (the logits' readback, which the sampler needs before the next draft);
the embedding rows cross to the drafter's device through the host when the embedding lives on
another stage (m x dim float32, once per propose).  This path allocates per call (CuPy pool): it
is the drafter's correctness form, not a device-resident step.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import ops_glue as G
from memra_dsv4.oracle.sampling import greedy
from memra_dsv4.oracle.spec import check_propose_args
from memra_dsv4.profiling import phase

__all__ = ["GpuMtpDrafter", "embed_rows", "f32_on_device"]


def _cp():
    import cupy as cp
    return cp


def f32_on_device(model, x, device: int):
    """``x`` (CuPy or NumPy) as float32 CuPy on ``device`` (a copy only when needed): the
    drafters' input rows.  An upload goes on ``device``'s compute stream: on the caller's current
    stream (the legacy default one, unless they made another current) the non-blocking compute
    stream would not wait for it."""
    cp = _cp()
    if isinstance(x, cp.ndarray) and x.device.id == device:
        return x if x.dtype == cp.float32 else x.astype(cp.float32)
    host = cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)
    with cp.cuda.Device(device), model.devs[device].compute:
        return cp.asarray(np.ascontiguousarray(host, dtype=np.float32))


def embed_rows(model, ids: np.ndarray, device: int):
    """float32 [m, dim] embedding rows of ``ids`` on ``device`` (the embedding is on the first
    stage; across devices the rows go through the host: m x dim float32, a sync of stage 0's
    compute stream), made on ``device``'s compute stream, which reads them next."""
    cp = _cp()
    from memra_dsv4.gpu.model import _f32
    st0 = model.stages[0]
    with cp.cuda.Device(st0.device), model.devs[st0.device].compute:
        e = _f32(st0["embed.weight"][cp.asarray(ids)])
        if st0.device == device:
            return e
        host = cp.asnumpy(e)
    with cp.cuda.Device(device), model.devs[device].compute:
        return cp.asarray(host)


class GpuMtpDrafter:
    """The MTP block as a drafter on the GPU (module doc)."""

    name = "mtp"

    def __init__(self) -> None:
        self.model = None
        self.state = None
        self._scratch = None

    # ------------------------------------------------------------------ set-up
    def begin(self, model, max_seq_len: int | None = None) -> None:
        from memra_dsv4.gpu.cache import DecodeState
        from memra_dsv4.config import DRAFTER_MTP
        si = getattr(model, "drafter_stage", None)
        if si is None:
            raise ValueError("GpuMtpDrafter: the model holds no drafter; load it with "
                             "Dsv4Gpu.load(..., drafter=True) (or synthetic(..., drafter=True))")
        cfg = model.config
        if cfg.drafter_kind != DRAFTER_MTP:
            raise ValueError(f"GpuMtpDrafter: config {cfg.name!r} has drafter kind "
                             f"{cfg.drafter_kind!r}, not an MTP block (a DSpark checkpoint "
                             f"drafts with gpu.dspark.GpuDSparkDrafter)")
        st = model.stages[si]
        lid = st.drafter_layers[0]
        if cfg.compress_ratio(lid) != 0:   # config.py refuses this for every drafter stage
            raise AssertionError(f"MTP layer {lid}: compress ratio {cfg.compress_ratio(lid)}")
        msl = int(max_seq_len or model.max_seq_len)
        self.model, self.stage, self.lid = model, st, lid
        self.state = DecodeState(cfg, {lid: st.device}, msl)
        self._scratch = DecodeState(cfg, {lid: st.device}, msl)
        model.devs.order_after_current()   # the caches were zeroed on the current stream

    # ------------------------------------------------------------------ drafting
    def propose(self, hc_rows, next_tokens, k: int, sampler=None):
        cp = _cp()
        if self.model is None:
            raise ValueError("GpuMtpDrafter.propose before begin(model, max_seq_len)")
        cfg = self.model.config
        shape = tuple(hc_rows.shape)
        if len(shape) == 2:
            shape = (1,) + shape
        kind = np.dtype(hc_rows.dtype).kind
        ids = check_propose_args(cfg, self.state.pos, self.state.max_seq_len, shape, kind,
                                 next_tokens, k)
        h = self._on_device(hc_rows).reshape(shape)
        dev = self.model.devs[self.stage.device]
        with cp.cuda.Device(self.stage.device), dev.compute:
            if not bool(cp.isfinite(h).all()):
                raise ValueError("hc_rows contains non-finite values")
        pick = sampler if sampler is not None else greedy
        self.model.clear_chunk_memo()
        with phase("draft/mtp"):
            lg, out = self._chunk(self.state, h, ids)
            toks, rows = [int(pick(lg))], [lg]
            if k > 1:
                self._copy_state(self._scratch, self.state)
                hs = out[-1:]
                for _ in range(k - 1):
                    lg, o = self._chunk(self._scratch, hs, np.array([toks[-1]], np.int64))
                    toks.append(int(pick(lg)))
                    rows.append(lg)
                    hs = o[-1:]
        return np.array(toks, dtype=np.int64), np.stack(rows)

    def _on_device(self, x):
        """hc rows as float32 CuPy on the drafter's device."""
        return f32_on_device(self.model, x, self.stage.device)

    def _embed_rows(self, ids: np.ndarray):
        return embed_rows(self.model, ids, self.stage.device)

    def _chunk(self, state, h, ids: np.ndarray):
        """The MTP block over rows at positions state.pos..: (logits NumPy float32 [V] of the
        last row, output streams float32 CuPy [m, hc, dim]); state.pos += m."""
        cp = _cp()
        from memra_dsv4.gpu.decode import ChunkBlock
        from memra_dsv4.gpu.model import _f64
        model, st, cfg = self.model, self.stage, self.model.config
        eps = cfg.rms_norm_eps
        m = ids.shape[0]
        assert h.shape == (m, cfg.hc_mult, cfg.hidden_size) and h.dtype == cp.float32, h.shape
        e = self._embed_rows(ids)
        dev = model.devs[st.device]
        with cp.cuda.Device(st.device), dev.compute:
            blk = ChunkBlock(model, st, self.lid, "draft/mtp/block")
            b = blk.b
            with phase("draft/mtp/input"):
                en = G.rmsnorm(e, _f64(b.w("enorm.weight")), eps)              # [m, D]
                z = G.rmsnorm(G.store(h), _f64(b.w("hnorm.weight")), eps)      # [m, hc, D]
                ep = b.lin(en, "e_proj.weight")
                hp = b.lin(z, "h_proj.weight")
                h0 = G.store(hp + ep[:, None, :])
            out = blk.forward(h0, cp.asarray(ids), state.cache(self.lid), state.pos)
            with phase("draft/mtp/head"):
                logits, _, _ = model._head(st, out[-1:], prefix=f"{b.p}.")
                logits_h = cp.asnumpy(logits)   # the host wait: the sampler needs the row
        state.pos += m
        return logits_h, out

    def _copy_state(self, dst, src) -> None:
        """dst := src (the ring and pos; a ratio-0 layer has nothing else)."""
        cp = _cp()
        c_dst, c_src = dst.layers[0], src.layers[0]
        with cp.cuda.Device(c_src.device), self.model.devs[c_src.device].compute:
            c_dst.ring[...] = c_src.ring   # on the compute stream: ordered with the chunks
        dst.pos = src.pos
