"""``aft-vision bench --ops``: every AFT-conv method on the mixer layer of each model, timed forward and backward
apart, beside the one ``method='auto'`` picks: the measurements behind the dispatch tables
(``aft_vision/layers/dispatch.py``; docs/performance.md, "Choosing the AFT-conv method")."""
import contextlib
import statistics
import time
from typing import Dict, List

import timm
import torch
from tqdm import tqdm

from ..layers import AFTConv2d, aft_conv2d, choose_conv_method
from .report import write_report

__all__ = ['layer_shape', 'time_methods', 'main', 'autocast', 'sync']


def autocast(device: torch.device, precision: str):
    """Autocast to ``precision`` ('bf16', 'fp16') on ``device``; nothing for 'fp32'."""
    if precision == 'fp32':
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == 'bf16' else torch.float16)


def sync(device: torch.device):
    """Wait for ``device``'s queued work (CUDA), so that a clock read after it times the work."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def layer_shape(name: str, img_size: int) -> Dict[str, int]:
    """The first AFT-conv layer of a registered model at ``img_size``: grid, width, heads, window (on meta)."""
    model = timm.create_model(name, img_size=img_size, device='meta')
    layer = next((m for m in model.modules() if isinstance(m, AFTConv2d)), None)
    if layer is None:
        raise ValueError(f'{name} has no AFT-conv layer; --ops times the AFT-conv methods')
    patch = model.patch_embed.patch_size
    return {'height': img_size // patch[0], 'width': img_size // patch[1], 'channels': layer.dim,
            'num_heads': layer.num_heads, 'kernel_size': layer.kernel_size}


def variants_for(device: torch.device) -> List[str]:
    """What ``--ops`` can time on ``device``: 'dense', 'conv:forward_conv' and, on CUDA, 'fused' (the operator)."""
    return ['dense', 'conv:forward_conv'] + (['fused'] if device.type == 'cuda' else [])


def time_methods(shape: Dict[str, int], batch_size: int, device: torch.device, precision: str, repeats: int,
                 warmup: int, variants: List[str]) -> Dict[str, Dict[str, float]]:
    """Median forward and backward milliseconds of ``aft_conv2d`` for one layer shape, per variant of
    ``variants_for``."""
    gen = torch.Generator(device=device).manual_seed(0)
    grid = (batch_size, shape['height'], shape['width'])
    q, v = (torch.randn(*grid, shape['channels'], device=device, generator=gen, requires_grad=True) for _ in 'qv')
    k = torch.randn(*grid, shape['num_heads'], device=device, generator=gen, requires_grad=True)
    w = torch.randn(shape['num_heads'], shape['kernel_size'], shape['kernel_size'], device=device, generator=gen,
                    requires_grad=True)
    dtype = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}[precision]

    def step(variant):
        method = variant.partition(':')[0]
        inputs = [x.to(dtype) if dtype else x for x in (q, k, v)]
        start = time.perf_counter()
        with autocast(device, precision):
            out = aft_conv2d(*inputs, w, method=method)
        loss = out.float().sum()
        sync(device)
        middle = time.perf_counter()
        loss.backward()
        sync(device)
        return (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3

    for variant in variants:
        for _ in range(warmup):
            step(variant)
    runs = [{variant: step(variant) for variant in variants} for _ in range(repeats)]  # round-robin: (fwd, bwd) ms
    return {variant: {'forward': statistics.median(run[variant][0] for run in runs),
                      'backward': statistics.median(run[variant][1] for run in runs)} for variant in variants}


def main(settings, models: List[str], resolutions: List[int]) -> int:
    """``aft-vision bench --ops``: ``settings`` is a ``BenchSettings``; writes ``ops.json`` and ``ops.md``."""
    device = torch.device(settings.device)
    variants = settings.ops_methods or variants_for(device)
    if set(variants) - set(variants_for(device)):
        raise ValueError(f'--ops-methods takes {", ".join(variants_for(device))}, got {variants}')
    rows = []
    pairs = [(res, name) for res in resolutions for name in models]
    for res, name in tqdm(pairs, desc='bench --ops', unit='layer'):
        shape = layer_shape(name, res)
        split = time_methods(shape, settings.batch_size, device, settings.precision, settings.repeats,
                             settings.warmup, variants)
        ms = {variant.partition(':')[0]: sum(parts.values()) for variant, parts in split.items()}
        auto = choose_conv_method(device.type, settings.batch_size, shape['height'], shape['width'],
                                  shape['channels'], shape['num_heads'], shape['kernel_size'])
        rows.append({'model': name, 'resolution': res, **shape, 'batch_size': settings.batch_size,
                     'device': str(device), 'precision': settings.precision, 'threads': torch.get_num_threads(),
                     'ms': ms, 'split_ms': split, 'fastest': min(ms, key=ms.get), 'auto': auto})
    head = ('| model | res | grid | C | h | s | ' + ' | '.join(f'{m} ms' for m in rows[0]['ms'])
            + ' | fastest | auto | ' + ' | '.join(f'{v} fwd / bwd' for v in rows[0]['split_ms']) + ' |')
    lines = [head, '|' + '---|' * (head.count('|') - 1)]
    for row in rows:
        lines.append(f"| {row['model']} | {row['resolution']} | {row['height']}x{row['width']} | {row['channels']} | "
                     f"{row['num_heads']} | {row['kernel_size']} | "
                     + ' | '.join(f'{value:.2f}' for value in row['ms'].values())
                     + f" | {row['fastest']} | {row['auto']} | "
                     + ' | '.join(f"{t['forward']:.2f} / {t['backward']:.2f}" for t in row['split_ms'].values()) + ' |')
    write_report(settings, 'ops', rows, '\n'.join(lines))
    return 0
