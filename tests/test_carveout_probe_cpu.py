"""tools/carveout_probe.py on the CPU: its refusals name the bad argument before CuPy is imported,
and its CUDA source compiles for sm_90a with nvcc (where nvcc is installed, as in CI), with no
stack or spills, the stream kernel's weight loads the production GEMVs' form, and the --residency
kernels' marks ordered as their counts need."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tool_loader import load_tool  # tests/tool_loader.py (prepend import mode)


def _tool():
    return load_tool("carveout_probe")


def test_carveout_probe_refusals():
    cp = _tool()
    for argv, msg in ((["--smem-kb", "32,x"], "--smem-kb '32,x': expected comma-separated integers"),
                      (["--smem-kb", "0"], "--smem-kb 0: every value must be >= 1"),
                      (["--smem-kb", "228"], "--smem-kb 228: at most 227 KB per CTA"),
                      (["--ctas", "64,0"], "--ctas 64,0: every value must be >= 1"),
                      (["--mb", "0"], "--mb 0: expected >= 1"),
                      (["--pairs", "0"], "--pairs 0: expected >= 1"),
                      (["--rounds", "2"], "--rounds 2: expected >= 3"),
                      (["--iters", "-1"], "--iters -1: expected >= 0"),
                      (["--residency", "--residency-iters", "0"], "--residency-iters 0: expected >= 1")):
        with pytest.raises(SystemExit, match=msg):
            cp.main(argv)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_carveout_probe_source_compiles(tmp_path):
    src = _tool().SRC
    # the production weight load (common.cuh ldg_stream16 with MEMRA_L2_EVICT_FIRST = 1)
    assert "ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32" in src
    assert "createpolicy.fractional.L2::evict_first.b64" in src
    for k in ("hold", "hold_nosmem", "stream", "hold_mark", "stream_count"):   # PDL kernels, wait before trigger
        body = src[src.index(f'__global__ void {k}('):]
        assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")
    # --residency: the hold's start mark precedes its trigger (no stream CTA can arrive before
    # it), and the stream CTA reads the marks before its own PDL wait (on arrival)
    mark = src[src.index("__global__ void hold_mark("):]
    assert mark.index("atomicExch(&sm_state[2 * sm], epoch)") < mark.index("__syncthreads()") \
        < mark.index("griddepcontrol.launch_dependents")
    count = src[src.index("__global__ void stream_count("):]
    assert count.index("counts[3 * sm + 1]") < count.index("griddepcontrol.wait")
    cu = tmp_path / "probe.cu"
    cu.write_text(src)
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "probe.cubin"), str(cu),
                        "-Xptxas", "-v"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "bytes spill stores" in r.stderr
    assert all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
               for line in r.stderr.splitlines() if "spill" in line), r.stderr
