"""The main job: train an AFT-conv model on scikit-learn's handwritten digits (no download), evaluate it at the
training resolution and a larger one, publish it as a Hub folder, reload it through timm and check it is identical,
also through timm's standard data config (``resolve_data_config({}, model=...)``) that every timm client uses.

``run(ClassifySettings(...))``; from the command line ``aft-vision train`` or ``python -m aft_vision.train``
(``bash scripts/run.sh``). ``data_dir`` (``--data-dir``) takes any ImageFolder with ``train/`` and ``val/``, ``model``
any registered AFT model, or any timm model that takes the image size (a ViT baseline of the same width, depth, patch
and MLP ratio trains under the identical recipe). ``init_from`` starts from saved weights: the model's own, or a ViT /
DeiT checkpoint mapped onto an AFT model by ``transfer_vit_weights``.

Distributed data parallel under ``torchrun --nproc_per_node=N -m aft_vision.train ...`` (gloo on CPU, NCCL on CUDA):
each process trains on its shard of the training set (``DistributedSampler``) with ``--batch-size`` images per step;
rank 0 writes the data set, evaluates, saves and publishes. ``results.json`` lists every rank's final weight digest.
"""
import copy
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import timm
import torch
import torch.distributed as dist
from timm.data import create_loader, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from torchvision.datasets import ImageFolder
from tqdm import tqdm

from ..checkpoints.files import load_weights, output_dir, save_figure, save_weights
from ..checkpoints.transfer import TransferReport, is_vit_state_dict, transfer_vit_weights, unwrap_state_dict
from ..hub import publish, source_architecture
from ..models import check_pretrained, create_aft_model
from ..models.aft_conv import AFTConvTransformer, checkpoint_filter_fn as aft_conv_filter, forward_at_size
from .image_folders import check_image_folders
from .regularizers import position_bias_entropy

# A small AFT-conv for 32 x 32 digits: patch 4 -> an 8 x 8 token grid, a 15 x 15 window (the whole grid), 8 heads.
DIGITS_MODEL = dict(patch_size=4, embed_dim=64, depth=4, num_heads=8, kernel_size=15, mlp_ratio=2.)
EVAL_IMG_SIZES = (24, 32, 40, 48, 64)  # the main job's evaluation sizes: 0.75x to 2x its 32 px
# The recipe's training sizes, as multiples of img_size (24, 32, 40 and 48 px for the main job), for a model that
# takes any size; a model tied to one size trains at img_size alone (docs/results.md, "Resolution")
TRAIN_SIZE_RATIOS = (0.75, 1.0, 1.25, 1.5)
SIZE_SCHEDULES = ('constant', 'progressive')  # timm's create_loader batch_choice_schedule


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


def write_digits(root: Path, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write scikit-learn's 1797 digits once as an ImageFolder (``train/``, ``val/``), stratified, as RGB PNGs."""
    if (root / 'train').is_dir() and (root / 'val').is_dir():
        return root
    from PIL import Image
    from sklearn.datasets import load_digits

    data = load_digits()
    gen = torch.Generator().manual_seed(seed)
    staging = root.with_name(f'.{root.name}.tmp')
    for label in range(10):
        indices = torch.nonzero(torch.tensor(data.target) == label).flatten()
        indices = indices[torch.randperm(len(indices), generator=gen)]
        num_val = round(len(indices) * val_fraction)
        for split, chosen in (('val', indices[:num_val]), ('train', indices[num_val:])):
            folder = staging / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen.tolist():
                pixels = (data.images[i] * (255 / 16)).astype('uint8')  # 8 x 8, values 0..16
                Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert('RGB').save(folder / f'{i}.png')
    root.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, root)
    return root


def eval_data_config(model: torch.nn.Module, img_size: int) -> Dict:
    """The job's evaluation preprocessing at ``img_size``: no crop (crop_pct 1.0), the model's interpolation and
    normalisation. Training crops come from the same config; it is what the published folder records."""
    return resolve_data_config({'input_size': (3, img_size, img_size), 'crop_pct': 1.0}, model=model)


