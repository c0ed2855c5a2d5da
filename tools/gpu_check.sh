#!/usr/bin/env bash
# The one script to run on the GPU machine, from the repository root, in a single call:
#
#   tools/gpu_check.sh                      # = tests
#   tools/gpu_check.sh tests [PYTEST ARGS]  # GPU tests (tests/gpu, -m gpu); extra args go to pytest;
#                                           # arguments naming tests/... paths replace the directory
#   tools/gpu_check.sh bench-decode ARGS    # python3 -m $BENCH_DECODE (bench.decode_step) ARGS
#   tools/gpu_check.sh bench-prefill ARGS   # python3 -m $BENCH_PREFILL (bench.prefill) ARGS
#   tools/gpu_check.sh all                  # tests, then both benches with their defaults
#   tools/gpu_check.sh flash-layers FMT     # the opt-in flash-layers:4 capture test of one expert
#                                           # format (mxfp4 | nvfp4), MEMRA_DSV4_SLOW_ORACLE=1, with
#                                           # the whole call's time (it did not finish in 230 s)
#   tools/gpu_check.sh batch FILE           # one line of FILE per step: SECONDS NAME COMMAND...
#                                           # (COMMAND run by bash under `timeout SECONDS`, output
#                                           # in NAME.log; '#' lines skipped); all the logs and
#                                           # the bench results the steps wrote come back in
#                                           # batch.tgz, with a summary (rc, seconds) in batch.log
#   tools/gpu_check.sh decode-evidence      # the #7 numbers in one call (~6 min on 2x H200):
#                                           # bench_gemv, then bench.decode_step device arm at
#                                           # 1K (bf16 with --launch-profile, fp8) and 32K
#                                           # (--fill random, bf16 and fp8); logs decode_*.log
#
# What it does first, every time: installs the carried wheels (.whl/*.whl: nvmath-python,
# nvtx; the machine has no internet) into /tmp/site without dependencies, puts /tmp/site and
# the repository on PYTHONPATH (no install of the repo itself), and writes env.log (GPUs,
# driver, package versions, cuBLASLt version).  Logs go to $OUT (the device tool's folder that
# comes back; ./out when unset), flat names, at most 8 files: env.log, pip.log,
# gpu_tests.log, bench_decode.log, bench_prefill.log and the newest bench result (json, png).
# Exit status: non-zero when any step failed (later steps of "all" still run).
# MEMRA_DSV4_DEBUG=1 in the environment makes every checked launch synchronise.
# CUDA_LOG_FILE=<path> makes the driver log every failing API call with its error (how the
# sixteenth session found the cuCtxSynchronize that invalidated a graph capture).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BENCH_DECODE=${BENCH_DECODE:-bench.decode_step}
BENCH_PREFILL=${BENCH_PREFILL:-bench.prefill}

# ---------------------------------------------------------------------------- environment
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl >"$OUT/pip.log" 2>&1 || { echo "gpu_check: wheel install failed, see pip.log"; cat "$OUT/pip.log"; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

{
    echo "== $(date -u +%FT%TZ)  commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
    nvidia-smi topo -m 2>/dev/null | head -8
    "$PY" - <<'EOF' 2>&1
import importlib, sys
print("python", sys.version.split()[0])
for mod in ("numpy", "cupy", "cuda.bindings", "cuda.core", "nvmath", "nvtx", "ml_dtypes", "torch"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:<14}", getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:
        print(f"{mod:<14} MISSING ({type(e).__name__}: {e})")
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cuda driver", rt.driverGetVersion(), "runtime", rt.runtimeGetVersion(),
          "devices", rt.getDeviceCount())
    n = rt.getDeviceCount()
    for a in range(n):
        # the devices a can reach by peer access (ids, not flags: "[1]" read as a flag list was ambiguous)
        print(f"  peer access from {a} to:", [b for b in range(n) if b != a and rt.deviceCanAccessPeer(a, b)])
except Exception as e:
    print("cupy runtime query failed:", e)
try:
    from nvmath.bindings import cublasLt
    print("cublasLt", cublasLt.get_version())
except Exception as e:
    print("cublasLt load failed:", e)
import os
print("CUPY_CACHE_DIR", os.environ.get("CUPY_CACHE_DIR", "(set by memra_dsv4.gpu)"),
      "MEMRA_DSV4_DEBUG", os.environ.get("MEMRA_DSV4_DEBUG", "0"))
EOF
} 2>&1 | tee "$OUT/env.log"

# ---------------------------------------------------------------------------- steps
status=0

