"""What ``aft-vision bench`` writes from its rows: the tables (AFT beside DeiT, and their ratios), the plot, and the
files that hold them."""
import dataclasses
import json
from pathlib import Path
from typing import Dict, List

from ..checkpoints.files import atomic_dir
from ..plots import figure, save_figure

__all__ = ['markdown', 'markdown_table', 'summary_table', 'plot', 'write_report']

RATIOS = ('infer_img_s', 'train_img_s', 'train_peak_mb', 'train_saved_mb')  # the full table's ratio columns


def markdown(head: List[str], rows: List[List]) -> str:
    """A markdown table: the ``head`` line, its rule, a line per row of cells (written by ``str``)."""
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    return '\n'.join(lines + ['| ' + ' | '.join(map(str, cells)) + ' |' for cells in rows])


def _figure(record: Dict, key: str, fmt: str, suffix: str = '') -> str:
    """A formatted figure, or '-' where it was not measured (e.g. under --no-train)."""
    value = record.get(key)
    return '-' if value is None else f'{value:{fmt}}{suffix}'


def markdown_table(rows: List[Dict]) -> str:
    """The full table: one line per (resolution, model), AFT beside DeiT, AFT's line with their ratios."""
    head = ['res', 'model', 'params (M)', 'GMACs', 'infer img/s', 'train img/s', 'train peak MB', 'saved MB', 'GFLOP/s',
            'vs DeiT: infer', 'train', 'train mem', 'saved']
    lines = []
    for row in rows:
        for who in ('aft', 'deit'):
            r = row[who]
            ratios = [_figure(row['ratio'], key, '.2f', 'x') if who == 'aft' else '' for key in RATIOS]
            lines.append([row['resolution'], r['model'], f"{r['params'] / 1e6:.1f}", f"{r['gmacs']:.2f}",
                          f"{r['infer_img_s']:.1f}", _figure(r, 'train_img_s', '.1f'),
                          _figure(r, 'train_peak_mb', '.0f'), _figure(r, 'train_saved_mb', '.0f'),
                          f"{r['infer_gflop_s']:.1f}", *ratios])
    return markdown(head, lines)


def summary_table(rows: List[Dict]) -> str:
    """The README's table: one line per AFT model and resolution, its figures and its ratios to its baseline."""
    head = ['res', 'model', 'params (M)', 'GMACs', 'infer img/s', 'train img/s', 'vs DeiT: infer', 'vs DeiT: train']
    lines = []
    for row in rows:
        r, ratio = row['aft'], row['ratio']
        lines.append([row['resolution'], r['model'], f"{r['params'] / 1e6:.1f}", f"{r['gmacs']:.2f}",
                      f"{r['infer_img_s']:.2f}", _figure(r, 'train_img_s', '.2f'),
                      _figure(ratio, 'infer_img_s', '.2f', 'x'), _figure(ratio, 'train_img_s', '.2f', 'x')])
    return markdown(head, lines)


def plot(rows: List[Dict], path: Path) -> None:
    """AFT / DeiT throughput ratios against resolution (inference, training step) and inference throughput."""
    fig = figure(16, 4.5)
    axes = fig.subplots(1, 3)
    for pair in dict.fromkeys((row['aft']['model'], row['deit']['model']) for row in rows):
        mine = [row for row in rows if (row['aft']['model'], row['deit']['model']) == pair]
        res = [row['resolution'] for row in mine]
        label = f'{pair[0]} / {pair[1]}'
        for ax, key in zip(axes, ('infer_img_s', 'train_img_s')):
            ax.plot(res, [row['ratio'].get(key, float('nan')) for row in mine], '-o', label=label)  # nan: --no-train
        axes[2].plot(res, [row['aft']['infer_img_s'] for row in mine], '-o', label=pair[0])
        axes[2].plot(res, [row['deit']['infer_img_s'] for row in mine], '--s', label=pair[1])
    for ax, title in zip(axes, ('Inference', 'Training step')):
        ax.axhline(1.0, color='grey', lw=0.8)
        ax.set(xlabel='resolution (px)', ylabel='AFT / DeiT images per second', title=title)
    axes[2].set(xlabel='resolution (px)', ylabel='inference images / s', yscale='log', title='Throughput')
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def write_report(settings, stem: str, rows: List[Dict], table: str, plot_rows: bool = False) -> None:
    """``<stem>.json`` (``settings``, a ``BenchSettings``, and the rows), ``<stem>.md`` (the table) and, for
    ``plot_rows``, ``<stem>.png`` into ``settings.out_dir``, replacing earlier ones of those names alone."""
    out = Path(settings.out_dir)
    with atomic_dir(out, force=True) as staging:
        (staging / f'{stem}.json').write_text(json.dumps({'command': dataclasses.asdict(settings), 'rows': rows},
                                                         indent=2))
        (staging / f'{stem}.md').write_text(table + '\n')
        try:
            if plot_rows:
                plot(rows, staging / f'{stem}.png')
        except ImportError:
            print('matplotlib is not installed (pip install aft-vision[demo]): no plot written')
    print(table)
    print(f'wrote {out}/{stem}.json, {stem}.md' + (f', {stem}.png' if plot_rows else ''))
