"""AFT models registered with timm: importing this package registers every ``aft_*`` model.

* ``aft_vit``: AFT-full and AFT-simple vision transformers (class token, position embedding, token output).
* ``aft_conv``: AFT-conv, fully convolutional (no class token or position embedding, global average pooling).
* ``_base``: what both share (``Block``, ``AFTTransformerBase``: the trunk and the timm interface built on it).
"""
from ._base import AFTTransformerBase, Block
from .aft_vit import *
from .aft_conv import *


def create_aft_model(name: str, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with a clear error for unknown names, naming the closest registered ones.

    Raises:
        ValueError: ``name`` (before any ``.tag``) is not a registered model.
    """
    import difflib

    import timm

    architecture = name.split('.')[0]
    if ':' not in name and not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models('aft_*'), n=3, cutoff=0.5)
        known = ", ".join(timm.list_models('aft_*'))
        hint = f'; did you mean {", ".join(close)}?' if close else f'; AFT models: {known}'
        raise ValueError(f'unknown model {name!r}{hint}')
    return timm.create_model(name, pretrained=pretrained, **kwargs)