run_tests() {
    echo "== gpu tests"
    # the whole tests/gpu directory unless an argument names test paths itself (tests/...):
    # then only those (pytest would otherwise collect the directory AND the files)
    local where=tests/gpu a
    for a in "$@"; do case "$a" in tests/*) where= ;; esac; done
    timeout "${GPU_TEST_TIMEOUT:-540}" "$PY" -m pytest -q $where -p no:cacheprovider --durations=15 "$@" 2>&1 | tee "$OUT/gpu_tests.log"
    local rc=${PIPESTATUS[0]}
    echo "== gpu tests exit $rc" | tee -a "$OUT/gpu_tests.log"
    return "$rc"
}

run_bench() {  # run_bench <log name> <python module> [args...]
    local log=$1 module=$2
    shift 2
    if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
        echo "gpu_check: module $module not found (bench not written yet?)" | tee "$OUT/$log"
        return 1
    fi
    echo "== $module $*"
    "$PY" -m "$module" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    # Bring back the newest result pair (json + png) under flat names.
    local newest
    newest=$(ls -t bench/results/*.json 2>/dev/null | head -1)
    if [ -n "$newest" ]; then
        cp "$newest" "$OUT/" && [ -f "${newest%.json}.png" ] && cp "${newest%.json}.png" "$OUT/"
    fi
    return "$rc"
}

step=${1:-tests}
[ $# -gt 0 ] && shift
case "$step" in
    tests)         run_tests "$@" || status=1 ;;
    bench-decode)  run_bench bench_decode.log "$BENCH_DECODE" "$@" || status=1 ;;
    bench-prefill) run_bench bench_prefill.log "$BENCH_PREFILL" "$@" || status=1 ;;
    flash-layers)
        fmt=${1:-mxfp4}
        case "$fmt" in mxfp4|nvfp4) ;; *) echo "flash-layers: format $fmt (mxfp4 | nvfp4)" >&2; exit 2 ;; esac
        MEMRA_DSV4_SLOW_ORACLE=1 GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-570} \
            run_tests -k "flash_layers and $fmt" -s || status=1 ;;
    decode-evidence)
        "$PY" tools/bench_gemv.py 2>&1 | tee "$OUT/gemv.log" || status=1
        common="--model synthetic:flash --devices ${DEVICES:-0,1} --arms path=device --steps 30 --warmup 3 --phase-steps 0"
        run_bench decode_1k_bf16.log "$BENCH_DECODE" $common --ctx 1024 --dense bf16 --launch-profile 10 || status=1
        run_bench decode_1k_fp8.log "$BENCH_DECODE" $common --ctx 1024 --dense fp8 || status=1
        run_bench decode_32k_bf16.log "$BENCH_DECODE" $common --ctx 32768 --fill random --dense bf16 || status=1
        run_bench decode_32k_fp8.log "$BENCH_DECODE" $common --ctx 32768 --fill random --dense fp8 || status=1
        # only 8 files come back from $OUT: every result pair of this run + the logs in one tar
        (cd "$REPO" && tar czf "$OUT/decode_evidence.tgz" -C "$OUT" gemv.log decode_1k_bf16.log \
            decode_1k_fp8.log decode_32k_bf16.log decode_32k_fp8.log \
            -C "$REPO" $(ls -t bench/results/*.json bench/results/*.png 2>/dev/null | head -8)) \
            && rm -f "$OUT"/decode_*.log "$OUT"/gemv.log "$OUT"/*.json "$OUT"/*.png
        ;;
    batch)
        file=${1:?batch FILE}
        [ -f "$file" ] || { echo "batch: $file not found" >&2; exit 2; }
        mkdir -p "$OUT/batch"
        touch "$OUT/batch/.t0"
        while read -r secs name cmd; do
            case "$secs" in ''|'#'*) continue ;; esac
            echo "== [$name] timeout $secs: $cmd" | tee -a "$OUT/batch.log"
            t0=$(date +%s)
            timeout "$secs" bash -c "$cmd" >"$OUT/batch/$name.log" 2>&1 </dev/null
            rc=$?
            echo "== [$name] rc $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/batch.log"
            tail -4 "$OUT/batch/$name.log" | sed 's/^/    /' | tee -a "$OUT/batch.log"
            [ "$rc" = 0 ] || status=1
        done <"$file"
        new_results=$(cd "$REPO" && find bench/results -newer "$OUT/batch/.t0" -type f 2>/dev/null)
        tar czf "$OUT/batch.tgz" -C "$OUT" batch batch.log ${new_results:+-C "$REPO" $new_results} \
            && rm -rf "$OUT/batch"
        ;;
    all)
        run_tests || status=1
        run_bench bench_decode.log "$BENCH_DECODE" || status=1
        run_bench bench_prefill.log "$BENCH_PREFILL" || status=1
        ;;
    *)
        echo "usage: tools/gpu_check.sh [tests [PYTEST ARGS]|bench-decode ARGS|bench-prefill ARGS|flash-layers FMT|batch FILE|decode-evidence|all]" >&2
        exit 2 ;;
esac
echo "== gpu_check: $step finished with status $status (logs in $OUT)"
exit "$status"