def _loader(folder: Path, model: torch.nn.Module, img_size: int, batch_size: int,
            data_config: Optional[Dict] = None) -> DataLoader:
    """timm's eval transform at ``img_size`` (or as ``data_config`` says) over an ImageFolder."""
    dataset = ImageFolder(str(folder), transform=create_transform(**(data_config or eval_data_config(model, img_size))))
    if not len(dataset):
        raise ValueError(f'no images found in {folder}')
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


def size_scaled_batches(batch_size: int, img_size: int, sizes: Sequence[int]) -> List[int]:
    """A batch size per training size, ``batch_size`` at ``img_size`` and inversely proportional to the side
    elsewhere (at least 1): a step's cost grows with the side rather than the area, so training at 0.75-1.5x costs
    about 1.1x a training at one size (docs/results.md, "Resolution")."""
    return [max(1, round(batch_size * img_size / size)) for size in sizes]


def train_loader(folder: Path, model: torch.nn.Module, img_sizes: Sequence[int], batch_sizes: Sequence[int],
                 schedule: str, epochs: int, seed: int, distributed: bool = False) -> DataLoader:
    """timm's scheduled training loader: each step one size of ``img_sizes`` (with its batch size), drawn by
    ``ScheduledBatchSampler`` from ``seed``, so every rank under torchrun draws the same size at each step; the
    images of a rank from its ``DistributedSampler`` shard. Call ``loader.batch_sampler.set_epoch`` each epoch.

    No flips (digits). Random crops of 40-100% of the area zoom in by up to 1.6x, so training sees digits larger than
    evaluation at the same size does (the train / test object-size gap behind the paper's 224 -> 384 gain, FixRes).
    """
    config = eval_data_config(model, img_sizes[0])
    dataset = ImageFolder(str(folder))
    if not len(dataset):
        raise ValueError(f'no images found in {folder}')
    loader = create_loader(
        dataset, input_size=config['input_size'], batch_size=batch_sizes[0], is_training=True, use_prefetcher=False,
        num_workers=0, distributed=distributed, hflip=0.0, scale=(0.4, 1.0), ratio=(0.9, 1.1), color_jitter=None,
        interpolation=config['interpolation'], mean=config['mean'], std=config['std'], crop_pct=config['crop_pct'],
        input_size_choices=list(img_sizes), batch_size_choices=list(batch_sizes), batch_choice_seed=seed,
        batch_choice_schedule=schedule, batch_schedule_epochs=epochs if schedule == 'progressive' else None)
    # The image order from the seed alone, not from torch's global generator (which timm's loader would draw it
    # from, between the crops' draws): the ViT baseline trained markedly worse so (docs/results.md, "Resolution").
    images = loader.batch_sampler.sampler
    if isinstance(images, RandomSampler):
        images.generator = torch.Generator().manual_seed(seed)
    elif isinstance(images, DistributedSampler):
        images.seed = seed
    return loader


