"""The greedy token on the CPU: host.sampling.greedy_token (np.argmax's rule and its refusals), a
NumPy run of decode.cu greedy_argmax_f32's reduction order (per-thread strided scan, warp
butterfly, one warp over the warp winners, all under argmax_ahead) against that rule, the wrapper's
launch (ops_decode.greedy_argmax on FakeKernels: one CTA of 1024 threads, the .cu signature), the
kernel's source contract, and the bench's feed arm setting (check_arms, --feed-chunk)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from memra_dsv4.host.sampling import greedy_token
from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)

ROOT = Path(__file__).resolve().parents[1]


def _cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    yield "random", rng.standard_normal(n).astype(np.float32)
    yield "equal", np.zeros(n, np.float32)
    yield "-inf", np.full(n, -np.inf, np.float32)
    if n >= 3:
        x = np.full(n, -1.0, np.float32); x[n - 1] = 5.0; x[n // 2] = 5.0
        yield "tie", x
        x = rng.standard_normal(n).astype(np.float32); x[n // 3] = np.inf; x[n - 1] = np.nan; x[n // 2] = np.nan
        yield "nan", x
        x = np.full(n, -1.0, np.float32); x[n - 1] = 0.0; x[1] = -0.0
        yield "signed zero", x


def _ahead(va, ia, vb, ib) -> bool:   # the kernel's argmax_ahead
    na, nb = math.isnan(va), math.isnan(vb)
    if na or nb:
        return na and (not nb or ia < ib)
    return va > vb or (va == vb and ia < ib)


def _kernel_order(x: np.ndarray) -> int:
    """greedy_argmax_f32's reduction, step for step: 1024 threads, 32 warps."""
    n = x.size
    best = []
    for t in range(1024):
        v, i = -math.inf, 0x7FFFFFFF
        for j in range(t, n, 1024):
            if _ahead(float(x[j]), j, v, i):
                v, i = float(x[j]), j
        best.append((v, i))

    def butterfly(lanes):
        lanes = list(lanes)
        off = 16
        while off:
            nxt = []
            for l in range(32):
                ov, oi = lanes[l ^ off]
                v, i = lanes[l]
                nxt.append((ov, oi) if _ahead(ov, oi, v, i) else (v, i))
            lanes, off = nxt, off >> 1
        assert len(set(lanes)) == 1 or all(math.isnan(a) for a, _ in lanes), lanes[:2]
        return lanes[0]

    winners = [butterfly(best[32 * w:32 * w + 32]) for w in range(32)]
    return butterfly(winners)[1]


@pytest.mark.parametrize("n", [1, 2, 31, 1000, 1024, 1025, 3000])
def test_kernel_order_is_np_argmax(n):
    for name, x in _cases(n, n):
        assert _kernel_order(x) == greedy_token(x) == int(np.argmax(x)), (n, name)


def test_greedy_token_is_the_oracle_greedy_on_valid_logits():
    from memra_dsv4.oracle.sampling import greedy
    rng = np.random.default_rng(7)
    for n in (1, 5, 1000):
        x = rng.standard_normal(n).astype(np.float32)
        if n > 1:
            x[rng.integers(0, n)] = -np.inf
        assert greedy_token(x) == greedy(x)
    x = np.array([0.5, 2.0, -1.0, 2.0], np.float32)   # a tie: both the lower id
    assert greedy_token(x) == greedy(x) == 1


