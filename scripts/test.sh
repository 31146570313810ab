#!/usr/bin/env bash
# The test suite (tests/, see [tool:pytest] in setup.cfg) in two processes (pytest-xdist, one torch thread each; tests
# that share an expensive fixture run in one of them, see tests/conftest.py). Arguments go to pytest, e.g.
# `-m "not slow"`, or `-n 0` for one process.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" test
python -m pytest -q -n 2 --dist loadgroup --max-worker-restart 0 "$@"
