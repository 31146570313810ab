"""``python -m aft_vision.train ARGS`` (also under torchrun): ``aft-vision train ARGS`` (``cli.train``, ``tasks``)."""
import sys

from .cli import main

if __name__ == '__main__':
    raise SystemExit(main(['train', *sys.argv[1:]]))
