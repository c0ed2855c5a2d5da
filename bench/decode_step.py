"""Decode-step A/B benchmark of the GPU runtime.

    python -m bench.decode_step --model synthetic:flash --devices 0,1 \\
        --arms path=legacy,path=device --steps 30 --ctx 1024 --warmup 3

One model is loaded; every arm gets its own DecodeState prefilled with the same --ctx tokens
(its own pending rows / ring, so arms never share state) and decodes greedily from there.
Arms (bench.harness.parse_arms): ``path=legacy|device-hostmath|device`` (the decode path seam,
set on the model per step; an arm whose path is not implemented is reported and dropped),
``pdl=on|off`` (programmatic dependent launch in the device step, gpu/pdl.py; each arm captures
its own graphs, so ``path=device+pdl=off,path=device+pdl=on`` is an A/B in one process) and
``attn=split|fused`` (the device step's sparse attention, seam MEMRA_DSV4_DECODE_ATTN: build_cand
+ split kernel + combine, or the one-launch sparse_attention_decode; bit-identical; each arm
captures its own graphs, so ``path=device+attn=split,path=device+attn=fused`` is an A/B in one
process); ``l2pf=off|8|16|32|64|128`` (seam MEMRA_DSV4_L2_PREFETCH: MB of each dense GEMV's
weights asked of the L2 before its PDL wait; a constant the kernels read when they run, so the
arms share graphs; bit-identical); ``fork=off|on|single|all`` (seam MEMRA_DSV4_DECODE_FORK: the
attention's kv / compressor and indexer launches on side graph branches beside wq_b; bit-identical);
``hcsplit=off|on`` (seam MEMRA_DSV4_HC_SPLIT: each sub-layer boundary as hc_boundary_pre +
hc_boundary_sinkhorn, the Sinkhorn on a side graph branch beside the sub-layer; bit-identical;
each arm captures its own graphs, so ``path=device+hcsplit=off,path=device+hcsplit=on`` is an
A/B in one process); ``prio=off|side|attn`` (seam MEMRA_DSV4_DECODE_PRIORITY: the side branches, or all but
the shared expert's, on greatest-priority streams, graphs instantiated with node priorities;
bit-identical; each arm captures its own graphs); ``qnorm=kernel|attn`` (seam MEMRA_DSV4_DECODE_QNORM: the per-head q norm +
q RoPE as its own head_rms launch after wq_b, or inside the sparse attention's q load (_qn
kernels); bit-identical; each arm captures its own graphs, so
``path=device+qnorm=kernel,path=device+qnorm=attn`` is an A/B in one process); ``w2=gemv|fused``
(seam MEMRA_DSV4_DECODE_SHARED_W2: the shared expert's w2 as its own gemv_bf16 launch, or computed
by the routed down + combine kernel (_k2_f_w2; bf16 dense, Flash shapes); bit-identical; each arm
captures its own graphs).  Kernel-choice
settings for in-process A/B of kernels that are not seams yet:
``gemv=base|pick`` (base: ops_decode's current defaults; pick: the MEMRA_DSV4_GEMV_VARIANT value
read from ``--gemv-pick FILE``, e.g. written by ``tools/bench_gemv.py --suggest FILE``) and
``hc=lastcta|poll`` (MEMRA_DSV4_HC_BOUNDARY_IMPL), ``fp4full=on|off`` (MEMRA_DSV4_FP4_FULL: the
full-shape FP4 expert kernels or the general ones, ops.experts) and ``fp4ring=on|off``
(MEMRA_DSV4_FP4_RING: the full-shape gate/up with its weight ring in shared memory),
``gupdl=on|off`` (MEMRA_DSV4_GATEUP_PDL: the routed gate/up launched with PDL or plainly, so that
the shared expert's and the Sinkhorn's branches can run beside the router) and ``idxsel=fused|split|auto``
(MEMRA_DSV4_INDEXER_SELECT: the CSA indexer's scores + top-k as the one-launch indexer_fused_d128, or
indexer_scores_tiles_d128 + indexer_select_d128, the selection on 1024 threads, or auto (the
default: split when the key row holds more than k); bit-identical, ops.indexer.scores_topk),
``l2side=off|wq|wo|both``, ``l2mb=8|16|24|32|48``, ``l2ns=0|100|200|400|800`` (MEMRA_DSV4_L2_SIDE,
_MB, _NS: a paced L2 prefetch of wq_b's / wo_a's first MB on the hc side stream; step_device.l2_side_targets),
``hcjoin=boundary|early|ride|ride_attn`` (MEMRA_DSV4_HC_JOIN: the hc Sinkhorn branch joined before the next
boundary or into the attention / down + combine, or the Sinkhorn run first on the attention's /
the shared expert's side stream; bit-identical, step_device.hc_join_form),
``idxpair=on|off`` (MEMRA_DSV4_IDXQ_PAIR: the CSA indexer's q GEMV inside wq_b's launch or its own;
on is the default since the thirty-first session; bit-identical, step_device.idxq_pair_on), ``wqbqn=on|off`` (MEMRA_DSV4_WQB_QNORM: the attention's q_norm inside wq_b, every CTA norming
the raw row, or as its own launch; bit-identical, step_device.wqb_qnorm_on), ``carve=default|driver|max|maxl1|fit1|fit1h8|fit1h16|fit1h32|fitocc|25|50|75`` (MEMRA_DSV4_SMEM_CARVEOUT: default = fit1h16
since the thirty-third session, the one-wave launches that use shared memory each prefer the
smallest carveout holding one CTA plus 16 KB for the next kernel's CTAs; fit1: without the
headroom, the default in the thirty-second session (arms named carve=default then meant fit1);
fit1h8 / fit1h32: other headrooms; driver: no preference, the default before (arms named
carve=default before the thirty-second session meant driver); fitocc: every launch with shared
memory its occupancy's share; max / maxl1 / a percentage: every PDL launch; pdl.smem_carveout), ``mqn=on|off`` (MEMRA_DSV4_MULTI_QNORM: the attention's q_norm in the multi GEMV's last CTA or as its
own rmsnorm launch; bit-identical, step_device.multi_qnorm_on), ``shgu=on|off``
(MEMRA_DSV4_SHARED_GATEUP: the shared expert's SwiGLU computed by the routed gate/up's launch
before its PDL wait, or as its own launch on the MoE side branch; bit-identical,
step_device.shared_gateup_on), ``rhand=ticket|cluster`` (MEMRA_DSV4_ROUTER_HANDOFF: the
device router's selection handed over through a ticket and L2 or inside one thread-block cluster
through DSMEM; bit-identical, step_device.router_handoff), ``shspare=router|grid|none``
(MEMRA_DSV4_SHARED_GATEUP_SPARE: the routed gate/up's CTAs that land on the router cluster's SMs
without shared-expert rows, or a gate/up grid sized for the other SMs; bit-identical,
step_device.shared_gateup_spare), ``hchand=ticket|cluster|coop|coopall`` (MEMRA_DSV4_HC_PRE_HANDOFF: the
boundary's critical launch as the last-CTA ticket kernel, one thread-block cluster exchanging
partials and x through DSMEM, or the cooperative grid polling tagged global words (8 tail CTAs, or all); bit-identical, step_device.hc_pre_handoff),
``attnhg=auto|own|16|8|4`` (MEMRA_DSV4_DECODE_ATTN_HG: the split attention kernel's heads per CTA, a group
below H's own with every tile in its own CTA; auto, the default, is 8 for Flash's 64 heads, own
the largest group dividing H, 16 for Flash: the default before the thirty-first session, when arms
named auto meant own; bit-identical, step_device.decode_attn_head_group),
``feed=host|token|device`` (how the arm's steps get their tokens: host, the default, reads the logits
back and takes np.argmax on the host; token, decode_step(readback="token"), 4 bytes back; device,
Dsv4Gpu.decode_greedy over --feed-chunk steps per sample, the tokens fed on the device and one host
wait per sample, the sample divided by the chunk; its bytes and floors at its own middle position), and
``kernels=tree|base`` (the arm's kernels from this checkout's kernels_cu or from ``--base-kernels
DIR``, e.g. the tree of the commit before a kernel change: kernel_loader.use_kernels_dir); the arm sets these variables
before each of its steps (outside the timed sample: harness.Arm.setup), so its graphs are captured with its kernels (give a kernel setting in
every arm: one an arm leaves out keeps the previous arm's value).  A setting an arm leaves out is the
model's (its seam's) value; the JSON records each arm's settings as given and as resolved.
Timing: arms interleaved round-robin in one process (harness.run_interleaved) with
CudaEventTimer on the first stage's compute stream; the step ends in the host readback of
the logits after every device synchronised, so each sample is the whole step as a caller of
decode_step pays it.  The arm's own setup (its env variables and model attributes, which the
in-process A/B needs and an engine does not) runs before the sample's start event (since
the twenty-eighth session; before it, ~30 us of it per host-fed sample were timed), and so do
``--prime N`` untimed one-token steps of the arm (default 1 with several arms): a sample starts
with its arm's graph just run, not with the switch from another arm's graphs (_ArmState.prime).
Per arm: median ms/step, p10/p90/iqr, tok/s, ratio to the first arm, bytes the step must read
(gpu.step.step_bytes summed over stages at the mid position: weights one token touches as this
runtime stores them (dense bf16, experts stored FP4), the KV it attends, pending compressor
rows, the head) over the median as a fraction of the copy bandwidth measured in this run
(harness.measure_copy_bandwidth), and two floors: its own (those bytes / copy bw) and the
native one (dense FP8 + FP4 experts + bf16 head, ~11.2 GB/token for Flash).  Phase report
per arm: --phase-steps EAGER steps in events mode after the timed run (the device arm calls
device_step(graph=False): same launches as its graph, bracketed with the legacy phase names).
``--device-trace N`` (device arms; the process must run with MEMRA_DSV4_DEVICE_TRACE=on, so
every kernel is the trace build from the start): N more graph-replayed steps with the kernels'
per-CTA %globaltimer records collected after each (profiling.device_trace); prints the median
step's critical chain (kernel time vs dependency-edge time, per kernel) and every kernel's
in-step busy time, and stores them in the JSON.  The trace build's own step time is the arm's
median in that run: compare it with an untraced run before reading the timeline's totals.
``--delay-probe US`` (device arms, trace build; ``--probe-rounds``, ``--probe-steps``): each
kernel of the step in turn waits US microseconds per launch after its PDL wait, and the step is
timed against undelayed blocks on both sides (profiling.delay_probe): per kernel the added time
per step and its slope (added time / (launches x US): ~1 on the critical path, ~0 hidden).  Runs
last for the arm and rewinds its state to one position for every block.
JSON + PNG via harness.write_results (bench/results/).
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np


def _load(model: str, devices, max_seq_len: int, dense: str | None = None,
          expert_storage: str = "per-layer"):
    from memra_dsv4.gpu.model import Dsv4Gpu
    kw = {} if dense is None else {"dense": dense}
    if model.startswith("synthetic:"):
        return Dsv4Gpu.synthetic(model.split(":", 1)[1], devices=devices, seed=0,
                                 max_seq_len=max_seq_len, decode_path="legacy",
                                 expert_storage=expert_storage, **kw)
    from memra_dsv4.checkpoint import Checkpoint
    return Dsv4Gpu.load(Checkpoint.open(model), devices=devices, max_seq_len=max_seq_len,
                        decode_path="legacy", **kw)


def _dense_of(m) -> str:
    return getattr(m.stages[0], "dense_fmt", "bf16")


def _stages(m):
    return [(list(st.layers), st.has_embed, st.has_head) for st in m.stages]


def _expert_fmt(m) -> str:
    fmts = {f for st in m.stages for f in st.expert_fmt.values()}
    return "nvfp4" if "nvfp4" in fmts else "mxfp4"


def random_filled_state(m, ctx: int, max_seq_len: int, seed: int = 0):
    """A DecodeState at pos = ctx whose caches hold random bf16 values instead of a prefill's:
    every ring row, compressed row and indexer key a step can read (the step's bytes and work
    depend on pos, not on the values), pending compressor rows reset (ctx % 128 == 0, so no
    block is open).  For long-context decode benches, where a 32K prefill would cost minutes."""
    import cupy as cp
    if ctx % 128:
        raise SystemExit(f"--fill random: --ctx {ctx} must be a multiple of 128")
    st = m.new_state(max_seq_len)
    rngs = {}                               # a cuRAND generator belongs to the device it was made on
    for c in st.layers:
        with cp.cuda.Device(c.device):
            rng = rngs.get(c.device)
            if rng is None:
                rng = rngs[c.device] = cp.random.default_rng(seed + c.device)
            for buf in (c.kv, c.idx_keys):
                if buf is not None:
                    v = rng.standard_normal(buf.shape, dtype=cp.float32)
                    buf[...] = (v.view(cp.uint32) >> 16).astype(cp.uint16)
    for d in m.devs:
        d.compute.synchronize()
    st.pos = ctx
    return st


# The non-seam arm settings: each stands for an env variable the kernels' wrappers read at every
# launch (_kernel_env sets its value), not a model attribute.
_KERNEL_SETTINGS = {
    "gemv": SimpleNamespace(allowed=("base", "pick"), env="MEMRA_DSV4_GEMV_VARIANT"),
    "hc": SimpleNamespace(allowed=("lastcta", "poll"), env="MEMRA_DSV4_HC_BOUNDARY_IMPL"),
    "fp4full": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_FP4_FULL"),
    "fp4ring": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_FP4_RING"),
    "gupdl": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_GATEUP_PDL"),
    "idxsel": SimpleNamespace(allowed=("fused", "split", "auto"), env="MEMRA_DSV4_INDEXER_SELECT"),
    "mqn": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_MULTI_QNORM"),
    "shgu": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_SHARED_GATEUP"),
    "rhand": SimpleNamespace(allowed=("ticket", "cluster"), env="MEMRA_DSV4_ROUTER_HANDOFF"),
    "hchand": SimpleNamespace(allowed=("ticket", "cluster", "coop", "coopall"), env="MEMRA_DSV4_HC_PRE_HANDOFF"),
    "attnhg": SimpleNamespace(allowed=("auto", "own", "16", "8", "4"), env="MEMRA_DSV4_DECODE_ATTN_HG"),
    "shspare": SimpleNamespace(allowed=("router", "grid", "none"), env="MEMRA_DSV4_SHARED_GATEUP_SPARE"),
    "wqbqn": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_WQB_QNORM"),
    "idxpair": SimpleNamespace(allowed=("on", "off"), env="MEMRA_DSV4_IDXQ_PAIR"),
    "l2side": SimpleNamespace(allowed=("off", "wq", "wo", "both"), env="MEMRA_DSV4_L2_SIDE"),
    "l2mb": SimpleNamespace(allowed=("8", "16", "24", "32", "48"), env="MEMRA_DSV4_L2_SIDE_MB"),
    "l2ns": SimpleNamespace(allowed=("0", "100", "200", "400", "800"), env="MEMRA_DSV4_L2_SIDE_NS"),
    "hcjoin": SimpleNamespace(allowed=("boundary", "early", "ride", "ride_attn"), env="MEMRA_DSV4_HC_JOIN"),
    "carve": SimpleNamespace(allowed=("default", "driver", "max", "maxl1", "fit1", "fit1h8", "fit1h16", "fit1h32", "fitocc",
                                      "25", "50", "75"),
                             env="MEMRA_DSV4_SMEM_CARVEOUT")}


def _arm_settings() -> dict:
    """Arm setting -> the seam whose allowed values it takes (path: MEMRA_DSV4_DECODE_PATH, pdl:
    MEMRA_DSV4_PDL, attn: MEMRA_DSV4_DECODE_ATTN, ..., qnorm: MEMRA_DSV4_DECODE_QNORM), then the
    non-seam settings (_KERNEL_SETTINGS)."""
    from memra_dsv4 import seams
    return {"path": seams.SEAM_DECODE_PATH, "pdl": seams.SEAM_PDL, "attn": seams.SEAM_DECODE_ATTN,
            "l2pf": seams.SEAM_L2_PREFETCH, "fork": seams.SEAM_DECODE_FORK,
            "hcsplit": seams.SEAM_HC_SPLIT, "prio": seams.SEAM_DECODE_PRIORITY,
            "qnorm": seams.SEAM_DECODE_QNORM, "w2": seams.SEAM_DECODE_SHARED_W2, **_KERNEL_SETTINGS,
            "kernels": _KERNELS_TREE, "feed": _FEED}


def _kernel_env(s: dict, gemv_pick: str | None) -> dict:
    """The env values an arm's non-seam settings (_KERNEL_SETTINGS) stand for ({} when it gives
    none): the setting's value itself, except gemv (pick: the --gemv-pick file's contents, base:
    empty) and fp4full / fp4ring (on / off: 1 / 0)."""
    env = {}
    for key, spec in _KERNEL_SETTINGS.items():
        if key not in s:
            continue
        val = s[key]
        if key == "gemv":
            val = ""
            if s["gemv"] == "pick":
                if not gemv_pick:
                    raise SystemExit(f"arm {s}: gemv=pick needs --gemv-pick FILE")
                with open(gemv_pick) as fh:
                    val = fh.read().strip()
        elif key in ("fp4full", "fp4ring"):   # ops.experts reads 1 / 0
            val = "1" if val == "on" else "0"
        env[spec.env] = val
    return env


# The env variables behind the non-seam arm settings, and their values when this module was
# imported (None: unset).  An arm that does not name one of these settings runs with that start
# value, not with whatever the arm before it set: arms share one process, and the variables are
# read at every launch.
# kernels=tree|base: the kernel tree the arm's launches (and graphs) use: this checkout's
# (MEMRA_DSV4_KERNELS_DIR) or --base-kernels DIR (kernel_loader.use_kernels_dir), for an
# in-process A/B of a kernel change against the tree before it (e.g. `git archive BASE
# kernels_cu | tar -x -C ab_base`); the kernels' signatures must match what this checkout's
# Python launches
class _ArmOnlySetting:   # an arm setting that is neither a seam nor an env variable
    def __init__(self, allowed: tuple, env: str):
        self.allowed, self.env = allowed, env


_KERNELS_TREE = _ArmOnlySetting(("tree", "base"), "--base-kernels DIR, kernel_loader.use_kernels_dir")
# feed=host|token|device: how the arm's steps get their tokens.  host (the default, every session
# before the twenty-seventh): decode_step returns the logits, the arm takes np.argmax on the host;
# token: decode_step(readback="token"), the head's greedy argmax read back as 4 bytes; device:
# decode_greedy over --feed-chunk steps per sample (the next token fed on the device, one host
# wait per chunk), the sample divided by the chunk: ms per token with the host off the chain
_FEED = _ArmOnlySetting(("host", "token", "device"), "bench arm only: Dsv4Gpu.decode_step / decode_greedy")
KERNEL_ENVS = tuple(s.env for s in _KERNEL_SETTINGS.values())
_START_ENV = {k: os.environ.get(k) for k in KERNEL_ENVS}


def _kernels_dir(s: dict, base_kernels: str | None, files: bool = True) -> str | None:
    """The kernel tree of an arm: None (this checkout's) unless it says kernels=base, which
    needs --base-kernels DIR (SystemExit naming the arm otherwise, or when DIR is not a tree
    with the .cu files this checkout registers; ``files=False``: that last check skipped, for
    the check before any GPU work, when the ops have not registered their stems yet)."""
    if s.get("kernels", "tree") == "tree":
        return None
    if not base_kernels:
        raise SystemExit(f"arm {s}: kernels=base needs --base-kernels DIR")
    if not os.path.isdir(base_kernels):
        raise SystemExit(f"arm {s}: --base-kernels {base_kernels} is not a directory")
    if not files:
        return os.path.abspath(base_kernels)
    from memra_dsv4.gpu import kernel_loader
    missing = [f"{stem}.cu" for stem in sorted(kernel_loader.registered())
               if not os.path.isfile(os.path.join(base_kernels, f"{stem}.cu"))]
    if missing:
        raise SystemExit(f"arm {s}: --base-kernels {base_kernels} lacks {', '.join(missing)}")
    return os.path.abspath(base_kernels)


def complete_kernel_env(own: dict) -> dict:
    """An arm's kernel env values (_kernel_env) over the start values of every KERNEL_ENVS
    variable: what the arm applies before each of its steps (None or '': unset)."""
    env = {k: _START_ENV.get(k) for k in KERNEL_ENVS}
    env.update(own)
    return env


def _arm_setup(st: "_ArmState", prime: int):
    """The untimed part of an arm's sample (harness.Arm.setup): its settings made the model's,
    then ``prime`` primed steps (_ArmState.prime)."""
    def setup() -> None:
        st.apply()
        st.prime(prime)
    return setup


def check_arms(spec: str) -> list[dict]:
    """``--arms`` parsed (bench.harness.parse_arms) and validated before any GPU work: only the
    settings path / pdl / attn, each with a value its seam allows; SystemExit naming the arm,
    the setting and the allowed values otherwise."""
    from bench.harness import parse_arms
    known = _arm_settings()
    arms = parse_arms(spec)
    for s in arms:
        unknown = set(s) - set(known)
        if unknown:
            raise SystemExit(f"arm {s}: unknown setting(s) {sorted(unknown)}; known: "
                             f"{', '.join(known)}")
        for key, seam in known.items():
            if key in s and s[key] not in seam.allowed:
                raise SystemExit(f"arm {s}: {key}={s[key]!r}; expected one of "
                                 f"{', '.join(seam.allowed)} "
                                 f"({'' if isinstance(seam, _ArmOnlySetting) else 'seam '}{seam.env})")
    # the samples are keyed by the arm's name (harness.arm_label): two arms with the same
    # settings would be refused by run_interleaved only after every arm was set up (each
    # prefills and captures its own state: ~15 s per arm at full depth), so refuse them here
    from bench.harness import arm_label
    labels = [arm_label(s) for s in arms]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise SystemExit(f"--arms: arm(s) {', '.join(dup)} given more than once (the samples are keyed by the "
                         f"arm's name; to repeat a setting, add a no-op one, e.g. attnhg=auto)")
    return arms


class _ArmState:
    def __init__(self, m, path: str, ids, max_seq_len: int, fill: str = "prefill",
                 pdl: str | None = None, attn: str | None = None, kernel_env: dict | None = None,
                 l2pf: str | None = None, fork: str | None = None, hcsplit: str | None = None,
                 prio: str | None = None, qnorm: str | None = None, w2: str | None = None,
                 kernels_dir: str | None = None, feed: str = "host", feed_chunk: int = 1):
        from memra_dsv4.gpu.decode import resolve_decode_path
        self.kernels_dir = kernels_dir   # None: this checkout's tree (kernels=tree)
        self.feed, self.feed_chunk = feed, int(feed_chunk)   # see _FEED
        # env var -> value set before each step: every KERNEL_ENVS variable, so a setting the arm
        # does not name is the process's start value, not the previous arm's
        self.kernel_env = complete_kernel_env(kernel_env or {})
        self._apply_env()
        self.m, self.path = m, resolve_decode_path(path, announce=False)
        self.pdl = pdl or getattr(m, "pdl", "off")   # the arm's PDL setting (device path only)
        self.attn = attn or getattr(m, "decode_attn", "split")  # decode attention form (device)
        self.l2pf = l2pf or getattr(m, "l2_prefetch", "off")     # GEMV L2 prefetch budget (device)
        self.fork = fork or getattr(m, "decode_fork", "all")     # attention graph branches (device)
        self.hcsplit = hcsplit or getattr(m, "hc_split", "off")  # hc boundary split (device)
        self.prio = prio or getattr(m, "decode_priority", "off")  # graph branch priority (device)
        self.qnorm = qnorm or getattr(m, "decode_qnorm", "kernel")  # q head norm form (device)
        self.w2 = w2 or getattr(m, "decode_shared_w2", "fused")  # shared w2 form (device)
        if fill == "random":
            self.state, self.tok = random_filled_state(m, len(ids), max_seq_len), int(ids[-1])
        else:
            logits, self.state = m.prefill(ids, m.new_state(max_seq_len))
            self.tok = int(np.argmax(logits))

    def _apply_env(self) -> None:
        from memra_dsv4.gpu import kernel_loader
        for k, v in self.kernel_env.items():
            if v:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
        kernel_loader.use_kernels_dir(getattr(self, "kernels_dir", None))

    def apply(self) -> None:
        """Make this arm the model's: its kernel env values and its settings on the model (the
        arms share one model; each step of an arm starts here)."""
        self._apply_env()
        self.m.decode_path, self.m.pdl, self.m.decode_attn = self.path, self.pdl, self.attn
        self.m.l2_prefetch, self.m.decode_fork, self.m.hc_split = self.l2pf, self.fork, self.hcsplit
        self.m.decode_priority, self.m.decode_qnorm = self.prio, self.qnorm
        self.m.decode_shared_w2 = self.w2

    def step(self) -> None:
        """apply(), then run(): one sample of this arm from any arm's state."""
        self.apply()
        self.run()

    def run(self) -> None:
        """One sample of this arm, its settings already the model's (apply): what the bench
        times (the A/B's own apply runs before the timed region, harness.Arm.setup)."""
        self._feed(self.feed_chunk)   # feed=device: one sample = feed_chunk tokens (main() divides)

    def _feed(self, chunk: int) -> None:
        """One call of this arm's feed: decode_greedy of ``chunk`` tokens (device), or one step
        with the token read back (token) or the logits and np.argmax (host)."""
        if self.feed == "device":
            self.tok = int(self.m.decode_greedy(self.state, self.tok, chunk)[-1])
        elif self.feed == "token":
            self.tok = int(self.m.decode_step(self.state, self.tok, readback="token"))
        else:
            self.tok = int(np.argmax(self.m.decode_step(self.state, self.tok)))

    def prime(self, n: int) -> None:
        """``n`` untimed one-token steps of this arm's feed (device: decode_greedy of 1 token;
        token: readback="token"; host: the logits and np.argmax), each ending in its host wait,
        so the GPU is idle again when the timed sample starts.  Why: in an interleaved A/B each
        sample would otherwise be the first run of its arm's graph right after the other arms'
        ran, so whatever that switch costs (the other arm's L2 / TLB contents; in the thirtieth
        session, with nine or more arms, a recapture per sample from DeviceStep's then 8-state
        graph cache: ~70 ms per sample at full depth, since fixed) lands in the arm's number,
        while an engine stepping one sequence never pays it."""
        for _ in range(n):
            self._feed(1)

    def eager_step(self) -> None:
        """One step for the phase report: the same launches as step(), issued eagerly so the
        phase brackets record events (a device-path graph replay has no per-phase brackets)."""
        self.apply()
        if self.path == "device":
            from memra_dsv4.gpu.step import device_step
            logits = device_step(self.m, self.state, self.tok, graph=False)
        else:
            logits = self.m.decode_step(self.state, self.tok)
        self.tok = int(np.argmax(logits))


