"""The ``aft-vision`` command line (also ``python -m aft_vision.cli``).

Each subcommand is a ``_add_<name>(subparsers)`` that declares its arguments and a ``_cmd_<name>(args) -> int``
that runs it. Errors the user causes (bad names, missing files, bad values) end as one line on stderr, exit code 2.
"""
import argparse
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence

import torch

from .version import __version__


def _median_ms(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
    times = []
    for i in range(warmup + repeats):
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _device(name: str) -> torch.device:
    """Parse a ``--device`` value; a bad or unavailable device is a user error (ValueError)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f'bad --device {name!r}: {e}') from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f'--device {name!r}: CUDA is not available')
    return device


def _print_table(header: Sequence[str], rows: List[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print('  '.join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def _add_demo(subparsers) -> None:
    p = subparsers.add_parser('demo', help='run random inputs through AFTConv2d and AFTFull; print shapes and times')
    p.add_argument('--repeats', type=int, default=10, help='timed forward passes per layer (default: 10)')
    p.add_argument('--device', default='cpu', help='torch device (default: cpu)')


def _cmd_demo(args: argparse.Namespace) -> int:
    from .layers import AFTConv2d, AFTFull

    if args.repeats < 1:
        raise ValueError(f'--repeats must be >= 1, got {args.repeats}')
    device = _device(args.device)
    torch.manual_seed(0)
    cases = [
        (AFTConv2d(dim=64, num_heads=8, kernel_size=7), (2, 14, 14, 64)),  # (B, H, W, C)
        (AFTFull(dim=64, seq_len=197), (2, 197, 64)),  # (B, T, C)
    ]
    rows = []
    with torch.inference_mode():
        for layer, shape in cases:
            layer = layer.to(device).eval()
            x = torch.randn(shape, device=device)
            y = layer(x)
            ms = _median_ms(lambda: layer(x), args.repeats, device)
            rows.append((type(layer).__name__, tuple(x.shape), tuple(y.shape), f'{ms:.3f}'))
    print(f'aft-vision {__version__}, torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads')
    _print_table(('layer', 'input', 'output', f'median ms ({args.repeats} runs)'), rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='aft-vision', description='Attention Free Transformer tools for timm.')
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    _add_demo(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    command = globals()[f'_cmd_{args.command}']
    try:
        return command(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f'{parser.prog}: error: {message}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    raise SystemExit(main())
