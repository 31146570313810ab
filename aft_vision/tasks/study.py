"""``aft-vision study``: the paper's comparisons (Tables 7-10 of Zhai et al. 2021) on scikit-learn's digits, every
configuration trained with the main job's recipe over several seeds, in five parts: ``families`` (Table 7), ``transfer``
from the ViT baseline (Table 8), ``transfer_ls`` from a ViT with LayerScale and pre-norm (DINOv2's and CLIP's
structure), ``window`` (Tables 9, 10) and ``resolution`` (docs/results.md). A run writes
``runs/<id>.json`` and its weights (a study resumes); the end ``study.md``, ``study.json`` and ``plots/*.png``."""
import copy
import difflib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import timm
import torch
from tqdm import tqdm

from ..checkpoints.files import atomic_file, load_weights, save_weights
from ..checkpoints.transfer import transfer_vit_weights
from .. import models
from .classify import DIGITS_MODEL, ClassifySettings, at_size, check_model_and_sizes
from .study_report import plot_study, render_markdown
from .training import evaluate, size_scaled_batches, sizes_text, train, write_digits

__all__ = ['Config', 'Run', 'StudySettings', 'PARTS', 'plan_runs', 'check_settings', 'run_study']

PARTS = ('families', 'transfer', 'transfer_ls', 'window', 'resolution')
FAMILY_KEYS = ('vit', 'aft_full', 'aft_simple', 'aft_conv')
AFT_CONV_MODES = ('keep', 'window', 'patch')  # resize_mode; the other families resample their position parameters
# The main job's trunk: patch 4 (an 8 x 8 token map at 32 px), width 64, 4 blocks, MLP ratio 2.
TRUNK = {key: DIGITS_MODEL[key] for key in ('patch_size', 'embed_dim', 'depth', 'mlp_ratio')}
# AFT-conv's (kernel, heads): Table 9's kernels at a head per channel, then Table 10's fewer heads at kernel 5
WINDOW = tuple((k, TRUNK['embed_dim']) for k in (3, 5, 7)) + ((5, 1), (5, 4))
# DINOv2's and CLIP's block on the trunk: LayerScale (CaiT's 0.1 for shallow nets) and a norm before the blocks
LS_PRE_NORM = {'init_values': 0.1, 'pre_norm': True}
_DIGITS = ClassifySettings()


@dataclass(frozen=True)
class Config:
    """One architecture of the study."""
    key: str  # short name, used in run ids, e.g. 'aft_conv_k5_h64'
    label: str  # row label in the tables
    family: str  # 'ViT', 'AFT-full', 'AFT-simple' or 'AFT-conv'
    model: str  # timm model name
    kwargs: Dict = field(default_factory=dict)  # model arguments over the entry point's
    multi_size: bool = False  # trained at the study's train_img_sizes, one per step (else at img_size)


@dataclass(frozen=True)
class Run:
    """One training run: a configuration, its start, its length and its seed."""
    config: Config
    start: str  # 'random', or a baseline's key ('vit', 'vit_ls'): transfer_vit_weights from its run of the same seed
    epochs: int
    seed: int

    @property
    def id(self) -> str:
        return f'{self.config.key}-{self.start}-e{self.epochs}-s{self.seed}'


@dataclass
class StudySettings:
    """What the study trains; the recipe's defaults are the main job's."""
    epochs: int = 24  # epochs of a full run (the main job has 30; 24 keeps the study near 30 min on one core)
    seeds: int = 3  # seeds 0 .. seeds - 1 for every configuration
    parts: Tuple[str, ...] = PARTS  # which of the comparisons to run
    img_size: int = _DIGITS.img_size  # training and evaluation size: 32 px, an 8 x 8 token map at patch 4
    eval_img_size: int = 48  # the larger evaluation size, never trained on
    eval_img_sizes: Tuple[int, ...] = (24, 32, 40, 48, 64)  # the resolution part's evaluation sizes
    train_img_sizes: Tuple[int, ...] = (24, 32, 40, 48)  # the resolution part's multi-size training
    batch_size: int = _DIGITS.batch_size
    lr: float = _DIGITS.lr
    baseline: str = 'vit_tiny_patch16_224'  # timm ViT, built at the AFT models' trunk with 2 heads of 32 channels

    @property
    def fine_tune_epochs(self) -> int:
        """A third of ``epochs`` (at least 1): the transfer's fine-tuning and its control."""
        return max(1, round(self.epochs / 3))

    def recipe(self) -> Dict:
        """The settings a run's result depends on besides its configuration, epochs and seed."""
        return dict(img_size=self.img_size, eval_img_size=self.eval_img_size, batch_size=self.batch_size,
                    lr=self.lr, eval_img_sizes=list(self.eval_img_sizes), train_img_sizes=list(self.train_img_sizes),
                    train_batch_sizes=size_scaled_batches(self.batch_size, self.img_size, self.train_img_sizes))


