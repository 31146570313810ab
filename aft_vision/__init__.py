"""aft_vision: the Attention Free Transformer (Zhai et al. 2021, arXiv 2105.14103) as timm models.

``import aft_vision`` registers every AFT model with timm. The package is laid out by job, one folder per part; each
part imports only the parts on the floors below it (``tests/test_imports.py`` holds the rule):

* ``layers`` (the AFT operators) and ``checkpoints`` (weight files, the DeiT / ViT transfer): the ground floor.
* ``models``: the timm-registered families and the feature pyramid for dense heads.
* ``hub`` (publishing and loading back) and ``deploy`` (ONNX, OpenVINO, INT8).
* ``bench`` (the benchmarks) and ``tasks`` (the jobs: classify, segment, study, visualize), each run with plain Python
  settings.
* ``cli``: the ``aft-vision`` command line, which turns options into those settings.
* Entry points named by path: ``python -m aft_vision.run`` (timm's scripts), ``python -m aft_vision.train``, and
  ``aft_vision.timm_sparsity`` (timm ``train.py``'s ``--device-modules`` hook).
"""
from .version import __version__
from . import layers
from . import models
