"""AFT-conv's windows following each step's size in timm's own ``train.py``, as ``aft-vision train`` runs them.

    python train.py DATA --device-modules aft_vision.timm_train --model aft_conv_small --train-img-sizes 160 224 288 ...

Importing this module registers the AFT models (it imports aft_vision) and makes timm's classification task run an
AFT-conv model built with ``resize_mode='window'`` (the default) at each step with its windows resampled for the
step's size (``aft_vision.models.aft_conv.forward_at_size``). ``aft_vision.timm_sparsity`` does the same and adds
Eq. 9's term.
"""
from .tasks.regularizers import add_to_timm_tasks

add_to_timm_tasks(0.0, follow_windows=True)