def configs(settings: StudySettings) -> Dict[str, Config]:
    """Every configuration of the study, by key."""
    found = [Config('vit', 'ViT (timm VisionTransformer, 2 heads)', 'ViT', settings.baseline, dict(TRUNK, num_heads=2)),
             Config('aft_full', 'AFT-full', 'AFT-full', 'aft_full_test', dict(TRUNK)),
             Config('aft_simple', 'AFT-simple', 'AFT-simple', 'aft_simple_test', dict(TRUNK)),
             Config('aft_conv', f'AFT-conv k{DIGITS_MODEL["kernel_size"]} h{DIGITS_MODEL["num_heads"]} (the main job)',
                    'AFT-conv', 'aft_conv_test', dict(DIGITS_MODEL))]
    found += [  # the transfer_ls part: the baseline and the two AFT families with LayerScale and pre-norm
        Config('vit_ls', 'ViT with LayerScale and pre-norm (2 heads)', 'ViT', settings.baseline,
               dict(TRUNK, num_heads=2, **LS_PRE_NORM)),
        Config('aft_full_ls', 'AFT-full with LayerScale and pre-norm', 'AFT-full', 'aft_full_test',
               dict(TRUNK, **LS_PRE_NORM)),
        Config('aft_conv_ls', 'AFT-conv with LayerScale and pre-norm', 'AFT-conv', 'aft_conv_test',
               dict(DIGITS_MODEL, **LS_PRE_NORM))]
    found += [  # the families at several sizes: position embeddings resampled per step, AFT-conv's windows following
        Config(f'{c.key}_ms', f'{c.label.split(" (")[0]} at several sizes', c.family, c.model,
               dict(c.kwargs, **({'resize_mode': 'window'} if c.key == 'aft_conv' else {'dynamic_img_size': True})),
               multi_size=True) for c in found[:4]]  # the families above
    for kernel, heads in WINDOW:
        found.append(Config(f'aft_conv_k{kernel}_h{heads}', f'AFT-conv k{kernel} h{heads}', 'AFT-conv', 'aft_conv_test',
                            dict(DIGITS_MODEL, kernel_size=kernel, num_heads=heads)))
    return {config.key: config for config in found}


def _part_runs(settings: StudySettings) -> Dict[str, List[Tuple[Config, str, int]]]:
    """Each chosen part's (configuration, start, epochs), each once and in its table's order (a run per seed)."""
    known, full, short = configs(settings), settings.epochs, settings.fine_tune_epochs
    parts = {'families': [(known[key], 'random', full) for key in FAMILY_KEYS],
             'transfer': [(known['vit'], 'random', full)] + [
                 (known[key], start, epochs) for key in ('aft_conv', 'aft_full')
                 for start, epochs in (('vit', short), ('random', short), ('random', full))],
             'transfer_ls': [(known['vit_ls'], 'random', full)] + [
                 (known[key], start, short) for key in ('aft_conv_ls', 'aft_full_ls')
                 for start in ('vit_ls', 'random')],
             'window': [(known[f'aft_conv_k{k}_h{h}'], 'random', full) for k, h in WINDOW],
             'resolution': [(known[key + suffix], 'random', full) for key in FAMILY_KEYS for suffix in ('', '_ms')]}
    return {part: list({(c.key, start, epochs): (c, start, epochs) for c, start, epochs in parts[part]}.values())
            for part in PARTS if part in settings.parts}


def plan_runs(settings: StudySettings) -> List[Run]:
    """The runs the chosen parts need, each once, every ViT baseline before the transfers from it."""
    runs = [Run(config, start, epochs, seed) for seed in range(settings.seeds)
            for specs in _part_runs(settings).values() for config, start, epochs in specs]
    return list({run.id: run for run in runs}.values())  # first occurrence kept, in order


