"""tools/fp4_mma_probe.py on the CPU: its refusals name the bad argument before CuPy is imported;
its lane / fragment mapping (emulate_tile: every lane's words and x fragments as the kernel loads
them, each HMMA by m16n8k16's fragment layout, the per-block folds) reproduces the dequantised
GEMV for both weight layouts, and fails when the x order does not match the words' pairs; the
f16 words are e2m1 * 2^-14; the `quad` layout is a permutation inside every 64 bytes; and the CUDA
source compiles for sm_90a with no stack or spills (where nvcc is installed, as in CI)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)


def _tool():
    return load_tool("fp4_mma_probe")


def test_fp4_mma_probe_refusals():
    p = _tool()
    for argv, msg in ((["--shape", "gateup,up"], "--shape 'up': not one of gateup, down"),
                      (["--kernels", "fp4mma_quad_d3"], "--kernels 'fp4mma_quad_d3': not one of"),
                      (["--ksplit", "0"], "--ksplit 0: expected >= 1"),
                      (["--ksplit", "x"], "--ksplit 'x': expected an integer"),
                      (["--shape", "down", "--ksplit", "32"], "--ksplit 32: K = 2048 of --shape down is not a "
                                                             "multiple of 128 x 32"),
                      (["--ctas-per-sm", "0"], "--ctas-per-sm 0: expected >= 1"),
                      (["--reps", "0"], "--reps 0: expected >= 1"),
                      (["--iters", "2"], "--iters 2: expected >= 3")):
        with pytest.raises(SystemExit, match=msg):
            p.main(argv)


def _problem(rng, O=16, K=512):
    stored = rng.integers(0, 256, size=(O, K // 2), dtype=np.uint8)
    scale = rng.integers(116, 124, size=(O, K // 32), dtype=np.uint8)
    x = rng.standard_normal(K).astype(np.float32)
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)     # bf16 values
    return stored, scale, x


@pytest.mark.parametrize("quad", [True, False])
def test_emulated_tile_is_the_gemv(quad):
    p = _tool()
    rng = np.random.default_rng(7)
    stored, scale, x = _problem(rng, O=32, K=512)
    xh, c, exact = p.x_half(x)
    assert exact
    ref = p.dequant(stored, scale) @ x.astype(np.float64)
    for row0 in (0, 16):
        y = p.emulate_tile(stored, scale, xh, c, row0, 0, 4, quad)           # all of K
        np.testing.assert_allclose(y, ref[row0:row0 + 16], rtol=1e-12, atol=1e-12)
    # a task over part of K (ksplit 2: steps 2..3) is that part's sum
    part = p.dequant(stored, scale)[:16, 256:] @ x[256:].astype(np.float64)
    np.testing.assert_allclose(p.emulate_tile(stored, scale, xh, c, 0, 2, 2, quad), part, rtol=1e-12, atol=1e-12)


def test_emulated_tile_fails_with_x_in_stored_order():
    """The B fragments must follow the words' pairs (0,4) (1,5) ...: x in plain order is wrong."""
    p = _tool()
    rng = np.random.default_rng(8)
    stored, scale, x = _problem(rng)
    xh, c, _ = p.x_half(x)
    plain = xh.view(np.float16).reshape(-1, 8)[:, np.argsort(p.X_ORDER)].reshape(-1).view(np.uint16)
    ref = p.dequant(stored, scale) @ x.astype(np.float64)
    assert np.allclose(p.emulate_tile(stored, scale, xh, c, 0, 0, 4, True), ref[:16], rtol=1e-12)
    assert not np.allclose(p.emulate_tile(stored, scale, plain, c, 0, 0, 4, True), ref[:16], rtol=1e-3)


def test_fp4_words_are_e2m1_times_2_to_minus_14():
    p = _tool()
    for w in (0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567):
        h = p.fp4_words(w)
        got = []
        for word in h:
            got.extend(p._f16x2(word))
        nib = [(w >> (4 * e)) & 15 for e in range(8)]
        want = [p.E2M1[nib[e]] * 2.0 ** -14 for e in (0, 4, 1, 5, 2, 6, 3, 7)]
        assert got == want, (hex(w), got, want)


