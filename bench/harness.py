"""Model-agnostic parts of the decode benchmarks: arms, interleaved timing, statistics, floors, results.

Run bench scripts from the repository root as modules (`python -m bench.decode_step ...`), so
that `bench.harness` and `bench.plot` import as a package.

Arms syntax (`--arms`): arms are separated by ',', settings within one arm by '+', and each
setting is `key=value`:

    --arms path=legacy,path=device+dense=fp8
    -> [{"path": "legacy"}, {"path": "device", "dense": "fp8"}]

Keys are identifiers (letters, digits, '_', '.', '-'; not starting with a digit); values are
non-empty strings without ',', '+', '=' or whitespace, left uninterpreted (the seam that
receives them validates them). The same arm may appear twice: an A/A pair measures the noise.

Timing: `run_interleaved` runs arms round-robin, A B A B ..., in one process, so slow drift
(clocks, thermals, a neighbour on the host) lands on every arm alike. A timer measures one
`step()` in milliseconds: `CudaEventTimer` on the GPU, `PerfCounterTimer` on the host.

Bandwidth floors: `measure_copy_bandwidth` copies a large buffer device to device and defines
`copy_bw = 2 * nbytes / time`, i.e. HBM traffic counting every byte once read and once written.
That is the rate at which the memory system moves bytes, so a decode step that must *read*
`B` bytes cannot finish in less than `floor = B / copy_bw`. (The H200 "4.3 TB/s measured copy"
of docs and references is this quantity; bytes copied per second is half of it.)

Results: `write_results(payload)` writes `bench/results/<YYYY-MM-DD>-<gpu-slug>-<commit7>.json`
(UTC date; `-2`, `-3`, ... appended rather than overwriting) and a PNG of the same name drawn by
`bench.plot`. Payload schema, as read by the plot:

    {"config": {...free-form: model, devices, steps, ctx, warmup, ...},
     "copy_bw": measure_copy_bandwidth(...),                       # optional
     "arms": {"<arm label>": {"settings": {...},
                              "summary": summarize(samples_ms),
                              "phases_us": {"<phase>": GPU us per step, ...},  # optional
                              "floor_ms": floors(bytes_per_step, copy_bw)}}}     # optional

`phases_us` must hold non-overlapping phases (`phase_breakdown` gives one level of the phase
tree); the plot stacks them and shows the rest of the median step as "unattributed".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Protocol

import numpy as np
from tqdm import tqdm

from memra_dsv4.profiling.report import Row

RESULTS_DIR = Path(__file__).resolve().parent / "results"

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_VALUE = re.compile(r"[^\s,+=]+")


def parse_arms(spec: str) -> list[dict[str, str]]:
    """`"path=legacy,path=device+dense=fp8"` -> one settings dict per arm (syntax in module doc)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("--arms is empty; expected e.g. path=legacy,path=device+dense=fp8")
    arms = []
    for n, arm in enumerate(spec.split(","), start=1):
        settings: dict[str, str] = {}
        if not arm.strip():
            raise ValueError(f"--arms {spec!r}: arm {n} is empty (stray ',')")
        for setting in arm.split("+"):
            key, eq, value = setting.strip().partition("=")
            if not eq:
                raise ValueError(f"--arms {spec!r}: arm {n} setting {setting.strip()!r} is not key=value")
            if not _KEY.fullmatch(key):
                raise ValueError(f"--arms {spec!r}: arm {n} has an invalid key {key!r}")
            if not _VALUE.fullmatch(value):
                raise ValueError(f"--arms {spec!r}: arm {n} key {key!r} has an invalid value {value!r}")
            if key in settings:
                raise ValueError(f"--arms {spec!r}: arm {n} sets {key!r} twice")
            settings[key] = value
        arms.append(settings)
    return arms


def arm_label(settings: Mapping[str, str]) -> str:
    """The canonical text of one arm, the inverse of parse_arms for that arm."""
    return "+".join(f"{k}={v}" for k, v in settings.items())


@dataclass
class Arm:
    name: str
    step: Callable[[], None]  # one decode step; the timer measures it
    settings: dict[str, str] = field(default_factory=dict)
    # run before every step, warm-up ones included, OUTSIDE the timed region: what the in-process
    # A/B itself needs (e.g. making this arm's settings the shared model's), not what a caller
    # of the measured API would pay
    setup: Callable[[], None] | None = None


