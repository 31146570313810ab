"""The recipe every classification job trains with: the digits as an ImageFolder, the checks a data folder passes
(``check_image_folders``), timm's loaders, optimizer, scheduler and loss, one size drawn per step, DDP under torchrun,
and top-1 evaluation (``train``, ``evaluate``)."""
import copy
import functools
import hashlib
import math
import os
import random
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from timm.data import create_loader, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils.distributed import init_distributed_device_so
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from torchvision.datasets import ImageFolder
from tqdm import tqdm

from ..checkpoints.files import atomic_dir
from ..hub import load_model
from ..images import read_image
from ..models import fit_checkpoint
from ..models.aft_conv import windows_follow_grid
from ..plots import figure
from .regularizers import position_bias_entropy

__all__ = ['split_digits', 'write_digits', 'check_image_folders', 'eval_data_config', 'evaluate', 'fixed_img_size',
           'at_size', 'check_input_size', 'size_scaled_batches', 'sizes_text', 'train_loader', 'fit', 'train',
           'plot_history', 'state_digest', 'launched_world', 'join_peers', 'parse_device']

LAUNCHER_VARIABLES = ('LOCAL_WORLD_SIZE', 'TORCHELASTIC_RUN_ID')  # set by torchrun (torch.distributed.run) alone
PEER_TIMEOUT_S = 1800  # how long a rank waits for the others (torch's default for gloo), to join and at each step


def parse_device(name: str) -> torch.device:
    """Parse a ``--device`` value; a bad or unavailable device is a user error (ValueError)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f'{name!r} is not a torch device ({e})') from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f'{name!r}: CUDA is not available')
    return device


def launched_world() -> Tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun set them; (0, 0, 1) in a process no launcher started. ValueError
    naming the variable: RANK, LOCAL_RANK or WORLD_SIZE without torchrun's (left in the shell), or not a number."""
    names = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        stray = next((name for name in names if name in os.environ), None)
        if stray:
            raise ValueError(f'{stray}={os.environ[stray]!r} is set, but no launcher started this process (torchrun '
                             f'sets {" and ".join(LAUNCHER_VARIABLES)}): unset {stray}, or start the job with torchrun')
        return 0, 0, 1
    for name in names:
        if not os.environ.get(name, '').isdecimal():
            raise ValueError(f'{name}={os.environ.get(name)!r}: torchrun sets it to a whole number')
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    if rank >= world_size:
        raise ValueError(f'RANK={rank} is not below WORLD_SIZE={world_size}')
    return rank, local_rank, world_size


def join_peers(device: str) -> Tuple[int, int, torch.device]:
    """Join torchrun's process group, saying whom it waits for: gloo on the CPU (RuntimeError in one line if the others
    are not all there within ``PEER_TIMEOUT_S``), on CUDA timm's ``init_distributed_device_so``. Returns (rank, world
    size, device): (0, 1, ``device``) outside torchrun. ValueError for a bad or unavailable device."""
    rank, _, world_size = launched_world()
    device = parse_device(device)
    if world_size == 1:
        return 0, 1, device
    where = f'{os.environ.get("MASTER_ADDR")}:{os.environ.get("MASTER_PORT")} (MASTER_ADDR:MASTER_PORT)'
    cuda = device.type == 'cuda'
    limit = "torch's timeout" if cuda else f'{PEER_TIMEOUT_S} s'
    print(f'rank {rank} of {world_size}: waiting up to {limit} for the other ranks at {where}', flush=True)
    try:
        if cuda:
            world = init_distributed_device_so(str(device))
            return world['global_rank'], world['world_size'], torch.device(world['device'])
        dist.init_process_group('gloo', timeout=timedelta(seconds=PEER_TIMEOUT_S))
    except (RuntimeError, ValueError) as error:  # torch's store and network errors are RuntimeErrors
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RuntimeError(f'rank {rank} of {world_size}: the other ranks did not join at {where} within {limit} '
                           f'({cause})') from None
    return rank, world_size, device


