"""The sparsity regulariser of Eq. 9, ``sum_i entropy(softmax(w_i))`` over AFT-conv heads (weight 0.001 in the
paper), and its hook into timm's ``train.py``, which has no loss hook (docs/training.md, "The sparsity regulariser")."""
from typing import Callable, Optional

import torch
from torch import nn

from ..layers import AFTConv2d
from ..models.aft_conv import forward_at_size

__all__ = ['position_bias_entropy', 'add_to_timm_tasks']


def position_bias_entropy(model: nn.Module) -> torch.Tensor:
    """Sum over every AFTConv2d layer and head of the entropy of ``softmax(w)`` over its bias (Eq. 8's ``w``; a
    one-hot layer's logits); 0 without AFT-conv layers. Works on wrapped models (DDP, ``torch.compile``)."""
    entropies = []
    for module in model.modules():
        if isinstance(module, AFTConv2d):
            logits = module.dense_bias().flatten(1).float()  # (h, s*s); the logits of a one-hot layer
            entropies.append(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum())
    return sum(entropies) if entropies else torch.zeros((), device=next(model.parameters()).device)


_timm_forward: Optional[Callable] = None  # ClassificationTask.forward before add_to_timm_tasks replaced it


def add_to_timm_tasks(weight: float = 0.001, follow_windows: bool = True) -> None:
    """Make every ``timm.task.ClassificationTask`` (what timm's ``train.py`` builds) run ``forward_at_size`` (AFT-conv's
    windows following each step's size) and add ``weight * position_bias_entropy(model)`` to its loss. A second call
    replaces both; ``weight=0, follow_windows=False`` restores timm's ``forward``. Distillation tasks are unchanged.
    """
    global _timm_forward
    from timm.task import ClassificationTask

    if _timm_forward is None:
        _timm_forward = ClassificationTask.forward
    if not weight and not follow_windows:
        ClassificationTask.forward = _timm_forward
        return
    plain = _timm_forward

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        if follow_windows:
            output = forward_at_size(self.trainable_module, input)
            result = {'loss': self.criterion(output, target), 'output': output}
        else:
            result = plain(self, input, target)
        if weight:
            result['loss'] = result['loss'] + weight * position_bias_entropy(self.trainable_module)
        return result

    forward.__doc__ = (f'{plain.__doc__ or ""}\n\n(aft_vision: AFT-conv windows follow the size: {follow_windows}; '
                       f'the loss includes {weight} x the Eq. 9 entropy.)')
    ClassificationTask.forward = forward
