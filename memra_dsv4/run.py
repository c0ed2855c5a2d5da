"""`python -m memra_dsv4 run CKPT --prompt-ids 1,2,3 --max-new 8 [--numerics N] [--device D]
[--continue incremental|reprefill]`

Greedy continuation.  ``--continue incremental`` (default, or MEMRA_DSV4_CONTINUE): one
prefill into a fresh decode state, then one decode step per token (the oracle's state machine,
or the GPU decode path chosen by MEMRA_DSV4_DECODE_PATH).  ``reprefill``: every step runs a
full prefill of prompt + generated tokens and appends the argmax of the last position's logits
(the consistency reference).  Prints each step's token id and wall time, then the generated ids.

* CKPT: a checkpoint directory (``config.json`` + safetensors, e.g. written by
  ``python -m memra_dsv4 synth``), or ``synth:PRESET[:SEED]`` for an in-memory synthetic
  checkpoint (tiny / small / flash-layers:N).
* ``--device oracle`` runs the NumPy oracle; ``gpu`` runs ``memra_dsv4.gpu`` (CuPy, a CUDA
  GPU, and the bf16 class); ``auto`` (default, or MEMRA_DSV4_DEVICE) uses the GPU when it is
  usable for the request and otherwise the oracle, saying which and why.
* ``--numerics`` (default MEMRA_DSV4_NUMERICS, else bf16): bf16 | reference | exact.
* Bad input (unknown flag, malformed or out-of-range ids, missing checkpoint, a GPU asked for
  but absent): one line on stderr naming the problem, exit status 2.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from memra_dsv4.cli import ArgParser, UsageError
from memra_dsv4.seams import SEAM_CONTINUE, SEAM_DEVICE, SEAM_NUMERICS, resolve

__all__ = ["main", "open_checkpoint", "select_backend", "greedy_reprefill", "UsageError"]



def _parser() -> ArgParser:
    p = ArgParser(prog="python -m memra_dsv4 run", add_help=True,
                description="Greedy continuation by re-prefill on the oracle or the GPU.")
    p.add_argument("checkpoint", help="checkpoint directory, or synth:PRESET[:SEED]")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--numerics", default=None, help="bf16 | reference | exact")
    p.add_argument("--device", default=None, help="oracle | gpu | auto")
    p.add_argument("--continue", dest="continue_mode", default=None,
                   help="incremental (default) | reprefill")
    return p


def parse_ids(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(s == "" for s in parts):
        raise UsageError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3")
    try:
        return [int(s) for s in parts]
    except ValueError:
        bad = next(s for s in parts if not s.lstrip("-").isdigit())
        raise UsageError(f"--prompt-ids: {bad!r} is not an integer") from None


def open_checkpoint(spec: str):
    """A checkpoint directory, or ``synth:PRESET[:SEED]`` built in memory."""
    from memra_dsv4.checkpoint import Checkpoint
    if spec.startswith("synth:"):
        from memra_dsv4.config import ConfigError, preset
        from memra_dsv4.synth import synth_arrays
        rest = spec[len("synth:"):]
        try:                     # "tiny", "flash-layers:2"
            cfg, seed = preset(rest), 0
        except ConfigError:      # "tiny:3", "flash-layers:2:3"
            head, _, tail = rest.rpartition(":")
            if not (head and tail.isdigit()):
                raise
            cfg, seed = preset(head), int(tail)
        return Checkpoint.from_arrays(cfg, synth_arrays(cfg, seed))
    return Checkpoint.open(spec)


def _gpu_unavailable_reason(numerics: str) -> str | None:
    if numerics != "bf16":
        return f"the GPU path implements only the bf16 class (asked: {numerics})"
    try:
        import cupy  # noqa: F401
        if not cupy.is_available() or cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # no CuPy, no driver
        return f"CuPy/CUDA not usable ({type(e).__name__}: {e})".splitlines()[0]
    try:
        from memra_dsv4.gpu.model import Dsv4Gpu  # noqa: F401
    except Exception as e:
        return f"memra_dsv4.gpu.model not importable ({type(e).__name__}: {e})".splitlines()[0]
    return None


class _OracleBackend:
    name = "oracle"

    def __init__(self, ckpt, numerics):
        from memra_dsv4.oracle import Oracle
        self.model = Oracle(ckpt, numerics)
        self.numerics = self.model.numerics

    def prefill(self, ids):
        return self.model.prefill(ids)

    def start(self, ids):
        """Prefill into a fresh decode state: (last logits, state)."""
        out = self.model.prefill_state(ids)
        return out.logits, out.state

    def step(self, state, token):
        return self.model.decode_step(state, int(token))

    def speculative(self, ids, n: int, k: int):
        """Greedy speculative decoding with the checkpoint's drafter (oracle.spec: the MTP
        block, or oracle.dspark's DSparkDrafter for a DSpark checkpoint): a SpecResult."""
        from memra_dsv4.oracle.spec import speculative_generate
        return speculative_generate(self.model, ids, n, k)   # oracle.spec.default_drafter


