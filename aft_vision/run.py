"""Run a timm script with the AFT models registered: ``python -m aft_vision.run SCRIPT [ARGS...]``.

timm's ``train.py`` has ``--device-modules aft_vision``; ``validate.py``, ``inference.py`` and ``benchmark.py`` have no
such hook. This launcher imports aft_vision (registering every ``aft_*`` model), then runs SCRIPT as ``__main__`` with
its arguments unchanged, so it also works under ``torchrun -m aft_vision.run SCRIPT ...``.
"""
import runpy
import sys
from pathlib import Path

import aft_vision.models  # noqa: F401  (registers the models before the script looks them up)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__.strip())
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f'aft_vision.run: error: script not found: {script}', file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT` would
    runpy.run_path(str(script), run_name='__main__')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
