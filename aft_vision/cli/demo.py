"""``aft-vision demo``: random inputs through AFTConv2d and AFTFull; their shapes and median times."""
import argparse
import statistics
import timeit

import torch

from ..layers import AFTConv2d, AFTFull
from ..version import __version__
from .args import parse_device

HELP = 'run random inputs through AFTConv2d and AFTFull; print shapes and times'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--repeats', type=int, default=10, help='timed forward passes per layer (default: 10)')
    parser.add_argument('--device', default='cpu', help='torch device (default: cpu)')


def _median_ms(layer: torch.nn.Module, x: torch.Tensor, repeats: int, warmup: int = 2) -> float:
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.is_cuda else (lambda: None)
    timeit.repeat(lambda: (layer(x), sync()), repeat=warmup, number=1)
    return statistics.median(timeit.repeat(lambda: (layer(x), sync()), repeat=repeats, number=1)) * 1e3


def run(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
    torch.manual_seed(0)
    cases = [
        (AFTConv2d(dim=64, num_heads=8, kernel_size=7), (2, 14, 14, 64)),  # (B, H, W, C)
        (AFTFull(dim=64, seq_len=197), (2, 197, 64)),  # (B, T, C)
    ]
    rows = [('layer', 'input', 'output', f'median ms ({args.repeats} runs)')]
    with torch.inference_mode():
        for layer, shape in cases:
            layer = layer.to(device).eval()
            x = torch.randn(shape, device=device)
            ms = _median_ms(layer, x, args.repeats)
            rows.append((type(layer).__name__, str(tuple(x.shape)), str(tuple(layer(x).shape)), f'{ms:.3f}'))
    print(f'aft-vision {__version__}, torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads')
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    for row in rows:
        print('  '.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0
