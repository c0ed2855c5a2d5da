"""The prefill chunk routine without host synchronisation inside its layers.

* router: ``_Block.route`` "kernel" (gpu.ops.router.select) against the CuPy chain it replaced
  (ops_glue.sqrtsoftplus, route_learned = cupy.sort, route_weights) on random logits with exact
  ties: from the SAME scores the ids and weights are bit-identical (the chain run on select's
  scores); the scores differ from the chain's by <= SCORES_MAX_ULP f32 ulp (double exp / log1p
  rounded to f32 in the kernel, expf / log1pf in CuPy), so on the chain's own scores an id may
  differ only at a near tie (<= TIE_ULP of the biased scores).  Hash layers: ids = tid2eid.
* candidates: the indexer's top-k in ascending index order + candidates(ascending=True) equal
  the score-order top-k + the sorting candidates() bit for bit; likewise the HCA matrix.
* no host synchronisation: with the compute stream held by a gate kernel (spinning on a pinned
  host flag), the host must enqueue a whole stage's layers (tiny) and a boundary copy (2 GPUs)
  before the gate opens.  Negative control: a stream synchronize injected into the layers blocks.
"""
from __future__ import annotations

import sys
import threading
import traceback

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from memra_dsv4.gpu.ops.testing import fresh_seed, rng_for, ulp_dist_f32  # noqa: E402

pytestmark = pytest.mark.gpu

SCORES_MAX_ULP = 2
TIE_ULP = 8
ENQUEUE_S = 30.0     # the host's time to enqueue tiny's layers while the GPU is held
CONTROL_S = 5.0      # the negative control: how long to wait before opening the gate


class _Route:
    """A _Block stand-in with what _Block.route reads."""

    def __init__(self, E, k, hashed, bias, tid2eid, mode):
        from memra_dsv4.gpu.model import _Block
        self.route = _Block.route.__get__(self)
        self._tid2eid32 = lambda: cp.ascontiguousarray(tid2eid.astype(cp.int32))
        self.prefill_router = mode
        self.lid = 0
        self._w = {"ffn.gate.bias": bias, "ffn.gate.tid2eid": tid2eid}

        class Cfg:
            num_experts_per_tok = k
            routed_scaling_factor = 1.5

            @staticmethod
            def is_hash_layer(i):
                return hashed
        self.cfg = Cfg

    def w(self, leaf):
        return self._w[leaf]


def _logits_with_ties(rng, T, E):
    x = rng.standard_normal((T, E)).astype(np.float32) * 2
    x[:, E // 2:E // 2 + 3] = x[:, 1:2]                      # equal logits in a row
    x[T // 2:] = np.round(x[T // 2:] * 4) / 4                 # coarse grid: many exact ties
    x[0, :] = 0.5                                             # a row of equal scores
    x[1, :4] = 25.0                                           # the softplus threshold branch
    return x


@pytest.mark.parametrize("T,E,k", [(64, 8, 2), (200, 16, 4), (333, 256, 6), (7, 384, 8)])
def test_router_kernel_equals_cupy_chain(T, E, k):
    from memra_dsv4.gpu import ops_glue as G
    seed = fresh_seed()
    rng = rng_for(seed)
    logits = cp.asarray(_logits_with_ties(rng, T, E))
    bias = cp.asarray((np.round(rng.standard_normal(E) * 8) / 256).astype(np.float32))
    new = _Route(E, k, False, bias, None, "kernel")
    old = _Route(E, k, False, bias, None, "cupy")
    idx, wts, sc = new.route(logits, None, want_scores=True)
    assert idx.dtype == cp.int32 and wts.dtype == cp.float32 and sc.dtype == cp.float32
    idx_o, wts_o, sc_o = old.route(logits, None, want_scores=True)
    assert idx_o.dtype == cp.int64
    d = ulp_dist_f32(sc.get(), sc_o.get())
    assert d.max() <= SCORES_MAX_ULP, f"scores differ by {d.max()} ulp [seed={seed}]"
    # the same scores -> the same ids and weights, bit for bit
    idx_s = G.route_learned(sc, bias, k)
    np.testing.assert_array_equal(idx.get().astype(np.int64), idx_s.get(), err_msg=f"seed={seed}")
    w_s = G.route_weights(sc, idx_s, 1.5)
    np.testing.assert_array_equal(wts.get().view(np.uint32), w_s.get().view(np.uint32),
                                  err_msg=f"seed={seed}")
    # on the chain's own scores: an id may differ only at a near tie of the biased scores
    ih, ioh = idx.get(), idx_o.get()
    biased = (sc_o + bias).get().astype(np.float32)
    for t in np.nonzero((np.sort(ih, 1) != np.sort(ioh, 1)).any(1))[0]:
        kth = np.sort(biased[t])[::-1][k - 1:k + 1]
        gap = ulp_dist_f32(kth[:1], kth[1:])[0]
        assert gap <= TIE_ULP, f"row {t}: ids differ at a gap of {gap} ulp [seed={seed}]"
    same = ~(ih != ioh).any(1)
    assert ulp_dist_f32(wts.get()[same], wts_o.get()[same]).max(initial=0) <= 4 * SCORES_MAX_ULP


@pytest.mark.parametrize("T,E,k,V", [(50, 8, 2, 512), (300, 256, 6, 1000)])
def test_router_kernel_hash(T, E, k, V):
    from memra_dsv4.gpu import ops_glue as G
    seed = fresh_seed()
    rng = rng_for(seed)
    logits = cp.asarray(_logits_with_ties(rng, T, E))
    tid2eid = cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(V)]).astype(np.int64))
    ids = cp.asarray(rng.integers(0, V, T))
    idx, wts, sc = _Route(E, k, True, None, tid2eid, "kernel").route(logits, ids, want_scores=True)
    idx_o, wts_o, sc_o = _Route(E, k, True, None, tid2eid, "cupy").route(logits, ids, want_scores=True)
    np.testing.assert_array_equal(idx.get().astype(np.int64), idx_o.get())
    w_s = G.route_weights(sc, idx_o, 1.5)
    np.testing.assert_array_equal(wts.get().view(np.uint32), w_s.get().view(np.uint32),
                                  err_msg=f"seed={seed}")
    assert ulp_dist_f32(wts.get(), wts_o.get()).max() <= 4 * SCORES_MAX_ULP


