"""PDL_ENTRY_PRELOAD's contract in the compiled code (common.cuh): the static-weight loads a kernel
issues before ``griddepcontrol.wait`` must be issued before it in the SASS too.  ptxas may move the
wait (ACQBULK on sm_90a) above loads that share its basic block (legal: it only delays them), which
would silently undo the preload; each preload helper therefore ends its block with a never-taken
branch.  This test compiles the modules with nvcc (the options of tools/compile_kernels.py),
disassembles them with nvdisasm and checks, for every kernel that opens with PDL_ENTRY_PRELOAD,
that a global load (LDG) comes before the first ACQBULK.  nvdisasm: PATH, else the
nvidia-cuda-nvdisasm wheel of the test extra; skipped where nvcc or nvdisasm is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from memra_dsv4.cuda_tools import nvdisasm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(REPO, "kernels_cu")

# module -> kernels that open with PDL_ENTRY_PRELOAD (the macro-generated names spelled out)
PRELOAD_KERNELS = {
    # the norm weight and RoPE rows of the kv norm and the compressor emission (compressor.cu
    # nrs_row_preload, emit_preload)
    "compressor": tuple(f"norm_rope_{s}_d{d}_{i}in" for s, d in (("fp8", 512), ("fp8", 128), ("hadfp4", 128))
                        for i in ("f32", "bf16"))
                  + ("compress_emit_fp8_d512", "compress_emit_fp8_d128", "compress_emit_hadfp4_d128"),
    # the indexer q's RoPE rows (quant_sim.cu rope_h128_preload)
    "quant_sim": ("rope_hadamard128_fp4_bf16",),
    # the combine's sink and inverse-RoPE cos / sin (attention.cu comb_preload)
    "attention": ("sparse_attn_combine_d512", "sparse_attn_combine_d128"),
    "router": tuple(f"router_fused_e{e}" for e in (32, 64, 128, 256, 384, 512))
              + tuple(f"router_cluster_e{e}" for e in (32, 64, 128, 256)),
    "rmsnorm": ("rmsnorm_bf16_wf32", "rmsnorm_bf16_wbf16", "head_rms_bf16"),
    "hc": ("hc_boundary", "hc_boundary_poll", "hc_boundary_pre", "hc_boundary_pre_cluster", "hc_boundary_pre_coop"),
    "decode": ("gemv_bf16_pl_r2", "gemv_bf16_pl_r4", "gemv_bf16_multi_r1_qn", "gemv_bf16_multi_r4_qn",
               "gemv_bf16_multi_r1t2_qn", "gemv_bf16_multi_r4t2_qn", "gemv_bf16_pl_r2_qn", "gemv_bf16_pl_r4_qn",
               "gemv_bf16_pl2_r2", "gemv_bf16_pl2_r4", "build_cand",
               "gemv_bf16_multi_pl_r1", "gemv_bf16_multi_pl_r4", "gemv_bf16_multi_pl_r1t2"),
    # FP4_DN_PRELOAD = 2 (the default): the full-shape down + combine (the NVFP4 _w2 keeps the plain entry)
    "experts": ("gemv_mxfp4_down_combine_k2_f", "gemv_nvfp4_down_combine_k2_f", "gemv_mxfp4_down_combine_k2_f_w2",
                # the shared expert's SwiGLU before the wait (MEMRA_DSV4_SHARED_GATEUP)
                "gemv_mxfp4_gateup_k4_f_sh", "gemv_nvfp4_gateup_k4_f_sh"),
}

NVDISASM = nvdisasm()
need_tools = pytest.mark.skipif(shutil.which("nvcc") is None or NVDISASM is None,
                                reason="nvcc / nvdisasm not found (PATH, or the nvidia-cuda-nvdisasm wheel)")


# build macros a module's preload kernels need (experts.cu: FP4_DN_PRELOAD, default 2, pinned here)
DEFINES = {"experts": ("-DFP4_DN_PRELOAD=2",)}


def _sass(stem: str, tmp_path) -> str:
    cubin = os.path.join(tmp_path, f"{stem}.cubin")
    subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-cubin", "-O3", *DEFINES.get(stem, ()), "-I", KDIR,
                    "-o", cubin, os.path.join(KDIR, f"{stem}.cu")], check=True, capture_output=True, text=True)
    return subprocess.run([NVDISASM, "-c", cubin], check=True, capture_output=True, text=True).stdout


def _function(sass: str, name: str) -> list[str]:
    """The instruction lines of kernel ``name`` (its .text section)."""
    m = re.search(rf"^\.text\.{re.escape(name)}:\n(.*?)(?=^\s*\.section|\Z)", sass, re.S | re.M)
    assert m, f"kernel {name} not in the disassembly"
    return [ln for ln in m.group(1).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]


def _first(lines: list[str], opcode: str) -> int:
    for i, ln in enumerate(lines):
        if re.search(rf"\b{opcode}\b", ln):
            return i
    return -1


def test_preload_kernels_are_the_ones_the_sources_declare():
    """Every module listed opens the kernels above with PDL_ENTRY_PRELOAD, and no other module
    uses it (so the SASS check below covers every preload in the tree)."""
    for fn in sorted(os.listdir(KDIR)):
        if not fn.endswith(".cu"):
            continue
        src = open(os.path.join(KDIR, fn)).read()
        uses = src.count("PDL_ENTRY_PRELOAD(") - src.count("#define PDL_ENTRY_PRELOAD(")
        stem = fn[:-3]
        assert (uses > 0) == (stem in PRELOAD_KERNELS), f"{fn}: {uses} PDL_ENTRY_PRELOAD uses"


@need_tools
@pytest.mark.parametrize("stem", sorted(PRELOAD_KERNELS))
def test_preloads_issue_before_the_wait(stem, tmp_path):
    sass = _sass(stem, str(tmp_path))
    for name in PRELOAD_KERNELS[stem]:
        lines = _function(sass, name)
        wait, load = _first(lines, "ACQBULK"), _first(lines, "LDG")
        assert wait >= 0, f"{name}: no ACQBULK (griddepcontrol.wait) in its SASS"
        assert 0 <= load < wait, (f"{name}: the first LDG (instruction {load}) is not before the PDL "
                                  f"wait (instruction {wait}): ptxas moved the wait above the preload")
        # common.cuh: every store (and atomic) stays after the wait
        early = [ln.strip() for ln in lines[:wait] if re.search(r"\b(STG|ATOMG|RED|ST)\b", ln)]
        assert not early, f"{name}: global stores before the PDL wait: {early[:3]}"


@need_tools
def test_paced_l2_prefetch_before_the_wait(tmp_path):
    """decode.cu l2_prefetch_paced (MEMRA_DSV4_L2_SIDE) opens with PDL_ENTRY_PRELOAD too, but its
    preload is cp.async.bulk.prefetch.L2 (UBLKPF) with __nanosleep between requests, not LDG:
    both must precede the wait."""
    lines = _function(_sass("decode", str(tmp_path)), "l2_prefetch_paced")
    wait, pf, nap = _first(lines, "ACQBULK"), _first(lines, "UBLKPF.L2"), _first(lines, "NANOSLEEP")
    assert wait >= 0 and 0 <= pf < wait and 0 <= nap < wait, (wait, pf, nap)


@need_tools
def test_down_w2_preload_cp_async_before_the_wait(tmp_path):
    """experts.cu FP4_DN_PRELOAD = 2: the MXFP4 _w2 kernel's first shared-w2 trip goes to shared
    memory by cp.async (LDGSTS) before the wait, beside the ring's LDGs; at level 0 nothing does."""
    lines = _function(_sass("experts", str(tmp_path)), "gemv_mxfp4_down_combine_k2_f_w2")
    wait, cpa = _first(lines, "ACQBULK"), _first(lines, "LDGSTS")
    assert 0 <= cpa < wait, (cpa, wait)
    cubin = os.path.join(str(tmp_path), "experts0.cubin")
    subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-cubin", "-O3", "-DFP4_DN_PRELOAD=0", "-I", KDIR,
                    "-o", cubin, os.path.join(KDIR, "experts.cu")], check=True, capture_output=True, text=True)
    sass0 = subprocess.run([NVDISASM, "-c", cubin], check=True, capture_output=True, text=True).stdout
    lines0 = _function(sass0, "gemv_mxfp4_down_combine_k2_f_w2")
    wait0 = _first(lines0, "ACQBULK")
    assert 0 <= wait0 and not any(re.search(r"\b(LDG|LDGSTS)\b", ln) for ln in lines0[:wait0]), wait0


