"""``python -m aft_vision.train ARGS`` (and torchrun's ``-m aft_vision.train``): ``aft-vision train ARGS``.

The job itself is ``aft_vision.tasks.classify`` (``--task segment``: ``aft_vision.tasks.segment``)."""
import sys

from .cli import main

if __name__ == '__main__':
    raise SystemExit(main(['train', *sys.argv[1:]]))