@pytest.mark.parametrize("S,N,k", [(64, 16, 2), (300, 75, 8), (1000, 250, 64), (40, 2000, 512)])
def test_candidates_index_order_bitwise(S, N, k):
    from memra_dsv4.gpu import ops_glue as G
    from memra_dsv4.gpu.ops import indexer as IX
    from memra_dsv4.host import indices as hidx
    seed = fresh_seed()
    rng = rng_for(seed)
    vals = rng.integers(-20, 20, size=(S, N)).astype(np.float32) / 8   # bf16-exact, many ties
    scores = cp.asarray((vals.view(np.uint32) >> 16).astype(np.uint16))
    n_valid = cp.asarray(rng.integers(0, N + 1, size=S).astype(np.int32))
    win = cp.asarray(hidx.window_matrix(S, 8, start=5))
    offset = 8 + S
    old = G.candidates(win, IX.topk(scores, n_valid, k), offset)
    new = G.candidates(win, IX.topk(scores, n_valid, k, order="index"), offset, ascending=True)
    assert new.dtype == old.dtype == cp.int32
    np.testing.assert_array_equal(new.get(), old.get(), err_msg=f"seed={seed}")
    comp = cp.asarray(hidx.hca_matrix(S, 4, start=3))
    np.testing.assert_array_equal(G.candidates(win, comp, offset, ascending=True).get(),
                                  G.candidates(win, comp, offset).get())


# ------------------------------------------------------------------ no host synchronisation
_GATE_SRC = r"""
extern "C" __global__ void gate_wait(const volatile int* flag, long long limit) {
    const long long t0 = clock64();
    while (*flag == 0 && clock64() - t0 < limit) __nanosleep(20000);
}
"""


class _Gate:
    """Holds a stream with a kernel spinning on a pinned host flag (at most ~2 minutes)."""

    def __init__(self):
        self.mem = cp.cuda.alloc_pinned_memory(4)
        self.flag = np.frombuffer(self.mem, np.int32, 1)
        self.flag[0] = 0
        self.kern = cp.RawKernel(_GATE_SRC, "gate_wait")

    def hold(self, stream):
        with cp.cuda.Device(stream.device_id):
            self.kern((1,), (1,), (np.uint64(self.mem.ptr), np.int64(240 * 10 ** 9)), stream=stream)

    def open(self):
        self.flag[0] = 1


