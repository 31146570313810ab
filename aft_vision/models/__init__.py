"""AFT models registered with timm: importing this package registers every ``aft_*`` model.

* ``aft_vit``: AFT-full and AFT-simple vision transformers (class token, position embedding, token output).
* ``aft_conv``: AFT-conv, fully convolutional (no class token or position embedding, global average pooling).
"""
from .aft_vit import *
from .aft_conv import *
