"""KV compressor ops (kernels_cu/compressor.cu).

add_ape(z, ape, pos)                   twin: the ``+ ape[pos % r]`` of oracle.ops.compressor_project
pool_overlap(kv, score, n_entries)     twin oracle.ops.compress_pool(*compress_candidates(.., 4))
pool_plain(kv, score, ratio, n)        twin oracle.ops.compress_pool(*compress_candidates(.., r))
norm_rope_sim(x, w, eps, cos, sin, pos, mode)
                                       twin oracle.ops.compress_entry_postprocess (f32 input), or
                                       kv_sim(rope(rmsnorm(x))) of the main KV path (bf16 input)

Decode uses the same kernels on the pending state: pool_overlap(state_kv[4:8], state_score[4:8],
1, prev_kv=state_kv[0:4], prev_score=state_score[0:4]); pool_plain(state_kv, state_score, r, 1).

emit(pos, kv, score, ratio, overlap, weight, eps, cos, sin, mode, out)
                                       the device step's emission chain in ONE launch
                                       (compress_emit_*): byte-for-byte pool_overlap / pool_plain
                                       (emit_gate) + norm_rope_sim(row="entry", rope position
                                       pos + 1 - r) + ops_decode.pending_advance; a no-op unless
                                       (pos + 1) % r == 0.

The chunk routine's rmsnorm (+ RoPE), bit-identical to the CuPy chain of ops_glue (which stays
the reference): chain_squares(x) -> cupy.mean(., axis=-1) -> chain_rms_rope(x, mean, ...);
ops_glue.rmsnorm_rope_bits does the three.
"""

from __future__ import annotations

import numpy as np

from memra_dsv4.gpu import kernel_loader
from memra_dsv4.gpu.ops._common import check, grid_stride_blocks, i32, kernel, null_or, out_array, row_stride

STEM = "compressor"
KERNELS = ("compress_add_ape", "compress_pool_overlap", "compress_pool_plain",
           "norm_rope_fp8_d512_f32in", "norm_rope_fp8_d512_bf16in", "norm_rope_fp8_d128_f32in",
           "norm_rope_fp8_d128_bf16in", "norm_rope_hadfp4_d128_f32in", "norm_rope_hadfp4_d128_bf16in",
           "compress_emit_fp8_d512", "compress_emit_fp8_d128", "compress_emit_hadfp4_d128",
           "compress_emit_rows_fp8_d512", "compress_emit_rows_fp8_d128", "compress_emit_rows_hadfp4_d128",
           "chain_sq", "chain_rms_rope")
kernel_loader.register(STEM, KERNELS)


def add_ape(z, ape, pos):
    """z [T, C] f32 in place: z[t] = f32(z[t] + ape[pos[t] % r]); ape [r, C] f32; pos [T] int32."""
    check(z, "add_ape.z", np.float32)
    T, C = z.shape
    check(ape, "add_ape.ape", np.float32, (None, C))
    check(pos, "add_ape.pos", np.int32, (T,))
    if T * C:
        kernel(STEM, "compress_add_ape")((grid_stride_blocks(T * C),), (256,),
                                         (z, ape, pos, i32(T), i32(C), i32(ape.shape[0])))
    return z


def _gate(emit_gate, n: int = 1):
    """(gate_pos pointer, gate_r) kernel arguments of an emit gate (pos int32 [n], r) or None
    (n > 1: norm_rope_sim's ring rows only)."""
    if emit_gate is None:
        return np.uint64(0), i32(1)
    pos, r = emit_gate
    check(pos, "emit_gate.pos", np.int32, (n,))
    assert int(r) >= 1, f"emit_gate: ratio {r}"
    return pos, i32(r)


