"""``aft-vision show-keys``: an image's keys per layer and head, as a PNG (``tasks.visualize``)."""
import functools

from ..tasks.visualize import show_keys
from .show_bias import add_arguments as add_bias_arguments, runner

HELP = 'plot an image\'s keys per layer and head (PNG)'
add_arguments = functools.partial(add_bias_arguments, keys=True)
run = runner(show_keys)
