"""``aft-vision publish``: an AFT checkpoint as a Hub repository in timm's layout (``hub.publish``)."""
import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import List

from ..hub import CROP_MODES, DATA_CONFIG_KEYS, INTERPOLATIONS, publish
from .args import ModelKwargs

HELP = 'publish an AFT checkpoint in timm\'s Hub layout: a folder (--out-dir) and, asked, the Hub (--upload)'
DESCRIPTION = ('The data config (input size, crop, interpolation, mean, std) comes from the run that made the '
               'checkpoint (the main job\'s results.json, --results or beside it; timm train.py\'s args.yaml beside '
               'it), under the flags below; without either, the default config, with a warning (and in the card).')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('checkpoint', help='AFT weights (.safetensors, or a weights-only PyTorch file)')
    parser.add_argument('--model', default=None,
                        help='registered AFT model name the weights belong to, or a local-dir: / hf-hub: folder whose '
                             'architecture they share (default: the one the run record names)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='architecture arguments of the weights, e.g. patch_size=4 (over the record\'s)')
    parser.add_argument('--repo-id', required=True, help='Hub repository, org/name')
    parser.add_argument('--out-dir', default=None, help='write the folder here (with --upload: once it is uploaded)')
    parser.add_argument('--upload', action='store_true', help='upload to the Hub (nothing is uploaded without it)')
    parser.add_argument('--dry-run', action='store_true', help='upload nothing (the default without --upload)')
    parser.add_argument('--force', action='store_true', help='replace what publish writes in --out-dir if it exists')
    parser.add_argument('--labels', default=None, help='class names: a text file, one per line, or a JSON list')
    parser.add_argument('--results', default=None, help='JSON file of metric -> value for the model card (the main '
                                                        'job\'s results.json also gives the data config)')
    parser.add_argument('--dataset', action='append', default=[], help='dataset name for the card (repeatable)')
    parser.add_argument('--base-model', default=None, help='Hub id the weights were initialised from')
    parser.add_argument('--training', default=None, help='one paragraph on how the model was trained')
    parser.add_argument('--private', action='store_true', help='create the Hub repository as private')
    parser.add_argument('--no-ema', dest='use_ema', action='store_false',
                        help='publish a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')
    data = parser.add_argument_group('data config (how the weights were evaluated; over the run record)')
    data.add_argument('--input-size', type=int, nargs='+', default=None, metavar='N',
                      help='evaluation size: N, H W or C H W (timm\'s pretrained_cfg input_size)')
    data.add_argument('--test-input-size', type=int, nargs='+', default=None, metavar='N',
                      help='a larger size the model was evaluated at and does at least as well (validate.py uses it)')
    data.add_argument('--crop-pct', type=float, default=None, help='centre-crop fraction at evaluation, in (0, 1]')
    data.add_argument('--crop-mode', default=None, choices=CROP_MODES)
    data.add_argument('--interpolation', default=None, choices=INTERPOLATIONS)
    data.add_argument('--mean', type=float, nargs='+', default=None, help='normalisation mean, 1 or C values')
    data.add_argument('--std', type=float, nargs='+', default=None, help='normalisation std, 1 or C values')


def _read_labels(path: str) -> List[str]:
    try:
        text = Path(path).read_text(encoding='utf-8')
        labels = json.loads(text) if text.lstrip().startswith('[') else [line.strip() for line in text.splitlines()]
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f'--labels {path}: not UTF-8 text or a JSON list ({error})') from None
    return [label for label in labels if label]  # as strings, one per class: checked by hub.publish


def run(args: argparse.Namespace) -> int:
    overrides = {key: getattr(args, key) for key in DATA_CONFIG_KEYS if getattr(args, key) is not None}
    with warnings.catch_warnings(record=True) as caught:  # printed below as one line, not as a Python warning
        warnings.simplefilter('always', UserWarning)
        result = publish(
            args.checkpoint, args.model, args.repo_id, out_dir=args.out_dir, dry_run=args.dry_run, force=args.force,
            label_names=args.labels and _read_labels(args.labels), results_file=args.results, datasets=args.dataset,
            base_model=args.base_model, training=args.training, private=args.private,
            model_kwargs=args.model_kwargs, data_config=overrides, use_ema=args.use_ema, upload=args.upload)
    for warning in caught:
        if str(warning.message).startswith('publishing '):
            print(f'warning: {warning.message}', file=sys.stderr)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    print(f'weights: {result["weights"]}')
    print(f'data config: {result["data_config_source"]}')
    for done, where in (('wrote', result['folder']), ('uploaded', result['url'])):
        print(f'{done} {where}  model.safetensors sha256 {result["sha256"]}') if where else None
    return 0
