"""Run a timm script with the AFT models registered: ``python -m aft_vision.run [--aft-sparsity W] SCRIPT [ARGS...]``.

timm's ``train.py`` has ``--device-modules aft_vision``; ``validate.py``, ``inference.py`` and ``benchmark.py`` have no
such hook. This launcher imports aft_vision (registering every ``aft_*`` model), then runs SCRIPT as ``__main__`` with
its arguments unchanged, so it also works under ``torchrun -m aft_vision.run SCRIPT ...``.

``--aft-sparsity W`` (the paper: 0.001): while SCRIPT runs, timm's classification task (what ``train.py`` trains with;
it has no loss hook) adds W times Eq. 9's ``position_bias_entropy`` to the training loss. Only this launcher, named on
the command line, changes timm, and only for the script's run. For AFT-conv's windows to follow each step's size
(``--train-img-sizes``), give ``train.py`` ``--model-kwargs dynamic_img_size=True``: no hook is needed.
"""
import contextlib
import math
import runpy
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import aft_vision.models  # noqa: F401  (registers the models before the script looks them up)


@contextlib.contextmanager
def sparsity_in_timm_tasks(weight: float) -> Iterator[None]:
    """Within the block, timm's ``ClassificationTask`` adds ``weight * position_bias_entropy(model)`` to its loss;
    timm's own ``forward`` is back after it. Distillation tasks are unchanged."""
    from timm.task import ClassificationTask

    from aft_vision.tasks.regularizers import position_bias_entropy

    timm_forward = ClassificationTask.forward

    def forward(self, input, target):
        result = timm_forward(self, input, target)
        result['loss'] = result['loss'] + weight * position_bias_entropy(self.trainable_module)
        return result

    ClassificationTask.forward = forward
    try:
        yield
    finally:
        ClassificationTask.forward = timm_forward


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__.strip())
        return 0 if argv else 2
    weight = None
    if argv[0] == '--aft-sparsity':
        try:
            weight = float(argv[1])
        except (IndexError, ValueError):
            weight = -1.0
        if not 0 <= weight < math.inf:
            print(f'aft_vision.run: error: --aft-sparsity takes a weight >= 0 (the paper: 0.001), got '
                  f'{argv[1] if len(argv) > 1 else "nothing"}', file=sys.stderr)
            return 2
        argv = argv[2:]
    script = Path(argv[0]) if argv else None
    if script is None or not script.is_file():
        print(f'aft_vision.run: error: script not found: {script or "none given"}', file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT` would
    with sparsity_in_timm_tasks(weight) if weight else contextlib.nullcontext():
        runpy.run_path(str(script), run_name='__main__')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