class _GpuBackend:
    name = "gpu"

    def __init__(self, ckpt, numerics):
        from memra_dsv4.config import DRAFTER_NONE
        from memra_dsv4.gpu.model import Dsv4Gpu
        # the drafter's stages too when the checkpoint has one (speculative(): gpu.spec)
        self.model = Dsv4Gpu.load(ckpt, numerics=numerics,
                                  drafter=ckpt.config.drafter_kind != DRAFTER_NONE)
        self.numerics = numerics

    def speculative(self, ids, n: int, k: int):
        """Greedy speculative decoding with the checkpoint's GPU drafter (gpu.spec's
        default_drafter: the MTP block or DSpark): a SpecResult."""
        from memra_dsv4.gpu.spec import speculative_generate
        return speculative_generate(self.model, ids, n, k)

    def prefill(self, ids):
        return self.model.forward(ids)

    def start(self, ids):
        return self.model.prefill(ids, self.model.new_state())

    def step(self, state, token):
        return self.model.decode_step(state, int(token))


def select_backend(ckpt, device: str | None, numerics: str | None, log=print):
    """Resolve --device / --numerics (argument > env > default) and build the backend.
    ``auto`` falls back to the oracle with a logged reason; ``gpu`` without a usable GPU is a
    UsageError."""
    device = resolve(SEAM_DEVICE, device)
    numerics = resolve(SEAM_NUMERICS, numerics)
    if device in ("gpu", "auto"):
        why = _gpu_unavailable_reason(numerics)
        if why is None:
            return _GpuBackend(ckpt, numerics)
        if device == "gpu":
            raise UsageError(f"--device gpu: {why}")
        log(f"device auto: using the NumPy oracle ({why})")
    return _OracleBackend(ckpt, numerics)


def greedy_incremental(backend, prompt: list[int], max_new: int, log=print) -> list[int]:
    """Greedy decode with the KV caches: one prefill into a fresh state, then one
    ``decode_step`` per token (the oracle's state machine, or the GPU's decode path)."""
    out: list[int] = []
    state = None
    for step in range(max_new):
        t0 = time.perf_counter()
        if state is None:
            logits, state = backend.start(np.asarray(prompt, dtype=np.int64))
            how = f"prefill of {len(prompt)} tokens into a fresh state"
        else:
            logits = backend.step(state, out[-1])
            how = f"one decode step at position {len(prompt) + step - 1}"
        nxt = int(np.argmax(logits))
        log(f"step {step + 1}: token {nxt}  ({(time.perf_counter() - t0) * 1e3:.1f} ms, {how})")
        out.append(nxt)
    return out


def greedy_reprefill(backend, prompt: list[int], max_new: int, log=print) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for step in range(max_new):
        t0 = time.perf_counter()
        logits = backend.prefill(np.asarray(ids, dtype=np.int64)).logits
        nxt = int(np.argmax(logits))
        dt = time.perf_counter() - t0
        log(f"step {step + 1}: token {nxt}  ({dt * 1e3:.1f} ms, prefill of {len(ids)} tokens)")
        ids.append(nxt)
        out.append(nxt)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        prompt = parse_ids(args.prompt_ids)
        if args.max_new < 0:
            raise UsageError(f"--max-new {args.max_new}: must be >= 0")
        try:
            ckpt = open_checkpoint(args.checkpoint)
        except (OSError, ValueError) as e:   # CheckpointError / ConfigError are ValueErrors
            raise UsageError(f"checkpoint {args.checkpoint!r}: {e}".splitlines()[0]) from None
        from memra_dsv4.oracle import check_token_ids
        try:
            check_token_ids(prompt, ckpt.config.vocab_size, "--prompt-ids")
            mode = resolve(SEAM_CONTINUE, args.continue_mode)
            backend = select_backend(ckpt, args.device, args.numerics)
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    except UsageError as e:
        print(f"memra_dsv4 run: {e}", file=sys.stderr)
        return 2
    print(f"memra_dsv4 run: device={backend.name} numerics={backend.numerics} "
          f"config={ckpt.config.name} prompt={len(prompt)} tokens, max_new={args.max_new} "
          f"continue={mode}")
    t0 = time.perf_counter()
    greedy = greedy_incremental if mode == "incremental" else greedy_reprefill
    out = greedy(backend, prompt, args.max_new)
    total = time.perf_counter() - t0
    print(f"generated: {','.join(str(t) for t in out)}")
    if out:
        print(f"total {total:.3f} s, {total / len(out) * 1e3:.1f} ms/step ({mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
