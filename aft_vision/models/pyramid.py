"""ViTDet's simple feature pyramid (`Exploring Plain Vision Transformer Backbones for Object Detection`,
https://arxiv.org/abs/2203.16527, Sec. 3; detectron2's ``SimpleFeaturePyramid``): AFT-conv keeps one map of one stride,
which FPN-style necks and torchvision's detectors cannot take; the levels (docs/dense.md) come from that map alone."""
from collections import OrderedDict
from typing import Dict, List, Sequence, Type

import torch
from torch import nn
import torch.nn.functional as F

from timm.layers import LayerNorm2d
from timm.models import FeatureInfo

__all__ = ['SimpleFeaturePyramid']

SCALE_FACTORS = (4.0, 2.0, 1.0, 0.5)  # the levels ViTDet builds, relative to the backbone map's resolution


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid on the last token map of a plain backbone; its own layers start as
    detectron2's (PyTorch's default initialisation, biases only where no norm follows), the backbone is left as it is.

    Args:
        backbone: An AFT-conv model (``num_classes=0``; its ``forward_features`` map is used) or a timm feature
            extractor (``features_only=True``; its last feature map).
        out_channels: Width of every level (ViTDet: 256).
        scale_factors: The levels from high to low resolution, distinct values of ``SCALE_FACTORS`` relative to the
            backbone's map (default all four: strides p/4, p/2, p, 2p).
        top_pool: Add a level 'pool' at twice the lowest level's stride (torchvision's ``LastLevelMaxPool``).
        norm_layer: Norm on NCHW maps (ViTDet: LayerNorm over channels).
        act_layer: Activation between the highest level's two transposed convolutions.
    """

    def __init__(self, backbone: nn.Module, out_channels: int = 256, scale_factors: Sequence[float] = SCALE_FACTORS,
                 top_pool: bool = False, norm_layer: Type[nn.Module] = LayerNorm2d,
                 act_layer: Type[nn.Module] = nn.GELU):
        super().__init__()
        self.is_feature_extractor = isinstance(getattr(backbone, 'feature_info', None), FeatureInfo)
        if self.is_feature_extractor:
            dim, stride = backbone.feature_info.channels()[-1], backbone.feature_info.reduction()[-1]
        elif getattr(backbone, 'output_fmt', None) == 'NHWC' and hasattr(backbone, 'forward_features'):
            dim, stride = backbone.num_features, backbone.feature_info[-1]['reduction']
        else:
            name = getattr(backbone, 'pretrained_cfg', {}).get('architecture', type(backbone).__name__)
            raise TypeError(
                f'{name} has no token map: its forward_features gives a sequence of tokens, not a (B, H, W, C) map. '
                f'Wrap an AFT-conv model (aft_conv_*), or a feature extractor (timm.create_model(..., '
                f'features_only=True)) whose features are maps')
        if not scale_factors or list(scale_factors) != [s for s in SCALE_FACTORS if s in scale_factors]:
            raise ValueError(f'scale_factors must be distinct values of {SCALE_FACTORS}, from high to low '
                             f'resolution; got {tuple(scale_factors)}')
        if scale_factors[0] == 4.0 and dim % 4 or scale_factors[0] == 2.0 and dim % 2:
            raise ValueError(f'the backbone width {dim} must be divisible by {int(scale_factors[0])} for a level at '
                             f'scale {scale_factors[0]} (its transposed convolutions halve the width each time)')
        self.backbone = backbone
        self.backbone_nhwc = self.is_feature_extractor and getattr(backbone, 'output_fmt', 'NCHW') == 'NHWC'
        self.out_channels = out_channels
        self.top_pool = top_pool

        self.stages = nn.ModuleList()
        reductions = []
        for scale in scale_factors:
            if scale == 4.0:  # (B, C, h, w) -> (B, C/4, 4h, 4w)
                layers = [nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2), norm_layer(dim // 2), act_layer(),
                          nn.ConvTranspose2d(dim // 2, dim // 4, kernel_size=2, stride=2)]
                level_dim = dim // 4
            elif scale == 2.0:  # (B, C, h, w) -> (B, C/2, 2h, 2w)
                layers, level_dim = [nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2)], dim // 2
            elif scale == 1.0:
                layers, level_dim = [], dim
            else:  # (B, C, h, w) -> (B, C, h/2, w/2)
                layers, level_dim = [nn.MaxPool2d(kernel_size=2, stride=2)], dim
            layers += [nn.Conv2d(level_dim, out_channels, kernel_size=1, bias=False), norm_layer(out_channels),
                       nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
                       norm_layer(out_channels)]
            self.stages.append(nn.Sequential(*layers))
            reductions.append(int(stride / scale))
        if top_pool:
            reductions.append(2 * reductions[-1])
        self.names: List[str] = [str(i) for i in range(len(scale_factors))] + (['pool'] if top_pool else [])
        self.feature_info = FeatureInfo(
            [dict(num_chs=out_channels, reduction=r, module=f'stages.{min(i, len(scale_factors) - 1)}')
             for i, r in enumerate(reductions)], out_indices=tuple(range(len(self.names))))

    def forward_backbone(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the backbone's last map (B, D, H/p, W/p)."""
        if self.is_feature_extractor:
            features = self.backbone(x)
            x = list(features.values())[-1] if isinstance(features, dict) else features[-1]
            return x.permute(0, 3, 1, 2) if self.backbone_nhwc else x  # (B, D, h, w)
        return self.backbone.forward_features(x).permute(0, 3, 1, 2)  # (B, h, w, D) -> (B, D, h, w)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Images (B, C, H, W) -> ordered dict of (B, out_channels, H / r, W / r) maps, r in ``feature_info``."""
        x = self.forward_backbone(x)  # (B, D, h, w)
        levels = [stage(x) for stage in self.stages]
        if self.top_pool:  # (B, C, h', w') -> (B, C, h'/2, w'/2), torchvision's LastLevelMaxPool
            levels.append(F.max_pool2d(levels[-1], kernel_size=1, stride=2))
        return OrderedDict(zip(self.names, levels))
