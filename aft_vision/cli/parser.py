"""The ``aft-vision`` command line (also ``python -m aft_vision.cli``): each subcommand is a module named after it
(``show-bias``: ``show_bias.py``) with ``HELP``, an optional ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> int``, run through ``args.run_command``."""
import argparse
import importlib
import sys
from types import ModuleType
from typing import Optional, Sequence

from ..version import __version__
from .args import Parser, run_command

__all__ = ['SUBCOMMANDS', 'build_parser', 'main']

SUBCOMMANDS = ('demo', 'transfer', 'publish', 'bench', 'train', 'study', 'predict', 'export', 'show-bias', 'show-keys')


def _subcommand(name: str) -> ModuleType:
    return importlib.import_module(f'{__package__}.{name.replace("-", "_")}')


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog='aft-vision', description='Attention Free Transformer tools for timm.')
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    for name in SUBCOMMANDS:
        command = _subcommand(name)
        command.add_arguments(subparsers.add_parser(name, help=command.HELP,
                                                    description=getattr(command, 'DESCRIPTION', None)))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit code."""
    return run_command(build_parser(), sys.argv[1:] if argv is None else argv,
                       lambda args: _subcommand(args.command).run(args))
