#!/usr/bin/env bash
# The GPU figures, then the CUDA tests, in under 5 minutes of an H100 / H200 (docs/performance.md, "GPU"):
#   OUT=/tmp/gpu bash scripts/gpu_check.sh          (OUT defaults to ./gpu_out)
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh       (every step but c at tiny sizes on the CPU: proves the script)
# Each step runs under its own `timeout` (cap), all under BUDGET_S seconds (default 290) of which the figures leave
# 110 to the tests; a step with under 15 s left is skipped and says so. Budget per step on an H100 / H200:
#   env         ~5 s  nvidia-smi, python / torch / CUDA / cuDNN / timm versions, the git commit -> env.txt
#   a_ops      ~45 s  one mixer layer per method, forward / backward, beside its op and MB count (bench --ops,
#                     bf16): aft_conv_small, aft_conv_tiny, aft_full_tiny at 224 and 384 px, batch 64; a_ops_big
#                     the AFT-conv layers at 768 px, batch 16 (--ops takes no --batch-at)               caps 70, 40
#   b_models   ~70 s  whole models on 'auto' against DeiT (bench, bf16): inference, training step, training peak
#                     memory; the three at 224 and 384 px, batch 64; b_models_big aft_conv_small at 768 px, batch 16
#                                                                                                      caps 75, 40
#   b_tuned    ~30 s  method='tuned' in whole models (bf16 autocast, batch 16): aft_conv_small, aft_conv_small_11_h16,
#                     aft_conv_tiny at 224, 384, 768 and 1024 px, an inference call and a training step each; per layer
#                     key the forms' times and the faster beside choose_conv_method's choice: the data to refit
#                     DISPATCH_TABLES['cuda'] from (docs/performance.md)                                   cap 45
#   c_compile  ~50 s  the same with --compile (torch.compile fullgraph): aft_conv_small at 224 px         cap 70
#   d_train    ~50 s  timm's train.py --amp --amp-dtype bfloat16 --torchcompile through aft_vision.run, 4 steps on
#                     generated images (needs AFT_TIMM_SCRIPTS: a folder holding timm's train.py)    cap 60
#   e_tests    ~80 s  pytest tests/layers/test_cuda.py -rA; if it failed, the failures again (--lf)  caps 100, 40
# Repeats 5, warmup 2 per figure (median). Every log lands whole in OUT (never cut), each table beside the command
# that made it (NAME/command.txt), and summary.md gathers the steps' status and seconds, and every table. Needs python3
# with torch, timm, pytest and Pillow (the machine's own, or PYTHON=...); nothing is installed, triton is not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-290}"
DRY="${GPU_CHECK_DRY:-0}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$SECONDS
RESERVE_S=110  # kept for the tests while the figures run

if [[ "$DRY" == 1 ]]; then  # the same commands at tiny sizes on the CPU
    DEVICE=cpu BATCH=2 BIG_BATCH=2 RES=(32 48) BIG_RES=64 TIMING=(--repeats 1 --warmup 1 --threads 1)
    TUNED_MODELS='aft_conv_tiny' TUNED_RES='32 48' TUNED_BATCH=2
    CONV_MODELS=(aft_conv_tiny) FULL_MODELS=(aft_full_tiny) TRAIN_MODEL=aft_conv_test COMPILE_BACKEND=eager
    LIGHT=(--no-peak-memory)  # the CPU measures peak memory in a process per figure
else
    DEVICE=cuda BATCH=64 BIG_BATCH=16 RES=(224 384) BIG_RES=768 TIMING=(--repeats 5 --warmup 2)
    TUNED_MODELS='aft_conv_small aft_conv_small_11_h16 aft_conv_tiny' TUNED_RES='224 384 768 1024' TUNED_BATCH=16
    CONV_MODELS=(aft_conv_small aft_conv_tiny) FULL_MODELS=(aft_full_tiny) TRAIN_MODEL=aft_conv_small
    COMPILE_BACKEND=inductor LIGHT=()
fi
export PY OUT DRY BUDGET_S TRAIN_MODEL COMPILE_BACKEND DEVICE TUNED_MODELS TUNED_RES TUNED_BATCH
BENCH=("$PY" -m aft_vision.cli bench --device "$DEVICE" --precision bf16 "${TIMING[@]}")

