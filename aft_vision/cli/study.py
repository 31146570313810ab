"""``aft-vision study``: the paper's claims checked on the digits over seeds (``tasks.study``)."""
import argparse
from pathlib import Path

from ..tasks.study import PARTS, StudySettings, render_markdown, run_study
from .args import settings_from

HELP = ('families, ViT transfer (plain, and with LayerScale and pre-norm), window, heads, resolution on the digits '
        'over seeds (resumable; tables, plots)')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StudySettings()
    parser.add_argument('--parts', nargs='+', default=list(PARTS), metavar='PART',
                        help=f'which comparisons: {", ".join(PARTS)} (default: all)')
    parser.add_argument('--epochs', type=int, default=defaults.epochs,
                        help='epochs of a full run; the transfer fine-tunes for a third (default: %(default)s)')
    parser.add_argument('--seeds', type=int, default=defaults.seeds, help='seeds 0 .. N-1 (default: %(default)s)')
    parser.add_argument('--img-size', type=int, default=defaults.img_size, help='default: %(default)s')
    parser.add_argument('--eval-img-size', type=int, default=defaults.eval_img_size, help='default: %(default)s')
    parser.add_argument('--eval-img-sizes', type=int, nargs='+', default=list(defaults.eval_img_sizes),
                        metavar='SIZE', help='the resolution part\'s evaluation sizes (default: %(default)s)')
    parser.add_argument('--train-img-sizes', type=int, nargs='+', default=list(defaults.train_img_sizes),
                        metavar='SIZE', help='the resolution part\'s multi-size training (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=defaults.batch_size, help='default: %(default)s')
    parser.add_argument('--lr', type=float, default=defaults.lr, help='default: %(default)s')
    parser.add_argument('--baseline', default=defaults.baseline, help='timm ViT at the AFT trunk (%(default)s)')
    parser.add_argument('--out-dir', default='outputs/study',
                        help='runs/, study.md, study.json, plots/ (default: %(default)s); an existing study resumes')


def run(args: argparse.Namespace) -> int:
    """Run or resume the study, print the tables."""
    summary = run_study(settings_from(StudySettings, args), Path(args.out_dir))
    print(render_markdown(summary))
    print(f'trained {len(summary["trained"])} runs, {len(summary["skipped"])} found finished; wrote '
          f'{Path(args.out_dir) / "study.md"}, study.json, plots/ ({", ".join(summary["plots"])}); '
          f'{summary["wall_seconds"]:.0f} s')
    return 0