def _init_distributed(device: str) -> Tuple[int, int, torch.device]:
    """(rank, world size, device). Joins torchrun's process group when ``WORLD_SIZE`` > 1: gloo on CPU, NCCL on CUDA."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    torch_device = torch.device(device)
    if torch_device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f'--device {device}: CUDA is not available')
    if world_size == 1:
        return 0, 1, torch_device
    if torch_device.type == 'cuda':
        torch_device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', '0')))
        torch.cuda.set_device(torch_device)
    if not dist.is_initialized():
        dist.init_process_group('nccl' if torch_device.type == 'cuda' else 'gloo')
    return dist.get_rank(), world_size, torch_device


def state_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the sorted names and raw bytes of a state dict: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fixed_img_size(model: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """The one input size a model accepts (its position embedding or AFT-full's biases are tied to the token grid), or
    None for a model that takes any size its patch divides (AFT-conv, ``dynamic_img_size=True``, a CNN)."""
    if hasattr(model, '_fixed_img_size'):  # the AFT models
        return model._fixed_img_size()
    embed = getattr(model, 'patch_embed', None)  # timm's ViT family
    if embed is None or getattr(model, 'dynamic_img_size', False) or not getattr(embed, 'strict_img_size', True):
        return None
    return tuple(embed.img_size) if embed.img_size is not None else None


def at_size(model: torch.nn.Module, img_size: int) -> torch.nn.Module:
    """``model`` if it runs ``img_size`` x ``img_size`` images as it is, else a copy rebuilt for that size by timm's
    ``set_input_size``: position embedding and AFT-full's u, v resampled over the patch grid; AFT-conv's windows or
    patch as its ``resize_mode`` says."""
    fixed = fixed_img_size(model)
    follows = getattr(model, 'resize_mode', 'keep') != 'keep'  # AFT-conv resizing its windows or patch
    if (fixed is None and not follows) or fixed == (img_size, img_size) or (
            follows and tuple(model.patch_embed.img_size) == (img_size, img_size)):
        return model
    if not hasattr(model, 'set_input_size'):
        raise ValueError(f'{type(model).__name__} is built for {fixed[0]}x{fixed[1]} px and cannot be rebuilt for '
                         f'{img_size} px (no set_input_size)')
    resized = copy.deepcopy(model)
    resized.set_input_size(img_size=img_size)
    return resized


def check_input_size(model: torch.nn.Module, img_size: int) -> None:
    """Raise ValueError unless ``model`` takes ``img_size`` x ``img_size`` images: the AFT models' own check, the patch
    size dividing the size for timm's ViT family (which would otherwise crop or fail later)."""
    if hasattr(model, '_check_input'):
        model._check_input(torch.empty(1, model.in_chans, img_size, img_size, device='meta'))
        return
    embed = getattr(model, 'patch_embed', None)
    if embed is None or getattr(embed, 'dynamic_img_pad', False):
        return
    patch_h, patch_w = embed.patch_size
    if img_size % patch_h or img_size % patch_w:
        raise ValueError(f'{img_size} px is not a multiple of the patch size {patch_h}x{patch_w}')


def load_initial_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> Optional[TransferReport]:
    """Start ``model`` from ``weights``: its own state dict (loaded strictly; an AFT-conv model's windows and patch
    resampled to its own first, as timm's pretrained loading does), or a ViT / DeiT one mapped onto an AFT
    model by ``transfer_vit_weights`` (DeiT's classifier dropped, ``model``'s fresh head and fresh tensors kept). A
    training checkpoint is read as timm reads it (``unwrap_state_dict``).

    Returns:
        The transfer's report, or None when the weights were the model's own.
    """
    weights = unwrap_state_dict(weights)  # a training checkpoint's (EMA) weights, DDP / compile prefixes stripped
    if is_vit_state_dict(weights) and not is_vit_state_dict(model.state_dict()):
        state_dict, report = transfer_vit_weights(weights, model)
        model.load_state_dict(state_dict)
        return report
    if isinstance(model, AFTConvTransformer):  # windows and patch resampled to the model's (a FixRes fine-tune)
        weights = aft_conv_filter(weights, model)
    model.load_state_dict(weights)
    return None


@torch.no_grad()
def evaluate(model: torch.nn.Module, folder: Path, img_size: Optional[int] = None, batch_size: int = 256,
             data_config: Optional[Dict] = None) -> float:
    """Top-1 accuracy (%) on an ImageFolder, on the device ``model`` lives on.

    Args:
        img_size: Evaluate with the job's own preprocessing at this size (``eval_data_config``).
        data_config: Evaluate with timm's eval transform for this data config instead (e.g. the one
            ``resolve_data_config({}, model=model)`` gives a client).
    """
    if (img_size is None) == (data_config is None):
        raise ValueError('evaluate takes either img_size or data_config')
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for images, labels in _loader(folder, model, img_size, batch_size, data_config):
        correct += (model(images.to(device)).argmax(-1).cpu() == labels).sum().item()
        total += len(labels)
    return 100.0 * correct / total


def train(
        data_dir: Path,
        model_name: str,
        epochs: int,
        img_size: int,
        batch_size: int,
        lr: float,
        seed: int,
        sparsity_weight: float = 0.0,
        model_kwargs: Optional[Dict] = None,
        pretrained: bool = False,
        device: torch.device = torch.device('cpu'),
        rank: int = 0,
        world_size: int = 1,
        init_weights: Optional[Mapping[str, torch.Tensor]] = None,
        log: Callable[[str], None] = print,
        train_img_sizes: Optional[Sequence[int]] = None,
        train_batch_sizes: Optional[Sequence[int]] = None,
        size_schedule: str = 'constant',
) -> Tuple[torch.nn.Module, List[Dict], List[str]]:
    """Train from scratch (or from the model's pretrained weights, or from ``init_weights``) with timm's components.

    Under torchrun (``world_size`` > 1) the model is wrapped in DistributedDataParallel and each rank trains on its
    shard; only rank 0 evaluates (``val_top1`` in the history) and prints. Returns the unwrapped model.

    Args:
        model_name: A registered AFT model, or any timm model (e.g. a ViT baseline; give it ``img_size``).
        init_weights: Weights to start from (``load_initial_weights``): the model's own state dict, or a ViT / DeiT
            one that ``transfer_vit_weights`` maps onto the AFT model. Tensors the transfer leaves fresh keep the
            initialisation ``seed`` gives, the same as a run from random weights.
        log: Where the per-epoch lines (and a transfer's report) go.
        train_img_sizes: The training sizes, one drawn per step (``train_loader``); None: ``img_size`` alone.
            Evaluation during training is at ``img_size``.
        train_batch_sizes: A batch size per training size; None: ``size_scaled_batches`` (``batch_size`` at
            ``img_size``).
        size_schedule: timm's choice schedule over the sizes, 'constant' or 'progressive' (small to large).

    Each history record holds the epoch's loss, steps per size, the sha256 of its sequence of sizes (equal on every
    rank) and, on rank 0, the held-out top-1.
    """
    torch.manual_seed(seed)  # the same initial weights on every rank
    classes = ImageFolder(str(data_dir / 'train')).classes
    model = create_aft_model(model_name, pretrained=pretrained, num_classes=len(classes), **(model_kwargs or {}))
    model = model.to(device)
    if init_weights is not None:
        report = load_initial_weights(model, init_weights)
        if report is not None and rank == 0:
            log(report.summary())
    random.seed(seed + rank)  # timm's crops draw from Python's random, the rest from torch: different per rank
    torch.manual_seed(seed + rank)
    sizes = list(train_img_sizes or [img_size])
    batch_sizes = list(train_batch_sizes or size_scaled_batches(batch_size, img_size, sizes))
    loader = train_loader(data_dir / 'train', model, sizes, batch_sizes, size_schedule, epochs, seed,
                          distributed=world_size > 1)
    net = model  # what the training step calls; DDP averages the gradients across ranks
    if world_size > 1:
        net = DistributedDataParallel(model, device_ids=[device] if device.type == 'cuda' else None)
    optimizer = create_optimizer_v2(model, 'adamw', lr=lr, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=epochs, warmup_epochs=1,
                                       warmup_lr=lr / 10, min_lr=lr / 100, step_on_epochs=False,
                                       updates_per_epoch=len(loader))
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)
    history = []
    for epoch in range(epochs):
        net.train()
        loader.batch_sampler.set_epoch(epoch)  # the epoch's size order and, under DDP, its shard
        losses, step_sizes = [], []
        bar = tqdm(loader, desc=f'epoch {epoch + 1}/{epochs}', unit='batch', leave=False, disable=rank != 0)
        for step, (images, labels) in enumerate(bar):
            step_sizes.append(images.shape[-1])
            loss = criterion(forward_at_size(net, images.to(device)), labels.to(device))
            if sparsity_weight:  # Eq. 9 on the shared weights: every rank adds the same term
                loss = loss + sparsity_weight * position_bias_entropy(model)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step_update(epoch * len(loader) + step + 1)
            losses.append(loss.item())
            bar.set_postfix(loss=f'{loss.item():.3f}')
        if not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f'training diverged in epoch {epoch + 1}: non-finite loss')
        record = {'epoch': epoch + 1, 'loss': sum(losses) / len(losses),
                  'steps_per_size': {str(size): step_sizes.count(size) for size in sorted(set(step_sizes))},
                  'size_schedule_sha256': hashlib.sha256(repr(step_sizes).encode()).hexdigest()}
        if rank == 0:
            record['val_top1'] = evaluate(model, data_dir / 'val', img_size)
            log(f'epoch {epoch + 1:2d}  loss {record["loss"]:.4f}  val top-1 {record["val_top1"]:.2f}%')
        history.append(record)
    return model, history, classes


