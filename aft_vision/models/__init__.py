"""AFT models registered with timm: importing this package registers every ``aft_*`` model. May import ``layers``
and ``checkpoints``.

* ``aft_vit``: AFT-full and AFT-simple: timm's ``VisionTransformer`` with an AFT ``attn_layer``.
* ``aft_conv``: AFT-conv: timm's ``VisionTransformer`` on a (B, H, W, C) map (no class token or position embedding,
  global average pooling).
* ``_base``: the checks, cfgs and checkpoint adapter both families use.
* ``fit_checkpoint`` (here): which weights a model starts from, decided once; ``count_macs``: its multiply-adds.
* ``pyramid``: ViTDet's simple feature pyramid on an AFT-conv backbone (``SimpleFeaturePyramid``), for dense heads.
"""
from typing import Callable, Dict, Mapping, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..layers import AFTConv2d
from ..checkpoints.transfer import unwrap_state_dict
from ._base import DEPRECATED_TAGS, adapt_vit_checkpoint
from .aft_vit import *
from .aft_conv import *
from .aft_conv import AFTConvTransformer, checkpoint_filter_fn as _aft_conv_filter
from .aft_vit import AFTVisionTransformer, checkpoint_filter_fn as _aft_vit_filter
from .pyramid import SimpleFeaturePyramid

_FAMILY_FILTERS = ((AFTConvTransformer, _aft_conv_filter), (AFTVisionTransformer, _aft_vit_filter))


def fit_checkpoint(checkpoint: Mapping, model: torch.nn.Module, log: Optional[Callable[[str], None]] = None
                   ) -> Dict[str, torch.Tensor]:
    """The one decision of which weights ``model`` starts from (``--init-from`` and its check before training): the
    family's checkpoint filter, the one timm's pretrained loading calls (the checkpoint's weights as timm takes them, a
    ViT's mapped by the transfer, its report to ``log``; windows, patch, position rows resampled to the model's), or
    for another model the weights as timm takes them. Load it strictly."""
    family_filter = next((fn for family, fn in _FAMILY_FILTERS if isinstance(model, family)), None)
    return unwrap_state_dict(checkpoint) if family_filter is None else family_filter(checkpoint, model, log=log)


def count_macs(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Multiply-adds of ``model`` on ``images`` by torch's flop counter, with AFT-conv counted as a convolution and
    timm's attention as explicit products for the count (the counter has no formula for the CPU's fused attention
    kernel or for AFT's fused operator: it would leave them out). The model is left as it was."""
    layers = [(m, 'fused_attn', False) for m in model.modules() if hasattr(m, 'fused_attn')]
    layers += [(m, 'method', 'conv') for m in model.modules() if isinstance(m, AFTConv2d)]
    kept = [getattr(m, name) for m, name, _ in layers]
    counter = FlopCounterMode(display=False)
    try:
        for module, name, value in layers:
            setattr(module, name, value)
        with torch.no_grad(), counter:
            model(images)
    finally:
        for (module, name, _), value in zip(layers, kept):
            setattr(module, name, value)
    return counter.get_total_flops() // 2