def _count(lines: list[str], pattern: str) -> int:
    return sum(1 for ln in lines if re.search(pattern, ln))


@need_tools
def test_hc_cluster_preload_and_handoff_order(tmp_path):
    """hc.cu hc_boundary_pre_cluster (cluster.cuh's handoff): before the PDL wait, thread 0's two
    mbarrier inits + expect_tx (SYNCS.EXCH.64, SYNCS.ARRIVE.TRANS64, twice) and the one
    FENCE.VIEW.ASYNC.S come before the norm weight's cp.async (LDGSTS: a fence behind it waits for
    the copy, ~1 us on thread 0's warp), then exactly the 6 fn loads (3 rows x 2 float4,
    ld.global.nc: LDG.E.NA.128.CONSTANT) and the one LDGSTS, then the relaxed cluster arrive
    (UCGABAR_ARV); no global or remote store, no cluster wait, no mbarrier wait and no MEMBAR
    before the wait.  After it, the cluster wait (UCGABAR_WAIT) before the first st.async (STAS)
    and the mbarrier waits (SYNCS.PHASECHK) after that; no MEMBAR anywhere
    (barrier.cluster.arrive.release, membar and fence.acq_rel would put one there)."""
    lines = _function(_sass("hc", str(tmp_path)), "hc_boundary_pre_cluster")
    wait = _first(lines, "ACQBULK")
    assert wait >= 0 and _count(lines, r"\bACQBULK\b") == 1
    pre = lines[:wait]
    at = lambda pat: [i for i, ln in enumerate(pre) if re.search(pat, ln)]
    ldg, ldgsts, fence = at(r"\bLDG\b"), at(r"\bLDGSTS\b"), at(r"\bFENCE\.VIEW\.ASYNC\.S\b")
    inits, expects, arv = at(r"\bSYNCS\.EXCH\.64\b"), at(r"\bSYNCS\.ARRIVE\.TRANS64\b"), at(r"\bUCGABAR_ARV\b")
    assert len(ldg) == 6 == len(at(r"\bLDG\.E\.NA\.128\.CONSTANT\b")), [pre[i].strip() for i in ldg]
    assert len(ldgsts) == 1 and len(fence) == 1 and len(inits) == 2 == len(expects) and len(arv) == 1
    assert max(fence + inits + expects) < ldgsts[0], (fence, inits, expects, ldgsts)   # the mbarriers first
    assert max(ldg + ldgsts + inits + expects) < arv[0], (ldg, ldgsts, arv)
    early = [ln.strip() for ln in pre if re.search(r"\b(STG|STAS|ST|ATOMG|RED|MEMBAR|UCGABAR_WAIT)\b", ln)
             or re.search(r"\bSYNCS\.PHASECHK", ln)]
    assert not early, early[:3]
    post = lines[wait:]
    cwait, stas, phase = _first(post, "UCGABAR_WAIT"), _first(post, "STAS"), _first(post, r"SYNCS\.PHASECHK\.TRANS64")
    assert 0 <= cwait < stas < phase and _count(post, r"\bUCGABAR_WAIT\b") == 1, (cwait, stas, phase)
    assert _count(post, r"\bSYNCS\.PHASECHK\.TRANS64") >= 2   # the partials' and x's mbarrier waits
    assert not [ln.strip() for ln in lines if re.search(r"\bMEMBAR\b", ln)]


@need_tools
def test_multi_pl_weights_before_the_wait(tmp_path):
    """gemv_bf16_multi_pl_r{R}[t{T}]: every one of the warp's first-trip weight loads (R rows x
    T trips x 4 chunks, 16-byte streamed loads) is issued before griddepcontrol.wait, not only the
    table's small loads (which the generic check above would also accept)."""
    sass = _sass("decode", str(tmp_path))
    for name, (R, T) in {"gemv_bf16_multi_pl_r1": (1, 1), "gemv_bf16_multi_pl_r4": (4, 1),
                         "gemv_bf16_multi_pl_r1t2": (1, 2)}.items():
        lines = _function(sass, name)
        wait = _first(lines, "ACQBULK")
        assert wait > 0, f"{name}: no ACQBULK"
        early = [ln for ln in lines[:wait] if re.search(r"\bLDG\.E\.NA\.128", ln)]
        assert len(early) == 4 * R * T, f"{name}: {len(early)} weight loads before the wait, expected {4 * R * T}"