step() {  # step NAME CAP COMMAND...: COMMAND under `timeout` into OUT/NAME.log (the command first), timed
    local name="$1" cap="$2" left=$((BUDGET_S - RESERVE_S - (SECONDS - START)))
    shift 2
    local limit=$((cap < left ? cap : left)) begin=$SECONDS rc
    if ((limit < 15)); then
        skip "$name" "${left}s of the ${BUDGET_S}s budget left"
        return 0
    fi
    echo "== $name (up to ${limit}s): $*"
    { echo "command: $*"; echo "timeout: ${limit}s"; echo; } > "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    rc=$?
    local status="ok"
    ((rc == 124 || rc == 137)) && status="timed out after ${limit}s"
    ((rc != 0 && rc != 124 && rc != 137)) && status="failed (exit $rc)"
    echo "| $name | $status | $((SECONDS - begin)) |" >> "$OUT/summary.steps"
    echo "   $status in $((SECONDS - begin))s: $OUT/$name.log"
    return 0
}

bench() {  # bench NAME CAP ARGS...: aft-vision bench into OUT/NAME/, its command beside its table
    local name="$1" cap="$2"
    shift 2
    rm -rf "${OUT:?}/$name"
    mkdir -p "$OUT/$name"
    echo "${BENCH[*]} $* --out-dir $OUT/$name --force" > "$OUT/$name/command.txt"
    step "$name" "$cap" "${BENCH[@]}" "$@" --out-dir "$OUT/$name" --force
}

skip() {  # skip NAME WHY
    echo "| $1 | skipped: $2 | 0 |" >> "$OUT/summary.steps"
    echo "== $1: skipped ($2)"
}

environment() {
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        nvidia-smi
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'EOF'
import importlib.util
import platform
import sys

import timm
import torch

print('python', sys.version.split()[0], platform.platform())
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())
print('timm', timm.__version__, 'triton', 'present' if importlib.util.find_spec('triton') else 'absent')
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
EOF
    local edits=''
    git diff --quiet HEAD 2>/dev/null || edits=' (with uncommitted edits)'
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$edits"
    echo "GPU_CHECK_DRY=$DRY BUDGET_S=$BUDGET_S"
}

train() {  # timm's train.py through aft_vision.run on 2 classes x 32 generated images (4 steps at batch 16)
    local data="$OUT/d_train/data" size=224 device=()
    [[ "$DRY" == 1 ]] && size=32 device=(--device cpu)
    "$PY" - "$data" "$size" <<'EOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image

rng = np.random.default_rng(0)
for split in ('train', 'validation'):
    for label in ('a', 'b'):
        folder = Path(sys.argv[1]) / split / label
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(32):
            size = int(sys.argv[2])
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f'{i}.png')
EOF
    "$PY" -m aft_vision.run "$AFT_TIMM_SCRIPTS/train.py" "$data" --model "$TRAIN_MODEL" --img-size "$size" \
        --num-classes 2 --amp --amp-dtype bfloat16 --torchcompile "$COMPILE_BACKEND" -b 16 --epochs 1 \
        --warmup-epochs 0 --workers 2 --log-interval 1 --output "$OUT/d_train/output" "${device[@]}"
}