def _launch_profile(st, reps: int, flush_bytes: int) -> dict:
    """One eager device step recorded launch by launch, each launch then timed alone as a
    graph of ``reps`` copies (memra_dsv4.profiling.launches); prints and returns the tables."""
    from memra_dsv4.profiling.launches import aggregate, format_rows, record_launches, time_launches

    recs = record_launches(st.eager_step, ("step_device.py",))   # a device arm: device_step(graph=False)
    times = time_launches(recs, reps=reps, flush_bytes=flush_bytes)
    by_k, by_s = aggregate(recs, times, "kernel"), aggregate(recs, times, "site")
    print(f"launch profile: {len(recs)} launches, sum {sum(times) / 1e3:.3f} ms "
          f"(each alone, graph of {reps} copies{', L2 flushed' if flush_bytes else ''})")
    print(format_rows(by_k, "kernel"))
    print(format_rows(by_s, "site"))
    return {"count": len(recs), "sum_ms": sum(times) / 1e3, "reps": reps,
            "flush_bytes": flush_bytes, "by_kernel": by_k, "by_site": by_s}


def _device_trace(st, devices, steps: int) -> dict:
    """``steps`` graph-replayed steps with the trace build's records collected after each
    (profiling.device_trace); prints the step with the median device-0 span and returns every
    step's summary plus that step's launches (ns from the device's first CTA start)."""
    from memra_dsv4.profiling import device_trace as DT
    runs = []
    for _ in range(steps):
        DT.reset(devices)
        st.step()
        ls = DT.launches(DT.collect(devices))
        runs.append((DT.summarize(ls), ls))
    key = str(devices[0])
    runs.sort(key=lambda r: r[0].get(key, {}).get("span_us", 0.0))
    summ, ls = runs[len(runs) // 2]
    print(f"device trace: {steps} steps; the median step (by device {key}'s span):")
    print(DT.format_summary(summ))
    t0 = {d: min(L.start for L in ls if L.device == d) for d in {L.device for L in ls}}
    return {"steps": [r[0] for r in runs], "median_step": summ,
            "median_step_launches": [
                {"device": L.device, "kernel": L.kernel, "ctas": L.ctas,
                 "start_ns": L.start - t0[L.device], "go_ns": L.go - t0[L.device],
                 "go_last_ns": L.go_last - t0[L.device], "end_ns": L.end - t0[L.device]}
                for L in ls]}


def _delay_probe(st, devices, timer, delay_us: float, rounds: int, steps: int) -> dict:
    """The delay probe (profiling.delay_probe) on this arm's graph-replayed step: the kernels of
    one traced step, each made to wait ``delay_us`` per launch in turn; prints and returns the
    table.  Rewinds the arm's state to its position at the start for every block (run it after
    everything else that reads the state)."""
    from memra_dsv4.profiling import delay_probe as DP
    from memra_dsv4.profiling import device_trace as DT
    DT.set_delay(None, 0, devices)
    DT.reset(devices)
    st.step()
    sites = DT.kernel_sites(DT.collect(devices))
    p0 = st.state.pos

    def rewind() -> None:   # the same positions in every block; a fresh record counter
        st.state.pos = p0
        DT.reset(devices)

    res = DP.run(st.step, rewind, timer, sites, lambda t, ns: DT.set_delay(t, ns, devices),
                 int(round(delay_us * 1e3)), rounds=rounds, steps_per_block=steps,
                 progress=lambda msg: print(msg, file=sys.stderr))
    print(DP.format_rows(res))
    return res


def main(argv=None) -> int:
    from memra_dsv4.gpu.weights import EXPERT_STORAGE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:flash")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--arms", default="path=legacy")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--gemv-pick", default=None, metavar="FILE",
                    help="MEMRA_DSV4_GEMV_VARIANT value used by arms with gemv=pick")
    ap.add_argument("--base-kernels", default=None, metavar="DIR",
                    help="the kernel tree of arms with kernels=base (an in-process A/B of two "
                         "kernels_cu trees; kernel_loader.use_kernels_dir)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--phase-steps", type=int, default=3)
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                    help="caches at --ctx: by a prefill of --ctx tokens, or random values "
                         "(random_filled_state; for long contexts)")
    ap.add_argument("--dense", choices=("bf16", "fp8"), default=None,
                    help="dense weight form on the GPU (the MEMRA_DSV4_DENSE seam; default: "
                         "the seam's own default)")
    ap.add_argument("--expert-storage", choices=EXPERT_STORAGE, default="per-layer",
                    help="synthetic models: shared = each stage's MoE layers alias its first MoE "
                         "layer's routed experts (a full-depth Flash on one H200; the bytes read "
                         "per step are the same)")
    ap.add_argument("--launch-profile", type=int, default=0, metavar="REPS",
                    help="device arms: time every kernel launch of one step alone as a graph "
                         "of REPS copies (profiling.launches); 0 = off")
    ap.add_argument("--device-trace", type=int, default=0, metavar="STEPS",
                    help="device arms: replay STEPS more steps with the kernels' %%globaltimer "
                         "records on (profiling.device_trace; needs MEMRA_DSV4_DEVICE_TRACE=on "
                         "from the start) and print the step's timeline and critical chain")
    ap.add_argument("--delay-probe", type=float, default=0.0, metavar="US",
                    help="device arms, trace build: make each kernel of the step in turn wait US "
                         "microseconds per launch after its PDL wait and time the step against "
                         "undelayed neighbours (profiling.delay_probe): which kernels set the "
                         "step's length; 0 = off")
    ap.add_argument("--probe-rounds", type=int, default=4, metavar="N",
                    help="with --delay-probe: rounds of the schedule (each kernel once per round)")
    ap.add_argument("--probe-steps", type=int, default=8, metavar="N",
                    help="with --delay-probe: timed steps per block")
    ap.add_argument("--feed-chunk", type=int, default=16, metavar="N",
                    help="feed=device arms: greedy steps per sample (the sample is divided by N)")
    ap.add_argument("--prime", type=int, default=None, metavar="N",
                    help="untimed one-token steps of an arm before each of its samples (and "
                         "warm-up rounds), outside the timed region: the switch between arms' "
                         "graphs is not the arm's cost (_ArmState.prime); default 1 with "
                         "several arms, 0 with one")
    ap.add_argument("--flush-mb", type=int, default=0,
                    help="with --launch-profile: memset this many MB between copies (L2 flush)")
    a = ap.parse_args(argv)
    arms_spec = check_arms(a.arms)   # before any GPU work
    if a.feed_chunk < 1:
        raise SystemExit(f"--feed-chunk {a.feed_chunk}: expected >= 1")
    if a.prime is None:   # the probes and profiles below time their own steps
        a.prime = int(len(arms_spec) > 1 and not (a.device_trace or a.delay_probe
                                                  or a.launch_profile))
    if not 0 <= a.prime <= 64:
        raise SystemExit(f"--prime {a.prime}: expected 0 .. 64 untimed steps per sample")
    if a.prime and (a.device_trace or a.delay_probe or a.launch_profile):
        raise SystemExit(f"--prime {a.prime}: --device-trace / --delay-probe / --launch-profile "
                         f"time their own steps; give --prime 0 with them")
    fed = [s for s in arms_spec if s.get("feed") == "device"]
    if fed and (a.device_trace or a.delay_probe or a.launch_profile):
        # those read one step per call of the arm's step; a feed=device call is --feed-chunk steps
        raise SystemExit(f"arm {fed[0]}: feed=device runs --feed-chunk steps per sample; "
                         f"--device-trace / --delay-probe / --launch-profile need host-fed arms")
    if a.expert_storage != "per-layer" and not a.model.startswith("synthetic:"):
        raise SystemExit(f"--expert-storage {a.expert_storage}: synthetic models only (a checkpoint "
                         f"stores its own experts), got --model {a.model}")
    for s in arms_spec:
        _kernels_dir(s, a.base_kernels, files=False)
    if a.device_trace:
        from memra_dsv4.seams import SEAM_DEVICE_TRACE, env_value
        if a.device_trace < 0:
            raise SystemExit(f"--device-trace {a.device_trace}: expected a step count >= 0")
        if env_value(SEAM_DEVICE_TRACE) != "on":
            raise SystemExit("--device-trace needs the trace build: set MEMRA_DSV4_DEVICE_TRACE=on "
                             "(the kernels must be compiled with it from the start)")
    if a.delay_probe:
        from memra_dsv4.seams import SEAM_DEVICE_TRACE, env_value
        if not 0 < a.delay_probe <= 1000:
            raise SystemExit(f"--delay-probe {a.delay_probe}: expected microseconds in (0, 1000]")
        if a.probe_rounds < 1 or a.probe_steps < 1:
            raise SystemExit(f"--probe-rounds {a.probe_rounds} / --probe-steps {a.probe_steps}: "
                             f"expected >= 1")
        if env_value(SEAM_DEVICE_TRACE) != "on":
            raise SystemExit("--delay-probe needs the trace build: set MEMRA_DSV4_DEVICE_TRACE=on "
                             "(the kernels must be compiled with it from the start)")

    import cupy as cp
    from bench.harness import (Arm, CudaEventTimer, floors, measure_copy_bandwidth,
                               phase_breakdown, run_interleaved, summarize, write_results)
    from memra_dsv4.gpu.step import total_step_bytes
    from memra_dsv4.profiling import build_report, phase_collect, phase_reset, prof_configure

    devices = tuple(int(d) for d in a.devices.split(","))
    prof_configure("off")
    chunk = a.feed_chunk if any(s.get("feed") == "device" for s in arms_spec) else 1
    max_seq = a.ctx + (a.warmup + a.steps + 1) * chunk + (a.warmup + a.steps) * a.prime \
        + a.phase_steps + 8
    max_seq += (a.device_trace + a.probe_steps + 2) if a.delay_probe else 0   # the probe rewinds
    m = _load(a.model, devices, max_seq, a.dense, a.expert_storage)
    cfg = m.config
    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, a.ctx)

    bw = measure_copy_bandwidth(devices[0])
    copy_bw = bw["copy_bw_Bps"]
    print(f"copy bandwidth (device {devices[0]}): {copy_bw / 1e12:.2f} TB/s (read+write)")

    arms, states = [], {}
    from bench.harness import arm_label
    kernels_dirs = [_kernels_dir(s, a.base_kernels) for s in arms_spec]   # registry filled: full check
    trees = set(kernels_dirs)
    if trees != {None}:   # an A/B of kernel trees: every module of both trees loaded on every
        from memra_dsv4.gpu import kernel_loader   # stage's device now, never inside a capture
        for tree in sorted(trees, key=str):
            kernel_loader.use_kernels_dir(tree)
            for d in sorted({int(S.device) for S in m.stages}):
                kernel_loader.get_loader(d).warm_all()
        kernel_loader.use_kernels_dir(None)
    for s, kdir in zip(arms_spec, kernels_dirs):
        name = arm_label(s)
        st = _ArmState(m, s.get("path", "legacy"), ids, max_seq, a.fill, s.get("pdl"), s.get("attn"),
                       _kernel_env(s, a.gemv_pick), s.get("l2pf"), s.get("fork"), s.get("hcsplit"),
                       s.get("prio"), s.get("qnorm"), s.get("w2"), kdir,
                       feed=s.get("feed", "host"), feed_chunk=a.feed_chunk)
        try:
            st.step()                                   # probe (also the first warmup)
        except NotImplementedError as e:
            print(f"arm {name}: dropped ({e})", file=sys.stderr)
            continue
        states[name] = st
        arms.append(Arm(name=name, step=st.run, settings=dict(s), setup=_arm_setup(st, a.prime)))
    if not arms:
        raise SystemExit("no arm could run")

    first = m.stages[0].device
    with cp.cuda.Device(first):
        timer = CudaEventTimer(m.devs[first].compute)
        samples = run_interleaved(arms, a.steps, a.warmup, timer)
    for arm in arms:   # a feed=device sample timed feed_chunk tokens
        if states[arm.name].feed == "device":
            samples[arm.name] = [x / a.feed_chunk for x in samples[arm.name]]

    fmt = _expert_fmt(m)
    out_arms, base = {}, None
    for arm in arms:
        # the position at the arm's middle sample (a feed=device arm advances feed_chunk per
        # sample, so its context, and the KV its steps read, grows faster than a host arm's)
        per = a.feed_chunk if states[arm.name].feed == "device" else 1
        mid = a.ctx + (a.warmup + 1 + a.steps // 2) * per + (a.warmup + a.steps // 2) * a.prime
        own_b = total_step_bytes(cfg, mid, _stages(m), dense=_dense_of(m), experts=fmt)
        nat_b = total_step_bytes(cfg, mid, _stages(m), dense="fp8", experts=fmt)
        summ = summarize(samples[arm.name])
        base = base or summ["median"]
        prof_configure("events")
        phase_reset()
        for _ in range(a.phase_steps):
            states[arm.name].eager_step()
        rows = build_report(phase_collect(), 0.0, a.phase_steps) if a.phase_steps else []
        prof_configure("off")
        frac = own_b / (summ["median"] * 1e-3) / copy_bw
        launches = (_launch_profile(states[arm.name], a.launch_profile, a.flush_mb << 20)
                    if a.launch_profile and arm.settings.get("path") == "device" else None)
        out_arms[arm.name] = {
            "settings": arm.settings, "summary": summ,
            "kernel_env": states[arm.name].kernel_env,
            "resolved": {"path": states[arm.name].path, "pdl": states[arm.name].pdl,
                         "attn": states[arm.name].attn, "l2pf": states[arm.name].l2pf,
                         "fork": states[arm.name].fork, "hcsplit": states[arm.name].hcsplit,
                         "prio": states[arm.name].prio, "qnorm": states[arm.name].qnorm,
                         "w2": states[arm.name].w2, "feed": states[arm.name].feed,
                         "feed_chunk": states[arm.name].feed_chunk,
                         "kernels_dir": states[arm.name].kernels_dir or "(this checkout)"},
            "ratio_to_first": summ["median"] / base,
            "bytes_per_step": own_b, "native_bytes_per_step": nat_b,
            "achieved_frac_of_copy_bw": frac,
            "floor_ms": floors(own_b, copy_bw), "native_floor_ms": floors(nat_b, copy_bw),
            "phases_us": phase_breakdown(rows, depth=2),
        }
        if launches is not None:
            out_arms[arm.name]["launches"] = launches
        if a.device_trace and arm.settings.get("path") == "device":
            out_arms[arm.name]["device_trace"] = _device_trace(states[arm.name], devices,
                                                               a.device_trace)
        if a.delay_probe and arm.settings.get("path") == "device":   # last: it rewinds the state
            out_arms[arm.name]["delay_probe"] = _delay_probe(states[arm.name], devices, timer,
                                                             a.delay_probe, a.probe_rounds,
                                                             a.probe_steps)
        print(f"{arm.name}: median {summ['median']:.2f} ms/step (p10 {summ['p10']:.2f}, p90 "
              f"{summ['p90']:.2f}, iqr {summ['iqr']:.2f}), {summ['tok_s']:.1f} tok/s, x"
              f"{summ['median'] / base:.2f} vs first; {own_b / 1e9:.2f} GB/step read -> "
              f"{100 * frac:.1f}% of copy bw; floors: own {floors(own_b, copy_bw):.2f} ms, "
              f"native {floors(nat_b, copy_bw):.2f} ms")
        for r in rows:
            if r.depth <= 4:
                print(f"  {'  ' * r.depth}{r.label:30s} {r.per_step_us / 1e3:9.3f} ms/step "
                      f"{100 * r.share:5.1f}%")
    js, png = write_results({"config": {"model": a.model, "devices": list(devices),
                                        "steps": a.steps, "ctx": a.ctx, "warmup": a.warmup,
                                        "prime": a.prime,
                                        "fill": a.fill, "dense": _dense_of(m),
                                        "phase_steps": a.phase_steps, "experts": fmt,
                                        "expert_storage": a.expert_storage},
                             "copy_bw": bw, "arms": out_arms})
    print(f"results: {js} {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
