"""``aft-vision train`` (``python -m aft_vision.train``): ``tasks.classify`` or ``tasks.segment`` (``args.TASKS``)."""
import argparse

from ..models.aft_conv import RESIZE_MODES
from ..tasks import classify
from .args import TASK_DEFAULTS, TASKS, ModelKwargs, settings_from

HELP = 'the main job: train on the digits (or --data-dir), evaluate, publish'


def _task_default(option: str) -> str:
    return ', '.join(f'{task}: {defaults[option]}' for task, defaults in TASK_DEFAULTS.items() if option in defaults)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--task', default='classify', choices=sorted(TASKS),
                        help='classify the digits (the main job), or segment scenes of them with AFT-conv in smp\'s '
                             'DPT (needs aft-vision[dense]) (default: %(default)s)')
    parser.add_argument('--data-dir', default=None, help='ImageFolder with train/ and val/ (default: the digits)')
    parser.add_argument('--model', default='aft_conv_test',
                        help='an AFT model, or a timm model taking the image size, e.g. vit_tiny_patch16_224 with '
                             '--model-kwargs patch_size=4 embed_dim=64 depth=4 num_heads=2 (default: %(default)s)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='model arguments, e.g. patch_size=8 depth=2 (aft_conv_test on the digits: over its own)')
    parser.add_argument('--pretrained', action='store_true', help='fine-tune from the tag\'s (source\'s) weights')
    parser.add_argument('--init-from', default=None, metavar='WEIGHTS',
                        help='start from the model\'s own weights, or a ViT / DeiT\'s mapped by transfer_vit_weights '
                             '(head fresh)')
    parser.add_argument('--epochs', type=int, default=None, help=f'default: {_task_default("epochs")}')
    parser.add_argument('--img-size', type=int, default=None,
                        help=f'training and evaluation resolution (default: {_task_default("img_size")})')
    parser.add_argument('--eval-img-size', type=int, default=None,
                        help=f'--task segment: the larger evaluation size ({_task_default("eval_img_size")})')
    parser.add_argument('--eval-img-sizes', type=int, nargs='+', default=None, metavar='SIZE',
                        help=f'evaluate at these sizes too (default: {" ".join(map(str, classify.EVAL_IMG_SIZES))})')
    parser.add_argument('--train-img-sizes', type=int, nargs='+', default=None, metavar='SIZE',
                        help='train at these sizes, one per step (timm\'s scheduled loader; default: --img-size)')
    parser.add_argument('--train-batch-sizes', type=int, nargs='+', default=None, metavar='N',
                        help='a batch size per training size (default: --batch-size at --img-size, inversely '
                             'proportional to the side elsewhere: 85 64 51 43 at 24 32 40 48 px)')
    parser.add_argument('--train-size-schedule', default=None, choices=classify.SIZE_SCHEDULES,
                        help='timm\'s batch_choice_schedule: uniform draws, or first to last size (default: constant)')
    parser.add_argument('--resize-mode', default=None, choices=RESIZE_MODES,
                        help='AFT-conv at another size: keep its windows, resample them by the size ratio (window), '
                             'or resize the patch so the token grid stays (patch) (default: the model\'s)')
    parser.add_argument('--base-img-size', type=int, default=None,
                        help='AFT-conv: the size its window and patch are given for (default: --img-size)')
    parser.add_argument('--batch-size', type=int, default=None,
                        help=f'images per step and per process (default: {_task_default("batch_size")})')
    parser.add_argument('--lr', type=float, default=None, help=f'default: {_task_default("lr")}')
    parser.add_argument('--scenes', type=int, default=None,
                        help=f'--task segment: training scenes, a quarter as many held out ({_task_default("scenes")})')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--sparsity-weight', type=float, default=0.0, help='Eq. 9 regulariser weight (paper: 0.001)')
    parser.add_argument('--out-dir', default=None,
                        help=f'where weights, hub folder and plots go (default: {_task_default("out_dir")})')
    parser.add_argument('--device', default='cpu', help='cpu or cuda (under torchrun: one GPU per process)')
    parser.add_argument('--force', action='store_true', help='replace only this command\'s files in --out-dir')


def run(args: argparse.Namespace) -> int:
    settings, job = TASKS[args.task]
    job(settings_from(settings, args))  # options left unset: the task's defaults
    return 0
