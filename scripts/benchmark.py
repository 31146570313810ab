#!/usr/bin/env python
"""AFT vs DeiT benchmark: ``python scripts/benchmark.py [ARGS]`` is ``aft-vision bench [ARGS]``."""
import sys

from aft_vision.cli import main

if __name__ == '__main__':
    raise SystemExit(main(['bench', *sys.argv[1:]]))
