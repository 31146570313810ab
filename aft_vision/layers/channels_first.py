"""``nn.Linear`` and ``nn.LayerNorm`` on channel-first (B, C, H, W) maps: the channel-first graph's layers
(``models/aft_conv.py: export_layout``), no transposes around the depthwise convolutions for OpenVINO."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ['linear_nchw', 'layer_norm_nchw']


def linear_nchw(x: torch.Tensor, linear: nn.Linear, rows: Optional[slice] = None) -> torch.Tensor:
    """``linear`` on the channels of x (B, C, H, W) as a 1 x 1 convolution: (B, out, H, W); ``rows`` takes a slice
    of its outputs (one product per slice: no split of a stacked output)."""
    weight, bias = linear.weight, linear.bias
    if rows is not None:
        weight, bias = weight[rows], None if bias is None else bias[rows]
    return F.conv2d(x, weight[:, :, None, None], bias)  # (B, out, H, W)


def layer_norm_nchw(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm`` (a LayerNorm over the C channels) on x (B, C, H, W), by mean and variance over dim 1."""
    if tuple(norm.normalized_shape) != (x.shape[1],):
        raise ValueError(f'LayerNorm over {list(norm.normalized_shape)} cannot normalise the channels of '
                         f'{list(x.shape)} (B, C, H, W)')
    centred = x - x.mean(dim=1, keepdim=True)
    x = centred / torch.sqrt(centred.pow(2).mean(dim=1, keepdim=True) + norm.eps)  # (B, C, H, W)
    if norm.weight is not None:
        x = x * norm.weight.view(1, -1, 1, 1)
    if norm.bias is not None:
        x = x + norm.bias.view(1, -1, 1, 1)
    return x
