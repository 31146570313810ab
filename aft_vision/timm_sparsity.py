"""Eq. 9's sparsity regulariser in timm's own ``train.py``, which has no loss hook.

    python train.py --device-modules aft_vision.timm_sparsity --model aft_conv_small_11 ...
    AFT_SPARSITY_WEIGHT=0.01 python train.py --device-modules aft_vision.timm_sparsity ...

Importing this module registers the AFT models (it imports aft_vision) and makes timm's classification task add
``AFT_SPARSITY_WEIGHT`` (default 0.001, the paper's) times ``position_bias_entropy(model)`` to the training loss,
and run AFT-conv with its windows following each step's size, as ``aft_vision.timm_train`` does.
The validation loss train.py reports is its plain cross-entropy.
"""
import os

from .tasks.regularizers import add_to_timm_tasks

WEIGHT = float(os.environ.get('AFT_SPARSITY_WEIGHT', '0.001'))
add_to_timm_tasks(WEIGHT)
