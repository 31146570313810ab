"""AFT models registered with timm: importing this package registers every ``aft_*`` model. May import ``layers``
and ``checkpoints``.

* ``aft_vit``: AFT-full and AFT-simple vision transformers (class token, position embedding, token output).
* ``aft_conv``: AFT-conv, fully convolutional (no class token or position embedding, global average pooling).
* ``_base``: what both share (``Block``, ``AFTTransformerBase``: the trunk and the timm interface built on it).
* ``fit_checkpoint`` (here): which weights a model starts from, decided once.
* ``pyramid``: ViTDet's simple feature pyramid on an AFT-conv backbone (``SimpleFeaturePyramid``), for dense heads.
"""
from typing import Callable, Dict, Mapping, Optional

import torch

from ._base import AFTTransformerBase, Block, adapt_vit_checkpoint
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
    if family_filter is None:
        return adapt_vit_checkpoint(checkpoint, model, log)
    return family_filter(checkpoint, model, log=log)