def plot_curves(history: List[Dict], top1_at: Dict[int, float], train_sizes: Sequence[int], path: Path) -> None:
    """Training loss and held-out top-1 per epoch, and top-1 against the evaluation size (training sizes marked)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    epochs = [h['epoch'] for h in history]
    fig, (ax_loss, ax_acc, ax_size) = plt.subplots(1, 3, figsize=(13, 3.5))
    ax_loss.plot(epochs, [h['loss'] for h in history], '-o')
    ax_loss.set(xlabel='epoch', ylabel='training loss', title='Loss')
    ax_acc.plot(epochs, [h['val_top1'] for h in history], '-o', color='tab:green')
    ax_acc.set(xlabel='epoch', ylabel='val top-1 (%)', title='Held-out accuracy')
    sizes = sorted(top1_at)
    ax_size.plot(sizes, [top1_at[size] for size in sizes], '-o', color='tab:purple')
    for size in train_sizes:
        ax_size.axvline(size, color='grey', alpha=0.3, linestyle='--')
    ax_size.set(xlabel='evaluation size (px); dashed: training sizes', ylabel='val top-1 (%)', title='Any size',
                ylim=(max(0, min(top1_at.values()) - 5), 100))
    for ax in (ax_loss, ax_acc, ax_size):
        ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def _sizes_text(sizes: Sequence[int]) -> str:
    return '/'.join(str(size) for size in sizes)


def check_model_and_sizes(settings: ClassifySettings, model_kwargs: Dict) -> Tuple[Dict, List[int]]:
    """The model's arguments and every image size of ``settings``, on a meta-device copy: before the data set or
    anything is written.

    A model tied to one input size (a ViT, AFT-full) is built for ``img_size`` unless ``model_kwargs`` names one, and
    evaluated at other sizes by a copy rebuilt for each (``at_size``); it cannot train at several sizes. An AFT-conv
    model is built for ``img_size``, with the settings' ``resize_mode`` and ``base_img_size`` where given.

    Returns:
        ``model_kwargs``, with the arguments above added where the model takes them, and the training sizes
        (``train_img_sizes``, or where None the recipe's: ``TRAIN_SIZE_RATIOS`` of ``img_size`` in whole patches for
        a model that takes any size, ``img_size`` alone for one tied to a size).

    Raises:
        ValueError: An unknown model, arguments it does not take, or a size it cannot take, as one line.
    """
    train_sizes = list(settings.train_img_sizes or [settings.img_size])  # the recipe's, once the model is known
    if settings.train_img_sizes is not None and not settings.train_img_sizes:
        raise ValueError('--train-img-sizes: give at least one size')
    if not settings.eval_img_sizes:
        raise ValueError('--eval-img-sizes: give at least one size')
    if settings.train_size_schedule not in SIZE_SCHEDULES:
        raise ValueError(f'--train-size-schedule: choose one of {", ".join(SIZE_SCHEDULES)}, got '
                         f'{settings.train_size_schedule!r}')
    model_name = settings.model
    try:
        with torch.device('meta'):
            probe = create_aft_model(model_name, **model_kwargs)
            if hasattr(probe, 'resize_mode'):  # AFT-conv: built for img_size, following other sizes as asked
                base = settings.base_img_size or model_kwargs.get('img_size', settings.img_size)
                size_args = dict(img_size=settings.img_size, resize_mode=settings.resize_mode, base_img_size=base)
                model_kwargs = dict({k: v for k, v in size_args.items() if v is not None}, **model_kwargs)
            elif settings.resize_mode is not None or settings.base_img_size is not None:
                raise ValueError(f'--resize-mode / --base-img-size: {model_name} is not an AFT-conv model')
            elif 'img_size' not in model_kwargs and getattr(probe, 'patch_embed', None) is not None and (
                    fixed_img_size(probe) is not None or getattr(probe, 'dynamic_img_size', False)):
                # built for the training size: a position embedding for its token grid (resampled per step under
                # dynamic_img_size=True)
                model_kwargs = dict(model_kwargs, img_size=settings.img_size)
            probe = create_aft_model(model_name, **model_kwargs)
    except TypeError as error:  # an argument the model does not take
        raise ValueError(f'--model-kwargs: {model_name} does not take them ({error})') from None
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
        raise ValueError(f'--train-img-sizes: {model_name} takes only {fixed[0]}x{fixed[1]} px images (position '
                         f'parameters tied to its token grid); train it at one size, or choose a model that takes '
                         f'any size (AFT-conv, a ViT with dynamic_img_size=True)')
    checks = [('--img-size', settings.img_size, probe)] + [('--train-img-sizes', size, probe) for size in train_sizes]
    checks += [('--eval-img-sizes', size, None) for size in settings.eval_img_sizes]
    for option, size, model in checks:
        try:
            with torch.device('meta'):  # trained as built; evaluated at each size as rebuilt for it
                check_input_size(model or at_size(probe, size), size)
        except ValueError as error:
            raise ValueError(f'{option} {size}: {error}') from None
    return model_kwargs, train_sizes


RUN_OUTPUTS = ('model.safetensors', 'results.json', 'hub', 'training_curve.png')  # what run writes in out_dir


def run(settings: ClassifySettings) -> Dict:
    """The whole job (``_run``) in its out_dir: refused if it holds anything unless ``force``, checked writable before
    training, left as it was if the job fails (``output_dir``); ``data/`` too for the digits."""
    writes = RUN_OUTPUTS + (() if settings.data_dir else ('data',))
    with output_dir(settings.out_dir, settings.force, writes, active=int(os.environ.get('RANK', 0)) == 0):
        return _run(settings)


def _run(settings: ClassifySettings) -> Dict:
    """The whole job; returns the results written to ``results.json`` (an empty dict on ranks other than 0)."""
    start = time.perf_counter()
    if settings.pretrained:
        check_pretrained(settings.model)
    model_kwargs = dict(settings.model_kwargs or {})
    if settings.model == 'aft_conv_test' and not settings.data_dir:
        model_kwargs = dict(DIGITS_MODEL, **model_kwargs)
    model_kwargs, train_sizes = check_model_and_sizes(settings, model_kwargs)
    batch_sizes = settings.train_batch_sizes or size_scaled_batches(settings.batch_size, settings.img_size, train_sizes)
    init_weights = None
    if settings.init_from:
        if settings.pretrained:
            raise ValueError('--init-from: give either --pretrained or --init-from')
        init_weights = load_weights(settings.init_from)
    rank, world_size, device = _init_distributed(settings.device)
    out = Path(settings.out_dir)
    try:
        if settings.data_dir:
            data_dir = Path(settings.data_dir)
        else:
            data_dir = out / 'data'
            if rank == 0:
                write_digits(data_dir)
        if world_size > 1:
            dist.barrier()  # rank 0 has written the data set
        for split in ('train', 'val'):
            if not (data_dir / split).is_dir():
                raise FileNotFoundError(f'{data_dir / split} not found: --data-dir needs train/ and val/ ImageFolders')
        check_image_folders(data_dir)
        model, history, classes = train(
            data_dir, settings.model, settings.epochs, settings.img_size, settings.batch_size, settings.lr,
            settings.seed, settings.sparsity_weight, model_kwargs, settings.pretrained, device, rank, world_size,
            init_weights, train_img_sizes=train_sizes, train_batch_sizes=batch_sizes,
            size_schedule=settings.train_size_schedule)
        digest = state_digest(model.state_dict())
        schedule = hashlib.sha256(''.join(h['size_schedule_sha256'] for h in history).encode()).hexdigest()
        digests, schedules = [digest] * world_size, [schedule] * world_size
        if world_size > 1:
            dist.all_gather_object(digests, digest)
            dist.all_gather_object(schedules, schedule)
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return {}

    top1 = evaluate(model, data_dir / 'val', settings.img_size)
    top1_at, rebuilt = {}, set()  # evaluation size -> top-1, the model rebuilt for a size as its resize_mode says
    for size in tqdm(settings.eval_img_sizes, desc='evaluating', unit='size', leave=False):
        sized = at_size(model, size)
        if sized is not model:
            rebuilt.add(size)
        top1_at[size] = top1 if size == settings.img_size else evaluate(sized, data_dir / 'val', size)
    weights = out / 'model.safetensors'
    sha256 = save_weights({k: v.cpu() for k, v in model.state_dict().items()}, weights, force=True)
    architecture, architecture_kwargs = source_architecture(settings.model, model_kwargs)  # a folder's saved arguments
    # How the weights were evaluated, for the published pretrained_cfg. timm's test_input_size is the size a client
    # should evaluate at for the best result (validate.py uses it by default): recorded only if the larger size did
    # at least as well, else validate.py would report the lower figure.
    # Only a size the published model runs as it is (no rebuild by at_size) can be a test size.
    data_config = eval_data_config(model, settings.img_size)
    as_built = [size for size in top1_at if size > settings.img_size and size not in rebuilt]
    best = max(as_built, key=lambda size: (top1_at[size], -size), default=None)
    if best is not None and top1_at[best] >= top1:
        data_config['test_input_size'] = (3, best, best)
    results = {'top1': top1, **{f'top1_at_{size}': value for size, value in top1_at.items()},
               'architecture': architecture, 'model_kwargs': architecture_kwargs, 'data_config': data_config,
               'train_img_sizes': train_sizes, 'train_batch_sizes': batch_sizes}
    (out / 'results.json').write_text(json.dumps(results, indent=2))
    hub_dir = out / 'hub'
    start_from = 'its pretrained weights' if settings.pretrained else 'scratch'
    if settings.pretrained and ':' in settings.model:
        start_from = settings.model
    if settings.init_from:
        start_from = Path(settings.init_from).name
    publish(str(weights), architecture, 'aft-vision/digits-demo', out_dir=str(hub_dir), dry_run=True, force=True,
            label_names=classes, results_file=str(out / 'results.json'),
            datasets=[] if settings.data_dir else ['sklearn-digits'],
            training=f'{settings.epochs} epochs from {start_from} at {_sizes_text(train_sizes)} px (one size per step, '
                     f'batches of {_sizes_text(batch_sizes)}, {settings.train_size_schedule}), AdamW '
                     f'lr {settings.lr}, cosine, label smoothing 0.1 (aft_vision.train).',
            model_kwargs=architecture_kwargs)
    reloaded = timm.create_model(f'local-dir:{hub_dir}', pretrained=True).to(device)
    top1_reloaded = evaluate(reloaded, data_dir / 'val', settings.img_size)
    if top1_reloaded != top1:
        raise RuntimeError(f'reloaded model scores {top1_reloaded:.2f}%, the trained one {top1:.2f}%')
    # A client at another size rebuilds the folder's model for it (timm's img_size; AFT-conv's windows or patch
    # follow as its resize_mode says): the same figure as the job's own rebuild.
    largest = max(top1_at)
    resized = timm.create_model(f'local-dir:{hub_dir}', pretrained=True, img_size=largest).to(device)
    top1_reloaded_large = evaluate(resized, data_dir / 'val', largest)
    if top1_reloaded_large != top1_at[largest]:
        raise RuntimeError(f'{hub_dir} rebuilt for {largest} px scores {top1_reloaded_large:.2f}%, the trained model '
                           f'at that size {top1_at[largest]:.2f}%')
    # What every timm client does with the folder: the data config its pretrained_cfg gives (the train size), and
    # validate.py's (the test size where one is recorded).
    client_config = resolve_data_config({}, model=reloaded)
    top1_data_config = evaluate(reloaded, data_dir / 'val', data_config=client_config)
    if top1_data_config != top1:
        raise RuntimeError(f'timm\'s data config for {hub_dir} ({client_config}) gives {top1_data_config:.2f}%, the '
                           f'job {top1:.2f}%: the published pretrained_cfg does not say how the model was evaluated')
    test_config = resolve_data_config({}, model=reloaded, use_test_size=True)
    top1_test_config = top1_data_config if test_config == client_config else evaluate(  # no test size: same config
        reloaded, data_dir / 'val', data_config=test_config)
    expected = top1_at[best] if 'test_input_size' in data_config else top1
    if top1_test_config != expected:
        raise RuntimeError(f'timm\'s test-size data config for {hub_dir} ({test_config}) gives '
                           f'{top1_test_config:.2f}%, the job {expected:.2f}% at that size')
    try:
        plot_curves(history, top1_at, train_sizes, out / 'training_curve.png')
    except ImportError:
        print('matplotlib is not installed (pip install aft-vision[demo]): no training curve written')
    results.update({
        'model': settings.model, 'epochs': settings.epochs,
        'img_size': settings.img_size, 'eval_img_sizes': list(top1_at), 'top1_reloaded': top1_reloaded,
        'top1_reloaded_at': {str(largest): top1_reloaded_large}, 'train_size_schedule': settings.train_size_schedule,
        'rank_size_schedule_sha256': schedules,
        'top1_timm_data_config': top1_data_config, 'top1_timm_test_data_config': top1_test_config,
        'history': history, 'weights_sha256': sha256, 'world_size': world_size, 'rank_state_sha256': digests,
        'wall_seconds': round(time.perf_counter() - start, 1),
    })
    (out / 'results.json').write_text(json.dumps(results, indent=2))
    print()
    for size, value in top1_at.items():
        print(f'top-1 at {size:3d} px: {value:6.2f}%  ({value - top1:+.2f} against {settings.img_size} px)')
    others = [size for size in top1_at if size != settings.img_size]
    print(f'\n{settings.model} on {data_dir}, trained at {_sizes_text(train_sizes)} px: top-1 {top1:.2f}% at '
          f'{settings.img_size}px; {"/".join(f"{top1_at[size]:.2f}" for size in others)}% at {_sizes_text(others)}px; '
          f'reloaded from {hub_dir}: {top1_reloaded:.2f}% (identical; at {largest}px: {top1_reloaded_large:.2f}%), '
          f'with timm\'s data config {top1_data_config:.2f}% ({client_config["input_size"][-1]}px, crop_pct '
          f'{client_config["crop_pct"]}; test size: {top1_test_config:.2f}%)')
    if world_size > 1:
        agree = 'identical on every rank' if len(set(digests)) == 1 else 'DIFFER between ranks'
        same_sizes = 'the same' if len(set(schedules)) == 1 else 'DIFFERENT'
        print(f'{world_size} processes: final weights {agree}; {same_sizes} size at every step on every rank')
    print(f'wrote {weights} (sha256 {sha256[:16]}...), {hub_dir}/, {out / "results.json"}, '
          f'{out / "training_curve.png"}; {results["wall_seconds"]:.0f} s')
    return results