def test_fp4_words_are_experts_cu_fp4_prmt_placement():
    """The probe's kernel is standalone (NVRTC, no repo header), so its decode is a copy: the same
    six lines as experts.cu's FP4_PRMT form of e2m1x8_to_f16x2, kept so by this test."""
    p = _tool()
    body = p.SRC[p.SRC.index("DEV void fp4_words("):]
    body = body[body.index("{") + 1:body.index("\n}")]
    lines = [ln.strip() for ln in body.strip().splitlines()]
    assert len(lines) == 6
    experts = (Path(__file__).resolve().parents[1] / "kernels_cu" / "experts.cu").read_text()
    prmt = experts[experts.index("DEV void e2m1x8_to_f16x2("):]
    prmt = prmt[prmt.index("#if FP4_MMA_PRMT"):]
    prmt = prmt[:prmt.index("return;")]
    assert [ln.strip() for ln in prmt.splitlines()[1:7]] == lines


def test_quad_layout_is_a_word_transpose():
    p = _tool()
    a = np.arange(2 * 128, dtype=np.uint32).astype(np.uint8).reshape(2, 128)
    q = p.quad_layout(a)
    assert sorted(q[0].tolist()) == sorted(a[0].tolist())
    np.testing.assert_array_equal(p.quad_layout(q), a)                     # a 4 x 4 transpose: its own inverse
    # lane t's 16 bytes of the first 64: word t of blocks 0..3
    for t in range(4):
        np.testing.assert_array_equal(q[0, 16 * t:16 * t + 16],
                                      np.concatenate([a[0, 16 * i + 4 * t:16 * i + 4 * t + 4] for i in range(4)]))
    with pytest.raises(AssertionError, match="not a multiple of 64"):
        p.quad_layout(np.zeros((1, 96), dtype=np.uint8))


def test_x_half_reports_inexact():
    p = _tool()
    x = np.array([1.0, 2.0 ** -40] + [0.5] * 6, dtype=np.float32)   # 2^-40 is below f16 at c = 14
    _, c, exact = p.x_half(x)
    assert c == 14 and not exact
    _, _, exact = p.x_half(np.array([1.0, -0.75, 3.0, 2.0 ** -10] + [0.0] * 4, dtype=np.float32))
    assert exact


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_fp4_mma_probe_source_compiles(tmp_path):
    p = _tool()
    cu = tmp_path / "fp4_mma_probe.cu"
    cu.write_text(p.SRC)
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-cubin", "-o", str(tmp_path / "probe.cubin"), str(cu),
                        "-Xptxas", "-v"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for k in p.KERNELS:
        assert f"Compiling entry function '{k}'" in r.stderr
    assert "bytes spill stores" in r.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
               for line in r.stderr.splitlines() if "spill" in line), r.stderr


