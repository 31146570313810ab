#!/usr/bin/env bash
# The main job: train a small AFT-conv on scikit-learn's digits (no download), evaluate it at 32 and 48 px,
# publish it as a Hub folder, reload it through timm and check it is identical. Arguments go to `aft-vision train`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" demo
python -m aft_vision.cli train "$@"