tuned() {  # method='tuned' in whole models: what it chose per layer key, the forms' times, the table's choice
    "$PY" - "$DEVICE" "$TUNED_BATCH" "$TUNED_MODELS" "$TUNED_RES" <<'EOF'
import re
import sys

import timm
import torch

import aft_vision  # noqa: F401  registers the models
from aft_vision.layers import choose_conv_method, tuned_choices

device, batch, models, sizes = torch.device(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
print(f"method='tuned' on {device}, bfloat16 autocast, batch {batch}: an inference call and a training step (forward "
      "and backward) per model and size; per layer key the median ms of each form (forward, or forward and backward, "
      "of one layer; '-': none timed, the dense form being beyond the table's size limit) beside what the table picks "
      "at this batch")
print('\n| model | res | key | tuned | dense ms | conv ms | table |\n|---|---|---|---|---|---|---|')
for name in models:
    for size in map(int, sizes):
        torch.manual_seed(0)
        model = timm.create_model(name, img_size=size, mixer_kwargs={'method': 'tuned'}).to(device)
        images = torch.randn(batch, 3, size, size, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            with torch.no_grad():
                model.eval()(images)
            out = model.train()(images)
        out.float().sum().backward()
        for key, (method, ms) in tuned_choices(clear=True).items():
            shape = map(int, re.search(r' (\d+)x(\d+) C (\d+) h (\d+) s (\d+) ', key).groups())
            dense, conv = (f'{ms[form]:.2f}' if form in ms else '-' for form in ('dense', 'conv'))
            table = choose_conv_method(device.type, batch, *shape)
            print(f'| {name} | {size} | {key} | {method} | {dense} | {conv} | {table} |', flush=True)
        del model, images, out
EOF
}

export -f environment train tuned
rm -f "$OUT/summary.steps"
step env 30 bash -c environment
cp "$OUT/env.log" "$OUT/env.txt"

bench a_ops 70 --ops --batch-size "$BATCH" --models "${CONV_MODELS[@]}" "${FULL_MODELS[@]}" --resolutions "${RES[@]}"
bench a_ops_big 40 --ops --batch-size "$BIG_BATCH" --models "${CONV_MODELS[@]}" --resolutions "$BIG_RES"
bench b_models 75 "${LIGHT[@]}" --batch-size "$BATCH" --models "${CONV_MODELS[@]}" "${FULL_MODELS[@]}" \
    --resolutions "${RES[@]}"
bench b_models_big 40 "${LIGHT[@]}" --batch-size "$BATCH" --batch-at "$BIG_RES=$BIG_BATCH" \
    --models "${CONV_MODELS[0]}" --resolutions "$BIG_RES"
step b_tuned 45 bash -c tuned
if [[ "$DRY" == 1 ]]; then  # tests/models/test_compile.py compiles on the CPU
    skip c_compile "dry run: Inductor takes minutes on a CPU"
else
    bench c_compile 70 --compile --no-peak-memory --batch-size "$BATCH" --models "${CONV_MODELS[0]}" \
        --resolutions "${RES[0]}"
fi
if [[ -f "${AFT_TIMM_SCRIPTS:-}/train.py" ]]; then
    mkdir -p "$OUT/d_train"
    step d_train 60 bash -c train
else
    skip d_train "set AFT_TIMM_SCRIPTS to a folder holding timm's train.py"
fi
RESERVE_S=0
PYTEST=("$PY" -m pytest -rA -o cache_dir="$OUT/.pytest_cache" tests/layers/test_cuda.py)
step e_tests 100 "${PYTEST[@]}"
if ! grep -q "^| e_tests | ok" "$OUT/summary.steps"; then
    step e_tests_rerun 40 "${PYTEST[@]}" --lf
fi

{
    echo "# gpu_check.sh, $(date -u +%FT%TZ), ${SECONDS}s in all"
    echo
    sed -n '/^device\|^torch\|^timm\|^commit\|^python/p' "$OUT/env.txt"
    echo
    echo "| step | status | seconds |"
    echo "|---|---|---|"
    cat "$OUT/summary.steps"
    for name in a_ops a_ops_big b_models b_models_big c_compile; do
        for table in "$OUT/$name"/*.md; do
            [[ -f "$table" ]] || continue
            printf '\n## %s\n\n`%s`\n\n' "$name" "$(cat "$OUT/$name/command.txt")"
            cat "$table"
        done
    done
    if grep -q '^| model ' "$OUT/b_tuned.log" 2>/dev/null; then
        printf '\n## b_tuned\n\n'
        grep -E "^(method='tuned'|\|)" "$OUT/b_tuned.log"
    fi
    echo
    grep -hE '^=+ .+ in [0-9.]+s( \([0-9:]+\))? =+$' "$OUT"/e_tests*.log 2>/dev/null
} > "$OUT/summary.md"
rm -f "$OUT/summary.steps"
cat "$OUT/summary.md"
echo "== done in ${SECONDS}s: $OUT"