def test_ring_copies_cover_a_step_once_and_read_the_natural_words():
    """gemv_ring's copies (ring_copies: two 16-byte granules and a scale word per lane) fill every
    byte of a step's 16 x 64 B tile and its 16 scale words exactly once (lanes 16..31's scale
    words land in the sink), no two copies overlap, and lane (g, t)'s reads
    from the image are the natural layout's words of rows g, g + 8 (what emulate_tile(quad=False)
    multiplies) and their scale words (ldmatrix's fragment rule); each matrix's 8 rows hit 32
    distinct banks."""
    p = _tool()
    cp = p.ring_copies()
    weights = sorted((row, off) for _, row, off, _ in cp if off >= 0)
    assert weights == [(r, o) for r in range(16) for o in range(0, 64, 16)]
    img_end = 16 * p.RING_ROW + 64      # the image; the sink after it takes lanes 16..31's scale words
    assert sorted(row for _, row, off, d in cp if off < 0 and d < img_end) == list(range(16))
    assert all(d >= img_end for lane, _, off, d in cp if off < 0 and lane >= 16)
    dsts = sorted((d, 16 if off >= 0 else 4) for _, _, off, d in cp)
    assert all(a + n <= b for (a, n), (b, _) in zip(dsts, dsts[1:])), "copies overlap in the image"
    assert max(d + n for d, n in dsts) <= p.RING_STEP and all(d % n == 0 for d, n in dsts)
    rng = np.random.default_rng(11)
    stored, scale, _ = _problem(rng, O=32, K=512)
    for row0, kstep in ((0, 0), (16, 3)):
        img = p.ring_image(stored, scale, row0, kstep)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            a, b, qa, qb = p.ring_words(img, g, t)
            for words, r in ((a, row0 + g), (b, row0 + g + 8)):
                want = [int.from_bytes(stored[r, 64 * kstep + 16 * i + 4 * t:64 * kstep + 16 * i + 4 * t + 4]
                                       .tobytes(), "little") for i in range(4)]
                assert words == want, (row0, kstep, lane)
            assert qa == int.from_bytes(scale[row0 + g, 4 * kstep:4 * kstep + 4].tobytes(), "little")
            assert qb == int.from_bytes(scale[row0 + g + 8, 4 * kstep:4 * kstep + 4].tobytes(), "little")
    for half in (0, 1):   # each matrix's 8 rows of 16 B (one ldmatrix phase) cover 32 distinct banks
        addrs = p.ldsm_row_addresses(half)
        for j in range(4):
            assert all(a % 16 == 0 for a in addrs[8 * j:8 * j + 8])
            banks = {(a // 4 + k) % 32 for a in addrs[8 * j:8 * j + 8] for k in range(4)}
            assert len(banks) == 32, (half, j, sorted(banks))


def test_smem_bytes():
    p = _tool()
    assert p.smem_bytes("fp4mma_quad_d4", 4096) == 8192
    assert p.smem_bytes("fp4mma_natsm_d8", 2048) == 4096 + 10240
    assert p.smem_bytes("fp4mma_ring_r8", 4096) == 8192 + 8 * 8 * 1408
    assert p.smem_bytes("fp4mma_ring_r16", 4096) + 1024 <= 232448      # one CTA fits an H100 / H200 SM
    assert 2 * (p.smem_bytes("fp4mma_ring_r16", 4096) + 1024) > 233472  # two do not (skipped)
    with pytest.raises(AssertionError):
        p.smem_bytes("fp4mma_ring_r3", 4096)


class _FakeProbeKernel:
    """A probe kernel on the CPU: each (16-row tile, K part) task's partial sums by emulate_tile,
    the kernel's lane mapping, written to part[ks, rows] as the kernel writes them."""

    def __init__(self, p, name):
        self.p, self.name, self.max_dynamic_shared_size_bytes, self.launches = p, name, 0, []

    def __call__(self, grid, block, args, shared_mem=0):
        W, S, xh, part, O, K, KS, c = args
        O, K, KS, c = int(O), int(K), int(KS), int(c)
        assert block == (256,) and shared_mem == self.p.smem_bytes(self.name, K)
        assert shared_mem <= 48 * 1024 or self.max_dynamic_shared_size_bytes >= shared_mem, "smem attribute unset"
        quad = "_quad_" in self.name
        stored = self.p.quad_layout(W) if quad else W          # the layout is its own inverse
        spt = K // KS // 128
        for tile in range(O // 16):
            for ks in range(KS):
                part[ks, 16 * tile:16 * tile + 16] = self.p.emulate_tile(stored, S, xh, c, 16 * tile, ks * spt,
                                                                         spt, quad)
        self.launches.append((grid, KS))


def test_probe_main_on_a_fake_device(monkeypatch, capsys):
    """main() end to end with CuPy replaced by NumPy and the kernels by emulate_tile: every kernel,
    ksplit and CTAs-per-SM configuration passes its float64 check, the ring r16 at 2 CTAs per SM
    is skipped for shared memory (one SM's 228 KB), the shared-memory attribute is raised where a
    kernel needs more than 48 KB, and each shape ends with its best line."""
    import sys
    import types

    import bench.harness
    import memra_dsv4.profiling.launches as launches

    p = _tool()
    kernels = {}
    fake = types.ModuleType("cupy")
    fake.float32 = np.float32
    fake.asarray, fake.asnumpy = np.array, np.asarray
    fake.zeros = lambda shape, dtype: np.zeros(shape, dtype)

    class _Dev:
        attributes = {"MultiProcessorCount": 2, "MaxSharedMemoryPerMultiprocessor": 233472}

        def __init__(self, i):
            pass

        def use(self):
            pass

    class _Mod:
        def __init__(self, code, options):
            assert code == p.SRC and "-arch=sm_90a" in options

        def get_function(self, name):
            return kernels.setdefault(name, _FakeProbeKernel(p, name))

    fake.cuda = types.SimpleNamespace(Device=_Dev, runtime=types.SimpleNamespace(
        getDeviceProperties=lambda d: {"name": b"Fake GPU"}))
    fake.RawModule = _Mod
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(bench.harness, "measure_copy_bandwidth", lambda d: {"copy_bw_Bps": 3.0e12})
    monkeypatch.setattr(launches, "time_launches", lambda lns, reps, iters, flush_bytes: [10.0] * len(lns))
    monkeypatch.setattr(p, "SHAPES", {"gateup": (32, 512), "down": (16, 256)})
    assert p.main(["--no-production", "--ksplit", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "CHECK FAILED" not in out, out
    assert "fp4mma_ring_r16 ksplit 1, 2/SM: skipped" in out and "fp4mma_ring_r16 ksplit 1, 1/SM" in out
    for name in p.KERNELS:
        assert f"{name} ksplit 2, 1/SM" in out, name
    assert out.count(" best: ") == 2
    assert kernels["fp4mma_ring_r8"].max_dynamic_shared_size_bytes == p.smem_bytes("fp4mma_ring_r8", 256)   # the last shape
    # 2 shapes x 2 ksplit x 2 CTAs per SM, less r16's two skips
    assert len(kernels["fp4mma_ring_r16"].launches) == 4 and len(kernels["fp4mma_quad_d4"].launches) == 8


RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_report_rows_round_trip():
    """parse_report reads back every field format_row prints, the ratio and check suffixes too."""
    p = _tool()
    bw = 3.01e12
    head = "device 0: NVIDIA H100 80GB HBM3, 132 SMs; copy bandwidth 3.01 TB/s; each launch timed ..."
    text = "\n".join([
        head, "gateup: O 24576, K 4096, 53.5 MB per launch; x in f16 exact: True",
        p.format_row("ops.experts gate/up (CUDA cores)", 53477376, 26.36, bw),
        p.format_row("fp4mma_ring_r8 ksplit 2, 1/SM", 53477376, 35.02, bw, 26.36)
        + "; relL2 9.4e-08, worst row 1.1e-03",
        p.format_row("fp4mma_quad_d2 ksplit 4, 2/SM", 53477376, 30.48, bw, 26.36)
        + "; relL2 2.0e-03, worst row 1.0e+00  CHECK FAILED",
        "  fp4mma_ring_r16 ksplit 2, 2/SM: skipped, 2 x 188416 B of shared memory do not fit one SM's 233472 B",
        p.format_row("gateup best: fp4mma_ring_r8 ksplit 2, 1/SM", 53477376, 35.02, bw, 26.36)])
    d = p.parse_report(text)
    assert (d["device"], d["sms"], d["copy_bw_TBps"]) == ("NVIDIA H100 80GB HBM3", 132, 3.01)
    g = d["shapes"]["gateup"]
    assert (g["O"], g["K"], g["MB"], g["x_f16_exact"]) == (24576, 4096, 53.5, True)
    base, ring, bad = g["rows"]
    assert base == {"label": "ops.experts gate/up (CUDA cores)", "us": 26.36,
                    "GBps": round(53477376 / 26.36 / 1e3, 1),
                    "pct_copy_bw": round(53477376 / 26.36 * 1e6 / bw * 100, 1)}
    assert (ring["kernel"], ring["ksplit"], ring["ctas_per_sm"], ring["ratio"]) == ("fp4mma_ring_r8", 2, 1, 1.33)
    assert ring["check_ok"] and ring["rel_l2"] == 9.4e-08 and not bad["check_ok"]
    assert g["skipped"] == [{"kernel": "fp4mma_ring_r16", "ksplit": 2, "ctas_per_sm": 2}]
    assert g["best"]["kernel"] == "fp4mma_ring_r8" and g["best"]["us"] == 35.02


def test_report_refuses_what_it_does_not_know():
    p = _tool()
    with pytest.raises(ValueError, match="line 2 is not a line of the probe's report: 'Traceback"):
        p.parse_report("device 0: X, 1 SMs; copy bandwidth 1.00 TB/s\nTraceback (most recent call last):")
    with pytest.raises(ValueError, match="no 'device N: ...' header"):
        p.parse_report("")
    with pytest.raises(SystemExit, match="usage: fp4_mma_probe.py --from-log"):
        p.main(["--from-log", "only-one"])


def test_thirty_sixth_session_report_as_committed(tmp_path):
    """The committed H100 report (bench/results, s36) parses whole, and --from-log writes the same
    JSON that sits beside it, and a PNG."""
    p = _tool()
    import json
    stem = RESULTS / "2026-12-07-nvidia-h100-fa2e018-s36-fp4_mma_probe_core"
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert p.main(["--from-log", f"{stem}.txt", str(out_json), str(out_png)]) == 0
    d = json.loads(out_json.read_text())
    assert d == json.loads(Path(f"{stem}.json").read_text())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for shape in ("gateup", "down"):
        s = d["shapes"][shape]
        # 9 kernels x 2 ksplit x 2 CTAs per SM, less r16 at 2 per SM (skipped): 34 timed rows.
        assert len(s["rows"]) == 34 and len(s["skipped"]) == 2
        assert all(r["check_ok"] for r in s["rows"])
        assert s["best"]["us"] == min(r["us"] for r in s["rows"])
