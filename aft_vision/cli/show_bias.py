"""``aft-vision show-bias``: learned position biases per layer and head as a PNG; options shared with show-keys."""
import argparse

from ..tasks.visualize import show_bias, show_keys
from .predict import add_model_arguments

HELP = 'plot learned position biases per layer and head (PNG)'


def add_arguments(parser: argparse.ArgumentParser, keys: bool = False) -> None:
    """Arguments of ``aft-vision show-bias`` (``keys=False``) or ``aft-vision show-keys`` (``keys=True``)."""
    if keys:
        parser.add_argument('image', help='image file (opened with PIL, timm\'s eval transform for the model)')
    add_model_arguments(parser)
    parser.add_argument('--heads', type=int, default=16, help='columns: first N heads or key channels (default: 16)')
    if keys:
        parser.add_argument('--img-size', type=int, default=None, help='input size (default: the data config\'s)')
    else:
        parser.add_argument('--query', type=int, nargs=2, default=None, metavar=('Y', 'X'),
                            help='AFT-full: query patch (row, column) (default: the grid centre)')
        parser.add_argument('--log-scale', action='store_true',
                            help='AFT-conv: colours linear within +-0.1, logarithmic beyond (default: linear)')
    parser.add_argument('--out', required=True, help='output .png file')
    parser.add_argument('--force', action='store_true', help='overwrite --out if it exists')
    parser.add_argument('--dpi', type=int, default=110, help='PNG resolution (default: 110)')


def run(args: argparse.Namespace) -> int:
    """``args.command``'s job (``tasks.visualize.show_bias`` / ``show_keys``) called with the parsed options."""
    job = show_keys if args.command == 'show-keys' else show_bias
    job(**{key: value for key, value in vars(args).items() if key != 'command'})
    return 0
