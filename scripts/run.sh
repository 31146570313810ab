#!/usr/bin/env bash
# The main job. For now: the AFT layer demo (shapes and timings). Arguments go to `aft-vision demo`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" demo
python -m aft_vision.cli demo "$@"
