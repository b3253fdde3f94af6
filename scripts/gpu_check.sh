#!/usr/bin/env bash
# GPU checks for a CUDA machine with no network: install FlashInfer from a local bundle, run
# tests/gpu and the GPU benchmark, print one summary line per check.
#
#   scripts/gpu_check.sh [BUNDLE_DIR] [--quick]
#
# BUNDLE_DIR (default .gpu-bundle/, git-ignored) is made beforehand on a machine with network:
#   python3 ../shared/tools/flashinfer_bundle.py .gpu-bundle
# which writes flashinfer-slim.zip (about 28 MB) and the apache-tvm-ffi wheel (CPython 3.12,
# x86-64). A folder of flashinfer-python wheels also works (pip --no-index). FlashInfer then
# JIT-compiles its kernels on first use (about 85 s for the first bf16 + fp8 pair; MAX_JOBS
# defaults to the core count). When flashinfer already imports, the bundle is not needed.
#
# --quick runs a small benchmark (batch 1 and 32, prompt 256, 16 timed steps) that fits a
# short device lease; the default is the full matrix (batch 1/8/32/128, prompt 256/1024).
#
# Results go to $OUT if set (else /tmp/gpu_check): one log per check, pytest's junit XML,
# bench_gpu.json and summary.txt (the lines printed here).
set -uo pipefail
cd "$(dirname "$0")/.."

BUNDLE=.gpu-bundle
QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        *) BUNDLE=$arg ;;
    esac
done
RESULTS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# $PYTHON, else the first of .venv/bin/python and python3 whose torch sees CUDA, else the
# first with torch at all (the checks then skip or fail and say why)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for check in "sys.exit(not torch.cuda.is_available())" "pass"; do
        for cand in .venv/bin/python python3; do
            if command -v "$cand" >/dev/null && "$cand" -c "import sys, torch; $check" 2>/dev/null; then
                PY=$cand
                break 2
            fi
        done
    done
fi
PY=${PY:-python3}

# -- FlashInfer from the bundle -------------------------------------------------------------
SITE=${FLASHINFER_SITE:-/tmp/flashinfer-site}
if "$PY" -c "import flashinfer" 2>/dev/null; then
    say "SETUP  flashinfer already importable"
elif [ -f "$BUNDLE/flashinfer-slim.zip" ]; then
    mkdir -p "$SITE"
    ok=1
    for whl in "$BUNDLE"/apache_tvm_ffi*.whl; do
        [ -e "$whl" ] || continue
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" \
            >>"$RESULTS/setup.log" 2>&1 || ok=0
    done
    "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$BUNDLE/flashinfer-slim.zip" "$SITE" >>"$RESULTS/setup.log" 2>&1 || ok=0
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    if [ $ok = 1 ] && "$PY" -c "import flashinfer" >>"$RESULTS/setup.log" 2>&1; then
        say "SETUP  flashinfer installed from $BUNDLE into $SITE"
    else
        say "SETUP  could not install flashinfer from $BUNDLE (see $RESULTS/setup.log)"
    fi
elif ls "$BUNDLE"/flashinfer*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$BUNDLE" flashinfer-python \
        >>"$RESULTS/setup.log" 2>&1 \
        && say "SETUP  installed flashinfer wheels from $BUNDLE" \
        || say "SETUP  could not install wheels from $BUNDLE (see $RESULTS/setup.log)"
else
    say "SETUP  no bundle in $BUNDLE: flashinfer checks will skip" \
        "(make one with: python3 ../shared/tools/flashinfer_bundle.py $BUNDLE)"
fi

"$PY" - <<'PYEOF' | tee -a "$SUMMARY"
import torch
ok = torch.cuda.is_available()
print(f"DEVICE {'cuda: ' + torch.cuda.get_device_name(0) if ok else 'no CUDA device'}; torch {torch.__version__}")
try:
    import flashinfer
    print(f"DEVICE flashinfer {flashinfer.__version__}")
except ImportError:
    print("DEVICE flashinfer not installed")
PYEOF

run() {  # name, timeout, command...
    local name=$1 limit=$2; shift 2
    local log="$RESULTS/$name.log" start=$SECONDS status
    if timeout "$limit" "$@" >"$log" 2>&1; then status=PASS; else status="FAIL(rc=$?)"; fi
    local summary
    summary=$(grep -E "passed|failed|skipped|error|greedy equal" "$log" | tail -n 3 | tr '\n' ' ')
    say "$status  $name ($((SECONDS - start)) s): $summary"
}

run gpu-tests 900 "$PY" -m pytest -q -rfEs tests/gpu --junitxml "$RESULTS/gpu_tests.xml"
if [ $QUICK = 1 ]; then
    run bench-gpu 600 "$PY" benchmarks/bench_gpu.py --batch 1 32 --prompt-len 256 \
        --decode-steps 16 --profile-steps 4 --spec-batch 1 --spec-tokens 48 \
        --json "$RESULTS/bench_gpu.json"
else
    run bench-gpu 1800 "$PY" benchmarks/bench_gpu.py --json "$RESULTS/bench_gpu.json"
fi
[ -f "$RESULTS/bench-gpu.log" ] && sed -n '/^## /,$p' "$RESULTS/bench-gpu.log" | tee -a "$SUMMARY"
exit 0