def pool_overlap(kv, score, n_entries: int, out=None, prev_kv=None, prev_score=None,
                 emit_gate=None):
    """Ratio-4 overlap pooling.  kv, score: [>= 4*n_entries, 2d] f32 rows (last axis contiguous;
    score already includes ape); prev_kv/prev_score: [4, >= 2d] f32 rows of the previous block
    (pending rows 0..3) or None for block 0 of a sequence.  -> out [n_entries, d] f32.
    emit_gate (pos int32 [1], r): decode; the kernel does nothing unless (pos + 1) % r == 0."""
    check(kv, "pool_overlap.kv", np.float32, rows_strided=True)
    check(score, "pool_overlap.score", np.float32, kv.shape, rows_strided=True)
    assert row_stride(kv) == row_stride(score), "pool_overlap: kv and score row strides differ"
    d = kv.shape[1] // 2
    assert kv.shape[0] >= 4 * n_entries, f"pool_overlap: {kv.shape[0]} rows < 4 * {n_entries}"
    if out is None:
        out = out_array(None, "pool_overlap.out", (n_entries, d), np.float32)
    check(out, "pool_overlap.out", np.float32, (n_entries, d), rows_strided=True)
    ld_prev = 0
    if prev_kv is not None:
        check(prev_kv, "pool_overlap.prev_kv", np.float32, rows_strided=True)
        check(prev_score, "pool_overlap.prev_score", np.float32, prev_kv.shape, rows_strided=True)
        assert prev_kv.shape[0] >= 4 and prev_kv.shape[1] >= d, f"pool_overlap.prev_kv: shape {prev_kv.shape}"
        assert row_stride(prev_kv) == row_stride(prev_score), "pool_overlap: prev row strides differ"
        ld_prev = row_stride(prev_kv)
    if n_entries and d:
        kernel(STEM, "compress_pool_overlap")(
            ((d + 127) // 128, n_entries), (128,),
            (kv, score, i32(row_stride(kv)), null_or(prev_kv), null_or(prev_score), i32(ld_prev),
             out, i32(row_stride(out)), i32(d), *_gate(emit_gate)))
    return out


def pool_plain(kv, score, ratio: int, n_entries: int, out=None, emit_gate=None):
    """Non-overlap pooling (any ratio != 4): entry k pools rows k*r .. k*r + r - 1.
    kv, score: [>= r*n_entries, >= d] f32 rows (d = kv.shape[1]); -> out [n_entries, d] f32.
    emit_gate as in pool_overlap."""
    check(kv, "pool_plain.kv", np.float32, rows_strided=True)
    check(score, "pool_plain.score", np.float32, kv.shape, rows_strided=True)
    assert row_stride(kv) == row_stride(score), "pool_plain: kv and score row strides differ"
    d = kv.shape[1]
    assert kv.shape[0] >= ratio * n_entries, f"pool_plain: {kv.shape[0]} rows < {ratio} * {n_entries}"
    if out is None:
        out = out_array(None, "pool_plain.out", (n_entries, d), np.float32)
    check(out, "pool_plain.out", np.float32, (n_entries, d), rows_strided=True)
    if n_entries and d:
        kernel(STEM, "compress_pool_plain")(((d + 127) // 128, n_entries), (128,),
                                            (kv, score, i32(row_stride(kv)), out, i32(row_stride(out)),
                                             i32(d), i32(ratio), *_gate(emit_gate)))
    return out


_NRS = {(512, "fp8", True): ("norm_rope_fp8_d512_f32in", 64),
        (512, "fp8", False): ("norm_rope_fp8_d512_bf16in", 64),
        (128, "fp8", True): ("norm_rope_fp8_d128_f32in", 32),
        (128, "fp8", False): ("norm_rope_fp8_d128_bf16in", 32),
        (128, "hadfp4", True): ("norm_rope_hadfp4_d128_f32in", 32),
        (128, "hadfp4", False): ("norm_rope_hadfp4_d128_bf16in", 32)}


_ROW_MODES = {"gate": 0, "entry": 1, "ring": 2}


def norm_rope_sim(x, weight, eps: float, cos, sin, pos, mode: str = "fp8", out=None,
                  emit_gate=None, row: str = "gate"):
    """Per row: v = bf16(x) (f32 x) | x (bf16 x); y = rmsnorm(v, weight, eps); RoPE(pos[row]) on the
    last R = 2*cos.shape[1] dims; then mode 'fp8' = FP8 sim of dims [0, D-R) (block 64) or
    'hadfp4' = Hadamard-128 + FP4 sim (block 32).  x: [n, D] float32 or bf16 (last axis
    contiguous); weight [D] f32; pos [n] int32; out [n, D] bf16 rows (may be a strided cache view).
    emit_gate (pos int32 [1], r), decode only (n == 1), places the row by ``row``:
    "gate": nothing happens unless (pos + 1) % r == 0, else out [1, D];
    "entry": the same gate, ``out`` is the compressed cache [N, D], the row goes to
    (pos + 1) // r - 1 (nothing past N); "ring": no gate, ``out`` is the ring [r, D], the row goes
    to pos % r.  "ring" takes n rows too (the device verify's T kv rows; emit_gate's pos int32
    [n]): row b goes to pos[b] % r, each row the bytes of its one-row launch (distinct slots:
    the caller's n <= r consecutive positions)."""
    assert x.ndim == 2 and x.dtype in (np.float32, np.uint16), f"norm_rope_sim.x: {x.shape} {x.dtype}"
    check(x, "norm_rope_sim.x", x.dtype, rows_strided=True)
    n, D = x.shape
    key = (D, mode, x.dtype == np.float32)
    assert key in _NRS, f"norm_rope_sim: D = {D}, mode {mode!r} unsupported (have {sorted(_NRS)})"
    name, threads = _NRS[key]
    check(weight, "norm_rope_sim.weight", np.float32, (D,))
    check(pos, "norm_rope_sim.pos", np.int32, (n,))
    check(cos, "norm_rope_sim.cos", np.float32)
    check(sin, "norm_rope_sim.sin", np.float32, cos.shape)
    R = 2 * cos.shape[1]
    assert R % 8 == 0 and (mode != "fp8" or (D - R) % 64 == 0), f"norm_rope_sim: rope dims {R} unsupported"
    assert row in _ROW_MODES, f"norm_rope_sim: row {row!r} (expected {sorted(_ROW_MODES)})"
    n_rows = 0
    if row != "gate":
        assert emit_gate is not None and (n == 1 or row == "ring"), (
            f"norm_rope_sim: row={row!r} needs emit_gate, one row")
        check(out, "norm_rope_sim.out", np.uint16, (None, D), rows_strided=True)
        n_rows = out.shape[0]
        assert row != "ring" or n_rows == int(emit_gate[1]), (
            f"norm_rope_sim: ring of {n_rows} rows, emit_gate r = {emit_gate[1]}")
    else:
        if out is None:
            out = out_array(None, "norm_rope_sim.out", (n, D), np.uint16)
        check(out, "norm_rope_sim.out", np.uint16, (n, D), rows_strided=True)
    if n:
        kernel(STEM, name)((n,), (threads,), (x, i32(row_stride(x)), weight, np.float64(eps), cos, sin, pos,
                                              i32(R), out, i32(row_stride(out)),
                                              *_gate(emit_gate, n if row == "ring" else 1),
                                              i32(_ROW_MODES[row]), i32(n_rows)))
    return out


_EMIT = {(512, "fp8"): "compress_emit_fp8_d512", (128, "fp8"): "compress_emit_fp8_d128",
         (128, "hadfp4"): "compress_emit_hadfp4_d128"}


def _emit_operands(who: str, kernels: dict, kv, score, ratio: int, overlap: bool, weight, cos, sin,
                   mode: str):
    """The pending rows, norm weight and RoPE tables emit and emit_rows check alike; returns
    (r, C, d, R): the ratio, the pending row width, the pooled width, the RoPE dims."""
    check(kv, f"{who}.kv", np.float32)
    check(score, f"{who}.score", np.float32, kv.shape)
    assert kv.ndim == 2, f"{who}.kv: expected [rows, C], got {kv.shape}"
    r, C = int(ratio), kv.shape[1]
    assert kv.shape[0] == (2 if overlap else 1) * r, (
        f"{who}: {kv.shape[0]} pending rows, expected {(2 if overlap else 1) * r} "
        f"(ratio {r}, overlap {overlap})")
    assert not overlap or r == 4, f"{who}: overlap pooling is ratio 4, got {r}"
    d = C // 2 if overlap else C
    assert not overlap or C == 2 * d, f"{who}: overlap rows must be 2d wide, got {C}"
    key = (d, mode)
    assert key in kernels, f"{who}: d = {d}, mode {mode!r} unsupported (have {sorted(kernels)})"
    check(weight, f"{who}.weight", np.float32, (d,))
    check(cos, f"{who}.cos", np.float32)
    check(sin, f"{who}.sin", np.float32, cos.shape)
    R = 2 * cos.shape[1]
    assert R % 8 == 0 and R <= d and (mode != "fp8" or (d - R) % 64 == 0), f"{who}: rope dims {R} unsupported"
    return r, C, d, R


def emit(pos, kv, score, ratio: int, overlap: bool, weight, eps: float, cos, sin, mode: str, out,
         incoming=None):
    """Decode emission of one compressor (one launch, graph-safe: reads pos on the device).
    pos int32 [1]; kv, score: the pending rows f32 [(2 if overlap else 1) * ratio, C], contiguous
    (overlap: ratio 4, C = 2d; else C = d), read and then advanced in place; weight [d] f32 norm
    weight; cos, sin [n_pos, R/2] f32; out: the compressed cache [N, d] bf16 rows (row-strided
    view).  When (pos + 1) % ratio == 0: entry (pos + 1) // ratio - 1 (if < N) = norm_rope_sim of
    the pooled pending rows at rope position pos + 1 - ratio, and the pending rows advance
    (CompressorState.advance); otherwise nothing is touched.  The same bytes as
    pool_* (emit_gate) -> norm_rope_sim(row="entry") -> ops_decode.pending_advance.
    ``incoming`` = (kv_in, score_in), f32 [C] each (the device verify's staging rows of this
    position, gemv_bf16_multi_rows): first written into pending row pos % ratio (+ ratio when
    overlapping), the row the step's gemv_bf16_multi epilogue writes; then the above."""
    check(pos, "compress.emit.pos", np.int32, (1,))
    r, C, d, R = _emit_operands("compress.emit", _EMIT, kv, score, ratio, overlap, weight, cos, sin, mode)
    check(out, "compress.emit.out", np.uint16, (None, d), rows_strided=True)
    kv_in = score_in = np.uint64(0)
    if incoming is not None:
        assert isinstance(incoming, tuple) and len(incoming) == 2, "compress.emit.incoming: expected (kv_in, score_in)"
        kv_in, score_in = incoming
        check(kv_in, "compress.emit.incoming.kv", np.float32, (C,))
        check(score_in, "compress.emit.incoming.score", np.float32, (C,))
    kernel(STEM, _EMIT[(d, mode)])((1,), (d,), (pos, i32(r), i32(int(overlap)), kv, score, kv_in, score_in,
                                          weight, np.float64(eps), cos, sin, i32(R), out,
                                          i32(row_stride(out)), i32(out.shape[0])))
    return out


_EMIT_ROWS = {key: name.replace("compress_emit_", "compress_emit_rows_") for key, name in _EMIT.items()}


def emit_rows(pos, kv, score, ratio: int, overlap: bool, weight, eps: float, cos, sin, mode: str, out,
              incoming):
    """The device verify's T rows through one compressor in one launch (compress_emit_rows_*):
    for t = 0..T-1, in position order, exactly emit(pos[t], ..., incoming=(kv_in[t],
    score_in[t])): the row's values into pending row pos[t] % ratio (+ ratio overlapping), then
    the emission when pos[t] closes a block.  pos int32 [T] (ascending positions); incoming =
    (kv_in, score_in) f32 [T', C] (T' >= T rows, contiguous; row t used); the rest as emit."""
    check(pos, "compress.emit_rows.pos", np.int32)
    assert pos.ndim == 1 and 1 <= pos.shape[0], f"compress.emit_rows.pos: expected [T >= 1], got {pos.shape}"
    T = int(pos.shape[0])
    r, C, d, R = _emit_operands("compress.emit_rows", _EMIT_ROWS, kv, score, ratio, overlap, weight, cos, sin,
                                mode)
    check(out, "compress.emit_rows.out", np.uint16, (None, d), rows_strided=True)
    assert isinstance(incoming, tuple) and len(incoming) == 2, "compress.emit_rows.incoming: expected (kv_in, score_in)"
    kv_in, score_in = incoming
    check(kv_in, "compress.emit_rows.incoming.kv", np.float32, (None, C))
    check(score_in, "compress.emit_rows.incoming.score", np.float32, kv_in.shape)
    assert kv_in.shape[0] >= T, f"compress.emit_rows.incoming: {kv_in.shape[0]} rows < {T} positions"
    kernel(STEM, _EMIT_ROWS[(d, mode)])((1,), (d,), (pos, i32(T), i32(r), i32(int(overlap)), kv, score, kv_in,
                                               score_in, i32(C), weight, np.float64(eps), cos, sin, i32(R),
                                               out, i32(row_stride(out)), i32(out.shape[0])))
    return out


def chain_squares(x, pre_store: bool = False, out=None):
    """f64 [n, D] contiguous: (double)v * (double)v of v = x (f32 [n, D], last axis contiguous) or
    ops_glue.store(x) with ``pre_store``: the array ops_glue.rmsnorm takes cupy.mean of."""
    check(x, "chain_squares.x", np.float32, rows_strided=True)
    n, D = x.shape
    out = out_array(out, "chain_squares.out", (n, D), np.float64)
    if n * D:
        kernel(STEM, "chain_sq")((grid_stride_blocks(n * D),), (256,),
                                 (x, i32(row_stride(x)), i32(int(pre_store)), out, i32(n), i32(D)))
    return out


def chain_rms_rope(x, mean, weight, eps: float, cos=None, sin=None, pre_store: bool = False,
                   out=None):
    """bf16 bits [n, D] of ops_glue.rope(ops_glue.rmsnorm(v, weight, eps), cos, sin) (no RoPE
    when cos is None), v = x or store(x) with ``pre_store``, given mean = cupy.mean of
    chain_squares(x, pre_store) over the last axis (f64, n values).  x f32 [n, D] (last axis
    contiguous); weight [D] bf16 bits; cos/sin f32 [n, P] (row t's angles)."""
    check(x, "chain_rms_rope.x", np.float32, rows_strided=True)
    n, D = x.shape
    assert D % 2 == 0, f"chain_rms_rope: odd width {D}"
    check(mean, "chain_rms_rope.mean", np.float64)   # [n] or cupy.mean's [n, 1]
    mean = mean.reshape(-1)   # a contiguous float64 view: only its shape is left to check
    assert mean.shape == (n,), f"chain_rms_rope.mean: shape {mean.shape}, expected {(n,)}"
    check(weight, "chain_rms_rope.weight", np.uint16, (D,))
    if cos is None:
        P = 0
        cos = sin = mean   # not read (P = 0): any device pointer
    else:
        P = cos.shape[-1]
        check(cos, "chain_rms_rope.cos", np.float32, (n, P))
        check(sin, "chain_rms_rope.sin", np.float32, (n, P))
        assert 2 * P <= D, f"chain_rms_rope: {2 * P} rope dims > width {D}"
    if out is None:   # made here: not checked again
        out = out_array(None, "chain_rms_rope.out", (n, D), np.uint16)
    else:
        check(out, "chain_rms_rope.out", np.uint16, (n, D), rows_strided=True)
    if n * D:
        kernel(STEM, "chain_rms_rope")(
            (grid_stride_blocks(n * D // 2),), (256,),
            (x, i32(row_stride(x)), i32(int(pre_store)), mean, weight, np.float64(eps), cos, sin,
             i32(P), out, i32(row_stride(out)), i32(n), i32(D)))
    return out


def twin_chain_rms_rope(x, w_bits, eps: float, cos=None, sin=None, pre_store: bool = False):
    """NumPy twin of chain_squares -> mean -> chain_rms_rope (bf16 bits [n, D]), a literal
    transcription of the kernel's per-element steps; the row mean is np.mean's (the GPU path
    takes cupy.mean's: the chain's).  tests/test_hostlean_cpu.py holds it to the oracle's
    apply_rope(rmsnorm(.)) bit for bit."""
    x = np.asarray(x, dtype=np.float32)

    def rne(f):   # ops_glue._RNE on f32 -> bits
        u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def bits_f32(b):
        return (b.astype(np.uint32) << 16).view(np.float32)

    v = bits_f32(rne(x)) if pre_store else x
    v64 = v.astype(np.float64)
    mean = np.mean(v64 * v64, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(mean + eps)
    w64 = bits_f32(np.asarray(w_bits, dtype=np.uint16)).astype(np.float64)
    y = bits_f32(rne((w64 * (v64 * r)).astype(np.float32)))
    if cos is not None:
        P = np.asarray(cos).shape[-1]
        D = x.shape[-1]
        a = y[:, D - 2 * P::2].astype(np.float64)
        b = y[:, D - 2 * P + 1::2].astype(np.float64)
        c = np.asarray(cos, dtype=np.float32).astype(np.float64)
        s = np.asarray(sin, dtype=np.float32).astype(np.float64)
        y = y.copy()
        y[:, D - 2 * P::2] = (a * c - b * s).astype(np.float32)
        y[:, D - 2 * P + 1::2] = (a * s + b * c).astype(np.float32)
    return rne(y)
