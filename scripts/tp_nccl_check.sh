#!/usr/bin/env bash
# Tensor-parallel checks with NCCL on a machine with 2 or more CUDA GPUs (issue #16).
#
#   scripts/tp_nccl_check.sh [--quick]
#
# NOT RUN YET: it was written on a CPU-only machine (no GPU at all, and the only device lease
# this project gets has a single GPU), so neither it nor the NCCL code path it exercises has
# ever run. Expect to debug it the first time.
#
# What it does, each step logged and summarised in one line:
#   1. refuses to run (exit 2, a clear message) unless torch sees >= 2 CUDA devices and NCCL;
#   2. tp-tests: tests/engine/test_tensor_parallel.py equality and startup tests with
#      SPECSERVE_TP_DEVICE=cuda: TP=1 on cuda:0 against TP=2 on cuda:0 + cuda:1 (NCCL
#      all-reduces, gloo control group), greedy tokens equal, logprobs within 1e-4, every rank
#      resolved the same KV layout and dtypes;
#   3. tp-kill (informational, bounded by `timeout`): the killed-worker tests; on NCCL a dead
#      peer is only noticed by NCCL's watchdog after SPECSERVE_TP_TIMEOUT (set to 20 s here),
#      so these may fail; the log says how;
#   4. bench-tp: benchmarks/bench_tp.py, TP=1 against TP=2 (and TP=4 with >= 4 GPUs, --quick
#      skips it) on SmolLM2-shaped random weights with 8/2 heads (SmolLM2-135M itself has 9
#      query heads: valid TP sizes 1 and 3), bfloat16 and float32.
#
# Results go to $OUT if set (else /tmp/tp_nccl_check): one log per step, junit XML,
# bench_tp_<dtype>.jsonl and summary.txt (the lines printed here). Exit status: 2 without
# 2 GPUs, 1 if a required step (tp-tests, bench-tp) failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "tp_nccl_check.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done
RESULTS=${OUT:-/tmp/tp_nccl_check}
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for cand in .venv/bin/python python3; do
        if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then
            PY=$cand
            break
        fi
    done
fi
PY=${PY:-python3}

GPUS=$("$PY" - <<'PYEOF' 2>>"$RESULTS/setup.log"
import torch
import torch.distributed as dist
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n if dist.is_nccl_available() or n == 0 else -1)
PYEOF
)
GPUS=${GPUS:-0}
if [ "$GPUS" = "-1" ]; then
    say "FAIL   torch sees CUDA devices but was built without NCCL: cannot run TP with NCCL"
    exit 2
fi
if [ "$GPUS" -lt 2 ]; then
    say "FAIL   tensor parallelism with NCCL needs >= 2 CUDA GPUs; torch ($PY) sees $GPUS" \
        "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}). Nothing was run."
    exit 2
fi
"$PY" - <<'PYEOF' | tee -a "$SUMMARY"
import torch
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"DEVICE {len(names)} GPUs: {', '.join(names)}; torch {torch.__version__}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF

FAILED=0
run() {  # required(1/0), name, timeout, command...
    local required=$1 name=$2 limit=$3; shift 3
    local log="$RESULTS/$name.log" start=$SECONDS status
    if timeout "$limit" "$@" >"$log" 2>&1; then
        status=PASS
    else
        local rc=$?
        if [ "$required" = 1 ]; then status="FAIL(rc=$rc)"; FAILED=1; else status="INFO(rc=$rc)"; fi
    fi
    local summary
    summary=$(grep -E "passed|failed|skipped|error|tok_s" "$log" | tail -n 3 | cut -c1-300 \
        | tr '\n' ' ')
    say "$status  $name ($((SECONDS - start)) s): $summary"
}

export SPECSERVE_TP_DEVICE=cuda
run 1 tp-tests 900 "$PY" -m pytest -q -rfEs tests/engine/test_tensor_parallel.py \
    -k "greedy_equals or startup_failure or does_not_fit" --junitxml "$RESULTS/tp_tests.xml"
if grep -q "skipped" "$RESULTS/tp-tests.log" && ! grep -q "passed" "$RESULTS/tp-tests.log"; then
    say "FAIL   tp-tests: everything skipped although $GPUS GPUs are visible"
    FAILED=1
fi
unset SPECSERVE_TP_DEVICE
SPECSERVE_TP_TIMEOUT=20 run 0 tp-kill 300 "$PY" -m pytest -q -rfEs \
    tests/engine/test_tensor_parallel.py -k "killed_worker" --junitxml "$RESULTS/tp_kill.xml"

# SmolLM2-135M's shapes (hidden 576, 30 layers, vocab 49152) with 8 query / 2 KV heads of 72,
# random weights: a folder with only config.json (load_format dummy needs no weights)
SHAPED="$RESULTS/smollm2-shaped-8h"
mkdir -p "$SHAPED"
cat >"$SHAPED/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
 "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 72,
 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000,
 "tie_word_embeddings": true, "torch_dtype": "bfloat16"}
JSON
SIZES="1 2"
if [ $QUICK = 0 ] && [ "$GPUS" -ge 4 ]; then SIZES="1 2 4"; fi
for dtype in bfloat16 float32; do
    run 1 "bench-tp-$dtype" 900 "$PY" -m benchmarks.bench_tp --model "$SHAPED" \
        --load-format dummy --device cuda --tp $SIZES --dtype "$dtype" --batch 1 8 32
    grep '^{' "$RESULTS/bench-tp-$dtype.log" >"$RESULTS/bench_tp_$dtype.jsonl" || true
done
[ $FAILED = 0 ] && say "DONE   all required steps passed" || say "DONE   some required step failed"
exit $FAILED
