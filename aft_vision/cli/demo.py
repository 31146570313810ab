"""``aft-vision demo``: random inputs through AFTConv2d and AFTFull; their shapes and median times."""
import argparse
import statistics
import time
from typing import Callable, List, Sequence

import torch

from ..layers import AFTConv2d, AFTFull
from ..version import __version__
from .args import parse_device

HELP = 'run random inputs through AFTConv2d and AFTFull; print shapes and times'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--repeats', type=int, default=10, help='timed forward passes per layer (default: 10)')
    parser.add_argument('--device', default='cpu', help='torch device (default: cpu)')


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


def _print_table(header: Sequence[str], rows: List[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print('  '.join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def run(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
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
