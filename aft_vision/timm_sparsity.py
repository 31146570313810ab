"""``--device-modules aft_vision.timm_sparsity``: ``aft_vision.timm_train`` with ``AFT_SPARSITY_WEIGHT`` defaulting to
the paper's 0.001 (Eq. 9's regulariser in timm's ``train.py``)."""
import os

from .timm_train import add_to_timm_tasks

add_to_timm_tasks(float(os.environ.get('AFT_SPARSITY_WEIGHT', '0.001')))
