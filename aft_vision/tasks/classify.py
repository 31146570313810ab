"""The main job (``aft-vision train``, ``run(ClassifySettings(...))``): train an AFT-conv model on scikit-learn's digits
(or any ImageFolder), also under torchrun, evaluate it at several sizes, publish it as a Hub folder, reload it through
timm and check every figure, plot its curves. The recipe lives in ``training``; docs/training.md explains it."""
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import timm
import torch
import torch.distributed as dist
from timm.data import resolve_data_config
from tqdm import tqdm

from ..checkpoints.files import load_weights, output_dir, save_weights
from ..hub import check_pretrained, create_aft_model, publish, source_architecture
from ..plots import save_figure
from .training import (at_size, check_image_folders, check_input_size, eval_data_config, evaluate, fixed_img_size,
                       join_peers, plot_history, runs_as_built, size_scaled_batches, sizes_text, state_digest, train,
                       write_digits)

# A small AFT-conv for 32 x 32 digits: patch 4 -> an 8 x 8 token grid, a 15 x 15 window (the whole grid), 8 heads.
DIGITS_MODEL = dict(patch_size=4, embed_dim=64, depth=4, num_heads=8, kernel_size=15, mlp_ratio=2.)
EVAL_IMG_SIZES = (24, 32, 40, 48, 64)  # the main job's evaluation sizes: 0.75x to 2x its 32 px
TRAIN_SIZE_RATIOS = (0.75, 1.0, 1.25, 1.5)  # the recipe's training sizes as multiples of img_size (any-size models)
SIZE_SCHEDULES = ('constant', 'progressive')  # timm's create_loader batch_choice_schedule
RUN_OUTPUTS = ('model.safetensors', 'results.json', 'hub', 'training_curve.png')  # what run writes in out_dir


@dataclass
class ClassifySettings:
    """What ``run`` trains, on what, for how long, and where it writes (``aft-vision train``'s options)."""
    model: str = 'aft_conv_test'  # an AFT model, or a timm model that takes the image size (a ViT baseline)
    model_kwargs: Dict = field(default_factory=dict)  # for aft_conv_test on the digits: changes to DIGITS_MODEL
    data_dir: Optional[str] = None  # an ImageFolder with train/ and val/; None: scikit-learn's digits
    pretrained: bool = False  # fine-tune from the pretrained tag (or a local-dir: / hf-hub: model's weights)
    init_from: Optional[str] = None  # start from these weights (the model's own, or a ViT / DeiT's)
    epochs: int = 30
    img_size: int = 32  # the size the model is built and published for, and the headline evaluation's
    train_img_sizes: Optional[List[int]] = None  # one drawn per step (timm's scheduled loader); None: the recipe's
    train_batch_sizes: Optional[List[int]] = None  # a batch size per training size; None: size_scaled_batches
    train_size_schedule: str = 'constant'  # timm's batch_choice_schedule: 'constant' or 'progressive'
    eval_img_sizes: List[int] = field(default_factory=lambda: list(EVAL_IMG_SIZES))  # evaluated after training
    resize_mode: Optional[str] = None  # how an AFT-conv model follows another size (its resize_mode); None: as built
    base_img_size: Optional[int] = None  # the size the AFT-conv windows are given for; None: the model's default
    batch_size: int = 64  # images per step and per process
    lr: float = 5e-3
    seed: int = 0
    sparsity_weight: float = 0.0  # weight of the Eq. 9 entropy regulariser (the paper: 0.001)
    out_dir: str = 'outputs/digits'
    device: str = 'cpu'
    force: bool = False  # write into an out_dir that holds something, replacing only RUN_OUTPUTS there


