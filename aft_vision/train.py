"""``python -m aft_vision.train ARGS`` (and torchrun's ``-m aft_vision.train``): ``aft-vision train ARGS``.

The job itself is ``aft_vision.tasks.classify`` (``--task segment``: ``aft_vision.tasks.segment``)."""
from .cli.train import main

if __name__ == '__main__':
    raise SystemExit(main())