class Timer(Protocol):
    def __call__(self, fn: Callable[[], None]) -> float: ...  # milliseconds of fn()


class PerfCounterTimer:
    """Host wall-clock time of fn(); for CPU arms and tests."""

    def __call__(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


class CudaEventTimer:
    """GPU time of fn() between two events on `stream` (None: the current stream at call time).

    It synchronizes after every step on purpose: a decode step ends in a host read of the next
    token anyway, and starting each timed step on an idle GPU is what makes host launch gaps show
    up in the time instead of hiding behind a queue. Work on other streams or devices is timed
    only if it joins back into `stream` before fn() returns. Create the timer with the device of
    `stream` current: its events belong to that device.
    """

    def __init__(self, stream=None) -> None:
        import cupy

        self._cupy = cupy
        self._stream = stream
        self._start = cupy.cuda.Event()
        self._end = cupy.cuda.Event()

    def __call__(self, fn: Callable[[], None]) -> float:
        self._start.record(self._stream)
        fn()
        self._end.record(self._stream)
        self._end.synchronize()
        return self._cupy.cuda.get_elapsed_time(self._start, self._end)


def run_interleaved(
    arms: list[Arm], steps: int, warmup: int, timer: Timer, progress: bool = True
) -> dict[str, list[float]]:
    """`warmup` untimed rounds, then `steps` timed rounds; each round runs every arm once in order.

    Returns arm name -> `steps` samples in ms, in arm order.
    """
    if not arms:
        raise ValueError("run_interleaved needs at least one arm")
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique (samples are keyed by name): {names}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps} warmup={warmup}")

    samples: dict[str, list[float]] = {name: [] for name in names}
    with tqdm(total=(warmup + steps) * len(arms), desc="bench", unit="step", disable=not progress,
              file=sys.stderr) as bar:
        for _ in range(warmup):
            for arm in arms:
                if arm.setup is not None:
                    arm.setup()
                arm.step()
                bar.update()
        for _ in range(steps):
            for arm in arms:
                if arm.setup is not None:
                    arm.setup()
                samples[arm.name].append(float(timer(arm.step)))
                bar.update()
    return samples


def summarize(samples_ms: list[float], tokens_per_step: float = 1.0) -> dict[str, float]:
    """median, p10, p90, iqr (p75 - p25), mean, n in ms; tok_s = tokens_per_step / median."""
    x = np.asarray(samples_ms, dtype=np.float64)
    if x.size == 0:
        raise ValueError("summarize needs at least one sample")
    p10, p25, median, p75, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return {
        "median": float(median),
        "p10": float(p10),
        "p90": float(p90),
        "iqr": float(p75 - p25),
        "mean": float(x.mean()),
        "n": int(x.size),
        "tok_s": float(tokens_per_step * 1e3 / median) if median > 0 else float("inf"),
    }


def phase_breakdown(rows: list[Row], depth: int = 0) -> dict[str, float]:
    """GPU µs per step of the phases at one tree depth: disjoint ranges, so they stack."""
    return {row.name: row.per_step_us for row in rows if row.depth == depth}


def measure_copy_bandwidth(device: int = 0, nbytes: int = 1 << 30, iters: int = 20, warmup: int = 3) -> dict:
    """Device-to-device cudaMemcpyAsync of `nbytes`, median of `iters` timed copies after `warmup`.

    Returns {"device", "nbytes", "iters", "median_ms", "copied_Bps", "copy_bw_Bps"} where
    copied_Bps = nbytes / t and copy_bw_Bps = 2 * nbytes / t (read + write traffic; module doc).
    Buffers come from cudaMalloc directly and are freed before returning, so CuPy's memory pool
    keeps no 2 * nbytes of cached blocks afterwards.
    """
    import cupy

    rt = cupy.cuda.runtime
    with cupy.cuda.Device(device):
        src = dst = 0
        try:
            src, dst = rt.malloc(nbytes), rt.malloc(nbytes)
            stream = cupy.cuda.Stream(non_blocking=True)
            pairs = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
            for _ in range(warmup):
                rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
            for start, end in pairs:
                start.record(stream)
                rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
                end.record(stream)
            stream.synchronize()
            ms = float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in pairs]))
        finally:
            for ptr in (src, dst):
                if ptr:
                    rt.free(ptr)
    seconds = ms / 1e3
    return {
        "device": device,
        "nbytes": nbytes,
        "iters": iters,
        "median_ms": ms,
        "copied_Bps": nbytes / seconds,
        "copy_bw_Bps": 2 * nbytes / seconds,
    }