def _enqueued_while_held(fn, streams, wait_s):
    """Run fn() in a thread while every stream in ``streams`` is held; True when fn returned
    before the gate opened (after wait_s seconds at most).  fn's exception is re-raised."""
    gate = _Gate()
    for s in streams:
        gate.hold(s)
    done, err = threading.Event(), []

    def work():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            err.append(e)
        finally:
            done.set()
    th = threading.Thread(target=work)
    th.start()
    ok = done.wait(wait_s)
    if not ok:   # where the host waits: printed for the report (pytest -s / on failure)
        frame = sys._current_frames().get(th.ident)
        print("host blocked at:\n" + "".join(traceback.format_stack(frame)) if frame else "")
    gate.open()
    th.join()
    for s in streams:
        s.synchronize()
    if err:
        raise err[0]
    return ok


_TINY: dict = {}


def _tiny_one_gpu():
    from memra_dsv4.gpu.model import Dsv4Gpu
    from test_decode_gpu import _ckpt, _ids  # noqa: E402  (prepend import mode)
    if "m" not in _TINY:
        ck = _ckpt("tiny")
        _TINY["m"] = Dsv4Gpu.load(ck, devices=(0,), max_seq_len=512)
        _TINY["ids"] = np.asarray(_ids(ck.config, 100, seed=3), np.int32)
    return _TINY["m"], _TINY["ids"]


def _stage_layers(m, ids, wait_s: float = ENQUEUE_S):
    """run_stage of stage 0 (embedding + layers, no head) on a fresh state at p0 = 0, after a
    warm run_chunk of the same ids (kernels built, GEMM plans and the chunk's tables made);
    True when it finished enqueuing within wait_s while the compute stream was held."""
    from memra_dsv4.gpu.decode import run_chunk, run_stage
    st = m.new_state()
    st.reset()
    run_chunk(m, st, ids, ph="prefill")          # warm; leaves the chunk memo filled
    st2 = m.new_state()
    st2.reset()
    dev = m.devs[m.stages[0].device]
    return _enqueued_while_held(
        lambda: run_stage(m, 0, st2, ids, 0, None, ph="prefill", head=False),
        [dev.compute], wait_s)


def test_stage_layers_make_no_host_sync():
    m, ids = _tiny_one_gpu()
    assert _stage_layers(m, ids), (
        "run_stage's layers did not finish enqueuing while the GPU was held: a host "
        "synchronisation remains inside the layers")


def test_gate_detects_a_host_sync(monkeypatch):
    """Negative control: one stream synchronisation inside the layers (injected into the
    candidate build, which every attention layer calls) must block behind the gate.  (The first
    control, the CuPy router chain with cupy.sort, did NOT block on the tiny model on the H200 at
    36bc886: cupy.sort is not a reliable synchronisation, so it cannot be the control.)"""
    from memra_dsv4.gpu import ops_glue as G
    m, ids = _tiny_one_gpu()
    real = G.candidates

    def syncing(*a, **k):
        cp.cuda.get_current_stream().synchronize()
        return real(*a, **k)
    monkeypatch.setattr(G, "candidates", syncing)
    assert not _stage_layers(m, ids, CONTROL_S), "the gate did not detect a stream synchronize"


def test_boundary_makes_no_host_sync_and_copies():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    from memra_dsv4.gpu.model import Dsv4Gpu
    from test_decode_gpu import _ckpt  # noqa: E402
    m = Dsv4Gpu.load(_ckpt("tiny"), devices=(0, 1), max_seq_len=256)
    if len(m.stages) != 2 or m.stages[0].device == m.stages[1].device:
        pytest.skip("the plan did not make 2 stages on 2 devices")
    src_dev = m.devs[m.stages[0].device]
    dst_dev = m.devs[m.stages[1].device]
    rng = np.random.default_rng(0)
    host = rng.standard_normal((300, m.config.hc_mult, m.config.hidden_size)).astype(np.float32)
    with cp.cuda.Device(src_dev.id), src_dev.compute:
        src = cp.asarray(host)
    src_dev.compute.synchronize()
    m.boundary_paths = []
    out = {}
    ok = _enqueued_while_held(lambda: out.setdefault("dst", m._boundary(src, 0, "prefill")),
                              [src_dev.compute, dst_dev.compute], ENQUEUE_S)
    assert ok, "_boundary synchronised the host"
    dst = out["dst"]
    assert dst.device.id == dst_dev.id and len(m.boundary_paths) == 1
    with cp.cuda.Device(dst_dev.id):
        got = cp.asnumpy(dst, stream=dst_dev.compute)
    dst_dev.compute.synchronize()
    np.testing.assert_array_equal(got, host)
    m._boundary_release()
