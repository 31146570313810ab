#!/usr/bin/env bash
# The test suite (tests/, see [tool:pytest] in setup.cfg). Arguments go to pytest, e.g. `-m "not slow"`.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
python -m pytest -q "$@"