def run(settings: ClassifySettings) -> Dict:
    """The whole job in its out_dir (``output_dir``: left as it was if the job fails or is stopped); returns the
    results written to ``results.json`` (empty on ranks other than 0)."""
    start = time.perf_counter()
    writes = RUN_OUTPUTS + (() if settings.data_dir else ('data',))
    plan = _plan(settings)  # every option checked before anything is written or waited for
    rank, world_size, device = join_peers(settings.device)  # every rank, before rank 0 touches out_dir
    with output_dir(settings.out_dir, settings.force, writes, active=rank == 0):
        model, data_dir, classes, record = _train_on_every_rank(settings, plan, rank, world_size, device)
        if rank != 0:
            return {}
        drawn = {int(size) for epoch in record['history'] for size in epoch['steps_per_size']}
        pairs = [pair for pair in zip(plan['train_sizes'], plan['batch_sizes']) if pair[0] in drawn]
        plan = dict(plan, train_sizes=[size for size, _ in pairs], batch_sizes=[batch for _, batch in pairs])
        top1, top1_at = evaluate_sizes(model, data_dir / 'val', settings.img_size, settings.eval_img_sizes)
        results, sha256 = save(model, settings, plan, top1, top1_at)
        hub_dir = publish_run(settings, plan, classes, results)
        reloaded, client_config = check_reload(hub_dir, data_dir / 'val', settings.img_size, top1, top1_at,
                                               results['data_config'], device)
        try:
            plot_curves(record['history'], top1_at, plan['train_sizes'], Path(settings.out_dir, 'training_curve.png'))
        except ImportError:
            print('matplotlib is not installed (pip install aft-vision[demo]): no training curve written')
        results.update(reloaded, **record, model=settings.model, epochs=settings.epochs, img_size=settings.img_size,
                       eval_img_sizes=list(top1_at), train_size_schedule=settings.train_size_schedule,
                       weights_sha256=sha256, wall_seconds=round(time.perf_counter() - start, 1))
        Path(settings.out_dir, 'results.json').write_text(json.dumps(results, indent=2))
        report(settings, results, data_dir, hub_dir, client_config)
    return results


def _plan(settings: ClassifySettings) -> Dict:
    """Everything checked before the data set is written: model arguments, sizes, batches, the starting weights."""
    if settings.pretrained:
        check_pretrained(settings.model)
    model_kwargs = dict(settings.model_kwargs or {})
    if settings.model == 'aft_conv_test' and not settings.data_dir:
        model_kwargs = dict(DIGITS_MODEL, **model_kwargs)
    model_kwargs, train_sizes = check_model_and_sizes(settings, model_kwargs)
    batch_sizes = settings.train_batch_sizes or size_scaled_batches(settings.batch_size, settings.img_size, train_sizes)
    if settings.init_from and settings.pretrained:
        raise ValueError('--init-from: give either --pretrained or --init-from')
    init_weights = load_weights(settings.init_from) if settings.init_from else None
    return dict(model_kwargs=model_kwargs, train_sizes=train_sizes, batch_sizes=batch_sizes, init_weights=init_weights)


