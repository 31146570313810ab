"""``aft-vision transfer``: DeiT / ViT weights mapped onto an AFT model (``checkpoints.transfer_vit_weights``)."""
import argparse
from pathlib import Path

import timm

from ..checkpoints import load_weights, save_weights, transfer_vit_weights
from ..hub import load_model
from .args import ModelKwargs

HELP = 'convert DeiT / ViT weights into an AFT model (safetensors)'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--src', required=True,
                        help='timm DeiT / ViT name (downloads its weights) or a checkpoint file')
    parser.add_argument('--model', required=True, help='registered AFT model name, e.g. aft_conv_small')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='AFT model arguments matching the source\'s trunk, e.g. patch_size=4 embed_dim=64 depth=4')
    parser.add_argument('--out', required=True, help='output .safetensors file')
    parser.add_argument('--num-classes', type=int, default=0,
                        help='classes of a fresh AFT head (default: 0, a backbone like the .deit_in1k tags)')
    parser.add_argument('--force', action='store_true', help='overwrite --out if it exists')
    parser.add_argument('--no-ema', dest='use_ema', action='store_false',
                        help='take a training checkpoint\'s trained weights, not its EMA weights (timm\'s default)')


def run(args: argparse.Namespace) -> int:
    model, _ = load_model(args.model, model_kwargs={**args.model_kwargs, 'num_classes': args.num_classes})
    is_file = Path(args.src).is_file()
    source = load_weights(args.src) if is_file else timm.create_model(args.src, pretrained=True).state_dict()
    state_dict, report = transfer_vit_weights(source, model, use_ema=args.use_ema)
    model.load_state_dict(state_dict)
    digest = save_weights(state_dict, args.out, force=args.force,
                          metadata={'source': str(args.src), 'architecture': args.model})
    print(report.summary())
    print(f'wrote {args.out}  sha256 {digest}')
    return 0
