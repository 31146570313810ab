"""timm's own ``train.py`` with the AFT models: ``--device-modules aft_vision.timm_train`` (the one module of hooks;
docs/training.md shows the runs).

Importing this module registers the AFT models (it imports aft_vision) and calls ``add_to_timm_tasks``: timm's
classification task runs an AFT-conv model at each step's size with its windows resampled for it (``forward_at_size``)
and, as train.py has no loss hook, adds ``AFT_SPARSITY_WEIGHT`` (default 0; ``aft_vision.timm_sparsity``: the paper's
0.001) times Eq. 9's ``position_bias_entropy(model)`` to the training loss. train.py's validation loss is plain.
"""
import os
from typing import Callable, Optional

import torch

from .models.aft_conv import forward_at_size
from .tasks.regularizers import position_bias_entropy

__all__ = ['add_to_timm_tasks']

_timm_forward: Optional[Callable] = None  # ClassificationTask.forward before add_to_timm_tasks replaced it


def add_to_timm_tasks(weight: Optional[float] = 0.0) -> None:
    """Make every ``timm.task.ClassificationTask`` (what timm's ``train.py`` builds) run ``forward_at_size`` (AFT-conv's
    windows following each step's size) and add ``weight * position_bias_entropy(model)`` to its loss. A second call
    replaces it; ``weight=None`` restores timm's ``forward``. Distillation tasks are unchanged."""
    global _timm_forward
    from timm.task import ClassificationTask

    _timm_forward = _timm_forward or ClassificationTask.forward
    if weight is None:
        ClassificationTask.forward = _timm_forward
        return

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        output = forward_at_size(self.trainable_module, input)
        loss = self.criterion(output, target)
        if weight:
            loss = loss + weight * position_bias_entropy(self.trainable_module)
        return {'loss': loss, 'output': output}

    forward.__doc__ = (f'{_timm_forward.__doc__ or ""}\n\n(aft_vision: AFT-conv windows follow the size: True; the '
                       f'loss includes {weight} x the Eq. 9 entropy.)')
    ClassificationTask.forward = forward


add_to_timm_tasks(float(os.environ.get('AFT_SPARSITY_WEIGHT', '0')))
