"""Decode state of the NumPy oracle: per-layer caches (window ring, compressed rows, compressor
pending rows, indexer keys) and the sequence position.

Reference: /work/shared/reference/dsv4_attention.md sections 4, 6, 7 (state machine M:279-377,
M:484-543), with the reset hazard of 7.3 made impossible and a canonical pending layout so two
states that processed the same tokens are equal array for array.

Layout (one ``LayerCache`` per trunk layer, or for the MTP block)
------------------------------------------------------------------
``ring`` [W, head_dim]        window ring, ``ring[t % W] = k_t`` (post RoPE + KV FP8 sim); the
                              slots of positions never written stay 0 (never read: the window
                              segment of position t only names positions max(0, t-W+1)..t).
``comp`` RowBuffer [n, hd]    main compressed entries, row k = entry k; n = pos // ratio.
``comp_state``                the main compressor's pending rows (``CompressorState``):
    ratio 4 (CSA, overlap)    kv / score [2r, 2d]: rows [0, r) = the previous COMPLETE block (the
                              block before the current one; 0 / -inf while the current block is
                              block 0), rows [r, r + pos % r) = the current block's tokens, rows
                              [r + pos % r, 2r) = 0 / -inf.
    ratio r (HCA)             kv / score [r, d]: rows [0, pos % r) = the current block's tokens,
                              the rest 0 / -inf.
                              ``score`` rows hold z + ape[t % r] (the gate score with its
                              position bias), kv rows the raw a_t, both fp32 (float64 exact).
``idx_keys`` RowBuffer        CSA only: indexer keys, row k = KI_k; n = pos // 4.
``idx_state``                 CSA only: the indexer compressor's pending rows (ratio-4 layout,
                              d = index_head_dim).

Unlike the reference (rows not written by a prefill keep stale values, M:325-336), rows that
hold no token of the current/previous block are ALWAYS (0, -inf): the pending rows are a pure
function of the tokens processed, every fresh or reset state starts from (0, -inf), and every
prefill resets the state first, so the stale-row hazard (7.3) cannot occur.

``DecodeState``: ``layers`` (one LayerCache per trunk layer), ``pos`` (number of positions
processed = the position of the next token), ``max_seq_len`` (positions >= it are refused),
``last_hc`` (the pre-hc_head streams [hc, dim] of position pos-1, the MTP drafter's input), and
the journal of an uncommitted ``verify`` (None otherwise).  ``snapshot()`` returns every array of
the state by name (valid rows only) for exact comparisons; ``diff(other)`` lists the differences.
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass, field

import numpy as np

from memra_dsv4.host.pending import advance_pending

__all__ = ["RowBuffer", "CompressorState", "LayerCache", "DecodeState", "DEFAULT_MAX_SEQ_LEN"]

DEFAULT_MAX_SEQ_LEN = 4096


class RowBuffer:
    """Append-only rows [n, width] with truncation (rolled-back rows are zeroed)."""

    def __init__(self, width: int, dtype, capacity: int = 16):
        self._a = np.zeros((max(1, capacity), width), dtype=dtype)
        self.n = 0

    @property
    def width(self) -> int:
        return self._a.shape[1]

    def view(self) -> np.ndarray:
        """The valid rows [n, width] (a read-only view)."""
        v = self._a[:self.n]
        v.setflags(write=False)
        return v

    def append(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        m = rows.shape[0]
        if m == 0:
            return
        need = self.n + m
        if need > self._a.shape[0]:
            cap = self._a.shape[0]
            while cap < need:
                cap *= 2
            a = np.zeros((cap, self._a.shape[1]), dtype=self._a.dtype)
            a[:self.n] = self._a[:self.n]
            self._a = a
        self._a[self.n:need] = rows
        self.n = need

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise ValueError(f"RowBuffer.truncate({n}) with {self.n} rows")
        self._a[n:self.n] = 0
        self.n = n

    def reset(self) -> None:
        self.truncate(0)


@dataclass
class CompressorState:
    """Pending rows of one compressor (see the module doc for the layout)."""
    ratio: int
    overlap: bool
    kv: np.ndarray      # [coff*r, coff*d]
    score: np.ndarray   # [coff*r, coff*d], -inf where no token

    @classmethod
    def fresh(cls, ratio: int, d: int, dtype) -> "CompressorState":
        overlap = ratio == 4
        coff = 2 if overlap else 1
        return cls(ratio, overlap, np.zeros((coff * ratio, coff * d), dtype=dtype),
                   np.full((coff * ratio, coff * d), -np.inf, dtype=dtype))

    def reset(self) -> None:
        self.kv[:] = 0
        self.score[:] = -np.inf

    def copy(self) -> "CompressorState":
        return CompressorState(self.ratio, self.overlap, self.kv.copy(), self.score.copy())

    @property
    def cur_offset(self) -> int:
        """First row of the current block's rows."""
        return self.ratio if self.overlap else 0

    def prev_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, z) [r, 2d] of the previous complete block (overlap only)."""
        r = self.ratio
        return self.kv[:r], self.score[:r]

    def cur_rows(self, rem: int) -> tuple[np.ndarray, np.ndarray]:
        """(a, z) [rem, coff*d] of the current block's first ``rem`` tokens."""
        o = self.cur_offset
        return self.kv[o:o + rem], self.score[o:o + rem]

    def advance(self, a: np.ndarray, z: np.ndarray, p0: int) -> None:
        """Feed the projections (a, z) [S, coff*d] of positions p0..p0+S-1 through the state
        machine (pure data movement: no arithmetic, so it is exact in every class).  Used by the
        forward (after pooling) and by a rollback (replaying the kept rows)."""
        advance_pending(self.kv, self.score, np.asarray(a), np.asarray(z), p0, self.ratio)


