"""The dense job (``aft-vision train --task segment``): AFT-conv in segmentation_models_pytorch's DPT, trained from
scratch on digit scenes (``scenes``), scored by mean IoU over 11 classes at ``img_size`` and at a larger
``eval_img_size`` (docs/dense.md, "The dense job")."""
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List

import torch
import torch.nn.functional as F

from ..checkpoints.files import output_dir, save_weights
from ..hub import create_aft_model
from ..plots import save_figure
from .scenes import NUM_CLASSES, Scenes, digit_split, make_scenes
from .training import check_input_size, fit, keeps_random_state, launched_world, plot_history

__all__ = ['DPT_SIZE_MULTIPLE', 'SegmentSettings', 'build_dpt', 'predict', 'confusion', 'mean_iou', 'run']

DPT_SIZE_MULTIPLE = 32  # DPT adds its features at 1/4 ... 1/32 of the image, each upsampled 2x, to the next
DPT_DECODER = dict(decoder_intermediate_channels=(32, 64, 64, 64), decoder_fusion_channels=64)  # a small decoder
MEAN, STD = 0.5, 0.5  # scenes are in [0, 1]; the model sees (x - 0.5) / 0.5


@dataclass
class SegmentSettings:
    """What ``run`` trains and where it writes (``aft-vision train --task segment``'s options)."""
    model: str = 'aft_conv_test'  # an AFT-conv model (a token map without class token)
    model_kwargs: Dict = field(default_factory=dict)
    epochs: int = 10
    img_size: int = 64  # training and evaluation resolution, a multiple of 32
    eval_img_size: int = 96  # the larger evaluation resolution, a multiple of 32
    batch_size: int = 32
    lr: float = 2e-3
    scenes: int = 1024  # training scenes; a quarter as many held out at each size
    seed: int = 0
    out_dir: str = 'outputs/segment'
    device: str = 'cpu'
    force: bool = False  # write into an out_dir that holds something (its files of the same names replaced)


def build_dpt(model_name: str, model_kwargs: Dict, classes: int = NUM_CLASSES) -> torch.nn.Module:
    """smp's DPT on ``tu-<model_name>`` (AFT-conv: no prefix tokens, so ``decoder_readout='ignore'``)."""
    import segmentation_models_pytorch as smp

    return smp.DPT(f'tu-{model_name}', encoder_weights=None, classes=classes, decoder_readout='ignore',
                   **DPT_DECODER, **model_kwargs)