def floors(bytes_per_step: float | Mapping[str, float], copy_bw: float) -> float | dict[str, float]:
    """Bandwidth floor in ms: bytes read per step / copy_bw (bytes/s, read + write traffic).

    A mapping (per arm or per phase) gives a mapping of floors.
    """
    if copy_bw <= 0:
        raise ValueError(f"copy_bw must be positive bytes/s, got {copy_bw}")
    if isinstance(bytes_per_step, Mapping):
        return {name: 1e3 * b / copy_bw for name, b in bytes_per_step.items()}
    return 1e3 * bytes_per_step / copy_bw


def git_commit_short(repo: Path | str | None = None) -> str:
    """7-character commit for result names: the environment variable MEMRA_DSV4_COMMIT when set
    and non-empty (a working-tree copy without .git, e.g. on the GPU machine, is told its commit
    that way), else git's HEAD of the repository holding this file, else 'nogit'."""
    env = os.environ.get("MEMRA_DSV4_COMMIT", "").strip()
    if env:
        return env[:7]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=repo or Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "nogit"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "nogit"


def git_dirty(repo: Path | str | None = None) -> bool | None:
    """Whether tracked files differ from HEAD (None when git cannot tell)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             cwd=repo or Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def gpu_name(device: int = 0) -> str:
    """The CUDA device's name from its properties, or 'cpu' where CuPy or a device is missing."""
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    except (ImportError, RuntimeError):  # CUDARuntimeError is a RuntimeError
        return "cpu"
    return name.decode() if isinstance(name, bytes) else str(name)


_query_gpu_name = gpu_name  # write_results has a parameter of that name


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host CPU's model name and logical CPU count ("<model> (<n> logical CPUs)"), for the
    results' meta: a host-fed step's time includes the host's Python after each wait, which
    depends on the CPU (docs/decode_perf.md, twenty-ninth session).  platform.processor() where
    there is no cpuinfo; "unknown" where neither names one."""
    import platform
    model = ""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or "unknown"
    return f"{model} ({os.cpu_count() or '?'} logical CPUs)"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable")


def write_results(
    payload: dict,
    out_dir: Path | str = RESULTS_DIR,
    gpu_name: str | None = None,
    commit: str | None = None,
) -> tuple[Path, Path | None]:
    """Write the payload as JSON plus its PNG (module doc); returns (json_path, png_path).

    `meta` (date, gpu, commit, host_cpu, and `dirty` when the commit was looked up here) is added to the
    document; keys of the payload's own `meta` win. The JSON is written first; if matplotlib is missing (the GPU machine may lack it) the PNG
    is skipped with a note on stderr and png_path is None: `python -m bench.plot <json>`
    draws it later from the JSON alone.
    """
    gpu = gpu_name if gpu_name is not None else _query_gpu_name()
    commit7 = (commit if commit is not None else git_commit_short())[:7]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    meta = {"date": date, "gpu": gpu, "commit": commit7, "host_cpu": host_cpu()}
    if commit is None:
        # A copy told its commit by MEMRA_DSV4_COMMIT (the GPU machine: no .git, or one that
        # does not match the copied tree) cannot judge its own cleanliness: say so, not "dirty".
        told = os.environ.get("MEMRA_DSV4_COMMIT", "").strip()
        meta["dirty"] = None if told else git_dirty()
        if told:
            meta["commit_from"] = "MEMRA_DSV4_COMMIT"
    doc = {**payload, "meta": {**meta, **payload.get("meta", {})}}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{date}-{_slug(gpu)}-{commit7}"
    json_path, n = out / f"{stem}.json", 1
    while json_path.exists():
        n += 1
        json_path = out / f"{stem}-{n}.json"
    json_path.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")

    try:
        from bench.plot import plot_results
    except ImportError as e:
        print(f"bench: no PNG ({e}); draw it later with python -m bench.plot {json_path}", file=sys.stderr)
        return json_path, None
    return json_path, plot_results(doc, json_path.with_suffix(".png"))