def check_settings(settings: StudySettings) -> Dict[str, Dict]:
    """Check the settings and every configuration on meta-device copies (ValueError: one line naming the option);
    returns each configuration's model arguments as the trainer builds it."""
    for name, value in (('--seeds', settings.seeds), ('--epochs', settings.epochs)):
        if value < 1:
            raise ValueError(f'{name}: must be >= 1, got {value}')
    if not settings.eval_img_sizes:
        raise ValueError('--eval-img-sizes: give at least one size')
    unknown = [part for part in settings.parts if part not in PARTS]
    if unknown or not settings.parts:
        raise ValueError(f'--parts: {" ".join(unknown) or "none given"}: choose from {", ".join(PARTS)}')
    if not timm.is_model(settings.baseline):
        close = difflib.get_close_matches(settings.baseline, timm.list_models('vit_*'), n=3, cutoff=0.6)
        hint = f'; did you mean {", ".join(close)}?' if close else ' (a timm ViT name, e.g. vit_tiny_patch16_224)'
        raise ValueError(f'--baseline: unknown model {settings.baseline!r}{hint}')
    kwargs = {}
    for config in {run.config.key: run.config for run in plan_runs(settings)}.values():  # each once, in order
        train_sizes = settings.train_img_sizes if config.multi_size else [settings.img_size]
        job = ClassifySettings(model=config.model, img_size=settings.img_size, train_img_sizes=list(train_sizes),
                               eval_img_sizes=[settings.eval_img_size, *settings.eval_img_sizes])
        try:
            kwargs[config.key] = check_model_and_sizes(job, dict(config.kwargs))[0]
        except ValueError as error:  # the option as the study names it, and the configuration
            message = str(error).replace(f'--eval-img-sizes {settings.eval_img_size}:',
                                         f'--eval-img-size {settings.eval_img_size}:', 1)
            raise ValueError(f'{message} ({config.label}: {config.model})') from None
    return kwargs


def _write(path: Path, text: str) -> None:
    """A record or report, whole or absent (``atomic_file``); the study rewrites its own files as it resumes."""
    with atomic_file(path, force=True) as temp:
        temp.write_text(text)


def _train_run(run: Run, model_kwargs: Dict, settings: StudySettings, data_dir: Path, runs_dir: Path, log) -> Dict:
    """Train one run, evaluate it at both sizes, save its weights and record."""
    start = time.perf_counter()
    init_weights, source = None, None
    if run.start != 'random':
        source = runs_dir / f'{Run(configs(settings)[run.start], "random", settings.epochs, run.seed).id}.safetensors'
        init_weights = load_weights(source)
    model, history, _ = train(data_dir, run.config.model, run.epochs, settings.img_size, settings.batch_size,
                              settings.lr, run.seed, model_kwargs=model_kwargs, init_weights=init_weights, log=log,
                              train_img_sizes=settings.train_img_sizes if run.config.multi_size else None)
    val = data_dir / 'val'
    record = {'id': run.id, 'config': asdict(run.config), 'model_kwargs': model_kwargs, 'start': run.start,
              'epochs': run.epochs, 'seed': run.seed, 'recipe': settings.recipe(),
              'top1': evaluate(model, val, settings.img_size),
              'top1_large': evaluate(at_size(model, settings.eval_img_size), val, settings.eval_img_size),
              'params': sum(p.numel() for p in model.parameters()),
              'macs': models.count_macs(model, torch.zeros(1, 3, settings.img_size, settings.img_size)),  # one image
              'history': history, 'threads': torch.get_num_threads()}
    if 'resolution' in settings.parts and run.config.key.removesuffix('_ms') in FAMILY_KEYS and run.start == 'random':
        record['top1_at'] = top1_at_sizes(model, val, settings.eval_img_sizes)
    if source is not None:
        _, report = transfer_vit_weights(init_weights, model)  # what the start copied, for the record
        record.update(init_from=source.name, transfer=report.summary())
    record['weights_sha256'] = save_weights(model.state_dict(), runs_dir / f'{run.id}.safetensors', force=True)
    record['wall_seconds'] = round(time.perf_counter() - start, 1)
    _write(runs_dir / f'{run.id}.json', json.dumps(record, indent=2))
    return record


def top1_at_sizes(model: torch.nn.Module, val: Path, sizes: Sequence[int]) -> Dict[str, Dict[str, float]]:
    """Top-1 at each size: AFT-conv under each ``resize_mode``, the others with position parameters resampled."""
    if not hasattr(model, 'resize_mode'):
        return {'resample': {str(size): evaluate(at_size(model, size), val, size) for size in sizes}}
    found = {mode: {} for mode in AFT_CONV_MODES}
    for mode in AFT_CONV_MODES:
        for size in sizes:
            resized = copy.deepcopy(model)
            try:
                resized.set_input_size(img_size=size, resize_mode=mode)
            except ValueError:  # the patch cannot follow this size in whole pixels
                continue
            found[mode][str(size)] = evaluate(resized, val, size)
    return found