def test_greedy_token_refusals():
    with pytest.raises(ValueError, match=r"shape \(0,\)"):
        greedy_token(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        greedy_token(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="floating point, got int32"):
        greedy_token(np.zeros(4, np.int32))
    assert greedy_token(np.array([1.0, np.nan, 3.0, np.nan])) == 1


def test_wrapper_launch(monkeypatch):
    from test_kernel_sources import fake_ops_module
    launched = []
    fake, DK = fake_ops_module(monkeypatch, "memra_dsv4.gpu.ops_decode",
                               lambda name, grid, block, args, smem: launched.append((name, grid, block, args)))
    logits = fake.zeros((129280,), np.float32)
    tok = fake.zeros((1,), np.int32)
    assert DK.greedy_argmax(logits, tok) is tok
    (name, grid, block, args), = launched
    assert name == "greedy_argmax_f32" and tuple(grid) == (1,) and tuple(block) == (1024,)
    assert args[1] == 129280 and isinstance(args[1], np.int32)
    assert args[3] == 0 and args[4] == 0 and args[5] == 0   # no pos, no history
    pos, hist = fake.zeros((1,), np.int32), fake.zeros((33,), np.int32)
    DK.greedy_argmax(logits, tok, pos, hist)
    args = launched[-1][3]
    assert args[3] is pos and args[4] is hist and args[5] == 33 and isinstance(args[5], np.int32)
    with pytest.raises(AssertionError, match="hist needs pos"):
        DK.greedy_argmax(logits, tok, None, hist)
    with pytest.raises(AssertionError, match="pos: shape"):
        DK.greedy_argmax(logits, tok, fake.zeros((2,), np.int32), hist)
    with pytest.raises(AssertionError, match="hist: dtype"):
        DK.greedy_argmax(logits, tok, pos, fake.zeros((4,), np.int64))
    launched[:] = launched[:1]
    with pytest.raises(AssertionError, match="logits: dtype"):
        DK.greedy_argmax(fake.zeros((8,), np.float16), tok)
    with pytest.raises(AssertionError, match="tok: shape"):
        DK.greedy_argmax(logits, fake.zeros((2,), np.int32))
    with pytest.raises(AssertionError, match="1 .. 2"):
        DK.greedy_argmax(fake.zeros((0,), np.float32), tok)
    assert len(launched) == 1   # nothing launched by a refused call


def test_kernel_source_contract():
    src = (ROOT / "kernels_cu" / "decode.cu").read_text()
    body = src[src.index("greedy_argmax_f32(const float*"):]
    body = body[:body.index("\n}\n")]
    assert "__launch_bounds__(1024)" in src[src.index("greedy_argmax_f32(const float*") - 80:
                                             src.index("greedy_argmax_f32(const float*")]
    assert body.count("PDL_ENTRY();") == 1
    assert re.search(r"j < n; j \+= 1024", body), "the per-thread scan is strided by the 1024 threads"
    assert "tok[0] = i" in body
    # the history entry and the advance come after the pick, on the one lane that writes tok
    assert body.index("tok[0] = i") < body.index("hist[p1] = i") < body.index("pos[0] = p1")
    from memra_dsv4.gpu import ops_decode
    assert "greedy_argmax_f32" in ops_decode.KERNELS


def test_bench_feed_setting():
    from bench.decode_step import check_arms, main
    arms = check_arms("path=device,path=device+feed=token,path=device+feed=device")
    assert [a.get("feed", "host") for a in arms] == ["host", "token", "device"]
    with pytest.raises(SystemExit, match=r"feed='gpu'; expected one of host, token, device"):
        check_arms("path=device+feed=gpu")
    with pytest.raises(SystemExit, match="--feed-chunk 0: expected >= 1"):
        main(["--arms", "path=device+feed=device", "--feed-chunk", "0"])
    for opt in (["--device-trace", "5"], ["--delay-probe", "4"], ["--launch-profile", "10"]):
        with pytest.raises(SystemExit, match="feed=device runs --feed-chunk steps per sample"):
            main(["--arms", "path=device,path=device+feed=device"] + opt)


def test_host_gap_refusals():
    """tools/host_gap.py refuses its bad arguments before importing CuPy."""
    hg = load_tool("host_gap")
    for argv, msg in ((["--steps", "9"], "--steps 9: need >= 10"), (["--chunk", "0"], "--chunk 0"),
                      (["--ctx", "0"], "--ctx 0"), (["--warmup", "0"], "--warmup 0"),
                      (["--cprofile", "-1"], "--cprofile -1"), (["--devices", "0,1"], "one device"),
                      (["--host-loops", "0"], "--host-loops 0")):
        with pytest.raises(SystemExit, match=msg):
            hg.main(argv)


def test_bench_arm_run_is_the_feed_alone():
    """_ArmState.run is what the bench times (the feed's call alone); step = apply + run; the
    bench's Arm takes run as its step and apply as its untimed setup."""
    import inspect
    from bench import decode_step as B
    calls = []

    class FakeModel:
        def decode_step(self, state, tok, readback="logits"):
            calls.append(("step", tok, readback))
            return 5 if readback == "token" else np.eye(8, dtype=np.float32)[3]

        def decode_greedy(self, state, tok, n):
            calls.append(("greedy", tok, n))
            return np.array([6] * n, np.int32)
    st = object.__new__(B._ArmState)
    st.m, st.state, st.tok, st.feed_chunk = FakeModel(), None, 1, 4
    st.apply = lambda: calls.append("apply")
    for feed, want, tok in (("host", ("step", 1, "logits"), 3), ("token", ("step", 3, "token"), 5),
                            ("device", ("greedy", 5, 4), 6)):
        st.feed = feed
        calls.clear()
        st.run()
        assert calls == [want] and st.tok == tok, (feed, calls)
    calls.clear()
    st.step()
    assert calls[0] == "apply" and len(calls) == 2
    src = inspect.getsource(B.main)
    assert "Arm(name=name, step=st.run, settings=dict(s), setup=_arm_setup(st, a.prime))" in src
    # the primed steps: one token of the arm's own feed each, outside the timed sample
    for feed, want, tok in (("host", ("step", 6, "logits"), 3), ("token", ("step", 3, "token"), 5),
                            ("device", ("greedy", 5, 1), 6)):
        st.feed = feed
        calls.clear()
        st.prime(2)
        assert calls[0] == want and len(calls) == 2 and st.tok == tok, (feed, calls)
    calls.clear()
    st.prime(0)
    assert calls == []
    st.feed = "device"
    B._arm_setup(st, 3)()
    assert calls == ["apply", ("greedy", 6, 1), ("greedy", 6, 1), ("greedy", 6, 1)]


def test_bench_prime_refusals():
    """--prime: 0 .. 64, refused (before any GPU work) with the probes / profiles that time
    their own steps."""
    from bench.decode_step import main
    for bad in ("-1", "65"):
        with pytest.raises(SystemExit, match=f"--prime {bad}: expected 0 .. 64"):
            main(["--arms", "path=device,path=device+feed=device", "--prime", bad])
    for opt in (["--device-trace", "5"], ["--delay-probe", "4"], ["--launch-profile", "10"]):
        with pytest.raises(SystemExit, match="--prime 1: --device-trace / --delay-probe"):
            main(["--arms", "path=device,path=device+pdl=off", "--prime", "1"] + opt)


def test_host_gap_wake_probe_is_fixed_work():
    """host_gap's wake.* probe: the pure-Python workload (host_wake.py_work) is the same work
    every call (its value fixed), and --wake reserves room for its replays (one per after_gpu
    sample and workload)."""
    import inspect
    mods = {name: load_tool(name) for name in ("host_gap", "host_wake")}
    want = sum((i * 7) % 5 + 1 for i in range(300))
    assert mods["host_wake"].py_work() == mods["host_wake"].py_work() == want
    src = inspect.getsource(mods["host_gap"].main)
    assert "(2 * a.steps if a.wake else 0)" in src and src.count('"py": host_wake.py_work') == 1