def check_model_and_sizes(settings: ClassifySettings, model_kwargs: Dict) -> Tuple[Dict, List[int]]:
    """Check the model and every size of ``settings`` on a meta-device copy (ValueError, one line). Returns
    ``model_kwargs`` with the size arguments added (a model tied to one size built for ``img_size``; AFT-conv's
    ``resize_mode`` / ``base_img_size``) and the training sizes: ``train_img_sizes``, else ``TRAIN_SIZE_RATIOS`` of
    ``img_size`` in whole patches for a model that takes any size."""
    train_sizes = list(settings.train_img_sizes or [settings.img_size])  # the recipe's, once the model is known
    if settings.train_img_sizes is not None and not settings.train_img_sizes:
        raise ValueError('--train-img-sizes: give at least one size')
    if not settings.eval_img_sizes:
        raise ValueError('--eval-img-sizes: give at least one size')
    if settings.train_size_schedule not in SIZE_SCHEDULES:
        raise ValueError(f'--train-size-schedule: choose one of {", ".join(SIZE_SCHEDULES)}, got '
                         f'{settings.train_size_schedule!r}')
    try:
        with torch.device('meta'):
            probe = create_aft_model(settings.model, **model_kwargs)
            if hasattr(probe, 'resize_mode'):  # AFT-conv: built for img_size, following other sizes as asked
                base = settings.base_img_size if settings.base_img_size is not None else model_kwargs.get(
                    'img_size', settings.img_size)
                size_args = dict(img_size=settings.img_size, resize_mode=settings.resize_mode, base_img_size=base)
                model_kwargs = dict({k: v for k, v in size_args.items() if v is not None}, **model_kwargs)
            elif settings.resize_mode is not None or settings.base_img_size is not None:
                raise ValueError(f'--resize-mode / --base-img-size: {settings.model} is not an AFT-conv model')
            elif 'img_size' not in model_kwargs and getattr(probe, 'patch_embed', None) is not None and (
                    fixed_img_size(probe) is not None or getattr(probe, 'dynamic_img_size', False)):
                # built for the training size: a position embedding for its token grid (resampled per step under
                # dynamic_img_size=True)
                model_kwargs = dict(model_kwargs, img_size=settings.img_size)
            probe = create_aft_model(settings.model, **model_kwargs)
    except TypeError as error:  # an argument the model does not take
        raise ValueError(f'--model-kwargs: {settings.model} does not take them ({error})') from None
    if probe.pretrained_cfg.get('classifier', 'head') != 'head':  # what publish and the reload find the classes by
        raise ValueError(f'--model {settings.model}: the job publishes a classifier named head (AFT models, timm\'s '
                         f'ViTs); its classifier is {probe.pretrained_cfg["classifier"]}')
    fixed = fixed_img_size(probe)
    if settings.train_img_sizes is None and fixed is None and getattr(probe, 'patch_embed', None) is not None:
        patch = probe.patch_embed.patch_size[0]
        train_sizes = [max(patch, round(settings.img_size * ratio / patch) * patch) for ratio in TRAIN_SIZE_RATIOS]
    if settings.train_batch_sizes is not None and len(settings.train_batch_sizes) != len(train_sizes):
        raise ValueError(f'--train-batch-sizes: give one batch size per training size ({len(train_sizes)}: '
                         f'{train_sizes}), got {len(settings.train_batch_sizes)}')
    if settings.train_size_schedule == 'progressive' and len(train_sizes) < 2:
        raise ValueError('--train-size-schedule progressive: give at least two --train-img-sizes')
    if len(set(train_sizes)) > 1 and fixed is not None:
        raise ValueError(f'--train-img-sizes: {settings.model} takes only {fixed[0]}x{fixed[1]} px images (position '
                         f'parameters tied to its token grid); train it at one size, or choose a model that takes '
                         f'any size (AFT-conv, a ViT with dynamic_img_size=True)')
    checks = [('--img-size', settings.img_size, probe)] + [('--train-img-sizes', size, probe) for size in train_sizes]
    checks += [('--eval-img-sizes', size, None) for size in settings.eval_img_sizes]
    for option, size, model in checks:
        try:
            if size <= 0:
                raise ValueError(f'expected a positive size, got {size}')
            with torch.device('meta'):  # trained as built; evaluated at each size as rebuilt for it
                check_input_size(model or at_size(probe, size), size)
        except ValueError as error:
            raise ValueError(f'{option} {size}: {error}') from None
    return model_kwargs, train_sizes


def _train_on_every_rank(settings: ClassifySettings, plan: Dict, rank: int, world_size: int, device: torch.device
                         ) -> Tuple[torch.nn.Module, Path, List[str], Dict]:
    """Write the digits (rank 0) and train on every rank. Returns the model, the data folder, the class names and the
    record: the history, the world size, and each rank's weight and size-schedule digests."""
    try:
        data_dir = Path(settings.data_dir) if settings.data_dir else Path(settings.out_dir) / 'data'
        if not settings.data_dir and rank == 0:
            write_digits(data_dir)
        if world_size > 1:
            dist.barrier()  # rank 0 has written the data set
        check_image_folders(data_dir)
        model, history, classes = train(
            data_dir, settings.model, settings.epochs, settings.img_size, settings.batch_size, settings.lr,
            settings.seed, settings.sparsity_weight, plan['model_kwargs'], settings.pretrained, device, rank,
            world_size, plan['init_weights'], train_img_sizes=plan['train_sizes'],
            train_batch_sizes=plan['batch_sizes'], size_schedule=settings.train_size_schedule)
        schedule = hashlib.sha256(''.join(h['size_schedule_sha256'] for h in history).encode()).hexdigest()
        gathered = [(state_digest(model.state_dict()), schedule)] * world_size  # each rank's weights and sizes
        if world_size > 1:
            dist.all_gather_object(gathered, gathered[0])
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    digests, schedules = (list(column) for column in zip(*gathered))
    return model, data_dir, classes, dict(history=history, world_size=world_size, rank_state_sha256=digests,
                                          rank_size_schedule_sha256=schedules)


