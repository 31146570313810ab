"""``aft-vision show-keys``: an image's keys per layer and head, as a PNG (``tasks.visualize``)."""
import functools

from . import show_bias

HELP = 'plot an image\'s keys per layer and head (PNG)'
add_arguments = functools.partial(show_bias.add_arguments, keys=True)
run = show_bias.run  # tasks.visualize.show_keys, as args.command says
