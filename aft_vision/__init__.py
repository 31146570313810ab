"""aft_vision: the Attention Free Transformer (Zhai et al. 2021, arXiv 2105.14103) as timm models.

``import aft_vision`` registers every AFT model with timm; the operators live in ``aft_vision.layers``.
"""
from .version import __version__
from . import layers
from . import models