def evaluate_sizes(model: torch.nn.Module, val: Path, img_size: int, sizes: Sequence[int]) -> Tuple[float, Dict]:
    """Top-1 at ``img_size`` and at every size ({size: %}, rebuilt by ``at_size`` where it must be)."""
    top1 = evaluate(model, val, img_size)
    top1_at = {size: top1 if size == img_size else evaluate(at_size(model, size), val, size)
               for size in tqdm(sizes, desc='evaluating', unit='size', leave=False, disable=None)}  # on a terminal only
    return top1, top1_at


def save(model: torch.nn.Module, settings: ClassifySettings, plan: Dict, top1: float, top1_at: Dict
         ) -> Tuple[Dict, str]:
    """Write ``model.safetensors`` and ``results.json`` (the figures, the data config to publish, its
    ``test_input_size`` the best larger size the model runs as built if it scores as well as ``img_size``)."""
    out = Path(settings.out_dir)
    sha256 = save_weights(model.state_dict(), out / 'model.safetensors', force=True)
    architecture, architecture_kwargs = source_architecture(settings.model, plan['model_kwargs'])
    data_config = eval_data_config(model, settings.img_size)
    as_built = [size for size in top1_at if size > settings.img_size and runs_as_built(model, size)]
    best = max(as_built, key=lambda size: (top1_at[size], -size), default=None)
    if best is not None and top1_at[best] >= top1:
        data_config['test_input_size'] = (3, best, best)
    results = {'top1': top1, **{f'top1_at_{size}': value for size, value in top1_at.items()},
               'architecture': architecture, 'model_kwargs': architecture_kwargs, 'data_config': data_config,
               'train_img_sizes': plan['train_sizes'], 'train_batch_sizes': plan['batch_sizes']}
    (out / 'results.json').write_text(json.dumps(results, indent=2))
    return results, sha256


def publish_run(settings: ClassifySettings, plan: Dict, classes: List[str], results: Dict) -> Path:
    """Publish the saved weights as a Hub folder (``out_dir/hub``, a dry run: nothing is uploaded)."""
    out = Path(settings.out_dir)
    start_from = 'its pretrained weights' if settings.pretrained else 'scratch'
    start_from = settings.model if settings.pretrained and ':' in settings.model else start_from
    start_from = Path(settings.init_from).name if settings.init_from else start_from
    sizes, batches = sizes_text(plan['train_sizes']), sizes_text(plan['batch_sizes'])
    publish(str(out / 'model.safetensors'), results['architecture'], 'aft-vision/digits-demo',
            out_dir=str(out / 'hub'), dry_run=True, force=True, label_names=classes,
            results_file=str(out / 'results.json'), datasets=[] if settings.data_dir else ['sklearn-digits'],
            training=f'{settings.epochs} epochs from {start_from} at {sizes} px (one size per step, batches of '
                     f'{batches}, {settings.train_size_schedule}), AdamW lr {settings.lr}, cosine, label smoothing '
                     f'0.1 (aft_vision.train).', model_kwargs=results['model_kwargs'])
    return out / 'hub'


