"""``aft-vision bench``: AFT against DeiT in every runtime, per operator, or in segmentation networks (``bench``)."""
import argparse

from ..bench import DENSE_PAIR, DENSE_RESOLUTIONS, OPS_RESOLUTIONS, README_RUN, RUNTIMES, BenchSettings, main
from .args import settings_from

HELP = 'AFT vs DeiT throughput, memory and GMACs at several resolutions'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchSettings()
    parser.add_argument('--models', nargs='+', default=defaults.models, help='AFT models (default: %(default)s)')
    parser.add_argument('--resolutions', nargs='+', type=int, default=defaults.resolutions)
    parser.add_argument('--batch-size', type=int, default=defaults.batch_size)
    parser.add_argument('--batch-at', nargs='+', default=[], metavar='RES=BATCH[,TRAIN_BATCH]',
                        help='other batch sizes at a resolution, e.g. 768=8,2 (the training step on 2 images)')
    parser.add_argument('--pairs', nargs='+', default=[], metavar='MODEL=BASELINE@RES[,RES]',
                        help='extra cases, e.g. aft_conv_base=deit_base_patch16_384@384')
    parser.add_argument('--repeats', type=int, default=defaults.repeats, help='timed repetitions (median)')
    parser.add_argument('--warmup', type=int, default=defaults.warmup)
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: all cores)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--precision', choices=['fp32', 'bf16', 'fp16', 'int8'], default='fp32',
                        help='autocast dtype; openvino: its precision hint; int8: both models quantized')
    parser.add_argument('--no-train', action='store_true', help='skip the training-step figures')
    parser.add_argument('--no-peak-memory', action='store_true', help='skip peak memory (CPU: a process per figure)')
    parser.add_argument('--runtime', choices=RUNTIMES, default='eager',
                        help='what runs both models: eager PyTorch, torch.compile(fullgraph=True), onnxruntime or '
                             'openvino (inference on the CPU: implies --no-train --no-peak-memory)')
    parser.add_argument('--compile', action='store_true', help='the same as --runtime compile')
    parser.add_argument('--ops', action='store_true',
                        help='time every method of --models\' first AFT layer and count its ops and MB (CUDA path), '
                             f'with the saved activations against DeiT\'s (default --resolutions {OPS_RESOLUTIONS})')
    parser.add_argument('--ops-methods', nargs='+', default=None, metavar='VARIANT',
                        help='--ops: the variants to run (default: all: dense, conv:forward_conv; AFT-full: dense)')
    parser.add_argument('--ops-count-only', action='store_true', help='--ops without timing: the counts alone')
    parser.add_argument('--dense', action='store_true',
                        help=f'time {DENSE_PAIR[0]} against {DENSE_PAIR[1]} in the same smp DPT instead, batch 1 '
                             f'(default --resolutions {DENSE_RESOLUTIONS}; needs aft-vision[dense])')
    parser.add_argument('--base-img-size', type=int, default=None, help='AFT-conv windows for this size, resampled')
    parser.add_argument('--quick', action='store_true', help='tiny run: aft_conv_test vs test_vit at 64 px')
    parser.add_argument('--readme', action='store_true',
                        help=f'the run behind docs/performance.md: {README_RUN} (--repeats, --warmup still apply)')
    parser.add_argument('--out-dir', default=defaults.out_dir, help='where bench.json, bench.md and bench.png go')
    parser.add_argument('--force', action='store_true', help='replace only this command\'s files in --out-dir')


def run(args: argparse.Namespace) -> int:
    return main(settings_from(BenchSettings, args))
