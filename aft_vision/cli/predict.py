"""``aft-vision predict``: top-k classes for image files, with timm's eval preprocessing at any crop size."""
import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from PIL import Image, UnidentifiedImageError
from timm.data import ImageNetInfo, create_transform, resolve_data_config

from ..hub import check_pretrained, load_model, warn_random_weights
from ..models import AFTConvTransformer
from .args import ModelKwargs

__all__ = ['predict', 'add_arguments', 'add_model_arguments', 'model_from_args', 'run']

HELP = 'top-k classes for image files at any crop size'


def _label_names(model: torch.nn.Module) -> Optional[List[str]]:
    """Names the weights carry, else ImageNet's for a 1000-class head."""
    names = model.pretrained_cfg.get('label_names')
    if names:
        return list(names.values()) if isinstance(names, dict) else list(names)
    return ImageNetInfo().label_descriptions() if model.num_classes == 1000 else None


def predict(model: torch.nn.Module, paths: List[str], img_size: Optional[int] = None, topk: int = 5) -> Dict:
    """Classify readable images; unreadable ones are listed with the reason. Returns ``{'results', 'errors'}``."""
    args = {'input_size': (3, img_size, img_size)} if img_size else {}
    transform = create_transform(**resolve_data_config(args, model=model))
    names = _label_names(model)
    results, errors = {}, {}
    model.eval()
    for path in paths:
        try:
            with Image.open(path) as image:
                tensor = transform(image.convert('RGB')).unsqueeze(0)
        except (OSError, UnidentifiedImageError, ValueError) as error:  # missing, not an image, truncated
            errors[path] = f'{type(error).__name__}: {error}'
            continue
        with torch.no_grad():
            probs = model(tensor).softmax(-1)[0]
        values, indices = probs.topk(min(topk, probs.numel()))
        results[path] = [(names[i] if names else str(i), float(p)) for p, i in zip(values, indices.tolist())]
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
        print(f'aft-vision: {args.checkpoint}: {weights}', file=sys.stderr)
    return model, weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('images', nargs='+', help='image files')
    add_model_arguments(parser)
    parser.add_argument('--img-size', type=int, default=None,
                        help='crop size (default: the data config\'s); AFT-conv is rebuilt for it (resize_mode)')
    parser.add_argument('--topk', type=int, default=5)


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
    out = predict(model, args.images, args.img_size, args.topk)
    for path, why in out['errors'].items():
        print(f'aft-vision: skipped {path}: {why}', file=sys.stderr)
    for path, top in out['results'].items():
        print(f'{Path(path).name}: ' + ', '.join(f'{name} {p:.3f}' for name, p in top))
    if not out['results']:
        raise ValueError('no image could be read')
    warn_random_weights(args.model, weights)
    return 0
