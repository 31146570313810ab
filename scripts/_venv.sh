# Sourced by scripts/*.sh: make .venv, install the pinned torch, then this package in editable mode.
#   source scripts/_venv.sh EXTRAS    (EXTRAS: '', 'test', 'demo', 'dev'; comma-separated for several)
# Leaves the caller in the repository root with .venv/bin first on PATH. Set PYTHON to pick the interpreter.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
AFT_EXTRAS="${1:-}"
AFT_VENV="$PWD/.venv"
AFT_STAMP="$AFT_VENV/.aft-stamp"  # one line per extras installed since setup.cfg / pyproject.toml last changed
AFT_TORCH=2.14.1
AFT_TORCHVISION=0.29.1

_aft_fresh() {  # the stamp is newer than the packaging files and lists these extras
    [[ "$AFT_STAMP" -nt setup.cfg && "$AFT_STAMP" -nt pyproject.toml ]] && grep -qxF "${AFT_EXTRAS:-.}" "$AFT_STAMP"
}

if [[ ! -x "$AFT_VENV/bin/python" ]]; then
    echo "_venv.sh: creating $AFT_VENV" >&2
    "${PYTHON:-python3}" -m venv "$AFT_VENV"
fi
export VIRTUAL_ENV="$AFT_VENV"
export PATH="$AFT_VENV/bin:$PATH"

if ! _aft_fresh; then
    python -m pip install -q --upgrade pip
    if ! python -c "import sys, torch, torchvision; sys.exit(torch.__version__.split('+')[0] != '$AFT_TORCH' \
            or torchvision.__version__.split('+')[0] != '$AFT_TORCHVISION')" 2>/dev/null; then
        echo "_venv.sh: installing torch==$AFT_TORCH torchvision==$AFT_TORCHVISION" >&2
        python -m pip install -q "torch==$AFT_TORCH" "torchvision==$AFT_TORCHVISION"
    fi
    echo "_venv.sh: installing aft-vision (editable${AFT_EXTRAS:+, extras: $AFT_EXTRAS})" >&2
    python -m pip install -q -e ".${AFT_EXTRAS:+[$AFT_EXTRAS]}"
    if [[ ! "$AFT_STAMP" -nt setup.cfg || ! "$AFT_STAMP" -nt pyproject.toml ]]; then
        : > "$AFT_STAMP"  # packaging changed: forget the extras installed before
    fi
    echo "${AFT_EXTRAS:-.}" >> "$AFT_STAMP"
fi