@torch.no_grad()
def predict(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The class of every pixel of scene ``images`` (B, 3, S, S) in [0, 1]: (B, S, S) on the CPU, in eval mode."""
    model.eval()
    return model((images.to(next(model.parameters()).device) - MEAN) / STD).argmax(1).cpu()


def confusion(model: torch.nn.Module, scenes: Scenes, batch_size: int = 64) -> torch.Tensor:
    """(classes, classes) pixel counts, true class by row, predicted class by column."""
    counts = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.long)
    for i in range(0, len(scenes.images), batch_size):
        predicted = predict(model, scenes.images[i:i + batch_size])  # (B, S, S)
        counts += torch.bincount((scenes.masks[i:i + batch_size] * NUM_CLASSES + predicted).flatten(),
                                 minlength=NUM_CLASSES * NUM_CLASSES)
    return counts.view(NUM_CLASSES, NUM_CLASSES)


def mean_iou(counts: torch.Tensor) -> float:
    """Mean over the classes present (in the labels or the predictions) of intersection over union."""
    intersection = counts.diag().double()
    union = counts.sum(0) + counts.sum(1) - counts.diag()
    return (intersection[union > 0] / union[union > 0]).mean().item()


def _check_model_and_sizes(settings: SegmentSettings) -> None:
    """An AFT-conv model and sizes DPT and the model take, on a meta-device copy, before anything is built."""
    import segmentation_models_pytorch  # noqa: F401 (missing: the command line names aft-vision[dense])
    if launched_world()[2] > 1:
        raise RuntimeError('--task segment runs in one process: start it without torchrun')
    probe = create_aft_model(settings.model, device='meta', **settings.model_kwargs)
    if getattr(probe, 'output_fmt', None) != 'NHWC':
        raise ValueError(f'--model {settings.model}: --task segment needs an AFT-conv model (a token map without class '
                         f'token), e.g. aft_conv_test')
    for option, size in (('--img-size', settings.img_size), ('--eval-img-size', settings.eval_img_size)):
        try:
            check_input_size(probe, size)
        except ValueError as error:
            raise ValueError(f'{option} {size}: {error}') from None
        if size % DPT_SIZE_MULTIPLE:
            raise ValueError(f'{option} {size}: DPT needs image sides that are multiples of {DPT_SIZE_MULTIPLE}')


@keeps_random_state
def train(settings: SegmentSettings, data: Dict[str, Scenes], device: torch.device) -> tuple:
    """Train DPT on ``data['train']``; returns the model and the per-epoch history (loss, held-out mIoU)."""
    torch.manual_seed(settings.seed)
    model = build_dpt(settings.model, settings.model_kwargs).to(device)
    scenes, gen = data['train'], torch.Generator().manual_seed(settings.seed)

    def epoch_batches(epoch: int) -> Iterator[torch.Tensor]:  # indices into the scenes, a new order every epoch
        return torch.randperm(len(scenes.images), generator=gen).split(settings.batch_size)

    def loss_of(chosen: torch.Tensor) -> torch.Tensor:
        images = (scenes.images[chosen].to(device) - MEAN) / STD  # (B, 3, S, S)
        return F.cross_entropy(model(images), scenes.masks[chosen].to(device))  # logits (B, classes, S, S)

    history = []
    steps = math.ceil(len(scenes.images) / settings.batch_size)
    for epoch, loss in fit(model, settings.lr, settings.epochs, steps, epoch_batches, loss_of):
        history.append({'epoch': epoch, 'loss': loss, 'val_miou': mean_iou(confusion(model, data['val']))})
        print(f'epoch {epoch:2d}  loss {loss:.4f}  held-out mIoU {100 * history[-1]["val_miou"]:.1f}%')
    return model, history


def plot(history: List[Dict], model: torch.nn.Module, scenes: Scenes, path: Path) -> None:
    """Loss and held-out mIoU per epoch, and one held-out scene at the larger size: image, labels, prediction."""
    fig, axes = plot_history(history, 'val_miou', 'held-out mIoU (%)', 'Held-out mIoU (training size)', 5, 17, 100)
    size = scenes.images.shape[-1]
    panels = ((scenes.images[0, 0], 'gray', f'held-out scene, {size} px'), (scenes.masks[0], 'tab20', 'labels'),
              (predict(model, scenes.images[:1])[0], 'tab20', 'prediction'))
    for ax, (image, cmap, title) in zip(axes[2:], panels):
        ax.imshow(image, cmap=cmap, vmin=0, vmax=1 if cmap == 'gray' else NUM_CLASSES - 1, interpolation='nearest')
        ax.set(title=title, xticks=[], yticks=[])
    save_figure(fig, path, dpi=100)


def run(settings: SegmentSettings) -> Dict:
    """The whole job in its out_dir (``output_dir``: left as it was if the job fails); returns ``results.json``'s."""
    start = time.perf_counter()
    with output_dir(settings.out_dir, settings.force, ('model.safetensors', 'results.json', 'training_curve.png')):
        _check_model_and_sizes(settings)
        digits = digit_split(seed=settings.seed)
        val_scenes = max(1, settings.scenes // 4)
        data = {'train': make_scenes(digits['train'], settings.scenes, settings.img_size, seed=settings.seed),
                'val': make_scenes(digits['val'], val_scenes, settings.img_size, seed=settings.seed + 1),
                'val_large': make_scenes(digits['val'], val_scenes, settings.eval_img_size, seed=settings.seed + 2)}
        print(f'{settings.scenes} training scenes at {settings.img_size} px; {val_scenes} held-out scenes at '
              f'{settings.img_size} and {settings.eval_img_size} px ({sum(len(b) for b in data["val"].boxes)} and '
              f'{sum(len(b) for b in data["val_large"].boxes)} digits)')
        model, history = train(settings, data, torch.device(settings.device))
        counts, counts_large = confusion(model, data['val']), confusion(model, data['val_large'])
        out = Path(settings.out_dir)
        sha256 = save_weights(model.state_dict(), out / 'model.safetensors', force=True)
        results = {
            'task': 'segment', 'model': settings.model, 'model_kwargs': dict(settings.model_kwargs),
            'decoder': 'smp.DPT', 'decoder_kwargs': DPT_DECODER,
            'miou': mean_iou(counts), f'miou_at_{settings.eval_img_size}': mean_iou(counts_large),
            'confusion': counts.tolist(), f'confusion_at_{settings.eval_img_size}': counts_large.tolist(),
            'img_size': settings.img_size, 'eval_img_size': settings.eval_img_size, 'epochs': settings.epochs,
            'train_scenes': settings.scenes, 'val_scenes': val_scenes, 'batch_size': settings.batch_size,
            'lr': settings.lr, 'seed': settings.seed, 'threads': torch.get_num_threads(), 'history': history,
            'weights_sha256': sha256, 'wall_seconds': round(time.perf_counter() - start, 1)}
        (out / 'results.json').write_text(json.dumps(results, indent=2))
        try:
            plot(history, model, data['val_large'], out / 'training_curve.png')
        except ImportError:
            print('matplotlib is not installed (pip install aft-vision[demo]): no training curve written')
        print(f'\n{settings.model} + DPT on digit scenes: held-out mIoU {100 * results["miou"]:.1f}% at '
              f'{settings.img_size} px, {100 * results[f"miou_at_{settings.eval_img_size}"]:.1f}% at '
              f'{settings.eval_img_size} px (never trained at that size)\nwrote {out / "model.safetensors"}, '
              f'{out / "results.json"}, {out / "training_curve.png"}; {results["wall_seconds"]:.0f} s')
        return results
