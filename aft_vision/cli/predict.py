"""``aft-vision predict``: top-k classes for image files, with timm's eval preprocessing at any crop size."""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from timm.data import ImageNetInfo, create_transform, resolve_data_config
from tqdm import tqdm

from ..hub import check_pretrained, load_model, warn_random_weights
from ..images import read_image
from ..models import AFTConvTransformer
from .args import ModelKwargs, one_line

__all__ = ['predict', 'add_arguments', 'add_model_arguments', 'model_from_args', 'run']

HELP = 'top-k classes for image files at any crop size'


def _label_names(model: torch.nn.Module) -> Optional[List[str]]:
    """Names the weights carry (one string per class: ``hub.read_hub_config`` checked them), else ImageNet's for a
    1000-class head."""
    names = model.pretrained_cfg.get('label_names')
    if names is None:
        return ImageNetInfo().label_descriptions() if model.num_classes == 1000 else None
    return list(names.values()) if isinstance(names, dict) else names


def predict(model: torch.nn.Module, paths: List[str], img_size: Optional[int] = None, topk: int = 5) -> Dict:
    """Classify readable images (``images.read_image``, timm's eval transform); unreadable ones are listed with the
    reason. Returns ``{'results': {path: [(label, p, index)]}, 'errors': {path: why}}``, the top ``topk`` classes."""
    transform = create_transform(**resolve_data_config({'input_size': (3, img_size, img_size)} if img_size else {},
                                                       model=model))
    names = _label_names(model)
    results, errors = {}, {}
    model.eval()
    for path in tqdm(paths, desc='predict', unit='image', delay=2, leave=False, disable=None):
        try:
            image = read_image(path)
        except (OSError, ValueError) as error:  # missing, not an image, damaged, a decompression bomb
            errors[path] = str(error)  # read_image's errors start with the file's name
            continue
        with torch.no_grad():
            probs = model(transform(image).unsqueeze(0)).softmax(-1)[0]  # (num_classes,)
        if not torch.isfinite(probs).all():
            raise ValueError(f'the model\'s output for {path} is not finite (NaN or inf weights?)')
        values, indices = probs.topk(min(topk, probs.numel()))
        results[path] = [(names[i] if names else str(i), float(p), i) for p, i in zip(values, indices.tolist())]
    return {'results': results, 'errors': errors}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options naming a model and its weights (``predict``, ``export``, ``show-*``; ``model_from_args``)."""
    parser.add_argument('--model', required=True, help='registered AFT model, or hf-hub:/local-dir: source')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='architecture arguments the checkpoint was trained with, e.g. patch_size=4')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--checkpoint', default=None, help='AFT weights (.safetensors or weights-only .pth)')
    source.add_argument('--pretrained', action='store_true', help='the model\'s pretrained tag (downloads)')
    parser.add_argument('--no-ema', dest='use_ema', action='store_false',
                        help='a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')


def model_from_args(args: argparse.Namespace) -> Tuple[torch.nn.Module, str]:
    """``hub.load_model`` of ``add_model_arguments``' options; AFT-conv rebuilt for ``--img-size`` (``resize_mode``)."""
    model, weights = load_model(args.model, args.checkpoint, args.pretrained, args.use_ema, args.model_kwargs)
    if getattr(args, 'img_size', None) and isinstance(model, AFTConvTransformer):
        model.set_input_size(args.img_size)
    if args.checkpoint:
        print(f'aft-vision: {one_line(args.checkpoint)}: {one_line(weights)}', file=sys.stderr)
    return model, weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('images', nargs='+', help='image files')
    add_model_arguments(parser)
    parser.add_argument('--img-size', type=int, default=None,
                        help='crop size (default: the data config\'s); AFT-conv is rebuilt for it (resize_mode)')
    parser.add_argument('--topk', type=int, default=5)
    parser.add_argument('--json', action='store_true',
                        help='one JSON object per image on stdout: {"file", "top": [{"label", "index", "p"}]} or '
                             '{"file", "error"}')


def _fine_tune_first(name: str) -> str:
    architecture = name.split('.')[0] if ':' not in name else 'ARCHITECTURE'
    return (f'fine-tune it first (e.g. aft-vision train --model {architecture}.deit_in1k --pretrained --data-dir DATA '
            f'--out-dir RUN), then predict with --model local-dir:RUN/hub or --checkpoint RUN/model.safetensors')


def run(args: argparse.Namespace) -> int:
    if args.pretrained:  # a tag without a trained classifier, refused before anything is downloaded
        try:
            check_pretrained(args.model, classifier=True)
        except ValueError as error:
            raise ValueError(f'{error}; {_fine_tune_first(args.model)}') from None
    model, weights = model_from_args(args)
    if not model.num_classes:
        raise ValueError(f'{args.model} has no classifier (num_classes=0): {_fine_tune_first(args.model)}')
    try:
        out = predict(model, args.images, args.img_size, args.topk)
    except ValueError as error:  # the model's label names or outputs
        raise ValueError(f'{args.model}: {error}') from None
    for path in args.images:  # one line per image, in the order given; text from files printed as data
        if args.json:
            top = [{'label': label, 'index': i, 'p': p} for label, p, i in out['results'].get(path, [])]
            print(json.dumps({'file': path, 'error': out['errors'][path]} if path in out['errors'] else
                             {'file': path, 'top': top}))
        elif path in out['errors']:
            print(f'aft-vision: skipped {one_line(out["errors"][path])}', file=sys.stderr)
        else:
            top = ', '.join(f'{one_line(label)} {p:.3f}' for label, p, _ in out['results'][path])
            print(f'{one_line(Path(path).name)}: {top}')
    if not out['results']:
        raise ValueError(f'no image could be read ({next(iter(out["errors"].values()))})')
    warn_random_weights(args.model, weights)
    return 0
