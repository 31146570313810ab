"""``aft-vision bench --ops``: every method on the mixer layer of each model, timed forward and backward apart, beside
the one ``method='auto'`` picks and each method's traffic count on the CUDA path (``traffic.py``): the measurements
behind ``layers/functional.py``'s dispatch tables."""
import statistics
import time
from typing import Dict, List

import torch
from tqdm import tqdm

from .report import markdown, write_report
from .traffic import (auto_method, autocast, count_layer, layer_shape, mixer_call, mixer_inputs,
                      saved_on_cuda_path)

__all__ = ['variants_for', 'time_methods', 'main', 'sync']


def sync(device: torch.device):
    """Wait for ``device``'s queued work (CUDA), so that a clock read after it times the work."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def variants_for(kind: str) -> List[str]:
    """What ``--ops`` runs for a layer of ``kind`` (``layer_shape``): AFT-conv's 'dense' and 'conv:forward_conv',
    AFT-full's 'dense', AFT-simple's 'simple'."""
    return {'conv': ['dense', 'conv:forward_conv'], 'full': ['dense'], 'simple': ['simple']}[kind]


def time_methods(shape: Dict, batch_size: int, device: torch.device, precision: str, repeats: int,
                 warmup: int, variants: List[str]) -> Dict[str, Dict[str, float]]:
    """Median forward and backward milliseconds of the mixer call for one layer shape, per ``variants_for`` variant."""
    torch.manual_seed(0)
    q, k, v, w = mixer_inputs(shape, batch_size, 'fp32', device)
    dtype = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}[precision]

    def step(variant):
        mix = mixer_call(shape, variant.partition(':')[0])
        inputs = [x.to(dtype) if dtype else x for x in (q, k, v)]
        start = time.perf_counter()
        with autocast(device, precision):
            out = mix(*inputs, w)
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


def _counts(shape: Dict, settings, variants: List[str]) -> Dict[str, Dict]:
    """Per method: the traffic count on the CUDA path."""
    counts = {}
    for method in dict.fromkeys(variant.partition(':')[0] for variant in variants):
        count = count_layer(shape, 0, settings.batch_size, settings.precision, method)
        counts[method] = {key: count[key] for key in ('forward_ops', 'forward_mb', 'ops', 'mb')}
    return counts


def _mb(value: float) -> str:
    return f'{value:,.0f}' if value >= 10 else f'{value:.2f}'


def _table(rows: List[Dict], timed: bool) -> str:
    """The markdown tables: per row the shape, per method its ms (when timed), its counts;
    '-' where a row's layer has no such method; when timed, forward and backward ms apart per variant."""
    methods = list(dict.fromkeys(method for row in rows for method in row['counts']))
    timing = [f'{m} ms' for m in methods] + ['fastest'] if timed else []
    head = ['model', 'res', 'grid', 'C', 'h', 's', *timing, 'auto', 'CUDA auto',
            *(f'{m} {part} ops / MB' for m in methods for part in ('fwd', 'fwd+bwd')),
            'saved MB: model / DeiT (ratio)']
    lines = []
    for row in rows:
        grid = f"{row['height']}x{row['width']}" + (f" ({row['tokens']} tokens)" if 'tokens' in row else '')
        cells = [row['model'], row['resolution'], grid, row['channels'], row.get('num_heads', '-'),
                 row.get('kernel_size', '-')]
        if timed:
            cells += [f"{row['ms'][m]:.2f}" if m in row['ms'] else '-' for m in methods] + [row['fastest']]
        cells += [row['auto'], row['cuda_auto']]
        counts = row['counts']
        for m in methods:
            cells += [f"{counts[m]['forward_ops']} / {_mb(counts[m]['forward_mb'])}",
                      f"{counts[m]['ops']} / {_mb(counts[m]['mb'])}"] if m in counts else ['-', '-']
        model_mb, baseline_mb = row['saved']['model_mb'], row['saved']['baseline_mb']
        lines.append(cells + [f'{_mb(model_mb)} / {_mb(baseline_mb)} ({model_mb / baseline_mb:.3f})'])
    first = rows[0]
    text = (f"Ops and MB (1e6 bytes): the aten ops one mixer call runs and what they read and write, counted on the "
            f"CUDA path (bench/traffic.py) whatever --device times; batch {first['batch_size']}, "
            f"{first['precision']}. Saved: what a training step of the whole model keeps for its backward "
            f"(CUDA auto, 'cuda' policy; traffic.saved_on_cuda_path) against its DeiT's.\n\n" + markdown(head, lines))
    if timed:
        variants = list(dict.fromkeys(variant for row in rows for variant in row['split_ms']))
        split = [[row['model'], row['resolution'], *(
            f"{row['split_ms'][v]['forward']:.2f} / {row['split_ms'][v]['backward']:.2f}" if v in row['split_ms']
            else '-' for v in variants)] for row in rows]
        text += '\n\n' + markdown(['model', 'res', *(f'{v} fwd / bwd ms' for v in variants)], split)
    return text


def main(settings, resolutions: List[int], baselines: Dict[str, str]) -> int:
    """``aft-vision bench --ops`` (``settings``: a ``BenchSettings``): ``ops.json`` and ``ops.md``, per layer the
    methods' times (none under ``ops_count_only``) and traffic counts, per model the bytes a training step saves and
    its DeiT's (``baselines``: each model measured -> its DeiT)."""
    device = torch.device(settings.device)
    timed = not settings.ops_count_only
    rows = []
    pairs = [(res, name) for res in resolutions for name in baselines]
    for res, name in tqdm(pairs, desc='bench --ops', unit='layer'):
        shape = layer_shape(name, res)
        runs = variants_for(shape['kind'])
        variants = settings.ops_methods or runs
        if set(variants) - set(runs):
            raise ValueError(f"--ops-methods takes {', '.join(runs)} for {name}, got {variants}")
        row = {'model': name, 'resolution': res, **shape, 'batch_size': settings.batch_size, 'device': str(device),
               'precision': settings.precision, 'threads': torch.get_num_threads()}
        if timed:
            split = time_methods(shape, settings.batch_size, device, settings.precision, settings.repeats,
                                 settings.warmup, variants)
            ms = {variant.partition(':')[0]: sum(parts.values()) for variant, parts in split.items()}
            row.update(ms=ms, split_ms=split, fastest=min(ms, key=ms.get))
        row['auto'], row['cuda_auto'] = (auto_method(shape, settings.batch_size, kind)
                                         for kind in (device.type, 'cuda'))
        row['counts'] = _counts(shape, settings, variants)
        row['saved'] = {'baseline': baselines[name]}
        for key, model in (('model_mb', name), ('baseline_mb', baselines[name])):
            row['saved'][key] = saved_on_cuda_path(model, res, settings.batch_size, settings.precision) / 1e6
        rows.append(row)
    write_report(settings, 'ops', rows, _table(rows, timed))
    return 0
