"""The study's report: its tables as markdown (``study.md``) and one plot per part (``plots/*.png``), from the rows
``study.run_study`` aggregates over the seeds."""
from pathlib import Path
from typing import Dict, List, Sequence

from ..plots import figure, save_figure
from .training import size_scaled_batches, sizes_text

__all__ = ['render_markdown', 'plot_study']

BAR_TITLES = {'families': 'Families at equal size', 'window': 'AFT-conv: kernel and heads'}  # the parts drawn as bars


def _pm(stats: Dict) -> str:
    return f'{stats["mean"]:.2f} ± {stats["std"]:.2f}'


def render_markdown(summary: Dict) -> str:
    """The study's tables as markdown: mean ± sample standard deviation over the seeds."""
    settings, tables = summary['settings'], summary['tables']
    size, large = settings['img_size'], settings['eval_img_size']
    top1, sizes = [f'top-1 at {size} px', f'top-1 at {large} px'], [str(s) for s in settings['eval_img_sizes']]
    batches = size_scaled_batches(settings['batch_size'], size, settings['train_img_sizes'])
    starts = {'vit': 'ViT baseline (transfer_vit_weights)', 'vit_ls': 'ViT with LayerScale and pre-norm (transfer)',
              'random': 'random'}
    transfer_columns = ['model', 'start', 'epochs', 'top-1 after epoch 1', 'head start after epoch 1 (per seed)',
                        *top1]

    def transfer_cells(r: Dict) -> List[str]:
        head_start = ', '.join(f'{d:+.2f}' for d in r.get('head_start', []))
        return [r['label'], starts[r['start']], str(r['epochs']), _pm(r['top1_per_epoch'][0]), head_start,
                _pm(r['top1']), _pm(r['top1_large'])]

    parts = {  # the part's title, the lines before its table, its columns and a row's cells
        'families': ('Families at equal size', [], ['model', 'params (k)', 'MMACs', *top1],
                     lambda r: [r['label'], f'{r["params"] / 1e3:.1f}', f'{r["macs"] / 1e6:.2f}', _pm(r['top1']),
                                _pm(r['top1_large'])]),
        'transfer': ('Transfer from the ViT baseline', [], transfer_columns, transfer_cells),
        'transfer_ls': ('Transfer from a ViT with LayerScale and pre-norm (the DINOv2 / CLIP block)',
                        ['Both families built with the same LayerScale and pre-norm; head start: top-1 after the '
                         'first epoch minus the random start\'s, same seed (percentage points).', ''],
                        transfer_columns, transfer_cells),
        'window': ('AFT-conv: window and heads', [], ['kernel', 'heads', 'params (k)', 'MMACs', *top1],
                   lambda r: [str(r['kernel']), str(r['heads']), f'{r["params"] / 1e3:.1f}', f'{r["macs"] / 1e6:.2f}',
                              _pm(r['top1']), _pm(r['top1_large'])]),
        'resolution': (
            'Resolution: one set of weights at every size',
            [f'Patch kept at every size (the token grid grows). Training at several sizes: one of '
             f'{sizes_text(settings["train_img_sizes"])} px per step, batches of {sizes_text(batches)} images '
             '(inversely proportional to the side). Following the size: the position parameters resampled '
             '(resample), AFT-conv\'s windows kept (keep), resampled by the size ratio (window) or its patch resized '
             'so that the token grid stays (patch).', ''],
            ['family', 'trained at (px)', 'following the size', *(f'{s} px' for s in sizes)],
            lambda r: [r['family'], r['training'], r['mode'],
                       *(_pm(r['top1_at'][s]) if s in r['top1_at'] else '-' for s in sizes)]),
    }
    lines = ['# The study', '', f'{settings["epochs"]} epochs (fine-tuning {settings["fine_tune_epochs"]}), seeds '
             f'0-{settings["seeds"] - 1}, {size} px training, batch {settings["batch_size"]}, lr {settings["lr"]}. '
             f'Top-1 (%) on the held-out digits: mean ± sample standard deviation over the seeds. MMACs: '
             f'multiply-adds of one {size} px image.', '']
    for part, (title, intro, columns, cells) in parts.items():
        if part in tables:
            lines += [f'## {title}', '', *intro, '| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
            lines += ['| ' + ' | '.join(cells(r)) + ' |' for r in tables[part]] + ['']
    return '\n'.join(lines)


def plot_study(summary: Dict, folder: Path) -> List[str]:
    """One PNG per part: bars with the seeds' spread (families, window), lines with their range (transfer: top-1 per
    epoch; resolution: per evaluation size); returns the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, rows in summary['tables'].items():
        draw = _plot_bars if part in BAR_TITLES else _plot_resolution if part == 'resolution' else _plot_transfer
        save_figure(draw(part, rows, summary['settings']), folder / f'{part}.png')
    return [f'{part}.png' for part in summary['tables']]


def _plot_bars(part: str, rows: List[Dict], settings: Dict):
    """Top-1 at both evaluation sizes, a pair of bars per row."""
    fig = figure(max(5, 1.3 * len(rows)), 3.6)
    ax = fig.subplots()
    width = 0.38
    for i, (name, size) in enumerate((('top1', settings['img_size']), ('top1_large', settings['eval_img_size']))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]['mean'] for r in rows], width, yerr=[r[name]['std'] for r in rows], capsize=3,
               label=f'{size} px')
    labels = [r['label'].split(' (')[0] if part == 'families' else f'k{r["kernel"]} h{r["heads"]}' for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    low = min(r[n]['mean'] - r[n]['std'] for r in rows for n in ('top1', 'top1_large'))
    ax.set(ylabel='held-out top-1 (%)', ylim=(max(0, low - 5), 100),
           title=f'{BAR_TITLES[part]}: mean ± std over {settings["seeds"]} seeds')
    ax.legend(fontsize=8)
    ax.grid(axis='y', alpha=0.3)
    return fig


def _plot_transfer(part: str, rows: List[Dict], settings: Dict):
    """A panel per transferred model: top-1 per epoch, a line per start and length."""
    titles = {r['key']: r['label'].split(' (')[0].split(' with ')[0] for r in rows if r['start'] != 'random'}
    fig, axes = _panels(list(titles.values()), 'epoch', settings)
    for ax, key in zip(axes, titles):
        for r in (r for r in rows if r['key'] == key):
            _line(ax, range(1, r['epochs'] + 1), r['top1_per_epoch'], r['epochs'] == settings['fine_tune_epochs'],
                  f'{"random" if r["start"] == "random" else "from ViT"}, {r["epochs"]} epochs')
        ax.legend(fontsize=7)
    return fig


def _plot_resolution(part: str, rows: List[Dict], settings: Dict):
    """A panel per family: top-1 against the evaluation size, a line per training and way of following the size."""
    families = list(dict.fromkeys(r['family'] for r in rows))
    fig, axes = _panels(families, 'evaluation size (px)', settings)
    for ax, family in zip(axes, families):
        ax.axvline(settings['img_size'], color='grey', alpha=0.4, linestyle='--')
        for r in (r for r in rows if r['family'] == family):
            sizes = sorted(r['top1_at'], key=int)
            _line(ax, [int(s) for s in sizes], [r['top1_at'][s] for s in sizes], '/' in r['training'],
                  f'{r["training"]} px, {r["mode"]}')
        ax.legend(fontsize=7)
    return fig


def _panels(titles: List[str], xlabel: str, settings: Dict) -> tuple:
    """A figure of a panel per title on one top-1 axis; returns it and the panels."""
    fig = figure(4.4 * len(titles), 3.6)
    axes = fig.subplots(1, len(titles), squeeze=False, sharey=True)[0]
    for ax, title in zip(axes, titles):
        ax.set(xlabel=xlabel, title=title)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel=f'held-out top-1 (%)\nmean and range over {settings["seeds"]} seeds')
    return fig, axes


def _line(ax, xs: Sequence[int], stats: List[Dict], solid: bool, label: str) -> None:
    """The means of ``stats`` (one per x) as a line, solid or dotted, the seeds' range shaded."""
    line, = ax.plot(xs, [v['mean'] for v in stats], '-' if solid else ':', marker='o', markersize=3, label=label)
    ax.fill_between(xs, [min(v['values']) for v in stats], [max(v['values']) for v in stats], color=line.get_color(),
                    alpha=0.15)