def split_digits(targets: torch.Tensor, val_fraction: float = 0.2, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The digits' stratified split: per class a seeded ``val_fraction`` of the indices in 'val', the rest 'train'."""
    gen = torch.Generator().manual_seed(seed)
    chosen = {'train': [], 'val': []}
    for label in range(10):
        indices = torch.nonzero(targets == label).flatten()
        indices = indices[torch.randperm(len(indices), generator=gen)]
        num_val = round(len(indices) * val_fraction)
        chosen['val'].append(indices[:num_val])
        chosen['train'].append(indices[num_val:])
    return {split: torch.cat(indices) for split, indices in chosen.items()}


def write_digits(root: Path, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write scikit-learn's 1797 digits as an ImageFolder (``train/``, ``val/``, ``split_digits``), RGB PNGs, through
    ``atomic_dir``. A folder already there is reused, and said so, only if it holds exactly these files."""
    from PIL import Image
    from sklearn.datasets import load_digits

    data = load_digits()
    files = {f'{split}/{data.target[i]}/{i}.png': i for split, indices in
             split_digits(torch.tensor(data.target), val_fraction, seed).items() for i in indices.tolist()}
    if root.exists():
        found = {p.relative_to(root).as_posix() for p in root.rglob('*') if not p.is_dir() or p.is_symlink()}
        if found != set(files):
            raise ValueError(f'{root} is not the digits data set ({len(found ^ set(files))} files differ from it): '
                             f'remove it, or train on it with --data-dir')
        print(f'reusing the digits written earlier in {root}')
        return root
    with atomic_dir(root) as staging:
        for name, i in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            pixels = (data.images[i] * (255 / 16)).astype('uint8')  # 8 x 8, values 0..16
            Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert('RGB').save(staging / name)
    return root


def check_image_folders(data_dir: Union[str, Path]) -> List[str]:
    """The classes of ``data_dir``'s ``train/`` and ``val/``; FileNotFoundError for a missing split, ValueError
    (naming them) for classes that differ or none."""
    data_dir = Path(data_dir)
    for split in ('train', 'val'):
        if not (data_dir / split).is_dir():
            raise FileNotFoundError(f'--data-dir: {data_dir / split} not found: train/ and val/ ImageFolders needed')
    # the class folders as ImageFolder finds them, hidden ones too
    train, val = (sorted(entry.name for entry in (data_dir / split).iterdir() if entry.is_dir())
                  for split in ('train', 'val'))
    if len(train) < 2:
        raise ValueError(f'--data-dir: {data_dir / "train"} has {len(train)} class folders ({", ".join(train)}): '
                         'top-1 means something only with at least two classes')
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise ValueError(f'--data-dir: {data_dir}: train/ and val/ classes differ (only in train/: '
                         f'{only_train or "none"}, only in val/: {only_val or "none"}): labels would not match')
    link = next(filter(None, (_link_out(data_dir / split / name) for split in ('train', 'val') for name in train)),
                None)
    if link is not None:
        raise ValueError(f'--data-dir: {link} links to {link.resolve()}, outside its class folder: its images would '
                         'take this class\'s label; copy them in or remove the link')
    return train


def _link_out(class_dir: Path) -> Optional[Path]:
    """The first link under ``class_dir`` to outside it (links inside it lead to what the walk sees anyway)."""
    inside = class_dir.resolve()
    entries = (Path(folder) / name for folder, subfolders, files in os.walk(class_dir) for name in subfolders + files)
    return next((entry for entry in entries if entry.is_symlink() and not entry.resolve().is_relative_to(inside)), None)


def eval_data_config(model: torch.nn.Module, img_size: int) -> Dict:
    """The jobs' preprocessing at ``img_size``: no crop (crop_pct 1.0), the model's interpolation and normalisation."""
    return resolve_data_config({'input_size': (3, img_size, img_size), 'crop_pct': 1.0}, model=model)


def _image_folder(folder: Path, transform=None) -> ImageFolder:
    try:
        return ImageFolder(str(folder), transform=transform, loader=read_image)
    except FileNotFoundError as error:  # no class folder, or one without images: a dataset is never empty
        raise FileNotFoundError(f'{folder}: {error}') from None


@torch.no_grad()
def evaluate(model: torch.nn.Module, folder: Path, img_size: Optional[int] = None, data_config: Optional[Dict] = None
             ) -> float:
    """Top-1 accuracy (%) on an ImageFolder, on ``model``'s device, with ``eval_data_config(model, img_size)`` or
    timm's eval transform for ``data_config`` (e.g. ``resolve_data_config({}, model=model)``, as a client)."""
    if (img_size is None) == (data_config is None):
        raise ValueError('evaluate takes either img_size or data_config')
    model.eval()
    device = next(model.parameters()).device
    transform = create_transform(**(data_config or eval_data_config(model, img_size)))
    dataset = _image_folder(folder, transform)
    correct = sum((model(images.to(device)).argmax(-1).cpu() == labels).sum().item()
                  for images, labels in DataLoader(dataset, batch_size=256, shuffle=False, num_workers=0))
    return 100.0 * correct / len(dataset)


def fixed_img_size(model: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """The one input size a model takes (position parameters tied to its token grid), or None for any size."""
    if hasattr(model, '_fixed_img_size'):  # the AFT models
        return model._fixed_img_size()
    embed = getattr(model, 'patch_embed', None)  # timm's ViT family
    if embed is None or getattr(model, 'dynamic_img_size', False) or not getattr(embed, 'strict_img_size', True):
        return None
    return tuple(embed.img_size) if embed.img_size is not None else None


def runs_as_built(model: torch.nn.Module, img_size: int) -> bool:
    """Whether ``model`` runs ``img_size`` px as it is, without ``at_size`` rebuilding it."""
    fixed = fixed_img_size(model)
    follows = getattr(model, 'resize_mode', 'keep') != 'keep'  # AFT-conv resizing its windows or patch
    return (fixed is None and not follows) or fixed == (img_size, img_size) or (
        follows and tuple(model.patch_embed.img_size) == (img_size, img_size))


def at_size(model: torch.nn.Module, img_size: int) -> torch.nn.Module:
    """``model`` if it runs ``img_size`` px as it is, else a copy rebuilt for that size by timm's ``set_input_size``
    (position parameters resampled; AFT-conv's windows or patch as its ``resize_mode`` says)."""
    if runs_as_built(model, img_size):
        return model
    fixed = fixed_img_size(model)
    if not hasattr(model, 'set_input_size'):
        raise ValueError(f'{type(model).__name__} is built for {fixed[0]}x{fixed[1]} px and cannot be rebuilt for '
                         f'{img_size} px (no set_input_size)')
    resized = copy.deepcopy(model)
    resized.set_input_size(img_size=img_size)
    return resized


def check_input_size(model: torch.nn.Module, img_size: int) -> None:
    """Raise ValueError unless ``model`` takes ``img_size`` px images (for timm's ViTs: the patch divides it)."""
    embed = getattr(model, 'patch_embed', None)
    if hasattr(embed, 'check'):  # the AFT families' patch embedding: the check each input meets
        embed.check(torch.empty(1, embed.proj.in_channels, img_size, img_size, device='meta'))
        return
    if embed is None or getattr(embed, 'dynamic_img_pad', False):
        return
    patch_h, patch_w = embed.patch_size
    if img_size % patch_h or img_size % patch_w:
        raise ValueError(f'{img_size} px is not a multiple of the patch size {patch_h}x{patch_w}')


def size_scaled_batches(batch_size: int, img_size: int, sizes: Sequence[int]) -> List[int]:
    """A batch size per training size: ``batch_size`` at ``img_size``, inversely proportional to the side elsewhere
    (at least 1): a step costs about the same at every size."""
    return [max(1, round(batch_size * img_size / size)) for size in sizes]


def sizes_text(sizes: Sequence[int]) -> str:
    return '/'.join(map(str, sizes))  # 24/32/40


def train_loader(folder: Path, model: torch.nn.Module, img_sizes: Sequence[int], batch_sizes: Sequence[int],
                 schedule: str, epochs: int, seed: int, distributed: bool = False) -> DataLoader:
    """timm's scheduled loader: a size of ``img_sizes`` per step (with its batch), drawn from ``seed`` alike on every
    rank; no flips (digits), crops of 40-100% of the area. Call ``batch_sampler.set_epoch``."""
    loader = create_loader(  # the size, interpolation and normalisation of eval_data_config (its crop unused here)
        _image_folder(folder), **eval_data_config(model, img_sizes[0]), batch_size=batch_sizes[0], is_training=True,
        use_prefetcher=False, num_workers=0, distributed=distributed, hflip=0.0, scale=(0.4, 1.0), ratio=(0.9, 1.1),
        color_jitter=None, input_size_choices=list(img_sizes), batch_size_choices=list(batch_sizes),
        batch_choice_seed=seed, batch_choice_schedule=schedule,
        batch_schedule_epochs=epochs if schedule == 'progressive' else None)
    # the image order from the seed alone, not from torch's global generator that the crops share (docs/results.md)
    images = loader.batch_sampler.sampler
    if isinstance(images, RandomSampler):
        images.generator = torch.Generator().manual_seed(seed)
    elif isinstance(images, DistributedSampler):
        images.seed = seed
    return loader


def fit(model: torch.nn.Module, lr: float, epochs: int, steps: int, epoch_batches: Callable[[int], Iterable],
        loss_of: Callable[[Any], torch.Tensor], disable: Optional[bool] = False) -> Iterator[Tuple[int, float]]:
    """The jobs' optimisation: AdamW (weight decay 0.05) under timm's cosine schedule (a warm-up epoch from lr / 10,
    down to lr / 100, stepped per update) on ``loss_of(batch)`` for the ``steps`` batches of ``epoch_batches(epoch)``.
    Yields each epoch's number (from 1) and mean loss; RuntimeError if a loss was not finite."""
    optimizer = create_optimizer_v2(model, 'adamw', lr=lr, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=epochs, warmup_epochs=1,
                                       warmup_lr=lr / 10, min_lr=lr / 100, step_on_epochs=False,
                                       updates_per_epoch=steps)
    for epoch in range(epochs):
        model.train()
        losses = []
        bar = tqdm(epoch_batches(epoch), desc=f'epoch {epoch + 1}/{epochs}', total=steps, unit='batch', leave=False,
                   disable=disable)
        for step, batch in enumerate(bar):
            loss = loss_of(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step_update(epoch * steps + step + 1)
            losses.append(loss.item())
            bar.set_postfix(loss=f'{loss.item():.3f}')
        if not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f'training diverged in epoch {epoch + 1}: non-finite loss')
        yield epoch + 1, sum(losses) / len(losses)


def keeps_random_state(job: Callable) -> Callable:
    """``job`` seeding and drawing from torch's and Python's global generators, the caller's states back after."""
    @functools.wraps(job)
    def run(*args, **kwargs):
        state = random.getstate()
        try:
            with torch.random.fork_rng():
                return job(*args, **kwargs)
        finally:
            random.setstate(state)
    return run


@keeps_random_state
def train(data_dir: Path, model_name: str, epochs: int, img_size: int, batch_size: int, lr: float, seed: int,
          sparsity_weight: float = 0.0, model_kwargs: Optional[Dict] = None, pretrained: bool = False,
          device: torch.device = torch.device('cpu'), rank: int = 0, world_size: int = 1,
          init_weights: Optional[Mapping[str, torch.Tensor]] = None, log: Callable[[str], None] = print,
          train_img_sizes: Optional[Sequence[int]] = None, train_batch_sizes: Optional[Sequence[int]] = None,
          size_schedule: str = 'constant') -> Tuple[torch.nn.Module, List[Dict], List[str]]:
    """Train ``model_name`` (``hub.load_model``) by ``fit`` with label smoothing, from ``init_weights`` if given, at
    ``train_img_sizes`` (one per step; None: ``img_size``, where evaluation runs) with ``train_batch_sizes`` (None:
    ``size_scaled_batches``); under torchrun a shard per rank, rank 0 alone evaluating and logging. Returns the model,
    a record per epoch (loss, steps per size, the sha256 of the sizes drawn, rank 0's top-1) and the class names."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    classes = _image_folder(data_dir / 'train').classes
    kwargs = dict(model_kwargs or {}, num_classes=len(classes))
    model = load_model(model_name, pretrained=pretrained, model_kwargs=kwargs, aft_only=False)[0].to(device)
    if init_weights is not None:
        model.load_state_dict(fit_checkpoint(init_weights, model, log if rank == 0 else lambda text: None))
    random.seed(seed + rank)  # timm's crops draw from Python's random, the rest from torch: different per rank
    torch.manual_seed(seed + rank)
    sizes = list(train_img_sizes or [img_size])
    batch_sizes = list(train_batch_sizes or size_scaled_batches(batch_size, img_size, sizes))
    loader = train_loader(data_dir / 'train', model, sizes, batch_sizes, size_schedule, epochs, seed,
                          distributed=world_size > 1)
    images = len(loader.batch_sampler.sampler)  # per process; a size whose batch exceeds them is never drawn
    never = ', '.join(f'{size} px (batches of {batch})' for size, batch in zip(sizes, batch_sizes) if batch > images)
    if never:
        raise ValueError(f'--train-img-sizes: {never} can never be drawn from {images} training images per process: '
                         f'a smaller batch size, or leave the size out')
    net = model  # what the training step calls; DDP averages the gradients across ranks
    if world_size > 1:
        net = DistributedDataParallel(model, device_ids=[device] if device.type == 'cuda' else None)
    criterion, step_sizes, history = LabelSmoothingCrossEntropy(smoothing=0.1), [], []  # step_sizes: the epoch's

    def epoch_batches(epoch: int) -> DataLoader:
        loader.batch_sampler.set_epoch(epoch)  # the epoch's size order and, under DDP, its shard
        step_sizes.clear()
        return loader

    def loss_of(batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step_sizes.append(batch[0].shape[-1])
        with windows_follow_grid(net):  # an AFT-conv's windows resampled for the step's size from its own
            loss = criterion(net(batch[0].to(device)), batch[1].to(device))
        # Eq. 9 on the shared weights: every rank adds the same term
        return loss + sparsity_weight * position_bias_entropy(model) if sparsity_weight else loss

    for epoch, loss in fit(model, lr, epochs, len(loader), epoch_batches, loss_of,
                           disable=None if rank == 0 else True):  # None: on a terminal only
        record = {'epoch': epoch, 'loss': loss,
                  'steps_per_size': {str(size): step_sizes.count(size) for size in sorted(set(step_sizes))},
                  'size_schedule_sha256': hashlib.sha256(repr(step_sizes).encode()).hexdigest()}
        if rank == 0:
            record['val_top1'] = evaluate(model, data_dir / 'val', img_size)
            log(f'epoch {epoch:2d}  loss {loss:.4f}  val top-1 {record["val_top1"]:.2f}%')
        history.append(record)
    return model, history, classes


def plot_history(history: List[Dict], metric: str, ylabel: str, title: str, panels: int, width: float,
                 scale: float = 1.0) -> tuple:
    """A figure of ``panels`` axes: the training loss and ``scale * metric`` per epoch of ``history`` in the first two,
    the rest left for the job's own. Returns the figure and its axes."""
    epochs = [h['epoch'] for h in history]
    fig = figure(width, 3.5)
    axes = fig.subplots(1, panels)
    axes[0].plot(epochs, [h['loss'] for h in history], '-o')
    axes[0].set(xlabel='epoch', ylabel='training loss', title='Loss')
    axes[1].plot(epochs, [scale * h[metric] for h in history], '-o', color='tab:green')
    axes[1].set(xlabel='epoch', ylabel=ylabel, title=title)
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
    return fig, axes


def state_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the sorted names and raw bytes of a state dict: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
