"""Scenes for the dense job from scikit-learn's digits (no download): a few digits pasted on a dark canvas without
overlap, labelled per pixel (0 background, 1 + the digit on its ink) and boxed; training and held-out scenes draw
from disjoint digit images (the main job's stratified 80 / 20 split)."""
from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torchvision.ops import masks_to_boxes

from .training import split_digits

__all__ = ['Scenes', 'NUM_CLASSES', 'digit_split', 'make_scenes']

NUM_CLASSES = 11  # background and the ten digits
INK = 0.25  # a pasted digit's pixels above this share of full intensity are its ink (labelled, inside its box)


class Scenes(NamedTuple):
    """A batch of scenes."""
    images: torch.Tensor  # (N, 3, S, S) in [0, 1]
    masks: torch.Tensor  # (N, S, S) class indices
    boxes: List[torch.Tensor]  # per scene (k, 4): (x0, y0, x1, y1) pixel edges
    labels: List[torch.Tensor]  # per scene (k,) in 1..10


def digit_split(val_fraction: float = 0.2, seed: int = 0) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's digits as (images (n, 8, 8) in [0, 1], targets (n,)) per split of ``split_digits``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32) / 16  # (n, 8, 8), values 0..16
    targets = torch.tensor(data.target)
    return {split: (images[idx], targets[idx]) for split, idx in split_digits(targets, val_fraction, seed).items()}


def make_scenes(digits: Tuple[torch.Tensor, torch.Tensor], num_scenes: int, size: int,
                digit_sizes: Tuple[int, int] = (16, 28), digits_per_area: float = 3 / 64 ** 2, seed: int = 0) -> Scenes:
    """``num_scenes`` noisy scenes of ``size`` px from ``digits`` (images (n, 8, 8) in [0, 1], classes (n,)): digits of
    ``digit_sizes`` px, ``digits_per_area`` tried per pixel (one without a free place in 20 tries left out)."""
    images, targets = digits
    gen = torch.Generator().manual_seed(seed)
    canvas = torch.zeros(num_scenes, size, size)
    masks = torch.zeros(num_scenes, size, size, dtype=torch.long)
    all_boxes, all_labels = [], []
    per_scene = max(1, round(digits_per_area * size * size))
    for n in range(num_scenes):
        taken = torch.zeros(size, size, dtype=torch.bool)
        boxes, labels = [], []
        for _ in range(per_scene):
            side = int(torch.randint(digit_sizes[0], digit_sizes[1] + 1, (1,), generator=gen))
            if side > size:
                continue
            for _ in range(20):
                y, x = (int(v) for v in torch.randint(0, size - side + 1, (2,), generator=gen))
                if not taken[max(0, y - 1):y + side + 1, max(0, x - 1):x + side + 1].any():  # a pixel apart
                    break
            else:
                continue
            i = int(torch.randint(len(images), (1,), generator=gen))
            digit = F.interpolate(images[i][None, None], size=(side, side), mode='bilinear', align_corners=False)
            digit = digit[0, 0].clamp(0, 1)  # (side, side)
            ink = digit > INK
            if not ink.any():
                continue
            canvas[n, y:y + side, x:x + side] = digit
            masks[n, y:y + side, x:x + side][ink] = int(targets[i]) + 1
            taken[y:y + side, x:x + side] = True
            boxes.append(masks_to_boxes(ink[None])[0] + torch.tensor([x, y, x + 1, y + 1]))  # ink's pixel edges
            labels.append(int(targets[i]) + 1)
        all_boxes.append(torch.stack(boxes) if boxes else torch.zeros(0, 4))
        all_labels.append(torch.tensor(labels, dtype=torch.long))
    background = 0.3 * torch.rand(num_scenes, 1, 1, generator=gen)
    noisy = background + (1 - background) * canvas + 0.05 * torch.randn(canvas.shape, generator=gen)
    return Scenes(noisy.clamp(0, 1)[:, None].expand(-1, 3, -1, -1).contiguous(), masks, all_boxes, all_labels)
