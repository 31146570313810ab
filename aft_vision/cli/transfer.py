"""``aft-vision transfer``: a ViT's weights (DeiT, DeiT III, DINOv2, CLIP, SigLIP, EVA-02) mapped onto an AFT model
(``checkpoints.transfer_vit_weights``), the model built to hold the source's layout (``checkpoints.sources``)."""
import argparse
from pathlib import Path

import timm
from timm.models import is_model_in_modules

from ..checkpoints import load_weights, save_weights, transfer_vit_weights
from ..checkpoints.sources import infer_layout, read_layout, source_layout
from ..checkpoints.transfer import select_weights
from ..hub import load_model
from .args import ModelKwargs

HELP = 'convert ViT weights (DeiT, DeiT III, DINOv2, CLIP, SigLIP, EVA-02) into an AFT model (safetensors)'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--src', required=True,
                        help='timm model name (downloads its weights), hf-hub:ORG/NAME, or a checkpoint file')
    parser.add_argument('--src-model', default=None, metavar='ARCH',
                        help='the timm architecture of a --src file, to read its layout (activation, position grid); '
                             'without it the layout is inferred from the keys, and what is assumed printed')
    parser.add_argument('--model', required=True, help='registered AFT model name, e.g. aft_conv_small')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='AFT model arguments over those read from the source (patch size, LayerScale, pre-norm, '
                             'activation, MLP), e.g. embed_dim=64 depth=4')
    parser.add_argument('--out', required=True, help='output .safetensors file')
    parser.add_argument('--num-classes', type=int, default=0,
                        help='classes of a fresh AFT head (default: 0, a backbone like the .deit_in1k tags)')
    parser.add_argument('--force', action='store_true', help='overwrite --out if it exists')
    parser.add_argument('--no-ema', dest='use_ema', action='store_false',
                        help='take a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')


def run(args: argparse.Namespace) -> int:
    if Path(args.src).is_file():
        source = load_weights(args.src)
        layout = source_layout(args.src_model) if args.src_model else infer_layout(select_weights(
            source, args.use_ema)[0])
    else:
        if args.src_model:
            raise ValueError(f'--src-model names the architecture of a --src file; {args.src} is a timm name')
        src_model = timm.create_model(args.src, pretrained=True)
        source, layout = src_model.state_dict(), read_layout(src_model, args.src)
    family = 'conv' if is_model_in_modules(args.model.split('.')[0], ['aft_conv']) else 'vit'
    model_kwargs = {**layout.model_args(family), **args.model_kwargs, 'num_classes': args.num_classes}
    model, _ = load_model(args.model, model_kwargs=model_kwargs)
    state_dict, report = transfer_vit_weights(source, model, use_ema=args.use_ema, layout=layout)
    model.load_state_dict(state_dict)
    built_with = ' '.join(f'{key}={value}' for key, value in model_kwargs.items())
    digest = save_weights(state_dict, args.out, force=args.force,
                          metadata={'source': str(args.src), 'architecture': args.model, 'model_kwargs': built_with})
    print(report.summary())
    print(f'model     {args.model} --model-kwargs {built_with}')
    print(f'wrote {args.out}  sha256 {digest}')
    return 0
