"""The ``aft-vision`` command line (also ``python -m aft_vision.cli``).

Each subcommand is a ``_add_<name>(subparsers)`` that declares its arguments and a ``_cmd_<name>(args) -> int``
that runs it. Errors the user causes (bad names, missing files, bad values) end as one line on stderr, exit code 2:
numbers, sizes, paths and names are checked by ``cli_args.check_args`` before a subcommand starts, so nothing
is written.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from .cli_args import Parser, parse_device, run_command
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


def _add_transfer(subparsers) -> None:
    from timm.utils import ParseKwargs

    p = subparsers.add_parser('transfer', help='convert DeiT / ViT weights into an AFT model (safetensors)')
    p.add_argument('--src', required=True, help='timm DeiT / ViT name (downloads its weights) or a checkpoint file')
    p.add_argument('--model', required=True, help='registered AFT model name, e.g. aft_conv_small')
    p.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                   help='AFT model arguments matching the source\'s trunk, e.g. patch_size=4 embed_dim=64 depth=4')
    p.add_argument('--out', required=True, help='output .safetensors file')
    p.add_argument('--num-classes', type=int, default=0,
                   help='classes of a fresh AFT head (default: 0, a backbone like the .deit_in1k tags)')
    p.add_argument('--force', action='store_true', help='overwrite --out if it exists')
    p.add_argument('--no-ema', dest='use_ema', action='store_false',
                   help='take a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')


def _cmd_transfer(args: argparse.Namespace) -> int:
    from ._io import load_weights, save_weights
    from .models import create_aft_model
    from .transfer import transfer_vit_weights

    model = create_aft_model(args.model, num_classes=args.num_classes, **args.model_kwargs)
    if Path(args.src).is_file():
        source = load_weights(args.src)
    else:
        import timm
        source = timm.create_model(args.src, pretrained=True).state_dict()
    state_dict, report = transfer_vit_weights(source, model, use_ema=args.use_ema)
    model.load_state_dict(state_dict)
    digest = save_weights(state_dict, args.out, force=args.force,
                          metadata={'source': str(args.src), 'architecture': args.model})
    print(report.summary())
    print(f'wrote {args.out}  sha256 {digest}')
    return 0


def _add_publish(subparsers) -> None:
    from timm.utils import ParseKwargs

    from .hub import CROP_MODES, INTERPOLATIONS

    p = subparsers.add_parser(
        'publish', help='publish an AFT checkpoint in timm\'s Hub layout (or --dry-run)',
        description='How the weights were trained and evaluated (input size, crop, interpolation, mean, std) is read '
                    'from the run that made the checkpoint: the main job\'s results.json (--results, or beside the '
                    'checkpoint) or timm train.py\'s args.yaml beside it; the flags below override it. Without '
                    'either, the architecture\'s default config is published and a warning (and the card) says so.')
    p.add_argument('checkpoint', help='AFT weights (.safetensors, or a weights-only PyTorch file)')
    p.add_argument('--model', default=None,
                   help='registered AFT model name the weights belong to, or a local-dir: / hf-hub: folder whose '
                        'architecture they share (default: the one the run record names)')
    p.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                   help='architecture arguments the weights were built with, e.g. patch_size=4 (over the record\'s)')
    p.add_argument('--repo-id', required=True, help='Hub repository, org/name')
    p.add_argument('--dry-run', action='store_true', help='write the folder locally (--out-dir); upload nothing')
    p.add_argument('--out-dir', default=None, help='output folder for --dry-run')
    p.add_argument('--force', action='store_true', help='replace --out-dir if it exists')
    p.add_argument('--labels', default=None, help='class names: a text file, one per line, or a JSON list')
    p.add_argument('--results', default=None, help='JSON file of metric -> value for the model card (the main job\'s '
                                                   'results.json also gives the data config)')
    p.add_argument('--dataset', action='append', default=[], help='dataset name for the card (repeatable)')
    p.add_argument('--base-model', default=None, help='Hub id the weights were initialised from')
    p.add_argument('--training', default=None, help='one paragraph on how the model was trained')
    p.add_argument('--private', action='store_true', help='create the Hub repository as private')
    p.add_argument('--no-ema', dest='use_ema', action='store_false',
                   help='publish a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')
    data = p.add_argument_group('data config (how the weights were trained and evaluated; overrides the run record)')
    data.add_argument('--input-size', type=int, nargs='+', default=None, metavar='N',
                      help='evaluation size: N, H W or C H W (timm\'s pretrained_cfg input_size)')
    data.add_argument('--test-input-size', type=int, nargs='+', default=None, metavar='N',
                      help='a larger size the model was evaluated at and does at least as well (validate.py uses it)')
    data.add_argument('--crop-pct', type=float, default=None, help='centre-crop fraction at evaluation, in (0, 1]')
    data.add_argument('--crop-mode', default=None, choices=CROP_MODES)
    data.add_argument('--interpolation', default=None, choices=INTERPOLATIONS)
    data.add_argument('--mean', type=float, nargs='+', default=None, help='normalisation mean, 1 or C values')
    data.add_argument('--std', type=float, nargs='+', default=None, help='normalisation std, 1 or C values')


def _read_labels(path: Optional[str]) -> Optional[List[str]]:
    if path is None:
        return None
    import json

    text = Path(path).read_text(encoding='utf-8')
    labels = json.loads(text) if text.lstrip().startswith('[') else [line.strip() for line in text.splitlines()]
    return [str(label) for label in labels if str(label)]


def _cmd_publish(args: argparse.Namespace) -> int:
    import warnings

    from .hub import DATA_CONFIG_KEYS, publish

    overrides = {key: getattr(args, key) for key in DATA_CONFIG_KEYS if getattr(args, key) is not None}
    with warnings.catch_warnings(record=True) as caught:  # printed below as one line, not as a Python warning
        warnings.simplefilter('always', UserWarning)
        result = publish(
            args.checkpoint, args.model, args.repo_id, out_dir=args.out_dir, dry_run=args.dry_run, force=args.force,
            label_names=_read_labels(args.labels), results_file=args.results, datasets=args.dataset,
            base_model=args.base_model, training=args.training, private=args.private,
            model_kwargs=args.model_kwargs, data_config=overrides, use_ema=args.use_ema,
        )
    for warning in caught:
        if str(warning.message).startswith('publishing '):
            print(f'warning: {warning.message}', file=sys.stderr)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    print(f'weights: {result["weights"]}')
    print(f'data config: {result["data_config_source"]}')
    where = result.get('folder') or result.get('url')
    print(f'{"wrote" if args.dry_run else "uploaded"} {where}  model.safetensors sha256 {result["sha256"]}')
    return 0


def _add_bench(subparsers) -> None:
    from . import bench

    p = subparsers.add_parser('bench', help='AFT vs DeiT throughput, memory and GMACs at several resolutions')
    bench.add_arguments(p)


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def _add_train(subparsers) -> None:
    from . import train

    train.add_subcommand(subparsers)


def _cmd_train(args: argparse.Namespace) -> int:
    from . import train

    train.run(args)
    return 0


def _add_study(subparsers) -> None:
    from . import study

    p = subparsers.add_parser('study', help='families, DeiT/ViT transfer, window and heads on the digits, over seeds '
                                            '(resumable; tables and plots)')
    study.add_arguments(p)


def _cmd_study(args: argparse.Namespace) -> int:
    from . import study

    return study.main(args)


def _add_predict(subparsers) -> None:
    from . import predict

    p = subparsers.add_parser('predict', help='top-k classes for image files at any crop size')
    predict.add_arguments(p)


def _cmd_predict(args: argparse.Namespace) -> int:
    from . import predict

    return predict.main(args)


def _add_export(subparsers) -> None:
    from . import export

    p = subparsers.add_parser('export', help='write an ONNX file or an OpenVINO IR, float32 or INT8, checked against '
                                             'eager PyTorch')
    export.add_arguments(p)


def _cmd_export(args: argparse.Namespace) -> int:
    from . import export

    return export.main(args)


def _add_show_bias(subparsers) -> None:
    from . import visualize

    p = subparsers.add_parser('show-bias', help='plot learned position biases per layer and head (PNG)')
    visualize.add_arguments(p)


def _cmd_show_bias(args: argparse.Namespace) -> int:
    from . import visualize

    visualize.show_bias(args)
    return 0


def _add_show_keys(subparsers) -> None:
    from . import visualize

    p = subparsers.add_parser('show-keys', help='plot an image\'s keys per layer and head (PNG)')
    visualize.add_arguments(p, keys=True)


def _cmd_show_keys(args: argparse.Namespace) -> int:
    from . import visualize

    visualize.show_keys(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog='aft-vision', description='Attention Free Transformer tools for timm.')
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    subparsers = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    _add_demo(subparsers)
    _add_transfer(subparsers)
    _add_publish(subparsers)
    _add_bench(subparsers)
    _add_train(subparsers)
    _add_study(subparsers)
    _add_predict(subparsers)
    _add_export(subparsers)
    _add_show_bias(subparsers)
    _add_show_keys(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit code."""
    return run_command(build_parser(), sys.argv[1:] if argv is None else argv, _run)


def _run(args: argparse.Namespace) -> int:
    return globals()[f'_cmd_{args.command.replace("-", "_")}'](args)  # 'show-bias' -> _cmd_show_bias


if __name__ == '__main__':
    raise SystemExit(main())
