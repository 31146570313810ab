"""aft_vision: the Attention Free Transformer (Zhai et al. 2021, arXiv 2105.14103) as timm models.

``import aft_vision`` registers every AFT model with timm. One folder per part; a part imports only the floors below
it (``tests/test_imports.py``): ``version``, ``images`` (the one image reader) and ``plots``; ``layers`` (the
operators) and ``checkpoints`` (weight files, the DeiT transfer); ``models``; ``hub`` (publishing, the one model
loader) and ``deploy`` (ONNX, OpenVINO, INT8); ``bench`` and ``tasks`` (the jobs, plain Python settings); ``cli``
(``aft-vision``); the entry points ``python -m aft_vision.run`` (timm's scripts; ``--aft-sparsity`` adds Eq. 9 to
``train.py``'s loss) and ``python -m aft_vision.train``.
"""
import os as _os
import sys as _sys

from .version import __version__

try:
    from . import layers
    from . import models
except KeyboardInterrupt:  # Ctrl-C while ``aft-vision`` starts (torch and timm load for seconds): one line, as later
    if _os.path.basename(_sys.argv[0] if _sys.argv else '') not in ('aft-vision', '-m'):  # -m: python -m aft_vision.*
        raise  # any other program that imports aft_vision handles its own interrupts
    print('aft-vision: stopped by SIGINT while starting: nothing was written', file=_sys.stderr)
    raise SystemExit(130) from None
