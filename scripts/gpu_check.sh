#!/usr/bin/env bash
# The GPU checks and figures of the fused AFT-conv operator in one run, under 8 minutes on an H100 (docs/gpu.md):
#   OUT=/tmp/gpu bash scripts/gpu_check.sh         (OUT defaults to outputs/gpu_check)
# 1. the CUDA tests (the fused kernels against the float64 reference in float32, bfloat16 and float16; CUDA graphs;
#    torch.compile under autocast), 2. one mixer layer per method (bench --ops), 3. whole models eager with
#    method='auto' and with AFT_CONV_METHOD=fused, 4. torch.compile, 5. timm's train.py --torchcompile for a few steps
#    on generated images (needs AFT_TIMM_SCRIPTS: a folder holding timm's train.py; skipped without it).
# Needs python3 with torch, triton, timm and pytest (the GPU machine's own); nothing is installed. Every figure file
# starts with the device, the versions and the command. At most eight files land in OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_check}"
PY="${PYTHON:-python3}"
SCRATCH="$(mktemp -d)"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu_check.log") 2>&1

header() {  # the machine, versions and commit, then the command
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -c 'import sys, torch, triton, timm; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "timm", timm.__version__)'
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +changes)"
    echo "command: $*"
    echo
}

bench() {  # bench NAME ARGS...: aft-vision bench into SCRATCH/NAME, its table copied to OUT/NAME.md
    local name="$1"
    shift
    local args=(--device cuda --precision bf16 --batch-size 64 --repeats 10 --warmup 3 --out-dir "$SCRATCH/$name" "$@")
    echo "== $name: aft-vision bench ${args[*]}"
    { header "${AFT_CONV_METHOD:+AFT_CONV_METHOD=$AFT_CONV_METHOD }aft-vision bench ${args[*]}"
      timeout 170 "$PY" -m aft_vision.cli bench "${args[@]}" >/dev/null && cat "$SCRATCH/$name"/*.md
    } > "$OUT/$name.md" 2>&1 || echo "$name failed (exit $?): see $OUT/$name.md"
}

echo "== versions"
header "bash scripts/gpu_check.sh"

echo "== 1. CUDA tests"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/layers -k "cuda or sm90" 2>&1 | tail -30

bench ops --ops --resolutions 224 384 --models aft_conv_small aft_conv_small_11_h16 aft_conv_tiny
MODELS=(--resolutions 224 384 --models aft_conv_small aft_conv_tiny aft_full_tiny)
bench models_auto "${MODELS[@]}"
AFT_CONV_METHOD=fused bench models_fused "${MODELS[@]}"
AFT_CONV_METHOD=fused bench compile_fused --compile --no-peak-memory --resolutions 224 --models aft_conv_small \
    aft_conv_tiny

echo "== 5. timm train.py --torchcompile through the fused operator"
if [[ -f "${AFT_TIMM_SCRIPTS:-}/train.py" ]]; then
    "$PY" - "$SCRATCH/data" <<'EOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image

rng = np.random.default_rng(0)
for split in ('train', 'validation'):
    for label in ('a', 'b'):
        folder = Path(sys.argv[1]) / split / label
        folder.mkdir(parents=True)
        for i in range(32):
            Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(folder / f'{i}.png')
EOF
    TRAIN=(train.py "$SCRATCH/data" --device-modules aft_vision --model aft_conv_small --num-classes 2 --amp
           --amp-dtype bfloat16 --torchcompile -b 16 --epochs 1 --warmup-epochs 0 --workers 2 --log-interval 1
           --output "$SCRATCH/train")
    { header "AFT_CONV_METHOD=fused ${TRAIN[*]}"
      (cd "$AFT_TIMM_SCRIPTS" && AFT_CONV_METHOD=fused timeout 200 "$PY" "${TRAIN[@]}" 2>&1 | tail -40)
    } > "$OUT/train.log" 2>&1
    tail -5 "$OUT/train.log"
else
    echo "skipped: set AFT_TIMM_SCRIPTS to a folder holding timm's train.py (carry it to the GPU machine)"
fi
rm -rf "$SCRATCH"
echo "== done: $OUT"
