"""aft_vision: the Attention Free Transformer (Zhai et al. 2021, arXiv 2105.14103) as timm models.

``import aft_vision`` registers every AFT model with timm. One folder per part; a part imports only the floors below
it (``tests/test_imports.py``): ``version``, ``images`` (the one image reader) and ``plots``; ``layers`` (the
operators) and ``checkpoints`` (weight files, the DeiT transfer); ``models``; ``hub`` (publishing, the one model
loader) and ``deploy`` (ONNX, OpenVINO, INT8); ``bench`` and ``tasks`` (the jobs, plain Python settings); ``cli``
(``aft-vision``); the entry points ``python -m aft_vision.run`` (timm's scripts; ``--aft-sparsity`` adds Eq. 9 to
``train.py``'s loss) and ``python -m aft_vision.train``.
"""
from .version import __version__

from . import layers
from . import models