def check_reload(hub_dir: Path, val: Path, img_size: int, top1: float, top1_at: Dict, data_config: Dict,
                 device: torch.device) -> Tuple[Dict, Dict]:
    """Reload the folder as timm clients do (``local-dir:``, as published and rebuilt for the largest size; with
    timm's data config and its test size): RuntimeError unless each gives the job's figure. Returns the figures (as
    ``results.json`` names them) and timm's data config."""
    reloaded = timm.create_model(f'local-dir:{hub_dir}', pretrained=True).to(device)
    largest = max(top1_at)
    resized = timm.create_model(f'local-dir:{hub_dir}', pretrained=True, img_size=largest).to(device)
    client_config = resolve_data_config({}, model=reloaded)
    test_config = resolve_data_config({}, model=reloaded, use_test_size=True)
    test_top1 = top1_at[data_config['test_input_size'][-1]] if 'test_input_size' in data_config else top1
    checks = {  # figure: (what scores it, the model, how it is evaluated, the trained model's figure)
        'top1_reloaded': (f'{hub_dir} reloaded', reloaded, dict(img_size=img_size), top1),
        'top1_reloaded_at': (f'{hub_dir} rebuilt for {largest} px', resized, dict(img_size=largest), top1_at[largest]),
        'top1_timm_data_config': (f'timm\'s data config for {hub_dir} ({client_config}; the published pretrained_cfg '
                                  f'does not say how it was evaluated)', reloaded, dict(data_config=client_config),
                                  top1),
        'top1_timm_test_data_config': (f'timm\'s test-size data config for {hub_dir} ({test_config})', reloaded,
                                       dict(data_config=test_config), test_top1)}
    found = {}
    for figure, (what, model, how, expected) in checks.items():
        found[figure] = evaluate(model, val, **how)
        if found[figure] != expected:
            raise RuntimeError(f'{what} scores {found[figure]:.2f}%, the trained model {expected:.2f}%')
    return dict(found, top1_reloaded_at={str(largest): found['top1_reloaded_at']}), client_config


def plot_curves(history: List[Dict], top1_at: Dict[int, float], train_sizes: Sequence[int], path: Path) -> None:
    """Training loss and held-out top-1 per epoch, and top-1 against the evaluation size (training sizes marked)."""
    fig, (_, _, ax_size) = plot_history(history, 'val_top1', 'val top-1 (%)', 'Held-out accuracy', 3, 13)
    sizes = sorted(top1_at)
    ax_size.plot(sizes, [top1_at[size] for size in sizes], '-o', color='tab:purple')
    for size in train_sizes:
        ax_size.axvline(size, color='grey', alpha=0.3, linestyle='--')
    ax_size.set(xlabel='evaluation size (px); dashed: training sizes', ylabel='val top-1 (%)', title='Any size',
                ylim=(max(0, min(top1_at.values()) - 5), 100))
    ax_size.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def report(settings: ClassifySettings, results: Dict, data_dir: Path, hub_dir: Path, client_config: Dict) -> None:
    """Print the figures per size and the job's line (the README's), the ranks' agreement, and what was written."""
    top1, img_size = results['top1'], settings.img_size
    top1_at = {size: results[f'top1_at_{size}'] for size in results['eval_img_sizes']}
    print()
    for size, value in top1_at.items():
        print(f'top-1 at {size:3d} px: {value:6.2f}%  ({value - top1:+.2f} against {img_size} px)')
    others = [size for size in top1_at if size != img_size]
    (largest, at_largest), = results['top1_reloaded_at'].items()
    at_others = f'{"/".join(f"{top1_at[size]:.2f}" for size in others)}% at {sizes_text(others)}px; ' * bool(others)
    print(f'\n{settings.model} on {data_dir}, trained at {sizes_text(results["train_img_sizes"])} px: top-1 '
          f'{top1:.2f}% at {img_size}px; {at_others}reloaded from {hub_dir}: {results["top1_reloaded"]:.2f}% '
          f'(identical; at {largest}px: {at_largest:.2f}%), with timm\'s data config '
          f'{results["top1_timm_data_config"]:.2f}% ({client_config["input_size"][-1]}px, crop_pct '
          f'{client_config["crop_pct"]}; test size: {results["top1_timm_test_data_config"]:.2f}%)')
    if results['world_size'] > 1:
        agree = 'identical on every rank' if len(set(results['rank_state_sha256'])) == 1 else 'DIFFER between ranks'
        same = 'the same' if len(set(results['rank_size_schedule_sha256'])) == 1 else 'DIFFERENT'
        print(f'{results["world_size"]} processes: final weights {agree}; {same} size at every step on every rank')
    out = Path(settings.out_dir)
    print(f'wrote {out / "model.safetensors"} (sha256 {results["weights_sha256"][:16]}...), {hub_dir}/, '
          f'{out / "results.json"}, {out / "training_curve.png"}; {results["wall_seconds"]:.0f} s')
