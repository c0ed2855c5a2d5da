"""Device decode state of the GPU path: one ``LayerCache`` per trunk layer, on the device of the
stage that owns the layer, plus the sequence position.

Reference: /work/shared/reference/dsv4_attention.md 7.1-7.4; the layout is the oracle's
(memra_dsv4/oracle/state.py) so the two states compare array for array by name
(``snapshot()`` uses the oracle's names).

Layout (all preallocated at construction; nothing grows afterwards)
--------------------------------------------------------------------
``ring``      bf16 bits (uint16) [W, head_dim]: ``ring[t % W] = k_t`` (post RoPE + KV FP8 sim).
``ring_copy`` bf16 bits [W, head_dim]: the device verify's pre-verify ring (its journal and
              its attention's shadow rows; not part of the state's contents).
``kv``        the one buffer [W + n_comp + W, head_dim] the three views share (ring, comp,
              ring_copy), so one attention launch indexes all of them.
``comp``      bf16 bits [max_seq_len // r, head_dim]: row k = compressed entry k; the first
              ``n_comp = pos // r`` rows are valid (ratio > 0 layers only).
``comp_kv`` / ``comp_score``   f32 [coff*r, coff*d]: the main compressor's pending rows in the
              oracle's canonical layout (ratio 4: rows [0, 4) the previous complete block,
              rows [4, 4 + pos % 4) the current block; ratio r: rows [0, pos % r)); every row
              that holds no token is (0, -inf).
``idx_keys``  bf16 bits [max_seq_len // 4, index_head_dim] (CSA only), ``n_idx = pos // 4``.
``idx_kv`` / ``idx_score``     f32 [8, 2 * index_head_dim] (CSA only), same layout.

Sequence start: ``DecodeState.reset()`` writes ring/comp/keys 0 and the pending rows (0, -inf)
on every layer and sets ``pos = 0``; every prefill calls it first, so the reference's
stale-row hazard (7.3: rows 0..3 of a reused state surviving a short prefill) cannot occur.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.host.pending import advance_pending

__all__ = ["PendingRows", "LayerCache", "DecodeState"]


class PendingRows:
    """One compressor's pending rows on the device (kv, score) f32 [coff*r, coff*d]."""

    def __init__(self, ratio: int, d: int):
        import cupy as cp
        self.ratio = int(ratio)
        self.overlap = self.ratio == 4
        coff = 2 if self.overlap else 1
        self.kv = cp.zeros((coff * self.ratio, coff * d), dtype=cp.float32)
        self.score = cp.full((coff * self.ratio, coff * d), -cp.inf, dtype=cp.float32)

    @property
    def cur_offset(self) -> int:
        return self.ratio if self.overlap else 0

    def reset(self) -> None:
        self.kv.fill(0)
        self.score.fill(-np.inf)

    def cur_rows(self, rem: int):
        o = self.cur_offset
        return self.kv[o:o + rem], self.score[o:o + rem]

    def prev_rows(self):
        r = self.ratio
        return self.kv[:r], self.score[:r]

    def advance(self, a, z, p0: int) -> None:
        """Feed the f32 projections (a, z) [S, coff*d] of positions p0..p0+S-1 (pure data
        movement, the oracle's CompressorState.advance)."""
        advance_pending(self.kv, self.score, a, z, p0, self.ratio)

    def nbytes(self) -> int:
        return int(self.kv.nbytes + self.score.nbytes)


