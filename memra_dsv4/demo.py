"""`python -m memra_dsv4 demo [--dir DIR] [--steps N] [--device D] [--numerics N]`

Writes a fresh tiny synthetic checkpoint (every layer kind: sliding, CSA with indexer, HCA,
hash and learned routing, an MTP block) to ``./.memra_cache/demo-tiny`` (or ``--dir``; a
temporary directory when the cache is not writable), opens it like a real checkpoint, runs a
prefill and a few greedy decode steps twice -- by re-prefill, then incrementally with the KV
caches and compressor state (one prefill into a fresh state, then one decode step per token) --
and checks that both give the same tokens, on the GPU when one is usable, on the NumPy oracle
otherwise, then one MTP draft from the last hidden streams, and greedy speculative decoding (MTP
drafts, k = 2, batched verify and rollback) on the same backend.  Prints what it did at each step.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

from memra_dsv4.cli import ArgParser, UsageError
from memra_dsv4.run import greedy_incremental, greedy_reprefill, select_backend

__all__ = ["main"]

DEMO_PROMPT = [0, 17, 42, 99, 3, 250, 7, 11, 64, 5, 301, 12]   # 12 tokens: CSA emits, window wraps


def _default_dir() -> str:
    root = os.path.join(os.getcwd(), ".memra_cache")
    try:
        os.makedirs(root, exist_ok=True)
        if os.access(root, os.W_OK):
            return os.path.join(root, "demo-tiny")
    except OSError:
        pass
    return os.path.join(tempfile.mkdtemp(prefix="memra-dsv4-demo-"), "demo-tiny")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = ArgParser(prog="python -m memra_dsv4 demo")
    p.add_argument("--dir", default=None, help="where to write the checkpoint")
    p.add_argument("--steps", type=int, default=6, help="greedy steps after the prompt")
    p.add_argument("--device", default=None, help="oracle | gpu | auto (default)")
    p.add_argument("--numerics", default=None, help="bf16 (default) | reference | exact")
    p.add_argument("--seed", type=int, default=0)
    try:
        args = p.parse_args(argv)
        if args.steps < 0:
            raise UsageError(f"--steps {args.steps}: must be >= 0")
    except UsageError as e:
        print(f"memra_dsv4 demo: {e}", file=sys.stderr)
        return 2

    from memra_dsv4.checkpoint import Checkpoint
    from memra_dsv4.config import preset
    from memra_dsv4.synth import write_synth_checkpoint

    cfg = preset("tiny")
    out = args.dir or _default_dir()
    if os.path.isdir(out):
        shutil.rmtree(out)
    t0 = time.perf_counter()
    nbytes = write_synth_checkpoint(out, cfg, seed=args.seed)
    print(f"[1] wrote a fresh synthetic '{cfg.name}' checkpoint to {out} "
          f"({nbytes:,} bytes, {time.perf_counter() - t0:.2f} s)")
    print("    layers: " + "; ".join(f"{l}: {cfg.layer_summary(l)}" for l in range(cfg.num_hidden_layers))
          + f"; MTP block: {cfg.layer_summary(cfg.num_hidden_layers)}")
    ckpt = Checkpoint.open(out)
    print(f"[2] opened it: {ckpt!r}")
    try:
        backend = select_backend(ckpt, args.device, args.numerics, log=lambda m: print("    " + m))
    except (UsageError, ValueError) as e:
        print(f"memra_dsv4 demo: {e}", file=sys.stderr)
        return 2
    print(f"[3] running on the {backend.name} (numerics {backend.numerics})")

    t0 = time.perf_counter()
    first = backend.prefill(np.asarray(DEMO_PROMPT))
    top = np.argsort(-first.logits)[:5]
    print(f"[4] prefill of {len(DEMO_PROMPT)} tokens {DEMO_PROMPT} in "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms; top-5 next tokens {top.tolist()}")
    print(f"[5] greedy decode, {args.steps} steps (by re-prefill):")
    gen = greedy_reprefill(backend, DEMO_PROMPT, args.steps, log=lambda m: print("    " + m))
    print(f"    generated: {gen}")
    print(f"[5b] greedy decode, {args.steps} steps, incremental (KV caches + compressor state):")
    inc = greedy_incremental(backend, DEMO_PROMPT, args.steps, log=lambda m: print("    " + m))
    same = "same tokens as re-prefill" if inc == gen else f"DIFFERS from re-prefill {gen}"
    print(f"    generated: {inc}  ({same})")

    from memra_dsv4.oracle import Oracle
    oracle = backend.model if backend.name == "oracle" else Oracle(ckpt, "bf16")
    seq = DEMO_PROMPT + gen
    trunk = oracle.prefill(seq[:-1], all_logits=True)
    draft = oracle.mtp_forward(trunk.streams, seq[1:])       # row i: state i + token i+1
    agree = float(np.mean(np.argmax(draft.logits[:-1], -1) == np.argmax(trunk.logits[1:], -1)))
    print(f"[6] MTP block (oracle) over {len(seq) - 1} rows: last row (trunk state of position "
          f"{len(seq) - 2} + token {seq[-1]}) drafts token {int(np.argmax(draft.logits[-1]))} for "
          f"position {len(seq)}; agreement with the trunk's own next-next argmax {agree:.0%} "
          f"(random weights: no skill expected)")
    if args.steps >= 1:
        t0 = time.perf_counter()
        res = backend.speculative(np.asarray(DEMO_PROMPT), args.steps, 2)
        same = ("same tokens as the incremental decode" if res.tokens == inc else
                f"DIFFERS from the incremental decode {inc}")
        print(f"[7] speculative decoding on the {backend.name} (MTP drafts, k = 2, verify + "
              f"rollback) in {(time.perf_counter() - t0) * 1e3:.1f} ms: {res.tokens} ({same}); "
              f"{res.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
