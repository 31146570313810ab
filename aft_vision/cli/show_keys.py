"""``aft-vision show-keys``: an image's keys per layer and head, as a PNG (``tasks.visualize``)."""
import argparse
import functools

from ..tasks.visualize import show_keys
from .show_bias import add_arguments as add_bias_arguments

HELP = 'plot an image\'s keys per layer and head (PNG)'
add_arguments = functools.partial(add_bias_arguments, keys=True)


def run(args: argparse.Namespace) -> int:
    options = {key: value for key, value in vars(args).items() if key != 'command'}
    show_keys(**options)
    return 0