class LayerCache:
    """Caches of one attention layer (see the module doc)."""

    def __init__(self, cfg, layer_id: int, dtype):
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratio(layer_id)
        self.kind = cfg.attn_kind(layer_id)
        self.window = cfg.sliding_window
        self.dtype = dtype
        hd = cfg.head_dim
        self.ring = np.zeros((self.window, hd), dtype=dtype)
        self.comp = RowBuffer(hd, dtype) if self.ratio else None
        self.comp_state = CompressorState.fresh(self.ratio, hd, dtype) if self.ratio else None
        csa = self.kind == "csa"
        self.idx_keys = RowBuffer(cfg.index_head_dim, dtype) if csa else None
        self.idx_state = CompressorState.fresh(4, cfg.index_head_dim, dtype) if csa else None

    def reset(self) -> None:
        self.ring[:] = 0
        for b in (self.comp, self.idx_keys):
            if b is not None:
                b.reset()
        for s in (self.comp_state, self.idx_state):
            if s is not None:
                s.reset()

    def snapshot(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}.ring": self.ring.copy()}
        if self.comp is not None:
            out[f"{prefix}.comp"] = self.comp.view().copy()
            out[f"{prefix}.comp_state.kv"] = self.comp_state.kv.copy()
            out[f"{prefix}.comp_state.score"] = self.comp_state.score.copy()
        if self.idx_keys is not None:
            out[f"{prefix}.idx_keys"] = self.idx_keys.view().copy()
            out[f"{prefix}.idx_state.kv"] = self.idx_state.kv.copy()
            out[f"{prefix}.idx_state.score"] = self.idx_state.score.copy()
        return out


@dataclass(eq=False)
class DecodeState:
    """Per-sequence state of the oracle's decode (see the module doc).  Create it with
    ``Oracle.new_state()`` (or ``Oracle.new_mtp_state()`` for the MTP drafter's cache)."""
    config: object
    numerics: str
    dtype: type
    layer_ids: tuple[int, ...]
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    pos: int = 0
    layers: list[LayerCache] = field(default_factory=list)
    last_hc: np.ndarray | None = None
    journal: object | None = None       # an uncommitted verify (memra_dsv4.oracle.decode)
    role: str = "trunk"                 # "trunk" or "mtp"

    @classmethod
    def create(cls, cfg, numerics: str, dtype, layer_ids, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
               role: str = "trunk") -> "DecodeState":
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) \
                or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        ids = tuple(int(i) for i in layer_ids)
        return cls(config=cfg, numerics=numerics, dtype=dtype, layer_ids=ids,
                   max_seq_len=int(max_seq_len),
                   layers=[LayerCache(cfg, i, dtype) for i in ids], role=role)

    def reset(self) -> None:
        """Back to the fresh state (position 0, rings 0, no entries, pending rows 0 / -inf)."""
        for c in self.layers:
            c.reset()
        self.pos = 0
        self.last_hc = None
        self.journal = None

    def copy(self) -> "DecodeState":
        """A deep copy (the config object is shared, not copied)."""
        return _copy.deepcopy(self, memo={id(self.config): self.config})

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every array of the state by name (valid rows only), plus pos and last_hc."""
        out: dict[str, np.ndarray] = {"pos": np.asarray(self.pos)}
        for lid, c in zip(self.layer_ids, self.layers):
            out.update(c.snapshot(f"layer{lid}"))
        out["last_hc"] = (np.zeros(0) if self.last_hc is None else self.last_hc.copy())
        out["journal"] = np.asarray(self.journal is not None)
        return out

    def diff(self, other: "DecodeState") -> list[str]:
        """Names of the arrays that differ (shape, dtype or any bit; NaN-free -inf aware)."""
        a, b = self.snapshot(), other.snapshot()
        bad = sorted(set(a) ^ set(b))
        for k in sorted(set(a) & set(b)):
            x, y = a[k], b[k]
            if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
                bad.append(k)
        return bad

    def equals(self, other: "DecodeState") -> bool:
        return not self.diff(other)