class LayerCache:
    """Caches of one trunk layer on ``device`` (see the module doc)."""

    def __init__(self, cfg, layer_id: int, device: int, max_seq_len: int):
        import cupy as cp
        self.layer_id = int(layer_id)
        self.device = int(device)
        self.ratio = cfg.compress_ratio(layer_id)
        self.kind = cfg.attn_kind(layer_id)
        self.window = cfg.sliding_window
        hd, dI = cfg.head_dim, cfg.index_head_dim
        with cp.cuda.Device(self.device):
            # ring and compressed rows are views of ONE [W + n_comp, hd] buffer (fixed
            # addresses): the device step attends rows of it directly (window rows t % W,
            # compressed entry k at row W + k).
            # A third view, ``ring_copy`` (W rows after the compressed ones), is the device
            # verify's copy of the ring before its rows (gpu.verify_step): its commit restores
            # rolled-back slots from it, and its rows' attention reads a slot a later row
            # replaced from it (build_cand's shadow rows), in the same buffer the attention
            # indexes.  Nothing else reads or writes it.
            n_comp = max(1, max_seq_len // self.ratio) if self.ratio else 0
            W = self.window
            self.kv = cp.zeros((W + n_comp + W, hd), dtype=cp.uint16)
            self.ring = self.kv[:W]
            self.ring_copy = self.kv[W + n_comp:]
            self.shadow_row = W + n_comp   # ring_copy's first row in kv
            self.comp = self.comp_state = self.idx_keys = self.idx_state = None
            if self.ratio:
                self.comp = self.kv[W:W + n_comp]
                self.comp_state = PendingRows(self.ratio, hd)
            if self.kind == "csa":
                self.idx_keys = cp.zeros((max(1, max_seq_len // 4), dI), dtype=cp.uint16)
                self.idx_state = PendingRows(4, dI)

    def reset(self) -> None:
        import cupy as cp
        with cp.cuda.Device(self.device):
            self.ring.fill(0)
            for b in (self.comp, self.idx_keys):
                if b is not None:
                    b.fill(0)
            for s in (self.comp_state, self.idx_state):
                if s is not None:
                    s.reset()

    def nbytes(self) -> int:
        n = self.ring.nbytes
        for b in (self.comp, self.idx_keys):
            if b is not None:
                n += b.nbytes
        for s in (self.comp_state, self.idx_state):
            if s is not None:
                n += s.nbytes()
        return int(n)

    def snapshot(self, prefix: str, pos: int) -> dict[str, np.ndarray]:
        """Host copies under the oracle's names (valid rows only), values as float32."""
        import cupy as cp

        def f32(u16):
            return (cp.asnumpy(u16).astype(np.uint32) << 16).view(np.float32)

        with cp.cuda.Device(self.device):
            out = {f"{prefix}.ring": f32(self.ring)}
            if self.comp is not None:
                out[f"{prefix}.comp"] = f32(self.comp[:pos // self.ratio])
                out[f"{prefix}.comp_state.kv"] = cp.asnumpy(self.comp_state.kv)
                out[f"{prefix}.comp_state.score"] = cp.asnumpy(self.comp_state.score)
            if self.idx_keys is not None:
                out[f"{prefix}.idx_keys"] = f32(self.idx_keys[:pos // 4])
                out[f"{prefix}.idx_state.kv"] = cp.asnumpy(self.idx_state.kv)
                out[f"{prefix}.idx_state.score"] = cp.asnumpy(self.idx_state.score)
        return out


class DecodeState:
    """Per-sequence GPU decode state: ``layers`` (LayerCache per trunk layer, each on its
    stage's device), ``pos`` (positions processed), ``max_seq_len``.  Make it with
    ``Dsv4Gpu.new_state()``."""

    def __init__(self, config, layer_devices: dict[int, int], max_seq_len: int):
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) \
                or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.config = config
        self.max_seq_len = int(max_seq_len)
        self.layer_ids = tuple(sorted(layer_devices))
        self.layers = [LayerCache(config, lid, layer_devices[lid], self.max_seq_len)
                       for lid in self.layer_ids]
        self.pos = 0
        self.owner = None        # the Dsv4Gpu that made it (checked by its calls)
        self.journal = None      # an uncommitted verify (gpu.verify.Journal)

    def cache(self, layer_id: int) -> LayerCache:
        return self.layers[self.layer_ids.index(layer_id)]

    def reset(self) -> None:
        """Fresh sequence: position 0, rings/rows 0, pending rows (0, -inf)."""
        for c in self.layers:
            c.reset()
        self.pos = 0
        self.journal = None

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def snapshot(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"pos": np.asarray(self.pos)}
        for lid, c in zip(self.layer_ids, self.layers):
            out.update(c.snapshot(f"layer{lid}", self.pos))
        return out
