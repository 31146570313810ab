"""AFT models registered with timm: importing this package registers every ``aft_*`` model. May import ``layers``
and ``checkpoints``.

* ``aft_vit``: AFT-full and AFT-simple vision transformers (class token, position embedding, token output).
* ``aft_conv``: AFT-conv, fully convolutional (no class token or position embedding, global average pooling).
* ``_base``: what both share (``Block``, ``AFTTransformerBase``: the trunk and the timm interface built on it).
* ``pyramid``: ViTDet's simple feature pyramid on an AFT-conv backbone (``SimpleFeaturePyramid``), for dense heads.
"""
from ._base import AFTTransformerBase, Block
from .aft_vit import *
from .aft_conv import *
from .pyramid import SimpleFeaturePyramid
