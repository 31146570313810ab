"""The ``aft-vision`` command line, on top: one module per subcommand, which declares its options and turns them into
the plain Python arguments of a job below. May import every other part of aft_vision."""
from .parser import SUBCOMMANDS, build_parser, main
