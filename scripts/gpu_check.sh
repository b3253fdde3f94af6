#!/usr/bin/env bash
# GPU checks for a CUDA machine with no network: prints one summary line per check.
#   scripts/gpu_check.sh [WHEEL_DIR]
# WHEEL_DIR (optional) holds local wheels (e.g. flashinfer-python) to install first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ $# -ge 1 ] && [ -d "$1" ]; then
    "$PY" -m pip install --no-index --find-links "$1" flashinfer-python >/tmp/gpu_check_pip.log 2>&1 \
        && echo "SETUP  installed flashinfer from $1" || echo "SETUP  could not install from $1 (see /tmp/gpu_check_pip.log)"
fi
"$PY" - <<'PYEOF'
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
    local log="/tmp/gpu_check_${name}.log" start=$SECONDS
    if timeout "$limit" "$@" >"$log" 2>&1; then status=PASS; else status=FAIL; fi
    local summary
    summary=$(grep -E "passed|failed|skipped|tok/s|error" "$log" | tail -n 3 | tr '\n' ' ')
    echo "$status  $name ($((SECONDS - start)) s): $summary"
}

run attention-flashinfer-vs-torch 240 "$PY" -m pytest -q tests/gpu -k "matches_torch"
run greedy-spec-equals-plain 120 "$PY" -m pytest -q tests/gpu -k "greedy"
run torch-backend-cpu-contracts 120 "$PY" -m pytest -q tests/attention
run throughput-qwen3-8b-shape 180 "$PY" benchmarks/bench_gpu.py --batch 1 32 --max-tokens 32