def _finished(path: Path, settings: StudySettings, run: Run) -> Optional[Dict]:
    """A finished run's record (None if none); ValueError for one of another recipe or configuration."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    wanted = json.loads(json.dumps({'config': asdict(run.config), 'recipe': settings.recipe()}))
    found = {key: record.get(key) for key in wanted}
    if found != wanted:
        raise ValueError(f'{path} was trained with {found}, this study asks for {wanted}: give another --out-dir')
    return record


def run_study(settings: StudySettings, out_dir: Path) -> Dict:
    """Run (or resume) the study under ``out_dir``; returns ``study.json``'s content."""
    start = time.perf_counter()
    model_kwargs = check_settings(settings)
    out_dir = Path(out_dir)
    runs_dir = out_dir / 'runs'
    runs = plan_runs(settings)
    finished = {run.id: _finished(runs_dir / f'{run.id}.json', settings, run) for run in runs}
    runs_dir.mkdir(parents=True, exist_ok=True)
    data_dir = write_digits(out_dir / 'data')
    records = dict(finished)  # None: still to train
    bar = tqdm(runs, desc='study', unit='run')
    for run in bar:
        bar.set_postfix_str(run.id)
        if records[run.id] is None:
            records[run.id] = record = _train_run(run, model_kwargs[run.config.key], settings, data_dir, runs_dir,
                                                  tqdm.write)
            bar.write(f'{run.id}: top-1 {record["top1"]:.2f}% at {settings.img_size} px, {record["top1_large"]:.2f}% '
                      f'at {settings.eval_img_size} px ({record["wall_seconds"]:.0f} s)')
    summary = {'settings': dict(asdict(settings), fine_tune_epochs=settings.fine_tune_epochs),
               'tables': _tables(settings, records),
               'trained': [i for i in finished if finished[i] is None],
               'skipped': [i for i in finished if finished[i] is not None],
               'train_seconds': round(sum(records[i]['wall_seconds'] for i in records), 1),
               'versions': {'torch': torch.__version__, 'timm': timm.__version__, 'python': platform.python_version()}}
    _write(out_dir / 'study.md', render_markdown(summary))
    summary['plots'] = plot_study(summary, out_dir / 'plots')
    summary['wall_seconds'] = round(time.perf_counter() - start, 1)
    _write(out_dir / 'study.json', json.dumps(summary, indent=2))
    return summary


def _stats(values: Sequence[float]) -> Dict:
    values = list(values)
    return {'mean': statistics.fmean(values), 'std': statistics.stdev(values) if len(values) > 1 else 0.0,
            'values': values}


def _row(settings: StudySettings, records: Dict[str, Dict], config: Config, start: str, epochs: int) -> Dict:
    chosen = [records[Run(config, start, epochs, seed).id] for seed in range(settings.seeds)]
    per_epoch = [[r['history'][e]['val_top1'] for r in chosen] for e in range(epochs)]  # [epoch][seed]
    row = {'key': config.key, 'label': config.label, 'family': config.family, 'model': config.model,
           'kernel': config.kwargs.get('kernel_size'), 'heads': config.kwargs.get('num_heads'),
           'start': start, 'epochs': epochs, 'params': chosen[0]['params'], 'macs': chosen[0]['macs'],
           'top1': _stats(r['top1'] for r in chosen), 'top1_large': _stats(r['top1_large'] for r in chosen),
           'top1_per_epoch': [_stats(v) for v in per_epoch]}
    if start != 'random':  # the head start: top-1 after epoch 1 minus the random start's, per seed (points)
        controls = [records[Run(config, 'random', epochs, seed).id] for seed in range(settings.seeds)]
        row['head_start'] = [a - b for a, b in zip(per_epoch[0], (r['history'][0]['val_top1'] for r in controls))]
    return row


def _tables(settings: StudySettings, records: Dict[str, Dict]) -> Dict[str, List[Dict]]:
    return {part: _resolution_rows(settings, records, [config for config, _, _ in specs]) if part == 'resolution'
            else [_row(settings, records, *spec) for spec in specs] for part, specs in _part_runs(settings).items()}


def _resolution_rows(settings: StudySettings, records: Dict[str, Dict], chosen_configs: List[Config]) -> List[Dict]:
    """A row per family, training (one size, several) and way of following the size: top-1 at each size every seed
    reached."""
    rows = []
    for config in chosen_configs:
        chosen = [records[Run(config, 'random', settings.epochs, seed).id]['top1_at'] for seed in range(settings.seeds)]
        training = sizes_text(settings.train_img_sizes) if config.multi_size else str(settings.img_size)
        rows += [{'family': config.family, 'key': config.key, 'training': training, 'mode': mode,
                  'top1_at': {size: _stats(r[mode][size] for r in chosen) for size in map(str, settings.eval_img_sizes)
                              if all(size in r[mode] for r in chosen)}} for mode in chosen[0]]
    return rows
